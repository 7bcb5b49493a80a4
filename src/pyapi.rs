//! C functions for the Python module (`python/expseg`, through ctypes): live figures while
//! the program runs, and giving held memory back. Exported under `expseg_` names that no CUDA library uses.

use crate::api;
use libc::{c_char, c_int, size_t};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The path this library was loaded from, with links resolved.
fn own_path() -> String {
    let Some(name) = crate::real::self_file() else {
        return String::new();
    };
    std::fs::canonicalize(&name)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or(name)
}

/// Write the live report (JSON, see `api::live_report_json`) into `buf` of `len` bytes,
/// NUL-terminated and cut if it does not fit; returns the report's full length without the
/// NUL (so a caller whose buffer was too small asks again with more), 0 on an internal error.
///
/// # Safety
/// `buf` is null or writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn expseg_stats_json(buf: *mut c_char, len: size_t) -> size_t {
    let Ok(json) = catch_unwind(AssertUnwindSafe(|| api::live_report_json(&own_path()))) else {
        return 0;
    };
    if !buf.is_null() && len > 0 {
        let n = json.len().min(len - 1);
        // SAFETY: `buf` is writable for `len` > n bytes; the source is `n` bytes of `json`.
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    json.len()
}

/// `expseg.trim()`: give back to the driver now everything held beyond the program's live
/// memory on every device (kept handles, cached blocks, stranded pages): the bytes given
/// back; 0 on an internal error.
#[no_mangle]
pub extern "C" fn expseg_trim() -> u64 {
    catch_unwind(api::trim::trim_all).unwrap_or(0)
}

/// The library's version (Cargo.toml's), NUL-terminated, static.
#[no_mangle]
pub extern "C" fn expseg_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// A tag name from C: None for null; `Err` for a name that is not UTF-8 or empty.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
unsafe fn tag_arg(tag: *const c_char) -> Result<Option<u32>, ()> {
    if tag.is_null() {
        return Ok(None);
    }
    // SAFETY: not null, and NUL-terminated (this function's contract).
    match unsafe { std::ffi::CStr::from_ptr(tag) }.to_str() {
        Ok(s) if !s.is_empty() => Ok(Some(api::sleep::tag_of(s))),
        _ => Err(()),
    }
}

/// `CUDA_ERROR_INVALID_VALUE`, and the code of an internal error.
const INVALID_VALUE: c_int = 1;
const UNKNOWN: c_int = 999;

/// Write a pause or resume outcome (also what a failed one did anyway) and turn it into the
/// C answer.
///
/// # Safety
/// `bytes` and `seconds` are null or writable.
unsafe fn outcome(
    r: std::thread::Result<Result<api::sleep::Outcome, api::sleep::Failed>>,
    bytes: *mut u64,
    seconds: *mut f64,
) -> c_int {
    let (o, code) = match r {
        Ok(Ok(o)) => (o, 0),
        Ok(Err(f)) => (f.done, f.code as c_int),
        Err(_) => return UNKNOWN,
    };
    // SAFETY (both writes): writable where not null (this function's contract).
    if !bytes.is_null() {
        unsafe { *bytes = o.bytes };
    }
    if !seconds.is_null() {
        unsafe { *seconds = o.seconds };
    }
    code
}

/// `expseg.pause()`: pause the memory of tag `tag` (null: every tag) on every device — wait
/// for the device, copy the live bytes to page-locked host memory (`discard` = 0) or drop
/// them, give the physical memory back; addresses stay reserved. Memory shared with other
/// processes is left alone. 0, or a CUDA error code (2: no host memory). `bytes`/`seconds`
/// (either may be null) get the bytes paused and the time taken, also when it fails (what
/// paused before the failure stays paused).
///
/// # Safety
/// `tag` is null or a NUL-terminated string; `bytes`, `seconds` null or writable.
#[no_mangle]
pub unsafe extern "C" fn expseg_pause(
    tag: *const c_char,
    discard: c_int,
    bytes: *mut u64,
    seconds: *mut f64,
) -> c_int {
    // SAFETY: `tag` is null or NUL-terminated (this function's contract).
    let Ok(tag) = (unsafe { tag_arg(tag) }) else {
        return INVALID_VALUE;
    };
    let r = catch_unwind(|| api::sleep::pause(tag, discard != 0, true));
    // SAFETY: `bytes`, `seconds` null or writable (this function's contract).
    unsafe { outcome(r, bytes, seconds) }
}

/// `expseg.resume()`: make paused memory of tag `tag` (null: all) again at the same
/// addresses, with its bytes. 0, or 2 when memory is short: what could be made is resumed
/// (`bytes` says how much), the rest stays paused with its host copy (call again).
///
/// # Safety
/// As `expseg_pause`.
#[no_mangle]
pub unsafe extern "C" fn expseg_resume(
    tag: *const c_char,
    bytes: *mut u64,
    seconds: *mut f64,
) -> c_int {
    // SAFETY: as in `expseg_pause`.
    let Ok(tag) = (unsafe { tag_arg(tag) }) else {
        return INVALID_VALUE;
    };
    let r = catch_unwind(|| api::sleep::resume(tag));
    // SAFETY: as in `expseg_pause`.
    unsafe { outcome(r, bytes, seconds) }
}

/// Bytes paused now, every device.
#[no_mangle]
pub extern "C" fn expseg_paused_bytes() -> u64 {
    catch_unwind(|| api::sleep::paused_bytes(true)).unwrap_or(0)
}

/// The calling thread's allocations from now on carry tag `tag` (null: none). 0, or 1 for
/// a name that is empty or not UTF-8.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn expseg_set_tag(tag: *const c_char) -> c_int {
    // SAFETY: `tag` is null or NUL-terminated (this function's contract).
    match unsafe { tag_arg(tag) } {
        Ok(t) => match catch_unwind(|| api::sleep::set_tag(t)) {
            Ok(_) => 0,
            Err(_) => UNKNOWN,
        },
        Err(()) => INVALID_VALUE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::sleep::{Failed, Outcome};

    #[test]
    fn a_failed_pause_or_resume_still_says_what_it_did() {
        let done = Outcome {
            bytes: 3 << 30,
            seconds: 0.5,
            ..Outcome::default()
        };
        let (mut bytes, mut seconds) = (0u64, 0f64);
        // SAFETY: both out-pointers are live locals.
        let code = unsafe { outcome(Ok(Err(Failed { code: 2, done })), &mut bytes, &mut seconds) };
        assert_eq!((code, bytes, seconds), (2, 3 << 30, 0.5));
        // SAFETY: null out-pointers are allowed.
        let code = unsafe { outcome(Ok(Ok(done)), std::ptr::null_mut(), std::ptr::null_mut()) };
        assert_eq!(code, 0);
        // SAFETY: as above.
        let code = unsafe { outcome(Err(Box::new(())), &mut bytes, &mut seconds) };
        assert_eq!(code, UNKNOWN);
    }
}
