//! The program's runs of another allocator's pages (PyTorch's, vLLM's) as the driver would
//! show them without expseg: one mapping a page, whatever handles lie behind coalesced pages;
//! and a registered read of one that is still mapped.

use super::shares::MAX_RUN;
use crate::gpu::cuda;

/// The program's run of mappings from the one containing `ptr`: its start, the mappings'
/// sizes and the device, as the driver would answer without expseg (coalesced pages one
/// mapping each, whatever handles lie behind them). None: no VMM mapping at `ptr`.
pub(super) fn run_of(t: &crate::real::DriverTable, ptr: u64) -> Option<(u64, Vec<u64>, i32)> {
    crate::api::vmm::program_run(ptr, MAX_RUN).or_else(|| cuda::run_from(t, ptr, MAX_RUN))
}

/// A registered read of `[base, base+size)` (the program's unmaps there wait for it), if that
/// range is still mapped by the program from `base` on, back to back; None: unmapped or
/// parked meanwhile.
pub(super) fn read_run(
    t: &crate::real::DriverTable,
    base: u64,
    size: u64,
) -> Option<crate::api::reads::Reading> {
    let (reading, run) = crate::api::vmm::begin_read_run(base, size, MAX_RUN)?;
    let (start, sizes) = match run {
        Some(r) => r,
        None => cuda::run_from(t, base, MAX_RUN).map(|(b, s, _)| (b, s))?,
    };
    (start == base && sizes.iter().sum::<u64>() >= size).then_some(reading)
}
