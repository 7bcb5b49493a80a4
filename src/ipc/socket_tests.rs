//! Test servers and helper processes shared by the socket's tests (`transport`'s and
//! `server`'s).

use super::server::serve;
use super::transport::FdSource;
use super::{Grant, Refusal};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A server whose requests are counted; `admit` decides who is read at all.
pub(super) fn counting_server(
    name: &str,
    admit: impl Fn(u32) -> bool + Send + 'static,
) -> (PathBuf, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let dir = std::env::temp_dir().join(format!("expseg-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let path = dir.join("p.sock");
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = seen.clone();
    serve(&path, false, admit, move |id, _, _| {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if id != 7 {
            return Err(Refusal::Unknown.into());
        }
        let source: FdSource = Box::new(|| Ok(std::fs::File::open("/dev/null").unwrap().into()));
        Ok((Grant::new(2 << 20, vec![2 << 20]), source))
    })
    .unwrap();
    (path, seen)
}

/// Run this test binary's `helper` test as a separate process, in a new pid namespace
/// when `new_ns` (`unshare --pid --fork`, with its own /proc), with `env`. `None` (with a
/// line saying why) where this machine cannot make pid namespaces.
pub(super) fn helper(name: &str, new_ns: bool, env: (&str, &Path)) -> Option<std::process::Child> {
    let exe = std::env::current_exe().unwrap();
    let test = format!("ipc::socket_tests::{name}");
    let mut c = if new_ns {
        let mut c = std::process::Command::new("unshare");
        c.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
            .arg(exe);
        c
    } else {
        std::process::Command::new(exe)
    };
    c.args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(env.0, env.1)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    match c.spawn() {
        Ok(child) => Some(child),
        Err(e) => {
            eprintln!("skipped: cannot run {name} ({e})");
            None
        }
    }
}

/// The value of `key=` in a helper's output.
pub(super) fn helper_said(out: &str, key: &str) -> Option<String> {
    // The harness prints the test's name on the same line first.
    let key = format!("{key}=");
    out.lines()
        .find_map(|l| l.split_once(&key))
        .map(|(_, v)| v.trim().to_string())
}

/// Helper (does nothing unless `EXPSEG_TEST_POKE` names a socket): connect, send a
/// request for ticket 7, and say how many bytes of answer came (0: closed unread).
#[test]
fn poke_helper() {
    let Some(path) = std::env::var_os("EXPSEG_TEST_POKE") else {
        return;
    };
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut req = [0u8; 16];
    req[0] = 7;
    let _ = s.write_all(&req);
    let mut head = [0u8; 16];
    let n = s.read(&mut head).unwrap_or(0);
    println!("poke_read={n}");
}

/// Helper (does nothing unless `EXPSEG_TEST_SERVE` names a socket): serve there, any
/// peer admitted, every request refused as unknown, for 10 s.
#[test]
fn serve_helper() {
    let Some(path) = std::env::var_os("EXPSEG_TEST_SERVE") else {
        return;
    };
    let r = serve(
        Path::new(&path),
        true,
        |_| true,
        |_, _, _| Err(Refusal::Unknown.into()),
    );
    println!("serving={}", r.is_ok());
    std::thread::sleep(Duration::from_secs(10));
}

/// Helper (does nothing unless `EXPSEG_TEST_SILENT` names a socket): keep 48 connections open
/// that send nothing, opening a new one for each the server closes, for 3 s ("silent=48" once
/// they are open).
#[test]
fn silent_helper() {
    let Some(path) = std::env::var_os("EXPSEG_TEST_SILENT") else {
        return;
    };
    let mut open: Vec<UnixStream> = (0..48)
        .filter_map(|_| UnixStream::connect(&path).ok())
        .collect();
    println!("silent={}", open.len());
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        for s in open.iter_mut() {
            let _ = s.set_nonblocking(true);
            // Closed by the server (read 0): connect again.
            if matches!(s.read(&mut [0u8; 1]), Ok(0)) {
                if let Ok(n) = UnixStream::connect(&path) {
                    *s = n;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
