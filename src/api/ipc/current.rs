//! Mirrors kept current at the program's orderings: after its synchronizes and before the
//! records of events it shared with other processes, the mirrors a consumer without expseg
//! reads are copied again (`EXPSEG_IPC_MIRROR_SYNC`), so that consumer reads what the producer
//! ordered before signalling it, as it would read the memory itself natively.

use super::mirror::Mirror;
use super::runs::read_run;
use crate::api::state::{config, lock};
use crate::config::MirrorSync;
use crate::gpu::stream;
use crate::real::runtime;
use crate::stats::GLOBAL;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Whether a mirror was made in this process under `EXPSEG_IPC_MIRROR_SYNC` other than `off`:
/// until then the program's synchronizations cost expseg one load.
static ARMED: AtomicBool = AtomicBool::new(false);

/// Mirrors are copied again at the program's synchronizations from now on.
pub(super) fn arm() {
    if config().ipc_mirror_sync != MirrorSync::Off {
        ARMED.store(true, Ordering::Release);
    }
}

/// The level of the line that says how a share reaches other processes: a warning for the
/// first share of the process, with the words that say later ones are not warned of, and a
/// debug line for each later one (a weight sync shares thousands of allocations).
pub(super) fn share_notice() -> (log::Level, &'static str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    match SAID.swap(true, Ordering::AcqRel) {
        false => (
            log::Level::Warn,
            " (said for the first share only; EXPSEG_LOG=expseg=debug names every one)",
        ),
        true => (log::Level::Debug, ""),
    }
}

/// How current a mirror is kept, for the line that says how a share reaches other processes.
pub(super) fn currency() -> &'static str {
    match config().ipc_mirror_sync {
        MirrorSync::Off => "copied at each cudaIpcGetMemHandle call only (EXPSEG_IPC_MIRROR_SYNC=off)",
        _ => "copied again at each cudaIpcGetMemHandle call, synchronize and record of a shared event of this process",
    }
}

/// Whether a synchronize of the program's has mirrors to bring up to date (one load while no
/// mirror was made). Never in a forked child: it passes everything through, and a lock another
/// thread held at the fork would never be let go there.
pub fn sync_armed() -> bool {
    let armed = ARMED.load(Ordering::Relaxed)
        || (super::pages::MADE.load(Ordering::Relaxed)
            && config().ipc_mirror_sync != MirrorSync::Off);
    armed && !crate::api::state::forked()
}

/// Events the program made handles of for other processes (`cuIpcGetEventHandle`), at most
/// [`IPC_EVENTS_KEPT`], the oldest forgotten first.
static IPC_EVENTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());
static IPC_EVENT_SEEN: AtomicBool = AtomicBool::new(false);
const IPC_EVENTS_KEPT: usize = 4096;

/// Whether a record of an event may need mirrors copied first (one load until the program
/// shares an event and a mirror exists).
pub fn ipc_events_seen() -> bool {
    IPC_EVENT_SEEN.load(Ordering::Relaxed) && sync_armed()
}

/// The program made a handle of `event` for another process.
pub fn note_ipc_event(event: usize) {
    if crate::api::state::forked() {
        return;
    }
    let mut v = IPC_EVENTS.lock().unwrap_or_else(|e| e.into_inner());
    if !v.contains(&event) {
        if v.len() == IPC_EVENTS_KEPT {
            v.remove(0);
        }
        v.push(event);
    }
    IPC_EVENT_SEEN.store(true, Ordering::Release);
}

/// A mirror to copy again: of another allocator's run, or of a pool allocation.
enum Target {
    Foreign { base: u64, m: Arc<Mirror> },
    Pool { base: u64, size: u64, ptr: u64 },
}

/// The mirrors on `dev` that `EXPSEG_IPC_MIRROR_SYNC` brings up to date at the program's
/// orderings: under `plain`, those no consumer running expseg was granted the ticket of (it
/// maps the memory itself).
fn targets(dev: i32) -> Vec<Target> {
    let always = match config().ipc_mirror_sync {
        MirrorSync::Off => return Vec::new(),
        MirrorSync::Plain => false,
        MirrorSync::Always => true,
    };
    let mut st = lock();
    let pool = st.open_pool(dev).map(|p| p.mirrors()).unwrap_or_default();
    let ipc = &st.ipc;
    let wanted = |base: u64| always || !ipc.granted_at(dev, base);
    let mut out: Vec<Target> = ipc
        .foreign
        .iter()
        .filter(|(b, f)| f.dev == dev && wanted(**b))
        .filter_map(|(b, f)| f.mirror.clone().map(|m| Target::Foreign { base: *b, m }))
        .collect();
    out.extend(
        pool.into_iter()
            .filter(|(b, _, _)| wanted(*b))
            .map(|(base, size, ptr)| Target::Pool { base, size, ptr }),
    );
    out
}

/// The source of `target` registered as read, if it is still what its mirror copies (the
/// program may have unmapped or freed it meanwhile): (read, source, mirror, bytes).
fn read_target(
    t: &crate::real::DriverTable,
    dev: i32,
    target: &Target,
) -> Option<(crate::api::reads::Reading, u64, u64, u64)> {
    match target {
        Target::Foreign { base, m } => {
            read_run(t, *base, m.size).map(|r| (r, *base, m.ptr, m.size))
        }
        Target::Pool { base, size, ptr } => {
            let reading = crate::api::reads::begin(*base, *size);
            let same = lock()
                .open_pool(dev)
                .and_then(|p| p.mirror_of(*base))
                .is_some_and(|x| x.2 == *ptr);
            same.then_some((reading, *base, *ptr, *size))
        }
    }
}

/// After a synchronize of the program's succeeded (device, stream or event): the mirrors of
/// the current device get the memory's bytes as they are now, so a consumer without expseg
/// the program signals next reads what it ordered before the synchronize, as it would read
/// the memory itself natively. The copies run on a stream of expseg's own and are waited for
/// (not the program's queued work: what it did not synchronize it has not ordered).
pub fn after_sync() {
    let Ok(dev) = runtime::get_device() else {
        return;
    };
    let Ok(t) = crate::real::driver() else { return };
    copy_mirrors(
        t,
        dev,
        |dst, src, size| stream::copy_aside(t, dev, dst, src, size),
        &GLOBAL.ipc_mirror_sync_copies,
        "after a synchronize",
    );
}

/// Before the program records `event` on `on`: where it made a handle of that event for
/// another process, copies of the current device's mirrors are queued on the stream first,
/// so a consumer without expseg that waits on the event reads in the mirror what the producer
/// wrote before the record. Not on a stream that is capturing a graph.
pub fn before_record(event: usize, on: usize) {
    let shared = IPC_EVENTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&event);
    if !shared {
        return;
    }
    let Ok(t) = crate::real::driver() else { return };
    if stream::capturing(t, on) {
        return;
    }
    let Ok(dev) = runtime::get_device() else {
        return;
    };
    copy_mirrors(
        t,
        dev,
        |dst, src, size| stream::copy_on(t, on, dst, src, size),
        &GLOBAL.ipc_mirror_event_copies,
        "before an interprocess event's record",
    );
}

/// Each mirror of `dev` the setting brings up to date ([`targets`]) whose source is still
/// what it copies: `copy(mirror, source, bytes)` in relaxed capture mode under a registered
/// read of the source, counted in `copies`; a failure is logged (`when`: at which ordering)
/// and the consumer reads the mirror's previous copy.
fn copy_mirrors(
    t: &crate::real::DriverTable,
    dev: i32,
    copy: impl Fn(u64, u64, u64) -> crate::gpu::DrvResult<()>,
    copies: &crate::stats::Counter,
    when: &str,
) {
    // Exports of coalesced pages through a copy (`pages`): every consumer reads the copy.
    if config().ipc_mirror_sync != MirrorSync::Off {
        let (n, bytes) = super::pages::copy_all(dev, |dst, src, size| {
            stream::relaxed(t, || copy(dst, src, size))
        });
        copies.add(n);
        GLOBAL.ipc_mirror_sync_bytes.add(bytes);
    }
    for target in &targets(dev) {
        let Some((reading, src, dst, size)) = read_target(t, dev, target) else {
            continue;
        };
        let r = stream::relaxed(t, || copy(dst, src, size));
        drop(reading);
        match r {
            Ok(()) => {
                copies.add(1);
                GLOBAL.ipc_mirror_sync_bytes.add(size);
            }
            Err(e) => log::warn!("IPC: copying the mirror of {src:#x} {when} failed ({e}); a consumer without expseg reads its previous copy"),
        }
    }
}
