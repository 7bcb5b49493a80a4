//! Where the ticket sockets live, and whether a directory may be trusted with them: one
//! directory per user (and per pid namespace) under `${EXPSEG_IPC_DIR:-/tmp}`, private to
//! that user, with one socket per producer process named by its pid.

use super::ns::{self, PidNamespace};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The directory holding the sockets of user `uid`: `${EXPSEG_IPC_DIR:-/tmp}/expseg-<uid>`,
/// or `expseg-<uid>-ns<inode>` in a pid namespace other than the host's (containers sharing
/// `/tmp` each have their own pid 7: one process's socket must not be taken for, or removed
/// as the stale socket of, another's; a ticket names its producer by pid, which a process of
/// another pid namespace could not check anyway). An invalid `EXPSEG_IPC_DIR` (named once on
/// stderr by the configuration) means `/tmp`. `Err`: this process's pid namespace is unknown
/// (`ns::own`), and it has no socket directory.
pub fn socket_dir(uid: u32) -> Result<PathBuf, String> {
    let base = std::env::var("EXPSEG_IPC_DIR")
        .ok()
        .filter(|v| crate::config::valid_ipc_dir(v).is_ok())
        .unwrap_or_else(|| "/tmp".into());
    Ok(Path::new(&base).join(dir_name(uid, ns::own()?)))
}

fn dir_name(uid: u32, pid_namespace: PidNamespace) -> String {
    if pid_namespace.is_host() {
        format!("expseg-{uid}")
    } else {
        format!("expseg-{uid}-ns{}", pid_namespace.ino)
    }
}

/// The socket of producer `pid` of user `uid` (`Err`: the pid namespace is unknown).
pub fn socket_path(uid: u32, pid: u32) -> Result<PathBuf, String> {
    Ok(socket_dir(uid)?.join(format!("{pid}.sock")))
}

/// This process's effective uid: whose socket directory it uses.
#[allow(unsafe_code)]
pub fn current_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Create (or check) this user's socket directory: owned by us, closed to everyone else
/// (0700); with `others` (EXPSEG_IPC_ALLOW_UIDS), others may pass through it but not list it
/// (0711), and the producer's uid check decides.
pub fn prepare_dir(uid: u32, others: bool) -> Result<PathBuf, String> {
    let mode = if others { 0o711 } else { 0o700 };
    let dir = socket_dir(uid)?;
    match std::fs::DirBuilder::new().mode(mode).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    }
    let md = std::fs::symlink_metadata(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !md.is_dir() || md.uid() != uid || md.permissions().mode() & 0o066 != 0 {
        return Err(format!(
            "{} must be a directory owned by uid {uid} that others cannot read or write",
            dir.display()
        ));
    }
    // An existing directory is never chmod-ed: processes of one user with different settings
    // would otherwise flip it against each other. A private one (0700) while other users are
    // allowed only means they cannot reach the socket; say so.
    if others && md.permissions().mode() & 0o011 == 0 {
        log::warn!(
            "{} is closed to other users (mode {:o}): EXPSEG_IPC_ALLOW_UIDS users cannot reach this process's tickets",
            dir.display(),
            md.permissions().mode() & 0o777
        );
    }
    Ok(dir)
}

/// Whether `dir` may hold the sockets of user `uid`: a real directory (not a link) owned by
/// `uid` that no one else can write.
pub fn dir_trusted(dir: &Path, uid: u32) -> Result<(), String> {
    let md = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !md.is_dir() || md.uid() != uid || md.permissions().mode() & 0o022 != 0 {
        return Err(format!(
            "{} is not a directory of uid {uid} closed to others' writes (owner uid {}, mode {:o})",
            dir.display(),
            md.uid(),
            md.permissions().mode() & 0o7777
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pid_namespace_has_its_own_socket_directory() {
        let ns = |ino| PidNamespace { dev: 4, ino };
        assert_eq!(dir_name(1000, ns(PidNamespace::HOST_INO)), "expseg-1000");
        assert_eq!(dir_name(1000, ns(4026532301)), "expseg-1000-ns4026532301");
        assert_ne!(
            dir_name(1000, ns(4026532301)),
            dir_name(1000, ns(4026532302))
        );
        // This process: the name its own namespace gives (the host's here, or a container's).
        let name = socket_dir(1000).unwrap();
        let name = name.file_name().unwrap().to_str().unwrap();
        assert!(
            name == "expseg-1000" || name.starts_with("expseg-1000-ns"),
            "{name}"
        );
    }

    #[test]
    fn an_unknown_pid_namespace_means_no_socket_directory() {
        // Taken for the host's, the directory would be the host processes' own, where a live
        // socket of a host process with this pid could be taken for ours.
        ns::UNKNOWN.with(|u| u.set(true));
        let dir = socket_dir(current_uid());
        let path = socket_path(current_uid(), 7);
        let prepared = prepare_dir(current_uid(), false);
        ns::UNKNOWN.with(|u| u.set(false));
        for e in [dir.unwrap_err(), path.unwrap_err(), prepared.unwrap_err()] {
            assert!(e.contains("/proc/self/ns/pid") && e.contains("off"), "{e}");
        }
    }

    #[test]
    fn the_socket_directory_must_be_private() {
        let base = std::env::temp_dir().join(format!("expseg-dir-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        std::env::set_var("EXPSEG_IPC_DIR", &base);
        let uid = current_uid();
        let dir = prepare_dir(uid, false).unwrap();
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        // An existing directory keeps its mode whatever the next process's settings.
        assert!(prepare_dir(uid, true).is_ok());
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        std::fs::remove_dir(&dir).unwrap();
        assert!(prepare_dir(uid, true).is_ok());
        assert!(prepare_dir(uid, false).is_ok());
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o711
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(
            prepare_dir(uid, false).is_err(),
            "a directory others can list is refused"
        );
        std::env::remove_var("EXPSEG_IPC_DIR");
        let _ = std::fs::remove_dir_all(&base);
    }
}
