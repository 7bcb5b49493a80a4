//! The per-user socket's server under a flood of bad requests (with this test's answers, then
//! with the library's own decisions): 10,000 connections, each
//! malformed, truncated, oversized, slow, silent (alone, or 40 at once for 1.5 s), or a grant
//! left unread, thrown at a server
//! on a temporary directory by 8 threads, while the owner's own control request is asked every
//! 20 ms. No panic, no descriptor left open, and every one of the owner's requests answered
//! within 1 s. Seeded (`EXPSEG_TEST_SEED`), the seed printed, so a failure can be replayed.
//!
//! Its own test binary: the descriptor count of the process is the server's alone.

use expseg::ipc::server::serve;
use expseg::ipc::sockdir::current_uid;
use expseg::ipc::transport::{ask, ask_plain, FdSource, Reply, FIRST_REQUEST_ID};
use expseg::ipc::{Grant, Refusal};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const REQUESTS: usize = 10_000;
const ATTACKERS: usize = 8;

/// splitmix64: a small seeded generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The server's answers: the owner's control request (the first request id) gets its nonce
/// back as a size; ticket 3 with nonce 99 a grant of 3 descriptors; ticket 4 with nonce 99 a
/// grant of 150 (three batches); everything else a refusal.
fn decide(id: u32, nonce: u64, _peer: expseg::ipc::server::Peer) -> Reply {
    let grant = |n: u64| -> Reply {
        let source: FdSource = Box::new(|| Ok(std::fs::File::open("/dev/null")?.into()));
        Ok((
            Grant::new(2 << 20, (0..n).map(|_| 2 << 20).collect()),
            source,
        ))
    };
    match (id, nonce) {
        (FIRST_REQUEST_ID, n) => Ok((
            Grant::new(n, vec![]),
            expseg::ipc::transport::fds_of(vec![]),
        )),
        (3, 99) => grant(3),
        (4, 99) => grant(150),
        _ => Err(Refusal::Unknown.into()),
    }
}

/// One bad (or unread) request of a kind the generator picks.
fn attack(path: &Path, rng: &mut Rng, me: (u32, u32)) {
    let Ok(mut s) = UnixStream::connect(path) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(3)));
    let drain = |s: &mut UnixStream| {
        let mut buf = [0u8; 256];
        while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
    };
    match rng.below(1000) {
        // Malformed: 16 random bytes (ids of tickets, requests, nonsense), answer read or not.
        0..=399 => {
            let mut req = rng.bytes(16);
            if rng.below(4) == 0 {
                req[0..4].copy_from_slice(&(u32::MAX - rng.below(5) as u32).to_le_bytes());
            }
            let _ = s.write_all(&req);
            if rng.below(2) == 0 {
                drain(&mut s);
            }
        }
        // Truncated: fewer than 16 bytes, then the writing half closed, or the whole.
        400..=599 => {
            let n = rng.below(16) as usize;
            let _ = s.write_all(&rng.bytes(n));
            if rng.below(2) == 0 {
                let _ = s.shutdown(std::net::Shutdown::Write);
                drain(&mut s);
            }
        }
        // Oversized: far more than a request, some of it a valid ticket.
        600..=749 => {
            let n = 17 + rng.below(64 << 10) as usize;
            let mut req = rng.bytes(n);
            if rng.below(2) == 0 {
                req[0..4].copy_from_slice(&3u32.to_le_bytes());
                req[4..8].fill(0);
                req[8..16].copy_from_slice(&99u64.to_le_bytes());
            }
            let _ = s.write_all(&req);
            if rng.below(2) == 0 {
                drain(&mut s);
            }
        }
        // A grant whose descriptors are never read, or only partly: the peer goes.
        750..=899 => {
            let mut req = [0u8; 16];
            req[0] = 3 + rng.below(2) as u8;
            req[8] = 99;
            let _ = s.write_all(&req);
            if rng.below(2) == 0 {
                let _ = s.read(&mut [0u8; 64]);
            }
        }
        // A grant asked properly, its descriptors received and closed.
        900..=979 => {
            drop(s);
            if let Ok((_, mut incoming)) = ask(path, me.0, me.1, 3 + rng.below(2) as u32, 99) {
                while matches!(incoming.next_batch(), Ok(b) if !b.is_empty()) {}
            }
        }
        // Connected and closed at once.
        980..=989 => {}
        // Silent for up to 400 ms.
        990..=993 => std::thread::sleep(Duration::from_millis(rng.below(400))),
        // A burst of 40 more that say nothing for 1.5 s: more than the server reads at once.
        994..=995 => {
            let burst: Vec<_> = (0..40)
                .filter_map(|_| UnixStream::connect(path).ok())
                .collect();
            std::thread::sleep(Duration::from_millis(1500));
            drop(burst);
        }
        // Slow: a byte at a time, some fast enough to finish within the server's 1 s.
        _ => {
            let gap = Duration::from_millis(20 + rng.below(100));
            let mut req = [0u8; 16];
            req[0] = 9;
            for b in req {
                if s.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(gap);
            }
            drain(&mut s);
        }
    }
}

#[test]
fn ten_thousand_bad_requests_leave_no_panic_no_descriptor_and_no_wait_for_the_owner() {
    // Against a server whose answers are this test's (grants of many descriptors, to leave
    // unread), then against the library's own decisions (`api::ipc::tickets`: the same code a
    // process under expseg serves with), where the owner asks the bytes paused (0 here).
    flood(
        "stub",
        |path| serve(path, false, |_| true, decide),
        |asked| (FIRST_REQUEST_ID, asked, asked),
    );
    flood("real", expseg::api::serve_decisions_at, |_| {
        (expseg::ipc::control::QUERY_ID, 0, 0)
    });
}

/// The flood against a server `start` makes at a path; `owner(n)` is the owner's n-th request
/// (id, nonce) and the answer it must get.
fn flood(
    name: &str,
    start: impl Fn(&Path) -> Result<(), String>,
    owner_request: fn(u64) -> (u32, u64, u64),
) {
    let seed = std::env::var("EXPSEG_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{name}: seed {seed} (EXPSEG_TEST_SEED={seed} replays it)");
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    static HOOKED: std::sync::Once = std::sync::Once::new();
    HOOKED.call_once(|| {
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default_hook(info);
        }));
    });

    let dir = std::env::temp_dir().join(format!("expseg-flood-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let path = dir.join(format!("{}.sock", std::process::id()));
    let before = open_fds();
    start(&path).unwrap();
    let me = (current_uid(), std::process::id());
    let started = Instant::now();

    let done = Arc::new(AtomicBool::new(false));
    let slowest = Arc::new(AtomicU64::new(0));
    let owner = {
        let (path, done, slowest) = (path.clone(), done.clone(), slowest.clone());
        std::thread::spawn(move || {
            let mut asked = 0u64;
            while !done.load(Ordering::SeqCst) {
                asked += 1;
                let (id, nonce, expected) = owner_request(asked);
                let t = Instant::now();
                let answer = ask_plain(&path, me.0, me.1, id, nonce, Duration::from_secs(5));
                let took = t.elapsed();
                assert_eq!(answer.unwrap(), expected, "request {asked}");
                assert!(
                    took < Duration::from_secs(1),
                    "the owner's request {asked} waited {took:?}"
                );
                slowest.fetch_max(took.as_micros() as u64, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
            asked
        })
    };
    let next = Arc::new(AtomicUsize::new(0));
    let attackers: Vec<_> = (0..ATTACKERS)
        .map(|t| {
            let (path, next) = (path.clone(), next.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(seed ^ (t as u64).wrapping_mul(0xA24B_AED4_963E_E407));
                while next.fetch_add(1, Ordering::SeqCst) < REQUESTS {
                    attack(&path, &mut rng, me);
                }
            })
        })
        .collect();
    for a in attackers {
        a.join().unwrap();
    }
    done.store(true, Ordering::SeqCst);
    let asked = owner
        .join()
        .expect("the owner's requests were answered in time");
    let took = started.elapsed();
    eprintln!(
        "{name}: {REQUESTS} requests in {took:?}; {asked} of the owner's, the slowest answered in {} us",
        slowest.load(Ordering::SeqCst)
    );
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "panics");

    // Every connection's descriptors go once its thread ends (a silent one's within 1 s, an
    // unread answer's write at once): the listener alone stays.
    let deadline = Instant::now() + Duration::from_secs(10);
    while open_fds() != before + 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(open_fds(), before + 1, "descriptors left open");
    let _ = std::fs::remove_dir_all(&dir);
}
