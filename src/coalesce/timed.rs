//! The driver as the coalescer sees it: every call counted and timed per operation, for the
//! exit report (calls and clock ticks per `Op`, then `cuMemGetInfo`; [`crate::clock`]).

use crate::gpu::{ChunkHandle, Driver, DrvResult, Held, IpcHandle, Op, PageProps};
use std::os::fd::OwnedFd;

/// The driver, with calls and clock ticks counted per operation (`Op::ALL` order; the last
/// slot is `cuMemGetInfo`).
pub struct Timed<D> {
    pub(super) inner: D,
    pub calls: [(u64, u64); Op::ALL.len() + 1],
}

impl<D> Timed<D> {
    fn count<T>(&mut self, slot: usize, f: impl FnOnce(&mut D) -> T) -> T {
        let t = crate::clock::ticks();
        let r = f(&mut self.inner);
        let c = &mut self.calls[slot];
        c.0 += 1;
        c.1 += crate::clock::since(t);
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
    fn copy_and_hold(
        &mut self,
        copies: &[(u64, u64, u64)],
        peers: &[i32],
        wait: crate::gpu::PeerWait,
    ) -> DrvResult<Held> {
        self.count(Op::Copy.index(), |d| d.copy_and_hold(copies, peers, wait))
    }
    fn wait_default_stream(&mut self) -> DrvResult<()> {
        self.count(Op::Sync.index(), |d| d.wait_default_stream())
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
    fn now_ns(&mut self) -> u64 {
        self.inner.now_ns()
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
    fn host_alloc(&mut self, sizes: &[u64]) -> DrvResult<Vec<u64>> {
        self.inner.host_alloc(sizes)
    }
    fn host_free(&mut self, host: u64) {
        self.inner.host_free(host)
    }
    fn copy_to_host(&mut self, host: u64, src: u64, size: u64) -> DrvResult<()> {
        self.count(Op::Copy.index(), |d| d.copy_to_host(host, src, size))
    }
    fn copy_from_host(&mut self, dst: u64, host: u64, size: u64) -> DrvResult<()> {
        self.count(Op::Copy.index(), |d| d.copy_from_host(dst, host, size))
    }
    fn wait_copies(&mut self) -> DrvResult<()> {
        self.count(Op::Sync.index(), |d| d.wait_copies())
    }
}
