//! The real driver: [`Driver`] over the CUDA VMM calls of [`crate::real::driver()`].
//!
//! Each method is one driver call and one return-code conversion; no policy lives here.
#![allow(unsafe_code)]

use super::{ChunkHandle, Driver, DrvError, DrvResult, Held, IpcHandle};
pub use crate::real::primary::{
    current_is_primary, make_primary_current, pop_primary, primary_device, primary_device_likely,
    push_primary, synchronize_primary, synchronize_primary_default_stream, with_primary,
};
use crate::real::{runtime, DriverTable};
use cudarc::driver::sys::{
    CUcontext, CUdevice_attribute, CUmemAccessDesc, CUmemAccess_flags,
    CUmemAllocationGranularity_flags, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemAllocationType, CUmemLocationType, CUstream,
};
use libc::c_void;
use std::os::fd::{FromRawFd, OwnedFd};

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, as the table's functions take it.
pub(super) const POSIX_FD: u32 = 1;

/// `CUDA_ERROR_NOT_FOUND`: an optional driver function is missing.
pub const NOT_FOUND: u32 = 500;

use super::{check, NOT_SUPPORTED};

/// A runtime error as a driver error (out of memory is 2 in both).
fn rt(code: i32) -> DrvError {
    DrvError(code as u32)
}

/// The driver of one device.
pub struct CudaDriver {
    t: &'static DriverTable,
    dev: i32,
    gran: u64,
    prop: CUmemAllocationProp,
    /// Chunks are exportable as POSIX file descriptors (for IPC).
    pub shareable: bool,
    /// The stream host copies are queued on (made at the first one; 0: none yet).
    copies: usize,
    /// Host buffers made by `host_alloc`: address -> size.
    pinned: std::collections::HashMap<u64, u64>,
}

// SAFETY: the property struct's only pointer (win32HandleMetaData) is always null.
unsafe impl Send for CudaDriver {}

fn prop_for(dev: i32, shareable: bool) -> CUmemAllocationProp {
    // SAFETY: the C struct is valid when zeroed (the driver's documented default).
    let mut p: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = if shareable {
        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    };
    p
}

pub(super) fn access(dev: i32, flags: CUmemAccess_flags) -> CUmemAccessDesc {
    // SAFETY: the C struct is valid when zeroed.
    let mut a: CUmemAccessDesc = unsafe { std::mem::zeroed() };
    a.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = dev;
    a.flags = flags;
    a
}

impl CudaDriver {
    /// Open device `dev` for the pool, or say why its memory cannot come from VMM.
    pub fn open(t: &'static DriverTable, dev: i32) -> Result<CudaDriver, String> {
        let attr = |a: CUdevice_attribute| -> DrvResult<i32> {
            let mut v = 0;
            // SAFETY: valid out-pointer; the device ordinal is checked by the driver.
            check(unsafe { (t.cuDeviceGetAttribute)(&mut v, a, dev) })?;
            Ok(v)
        };
        // SAFETY: cuInit is idempotent; the runtime has called it already in practice.
        check(unsafe { (t.cuInit)(0) }).map_err(|e| format!("cuInit failed: {e}"))?;
        let vmm = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
            .map_err(|e| format!("device {dev}: cannot read the VMM attribute: {e}"))?;
        if vmm == 0 {
            return Err(format!(
                "device {dev} does not support virtual memory management"
            ));
        }
        let shareable = attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )
        .unwrap_or(0)
            != 0;
        if !shareable {
            log::warn!("device {dev}: no POSIX-fd shareable VMM memory; IPC of pool memory will need a mirror");
        }
        let prop = prop_for(dev, shareable);
        let mut g: usize = 0;
        // SAFETY: valid out-pointer and property struct.
        check(unsafe {
            (t.cuMemGetAllocationGranularity)(
                &mut g,
                &prop,
                CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })
        .map_err(|e| format!("device {dev}: cuMemGetAllocationGranularity failed: {e}"))?;
        if g == 0 {
            return Err(format!("device {dev}: granularity 0"));
        }
        Ok(CudaDriver {
            t,
            dev,
            gran: g as u64,
            prop,
            shareable,
            copies: 0,
            pinned: Default::default(),
        })
    }

    /// A move's copies and the hold on the default stream ([`super::fence`]).
    fn fenced_copies(
        &mut self,
        copies: &[(u64, u64, u64)],
        peers: &[i32],
        wait: super::PeerWait,
    ) -> DrvResult<Held> {
        // The fence holds the *current* context's legacy stream, and the copy stream is made
        // in the current context: both must be this device's primary one (the caller pushed
        // it; where it could not, the move copies after the wait instead).
        if primary_device(self.t) != Some(self.dev) {
            return Err(DrvError(NOT_SUPPORTED));
        }
        let s = self.copy_stream()?;
        super::fence::copies_then_hold(self.t, s, self.dev, copies, peers, wait)
    }

    /// The stream host copies go on (a non-blocking one of the current context, made once).
    fn copy_stream(&mut self) -> DrvResult<CUstream> {
        if self.copies == 0 {
            let make = self.t.cuStreamCreate.ok_or(DrvError(NOT_SUPPORTED))?;
            let mut s: CUstream = std::ptr::null_mut();
            const NON_BLOCKING: u32 = 1;
            // SAFETY: valid out-pointer; the caller made the device's context current.
            check(unsafe { make(&mut s, NON_BLOCKING) })?;
            self.copies = s as usize;
        }
        Ok(self.copies as CUstream)
    }
}

/// One page-locked host buffer of `size` bytes, made on a thread with `dev`'s primary context
/// current: anonymous memory on transparent huge pages, its pages touched here (the kernel
/// clears them on this thread, so several threads clear in parallel), then registered with
/// the driver. Measured on an H100 host (scripts/vmm-cost/pin_cost.cu, 8 GiB): 369 ms on 16
/// threads, against 3.3 s for `cuMemHostAlloc` on 16 threads and 5.2 s on one.
fn pin_one(t: &DriverTable, dev: i32, size: u64) -> DrvResult<u64> {
    // Registered memory must be unregistered before it is unmapped: both calls, or neither.
    let register = t
        .cuMemHostRegister_v2
        .filter(|_| t.cuMemHostUnregister.is_some())
        .ok_or(DrvError(NOT_SUPPORTED))?;
    let _ = make_primary_current(t, dev);
    // SAFETY: a fresh private anonymous mapping; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(DrvError::OUT_OF_MEMORY);
    }
    // SAFETY: `p` is our mapping of `size` bytes; advice and writes stay inside it.
    unsafe {
        libc::madvise(p, size as usize, libc::MADV_HUGEPAGE);
        std::ptr::write_bytes(p.cast::<u8>(), 0, size as usize);
    }
    const PORTABLE: u32 = 1;
    // SAFETY: `p` is a mapping of `size` bytes that stays until `host_free`.
    if let Err(e) = check(unsafe { register(p, size as usize, PORTABLE) }) {
        // SAFETY: our own mapping, never registered.
        unsafe { libc::munmap(p, size as usize) };
        return Err(e);
    }
    Ok(p as u64)
}

/// Give back a buffer of `pin_one`.
fn unpin_one(t: &DriverTable, host: u64, size: u64) {
    if let Some(unregister) = t.cuMemHostUnregister {
        // SAFETY: `host` was registered by `pin_one` and is unregistered once.
        unsafe { unregister(host as *mut c_void) };
    }
    // SAFETY: the mapping `pin_one` made, of `size` bytes, no longer used.
    unsafe { libc::munmap(host as *mut c_void, size as usize) };
}

/// The thread that unpins and unmaps host buffers given back (started at the first).
fn reaper() -> std::sync::mpsc::Sender<(i32, u64, u64)> {
    type Tx = std::sync::mpsc::Sender<(i32, u64, u64)>;
    static TX: std::sync::OnceLock<std::sync::Mutex<Tx>> = std::sync::OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<(i32, u64, u64)>();
        let spawned = std::thread::Builder::new()
            .name("expseg-unpin".into())
            .spawn(move || {
                for (dev, host, size) in rx {
                    if let Ok(t) = crate::real::driver() {
                        let _ = make_primary_current(t, dev);
                        unpin_one(t, host, size);
                    }
                }
            });
        if spawned.is_err() {
            log::warn!("no thread to unpin host buffers: they stay until exit");
        }
        std::sync::Mutex::new(tx)
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
    .clone()
}

/// Page-locking costs the host more than copying costs the GPU (the kernel clears and pins
/// every page): buffers are made on up to this many threads at once.
const PIN_THREADS: usize = 16;

/// Host memory a pause leaves untaken, so the program and the system go on around it.
const HOST_HEADROOM: u64 = 1 << 30;

/// Number of devices the driver sees.
pub fn device_count(t: &DriverTable) -> DrvResult<i32> {
    let mut n = 0;
    // SAFETY: cuInit is idempotent; valid out-pointer.
    check(unsafe { (t.cuInit)(0) })?;
    check(unsafe { (t.cuDeviceGetCount)(&mut n) })?;
    Ok(n)
}

/// The 16-byte UUID of device `dev` (the same GPU under any `CUDA_VISIBLE_DEVICES`); None
/// where the driver has no `cuDeviceGetUuid_v2`.
pub fn device_uuid(t: &DriverTable, dev: i32) -> Option<[u8; 16]> {
    let f = t.cuDeviceGetUuid_v2?;
    let mut d: cudarc::driver::sys::CUdevice = 0;
    let mut uuid = [0u8; 16];
    // SAFETY: valid out-pointers; a CUuuid is 16 bytes.
    unsafe {
        check((t.cuDeviceGet)(&mut d, dev)).ok()?;
        check(f(uuid.as_mut_ptr().cast(), d)).ok()?;
    }
    Some(uuid)
}

/// Whether the calling thread has a current context (after the driver is initialised).
pub fn has_context(t: &DriverTable) -> bool {
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; returns an error code if the driver is not initialised.
    unsafe { (t.cuCtxGetCurrent)(&mut c) == 0 && !c.is_null() }
}

/// The device of context `ctx` (pushed for the question, then popped).
pub fn device_of_context(t: &DriverTable, ctx: usize) -> Option<i32> {
    let (push, pop, get) = (
        t.cuCtxPushCurrent_v2?,
        t.cuCtxPopCurrent_v2?,
        t.cuCtxGetDevice?,
    );
    if ctx == 0 {
        return None;
    }
    let mut dev = 0;
    // SAFETY: a context the program handed the driver; push/pop leave the caller's as it was.
    unsafe {
        if push(ctx as CUcontext) != 0 {
            return None;
        }
        let r = get(&mut dev);
        let mut popped: CUcontext = std::ptr::null_mut();
        pop(&mut popped);
        (r == 0).then_some(dev)
    }
}

/// The driver's own view of `ptr`: the mapping (or allocation) containing it and its device.
/// `None` for pointers the driver does not know.
pub fn mapping_of(t: &DriverTable, ptr: u64) -> Option<(u64, u64, i32)> {
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
    const DEVICE_ORDINAL: libc::c_int = 9;
    let (range, attr) = (t.cuMemGetAddressRange_v2?, t.cuPointerGetAttribute?);
    let (mut base, mut size, mut dev) = (0u64, 0usize, 0 as libc::c_int);
    // SAFETY: valid out-pointers; the driver validates `ptr`.
    let found = unsafe {
        range(&mut base, &mut size, ptr) == 0
            && attr((&mut dev as *mut libc::c_int).cast(), DEVICE_ORDINAL, ptr) == 0
    };
    (found && size > 0).then_some((base, size as u64, dev))
}

/// The back-to-back VMM mappings on one device that start with the one containing `ptr`, as
/// (start, mapping sizes). A legacy handle of `ptr` stands for this whole run: its base must
/// be the start of `ptr`'s mapping (what range queries answer, from which a consumer computes
/// its offset), and the buffer at `ptr` may run on into the following mappings (PyTorch maps
/// an expandable segment 20 MiB at a time). The walk stops at a gap, at memory that is not
/// VMM, at another device, at a mapping the device may not read yet (mapped by another thread,
/// access not set: copying from it would fault), or after `max_mappings`.
pub fn run_from(t: &DriverTable, ptr: u64, max_mappings: usize) -> Option<(u64, Vec<u64>, i32)> {
    let (base, size, dev) = mapping_of(t, ptr)?;
    let mut sizes = vec![size];
    let mut end = base + size;
    while sizes.len() < max_mappings {
        match mapping_of(t, end) {
            Some((b, s, d)) if b == end && d == dev && is_vmm(t, end) && readable(t, end, dev) => {
                sizes.push(s);
                end += s;
            }
            _ => break,
        }
    }
    Some((base, sizes, dev))
}

/// Whether device `dev` may read the mapping at `ptr` (`cuMemGetAccess`; true where the driver
/// lacks the call).
fn readable(t: &DriverTable, ptr: u64, dev: i32) -> bool {
    t.cuMemGetAccess.is_none() || granted(t, ptr, dev)
}

/// Whether the driver says device `dev` was given access to the mapping at `ptr` (false where
/// it cannot say: no `cuMemGetAccess`, not a VMM mapping).
pub fn granted(t: &DriverTable, ptr: u64, dev: i32) -> bool {
    let Some(get) = t.cuMemGetAccess else {
        return false;
    };
    // CUmemLocation { type: CU_MEM_LOCATION_TYPE_DEVICE, id }
    let loc: [i32; 2] = [1, dev];
    let mut flags: u64 = 0;
    // SAFETY: valid out-pointer and location struct (two ints); the driver validates `ptr`.
    unsafe { get(&mut flags, loc.as_ptr().cast(), ptr) == 0 && flags & 1 != 0 }
}

/// Whether `ptr` is VMM memory (not legacy-IPC capable), by the driver's own attribute.
fn is_vmm(t: &DriverTable, ptr: u64) -> bool {
    /// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`.
    const LEGACY_IPC: libc::c_int = 10;
    let Some(attr) = t.cuPointerGetAttribute else {
        return false;
    };
    let mut v: libc::c_int = 1;
    // SAFETY: valid out-pointer for a boolean attribute; the driver validates `ptr`.
    unsafe { attr((&mut v as *mut libc::c_int).cast(), LEGACY_IPC, ptr) == 0 && v == 0 }
}

/// A context made current for a while on a thread that has none (the ticket thread): the
/// driver's pointer queries and exports need one. Where `dev`'s primary context is active
/// (the program's memory lives there) it is made current without a reference of ours;
/// otherwise (a program of its own `cuCtxCreate` contexts) it is retained while the guard
/// lives, then released, so no request leaves a context created or a reference held.
pub struct ThreadContext {
    t: &'static DriverTable,
    retained: Option<i32>,
}

/// See [`ThreadContext`]; the thread keeps the context it has, if any.
pub fn ensure_context(t: &'static DriverTable, dev: i32) -> ThreadContext {
    let mut guard = ThreadContext { t, retained: None };
    if has_context(t) || make_primary_current(t, dev) == 0 {
        return guard;
    }
    if let (Some(primary), Some(set)) = (t.cuDevicePrimaryCtxRetain, t.cuCtxSetCurrent) {
        let mut c: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the guard gives the reference back.
        if unsafe { primary(&mut c, dev) } == 0 {
            guard.retained = Some(dev);
            // SAFETY: a context the driver just handed us.
            unsafe { set(c) };
        }
    }
    guard
}

impl Drop for ThreadContext {
    fn drop(&mut self) {
        let Some(dev) = self.retained else {
            return;
        };
        // SAFETY: the thread stops using the context before the reference it holds goes.
        unsafe {
            if let Some(set) = self.t.cuCtxSetCurrent {
                set(std::ptr::null_mut());
            }
            if let Some(release) = self.t.cuDevicePrimaryCtxRelease_v2 {
                release(dev);
            }
        }
    }
}

/// The physical allocations mapped at `vas` (another allocator's pages), each with a
/// reference of ours: what a ticket exports, pinned when its open is decided, so that pages
/// the program unmaps and maps anew meanwhile are not what the consumer gets. The references
/// go as each is exported, and the rest when this drops.
pub struct RetainedRun {
    t: &'static DriverTable,
    handles: std::collections::VecDeque<u64>,
}

/// Retain the handle behind each mapping at `vas`, in order; all or nothing.
pub fn retain_run(t: &'static DriverTable, vas: &[u64]) -> DrvResult<RetainedRun> {
    let retain = t.cuMemRetainAllocationHandle.ok_or(DrvError(NOT_FOUND))?;
    t.cuMemExportToShareableHandle.ok_or(DrvError(NOT_FOUND))?;
    let mut run = RetainedRun {
        t,
        handles: std::collections::VecDeque::with_capacity(vas.len()),
    };
    for &va in vas {
        let mut h = 0;
        // SAFETY: valid out-pointer; the driver validates the address.
        check(unsafe { retain(&mut h, va as usize as *mut libc::c_void) })?;
        run.handles.push_back(h);
    }
    Ok(run)
}

impl RetainedRun {
    /// A POSIX descriptor of the next allocation, in the order retained; its reference goes.
    /// The calling thread needs a context (see [`ThreadContext`]).
    pub fn export_next(&mut self) -> Option<DrvResult<OwnedFd>> {
        let h = self.handles.pop_front()?;
        let r = export_handle(self.t, h);
        // SAFETY: drops the reference the retain took; the descriptor keeps the memory.
        unsafe { (self.t.cuMemRelease)(h) };
        Some(r)
    }
}

impl Drop for RetainedRun {
    fn drop(&mut self) {
        for h in self.handles.drain(..) {
            // SAFETY: a reference `retain_run` took and nothing gave back.
            unsafe { (self.t.cuMemRelease)(h) };
        }
    }
}

fn export_handle(t: &DriverTable, h: u64) -> DrvResult<OwnedFd> {
    let export = t.cuMemExportToShareableHandle.ok_or(DrvError(NOT_FOUND))?;
    let mut fd: libc::c_int = -1;
    // SAFETY: `fd` receives an int for POSIX-fd handles.
    check(unsafe { export((&mut fd as *mut libc::c_int).cast(), h, POSIX_FD, 0) })?;
    // SAFETY: the driver handed us a new descriptor we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Driver for CudaDriver {
    fn device(&self) -> i32 {
        self.dev
    }

    fn granularity(&self) -> u64 {
        self.gran
    }

    fn create(&mut self, size: u64) -> DrvResult<ChunkHandle> {
        let mut h = 0;
        // SAFETY: valid out-pointer and property struct.
        check(unsafe { (self.t.cuMemCreate)(&mut h, size as usize, &self.prop, 0) })?;
        Ok(h)
    }

    fn release(&mut self, h: ChunkHandle) -> DrvResult<()> {
        // SAFETY: `h` came from cuMemCreate and is released once.
        check(unsafe { (self.t.cuMemRelease)(h) })
    }

    fn reserve_at(&mut self, va: u64, size: u64) -> DrvResult<u64> {
        let mut got = 0;
        // SAFETY: valid out-pointer; `va` is only a hint to the driver.
        check(unsafe { (self.t.cuMemAddressReserve)(&mut got, size as usize, 0, va, 0) })?;
        Ok(got)
    }

    fn legacy_alloc(&mut self, size: u64) -> DrvResult<u64> {
        runtime::on_device(self.dev, || match runtime::malloc(size as usize) {
            (0, p) => Ok(p),
            (e, _) => Err(e),
        })
        .map_err(rt)
    }

    fn legacy_free(&mut self, ptr: u64) -> DrvResult<()> {
        match runtime::free(ptr) {
            0 => Ok(()),
            e => Err(rt(e)),
        }
    }

    fn copy(&mut self, dst: u64, src: u64, size: u64) -> DrvResult<()> {
        runtime::on_device(self.dev, || {
            match runtime::copy_d2d(dst, src, size as usize) {
                0 => match runtime::device_synchronize() {
                    0 => Ok(()),
                    e => Err(e),
                },
                e => Err(e),
            }
        })
        .map_err(rt)
    }

    fn legacy_handle(&mut self, ptr: u64) -> DrvResult<IpcHandle> {
        runtime::ipc_get_mem_handle(ptr).map_err(rt)
    }

    fn host_alloc(&mut self, sizes: &[u64]) -> DrvResult<Vec<u64>> {
        let (t, dev) = (self.t, self.dev);
        // Pinning touches every page: past what the host (or the job's cgroup) can give,
        // the kernel kills the process instead of failing a call. Refuse first.
        let need: u64 = sizes.iter().sum();
        if let Some(room) = crate::hostmem::available() {
            if need.saturating_add(HOST_HEADROOM) > room {
                log::warn!(
                    "page-locking {need} bytes of host memory refused: {room} bytes can be taken (MemAvailable and cgroup limits) and {HOST_HEADROOM} are left to the rest of the system"
                );
                return Err(DrvError::OUT_OF_MEMORY);
            }
        }
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let threads = PIN_THREADS.min(cores).min(sizes.len()).max(1);
        let got: Vec<DrvResult<u64>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|w| {
                    scope.spawn(move || {
                        sizes
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| i % threads == w)
                            .map(|(i, s)| (i, pin_one(t, dev, *s)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            let mut all: Vec<(usize, DrvResult<u64>)> = workers
                .into_iter()
                .flat_map(|h| {
                    h.join()
                        .unwrap_or_else(|_| vec![(usize::MAX, Err(DrvError(NOT_SUPPORTED)))])
                })
                .collect();
            all.sort_by_key(|(i, _)| *i);
            all.into_iter().map(|(_, r)| r).collect()
        });
        if got.len() == sizes.len() && got.iter().all(Result::is_ok) {
            let got: Vec<u64> = got.into_iter().map(Result::unwrap).collect();
            self.pinned
                .extend(got.iter().copied().zip(sizes.iter().copied()));
            return Ok(got);
        }
        let err = got
            .iter()
            .find_map(|r| r.err())
            .unwrap_or(DrvError(NOT_SUPPORTED));
        for (p, size) in got.into_iter().zip(sizes) {
            if let Ok(p) = p {
                unpin_one(t, p, *size);
            }
        }
        Err(err)
    }

    fn host_free(&mut self, host: u64) {
        let Some(size) = self.pinned.remove(&host) else {
            return;
        };
        // Unpinning is slow too (≈ 20 ms a GiB): it happens on a thread of its own, after
        // the call that gave the buffer back has returned.
        if let Err(back) = reaper().send((self.dev, host, size)) {
            let (_, host, size) = back.0;
            unpin_one(self.t, host, size);
        }
    }

    fn copy_to_host(&mut self, host: u64, src: u64, size: u64) -> DrvResult<()> {
        let copy = self.t.cuMemcpyDtoHAsync_v2.ok_or(DrvError(NOT_SUPPORTED))?;
        let s = self.copy_stream()?;
        // SAFETY: `host` lies in a page-locked buffer of at least `size` bytes (the caller's
        // layout); `src` is device memory mapped for `size` bytes.
        check(unsafe { copy(host as *mut c_void, src, size as usize, s) })
    }

    fn copy_from_host(&mut self, dst: u64, host: u64, size: u64) -> DrvResult<()> {
        let copy = self.t.cuMemcpyHtoDAsync_v2.ok_or(DrvError(NOT_SUPPORTED))?;
        let s = self.copy_stream()?;
        // SAFETY: as in `copy_to_host`, the other way.
        check(unsafe { copy(dst, host as *const c_void, size as usize, s) })
    }

    fn wait_copies(&mut self) -> DrvResult<()> {
        if self.copies == 0 {
            return Ok(());
        }
        let sync = self.t.cuStreamSynchronize.ok_or(DrvError(NOT_SUPPORTED))?;
        // SAFETY: a stream this driver made.
        check(unsafe { sync(self.copies as CUstream) })
    }

    fn synchronize(&mut self) -> DrvResult<()> {
        match runtime::synchronize_device(self.dev) {
            0 => Ok(()),
            e => Err(rt(e)),
        }
    }

    fn wait_default_stream(&mut self) -> DrvResult<()> {
        check(synchronize_primary_default_stream(self.t, self.dev))
    }

    fn copy_and_hold(
        &mut self,
        copies: &[(u64, u64, u64)],
        peers: &[i32],
        wait: super::PeerWait,
    ) -> DrvResult<Held> {
        if super::fence::enabled() {
            // No move while a stream of the program's captures a graph: the device wait
            // below would end the capture.
            let list = super::streams::STREAMS.on_device(self.dev);
            if super::fence::capturing(self.t, self.dev, &list).is_some() {
                return Err(DrvError(super::fence::CAPTURING));
            }
            // Work already queued on any stream ends first (the fence holds the default
            // stream only).
            self.synchronize()?;
            match self.fenced_copies(copies, peers, wait) {
                Ok(held) => return Ok(held),
                Err(e) => log::debug!(
                    "device {}: no fence for a move ({e}); copying after the wait",
                    self.dev
                ),
            }
        }
        super::copy_after_wait(self, copies)?;
        // Nothing held: peers asked for are counted as let go.
        Ok(Held::default().with_peers(0, peers.len() as u32))
    }

    fn synchronize_peer(&mut self, dev: i32) -> DrvResult<()> {
        match runtime::synchronize_device(dev) {
            0 => Ok(()),
            e => Err(rt(e)),
        }
    }

    fn export_fd(&mut self, h: ChunkHandle) -> DrvResult<OwnedFd> {
        let f = self
            .t
            .cuMemExportToShareableHandle
            .ok_or(DrvError(NOT_FOUND))?;
        let mut fd: libc::c_int = -1;
        // SAFETY: `fd` receives an int for POSIX-fd handles.
        check(unsafe { f((&mut fd as *mut libc::c_int).cast(), h, POSIX_FD, 0) })?;
        // SAFETY: the driver handed us a new descriptor we now own; children must not
        // inherit it.
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            Ok(OwnedFd::from_raw_fd(fd))
        }
    }

    fn create_as(&mut self, size: u64, props: super::PageProps) -> DrvResult<ChunkHandle> {
        let mut p = prop_for(self.dev, props.shareable);
        p.allocFlags.gpuDirectRDMACapable = props.rdma as u8;
        let mut h = 0;
        // SAFETY: valid out-pointer and property struct.
        check(unsafe { (self.t.cuMemCreate)(&mut h, size as usize, &p, 0) })?;
        Ok(h)
    }

    fn free_memory(&mut self) -> DrvResult<u64> {
        runtime::on_device(self.dev, runtime::mem_get_info)
            .map(|(free, _)| free)
            .map_err(rt)
    }

    fn now_ns(&mut self) -> u64 {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let start = *START.get_or_init(std::time::Instant::now);
        u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn set_access_flags(&mut self, va: u64, size: u64, descs: &[(i32, u32)]) -> DrvResult<()> {
        let descs: Vec<CUmemAccessDesc> = descs
            .iter()
            .map(|(d, f)| {
                let flags = match f {
                    0 => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
                    1 => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
                    _ => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                };
                access(*d, flags)
            })
            .collect();
        // SAFETY: the descriptors outlive the call; the range is mapped by us.
        check(unsafe { (self.t.cuMemSetAccess)(va, size as usize, descs.as_ptr(), descs.len()) })
    }

    fn save(&mut self, src: u64, size: u64) -> DrvResult<Vec<u8>> {
        let mut out = vec![0u8; size as usize];
        runtime::on_device(self.dev, || match runtime::copy_d2h(&mut out, src) {
            0 => Ok(()),
            e => Err(e),
        })
        .map_err(rt)?;
        Ok(out)
    }

    fn load(&mut self, dst: u64, data: &[u8]) -> DrvResult<()> {
        runtime::on_device(self.dev, || match runtime::copy_h2d(dst, data) {
            0 => Ok(()),
            e => Err(e),
        })
        .map_err(rt)
    }

    fn reserve(&mut self, size: u64) -> DrvResult<u64> {
        let mut va = 0;
        // SAFETY: valid out-pointer; no fixed address requested.
        check(unsafe { (self.t.cuMemAddressReserve)(&mut va, size as usize, 0, 0, 0) })?;
        Ok(va)
    }

    fn free_va(&mut self, va: u64, size: u64) -> DrvResult<()> {
        // SAFETY: the range is a whole reservation with nothing mapped.
        check(unsafe { (self.t.cuMemAddressFree)(va, size as usize) })
    }

    fn map(&mut self, va: u64, size: u64, h: ChunkHandle) -> DrvResult<()> {
        // SAFETY: the range lies in a reservation of ours and is unmapped.
        check(unsafe { (self.t.cuMemMap)(va, size as usize, 0, h, 0) })
    }

    fn unmap(&mut self, va: u64, size: u64) -> DrvResult<()> {
        // SAFETY: the range is mapped by us and no GPU work uses it any more.
        check(unsafe { (self.t.cuMemUnmap)(va, size as usize) })
    }

    fn set_access(
        &mut self,
        va: u64,
        size: u64,
        readers: &[i32],
        revoked: &[i32],
    ) -> DrvResult<()> {
        let descs: Vec<CUmemAccessDesc> = readers
            .iter()
            .map(|d| access(*d, CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
            .chain(
                revoked
                    .iter()
                    .map(|d| access(*d, CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE)),
            )
            .collect();
        // SAFETY: the descriptors outlive the call; the range is mapped by us.
        check(unsafe { (self.t.cuMemSetAccess)(va, size as usize, descs.as_ptr(), descs.len()) })
    }
}
