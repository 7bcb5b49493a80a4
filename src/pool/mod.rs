//! The expandable pool of one device.
//!
//! Physical memory comes from the driver in *chunks* (`cuMemCreate`, any multiple of the
//! granularity). Every user allocation is a *block*: its own virtual reservation with one or
//! more whole chunks mapped back to back, so one allocation's range can be released on its own.
//!
//! Freed blocks stay mapped in the *cache*, so an allocation of the same rounded size is
//! served with no driver call at all. Other sizes get fresh chunks while the driver has
//! memory; when it has none they are *stitched*: cached blocks are taken apart and their
//! chunks mapped into a fresh reservation, the remainder created new. Freed memory therefore
//! never strands: a request fails only when cached chunks plus driver-free memory cannot
//! cover it.
//!
//! The cache is bounded by `cache_max`; the least recently freed memory above it goes back to
//! the driver, where a colocated process may need it (the library's default bound is 0: every
//! free goes back before it returns). One exception where a bound is set: after an allocation
//! fails, frees are kept until the next allocation succeeds, so the release-and-retry sequence
//! of caching allocators (fail, free cached segments, retry) reuses those chunks without a
//! round trip to the driver.

mod export;
mod export_types;
mod sleep;
mod stats;

pub use crate::hostcopy::Paused;
pub use export_types::{Export, ExportError, ExportPolicy, Exported, MoveStep};
pub use stats::PoolStats;

use crate::gpu::{ChunkHandle, Driver, DrvError, Op};
use std::collections::BTreeMap;
use std::time::Instant;

/// Tuning of one pool.
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    /// Bytes of freed memory kept for reuse; above it the least recently freed goes back.
    pub cache_max: u64,
    /// Largest chunk created, 0 for no limit; larger allocations are built of several.
    pub max_chunk: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            cache_max: 1 << 30,
            max_chunk: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocError {
    /// Cached chunks plus driver-free memory do not cover the request.
    OutOfMemory,
    /// The driver failed in a way that is not lack of memory; nothing was allocated.
    Driver(DrvError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeError {
    /// Not the start of a live allocation of this pool.
    NotOwned,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chunk {
    handle: ChunkHandle,
    size: u64,
}

#[derive(Debug)]
struct Block {
    /// Reserved and mapped bytes: the sum of the chunk sizes.
    size: u64,
    /// Bytes the user asked for (≤ size); 0 while cached.
    user: u64,
    chunks: Vec<Chunk>,
    /// `Some(tick)` while cached: when it was freed.
    cached_at: Option<u64>,
    /// Standard memory mirroring this allocation for IPC, once a handle was asked for.
    mirror: Option<export_types::Mirror>,
    /// The tag set when it was allocated (`crate::sleep`; 0: none).
    tag: u32,
    /// Paused: its chunks are given back (`chunks` is empty), these sizes come back.
    asleep: Option<BlockSleep>,
    /// Its chunks were given to other processes (IPC tickets): never reused after the free.
    shared: bool,
    /// The chunks as POSIX descriptors, exported once when the block is first shared, so a
    /// consumer's request costs a `dup`, not a driver call.
    fds: Vec<std::os::fd::OwnedFd>,
}

/// What a paused block needs to come back (`sleep`): its bytes on the host (None:
/// discarded) and its chunks' sizes.
#[derive(Debug)]
struct BlockSleep {
    saved: Option<crate::hostcopy::Saved>,
    sizes: Vec<u64>,
}

/// Where a chunk chosen for a new allocation comes from.
#[derive(Clone, Copy, Debug)]
enum Source {
    Loose,
    Block(u64),
}

#[derive(Clone, Copy, Debug)]
struct Candidate {
    chunk: Chunk,
    from: Source,
}

pub struct Pool<D: Driver> {
    drv: D,
    cfg: PoolConfig,
    gran: u64,
    /// Every reservation the pool holds, live or cached, by base address.
    blocks: BTreeMap<u64, Block>,
    /// Cached blocks by (size, newest first) for the exact-size fast path.
    by_size: BTreeMap<(u64, u64), u64>,
    /// Cached blocks by age for trimming.
    by_age: BTreeMap<u64, u64>,
    /// Chunks that are mapped nowhere (left over from stitching).
    loose: Vec<Chunk>,
    /// Devices that get access to every mapping (the pool's own device first).
    readers: Vec<i32>,
    /// Reservations whose `cuMemAddressFree` failed: freed again on the next trim.
    stray_va: Vec<(u64, u64)>,
    /// Set by a failed allocation, cleared by the next successful one.
    retry_window: bool,
    /// Descriptors kept in `Block::fds`, all blocks together.
    cached_fds: usize,
    tick: u64,
    /// The tag new allocations get (`crate::sleep`), set by the caller.
    pub tag: u32,
    /// Host buffers of paused blocks.
    host: crate::hostcopy::HostCopies,
    stats: PoolStats,
}

impl<D: Driver> Pool<D> {
    pub fn new(drv: D, cfg: PoolConfig) -> Self {
        let gran = drv.granularity().max(1);
        let readers = vec![drv.device()];
        Pool {
            drv,
            cfg,
            gran,
            blocks: BTreeMap::new(),
            by_size: BTreeMap::new(),
            by_age: BTreeMap::new(),
            loose: Vec::new(),
            stray_va: Vec::new(),
            readers,
            retry_window: false,
            cached_fds: 0,
            tick: 0,
            tag: 0,
            host: Default::default(),
            stats: PoolStats::default(),
        }
    }

    pub fn driver(&self) -> &D {
        &self.drv
    }

    pub fn driver_mut(&mut self) -> &mut D {
        &mut self.drv
    }

    pub fn stats(&self) -> &PoolStats {
        &self.stats
    }

    /// Bytes freed by the application and kept by the pool: what it can allocate beyond the
    /// driver's free memory.
    pub fn cached_bytes(&self) -> u64 {
        self.stats.cached_bytes
    }

    /// The user size of the live allocation starting at `ptr`.
    pub fn live_size(&self, ptr: u64) -> Option<u64> {
        self.blocks
            .get(&ptr)
            .filter(|b| b.cached_at.is_none())
            .map(|b| b.user)
    }

    /// The live allocation containing `ptr`: its base and user size.
    pub fn find(&self, ptr: u64) -> Option<(u64, u64)> {
        let (base, b) = self.blocks.range(..=ptr).next_back()?;
        (b.cached_at.is_none() && ptr < base + b.user.max(1)).then_some((*base, b.user))
    }

    /// Whether `ptr` lies in any range the pool holds, live or cached.
    pub fn holds(&self, ptr: u64) -> bool {
        self.blocks
            .range(..=ptr)
            .next_back()
            .is_some_and(|(base, b)| ptr < base + b.size)
    }

    fn round(&self, size: u64) -> Option<u64> {
        size.checked_add(self.gran - 1)
            .map(|s| s / self.gran * self.gran)
    }

    fn timed<T>(
        &mut self,
        op: Op,
        f: impl FnOnce(&mut D) -> Result<T, DrvError>,
    ) -> Result<T, DrvError> {
        let t = Instant::now();
        let r = f(&mut self.drv);
        self.stats.count_driver(op, t.elapsed());
        if r.as_ref().is_err_and(|e| !e.is_oom()) {
            self.stats.driver_errors += 1;
        }
        r
    }

    /// Allocate `size` bytes (> 0). Returns the base address.
    pub fn alloc(&mut self, size: u64) -> Result<u64, AllocError> {
        let Some(need) = self.round(size) else {
            return self.fail_oom();
        };
        let base = match self.take_cached(need) {
            Some(base) => {
                self.stats.cache_hits += 1;
                base
            }
            None => match self.alloc_slow(need) {
                Ok(base) => base,
                Err(AllocError::OutOfMemory) => return self.fail_oom(),
                Err(e) => {
                    // A failed map leaves the chunks it was given loose (nothing lost); fresh
                    // ones among them go back now unless keeping is opted into.
                    self.trim(self.cfg.cache_max);
                    return Err(e);
                }
            },
        };
        let b = self
            .blocks
            .get_mut(&base)
            .expect("allocated block is registered");
        b.user = size;
        b.tag = self.tag;
        let held = b.size;
        self.stats.on_alloc(size, held);
        if self.retry_window {
            self.retry_window = false;
            self.trim(self.cfg.cache_max);
        }
        Ok(base)
    }

    fn fail_oom(&mut self) -> Result<u64, AllocError> {
        self.stats.ooms += 1;
        // Keeping frees for the retry is keeping memory: only where keeping is opted into (a
        // cache bound); without it every free goes back before it returns.
        self.retry_window = self.cfg.cache_max > 0;
        Err(AllocError::OutOfMemory)
    }

    /// The fast path: a cached block of exactly `need` bytes, most recently freed first.
    fn take_cached(&mut self, need: u64) -> Option<u64> {
        let (&key, &base) = self.by_size.range((need, 0)..=(need, u64::MAX)).next()?;
        self.uncache(u64::MAX - key.1, base);
        Some(base)
    }

    fn uncache(&mut self, age: u64, base: u64) {
        let b = self
            .blocks
            .get_mut(&base)
            .expect("cached block is registered");
        debug_assert_eq!(b.cached_at, Some(age));
        b.cached_at = None;
        let size = b.size;
        self.by_size.remove(&(size, u64::MAX - age));
        self.by_age.remove(&age);
        self.stats.cached_bytes -= size;
    }

    /// Every chunk that could serve a new allocation: loose ones first, then those of cached
    /// blocks, largest first.
    fn candidates(&self) -> Vec<Candidate> {
        let mut c: Vec<Candidate> = self
            .loose
            .iter()
            .map(|ch| Candidate {
                chunk: *ch,
                from: Source::Loose,
            })
            .collect();
        for &base in self.by_age.values() {
            for ch in &self.blocks[&base].chunks {
                c.push(Candidate {
                    chunk: *ch,
                    from: Source::Block(base),
                });
            }
        }
        // Stable: among equal sizes loose chunks (no unmap needed) stay first.
        c.sort_by_key(|c| std::cmp::Reverse(c.chunk.size));
        c
    }

    /// Greedy cover of `need` from `cands` (largest first), never taking a chunk larger than
    /// what is still missing. Returns the chosen indices and the bytes still missing.
    fn select(cands: &[Candidate], need: u64) -> (Vec<usize>, u64) {
        let mut chosen = Vec::new();
        let mut missing = need;
        for (i, c) in cands.iter().enumerate() {
            if missing == 0 {
                break;
            }
            if c.chunk.size <= missing {
                chosen.push(i);
                missing -= c.chunk.size;
            }
        }
        (chosen, missing)
    }

    fn alloc_slow(&mut self, need: u64) -> Result<u64, AllocError> {
        if !self.retry_window {
            // The driver first: fresh memory costs about what cudaMalloc costs, while taking
            // cached blocks apart (unmap, remap, set access) costs more (shim-tests/RESULTS.md,
            // "new size" rows). The cache serves exact sizes; the bound trims the rest.
            match self.create(need) {
                Ok(fresh) => return self.assemble(&[], fresh).map_err(AllocError::Driver),
                Err(AllocError::OutOfMemory) => {}
                Err(e) => return Err(e),
            }
        }
        // Short of memory, or retrying after a failure: stitch.
        let cands = self.candidates();
        let (mut chosen, fresh) = self.cover(&cands, need)?;
        self.stats.stitched += 1;
        chosen.sort_unstable();
        let picked: Vec<Candidate> = chosen.iter().map(|i| cands[*i]).collect();
        self.assemble(&picked, fresh).map_err(AllocError::Driver)
    }

    /// Cover `need` bytes with every cached chunk that fits, then one larger cached chunk if
    /// the sizes don't add up, and the driver only for the rest. So an allocation fails only
    /// if cached plus driver-free memory cannot cover it. Returns indices into `cands` and
    /// the fresh chunks.
    fn cover(
        &mut self,
        cands: &[Candidate],
        need: u64,
    ) -> Result<(Vec<usize>, Vec<Chunk>), AllocError> {
        let (mut all, missing) = Self::select(cands, need);
        if missing == 0 {
            return Ok((all, Vec::new()));
        }
        let spare = (0..cands.len())
            .filter(|i| !all.contains(i) && cands[*i].chunk.size >= missing)
            .min_by_key(|i| cands[*i].chunk.size);
        if let Some(i) = spare {
            all.push(i);
            self.stats.over_commits += 1;
            return Ok((all, Vec::new()));
        }
        let fresh = self.create(missing)?;
        Ok((all, fresh))
    }

    /// Create `size` bytes as chunks of at most `max_chunk`. All or nothing: if one chunk
    /// cannot be created, those already created go straight back to the driver.
    fn create(&mut self, size: u64) -> Result<Vec<Chunk>, AllocError> {
        let max = match self.cfg.max_chunk {
            0 => u64::MAX,
            m => (m / self.gran * self.gran).max(self.gran),
        };
        if size > max {
            // Many chunks (`EXPSEG_MAX_CHUNK`): a request beyond the device's free memory is
            // refused at once, as the driver refuses one chunk, instead of taking the free
            // memory a chunk at a time under the lock and giving it back.
            if let Ok(free) = self.drv.free_memory() {
                if size > free {
                    return Err(AllocError::OutOfMemory);
                }
            }
        }
        let mut made = Vec::new();
        let mut left = size;
        while left > 0 {
            let n = left.min(max);
            match self.timed(Op::Create, |d| d.create(n)) {
                Ok(handle) => made.push(Chunk { handle, size: n }),
                Err(e) => {
                    for c in made {
                        if self.timed(Op::Release, |d| d.release(c.handle)).is_err() {
                            // Keep what cannot be released: cached, trimmed later.
                            self.stats.on_created(c.size);
                            self.add_loose(c);
                        }
                    }
                    return Err(if e.is_oom() {
                        AllocError::OutOfMemory
                    } else {
                        AllocError::Driver(e)
                    });
                }
            }
            left -= n;
        }
        made.iter().for_each(|c| self.stats.on_created(c.size));
        Ok(made)
    }

    fn add_loose(&mut self, ch: Chunk) {
        self.loose.push(ch);
        self.stats.cached_bytes += ch.size;
    }

    /// Take the chosen cached chunks (and fresh ones) out of where they are and map them back
    /// to back in a new reservation. On error every chunk involved, fresh ones too, is
    /// loose: cached, nothing lost.
    fn assemble(&mut self, picked: &[Candidate], fresh: Vec<Chunk>) -> Result<u64, DrvError> {
        // 1. Take apart the cached blocks the chunks come from; their other chunks go loose.
        let mut blocks: Vec<u64> = picked
            .iter()
            .filter_map(|c| match c.from {
                Source::Block(b) => Some(b),
                Source::Loose => None,
            })
            .collect();
        blocks.sort_unstable();
        blocks.dedup();
        for base in blocks {
            if let Err(e) = self.dismantle(base) {
                fresh.into_iter().for_each(|f| self.add_loose(f));
                return Err(e);
            }
        }
        // 2. Pull the chosen chunks out of the loose list (by handle: indices moved above).
        let mut chunks: Vec<Chunk> = Vec::with_capacity(picked.len() + 1);
        for c in picked {
            let i = self
                .loose
                .iter()
                .position(|l| l.handle == c.chunk.handle)
                .expect("chosen chunk is loose after dismantling");
            chunks.push(self.loose.swap_remove(i));
            self.stats.cached_bytes -= c.chunk.size;
        }
        chunks.extend(fresh);
        let total: u64 = chunks.iter().map(|c| c.size).sum();
        match self.map_new(&chunks, total) {
            Ok(base) => {
                self.blocks.insert(
                    base,
                    Block {
                        size: total,
                        user: 0,
                        chunks,
                        cached_at: None,
                        mirror: None,
                        tag: 0,
                        asleep: None,
                        shared: false,
                        fds: Vec::new(),
                    },
                );
                Ok(base)
            }
            Err(e) => {
                for c in chunks {
                    self.add_loose(c);
                }
                Err(e)
            }
        }
    }

    /// Reserve `total` bytes and map `chunks` back to back with access for every reader.
    /// On error nothing stays mapped or reserved.
    fn map_new(&mut self, chunks: &[Chunk], total: u64) -> Result<u64, DrvError> {
        let base = self.timed(Op::Reserve, |d| d.reserve(total))?;
        if let Err(e) = self.map_at(base, chunks) {
            self.free_va(base, total);
            return Err(e);
        }
        Ok(base)
    }

    /// Map `chunks` back to back at `va` (inside a reservation of ours) with access for every
    /// reader. On error nothing stays mapped; the reservation is the caller's.
    fn map_at(&mut self, va: u64, chunks: &[Chunk]) -> Result<(), DrvError> {
        let total: u64 = chunks.iter().map(|c| c.size).sum();
        let mut off = 0;
        let mut result = Ok(());
        for c in chunks {
            if let Err(e) = self.timed(Op::Map, |d| d.map(va + off, c.size, c.handle)) {
                result = Err(e);
                break;
            }
            off += c.size;
        }
        if result.is_ok() {
            let readers = self.readers.clone();
            result = self.timed(Op::SetAccess, |d| d.set_access(va, total, &readers, &[]));
        }
        if result.is_err() {
            // Roll back chunk by chunk: a partial range cannot be unmapped in one call.
            let mut at = 0;
            for c in chunks {
                if at >= off {
                    break;
                }
                let _ = self.timed(Op::Unmap, |d| d.unmap(va + at, c.size));
                at += c.size;
            }
        }
        result
    }

    /// Unmap a cached block and free its reservation; its chunks become loose.
    fn dismantle(&mut self, base: u64) -> Result<(), DrvError> {
        let size = self.blocks[&base].size;
        self.timed(Op::Unmap, |d| d.unmap(base, size))?;
        let age = self.blocks[&base]
            .cached_at
            .expect("only cached blocks are taken apart");
        self.uncache(age, base);
        let b = self.blocks.remove(&base).expect("block exists");
        self.free_va(base, size);
        b.chunks.into_iter().for_each(|c| self.add_loose(c));
        Ok(())
    }

    /// Free a reservation with nothing mapped in it; on failure keep it to try again later.
    fn free_va(&mut self, va: u64, size: u64) {
        if let Err(e) = self.timed(Op::FreeVa, |d| d.free_va(va, size)) {
            log::warn!("cuMemAddressFree({va:#x}, {size}) failed: {e}; will retry");
            self.stray_va.push((va, size));
        }
    }

    /// Free the allocation starting at `ptr`. The caller has made sure no earlier GPU work
    /// still uses it.
    pub fn free(&mut self, ptr: u64) -> Result<u64, FreeError> {
        let b = match self.blocks.get_mut(&ptr) {
            Some(b) if b.cached_at.is_none() => b,
            _ => return Err(FreeError::NotOwned),
        };
        if b.shared {
            return Ok(self.free_shared(ptr));
        }
        if b.asleep.is_some() {
            return Ok(self.free_asleep(ptr));
        }
        self.tick += 1;
        let (user, size) = (b.user, b.size);
        let mirror = b.mirror.take();
        b.user = 0;
        b.cached_at = Some(self.tick);
        self.by_size.insert((size, u64::MAX - self.tick), ptr);
        self.by_age.insert(self.tick, ptr);
        self.stats.cached_bytes += size;
        self.stats.on_free(user, size);
        if let Some(m) = mirror {
            self.drop_mirror(m);
        }
        if !self.retry_window {
            self.trim(self.cfg.cache_max);
        }
        Ok(user)
    }

    /// `cudaDeviceReset`: the reset destroys every runtime allocation of the device, so every
    /// allocation of the pool goes (shared ones, paused ones and mirrors included) and every
    /// byte goes back to the driver, reservations too. Returns the bases freed. The caller
    /// has waited for the device.
    pub fn reset(&mut self) -> Vec<u64> {
        let live: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.cached_at.is_none())
            .map(|(a, _)| *a)
            .collect();
        for base in &live {
            let _ = self.free(*base);
        }
        self.retry_window = false;
        self.trim(0);
        live
    }

    /// Give every cached byte back to the driver now (`expseg.trim()`, another expseg process
    /// that found no memory): the bytes given back. An open retry window stays open (the
    /// program's own retry after a failure is what it keeps frees for).
    pub fn give_back_cache(&mut self) -> u64 {
        let before = self.cached_bytes();
        self.trim(0);
        before.saturating_sub(self.cached_bytes())
    }

    /// Give cached memory back to the driver until at most `limit` bytes are cached: loose
    /// chunks first, then the least recently freed blocks.
    pub fn trim(&mut self, limit: u64) {
        for (va, size) in std::mem::take(&mut self.stray_va) {
            self.free_va(va, size);
        }
        while self.stats.cached_bytes > limit {
            if let Some(c) = self.loose.pop() {
                if self.timed(Op::Release, |d| d.release(c.handle)).is_err() {
                    self.loose.push(c);
                    return;
                }
                self.stats.cached_bytes -= c.size;
                self.stats.on_released(c.size);
                continue;
            }
            let Some((_, &base)) = self.by_age.iter().next() else {
                return;
            };
            if self.dismantle(base).is_err() {
                return;
            }
        }
    }

    /// The other devices given access to this pool's memory: their kernels may be reading or
    /// writing it, so a move or a pause waits for them too (`synchronize_peer`).
    pub(super) fn peer_readers(&self) -> Vec<i32> {
        let me = self.drv.device();
        self.readers.iter().copied().filter(|d| *d != me).collect()
    }

    /// Give `dev` read-write access to every current and future mapping of this pool.
    pub fn grant(&mut self, dev: i32) -> Result<(), DrvError> {
        if !self.readers.contains(&dev) {
            self.readers.push(dev);
        }
        self.apply_access(&[])
    }

    /// Take access from `dev` on every current mapping; future ones no longer grant it.
    pub fn revoke(&mut self, dev: i32) -> Result<(), DrvError> {
        if dev == self.drv.device() {
            return Ok(());
        }
        self.readers.retain(|d| *d != dev);
        self.apply_access(&[dev])
    }

    fn apply_access(&mut self, revoked: &[i32]) -> Result<(), DrvError> {
        let readers = self.readers.clone();
        // Paused blocks get the readers of the moment when they are mapped again.
        let ranges: Vec<(u64, u64)> = self
            .blocks
            .iter()
            .filter(|(_, blk)| blk.asleep.is_none())
            .map(|(b, blk)| (*b, blk.size))
            .collect();
        let mut first_err = Ok(());
        for (base, size) in ranges {
            let r = self.timed(Op::SetAccess, |d| {
                d.set_access(base, size, &readers, revoked)
            });
            if first_err.is_ok() {
                first_err = r;
            }
        }
        first_err
    }

    /// Check the pool's books: every invariant the rest of the code relies on.
    pub fn validate(&self) -> Result<(), String> {
        let mut live_user = 0;
        let mut live = 0;
        let mut cached = self.loose.iter().map(|c| c.size).sum::<u64>();
        let mut end = 0;
        let mut handles: Vec<ChunkHandle> = self.loose.iter().map(|c| c.handle).collect();
        let mut mirrors = 0;
        let mut paused = 0;
        for (base, b) in &self.blocks {
            handles.extend(b.chunks.iter().map(|c| c.handle));
            mirrors += b.mirror.map_or(0, |m| m.size);
            if b.mirror.is_some() && b.cached_at.is_some() {
                return Err(format!("cached block {base:#x} kept its mirror"));
            }
            if *base < end {
                return Err(format!("block {base:#x} overlaps the previous one"));
            }
            end = base + b.size;
            if b.asleep.is_some() {
                if !b.chunks.is_empty() || b.cached_at.is_some() {
                    return Err(format!("paused block {base:#x} holds chunks or is cached"));
                }
                paused += b.size;
            } else if b.chunks.iter().map(|c| c.size).sum::<u64>() != b.size {
                return Err(format!("block {base:#x}: chunk sizes do not add up"));
            }
            match b.cached_at {
                Some(age) => {
                    cached += b.size;
                    if self.by_age.get(&age) != Some(base)
                        || self.by_size.get(&(b.size, u64::MAX - age)) != Some(base)
                    {
                        return Err(format!("cached block {base:#x} missing from an index"));
                    }
                }
                None => {
                    if b.user == 0 || b.user > b.size {
                        return Err(format!(
                            "live block {base:#x}: user {} of {}",
                            b.user, b.size
                        ));
                    }
                    live_user += b.user;
                    live += b.size;
                }
            }
        }
        let n = handles.len();
        handles.sort_unstable();
        handles.dedup();
        if handles.len() != n {
            return Err("a chunk belongs to two places".into());
        }
        if mirrors != self.stats.mirror_bytes {
            return Err(format!(
                "mirror bytes {} counted as {}",
                mirrors, self.stats.mirror_bytes
            ));
        }
        if self.by_age.len() != self.by_size.len()
            || self.by_age.len()
                != self
                    .blocks
                    .values()
                    .filter(|b| b.cached_at.is_some())
                    .count()
        {
            return Err("cache indexes disagree with the blocks".into());
        }
        let s = &self.stats;
        if s.live_user_bytes != live_user || s.live_bytes != live || s.cached_bytes != cached {
            return Err(format!(
                "accounting: live_user {}/{live_user} live {}/{live} cached {}/{cached}",
                s.live_user_bytes, s.live_bytes, s.cached_bytes
            ));
        }
        if s.paused_bytes != paused {
            return Err(format!(
                "paused bytes {} counted as {paused}",
                s.paused_bytes
            ));
        }
        if s.held_bytes() != s.created_bytes - s.released_bytes {
            return Err("held bytes differ from created minus released".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod export_tests;
#[cfg(test)]
mod sleep_tests;
#[cfg(test)]
mod tests;
