//! `torch.multiprocessing` of expandable-segment memory without ptrace rights.
//!
//! PyTorch shares a page by sending the consumer its own process id and the number of the
//! descriptor `cuMemExportToShareableHandle` gave it; the consumer takes a copy of that
//! descriptor with `pidfd_getfd`, which the kernel allows only to processes that may ptrace
//! the producer (denied in containers without `CAP_SYS_PTRACE`, under Yama `ptrace_scope` ≥ 2,
//! and against non-dumpable producers). When both processes run expseg, a denied
//! `pidfd_getfd` is answered by the producer over its ticket socket instead:
//!
//! - the producer serves only descriptors its PyTorch exported through expseg's
//!   `cuMemExportToShareableHandle`, only until PyTorch releases that page (`cuMemRelease`,
//!   beside which it closes the descriptor), and only while the number still names a file with
//!   the same device and inode, so no other descriptor of the process can be had this way;
//! - the consumer asks only after the kernel said no (`EPERM`), connects only to the socket of
//!   its own user (directory owner and mode checked), and accepts only an answer from the very
//!   process it asked about (`SO_PEERCRED`: uid and pid);
//! - the request reuses the ticket protocol: id [`GETFD_ID`], the descriptor number in place
//!   of the nonce; the grant carries one descriptor.

use crate::ipc::transport::{self, AskError, Decision};
use crate::ipc::{Grant, Refusal};
use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

/// The ticket id that means "a descriptor PyTorch exported" (ticket ids count up from 1).
pub const GETFD_ID: u32 = u32::MAX;

/// Descriptors remembered at most; older numbers are checked again before they are served.
const KEPT_MAX: usize = 1 << 16;

/// Device and inode of an open file.
type FileId = (u64, u64);

/// Exported descriptor number -> (page handle, the file it named then).
static EXPORTED: Mutex<Option<HashMap<i32, (u64, FileId)>>> = Mutex::new(None);

/// Device and inode of the open file `fd` names, if it is open.
fn identity(fd: i32) -> Option<FileId> {
    if fd < 0 {
        return None;
    }
    let path = format!("/proc/self/fd/{fd}");
    // fstat through /proc follows to the open file itself (an anonymous inode included).
    let md = std::fs::metadata(path).ok()?;
    Some((md.dev(), md.ino()))
}

/// PyTorch's `cuMemExportToShareableHandle` of page `handle` gave it descriptor `fd`:
/// remember it, and make sure the socket serves.
pub fn exported(fd: i32, handle: u64) {
    let Some(id) = identity(fd) else { return };
    {
        let mut g = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
        let map = g.get_or_insert_with(HashMap::new);
        if map.len() >= KEPT_MAX {
            map.retain(|f, (_, i)| identity(*f) == Some(*i));
        }
        if map.len() < KEPT_MAX {
            map.insert(fd, (handle, id));
        }
    }
    super::ipc::ensure_server();
}

/// PyTorch releases page `handle`: its descriptors are closed with it and never served again.
pub fn released(handle: u64) {
    let mut g = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(map) = g.as_mut() {
        map.retain(|_, (h, _)| *h != handle);
    }
}

/// The producer's answer to a request for descriptor `fd` (on a socket thread; the peer's uid
/// was admitted).
pub fn serve(fd: u64) -> Decision {
    let Ok(fd) = i32::try_from(fd) else {
        return Err(Refusal::Unknown);
    };
    let known = EXPORTED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&fd).map(|(_, id)| *id));
    match known {
        Some(id) if identity(fd) == Some(id) => {}
        Some(_) => return Err(Refusal::Stale),
        None => return Err(Refusal::Unknown),
    }
    // The number may be closed and reused between the check and the copy: check the copy.
    let copy = dup(fd).ok_or(Refusal::Failed)?;
    if identity_of(&copy) != Some(known.expect("checked")) {
        return Err(Refusal::Stale);
    }
    const PAGE: u64 = 2 << 20;
    Ok((
        Grant {
            size: PAGE,
            chunks: vec![PAGE],
        },
        transport::fds_of(vec![copy]),
    ))
}

fn identity_of(f: &OwnedFd) -> Option<FileId> {
    use std::os::fd::AsRawFd;
    identity(f.as_raw_fd())
}

#[allow(unsafe_code)]
fn dup(fd: i32) -> Option<OwnedFd> {
    // SAFETY: `fd` is a number; borrowing it only to duplicate it with F_DUPFD_CLOEXEC, which
    // fails cleanly (EBADF) if it was closed meanwhile.
    let b = unsafe { BorrowedFd::borrow_raw(fd) };
    b.try_clone_to_owned().ok()
}

/// The consumer's side: the kernel refused `pidfd_getfd` for descriptor `fd` of the process
/// behind `pidfd`; ask that process's expseg for it. `None`: no answer (the caller keeps the
/// kernel's refusal).
pub fn ask(pidfd: i32, fd: i32) -> Option<OwnedFd> {
    let pid = pid_of_pidfd(pidfd)?;
    let uid = transport::current_uid();
    let path = transport::socket_path(uid, pid);
    if std::fs::symlink_metadata(&path).is_err() {
        return None; // the producer does not run expseg (or shared nothing through it)
    }
    match transport::ask(&path, uid, pid, GETFD_ID, fd as u64) {
        Ok((grant, mut incoming)) if grant.chunks.len() == 1 => match incoming.next_batch() {
            Ok(mut fds) if fds.len() == 1 => {
                log::debug!("pidfd_getfd of descriptor {fd} of process {pid} was denied; its expseg served it");
                fds.pop()
            }
            _ => None,
        },
        Ok(_) => None,
        Err(e) => {
            let why = match e {
                AskError::Unreachable(e) => format!("unreachable ({e})"),
                AskError::Refused(r) => format!("refused ({r:?})"),
                AskError::Protocol(p) => p.to_string(),
                AskError::Untrusted(u) => u,
            };
            log::warn!("pidfd_getfd of descriptor {fd} of process {pid} was denied, and asking its expseg failed: {why}");
            None
        }
    }
}

/// The process a pidfd refers to, from `/proc/self/fdinfo`.
fn pid_of_pidfd(pidfd: i32) -> Option<u32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{pidfd}")).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|p| p.trim().parse::<i64>().ok())
        .filter(|p| *p > 0)
        .map(|p| p as u32)
}
