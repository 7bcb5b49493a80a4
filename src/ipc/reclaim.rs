//! Reclaim between expseg processes: when an allocation finds no memory, the other expseg
//! processes of the same user are asked, each within a bounded time, to give back what they
//! hold beyond their program's live memory on that GPU (kept handles, cached blocks).
//!
//! The request rides on the ticket protocol (`transport`): id [`RECLAIM_ID`], the GPU's key
//! (from its UUID, so the same GPU under any `CUDA_VISIBLE_DEVICES`) as the nonce. The answer
//! is a grant header with no chunks whose size is the bytes given back. The same checks as for
//! tickets hold both ways: the asker only talks to a socket in its own private directory
//! served by the process its name says, of its own uid; the server serves it only to its own
//! uid (not to `EXPSEG_IPC_ALLOW_UIDS`, which may map shared memory, not trim this process).
//! A peer that does not answer within the bound is skipped; at most [`ASKERS`] are asked at
//! once, and none after four bounds have gone by; a socket nobody listens on any more (its
//! process was killed) is removed.

use super::server;
use super::sockdir;
use super::transport::{self, AskError};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The request id of a reclaim (ticket ids stay below it; `u32::MAX` is `pidfd_getfd`'s).
pub const RECLAIM_ID: u32 = u32::MAX - 1;

/// How long one peer may take to connect, give back and answer.
pub const PEER_TIMEOUT: Duration = Duration::from_millis(500);

/// Most peers asked at once (the asking thread and up to three more).
pub const ASKERS: usize = 4;

/// The key that asks for every GPU: an allocation whose device is not known (a context of
/// the program's own) asks each peer once for all, rather than once per GPU.
pub const EVERY_GPU: u64 = u64::MAX;

/// The key of a GPU in requests: its 16-byte UUID folded to 64 bits (never [`EVERY_GPU`]).
pub fn gpu_key(uuid: &[u8; 16]) -> u64 {
    let lo = u64::from_le_bytes(uuid[0..8].try_into().unwrap());
    let hi = u64::from_le_bytes(uuid[8..16].try_into().unwrap());
    match lo ^ hi.rotate_left(17) {
        EVERY_GPU => EVERY_GPU - 1,
        k => k,
    }
}

/// The pids of the other processes of `uid` that serve an expseg socket (a socket of a dead
/// process is listed too; asking it fails at once), in every socket directory of the user's
/// (`sockdir::socket_dirs`).
pub fn peers(uid: u32, me: u32) -> Vec<u32> {
    peer_sockets(uid, me)
        .into_iter()
        .map(|(pid, _)| pid)
        .collect()
}

fn peer_sockets(uid: u32, me: u32) -> Vec<(u32, PathBuf)> {
    sockets_in(&sockdir::socket_dirs(uid), uid, me)
}

/// The sockets in `dirs` but `me`'s, by pid (one per pid: the first directory's, as a
/// consumer looks), skipping directories that are not private to `uid`.
fn sockets_in(dirs: &[PathBuf], uid: u32, me: u32) -> Vec<(u32, PathBuf)> {
    let mut out: Vec<(u32, PathBuf)> = Vec::new();
    for dir in dirs {
        if sockdir::dir_trusted(dir, uid).is_err() {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            // Any of a producer's names ([`sockdir::socket_names`]) stands for it; it is asked
            // at its usual name, and the asker tries the others (`transport`).
            let pid = name.to_str().and_then(sockdir::pid_of_name);
            match pid {
                Some(pid) if pid != me && !out.iter().any(|(p, _)| *p == pid) => {
                    out.push((pid, dir.join(format!("{pid}.sock"))))
                }
                _ => {}
            }
        }
    }
    out.sort_unstable();
    out
}

/// Ask process `pid` of `uid` to give back what it holds beyond live memory on the GPU of
/// `key`: the bytes it gave back.
pub fn ask_one(uid: u32, pid: u32, key: u64, timeout: Duration) -> Result<u64, AskError> {
    let path = sockdir::socket_path(uid, pid).map_err(AskError::Untrusted)?;
    ask_at(&path, uid, pid, key, timeout)
}

fn ask_at(path: &Path, uid: u32, pid: u32, key: u64, timeout: Duration) -> Result<u64, AskError> {
    transport::ask_plain(path, uid, pid, RECLAIM_ID, key, timeout)
}

/// What one peer answered.
#[derive(Debug)]
pub struct Answer {
    pub pid: u32,
    pub result: Result<u64, AskError>,
}

/// Ask every other expseg process of `uid`, each bounded by `timeout`, [`ASKERS`] at once
/// (fewer where threads cannot be started: the calling thread asks in any case), none after
/// four times `timeout`: their answers, in pid order.
pub fn ask_peers(uid: u32, me: u32, key: u64, timeout: Duration) -> Vec<Answer> {
    ask_all(peer_sockets(uid, me), uid, key, timeout)
}

fn ask_all(peers: Vec<(u32, PathBuf)>, uid: u32, key: u64, timeout: Duration) -> Vec<Answer> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let started = std::time::Instant::now();
    let next = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<Result<u64, AskError>>>> =
        peers.iter().map(|_| Mutex::new(None)).collect();
    // Each asker takes the next peer until none is left.
    let asker = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some((pid, path)) = peers.get(i) else {
            break;
        };
        let result = if started.elapsed() >= 4 * timeout {
            Err(AskError::Unreachable(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "not asked: the other peers took the time",
            )))
        } else {
            std::panic::catch_unwind(|| ask_peer(path, uid, *pid, key, timeout))
                .unwrap_or(Err(AskError::Protocol("asking it panicked")))
        };
        *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
    };
    std::thread::scope(|scope| {
        for _ in 1..ASKERS.min(peers.len()) {
            if start_asker(scope, &asker).is_err() {
                break; // out of threads: fewer askers
            }
        }
        asker();
    });
    peers
        .iter()
        .zip(results)
        .map(|((pid, _), r)| Answer {
            pid: *pid,
            result: r
                .into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or(Err(AskError::Protocol("not asked"))),
        })
        .collect()
}

/// Start one more asker on `scope` (`Err` where no thread can be made).
fn start_asker<'scope, 'env, F>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    asker: &'env F,
) -> std::io::Result<()>
where
    F: Fn() + Sync,
{
    #[cfg(test)]
    if NO_THREADS.with(|n| n.get()) {
        return Err(std::io::Error::other("no threads (test)"));
    }
    std::thread::Builder::new()
        .name("expseg-reclaim".into())
        .spawn_scoped(scope, asker)
        .map(drop)
}

/// Ask the peer at `path`; a socket nobody listens on any more (its process was killed) is
/// removed, so that it is not asked again.
fn ask_peer(path: &Path, uid: u32, pid: u32, key: u64, timeout: Duration) -> Result<u64, AskError> {
    let r = ask_at(path, uid, pid, key, timeout);
    if let Err(AskError::Unreachable(e)) = &r {
        if e.kind() == std::io::ErrorKind::ConnectionRefused {
            let _ = server::clear_stale(path);
        }
    }
    r
}

#[cfg(test)]
thread_local! {
    /// Makes starting an asker fail on this thread, as when the process is out of threads.
    static NO_THREADS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::server::serve;
    use crate::ipc::sockdir::current_uid;
    use crate::ipc::transport::FdSource;
    use crate::ipc::{Grant, Refusal};
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::UnixListener;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// A private socket directory of this test's own (no environment variable: other tests
    /// of the process set `EXPSEG_IPC_DIR`).
    fn private_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("expseg-reclaim-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        dir
    }

    fn pids(sockets: &[(u32, PathBuf)]) -> Vec<u32> {
        sockets.iter().map(|(p, _)| *p).collect()
    }

    fn sock(dir: &Path, pid: u32) -> PathBuf {
        dir.join(format!("{pid}.sock"))
    }

    /// A peer answering reclaims the way api's server does: `freed` bytes for `key`, 0 for
    /// other GPUs. Returns how many requests it saw.
    fn holding_peer(path: &Path, key: u64, freed: u64) -> Arc<AtomicU64> {
        let seen = Arc::new(AtomicU64::new(0));
        let s = seen.clone();
        serve(
            path,
            false,
            |u| u == current_uid(),
            move |id, nonce, _| {
                s.fetch_add(1, Ordering::SeqCst);
                if id != RECLAIM_ID {
                    return Err(Refusal::Unknown.into());
                }
                let none: FdSource = Box::new(|| Err(std::io::Error::other("no chunks")));
                let size = if nonce == key { freed } else { 0 };
                Ok((Grant::new(size, vec![]), none))
            },
        )
        .unwrap();
        seen
    }

    #[test]
    fn a_holding_peer_gives_back_a_silent_one_is_skipped_in_bounded_time() {
        let dir = private_dir("peers");
        let uid = current_uid();
        let me = std::process::id();
        // This process serves as pid `me`, a holding peer; a stale socket of a dead process
        // stands at pid me+1.
        let key = gpu_key(&[7; 16]);
        let seen = holding_peer(&sock(&dir, me), key, 3 << 30);
        drop(UnixListener::bind(sock(&dir, me + 1)).unwrap());
        assert_eq!(
            ask_at(&sock(&dir, me), uid, me, key, PEER_TIMEOUT).unwrap(),
            3 << 30
        );
        let other_gpu = gpu_key(&[8; 16]);
        assert_eq!(
            ask_at(&sock(&dir, me), uid, me, other_gpu, PEER_TIMEOUT).unwrap(),
            0
        );
        assert_eq!(seen.load(Ordering::SeqCst), 2);
        // Asked as another process would (`me` = 1): the holder gives, the dead one fails.
        assert_eq!(
            pids(&sockets_in(std::slice::from_ref(&dir), uid, 1)),
            vec![me, me + 1]
        );
        let answers = ask_all(
            sockets_in(std::slice::from_ref(&dir), uid, 1),
            uid,
            key,
            PEER_TIMEOUT,
        );
        assert_eq!(
            answers[0].result.as_ref().ok(),
            Some(&(3 << 30)),
            "{answers:?}"
        );
        assert!(matches!(answers[1].result, Err(AskError::Unreachable(_))));
        // The dead one's socket refused the connection: it is gone, the live one stays.
        assert!(
            !sock(&dir, me + 1).exists(),
            "a killed process's socket is removed"
        );
        assert!(sock(&dir, me).exists());
        // A process's own socket is never asked.
        drop(UnixListener::bind(sock(&dir, me + 1)).unwrap());
        assert_eq!(
            pids(&sockets_in(std::slice::from_ref(&dir), uid, me)),
            vec![me + 1]
        );
        // A socket whose name says another pid than the process serving it: untrusted,
        // nothing sent.
        std::fs::rename(sock(&dir, me), sock(&dir, me + 3)).unwrap();
        assert!(matches!(
            ask_at(&sock(&dir, me + 3), uid, me + 3, key, PEER_TIMEOUT),
            Err(AskError::Untrusted(_))
        ));
        assert_eq!(seen.load(Ordering::SeqCst), 3);
        // A directory others can write: no peers at all.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(sockets_in(std::slice::from_ref(&dir), uid, 1).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_peer_that_never_answers_is_skipped_after_the_bound() {
        let dir = private_dir("silent");
        let uid = current_uid();
        let me = std::process::id();
        // A listener of this process that accepts nothing and answers nothing.
        let silent = UnixListener::bind(sock(&dir, me)).unwrap();
        let t = std::time::Instant::now();
        let answers = ask_all(
            sockets_in(std::slice::from_ref(&dir), uid, 1),
            uid,
            1,
            Duration::from_millis(200),
        );
        let took = t.elapsed();
        assert_eq!(answers.len(), 1);
        assert!(
            matches!(answers[0].result, Err(AskError::Unreachable(_))),
            "{answers:?}"
        );
        assert!(
            took >= Duration::from_millis(150) && took < Duration::from_secs(2),
            "{took:?}"
        );
        drop(silent);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn at_most_four_peers_are_asked_at_once_and_none_after_four_bounds() {
        let dir = private_dir("bounded");
        let uid = current_uid();
        let me = std::process::id();
        // Silent peers: listeners of this process (so the pid check passes) that accept
        // nothing; each ask waits out its bound.
        let silent = |n: usize| -> (Vec<UnixListener>, Vec<(u32, PathBuf)>) {
            (0..n)
                .map(|i| {
                    let path = dir.join(format!("silent-{n}-{i}.sock"));
                    (UnixListener::bind(&path).unwrap(), (me, path))
                })
                .unzip()
        };
        // 10 peers, 200 ms each, 4 at a time: three rounds, not one.
        let (_held, peers) = silent(10);
        let t = std::time::Instant::now();
        let answers = ask_all(peers, uid, 1, Duration::from_millis(200));
        let took = t.elapsed();
        assert_eq!(answers.len(), 10);
        assert!(answers.iter().all(|a| a.result.is_err()));
        assert!(
            took >= Duration::from_millis(550) && took < Duration::from_secs(3),
            "{took:?}"
        );
        // 40 peers, 100 ms each: none asked after 400 ms, the rest skipped.
        let (_held, peers) = silent(40);
        let t = std::time::Instant::now();
        let answers = ask_all(peers, uid, 1, Duration::from_millis(100));
        let took = t.elapsed();
        let skipped = answers
            .iter()
            .filter(|a| matches!(&a.result, Err(AskError::Unreachable(e)) if e.to_string().contains("not asked")))
            .count();
        assert!((12..=36).contains(&skipped), "{skipped} skipped");
        assert!(took < Duration::from_secs(2), "{took:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn without_threads_to_spare_the_calling_thread_asks_alone() {
        let dir = private_dir("nothreads");
        let uid = current_uid();
        let me = std::process::id();
        let key = gpu_key(&[9; 16]);
        let _seen = holding_peer(&sock(&dir, me), key, 5 << 20);
        drop(UnixListener::bind(sock(&dir, me + 1)).unwrap());
        let peers = vec![
            (me, sock(&dir, me)),
            (me + 1, sock(&dir, me + 1)),
            (me, sock(&dir, me)),
        ];
        NO_THREADS.with(|n| n.set(true));
        let answers = ask_all(peers, uid, key, PEER_TIMEOUT);
        NO_THREADS.with(|n| n.set(false));
        assert_eq!(answers[0].result.as_ref().ok(), Some(&(5 << 20)));
        assert!(answers[1].result.is_err());
        assert_eq!(answers[2].result.as_ref().ok(), Some(&(5 << 20)));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_peer_of_another_uid_is_never_asked_and_refuses_to_give() {
        let dir = private_dir("uid");
        let uid = current_uid();
        let me = std::process::id();
        let seen = Arc::new(AtomicU64::new(0));
        let s = seen.clone();
        // A server that admits no one (as a process of another user admits us).
        serve(
            &sock(&dir, me),
            false,
            |_| false,
            move |_, _, _| {
                s.fetch_add(1, Ordering::SeqCst);
                Err(Refusal::Unknown.into())
            },
        )
        .unwrap();
        assert!(ask_at(&sock(&dir, me), uid, me, 1, PEER_TIMEOUT).is_err());
        assert_eq!(
            seen.load(Ordering::SeqCst),
            0,
            "refused before the request was read"
        );
        // As the asker: a socket served by a process of another uid than the one asked
        // for is never written to.
        assert!(matches!(
            ask_at(&sock(&dir, me), uid + 1, me, 1, PEER_TIMEOUT),
            Err(AskError::Untrusted(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn gpu_keys_differ_by_uuid() {
        assert_ne!(gpu_key(&[1; 16]), gpu_key(&[2; 16]));
        // No GPU's key asks for every GPU.
        let mut all_ones = [0xff; 16];
        all_ones[8..].fill(0);
        assert_eq!(
            u64::from_le_bytes(all_ones[..8].try_into().unwrap()),
            EVERY_GPU
        );
        assert_ne!(gpu_key(&all_ones), EVERY_GPU);
        let mut a = [0u8; 16];
        a[15] = 1;
        assert_ne!(gpu_key(&a), gpu_key(&[0; 16]));
    }
}
