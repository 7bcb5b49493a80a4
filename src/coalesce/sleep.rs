//! Paused handles: a handle's live pages copied to the host (offload) or dropped (discard),
//! the handle unmapped and released with its address kept in the books; on resume a new
//! handle is made, mapped at the same address with the same access, and the bytes copied back.
//!
//! A paused phys keeps its place in `phys` and `bases` (the program still has its pages
//! mapped there); only its handle is gone (`Phys::asleep`). Every program call that would
//! make the driver touch it wakes it first ([`Coalescer::wake_in`], [`Coalescer::wake_page`]).

use super::books::{Coalescer, Sleep};
use crate::gpu::{Driver, DrvResult};
pub use crate::hostcopy::{Choose, Paused};

impl<D: Driver> Coalescer<D> {
    /// Pause the mapped handles `choose` takes (the caller has given back what was held
    /// beyond the program's pages, and waited for the device). Err: nothing was paused.
    pub(super) fn sleep(&mut self, choose: Choose) -> DrvResult<Paused> {
        let mut out = Paused::default();
        let mut offload: Vec<(u64, Vec<(u64, u64)>)> = Vec::new();
        let mut discard: Vec<u64> = Vec::new();
        for pid in self.pids(|_, p| p.base.is_some() && p.asleep.is_none()) {
            let ph = &self.phys[&pid];
            let base = ph.base.expect("mapped and awake: chosen so");
            // Pages of several tags share a handle only where a page of another tag was
            // mapped onto its released or grown-ahead bytes (`adopt_stranded`): paused only if
            // the pause takes every tag in it alike.
            let mut tags = ph.slots.values().map(|v| choose(self.pages[v].props.tag));
            let Some(first) = tags.next() else {
                continue;
            };
            if tags.any(|t| t != first) {
                out.mixed += ph.size;
                continue;
            }
            let Some(drop) = first else {
                continue;
            };
            if ph.slots.values().any(|v| self.pages[v].single) {
                out.shared += ph.size;
                continue;
            }
            if drop {
                discard.push(pid);
                continue;
            }
            // The live pages' bytes, runs of adjacent pages as one range.
            let mut ranges: Vec<(u64, u64)> = Vec::new();
            for (off, vh) in ph.slots.iter() {
                let (a, n) = (base + off, self.pages[vh].size);
                match ranges.last_mut() {
                    Some(r) if r.0 + r.1 == a => r.1 += n,
                    _ => ranges.push((a, n)),
                }
            }
            offload.push((pid, ranges));
        }
        let items: Vec<Vec<(u64, u64)>> = offload.iter().map(|(_, r)| r.clone()).collect();
        let saved = self.host.save(&mut self.drv, &items)?;
        out.pin_ns = self.host.last_pin_ns;
        let chosen = offload
            .into_iter()
            .zip(saved.into_iter().map(Some))
            .map(|((pid, _), s)| (pid, s))
            .chain(discard.into_iter().map(|pid| (pid, None)));
        for (pid, saved) in chosen {
            let ph = &self.phys[&pid];
            let (base, size, handle) = (ph.base.expect("mapped"), ph.size, ph.handle);
            let props = self.pages[ph.slots.values().next().unwrap()].props;
            if let Err(e) = self.drv.unmap(base, size) {
                log::warn!("pausing {base:#x}+{size:#x}: unmapping failed ({e}); it stays");
                if let Some(s) = saved {
                    self.host.done(&mut self.drv, s);
                }
                continue;
            }
            if let Err(e) = self.drv.release(handle) {
                self.hold(handle, size, e);
            }
            // The whole handle went back, its released pages and bytes grown ahead with it:
            // nothing of it is left to compact or give back while it sleeps (a pause from
            // outside, which moves nothing, leaves both). It comes back whole, and the pages
            // released by then are compacted at the program's next call.
            self.dirty.remove(&pid);
            if self.deferred.is_some_and(|(d, _)| d == pid) {
                self.deferred = None;
            }
            // Bytes grown ahead (the handle's end, never a page's) went back for good: the
            // handle comes back without them, and they are not counted as paused.
            let ahead = self.set_ahead(pid, 0);
            let ph = self.phys.get_mut(&pid).unwrap();
            self.held_awake -= ph.size;
            ph.size -= ahead;
            self.stats.ahead_returned += ahead;
            out.bytes += size - ahead;
            out.offloaded += saved.as_ref().map_or(0, |s| s.bytes());
            let ph = self.phys.get_mut(&pid).unwrap();
            ph.handle = 0;
            ph.asleep = Some(Sleep { saved, props });
            self.maybe_asleep = true;
        }
        Ok(out)
    }

    /// Resume the paused handles `choose` takes: new handles at the same addresses, access
    /// as it was, bytes copied back. On failure (out of memory) what was made stays resumed
    /// and the rest stays paused, host copies kept: a later resume goes on. The bytes resumed.
    pub(super) fn wake(&mut self, choose: &dyn Fn(u32) -> bool) -> DrvResult<u64> {
        let pids = self.pids(|_, p| p.asleep.as_ref().is_some_and(|s| choose(s.props.tag)));
        self.wake_pids(&pids)
    }

    fn wake_pids(&mut self, pids: &[u64]) -> DrvResult<u64> {
        let mut made: Vec<(u64, u64)> = Vec::new();
        let mut failed = None;
        let mut queued = Ok(());
        // The smallest handle that found no memory: larger ones are not tried (they would
        // fail too), smaller ones are (what fits is resumed).
        let mut too_big = u64::MAX;
        for &pid in pids {
            let size = self.phys[&pid].size;
            if size >= too_big {
                continue;
            }
            match self.remake(pid) {
                Ok(h) => made.push((pid, h)),
                // Out of memory: this one stays paused with its host copy (retry).
                Err(e) if e.is_oom() => {
                    failed = Some(e);
                    too_big = size;
                    continue;
                }
                // This handle alone cannot come back (its range taken): it stays paused with
                // its host copy and the others go on.
                Err(e) => {
                    log::warn!(
                        "device {}: resuming a paused handle failed ({e}); it stays paused, the others resume",
                        self.drv.device()
                    );
                    failed.get_or_insert(e);
                    continue;
                }
            }
            // Its bytes go back while the next handle is made.
            if let Some(s) = self.phys[&pid]
                .asleep
                .as_ref()
                .and_then(|s| s.saved.as_ref())
            {
                queued = self.host.restore(&mut self.drv, s);
                if queued.is_err() {
                    break;
                }
            }
        }
        let copied = queued.and_then(|_| self.drv.wait_copies());
        if let Err(e) = copied {
            // The host copies stay; the handles made go back.
            for (pid, h) in made {
                let ph = &self.phys[&pid];
                let (base, size) = (ph.base.expect("mapped"), ph.size);
                let _ = self.drv.unmap(base, size);
                if let Err(e) = self.drv.release(h) {
                    self.hold(h, size, e);
                }
            }
            return Err(e);
        }
        let mut bytes = 0;
        for (pid, h) in made {
            let ph = self.phys.get_mut(&pid).unwrap();
            ph.handle = h;
            bytes += ph.size;
            self.held_awake += ph.size;
            if let Some(s) = ph.asleep.take().and_then(|s| s.saved) {
                self.host.done(&mut self.drv, s);
            }
            // Pages the program released while it was paused: stranded now, compacted at
            // the program's next call.
            if self.dead(pid) > 0 {
                self.dirty.insert(pid);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(bytes),
        }
    }

    /// A new handle for a paused phys, mapped where it was with the access it had.
    fn remake(&mut self, pid: u64) -> DrvResult<u64> {
        let ph = &self.phys[&pid];
        let (base, size) = (ph.base.expect("paused while mapped"), ph.size);
        let granted = ph.granted.clone();
        let props = ph.asleep.as_ref().expect("paused").props;
        let h = self.create_fresh(size, props)?;
        let mapped = self.drv.map(base, size, h).and_then(|_| {
            self.drv
                .set_access_flags(base, size, &granted)
                .inspect_err(|_| {
                    let _ = self.drv.unmap(base, size);
                })
        });
        if let Err(e) = mapped {
            if let Err(e) = self.drv.release(h) {
                self.hold(h, size, e);
            }
            return Err(e);
        }
        Ok(h)
    }

    /// The program released a page of paused phys `pid` (unmapped while paused: PyTorch's
    /// `empty_cache()`): the last page gone, the phys and its host copy go, with no driver
    /// call; otherwise it stays paused and comes back with that page's bytes stranded.
    pub(super) fn forget_asleep(&mut self, pid: u64) {
        if !self.phys[&pid].slots.is_empty() {
            return;
        }
        let ph = self.remove_phys(pid).unwrap();
        if let Some(b) = ph.base {
            self.bases.remove(&b);
        }
        self.dirty.remove(&pid);
        if let Some(s) = ph.asleep.and_then(|s| s.saved) {
            self.host.done(&mut self.drv, s);
        }
    }

    /// A program call about to touch `[va, va+size)`: paused handles there wake first.
    pub(super) fn wake_in(&mut self, va: u64, size: u64) -> DrvResult<()> {
        if !self.any_asleep() {
            return Ok(());
        }
        let pids: Vec<u64> = self
            .phys_in(va, size)
            .into_iter()
            .filter(|p| self.phys[p].asleep.is_some())
            .collect();
        self.wake_some(pids)
    }

    /// A program call about to touch page `vh`'s memory: its handle wakes first if paused.
    pub(super) fn wake_page(&mut self, vh: u64) -> DrvResult<()> {
        match self.pages.get(&vh).and_then(|p| p.slot) {
            Some((pid, _)) => self.wake_phys(pid),
            None => Ok(()),
        }
    }

    /// A program call about to touch phys `pid`'s memory: it wakes first if paused.
    pub(super) fn wake_phys(&mut self, pid: u64) -> DrvResult<()> {
        match self.phys[&pid].asleep {
            Some(_) => self.wake_some(vec![pid]),
            None => Ok(()),
        }
    }

    fn wake_some(&mut self, pids: Vec<u64>) -> DrvResult<()> {
        if pids.is_empty() {
            return Ok(());
        }
        log::info!(
            "device {}: the program touched paused memory through the allocator: {} handle(s) resumed first",
            self.drv.device(),
            pids.len()
        );
        self.wake_pids(&pids).map(|_| ())
    }

    /// Whether any phys is paused (a look at every phys only after a pause, until one finds
    /// none).
    pub(super) fn any_asleep(&mut self) -> bool {
        if self.maybe_asleep {
            self.maybe_asleep = self.phys.values().any(|p| p.asleep.is_some());
        }
        self.maybe_asleep
    }

    /// Bytes paused on this device (given back to the driver; on the host where offloaded).
    pub fn paused_bytes(&self) -> u64 {
        self.phys
            .values()
            .filter(|p| p.asleep.is_some())
            .map(|p| p.size)
            .sum()
    }
}
