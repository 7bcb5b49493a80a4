//! The coalescer against the fake driver: PyTorch's page pattern, partial release and
//! compaction (data checked granule by granule), its faults, exact out-of-memory answers,
//! export, and randomized sequences with exact accounting.

use super::*;
use crate::gpu::fake::FakeDriver;
use crate::gpu::Op;

const G: u64 = 1 << 21; // granularity
const PAGE: u64 = 10 * G; // a 20 MiB page
const RW: u32 = 3;
const PROPS: PageProps = PageProps {
    shareable: true,
    rdma: false,
};

fn setup(capacity: u64, cfg: CoalesceConfig) -> (Coalescer<FakeDriver>, u64) {
    let mut c = Coalescer::new(FakeDriver::new(0, G, capacity), cfg);
    let va = c.driver_mut().reserve(4000 * PAGE).unwrap();
    c.reserved(va, 4000 * PAGE);
    (c, va)
}

fn cfg() -> CoalesceConfig {
    CoalesceConfig {
        max_handle: 64 * PAGE,
        strand_max: 0,
        margin: 4 * PAGE,
        release_delay: std::time::Duration::ZERO,
    }
}

/// PyTorch's `map()`: create each page, map each back to back, set access over the range.
fn grow(c: &mut Coalescer<FakeDriver>, at: u64, n: u64) -> DrvResult<Vec<u64>> {
    let mut hs = Vec::new();
    for _ in 0..n {
        match c.create(PAGE, PROPS) {
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
    assert!(c.set_access(at, n * PAGE, &[(0, RW)])?);
    Ok(hs)
}

/// PyTorch's `unmapHandles()`: per page, unmap then release.
fn shrink(c: &mut Coalescer<FakeDriver>, at: u64, hs: &[u64]) {
    for (i, h) in hs.iter().enumerate() {
        assert!(c.unmap(at + i as u64 * PAGE, PAGE).unwrap());
        c.release(*h).unwrap();
    }
}

fn tag(va: u64) -> u64 {
    va ^ 0x5a5a
}

fn fill(c: &mut Coalescer<FakeDriver>, at: u64, n: u64) {
    for i in 0..n * PAGE / G {
        let a = at + i * G;
        assert!(c.driver_mut().write(a, G, tag(a)));
    }
}

fn intact(c: &Coalescer<FakeDriver>, at: u64, n: u64) -> bool {
    (0..n * PAGE / G).all(|i| {
        let a = at + i * G;
        c.driver().read(a) == Some(tag(a)) && c.driver().is_accessible(a, G, 0)
    })
}

#[test]
fn a_batch_of_pages_is_one_handle_and_goes_back_whole() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 8).unwrap();
    assert_eq!(c.driver().calls_of(Op::Create), 1);
    assert_eq!(c.driver().calls_of(Op::Map), 1);
    assert_eq!(c.driver().chunk_count(), 1);
    fill(&mut c, va, 8);
    assert!(intact(&c, va, 8));
    shrink(&mut c, va, &hs);
    assert_eq!(c.driver().chunk_count(), 0);
    assert_eq!(c.driver().mapping_count(), 0);
    assert_eq!(c.counts(), (0, 0));
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.stats().compactions, 0);
}

#[test]
fn partial_release_is_compacted_with_data_intact() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 8).unwrap();
    fill(&mut c, va, 8);
    // Pages 2..6 go; 0-1 and 6-7 stay.
    shrink(&mut c, va + 2 * PAGE, &hs[2..6]);
    assert_eq!(c.stranded(), 4 * PAGE);
    assert_eq!(c.driver().used(), 8 * PAGE);
    c.settle(false);
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.driver().used(), 4 * PAGE);
    assert_eq!(c.driver().chunk_count(), 2);
    assert!(intact(&c, va, 2));
    assert!(intact(&c, va + 6 * PAGE, 2));
    // The freed range can be mapped again by a new batch.
    let hs2 = grow(&mut c, va + 2 * PAGE, 4).unwrap();
    fill(&mut c, va + 2 * PAGE, 4);
    assert!(intact(&c, va, 8));
    shrink(&mut c, va, &hs[..2]);
    shrink(&mut c, va + 2 * PAGE, &hs2);
    shrink(&mut c, va + 6 * PAGE, &hs[6..]);
    assert_eq!(c.driver().used(), 0);
    assert_eq!(c.driver().mapping_count(), 0);
}

#[test]
fn a_compaction_waits_for_peer_devices_and_keeps_their_access() {
    // PyTorch gives peers access to its pages (addPeer): their kernels may read the live
    // pages, so they are waited for before the pages move, and keep access after.
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 8).unwrap();
    assert!(c.set_access(va, 8 * PAGE, &[(1, RW)]).unwrap());
    fill(&mut c, va, 8);
    shrink(&mut c, va + 2 * PAGE, &hs[2..6]);
    assert!(c.driver().peers_synced.is_empty());
    c.settle(false);
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.driver().peers_synced, vec![1], "device 1 was waited for");
    for at in [va, va + 6 * PAGE] {
        assert!(c.driver().is_accessible(at, 2 * PAGE, 0));
        assert!(
            c.driver().is_accessible(at, 2 * PAGE, 1),
            "the peer keeps access"
        );
    }
    assert!(intact(&c, va, 2) && intact(&c, va + 6 * PAGE, 2));
    // A peer that cannot be waited for stops the compaction before anything moved.
    let hs2 = grow(&mut c, va + 2 * PAGE, 4).unwrap();
    assert!(c.set_access(va + 2 * PAGE, 4 * PAGE, &[(1, RW)]).unwrap());
    fill(&mut c, va + 2 * PAGE, 4);
    shrink(&mut c, va + 3 * PAGE, &hs2[1..3]);
    let used = c.driver().used();
    c.driver_mut().fail(Op::Sync, DrvError(700));
    c.settle(false);
    assert_eq!(c.driver().used(), used, "nothing moved");
    assert!(intact(&c, va, 3) && intact(&c, va + 5 * PAGE, 3));
}

#[test]
fn mapping_over_a_ghost_compacts_first() {
    let mut k = cfg();
    k.strand_max = u64::MAX; // never on its own
    let (mut c, va) = setup(100 * PAGE, k);
    let hs = grow(&mut c, va, 6).unwrap();
    fill(&mut c, va, 6);
    shrink(&mut c, va + 4 * PAGE, &hs[4..]);
    assert_eq!(c.stranded(), 2 * PAGE);
    let hs2 = grow(&mut c, va + 4 * PAGE, 3).unwrap();
    fill(&mut c, va + 4 * PAGE, 3);
    assert!(intact(&c, va, 7));
    assert_eq!(c.stranded(), 0);
    shrink(&mut c, va, &hs[..4]);
    shrink(&mut c, va + 4 * PAGE, &hs2);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn every_failing_step_of_a_compaction_leaves_data_and_mappings_as_they_were() {
    let ops = [
        Op::Sync,
        Op::Create,
        Op::Reserve,
        Op::Map,
        Op::SetAccess,
        Op::Copy,
        Op::Unmap,
    ];
    let mut tried = 0;
    for op in ops {
        for nth in 0..4 {
            let (mut c, va) = setup(100 * PAGE, cfg());
            let mut k = cfg();
            k.strand_max = u64::MAX;
            c.cfg = k;
            let hs = grow(&mut c, va, 9).unwrap();
            fill(&mut c, va, 9);
            // Live: 0-2 and 6-8, two groups.
            shrink(&mut c, va + 3 * PAGE, &hs[3..6]);
            let before = c.driver().used();
            c.driver_mut().fail_nth(op, nth, DrvError(999));
            c.cfg.strand_max = 0;
            c.settle(false);
            c.driver_mut().clear_failures();
            assert!(intact(&c, va, 3), "{op:?} #{nth}");
            assert!(intact(&c, va + 6 * PAGE, 3), "{op:?} #{nth}");
            if c.stats().compaction_failures > 0 {
                tried += 1;
                assert_eq!(c.driver().used(), before, "{op:?} #{nth}: nothing leaked");
                assert_eq!(c.stranded(), 3 * PAGE);
                // And it succeeds once the driver does.
                c.settle(false);
            }
            assert_eq!(c.stranded(), 0, "{op:?} #{nth}");
            assert_eq!(c.driver().used(), 6 * PAGE, "{op:?} #{nth}");
            assert!(intact(&c, va, 3) && intact(&c, va + 6 * PAGE, 3));
            shrink(&mut c, va, &hs[..3]);
            shrink(&mut c, va + 6 * PAGE, &hs[6..]);
            assert_eq!(c.driver().used(), 0, "{op:?} #{nth}");
            assert_eq!(
                c.driver().reservation_count(),
                1,
                "{op:?} #{nth}: temporaries freed"
            );
        }
    }
    assert!(
        tried >= 12,
        "only {tried} injected failures hit a compaction"
    );
}

#[test]
fn without_room_on_the_device_the_copy_goes_through_the_host() {
    // 10 pages of capacity, 8 in one handle, 4 of them live: no room for a 2-page copy
    // beside the old handle... the device path needs 4 more pages; only 2 are free.
    let mut k = cfg();
    k.margin = 0;
    let (mut c, va) = setup(10 * PAGE, k);
    let hs = grow(&mut c, va, 8).unwrap();
    fill(&mut c, va, 8);
    shrink(&mut c, va + 4 * PAGE, &hs[4..]);
    c.settle(false);
    assert!(c.stats().host_copies >= 1);
    assert!(intact(&c, va, 4));
    assert_eq!(c.driver().used(), 4 * PAGE);
    shrink(&mut c, va, &hs[..4]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_host_copy_whose_old_handle_will_not_go_back_is_undone_with_data_intact() {
    // The host path's new handles are made of the old handle's memory: if cuMemRelease of
    // it fails, the compaction is undone (before anything was lost), and tried again later.
    let mut k = cfg();
    k.margin = 0;
    let (mut c, va) = setup(10 * PAGE, k);
    let hs = grow(&mut c, va, 8).unwrap();
    fill(&mut c, va, 8);
    c.driver_mut().fail(Op::Release, DrvError(999));
    shrink(&mut c, va + 4 * PAGE, &hs[4..]);
    c.settle(true);
    assert_eq!(c.stats().compactions, 0);
    assert!(c.stats().compaction_failures >= 1);
    assert!(intact(&c, va, 4), "restored in place");
    assert_eq!(c.driver().used(), 8 * PAGE);
    c.driver_mut().clear_failures();
    c.settle(true);
    assert_eq!(c.stats().compactions, 1);
    assert!(c.stats().host_copies >= 1);
    assert!(intact(&c, va, 4));
    assert_eq!(c.driver().used(), 4 * PAGE);
    shrink(&mut c, va, &hs[..4]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn create_fails_with_out_of_memory_exactly_when_native_pages_would_not_fit() {
    for margin in [0, 3 * PAGE, 50 * PAGE] {
        let mut k = cfg();
        k.margin = margin;
        let (mut c, va) = setup(10 * PAGE, k);
        // Native: 10 pages fit, the 11th does not.
        let mut hs = Vec::new();
        for i in 0..10 {
            hs.push(
                c.create(PAGE, PROPS)
                    .unwrap_or_else(|e| panic!("page {i}: {e}")),
            );
        }
        assert_eq!(c.create(PAGE, PROPS), Err(DrvError::OUT_OF_MEMORY));
        for (i, h) in hs.iter().enumerate() {
            c.map(va + i as u64 * PAGE, PAGE, 0, *h).unwrap();
        }
        c.set_access(va, 10 * PAGE, &[(0, RW)]).unwrap();
        fill(&mut c, va, 10);
        assert!(intact(&c, va, 10));
        // Freeing part of it makes room again, through compaction, before create fails.
        shrink(&mut c, va + 8 * PAGE, &hs[8..]);
        let mut k2 = c.cfg;
        k2.strand_max = u64::MAX;
        c.cfg = k2;
        let h = c
            .create(PAGE, PROPS)
            .expect("stranded pages are compacted first");
        c.release(h).unwrap();
        shrink(&mut c, va, &hs[..8]);
        assert_eq!(c.driver().used(), 0, "margin {margin}");
    }
}

#[test]
fn pytorch_oom_path_releases_pending_pages() {
    let (mut c, _va) = setup(10 * PAGE, cfg());
    let mut hs = Vec::new();
    for _ in 0..5 {
        hs.push(c.create(PAGE, PROPS).unwrap());
    }
    for h in hs {
        c.release(h).unwrap();
    }
    assert_eq!(c.counts(), (0, 0));
    assert_eq!(c.driver().used(), 0);
    assert_eq!(c.pending_bytes, 0);
}

#[test]
fn an_exported_page_gets_its_own_handle_with_its_data() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va, 4);
    let h1 = c.export(hs[1]).unwrap();
    assert!(!is_virtual(h1));
    assert_eq!(c.driver().chunk_count(), 4);
    assert!(intact(&c, va, 4));
    // Exporting again costs nothing and gives the same handle.
    let creates = c.driver().calls_of(Op::Create);
    assert_eq!(c.export(hs[1]).unwrap(), h1);
    assert_eq!(c.driver().calls_of(Op::Create), creates);
    shrink(&mut c, va, &hs);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn foreign_handles_and_ranges_are_not_ours() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    assert_eq!(c.unmap(va, PAGE), Ok(false));
    assert_eq!(c.set_access(va, PAGE, &[(0, RW)]), Ok(false));
    assert!(!c.owns(12345));
    assert_eq!(c.release(12345), Err(INVALID));
    let h = c.create(PAGE, PROPS).unwrap();
    assert!(is_virtual(h));
    assert_eq!(c.map(va, PAGE, G, h), Err(INVALID), "offset must be 0");
    assert_eq!(c.map(va, 2 * PAGE, 0, h), Err(INVALID), "whole handle only");
    c.map(va, PAGE, 0, h).unwrap();
    assert_eq!(c.unmap(va, PAGE / 2), Err(INVALID));
    assert_eq!(c.range_of(va + 5), Some((va, PAGE)));
    let r = c.retain(va + 5).unwrap().unwrap();
    assert_eq!(r, h);
    c.release(r).unwrap();
    assert!(c.unmap(va, PAGE).unwrap());
    c.release(h).unwrap();
    assert_eq!(c.counts(), (0, 0));
}

/// A tiny deterministic generator (no dependency).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// The randomized tests' program: pages in numbered slots of the reservation, slot -> handle.

/// The lowest run of `n` free slots.
fn free_run(live: &BTreeMap<u64, u64>, n: u64) -> u64 {
    (0..200u64)
        .find(|s| (0..n).all(|i| !live.contains_key(&(s + i))))
        .unwrap()
}

/// A random live slot.
fn pick(rng: &mut Rng, live: &BTreeMap<u64, u64>) -> Option<u64> {
    live.keys()
        .nth(rng.below(live.len().max(1) as u64) as usize)
        .copied()
}

/// Release a random run of up to 4 live slots, PyTorch's way.
fn release_random_run(
    c: &mut Coalescer<FakeDriver>,
    va: u64,
    rng: &mut Rng,
    live: &mut BTreeMap<u64, u64>,
) {
    if let Some(s) = pick(rng, live) {
        let n = 1 + rng.below(4);
        let run: Vec<u64> = (s..s + n).take_while(|x| live.contains_key(x)).collect();
        for x in run {
            let h = live.remove(&x).unwrap();
            shrink(c, va + x * PAGE, &[h]);
        }
    }
}

/// The program maps a handle of its own over two free slots at `at` (over parked handles,
/// if any) and takes it down again.
fn program_maps_its_own(c: &mut Coalescer<FakeDriver>, at: u64) {
    c.clear_for_program(at, 2 * PAGE);
    if let Ok(own) = c.driver_mut().create(2 * PAGE) {
        c.driver_mut().map(at, 2 * PAGE, own).unwrap();
        c.driver_mut().unmap(at, 2 * PAGE).unwrap();
        c.driver_mut().release(own).unwrap();
    }
}

#[test]
fn randomized_batches_partial_releases_and_faults_keep_data_and_books_exact() {
    for seed in 1..=12u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut k = cfg();
        k.strand_max = [0, 3 * PAGE, u64::MAX][seed as usize % 3];
        k.max_handle = [4, 16, 64][seed as usize % 3] * PAGE;
        if seed % 2 == 0 {
            k.release_delay = std::time::Duration::from_secs(3600);
        }
        let (mut c, va) = setup(60 * PAGE, k);
        // slot index -> live page handle
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        for step in 0..300 {
            let opn = rng.below(10);
            match opn {
                0..=3 => {
                    // Grow: a batch at the lowest free run of slots.
                    let n = 1 + rng.below(6);
                    let start = free_run(&live, n);
                    let at = va + start * PAGE;
                    match grow(&mut c, at, n) {
                        Ok(hs) => {
                            fill(&mut c, at, n);
                            for (i, h) in hs.into_iter().enumerate() {
                                live.insert(start + i as u64, h);
                            }
                        }
                        Err(e) => assert!(e.is_oom(), "seed {seed} step {step}: {e}"),
                    }
                }
                4..=6 => release_random_run(&mut c, va, &mut rng, &mut live),
                7 => {
                    // A fault somewhere in the next compaction.
                    let op =
                        [Op::Create, Op::Map, Op::Copy, Op::Unmap, Op::Sync][rng.below(5) as usize];
                    c.driver_mut()
                        .fail_nth(op, rng.below(3) as usize, DrvError(999));
                    c.settle(true);
                    c.driver_mut().clear_failures();
                }
                8 => c.settle(false),
                _ => match rng.below(4) {
                    0 | 1 => {
                        if let Some(s) = pick(&mut rng, &live) {
                            c.export(live[&s]).unwrap();
                        }
                    }
                    2 => {
                        // cudaIpcGetMemHandle on a live page: its run is split page by
                        // page, and nothing parked may stay in the driver's mappings.
                        if let Some(s) = pick(&mut rng, &live) {
                            c.isolate_run(va + s * PAGE + 5).unwrap();
                            assert!(!c.parked_in_range(va, 200 * PAGE));
                        }
                    }
                    _ => program_maps_its_own(&mut c, va + free_run(&live, 2) * PAGE),
                },
            }
            for &s in live.keys() {
                assert!(
                    intact(&c, va + s * PAGE, 1),
                    "seed {seed} step {step} slot {s}"
                );
            }
            assert_eq!(
                c.driver().used(),
                c.physical_bytes(),
                "seed {seed} step {step}"
            );
            let live_bytes = live.len() as u64 * PAGE;
            assert_eq!(
                c.physical_bytes(),
                live_bytes + c.stranded() + c.kept_bytes(),
                "seed {seed} step {step}: every byte is live, stranded or kept"
            );
            if rng.below(20) == 0 {
                c.release_kept();
            }
            // Stranded bytes are bounded at every settle (the start of the next call).
            c.settle(false);
            if c.stats().compaction_failures == 0 {
                assert!(c.stranded() <= k.strand_max, "seed {seed} step {step}");
            }
        }
        let rest: Vec<(u64, u64)> = live.into_iter().collect();
        for (s, h) in rest {
            shrink(&mut c, va + s * PAGE, &[h]);
        }
        c.settle(true);
        if seed % 2 == 0 {
            assert!(
                c.stats().reused_in_place > 0,
                "seed {seed}: handles taken back in place"
            );
        }
        c.release_kept();
        assert_eq!(c.driver().used(), 0, "seed {seed}: nothing leaked");
        assert_eq!(c.driver().mapping_count(), 0, "seed {seed}");
        assert_eq!(c.counts(), (0, 0), "seed {seed}");
        assert_eq!(c.driver().reservation_count(), 1, "seed {seed}");
    }
}

#[test]
fn memory_shared_with_another_process_is_split_per_page_and_never_moves() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let a = grow(&mut c, va, 4).unwrap();
    let b = grow(&mut c, va + 4 * PAGE, 3).unwrap();
    fill(&mut c, va, 7);
    c.isolate_run(va + PAGE + 7).unwrap();
    assert_eq!(
        c.driver().chunk_count(),
        7,
        "both batches of the run, page by page"
    );
    assert!(intact(&c, va, 7));
    let creates = c.driver().calls_of(Op::Create);
    shrink(&mut c, va + PAGE, &a[1..3]);
    c.settle(true);
    assert_eq!(c.driver().calls_of(Op::Create), creates, "no page moved");
    assert_eq!(c.stranded(), 0);
    assert!(intact(&c, va, 1) && intact(&c, va + 3 * PAGE, 4));
    shrink(&mut c, va, &a[..1]);
    shrink(&mut c, va + 3 * PAGE, &a[3..]);
    shrink(&mut c, va + 4 * PAGE, &b);
    assert_eq!(c.driver().used(), 0);
}

/// Not a test: the coalescer's own cost per page of PyTorch's pattern (fake driver), printed.
#[test]
#[ignore]
fn bookkeeping_cost_per_page() {
    let (mut c, va) = setup(1 << 44, cfg());
    let t = std::time::Instant::now();
    let mut pages = 0;
    for _ in 0..20 {
        let mut at = 0;
        let mut batches = Vec::new();
        for k in 0..150u64 {
            let n = 3 + k % 28;
            batches.push((at, grow(&mut c, va + at * PAGE, n).unwrap()));
            at += n;
            pages += n;
        }
        for (a, hs) in batches {
            shrink(&mut c, va + a * PAGE, &hs);
        }
    }
    eprintln!(
        "{:.2} us per page",
        t.elapsed().as_secs_f64() * 1e6 / pages as f64
    );
}

#[test]
fn released_handles_are_reused_for_the_next_pages_and_given_back_on_demand() {
    let mut k = cfg();
    k.release_delay = std::time::Duration::from_secs(3600);
    let (mut c, va) = setup(20 * PAGE, k);
    let a = grow(&mut c, va, 4).unwrap();
    let b = grow(&mut c, va + 4 * PAGE, 4).unwrap();
    shrink(&mut c, va, &a);
    shrink(&mut c, va + 4 * PAGE, &b);
    assert_eq!(c.kept_bytes(), 8 * PAGE);
    assert_eq!(c.driver().used(), 8 * PAGE, "kept, not released");
    let creates = c.driver().calls_of(Op::Create);
    let d = grow(&mut c, va + 2 * PAGE, 9).unwrap();
    assert_eq!(
        c.driver().calls_of(Op::Create),
        creates + 1,
        "8 pages from the kept handles, 1 new"
    );
    assert_eq!(c.stats().reused_bytes, 8 * PAGE);
    fill(&mut c, va + 2 * PAGE, 9);
    assert!(intact(&c, va + 2 * PAGE, 9));
    // A create that needs more than the driver has gets the kept memory back first.
    shrink(&mut c, va + 2 * PAGE, &d);
    assert_eq!(c.kept_bytes(), 9 * PAGE);
    let e = grow(&mut c, va, 17).unwrap();
    fill(&mut c, va, 17);
    assert!(intact(&c, va, 17));
    shrink(&mut c, va, &e);
    c.release_kept();
    assert_eq!(c.driver().used(), 0);
    assert_eq!(c.kept_bytes(), 0);
}

#[test]
fn handles_of_two_devices_never_collide() {
    let (mut a, _) = setup(100 * PAGE, cfg());
    let mut b = Coalescer::new(FakeDriver::new(1, G, 100 * PAGE), cfg());
    let ha: Vec<u64> = (0..5).map(|_| a.create(PAGE, PROPS).unwrap()).collect();
    let hb: Vec<u64> = (0..5).map(|_| b.create(PAGE, PROPS).unwrap()).collect();
    for h in &hb {
        assert!(!a.owns(*h), "device 0 must not own device 1's page");
        assert!(b.owns(*h));
    }
    for h in ha {
        a.release(h).unwrap();
    }
    for h in hb {
        b.release(h).unwrap();
    }
}

#[test]
fn pages_released_before_they_were_mapped_never_cover_new_pages() {
    // Near the limit the pages are created as one handle at once; PyTorch's out-of-memory path
    // releases some before anything is mapped, and new pages take their addresses.
    let mut k = cfg();
    k.margin = 1 << 50; // always the exact path
    let (mut c, va) = setup(100 * PAGE, k);
    let hs: Vec<u64> = (0..4).map(|_| c.create(PAGE, PROPS).unwrap()).collect();
    // Pages 2 and 3 go back unmapped; 0 and 1 are mapped and used.
    c.release(hs[2]).unwrap();
    c.release(hs[3]).unwrap();
    c.map(va, PAGE, 0, hs[0]).unwrap();
    c.map(va + PAGE, PAGE, 0, hs[1]).unwrap();
    assert!(c.set_access(va, 2 * PAGE, &[(0, RW)]).unwrap());
    fill(&mut c, va, 2);
    let more = grow(&mut c, va + 2 * PAGE, 2).unwrap();
    fill(&mut c, va + 2 * PAGE, 2);
    assert!(intact(&c, va, 4));
    assert_eq!(c.stranded(), 0);
    shrink(&mut c, va, &hs[..2]);
    shrink(&mut c, va + 2 * PAGE, &more);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn without_the_drivers_free_memory_pages_are_created_at_once_and_still_coalesced_by_batch() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    // A driver that cannot say how much is free: margin can never be checked.
    c.cfg.margin = u64::MAX / 4;
    let hs = grow(&mut c, va, 3).unwrap();
    fill(&mut c, va, 3);
    assert!(intact(&c, va, 3));
    assert!(c.stats().exact_creates >= 1);
    shrink(&mut c, va, &hs);
    assert_eq!(c.driver().used(), 0);
}

fn delayed() -> CoalesceConfig {
    let mut k = cfg();
    k.release_delay = std::time::Duration::from_secs(3600);
    k
}

/// Kept handles go back; then nothing may be held or mapped.
fn all_given_back(c: &mut Coalescer<FakeDriver>) {
    c.release_kept();
    assert_eq!(c.driver().used(), 0);
    assert_eq!(c.driver().mapping_count(), 0);
}

fn meminfo_calls(c: &Coalescer<FakeDriver>) -> u64 {
    c.driver_calls()[Op::ALL.len()].0
}

#[test]
fn a_released_batch_mapped_again_in_place_costs_no_driver_call() {
    let mut k = delayed();
    k.margin = 0; // kept handles cover the whole batch
    let (mut c, va) = setup(100 * PAGE, k);
    let hs = grow(&mut c, va, 4).unwrap();
    let more = grow(&mut c, va + 4 * PAGE, 3).unwrap();
    shrink(&mut c, va, &hs);
    shrink(&mut c, va + 4 * PAGE, &more);
    // Parked: still mapped (and held) where the pages were.
    assert_eq!(c.kept_bytes(), 7 * PAGE);
    assert_eq!(c.driver().mapping_count(), 2);
    assert_eq!(c.counts(), (0, 0));
    let before = c.driver().total_calls();
    let infos = meminfo_calls(&c);
    // The next step maps 7 pages over both places as one batch.
    let again = grow(&mut c, va, 7).unwrap();
    assert_eq!(
        c.driver().total_calls(),
        before,
        "no create, map, access or unmap"
    );
    assert_eq!(meminfo_calls(&c), infos, "kept handles covered the batch");
    assert_eq!(c.stats().reused_in_place, 7 * PAGE);
    assert_eq!(c.stats().access_skipped, 1);
    fill(&mut c, va, 7);
    assert!(intact(&c, va, 7));
    assert_eq!(c.driver().used(), c.physical_bytes());
    // Access for another device is still asked of the driver.
    assert!(c.set_access(va, 7 * PAGE, &[(1, RW)]).unwrap());
    assert!(c.driver().is_accessible(va, 7 * PAGE, 1));
    shrink(&mut c, va, &again);
    all_given_back(&mut c);
}

#[test]
fn pages_over_part_of_a_parked_handle_move_it_first() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 4).unwrap();
    shrink(&mut c, va, &hs);
    // Two pages in the middle of the parked handle: it cannot serve them where it is.
    let mid = grow(&mut c, va + PAGE, 2).unwrap();
    fill(&mut c, va + PAGE, 2);
    assert!(intact(&c, va + PAGE, 2));
    assert_eq!(c.driver().mapping_count(), 1, "the parked handle left");
    assert_eq!(c.driver().used(), c.physical_bytes());
    // A longer batch over a parked handle and beyond: taken back in place only when the
    // pieces around it cost no more than the whole batch would (here two new handles against
    // one: the parked handle moves and serves the batch's first four pages).
    let hs = grow(&mut c, va + 8 * PAGE, 4).unwrap();
    shrink(&mut c, va + 8 * PAGE, &hs);
    let creates = c.driver().calls_of(Op::Create);
    let wide = grow(&mut c, va + 7 * PAGE, 6).unwrap();
    assert_eq!(c.driver().calls_of(Op::Create), creates + 1);
    assert_eq!(c.stats().reused_in_place, 0);
    fill(&mut c, va + 7 * PAGE, 6);
    shrink(&mut c, va + 7 * PAGE, &wide);
    c.release_kept();
    // With one-page handles kept for the ends, the middle is taken back in place.
    let ends: Vec<Vec<u64>> = [20, 22]
        .iter()
        .map(|i| grow(&mut c, va + i * PAGE, 1).unwrap())
        .collect();
    let hs = grow(&mut c, va + 8 * PAGE, 4).unwrap();
    shrink(&mut c, va + 20 * PAGE, &ends[0]);
    shrink(&mut c, va + 22 * PAGE, &ends[1]);
    shrink(&mut c, va + 8 * PAGE, &hs);
    let creates = c.driver().calls_of(Op::Create);
    let wide = grow(&mut c, va + 7 * PAGE, 6).unwrap();
    assert_eq!(c.driver().calls_of(Op::Create), creates, "no new handle");
    assert_eq!(c.stats().reused_in_place, 4 * PAGE);
    fill(&mut c, va + 7 * PAGE, 6);
    assert!(intact(&c, va + PAGE, 2) && intact(&c, va + 7 * PAGE, 6));
    shrink(&mut c, va + PAGE, &mid);
    shrink(&mut c, va + 7 * PAGE, &wide);
    all_given_back(&mut c);
}

#[test]
fn a_parked_handle_is_not_the_programs_mapping() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 4).unwrap();
    shrink(&mut c, va, &hs);
    // The program unmapped it: unmapping or setting access there again fails as natively,
    // and is not passed to the driver (which would unmap expseg's handle).
    assert!(c.maps_in(va + PAGE, PAGE));
    assert_eq!(c.unmap(va, PAGE), Err(INVALID));
    assert_eq!(c.set_access(va, PAGE, &[(0, RW)]), Err(INVALID));
    // The program maps a handle of its own there: the parked handle moves out first.
    c.clear_for_program(va + 2 * PAGE, PAGE);
    let own = c.driver_mut().create(PAGE).unwrap();
    c.driver_mut().map(va + 2 * PAGE, PAGE, own).unwrap();
    assert_eq!(c.kept_bytes(), 4 * PAGE, "still kept, unmapped");
    c.driver_mut().unmap(va + 2 * PAGE, PAGE).unwrap();
    c.driver_mut().release(own).unwrap();
    // Parked again, then the reservation goes: nothing of ours may stay mapped in it.
    let hs = grow(&mut c, va, 4).unwrap();
    shrink(&mut c, va, &hs);
    assert_eq!(c.driver().mapping_count(), 1);
    c.address_free(va, 4000 * PAGE).unwrap();
    assert_eq!(c.driver().mapping_count(), 0);
    c.driver_mut().free_va(va, 4000 * PAGE).unwrap();
    c.release_kept();
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn shared_pages_are_never_kept_for_new_pages() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 3).unwrap();
    let other = grow(&mut c, va + 3 * PAGE, 2).unwrap();
    c.export(hs[1]).unwrap();
    shrink(&mut c, va, &hs);
    shrink(&mut c, va + 3 * PAGE, &other);
    // Another process may still map the exported batch's pages (split page by page): their
    // handles went back to the driver (which keeps the memory for an importer), not into the
    // kept handles; the other batch is kept.
    assert_eq!(c.kept_bytes(), 2 * PAGE);
    assert_eq!(c.driver().used(), 2 * PAGE);
    all_given_back(&mut c);
}

#[test]
fn a_failing_unmap_of_a_parked_handle_keeps_it() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 4).unwrap();
    shrink(&mut c, va, &hs);
    c.driver_mut().fail_nth(Op::Unmap, 0, DrvError(999));
    c.release_kept();
    c.driver_mut().clear_failures();
    assert_eq!(c.kept_bytes(), 4 * PAGE, "kept, to be tried again");
    assert_eq!(c.driver().used(), c.physical_bytes());
    c.release_kept();
    assert_eq!(c.kept_bytes(), 0);
    assert_eq!(c.driver().used(), 0);
    assert_eq!(c.driver().mapping_count(), 0);
}

#[test]
fn sharing_a_run_takes_parked_handles_off_its_addresses() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let live = grow(&mut c, va, 2).unwrap();
    let after = grow(&mut c, va + 2 * PAGE, 3).unwrap();
    shrink(&mut c, va + 2 * PAGE, &after);
    assert_eq!(
        c.driver().mapping_count(),
        2,
        "the released batch is parked after the live one"
    );
    // cudaIpcGetMemHandle walks the driver's back-to-back mappings from the tensor's: they
    // must end where the program's pages end.
    c.isolate_run(va).unwrap();
    assert_eq!(
        c.driver().mapping_count(),
        2,
        "the live batch, page by page"
    );
    assert!(!c.maps_in(va + 2 * PAGE, 3 * PAGE));
    assert_eq!(c.kept_bytes(), 3 * PAGE, "still kept, unmapped");
    shrink(&mut c, va, &live);
    c.release_kept();
    assert_eq!(c.driver().used(), 0);
}

// ---- edge cases found in review: answers as native, books that match the driver ---------

#[test]
fn exporting_a_page_without_memory_counts_its_pending_bytes_once() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let a = c.create(PAGE, PROPS).unwrap();
    let b = c.create(PAGE, PROPS).unwrap();
    assert_eq!(c.pending_bytes, 2 * PAGE);
    // Exported before any access was set: the page gets a handle of its own.
    c.export(a).unwrap();
    assert_eq!(c.pending_bytes, PAGE, "only b is pending now");
    c.map(va, PAGE, 0, b).unwrap();
    c.release(a).unwrap();
    c.release(b).unwrap();
    assert_eq!(c.pending_bytes, 0);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_compaction_whose_restore_fails_leaves_books_that_say_unmapped() {
    // The new mapping fails, and mapping the old handle back fails too: the books must not
    // say it is mapped, and the next access call maps it again, data intact.
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va, 4);
    shrink(&mut c, va + 2 * PAGE, &hs[2..]);
    // maps: #0 the copy's temporary target, #1 the new handle in place, then the restore.
    c.driver_mut().fail_nth(Op::Map, 1, DrvError(999));
    c.driver_mut().fail(Op::Map, DrvError(999));
    c.settle(true);
    c.driver_mut().clear_failures();
    assert_eq!(c.stats().compaction_failures, 1);
    assert!(
        !c.driver().is_accessible(va, 2 * PAGE, 0),
        "the restore failed"
    );
    assert!(c.set_access(va, 2 * PAGE, &[(0, RW)]).unwrap());
    assert!(intact(&c, va, 2), "mapped again with its data");
    // Done with the pages; the same place mapped again gets memory.
    shrink(&mut c, va, &hs[..2]);
    let again = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va, 4);
    assert!(intact(&c, va, 4));
    shrink(&mut c, va, &again);
    all_given_back(&mut c);
}

#[test]
fn unmapping_pages_twice_is_refused_and_never_reaches_our_mapping() {
    // Parking leaves a handle mapped after its pages are unmapped (they are released next).
    // A second cuMemUnmap of the range is the program's mistake: INVALID, as natively, and
    // the driver must not take our mapping down behind the books.
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 2).unwrap();
    assert!(c.unmap(va, 2 * PAGE).unwrap());
    assert!(c.maps_in(va, 2 * PAGE), "ours: not passed through");
    assert_eq!(c.unmap(va, 2 * PAGE), Err(INVALID));
    assert_eq!(c.unmap(va + PAGE, PAGE), Err(INVALID));
    assert_eq!(c.set_access(va, PAGE, &[(0, RW)]), Err(INVALID));
    assert_eq!(
        c.retain(va + 5),
        Err(INVALID),
        "our real handle is not the program's"
    );
    c.release(hs[0]).unwrap();
    c.release(hs[1]).unwrap();
    assert_eq!(c.retain(va + 5), Err(INVALID), "parked");
    assert_eq!(
        c.retain(va + 4 * PAGE),
        Ok(None),
        "nothing of ours: pass through"
    );
    let again = grow(&mut c, va, 2).unwrap();
    fill(&mut c, va, 2);
    assert!(intact(&c, va, 2), "pages taken back in place have memory");
    shrink(&mut c, va, &again);
    all_given_back(&mut c);
}

#[test]
fn releasing_a_page_twice_is_refused() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 1).unwrap();
    c.release(hs[0]).unwrap();
    // Still mapped, but the handle is gone for the program: CUDA_ERROR_INVALID_VALUE.
    assert_eq!(c.release(hs[0]), Err(INVALID));
    assert!(c.unmap(va, PAGE).unwrap());
    assert_eq!(c.release(hs[0]), Err(INVALID));
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn ranges_past_the_end_of_the_address_space_answer_without_panicking() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 2).unwrap();
    assert!(!c.maps_in(va + 4 * PAGE, u64::MAX));
    assert_eq!(c.unmap(va + 4 * PAGE, u64::MAX), Ok(false));
    assert_eq!(c.unmap(va, u64::MAX), Err(INVALID));
    assert!(c.address_free(va, u64::MAX).is_err(), "pages mapped there");
    shrink(&mut c, va, &hs);
    all_given_back(&mut c);
}

#[test]
fn a_handle_the_driver_will_not_take_back_stays_counted_and_goes_later() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 3).unwrap();
    shrink(&mut c, va, &hs);
    assert_eq!(c.kept_bytes(), 3 * PAGE);
    c.driver_mut().fail(Op::Release, DrvError(999));
    c.release_kept();
    c.driver_mut().clear_failures();
    assert_eq!(c.kept_bytes(), 0);
    assert_eq!(c.physical_bytes(), 3 * PAGE, "still held");
    assert_eq!(c.driver().used(), c.physical_bytes());
    assert!(c.holds_anything());
    c.settle(false);
    assert_eq!(c.physical_bytes(), 0);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_compaction_short_of_room_gives_kept_handles_back_and_copies_on_the_device() {
    let mut k = delayed();
    k.margin = 0;
    let (mut c, va) = setup(12 * PAGE, k);
    let hs = grow(&mut c, va, 8).unwrap();
    fill(&mut c, va, 8);
    let other = grow(&mut c, va + 20 * PAGE, 4).unwrap();
    shrink(&mut c, va + 20 * PAGE, &other);
    assert_eq!(c.kept_bytes(), 4 * PAGE);
    // Half the first handle goes; its live half needs 4 pages of room: the kept ones.
    shrink(&mut c, va + 4 * PAGE, &hs[4..]);
    c.settle(true);
    assert_eq!(c.stats().compactions, 1);
    assert_eq!(c.stats().host_copies, 0, "room came from kept handles");
    assert!(intact(&c, va, 4));
    shrink(&mut c, va, &hs[..4]);
    all_given_back(&mut c);
}

/// Books against the driver: every mapping the books claim exists, with the access claimed,
/// and no mapping of one of our handles is unknown to them.
fn books_match_driver(c: &Coalescer<FakeDriver>, ctx: &str) {
    let maps = c.driver().mapping_list();
    let find = |b: u64| maps.iter().find(|m| m.0 == b).cloned();
    let granted_in = |g: &[(i32, u32)], m: &(u64, u64, ChunkHandle, Vec<i32>)| {
        g.iter().all(|(d, f)| *f == 0 || m.3.contains(d))
    };
    for (b, k) in &c.parked {
        let kh = &c.kept[k];
        assert_eq!(kh.base, Some(*b), "{ctx}");
        let m = find(*b).unwrap_or_else(|| panic!("{ctx}: parked at {b:#x} but not mapped"));
        assert_eq!(
            (m.1, m.2),
            (k.1, kh.handle),
            "{ctx}: parked mapping differs"
        );
        assert!(granted_in(&kh.granted, &m), "{ctx}: parked access missing");
    }
    for kh in c.kept.values().filter(|kh| kh.base.is_none()) {
        assert!(
            maps.iter().all(|m| m.2 != kh.handle),
            "{ctx}: unmapped kept is mapped"
        );
    }
    for (b, pid) in &c.bases {
        let ph = &c.phys[pid];
        let m = find(*b).unwrap_or_else(|| panic!("{ctx}: phys at {b:#x} not mapped"));
        assert_eq!(
            (m.1, m.2),
            (ph.size, ph.handle),
            "{ctx}: phys mapping differs"
        );
        assert!(granted_in(&ph.granted, &m), "{ctx}: phys access missing");
    }
    for m in &maps {
        let known = c.bases.contains_key(&m.0) || c.parked.contains_key(&m.0);
        let ours =
            c.phys.values().any(|p| p.handle == m.2) || c.kept.values().any(|k| k.handle == m.2);
        assert!(
            !ours || known,
            "{ctx}: our handle mapped at {:#x} unknown to the books",
            m.0
        );
    }
}

/// Parking with everything a program may do out of PyTorch's order (unmap now, release
/// later; access for another device; its own handles over free slots; exports and shared
/// runs) and driver failures in compactions and in growing: after every step the books
/// match the driver's mappings, live data is intact and every byte is accounted for.
#[test]
fn randomized_parking_keeps_books_equal_to_the_drivers_mappings() {
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut k = delayed();
        k.strand_max = [0, 3 * PAGE, u64::MAX][seed as usize % 3];
        k.max_handle = [4, 16, 64][seed as usize % 3] * PAGE;
        k.margin = [0, 2 * PAGE, 4 * PAGE][(seed / 3) as usize % 3];
        let (mut c, va) = setup(60 * PAGE, k);
        let mut live: BTreeMap<u64, u64> = BTreeMap::new(); // slot -> handle
        let mut unmapped: Vec<u64> = Vec::new(); // unmapped, not yet released
        for step in 0..300 {
            let ctx = format!("seed {seed} step {step}");
            match rng.below(12) {
                0..=3 => {
                    let n = 1 + rng.below(6);
                    let start = free_run(&live, n);
                    let at = va + start * PAGE;
                    match grow(&mut c, at, n) {
                        Ok(hs) => {
                            if rng.below(3) == 0 {
                                c.set_access(at, n * PAGE, &[(1, RW)]).unwrap();
                            }
                            fill(&mut c, at, n);
                            for (i, h) in hs.into_iter().enumerate() {
                                live.insert(start + i as u64, h);
                            }
                        }
                        Err(e) => assert!(e.is_oom(), "{ctx}: {e}"),
                    }
                }
                4..=5 => release_random_run(&mut c, va, &mut rng, &mut live),
                6 => {
                    if let Some(s) = pick(&mut rng, &live) {
                        let h = live.remove(&s).unwrap();
                        assert!(c.unmap(va + s * PAGE, PAGE).unwrap(), "{ctx}");
                        assert_eq!(c.unmap(va + s * PAGE, PAGE), Err(INVALID), "{ctx}");
                        unmapped.push(h);
                    }
                }
                7 => {
                    for h in std::mem::take(&mut unmapped) {
                        c.release(h).unwrap();
                        assert_eq!(c.release(h), Err(INVALID), "{ctx}");
                    }
                }
                8 => {
                    let op = [
                        Op::Create,
                        Op::Map,
                        Op::Copy,
                        Op::Unmap,
                        Op::Sync,
                        Op::Release,
                    ];
                    let op = op[rng.below(6) as usize];
                    c.driver_mut()
                        .fail_nth(op, rng.below(3) as usize, DrvError(999));
                    c.settle(true);
                    c.driver_mut().clear_failures();
                }
                9 => {
                    if rng.below(2) == 0 {
                        c.release_kept();
                        continue;
                    }
                    // A grow whose driver calls fail somewhere (PyTorch gives the pages back).
                    let op = [Op::Create, Op::Map, Op::SetAccess, Op::Unmap, Op::Release];
                    let op = op[rng.below(5) as usize];
                    c.driver_mut()
                        .fail_nth(op, rng.below(3) as usize, DrvError(999));
                    let n = 1 + rng.below(6);
                    let start = free_run(&live, n);
                    let at = va + start * PAGE;
                    let hs: Vec<u64> = (0..n).filter_map(|_| c.create(PAGE, PROPS).ok()).collect();
                    let got = hs.len() as u64;
                    for (i, h) in hs.iter().enumerate() {
                        c.map(at + i as u64 * PAGE, PAGE, 0, *h).unwrap();
                    }
                    let r = match got {
                        0 => Ok(true),
                        _ => c.set_access(at, got * PAGE, &[(0, RW)]),
                    };
                    c.driver_mut().clear_failures();
                    match r {
                        Ok(_) => {
                            fill(&mut c, at, got);
                            for (i, h) in hs.into_iter().enumerate() {
                                live.insert(start + i as u64, h);
                            }
                        }
                        Err(_) => shrink(&mut c, at, &hs),
                    }
                }
                10 => program_maps_its_own(&mut c, va + free_run(&live, 2) * PAGE),
                _ => {
                    if let Some(s) = pick(&mut rng, &live) {
                        match rng.below(2) {
                            0 => drop(c.export(live[&s]).unwrap()),
                            _ => c.isolate_run(va + s * PAGE).unwrap(),
                        }
                    }
                }
            }
            books_match_driver(&c, &ctx);
            for &s in live.keys() {
                assert!(intact(&c, va + s * PAGE, 1), "{ctx} slot {s}");
            }
            assert_eq!(c.driver().used(), c.physical_bytes(), "{ctx}");
            let pages = (live.len() + unmapped.len()) as u64 * PAGE;
            assert_eq!(
                c.physical_bytes(),
                pages + c.stranded() + c.kept_bytes() + c.unreleased_bytes(),
                "{ctx}: books"
            );
            let pending: u64 = c
                .pages
                .values()
                .filter(|p| p.slot.is_none() && p.refs > 0)
                .map(|p| p.size)
                .sum();
            assert_eq!(c.pending_bytes, pending, "{ctx}: pending");
        }
        for h in std::mem::take(&mut unmapped) {
            c.release(h).unwrap();
        }
        for (s, h) in std::mem::take(&mut live) {
            shrink(&mut c, va + s * PAGE, &[h]);
        }
        c.settle(true);
        c.address_free(va, 4000 * PAGE).unwrap();
        assert_eq!(c.driver().mapping_count(), 0, "seed {seed}");
        c.release_kept();
        assert_eq!(c.driver().used(), 0, "seed {seed}");
        assert_eq!(c.counts(), (0, 0), "seed {seed}");
    }
}
