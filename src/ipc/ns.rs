//! Pid namespaces: this process's, and whether the process at the other end of a socket is in
//! it. A socket directory is per user and per pid namespace (containers that share `/tmp` each
//! have their own pid 7), and a socket serves only processes of its own namespace: a process
//! of another container of the same uid could otherwise pause this one or take its memory.
//!
//! Both answers come from `/proc`, which must number processes as this namespace does (a pid
//! from `SO_PEERCRED` is this namespace's number). Where `/proc/self/ns/pid` cannot be read,
//! or `/proc` is the procfs of another namespace, the namespace is unknown, and every IPC
//! socket is off: taking an unknown namespace for the host's would put this process's socket
//! beside the host processes' and let it be taken for, or removed as, one of theirs.

use once_cell::sync::Lazy;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A pid namespace: the device and inode of its `nsfs` file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PidNamespace {
    pub dev: u64,
    pub ino: u64,
}

impl PidNamespace {
    /// The inode of the host's pid namespace (`PROC_PID_INIT_INO`).
    pub const HOST_INO: u64 = 0xEFFF_FFFC;

    /// Whether this is the host's (the initial) pid namespace.
    pub fn is_host(&self) -> bool {
        self.ino == Self::HOST_INO
    }
}

/// This process's pid namespace, read once.
static OWN: Lazy<Result<PidNamespace, String>> = Lazy::new(|| read_own(Path::new("/proc")));

/// This process's pid namespace, or why it is unknown (then IPC sockets are off).
pub fn own() -> Result<PidNamespace, String> {
    #[cfg(test)]
    if UNKNOWN.with(|u| u.get()) {
        return Err("cannot read /proc/self/ns/pid (test): the pid namespace is unknown, so IPC sockets are off".into());
    }
    OWN.clone()
}

/// The namespace of the process reading `proc` (a procfs mount), checked to be the one that
/// procfs numbers processes in.
fn read_own(proc: &Path) -> Result<PidNamespace, String> {
    let md = std::fs::metadata(proc.join("self/ns/pid")).map_err(|e| {
        format!("cannot read /proc/self/ns/pid ({e}): this process's pid namespace is unknown, so its IPC sockets are off")
    })?;
    // `/proc/self/status` lists this process's pid in every namespace from procfs's down to
    // its own: one entry when they are the same. Kernels without the line (before 4.1):
    // `/proc/self` must at least name this process by its own pid.
    let numbered_here = match nspid_depth(&proc.join("self/status")) {
        Some(depth) => depth == 1,
        None => std::fs::read_link(proc.join("self"))
            .is_ok_and(|p| p.as_os_str() == std::process::id().to_string().as_str()),
    };
    if !numbered_here {
        return Err("/proc is the procfs of another pid namespace than this process's: its peers cannot be checked, so its IPC sockets are off".into());
    }
    Ok(PidNamespace {
        dev: md.dev(),
        ino: md.ino(),
    })
}

/// Whether process `pid` (this namespace's number, as `SO_PEERCRED` gives it) is in pid
/// namespace `own`, this process's. `Err` says why not, or why it cannot be told.
///
/// A process of an outer or a sibling namespace has no number here: the kernel gives pid 0.
/// A process of a namespace inside this one has a number here and more below: its
/// `/proc/<pid>/status` lists more than one. Its `/proc/<pid>/ns/pid` is compared too where it
/// can be read (another user's process needs ptrace rights for that link; its status file
/// needs none, so an `EXPSEG_IPC_ALLOW_UIDS` peer is checked by the status alone).
pub fn check_peer(pid: u32, own: PidNamespace) -> Result<(), String> {
    check_peer_in(Path::new("/proc"), pid, own)
}

fn check_peer_in(proc: &Path, pid: u32, own: PidNamespace) -> Result<(), String> {
    if pid == 0 {
        return Err("a process of another pid namespace (the kernel gives it no pid here)".into());
    }
    let entry = proc.join(pid.to_string());
    let depth = nspid_depth(&entry.join("status"));
    if depth.is_some_and(|d| d != 1) {
        return Err(format!(
            "process {pid} is in a pid namespace inside this one"
        ));
    }
    match std::fs::metadata(entry.join("ns/pid")) {
        Ok(md) if (md.dev(), md.ino()) == (own.dev, own.ino) => Ok(()),
        Ok(_) => Err(format!("process {pid} is in another pid namespace")),
        Err(_) if depth == Some(1) => Ok(()),
        Err(e) => Err(format!(
            "cannot tell the pid namespace of process {pid} ({e})"
        )),
    }
}

/// How many pid namespaces number the process whose status file is `status` (the `NSpid:`
/// line: procfs's namespace down to the process's own), if the file says.
fn nspid_depth(status: &Path) -> Option<usize> {
    let text = std::fs::read_to_string(status).ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    Some(line.split_whitespace().count())
}

#[cfg(test)]
thread_local! {
    /// Makes `own` fail on this thread, as where `/proc/self/ns/pid` cannot be read.
    pub(crate) static UNKNOWN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_namespace_is_unknown_not_the_hosts() {
        // A procfs without this process's entries (an empty directory): unknown.
        let fake = std::env::temp_dir().join(format!("expseg-noproc-{}", std::process::id()));
        std::fs::create_dir_all(&fake).unwrap();
        let e = read_own(&fake).unwrap_err();
        assert!(e.contains("/proc/self/ns/pid") && e.contains("off"), "{e}");
        let _ = std::fs::remove_dir_all(&fake);
        // The real one: known, and the same on every call.
        let own = read_own(Path::new("/proc")).unwrap();
        assert_eq!(super::own(), Ok(own));
        UNKNOWN.with(|u| u.set(true));
        assert!(super::own().is_err());
        UNKNOWN.with(|u| u.set(false));
    }

    #[test]
    fn peers_of_other_pid_namespaces_are_told_apart() {
        let own = own().unwrap();
        assert!(check_peer(std::process::id(), own).is_ok());
        assert!(check_peer(0, own)
            .unwrap_err()
            .contains("another pid namespace"));
        // A procfs where process 42 is numbered in two namespaces (its own inside this one),
        // or has a namespace link of another namespace.
        let fake = std::env::temp_dir().join(format!("expseg-fakeproc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&fake);
        std::fs::create_dir_all(fake.join("42/ns")).unwrap();
        std::fs::write(fake.join("42/status"), "NSpid:\t42\t1\n").unwrap();
        std::fs::write(fake.join("42/ns/pid"), "").unwrap();
        let e = check_peer_in(&fake, 42, own).unwrap_err();
        assert!(e.contains("inside this one"), "{e}");
        std::fs::write(fake.join("42/status"), "NSpid:\t42\n").unwrap();
        let e = check_peer_in(&fake, 42, own).unwrap_err();
        assert!(e.contains("another pid namespace"), "{e}");
        // The link unreadable (another user's process): the status alone decides.
        std::fs::remove_file(fake.join("42/ns/pid")).unwrap();
        assert!(check_peer_in(&fake, 42, own).is_ok());
        // Neither readable (a process gone): refused.
        std::fs::remove_file(fake.join("42/status")).unwrap();
        assert!(check_peer_in(&fake, 42, own).is_err());
        let _ = std::fs::remove_dir_all(&fake);
        // A real process of another namespace, where this machine lets us make one.
        if let Some(mut child) = in_new_pid_namespace() {
            let e = check_peer(child.1, own).unwrap_err();
            assert!(e.contains("inside this one"), "{e}");
            let _ = child.0.kill();
            let _ = child.0.wait();
        }
    }

    /// `unshare --pid --fork sleep 30`: the child and the pid of its sleep (numbered here),
    /// or `None` (with a line saying why) where this machine cannot make pid namespaces.
    pub(crate) fn in_new_pid_namespace() -> Option<(std::process::Child, u32)> {
        let child = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "sleep", "30"])
            .stderr(std::process::Stdio::null())
            .spawn();
        let Ok(mut child) = child else {
            eprintln!("skipped: no unshare here");
            return None;
        };
        for _ in 0..200 {
            let kids = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", child.id()))
                .unwrap_or_default();
            if let Some(pid) = kids.split_whitespace().next().and_then(|p| p.parse().ok()) {
                return Some((child, pid));
            }
            if let Ok(Some(_)) = child.try_wait() {
                eprintln!("skipped: unshare --pid --fork is not allowed here");
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        eprintln!("skipped: unshare --pid --fork started no child");
        None
    }

    #[test]
    fn a_status_file_says_how_many_namespaces_number_the_process() {
        let dir = std::env::temp_dir().join(format!("expseg-nspid-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let status = dir.join("status");
        std::fs::write(&status, "Name:\tx\nNSpid:\t4242\n").unwrap();
        assert_eq!(nspid_depth(&status), Some(1));
        std::fs::write(&status, "Name:\tx\nNSpid:\t4242\t7\t1\n").unwrap();
        assert_eq!(nspid_depth(&status), Some(3));
        std::fs::write(&status, "Name:\tx\n").unwrap();
        assert_eq!(nspid_depth(&status), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
