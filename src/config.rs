//! The `EXPSEG_*` configuration: defaults in one literal, one table mapping each variable to
//! its field. Read once, at the first hooked call (never in the library's constructor).
//!
//! An invalid value prints one stderr line naming the variable and the value, and the default
//! is used; a variable named `EXPSEG_*` that expseg does not read (a misspelling) prints one
//! naming it and the closest known name.

use std::io::Write;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Whose VMM pages expseg coalesces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coalesce {
    Torch,
    All,
    Off,
}

/// What a move of live pages does with the default streams of other devices given access to
/// them (`EXPSEG_PEER_HOLD`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerHold {
    /// Waited for before the move, not held during it.
    Off,
    /// Held from before the copies until the pages are back. A hold that does not start in
    /// time (200 ms for a move that only gives bytes back, 10 s when memory is asked for: then
    /// put off to a later call; 10 s for a move the program's call needs: then made as with
    /// `Off`), or that keeps the
    /// device's own fence from running 200 ms (a watchdog thread: 400 ms), is let go, and any
    /// after 2 s.
    On,
    /// A test on one GPU: the device's own default stream is held as a peer's would be, so the
    /// hold's driver calls and its letting go run (every move waits 200-400 ms).
    SelfTest,
}

/// Which mirrors (the standard copies a consumer without expseg opens) are brought up to date
/// when the program synchronizes or records an interprocess event (`EXPSEG_IPC_MIRROR_SYNC`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MirrorSync {
    /// Only at each handle request (a consumer that takes a handle once reads stale data).
    Off,
    /// Mirrors of memory no consumer running expseg has opened through its ticket (the
    /// default): such a consumer maps the memory itself, and the copies would be wasted.
    Plain,
    /// Every mirror, also of memory consumers running expseg opened (a plain consumer of the
    /// same handle besides them).
    Always,
}

/// Whether the page-locked host buffers of a pause stay after the resume, for the next pause
/// (`EXPSEG_PAUSE_KEEP_HOST`): page-locking is most of a pause's time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepHost {
    /// Freed when the resume is done.
    Off,
    /// Kept until `expseg.trim()` (or an allocation that finds no device memory).
    On,
    /// Kept while the host has room: given back when its available memory falls under an
    /// eighth of the host's (at least 4 GiB), checked ten times a second while any are kept,
    /// and at `expseg.trim()`.
    Auto,
}

impl KeepHost {
    /// Whether emptied buffers are kept at all.
    pub fn keeps(self) -> bool {
        self != KeepHost::Off
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `EXPSEG_DISABLE`: pure pass-through.
    pub disabled: bool,
    /// `EXPSEG_TORCH_DEFAULTS`: at load, PyTorch's allocator gets `expandable_segments:True`
    /// when the user set no allocator options (false: left as configured).
    pub torch_defaults: bool,
    /// `EXPSEG_LOG`: env_logger filter.
    pub log: String,
    /// `EXPSEG_PASSTHROUGH_BELOW`: requests smaller than this go to the real `cudaMalloc`.
    pub passthrough_below: u64,
    /// `EXPSEG_CACHE_MAX`: freed bytes kept per device for reuse. 0 (the default): a
    /// `cudaFree` of pool memory gives it back to the driver before it returns, as natively;
    /// more is opt-in, for processes that share the GPU with no one or only with expseg
    /// processes (which reclaim it when they find no memory).
    pub cache_max: u64,
    /// `EXPSEG_MAX_CHUNK`: largest physical chunk, 0 for no limit; larger allocations are made
    /// of several.
    pub max_chunk: u64,
    /// `EXPSEG_IPC_MOVE_MAX`: allocations up to this size are moved into standard memory in
    /// place when an IPC handle is asked for; larger ones get a mirror. 0: always a mirror.
    pub ipc_move_max: u64,
    /// `EXPSEG_MOVE_FENCE`: a compaction copies the live pages it moves and holds the device's
    /// legacy default stream until they are back at their address, so kernels other threads
    /// queue there meanwhile run after the move. Off: it copies after waiting for the device,
    /// and another thread's kernel may meet the pages while they are away.
    pub move_fence: bool,
    /// `EXPSEG_PEER_HOLD`: `0` (default) waits for the other devices given access to moving
    /// pages before the move; `1` also holds their default streams until the pages are back.
    pub peer_hold: PeerHold,
    /// `EXPSEG_IPC_TICKETS`: put tickets in mirror handles, so consumers running expseg map the
    /// original memory (two-way) instead of the mirror.
    pub ipc_tickets: bool,
    /// `EXPSEG_IPC_PEERS=expseg`: every consumer runs expseg: no mirror, only the ticket.
    pub ipc_peers_expseg: bool,
    /// `EXPSEG_IPC_EXTENT`: how far the mirror of another allocator's memory reaches. `torch`:
    /// to the end of PyTorch's live blocks over the handle's page, asked of the process's
    /// PyTorch (when it is a Python process using PyTorch), else the run of mappings. `run`:
    /// always the run of mappings from the page on.
    pub ipc_extent_torch: bool,
    /// `EXPSEG_IPC_MIRROR_SYNC`: which mirrors are copied again when the program synchronizes
    /// (a device, stream or event synchronize) or records an interprocess event, so that a
    /// consumer without expseg reads what the producer ordered before it, as natively.
    pub ipc_mirror_sync: MirrorSync,
    /// `EXPSEG_IPC_KEEP_CLOSED`: memory opened through a producer's ticket stays mapped after
    /// its last `cudaIpcCloseMemHandle`, unseen by the program, so the next open of the same
    /// handle costs nothing; the producer tells this process when it frees the memory (and it
    /// goes at once), and it goes when the producer exits.
    pub ipc_keep_closed: bool,
    /// `EXPSEG_CONTROL`: from its first allocation on, the process serves `expseg pause` and
    /// `expseg resume` of its own user on the per-user socket.
    pub control: bool,
    /// `EXPSEG_ALLOW_REMOTE_DISCARD`: opt-in: `expseg pause --discard` from outside may drop
    /// this process's paused bytes (without it, only an offloading pause is served).
    pub allow_remote_discard: bool,
    /// `EXPSEG_PAUSE_KEEP_HOST`: whether the page-locked host buffers of a pause are kept
    /// after the resume for the next pause ([`KeepHost`]; `auto`: while the host has room).
    pub pause_keep_host: KeepHost,
    /// `EXPSEG_IPC_ALLOW_UIDS`: users besides our own whose processes may map shared memory.
    pub ipc_allow_uids: Vec<u32>,
    /// `EXPSEG_PIDFD_RESCUE`: a `pidfd_getfd` the kernel denies (`EPERM`) is asked of the
    /// producer's expseg over its socket. `0`: the kernel's answer stands, no socket is made
    /// for it (a sandbox whose seccomp filter kills on `socket()`).
    pub pidfd_rescue: bool,
    /// `EXPSEG_SOCKETS`: `0` makes expseg open and connect no socket at all (no tickets, no
    /// `expseg pause` from outside, no reclaims, no descriptor rescue), for sandboxes whose
    /// seccomp filter kills a process on `socket()`.
    pub sockets: bool,
    /// `EXPSEG_COALESCE`: whose VMM pages get coalesced: `torch` (PyTorch's expandable
    /// segments: callers of the runtime's driver entry points in `libc10_cuda`), `all` (every
    /// caller of those entry points), `off`.
    pub coalesce: Coalesce,
    /// `EXPSEG_DRIVER_API`: serve the driver's allocation calls (`cuMemAlloc_v2` of programs
    /// that reach the driver themselves: static runtimes, driver API users) from the pool.
    /// On by default (the static-runtime, driver API, CuPy and JAX entries of shim-tests pass
    /// on the GPU). `0`: those programs get the driver's own memory.
    pub driver_api: bool,
    /// `EXPSEG_COALESCE_MAX`: largest physical handle behind coalesced pages.
    pub coalesce_max: u64,
    /// `EXPSEG_STRAND_MAX`: bytes of released pages a partly live handle may hold before it
    /// is compacted (with `EXPSEG_COMPACT=1`).
    pub strand_max: u64,
    /// `EXPSEG_COMPACT`: opt-in: partly released coalesced handles are compacted (their live
    /// pages copied into new handles and mapped back at their addresses), so released pages
    /// go back at once. Off (the default): a page the program has mapped never moves; released
    /// pages of a handle with live ones stay held until its last page goes or new pages are
    /// mapped where they were. Only for programs where no other thread launches GPU work while
    /// the allocator runs (such work meets the pages while they are away: an illegal address).
    pub compact: bool,
    /// `EXPSEG_SPLIT_TAIL` (default on): the last page of each batch of PyTorch's new pages
    /// gets a handle of its own (its tail holds the next small blocks, whose lifetime is not
    /// the batch's), so that the batch's other pages go back whole. Off: one handle a batch.
    pub split_tail: bool,
    /// `EXPSEG_LEARN_CUTS` (default on): where a handle's live pages met released ones when
    /// the program's giving back ended, later handles are cut (and not grown ahead across),
    /// so pages of different lifetimes seldom share one. Off: handles follow batches only.
    pub learn_cuts: bool,
    /// `EXPSEG_COALESCE_MARGIN`: free memory kept in hand while pages are admitted without
    /// being created; nearer the limit pages are created at once.
    pub coalesce_margin: u64,
    /// `EXPSEG_RELEASE_DELAY`: milliseconds of allocator quiet after which released coalesced
    /// handles go back to the driver; until then the program's next pages reuse them. 0 (the
    /// default): released before the call that releases them returns. More is opt-in, as
    /// `EXPSEG_CACHE_MAX`.
    pub release_delay_ms: u64,
    /// `EXPSEG_KEEP` (opt-in `auto`; default `off`): with no `EXPSEG_RELEASE_DELAY` of the
    /// user's, released coalesced handles are kept for reuse while every other process with a
    /// context on the GPU is an expseg process of the user (they ask for kept memory when they
    /// need it), and given back from the moment another process is listed (`api::keep`). Opt-in:
    /// a plain process arriving can ask before the give-back ends (measured: RESULTS.md).
    pub keep_auto: bool,
    /// `EXPSEG_KEEP_GIVEBACK` (default 40 ms; 0: no bound): under `EXPSEG_KEEP=auto`, what is
    /// kept is bounded by the time giving it back is estimated to take (`coalesce::reuse::giveback_us`),
    /// the oldest kept handles going back first, so that a plain process arriving (listed about
    /// 100 ms before it allocates) finds its memory back.
    pub keep_giveback_ms: u64,
    /// `EXPSEG_GROW_AHEAD`: most bytes a new coalesced handle covers beyond the program's
    /// last page (at most 1/64 of the most held), so that its next pages need no driver call;
    /// they go back at the program's first unmap. 0: off.
    pub grow_ahead: u64,
    /// `EXPSEG_IPC_DIR`: where the per-user socket directory lives; an existing absolute
    /// directory.
    pub ipc_dir: String,
    /// `EXPSEG_REPORT`: where to write the exit report (`%p` pid, `%r` rank); none if empty.
    pub report: Option<String>,
    /// `EXPSEG_TEST_PANIC`: for tests only, the hook that panics on purpose (to check that
    /// panics become error codes; `name:N`: at its Nth call only), or `pool`/`coalescer`: a
    /// panic inside that lock, right after an allocation was booked. Like every
    /// `EXPSEG_TEST_*` switch, read only in builds with the cargo feature `test-switches`
    /// ([`TEST_SWITCHES`]).
    pub test_panic: Option<String>,
    /// `EXPSEG_TEST_SLOW_CHECK`: for tests only, milliseconds the one-time ticket check waits
    /// (a hanging helper).
    pub test_slow_check_ms: Option<u64>,
    /// `EXPSEG_TEST_SLOW_EXPORT`: for tests only, milliseconds a foreign run's ticket waits
    /// after its first descriptor before exporting the others (a program changing the run
    /// meanwhile).
    pub test_slow_export_ms: Option<u64>,
    /// `EXPSEG_TEST_FAIL_MOVE`: for tests only, the step of an IPC move that fails on purpose.
    pub test_fail_move: Option<String>,
    /// `EXPSEG_TEST_TRACE`: for tests only, the path prefix of a trace of every coalescer call
    /// (`PREFIX.<pid>.trace`, `crate::api::trace`), which `expseg-replay` replays on the fake
    /// driver.
    pub test_trace: Option<String>,
    /// `EXPSEG_TEST_HOST_AVAILABLE`: for tests only, a file whose number is the host memory
    /// available to the process in bytes, read at each look instead of
    /// `crate::hostmem::available`: whether kept host buffers stay.
    pub test_host_available: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            disabled: false,
            torch_defaults: true,
            log: "warn".into(),
            // VMM memory comes in 2 MiB pages: smaller requests would waste most of a page,
            // while cudaMalloc packs them. PyTorch's smallest segment is exactly 2 MiB.
            passthrough_below: 2 * MIB,
            // Freed memory goes back at once: any cache is held from a process without expseg
            // (a plain process missed its handoff every time with 64G kept); keeping is opt-in.
            cache_max: 0,
            // One chunk per allocation: measured as fast as or faster than 2 GiB pieces at 4 and
            // 16 GiB (shim-tests/RESULTS.md, "cache0_onechunk" against "cache0").
            max_chunk: 0,
            // Off: a move unmaps the allocation for a moment, and expseg cannot tell whether
            // another thread is using it (a writer thread beside a move crashed every run).
            // Programs that guarantee no such use may set it; 20M is the size
            // measured reliable (cudaMalloc of at most 20 MiB shares the address heap of VMM
            // reservations, ../shared/notes/driver-facts.md).
            ipc_move_max: 0,
            ipc_tickets: true,
            move_fence: true,
            // Off until a move that holds device 1's stream has run on two GPUs
            // (scripts/vmm-cost/fence_peer.cu decides whether it can wait on device 0's).
            peer_hold: PeerHold::Off,
            control: true,
            // Discarding loses the program's data: only the program's own environment says yes.
            allow_remote_discard: false,
            pause_keep_host: KeepHost::Auto,
            ipc_peers_expseg: false,
            // A tensor ends inside its PyTorch block; the run of mappings after its page is
            // the rest of the segment (unbounded, a trained model's 7 parameters of 2.8 GiB
            // took 280 GiB of mirrors: shim-tests/ipc_reach.py).
            ipc_extent_torch: true,
            ipc_mirror_sync: MirrorSync::Plain,
            ipc_keep_closed: true,
            ipc_allow_uids: Vec::new(),
            pidfd_rescue: true,
            sockets: true,
            coalesce: Coalesce::Torch,
            driver_api: true,
            // Bounds the temporary memory a compaction needs (the live part of one handle),
            // and holds a churn step's largest tensors (0.6 GiB) whole.
            coalesce_max: GIB,
            // Released pages are compacted inside the release that strands them.
            strand_max: 0,
            compact: false,
            split_tail: true,
            learn_cuts: true,
            coalesce_margin: GIB,
            // Released handles go back before the release returns: a colocated engine handed
            // the memory by empty_cache() gets it (kept 2 ms, it did 1 time in 20; churn
            // is then 0.25x default instead of 1.0x, docs/design.md). Keeping is opt-in.
            release_delay_ms: 0,
            keep_auto: false,
            keep_giveback_ms: 40,
            // Bounded by 1/64 of the peak held and by EXPSEG_COALESCE_MAX in practice.
            grow_ahead: GIB,
            ipc_dir: "/tmp".into(),
            report: None,
            test_panic: None,
            test_slow_check_ms: None,
            test_slow_export_ms: None,
            test_fail_move: None,
            test_trace: None,
            test_host_available: None,
        }
    }
}

/// One line of the table: a variable, how to parse it, where it goes.
struct Var {
    name: &'static str,
    /// Applies the value; `Err` says what was expected.
    set: fn(&mut Config, &str) -> Result<(), &'static str>,
    show: fn(&Config) -> String,
}

const VARS: &[Var] = &[
    Var {
        name: "EXPSEG_DISABLE",
        set: |c, v| set_switch(&mut c.disabled, v),
        show: |c| c.disabled.to_string(),
    },
    Var {
        name: "EXPSEG_LOG",
        set: |c, v| check_log_filter(v).map(|()| c.log = v.to_string()),
        show: |c| c.log.clone(),
    },
    Var {
        name: "EXPSEG_PASSTHROUGH_BELOW",
        set: |c, v| parse_size(v).map(|s| c.passthrough_below = s),
        show: |c| fmt_size(c.passthrough_below),
    },
    Var {
        name: "EXPSEG_CACHE_MAX",
        set: |c, v| parse_size(v).map(|s| c.cache_max = s),
        show: |c| fmt_size(c.cache_max),
    },
    Var {
        name: "EXPSEG_MAX_CHUNK",
        set: |c, v| match parse_size(v) {
            Ok(s) if s == 0 || s >= 2 * MIB => {
                c.max_chunk = s;
                Ok(())
            }
            _ => Err("0 (no limit) or a size of at least 2M, such as 512M or 2G"),
        },
        show: |c| fmt_size(c.max_chunk),
    },
    Var {
        name: "EXPSEG_DRIVER_API",
        set: |c, v| set_switch(&mut c.driver_api, v),
        show: |c| c.driver_api.to_string(),
    },
    Var {
        name: "EXPSEG_COALESCE",
        set: |c, v| {
            c.coalesce = match v {
                "torch" => Coalesce::Torch,
                "all" => Coalesce::All,
                "off" | "0" => Coalesce::Off,
                _ => return Err("torch, all or off"),
            };
            Ok(())
        },
        show: |c| format!("{:?}", c.coalesce).to_lowercase(),
    },
    Var {
        name: "EXPSEG_TORCH_DEFAULTS",
        // Empty is the default, as `expseg-run` reads it (`${EXPSEG_TORCH_DEFAULTS:-1}`).
        set: |c, v| set_switch(&mut c.torch_defaults, v),
        show: |c| u8::from(c.torch_defaults).to_string(),
    },
    Var {
        name: "EXPSEG_COALESCE_MAX",
        set: |c, v| match parse_size(v) {
            Ok(s) if s >= 2 * MIB => {
                c.coalesce_max = s;
                Ok(())
            }
            _ => Err("a size of at least 2M, such as 512M or 1G"),
        },
        show: |c| fmt_size(c.coalesce_max),
    },
    Var {
        name: "EXPSEG_STRAND_MAX",
        set: |c, v| parse_size(v).map(|s| c.strand_max = s),
        show: |c| fmt_size(c.strand_max),
    },
    Var {
        name: "EXPSEG_COMPACT",
        set: |c, v| set_switch(&mut c.compact, v),
        show: |c| u8::from(c.compact).to_string(),
    },
    Var {
        name: "EXPSEG_SPLIT_TAIL",
        set: |c, v| set_switch(&mut c.split_tail, v),
        show: |c| u8::from(c.split_tail).to_string(),
    },
    Var {
        name: "EXPSEG_LEARN_CUTS",
        set: |c, v| set_switch(&mut c.learn_cuts, v),
        show: |c| u8::from(c.learn_cuts).to_string(),
    },
    Var {
        name: "EXPSEG_COALESCE_MARGIN",
        set: |c, v| parse_size(v).map(|s| c.coalesce_margin = s),
        show: |c| fmt_size(c.coalesce_margin),
    },
    Var {
        name: "EXPSEG_RELEASE_DELAY",
        set: |c, v| {
            let ms = v.strip_suffix("ms").unwrap_or(v);
            match ms.parse::<u64>() {
                Ok(n) if n <= 60_000 => {
                    c.release_delay_ms = n;
                    Ok(())
                }
                _ => Err("milliseconds from 0 to 60000, such as 2 or 10ms"),
            }
        },
        show: |c| format!("{}ms", c.release_delay_ms),
    },
    Var {
        name: "EXPSEG_KEEP",
        set: |c, v| match v.trim().to_ascii_lowercase().as_str() {
            "auto" => {
                c.keep_auto = true;
                Ok(())
            }
            "off" | "0" | "false" | "no" => {
                c.keep_auto = false;
                Ok(())
            }
            _ => Err("auto or off"),
        },
        show: |c| if c.keep_auto { "auto" } else { "off" }.to_string(),
    },
    Var {
        name: "EXPSEG_KEEP_GIVEBACK",
        set: |c, v| {
            let ms = v.trim().strip_suffix("ms").unwrap_or(v.trim());
            match ms.parse::<u64>() {
                Ok(n) if n <= 10_000 => {
                    c.keep_giveback_ms = n;
                    Ok(())
                }
                _ => Err("milliseconds from 0 (no bound) to 10000, such as 40 or 40ms"),
            }
        },
        show: |c| format!("{}ms", c.keep_giveback_ms),
    },
    Var {
        name: "EXPSEG_GROW_AHEAD",
        set: |c, v| parse_size(v).map(|s| c.grow_ahead = s),
        show: |c| fmt_size(c.grow_ahead),
    },
    Var {
        name: "EXPSEG_IPC_DIR",
        set: |c, v| {
            valid_ipc_dir(v)?;
            c.ipc_dir = v.to_string();
            Ok(())
        },
        show: |c| c.ipc_dir.clone(),
    },
    Var {
        name: "EXPSEG_IPC_MOVE_MAX",
        set: |c, v| parse_size(v).map(|s| c.ipc_move_max = s),
        show: |c| fmt_size(c.ipc_move_max),
    },
    Var {
        name: "EXPSEG_MOVE_FENCE",
        set: |c, v| set_switch(&mut c.move_fence, v),
        show: |c| c.move_fence.to_string(),
    },
    Var {
        name: "EXPSEG_PEER_HOLD",
        set: |c, v| {
            c.peer_hold = match v.trim() {
                "" => return Ok(()),
                "self" => PeerHold::SelfTest,
                b => match parse_bool(b) {
                    Ok(true) => PeerHold::On,
                    Ok(false) => PeerHold::Off,
                    Err(_) => return Err("1/0, true/false, yes/no, on/off, or self"),
                },
            };
            Ok(())
        },
        show: |c| match c.peer_hold {
            PeerHold::Off => "0".into(),
            PeerHold::On => "1".into(),
            PeerHold::SelfTest => "self".into(),
        },
    },
    Var {
        name: "EXPSEG_IPC_TICKETS",
        set: |c, v| set_switch(&mut c.ipc_tickets, v),
        show: |c| c.ipc_tickets.to_string(),
    },
    Var {
        name: "EXPSEG_CONTROL",
        set: |c, v| set_switch(&mut c.control, v),
        show: |c| c.control.to_string(),
    },
    Var {
        name: "EXPSEG_ALLOW_REMOTE_DISCARD",
        set: |c, v| parse_bool(v).map(|b| c.allow_remote_discard = b),
        show: |c| c.allow_remote_discard.to_string(),
    },
    Var {
        name: "EXPSEG_PAUSE_KEEP_HOST",
        set: |c, v| {
            c.pause_keep_host = match v.trim() {
                "" => return Ok(()),
                w if w.eq_ignore_ascii_case("auto") => KeepHost::Auto,
                w => match parse_bool(w).map_err(|_| "1/0, true/false, yes/no, on/off or auto")? {
                    true => KeepHost::On,
                    false => KeepHost::Off,
                },
            };
            Ok(())
        },
        show: |c| match c.pause_keep_host {
            KeepHost::Off => "0".into(),
            KeepHost::On => "1".into(),
            KeepHost::Auto => "auto".into(),
        },
    },
    Var {
        name: "EXPSEG_IPC_PEERS",
        set: |c, v| {
            parse_choice(v, ["any", "expseg"], false, "any or expseg")
                .map(|b| c.ipc_peers_expseg = b)
        },
        show: |c| if c.ipc_peers_expseg { "expseg" } else { "any" }.to_string(),
    },
    Var {
        name: "EXPSEG_IPC_EXTENT",
        set: |c, v| {
            parse_choice(v, ["run", "torch"], true, "torch or run").map(|b| c.ipc_extent_torch = b)
        },
        show: |c| if c.ipc_extent_torch { "torch" } else { "run" }.to_string(),
    },
    Var {
        name: "EXPSEG_IPC_MIRROR_SYNC",
        set: |c, v| {
            c.ipc_mirror_sync = match v.trim() {
                "" => return Ok(()),
                "plain" => MirrorSync::Plain,
                "always" => MirrorSync::Always,
                "off" => MirrorSync::Off,
                _ => return Err("plain, always or off"),
            };
            Ok(())
        },
        show: |c| {
            match c.ipc_mirror_sync {
                MirrorSync::Off => "off",
                MirrorSync::Plain => "plain",
                MirrorSync::Always => "always",
            }
            .to_string()
        },
    },
    Var {
        name: "EXPSEG_IPC_ALLOW_UIDS",
        set: |c, v| {
            let uids: Result<Vec<u32>, _> = v
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::parse)
                .collect();
            uids.map(|u| c.ipc_allow_uids = u)
                .map_err(|_| "a comma-separated list of user ids")
        },
        show: |c| {
            c.ipc_allow_uids
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        },
    },
    Var {
        name: "EXPSEG_IPC_KEEP_CLOSED",
        set: |c, v| parse_bool(v).map(|b| c.ipc_keep_closed = b),
        show: |c| c.ipc_keep_closed.to_string(),
    },
    Var {
        name: "EXPSEG_PIDFD_RESCUE",
        set: |c, v| parse_bool(v).map(|b| c.pidfd_rescue = b),
        show: |c| c.pidfd_rescue.to_string(),
    },
    Var {
        name: "EXPSEG_SOCKETS",
        set: |c, v| parse_bool(v).map(|b| c.sockets = b),
        show: |c| c.sockets.to_string(),
    },
    Var {
        name: "EXPSEG_REPORT",
        set: |c, v| {
            // `none` is off, as for expseg-run (a file named "none" is `./none`).
            let v = v.trim();
            c.report = (!v.is_empty() && v != "none").then(|| v.to_string());
            Ok(())
        },
        show: |c| c.report.clone().unwrap_or_default(),
    },
    Var {
        name: "EXPSEG_TEST_PANIC",
        set: |c, v| {
            c.test_panic = text(v);
            Ok(())
        },
        show: |c| c.test_panic.clone().unwrap_or_default(),
    },
    Var {
        name: "EXPSEG_TEST_SLOW_CHECK",
        set: |c, v| test_ms(v).map(|ms| c.test_slow_check_ms = Some(ms)),
        show: |c| show_ms(c.test_slow_check_ms),
    },
    Var {
        name: "EXPSEG_TEST_SLOW_EXPORT",
        set: |c, v| test_ms(v).map(|ms| c.test_slow_export_ms = Some(ms)),
        show: |c| show_ms(c.test_slow_export_ms),
    },
    Var {
        name: "EXPSEG_TEST_FAIL_MOVE",
        set: |c, v| {
            match crate::pool::MoveStep::from_name(v.trim()) {
            Some(_) => {
                c.test_fail_move = Some(v.trim().to_string());
                Ok(())
            }
            None if v.trim().is_empty() => Ok(()),
            None => Err("a move step: sync, temp_reserve, temp_map, unmap, free_range, alloc, placement, copy or handle"),
        }
        },
        show: |c| c.test_fail_move.clone().unwrap_or_default(),
    },
    Var {
        name: "EXPSEG_TEST_TRACE",
        set: |c, v| {
            c.test_trace = text(v);
            Ok(())
        },
        show: |c| c.test_trace.clone().unwrap_or_default(),
    },
    Var {
        name: "EXPSEG_TEST_HOST_AVAILABLE",
        set: |c, v| {
            c.test_host_available = text(v);
            Ok(())
        },
        show: |c| c.test_host_available.clone().unwrap_or_default(),
    },
];

impl Config {
    /// Whether memory the program gives back may be kept for reuse (opt-in: a cache bound, a
    /// release delay, or `EXPSEG_KEEP=auto`): such a process serves reclaims of other expseg
    /// processes.
    pub fn keeps(&self) -> bool {
        self.cache_max > 0 || self.release_delay_ms > 0 || self.keep_auto
    }

    /// Whether the hook `name` must panic now (tests of the panic boundary):
    /// `EXPSEG_TEST_PANIC=name` at every call, `name:N` at the Nth call only, after earlier
    /// calls have done their work.
    pub fn test_panic(&self, name: &str) -> bool {
        static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        match self.test_panic.as_deref().map(|v| v.split_once(':')) {
            Some(None) => self.test_panic.as_deref() == Some(name),
            Some(Some((n, nth))) if n == name => {
                let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                nth.parse() == Ok(call)
            }
            _ => false,
        }
    }

    /// Build from a lookup function (`Err`: the value is not UTF-8, shown lossily); each invalid
    /// value is reported through `bad`.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<Result<String, String>>,
        mut bad: impl FnMut(String),
    ) -> Config {
        let mut c = Config::default();
        for v in VARS {
            if let Some(val) = get(v.name) {
                if v.name.starts_with(TEST_SWITCH) && !TEST_SWITCHES {
                    if !matches!(&val, Ok(s) if s.trim().is_empty()) {
                        bad(format!(
                            "expseg: {} is ignored: this build has no test switches (they need the cargo feature test-switches)",
                            v.name
                        ));
                    }
                    continue;
                }
                let val = match val {
                    Ok(val) => val,
                    Err(lossy) => {
                        bad(format!(
                            "expseg: invalid {}={:?} (not UTF-8); using the default {}",
                            v.name,
                            lossy,
                            (v.show)(&Config::default())
                        ));
                        continue;
                    }
                };
                if let Err(expected) = (v.set)(&mut c, &val) {
                    bad(format!(
                        "expseg: invalid {}={:?} (expected {}); using the default {}",
                        v.name,
                        val,
                        expected,
                        (v.show)(&Config::default())
                    ));
                }
            }
        }
        c
    }

    /// A variable of the process environment for [`Config::from_lookup`].
    pub fn env_value(name: &str) -> Option<Result<String, String>> {
        std::env::var_os(name).map(|v| match v.to_str() {
            Some(s) => Ok(s.to_string()),
            None => Err(v.to_string_lossy().into_owned()),
        })
    }

    /// Read the process environment, printing one stderr line per invalid value and one per
    /// `EXPSEG_*` variable that expseg does not read ([`unknown_vars`]).
    pub fn from_env() -> Config {
        let mut say = |line: String| {
            let _ = writeln!(std::io::stderr(), "{line}");
        };
        let c = Config::from_lookup(Config::env_value, &mut say);
        for u in unknown_vars(std::env::vars_os()) {
            say(u.line());
        }
        c
    }

    /// Every variable and its effective value, for logs, reports and `expseg doctor` (the
    /// test switches only in builds that read them).
    pub fn effective(&self) -> Vec<(&'static str, String)> {
        VARS.iter()
            .filter(|v| TEST_SWITCHES || !v.name.starts_with(TEST_SWITCH))
            .map(|v| (v.name, (v.show)(self)))
            .collect()
    }
}

/// `EXPSEG_IPC_DIR` must name an existing directory by an absolute path (an empty value would
/// mean the working directory; a missing one would be created with its parents).
pub fn valid_ipc_dir(v: &str) -> Result<(), &'static str> {
    use std::os::unix::fs::PermissionsExt;
    let p = std::path::Path::new(v);
    if !(p.is_absolute() && p.is_dir()) {
        return Err("the absolute path of an existing directory");
    }
    // Where others may write and the sticky bit is off, another user could rename or remove
    // the socket directories made there, or take their names first.
    let mode = std::fs::metadata(p).map_or(0, |m| m.permissions().mode());
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err("a directory others cannot write to, or a sticky one (as /tmp)");
    }
    Ok(())
}

/// A switch's word: 1/0, true/false, yes/no, on/off (any case); nothing else.
fn parse_bool(v: &str) -> Result<bool, &'static str> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err("1/0, true/false, yes/no or on/off"),
    }
}

/// A text value, trimmed; empty is as if unset.
fn text(v: &str) -> Option<String> {
    Some(v.trim().to_string()).filter(|t| !t.is_empty())
}

/// Set a switch from its word; an empty value is as if unset (the default stays).
fn set_switch(field: &mut bool, v: &str) -> Result<(), &'static str> {
    if !v.trim().is_empty() {
        *field = parse_bool(v)?;
    }
    Ok(())
}

/// One of two words: `Ok(false)` for the first, `Ok(true)` for the second, `Ok(default)` for
/// an empty value.
fn parse_choice(
    v: &str,
    words: [&str; 2],
    default: bool,
    expected: &'static str,
) -> Result<bool, &'static str> {
    match v.trim() {
        "" => Ok(default),
        w if w == words[0] => Ok(false),
        w if w == words[1] => Ok(true),
        _ => Err(expected),
    }
}

/// Bytes, with an optional suffix: K, M, G, T (powers of 1024; `KiB`, `MB`... also accepted).
pub fn parse_size(v: &str) -> Result<u64, &'static str> {
    const EXPECTED: &str = "a byte count such as 0, 4096, 512M or 2G";
    let s = v.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits);
    let n: u64 = num.parse().map_err(|_| EXPECTED)?;
    let shift = match unit
        .trim()
        .to_ascii_lowercase()
        .trim_end_matches("ib")
        .trim_end_matches('b')
    {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(EXPECTED),
    };
    n.checked_mul(1 << shift).ok_or(EXPECTED)
}

pub fn fmt_size(b: u64) -> String {
    for (unit, shift) in [("G", 30), ("M", 20), ("K", 10)] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{unit}", b >> shift);
        }
    }
    b.to_string()
}

/// Accept what env_logger accepts in practice: comma-separated `level`, `target` or
/// `target=level` directives.
fn check_log_filter(v: &str) -> Result<(), &'static str> {
    const EXPECTED: &str =
        "levels off, error, warn, info, debug or trace, alone or as expseg=LEVEL, comma-separated";
    let level = |l: &str| {
        matches!(
            l.to_ascii_lowercase().as_str(),
            "off" | "error" | "warn" | "info" | "debug" | "trace"
        )
    };
    // expseg's own module paths only: any other bare word (`loud`, `warning`) would be taken
    // by env_logger as a module name and silence every line of expseg.
    let target = |t: &str| {
        (t == "expseg" || t.starts_with("expseg::"))
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    for d in v.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let ok = match d.split_once('=') {
            Some((t, l)) => target(t) && level(l),
            None => level(d) || target(d),
        };
        if !ok {
            return Err(EXPECTED);
        }
    }
    if v.trim().is_empty() {
        return Err(EXPECTED);
    }
    Ok(())
}

/// The prefix of the test switches: variables that make expseg fail or wait on purpose, for
/// tests of those paths.
const TEST_SWITCH: &str = "EXPSEG_TEST_";

/// Whether this build reads the test switches (cargo feature `test-switches`; the preload
/// tests build the library with it). Without it they are ignored, with one line each.
pub const TEST_SWITCHES: bool = cfg!(feature = "test-switches");

/// A test knob's milliseconds.
fn test_ms(v: &str) -> Result<u64, &'static str> {
    v.trim().parse::<u64>().map_err(|_| "milliseconds")
}

/// A test knob's milliseconds as set, or nothing.
fn show_ms(ms: Option<u64>) -> String {
    ms.map(|m| m.to_string()).unwrap_or_default()
}

mod names;
pub use names::Unknown;

/// Every name of `vars` (an environment: names and values) that starts with `EXPSEG_`, has a
/// value (an empty one is as if unset) and is none of expseg's, by name, each with the closest
/// known name (edit distance, any case; the library's own variables first on a tie).
pub fn unknown_vars<K, V>(vars: impl IntoIterator<Item = (K, V)>) -> Vec<Unknown>
where
    K: AsRef<std::ffi::OsStr>,
    V: AsRef<std::ffi::OsStr>,
{
    let library: Vec<&'static str> = VARS.iter().map(|v| v.name).collect();
    names::unknown_among(vars, &library)
}

#[cfg(test)]
mod tests;
