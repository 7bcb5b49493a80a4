//! Every C symbol expseg exports, in one place. Each hook is a few lines: take the
//! re-entrancy guard, run [`crate::api`]'s function of the same name inside the panic
//! boundary, and either hand its answer back or call the real runtime with the program's own
//! arguments.
//!
//! `#[cfg_attr(not(test), no_mangle)]` keeps `cargo test` from hooking its own test binary.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use crate::api::{self, Answer, OUT_OF_MEMORY, UNKNOWN};
use crate::real::{next, CudaIpcMemHandle};
use crate::stats::GLOBAL;
use libc::{c_char, c_int, c_uint, c_void, size_t};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Held while a thread is inside expseg; a nested hook call takes the plain path.
struct Guard;

impl Guard {
    fn enter() -> Option<Guard> {
        INSIDE
            // No Guard may be built for a thread already inside: dropped at once, it would
            // clear the flag of the outer hook.
            .try_with(|i| if i.replace(true) { None } else { Some(Guard) })
            .ok()
            .flatten()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|i| i.set(false));
    }
}

/// Run `f`; a panic becomes `cudaErrorUnknown` and one log line instead of unwinding into C.
fn boundary(name: &str, f: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(code) => code,
        Err(_) => {
            GLOBAL.panics_caught.add(1);
            log::error!("{name}: internal error caught; returning cudaErrorUnknown");
            UNKNOWN
        }
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: size_t) -> c_int {
    let Some(_g) = Guard::enter().filter(|_| !dev_ptr.is_null()) else {
        return next::cudaMalloc(dev_ptr, size);
    };
    let once = || match api::cudaMalloc(size) {
        Answer::Done(Ok(p)) => {
            *dev_ptr = p as *mut c_void;
            0
        }
        Answer::Done(Err(e)) => e,
        Answer::PassThrough => next::cudaMalloc(dev_ptr, size),
    };
    boundary("cudaMalloc", || match once() {
        // Handles kept for PyTorch's next pages must not cost this allocation its memory.
        OUT_OF_MEMORY if api::vmm::release_kept_for_others() => {
            next::cudaGetLastError();
            once()
        }
        e => e,
    })
}

/// `cuMemUnmap` of programs that link the driver: waits while an IPC mirror refresh is
/// reading the range (`api::reads`), then the driver's own.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(va: u64, size: size_t) -> u32 {
    let Ok(t) = crate::real::driver() else {
        return NO_DRIVER;
    };
    let unmapping = catch_unwind(|| api::reads::begin_unmap(va, size as u64)).ok();
    let r = (t.cuMemUnmap)(va, size);
    drop(unmapping);
    if r == 0 {
        // Shares of runs that started here (mirrors, tickets) stand for nothing any more.
        let _ = catch_unwind(|| api::forget_foreign_range(va, size as u64));
    }
    r
}

/// `cuMemCreate` of programs that link the driver (vLLM's CuMemAllocator): the driver's own,
/// asked again after kept handles went back if it found no memory. (PyTorch's pages get
/// `crate::vmm_hooks::cuMemCreate` through the entry point API instead.)
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
    let r = (t.cuMemCreate)(h, size, prop.cast(), flags);
    if r == OUT_OF_MEMORY as u32 && catch_unwind(api::vmm::release_kept_for_others).unwrap_or(false)
    {
        return (t.cuMemCreate)(h, size, prop.cast(), flags);
    }
    r
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaFree(dev_ptr: *mut c_void) -> c_int {
    let Some(_g) = Guard::enter() else {
        return next::cudaFree(dev_ptr);
    };
    boundary("cudaFree", || match api::cudaFree(dev_ptr as u64) {
        Answer::Done(e) => e,
        Answer::PassThrough => next::cudaFree(dev_ptr),
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaIpcGetMemHandle(handle: *mut c_void, dev_ptr: *mut c_void) -> c_int {
    let Some(_g) = Guard::enter().filter(|_| !handle.is_null()) else {
        return next::cudaIpcGetMemHandle(handle, dev_ptr);
    };
    boundary("cudaIpcGetMemHandle", || {
        match api::cudaIpcGetMemHandle(dev_ptr as u64) {
            Answer::Done(Ok(bytes)) => {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), handle as *mut u8, bytes.len());
                0
            }
            Answer::Done(Err(e)) => e,
            Answer::PassThrough => {
                let e = next::cudaIpcGetMemHandle(handle, dev_ptr);
                if e != INVALID_VALUE {
                    return e;
                }
                // VMM memory of another allocator: a mirror (see api::mirror_foreign).
                match api::mirror_foreign(dev_ptr as u64) {
                    Some(Ok(bytes)) => {
                        next::cudaGetLastError();
                        std::ptr::copy_nonoverlapping(
                            bytes.as_ptr(),
                            handle as *mut u8,
                            bytes.len(),
                        );
                        0
                    }
                    Some(Err(e)) => e,
                    None => e,
                }
            }
        }
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaIpcOpenMemHandle(
    dev_ptr: *mut *mut c_void,
    handle: CudaIpcMemHandle,
    flags: c_uint,
) -> c_int {
    let Some(_g) = Guard::enter().filter(|_| !dev_ptr.is_null()) else {
        return next::cudaIpcOpenMemHandle(dev_ptr, handle, flags);
    };
    boundary("cudaIpcOpenMemHandle", || {
        match api::cudaIpcOpenMemHandle(handle.reserved) {
            Answer::Done(Ok(p)) => {
                *dev_ptr = p as *mut c_void;
                0
            }
            Answer::Done(Err(e)) => e,
            Answer::PassThrough => next::cudaIpcOpenMemHandle(dev_ptr, handle, flags),
        }
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaIpcCloseMemHandle(dev_ptr: *mut c_void) -> c_int {
    let Some(_g) = Guard::enter() else {
        return next::cudaIpcCloseMemHandle(dev_ptr);
    };
    boundary(
        "cudaIpcCloseMemHandle",
        || match api::cudaIpcCloseMemHandle(dev_ptr as u64) {
            Answer::Done(e) => e,
            Answer::PassThrough => next::cudaIpcCloseMemHandle(dev_ptr),
        },
    )
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaMemGetInfo(free: *mut size_t, total: *mut size_t) -> c_int {
    // What the program is told is free should be free: compact partly released pages first.
    if let Some(_g) = Guard::enter() {
        let _ = catch_unwind(api::vmm::settle);
    }
    let e = next::cudaMemGetInfo(free, total);
    let Some(_g) = Guard::enter().filter(|_| e == 0 && !free.is_null() && !total.is_null()) else {
        return e;
    };
    boundary("cudaMemGetInfo", || {
        let extra = api::cudaMemGetInfo() as size_t;
        *free = (*free).saturating_add(extra).min(*total);
        e
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaDeviceEnablePeerAccess(peer: c_int, flags: c_uint) -> c_int {
    let Some(_g) = Guard::enter() else {
        return next::cudaDeviceEnablePeerAccess(peer, flags);
    };
    boundary("cudaDeviceEnablePeerAccess", || {
        api::cudaDeviceEnablePeerAccess(peer, flags)
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaDeviceDisablePeerAccess(peer: c_int) -> c_int {
    let Some(_g) = Guard::enter() else {
        return next::cudaDeviceDisablePeerAccess(peer);
    };
    boundary("cudaDeviceDisablePeerAccess", || {
        api::cudaDeviceDisablePeerAccess(peer)
    })
}

// Driver queries that must describe the allocation the program made, not one chunk's mapping.

/// `cudaErrorInvalidValue`: what the runtime answers for IPC of VMM memory.
const INVALID_VALUE: c_int = 1;

/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` and `..._RANGE_SIZE`.
const RANGE_START_ADDR: c_int = 11;
const RANGE_SIZE: c_int = 12;
/// `CUDA_ERROR_NOT_INITIALIZED`: no driver to ask.
const NO_DRIVER: u32 = 3;

/// The allocation containing `ptr` if expseg made it (pool memory or a ticket mapping).
fn ours(ptr: u64) -> Option<(u64, u64)> {
    let _g = Guard::enter()?;
    catch_unwind(|| api::allocation_range(ptr)).ok().flatten()
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut u64,
    size: *mut size_t,
    ptr: u64,
) -> u32 {
    if let Some((b, s)) = ours(ptr) {
        if !base.is_null() {
            *base = b;
        }
        if !size.is_null() {
            *size = s as size_t;
        }
        return 0;
    }
    match crate::real::driver()
        .ok()
        .and_then(|t| t.cuMemGetAddressRange_v2)
    {
        Some(f) => f(base, size, ptr),
        None => NO_DRIVER,
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(data: *mut c_void, attr: c_int, ptr: u64) -> u32 {
    if attr == RANGE_START_ADDR || attr == RANGE_SIZE {
        if let Some((b, s)) = ours(ptr).filter(|_| !data.is_null()) {
            *(data as *mut u64) = if attr == RANGE_START_ADDR { b } else { s };
            return 0;
        }
    }
    match crate::real::driver()
        .ok()
        .and_then(|t| t.cuPointerGetAttribute)
    {
        Some(f) => f(data, attr, ptr),
        None => NO_DRIVER,
    }
}

/// Entry points handed out by the driver's and runtime's lookup functions: expseg's hook for
/// the functions it interposes, so programs that fetch driver functions at run time
/// (PyTorch's driver API, `cudaGetDriverEntryPoint`) reach it too.
unsafe fn redirect_entry_point(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int) {
    if symbol.is_null() || pfn.is_null() || (*pfn).is_null() {
        return;
    }
    let name = std::ffi::CStr::from_ptr(symbol).to_bytes();
    let ours: *mut c_void = match name {
        // Version 3020 introduced the size_t signature that the hook has.
        b"cuMemGetAddressRange" if version >= 3020 => cuMemGetAddressRange_v2 as *mut c_void,
        b"cuPointerGetAttribute" => cuPointerGetAttribute as *mut c_void,
        _ => match crate::vmm_hooks::for_caller(name) {
            Some(p) => p,
            None => return,
        },
    };
    *pfn = ours;
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_void,
) -> u32 {
    let Some(f) = crate::real::driver()
        .ok()
        .and_then(|t| t.cuGetProcAddress_v2)
    else {
        return NO_DRIVER;
    };
    let r = f(symbol, pfn, version, flags, status);
    if r == 0 {
        redirect_entry_point(symbol, pfn, version);
    }
    r
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaGetDriverEntryPoint(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    flags: u64,
    status: *mut c_void,
) -> c_int {
    let r = next::cudaGetDriverEntryPoint(symbol, pfn, flags, status);
    if r == 0 {
        redirect_entry_point(symbol, pfn, i32::MAX);
    }
    r
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cudaGetDriverEntryPointByVersion(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_uint,
    flags: u64,
    status: *mut c_void,
) -> c_int {
    let r = next::cudaGetDriverEntryPointByVersion(symbol, pfn, version, flags, status);
    if r == 0 {
        redirect_entry_point(symbol, pfn, version as c_int);
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
        b"cuGetProcAddress_v2" => cuGetProcAddress_v2 as *mut c_void,
        _ => return None,
    })
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
}
