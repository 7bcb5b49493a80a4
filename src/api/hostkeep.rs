//! Host buffers kept after a resume for the next pause, while the host has room for them
//! (`EXPSEG_PAUSE_KEEP_HOST=auto`, the default): page-locking host memory is most of a pause's
//! time, so a loop that pauses every iteration (an RL trainer handing the GPU to its rollout
//! engine) pays it once. Page-locked memory cannot be swapped out, so the buffers are given
//! back as soon as the memory available to the process falls under a reserve: checked when a
//! pause or resume is done and then ten times a second by a thread of its own (started by the
//! first pause; with no buffer kept a look is one atomic load). `expseg.trim()` frees them too.
//!
//! The rule is [`room_to_keep`]; the rest fetches the figures and frees the buffers.

use super::state::{self, coalescers, config, STATE_STARTED};
use super::trace::record;
use crate::coalesce::trace::Call;
use crate::config::KeepHost;
use crate::hostmem;
use once_cell::sync::OnceCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Least reserve of available host memory kept free of kept buffers.
pub const RESERVE_MIN: u64 = 4 << 30;
/// How often the host's memory is read while buffers are kept.
const EVERY: Duration = Duration::from_millis(100);

/// Whether buffers already made may stay kept: the memory available to the process
/// (`available`: the host's, bounded by its cgroup's room) is at least an eighth of the memory
/// it may use (`total`: the host's, bounded by its cgroup's limit), and at least
/// [`RESERVE_MIN`]. Unknown figures keep nothing (nothing would tell pressure).
pub fn room_to_keep(available: Option<u64>, total: Option<u64>) -> bool {
    match (available, total) {
        (Some(a), Some(t)) => a >= (t / 8).max(RESERVE_MIN),
        _ => false,
    }
}

/// Bytes of host buffers kept on every device (a counter: no lock taken).
pub(super) fn kept() -> u64 {
    crate::hostcopy::spare_bytes_everywhere()
}

/// Free every kept host buffer: the bytes freed.
fn free_all() -> u64 {
    if state::forked() {
        return 0; // a forked child's CUDA state is not its own
    }
    let mut n = 0;
    if STATE_STARTED.load(Ordering::Acquire) {
        let mut st = state::lock();
        for (_, p) in st.open_pools() {
            n += p.release_host();
        }
    }
    if coalescers::started() {
        for c in coalescers::lock().all() {
            let freed = c.release_host();
            if freed > 0 {
                record(c, Call::ReleaseHost, freed);
            }
            n += freed;
        }
    }
    n
}

/// One look: with buffers kept and no room for them, free them.
fn check() {
    if kept() == 0 {
        return;
    }
    let available = match &config().test_host_available {
        Some(path) => std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse().ok()),
        None => hostmem::available(),
    };
    if room_to_keep(available, hostmem::total()) {
        return;
    }
    let freed = free_all();
    log::info!(
        "gave back {freed} bytes of host buffers kept for the next pause: the process has {} MiB of host memory available",
        available.map_or(0, |a| a >> 20)
    );
}

static WATCHER: OnceCell<bool> = OnceCell::new();
/// The watcher stopped (an internal error): nothing is kept after a resume any more.
static STOPPED: AtomicBool = AtomicBool::new(false);

/// A pause or resume is done: under `auto`, buffers kept stay only while the host has room,
/// looked at now and then ten times a second by a thread of its own, started here once. It
/// looks whenever buffers are kept, however they came to be (a resume, or the program freeing
/// or touching paused memory); with none kept a look is one atomic load.
pub fn after_sleep() {
    if config().pause_keep_host != KeepHost::Auto || state::forked() {
        return;
    }
    check();
    let started = *WATCHER.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("expseg-hostkeep".into())
            .spawn(|| loop {
                if state::forked() {
                    return;
                }
                if std::panic::catch_unwind(check).is_err() {
                    STOPPED.store(true, Ordering::Release);
                    crate::stats::GLOBAL.panics_caught.add(1);
                    log::error!("expseg-hostkeep: internal error caught; kept host buffers are freed now and no longer kept");
                    let _ = std::panic::catch_unwind(free_all);
                    return;
                }
                std::thread::sleep(EVERY);
            });
        match spawned {
            Ok(_) => true,
            Err(e) => {
                log::warn!("no thread to watch host memory ({e}); host buffers are not kept after a resume");
                false
            }
        }
    });
    if !started || STOPPED.load(Ordering::Acquire) {
        free_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    #[test]
    fn buffers_stay_while_an_eighth_of_the_host_and_4_gib_are_available() {
        assert!(room_to_keep(Some(64 * G), Some(512 * G)));
        assert!(!room_to_keep(Some(64 * G - 1), Some(512 * G)));
        // A small host: the 4 GiB floor.
        assert!(!room_to_keep(Some(3 * G), Some(16 * G)));
        assert!(room_to_keep(Some(4 * G), Some(16 * G)));
        // Nothing can be read: nothing would tell pressure, so nothing is kept.
        assert!(!room_to_keep(None, Some(16 * G)));
        assert!(!room_to_keep(Some(16 * G), None));
    }
}
