//! Compaction: partial release with data intact, peers waited for, every failing step undone,
//! the host path and its undo.

use super::*;

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
    // The last page of the handle released: its bytes go back at once, so the compaction
    // runs inside that call (and meets the failure).
    shrink(&mut c, va + 4 * PAGE, &hs[4..]);
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

#[test]
fn released_pages_go_back_before_the_release_returns() {
    // Release at once (no keeping): the tail of a handle released page by page, as PyTorch's
    // empty_cache() does; when the last page's cuMemRelease returns, its bytes are back.
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 8).unwrap();
    fill(&mut c, va, 8);
    for (i, h) in hs.iter().enumerate().skip(3) {
        assert!(c.unmap(va + i as u64 * PAGE, PAGE).unwrap());
        c.release(*h).unwrap();
        if i < 7 {
            // The loop goes on over the same handle: nothing is copied yet.
            assert_eq!(c.stats().compactions, 0, "page {i}");
            assert!(c.settle_deferred());
        }
    }
    assert_eq!(c.stats().compactions, 1, "once for the whole loop");
    assert!(!c.settle_deferred());
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.held_beyond_live(), 0);
    assert_eq!(c.driver().used(), 3 * PAGE);
    assert!(intact(&c, va, 3));
    shrink(&mut c, va, &hs[..3]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_release_loop_that_ends_inside_a_handle_settles_at_the_next_other_call() {
    // Pages 2..5 of 8 go, 5..8 stay live: after the loop the handle's next page is live, so
    // expseg cannot tell the loop ended; any call that is not the loop's next step settles
    // first (never a thread of expseg's: moving live pages is safe only inside the program's
    // own calls).
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 8).unwrap();
    fill(&mut c, va, 8);
    shrink(&mut c, va + 2 * PAGE, &hs[2..5]);
    assert!(c.settle_deferred());
    assert_eq!(c.held_beyond_live(), 3 * PAGE);
    // Another call (here: the unmap of a page that is not the loop's next one).
    let other = grow(&mut c, va + 100 * PAGE, 1).unwrap();
    assert!(!c.settle_deferred());
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.driver().used(), 6 * PAGE);
    assert!(intact(&c, va, 2) && intact(&c, va + 5 * PAGE, 3));
    // The same through an unmap elsewhere.
    shrink(&mut c, va + 6 * PAGE, &hs[6..7]);
    assert!(c.settle_deferred());
    assert!(c.unmap(va + 100 * PAGE, PAGE).unwrap());
    assert!(!c.settle_deferred());
    assert_eq!(c.stranded(), 0);
    c.release(other[0]).unwrap();
    shrink(&mut c, va, &hs[..2]);
    shrink(&mut c, va + 5 * PAGE, &hs[5..6]);
    shrink(&mut c, va + 7 * PAGE, &hs[7..]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn trim_gives_back_kept_handles_and_stranded_pages() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 8).unwrap();
    let hs2 = grow(&mut c, va + 8 * PAGE, 4).unwrap();
    fill(&mut c, va, 8);
    // With keeping on, released pages stay: 4 kept (a whole handle), 3 stranded.
    shrink(&mut c, va + 8 * PAGE, &hs2);
    shrink(&mut c, va + 2 * PAGE, &hs[2..5]);
    assert_eq!(c.held_beyond_live(), 7 * PAGE);
    assert_eq!(c.driver().used(), 12 * PAGE);
    assert_eq!(c.trim(), 7 * PAGE);
    assert_eq!(c.held_beyond_live(), 0);
    assert_eq!(c.driver().used(), 5 * PAGE);
    assert!(intact(&c, va, 2) && intact(&c, va + 5 * PAGE, 3));
    assert_eq!(c.trim(), 0, "nothing left to give");
    shrink(&mut c, va, &hs[..2]);
    shrink(&mut c, va + 5 * PAGE, &hs[5..]);
    all_given_back(&mut c);
}

#[test]
fn mapped_live_pages_move_through_one_copy_and_hold() {
    // The copies of a move of mapped pages and the hold on the default stream are one driver
    // call (the real driver launches them as one graph, so another thread's kernels queue
    // behind the move); pages that are not mapped need no hold.
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 8).unwrap();
    fill(&mut c, va, 8);
    shrink(&mut c, va + 2 * PAGE, &hs[2..6]);
    c.settle(false);
    assert_eq!(c.stranded(), 0);
    assert_eq!(
        c.driver().held_copies,
        vec![2],
        "pages 0-1 and 6-7: two copies, one hold"
    );
    assert!(intact(&c, va, 2) && intact(&c, va + 6 * PAGE, 2));
    shrink(&mut c, va, &hs[..2]);
    shrink(&mut c, va + 6 * PAGE, &hs[6..]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_move_holds_the_peers_given_access_where_asked() {
    // EXPSEG_PEER_HOLD=1: the devices given access to moving pages have their default
    // streams held through the move (a kernel another thread queues there may write the
    // pages); off, they are only waited for; `self` holds the device's own stream, a test of
    // the hold on one GPU.
    use crate::config::PeerHold;
    for (mode, want) in [
        (PeerHold::Off, vec![]),
        (PeerHold::On, vec![1]),
        (PeerHold::SelfTest, vec![0]),
    ] {
        let (mut c, va) = setup(
            100 * PAGE,
            CoalesceConfig {
                peer_hold: mode,
                ..cfg()
            },
        );
        let hs = grow(&mut c, va, 8).unwrap();
        assert!(c.set_access(va, 8 * PAGE, &[(0, RW), (1, RW)]).unwrap());
        fill(&mut c, va, 8);
        shrink(&mut c, va + 2 * PAGE, &hs[2..6]);
        c.settle(false);
        assert_eq!(c.stranded(), 0);
        assert_eq!(c.driver().held_peers, vec![want.clone()], "{mode:?}");
        assert_eq!(c.stats().peer_holds, want.len() as u64, "{mode:?}");
        assert_eq!(c.stats().peer_holds_let_go, 0);
        assert_eq!(c.driver().peers_synced, vec![1], "waited for in every mode");
        assert!(intact(&c, va, 2) && intact(&c, va + 6 * PAGE, 2));
        shrink(&mut c, va, &hs[..2]);
        shrink(&mut c, va + 6 * PAGE, &hs[6..]);
        assert_eq!(c.driver().used(), 0);
    }
}

/// `EXPSEG_PEER_HOLD=1` with `n` pages live at the start of a reservation of `capacity`
/// bytes (`margin` 0), given access as `access` says, and device 1's hold never starting
/// (its stream busy, or waiting on other work).
fn unheld_peer(
    capacity: u64,
    n: u64,
    access: &[(i32, u32)],
) -> (Coalescer<FakeDriver>, u64, Vec<u64>) {
    let mut k = CoalesceConfig {
        peer_hold: crate::config::PeerHold::On,
        ..cfg()
    };
    k.margin = 0;
    let (mut c, va) = setup(capacity, k);
    c.driver_mut().peer_holds_start = false;
    let hs = grow(&mut c, va, n).unwrap();
    assert!(c.set_access(va, n * PAGE, access).unwrap());
    fill(&mut c, va, n);
    (c, va, hs)
}

#[test]
fn a_move_that_gives_bytes_back_waits_for_a_peer_that_cannot_be_held() {
    // Where a peer's hold does not start (its stream busy, or waiting on other work), its
    // kernels queued meanwhile could write the pages while they move (an illegal address on
    // two GPUs): a move that only gives stranded bytes back is put off, nothing
    // changed, and made by a later call once the peer can be held.
    let (mut c, va, hs) = unheld_peer(100 * PAGE, 8, &[(0, RW), (1, RW), (2, 0)]);
    shrink(&mut c, va + 2 * PAGE, &hs[2..6]);
    c.settle(false);
    assert_eq!(c.stranded(), 4 * PAGE, "put off: the bytes stay");
    assert_eq!(c.driver().used(), 8 * PAGE, "the new handles went back");
    assert_eq!(
        c.driver().held_peers,
        vec![vec![1]],
        "device 2 has no access: not held"
    );
    assert_eq!((c.stats().peer_holds, c.stats().peer_holds_let_go), (0, 1));
    assert_eq!(
        (
            c.stats().moves_put_off,
            c.stats().compactions,
            c.stats().compaction_failures
        ),
        (1, 0, 0)
    );
    assert!(intact(&c, va, 2) && intact(&c, va + 6 * PAGE, 2));
    assert!(
        c.driver().is_accessible(va, 2 * PAGE, 1),
        "the peer keeps access"
    );
    assert_eq!(c.driver().peer_waits, vec![crate::gpu::PeerWait::Brief]);
    // Once the peer's hold starts, the next call moves them.
    c.driver_mut().peer_holds_start = true;
    c.settle(false);
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.driver().used(), 4 * PAGE);
    assert_eq!((c.stats().peer_holds, c.stats().compactions), (1, 1));
    assert!(intact(&c, va, 2) && intact(&c, va + 6 * PAGE, 2));
    assert!(c.driver().is_accessible(va + 6 * PAGE, 2 * PAGE, 1));
    shrink(&mut c, va, &hs[..2]);
    shrink(&mut c, va + 6 * PAGE, &hs[6..]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_trim_waits_patiently_for_a_peer_and_still_puts_the_move_off() {
    // Memory asked for (a near-full allocation, expseg.trim()): worth a patient wait for the
    // peer's hold, but a hold that never starts still leaves the pages where they are.
    let (mut c, va, hs) = unheld_peer(100 * PAGE, 8, &[(0, RW), (1, RW)]);
    shrink(&mut c, va + 2 * PAGE, &hs[2..6]);
    c.driver_mut().peer_waits.clear();
    assert_eq!(c.trim(), 0);
    assert_eq!(c.driver().peer_waits, vec![crate::gpu::PeerWait::Patient]);
    assert_eq!(c.stranded(), 4 * PAGE);
    assert!(c.stats().moves_put_off >= 1);
    assert!(intact(&c, va, 2) && intact(&c, va + 6 * PAGE, 2));
    c.driver_mut().peer_holds_start = true;
    assert_eq!(c.trim(), 4 * PAGE);
    assert!(intact(&c, va, 2) && intact(&c, va + 6 * PAGE, 2));
    shrink(&mut c, va, &hs[..2]);
    shrink(&mut c, va + 6 * PAGE, &hs[6..]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_move_through_the_host_holds_nothing_and_is_made_with_a_peer_to_hold() {
    // Pages copied through the host (no room on the device) hold nothing, the device's own
    // stream included: waited for, as without the option. Putting them off would keep the
    // stranded bytes exactly when memory runs short.
    let (mut c, va, hs) = unheld_peer(10 * PAGE, 8, &[(0, RW), (1, RW)]);
    shrink(&mut c, va + 4 * PAGE, &hs[4..]);
    c.settle(false);
    assert!(c.stats().host_copies >= 1);
    assert_eq!(c.stats().moves_put_off, 0);
    assert_eq!(c.stranded(), 0);
    assert!(intact(&c, va, 4));
    assert!(
        c.driver().is_accessible(va, 4 * PAGE, 1),
        "the peer keeps access"
    );
    shrink(&mut c, va, &hs[..4]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_move_the_program_needs_goes_on_without_the_peer_hold() {
    // An export of one page of a shared handle splits it now (the call needs its own
    // handle): the peer's hold is waited for patiently (its queue may take seconds), and one
    // that never starts is let go and the move made as with the hold off.
    let (mut c, va, hs) = unheld_peer(100 * PAGE, 4, &[(0, RW), (1, RW)]);
    c.export(hs[1]).unwrap();
    assert_eq!(c.stats().exports_split, 1);
    assert_eq!(c.driver().peer_waits, vec![crate::gpu::PeerWait::Patient]);
    assert_eq!(
        (c.stats().moves_put_off, c.stats().peer_holds_let_go),
        (0, 1)
    );
    assert!(intact(&c, va, 4));
    shrink(&mut c, va, &hs);
    assert_eq!(c.driver().used(), 0);
}
