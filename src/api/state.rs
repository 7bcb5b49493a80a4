//! What the api keeps for the whole process, created at first use: the configuration (whose
//! first read sets up the logger and registers the exit report), the device pools under one
//! lock ([`STATE`]), the coalescers of PyTorch's pages under theirs ([`coalescers`]), and the
//! small helpers every call shares (the off switches, [`Answer`], the error codes).

use super::ipc::shares::IpcState;
use crate::config::Config;
use crate::gpu::cuda::{self, CudaDriver};
use crate::gpu::Driver as _;
use crate::pool::{Pool, PoolConfig, PoolStats};
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

static CONFIG: Lazy<Config> = Lazy::new(|| {
    let c = Config::from_env();
    init_logger(&c.log);
    crate::gpu::fence::set_move_fence(c.move_fence);
    if c.report.is_some() || c.test_trace.is_some() {
        extern "C" fn at_exit() {
            let _ = std::panic::catch_unwind(exit_work);
        }
        OWNER_PID.store(std::process::id(), Ordering::Relaxed);
        #[allow(unsafe_code)]
        // SAFETY: registers a plain extern "C" function that only reads counters and writes files.
        unsafe {
            libc::atexit(at_exit);
        }
        report_on_sigterm();
    }
    if c.test_panic("config") {
        // Every later `config()` panics too (the cell stays empty): what every path from C
        // must survive.
        panic!("EXPSEG_TEST_PANIC=config: the configuration cannot be read");
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
        let _ = std::panic::catch_unwind(exit_work);
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

/// What exit (or SIGTERM) writes: the report, then the rest of the coalescers' trace (whose
/// last lines are the report's queries).
fn exit_work() {
    let _ = std::panic::catch_unwind(write_exit_report);
    super::trace::finish();
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
pub(super) static FORKED: AtomicBool = AtomicBool::new(false);
/// Pid that owns the state; the exit report is written by it only.
static OWNER_PID: AtomicU32 = AtomicU32::new(0);

enum Slot {
    Unopened,
    Open(Box<Pool<CudaDriver>>),
    /// VMM cannot serve this device (why); its calls pass through.
    Off(String),
    /// A pool whose books a panic may have left half-made ([`books_unsure`]): kept as it is
    /// until exit. Its memory stays mapped (the program's pointers keep working), nothing is
    /// handed out from it or given back, and its calls pass through, except the free of a
    /// pointer its books call live, which is answered and leaked ([`State::free_frozen`]).
    Frozen(Box<Pool<CudaDriver>>),
}

pub(super) struct State {
    pub(super) driver: Result<&'static DriverTable, String>,
    pools: Vec<Slot>,
    /// Per owning device, the devices granted peer access to its memory.
    pub(super) grants: Vec<Vec<i32>>,
    /// IPC tickets issued and memory opened through tickets.
    pub(super) ipc: IpcState,
    /// Per device, the id of its primary context when a driver-API call last served there
    /// (`api::notice_reset`: a new id is a reset no hook saw).
    pub(super) primary_ids: std::collections::HashMap<i32, u64>,
    /// Pointers of frozen pools whose free was answered (a second free of one is the
    /// runtime's to answer, as a double free).
    frozen_freed: std::collections::HashSet<u64>,
}

pub(super) static STATE: Lazy<Mutex<State>> = Lazy::new(|| Mutex::new(State::start()));

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
                    primary_ids: Default::default(),
                    frozen_freed: Default::default(),
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
                    primary_ids: Default::default(),
                    frozen_freed: Default::default(),
                }
            }
        }
    }

    /// The pool of `dev`, opened on first use.
    pub(super) fn pool(&mut self, dev: i32) -> Option<&mut Pool<CudaDriver>> {
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
                    p.keep_host(c.pause_keep_host.keeps());
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
                    Slot::Off(why)
                }
            };
        }
        match slot {
            Slot::Open(p) => Some(p),
            _ => None,
        }
    }

    pub(super) fn open_pools(&mut self) -> impl Iterator<Item = (i32, &mut Pool<CudaDriver>)> {
        self.pools
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Open(p) => Some((i as i32, p.as_mut())),
                _ => None,
            })
    }

    /// The pool of `dev` if it is open (never opens one).
    pub(super) fn open_pool(&mut self, dev: i32) -> Option<&mut Pool<CudaDriver>> {
        match self.pools.get_mut(usize::try_from(dev).ok()?)? {
            Slot::Open(p) => Some(p),
            _ => None,
        }
    }

    /// The device whose pool has a live allocation starting at `ptr`.
    pub(super) fn owner(&mut self, ptr: u64) -> Option<i32> {
        self.open_pools()
            .find(|(_, p)| p.live_size(ptr).is_some())
            .map(|(d, _)| d)
    }

    /// The books may be half-made ([`books_unsure`]): every pool is frozen as it is and no
    /// pool opens any more, so every call that would hand memory out, give it back or share
    /// it finds no pool and passes through.
    fn freeze(&mut self) {
        for slot in &mut self.pools {
            *slot = match std::mem::replace(slot, Slot::Unopened) {
                Slot::Open(p) | Slot::Frozen(p) => Slot::Frozen(p),
                Slot::Off(why) => Slot::Off(why),
                Slot::Unopened => Slot::Off("a panic left expseg's books unsure".into()),
            };
        }
    }

    /// The device of the frozen pool whose books call `ptr` a live allocation not freed yet
    /// (read only: an answer, never a release).
    pub(super) fn frozen_owner(&self, ptr: u64) -> Option<i32> {
        if self.frozen_freed.contains(&ptr) {
            return None;
        }
        self.pools.iter().enumerate().find_map(|(d, s)| match s {
            Slot::Frozen(p) if p.live_size(ptr).is_some() => Some(d as i32),
            _ => None,
        })
    }

    /// The program frees `ptr` of a frozen pool: answered, and its memory stays where it is
    /// until exit (leaked: half-made books are never trusted to give memory back). False if
    /// it is not such a pointer or was freed already.
    pub(super) fn free_frozen(&mut self, ptr: u64) -> bool {
        self.frozen_owner(ptr).is_some() && self.frozen_freed.insert(ptr)
    }
}

/// Set for good once a panic poisoned the lock of the pools or of the coalescers: the panic
/// may have cut an update of their books short (a block booked but not returned, a chunk
/// released but still listed), so they are never trusted again to hand memory out or give it
/// back. From then on new allocations pass through to the runtime and the driver, every pool
/// and coalescer is frozen as it is (`State::freeze`, `coalescers::Vmm::freeze`), and frees
/// of their memory are answered and leaked.
static BOOKS_UNSURE: AtomicBool = AtomicBool::new(false);

/// Whether a panic may have left the books half-made ([`BOOKS_UNSURE`]).
pub(crate) fn books_unsure() -> bool {
    BOOKS_UNSURE.load(Ordering::Acquire)
}

/// The lock of `whose` books was found poisoned: from now on the books are unsure (one
/// `[expseg ERROR]` line for the process); the guard, for the caller to freeze them.
fn books_poisoned<T>(p: std::sync::PoisonError<T>, whose: &str) -> T {
    if !BOOKS_UNSURE.swap(true, Ordering::AcqRel) {
        log::error!(
            "a panic inside expseg may have left the books of {whose} half-made: from now on new allocations pass through to CUDA, and the memory expseg handed out stays where it is until exit (its frees are answered; none of it is reused or given back)"
        );
    }
    p.into_inner()
}

/// The pools' lock. The first holder after a panic poisoned it (or the coalescers' lock)
/// freezes the pools.
pub(super) fn lock() -> MutexGuard<'static, State> {
    frozen_if_unsure(
        STATE
            .lock()
            .unwrap_or_else(|p| books_poisoned(p, "the pools")),
    )
}

fn frozen_if_unsure(mut st: MutexGuard<'static, State>) -> MutexGuard<'static, State> {
    if books_unsure() {
        st.freeze();
    }
    st
}

/// Whether this is a forked child (CUDA state is not inherited).
pub fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// Whether calls should even look at the pool.
pub(super) fn bypass() -> bool {
    config().disabled || FORKED.load(Ordering::Relaxed)
}

/// Mark forked children (once per process, whichever of the pool and the coalescers starts
/// first): a child's CUDA state is not its own, so expseg passes everything through there.
pub(super) fn register_fork_hook() {
    extern "C" fn child_after_fork() {
        FORKED.store(true, Ordering::Relaxed);
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[allow(unsafe_code)]
        // SAFETY: registers a plain extern "C" function that only sets an atomic.
        unsafe {
            libc::pthread_atfork(None, None, Some(child_after_fork));
        }
    });
}

/// What a hook should do.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer<T> {
    /// Hand this back to the program.
    Done(T),
    /// Call the real runtime with the program's arguments.
    PassThrough,
}

/// Set once the pool state exists; before that no pointer can be the pool's.
pub(super) static STATE_STARTED: AtomicBool = AtomicBool::new(false);

/// Wait for all work on `dev`, leaving the calling thread's current device as it was.
pub(crate) fn synchronize(dev: i32) -> i32 {
    let t = Instant::now();
    let e = runtime::synchronize_device(dev);
    GLOBAL.syncs.add(1);
    GLOBAL.sync_ns.add(t.elapsed().as_nanos() as u64);
    e
}

pub(super) fn ensure_state() -> MutexGuard<'static, State> {
    let g = lock();
    STATE_STARTED.store(true, Ordering::Release);
    g
}

/// Whether the pool is running, or why not; for reports and diagnostics. "pass-through: ..."
/// when every call so far passed through: no driver, or no device that was asked for could
/// be served (no VMM).
pub(super) fn status(st: &State) -> String {
    if config().disabled {
        return "disabled by EXPSEG_DISABLE".into();
    }
    if books_unsure() {
        return "pass-through for new allocations: a panic left expseg's books unsure (the memory it handed out stays until exit)".into();
    }
    if let Err(why) = &st.driver {
        return format!("pass-through: {why}");
    }
    let served = st.pools.iter().any(|s| matches!(s, Slot::Open(_)));
    match st.pools.iter().find_map(|s| match s {
        Slot::Off(why) => Some(why),
        _ => None,
    }) {
        Some(why) if !served => format!("pass-through: {why}"),
        _ => "pool active".into(),
    }
}

/// Before the pool starts: why it would pass everything through, where that is known without a
/// CUDA call (the driver library is missing or lacks the VMM calls: what starting would find
/// first, as `expseg doctor` does). Looks the library up, calls nothing in it.
pub(super) fn pass_through_before_start() -> Option<String> {
    real::driver()
        .err()
        .map(|why| format!("pass-through: {why}"))
}

/// What the report says of a process whose pool never started: why, where expseg knows it
/// (`EXPSEG_DISABLE`, a driver library that is missing or lacks the VMM calls), else what
/// served it instead (PyTorch's pages) or that no `cudaMalloc` came. `so_far`: the live
/// report's words ("yet"), not the exit report's.
pub(super) fn not_started_status(so_far: bool) -> String {
    if config().disabled {
        "disabled by EXPSEG_DISABLE".into()
    } else if let Some(why) = pass_through_before_start() {
        why
    } else if !coalescers::report_rows().is_empty() {
        "coalescing PyTorch's pages (no cudaMalloc reached the pool)".into()
    } else if so_far {
        "pool not started yet (no cudaMalloc so far)".into()
    } else {
        "pool never started (no cudaMalloc reached it)".into()
    }
}

/// Counters of every pool that opened (frozen ones too: what they hold stays held).
pub(super) fn pool_stats(st: &mut State) -> Vec<(i32, PoolStats)> {
    st.pools
        .iter()
        .enumerate()
        .filter_map(|(d, s)| match s {
            Slot::Open(p) | Slot::Frozen(p) => Some((d as i32, p.stats().clone())),
            _ => None,
        })
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
                guard = Some(frozen_if_unsure(books_poisoned(p, "the pools")));
                break;
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                std::thread::sleep(std::time::Duration::from_millis(2))
            }
        }
    }
    let (status, pools) = match guard.as_mut() {
        Some(st) => (status(st), pool_stats(st)),
        None if !STATE_STARTED.load(Ordering::Acquire) => (not_started_status(false), Vec::new()),
        None => ("pool busy at exit; pool figures missing".into(), Vec::new()),
    };
    let status = status + &crate::api::keep::status_suffix(forked());
    let mut snap = stats::Snapshot::take(status, config().effective(), pools);
    snap.global.extend(coalescers::report_rows());
    if let Err(e) = stats::write_report(&template, &snap) {
        log::error!("cannot write the report to {template}: {e}");
    }
}

/// Whether a foreign run was ever shared (set under the lock before its share is recorded):
/// until then an unmap of PyTorch's pages takes no lock to look for shares.
pub static FOREIGN_SEEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The program unmapped `[va, va+size)`: shares of foreign runs that start there are over
/// (their tickets go stale, their mirrors are freed once no refresh uses them), and a run it
/// cuts after its start is shared up to the cut from now on (`IpcState::unmapped`).
pub fn forget_foreign_range(va: u64, size: u64) {
    if !STATE_STARTED.load(std::sync::atomic::Ordering::Acquire)
        || !FOREIGN_SEEN.load(std::sync::atomic::Ordering::Acquire)
    {
        return;
    }
    let mut st = lock();
    if st.ipc.foreign.is_empty() {
        return;
    }
    let dropped = st.ipc.unmapped(va, size);
    drop(st);
    drop(dropped); // cudaFree outside the lock
}

/// The coalescers of PyTorch's pages, one per device, under a lock of their own; their policy
/// is `api::vmm`'s. They live here, beside the configuration, because the exit report that
/// the configuration registers reads their figures and they read the configuration.
pub(super) mod coalescers {
    use crate::api::keep;
    use crate::api::state::config;
    use crate::api::trace::record;
    use crate::coalesce::trace::{Call, Outcome};
    use crate::coalesce::{CoalesceConfig, CoalesceStats, Coalescer};
    use crate::gpu::cuda::{self, CudaDriver};
    use crate::gpu::Op;
    use crate::real;
    use once_cell::sync::{Lazy, OnceCell};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Mutex, MutexGuard};
    use std::time::Duration;

    pub(crate) struct Vmm {
        pub(crate) devs: Vec<Option<Coalescer<CudaDriver>>>,
        /// Coalescers whose books a panic may have left half-made
        /// ([`crate::api::state::books_unsure`]): taken out of `devs`, so no call finds them
        /// (new pages are the driver's), and kept as they are until exit: their pages stay
        /// mapped, nothing of theirs is moved, reused or given back.
        frozen: Vec<Coalescer<CudaDriver>>,
    }

    pub(crate) static VMM: Lazy<Mutex<Vmm>> = Lazy::new(|| {
        crate::api::state::register_fork_hook();
        let devs = match real::driver() {
            Ok(t) => {
                let n = cuda::device_count(t).unwrap_or(0);
                let c = config();
                let watched = keep::gpus_to_watch(c, n, |d| cuda::device_uuid(t, d));
                let delay_ms = keep::delay_ms(c, &watched);
                // Without the thread that gives kept handles back, nothing would after the delay:
                // release at once instead.
                let threaded = n > 0 && start_releaser(delay_ms);
                let mut cfg = CoalesceConfig::from_config(c, threaded);
                if threaded {
                    cfg.release_delay = Duration::from_millis(delay_ms);
                }
                let watching = threaded && !watched.is_empty();
                cfg.keep_giveback_us = keep::giveback_bound_us(c, watching);
                let devs: Vec<Option<Coalescer<CudaDriver>>> = (0..n)
                    .map(|d| match CudaDriver::open(t, d) {
                        Ok(drv) => {
                            let mut co = Coalescer::new(drv, cfg);
                            co.keep_host(c.pause_keep_host.keeps());
                            // A watched GPU keeps nothing until the watcher has looked.
                            co.set_keeping(!watching);
                            Some(co)
                        }
                        Err(why) => {
                            log::warn!("{why}; its expandable segments are not coalesced");
                            None
                        }
                    })
                    .collect();
                use crate::gpu::Driver as _;
                let granularity: Vec<(i32, u64)> = devs
                    .iter()
                    .flatten()
                    .map(|c| (c.driver().device(), c.driver().granularity()))
                    .collect();
                let trace = c.test_trace.as_deref();
                crate::api::trace::begin(trace, &cfg, c.pause_keep_host.keeps(), &granularity);
                let hooks = keep::Hooks {
                    set_keeping: set_keeping_of,
                    forked: crate::api::state::forked,
                };
                if watching {
                    keep::start(watched, hooks);
                }
                devs
            }
            Err(_) => Vec::new(),
        };
        STARTED.store(true, Ordering::Release);
        Mutex::new(Vmm {
            devs,
            frozen: Vec::new(),
        })
    });

    /// Set once the coalescers exist (before that no handle or address can be theirs).
    static STARTED: AtomicBool = AtomicBool::new(false);

    /// The coalescers, once no IPC mirror refresh is reading memory (any call may unmap pages it
    /// moves: `super::reads`). A refresh registers under this lock, so none starts meanwhile.
    pub(crate) fn lock() -> MutexGuard<'static, Vmm> {
        let g = books();
        crate::api::reads::wait_none();
        g
    }

    /// The coalescers' lock alone (not waiting for reads). The first holder after a panic
    /// poisoned it (or the pools' lock) freezes the coalescers.
    pub(crate) fn books() -> MutexGuard<'static, Vmm> {
        let g = VMM
            .lock()
            .unwrap_or_else(|p| crate::api::state::books_poisoned(p, "PyTorch's coalesced pages"));
        frozen_if_unsure(g)
    }

    fn frozen_if_unsure(mut g: MutexGuard<'static, Vmm>) -> MutexGuard<'static, Vmm> {
        if crate::api::state::books_unsure() {
            g.freeze();
        }
        g
    }

    /// Whether the coalescers serve: started, and not in a forked child (whose pages and
    /// locks are copies of the parent's, possibly taken by a thread that does not exist there;
    /// everything passes through to the driver, which answers a child's calls as natively).
    pub(crate) fn started() -> bool {
        STARTED.load(Ordering::Acquire) && !crate::api::state::forked()
    }

    impl Vmm {
        pub(crate) fn all(&mut self) -> impl Iterator<Item = &mut Coalescer<CudaDriver>> {
            self.devs.iter_mut().flatten()
        }

        pub(crate) fn owner(&mut self, vh: u64) -> Option<&mut Coalescer<CudaDriver>> {
            self.all().find(|c| c.owns(vh))
        }

        /// The books may be half-made: every coalescer is frozen as it is.
        fn freeze(&mut self) {
            for c in self.devs.iter_mut().filter_map(Option::take) {
                self.frozen.push(c);
            }
        }

        /// Whether the page `vh` is a frozen coalescer's (read only).
        pub(crate) fn frozen_owns(&self, vh: u64) -> bool {
            self.frozen.iter().any(|c| c.owns(vh))
        }

        /// Whether a frozen coalescer maps memory in `[va, va+size)` (read only).
        pub(crate) fn frozen_maps_in(&self, va: u64, size: u64) -> bool {
            self.frozen.iter().any(|c| c.maps_in(va, size))
        }
    }

    /// Run `f` on `c` with its device's primary context current on the calling thread (pushed
    /// for the call and popped after when another context is current): expseg's driver calls for
    /// device d are made in d's context, as PyTorch's own calls for d are made under its device
    /// guard, whatever device the thread is on when PyTorch empties every device's cache, the
    /// program asks another device's free memory, or the releaser thread wakes. A coalescer that
    /// holds nothing makes no driver call: its context is left alone.
    ///
    /// Only on the device's allocator thread may the call move live pages it was not asked to
    /// move (`crate::api::allocator`).
    pub(crate) fn in_context<T>(
        c: &mut Coalescer<CudaDriver>,
        f: impl FnOnce(&mut Coalescer<CudaDriver>) -> T,
    ) -> T {
        use crate::gpu::Driver as _;
        c.allow_moves(crate::api::allocator::may_move(c.driver().device()));
        let r = match real::driver() {
            Ok(t) if c.holds_anything() => {
                let dev = c.driver().device();
                cuda::with_primary(t, dev, || f(c))
            }
            _ => f(c),
        };
        if c.kept_bytes() > 0 {
            wake_releaser();
        }
        r
    }

    /// The releaser thread, once spawned.
    static RELEASER: OnceCell<std::thread::Thread> = OnceCell::new();

    /// A coalescer keeps handles: the releaser checks every millisecond until none are kept.
    fn wake_releaser() {
        if let Some(t) = RELEASER.get() {
            t.unpark();
        }
    }

    /// `api::keep`'s hook: device `dev` keeps released memory, or gives it back (what that did);
    /// None before the coalescers exist (the watcher may look while they are being made).
    fn set_keeping_of(dev: i32, keep: bool) -> Option<keep::GaveBack> {
        use crate::gpu::Driver as _;
        let t0 = std::time::Instant::now();
        let mut v = started().then(lock)?;
        let waited_us = t0.elapsed().as_micros() as u64;
        let on_dev = v.all().filter(|c| c.driver().device() == dev);
        let trim = on_dev.map(|c| in_context(c, |c| c.set_keeping_timed(keep)));
        let trim = trim.fold(Default::default(), crate::coalesce::TrimParts::plus);
        Some(keep::GaveBack { waited_us, trim })
    }

    /// Kept handles go back to the driver once the program has been quiet for the delay: a
    /// thread of its own checks every millisecond while any are kept and sleeps while none are
    /// (woken by the call that keeps one; started at the first coalescer; never in a forked
    /// child). False if there is none (no delay, or no thread).
    ///
    /// It never compacts: a compaction briefly unmaps live pages, which is safe only inside
    /// one of the program's allocator calls (outside them its threads launch work on those
    /// pages; tried on the fake driver: the program faulted). Pages a release loop
    /// left stranded wait for the program's next call.
    fn start_releaser(delay_ms: u64) -> bool {
        let delay = Duration::from_millis(delay_ms);
        if delay.is_zero() {
            return false;
        }
        // One pass: whether any handle is still kept.
        let pass = move || {
            if config().test_panic("releaser") {
                panic!("EXPSEG_TEST_PANIC=releaser");
            }
            let mut any = false;
            for c in lock().all() {
                if c.kept_bytes() > 0 && c.idle_for() >= delay {
                    in_context(c, |c| c.release_kept());
                    record(c, Call::Releaser, Outcome::DONE);
                }
                any |= c.kept_bytes() > 0;
            }
            any
        };
        let spawned = std::thread::Builder::new()
            .name("expseg-release".into())
            .spawn(move || loop {
                if crate::api::state::forked() {
                    return;
                }
                let any = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&pass)) {
                    Ok(any) => any,
                    // Kept handles then go back at the program's next call that makes room.
                    Err(_) => {
                        crate::stats::GLOBAL.panics_caught.add(1);
                        log::error!("expseg-release: internal error caught; kept handles are no longer given back after the delay");
                        return;
                    }
                };
                match any {
                    true => std::thread::sleep(Duration::from_millis(1)),
                    // A wake-up given meanwhile makes park return at once.
                    false => std::thread::park(),
                }
            });
        match spawned {
            Ok(t) => {
                let _ = RELEASER.set(t.thread().clone());
                true
            }
            Err(e) => {
                log::warn!("no thread to give kept handles back ({e}); releasing at once instead");
                false
            }
        }
    }

    /// Per device: counters, pages held, physical handles, stranded bytes, driver calls.
    #[allow(clippy::type_complexity)]
    pub fn stats() -> Vec<(i32, CoalesceStats, usize, usize, u64, Vec<(u64, u64)>)> {
        if !started() {
            return Vec::new();
        }
        use crate::gpu::Driver as _;
        let mut v = match VMM.try_lock() {
            Ok(g) => frozen_if_unsure(g),
            Err(std::sync::TryLockError::Poisoned(p)) => frozen_if_unsure(
                crate::api::state::books_poisoned(p, "PyTorch's coalesced pages"),
            ),
            Err(_) => return Vec::new(),
        };
        v.all()
            .map(|c| {
                let (pages, phys) = c.counts();
                let stranded = c.stranded_now();
                record(c, Call::StrandedNow, stranded);
                (
                    c.driver().device(),
                    c.stats().clone(),
                    pages,
                    phys,
                    stranded,
                    c.driver_calls().to_vec(),
                )
            })
            .collect()
    }

    /// Row names of the per-device figures (made once, for up to 64 devices).
    static DEVICE_ROWS: Lazy<Vec<[&'static str; 3]>> = Lazy::new(|| {
        (0..64)
            .map(|d| {
                [
                    format!("coalesce_dev{d}_stranded_bytes"),
                    format!("coalesce_dev{d}_peak_stranded_bytes"),
                    format!("coalesce_dev{d}_peak_held_bytes"),
                ]
                .map(|s| &*Box::leak(s.into_boxed_str()))
            })
            .collect()
    });

    /// The coalescers' figures for the exit report, summed over devices (and per device
    /// where it says so).
    pub fn report_rows() -> Vec<(&'static str, u64)> {
        let all = stats();
        if all.is_empty() {
            return Vec::new();
        }
        let sum =
            |f: &dyn Fn(&CoalesceStats) -> u64| all.iter().map(|(_, s, ..)| f(s)).sum::<u64>();
        let mut rows = vec![
            ("coalesce_pages_created", sum(&|s| s.pages_created)),
            ("coalesce_handles_created", sum(&|s| s.phys_created)),
            ("coalesce_handles_released", sum(&|s| s.phys_released)),
            ("coalesce_exact_creates", sum(&|s| s.exact_creates)),
            ("coalesce_compactions", sum(&|s| s.compactions)),
            ("coalesce_compacted_bytes", sum(&|s| s.compacted_bytes)),
            ("coalesce_host_copies", sum(&|s| s.host_copies)),
            (
                "coalesce_compaction_failures",
                sum(&|s| s.compaction_failures),
            ),
            ("coalesce_access_fallbacks", sum(&|s| s.access_fallbacks)),
            ("coalesce_exports_split", sum(&|s| s.exports_split)),
            ("coalesce_splits_refused", sum(&|s| s.splits_refused)),
            (
                "coalesce_cross_device_waits",
                sum(&|s| s.cross_device_waits),
            ),
            ("coalesce_held_moves", sum(&|s| s.held_moves)),
            (
                "coalesce_moves_refused_capture",
                sum(&|s| s.moves_refused_capture),
            ),
            ("coalesce_peer_holds", sum(&|s| s.peer_holds)),
            ("coalesce_peer_holds_let_go", sum(&|s| s.peer_holds_let_go)),
            ("coalesce_moves_put_off", sum(&|s| s.moves_put_off)),
            ("coalesce_peak_stranded_bytes", sum(&|s| s.peak_stranded)),
            ("coalesce_peak_beyond_bytes", sum(&|s| s.peak_beyond)),
            ("coalesce_peak_held_bytes", sum(&|s| s.peak_held)),
            ("coalesce_moves_declined", sum(&|s| s.moves_declined)),
            (
                "coalesce_reused_stranded_bytes",
                sum(&|s| s.reused_stranded),
            ),
            ("coalesce_cuts_learned", sum(&|s| s.cuts_learned)),
            (
                "coalesce_tail_splits_useful",
                sum(&|s| s.tail_splits_useful),
            ),
            ("coalesce_reused_bytes", sum(&|s| s.reused_bytes)),
            ("coalesce_kept_released", sum(&|s| s.kept_released)),
            ("coalesce_kept_bounded", sum(&|s| s.kept_bounded)),
            (
                "coalesce_reused_in_place_bytes",
                sum(&|s| s.reused_in_place),
            ),
            ("coalesce_ahead_used_bytes", sum(&|s| s.ahead_used)),
            ("coalesce_ahead_returned_bytes", sum(&|s| s.ahead_returned)),
            ("coalesce_access_skipped", sum(&|s| s.access_skipped)),
            ("coalesce_meminfo_skipped", sum(&|s| s.meminfo_skipped)),
            ("coalesce_pages_live", all.iter().map(|a| a.2 as u64).sum()),
            (
                "coalesce_handles_live",
                all.iter().map(|a| a.3 as u64).sum(),
            ),
            ("coalesce_stranded_bytes", all.iter().map(|a| a.4).sum()),
        ];
        // Per device: stranded bytes now and at peak, and the peak held behind pages.
        for a in &all {
            if let Some(names) = usize::try_from(a.0).ok().and_then(|d| DEVICE_ROWS.get(d)) {
                rows.push((names[0], a.4));
                rows.push((names[1], a.1.peak_stranded));
                rows.push((names[2], a.1.peak_held));
            }
        }
        // Driver time of the coalescers, per operation that was called: its calls and their ns.
        macro_rules! names {
            ($($op:literal),*) => {
                ([$(concat!("coalesce_", $op)),*], [$(concat!("coalesce_", $op, "_ns")),*])
            };
        }
        const ROWS: ([&str; Op::ALL.len() + 1], [&str; Op::ALL.len() + 1]) = names!(
            "create",
            "release",
            "reserve",
            "free_va",
            "map",
            "unmap",
            "set_access",
            "legacy_alloc",
            "legacy_free",
            "copy",
            "ipc_handle",
            "sync",
            "meminfo"
        );
        let (names, ns) = ROWS;
        for i in 0..names.len() {
            let calls: u64 = all.iter().map(|a| a.5[i].0).sum();
            if calls > 0 {
                rows.push((names[i], calls));
                rows.push((ns[i], crate::clock::ns(all.iter().map(|a| a.5[i].1).sum())));
            }
        }
        rows
    }
}
