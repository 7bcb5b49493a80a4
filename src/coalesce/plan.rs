//! Backing pending pages: runs of pages mapped back to back get one handle each (memory
//! grown ahead under them first, then parked handles taken back in place where that costs
//! no more, then kept handles, then new ones, grown ahead where the program's pages end),
//! mapped where the pages are.

use super::books::{key, Coalescer, KeptKey, AHEAD_SHARE, INVALID};
use crate::gpu::{ChunkHandle, Driver, DrvResult};

impl<D: Driver> Coalescer<D> {
    /// Give memory to the pages in `inside` (address, page) and map every phys behind them.
    pub(super) fn materialize(&mut self, inside: &[(u64, u64)]) -> DrvResult<()> {
        self.unexact(inside);
        // Parked handles under whole chains of pending pages first (no driver call), then
        // kept or new handles for the rest, in runs of at most `max_handle`. Runs and pieces
        // are slices of `inside` (no copies of it).
        let mut rest: Vec<&[(u64, u64)]> = Vec::new();
        let leaving = self.leaving_for(inside);
        for (a, b) in self.pending_runs(inside, u64::MAX) {
            let chain = &inside[a..b];
            let chain = &chain[self.adopt_ahead(chain)..];
            for (c, d) in self.adopt_stranded(chain, &leaving)? {
                let piece = &chain[c..d];
                for (e, f) in self.adopt_parked(piece) {
                    rest.push(&piece[e..f]);
                }
            }
        }
        // The last page of the program's batch is shared with what it allocates next (PyTorch
        // serves small blocks from the tail of the block it mapped pages for): with
        // `split_tail` it gets a handle of its own, so the batch's other pages go back whole
        // when their block does, whatever lives in the tail.
        let tail = inside.last().map(|(va, _)| *va);
        let split_tail = self.splits_tails();
        for piece in rest {
            for (a, b) in self.pending_runs(piece, self.cfg.max_handle) {
                let run = &piece[a..b];
                match run.split_last() {
                    Some((last, body))
                        if split_tail
                            && !body.is_empty()
                            && Some(last.0) == tail
                            && self.splits_tail_here(body[0].0, last.0 + 1) =>
                    {
                        self.back_run(body)?;
                        self.back_run(&[*last])?;
                        if self.cfg.learn_cuts {
                            self.cuts.split_tail(body[0].0, last.0);
                        }
                    }
                    _ => self.back_run(run)?,
                }
            }
        }
        // Map every phys of the range that is not mapped where its pages are (a phys whose
        // pages disagree is split first, so look again).
        for &(_, vh) in inside {
            for _ in 0..3 {
                let (pid, _) = self.pages[&vh].slot.expect("backed");
                if self.phys[&pid].base.is_some() {
                    break;
                }
                self.map_phys(pid)?;
            }
            let (pid, _) = self.pages[&vh].slot.expect("backed");
            if self.phys[&pid].base.is_none() {
                return Err(INVALID);
            }
        }
        self.saw(inside);
        Ok(())
    }

    /// Runs of the pending pages in `inside` mapped back to back, within one reservation, of
    /// the same properties, each at most `limit` bytes (a longer page stands alone): index
    /// ranges of `inside` (pages back to back are next to each other there: its mappings are
    /// in address order and never overlap).
    pub(super) fn pending_runs(&self, inside: &[(u64, u64)], limit: u64) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut len = 0u64;
        for (i, &(va, vh)) in inside.iter().enumerate() {
            let p = &self.pages[&vh];
            if p.slot.is_some() {
                continue;
            }
            let extend = runs.last().is_some_and(|r| {
                let (lva, lvh) = inside[r.1 - 1];
                let lp = &self.pages[&lvh];
                r.1 == i
                    && lva + lp.size == va
                    && lp.props == p.props
                    && !p.single
                    && !lp.single
                    && len.saturating_add(p.size) <= limit.max(p.size)
                    && !self.cuts.at(va)
                    && (self.known(lva, lp.size) && self.known(va, p.size)
                        || p.props.tag != 0
                            && !self.shared_at(lva, lp.size)
                            && !self.shared_at(va, p.size))
                    && self.same_reservation(inside[r.0].0, va + p.size)
            });
            if extend {
                runs.last_mut().unwrap().1 = i + 1;
                len += p.size;
            } else {
                runs.push((i, i + 1));
                len = p.size;
            }
        }
        runs
    }

    /// What `back_run` would do for these pieces of uniform pages, given kept handles of
    /// these sizes (largest that fits first, as `take_kept`): (new bytes, driver cost). The
    /// cost counts, per handle mapped, a map, an access call and the unmap to come (≈ 130 µs,
    /// H100), and per new handle its create and release (≈ 200 µs more).
    pub(super) fn plan_cost(
        &self,
        pieces: &[&[(u64, u64)]],
        mut sizes: Vec<u64>,
        unit: u64,
    ) -> (u64, u64) {
        sizes.sort_unstable();
        let (mut fresh, mut cost) = (0, 0);
        for piece in pieces {
            for (a, b) in self.pending_runs(piece, self.cfg.max_handle) {
                let mut want = (b - a) as u64 * unit;
                while let Some(x) = sizes
                    .iter()
                    .rposition(|s| *s <= want && s.is_multiple_of(unit))
                {
                    want -= sizes.remove(x);
                    cost += 130;
                }
                if want > 0 {
                    fresh += want;
                    cost += 330;
                }
            }
        }
        (fresh, cost)
    }

    /// Parked handles that lie wholly under a chain of pending pages of one size, page
    /// aligned, become those pages' memory where they are mapped: no driver call. Returns
    /// the pieces of the chain still without memory (index ranges).
    pub(super) fn adopt_parked(&mut self, chain: &[(u64, u64)]) -> Vec<(usize, usize)> {
        let (start, first) = chain[0];
        let unit = self.pages[&first].size;
        let props = self.pages[&first].props;
        let end = start + chain.len() as u64 * unit;
        let uniform = chain
            .iter()
            .enumerate()
            .all(|(i, (va, v))| *va == start + i as u64 * unit && self.pages[v].size == unit);
        if !uniform || self.parked.is_empty() {
            return vec![(0, chain.len())];
        }
        let hits: Vec<(u64, KeptKey)> = self
            .parked
            .range(start..end)
            .filter(|(b, k)| {
                k.0 == key(props)
                    && **b + k.1 <= end
                    && (**b - start).is_multiple_of(unit)
                    && k.1.is_multiple_of(unit)
            })
            .map(|(b, k)| (*b, *k))
            .collect();
        if hits.is_empty() {
            return vec![(0, chain.len())];
        }
        // Taking them back saves an unmap, a map and an access call each, but splits the
        // chain into more handles: only when the pieces need no more new memory, and no more
        // driver time, than the whole chain would with kept handles. (Splitting whenever the
        // new bytes were equal made churn 1.24x slower: more, smaller handles, H100.)
        let kp = key(props);
        let sizes: Vec<u64> = self
            .kept
            .keys()
            .filter(|k| k.0 == kp)
            .map(|k| k.1)
            .collect();
        let mut whole = self.plan_cost(&[chain], sizes.clone(), unit);
        // Without them, each is unmapped before the chain is mapped (≈ 50 µs).
        whole.1 += 50 * hits.len() as u64;
        let mut pieces = Vec::new();
        let mut left = sizes;
        let mut i = 0usize;
        for (b, k) in &hits {
            let i0 = ((b - start) / unit) as usize;
            if i0 > i {
                pieces.push((i, i0));
            }
            i = i0 + (k.1 / unit) as usize;
            if let Some(x) = left.iter().position(|s| *s == k.1) {
                left.swap_remove(x);
            }
        }
        if i < chain.len() {
            pieces.push((i, chain.len()));
        }
        let slices: Vec<&[(u64, u64)]> = pieces.iter().map(|(a, b)| &chain[*a..*b]).collect();
        let split = self.plan_cost(&slices, left, unit);
        if split.0 > whole.0 || split.1 > whole.1 {
            return vec![(0, chain.len())];
        }
        for (b, k) in hits {
            let i0 = ((b - start) / unit) as usize;
            let n = (k.1 / unit) as usize;
            let kh = self.kept.remove(&k).unwrap();
            self.parked.remove(&b);
            self.kept_bytes -= k.1;
            self.stats.reused_bytes += k.1;
            self.stats.reused_in_place += k.1;
            log::debug!(
                "device {}: kept handle {:#x} taken back in place at {b:#x}+{:#x}",
                self.drv.device(),
                kh.handle,
                k.1
            );
            let pid = self.add_phys(kh.handle, k.1, Some(b), kh.granted);
            for (j, (_, vh)) in chain[i0..i0 + n].iter().enumerate() {
                self.attach(*vh, pid, j as u64 * unit);
            }
        }
        pieces
    }

    /// Pending pages mapped where a phys has memory grown ahead (right after its last page)
    /// take it, in order, with no driver call (the mapping has its access already). Returns
    /// how many of the chain's first pages it served (the rest are left without memory).
    pub(super) fn adopt_ahead(&mut self, chain: &[(u64, u64)]) -> usize {
        let (va, first) = chain[0];
        let props = self.pages[&first].props;
        let Some((&base, &pid)) = self.bases.range(..=va).next_back() else {
            return 0;
        };
        let ph = &self.phys[&pid];
        let from = ph.size - ph.ahead;
        let same = ph.slots.values().next().map(|v| self.pages[v].props) == Some(props);
        if ph.ahead == 0 || base + from != va || !same {
            return 0;
        }
        // A shared handle's pages are all `single` (it never moves): so are those it takes.
        let shared = self.shared_phys(pid);
        let mut off = from;
        let mut taken = 0;
        for &(pva, vh) in chain {
            let size = self.pages[&vh].size;
            if pva != base + off || off + size > self.phys[&pid].size {
                break;
            }
            self.attach(vh, pid, off);
            self.pages.get_mut(&vh).unwrap().single |= shared;
            self.set_ahead(pid, self.phys[&pid].ahead - size);
            self.stats.ahead_used += size;
            off += size;
            taken += 1;
        }
        log::debug!(
            "device {}: {taken} pages at {va:#x} served by memory grown ahead",
            self.drv.device()
        );
        taken
    }

    /// Pages created near the limit with a handle of their own (`create_each`), not mapped
    /// yet, that land inside a live handle's mapping (on its released pages): their handles
    /// go back and they are pending again, to take those bytes in place (`adopt_stranded`).
    /// Mapping them over those bytes would move the live handle's pages; holding both would
    /// hold the bytes twice.
    /// Moving live pages on, the pages of a batch made near the limit (`create_batch`) keep
    /// their handle and the live handle is compacted out of their way, unless it is shared
    /// (another process may map it whole: it never moves, `compact_as` refuses): then the
    /// batch's handle goes back whole (it cannot in part; it holds no bytes of the program's
    /// yet) and all its pages are pending again, those on the shared handle's released bytes
    /// to take them in place (they become shared too), the rest to get memory as any.
    fn unexact(&mut self, inside: &[(u64, u64)]) {
        for &(va, vh) in inside {
            let Some((pid, _)) = self.pages[&vh].slot else {
                continue;
            };
            let ph = &self.phys[&pid];
            // An exported one (`single`) is another process's too: never given back.
            if !ph.blank || ph.base.is_some() || ph.asleep.is_some() || self.shared_phys(pid) {
                continue;
            }
            let in_way = self.phys_in(va, self.pages[&vh].size);
            let gives_back = match self.cfg.move_live {
                false => {
                    ph.slots.len() == 1 && ph.size == self.pages[&vh].size && !in_way.is_empty()
                }
                true => in_way
                    .iter()
                    .any(|w| self.shared_phys(*w) && self.has_mapped_page(*w)),
            };
            if !gives_back {
                continue;
            }
            let handle = ph.handle;
            if let Err(e) = self.drv.release(handle) {
                log::warn!("giving back a handle made near the limit failed ({e}); kept");
                continue;
            }
            let ph = self.remove_phys(pid).expect("a phys");
            self.dirty.remove(&pid);
            self.stats.phys_released += 1;
            for v in ph.slots.values() {
                let p = self.pages.get_mut(v).unwrap();
                p.slot = None;
                if p.refs > 0 {
                    self.pending_bytes += p.size;
                }
            }
        }
    }

    /// Pending pages mapped where a live handle holds released pages (or bytes grown ahead)
    /// take those bytes in place: no driver call, and the handle strands less. This is how
    /// stranded memory serves the program again without moving a live page: PyTorch maps
    /// new pages into the holes its `empty_cache()` left. A handle another process may map
    /// (a shared run's) gives them too, and the page becomes shared with it (`stranded_room`).
    /// Handles in `leaving` (`leaving_for`) give none.
    /// Returns the pieces of the chain still without memory (index ranges).
    pub(super) fn adopt_stranded(
        &mut self,
        chain: &[(u64, u64)],
        leaving: &[u64],
    ) -> DrvResult<Vec<(usize, usize)>> {
        let mut pieces: Vec<(usize, usize)> = Vec::new();
        // The first page of the piece under way.
        let mut start = None;
        for (i, &(va, vh)) in chain.iter().enumerate() {
            self.loose_out_of_the_way(va, vh)?;
            let room = self
                .stranded_room(va, vh)
                .filter(|(pid, _)| !leaving.contains(pid));
            match room {
                Some((pid, off)) => {
                    let size = self.pages[&vh].size;
                    let ph = &self.phys[&pid];
                    if off + size > ph.size - ph.ahead {
                        // Into the bytes grown ahead: what lies before the page is dead now.
                        let ahead = ph.size - (off + size);
                        self.stats.ahead_used += self.set_ahead(pid, ahead) - ahead;
                    }
                    self.stats.reused_stranded += size;
                    // A handle another process may map (shared: every page `single`) stays
                    // shared with the page that takes its bytes.
                    let shared = self.shared_phys(pid);
                    self.attach(vh, pid, off);
                    if shared {
                        self.pages.get_mut(&vh).unwrap().single = true;
                    }
                    match self.dead(pid) {
                        0 => self.dirty.remove(&pid),
                        _ => self.dirty.insert(pid),
                    };
                    if let Some(s) = start.take() {
                        pieces.push((s, i));
                    }
                }
                None => {
                    start.get_or_insert(i);
                }
            }
        }
        if let Some(s) = start {
            pieces.push((s, chain.len()));
        }
        Ok(pieces)
    }

    /// Mapped handles none of whose pages the program maps that the pages `inside` need out
    /// of their way: under a page with a handle of its own (`map_phys` maps it there), or
    /// with a page the program unmapped but holds under a pending page (`loose_out_of_the_way`
    /// leaves handles without mapped pages to `clear_range`). They leave whole when the pages'
    /// handles are mapped (`clear_range`: compacted, or unmapped as an unmoved ghost), so no
    /// page takes their released bytes in place meanwhile (`adopt_stranded`): a page mapped
    /// there would pin the handle where moving live pages is off, and always for a shared
    /// one (`compact_as`: `STAYS`), and the page in its way could not be mapped.
    fn leaving_for(&self, inside: &[(u64, u64)]) -> Vec<u64> {
        let mut out = Vec::new();
        for &(va, vh) in inside {
            let p = &self.pages[&vh];
            for pid in self.phys_in(va, p.size) {
                let ph = &self.phys[&pid];
                if ph.asleep.is_some() || self.has_mapped_page(pid) || out.contains(&pid) {
                    continue;
                }
                let needed = match p.slot {
                    // Its own handle, or one in its place (a page back where it was mapped).
                    Some((own, _)) => own != pid,
                    None => {
                        let base = ph.base.expect("mapped");
                        let (lo, hi) = (va.saturating_sub(base), va + p.size - base);
                        let under = ph.slots.range(..hi).next_back();
                        under.is_some_and(|(o, v)| *o + self.pages[v].size > lo)
                    }
                };
                if needed {
                    out.push(pid);
                }
            }
        }
        out
    }

    /// Pages the program unmapped but holds (not released) whose bytes lie under `va` in a
    /// live handle: each gets a handle of its own with a copy (`detach`: nothing uses them),
    /// so the page mapped there takes the room.
    /// A copy that fails (no memory for it) is the access call's failure: natively the page
    /// would get the memory its own create held, but here the bytes in its way cannot move.
    fn loose_out_of_the_way(&mut self, va: u64, vh: u64) -> DrvResult<()> {
        let size = self.pages[&vh].size;
        let Some((&base, &pid)) = self.bases.range(..=va).next_back() else {
            return Ok(());
        };
        let ph = &self.phys[&pid];
        if va >= base + ph.size || ph.asleep.is_some() || !self.has_mapped_page(pid) {
            return Ok(());
        }
        let off = va - base;
        let loose: Vec<u64> = ph
            .slots
            .range(..off + size)
            .filter(|(o, v)| *o + self.pages[*v].size > off && self.pages[*v].va.is_none())
            .map(|(_, v)| *v)
            .collect();
        for v in loose {
            self.detach(v).inspect_err(|e| {
                log::warn!("copying out an unmapped page under a new one failed ({e})")
            })?;
        }
        Ok(())
    }

    /// The live handle mapped under `va` whose bytes `[off, off+size)` there are no page's
    /// (released, or grown ahead), of the page's properties: (phys, off).
    fn stranded_room(&self, va: u64, vh: u64) -> Option<(u64, u64)> {
        let p = &self.pages[&vh];
        let (&base, &pid) = self.bases.range(..=va).next_back()?;
        let ph = &self.phys[&pid];
        let off = va - base;
        if ph.asleep.is_some() || off.checked_add(p.size)? > ph.size {
            return None;
        }
        // The handle's own properties (a tag is expseg's, not the driver's: a page of another
        // tag may land here where the program maps it; a pause then leaves the handle alone
        // unless it takes both tags). A shared handle (its pages `single`: another process
        // may map it whole, so it never moves) gives its released bytes to the page mapped
        // there, as the default allocator gives a freed block's bytes to the next tensor:
        // they cannot leave the address for it.
        let mut members = ph.slots.values().map(|v| &self.pages[v]);
        let first = members.next()?;
        if p.single || key(first.props) != key(p.props) || members.any(|m| m.single != first.single)
        {
            return None;
        }
        let before = ph.slots.range(..off).next_back();
        if before.is_some_and(|(o, v)| o + self.pages[v].size > off) {
            return None;
        }
        if ph.slots.range(off..off + p.size).next().is_some() {
            return None;
        }
        Some((pid, off))
    }

    /// How far to grow a new handle ahead of a run of `total` bytes of pages of `unit` bytes
    /// ending at `end`: at most `ahead`, 1/AHEAD_SHARE of the most held so far (all handles'
    /// bytes ahead together) and what the largest handle leaves, in whole pages, within the
    /// program's reservation and short of anything mapped after the run (the program's pages
    /// or handles, or ours); nothing for a run larger than that.
    ///
    /// Where live pages never move, what a handle grew ahead may end up stranded (the next
    /// pages there have their own lifetimes). Counting stranded bytes against the same share
    /// was measured and undone: it stopped growing ahead in the RL loop's trainer, whose
    /// stranded bytes do not come from it (a slower step: docs/failed-approaches.md).
    fn ahead_for(&self, end: u64, total: u64, unit: u64) -> u64 {
        let mut cap = self
            .cfg
            .ahead
            .min((self.peak_held / AHEAD_SHARE).saturating_sub(self.ahead_bytes()))
            .min(self.cfg.max_handle.saturating_sub(total));
        if let Some(most) = self.learning_ahead() {
            cap = cap.min(most);
        }
        // Only small runs grow ahead: a run that outlives an empty_cache() keeps its handle's
        // bytes ahead until it moves to a handle of its own (a copy), so the copy a large run
        // would cost is not risked (train_ec with logits live across empty_cache() compacted
        // 230 MB a step, H100).
        if total > cap {
            return 0;
        }
        let Some((s, l)) = self.reservations.range(..end).next_back() else {
            return 0;
        };
        cap = cap.min((s + l).saturating_sub(end));
        if let Some((m, _)) = self.maps.range(end..end.saturating_add(cap)).next() {
            cap = cap.min(m - end);
        }
        if let Some((b, _)) = self.bases.range(end..end.saturating_add(cap)).next() {
            cap = cap.min(b - end);
        }
        if let Some((b, _)) = self.parked.range(end..end.saturating_add(cap)).next() {
            cap = cap.min(b - end);
        }
        if let Some(c) = self.cuts.first_in(end, end.saturating_add(cap)) {
            cap = cap.min(c - end);
        }
        // Nor over addresses the program shared pages at: pages mapped there get handles of
        // their own (bytes grown ahead under them would be a coalesced handle again).
        if self.cfg.learn_cuts {
            if let Some(s) = self.cuts.first_shared(end, end.saturating_add(cap)) {
                cap = cap.min(s - end);
            }
        }
        cap / unit.max(1) * unit
    }

    /// Memory for a run of pending pages: kept handles first (largest that fits, several back
    /// to back), the rest as one new handle (grown ahead where the run ends the program's
    /// pages); one per page if that cannot be had.
    pub(super) fn back_run(&mut self, run: &[(u64, u64)]) -> DrvResult<()> {
        let props = self.pages[&run[0].1].props;
        let unit = self.pages[&run[0].1].size;
        let uniform = run.iter().all(|(_, v)| self.pages[v].size == unit);
        let mut rest = run;
        while uniform && !rest.is_empty() && self.kept_bytes > 0 {
            let want = rest.len() as u64 * unit;
            let Some((h, size)) = self.take_kept(props, want, unit) else {
                break;
            };
            let n = (size / unit) as usize;
            self.adopt(h, size, &rest[..n]);
            rest = &rest[n..];
        }
        if rest.is_empty() {
            return Ok(());
        }
        let total: u64 = rest.iter().map(|(_, v)| self.pages[v].size).sum();
        let (last_va, last) = *rest.last().unwrap();
        let known = self.known(last_va, self.pages[&last].size);
        let ahead = match uniform && last_va != 0 && !self.no_ahead && known {
            true => self.ahead_for(last_va + self.pages[&last].size, total, unit),
            false => 0,
        };
        if ahead > 0 {
            // Memory short for the bytes ahead is no failure: without them, as before.
            if let Ok(h) = self.create_fresh(total + ahead, props) {
                let pid = self.adopt(h, total + ahead, rest);
                self.set_ahead(pid, ahead);
                self.grown = true;
                self.note_stranded();
                log::debug!(
                    "device {}: handle for {total:#x} bytes of pages grown {ahead:#x} ahead",
                    self.drv.device()
                );
                return Ok(());
            }
        }
        match self.create_fresh(total, props) {
            Ok(h) => {
                self.adopt(h, total, rest);
                Ok(())
            }
            Err(e) if e.is_oom() && rest.len() > 1 => {
                self.stats.access_fallbacks += 1;
                for (_, vh) in rest {
                    self.back_run(&[(0, *vh)])?;
                }
                Ok(())
            }
            Err(e) => {
                if e.is_oom() {
                    self.stats.access_fallbacks += 1;
                    log::warn!("memory admitted for a page was taken before it was mapped (another process?); out of memory at cuMemSetAccess");
                }
                Err(e)
            }
        }
    }

    /// A handle becomes the memory of pending pages, in order: its phys.
    pub(super) fn adopt(&mut self, h: ChunkHandle, size: u64, pages: &[(u64, u64)]) -> u64 {
        let pid = self.add_phys(h, size, None, Vec::new());
        self.phys.get_mut(&pid).unwrap().slots.reserve(pages.len());
        let mut off = 0;
        for (_, vh) in pages {
            self.attach(*vh, pid, off);
            off += self.pages[vh].size;
        }
        self.note_held();
        pid
    }

    /// Map an unmapped phys where its pages are mapped; split it first if they disagree.
    pub(super) fn map_phys(&mut self, pid: u64) -> DrvResult<()> {
        let ph = &self.phys[&pid];
        let mut base = None;
        let mut consistent = true;
        for (off, vh) in ph.slots.iter() {
            if let Some(va) = self.pages[vh].va {
                match base {
                    None => base = Some(va - off),
                    Some(b) if b + off == va => {}
                    Some(_) => consistent = false,
                }
            }
        }
        let Some(b) = base else { return Ok(()) };
        let size = ph.size;
        let whole = consistent
            && ph.slots.values().all(|v| self.pages[v].va.is_some())
            && self.dead(pid) == 0;
        // A shared handle (another process may map it whole) that left its address with none
        // of its pages mapped (`unmoved_ghost`) comes back whole where its mapped pages say,
        // its unmapped and released pages with it, as before it left, where nothing else of
        // the program's lies there: split, its pages would be copies the other process does
        // not see. Where it cannot, it is split as any (the program's call goes on).
        let shared = !whole
            && consistent
            && self.shared_phys(pid)
            && self.same_reservation(b, b + size)
            && self
                .maps
                .range(b..b + size)
                .all(|(_, v)| self.pages[v].slot.is_some_and(|(o, _)| o == pid));
        if !whole && !shared {
            // Pages elsewhere or unmapped, or released pages among them (the program may have
            // mapped something else where those were: mapped whole, the handle would not
            // fit, and the access call would fail): one handle each, mapped one by one.
            return self.compact(pid, true);
        }
        let h = ph.handle;
        if let Err(e) = self.clear_range(b, size, pid) {
            match shared {
                true => return self.compact(pid, true),
                false => return Err(e),
            }
        }
        log::debug!(
            "device {}: handle {h:#x} mapped at {b:#x}+{size:#x}",
            self.drv.device()
        );
        if let Err(e) = self.drv.map(b, size, h) {
            if shared {
                // A mapping the books do not know (the program's own) lies there.
                return self.compact(pid, true);
            }
            if self.phys[&pid].ahead == 0 {
                return Err(e);
            }
            // A mapping the books do not know lies where the handle grew ahead (the program's
            // own, in its reservation): its pages get a handle without, and nothing grows
            // ahead any more.
            log::warn!("a handle grown ahead could not be mapped at {b:#x}+{size:#x} ({e}); growing ahead is off from here");
            self.no_ahead = true;
            return self.back_again(pid);
        }
        let ph = self.phys.get_mut(&pid).unwrap();
        ph.base = Some(b);
        ph.granted.clear();
        ph.blank = false;
        self.bases.insert(b, pid);
        Ok(())
    }

    /// An unmapped phys's pages get memory anew (its handle goes back): they are pending
    /// again and backed as a run.
    fn back_again(&mut self, pid: u64) -> DrvResult<()> {
        let ph = self.remove_phys(pid).expect("a phys");
        self.dirty.remove(&pid);
        let mut run = Vec::new();
        for vh in ph.slots.values() {
            let p = self.pages.get_mut(vh).unwrap();
            p.slot = None;
            if p.refs > 0 {
                self.pending_bytes += p.size;
            }
            run.push((p.va.unwrap_or(0), *vh));
        }
        self.stats.phys_released += 1;
        self.release_or_hold(ph.handle, ph.size);
        self.back_run(&run)
    }

    /// Compact every other phys whose mapping overlaps `[va, va+size)` (ghosts in the way).
    pub(super) fn clear_range(&mut self, va: u64, size: u64, except: u64) -> DrvResult<()> {
        for b in self.parked_in(va, size) {
            self.unpark(b)?;
        }
        for pid in self.phys_in(va, size).into_iter().filter(|p| *p != except) {
            self.compact(pid, false)?;
        }
        Ok(())
    }
}
