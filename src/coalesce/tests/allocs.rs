//! Heap allocations a hook call makes, at the defaults, once the books have grown to the
//! program's size: a training loop evicts the allocator's bins between calls, so each one costs
//! cache misses as the books' own reads do (docs/design.md, "What the books cost"). Unmaps and
//! releases make none; the bounds on the others are what the books need now, so a change that
//! adds some fails here rather than only on the GPU. The fake driver allocates nothing in an
//! unmap; in an access call it makes an access list per mapping, counted here too.

use super::*;
use crate::config::Config;
use crate::test_alloc::allocations;

/// Calls and allocations by hook, over some rounds.
#[derive(Default, Debug)]
struct Tally {
    create: (u64, u64),
    map: (u64, u64),
    access: (u64, u64),
    unmap: (u64, u64),
    release: (u64, u64),
}

fn add(t: &mut (u64, u64), allocs: u64) {
    t.0 += 1;
    t.1 += allocs;
}

/// One step of a loop that empties the cache each step: segments of `sizes` pages grown at
/// their places, then given back page by page in address order, as PyTorch does.
fn step(c: &mut Coalescer<FakeDriver>, va: u64, sizes: &[u64], t: &mut Tally) {
    let mut segs = Vec::new();
    let mut at = va;
    for &n in sizes {
        let mut hs = Vec::new();
        for _ in 0..n {
            let (a, h) = allocations(|| c.create(PAGE, PROPS));
            add(&mut t.create, a);
            hs.push(h.unwrap());
        }
        for (i, h) in hs.iter().enumerate() {
            let (a, r) = allocations(|| c.map(at + i as u64 * PAGE, PAGE, 0, *h));
            add(&mut t.map, a);
            r.unwrap();
        }
        let (a, r) = allocations(|| c.set_access(at, n * PAGE, &[(0, RW)]));
        add(&mut t.access, a);
        assert!(r.unwrap());
        segs.push((at, hs));
        // A gap between segments, as between PyTorch's reservations' mapped ends.
        at += (n + 3) * PAGE;
    }
    for (at, hs) in segs {
        for (i, h) in hs.iter().enumerate() {
            let (a, r) = allocations(|| c.unmap(at + i as u64 * PAGE, PAGE));
            add(&mut t.unmap, a);
            assert!(r.unwrap());
            let (a, r) = allocations(|| c.release(*h));
            add(&mut t.release, a);
            r.unwrap();
        }
    }
}

#[test]
fn hooks_at_the_defaults_allocate_within_their_bounds_and_unmaps_not_at_all() {
    let cfg = CoalesceConfig::from_config(&Config::default(), true);
    let (mut c, va) = setup(2000 * PAGE, cfg);
    let sizes = [1, 7, 2, 30, 5, 64, 3];
    // The books grow to the loop's size first (maps, rings, scratch lists).
    for _ in 0..4 {
        step(&mut c, va, &sizes, &mut Tally::default());
    }
    let mut t = Tally::default();
    for _ in 0..8 {
        step(&mut c, va, &sizes, &mut t);
    }
    assert_eq!(c.driver().used(), 0, "every step gave all back");
    let per = |(n, a): (u64, u64)| a as f64 / n as f64;
    println!("{t:?}");
    // Bounds from a measured run (create 0.007, map 0.16, access 11.7 a call, the fake
    // driver's access lists among them; unmap and release 0), with a little room.
    assert!(t.access.1 > 0, "the allocator counts: {t:?}");
    assert_eq!(t.unmap.1, 0, "an unmap allocates nothing: {t:?}");
    assert_eq!(t.release.1, 0, "a release allocates nothing: {t:?}");
    assert!(per(t.create) <= 0.05, "{t:?}");
    assert!(per(t.map) <= 0.25, "{t:?}");
    assert!(per(t.access) <= 13.0, "{t:?}");
}
