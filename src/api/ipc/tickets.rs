//! Tickets on the producer's side: whether they can be issued (the socket serves; a ticketed
//! handle still opens with the plain driver, checked once in a child process), the socket
//! itself, and its answer to each ticket.

use super::shares::MAX_RUN;
use crate::api::state::{config, lock, State};
use crate::gpu::cuda;
use crate::ipc::control::Control;
use crate::ipc::server::{self, Peer};
use crate::ipc::sockdir;
use crate::ipc::transport::{self, Decision, Denial, Reply};
use crate::ipc::{Grant, Refusal};
use crate::stats::GLOBAL;
use once_cell::sync::OnceCell;
use std::sync::atomic::Ordering;

/// Whether tickets can be issued for foreign memory on `dev`: the socket serves and a
/// ticketed handle still opens with the plain driver (the one-time check has said so: never
/// waited for here, under the lock). (Whether the other allocator's pages can
/// be exported is found out per request; a consumer falls back to the mirror if not.)
pub(super) fn foreign_tickets_ready(st: &mut State, dev: i32) -> bool {
    server_ready(st) && super::check::known(dev) == Some(true)
}

/// Export the run of foreign mappings starting at `base` that a ticket stands for. The run is
/// checked and every allocation behind it retained at once, with the program's unmaps of the
/// range held back meanwhile (a registered read, as a mirror refresh takes), so the consumer
/// gets the pages that were there when its open was decided even if the program unmaps and
/// maps others there while the descriptors are sent (before, mappings 2..n were looked up by
/// address as they were sent). The first is exported at once (so a refusal is clean), the
/// others as the transport sends them; retained references go as each is exported.
///
/// The run is the program's pages (`foreign::read_run`); what is exported is the driver's
/// mappings that hold them: for coalesced pages, the handles behind them, whole (a handle maps
/// only whole), the first of which may start before the run: the grant's lead says where the
/// run starts inside it. Nothing moves for a share.
fn export_foreign(dev: i32, base: u64, size: u64) -> Decision {
    let t = crate::real::driver().map_err(|_| Refusal::Failed)?;
    // The ticket thread has no context of its own; the source below runs on it too, so it
    // keeps the context until the last descriptor is exported.
    let context = cuda::ensure_context(t, dev);
    // Pages the program released may be parked there by expseg: the run is gone, as it would
    // be natively (an unmapped gap). Checked as the read is registered (after it, a coalescer
    // call waiting for the read could hand a parked handle on before the check; asked with
    // the coalescers' ordinary lock inside the read, the thread would wait for itself).
    let reading = super::runs::read_run(t, base, size).ok_or(Refusal::Stale)?;
    let (lead, vas, sizes) = driver_mappings(t, base, size).ok_or(Refusal::Stale)?;
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
            lead,
        },
        source,
    ))
}

/// The driver's mappings that hold `[base, base+size)`, back to back: how far into the first
/// the range starts, and each mapping's start and size. None: a gap, or more than a grant
/// carries.
fn driver_mappings(
    t: &crate::real::DriverTable,
    base: u64,
    size: u64,
) -> Option<(u64, Vec<u64>, Vec<u64>)> {
    let (start, first, _) = cuda::mapping_of(t, base)?;
    let (mut vas, mut sizes, mut end) = (vec![start], vec![first], start + first);
    while end < base + size {
        let (b, s, _) = cuda::mapping_of(t, end).filter(|m| m.0 == end)?;
        if vas.len() == MAX_RUN {
            return None;
        }
        vas.push(b);
        sizes.push(s);
        end += s;
    }
    Some((base - start, vas, sizes))
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
        let started = match config().sockets {
            true => start_server(),
            false => Err("EXPSEG_SOCKETS=0: no socket is made (handles carry mirrors only)".into()),
        };
        if let Err(e) = &started {
            match config().sockets {
                true => log::warn!("IPC tickets disabled: {e}"),
                false => log::info!("IPC tickets disabled: {e}"),
            }
            st.ipc.server_error = Some(e.clone());
        }
        st.ipc.server = Some(started.is_ok());
    }
    st.ipc.server == Some(true)
}

/// The pid that serves and its socket, removed when that process exits.
static SERVED: OnceCell<(u32, std::path::PathBuf)> = OnceCell::new();

fn start_server() -> Result<(), String> {
    // Nonces are what keeps other processes of the user from guessing tickets.
    crate::ipc::random_u64()
        .ok_or("no random source (getrandom, /dev/urandom) for ticket nonces")?;
    let uid = sockdir::current_uid();
    let others = !config().ipc_allow_uids.is_empty();
    let dir = sockdir::prepare_dir(uid, others)?;
    let name = format!("{}.sock", std::process::id());
    // A dead process's socket with this pid where consumers look first would hide this one.
    for earlier in sockdir::places(uid)?.iter().take_while(|p| p.dir != dir) {
        if sockdir::dir_trusted(&earlier.dir, uid).is_ok() {
            let _ = server::clear_stale(&earlier.dir.join(&name));
        }
    }
    // The usual name, or where a process of another pid namespace holds it, the next free one.
    let path = server::serve_named(&dir, std::process::id(), others, admitted, decide)?;
    let _ = SERVED.set((std::process::id(), path));
    extern "C" fn remove_socket() {
        // A forked child exits with this handler too: the socket stays its parent's.
        let _ = std::panic::catch_unwind(|| {
            if let Some((_, path)) = SERVED.get().filter(|s| s.0 == std::process::id()) {
                let _ = std::fs::remove_file(path);
            }
        });
    }
    #[allow(unsafe_code)]
    // SAFETY: registers a plain extern "C" function that removes one file.
    unsafe {
        libc::atexit(remove_socket);
    }
    Ok(())
}

/// Serve the socket at `path` with this process's own decisions ([`admitted`], [`decide`]:
/// tickets, descriptors, pause, resume, queries, reclaims), for tests that throw hostile
/// requests at the real thing (`tests/socket_flood.rs`).
#[doc(hidden)]
pub fn serve_decisions_at(path: &std::path::Path) -> Result<(), String> {
    server::serve(path, false, admitted, decide)
}

/// Who asks, as the socket tells (a process of another pid namespace never gets this far: the
/// server closes it unread).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    /// This process's own user.
    Own,
    /// A user of `EXPSEG_IPC_ALLOW_UIDS`.
    Allowed,
    /// Anyone else: closed before a byte is read.
    Other,
}

impl Who {
    fn of(peer: u32, own: u32, allowed: &[u32]) -> Who {
        match peer {
            p if p == own => Who::Own,
            p if allowed.contains(&p) => Who::Allowed,
            _ => Who::Other,
        }
    }
}

/// What is asked: the columns of docs/contract.md's "Who may do what".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum What {
    /// A ticket's memory (`cudaIpcOpenMemHandle`).
    Ticket,
    /// A descriptor PyTorch exported (`pidfd_getfd`).
    Descriptor,
    /// Pause (offloading), resume, the bytes paused, a reclaim.
    Control,
    /// A pause that discards.
    Discard,
}

impl What {
    fn of(id: u32, nonce: u64) -> What {
        match Control::of(id, nonce) {
            Some(Control::Pause { discard: true, .. }) => What::Discard,
            Some(_) => What::Control,
            None if id == crate::ipc::reclaim::RECLAIM_ID => What::Control,
            None if id == crate::api::fdshare::record::GETFD_ID => What::Descriptor,
            None if id == crate::ipc::closed::CLOSED_ID => What::Control,
            None if id == crate::ipc::closed::WATCH_ID => What::Control,
            None => What::Ticket,
        }
    }
}

/// Who may ask what, of a process of the same pid namespace: docs/contract.md's table. Other
/// users may map memory shared with them, not stop or trim this process's work, nor take
/// descriptors no ticket names; discarding from outside loses the program's data, and needs
/// its own opt-in (`remote_discard`, EXPSEG_ALLOW_REMOTE_DISCARD).
fn may(who: Who, what: What, remote_discard: bool) -> bool {
    match (who, what) {
        (Who::Own, What::Discard) => remote_discard,
        (Who::Own, _) => true,
        (Who::Allowed, What::Ticket) => true,
        (Who::Allowed | Who::Other, _) => false,
    }
}

/// Whether a process of `uid` is read at all (checked before its request is read; the first
/// refusal is logged).
fn admitted(uid: u32) -> bool {
    let ok = Who::of(uid, sockdir::current_uid(), &config().ipc_allow_uids) != Who::Other;
    if !ok {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            log::warn!("IPC: closed a connection from uid {uid} (not ours, not in EXPSEG_IPC_ALLOW_UIDS); later ones are closed silently");
        }
    }
    ok
}

/// The producer's answer to a ticket: runs on a thread of the socket server. A reclaim
/// (another expseg process of the user found no memory on the GPU the nonce names) is no
/// ticket: what this process holds beyond live memory there goes back, and the answer is a
/// grant of no chunks whose size is the bytes given back.
fn decide(id: u32, nonce: u64, peer: Peer) -> Reply {
    let who = Who::of(peer.uid, sockdir::current_uid(), &config().ipc_allow_uids);
    let what = What::of(id, nonce);
    if !may(who, what, config().allow_remote_discard) {
        match (who, what) {
            (Who::Own, What::Discard) => log::warn!("IPC: refused a pause with discard from outside: this process's paused memory is discarded only with EXPSEG_ALLOW_REMOTE_DISCARD=1 in its environment"),
            (_, What::Ticket) => {}
            _ => log::warn!("IPC: refused request {id:#x} from uid {} (only this process's own user may make it)", peer.uid),
        }
        return Err(Refusal::Forbidden.into());
    }
    if let Some(c) = Control::of(id, nonce) {
        return control(c);
    }
    if id == crate::ipc::closed::CLOSED_ID {
        // A producer freed memory this process may keep mapped (`kept`), or one of its
        // descriptor numbers no longer names its page (`imports`): the producer is the peer,
        // whatever the request says.
        if nonce & crate::ipc::closed::FD != 0 {
            let bytes = crate::api::imports::gone(peer.pid, Some(nonce as u32 as i32));
            let none = transport::fds_of(Vec::new());
            return Ok((Grant::new(bytes, Vec::new()), none));
        }
        return super::kept::producer_freed(peer.pid, nonce as u32);
    }
    if id == crate::ipc::closed::WATCH_ID {
        let none = transport::fds_of(Vec::new());
        return match crate::api::fdshare::watchers::watch(peer.pid) {
            Ok(()) => Ok((Grant::new(0, Vec::new()), none)),
            Err(r) => Err(r.into()),
        };
    }
    if id == crate::ipc::reclaim::RECLAIM_ID {
        let size = crate::api::trim::trim_gpu(nonce);
        let none = transport::fds_of(Vec::new());
        return Ok((Grant::new(size, Vec::new()), none));
    }
    // A consumer of this process's own user may keep the memory mapped after its close: it
    // is told when the memory is freed.
    let keeper = (who == Who::Own).then_some(peer.pid);
    let d = decide_once(id, nonce, keeper);
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
fn control(c: Control) -> Reply {
    let done = match c {
        Control::Pause { tag, discard } => crate::api::sleep::pause(tag, discard, false),
        Control::Resume { tag } => crate::api::sleep::resume(tag),
        Control::Query => Ok(crate::api::sleep::Outcome {
            bytes: crate::api::sleep::paused_bytes(true),
            ..Default::default()
        }),
        Control::Sharing => Ok(crate::api::sleep::Outcome {
            bytes: super::sharing::state(),
            ..Default::default()
        }),
    };
    match done {
        Ok(o) => Ok((
            Grant::new(o.bytes, Vec::new()),
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

fn decide_once(id: u32, nonce: u64, keeper: Option<u32>) -> Decision {
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
        let d = export_foreign(dev, base, size);
        if d.is_ok() {
            lock().ipc.note_granted(id, keeper);
        }
        return d;
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
            st.ipc.note_granted(id, keeper);
            let chunks = fds.iter().map(|f| f.1).collect();
            Ok((
                Grant::new(size, chunks),
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
    use crate::ipc::control::{PAUSE_ID, QUERY_ID, RESUME_ID, SHARING_ID};

    /// The rows of docs/contract.md's "Who may do what": the peer, then one cell per column.
    fn contract_table() -> Vec<(String, Vec<String>)> {
        let doc = include_str!("../../../docs/contract.md");
        let start = doc
            .find("### Who may do what")
            .expect("the table's heading");
        doc[start..]
            .lines()
            .skip_while(|l| !l.starts_with("| peer |"))
            .skip(2) // the header and its rule
            .take_while(|l| l.starts_with('|'))
            .map(|l| {
                let cells: Vec<String> = l
                    .trim_matches('|')
                    .split('|')
                    .map(|c| c.trim().to_string())
                    .collect();
                (cells[0].clone(), cells[1..].to_vec())
            })
            .collect()
    }

    #[test]
    fn who_may_do_what_is_the_contracts_table_row_by_row() {
        // The rows, as the test knows them: who the peer is to this process, not read from the
        // row's words. `same_ns`: of this pid namespace (the server closes any other before
        // anything else; `ipc::server`'s two-namespace test shows it does). A process of
        // another user namespace whose uid maps to ours is, to the kernel's SO_PEERCRED, our
        // uid: served as such.
        let (own, allowed_uid, stranger) = (1000, 1001, 1002);
        let known: [(&str, u32, bool); 6] = [
            ("same uid, same pid namespace", own, true),
            (
                "same uid (another user namespace mapping to it), same pid namespace",
                own,
                true,
            ),
            ("same uid, other pid namespace", own, false),
            (
                "uid in EXPSEG_IPC_ALLOW_UIDS, same pid namespace",
                allowed_uid,
                true,
            ),
            (
                "uid in EXPSEG_IPC_ALLOW_UIDS, other pid namespace",
                allowed_uid,
                false,
            ),
            ("other uid", stranger, true),
        ];
        let rows = contract_table();
        assert_eq!(
            rows.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
            known.iter().map(|k| k.0).collect::<Vec<_>>(),
            "the table's rows"
        );
        let columns = [What::Ticket, What::Descriptor, What::Control, What::Discard];
        let allowed = [allowed_uid];
        for ((peer, cells), (_, uid, same_ns)) in rows.iter().zip(known) {
            assert_eq!(cells.len(), columns.len(), "{peer}");
            let who = Who::of(uid, own, &allowed);
            for (what, cell) in columns.iter().zip(cells) {
                let read = same_ns && who != Who::Other;
                let (without, with) = match read {
                    false => ("closed unread", "closed unread"),
                    true => {
                        let say = |ok| if ok { "yes" } else { "refused" };
                        (say(may(who, *what, false)), say(may(who, *what, true)))
                    }
                };
                let expected = match (without, with) {
                    (a, b) if a == b => a.to_string(),
                    ("refused", "yes") => "only with EXPSEG_ALLOW_REMOTE_DISCARD=1".to_string(),
                    other => panic!("{other:?}"),
                };
                assert_eq!(cell, &expected, "row {peer:?}, column {what:?}");
            }
        }
    }

    #[test]
    fn requests_are_told_apart_by_id_and_the_discard_bit() {
        use crate::api::fdshare::record::GETFD_ID;
        use crate::ipc::reclaim::RECLAIM_ID;
        let discard = crate::ipc::control::Control::Pause {
            tag: Some(3),
            discard: true,
        }
        .encode();
        assert_eq!(What::of(discard.0, discard.1), What::Discard);
        for id in [PAUSE_ID, RESUME_ID, QUERY_ID, SHARING_ID, RECLAIM_ID] {
            assert_eq!(What::of(id, 5), What::Control, "{id:#x}");
        }
        assert_eq!(What::of(GETFD_ID, 3), What::Descriptor);
        for ticket in [1, transport::FIRST_REQUEST_ID - 1] {
            assert_eq!(What::of(ticket, 1 << 32), What::Ticket);
        }
        assert_eq!(Who::of(7, 7, &[8]), Who::Own);
        assert_eq!(Who::of(8, 7, &[8]), Who::Allowed);
        assert_eq!(Who::of(9, 7, &[8]), Who::Other);
    }

    #[test]
    fn requests_that_are_not_tickets_come_only_from_the_processs_own_user() {
        // Through decide: a descriptor asked by another user is refused before anything is
        // looked up; from the own user one nobody exported is unknown.
        let own = sockdir::current_uid();
        let getfd = crate::api::fdshare::record::GETFD_ID;
        assert!(matches!(
            decide(
                getfd,
                3,
                Peer {
                    uid: own.wrapping_add(1),
                    pid: 1
                }
            ),
            Err(Denial {
                why: Refusal::Forbidden,
                done: 0
            })
        ));
        assert!(matches!(
            decide(getfd, 1 << 40, Peer { uid: own, pid: 1 }),
            Err(Denial {
                why: Refusal::Unknown,
                ..
            })
        ));
        // A discarding pause from outside, without the process's opt-in: refused, nothing
        // done.
        let (id, nonce) = Control::Pause {
            tag: Some(77),
            discard: true,
        }
        .encode();
        assert!(matches!(
            decide(id, nonce, Peer { uid: own, pid: 1 }),
            Err(Denial {
                why: Refusal::Forbidden,
                done: 0
            })
        ));
    }
}
