//! NVML, loaded at run time (`libnvidia-ml.so.1`, the driver's): which processes have a
//! context on a GPU. Only what `api::keep` asks; None where the library or a call is missing.

use once_cell::sync::OnceCell;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CString};

/// `nvmlProcessInfo_v2_t`, as `nvmlDeviceGetComputeRunningProcesses_v3` fills it.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcInfo {
    pid: c_uint,
    used: c_ulonglong,
    gpu_instance: c_uint,
    compute_instance: c_uint,
}

type HandleByUuid = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_int;
type Processes = unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut ProcInfo) -> c_int;

struct Nvml {
    by_uuid: HandleByUuid,
    processes: Processes,
    /// `nvmlDeviceGetGraphicsRunningProcesses_v3` (same form), where the library has it.
    graphics: Option<Processes>,
}

/// `NVML_ERROR_INSUFFICIENT_SIZE`: the count asked for more room.
const INSUFFICIENT_SIZE: c_int = 7;

fn nvml() -> Option<&'static Nvml> {
    static N: OnceCell<Option<Nvml>> = OnceCell::new();
    N.get_or_init(|| {
        // SAFETY: dlopen of the driver's NVML by its soname; never closed.
        let lib = unsafe { libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW) };
        if lib.is_null() {
            return None;
        }
        let sym = |name: &std::ffi::CStr| {
            // SAFETY: a lookup in the handle just opened, with a constant name.
            let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
            (!p.is_null()).then_some(p)
        };
        let init = sym(c"nvmlInit_v2")?;
        let by_uuid = sym(c"nvmlDeviceGetHandleByUUID")?;
        let processes = sym(c"nvmlDeviceGetComputeRunningProcesses_v3")?;
        let graphics = sym(c"nvmlDeviceGetGraphicsRunningProcesses_v3");
        // SAFETY: the functions' C signatures, as NVML's header declares them.
        unsafe {
            let init: unsafe extern "C" fn() -> c_int = std::mem::transmute(init);
            if init() != 0 {
                return None;
            }
            Some(Nvml {
                by_uuid: std::mem::transmute::<*mut c_void, HandleByUuid>(by_uuid),
                processes: std::mem::transmute::<*mut c_void, Processes>(processes),
                graphics: graphics.map(|g| std::mem::transmute::<*mut c_void, Processes>(g)),
            })
        }
    })
    .as_ref()
}

/// A GPU as NVML names it.
#[derive(Clone, Copy, Debug)]
pub struct Gpu(*mut c_void);

// SAFETY: an NVML device handle is an opaque value valid in every thread.
unsafe impl Send for Gpu {}

/// The GPU whose UUID the CUDA driver reports as `uuid`; None without NVML or where NVML
/// does not know it (a MIG instance, another driver).
pub fn gpu(uuid: &[u8; 16]) -> Option<Gpu> {
    let n = nvml()?;
    let u = uuid;
    let text = format!(
        "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]
    );
    let c = CString::new(text).ok()?;
    let mut h: *mut c_void = std::ptr::null_mut();
    // SAFETY: a NUL-terminated UUID string and an out-pointer.
    let r = unsafe { (n.by_uuid)(c.as_ptr(), &mut h) };
    (r == 0 && !h.is_null()).then_some(Gpu(h))
}

/// The pids of the processes with a compute or graphics context on `gpu` (as NVML sees them:
/// in a container, possibly pids of another namespace), into `out`. Err: NVML's error code.
pub fn processes(gpu: Gpu, out: &mut Vec<u32>) -> Result<(), i32> {
    let n = nvml().ok_or(-1)?;
    out.clear();
    list(gpu, n.processes, out)?;
    // Graphics contexts too where the library lists them (a GPU without graphics may
    // refuse the question: nothing there).
    if let Some(g) = n.graphics {
        let _ = list(gpu, g, out);
    }
    out.sort_unstable();
    out.dedup();
    Ok(())
}

/// One of NVML's lists of processes on `gpu`, added to `out`.
fn list(gpu: Gpu, f: Processes, out: &mut Vec<u32>) -> Result<(), i32> {
    let mut buf = [ProcInfo::default(); 64];
    let mut count = buf.len() as c_uint;
    // SAFETY: a handle NVML gave, a count and a buffer of that many entries.
    let mut r = unsafe { f(gpu.0, &mut count, buf.as_mut_ptr()) };
    let mut big: Vec<ProcInfo> = Vec::new();
    if r == INSUFFICIENT_SIZE {
        big = vec![ProcInfo::default(); count as usize + 16];
        count = big.len() as c_uint;
        // SAFETY: as above, with a buffer of `count` entries.
        r = unsafe { f(gpu.0, &mut count, big.as_mut_ptr()) };
    }
    if r != 0 {
        return Err(r);
    }
    let got: &[ProcInfo] = if big.is_empty() { &buf } else { &big };
    out.extend(got.iter().take(count as usize).map(|p| p.pid));
    Ok(())
}
