//! The VMM entry points expseg hands to PyTorch's expandable segments.
//!
//! They are never exported as symbols: programs that link `libcuda` (vLLM's CuMemAllocator) or
//! look functions up with `cuGetProcAddress`/`dlsym` (the runtime itself, NCCL, Triton) keep
//! the driver's own. Only a lookup through the runtime's driver entry point API
//! (`cudaGetDriverEntryPoint[ByVersion]`) from PyTorch's `libc10_cuda` gets them
//! (`EXPSEG_COALESCE=torch`, the default), or from any caller (`all`). Each hook passes
//! everything that is not a coalesced page to the driver untouched.
//!
//! This module also applies PyTorch's allocator default at load time (`expandable_segments:True`
//! when the user set no allocator options), so `LD_PRELOAD=libexpseg.so` alone is enough.
#![allow(non_snake_case)]

use crate::api::imports;
use crate::api::vmm;
use crate::config::Coalesce;
use crate::gpu::PageProps;
use crate::real;
use libc::{c_int, c_void, size_t};
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicBool, Ordering};

/// `CUDA_ERROR_NOT_INITIALIZED`: no driver to pass to.
const NO_DRIVER: u32 = 3;
/// `CUDA_ERROR_UNKNOWN`: a panic caught at the boundary.
const UNKNOWN: u32 = 999;

/// A panic caught in the hook `name`: counted and logged once per panic, as the exported hooks
/// do.
/// `then` says what the call does instead.
fn caught(name: &str, then: &str) {
    crate::stats::GLOBAL.panics_caught.add(1);
    log::error!("{name}: internal error caught; {then}");
}

/// A panic caught where the call has no other answer: `CUDA_ERROR_UNKNOWN`.
fn unknown(name: &str) -> u32 {
    caught(name, "returning CUDA_ERROR_UNKNOWN");
    UNKNOWN
}

/// expseg's part of a hook around the driver's call, inside the one panic boundary
/// (`hooks::guard`): `None` after a panic, counted and logged, and the call goes on as the
/// driver's.
fn hook_contained<T>(name: &str, f: impl FnOnce() -> T) -> Option<T> {
    crate::hooks::guard::contained(name, "the driver's call goes on", f)
}

/// `CUmemAllocationProp`, read field by field (no enum may hold an unknown value).
#[repr(C)]
struct RawProp {
    type_: u32,
    handle_types: u32,
    loc_type: u32,
    loc_id: i32,
    win32: *mut c_void,
    compression: u8,
    rdma: u8,
    usage: u16,
    reserved: [u8; 4],
}

/// `CUmemAccessDesc`.
#[repr(C)]
struct RawAccess {
    loc_type: u32,
    loc_id: i32,
    flags: u32,
}

const PINNED: u32 = 1;
const LOCATION_DEVICE: u32 = 1;
const POSIX_FD: u32 = 1;

/// The page properties expseg can reproduce, or `None` (then the call passes through).
fn coalescable(p: &RawProp, flags: u64) -> Option<(i32, PageProps)> {
    let plain = flags == 0
        && p.type_ == PINNED
        && p.loc_type == LOCATION_DEVICE
        && (p.handle_types == 0 || p.handle_types == POSIX_FD)
        && p.win32.is_null()
        && p.compression == 0
        && p.usage == 0;
    plain.then_some((
        p.loc_id,
        PageProps {
            shareable: p.handle_types == POSIX_FD,
            rdma: p.rdma != 0,
            tag: 0,
        },
    ))
}

macro_rules! real_or {
    ($name:ident) => {
        match real::driver() {
            Ok(t) => t.$name,
            Err(_) => return NO_DRIVER,
        }
    };
}

/// # Safety
/// As CUDA's `cuMemCreate`: `h`, `prop` must be valid for what that call reads and writes
/// through them (or null where CUDA allows null).
pub unsafe extern "C" fn cuMemCreate(
    h: *mut u64,
    size: size_t,
    prop: *const c_void,
    flags: u64,
) -> u32 {
    let f = real_or!(cuMemCreate);
    // SAFETY: the driver's own function, with the program's own arguments.
    let pass = || unsafe { f(h, size, prop.cast(), flags) };
    if h.is_null() || prop.is_null() {
        return pass();
    }
    // SAFETY: CUDA's `CUmemAllocationProp`, which `RawProp` lays out (not null: checked).
    let Some((dev, props)) = coalescable(unsafe { &*(prop as *const RawProp) }, flags) else {
        return pass();
    };
    let r = catch_unwind(|| {
        if crate::api::config().test_panic("cuMemCreate") {
            panic!("EXPSEG_TEST_PANIC=cuMemCreate");
        }
        crate::api::serve_reclaims();
        vmm::create(dev, size as u64, props)
    });
    match r {
        Ok(Some(Ok(vh))) => {
            // SAFETY: the caller's out-pointer (not null: checked).
            unsafe { *h = vh };
            0
        }
        Ok(Some(Err(e))) => e,
        Ok(None) => pass(),
        Err(_) => unknown("cuMemCreate"),
    }
}

/// # Safety
/// As CUDA's `cuMemRelease`: called with the arguments CUDA documents for it (no pointer is
/// read).
pub unsafe extern "C" fn cuMemRelease(h: u64) -> u32 {
    let f = real_or!(cuMemRelease);
    // Descriptors exported for this page are no longer served (PyTorch closes them with it).
    let _ = catch_unwind(|| crate::api::fdshare::released(h));
    // An imported page's handle: its kept mapping, if any, holds the page (api::imports); a
    // deferred import is expseg's to release.
    if let Some(Some(c)) = hook_contained("cuMemRelease", || imports::release_deferred(h)) {
        return c;
    }
    hook_contained("cuMemRelease", || imports::released(h));
    // A copy exported for the page goes with it (api::ipc::pages).
    let release = || {
        let r = vmm::release(h);
        if r == Some(0) {
            crate::api::export_copies::released(h);
        }
        r
    };
    match catch_unwind(release) {
        Ok(Some(c)) => c,
        // SAFETY: the driver's own function, with the program's own arguments.
        Ok(None) => unsafe { f(h) },
        Err(_) => unknown("cuMemRelease"),
    }
}

/// # Safety
/// As CUDA's `cuMemMap`: called with the arguments CUDA documents for it (no pointer is read).
pub unsafe extern "C" fn cuMemMap(
    va: u64,
    size: size_t,
    offset: size_t,
    h: u64,
    flags: u64,
) -> u32 {
    let f = real_or!(cuMemMap);
    // An imported page where a kept view has it mapped already (api::imports).
    if flags == 0 {
        if let Some(Some(c)) = hook_contained("cuMemMap", || {
            imports::map(va, size as u64, offset as u64, h)
        }) {
            return c;
        }
    }
    // A deferred import needs the driver's handle now.
    let h = match hook_contained("cuMemMap", || imports::real_handle(h)) {
        Some(Ok(r)) => r,
        Some(Err(e)) => return e,
        None => h,
    };
    match catch_unwind(|| vmm::map(va, size as u64, offset as u64, h, flags)) {
        Ok(Some(c)) => c,
        Ok(None) => {
            let _ = catch_unwind(|| vmm::clear(va, size as u64));
            // SAFETY: the driver's own function, with the program's own arguments.
            unsafe { f(va, size, offset, h, flags) }
        }
        Err(_) => unknown("cuMemMap"),
    }
}

/// # Safety
/// As CUDA's `cuMemUnmap`: called with the arguments CUDA documents for it (no pointer is
/// read).
pub unsafe extern "C" fn cuMemUnmap(va: u64, size: size_t) -> u32 {
    let f = real_or!(cuMemUnmap);
    // An imported page kept mapped for the next open (api::imports).
    if let Some(Some(c)) = hook_contained("cuMemUnmap", || imports::unmap(va, size as u64)) {
        return c;
    }
    match catch_unwind(|| vmm::unmap(va, size as u64)) {
        Ok(Some(c)) => {
            // A foreign run shared from here may have been freed: its consumers are told.
            hook_contained("cuMemUnmap", crate::api::tell_freed);
            c
        }
        // SAFETY: the driver's own function, with the program's own arguments.
        Ok(None) => crate::api::unmap_unserved(va, size as u64, || unsafe { f(va, size) }),
        Err(_) => unknown("cuMemUnmap"),
    }
}

/// # Safety
/// As CUDA's `cuMemSetAccess`: `desc` must be valid for what that call reads and writes through
/// it (or null where CUDA allows null).
pub unsafe extern "C" fn cuMemSetAccess(
    va: u64,
    size: size_t,
    desc: *const c_void,
    count: size_t,
) -> u32 {
    let f = real_or!(cuMemSetAccess);
    // SAFETY: the driver's own function, with the program's own arguments.
    let pass = || unsafe { f(va, size, desc.cast(), count) };
    if desc.is_null() || count == 0 {
        return pass();
    }
    // SAFETY: `count` of CUDA's `CUmemAccessDesc`, which `RawAccess` lays out (not null).
    let raw = unsafe { std::slice::from_raw_parts(desc as *const RawAccess, count) };
    if raw.iter().any(|d| d.loc_type != LOCATION_DEVICE) {
        return pass();
    }
    let descs: Vec<(i32, u32)> = raw.iter().map(|d| (d.loc_id, d.flags)).collect();
    // A kept view opened again whole: its access stands (api::imports).
    if let Some(Some(c)) = hook_contained("cuMemSetAccess", || {
        imports::access(va, size as u64, &descs)
    }) {
        return c;
    }
    match catch_unwind(|| vmm::set_access(va, size as u64, &descs)) {
        Ok(Some(c)) => c,
        Ok(None) => pass(),
        Err(_) => unknown("cuMemSetAccess"),
    }
}

/// # Safety
/// As CUDA's `cuMemExportToShareableHandle`: `out` must be valid for what that call reads and
/// writes through it (or null where CUDA allows null).
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    out: *mut c_void,
    h: u64,
    kind: u32,
    flags: u64,
) -> u32 {
    crate::api::sharing::note_shared();
    let Some(f) = real::driver()
        .ok()
        .and_then(|t| t.cuMemExportToShareableHandle)
    else {
        return NO_DRIVER;
    };
    // A deferred import is exported as the driver's import.
    let h = match hook_contained("cuMemExportToShareableHandle", || imports::real_handle(h)) {
        Some(Ok(r)) => r,
        Some(Err(e)) => return e,
        None => h,
    };
    // SAFETY: the driver's own function, with the program's own arguments.
    let export = |h| unsafe { f(out, h, kind, flags) };
    // A page inside a coalesced handle, while the program has non-blocking streams: a copy
    // of it is exported (api::ipc::pages); otherwise its own handle, split off if need be.
    let r = match catch_unwind(|| crate::api::export_copies::export(h).or_else(|| vmm::export(h))) {
        Ok(Some(Ok(real_h))) => export(real_h),
        Ok(Some(Err(e))) => e,
        Ok(None) => export(h),
        Err(_) => unknown("cuMemExportToShareableHandle"),
    };
    // A POSIX descriptor for another process: served over expseg's socket to consumers whose
    // pidfd_getfd the kernel denies (api::fdshare).
    const POSIX_FD: u32 = 1;
    if r == 0 && kind == POSIX_FD && !out.is_null() {
        // SAFETY: the driver wrote a descriptor there (POSIX type; not null: checked).
        let fd = unsafe { *(out as *const c_int) };
        if let Some(moved) = hook_contained("cuMemExportToShareableHandle", || {
            crate::api::fdshare::exported(fd, h)
        }) {
            // SAFETY: as above; the same descriptor under the number a consumer that did not
            // answer cannot hold another page by (api::fdshare::watchers).
            unsafe { *(out as *mut c_int) = moved };
        }
    }
    r
}

/// The real handle behind `h` and the offset of `h`'s memory in it, for a call that names the
/// memory by a handle and an offset and keeps using it (`cuMulticastBindMem`): a page of ours
/// is bound inside its coalesced handle, which never moves from then on (nothing moves now);
/// anything else is the driver's handle already, at offset 0.
fn real_handle(name: &str, h: u64) -> Result<(u64, u64), u32> {
    match catch_unwind(|| vmm::bind_handle(h)) {
        Ok(Some(r)) => r,
        Ok(None) => Ok((h, 0)),
        Err(_) => Err(unknown(name)),
    }
}

/// Before a call that binds the memory mapped at `[va, ..)` for good (`cuMulticastBindAddr`):
/// the handles behind the coalesced pages of the run there never move again (as for IPC);
/// nothing moves now (the driver binds what is mapped at the address, whatever handle).
fn pin_pages(name: &str, va: u64) -> Result<(), u32> {
    match catch_unwind(|| vmm::share_run(va)) {
        Ok(r) => r,
        Err(_) => Err(unknown(name)),
    }
}

/// `cuMulticastBindMem`: PyTorch's symmetric memory binds its pages to a multicast object by
/// handle; the driver knows only the real one.
///
/// # Safety
/// As CUDA's `cuMulticastBindMem`: called with the arguments CUDA documents for it (no pointer
/// is read).
pub unsafe extern "C" fn cuMulticastBindMem(
    mc: u64,
    mc_offset: size_t,
    h: u64,
    offset: size_t,
    size: size_t,
    flags: u64,
) -> u32 {
    let Some(f) = real::driver().ok().and_then(|t| t.cuMulticastBindMem) else {
        return NO_DRIVER;
    };
    match real_handle("cuMulticastBindMem", h) {
        // SAFETY: the driver's own function, with the program's own arguments.
        Ok((h, at)) => unsafe { f(mc, mc_offset, h, offset + at as size_t, size, flags) },
        Err(e) => e,
    }
}

/// `cuMulticastBindAddr`: the driver binds what is mapped at `va`; those pages must stay.
///
/// # Safety
/// As CUDA's `cuMulticastBindAddr`: called with the arguments CUDA documents for it (no pointer
/// is read).
pub unsafe extern "C" fn cuMulticastBindAddr(
    mc: u64,
    mc_offset: size_t,
    va: u64,
    size: size_t,
    flags: u64,
) -> u32 {
    let Some(f) = real::driver().ok().and_then(|t| t.cuMulticastBindAddr) else {
        return NO_DRIVER;
    };
    match pin_pages("cuMulticastBindAddr", va) {
        // SAFETY: the driver's own function, with the program's own arguments.
        Ok(()) => unsafe { f(mc, mc_offset, va, size, flags) },
        Err(e) => e,
    }
}

/// # Safety
/// As CUDA's `cuMemRetainAllocationHandle`: `h`, `addr` must be valid for what that call reads
/// and writes through them (or null where CUDA allows null).
pub unsafe extern "C" fn cuMemRetainAllocationHandle(h: *mut u64, addr: *mut c_void) -> u32 {
    let Some(f) = real::driver()
        .ok()
        .and_then(|t| t.cuMemRetainAllocationHandle)
    else {
        return NO_DRIVER;
    };
    if !h.is_null() {
        match catch_unwind(|| vmm::retain(addr as u64)) {
            Ok(Some(Ok(vh))) => {
                // SAFETY: the caller's out-pointer (not null: checked).
                unsafe { *h = vh };
                return 0;
            }
            Ok(Some(Err(e))) => return e,
            Ok(None) => {}
            Err(_) => caught("cuMemRetainAllocationHandle", "asking the driver"),
        }
    }
    // SAFETY: the driver's own function, with the program's own arguments.
    unsafe { f(h, addr) }
}

/// # Safety
/// As CUDA's `cuMemGetAllocationPropertiesFromHandle`: `prop` must be valid for what that call
/// reads and writes through it (or null where CUDA allows null).
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(prop: *mut c_void, h: u64) -> u32 {
    let Some(f) = real::driver()
        .ok()
        .and_then(|t| t.cuMemGetAllocationPropertiesFromHandle)
    else {
        return NO_DRIVER;
    };
    // A deferred import is asked of the driver's import.
    let h = match hook_contained("cuMemGetAllocationPropertiesFromHandle", || {
        imports::real_handle(h)
    }) {
        Some(Ok(r)) => r,
        Some(Err(e)) => return e,
        None => h,
    };
    if !prop.is_null() {
        let props = catch_unwind(|| vmm::props_of(h)).unwrap_or_else(|_| {
            caught(
                "cuMemGetAllocationPropertiesFromHandle",
                "asking the driver",
            );
            None
        });
        if let Some((dev, p)) = props {
            // SAFETY: the caller's `CUmemAllocationProp`, which `RawProp` lays out (not null).
            unsafe {
                *(prop as *mut RawProp) = RawProp {
                    type_: PINNED,
                    handle_types: if p.shareable { POSIX_FD } else { 0 },
                    loc_type: LOCATION_DEVICE,
                    loc_id: dev,
                    win32: std::ptr::null_mut(),
                    compression: 0,
                    rdma: p.rdma as u8,
                    usage: 0,
                    reserved: [0; 4],
                }
            };
            return 0;
        }
    }
    // SAFETY: the driver's own function, with the program's own arguments.
    unsafe { f(prop, h) }
}

/// # Safety
/// As CUDA's `cuMemImportFromShareableHandle`: `h` must be valid for what that call writes
/// through it (or null where CUDA allows null); `os` is a descriptor number for the POSIX type.
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    h: *mut u64,
    os: *mut c_void,
    kind: u32,
) -> u32 {
    let Some(f) = real_or!(cuMemImportFromShareableHandle) else {
        return NO_DRIVER;
    };
    // This process maps another's memory (api::sharing), as every import notes.
    crate::api::sharing::note_imported();
    const POSIX_FD: u32 = 1;
    // A page mapped in a kept view already: the import waits until a call needs it.
    if kind == POSIX_FD && !h.is_null() {
        if let Some(Some(d)) = hook_contained("cuMemImportFromShareableHandle", || {
            imports::import_deferred(os as usize as i32)
        }) {
            // SAFETY: not null (checked): the program's out-pointer.
            unsafe { *h = d };
            return 0;
        }
    }
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { f(h, os, kind) };
    if r == 0 && kind == POSIX_FD && !h.is_null() {
        // SAFETY: the driver just wrote the handle there (not null: checked).
        let handle = unsafe { *h };
        // A page of a producer that tells this process about it (api::imports).
        hook_contained("cuMemImportFromShareableHandle", || {
            imports::imported(handle, os as usize as i32)
        });
    }
    r
}

/// # Safety
/// As CUDA's `cuMemAddressReserve`: `ptr` must be valid for what that call reads and writes
/// through it (or null where CUDA allows null).
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut u64,
    size: size_t,
    align: size_t,
    addr: u64,
    flags: u64,
) -> u32 {
    let f = real_or!(cuMemAddressReserve);
    // A kept view of imported pages, handed back for the next open (api::imports).
    if addr == 0 && flags == 0 && !ptr.is_null() {
        if let Some(Some(va)) =
            hook_contained("cuMemAddressReserve", || imports::reserve(size as u64))
        {
            if align == 0 || va % align as u64 == 0 {
                // SAFETY: not null (checked): the program's out-pointer.
                unsafe { *ptr = va };
                return 0;
            }
            // Not aligned as asked: the view goes, the driver reserves.
            hook_contained("cuMemAddressReserve", || imports::address_free(va));
        }
    }
    // SAFETY: the driver's own function, with the program's own arguments.
    let mut r = unsafe { f(ptr, size, align, addr, flags) };
    // No address space left: kept views hold some; they go, and the driver is asked again.
    if r != 0
        && hook_contained("cuMemAddressReserve", imports::out_of_address_space).unwrap_or(false)
    {
        // SAFETY: as above.
        r = unsafe { f(ptr, size, align, addr, flags) };
    }
    if r == 0 && !ptr.is_null() {
        // SAFETY: the driver just wrote the reservation there (not null: checked).
        let va = unsafe { *ptr };
        let _ = catch_unwind(|| vmm::reserved(va, size as u64));
        hook_contained("cuMemAddressReserve", || imports::reserved(va, size as u64));
    }
    r
}

/// # Safety
/// As CUDA's `cuMemAddressFree`: called with the arguments CUDA documents for it (no pointer is
/// read).
pub unsafe extern "C" fn cuMemAddressFree(va: u64, size: size_t) -> u32 {
    let f = real_or!(cuMemAddressFree);
    // SAFETY: the driver's own function, with the program's own arguments.
    let pass = || unsafe { f(va, size) };
    // A view of imported pages kept for the next open (api::imports).
    if let Some(Some(c)) = hook_contained("cuMemAddressFree", || imports::address_free(va)) {
        return c;
    }
    match catch_unwind(|| vmm::address_free(va, size as u64)) {
        Ok(Some(c)) => c,
        Ok(None) => pass(),
        Err(_) => {
            caught("cuMemAddressFree", "passing it to the driver");
            pass()
        }
    }
}

/// The hook for `name`, looked up at CUDA `version`, if the caller of the entry point lookup
/// gets coalesced pages.
pub fn for_caller(name: &[u8], version: c_int) -> Option<*mut c_void> {
    let hook = match name {
        b"cuMemCreate" => cuMemCreate as *mut c_void,
        b"cuMemRelease" => cuMemRelease as *mut c_void,
        b"cuMemMap" => cuMemMap as *mut c_void,
        b"cuMemUnmap" => cuMemUnmap as *mut c_void,
        b"cuMemSetAccess" => cuMemSetAccess as *mut c_void,
        b"cuMemExportToShareableHandle" => cuMemExportToShareableHandle as *mut c_void,
        b"cuMemRetainAllocationHandle" => cuMemRetainAllocationHandle as *mut c_void,
        b"cuMemGetAllocationPropertiesFromHandle" => {
            cuMemGetAllocationPropertiesFromHandle as *mut c_void
        }
        b"cuMemAddressReserve" => cuMemAddressReserve as *mut c_void,
        b"cuMemImportFromShareableHandle" => cuMemImportFromShareableHandle as *mut c_void,
        b"cuMemAddressFree" => cuMemAddressFree as *mut c_void,
        // The signatures of CUDA 12.1. CUDA 13 added `_v2` variants with a device argument,
        // which a lookup at a 13.x version may get under the same name: those stay the
        // driver's (no hook with the wrong arguments).
        b"cuMulticastBindMem" if version < 13000 => cuMulticastBindMem as *mut c_void,
        b"cuMulticastBindAddr" if version < 13000 => cuMulticastBindAddr as *mut c_void,
        _ => return None,
    };
    let c = crate::api::config();
    if c.disabled {
        return None;
    }
    let torch = || caller_object().is_some_and(|f| f.contains("c10_cuda"));
    let yes = match c.coalesce {
        Coalesce::Off => false,
        Coalesce::All => true,
        Coalesce::Torch => torch(),
    };
    // The line about PyTorch's allocator is for PyTorch (with `all`, other callers get pages too).
    if yes && name == b"cuMemCreate" && (c.coalesce == Coalesce::Torch || torch()) {
        note_torch_defaults();
        log::info!("coalescing VMM pages of this process's expandable segments");
    }
    if yes && name == b"cuMemImportFromShareableHandle" {
        IMPORT_HANDED.store(true, Ordering::Release);
    }
    yes.then_some(hook)
}

/// Whether PyTorch's table got expseg's import (kept views of imported pages need it: until
/// then a `pidfd_getfd` asks nothing, and reads no configuration).
static IMPORT_HANDED: AtomicBool = AtomicBool::new(false);

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn import_handed() -> bool {
    IMPORT_HANDED.load(Ordering::Acquire)
}

extern "C" {
    fn backtrace(buffer: *mut *mut c_void, size: c_int) -> c_int;
}

/// The address of the first caller outside expseg on this thread's stack, looking deep enough
/// for expseg's own frames above a lookup hook in a debug build (about 17: the redirection runs
/// inside the panic boundary).
pub(crate) fn caller_pc() -> Option<usize> {
    let mut frames = [std::ptr::null_mut::<c_void>(); 32];
    // SAFETY: `frames` has room for the count given.
    let n = unsafe { backtrace(frames.as_mut_ptr(), frames.len() as c_int) };
    frames
        .iter()
        .take(n.max(0) as usize)
        .map(|&pc| pc as usize)
        .find(|&pc| !real::is_self(pc))
}

/// The file of the first caller outside expseg on this thread's stack.
fn caller_object() -> Option<String> {
    let pc = caller_pc()?;
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address; dli_fname points into the loader's tables.
    unsafe {
        if libc::dladdr(pc as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// Set by the load-time default: the stderr line is owed once PyTorch uses it.
static DEFAULTS_APPLIED: AtomicBool = AtomicBool::new(false);

fn note_torch_defaults() {
    if DEFAULTS_APPLIED.swap(false, Ordering::Relaxed) {
        let line = b"expseg: PyTorch allocator set to expandable_segments:True (EXPSEG_TORCH_DEFAULTS=0 keeps PyTorch's default)\n";
        // SAFETY: writes a constant buffer to stderr.
        unsafe {
            libc::write(2, line.as_ptr().cast(), line.len());
        }
    }
}

fn env_set(name: &std::ffi::CStr) -> bool {
    // SAFETY: getenv with a NUL-terminated name; the result is only tested for null.
    unsafe { !libc::getenv(name.as_ptr()).is_null() }
}

/// PyTorch's allocator setting expseg applies, and the variable that says expseg applied it
/// (set beside it by this library and by expseg-run, with the same value).
const DEFAULT: &std::ffi::CStr = c"expandable_segments:True";
const APPLIED: &std::ffi::CStr = c"EXPSEG_TORCH_DEFAULTS_APPLIED";

/// Whether `PYTORCH_CUDA_ALLOC_CONF` is the setting expseg applied (not one of the user's).
fn expsegs_own_setting() -> bool {
    let get = |name: &std::ffi::CStr| {
        // SAFETY: getenv with a NUL-terminated name; the value is copied at once.
        let p = unsafe { libc::getenv(name.as_ptr()) };
        // SAFETY: a non-null getenv result is a NUL-terminated string.
        (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_owned())
    };
    let conf = get(c"PYTORCH_CUDA_ALLOC_CONF");
    conf.as_deref() == Some(DEFAULT) && get(APPLIED) == conf
}

/// Load time, in `libexpseg.so` only (not in test programs or tools that link the crate):
/// PyTorch's allocator default, as `expseg-run` applies it, when the user set none.
extern "C" fn apply_torch_defaults() {
    let _ = catch_unwind(|| {
        let loaded_as_library = real::self_file().is_some_and(|f| f.ends_with(".so"));
        if !loaded_as_library {
            return;
        }
        // The variables read as the configuration reads them (`EXPSEG_DISABLE=true`,
        // `EXPSEG_COALESCE=0`, `EXPSEG_TORCH_DEFAULTS=off` all count); an invalid value is
        // said once, when the configuration is read at the first hooked call.
        let c = crate::config::Config::from_lookup(crate::config::Config::env_value, |_| {});
        // torch_memory_saver turns itself off under expandable segments. Its
        // `configure_subprocess()` adds its hook to LD_PRELOAD of a process started under
        // expseg-run (or under a parent where this library applied the default), so that
        // process inherits expseg's own setting: taken back here. The user's own setting stays.
        if real::tms::preloaded() && expsegs_own_setting() {
            // SAFETY: constant NUL-terminated names; no other thread runs at load time.
            unsafe {
                libc::unsetenv(c"PYTORCH_CUDA_ALLOC_CONF".as_ptr());
                libc::unsetenv(APPLIED.as_ptr());
            }
            return;
        }
        if !c.torch_defaults
            || c.disabled
            || c.coalesce == Coalesce::Off
            || env_set(c"PYTORCH_CUDA_ALLOC_CONF")
            || env_set(c"PYTORCH_ALLOC_CONF")
            || env_set(c"PYTORCH_HIP_ALLOC_CONF")
        {
            return;
        }
        // torch_memory_saver turns itself off under expandable segments: left alone (silently
        // here, in every process of the job; expseg-run says it once).
        if real::tms::preloaded() {
            return;
        }
        // SAFETY: constant NUL-terminated strings; no other thread runs at load time.
        unsafe {
            libc::setenv(c"PYTORCH_CUDA_ALLOC_CONF".as_ptr(), DEFAULT.as_ptr(), 0);
            libc::setenv(APPLIED.as_ptr(), DEFAULT.as_ptr(), 0);
        }
        DEFAULTS_APPLIED.store(true, Ordering::Relaxed);
    });
}

#[used]
#[link_section = ".init_array"]
static APPLY_TORCH_DEFAULTS: extern "C" fn() = apply_torch_defaults;
