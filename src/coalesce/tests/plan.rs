//! Backing pages: parked handles taken back in place, and moved first when only partly under
//! new pages.

use super::*;

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
fn pages_grown_into_memory_made_ahead_cost_no_driver_call() {
    let (mut c, va) = setup(100 * PAGE, ahead(6));
    c.peak_held = u64::MAX;
    let first = grow(&mut c, va, 2).unwrap();
    assert_eq!(c.driver().calls_of(Op::Create), 1);
    assert_eq!(c.driver().used(), 8 * PAGE, "two pages and six ahead");
    assert_eq!(c.ahead_bytes(), 6 * PAGE);
    assert_eq!(c.stranded(), 0, "bytes ahead are not stranded");
    fill(&mut c, va, 2);
    // The next two batches land where the handle grew: no create, map or access call.
    let before = c.driver().total_calls();
    let second = grow(&mut c, va + 2 * PAGE, 3).unwrap();
    let third = grow(&mut c, va + 5 * PAGE, 1).unwrap();
    assert_eq!(c.driver().total_calls(), before, "no create, map or access");
    assert_eq!(c.stats().ahead_used, 4 * PAGE);
    assert_eq!(c.stats().access_skipped, 2);
    assert_eq!(c.ahead_bytes(), 2 * PAGE);
    fill(&mut c, va + 2 * PAGE, 4);
    // Past the end of what grew ahead: the rest gets a handle of its own (grown ahead too).
    let fourth = grow(&mut c, va + 6 * PAGE, 3).unwrap();
    assert_eq!(c.driver().calls_of(Op::Create), 2);
    assert_eq!(c.driver().used(), 8 * PAGE + 7 * PAGE);
    fill(&mut c, va + 6 * PAGE, 3);
    assert!(intact(&c, va, 9));
    assert!(c.driver().is_accessible(va, 9 * PAGE, 0));
    assert_eq!(c.held_beyond_live(), c.ahead_bytes());
    // Another device's access: asked of the driver for the whole handles.
    assert!(c.set_access(va, 9 * PAGE, &[(1, RW)]).unwrap());
    assert!(c.driver().is_accessible(va, 9 * PAGE, 1));
    shrink(&mut c, va, &first);
    shrink(&mut c, va + 2 * PAGE, &second);
    shrink(&mut c, va + 5 * PAGE, &third);
    shrink(&mut c, va + 6 * PAGE, &fourth);
    assert_eq!(c.ahead_bytes(), 0);
    all_given_back(&mut c);
}

#[test]
fn memory_grown_ahead_goes_back_when_the_program_gives_memory_back() {
    let (mut c, va) = setup(100 * PAGE, ahead(6));
    c.peak_held = u64::MAX;
    let a = grow(&mut c, va, 2).unwrap();
    // A second reservation's pages, released while the first handle's stay live.
    let vb = c.driver_mut().reserve(100 * PAGE).unwrap();
    c.reserved(vb, 100 * PAGE);
    let b = grow(&mut c, vb, 1).unwrap();
    fill(&mut c, va, 2);
    fill(&mut c, vb, 1);
    assert_eq!(c.ahead_bytes(), 12 * PAGE);
    let copies = c.driver().calls_of(Op::Copy);
    shrink(&mut c, vb, &b);
    // The released handle took its bytes ahead back with it, no copy; the other's wait for
    // the end of the giving back (a later loop of empty_cache() may release its pages too).
    assert_eq!(c.ahead_bytes(), 6 * PAGE);
    assert!(c.giving_back());
    assert_eq!(c.driver().used(), 8 * PAGE);
    assert_eq!(c.driver().calls_of(Op::Copy), copies);
    // The program's next call: everything ahead is back, the live pages intact.
    c.giving_back_ended();
    assert!(!c.giving_back());
    assert_eq!(c.ahead_bytes(), 0);
    assert_eq!(c.driver().used(), 2 * PAGE, "only the live pages");
    assert_eq!(c.stats().ahead_returned, 12 * PAGE);
    assert!(intact(&c, va, 2));
    // A later loop over the grown handle's own pages: its bytes ahead go with them, no copy.
    let more = grow(&mut c, va + 2 * PAGE, 1).unwrap();
    let other = grow(&mut c, vb, 1).unwrap();
    assert!(c.ahead_bytes() > 0);
    let copies = c.driver().calls_of(Op::Copy);
    shrink(&mut c, vb, &other);
    shrink(&mut c, va + 2 * PAGE, &more);
    assert_eq!(c.driver().calls_of(Op::Copy), copies, "no compaction");
    assert_eq!(c.driver().used(), 2 * PAGE);
    // trim() and a shortfall at admission give it back at once.
    let more = grow(&mut c, va + 2 * PAGE, 1).unwrap();
    assert!(c.ahead_bytes() > 0);
    let held = c.ahead_bytes();
    assert_eq!(c.trim(), held);
    assert_eq!(c.driver().used(), 3 * PAGE);
    assert!(intact(&c, va, 2));
    shrink(&mut c, va, &a);
    shrink(&mut c, va + 2 * PAGE, &more);
    all_given_back(&mut c);
}

#[test]
fn growing_ahead_never_costs_a_page_its_memory() {
    // Room for the pages, not for the bytes ahead: the pages get theirs, nothing ahead.
    let (mut c, va) = setup(10 * PAGE, ahead(8));
    c.peak_held = u64::MAX;
    let hs = grow(&mut c, va, 3).unwrap();
    assert_eq!(c.ahead_bytes(), 0);
    assert_eq!(c.driver().used(), 3 * PAGE);
    // Nothing ahead where something is mapped already: a program handle two pages on.
    let own = c.driver_mut().create(PAGE).unwrap();
    c.driver_mut().map(va + 5 * PAGE, PAGE, own).unwrap();
    let next = grow(&mut c, va + 3 * PAGE, 1).unwrap();
    assert_eq!(c.ahead_bytes(), 0, "the program's mapping is in the way");
    // Only within the program's reservation.
    let (mut d, vd) = setup(100 * PAGE, ahead(8));
    d.peak_held = u64::MAX;
    let last = grow(&mut d, vd + 3998 * PAGE, 1).unwrap();
    assert_eq!(d.ahead_bytes(), PAGE, "one page left in the reservation");
    shrink(&mut d, vd + 3998 * PAGE, &last);
    all_given_back(&mut d);
    // At most 1/64 of the most held so far.
    let (mut e, ve) = setup(100 * PAGE, ahead(8));
    let small = grow(&mut e, ve, 1).unwrap();
    assert_eq!(e.ahead_bytes(), 0, "nothing held before");
    shrink(&mut e, ve, &small);
    c.driver_mut().unmap(va + 5 * PAGE, PAGE).unwrap();
    c.driver_mut().release(own).unwrap();
    shrink(&mut c, va, &hs);
    shrink(&mut c, va + 3 * PAGE, &next);
    all_given_back(&mut c);
}

#[test]
fn a_mapping_unknown_to_the_books_where_a_handle_grew_ahead_costs_nothing_but_the_growing() {
    let (mut c, va) = setup(100 * PAGE, ahead(6));
    c.peak_held = u64::MAX;
    // The program maps a handle of its own two pages on, without telling the coalescer.
    let own = c.driver_mut().create(PAGE).unwrap();
    c.driver_mut().map(va + 3 * PAGE, PAGE, own).unwrap();
    let hs = grow(&mut c, va, 2).unwrap();
    fill(&mut c, va, 2);
    assert!(intact(&c, va, 2));
    assert_eq!(c.ahead_bytes(), 0);
    assert_eq!(
        c.driver().used(),
        3 * PAGE,
        "the pages and the program's own"
    );
    assert_eq!(c.driver().used(), c.physical_bytes() + PAGE);
    // Growing ahead is off from here.
    let more = grow(&mut c, va + 4 * PAGE, 1).unwrap();
    assert_eq!(c.ahead_bytes(), 0);
    shrink(&mut c, va, &hs);
    shrink(&mut c, va + 4 * PAGE, &more);
    c.driver_mut().unmap(va + 3 * PAGE, PAGE).unwrap();
    c.driver_mut().release(own).unwrap();
    all_given_back(&mut c);
}

#[test]
fn range_queries_see_the_programs_pages_and_not_the_memory_grown_ahead() {
    // What the range hooks answer: the page and its reservation where the program mapped a
    // page; past its pages, where only memory grown ahead is mapped, nothing (natively there
    // is no mapping); outside the coalescer's handles, not ours at all.
    let (mut c, va) = setup(100 * PAGE, ahead(6));
    c.peak_held = u64::MAX;
    let hs = grow(&mut c, va, 2).unwrap();
    assert_eq!(c.ahead_bytes(), 6 * PAGE);
    let reservation = Some((va, 4000 * PAGE));
    assert_eq!(
        c.query(va + PAGE + 5),
        Some(Seen::Page {
            page: (va + PAGE, PAGE),
            reservation
        })
    );
    assert_eq!(
        c.query(va + 3 * PAGE),
        Some(Seen::Hidden { reservation }),
        "grown ahead"
    );
    assert_eq!(c.query(va + 9 * PAGE), None, "nothing of ours");
    shrink(&mut c, va, &hs);
    assert_eq!(c.query(va), None);
    all_given_back(&mut c);
}
