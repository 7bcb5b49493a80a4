//! What placement has learned of the program's lifetimes, as data: cut addresses, the
//! addresses the program has mapped pages at, those of pages it shared, and the batches whose
//! tail split proved useful or useless. The rules that learn and use them are in `cuts`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// At most this many cuts a device; the oldest go first.
pub(super) const MAX_CUTS: usize = 4096;
/// At most this many tail splits waiting to be judged (each giving back's end looks at every
/// one: two lookups each); the oldest go first.
const MAX_TAILS: usize = 1024;

/// Cut addresses, the order they were learned in (to forget the oldest), the addresses the
/// program has mapped pages at, those of pages it shared, and the batches whose tail split
/// proved useful or useless. The address sets are merged
/// ranges: they grow with the separate ranges a program ever maps, not with its calls.
#[derive(Debug, Default)]
pub(super) struct Cuts {
    at: BTreeSet<u64>,
    order: VecDeque<u64>,
    seen: Ranges,
    shared: Ranges,
    /// Giving backs since the last one that learned a cut.
    quiet: u32,
    /// Batches whose last page got a handle of its own, not yet judged: the last page's
    /// address -> (the batch's first page's, when it was split: a sequence number).
    tails: BTreeMap<u64, (u64, u64)>,
    /// The order tails were split in, (address, sequence), to forget the oldest; entries
    /// judged or split again since are skipped.
    tail_order: VecDeque<(u64, u64)>,
    tail_seq: u64,
    /// The ranges of batches whose tail split proved useful, and of those whose split was
    /// judged and proved nothing (batch and last page gone together).
    useful: Ranges,
    useless: Ranges,
    /// Giving backs ended so far.
    rounds: u64,
}

/// Address ranges, merged: start -> end.
#[derive(Debug, Default)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    fn covers(&self, va: u64, size: u64) -> bool {
        self.0
            .range(..=va)
            .next_back()
            .is_some_and(|(_, e)| *e >= va.saturating_add(size))
    }

    fn overlaps(&self, va: u64, size: u64) -> bool {
        self.0
            .range(..va.saturating_add(size))
            .next_back()
            .is_some_and(|(_, e)| *e > va)
    }

    fn add(&mut self, va: u64, size: u64) {
        let (mut s, mut e) = (va, va.saturating_add(size));
        if let Some((&ps, &pe)) = self.0.range(..=s).next_back() {
            if pe >= s {
                s = ps;
                e = e.max(pe);
            }
        }
        let after: Vec<(u64, u64)> = self.0.range(s..=e).map(|(a, b)| (*a, *b)).collect();
        for (a, b) in after {
            self.0.remove(&a);
            e = e.max(b);
        }
        self.0.insert(s, e);
    }
}

impl Cuts {
    /// Learn a cut; false if it was known.
    pub(super) fn add(&mut self, va: u64) -> bool {
        if !self.at.insert(va) {
            return false;
        }
        self.order.push_back(va);
        while self.order.len() > MAX_CUTS {
            if let Some(old) = self.order.pop_front() {
                self.at.remove(&old);
            }
        }
        true
    }

    /// Whether a handle must not run across `va` (from below it into it).
    pub(super) fn at(&self, va: u64) -> bool {
        self.at.contains(&va)
    }

    /// The first cut in `[from, to)`.
    pub(super) fn first_in(&self, from: u64, to: u64) -> Option<u64> {
        self.at.range(from..to).next().copied()
    }

    /// Whether the program mapped a page over all of `[va, va+size)` before.
    pub(super) fn seen(&self, va: u64, size: u64) -> bool {
        self.seen.covers(va, size)
    }

    /// The program maps a page at `[va, va+size)`.
    pub(super) fn see(&mut self, va: u64, size: u64) {
        self.seen.add(va, size);
    }

    /// Whether a page the program shared lay in `[va, va+size)`.
    pub(super) fn shared(&self, va: u64, size: u64) -> bool {
        self.shared.overlaps(va, size)
    }

    /// Where in `[from, to)` the first shared range starts (`from` if one covers it).
    pub(super) fn first_shared(&self, from: u64, to: u64) -> Option<u64> {
        if self.shared.overlaps(from, 1) {
            return Some(from);
        }
        self.shared.0.range(from..to).next().map(|(s, _)| *s)
    }

    /// A page at `[va, va+size)` is shared (an export, an IPC run, NCCL's retain).
    pub(super) fn share(&mut self, va: u64, size: u64) {
        self.shared.add(va, size);
    }

    /// A giving back ended having learned `new` cuts.
    pub(super) fn round(&mut self, new: usize) {
        self.rounds += 1;
        self.quiet = if new > 0 {
            0
        } else {
            self.quiet.saturating_add(1)
        };
    }

    /// Whether the program's lifetimes are still being learned: a cut was learned in one of
    /// the last `quiet` giving backs, or fewer than that many have ended. A program that never
    /// gives memory back stays learning (only its growth pays: a few more handles); one whose
    /// cuts outnumber [`MAX_CUTS`] relearns forgotten ones and learns again. Both cost speed,
    /// never exactness.
    pub(super) fn learning(&self, quiet: u32) -> bool {
        self.quiet < quiet
    }

    /// A batch `[first, tail + a page)` got a handle of its own for its last page at `tail`.
    pub(super) fn split_tail(&mut self, first: u64, tail: u64) {
        self.tail_seq += 1;
        self.tails.insert(tail, (first, self.tail_seq));
        self.tail_order.push_back((tail, self.tail_seq));
        while self.tails.len() > MAX_TAILS {
            let Some((t, seq)) = self.tail_order.pop_front() else {
                break;
            };
            if self.tails.get(&t).is_some_and(|v| v.1 == seq) {
                self.tails.remove(&t);
            }
        }
        if self.tail_order.len() > 4 * MAX_TAILS {
            let tails = &self.tails;
            self.tail_order
                .retain(|(t, seq)| tails.get(t).is_some_and(|v| v.1 == *seq));
        }
    }

    /// At the end of a giving back, judge the tail splits whose batch and last page now
    /// differ: `mapped(from, to)` tells whether the program has a page mapped in
    /// `[from, to)`. A batch all gone while its last page lives: the split kept it from
    /// stranding (its range remembered as useful). Both gone: the split proved nothing (its
    /// range remembered as useless). Both mapped: judged later. Returns
    /// the useful ones found now (counted in `CoalesceStats::tail_splits_useful`).
    pub(super) fn judge_tails(&mut self, mapped: impl Fn(u64, u64) -> bool) -> u64 {
        let mut useful = 0;
        self.tails.retain(|&tail, &mut (first, _)| {
            let (batch, last) = (mapped(first, tail), mapped(tail, tail + 1));
            if batch && last {
                return true;
            }
            if last && !batch {
                useful += 1;
                self.useful.add(first, tail + 1 - first);
            } else if !last && !batch {
                self.useless.add(first, tail + 1 - first);
            }
            false
        });
        useful
    }

    /// Giving backs ended so far.
    pub(super) fn rounds(&self) -> u64 {
        self.rounds
    }

    /// Whether a tail split proved useful for a batch overlapping `[first, end)`.
    pub(super) fn useful_near(&self, first: u64, end: u64) -> bool {
        self.useful.overlaps(first, end - first)
    }

    /// Whether a tail split was judged useless for a batch overlapping `[first, end)`.
    pub(super) fn useless_near(&self, first: u64, end: u64) -> bool {
        self.useless.overlaps(first, end - first)
    }

    /// Tests: the tail splits waiting to be judged.
    #[cfg(test)]
    pub(super) fn tails_waiting(&self) -> Vec<u64> {
        self.tails.keys().copied().collect()
    }

    /// Tests: lifetimes count as learned from now on.
    #[cfg(test)]
    pub(super) fn settle(&mut self) {
        self.quiet = u32::MAX;
    }

    pub(super) fn len(&self) -> usize {
        self.at.len()
    }
}
