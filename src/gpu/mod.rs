//! The GPU as the pool sees it: a handful of VMM operations behind one small trait.
//!
//! Everything the pool needs from the driver goes through [`Driver`], so the pool is plain
//! safe Rust that runs against [`fake::FakeDriver`] under `cargo test` and against
//! [`cuda::CudaDriver`] inside a process. The trait speaks in driver terms: physical chunks
//! (`cuMemCreate` handles), virtual reservations and mappings between them.

pub mod cuda;
// The stand-in driver of the unit tests and the trace replay: not in the shipped library.
#[cfg(any(test, feature = "test-switches"))]
pub mod fake;
pub mod fence;
pub mod stream;
pub mod streams;
pub mod views;

use std::fmt;

/// A driver error: the raw `CUresult` of the failing call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrvError(pub u32);

/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;

impl DrvError {
    pub const OUT_OF_MEMORY: DrvError = DrvError(CUDA_ERROR_OUT_OF_MEMORY);

    pub fn is_oom(self) -> bool {
        self.0 == CUDA_ERROR_OUT_OF_MEMORY
    }
}

impl fmt::Display for DrvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CUresult {}", self.0)
    }
}

pub type DrvResult<T> = Result<T, DrvError>;

/// A driver call's `CUresult` as a result.
pub(crate) fn check(code: u32) -> DrvResult<()> {
    match code {
        0 => Ok(()),
        e => Err(DrvError(e)),
    }
}

/// `CUDA_ERROR_NOT_SUPPORTED`: the driver lacks a call.
pub(crate) const NOT_SUPPORTED: u32 = 801;

/// A physical allocation made by `cuMemCreate`.
pub type ChunkHandle = u64;

/// The driver and runtime operations whose cost the pool counts, in report order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Create,
    Release,
    Reserve,
    FreeVa,
    Map,
    Unmap,
    SetAccess,
    LegacyAlloc,
    LegacyFree,
    Copy,
    IpcHandle,
    Sync,
}

impl Op {
    pub const ALL: [Op; 12] = [
        Op::Create,
        Op::Release,
        Op::Reserve,
        Op::FreeVa,
        Op::Map,
        Op::Unmap,
        Op::SetAccess,
        Op::LegacyAlloc,
        Op::LegacyFree,
        Op::Copy,
        Op::IpcHandle,
        Op::Sync,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::Create => "cuMemCreate",
            Op::Release => "cuMemRelease",
            Op::Reserve => "cuMemAddressReserve",
            Op::FreeVa => "cuMemAddressFree",
            Op::Map => "cuMemMap",
            Op::Unmap => "cuMemUnmap",
            Op::SetAccess => "cuMemSetAccess",
            Op::LegacyAlloc => "cudaMalloc (IPC)",
            Op::LegacyFree => "cudaFree (IPC)",
            Op::Copy => "cudaMemcpy D2D (IPC)",
            Op::IpcHandle => "cudaIpcGetMemHandle",
            Op::Sync => "synchronize (IPC)",
        }
    }
}

/// The properties of a program's `cuMemCreate` that expseg reproduces when it coalesces
/// pages (everything else in the property struct is the plain default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct PageProps {
    /// `requestedHandleTypes` includes POSIX file descriptors.
    pub shareable: bool,
    /// `allocFlags.gpuDirectRDMACapable`.
    pub rdma: bool,
    /// expseg's own: the tag that was set when the program created the page (0: none), so
    /// that pages of different tags never share a handle (`crate::sleep`). Not the driver's.
    pub tag: u32,
}

/// Wait for the device, then copy each `(dst, src, size)`: a move's copies without a hold.
pub fn copy_after_wait<D: Driver + ?Sized>(d: &mut D, copies: &[(u64, u64, u64)]) -> DrvResult<()> {
    d.synchronize()?;
    for &(dst, src, size) in copies {
        d.copy(dst, src, size)?;
    }
    Ok(())
}

/// A legacy (`cudaIpcMemHandle_t`) IPC handle.
pub type IpcHandle = [u8; 64];

/// Whatever a driver holds for a move until the move is done (the fence on the device's
/// default stream, and the peers' holds, [`Driver::copy_and_hold`]); released when dropped.
#[derive(Default)]
pub struct Held {
    what: Option<Box<dyn Send>>,
    /// Peers whose default stream stays held until the move is done (`EXPSEG_PEER_HOLD`).
    pub peers_held: u32,
    /// Peers asked for whose hold was let go before the move was done: it did not start in
    /// time, or the device's own fence did not run in time while they were held (their
    /// streams wait on each other's work; by the mover or by the watchdog), or the move ran
    /// without its fence; the move then goes on as without a peer hold.
    pub peers_let_go: u32,
}

impl Held {
    pub fn new(what: Box<dyn Send>) -> Held {
        Held {
            what: Some(what),
            ..Held::default()
        }
    }

    /// The same hold, saying how many peers' holds it kept and let go.
    pub fn with_peers(mut self, held: u32, let_go: u32) -> Held {
        self.peers_held = held;
        self.peers_let_go = let_go;
        self
    }

    /// Whether something is held (not the fake's nothing).
    pub fn holds(&self) -> bool {
        self.what.is_some()
    }
}

/// How long a move waits for the holds of peers' default streams to start (the work those
/// streams queued before the hold to end), [`Driver::copy_and_hold`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerWait {
    /// 200 ms: a move a later call may make instead (giving stranded bytes back); then the
    /// holds are let go and the move is put off.
    Brief,
    /// Until the holds start, up to 10 s (a queue of a thousand kernels writing through peer
    /// access takes seconds): a move the program's call needs (its mapping, an export; then
    /// made as without them, with a warning), or one giving bytes back where memory is asked
    /// for (an allocation near the limit, a trim; then put off).
    Patient,
}

/// The VMM operations of one device that the pool uses. Sizes and addresses are bytes; sizes
/// are multiples of the device's granularity.
pub trait Driver {
    /// The device this driver allocates on.
    fn device(&self) -> i32;
    /// Allocation granularity (the smallest chunk and the unit of every size).
    fn granularity(&self) -> u64;
    /// Create a physical chunk of `size` bytes on the device.
    fn create(&mut self, size: u64) -> DrvResult<ChunkHandle>;
    /// Release a chunk that is no longer mapped anywhere.
    fn release(&mut self, h: ChunkHandle) -> DrvResult<()>;
    /// Reserve `size` bytes of virtual address space.
    fn reserve(&mut self, size: u64) -> DrvResult<u64>;
    /// Free a reservation that has nothing mapped in it.
    fn free_va(&mut self, va: u64, size: u64) -> DrvResult<()>;
    /// Map a whole chunk at `va`.
    fn map(&mut self, va: u64, size: u64, h: ChunkHandle) -> DrvResult<()>;
    /// Unmap `[va, va+size)`.
    fn unmap(&mut self, va: u64, size: u64) -> DrvResult<()>;
    /// Give exactly the devices in `readers` read-write access to `[va, va+size)` and take it
    /// from the devices in `revoked`.
    fn set_access(&mut self, va: u64, size: u64, readers: &[i32], revoked: &[i32])
        -> DrvResult<()>;

    // What IPC export needs besides VMM: standard (`cudaMalloc`) memory and its handles.

    /// Reserve `size` bytes at exactly `va` if that range is free; else wherever the driver
    /// likes (the caller compares).
    fn reserve_at(&mut self, va: u64, size: u64) -> DrvResult<u64>;
    /// Standard device memory from the real `cudaMalloc`.
    fn legacy_alloc(&mut self, size: u64) -> DrvResult<u64>;
    fn legacy_free(&mut self, ptr: u64) -> DrvResult<()>;
    /// Copy device to device and wait until the copy is done.
    fn copy(&mut self, dst: u64, src: u64, size: u64) -> DrvResult<()>;
    /// The legacy IPC handle of standard memory.
    fn legacy_handle(&mut self, ptr: u64) -> DrvResult<IpcHandle>;
    /// Wait for all work on the device.
    fn synchronize(&mut self) -> DrvResult<()>;
    /// For a move of live pages: once all work queued on the device so far has ended, copy
    /// each `(dst, src, size)` (device to device), and hold the device's default stream from
    /// then until the returned guard drops, so that work any thread of the program queues
    /// there (or on a stream that waits for it) meanwhile starts after the pages are back at
    /// their address. `peers`: other devices given access to the pages, whose default
    /// streams are held too where `EXPSEG_PEER_HOLD` asks (kernels queued there may write the
    /// pages through peer access), waiting for their holds to start as `wait` says. This
    /// default waits, copies and holds nothing.
    fn copy_and_hold(
        &mut self,
        copies: &[(u64, u64, u64)],
        peers: &[i32],
        wait: PeerWait,
    ) -> DrvResult<Held> {
        let _ = (peers, wait);
        copy_after_wait(self, copies)?;
        Ok(Held::default())
    }
    /// Wait for the work queued on the device's legacy default stream (the runtime's stream 0,
    /// where PyTorch's default stream runs), not for other streams: what a program that frees
    /// memory of this device meant to wait for when it waited on another device's stream
    /// (PyTorch's `empty_cache()` with another device current).
    fn wait_default_stream(&mut self) -> DrvResult<()>;
    /// Wait for all work on another device `dev`: one that was given access to this device's
    /// memory (peer access), whose kernels may be reading it.
    fn synchronize_peer(&mut self, dev: i32) -> DrvResult<()>;

    /// A POSIX file descriptor for a chunk, for another process to import (IPC tickets).
    fn export_fd(&mut self, h: ChunkHandle) -> DrvResult<std::os::fd::OwnedFd>;

    // What coalescing another allocator's pages needs (`crate::coalesce`).

    /// Create a chunk with the properties a program asked for (`crate::coalesce`).
    fn create_as(&mut self, size: u64, props: PageProps) -> DrvResult<ChunkHandle>;
    /// Bytes the driver can still give out on the device (`cuMemGetInfo`'s free).
    fn free_memory(&mut self) -> DrvResult<u64>;
    /// A monotonic clock in nanoseconds: how old an answer of `free_memory` is.
    fn now_ns(&mut self) -> u64;
    /// Set access to `[va, va+size)` exactly as the program's descriptors say: `(device,
    /// CUmemAccess_flags)`, flags 0 taking access away.
    fn set_access_flags(&mut self, va: u64, size: u64, descs: &[(i32, u32)]) -> DrvResult<()>;
    /// Copy `size` bytes of device memory at `src` to the host (and wait).
    fn save(&mut self, src: u64, size: u64) -> DrvResult<Vec<u8>>;
    /// Copy host bytes to device memory at `dst` (and wait).
    fn load(&mut self, dst: u64, data: &[u8]) -> DrvResult<()>;

    // What pausing a process's memory needs (`crate::sleep`): page-locked host buffers and
    // copies queued to and from them. Host buffers are named by their address.

    /// Page-locked host buffers of `sizes` bytes, all or none (a failure frees those made).
    fn host_alloc(&mut self, sizes: &[u64]) -> DrvResult<Vec<u64>>;
    /// Free a buffer `host_alloc` made.
    fn host_free(&mut self, host: u64);
    /// Queue a copy of `size` device bytes at `src` into host memory at `host` (inside a
    /// buffer of `host_alloc`).
    fn copy_to_host(&mut self, host: u64, src: u64, size: u64) -> DrvResult<()>;
    /// Queue a copy of `size` host bytes at `host` to device memory at `dst`.
    fn copy_from_host(&mut self, dst: u64, host: u64, size: u64) -> DrvResult<()>;
    /// Wait until every queued copy is done: Err if one failed.
    fn wait_copies(&mut self) -> DrvResult<()>;
}
