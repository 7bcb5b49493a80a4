//! The defaults' rule (`EXPSEG_COMPACT` off): no page the program has mapped is ever unmapped
//! by expseg, whatever the program calls, except its own sharing calls (an export, a run
//! shared by IPC). Released pages of live handles stay held, and new pages mapped where they
//! were take them in place.

use super::randomized::{free_run, grow_live_as, pick, Rng};
use super::*;

/// The fake driver watches every page the program has mapped.
fn watch(c: &mut Coalescer<FakeDriver>, va: u64, live: &BTreeMap<u64, u64>) {
    c.driver_mut().watched = live.keys().map(|s| (va + s * PAGE, PAGE)).collect();
}

#[test]
fn a_partly_released_handle_keeps_its_live_pages_where_they_are() {
    let (mut c, va) = setup(100 * PAGE, still());
    let hs = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va, 4);
    c.driver_mut().watched = vec![(va + 2 * PAGE, 2 * PAGE)];
    shrink(&mut c, va, &hs[..2]);
    c.giving_back_ended();
    c.settle(false);
    c.settle(true);
    c.trim();
    assert_eq!(c.driver().unmapped_watched, 0, "no live page moved");
    assert_eq!(c.stats().compactions, 0);
    assert_eq!(c.stranded(), 2 * PAGE);
    assert_eq!(c.stats().peak_stranded, 2 * PAGE);
    assert_eq!(c.stats().peak_held, 4 * PAGE);
    assert!(intact(&c, va + 2 * PAGE, 2));
    assert_eq!(c.driver().used(), 4 * PAGE);
    // The handle's last pages go: all of it goes back before the call returns.
    shrink(&mut c, va + 2 * PAGE, &hs[2..]);
    assert_eq!(c.driver().used(), 0);
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.counts(), (0, 0));
}

#[test]
fn pages_mapped_where_released_pages_were_take_them_in_place() {
    let (mut c, va) = setup(100 * PAGE, still());
    let hs = grow(&mut c, va, 4).unwrap();
    fill(&mut c, va + 2 * PAGE, 2);
    shrink(&mut c, va, &hs[..2]);
    let creates = c.driver().calls_of(Op::Create);
    let again = grow(&mut c, va, 2).unwrap();
    assert_eq!(c.driver().calls_of(Op::Create), creates, "no new memory");
    assert_eq!(c.stranded(), 0);
    assert_eq!(c.stats().reused_stranded, 2 * PAGE);
    assert_eq!(c.counts(), (4, 1));
    fill(&mut c, va, 2);
    assert!(intact(&c, va, 4));
    shrink(&mut c, va, &again);
    shrink(&mut c, va + 2 * PAGE, &hs[2..]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn with_the_tail_split_a_batch_goes_back_whole_while_its_last_page_lives() {
    let mut k = still();
    k.split_tail = true;
    let (mut c, va) = setup(100 * PAGE, k);
    let hs = grow(&mut c, va, 4).unwrap();
    assert_eq!(c.counts(), (4, 2), "the batch and its last page");
    fill(&mut c, va + 3 * PAGE, 1);
    shrink(&mut c, va, &hs[..3]);
    assert_eq!(c.driver().used(), PAGE, "nothing stranded");
    assert!(intact(&c, va + 3 * PAGE, 1));
    shrink(&mut c, va + 3 * PAGE, &hs[3..]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn bytes_grown_ahead_of_live_pages_stay_for_the_next_pages_there() {
    let mut k = still();
    k.ahead = 4 * PAGE;
    let (mut c, va) = setup(100 * PAGE, k);
    c.peak_held = u64::MAX;
    let hs = grow(&mut c, va, 2).unwrap();
    assert_eq!(c.ahead_bytes(), 4 * PAGE);
    c.driver_mut().watched = vec![(va, 2 * PAGE)];
    // The program gives memory back elsewhere, and trims: nothing moves.
    let other = grow(&mut c, va + 40 * PAGE, 1).unwrap();
    shrink(&mut c, va + 40 * PAGE, &other);
    c.giving_back_ended();
    c.trim();
    assert_eq!(c.driver().unmapped_watched, 0);
    assert_eq!(c.ahead_bytes(), 4 * PAGE);
    assert!(c.stats().peak_beyond >= 4 * PAGE);
    // The next pages there take them with no driver call; one past them is stranded room.
    let creates = c.driver().calls_of(Op::Create);
    let next = grow(&mut c, va + 3 * PAGE, 1).unwrap();
    assert_eq!(c.driver().calls_of(Op::Create), creates);
    assert_eq!(c.ahead_bytes(), 2 * PAGE);
    assert_eq!(c.stranded(), PAGE, "the page skipped over");
    let fill_in = grow(&mut c, va + 2 * PAGE, 1).unwrap();
    assert_eq!(c.driver().calls_of(Op::Create), creates);
    assert_eq!(c.stranded(), 0);
    for (at, h) in [(0, &hs), (2, &fill_in), (3, &next)] {
        shrink(&mut c, va + at * PAGE, h);
    }
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_page_made_near_the_limit_that_lands_on_released_pages_gives_its_handle_back() {
    let (mut c, va) = setup(100 * PAGE, still());
    let hs = grow(&mut c, va, 8).unwrap();
    fill(&mut c, va + 7 * PAGE, 1);
    shrink(&mut c, va, &hs[..7]);
    assert_eq!(c.stranded(), 7 * PAGE);
    // One page of memory left beyond what is held: every new page is created at once.
    c.driver_mut().set_capacity(9 * PAGE);
    let mut again = Vec::new();
    for i in 0..7 {
        again.extend(grow(&mut c, va + i * PAGE, 1).unwrap());
        assert_eq!(c.driver().used(), 8 * PAGE, "page {i}: no byte held twice");
    }
    assert_eq!(c.stats().exact_creates, 7, "the test tested");
    assert_eq!(c.stranded(), 0);
    fill(&mut c, va, 7);
    assert!(intact(&c, va, 8));
    for (i, h) in again.iter().enumerate() {
        shrink(&mut c, va + i as u64 * PAGE, &[*h]);
    }
    shrink(&mut c, va + 7 * PAGE, &hs[7..]);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn a_page_of_another_tag_on_bytes_grown_ahead_takes_them_and_a_pause_of_one_tag_leaves_them() {
    let mut k = still();
    k.ahead = 4 * PAGE;
    let (mut c, va) = setup(100 * PAGE, k);
    c.peak_held = u64::MAX;
    let hs = grow(&mut c, va, 1).unwrap();
    assert_eq!(c.ahead_bytes(), 4 * PAGE);
    // The program switches tags (expseg_set_tag without a pool of its own) and maps the next
    // page where the first handle grew ahead: it takes those bytes (nothing can move).
    let tagged = PageProps { tag: 9, ..PROPS };
    let v = c.create(PAGE, tagged).unwrap();
    c.map(va + PAGE, PAGE, 0, v).unwrap();
    assert!(c.set_access(va + PAGE, PAGE, &[(0, RW)]).unwrap());
    assert_eq!(c.counts(), (2, 1));
    fill(&mut c, va, 2);
    // A pause of tag 9 alone leaves the shared handle: it would take tag 0's page too.
    let p = c.pause(&|t| (t == 9).then_some(false)).unwrap();
    assert_eq!((p.bytes, p.mixed), (0, 5 * PAGE));
    assert!(intact(&c, va, 2));
    let p = c.pause(&|_| Some(false)).unwrap();
    assert_eq!(
        p.bytes,
        2 * PAGE,
        "both tags: paused, without the bytes ahead"
    );
    c.resume(&|_| true).unwrap();
    assert!(intact(&c, va, 2));
    shrink(&mut c, va + PAGE, &[v]);
    shrink(&mut c, va, &hs);
    assert_eq!(c.driver().used(), 0);
}

#[test]
fn an_unmapped_page_mapped_elsewhere_is_copied_out_alone() {
    let (mut c, va) = setup(100 * PAGE, still());
    let hs = grow(&mut c, va, 3).unwrap();
    fill(&mut c, va, 3);
    let page1 = c.driver().read_range(va + PAGE, PAGE);
    c.driver_mut().watched = vec![(va, PAGE), (va + 2 * PAGE, PAGE)];
    assert!(c.unmap(va + PAGE, PAGE).unwrap());
    let at = va + 50 * PAGE;
    c.map(at, PAGE, 0, hs[1]).unwrap();
    assert!(c.set_access(at, PAGE, &[(0, RW)]).unwrap());
    assert_eq!(c.driver().unmapped_watched, 0);
    assert_eq!(
        c.driver().read_range(at, PAGE),
        page1,
        "its bytes came along"
    );
    assert!(intact(&c, va, 1) && intact(&c, va + 2 * PAGE, 1));
    assert_eq!(c.stranded(), PAGE, "its old bytes are released pages now");
    shrink(&mut c, at, &hs[1..2]);
    shrink(&mut c, va, &hs[..1]);
    shrink(&mut c, va + 2 * PAGE, &hs[2..]);
    assert_eq!(c.driver().used(), 0);
}

/// Everything a program does (PyTorch's batches and release loops, unmaps now and releases
/// later, trims, settles, near-limit creates, faults, its own mappings over free slots,
/// pages mapped elsewhere) with moving live pages off: no mapped page is ever unmapped but by
/// the program itself or its sharing calls; live data stays intact; every byte is live,
/// stranded or grown ahead; a handle with no page left goes back before the call returns;
/// and new pages reuse stranded bytes.
#[test]
fn randomized_calls_never_unmap_a_page_the_program_has_mapped() {
    let mut reused = 0;
    for seed in seeds(16) {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut k = still();
        k.max_handle = [4, 16, 64][seed as usize % 3] * PAGE;
        k.ahead = [0, 2 * PAGE, 8 * PAGE][(seed / 3) as usize % 3];
        k.margin = [0, 4 * PAGE][(seed / 9) as usize % 2];
        k.split_tail = seed % 2 == 0;
        k.learn_cuts = seed % 4 < 2;
        let (mut c, va) = setup(60 * PAGE, k);
        c.peak_held = u64::MAX;
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        // Unmapped, not released: (page, its bytes).
        let mut loose: Vec<(u64, Vec<Option<u64>>)> = Vec::new();
        for step in 0..300 {
            let ctx = format!("seed {seed} step {step}");
            watch(&mut c, va, &live);
            let mut sharing = false;
            match rng.below(12) {
                0..=3 => {
                    let n = 1 + rng.below(6);
                    // A third of the seeds tag half their batches (expseg.tag(): coalesced
                    // at new addresses too).
                    let props = match seed % 3 == 0 && rng.below(2) == 0 {
                        true => PageProps { tag: 9, ..PROPS },
                        false => PROPS,
                    };
                    if let Err(e) = grow_live_as(&mut c, va, &mut live, n, props) {
                        assert!(e.is_oom(), "{ctx}: {e}");
                    }
                }
                4..=6 => {
                    // PyTorch's release loop over a run of live pages.
                    if let Some(s) = pick(&mut rng, &live) {
                        let n = 1 + rng.below(4);
                        let run: Vec<u64> =
                            (s..s + n).take_while(|x| live.contains_key(x)).collect();
                        let hs: Vec<u64> = run.iter().map(|x| live.remove(x).unwrap()).collect();
                        watch(&mut c, va, &live);
                        shrink(&mut c, va + s * PAGE, &hs);
                    }
                }
                7 => {
                    // Unmap a page now (release later), or map such a page elsewhere.
                    match (loose.pop(), pick(&mut rng, &live)) {
                        (Some((h, bytes)), _) if rng.below(2) == 0 => {
                            let s = free_run(&live, 1);
                            let at = va + s * PAGE;
                            c.clear_for_program(at, PAGE);
                            let mapped = c.map(at, PAGE, 0, h).is_ok()
                                && c.set_access(at, PAGE, &[(0, RW)]).is_ok();
                            if mapped {
                                assert_eq!(c.driver().read_range(at, PAGE), bytes, "{ctx}");
                                fill(&mut c, at, 1);
                                live.insert(s, h);
                            } else {
                                let _ = c.unmap(at, PAGE);
                                c.release(h).unwrap();
                            }
                        }
                        (Some((h, _)), _) => c.release(h).unwrap(),
                        (None, Some(s)) => {
                            let h = live.remove(&s).unwrap();
                            watch(&mut c, va, &live);
                            let bytes = c.driver().read_range(va + s * PAGE, PAGE);
                            assert!(c.unmap(va + s * PAGE, PAGE).unwrap(), "{ctx}");
                            loose.push((h, bytes));
                        }
                        (None, None) => {}
                    }
                }
                8 => {
                    let op = [Op::Create, Op::Map, Op::Copy, Op::Unmap, Op::Release];
                    c.driver_mut().fail_nth(
                        op[rng.below(5) as usize],
                        rng.below(3) as usize,
                        DrvError(999),
                    );
                    match rng.below(3) {
                        0 => c.settle(true),
                        1 => drop(c.trim()),
                        _ => c.giving_back_ended(),
                    }
                    c.driver_mut().clear_failures();
                }
                9 => match rng.below(3) {
                    0 => drop(c.trim_unmoved()),
                    1 => {
                        c.drop_ahead();
                        c.settle(false);
                    }
                    _ => {
                        // cudaMemGetInfo on the allocator's thread.
                        c.drop_ahead();
                        c.settle(false);
                        c.release_kept();
                    }
                },
                10 => {
                    // The program maps a handle of its own over free slots: where a live
                    // handle of ours still holds released pages there, it cannot (they would
                    // have to move), and the driver says so.
                    let at = va + free_run(&live, 2) * PAGE;
                    c.clear_for_program(at, 2 * PAGE);
                    if let Ok(own) = c.driver_mut().create(2 * PAGE) {
                        match c.driver_mut().map(at, 2 * PAGE, own) {
                            Ok(()) => c.driver_mut().unmap(at, 2 * PAGE).unwrap(),
                            Err(_) => assert!(c.maps_in(at, 2 * PAGE), "{ctx}"),
                        }
                        c.driver_mut().release(own).unwrap();
                    }
                }
                _ => {
                    if let Some(s) = pick(&mut rng, &live) {
                        // An export of a page may split its handle (moving its pages), or
                        // be refused where that handle was shared whole; a share of a run
                        // moves nothing.
                        let r = match rng.below(2) {
                            0 => {
                                sharing = true;
                                super::randomized::export_unless_shared(&mut c, live[&s]).map(drop)
                            }
                            _ => c.share_run(va + s * PAGE, usize::MAX),
                        };
                        assert!(r.is_ok() || r.unwrap_err().is_oom(), "{ctx}");
                    }
                }
            }
            if !sharing {
                assert_eq!(c.driver().unmapped_watched, 0, "{ctx}: a mapped page moved");
            }
            c.driver_mut().unmapped_watched = 0;
            for &s in live.keys() {
                assert!(intact(&c, va + s * PAGE, 1), "{ctx} slot {s}");
            }
            super::randomized::books_match_driver(&c, &ctx);
            assert_eq!(c.driver().used(), c.physical_bytes(), "{ctx}");
            let pages = (live.len() + loose.len()) as u64 * PAGE;
            assert_eq!(
                c.physical_bytes(),
                pages + c.stranded() + c.ahead_bytes() + c.unreleased_bytes(),
                "{ctx}: every byte is live, stranded or grown ahead"
            );
            assert!(
                c.phys.values().all(|p| !p.slots.is_empty()),
                "{ctx}: a handle with no page left is given back at once"
            );
            let now = c.stranded_now();
            assert!(c.stats().peak_stranded >= now, "{ctx}");
        }
        reused += c.stats().reused_stranded;
        for (h, _) in std::mem::take(&mut loose) {
            c.release(h).unwrap();
        }
        for (s, h) in std::mem::take(&mut live) {
            shrink(&mut c, va + s * PAGE, &[h]);
        }
        assert_eq!(c.driver().used(), c.unreleased_bytes(), "seed {seed}");
        c.settle(true);
        assert_eq!(c.driver().used(), 0, "seed {seed}: nothing leaked");
        assert_eq!(c.counts(), (0, 0), "seed {seed}");
    }
    assert!(reused > 0, "stranded bytes were taken in place");
}
