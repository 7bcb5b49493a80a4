//! Pausing coalesced pages: offload and discard, tags, exported pages left alone, program
//! calls on paused pages, out of memory on resume and the retry.

use super::*;

const OFFLOAD: Option<bool> = Some(false);

fn tagged(tag: u32) -> PageProps {
    PageProps { tag, ..PROPS }
}

/// Like `grow`, with pages of `props`.
fn grow_as(c: &mut Coalescer<FakeDriver>, at: u64, n: u64, props: PageProps) -> Vec<u64> {
    let hs: Vec<u64> = (0..n).map(|_| c.create(PAGE, props).unwrap()).collect();
    for (i, h) in hs.iter().enumerate() {
        c.map(at + i as u64 * PAGE, PAGE, 0, *h).unwrap();
    }
    assert!(c.set_access(at, n * PAGE, &[(0, RW)]).unwrap());
    hs
}

#[test]
fn paused_pages_give_memory_back_and_come_back_with_their_bytes() {
    let (mut c, va) = setup(1 << 40, cfg());
    let a = grow(&mut c, va, 6).unwrap();
    let b = grow(&mut c, va + 10 * PAGE, 3).unwrap();
    fill(&mut c, va, 6);
    fill(&mut c, va + 10 * PAGE, 3);
    let out = c.pause(&|_| OFFLOAD).unwrap();
    assert_eq!(
        (out.bytes, out.offloaded, out.shared),
        (9 * PAGE, 9 * PAGE, 0)
    );
    assert_eq!(c.driver().used(), 0, "every handle back to the driver");
    assert_eq!(c.driver().mapping_count(), 0);
    assert_eq!(c.paused_bytes(), 9 * PAGE);
    assert_eq!(c.physical_bytes(), 0);
    assert_eq!(
        c.pause(&|_| OFFLOAD).unwrap().bytes,
        0,
        "twice: nothing more"
    );
    assert_eq!(c.resume(&|_| true).unwrap(), 9 * PAGE);
    assert!(intact(&c, va, 6) && intact(&c, va + 10 * PAGE, 3));
    assert_eq!(c.driver().host_buffers(), (0, 0));
    assert_eq!(c.resume(&|_| true).unwrap(), 0, "resume without pause");
    // The program goes on as if nothing happened.
    shrink(&mut c, va, &a);
    shrink(&mut c, va + 10 * PAGE, &b);
    all_given_back(&mut c);
}

#[test]
fn tags_split_handles_and_pause_alone_discarded_ones_keep_no_copy() {
    let (mut c, va) = setup(1 << 40, cfg());
    // Back to back, two tags: never one handle.
    let w = grow_as(&mut c, va, 4, tagged(0));
    let kv = grow_as(&mut c, va + 4 * PAGE, 4, tagged(9));
    fill(&mut c, va, 8);
    let out = c.pause(&|t| (t == 9).then_some(true)).unwrap();
    assert_eq!((out.bytes, out.offloaded), (4 * PAGE, 0));
    assert_eq!(c.driver().host_buffers(), (0, 0));
    assert!(intact(&c, va, 4), "the untagged pages are untouched");
    assert!(!c.driver().is_accessible(va + 4 * PAGE, PAGE, 0));
    assert_eq!(c.resume(&|t| t == 9).unwrap(), 4 * PAGE);
    assert!(c.driver().is_accessible(va + 4 * PAGE, 4 * PAGE, 0));
    shrink(&mut c, va, &w);
    shrink(&mut c, va + 4 * PAGE, &kv);
    all_given_back(&mut c);
}

#[test]
fn exported_pages_are_left_alone() {
    let (mut c, va) = setup(1 << 40, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    let other = grow(&mut c, va + 10 * PAGE, 2).unwrap();
    fill(&mut c, va, 4);
    fill(&mut c, va + 10 * PAGE, 2);
    // Exporting a page splits its handle page by page; none of them is paused.
    c.export(hs[1]).unwrap();
    let out = c.pause(&|_| OFFLOAD).unwrap();
    assert_eq!(out.shared, 4 * PAGE);
    assert_eq!(out.bytes, 2 * PAGE);
    assert!(intact(&c, va, 4));
    c.resume(&|_| true).unwrap();
    assert!(intact(&c, va + 10 * PAGE, 2));
    shrink(&mut c, va, &hs);
    shrink(&mut c, va + 10 * PAGE, &other);
    all_given_back(&mut c);
}

#[test]
fn pages_released_while_paused_need_no_memory_and_other_calls_resume_first() {
    let (mut c, va) = setup(1 << 40, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    let more = grow(&mut c, va + 10 * PAGE, 2).unwrap();
    fill(&mut c, va, 4);
    fill(&mut c, va + 10 * PAGE, 2);
    c.pause(&|_| OFFLOAD).unwrap();
    let calls = c.driver().total_calls();
    // New pages while paused: their own memory, nothing woken.
    let new = grow(&mut c, va + 20 * PAGE, 2).unwrap();
    assert_eq!(c.paused_bytes(), 6 * PAGE);
    let calls = c.driver().total_calls() - calls;
    // empty_cache() on paused pages: gone from the books and the host, no driver call.
    let before = c.driver().total_calls();
    shrink(&mut c, va, &hs);
    assert_eq!(
        c.driver().total_calls(),
        before,
        "released while paused: nothing to do"
    );
    assert_eq!(c.paused_bytes(), 2 * PAGE);
    assert_eq!(c.driver().host_buffers().1 % (2 * PAGE), 0);
    assert!(calls > 0);
    // Exporting a paused page resumes its handle first.
    c.export(more[0]).unwrap();
    assert_eq!(c.paused_bytes(), 0);
    assert!(intact(&c, va + 10 * PAGE, 2));
    shrink(&mut c, va + 10 * PAGE, &more);
    shrink(&mut c, va + 20 * PAGE, &new);
    assert_eq!(c.driver().host_buffers(), (0, 0));
    all_given_back(&mut c);
}

#[test]
fn an_access_call_on_paused_pages_resumes_them_after_every_pause() {
    let (mut c, va) = setup(1 << 40, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va, 4);
    for round in 0..3 {
        c.pause(&|_| OFFLOAD).unwrap();
        assert_eq!(c.paused_bytes(), 4 * PAGE, "round {round}");
        // The program sets access again on its pages: they come back first, bytes intact.
        assert!(c.set_access(va, 4 * PAGE, &[(0, RW)]).unwrap());
        assert_eq!(
            c.paused_bytes(),
            0,
            "round {round}: resumed by the access call"
        );
        assert!(intact(&c, va, 4), "round {round}");
        // Calls on awake memory between pauses find nothing to resume.
        assert!(c.set_access(va, 4 * PAGE, &[(0, RW)]).unwrap());
        assert!(intact(&c, va, 4));
    }
    shrink(&mut c, va, &hs);
    assert_eq!(c.driver().host_buffers(), (0, 0));
    all_given_back(&mut c);
}

#[test]
fn out_of_memory_on_resume_loses_nothing_and_a_retry_finishes() {
    let mut k = cfg();
    k.max_handle = 2 * PAGE;
    let (mut c, va) = setup(8 * PAGE, k);
    let hs = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va, 4);
    c.pause(&|_| OFFLOAD).unwrap();
    assert_eq!(c.driver().used(), 0);
    // Another process takes most of the memory meanwhile.
    let other = c.driver_mut().create(6 * PAGE).unwrap();
    assert_eq!(c.resume(&|_| true), Err(DrvError::OUT_OF_MEMORY));
    assert_eq!(
        c.paused_bytes(),
        2 * PAGE,
        "one handle made, one still paused"
    );
    assert_eq!(c.driver().host_buffers().1, 4 * PAGE, "host copies kept");
    c.driver_mut().release(other).unwrap();
    assert_eq!(c.resume(&|_| true).unwrap(), 2 * PAGE);
    assert!(intact(&c, va, 4));
    assert_eq!(c.driver().host_buffers(), (0, 0));
    shrink(&mut c, va, &hs);
    all_given_back(&mut c);
}

#[test]
fn a_resume_short_of_memory_resumes_the_smaller_handles_that_fit() {
    // A 4-page handle first, a 1-page one after it, room for 2 pages: the large one stays
    // paused, the small one comes back (the first failure does not end the resume).
    let (mut c, va) = setup(1 << 40, cfg());
    let big = grow(&mut c, va, 4).unwrap();
    let small = grow(&mut c, va + 10 * PAGE, 1).unwrap();
    fill(&mut c, va, 4);
    fill(&mut c, va + 10 * PAGE, 1);
    c.pause(&|_| OFFLOAD).unwrap();
    c.driver_mut().set_capacity(2 * PAGE);
    assert_eq!(c.resume(&|_| true), Err(DrvError::OUT_OF_MEMORY));
    assert_eq!(c.paused_bytes(), 4 * PAGE, "the small handle resumed");
    assert!(intact(&c, va + 10 * PAGE, 1));
    c.driver_mut().set_capacity(1 << 40);
    assert_eq!(c.resume(&|_| true).unwrap(), 4 * PAGE);
    assert!(intact(&c, va, 4) && intact(&c, va + 10 * PAGE, 1));
    shrink(&mut c, va, &big);
    shrink(&mut c, va + 10 * PAGE, &small);
    all_given_back(&mut c);
}

#[test]
fn a_pause_waits_for_peer_devices_first() {
    // A peer given access to the pages (PyTorch's addPeer) may still be reading them: it is
    // waited for before they go, and a peer that cannot be waited for stops the pause.
    let (mut c, va) = setup(1 << 40, cfg());
    let hs = grow(&mut c, va, 4).unwrap();
    assert!(c.set_access(va, 4 * PAGE, &[(0, RW), (1, RW)]).unwrap());
    fill(&mut c, va, 4);
    // The first wait (this device's) passes, the peer's fails.
    c.driver_mut().fail_nth(Op::Sync, 1, DrvError(700));
    assert_eq!(c.pause(&|_| OFFLOAD), Err(DrvError(700)));
    assert_eq!(c.paused_bytes(), 0, "nothing paused");
    assert!(intact(&c, va, 4));
    c.driver_mut().clear_failures();
    assert!(c.driver().peers_synced.is_empty());
    assert_eq!(c.pause(&|_| OFFLOAD).unwrap().bytes, 4 * PAGE);
    assert_eq!(
        c.driver().peers_synced,
        vec![1],
        "device 1 was waited for, once"
    );
    assert_eq!(c.resume(&|_| true).unwrap(), 4 * PAGE);
    assert!(intact(&c, va, 4));
    assert!(
        c.driver().is_accessible(va, 4 * PAGE, 1),
        "the peer keeps access"
    );
    shrink(&mut c, va, &hs);
    all_given_back(&mut c);
}

#[test]
fn a_failed_copy_pauses_nothing() {
    let (mut c, va) = setup(1 << 40, cfg());
    let hs = grow(&mut c, va, 3).unwrap();
    fill(&mut c, va, 3);
    c.driver_mut().fail(Op::Copy, DrvError(700));
    assert_eq!(c.pause(&|_| OFFLOAD), Err(DrvError(700)));
    assert_eq!(c.paused_bytes(), 0);
    assert!(intact(&c, va, 3));
    assert_eq!(c.driver().host_buffers(), (0, 0));
    shrink(&mut c, va, &hs);
    all_given_back(&mut c);
}

#[test]
fn randomized_pauses_between_the_programs_calls_keep_data_and_books_exact() {
    use super::randomized::{grow_live, release_random_run, Rng};
    for seed in seeds(8) {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut k = cfg();
        k.max_handle = [4, 16][seed as usize % 2] * PAGE;
        k.ahead = [0, 2 * PAGE][seed as usize % 2];
        if seed % 3 == 0 {
            k.release_delay = std::time::Duration::from_secs(3600);
        }
        let (mut c, va) = setup(60 * PAGE, k);
        c.peak_held = u64::MAX;
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        for step in 0..200 {
            match rng.below(8) {
                0..=2 => {
                    let n = 1 + rng.below(5);
                    if let Err(e) = grow_live(&mut c, va, &mut live, n) {
                        assert!(e.is_oom(), "seed {seed} step {step}: {e}");
                    }
                }
                3 | 4 => {
                    release_random_run(&mut c, va, &mut rng, &mut live);
                }
                5 => {
                    c.pause(&|_| OFFLOAD).unwrap();
                    assert_eq!(c.held_beyond_live(), 0, "seed {seed} step {step}");
                }
                _ => match c.resume(&|_| true) {
                    Ok(_) => assert_eq!(c.paused_bytes(), 0),
                    Err(e) => assert!(e.is_oom(), "seed {seed} step {step}: {e}"),
                },
            }
            // Every live page is intact, or paused (its bytes on the host).
            for &s in live.keys() {
                let a = va + s * PAGE;
                assert!(
                    intact(&c, a, 1) || !c.driver().is_accessible(a, PAGE, 0),
                    "seed {seed} step {step} slot {s}"
                );
            }
            assert_eq!(
                c.driver().used(),
                c.physical_bytes(),
                "seed {seed} step {step}"
            );
        }
        // Memory may be short for all of it: the program frees awake pages until it fits.
        while let Err(e) = c.resume(&|_| true) {
            assert!(e.is_oom());
            let awake = live
                .keys()
                .copied()
                .find(|s| c.driver().is_accessible(va + s * PAGE, PAGE, 0))
                .expect("memory is short only while some pages are awake");
            let h = live.remove(&awake).unwrap();
            assert!(intact(&c, va + awake * PAGE, 1));
            shrink(&mut c, va + awake * PAGE, &[h]);
        }
        for &s in live.keys() {
            assert!(
                intact(&c, va + s * PAGE, 1),
                "seed {seed}: slot {s} after resume"
            );
        }
        let rest: Vec<(u64, u64)> = live.into_iter().collect();
        for (s, h) in rest {
            shrink(&mut c, va + s * PAGE, &[h]);
        }
        c.settle(true);
        c.release_kept();
        assert_eq!(c.driver().host_buffers(), (0, 0), "seed {seed}");
        assert_eq!(c.driver().used(), 0, "seed {seed}: nothing leaked");
        assert_eq!(c.counts(), (0, 0), "seed {seed}");
    }
}

#[test]
fn a_pause_from_outside_gives_back_bytes_grown_ahead_and_no_paused_handle_is_compacted() {
    // `expseg pause PID` runs on the socket thread, which moves nothing: bytes grown ahead
    // stay until the program's next call. The pause releases the whole handle, so they go
    // back with it, and that next call must not compact the paused handle (its memory is
    // not mapped: a copy would read nothing).
    let (mut c, va) = setup(1 << 40, ahead(4));
    c.peak_held = u64::MAX;
    let _hs = grow(&mut c, va, 2).unwrap();
    fill(&mut c, va, 2);
    assert!(c.ahead_bytes() > 0);
    c.allow_moves(false);
    c.pause(&|_| OFFLOAD).unwrap();
    c.allow_moves(true);
    assert_eq!(c.ahead_bytes(), 0, "went back with the paused handle");
    assert_eq!(c.held_beyond_live(), 0);
    assert_eq!(c.driver().used(), 0);
    let creates = c.driver().calls_of(Op::Create);
    let _n = grow(&mut c, va + 100 * PAGE, 1).unwrap();
    assert_eq!(
        c.stats().compaction_failures,
        0,
        "a paused handle was compacted"
    );
    assert_eq!(
        c.driver().calls_of(Op::Create),
        creates + 1,
        "the new page only"
    );
    c.resume(&|_| true).unwrap();
    assert!(intact(&c, va, 2));
    c.trim();
    assert_eq!(c.held_beyond_live(), 0);
    assert_eq!(c.driver().used(), 3 * PAGE);
}

#[test]
fn sharing_a_run_resumes_only_its_paused_handles() {
    let (mut c, va) = setup(1 << 40, cfg());
    let _w = grow_as(&mut c, va, 2, tagged(0));
    let _kv = grow_as(&mut c, va + 10 * PAGE, 2, tagged(9));
    fill(&mut c, va, 2);
    fill(&mut c, va + 10 * PAGE, 2);
    // Weights awake, the KV cache paused: sharing a weight leaves the KV cache paused.
    c.pause(&|t| (t == 9).then_some(false)).unwrap();
    c.share_run(va, usize::MAX).unwrap();
    assert_eq!(c.paused_bytes(), 2 * PAGE, "the KV cache stays paused");
    // Sharing a paused page resumes its run, with its bytes.
    c.share_run(va + 10 * PAGE + 5, usize::MAX).unwrap();
    assert_eq!(c.paused_bytes(), 0);
    assert!(intact(&c, va + 10 * PAGE, 2));
    // Its pages are shared now: a later pause leaves them alone.
    assert_eq!(c.pause(&|_| OFFLOAD).unwrap().shared, 4 * PAGE);
}

#[test]
fn sharing_a_paused_run_without_memory_to_resume_it_fails_and_shares_nothing() {
    let (mut c, va) = setup(8 * PAGE, cfg());
    let _w = grow_as(&mut c, va, 2, tagged(0));
    let _kv = grow_as(&mut c, va + 10 * PAGE, 2, tagged(9));
    fill(&mut c, va + 10 * PAGE, 2);
    c.pause(&|t| (t == 9).then_some(false)).unwrap();
    let other = c.driver_mut().create(6 * PAGE).unwrap();
    assert!(c
        .share_run(va + 10 * PAGE, usize::MAX)
        .unwrap_err()
        .is_oom());
    // An awake run still shares while the paused one waits for memory.
    c.share_run(va, usize::MAX).unwrap();
    c.driver_mut().release(other).unwrap();
    let out = c.pause(&|_| OFFLOAD).unwrap();
    assert_eq!(
        out.shared,
        2 * PAGE,
        "the shared run is left alone, the other was not shared"
    );
    c.resume(&|_| true).unwrap();
    assert!(intact(&c, va + 10 * PAGE, 2));
}

#[test]
fn a_handle_that_cannot_resume_does_not_hold_back_the_others() {
    let (mut c, va) = setup(1 << 40, cfg());
    let _a = grow_as(&mut c, va, 2, tagged(1));
    let _b = grow_as(&mut c, va + 10 * PAGE, 2, tagged(2));
    fill(&mut c, va, 2);
    fill(&mut c, va + 10 * PAGE, 2);
    c.pause(&|_| OFFLOAD).unwrap();
    // The first handle's mapping fails (not for memory): the second still comes back.
    c.driver_mut().fail(Op::Map, crate::gpu::DrvError(1));
    assert_eq!(c.resume(&|_| true).unwrap_err(), crate::gpu::DrvError(1));
    assert_eq!(
        c.paused_bytes(),
        2 * PAGE,
        "one handle resumed, one still paused"
    );
    assert!(intact(&c, va, 2) || intact(&c, va + 10 * PAGE, 2));
    assert_eq!(c.resume(&|_| true).unwrap(), 2 * PAGE);
    assert!(intact(&c, va, 2) && intact(&c, va + 10 * PAGE, 2));
    assert_eq!(c.driver().host_buffers(), (0, 0));
}

#[test]
fn bytes_grown_ahead_of_live_pages_are_not_paused_and_do_not_come_back() {
    // The defaults move no live page: the trim before a pause keeps what a handle of mapped
    // pages grew ahead. The pause releases it with the handle; it is not the tag's memory,
    // so it is neither counted as paused nor made again on resume (on a GPU, a tagged KV
    // cache paused more than its own bytes before).
    let mut k = still();
    k.split_tail = true;
    k.ahead = 8 * PAGE;
    let (mut c, va) = setup(1 << 40, k);
    c.peak_held = u64::MAX;
    for b in 0..4 {
        grow_as(&mut c, va + b * 5 * PAGE, 5, tagged(9));
    }
    fill(&mut c, va, 20);
    assert!(c.ahead_bytes() > 0, "the last batch's tail grew ahead");
    for discard in [false, true] {
        let out = c.pause(&|t| (t == 9).then_some(discard)).unwrap();
        assert_eq!(out.bytes, 20 * PAGE, "discard {discard}");
        assert_eq!(c.paused_bytes(), 20 * PAGE);
        assert_eq!(c.driver().used(), 0);
        assert_eq!(c.resume(&|t| t == 9).unwrap(), 20 * PAGE);
        assert_eq!(c.held_beyond_live(), 0, "nothing stranded after the resume");
        assert_eq!(c.driver().used(), 20 * PAGE);
        if !discard {
            assert!(intact(&c, va, 20));
        }
    }
}
