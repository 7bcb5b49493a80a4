//! Sharing: what other processes map never moves. A run shared by IPC marks the handles
//! behind it shared, whole (`share_run`: nothing moves); a multicast binding by handle binds
//! the coalesced handle at the page's offset (`bind_handle`); an export of a page, or another
//! library's retain of it, gives the page a handle of its own (`export`, `isolate_page`: a
//! split, which moves the handle's live pages, refused where the handle was shared whole).

use super::books::{Coalescer, INVALID, NOT_SUPPORTED};
use crate::gpu::{ChunkHandle, Driver, DrvResult, PageProps};

impl<D: Driver> Coalescer<D> {
    /// `cuMemExportToShareableHandle` of a page: the page gets a handle of its own (a consumer
    /// maps what it imports whole, page by page), and that real handle is returned.
    pub fn export(&mut self, vh: u64) -> DrvResult<ChunkHandle> {
        self.wake_page(vh)?;
        self.giving_back_ended();
        let p = self.pages.get(&vh).ok_or(INVALID)?;
        let size = p.size;
        match p.slot {
            None => {
                // Its own handle (attach takes it off the pending bytes), room made as for
                // any new page.
                let props = p.props;
                let h = self.create_fresh(size, props)?;
                let pid = self.add_phys(h, size, None, Vec::new());
                self.attach(vh, pid, 0);
                self.shared_here(pid);
            }
            Some((pid, _)) if self.phys[&pid].size != size => {
                self.refuse_split_of_shared(pid)?;
                // Every page of the phys is likely shared too: split it once, page by page.
                let members: Vec<(u64, bool)> = self.phys[&pid]
                    .slots
                    .values()
                    .map(|m| (*m, self.pages[m].single))
                    .collect();
                for (m, _) in &members {
                    self.pages.get_mut(m).unwrap().single = true;
                }
                self.shared_here(pid);
                if let Err(e) = self.compact_for_sharing(pid) {
                    // Nothing moved (a capture in progress, no memory): the pages are as they
                    // were, so a later export may split them.
                    for (m, was) in members {
                        if let Some(p) = self.pages.get_mut(&m) {
                            p.single = was;
                        }
                    }
                    return Err(e);
                }
                self.stats.exports_split += 1;
            }
            Some((pid, _)) => self.shared_here(pid),
        }
        self.pages.get_mut(&vh).unwrap().single = true;
        let (pid, _) = self.pages[&vh].slot.expect("has memory");
        Ok(self.phys[&pid].handle)
    }

    /// Before `cuMemExportToShareableHandle` of page `vh`: where the page lies inside a handle
    /// larger than itself (one a split would move the live neighbours of), mapped at its
    /// address, its `(address, size, properties)`, so that the caller may export a copy of it
    /// instead (`api::ipc::pages`); `None` where the page has a handle of its own or no memory
    /// (the export needs no move). Paused, it resumes first. Nothing else changes.
    pub fn export_inside(&mut self, vh: u64) -> DrvResult<Option<(u64, u64, PageProps)>> {
        self.wake_page(vh)?;
        self.giving_back_ended();
        let p = self.pages.get(&vh).ok_or(INVALID)?;
        let (Some((pid, off)), Some(va)) = (p.slot, p.va) else {
            return Ok(None);
        };
        let ph = &self.phys[&pid];
        let inside = ph.size != p.size && ph.base.is_some_and(|b| b + off == va);
        if !inside {
            return Ok(None);
        }
        let (size, props) = (p.size, p.props);
        // Learned as for a split: pages mapped here again get handles of their own, so the
        // next share of the same buffer needs no copy.
        self.shared_here(pid);
        Ok(Some((va, size, props)))
    }

    /// Whether page `vh` is mapped at `va` with its memory there (not paused, not moved
    /// away): what a copy of it may read.
    pub fn page_mapped_at(&self, vh: u64, va: u64) -> bool {
        let Some(p) = self.pages.get(&vh) else {
            return false;
        };
        match (p.slot, p.va) {
            (Some((pid, off)), Some(v)) if v == va => self
                .phys
                .get(&pid)
                .is_some_and(|ph| ph.asleep.is_none() && ph.base.is_some_and(|b| b + off == va)),
            _ => false,
        }
    }

    /// The real handle behind page `vh` and where the page starts in it, for a call that names
    /// memory by a handle and an offset into it and keeps using it (`cuMulticastBindMem`):
    /// nothing moves; the handle is shared from now on (never moves, pauses or splits: its
    /// pages are `single`), as for [`Coalescer::share_run`]. A page with no memory yet gets a
    /// handle of its own (as for an export). Paused, it resumes first.
    pub fn bind_handle(&mut self, vh: u64) -> DrvResult<(ChunkHandle, u64)> {
        self.wake_page(vh)?;
        self.giving_back_ended();
        let Some((pid, off)) = self.pages.get(&vh).ok_or(INVALID)?.slot else {
            return self.export(vh).map(|h| (h, 0));
        };
        let members: Vec<u64> = self.phys[&pid].slots.values().copied().collect();
        for m in members {
            self.pages.get_mut(&m).unwrap().single = true;
        }
        self.shared_here(pid);
        Ok((self.phys[&pid].handle, off))
    }

    /// Before another process gets the memory of the run of the program's pages starting at
    /// `ptr`'s (IPC of another allocator's memory, a multicast binding by address): every
    /// handle behind the run's first `max` pages is woken if paused, and from now on never
    /// moves, pauses or takes new pages (its pages are `single`), so what a consumer maps
    /// stays the program's memory. Nothing moves: a consumer maps those handles whole, and a
    /// ticket's grant says where the run starts inside the first (`api::ipc::tickets`).
    /// Handles beyond the run (parked ones, others' pages) are left as they are. Out of memory
    /// to wake a paused handle: an error, and the run's other handles stay as they were.
    pub fn share_run(&mut self, ptr: u64, max: usize) -> DrvResult<()> {
        self.giving_back_ended();
        let Some((mut at, _)) = self.range_of(ptr) else {
            return Ok(());
        };
        let mut done: Vec<u64> = Vec::new();
        for _ in 0..max {
            let Some(&vh) = self.maps.get(&at) else {
                break;
            };
            let (size, slot, va) = {
                let p = &self.pages[&vh];
                (p.size, p.slot, p.va)
            };
            let Some((pid, _)) = slot else {
                // No memory yet: it will get a handle of its own where it is shared.
                if let (true, Some(va)) = (self.cfg.learn_cuts, va) {
                    self.cuts.share(va, size);
                }
                break;
            };
            if !done.contains(&pid) {
                // Paused handles of the run resume first (the consumer maps them); handles
                // outside it stay paused.
                self.wake_phys(pid)?;
                let members: Vec<u64> = self.phys[&pid].slots.values().copied().collect();
                for m in members {
                    self.pages.get_mut(&m).unwrap().single = true;
                }
                self.shared_here(pid);
                done.push(pid);
            }
            at += size;
        }
        Ok(())
    }

    /// The program's run from the page containing `ptr`: its start and the sizes of the
    /// pages mapped back to back from there (at most `max`), each with memory that is mapped
    /// (not paused). What the driver would report natively, one mapping a page, whatever
    /// handles lie behind them. None: no page of the program's at `ptr`.
    pub fn program_run(&self, ptr: u64, max: usize) -> Option<(u64, Vec<u64>)> {
        let (start, _) = self.range_of(ptr)?;
        let mut sizes = Vec::new();
        let mut at = start;
        while sizes.len() < max {
            let Some(vh) = self.maps.get(&at) else { break };
            let p = &self.pages[vh];
            match p.slot {
                Some((pid, _)) if self.phys[&pid].base.is_some() => {}
                _ => break,
            }
            sizes.push(p.size);
            at += p.size;
        }
        (!sizes.is_empty()).then_some((start, sizes))
    }

    /// Before a caller retains and exports the handle behind the page containing `ptr`
    /// (NCCL's buffer registration): that page gets a handle of its own that never moves
    /// again. A coalesced handle is split for it, its live pages moved into page-sized
    /// handles (held as every move is: `compact`): a consumer that maps the exported handle
    /// maps it whole, page-sized. Paused, it resumes first.
    pub fn isolate_page(&mut self, ptr: u64) -> DrvResult<()> {
        self.giving_back_ended();
        let Some((_, vh)) = self.maps.range(..=ptr).next_back().map(|(a, v)| (*a, *v)) else {
            return Ok(());
        };
        let Some((pid, _)) = self.pages[&vh].slot else {
            // No memory yet: it will get a handle of its own where it is shared.
            let p = &self.pages[&vh];
            if let (true, Some(va)) = (self.cfg.learn_cuts, p.va) {
                let size = p.size;
                self.cuts.share(va, size);
            }
            return Ok(());
        };
        self.wake_phys(pid)?;
        let ph = &self.phys[&pid];
        let (Some(base), size) = (ph.base, ph.size) else {
            return Ok(());
        };
        if !(base..base + size).contains(&ptr) {
            return Ok(());
        }
        let members: Vec<u64> = ph.slots.values().copied().collect();
        let split = ph.slots.len() > 1 || members.iter().any(|v| self.pages[v].size != size);
        if split {
            self.refuse_split_of_shared(pid)?;
        }
        let was: Vec<bool> = members.iter().map(|m| self.pages[m].single).collect();
        for m in &members {
            self.pages.get_mut(m).unwrap().single = true;
        }
        self.shared_here(pid);
        if split {
            if let Err(e) = self.compact_for_sharing(pid) {
                // Nothing moved: the pages are as they were.
                for (m, w) in members.iter().zip(was) {
                    if let Some(p) = self.pages.get_mut(m) {
                        p.single = w;
                    }
                }
                return Err(e);
            }
            self.stats.exports_split += 1;
        }
        Ok(())
    }

    /// A page-sized handle is asked for a page of `pid` (an export, NCCL's retain) after the
    /// handle was shared whole (`share_run`: another process may map it): splitting it would
    /// move pages that process maps, so the call fails (`CUDA_ERROR_NOT_SUPPORTED`), saying
    /// why once; nothing changes.
    fn refuse_split_of_shared(&mut self, pid: u64) -> DrvResult<()> {
        if !self.shared_phys(pid) {
            return Ok(());
        }
        self.stats.splits_refused += 1;
        if self.stats.splits_refused == 1 {
            log::warn!("a page-sized handle was asked for a page of memory this process shared with cudaIpcGetMemHandle (another process may map its handle whole): it is not split, because that would move memory the other process maps; the call fails with CUDA_ERROR_NOT_SUPPORTED (share one buffer one way: by cudaIpcGetMemHandle, or by handle export)");
        }
        Err(NOT_SUPPORTED)
    }
}
