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
//! Locks: one mutex over all device pools ([`STATE`]). Driver calls of the pool run under it;
//! device synchronisation (which may wait for long kernels) never does.
#![allow(non_snake_case)]

pub mod fdshare;
mod ipc;
pub mod reads;
pub mod vmm;

pub use crate::real::is_shared_runtime_file;
pub use ipc::{
    allocation_range, cudaIpcCloseMemHandle, cudaIpcGetMemHandle, cudaIpcOpenMemHandle,
    forget_foreign_range, mirror_foreign, pool_allocation_range,
};

use crate::config::Config;
use crate::gpu::cuda::{self, CudaDriver};
use crate::gpu::Driver as _;
use crate::pool::{AllocError, Pool, PoolConfig, PoolStats};
use crate::real::{self, runtime, DriverTable};
use crate::stats::{self, GLOBAL};
use once_cell::sync::Lazy;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

/// `cudaErrorMemoryAllocation`.
pub const OUT_OF_MEMORY: i32 = 2;
/// `cudaErrorUnknown`: what a hook returns after catching a panic.
pub const UNKNOWN: i32 = 999;
/// `cudaErrorPeerAccessAlreadyEnabled`.
const PEER_ALREADY_ENABLED: i32 = 704;

static CONFIG: Lazy<Config> = Lazy::new(|| {
    let c = Config::from_env();
    init_logger(&c.log);
    if c.report.is_some() {
        extern "C" fn at_exit() {
            write_exit_report();
        }
        OWNER_PID.store(std::process::id(), Ordering::Relaxed);
        #[allow(unsafe_code)]
        // SAFETY: registers a plain extern "C" function that only reads counters and writes files.
        unsafe {
            libc::atexit(at_exit);
        }
        report_on_sigterm();
    }
    c
});

/// Jobs end by SIGTERM (`scancel`, Ray teardown, torchrun's elastic agent): where the program
/// left SIGTERM at its default, a one-shot handler writes the report, then the default action
/// runs as before (the process dies by SIGTERM). A program that installs its own handler
/// later replaces this one. Writing in a signal handler is not async-signal-safe: a SIGTERM
/// that lands while that very thread is inside `malloc` can hang the exit until the sender's
/// SIGKILL, which is what the job would get without a report anyway.
fn report_on_sigterm() {
    extern "C" fn on_sigterm(_: libc::c_int) {
        write_exit_report();
        #[allow(unsafe_code)]
        // SAFETY: SA_RESETHAND restored the default action; raising it ends the process as
        // the signal would have.
        unsafe {
            libc::raise(libc::SIGTERM);
        }
    }
    #[allow(unsafe_code)]
    // SAFETY: sigaction with zeroed, then filled, structs; only installed over SIG_DFL.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGTERM, std::ptr::null(), &mut old) != 0
            || old.sa_sigaction != libc::SIG_DFL
        {
            return;
        }
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigterm as *const () as usize;
        sa.sa_flags = libc::SA_RESETHAND;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
    }
}

/// The configuration, read (and the logger set up) at the first call.
pub fn config() -> &'static Config {
    &CONFIG
}

fn init_logger(filter: &str) {
    use std::io::Write;
    let _ = env_logger::Builder::new()
        .parse_filters(filter)
        .target(env_logger::Target::Stderr)
        .format(|buf, r| writeln!(buf, "[expseg {}] {}", r.level(), r.args()))
        .try_init();
}

/// Set in a child after `fork`: CUDA state is not inherited, so everything passes through.
static FORKED: AtomicBool = AtomicBool::new(false);
/// Pid that owns the state; the exit report is written by it only.
static OWNER_PID: AtomicU32 = AtomicU32::new(0);

enum Slot {
    Unopened,
    Open(Box<Pool<CudaDriver>>),
    /// VMM cannot serve this device; its calls pass through.
    Off,
}

struct State {
    driver: Result<&'static DriverTable, String>,
    pools: Vec<Slot>,
    /// Per owning device, the devices granted peer access to its memory.
    grants: Vec<Vec<i32>>,
    /// IPC tickets issued and memory opened through tickets.
    ipc: ipc::IpcState,
}

static STATE: Lazy<Mutex<State>> = Lazy::new(|| Mutex::new(State::start()));

impl State {
    fn start() -> State {
        register_fork_hook();
        let driver = real::driver().map_err(str::to_string).and_then(|t| {
            cuda::device_count(t)
                .map(|n| (t, n))
                .map_err(|e| format!("cuDeviceGetCount failed: {e}"))
        });
        match driver {
            Ok((t, n)) => {
                log::debug!("pool ready for {n} device(s)");
                State {
                    driver: Ok(t),
                    pools: (0..n).map(|_| Slot::Unopened).collect(),
                    grants: vec![Vec::new(); n.max(0) as usize],
                    ipc: Default::default(),
                }
            }
            Err(why) => {
                log::warn!(
                    "VMM pool unavailable ({why}); every call passes through to the CUDA runtime"
                );
                State {
                    driver: Err(why),
                    pools: Vec::new(),
                    grants: Vec::new(),
                    ipc: Default::default(),
                }
            }
        }
    }

    /// The pool of `dev`, opened on first use.
    fn pool(&mut self, dev: i32) -> Option<&mut Pool<CudaDriver>> {
        let t = *self.driver.as_ref().ok()?;
        let slot = self.pools.get_mut(usize::try_from(dev).ok()?)?;
        if let Slot::Unopened = slot {
            *slot = match CudaDriver::open(t, dev) {
                Ok(d) => {
                    let c = config();
                    let cfg = PoolConfig {
                        cache_max: c.cache_max,
                        max_chunk: c.max_chunk,
                    };
                    log::info!(
                        "device {dev}: pool open (granularity {} KiB, shareable {})",
                        d.granularity() / 1024,
                        d.shareable
                    );
                    let mut p = Pool::new(d, cfg);
                    for peer in &self.grants[dev as usize] {
                        if let Err(e) = p.grant(*peer) {
                            log::error!(
                                "device {dev}: granting access to device {peer} failed: {e}"
                            );
                        }
                    }
                    Slot::Open(Box::new(p))
                }
                Err(why) => {
                    log::warn!("{why}; its allocations pass through to cudaMalloc");
                    Slot::Off
                }
            };
        }
        match slot {
            Slot::Open(p) => Some(p),
            _ => None,
        }
    }

    fn open_pools(&mut self) -> impl Iterator<Item = (i32, &mut Pool<CudaDriver>)> {
        self.pools
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Open(p) => Some((i as i32, p.as_mut())),
                _ => None,
            })
    }

    /// The pool of `dev` if it is open (never opens one).
    fn open_pool(&mut self, dev: i32) -> Option<&mut Pool<CudaDriver>> {
        match self.pools.get_mut(usize::try_from(dev).ok()?)? {
            Slot::Open(p) => Some(p),
            _ => None,
        }
    }

    /// The device whose pool has a live allocation starting at `ptr`.
    fn owner(&mut self, ptr: u64) -> Option<i32> {
        self.open_pools()
            .find(|(_, p)| p.live_size(ptr).is_some())
            .map(|(d, _)| d)
    }
}

fn lock() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether this is a forked child (CUDA state is not inherited).
pub fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// Whether calls should even look at the pool.
fn bypass() -> bool {
    config().disabled || FORKED.load(Ordering::Relaxed)
}

fn register_fork_hook() {
    extern "C" fn child_after_fork() {
        FORKED.store(true, Ordering::Relaxed);
    }
    #[allow(unsafe_code)]
    // SAFETY: registers a plain extern "C" function that only sets an atomic.
    unsafe {
        libc::pthread_atfork(None, None, Some(child_after_fork));
    }
}

/// What a hook should do.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer<T> {
    /// Hand this back to the program.
    Done(T),
    /// Call the real runtime with the program's arguments.
    PassThrough,
}

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
    // Any trouble before the pool is reached: the real cudaMalloc reports it exactly.
    let Ok(dev) = runtime::get_device() else {
        return pass_alloc(size);
    };
    let Ok(t) = real::driver() else {
        // Starting the state logs, once, why the pool cannot run.
        drop(ensure_state());
        return pass_alloc(size);
    };
    // The real cudaMalloc creates and binds the primary context; keep that side effect.
    if !cuda::has_context(t) && runtime::free(0) != 0 {
        return pass_alloc(size);
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
    // One lock for the allocation (it also starts the state on first use).
    let mut st = ensure_state();
    let Some(pool) = st.pool(dev) else {
        return Served::Pass;
    };
    match pool.alloc(size as u64) {
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
    let Some(dev) = real::driver().ok().and_then(cuda::primary_device) else {
        return pass_alloc(least);
    };
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

/// Free `ptr` if it is a live pool allocation, after `sync` waited for its device; the
/// answer is `sync`'s error if it failed (the allocation then stays live).
fn free_with(ptr: u64, sync: impl FnOnce(i32) -> i32) -> Answer<i32> {
    if ptr == 0 || bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        GLOBAL.passthrough_frees.add(1);
        return Answer::PassThrough;
    }
    let Some(dev) = lock().owner(ptr) else {
        GLOBAL.passthrough_frees.add(1);
        return Answer::PassThrough;
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
            Answer::Done(0)
        }
        // Freed by another thread meanwhile: let the runtime answer the double free.
        _ => Answer::PassThrough,
    }
}

/// Set once the pool state exists; before that no pointer can be the pool's.
static STATE_STARTED: AtomicBool = AtomicBool::new(false);

/// Wait for all work on `dev`, leaving the calling thread's current device as it was.
pub(crate) fn synchronize(dev: i32) -> i32 {
    let t = Instant::now();
    let e = runtime::synchronize_device(dev);
    GLOBAL.syncs.add(1);
    GLOBAL.sync_ns.add(t.elapsed().as_nanos() as u64);
    e
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
}

fn ensure_state() -> MutexGuard<'static, State> {
    let g = lock();
    STATE_STARTED.store(true, Ordering::Release);
    g
}

/// Whether the pool is running, or why not; for reports and diagnostics.
fn status(st: &State) -> String {
    if config().disabled {
        return "disabled by EXPSEG_DISABLE".into();
    }
    match &st.driver {
        Ok(_) => "pool active".into(),
        Err(why) => format!("pass-through: {why}"),
    }
}

/// Counters of every open pool.
fn pool_stats(st: &mut State) -> Vec<(i32, PoolStats)> {
    st.open_pools()
        .map(|(d, p)| (d, p.stats().clone()))
        .collect()
}

/// Called at exit: write the report if one was asked for. No CUDA call: the runtime may
/// already be shutting down.
pub fn write_exit_report() {
    let Some(template) = config().report.clone() else {
        return;
    };
    if FORKED.load(Ordering::Relaxed) || OWNER_PID.load(Ordering::Relaxed) != std::process::id() {
        return;
    }
    // Another thread may hold the lock while the process exits: wait a little, then report
    // without pool figures rather than hang the exit.
    let mut guard = None;
    for _ in 0..50 {
        if !STATE_STARTED.load(Ordering::Acquire) {
            break;
        }
        match STATE.try_lock() {
            Ok(g) => {
                guard = Some(g);
                break;
            }
            Err(std::sync::TryLockError::Poisoned(p)) => {
                guard = Some(p.into_inner());
                break;
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                std::thread::sleep(std::time::Duration::from_millis(2))
            }
        }
    }
    let (status, pools) = match guard.as_mut() {
        Some(st) => (status(st), pool_stats(st)),
        None if !STATE_STARTED.load(Ordering::Acquire) => {
            let why = if config().disabled {
                "disabled by EXPSEG_DISABLE"
            } else if !vmm::report_rows().is_empty() {
                "coalescing PyTorch's pages (no cudaMalloc reached the pool)"
            } else {
                "pool never started"
            };
            (why.into(), Vec::new())
        }
        None => ("pool busy at exit; pool figures missing".into(), Vec::new()),
    };
    let mut snap = stats::Snapshot::take(status, config().effective(), pools);
    snap.global.extend(vmm::report_rows());
    if let Err(e) = stats::write_report(&template, &snap) {
        log::error!("cannot write the report to {template}: {e}");
    }
}

/// The exit report's figures now, as its JSON object, with `active` (whether expseg serves
/// this process) and, when not, `why`; for `expseg.stats()` in Python (`pyapi`). Starts
/// nothing and makes no CUDA call.
pub fn live_report_json(library: &str) -> String {
    let started = STATE_STARTED.load(Ordering::Acquire);
    let (status, pools) = if started {
        let mut st = lock();
        (status(&st), pool_stats(&mut st))
    } else if config().disabled {
        ("disabled by EXPSEG_DISABLE".to_string(), Vec::new())
    } else if !vmm::report_rows().is_empty() {
        (
            "coalescing PyTorch's pages (no cudaMalloc reached the pool)".to_string(),
            Vec::new(),
        )
    } else {
        (
            "pool not started yet (no cudaMalloc so far)".to_string(),
            Vec::new(),
        )
    };
    let why = if FORKED.load(Ordering::Relaxed) {
        Some("a forked child: CUDA state is not inherited, everything passes through".to_string())
    } else if config().disabled || status.starts_with("pass-through") {
        Some(status.clone())
    } else {
        None
    };
    let mut snap = stats::Snapshot::take(status, config().effective(), pools);
    snap.global.extend(vmm::report_rows());
    stats::render_live_json(&snap, why.as_deref(), library)
}
