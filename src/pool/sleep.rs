//! Paused blocks: a live allocation's bytes copied to the host (offload) or dropped
//! (discard), its chunks unmapped and released with its reservation kept; on resume new
//! chunks of the same sizes are mapped there with the pool's readers and the bytes copied
//! back. Freeing a paused block drops its host copy; exporting one resumes it first.

use super::{Block, BlockSleep, Chunk, Pool};
use crate::gpu::{Driver, DrvError, Op};
use crate::hostcopy::Saved;
pub use crate::hostcopy::{Choose, Paused};

impl<D: Driver> Pool<D> {
    /// Pause the live blocks `choose` takes by tag (`Some(discard)`). Cached memory goes
    /// back first and the device's work is waited for. Blocks shared by IPC (tickets,
    /// mirrors) are left alone and counted. Err: nothing was paused.
    pub fn pause(&mut self, choose: Choose) -> Result<Paused, DrvError> {
        self.give_back_cache();
        let mut out = Paused::default();
        let mut offload: Vec<(u64, Vec<(u64, u64)>)> = Vec::new();
        let mut discard: Vec<u64> = Vec::new();
        for (base, b) in &self.blocks {
            if b.cached_at.is_some() || b.asleep.is_some() {
                continue;
            }
            let Some(drop) = choose(b.tag) else { continue };
            if b.shared || b.mirror.is_some() {
                out.shared += b.size;
                continue;
            }
            match drop {
                true => discard.push(*base),
                // The bytes the program asked for, to the granule (never past the block).
                false => offload.push((
                    *base,
                    vec![(*base, b.user.next_multiple_of(self.gran).min(b.size))],
                )),
            }
        }
        if offload.is_empty() && discard.is_empty() {
            return Ok(out);
        }
        self.timed(Op::Sync, |d| d.synchronize())?;
        // Devices given peer access may still be reading the blocks: they finish first.
        for d in self.peer_readers() {
            self.timed(Op::Sync, |x| x.synchronize_peer(d))?;
        }
        let items: Vec<Vec<(u64, u64)>> = offload.iter().map(|(_, r)| r.clone()).collect();
        let saved = self.host.save(&mut self.drv, &items)?;
        out.pin_ns = self.host.last_pin_ns;
        let chosen: Vec<(u64, Option<Saved>)> = offload
            .into_iter()
            .zip(saved.into_iter().map(Some))
            .map(|((b, _), s)| (b, s))
            .chain(discard.into_iter().map(|b| (b, None)))
            .collect();
        for (base, saved) in chosen {
            let size = self.blocks[&base].size;
            if let Err(e) = self.timed(Op::Unmap, |d| d.unmap(base, size)) {
                log::warn!("pausing {base:#x}+{size:#x}: unmapping failed ({e}); it stays");
                if let Some(s) = saved {
                    self.host.done(&mut self.drv, s);
                }
                continue;
            }
            let b = self.blocks.get_mut(&base).unwrap();
            let chunks = std::mem::take(&mut b.chunks);
            b.asleep = Some(BlockSleep {
                sizes: chunks.iter().map(|c| c.size).collect(),
                saved,
            });
            for c in chunks {
                match self.timed(Op::Release, |d| d.release(c.handle)) {
                    Ok(()) => self.stats.on_released(c.size),
                    // Unmapped and not the block's any more: given back at the next trim.
                    Err(_) => self.add_loose(c),
                }
            }
            self.stats.paused_bytes += size;
            out.bytes += size;
            out.offloaded += self.blocks[&base]
                .asleep
                .as_ref()
                .and_then(|s| s.saved.as_ref())
                .map_or(0, Saved::bytes);
        }
        Ok(out)
    }

    /// Resume the paused blocks `choose` takes: the bytes resumed. Out of memory: Err, the
    /// blocks made so far are resumed, the rest stay paused with their host copies (retry).
    pub fn resume(&mut self, choose: &dyn Fn(u32) -> bool) -> Result<u64, DrvError> {
        let bases: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.asleep.is_some() && choose(b.tag))
            .map(|(a, _)| *a)
            .collect();
        self.wake(&bases)
    }

    fn wake(&mut self, bases: &[u64]) -> Result<u64, DrvError> {
        let mut made: Vec<(u64, Vec<Chunk>)> = Vec::new();
        let mut failed = None;
        let mut queued = Ok(());
        // The smallest block that found no memory: larger ones are not tried (they would fail
        // too), smaller ones are (what fits is resumed).
        let mut too_big = u64::MAX;
        for &base in bases {
            let size = self.blocks[&base].size;
            if size >= too_big {
                continue;
            }
            match self.remake(base) {
                Ok(c) => made.push((base, c)),
                // Out of memory: this one stays paused with its host copy (retry).
                Err(e) if e.is_oom() => {
                    failed = Some(e);
                    too_big = size;
                    continue;
                }
                // This block alone cannot come back: it stays paused with its host copy and
                // the others go on.
                Err(e) => {
                    log::warn!("resuming paused allocation {base:#x} failed ({e}); it stays paused, the others resume");
                    failed.get_or_insert(e);
                    continue;
                }
            }
            // Its bytes go back while the next block is made.
            if let Some(s) = self.blocks[&base]
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
            for (base, chunks) in made {
                let size = self.blocks[&base].size;
                let _ = self.timed(Op::Unmap, |d| d.unmap(base, size));
                self.release_all(chunks);
            }
            return Err(e);
        }
        let mut bytes = 0;
        for (base, chunks) in made {
            let b = self.blocks.get_mut(&base).unwrap();
            b.chunks = chunks;
            bytes += b.size;
            let size = b.size;
            if let Some(s) = b.asleep.take().and_then(|s| s.saved) {
                self.host.done(&mut self.drv, s);
            }
            self.stats.paused_bytes -= size;
            self.stats.on_created(size);
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(bytes),
        }
    }

    /// New chunks for a paused block, mapped where it was with access for every reader.
    fn remake(&mut self, base: u64) -> Result<Vec<Chunk>, DrvError> {
        let sizes = self.blocks[&base]
            .asleep
            .as_ref()
            .expect("paused")
            .sizes
            .clone();
        let mut chunks = Vec::with_capacity(sizes.len());
        for size in sizes {
            match self.timed(Op::Create, |d| d.create(size)) {
                Ok(handle) => chunks.push(Chunk { handle, size }),
                Err(e) => {
                    self.release_all(chunks);
                    return Err(e);
                }
            }
        }
        if let Err(e) = self.map_at(base, &chunks) {
            self.release_all(chunks);
            return Err(e);
        }
        Ok(chunks)
    }

    /// Give back chunks made for a resume that did not complete; one the driver will not
    /// take back stays cached (counted as made, so the books hold: trimmed later).
    fn release_all(&mut self, chunks: Vec<Chunk>) {
        for c in chunks {
            if self.timed(Op::Release, |d| d.release(c.handle)).is_err() {
                self.stats.on_created(c.size);
                self.add_loose(c);
            }
        }
    }

    /// A call about to touch the live allocation containing `ptr` (an IPC export): it
    /// resumes first if paused. Err (out of memory): it stays paused, nothing lost.
    pub fn wake_for(&mut self, ptr: u64) -> Result<(), DrvError> {
        match self.find(ptr) {
            Some((base, _)) => self.wake_block(base),
            None => Ok(()),
        }
    }

    /// A call about to touch the block at `base` (an IPC export): it resumes first if paused.
    pub(super) fn wake_block(&mut self, base: u64) -> Result<(), DrvError> {
        match self.blocks.get(&base).is_some_and(|b| b.asleep.is_some()) {
            true => self.wake(&[base]).map(|_| ()),
            false => Ok(()),
        }
    }

    /// `cudaFree` of a paused block: its host copy and its reservation go.
    pub(super) fn free_asleep(&mut self, base: u64) -> u64 {
        let b: Block = self.blocks.remove(&base).expect("paused block");
        if let Some(s) = b.asleep.and_then(|s| s.saved) {
            self.host.done(&mut self.drv, s);
        }
        // Never both (a mirrored block is not paused; an export resumes first), but a
        // mirror must not outlive its allocation.
        if let Some(m) = b.mirror {
            self.drop_mirror(m);
        }
        self.stats.paused_bytes -= b.size;
        self.stats.on_free(b.user, b.size);
        self.free_va(base, b.size);
        b.user
    }

    /// Keep the host buffers of a pause for the next one (`EXPSEG_PAUSE_KEEP_HOST`).
    pub fn keep_host(&mut self, on: bool) {
        self.host.keep = on;
    }

    /// Free host buffers kept for the next pause: the bytes freed.
    pub fn release_host(&mut self) -> u64 {
        self.host.release_spare(&mut self.drv)
    }

    /// Bytes of live allocations paused.
    pub fn paused_bytes(&self) -> u64 {
        self.stats.paused_bytes
    }
}
