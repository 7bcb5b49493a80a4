//! The consumers that keep PyTorch's mappings of this process's pages (`api::imports`) and
//! asked to be told when one of this process's exported descriptor numbers stops naming its
//! page (`ipc::closed`), and the telling.

use crate::api::state::config;
use crate::ipc::closed;
use crate::ipc::sockdir;
use crate::ipc::transport::AskError;
use crate::ipc::Refusal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// The watchers, by pid.
static WATCHERS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static ANY_WATCHER: AtomicBool = AtomicBool::new(false);

/// Consumer `pid` (of this process's own user: `tickets::may`) asks to be told: yes where this
/// process records its exported descriptors (the numbers it will tell of).
pub fn watch(pid: u32) -> Result<(), Refusal> {
    if !config().pidfd_rescue || !config().sockets {
        return Err(Refusal::Unknown);
    }
    let mut w = WATCHERS.lock().unwrap_or_else(|e| e.into_inner());
    if !w.contains(&pid) {
        w.push(pid);
    }
    ANY_WATCHER.store(true, Ordering::Release);
    Ok(())
}

/// Tell every watcher that descriptor numbers `fds` no longer name the pages they named, and
/// wait for their answers (each bounded: `closed::TIMEOUT`); a watcher gone is forgotten.
pub(super) fn tell(fds: &[i32]) {
    if fds.is_empty() || !ANY_WATCHER.load(Ordering::Acquire) {
        return;
    }
    let watchers = WATCHERS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let uid = sockdir::current_uid();
    let mut gone = Vec::new();
    for pid in watchers {
        for fd in fds {
            match closed::tell_fd(uid, pid, *fd) {
                Ok(_) => {}
                Err(AskError::Unreachable(e))
                    if e.kind() == std::io::ErrorKind::NotFound
                        || e.kind() == std::io::ErrorKind::ConnectionRefused =>
                {
                    gone.push(pid); // exited: its socket with it
                    break;
                }
                Err(e) => {
                    log::warn!("IPC: process {pid} did not answer that this process's descriptor {fd} no longer names the page it named ({e:?}); it may keep that page mapped until it answers or exits");
                }
            }
        }
    }
    if !gone.is_empty() {
        let mut w = WATCHERS.lock().unwrap_or_else(|e| e.into_inner());
        w.retain(|p| !gone.contains(p));
    }
}
