//! IPC export of pool memory: what `cudaIpcGetMemHandle` needs from the pool.
//!
//! Legacy IPC handles exist only for standard (`cudaMalloc`) memory. An allocation asked for
//! a handle therefore becomes standard memory in one of two ways:
//!
//! * **Move in place.** Its physical chunks are mapped a second time at a temporary range,
//!   the original range is released, and a real `cudaMalloc` of the same size is taken; if it
//!   lands on the original address, the data is copied back and the VMM pages dropped. The
//!   program's pointer is unchanged and the memory is now ordinary: the pool forgets it and
//!   its `cudaFree` goes to the runtime. Every step has a way back: until the copy succeeds
//!   the data stays in the chunks, mapped at the temporary range, and a failure restores the
//!   original mapping (re-reserving the exact range) before anything else happens.
//! * **Mirror.** Otherwise a standard buffer of the same size receives a copy, and its handle
//!   is returned. Each later request refreshes the copy and returns the same 64 bytes. The
//!   consumer sees the data as of the latest request; its writes do not reach the producer.
//!   Freeing the allocation frees the mirror.

use super::export_types::{Export, ExportError, ExportPolicy, Exported, Mirror, MoveStep};
use super::{Block, Chunk, Pool};
use crate::gpu::{Driver, DrvError, IpcHandle, Op};
use std::os::fd::OwnedFd;

/// A shared allocation's size and its chunks as descriptors with their sizes, in order.
pub type SharedChunks = (u64, Vec<(OwnedFd, u64)>);

enum MoveError {
    /// Rolled back: the allocation is as it was.
    NotMoved(MoveStep, DrvError),
    Lost {
        kept: u64,
    },
}

/// How many `cudaMalloc`s a restore may take to get the original address back from the
/// runtime's heap, and how many bytes they may hold at once.
const PLUG_TRIES: usize = 64;
const PLUG_BYTES: u64 = 4 << 30;

/// An injected failure.
const INJECTED: DrvError = DrvError(999);

/// Most chunk descriptors kept open for shared allocations; beyond, each consumer request
/// exports afresh.
pub const FD_CACHE_MAX: usize = 256;

impl<D: Driver> Pool<D> {
    /// Make the allocation containing `ptr` exportable with a legacy handle.
    pub fn export(&mut self, ptr: u64, policy: ExportPolicy) -> Result<Export, ExportError> {
        let (base, user) = self.find(ptr).ok_or(ExportError::NotOwned)?;
        self.wake_block(base).map_err(ExportError::Paused)?;
        let b = &self.blocks[&base];
        if movable(b, &policy) {
            match self.move_in_place(base, policy.fail_move_at) {
                Ok(handle) => {
                    return Ok(Export {
                        base,
                        size: user,
                        handle,
                        how: Exported::Moved,
                    });
                }
                Err(MoveError::NotMoved(step, e)) => {
                    self.stats.ipc_move_failures += 1;
                    log::info!("allocation {base:#x}: move in place stopped at {} ({e}); restored, using a mirror", step.name());
                }
                Err(MoveError::Lost { kept }) => {
                    return Err(ExportError::RangeLost { base, kept });
                }
            }
        }
        let (handle, ptr, first) = self.mirror(base)?;
        self.stats.ipc_mirrored += 1;
        Ok(Export {
            base,
            size: user,
            handle,
            how: Exported::Mirror { ptr, first },
        })
    }

    /// The mirror of the live allocation containing `ptr`, if it has one: (base, mapped size,
    /// mirror, its handle). For a refresh outside the pool's lock (`api::ipc`).
    pub fn mirror_of(&self, ptr: u64) -> Option<(u64, u64, u64, IpcHandle)> {
        let (base, _) = self.find(ptr)?;
        let b = &self.blocks[&base];
        b.mirror.map(|m| (base, b.size, m.ptr, m.handle))
    }

    /// The live allocations that have a mirror: (base, size, mirror).
    pub fn mirrors(&self) -> Vec<(u64, u64, u64)> {
        self.blocks
            .iter()
            .filter_map(|(b, blk)| blk.mirror.map(|m| (*b, blk.size, m.ptr)))
            .collect()
    }

    /// Count a mirror refreshed outside the pool.
    pub fn count_mirror_refresh(&mut self) {
        self.stats.ipc_mirrored += 1;
    }

    /// Create or refresh the mirror of the live block at `base`.
    fn mirror(&mut self, base: u64) -> Result<(IpcHandle, u64, bool), ExportError> {
        let size = self.blocks[&base].size;
        self.timed(Op::Sync, |d| d.synchronize())
            .map_err(ExportError::Driver)?;
        // Writes other devices queued into the block through peer access are in the copy (a
        // peer whose wait fails, a context in error, is passed over: the request is ours).
        for r in self.peer_readers() {
            if let Err(e) = self.timed(Op::Sync, |d| d.synchronize_peer(r)) {
                log::warn!("IPC: waiting for device {r} before a mirror's copy failed ({e})");
            }
        }
        if let Some(m) = self.blocks[&base].mirror {
            self.timed(Op::Copy, |d| d.copy(m.ptr, base, size))
                .map_err(ExportError::Driver)?;
            return Ok((m.handle, m.ptr, false));
        }
        let (handle, ptr) = self.new_mirror(base)?;
        if let Err(e) = self.timed(Op::Copy, |d| d.copy(ptr, base, size)) {
            self.forget_mirror(base);
            return Err(ExportError::Driver(e));
        }
        Ok((handle, ptr, true))
    }

    /// Give the live allocation containing `ptr` a mirror whose data is not copied yet (the
    /// caller copies it without the pool's lock, as for a refresh, before handing the handle
    /// out): nothing here waits for the device. Returns (mirror, whether it is new); an
    /// existing mirror is returned as it is.
    pub fn prepare_mirror(&mut self, ptr: u64) -> Result<(u64, bool), ExportError> {
        let (base, _) = self.find(ptr).ok_or(ExportError::NotOwned)?;
        // A paused block resumes first: its mirror's copy reads it.
        self.wake_block(base).map_err(ExportError::Paused)?;
        if let Some(m) = self.blocks[&base].mirror {
            return Ok((m.ptr, false));
        }
        let (_, m) = self.new_mirror(base)?;
        Ok((m, true))
    }

    /// Whether an export of the allocation containing `ptr` may move it in place.
    pub fn would_move(&self, ptr: u64, policy: &ExportPolicy) -> bool {
        self.find(ptr)
            .is_some_and(|(base, _)| movable(&self.blocks[&base], policy))
    }

    /// Standard memory and its legacy handle for a mirror of the live block at `base`,
    /// recorded on the block (its data still to be copied).
    fn new_mirror(&mut self, base: u64) -> Result<(IpcHandle, u64), ExportError> {
        let size = self.blocks[&base].size;
        let ptr = match self.timed(Op::LegacyAlloc, |d| d.legacy_alloc(size)) {
            Ok(p) => p,
            Err(e) if e.is_oom() => {
                // What the pool keeps cached may be just what the mirror needs.
                self.trim(0);
                self.timed(Op::LegacyAlloc, |d| d.legacy_alloc(size))
                    .map_err(|e| {
                        if e.is_oom() {
                            ExportError::OutOfMemory
                        } else {
                            ExportError::Driver(e)
                        }
                    })?
            }
            Err(e) => return Err(ExportError::Driver(e)),
        };
        match self.timed(Op::IpcHandle, |d| d.legacy_handle(ptr)) {
            Ok(handle) => {
                let m = Mirror { ptr, size, handle };
                self.blocks.get_mut(&base).expect("live block").mirror = Some(m);
                self.stats.mirror_bytes += size;
                Ok((handle, ptr))
            }
            Err(e) => {
                let _ = self.timed(Op::LegacyFree, |d| d.legacy_free(ptr));
                Err(ExportError::Driver(e))
            }
        }
    }

    /// Undo `new_mirror` (its copy failed): nothing was handed out yet.
    fn forget_mirror(&mut self, base: u64) {
        if let Some(m) = self.blocks.get_mut(&base).and_then(|b| b.mirror.take()) {
            self.drop_mirror(m);
        }
    }

    /// A device outside this process may read and write `[ptr, ptr+size)` (a dma-buf of the
    /// range, for RDMA): every live allocation overlapping it is shared from now on (never
    /// reused, paused or moved), as after an IPC share, without descriptors of its own. The
    /// allocations marked.
    pub fn share_range(&mut self, ptr: u64, size: u64) -> usize {
        let end = ptr.saturating_add(size.max(1));
        let mut n = 0;
        for (base, b) in self.blocks.range_mut(..end).rev() {
            if base + b.size <= ptr {
                break;
            }
            if b.cached_at.is_none() && b.asleep.is_none() {
                b.shared = true;
                n += 1;
            }
        }
        n
    }

    /// Mark the live allocation containing `ptr` as shared with other processes: from now on
    /// its chunks may be mapped elsewhere, so they are never reused. Returns base and size.
    /// `None` for a paused allocation (it has no chunks to share: [`Pool::wake_for`] first).
    pub fn share(&mut self, ptr: u64) -> Option<(u64, u64)> {
        let (base, user) = self.find(ptr)?;
        let b = self.blocks.get_mut(&base).expect("live block");
        if b.asleep.is_some() {
            return None;
        }
        b.shared = true;
        // Descriptors are kept (a consumer's request then costs a dup) only up to a bound:
        // each is an open file of the process, and a process has about a thousand.
        if b.fds.is_empty() && self.cached_fds + b.chunks.len() <= FD_CACHE_MAX {
            let handles: Vec<_> = b.chunks.iter().map(|c| c.handle).collect();
            let fds: Result<Vec<_>, _> =
                handles.into_iter().map(|h| self.drv.export_fd(h)).collect();
            match fds {
                Ok(f) => {
                    self.cached_fds += f.len();
                    self.blocks.get_mut(&base).expect("live block").fds = f;
                }
                // Tried again when a consumer asks.
                Err(e) => log::warn!("exporting the chunks of {base:#x} failed: {e}"),
            }
        }
        Some((base, user))
    }

    /// Descriptors kept open for shared chunks, all allocations together.
    pub fn cached_fd_count(&self) -> usize {
        self.cached_fds
    }

    /// File descriptors for the chunks of the shared live allocation at `base`, in mapping
    /// order, with its size; `None` if it is no longer live and shared.
    pub fn export_fds(&mut self, base: u64) -> Option<Result<SharedChunks, DrvError>> {
        let b = self
            .blocks
            .get(&base)
            .filter(|b| b.cached_at.is_none() && b.shared)?;
        let (user, chunks) = (b.user, b.chunks.clone());
        let cached: std::io::Result<Vec<OwnedFd>> = b.fds.iter().map(OwnedFd::try_clone).collect();
        let mut fds = Vec::with_capacity(chunks.len());
        match cached {
            Ok(c) if c.len() == chunks.len() => {
                fds.extend(c.into_iter().zip(chunks.iter().map(|c| c.size)));
            }
            _ => {
                for c in chunks {
                    match self.drv.export_fd(c.handle) {
                        Ok(fd) => fds.push((fd, c.size)),
                        Err(e) => return Some(Err(e)),
                    }
                }
            }
        }
        Some(Ok((user, fds)))
    }

    /// Free a shared allocation: unmap it and give its chunks back to the driver, which keeps
    /// the pages alive while other processes still map them.
    pub(super) fn free_shared(&mut self, base: u64) -> u64 {
        let b = self.blocks.remove(&base).expect("live block");
        self.cached_fds -= b.fds.len();
        self.stats.on_free(b.user, b.size);
        if let Some(m) = b.mirror {
            self.drop_mirror(m);
        }
        let _ = self.timed(Op::Unmap, |d| d.unmap(base, b.size));
        self.free_va(base, b.size);
        for c in &b.chunks {
            if self.timed(Op::Release, |d| d.release(c.handle)).is_err() {
                log::warn!("releasing a chunk of shared allocation {base:#x} failed");
            }
        }
        self.stats.on_released(b.size);
        b.user
    }

    pub(super) fn drop_mirror(&mut self, m: Mirror) {
        if let Err(e) = self.timed(Op::LegacyFree, |d| d.legacy_free(m.ptr)) {
            log::warn!("freeing the IPC mirror {:#x} failed: {e}", m.ptr);
        }
        self.stats.mirror_bytes -= m.size;
    }

    /// One step of a move: the driver call, or the injected failure.
    fn step<T>(
        &mut self,
        step: MoveStep,
        fail: Option<MoveStep>,
        op: Op,
        f: impl FnOnce(&mut D) -> Result<T, DrvError>,
    ) -> Result<T, (MoveStep, DrvError)> {
        if fail == Some(step) {
            return Err((step, INJECTED));
        }
        self.timed(op, f).map_err(|e| (step, e))
    }

    fn move_in_place(&mut self, base: u64, fail: Option<MoveStep>) -> Result<IpcHandle, MoveError> {
        let (size, user) = (self.blocks[&base].size, self.blocks[&base].user);
        let chunks = self.blocks[&base].chunks.clone();
        let not_moved = |(s, e)| MoveError::NotMoved(s, e);

        self.step(MoveStep::Sync, fail, Op::Sync, |d| d.synchronize())
            .map_err(not_moved)?;
        // Devices given peer access may be at work on the block: it leaves its address below.
        for r in self.peer_readers() {
            self.step(MoveStep::Sync, fail, Op::Sync, |d| d.synchronize_peer(r))
                .map_err(not_moved)?;
        }
        // The chunks at a temporary range: the source of the copy and the way back.
        let temp = self
            .step(MoveStep::TempReserve, fail, Op::Reserve, |d| {
                d.reserve(size)
            })
            .map_err(not_moved)?;
        if let Err(e) = self.map_chunks(temp, &chunks, MoveStep::TempMap, fail) {
            let _ = self.timed(Op::FreeVa, |d| d.free_va(temp, size));
            return Err(not_moved(e));
        }
        if let Err(e) = self.step(MoveStep::Unmap, fail, Op::Unmap, |d| d.unmap(base, size)) {
            self.drop_temp(temp, size);
            return Err(not_moved(e));
        }
        let handle = self.release_and_land(base, size, &chunks, temp, fail)?;
        // Committed: the VMM pages go, the pool forgets the allocation.
        self.drop_temp(temp, size);
        for c in &chunks {
            if let Err(e) = self.timed(Op::Release, |d| d.release(c.handle)) {
                log::warn!("releasing chunk of moved allocation {base:#x} failed: {e}");
            }
        }
        self.blocks.remove(&base);
        self.stats.on_moved(user, size);
        Ok(handle)
    }

    /// The part of a move after the original range is unmapped: release it, take standard
    /// memory that lands on it, copy, take the handle. Any failure goes through `restore`,
    /// which may still complete the move (`Ok`).
    fn release_and_land(
        &mut self,
        base: u64,
        size: u64,
        chunks: &[Chunk],
        temp: u64,
        fail: Option<MoveStep>,
    ) -> Result<IpcHandle, MoveError> {
        if let Err(e) = self.step(MoveStep::FreeRange, fail, Op::FreeVa, |d| {
            d.free_va(base, size)
        }) {
            // The range is still ours: map the chunks back.
            return self.restore(base, size, chunks, temp, None, e);
        }
        // The original range is released: from here a failure must take it back.
        let new = match self.step(MoveStep::Alloc, fail, Op::LegacyAlloc, |d| {
            d.legacy_alloc(size)
        }) {
            Ok(p) => p,
            Err(e) => return self.restore(base, size, chunks, temp, None, e),
        };
        if new != base || fail == Some(MoveStep::Placement) {
            let e = if new != base {
                log::debug!("IPC move of {base:#x}: cudaMalloc({size}) landed at {new:#x}");
                DrvError(0)
            } else {
                INJECTED
            };
            return self.restore(
                base,
                size,
                chunks,
                temp,
                Some(new),
                (MoveStep::Placement, e),
            );
        }
        let copied = self
            .step(MoveStep::Copy, fail, Op::Copy, |d| d.copy(base, temp, size))
            .and_then(|()| {
                self.step(MoveStep::Handle, fail, Op::IpcHandle, |d| {
                    d.legacy_handle(base)
                })
            });
        match copied {
            Ok(h) => Ok(h),
            Err(e) => self.restore(base, size, chunks, temp, Some(new), e),
        }
    }

    /// `map_at` as a step of a move (a test can make it fail).
    fn map_chunks(
        &mut self,
        va: u64,
        chunks: &[Chunk],
        step: MoveStep,
        fail: Option<MoveStep>,
    ) -> Result<(), (MoveStep, DrvError)> {
        if fail == Some(step) {
            return Err((step, INJECTED));
        }
        self.map_at(va, chunks).map_err(|e| (step, e))
    }

    fn drop_temp(&mut self, temp: u64, size: u64) {
        let _ = self.timed(Op::Unmap, |d| d.unmap(temp, size));
        self.free_va(temp, size);
    }

    /// Put the allocation back where it was after a failed move, and drop the temporary
    /// mapping. `legacy`: standard memory taken by the move, freed here (after the original
    /// range is safely reserved again, unless it is in the way).
    ///
    /// The runtime's heap may have swallowed the released range (its `cudaMalloc` reserved a
    /// region covering it and placed the new memory elsewhere in it: seen on H200 for 8 MiB
    /// after a cluttered history). Then the range cannot be reserved again, and the only way
    /// back to the program's address is a `cudaMalloc` that lands on it: the restore takes
    /// allocations until one does and completes the move there (`Ok`, with the handle).
    fn restore(
        &mut self,
        base: u64,
        size: u64,
        chunks: &[Chunk],
        temp: u64,
        legacy: Option<u64>,
        (step, err): (MoveStep, DrvError),
    ) -> Result<IpcHandle, MoveError> {
        let range_held = step == MoveStep::FreeRange;
        let mut held = range_held;
        let mut legacy = legacy;
        if legacy == Some(base) {
            // The new memory is the original range itself: give it back first.
            let _ = self.timed(Op::LegacyFree, |d| d.legacy_free(base));
            legacy = None;
        }
        for attempt in 0..2 {
            if held {
                break;
            }
            match self.timed(Op::Reserve, |d| d.reserve_at(base, size)) {
                Ok(r) if r == base => held = true,
                Ok(r) => {
                    let _ = self.timed(Op::FreeVa, |d| d.free_va(r, size));
                }
                Err(_) => {}
            }
            // The new memory may overlap the range: free it and try once more.
            if !held && attempt == 0 {
                if let Some(p) = legacy.take() {
                    let _ = self.timed(Op::LegacyFree, |d| d.legacy_free(p));
                }
            }
        }
        if let Some(p) = legacy {
            let _ = self.timed(Op::LegacyFree, |d| d.legacy_free(p));
        }
        if !held {
            if let Some(h) = self.plug(base, size, temp) {
                return Ok(h);
            }
        }
        if !held || self.map_chunks(base, chunks, step, None).is_err() {
            // The data is intact at `temp`; keep that mapping and the chunks alive.
            log::error!(
                "IPC move of {base:#x} ({size} bytes) failed at {} ({err}) and the original range could not be restored; the data is kept at {temp:#x}",
                step.name()
            );
            if held {
                let _ = self.timed(Op::FreeVa, |d| d.free_va(base, size));
            }
            let b = self.blocks.remove(&base).expect("moving block");
            self.blocks.insert(
                temp,
                Block {
                    cached_at: None,
                    ..b
                },
            );
            return Err(MoveError::Lost { kept: temp });
        }
        self.drop_temp(temp, size);
        Err(MoveError::NotMoved(step, err))
    }

    /// Take `cudaMalloc`s of `size` until one lands on `base`, then copy the data there from
    /// `temp` and take its handle. Frees every other allocation it took.
    fn plug(&mut self, base: u64, size: u64, temp: u64) -> Option<IpcHandle> {
        let mut plugs = Vec::new();
        let mut landed = false;
        while plugs.len() < PLUG_TRIES && (plugs.len() as u64) * size < PLUG_BYTES {
            match self.timed(Op::LegacyAlloc, |d| d.legacy_alloc(size)) {
                Ok(p) if p == base => {
                    landed = true;
                    break;
                }
                Ok(p) => plugs.push(p),
                Err(_) => break,
            }
        }
        for p in plugs {
            let _ = self.timed(Op::LegacyFree, |d| d.legacy_free(p));
        }
        if !landed {
            return None;
        }
        let done = self
            .timed(Op::Copy, |d| d.copy(base, temp, size))
            .and_then(|()| self.timed(Op::IpcHandle, |d| d.legacy_handle(base)));
        match done {
            Ok(h) => {
                self.stats.ipc_plugged += 1;
                Some(h)
            }
            Err(e) => {
                log::warn!("IPC move of {base:#x}: copy into the recovered address failed: {e}");
                let _ = self.timed(Op::LegacyFree, |d| d.legacy_free(base));
                None
            }
        }
    }
}

/// Whether an export may move block `b` in place: never shared or mirrored, and the program's
/// size at most `EXPSEG_IPC_MOVE_MAX` (the size `api::ipc::get` compares too: comparing the
/// rounded block would mirror a 3 MiB allocation under `3M` after the caller had skipped the
/// ticket check a mirror needs outside the lock).
fn movable(b: &super::Block, policy: &ExportPolicy) -> bool {
    b.mirror.is_none() && !b.shared && b.user <= policy.move_max
}
