//! The coalescer's books: pages (the program's virtual handles), physical handles behind them,
//! kept handles, reservations, and the range queries over them. Nothing here calls the
//! driver but to read its free memory or name its device.

use super::slots::Slots;
use super::timed::Timed;
use crate::gpu::{ChunkHandle, Driver, DrvError, DrvResult, PageProps};
use crate::hostcopy::{HostCopies, Saved};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

/// `CUDA_ERROR_INVALID_VALUE`.
pub const INVALID: DrvError = DrvError(1);
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const NOT_SUPPORTED: DrvError = DrvError(801);

/// Virtual handles carry this tag in their top 16 bits (the driver's own handles are
/// addresses of its objects, far below it).
pub(super) const TAG: u64 = 0xE5E5 << 48;

pub fn is_virtual(h: u64) -> bool {
    h & (0xFFFF << 48) == TAG
}

/// Virtual handles are numbered process-wide: each device has its coalescer, and a handle
/// must name one page of one of them.
pub(super) static NEXT_VH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The books' maps of pages by virtual handle and of phys by number. The keys are expseg's
/// own (counters), so SipHash's resistance to chosen keys buys nothing (it cost a fifth of the
/// coalescer's time in a replayed GPT-2 run). Phys are in a hash map, not a BTreeMap: a
/// lookup is a control byte and the entry, not two or three nodes, each a cache miss or two
/// in a training loop (design.md, the books' cost).
pub(super) type PageMap<V> = HashMap<u64, V, BuildKeyHasher>;

/// The key's own low bits choose the bucket, so the pages of a batch (handles numbered one
/// after another) sit side by side in the table and a call on them finds them in the lines
/// the last call brought in; one multiply gives the top 7 bits (the control byte that a
/// probe compares first). With the caches evicted between calls as a training loop does
/// (`examples/coldbench.rs`, medians of 6 runs) a call costs 7-18 % less than with a
/// multiplicative hash (train_ec 2.49 -> 2.10 us, DDP 2.82 -> 2.63, GPT-2 2.33 -> 1.90;
/// creates, maps and releases 11-35 % less, access calls alike).
#[derive(Default, Clone, Copy)]
pub(super) struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, n: u64) {
        let top = n.wrapping_mul(0x517c_c1b7_2722_0a95) >> 57;
        self.0 = ((self.0.rotate_left(5) ^ n) & ((1 << 57) - 1)) | (top << 57);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(super) type BuildKeyHasher = std::hash::BuildHasherDefault<KeyHasher>;

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
    /// Growing ahead: a new handle at the end of the program's pages covers up to this many
    /// bytes more (and at most 1/[`AHEAD_SHARE`] of the most this coalescer has held), so
    /// that the pages the program maps there next need no driver call; 0: off. The bytes
    /// ahead go back at the program's first unmap, as released pages do.
    pub ahead: u64,
    /// Whether a move of live pages also holds the default streams of the other devices
    /// given access to them (`EXPSEG_PEER_HOLD`).
    pub peer_hold: crate::config::PeerHold,
    /// Opt-in (`EXPSEG_COMPACT=1`): partly released handles are compacted, their live pages
    /// moved to new handles, so released pages go back at once. Off (the default): a page the
    /// program has mapped never moves (another thread's kernels on their own streams may be
    /// using it, and no hook sees them); released pages of a handle that still has live ones
    /// stay held until its last page goes or new pages are mapped where they were.
    pub move_live: bool,
    /// The last page of each batch of new pages gets a handle of its own
    /// (`EXPSEG_SPLIT_TAIL`): the program's next small blocks share it, so its lifetime is
    /// not the batch's.
    pub split_tail: bool,
    /// Handles are cut where live pages met released ones at the end of a giving back
    /// (`EXPSEG_LEARN_CUTS`, [`super::cuts`]).
    pub learn_cuts: bool,
    /// What is kept is bounded by the time giving it back is estimated to take, in
    /// microseconds (`reuse::giveback_us`); 0: no bound (`EXPSEG_KEEP_GIVEBACK`, under
    /// `EXPSEG_KEEP=auto` only).
    pub keep_giveback_us: u64,
}

/// Bytes grown ahead are at most this fraction of the peak held (1/64: 1.6 %).
pub const AHEAD_SHARE: u64 = 64;

/// For how long the driver's answer of free memory admits new batches of pages as it stands
/// (less what the coalescer created since): 2 ms. Another process's allocations in those 2 ms
/// are what the margin (`EXPSEG_COALESCE_MARGIN`, 1 GiB) absorbs.
pub const FREE_FRESH_NS: u64 = 2_000_000;

/// Past `FREE_FRESH_NS`, the answer still admits a batch, less what other processes could
/// have taken since at this many bytes a millisecond: 2 GiB, four times what the driver gives
/// one process (a `cudaMalloc` of 80 GiB took 153 ms in the handoff bench, H200). A batch
/// that does not fit by that figure asks the driver again. Asking costs 12-15 us alone
/// (`cuMemGetInfo`, H200) and 34-35 us inside a training loop (train_ec, gpt2_ec: 1,362 and
/// 708 asks a run with the 2 ms window alone); PyTorch maps in bursts, and replayed on a
/// 140 GiB card, the bench's 15 traces ask 2.6-17 times less (train_ec 1,323 -> 99, GPT-2
/// 639 -> 50, DeepSpeed 44 -> 17), every other driver call and all placement unchanged; on
/// the GPU with 24 GiB to itself, train_ec 1,286-1,393 -> 388-419 (14-18 ms a run instead of
/// 39-51; no step change measurable).
pub const OTHERS_BYTES_PER_MS: u64 = 2 << 30;

/// An answer older than this is never used: 100 ms.
pub const FREE_STALE_NS: u64 = 100_000_000;

impl Default for CoalesceConfig {
    fn default() -> Self {
        CoalesceConfig {
            max_handle: 1 << 30,
            strand_max: 0,
            margin: 1 << 30,
            release_delay: std::time::Duration::ZERO,
            ahead: 1 << 30,
            peer_hold: crate::config::PeerHold::Off,
            move_live: false,
            split_tail: true,
            learn_cuts: true,
            keep_giveback_us: 0,
        }
    }
}

impl CoalesceConfig {
    /// The tuning the `EXPSEG_*` configuration asks for. `releaser`: whether a thread gives
    /// kept handles back after the delay (without one, nothing would: released at once).
    pub fn from_config(c: &crate::config::Config, releaser: bool) -> Self {
        CoalesceConfig {
            max_handle: c.coalesce_max,
            strand_max: c.strand_max,
            margin: c.coalesce_margin,
            release_delay: match releaser {
                true => std::time::Duration::from_millis(c.release_delay_ms),
                false => std::time::Duration::ZERO,
            },
            ahead: c.grow_ahead,
            peer_hold: c.peer_hold,
            move_live: c.compact,
            split_tail: c.split_tail,
            learn_cuts: c.learn_cuts,
            keep_giveback_us: 0,
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
    /// Page-sized handles refused for pages of memory shared whole (it would have moved).
    pub splits_refused: u64,
    /// Released pages' bytes held inside handles that still have live pages: the most at
    /// once, and the most together with bytes grown ahead (all that is held beyond the
    /// program's pages but kept handles).
    pub peak_stranded: u64,
    pub peak_beyond: u64,
    /// The most physical bytes behind the program's pages at once.
    pub peak_held: u64,
    /// Compactions not made because they would have moved pages the program has mapped
    /// (`CoalesceConfig::move_live` off): their released bytes stay held.
    pub moves_declined: u64,
    /// Bytes of new pages served in place by released pages of a live handle (mapped where
    /// those were): no driver call, and those bytes are no longer stranded.
    pub reused_stranded: u64,
    /// Lifetime boundaries learned from stranded handles (`EXPSEG_LEARN_CUTS`).
    pub cuts_learned: u64,
    /// Batches whose split-off last page kept them from stranding (all their pages went back
    /// while it lived): from the first, last pages are split off for good.
    pub tail_splits_useful: u64,
    /// Bytes of pages served from released handles kept for reuse.
    pub reused_bytes: u64,
    /// Kept handles that went back to the driver (quiet, mem_get_info, or memory needed).
    pub kept_released: u64,
    /// Kept handles given back because what was kept would take longer to give back than
    /// `EXPSEG_KEEP_GIVEBACK` allows.
    pub kept_bounded: u64,
    /// Bytes of pages served by a kept handle still mapped where the pages were mapped: no
    /// driver call at all.
    pub reused_in_place: u64,
    /// Bytes of pages served by memory grown ahead (no driver call), and the bytes grown
    /// ahead that went back unused.
    pub ahead_used: u64,
    pub ahead_returned: u64,
    /// `cuMemSetAccess` calls answered without the driver: the mappings already had it.
    pub access_skipped: u64,
    /// Batches admitted without asking the driver for its free memory (kept handles cover them,
    /// or its last answer does, less what others could have taken since: `free_recent`).
    pub meminfo_skipped: u64,
    /// Handles given back from a thread whose current context was not their device's primary
    /// one, after waiting for their device's default stream (`Coalescer::unmap_from`).
    pub cross_device_waits: u64,
    /// Compactions whose copies and remapping ran behind a hold on the device's default
    /// stream (`Driver::copy_and_hold`).
    pub held_moves: u64,
    /// Moves of live pages not made because a stream of the program's captured a CUDA graph.
    pub moves_refused_capture: u64,
    /// Holds of peers' default streams kept through a move, and let go before it was done
    /// (`EXPSEG_PEER_HOLD`, `Held::peers_let_go`). Moves copied through the host hold nothing
    /// and count in neither.
    pub peer_holds: u64,
    pub peer_holds_let_go: u64,
    /// Moves that only gave stranded bytes back, put off because a peer given access could
    /// not be held (`EXPSEG_PEER_HOLD=1`; `compact::PUT_OFF`): the bytes stay until a later call.
    pub moves_put_off: u64,
}

#[derive(Debug)]
pub(super) struct Page {
    pub(super) size: u64,
    pub(super) props: PageProps,
    /// Program references: 1 from create, +1 per retain; released at 0.
    pub(super) refs: u32,
    /// `(phys, offset)` once the page has memory.
    pub(super) slot: Option<(u64, u64)>,
    /// Where the program mapped it.
    pub(super) va: Option<u64>,
    /// Handed out as its own handle (exported): never coalesced again.
    pub(super) single: bool,
}

#[derive(Debug)]
pub(super) struct Phys {
    pub(super) handle: ChunkHandle,
    pub(super) size: u64,
    /// Where the handle is mapped, whole.
    pub(super) base: Option<u64>,
    /// offset -> page
    pub(super) slots: Slots,
    /// Access the program set on any page of it: (device, flags).
    pub(super) access: Vec<(i32, u32)>,
    /// Access set on the mapping at `base` since it was mapped (empty when unmapped).
    pub(super) granted: Vec<(i32, u32)>,
    /// Bytes at the end grown ahead of the program's pages (never a page's): not stranded
    /// while they wait for the next pages mapped there.
    pub(super) ahead: u64,
    /// Paused (`sleep`): the handle is given back, `base` and `granted` say where and how
    /// it comes back.
    pub(super) asleep: Option<Sleep>,
    /// Made near the limit for pages not mapped yet (`create_each`, `create_batch`), never
    /// mapped since: it holds no bytes of the program's, so it may be given back for other
    /// memory of its pages' (`unexact`).
    pub(super) blank: bool,
    /// How many of its pages the program has mapped (`va` set): kept by `attach`,
    /// `attach_moved`, `map`, `unmap` and `unslot`, so an unmap need not look at every page.
    pub(super) mapped: u32,
}

/// What a range query at an address of ours should see ([`Coalescer::query`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// The program's page `(start, size)` (what `cuMemGetAddressRange` reports natively), in
    /// the reservation `(start, size)` if expseg knows it (what the pointer attributes
    /// `RANGE_START_ADDR`/`RANGE_SIZE` report for VMM memory, measured).
    Page {
        page: (u64, u64),
        reservation: Option<(u64, u64)>,
    },
    /// Only a handle of expseg's is mapped here: natively nothing is.
    Hidden { reservation: Option<(u64, u64)> },
}

/// A paused phys: its live bytes on the host (None: discarded), and the properties of the
/// handle it gets back.
#[derive(Debug)]
pub(super) struct Sleep {
    pub(super) saved: Option<Saved>,
    pub(super) props: PageProps,
}

/// A fully released handle kept for reuse. `base`: still mapped there (*parked*), with
/// `granted` access, so pages mapped at the same place again need no driver call.
#[derive(Debug, Clone)]
pub(super) struct Kept {
    pub(super) handle: ChunkHandle,
    pub(super) base: Option<u64>,
    pub(super) granted: Vec<(i32, u32)>,
}

/// Page properties as an ordered key.
pub(super) type KeyProps = (bool, bool);

/// A kept handle's key: (properties, size, sequence).
pub(super) type KeptKey = (KeyProps, u64, u64);

pub(super) fn key(p: PageProps) -> KeyProps {
    (p.shareable, p.rdma)
}

/// The end of `[va, va+size)`, saturated: a range that wraps (the driver refuses it) must not
/// make the books panic.
pub(super) fn end(va: u64, size: u64) -> u64 {
    va.saturating_add(size)
}

pub struct Coalescer<D: Driver> {
    pub(super) drv: Timed<D>,
    pub(super) cfg: CoalesceConfig,
    pub(super) next_phys: u64,
    pub(super) pages: PageMap<Page>,
    /// phys by number (numbered in creation order: where the order of a walk over them
    /// matters, it goes through [`Coalescer::pids`])
    pub(super) phys: PageMap<Phys>,
    /// program mapping address -> page
    pub(super) maps: BTreeMap<u64, u64>,
    /// phys base address -> phys (mapped phys only)
    pub(super) bases: BTreeMap<u64, u64>,
    /// Reservations the program made through expseg: start -> size.
    pub(super) reservations: BTreeMap<u64, u64>,
    pub(super) pending_bytes: u64,
    pub(super) free_est: u64,
    /// Phys with dead bytes.
    pub(super) dirty: BTreeSet<u64>,
    /// False only while no phys is paused: set when one is, cleared by a look that finds
    /// none (`any_asleep`), so a program call on awake memory looks at no phys for it.
    pub(super) maybe_asleep: bool,
    /// Temporary mappings whose teardown failed, retried at the next settle.
    pub(super) stray: Vec<(u64, u64)>,
    /// Handles the driver would not take back (cuMemRelease failed): (handle, size), still
    /// counted as held and retried at the next settle.
    pub(super) unreleased: Vec<(ChunkHandle, u64)>,
    /// Fully released handles kept for reuse: (properties, size, sequence) -> handle.
    pub(super) kept: BTreeMap<KeptKey, Kept>,
    /// Kept handles still mapped: base -> key.
    pub(super) parked: BTreeMap<u64, KeptKey>,
    pub(super) kept_bytes: u64,
    /// Whether `free_est` was read from the driver in this batch.
    pub(super) free_known: bool,
    /// The driver's last answer of free memory: (clock when read, bytes, `made` then).
    pub(super) free_seen: Option<(u64, u64, u64)>,
    /// Bytes this coalescer has created, a running count (what it took since an answer).
    pub(super) made: u64,
    pub(super) kept_seq: u64,
    /// The program's last call.
    pub(super) last_call: Instant,
    /// Whether released handles may be kept now (with a release delay): off while a process
    /// that cannot ask for them shares the GPU (`set_keeping`).
    pub(super) keeping: bool,
    /// Released pages of a handle still stranded because the next page of the same handle
    /// may be released next (the program's loop over a free range): (phys, offset of that
    /// page). Settled at the program's next call that is not the loop's (only inside the
    /// program's own calls is moving live pages safe).
    pub(super) deferred: Option<(u64, u64)>,
    /// The most physical bytes behind pages held at once (bounds growing ahead).
    pub(super) peak_held: u64,
    /// Whether some phys may have bytes grown ahead (cleared when they go back).
    pub(super) grown: bool,
    /// Growing ahead is off: a handle grown ahead met a mapping the books did not know.
    pub(super) no_ahead: bool,
    /// The program unmapped pages since its last other call (it is giving memory back):
    /// memory grown ahead goes back when that ends, unless its own handle's pages go first.
    pub(super) giving_back: bool,
    /// A trim from outside the program's calls (`trim_unmoved`) left memory that only moving
    /// live pages gives back: its next call does.
    pub(super) trim_owed: bool,
    /// The program released a page of a handle that stays (stranded bytes may have grown):
    /// measured when its giving back ends (`note_stranded`).
    pub(super) released_since: bool,
    /// Whether a page's memory went back since the last giving back ended (stranding or not):
    /// the rounds that tell whether lifetimes are still being learned ([`super::cuts`]).
    pub(super) gave_back: bool,
    /// Whether the call under way runs on the device's allocator thread (set by the caller
    /// before each call, `allow_moves`): only there may a call move live pages it was not
    /// asked to move (the compaction owed since the program's release loop, a trim before a
    /// pause). Elsewhere that waits for the device's own next call.
    pub(super) moves_allowed: bool,
    /// Host buffers of paused handles.
    pub(super) host: HostCopies,
    /// The pages of the program's unmap or access call under way, and the phys behind them:
    /// lists kept for their room, so that a hook call allocates nothing for them.
    pub(super) scratch: Vec<(u64, u64)>,
    /// The sizes of the phys not paused, and their bytes grown ahead, summed as they change
    /// ([`Coalescer::remove_phys`] and the places that change them): a batch reads both.
    pub(super) held_awake: u64,
    pub(super) ahead_total: u64,
    pub(super) touched: Vec<(u64, u64, u64, bool)>,
    /// Lifetime boundaries learned from stranded handles ([`super::cuts`]).
    pub(super) cuts: super::learned::Cuts,
    pub(super) stats: CoalesceStats,
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
            pages: PageMap::default(),
            phys: PageMap::default(),
            maps: BTreeMap::new(),
            bases: BTreeMap::new(),
            reservations: BTreeMap::new(),
            pending_bytes: 0,
            free_est: 0,
            dirty: BTreeSet::new(),
            maybe_asleep: false,
            stray: Vec::new(),
            unreleased: Vec::new(),
            kept: BTreeMap::new(),
            parked: BTreeMap::new(),
            free_known: false,
            free_seen: None,
            made: 0,
            kept_bytes: 0,
            kept_seq: 0,
            last_call: Instant::now(),
            keeping: true,
            deferred: None,
            peak_held: 0,
            grown: false,
            no_ahead: false,
            giving_back: false,
            trim_owed: false,
            released_since: false,
            gave_back: false,
            moves_allowed: true,
            host: HostCopies::default(),
            scratch: Vec::new(),
            held_awake: 0,
            ahead_total: 0,
            touched: Vec::new(),
            cuts: Default::default(),
            stats: CoalesceStats::default(),
        }
    }

    pub fn driver(&self) -> &D {
        &self.drv.inner
    }

    pub fn driver_mut(&mut self) -> &mut D {
        &mut self.drv.inner
    }

    /// Driver calls and their time in clock ticks per operation (`Op::ALL` order, then
    /// `cuMemGetInfo`; [`crate::clock::ns`] makes nanoseconds of a sum).
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

    /// Released handles kept for reuse.
    pub fn kept_handles(&self) -> u64 {
        self.kept.len() as u64
    }

    /// Bytes of released handles kept for reuse.
    pub fn kept_bytes(&self) -> u64 {
        self.kept_bytes
    }

    /// How long the program has made no call (kept only where released handles are parked:
    /// elsewhere nothing asks, and a hook saves the clock read).
    pub fn idle_for(&self) -> std::time::Duration {
        self.last_call.elapsed()
    }

    /// The program called (`create`, `unmap`, `set_access`): the time, for [`Self::idle_for`].
    pub(super) fn note_call(&mut self) {
        if self.parking() {
            self.last_call = Instant::now();
        }
    }

    pub(super) fn parking(&self) -> bool {
        self.keeping && !self.cfg.release_delay.is_zero()
    }

    /// Whether released handles are kept now.
    pub fn keeping(&self) -> bool {
        self.parking()
    }

    /// Whether a parked handle overlaps `[va, va+size)`.
    pub fn parked_in_range(&self, va: u64, size: u64) -> bool {
        !self.parked_in(va, size).is_empty()
    }

    /// Parked handles overlapping `[va, va+size)`: base addresses.
    pub(super) fn parked_in(&self, va: u64, size: u64) -> Vec<u64> {
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

    /// Dead bytes still held in partly released handles.
    pub fn stranded(&self) -> u64 {
        self.dirty.iter().map(|p| self.dead(*p)).sum()
    }

    /// Record the peaks of stranded bytes, and of stranded bytes with bytes grown ahead: where
    /// the program's giving back has ended (its next other call, a settle where memory is
    /// asked for, a query), not between the pages of a release loop (`empty_cache()` releases
    /// a handle's pages block by block: its first pages are released pages of a live handle
    /// only until its last ones go, in the same call).
    pub(super) fn note_stranded(&mut self) {
        let stranded = self.stranded();
        let beyond = stranded + self.ahead_bytes();
        self.stats.peak_stranded = self.stats.peak_stranded.max(stranded);
        self.stats.peak_beyond = self.stats.peak_beyond.max(beyond);
    }

    /// Record the peak of physical bytes behind the program's pages (also what bounds
    /// growing ahead).
    pub(super) fn note_held(&mut self) {
        let held = self.held_awake;
        debug_assert_eq!(held, self.awake_summed());
        self.peak_held = self.peak_held.max(held);
        self.stats.peak_held = self.stats.peak_held.max(held);
    }

    /// The stranded bytes now, as measured (a query from the program: its giving back has
    /// ended, or it asks meanwhile).
    pub fn stranded_now(&mut self) -> u64 {
        self.note_stranded();
        if log::log_enabled!(log::Level::Debug) {
            for pid in &self.dirty {
                let ph = &self.phys[pid];
                let pages: Vec<(u64, u64, bool)> = ph
                    .slots
                    .iter()
                    .map(|(o, v)| (o >> 20, self.pages[v].size >> 20, self.pages[v].single))
                    .collect();
                log::debug!(
                    "device {}: stranded {} MiB in a handle of {} MiB at {:?} (ahead {} MiB); pages (MiB offset, MiB, shared): {pages:?}",
                    self.drv.device(),
                    self.dead(*pid) >> 20,
                    ph.size >> 20,
                    ph.base,
                    ph.ahead >> 20
                );
            }
        }
        self.stranded()
    }

    /// The numbers of the phys `keep` takes, in creation order (the map's own order is its
    /// buckets').
    pub(super) fn pids(&self, keep: impl Fn(u64, &Phys) -> bool) -> Vec<u64> {
        let mut pids: Vec<u64> = self
            .phys
            .iter()
            .filter(|(pid, p)| keep(**pid, p))
            .map(|(pid, _)| *pid)
            .collect();
        pids.sort_unstable();
        pids
    }

    /// Whether the program has a page of `pid` mapped: moving it could meet another
    /// thread's work.
    pub(super) fn has_mapped_page(&self, pid: u64) -> bool {
        let ph = &self.phys[&pid];
        debug_assert_eq!(
            ph.mapped as usize,
            ph.slots
                .values()
                .filter(|v| self.pages[v].va.is_some())
                .count()
        );
        ph.mapped > 0
    }

    /// Physical bytes held: handles behind pages and handles kept for reuse.
    pub fn physical_bytes(&self) -> u64 {
        debug_assert_eq!(self.held_awake, self.awake_summed());
        self.held_awake + self.kept_bytes + self.unreleased_bytes()
    }

    /// The sizes of the phys not paused, summed over them (what `held_awake` must be).
    fn awake_summed(&self) -> u64 {
        let awake = self.phys.values().filter(|p| p.asleep.is_none());
        awake.map(|p| p.size).sum()
    }

    /// Phys `pid` leaves the books: it, if it was there.
    pub(super) fn remove_phys(&mut self, pid: u64) -> Option<Phys> {
        let ph = self.phys.remove(&pid)?;
        if ph.asleep.is_none() {
            self.held_awake -= ph.size;
        }
        self.ahead_total -= ph.ahead;
        Some(ph)
    }

    /// Phys `pid`'s bytes grown ahead become `ahead` (their total with them): the bytes it had.
    pub(super) fn set_ahead(&mut self, pid: u64, ahead: u64) -> u64 {
        let ph = self.phys.get_mut(&pid).unwrap();
        let was = std::mem::replace(&mut ph.ahead, ahead);
        self.ahead_total = self.ahead_total - was + ahead;
        was
    }

    /// Physical bytes held beyond what the program's pages use: kept handles, released pages
    /// still inside partly live handles, bytes grown ahead, handles the driver would not take
    /// back yet.
    pub fn held_beyond_live(&self) -> u64 {
        self.kept_bytes + self.stranded() + self.ahead_bytes() + self.unreleased_bytes()
    }

    /// Bytes grown ahead of the program's pages, not yet used.
    pub fn ahead_bytes(&self) -> u64 {
        debug_assert_eq!(
            self.ahead_total,
            self.phys.values().map(|p| p.ahead).sum::<u64>()
        );
        self.ahead_total
    }

    /// Whether memory grown ahead waits for the end of the program's giving back (its next
    /// call other than an unmap or a release: [`Coalescer::giving_back_ended`]).
    pub fn giving_back(&self) -> bool {
        self.giving_back && self.ahead_bytes() > 0
    }

    /// Whether released pages wait for the end of the program's release loop (a settle at
    /// its next call: [`Coalescer::settle`]).
    pub fn settle_deferred(&self) -> bool {
        self.deferred.is_some()
    }

    /// Bytes of handles the driver would not take back yet.
    pub(super) fn unreleased_bytes(&self) -> u64 {
        self.unreleased.iter().map(|(_, s)| s).sum()
    }

    /// Bytes of a phys that are neither a page's nor grown ahead: released pages.
    pub(super) fn dead(&self, pid: u64) -> u64 {
        let p = &self.phys[&pid];
        p.size - p.slots.live() - p.ahead
    }

    /// Whether the program has a page of ours mapped in `[va, va+size)`.
    /// (or a handle of ours is parked there: the driver's mapping is ours, not the program's).
    pub fn maps_in(&self, va: u64, size: u64) -> bool {
        self.maps.range(va..end(va, size)).next().is_some() || self.ours_in_range(va, size)
    }

    /// Whether a handle of ours is mapped in `[va, va+size)`: a parked one, or one behind
    /// pages (some perhaps already unmapped by the program, not yet released).
    pub(super) fn ours_in_range(&self, va: u64, size: u64) -> bool {
        self.parked_in_range(va, size) || !self.phys_in(va, size).is_empty()
    }

    /// Mapped phys overlapping `[va, va+size)`, by address (mappings never overlap).
    pub(super) fn phys_in(&self, va: u64, size: u64) -> Vec<u64> {
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
    pub(super) fn none_of_the_programs(&self, va: u64, size: u64) -> DrvResult<bool> {
        match self.ours_in_range(va, size) {
            false => Ok(false),
            true => Err(INVALID),
        }
    }

    /// Whether the calls that follow run on the device's allocator thread (may move live
    /// pages they were not asked to move), until the next change. True when made.
    pub fn allow_moves(&mut self, on: bool) {
        self.moves_allowed = on;
    }

    /// Whether the calls under way may move live pages ([`Coalescer::allow_moves`]).
    pub fn moves_allowed(&self) -> bool {
        self.moves_allowed
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

    /// What a range or pointer query at `ptr` should see: the program's page there, or an
    /// address where only a handle of expseg's is mapped (memory grown ahead, released pages
    /// not given back yet, a parked handle), which natively has no mapping. None: nothing of
    /// ours (the driver answers).
    pub fn query(&self, ptr: u64) -> Option<Seen> {
        let reservation = self
            .reservations
            .range(..=ptr)
            .next_back()
            .filter(|(va, size)| ptr < end(**va, **size))
            .map(|(va, size)| (*va, *size));
        match self.range_of(ptr) {
            Some(page) => Some(Seen::Page { page, reservation }),
            None if self.ours_in_range(ptr, 1) => Some(Seen::Hidden { reservation }),
            None => None,
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

    /// A program call on `[va, va+size)`: `call` on the pages the program mapped there
    /// ((address, page), in address order, listed in the books' scratch list), or, where it
    /// mapped none, [`none_of_the_programs`](Self::none_of_the_programs).
    pub(super) fn on_mapped_in(
        &mut self,
        va: u64,
        size: u64,
        call: impl FnOnce(&mut Self, &[(u64, u64)]) -> DrvResult<bool>,
    ) -> DrvResult<bool> {
        let mut inside = std::mem::take(&mut self.scratch);
        inside.clear();
        inside.extend(self.maps.range(va..end(va, size)).map(|(a, v)| (*a, *v)));
        let r = match inside.is_empty() {
            true => self.none_of_the_programs(va, size),
            false => call(self, &inside),
        };
        self.scratch = inside;
        r
    }

    pub(super) fn add_phys(
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
        self.held_awake += size;
        self.phys.insert(
            pid,
            Phys {
                handle,
                size,
                base,
                slots: Slots::default(),
                access,
                granted,
                ahead: 0,
                asleep: None,
                blank: false,
                mapped: 0,
            },
        );
        self.stats.phys_created += 1;
        pid
    }

    /// A page gets memory at `off` of `pid` (a pending page's bytes are pending no more).
    pub(super) fn attach(&mut self, vh: u64, pid: u64, off: u64) {
        let p = &self.pages[&vh];
        if p.slot.is_none() && p.refs > 0 {
            self.pending_bytes -= p.size;
        }
        self.attach_moved(vh, pid, off);
    }

    pub(super) fn same_reservation(&self, a: u64, end: u64) -> bool {
        self.reservations
            .range(..=a)
            .next_back()
            .is_some_and(|(s, l)| end <= s + l)
    }

    /// A page moves from one phys to another (no pending accounting involved).
    pub(super) fn attach_moved(&mut self, vh: u64, pid: u64, off: u64) {
        let p = self.pages.get_mut(&vh).unwrap();
        p.slot = Some((pid, off));
        let (size, mapped) = (p.size, p.va.is_some());
        let ph = self.phys.get_mut(&pid).unwrap();
        ph.slots.insert(off, vh, size);
        ph.mapped += u32::from(mapped);
    }

    /// Take page `vh` out of its phys's slots (its `slot` is left to the caller).
    pub(super) fn unslot(&mut self, vh: u64) {
        let p = &self.pages[&vh];
        let Some((pid, off)) = p.slot else { return };
        let mapped = p.va.is_some();
        let ph = self.phys.get_mut(&pid).unwrap();
        ph.slots.remove(&off);
        ph.mapped -= u32::from(mapped);
    }

    /// The program mapped (`true`) or unmapped page `vh`: its phys's count of mapped pages.
    pub(super) fn note_mapped(&mut self, vh: u64, mapped: bool) {
        let Some((pid, _)) = self.pages[&vh].slot else {
            return;
        };
        let ph = self.phys.get_mut(&pid).unwrap();
        match mapped {
            true => ph.mapped += 1,
            false => ph.mapped -= 1,
        }
    }
}
