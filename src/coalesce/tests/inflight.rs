//! Pages freed while their device still has work on them, by a thread whose current device is
//! another (PyTorch's `empty_cache()` over two devices waits on the current device's default
//! stream only): no handle leaves its address under that work. And a trim from outside the
//! program's calls (another process's reclaim) moves no live page.

use super::*;

/// PyTorch's `unmapHandles()` from a thread whose current device is `caller`.
fn shrink_from(c: &mut Coalescer<FakeDriver>, at: u64, hs: &[u64], caller: Option<i32>) {
    for (i, h) in hs.iter().enumerate() {
        assert!(c.unmap_from(at + i as u64 * PAGE, PAGE, caller).unwrap());
        c.release(*h).unwrap();
    }
}

#[test]
fn a_handle_freed_from_another_device_waits_for_its_default_stream_before_it_leaves() {
    for caller in [Some(1), None] {
        let (mut c, va) = setup(100 * PAGE, cfg());
        let hs = grow(&mut c, va, 4).unwrap();
        c.driver_mut().launch(va, 4 * PAGE);
        shrink_from(&mut c, va, &hs, caller);
        assert_eq!(c.driver().unmapped_in_flight, 0, "caller {caller:?}");
        assert_eq!(c.driver().default_stream_waits, 1, "one handle, one wait");
        assert_eq!(c.stats().cross_device_waits, 1);
        all_given_back(&mut c);
    }
}

#[test]
fn a_handle_freed_from_its_own_device_adds_no_wait() {
    // The program's own wait covered the memory (PyTorch's on the current device's stream);
    // natively the unmap follows at once, and so it does here.
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    c.driver_mut().launch(va, 4 * PAGE);
    c.driver_mut().synchronize().unwrap(); // the program's wait
    let syncs = c.driver().calls_of(Op::Sync);
    shrink_from(&mut c, va, &hs, Some(0));
    assert_eq!(c.driver().default_stream_waits, 0);
    assert_eq!(c.driver().calls_of(Op::Sync), syncs);
    assert_eq!(c.stats().cross_device_waits, 0);
    assert_eq!(c.driver().unmapped_in_flight, 0);
    all_given_back(&mut c);
}

#[test]
fn pages_of_a_live_handle_freed_from_another_device_wait_before_they_move() {
    // Pages 2-3 go, 0-1 stay: compaction waits for the device before the handle leaves.
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va, 4);
    c.driver_mut().launch(va + 2 * PAGE, 2 * PAGE);
    shrink_from(&mut c, va + 2 * PAGE, &hs[2..], Some(1));
    c.giving_back_ended();
    assert_eq!(c.driver().unmapped_in_flight, 0);
    assert!(intact(&c, va, 2));
    shrink(&mut c, va, &hs[..2]);
    all_given_back(&mut c);
}

#[test]
fn a_kept_handle_freed_from_another_device_waits_when_freed_not_when_given_back() {
    let (mut c, va) = setup(100 * PAGE, delayed());
    let hs = grow(&mut c, va, 4).unwrap();
    c.driver_mut().launch(va, 4 * PAGE);
    shrink_from(&mut c, va, &hs, Some(1));
    assert_eq!(c.kept_bytes(), 4 * PAGE, "parked where it was");
    assert_eq!(c.driver().default_stream_waits, 1);
    // Given back later (quiet, or from another thread): the work it waited for is over.
    all_given_back(&mut c);
    assert_eq!(c.driver().unmapped_in_flight, 0);
    assert_eq!(c.driver().default_stream_waits, 1);
}

#[test]
fn a_failed_wait_still_gives_the_handle_back() {
    // A context already in error (an earlier fault) fails the wait: the unmap goes on, as it
    // would natively, and nothing is held.
    let (mut c, va) = setup(100 * PAGE, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    c.driver_mut().fail(Op::Sync, DrvError(700));
    shrink_from(&mut c, va, &hs, Some(1));
    all_given_back(&mut c);
}

#[test]
fn a_trim_from_outside_moves_no_live_page_and_leaves_that_to_the_programs_next_call() {
    // Another process's reclaim runs on the socket thread while the program's threads may be
    // launching work: bytes grown ahead of live pages stay until the program's next call.
    let (mut c, va) = setup(100 * PAGE, ahead(6));
    c.peak_held = u64::MAX;
    let a = grow(&mut c, va, 2).unwrap();
    fill(&mut c, va, 2);
    assert_eq!(c.ahead_bytes(), 6 * PAGE);
    c.driver_mut().launch(va, 2 * PAGE); // the program at work on its pages
    let (copies, unmaps) = (
        c.driver().calls_of(Op::Copy),
        c.driver().calls_of(Op::Unmap),
    );
    assert_eq!(c.trim_unmoved(), 0, "nothing goes back without a move");
    assert_eq!(c.driver().calls_of(Op::Copy), copies);
    assert_eq!(c.driver().calls_of(Op::Unmap), unmaps);
    assert_eq!(c.driver().unmapped_in_flight, 0);
    assert_eq!(
        c.ahead_bytes(),
        6 * PAGE,
        "still the program's to grow into"
    );
    // The program's next call (here: a create) gives them back first, moving the live pages
    // inside it, as a release loop's stranded pages are.
    c.driver_mut().synchronize().unwrap();
    let b = grow(&mut c, va + 2 * PAGE, 1).unwrap();
    assert_eq!(c.stats().ahead_returned, 6 * PAGE);
    assert!(c.driver().calls_of(Op::Copy) > copies);
    assert!(intact(&c, va, 2));
    shrink(&mut c, va + 2 * PAGE, &b);
    shrink(&mut c, va, &a);
    all_given_back(&mut c);
}

#[test]
fn a_trim_from_outside_gives_back_kept_and_idle_handles_at_once() {
    // Kept handles (parked where their pages were) and handles with no live page need no
    // move: they go back in the reclaim; stranded pages of a partly released handle wait.
    let (mut c, va) = setup(100 * PAGE, delayed());
    let a = grow(&mut c, va, 4).unwrap();
    let b = grow(&mut c, va + 4 * PAGE, 4).unwrap();
    fill(&mut c, va + 4 * PAGE, 4);
    shrink(&mut c, va, &a);
    shrink(&mut c, va + 6 * PAGE, &b[2..]);
    assert_eq!(c.kept_bytes(), 4 * PAGE);
    c.driver_mut().launch(va + 4 * PAGE, 2 * PAGE);
    let copies = c.driver().calls_of(Op::Copy);
    assert_eq!(c.trim_unmoved(), 4 * PAGE, "the kept handle");
    assert_eq!(c.kept_bytes(), 0);
    assert_eq!(c.driver().calls_of(Op::Copy), copies, "no live page moved");
    assert_eq!(c.driver().unmapped_in_flight, 0);
    assert!(c.stranded() > 0, "the released half waits for the program");
    c.driver_mut().synchronize().unwrap();
    c.giving_back_ended();
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.driver().used(), 2 * PAGE);
    assert!(intact(&c, va + 4 * PAGE, 2));
    shrink(&mut c, va + 4 * PAGE, &b[..2]);
    all_given_back(&mut c);
}

#[test]
fn a_trim_from_inside_still_gives_back_everything_at_once() {
    let (mut c, va) = setup(100 * PAGE, ahead(6));
    c.peak_held = u64::MAX;
    let a = grow(&mut c, va, 2).unwrap();
    fill(&mut c, va, 2);
    assert_eq!(c.trim(), 6 * PAGE);
    assert_eq!(c.held_beyond_live(), 0);
    assert!(intact(&c, va, 2));
    shrink(&mut c, va, &a);
    all_given_back(&mut c);
}

#[test]
fn calls_from_another_thread_leave_the_owed_compaction_to_the_devices_own_thread() {
    // A model split: bytes grown ahead of device 1's live pages are owed to its next call (a
    // trim from outside left them). Device 0's thread then frees an address range and pauses
    // a tag: neither moves a live page of device 1 (its worker may be launching work on
    // them). Device 1's own next call does.
    let (mut c, va) = setup(100 * PAGE, ahead(6));
    c.peak_held = u64::MAX;
    let a = grow(&mut c, va, 2).unwrap();
    fill(&mut c, va, 2);
    c.driver_mut().launch(va, 2 * PAGE);
    assert_eq!(c.trim_unmoved(), 0);
    let copies = c.driver().calls_of(Op::Copy);
    c.allow_moves(false);
    c.address_free(va + 50 * PAGE, PAGE).unwrap();
    c.pause(&|t| (t == 9).then_some(true)).unwrap();
    assert_eq!(c.driver().calls_of(Op::Copy), copies, "no live page moved");
    assert_eq!(c.driver().unmapped_in_flight, 0);
    assert_eq!(
        c.ahead_bytes(),
        6 * PAGE,
        "still owed to device 1's next call"
    );
    // Device 1's own call (a create) gives it back, moving the live pages.
    c.allow_moves(true);
    c.driver_mut().synchronize().unwrap();
    let b = grow(&mut c, va + 10 * PAGE, 1).unwrap();
    assert!(c.driver().calls_of(Op::Copy) > copies);
    assert_eq!(c.stats().ahead_returned, 6 * PAGE);
    assert!(intact(&c, va, 2));
    shrink(&mut c, va + 10 * PAGE, &b);
    shrink(&mut c, va, &a);
    all_given_back(&mut c);
}
