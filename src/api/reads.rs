//! Ranges of another allocator's memory that expseg is reading right now (an IPC mirror being
//! refreshed from them), and ranges the program is unmapping right now. Unmapping memory while
//! a copy reads it faults the device, and the program's unmaps happen on threads of their own:
//! so a read and an unmap of overlapping ranges never run at once (each waits for the other),
//! and the coalescer, which may unmap pages it moves, waits for every read to end.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

/// (start, size, is an unmap)
static RANGES: Mutex<Vec<(u64, u64, bool)>> = Mutex::new(Vec::new());
static DONE: Condvar = Condvar::new();
/// How many reads are registered: the check on every unmap is one atomic load.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// The registry, even after a panic poisoned its lock: every change to it is one `push` or one
/// `swap_remove`, which no panic can cut in half (unlike the pools' and coalescers' books,
/// `state::books_unsure`), so what a poisoned lock guards is whole.
fn ranges() -> std::sync::MutexGuard<'static, Vec<(u64, u64, bool)>> {
    RANGES.lock().unwrap_or_else(|e| e.into_inner())
}

/// A registered read or unmap; dropping it ends it.
pub struct Reading {
    range: (u64, u64, bool),
}

fn overlaps(a: (u64, u64, bool), va: u64, size: u64) -> bool {
    a.0 < va.saturating_add(size) && va < a.0.saturating_add(a.1)
}

/// Register a range once no entry of the other kind overlaps it.
fn register(va: u64, size: u64, unmap: bool) -> Reading {
    let mut r = ranges();
    while r.iter().any(|x| x.2 != unmap && overlaps(*x, va, size)) {
        r = DONE.wait(r).unwrap_or_else(|e| e.into_inner());
    }
    r.push((va, size, unmap));
    if !unmap {
        ACTIVE.fetch_add(1, Ordering::AcqRel);
    }
    Reading {
        range: (va, size, unmap),
    }
}

/// Register a read of `[base, base+size)` (waiting for overlapping unmaps in progress). The
/// caller checks afterwards that the range is still mapped (an unmap may have just finished).
pub fn begin(base: u64, size: u64) -> Reading {
    register(base, size, false)
}

/// Register an unmap of `[va, va+size)` by the program, waiting for overlapping reads; drop
/// the guard once the driver has unmapped.
pub fn begin_unmap(va: u64, size: u64) -> Reading {
    register(va, size, true)
}

impl Drop for Reading {
    fn drop(&mut self) {
        let mut r = ranges();
        if let Some(i) = r.iter().position(|x| *x == self.range) {
            r.swap_remove(i);
        }
        if !self.range.2 {
            ACTIVE.fetch_sub(1, Ordering::AcqRel);
        }
        DONE.notify_all();
    }
}

/// Whether any read is registered (one atomic load: the check on hot paths).
pub fn active() -> bool {
    ACTIVE.load(Ordering::Acquire) > 0
}

/// Wait until no read is registered at all.
pub fn wait_none() {
    if ACTIVE.load(Ordering::Acquire) == 0 {
        return;
    }
    let mut r = ranges();
    while r.iter().any(|x| !x.2) {
        r = DONE.wait(r).unwrap_or_else(|e| e.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn reads_and_unmaps_of_overlapping_ranges_exclude_each_other() {
        let g = begin(0x1000_0000, 0x20_0000);
        let t = Instant::now();
        drop(begin_unmap(0x2000_0000, 0x1000)); // elsewhere: at once
        drop(begin(0x1000_0000, 0x1000)); // reads share
        assert!(t.elapsed() < Duration::from_millis(50));
        let waiter = std::thread::spawn(|| {
            let t = Instant::now();
            let u = begin_unmap(0x1010_0000, 0x1000);
            (t.elapsed(), u)
        });
        std::thread::sleep(Duration::from_millis(100));
        drop(g);
        let (waited, u) = waiter.join().unwrap();
        assert!(waited >= Duration::from_millis(90));
        // And a read waits for the unmap in progress.
        let reader = std::thread::spawn(|| {
            let t = Instant::now();
            drop(begin(0x1010_0000, 0x10));
            t.elapsed()
        });
        std::thread::sleep(Duration::from_millis(100));
        drop(u);
        assert!(reader.join().unwrap() >= Duration::from_millis(90));
        wait_none();
    }
}
