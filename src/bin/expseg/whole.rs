//! `expseg pause` of a whole process: the driver's process checkpoint
//! (`expseg::real::checkpoint`) locks it, so that every thread's CUDA calls wait and the work it
//! submitted ends, then copies all its device memory to host memory and releases its GPU
//! resources; `expseg resume` restores them at the same addresses and unlocks it. Nothing of
//! the program runs on the GPU meanwhile, so a busy program is paused exactly.

use expseg::real::checkpoint::{Checkpoint, State, NOT_INITIALIZED, TIMEOUT};
use std::collections::HashMap;
use std::time::Instant;

/// A whole-process pause done: its parts' times in seconds.
pub(super) struct Paused {
    pub lock: f64,
    pub copy: f64,
    /// Already checkpointed before this call: nothing was done.
    pub already: bool,
}

/// Why a process was not paused, resumed or asked.
pub(super) struct Failure {
    pub why: String,
    /// The process has no CUDA in it (a launcher, a data loader): skipped where found, not named.
    pub no_cuda: bool,
    /// No expseg in it answers (a whole pause asks it first): skipped where found.
    pub no_expseg: bool,
}

impl Failure {
    fn new(why: String) -> Failure {
        Failure {
            why,
            no_cuda: false,
            no_expseg: false,
        }
    }
}

/// `pid`'s state, or why it has none.
fn state(ck: &Checkpoint, pid: u32) -> Result<State, Failure> {
    ck.state(pid).map_err(|e| match e {
        NOT_INITIALIZED => Failure {
            why: "no CUDA in this process (yet)".into(),
            no_cuda: true,
            no_expseg: false,
        },
        e => Failure::new(format!(
            "the driver cannot tell its state ({})",
            ck.error_name(e)
        )),
    })
}

/// Lock `pid` within `timeout_ms`, then checkpoint it, where it runs CUDA and `may` agrees.
/// Where a step fails, the process is left running as it was (unlocked again after a failed
/// checkpoint).
pub(super) fn pause(
    ck: &Checkpoint,
    pid: u32,
    timeout_ms: u32,
    may: impl FnOnce() -> Result<(), Failure>,
) -> Result<Paused, Failure> {
    match state(ck, pid)? {
        State::Running => may()?,
        State::Checkpointed => {
            return Ok(Paused {
                lock: 0.0,
                copy: 0.0,
                already: true,
            })
        }
        State::Locked => {
            return Err(Failure::new(
                "another tool holds it locked (cuda-checkpoint?): not paused".into(),
            ))
        }
        s => {
            return Err(Failure::new(format!(
                "not paused: the driver reports it {s:?}"
            )))
        }
    }
    let t0 = Instant::now();
    if let Err(e) = ck.lock(pid, timeout_ms) {
        let why = match e {
            TIMEOUT => format!(
                "not paused: its CUDA calls and queued work did not come to a stop within {:.1} s (a kernel that runs long, or a thread waiting inside a CUDA call for something that needs this process to run on); nothing changed, try again or raise --timeout",
                timeout_ms as f64 / 1e3
            ),
            e => format!("not paused: the driver refused to lock it ({}); nothing changed", ck.error_name(e)),
        };
        return Err(Failure::new(why));
    }
    let lock = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    if let Err(e) = ck.checkpoint(pid) {
        let back = match ck.unlock(pid) {
            Ok(()) => "it was unlocked and runs on".to_string(),
            Err(u) => format!(
                "unlocking it failed too ({}): it stays locked, run 'expseg resume {pid}'",
                ck.error_name(u)
            ),
        };
        return Err(Failure::new(format!(
            "not paused: the driver could not checkpoint it ({}; the driver does not checkpoint UVM memory, and some drivers no memory shared by IPC); {back}",
            ck.error_name(e)
        )));
    }
    Ok(Paused {
        lock,
        copy: t1.elapsed().as_secs_f64(),
        already: false,
    })
}

/// Restore and unlock `pid` where the driver holds it: the seconds it took, or None where the
/// driver does not hold it (a pause of the pool alone, or none, for the caller's other path).
pub(super) fn resume(ck: &Checkpoint, pid: u32) -> Result<Option<f64>, Failure> {
    let t0 = Instant::now();
    match state(ck, pid)? {
        State::Running => return Ok(None),
        State::Checkpointed => {
            if let Err(e) = ck.restore(pid) {
                let now = ck.state(pid).map_or("unknown".into(), |s| format!("{s:?}"));
                return Err(Failure::new(format!(
                    "the driver could not restore it ({}; not enough free GPU memory?); its state is now {now}: resume again once memory is free",
                    ck.error_name(e)
                )));
            }
        }
        State::Locked => {}
        s => {
            return Err(Failure::new(format!(
                "the driver reports it {s:?}: it cannot be resumed"
            )))
        }
    }
    ck.unlock(pid).map_err(|e| {
        Failure::new(format!(
            "restored, but unlocking failed ({})",
            ck.error_name(e)
        ))
    })?;
    Ok(Some(t0.elapsed().as_secs_f64()))
}

/// Whether the driver holds `pid` paused (checkpointed or locked); None where it cannot say.
pub(super) fn held(ck: &Checkpoint, pid: u32) -> Option<State> {
    match ck.state(pid) {
        Ok(s @ (State::Checkpointed | State::Locked | State::Failed)) => Some(s),
        _ => None,
    }
}

/// GPU memory each process uses, as `nvidia-smi` lists it (bytes; empty where it cannot run or
/// does not see the processes, as in some containers).
pub(super) fn used_memory() -> HashMap<u32, u64> {
    let Ok(out) = std::process::Command::new("nvidia-smi")
        .args([
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ])
        .output()
    else {
        return HashMap::new();
    };
    parse_used(&String::from_utf8_lossy(&out.stdout))
}

/// `nvidia-smi`'s "pid, MiB" lines, summed per process (one line per GPU it uses).
fn parse_used(text: &str) -> HashMap<u32, u64> {
    let mut m = HashMap::new();
    for (p, mib) in text.lines().filter_map(|l| l.split_once(',')) {
        if let (Ok(p), Ok(mib)) = (p.trim().parse::<u32>(), mib.trim().parse::<u64>()) {
            *m.entry(p).or_insert(0) += mib << 20;
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvidia_smi_lines_are_summed_per_process() {
        let m = parse_used("4242, 1024\n4243, 10\n4242, 2048\n[N/A], 5\nbad\n");
        assert_eq!(m.get(&4242), Some(&(3072u64 << 20)));
        assert_eq!(m.get(&4243), Some(&(10u64 << 20)));
        assert_eq!(m.len(), 2);
    }
}
