//! Mirrors: standard buffers holding a copy of memory that has no legacy handle of its own,
//! made and refreshed on request, freed with their last reference.

use crate::gpu::{cuda, stream, IpcHandle};
use crate::real::runtime;
use crate::stats::GLOBAL;

/// `cudaErrorUnknown`, for a driver code that does not fit the runtime's.
const UNKNOWN: i32 = 999;

/// A standard buffer mirroring a foreign run, with its legacy handle. Freed when the last
/// reference goes: a refresh in flight on another thread keeps it alive.
pub(super) struct Mirror {
    pub(super) ptr: u64,
    pub(super) handle: IpcHandle,
    /// Bytes copied from the run's start: the run, or less where PyTorch's blocks end sooner.
    pub(super) size: u64,
}

impl Drop for Mirror {
    fn drop(&mut self) {
        let free = || runtime::free(self.ptr);
        let freed = match crate::real::driver() {
            Ok(t) => stream::relaxed(t, free),
            Err(_) => free(),
        };
        if freed != 0 {
            log::warn!("IPC: freeing the mirror at {:#x} failed", self.ptr);
        }
        GLOBAL.foreign_mirror_bytes.sub(self.size);
    }
}

/// Wait for the work queued on the default stream of every device other than `dev` that was
/// given access to the memory at `base` (peer access: its kernels may write it too; PyTorch's
/// copies between devices run there), so that a mirror copied next holds their writes as it
/// holds `dev`'s. Called before any lock is taken or read registered (a peer's work may wait
/// on a thread that needs them); a peer that fails its wait (a context in error) is logged
/// and passed over: the handle request is `dev`'s. Capture-safe (see [`refresh_mirror`]).
pub(super) fn wait_for_peers(dev: i32, base: u64) {
    let Ok(t) = crate::real::driver() else { return };
    let n = cuda::device_count(t).unwrap_or(0);
    for d in (0..n).filter(|d| *d != dev && cuda::granted(t, base, *d)) {
        let e = runtime::on_device(d, || {
            stream::relaxed(t, || stream::wait_legacy(t)).map_err(|e| e.0 as i32)
        });
        if let Err(e) = e {
            log::warn!("IPC: waiting for device {d}, which has access to {base:#x}, failed ({e}); the mirror may miss its writes");
        }
    }
}

/// Copy `size` bytes at `base` into the mirror at `p`, after the work queued on `dev`'s
/// default stream and its blocking streams (the caller waited for its peers' first:
/// `wait_for_peers`), and wait for the copy. Work a program queued on a non-blocking stream of
/// its own and has not ordered before this call by an event or a synchronize is not waited
/// for (natively a consumer would race it too). Capture-safe: in relaxed capture mode and
/// without a device synchronize, so a CUDA graph another thread is capturing on a non-blocking
/// stream (PyTorch's) is left intact (`scripts/vmm-cost/capture_calls.cu`: a device
/// synchronize invalidates it, a legacy-stream copy and wait in relaxed mode does not).
pub(super) fn refresh_mirror(dev: i32, p: u64, base: u64, size: u64) -> Result<(), i32> {
    let t = crate::real::driver().map_err(|_| 3)?;
    runtime::on_device(dev, || {
        stream::relaxed(t, || stream::copy_on_legacy(t, p, base, size))
            .map_err(|e| i32::try_from(e.0).unwrap_or(UNKNOWN))
    })
}

/// A standard buffer holding a copy of `size` bytes at `base`, and its legacy handle.
/// Capture-safe as [`refresh_mirror`].
pub(super) fn make_mirror(dev: i32, base: u64, size: u64) -> Result<Mirror, i32> {
    let t = crate::real::driver().map_err(|_| 3)?;
    let p = runtime::on_device(dev, || {
        stream::relaxed(t, || match runtime::malloc(size as usize) {
            (0, p) => Ok(p),
            (e, _) => Err(e),
        })
    })?;
    let made = refresh_mirror(dev, p, base, size).and_then(|()| {
        runtime::on_device(dev, || {
            stream::relaxed(t, || runtime::ipc_get_mem_handle(p))
        })
    });
    match made {
        Ok(handle) => {
            GLOBAL.foreign_mirror_bytes.add(size);
            GLOBAL.foreign_mirror_bytes_made.add(size);
            Ok(Mirror {
                ptr: p,
                handle,
                size,
            })
        }
        Err(e) => {
            stream::relaxed(t, || runtime::free(p));
            Err(e)
        }
    }
}
