//! IPC export against the fake driver: moves, mirrors, and a failure at every step.

use super::*;
use crate::gpu::fake::{FakeDriver, Placement};

const MIB: u64 = 1 << 20;
const GRAN: u64 = 2 * MIB;

fn pool(placement: Placement) -> Pool<FakeDriver> {
    let mut d = FakeDriver::new(0, GRAN, 1 << 30);
    d.legacy_placement = placement;
    Pool::new(
        d,
        PoolConfig {
            cache_max: 1 << 30,
            max_chunk: 0,
        },
    )
}

const MOVE: ExportPolicy = ExportPolicy {
    move_max: u64::MAX,
    fail_move_at: None,
};

/// Write a distinct tag into each granule of the allocation.
fn stamp(p: &mut Pool<FakeDriver>, base: u64, size: u64, seed: u64) {
    for i in 0..size.div_ceil(GRAN) {
        assert!(p.driver_mut().write(base + i * GRAN, GRAN, seed * 1000 + i));
    }
}

fn stamped(p: &Pool<FakeDriver>, base: u64, size: u64, seed: u64) -> bool {
    (0..size.div_ceil(GRAN)).all(|i| p.driver().read(base + i * GRAN) == Some(seed * 1000 + i))
}

fn check(p: &Pool<FakeDriver>) {
    p.validate().unwrap();
    let d = p.driver();
    assert_eq!(p.stats().held_bytes(), d.used() - d.legacy_bytes());
}

#[test]
fn a_move_in_place_keeps_address_and_data_and_leaves_the_pool() {
    let mut p = pool(Placement::SharedLowHeap);
    let a = p.alloc(6 * MIB).unwrap();
    stamp(&mut p, a, 6 * MIB, 7);
    let ex = p.export(a + 12345, MOVE).unwrap();
    assert_eq!((ex.base, ex.size, ex.how), (a, 6 * MIB, Exported::Moved));
    assert!(
        p.driver().is_legacy(a),
        "standard memory at the same address"
    );
    assert!(stamped(&p, a, 6 * MIB, 7));
    assert_eq!(p.driver().chunk_count(), 0, "VMM pages dropped");
    assert_eq!(p.driver().reservation_count(), 0, "temporary range freed");
    assert_eq!(
        p.free(a),
        Err(FreeError::NotOwned),
        "its cudaFree goes to the runtime"
    );
    assert_eq!(ex.handle, p.driver_mut().legacy_handle(a).unwrap());
    assert_eq!(p.stats().ipc_moved, 1);
    check(&p);
}

#[test]
fn a_move_waits_for_devices_given_peer_access() {
    // Another device's kernels may be at work on the block (peer access): the block leaves
    // its address only after they end. A failed wait there moves nothing.
    let mut p = pool(Placement::SharedLowHeap);
    let a = p.alloc(6 * MIB).unwrap();
    stamp(&mut p, a, 6 * MIB, 4);
    p.grant(1).unwrap();
    p.driver_mut().fail_nth(Op::Sync, 1, DrvError(700));
    let ex = p.export(a, MOVE).unwrap();
    assert!(matches!(ex.how, Exported::Mirror { .. }), "{ex:?}");
    assert!(
        p.driver().is_accessible(a, 6 * MIB, 1),
        "still pool memory, peer access kept"
    );
    assert_eq!(p.stats().ipc_move_failures, 1);
    assert_eq!(
        p.driver().peers_synced,
        vec![1],
        "the mirror's copy waited for device 1 too"
    );
    p.driver_mut().clear_failures();
    p.driver_mut().peers_synced.clear();
    let b = p.alloc(4 * MIB).unwrap();
    stamp(&mut p, b, 4 * MIB, 5);
    let ex = p.export(b, MOVE).unwrap();
    assert_eq!(ex.how, Exported::Moved);
    assert!(stamped(&p, b, 4 * MIB, 5));
    assert_eq!(p.driver().peers_synced, vec![1], "device 1 was waited for");
    p.free(a).unwrap();
    check(&p);
}

#[test]
fn a_stitched_allocation_moves_with_its_data_in_order() {
    let mut p = pool(Placement::SharedLowHeap);
    p.driver_mut().set_capacity(8 * MIB);
    let xs: Vec<u64> = (0..4).map(|_| p.alloc(2 * MIB).unwrap()).collect();
    for x in xs {
        p.free(x).unwrap();
    }
    let a = p.alloc(8 * MIB).unwrap(); // four chunks
    stamp(&mut p, a, 8 * MIB, 3);
    p.driver_mut().set_capacity(1 << 30);
    assert_eq!(p.export(a, MOVE).unwrap().how, Exported::Moved);
    assert!(stamped(&p, a, 8 * MIB, 3));
    check(&p);
}

#[test]
fn elsewhere_landing_restores_and_mirrors_with_one_way_refreshes() {
    let mut p = pool(Placement::SeparateHeap);
    let a = p.alloc(4 * MIB).unwrap();
    stamp(&mut p, a, 4 * MIB, 1);
    let ex = p.export(a, MOVE).unwrap();
    let Exported::Mirror {
        ptr: m,
        first: true,
    } = ex.how
    else {
        panic!("{ex:?}")
    };
    assert_eq!(p.stats().ipc_move_failures, 1);
    assert!(p.driver().is_accessible(a, 4 * MIB, 0), "still pool memory");
    assert!(stamped(&p, a, 4 * MIB, 1) && stamped(&p, m, 4 * MIB, 1));
    // The producer writes, asks again: same bytes, refreshed data, no second mirror.
    stamp(&mut p, a, 4 * MIB, 2);
    let again = p.export(a + 1, MOVE).unwrap();
    assert_eq!(again.handle, ex.handle);
    assert_eq!(
        again.how,
        Exported::Mirror {
            ptr: m,
            first: false
        }
    );
    assert!(stamped(&p, m, 4 * MIB, 2));
    // A consumer's write to the mirror does not reach the allocation.
    stamp(&mut p, m, 4 * MIB, 9);
    assert!(stamped(&p, a, 4 * MIB, 2));
    assert_eq!(p.stats().mirror_bytes, 4 * MIB);
    check(&p);
    p.free(a).unwrap();
    assert_eq!(
        p.driver().legacy_count(),
        0,
        "freeing the allocation freed its mirror"
    );
    check(&p);
}

#[test]
fn move_max_zero_always_mirrors() {
    let mut p = pool(Placement::SharedLowHeap);
    let a = p.alloc(2 * MIB).unwrap();
    let ex = p.export(a, ExportPolicy::default()).unwrap();
    assert!(matches!(ex.how, Exported::Mirror { first: true, .. }));
    assert_eq!(p.stats().ipc_move_failures, 0, "no move tried");
    check(&p);
}

#[test]
fn move_max_counts_the_programs_size_not_the_rounded_block() {
    // 3 MiB asked (a 4 MiB block) under a bound of 3 MiB: moved, as the caller, which
    // compares the program's size, expects (not mirrored).
    let mut p = pool(Placement::SharedLowHeap);
    let a = p.alloc(3 * MIB).unwrap();
    stamp(&mut p, a, 3 * MIB, 4);
    let policy = ExportPolicy {
        move_max: 3 * MIB,
        fail_move_at: None,
    };
    let ex = p.export(a, policy).unwrap();
    assert_eq!(ex.how, Exported::Moved);
    check(&p);
}

#[test]
fn a_move_failing_at_each_step_is_rolled_back_with_data_intact() {
    for step in MoveStep::ALL {
        let mut p = pool(Placement::SharedLowHeap);
        let keep = p.alloc(2 * MIB).unwrap();
        let a = p.alloc(6 * MIB).unwrap();
        stamp(&mut p, a, 6 * MIB, 5);
        let policy = ExportPolicy {
            move_max: u64::MAX,
            fail_move_at: Some(step),
        };
        let ex = p.export(a, policy).unwrap();
        assert!(matches!(ex.how, Exported::Mirror { .. }), "{step:?}");
        assert!(
            p.driver().is_accessible(a, 6 * MIB, 0),
            "{step:?}: mapped again"
        );
        assert!(stamped(&p, a, 6 * MIB, 5), "{step:?}: data intact");
        assert_eq!(p.find(a + 100), Some((a, 6 * MIB)), "{step:?}");
        check(&p);
        // Everything still works and nothing leaks.
        p.free(a).unwrap();
        p.free(keep).unwrap();
        p.trim(0);
        let d = p.driver();
        assert_eq!(
            (d.chunk_count(), d.reservation_count(), d.legacy_count()),
            (0, 0, 0),
            "{step:?}"
        );
    }
}

#[test]
fn driver_failures_during_a_move_are_rolled_back_too() {
    for op in [
        Op::Sync,
        Op::Reserve,
        Op::Map,
        Op::SetAccess,
        Op::Unmap,
        Op::FreeVa,
        Op::LegacyAlloc,
        Op::Copy,
        Op::IpcHandle,
    ] {
        let mut p = pool(Placement::SharedLowHeap);
        let a = p.alloc(4 * MIB).unwrap();
        stamp(&mut p, a, 4 * MIB, 8);
        p.driver_mut().fail(op, DrvError(700));
        match p.export(a, MOVE) {
            Ok(ex) if ex.how == Exported::Moved => panic!("{op:?}: moved despite the failure"),
            Ok(_) => {}
            // The failure hit the mirror that followed the rolled-back move.
            Err(ExportError::Driver(DrvError(700))) => {}
            Err(e) => panic!("{op:?}: {e:?}"),
        }
        assert!(p.driver().is_accessible(a, 4 * MIB, 0), "{op:?}");
        assert!(stamped(&p, a, 4 * MIB, 8), "{op:?}");
        check(&p);
        p.driver_mut().clear_failures();
        assert!(p.export(a, MOVE).is_ok(), "{op:?}: a second request works");
        check(&p);
    }
}

#[test]
fn a_range_taken_meanwhile_is_reported_and_the_data_kept() {
    let mut p = pool(Placement::SeparateHeap);
    let a = p.alloc(4 * MIB).unwrap();
    stamp(&mut p, a, 4 * MIB, 4);
    // Both attempts to re-reserve the original range fail (after the temporary reserve).
    p.driver_mut().fail_nth(Op::Reserve, 1, DrvError(2));
    p.driver_mut().fail_nth(Op::Reserve, 0, DrvError(2));
    let err = p.export(a, MOVE).unwrap_err();
    let ExportError::RangeLost { base, kept } = err else {
        panic!("{err:?}")
    };
    assert_eq!(base, a);
    assert!(
        stamped(&p, kept, 4 * MIB, 4),
        "data intact where it is kept"
    );
    assert_eq!(p.find(kept), Some((kept, 4 * MIB)));
    check(&p);
}

#[test]
fn a_mirror_without_memory_gives_the_cache_back_first() {
    let mut p = pool(Placement::SeparateHeap);
    p.driver_mut().set_capacity(8 * MIB);
    let a = p.alloc(4 * MIB).unwrap();
    let b = p.alloc(4 * MIB).unwrap();
    p.free(b).unwrap(); // cached: the driver is full
    let ex = p.export(a, ExportPolicy::default()).unwrap();
    assert!(matches!(ex.how, Exported::Mirror { .. }));
    assert_eq!(p.cached_bytes(), 0);
    check(&p);
    // With nothing left to give back: a clear out-of-memory, the allocation unchanged.
    let mut p = pool(Placement::SeparateHeap);
    p.driver_mut().set_capacity(4 * MIB);
    let a = p.alloc(4 * MIB).unwrap();
    assert_eq!(
        p.export(a, ExportPolicy::default()),
        Err(ExportError::OutOfMemory)
    );
    assert_eq!(p.find(a), Some((a, 4 * MIB)));
    check(&p);
}

#[test]
fn only_live_pool_memory_is_exported() {
    let mut p = pool(Placement::SharedLowHeap);
    assert_eq!(p.export(0x1234, MOVE), Err(ExportError::NotOwned));
    let a = p.alloc(2 * MIB).unwrap();
    p.free(a).unwrap();
    assert_eq!(
        p.export(a, MOVE),
        Err(ExportError::NotOwned),
        "cached is not live"
    );
}

#[test]
fn a_range_swallowed_by_the_runtime_heap_is_won_back_by_plugging() {
    // The runtime's cudaMalloc reserves a region over the released range and places the new
    // memory at its end: the range cannot be reserved again, but a later cudaMalloc lands on it.
    let mut p = pool(Placement::Suballocator);
    let a = p.alloc(8 * MIB).unwrap();
    stamp(&mut p, a, 8 * MIB, 6);
    // Reservations from now on go far away, so the heap region can grow over a's range.
    p.driver_mut().reserve_floor = a + (1 << 30);
    let ex = p.export(a, MOVE).unwrap();
    assert_eq!(ex.how, Exported::Moved);
    assert_eq!(p.stats().ipc_plugged, 1);
    assert!(p.driver().is_legacy(a));
    assert!(
        stamped(&p, a, 8 * MIB, 6),
        "data copied to the recovered address"
    );
    assert_eq!(
        p.driver().legacy_count(),
        1,
        "the first, misplaced allocation was freed"
    );
    check(&p);
}

#[test]
fn shared_allocations_hand_out_their_chunks_and_are_never_reused() {
    let mut p = Pool::new(
        FakeDriver::new(0, GRAN, 1 << 30),
        PoolConfig {
            cache_max: 1 << 30,
            max_chunk: 2 * MIB,
        },
    );
    let a = p.alloc(6 * MIB).unwrap();
    assert!(p.export_fds(a).is_none(), "not shared yet");
    assert_eq!(p.share(a + 1), Some((a, 6 * MIB)));
    for _ in 0..2 {
        let (size, fds) = p.export_fds(a).unwrap().unwrap();
        assert_eq!(size, 6 * MIB);
        assert_eq!(
            fds.iter().map(|f| f.1).collect::<Vec<_>>(),
            vec![2 * MIB; 3]
        );
    }
    p.free(a).unwrap();
    assert_eq!(
        p.cached_bytes(),
        0,
        "shared chunks go back to the driver, not the cache"
    );
    assert_eq!(p.driver().chunk_count(), 0);
    assert!(p.export_fds(a).is_none(), "stale");
    check(&p);
}

#[test]
fn descriptors_kept_for_shared_allocations_are_bounded() {
    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
    }
    let mut p = Pool::new(
        FakeDriver::new(0, GRAN, 20_000 * GRAN),
        PoolConfig::default(),
    );
    let before = open_fds();
    let mut live = Vec::new();
    for _ in 0..5000 {
        let a = p.alloc(GRAN).unwrap();
        p.share(a).unwrap();
        live.push(a);
    }
    assert_eq!(p.cached_fd_count(), super::export::FD_CACHE_MAX);
    assert!(
        open_fds() <= before + super::export::FD_CACHE_MAX + 16,
        "{} descriptors open",
        open_fds() - before
    );
    // Every allocation still gets its descriptors when a consumer asks.
    let (_, fds) = p.export_fds(live[4999]).unwrap().unwrap();
    assert_eq!(fds.len(), 1);
    drop(fds);
    for a in live {
        p.free(a).unwrap();
    }
    assert_eq!(p.cached_fd_count(), 0);
}
