//! Pausing pool blocks against the fake driver: offload and discard, tags, shared blocks left
//! alone, frees and exports of paused blocks, out of memory on resume and the retry.

use super::*;
use crate::gpu::fake::FakeDriver;

const MIB: u64 = 1 << 20;
const GRAN: u64 = 2 * MIB;
const OFFLOAD: Option<bool> = Some(false);

fn pool(capacity: u64) -> Pool<FakeDriver> {
    Pool::new(
        FakeDriver::new(0, GRAN, capacity),
        PoolConfig {
            cache_max: 0,
            max_chunk: 16 * MIB,
        },
    )
}

fn stamp(p: &mut Pool<FakeDriver>, base: u64, size: u64, seed: u64) {
    for i in 0..size / GRAN {
        assert!(p.driver_mut().write(base + i * GRAN, GRAN, seed * 1000 + i));
    }
}

fn stamped(p: &Pool<FakeDriver>, base: u64, size: u64, seed: u64) -> bool {
    (0..size / GRAN).all(|i| {
        p.driver().read(base + i * GRAN) == Some(seed * 1000 + i)
            && p.driver().is_accessible(base + i * GRAN, GRAN, 0)
    })
}

fn check(p: &Pool<FakeDriver>) {
    p.validate().unwrap();
    let s = p.stats();
    assert_eq!(s.held_bytes() + s.mirror_bytes, p.driver().used());
}

#[test]
fn offloaded_blocks_give_memory_back_and_come_back_with_their_bytes() {
    let mut p = pool(1 << 30);
    let a = p.alloc(40 * MIB).unwrap(); // 16 + 16 + 8 MiB chunks
    let b = p.alloc(5 * MIB).unwrap();
    stamp(&mut p, a, 40 * MIB, 1);
    stamp(&mut p, b, 6 * MIB, 2);
    let out = p.pause(&|_| OFFLOAD).unwrap();
    assert_eq!(out.bytes, 46 * MIB);
    assert_eq!(out.offloaded, 46 * MIB);
    check(&p);
    assert_eq!(p.driver().used(), 0, "every chunk back to the driver");
    assert_eq!(p.driver().mapping_count(), 0);
    assert_eq!(p.driver().reservation_count(), 2, "addresses kept");
    assert_eq!(p.paused_bytes(), 46 * MIB);
    assert_eq!(
        p.driver().calls_of(Op::Sync),
        2,
        "device waited for, then the copies"
    );
    // Pausing again pauses nothing more.
    assert_eq!(p.pause(&|_| OFFLOAD).unwrap().bytes, 0);
    assert_eq!(p.resume(&|_| true).unwrap(), 46 * MIB);
    check(&p);
    assert!(stamped(&p, a, 40 * MIB, 1) && stamped(&p, b, 6 * MIB, 2));
    assert_eq!(p.driver().host_buffers(), (0, 0), "host copies freed");
    assert_eq!(p.resume(&|_| true).unwrap(), 0, "resume without pause");
    p.free(a).unwrap();
    p.free(b).unwrap();
    check(&p);
    assert_eq!(p.driver().reservation_count(), 0);
}

#[test]
fn a_pause_waits_for_devices_given_peer_access() {
    let mut p = pool(1 << 30);
    let a = p.alloc(8 * MIB).unwrap();
    stamp(&mut p, a, 8 * MIB, 3);
    p.grant(1).unwrap();
    // This device's wait passes, the peer's fails: nothing is paused.
    p.driver_mut().fail_nth(Op::Sync, 1, DrvError(700));
    assert!(p.pause(&|_| OFFLOAD).is_err());
    assert_eq!(p.paused_bytes(), 0);
    assert!(stamped(&p, a, 8 * MIB, 3));
    p.driver_mut().clear_failures();
    assert!(p.driver().peers_synced.is_empty());
    assert_eq!(p.pause(&|_| OFFLOAD).unwrap().bytes, 8 * MIB);
    assert_eq!(p.driver().peers_synced, vec![1], "device 1 was waited for");
    assert_eq!(p.resume(&|_| true).unwrap(), 8 * MIB);
    assert!(stamped(&p, a, 8 * MIB, 3));
    assert!(
        p.driver().is_accessible(a, 8 * MIB, 1),
        "the peer keeps access"
    );
    p.free(a).unwrap();
    check(&p);
}

#[test]
fn discard_tags_and_shared_blocks() {
    let mut p = pool(1 << 30);
    p.tag = 7;
    let kv = p.alloc(32 * MIB).unwrap();
    p.tag = 0;
    let w = p.alloc(8 * MIB).unwrap();
    stamp(&mut p, w, 8 * MIB, 3);
    // Only tag 7, dropped: no host copy at all.
    let out = p.pause(&|t| (t == 7).then_some(true)).unwrap();
    assert_eq!((out.bytes, out.offloaded), (32 * MIB, 0));
    assert_eq!(p.driver().host_buffers(), (0, 0));
    assert_eq!(p.driver().used(), 8 * MIB);
    assert!(
        stamped(&p, w, 8 * MIB, 3),
        "the untagged block is untouched"
    );
    check(&p);
    // A mirrored block (shared by IPC) is left alone and counted.
    let m = p.export(w, ExportPolicy::default()).unwrap();
    assert!(matches!(m.how, Exported::Mirror { .. }));
    let out = p.pause(&|_| OFFLOAD).unwrap();
    assert_eq!((out.bytes, out.shared), (0, 8 * MIB));
    // Tag 7 comes back alone, mapped and accessible (its bytes were dropped).
    assert_eq!(p.resume(&|t| t == 7).unwrap(), 32 * MIB);
    assert!(p.driver().is_accessible(kv, 32 * MIB, 0));
    check(&p);
    p.free(kv).unwrap();
    p.free(w).unwrap();
    check(&p);
}

#[test]
fn a_range_another_device_may_use_is_never_paused() {
    let mut p = pool(1 << 30);
    let a = p.alloc(16 * MIB).unwrap();
    let b = p.alloc(16 * MIB).unwrap();
    let c = p.alloc(16 * MIB).unwrap();
    stamp(&mut p, b, 16 * MIB, 5);
    // A dma-buf of a range from inside a to inside b: both are shared, c is not.
    assert_eq!(p.share_range(a + 4 * MIB, b + MIB - (a + 4 * MIB)), 2);
    let out = p.pause(&|_| OFFLOAD).unwrap();
    assert_eq!((out.bytes, out.shared), (16 * MIB, 32 * MIB));
    assert!(stamped(&p, b, 16 * MIB, 5), "mapped and untouched");
    assert!(!p.driver().is_accessible(c, 16 * MIB, 0), "c paused");
    assert_eq!(p.resume(&|_| true).unwrap(), 16 * MIB);
    check(&p);
    for x in [a, b, c] {
        p.free(x).unwrap();
    }
    check(&p);
}

#[test]
fn freeing_a_paused_block_drops_its_host_copy_and_an_export_resumes_it() {
    let mut p = pool(1 << 30);
    let a = p.alloc(16 * MIB).unwrap();
    let b = p.alloc(16 * MIB).unwrap();
    stamp(&mut p, b, 16 * MIB, 4);
    p.pause(&|_| OFFLOAD).unwrap();
    assert_eq!(p.driver().host_buffers().1, 32 * MIB);
    assert_eq!(p.free(a).unwrap(), 16 * MIB);
    check(&p);
    assert_eq!(p.driver().reservation_count(), 1);
    // The buffer holds b's bytes too: it stays until b is back.
    assert_eq!(p.driver().host_buffers().0, 1);
    let ex = p.export(b, ExportPolicy::default()).unwrap();
    assert!(matches!(ex.how, Exported::Mirror { .. }));
    assert_eq!(p.paused_bytes(), 0, "the export resumed it");
    assert!(stamped(&p, b, 16 * MIB, 4));
    assert_eq!(p.driver().host_buffers(), (0, 0));
    p.free(b).unwrap();
    check(&p);
}

#[test]
fn out_of_memory_on_resume_loses_nothing_and_a_retry_finishes() {
    let mut p = pool(64 * MIB);
    let a = p.alloc(16 * MIB).unwrap();
    let b = p.alloc(16 * MIB).unwrap();
    stamp(&mut p, a, 16 * MIB, 5);
    stamp(&mut p, b, 16 * MIB, 6);
    p.pause(&|_| OFFLOAD).unwrap();
    // Another process takes most of the memory meanwhile.
    let other = p.driver_mut().create(40 * MIB).unwrap();
    assert_eq!(p.resume(&|_| true), Err(DrvError::OUT_OF_MEMORY));
    p.validate().unwrap();
    assert_eq!(p.stats().held_bytes() + 40 * MIB, p.driver().used());
    assert_eq!(
        p.paused_bytes(),
        16 * MIB,
        "one block made, one still paused"
    );
    assert!(stamped(&p, a, 16 * MIB, 5));
    assert_eq!(p.driver().host_buffers().1, 32 * MIB, "the host copy stays");
    p.driver_mut().release(other).unwrap();
    assert_eq!(p.resume(&|_| true).unwrap(), 16 * MIB);
    assert!(stamped(&p, a, 16 * MIB, 5) && stamped(&p, b, 16 * MIB, 6));
    assert_eq!(p.driver().host_buffers(), (0, 0));
    check(&p);
}

#[test]
fn a_failed_copy_pauses_nothing_and_no_host_memory_is_an_answer() {
    let mut p = pool(1 << 30);
    let a = p.alloc(16 * MIB).unwrap();
    stamp(&mut p, a, 16 * MIB, 8);
    p.driver_mut().fail(Op::Copy, DrvError(700));
    assert_eq!(p.pause(&|_| OFFLOAD), Err(DrvError(700)));
    p.driver_mut().host_capacity = 4 * MIB;
    assert_eq!(p.pause(&|_| OFFLOAD), Err(DrvError::OUT_OF_MEMORY));
    assert_eq!(p.paused_bytes(), 0);
    assert!(stamped(&p, a, 16 * MIB, 8));
    check(&p);
    // Discarding needs no host memory.
    assert_eq!(p.pause(&|_| Some(true)).unwrap().bytes, 16 * MIB);
    check(&p);
}

#[test]
fn the_mirror_and_share_paths_of_an_export_resume_a_paused_block_first() {
    // cudaIpcGetMemHandle's default path makes the mirror with `prepare_mirror` (its copy is
    // made outside the pool), and tickets mark the block with `share`: neither may work on
    // a paused block's missing chunks.
    let mut p = pool(1 << 30);
    let a = p.alloc(8 * MIB).unwrap();
    stamp(&mut p, a, 8 * MIB, 1);
    p.pause(&|_| OFFLOAD).unwrap();
    assert_eq!(p.share(a), None, "no chunks to share while paused");
    let (m, first) = p.prepare_mirror(a).unwrap();
    assert!(first);
    assert_eq!(p.paused_bytes(), 0, "resumed before its mirror");
    assert!(stamped(&p, a, 8 * MIB, 1));
    assert_eq!(p.driver_mut().copy(m, a, 8 * MIB), Ok(()));
    p.free(a).unwrap();
    assert_eq!(
        p.driver().legacy_count(),
        0,
        "the mirror went with the allocation"
    );
    check(&p);

    let b = p.alloc(8 * MIB).unwrap();
    stamp(&mut p, b, 8 * MIB, 2);
    p.pause(&|_| OFFLOAD).unwrap();
    p.wake_for(b + 5).unwrap();
    assert_eq!(p.share(b), Some((b, 8 * MIB)));
    assert_eq!(p.export_fds(b).unwrap().unwrap().1.len(), 1);
    p.free(b).unwrap();
    assert_eq!(p.paused_bytes(), 0);
    assert_eq!(p.driver().host_buffers(), (0, 0));
    check(&p);
}

#[test]
fn an_export_that_cannot_resume_a_paused_block_fails_and_keeps_it_paused() {
    let mut p = pool(64 * MIB);
    let a = p.alloc(16 * MIB).unwrap();
    stamp(&mut p, a, 16 * MIB, 3);
    p.pause(&|_| OFFLOAD).unwrap();
    let other = p.driver_mut().create(56 * MIB).unwrap();
    for r in [
        p.prepare_mirror(a).map(|_| ()),
        p.export(a, ExportPolicy::default()).map(|_| ()),
    ] {
        assert!(
            matches!(r, Err(ExportError::Paused(e)) if e.is_oom()),
            "{r:?}"
        );
    }
    assert!(p.wake_for(a).unwrap_err().is_oom());
    assert_eq!(p.paused_bytes(), 16 * MIB, "still paused, host copy kept");
    assert_eq!(p.driver().legacy_count(), 0);
    p.driver_mut().release(other).unwrap();
    p.resume(&|_| true).unwrap();
    assert!(stamped(&p, a, 16 * MIB, 3));
    check(&p);
}

#[test]
fn a_block_that_cannot_resume_does_not_hold_back_the_others() {
    let mut p = pool(1 << 30);
    let a = p.alloc(8 * MIB).unwrap();
    let b = p.alloc(8 * MIB).unwrap();
    stamp(&mut p, a, 8 * MIB, 7);
    stamp(&mut p, b, 8 * MIB, 8);
    p.pause(&|_| OFFLOAD).unwrap();
    p.driver_mut().fail(Op::Map, DrvError(1));
    assert_eq!(p.resume(&|_| true).unwrap_err(), DrvError(1));
    assert_eq!(p.paused_bytes(), 8 * MIB, "one resumed, one still paused");
    assert_eq!(p.resume(&|_| true).unwrap(), 8 * MIB);
    assert!(stamped(&p, a, 8 * MIB, 7) && stamped(&p, b, 8 * MIB, 8));
    assert_eq!(p.driver().host_buffers(), (0, 0));
    check(&p);
}

#[test]
fn a_resume_short_of_memory_resumes_the_smaller_blocks_that_fit() {
    // A large block first, a small one after it: the large one finds no memory, the small
    // one still comes back (the first failure does not end the resume).
    let mut p = pool(1 << 30);
    let big = p.alloc(64 * MIB).unwrap();
    let small = p.alloc(4 * MIB).unwrap();
    assert!(big < small, "the large block is tried first");
    stamp(&mut p, big, 64 * MIB, 1);
    stamp(&mut p, small, 4 * MIB, 2);
    p.pause(&|_| OFFLOAD).unwrap();
    p.driver_mut().set_capacity(10 * MIB);
    let creates = p.driver().calls_of(Op::Create);
    assert_eq!(p.resume(&|_| true), Err(DrvError::OUT_OF_MEMORY));
    assert_eq!(p.paused_bytes(), 64 * MIB, "the small block resumed");
    assert!(stamped(&p, small, 4 * MIB, 2));
    p.driver_mut().set_capacity(1 << 30);
    assert_eq!(p.resume(&|_| true).unwrap(), 64 * MIB);
    assert!(stamped(&p, big, 64 * MIB, 1) && stamped(&p, small, 4 * MIB, 2));
    assert!(p.driver().calls_of(Op::Create) > creates);
    check(&p);
}

#[test]
fn chunks_a_failed_resume_cannot_give_back_stay_counted() {
    let mut p = pool(1 << 30);
    let a = p.alloc(8 * MIB).unwrap();
    stamp(&mut p, a, 8 * MIB, 3);
    p.pause(&|_| OFFLOAD).unwrap();
    p.driver_mut().fail(Op::Map, DrvError(1));
    p.driver_mut().fail(Op::Release, DrvError(1));
    assert!(p.resume(&|_| true).is_err());
    check(&p);
    assert_eq!(p.resume(&|_| true).unwrap(), 8 * MIB);
    assert!(stamped(&p, a, 8 * MIB, 3));
    p.trim(0);
    check(&p);
}
