//! Where the ticket sockets live, and whether a directory may be trusted with them: one
//! directory per user (and per pid namespace), private to that user, with one socket per
//! producer process named by its pid.
//!
//! The directory's name is `expseg-<uid>`, or `expseg-<uid>-ns<inode>` in a pid namespace
//! other than the host's (containers sharing `/tmp` each have their own pid 7: one process's
//! socket must not be taken for, or removed as the stale socket of, another's). A producer
//! serves in the first of these [`places`] it can make, or finds its own (owned by the user,
//! closed to others):
//!
//! 1. with `EXPSEG_IPC_DIR`, that directory only: `<name>`, then `<name>.1` … `<name>.8`;
//! 2. otherwise `$XDG_RUNTIME_DIR/<name>` where that is the user's own runtime directory
//!    (absolute, owned by the user, 0700; not with `EXPSEG_IPC_ALLOW_UIDS`, whose users
//!    could not enter it): no other user can take that name first;
//! 3. then, where the user's home directory is private to them (owned, not writable by
//!    others), `~/.cache/expseg/<boot>/<name>` (`<boot>`: the kernel's boot id, so that nodes
//!    sharing a home never meet in one directory); not with `EXPSEG_IPC_ALLOW_UIDS`. No one
//!    else can take that name first where there is no runtime directory (cron, batch steps,
//!    containers);
//! 4. then `/tmp/<name>`, and where another user took that name first (any local user can
//!    `mkdir /tmp/expseg-1000`), `/tmp/<name>.1` … `/tmp/<name>.8`.
//!
//! Consumers find a producer by its uid and pid alone (a ticket says no more): they look for
//! `<pid>.sock` along the same list, in every directory of it that the producer's uid owns and
//! keeps closed, and, for a producer of their own user, in `/run/user/<uid>` too (the runtime
//! directory of a producer whose environment named it when theirs does not). The names are
//! fixed, so producers and consumers of one user meet whatever their environments; the
//! ownership check means a directory someone else made is never used, only skipped.

use super::ns::{self, PidNamespace};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Names tried after the usual one in a shared directory (`<name>.1` … `<name>.8`).
pub const FALLBACKS: u32 = 8;

/// A directory where a user's sockets may be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    pub dir: PathBuf,
    /// Its parent is the user's private runtime directory: other users cannot reach it.
    pub private: bool,
    /// A producer may serve here (not `/run/user/<uid>` found without `XDG_RUNTIME_DIR`: it
    /// goes with the user's last login session, which such a process has no part in).
    pub serve: bool,
}

/// The directories where user `uid`'s sockets may be, in the order a producer tries them
/// and a consumer looks. `Err`: this process's pid namespace is unknown (`ns::own`), and it
/// has no socket directory.
pub fn places(uid: u32) -> Result<Vec<Place>, String> {
    let ipc_dir = std::env::var("EXPSEG_IPC_DIR")
        .ok()
        .filter(|v| crate::config::valid_ipc_dir(v).is_ok());
    let xdg = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from);
    let own = uid == current_uid();
    let home = own.then(|| home_place(uid)).flatten();
    Ok(places_from(
        &dir_name(uid, ns::own()?),
        uid,
        ipc_dir.as_deref().map(Path::new),
        xdg.as_deref().filter(|_| own),
        Path::new("/run/user"),
        home.as_deref(),
    ))
}

/// `~/.cache/expseg/<boot>` of user `uid` (their home directory as the password database
/// says, whatever `HOME` is), where that home is private to them: absolute, a directory owned
/// by `uid` that no one else may write; and every part of the path that exists already so too.
fn home_place(uid: u32) -> Option<PathBuf> {
    let home = home_of(uid)?;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let boot: String = boot.trim().chars().filter(|c| *c != '-').take(12).collect();
    if boot.is_empty() {
        return None;
    }
    let dir = home.join(".cache").join("expseg").join(boot);
    private_chain(&home, &dir, uid).then_some(dir)
}

/// Whether `home` and each part of `dir` below it that exists is a directory owned by `uid`
/// that others cannot write (parts not made yet are made private by [`make_parents`]).
fn private_chain(home: &Path, dir: &Path, uid: u32) -> bool {
    let private = |p: &Path| {
        std::fs::symlink_metadata(p)
            .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o022 == 0)
    };
    if !home.is_absolute() || !private(home) {
        return false;
    }
    let mut p = home.to_path_buf();
    for c in dir
        .strip_prefix(home)
        .ok()
        .into_iter()
        .flat_map(|r| r.components())
    {
        p.push(c);
        if std::fs::symlink_metadata(&p).is_ok() && !private(&p) {
            return false;
        }
    }
    true
}

/// User `uid`'s home directory, from the password database.
#[allow(unsafe_code)]
fn home_of(uid: u32) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut buf = vec![0 as libc::c_char; 16384];
    // SAFETY: a zeroed passwd is a valid out-value; the strings it gets point into `buf`.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: valid pointers and the buffer's length.
    let r = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut found) };
    if r != 0 || found.is_null() || pw.pw_dir.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string inside `buf`, alive here.
    let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes())))
}

/// [`places`] for directory name `name` of `uid`, with `EXPSEG_IPC_DIR` = `ipc_dir`, the
/// user's `XDG_RUNTIME_DIR` = `xdg` (none for another user's sockets) and the runtime
/// directories under `run_user`. An invalid `EXPSEG_IPC_DIR` (named once on stderr by the
/// configuration) is no setting: `/tmp`.
fn places_from(
    name: &str,
    uid: u32,
    ipc_dir: Option<&Path>,
    xdg: Option<&Path>,
    run_user: &Path,
    home: Option<&Path>,
) -> Vec<Place> {
    let shared = |base: &Path| {
        std::iter::once(name.to_string())
            .chain((1..=FALLBACKS).map(|n| format!("{name}.{n}")))
            .map(|n| Place {
                dir: base.join(n),
                private: false,
                serve: true,
            })
            .collect::<Vec<_>>()
    };
    if let Some(base) = ipc_dir {
        return shared(base);
    }
    let mut out = Vec::new();
    let xdg = xdg.filter(|d| runtime_dir_private(d, uid));
    if let Some(d) = xdg {
        out.push(Place {
            dir: d.join(name),
            private: true,
            serve: true,
        });
    }
    let run = run_user.join(uid.to_string());
    let same = |a: &Path, b: &Path| match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    };
    if uid == current_uid() && runtime_dir_private(&run, uid) && !xdg.is_some_and(|d| same(d, &run))
    {
        out.push(Place {
            dir: run.join(name),
            private: true,
            serve: false,
        });
    }
    if let Some(h) = home {
        out.push(Place {
            dir: h.join(name),
            private: true,
            serve: true,
        });
    }
    out.extend(shared(Path::new("/tmp")));
    out
}

/// Whether `dir` is a user's own runtime directory: absolute, a directory owned by `uid`
/// that no one else may enter (0700).
fn runtime_dir_private(dir: &Path, uid: u32) -> bool {
    dir.is_absolute()
        && std::fs::metadata(dir)
            .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o077 == 0)
}

fn dir_name(uid: u32, pid_namespace: PidNamespace) -> String {
    if pid_namespace.is_host() {
        format!("expseg-{uid}")
    } else {
        format!("expseg-{uid}-ns{}", pid_namespace.ino)
    }
}

/// The directories of [`places`] that hold user `uid`'s sockets now (they exist, `uid` owns
/// them and no one else may write them).
pub fn socket_dirs(uid: u32) -> Vec<PathBuf> {
    let Ok(places) = places(uid) else {
        return Vec::new();
    };
    places
        .into_iter()
        .map(|p| p.dir)
        .filter(|d| dir_trusted(d, uid).is_ok())
        .collect()
}

/// The socket of producer `pid` of user `uid`: the first of [`places`] that holds one, in a
/// directory `uid` owns and keeps closed; where none does, where the first would be (asking
/// there fails: no such file). `Err`: the pid namespace is unknown.
pub fn socket_path(uid: u32, pid: u32) -> Result<PathBuf, String> {
    Ok(find_socket(&places(uid)?, uid, pid))
}

fn find_socket(places: &[Place], uid: u32, pid: u32) -> PathBuf {
    let name = format!("{pid}.sock");
    // The usual name in the first trusted directory that holds any of the producer's names
    // (the asker tries the others there: `transport`).
    places
        .iter()
        .find(|p| {
            socket_names(pid).any(|n| std::fs::symlink_metadata(p.dir.join(n)).is_ok())
                && dir_trusted(&p.dir, uid).is_ok()
        })
        .or_else(|| places.first())
        .map(|p| p.dir.join(&name))
        .unwrap_or_else(|| PathBuf::from(name))
}

/// The names producer `pid` may serve under in a directory, in order: `<pid>.sock`, then, where
/// a live process of another pid namespace holds that name (it can bind there first),
/// `<pid>.1.sock` … `<pid>.8.sock`.
pub fn socket_names(pid: u32) -> impl Iterator<Item = String> {
    std::iter::once(format!("{pid}.sock"))
        .chain((1..=FALLBACKS).map(move |n| format!("{pid}.{n}.sock")))
}

/// The pid a socket's file name is of ([`socket_names`]), if it is one.
pub fn pid_of_name(name: &str) -> Option<u32> {
    let stem = name.strip_suffix(".sock")?;
    let (pid, n) = match stem.split_once('.') {
        Some((p, n)) => (p, Some(n)),
        None => (stem, None),
    };
    if n.is_some_and(|n| !n.parse::<u32>().is_ok_and(|n| (1..=FALLBACKS).contains(&n))) {
        return None;
    }
    pid.parse().ok()
}

/// This process's effective uid: whose socket directory it uses.
#[allow(unsafe_code)]
pub fn current_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Create (or find) this user's socket directory, the first of [`places`] where a producer
/// may serve that it can make or finds its own: owned by us, closed to everyone else (0700);
/// with `others` (EXPSEG_IPC_ALLOW_UIDS), others may pass through it but not list it (0711),
/// and the producer's uid check decides (then not in a private runtime directory, which they
/// could not enter). A name taken by someone else is skipped with one warning line.
pub fn prepare_dir(uid: u32, others: bool) -> Result<PathBuf, String> {
    prepare_in(&places(uid)?, uid, others)
}

fn prepare_in(places: &[Place], uid: u32, others: bool) -> Result<PathBuf, String> {
    let mut skipped = Vec::new();
    for p in places.iter().filter(|p| p.serve && !(others && p.private)) {
        // A socket's path must fit a sockaddr_un (108 bytes with its NUL).
        if p.dir.join("4294967295.sock").as_os_str().len() >= 108 {
            skipped.push(format!("{}: too long a path for a socket", p.dir.display()));
            continue;
        }
        // A private place under the home directory: its parents are made private too.
        if p.private {
            if let Some(parent) = p.dir.parent() {
                let _ = std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(parent);
            }
        }
        match make_or_check(&p.dir, uid, others) {
            Ok(()) => {
                if !skipped.is_empty() {
                    log::warn!(
                        "IPC: {}; this process's socket is in {}",
                        skipped.join("; "),
                        p.dir.display()
                    );
                }
                return Ok(p.dir.clone());
            }
            Err(e) => skipped.push(e),
        }
    }
    Err(format!(
        "no socket directory of uid {uid} could be made: {}",
        skipped.join("; ")
    ))
}

/// Make `dir` (0700, or 0711 with `others`) or check the one there: a directory owned by `uid`
/// that others cannot read or write.
fn make_or_check(dir: &Path, uid: u32, others: bool) -> Result<(), String> {
    let mode = if others { 0o711 } else { 0o700 };
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    }
    let md = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !md.is_dir() || md.uid() != uid || md.permissions().mode() & 0o066 != 0 {
        return Err(format!(
            "{} must be a directory owned by uid {uid} that others cannot read or write (owner uid {}, mode {:o})",
            dir.display(),
            md.uid(),
            md.permissions().mode() & 0o7777
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
    Ok(())
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

    /// A fresh directory of this test's own under the temporary directory.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("expseg-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

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
        for p in places(1000).unwrap() {
            let name = p.dir.file_name().unwrap().to_str().unwrap().to_string();
            assert!(
                name.starts_with("expseg-1000.")
                    || name == "expseg-1000"
                    || name.starts_with("expseg-1000-ns"),
                "{name}"
            );
        }
    }

    #[test]
    fn an_unknown_pid_namespace_means_no_socket_directory() {
        // Taken for the host's, the directory would be the host processes' own, where a live
        // socket of a host process with this pid could be taken for ours.
        ns::UNKNOWN.with(|u| u.set(true));
        let found = places(current_uid());
        let path = socket_path(current_uid(), 7);
        let prepared = prepare_dir(current_uid(), false);
        let dirs = socket_dirs(current_uid());
        ns::UNKNOWN.with(|u| u.set(false));
        for e in [found.unwrap_err(), path.unwrap_err(), prepared.unwrap_err()] {
            assert!(e.contains("/proc/self/ns/pid") && e.contains("off"), "{e}");
        }
        assert!(dirs.is_empty());
    }

    #[test]
    fn the_socket_directory_must_be_private() {
        let base = scratch("dir");
        let uid = current_uid();
        let dir = base.join("expseg-x");
        make_or_check(&dir, uid, false).unwrap();
        assert_eq!(mode(&dir), 0o700);
        // An existing directory keeps its mode whatever the next process's settings.
        assert!(make_or_check(&dir, uid, true).is_ok());
        assert_eq!(mode(&dir), 0o700);
        std::fs::remove_dir(&dir).unwrap();
        assert!(make_or_check(&dir, uid, true).is_ok());
        assert!(make_or_check(&dir, uid, false).is_ok());
        assert_eq!(mode(&dir), 0o711);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(
            make_or_check(&dir, uid, false).is_err(),
            "a directory others can list is refused"
        );
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn a_producers_names_and_the_pid_they_are_of() {
        let names: Vec<String> = socket_names(42).collect();
        assert_eq!(names.len(), 1 + FALLBACKS as usize);
        assert_eq!(
            (names[0].as_str(), names[1].as_str()),
            ("42.sock", "42.1.sock")
        );
        for n in &names {
            assert_eq!(pid_of_name(n), Some(42), "{n}");
        }
        for n in [
            "42.9.sock",
            "42.x.sock",
            "ab.sock",
            "42.sock.tmp",
            "42",
            "42.0.sock",
        ] {
            assert_eq!(pid_of_name(n), None, "{n}");
        }
    }

    #[test]
    fn without_a_runtime_directory_a_private_home_comes_before_tmp() {
        let uid = current_uid();
        let base = scratch("home-place");
        let home = base.join("home");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
        let place = home.join(".cache/expseg/b00t");
        assert!(
            private_chain(&home, &place, uid),
            "nothing made yet: private"
        );
        let ps = places_from("expseg-7", uid, None, None, &base.join("run"), Some(&place));
        assert_eq!(ps[0].dir, place.join("expseg-7"));
        assert!(ps[0].private && ps[0].serve);
        assert_eq!(ps[1].dir, PathBuf::from("/tmp/expseg-7"));
        // Served there, its parents made private; with other users allowed, /tmp instead.
        assert_eq!(
            prepare_in(&ps[..1], uid, false).unwrap(),
            place.join("expseg-7")
        );
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&home.join(".cache")), 0o700);
        assert!(prepare_in(&ps[..1], uid, true).is_err());
        // A part of the path others may write (a group-writable ~/.cache): not private.
        std::fs::set_permissions(home.join(".cache"), std::fs::Permissions::from_mode(0o770))
            .unwrap();
        assert!(!private_chain(&home, &place, uid));
        std::fs::set_permissions(home.join(".cache"), std::fs::Permissions::from_mode(0o700))
            .unwrap();
        // A home others may write: not private.
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(!private_chain(&home, &place, uid));
        // A path too long for a socket is skipped, and the error says so.
        let long = base.join("x".repeat(90));
        let e = prepare_in(
            &[Place {
                dir: long,
                private: false,
                serve: true,
            }],
            uid,
            false,
        )
        .unwrap_err();
        assert!(e.contains("too long a path for a socket"), "{e}");
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn the_users_runtime_directory_comes_first_and_a_taken_name_is_skipped() {
        let uid = current_uid();
        let base = scratch("places");
        let xdg = base.join("xdg");
        let run_user = base.join("run");
        std::fs::create_dir_all(&xdg).unwrap();
        std::fs::create_dir_all(run_user.join(uid.to_string())).unwrap();
        for d in [&xdg, &run_user.join(uid.to_string())] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        let dirs = |ps: &[Place]| ps.iter().map(|p| p.dir.clone()).collect::<Vec<_>>();
        // EXPSEG_IPC_DIR: its own names only, the usual one first.
        let shared = places_from("expseg-7", uid, Some(&base), Some(&xdg), &run_user, None);
        assert_eq!(shared.len(), 1 + FALLBACKS as usize);
        assert_eq!(shared[0].dir, base.join("expseg-7"));
        assert_eq!(shared[8].dir, base.join("expseg-7.8"));
        assert!(shared.iter().all(|p| p.serve && !p.private));
        // Otherwise the user's runtime directory, /run/user/<uid> (looked in, not served in),
        // then /tmp's names.
        let all = places_from("expseg-7", uid, None, Some(&xdg), &run_user, None);
        assert_eq!(
            dirs(&all[..4]),
            vec![
                xdg.join("expseg-7"),
                run_user.join(uid.to_string()).join("expseg-7"),
                PathBuf::from("/tmp/expseg-7"),
                PathBuf::from("/tmp/expseg-7.1"),
            ]
        );
        assert!(all[0].serve && all[0].private);
        assert!(!all[1].serve && all[1].private);
        // A runtime directory others may enter is no private one: not used.
        std::fs::set_permissions(&xdg, std::fs::Permissions::from_mode(0o755)).unwrap();
        let open = places_from("expseg-7", uid, None, Some(&xdg), &run_user, None);
        assert!(!dirs(&open).contains(&xdg.join("expseg-7")));
        std::fs::set_permissions(&xdg, std::fs::Permissions::from_mode(0o700)).unwrap();

        // The usual name taken (by another user; here: a directory others can write): the
        // next one, and consumers find the socket there, not in the taken one.
        let ps = places_from("expseg-7", uid, Some(&base), None, &run_user, None);
        std::fs::create_dir(base.join("expseg-7")).unwrap();
        std::fs::set_permissions(
            base.join("expseg-7"),
            std::fs::Permissions::from_mode(0o777),
        )
        .unwrap();
        std::fs::write(base.join("expseg-7/42.sock"), "").unwrap();
        let dir = prepare_in(&ps, uid, false).unwrap();
        assert_eq!(dir, base.join("expseg-7.1"));
        assert_eq!(
            find_socket(&ps, uid, 42),
            base.join("expseg-7/42.sock"),
            "none in a trusted one: the usual place"
        );
        std::fs::write(dir.join("42.sock"), "").unwrap();
        assert_eq!(find_socket(&ps, uid, 42), dir.join("42.sock"));
        // Every name taken: no directory, and the error names them.
        for n in 1..=FALLBACKS {
            let d = base.join(format!("expseg-7.{n}"));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::write(&d, "").unwrap();
        }
        let e = prepare_in(&ps, uid, false).unwrap_err();
        assert!(
            e.contains("expseg-7.8") && e.contains("expseg-7 must be"),
            "{e}"
        );
        // With other users allowed, never the private runtime directory (they could not
        // enter it).
        let both = places_from("expseg-7", uid, None, Some(&xdg), &run_user, None);
        assert_eq!(prepare_in(&both, uid, false).unwrap(), xdg.join("expseg-7"));
        // (That goes on to /tmp's name: made here, it is taken away again.)
        let in_tmp = PathBuf::from("/tmp/expseg-7");
        let was_there = std::fs::symlink_metadata(&in_tmp).is_ok();
        assert_ne!(
            prepare_in(&both[..3], uid, true).ok(),
            Some(xdg.join("expseg-7"))
        );
        if !was_there {
            let _ = std::fs::remove_dir(&in_tmp);
        }
        let _ = std::fs::remove_dir_all(&base);
    }
}
