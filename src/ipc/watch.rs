//! Other processes this one watches for their exit (a producer whose memory a consumer keeps
//! mapped), and the process a pidfd refers to.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The process a pidfd refers to, from `/proc/self/fdinfo`.
pub fn pid_of_pidfd(pidfd: i32) -> Option<u32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{pidfd}")).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|p| p.trim().parse::<i64>().ok())
        .filter(|p| *p > 0)
        .map(|p| p as u32)
}

/// A process watched for its exit: through a pidfd where the kernel gives one (a pid handed on
/// to another process is then no confusion), else by its pid.
pub struct Watch {
    pid: u32,
    fd: Option<OwnedFd>,
}

impl Watch {
    pub fn new(pid: u32) -> Watch {
        // SAFETY: pidfd_open(pid, 0) returns a new descriptor or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0 as libc::c_long) };
        // SAFETY: a descriptor the kernel just made for us.
        let fd = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
        Watch { pid, fd }
    }

    /// Whether the process exited, reaped or not (its memory went at its exit): a pidfd is
    /// readable from then on; without one, no process of that pid, or a zombie.
    pub fn exited(&self) -> bool {
        match &self.fd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, no wait.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                n > 0 && p.revents & libc::POLLIN != 0
            }
            None => {
                // SAFETY: signal 0 only checks.
                let r = unsafe { libc::kill(self.pid as libc::pid_t, 0) };
                let gone =
                    r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
                gone || zombie(self.pid)
            }
        }
    }
}

/// Whether process `pid` is a zombie (`/proc/PID/stat`'s state after the name's parenthesis).
fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Run `look` every `period` on a thread of its own named `name`, started once (`started`
/// says whether it runs; cleared again where the thread cannot start); a panic in one look is
/// caught, and the next look runs.
pub fn every(name: &str, started: &'static AtomicBool, period: Duration, look: fn()) {
    if started.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || loop {
            std::thread::sleep(period);
            let _ = std::panic::catch_unwind(look);
        });
    if spawned.is_err() {
        started.store(false, Ordering::Release);
    }
}
