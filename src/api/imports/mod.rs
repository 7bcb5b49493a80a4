//! PyTorch's mappings of other processes' pages (`torch.multiprocessing` of expandable
//! segments) kept mapped after the program frees them, so the next open of the same pages
//! costs no map or access call and no unmap at its close (`EXPSEG_IPC_KEEP_CLOSED`): the books
//! are [`books`]; this file keeps them for the hooks and makes their driver calls.
//!
//! A page is known only through a producer that runs expseg and agreed to tell this process
//! when a descriptor number of its stops naming its page ([`before_getfd`]: asked once per
//! producer, before the first descriptor is taken, so no number is learnt untold); the
//! producer tells before the number can reach a consumer again (`fdshare`), and this process
//! unmaps those views on its socket's thread ([`gone`]). Views of a producer that exits go
//! within [`WATCH_EVERY`]; at most `books::KEPT_MAX` are kept.

// Only the x86-64 `syscall` hook names producers: elsewhere nothing is ever kept.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

pub mod books;

use crate::api::state::config;
use crate::ipc::closed;
use crate::ipc::sockdir;
use crate::ipc::watch::Watch;
use books::{Free, Id, Map, View, Views};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// How often the producers of kept views are looked at.
const WATCH_EVERY: Duration = Duration::from_millis(100);

static VIEWS: Lazy<Mutex<Views>> = Lazy::new(|| Mutex::new(Views::default()));
/// Whether a known page was ever imported (before, the hooks' other calls skip the books).
static ANY: AtomicBool = AtomicBool::new(false);

fn views() -> MutexGuard<'static, Views> {
    VIEWS.lock().unwrap_or_else(|e| e.into_inner())
}

/// What this process knows of producers: whether each tells it (and is watched for its exit).
enum Producer {
    Tells(Watch),
    Silent,
}

static PRODUCERS: Lazy<Mutex<HashMap<u32, Producer>>> = Lazy::new(|| Mutex::new(HashMap::new()));
/// Descriptors taken from producers that tell, by number here, until imported.
static TAKEN: Lazy<Mutex<HashMap<i32, Id>>> = Lazy::new(|| Mutex::new(HashMap::new()));

fn producers() -> MutexGuard<'static, HashMap<u32, Producer>> {
    PRODUCERS.lock().unwrap_or_else(|e| e.into_inner())
}

fn tells(pid: u32) -> bool {
    matches!(producers().get(&pid), Some(Producer::Tells(_)))
}

/// Before `pidfd_getfd(pidfd, ..)`: the producer's pid if it tells this process of its
/// descriptors (asked the first time; `serving`: this process's socket serves, where the
/// producer tells it).
pub fn before_getfd(pidfd: i32, serving: impl FnOnce() -> bool) -> Option<u32> {
    if !config().ipc_keep_closed {
        return None;
    }
    let pid = crate::ipc::watch::pid_of_pidfd(pidfd)?;
    if let Some(p) = producers().get(&pid) {
        return matches!(p, Producer::Tells(_)).then_some(pid);
    }
    // A producer without a socket runs no expseg (its socket is made at its first export,
    // before its descriptors can be sent): nothing asked, this process's socket not made.
    let uid = sockdir::current_uid();
    let has_socket =
        sockdir::socket_path(uid, pid).is_ok_and(|p| std::fs::symlink_metadata(p).is_ok());
    let told = has_socket && serving() && closed::watch(uid, pid).is_ok();
    let p = match told {
        true => Producer::Tells(Watch::new(pid)),
        false => Producer::Silent,
    };
    producers().insert(pid, p);
    if told {
        start_watching();
    }
    told.then_some(pid)
}

/// `pidfd_getfd` gave this process `mine`, a copy of producer `pid`'s descriptor `fd`.
pub fn got_fd(mine: i32, pid: u32, fd: i32) {
    let mut t = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    if t.len() >= 4096 {
        t.clear(); // never imported (or closed and reused): forgotten
    }
    t.insert(mine, Id { pid, fd });
}

/// `CUDA_ERROR_INVALID_VALUE`: a deferred handle released already.
const INVALID_VALUE: u32 = 1;

/// The tag of the handles [`import_deferred`] gives (the coalescers' are `0xE5E5`).
const DEFERRED: u64 = 0xE5E6 << 48;
const TAG: u64 = 0xFFFF << 48;

/// An import not made yet: a copy of the descriptor, and the driver's handle once a call
/// needed one.
struct Deferred {
    fd: std::os::fd::OwnedFd,
    real: Option<u64>,
}

static DEFERRED_IMPORTS: Lazy<Mutex<HashMap<u64, Deferred>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

fn deferred() -> MutexGuard<'static, HashMap<u64, Deferred>> {
    DEFERRED_IMPORTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Before the program imports descriptor `fd`: where its page is mapped in a view already, a
/// handle of expseg's instead of the driver's import (the map that follows usually finds the
/// page in place and needs no handle; one that does gets the driver's import then, from a
/// copy of the descriptor kept meanwhile). `None`: the driver imports.
pub fn import_deferred(fd: i32) -> Option<u64> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    let id = *TAKEN.lock().unwrap_or_else(|e| e.into_inner()).get(&fd)?;
    if !views().holds(id) {
        return None;
    }
    // The program's descriptor, open for the length of its import call.
    let copy = crate::api::fdshare::record::dup(fd)?;
    TAKEN.lock().unwrap_or_else(|e| e.into_inner()).remove(&fd);
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let h = DEFERRED | (NEXT.fetch_add(1, Ordering::Relaxed) & !TAG);
    let d = Deferred {
        fd: copy,
        real: None,
    };
    deferred().insert(h, d);
    views().imported(h, id);
    crate::stats::GLOBAL.ipc_imports_deferred.add(1);
    Some(h)
}

/// The driver's handle for `h`: `h` itself, or for a deferred import, the driver's import of
/// its descriptor (made now, once).
pub fn real_handle(h: u64) -> Result<u64, u32> {
    if h & TAG != DEFERRED {
        return Ok(h);
    }
    let mut d = deferred();
    let Some(e) = d.get_mut(&h) else {
        return Err(INVALID_VALUE);
    };
    if let Some(r) = e.real {
        return Ok(r);
    }
    let t = crate::real::driver().map_err(|_| crate::gpu::cuda::NOT_FOUND)?;
    use std::os::fd::AsRawFd;
    let r = crate::gpu::views::import_fd(t, e.fd.as_raw_fd())?;
    e.real = Some(r);
    Ok(r)
}

/// The program releases `h`: for a deferred import, `Some` of the answer (the driver's handle,
/// if one was made, released).
pub fn release_deferred(h: u64) -> Option<u32> {
    if h & TAG != DEFERRED {
        return None;
    }
    let Some(e) = deferred().remove(&h) else {
        return Some(INVALID_VALUE);
    };
    views().released(h);
    Some(match (e.real, crate::real::driver()) {
        (Some(r), Ok(t)) => crate::gpu::views::release_handle(t, r),
        _ => 0,
    })
}

/// The program imported handle `h` from descriptor `fd` (POSIX).
pub fn imported(h: u64, fd: i32) {
    let id = TAKEN.lock().unwrap_or_else(|e| e.into_inner()).remove(&fd);
    if let Some(id) = id {
        views().imported(h, id);
        ANY.store(true, Ordering::Release);
    }
}

/// The program releases handle `h`.
pub fn released(h: u64) {
    if ANY.load(Ordering::Acquire) {
        views().released(h);
    }
}

/// The program asks for a reservation of `size` bytes: a kept view's, or `None` (the driver's).
pub fn reserve(size: u64) -> Option<u64> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    let va = views().reserve(size)?;
    crate::stats::GLOBAL.ipc_views_reused.add(1);
    Some(va)
}

/// The driver found no address space for a reservation: the kept views go (whether there
/// were any: then the reservation is asked again).
pub fn out_of_address_space() -> bool {
    if !ANY.load(Ordering::Acquire) {
        return false;
    }
    let kept = views().take_kept();
    let any = !kept.is_empty();
    drop_views(kept);
    any
}

/// The driver reserved `[va, va+size)` for the program.
pub fn reserved(va: u64, size: u64) {
    views().reserved(va, size);
}

/// The program maps handle `h` at `va`: `Some(0)` where it is mapped there already.
pub fn map(va: u64, len: u64, off: u64, h: u64) -> Option<u32> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    let m = views().map(va, len, off, h);
    match m {
        Map::Done => Some(0),
        Map::Pass(stale) => {
            unmap_ranges(&stale);
            None
        }
    }
}

/// The program sets access on `[va, va+len)`: `Some(0)` where it is so already.
pub fn access(va: u64, len: u64, descs: &[(i32, u32)]) -> Option<u32> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    let (done, stale) = views().access(va, len, descs);
    unmap_ranges(&stale);
    done.then_some(0)
}

/// The program unmaps `[va, va+len)`: `Some(0)` where it stays mapped, kept.
pub fn unmap(va: u64, len: u64) -> Option<u32> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    views().unmap(va, len, tells).then_some(0)
}

/// The program frees its reservation at `va`: `Some(0)` where it is kept.
pub fn address_free(va: u64) -> Option<u32> {
    let (free, over) = views().address_free(va);
    drop_views(over);
    match free {
        Free::Kept => {
            crate::stats::GLOBAL.ipc_views_kept.add(1);
            Some(0)
        }
        Free::Pass(ours) => {
            unmap_ranges(&ours);
            None
        }
    }
}

/// Producer `pid`'s descriptor `fd` no longer names its page (`None`: the producer exited):
/// the views holding it are unmapped and freed; the bytes unmapped.
pub fn gone(pid: u32, fd: Option<i32>) -> u64 {
    let gone = views().gone(pid, fd);
    drop_views(gone)
}

fn unmap_ranges(ranges: &[(u64, u64)]) {
    if ranges.is_empty() {
        return;
    }
    if let Ok(t) = crate::real::driver() {
        crate::gpu::views::unmap_and_free(t, ranges, 0, 0);
    }
}

/// Unmap kept views and free their reservations (the coalescers' books see the free too).
fn drop_views(views: Vec<View>) -> u64 {
    let Ok(t) = crate::real::driver() else {
        return 0;
    };
    let mut bytes = 0;
    for v in views {
        let m = v.mappings();
        bytes += m.iter().map(|(_, n)| n).sum::<u64>();
        let _ = crate::api::vmm::address_free(v.va, v.size);
        crate::gpu::views::unmap_and_free(t, &m, v.va, v.size);
        crate::stats::GLOBAL.ipc_views_dropped.add(1);
    }
    bytes
}

/// Look every [`WATCH_EVERY`] whether producers of kept views exited (their views go).
fn start_watching() {
    static STARTED: AtomicBool = AtomicBool::new(false);
    crate::ipc::watch::every("expseg-ipc-views", &STARTED, WATCH_EVERY, look);
}

fn look() {
    let kept = views().kept_producers();
    let exited: Vec<u32> = {
        let p = producers();
        kept.into_iter()
            .filter(|pid| matches!(p.get(pid), Some(Producer::Tells(w)) if w.exited()))
            .collect()
    };
    for pid in exited {
        let bytes = gone(pid, None);
        producers().remove(&pid);
        log::debug!(
            "IPC: process {pid} exited: {bytes} bytes of its pages kept mapped here unmapped"
        );
    }
}
