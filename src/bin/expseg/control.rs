//! `expseg pause|resume|paused`: the processes named or found (`--tree`, `--gpu`, `--all`), one
//! request each over their sockets (`expseg::ipc::control`), one line per answer, for people or
//! as JSON lines.

use super::bad_usage;
use super::whole;
use std::path::Path;
use std::process::ExitCode;

/// Bytes for people: `512 B`, `64.0 MiB`, `16.2 GiB`.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A JSON string literal.
pub(super) fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// A way of finding processes other than naming them, and what it found.
struct Selector {
    /// As the user wrote it: `--all`, `--tree 42`, `--gpu 0`.
    label: String,
    pids: Vec<u32>,
    /// Why it may have found nothing, for the "no expseg process found" line.
    hint: Option<String>,
}

/// `expseg pause|resume|paused`: one request per process, one line per answer.
pub(super) fn control(cmd: &str, args: &[String]) -> ExitCode {
    use expseg::ipc::control::{self, Control};
    use expseg::ipc::sockdir::current_uid;
    use expseg::ipc::transport::AskError;
    let (mut tag, mut discard, mut all, mut json) = (None, false, false, false);
    let (mut pool, mut force, mut timeout_ms) = (false, false, 10_000u32);
    // Processes named by PID must answer; those found by --tree, --gpu or --all may be no
    // expseg process of the user's (a launcher, a data loader worker, another user's job on
    // the GPU): skipped with a note, not failures.
    let mut named: Vec<u32> = Vec::new();
    let mut selectors: Vec<Selector> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--discard" if cmd == "pause" => discard = true,
            "--pool" => pool = true,
            "--force" if cmd == "pause" => force = true,
            "--timeout" if cmd == "pause" => match it.next().and_then(|t| t.parse::<f64>().ok()) {
                Some(t) if t > 0.0 && t <= 3600.0 => timeout_ms = (t * 1e3).round() as u32,
                _ => return bad_usage(Some(cmd), "--timeout needs seconds (0 < S <= 3600)"),
            },
            "--json" => json = true,
            "--all" => all = true,
            "--tag" if cmd != "paused" => match it.next() {
                Some(t) if !t.is_empty() && !t.starts_with('-') => {
                    tag = Some(expseg::api::sleep::tag_of(t))
                }
                _ => return bad_usage(Some(cmd), "--tag needs a name"),
            },
            "--tree" => match it.next().and_then(|p| p.parse::<u32>().ok()) {
                Some(p) => {
                    let exists = Path::new(&format!("/proc/{p}")).exists();
                    selectors.push(Selector {
                        label: format!("--tree {p}"),
                        pids: if exists { tree(p) } else { Vec::new() },
                        hint: (!exists).then(|| format!("there is no process {p}")),
                    });
                }
                None => return bad_usage(Some(cmd), "--tree needs a PID"),
            },
            "--gpu" => match it.next() {
                Some(g) if !g.starts_with('-') => {
                    let (pids, hint) = match on_gpu(g) {
                        Ok(p) if p.is_empty() => (p, Some(format!("nvidia-smi lists no process on GPU {g}; in a container it may not see them: name the PIDs"))),
                        Ok(p) => (p, None),
                        Err(e) => (Vec::new(), Some(e)),
                    };
                    selectors.push(Selector {
                        label: format!("--gpu {g}"),
                        pids,
                        hint,
                    });
                }
                _ => return bad_usage(Some(cmd), "--gpu needs an index or a UUID"),
            },
            p => match p.parse::<u32>() {
                Ok(p) => named.push(p),
                Err(_) if p.starts_with('-') => {
                    return bad_usage(Some(cmd), &format!("unknown option '{p}'"))
                }
                Err(_) => return bad_usage(Some(cmd), &format!("unknown argument '{p}'")),
            },
        }
    }
    let uid = current_uid();
    if all {
        // Sockets of processes that are gone (killed before they could remove theirs) are
        // not processes of the user's any more: skipped.
        let alive = |p: &u32| Path::new(&format!("/proc/{p}")).exists();
        selectors.push(Selector {
            label: "--all".into(),
            pids: expseg::ipc::reclaim::peers(uid, std::process::id())
                .into_iter()
                .filter(alive)
                .collect(),
            hint: None,
        });
    }
    if named.is_empty() && selectors.is_empty() {
        return bad_usage(
            Some(cmd),
            "name the processes: PID..., --all, --tree PID or --gpu N",
        );
    }
    let mut pids: Vec<u32> = named
        .iter()
        .chain(selectors.iter().flat_map(|s| s.pids.iter()))
        .copied()
        .collect();
    pids.sort_unstable();
    pids.dedup();
    // A pause is of the whole process (the driver's checkpoint) unless it is of the pool alone:
    // --pool, or what only the pool has (--discard, --tag).
    let whole_pause = cmd == "pause" && !pool && !discard && tag.is_none();
    // The driver's checkpoint, looked for at the first process that exists and is the user's
    // (so "no such process" comes first). resume and paused: the driver's state first, where
    // it can say; a pause without it fails, naming --pool.
    let mut ck: Option<Result<expseg::real::checkpoint::Checkpoint, String>> = None;
    let want_ck = !pool && (whole_pause || cmd != "pause");
    let used = match whole_pause {
        true => whole::used_memory(),
        false => Default::default(),
    };
    let c = match cmd {
        "pause" => Control::Pause { tag, discard },
        "resume" => Control::Resume { tag },
        _ => Control::Query,
    };
    let mut ok = true;
    let mut answered: Vec<u32> = Vec::new();
    let fail = |pid: u32, why: String, done: u64| {
        if json {
            println!(
                "{{\"pid\":{pid},\"command\":{},\"error\":{},\"bytes\":{done}}}",
                json_str(cmd),
                json_str(&why)
            );
        } else {
            eprintln!("pid {pid}: {cmd} failed: {why}");
        }
    };
    for pid in pids {
        let found = !named.contains(&pid);
        if !exists(pid) {
            if found {
                eprintln!("pid {pid}: no such process (it has exited): skipped");
            } else {
                ok = false;
                fail(pid, "no such process".into(), 0);
            }
            continue;
        }
        if let Some(owner) = owner_of(pid).filter(|o| *o != uid) {
            if found {
                eprintln!("pid {pid}: belongs to uid {owner}: skipped");
            } else {
                ok = false;
                fail(pid, format!("belongs to uid {owner}; expseg pauses and resumes only processes of your own user ({uid})"), 0);
            }
            continue;
        }
        if want_ck && ck.is_none() {
            ck = Some(expseg::real::checkpoint::Checkpoint::get());
        }
        if let (true, Some(Err(e))) = (whole_pause, &ck) {
            ok = false;
            fail(pid, format!("{e}; 'expseg pause --pool PID' pauses the expseg pool alone, of a program that runs no GPU work meanwhile"), 0);
            continue;
        }
        if let Some(Ok(ck)) = &ck {
            let done = match c {
                Control::Pause { .. } => {
                    let may = || may_pause_whole(uid, pid, force);
                    whole_line(pid, whole::pause(ck, pid, timeout_ms, may), used.get(&pid), json)
                }
                Control::Resume { .. } => match whole::resume(ck, pid) {
                    // Not held by the driver (or no CUDA it can see): the pool's resume.
                    Ok(None) => None,
                    Err(f) if f.no_cuda => None,
                    Ok(Some(s)) => {
                        match json {
                            true => println!("{{\"pid\":{pid},\"command\":\"resume\",\"mode\":\"whole\",\"seconds\":{s:.3}}}"),
                            false => println!("pid {pid}: resumed the whole process in {s:.2} s"),
                        }
                        Some(Ok(()))
                    }
                    Err(f) => Some(Err(f)),
                },
                Control::Sharing => None,
                Control::Query => whole::held(ck, pid).map(|s| {
                    match json {
                        true => println!("{{\"pid\":{pid},\"command\":\"paused\",\"mode\":\"whole\",\"state\":{}}}", json_str(&format!("{s:?}"))),
                        false => println!("pid {pid}: the whole process is paused (driver state {s:?})"),
                    }
                    Ok(())
                }),
            };
            match done {
                None => {}
                Some(Ok(())) => {
                    answered.push(pid);
                    continue;
                }
                Some(Err(f)) if f.no_cuda && found => {
                    eprintln!("pid {pid}: {}: skipped", f.why);
                    continue;
                }
                Some(Err(f)) if f.no_expseg && found => {
                    eprintln!("pid {pid}: no expseg socket answers (not an expseg process, or no GPU allocation yet): skipped");
                    continue;
                }
                Some(Err(f)) => {
                    ok = false;
                    fail(pid, f.why, 0);
                    continue;
                }
            }
        }
        let t = std::time::Instant::now();
        match control::ask(uid, pid, c, control::TIMEOUT) {
            Ok(n) => {
                answered.push(pid);
                let s = t.elapsed().as_secs_f64();
                if json {
                    let secs = match c {
                        Control::Query => String::new(),
                        _ => format!(",\"seconds\":{s:.3}"),
                    };
                    println!(
                        "{{\"pid\":{pid},\"command\":{},\"bytes\":{n}{secs}}}",
                        json_str(cmd)
                    );
                    continue;
                }
                let n = human(n);
                match c {
                    Control::Pause { .. } if beside_tms(pid) => println!("pid {pid}: paused {n} in {s:.2} s (expseg's pool only: torch_memory_saver's memory in it is its own, paused by its pause(), or with the rest by expseg pause without --pool)"),
                    Control::Pause { .. } => println!("pid {pid}: paused {n} in {s:.2} s"),
                    Control::Resume { .. } => println!("pid {pid}: resumed {n} in {s:.2} s"),
                    Control::Query | Control::Sharing => println!("pid {pid}: {n} paused"),
                }
            }
            Err(AskError::Unreachable(_)) if found => {
                eprintln!("pid {pid}: no expseg socket answers (not an expseg process, or no GPU allocation yet): skipped");
            }
            Err(e) => {
                ok = false;
                let (why, done) = match e {
                    AskError::Unreachable(e) => (format!("no answer ({e}): not an expseg process of yours, or EXPSEG_CONTROL=0 there, or it made no GPU allocation yet"), 0),
                    AskError::Refused(r, done) => (refused(c, r, done, json), done),
                    AskError::Untrusted(w) => (format!("not asked: {w}"), 0),
                    AskError::Protocol(w) => (format!("bad answer: {w}"), 0),
                };
                fail(pid, why, done);
            }
        }
    }
    let kind = match whole_pause && force {
        true => "CUDA",
        false => "expseg",
    };
    for s in &selectors {
        if !s.pids.iter().any(|p| answered.contains(p)) {
            let hint = s.hint.as_ref().map_or(String::new(), |h| format!(" ({h})"));
            eprintln!("expseg {cmd}: {}: no {kind} process found{hint}", s.label);
        }
    }
    if named.is_empty() && answered.is_empty() {
        ok = false;
    }
    match ok {
        true => ExitCode::SUCCESS,
        false => ExitCode::FAILURE,
    }
}

/// Whether process `pid` may be paused whole: its expseg says it neither maps memory another
/// process shared with it (the driver checkpoints such a process but cannot restore it) nor
/// shared its own; a process that cannot be asked (no expseg in it) only with `--force`.
fn may_pause_whole(uid: u32, pid: u32, force: bool) -> Result<(), whole::Failure> {
    use expseg::api::sharing::{IMPORTED_BIT, SHARED_BIT};
    use expseg::ipc::control::{self, Control};
    use expseg::ipc::transport::AskError;
    let no = |why: String| {
        Err(whole::Failure {
            why,
            no_cuda: false,
            no_expseg: false,
        })
    };
    // A pause from outside stays within the pid namespace (the container), --force or not.
    let same_ns = expseg::ipc::ns::own().and_then(|own| expseg::ipc::ns::check_peer(pid, own));
    if let Err(e) = same_ns {
        return no(format!("{e}: expseg pauses only processes of its own pid namespace (run it inside that container)"));
    }
    if force {
        return Ok(());
    }
    match control::ask(uid, pid, Control::Sharing, std::time::Duration::from_secs(5)) {
        Ok(bits) if bits & IMPORTED_BIT != 0 => no("it maps memory another process shared with it (IPC): the driver checkpoints such a process but cannot restore it, so it is not paused; pause it with --pool (its own pool memory), or pause the process that shared the memory".into()),
        Ok(bits) if bits & SHARED_BIT != 0 => no("it shared its memory with another process (IPC), which may map it: not paused whole; pause it with --pool (memory shared by IPC stays), or with --force once no other process maps it".into()),
        Ok(_) => Ok(()),
        Err(AskError::Unreachable(_)) => Err(whole::Failure {
            why: "no expseg in it to ask whether it maps memory another process shared with it (IPC), which the driver cannot restore: not paused; --force pauses it whole anyway".into(),
            no_cuda: false,
            no_expseg: true,
        }),
        Err(e) => no(format!("its expseg did not say whether it shares memory by IPC ({e:?}): not paused; --force pauses it whole anyway")),
    }
}

/// Whether torch_memory_saver's preload hook is loaded in `pid` (its pause line says what
/// happens to that memory).
fn beside_tms(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .is_ok_and(|m| m.contains("torch_memory_saver_hook_mode_preload"))
}

/// Print a whole-process pause's line; what the caller does next.
fn whole_line(
    pid: u32,
    r: Result<whole::Paused, whole::Failure>,
    used: Option<&u64>,
    json: bool,
) -> Option<Result<(), whole::Failure>> {
    let p = match r {
        Ok(p) => p,
        Err(f) => return Some(Err(f)),
    };
    let bytes = used.copied();
    if json {
        let b = bytes.map_or("null".to_string(), |b| b.to_string());
        println!(
            "{{\"pid\":{pid},\"command\":\"pause\",\"mode\":\"whole\",\"bytes\":{b},\"seconds\":{:.3},\"lock_seconds\":{:.3},\"copy_seconds\":{:.3},\"already\":{}}}",
            p.lock + p.copy,
            p.lock,
            p.copy,
            p.already
        );
    } else if p.already {
        println!("pid {pid}: already paused (the whole process)");
    } else {
        let what = bytes.map_or(String::new(), |b| {
            format!(", {} on the GPU before", human(b))
        });
        let tms = match beside_tms(pid) {
            true => "; torch_memory_saver's memory in it is paused too",
            false => "",
        };
        println!(
            "pid {pid}: paused the whole process{what} in {:.2} s (its work stopped in {:.2} s, memory copied out in {:.2} s){tms}",
            p.lock + p.copy,
            p.lock,
            p.copy
        );
    }
    Some(Ok(()))
}

/// Why a pause, resume or query was refused, and what was done before it (in bytes for
/// `--json`, where the answer's `bytes` carries them, for people otherwise).
fn refused(
    c: expseg::ipc::control::Control,
    r: expseg::ipc::Refusal,
    done: u64,
    json: bool,
) -> String {
    use expseg::ipc::control::Control;
    use expseg::ipc::Refusal::{Forbidden, NoMemory};
    let why = match (c, r) {
        (Control::Pause { discard: true, .. }, Forbidden) => "that process does not let its memory be discarded from outside: start it with EXPSEG_ALLOW_REMOTE_DISCARD=1, or pause without --discard (its bytes then go to host memory)".to_string(),
        (Control::Resume { .. }, NoMemory) => "not enough free GPU memory to resume all of it; what is still paused stays paused with its bytes: resume again when memory is free".to_string(),
        (Control::Pause { .. }, NoMemory) => "not enough host memory for the paused bytes (its MemAvailable or cgroup limit, less 1 GiB kept for the system): the rest stays on the GPU; free host memory or pause with --discard".to_string(),
        _ => format!("refused ({r:?}): see that process's [expseg] log lines"),
    };
    let done = if json {
        format!("{done} bytes")
    } else {
        human(done)
    };
    match c {
        Control::Pause { .. } => format!("{why} ({done} paused before the failure stay paused)"),
        Control::Resume { .. } => {
            format!("{why} ({done} resumed before the failure stay resumed)")
        }
        Control::Query | Control::Sharing => why,
    }
}

/// Whether process `pid` exists (`kill(pid, 0)` answers anything but `ESRCH`: a process of
/// another user answers `EPERM`, and one /proc does not show is still found).
fn exists(pid: u32) -> bool {
    // 0 and numbers past i32::MAX would name process groups, not a process.
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists; nothing is sent.
    p > 0
        && (unsafe { libc::kill(p, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH))
}

/// The uid that owns process `pid` (None: no such process visible).
fn owner_of(pid: u32) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid())
}

/// The processes `nvidia-smi` lists on GPU `gpu` (its index or UUID); none is an answer, a GPU
/// that is not there or an `nvidia-smi` that does not run is an error.
fn on_gpu(gpu: &str) -> Result<Vec<u32>, String> {
    let q = |args: &[&str]| -> Result<String, String> {
        let out = std::process::Command::new("nvidia-smi")
            .args(args)
            .output()
            .map_err(|e| format!("cannot run nvidia-smi: {e}"))?;
        match out.status.success() {
            true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
            false => Err(format!(
                "nvidia-smi failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
        }
    };
    let gpus = q(&["--query-gpu=index,uuid", "--format=csv,noheader"])?;
    let uuid = gpus
        .lines()
        .filter_map(|l| l.split_once(','))
        .map(|(i, u)| (i.trim(), u.trim()))
        .find(|(i, u)| *i == gpu || *u == gpu)
        .map(|(_, u)| u.to_string())
        .ok_or_else(|| format!("no GPU {gpu} (nvidia-smi lists: {})", gpus.trim()))?;
    let apps = q(&["--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"])?;
    let pids: Vec<u32> = apps
        .lines()
        .filter_map(|l| l.split_once(','))
        .filter(|(_, u)| u.trim() == uuid)
        .filter_map(|(p, _)| p.trim().parse().ok())
        .collect();
    Ok(pids)
}

/// `root` and every process descended from it.
fn tree(root: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // The name may hold spaces and parentheses: the fields follow the last ')'.
            let rest = &stat[stat.rfind(')')? + 2..];
            let ppid: u32 = rest.split(' ').nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_printed_for_people() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(64 << 20), "64.0 MiB");
        assert_eq!(human(17_421_041_664), "16.2 GiB");
        assert_eq!(human(3 << 40), "3.0 TiB");
        assert_eq!(human(u64::MAX), "16384.0 PiB");
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
