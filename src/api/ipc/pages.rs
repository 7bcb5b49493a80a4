//! Exports through a copy: `cuMemExportToShareableHandle` of a page that lies inside a
//! coalesced handle, while the program has a non-blocking stream on that device, exports a
//! page-sized handle of expseg's holding a copy of the page, instead of splitting the handle.
//! A split moves the page's live neighbours, and only the legacy default stream's fence holds
//! the program's work during a move: a non-blocking stream's kernels are not held (holding
//! them by stream memory operations hangs once streams outnumber the hardware queues, and
//! PyTorch makes 128: docs/failed-approaches.md), so they could meet the pages mid-move.
//! Without non-blocking streams the fence holds every stream and the split stays (both ways,
//! as natively).
//!
//! The copy is made at each export of the page, again after each synchronize of the program's
//! and before each record of an event it shared (`current`, as mirrors of `cudaIpcGetMemHandle`
//! are), and its handle is released with the page (a consumer's import keeps its memory until
//! the consumer lets it go). A consumer reads what the producer ordered before signalling it;
//! what it writes stays in the copy (one warning says so at the first such export).

use crate::gpu::cuda::CudaDriver;
use crate::gpu::{stream, streams::STREAMS, ChunkHandle, Driver, DrvResult, PageProps};
use crate::stats::GLOBAL;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// A page-sized handle holding a copy of one of the program's pages, mapped where expseg
/// copies into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCopy {
    pub dev: i32,
    pub handle: ChunkHandle,
    /// Where the copy is mapped (a reservation of its own).
    pub va: u64,
    pub size: u64,
    /// The program's page: where it is mapped.
    pub src: u64,
}

/// The copies, by the program's page handle.
#[derive(Default)]
pub struct Copies {
    by_page: HashMap<u64, PageCopy>,
}

impl Copies {
    /// The copy of page `vh`, if one was made.
    pub fn get(&self, vh: u64) -> Option<PageCopy> {
        self.by_page.get(&vh).copied()
    }

    /// A handle for a copy of page `vh` (mapped at `src`, `size` bytes, made as `props`) on
    /// `d`'s device: made, mapped at a reservation of its own and readable and writable there
    /// by that device; not filled yet. On failure nothing is left behind.
    pub fn make<D: Driver>(
        &mut self,
        d: &mut D,
        vh: u64,
        src: u64,
        size: u64,
        props: PageProps,
    ) -> DrvResult<PageCopy> {
        let dev = d.device();
        let handle = d.create_as(size, props)?;
        let undo_handle = |d: &mut D| {
            if let Err(e) = d.release(handle) {
                log::warn!("releasing the copy's handle {handle:#x} failed ({e})");
            }
        };
        let va = match d.reserve(size) {
            Ok(va) => va,
            Err(e) => {
                undo_handle(d);
                return Err(e);
            }
        };
        let mapped = d.map(va, size, handle).and_then(|()| {
            d.set_access(va, size, &[dev], &[]).inspect_err(|_| {
                let _ = d.unmap(va, size);
            })
        });
        if let Err(e) = mapped {
            let _ = d.free_va(va, size);
            undo_handle(d);
            return Err(e);
        }
        let c = PageCopy {
            dev,
            handle,
            va,
            size,
            src,
        };
        self.by_page.insert(vh, c);
        Ok(c)
    }

    /// Page `vh` was released: its copy goes (unmapped, its reservation and handle given
    /// back; memory a consumer imported stays until the consumer lets it go). None: no copy.
    pub fn release<D: Driver>(&mut self, d: &mut D, vh: u64) -> Option<PageCopy> {
        let c = self.by_page.remove(&vh)?;
        let r = d
            .unmap(c.va, c.size)
            .and_then(|()| d.free_va(c.va, c.size))
            .and_then(|()| d.release(c.handle));
        if let Err(e) = r {
            log::warn!(
                "giving back the copy of the page at {:#x} failed ({e}); its memory stays",
                c.src
            );
        }
        Some(c)
    }

    /// The copy of page `vh`, now that the page is mapped at `src` (where it is copied from).
    pub fn moved_to(&mut self, vh: u64, src: u64) -> Option<PageCopy> {
        let c = self.by_page.get_mut(&vh)?;
        c.src = src;
        Some(*c)
    }

    /// The copies on device `dev`, with their pages.
    pub fn on_device(&self, dev: i32) -> Vec<(u64, PageCopy)> {
        self.by_page
            .iter()
            .filter(|(_, c)| c.dev == dev)
            .map(|(vh, c)| (*vh, *c))
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.by_page.is_empty()
    }
}

/// The process's copies and the drivers that made them, one a device.
struct Books {
    copies: Copies,
    drivers: HashMap<i32, CudaDriver>,
}

static BOOKS: Mutex<Option<Books>> = Mutex::new(None);

/// Whether a copy was ever made: until then the program's synchronizes cost one load more
/// (`current::sync_armed`).
pub(super) static MADE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The books (a poisoned lock still guards whole entries: each change is one insert or
/// remove after the driver's calls).
fn books() -> MutexGuard<'static, Option<Books>> {
    BOOKS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `CUDA_ERROR_NOT_INITIALIZED`, where there is no driver table.
const NO_DRIVER: u32 = 3;

/// Run `f` with `dev`'s primary context current (pushed and popped where another, or
/// none, was: `torch.multiprocessing` exports from its queue's feeder thread, which has no
/// context), in relaxed capture mode; a driver error as the code.
fn on_primary<T>(
    t: &'static crate::real::DriverTable,
    dev: i32,
    f: impl FnOnce() -> crate::gpu::DrvResult<T>,
) -> Result<T, u32> {
    let pushed = crate::real::primary::push_primary(t, dev)?;
    let r = stream::relaxed(t, f).map_err(|e| e.0);
    if pushed {
        crate::real::primary::pop_primary(t);
    }
    r
}

/// `cuMemExportToShareableHandle` of page `vh`: the handle to export where the page goes
/// through a copy (made, or filled again now); `None` where it does not (the page has a
/// handle of its own or no memory, or the program has no non-blocking stream on its
/// device: `api::vmm::export` splits it, the legacy stream's fence holding every stream).
pub fn export(vh: u64) -> Option<Result<ChunkHandle, u32>> {
    let (dev, src, size, props) = match crate::api::vmm::export_inside(vh)? {
        Ok(x) => x,
        Err(e) => return Some(Err(e)),
    };
    // Exported before: the same copy, its bytes made again (where the page is mapped now).
    // The books' lock is never held over a copy (it waits for the device).
    let known = books().as_mut().and_then(|b| b.copies.moved_to(vh, src));
    if let Some(c) = known {
        return Some(fill(vh, &c).map(|()| c.handle));
    }
    if !STREAMS.on_device(dev).iter().any(|s| s.non_blocking) {
        return None;
    }
    let t = match crate::real::driver() {
        Ok(t) => t,
        Err(_) => return Some(Err(NO_DRIVER)),
    };
    // Out of memory for the copy: what this process holds beyond its pages goes back (and
    // other expseg processes are asked), then once more.
    let mut made = make(t, vh, dev, src, size, props)?;
    if made == Err(OUT_OF_MEMORY) && crate::api::trim::make_room(Some(dev)) {
        made = make(t, vh, dev, src, size, props)?;
    }
    if made == Err(OUT_OF_MEMORY) {
        log::error!("no device memory for the copy an export of the page at {src:#x} ({size} bytes) goes through; the export fails with CUDA_ERROR_OUT_OF_MEMORY (a split would move live pages under the program's non-blocking streams)");
    }
    let (c, new) = match made {
        Ok(x) => x,
        Err(e) => return Some(Err(e)),
    };
    if !new {
        // Made by another thread's export of the same page meanwhile.
        return Some(fill(vh, &c).map(|()| c.handle));
    }
    GLOBAL.export_mirrors_made.add(1);
    GLOBAL.export_mirror_bytes.add(size);
    MADE.store(true, std::sync::atomic::Ordering::Release);
    said_once(src, size);
    Some(fill(vh, &c).map(|()| c.handle))
}

/// `CUDA_ERROR_OUT_OF_MEMORY`.
const OUT_OF_MEMORY: u32 = 2;

/// A copy's handle for page `vh` on `dev`, made in the device's primary context. None:
/// the device cannot be opened for one (a warning; the export splits instead).
fn make(
    t: &'static crate::real::DriverTable,
    vh: u64,
    dev: i32,
    src: u64,
    size: u64,
    props: crate::gpu::PageProps,
) -> Option<Result<(PageCopy, bool), u32>> {
    let mut g = books();
    let b = g.get_or_insert_with(|| Books {
        copies: Copies::default(),
        drivers: HashMap::new(),
    });
    // Another thread exported the same page meanwhile: its copy (filled by the caller).
    if let Some(c) = b.copies.get(vh) {
        return Some(Ok((c, false)));
    }
    let d = match b.drivers.entry(dev) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => match CudaDriver::open(t, dev) {
            Ok(d) => e.insert(d),
            Err(why) => {
                log::warn!("an export of a page inside a coalesced handle cannot go through a copy ({why}); the handle is split");
                return None;
            }
        },
    };
    Some(on_primary(t, dev, || b.copies.make(d, vh, src, size, props)).map(|c| (c, true)))
}

/// The first export through a copy says what the consumer gets.
fn said_once(src: u64, size: u64) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let (level, tail) = match SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        false => (
            log::Level::Warn,
            " (said for the first such export; EXPSEG_LOG=expseg=debug names every one)",
        ),
        true => (log::Level::Debug, ""),
    };
    log::log!(level, "the page at {src:#x} ({size} bytes) is exported as a copy: it lies inside a larger handle of expseg's, and a split would move its live neighbours under the program's non-blocking streams, which no hold reaches; a consumer reads what this process wrote before the export, a synchronize or a record of an event it shared, and what the consumer writes is not seen here{tail}");
}

/// Copy page `vh` into its copy `c` now: after the work queued on the legacy stream and
/// the blocking streams (not a device synchronize: capture-safe), under a registered read
/// of the page (the program's unmaps and expseg's moves of it wait). A page no longer
/// mapped where it was is not copied (an error: `CUDA_ERROR_INVALID_VALUE`).
fn fill(vh: u64, c: &PageCopy) -> Result<(), u32> {
    const INVALID: u32 = 1;
    let t = crate::real::driver().map_err(|_| NO_DRIVER)?;
    let Some(reading) = crate::api::vmm::begin_read_page(vh, c.src, c.size) else {
        return Err(INVALID);
    };
    let r = on_primary(t, c.dev, || stream::copy_on_legacy(t, c.va, c.src, c.size));
    drop(reading);
    GLOBAL.export_mirror_copies.add(1);
    r
}

/// After a synchronize, or before a record of a shared event: every copy of `dev` gets
/// its page's bytes again with `copy(dst, src, size)`, under a registered read; a page no
/// longer mapped where it was is passed over. How many were copied, and their bytes.
pub fn copy_all(dev: i32, copy: impl Fn(u64, u64, u64) -> crate::gpu::DrvResult<()>) -> (u64, u64) {
    let list = match books().as_ref() {
        Some(b) if !b.copies.is_empty() => b.copies.on_device(dev),
        _ => return (0, 0),
    };
    let (mut n, mut bytes) = (0, 0);
    for (vh, c) in list {
        let Some(reading) = crate::api::vmm::begin_read_page(vh, c.src, c.size) else {
            continue;
        };
        let r = copy(c.va, c.src, c.size);
        drop(reading);
        match r {
            Ok(()) => {
                n += 1;
                bytes += c.size;
            }
            Err(e) => log::warn!(
                "copying the page at {:#x} into its export's copy failed ({e}); the consumer reads the previous copy",
                c.src
            ),
        }
    }
    (n, bytes)
}

/// The program released page `vh`: its copy goes.
pub fn released(vh: u64) {
    let mut g = books();
    let Some(b) = g.as_mut() else { return };
    let Some(c) = b.copies.get(vh) else { return };
    let Some(d) = b.drivers.get_mut(&c.dev) else {
        return;
    };
    let Ok(t) = crate::real::driver() else { return };
    let _ = on_primary(t, c.dev, || Ok(b.copies.release(d, vh)));
    GLOBAL.export_mirror_bytes.sub(c.size);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::fake::FakeDriver;

    #[test]
    fn a_copy_is_made_mapped_and_given_back_with_its_page() {
        let mut d = FakeDriver::new(0, 1 << 21, 1 << 30);
        let mut c = Copies::default();
        let size = 20 << 20;
        let made = c
            .make(&mut d, 0x77, 0x7000_0000, size, PageProps::default())
            .unwrap();
        assert_eq!(c.get(0x77), Some(made));
        assert_eq!(c.on_device(0).len(), 1);
        assert!(c.on_device(1).is_empty());
        // Mapped and readable there: a copy into it lands.
        assert!(d.write(made.va, size, 42));
        assert_eq!(d.read(made.va + size - (1 << 21)), Some(42));
        assert!(d.is_accessible(made.va, size, 0));
        assert_eq!(c.release(&mut d, 0x77), Some(made));
        assert!(c.is_empty());
        assert_eq!(c.release(&mut d, 0x77), None, "once");
        assert_eq!(d.chunk_count(), 0, "the copy's handle went back");
        assert_eq!((d.mapping_count(), d.reservation_count()), (0, 0));
    }

    #[test]
    fn a_copy_that_cannot_be_mapped_leaves_nothing_behind() {
        let mut d = FakeDriver::new(0, 1 << 21, 1 << 30);
        let mut c = Copies::default();
        d.fail(crate::gpu::Op::Map, crate::gpu::DrvError(2));
        assert!(c
            .make(&mut d, 0x77, 0x7000_0000, 2 << 20, PageProps::default())
            .is_err());
        assert!(c.is_empty());
        assert_eq!(d.chunk_count(), 0);
        assert_eq!((d.mapping_count(), d.reservation_count()), (0, 0));
    }
}
