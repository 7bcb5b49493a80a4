//! Policy of the VMM calls expseg hands to PyTorch's expandable segments through the
//! runtime's driver entry points: coalesced pages (`crate::coalesce`), one coalescer per
//! device, under a lock of their own (a compaction waits for the device; `cudaMalloc` never
//! waits for it).

use super::config;
use crate::coalesce::{is_virtual, CoalesceConfig, CoalesceStats, Coalescer};
use crate::gpu::cuda::{self, CudaDriver};
use crate::gpu::{ChunkHandle, DrvError, Op, PageProps};
use crate::real;
use once_cell::sync::{Lazy, OnceCell};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

struct Vmm {
    devs: Vec<Option<Coalescer<CudaDriver>>>,
}

static VMM: Lazy<Mutex<Vmm>> = Lazy::new(|| {
    let devs = match real::driver() {
        Ok(t) => {
            let n = cuda::device_count(t).unwrap_or(0);
            let c = config();
            // Without the thread that gives kept handles back, nothing would after the delay:
            // release at once instead.
            let threaded = n > 0 && start_releaser();
            let cfg = CoalesceConfig {
                max_handle: c.coalesce_max,
                strand_max: c.strand_max,
                margin: c.coalesce_margin,
                release_delay: match threaded {
                    true => Duration::from_millis(c.release_delay_ms),
                    false => Duration::ZERO,
                },
            };
            (0..n)
                .map(|d| match CudaDriver::open(t, d) {
                    Ok(drv) => Some(Coalescer::new(drv, cfg)),
                    Err(why) => {
                        log::warn!("{why}; its expandable segments are not coalesced");
                        None
                    }
                })
                .collect()
        }
        Err(_) => Vec::new(),
    };
    STARTED.store(true, Ordering::Release);
    Mutex::new(Vmm { devs })
});

/// Set once the coalescers exist (before that no handle or address can be theirs).
static STARTED: AtomicBool = AtomicBool::new(false);

/// The coalescers, once no IPC mirror refresh is reading memory (any call may unmap pages it
/// moves: `super::reads`). A refresh registers under this lock, so none starts meanwhile.
fn lock() -> MutexGuard<'static, Vmm> {
    let g = VMM.lock().unwrap_or_else(|e| e.into_inner());
    super::reads::wait_none();
    g
}

/// Register a read of another allocator's memory (an IPC mirror refresh) while no coalescer
/// call is running.
pub fn begin_read(base: u64, size: u64) -> super::reads::Reading {
    if !started() {
        return super::reads::begin(base, size);
    }
    let _g = VMM.lock().unwrap_or_else(|e| e.into_inner());
    super::reads::begin(base, size)
}

fn started() -> bool {
    STARTED.load(Ordering::Acquire)
}

impl Vmm {
    fn all(&mut self) -> impl Iterator<Item = &mut Coalescer<CudaDriver>> {
        self.devs.iter_mut().flatten()
    }

    fn owner(&mut self, vh: u64) -> Option<&mut Coalescer<CudaDriver>> {
        self.all().find(|c| c.owns(vh))
    }
}

/// Run `f` on `c` with its device's primary context current on the calling thread (pushed
/// for the call and popped after when another context is current): expseg's driver calls for
/// device d are made in d's context, as PyTorch's own calls for d are made under its device
/// guard, whatever device the thread is on when PyTorch empties every device's cache, the
/// program asks another device's free memory, or the releaser thread wakes. A coalescer that
/// holds nothing makes no driver call: its context is left alone.
fn in_context<T>(
    c: &mut Coalescer<CudaDriver>,
    f: impl FnOnce(&mut Coalescer<CudaDriver>) -> T,
) -> T {
    use crate::gpu::Driver as _;
    let r = match real::driver() {
        Ok(t) if c.holds_anything() => {
            let dev = c.driver().device();
            cuda::with_primary(t, dev, || f(c))
        }
        _ => f(c),
    };
    if c.kept_bytes() > 0 {
        wake_releaser();
    }
    r
}

/// A range past the end of the address space: nothing of expseg's is there (the driver
/// answers it).
fn wraps(va: u64, size: u64) -> bool {
    va.checked_add(size).is_none()
}

/// A driver result as the C code.
fn code(r: Result<(), DrvError>) -> u32 {
    match r {
        Ok(()) => 0,
        Err(e) => e.0,
    }
}

/// The first device whose pages were coalesced (-1: none yet).
static FIRST_DEVICE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// `cuMemCreate` of a page with coalescable properties on `dev`: `None` to pass through.
///
/// Only the first device a process creates pages on is coalesced; the pages of any other
/// device pass through to the driver. A process that used two GPUs at once hit an illegal
/// address under coalescing on 2 x H200 (2026-11-23; the same stress passes with coalescing
/// off and, on one GPU, with it on), cause not found yet: one process per GPU (torchrun, Ray
/// workers) is what is served.
pub fn create(dev: i32, size: u64, props: PageProps) -> Option<Result<u64, u32>> {
    let first = match FIRST_DEVICE.compare_exchange(-1, dev, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => dev,
        Err(d) => d,
    };
    if first != dev && !config().test_all_devices {
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            log::info!("device {dev}: pages pass through (only device {first}'s are coalesced in a process)");
        }
        return None;
    }
    let mut v = lock();
    let c = v.devs.get_mut(usize::try_from(dev).ok()?)?.as_mut()?;
    Some(in_context(c, |c| c.create(size, props)).map_err(|e| e.0))
}

pub fn release(vh: u64) -> Option<u32> {
    if !is_virtual(vh) || !started() {
        return None;
    }
    let mut v = lock();
    let c = v.owner(vh)?;
    Some(code(in_context(c, |c| c.release(vh))))
}

pub fn map(va: u64, size: u64, offset: u64, vh: u64, flags: u64) -> Option<u32> {
    if !is_virtual(vh) || !started() {
        return None;
    }
    let mut v = lock();
    let c = v.owner(vh)?;
    if flags != 0 || wraps(va, size) {
        return Some(crate::coalesce::INVALID.0);
    }
    Some(code(in_context(c, |c| c.map(va, size, offset, vh))))
}

/// Before the program maps a handle of its own at `[va, va+size)`: no ghost of ours there.
pub fn clear(va: u64, size: u64) {
    if !started() || wraps(va, size) {
        return;
    }
    for c in lock().all() {
        in_context(c, |c| c.clear_for_program(va, size));
    }
}

pub fn unmap(va: u64, size: u64) -> Option<u32> {
    if !started() || wraps(va, size) {
        return None;
    }
    let mut v = lock();
    let mut answer = None;
    for c in v.all().filter(|c| c.maps_in(va, size)) {
        match in_context(c, |c| c.unmap(va, size)) {
            Ok(false) => continue,
            Ok(true) => answer = Some(0),
            Err(e) => answer = Some(e.0),
        }
        break;
    }
    drop(v);
    if answer == Some(0) {
        // Handles given out for runs that started here stand for nothing any more.
        super::forget_foreign_range(va, size);
    }
    answer
}

pub fn set_access(va: u64, size: u64, descs: &[(i32, u32)]) -> Option<u32> {
    if !started() || wraps(va, size) {
        return None;
    }
    let mut v = lock();
    for c in v.all().filter(|c| c.maps_in(va, size)) {
        match in_context(c, |c| c.set_access(va, size, descs)) {
            Ok(false) => continue,
            Ok(true) => return Some(0),
            Err(e) => return Some(e.0),
        }
    }
    None
}

/// Whether a handle expseg parked (released pages' memory, kept mapped for reuse) lies in
/// `[va, va+size)`: such a mapping is not the program's, whatever the driver says.
pub fn parked_in(va: u64, size: u64) -> bool {
    if !started() {
        return false;
    }
    lock().all().any(|c| c.parked_in_range(va, size))
}

/// `cuMemExportToShareableHandle` of a page: the real handle to export.
pub fn export(vh: u64) -> Option<Result<ChunkHandle, u32>> {
    if !is_virtual(vh) || !started() {
        return None;
    }
    let mut v = lock();
    let c = v.owner(vh)?;
    Some(in_context(c, |c| c.export(vh)).map_err(|e| e.0))
}

/// Before the memory of the run starting at `ptr` is shared with another process: page-sized
/// handles that never move.
pub fn isolate_run(ptr: u64) {
    if !started() {
        return;
    }
    for c in lock().all() {
        if let Err(e) = in_context(c, |c| c.isolate_run(ptr)) {
            log::warn!("splitting coalesced pages before sharing failed ({e}); a consumer may see memory that later moves");
        }
    }
}

/// `cuMemRetainAllocationHandle`: Some(Ok(page handle)), Some(Err(code)) where only a handle
/// of expseg's is mapped, None to pass through.
pub fn retain(ptr: u64) -> Option<Result<u64, u32>> {
    if !started() {
        return None;
    }
    lock()
        .all()
        .find_map(|c| c.retain(ptr).map_err(|e| e.0).transpose())
}

pub fn props_of(vh: u64) -> Option<(i32, PageProps)> {
    if !is_virtual(vh) || !started() {
        return None;
    }
    let mut v = lock();
    let c = v.owner(vh)?;
    use crate::gpu::Driver as _;
    let dev = c.driver().device();
    c.props_of(vh).map(|(_, p)| (dev, p))
}

/// `cuMemAddressReserve` succeeded.
pub fn reserved(va: u64, size: u64) {
    for c in lock().all() {
        c.reserved(va, size);
    }
}

/// `cuMemAddressFree` is about to run: `Some(code)` if it must fail.
pub fn address_free(va: u64, size: u64) -> Option<u32> {
    if !started() || wraps(va, size) {
        return None;
    }
    for c in lock().all() {
        if let Err(e) = in_context(c, |c| c.address_free(va, size)) {
            return Some(e.0);
        }
    }
    None
}

/// At `cudaMemGetInfo`: what the program is told is free should be free. Compact what the
/// bound asks for and give kept handles back.
pub fn settle() {
    if !started() {
        return;
    }
    for c in lock().all() {
        in_context(c, |c| {
            c.settle(false);
            c.release_kept();
        });
    }
}

/// Another allocation of this process (a direct `cuMemCreate`, `cudaMalloc`) found no memory:
/// give kept handles back. True if there were any (worth asking the driver again).
pub fn release_kept_for_others() -> bool {
    if !started() {
        return false;
    }
    let mut any = false;
    for c in lock().all() {
        if c.kept_bytes() > 0 {
            in_context(c, |c| c.release_kept());
            any = true;
        }
    }
    any
}

/// The releaser thread, once spawned.
static RELEASER: OnceCell<std::thread::Thread> = OnceCell::new();

/// A coalescer keeps handles: the releaser checks every millisecond until none are kept.
fn wake_releaser() {
    if let Some(t) = RELEASER.get() {
        t.unpark();
    }
}

/// Kept handles go back to the driver once the program has been quiet for the delay: a
/// thread of its own checks every millisecond while any are kept and sleeps while none are
/// (woken by the call that keeps one; started at the first coalescer; never in a forked
/// child). False if there is none (no delay, or no thread).
fn start_releaser() -> bool {
    let delay = Duration::from_millis(config().release_delay_ms);
    if delay.is_zero() {
        return false;
    }
    let spawned = std::thread::Builder::new()
        .name("expseg-release".into())
        .spawn(move || loop {
            if super::forked() {
                return;
            }
            let mut any = false;
            for c in lock().all() {
                if c.kept_bytes() > 0 && c.idle_for() >= delay {
                    in_context(c, |c| c.release_kept());
                }
                any |= c.kept_bytes() > 0;
            }
            match any {
                true => std::thread::sleep(Duration::from_millis(1)),
                // A wake-up given meanwhile makes park return at once.
                false => std::thread::park(),
            }
        });
    match spawned {
        Ok(t) => {
            let _ = RELEASER.set(t.thread().clone());
            true
        }
        Err(e) => {
            log::warn!("no thread to give kept handles back ({e}); releasing at once instead");
            false
        }
    }
}

/// Per device: counters, pages held, physical handles, stranded bytes, driver calls.
#[allow(clippy::type_complexity)]
pub fn stats() -> Vec<(i32, CoalesceStats, usize, usize, u64, Vec<(u64, u64)>)> {
    if !started() {
        return Vec::new();
    }
    use crate::gpu::Driver as _;
    let mut v = match VMM.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(_) => return Vec::new(),
    };
    v.all()
        .map(|c| {
            let (pages, phys) = c.counts();
            (
                c.driver().device(),
                c.stats().clone(),
                pages,
                phys,
                c.stranded(),
                c.driver_calls().to_vec(),
            )
        })
        .collect()
}

/// The coalescers' figures for the exit report, summed over devices.
pub fn report_rows() -> Vec<(&'static str, u64)> {
    let all = stats();
    if all.is_empty() {
        return Vec::new();
    }
    let sum = |f: &dyn Fn(&CoalesceStats) -> u64| all.iter().map(|(_, s, ..)| f(s)).sum::<u64>();
    let mut rows = vec![
        ("coalesce_pages_created", sum(&|s| s.pages_created)),
        ("coalesce_handles_created", sum(&|s| s.phys_created)),
        ("coalesce_handles_released", sum(&|s| s.phys_released)),
        ("coalesce_exact_creates", sum(&|s| s.exact_creates)),
        ("coalesce_compactions", sum(&|s| s.compactions)),
        ("coalesce_compacted_bytes", sum(&|s| s.compacted_bytes)),
        ("coalesce_host_copies", sum(&|s| s.host_copies)),
        (
            "coalesce_compaction_failures",
            sum(&|s| s.compaction_failures),
        ),
        ("coalesce_access_fallbacks", sum(&|s| s.access_fallbacks)),
        ("coalesce_exports_split", sum(&|s| s.exports_split)),
        ("coalesce_peak_stranded_bytes", sum(&|s| s.peak_stranded)),
        ("coalesce_reused_bytes", sum(&|s| s.reused_bytes)),
        ("coalesce_kept_released", sum(&|s| s.kept_released)),
        (
            "coalesce_reused_in_place_bytes",
            sum(&|s| s.reused_in_place),
        ),
        ("coalesce_access_skipped", sum(&|s| s.access_skipped)),
        ("coalesce_meminfo_skipped", sum(&|s| s.meminfo_skipped)),
        ("coalesce_pages_live", all.iter().map(|a| a.2 as u64).sum()),
        (
            "coalesce_handles_live",
            all.iter().map(|a| a.3 as u64).sum(),
        ),
        ("coalesce_stranded_bytes", all.iter().map(|a| a.4).sum()),
    ];
    // Driver time of the coalescers, per operation that was called.
    const NAMES: [&str; Op::ALL.len() + 1] = [
        "coalesce_create",
        "coalesce_release",
        "coalesce_reserve",
        "coalesce_free_va",
        "coalesce_map",
        "coalesce_unmap",
        "coalesce_set_access",
        "coalesce_legacy_alloc",
        "coalesce_legacy_free",
        "coalesce_copy",
        "coalesce_ipc_handle",
        "coalesce_sync",
        "coalesce_meminfo",
    ];
    const NS: [&str; Op::ALL.len() + 1] = [
        "coalesce_create_ns",
        "coalesce_release_ns",
        "coalesce_reserve_ns",
        "coalesce_free_va_ns",
        "coalesce_map_ns",
        "coalesce_unmap_ns",
        "coalesce_set_access_ns",
        "coalesce_legacy_alloc_ns",
        "coalesce_legacy_free_ns",
        "coalesce_copy_ns",
        "coalesce_ipc_handle_ns",
        "coalesce_sync_ns",
        "coalesce_meminfo_ns",
    ];
    for i in 0..NAMES.len() {
        let calls: u64 = all.iter().map(|a| a.5[i].0).sum();
        if calls > 0 {
            rows.push((NAMES[i], calls));
            rows.push((NS[i], all.iter().map(|a| a.5[i].1).sum()));
        }
    }
    rows
}
