//! The producer's record of the descriptors its PyTorch exported (each page's, by number),
//! and its answer to a consumer asking for one.

use crate::ipc::transport::{self, Decision};
use crate::ipc::{Grant, Refusal};
use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

/// The ticket id that means "a descriptor PyTorch exported" (ticket ids count up from 1).
pub const GETFD_ID: u32 = u32::MAX;

/// Descriptors remembered at most; older numbers are checked again before they are served.
pub(super) const KEPT_MAX: usize = 1 << 16;

/// Device and inode of an open file.
type FileId = (u64, u64);

/// Exported descriptor number -> (page handle, the file it named then).
pub(super) static EXPORTED: Mutex<Option<HashMap<i32, (u64, FileId)>>> = Mutex::new(None);

/// Device and inode of the open file `fd` names, if it is open.
pub(super) fn identity(fd: i32) -> Option<FileId> {
    if fd < 0 {
        return None;
    }
    let path = format!("/proc/self/fd/{fd}");
    // fstat through /proc follows to the open file itself (an anonymous inode included).
    let md = std::fs::metadata(path).ok()?;
    Some((md.dev(), md.ino()))
}

/// PyTorch releases page `handle`: its descriptors are closed with it and never served again.
pub fn released(handle: u64) {
    let mut g = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(map) = g.as_mut() {
        map.retain(|_, (h, _)| *h != handle);
    }
}

/// The producer's answer to a request for descriptor `fd` (on a socket thread; the peer is a
/// process of this pid namespace and of this process's own user: `ipc::transport` and
/// `tickets::may`).
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
