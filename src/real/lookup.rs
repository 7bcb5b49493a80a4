//! The bottom floor: glibc's own `dlsym` (found with `dlvsym`, which expseg does not
//! interpose), for lookups that must not pass through expseg's exported `dlsym`.

use libc::{c_char, c_void};
use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, Ordering};

/// The real `dlsym`, read by the trampoline.
pub(crate) static EXPSEG_REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's own `dlsym`, found with `dlvsym` (which expseg does not interpose).
pub(crate) fn real_ptr() -> *mut c_void {
    let p = EXPSEG_REAL_DLSYM.load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    let mut found = std::ptr::null_mut();
    // SAFETY: dlopen/dlvsym with constant NUL-terminated strings.
    let libc_handle =
        unsafe { libc::dlopen(c"libc.so.6".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    'search: for h in [libc::RTLD_NEXT, libc_handle] {
        for v in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            if h.is_null() {
                continue;
            }
            // SAFETY: as above.
            found = unsafe { libc::dlvsym(h, c"dlsym".as_ptr(), v.as_ptr()) };
            if !found.is_null() {
                break 'search;
            }
        }
    }
    EXPSEG_REAL_DLSYM.store(found, Ordering::Release);
    found
}

/// Look `name` up in `handle` with the real `dlsym`, never redirected: what expseg uses to
/// find the functions it stands in front of.
///
/// # Safety
/// `handle` must be `RTLD_DEFAULT`, `RTLD_NEXT` or a live `dlopen` handle.
pub unsafe fn real(handle: *mut c_void, name: &CStr) -> *mut c_void {
    let p = real_ptr();
    if p.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: `p` is glibc's dlsym; `name` is NUL-terminated.
    unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p)(handle, name.as_ptr()) }
}
