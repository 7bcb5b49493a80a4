//! Pages freed while their device still has work on them, by a thread whose current device is
//! another (PyTorch's `empty_cache()` over two devices waits on the current device's default
//! stream only): no handle leaves its address under that work.

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
