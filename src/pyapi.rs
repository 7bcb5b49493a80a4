//! C functions for the Python module (`python/expseg`, through ctypes): live figures while
//! the program runs, and giving held memory back. Exported under `expseg_` names that no CUDA library uses.

use crate::api;
use libc::{c_char, size_t};
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
        std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
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
