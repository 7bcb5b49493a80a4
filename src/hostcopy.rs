//! Paused memory's bytes on the host: laid out in page-locked buffers, copied there, copied
//! back, and each buffer freed when the last bytes in it are back on the device.
//!
//! Used by the pool and the coalescer when a process is paused (`expseg.pause()`); the
//! device addresses never change, so what is saved is a list of (device address, length)
//! pieces and where each waits on the host.

use crate::gpu::{Driver, DrvResult};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of emptied buffers kept for the next pause, every `HostCopies` of the process
/// together: read without a lock (the watcher of `api::hostkeep`, `expseg.stats()`).
static SPARE_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes of host buffers kept for the next pause in this process.
pub fn spare_bytes_everywhere() -> u64 {
    SPARE_BYTES.load(Ordering::Relaxed)
}

/// Largest host buffer: big enough that a copy runs at full speed, small enough that several
/// threads can page-lock a large pause in parallel.
pub const BUFFER: u64 = 256 << 20;

/// What a pause did on one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Paused {
    /// Physical bytes given back to the driver.
    pub bytes: u64,
    /// Of them, bytes copied to the host.
    pub offloaded: u64,
    /// Bytes left alone because another process may use them (exported pages, shared or
    /// mirrored allocations).
    pub shared: u64,
    /// Bytes left alone because their handle also holds pages of a tag the pause does not
    /// take (pages of another tag mapped onto its released or grown-ahead bytes: they could
    /// only be told apart by moving live pages).
    pub mixed: u64,
    /// Nanoseconds spent making page-locked host buffers.
    pub pin_ns: u64,
}

/// Which memory a pause takes, by tag: `Some(discard)` to pause it, `None` to leave it.
pub type Choose<'a> = &'a dyn Fn(u32) -> Option<bool>;

/// Buffers made at once (16 × 256 MiB = 4 GiB: one per pinning thread): the copies into
/// one batch overlap the making of the next.
pub const BATCH: usize = 16;

/// One piece of device memory waiting on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Piece {
    dev: u64,
    len: u64,
    /// Host address inside buffer `buf`.
    host: u64,
    buf: u64,
}

/// What one item (a handle's live pages, a block) left on the host.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Saved {
    pieces: Vec<Piece>,
}

impl Saved {
    /// Bytes saved.
    pub fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len).sum()
    }
}

#[derive(Debug)]
struct Buffer {
    size: u64,
    /// Items with pieces in it that are not back yet.
    users: u32,
}

/// The host buffers of one driver's paused memory.
#[derive(Debug, Default)]
pub struct HostCopies {
    /// host address -> buffer
    bufs: BTreeMap<u64, Buffer>,
    /// Keep emptied buffers for the next pause (opt-in); all are then `BUFFER` bytes.
    pub keep: bool,
    /// Emptied buffers kept (`keep`).
    spare: Vec<u64>,
    /// Nanoseconds the last `save` waited for buffers to be made (page-locking).
    pub last_pin_ns: u64,
}

impl HostCopies {
    /// Bytes waiting on the host (whole buffers), and kept for the next pause.
    pub fn held(&self) -> u64 {
        self.bufs.values().map(|b| b.size).sum::<u64>() + self.spare.len() as u64 * BUFFER
    }

    /// Free the buffers kept for the next pause: the bytes freed.
    pub fn release_spare<D: Driver>(&mut self, drv: &mut D) -> u64 {
        let n = self.spare.len() as u64 * BUFFER;
        SPARE_BYTES.fetch_sub(n, Ordering::Relaxed);
        for h in self.spare.drain(..) {
            drv.host_free(h);
        }
        n
    }

    /// Buffers of `sizes`: kept ones first, then made (`keep`: every one `BUFFER` bytes).
    fn take<D: Driver>(&mut self, drv: &mut D, sizes: &[u64]) -> DrvResult<Vec<u64>> {
        let reuse = self.spare.len().min(sizes.len());
        let mut out: Vec<u64> = self.spare.drain(..reuse).collect();
        SPARE_BYTES.fetch_sub(reuse as u64 * BUFFER, Ordering::Relaxed);
        if reuse < sizes.len() {
            match drv.host_alloc(&sizes[reuse..]) {
                Ok(made) => out.extend(made),
                Err(e) => {
                    SPARE_BYTES.fetch_add(out.len() as u64 * BUFFER, Ordering::Relaxed);
                    self.spare.extend(out);
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// A buffer no item uses any more: kept or freed.
    fn empty<D: Driver>(&mut self, drv: &mut D, h: u64) {
        match self.keep {
            true => {
                SPARE_BYTES.fetch_add(BUFFER, Ordering::Relaxed);
                self.spare.push(h);
            }
            false => drv.host_free(h),
        }
    }

    /// Copy every item's ranges `(device address, length)` to new host buffers and wait for
    /// the copies: one `Saved` per item. On failure every buffer made is freed and nothing
    /// else changed (the device memory is untouched). Lengths are multiples of the
    /// driver's granularity.
    pub fn save<D: Driver>(
        &mut self,
        drv: &mut D,
        items: &[Vec<(u64, u64)>],
    ) -> DrvResult<Vec<Saved>> {
        let total: u64 = items.iter().flatten().map(|r| r.1).sum();
        if total == 0 {
            return Ok(items.iter().map(|_| Saved::default()).collect());
        }
        let keep = self.keep;
        let sizes: Vec<u64> = (0..total.div_ceil(BUFFER))
            .map(|i| match keep {
                true => BUFFER,
                false => (total - i * BUFFER).min(BUFFER),
            })
            .collect();
        // Lay the ranges out back to back across the buffers, in order: (buffer, offset).
        let mut out = Vec::with_capacity(items.len());
        let (mut b, mut at) = (0usize, 0u64);
        for item in items {
            let mut s = Saved::default();
            for &(dev, len) in item {
                let mut done = 0;
                while done < len {
                    if at == sizes[b] {
                        b += 1;
                        at = 0;
                    }
                    let n = (len - done).min(sizes[b] - at);
                    s.pieces.push(Piece {
                        dev: dev + done,
                        len: n,
                        host: at,
                        buf: b as u64,
                    });
                    at += n;
                    done += n;
                }
            }
            out.push(s);
        }
        // Buffers are made a batch at a time; the copies into one batch run on the device
        // while the host makes the next.
        let mut bufs: Vec<u64> = Vec::with_capacity(sizes.len());
        let mut queued = 0usize; // pieces queued, in layout order
        let order: Vec<(usize, usize)> = out
            .iter()
            .enumerate()
            .flat_map(|(i, s)| (0..s.pieces.len()).map(move |k| (i, k)))
            .collect();
        let mut result = Ok(());
        self.last_pin_ns = 0;
        for batch in sizes.chunks(BATCH) {
            let t = std::time::Instant::now();
            let made = self.take(drv, batch);
            self.last_pin_ns += t.elapsed().as_nanos() as u64;
            match made {
                Ok(made) => bufs.extend(made),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            while let Some(&(i, k)) = order.get(queued) {
                let p = &mut out[i].pieces[k];
                if p.buf as usize >= bufs.len() {
                    break;
                }
                p.buf = bufs[p.buf as usize];
                p.host += p.buf;
                if let Err(e) = drv.copy_to_host(p.host, p.dev, p.len) {
                    result = Err(e);
                    break;
                }
                queued += 1;
            }
            if result.is_err() {
                break;
            }
        }
        let copied = result.and_then(|_| drv.wait_copies());
        if let Err(e) = copied {
            let _ = drv.wait_copies();
            for h in bufs {
                self.empty(drv, h);
            }
            return Err(e);
        }
        for (h, size) in bufs.iter().zip(&sizes) {
            self.bufs.insert(
                *h,
                Buffer {
                    size: *size,
                    users: 0,
                },
            );
        }
        for s in &out {
            let mut seen: Vec<u64> = s.pieces.iter().map(|p| p.buf).collect();
            seen.dedup();
            for h in seen {
                self.bufs.get_mut(&h).unwrap().users += 1;
            }
        }
        Ok(out)
    }

    /// Queue the copies that put `s` back where it was (the device memory is mapped there
    /// again). The caller waits (`Driver::wait_copies`), then calls [`HostCopies::done`].
    pub fn restore<D: Driver>(&self, drv: &mut D, s: &Saved) -> DrvResult<()> {
        s.pieces
            .iter()
            .try_for_each(|p| drv.copy_from_host(p.dev, p.host, p.len))
    }

    /// `s` is back on the device, or no longer wanted (its memory was freed): buffers that
    /// hold nothing else are freed.
    pub fn done<D: Driver>(&mut self, drv: &mut D, s: Saved) {
        let mut seen: Vec<u64> = s.pieces.iter().map(|p| p.buf).collect();
        seen.dedup();
        for h in seen {
            let Some(b) = self.bufs.get_mut(&h) else {
                continue;
            };
            b.users -= 1;
            if b.users == 0 {
                self.bufs.remove(&h);
                self.empty(drv, h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::fake::FakeDriver;
    use crate::gpu::{DrvError, Op};

    const G: u64 = 1 << 21;

    #[test]
    fn ranges_larger_than_a_buffer_cross_buffers_and_come_back_whole() {
        let mut d = FakeDriver::new(0, G, 8 << 30);
        let big = BUFFER + 3 * G;
        let a = d.reserve(big).unwrap();
        let h = d.create(big).unwrap();
        d.map(a, big, h).unwrap();
        d.set_access(a, big, &[0], &[]).unwrap();
        for i in 0..big / G {
            d.write(a + i * G, G, 1000 + i);
        }
        let mut hc = HostCopies::default();
        let saved = hc
            .save(&mut d, &[vec![(a, G)], vec![(a + G, big - G)]])
            .unwrap();
        assert_eq!(saved[0].bytes() + saved[1].bytes(), big);
        assert_eq!(d.host_buffers(), (2, big));
        for i in 0..big / G {
            d.write(a + i * G, G, 0);
        }
        for s in &saved {
            hc.restore(&mut d, s).unwrap();
        }
        d.wait_copies().unwrap();
        for i in 0..big / G {
            assert_eq!(d.read(a + i * G), Some(1000 + i));
        }
        let mut it = saved.into_iter();
        hc.done(&mut d, it.next().unwrap());
        assert_eq!(
            d.host_buffers().0,
            2,
            "the second item still uses the first buffer"
        );
        hc.done(&mut d, it.next().unwrap());
        assert_eq!(d.host_buffers(), (0, 0));
        assert_eq!(hc.held(), 0);
    }

    #[test]
    fn buffers_are_made_a_batch_at_a_time_and_a_failure_in_a_later_batch_frees_all() {
        let total = (BATCH as u64 + 1) * BUFFER;
        let mut d = FakeDriver::new(0, G, 2 * total);
        let a = d.reserve(total).unwrap();
        let h = d.create(total).unwrap();
        d.map(a, total, h).unwrap();
        for i in 0..total / G {
            d.write(a + i * G, G, 7 + i);
        }
        let mut hc = HostCopies::default();
        let saved = hc.save(&mut d, &[vec![(a, total)]]).unwrap();
        assert_eq!(d.calls_of(Op::LegacyAlloc), 2, "two batches");
        assert_eq!(d.host_buffers(), (BATCH + 1, total));
        for i in 0..total / G {
            d.write(a + i * G, G, 0);
        }
        hc.restore(&mut d, &saved[0]).unwrap();
        d.wait_copies().unwrap();
        assert!((0..total / G).all(|i| d.read(a + i * G) == Some(7 + i)));
        hc.done(&mut d, saved.into_iter().next().unwrap());
        assert_eq!(d.host_buffers(), (0, 0));
        // No host memory for the second batch: the first batch's buffers go too.
        d.host_capacity = BATCH as u64 * BUFFER;
        assert_eq!(
            hc.save(&mut d, &[vec![(a, total)]]),
            Err(DrvError::OUT_OF_MEMORY)
        );
        assert_eq!(d.host_buffers(), (0, 0));
    }

    #[test]
    fn kept_buffers_serve_the_next_pause_and_trim_frees_them() {
        let mut d = FakeDriver::new(0, G, 4 << 30);
        let a = d.reserve(8 * G).unwrap();
        let h = d.create(8 * G).unwrap();
        d.map(a, 8 * G, h).unwrap();
        let mut hc = HostCopies {
            keep: true,
            ..Default::default()
        };
        let s = hc.save(&mut d, &[vec![(a, 8 * G)]]).unwrap();
        assert_eq!(d.host_buffers(), (1, BUFFER), "a whole buffer when kept");
        hc.done(&mut d, s.into_iter().next().unwrap());
        assert_eq!(d.host_buffers().0, 1, "kept");
        let allocs = d.calls_of(Op::LegacyAlloc);
        let s = hc.save(&mut d, &[vec![(a, 4 * G)]]).unwrap();
        assert_eq!(
            d.calls_of(Op::LegacyAlloc),
            allocs,
            "the kept buffer served it"
        );
        hc.done(&mut d, s.into_iter().next().unwrap());
        assert_eq!(hc.release_spare(&mut d), BUFFER);
        assert_eq!(d.host_buffers(), (0, 0));
    }

    #[test]
    fn a_failed_copy_or_no_host_memory_leaves_no_buffer() {
        let mut d = FakeDriver::new(0, G, 1 << 30);
        let a = d.reserve(4 * G).unwrap();
        let h = d.create(4 * G).unwrap();
        d.map(a, 4 * G, h).unwrap();
        let mut hc = HostCopies::default();
        d.fail(Op::Copy, DrvError(700));
        assert_eq!(hc.save(&mut d, &[vec![(a, 4 * G)]]), Err(DrvError(700)));
        assert_eq!(d.host_buffers(), (0, 0));
        d.host_capacity = G;
        assert_eq!(
            hc.save(&mut d, &[vec![(a, 4 * G)]]),
            Err(DrvError::OUT_OF_MEMORY)
        );
        assert_eq!(d.host_buffers(), (0, 0));
        assert_eq!(hc.held(), 0);
    }
}
