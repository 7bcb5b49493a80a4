//! Memory held beyond the program's live memory, given back: how much is held (the report,
//! `expseg.stats()`), `trim` (`expseg.trim()`, and the reclaims other expseg processes send),
//! and making room for an allocation that found none: this process's own held memory first,
//! then what the other expseg processes of the user hold on the same GPU, each asked within a
//! bound (`ipc::reclaim`).
//!
//! With the defaults nothing is held beyond live memory (released at once), so all of this
//! matters where keeping is opted into (`EXPSEG_RELEASE_DELAY`, `EXPSEG_CACHE_MAX`).

use super::state::coalescers::{self, in_context};
use super::state::{self, STATE_STARTED};
use super::trace::record;
use crate::coalesce::trace::Call;
use crate::gpu::cuda;
use crate::gpu::Driver as _;
use crate::ipc::{reclaim, sockdir};
use crate::real;
use crate::stats::GLOBAL;
use once_cell::sync::OnceCell;
use std::sync::atomic::Ordering;

/// Each device's key in reclaims: from its UUID; from its ordinal where the driver cannot say
/// (then only processes that see the same ordering agree, which is all a fake driver has).
fn key_of(dev: i32) -> u64 {
    static KEYS: OnceCell<Vec<u64>> = OnceCell::new();
    let keys = KEYS.get_or_init(|| {
        let Ok(t) = real::driver() else {
            return Vec::new();
        };
        let n = cuda::device_count(t).unwrap_or(0);
        (0..n)
            .map(|d| match cuda::device_uuid(t, d) {
                Some(u) => reclaim::gpu_key(&u),
                None => d as u64,
            })
            .collect()
    });
    usize::try_from(dev)
        .ok()
        .and_then(|i| keys.get(i).copied())
        .unwrap_or(dev as u64)
}

/// Bytes held beyond live memory on every device: the pools' cached blocks, the coalescers'
/// kept handles, stranded pages and handles the driver would not take back yet. Never starts
/// anything; 0 while a lock is busy elsewhere.
pub fn held_beyond_live() -> u64 {
    let mut held = 0;
    if STATE_STARTED.load(Ordering::Acquire) {
        if let Ok(mut st) = state::STATE.try_lock() {
            held += st.open_pools().map(|(_, p)| p.cached_bytes()).sum::<u64>();
        }
    }
    if coalescers::started() {
        if let Ok(mut v) = coalescers::VMM.try_lock() {
            held += v.all().map(|c| c.held_beyond_live()).sum::<u64>();
        }
    }
    held
}

/// Who asks for a trim, and so which live pages may move to give back what they strand.
#[derive(Clone, Copy, PartialEq)]
enum Asker {
    /// The program itself (`expseg.trim()`): every device's, as it asked.
    Program,
    /// An allocation that found no memory: the devices whose allocator's thread this is
    /// (`super::allocator`); another thread may be launching work on the others' pages.
    Allocation,
    /// Another process (its reclaim, on the socket thread): none (`Coalescer::trim_unmoved`).
    Outside,
}

/// Give back everything held beyond live memory on the devices `which` accepts, moving live
/// pages where `asker` allows: the bytes given back.
fn trim_devices(which: impl Fn(i32) -> bool, asker: Asker) -> u64 {
    let mut freed = 0;
    if state::forked() {
        return 0; // a forked child's CUDA state is not its own
    }
    if STATE_STARTED.load(Ordering::Acquire) {
        let mut st = state::lock();
        if let Ok(t) = st.driver.as_ref().map(|t| *t) {
            for (dev, p) in st.open_pools().filter(|(d, _)| which(*d)) {
                freed += real::primary::with_primary(t, dev, || p.give_back_cache());
                p.release_host();
            }
        }
    }
    if coalescers::started() {
        for c in coalescers::lock()
            .all()
            .filter(|c| which(c.driver().device()))
        {
            let moves = match asker {
                Asker::Program => true,
                Asker::Allocation => super::allocator::may_move(c.driver().device()),
                Asker::Outside => false,
            };
            let (n, call) = match moves {
                false => (in_context(c, |c| c.trim_unmoved()), Call::TrimUnmoved),
                true => (in_context(c, |c| c.trim()), Call::Trim),
            };
            record(c, call, n);
            freed += n;
            if asker == Asker::Allocation && !moves {
                owed_warning(c.driver().device(), c.stranded() + c.ahead_bytes());
            }
            let n = c.release_host();
            record(c, Call::ReleaseHost, n);
        }
    }
    GLOBAL.given_back_bytes.add(freed);
    freed
}

/// An allocation that found no memory, on a thread other than `dev`'s allocator's, left
/// `owed` bytes that only moving live pages gives back: said once, so that an out-of-memory
/// error there can be explained (they go back at that thread's next call, or `expseg.trim()`).
fn owed_warning(dev: i32, owed: u64) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if owed > 0 && !SAID.swap(true, Ordering::Relaxed) {
        log::warn!(
            "an allocation on device {dev} found no memory on a thread other than the one that allocates there: {owed} bytes that only moving live pages gives back stay held until that thread's next allocator call (expseg.trim() gives them back now)"
        );
    }
}

/// `expseg.trim()`: give back everything held beyond live memory, on every device.
pub fn trim_all() -> u64 {
    trim_devices(|_| true, Asker::Program)
}

/// Another expseg process found no memory on the GPU of `key` (`reclaim::EVERY_GPU`: on a
/// device it could not name): what this process holds beyond live memory there goes back, as
/// far as it can without moving a live page (this runs on the socket thread, while the
/// program's threads may be launching work); the rest at the program's next call.
pub fn trim_gpu(key: u64) -> u64 {
    let freed = trim_devices(
        |d| key == reclaim::EVERY_GPU || key_of(d) == key,
        Asker::Outside,
    );
    if freed > 0 {
        log::info!("gave back {freed} bytes another expseg process asked for");
    }
    freed
}

/// An allocation on `dev` (None: the device is not known) found no memory: this process's
/// own held memory goes back, then the other expseg processes of the user are asked for
/// theirs on the same GPU. True if any bytes came back (worth asking the driver again).
pub fn make_room(dev: Option<i32>) -> bool {
    let own = match dev {
        Some(d) => trim_devices(|x| x == d, Asker::Allocation),
        None => trim_devices(|_| true, Asker::Allocation),
    };
    own + reclaim_from_peers(dev) > 0
}

/// A free-memory query while this process keeps released memory (`api::keep`: only expseg
/// processes of the user that keep theirs too share its GPUs): the ones the watcher saw on
/// each keeping GPU are asked to give back what they hold there, each within the reclaim's
/// bound, at most once in 10 ms (a loop of queries asks once).
pub fn peers_give_back() {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    {
        let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < std::time::Duration::from_millis(10)) {
            return;
        }
        *last = Some(std::time::Instant::now());
    }
    if state::bypass() || !state::config().sockets {
        return;
    }
    let uid = sockdir::current_uid();
    let mut freed = 0;
    for (dev, pids) in super::keep::peers() {
        for pid in pids {
            GLOBAL.reclaim_asks.add(1);
            match reclaim::ask_one(uid, pid, key_of(dev), reclaim::PEER_TIMEOUT) {
                Ok(n) => freed += n,
                Err(e) => log::debug!("asking expseg process {pid} to give memory back: {e:?}"),
            }
        }
    }
    GLOBAL.reclaimed_bytes.add(freed);
}

/// Ask the other expseg processes of the user to give back what they hold on `dev`'s GPU
/// (on every GPU when `dev` is unknown: one request each, not one per GPU): the bytes they
/// gave.
fn reclaim_from_peers(dev: Option<i32>) -> u64 {
    // Off (`EXPSEG_DISABLE=1`: pure pass-through), a forked child, or no sockets
    // (`EXPSEG_SOCKETS=0`): nobody is asked.
    if state::bypass() || !state::config().sockets {
        return 0;
    }
    let key = dev.map_or(reclaim::EVERY_GPU, key_of);
    let (uid, me) = (sockdir::current_uid(), std::process::id());
    let mut freed = 0;
    for a in reclaim::ask_peers(uid, me, key, reclaim::PEER_TIMEOUT) {
        GLOBAL.reclaim_asks.add(1);
        match a.result {
            Ok(0) => {}
            Ok(n) => {
                log::info!(
                    "expseg process {} gave back {n} bytes for an allocation here",
                    a.pid
                );
                freed += n;
            }
            Err(e) => log::debug!("asking expseg process {} to give memory back: {e:?}", a.pid),
        }
    }
    GLOBAL.reclaimed_bytes.add(freed);
    freed
}
