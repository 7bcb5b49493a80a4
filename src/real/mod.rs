//! The functions expseg stands in front of: the next `libcudart`'s entry points and the
//! driver's function table. This is the only module that calls `dlsym`.
//!
//! Runtime functions are looked up lazily, one atomic each (null = not found yet): first
//! `dlsym(RTLD_NEXT)`, then, when the runtime was loaded privately (Python extensions load
//! `libcudart.so.13` with `RTLD_LOCAL`), the already-loaded `libcudart.so.13`/`.so.12` through
//! `dlopen(RTLD_NOLOAD)`. A hit is cached; a miss is not, so a runtime loaded later is found.
//! A lookup that lands in expseg itself is refused.
//!
//! The driver table is loaded once, from the `libcuda.so.1` the runtime loaded (or loaded
//! here if none is yet). Its symbols are split like cuinterpose's: without the *required* ones
//! the pool cannot run and everything passes through.

pub mod checkpoint;
pub mod driver;
pub mod lookup;
pub mod nvml;
pub mod primary;
pub mod python;
pub mod tms;

pub use driver::{driver, DriverTable};

use libc::{c_char, c_int, c_uint, c_void, size_t};
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

/// `cudaErrorInitializationError`: what a hook returns when no runtime can be found.
pub const NO_RUNTIME: i32 = 3;

fn self_base() -> *mut c_void {
    static BASE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    let b = BASE.load(Ordering::Relaxed);
    if !b.is_null() {
        return b;
    }
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address; `self_base` is a function of this library.
    let found = unsafe { libc::dladdr(self_base as *const c_void, &mut info) };
    let b = if found != 0 {
        info.dli_fbase
    } else {
        std::ptr::null_mut()
    };
    BASE.store(b, Ordering::Relaxed);
    b
}

/// Whether `p` is code of expseg itself (a lookup must never resolve to a hook).
pub fn is_self(p: usize) -> bool {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only looks the address up in the loader's tables.
    unsafe { libc::dladdr(p as *const c_void, &mut info) != 0 && info.dli_fbase == self_base() }
}

const RUNTIMES: [&CStr; 2] = [c"libcudart.so.13", c"libcudart.so.12"];

/// Find the next definition of `name` after expseg.
fn lookup_next(name: &CStr) -> *mut c_void {
    // SAFETY: dlsym/dlopen with valid NUL-terminated strings; handles are closed again
    // (RTLD_NOLOAD only raised their reference count).
    unsafe {
        let p = lookup::real(libc::RTLD_NEXT, name);
        if !p.is_null() && !is_self(p as usize) {
            return p;
        }
        for lib in RUNTIMES {
            let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if h.is_null() {
                continue;
            }
            let p = lookup::real(h, name);
            libc::dlclose(h);
            if !p.is_null() && !is_self(p as usize) {
                return p;
            }
        }
    }
    std::ptr::null_mut()
}

/// One lazily found runtime function.
struct Next {
    name: &'static CStr,
    ptr: AtomicPtr<c_void>,
    warned: AtomicBool,
}

impl Next {
    const fn new(name: &'static CStr) -> Self {
        Next {
            name,
            ptr: AtomicPtr::new(std::ptr::null_mut()),
            warned: AtomicBool::new(false),
        }
    }

    fn get(&self) -> Option<*mut c_void> {
        let p = self.ptr.load(Ordering::Acquire);
        if !p.is_null() {
            return Some(p);
        }
        let p = lookup_next(self.name);
        if p.is_null() {
            if !self.warned.swap(true, Ordering::Relaxed) {
                log::error!(
                    "no CUDA runtime defines {:?} after expseg (tried RTLD_NEXT, libcudart.so.13, libcudart.so.12)",
                    self.name
                );
            }
            return None;
        }
        self.ptr.store(p, Ordering::Release);
        Some(p)
    }
}

/// Declares functions expseg calls through, in module `$module`: for each, a static lookup of
/// type `$lookup` ([`Next`] for the runtime, [`NextDriver`] for the driver) and an `unsafe fn`
/// with the C signature that returns `$none` when the function is not found.
macro_rules! forwarders {
    ($(#[$doc:meta])* $module:ident, $lookup:ident, $ret:ty, $none:expr;
     $( $name:ident ( $($arg:ident : $ty:ty),* ); )*) => {
        $(#[$doc])*
        #[allow(non_snake_case, clippy::missing_safety_doc)]
        pub mod $module {
            use super::*;
            $(
                pub unsafe fn $name($($arg: $ty),*) -> $ret {
                    static F: $lookup = $lookup::new(
                        match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                            Ok(s) => s,
                            Err(_) => panic!("symbol name"),
                        },
                    );
                    match F.get() {
                        // SAFETY: the next object's function of this name, whose C signature
                        // this forwarder declares; the caller's arguments, passed on.
                        Some(p) => unsafe {
                            let f: unsafe extern "C" fn($($ty),*) -> $ret = std::mem::transmute(p);
                            f($($arg),*)
                        },
                        None => $none,
                    }
                }
            )*
        }
    };
}

/// The driver library expseg passes driver calls on to: the `libcuda.so.1` already loaded
/// (a program calling a driver hook has loaded it), else loaded here. Kept open for the life
/// of the process. Null if there is none.
fn driver_lib() -> *mut c_void {
    static LIB: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    let l = LIB.load(Ordering::Acquire);
    if !l.is_null() {
        return l;
    }
    // SAFETY: dlopen with a constant NUL-terminated name; the handle is never closed.
    let l = unsafe {
        let mut l = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if l.is_null() {
            l = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        }
        l
    };
    if !l.is_null() {
        LIB.store(l, Ordering::Release);
    }
    l
}

/// One lazily found driver function, for the driver hooks to pass calls on to. Found with the
/// real `dlsym` on the driver's own handle, so it is never one of expseg's hooks. Unlike
/// [`driver`], it does not need the VMM symbols: a driver without VMM still gets its calls.
struct NextDriver {
    name: &'static CStr,
    ptr: AtomicPtr<c_void>,
}

impl NextDriver {
    const fn new(name: &'static CStr) -> Self {
        NextDriver {
            name,
            ptr: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    fn get(&self) -> Option<*mut c_void> {
        let p = self.ptr.load(Ordering::Acquire);
        if !p.is_null() {
            return Some(p);
        }
        let lib = driver_lib();
        if lib.is_null() {
            return None;
        }
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { lookup::real(lib, self.name) };
        if p.is_null() || is_self(p as usize) {
            return None;
        }
        self.ptr.store(p, Ordering::Release);
        Some(p)
    }
}

forwarders! {
    /// The driver's own functions behind expseg's driver hooks, same names and signatures;
    /// `CUDA_ERROR_NOT_INITIALIZED` (3) when there is no driver.
    next_driver, NextDriver, u32, 3;
    cuMemcpyHtoD_v2(dst: u64, src: *const c_void, size: size_t);
    cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, size: size_t);
    cuMemcpyDtoD_v2(dst: u64, src: u64, size: size_t);
    cuIpcGetMemHandle(handle: *mut c_void, dptr: u64);
    cuIpcOpenMemHandle_v2(dptr: *mut u64, handle: CudaIpcMemHandle, flags: c_uint);
    cuIpcCloseMemHandle(dptr: u64);
    cuCtxEnablePeerAccess(peer: *mut c_void, flags: c_uint);
    cuPointerGetAttributes(count: c_uint, attrs: *const c_int, data: *mut *mut c_void, ptr: u64);
    cuPointerGetAttribute(data: *mut c_void, attr: c_int, ptr: u64);
    cuMemGetAddressRange_v2(base: *mut u64, size: *mut size_t, ptr: u64);
    cuCtxDisablePeerAccess(peer: *mut c_void);
    cuMemAlloc_v2(dptr: *mut u64, size: size_t);
    cuDevicePrimaryCtxReset_v2(dev: c_int);
    cuMemFree_v2(dptr: u64);
    cuMemGetInfo_v2(free: *mut size_t, total: *mut size_t);
    cuMemAllocPitch_v2(dptr: *mut u64, pitch: *mut size_t, width: size_t, height: size_t, elem: c_uint);
    cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64);
    cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_void);
    cuCtxSynchronize();
    cuStreamSynchronize(stream: usize);
    cuStreamSynchronize_ptsz(stream: usize);
    cuEventSynchronize(event: usize);
    cuEventRecord(event: usize, stream: usize);
    cuEventRecord_ptsz(event: usize, stream: usize);
    cuEventRecordWithFlags(event: usize, stream: usize, flags: c_uint);
    cuEventRecordWithFlags_ptsz(event: usize, stream: usize, flags: c_uint);
    cuIpcGetEventHandle(handle: *mut c_void, event: usize);
    cuMemGetHandleForAddressRange(handle: *mut c_void, ptr: u64, size: size_t, kind: c_uint, flags: u64);
    cuStreamCreate(out: *mut usize, flags: c_uint);
    cuStreamCreateWithPriority(out: *mut usize, flags: c_uint, prio: c_int);
    cuStreamDestroy(stream: usize);
    cuStreamDestroy_v2(stream: usize);
}

/// Whether `path` names a shared CUDA runtime (`libcudart.so.13`, `libcudart.so.12`, a wheel's
/// `libcudart-1a2b3c.so.12`): the callers that must get the driver's own allocation
/// functions, because expseg serves their programs at the runtime level already.
pub fn is_shared_runtime_file(path: &[u8]) -> bool {
    let file = path.rsplit(|b| *b == b'/').next().unwrap_or(path);
    file.starts_with(b"libcudart") && file.windows(3).any(|w| w == b".so")
}

/// Whether the code at `pc` belongs to a shared CUDA runtime (`libcudart*.so*`). Makes no
/// allocation and no `dlsym` call (it runs inside the exported `dlsym`).
pub fn in_shared_runtime(pc: usize) -> bool {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address; dli_fname points into the loader's tables.
    unsafe {
        libc::dladdr(pc as *const c_void, &mut info) != 0
            && !info.dli_fname.is_null()
            && is_shared_runtime_file(CStr::from_ptr(info.dli_fname).to_bytes())
    }
}

/// `cudaIpcMemHandle_t`, passed by value as the C API does.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaIpcMemHandle {
    pub reserved: [u8; 64],
}

forwarders! {
    /// The next runtime's functions, same names and signatures as the C API; [`NO_RUNTIME`]
    /// when none is found.
    next, Next, c_int, NO_RUNTIME;
    cudaMalloc(dev_ptr: *mut *mut c_void, size: size_t);
    cudaFree(dev_ptr: *mut c_void);
    cudaIpcGetMemHandle(handle: *mut c_void, dev_ptr: *mut c_void);
    cudaMemGetInfo(free: *mut size_t, total: *mut size_t);
    cudaDeviceEnablePeerAccess(peer: c_int, flags: c_uint);
    cudaDeviceDisablePeerAccess(peer: c_int);
    cudaGetDevice(dev: *mut c_int);
    cudaSetDevice(dev: c_int);
    cudaDeviceSynchronize();
    cudaDeviceReset();
    cudaMemcpy(dst: *mut c_void, src: *const c_void, count: size_t, kind: c_int);
    cudaIpcOpenMemHandle(dev_ptr: *mut *mut c_void, handle: CudaIpcMemHandle, flags: c_uint);
    cudaIpcCloseMemHandle(dev_ptr: *mut c_void);
    cudaGetLastError();
    cudaGetDriverEntryPoint(symbol: *const c_char, func: *mut *mut c_void, flags: u64, status: *mut c_void);
    cudaGetDriverEntryPointByVersion(symbol: *const c_char, func: *mut *mut c_void, version: c_uint, flags: u64, status: *mut c_void);
}

/// The file the next runtime's `cudaMalloc` lives in (for a helper process to load the same
/// runtime), if it is found.
pub fn runtime_path() -> Option<String> {
    static F: Next = Next::new(c"cudaMalloc");
    let p = F.get()?;
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address; dli_fname points into the loader's tables.
    unsafe {
        if libc::dladdr(p, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(
            CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// The file expseg's own code was loaded from (the library, or a program linking the crate).
pub fn self_file() -> Option<String> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address; dli_fname points into the loader's tables.
    unsafe {
        if libc::dladdr(self_base as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(
            CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// The directory expseg's own library was loaded from.
pub fn self_dir() -> Option<std::path::PathBuf> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above, for a function of this library.
    unsafe {
        if libc::dladdr(self_base as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let f = std::path::PathBuf::from(
            CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned(),
        );
        f.parent().map(|d| d.to_path_buf())
    }
}

/// Whether a shared CUDA runtime is loaded (asked without the one-time error line a missing
/// symbol gives). A process with the static runtime has none: `runtime` then works through
/// the driver. A hit is cached; a runtime loaded later is found.
pub fn runtime_present() -> bool {
    static SEEN: AtomicBool = AtomicBool::new(false);
    if SEEN.load(Ordering::Relaxed) {
        return true;
    }
    let yes = !lookup_next(c"cudaMalloc").is_null();
    if yes {
        SEEN.store(true, Ordering::Relaxed);
    }
    yes
}

/// Safe calls of the next runtime for the rest of the crate: values in, values out. Where no
/// shared runtime is loaded (a static-runtime program served through the driver hooks), the
/// same operations go to the driver in the primary context of the current device
/// (`through_driver`); error codes are then the driver's, which agree with the runtime's for
/// what callers test (0, and 2 for out of memory).
pub mod runtime {
    use super::next;
    use super::through_driver as drv;
    use libc::c_void;

    /// `cudaMalloc` into a local: the code and the pointer.
    pub fn malloc(size: usize) -> (i32, u64) {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer.
        if !super::runtime_present() {
            return drv::malloc(size);
        }
        let e = unsafe { next::cudaMalloc(&mut p, size) };
        (e, p as u64)
    }

    pub fn free(ptr: u64) -> i32 {
        if !super::runtime_present() {
            return drv::free(ptr);
        }
        // SAFETY: the runtime validates the pointer; an unknown one is an error code.
        unsafe { next::cudaFree(ptr as *mut c_void) }
    }

    pub fn get_device() -> Result<i32, i32> {
        if !super::runtime_present() {
            return drv::get_device();
        }
        let mut d = 0;
        // SAFETY: `d` is a valid out-pointer.
        match unsafe { next::cudaGetDevice(&mut d) } {
            0 => Ok(d),
            e => Err(e),
        }
    }

    pub fn set_device(d: i32) -> i32 {
        if !super::runtime_present() {
            return drv::set_device(d);
        }
        // SAFETY: plain value argument.
        unsafe { next::cudaSetDevice(d) }
    }

    pub fn device_synchronize() -> i32 {
        if !super::runtime_present() {
            return drv::synchronize();
        }
        // SAFETY: no arguments.
        unsafe { next::cudaDeviceSynchronize() }
    }

    /// Run `f` with `dev` as the calling thread's current device, then restore the thread's
    /// context exactly as it was: none (no context is left behind on a thread that had none),
    /// or a context the program made itself (not replaced by its device's primary one).
    pub fn on_device<T>(dev: i32, f: impl FnOnce() -> Result<T, i32>) -> Result<T, i32> {
        let cur = get_device().unwrap_or(dev);
        if cur == dev {
            return f();
        }
        let saved = drv::current_context();
        match set_device(dev) {
            0 => {}
            e => return Err(e),
        }
        let r = f();
        // The runtime's own idea of the thread's device first, then the very context.
        set_device(cur);
        if let Some(c) = saved {
            drv::set_current_context(c);
        }
        r
    }

    /// Wait for all work on `dev`.
    pub fn synchronize_device(dev: i32) -> i32 {
        on_device(dev, || match device_synchronize() {
            0 => Ok(()),
            e => Err(e),
        })
        .err()
        .unwrap_or(0)
    }

    /// `cudaMemcpy` host to device.
    pub fn copy_h2d(dst: u64, src: &[u8]) -> i32 {
        const HOST_TO_DEVICE: i32 = 1;
        if !super::runtime_present() {
            // SAFETY: as below.
            return unsafe {
                drv::code(super::next_driver::cuMemcpyHtoD_v2(
                    dst,
                    src.as_ptr().cast(),
                    src.len(),
                ))
            };
        }
        // SAFETY: `src` is readable for its length; `dst` is device memory of at least as much.
        unsafe {
            next::cudaMemcpy(
                dst as *mut c_void,
                src.as_ptr().cast(),
                src.len(),
                HOST_TO_DEVICE,
            )
        }
    }

    /// `cudaMemcpy` device to host.
    pub fn copy_d2h(dst: &mut [u8], src: u64) -> i32 {
        const DEVICE_TO_HOST: i32 = 2;
        if !super::runtime_present() {
            // SAFETY: as below.
            return unsafe {
                drv::code(super::next_driver::cuMemcpyDtoH_v2(
                    dst.as_mut_ptr().cast(),
                    src,
                    dst.len(),
                ))
            };
        }
        // SAFETY: `dst` is writable for its length; `src` is device memory of at least as much.
        unsafe {
            next::cudaMemcpy(
                dst.as_mut_ptr().cast(),
                src as *const c_void,
                dst.len(),
                DEVICE_TO_HOST,
            )
        }
    }

    /// The real `cudaMemGetInfo` of the current device: (free, total).
    pub fn mem_get_info() -> Result<(u64, u64), i32> {
        let (mut f, mut t) = (0usize, 0usize);
        if !super::runtime_present() {
            // SAFETY: valid out-pointers.
            return match unsafe { super::next_driver::cuMemGetInfo_v2(&mut f, &mut t) } {
                0 => Ok((f as u64, t as u64)),
                e => Err(drv::code(e)),
            };
        }
        // SAFETY: valid out-pointers.
        match unsafe { next::cudaMemGetInfo(&mut f, &mut t) } {
            0 => Ok((f as u64, t as u64)),
            e => Err(e),
        }
    }

    /// `cudaMemcpy` device to device.
    pub fn copy_d2d(dst: u64, src: u64, size: usize) -> i32 {
        const DEVICE_TO_DEVICE: i32 = 3;
        if !super::runtime_present() {
            // SAFETY: as below; the copy is followed by the callers' synchronisation.
            return unsafe { drv::code(super::next_driver::cuMemcpyDtoD_v2(dst, src, size)) };
        }
        // SAFETY: both ranges are device memory the caller owns, `size` bytes long.
        unsafe {
            next::cudaMemcpy(
                dst as *mut c_void,
                src as *const c_void,
                size,
                DEVICE_TO_DEVICE,
            )
        }
    }

    /// `cudaIpcGetMemHandle` into a local.
    pub fn ipc_get_mem_handle(ptr: u64) -> Result<[u8; 64], i32> {
        let mut h = [0u8; 64];
        if !super::runtime_present() {
            // SAFETY: `h` is 64 writable bytes, the size of CUipcMemHandle.
            return match unsafe {
                super::next_driver::cuIpcGetMemHandle(h.as_mut_ptr().cast(), ptr)
            } {
                0 => Ok(h),
                e => Err(drv::code(e)),
            };
        }
        // SAFETY: `h` is 64 writable bytes, the size of cudaIpcMemHandle_t.
        match unsafe {
            next::cudaIpcGetMemHandle(h.as_mut_ptr() as *mut c_void, ptr as *mut c_void)
        } {
            0 => Ok(h),
            e => Err(e),
        }
    }

    pub fn enable_peer_access(peer: i32, flags: u32) -> i32 {
        // SAFETY: plain value arguments.
        unsafe { next::cudaDeviceEnablePeerAccess(peer, flags) }
    }

    pub fn disable_peer_access(peer: i32) -> i32 {
        // SAFETY: plain value argument.
        unsafe { next::cudaDeviceDisablePeerAccess(peer) }
    }
}

/// The `runtime` operations through the driver, for processes without a shared runtime: in
/// the primary context of the current device (a static runtime makes it current; expseg never
/// creates one).
mod through_driver {
    use super::{driver, next_driver, primary};

    /// A driver code as the runtime's (`CUDA_ERROR_NOT_INITIALIZED` when there is no driver).
    pub fn code(e: u32) -> i32 {
        i32::try_from(e).unwrap_or(999)
    }

    pub fn malloc(size: usize) -> (i32, u64) {
        let mut p = 0u64;
        // SAFETY: valid out-pointer.
        let e = unsafe { next_driver::cuMemAlloc_v2(&mut p, size) };
        (code(e), p)
    }

    pub fn free(ptr: u64) -> i32 {
        // SAFETY: the driver validates the pointer.
        code(unsafe { next_driver::cuMemFree_v2(ptr) })
    }

    pub fn get_device() -> Result<i32, i32> {
        let t = driver().map_err(|_| 3)?;
        let f = t.cuCtxGetDevice.ok_or(3)?;
        let mut d = 0;
        // SAFETY: valid out-pointer.
        match unsafe { f(&mut d) } {
            0 => Ok(d),
            e => Err(code(e)),
        }
    }

    pub fn set_device(d: i32) -> i32 {
        match driver() {
            Ok(t) => code(primary::make_primary_current(t, d)),
            Err(_) => 3,
        }
    }

    /// The calling thread's current context (null: none); `None` where the driver cannot say.
    pub fn current_context() -> Option<usize> {
        let t = driver().ok()?;
        let mut c: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        (unsafe { (t.cuCtxGetCurrent)(&mut c) } == 0).then_some(c as usize)
    }

    /// Make `c` (from `current_context`; null: none) the calling thread's context again.
    pub fn set_current_context(c: usize) {
        if let Ok(Some(set)) = driver().map(|t| t.cuCtxSetCurrent) {
            // SAFETY: a context the thread had current a moment ago, or null.
            unsafe { set(c as cudarc::driver::sys::CUcontext) };
        }
    }

    pub fn synchronize() -> i32 {
        let Ok(t) = driver() else { return 3 };
        match t.cuCtxSynchronize {
            // SAFETY: no arguments.
            Some(f) => code(unsafe { f() }),
            None => 0,
        }
    }
}
