//! A fake driver for tests: it keeps the books a real driver keeps and refuses every misuse
//! the real one would refuse (or that would be a bug in the pool even where the real driver is
//! lenient), so pool tests check the pool's driver usage as well as its answers.
//!
//! Capacity is a byte budget; `fail` injects an error into the next call of one operation.

use super::{ChunkHandle, Driver, DrvError, DrvResult, Op};
use std::collections::{BTreeMap, HashMap};

const VA_BASE: u64 = 0x7000_0000_0000;
/// `CUDA_ERROR_INVALID_VALUE`: what the fake answers to misuse.
const INVALID: DrvError = DrvError(1);

#[derive(Debug)]
pub struct FakeDriver {
    dev: i32,
    gran: u64,
    capacity: u64,
    next_handle: ChunkHandle,
    /// handle -> (size, times mapped)
    chunks: HashMap<ChunkHandle, (u64, u32)>,
    /// reservation start -> size
    reservations: BTreeMap<u64, u64>,
    /// mapping start -> (size, handle)
    mappings: BTreeMap<u64, (u64, ChunkHandle)>,
    /// mapping start -> devices with access
    access: HashMap<u64, Vec<i32>>,
    /// calls per operation, in `Op::ALL` order
    pub calls: [u64; 7],
    inject: Vec<(Op, DrvError)>,
    /// Let one chunk be mapped at several addresses at once.
    pub allow_shared_mapping: bool,
}

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
            calls: [0; 7],
            inject: Vec::new(),
            allow_shared_mapping: false,
        }
    }

    /// Make the next call of `op` fail with `err`.
    pub fn fail(&mut self, op: Op, err: DrvError) {
        self.inject.push((op, err));
    }

    /// Forget failures injected with `fail` that no call has met.
    pub fn clear_failures(&mut self) {
        self.inject.clear();
    }

    /// Physical bytes currently created.
    pub fn used(&self) -> u64 {
        self.chunks.values().map(|c| c.0).sum()
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

    pub fn total_calls(&self) -> u64 {
        self.calls.iter().sum()
    }

    pub fn calls_of(&self, op: Op) -> u64 {
        self.calls[Op::ALL.iter().position(|o| *o == op).unwrap()]
    }

    /// The handle mapped at `va` (any address inside a mapping).
    pub fn chunk_at(&self, va: u64) -> Option<ChunkHandle> {
        let (start, (size, h)) = self.mappings.range(..=va).next_back()?;
        (va < start + size).then_some(*h)
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

    fn enter(&mut self, op: Op) -> DrvResult<()> {
        self.calls[Op::ALL.iter().position(|o| *o == op).unwrap()] += 1;
        match self.inject.iter().position(|(o, _)| *o == op) {
            Some(i) => Err(self.inject.remove(i).1),
            None => Ok(()),
        }
    }

    fn aligned(&self, x: u64) -> bool {
        x.is_multiple_of(self.gran)
    }

    /// The starts of the mappings that cover exactly `[va, va+size)`, as the driver requires
    /// for unmapping and setting access.
    fn mappings_covering(&self, va: u64, size: u64) -> DrvResult<Vec<u64>> {
        let inside: Vec<u64> = self
            .mappings
            .range(va..va + size)
            .map(|(s, _)| *s)
            .collect();
        let covered: u64 = inside.iter().map(|s| self.mappings[s].0).sum();
        if inside.first() != Some(&va) || covered != size {
            return Err(INVALID);
        }
        Ok(inside)
    }

    fn reservation_containing(&self, va: u64, size: u64) -> bool {
        self.reservations
            .range(..=va)
            .next_back()
            .is_some_and(|(s, l)| va + size <= s + l)
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
        self.chunks.insert(h, (size, 0));
        Ok(h)
    }

    fn release(&mut self, h: ChunkHandle) -> DrvResult<()> {
        self.enter(Op::Release)?;
        match self.chunks.get(&h) {
            // The real driver defers the release of a mapped chunk; the pool never relies on it.
            Some((_, 0)) => {
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
        // First fit from the bottom, so freed ranges are handed out again as a real driver does.
        let mut at = VA_BASE;
        for (s, l) in &self.reservations {
            if at + size <= *s {
                break;
            }
            at = at.max(s + l);
        }
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
        // A chunk mapped twice would be one memory behind two allocations: refuse it, so
        // pool tests catch it (the real driver allows it; only IPC code may do it on purpose).
        let twice = chunk.1 > 0 && !self.allow_shared_mapping;
        if chunk.0 != size
            || twice
            || !self.aligned(va)
            || !self.reservation_containing(va, size)
            || overlaps
        {
            return Err(INVALID);
        }
        self.chunks.get_mut(&h).unwrap().1 += 1;
        self.mappings.insert(va, (size, h));
        Ok(())
    }

    fn unmap(&mut self, va: u64, size: u64) -> DrvResult<()> {
        self.enter(Op::Unmap)?;
        for s in self.mappings_covering(va, size)? {
            let (_, h) = self.mappings.remove(&s).unwrap();
            self.access.remove(&s);
            self.chunks.get_mut(&h).unwrap().1 -= 1;
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
        for s in self.mappings_covering(va, size)? {
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
}
