//! The clock the hooks are timed with: the CPU's time-stamp counter on x86-64, read from a
//! register; nanoseconds elsewhere.
//!
//! Every hook call is timed for the exit report (`vmm_*_ns`, and `coalesce_*_ns` around the
//! driver's calls). `Instant::now()` reads the kernel's clock page: warm that costs ~50 ns, but
//! the first read of a hook, after the program's own work between two allocator calls evicted
//! the page and the vDSO's code, cost 975-1,033 cycles against 124 warm (2.6 GHz x86-64, 16 MiB
//! written between reads: `scripts/vmm-cost/clock_cost.c`), and it falls before the timed span, so
//! the report never showed it. `rdtsc` touches no memory. Ticks become nanoseconds only when a
//! report is made ([`ns`]), scaled by the ticks and the `Instant` time elapsed since the library
//! loaded, so the rate needs no calibration loop in the program's process. Seen from the
//! caller with the caches evicted between calls (`scripts/vmm-cost/hook_cold.c`, the preload
//! tests' fake driver, median of 5 runs), with no clock read for parked handles' quiet either
//! ([`crate::coalesce`]) and a hook's two counters on one line ([`crate::stats::Timing`]): a
//! create 2,236 -> 1,716 cycles, a map 1,950 -> 1,586, an unmap 3,458 -> 3,042, a release
//! equal within the runs' spread.

use std::sync::OnceLock;
use std::time::Instant;

/// A reading of both clocks at one moment, taken when the library loads ([`START`]): the
/// baseline [`ns`] scales ticks by.
static ORIGIN: OnceLock<(Instant, u64)> = OnceLock::new();

fn origin() -> (Instant, u64) {
    *ORIGIN.get_or_init(|| (Instant::now(), tsc()))
}

extern "C" fn take_origin() {
    // `Instant::now()` panics where the kernel refuses the monotonic clock (a seccomp filter),
    // and a panic's message is printed even when it is caught: ask the kernel first, and where
    // it refuses take nothing now (a later `origin()` takes it, inside a hook's boundary). A
    // panic must not leave a load-time constructor.
    if monotonic_clock_works() {
        let _ = std::panic::catch_unwind(origin);
    }
}

/// Whether the kernel answers `clock_gettime(CLOCK_MONOTONIC)`, as `Instant::now()` asks it.
#[allow(unsafe_code)]
fn monotonic_clock_works() -> bool {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) == 0 }
}

/// Taken at load, so that a hook's reading touches no memory at all (not even a flag).
#[allow(unsafe_code)] // a load-time constructor: the loader calls it once, before any hook
#[used]
#[link_section = ".init_array"]
static START: extern "C" fn() = take_origin;

/// Now, in ticks. Only differences of two readings mean anything; [`ns`] turns a sum of them
/// into nanoseconds.
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn ticks() -> u64 {
    tsc()
}

/// Now, in ticks: nanoseconds since the first reading where there is no TSC to read.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub fn ticks() -> u64 {
    u64::try_from(origin().0.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Ticks since `start` (a [`ticks`] reading), 0 if the clock seems to have gone back (a thread
/// moved to a core whose counter lags).
#[inline]
pub fn since(start: u64) -> u64 {
    ticks().saturating_sub(start)
}

/// `t` ticks in nanoseconds, at the TSC's mean rate since the library loaded. Where CPUID does
/// not call the TSC invariant (some virtual machines do not say so of one that is) the rate may
/// have varied with the core's frequency and the figure is that mean: for the report only.
pub fn ns(t: u64) -> u64 {
    if cfg!(not(target_arch = "x86_64")) {
        return t;
    }
    let (at, tsc0) = origin();
    let elapsed = at.elapsed().as_nanos();
    let counted = u128::from(tsc().saturating_sub(tsc0));
    if counted == 0 {
        return t;
    }
    u64::try_from(u128::from(t) * elapsed / counted).unwrap_or(u64::MAX)
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn tsc() -> u64 {
    // SAFETY: `rdtsc` reads a register; every x86-64 CPU has it.
    #[allow(unsafe_code)]
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn tsc() -> u64 {
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_become_the_nanoseconds_that_passed() {
        let t0 = ticks();
        let wall = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let spent = ns(since(t0));
        let real = wall.elapsed().as_nanos() as u64;
        // The rate is read over the whole time since the first reading, this sleep included.
        assert!(
            spent >= real * 9 / 10 && spent <= real * 11 / 10 + 1_000_000,
            "{spent} ns counted, {real} ns passed"
        );
    }

    #[test]
    fn readings_never_go_back_by_more_than_nothing() {
        let a = ticks();
        let b = ticks();
        assert!(b >= a);
        assert_eq!(since(u64::MAX), 0);
    }
}
