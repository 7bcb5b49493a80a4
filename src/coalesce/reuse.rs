//! Released memory kept for reuse and given back: handles kept while the program keeps
//! allocating (parked where their pages were, or unmapped), creating with room made from
//! them, and handles the driver would not take back, held and retried.

use super::books::{key, Coalescer, Kept, KeptKey};
use crate::gpu::{ChunkHandle, Driver, DrvError, DrvResult, PageProps};

/// What a give-back did ([`Coalescer::set_keeping_timed`]): the bytes, the kept handles
/// before it and the estimate of their give-back, and how long its parts took (retrying what
/// the driver refused before, handles with no live page and how many, kept handles).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TrimParts {
    pub bytes: u64,
    pub kept_handles: u64,
    pub estimate_us: u64,
    pub leftovers: std::time::Duration,
    pub idle: std::time::Duration,
    pub idle_handles: u64,
    pub kept: std::time::Duration,
}

impl TrimParts {
    /// Two coalescers' give-backs as one.
    pub fn plus(self, o: TrimParts) -> TrimParts {
        TrimParts {
            bytes: self.bytes + o.bytes,
            kept_handles: self.kept_handles + o.kept_handles,
            estimate_us: self.estimate_us + o.estimate_us,
            leftovers: self.leftovers + o.leftovers,
            idle: self.idle + o.idle,
            idle_handles: self.idle_handles + o.idle_handles,
            kept: self.kept + o.kept,
        }
    }
}

/// Giving a kept handle back costs the driver about this much a handle, in microseconds
/// (`scripts/vmm-cost/release_parallel.c`, H200: 5,120 handles of 20 MiB in 144-163 ms)...
pub const GIVEBACK_US_A_HANDLE: u64 = 15;
/// ...plus its bytes at this many a microsecond (1.6 GB/ms: 50 handles of 2 GiB in 54-74 ms,
/// 400 of 256 MiB in 69-88 ms; more threads do not release faster)...
pub const GIVEBACK_BYTES_A_US: u64 = 1_600_000;
/// ...plus an unmap first where it is still mapped (parked): `keep_newcomer.py` (H200) gave
/// back 1,131 parked handles of about 20 MiB (23.7 GB) in 111 ms, 98 us a handle.
pub const GIVEBACK_US_UNMAP: u64 = 80;

/// The estimated time to give back `handles` kept handles of `bytes` in all, `parked` of them
/// mapped, in microseconds.
pub fn giveback_us(handles: u64, parked: u64, bytes: u64) -> u64 {
    handles * GIVEBACK_US_A_HANDLE + parked * GIVEBACK_US_UNMAP + bytes / GIVEBACK_BYTES_A_US
}

impl<D: Driver> Coalescer<D> {
    /// Whether released handles may be kept from now on (where a release delay is set): off,
    /// what goes back without moving a live page goes back at once (`trim_unmoved`: every kept
    /// handle, a parked one unmapped first, and idle handles; one that will not unmap stays,
    /// tried again at the next release), the rest at the program's next call. The bytes given
    /// back.
    pub fn set_keeping(&mut self, keeping: bool) -> u64 {
        self.set_keeping_timed(keeping).bytes
    }

    /// [`Self::set_keeping`], with what was kept before and how long the give-back's parts
    /// took.
    pub fn set_keeping_timed(&mut self, keeping: bool) -> TrimParts {
        self.keeping = keeping;
        if keeping {
            return TrimParts::default();
        }
        let (kept_handles, estimate_us) = (self.kept_handles(), self.kept_giveback_us());
        TrimParts {
            kept_handles,
            estimate_us,
            ..self.trim_unmoved_timed()
        }
    }

    /// Give every kept handle back to the driver (a parked one is unmapped first; one that
    /// will not unmap stays kept and is tried again next time).
    pub fn release_kept(&mut self) {
        let keys: Vec<KeptKey> = self.kept.keys().copied().collect();
        for k in keys {
            self.give_back(k);
        }
    }

    /// Take a kept handle out of the books, unmapped (a parked one is unmapped here). None if
    /// it is parked and will not unmap: it stays kept.
    pub(super) fn unkeep(&mut self, k: KeptKey) -> Option<ChunkHandle> {
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
    pub(super) fn give_back(&mut self, k: KeptKey) -> bool {
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
    pub(super) fn release_or_hold(&mut self, h: ChunkHandle, size: u64) {
        if let Err(e) = self.drv.release(h) {
            self.hold(h, size, e);
        }
    }

    /// A handle the driver would not take back (`e`): held, counted, tried again later.
    pub(super) fn hold(&mut self, h: ChunkHandle, size: u64, e: DrvError) {
        log::warn!("releasing a handle failed ({e}); tried again later");
        self.unreleased.push((h, size));
    }

    /// A parked handle leaves its address (something else is mapped there) and stays kept.
    pub(super) fn unpark(&mut self, base: u64) -> DrvResult<()> {
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

    /// A handle of exactly the pages' memory that is no longer needed: kept for reuse while
    /// the program keeps allocating, else released.
    pub(super) fn dispose(
        &mut self,
        handle: ChunkHandle,
        size: u64,
        props: PageProps,
    ) -> DrvResult<()> {
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
        self.bound_kept();
        Ok(())
    }

    /// The estimated time to give back every kept handle, in microseconds.
    pub fn kept_giveback_us(&self) -> u64 {
        giveback_us(
            self.kept.len() as u64,
            self.parked.len() as u64,
            self.kept_bytes,
        )
    }

    /// Under a bound on the time giving back what is kept may take
    /// (`CoalesceConfig::keep_giveback_us`): past it, the oldest kept handles go back until
    /// what is kept takes at most 7/8 of it (so that the next releases do not each sort them).
    fn bound_kept(&mut self) {
        let bound = self.cfg.keep_giveback_us;
        if bound == 0 || self.kept_giveback_us() <= bound {
            return;
        }
        let mut oldest: Vec<KeptKey> = self.kept.keys().copied().collect();
        oldest.sort_unstable_by_key(|k| k.2);
        for k in oldest {
            if self.kept_giveback_us() <= bound - bound / 8 {
                break;
            }
            if self.give_back(k) {
                self.stats.kept_bounded += 1;
            }
        }
    }

    /// A phys that is still mapped and has no page left: kept where it is (parked). Pages
    /// mapped at the same place again take it back with no driver call at all.
    pub(super) fn park(&mut self, pid: u64, props: PageProps) {
        let ph = self.remove_phys(pid).unwrap();
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
        self.bound_kept();
    }

    /// Create `size` bytes. Kept handles that could not serve the pages make room first (the
    /// best fit, else the largest), so the memory held never exceeds what the program's pages
    /// and the kept handles held before; on out-of-memory all kept handles go back and the
    /// driver is asked again.
    pub(super) fn create_fresh(&mut self, size: u64, props: PageProps) -> DrvResult<ChunkHandle> {
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
    pub(super) fn create_room(&mut self, size: u64, props: PageProps) -> DrvResult<ChunkHandle> {
        let made = match self.drv.create_as(size, props) {
            Err(e) if e.is_oom() && self.kept_bytes > 0 => {
                self.release_kept();
                self.drv.create_as(size, props)
            }
            r => r,
        };
        if made.is_ok() {
            self.made += size;
        }
        made
    }

    /// The largest kept handle of these properties of at most `max` bytes, a multiple of
    /// `unit` (an unmapped one before a parked one of the same size, which must unmap).
    pub(super) fn take_kept(
        &mut self,
        props: PageProps,
        max: u64,
        unit: u64,
    ) -> Option<(ChunkHandle, u64)> {
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
}
