//! The consumer's side: `cudaIpcOpenMemHandle` of a ticketed handle maps the producer's own
//! memory, `cudaIpcCloseMemHandle` unmaps it, and range queries see such memory (and pool
//! allocations) whole.

use super::shares::Closed;
use crate::api::state::{bypass, ensure_state, lock, Answer, STATE_STARTED};
use crate::gpu::cuda;
use crate::gpu::IpcHandle;
use crate::ipc::sockdir;
use crate::ipc::transport::{self, AskError};
use crate::ipc::{Refusal, Ticket};
use crate::real::runtime;
use crate::stats::GLOBAL;
use std::sync::atomic::Ordering;

/// `cudaErrorInvalidResourceHandle`: a ticket that cannot be honoured.
const INVALID_HANDLE: i32 = 400;

/// `cudaIpcOpenMemHandle`: a handle with an expseg ticket maps the producer's original memory
/// (two-way sharing); plain handles pass through. If the producer cannot be reached, a handle
/// that also carries a mirror opens the mirror; a refused ticket is an error.
pub fn cudaIpcOpenMemHandle(handle: IpcHandle) -> Answer<Result<u64, i32>> {
    if bypass() {
        return Answer::PassThrough;
    }
    let Some(t) = Ticket::read(&handle) else {
        return Answer::PassThrough;
    };
    let ticket_only = handle[24..].iter().all(|b| *b == 0);
    let Ok(dev) = runtime::get_device() else {
        return Answer::Done(Err(INVALID_HANDLE));
    };
    // Opened in this context already: the same address, one reference more (as CUDA does).
    let key = (t.uid, t.pid, t.id, t.nonce, dev);
    if STATE_STARTED.load(Ordering::Acquire) {
        if let Some(va) = lock().ipc.reopen(key) {
            return Answer::Done(Ok(va));
        }
    }
    if !crate::api::state::config().sockets {
        // EXPSEG_SOCKETS=0: the producer is not asked; its mirror, where the handle has one.
        if ticket_only {
            log::error!("IPC: a handle with a ticket only, and EXPSEG_SOCKETS=0: not opened");
            return Answer::Done(Err(INVALID_HANDLE));
        }
        return Answer::PassThrough;
    }
    let started = std::time::Instant::now();
    let asked = sockdir::socket_path(t.uid, t.pid)
        .map_err(AskError::Untrusted)
        .and_then(|path| transport::ask(&path, t.uid, t.pid, t.id, t.nonce));
    let (grant, mut incoming) = match asked {
        Ok(g) => g,
        Err(AskError::Untrusted(why)) => {
            log::error!("IPC: not asking for the ticket of process {}: {why}", t.pid);
            if ticket_only {
                return Answer::Done(Err(INVALID_HANDLE));
            }
            log::error!("IPC: opening the handle's mirror instead (one-way)");
            return Answer::PassThrough;
        }
        Err(AskError::Refused(Refusal::Failed, _)) if !ticket_only => {
            log::warn!(
                "IPC: process {} could not export the memory of its ticket; opening its mirror (one-way)",
                t.pid
            );
            return Answer::PassThrough;
        }
        Err(AskError::Refused(r, _)) => {
            log::error!("IPC: process {} refused the ticket ({r:?}): the handle is stale, forged or not ours to open", t.pid);
            return Answer::Done(Err(INVALID_HANDLE));
        }
        Err(e) if ticket_only => {
            log::error!("IPC: cannot reach process {} for its ticket ({e:?})", t.pid);
            return Answer::Done(Err(INVALID_HANDLE));
        }
        Err(e) => {
            log::warn!(
                "IPC: cannot reach process {} for its ticket ({e:?}); opening its mirror (one-way)",
                t.pid
            );
            return Answer::PassThrough;
        }
    };
    let Some(drv) = ensure_state().driver.as_ref().ok().copied() else {
        return Answer::Done(Err(INVALID_HANDLE));
    };
    if !cuda::has_context(drv) && runtime::free(0) != 0 {
        return Answer::Done(Err(INVALID_HANDLE));
    }
    let asked = started.elapsed();
    let imported =
        crate::gpu::views::import(drv, &grant.chunks, grant.size, grant.lead, dev, || {
            incoming.next_batch().map_err(|e| format!("{e:?}"))
        });
    match imported {
        Ok(imp) => {
            log::debug!(
                "IPC: ticket {} of process {} opened: {} bytes in {} chunk(s); ask {:.3} ms, import and map {:.3} ms",
                t.id,
                t.pid,
                grant.size,
                grant.chunks.len(),
                asked.as_secs_f64() * 1e3,
                (started.elapsed() - asked).as_secs_f64() * 1e3
            );
            // Starts this process's socket (not under the lock): the producer tells it there.
            let keep = super::kept::may_keep(t.uid) && super::tickets::ensure_server();
            let mut st = lock();
            // Devices with peer access to `dev` reach it too, as legacy IPC memory of its
            // context (under the lock that grants and revokes peer access take as well).
            for p in st.grants.get(dev as usize).cloned().unwrap_or_default() {
                if p != dev {
                    if let Err(e) = crate::gpu::views::set_import_access(drv, &imp, p, true) {
                        log::warn!("IPC: giving device {p} (peer access to device {dev}) access to memory of process {} failed ({e})", t.pid);
                    }
                }
            }
            match st.ipc.record_open(key, imp, keep) {
                Ok(va) => {
                    drop(st);
                    GLOBAL.ipc_tickets_opened.add(1);
                    Answer::Done(Ok(va))
                }
                // Another thread opened the same ticket meanwhile: its mapping serves.
                Err((first, twin)) => {
                    drop(st);
                    crate::gpu::views::unmap_imported(drv, twin);
                    Answer::Done(Ok(first))
                }
            }
        }
        Err(e) => {
            log::error!("IPC: mapping the memory of process {} failed: {e}", t.pid);
            if ticket_only {
                Answer::Done(Err(INVALID_HANDLE))
            } else {
                Answer::PassThrough
            }
        }
    }
    // The received descriptors close here: the imported handles keep the memory.
}

/// The allocation containing `ptr` as the program sees it — a pool allocation or memory opened
/// through a ticket — for `cuMemGetAddressRange` and `cuPointerGetAttribute`, which would
/// otherwise report one chunk's mapping. `None`: not ours, ask the driver.
pub fn allocation_range(ptr: u64) -> Option<(u64, u64)> {
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return None;
    }
    let mut st = lock();
    if let Some(r) = st.open_pools().find_map(|(_, p)| p.find(ptr)) {
        return Some(r);
    }
    st.ipc.opened_at(ptr).map(|imp| (imp.addr(), imp.user))
}

/// The pool allocation containing `ptr` (memory opened through a ticket excluded).
pub fn pool_allocation_range(ptr: u64) -> Option<(u64, u64)> {
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return None;
    }
    let mut st = lock();
    let found = st.open_pools().find_map(|(_, p)| p.find(ptr));
    found
}

/// `cudaIpcCloseMemHandle`: one reference of memory opened through a ticket goes; the last
/// unmaps it, or keeps it mapped for the next open of the handle (`kept`). Others pass
/// through.
pub fn cudaIpcCloseMemHandle(ptr: u64) -> Answer<i32> {
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return Answer::PassThrough;
    }
    let imp = match lock().ipc.close(ptr) {
        None => return Answer::PassThrough,
        Some(Closed::Kept) => return Answer::Done(0),
        Some(Closed::Last(imp)) => imp,
        // Kept mapped: work of this process that may still use it ends first, as before an
        // unmap (the producer may free it any time from now).
        Some(Closed::KeptMapped {
            producer,
            dev,
            over,
        }) => {
            let e = super::super::state::synchronize(dev);
            super::kept::kept(over, producer);
            return Answer::Done(e);
        }
    };
    // Work of this process may still use the mapping: the device it was opened for (not
    // whichever is current now).
    let e = super::super::state::synchronize(imp.dev);
    if let Ok(t) = crate::real::driver() {
        crate::gpu::views::unmap_imported(t, imp);
    }
    Answer::Done(e)
}
