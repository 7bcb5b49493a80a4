//! Tickets on the producer's side: whether they can be issued (the socket serves; a ticketed
//! handle still opens with the plain driver, checked once in a child process), the socket
//! itself, and its answer to each ticket.

use super::shares::MAX_RUN;
use crate::api::state::{config, lock, State};
use crate::gpu::cuda;
use crate::ipc::sockdir;
use crate::ipc::transport::{self, Decision, Denial, Reply};
use crate::ipc::{Grant, Refusal};
use crate::stats::GLOBAL;
use std::sync::atomic::Ordering;

/// Whether tickets can be issued for foreign memory on `dev`: the socket serves and a
/// ticketed handle still opens with the plain driver (the one-time check has said so: never
/// waited for here, under the lock). (Whether the other allocator's pages can
/// be exported is found out per request; a consumer falls back to the mirror if not.)
pub(super) fn foreign_tickets_ready(st: &mut State, dev: i32) -> bool {
    server_ready(st) && super::check::known(dev) == Some(true)
}

/// Export the run of foreign mappings starting at `base` that a ticket stands for. The run is
/// checked and every mapping's allocation retained at once, with the program's unmaps of the
/// range held back meanwhile (a registered read, as a mirror refresh takes), so the consumer
/// gets the pages that were there when its open was decided even if the program unmaps and
/// maps others there while the descriptors are sent (before, mappings 2..n were looked up by
/// address as they were sent). The first is exported at once (so a refusal is clean), the
/// others as the transport sends them; retained references go as each is exported.
fn export_foreign(dev: i32, base: u64, size: u64) -> Decision {
    let t = crate::real::driver().map_err(|_| Refusal::Failed)?;
    // The ticket thread has no context of its own; the source below runs on it too, so it
    // keeps the context until the last descriptor is exported.
    let context = cuda::ensure_context(t, dev);
    // Pages the program released may be parked there by expseg: the run is gone, as it would
    // be natively (an unmapped gap). Checked as the read is registered (after it, a coalescer
    // call waiting for the read could hand a parked handle on before the check; asked with
    // the coalescers' ordinary lock inside the read, the thread waited for itself: b337f23).
    let reading = crate::api::vmm::begin_read_unparked(base, size).ok_or(Refusal::Stale)?;
    let (start, all, _) = cuda::run_from(t, base, MAX_RUN).ok_or(Refusal::Stale)?;
    // The mappings that make up the shared `size`: still mapped from the same start.
    let (mut sizes, mut vas, mut end) = (Vec::new(), Vec::new(), start);
    for s in all {
        if end >= start + size {
            break;
        }
        sizes.push(s);
        vas.push(end);
        end += s;
    }
    if start != base || end != base + size {
        return Err(Refusal::Stale);
    }
    let cannot = |e: crate::gpu::DrvError| {
        log::warn!("IPC: the pages at {base:#x} cannot be exported ({e}); consumers fall back to the mirror");
        Refusal::Failed
    };
    let mut run = cuda::retain_run(t, &vas).map_err(cannot)?;
    drop(reading);
    let first = run
        .export_next()
        .unwrap_or(Err(crate::gpu::DrvError(cuda::NOT_FOUND)))
        .map_err(cannot)?;
    let mut slow = config().test_slow_export_ms;
    let mut first = Some(first);
    // Fields drop in order: the references before the context.
    let mut held = (run, context);
    let source: transport::FdSource = Box::new(move || {
        if let Some(f) = first.take() {
            return Ok(f);
        }
        if let Some(ms) = slow.take() {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        match held.0.export_next() {
            Some(r) => r.map_err(|e| std::io::Error::other(e.to_string())),
            None => Err(std::io::Error::other("no more mappings")),
        }
    });
    Ok((
        Grant {
            size,
            chunks: sizes,
        },
        source,
    ))
}

/// `EXPSEG_IPC_PEERS=expseg` promises consumers the memory itself; without tickets there is
/// no way to keep that promise, and a mirror would silently break it: fail, saying why.
pub(super) fn peers_without_tickets(st: &State, ptr: u64) -> i32 {
    let why = match (&st.ipc.server_error, config().ipc_tickets) {
        (_, false) => "EXPSEG_IPC_TICKETS=0".to_string(),
        (Some(e), _) => e.clone(),
        (None, _) => "this device's memory cannot be exported, or the driver does not accept ticketed handles (expseg doctor tells)".to_string(),
    };
    log::error!("IPC: cudaIpcGetMemHandle({ptr:#x}) fails: EXPSEG_IPC_PEERS=expseg needs tickets, and tickets are off: {why}");
    NOT_SUPPORTED
}

/// Whether tickets can be issued: the device's chunks are exportable, the socket serves, and
/// a ticketed handle still opens with the plain driver (the one-time check has said so: never
/// waited for here, under the lock).
pub(super) fn tickets_ready(st: &mut State, dev: i32) -> bool {
    if !st.open_pool(dev).is_some_and(|p| p.driver().shareable) {
        return false;
    }
    server_ready(st) && super::check::known(dev) == Some(true)
}

/// Start the ticket socket if it does not serve yet (for `fdshare`); whether it serves.
pub(crate) fn ensure_server() -> bool {
    let mut st = lock();
    server_ready(&mut st)
}

/// Start the ticket socket on first use; whether it serves.
fn server_ready(st: &mut State) -> bool {
    if st.ipc.server.is_none() {
        let started = start_server();
        if let Err(e) = &started {
            log::warn!("IPC tickets disabled: {e}");
            st.ipc.server_error = Some(e.clone());
        }
        st.ipc.server = Some(started.is_ok());
    }
    st.ipc.server == Some(true)
}

fn start_server() -> Result<(), String> {
    // Nonces are what keeps other processes of the user from guessing tickets.
    crate::ipc::random_u64()
        .ok_or("no random source (getrandom, /dev/urandom) for ticket nonces")?;
    let uid = sockdir::current_uid();
    let others = !config().ipc_allow_uids.is_empty();
    sockdir::prepare_dir(uid, others)?;
    let path = sockdir::socket_path(uid, std::process::id());
    transport::serve(&path, others, admitted, decide)?;
    extern "C" fn remove_socket() {
        let _ = std::panic::catch_unwind(|| {
            std::fs::remove_file(sockdir::socket_path(
                sockdir::current_uid(),
                std::process::id(),
            ))
        });
    }
    #[allow(unsafe_code)]
    // SAFETY: registers a plain extern "C" function that removes one file.
    unsafe {
        libc::atexit(remove_socket);
    }
    Ok(())
}

/// Whether a process of `uid` may ask for tickets at all (checked before its request is
/// read; the first refusal is logged).
fn admitted(uid: u32) -> bool {
    let ok = uid == sockdir::current_uid() || config().ipc_allow_uids.contains(&uid);
    if !ok {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            log::warn!("IPC: closed a connection from uid {uid} (not ours, not in EXPSEG_IPC_ALLOW_UIDS); later ones are closed silently");
        }
    }
    ok
}

/// Whether a process of `peer` may ask request `id` of a process of `own`: a ticket, the own
/// user or one of `allowed` (EXPSEG_IPC_ALLOW_UIDS); a request that is not a ticket (pause,
/// resume, query, reclaim, a descriptor for pidfd_getfd), the own user only: other users may
/// map memory shared with them, not stop or trim this process's work, nor take descriptors no
/// ticket names.
fn may_ask(id: u32, peer: u32, own: u32, allowed: &[u32]) -> bool {
    peer == own || (id < transport::FIRST_REQUEST_ID && allowed.contains(&peer))
}

/// The producer's answer to a ticket: runs on a thread of the socket server. A reclaim
/// (another expseg process of the user found no memory on the GPU the nonce names) is no
/// ticket: what this process holds beyond live memory there goes back, and the answer is a
/// grant of no chunks whose size is the bytes given back.
fn decide(id: u32, nonce: u64, peer: u32) -> Reply {
    if !may_ask(id, peer, sockdir::current_uid(), &config().ipc_allow_uids) {
        if id >= transport::FIRST_REQUEST_ID {
            log::warn!("IPC: refused request {id:#x} from uid {peer} (only this process's own user may make it)");
        }
        return Err(Refusal::Forbidden.into());
    }
    if let Some(c) = crate::ipc::control::Control::of(id, nonce) {
        return control(c);
    }
    if id == crate::ipc::reclaim::RECLAIM_ID {
        let size = crate::api::trim::trim_gpu(nonce);
        let none = transport::fds_of(Vec::new());
        return Ok((
            Grant {
                size,
                chunks: Vec::new(),
            },
            none,
        ));
    }
    let d = decide_once(id, nonce);
    match &d {
        Ok(_) => GLOBAL.ipc_tickets_granted.add(1),
        Err(_) => GLOBAL.ipc_tickets_refused.add(1),
    }
    d.map_err(Denial::from)
}

/// `expseg pause|resume PID` from the user: done on this thread; the answer is a grant of no
/// chunks whose size is the bytes paused or resumed, or a refusal (`NoMemory`: a resume or a
/// pause that found no memory; else `Failed`) with the bytes done anyway (what paused or
/// resumed before the failure stays so).
fn control(c: crate::ipc::control::Control) -> Reply {
    use crate::ipc::control::Control;
    let done = match c {
        Control::Pause { tag, discard } => crate::api::sleep::pause(tag, discard, false),
        Control::Resume { tag } => crate::api::sleep::resume(tag),
        Control::Query => Ok(crate::api::sleep::Outcome {
            bytes: crate::api::sleep::paused_bytes(),
            ..Default::default()
        }),
    };
    match done {
        Ok(o) => Ok((
            Grant {
                size: o.bytes,
                chunks: Vec::new(),
            },
            transport::fds_of(Vec::new()),
        )),
        Err(e) => Err(Denial {
            why: match e.code {
                crate::gpu::CUDA_ERROR_OUT_OF_MEMORY => Refusal::NoMemory,
                _ => Refusal::Failed,
            },
            done: e.done.bytes,
        }),
    }
}

fn decide_once(id: u32, nonce: u64) -> Decision {
    if id == crate::api::fdshare::record::GETFD_ID {
        return crate::api::fdshare::record::serve(nonce);
    }
    let mut st = lock();
    let Some(&(dev, base, n)) = st.ipc.by_id.get(&id) else {
        return Err(if st.ipc.freed.contains(&id) {
            Refusal::Stale
        } else {
            Refusal::Unknown
        });
    };
    if n != nonce {
        return Err(Refusal::Unknown);
    }
    if let Some(f) = st.ipc.foreign.get(&base) {
        let size = f.size;
        drop(st);
        return export_foreign(dev, base, size);
    }
    let Some(pool) = st.open_pool(dev) else {
        return Err(Refusal::Stale);
    };
    match pool.export_fds(base) {
        None => Err(Refusal::Stale),
        Some(Err(e)) => {
            log::error!("IPC: exporting the chunks of {base:#x} failed: {e}");
            Err(Refusal::Failed)
        }
        Some(Ok((size, fds))) => {
            let chunks = fds.iter().map(|f| f.1).collect();
            Ok((
                Grant { size, chunks },
                transport::fds_of(fds.into_iter().map(|f| f.0).collect()),
            ))
        }
    }
}

/// `cudaErrorNotSupported`.
pub(super) const NOT_SUPPORTED: i32 = 801;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_that_are_not_tickets_come_only_from_the_processs_own_user() {
        let (me, other, stranger) = (1000, 1001, 1002);
        let allowed = [other];
        for id in [
            crate::api::fdshare::record::GETFD_ID,
            crate::ipc::reclaim::RECLAIM_ID,
            crate::ipc::control::QUERY_ID,
            crate::ipc::control::RESUME_ID,
            crate::ipc::control::PAUSE_ID,
        ] {
            assert!(may_ask(id, me, me, &allowed), "{id:#x} from the own user");
            assert!(
                !may_ask(id, other, me, &allowed),
                "{id:#x} from an allowed user"
            );
        }
        for ticket in [1, transport::FIRST_REQUEST_ID - 1] {
            assert!(may_ask(ticket, me, me, &allowed));
            assert!(
                may_ask(ticket, other, me, &allowed),
                "tickets: allowed users too"
            );
            assert!(!may_ask(ticket, stranger, me, &allowed));
        }
        // Through decide: a descriptor asked by another user is refused before anything is
        // looked up; from the own user one nobody exported is unknown.
        let own = sockdir::current_uid();
        let getfd = crate::api::fdshare::record::GETFD_ID;
        assert!(matches!(
            decide(getfd, 3, own.wrapping_add(1)),
            Err(Denial {
                why: Refusal::Forbidden,
                done: 0
            })
        ));
        assert!(matches!(
            decide(getfd, 1 << 40, own),
            Err(Denial {
                why: Refusal::Unknown,
                ..
            })
        ));
    }
}
