//! Every C symbol expseg exports, in one place (the range and pointer queries in [`query`]).
//! Each hook is a few lines: take the re-entrancy guard ([`guard`]), run [`crate::api`]'s
//! function of the same name inside the panic boundary, and either hand its answer back or
//! call the real runtime with the program's own arguments.
//!
//! `#[cfg_attr(not(test), no_mangle)]` keeps `cargo test` from hooking its own test binary.
//!
//! Every `unsafe { next::... }`, `unsafe { next_driver::... }` and `unsafe { (t.cu...)(...) }`
//! block passes the program's own arguments on to the real function of the same C signature:
//! the hook's caller vouches for them (each hook's `# Safety`). Writes through the caller's
//! pointers say why in their own blocks.
#![allow(non_snake_case)]

pub(crate) mod guard;
#[macro_use]
mod order;
pub mod query;
mod streams;

use crate::api::{self, Answer, OUT_OF_MEMORY};
use crate::real::{next, next_driver, CudaIpcMemHandle};
use guard::{around_real, boundary, contained, Guard};
use libc::{c_char, c_int, c_uint, c_void, size_t};
use query::{cuMemGetAddressRange_v2, cuPointerGetAttribute, cuPointerGetAttributes};
use std::panic::catch_unwind;

/// `cudaErrorInvalidValue`: what the runtime answers for IPC of VMM memory.
const INVALID_VALUE: c_int = 1;
/// `CUDA_ERROR_NOT_INITIALIZED`: no driver to ask.
const NO_DRIVER: u32 = 3;

/// # Safety
/// As CUDA's `cudaMalloc`: `dev_ptr` must be valid for what that call reads and writes through
/// it (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: size_t) -> c_int {
    let Some(_g) = Guard::enter().filter(|_| !dev_ptr.is_null()) else {
        return unsafe { next::cudaMalloc(dev_ptr, size) };
    };
    let once = || match api::cudaMalloc(size) {
        Answer::Done(Ok(p)) => {
            // SAFETY: the caller's out-pointer (not null: checked).
            unsafe { *dev_ptr = p as *mut c_void };
            0
        }
        Answer::Done(Err(e)) => e,
        Answer::PassThrough => unsafe { next::cudaMalloc(dev_ptr, size) },
    };
    boundary("cudaMalloc", || match once() {
        // Memory held for reuse, here or in other expseg processes, must not cost this
        // allocation its memory.
        OUT_OF_MEMORY if api::make_room_runtime() => {
            unsafe { next::cudaGetLastError() };
            once()
        }
        e => e,
    })
}

/// `cuMemUnmap` of programs that link the driver: waits while an IPC mirror refresh is
/// reading the range (`api::reads`), then the driver's own.
///
/// # Safety
/// As CUDA's `cuMemUnmap`: called with the arguments CUDA documents for it (no pointer is
/// read).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(va: u64, size: size_t) -> u32 {
    let Ok(t) = crate::real::driver() else {
        return NO_DRIVER;
    };
    api::unmap_unserved(va, size as u64, || unsafe { (t.cuMemUnmap)(va, size) })
}

/// `cuMemCreate` of programs that link the driver (vLLM's CuMemAllocator): the driver's own,
/// asked again after memory held for reuse (here, or in other expseg processes) went back if
/// it found no memory. (PyTorch's pages get
/// `crate::vmm_hooks::cuMemCreate` through the entry point API instead.)
///
/// # Safety
/// As CUDA's `cuMemCreate`: `h`, `prop` must be valid for what that call reads and writes
/// through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    h: *mut u64,
    size: size_t,
    prop: *const c_void,
    flags: u64,
) -> u32 {
    let Ok(t) = crate::real::driver() else {
        return NO_DRIVER;
    };
    let r = unsafe { (t.cuMemCreate)(h, size, prop.cast(), flags) };
    let on_device = || {
        let p = prop.cast::<cudarc::driver::sys::CUmemAllocationProp>();
        let device = cudarc::driver::sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        // SAFETY: the caller's `CUmemAllocationProp`, read only where not null.
        (!p.is_null() && unsafe { (*p).location.type_ } == device)
            .then(|| unsafe { (*p).location.id })
    };
    if r == OUT_OF_MEMORY as u32
        && catch_unwind(|| api::make_room_driver(on_device())).unwrap_or(false)
    {
        return unsafe { (t.cuMemCreate)(h, size, prop.cast(), flags) };
    }
    r
}

/// # Safety
/// As CUDA's `cudaFree`: `dev_ptr` must be valid for what that call reads and writes through it
/// (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaFree(dev_ptr: *mut c_void) -> c_int {
    let Some(_g) = Guard::enter() else {
        return unsafe { next::cudaFree(dev_ptr) };
    };
    boundary("cudaFree", || match api::cudaFree(dev_ptr as u64) {
        Answer::Done(e) => e,
        Answer::PassThrough => unsafe { next::cudaFree(dev_ptr) },
    })
}

/// `cudaDeviceReset`: the pool's allocations of the device go first, as the reset destroys
/// the runtime's (`api::cudaDeviceReset`), then the real reset, then the context's id is
/// forgotten again (`api::reset_done`).
///
/// # Safety
/// As CUDA's `cudaDeviceReset`: called with the arguments CUDA documents for it (no pointer is
/// read).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaDeviceReset() -> c_int {
    let dev = around_real("cudaDeviceReset", "resetting anyway", api::cudaDeviceReset);
    let r = unsafe { next::cudaDeviceReset() };
    if let Some(Some(dev)) = dev {
        around_real("cudaDeviceReset", "the reset is done", || {
            api::reset_done(dev)
        });
    }
    r
}

/// `cuMemRetainAllocationHandle` for every caller but PyTorch's allocator (which gets the
/// VMM hook and virtual handles): NCCL registers a user buffer by the range query's base
/// (expseg answers the page PyTorch mapped) and the handle retained there, exports it and has
/// the peer map the range's size from offset 0. The driver alone would retain the larger
/// handle expseg mapped behind a run of pages, whose start is another page's. So the pages of
/// the handle behind that page get handles of their own that never move first (as for an IPC
/// handle of such memory), then the driver retains the page's. A split that fails (out of
/// memory): its code, no handle.
///
/// # Safety
/// As CUDA's `cuMemRetainAllocationHandle`: `h`, `addr` must be valid for what that call reads
/// and writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(h: *mut u64, addr: *mut c_void) -> u32 {
    let Some(f) = crate::real::driver()
        .ok()
        .and_then(|t| t.cuMemRetainAllocationHandle)
    else {
        return NO_DRIVER;
    };
    let split = around_real("cuMemRetainAllocationHandle", "asking the driver", || {
        api::vmm::isolate_page(addr as u64)
    });
    if let Some(Err(e)) = split {
        return e;
    }
    // SAFETY: the driver's own function, with the program's own arguments.
    unsafe { f(h, addr) }
}

/// `cuDevicePrimaryCtxReset_v2`: as `cudaDeviceReset`, for programs of the driver API (a
/// shared runtime's reset is served by `cudaDeviceReset`; a static runtime's reaches neither,
/// measured, and is seen afterwards by the primary context's new id: `api::notice_reset`).
///
/// # Safety
/// As CUDA's `cuDevicePrimaryCtxReset_v2`: called with the arguments CUDA documents for it (no
/// pointer is read).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: c_int) -> u32 {
    around_real("cuDevicePrimaryCtxReset_v2", "resetting anyway", || {
        api::cuDevicePrimaryCtxReset(dev)
    });
    let r = unsafe { next_driver::cuDevicePrimaryCtxReset_v2(dev) };
    around_real("cuDevicePrimaryCtxReset_v2", "the reset is done", || {
        api::reset_done(dev)
    });
    r
}

/// # Safety
/// As CUDA's `cudaIpcGetMemHandle`: `handle`, `dev_ptr` must be valid for what that call reads
/// and writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaIpcGetMemHandle(handle: *mut c_void, dev_ptr: *mut c_void) -> c_int {
    api::sharing::note_shared();
    let Some(_g) = Guard::enter().filter(|_| !handle.is_null()) else {
        return unsafe { next::cudaIpcGetMemHandle(handle, dev_ptr) };
    };
    boundary("cudaIpcGetMemHandle", || {
        match api::cudaIpcGetMemHandle(dev_ptr as u64) {
            Answer::Done(Ok(bytes)) => {
                // SAFETY: the caller's 64-byte `cudaIpcMemHandle_t` (not null: checked).
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), handle as *mut u8, bytes.len())
                };
                0
            }
            Answer::Done(Err(e)) => e,
            Answer::PassThrough => {
                let e = unsafe { next::cudaIpcGetMemHandle(handle, dev_ptr) };
                if e != INVALID_VALUE {
                    return e;
                }
                // VMM memory of another allocator: a mirror (see api::mirror_foreign).
                match api::mirror_foreign(dev_ptr as u64) {
                    Some(Ok(bytes)) => {
                        unsafe { next::cudaGetLastError() };
                        // SAFETY: the caller's 64-byte handle (not null: checked).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                bytes.as_ptr(),
                                handle as *mut u8,
                                bytes.len(),
                            )
                        };
                        0
                    }
                    Some(Err(e)) => e,
                    None => e,
                }
            }
        }
    })
}

/// # Safety
/// As CUDA's `cudaIpcOpenMemHandle`: `dev_ptr` must be valid for what that call reads and
/// writes through it (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaIpcOpenMemHandle(
    dev_ptr: *mut *mut c_void,
    handle: CudaIpcMemHandle,
    flags: c_uint,
) -> c_int {
    api::sharing::note_imported();
    let Some(_g) = Guard::enter().filter(|_| !dev_ptr.is_null()) else {
        return unsafe { next::cudaIpcOpenMemHandle(dev_ptr, handle, flags) };
    };
    boundary("cudaIpcOpenMemHandle", || {
        match api::cudaIpcOpenMemHandle(handle.reserved) {
            Answer::Done(Ok(p)) => {
                // SAFETY: the caller's out-pointer (not null: checked).
                unsafe { *dev_ptr = p as *mut c_void };
                0
            }
            Answer::Done(Err(e)) => e,
            Answer::PassThrough => unsafe { next::cudaIpcOpenMemHandle(dev_ptr, handle, flags) },
        }
    })
}

/// # Safety
/// As CUDA's `cudaIpcCloseMemHandle`: `dev_ptr` must be valid for what that call reads and
/// writes through it (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaIpcCloseMemHandle(dev_ptr: *mut c_void) -> c_int {
    let Some(_g) = Guard::enter() else {
        return unsafe { next::cudaIpcCloseMemHandle(dev_ptr) };
    };
    boundary(
        "cudaIpcCloseMemHandle",
        || match api::cudaIpcCloseMemHandle(dev_ptr as u64) {
            Answer::Done(e) => e,
            Answer::PassThrough => unsafe { next::cudaIpcCloseMemHandle(dev_ptr) },
        },
    )
}

/// # Safety
/// As CUDA's `cudaMemGetInfo`: `free`, `total` must be valid for what that call reads and
/// writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaMemGetInfo(free: *mut size_t, total: *mut size_t) -> c_int {
    // The guard is held across the real call too: the runtime's own `cuMemGetInfo` must not
    // add the cached bytes a second time (see `cuMemGetInfo_v2`).
    let Some(_g) = Guard::enter() else {
        return unsafe { next::cudaMemGetInfo(free, total) };
    };
    // SAFETY: the caller's own pointers, checked there before they are written.
    unsafe {
        mem_get_info(
            "cudaMemGetInfo",
            free,
            total,
            || next::cudaMemGetInfo(free, total),
            api::cudaMemGetInfo,
        )
    }
}

/// Free memory as the runtime (`cudaMemGetInfo`) or the driver (`cuMemGetInfo_v2`) tells it,
/// inside the hook's guard: what the program is told is free should be free, so partly
/// released pages are compacted first; after the real call answered (`real`, 0 and both
/// pointers non-null) the bytes the pool keeps cached (`cached`: this process can allocate
/// them) are added, capped at the total.
unsafe fn mem_get_info(
    name: &str,
    free: *mut size_t,
    total: *mut size_t,
    real: impl FnOnce() -> c_int,
    cached: fn() -> u64,
) -> c_int {
    let _ = catch_unwind(api::vmm::settle);
    let e = real();
    if e != 0 || free.is_null() || total.is_null() {
        return e;
    }
    boundary(name, || {
        // SAFETY: the caller's out-pointers (not null: checked), which the real call wrote.
        unsafe { *free = (*free).saturating_add(cached() as size_t).min(*total) };
        e
    })
}

/// # Safety
/// As CUDA's `cudaDeviceEnablePeerAccess`: called with the arguments CUDA documents for it (no
/// pointer is read).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaDeviceEnablePeerAccess(peer: c_int, flags: c_uint) -> c_int {
    let Some(_g) = Guard::enter() else {
        return unsafe { next::cudaDeviceEnablePeerAccess(peer, flags) };
    };
    boundary("cudaDeviceEnablePeerAccess", || {
        api::cudaDeviceEnablePeerAccess(peer, flags)
    })
}

/// # Safety
/// As CUDA's `cudaDeviceDisablePeerAccess`: called with the arguments CUDA documents for it (no
/// pointer is read).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaDeviceDisablePeerAccess(peer: c_int) -> c_int {
    let Some(_g) = Guard::enter() else {
        return unsafe { next::cudaDeviceDisablePeerAccess(peer) };
    };
    boundary("cudaDeviceDisablePeerAccess", || {
        api::cudaDeviceDisablePeerAccess(peer)
    })
}

// The driver's allocation entry points, for programs that reach the driver themselves: linked
// against `libcuda`, `dlsym` on it, `cuGetProcAddress`, a statically linked runtime. A call
// made while the thread is inside expseg (the real runtime allocating on behalf of a
// pass-through `cudaMalloc`) is the driver's own; so is every call of a shared runtime, which
// is given the driver's functions at lookup (`driver_hook_for`).

/// `boundary` for driver hooks: a panic becomes `CUDA_ERROR_UNKNOWN` (999, as the runtime's).
fn driver_boundary(name: &str, f: impl FnOnce() -> u32) -> u32 {
    boundary(name, || f() as c_int) as u32
}

/// # Safety
/// As CUDA's `cuMemAlloc_v2`: `dptr` must be valid for what that call reads and writes through
/// it (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: size_t) -> u32 {
    let Some(_g) = Guard::enter().filter(|_| !dptr.is_null()) else {
        return unsafe { next_driver::cuMemAlloc_v2(dptr, size) };
    };
    let once = || match api::cuMemAlloc(size) {
        Answer::Done(Ok(p)) => {
            // SAFETY: the caller's out-pointer (not null: checked).
            unsafe { *dptr = p };
            0
        }
        Answer::Done(Err(e)) => e,
        Answer::PassThrough => unsafe { next_driver::cuMemAlloc_v2(dptr, size) },
    };
    driver_boundary("cuMemAlloc_v2", || match once() {
        // Memory held for reuse, here or in other expseg processes, must not cost this
        // allocation its memory.
        api::DRV_OUT_OF_MEMORY if api::make_room_driver(None) => once(),
        e => e,
    })
}

/// # Safety
/// As CUDA's `cuMemFree_v2`: called with the arguments CUDA documents for it (no pointer is
/// read).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: u64) -> u32 {
    let Some(_g) = Guard::enter() else {
        return unsafe { next_driver::cuMemFree_v2(dptr) };
    };
    driver_boundary("cuMemFree_v2", || match api::cuMemFree(dptr) {
        Answer::Done(e) => e,
        Answer::PassThrough => unsafe { next_driver::cuMemFree_v2(dptr) },
    })
}

/// # Safety
/// As CUDA's `cuMemGetInfo_v2`: `free`, `total` must be valid for what that call reads and
/// writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut size_t, total: *mut size_t) -> u32 {
    let Some(_g) = Guard::enter() else {
        return unsafe { next_driver::cuMemGetInfo_v2(free, total) };
    };
    let _ = catch_unwind(api::notice_reset_here);
    // SAFETY: the caller's own pointers, checked there before they are written.
    unsafe {
        mem_get_info(
            "cuMemGetInfo_v2",
            free,
            total,
            || next_driver::cuMemGetInfo_v2(free, total) as c_int,
            api::cuMemGetInfo,
        ) as u32
    }
}

/// # Safety
/// As CUDA's `cuMemAllocPitch_v2`: `dptr`, `pitch` must be valid for what that call reads and
/// writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut u64,
    pitch: *mut size_t,
    width: size_t,
    height: size_t,
    elem: c_uint,
) -> u32 {
    let Some(_g) = Guard::enter().filter(|_| !dptr.is_null() && !pitch.is_null()) else {
        return unsafe { next_driver::cuMemAllocPitch_v2(dptr, pitch, width, height, elem) };
    };
    // The driver's pitch for this width: one row of it, freed again.
    let probe = || {
        let (mut p, mut row) = (0u64, 0 as size_t);
        match unsafe { next_driver::cuMemAllocPitch_v2(&mut p, &mut row, width, 1, elem) } {
            0 => {
                unsafe { next_driver::cuMemFree_v2(p) };
                Ok(row)
            }
            e => Err(e),
        }
    };
    let once = || match api::cuMemAllocPitch(width, height, probe) {
        Answer::Done(Ok((p, row))) => {
            // SAFETY: the caller's out-pointers (not null: checked).
            unsafe {
                *dptr = p;
                *pitch = row;
            }
            0
        }
        Answer::Done(Err(e)) => e,
        Answer::PassThrough => unsafe {
            next_driver::cuMemAllocPitch_v2(dptr, pitch, width, height, elem)
        },
    };
    driver_boundary("cuMemAllocPitch_v2", || match once() {
        // As cuMemAlloc_v2: memory held for reuse must not cost this allocation its memory.
        api::DRV_OUT_OF_MEMORY if api::make_room_driver(None) => once(),
        e => e,
    })
}

// Legacy IPC at the driver, for programs with a static runtime or on the driver API: the same
// policies as the runtime's calls (a pool allocation is mirrored and ticketed; a ticketed
// handle opens the producer's memory). Other pointers and plain handles are the driver's.
// These act on pool memory and tickets only, so they are handed out whatever
// `EXPSEG_DRIVER_API` says: a pool pointer reaches the driver's IPC from a static runtime
// even when the pool was filled by the shared runtime's `cudaMalloc` (NCCL does that).

/// # Safety
/// As CUDA's `cuIpcGetMemHandle`: `handle` must be valid for what that call reads and writes
/// through it (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut c_void, dptr: u64) -> u32 {
    api::sharing::note_shared();
    let Some(_g) = Guard::enter().filter(|_| !handle.is_null()) else {
        return unsafe { next_driver::cuIpcGetMemHandle(handle, dptr) };
    };
    driver_boundary("cuIpcGetMemHandle", || {
        match api::cudaIpcGetMemHandle(dptr) {
            Answer::Done(Ok(bytes)) => {
                // SAFETY: the caller's 64-byte `cudaIpcMemHandle_t` (not null: checked).
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), handle as *mut u8, bytes.len())
                };
                0
            }
            // The runtime's codes for these answers are the driver's numbers too (1, 2, 400,
            // 801, 999).
            Answer::Done(Err(e)) => e as u32,
            Answer::PassThrough => unsafe { next_driver::cuIpcGetMemHandle(handle, dptr) },
        }
    })
}

/// # Safety
/// As CUDA's `cuIpcOpenMemHandle_v2`: `dptr` must be valid for what that call reads and writes
/// through it (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    dptr: *mut u64,
    handle: CudaIpcMemHandle,
    flags: c_uint,
) -> u32 {
    api::sharing::note_imported();
    let Some(_g) = Guard::enter().filter(|_| !dptr.is_null()) else {
        return unsafe { next_driver::cuIpcOpenMemHandle_v2(dptr, handle, flags) };
    };
    driver_boundary(
        "cuIpcOpenMemHandle_v2",
        || match api::cudaIpcOpenMemHandle(handle.reserved) {
            Answer::Done(Ok(p)) => {
                // SAFETY: the caller's out-pointer (not null: checked).
                unsafe { *dptr = p };
                0
            }
            Answer::Done(Err(e)) => e as u32,
            Answer::PassThrough => unsafe {
                next_driver::cuIpcOpenMemHandle_v2(dptr, handle, flags)
            },
        },
    )
}

/// # Safety
/// As CUDA's `cuIpcCloseMemHandle`: called with the arguments CUDA documents for it (no pointer
/// is read).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: u64) -> u32 {
    let Some(_g) = Guard::enter() else {
        return unsafe { next_driver::cuIpcCloseMemHandle(dptr) };
    };
    driver_boundary("cuIpcCloseMemHandle", || {
        match api::cudaIpcCloseMemHandle(dptr) {
            Answer::Done(e) => e as u32,
            Answer::PassThrough => unsafe { next_driver::cuIpcCloseMemHandle(dptr) },
        }
    })
}

/// # Safety
/// As CUDA's `cuCtxEnablePeerAccess`: `peer` must be valid for what that call reads and writes
/// through it (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: *mut c_void, flags: c_uint) -> u32 {
    let e = unsafe { next_driver::cuCtxEnablePeerAccess(peer, flags) };
    let Some(_g) = Guard::enter() else {
        return e;
    };
    driver_boundary("cuCtxEnablePeerAccess", || {
        api::cuCtxEnablePeerAccess(peer as usize, e);
        e
    })
}

/// # Safety
/// As CUDA's `cuCtxDisablePeerAccess`: `peer` must be valid for what that call reads and writes
/// through it (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxDisablePeerAccess(peer: *mut c_void) -> u32 {
    let e = unsafe { next_driver::cuCtxDisablePeerAccess(peer) };
    let Some(_g) = Guard::enter() else {
        return e;
    };
    driver_boundary("cuCtxDisablePeerAccess", || {
        api::cuCtxDisablePeerAccess(peer as usize, e);
        e
    })
}

/// The driver allocation hook for a looked-up `name` (the base name with `version`, as
/// `cuGetProcAddress` takes it, or the versioned symbol name), if the caller at `caller` may
/// have it: a shared runtime (`libcudart*.so*`) always gets the driver's own function,
/// because expseg already serves its program at the runtime level and its internal calls
/// (a pass-through `cudaMalloc`'s `cuMemAlloc`) must reach the driver exactly once.
fn driver_hook_for(
    name: &[u8],
    version: c_int,
    caller: impl FnOnce() -> Option<usize>,
) -> Option<*mut c_void> {
    // Version 3020 introduced the 64-bit `CUdeviceptr` and `size_t` signatures of the hooks;
    // these functions have no `_ptds` variants, so the lookup flags do not matter.
    let hook = match name {
        b"cuMemAlloc" if version >= 3020 => cuMemAlloc_v2 as *mut c_void,
        b"cuMemFree" if version >= 3020 => cuMemFree_v2 as *mut c_void,
        b"cuMemGetInfo" if version >= 3020 => cuMemGetInfo_v2 as *mut c_void,
        b"cuMemAllocPitch" if version >= 3020 => cuMemAllocPitch_v2 as *mut c_void,
        b"cuMemAllocPitch_v2" => cuMemAllocPitch_v2 as *mut c_void,
        b"cuMemAlloc_v2" => cuMemAlloc_v2 as *mut c_void,
        b"cuMemFree_v2" => cuMemFree_v2 as *mut c_void,
        b"cuMemGetInfo_v2" => cuMemGetInfo_v2 as *mut c_void,
        // IPC: `cuIpcOpenMemHandle` is the `_v2` signature from 11000 on.
        b"cuIpcGetMemHandle" => cuIpcGetMemHandle as *mut c_void,
        b"cuIpcOpenMemHandle" if version >= 11000 => cuIpcOpenMemHandle_v2 as *mut c_void,
        b"cuIpcOpenMemHandle_v2" => cuIpcOpenMemHandle_v2 as *mut c_void,
        b"cuIpcCloseMemHandle" => cuIpcCloseMemHandle as *mut c_void,
        b"cuCtxEnablePeerAccess" => cuCtxEnablePeerAccess as *mut c_void,
        b"cuCtxDisablePeerAccess" => cuCtxDisablePeerAccess as *mut c_void,
        // The reset's `_v2` (11000) has the same argument; the pool's memory goes first.
        b"cuDevicePrimaryCtxReset" if version >= 11000 => cuDevicePrimaryCtxReset_v2 as *mut c_void,
        b"cuMemRetainAllocationHandle" => cuMemRetainAllocationHandle as *mut c_void,
        b"cuDevicePrimaryCtxReset_v2" => cuDevicePrimaryCtxReset_v2 as *mut c_void,
        _ => return None,
    };
    match caller() {
        Some(pc) if crate::real::in_shared_runtime(pc) => None,
        _ => Some(hook),
    }
}

/// What a lookup hands out after a panic in [`redirect_entry_point`]: `*pfn` is written last,
/// so the caller keeps the function the real lookup found.
const REAL_FOUND: &str = "the real lookup's function is handed out";

/// Entry points handed out by the driver's and runtime's lookup functions: expseg's hook for
/// the functions it interposes, so programs that fetch driver functions at run time
/// (PyTorch's driver API, `cudaGetDriverEntryPoint`) reach it too. A panic inside leaves
/// `*pfn` as the real lookup wrote it (it is written last).
///
/// PyTorch's VMM hooks are handed out only by the runtime's entry point API
/// (`runtime_api`), never by `cuGetProcAddress`: the runtime itself, NCCL and Triton look
/// their VMM functions up there and must keep the driver's (docs/contract.md).
unsafe fn redirect_entry_point(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    runtime_api: bool,
) {
    // SAFETY: `pfn` is the lookup's out-pointer, read where not null.
    if symbol.is_null() || pfn.is_null() || unsafe { (*pfn).is_null() } {
        return;
    }
    // SAFETY: the lookup's symbol name, NUL-terminated (the call's contract; not null).
    let name = unsafe { std::ffi::CStr::from_ptr(symbol) }.to_bytes();
    // SAFETY: checked above; the real lookup wrote it.
    let before = unsafe { *pfn };
    // SAFETY: as above.
    unsafe { redirect_by_name(name, pfn, version, runtime_api) };
    // Which memory functions a program fetches, and whether it got expseg's: the first
    // question when a program's memory does not reach the pool (EXPSEG_LOG=expseg=debug).
    // (Lookups come early, during the runtime's initialisation: reading the configuration
    // starts the logger.)
    if (name.starts_with(b"cuMem") || name.starts_with(b"cuIpc"))
        && catch_unwind(api::config).is_ok()
    {
        log::debug!(
            "lookup {} (version {version}, {}): {}",
            String::from_utf8_lossy(name),
            if runtime_api {
                "entry point API"
            } else {
                "cuGetProcAddress"
            },
            if unsafe { *pfn } == before {
                "the driver's"
            } else {
                "expseg's"
            }
        );
    }
}

unsafe fn redirect_by_name(name: &[u8], pfn: *mut *mut c_void, version: c_int, runtime_api: bool) {
    // SAFETY (every read and write of `*pfn` here): the lookup's out-pointer, not null
    // (the caller's check), holding the real lookup's answer.
    // The program's orderings (synchronizes, event records): whatever variant was found.
    if let Some(p) = order::for_lookup(name, unsafe { *pfn })
        .or_else(|| streams::for_lookup(name, unsafe { *pfn }))
    {
        unsafe { *pfn = p };
        return;
    }
    let ours: *mut c_void = match name {
        // Version 3020 introduced the size_t signature that the hook has.
        b"cuMemGetAddressRange" if version >= 3020 => cuMemGetAddressRange_v2 as *mut c_void,
        b"cuPointerGetAttribute" => cuPointerGetAttribute as *mut c_void,
        b"cuPointerGetAttributes" => cuPointerGetAttributes as *mut c_void,
        // A runtime that looks up the lookup function itself (CUDA 12's runtime asks for
        // `cuGetProcAddress` at version 12000 and gets `_v2`) keeps going through expseg.
        b"cuGetProcAddress" if version >= 12000 => cuGetProcAddress_v2 as *mut c_void,
        b"cuGetProcAddress" => cuGetProcAddress as *mut c_void,
        // PyTorch's table first (its retain hook answers virtual handles; every other caller's
        // retain gets real ones), then the driver hooks.
        _ => match runtime_api
            .then(|| crate::vmm_hooks::for_caller(name, version))
            .flatten()
            .or_else(|| driver_hook_for(name, version, crate::vmm_hooks::caller_pc))
            .or_else(|| order::seen_for_lookup(name, unsafe { *pfn }))
        {
            Some(p) => p,
            None => return,
        },
    };
    unsafe { *pfn = ours };
}

/// `cuGetProcAddress` (before CUDA 12: no status argument).
///
/// # Safety
/// As CUDA's `cuGetProcAddress`: `symbol`, `pfn` must be valid for what that call reads and
/// writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> u32 {
    let r = unsafe { next_driver::cuGetProcAddress(symbol, pfn, version, flags) };
    if r == 0 {
        contained("cuGetProcAddress", REAL_FOUND, || {
            // SAFETY: the lookup's own arguments, which the real lookup just answered.
            unsafe { redirect_entry_point(symbol, pfn, version, false) }
        });
    }
    r
}

/// # Safety
/// As CUDA's `cuGetProcAddress_v2`: `symbol`, `pfn`, `status` must be valid for what that call
/// reads and writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_void,
) -> u32 {
    let r = unsafe { next_driver::cuGetProcAddress_v2(symbol, pfn, version, flags, status) };
    if r == 0 {
        contained("cuGetProcAddress_v2", REAL_FOUND, || {
            // SAFETY: the lookup's own arguments, which the real lookup just answered.
            unsafe { redirect_entry_point(symbol, pfn, version, false) }
        });
    }
    r
}

/// # Safety
/// As CUDA's `cudaGetDriverEntryPoint`: `symbol`, `pfn`, `status` must be valid for what that
/// call reads and writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaGetDriverEntryPoint(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    flags: u64,
    status: *mut c_void,
) -> c_int {
    let r = unsafe { next::cudaGetDriverEntryPoint(symbol, pfn, flags, status) };
    if r == 0 {
        contained("cudaGetDriverEntryPoint", REAL_FOUND, || {
            // SAFETY: the lookup's own arguments, which the real lookup just answered.
            unsafe { redirect_entry_point(symbol, pfn, i32::MAX, true) }
        });
    }
    r
}

/// # Safety
/// As CUDA's `cudaGetDriverEntryPointByVersion`: `symbol`, `pfn`, `status` must be valid for
/// what that call reads and writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaGetDriverEntryPointByVersion(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_uint,
    flags: u64,
    status: *mut c_void,
) -> c_int {
    let r = unsafe { next::cudaGetDriverEntryPointByVersion(symbol, pfn, version, flags, status) };
    if r == 0 {
        contained("cudaGetDriverEntryPointByVersion", REAL_FOUND, || {
            // SAFETY: the lookup's own arguments, which the real lookup just answered.
            unsafe { redirect_entry_point(symbol, pfn, version as c_int, true) }
        });
    }
    r
}

/// expseg's hook for an interposed function name, for `dlsym` on a runtime or driver handle
/// (see `crate::dlsym`).
pub fn replacement(name: &[u8]) -> Option<*mut c_void> {
    Some(match name {
        b"cudaMalloc" => cudaMalloc as *mut c_void,
        b"cudaFree" => cudaFree as *mut c_void,
        b"cudaIpcGetMemHandle" => cudaIpcGetMemHandle as *mut c_void,
        b"cudaIpcOpenMemHandle" => cudaIpcOpenMemHandle as *mut c_void,
        b"cudaIpcCloseMemHandle" => cudaIpcCloseMemHandle as *mut c_void,
        b"cudaMemGetInfo" => cudaMemGetInfo as *mut c_void,
        b"cudaDeviceEnablePeerAccess" => cudaDeviceEnablePeerAccess as *mut c_void,
        b"cudaDeviceDisablePeerAccess" => cudaDeviceDisablePeerAccess as *mut c_void,
        b"cudaGetDriverEntryPoint" => cudaGetDriverEntryPoint as *mut c_void,
        b"cudaGetDriverEntryPointByVersion" => cudaGetDriverEntryPointByVersion as *mut c_void,
        b"cuMemGetAddressRange_v2" => cuMemGetAddressRange_v2 as *mut c_void,
        b"cuPointerGetAttribute" => cuPointerGetAttribute as *mut c_void,
        b"cuPointerGetAttributes" => cuPointerGetAttributes as *mut c_void,
        b"cuGetProcAddress_v2" => cuGetProcAddress_v2 as *mut c_void,
        b"cuGetProcAddress" => cuGetProcAddress as *mut c_void,
        b"cuMemAlloc_v2" => cuMemAlloc_v2 as *mut c_void,
        b"cuMemFree_v2" => cuMemFree_v2 as *mut c_void,
        b"cuMemGetInfo_v2" => cuMemGetInfo_v2 as *mut c_void,
        b"cuMemAllocPitch_v2" => cuMemAllocPitch_v2 as *mut c_void,
        b"cuIpcGetMemHandle" => cuIpcGetMemHandle as *mut c_void,
        b"cuIpcOpenMemHandle_v2" => cuIpcOpenMemHandle_v2 as *mut c_void,
        b"cuIpcCloseMemHandle" => cuIpcCloseMemHandle as *mut c_void,
        b"cuCtxEnablePeerAccess" => cuCtxEnablePeerAccess as *mut c_void,
        b"cuCtxDisablePeerAccess" => cuCtxDisablePeerAccess as *mut c_void,
        b"cuDevicePrimaryCtxReset_v2" => cuDevicePrimaryCtxReset_v2 as *mut c_void,
        b"cuMemRetainAllocationHandle" => cuMemRetainAllocationHandle as *mut c_void,
        b"cudaDeviceReset" => cudaDeviceReset as *mut c_void,
        b"cuCtxSynchronize" => order::cuCtxSynchronize as *mut c_void,
        b"cuStreamSynchronize" => order::cuStreamSynchronize as *mut c_void,
        b"cuStreamSynchronize_ptsz" => order::cuStreamSynchronize_ptsz as *mut c_void,
        b"cuEventSynchronize" => order::cuEventSynchronize as *mut c_void,
        b"cuEventRecord" => order::cuEventRecord as *mut c_void,
        b"cuEventRecord_ptsz" => order::cuEventRecord_ptsz as *mut c_void,
        b"cuEventRecordWithFlags" => order::cuEventRecordWithFlags as *mut c_void,
        b"cuEventRecordWithFlags_ptsz" => order::cuEventRecordWithFlags_ptsz as *mut c_void,
        b"cuIpcGetEventHandle" => order::cuIpcGetEventHandle as *mut c_void,
        b"cuMemGetHandleForAddressRange" => order::cuMemGetHandleForAddressRange as *mut c_void,
        b"cuStreamCreate" => streams::cuStreamCreate as *mut c_void,
        b"cuStreamCreateWithPriority" => streams::cuStreamCreateWithPriority as *mut c_void,
        b"cuStreamDestroy" => streams::cuStreamDestroy as *mut c_void,
        b"cuStreamDestroy_v2" => streams::cuStreamDestroy_v2 as *mut c_void,
        _ => return None,
    })
}

/// For `dlsym` on a driver handle: whether the caller at `caller` gets `name`'s hook. The
/// driver's allocation functions are withheld from shared runtimes (see `driver_hook_for`).
pub fn driver_lookup_allowed(name: &[u8], caller: usize) -> bool {
    match name {
        b"cuMemAlloc_v2"
        | b"cuMemFree_v2"
        | b"cuMemGetInfo_v2"
        | b"cuMemAllocPitch_v2"
        | b"cuIpcGetMemHandle"
        | b"cuIpcOpenMemHandle_v2"
        | b"cuIpcCloseMemHandle"
        | b"cuCtxEnablePeerAccess"
        | b"cuCtxDisablePeerAccess" => driver_hook_for(name, c_int::MAX, || Some(caller)).is_some(),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nested_entry_leaves_the_outer_guard_in_force() {
        let outer = Guard::enter().expect("first entry");
        assert!(
            Guard::enter().is_none(),
            "nested entry takes the plain path"
        );
        assert!(
            Guard::enter().is_none(),
            "and does not clear the flag for the next one"
        );
        drop(outer);
        assert!(Guard::enter().is_some());
    }

    #[test]
    fn shared_runtimes_are_told_apart_from_other_callers() {
        for yes in [
            &b"/usr/local/cuda/lib64/libcudart.so.13"[..],
            b"libcudart.so.12",
            b"/site-packages/torch/lib/libcudart-9335f6a2.so.12",
        ] {
            assert!(api::is_shared_runtime_file(yes), "{yes:?}");
        }
        for no in [
            &b"/usr/bin/python3"[..],
            b"/site-packages/cupy/_core/core.cpython-312-x86_64-linux-gnu.so",
            b"libcudart_static.a",
            b"libcuda.so.1",
            b"",
        ] {
            assert!(!api::is_shared_runtime_file(no), "{no:?}");
        }
    }
}
