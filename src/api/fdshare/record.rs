//! The producer's record of the descriptors its PyTorch exported (each page's, by number),
//! and its answer to a consumer asking for one.

use crate::ipc::transport::{self, Decision};
use crate::ipc::{Grant, Refusal};
use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// The ticket id that means "a descriptor PyTorch exported" (ticket ids count up from 1).
pub const GETFD_ID: u32 = u32::MAX;

/// Descriptors remembered at most; older numbers are checked again before they are served.
pub(super) const KEPT_MAX: usize = 1 << 16;

/// Device and inode of an open file.
type FileId = (u64, u64);

/// The descriptors exported so far, and whether there ever was one (every `cuMemRelease`
/// asks; a process that never shared a page does not take the lock for it).
pub(super) static EXPORTED: Mutex<Option<Exports>> = Mutex::new(None);
pub(super) static ANY_EXPORTED: AtomicBool = AtomicBool::new(false);

/// Exported descriptor number -> (page handle, the file it named then), and each page's
/// numbers, so a release forgets its page's in the time of one lookup (a scan of every
/// descriptor took each of PyTorch's releases through all the shared pages' entries).
#[derive(Default, Debug)]
pub(super) struct Exports {
    by_fd: HashMap<i32, (u64, FileId)>,
    by_handle: HashMap<u64, Vec<i32>>,
}

impl Exports {
    pub(super) fn len(&self) -> usize {
        self.by_fd.len()
    }

    /// Descriptor `fd` names page `handle`'s file `id` (a number PyTorch closed and reused
    /// names the new page's).
    pub(super) fn insert(&mut self, fd: i32, handle: u64, id: FileId) {
        if let Some((old, _)) = self.by_fd.insert(fd, (handle, id)) {
            if old == handle {
                return;
            }
            self.unlink(old, fd);
        }
        self.by_handle.entry(handle).or_default().push(fd);
    }

    /// The file descriptor `fd` named when it was exported.
    pub(super) fn get(&self, fd: i32) -> Option<FileId> {
        self.by_fd.get(&fd).map(|(_, id)| *id)
    }

    /// Page `handle` is released: its descriptors are served no more (returned).
    pub(super) fn release(&mut self, handle: u64) -> Vec<i32> {
        let fds = self.by_handle.remove(&handle).unwrap_or_default();
        for fd in &fds {
            self.by_fd.remove(fd);
        }
        fds
    }

    /// Keep only the descriptors `open` still finds naming their file.
    pub(super) fn retain(&mut self, open: impl Fn(i32, FileId) -> bool) {
        self.by_fd.retain(|fd, (_, id)| open(*fd, *id));
        self.by_handle.clear();
        for (fd, (h, _)) in &self.by_fd {
            self.by_handle.entry(*h).or_default().push(*fd);
        }
    }

    fn unlink(&mut self, handle: u64, fd: i32) {
        if let Some(fds) = self.by_handle.get_mut(&handle) {
            fds.retain(|f| *f != fd);
            if fds.is_empty() {
                self.by_handle.remove(&handle);
            }
        }
    }
}

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

/// PyTorch releases page `handle`: its descriptors are closed with it and never served again;
/// their numbers are returned.
pub(super) fn forget(handle: u64) -> Vec<i32> {
    if !ANY_EXPORTED.load(Ordering::Acquire) {
        return Vec::new();
    }
    let mut g = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
    g.as_mut().map(|m| m.release(handle)).unwrap_or_default()
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
        .and_then(|m| m.get(fd));
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
    Ok((Grant::new(PAGE, vec![PAGE]), transport::fds_of(vec![copy])))
}

fn identity_of(f: &OwnedFd) -> Option<FileId> {
    use std::os::fd::AsRawFd;
    identity(f.as_raw_fd())
}

/// Descriptor `fd` moved to the lowest free number that `avoid` does not refuse (the numbers
/// tried on the way are closed again), `fd` closed: the new number. `None` (and `fd` kept)
/// where no such number turned up within 64 tries.
#[allow(unsafe_code)]
pub(super) fn renumber(fd: i32, avoid: impl Fn(i32) -> bool) -> Option<i32> {
    let mut tried = Vec::new();
    let mut found = None;
    for _ in 0..64 {
        // SAFETY: F_DUPFD on a number this process holds: a new descriptor or -1.
        let d = unsafe { libc::fcntl(fd, libc::F_DUPFD, 0) };
        if d < 0 {
            break;
        }
        if avoid(d) {
            tried.push(d);
        } else {
            found = Some(d);
            break;
        }
    }
    // SAFETY: descriptors this function just made, and `fd` once it has a new number.
    unsafe {
        for d in tried {
            libc::close(d);
        }
        if found.is_some() {
            libc::close(fd);
        }
    }
    found
}

/// A copy of descriptor `fd` (close-on-exec), if it is open.
#[allow(unsafe_code)]
pub(crate) fn dup(fd: i32) -> Option<OwnedFd> {
    // SAFETY: `fd` is a number; borrowing it only to duplicate it with F_DUPFD_CLOEXEC, which
    // fails cleanly (EBADF) if it was closed meanwhile.
    let b = unsafe { BorrowedFd::borrow_raw(fd) };
    b.try_clone_to_owned().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_forgets_its_pages_descriptors_and_no_other() {
        let mut e = Exports::default();
        e.insert(10, 1, (0, 100));
        e.insert(11, 1, (0, 101));
        e.insert(12, 2, (0, 102));
        e.insert(10, 1, (0, 100)); // exported again under the same number
        assert_eq!(e.len(), 3);
        e.release(1);
        assert_eq!(
            (e.get(10), e.get(11), e.get(12)),
            (None, None, Some((0, 102)))
        );
        e.release(1);
        assert_eq!(e.len(), 1);
    }

    #[test]
    fn a_number_reused_for_another_page_belongs_to_that_page_only() {
        let mut e = Exports::default();
        e.insert(10, 1, (0, 100));
        // PyTorch closed 10 and a new export of page 2 got the number.
        e.insert(10, 2, (0, 200));
        e.release(1);
        assert_eq!(
            e.get(10),
            Some((0, 200)),
            "page 1's release leaves page 2's descriptor"
        );
        e.release(2);
        assert_eq!(e.get(10), None);
        assert!(e.by_handle.is_empty());
    }

    #[test]
    fn a_descriptor_moves_to_the_lowest_number_not_refused() {
        use std::os::fd::IntoRawFd;
        let open = || std::fs::File::open("/dev/null").unwrap().into_raw_fd();
        let fd = open();
        let refused: Vec<i32> = (0..3).map(|_| open()).collect();
        // SAFETY: numbers this test just opened.
        #[allow(unsafe_code)]
        unsafe {
            for r in &refused {
                libc::close(*r);
            }
        }
        // The three freed numbers are among the lowest free ones: refused, another taken.
        let moved = renumber(fd, |d| refused.contains(&d)).expect("a number");
        assert!(!refused.contains(&moved) && moved != fd);
        // (Other tests' threads open and close descriptors meanwhile: only the moved one is
        // this test's to look at.)
        // SAFETY: fcntl and close on the number this test owns now.
        #[allow(unsafe_code)]
        unsafe {
            assert!(libc::fcntl(moved, libc::F_GETFD) >= 0);
            libc::close(moved);
        }
    }

    #[test]
    fn keeping_the_open_ones_keeps_their_pages_index() {
        let mut e = Exports::default();
        for fd in 0..6 {
            e.insert(fd, u64::from(fd as u32 % 2), (0, fd as u64));
        }
        e.retain(|fd, _| fd >= 3);
        assert_eq!(e.len(), 3);
        e.release(1);
        assert_eq!((e.get(3), e.get(4), e.get(5)), (None, Some((0, 4)), None));
    }
}
