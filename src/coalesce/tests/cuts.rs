//! Lifetimes learned from the program's giving back (`EXPSEG_LEARN_CUTS`): pages at new
//! addresses get handles of their own, pages mapped again where pages were before share one,
//! and handles made after a stranded one are cut where its live pages met released ones.

use super::*;

fn learning() -> CoalesceConfig {
    CoalesceConfig {
        learn_cuts: true,
        ..still()
    }
}

/// Handles created so far.
fn creates(c: &Coalescer<FakeDriver>) -> u64 {
    c.driver_calls()[crate::gpu::Op::Create.index()].0
}

#[test]
fn pages_at_new_addresses_get_handles_of_their_own_and_share_one_when_mapped_there_again() {
    let (mut c, va) = setup(100 * PAGE, learning());
    let hs = grow(&mut c, va, 4).unwrap();
    assert_eq!(c.counts(), (4, 4), "first use: a handle per page");
    fill(&mut c, va, 4);
    assert!(intact(&c, va, 4));
    shrink(&mut c, va, &hs);
    c.giving_back_ended();
    assert_eq!(c.driver().used(), 0);
    let before = creates(&c);
    let hs = grow(&mut c, va, 4).unwrap();
    assert_eq!(c.counts(), (4, 1), "known addresses: one handle");
    assert_eq!(creates(&c) - before, 1);
    shrink(&mut c, va, &hs);
    // Off: one handle a batch from the first use on.
    let (mut c, va) = setup(100 * PAGE, still());
    grow(&mut c, va, 4).unwrap();
    assert_eq!(c.counts(), (4, 1));
}

#[test]
fn what_was_learned_outlives_the_reservation_freed_and_made_again() {
    let (mut c, va) = setup(100 * PAGE, learning());
    let hs = grow(&mut c, va, 3).unwrap();
    shrink(&mut c, va, &hs);
    c.address_free(va, 4000 * PAGE).unwrap();
    c.reserved(va, 4000 * PAGE);
    grow(&mut c, va, 3).unwrap();
    assert_eq!(c.counts(), (3, 1));
}

#[test]
fn a_handle_made_after_a_stranded_one_is_cut_where_its_live_pages_met_released_ones() {
    let (mut c, va) = setup(100 * PAGE, learning());
    // Learn the addresses, then one handle over 4 pages.
    let hs = grow(&mut c, va, 4).unwrap();
    shrink(&mut c, va, &hs);
    let hs = grow(&mut c, va, 4).unwrap();
    assert_eq!(c.counts(), (4, 1));
    // Pages 1..4 go, page 0 lives on: stranded, and a cut at page 1 when the giving back ends.
    shrink(&mut c, va + PAGE, &hs[1..]);
    assert_eq!(
        c.stats().cuts_learned,
        0,
        "not while the program gives back"
    );
    c.giving_back_ended();
    assert_eq!(c.stranded(), 3 * PAGE);
    assert_eq!(c.stats().cuts_learned, 1);
    shrink(&mut c, va, &hs[..1]);
    assert_eq!(c.driver().used(), 0);
    // Mapped again: two handles, cut at page 1, so page 0 living on strands nothing.
    let hs = grow(&mut c, va, 4).unwrap();
    assert_eq!(c.counts(), (4, 2));
    shrink(&mut c, va + PAGE, &hs[1..]);
    c.giving_back_ended();
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.driver().used(), PAGE);
    assert_eq!(c.driver().unmapped_watched, 0);
}

#[test]
fn bytes_are_not_grown_ahead_across_a_cut_nor_past_new_addresses() {
    let mut k = learning();
    k.ahead = 8 * PAGE;
    let (mut c, va) = setup(100 * PAGE, k);
    c.peak_held = u64::MAX;
    c.cuts.settle();
    // New addresses: no bytes grown ahead.
    let hs = grow(&mut c, va, 2).unwrap();
    assert_eq!(c.ahead_bytes(), 0);
    shrink(&mut c, va, &hs);
    // Known: grown ahead up to the reservation's next known limit.
    let hs = grow(&mut c, va, 2).unwrap();
    assert_eq!(c.counts(), (2, 1));
    assert_eq!(c.ahead_bytes(), 8 * PAGE);
    // A cut at page 1 (page 0 lived on while page 1 and the bytes ahead were released).
    shrink(&mut c, va + PAGE, &hs[1..]);
    c.giving_back_ended();
    assert_eq!(c.stats().cuts_learned, 1);
    shrink(&mut c, va, &hs[..1]);
    c.giving_back_ended();
    assert_eq!(c.driver().used(), 0);
    // Page 0 alone again: its handle grows no bytes ahead across the cut at page 1.
    grow(&mut c, va, 1).unwrap();
    assert_eq!(c.ahead_bytes(), 0);
    assert_eq!(c.driver().used(), PAGE);
}

#[test]
fn pages_mapped_where_pages_were_shared_get_handles_of_their_own_so_sharing_again_moves_nothing() {
    let (mut c, va) = setup(100 * PAGE, learning());
    let hs = grow(&mut c, va, 3).unwrap();
    shrink(&mut c, va, &hs);
    // Known addresses: one handle, and its first export splits it (the one move).
    let hs = grow(&mut c, va, 3).unwrap();
    assert_eq!(c.counts(), (3, 1));
    fill(&mut c, va, 3);
    c.export(hs[1]).unwrap();
    assert_eq!(c.stats().exports_split, 1);
    let moved = c.stats().compactions;
    assert!(intact(&c, va, 3));
    shrink(&mut c, va, &hs);
    // The same buffer again (a weight bucket each sync): a handle a page, nothing split.
    let hs = grow(&mut c, va, 3).unwrap();
    assert_eq!(c.counts(), (3, 3));
    c.export(hs[1]).unwrap();
    c.share_run(va, usize::MAX).unwrap();
    assert_eq!(c.stats().exports_split, 1);
    assert_eq!(c.stats().compactions, moved);
    // Elsewhere, known addresses still share a handle.
    let other = va + 10 * PAGE;
    let hs2 = grow(&mut c, other, 2).unwrap();
    shrink(&mut c, other, &hs2);
    grow(&mut c, other, 2).unwrap();
    assert_eq!(c.counts(), (5, 4));
}

#[test]
fn pages_mapped_where_pages_were_exported_through_a_copy_get_handles_of_their_own() {
    let (mut c, va) = setup(100 * PAGE, learning());
    let hs = grow(&mut c, va, 3).unwrap();
    shrink(&mut c, va, &hs);
    let hs = grow(&mut c, va, 3).unwrap();
    assert_eq!(c.counts(), (3, 1));
    // The first share goes through a copy (`api::ipc::pages`): nothing moves.
    assert!(c.export_inside(hs[1]).unwrap().is_some());
    assert_eq!(c.stats().compactions, 0);
    shrink(&mut c, va, &hs);
    // The same buffer again: a handle a page, so its share needs neither a copy nor a split.
    let hs = grow(&mut c, va, 3).unwrap();
    assert_eq!(c.counts(), (3, 3));
    assert_eq!(c.export_inside(hs[1]), Ok(None));
    assert_eq!(c.stats().compactions, 0);
}

#[test]
fn bytes_grown_ahead_stop_where_pages_were_shared_so_the_shared_buffer_stays_alone() {
    let mut k = learning();
    k.ahead = 8 * PAGE;
    let (mut c, va) = setup(100 * PAGE, k);
    c.peak_held = u64::MAX;
    let hs = grow(&mut c, va, 4).unwrap();
    shrink(&mut c, va, &hs);
    c.giving_back_ended();
    // A buffer at pages 2-3, shared once (its one split).
    let b = grow(&mut c, va + 2 * PAGE, 2).unwrap();
    c.export(b[0]).unwrap();
    let splits = c.stats().exports_split;
    shrink(&mut c, va + 2 * PAGE, &b);
    // Pages 0-1 grow ahead, but not over pages 2-3.
    let a = grow(&mut c, va, 2).unwrap();
    assert_eq!(c.ahead_bytes(), 0);
    let b = grow(&mut c, va + 2 * PAGE, 2).unwrap();
    assert_eq!(c.counts(), (4, 3), "pages 0-1 together, 2 and 3 alone");
    c.export(b[0]).unwrap();
    assert_eq!(
        c.stats().exports_split,
        splits,
        "shared again: nothing split"
    );
    shrink(&mut c, va + 2 * PAGE, &b);
    shrink(&mut c, va, &a);
}

#[test]
fn a_page_shared_before_it_has_memory_is_remembered_as_shared() {
    let (mut c, va) = setup(100 * PAGE, learning());
    let hs = grow(&mut c, va, 3).unwrap();
    shrink(&mut c, va, &hs);
    // Mapped, not yet given access (no memory), and exported.
    let hs: Vec<u64> = (0..3).map(|_| c.create(PAGE, PROPS).unwrap()).collect();
    for (i, h) in hs.iter().enumerate() {
        c.map(va + i as u64 * PAGE, PAGE, 0, *h).unwrap();
    }
    c.export(hs[1]).unwrap();
    assert!(c.set_access(va, 3 * PAGE, &[(0, RW)]).unwrap());
    shrink(&mut c, va, &hs);
    let hs = grow(&mut c, va, 3).unwrap();
    let splits = c.stats().exports_split;
    c.export(hs[1]).unwrap();
    assert_eq!(
        c.stats().exports_split,
        splits,
        "page 1 has a handle of its own"
    );
}

#[test]
fn while_lifetimes_are_learned_a_handle_grows_little_ahead_and_a_new_cut_starts_learning_again() {
    let mut k = learning();
    k.ahead = 8 * PAGE;
    let (mut c, va) = setup(100 * PAGE, k);
    c.peak_held = u64::MAX;
    let hs = grow(&mut c, va, 2).unwrap();
    shrink(&mut c, va, &hs);
    c.giving_back_ended();
    // Known addresses, but no giving back has shown their lifetimes yet.
    let mut rounds = 1;
    while rounds < crate::coalesce::cuts::LEARNING_ROUNDS {
        let hs = grow(&mut c, va, 1).unwrap();
        assert_eq!(
            c.ahead_bytes(),
            crate::coalesce::cuts::LEARNING_AHEAD / PAGE * PAGE,
            "round {rounds}: still learning"
        );
        shrink(&mut c, va, &hs);
        c.giving_back_ended();
        rounds += 1;
    }
    // Rounds that learned no cut: learned, the full growth.
    let hs = grow(&mut c, va, 1).unwrap();
    assert_eq!(c.ahead_bytes(), 8 * PAGE);
    shrink(&mut c, va, &hs);
    c.giving_back_ended();
    // A giving back that learns a cut (page 20 lives on, page 21 goes): learning again.
    let far = va + 20 * PAGE;
    let hs = grow(&mut c, far, 2).unwrap();
    shrink(&mut c, far, &hs);
    c.giving_back_ended();
    let hs = grow(&mut c, far, 2).unwrap();
    shrink(&mut c, far + PAGE, &hs[1..]);
    c.giving_back_ended();
    assert!(c.stats().cuts_learned > 0);
    grow(&mut c, va, 1).unwrap();
    assert_eq!(
        c.ahead_bytes(),
        crate::coalesce::cuts::LEARNING_AHEAD / PAGE * PAGE,
        "a new cut: learning again"
    );
    // Off: the full growth at once.
    let mut k = still();
    k.ahead = 8 * PAGE;
    let (mut c, va) = setup(100 * PAGE, k);
    c.peak_held = u64::MAX;
    grow(&mut c, va, 1).unwrap();
    assert_eq!(c.ahead_bytes(), 8 * PAGE);
}

#[test]
fn tagged_pages_at_new_addresses_share_a_handle_so_a_pause_costs_few_driver_calls() {
    let (mut c, va) = setup(100 * PAGE, learning());
    grow_props(&mut c, va, 4, crate::gpu::PageProps { tag: 9, ..PROPS }).unwrap();
    // One handle (with EXPSEG_SPLIT_TAIL the tail page alone): not four.
    let tagged = c.counts().1;
    assert!(tagged <= 2, "{:?}", c.counts());
    // Untagged pages at new addresses: a handle each.
    grow(&mut c, va + 10 * PAGE, 4).unwrap();
    assert_eq!(c.counts().1 - tagged, 4, "{:?}", c.counts());
}

#[test]
fn tagged_pages_where_pages_were_shared_still_get_handles_of_their_own() {
    let (mut c, va) = setup(100 * PAGE, learning());
    let props = crate::gpu::PageProps { tag: 9, ..PROPS };
    let grow_tagged = |c: &mut Coalescer<FakeDriver>| grow_props(c, va, 3, props).unwrap();
    let hs = grow_tagged(&mut c);
    fill(&mut c, va, 3);
    c.export(hs[1]).unwrap();
    assert_eq!(c.stats().exports_split, 1, "coalesced at first: one split");
    shrink(&mut c, va, &hs);
    // Made again and shared again (a KV cache handed to another process each time): nothing
    // to split.
    let hs = grow_tagged(&mut c);
    c.export(hs[1]).unwrap();
    assert_eq!(c.stats().exports_split, 1);
}

/// One round of the tail-split tests: the program maps 4 pages at `at` (known addresses) and
/// gives them back; `keep_last` keeps the last page a giving back longer than the others.
/// Returns the handles the batch got.
fn tail_round(c: &mut Coalescer<FakeDriver>, at: u64, keep_last: bool) -> usize {
    let before = c.counts().1;
    let hs = grow(c, at, 4).unwrap();
    let handles = c.counts().1 - before;
    fill(c, at, 4);
    if keep_last {
        shrink(c, at, &hs[..3]);
        c.giving_back_ended();
        assert_eq!(c.stranded(), 0, "the split kept the batch whole");
        assert!(intact(c, at + 3 * PAGE, 1));
        shrink(c, at + 3 * PAGE, &hs[3..]);
    } else {
        shrink(c, at, &hs);
    }
    c.giving_back_ended();
    assert_eq!(c.driver().used(), 0);
    handles
}

#[test]
fn once_learned_a_batch_keeps_its_last_page_unless_a_split_last_page_kept_a_batch_whole() {
    let tails = CoalesceConfig {
        split_tail: true,
        ..learning()
    };
    let round = tail_round;
    // A program whose batches live and go whole (DeepSpeed's): while cuts are learned the
    // last page is split off; after TAIL_ROUNDS quiet giving backs, no longer.
    let (mut c, va) = setup(100 * PAGE, tails);
    round(&mut c, va, false); // first use: a handle a page
    let mut learning = Vec::new();
    for _ in 1..crate::coalesce::cuts::TAIL_ROUNDS {
        learning.push(round(&mut c, va, false));
    }
    assert!(learning.iter().all(|&h| h == 2), "{learning:?}");
    assert_eq!(round(&mut c, va, false), 1, "learned: one handle a batch");
    assert_eq!(round(&mut c, va, false), 1);
    assert_eq!(c.stats().tail_splits_useful, 0);
    // A program whose batch went back while its last page lived: the split was useful, and
    // stays after the learning.
    let (mut c, va) = setup(100 * PAGE, tails);
    round(&mut c, va, false);
    assert_eq!(round(&mut c, va, true), 2);
    assert_eq!(c.stats().tail_splits_useful, 1);
    for _ in 0..crate::coalesce::cuts::TAIL_ROUNDS + 2 {
        assert_eq!(round(&mut c, va, false), 2, "split for good");
    }
    // The same with batches of two pages: the one page before the last goes back alone (a
    // handle with no page left: nothing stranded, yet the giving back still judges).
    let (mut c, va) = setup(100 * PAGE, tails);
    let hs = grow(&mut c, va, 2).unwrap();
    shrink(&mut c, va, &hs);
    c.giving_back_ended();
    let hs = grow(&mut c, va, 2).unwrap();
    shrink(&mut c, va, &hs[..1]);
    c.giving_back_ended();
    assert_eq!(c.stranded(), 0);
    shrink(&mut c, va + PAGE, &hs[1..]);
    c.giving_back_ended();
    for _ in 0..crate::coalesce::cuts::TAIL_ROUNDS + 2 {
        let before = c.counts().1;
        let hs = grow(&mut c, va, 2).unwrap();
        assert_eq!(c.counts().1 - before, 2, "split for good");
        shrink(&mut c, va, &hs);
        c.giving_back_ended();
    }
    // Without learning, EXPSEG_SPLIT_TAIL alone decides.
    let (mut c, va) = setup(
        100 * PAGE,
        CoalesceConfig {
            split_tail: true,
            ..still()
        },
    );
    for _ in 0..crate::coalesce::cuts::TAIL_ROUNDS + 2 {
        assert_eq!(round(&mut c, va, false), 2);
    }
}

#[test]
fn after_the_first_giving_backs_a_batch_is_split_only_where_no_split_proved_useless_or_when_judged_again(
) {
    use crate::coalesce::cuts::TAIL_LOCAL_ROUNDS;
    let (mut c, va) = setup(
        100 * PAGE,
        CoalesceConfig {
            split_tail: true,
            ..learning()
        },
    );
    let round = tail_round;
    let (a, b, fresh) = (va, va + 20 * PAGE, va + 40 * PAGE);
    // At `a` a split keeps a batch whole (so batches' last pages are split for good); at `b`
    // batches go whole, and their splits prove nothing.
    round(&mut c, a, false);
    assert_eq!(round(&mut c, a, true), 2);
    assert_eq!(c.stats().tail_splits_useful, 1);
    round(&mut c, b, false);
    while c.cuts.rounds() < TAIL_LOCAL_ROUNDS {
        assert_eq!(round(&mut c, b, false), 2, "split everywhere at first");
    }
    assert_eq!(c.cuts.rounds(), TAIL_LOCAL_ROUNDS);
    assert_eq!(round(&mut c, b, false), 2, "every batch judged again");
    assert_eq!(round(&mut c, b, false), 1, "useless here: one a batch");
    assert_eq!(round(&mut c, a, false), 2, "useful here: still split");
    assert_eq!(round(&mut c, a, false), 2, "useful and useless here: split");
    // Addresses where no split was judged yet: split (after the first use's page handles),
    // until one proves useless there.
    assert_eq!(round(&mut c, fresh, false), 4, "first use: a handle a page");
    assert_eq!(round(&mut c, fresh, false), 2);
    assert_eq!(round(&mut c, fresh, false), 1);
    // Every TAIL_LOCAL_ROUNDS-th giving back splits every batch again.
    while !c.cuts.rounds().is_multiple_of(TAIL_LOCAL_ROUNDS) {
        round(&mut c, b, false);
    }
    assert_eq!(round(&mut c, b, false), 2, "judged again");
    assert_eq!(round(&mut c, b, false), 1);
}

#[test]
fn tail_splits_waiting_to_be_judged_are_forgotten_oldest_first() {
    let mut cuts = crate::coalesce::learned::Cuts::default();
    // Batches split at falling addresses: the oldest at the highest.
    let at = |i: u64| (3000 - i) * PAGE;
    for i in 0..1100 {
        cuts.split_tail(at(i) - PAGE, at(i));
    }
    let waiting = cuts.tails_waiting();
    assert_eq!(waiting.len(), 1024);
    assert!(waiting.contains(&at(1099)), "the newest stays");
    assert!(!waiting.contains(&at(0)), "the oldest goes");
    assert!(waiting.contains(&at(76)) && !waiting.contains(&at(75)));
    // Split again: young again.
    cuts.split_tail(at(76) - PAGE, at(76));
    cuts.split_tail(at(2000) - PAGE, at(2000));
    let waiting = cuts.tails_waiting();
    assert!(waiting.contains(&at(76)) && !waiting.contains(&at(77)));
}
