//! Kept and parked handles: reuse, given back on demand, never for shared pages, failures that
//! keep them, handles the driver would not take back.

use super::*;

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
fn sharing_a_run_moves_nothing_and_stops_where_the_programs_pages_stop() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let live = grow(&mut c, va, 2).unwrap();
    let after = grow(&mut c, va + 2 * PAGE, 3).unwrap();
    shrink(&mut c, va + 2 * PAGE, &after);
    assert_eq!(
        c.driver().mapping_count(),
        2,
        "the released batch is parked after the live one"
    );
    // cudaIpcGetMemHandle: the run is the program's pages, not the driver's back-to-back
    // mappings (the parked handle after them is expseg's); nothing is unmapped or split.
    let unmaps = c.driver().calls_of(Op::Unmap);
    c.share_run(va, usize::MAX).unwrap();
    assert_eq!(
        c.driver().mapping_count(),
        2,
        "both handles where they were"
    );
    assert_eq!(c.driver().calls_of(Op::Unmap), unmaps, "nothing moved");
    assert_eq!(
        c.program_run(va + 5, usize::MAX),
        Some((va, vec![PAGE, PAGE]))
    );
    assert_eq!(c.kept_bytes(), 3 * PAGE, "still kept");
    // The shared handle takes no new pages: its pages are the consumer's to read.
    shrink(&mut c, va, &live);
    c.release_kept();
    assert_eq!(c.driver().used(), 0);
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
fn keeping_turned_off_gives_every_kept_handle_back_and_keeps_none_until_turned_on() {
    let (mut c, va) = setup(20 * PAGE, delayed());
    let a = grow(&mut c, va, 4).unwrap();
    shrink(&mut c, va, &a);
    assert_eq!(c.kept_bytes(), 4 * PAGE);
    assert!(c.keeping());
    // Another process came to the GPU: what is kept goes back, and releases go back at once.
    assert_eq!(c.set_keeping(false), 4 * PAGE);
    assert_eq!((c.kept_bytes(), c.driver().used()), (0, 0));
    assert!(!c.keeping());
    let b = grow(&mut c, va, 3).unwrap();
    fill(&mut c, va, 3);
    assert!(intact(&c, va, 3));
    shrink(&mut c, va, &b);
    assert_eq!(
        (c.kept_bytes(), c.driver().used()),
        (0, 0),
        "released at once"
    );
    // It left: kept again.
    assert_eq!(c.set_keeping(true), 0);
    let d = grow(&mut c, va, 2).unwrap();
    shrink(&mut c, va, &d);
    assert_eq!(c.kept_bytes(), 2 * PAGE);
    all_given_back(&mut c);
}

#[test]
fn what_is_kept_is_bounded_by_the_time_giving_it_back_takes_the_oldest_going_first() {
    // A handle of 4 pages, parked: 15 us + 80 us (its unmap) + 80 MiB at 1.6 GB/ms (52 us).
    let one = super::super::reuse::giveback_us(1, 1, 4 * PAGE);
    assert_eq!(one, 147);
    let (mut c, va) = setup(
        100 * PAGE,
        CoalesceConfig {
            keep_giveback_us: 2 * one + one / 2, // 7/8 of it still holds two
            ..delayed()
        },
    );
    let batches: Vec<Vec<u64>> = (0..5)
        .map(|i| grow(&mut c, va + i * 10 * PAGE, 4).unwrap())
        .collect();
    for (i, hs) in batches.iter().enumerate() {
        shrink(&mut c, va + i as u64 * 10 * PAGE, hs);
        assert!(c.kept_giveback_us() <= 2 * one + one / 2, "batch {i}");
    }
    assert_eq!(c.kept_bytes(), 8 * PAGE, "the two newest handles kept");
    assert_eq!(c.driver().used(), 8 * PAGE, "the three oldest given back");
    assert_eq!(c.stats().kept_bounded, 3);
    let parked =
        |c: &Coalescer<FakeDriver>, i: u64| c.parked_in_range(va + i * 10 * PAGE, 4 * PAGE);
    assert!(!parked(&c, 0) && !parked(&c, 2) && parked(&c, 3) && parked(&c, 4));
    // Without a bound all five stay.
    let (mut c, va) = setup(100 * PAGE, delayed());
    let batches: Vec<Vec<u64>> = (0..5)
        .map(|i| grow(&mut c, va + i * 10 * PAGE, 4).unwrap())
        .collect();
    for (i, hs) in batches.iter().enumerate() {
        shrink(&mut c, va + i as u64 * 10 * PAGE, hs);
    }
    assert_eq!((c.kept_bytes(), c.stats().kept_bounded), (20 * PAGE, 0));
    all_given_back(&mut c);
}
