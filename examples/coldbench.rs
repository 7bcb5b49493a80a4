//! The coalescer's own time per call, as a training loop sees it: a recorded trace replayed on
//! the fake driver with the caches evicted between calls (the program's work between two
//! allocator calls does that), each call timed by kind.
//!
//!     cargo run --release --features test-switches --example coldbench -- TRACE [EVICT_MB]
//!
//! EVICT_MB (default 16) is how many MiB are written between calls; 0 times the calls with
//! warm caches. With 16 on session 28's train_ec trace the figures come near what the exit
//! reports of that workload on the GPU give as expseg's own work per hook call (the hooks'
//! time less the driver's; shim-tests/RESULTS.md, session 31), so a change to the books can be
//! judged here before it goes to the GPU. The fake driver's own time is included, and so are
//! the replay's own allocations; each kind's heap allocations a call are printed beside its
//! time (a cold allocator's bins cost misses as the books do).
use expseg::coalesce::replay::Replay;
use expseg::coalesce::trace::{self, Call};
use expseg::coalesce::CoalesceConfig;
use expseg::config::Config;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Heap allocations made, counted (a cold allocator's bins cost misses like the books do).
struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}
#[global_allocator]
static GLOBAL: Counting = Counting;

const KINDS: [&str; 6] = ["create", "release", "map", "unmap", "set_access", "other"];

fn kind(call: &Call<'_>) -> usize {
    match call {
        Call::Create { .. } => 0,
        Call::Release { .. } => 1,
        Call::Map { .. } => 2,
        Call::Unmap { .. } => 3,
        Call::SetAccess { .. } => 4,
        _ => 5,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        eprintln!("usage: coldbench TRACE [EVICT_MB (default 16)]");
        std::process::exit(2);
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("coldbench: {path}: {e}");
            std::process::exit(1);
        }
    };
    let mb: usize = match args.get(1).map(|s| s.parse()) {
        None => 16,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            eprintln!("coldbench: EVICT_MB must be a whole number of MiB");
            std::process::exit(2);
        }
    };
    let config = Config::from_env();
    let mut replay = Replay::new(
        CoalesceConfig::from_config(&config, true),
        config.pause_keep_host.keeps(),
        140 << 30,
    );
    let mut junk = vec![0u8; mb << 20];
    let (mut ns, mut n, mut al) = ([0u64; 6], [0u64; 6], [0u64; 6]);
    for (i, line) in text.lines().enumerate() {
        let Some(Ok(e)) = trace::parse(line) else {
            replay.line(line);
            continue;
        };
        for b in junk.iter_mut().step_by(64) {
            *b = b.wrapping_add(i as u8);
        }
        let k = kind(&e.call);
        let a = ALLOCS.load(Ordering::Relaxed);
        let t = Instant::now();
        replay.event(&e);
        ns[k] += t.elapsed().as_nanos() as u64;
        al[k] += ALLOCS.load(Ordering::Relaxed) - a;
        n[k] += 1;
    }
    let events: u64 = n.iter().sum();
    let total: u64 = ns.iter().sum();
    print!(
        "{path}: {events} calls, caches evicted by {mb} MiB: {:.2} us a call;",
        total as f64 / events.max(1) as f64 / 1e3
    );
    for k in (0..KINDS.len()).filter(|k| n[*k] > 0) {
        print!(
            " {} {:.2} ({:.2} allocs)",
            KINDS[k],
            ns[k] as f64 / n[k] as f64 / 1e3,
            al[k] as f64 / n[k] as f64
        );
    }
    // The buffer is read once, so its writes are not optimised away.
    println!(" (us; {})", junk.iter().map(|b| *b as u64).sum::<u64>() % 2);
}
