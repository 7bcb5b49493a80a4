//! A coalescer driven as PyTorch drives it, every call written as the recorder writes it, then
//! the trace replayed: the same figures under the same policy; malformed lines skipped.

use super::*;
use crate::coalesce::trace::{Call, Event, Header, Outcome};
use crate::gpu::PageProps;
use std::borrow::Cow;
use std::fmt::Write as _;

const G: u64 = 2 << 20;
const PAGE: u64 = 10 * G; // PyTorch's 20 MiB page
const RW: u32 = 3;
const PROPS: PageProps = PageProps {
    shareable: true,
    rdma: false,
    tag: 0,
};
const CAPACITY: u64 = 140 << 30;

/// The library's defaults (`Config::default()` through `CoalesceConfig::from_config`).
fn defaults(delay_ms: u64) -> CoalesceConfig {
    let c = crate::config::Config {
        release_delay_ms: delay_ms,
        ..Default::default()
    };
    CoalesceConfig::from_config(&c, true)
}

/// A live coalescer on the fake driver, each call recorded as `api::trace` records it.
struct Live {
    c: Coalescer<FakeDriver>,
    text: String,
    t: u64,
}

impl Live {
    fn new(cfg: CoalesceConfig) -> Live {
        Live {
            c: Coalescer::new(FakeDriver::new(0, G, CAPACITY), cfg),
            text: Header::lines(1, &cfg, false, &[(0, G)]),
            t: 0,
        }
    }

    fn rec(&mut self, call: Call<'_>, out: Outcome) {
        self.t += 50_000; // 50 µs between calls
        let e = Event {
            t_ns: self.t,
            dev: 0,
            moves: self.c.moves_allowed(),
            call,
            out,
        };
        writeln!(self.text, "{e}").unwrap();
    }

    fn reserve(&mut self, size: u64) -> u64 {
        let va = self.c.driver_mut().reserve(size).unwrap();
        self.c.reserved(va, size);
        self.rec(Call::Reserved { va, size }, Outcome::DONE);
        va
    }

    /// PyTorch's `map()`: create each page, map each, set access over the range.
    fn grow(&mut self, at: u64, n: u64) -> Vec<u64> {
        let mut vhs = Vec::new();
        for _ in 0..n {
            let r = self.c.create(PAGE, PROPS);
            self.rec(
                Call::Create {
                    size: PAGE,
                    props: PROPS,
                },
                (&r).into(),
            );
            vhs.push(r.unwrap());
        }
        for (i, vh) in vhs.iter().enumerate() {
            let va = at + i as u64 * PAGE;
            let r = self.c.map(va, PAGE, 0, *vh);
            self.rec(
                Call::Map {
                    va,
                    size: PAGE,
                    offset: 0,
                    vh: *vh,
                },
                (&r).into(),
            );
            r.unwrap();
        }
        let descs = [(0, RW)];
        let r = self.c.set_access(at, n * PAGE, &descs);
        self.rec(
            Call::SetAccess {
                va: at,
                size: n * PAGE,
                descs: Cow::Borrowed(&descs),
            },
            (&r).into(),
        );
        assert_eq!(r, Ok(true));
        vhs
    }

    /// PyTorch's `unmapHandles`: unmap and release page by page.
    fn shrink(&mut self, va: u64, vh: u64) {
        let r = self.c.unmap_from(va, PAGE, Some(0));
        self.rec(
            Call::Unmap {
                va,
                size: PAGE,
                caller: Some(0),
            },
            (&r).into(),
        );
        assert_eq!(r, Ok(true));
        let r = self.c.release(vh);
        self.rec(Call::Release { vh }, (&r).into());
        r.unwrap();
    }

    /// `cudaMemGetInfo` on the allocator's thread (`api::vmm::settle`).
    fn settle(&mut self) {
        self.c.drop_ahead();
        self.rec(Call::DropAhead, Outcome::DONE);
        self.c.settle(false);
        self.rec(Call::Settle { force: false }, Outcome::DONE);
        self.c.release_kept();
        self.rec(Call::ReleaseKept, Outcome::DONE);
    }

    /// The releaser thread after the delay's quiet (it may not move live pages).
    fn releaser(&mut self) {
        self.t += 10_000_000;
        self.c.allow_moves(false);
        self.c.release_kept();
        self.rec(Call::Releaser, Outcome::DONE);
        self.c.allow_moves(true);
    }

    /// The report's query of the stranded bytes.
    fn stranded_now(&mut self) {
        let n = self.c.stranded_now();
        self.rec(Call::StrandedNow, n.into());
    }

    fn figures(&self) -> Summary {
        let mut s = Summary::default();
        s.add(&self.c);
        s
    }
}

/// A PyTorch-like run: a 1 GiB segment whose blocks of 1 to 6 pages come and go at random
/// places, access set per block, `cudaMemGetInfo` now and then, the releaser now and then.
fn pytorch_like(cfg: CoalesceConfig, steps: u32) -> Live {
    let mut live = Live::new(cfg);
    let base = live.reserve(1 << 30);
    let slots = (1u64 << 30) / PAGE; // 51 pages
    let mut held: Vec<Option<u64>> = vec![None; slots as usize];
    let mut r: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |m: u64| {
        r ^= r << 13;
        r ^= r >> 7;
        r ^= r << 17;
        r % m
    };
    for step in 0..steps {
        let at = next(slots);
        let n = (1 + next(6)).min(slots - at);
        let range = at as usize..(at + n) as usize;
        if held[range.clone()].iter().all(Option::is_none) {
            let vhs = live.grow(base + at * PAGE, n);
            for (slot, vh) in held[range].iter_mut().zip(vhs) {
                *slot = Some(vh);
            }
        } else {
            for i in range {
                if let Some(vh) = held[i].take() {
                    live.shrink(base + i as u64 * PAGE, vh);
                }
            }
        }
        if step % 7 == 0 {
            live.settle();
        }
        if step % 11 == 0 {
            live.releaser();
        }
    }
    live.stranded_now();
    live
}

fn replay(text: &str, cfg: CoalesceConfig) -> Replay {
    let mut r = Replay::new(cfg, false, CAPACITY);
    for l in text.lines() {
        r.line(l);
    }
    r
}

/// The figures a replay must reproduce.
fn key(s: &Summary) -> impl PartialEq + std::fmt::Debug {
    (
        (s.peak_stranded, s.peak_held, s.peak_beyond),
        (s.final_stranded, s.final_held),
        (
            s.compactions,
            s.compacted_bytes,
            s.held_moves,
            s.moves_declined,
        ),
        (s.phys_created, s.phys_released),
        s.calls,
    )
}

#[test]
fn a_replay_under_the_recorded_policy_reproduces_the_live_figures() {
    for (name, cfg) in [
        ("defaults", defaults(0)),
        ("one handle a batch", {
            let mut c = defaults(0);
            c.split_tail = false;
            c
        }),
        ("compaction", {
            let mut c = defaults(0);
            c.move_live = true;
            c
        }),
        ("release delay", defaults(5)),
    ] {
        let live = pytorch_like(cfg, 300);
        let want = live.figures();
        assert!(
            want.peak_held > 0 && want.calls_of(Op::Create) > 0,
            "{name}"
        );
        let r = replay(&live.text, cfg);
        let got = r.summary();
        assert_eq!(key(&got), key(&want), "{name}\n{}", got.json(None, true));
        assert_eq!(got.mismatches, 0, "{name}: {:?}", got.first_mismatch);
        assert_eq!(got.skipped, 0, "{name}: {:?}", got.first_skipped);
        assert_eq!(got.va_conflicts, 0, "{name}");
        assert!(got.recorded_releaser, "{name}");
        assert_eq!(
            got.events,
            live.text.lines().filter(|l| !l.starts_with('#')).count() as u64
        );
        assert_eq!(r.header().pid, 1);
    }
}

#[test]
fn the_policy_of_the_replay_is_its_own() {
    let live = pytorch_like(defaults(0), 300);
    let split = replay(&live.text, defaults(0)).summary();
    let mut one = defaults(0);
    one.split_tail = false;
    let whole = replay(&live.text, one).summary();
    // The program saw the same answers; the handles behind its pages differ.
    assert_eq!(whole.mismatches, 0, "{:?}", whole.first_mismatch);
    assert!(
        whole.calls_of(Op::Create) < split.calls_of(Op::Create),
        "{} vs {}",
        whole.json(None, true),
        split.json(None, true)
    );
    assert!(whole.policy.contains("split_tail=0") && split.policy.contains("split_tail=1"));
}

#[test]
fn under_another_release_delay_kept_handles_go_back_after_quiet_on_the_recorded_clock() {
    // Recorded at release at once: nothing kept, no releaser line needed.
    let live = pytorch_like(defaults(0), 300);
    let kept = replay(&live.text, defaults(1)).summary();
    assert!(!kept.recorded_releaser);
    assert_eq!(kept.mismatches, 0, "{:?}", kept.first_mismatch);
    // Calls come 50 µs apart, the releaser's every 11 steps 10 ms later: handles are kept
    // between, and given back after each 10 ms quiet.
    assert!(kept.releases_simulated > 0, "{}", kept.json(None, true));
    let at_once = replay(&live.text, defaults(0)).summary();
    assert!(
        kept.calls_of(Op::Create) < at_once.calls_of(Op::Create),
        "kept handles serve new pages: {} vs {}",
        kept.json(None, true),
        at_once.json(None, true)
    );
    // Recorded with a delay, replayed at once: the releaser's lines have nothing to do.
    let delayed = pytorch_like(defaults(5), 300);
    let now = replay(&delayed.text, defaults(0)).summary();
    assert!(!now.recorded_releaser);
    assert_eq!(now.releases_simulated, 0);
    assert_eq!(now.mismatches, 0, "{:?}", now.first_mismatch);
}

#[test]
fn malformed_lines_are_skipped_and_counted_and_the_rest_replays() {
    let live = pytorch_like(defaults(0), 120);
    let bad = [
        "",
        "garbage",
        "12 0 1 create 0x1400000 = ok",
        "12 0 1 frobnicate = ok",
        "12 0 1 release 0xnothex = ok",
        "\u{fffd}\u{fffd} = err",
        "12 0 1 map 0x1 0x2 0x3 = ok",
        "# a comment of someone's",
    ];
    let mut noisy = String::new();
    for (i, l) in live.text.lines().enumerate() {
        noisy += l;
        noisy += "\n";
        if i % 9 == 4 {
            noisy += bad[i % bad.len()];
            noisy += "\n";
        }
    }
    let clean = replay(&live.text, defaults(0)).summary();
    let got = replay(&noisy, defaults(0)).summary();
    let expect_skipped = noisy
        .lines()
        .filter(|l| matches!(trace::parse(l), Some(Err(_))))
        .count() as u64;
    assert!(expect_skipped > 5);
    assert_eq!(got.skipped, expect_skipped);
    assert!(got.first_skipped.is_some());
    assert_eq!(key(&got), key(&clean));
    assert_eq!(got.events, clean.events);
    // A truncated last line (a process killed mid-write) and a trace of nothing but noise.
    let cut = &live.text[..live.text.len() - 7];
    let r = replay(cut, defaults(0)).summary();
    assert!(r.skipped <= 1 && r.events + 1 >= clean.events);
    let noise = replay("\u{0}\u{1}\n= = =\n1 2 3\n\n", defaults(0)).summary();
    assert_eq!((noise.events, noise.skipped, noise.devices), (0, 3, 0));
    // The JSON line stays one line, whatever the lines said.
    assert_eq!(got.json(Some("a \"b\"\n"), true).lines().count(), 1);
}

#[test]
fn unknown_handles_are_counted_as_mismatches_not_panics() {
    let text = "\
1 0 1 reserved 0x700000000000 0x40000000 = ok
2 0 1 release 0xe5e5000000000099 = ok
3 0 1 map 0x700000000000 0x1400000 0x0 0xe5e5000000000099 = ok
4 0 1 set_access 0x700000000000 0x1400000 0:3 = ok 0x1
5 0 1 export 0x1234 = ok 0x1
6 0 1 unmap 0x700000000000 0x1400000 0 = ok 0x1
7 1 0 pause - 0 = ok 0x0
8 1 0 resume 0x5 = ok 0x0
9 0 1 retain 0x700000000000 = ok
";
    let s = replay(text, defaults(0)).summary();
    assert_eq!(s.events, 9);
    assert_eq!(s.skipped, 0);
    assert_eq!(s.devices, 2);
    // release, map, set_access (nothing of ours: Ok(false)), export and unmap differ.
    assert_eq!(s.mismatches, 5, "{:?}", s.first_mismatch);
}
