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

pub mod record;
pub mod watchers;

use super::state::config;
use crate::ipc::sockdir;
use crate::ipc::transport::{self, AskError};
use record::{identity, Exports, ANY_EXPORTED, EXPORTED, GETFD_ID, KEPT_MAX};
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;

/// PyTorch releases page `handle`: its descriptors are closed with it, never served again, and
/// watchers are told (they unmap what they kept of it).
pub fn released(handle: u64) {
    let fds = record::forget(handle);
    watchers::tell(&fds);
}

/// PyTorch's `cuMemExportToShareableHandle` of page `handle` gave it descriptor `fd`:
/// remember it, and make sure the socket serves (nothing with `EXPSEG_PIDFD_RESCUE=0`).
/// Watchers hear first that the number now names this page (before PyTorch can send it).
/// Answers the number PyTorch is to get: `fd`, or where a watcher that did not answer may
/// hold another page by that number, the same descriptor under another number.
pub fn exported(fd: i32, handle: u64) -> i32 {
    if !config().pidfd_rescue || !config().sockets {
        return fd;
    }
    let fd = match watchers::tell(&[fd]).is_empty() {
        true => fd,
        false => record::renumber(fd, watchers::must_renumber).unwrap_or(fd),
    };
    exported_as(fd, handle);
    fd
}

fn exported_as(fd: i32, handle: u64) {
    let Some(id) = identity(fd) else { return };
    {
        let mut g = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
        let map = g.get_or_insert_with(Exports::default);
        if map.len() >= KEPT_MAX {
            map.retain(|f, i| identity(f) == Some(i));
        }
        if map.len() < KEPT_MAX {
            map.insert(fd, handle, id);
            ANY_EXPORTED.store(true, Ordering::Release);
        }
    }
    super::ipc::tickets::ensure_server();
}

/// The consumer's side: the kernel refused `pidfd_getfd` for descriptor `fd` of the process
/// behind `pidfd`; ask that process's expseg for it. `None`: no answer (the caller keeps the
/// kernel's refusal). With `EXPSEG_PIDFD_RESCUE=0` nothing is asked (no socket is made: a
/// seccomp filter may kill on `socket()`).
pub fn ask(pidfd: i32, fd: i32) -> Option<OwnedFd> {
    if !config().pidfd_rescue || !config().sockets {
        return None;
    }
    let pid = crate::ipc::watch::pid_of_pidfd(pidfd)?;
    let uid = sockdir::current_uid();
    let path = match sockdir::socket_path(uid, pid) {
        Ok(path) => path,
        Err(why) => {
            log::warn!("pidfd_getfd of descriptor {fd} of process {pid} was denied, and its expseg cannot be asked: {why}");
            return None;
        }
    };
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
                AskError::Refused(r, _) => format!("refused ({r:?})"),
                AskError::Protocol(p) => p.to_string(),
                AskError::Untrusted(u) => u,
            };
            log::warn!("pidfd_getfd of descriptor {fd} of process {pid} was denied, and asking its expseg failed: {why}");
            None
        }
    }
}
