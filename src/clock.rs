//! The clock the hooks are timed with: the CPU's time-stamp counter where it ticks at a constant
//! rate (x86-64 with an invariant TSC), read from a register; nanoseconds elsewhere.
//!
//! Every hook call is timed for the exit report (`vmm_*_ns`, and `coalesce_*_ns` around the
//! driver's calls). `Instant::now()` reads the kernel's clock page: warm that costs ~50 ns, but
//! the first read of a hook, after the program's own work between two allocator calls evicted
//! the page and the vDSO's code, cost 975-1,033 cycles against 124 warm (2.6 GHz x86-64, 16 MiB
//! written between reads: `scripts/vmm-cost/clock_cost.c`), and it falls before the timed span, so
//! the report never showed it. `rdtsc` touches no memory. Ticks become nanoseconds only when a
//! report is made ([`ns`]), scaled by the ticks and the `Instant` time elapsed since the first
//! reading, so the rate needs no calibration loop in the program's process. Seen from the
//! caller with the caches evicted between calls (`scripts/vmm-cost/hook_cold.c`, the preload
//! tests' fake driver), a create or map hook costs 1,590-1,770 cycles against 1,850-2,390 with
//! `Instant` (and no clock read for parked handles' quiet, [`crate::coalesce`]), an unmap or a
//! release 5-10 % less.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// How [`ticks`] reads: not yet decided, the TSC, or nanoseconds since [`ORIGIN`].
const UNSET: u8 = 0;
const TSC: u8 = 1;
const NANOS: u8 = 2;
static MODE: AtomicU8 = AtomicU8::new(UNSET);

/// The first reading: the `Instant` and the TSC (0 where it is not used) at the same moment.
static ORIGIN: OnceLock<(Instant, u64)> = OnceLock::new();

/// Now, in ticks. Only differences of two readings mean anything; [`ns`] turns a sum of them
/// into nanoseconds.
#[inline]
pub fn ticks() -> u64 {
    match MODE.load(Ordering::Relaxed) {
        TSC => tsc(),
        NANOS => since_origin(),
        _ => {
            let tsc_ok = invariant_tsc();
            ORIGIN.get_or_init(|| (Instant::now(), if tsc_ok { tsc() } else { 0 }));
            MODE.store(if tsc_ok { TSC } else { NANOS }, Ordering::Relaxed);
            ticks()
        }
    }
}

/// Ticks since `start` (a [`ticks`] reading), 0 if the clock seems to have gone back (a thread
/// moved to a core whose counter lags).
#[inline]
pub fn since(start: u64) -> u64 {
    ticks().saturating_sub(start)
}

/// `t` ticks in nanoseconds, at the rate the TSC ran since the first reading (exact for
/// nanosecond ticks).
pub fn ns(t: u64) -> u64 {
    match (MODE.load(Ordering::Relaxed), ORIGIN.get()) {
        (TSC, Some(&(at, tsc0))) => {
            let elapsed = at.elapsed().as_nanos();
            let counted = u128::from(tsc().saturating_sub(tsc0));
            if counted == 0 {
                return t;
            }
            u64::try_from(u128::from(t) * elapsed / counted).unwrap_or(u64::MAX)
        }
        _ => t,
    }
}

fn since_origin() -> u64 {
    let at = ORIGIN.get_or_init(|| (Instant::now(), 0)).0;
    u64::try_from(at.elapsed().as_nanos()).unwrap_or(u64::MAX)
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

/// Whether the TSC ticks at a constant rate whatever the core's frequency and sleep states
/// (CPUID 0x80000007, EDX bit 8), as the kernel's own TSC clock requires.
#[cfg(target_arch = "x86_64")]
fn invariant_tsc() -> bool {
    use core::arch::x86_64::__cpuid;
    // SAFETY: `cpuid` reads identification registers; leaf 0x80000000 says which extended
    // leaves exist before 0x80000007 is asked.
    #[allow(unsafe_code, unused_unsafe)]
    unsafe {
        __cpuid(0x8000_0000).eax >= 0x8000_0007 && (__cpuid(0x8000_0007).edx >> 8) & 1 == 1
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn invariant_tsc() -> bool {
    false
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
