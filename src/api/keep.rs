//! Keeping released memory where only expseg processes share a GPU (`EXPSEG_KEEP=auto`,
//! opt-in, where the user set no `EXPSEG_RELEASE_DELAY`).
//!
//! An `empty_cache()` loop is slow because every released handle goes back to the driver and
//! the next step makes it again; kept handles cost nothing but the memory, which only a process
//! that cannot ask for it would miss. Other expseg processes of the user ask (reclaim: an
//! allocation that finds no memory, and a free-memory query, ask them first). So a thread polls
//! the driver's list of processes with a context on each GPU (NVML, every [`POLL`]; a poll costs
//! about 25 us, measured) and keeps only while every other process listed is an expseg process
//! of the user that can ask; the moment another one is listed, what is kept goes back and
//! releases go back at once, as with `EXPSEG_KEEP=off`. A newcomer is listed about 100 ms
//! before its context exists (H200, driver 580: 118 ms before its first allocation), but
//! giving back 119 GB took 46-256 ms there: a plain newcomer asking for most of the GPU at once
//! missed it 1 time in 10, which is why this is opt-in. Without NVML, keeping stays off.

use crate::real::nvml;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the processes on each GPU are looked at.
pub const POLL: Duration = Duration::from_millis(5);

/// The release delay while keeping: a program quiet this long gives its kept memory back.
pub const DELAY_MS: u64 = 10_000;

/// Whether any GPU keeps now (free-memory queries then ask the peers first).
static ANY_KEEPING: AtomicBool = AtomicBool::new(false);

/// Each device's mode, for the report and `expseg.stats()`: (device, what and why).
static MODES: Mutex<Vec<(i32, String)>> = Mutex::new(Vec::new());

/// The first process in `listed` (but `me`) that is not a peer: None if all are.
pub fn first_stranger(
    listed: &[u32],
    me: u32,
    mut is_peer: impl FnMut(u32) -> bool,
) -> Option<u32> {
    listed.iter().copied().find(|&p| p != me && !is_peer(p))
}

/// Whether process `pid` (under `proc_root`, `/proc`) is an expseg process of `uid` that asks
/// for kept memory: owned by `uid`, `libexpseg` mapped, and in the environment it started with
/// `EXPSEG_KEEP=auto` (its free-memory queries ask the peers first, as its allocations do),
/// neither `EXPSEG_DISABLE` nor `EXPSEG_SOCKETS=0`. A process that cannot be read (gone,
/// another pid namespace, not dumpable) is not one.
pub fn is_peer(proc_root: &Path, pid: u32, uid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let dir = proc_root.join(pid.to_string());
    if std::fs::metadata(&dir).ok().map(|m| m.uid()) != Some(uid) {
        return false;
    }
    let Ok(maps) = std::fs::read_to_string(dir.join("maps")) else {
        return false;
    };
    if !maps.contains("libexpseg") {
        return false;
    }
    let Ok(env) = std::fs::read(dir.join("environ")) else {
        return false;
    };
    let off = |name: &str, words: &[&str]| {
        env.split(|b| *b == 0).any(|kv| {
            let kv = String::from_utf8_lossy(kv);
            kv.split_once('=').is_some_and(|(k, v)| {
                k == name && words.contains(&v.trim().to_ascii_lowercase().as_str())
            })
        })
    };
    off("EXPSEG_KEEP", &["auto"])
        && !off("EXPSEG_DISABLE", &["1", "true", "yes", "on"])
        && !off("EXPSEG_SOCKETS", &["0", "false", "no", "off"])
}

/// The GPUs keeping may watch: each device with an NVML name. Empty: keeping stays off (one
/// line says why).
pub fn watchable(uuids: &[(i32, Option<[u8; 16]>)]) -> Vec<(i32, nvml::Gpu)> {
    let gpus: Vec<(i32, nvml::Gpu)> = uuids
        .iter()
        .filter_map(|(d, u)| Some((*d, nvml::gpu(u.as_ref()?)?)))
        .collect();
    if gpus.is_empty() && !uuids.is_empty() {
        log::info!("EXPSEG_KEEP=auto: NVML cannot list the processes on the GPU here (no libnvidia-ml.so.1, or a MIG instance); released memory goes back at once");
        set_modes(uuids.iter().map(|(d, _)| {
            (
                *d,
                "releasing at once (NVML cannot list the GPU's processes)".to_string(),
            )
        }));
    }
    gpus
}

fn set_modes(modes: impl Iterator<Item = (i32, String)>) {
    let mut m = MODES.lock().unwrap_or_else(|e| e.into_inner());
    for (d, what) in modes {
        match m.iter_mut().find(|(x, _)| *x == d) {
            Some(e) => e.1 = what,
            None => m.push((d, what)),
        }
    }
}

/// Each device's keeping mode and why (empty where keeping is not automatic).
pub fn modes() -> Vec<(i32, String)> {
    MODES.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The report's words on keeping, after the status: "; GPU 0: keeping released memory (...)"
/// per watched GPU; empty where keeping is not automatic, and in a forked child (`forked`:
/// its modes are copies of the parent's).
pub fn status_suffix(forked: bool) -> String {
    if forked {
        return String::new();
    }
    modes()
        .iter()
        .map(|(d, what)| format!("; GPU {d}: {what}"))
        .collect()
}

/// The other expseg processes on each GPU that keeps now: the ones a free-memory query asks
/// to give back what they keep (device, pids).
static PEERS: Mutex<Vec<(i32, Vec<u32>)>> = Mutex::new(Vec::new());

fn set_peers(dev: i32, pids: Vec<u32>) {
    let mut p = PEERS.lock().unwrap_or_else(|e| e.into_inner());
    p.retain(|(d, _)| *d != dev);
    if !pids.is_empty() {
        p.push((dev, pids));
    }
}

/// The other expseg processes on each GPU that keeps released memory now (device, pids).
pub fn peers() -> Vec<(i32, Vec<u32>)> {
    PEERS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Whether any GPU keeps released memory now.
pub fn any_keeping() -> bool {
    ANY_KEEPING.load(Ordering::Acquire)
}

/// What the watching thread does to the process: make device d's coalescer keep or give back
/// what it keeps, and whether this is a forked child (stop).
#[derive(Clone, Copy)]
pub struct Hooks {
    /// None: the coalescers are not there yet (asked again at the next poll).
    pub set_keeping: fn(i32, bool) -> Option<GaveBack>,
    pub forked: fn() -> bool,
}

/// What a give-back did, for the line that says it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GaveBack {
    /// How long taking the coalescers' lock took (another thread's call in progress).
    pub waited_us: u64,
    pub trim: crate::coalesce::TrimParts,
}

/// The GPUs `EXPSEG_KEEP=auto` watches (device, the CUDA driver's UUID by `uuid_of`): every
/// device where the user set no release delay and other processes can ask (sockets); none
/// otherwise.
pub fn gpus_to_watch(
    c: &crate::config::Config,
    devices: i32,
    uuid_of: impl Fn(i32) -> Option<[u8; 16]>,
) -> Vec<(i32, Option<[u8; 16]>)> {
    match c.keep_auto && c.release_delay_ms == 0 && c.sockets && devices > 0 {
        true => (0..devices).map(|d| (d, uuid_of(d))).collect(),
        false => Vec::new(),
    }
}

/// The coalescers' release delay: [`DELAY_MS`] where GPUs are watched, else the user's.
pub fn delay_ms(c: &crate::config::Config, watched: &[(i32, Option<[u8; 16]>)]) -> u64 {
    match watched.is_empty() {
        true => c.release_delay_ms,
        false => DELAY_MS,
    }
}

/// The bound on what a coalescer keeps, in microseconds of estimated give-back
/// (`EXPSEG_KEEP_GIVEBACK`): only where its GPU is watched; 0 (none) otherwise.
pub fn giveback_bound_us(c: &crate::config::Config, watching: bool) -> u64 {
    match watching {
        true => c.keep_giveback_ms * 1000,
        false => 0,
    }
}

/// Start the thread that watches the GPUs of `uuids` (device, the CUDA driver's UUID; their
/// coalescers start not keeping). NVML is loaded there, not in the allocation that made the
/// coalescers (loading it may take long). False if it could not start (keeping stays off).
pub fn start(uuids: Vec<(i32, Option<[u8; 16]>)>, hooks: Hooks) -> bool {
    set_modes(
        uuids
            .iter()
            .map(|(d, _)| (*d, "releasing at once (not looked yet)".to_string())),
    );
    let spawned = std::thread::Builder::new()
        .name("expseg-keep".into())
        .spawn(move || {
            let gpus = watchable(&uuids);
            let watch = std::panic::AssertUnwindSafe(|| watch(&gpus, hooks));
            if std::panic::catch_unwind(watch).is_err() {
                crate::stats::GLOBAL.panics_caught.add(1);
                log::error!("expseg-keep: internal error caught; released memory goes back at once from now on");
                let stop = std::panic::AssertUnwindSafe(|| {
                    for (d, _) in &gpus {
                        let _ = apply(hooks, *d, false, "releasing at once (internal error)");
                    }
                });
                let _ = std::panic::catch_unwind(stop);
                ANY_KEEPING.store(false, Ordering::Release);
            }
        });
    if spawned.is_err() {
        log::warn!("no thread to watch the GPU's processes: released memory goes back at once");
    }
    spawned.is_ok()
}

/// The watching loop: per GPU, keeping on while no stranger is listed.
fn watch(gpus: &[(i32, nvml::Gpu)], hooks: Hooks) {
    let me = std::process::id();
    let uid = crate::ipc::sockdir::current_uid();
    let mut known: HashMap<u32, bool> = HashMap::new();
    let mut listed = Vec::new();
    let mut state: Vec<Option<bool>> = vec![None; gpus.len()];
    loop {
        if (hooks.forked)() {
            return;
        }
        let t0 = Instant::now();
        let mut seen: Vec<u32> = Vec::new();
        for (i, (dev, gpu)) in gpus.iter().enumerate() {
            let (keep, why) = match nvml::processes(*gpu, &mut listed) {
                Err(e) => (
                    false,
                    format!("releasing at once (NVML's list failed: error {e})"),
                ),
                // NVML of another pid namespace (a container's) lists pids this process
                // cannot name, or none: it cannot tell who is there.
                Ok(()) if !listed.contains(&me) => (
                    false,
                    "releasing at once (NVML does not list this process: its pids are of another namespace)".to_string(),
                ),
                Ok(()) => {
                    seen.extend_from_slice(&listed);
                    let mut peer = |p: u32| {
                        *known
                            .entry(p)
                            .or_insert_with(|| is_peer(Path::new("/proc"), p, uid))
                    };
                    match first_stranger(&listed, me, &mut peer) {
                        Some(p) => (false, format!("releasing at once (process {p} on the GPU is not an expseg process of this user with EXPSEG_KEEP=auto)")),
                        None => {
                            let others: Vec<u32> = listed.iter().copied().filter(|&p| p != me).collect();
                            set_peers(*dev, others.clone());
                            (true, format!("keeping released memory ({} other expseg processes of this user on the GPU, none else)", others.len()))
                        }
                    }
                }
            };
            if !keep {
                set_peers(*dev, Vec::new());
            }
            if state[i] != Some(keep) && apply(hooks, *dev, keep, &why) {
                state[i] = Some(keep);
            }
        }
        known.retain(|p, _| seen.contains(p));
        ANY_KEEPING.store(state.contains(&Some(true)), Ordering::Release);
        std::thread::sleep(POLL.saturating_sub(t0.elapsed()));
    }
}

/// Device `dev`'s coalescer keeps released memory from now on, or gives back what it keeps;
/// false if the coalescers are not there yet.
fn apply(hooks: Hooks, dev: i32, keep: bool, why: &str) -> bool {
    let t0 = Instant::now();
    let Some(g) = (hooks.set_keeping)(dev, keep) else {
        return false;
    };
    let (t, ms) = (g.trim, |d: std::time::Duration| d.as_secs_f64() * 1e3);
    match (keep, t.bytes) {
        (true, _) | (false, 0) => log::debug!("GPU {dev}: {why}"),
        (false, n) => log::info!(
            "GPU {dev}: {why}; gave back {n} kept bytes ({} kept handles, estimated {:.1} ms) in {:.1} ms: {:.1} waiting for another call, {:.1} retries, {:.1} for {} handles with no live page, {:.1} for the kept ones",
            t.kept_handles,
            t.estimate_us as f64 / 1e3,
            ms(t0.elapsed()),
            g.waited_us as f64 / 1e3,
            ms(t.leftovers),
            ms(t.idle),
            t.idle_handles,
            ms(t.kept)
        ),
    }
    set_modes(std::iter::once((dev, why.to_string())));
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_process_that_is_not_a_peer_is_the_stranger() {
        let peers = [10, 11];
        let is = |p: u32| peers.contains(&p);
        assert_eq!(first_stranger(&[1, 10, 11], 1, is), None, "me and peers");
        assert_eq!(first_stranger(&[10, 12, 11], 1, is), Some(12));
        assert_eq!(first_stranger(&[], 1, is), None);
    }

    #[test]
    fn a_peer_runs_expseg_as_the_user_keeps_too_and_can_ask() {
        let root = std::env::temp_dir().join(format!("expseg-keep-{}", std::process::id()));
        let uid = crate::ipc::sockdir::current_uid();
        let proc_of = |pid: u32, maps: &str, env: &[&str]| {
            let d = root.join(pid.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("maps"), maps).unwrap();
            std::fs::write(d.join("environ"), env.join("\0")).unwrap();
        };
        let lib = "7f00-7f10 r-xp 0 08:01 1 /opt/x/libexpseg.so\n";
        let auto = "EXPSEG_KEEP=auto";
        proc_of(
            1,
            lib,
            &["PATH=/bin", "LD_PRELOAD=/opt/x/libexpseg.so", auto],
        );
        let libc = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n";
        proc_of(2, libc, &["PATH=/bin", auto]);
        proc_of(3, lib, &["EXPSEG_DISABLE=1", auto]);
        proc_of(4, lib, &["EXPSEG_SOCKETS=off", auto]);
        proc_of(
            5,
            lib,
            &["EXPSEG_SOCKETS=1", "EXPSEG_DISABLE=0", "EXPSEG_KEEP=Auto"],
        );
        proc_of(7, lib, &["PATH=/bin"]);
        assert!(is_peer(&root, 1, uid));
        assert!(!is_peer(&root, 2, uid), "no expseg");
        assert!(!is_peer(&root, 3, uid), "expseg off");
        assert!(!is_peer(&root, 4, uid), "cannot ask");
        assert!(is_peer(&root, 5, uid));
        assert!(
            !is_peer(&root, 7, uid),
            "does not ask on a free-memory query"
        );
        assert!(!is_peer(&root, 6, uid), "not readable");
        assert!(!is_peer(&root, 1, uid + 1), "another user's");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
