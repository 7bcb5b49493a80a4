//! The program's calls: one handle per batch, exact out-of-memory answers, export, foreign
//! handles and ranges, answers as native for calls twice or out of range.

use super::*;
use crate::coalesce::books::FREE_STALE_NS;

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

#[test]
fn memory_shared_with_another_process_is_not_split_and_never_moves() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let a = grow(&mut c, va, 4).unwrap();
    let b = grow(&mut c, va + 4 * PAGE, 3).unwrap();
    fill(&mut c, va, 7);
    let (creates, unmaps) = (
        c.driver().calls_of(Op::Create),
        c.driver().calls_of(Op::Unmap),
    );
    let chunks = c.driver().chunk_count();
    c.share_run(va + PAGE + 7, usize::MAX).unwrap();
    assert_eq!(
        c.driver().chunk_count(),
        chunks,
        "both batches of the run in their handles, where they were"
    );
    assert!(chunks < 7, "coalesced: {chunks} handles for 7 pages");
    assert_eq!(
        c.driver().calls_of(Op::Unmap),
        unmaps,
        "nothing left its address"
    );
    assert_eq!(
        c.program_run(va + PAGE, usize::MAX),
        Some((va + PAGE, vec![PAGE; 6]))
    );
    assert!(intact(&c, va, 7));
    shrink(&mut c, va + PAGE, &a[1..3]);
    c.settle(true);
    assert_eq!(c.driver().calls_of(Op::Create), creates, "no page moved");
    assert_eq!(
        c.stranded(),
        2 * PAGE,
        "released pages stay in the shared handle"
    );
    assert!(intact(&c, va, 1) && intact(&c, va + 3 * PAGE, 4));
    // Pages the program maps there again take those bytes in place (nothing can move).
    let again = grow(&mut c, va + PAGE, 2).unwrap();
    assert_eq!(c.driver().calls_of(Op::Create), creates, "no new memory");
    assert_eq!(c.stranded(), 0);
    assert_eq!(
        c.driver().calls_of(Op::Unmap),
        unmaps,
        "nothing left its address"
    );
    shrink(&mut c, va + PAGE, &again);
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
fn retaining_a_released_page_not_backed_yet_counts_it_pending_again() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let h = c.create(PAGE, PROPS).unwrap();
    c.map(va, PAGE, 0, h).unwrap();
    c.release(h).unwrap();
    assert_eq!(c.pending_bytes, 0);
    assert_eq!(c.retain(va + G), Ok(Some(h)));
    assert_eq!(c.pending_bytes, PAGE);
    assert!(c.set_access(va, PAGE, &[(0, RW)]).unwrap());
    assert_eq!(c.pending_bytes, 0);
    assert!(c.unmap(va, PAGE).unwrap());
    c.release(h).unwrap();
    all_given_back(&mut c);
}

#[test]
fn a_page_retained_for_another_process_splits_its_own_handle_only() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let _a = grow(&mut c, va, 4).unwrap();
    let _b = grow(&mut c, va + 4 * PAGE, 3).unwrap();
    fill(&mut c, va, 7);
    assert_eq!(c.driver().chunk_count(), 2);
    c.isolate_page(va + PAGE + 7).unwrap();
    assert_eq!(
        c.driver().chunk_count(),
        5,
        "the first batch page by page, the second whole"
    );
    assert!(intact(&c, va, 7));
}

/// Whether the `n` pages at `at` hold what `fill` wrote at `from`.
fn moved_intact(c: &Coalescer<FakeDriver>, at: u64, from: u64, n: u64) -> bool {
    (0..n * PAGE / G).all(|i| c.driver().read(at + i * G) == Some(tag(from + i * G)))
}

#[test]
fn an_exported_page_kept_and_mapped_again_keeps_its_handle() {
    // With kept handles (EXPSEG_RELEASE_DELAY above 0) the handle of an unmapped exported
    // page stays mapped where it was; mapped elsewhere again, or with a new page mapped over
    // its old address, the page must keep the handle the importer has (not a copy of it in a
    // new one).
    for over in [false, true] {
        let (mut c, va) = setup(100 * PAGE, delayed());
        let hs = grow(&mut c, va, 2).unwrap();
        fill(&mut c, va, 2);
        let h0 = c.export(hs[0]).unwrap();
        assert!(c.unmap(va, PAGE).unwrap());
        let mut extra = Vec::new();
        if over {
            extra = grow(&mut c, va, 1).unwrap();
        }
        c.map(va + 10 * PAGE, PAGE, 0, hs[0]).unwrap();
        assert!(c.set_access(va + 10 * PAGE, PAGE, &[(0, RW)]).unwrap());
        assert_eq!(c.export(hs[0]).unwrap(), h0, "over {over}: the same handle");
        assert!(moved_intact(&c, va + 10 * PAGE, va, 1), "over {over}");
        assert!(intact(&c, va + PAGE, 1), "over {over}");
        shrink(&mut c, va + 10 * PAGE, &hs[..1]);
        shrink(&mut c, va + PAGE, &hs[1..]);
        shrink(&mut c, va, &extra);
        all_given_back(&mut c);
    }
}

#[test]
fn a_kept_page_mapped_back_beside_a_new_page_where_a_released_one_was() {
    // A handle of two pages with the first released and not compacted yet (a strand bound),
    // the second unmapped and kept; a new page is mapped where the first was; the second is
    // mapped back at its own address: every call succeeds, as natively (the whole handle is
    // not mapped back over the new page).
    let mut k = cfg();
    k.strand_max = u64::MAX;
    let (mut c, va) = setup(100 * PAGE, k);
    let ab = grow(&mut c, va, 2).unwrap();
    fill(&mut c, va, 2);
    shrink(&mut c, va, &ab[..1]);
    assert!(c.unmap(va + PAGE, PAGE).unwrap());
    let new = grow(&mut c, va, 1).unwrap();
    c.map(va + PAGE, PAGE, 0, ab[1]).unwrap();
    assert_eq!(c.set_access(va + PAGE, PAGE, &[(0, RW)]), Ok(true));
    assert!(intact(&c, va + PAGE, 1));
    shrink(&mut c, va, &new);
    shrink(&mut c, va + PAGE, &ab[1..]);
    all_given_back(&mut c);
}

#[test]
fn an_unmap_over_a_hole_is_refused_as_natively() {
    // Pages at va (one) and va+2P (two): an unmap of [va, va+3P) has sizes that add up but
    // a hole at va+P, and would end past its range: INVALID, nothing unmapped.
    let (mut c, va) = setup(100 * PAGE, cfg());
    let a = grow(&mut c, va, 1).unwrap();
    let b = c.create(2 * PAGE, PROPS).unwrap();
    c.map(va + 2 * PAGE, 2 * PAGE, 0, b).unwrap();
    assert!(c.set_access(va + 2 * PAGE, 2 * PAGE, &[(0, RW)]).unwrap());
    assert_eq!(c.unmap(va, 3 * PAGE), Err(INVALID));
    assert!(c.driver().is_accessible(va, G, 0));
    assert!(c.driver().is_accessible(va + 3 * PAGE, G, 0));
    shrink(&mut c, va, &a);
    assert!(c.unmap(va + 2 * PAGE, 2 * PAGE).unwrap());
    c.release(b).unwrap();
    all_given_back(&mut c);
}

#[test]
fn an_answer_of_free_memory_a_moment_old_admits_the_next_batch_without_asking_again() {
    let (mut c, va) = setup(100 * PAGE, still());
    let a = grow_at(&mut c, 0, va, 3);
    assert_eq!(meminfo_calls(&c), 1);
    // 1 ms later: the answer still admits a batch (less the 3 pages made since).
    let b = grow_at(&mut c, 1_000_000, va + 3 * PAGE, 3);
    assert_eq!(meminfo_calls(&c), 1);
    assert_eq!(c.stats().meminfo_skipped, 1);
    // 3.5 ms after the answer: other processes could have taken 3 GiB in the last 1.5 ms,
    // more than the card has: asked again.
    let d = grow_at(&mut c, 3_500_000, va + 6 * PAGE, 3);
    assert_eq!(meminfo_calls(&c), 2);
    intact_then_given_back(&mut c, va, &[&a, &b, &d]);
}

#[test]
fn an_older_answer_admits_a_batch_less_what_other_processes_could_have_taken_since() {
    // 80 GiB free, a margin of 4 pages: 20 ms after the answer, others could have taken
    // 36 GiB (2 GiB a ms past the first 2 ms): the batch is admitted without asking; 45 ms
    // after it, 86 GiB: asked again.
    let (mut c, va) = setup(4096 * PAGE, still());
    let a = grow_at(&mut c, 0, va, 3);
    assert_eq!(meminfo_calls(&c), 1);
    let b = grow_at(&mut c, 20_000_000, va + 3 * PAGE, 3);
    assert_eq!(meminfo_calls(&c), 1, "admitted by the 20 ms old answer");
    assert_eq!(c.stats().meminfo_skipped, 1);
    let d = grow_at(&mut c, 45_000_000, va + 6 * PAGE, 3);
    assert_eq!(meminfo_calls(&c), 2, "86 GiB could be gone: asked");
    intact_then_given_back(&mut c, va, &[&a, &b, &d]);
}

#[test]
fn an_answer_past_its_age_limit_is_asked_again_whatever_is_free() {
    let (mut c, va) = setup(1 << 40, still());
    let a = grow_at(&mut c, 0, va, 2);
    let b = grow_at(&mut c, FREE_STALE_NS - 1, va + 2 * PAGE, 2);
    assert_eq!(
        meminfo_calls(&c),
        1,
        "a TiB free covers 2 GiB a ms for 100 ms"
    );
    let d = grow_at(&mut c, FREE_STALE_NS + 1, va + 4 * PAGE, 2);
    assert_eq!(meminfo_calls(&c), 2);
    intact_then_given_back(&mut c, va, &[&a, &b, &d]);
}

#[test]
fn a_batch_the_recent_answer_does_not_cover_asks_the_driver_and_is_made_at_once() {
    // 20 pages, a margin of 4: the first batch (10 pages) leaves 10 by the answer, less
    // what was made since; the next batch's 7th page passes that.
    let (mut c, va) = setup(20 * PAGE, still());
    let a = grow_at(&mut c, 0, va, 10);
    assert_eq!(meminfo_calls(&c), 1);
    c.driver_mut().set_clock(1_000_000);
    let exact = c.stats().exact_creates;
    let b = grow(&mut c, va + 10 * PAGE, 7).unwrap();
    assert!(meminfo_calls(&c) >= 2, "asked again");
    assert!(
        c.stats().exact_creates > exact,
        "near the limit: made at once"
    );
    fill(&mut c, va, 17);
    assert!(intact(&c, va, 17));
    assert_eq!(c.driver().used(), 17 * PAGE);
    shrink(&mut c, va, &a);
    shrink(&mut c, va + 10 * PAGE, &b);
    all_given_back(&mut c);
}

#[test]
fn bytes_given_back_since_the_answer_are_not_counted_free_so_creates_fail_as_natively() {
    // The program gives its 10 pages back and another process takes 12 of the 20 at once.
    // Were the 10 counted free again, a batch of 12 would be admitted by the 1 ms old answer
    // and fail at cuMemSetAccess; as it is, the 7th page asks, and the 9th create is out of
    // memory, where PyTorch expects it.
    let (mut c, va) = setup(20 * PAGE, still());
    c.driver_mut().set_clock(0);
    let a = grow(&mut c, va, 10).unwrap();
    shrink(&mut c, va, &a);
    assert_eq!(c.driver().used(), 0);
    c.driver_mut().set_capacity(8 * PAGE);
    c.driver_mut().set_clock(1_000_000);
    let mut made = Vec::new();
    let err = loop {
        match c.create(PAGE, PROPS) {
            Ok(h) => made.push(h),
            Err(e) => break e,
        }
        assert!(made.len() <= 12);
    };
    assert!(err.is_oom());
    assert_eq!(
        made.len(),
        8,
        "every page that fits, then out of memory at create"
    );
    assert!(meminfo_calls(&c) >= 2);
    for (i, h) in made.iter().enumerate() {
        c.map(va + i as u64 * PAGE, PAGE, 0, *h).unwrap();
    }
    assert!(c.set_access(va, 8 * PAGE, &[(0, RW)]).unwrap());
    fill(&mut c, va, 8);
    assert!(intact(&c, va, 8));
    shrink(&mut c, va, &made);
    all_given_back(&mut c);
}

/// A batch of `n` pages at `at`, grown when the fake's clock reads `ns`.
fn grow_at(c: &mut Coalescer<FakeDriver>, ns: u64, at: u64, n: u64) -> Vec<u64> {
    c.driver_mut().set_clock(ns);
    grow(c, at, n).unwrap()
}

/// Batches of pages grown back to back from `va`: filled, found intact, each given back, and
/// nothing left in the driver.
fn intact_then_given_back(c: &mut Coalescer<FakeDriver>, va: u64, batches: &[&[u64]]) {
    let n: u64 = batches.iter().map(|b| b.len() as u64).sum();
    fill(c, va, n);
    assert!(intact(c, va, n));
    let mut at = va;
    for b in batches {
        shrink(c, at, b);
        at += b.len() as u64 * PAGE;
    }
    all_given_back(c);
}

#[test]
fn a_shared_handle_that_left_its_address_comes_back_whole_where_a_page_of_it_is_mapped() {
    // A run shared by IPC (its handle mapped whole by another process), all its pages then
    // unmapped or released; a new page over the unmapped one takes the handle off its address
    // (no copy: nothing of it is mapped); the unmapped page mapped elsewhere brings the handle
    // back whole around it, not split (that would copy it away from what the other process maps).
    for k in [cfg(), still()] {
        let (mut c, va) = setup(100 * PAGE, k);
        let hs = grow(&mut c, va, 3).unwrap();
        fill(&mut c, va, 3);
        c.share_run(va, usize::MAX).unwrap();
        assert!(c.unmap(va, PAGE).unwrap());
        shrink(&mut c, va + PAGE, &hs[1..]);
        let creates = c.driver().calls_of(Op::Create);
        let new = grow(&mut c, va, 1).unwrap();
        assert_eq!(
            c.driver().calls_of(Op::Create),
            creates + 1,
            "the new page's"
        );
        c.map(va + 10 * PAGE, PAGE, 0, hs[0]).unwrap();
        assert_eq!(c.set_access(va + 10 * PAGE, PAGE, &[(0, RW)]), Ok(true));
        assert_eq!(
            c.driver().calls_of(Op::Create),
            creates + 1,
            "nothing copied"
        );
        assert_eq!(c.driver().chunk_count(), 2);
        assert!(moved_intact(&c, va + 10 * PAGE, va, 1));
        assert_eq!(
            c.stranded(),
            2 * PAGE,
            "released pages stay in the shared handle"
        );
        shrink(&mut c, va + 10 * PAGE, &hs[..1]);
        shrink(&mut c, va, &new);
        all_given_back(&mut c);
    }
}

#[test]
fn a_page_inside_a_larger_handle_says_where_it_lies_and_nothing_moves() {
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va, 4);
    let creates = c.driver().calls_of(Op::Create);
    let (at, size, _) = c
        .export_inside(hs[2])
        .unwrap()
        .expect("inside one handle of 4");
    assert_eq!((at, size), (va + 2 * PAGE, PAGE));
    assert!(c.page_mapped_at(hs[2], va + 2 * PAGE));
    assert!(
        !c.page_mapped_at(hs[2], va + PAGE),
        "not where another page is"
    );
    assert_eq!(c.driver().calls_of(Op::Create), creates, "nothing made");
    assert_eq!(c.stats().compactions, 0, "nothing moved");
    // A page with a handle of its own: nothing to say (its export moves nothing either).
    let own = c.create(PAGE, PROPS).unwrap();
    c.map(va + 10 * PAGE, PAGE, 0, own).unwrap();
    c.set_access(va + 10 * PAGE, PAGE, &[(0, RW)]).unwrap();
    assert_eq!(c.export_inside(own), Ok(None));
    assert!(c.unmap(va + 10 * PAGE, PAGE).unwrap());
    assert!(!c.page_mapped_at(own, va + 10 * PAGE), "unmapped");
    c.release(own).unwrap();
    assert!(intact(&c, va, 4));
    shrink(&mut c, va, &hs);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_split_refused_while_a_stream_captures_a_graph_changes_nothing() {
    // The real driver answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED before its device wait
    // (`gpu::fence::capturing`); the fake's copy stands for it.
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va, 4);
    let before = (c.driver().chunk_count(), c.driver().mapping_list());
    c.driver_mut().fail(Op::Copy, DrvError(900));
    assert_eq!(
        c.export(hs[1]),
        Err(DrvError(900)),
        "the share's call fails with the code"
    );
    assert_eq!(c.stats().moves_refused_capture, 1);
    assert_eq!(
        (c.driver().chunk_count(), c.driver().mapping_list()),
        before
    );
    assert!(intact(&c, va, 4));
    // Once the capture ended, the same export splits.
    let h1 = c.export(hs[1]).unwrap();
    assert!(!is_virtual(h1));
    assert!(intact(&c, va, 4));
    shrink(&mut c, va, &hs);
    assert_eq!(c.driver().used(), 0);
}
