//! The IPC calls: `cudaIpcGetMemHandle` (producer), `cudaIpcOpenMemHandle` and
//! `cudaIpcCloseMemHandle` (consumer), and the producer's answers to tickets.

use super::state::{
    bypass, config, ensure_state, lock, Answer, State, OUT_OF_MEMORY, STATE_STARTED, UNKNOWN,
};
use crate::gpu::cuda::{self, Imported};
use crate::gpu::IpcHandle;
use crate::ipc::transport::{self, AskError, Decision};
use crate::ipc::{random_u64, Grant, Refusal, Ticket};
use crate::pool::{ExportError, ExportPolicy, Exported, MoveStep};
use crate::real::runtime;
use crate::stats::GLOBAL;
use once_cell::sync::OnceCell;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// `cudaErrorInvalidResourceHandle`: a ticket that cannot be honoured.
const INVALID_HANDLE: i32 = 400;

/// Tickets this process issued, and memory it opened through other processes' tickets.
#[derive(Default)]
pub(super) struct IpcState {
    next_id: u32,
    /// ticket id -> (device, allocation base, nonce)
    by_id: HashMap<u32, (i32, u64, u64)>,
    /// (device, base) -> ticket id: one ticket per allocation, so repeated requests return
    /// the same 64 bytes
    by_alloc: HashMap<(i32, u64), u32>,
    /// Tickets of the most recently freed allocations (at most [`FREED_KEPT`]): refused as
    /// stale, not as unknown; older ones are refused as unknown.
    freed: std::collections::HashSet<u32>,
    freed_order: std::collections::VecDeque<u32>,
    /// Whether the ticket socket is serving (`None`: not tried yet).
    server: Option<bool>,
    /// Why the socket could not serve.
    server_error: Option<String>,
    /// Mirrors of VMM memory expseg does not own, by the start of the mapping.
    pub(super) foreign: HashMap<u64, ForeignShare>,
    /// Imported mappings by the address `cudaIpcOpenMemHandle` returned.
    opened: std::collections::BTreeMap<u64, Imported>,
}

impl IpcState {
    /// The ticket of allocation `base` on `dev`, issued on first use; `None` without a random
    /// source for its nonce (the handle then carries no ticket).
    fn ticket(&mut self, dev: i32, base: u64) -> Option<Ticket> {
        let id = match self.by_alloc.get(&(dev, base)) {
            Some(id) => *id,
            None => {
                let Some(nonce) = random_u64() else {
                    log::error!("IPC: no random source for a ticket's nonce; no ticket");
                    return None;
                };
                // Ids count up from 1; `fdshare::GETFD_ID` (u32::MAX) is never one.
                self.next_id = (self.next_id % (super::fdshare::record::GETFD_ID - 1)) + 1;
                let id = self.next_id;
                self.by_id.insert(id, (dev, base, nonce));
                GLOBAL.ipc_tickets_issued.add(1);
                self.by_alloc.insert((dev, base), id);
                id
            }
        };
        Some(Ticket {
            pid: std::process::id(),
            uid: transport::current_uid(),
            id,
            nonce: self.by_id[&id].2,
        })
    }

    /// The allocation was freed: its tickets are stale from now on.
    pub(super) fn forget(&mut self, dev: i32, base: u64) {
        if let Some(id) = self.by_alloc.remove(&(dev, base)) {
            self.by_id.remove(&id);
            if self.freed.insert(id) {
                self.freed_order.push_back(id);
            }
            while self.freed_order.len() > FREED_KEPT {
                if let Some(old) = self.freed_order.pop_front() {
                    self.freed.remove(&old);
                }
            }
        }
    }
}

/// How many freed tickets are remembered as stale.
const FREED_KEPT: usize = 4096;

/// VMM memory of another allocator that was asked for a handle: the run of mappings the
/// handle stands for, and its mirror (none when only expseg consumers are served).
pub(super) struct ForeignShare {
    pub(super) dev: i32,
    size: u64,
    mirror: Option<Arc<Mirror>>,
}

/// A standard buffer mirroring a foreign run, with its legacy handle. Freed when the last
/// reference goes: a refresh in flight on another thread keeps it alive.
pub(super) struct Mirror {
    ptr: u64,
    handle: IpcHandle,
}

impl Drop for Mirror {
    fn drop(&mut self) {
        if runtime::free(self.ptr) != 0 {
            log::warn!("IPC: freeing the mirror at {:#x} failed", self.ptr);
        }
    }
}

/// Most mappings a foreign run covers (20 MiB pages: 1.25 TiB).
const MAX_RUN: usize = transport::MAX_CHUNKS;

/// How many times a request starts over when another thread changed the share meanwhile.
const RACE_RETRIES: usize = 8;

/// `cudaIpcGetMemHandle` on VMM memory expseg does not own (PyTorch's expandable segments,
/// vLLM's cumem pool), after the runtime refused it. The handle stands for the run of
/// back-to-back mappings that starts with the one containing `ptr` (PyTorch maps a segment
/// 20 MiB at a time, so a tensor spans several): its base is that mapping's start, which is
/// what range queries answer. It carries a ticket for consumers running expseg (they map the
/// same pages: shared both ways) and, unless `EXPSEG_IPC_PEERS=expseg`, a mirror of the run
/// for plain consumers, refreshed at each request (one-way, point-in-time). `None`: not such
/// memory, keep the runtime's answer.
pub fn mirror_foreign(ptr: u64) -> Option<Result<IpcHandle, i32>> {
    if bypass() {
        return None;
    }
    let t = crate::real::driver().ok()?;
    super::vmm::isolate_run(ptr);
    let c = config();
    for _ in 0..RACE_RETRIES {
        let (base, sizes, dev) = cuda::run_from(t, ptr, MAX_RUN)?;
        let size: u64 = sizes.iter().sum();
        if c.ipc_tickets {
            // Once per process, possibly slow (a child process): never under the lock.
            plain_driver_ignores_tickets(dev);
        }
        let mut st = ensure_state();
        let ticketed = c.ipc_tickets && foreign_tickets_ready(&mut st, dev);
        if c.ipc_peers_expseg && !ticketed {
            return Some(Err(peers_without_tickets(&st, ptr)));
        }
        let want_mirror = !c.ipc_peers_expseg;
        let same = st
            .ipc
            .foreign
            .get(&base)
            .filter(|f| f.size == size && f.dev == dev && f.mirror.is_some() == want_mirror)
            .map(|f| f.mirror.clone());
        let mirror = match same {
            Some(Some(m)) => {
                // Refresh without the lock; the reference keeps the buffer alive even if
                // another thread replaces or forgets the share meanwhile, and the registered
                // read holds back unmaps of the run until the copy is done.
                drop(st);
                let reading = super::vmm::begin_read(base, size);
                if !still_mapped(t, base, size) {
                    continue; // unmapped meanwhile: look again
                }
                let refreshed = refresh_mirror(dev, m.ptr, base, size);
                drop(reading);
                if let Err(e) = refreshed {
                    return Some(Err(e));
                }
                st = lock();
                let current = st
                    .ipc
                    .foreign
                    .get(&base)
                    .and_then(|f| f.mirror.as_ref())
                    .is_some_and(|cur| Arc::ptr_eq(cur, &m));
                if !current {
                    continue; // replaced while refreshing: its handle would die with it
                }
                Some(m)
            }
            Some(None) => None,
            None => {
                let old = st.ipc.foreign.remove(&base);
                drop(st);
                drop(old); // cudaFree outside the lock
                let reading = super::vmm::begin_read(base, size);
                if !still_mapped(t, base, size) {
                    continue;
                }
                let made = want_mirror.then(|| make_mirror(dev, base, size));
                drop(reading);
                let mirror = if let Some(made) = made {
                    match made {
                        Ok(m) => Some(Arc::new(m)),
                        // A handle plain consumers could not open would fail in the consumer,
                        // far from the cause: fail here, saying why and what helps.
                        Err(e) => {
                            log::error!(
                                "IPC: cudaIpcGetMemHandle({ptr:#x}) fails: no device memory for a mirror of the {size} bytes of mappings from {base:#x} on (error {e}); free memory, or set EXPSEG_IPC_PEERS=expseg if every consumer runs expseg (they map the memory itself)"
                            );
                            return Some(Err(e));
                        }
                    }
                } else {
                    None
                };
                st = lock();
                if st.ipc.foreign.contains_key(&base) {
                    continue; // another thread shared this base meanwhile: start over
                }
                log::warn!(
                    "IPC: {base:#x} ({size} bytes in {} mapping(s)) is VMM memory expseg does not own (expandable_segments or another VMM allocator); {}",
                    sizes.len(),
                    match (ticketed, &mirror) {
                        (true, Some(m)) => format!("consumers running expseg share it both ways; others get a mirror at {:#x} with its data as of the latest cudaIpcGetMemHandle call, and their writes do not reach this process", m.ptr),
                        (true, None) => "shared with consumers running expseg only (EXPSEG_IPC_PEERS=expseg): plain consumers cannot open its handle".to_string(),
                        (false, Some(m)) => format!("shared through a mirror at {:#x}: consumers see its data as of the latest cudaIpcGetMemHandle call and their writes do not reach this process", m.ptr),
                        (false, None) => unreachable!("no mirror only with tickets"),
                    }
                );
                st.ipc.foreign.insert(
                    base,
                    ForeignShare {
                        dev,
                        size,
                        mirror: mirror.clone(),
                    },
                );
                mirror
            }
        };
        let mut handle = mirror.map_or([0u8; 64], |m| m.handle);
        if ticketed {
            if let Some(t) = st.ipc.ticket(dev, base) {
                t.stamp(&mut handle);
            }
        }
        return Some(Ok(handle));
    }
    log::error!("IPC: cudaIpcGetMemHandle({ptr:#x}): the mappings kept changing under concurrent requests; giving up");
    Some(Err(UNKNOWN))
}

/// Whether `[base, base+size)` is still one run of mappings from `base` on.
fn still_mapped(t: &crate::real::DriverTable, base: u64, size: u64) -> bool {
    cuda::run_from(t, base, MAX_RUN)
        .is_some_and(|(b, sizes, _)| b == base && sizes.iter().sum::<u64>() >= size)
}

/// Copy `size` bytes at `base` into the mirror at `p`, after the device's pending work.
fn refresh_mirror(dev: i32, p: u64, base: u64, size: u64) -> Result<(), i32> {
    runtime::on_device(dev, || match runtime::device_synchronize() {
        0 => match runtime::copy_d2d(p, base, size as usize) {
            0 => match runtime::device_synchronize() {
                0 => Ok(()),
                e => Err(e),
            },
            e => Err(e),
        },
        e => Err(e),
    })
}

/// A standard buffer holding a copy of `size` bytes at `base`, and its legacy handle.
fn make_mirror(dev: i32, base: u64, size: u64) -> Result<Mirror, i32> {
    let p = runtime::on_device(dev, || match runtime::malloc(size as usize) {
        (0, p) => Ok(p),
        (e, _) => Err(e),
    })?;
    let made = refresh_mirror(dev, p, base, size)
        .and_then(|()| runtime::on_device(dev, || runtime::ipc_get_mem_handle(p)));
    match made {
        Ok(handle) => Ok(Mirror { ptr: p, handle }),
        Err(e) => {
            runtime::free(p);
            Err(e)
        }
    }
}

/// Whether tickets can be issued for foreign memory on `dev`: the socket serves and a
/// ticketed handle still opens with the plain driver. (Whether the other allocator's pages can
/// be exported is found out per request; a consumer falls back to the mirror if not.)
fn foreign_tickets_ready(st: &mut State, dev: i32) -> bool {
    server_ready(st) && plain_driver_ignores_tickets(dev)
}

/// Export the run of foreign mappings starting at `base` that a ticket stands for: the first
/// mapping at once (so a refusal is clean), the others as the transport sends them.
fn export_foreign(dev: i32, base: u64, size: u64) -> Decision {
    let t = crate::real::driver().map_err(|_| Refusal::Failed)?;
    // The ticket thread has no context of its own; the source below runs on it too.
    cuda::ensure_context(t, dev);
    let (start, all, _) = cuda::run_from(t, base, MAX_RUN).ok_or(Refusal::Stale)?;
    // The mappings that make up the shared `size`: still mapped from the same start.
    let (mut sizes, mut vas, mut end) = (Vec::new(), Vec::new(), start);
    for s in all {
        if end >= start + size {
            break;
        }
        sizes.push(s);
        vas.push(end);
        end += s;
    }
    // Pages the program released since may be parked there by expseg: the run is gone, as
    // it would be natively (an unmapped gap).
    if start != base || end != base + size || super::vmm::parked_in(base, size) {
        return Err(Refusal::Stale);
    }
    let first = cuda::export_mapping(t, base).map_err(|e| {
        log::warn!("IPC: the pages at {base:#x} cannot be exported ({e}); consumers fall back to the mirror");
        Refusal::Failed
    })?;
    let mut fds = std::iter::once(Ok(first)).chain(vas.into_iter().skip(1).map(move |va| {
        cuda::export_mapping(t, va).map_err(|e| std::io::Error::other(e.to_string()))
    }));
    let source: transport::FdSource = Box::new(move || {
        fds.next()
            .unwrap_or_else(|| Err(std::io::Error::other("no more mappings")))
    });
    Ok((
        Grant {
            size,
            chunks: sizes,
        },
        source,
    ))
}

/// `cudaIpcGetMemHandle`: a pointer inside a pool allocation gets a working legacy handle,
/// by moving the allocation into standard memory at the same address, or else through a
/// standard mirror (see `pool::export`) whose handle carries a ticket for consumers running
/// expseg. Anything else passes through.
pub fn cudaIpcGetMemHandle(ptr: u64) -> Answer<Result<IpcHandle, i32>> {
    GLOBAL.ipc_handle_requests.add(1);
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return Answer::PassThrough;
    }
    let c = config();
    let mut st = lock();
    let Some((mut dev, size)) = st
        .open_pools()
        .find_map(|(d, p)| p.find(ptr).map(|(_, size)| (d, size)))
    else {
        return Answer::PassThrough;
    };
    let needs_tickets = c.ipc_peers_expseg || size > c.ipc_move_max;
    {
        // Waits happen without the lock: the device's pending work (the export waits again
        // under the lock, for what was queued meanwhile only) and the one-time ticket check,
        // a child process (a move that falls back to a mirror, rare, still runs it there).
        drop(st);
        let e = super::state::synchronize(dev);
        if e != 0 {
            return Answer::Done(Err(e));
        }
        if c.ipc_tickets && needs_tickets {
            plain_driver_ignores_tickets(dev);
        }
        st = lock();
        match st
            .open_pools()
            .find(|(_, p)| p.find(ptr).is_some())
            .map(|(d, _)| d)
        {
            Some(d) => dev = d,
            None => return Answer::PassThrough,
        }
    }
    if c.ipc_peers_expseg && !(c.ipc_tickets && tickets_ready(&mut st, dev)) {
        return Answer::Done(Err(peers_without_tickets(&st, ptr)));
    }
    let policy = ExportPolicy {
        move_max: c.ipc_move_max,
        fail_move_at: c.test_fail_move.as_deref().and_then(MoveStep::from_name),
    };
    if !c.ipc_peers_expseg {
        if let Some(h) = refresh_outside_lock(st, dev, ptr) {
            return h;
        }
        st = lock();
        // A new mirror: its memory and handle under the lock, its copy (a device wait)
        // without it, exactly as a refresh. Only a move (opt-in) works under the lock.
        let Some(pool) = st.open_pool(dev) else {
            return Answer::PassThrough;
        };
        if !pool.would_move(ptr, &policy) {
            let (base, size) = match pool.find(ptr) {
                Some(x) => x,
                None => return Answer::PassThrough,
            };
            return match pool.prepare_mirror(ptr) {
                Ok((m, first)) => {
                    let ticketed = c.ipc_tickets && tickets_ready(&mut st, dev);
                    match refresh_outside_lock(st, dev, ptr) {
                        Some(answer) => {
                            if first && matches!(answer, Answer::Done(Ok(_))) {
                                warn_mirrored(base, size, m, ticketed);
                            }
                            answer
                        }
                        // Freed by another thread meanwhile: no longer the pool's pointer.
                        None => Answer::PassThrough,
                    }
                }
                Err(e) => export_error(ptr, e),
            };
        }
    }
    if c.ipc_peers_expseg {
        // Every consumer runs expseg: no mirror, the ticket alone.
        let pool = st.open_pool(dev).expect("found above");
        let (base, _) = pool.share(ptr).expect("found above");
        let mut h = [0u8; 64];
        return match st.ipc.ticket(dev, base) {
            Some(t) => {
                t.stamp(&mut h);
                Answer::Done(Ok(h))
            }
            None => Answer::Done(Err(NOT_SUPPORTED)),
        };
    }
    let pool = st.open_pool(dev).expect("found above");
    match pool.export(ptr, policy) {
        Ok(ex) => {
            let mut handle = ex.handle;
            if let Exported::Mirror { ptr: m, first } = ex.how {
                let ticketed = c.ipc_tickets && tickets_ready(&mut st, dev);
                if ticketed {
                    st.open_pool(dev).expect("found above").share(ex.base);
                    if let Some(t) = st.ipc.ticket(dev, ex.base) {
                        t.stamp(&mut handle);
                    }
                }
                if first {
                    warn_mirrored(ex.base, ex.size, m, ticketed);
                }
            } else {
                log::debug!(
                    "IPC: moved {:#x} ({} bytes) into standard memory in place",
                    ex.base,
                    ex.size
                );
            }
            Answer::Done(Ok(handle))
        }
        Err(e) => export_error(ptr, e),
    }
}

/// The one warning per mirrored pool allocation: what a plain consumer gets.
fn warn_mirrored(base: u64, size: u64, mirror: u64, ticketed: bool) {
    log::warn!(
        "IPC: allocation {base:#x} ({size} bytes) is shared through a mirror at {mirror:#x}: a consumer without expseg sees its data as of the latest cudaIpcGetMemHandle call, and its writes do not reach this process{}",
        if ticketed { " (consumers running expseg share it both ways)" } else { "" }
    );
}

fn export_error(ptr: u64, e: ExportError) -> Answer<Result<IpcHandle, i32>> {
    match e {
        ExportError::NotOwned => Answer::PassThrough,
        ExportError::OutOfMemory => Answer::Done(Err(OUT_OF_MEMORY)),
        ExportError::Driver(e) => {
            log::error!("IPC export of {ptr:#x} failed: {e}; the allocation is unchanged");
            Answer::Done(Err(if e.0 < 1000 { e.0 as i32 } else { UNKNOWN }))
        }
        ExportError::RangeLost { base, kept } => {
            log::error!(
                "IPC export of {base:#x} lost its address range; its data is kept at {kept:#x}"
            );
            Answer::Done(Err(UNKNOWN))
        }
    }
}

/// `EXPSEG_IPC_PEERS=expseg` promises consumers the memory itself; without tickets there is
/// no way to keep that promise, and a mirror would silently break it: fail, saying why.
fn peers_without_tickets(st: &State, ptr: u64) -> i32 {
    let why = match (&st.ipc.server_error, config().ipc_tickets) {
        (_, false) => "EXPSEG_IPC_TICKETS=0".to_string(),
        (Some(e), _) => e.clone(),
        (None, _) => "this device's memory cannot be exported, or the driver does not accept ticketed handles (expseg doctor tells)".to_string(),
    };
    log::error!("IPC: cudaIpcGetMemHandle({ptr:#x}) fails: EXPSEG_IPC_PEERS=expseg needs tickets, and tickets are off: {why}");
    NOT_SUPPORTED
}

/// Refresh an existing mirror of a pool allocation without the global lock (weight sync
/// repeats this every step): register the read, check under the lock that the allocation
/// still has that mirror (a `cudaFree` that got there first has freed both; one that comes
/// later waits for the read), copy, then stamp the ticket. `None`: no mirror yet, take the
/// locked path.
fn refresh_outside_lock(
    st: std::sync::MutexGuard<'static, State>,
    dev: i32,
    ptr: u64,
) -> Option<Answer<Result<IpcHandle, i32>>> {
    let mut st = st;
    let (base, size, m, handle) = st.open_pool(dev)?.mirror_of(ptr)?;
    drop(st);
    let reading = super::reads::begin(base, size);
    if lock()
        .open_pool(dev)
        .and_then(|p| p.mirror_of(ptr))
        .map(|x| x.2)
        != Some(m)
    {
        return None;
    }
    let copied = refresh_mirror(dev, m, base, size);
    drop(reading);
    if let Err(e) = copied {
        log::error!("IPC: refreshing the mirror of {base:#x} failed ({e})");
        return Some(Answer::Done(Err(e)));
    }
    let mut st = lock();
    let mut handle = handle;
    if let Some(p) = st.open_pool(dev) {
        p.count_mirror_refresh();
    }
    if config().ipc_tickets && tickets_ready(&mut st, dev) {
        if let Some(pool) = st.open_pool(dev) {
            pool.share(base);
        }
        if let Some(t) = st.ipc.ticket(dev, base) {
            t.stamp(&mut handle);
        }
    }
    Some(Answer::Done(Ok(handle)))
}

/// Whether tickets can be issued: the device's chunks are exportable, the socket serves, and
/// a ticketed handle still opens with the plain driver (checked once, in a child process).
fn tickets_ready(st: &mut State, dev: i32) -> bool {
    if !st.open_pool(dev).is_some_and(|p| p.driver().shareable) {
        return false;
    }
    server_ready(st) && plain_driver_ignores_tickets(dev)
}

/// Start the ticket socket if it does not serve yet (for `fdshare`); whether it serves.
pub(super) fn ensure_server() -> bool {
    let mut st = lock();
    server_ready(&mut st)
}

/// Start the ticket socket on first use; whether it serves.
fn server_ready(st: &mut State) -> bool {
    if st.ipc.server.is_none() {
        let started = start_server();
        if let Err(e) = &started {
            log::warn!("IPC tickets disabled: {e}");
            st.ipc.server_error = Some(e.clone());
        }
        st.ipc.server = Some(started.is_ok());
    }
    st.ipc.server == Some(true)
}

fn start_server() -> Result<(), String> {
    // Nonces are what keeps other processes of the user from guessing tickets.
    crate::ipc::random_u64()
        .ok_or("no random source (getrandom, /dev/urandom) for ticket nonces")?;
    let uid = transport::current_uid();
    let others = !config().ipc_allow_uids.is_empty();
    transport::prepare_dir(uid, others)?;
    let path = transport::socket_path(uid, std::process::id());
    transport::serve(&path, others, admitted, decide)?;
    extern "C" fn remove_socket() {
        let _ = std::fs::remove_file(transport::socket_path(
            transport::current_uid(),
            std::process::id(),
        ));
    }
    #[allow(unsafe_code)]
    // SAFETY: registers a plain extern "C" function that removes one file.
    unsafe {
        libc::atexit(remove_socket);
    }
    Ok(())
}

/// Whether a process of `uid` may ask for tickets at all (checked before its request is
/// read; the first refusal is logged).
fn admitted(uid: u32) -> bool {
    let ok = uid == transport::current_uid() || config().ipc_allow_uids.contains(&uid);
    if !ok {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            log::warn!("IPC: closed a connection from uid {uid} (not ours, not in EXPSEG_IPC_ALLOW_UIDS); later ones are closed silently");
        }
    }
    ok
}

/// The producer's answer to a ticket: runs on a thread of the socket server.
fn decide(id: u32, nonce: u64, peer: u32) -> Decision {
    let d = decide_once(id, nonce, peer);
    match &d {
        Ok(_) => GLOBAL.ipc_tickets_granted.add(1),
        Err(_) => GLOBAL.ipc_tickets_refused.add(1),
    }
    d
}

fn decide_once(id: u32, nonce: u64, peer: u32) -> Decision {
    if !admitted(peer) {
        return Err(Refusal::Forbidden);
    }
    if id == super::fdshare::record::GETFD_ID {
        return super::fdshare::record::serve(nonce);
    }
    let mut st = lock();
    let Some(&(dev, base, n)) = st.ipc.by_id.get(&id) else {
        return Err(if st.ipc.freed.contains(&id) {
            Refusal::Stale
        } else {
            Refusal::Unknown
        });
    };
    if n != nonce {
        return Err(Refusal::Unknown);
    }
    if let Some(f) = st.ipc.foreign.get(&base) {
        let size = f.size;
        drop(st);
        return export_foreign(dev, base, size);
    }
    let Some(pool) = st.open_pool(dev) else {
        return Err(Refusal::Stale);
    };
    match pool.export_fds(base) {
        None => Err(Refusal::Stale),
        Some(Err(e)) => {
            log::error!("IPC: exporting the chunks of {base:#x} failed: {e}");
            Err(Refusal::Failed)
        }
        Some(Ok((size, fds))) => {
            let chunks = fds.iter().map(|f| f.1).collect();
            Ok((
                Grant { size, chunks },
                transport::fds_of(fds.into_iter().map(|f| f.0).collect()),
            ))
        }
    }
}

/// Run the ticket check once per process: a child process without expseg opens a ticketed
/// handle of a 2 MiB buffer with a known pattern and reads it back. Needs the helper
/// `expseg-ipc-check` next to libexpseg.so.
/// The one-time ticket check's answer, once known.
static TICKET_CHECK: OnceCell<bool> = OnceCell::new();

fn plain_driver_ignores_tickets(dev: i32) -> bool {
    *TICKET_CHECK.get_or_init(|| match check_in_child(dev) {
        Ok(()) => {
            log::info!("IPC: a ticketed handle opens with the plain driver; tickets enabled");
            true
        }
        Err(e) => {
            log::warn!("IPC tickets disabled: {e}; mirrors carry plain handles");
            false
        }
    })
}

fn check_in_child(dev: i32) -> Result<(), String> {
    if let Some(ms) = config().test_slow_check_ms {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    let helper = crate::real::self_dir()
        .map(|d| d.join("expseg-ipc-check"))
        .ok_or("cannot tell where libexpseg.so is")?;
    // A process with the static runtime has no libcudart: its plain consumers open handles
    // with the driver, and so does the check.
    let lib = if crate::real::runtime_present() {
        crate::real::runtime_path().ok_or("cannot tell which libcudart is loaded")?
    } else {
        "libcuda.so.1".to_string()
    };
    let pattern: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
    let buf = runtime::on_device(dev, || match runtime::malloc(2 << 20) {
        (0, p) => Ok(p),
        (e, _) => Err(e),
    })
    .map_err(|e| format!("cudaMalloc for the check failed ({e})"))?;
    let result = (|| {
        if runtime::copy_h2d(buf, &pattern) != 0 {
            return Err("copy for the check failed".to_string());
        }
        let h = runtime::ipc_get_mem_handle(buf)
            .map_err(|e| format!("cudaIpcGetMemHandle failed ({e})"))?;
        crate::ipc::check_ticketed_handle(&helper, &lib, h, &pattern, dev)
    })();
    runtime::free(buf);
    result
}

/// `cudaErrorNotSupported`.
const NOT_SUPPORTED: i32 = 801;

/// `cudaIpcOpenMemHandle`: a handle with an expseg ticket maps the producer's original memory
/// (two-way sharing); plain handles pass through. If the producer cannot be reached, a handle
/// that also carries a mirror opens the mirror; a refused ticket is an error.
pub fn cudaIpcOpenMemHandle(handle: IpcHandle) -> Answer<Result<u64, i32>> {
    if bypass() {
        return Answer::PassThrough;
    }
    let Some(t) = Ticket::read(&handle) else {
        return Answer::PassThrough;
    };
    let ticket_only = handle[24..].iter().all(|b| *b == 0);
    let path = transport::socket_path(t.uid, t.pid);
    let started = std::time::Instant::now();
    let (grant, mut incoming) = match transport::ask(&path, t.uid, t.pid, t.id, t.nonce) {
        Ok(g) => g,
        Err(AskError::Untrusted(why)) => {
            log::error!("IPC: not asking for the ticket of process {}: {why}", t.pid);
            if ticket_only {
                return Answer::Done(Err(INVALID_HANDLE));
            }
            log::error!("IPC: opening the handle's mirror instead (one-way)");
            return Answer::PassThrough;
        }
        Err(AskError::Refused(Refusal::Failed)) if !ticket_only => {
            log::warn!(
                "IPC: process {} could not export the memory of its ticket; opening its mirror (one-way)",
                t.pid
            );
            return Answer::PassThrough;
        }
        Err(AskError::Refused(r)) => {
            log::error!("IPC: process {} refused the ticket ({r:?}): the handle is stale, forged or not ours to open", t.pid);
            return Answer::Done(Err(INVALID_HANDLE));
        }
        Err(e) if ticket_only => {
            log::error!("IPC: cannot reach process {} for its ticket ({e:?})", t.pid);
            return Answer::Done(Err(INVALID_HANDLE));
        }
        Err(e) => {
            log::warn!(
                "IPC: cannot reach process {} for its ticket ({e:?}); opening its mirror (one-way)",
                t.pid
            );
            return Answer::PassThrough;
        }
    };
    let Ok(dev) = runtime::get_device() else {
        return Answer::Done(Err(INVALID_HANDLE));
    };
    let Some(drv) = ensure_state().driver.as_ref().ok().copied() else {
        return Answer::Done(Err(INVALID_HANDLE));
    };
    if !cuda::has_context(drv) && runtime::free(0) != 0 {
        return Answer::Done(Err(INVALID_HANDLE));
    }
    let asked = started.elapsed();
    let imported = cuda::import(drv, &grant.chunks, grant.size, dev, || {
        incoming.next_batch().map_err(|e| format!("{e:?}"))
    });
    match imported {
        Ok(imp) => {
            let va = imp.va;
            log::debug!(
                "IPC: ticket {} of process {} opened: {} bytes in {} chunk(s); ask {:.3} ms, import and map {:.3} ms",
                t.id,
                t.pid,
                grant.size,
                grant.chunks.len(),
                asked.as_secs_f64() * 1e3,
                (started.elapsed() - asked).as_secs_f64() * 1e3
            );
            lock().ipc.opened.insert(va, imp);
            GLOBAL.ipc_tickets_opened.add(1);
            Answer::Done(Ok(va))
        }
        Err(e) => {
            log::error!("IPC: mapping the memory of process {} failed: {e}", t.pid);
            if ticket_only {
                Answer::Done(Err(INVALID_HANDLE))
            } else {
                Answer::PassThrough
            }
        }
    }
    // The received descriptors close here: the imported handles keep the memory.
}

/// The allocation containing `ptr` as the program sees it — a pool allocation or memory opened
/// through a ticket — for `cuMemGetAddressRange` and `cuPointerGetAttribute`, which would
/// otherwise report one chunk's mapping. `None`: not ours, ask the driver.
pub fn allocation_range(ptr: u64) -> Option<(u64, u64)> {
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return None;
    }
    let mut st = lock();
    if let Some(r) = st.open_pools().find_map(|(_, p)| p.find(ptr)) {
        return Some(r);
    }
    let (va, imp) = st.ipc.opened.range(..=ptr).next_back()?;
    (ptr < va + imp.size).then_some((*va, imp.user))
}

/// The pool allocation containing `ptr` (memory opened through a ticket excluded).
pub fn pool_allocation_range(ptr: u64) -> Option<(u64, u64)> {
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return None;
    }
    let mut st = lock();
    let found = st.open_pools().find_map(|(_, p)| p.find(ptr));
    found
}

/// `cudaIpcCloseMemHandle`: unmap memory opened through a ticket; others pass through.
pub fn cudaIpcCloseMemHandle(ptr: u64) -> Answer<i32> {
    if bypass() || !STATE_STARTED.load(Ordering::Acquire) {
        return Answer::PassThrough;
    }
    let Some(imp) = lock().ipc.opened.remove(&ptr) else {
        return Answer::PassThrough;
    };
    // Work of this process may still use the mapping.
    let e = runtime::device_synchronize();
    if let Ok(t) = crate::real::driver() {
        cuda::unmap_imported(t, imp);
    }
    Answer::Done(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_random_source_no_ticket_is_issued() {
        use crate::ipc::transport::NO_RANDOM;
        NO_RANDOM.with(|n| n.set(true));
        let mut s = IpcState::default();
        let t = s.ticket(0, 1 << 21);
        let r = crate::ipc::random_u64();
        NO_RANDOM.with(|n| n.set(false));
        assert!(t.is_none(), "no guessable nonce");
        assert!(r.is_none());
        assert!(s.by_id.is_empty());
    }

    #[test]
    fn freed_tickets_are_remembered_within_a_bound() {
        let mut s = IpcState::default();
        for base in 0..(3 * FREED_KEPT as u64) {
            s.ticket(0, base << 21);
            s.forget(0, base << 21);
        }
        assert_eq!(s.freed.len(), FREED_KEPT);
        assert_eq!(s.freed_order.len(), FREED_KEPT);
        assert!(s.by_id.is_empty() && s.by_alloc.is_empty());
        // The newest is stale, the oldest forgotten.
        assert!(s.freed.contains(&(3 * FREED_KEPT as u32)));
        assert!(!s.freed.contains(&1));
    }
}
