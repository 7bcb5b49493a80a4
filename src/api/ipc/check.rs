//! The one-time ticket check: does a handle with a ticket in its leading bytes still open with
//! the plain driver? A child process without expseg opens one and reads it back, which takes
//! up to 30 s on a busy node. So the check runs once per process on a thread of its own,
//! started by the first handle request, and is waited for only by a thread that holds no lock
//! of expseg's ([`wait`]). A caller that holds the pools' lock takes the answer if it is known
//! and "not yet" otherwise ([`known`]: that handle goes without a ticket); before, such a caller
//! waited for the child under the lock, and every allocation and free of every thread with it.

use crate::api::state::config;
use crate::real::runtime;
use std::sync::{Condvar, Mutex, MutexGuard};

enum Check {
    NotStarted,
    Running,
    Done(bool),
}

static CHECK: Mutex<Check> = Mutex::new(Check::NotStarted);
static DONE: Condvar = Condvar::new();

/// The check's state, even after a panic poisoned its lock (every change is one store).
fn state() -> MutexGuard<'static, Check> {
    CHECK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Start the check for `dev` on its own thread, unless it started already.
pub(super) fn start(dev: i32) {
    start_locked(&mut state(), dev);
}

fn start_locked(check: &mut Check, dev: i32) {
    if !matches!(check, Check::NotStarted) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("expseg-ipc-check".into())
        .spawn(move || {
            // In relaxed capture mode: a graph another thread is capturing meanwhile stays
            // intact (its allocation and copies are allowed then; `gpu::cuda::relaxed`).
            let checked = || match crate::real::driver() {
                Ok(t) => crate::gpu::stream::relaxed(t, || run(dev)),
                Err(_) => run(dev),
            };
            let ok = std::panic::catch_unwind(checked).unwrap_or_else(|_| {
                log::error!("IPC tickets disabled: the one-time check failed (internal error caught); mirrors carry plain handles");
                false
            });
            *state() = Check::Done(ok);
            DONE.notify_all();
        });
    *check = match spawned {
        Ok(_) => Check::Running,
        Err(e) => {
            log::warn!("IPC tickets disabled: no thread for the one-time check ({e}); mirrors carry plain handles");
            Check::Done(false)
        }
    };
}

/// Whether tickets work, waiting for the check (started here if it was not). Only ever called
/// without the pools' lock.
pub(super) fn wait(dev: i32) -> bool {
    let mut check = state();
    start_locked(&mut check, dev);
    loop {
        if let Check::Done(ok) = *check {
            return ok;
        }
        check = DONE.wait(check).unwrap_or_else(|e| e.into_inner());
    }
}

/// Whether tickets work, if the check has answered; never waits (the check is started if it
/// was not). For callers that hold the pools' lock.
pub(super) fn known(dev: i32) -> Option<bool> {
    let mut check = state();
    start_locked(&mut check, dev);
    match *check {
        Check::Done(ok) => Some(ok),
        _ => None,
    }
}

fn run(dev: i32) -> bool {
    match check_in_child(dev) {
        Ok(()) => {
            log::info!("IPC: a ticketed handle opens with the plain driver; tickets enabled");
            true
        }
        Err(e) => {
            log::warn!("IPC tickets disabled: {e}; mirrors carry plain handles");
            false
        }
    }
}

/// A child process without expseg opens a ticketed handle of a 2 MiB buffer with a known
/// pattern and reads it back. Needs the helper `expseg-ipc-check` next to libexpseg.so.
fn check_in_child(dev: i32) -> Result<(), String> {
    if let Some(ms) = config().test_slow_check_ms {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    let helper = crate::real::self_dir()
        .map(|d| d.join("expseg-ipc-check"))
        .ok_or("cannot tell where libexpseg.so is")?;
    // A process with the static runtime has no libcudart: its plain consumers open handles
    // with the driver, and so does the check.
    let lib = if crate::real::runtime_present() {
        crate::real::runtime_path().ok_or("cannot tell which libcudart is loaded")?
    } else {
        "libcuda.so.1".to_string()
    };
    // The check's thread has no context of its own, and a process with a static runtime has
    // no runtime to make one current: the device's primary context is (the program's).
    let _context = crate::real::driver()
        .ok()
        .map(|t| crate::gpu::cuda::ensure_context(t, dev));
    let pattern: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
    // Taken under the pools' lock: an IPC move in place (under that lock) releases an
    // allocation's range and takes a cudaMalloc that must land on it; a cudaMalloc of this
    // thread meanwhile could take that range (seen on a GPU: the move failed at placement,
    // the range was lost, and the program's pointer addressed this buffer).
    let buf = {
        let _moves = crate::api::state::lock();
        runtime::on_device(dev, || match runtime::malloc(2 << 20) {
            (0, p) => Ok(p),
            (e, _) => Err(e),
        })
    }
    .map_err(|e| format!("cudaMalloc for the check failed ({e})"))?;
    let result = (|| {
        if runtime::copy_h2d(buf, &pattern) != 0 {
            return Err("copy for the check failed".to_string());
        }
        let h = runtime::ipc_get_mem_handle(buf)
            .map_err(|e| format!("cudaIpcGetMemHandle failed ({e})"))?;
        crate::ipc::check_ticketed_handle(&helper, &lib, h, &pattern, dev)
    })();
    runtime::free(buf);
    result
}
