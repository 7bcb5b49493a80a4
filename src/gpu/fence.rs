//! The fence of a move: a move's copies and a hold on the device's legacy default stream,
//! launched as one graph, so that work any thread of the program queues on that stream (or on
//! a blocking stream) while live pages are away starts only once they are back. Kernels of
//! statically linked runtimes (PyTorch's own) reach no hook; the stream holds them all.
//! With `EXPSEG_PEER_HOLD`, the legacy streams of other devices given access to the pages
//! are held too, by stream memory operations, from before the copies on.
#![allow(unsafe_code)]

use super::{check, DrvError, DrvResult, Held, PeerWait, NOT_SUPPORTED};
use crate::real::primary::{pop_primary, push_primary};
use crate::real::DriverTable;
use cudarc::driver::sys::CUstream;
use libc::c_void;
use std::time::{Duration, Instant};

/// The current context's legacy default stream.
const CU_STREAM_LEGACY: CUstream = 1 as CUstream;

/// Whether moves hold the default stream (`EXPSEG_MOVE_FENCE`, set from the configuration).
static MOVE_FENCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turn the fence of moves on or off (`EXPSEG_MOVE_FENCE`).
pub fn set_move_fence(on: bool) {
    MOVE_FENCE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether moves hold the default stream.
pub fn enabled() -> bool {
    MOVE_FENCE.load(std::sync::atomic::Ordering::Relaxed)
}

/// A host function queued on a device's legacy default stream behind a move's copies: once it
/// runs, the copies and every earlier operation of that stream (and of the blocking streams it
/// waits for) have ended, and until it returns no later one starts. States: 0 queued, 1
/// running, 2 released.
#[derive(Default)]
struct Fence {
    state: std::sync::Mutex<u8>,
    changed: std::sync::Condvar,
    /// The watchdog let the move's peers go before the fence ran ([`watch`]).
    peers_let_go: std::sync::atomic::AtomicBool,
    /// The move keeps peers held until it is done (the watchdog's last deadline applies).
    peers_kept: std::sync::atomic::AtomicBool,
}

impl Fence {
    /// The state, even after a panic poisoned its lock (here and in the waits below): it is
    /// one byte, always written whole, so a poisoned lock never guards a half-made state.
    fn lock(&self) -> std::sync::MutexGuard<'_, u8> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until the stream reached the fence (no bound: the copies before it must have run
    /// before anything they wrote to is touched again; a warning every 10 s).
    fn wait_running(&self, dev: i32) {
        let t0 = std::time::Instant::now();
        let mut s = self.lock();
        while *s == 0 {
            s = match self
                .changed
                .wait_timeout(s, std::time::Duration::from_secs(10))
            {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
            if *s == 0 {
                log::warn!(
                    "device {dev}: a move waits for the default stream's earlier work ({:.0} s)",
                    t0.elapsed().as_secs_f64()
                );
            }
        }
    }

    /// Wait until the stream reached the fence, or `until`: whether it did.
    fn running_by(&self, until: Instant) -> bool {
        let mut s = self.lock();
        while *s == 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s = match self.changed.wait_timeout(s, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    fn release(&self) {
        *self.lock() = 2;
        self.changed.notify_all();
    }
}

/// The fence's host function: says it runs, then holds the stream until released.
unsafe extern "C" fn fence_runs(p: *mut c_void) {
    // SAFETY: `p` is the `Arc::into_raw` reference `copy_and_hold` put in the graph it
    // launched once; this one run takes it back.
    let f = unsafe { std::sync::Arc::from_raw(p as *const Fence) };
    // Nothing here is expected to panic; if it did, the stream goes on rather than the
    // driver's thread unwinding into C.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut s = f.lock();
        if *s == 0 {
            *s = 1;
            f.changed.notify_all();
        }
        while *s != 2 {
            s = match f.changed.wait(s) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
    }));
}

/// The fence held for a move; dropped, the stream goes on.
struct FenceHeld(std::sync::Arc<Fence>);

impl Drop for FenceHeld {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// The copies and the fence of a move as one graph (captured on this driver's own stream:
/// the copies, then the host function), launched on the legacy default stream: one
/// launch, so no other thread's work falls between the copies and the fence. Under the
/// fence only VMM calls remain, which the driver answers even while another thread is
/// blocked on a full launch queue behind it (`scripts/vmm-cost/fence_calls.cu`); a copy
/// made there would never end.
///
/// `peers`: devices whose legacy streams are held first ([`hold_peers`], their holds waited
/// for as `wait` says), so that nothing they queue meanwhile writes the pages between the
/// copy and the remap. Where the fence
/// does not run within [`PEER_WAIT`] while peers are held (this stream waits for work queued
/// behind a peer's hold), the peers are let go and the fence waited for as without them.
pub(super) fn copies_then_hold(
    t: &DriverTable,
    s: CUstream,
    dev: i32,
    copies: &[(u64, u64, u64)],
    peers: &[i32],
    wait: PeerWait,
) -> DrvResult<Held> {
    let missing = DrvError(NOT_SUPPORTED);
    let begin = t.cuStreamBeginCapture_v2.ok_or(missing)?;
    let end = t.cuStreamEndCapture.ok_or(missing)?;
    let instantiate = t.cuGraphInstantiateWithFlags.ok_or(missing)?;
    let launch = t.cuGraphLaunch.ok_or(missing)?;
    let destroy_exec = t.cuGraphExecDestroy.ok_or(missing)?;
    let destroy = t.cuGraphDestroy.ok_or(missing)?;
    let host = t.cuLaunchHostFunc.ok_or(missing)?;
    let copy = t.cuMemcpyDtoDAsync_v2.ok_or(missing)?;
    const RELAXED: u32 = 2; // CU_STREAM_CAPTURE_MODE_RELAXED: other threads unaffected
    let fence = std::sync::Arc::new(Fence::default());
    let (mut peers, mut let_go) = match peers.is_empty() {
        true => (Vec::new(), 0),
        false => hold_peers(t, peers, &fence, start_wait(wait)),
    };
    let raw = std::sync::Arc::into_raw(fence.clone()) as *mut c_void;
    // SAFETY: a stream of this driver's; the copies' ranges are device memory mapped for
    // their sizes (the caller's); `raw` is taken back by the host function's one run, or
    // below when the graph is not launched.
    let launched = unsafe {
        let mut graph: *mut c_void = std::ptr::null_mut();
        let mut rc = begin(s, RELAXED);
        let captured = rc == 0;
        for &(dst, src, size) in copies {
            if rc == 0 {
                rc = copy(dst, src, size as usize, s);
            }
        }
        if rc == 0 {
            rc = host(s, fence_runs, raw);
        }
        if captured {
            let e = end(s, &mut graph);
            if rc == 0 {
                rc = e;
            }
        }
        let mut exec: *mut c_void = std::ptr::null_mut();
        if rc == 0 {
            rc = instantiate(&mut exec, graph, 0);
        }
        if rc == 0 {
            rc = launch(exec, CU_STREAM_LEGACY);
        }
        if !exec.is_null() {
            destroy_exec(exec); // freed once it has run
        }
        if !graph.is_null() {
            destroy(graph);
        }
        if rc != 0 {
            drop(std::sync::Arc::from_raw(raw as *const Fence));
        }
        check(rc)
    };
    launched?;
    if !peers.is_empty() && !fence.running_by(Instant::now() + PEER_WAIT) {
        log::debug!(
            "device {dev}: the move's fence waits for a held peer; letting {} go",
            peers.len()
        );
        let_go += peers.len() as u32;
        peers.clear();
    }
    if fence.peers_let_go.load(std::sync::atomic::Ordering::SeqCst) {
        let_go += peers.len() as u32;
        peers.clear();
    }
    fence.wait_running(dev);
    let kept = peers.len() as u32;
    if kept > 0 {
        fence
            .peers_kept
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
    // Dropped in order: this device's fence, then the peers'.
    Ok(Held::new(Box::new((FenceHeld(fence), peers))).with_peers(kept, let_go))
}

/// How long a move waits for a peer's hold to start, and for its own fence to run while
/// peers are held, before it lets them go (two devices' streams may wait on each other's
/// events, as PyTorch's copies between devices make them: a hold on one can keep the other
/// from ever reaching its own).
pub const PEER_WAIT: Duration = Duration::from_millis(200);

/// How long a move waits for its peers' holds to start ([`PeerWait`]).
fn start_wait(wait: PeerWait) -> Duration {
    match wait {
        PeerWait::Brief => PEER_WAIT,
        PeerWait::Patient => PEER_START_MAX,
    }
}

/// The longest a patient move ([`PeerWait::Patient`]: one the program's call needs, or one
/// giving memory back where it is asked for) waits for its peers' holds to start: the work
/// their streams queued before the holds must end first (on two GPUs a thread adding into
/// 256 MiB through peer access kept device 1's queue longer than 200 ms at every move).
pub const PEER_START_MAX: Duration = Duration::from_secs(10);

/// The longest peers stay held through a move: past it the watchdog lets them go, with a
/// warning, whatever the move is doing (its VMM calls under the hold have never needed a
/// held peer's queue, but nothing proves they never will).
pub const PEER_HOLD_MAX: Duration = Duration::from_secs(2);

/// Pairs of words [reached, release] that peers' holds use, in one page of page-locked host
/// memory that every device reads and writes.
const SLOTS: usize = 512;

/// The page of the peers' holds, made at the first hold.
static WORDS: once_cell::sync::OnceCell<Option<Words>> = once_cell::sync::OnceCell::new();

/// What a slot of the page is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    Taken,
    /// Let go before its hold was seen to start: its device may still write `reached`, so it
    /// is free again only once `reached` shows its generation.
    Abandoned,
}

/// The page of the peers' holds and which of its slots are taken.
struct Words {
    host: std::ptr::NonNull<u32>,
    /// The address devices use for it.
    dev: u64,
    /// Per slot: the last generation used and its state.
    slots: std::sync::Mutex<Vec<(u32, SlotState)>>,
}

// SAFETY: the page is never freed, and its words are only read and written atomically.
unsafe impl Send for Words {}
unsafe impl Sync for Words {}

impl Words {
    /// Made once, in the current context (portable: every context may use it). `None` where
    /// the driver lacks the calls or refuses (one log line).
    fn get(t: &DriverTable) -> Option<&'static Words> {
        WORDS
            .get_or_init(|| {
                let w = Words::make(t);
                if let Err(e) = &w {
                    log::info!("no hold for peers' default streams: {e}");
                }
                w.ok()
            })
            .as_ref()
    }

    fn make(t: &DriverTable) -> Result<Words, String> {
        let missing = "the driver lacks stream memory operations".to_string();
        let register = t.cuMemHostRegister_v2.ok_or(missing.clone())?;
        let device_ptr = t.cuMemHostGetDevicePointer_v2.ok_or(missing.clone())?;
        t.cuStreamBatchMemOp_v2.ok_or(missing)?;
        const PAGE: usize = 4096;
        let layout = std::alloc::Layout::from_size_align(PAGE, PAGE).map_err(|e| e.to_string())?;
        // SAFETY: a non-zero size; the page lives for the process (devices may touch it
        // until the end).
        let host = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(host) = std::ptr::NonNull::new(host) else {
            return Err("no host page".into());
        };
        const PORTABLE: u32 = 1;
        const DEVICEMAP: u32 = 2;
        let mut dev = 0u64;
        // SAFETY: a page-aligned page of ours; valid out-pointer. On failure the page is
        // freed only where it is surely not registered (else it is left as it is).
        let rc = unsafe {
            match register(host.as_ptr().cast(), PAGE, PORTABLE | DEVICEMAP) {
                0 => device_ptr(&mut dev, host.as_ptr().cast(), 0),
                e => {
                    std::alloc::dealloc(host.as_ptr(), layout);
                    e
                }
            }
        };
        if rc != 0 {
            return Err(format!("host page not registered (CUresult {rc})"));
        }
        Ok(Words {
            host: host.cast(),
            dev,
            slots: std::sync::Mutex::new(vec![(0, SlotState::Free); SLOTS]),
        })
    }

    /// Word `which` (0: reached, 1: release) of `slot`.
    fn word(&self, slot: usize, which: usize) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: inside the page (2 * SLOTS words of 4096 bytes), aligned, never freed;
        // the host touches it only atomically.
        unsafe { std::sync::atomic::AtomicU32::from_ptr(self.host.as_ptr().add(2 * slot + which)) }
    }

    /// Whether the device executed slot's hold of generation `gen` (wrote `reached`).
    fn reached(&self, slot: usize, gen: u32) -> bool {
        self.word(slot, 0)
            .load(std::sync::atomic::Ordering::Acquire)
            == gen
    }

    /// A free slot and its next generation. A slot whose generations ran out stays unused
    /// (its words never go back down).
    fn take(&self) -> Option<(usize, u32)> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let free = |(i, s): &(usize, &mut (u32, SlotState))| {
            s.0 < u32::MAX
                && match s.1 {
                    SlotState::Free => true,
                    SlotState::Taken => false,
                    SlotState::Abandoned => self.reached(*i, s.0),
                }
        };
        let (i, s) = slots.iter_mut().enumerate().find(free)?;
        s.0 += 1;
        s.1 = SlotState::Taken;
        Some((i, s.0))
    }

    /// Give a slot back: free, or abandoned where its hold may still be executed.
    fn give_back(&self, slot: usize, started: bool) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots[slot].1 = match started {
            true => SlotState::Free,
            false => SlotState::Abandoned,
        };
    }

    /// Let slot's hold of generation `gen` go (from any thread, any number of times: a late
    /// one never lowers the word under a later generation's release).
    fn release(&self, slot: usize, gen: u32) {
        self.word(slot, 1)
            .fetch_max(gen, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the page is still registered where it was (a context reset unregisters it).
    fn still_mapped(&self, t: &DriverTable) -> bool {
        let Some(device_ptr) = t.cuMemHostGetDevicePointer_v2 else {
            return false;
        };
        let mut dev = 0u64;
        // SAFETY: valid out-pointer; the driver checks the host address.
        unsafe { device_ptr(&mut dev, self.host.as_ptr().cast(), 0) == 0 && dev == self.dev }
    }
}

/// Peers' holds for the watchdog: let go at `until` unless the move's fence runs by then (the
/// mover may be stuck inside the driver meanwhile, as a launch into a full queue of a stream
/// that waits for a held peer, where its own bounded waits cannot help), and at `max` if the
/// move still holds them.
struct Watch {
    fence: std::sync::Arc<Fence>,
    holds: Vec<(usize, u32)>,
    until: Instant,
    max: Instant,
    /// `until` has passed with the fence running.
    looked: bool,
}

impl Watch {
    fn release(&self) {
        if let Some(words) = WORDS.get().and_then(Option::as_ref) {
            for &(slot, gen) in &self.holds {
                words.release(slot, gen);
            }
        }
    }

    /// Act on the deadlines passed by `now`: whether the job is done.
    fn due(&mut self, now: Instant) -> bool {
        if !self.looked && now >= self.until {
            self.looked = true;
            // Under the fence's lock: it cannot start running meanwhile, so the mover reads
            // `peers_let_go` right once it runs.
            let state = self.fence.lock();
            match *state {
                0 => {
                    self.fence
                        .peers_let_go
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                    self.release();
                    log::debug!("a watchdog let {} peers' holds go", self.holds.len());
                    return true;
                }
                2 => return true, // the move is done
                _ => {}
            }
        }
        if self.looked && now >= self.max {
            let state = self.fence.lock();
            if *state == 1
                && self
                    .fence
                    .peers_kept
                    .load(std::sync::atomic::Ordering::SeqCst)
            {
                self.release();
                log::warn!(
                    "a move held {} other devices' default streams for {} s: let go",
                    self.holds.len(),
                    PEER_HOLD_MAX.as_secs()
                );
            }
            return true;
        }
        false
    }
}

/// Hand `w` to the watchdog thread (made at the first call): false where there is none, and
/// then nothing may be held.
fn watch(w: Watch) -> bool {
    static TX: once_cell::sync::OnceCell<Option<crossbeam::channel::Sender<Watch>>> =
        once_cell::sync::OnceCell::new();
    let tx = TX.get_or_init(|| {
        let (tx, rx) = crossbeam::channel::unbounded::<Watch>();
        let spawned = std::thread::Builder::new()
            .name("expseg-peerhold".into())
            .spawn(move || {
                use crossbeam::channel::RecvTimeoutError;
                let mut pending: Vec<Watch> = Vec::new();
                loop {
                    let next = pending
                        .iter()
                        .map(|w| if w.looked { w.max } else { w.until })
                        .min();
                    let got = match next {
                        Some(t) => rx.recv_deadline(t),
                        None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                    };
                    match got {
                        Ok(w) => pending.push(w),
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                    let now = Instant::now();
                    pending.retain_mut(|w| !w.due(now));
                }
            });
        if let Err(e) = &spawned {
            log::info!("no watchdog thread for peers' holds ({e}): peers are not held");
        }
        spawned.ok().map(|_| tx)
    });
    tx.as_ref().is_some_and(|tx| tx.send(w).is_ok())
}

/// One peer's legacy stream held by one batch of stream memory operations queued on it,
/// [write `reached` = generation; wait until `release` >= generation] (one call, so no other
/// thread's work falls between them): once `reached` reads the generation, every earlier
/// operation of that stream (and of its blocking streams) has ended, and no later one starts
/// until the hold drops.
pub(super) struct PeerHeld {
    words: &'static Words,
    slot: usize,
    gen: u32,
    dev: i32,
}

impl PeerHeld {
    /// Wait until the hold started, or `until`: whether it did.
    fn reached_by(&self, until: Instant) -> bool {
        loop {
            if self.words.reached(self.slot, self.gen) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

impl Drop for PeerHeld {
    fn drop(&mut self) {
        self.words.release(self.slot, self.gen);
        let started = self.words.reached(self.slot, self.gen);
        if !started {
            log::debug!("device {}: a hold let go before it started", self.dev);
        }
        self.words.give_back(self.slot, started);
    }
}

/// Hold the legacy default stream of each device in `peers` (their primary contexts) for a
/// move whose own fence is `fence`, and wait up to `start` for the holds to start: the
/// holds that started, and how many did not (those are let go: the caller decides what the
/// move does without them). The watchdog lets every one go unless `fence` runs twice
/// [`PEER_WAIT`] after queueing (with a longer `start`: after they started), and
/// [`PEER_HOLD_MAX`] after in any case.
fn hold_peers(
    t: &DriverTable,
    peers: &[i32],
    fence: &std::sync::Arc<Fence>,
    start: Duration,
) -> (Vec<PeerHeld>, u32) {
    let none = (Vec::new(), peers.len() as u32);
    let Some(words) = Words::get(t) else {
        return none;
    };
    if !words.still_mapped(t) {
        log::debug!("the page of peers' holds is no longer registered: peers not held");
        return none;
    }
    let mut slots = Vec::with_capacity(peers.len());
    for &dev in peers {
        match words.take() {
            Some((slot, gen)) => slots.push((dev, slot, gen)),
            None => log::debug!("device {dev}: no free slot for a hold"),
        }
    }
    let now = Instant::now();
    let longer = start.saturating_sub(PEER_WAIT);
    let watched = watch(Watch {
        fence: fence.clone(),
        holds: slots.iter().map(|&(_, slot, gen)| (slot, gen)).collect(),
        until: now + longer + 2 * PEER_WAIT,
        max: now + longer + PEER_HOLD_MAX,
        looked: false,
    });
    if !watched {
        for &(_, slot, _) in &slots {
            words.give_back(slot, true); // nothing was queued
        }
        return none;
    }
    let mut held: Vec<PeerHeld> = slots
        .into_iter()
        .filter_map(|(dev, slot, gen)| hold_one(t, words, dev, slot, gen))
        .collect();
    let t0 = Instant::now();
    let until = t0 + start;
    held.retain(|h| {
        let started = h.reached_by(until);
        if !started && start > PEER_WAIT {
            log::warn!(
                "device {}: its default stream's hold did not start in {} s: let go (a move that can wait is put off, one the program's call needs goes on unheld)",
                h.dev,
                start.as_secs()
            );
        } else if !started {
            log::debug!(
                "device {}: its default stream's hold did not start in time",
                h.dev
            );
        }
        started
    });
    if start > PEER_WAIT && !held.is_empty() {
        log::debug!(
            "peers' holds started after {:.0} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );
        // Started: from here the fence gets what a brief wait gives it, twice PEER_WAIT (a
        // second watch; the first stays as a backstop, and a second release is harmless).
        let now = Instant::now();
        watch(Watch {
            fence: fence.clone(),
            holds: held.iter().map(|h| (h.slot, h.gen)).collect(),
            until: now + 2 * PEER_WAIT,
            max: now + PEER_HOLD_MAX,
            looked: false,
        });
    }
    let let_go = (peers.len() - held.len()) as u32;
    (held, let_go)
}

/// Queue one hold on `dev`'s legacy default stream in `slot`, generation `gen`.
fn hold_one(
    t: &DriverTable,
    words: &'static Words,
    dev: i32,
    slot: usize,
    gen: u32,
) -> Option<PeerHeld> {
    let reached = words.dev + (8 * slot) as u64;
    // CUstreamBatchMemOpParams (48 bytes): operation, address, value, flags, alias.
    const WAIT_VALUE_32: u64 = 1;
    const WRITE_VALUE_32: u64 = 2;
    const WAIT_GEQ: u64 = 0;
    let mut ops: [[u64; 6]; 2] = [
        [WRITE_VALUE_32, reached, gen as u64, 0, 0, 0],
        [WAIT_VALUE_32, reached + 4, gen as u64, WAIT_GEQ, 0, 0],
    ];
    let rc = match t.cuStreamBatchMemOp_v2 {
        None => NOT_SUPPORTED,
        Some(batch) => match push_primary(t, dev) {
            Err(e) => e,
            Ok(pushed) => {
                // SAFETY: two parameter blocks of the driver's layout, addresses in the page
                // every device maps; the stream is `dev`'s primary context's legacy one.
                let rc = unsafe { batch(CU_STREAM_LEGACY, 2, ops.as_mut_ptr().cast(), 0) };
                if pushed {
                    pop_primary(t);
                }
                rc
            }
        },
    };
    if rc != 0 {
        log::debug!("device {dev}: no hold on its default stream (CUresult {rc})");
        // Nothing should be queued; should the driver have queued it anyway, it passes.
        words.release(slot, gen);
        words.give_back(slot, false);
        return None;
    }
    Some(PeerHeld {
        words,
        slot,
        gen,
        dev,
    })
}

/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: a stream of the device captures a CUDA graph; no
/// move is made while it does (the device wait before a move would end the capture).
pub const CAPTURING: u32 = 900;

/// The first stream of `list` (the program's, `gpu::streams`) that captures a CUDA graph now,
/// if any; said once as a warning (later at debug level): the move that needed the check is
/// not made.
pub fn capturing(t: &DriverTable, dev: i32, list: &[crate::gpu::streams::Stream]) -> Option<usize> {
    let s = list
        .iter()
        .find(|s| in_context(t, s.ctx, || stream_capturing(t, s.stream)).unwrap_or(false))?;
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let level = match SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        false => log::Level::Warn,
        true => log::Level::Debug,
    };
    log::log!(level, "device {dev}: no page moves now: stream {:#x} of the program's captures a CUDA graph (the device wait before a move would end the capture); a move that can wait is put off, a call that needs one fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (later ones at debug level)", s.stream);
    Some(s.stream)
}

/// Whether `stream` captures a graph now (`cuStreamIsCapturing`: active or invalidated).
fn stream_capturing(t: &DriverTable, stream: usize) -> bool {
    let Some(f) = t.cuStreamIsCapturing else {
        return false;
    };
    let mut status: libc::c_uint = 0;
    // SAFETY: valid out-pointer; the stream is the program's, in the current context.
    unsafe { f(stream as CUstream, &mut status) == 0 && status != 0 }
}

/// Run `f` with context `ctx` current (pushed, then popped); `None` where it cannot be pushed
/// (a context destroyed meanwhile).
fn in_context<T>(t: &DriverTable, ctx: usize, f: impl FnOnce() -> T) -> Option<T> {
    let push = t.cuCtxPushCurrent_v2?;
    let pop = t.cuCtxPopCurrent_v2?;
    // SAFETY: a context the program made a stream in (a destroyed one gets an error).
    if unsafe { push(ctx as cudarc::driver::sys::CUcontext) } != 0 {
        return None;
    }
    let r = f();
    let mut out: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; pops what was pushed above.
    unsafe { pop(&mut out) };
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words over plain memory (no driver): the slots' books alone.
    fn words() -> &'static Words {
        let page: &'static mut [u32] = Box::leak(vec![0u32; 2 * SLOTS].into_boxed_slice());
        Box::leak(Box::new(Words {
            host: std::ptr::NonNull::new(page.as_mut_ptr()).unwrap(),
            dev: 0,
            slots: std::sync::Mutex::new(vec![(0, SlotState::Free); SLOTS]),
        }))
    }

    #[test]
    fn a_slot_comes_back_with_the_next_generation() {
        let w = words();
        assert_eq!(w.take(), Some((0, 1)));
        assert_eq!(w.take(), Some((1, 1)), "a taken slot is not handed out");
        w.give_back(0, true);
        assert_eq!(w.take(), Some((0, 2)));
    }

    #[test]
    fn a_hold_let_go_before_it_started_keeps_its_slot_until_the_device_ran_it() {
        let w = words();
        let (slot, gen) = w.take().unwrap();
        w.release(slot, gen);
        w.give_back(slot, false);
        assert_eq!(
            w.take(),
            Some((1, 1)),
            "abandoned: the device may still write it"
        );
        // The device runs the old hold: it writes `reached` and passes the released wait.
        w.word(slot, 0)
            .store(gen, std::sync::atomic::Ordering::Release);
        assert_eq!(w.take(), Some((slot, gen + 1)));
        assert!(!w.reached(slot, gen + 1), "the new hold has not started");
    }

    #[test]
    fn the_watchdog_lets_go_where_the_fence_has_not_run_and_at_the_last_deadline() {
        let t0 = Instant::now();
        let job = |state: u8| {
            let fence = std::sync::Arc::new(Fence::default());
            *fence.lock() = state;
            Watch {
                fence,
                holds: vec![(0, 1)],
                until: t0 + 2 * PEER_WAIT,
                max: t0 + PEER_HOLD_MAX,
                looked: false,
            }
        };
        let early = t0 + PEER_WAIT;
        let (late, last) = (t0 + 3 * PEER_WAIT, t0 + PEER_HOLD_MAX);
        // Queued, the fence not running at the first deadline: let go, and the mover told.
        let mut w = job(0);
        assert!(!w.due(early));
        assert!(w.due(late));
        assert!(w
            .fence
            .peers_let_go
            .load(std::sync::atomic::Ordering::SeqCst));
        // Running (the move under way): looked at, then done at the last deadline.
        let mut w = job(1);
        assert!(!w.due(late) && w.looked);
        assert!(!w
            .fence
            .peers_let_go
            .load(std::sync::atomic::Ordering::SeqCst));
        assert!(w.due(last));
        // Released (the move done): nothing left to watch.
        assert!(job(2).due(late));
    }

    #[test]
    fn a_release_never_lowers_the_word_and_spent_slots_stay_unused() {
        let w = words();
        w.release(0, 5);
        w.release(0, 3); // a late watchdog's release of an older hold
        assert_eq!(w.word(0, 1).load(std::sync::atomic::Ordering::SeqCst), 5);
        w.slots.lock().unwrap()[0].0 = u32::MAX;
        assert_eq!(w.take(), Some((1, 1)), "no generation left after u32::MAX");
    }
}
