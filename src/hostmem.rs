//! How much host memory the process can still take without waking the kernel's OOM killer:
//! the system's `MemAvailable`, bounded by the room left under every memory limit of the
//! process's cgroup and its ancestors (v2 `memory.max`, v1 `memory.limit_in_bytes`; a
//! Slurm job or a container), where file pages the kernel can drop count as room.
//!
//! A pause pins its host copy by touching anonymous memory: under the default overcommit an
//! `mmap` past these bounds succeeds and the touching kills the process, which holds the
//! paused bytes. Asked first, the pause answers "no host memory" and pauses nothing.

use std::path::{Path, PathBuf};

/// Bytes the process can take now; `None` if nothing can be read (then nothing is refused).
pub fn available() -> Option<u64> {
    bounded(meminfo_available, cgroup_room)
}

/// A figure of `/proc/meminfo` (`system`) bounded by one of the process's cgroups (`cgroup`,
/// given `/proc/self/cgroup` and the cgroup root): the least of those that can be read.
fn bounded(
    system: impl Fn(&str) -> Option<u64>,
    cgroup: impl Fn(&str, &Path) -> Option<u64>,
) -> Option<u64> {
    let system = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| system(&t));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| cgroup(&t, Path::new("/sys/fs/cgroup")));
    match (system, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The memory the process may use at most: the host's (`MemTotal`), bounded by the
/// tightest memory limit of its cgroup and their ancestors; `None` if nothing can be read.
pub fn total() -> Option<u64> {
    bounded(|t| meminfo_field(t, "MemTotal:"), cgroup_limit)
}

/// The tightest memory limit of the cgroup that `/proc/self/cgroup` names (`text`) and its
/// ancestors, read below `root`; `None` where no limit is set.
fn cgroup_limit(text: &str, root: &Path) -> Option<u64> {
    limit_dirs(text, root)
        .into_iter()
        .filter_map(|(dir, v2)| {
            let name = if v2 {
                "memory.max"
            } else {
                "memory.limit_in_bytes"
            };
            let v: u64 = std::fs::read_to_string(dir.join(name))
                .ok()?
                .trim()
                .parse()
                .ok()?;
            (v < 1 << 60).then_some(v)
        })
        .min()
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn meminfo_available(text: &str) -> Option<u64> {
    meminfo_field(text, "MemAvailable:")
}

/// A `/proc/meminfo` field (`name` with its colon) in bytes.
fn meminfo_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The least room under the memory limits of the cgroup that `/proc/self/cgroup` names
/// (`text`) and its ancestors, read below `root`; `None` where no limit is set.
fn cgroup_room(text: &str, root: &Path) -> Option<u64> {
    let mut least: Option<u64> = None;
    for (dir, v2) in limit_dirs(text, root) {
        let room = match v2 {
            true => room_in(&dir, "memory.max", "memory.current", "inactive_file"),
            false => room_in(
                &dir,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            ),
        };
        if let Some(r) = room {
            least = Some(least.map_or(r, |l| l.min(r)));
        }
    }
    least
}

/// The directories whose limits bind the process: its cgroup's and each ancestor's, up to
/// `root` (v2: the unified hierarchy; v1: the memory controller's), with whether they are v2.
fn limit_dirs(text: &str, root: &Path) -> Vec<(PathBuf, bool)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let (base, v2) = match ctrl {
            "" => (root.to_path_buf(), true),
            c if c.split(',').any(|x| x == "memory") => (root.join("memory"), false),
            _ => continue,
        };
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            out.push((dir.clone(), v2));
            if dir == base || !dir.pop() || !dir.starts_with(&base) {
                break;
            }
        }
    }
    out
}

/// Room under one cgroup's limit: the limit less what it uses beyond reclaimable file pages.
/// `None`: no limit there (or unreadable).
fn room_in(dir: &Path, limit: &str, usage: &str, inactive: &str) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let limit: u64 = read(limit)?.trim().parse().ok()?; // "max": no limit
                                                        // v1 writes "no limit" as the largest page-aligned i64.
    if limit >= 1 << 60 {
        return None;
    }
    let usage: u64 = read(usage)?.trim().parse().ok()?;
    let reclaimable = read("memory.stat")
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(inactive)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .unwrap_or(0u64);
    Some(limit.saturating_sub(usage.saturating_sub(reclaimable)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text =
            "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(meminfo_available(text), Some(2 << 20));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn the_tightest_cgroup_limit_binds_and_dropped_file_pages_count_as_room() {
        let root = std::env::temp_dir().join(format!("expseg-hostmem-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // v2: a job limit of 16 GiB using 10 (2 of them file pages), a step without limit.
        let job = root.join("slurm/job_1");
        write(&job, "memory.max", &format!("{}\n", 16 * GIB));
        write(&job, "memory.current", &format!("{}\n", 10 * GIB));
        write(
            &job,
            "memory.stat",
            &format!("anon 1\ninactive_file {}\nactive_file 5\n", 2 * GIB),
        );
        write(&job.join("step_0"), "memory.max", "max\n");
        write(&job.join("step_0"), "memory.current", "7\n");
        write(&root, "memory.max", "max\n");
        assert_eq!(
            cgroup_room("0::/slurm/job_1/step_0\n", &root),
            Some(8 * GIB)
        );
        // No limit anywhere: none.
        assert_eq!(cgroup_room("0::/slurm\n", &root), None);
        // v1: the memory controller's hierarchy; "no limit" is a huge number.
        let v1 = root.join("memory/docker/abc");
        write(&v1, "memory.limit_in_bytes", &format!("{}\n", 4 * GIB));
        write(&v1, "memory.usage_in_bytes", &format!("{}\n", 5 * GIB));
        write(
            &v1,
            "memory.stat",
            &format!("total_inactive_file {}\n", 2 * GIB),
        );
        write(
            &root.join("memory/docker"),
            "memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        let text = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n";
        assert_eq!(cgroup_room(text, &root), Some(GIB));
        assert_eq!(cgroup_limit(text, &root), Some(4 * GIB));
        assert_eq!(
            cgroup_limit("0::/slurm/job_1/step_0\n", &root),
            Some(16 * GIB)
        );
        assert_eq!(cgroup_limit("0::/slurm\n", &root), None);
        // Over the limit by anonymous memory alone: no room, never an underflow.
        write(&v1, "memory.usage_in_bytes", &format!("{}\n", 9 * GIB));
        assert_eq!(cgroup_room(text, &root), Some(0));
        let _ = std::fs::remove_dir_all(&root);
    }
}
