//! The program's orderings, seen so that a consumer without expseg reads what the producer
//! ordered before them: after a device, stream or event synchronize, and before a record of
//! an event it shared with another process, expseg copies its mirrors again
//! (`api::ipc::mirror`, `EXPSEG_IPC_MIRROR_SYNC`); and the sharing calls no other hook serves
//! (a descriptor import or export, as NCCL's, noted for `expseg pause`: `api::sharing`; a
//! dma-buf of a range, whose memory then never moves or pauses: `api::range_exported`). The
//! driver's call is made in any case and its answer stands; expseg's part is inside the
//! re-entrancy guard and the panic boundary.
//!
//! Exported under the driver's names (programs linked against `libcuda`), and handed out by
//! the lookups (`cuGetProcAddress`, the runtime's entry point API: runtimes, static ones too,
//! fetch their driver functions there). A lookup's answer may be any variant of the function
//! (`_ptsz`, another version), so it is kept in a slot of its own and handed out as that
//! slot's forwarder; a function met when every slot is taken is handed out unchanged.

use super::guard::around_real;
use crate::api as mirror;
use crate::real::next_driver;
use libc::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Variants one function may come in through the lookups.
pub(super) const SLOTS: usize = 4;

/// The real functions handed out through one function's slots (0: free).
pub(super) struct Slots([AtomicUsize; SLOTS]);

impl Slots {
    pub(super) const fn new() -> Slots {
        Slots([const { AtomicUsize::new(0) }; SLOTS])
    }

    /// The slot holding `f`: the one it is in already, or a free one it takes now.
    pub(super) fn claim(&self, f: usize) -> Option<usize> {
        for (i, s) in self.0.iter().enumerate() {
            match s.compare_exchange(0, f, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(i),
                Err(cur) if cur == f => return Some(i),
                Err(_) => {}
            }
        }
        None
    }

    pub(super) fn get(&self, i: usize) -> usize {
        self.0[i].load(Ordering::Acquire)
    }
}

static CTX_SYNC: Slots = Slots::new();
static STREAM_SYNC: Slots = Slots::new();
static EVENT_SYNC: Slots = Slots::new();
static RECORD: Slots = Slots::new();
static RECORD_FLAGS: Slots = Slots::new();
static IPC_EVENT: Slots = Slots::new();
static IMPORT: Slots = Slots::new();
static EXPORT: Slots = Slots::new();
static RANGE_HANDLE: Slots = Slots::new();

type Fn0 = unsafe extern "C" fn() -> u32;
type Fn1 = unsafe extern "C" fn(usize) -> u32;
type Fn2 = unsafe extern "C" fn(usize, usize) -> u32;
type Fn3 = unsafe extern "C" fn(usize, usize, u32) -> u32;
type FnIpc = unsafe extern "C" fn(*mut c_void, usize) -> u32;
type FnImport = unsafe extern "C" fn(*mut u64, *mut c_void, u32) -> u32;
type FnExport = unsafe extern "C" fn(*mut c_void, u64, u32, u64) -> u32;
type FnRangeHandle = unsafe extern "C" fn(*mut c_void, u64, usize, u32, u64) -> u32;

/// After a synchronize that succeeded: the mirrors are copied again.
fn synchronized(name: &str, r: u32) {
    if r == 0 && mirror::sync_armed() {
        around_real(name, "the mirrors keep their last copy", mirror::after_sync);
    }
}

/// Before a record of `event` on `stream`: copies of the mirrors queued there first where the
/// event was shared with another process.
fn recording(name: &str, event: usize, stream: usize) {
    if mirror::ipc_events_seen() {
        around_real(name, "the event is recorded without copies", || {
            mirror::before_record(event, stream)
        });
    }
}

/// A shared event: remembered once its handle was made.
fn shared_event(name: &str, r: u32, event: usize) {
    if r == 0 {
        around_real(name, "the event is not remembered", || {
            mirror::note_ipc_event(event)
        });
    }
}

unsafe extern "C" fn ctx_sync_slot<const I: usize>() -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: Fn0 = unsafe { std::mem::transmute(CTX_SYNC.get(I)) };
    // SAFETY: the program's own arguments, passed on unchanged.
    let r = unsafe { f() };
    synchronized("cuCtxSynchronize", r);
    r
}

unsafe extern "C" fn stream_sync_slot<const I: usize>(s: usize) -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: Fn1 = unsafe { std::mem::transmute(STREAM_SYNC.get(I)) };
    // SAFETY: the program's own arguments, passed on unchanged.
    let r = unsafe { f(s) };
    synchronized("cuStreamSynchronize", r);
    r
}

unsafe extern "C" fn event_sync_slot<const I: usize>(e: usize) -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: Fn1 = unsafe { std::mem::transmute(EVENT_SYNC.get(I)) };
    // SAFETY: the program's own arguments, passed on unchanged.
    let r = unsafe { f(e) };
    synchronized("cuEventSynchronize", r);
    r
}

unsafe extern "C" fn record_slot<const I: usize>(e: usize, s: usize) -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: Fn2 = unsafe { std::mem::transmute(RECORD.get(I)) };
    recording("cuEventRecord", e, s);
    // SAFETY: the program's own arguments, passed on unchanged.
    unsafe { f(e, s) }
}

unsafe extern "C" fn record_flags_slot<const I: usize>(e: usize, s: usize, flags: u32) -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: Fn3 = unsafe { std::mem::transmute(RECORD_FLAGS.get(I)) };
    recording("cuEventRecordWithFlags", e, s);
    // SAFETY: the program's own arguments, passed on unchanged.
    unsafe { f(e, s, flags) }
}

unsafe extern "C" fn ipc_event_slot<const I: usize>(h: *mut c_void, e: usize) -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: FnIpc = unsafe { std::mem::transmute(IPC_EVENT.get(I)) };
    // SAFETY: the program's own arguments, passed on unchanged.
    let r = unsafe { f(h, e) };
    shared_event("cuIpcGetEventHandle", r, e);
    r
}

/// A descriptor import (`cuMemImportFromShareableHandle`, as NCCL's peers map each other's
/// buffers): this process maps another's memory (`api::sharing`), then the driver's call.
unsafe extern "C" fn import_slot<const I: usize>(h: *mut u64, os: *mut c_void, ty: u32) -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: FnImport = unsafe { std::mem::transmute(IMPORT.get(I)) };
    mirror::sharing::note_imported();
    // SAFETY: the program's own arguments, passed on unchanged.
    unsafe { f(h, os, ty) }
}

/// A descriptor export by a caller other than PyTorch's allocator (whose export is
/// `vmm_hooks`'): this process's memory may be mapped by another, then the driver's call.
unsafe extern "C" fn export_slot<const I: usize>(
    out: *mut c_void,
    h: u64,
    ty: u32,
    fl: u64,
) -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: FnExport = unsafe { std::mem::transmute(EXPORT.get(I)) };
    mirror::sharing::note_shared();
    // SAFETY: the program's own arguments, passed on unchanged.
    unsafe { f(out, h, ty, fl) }
}

/// A dma-buf of a range (`cuMemGetHandleForAddressRange`, NCCL's network plugins' RDMA
/// registration): the driver's call, then, where it made one, the range never moves or pauses
/// again (`api::range_exported`).
unsafe extern "C" fn range_handle_slot<const I: usize>(
    out: *mut c_void,
    ptr: u64,
    size: usize,
    ty: u32,
    fl: u64,
) -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: FnRangeHandle = unsafe { std::mem::transmute(RANGE_HANDLE.get(I)) };
    range_asked(ptr, size);
    // SAFETY: the program's own arguments, passed on unchanged.
    unsafe { f(out, ptr, size, ty, fl) }
}

/// A dma-buf of `[ptr, ptr+size)` is asked for: its memory never moves or pauses from now on,
/// marked before the driver makes it (after, a pause or a move could come in between; marked
/// for a call that then fails, it only stays put).
fn range_asked(ptr: u64, size: usize) {
    around_real(
        "cuMemGetHandleForAddressRange",
        "its memory may still move or pause",
        || mirror::range_exported(ptr, size as u64),
    );
}

/// The forwarders of one function's slots, in slot order (`hooks::streams` uses it too).
macro_rules! slot_fns {
    ($f:ident) => {
        [
            $f::<0> as *mut c_void,
            $f::<1> as *mut c_void,
            $f::<2> as *mut c_void,
            $f::<3> as *mut c_void,
        ]
    };
}

/// What a lookup of `name` hands out instead of `found` (the driver's answer): the forwarder
/// of the slot `found` is kept in. None: not one of these functions, or no slot left.
pub(super) fn for_lookup(name: &[u8], found: *mut c_void) -> Option<*mut c_void> {
    let (slots, fns) = match name {
        b"cuCtxSynchronize" => (&CTX_SYNC, slot_fns!(ctx_sync_slot)),
        b"cuStreamSynchronize" => (&STREAM_SYNC, slot_fns!(stream_sync_slot)),
        b"cuEventSynchronize" => (&EVENT_SYNC, slot_fns!(event_sync_slot)),
        b"cuEventRecord" => (&RECORD, slot_fns!(record_slot)),
        b"cuEventRecordWithFlags" => (&RECORD_FLAGS, slot_fns!(record_flags_slot)),
        b"cuIpcGetEventHandle" => (&IPC_EVENT, slot_fns!(ipc_event_slot)),
        _ => return None,
    };
    // A forwarder handed back to a lookup (a runtime that looks itself up) is not wrapped
    // twice.
    if fns.contains(&found) || found.is_null() {
        return None;
    }
    slots.claim(found as usize).map(|i| fns[i])
}

/// What a lookup of `name` hands out instead of `found` where no other hook of expseg's serves
/// the caller: the sharing calls, seen ([`import_slot`], [`export_slot`]).
pub(super) fn seen_for_lookup(name: &[u8], found: *mut c_void) -> Option<*mut c_void> {
    let (slots, fns) = match name {
        b"cuMemImportFromShareableHandle" => (&IMPORT, slot_fns!(import_slot)),
        b"cuMemExportToShareableHandle" => (&EXPORT, slot_fns!(export_slot)),
        b"cuMemGetHandleForAddressRange" => (&RANGE_HANDLE, slot_fns!(range_handle_slot)),
        _ => return None,
    };
    if fns.contains(&found) || found.is_null() {
        return None;
    }
    slots.claim(found as usize).map(|i| fns[i])
}

// The exported names, for programs linked against the driver: the driver's own function by
// its symbol name, then expseg's part.

/// # Safety
/// As the driver's `cuMemGetHandleForAddressRange`: `handle` points to room for the handle.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemGetHandleForAddressRange(
    handle: *mut c_void,
    ptr: u64,
    size: usize,
    kind: u32,
    flags: u64,
) -> u32 {
    range_asked(ptr, size);
    // SAFETY: the driver's own function, with the program's own arguments.
    unsafe { next_driver::cuMemGetHandleForAddressRange(handle, ptr, size, kind, flags) }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { next_driver::cuCtxSynchronize() };
    synchronized("cuCtxSynchronize", r);
    r
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(s: usize) -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { next_driver::cuStreamSynchronize(s) };
    synchronized("cuStreamSynchronize", r);
    r
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize_ptsz(s: usize) -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { next_driver::cuStreamSynchronize_ptsz(s) };
    synchronized("cuStreamSynchronize_ptsz", r);
    r
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(e: usize) -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { next_driver::cuEventSynchronize(e) };
    synchronized("cuEventSynchronize", r);
    r
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuEventRecord(e: usize, s: usize) -> u32 {
    recording("cuEventRecord", e, s);
    // SAFETY: the driver's own function, with the program's own arguments.
    unsafe { next_driver::cuEventRecord(e, s) }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuEventRecord_ptsz(e: usize, s: usize) -> u32 {
    recording("cuEventRecord_ptsz", e, s);
    // SAFETY: the driver's own function, with the program's own arguments.
    unsafe { next_driver::cuEventRecord_ptsz(e, s) }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuEventRecordWithFlags(e: usize, s: usize, flags: u32) -> u32 {
    recording("cuEventRecordWithFlags", e, s);
    // SAFETY: the driver's own function, with the program's own arguments.
    unsafe { next_driver::cuEventRecordWithFlags(e, s, flags) }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuEventRecordWithFlags_ptsz(e: usize, s: usize, flags: u32) -> u32 {
    recording("cuEventRecordWithFlags_ptsz", e, s);
    // SAFETY: the driver's own function, with the program's own arguments.
    unsafe { next_driver::cuEventRecordWithFlags_ptsz(e, s, flags) }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuIpcGetEventHandle(h: *mut c_void, e: usize) -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { next_driver::cuIpcGetEventHandle(h, e) };
    shared_event("cuIpcGetEventHandle", r, e);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_keeps_each_variant_in_a_slot_of_its_own_and_never_wraps_twice() {
        let (a, b) = (0x1000 as *mut c_void, 0x2000 as *mut c_void);
        let fa = for_lookup(b"cuEventSynchronize", a).unwrap();
        let fb = for_lookup(b"cuEventSynchronize", b).unwrap();
        assert_ne!(fa, fb);
        assert_eq!(
            for_lookup(b"cuEventSynchronize", a),
            Some(fa),
            "the same slot again"
        );
        assert_eq!(
            for_lookup(b"cuEventSynchronize", fa),
            None,
            "a forwarder stays"
        );
        for i in 0..SLOTS - 2 {
            assert!(for_lookup(b"cuEventSynchronize", (0x3000 + i) as *mut c_void).is_some());
        }
        assert_eq!(
            for_lookup(b"cuEventSynchronize", 0x9000 as *mut c_void),
            None,
            "no slot left: the driver's function is handed out"
        );
        assert_eq!(for_lookup(b"cuMemcpy", a), None);
    }
}
