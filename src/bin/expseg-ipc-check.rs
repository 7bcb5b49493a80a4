//! expseg-ipc-check LIBCUDART|libcuda.so.1 HANDLE_HEX EXPECT_HEX [DEVICE]
//!
//! Run by libexpseg.so, once per process, in a child without expseg: opens the 64-byte legacy
//! IPC handle (which carries an expseg ticket in its leading bytes) with the plain runtime at
//! LIBCUDART, or, when the producer has no shared runtime (a static one), with the driver
//! (`libcuda.so.1`, in DEVICE's primary context), reads back as many bytes as EXPECT_HEX
//! holds, and exits 0 if they match. That is the run-time proof that the driver ignores the
//! ticket bytes; without it expseg hands out plain handles. Uses nothing but the C library.

use std::ffi::{c_int, c_uint, c_void, CString};
use std::process::ExitCode;

#[repr(C)]
#[derive(Clone, Copy)]
struct Handle([u8; 64]);

type Open = unsafe extern "C" fn(*mut *mut c_void, Handle, c_uint) -> c_int;
type Copy = unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
type Close = unsafe extern "C" fn(*mut c_void) -> c_int;

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(lib), Some(h), Some(want)) = (
        args.get(1),
        args.get(2).and_then(|s| unhex(s)),
        args.get(3).and_then(|s| unhex(s)),
    ) else {
        eprintln!("usage: expseg-ipc-check LIBCUDART HANDLE_HEX EXPECT_HEX");
        return ExitCode::from(2);
    };
    if h.len() != 64 || want.is_empty() {
        return ExitCode::from(2);
    }
    let mut handle = Handle([0; 64]);
    handle.0.copy_from_slice(&h);
    let driver = std::path::Path::new(lib.as_str())
        .file_name()
        .is_some_and(|f| f.to_string_lossy().starts_with("libcuda.so"));
    let dev: c_int = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(0);
    let Ok(lib) = CString::new(lib.as_str()) else {
        return ExitCode::from(2);
    };
    if driver {
        return through_driver(&lib, handle, &want, dev);
    }
    // SAFETY: loading the CUDA runtime and calling its documented entry points with valid
    // arguments; the symbol types match the C declarations.
    unsafe {
        let rt = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if rt.is_null() {
            return ExitCode::from(3);
        }
        let sym = |n: &str| libc::dlsym(rt, CString::new(n).unwrap().as_ptr());
        let (o, c, x) = (
            sym("cudaIpcOpenMemHandle"),
            sym("cudaMemcpy"),
            sym("cudaIpcCloseMemHandle"),
        );
        if o.is_null() || c.is_null() || x.is_null() {
            return ExitCode::from(3);
        }
        let open: Open = std::mem::transmute(o);
        let copy: Copy = std::mem::transmute(c);
        let close: Close = std::mem::transmute(x);
        let mut p: *mut c_void = std::ptr::null_mut();
        if open(&mut p, handle, 1) != 0 {
            return ExitCode::from(1);
        }
        let mut got = vec![0u8; want.len()];
        let ok = copy(got.as_mut_ptr().cast(), p, got.len(), 2) == 0 && got == want;
        close(p);
        if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }
    }
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_uint;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_uint;
type CuRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_uint;
type CuSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_uint;
type CuOpen = unsafe extern "C" fn(*mut u64, Handle, c_uint) -> c_uint;
type CuDtoH = unsafe extern "C" fn(*mut c_void, u64, usize) -> c_uint;
type CuClose = unsafe extern "C" fn(u64) -> c_uint;

/// The same check with the driver's legacy IPC, as a program with a static runtime opens it.
fn through_driver(lib: &CString, handle: Handle, want: &[u8], ordinal: c_int) -> ExitCode {
    // SAFETY: loading the CUDA driver and calling its documented entry points with valid
    // arguments; the symbol types match the C declarations.
    unsafe {
        let cu = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if cu.is_null() {
            return ExitCode::from(3);
        }
        let sym = |n: &str| libc::dlsym(cu, CString::new(n).unwrap().as_ptr());
        let names = [
            "cuInit",
            "cuDeviceGet",
            "cuDevicePrimaryCtxRetain",
            "cuCtxSetCurrent",
            "cuIpcOpenMemHandle_v2",
            "cuMemcpyDtoH_v2",
            "cuIpcCloseMemHandle",
        ];
        let f: Vec<*mut c_void> = names.iter().map(|n| sym(n)).collect();
        if f.iter().any(|p| p.is_null()) {
            return ExitCode::from(3);
        }
        let init: CuInit = std::mem::transmute(f[0]);
        let device_get: CuDeviceGet = std::mem::transmute(f[1]);
        let retain: CuRetain = std::mem::transmute(f[2]);
        let set_current: CuSetCurrent = std::mem::transmute(f[3]);
        let open: CuOpen = std::mem::transmute(f[4]);
        let copy: CuDtoH = std::mem::transmute(f[5]);
        let close: CuClose = std::mem::transmute(f[6]);
        let (mut dev, mut ctx) = (0, std::ptr::null_mut());
        if init(0) != 0
            || device_get(&mut dev, ordinal) != 0
            || retain(&mut ctx, dev) != 0
            || set_current(ctx) != 0
        {
            return ExitCode::from(3);
        }
        let mut p = 0u64;
        if open(&mut p, handle, 1) != 0 {
            return ExitCode::from(1);
        }
        let mut got = vec![0u8; want.len()];
        let ok = copy(got.as_mut_ptr().cast(), p, got.len()) == 0 && got == want;
        close(p);
        if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }
    }
}
