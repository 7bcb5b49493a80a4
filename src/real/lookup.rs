//! The bottom floor: glibc's own `dlsym` (found with `dlvsym`, which expseg does not
//! interpose), for lookups that must not pass through expseg's exported `dlsym`.

use libc::{c_char, c_void};
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

/// The real `dlsym`, read by the trampoline (null: not found, or not looked for yet).
pub(crate) static EXPSEG_REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// Set once the real `dlsym` was looked for: a miss is not looked for again (glibc is loaded
/// before any code runs, so a later search would find no more).
static LOOKED: AtomicBool = AtomicBool::new(false);

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's own `dlsym`, found with `dlvsym` (which expseg does not interpose): in the objects
/// after expseg, `libc.so.6` (glibc 2.34 on) and `libdl.so.2` (before). Null where none has
/// it, which one stderr line says: then `dlsym` answers null for what expseg does not serve
/// (`crate::dlsym`), and expseg finds no runtime to pass calls on to.
pub(crate) fn real_ptr() -> *mut c_void {
    let p = EXPSEG_REAL_DLSYM.load(Ordering::Acquire);
    if !p.is_null() || LOOKED.load(Ordering::Acquire) {
        return p;
    }
    let mut found = std::ptr::null_mut();
    // SAFETY: dlopen/dlvsym with constant NUL-terminated strings; RTLD_NOLOAD loads nothing.
    let handles = unsafe {
        [
            libc::RTLD_NEXT,
            libc::dlopen(c"libc.so.6".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD),
            libc::dlopen(c"libdl.so.2".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD),
        ]
    };
    'search: for h in handles {
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
    if !LOOKED.swap(true, Ordering::AcqRel) && found.is_null() {
        let line = b"expseg: glibc's dlsym was not found; dlsym answers null for every name and expseg passes no call on\n";
        // SAFETY: writes a constant buffer to stderr (no allocation: this may run at load).
        unsafe {
            libc::write(2, line.as_ptr().cast(), line.len());
        }
    }
    found
}

/// Forget the real `dlsym`, as if it had not been found (for a test in a forked child; the
/// test runs where the redirecting `dlsym` is built: x86-64).
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) fn forget_real_dlsym() {
    LOOKED.store(true, Ordering::Release);
    EXPSEG_REAL_DLSYM.store(std::ptr::null_mut(), Ordering::Release);
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
