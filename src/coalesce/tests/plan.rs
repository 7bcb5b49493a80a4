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
