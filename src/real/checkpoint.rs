//! The driver's process checkpoint (driver 570 and later): another process of the same user is
//! locked (its CUDA calls block, the work it submitted finishes), checkpointed (the driver
//! copies its device memory to host memory and releases its GPU resources, context included),
//! restored at the same addresses and unlocked. `expseg pause` of a whole process stands on it:
//! the driver holds every thread, stream and graph of the program, which nothing in the
//! process itself can (docs/failed-approaches.md, "Holding the program's non-blocking streams").

use super::driver::{driver, DriverTable};
use libc::{c_int, c_void};

/// `CUDA_ERROR_NOT_INITIALIZED`: the process named has no CUDA in it (yet).
pub const NOT_INITIALIZED: u32 = 3;
/// `CUDA_ERROR_TIMEOUT`: the lock did not come within its time.
pub const TIMEOUT: u32 = 909;

/// A process's checkpoint state, as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Running,
    Locked,
    Checkpointed,
    /// A checkpoint or restore failed part way; the driver keeps it so.
    Failed,
    Other(i32),
}

impl State {
    fn from_raw(s: c_int) -> State {
        match s {
            0 => State::Running,
            1 => State::Locked,
            2 => State::Checkpointed,
            3 => State::Failed,
            o => State::Other(o),
        }
    }
}

/// `CUcheckpointLockArgs`: a timeout in milliseconds (0: none) and reserved zeros.
#[repr(C)]
struct LockArgs {
    timeout_ms: u32,
    reserved0: u32,
    reserved1: [u64; 7],
}

/// The driver's checkpoint calls, found.
pub struct Checkpoint {
    t: &'static DriverTable,
}

/// A failed driver call: its `CUresult`.
pub type CuResult<T> = Result<T, u32>;

impl Checkpoint {
    /// The calls of this machine's driver, or why there are none (one sentence).
    pub fn get() -> Result<Checkpoint, String> {
        let t = driver().map_err(|e| e.to_string())?;
        // SAFETY: no arguments.
        if unsafe { (t.cuInit)(0) } != 0 {
            return Err("cuInit failed (no usable GPU?)".into());
        }
        let all = t.cuCheckpointProcessGetState.is_some()
            && t.cuCheckpointProcessLock.is_some()
            && t.cuCheckpointProcessCheckpoint.is_some()
            && t.cuCheckpointProcessRestore.is_some()
            && t.cuCheckpointProcessUnlock.is_some();
        if !all {
            let mut v = 0;
            if let Some(f) = t.cuDriverGetVersion {
                // SAFETY: valid out-pointer.
                unsafe { f(&mut v) };
            }
            return Err(format!(
                "this driver (CUDA {}.{}) has no process checkpoint: it needs driver 570 or later",
                v / 1000,
                v % 1000 / 10
            ));
        }
        Ok(Checkpoint { t })
    }

    /// `pid`'s state; `Err(NOT_INITIALIZED)` where it has no CUDA.
    pub fn state(&self, pid: u32) -> CuResult<State> {
        let f = self.t.cuCheckpointProcessGetState.ok_or(NOT_SUPPORTED)?;
        let mut s: c_int = -1;
        // SAFETY: valid out-pointer; the driver checks the pid.
        check(unsafe { f(pid as c_int, &mut s) }).map(|_| State::from_raw(s))
    }

    /// Lock `pid`: its CUDA calls block and its submitted work finishes, within `timeout_ms`
    /// (0: no bound).
    pub fn lock(&self, pid: u32, timeout_ms: u32) -> CuResult<()> {
        let f = self.t.cuCheckpointProcessLock.ok_or(NOT_SUPPORTED)?;
        let mut a = LockArgs {
            timeout_ms,
            reserved0: 0,
            reserved1: [0; 7],
        };
        // SAFETY: the argument block of the driver's layout, zeros where reserved.
        check(unsafe { f(pid as c_int, (&mut a as *mut LockArgs).cast()) })
    }

    /// Copy a locked `pid`'s device memory to host memory and release its GPU resources.
    pub fn checkpoint(&self, pid: u32) -> CuResult<()> {
        let f = self.t.cuCheckpointProcessCheckpoint.ok_or(NOT_SUPPORTED)?;
        // SAFETY: no optional arguments (null).
        check(unsafe { f(pid as c_int, std::ptr::null_mut::<c_void>()) })
    }

    /// Bring a checkpointed `pid`'s GPU state back, at the same addresses (it stays locked).
    pub fn restore(&self, pid: u32) -> CuResult<()> {
        let f = self.t.cuCheckpointProcessRestore.ok_or(NOT_SUPPORTED)?;
        // SAFETY: as above.
        check(unsafe { f(pid as c_int, std::ptr::null_mut::<c_void>()) })
    }

    /// Let a locked `pid`'s CUDA calls go on.
    pub fn unlock(&self, pid: u32) -> CuResult<()> {
        let f = self.t.cuCheckpointProcessUnlock.ok_or(NOT_SUPPORTED)?;
        // SAFETY: as above.
        check(unsafe { f(pid as c_int, std::ptr::null_mut::<c_void>()) })
    }

    /// The driver's name of `rc` (`CUDA_ERROR_TIMEOUT`), or its number.
    pub fn error_name(&self, rc: u32) -> String {
        let mut p: *const libc::c_char = std::ptr::null();
        match self.t.cuGetErrorName {
            // SAFETY: valid out-pointer; the driver's string is static.
            Some(f) if unsafe { f(rc, &mut p) } == 0 && !p.is_null() => {
                // SAFETY: a NUL-terminated static string of the driver's.
                let name = unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy();
                format!("{name} ({rc})")
            }
            _ => format!("CUresult {rc}"),
        }
    }
}

/// `CUDA_ERROR_NOT_SUPPORTED`.
const NOT_SUPPORTED: u32 = 801;

fn check(rc: u32) -> CuResult<()> {
    match rc {
        0 => Ok(()),
        e => Err(e),
    }
}
