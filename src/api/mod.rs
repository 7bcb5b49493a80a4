//! One safe function per hooked call, with the hook's name: the policy of each call.
//!
//! A function answers either with a result for the hook to hand back, or with `PassThrough`,
//! in which case the hook calls the real runtime with the program's own arguments. Passing
//! through is the answer to everything expseg does not own or cannot do: small requests,
//! unknown pointers, a missing driver, a forked child, the off switch.
//!
//! State is created at the first call that needs the pool, never in the library's
//! constructor: a process that never touches CUDA meets no thread, lock or driver call.
//!
//! Locks: one mutex over all device pools (`state::STATE`). Driver calls of the pool run under it;
//! device synchronisation (which may wait for long kernels) never does.
#![allow(non_snake_case)]

mod allocator;
pub mod fdshare;
mod hostkeep;
pub(crate) mod imports;
mod ipc;
mod keep;
pub mod reads;
pub mod sleep;
mod state;
mod trace;
pub mod trim;
pub mod vmm;

pub use crate::real::is_shared_runtime_file;
pub use ipc::current::{after_sync, before_record, ipc_events_seen, note_ipc_event, sync_armed};
#[cfg(target_arch = "x86_64")]
pub(crate) use ipc::ensure_server;
pub(crate) use ipc::tell_freed;
pub use ipc::{
    allocation_range, cudaIpcCloseMemHandle, cudaIpcGetMemHandle, cudaIpcOpenMemHandle,
    mirror_foreign, pool_allocation_range, range_exported, serve_decisions_at,
};
pub use ipc::{pages as export_copies, sharing};
pub use state::{
    config, forget_foreign_range, forked, write_exit_report, Answer, OUT_OF_MEMORY, UNKNOWN,
};

use state::{bypass, ensure_state, lock, pool_stats, status, synchronize, FORKED, STATE_STARTED};

use crate::gpu::cuda;
use crate::pool::AllocError;
use crate::real::{self, runtime};
use crate::stats::{self, GLOBAL};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// `cudaErrorPeerAccessAlreadyEnabled`.
const PEER_ALREADY_ENABLED: i32 = 704;

fn pass_alloc<T>(size: usize) -> Answer<T> {
    GLOBAL.passthrough_allocs.add(1);
    GLOBAL.passthrough_alloc_bytes.add(size as u64);
    Answer::PassThrough
}

/// `cudaMalloc`: pool memory for requests of at least `EXPSEG_PASSTHROUGH_BELOW` bytes.
pub fn cudaMalloc(size: usize) -> Answer<Result<u64, i32>> {
    let c = config();
    if c.test_panic("cudaMalloc") {
        panic!("EXPSEG_TEST_PANIC=cudaMalloc");
    }
    if bypass() || size == 0 || (size as u64) < c.passthrough_below {
        return pass_alloc(size);
    }
    // Inside a torch_memory_saver region its preload hook (next in line) serves, so that its
    // pause gives the memory back (expseg serving would leave that pause a silent no-op).
    if real::tms::in_region() {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| log::info!("torch_memory_saver's region: its hook serves cudaMalloc there (expseg passes it on)"));
        return pass_alloc(size);
    }
    // Any trouble before the pool is reached: the real cudaMalloc reports it exactly.
    let Ok(dev) = runtime::get_device() else {
        return pass_alloc(size);
    };
    let Ok(t) = real::driver() else {
        // Starting the state logs, once, why the pool cannot run.
        drop(ensure_state());
        return pass_alloc(size);
    };
    match cuda::current_is_primary(t, dev) {
        Some(true) => {}
        // A context of the program's own (`cuCtxCreate`, a green context): the runtime
        // allocates in it and the memory is that context's (gone with it); the pool's belongs
        // to the primary context.
        Some(false) => return pass_alloc(size),
        // The real cudaMalloc creates and binds the primary context; keep that side effect.
        None => {
            if runtime::free(0) != 0 {
                return pass_alloc(size);
            }
        }
    }
    match serve(dev, size) {
        Served::Ptr(p) => Answer::Done(Ok(p)),
        Served::OutOfMemory => {
            set_last_error_out_of_memory();
            Answer::Done(Err(OUT_OF_MEMORY))
        }
        Served::Pass => pass_alloc(size),
    }
}

/// From its first allocation on, this process's socket serves its user's `expseg pause` and
/// `expseg resume` (`EXPSEG_CONTROL`, on by default), and, where keeping is opted into
/// (`Config::keeps`), other expseg processes' reclaims (`trim::trim_gpu`).
pub fn serve_reclaims() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // Served already (every allocation after the first): one load, not the configuration's.
    if ONCE.is_completed() {
        return;
    }
    if (config().keeps() || config().control) && config().sockets && !bypass() {
        ONCE.call_once(|| {
            ipc::tickets::ensure_server();
        });
    }
}

/// A `cuMemUnmap` of a range expseg does not serve, made by `real` (the driver's call): an IPC
/// mirror refresh reading the range is waited for (and held back) while it runs, and on
/// success the shares of runs that start in the range (mirrors, tickets) end, since they
/// stand for nothing any more. For the exported hook and the VMM hook's pass-through alike.
pub fn unmap_unserved(va: u64, size: u64, real: impl FnOnce() -> u32) -> u32 {
    // A forked child's copies of expseg's locks may be held by threads it does not have.
    if forked() {
        return real();
    }
    let unmapping = std::panic::catch_unwind(|| reads::begin_unmap(va, size)).ok();
    let r = real();
    drop(unmapping);
    if r == 0 {
        let _ = std::panic::catch_unwind(|| {
            forget_foreign_range(va, size);
            ipc::tell_freed();
        });
    }
    r
}

/// A runtime allocation of the calling thread's device found no memory: make room for one
/// more try (`trim::make_room`: this process's held memory, then other expseg processes').
pub fn make_room_runtime() -> bool {
    trim::make_room(runtime::get_device().ok())
}

/// The same for a driver allocation on `dev`, or where unknown, on the device of the current
/// primary context.
pub fn make_room_driver(dev: Option<i32>) -> bool {
    trim::make_room(dev.or_else(|| real::driver().ok().and_then(cuda::primary_device)))
}

/// What the pool made of one allocation request.
enum Served {
    Ptr(u64),
    OutOfMemory,
    /// The pool cannot serve it: the real call should.
    Pass,
}

/// An allocation of `size` bytes from `dev`'s pool: the part `cudaMalloc` and `cuMemAlloc`
/// share once they know the device.
fn serve(dev: i32, size: usize) -> Served {
    serve_reclaims();
    // One lock for the allocation (it also starts the state on first use).
    let mut st = ensure_state();
    let Some(pool) = st.pool(dev) else {
        return Served::Pass;
    };
    pool.tag = sleep::current_tag();
    match pool.alloc(size as u64) {
        Ok(_) if config().test_panic("pool") => {
            panic!("EXPSEG_TEST_PANIC=pool: an allocation booked, the lock poisoned")
        }
        Ok(p) => Served::Ptr(p),
        Err(AllocError::OutOfMemory) => {
            drop(st);
            log::debug!("device {dev}: out of memory for {size} bytes");
            Served::OutOfMemory
        }
        Err(AllocError::Driver(e)) => {
            drop(st);
            log::warn!(
                "device {dev}: pool allocation of {size} bytes failed ({e}); using the real call"
            );
            Served::Pass
        }
    }
}

/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const DRV_OUT_OF_MEMORY: u32 = 2;

/// `cuMemAlloc_v2` of a driver caller (a program linking `libcuda`, a statically linked
/// runtime reaching the driver through `cuGetProcAddress`): the same pool and threshold as
/// `cudaMalloc`, for callers whose current context is a device's primary context. Everything
/// else (no or another context, small sizes, no VMM, `EXPSEG_DRIVER_API=0`) is the driver's
/// own call.
pub fn cuMemAlloc(size: usize) -> Answer<Result<u64, u32>> {
    let c = config();
    if c.test_panic("cuMemAlloc_v2") {
        panic!("EXPSEG_TEST_PANIC=cuMemAlloc_v2");
    }
    if bypass() || !c.driver_api || size == 0 || (size as u64) < c.passthrough_below {
        return pass_alloc(size);
    }
    let Ok(t) = real::driver() else {
        drop(ensure_state());
        return pass_alloc(size);
    };
    let Some(dev) = cuda::primary_device(t) else {
        return pass_alloc(size);
    };
    notice_reset(t, dev);
    match serve(dev, size) {
        Served::Ptr(p) => {
            GLOBAL.driver_allocs.add(1);
            Answer::Done(Ok(p))
        }
        Served::OutOfMemory => Answer::Done(Err(DRV_OUT_OF_MEMORY)),
        Served::Pass => pass_alloc(size),
    }
}

/// `cuMemAllocPitch_v2`: as `cuMemAlloc_v2` for `pitch × height` bytes, where `pitch` is the
/// driver's own for this width and element size (`probe` asks it, with a one-row allocation
/// it frees again); a probe that fails, like every other case `cuMemAlloc` passes through,
/// leaves the call to the driver, whose answer is then exact.
pub fn cuMemAllocPitch(
    width: usize,
    height: usize,
    probe: impl FnOnce() -> Result<usize, u32>,
) -> Answer<Result<(u64, usize), u32>> {
    let c = config();
    let least = width.saturating_mul(height);
    if bypass() || !c.driver_api || least == 0 || (least as u64) < c.passthrough_below {
        return pass_alloc(least);
    }
    let Some((t, dev)) = real::driver()
        .ok()
        .and_then(|t| cuda::primary_device(t).map(|d| (t, d)))
    else {
        return pass_alloc(least);
    };
    notice_reset(t, dev);
    let Ok(pitch) = probe() else {
        return pass_alloc(least);
    };
    let Some(size) = pitch.checked_mul(height) else {
        return pass_alloc(least);
    };
    match serve(dev, size) {
        Served::Ptr(p) => {
            GLOBAL.driver_allocs.add(1);
            Answer::Done(Ok((p, pitch)))
        }
        Served::OutOfMemory => Answer::Done(Err(DRV_OUT_OF_MEMORY)),
        Served::Pass => pass_alloc(size),
    }
}

/// `cuMemFree_v2`: a live pool allocation goes back to the pool after waiting for its
/// device's primary context (`cuCtxSynchronize`); anything else is the driver's call.
pub fn cuMemFree(ptr: u64) -> Answer<u32> {
    if config().test_panic("cuMemFree_v2") {
        panic!("EXPSEG_TEST_PANIC=cuMemFree_v2");
    }
    let a = free_with(ptr, |dev| {
        // A pool pointer: a reset no hook saw ends it first (the free then finds it gone and
        // the driver answers, as natively).
        notice_reset_here();
        let t = Instant::now();
        let e = real::driver().map_or(0, |t| cuda::synchronize_primary(t, dev));
        GLOBAL.syncs.add(1);
        GLOBAL.sync_ns.add(t.elapsed().as_nanos() as u64);
        e as i32
    });
    match a {
        Answer::Done(e) => {
            if e == 0 {
                GLOBAL.driver_frees.add(1);
            }
            Answer::Done(e as u32)
        }
        Answer::PassThrough => Answer::PassThrough,
    }
}

/// `cuMemGetInfo_v2`: as `cudaMemGetInfo`, for the device whose primary context is current
/// (another context gets the driver's answer alone). Returns the bytes to add to `free`.
pub fn cuMemGetInfo() -> u64 {
    if bypass() || !config().driver_api || !STATE_STARTED.load(Ordering::Acquire) {
        return 0;
    }
    let Some(dev) = real::driver().ok().and_then(cuda::primary_device) else {
        return 0;
    };
    lock().open_pool(dev).map_or(0, |p| p.cached_bytes())
}

/// Make `cudaGetLastError` report the out-of-memory, as after a failing real `cudaMalloc`:
/// ask the runtime for an impossible size, which fails the same way without side effects.
fn set_last_error_out_of_memory() {
    let (e, p) = runtime::malloc(usize::MAX);
    if e == 0 && p != 0 {
        runtime::free(p);
    }
}

/// `cudaFree`: pool allocations go back to the pool after the device has finished the work
/// that may use them (the real call waits for the device too). Everything else, `NULL`
/// included, passes through, so the runtime gives its own answer to bad pointers.
pub fn cudaFree(ptr: u64) -> Answer<i32> {
    if config().test_panic("cudaFree") {
        panic!("EXPSEG_TEST_PANIC=cudaFree");
    }
    free_with(ptr, synchronize)
}

/// `cudaDeviceReset` of the calling thread's device, before the real call. The reset destroys
/// every runtime allocation of the device and gives its memory back, but not memory made with
/// `cuMemCreate` (measured on an H100: `scripts/vmm-cost/reset_vmm.cu`), so the pool's
/// allocations of the device, which the program made with `cudaMalloc`, go now, their IPC
/// shares and mirrors with them: afterwards their memory is free and a `cudaFree` of one is an
/// error, as natively. PyTorch's coalesced pages stay, as the program's own VMM memory does.
pub fn cudaDeviceReset() -> Option<i32> {
    let dev = runtime::get_device().ok()?;
    cuDevicePrimaryCtxReset(dev);
    Some(dev)
}

/// A reset of `dev`'s primary context that no hook saw (a statically linked runtime's
/// `cudaDeviceReset` reaches the driver through its internal tables): the current context is
/// `dev`'s primary context with another id than at the last driver-API call served there
/// (measured on an H100: a reset keeps the context's pointer and gives it a new id once used
/// again). What the reset ended is ended here, as [`cuDevicePrimaryCtxReset`] does; a primary
/// context destroyed by its last release and made again ends the runtime's memory likewise.
/// One `cuCtxGetId` per driver-API allocation or free.
fn notice_reset(t: &'static real::DriverTable, dev: i32) {
    // The read, the compare and the whole cleanup under one lock of their own: a second
    // thread's call after the same reset waits here until the cleanup is done, so the cleanup
    // never frees what that thread allocates in the new context; and a hooked reset forgets
    // the id under it once the real reset is done ([`reset_done`]), so an id read before that
    // reset is never recorded after it.
    let _one = NOTICING.lock().unwrap_or_else(|e| e.into_inner());
    let Some(id) = real::primary::current_context_id(t) else {
        return;
    };
    let before = lock().primary_ids.insert(dev, id);
    if let Some(old) = before.filter(|old| *old != id) {
        log::info!(
            "device {dev}: its primary context was reset (context id {old}, now {id}) by a call expseg does not see (a static runtime's cudaDeviceReset): freeing what the reset freed"
        );
        cuDevicePrimaryCtxReset(dev);
        // That call forgets the id (for a reset it sees before it happens): this one stays.
        lock().primary_ids.insert(dev, id);
    }
}

/// Held while a driver-API call reads and records the primary context's id ([`notice_reset`]),
/// and by a hooked reset's end ([`reset_done`]).
static NOTICING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// After the real reset of `dev`'s primary context that [`cuDevicePrimaryCtxReset`] (or
/// [`cudaDeviceReset`]) saw coming: forget the context's id again. A driver-API call on
/// another thread may have read the old id between the hook and the real reset and recorded
/// it; left there, the next call would take the new id for a reset no hook saw and free what
/// was allocated after this one (preload test
/// `a_reset_between_an_id_read_and_its_record_frees_nothing_made_after_it`).
pub fn reset_done(dev: i32) {
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return;
    }
    let _one = NOTICING.lock().unwrap_or_else(|e| e.into_inner());
    lock().primary_ids.remove(&dev);
}

/// [`notice_reset`] for the current primary context, before a driver-API call whose answer
/// depends on what a reset gave back (`cuMemGetInfo_v2`: a static runtime's
/// `cudaMemGetInfo` right after its reset sees the pool's memory back, as natively).
pub fn notice_reset_here() {
    if bypass() || !config().driver_api || !STATE_STARTED.load(Ordering::Acquire) {
        return;
    }
    if let Some((t, dev)) = real::driver()
        .ok()
        .and_then(|t| cuda::primary_device(t).map(|d| (t, d)))
    {
        notice_reset(t, dev);
    }
}

/// `cuDevicePrimaryCtxReset_v2(dev)` (what the runtime's reset does; static runtimes and
/// programs of the driver API call it themselves), before the real call: as
/// [`cudaDeviceReset`], for `dev`.
pub fn cuDevicePrimaryCtxReset(dev: i32) {
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return;
    }
    let _ = synchronize(dev);
    let mut st = lock();
    // The context's next id is the new one: no driver-API call may take it for a reset again.
    st.primary_ids.remove(&dev);
    // Memory opened through tickets ends too, as memory opened with legacy IPC does (measured
    // natively: a close after the reset fails).
    let opened = st.ipc.take_opened_on(dev);
    let freed = st.open_pool(dev).map(|p| p.reset()).unwrap_or_default();
    for base in &freed {
        st.ipc.forget(dev, *base);
    }
    let driver = st.driver.as_ref().ok().copied();
    drop(st);
    ipc::tell_freed();
    let unmapped = opened.len();
    if let Some(t) = driver {
        for imp in opened {
            crate::gpu::views::unmap_imported(t, imp);
        }
    }
    if !freed.is_empty() || unmapped > 0 {
        log::info!(
            "device {dev} reset: {} allocation(s) of its pool freed and {unmapped} mapping(s) opened through tickets unmapped, as the reset ends runtime and IPC memory",
            freed.len()
        );
    }
}

/// Free `ptr` if it is a live pool allocation, after `sync` waited for its device; the
/// answer is `sync`'s error if it failed (the allocation then stays live).
fn free_with(ptr: u64, sync: impl FnOnce(i32) -> i32) -> Answer<i32> {
    if ptr == 0 || bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        GLOBAL.passthrough_frees.add(1);
        return Answer::PassThrough;
    }
    let Some(dev) = lock().owner(ptr) else {
        return free_frozen_or_pass(ptr, sync);
    };
    let e = sync(dev);
    if e != 0 {
        return Answer::Done(e);
    }
    let mut st = lock();
    // An IPC mirror refresh may be copying from this allocation without the lock
    // (`ipc::cudaIpcGetMemHandle`): registered reads are checked under the lock, and an
    // overlapping one is waited for without it.
    let _unmapping = if reads::active() {
        drop(st);
        let g = reads::begin_unmap(ptr, 1);
        st = lock();
        Some(g)
    } else {
        None
    };
    match st.pool(dev).map(|p| p.free(ptr)) {
        Some(Ok(_)) => {
            st.ipc.forget(dev, ptr);
            drop(st);
            // Consumers that keep this memory mapped let it go before the free returns.
            ipc::tell_freed();
            Answer::Done(0)
        }
        // Freed by another thread meanwhile: let the runtime answer the double free.
        _ => Answer::PassThrough,
    }
}

/// A free of a pointer no open pool has: where a frozen pool's books call it live (a panic
/// left them unsure, `state::books_unsure`), the device is waited for as for any free and the
/// free is answered, its memory left where it is until exit; anything else is the runtime's.
fn free_frozen_or_pass(ptr: u64, sync: impl FnOnce(i32) -> i32) -> Answer<i32> {
    let frozen = lock().frozen_owner(ptr);
    let Some(dev) = frozen else {
        GLOBAL.passthrough_frees.add(1);
        return Answer::PassThrough;
    };
    let e = sync(dev);
    if e != 0 {
        return Answer::Done(e);
    }
    match lock().free_frozen(ptr) {
        true => Answer::Done(0),
        // Freed by another thread meanwhile: the runtime answers the double free.
        false => Answer::PassThrough,
    }
}

/// `cudaMemGetInfo`: what the application can allocate on the current device is the driver's
/// free memory plus what the pool keeps cached for it. Returns the bytes to add to `free`.
pub fn cudaMemGetInfo() -> u64 {
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return 0;
    }
    let Ok(dev) = runtime::get_device() else {
        return 0;
    };
    lock().open_pool(dev).map_or(0, |p| p.cached_bytes())
}

/// `cudaDeviceEnablePeerAccess`: the real call covers cudaMalloc memory; VMM mappings need
/// their access set explicitly, now and for every later mapping of the peer's pool.
pub fn cudaDeviceEnablePeerAccess(peer: i32, flags: u32) -> i32 {
    let e = runtime::enable_peer_access(peer, flags);
    if (e != 0 && e != PEER_ALREADY_ENABLED) || bypass() {
        return e;
    }
    if let Ok(cur) = runtime::get_device() {
        grant_peer(peer, cur);
    }
    e
}

/// Device `cur` may now access device `peer`'s memory: every mapping of `peer`'s pool,
/// present and future, gets access for `cur`.
fn grant_peer(peer: i32, cur: i32) {
    let mut st = ensure_state();
    if let Some(g) = st.grants.get_mut(peer as usize) {
        if !g.contains(&cur) {
            g.push(cur);
        }
    }
    if let Some(p) = st.open_pool(peer) {
        if let Err(err) = p.grant(cur) {
            log::error!("granting device {cur} access to device {peer}'s pool failed: {err}");
        }
    }
    imports_of(&mut st, peer, cur, true);
}

/// Memory opened through tickets on device `peer`: device `cur` gets access (`on`) or loses
/// it, as it would to legacy IPC memory of `peer`'s context.
fn imports_of(st: &mut state::State, peer: i32, cur: i32, on: bool) {
    let Ok(t) = st.driver.as_ref().map(|t| *t) else {
        return;
    };
    if cur == peer {
        return;
    }
    for imp in st.ipc.opened_on(peer) {
        if let Err(err) = crate::gpu::views::set_import_access(t, imp, cur, on) {
            log::error!(
                "setting device {cur}'s access to IPC memory opened on device {peer} failed: {err}"
            );
        }
    }
}

/// `cuCtxEnablePeerAccess(peer_ctx, flags)` answered `e` (the driver's call is made by the
/// hook): as `cudaDeviceEnablePeerAccess` for the devices of the current and the peer context.
pub fn cuCtxEnablePeerAccess(peer_ctx: usize, e: u32) {
    if (e != 0 && e != PEER_ALREADY_ENABLED as u32) || bypass() {
        return;
    }
    let Ok(t) = real::driver() else { return };
    if let (Some(peer), Ok(cur)) = (cuda::device_of_context(t, peer_ctx), runtime::get_device()) {
        grant_peer(peer, cur);
    }
}

/// `cuCtxDisablePeerAccess(peer_ctx)` answered `e`: as `cudaDeviceDisablePeerAccess`.
pub fn cuCtxDisablePeerAccess(peer_ctx: usize, e: u32) {
    if e != 0 || bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return;
    }
    let Ok(t) = real::driver() else { return };
    if let (Some(peer), Ok(cur)) = (cuda::device_of_context(t, peer_ctx), runtime::get_device()) {
        revoke_peer(peer, cur);
    }
}

/// `cudaDeviceDisablePeerAccess`: revoke what enabling granted on the peer's pool.
pub fn cudaDeviceDisablePeerAccess(peer: i32) -> i32 {
    let e = runtime::disable_peer_access(peer);
    if e != 0 || bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return e;
    }
    if let Ok(cur) = runtime::get_device() {
        revoke_peer(peer, cur);
    }
    e
}

fn revoke_peer(peer: i32, cur: i32) {
    let mut st = lock();
    if let Some(g) = st.grants.get_mut(peer as usize) {
        g.retain(|d| *d != cur);
    }
    if let Some(p) = st.open_pool(peer) {
        if let Err(err) = p.revoke(cur) {
            log::error!("revoking device {cur}'s access to device {peer}'s pool failed: {err}");
        }
    }
    imports_of(&mut st, peer, cur, false);
}

/// The exit report's figures now, as its JSON object, with `active` (whether expseg serves
/// this process) and, when not, `why`; for `expseg.stats()` in Python (`pyapi`). Starts
/// nothing and makes no CUDA call (before the pool starts, it looks for the driver library as
/// the start would: without one, or without its VMM calls, everything passes through).
pub fn live_report_json(library: &str) -> String {
    let started = STATE_STARTED.load(Ordering::Acquire);
    let (status, pools) = if started {
        let mut st = lock();
        (status(&st), pool_stats(&mut st))
    } else {
        (state::not_started_status(true), Vec::new())
    };
    let why = if FORKED.load(Ordering::Relaxed) {
        Some("a forked child: CUDA state is not inherited, everything passes through".to_string())
    } else if config().disabled || status.starts_with("pass-through") {
        Some(status.clone())
    } else {
        None
    };
    let status = status + &keep::status_suffix(FORKED.load(Ordering::Relaxed));
    let mut snap = stats::Snapshot::take(status, config().effective(), pools);
    snap.global.extend(vmm::report_rows());
    snap.global
        .push(("held_beyond_live_bytes", trim::held_beyond_live()));
    snap.global
        .push(("paused_bytes", sleep::paused_bytes(false)));
    snap.global
        .push(("pause_host_kept_bytes", hostkeep::kept()));
    stats::render_live_json(&snap, why.as_deref(), library)
}

#[cfg(test)]
mod fork_tests {
    use std::time::{Duration, Instant};

    /// Helper, alone in a process of its own (does nothing unless `EXPSEG_TEST_FORKED_UNMAP` is
    /// set: marking the process forked would send every other test on the plain path): a
    /// read of a range is registered on another thread, as a mirror refresh of the parent's
    /// would be at a fork, and this "child" unmaps in that range.
    #[test]
    fn forked_unmap_helper() {
        if std::env::var_os("EXPSEG_TEST_FORKED_UNMAP").is_none() {
            return;
        }
        let reader = std::thread::spawn(|| {
            let r = super::reads::begin(0x10_0000, 0x10_0000);
            std::thread::sleep(Duration::from_secs(3));
            drop(r);
        });
        std::thread::sleep(Duration::from_millis(200));
        super::state::FORKED.store(true, std::sync::atomic::Ordering::Relaxed);
        let t = Instant::now();
        let rc = super::unmap_unserved(0x10_0000, 0x1000, || 0);
        println!("forked_unmap_ms={} rc={rc}", t.elapsed().as_millis());
        reader.join().unwrap();
    }

    #[test]
    fn a_forked_childs_unmap_never_waits_for_expseg_locks() {
        // In a forked child the threads that hold expseg's reads are not there to end them:
        // its unmaps are the driver's alone.
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "api::fork_tests::forked_unmap_helper",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("EXPSEG_TEST_FORKED_UNMAP", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let ms: u64 = text
            .split_whitespace()
            .find_map(|t| t.strip_prefix("forked_unmap_ms="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("the helper said: {text}"));
        assert!(ms < 1000, "the unmap waited {ms} ms");
    }
}
