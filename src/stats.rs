//! Process-wide counters and the exit report.
//!
//! Pool counters live in each pool (under its lock, see [`crate::pool::PoolStats`]); what
//! happens outside any pool — pass-throughs, synchronisations, caught panics — is counted
//! here in atomics. At exit, when `EXPSEG_REPORT` is set, both go into a human-readable table
//! and a JSON file. Writing the report makes no CUDA call.

use crate::gpu::Op;
use crate::pool::PoolStats;
use crossbeam::utils::CachePadded;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// One process-wide counter, padded so threads counting different things do not contend.
pub struct Counter(CachePadded<AtomicU64>);

/// Calls of one kind and their time, side by side: a hook updates both, so they share a cache
/// line (one miss a hook where two counters of their own cost two).
pub struct Timing(CachePadded<[AtomicU64; 2]>);

impl Timing {
    const fn new() -> Self {
        Timing(CachePadded::new([AtomicU64::new(0), AtomicU64::new(0)]))
    }

    /// One call that took `ticks` ([`crate::clock`]).
    pub fn add(&self, ticks: u64) {
        self.0[0].fetch_add(1, Ordering::Relaxed);
        self.0[1].fetch_add(ticks, Ordering::Relaxed);
    }

    pub fn calls(&self) -> u64 {
        self.0[0].load(Ordering::Relaxed)
    }

    pub fn ticks(&self) -> u64 {
        self.0[1].load(Ordering::Relaxed)
    }
}

impl Counter {
    const fn new() -> Self {
        Counter(CachePadded::new(AtomicU64::new(0)))
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    pub fn sub(&self, n: u64) {
        self.0.fetch_sub(n, Ordering::Relaxed);
    }
}

pub struct Global {
    pub passthrough_allocs: Counter,
    pub passthrough_alloc_bytes: Counter,
    pub passthrough_frees: Counter,
    pub ipc_handle_requests: Counter,
    pub syncs: Counter,
    pub sync_ns: Counter,
    pub panics_caught: Counter,
    /// Pool allocations and frees made through the driver API (`cuMemAlloc_v2`, `cuMemFree_v2`).
    pub driver_allocs: Counter,
    pub driver_frees: Counter,
    /// Tickets this process issued (one per shared allocation).
    pub ipc_tickets_issued: Counter,
    /// Requests for tickets (and PyTorch descriptors) this process granted and refused.
    pub ipc_tickets_granted: Counter,
    pub ipc_tickets_refused: Counter,
    /// Handles issued with a ticket and no mirror because there was no memory for one.
    pub ipc_ticket_only: Counter,
    /// Mirrors copied again after a synchronize of the program's, and before a record of an
    /// interprocess event (`EXPSEG_IPC_MIRROR_SYNC`), and the bytes of both.
    pub ipc_mirror_sync_copies: Counter,
    pub ipc_mirror_event_copies: Counter,
    pub ipc_mirror_sync_bytes: Counter,
    /// Mirrors of other allocators' memory (PyTorch's pages): bytes held now, bytes made in all.
    pub foreign_mirror_bytes: Counter,
    pub foreign_mirror_bytes_made: Counter,
    /// Exports of pages inside coalesced handles made through a page-sized copy
    /// (`api::ipc::pages`): copies made, bytes held now, copies made again.
    pub export_mirrors_made: Counter,
    pub export_mirror_bytes: Counter,
    pub export_mirror_copies: Counter,
    /// Mirrors made to the end of PyTorch's live blocks instead of the whole run of mappings,
    /// and the bytes of runs they did not copy.
    pub foreign_mirrors_bounded: Counter,
    pub foreign_mirror_bytes_spared: Counter,
    /// Other processes' memory this process opened through their tickets.
    pub ipc_tickets_opened: Counter,
    /// Closes of memory opened through a ticket that kept it mapped for the next open.
    pub ipc_kept_closed: Counter,
    /// Opens served by such a kept mapping (nothing asked, imported or mapped).
    pub ipc_kept_reopened: Counter,
    /// Kept mappings unmapped (the producer freed the memory or exited, or too many kept).
    pub ipc_kept_dropped: Counter,
    /// PyTorch's reservations of imported pages kept at its free (`api::imports`), handed back
    /// at a later reservation, and unmapped (their producer let the page go or exited).
    pub ipc_views_kept: Counter,
    pub ipc_views_reused: Counter,
    pub ipc_views_dropped: Counter,
    /// Imports of a page mapped in a kept view already, not made (`api::imports`).
    pub ipc_imports_deferred: Counter,
    /// Reclaims: asks of other expseg processes after an allocation found no memory, the
    /// bytes they gave back, and the bytes this process gave back when asked or trimmed.
    pub reclaim_asks: Counter,
    pub reclaimed_bytes: Counter,
    pub given_back_bytes: Counter,
    /// PyTorch's VMM calls on coalesced pages: calls and wall time per call in clock ticks
    /// ([`crate::clock`]; nanoseconds in the report), [`VMM_CALLS`] order, lock waits and
    /// driver calls included: the hooks' own cost is this less the coalescer's driver time.
    pub vmm: [Timing; VMM_CALLS.len()],
}

/// The VMM calls timed in [`Global::vmm`], and their indices there.
pub const VMM_CALLS: [&str; 5] = ["create", "map", "access", "unmap", "release"];
pub const VMM_CREATE: usize = 0;
pub const VMM_MAP: usize = 1;
pub const VMM_ACCESS: usize = 2;
pub const VMM_UNMAP: usize = 3;
pub const VMM_RELEASE: usize = 4;

pub static GLOBAL: Global = Global {
    passthrough_allocs: Counter::new(),
    passthrough_alloc_bytes: Counter::new(),
    passthrough_frees: Counter::new(),
    ipc_handle_requests: Counter::new(),
    syncs: Counter::new(),
    sync_ns: Counter::new(),
    panics_caught: Counter::new(),
    driver_allocs: Counter::new(),
    driver_frees: Counter::new(),
    ipc_tickets_issued: Counter::new(),
    ipc_tickets_granted: Counter::new(),
    ipc_tickets_refused: Counter::new(),
    ipc_ticket_only: Counter::new(),
    ipc_mirror_sync_copies: Counter::new(),
    ipc_mirror_event_copies: Counter::new(),
    ipc_mirror_sync_bytes: Counter::new(),
    foreign_mirror_bytes: Counter::new(),
    foreign_mirror_bytes_made: Counter::new(),
    export_mirrors_made: Counter::new(),
    export_mirror_bytes: Counter::new(),
    export_mirror_copies: Counter::new(),
    foreign_mirrors_bounded: Counter::new(),
    foreign_mirror_bytes_spared: Counter::new(),
    ipc_tickets_opened: Counter::new(),
    ipc_kept_closed: Counter::new(),
    ipc_kept_reopened: Counter::new(),
    ipc_kept_dropped: Counter::new(),
    ipc_views_kept: Counter::new(),
    ipc_views_reused: Counter::new(),
    ipc_views_dropped: Counter::new(),
    ipc_imports_deferred: Counter::new(),
    reclaim_asks: Counter::new(),
    reclaimed_bytes: Counter::new(),
    given_back_bytes: Counter::new(),
    vmm: [const { Timing::new() }; VMM_CALLS.len()],
};

/// Time `f` as one VMM call of kind `k` (an index into [`VMM_CALLS`]).
pub fn time_vmm<T>(k: usize, f: impl FnOnce() -> T) -> T {
    let t = crate::clock::ticks();
    let r = f();
    GLOBAL.vmm[k].add(crate::clock::since(t));
    r
}

impl Global {
    fn rows(&self) -> Vec<(&'static str, u64)> {
        let mut rows = vec![
            ("passthrough_allocs", self.passthrough_allocs.get()),
            (
                "passthrough_alloc_bytes",
                self.passthrough_alloc_bytes.get(),
            ),
            ("passthrough_frees", self.passthrough_frees.get()),
            ("ipc_handle_requests", self.ipc_handle_requests.get()),
            ("syncs", self.syncs.get()),
            ("sync_ns", self.sync_ns.get()),
            ("panics_caught", self.panics_caught.get()),
            ("driver_allocs", self.driver_allocs.get()),
            ("driver_frees", self.driver_frees.get()),
            ("ipc_tickets_issued", self.ipc_tickets_issued.get()),
            ("ipc_tickets_granted", self.ipc_tickets_granted.get()),
            ("ipc_tickets_refused", self.ipc_tickets_refused.get()),
            ("ipc_ticket_only", self.ipc_ticket_only.get()),
            ("ipc_mirror_sync_copies", self.ipc_mirror_sync_copies.get()),
            (
                "ipc_mirror_event_copies",
                self.ipc_mirror_event_copies.get(),
            ),
            ("ipc_mirror_sync_bytes", self.ipc_mirror_sync_bytes.get()),
            ("foreign_mirror_bytes", self.foreign_mirror_bytes.get()),
            (
                "foreign_mirror_bytes_made",
                self.foreign_mirror_bytes_made.get(),
            ),
            ("export_mirrors_made", self.export_mirrors_made.get()),
            ("export_mirror_bytes", self.export_mirror_bytes.get()),
            ("export_mirror_copies", self.export_mirror_copies.get()),
            (
                "foreign_mirrors_bounded",
                self.foreign_mirrors_bounded.get(),
            ),
            (
                "foreign_mirror_bytes_spared",
                self.foreign_mirror_bytes_spared.get(),
            ),
            ("ipc_tickets_opened", self.ipc_tickets_opened.get()),
            ("ipc_kept_closed", self.ipc_kept_closed.get()),
            ("ipc_kept_reopened", self.ipc_kept_reopened.get()),
            ("ipc_kept_dropped", self.ipc_kept_dropped.get()),
            ("ipc_views_kept", self.ipc_views_kept.get()),
            ("ipc_views_reused", self.ipc_views_reused.get()),
            ("ipc_views_dropped", self.ipc_views_dropped.get()),
            ("ipc_imports_deferred", self.ipc_imports_deferred.get()),
            ("reclaim_asks", self.reclaim_asks.get()),
            ("reclaimed_bytes", self.reclaimed_bytes.get()),
            ("given_back_bytes", self.given_back_bytes.get()),
        ];
        const CALLS: [&str; VMM_CALLS.len()] = [
            "vmm_create_calls",
            "vmm_map_calls",
            "vmm_access_calls",
            "vmm_unmap_calls",
            "vmm_release_calls",
        ];
        const NS: [&str; VMM_CALLS.len()] = [
            "vmm_create_ns",
            "vmm_map_ns",
            "vmm_access_ns",
            "vmm_unmap_ns",
            "vmm_release_ns",
        ];
        for k in 0..VMM_CALLS.len() {
            let n = self.vmm[k].calls();
            if n > 0 {
                rows.push((CALLS[k], n));
                rows.push((NS[k], crate::clock::ns(self.vmm[k].ticks())));
            }
        }
        rows
    }
}

/// Everything the report shows, taken at one moment.
pub struct Snapshot {
    pub pid: u32,
    pub rank: String,
    /// Whether the pool runs, or why not.
    pub status: String,
    pub config: Vec<(&'static str, String)>,
    pub global: Vec<(&'static str, u64)>,
    pub pools: Vec<(i32, PoolStats)>,
}

impl Snapshot {
    pub fn take(
        status: String,
        config: Vec<(&'static str, String)>,
        pools: Vec<(i32, PoolStats)>,
    ) -> Self {
        Snapshot {
            pid: std::process::id(),
            rank: rank(),
            status,
            config,
            global: GLOBAL.rows(),
            pools,
        }
    }
}

/// The process's rank as launchers set it, for `%r`.
pub fn rank() -> String {
    [
        "RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "PMIX_RANK",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
    .unwrap_or_else(|| "0".into())
}

/// Expand `%p` (pid), `%r` (rank) and `%%` in a report path.
pub fn expand_path(template: &str, pid: u32, rank: &str) -> String {
    let mut out = String::new();
    let mut chars = template.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('p') => out.push_str(&pid.to_string()),
            Some('r') => out.push_str(rank),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 20) as f64)
}

type Row = (&'static str, fn(&PoolStats) -> u64);

const POOL_ROWS: &[Row] = &[
    ("allocs", |s| s.allocs),
    ("frees", |s| s.frees),
    ("cache_hits", |s| s.cache_hits),
    ("stitched", |s| s.stitched),
    ("over_commits", |s| s.over_commits),
    ("ooms", |s| s.ooms),
    ("driver_errors", |s| s.driver_errors),
    ("live_user_bytes", |s| s.live_user_bytes),
    ("live_bytes", |s| s.live_bytes),
    ("cached_bytes", |s| s.cached_bytes),
    ("peak_live_user_bytes", |s| s.peak_live_user_bytes),
    ("peak_held_bytes", |s| s.peak_held_bytes),
    ("created_bytes", |s| s.created_bytes),
    ("released_bytes", |s| s.released_bytes),
    ("ipc_moved", |s| s.ipc_moved),
    ("ipc_plugged", |s| s.ipc_plugged),
    ("ipc_move_failures", |s| s.ipc_move_failures),
    ("ipc_mirrored", |s| s.ipc_mirrored),
    ("mirror_bytes", |s| s.mirror_bytes),
];

/// The human-readable report.
pub fn render_table(s: &Snapshot) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "expseg report: pid {} rank {} ({})",
        s.pid, s.rank, s.status
    );
    for (dev, p) in &s.pools {
        let _ = writeln!(o, "\ndevice {dev} pool");
        for (name, get) in POOL_ROWS {
            let v = get(p);
            if name.ends_with("bytes") {
                let _ = writeln!(o, "  {name:<24} {v:>16}  ({} MiB)", mib(v));
            } else {
                let _ = writeln!(o, "  {name:<24} {v:>16}");
            }
        }
        let _ = writeln!(
            o,
            "  {:<24} {:>10} {:>12} {:>10}",
            "driver call", "calls", "total ms", "mean us"
        );
        for (i, op) in Op::ALL.iter().enumerate() {
            let (n, ns) = (p.driver_calls[i], p.driver_ns[i]);
            if n > 0 {
                let _ = writeln!(
                    o,
                    "  {:<24} {:>10} {:>12.3} {:>10.1}",
                    op.name(),
                    n,
                    ns as f64 / 1e6,
                    ns as f64 / 1e3 / n as f64
                );
            }
        }
    }
    // Names longer than the pool's 24 columns widen their section's column.
    let _ = writeln!(o, "\nprocess");
    let w = name_width(s.global.iter().map(|(n, _)| n.len()));
    for (name, v) in &s.global {
        let _ = writeln!(o, "  {name:<w$} {v:>16}");
    }
    let _ = writeln!(o, "\nconfiguration");
    let w = name_width(s.config.iter().map(|(n, _)| n.len()));
    for (name, v) in &s.config {
        let _ = writeln!(o, "  {name:<w$} {v}");
    }
    o
}

/// The column of a report section's names: the longest name, at least the pool's 24.
fn name_width(lens: impl Iterator<Item = usize>) -> usize {
    lens.max().unwrap_or(0).max(24)
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// The machine-readable report (one JSON object).
pub fn render_json(s: &Snapshot) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        "{{\"pid\":{},\"rank\":{},\"status\":{},\"process\":{{",
        s.pid,
        json_str(&s.rank),
        json_str(&s.status)
    );
    let g: Vec<String> = s
        .global
        .iter()
        .map(|(k, v)| format!("{}:{v}", json_str(k)))
        .collect();
    o.push_str(&g.join(","));
    o.push_str("},\"devices\":[");
    let pools: Vec<String> = s
        .pools
        .iter()
        .map(|(dev, p)| {
            let mut f: Vec<String> = vec![format!("\"device\":{dev}")];
            f.extend(
                POOL_ROWS
                    .iter()
                    .map(|(k, get)| format!("{}:{}", json_str(k), get(p))),
            );
            let calls: Vec<String> = Op::ALL
                .iter()
                .enumerate()
                .map(|(i, op)| {
                    format!(
                        "{}:{{\"calls\":{},\"ns\":{}}}",
                        json_str(op.name()),
                        p.driver_calls[i],
                        p.driver_ns[i]
                    )
                })
                .collect();
            f.push(format!("\"driver\":{{{}}}", calls.join(",")));
            format!("{{{}}}", f.join(","))
        })
        .collect();
    o.push_str(&pools.join(","));
    o.push_str("],\"config\":{");
    let c: Vec<String> = s
        .config
        .iter()
        .map(|(k, v)| format!("{}:{}", json_str(k), json_str(v)))
        .collect();
    o.push_str(&c.join(","));
    o.push_str("}}\n");
    o
}

/// The report's JSON object with what a live query adds in front: `active` (and `why` not),
/// the library's version and path.
pub fn render_live_json(s: &Snapshot, why_not: Option<&str>, library: &str) -> String {
    let report = render_json(s);
    let mut o = format!(
        "{{\"active\":{},\"version\":{},\"library\":{},",
        why_not.is_none(),
        json_str(env!("CARGO_PKG_VERSION")),
        json_str(library)
    );
    if let Some(w) = why_not {
        let _ = write!(o, "\"why\":{},", json_str(w));
    }
    o.push_str(report.trim_end().strip_prefix('{').unwrap_or(&report));
    o
}

/// Write the table to the expanded path and the JSON next to it (`.json` appended).
/// `stderr` as the path prints the table to standard error instead.
pub fn write_report(template: &str, s: &Snapshot) -> std::io::Result<()> {
    use std::io::Write;
    if template == "stderr" {
        return std::io::stderr().write_all(render_table(s).as_bytes());
    }
    let path = expand_path(template, s.pid, &s.rank);
    write_no_follow(&path, &render_table(s))?;
    write_no_follow(&format!("{path}.json"), &render_json(s))
}

/// Create (or truncate) a file the process writes for its user (a report, a trace), never
/// through a symbolic link (a link planted at its path must not make the process overwrite
/// what it points to).
pub fn create_no_follow(path: &str) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o644)
        .open(path)
}

/// Write a report file, never through a symbolic link.
fn write_no_follow(path: &str, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    create_no_follow(path)?.write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_never_written_through_a_symlink() {
        let dir = std::env::temp_dir().join(format!("expseg-report-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let link = dir.join("r.txt");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(write_no_follow(link.to_str().unwrap(), "report").is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        let plain = dir.join("plain.txt");
        write_no_follow(plain.to_str().unwrap(), "report").unwrap();
        assert_eq!(std::fs::read_to_string(&plain).unwrap(), "report");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn placeholders_expand() {
        assert_eq!(expand_path("/tmp/r-%p-%r.txt", 42, "3"), "/tmp/r-42-3.txt");
        assert_eq!(expand_path("100%%-%x-%", 1, "0"), "100%-%x-%");
    }

    #[test]
    fn report_renders_table_and_valid_looking_json() {
        let mut p = PoolStats {
            allocs: 3,
            peak_held_bytes: 3 << 20,
            ..Default::default()
        };
        p.driver_calls[0] = 2;
        p.driver_ns[0] = 5000;
        let s = Snapshot::take(
            "pool active".into(),
            vec![("EXPSEG_LOG", "w\"arn".into())],
            vec![(0, p)],
        );
        let t = render_table(&s);
        assert!(t.contains("device 0 pool") && t.contains("cuMemCreate") && t.contains("3.0 MiB"));
        let j = render_json(&s);
        assert!(
            j.contains("\"allocs\":3") && j.contains("\"cuMemCreate\":{\"calls\":2,\"ns\":5000}")
        );
        assert!(j.contains("\"EXPSEG_LOG\":\"w\\\"arn\""));
        assert_eq!(j.matches('{').count(), j.matches('}').count());
    }

    #[test]
    fn live_json_is_the_report_with_active_and_why_in_front() {
        let s = Snapshot::take(
            "pool active".into(),
            vec![],
            vec![(0, PoolStats::default())],
        );
        let on = render_live_json(&s, None, "/x/lib\"expseg.so");
        assert!(on.starts_with("{\"active\":true,\"version\":"), "{on}");
        assert!(on.contains("\"library\":\"/x/lib\\\"expseg.so\""), "{on}");
        assert!(!on.contains("\"why\"") && on.contains("\"devices\":[{\"device\":0"));
        assert!(on.ends_with("}}") && !on.contains('\n'), "{on}");
        assert_eq!(on.matches('{').count(), on.matches('}').count());
        let off = render_live_json(&s, Some("disabled by EXPSEG_DISABLE"), "");
        assert!(off.starts_with("{\"active\":false,"));
        assert!(off.contains("\"why\":\"disabled by EXPSEG_DISABLE\""));
        assert_eq!(off.matches('{').count(), off.matches('}').count());
    }
}
