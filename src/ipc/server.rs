//! The socket's server: who is read and answered, when, and on which thread. A connection's
//! peer is checked before a byte of it is read (`transport::peer_of`), its request is read
//! within bounds, and it is answered (`transport::reply`) once one of a limited number of
//! places is free.

use super::ns;
use super::transport::{connect_within, peer_of, read_exact_by, reply, Reply, FIRST_REQUEST_ID};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

/// Connections whose request is being read at once. Each has [`FIRST_BYTE`] to start its
/// request and [`REQUEST_WITHIN`] to send all 16 bytes, so peers that send nothing, or a byte
/// at a time, hold a place briefly; a connection beyond them waits among the parked ones
/// ([`MAX_PARKED`]), never on the accepting thread (one that waited there kept the owner's
/// own request, from another process, behind a silent flood for 1-2.3 s).
pub const MAX_READING: usize = 32;

/// Places of [`MAX_READING`] one process may hold at once: a flood from one process leaves
/// the others room (the own user's reserve has no such cap).
pub const PER_PEER_READING: usize = 16;

/// Connections that found no reading place, waiting (unread, in order) for one up to
/// [`SLOT_WAIT`] on a thread of their own; beyond them a connection is closed at once.
pub const MAX_PARKED: usize = 256;

/// Reading places beyond [`MAX_READING`] that only processes of the server's own user may take:
/// another user's flood (an `EXPSEG_IPC_ALLOW_UIDS` user's) cannot keep the owner's
/// `expseg pause` or a reclaim out.
pub const RESERVED_READING: usize = 16;

/// Requests answered at once (a burst of consumers opening one producer's handles); a request
/// beyond them waits for one to end up to [`SLOT_WAIT`] (well within the asker's 10 s), then
/// is closed unanswered.
pub const MAX_IN_FLIGHT: usize = 32;

/// Answers beyond [`MAX_IN_FLIGHT`] that only the server's own user's control requests
/// (pause, resume, query, sharing, reclaim: ids from [`FIRST_REQUEST_ID`] below `u32::MAX`) may take, so
/// slow tickets cannot keep `expseg pause` or a reclaim waiting.
pub const RESERVED: usize = 8;

/// How long a connection may wait before the first byte of its request.
const FIRST_BYTE: Duration = Duration::from_millis(200);

/// How long a connection may take to send its whole request.
const REQUEST_WITHIN: Duration = Duration::from_secs(1);

/// How long a connection waits for a place to be read or answered.
const SLOT_WAIT: Duration = Duration::from_secs(2);

/// Whether request `id` of a peer of uid `peer` may take a [`RESERVED`] place.
fn reserved_for(id: u32, peer: u32) -> bool {
    (FIRST_REQUEST_ID..u32::MAX).contains(&id) && peer == super::sockdir::current_uid()
}

/// Places counted against limits: one is taken while a connection is read or answered.
struct Places(std::sync::atomic::AtomicUsize);

/// A place taken, given back when dropped (a panic included).
struct Place(std::sync::Arc<Places>);

impl Drop for Place {
    fn drop(&mut self) {
        (self.0).0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl Places {
    fn new() -> std::sync::Arc<Places> {
        std::sync::Arc::new(Places(std::sync::atomic::AtomicUsize::new(0)))
    }

    /// Take a place while fewer than `limit` are taken, waiting at most [`SLOT_WAIT`].
    fn take(self: &std::sync::Arc<Self>, limit: usize) -> Option<Place> {
        use std::sync::atomic::Ordering::AcqRel;
        let waited = std::time::Instant::now();
        loop {
            if self.0.fetch_add(1, AcqRel) < limit {
                return Some(Place(self.clone()));
            }
            self.0.fetch_sub(1, AcqRel);
            if waited.elapsed() >= SLOT_WAIT {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// The reading places: how many are taken, of the shared ones by each process, and of the own
/// user's reserve.
#[derive(Default)]
struct Readers(std::sync::Mutex<Taken>);

#[derive(Default)]
struct Taken {
    shared: usize,
    reserve: usize,
    by_pid: std::collections::HashMap<u32, usize>,
}

/// A reading place, given back when dropped (a panic included): of `pid`'s shared ones, or
/// of the reserve (`None`).
struct Reading(std::sync::Arc<Readers>, Option<u32>);

impl Drop for Reading {
    fn drop(&mut self) {
        let mut t = self.0.lock();
        match self.1 {
            None => t.reserve -= 1,
            Some(pid) => {
                t.shared -= 1;
                if let Some(n) = t.by_pid.get_mut(&pid) {
                    *n -= 1;
                    if *n == 0 {
                        t.by_pid.remove(&pid);
                    }
                }
            }
        }
    }
}

impl Readers {
    fn lock(&self) -> std::sync::MutexGuard<'_, Taken> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for a connection of process `pid` (of the server's own user: `own`), at once or
    /// not at all: a shared one while fewer than [`MAX_READING`] are taken and `pid` holds
    /// fewer than [`PER_PEER_READING`], else for the own user one of [`RESERVED_READING`].
    fn admit(self: &std::sync::Arc<Self>, pid: u32, own: bool) -> Option<Reading> {
        let mut t = self.lock();
        let mine = t.by_pid.get(&pid).copied().unwrap_or(0);
        if t.shared < MAX_READING && mine < PER_PEER_READING {
            t.shared += 1;
            *t.by_pid.entry(pid).or_insert(0) += 1;
            return Some(Reading(self.clone(), Some(pid)));
        }
        if own && t.reserve < RESERVED_READING {
            t.reserve += 1;
            return Some(Reading(self.clone(), None));
        }
        None
    }
}

/// Who is at the other end of an admitted connection, as `SO_PEERCRED` told (a process of this
/// pid namespace: the server closed any other unread).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub pid: u32,
}

/// A connection admitted but not yet read: its stream, peer and when it came.
type Parked = (UnixStream, u32, u32, std::time::Instant);

/// Listen at `path` on a thread of its own. Each connection's peer is checked with
/// `SO_PEERCRED` before a byte is read: a process of another pid namespace is closed at once,
/// whatever its uid (it could not be told from a process of this one with the same pid, and
/// a container must not reach into another that shares its `/tmp`), and so is one that
/// `admit(uid)` refuses. `Err` where this process's pid namespace is unknown. Then each
/// admitted connection is read and answered on a thread of its own, so an idle or slow peer
/// delays nobody else: at most [`MAX_READING`] read at once ([`PER_PEER_READING`] a process,
/// [`RESERVED_READING`] more for the own user), within [`FIRST_BYTE`] and [`REQUEST_WITHIN`],
/// the rest parked (never on the accepting thread) up to [`SLOT_WAIT`]; at most [`MAX_IN_FLIGHT`] answered at once, plus [`RESERVED`] for the
/// own user's control requests; `decide(id, nonce, peer)` answers.
pub fn serve(
    path: &Path,
    others: bool,
    admit: impl Fn(u32) -> bool + Send + 'static,
    decide: impl Fn(u32, u64, Peer) -> Reply + Send + Sync + 'static,
) -> Result<(), String> {
    let own_ns = ns::own()?;
    clear_stale(path)?;
    let listener = UnixListener::bind(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // Connecting needs write permission on the socket: for allowed other users, everyone may
    // connect, and the uid check decides.
    let mode = if others { 0o666 } else { 0o600 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let decide = std::sync::Arc::new(decide);
    let (reading, answering) = (std::sync::Arc::new(Readers::default()), Places::new());
    let me = super::sockdir::current_uid();
    // Read and answer one connection on a thread of its own.
    let start = {
        let (decide, answering) = (decide.clone(), answering.clone());
        move |s: UnixStream, peer: Peer, read_place: Reading| {
            let (decide, answering) = (decide.clone(), answering.clone());
            let _ = std::thread::Builder::new()
                .name("expseg-ipc-req".into())
                .spawn(move || {
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        answer(s, peer, read_place, &answering, &*decide)
                    }));
                });
            // A thread that could not start drops the connection and its place.
        }
    };
    // Connections that found no place wait here, in order, for one.
    let (park, parked) = crossbeam::channel::bounded::<Parked>(MAX_PARKED);
    {
        let (reading, start) = (reading.clone(), start.clone());
        std::thread::Builder::new()
            .name("expseg-ipc-wait".into())
            .spawn(move || {
                for (s, uid, pid, came) in parked {
                    loop {
                        if let Some(place) = reading.admit(pid, uid == me) {
                            start(s, Peer { uid, pid }, place);
                            break;
                        }
                        if came.elapsed() >= SLOT_WAIT {
                            break; // closed unread
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            })
            .map_err(|e| format!("cannot start the IPC thread: {e}"))?;
    }
    std::thread::Builder::new()
        .name("expseg-ipc".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(s) = conn else {
                    // Out of descriptors (EMFILE/ENFILE): the connection stays queued and
                    // accept fails again at once; a pause keeps this thread off the CPU.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let admitted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    match peer_of(&s, own_ns) {
                        Ok((uid, pid)) => admit(uid).then_some((uid, pid)),
                        Err(why) => {
                            refused_once(&why);
                            None
                        }
                    }
                }));
                let Ok(Some((uid, pid))) = admitted else {
                    continue; // closed unread
                };
                match reading.admit(pid, uid == me) {
                    Some(place) => start(s, Peer { uid, pid }, place),
                    // No place now: parked, or closed at once where too many are.
                    None => {
                        let _ = park.try_send((s, uid, pid, std::time::Instant::now()));
                    }
                }
            }
        })
        .map_err(|e| format!("cannot start the IPC thread: {e}"))?;
    Ok(())
}

/// [`serve`] in `dir` under the first of producer `pid`'s names ([`sockdir::socket_names`])
/// that no live process holds (one of another pid namespace can bind the usual name first:
/// this process then serves under the next, where askers look too): the path served.
pub fn serve_named(
    dir: &Path,
    pid: u32,
    others: bool,
    admit: impl Fn(u32) -> bool + Send + 'static,
    decide: impl Fn(u32, u64, Peer) -> Reply + Send + Sync + 'static,
) -> Result<std::path::PathBuf, String> {
    let mut first_err = None;
    for name in super::sockdir::socket_names(pid) {
        let path = dir.join(&name);
        if let Err(e) = clear_stale(&path) {
            log::warn!("IPC: {e}; trying the next name");
            first_err.get_or_insert(e);
            continue;
        }
        serve(&path, others, admit, decide)?;
        return Ok(path);
    }
    Err(first_err.unwrap_or_else(|| "no socket name left".into()))
}

/// Make way for a socket at `path`: a file there that no process listens on (the socket of a
/// dead process that had this pid) is removed; a live socket is never touched: another process
/// serves there (of another pid namespace whose directory name is the same), and this one
/// serves nothing rather than take its socket away.
pub fn clear_stale(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let Ok(found) = std::fs::symlink_metadata(path) else {
        return Ok(()); // nothing there
    };
    match connect_within(path, Duration::from_millis(200)) {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            // Only the file found dead: not one a process with the same pid made meanwhile.
            let now = std::fs::symlink_metadata(path);
            if now.is_ok_and(|m| (m.dev(), m.ino()) == (found.dev(), found.ino())) {
                let _ = std::fs::remove_file(path);
            }
            Ok(())
        }
        Ok(_) => Err(format!(
            "{}: another process serves this socket",
            path.display()
        )),
        Err(e) => Err(format!(
            "{}: a socket that may be another process's ({e})",
            path.display()
        )),
    }
}

/// The first connection closed for its pid namespace is logged; later ones are not.
fn refused_once(why: &str) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        log::warn!("IPC: closed a connection unread: {why} (only processes of this pid namespace are served); later ones are closed silently");
    }
}

/// Read one request from an admitted peer (holding `read_place` meanwhile) and answer it once
/// a place among `answering` is free.
fn answer(
    mut s: UnixStream,
    peer: Peer,
    read_place: Reading,
    answering: &std::sync::Arc<Places>,
    decide: &dyn Fn(u32, u64, Peer) -> Reply,
) {
    let req = read_request(&mut s);
    drop(read_place);
    let Some(req) = req else {
        return; // closed unanswered
    };
    let id = u32::from_le_bytes(req[0..4].try_into().unwrap());
    let nonce = u64::from_le_bytes(req[8..16].try_into().unwrap());
    let limit = match reserved_for(id, peer.uid) {
        true => MAX_IN_FLIGHT + RESERVED,
        false => MAX_IN_FLIGHT,
    };
    let Some(_answering) = answering.take(limit) else {
        return; // closed unanswered
    };
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
    let _ = reply(&mut s, decide(id, nonce, peer));
}

/// The 16 bytes of a request: the first within [`FIRST_BYTE`], all within
/// [`REQUEST_WITHIN`]; `None` for a peer that is slower, or closes first.
fn read_request(s: &mut UnixStream) -> Option<[u8; 16]> {
    let started = std::time::Instant::now();
    let mut req = [0u8; 16];
    read_exact_by(s, &mut req[..1], started + FIRST_BYTE).ok()?;
    read_exact_by(s, &mut req[1..], started + REQUEST_WITHIN).ok()?;
    Some(req)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::sockdir::current_uid;
    use crate::ipc::socket_tests::{counting_server, helper, helper_said};
    use crate::ipc::transport::{ask, ask_plain, fds_of, AskError};
    use crate::ipc::{Grant, Refusal};
    use std::io::Read;
    use std::io::Write;
    use std::path::PathBuf;

    #[test]
    fn a_live_socket_is_never_unlinked_a_dead_one_is_replaced() {
        let dir = std::env::temp_dir().join(format!("expseg-live-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("7.sock");
        // Another process's live socket at the same name (another namespace's pid 7).
        let theirs = UnixListener::bind(&path).unwrap();
        let e = serve(
            &path,
            false,
            |_| true,
            |_, _, _| Err(Refusal::Unknown.into()),
        )
        .unwrap_err();
        assert!(e.contains("another process serves"), "{e}");
        let mut c = UnixStream::connect(&path).expect("their socket still answers");
        theirs.accept().unwrap();
        c.write_all(b"x").unwrap();
        // Once it is dead, the name is free: the stale file goes, this process serves there.
        drop(theirs);
        serve(
            &path,
            false,
            |_| true,
            |_, _, _| Err(Refusal::Unknown.into()),
        )
        .unwrap();
        let me = (current_uid(), std::process::id());
        assert!(matches!(
            ask(&path, me.0, me.1, 3, 1),
            Err(AskError::Refused(Refusal::Unknown, 0))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn idle_peers_do_not_delay_a_request() {
        let (path, _) = counting_server("idle", |_| true);
        // Three connections that never send a byte: each holds a place to be read 200 ms.
        let idle: Vec<UnixStream> = (0..3)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        let t = std::time::Instant::now();
        let me = (current_uid(), std::process::id());
        let (g, _) = ask(&path, me.0, me.1, 7, 1).unwrap();
        assert_eq!(g.chunks.len(), 1);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "served in {:?}",
            t.elapsed()
        );
        drop(idle);
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn a_burst_beyond_the_requests_served_at_once_waits_for_a_slot() {
        // MAX_IN_FLIGHT tickets each answered in 0.4 s take every place; one more meanwhile
        // waits for a place and is answered.
        let path = server_with("burst", |id, _, _| {
            std::thread::sleep(Duration::from_millis(400));
            if id == 7 {
                return plain(1);
            }
            Err(Refusal::Unknown.into())
        });
        let me = (current_uid(), std::process::id());
        let burst: Vec<_> = (0..MAX_IN_FLIGHT)
            .map(|_| {
                let path = path.clone();
                std::thread::spawn(move || {
                    ask_plain(&path, me.0, me.1, 5, 0, Duration::from_secs(10))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let asked = ask_plain(&path, me.0, me.1, 7, 1, Duration::from_secs(10));
        assert_eq!(asked.expect("answered once a place was free"), 1);
        for b in burst {
            assert!(b.join().unwrap().is_err());
        }
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    /// A private directory of this test's and a server in it whose `decide` is the test's.
    fn server_with(
        name: &str,
        decide: impl Fn(u32, u64, Peer) -> Reply + Send + Sync + 'static,
    ) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("expseg-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let path = dir.join("p.sock");
        serve(&path, false, |_| true, decide).unwrap();
        path
    }

    /// The owner's control request (the first request id) of the server at `path`, as this
    /// process: its answer and how long it took.
    fn owners_query(path: &Path) -> (u64, Duration) {
        let t = std::time::Instant::now();
        let asked = ask_plain(
            path,
            current_uid(),
            std::process::id(),
            FIRST_REQUEST_ID,
            0,
            Duration::from_secs(5),
        );
        (asked.unwrap(), t.elapsed())
    }

    /// A grant of no chunks whose size is `size` (a control request's answer).
    fn plain(size: u64) -> Reply {
        Ok((Grant::new(size, vec![]), fds_of(vec![])))
    }

    #[test]
    fn reading_places_are_capped_per_process_and_kept_for_the_own_user_without_a_wait() {
        let r = std::sync::Arc::new(Readers::default());
        let t0 = std::time::Instant::now();
        let one: Vec<_> = (0..PER_PEER_READING)
            .map(|_| r.admit(7, false).unwrap())
            .collect();
        assert!(r.admit(7, false).is_none(), "one process's cap");
        let rest: Vec<_> = (0..MAX_READING - PER_PEER_READING)
            .map(|i| r.admit(100 + i as u32, false).unwrap())
            .collect();
        assert!(r.admit(999, false).is_none(), "every shared place taken");
        let own: Vec<_> = (0..RESERVED_READING)
            .map(|_| r.admit(7, true).unwrap())
            .collect();
        assert!(r.admit(3000, true).is_none(), "the reserve taken too");
        assert!(
            t0.elapsed() < Duration::from_millis(100),
            "never waits: {:?}",
            t0.elapsed()
        );
        drop(one);
        assert!(r.admit(7, false).is_some(), "given back when dropped");
        drop((rest, own));
        let t = r.lock();
        assert_eq!((t.shared, t.reserve, t.by_pid.len()), (0, 0, 0));
    }

    #[test]
    fn a_silent_flood_from_another_process_does_not_delay_the_owners_request() {
        // Another process keeps 48 silent connections open (more than the shared places):
        // capped per process, it leaves this process a place at once, where the accepting
        // thread that waited for places kept the owner's request behind the flood.
        let path = server_with("flood", |_, _, _| plain(42));
        let Some(mut child) = helper(
            "silent_helper",
            false,
            ("EXPSEG_TEST_SILENT", path.as_path()),
        ) else {
            return;
        };
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while helper_said(&line, "silent").is_none() {
            line.clear();
            if std::io::BufRead::read_line(&mut out, &mut line).unwrap_or(0) == 0 {
                panic!("the helper said nothing");
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        let mut worst = Duration::ZERO;
        for _ in 0..10 {
            let (asked, took) = owners_query(&path);
            assert_eq!(asked, 42);
            worst = worst.max(took);
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            worst < Duration::from_millis(60),
            "answered within {worst:?}"
        );
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn a_name_another_process_holds_is_left_and_askers_find_the_next() {
        // Another process (here a helper, of another pid: as one of another pid namespace
        // would) serves at this process's usual name first. This process serves under the
        // next name; an asker of this process's socket, sent to the usual name, finds it.
        let dir = std::env::temp_dir().join(format!("expseg-squat-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let me = (current_uid(), std::process::id());
        let usual = dir.join(format!("{}.sock", me.1));
        let Some(mut squatter) = helper("serve_helper", false, ("EXPSEG_TEST_SERVE", &usual))
        else {
            return;
        };
        let t0 = std::time::Instant::now();
        while std::fs::symlink_metadata(&usual).is_err() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(100));
        let served = serve_named(&dir, me.1, false, |_| true, |_, _, _| plain(42)).unwrap();
        assert_eq!(served, dir.join(format!("{}.1.sock", me.1)));
        assert!(
            std::fs::symlink_metadata(&usual).is_ok(),
            "the other's socket stays"
        );
        let asked = ask_plain(
            &usual,
            me.0,
            me.1,
            FIRST_REQUEST_ID,
            0,
            Duration::from_secs(5),
        );
        assert_eq!(asked.unwrap(), 42, "found under the next name");
        let _ = squatter.kill();
        let _ = squatter.wait();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn forty_silent_peers_do_not_keep_the_owners_request_waiting() {
        let path = server_with("silent40", |_, _, _| plain(42));
        // More connections than places to read them, none sending a byte.
        let silent: Vec<UnixStream> = (0..40)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        let (asked, took) = owners_query(&path);
        assert_eq!(asked, 42);
        assert!(took < Duration::from_secs(1), "answered in {took:?}");
        // The silent ones were closed unanswered.
        for mut s in silent {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            assert_eq!(s.read(&mut [0u8; 16]).unwrap_or(0), 0);
        }
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn slow_tickets_leave_places_for_the_owners_control_requests() {
        // Every ticket takes 1.5 s to answer; control requests are answered at once.
        let path = server_with("reserved", |id, _, _| {
            if id < FIRST_REQUEST_ID {
                std::thread::sleep(Duration::from_millis(1500));
                return Err(Refusal::Unknown.into());
            }
            plain(7)
        });
        let me = (current_uid(), std::process::id());
        let tickets: Vec<_> = (0..MAX_IN_FLIGHT)
            .map(|i| {
                let path = path.clone();
                std::thread::spawn(move || {
                    ask_plain(&path, me.0, me.1, i as u32 + 1, 0, Duration::from_secs(10))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let t = std::time::Instant::now();
        let asked = ask_plain(&path, me.0, me.1, u32::MAX - 2, 0, Duration::from_secs(5));
        assert_eq!(asked.unwrap(), 7);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "answered in {:?}",
            t.elapsed()
        );
        for t in tickets {
            assert!(matches!(
                t.join().unwrap(),
                Err(AskError::Refused(Refusal::Unknown, 0))
            ));
        }
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn a_request_sent_a_byte_at_a_time_is_closed_after_a_second() {
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = seen.clone();
        let path = server_with("drip", move |_, _, _| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            plain(1)
        });
        let mut s = UnixStream::connect(&path).unwrap();
        let t = std::time::Instant::now();
        let mut sent = 0;
        while sent < 16 && s.write_all(&[0u8]).is_ok() {
            sent += 1;
            std::thread::sleep(Duration::from_millis(150));
        }
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        assert_eq!(s.read(&mut [0u8; 16]).unwrap_or(0), 0, "closed unanswered");
        assert!(
            t.elapsed() < Duration::from_millis(2000),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(
            seen.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "never decided"
        );
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn a_peer_that_is_not_admitted_is_closed_before_its_request_is_read() {
        let (path, seen) = counting_server("refused", |_| false);
        let mut s = UnixStream::connect(&path).unwrap();
        let _ = s.write_all(&[0u8; 16]);
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = [0u8; 16];
        let t = std::time::Instant::now();
        let n = s.read(&mut buf).unwrap_or(0);
        assert_eq!(n, 0, "closed, not answered");
        assert!(t.elapsed() < Duration::from_secs(1));
        assert_eq!(
            seen.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "never decided"
        );
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn processes_of_another_pid_namespace_are_closed_unread_both_ways() {
        use std::io::BufRead;
        let (path, seen) = counting_server("ns", |_| true);
        // A process of this namespace is answered (the helper works).
        let Some(same) = helper("poke_helper", false, ("EXPSEG_TEST_POKE", &path)) else {
            return;
        };
        let out = String::from_utf8(same.wait_with_output().unwrap().stdout).unwrap();
        assert_eq!(
            helper_said(&out, "poke_read").as_deref(),
            Some("16"),
            "{out}"
        );
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 1);
        // The same program in a pid namespace inside this one (same uid): closed unread.
        let Some(inner) = helper("poke_helper", true, ("EXPSEG_TEST_POKE", &path)) else {
            return;
        };
        let out = inner.wait_with_output().unwrap();
        let out = String::from_utf8(out.stdout).unwrap();
        let Some(n) = helper_said(&out, "poke_read") else {
            eprintln!("skipped: unshare --pid --fork --mount-proc is not allowed here");
            return;
        };
        assert_eq!(n, "0", "closed, not answered");
        assert_eq!(
            seen.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "never decided"
        );
        // A server in the inner namespace: this process has no pid there (0), and is closed.
        let inner_path = path.with_file_name("inner.sock");
        let mut server = helper("serve_helper", true, ("EXPSEG_TEST_SERVE", &inner_path)).unwrap();
        let mut lines = std::io::BufReader::new(server.stdout.take().unwrap()).lines();
        let first = lines.find_map(|l| l.ok().and_then(|l| helper_said(&l, "serving")));
        assert_eq!(first.as_deref(), Some("true"));
        let mut s = UnixStream::connect(&inner_path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let _ = s.write_all(&[1u8; 16]);
        let mut head = [0u8; 16];
        assert_eq!(s.read(&mut head).unwrap_or(0), 0, "closed, not answered");
        let _ = server.kill();
        let _ = server.wait();
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }
}
