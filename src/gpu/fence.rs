//! The fence of a move: a move's copies and a hold on the device's legacy default stream,
//! launched as one graph, so that work any thread of the program queues on that stream (or on
//! a blocking stream) while live pages are away starts only once they are back. Kernels of
//! statically linked runtimes (PyTorch's own) reach no hook; the stream holds them all.
#![allow(unsafe_code)]

use super::{check, DrvError, DrvResult, Held, NOT_SUPPORTED};
use crate::real::DriverTable;
use cudarc::driver::sys::CUstream;
use libc::c_void;

/// Whether moves hold the default stream (`EXPSEG_MOVE_FENCE`, set from the configuration).
static MOVE_FENCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turn the fence of moves on or off (`EXPSEG_MOVE_FENCE`).
pub fn set_move_fence(on: bool) {
    MOVE_FENCE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether moves hold the default stream.
pub fn enabled() -> bool {
    MOVE_FENCE.load(std::sync::atomic::Ordering::Relaxed)
}

/// A host function queued on a device's legacy default stream behind a move's copies: once it
/// runs, the copies and every earlier operation of that stream (and of the blocking streams it
/// waits for) have ended, and until it returns no later one starts. States: 0 queued, 1
/// running, 2 released.
#[derive(Default)]
struct Fence {
    state: std::sync::Mutex<u8>,
    changed: std::sync::Condvar,
}

impl Fence {
    fn lock(&self) -> std::sync::MutexGuard<'_, u8> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until the stream reached the fence (no bound: the copies before it must have run
    /// before anything they wrote to is touched again; a warning every 10 s).
    fn wait_running(&self, dev: i32) {
        let t0 = std::time::Instant::now();
        let mut s = self.lock();
        while *s == 0 {
            s = match self
                .changed
                .wait_timeout(s, std::time::Duration::from_secs(10))
            {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
            if *s == 0 {
                log::warn!(
                    "device {dev}: a move waits for the default stream's earlier work ({:.0} s)",
                    t0.elapsed().as_secs_f64()
                );
            }
        }
    }

    fn release(&self) {
        *self.lock() = 2;
        self.changed.notify_all();
    }
}

/// The fence's host function: says it runs, then holds the stream until released.
unsafe extern "C" fn fence_runs(p: *mut c_void) {
    // SAFETY: `p` is the `Arc::into_raw` reference `copy_and_hold` put in the graph it
    // launched once; this one run takes it back.
    let f = unsafe { std::sync::Arc::from_raw(p as *const Fence) };
    let mut s = f.lock();
    if *s == 0 {
        *s = 1;
        f.changed.notify_all();
    }
    while *s != 2 {
        s = match f.changed.wait(s) {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
    }
}

/// The fence held for a move; dropped, the stream goes on.
struct FenceHeld(std::sync::Arc<Fence>);

impl Drop for FenceHeld {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// The copies and the fence of a move as one graph (captured on this driver's own stream:
/// the copies, then the host function), launched on the legacy default stream: one
/// launch, so no other thread's work falls between the copies and the fence. Under the
/// fence only VMM calls remain, which the driver answers even while another thread is
/// blocked on a full launch queue behind it (`scripts/vmm-cost/fence_calls.cu`); a copy
/// made there would never end.
pub(super) fn copies_then_hold(
    t: &DriverTable,
    s: CUstream,
    dev: i32,
    copies: &[(u64, u64, u64)],
) -> DrvResult<Held> {
    let missing = DrvError(NOT_SUPPORTED);
    let begin = t.cuStreamBeginCapture_v2.ok_or(missing)?;
    let end = t.cuStreamEndCapture.ok_or(missing)?;
    let instantiate = t.cuGraphInstantiateWithFlags.ok_or(missing)?;
    let launch = t.cuGraphLaunch.ok_or(missing)?;
    let destroy_exec = t.cuGraphExecDestroy.ok_or(missing)?;
    let destroy = t.cuGraphDestroy.ok_or(missing)?;
    let host = t.cuLaunchHostFunc.ok_or(missing)?;
    let copy = t.cuMemcpyDtoDAsync_v2.ok_or(missing)?;
    const RELAXED: u32 = 2; // CU_STREAM_CAPTURE_MODE_RELAXED: other threads unaffected
    const CU_STREAM_LEGACY: CUstream = 1 as CUstream;
    let fence = std::sync::Arc::new(Fence::default());
    let raw = std::sync::Arc::into_raw(fence.clone()) as *mut c_void;
    // SAFETY: a stream of this driver's; the copies' ranges are device memory mapped for
    // their sizes (the caller's); `raw` is taken back by the host function's one run, or
    // below when the graph is not launched.
    let launched = unsafe {
        let mut graph: *mut c_void = std::ptr::null_mut();
        let mut rc = begin(s, RELAXED);
        let captured = rc == 0;
        for &(dst, src, size) in copies {
            if rc == 0 {
                rc = copy(dst, src, size as usize, s);
            }
        }
        if rc == 0 {
            rc = host(s, fence_runs, raw);
        }
        if captured {
            let e = end(s, &mut graph);
            if rc == 0 {
                rc = e;
            }
        }
        let mut exec: *mut c_void = std::ptr::null_mut();
        if rc == 0 {
            rc = instantiate(&mut exec, graph, 0);
        }
        if rc == 0 {
            rc = launch(exec, CU_STREAM_LEGACY);
        }
        if !exec.is_null() {
            destroy_exec(exec); // freed once it has run
        }
        if !graph.is_null() {
            destroy(graph);
        }
        if rc != 0 {
            drop(std::sync::Arc::from_raw(raw as *const Fence));
        }
        check(rc)
    };
    launched?;
    fence.wait_running(dev);
    Ok(Held::new(Box::new(FenceHeld(fence))))
}
