//! The coalescer against the fake driver: PyTorch's page pattern, partial release and
//! compaction (data checked granule by granule), its faults, exact out-of-memory answers,
//! export, and randomized sequences with exact accounting.

mod allocs;
mod api;
mod compact;
mod cuts;
mod inflight;
mod plan;
mod randomized;
mod reuse;
mod sleep;
mod still;

pub(super) use super::*;
pub(super) use crate::gpu::fake::FakeDriver;
pub(super) use crate::gpu::{DrvError, Op};
pub(super) use std::collections::BTreeMap;

pub(super) const G: u64 = 1 << 21; // granularity
pub(super) const PAGE: u64 = 10 * G; // a 20 MiB page
pub(super) const RW: u32 = 3;
pub(super) const PROPS: PageProps = PageProps {
    shareable: true,
    rdma: false,
    tag: 0,
};

/// The seeds of a randomized test: `1..=base`, times `EXPSEG_TEST_SOAK` (default 1) for a longer
/// search (`EXPSEG_TEST_SOAK=200 cargo test --release --lib randomized`). What a test asserts
/// its seeds reach (coverage, not correctness) holds for the first `base` only.
pub(super) fn seeds(base: u64) -> std::ops::RangeInclusive<u64> {
    let soak = std::env::var("EXPSEG_TEST_SOAK")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(1)
        .max(1);
    1..=base.saturating_mul(soak)
}

pub(super) fn setup(capacity: u64, cfg: CoalesceConfig) -> (Coalescer<FakeDriver>, u64) {
    let mut c = Coalescer::new(FakeDriver::new(0, G, capacity), cfg);
    let va = c.driver_mut().reserve(4000 * PAGE).unwrap();
    c.reserved(va, 4000 * PAGE);
    (c, va)
}

pub(super) fn cfg() -> CoalesceConfig {
    CoalesceConfig {
        max_handle: 64 * PAGE,
        strand_max: 0,
        margin: 4 * PAGE,
        release_delay: std::time::Duration::ZERO,
        ahead: 0,
        peer_hold: crate::config::PeerHold::Off,
        move_live: true,
        split_tail: false,
        learn_cuts: false,
        keep_giveback_us: 0,
    }
}

/// The defaults' rule: no page the program has mapped ever moves (`EXPSEG_COMPACT` off).
pub(super) fn still() -> CoalesceConfig {
    CoalesceConfig {
        move_live: false,
        ..cfg()
    }
}

/// PyTorch's `map()`: create each page, map each back to back, set access over the range.
pub(super) fn grow(c: &mut Coalescer<FakeDriver>, at: u64, n: u64) -> DrvResult<Vec<u64>> {
    grow_props(c, at, n, PROPS)
}

/// `grow` with pages of `props` (a tag).
pub(super) fn grow_props(
    c: &mut Coalescer<FakeDriver>,
    at: u64,
    n: u64,
    props: PageProps,
) -> DrvResult<Vec<u64>> {
    let mut hs = Vec::new();
    for _ in 0..n {
        match c.create(PAGE, props) {
            Ok(h) => hs.push(h),
            Err(e) => {
                for h in hs {
                    c.release(h).unwrap();
                }
                return Err(e);
            }
        }
    }
    for (i, h) in hs.iter().enumerate() {
        c.map(at + i as u64 * PAGE, PAGE, 0, *h)?;
    }
    match c.set_access(at, n * PAGE, &[(0, RW)]) {
        Ok(ours) => assert!(ours),
        Err(e) => {
            // A program that goes on after a failed access call gives its pages back (a
            // paused handle under them could not resume: out of memory).
            shrink(c, at, &hs);
            return Err(e);
        }
    }
    Ok(hs)
}

/// PyTorch's `unmapHandles()`: per page, unmap then release.
pub(super) fn shrink(c: &mut Coalescer<FakeDriver>, at: u64, hs: &[u64]) {
    for (i, h) in hs.iter().enumerate() {
        assert!(c.unmap(at + i as u64 * PAGE, PAGE).unwrap());
        c.release(*h).unwrap();
    }
}

pub(super) fn tag(va: u64) -> u64 {
    va ^ 0x5a5a
}

pub(super) fn fill(c: &mut Coalescer<FakeDriver>, at: u64, n: u64) {
    for i in 0..n * PAGE / G {
        let a = at + i * G;
        assert!(c.driver_mut().write(a, G, tag(a)));
    }
}

pub(super) fn intact(c: &Coalescer<FakeDriver>, at: u64, n: u64) -> bool {
    (0..n * PAGE / G).all(|i| {
        let a = at + i * G;
        c.driver().read(a) == Some(tag(a)) && c.driver().is_accessible(a, G, 0)
    })
}

/// Growing ahead: up to `n` pages, whatever the coalescer has held so far.
pub(super) fn ahead(n: u64) -> CoalesceConfig {
    let mut k = cfg();
    k.ahead = n * PAGE;
    k
}

pub(super) fn delayed() -> CoalesceConfig {
    let mut k = cfg();
    k.release_delay = std::time::Duration::from_secs(3600);
    k
}

/// Kept handles go back; then nothing may be held or mapped.
pub(super) fn all_given_back(c: &mut Coalescer<FakeDriver>) {
    c.release_kept();
    assert_eq!(c.driver().used(), 0);
    assert_eq!(c.driver().mapping_count(), 0);
}

pub(super) fn meminfo_calls(c: &Coalescer<FakeDriver>) -> u64 {
    c.driver_calls()[Op::ALL.len()].0
}
