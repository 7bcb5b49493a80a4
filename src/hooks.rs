//! Every C symbol expseg exports, in one place. Each hook is a few lines: take the
//! re-entrancy guard, run [`crate::api`]'s function of the same name inside the panic
//! boundary, and either hand its answer back or call the real runtime with the program's own
//! arguments.
//!
//! `#[cfg_attr(not(test), no_mangle)]` keeps `cargo test` from hooking its own test binary.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use crate::api::{self, Answer, UNKNOWN};
use crate::real::{next, CudaIpcMemHandle};
use crate::stats::GLOBAL;
use libc::{c_int, c_uint, c_void, size_t};
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
            .try_with(|i| (!i.replace(true)).then_some(Guard))
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
    boundary("cudaMalloc", || match api::cudaMalloc(size) {
        Answer::Done(Ok(p)) => {
            *dev_ptr = p as *mut c_void;
            0
        }
        Answer::Done(Err(e)) => e,
        Answer::PassThrough => next::cudaMalloc(dev_ptr, size),
    })
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
            Answer::PassThrough => next::cudaIpcGetMemHandle(handle, dev_ptr),
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
