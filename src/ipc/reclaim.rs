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
//! A peer that does not answer within the bound is skipped.

use super::sockdir;
use super::transport::{self, AskError};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The request id of a reclaim (ticket ids stay below it; `u32::MAX` is `pidfd_getfd`'s).
pub const RECLAIM_ID: u32 = u32::MAX - 1;

/// How long one peer may take to connect, give back and answer.
pub const PEER_TIMEOUT: Duration = Duration::from_millis(500);

/// The key of a GPU in requests: its 16-byte UUID folded to 64 bits.
pub fn gpu_key(uuid: &[u8; 16]) -> u64 {
    let lo = u64::from_le_bytes(uuid[0..8].try_into().unwrap());
    let hi = u64::from_le_bytes(uuid[8..16].try_into().unwrap());
    lo ^ hi.rotate_left(17)
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
            let pid = name
                .to_str()
                .and_then(|n| n.strip_suffix(".sock"))
                .and_then(|p| p.parse::<u32>().ok());
            match pid {
                Some(pid) if pid != me && !out.iter().any(|(p, _)| *p == pid) => {
                    out.push((pid, e.path()))
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

/// Ask every other expseg process of `uid` at once (one thread each, each bounded by
/// `timeout`): their answers, in pid order.
pub fn ask_peers(uid: u32, me: u32, key: u64, timeout: Duration) -> Vec<Answer> {
    ask_all(peer_sockets(uid, me), uid, key, timeout)
}

fn ask_all(peers: Vec<(u32, PathBuf)>, uid: u32, key: u64, timeout: Duration) -> Vec<Answer> {
    std::thread::scope(|scope| {
        let asks: Vec<_> = peers
            .into_iter()
            .map(|(pid, path)| {
                (
                    pid,
                    scope.spawn(move || ask_at(&path, uid, pid, key, timeout)),
                )
            })
            .collect();
        asks.into_iter()
            .map(|(pid, h)| Answer {
                pid,
                result: h
                    .join()
                    .unwrap_or(Err(AskError::Protocol("the asking thread panicked"))),
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::sockdir::current_uid;
    use crate::ipc::transport::{serve, FdSource};
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
                Ok((
                    Grant {
                        size,
                        chunks: vec![],
                    },
                    none,
                ))
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
        // A process's own socket is never asked.
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
        let mut a = [0u8; 16];
        a[15] = 1;
        assert_ne!(gpu_key(&a), gpu_key(&[0; 16]));
    }
}
