//! Lifetimes learned from the program's own giving back, so that pages that live differently
//! seldom share a handle (live pages never move, so a shared handle strands the released
//! part). Three rules:
//! - A page mapped at an address the program never mapped before gets a handle of its own
//!   (nothing is known of its lifetime yet; PyTorch's first steps make the long-lived tensors
//!   and the first activations there), unless the program tagged it (`expseg.tag()`): pages
//!   of one tag live together by the program's word (a KV cache), and a pause and resume of
//!   them costs a driver call per handle (2048 page handles for a 40 GiB KV cache: its
//!   discarding pause took 141 ms on an H200 against 15-46 ms with one handle a batch).
//! - A page mapped where the program shared pages before (an export, an IPC run, NCCL's
//!   retain) gets a handle of its own: sharing splits a coalesced handle, and a split moves
//!   pages, so the program's next sharing of the same buffer splits nothing.
//! - Where a stranded handle's live pages meet its released bytes when the program's giving
//!   back ends, the address is a *cut*: handles made later end there and never grow ahead
//!   across it (PyTorch's segments put the same blocks at the same addresses step after step).
//!
//! - The last page of a batch gets a handle of its own (`EXPSEG_SPLIT_TAIL`: PyTorch serves
//!   the program's next small blocks from it, so the batch's other pages go back whole with
//!   their block) while cuts are being learned ([`TAIL_ROUNDS`]), and from then on only in a
//!   program where such a split once kept a batch from stranding: all its pages went back
//!   while its last page lived. Elsewhere (DeepSpeed, FSDP2, GPT-2) the split only doubled
//!   the handles a batch costs: replayed, 36 % fewer handles on DeepSpeed ZeRO-3, the same
//!   stranded bytes. After the first [`TAIL_LOCAL_ROUNDS`] giving backs, a batch is split
//!   only where a split proved useful at its addresses or none proved useless there (batch
//!   and last page gone together), and every batch again in every [`TAIL_LOCAL_ROUNDS`]th
//!   giving back: a program with varying shapes (DDP) learns cuts forever, so it would split
//!   every batch; replayed, 22 % fewer handles there.
//! - While cuts are still being learned (one was learned in the last [`LEARNING_ROUNDS`]
//!   giving backs, or fewer have ended), only a run of at most [`LEARNING_AHEAD`] grows
//!   ahead, by at most that much:
//!   bytes grown ahead serve the next pages whatever their lifetime, and before the cuts are
//!   known that strands most (DDP with varying shapes: 2.1 % of its peak in its first ~24
//!   steps with the full 1/64 of the most held, 1.2 % with this; replayed, docs/design.md).
//!
//! Bytes grown ahead of known pages may still serve the next pages at new addresses (that is
//! what growing ahead is for), but never reach over a cut or an address that was shared.
//! What is learned outlives the program's reservations (PyTorch frees a segment's range and
//! reserves the same one again). Nothing moves for it: only handles made afterwards follow it.
//! Measured on traces of the bench's workloads (`expseg-replay`, docs/design.md).

use super::books::Coalescer;
use crate::gpu::Driver;

/// Giving backs without a new cut after which the program's lifetimes count as learned.
pub(super) const LEARNING_ROUNDS: u32 = 2;
/// The most a handle grows ahead while they are being learned (three of PyTorch's 20 MiB pages).
pub(super) const LEARNING_AHEAD: u64 = 64 << 20;
/// Giving backs without a new cut after which batches' last pages are split off only where
/// a split proved useful (2: DDP with varying shapes stranded 1.7 % of its peak, not 1.2 %).
pub(super) const TAIL_ROUNDS: u32 = 4;
/// Giving backs after which a batch's last page is split off only at addresses where a split
/// proved useful or none was judged useless, and the period of the giving backs that split
/// every batch again (replayed: DDP with varying shapes 5612 -> 4374 handles at 1.74 %
/// stranded, not 1.16 %; after 4 or 8, 2.9 %).
pub(super) const TAIL_LOCAL_ROUNDS: u64 = 16;

impl<D: Driver> Coalescer<D> {
    /// Whether pages at `[va, va+size)` may share a handle with their neighbours: the program
    /// mapped a page there before and never shared one there (or nothing is learned).
    pub(super) fn known(&self, va: u64, size: u64) -> bool {
        !self.cfg.learn_cuts || (self.cuts.seen(va, size) && !self.cuts.shared(va, size))
    }

    /// The most bytes a handle may grow ahead while lifetimes are still being learned (None:
    /// learned, or learning off).
    pub(super) fn learning_ahead(&self) -> Option<u64> {
        (self.cfg.learn_cuts && self.cuts.learning(LEARNING_ROUNDS)).then_some(LEARNING_AHEAD)
    }

    /// Whether the last page of a batch gets a handle of its own (`EXPSEG_SPLIT_TAIL`, with
    /// learning: while cuts are learned, then once a split proved useful: the count of those
    /// in the stats is what was learned).
    pub(super) fn splits_tails(&self) -> bool {
        self.cfg.split_tail
            && (!self.cfg.learn_cuts
                || self.cuts.learning(TAIL_ROUNDS)
                || self.stats.tail_splits_useful > 0)
    }

    /// Whether the last page of the batch `[first, end)` gets a handle of its own, where
    /// [`splits_tails`](Self::splits_tails) says that batches' last pages do: after the first
    /// [`TAIL_LOCAL_ROUNDS`] giving backs, only where a split proved useful at the batch's
    /// addresses or none was judged useless there, and everywhere again in every
    /// [`TAIL_LOCAL_ROUNDS`]th giving back (so that a later phase's lifetimes are judged anew).
    /// A program with varying shapes learns cuts forever, and a split that proved useful
    /// somewhere kept every batch split.
    pub(super) fn splits_tail_here(&self, first: u64, end: u64) -> bool {
        !self.cfg.learn_cuts
            || self.cuts.rounds() < TAIL_LOCAL_ROUNDS
            || self.cuts.rounds().is_multiple_of(TAIL_LOCAL_ROUNDS)
            || self.cuts.useful_near(first, end)
            || !self.cuts.useless_near(first, end)
    }

    /// At the end of a giving back (anything given back, stranded or not): the tail splits
    /// whose batch and last page now differ are judged (`Cuts::judge_tails`).
    pub(super) fn judge_tails(&mut self) {
        if !self.cfg.learn_cuts {
            return;
        }
        let maps = &self.maps;
        self.stats.tail_splits_useful += self
            .cuts
            .judge_tails(|from, to| maps.range(from..to).next().is_some());
    }

    /// Whether a page the program shared lay in `[va, va+size)` (and learning is on).
    pub(super) fn shared_at(&self, va: u64, size: u64) -> bool {
        self.cfg.learn_cuts && self.cuts.shared(va, size)
    }

    /// The pages of `pid` are shared, or about to be: pages mapped there later get handles of
    /// their own, so that sharing them again splits nothing.
    pub(super) fn shared_here(&mut self, pid: u64) {
        if !self.cfg.learn_cuts {
            return;
        }
        let pages: Vec<(u64, u64)> = self.phys[&pid]
            .slots
            .values()
            .filter_map(|v| self.pages[v].va.map(|va| (va, self.pages[v].size)))
            .collect();
        for (va, size) in pages {
            self.cuts.share(va, size);
        }
    }

    /// The pages of `inside` (address, page) have memory now: their addresses are known.
    pub(super) fn saw(&mut self, inside: &[(u64, u64)]) {
        if !self.cfg.learn_cuts {
            return;
        }
        let mut new = 0;
        for &(va, vh) in inside {
            let size = self.pages[&vh].size;
            // A range seen already is inside one merged range: seeing it again changes nothing.
            if va != 0 && !self.cuts.seen(va, size) {
                new += 1;
                self.cuts.see(va, size);
            }
        }
        if new > 0 {
            log::debug!("device {}: {new} pages at new addresses", self.drv.device());
        }
    }

    /// At the end of a giving back: every boundary between a stranded handle's live pages and
    /// its released bytes becomes a cut (its bytes grown ahead are not released bytes).
    pub(super) fn learn_cuts(&mut self) {
        if !self.cfg.learn_cuts {
            log::debug!(
                "device {}: giving back ended, {} MiB stranded in {} handles",
                self.drv.device(),
                self.stranded() >> 20,
                self.dirty.len()
            );
            return;
        }
        if log::log_enabled!(target: "expseg::coalesce::books", log::Level::Debug) {
            self.stranded_now();
        }
        let mut found = Vec::new();
        for pid in &self.dirty {
            let ph = &self.phys[pid];
            let Some(base) = ph.base else { continue };
            let used = ph.size - ph.ahead;
            // The end of the last live page (0: none yet).
            let mut end = 0;
            for (&o, vh) in ph.slots.iter() {
                if o > end {
                    // Released bytes [end, o): a cut where live pages end before them and
                    // where live pages start after them.
                    if end > 0 {
                        found.push(base + end);
                    }
                    found.push(base + o);
                }
                end = end.max(o + self.pages[vh].size);
            }
            if end > 0 && end < used {
                found.push(base + end);
            }
        }
        let mut new = 0;
        for va in found {
            if self.cuts.add(va) {
                self.stats.cuts_learned += 1;
                new += 1;
            }
        }
        self.cuts.round(new);
        log::debug!(
            "device {}: giving back ended, {} MiB stranded in {} handles; {new} cuts learned, {} known",
            self.drv.device(),
            self.stranded() >> 20,
            self.dirty.len(),
            self.cuts.len()
        );
    }
}
