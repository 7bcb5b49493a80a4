//! Mirrors: standard buffers holding a copy of memory that has no legacy handle of its own,
//! made and refreshed on request, freed with their last reference.

use crate::gpu::{cuda, IpcHandle};
use crate::real::runtime;
use crate::stats::GLOBAL;

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
        if runtime::free(self.ptr) != 0 {
            log::warn!("IPC: freeing the mirror at {:#x} failed", self.ptr);
        }
        GLOBAL.foreign_mirror_bytes.sub(self.size);
    }
}

/// Wait for the work of every device other than `dev` that was given access to the memory at
/// `base` (peer access: its kernels may write it too), so that a mirror copied next holds
/// their writes as it holds `dev`'s. Called before any lock is taken or read registered (a
/// peer's work may wait on a thread that needs them); a peer that fails its wait (a context
/// in error) is logged and passed over: the handle request is `dev`'s.
pub(super) fn wait_for_peers(dev: i32, base: u64) {
    let Ok(t) = crate::real::driver() else { return };
    let n = cuda::device_count(t).unwrap_or(0);
    for d in (0..n).filter(|d| *d != dev && cuda::granted(t, base, *d)) {
        let e = runtime::on_device(d, || match runtime::device_synchronize() {
            0 => Ok(()),
            e => Err(e),
        });
        if let Err(e) = e {
            log::warn!("IPC: waiting for device {d}, which has access to {base:#x}, failed ({e}); the mirror may miss its writes");
        }
    }
}

/// Copy `size` bytes at `base` into the mirror at `p`, after the device's pending work (the
/// caller waited for its peers' first: `wait_for_peers`).
pub(super) fn refresh_mirror(dev: i32, p: u64, base: u64, size: u64) -> Result<(), i32> {
    runtime::on_device(dev, || match runtime::device_synchronize() {
        0 => match runtime::copy_d2d(p, base, size as usize) {
            0 => match runtime::device_synchronize() {
                0 => Ok(()),
                e => Err(e),
            },
            e => Err(e),
        },
        e => Err(e),
    })
}

/// A standard buffer holding a copy of `size` bytes at `base`, and its legacy handle.
pub(super) fn make_mirror(dev: i32, base: u64, size: u64) -> Result<Mirror, i32> {
    let p = runtime::on_device(dev, || match runtime::malloc(size as usize) {
        (0, p) => Ok(p),
        (e, _) => Err(e),
    })?;
    let made = refresh_mirror(dev, p, base, size)
        .and_then(|()| runtime::on_device(dev, || runtime::ipc_get_mem_handle(p)));
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
            runtime::free(p);
            Err(e)
        }
    }
}
