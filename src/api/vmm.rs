//! Policy of the VMM calls expseg hands to PyTorch's expandable segments through the
//! runtime's driver entry points: coalesced pages (`crate::coalesce`), one coalescer per
//! device, under a lock of their own (a compaction waits for the device; `cudaMalloc` never
//! waits for it). The coalescers and their lock are kept in `state::coalescers`.

pub use super::state::coalescers::{report_rows, stats};

use super::allocator;
use super::state::coalescers::{books, in_context, lock, started};
use super::trace::record;
use crate::coalesce::trace::{Call, Outcome};
use crate::coalesce::{is_virtual, Coalescer};
use crate::gpu::{ChunkHandle, Driver as _, DrvError, PageProps};
use crate::stats::{time_vmm, VMM_ACCESS, VMM_CREATE, VMM_MAP, VMM_RELEASE, VMM_UNMAP};

/// Register a read of another allocator's memory (an IPC mirror refresh) while no coalescer
/// call is running.
pub fn begin_read(base: u64, size: u64) -> super::reads::Reading {
    if !started() {
        return super::reads::begin(base, size);
    }
    let _g = books();
    super::reads::begin(base, size)
}

/// The program's run of coalesced pages from an address: its start and the pages' sizes (None:
/// no coalesced page there).
pub type Run = Option<(u64, Vec<u64>)>;

/// A registered read of `[base, base+size)` (an IPC export or a mirror's copy of a run of
/// another allocator's pages), and the program's run from `base` as the coalescers see it
/// then (`Coalescer::program_run`, at most `max` pages; None where no coalesced page lies at
/// `base`: the driver's mappings are the program's, and the caller asks the driver). None
/// instead of a read where a page of the range is parked by a coalescer (released by the
/// program, kept mapped by expseg): the run is gone. Checked under the coalescers' lock once
/// the read is registered, so no coalescer call can unmap, reuse or give back a handle of
/// the range between the check and the end of the read (the lock's own wait for reads is not
/// taken: this thread's read would be one).
pub fn begin_read_run(base: u64, size: u64, max: usize) -> Option<(super::reads::Reading, Run)> {
    if !started() {
        return Some((super::reads::begin(base, size), None));
    }
    let mut g = books();
    let reading = super::reads::begin(base, size);
    if g.all().any(|c| c.parked_in_range(base, size)) {
        return None;
    }
    let run = g.all().find_map(|c| c.program_run(base, max));
    Some((reading, run))
}

/// A registered read of page `vh` at `va` (`size` bytes: an export's copy of it), where the
/// page is still mapped there with its memory (not paused, not moved away): checked under the
/// coalescers' bare mutex once the read is registered (as [`begin_read_run`]), so no coalescer
/// call moves or pauses it until the read ends. None: not so.
pub fn begin_read_page(vh: u64, va: u64, size: u64) -> Option<super::reads::Reading> {
    if !started() {
        return None;
    }
    let mut g = books();
    let reading = super::reads::begin(va, size);
    let mapped = g.all().any(|c| c.page_mapped_at(vh, va));
    mapped.then_some(reading)
}

/// Before `cuMemExportToShareableHandle` of page `vh`: where it lies inside a larger handle
/// (`Coalescer::export_inside`; woken first if paused), its device, address, size and
/// properties. None: not a page of ours, or one a split would not move others for.
pub fn export_inside(vh: u64) -> Option<Result<(i32, u64, u64, PageProps), u32>> {
    if !is_virtual(vh) || !started() {
        return None;
    }
    let mut v = lock();
    if v.frozen_owns(vh) {
        return Some(Err(FROZEN_USED));
    }
    let c = v.owner(vh)?;
    let dev = c.driver().device();
    match in_context(c, |c| c.export_inside(vh)) {
        Ok(Some((va, size, props))) => Some(Ok((dev, va, size, props))),
        Ok(None) => None,
        Err(e) => Some(Err(e.0)),
    }
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

/// `cuMemCreate` of a page with coalescable properties on `dev`: `None` to pass through.
///
/// Every device a process uses is coalesced, each by a coalescer of its own (coalescing only
/// the first device faulted in the two-device stress on two GPUs: RESULTS.md).
pub fn create(dev: i32, size: u64, props: PageProps) -> Option<Result<u64, u32>> {
    if super::state::forked() {
        return None;
    }
    let props = PageProps {
        tag: super::sleep::current_tag(),
        ..props
    };
    allocator::call_on(dev);
    time_vmm(VMM_CREATE, || {
        let once = || {
            let mut v = lock();
            let c = v.devs.get_mut(usize::try_from(dev).ok()?)?.as_mut()?;
            let page = in_context(c, |c| c.create(size, props));
            record(c, Call::Create { size, props }, &page);
            let page = page.map_err(|e| e.0);
            if super::state::config().test_panic("coalescer") {
                panic!("EXPSEG_TEST_PANIC=coalescer: a page booked, the lock poisoned");
            }
            Some(page)
        };
        match once() {
            // Memory held for reuse elsewhere (other devices' caches here, other expseg
            // processes) must not cost this page its memory: one more try after making room.
            Some(Err(OUT_OF_MEMORY)) if super::trim::make_room(Some(dev)) => once(),
            r => r,
        }
    })
}

/// `CUDA_ERROR_OUT_OF_MEMORY`.
const OUT_OF_MEMORY: u32 = 2;

/// What a call on a page of a frozen coalescer answers (its books may be half-made,
/// `state::books_unsure`): giving the page up (release, unmap, address free) is done as far
/// as the program can tell, and its memory stays until exit; using it (map, export) fails
/// with `CUDA_ERROR_UNKNOWN`, as the panic's own call did.
const FROZEN_GIVEN_UP: u32 = 0;
const FROZEN_USED: u32 = 999;

pub fn release(vh: u64) -> Option<u32> {
    time_vmm(VMM_RELEASE, || {
        if !is_virtual(vh) || !started() {
            return None;
        }
        let mut v = lock();
        if v.frozen_owns(vh) {
            return Some(FROZEN_GIVEN_UP);
        }
        let c = v.owner(vh)?;
        allocator::call_on(c.driver().device());
        let r = in_context(c, |c| c.release(vh));
        record(c, Call::Release { vh }, &r);
        Some(code(r))
    })
}

pub fn map(va: u64, size: u64, offset: u64, vh: u64, flags: u64) -> Option<u32> {
    time_vmm(VMM_MAP, || {
        if !is_virtual(vh) || !started() {
            return None;
        }
        let mut v = lock();
        if v.frozen_owns(vh) {
            return Some(FROZEN_USED);
        }
        let c = v.owner(vh)?;
        allocator::call_on(c.driver().device());
        if flags != 0 || wraps(va, size) {
            return Some(crate::coalesce::INVALID.0);
        }
        let r = in_context(c, |c| c.map(va, size, offset, vh));
        let call = Call::Map {
            va,
            size,
            offset,
            vh,
        };
        record(c, call, &r);
        Some(code(r))
    })
}

/// Before the program maps a handle of its own at `[va, va+size)`: no ghost of ours there.
pub fn clear(va: u64, size: u64) {
    if !started() || wraps(va, size) {
        return;
    }
    for c in lock().all() {
        in_context(c, |c| c.clear_for_program(va, size));
        record(c, Call::Clear { va, size }, Outcome::DONE);
    }
}

pub fn unmap(va: u64, size: u64) -> Option<u32> {
    time_vmm(VMM_UNMAP, || {
        if !started() || wraps(va, size) {
            return None;
        }
        // Whose stream the caller waited on: its current primary context's device, asked (for
        // pages of ours only) before `in_context` makes the memory's device current; one
        // `cuCtxGetCurrent` where it is the memory's device's (the common case).
        let caller = std::cell::OnceCell::new();
        let mut v = lock();
        if v.frozen_maps_in(va, size) {
            return Some(FROZEN_GIVEN_UP);
        }
        let mut answer = None;
        for c in v.all().filter(|c| c.maps_in(va, size)) {
            let dev = c.driver().device();
            allocator::call_on(dev);
            let who = *caller.get_or_init(|| {
                let t = crate::real::driver().ok()?;
                crate::gpu::cuda::primary_device_likely(t, dev)
            });
            let r = in_context(c, |c| c.unmap_from(va, size, who));
            let call = Call::Unmap {
                va,
                size,
                caller: who,
            };
            record(c, call, &r);
            match r {
                Ok(false) => continue,
                Ok(true) => answer = Some(0),
                Err(e) => answer = Some(e.0),
            }
            break;
        }
        drop(v);
        if answer == Some(0) {
            // Handles given out for runs that started here stand for nothing any more.
            super::state::forget_foreign_range(va, size);
        }
        answer
    })
}

pub fn set_access(va: u64, size: u64, descs: &[(i32, u32)]) -> Option<u32> {
    time_vmm(VMM_ACCESS, || {
        if !started() || wraps(va, size) {
            return None;
        }
        let once = || {
            let mut v = lock();
            for c in v.all().filter(|c| c.maps_in(va, size)) {
                let dev = c.driver().device();
                // PyTorch grants a new peer access to a device's segments from whichever
                // thread first copies between the two (under the other device's guard): that
                // thread is not this device's allocator.
                // (Asked only when the thread changes: the driver is not asked on every call.)
                if !allocator::may_move(dev) {
                    let caller = crate::real::driver()
                        .ok()
                        .and_then(crate::gpu::cuda::primary_device);
                    if caller.is_none_or(|d| d == dev) {
                        allocator::call_on(dev);
                    }
                }
                let r = in_context(c, |c| c.set_access(va, size, descs));
                let call = Call::SetAccess {
                    va,
                    size,
                    descs: descs.into(),
                };
                record(c, call, &r);
                match r {
                    Ok(false) => continue,
                    Ok(true) => return Some((0, dev)),
                    Err(e) => return Some((e.0, dev)),
                }
            }
            None
        };
        match once() {
            // Admitted pages whose memory another process took meanwhile: room made, once more
            // (pages already backed keep their memory).
            Some((OUT_OF_MEMORY, dev)) if super::trim::make_room(Some(dev)) => once().map(|r| r.0),
            r => r.map(|r| r.0),
        }
    })
}

/// `cuMemExportToShareableHandle` of a page: the real handle to export.
pub fn export(vh: u64) -> Option<Result<ChunkHandle, u32>> {
    on_page(vh, Call::Export { vh }, |c| c.export(vh), |h| *h)
}

/// `cuMulticastBindMem` of a page: the real handle and the page's offset in it (nothing moves).
pub fn bind_handle(vh: u64) -> Option<Result<(ChunkHandle, u64), u32>> {
    on_page(vh, Call::Bind { vh }, |c| c.bind_handle(vh), |(h, _)| *h)
}

/// A call on page handle `vh` by its coalescer (`None`: not a page of ours), recorded with the
/// handle `handle` takes from its answer.
fn on_page<T>(
    vh: u64,
    call: Call<'_>,
    f: impl FnOnce(&mut Coalescer<crate::gpu::cuda::CudaDriver>) -> crate::gpu::DrvResult<T>,
    handle: impl Fn(&T) -> ChunkHandle,
) -> Option<Result<T, u32>> {
    if !is_virtual(vh) || !started() {
        return None;
    }
    let mut v = lock();
    if v.frozen_owns(vh) {
        return Some(Err(FROZEN_USED));
    }
    let c = v.owner(vh)?;
    let r = in_context(c, f);
    record(c, call, &r.as_ref().map(&handle).map_err(|e| *e));
    Some(r.map_err(|e| e.0))
}

/// Before the memory of the program's run starting at `ptr` is shared with another process:
/// the handles behind it are awake and never move again; nothing moves now
/// (`Coalescer::share_run`). Only the device of `ptr`'s memory is touched (the run never
/// leaves it): another device's paused pages stay paused and its handles stay where they are.
pub fn share_run(ptr: u64) -> Result<(), u32> {
    isolate(
        ptr,
        |c, p| c.share_run(p, crate::ipc::transport::MAX_CHUNKS),
        Call::ShareRun { ptr },
    )
}

/// The handle behind `ptr`'s page alone gets a handle of its own that never moves (a caller
/// that retains that page's handle): a coalesced handle is split, its live pages moved.
pub fn isolate_page(ptr: u64) -> Result<(), u32> {
    isolate(ptr, Coalescer::isolate_page, Call::IsolatePage { ptr })
}

/// The program's run of pages from `ptr`'s, as the driver would report it natively (one
/// mapping a page): `(start, sizes, device)`. None: no coalesced page at `ptr` (the driver's
/// own mappings are the program's). Never under a registered read (the lock waits for reads).
pub fn program_run(ptr: u64, max: usize) -> Option<(u64, Vec<u64>, i32)> {
    if !started() {
        return None;
    }
    lock().all().find_map(|c| {
        c.program_run(ptr, max)
            .map(|(b, s)| (b, s, c.driver().device()))
    })
}

fn isolate(
    ptr: u64,
    how: impl FnOnce(&mut Coalescer<crate::gpu::cuda::CudaDriver>, u64) -> crate::gpu::DrvResult<()>,
    call: Call<'_>,
) -> Result<(), u32> {
    if !started() {
        return Ok(());
    }
    // Found by the books, not the driver: a paused page has no mapping the driver could name.
    let mut v = lock();
    let Some(c) = v.all().find(|c| c.range_of(ptr).is_some()) else {
        return Ok(());
    };
    let r = in_context(c, |c| how(c, ptr));
    record(c, call, &r);
    r.map_err(|e| e.0)
}

/// What a range query at `ptr` sees, as it would without coalescing: the mapping the program
/// made there (one `cuMemMap`, PyTorch's page, not the larger handle mapped behind a run of
/// pages) and its reservation, or an address where only expseg's memory is mapped. `None`:
/// nothing of the coalescers', ask the driver.
pub fn program_mapping(ptr: u64) -> Option<crate::coalesce::Seen> {
    if !started() {
        return None;
    }
    lock().all().find_map(|c| c.query(ptr))
}

/// `cuMemRetainAllocationHandle`: Some(Ok(page handle)), Some(Err(code)) where only a handle
/// of expseg's is mapped, None to pass through.
pub fn retain(ptr: u64) -> Option<Result<u64, u32>> {
    if !started() {
        return None;
    }
    lock().all().find_map(|c| {
        let r = c.retain(ptr);
        record(c, Call::Retain { ptr }, &r);
        r.map_err(|e| e.0).transpose()
    })
}

pub fn props_of(vh: u64) -> Option<(i32, PageProps)> {
    if !is_virtual(vh) || !started() {
        return None;
    }
    let mut v = lock();
    let c = v.owner(vh)?;
    let dev = c.driver().device();
    c.props_of(vh).map(|(_, p)| (dev, p))
}

/// `cuMemAddressReserve` succeeded.
pub fn reserved(va: u64, size: u64) {
    // Not `started()`: reservations made before the first page count too. A forked child's
    // are not ours to know.
    if super::state::forked() {
        return;
    }
    for c in lock().all() {
        c.reserved(va, size);
        record(c, Call::Reserved { va, size }, Outcome::DONE);
    }
}

/// `cuMemAddressFree` is about to run: `Some(code)` if it must fail.
pub fn address_free(va: u64, size: u64) -> Option<u32> {
    if !started() || wraps(va, size) {
        return None;
    }
    let mut v = lock();
    if v.frozen_maps_in(va, size) {
        return Some(FROZEN_GIVEN_UP);
    }
    for c in v.all() {
        let r = in_context(c, |c| c.address_free(va, size));
        record(c, Call::AddressFree { va, size }, &r);
        if let Err(e) = r {
            return Some(e.0);
        }
    }
    None
}

/// At `cudaMemGetInfo`: what the program is told is free should be free. Compact what the
/// bound asks for and give kept handles back. On each device whose allocator's thread this
/// is not (a monitor's, or another device's allocator, while that thread may be launching
/// work): only what goes back without moving a live page, the rest at its next call.
pub fn settle() {
    if !started() {
        return;
    }
    for c in lock().all() {
        let inside = allocator::may_move(c.driver().device());
        in_context(c, |c| match inside {
            true => {
                c.drop_ahead();
                record(c, Call::DropAhead, Outcome::DONE);
                c.settle(false);
                record(c, Call::Settle { force: false }, Outcome::DONE);
                c.release_kept();
                record(c, Call::ReleaseKept, Outcome::DONE);
            }
            false => {
                let n = c.trim_unmoved();
                record(c, Call::TrimUnmoved, n);
            }
        });
    }
    // The other expseg processes on the GPU keep what they released too (`api::keep`): what
    // they keep is free for this program as well, so it is asked back first.
    if super::keep::any_keeping() {
        super::trim::peers_give_back();
    }
}
