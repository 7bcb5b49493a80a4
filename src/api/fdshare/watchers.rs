//! The consumers that keep PyTorch's mappings of this process's pages (`api::imports`) and
//! asked to be told when one of this process's exported descriptor numbers stops naming its
//! page (`ipc::closed`), and the telling.

use crate::api::state::config;
use crate::ipc::closed;
use crate::ipc::sockdir;
use crate::ipc::transport::AskError;
use crate::ipc::Refusal;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// A watcher: its pid, and the descriptor numbers it could not be told of (its answer did not
/// come in time: stopped, or busy past the bound). It may still hold a page by such a number:
/// the number is never handed to PyTorch for another page while it is unsure
/// ([`must_renumber`]).
struct Watcher {
    pid: u32,
    unsure: HashSet<i32>,
}

static WATCHERS: Mutex<Vec<Watcher>> = Mutex::new(Vec::new());
static ANY_WATCHER: AtomicBool = AtomicBool::new(false);

fn watchers() -> std::sync::MutexGuard<'static, Vec<Watcher>> {
    WATCHERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Consumer `pid` (of this process's own user: `tickets::may`) asks to be told: yes where this
/// process records its exported descriptors (the numbers it will tell of).
pub fn watch(pid: u32) -> Result<(), Refusal> {
    if !config().pidfd_rescue || !config().sockets {
        return Err(Refusal::Unknown);
    }
    let mut w = watchers();
    if !w.iter().any(|x| x.pid == pid) {
        w.push(Watcher {
            pid,
            unsure: HashSet::new(),
        });
    }
    ANY_WATCHER.store(true, Ordering::Release);
    Ok(())
}

/// Tell every watcher that descriptor numbers `fds` no longer name the pages they named, and
/// wait for their answers (each bounded: `closed::TIMEOUT`); a watcher gone is forgotten, one
/// that did not answer keeps the number unsure. The numbers some watcher is unsure of now.
pub(super) fn tell(fds: &[i32]) -> Vec<i32> {
    if fds.is_empty() || !ANY_WATCHER.load(Ordering::Acquire) {
        return Vec::new();
    }
    let pids: Vec<u32> = watchers().iter().map(|w| w.pid).collect();
    let uid = sockdir::current_uid();
    let (mut gone, mut told, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    for pid in pids {
        for fd in fds {
            match closed::tell_fd(uid, pid, *fd) {
                Ok(_) => told.push((pid, *fd)),
                Err(AskError::Unreachable(e))
                    if e.kind() == std::io::ErrorKind::NotFound
                        || e.kind() == std::io::ErrorKind::ConnectionRefused =>
                {
                    gone.push(pid); // exited: its socket with it
                    break;
                }
                Err(e) => {
                    log::warn!("IPC: process {pid} did not answer that this process's descriptor {fd} no longer names the page it named ({e:?}); it may keep that page mapped until it answers or exits, and the number is not given to another page meanwhile");
                    failed.push((pid, *fd));
                }
            }
        }
    }
    let mut w = watchers();
    w.retain(|x| !gone.contains(&x.pid));
    for x in w.iter_mut() {
        for (p, fd) in &told {
            if *p == x.pid {
                x.unsure.remove(fd);
            }
        }
        for (p, fd) in &failed {
            if *p == x.pid {
                x.unsure.insert(*fd);
            }
        }
    }
    let mut unsure: Vec<i32> = fds
        .iter()
        .copied()
        .filter(|fd| w.iter().any(|x| x.unsure.contains(fd)))
        .collect();
    unsure.dedup();
    unsure
}

/// Whether number `fd` may not name a new page: a watcher may hold another page by it.
pub(super) fn must_renumber(fd: i32) -> bool {
    ANY_WATCHER.load(Ordering::Acquire) && watchers().iter().any(|x| x.unsure.contains(&fd))
}
