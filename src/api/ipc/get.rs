//! `cudaIpcGetMemHandle` on pool memory: the allocation is moved into standard memory in
//! place, or mirrored (refreshed outside the lock), and carries a ticket where tickets work.

use super::mirror::refresh_mirror;
use super::tickets::{peers_without_tickets, tickets_ready, NOT_SUPPORTED};
use crate::api::state::{
    bypass, config, lock, Answer, State, OUT_OF_MEMORY, STATE_STARTED, UNKNOWN,
};
use crate::gpu::IpcHandle;
use crate::pool::{ExportError, ExportPolicy, Exported, MoveStep};
use crate::stats::GLOBAL;
use std::sync::atomic::Ordering;

/// `cudaIpcGetMemHandle`: a pointer inside a pool allocation gets a working legacy handle,
/// by moving the allocation into standard memory at the same address, or else through a
/// standard mirror (see `pool::export`) whose handle carries a ticket for consumers running
/// expseg. Anything else passes through.
///
/// Its calls are allowed while another thread captures a CUDA graph (relaxed capture mode;
/// a device synchronize only before a move, opt-in).
pub fn cudaIpcGetMemHandle(ptr: u64) -> Answer<Result<IpcHandle, i32>> {
    GLOBAL.ipc_handle_requests.add(1);
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return Answer::PassThrough;
    }
    match crate::real::driver() {
        Ok(t) => crate::gpu::stream::relaxed(t, || share_pool(ptr)),
        Err(_) => share_pool(ptr),
    }
}

fn share_pool(ptr: u64) -> Answer<Result<IpcHandle, i32>> {
    let c = config();
    let mut st = lock();
    let Some((mut dev, size)) = st
        .open_pools()
        .find_map(|(d, p)| p.find(ptr).map(|(_, size)| (d, size)))
    else {
        return Answer::PassThrough;
    };
    let needs_tickets = c.ipc_peers_expseg || size > c.ipc_move_max;
    {
        // Waits happen without the lock: the device's pending work (the export waits again
        // under the lock, for what was queued meanwhile only) and the one-time ticket check, a
        // child process on a thread of its own. A request that needs no ticket (a move, opt-in)
        // only starts the check: if its move falls back to a mirror before the check has
        // answered, that handle carries no ticket (nothing waits for the check under the lock).
        drop(st);
        // A move (opt-in) waits for all of the device's work; a mirror's copy is ordered
        // after the default stream's and blocking streams' work (`refresh_mirror`) and issues
        // no device synchronize, which would break a graph another thread is capturing.
        if size <= c.ipc_move_max {
            let e = crate::api::state::synchronize(dev);
            if e != 0 {
                return Answer::Done(Err(e));
            }
        }
        // Devices given peer access may have written it too (their waits under the lock,
        // in a move or a mirror's copy, are then short).
        super::mirror::wait_for_peers(dev, ptr);
        if c.ipc_tickets && needs_tickets {
            super::check::wait(dev);
        } else if c.ipc_tickets {
            super::check::start(dev);
        }
        st = lock();
        match st
            .open_pools()
            .find(|(_, p)| p.find(ptr).is_some())
            .map(|(d, _)| d)
        {
            Some(d) => dev = d,
            None => return Answer::PassThrough,
        }
    }
    // A paused allocation resumes first (every path below reads or shares its chunks).
    if let Some(e) = st.open_pool(dev).and_then(|p| p.wake_for(ptr).err()) {
        return export_error(ptr, ExportError::Paused(e));
    }
    if c.ipc_peers_expseg && !(c.ipc_tickets && tickets_ready(&mut st, dev)) {
        return Answer::Done(Err(peers_without_tickets(&st, ptr)));
    }
    let policy = ExportPolicy {
        move_max: c.ipc_move_max,
        fail_move_at: c.test_fail_move.as_deref().and_then(MoveStep::from_name),
    };
    if !c.ipc_peers_expseg {
        if let Some(h) = refresh_outside_lock(st, dev, ptr) {
            return h;
        }
        st = lock();
        // A new mirror: its memory and handle under the lock, its copy (a device wait)
        // without it, exactly as a refresh. Only a move (opt-in) works under the lock.
        let Some(pool) = st.open_pool(dev) else {
            return Answer::PassThrough;
        };
        if !pool.would_move(ptr, &policy) {
            let (base, size) = match pool.find(ptr) {
                Some(x) => x,
                None => return Answer::PassThrough,
            };
            return match pool.prepare_mirror(ptr) {
                Err(ExportError::OutOfMemory) => ticket_only(st, dev, ptr, base, size),
                Ok((m, first)) => {
                    super::current::arm();
                    let ticketed = c.ipc_tickets && tickets_ready(&mut st, dev);
                    match refresh_outside_lock(st, dev, ptr) {
                        Some(answer) => {
                            if first && matches!(answer, Answer::Done(Ok(_))) {
                                warn_mirrored(base, size, m, ticketed);
                            }
                            answer
                        }
                        // Freed by another thread meanwhile: no longer the pool's pointer.
                        None => Answer::PassThrough,
                    }
                }
                Err(e) => export_error(ptr, e),
            };
        }
    }
    if c.ipc_peers_expseg {
        // Every consumer runs expseg: no mirror, the ticket alone.
        let pool = st.open_pool(dev).expect("found above");
        let (base, _) = pool.share(ptr).expect("found above");
        let mut h = [0u8; 64];
        return match st.ipc.ticket(dev, base) {
            Some(t) => {
                t.stamp(&mut h);
                Answer::Done(Ok(h))
            }
            None => Answer::Done(Err(NOT_SUPPORTED)),
        };
    }
    let pool = st.open_pool(dev).expect("found above");
    match pool.export(ptr, policy) {
        Ok(ex) => {
            let mut handle = ex.handle;
            if let Exported::Mirror { ptr: m, first } = ex.how {
                let ticketed = c.ipc_tickets && tickets_ready(&mut st, dev);
                if ticketed {
                    st.open_pool(dev).expect("found above").share(ex.base);
                    if let Some(t) = st.ipc.ticket(dev, ex.base) {
                        t.stamp(&mut handle);
                    }
                }
                if first {
                    warn_mirrored(ex.base, ex.size, m, ticketed);
                }
            } else {
                log::debug!(
                    "IPC: moved {:#x} ({} bytes) into standard memory in place",
                    ex.base,
                    ex.size
                );
            }
            Answer::Done(Ok(handle))
        }
        Err(ExportError::OutOfMemory) => {
            let (base, size) = st
                .open_pool(dev)
                .and_then(|p| p.find(ptr))
                .unwrap_or((ptr, 0));
            ticket_only(st, dev, ptr, base, size)
        }
        Err(e) => export_error(ptr, e),
    }
}

/// No device memory for a mirror of the allocation at `base`: where tickets work, the handle
/// is issued with the ticket alone, so consumers running expseg map the memory itself; a
/// plain consumer's open of it fails (an error code, never wrong data). The log says which
/// handle has no mirror and why. Without tickets: out of memory, as before.
fn ticket_only(
    mut st: std::sync::MutexGuard<'static, State>,
    dev: i32,
    ptr: u64,
    base: u64,
    size: u64,
) -> Answer<Result<IpcHandle, i32>> {
    let c = config();
    if !(c.ipc_tickets && tickets_ready(&mut st, dev)) {
        log::error!("IPC: cudaIpcGetMemHandle({ptr:#x}) fails: no device memory for a mirror of the {size} bytes at {base:#x}, and no tickets here (consumers running expseg would map the memory itself)");
        return Answer::Done(Err(OUT_OF_MEMORY));
    }
    let Some(pool) = st.open_pool(dev) else {
        return Answer::PassThrough;
    };
    if pool.share(ptr).is_none() {
        return Answer::PassThrough;
    }
    GLOBAL.ipc_ticket_only.add(1);
    log::warn!("IPC: the handle of {base:#x} ({size} bytes) has no mirror: no device memory for one. Consumers running expseg map the memory itself (both ways); a consumer without expseg fails to open it (free memory before asking, or run the consumer under expseg)");
    let mut h = [0u8; 64];
    match st.ipc.ticket(dev, base) {
        Some(t) => {
            t.stamp(&mut h);
            Answer::Done(Ok(h))
        }
        None => Answer::Done(Err(NOT_SUPPORTED)),
    }
}

/// What a plain consumer of a mirrored pool allocation gets: a warning for the process's
/// first share, a debug line for later ones (`current::share_notice`).
fn warn_mirrored(base: u64, size: u64, mirror: u64, ticketed: bool) {
    let (level, once) = super::current::share_notice();
    log::log!(
        level,
        "IPC: allocation {base:#x} ({size} bytes) is shared through a mirror at {mirror:#x}: a consumer without expseg reads a copy, {}, and its writes do not reach this process{}{once}",
        super::current::currency(),
        if ticketed { " (consumers running expseg share it both ways)" } else { "" }
    );
}

fn export_error(ptr: u64, e: ExportError) -> Answer<Result<IpcHandle, i32>> {
    match e {
        ExportError::NotOwned => Answer::PassThrough,
        ExportError::OutOfMemory => Answer::Done(Err(OUT_OF_MEMORY)),
        ExportError::Paused(e) => {
            log::error!("IPC: cudaIpcGetMemHandle({ptr:#x}): the allocation is paused and could not be resumed ({e}); it stays paused, nothing lost: resume or free memory first");
            Answer::Done(Err(if e.0 < 1000 { e.0 as i32 } else { UNKNOWN }))
        }
        ExportError::Driver(e) => {
            log::error!("IPC export of {ptr:#x} failed: {e}; the allocation is unchanged");
            Answer::Done(Err(if e.0 < 1000 { e.0 as i32 } else { UNKNOWN }))
        }
        ExportError::RangeLost { base, kept } => {
            log::error!(
                "IPC export of {base:#x} lost its address range; its data is kept at {kept:#x}"
            );
            Answer::Done(Err(UNKNOWN))
        }
    }
}

/// Refresh an existing mirror of a pool allocation without the global lock (weight sync
/// repeats this every step): register the read, check under the lock that the allocation
/// still has that mirror (a `cudaFree` that got there first has freed both; one that comes
/// later waits for the read), copy, then stamp the ticket. `None`: no mirror yet, take the
/// locked path.
fn refresh_outside_lock(
    st: std::sync::MutexGuard<'static, State>,
    dev: i32,
    ptr: u64,
) -> Option<Answer<Result<IpcHandle, i32>>> {
    let mut st = st;
    let (base, size, m, handle) = st.open_pool(dev)?.mirror_of(ptr)?;
    drop(st);
    let reading = crate::api::reads::begin(base, size);
    if lock()
        .open_pool(dev)
        .and_then(|p| p.mirror_of(ptr))
        .map(|x| x.2)
        != Some(m)
    {
        return None;
    }
    let copied = refresh_mirror(dev, m, base, size);
    drop(reading);
    if let Err(e) = copied {
        log::error!("IPC: refreshing the mirror of {base:#x} failed ({e})");
        return Some(Answer::Done(Err(e)));
    }
    let mut st = lock();
    let mut handle = handle;
    if let Some(p) = st.open_pool(dev) {
        p.count_mirror_refresh();
    }
    if config().ipc_tickets && tickets_ready(&mut st, dev) {
        if let Some(pool) = st.open_pool(dev) {
            pool.share(base);
        }
        if let Some(t) = st.ipc.ticket(dev, base) {
            t.stamp(&mut handle);
        }
    }
    Some(Answer::Done(Ok(handle)))
}
