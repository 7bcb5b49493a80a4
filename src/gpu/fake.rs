//! A fake driver for tests: it keeps the books a real driver keeps and refuses every misuse
//! the real one would refuse, so pool tests check the pool's driver usage as well as its
//! answers.
//!
//! Memory has contents at the resolution of one granule: a `u64` tag per granule, in
//! physical chunks and in standard (`cudaMalloc`) allocations, readable and writable through
//! any address that maps them. So IPC tests can check that data survives a migration.
//!
//! Capacity is a byte budget shared by chunks and standard allocations; `fail` injects an
//! error into the next call of one operation; `legacy_placement` says where `cudaMalloc` puts
//! memory (the same low heap as reservations, as measured for ≤ 20 MiB, or a separate one).

use super::{ChunkHandle, Driver, DrvError, DrvResult, IpcHandle, Op};
use std::collections::{BTreeMap, HashMap};

const VA_BASE: u64 = 0x7000_0000_0000;
const LEGACY_TOP: u64 = 0x7f00_0000_0000;
/// `CUDA_ERROR_INVALID_VALUE`: what the fake answers to misuse.
const INVALID: DrvError = DrvError(1);

/// Where the fake `cudaMalloc` places memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// First fit in the heap reservations use: a freed reservation's address comes back.
    SharedLowHeap,
    /// A separate heap growing down from the top: never a reservation's address.
    SeparateHeap,
    /// A sub-allocator: new memory comes from heap regions the runtime reserves (twice the
    /// request, lowest free address) and keeps after frees; a new region's first allocation
    /// sits at its end, later ones take the lowest free slot. A freed reservation can thus be
    /// swallowed by a region without being handed out.
    Suballocator,
}

#[derive(Debug)]
struct Chunk {
    size: u64,
    mapped: u32,
    data: Vec<u64>,
}

#[derive(Debug)]
pub struct FakeDriver {
    dev: i32,
    gran: u64,
    capacity: u64,
    next_handle: ChunkHandle,
    chunks: HashMap<ChunkHandle, Chunk>,
    /// reservation start -> size
    reservations: BTreeMap<u64, u64>,
    /// mapping start -> (size, handle)
    mappings: BTreeMap<u64, (u64, ChunkHandle)>,
    /// mapping start -> devices with access
    access: HashMap<u64, Vec<i32>>,
    /// standard allocation start -> per-granule data
    legacy: BTreeMap<u64, Vec<u64>>,
    /// the sub-allocator's regions: start -> size
    regions: BTreeMap<u64, u64>,
    pub legacy_placement: Placement,
    /// Lowest address `reserve` hands out (tests move reservations away from a hole).
    pub reserve_floor: u64,
    /// calls per operation, in `Op::ALL` order
    pub calls: [u64; Op::ALL.len()],
    /// Other devices waited for (`synchronize_peer`), in order.
    pub peers_synced: Vec<i32>,
    /// Work in flight on the default stream (`launch`): ranges a kernel still uses until the
    /// device or its default stream is waited for.
    in_flight: Vec<(u64, u64)>,
    /// Unmaps of a range with work in flight on it: what faults a real GPU with an illegal
    /// address.
    pub unmapped_in_flight: u64,
    /// `wait_default_stream` calls.
    pub default_stream_waits: u64,
    /// Ranges a test says the program is using (its mapped pages), and how many unmaps took
    /// a mapping from under one of them: what another thread's kernel would meet.
    pub watched: Vec<(u64, u64)>,
    pub unmapped_watched: u64,
    /// `copy_and_hold` calls and the copies they made (a move of mapped pages).
    pub held_copies: Vec<usize>,
    /// The peers each `copy_and_hold` was asked to hold, in order.
    pub held_peers: Vec<Vec<i32>>,
    /// How long each `copy_and_hold` was asked to wait for its peers' holds.
    pub peer_waits: Vec<super::PeerWait>,
    /// Whether a peer's hold starts (false: every peer's hold is let go, as where the
    /// streams wait on each other).
    pub peer_holds_start: bool,
    /// Page-locked host buffers: start -> per-granule data (host addresses are a range of
    /// their own, `HOST_BASE` up).
    host: BTreeMap<u64, Vec<u64>>,
    next_host: u64,
    /// Host buffers that can still be made, in bytes.
    pub host_capacity: u64,
    inject: Vec<(Op, DrvError)>,
    /// The clock `now_ns` reads: pinned by `set_clock`, else a second later at every read
    /// (no answer of `free_memory` is ever recent).
    clock: Option<u64>,
    ticks: u64,
}

/// Where fake host buffers live (far from device addresses).
const HOST_BASE: u64 = 0x1000_0000_0000;

impl FakeDriver {
    pub fn new(dev: i32, gran: u64, capacity: u64) -> Self {
        FakeDriver {
            dev,
            gran,
            capacity,
            next_handle: 1,
            chunks: HashMap::new(),
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            access: HashMap::new(),
            legacy: BTreeMap::new(),
            regions: BTreeMap::new(),
            legacy_placement: Placement::SharedLowHeap,
            reserve_floor: VA_BASE,
            calls: [0; Op::ALL.len()],
            peers_synced: Vec::new(),
            in_flight: Vec::new(),
            unmapped_in_flight: 0,
            default_stream_waits: 0,
            watched: Vec::new(),
            unmapped_watched: 0,
            held_copies: Vec::new(),
            held_peers: Vec::new(),
            peer_waits: Vec::new(),
            peer_holds_start: true,
            host: BTreeMap::new(),
            next_host: HOST_BASE,
            host_capacity: u64::MAX,
            inject: Vec::new(),
            clock: None,
            ticks: 0,
        }
    }

    /// Pin the clock `now_ns` reads (the replay: the recorded time of each call).
    pub fn set_clock(&mut self, ns: u64) {
        self.clock = Some(ns);
    }

    /// A kernel on the default stream uses `[va, va+size)` until the device is waited for.
    pub fn launch(&mut self, va: u64, size: u64) {
        self.in_flight.push((va, size));
    }

    /// Make the next call of `op` fail with `err`.
    pub fn fail(&mut self, op: Op, err: DrvError) {
        self.inject.push((op, err));
    }

    /// Make the `n`-th next call (0 = the next) of `op` fail with `err`.
    pub fn fail_nth(&mut self, op: Op, n: usize, err: DrvError) {
        for _ in 0..n {
            self.inject.push((op, DrvError(0)));
        }
        self.inject.push((op, err));
    }

    /// Forget failures injected with `fail` that no call has met.
    pub fn clear_failures(&mut self) {
        self.inject.clear();
    }

    /// Physical bytes currently created: chunks and standard allocations.
    pub fn used(&self) -> u64 {
        self.chunks.values().map(|c| c.size).sum::<u64>() + self.legacy_bytes()
    }

    /// Bytes of standard allocations.
    pub fn legacy_bytes(&self) -> u64 {
        self.legacy
            .values()
            .map(|d| d.len() as u64 * self.gran)
            .sum()
    }

    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.used()
    }

    pub fn set_capacity(&mut self, capacity: u64) {
        self.capacity = capacity;
    }

    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    pub fn reservation_count(&self) -> usize {
        self.reservations.len()
    }

    pub fn mapping_count(&self) -> usize {
        self.mappings.len()
    }

    pub fn legacy_count(&self) -> usize {
        self.legacy.len()
    }

    pub fn is_legacy(&self, ptr: u64) -> bool {
        self.legacy.contains_key(&ptr)
    }

    pub fn total_calls(&self) -> u64 {
        self.calls.iter().sum()
    }

    pub fn calls_of(&self, op: Op) -> u64 {
        self.calls[op.index()]
    }

    /// Every mapping: (address, size, handle, devices with access).
    pub fn mapping_list(&self) -> Vec<(u64, u64, ChunkHandle, Vec<i32>)> {
        self.mappings
            .iter()
            .map(|(s, (l, h))| (*s, *l, *h, self.access.get(s).cloned().unwrap_or_default()))
            .collect()
    }

    /// Whether every byte of `[va, va+size)` is mapped, and readable by `dev`.
    pub fn is_accessible(&self, va: u64, size: u64, dev: i32) -> bool {
        let mut at = va;
        while at < va + size {
            let Some((start, (len, _))) = self.mappings.range(..=at).next_back() else {
                return false;
            };
            if at >= start + len || !self.access.get(start).is_some_and(|d| d.contains(&dev)) {
                return false;
            }
            at = start + len;
        }
        true
    }

    /// The granule of data at `va`: `(chunk or legacy start, index)`.
    fn locate(&self, va: u64) -> Option<(bool, u64, usize)> {
        if let Some((start, (size, h))) = self.mappings.range(..=va).next_back() {
            if va < start + size {
                return Some((true, *h, ((va - start) / self.gran) as usize));
            }
        }
        let (start, data) = self.legacy.range(..=va).next_back()?;
        let i = ((va - start) / self.gran) as usize;
        (i < data.len()).then_some((false, *start, i))
    }

    /// Host buffers alive, and their bytes.
    pub fn host_buffers(&self) -> (usize, u64) {
        let bytes = self.host.values().map(|d| d.len() as u64 * self.gran).sum();
        (self.host.len(), bytes)
    }

    /// The host buffer granule at `host`: (buffer start, index), if `[host, host+size)` lies
    /// inside one buffer on granule bounds.
    fn host_at(&self, host: u64, size: u64) -> DrvResult<(u64, usize)> {
        let (start, data) = self.host.range(..=host).next_back().ok_or(INVALID)?;
        let (off, len) = (host - start, data.len() as u64 * self.gran);
        if !self.aligned(off) || !self.aligned(size) || off + size > len {
            return Err(INVALID);
        }
        Ok((*start, (off / self.gran) as usize))
    }

    /// The data tag of the granule at `va`, through a mapping or a standard allocation.
    pub fn read(&self, va: u64) -> Option<u64> {
        match self.locate(va)? {
            (true, h, i) => Some(self.chunks[&h].data[i]),
            (false, s, i) => Some(self.legacy[&s][i]),
        }
    }

    /// Write `tag` into every granule of `[va, va+size)`; false if some are not memory.
    pub fn write(&mut self, va: u64, size: u64, tag: u64) -> bool {
        let mut at = va;
        while at < va + size {
            match self.locate(at) {
                Some((true, h, i)) => self.chunks.get_mut(&h).unwrap().data[i] = tag,
                Some((false, s, i)) => self.legacy.get_mut(&s).unwrap()[i] = tag,
                None => return false,
            }
            at += self.gran;
        }
        true
    }

    /// Tags of every granule in `[va, va+size)`, `None` where there is no memory.
    pub fn read_range(&self, va: u64, size: u64) -> Vec<Option<u64>> {
        (0..size.div_ceil(self.gran))
            .map(|i| self.read(va + i * self.gran))
            .collect()
    }

    fn enter(&mut self, op: Op) -> DrvResult<()> {
        self.calls[op.index()] += 1;
        match self.inject.iter().position(|(o, _)| *o == op) {
            Some(i) => match self.inject.remove(i).1 {
                DrvError(0) => Ok(()),
                e => Err(e),
            },
            None => Ok(()),
        }
    }

    fn aligned(&self, x: u64) -> bool {
        x.is_multiple_of(self.gran)
    }

    fn reservation_containing(&self, va: u64, size: u64) -> bool {
        self.reservations
            .range(..=va)
            .next_back()
            .is_some_and(|(s, l)| va + size <= s + l)
    }

    /// Whether `[va, va+size)` overlaps a reservation or a standard allocation.
    fn taken(&self, va: u64, size: u64) -> bool {
        let hit = |m: &BTreeMap<u64, u64>| {
            m.range(..va + size)
                .next_back()
                .is_some_and(|(s, l)| s + l > va)
        };
        let legacy: BTreeMap<u64, u64> = self
            .legacy
            .iter()
            .map(|(s, d)| (*s, d.len() as u64 * self.gran))
            .collect();
        hit(&self.reservations) || hit(&legacy) || hit(&self.regions)
    }

    /// The lowest free slot of `size` bytes inside a sub-allocator region.
    fn region_slot(&self, size: u64) -> Option<u64> {
        let legacy: BTreeMap<u64, u64> = self
            .legacy
            .iter()
            .map(|(s, d)| (*s, d.len() as u64 * self.gran))
            .collect();
        for (start, len) in &self.regions {
            let mut at = *start;
            while at + size <= start + len {
                let busy = legacy
                    .range(..at + size)
                    .next_back()
                    .is_some_and(|(s, l)| s + l > at);
                if !busy {
                    return Some(at);
                }
                at += self.gran;
            }
        }
        None
    }

    /// Lowest free range of `size` bytes at or above `VA_BASE`.
    fn first_fit(&self, size: u64) -> u64 {
        self.first_fit_from(VA_BASE, size)
    }

    fn first_fit_from(&self, from: u64, size: u64) -> u64 {
        let mut at = from;
        while self.taken(at, size) {
            at += self.gran;
        }
        at
    }

    /// The starts of the mappings that cover exactly `[va, va+size)`, as the driver requires
    /// for unmapping and setting access.
    /// Ok if the mappings starting in `[va, va+size)` cover it exactly from `va` (what the
    /// driver takes for an unmap or an access call). Allocates nothing, so a test can count
    /// the books' allocations alone (`coalesce::tests::allocs`).
    fn covered_whole(&self, va: u64, size: u64) -> DrvResult<()> {
        let mut inside = self.mappings.range(va..va + size);
        let first = inside.next().map(|(s, _)| *s);
        let covered: u64 = self.mappings.range(va..va + size).map(|(_, m)| m.0).sum();
        if first != Some(va) || covered != size {
            return Err(INVALID);
        }
        Ok(())
    }
}

impl Driver for FakeDriver {
    fn device(&self) -> i32 {
        self.dev
    }

    fn granularity(&self) -> u64 {
        self.gran
    }

    fn create(&mut self, size: u64) -> DrvResult<ChunkHandle> {
        self.enter(Op::Create)?;
        if size == 0 || !self.aligned(size) {
            return Err(INVALID);
        }
        if size > self.free_bytes() {
            return Err(DrvError::OUT_OF_MEMORY);
        }
        let h = self.next_handle;
        self.next_handle += 1;
        let data = vec![0; (size / self.gran) as usize];
        self.chunks.insert(
            h,
            Chunk {
                size,
                mapped: 0,
                data,
            },
        );
        Ok(h)
    }

    fn release(&mut self, h: ChunkHandle) -> DrvResult<()> {
        self.enter(Op::Release)?;
        match self.chunks.get(&h) {
            // The real driver defers the release of a mapped chunk; the pool never relies on it.
            Some(c) if c.mapped == 0 => {
                self.chunks.remove(&h);
                Ok(())
            }
            _ => Err(INVALID),
        }
    }

    fn reserve(&mut self, size: u64) -> DrvResult<u64> {
        self.enter(Op::Reserve)?;
        if size == 0 || !self.aligned(size) {
            return Err(INVALID);
        }
        let at = self.first_fit_from(self.reserve_floor, size);
        self.reservations.insert(at, size);
        Ok(at)
    }

    fn reserve_at(&mut self, va: u64, size: u64) -> DrvResult<u64> {
        self.enter(Op::Reserve)?;
        if size == 0 || !self.aligned(size) || !self.aligned(va) {
            return Err(INVALID);
        }
        let at = if va != 0 && !self.taken(va, size) {
            va
        } else {
            self.first_fit_from(self.reserve_floor, size)
        };
        self.reservations.insert(at, size);
        Ok(at)
    }

    fn free_va(&mut self, va: u64, size: u64) -> DrvResult<()> {
        self.enter(Op::FreeVa)?;
        if self.reservations.get(&va) != Some(&size)
            || self.mappings.range(va..va + size).count() > 0
        {
            return Err(INVALID);
        }
        self.reservations.remove(&va);
        Ok(())
    }

    fn map(&mut self, va: u64, size: u64, h: ChunkHandle) -> DrvResult<()> {
        self.enter(Op::Map)?;
        let Some(chunk) = self.chunks.get(&h) else {
            return Err(INVALID);
        };
        let overlaps = self
            .mappings
            .range(..va + size)
            .next_back()
            .is_some_and(|(s, (l, _))| s + l > va);
        if chunk.size != size
            || !self.aligned(va)
            || !self.reservation_containing(va, size)
            || overlaps
        {
            return Err(INVALID);
        }
        self.chunks.get_mut(&h).unwrap().mapped += 1;
        self.mappings.insert(va, (size, h));
        Ok(())
    }

    fn unmap(&mut self, va: u64, size: u64) -> DrvResult<()> {
        self.enter(Op::Unmap)?;
        if self
            .in_flight
            .iter()
            .any(|&(s, n)| s < va + size && va < s + n)
        {
            self.unmapped_in_flight += 1;
        }
        self.covered_whole(va, size)?;
        let under = |&(s, n): &(u64, u64)| {
            self.mappings
                .range(va..va + size)
                .any(|(m, (len, _))| s < m + len && *m < s + n)
        };
        if self.watched.iter().any(under) {
            self.unmapped_watched += 1;
        }
        while let Some((&s, _)) = self.mappings.range(va..va + size).next() {
            let (_, h) = self.mappings.remove(&s).unwrap();
            self.access.remove(&s);
            self.chunks.get_mut(&h).unwrap().mapped -= 1;
        }
        Ok(())
    }

    fn set_access(
        &mut self,
        va: u64,
        size: u64,
        readers: &[i32],
        revoked: &[i32],
    ) -> DrvResult<()> {
        self.enter(Op::SetAccess)?;
        self.covered_whole(va, size)?;
        for (&s, _) in self.mappings.range(va..va + size) {
            let e = self.access.entry(s).or_default();
            e.retain(|d| !revoked.contains(d));
            for d in readers {
                if !e.contains(d) {
                    e.push(*d);
                }
            }
        }
        Ok(())
    }

    fn legacy_alloc(&mut self, size: u64) -> DrvResult<u64> {
        self.enter(Op::LegacyAlloc)?;
        let size = size.div_ceil(self.gran) * self.gran;
        if size == 0 || size > self.free_bytes() {
            return Err(DrvError::OUT_OF_MEMORY);
        }
        let at = match self.legacy_placement {
            Placement::SharedLowHeap => self.first_fit(size),
            Placement::SeparateHeap => {
                let mut at = LEGACY_TOP - size;
                while self.taken(at, size) {
                    at -= self.gran;
                }
                at
            }
            Placement::Suballocator => match self.region_slot(size) {
                Some(at) => at,
                None => {
                    let len = 2 * size;
                    let start = self.first_fit(len);
                    self.regions.insert(start, len);
                    start + len - size
                }
            },
        };
        self.legacy.insert(at, vec![0; (size / self.gran) as usize]);
        Ok(at)
    }

    fn legacy_free(&mut self, ptr: u64) -> DrvResult<()> {
        self.enter(Op::LegacyFree)?;
        self.legacy.remove(&ptr).map(|_| ()).ok_or(INVALID)
    }

    fn copy(&mut self, dst: u64, src: u64, size: u64) -> DrvResult<()> {
        self.enter(Op::Copy)?;
        let data = self.read_range(src, size);
        if data.iter().any(Option::is_none)
            || self.read_range(dst, size).iter().any(Option::is_none)
        {
            return Err(INVALID);
        }
        for (i, d) in data.into_iter().enumerate() {
            self.write(dst + i as u64 * self.gran, self.gran, d.unwrap());
        }
        Ok(())
    }

    fn legacy_handle(&mut self, ptr: u64) -> DrvResult<IpcHandle> {
        self.enter(Op::IpcHandle)?;
        let (start, data) = self.legacy.range(..=ptr).next_back().ok_or(INVALID)?;
        if ptr >= start + data.len() as u64 * self.gran {
            return Err(INVALID);
        }
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(&start.to_le_bytes());
        h[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
        h[16..20].copy_from_slice(b"FAKE");
        Ok(h)
    }

    fn synchronize(&mut self) -> DrvResult<()> {
        self.enter(Op::Sync)?;
        self.in_flight.clear();
        Ok(())
    }

    fn wait_default_stream(&mut self) -> DrvResult<()> {
        self.enter(Op::Sync)?;
        self.default_stream_waits += 1;
        self.in_flight.clear();
        Ok(())
    }

    fn copy_and_hold(
        &mut self,
        copies: &[(u64, u64, u64)],
        peers: &[i32],
        wait: super::PeerWait,
    ) -> DrvResult<super::Held> {
        self.held_copies.push(copies.len());
        self.held_peers.push(peers.to_vec());
        self.peer_waits.push(wait);
        super::copy_after_wait(self, copies)?;
        let n = peers.len() as u32;
        Ok(match self.peer_holds_start {
            true => super::Held::default().with_peers(n, 0),
            false => super::Held::default().with_peers(0, n),
        })
    }

    fn synchronize_peer(&mut self, dev: i32) -> DrvResult<()> {
        self.enter(Op::Sync)?;
        self.peers_synced.push(dev);
        Ok(())
    }

    fn create_as(&mut self, size: u64, _props: super::PageProps) -> DrvResult<ChunkHandle> {
        self.create(size)
    }

    fn free_memory(&mut self) -> DrvResult<u64> {
        Ok(self.free_bytes())
    }

    fn now_ns(&mut self) -> u64 {
        match self.clock {
            Some(ns) => ns,
            None => {
                self.ticks += 1_000_000_000;
                self.ticks
            }
        }
    }

    fn set_access_flags(&mut self, va: u64, size: u64, descs: &[(i32, u32)]) -> DrvResult<()> {
        let readers: Vec<i32> = descs.iter().filter(|d| d.1 != 0).map(|d| d.0).collect();
        let revoked: Vec<i32> = descs.iter().filter(|d| d.1 == 0).map(|d| d.0).collect();
        self.set_access(va, size, &readers, &revoked)
    }

    /// Host copies hold each granule's tag as 8 little-endian bytes.
    fn save(&mut self, src: u64, size: u64) -> DrvResult<Vec<u8>> {
        self.enter(Op::Copy)?;
        let mut out = Vec::new();
        for t in self.read_range(src, size) {
            out.extend_from_slice(&t.ok_or(INVALID)?.to_le_bytes());
        }
        Ok(out)
    }

    fn load(&mut self, dst: u64, data: &[u8]) -> DrvResult<()> {
        self.enter(Op::Copy)?;
        let n = data.len() as u64 / 8;
        if self
            .read_range(dst, n * self.gran)
            .iter()
            .any(Option::is_none)
        {
            return Err(INVALID);
        }
        for (i, t) in data.chunks_exact(8).enumerate() {
            let tag = u64::from_le_bytes(t.try_into().unwrap());
            self.write(dst + i as u64 * self.gran, self.gran, tag);
        }
        Ok(())
    }

    fn host_alloc(&mut self, sizes: &[u64]) -> DrvResult<Vec<u64>> {
        self.enter(Op::LegacyAlloc)?;
        let total: u64 = sizes.iter().sum();
        if sizes.iter().any(|s| *s == 0 || !self.aligned(*s)) {
            return Err(INVALID);
        }
        if total > self.host_capacity {
            return Err(DrvError::OUT_OF_MEMORY);
        }
        self.host_capacity -= total;
        Ok(sizes
            .iter()
            .map(|s| {
                let at = self.next_host;
                self.next_host += s.next_multiple_of(1 << 30);
                self.host.insert(at, vec![0; (s / self.gran) as usize]);
                at
            })
            .collect())
    }

    fn host_free(&mut self, host: u64) {
        if let Some(d) = self.host.remove(&host) {
            self.host_capacity = self
                .host_capacity
                .saturating_add(d.len() as u64 * self.gran);
        }
    }

    fn copy_to_host(&mut self, host: u64, src: u64, size: u64) -> DrvResult<()> {
        self.enter(Op::Copy)?;
        let (start, i) = self.host_at(host, size)?;
        let data = self.read_range(src, size);
        if data.iter().any(Option::is_none) {
            return Err(INVALID);
        }
        let buf = self.host.get_mut(&start).unwrap();
        for (k, t) in data.into_iter().enumerate() {
            buf[i + k] = t.unwrap();
        }
        Ok(())
    }

    fn copy_from_host(&mut self, dst: u64, host: u64, size: u64) -> DrvResult<()> {
        self.enter(Op::Copy)?;
        let (start, i) = self.host_at(host, size)?;
        if self.read_range(dst, size).iter().any(Option::is_none) {
            return Err(INVALID);
        }
        let tags: Vec<u64> = self.host[&start][i..i + (size / self.gran) as usize].to_vec();
        for (k, t) in tags.into_iter().enumerate() {
            self.write(dst + k as u64 * self.gran, self.gran, t);
        }
        Ok(())
    }

    fn wait_copies(&mut self) -> DrvResult<()> {
        self.enter(Op::Sync)
    }

    fn export_fd(&mut self, h: ChunkHandle) -> DrvResult<std::os::fd::OwnedFd> {
        if !self.chunks.contains_key(&h) {
            return Err(INVALID);
        }
        std::fs::File::open("/dev/null")
            .map(Into::into)
            .map_err(|_| INVALID)
    }
}
