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

#[cfg(test)]
mod tests;

use crate::gpu::{ChunkHandle, Driver, DrvError, DrvResult, IpcHandle, Op, PageProps};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::time::Instant;

/// The driver, with calls and nanoseconds counted per operation (`Op::ALL` order; the last
/// slot is `cuMemGetInfo`).
pub struct Timed<D> {
    inner: D,
    pub calls: [(u64, u64); Op::ALL.len() + 1],
}

impl<D> Timed<D> {
    fn count<T>(&mut self, slot: usize, f: impl FnOnce(&mut D) -> T) -> T {
        let t = Instant::now();
        let r = f(&mut self.inner);
        let c = &mut self.calls[slot];
        c.0 += 1;
        c.1 += t.elapsed().as_nanos() as u64;
        r
    }
}

const MEMINFO: usize = Op::ALL.len();

impl<D: Driver> Driver for Timed<D> {
    fn device(&self) -> i32 {
        self.inner.device()
    }
    fn granularity(&self) -> u64 {
        self.inner.granularity()
    }
    fn create(&mut self, size: u64) -> DrvResult<ChunkHandle> {
        self.count(Op::Create.index(), |d| d.create(size))
    }
    fn release(&mut self, h: ChunkHandle) -> DrvResult<()> {
        self.count(Op::Release.index(), |d| d.release(h))
    }
    fn reserve(&mut self, size: u64) -> DrvResult<u64> {
        self.count(Op::Reserve.index(), |d| d.reserve(size))
    }
    fn free_va(&mut self, va: u64, size: u64) -> DrvResult<()> {
        self.count(Op::FreeVa.index(), |d| d.free_va(va, size))
    }
    fn map(&mut self, va: u64, size: u64, h: ChunkHandle) -> DrvResult<()> {
        self.count(Op::Map.index(), |d| d.map(va, size, h))
    }
    fn unmap(&mut self, va: u64, size: u64) -> DrvResult<()> {
        self.count(Op::Unmap.index(), |d| d.unmap(va, size))
    }
    fn set_access(&mut self, va: u64, size: u64, r: &[i32], v: &[i32]) -> DrvResult<()> {
        self.count(Op::SetAccess.index(), |d| d.set_access(va, size, r, v))
    }
    fn reserve_at(&mut self, va: u64, size: u64) -> DrvResult<u64> {
        self.count(Op::Reserve.index(), |d| d.reserve_at(va, size))
    }
    fn legacy_alloc(&mut self, size: u64) -> DrvResult<u64> {
        self.count(Op::LegacyAlloc.index(), |d| d.legacy_alloc(size))
    }
    fn legacy_free(&mut self, ptr: u64) -> DrvResult<()> {
        self.count(Op::LegacyFree.index(), |d| d.legacy_free(ptr))
    }
    fn copy(&mut self, dst: u64, src: u64, size: u64) -> DrvResult<()> {
        self.count(Op::Copy.index(), |d| d.copy(dst, src, size))
    }
    fn legacy_handle(&mut self, ptr: u64) -> DrvResult<IpcHandle> {
        self.count(Op::IpcHandle.index(), |d| d.legacy_handle(ptr))
    }
    fn synchronize(&mut self) -> DrvResult<()> {
        self.count(Op::Sync.index(), |d| d.synchronize())
    }
    fn synchronize_peer(&mut self, dev: i32) -> DrvResult<()> {
        self.count(Op::Sync.index(), |d| d.synchronize_peer(dev))
    }
    fn export_fd(&mut self, h: ChunkHandle) -> DrvResult<OwnedFd> {
        self.inner.export_fd(h)
    }
    fn create_as(&mut self, size: u64, props: PageProps) -> DrvResult<ChunkHandle> {
        self.count(Op::Create.index(), |d| d.create_as(size, props))
    }
    fn free_memory(&mut self) -> DrvResult<u64> {
        self.count(MEMINFO, |d| d.free_memory())
    }
    fn set_access_flags(&mut self, va: u64, size: u64, descs: &[(i32, u32)]) -> DrvResult<()> {
        self.count(Op::SetAccess.index(), |d| {
            d.set_access_flags(va, size, descs)
        })
    }
    fn save(&mut self, src: u64, size: u64) -> DrvResult<Vec<u8>> {
        self.count(Op::Copy.index(), |d| d.save(src, size))
    }
    fn load(&mut self, dst: u64, data: &[u8]) -> DrvResult<()> {
        self.count(Op::Copy.index(), |d| d.load(dst, data))
    }
}

/// `CUDA_ERROR_INVALID_VALUE`.
pub const INVALID: DrvError = DrvError(1);
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const NOT_SUPPORTED: DrvError = DrvError(801);

/// Virtual handles carry this tag in their top 16 bits (the driver's own handles are
/// addresses of its objects, far below it).
const TAG: u64 = 0xE5E5 << 48;

pub fn is_virtual(h: u64) -> bool {
    h & (0xFFFF << 48) == TAG
}

/// Virtual handles are numbered process-wide: each device has its coalescer, and a handle
/// must name one page of one of them.
static NEXT_VH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Tuning.
#[derive(Clone, Copy, Debug)]
pub struct CoalesceConfig {
    /// Largest physical handle a batch gets; longer runs get several.
    pub max_handle: u64,
    /// Stranded bytes tolerated before compaction.
    pub strand_max: u64,
    /// Free memory kept in hand when pages are admitted without creating them.
    pub margin: u64,
    /// Keep fully released handles for reuse while the program keeps allocating; 0: release
    /// at once. The caller releases them after this much quiet ([`Coalescer::idle_for`]).
    pub release_delay: std::time::Duration,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        CoalesceConfig {
            max_handle: 1 << 30,
            strand_max: 0,
            margin: 1 << 30,
            release_delay: std::time::Duration::ZERO,
        }
    }
}

/// Counters for the report.
#[derive(Clone, Debug, Default)]
pub struct CoalesceStats {
    pub pages_created: u64,
    pub phys_created: u64,
    pub phys_released: u64,
    pub exact_creates: u64,
    pub compactions: u64,
    pub compacted_bytes: u64,
    pub host_copies: u64,
    pub compaction_failures: u64,
    pub access_fallbacks: u64,
    pub exports_split: u64,
    pub peak_stranded: u64,
    /// Bytes of pages served from released handles kept for reuse.
    pub reused_bytes: u64,
    /// Kept handles that went back to the driver (quiet, mem_get_info, or memory needed).
    pub kept_released: u64,
    /// Bytes of pages served by a kept handle still mapped where the pages were mapped: no
    /// driver call at all.
    pub reused_in_place: u64,
    /// `cuMemSetAccess` calls answered without the driver: the mappings already had it.
    pub access_skipped: u64,
    /// Batches admitted without asking the driver for its free memory (kept handles cover them).
    pub meminfo_skipped: u64,
}

#[derive(Debug)]
struct Page {
    size: u64,
    props: PageProps,
    /// Program references: 1 from create, +1 per retain; released at 0.
    refs: u32,
    /// `(phys, offset)` once the page has memory.
    slot: Option<(u64, u64)>,
    /// Where the program mapped it.
    va: Option<u64>,
    /// Handed out as its own handle (exported): never coalesced again.
    single: bool,
}

#[derive(Debug)]
struct Phys {
    handle: ChunkHandle,
    size: u64,
    /// Where the handle is mapped, whole.
    base: Option<u64>,
    /// offset -> page
    slots: BTreeMap<u64, u64>,
    /// Access the program set on any page of it: (device, flags).
    access: Vec<(i32, u32)>,
    /// Access set on the mapping at `base` since it was mapped (empty when unmapped).
    granted: Vec<(i32, u32)>,
}

/// A fully released handle kept for reuse. `base`: still mapped there (*parked*), with
/// `granted` access, so pages mapped at the same place again need no driver call.
#[derive(Debug, Clone)]
struct Kept {
    handle: ChunkHandle,
    base: Option<u64>,
    granted: Vec<(i32, u32)>,
}

/// Page properties as an ordered key.
type KeyProps = (bool, bool);

/// A kept handle's key: (properties, size, sequence).
type KeptKey = (KeyProps, u64, u64);

fn key(p: PageProps) -> KeyProps {
    (p.shareable, p.rdma)
}

/// The end of `[va, va+size)`, saturated: a range that wraps (the driver refuses it) must not
/// make the books panic.
fn end(va: u64, size: u64) -> u64 {
    va.saturating_add(size)
}

/// A run of a phys's live pages that moves to one new handle.
#[derive(Debug, Clone)]
struct Group {
    off: u64,
    len: u64,
    /// Where the new handle is mapped (the pages' address), or none for unmapped pages.
    target: Option<u64>,
}

/// What a compaction holds while it is not yet committed.
#[derive(Default)]
struct Work {
    /// New handles, and whether each was created (false: no room, host path).
    new: Vec<(ChunkHandle, bool)>,
    /// Temporary mappings: (address, size) of a reservation with one handle mapped whole.
    tmp: Vec<(u64, u64)>,
    /// The old handle's temporary mapping, when it was not mapped.
    src_tmp: Option<(u64, u64)>,
    host: Vec<Option<Vec<u8>>>,
}

pub struct Coalescer<D: Driver> {
    drv: Timed<D>,
    cfg: CoalesceConfig,
    next_phys: u64,
    pages: HashMap<u64, Page>,
    phys: BTreeMap<u64, Phys>,
    /// program mapping address -> page
    maps: BTreeMap<u64, u64>,
    /// phys base address -> phys (mapped phys only)
    bases: BTreeMap<u64, u64>,
    /// Reservations the program made through expseg: start -> size.
    reservations: BTreeMap<u64, u64>,
    pending_bytes: u64,
    free_est: u64,
    /// Phys with dead bytes.
    dirty: BTreeSet<u64>,
    /// Temporary mappings whose teardown failed, retried at the next settle.
    stray: Vec<(u64, u64)>,
    /// Handles the driver would not take back (cuMemRelease failed): (handle, size), still
    /// counted as held and retried at the next settle.
    unreleased: Vec<(ChunkHandle, u64)>,
    /// Fully released handles kept for reuse: (properties, size, sequence) -> handle.
    kept: BTreeMap<KeptKey, Kept>,
    /// Kept handles still mapped: base -> key.
    parked: BTreeMap<u64, KeptKey>,
    kept_bytes: u64,
    /// Whether `free_est` was read from the driver in this batch.
    free_known: bool,
    kept_seq: u64,
    /// The program's last call.
    last_call: Instant,
    stats: CoalesceStats,
}

impl<D: Driver> Coalescer<D> {
    pub fn new(drv: D, cfg: CoalesceConfig) -> Self {
        Coalescer {
            drv: Timed {
                inner: drv,
                calls: Default::default(),
            },
            cfg,
            next_phys: 1,
            pages: HashMap::new(),
            phys: BTreeMap::new(),
            maps: BTreeMap::new(),
            bases: BTreeMap::new(),
            reservations: BTreeMap::new(),
            pending_bytes: 0,
            free_est: 0,
            dirty: BTreeSet::new(),
            stray: Vec::new(),
            unreleased: Vec::new(),
            kept: BTreeMap::new(),
            parked: BTreeMap::new(),
            free_known: false,
            kept_bytes: 0,
            kept_seq: 0,
            last_call: Instant::now(),
            stats: CoalesceStats::default(),
        }
    }

    pub fn driver(&self) -> &D {
        &self.drv.inner
    }

    pub fn driver_mut(&mut self) -> &mut D {
        &mut self.drv.inner
    }

    /// Driver calls and nanoseconds per operation (`Op::ALL` order, then `cuMemGetInfo`).
    pub fn driver_calls(&self) -> &[(u64, u64)] {
        &self.drv.calls
    }

    pub fn stats(&self) -> &CoalesceStats {
        &self.stats
    }

    pub fn owns(&self, vh: u64) -> bool {
        self.pages.contains_key(&vh)
    }

    /// Pages the program holds, and physical handles behind them.
    pub fn counts(&self) -> (usize, usize) {
        (self.pages.len(), self.phys.len())
    }

    /// Bytes of released handles kept for reuse.
    pub fn kept_bytes(&self) -> u64 {
        self.kept_bytes
    }

    /// How long the program has made no call.
    pub fn idle_for(&self) -> std::time::Duration {
        self.last_call.elapsed()
    }

    /// Give every kept handle back to the driver (a parked one is unmapped first; one that
    /// will not unmap stays kept and is tried again next time).
    pub fn release_kept(&mut self) {
        let keys: Vec<KeptKey> = self.kept.keys().copied().collect();
        for k in keys {
            self.give_back(k);
        }
    }

    fn parking(&self) -> bool {
        !self.cfg.release_delay.is_zero()
    }

    /// Take a kept handle out of the books, unmapped (a parked one is unmapped here). None if
    /// it is parked and will not unmap: it stays kept.
    fn unkeep(&mut self, k: KeptKey) -> Option<ChunkHandle> {
        if let Some(b) = self.kept.get(&k)?.base {
            if let Err(e) = self.unpark(b) {
                log::warn!("unmapping a kept handle failed ({e})");
                return None;
            }
        }
        let kh = self.kept.remove(&k)?;
        self.kept_bytes -= k.1;
        Some(kh.handle)
    }

    /// A kept handle goes back to the driver; false if it is parked and would not unmap.
    fn give_back(&mut self, k: KeptKey) -> bool {
        let Some(h) = self.unkeep(k) else {
            return false;
        };
        self.release_or_hold(h, k.1);
        self.stats.kept_released += 1;
        self.stats.phys_released += 1;
        true
    }

    /// Give a handle back to the driver; one it will not take stays held (and counted) and
    /// is tried again at the next settle.
    fn release_or_hold(&mut self, h: ChunkHandle, size: u64) {
        if let Err(e) = self.drv.release(h) {
            self.hold(h, size, e);
        }
    }

    /// A handle the driver would not take back (`e`): held, counted, tried again later.
    fn hold(&mut self, h: ChunkHandle, size: u64, e: DrvError) {
        log::warn!("releasing a handle failed ({e}); tried again later");
        self.unreleased.push((h, size));
    }

    /// A parked handle leaves its address (something else is mapped there) and stays kept.
    fn unpark(&mut self, base: u64) -> DrvResult<()> {
        let Some(k) = self.parked.get(&base).copied() else {
            return Ok(());
        };
        log::debug!(
            "device {}: kept handle {:#x} unmapped from {base:#x}+{:#x}",
            self.drv.device(),
            self.kept[&k].handle,
            k.1
        );
        self.drv.unmap(base, k.1)?;
        self.parked.remove(&base);
        let kh = self.kept.get_mut(&k).unwrap();
        kh.base = None;
        kh.granted.clear();
        Ok(())
    }

    /// Whether a parked handle overlaps `[va, va+size)`.
    pub fn parked_in_range(&self, va: u64, size: u64) -> bool {
        !self.parked_in(va, size).is_empty()
    }

    /// Parked handles overlapping `[va, va+size)`: base addresses.
    fn parked_in(&self, va: u64, size: u64) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .parked
            .range(..end(va, size))
            .rev()
            .take_while(|(b, k)| **b + k.1 > va)
            .map(|(b, _)| *b)
            .collect();
        out.reverse();
        out
    }

    /// A handle of exactly the pages' memory that is no longer needed: kept for reuse while
    /// the program keeps allocating, else released.
    fn dispose(&mut self, handle: ChunkHandle, size: u64, props: PageProps) -> DrvResult<()> {
        if !self.parking() {
            self.stats.phys_released += 1;
            return self.drv.release(handle);
        }
        self.kept_seq += 1;
        self.kept.insert(
            (key(props), size, self.kept_seq),
            Kept {
                handle,
                base: None,
                granted: Vec::new(),
            },
        );
        self.kept_bytes += size;
        Ok(())
    }

    /// A phys that is still mapped and has no page left: kept where it is (parked). Pages
    /// mapped at the same place again take it back with no driver call at all.
    fn park(&mut self, pid: u64, props: PageProps) {
        let ph = self.phys.remove(&pid).unwrap();
        let b = ph.base.expect("parked handles are mapped");
        self.bases.remove(&b);
        self.dirty.remove(&pid);
        self.kept_seq += 1;
        let k = (key(props), ph.size, self.kept_seq);
        self.kept.insert(
            k,
            Kept {
                handle: ph.handle,
                base: Some(b),
                granted: ph.granted,
            },
        );
        self.parked.insert(b, k);
        self.kept_bytes += ph.size;
    }

    /// Create `size` bytes. Kept handles that could not serve the pages make room first (the
    /// best fit, else the largest), so the memory held never exceeds what the program's pages
    /// and the kept handles held before; on out-of-memory all kept handles go back and the
    /// driver is asked again.
    fn create_fresh(&mut self, size: u64, props: PageProps) -> DrvResult<ChunkHandle> {
        let mut freed = 0;
        let mut stuck: Vec<KeptKey> = Vec::new();
        while freed < size && self.kept_bytes > 0 {
            let free = self.kept.keys().filter(|k| !stuck.contains(k));
            let fit = free
                .clone()
                .filter(|(_, s, _)| *s >= size - freed)
                .min_by_key(|(_, s, _)| *s)
                .or_else(|| free.max_by_key(|(_, s, _)| *s))
                .copied();
            let Some(k) = fit else { break };
            if self.give_back(k) {
                freed += k.1;
            } else {
                stuck.push(k);
            }
        }
        self.create_room(size, props)
    }

    /// Create; on out-of-memory every kept handle goes back and the driver is asked again (a
    /// compaction's move then takes the device path where it can).
    fn create_room(&mut self, size: u64, props: PageProps) -> DrvResult<ChunkHandle> {
        match self.drv.create_as(size, props) {
            Err(e) if e.is_oom() && self.kept_bytes > 0 => {
                self.release_kept();
                self.drv.create_as(size, props)
            }
            r => r,
        }
    }

    /// The largest kept handle of these properties of at most `max` bytes, a multiple of
    /// `unit` (an unmapped one before a parked one of the same size, which must unmap).
    fn take_kept(&mut self, props: PageProps, max: u64, unit: u64) -> Option<(ChunkHandle, u64)> {
        let k = key(props);
        let size = self
            .kept
            .range((k, 0, 0)..=(k, max, u64::MAX))
            .rev()
            .find(|((_, s, _), _)| s.is_multiple_of(unit))
            .map(|((_, s, _), _)| *s)?;
        let mut same: Vec<(bool, KeptKey)> = self
            .kept
            .range((k, size, 0)..=(k, size, u64::MAX))
            .map(|(key, kh)| (kh.base.is_some(), *key))
            .collect();
        same.sort_unstable();
        for (_, key) in same {
            if let Some(h) = self.unkeep(key) {
                self.stats.reused_bytes += size;
                return Some((h, size));
            }
        }
        None
    }

    /// Dead bytes still held in partly released handles.
    pub fn stranded(&self) -> u64 {
        self.dirty.iter().map(|p| self.dead(*p)).sum()
    }

    /// Physical bytes held: handles behind pages and handles kept for reuse.
    pub fn physical_bytes(&self) -> u64 {
        self.phys.values().map(|p| p.size).sum::<u64>() + self.kept_bytes + self.unreleased_bytes()
    }

    /// Bytes of handles the driver would not take back yet.
    fn unreleased_bytes(&self) -> u64 {
        self.unreleased.iter().map(|(_, s)| s).sum()
    }

    fn dead(&self, pid: u64) -> u64 {
        let p = &self.phys[&pid];
        let live: u64 = p.slots.values().map(|vh| self.pages[vh].size).sum();
        p.size - live
    }

    /// Whether the program has a page of ours mapped in `[va, va+size)`.
    /// (or a handle of ours is parked there: the driver's mapping is ours, not the program's).
    pub fn maps_in(&self, va: u64, size: u64) -> bool {
        self.maps.range(va..end(va, size)).next().is_some() || self.ours_in_range(va, size)
    }

    /// Whether a handle of ours is mapped in `[va, va+size)`: a parked one, or one behind
    /// pages (some perhaps already unmapped by the program, not yet released).
    fn ours_in_range(&self, va: u64, size: u64) -> bool {
        self.parked_in_range(va, size) || !self.phys_in(va, size).is_empty()
    }

    /// Mapped phys overlapping `[va, va+size)`, by address (mappings never overlap).
    fn phys_in(&self, va: u64, size: u64) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .bases
            .range(..end(va, size))
            .rev()
            .take_while(|(b, p)| **b + self.phys[p].size > va)
            .map(|(_, p)| *p)
            .collect();
        out.reverse();
        out
    }

    /// A program call on `[va, va+size)` where it has no page of ours: Ok(false), pass it
    /// through; or, where a handle of ours is mapped (parked, or behind pages the program
    /// unmapped), the program has nothing mapped there (the driver's answer without expseg,
    /// and the driver must not touch our mapping).
    fn none_of_the_programs(&self, va: u64, size: u64) -> DrvResult<bool> {
        match self.ours_in_range(va, size) {
            false => Ok(false),
            true => Err(INVALID),
        }
    }

    /// Whether this device has anything of ours: pages, handles, kept handles, or temporary
    /// mappings to take down. A coalescer that holds nothing has no driver call to make.
    pub fn holds_anything(&self) -> bool {
        !self.pages.is_empty()
            || !self.phys.is_empty()
            || self.kept_bytes > 0
            || !self.stray.is_empty()
            || !self.unreleased.is_empty()
    }

    // ---- the program's calls -------------------------------------------------------------

    /// `cuMemAddressReserve` succeeded: remember the range (runs never cross reservations).
    pub fn reserved(&mut self, va: u64, size: u64) {
        self.reservations.insert(va, size);
    }

    /// `cuMemAddressFree` of `[va, va+size)`: make sure no phys is mapped there any more.
    /// Err if the program still has pages mapped in it (the driver's answer too).
    pub fn address_free(&mut self, va: u64, size: u64) -> DrvResult<()> {
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
        if let Err(e) = self.clear_range(va, size, u64::MAX) {
            log::warn!("clearing released pages under a new mapping failed ({e})");
        }
    }

    /// The driver's free memory; 0 if it cannot say (every page is then created at once, so
    /// the answer is still the driver's own).
    fn free_now(&mut self) -> u64 {
        self.drv.free_memory().unwrap_or(0)
    }

    /// `cuMemCreate` of a page. `dev_free` is not needed: the driver is asked.
    pub fn create(&mut self, size: u64, props: PageProps) -> DrvResult<u64> {
        self.last_call = Instant::now();
        let gran = self.drv.granularity();
        if size == 0 || !size.is_multiple_of(gran) {
            return Err(INVALID);
        }
        self.settle(false);
        if self.pending_bytes == 0 {
            // A new batch. Kept handles are this process's own memory: while they cover it,
            // the driver need not be asked what is free (≈ 30 µs a batch, H100).
            if self.kept_bytes >= size.saturating_add(self.cfg.margin) {
                self.free_est = 0;
                self.free_known = false;
                self.stats.meminfo_skipped += 1;
            } else {
                self.free_est = self.free_now();
                self.free_known = true;
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
            // Near the limit: stranded memory first, then a fresh look.
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
            // Create the pending pages of these properties and this one as one handle now:
            // the driver's answer is the exact one.
            let mut batch: Vec<u64> = self
                .pages
                .iter()
                .filter(|(_, p)| p.slot.is_none() && p.props == props)
                .map(|(v, _)| *v)
                .collect();
            batch.sort_unstable();
            let total: u64 = batch.iter().map(|v| self.pages[v].size).sum();
            match self.create_fresh(total, props) {
                Ok(h) => {
                    self.stats.exact_creates += 1;
                    let pid = self.add_phys(h, total, None, Vec::new());
                    let mut off = 0;
                    for v in batch {
                        self.attach(v, pid, off);
                        off += self.pages[&v].size;
                    }
                }
                Err(e) => {
                    self.pages.remove(&vh);
                    self.pending_bytes -= size;
                    return Err(e);
                }
            }
        }
        Ok(vh)
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
                p.refs += 1;
                return Ok(Some(*vh));
            }
        }
        match self.ours_in_range(ptr, 1) {
            true => Err(INVALID),
            false => Ok(None),
        }
    }

    /// The page mapping containing `ptr`: (start, size).
    pub fn range_of(&self, ptr: u64) -> Option<(u64, u64)> {
        let (va, vh) = self.maps.range(..=ptr).next_back()?;
        let size = self.pages[vh].size;
        (ptr < va + size).then_some((*va, size))
    }

    pub fn props_of(&self, vh: u64) -> Option<(u64, PageProps)> {
        self.pages.get(&vh).map(|p| (p.size, p.props))
    }

    /// `cuMemMap(va, size, offset, vh, flags)`.
    pub fn map(&mut self, va: u64, size: u64, offset: u64, vh: u64) -> DrvResult<()> {
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
                self.compact(pid, false)?;
            }
        }
        self.maps.insert(va, vh);
        self.pages.get_mut(&vh).unwrap().va = Some(va);
        Ok(())
    }

    /// The pages the program mapped in `[va, va+size)`: (address, page), in address order.
    fn mapped_in(&self, va: u64, size: u64) -> Vec<(u64, u64)> {
        self.maps
            .range(va..end(va, size))
            .map(|(a, v)| (*a, *v))
            .collect()
    }

    /// `cuMemUnmap(va, size)`: Ok(false) if no page of ours is mapped there (pass through).
    pub fn unmap(&mut self, va: u64, size: u64) -> DrvResult<bool> {
        self.last_call = Instant::now();
        let inside = self.mapped_in(va, size);
        if inside.is_empty() {
            return self.none_of_the_programs(va, size);
        }
        let covered: u64 = inside.iter().map(|(_, v)| self.pages[v].size).sum();
        if inside[0].0 != va || covered != size {
            return Err(INVALID);
        }
        for (a, vh) in inside {
            self.maps.remove(&a);
            let p = self.pages.get_mut(&vh).unwrap();
            p.va = None;
            if let Some((pid, _)) = p.slot {
                self.unmap_phys_if_idle(pid);
            }
            self.drop_if_dead(vh);
        }
        Ok(true)
    }

    /// `cuMemSetAccess(va, size, descs)`: give memory to the pending pages mapped in the range,
    /// map what is not mapped yet, and set access. Ok(false): nothing of ours (pass through).
    pub fn set_access(&mut self, va: u64, size: u64, descs: &[(i32, u32)]) -> DrvResult<bool> {
        self.last_call = Instant::now();
        let inside = self.mapped_in(va, size);
        if inside.is_empty() {
            return self.none_of_the_programs(va, size);
        }
        self.materialize(&inside)?;
        // The driver sets access on whole mappings: the phys behind the pages, those whose
        // mapping lacks some of it (a parked handle taken back in place has it already),
        // one call per run of them back to back.
        let mut touched = Vec::new();
        let mut need: Vec<(u64, u64)> = Vec::new();
        for (_, vh) in &inside {
            let (pid, _) = self.pages[vh].slot.expect("materialized");
            if touched.contains(&pid) {
                continue;
            }
            touched.push(pid);
            let ph = &self.phys[&pid];
            if !descs.iter().all(|d| ph.granted.contains(d)) {
                need.push((ph.base.expect("mapped"), ph.size));
            }
        }
        need.sort_unstable();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for (b, sz) in need {
            match ranges.last_mut() {
                Some(r) if r.0 + r.1 == b => r.1 += sz,
                _ => ranges.push((b, sz)),
            }
        }
        if ranges.is_empty() {
            self.stats.access_skipped += 1;
        }
        for (b, sz) in ranges {
            log::debug!(
                "device {}: access {descs:?} at {va:#x}+{size:#x}, set on {b:#x}+{sz:#x}",
                self.drv.device()
            );
            self.drv.set_access_flags(b, sz, descs)?;
        }
        for pid in touched {
            let ph = self.phys.get_mut(&pid).unwrap();
            for (d, f) in descs {
                ph.access.retain(|(x, _)| x != d);
                ph.access.push((*d, *f));
                ph.granted.retain(|(x, _)| x != d);
                ph.granted.push((*d, *f));
            }
        }
        Ok(true)
    }

    /// `cuMemExportToShareableHandle` of a page: the page gets a handle of its own (a consumer
    /// maps what it imports whole, page by page), and that real handle is returned.
    pub fn export(&mut self, vh: u64) -> DrvResult<ChunkHandle> {
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
            }
            Some((pid, _)) if self.phys[&pid].size != size => {
                // Every page of the phys is likely shared too: split it once, page by page.
                let members: Vec<u64> = self.phys[&pid].slots.values().copied().collect();
                for m in members {
                    self.pages.get_mut(&m).unwrap().single = true;
                }
                self.stats.exports_split += 1;
                self.compact(pid, true)?;
            }
            Some(_) => {}
        }
        self.pages.get_mut(&vh).unwrap().single = true;
        let (pid, _) = self.pages[&vh].slot.expect("has memory");
        Ok(self.phys[&pid].handle)
    }

    /// Before another process gets the memory of the run of mappings starting at `ptr`'s
    /// (IPC of another allocator's memory: tickets export the mappings' handles): every
    /// coalesced handle in the run becomes one handle per page, which never moves again, so
    /// what the consumer maps stays the program's memory.
    /// Parked handles leave their addresses first: the run is the driver's back-to-back
    /// mappings, and it must stop where the program's pages stop, as it does natively.
    pub fn isolate_run(&mut self, ptr: u64) -> DrvResult<()> {
        let parked: Vec<u64> = self.parked.keys().copied().collect();
        for b in parked {
            self.unpark(b)?;
        }
        let Some((_, vh)) = self.maps.range(..=ptr).next_back().map(|(a, v)| (*a, *v)) else {
            return Ok(());
        };
        let Some((mut pid, _)) = self.pages[&vh].slot else {
            return Ok(());
        };
        loop {
            let ph = &self.phys[&pid];
            let (Some(base), size) = (ph.base, ph.size) else {
                return Ok(());
            };
            if !(base..base + size).contains(&ptr) && base < ptr {
                return Ok(());
            }
            let members: Vec<u64> = ph.slots.values().copied().collect();
            let split = ph.slots.len() > 1 || members.iter().any(|v| self.pages[v].size != size);
            for m in &members {
                self.pages.get_mut(m).unwrap().single = true;
            }
            if split {
                self.stats.exports_split += 1;
                self.compact(pid, true)?;
            }
            match self.bases.get(&(base + size)) {
                Some(next) => pid = *next,
                None => return Ok(()),
            }
        }
    }

    /// Compact partly released handles: all of them if `force`, else until the stranded bytes
    /// are within the bound. Failures leave memory stranded (and are counted), never lost.
    pub fn settle(&mut self, force: bool) {
        for (va, size) in std::mem::take(&mut self.stray) {
            self.drop_tmp(va, size);
        }
        for (h, size) in std::mem::take(&mut self.unreleased) {
            self.release_or_hold(h, size);
        }
        if self.dirty.is_empty() {
            return;
        }
        let mut stranded = self.stranded();
        self.stats.peak_stranded = self.stats.peak_stranded.max(stranded);
        if !force && stranded <= self.cfg.strand_max {
            return;
        }
        let mut order: Vec<(u64, u64)> = self.dirty.iter().map(|p| (self.dead(*p), *p)).collect();
        order.sort_unstable_by(|a, b| b.cmp(a));
        for (dead, pid) in order {
            if !force && stranded <= self.cfg.strand_max {
                break;
            }
            match self.compact(pid, false) {
                Ok(()) => stranded -= dead,
                Err(e) => {
                    self.stats.compaction_failures += 1;
                    log::warn!("compaction of a partly released handle failed ({e}); its free pages stay held");
                }
            }
        }
    }

    // ---- internals -------------------------------------------------------------------------

    fn add_phys(
        &mut self,
        handle: ChunkHandle,
        size: u64,
        base: Option<u64>,
        access: Vec<(i32, u32)>,
    ) -> u64 {
        let pid = self.next_phys;
        self.next_phys += 1;
        if let Some(b) = base {
            self.bases.insert(b, pid);
        }
        // A mapped new phys has the access it is given (compaction sets it before).
        let granted = match base {
            Some(_) => access.clone(),
            None => Vec::new(),
        };
        self.phys.insert(
            pid,
            Phys {
                handle,
                size,
                base,
                slots: BTreeMap::new(),
                access,
                granted,
            },
        );
        self.stats.phys_created += 1;
        pid
    }

    fn attach(&mut self, vh: u64, pid: u64, off: u64) {
        let p = self.pages.get_mut(&vh).unwrap();
        if p.slot.is_none() && p.refs > 0 {
            self.pending_bytes -= p.size;
        }
        p.slot = Some((pid, off));
        self.phys.get_mut(&pid).unwrap().slots.insert(off, vh);
    }

    /// Unmap a phys none of whose pages the program still maps. With reuse on, it stays
    /// mapped: its pages are about to be released (PyTorch unmaps and releases page by page),
    /// and the handle is then parked where it is. What is mapped there later moves it first.
    fn unmap_phys_if_idle(&mut self, pid: u64) {
        if self.parking() {
            return;
        }
        let ph = &self.phys[&pid];
        let Some(base) = ph.base else { return };
        if ph.slots.values().any(|v| self.pages[v].va.is_some()) {
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

    /// Forget a page the program neither holds nor maps; release its phys when it was the
    /// last, or count the phys as stranding.
    fn drop_if_dead(&mut self, vh: u64) {
        let p = &self.pages[&vh];
        if p.refs > 0 || p.va.is_some() {
            return;
        }
        let slot = p.slot;
        let props = p.props;
        // Memory another process may have imported is never kept for new pages: it goes
        // back to the driver, which keeps it for the importer.
        let shared = p.single;
        self.pages.remove(&vh);
        let Some((pid, off)) = slot else { return };
        let ph = self.phys.get_mut(&pid).unwrap();
        ph.slots.remove(&off);
        if !ph.slots.is_empty() {
            self.dirty.insert(pid);
            return;
        }
        if shared {
            if let Err(e) = self.release_idle(pid) {
                log::warn!("releasing a shared handle failed ({e})");
                self.dirty.insert(pid);
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
                self.phys.remove(&pid);
                self.dirty.remove(&pid);
            }
            Err(e) => {
                log::warn!("releasing a coalesced handle failed ({e})");
                self.dirty.insert(pid);
            }
        }
    }

    /// Give memory to the pages in `inside` (address, page) and map every phys behind them.
    fn materialize(&mut self, inside: &[(u64, u64)]) -> DrvResult<()> {
        // Parked handles under whole chains of pending pages first (no driver call), then
        // kept or new handles for the rest, in runs of at most `max_handle`.
        let mut rest = Vec::new();
        for chain in self.pending_runs(inside, u64::MAX) {
            rest.extend(self.adopt_parked(&chain));
        }
        for piece in rest {
            for run in self.pending_runs(&piece, self.cfg.max_handle) {
                self.back_run(&run)?;
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
        Ok(())
    }

    /// Runs of the pending pages in `inside` mapped back to back, within one reservation, of
    /// the same properties, each at most `limit` bytes (a longer page stands alone).
    fn pending_runs(&self, inside: &[(u64, u64)], limit: u64) -> Vec<Vec<(u64, u64)>> {
        let mut runs: Vec<Vec<(u64, u64)>> = Vec::new();
        let mut len = 0u64;
        for &(va, vh) in inside {
            let p = &self.pages[&vh];
            if p.slot.is_some() {
                continue;
            }
            let extend = runs.last().is_some_and(|r| {
                let (lva, lvh) = *r.last().unwrap();
                let lp = &self.pages[&lvh];
                lva + lp.size == va
                    && lp.props == p.props
                    && !p.single
                    && !lp.single
                    && len.saturating_add(p.size) <= limit.max(p.size)
                    && self.same_reservation(r[0].0, va + p.size)
            });
            if extend {
                runs.last_mut().unwrap().push((va, vh));
                len += p.size;
            } else {
                runs.push(vec![(va, vh)]);
                len = p.size;
            }
        }
        runs
    }

    /// What `back_run` would do for these pieces of uniform pages, given kept handles of
    /// these sizes (largest that fits first, as `take_kept`): (new bytes, driver cost). The
    /// cost counts, per handle mapped, a map, an access call and the unmap to come (≈ 130 µs,
    /// H100), and per new handle its create and release (≈ 200 µs more).
    fn plan_cost(&self, pieces: &[Vec<(u64, u64)>], mut sizes: Vec<u64>, unit: u64) -> (u64, u64) {
        sizes.sort_unstable();
        let (mut fresh, mut cost) = (0, 0);
        for piece in pieces {
            for run in self.pending_runs(piece, self.cfg.max_handle) {
                let mut want = run.len() as u64 * unit;
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
    /// the pieces of the chain still without memory.
    fn adopt_parked(&mut self, chain: &[(u64, u64)]) -> Vec<Vec<(u64, u64)>> {
        let (start, first) = chain[0];
        let unit = self.pages[&first].size;
        let props = self.pages[&first].props;
        let end = start + chain.len() as u64 * unit;
        let uniform = chain
            .iter()
            .enumerate()
            .all(|(i, (va, v))| *va == start + i as u64 * unit && self.pages[v].size == unit);
        if !uniform || self.parked.is_empty() {
            return vec![chain.to_vec()];
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
            return vec![chain.to_vec()];
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
        let mut whole = self.plan_cost(&[chain.to_vec()], sizes.clone(), unit);
        // Without them, each is unmapped before the chain is mapped (≈ 50 µs).
        whole.1 += 50 * hits.len() as u64;
        let mut pieces = Vec::new();
        let mut left = sizes;
        let mut i = 0usize;
        for (b, k) in &hits {
            let i0 = ((b - start) / unit) as usize;
            if i0 > i {
                pieces.push(chain[i..i0].to_vec());
            }
            i = i0 + (k.1 / unit) as usize;
            if let Some(x) = left.iter().position(|s| *s == k.1) {
                left.swap_remove(x);
            }
        }
        if i < chain.len() {
            pieces.push(chain[i..].to_vec());
        }
        let split = self.plan_cost(&pieces, left, unit);
        if split.0 > whole.0 || split.1 > whole.1 {
            return vec![chain.to_vec()];
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

    fn same_reservation(&self, a: u64, end: u64) -> bool {
        self.reservations
            .range(..=a)
            .next_back()
            .is_some_and(|(s, l)| end <= s + l)
    }

    /// Memory for a run of pending pages: kept handles first (largest that fits, several back
    /// to back), the rest as one new handle; one per page if that cannot be had.
    fn back_run(&mut self, run: &[(u64, u64)]) -> DrvResult<()> {
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

    /// A handle becomes the memory of pending pages, in order.
    fn adopt(&mut self, h: ChunkHandle, size: u64, pages: &[(u64, u64)]) {
        let pid = self.add_phys(h, size, None, Vec::new());
        let mut off = 0;
        for (_, vh) in pages {
            self.attach(*vh, pid, off);
            off += self.pages[vh].size;
        }
    }

    /// Map an unmapped phys where its pages are mapped; split it first if they disagree.
    fn map_phys(&mut self, pid: u64) -> DrvResult<()> {
        let ph = &self.phys[&pid];
        let mut base = None;
        let mut consistent = true;
        for (off, vh) in &ph.slots {
            if let Some(va) = self.pages[vh].va {
                match base {
                    None => base = Some(va - off),
                    Some(b) if b + off == va => {}
                    Some(_) => consistent = false,
                }
            }
        }
        let Some(b) = base else { return Ok(()) };
        if !consistent || ph.slots.values().any(|v| self.pages[v].va.is_none()) {
            // Pages elsewhere or unmapped: one handle each, mapped one by one.
            return self.compact(pid, true);
        }
        let size = ph.size;
        let h = ph.handle;
        self.clear_range(b, size, pid)?;
        log::debug!(
            "device {}: handle {h:#x} mapped at {b:#x}+{size:#x}",
            self.drv.device()
        );
        self.drv.map(b, size, h)?;
        let ph = self.phys.get_mut(&pid).unwrap();
        ph.base = Some(b);
        ph.granted.clear();
        self.bases.insert(b, pid);
        Ok(())
    }

    /// Compact every other phys whose mapping overlaps `[va, va+size)` (ghosts in the way).
    fn clear_range(&mut self, va: u64, size: u64, except: u64) -> DrvResult<()> {
        for b in self.parked_in(va, size) {
            self.unpark(b)?;
        }
        for pid in self.phys_in(va, size).into_iter().filter(|p| *p != except) {
            self.compact(pid, false)?;
        }
        Ok(())
    }

    /// The groups a phys's live pages move to.
    fn groups(&self, pid: u64, singles: bool) -> Vec<Group> {
        let ph = &self.phys[&pid];
        let mut out: Vec<Group> = Vec::new();
        for (off, vh) in &ph.slots {
            let p = &self.pages[vh];
            let target = p.va;
            let join = !singles && !p.single;
            if let Some(g) = out.last_mut() {
                let adjacent = g.off + g.len == *off;
                let continues = match (g.target, target) {
                    (Some(t), Some(v)) => t + g.len == v,
                    _ => false,
                };
                if join && adjacent && continues && g.len + p.size <= self.cfg.max_handle {
                    g.len += p.size;
                    continue;
                }
            }
            out.push(Group {
                off: *off,
                len: p.size,
                target,
            });
        }
        out
    }

    /// Move the live pages of `pid` into new handles at the same addresses and release it.
    /// Device path: every step before the release has a restore path, so a failure leaves
    /// data and mappings as they were. Host path (no room for a copy on the device): the old
    /// handle is released before the new one is created; if that create fails (another
    /// process took the memory in between) it is retried, and otherwise the data is lost and
    /// said so loudly: the one step without a way back.
    fn compact(&mut self, pid: u64, singles: bool) -> DrvResult<()> {
        let mut groups = self.groups(pid, singles);
        if groups.is_empty() {
            return self.release_idle(pid);
        }
        let (handle, size, base) = {
            let ph = &self.phys[&pid];
            (ph.handle, ph.size, ph.base)
        };
        if base.is_none() {
            // Not mapped yet: the new handles are mapped when access is set.
            for g in &mut groups {
                g.target = None;
            }
        }
        let own = vec![(self.drv.device(), 3u32)];
        let acc = match &self.phys[&pid].access {
            a if a.is_empty() => own.clone(),
            a => a.clone(),
        };
        let props = self.phys[&pid]
            .slots
            .values()
            .next()
            .map(|v| self.pages[v].props)
            .unwrap_or_default();
        let me = self.drv.device();
        log::debug!(
            "device {me}: compacting handle {handle:#x} ({size:#x} bytes at {base:?}) into {} groups, access {acc:?}",
            groups.len()
        );
        // Kernels of other devices given access (PyTorch's peers) may be reading the live
        // pages: they finish before the pages move, as this device's do in copy_out.
        for (d, _) in acc.iter().filter(|(d, _)| *d != me) {
            self.drv.synchronize_peer(*d)?;
        }
        let mut w = Work::default();
        if let Err(e) = self.copy_out(handle, size, base, &groups, props, &own, &mut w) {
            self.undo(&mut w);
            return Err(e);
        }
        // Commit point: the old handle leaves its address; the device copies take its place.
        if let Some(b) = base {
            if let Err(e) = self.drv.unmap(b, size) {
                self.undo(&mut w);
                return Err(e);
            }
        }
        let mut placed = Vec::new();
        let mut failure = None;
        for (i, g) in groups.iter().enumerate() {
            let (h, on_device) = w.new[i];
            let Some(t) = g.target.filter(|_| on_device) else {
                continue;
            };
            if let Err(e) = self.drv.map(t, g.len, h) {
                failure = Some(e);
                break;
            }
            placed.push((t, g.len));
            if let Err(e) = self.drv.set_access_flags(t, g.len, &acc) {
                failure = Some(e);
                break;
            }
        }
        // The old handle goes back to the driver (off its temporary mapping first). The host
        // path's new handles are made of its memory: if it will not go, nothing has been
        // lost yet, and the compaction is undone instead.
        let mut held = None;
        if failure.is_none() {
            if let Some((t, sz)) = w.src_tmp.take() {
                self.drop_tmp(t, sz);
            }
            if let Err(e) = self.drv.release(handle) {
                match w.new.iter().any(|(_, on_device)| !on_device) {
                    true => failure = Some(e),
                    false => held = Some(e),
                }
            }
        }
        if let Some(e) = failure {
            for (t, len) in placed {
                self.drop_mapping(t, len);
            }
            if let Some(b) = base {
                let remapped = self.drv.map(b, size, handle);
                let mapped = remapped.is_ok();
                let back = remapped.and_then(|_| self.drv.set_access_flags(b, size, &acc));
                let ph = self.phys.get_mut(&pid).unwrap();
                match back {
                    Ok(()) => ph.granted = acc.clone(),
                    Err(e2) => {
                        // Not granted (access is set again with the pages'); not mapped, the
                        // books say so: the next cuMemSetAccess of its pages maps it again.
                        ph.granted.clear();
                        if !mapped {
                            ph.base = None;
                            self.bases.remove(&b);
                        }
                        log::error!("restoring a handle after a failed compaction failed ({e2}); its data is intact in the handle, {} until access is set again", if mapped { "without access" } else { "unmapped" });
                    }
                }
            }
            self.undo(&mut w);
            return Err(e);
        }
        // Committed.
        if let Some(b) = base {
            self.bases.remove(&b);
        }
        if let Some(e) = held {
            self.hold(handle, size, e);
        }
        let members: Vec<(u64, u64)> = self.phys[&pid]
            .slots
            .iter()
            .map(|(o, v)| (*o, *v))
            .collect();
        self.phys.remove(&pid);
        self.dirty.remove(&pid);
        self.stats.phys_released += 1;
        self.stats.compactions += 1;
        let mut result = Ok(());
        for (i, g) in groups.iter().enumerate() {
            let (mut h, on_device) = w.new[i];
            if !on_device {
                match self.fill_from_host(g, props, &acc, &own, w.host[i].as_deref().unwrap_or(&[]))
                {
                    Ok(nh) => h = nh,
                    Err(e) => {
                        log::error!(
                            "compaction through host memory: no device memory came back for {} bytes at {:#x} ({e}); their contents are lost",
                            g.len,
                            g.target.unwrap_or(0)
                        );
                        self.stats.compaction_failures += 1;
                        for (o, v) in &members {
                            if *o >= g.off && *o < g.off + g.len {
                                let p = self.pages.get_mut(v).unwrap();
                                p.slot = None;
                                if p.refs > 0 {
                                    self.pending_bytes += p.size;
                                }
                            }
                        }
                        result = Err(e);
                        continue;
                    }
                }
            }
            let npid = self.add_phys(h, g.len, g.target, acc.clone());
            self.stats.compacted_bytes += g.len;
            for (o, v) in &members {
                if *o >= g.off && *o < g.off + g.len {
                    self.pages.get_mut(v).unwrap().slot = None;
                    self.attach_moved(*v, npid, o - g.off);
                }
            }
        }
        let tmp: Vec<(u64, u64)> = w.tmp.drain(..).collect();
        for (t, sz) in tmp {
            self.drop_tmp(t, sz);
        }
        result
    }

    /// Take a temporary mapping down; one that will not go is retried at the next settle.
    fn drop_tmp(&mut self, va: u64, size: u64) {
        let unmapped = self
            .drv
            .unmap(va, size)
            .or_else(|_| self.drv.unmap(va, size));
        let freed = unmapped.and_then(|_| {
            self.drv
                .free_va(va, size)
                .or_else(|_| self.drv.free_va(va, size))
        });
        if freed.is_err() {
            self.stray.push((va, size));
        }
    }

    /// A page moves from one phys to another (no pending accounting involved).
    fn attach_moved(&mut self, vh: u64, pid: u64, off: u64) {
        self.pages.get_mut(&vh).unwrap().slot = Some((pid, off));
        self.phys.get_mut(&pid).unwrap().slots.insert(off, vh);
    }

    /// Steps of a compaction that change nothing the program sees: wait for the device,
    /// create the new handles, and copy the live pages out (to device memory where the
    /// driver had room, else to the host).
    #[allow(clippy::too_many_arguments)]
    fn copy_out(
        &mut self,
        handle: ChunkHandle,
        size: u64,
        base: Option<u64>,
        groups: &[Group],
        props: PageProps,
        own: &[(i32, u32)],
        w: &mut Work,
    ) -> DrvResult<()> {
        self.drv.synchronize()?;
        for g in groups {
            match self.create_room(g.len, props) {
                Ok(h) => w.new.push((h, true)),
                Err(e) if e.is_oom() => w.new.push((0, false)),
                Err(e) => return Err(e),
            }
        }
        let src = match base {
            Some(b) => b,
            None => {
                let t = self.temp_map(handle, size, own, w)?;
                w.src_tmp = w.tmp.pop();
                t
            }
        };
        for (i, g) in groups.iter().enumerate() {
            let (h, on_device) = w.new[i];
            if on_device {
                let t = self.temp_map(h, g.len, own, w)?;
                self.drv.copy(t, src + g.off, g.len)?;
                w.host.push(None);
            } else {
                self.stats.host_copies += 1;
                w.host.push(Some(self.drv.save(src + g.off, g.len)?));
            }
        }
        Ok(())
    }

    /// Map `h` at a fresh reservation for copying; recorded in `w.tmp`.
    fn temp_map(
        &mut self,
        h: ChunkHandle,
        size: u64,
        own: &[(i32, u32)],
        w: &mut Work,
    ) -> DrvResult<u64> {
        let t = self.drv.reserve(size)?;
        if let Err(e) = self.drv.map(t, size, h) {
            let _ = self.drv.free_va(t, size);
            return Err(e);
        }
        w.tmp.push((t, size));
        self.drv.set_access_flags(t, size, own)?;
        Ok(t)
    }

    /// Host path, after the old handle's release: a new handle, mapped, filled. Nothing can
    /// restore the old handle from here, so the whole step is tried three times.
    fn fill_from_host(
        &mut self,
        g: &Group,
        props: PageProps,
        acc: &[(i32, u32)],
        own: &[(i32, u32)],
        data: &[u8],
    ) -> DrvResult<ChunkHandle> {
        let mut last = INVALID;
        for attempt in 0..3 {
            if attempt > 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            match self.fill_once(g, props, acc, own, data) {
                Ok(h) => return Ok(h),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn fill_once(
        &mut self,
        g: &Group,
        props: PageProps,
        acc: &[(i32, u32)],
        own: &[(i32, u32)],
        data: &[u8],
    ) -> DrvResult<ChunkHandle> {
        let h = self.create_room(g.len, props)?;
        let mut w = Work::default();
        let r = match g.target {
            Some(t) => self.drv.map(t, g.len, h).and_then(|_| {
                self.drv
                    .set_access_flags(t, g.len, acc)
                    .and_then(|_| self.drv.load(t, data))
                    .inspect_err(|_| self.drop_mapping(t, g.len))
            }),
            None => self
                .temp_map(h, g.len, own, &mut w)
                .and_then(|t| self.drv.load(t, data)),
        };
        let tmp: Vec<(u64, u64)> = w.tmp.drain(..).collect();
        for (t, sz) in tmp {
            self.drop_tmp(t, sz);
        }
        match r {
            Ok(()) => Ok(h),
            Err(e) => {
                let _ = self.drv.release(h);
                Err(e)
            }
        }
    }

    /// Unmap a mapping of ours, once more if the first try fails.
    fn drop_mapping(&mut self, va: u64, size: u64) {
        if self.drv.unmap(va, size).is_err() {
            let _ = self.drv.unmap(va, size);
        }
    }

    /// Release a phys none of whose pages is live.
    fn release_idle(&mut self, pid: u64) -> DrvResult<()> {
        let ph = &self.phys[&pid];
        log::debug!(
            "device {}: handle {:#x} released ({:#x} bytes, was at {:?})",
            self.drv.device(),
            ph.handle,
            ph.size,
            ph.base
        );
        if let Some(b) = ph.base {
            self.drv.unmap(b, ph.size)?;
            self.bases.remove(&b);
            self.phys.get_mut(&pid).unwrap().base = None;
        }
        self.drv.release(self.phys[&pid].handle)?;
        self.phys.remove(&pid);
        self.dirty.remove(&pid);
        self.stats.phys_released += 1;
        Ok(())
    }

    /// Undo an uncommitted compaction: temporary mappings and new handles go away.
    fn undo(&mut self, w: &mut Work) {
        let tmp: Vec<(u64, u64)> = w.tmp.drain(..).chain(w.src_tmp.take()).collect();
        for (va, sz) in tmp {
            self.drop_tmp(va, sz);
        }
        for (h, on_device) in w.new.drain(..) {
            if on_device {
                let _ = self.drv.release(h);
            }
        }
    }
}
