//! Coalesced pages: the physical memory behind another allocator's VMM pages (PyTorch's
//! expandable segments), in one driver handle per batch instead of one per page.
//!
//! The program keeps calling `cuMemCreate`/`cuMemMap`/`cuMemSetAccess`/`cuMemUnmap`/
//! `cuMemRelease` page by page. The handles it gets are expseg's names for pages (*virtual
//! handles*). A page is *pending* until its memory is needed; pending pages mapped back to back
//! get one physical handle (a *phys*) when the program sets access to them, mapped once over
//! the whole run. What a step of `empty_cache()` churn costs is then a handful of driver calls
//! per tensor, not five per 20 MiB page.
//!
//! # Admission
//! `cuMemCreate` must answer `CUDA_ERROR_OUT_OF_MEMORY` exactly when the memory is not there
//! (PyTorch frees its cache and retries on that answer only). A page is admitted as pending
//! while the pending bytes stay `margin` below the driver's free memory, read once per batch.
//! Nearer the limit the pending pages and the new one are created at once, as one handle, so
//! the answer is the driver's own: it fails exactly when the bytes a native run would hold by
//! now do not fit. What remains is a race with other processes taking more than `margin`
//! between a create and the access call; then access falls back to one handle per page, and
//! fails with out-of-memory if even that cannot be had.
//!
//! # Compaction
//! A handle maps and unmaps only whole. When the program unmaps and releases some pages of a
//! phys while others stay live, the phys stays mapped (the released pages are *ghosts*) and
//! its dead bytes are *stranded*. [`Coalescer::settle`] moves the live pages into new handles
//! at the same addresses and releases the old one: wait for the device, create, copy (through
//! device memory where there is room, else through host memory), unmap the old, map the new,
//! release. Every step before the release has a restore path that leaves data and mappings as
//! they were. It runs when stranded bytes pass `strand_max`, before a create would fail, before
//! a ghost range is mapped again, and before a page is exported.
//!
//! While it runs, the live pages are briefly unmapped: no other thread may launch work on
//! them during the allocator call that compacts (PyTorch holds its allocator lock; its own
//! stream was synchronised before the unmap that stranded the bytes, and expseg waits for the
//! whole device before copying).
//!
//! # Rooms
//! This file is the API (the program's calls). Below it, each room uses only the rooms under
//! it: `share` gives other processes what they map (never moving what is shared whole),
//! `sleep` pauses and resumes handles, `plan` backs pending pages, `compact` moves live pages out of partly released
//! handles, `reuse` keeps and gives back released handles, `books` holds the state and
//! its range queries, `timed` counts and times every driver call; `cuts` learns where handles
//! should end from the program's giving back and sharing (its data in `learned`, kept by `books`).
//! Beside them, `trace` is the
//! text form of the API's calls (recorded by `crate::api::trace` in test builds), and `replay`
//! (test builds) drives a coalescer on the fake driver from it.

mod books;
mod compact;
mod cuts;
mod learned;
mod plan;
#[cfg(feature = "test-switches")]
pub mod replay;
mod reuse;
mod share;
mod sleep;
mod slots;
#[cfg(test)]
mod tests;
mod timed;
pub mod trace;

pub use books::{
    is_virtual, CoalesceConfig, CoalesceStats, Coalescer, Seen, INVALID, NOT_SUPPORTED,
};
pub use reuse::TrimParts;
pub use sleep::{Choose, Paused};

use crate::gpu::{Driver, DrvResult, PageProps};
use books::{end, Page, FREE_FRESH_NS, FREE_STALE_NS, NEXT_VH, OTHERS_BYTES_PER_MS, TAG};

impl<D: Driver> Coalescer<D> {
    /// Give back now everything held beyond the program's pages (stranded pages compacted,
    /// kept handles released): the bytes given back.
    pub fn trim(&mut self) -> u64 {
        let before = self.physical_bytes();
        self.drop_ahead();
        self.settle(true);
        self.release_kept();
        before.saturating_sub(self.physical_bytes())
    }

    /// Keep the host buffers of a pause for the next one (`EXPSEG_PAUSE_KEEP_HOST`).
    pub fn keep_host(&mut self, on: bool) {
        self.host.keep = on;
    }

    /// Free host buffers kept for the next pause: the bytes freed.
    pub fn release_host(&mut self) -> u64 {
        self.host.release_spare(&mut self.drv)
    }

    /// Pause the program's pages whose tag `choose` takes (`Some(discard)`): what is held
    /// beyond them goes back first, the device's work is waited for (and that of every other
    /// device given access to its pages), then each handle's live bytes go to the host (or
    /// are dropped) and the handle goes back to the driver. Handles with exported pages are
    /// left alone (counted). Pausing twice pauses what is still awake.
    pub fn pause(&mut self, choose: Choose) -> DrvResult<Paused> {
        match self.moves_allowed {
            true => self.trim(),
            // Another thread's pause: pages it does not pause may be in use meanwhile.
            false => self.trim_unmoved(),
        };
        self.drv.synchronize()?;
        let mut access: Vec<(i32, u32)> = self
            .phys
            .values()
            .filter(|p| p.base.is_some() && p.asleep.is_none())
            .flat_map(|p| p.access.iter().copied())
            .collect();
        access.sort_unstable();
        self.wait_for_peers(&access)?;
        self.sleep(choose)
    }

    /// Resume paused pages whose tag `choose` takes: the bytes resumed. Out of memory: Err,
    /// what could be made is resumed, the rest stays paused with its host copy (retry).
    pub fn resume(&mut self, choose: &dyn Fn(u32) -> bool) -> DrvResult<u64> {
        self.wake(choose)
    }

    /// Memory grown ahead goes back with released pages: the program's pages did not grow
    /// into it, and it is not the program's. Its phys are compacted as partly released ones.
    /// With moving live pages off (the default) the bytes ahead of a handle whose pages the
    /// program maps stay for its next pages there (`adopt_stranded`): giving them back would
    /// move those pages.
    pub fn drop_ahead(&mut self) {
        if !std::mem::take(&mut self.grown) {
            return;
        }
        let grown: Vec<u64> = self
            .phys
            .iter()
            .filter(|(_, p)| p.ahead > 0)
            .map(|(pid, _)| *pid)
            .filter(|pid| self.cfg.move_live || !self.has_mapped_page(*pid))
            .collect();
        for pid in grown {
            self.stats.ahead_returned += self.set_ahead(pid, 0);
            self.dirty.insert(pid);
        }
        self.grown = self.ahead_bytes() > 0;
    }

    /// `trim` for a caller outside the program's own calls (another process asking for memory,
    /// on the socket thread): what goes back without moving a live page (kept handles,
    /// handles none of whose bytes are a live page's, handles the driver refused before), the
    /// bytes given back. Moving live pages is safe only inside the program's own calls: now
    /// its threads may be launching work on them, whose writes a copy would miss. What only
    /// moving them gives back (bytes grown ahead of live pages, pages stranded by a release
    /// loop in progress) goes back at the program's next call (`giving_back_ended`).
    pub fn trim_unmoved(&mut self) -> u64 {
        self.trim_unmoved_timed().bytes
    }

    /// [`Self::trim_unmoved`], with how long each of its parts took.
    pub fn trim_unmoved_timed(&mut self) -> TrimParts {
        let before = self.physical_bytes();
        let mut parts = TrimParts::default();
        let t0 = std::time::Instant::now();
        self.retry_leftovers();
        let t1 = std::time::Instant::now();
        let idle = self.pids(|pid, p| {
            p.slots.is_empty() && p.asleep.is_none() && (p.ahead > 0 || self.dirty.contains(&pid))
        });
        parts.idle_handles = idle.len() as u64;
        for pid in idle {
            let ahead = self.phys[&pid].ahead;
            match self.release_idle(pid) {
                Ok(()) => self.stats.ahead_returned += ahead,
                Err(e) => log::warn!("releasing an idle handle failed ({e}); tried again later"),
            }
        }
        let t2 = std::time::Instant::now();
        self.release_kept();
        let t3 = std::time::Instant::now();
        if self.stranded() > 0 || self.phys.values().any(|p| p.ahead > 0) {
            self.trim_owed = true;
        }
        (parts.leftovers, parts.idle, parts.kept) = (t1 - t0, t2 - t1, t3 - t2);
        parts.bytes = before.saturating_sub(self.physical_bytes());
        parts
    }

    /// A call other than an unmap or a release: if the program was giving memory back, that
    /// has ended, and memory grown ahead before it goes back now (its handles compacted with
    /// the pages the release loops left stranded). Handles whose own pages the program
    /// released took theirs back then, with no copy; waiting for the end spares a copy of
    /// handles whose pages a later loop of the same `empty_cache()` releases.
    ///
    /// On a thread other than the device's allocator's (`moves_allowed` false) nothing moves:
    /// the device's own next call does this.
    pub fn giving_back_ended(&mut self) {
        let gave_back = std::mem::take(&mut self.gave_back);
        let released = std::mem::take(&mut self.released_since);
        if gave_back || released {
            self.judge_tails();
        }
        if released {
            self.note_stranded();
            self.learn_cuts();
        } else if gave_back {
            // Nothing stranded: nothing to learn, one more round that learned nothing.
            self.cuts.round(0);
        }
        if !self.moves_allowed {
            return;
        }
        if std::mem::take(&mut self.trim_owed) {
            // What a trim from outside left to this call (`trim_unmoved`).
            self.giving_back = false;
            self.drop_ahead();
            self.settle(true);
            return;
        }
        if std::mem::take(&mut self.giving_back) {
            self.drop_ahead();
            self.settle(false);
        } else {
            self.loop_ended();
        }
    }

    /// A call that is not the next step of the program's release loop: the pages that loop
    /// left stranded go back first.
    fn loop_ended(&mut self) {
        if self.deferred.is_some() && self.moves_allowed {
            self.settle(false);
        }
    }

    /// `cuMemAddressReserve` succeeded: remember the range (runs never cross reservations).
    pub fn reserved(&mut self, va: u64, size: u64) {
        self.reservations.insert(va, size);
    }

    /// `cuMemAddressFree` of `[va, va+size)`: make sure no phys is mapped there any more.
    /// Err if the program still has pages mapped in it (the driver's answer too).
    pub fn address_free(&mut self, va: u64, size: u64) -> DrvResult<()> {
        self.wake_in(va, size)?;
        self.giving_back_ended();
        if self.maps.range(va..end(va, size)).next().is_some() {
            return Err(INVALID);
        }
        let inside: Vec<u64> = self
            .bases
            .range(va..end(va, size))
            .map(|(_, p)| *p)
            .collect();
        for pid in inside {
            self.compact(pid, false)?;
        }
        for b in self.parked_in(va, size) {
            self.unpark(b)?;
        }
        self.reservations.remove(&va);
        Ok(())
    }

    /// The program maps a handle of its own at `[va, va+size)`: ghosts of ours must go first.
    pub fn clear_for_program(&mut self, va: u64, size: u64) {
        if let Err(e) = self.wake_in(va, size) {
            log::warn!("resuming paused pages under a new mapping failed ({e})");
            return;
        }
        if let Err(e) = self.clear_range(va, size, u64::MAX) {
            log::warn!("clearing released pages under a new mapping failed ({e})");
        }
    }

    /// The driver's free memory; 0 if it cannot say (every page is then created at once, so
    /// the answer is still the driver's own).
    fn free_now(&mut self) -> u64 {
        match self.drv.free_memory() {
            Ok(free) => {
                self.free_seen = Some((self.drv.now_ns(), free, self.made));
                free
            }
            Err(_) => {
                self.free_seen = None;
                0
            }
        }
    }

    /// The driver's last answer if it is at most `FREE_STALE_NS` old, less what this coalescer
    /// created since and what other processes could have taken past its first `FREE_FRESH_NS`
    /// (`OTHERS_BYTES_PER_MS`). What it gave back since is not added (another process may
    /// have taken it), so the figure errs low but for other processes' allocations faster
    /// than that.
    fn free_recent(&mut self) -> Option<u64> {
        let (at, free, made) = self.free_seen?;
        let age = self.drv.now_ns().saturating_sub(at);
        if age > FREE_STALE_NS {
            return None;
        }
        let others =
            age.saturating_sub(FREE_FRESH_NS) as u128 * OTHERS_BYTES_PER_MS as u128 / 1_000_000;
        let others = u64::try_from(others).unwrap_or(u64::MAX);
        Some(free.saturating_sub(self.made - made).saturating_sub(others))
    }

    /// `cuMemCreate` of a page. `dev_free` is not needed: the driver is asked.
    pub fn create(&mut self, size: u64, props: PageProps) -> DrvResult<u64> {
        self.note_call();
        let gran = self.drv.granularity();
        if size == 0 || !size.is_multiple_of(gran) {
            return Err(INVALID);
        }
        self.giving_back_ended();
        self.settle(false);
        if self.pending_bytes == 0 {
            // A new batch. The driver need not be asked what is free (34-35 µs in a training
            // loop, H200) while kept handles, this process's own memory, cover it, or its last
            // answer does (`free_recent`); a batch that does not fit by that figure asks below.
            let known = match self.kept_bytes >= size.saturating_add(self.cfg.margin) {
                true => Some(0),
                false => self.free_recent(),
            };
            match known {
                Some(free) => {
                    self.free_est = free;
                    self.free_known = false;
                    self.stats.meminfo_skipped += 1;
                }
                None => {
                    self.free_est = self.free_now();
                    self.free_known = true;
                }
            }
        }
        // Whether the pending pages and `extra` more bytes stay `margin` below what is free.
        let admit = |c: &Self, extra: u64| {
            c.pending_bytes + extra + c.cfg.margin <= c.free_est + c.kept_bytes
        };
        if !admit(self, size) && !self.free_known {
            self.free_est = self.free_now();
            self.free_known = true;
        }
        if !admit(self, size) {
            // Near the limit: stranded memory and memory grown ahead first, then a fresh look.
            self.drop_ahead();
            self.settle(true);
            self.free_est = self.free_now();
            self.free_known = true;
        }
        let vh = TAG | NEXT_VH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.pages.insert(
            vh,
            Page {
                size,
                props,
                refs: 1,
                slot: None,
                va: None,
                single: false,
            },
        );
        self.pending_bytes += size;
        self.stats.pages_created += 1;
        if !admit(self, 0) && !self.free_known {
            self.free_est = self.free_now();
            self.free_known = true;
        }
        if !admit(self, 0) {
            // Create the pending pages of these properties and this one now: the driver's
            // answer is the exact one.
            let mut batch: Vec<u64> = self
                .pages
                .iter()
                .filter(|(_, p)| p.slot.is_none() && p.props == props)
                .map(|(v, _)| *v)
                .collect();
            batch.sort_unstable();
            let made = match self.cfg.move_live {
                true => self.create_batch(&batch, props),
                false => self.create_each(&batch, props),
            };
            if let Err(e) = made {
                if self.pages.get(&vh).is_some_and(|p| p.slot.is_none()) {
                    self.pages.remove(&vh);
                    self.pending_bytes -= size;
                }
                return Err(e);
            }
        }
        Ok(vh)
    }

    /// Near the limit, pending pages as one handle (moving live pages on: a page that lands
    /// on released pages of a live handle has those compacted out of its way).
    fn create_batch(&mut self, batch: &[u64], props: PageProps) -> DrvResult<()> {
        let total: u64 = batch.iter().map(|v| self.pages[v].size).sum();
        let h = self.create_fresh(total, props)?;
        self.stats.exact_creates += 1;
        let pid = self.add_phys(h, total, None, Vec::new());
        // Its pages may land on a shared handle's released bytes (`unexact`).
        self.phys.get_mut(&pid).unwrap().blank = true;
        let mut off = 0;
        for &v in batch {
            self.attach(v, pid, off);
            off += self.pages[&v].size;
        }
        self.note_held();
        Ok(())
    }

    /// Near the limit, pending pages one handle each, in order, as natively (the program's
    /// pages so far first: they would hold memory by now). A page that lands on released
    /// pages of a live handle takes those instead and gives its own handle back (`unexact`);
    /// one handle for the batch could not be given back in part. Stops at the first failure.
    fn create_each(&mut self, batch: &[u64], props: PageProps) -> DrvResult<()> {
        for &v in batch {
            let size = self.pages[&v].size;
            let h = self.create_fresh(size, props)?;
            self.stats.exact_creates += 1;
            let pid = self.add_phys(h, size, None, Vec::new());
            self.phys.get_mut(&pid).unwrap().blank = true;
            self.attach(v, pid, 0);
            self.note_held();
        }
        Ok(())
    }

    /// `cuMemRelease` of a virtual handle.
    pub fn release(&mut self, vh: u64) -> DrvResult<()> {
        let p = self.pages.get_mut(&vh).ok_or(INVALID)?;
        // Released already, still mapped: the handle is gone for the program (as natively).
        if p.refs == 0 {
            return Err(INVALID);
        }
        p.refs -= 1;
        if p.refs == 0 && p.slot.is_none() {
            self.pending_bytes -= p.size;
        }
        self.drop_if_dead(vh);
        Ok(())
    }

    /// `cuMemRetainAllocationHandle` for an address inside a page: a new reference.
    /// Ok(None): nothing of ours there (pass through); INVALID where only a handle of ours is
    /// mapped (the program has nothing there, and our real handle is not the program's).
    pub fn retain(&mut self, ptr: u64) -> DrvResult<Option<u64>> {
        if let Some((va, vh)) = self.maps.range(..=ptr).next_back() {
            let p = self.pages.get_mut(vh).ok_or(INVALID)?;
            if ptr < va + p.size {
                // A released page not backed yet is pending again (its release took it off).
                if p.refs == 0 && p.slot.is_none() {
                    self.pending_bytes += p.size;
                }
                p.refs += 1;
                return Ok(Some(*vh));
            }
        }
        match self.ours_in_range(ptr, 1) {
            true => Err(INVALID),
            false => Ok(None),
        }
    }

    /// `cuMemMap(va, size, offset, vh, flags)`.
    pub fn map(&mut self, va: u64, size: u64, offset: u64, vh: u64) -> DrvResult<()> {
        self.wake_page(vh)?;
        self.giving_back_ended();
        let p = self.pages.get(&vh).ok_or(INVALID)?;
        if offset != 0 || size != p.size || !va.is_multiple_of(self.drv.granularity()) {
            return Err(INVALID);
        }
        if p.va.is_some() {
            log::warn!("a coalesced page is mapped at a second address; not supported");
            return Err(NOT_SUPPORTED);
        }
        let taken = self
            .maps
            .range(..end(va, size))
            .next_back()
            .is_some_and(|(s, v)| s + self.pages[v].size > va);
        if taken {
            return Err(INVALID);
        }
        // Back where it is still mapped (a ghost of its own phys): nothing to do in the driver.
        if let Some((pid, off)) = p.slot {
            let ph = &self.phys[&pid];
            if ph.base.is_some_and(|b| b + off != va) {
                // Its handle moves with it, unless other pages of it are live there: then
                // this page alone is copied out (it is not mapped: nothing uses it).
                match self.compact(pid, false) {
                    Err(compact::STAYS) => self.detach(vh)?,
                    r => r?,
                }
            }
        }
        self.maps.insert(va, vh);
        self.pages.get_mut(&vh).unwrap().va = Some(va);
        self.note_mapped(vh, true);
        Ok(())
    }

    /// `cuMemUnmap(va, size)` from a thread whose current context is this device's primary
    /// one: Ok(false) if no page of ours is mapped there (pass through).
    pub fn unmap(&mut self, va: u64, size: u64) -> DrvResult<bool> {
        self.unmap_from(va, size, Some(self.drv.device()))
    }

    /// `cuMemUnmap(va, size)` from a thread whose current context is the primary context of
    /// device `caller` (None: no context, or one of the program's own). A program waits for
    /// its work on the memory before unmapping it; PyTorch waits on the default stream of the
    /// current context, which is not this device's when `empty_cache()` frees every device's
    /// pages from one thread. So when the caller is elsewhere, a handle whose last page goes
    /// waits for this device's default stream before it leaves its address (natively that
    /// unmap runs under the kernels still using the memory: an illegal address).
    pub fn unmap_from(&mut self, va: u64, size: u64, caller: Option<i32>) -> DrvResult<bool> {
        self.note_call();
        self.on_mapped_in(va, size, |c, inside| {
            c.unmap_pages(inside, va, size, caller)
        })
    }

    /// `unmap_from` of the pages `inside` (address, page), those the program mapped in the
    /// range, in address order.
    fn unmap_pages(
        &mut self,
        inside: &[(u64, u64)],
        va: u64,
        size: u64,
        caller: Option<i32>,
    ) -> DrvResult<bool> {
        let elsewhere = caller != Some(self.drv.device());
        // Whole mappings back to back from `va` to its end, as the driver requires (adding up
        // sizes alone let a range with a hole pass, and the page after it was unmapped past
        // the range's end).
        let mut at = va;
        for (a, v) in inside {
            if *a != at {
                return Err(INVALID);
            }
            at = at.saturating_add(self.pages[v].size);
        }
        if at != va.saturating_add(size) {
            return Err(INVALID);
        }
        if self.deferred.is_some() && self.pages[&inside[0].1].slot != self.deferred {
            self.loop_ended();
        }
        // The program gives memory back: memory grown ahead goes with it (below, or when
        // the giving back ends).
        self.giving_back |= self.grown;
        for &(a, vh) in inside {
            self.maps.remove(&a);
            self.note_mapped(vh, false);
            let p = self.pages.get_mut(&vh).unwrap();
            p.va = None;
            if let Some((pid, _)) = p.slot {
                if elsewhere {
                    self.wait_before_unmap(pid);
                }
                self.unmap_phys_if_idle(pid);
            }
            self.drop_if_dead(vh);
        }
        Ok(true)
    }

    /// `cuMemSetAccess(va, size, descs)`: give memory to the pending pages mapped in the range,
    /// map what is not mapped yet, and set access. Ok(false): nothing of ours (pass through).
    pub fn set_access(&mut self, va: u64, size: u64, descs: &[(i32, u32)]) -> DrvResult<bool> {
        self.giving_back_ended();
        self.note_call();
        self.on_mapped_in(va, size, |c, inside| {
            c.set_access_pages(inside, va, size, descs)
        })
    }

    /// `set_access` on the pages `inside` (address, page), those the program mapped in the
    /// range, in address order.
    fn set_access_pages(
        &mut self,
        inside: &[(u64, u64)],
        va: u64,
        size: u64,
        descs: &[(i32, u32)],
    ) -> DrvResult<bool> {
        self.wake_in(va, size)?;
        self.materialize(inside)?;
        // The driver sets access on whole mappings: the phys behind the pages, those whose
        // mapping lacks some of it (a parked handle taken back in place has it already),
        // one call per run of them back to back. (base, size, phys, lacks access), by base
        // (mapped phys never share one).
        let mut touched = std::mem::take(&mut self.touched);
        touched.clear();
        let mut last = None;
        for (_, vh) in inside {
            let (pid, _) = self.pages[vh].slot.expect("materialized");
            if last == Some(pid) || touched.iter().any(|t| t.2 == pid) {
                continue;
            }
            last = Some(pid);
            let ph = &self.phys[&pid];
            let lacks = !descs.iter().all(|d| ph.granted.contains(d));
            touched.push((ph.base.expect("mapped"), ph.size, pid, lacks));
        }
        touched.sort_unstable();
        let mut run: Option<(u64, u64)> = None;
        for &(b, sz, _, _) in touched.iter().filter(|t| t.3) {
            match run.as_mut() {
                Some(r) if r.0 + r.1 == b => r.1 += sz,
                _ => {
                    if let Some((rb, rs)) = run.replace((b, sz)) {
                        self.set_access_on(va, size, rb, rs, descs)?;
                    }
                }
            }
        }
        match run {
            Some((rb, rs)) => self.set_access_on(va, size, rb, rs, descs)?,
            None => self.stats.access_skipped += 1,
        }
        for &(_, _, pid, _) in &touched {
            let ph = self.phys.get_mut(&pid).unwrap();
            for (d, f) in descs {
                ph.access.retain(|(x, _)| x != d);
                ph.access.push((*d, *f));
                ph.granted.retain(|(x, _)| x != d);
                ph.granted.push((*d, *f));
            }
        }
        self.touched = touched;
        Ok(true)
    }

    /// The driver's `cuMemSetAccess` on `[b, b+sz)`, for the program's call on `[va, va+size)`.
    fn set_access_on(
        &mut self,
        va: u64,
        size: u64,
        b: u64,
        sz: u64,
        descs: &[(i32, u32)],
    ) -> DrvResult<()> {
        log::debug!(
            "device {}: access {descs:?} at {va:#x}+{size:#x}, set on {b:#x}+{sz:#x}",
            self.drv.device()
        );
        self.drv.set_access_flags(b, sz, descs)
    }

    /// The program unmapped a page of `pid` after waiting on another device's stream: if no
    /// page of the handle is mapped any more (it leaves its address now, or is kept parked
    /// there for reuse, and unparked later), this device's default stream ends first. A failed
    /// wait (the context already in error) is logged; the unmap goes on as it would natively.
    fn wait_before_unmap(&mut self, pid: u64) {
        let ph = &self.phys[&pid];
        if ph.base.is_none() || ph.asleep.is_some() || self.has_mapped_page(pid) {
            return;
        }
        self.stats.cross_device_waits += 1;
        if let Err(e) = self.drv.wait_default_stream() {
            log::warn!(
                "device {}: waiting for the default stream before giving a handle back failed ({e})",
                self.drv.device()
            );
        }
    }

    /// Unmap a phys none of whose pages the program still maps. With reuse on, it stays
    /// mapped: its pages are about to be released (PyTorch unmaps and releases page by page),
    /// and the handle is then parked where it is. What is mapped there later moves it first.
    fn unmap_phys_if_idle(&mut self, pid: u64) {
        // Paused: nothing is mapped; it comes back where it was, if any page is left then.
        if self.parking() || self.phys[&pid].asleep.is_some() {
            return;
        }
        let ph = &self.phys[&pid];
        let Some(base) = ph.base else { return };
        if self.has_mapped_page(pid) {
            return;
        }
        let size = ph.size;
        log::debug!(
            "device {}: handle {:#x} unmapped from {base:#x}+{size:#x} (no page of it mapped)",
            self.drv.device(),
            ph.handle
        );
        match self.drv.unmap(base, size) {
            Ok(()) => {
                let ph = self.phys.get_mut(&pid).unwrap();
                ph.base = None;
                ph.granted.clear();
                self.bases.remove(&base);
            }
            Err(e) => log::warn!("unmapping a coalesced handle failed ({e})"),
        }
    }

    /// A handle went back whole: without keeping, what the program's giving back stranded
    /// elsewhere (memory grown ahead) is back before the call returns, as in a partial
    /// release.
    fn settle_released(&mut self) {
        // A loop over a handle that is gone whole has ended.
        if self
            .deferred
            .is_some_and(|(pid, _)| !self.phys.contains_key(&pid))
        {
            self.deferred = None;
        }
        if !self.parking() && self.deferred.is_none() && !self.dirty.is_empty() {
            self.settle(false);
        }
    }

    /// Forget a page the program neither holds nor maps; release its phys when it was the
    /// last, or count the phys as stranding.
    fn drop_if_dead(&mut self, vh: u64) {
        let p = &self.pages[&vh];
        if p.refs > 0 || p.va.is_some() {
            return;
        }
        let slot = p.slot;
        let props = p.props;
        let size_of_page = p.size;
        // Memory another process may have imported is never kept for new pages: it goes
        // back to the driver, which keeps it for the importer.
        let shared = p.single;
        self.unslot(vh);
        self.pages.remove(&vh);
        let Some((pid, off)) = slot else { return };
        self.gave_back = true;
        if self.phys[&pid].asleep.is_some() {
            // Paused: the driver holds nothing of it; only the books and the host copy change.
            self.forget_asleep(pid);
            return;
        }
        self.stats.ahead_returned += self.set_ahead(pid, 0);
        if !self.phys[&pid].slots.is_empty() {
            self.dirty.insert(pid);
            self.released_since = true;
            if !self.parking() {
                // Released memory goes back before the call returns (the contract without
                // keeping): compact now, unless the program may be releasing the next page
                // of this handle next (PyTorch frees a range page by page, in address order):
                // then at the call that ends that loop.
                let next = off + size_of_page;
                match self.phys[&pid].slots.contains_key(&next) {
                    true => self.deferred = Some((pid, next)),
                    false => self.settle(false),
                }
            }
            return;
        }
        if shared {
            match self.release_idle(pid) {
                Ok(()) => self.settle_released(),
                Err(e) => {
                    log::warn!("releasing a shared handle failed ({e})");
                    self.dirty.insert(pid);
                }
            }
            return;
        }
        if self.parking() && self.phys[&pid].base.is_some() {
            self.park(pid, props);
            return;
        }
        self.unmap_phys_if_idle(pid);
        let ph = &self.phys[&pid];
        if ph.base.is_some() {
            // Unmapping failed: keep it and try again at the next compaction.
            self.dirty.insert(pid);
            return;
        }
        let (handle, size) = (ph.handle, ph.size);
        match self.dispose(handle, size, props) {
            Ok(()) => {
                self.remove_phys(pid);
                self.dirty.remove(&pid);
                self.settle_released();
            }
            Err(e) => {
                log::warn!("releasing a coalesced handle failed ({e})");
                self.dirty.insert(pid);
            }
        }
    }
}
