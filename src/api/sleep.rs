//! Pausing and resuming the process's memory at fixed addresses (`expseg.pause()`,
//! `expseg.resume()`, `expseg pause PID`): every device's pool blocks and coalesced pages,
//! chosen by tag, offloaded to page-locked host memory or discarded, their physical memory
//! given back to the driver; on resume made again at the same addresses with the bytes back.
//!
//! Tags: allocations a thread makes while it has a tag set (`with expseg.tag("kv_cache"):`)
//! carry it. The tag is the thread's, as PyTorch's memory pools are (`expseg.tag` also
//! gives the tag a PyTorch memory pool of its own, so no untagged tensor shares its pages). A tag is named by the
//! 32-bit FNV-1a hash of its name (never 0: 0 is "no tag"), so `expseg pause --tag NAME`
//! from outside names the same tag without a table.
//!
//! The caller's duty: no work may run on paused memory. A kernel that touches it faults (the
//! addresses are reserved but unmapped, as in torch_memory_saver); an allocator call that
//! touches it (a free, an unmap, an IPC export) resumes that memory first.

use super::state::coalescers::{self, in_context};
use super::state::{self, STATE_STARTED};
use super::trace::record;
use crate::coalesce::trace::Call;
use crate::gpu::{cuda, Op};
use crate::hostcopy::Paused;
use std::sync::atomic::Ordering;
use std::time::Instant;

thread_local! {
    /// The tag the calling thread's allocations get now (0: none).
    static CURRENT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// A tag's number: its name's 32-bit FNV-1a hash, 0 avoided.
pub fn tag_of(name: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h.max(1)
}

/// Set the tag of the calling thread's allocations from now on (None: no tag). Returns the
/// previous one.
pub fn set_tag(tag: Option<u32>) -> u32 {
    CURRENT.with(|c| c.replace(tag.unwrap_or(0)))
}

/// The tag an allocation the calling thread makes now gets.
pub fn current_tag() -> u32 {
    CURRENT.with(|c| c.get())
}

/// Bytes of physical memory paused now, every device. `wait`: the locks are taken as a
/// program call takes them (the program's own query, `expseg status` on the socket thread:
/// an answer read while another thread held a lock was 0, which a test met under load).
/// Without: never waits, 0 for a device whose lock is busy elsewhere (the exit report, which
/// may run from a signal handler).
pub fn paused_bytes(wait: bool) -> u64 {
    let mut n = 0;
    if STATE_STARTED.load(Ordering::Acquire) {
        let st = match wait {
            true => Some(state::lock()),
            false => state::STATE.try_lock().ok(),
        };
        if let Some(mut st) = st {
            n += st.open_pools().map(|(_, p)| p.paused_bytes()).sum::<u64>();
        }
    }
    if coalescers::started() {
        let v = match wait {
            true => Some(coalescers::books()),
            false => coalescers::VMM.try_lock().ok(),
        };
        if let Some(mut v) = v {
            n += v.all().map(|c| c.paused_bytes()).sum::<u64>();
        }
    }
    n
}

/// What a pause or resume did: bytes, bytes copied, bytes left alone (shared), seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct Outcome {
    pub bytes: u64,
    pub offloaded: u64,
    pub shared: u64,
    pub seconds: f64,
}

/// A pause or resume that failed: the first failure's CUDA code, and what was done anyway
/// (a pause pauses what it can on each device; a resume resumes what fits).
#[derive(Clone, Copy, Debug, Default)]
pub struct Failed {
    pub code: u32,
    pub done: Outcome,
}

/// Pause the memory of tag `tag` (None: every tag), offloading it to host memory or
/// discarding it. Err: the first device's failure code, with the bytes paused anyway (what
/// paused before it stays paused; an out-of-memory pause of host memory pauses nothing on that
/// device).
///
/// `by_program`: the program asked (`expseg.pause()`), so what is held beyond live memory
/// goes back first, live pages moved as its trim moves them; asked from outside (`expseg
/// pause PID`, on the socket thread) only what needs no move.
pub fn pause(tag: Option<u32>, discard: bool, by_program: bool) -> Result<Outcome, Failed> {
    let t0 = Instant::now();
    let choose = |t: u32| (tag.is_none() || tag == Some(t)).then_some(discard);
    let mut total = Paused::default();
    let mut first_err = None;
    // A device's result, and the bytes it holds paused now beyond before (what a failed
    // pause paused anyway).
    let mut add = |r: Result<Paused, crate::gpu::DrvError>, grew: u64| match r {
        Ok(p) => {
            total.bytes += p.bytes;
            total.offloaded += p.offloaded;
            total.shared += p.shared;
            total.mixed += p.mixed;
            total.pin_ns += p.pin_ns;
        }
        Err(e) => {
            total.bytes += grew;
            first_err.get_or_insert(e.0);
        }
    };
    if state::forked() {
        return Err(Failed {
            code: NOT_PERMITTED,
            done: Outcome::default(),
        });
    }
    if STATE_STARTED.load(Ordering::Acquire) {
        let mut st = state::lock();
        if let Ok(t) = st.driver.as_ref().map(|t| *t) {
            for (dev, p) in st.open_pools() {
                let before = p.paused_bytes();
                let r = cuda::with_primary(t, dev, || p.pause(&choose));
                add(r, p.paused_bytes().saturating_sub(before));
            }
        }
    }
    if coalescers::started() {
        for c in coalescers::lock().all() {
            let before = c.paused_bytes();
            let r = in_context(c, |c| {
                if by_program {
                    c.allow_moves(true);
                }
                c.pause(&choose)
            });
            let bytes = r.as_ref().map(|p| p.bytes).map_err(|e| *e);
            record(c, Call::Pause { tag, discard }, &bytes);
            add(r, c.paused_bytes().saturating_sub(before));
        }
    }
    let out = Outcome {
        bytes: total.bytes,
        offloaded: total.offloaded,
        shared: total.shared,
        seconds: t0.elapsed().as_secs_f64(),
    };
    log::info!(
        "paused {} bytes ({} to host, {} shared left alone) in {:.3} s, {:.3} s of it page-locking host memory",
        out.bytes,
        out.offloaded,
        out.shared,
        out.seconds,
        total.pin_ns as f64 * 1e-9
    );
    if out.shared > 0 {
        log::warn!(
            "{} bytes shared with other processes (IPC) were not paused",
            out.shared
        );
    }
    if total.mixed > 0 {
        log::warn!(
            "{} bytes were not paused: their handles also hold pages of a tag this pause does not take (pages of one tag mapped where another's were released)",
            total.mixed
        );
    }
    super::hostkeep::after_sleep();
    match first_err {
        Some(code) => Err(Failed { code, done: out }),
        None => Ok(out),
    }
}

/// Resume the paused memory of `tag` (None: all). Err (2: out of memory): what could be made
/// is resumed (its bytes in the answer), the rest stays paused with its host copy; call again.
pub fn resume(tag: Option<u32>) -> Result<Outcome, Failed> {
    if state::forked() {
        return Err(Failed {
            code: NOT_PERMITTED,
            done: Outcome::default(),
        });
    }
    let t0 = Instant::now();
    let choose = |t: u32| tag.is_none() || tag == Some(t);
    let mut bytes = 0;
    let mut first_err = None;
    // Driver nanoseconds per operation spent in the resume (the log's profile).
    let mut ns = [0u64; Op::ALL.len()];
    if STATE_STARTED.load(Ordering::Acquire) {
        let mut st = state::lock();
        if let Ok(t) = st.driver.as_ref().map(|t| *t) {
            for (dev, p) in st.open_pools() {
                let before = (p.paused_bytes(), p.stats().driver_ns);
                if let Err(e) = cuda::with_primary(t, dev, || p.resume(&choose)) {
                    first_err.get_or_insert(e.0);
                }
                bytes += before.0 - p.paused_bytes();
                for (i, n) in p.stats().driver_ns.iter().enumerate() {
                    ns[i] += n - before.1[i];
                }
            }
        }
    }
    if coalescers::started() {
        for c in coalescers::lock().all() {
            let before = (c.paused_bytes(), c.driver_calls().to_vec());
            let r = in_context(c, |c| c.resume(&choose));
            record(c, Call::Resume { tag }, &r);
            if let Err(e) = r {
                first_err.get_or_insert(e.0);
            }
            bytes += before.0 - c.paused_bytes();
            for (i, op) in Op::ALL.iter().enumerate() {
                ns[i] += crate::clock::ns(c.driver_calls()[op.index()].1 - before.1[op.index()].1);
            }
        }
    }
    let profile: Vec<String> = Op::ALL
        .iter()
        .zip(ns)
        .filter(|(_, n)| *n > 0)
        .map(|(op, n)| format!("{} {:.1} ms", op.name(), n as f64 * 1e-6))
        .collect();
    let out = Outcome {
        bytes,
        seconds: t0.elapsed().as_secs_f64(),
        ..Outcome::default()
    };
    super::hostkeep::after_sleep();
    match first_err {
        Some(e) => {
            log::error!(
                "resume: {bytes} bytes resumed, {} still paused: CUresult {e} (nothing is lost; resume again when memory is free)",
                paused_bytes(false)
            );
            Err(Failed { code: e, done: out })
        }
        None => {
            log::info!(
                "resumed {bytes} bytes in {:.3} s (driver: {})",
                out.seconds,
                profile.join(", ")
            );
            Ok(out)
        }
    }
}

/// `CUDA_ERROR_NOT_PERMITTED`: a forked child's CUDA state is not its own.
const NOT_PERMITTED: u32 = 800;
