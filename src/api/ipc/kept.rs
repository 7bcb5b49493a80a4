//! Memory opened through a ticket and kept mapped after its last close, on both sides: the
//! consumer keeps it (for the next open of the same handle: a weight refit shares the same
//! buffers every step) and lets it go when the producer frees it or exits; the producer tells
//! the consumers it granted a ticket when it frees that memory (`ipc::closed`), before its
//! free returns, so the memory is back on the GPU as natively.
//!
//! Only a consumer of the producer's own user keeps (the producer can reach its socket), and
//! only while its own socket serves (it hears the producer there).

use crate::api::state::{config, lock};
use crate::gpu::cuda::{self};
use crate::gpu::views::Imported;
use crate::ipc::closed;
use crate::ipc::sockdir;
use crate::ipc::transport::{self, Reply};
use crate::ipc::watch::Watch;
use crate::ipc::Grant;
use once_cell::sync::OnceCell;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// How often the consumer looks whether producers whose memory it keeps still live.
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// Whether memory opened through a ticket of producer uid `uid` may stay mapped after its
/// last close (and this process's socket serves: the caller asks, starting it).
pub(super) fn may_keep(uid: u32) -> bool {
    config().ipc_keep_closed && uid == sockdir::current_uid()
}

/// A close kept memory of `producer` mapped (outside the lock): the producer is watched, and
/// the mappings kept beyond the bound (`over`) go.
pub(super) fn kept(over: Vec<Imported>, producer: u32) {
    watch(producer);
    unmap(over.into_iter());
}

/// Unmap mappings kept for producers that freed or left them (a thread of its own or the
/// socket's: the device's context is made current for the calls).
fn unmap(imps: impl Iterator<Item = Imported>) -> u64 {
    let Ok(t) = crate::real::driver() else {
        return 0;
    };
    let mut bytes = 0;
    for imp in imps {
        let _context = cuda::ensure_context(t, imp.dev);
        bytes += imp.size;
        crate::gpu::views::unmap_imported(t, imp);
    }
    bytes
}

/// The consumer's answer to producer `pid`'s word that it freed ticket `id`: the bytes
/// unmapped here.
pub(super) fn producer_freed(pid: u32, id: u32) -> Reply {
    let gone = lock().ipc.producer_freed(pid, id);
    let bytes = unmap(gone.into_iter());
    Ok((Grant::new(bytes, Vec::new()), transport::fds_of(Vec::new())))
}

/// The producer's side: tell each consumer that may keep memory of tickets freed since the
/// last call, and wait for its answer (bounded: `closed::TIMEOUT`). Called outside the lock
/// after a free.
pub(crate) fn tell_freed() {
    if !super::shares::TO_TELL.load(std::sync::atomic::Ordering::Acquire) {
        return;
    }
    let todo = lock().ipc.take_to_tell();
    if todo.is_empty() {
        return;
    }
    let uid = sockdir::current_uid();
    for (id, pids) in todo {
        for pid in pids {
            if let Err(e) = closed::tell(uid, pid, id) {
                // No socket: it keeps nothing (a consumer that keeps serves one), or it is
                // gone. Said only where it may keep memory and still runs.
                let no_socket = matches!(&e, transport::AskError::Unreachable(io) if io.kind() == std::io::ErrorKind::NotFound);
                if !no_socket && !Watch::new(pid).exited() {
                    log::warn!("IPC: process {pid} did not answer that this process freed memory it opened through a ticket ({e:?}); it may keep that memory mapped until it answers or exits");
                }
            }
        }
    }
}

/// Producers watched, by pid.
static WATCHED: OnceCell<Mutex<HashMap<u32, Watch>>> = OnceCell::new();

fn watched() -> std::sync::MutexGuard<'static, HashMap<u32, Watch>> {
    WATCHED
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Watch producer `pid` while memory of it is kept here: when it exits, that memory is
/// unmapped (natively it would be back on the GPU).
fn watch(pid: u32) {
    watched().entry(pid).or_insert_with(|| Watch::new(pid));
    static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    crate::ipc::watch::every("expseg-ipc-kept", &STARTED, WATCH_EVERY, look);
}

/// One look: producers no memory is kept of are forgotten, exited ones' memory unmapped.
fn look() {
    let kept = lock().ipc.kept_producers();
    let exited: Vec<u32> = {
        let mut w = watched();
        w.retain(|p, _| kept.contains(p));
        w.iter()
            .filter(|(_, w)| w.exited())
            .map(|(p, _)| *p)
            .collect()
    };
    for pid in exited {
        let gone = lock().ipc.producer_exited(pid);
        let bytes = unmap(gone.into_iter());
        log::debug!(
            "IPC: process {pid} exited: {bytes} bytes of its memory kept mapped here unmapped"
        );
        watched().remove(&pid);
    }
}
