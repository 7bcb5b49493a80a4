//! Recording the coalescers' calls for replay (`EXPSEG_TEST_TRACE=PREFIX`, read only in builds
//! with the cargo feature `test-switches`): every call the api makes on a coalescer appends one
//! line ([`crate::coalesce::trace`]) to `PREFIX.<pid>.trace`, buffered, flushed every
//! [`FLUSH_EVERY`] lines and at exit (after the exit report, whose queries are the last
//! lines). `expseg-replay` replays it on the fake driver.
//!
//! The variable is read once, with the configuration. Unset, a call site costs one look at a
//! cell; in builds without the feature nothing (the check is a constant). Nothing here panics
//! or writes to stdout: a trace that cannot be written says so once on stderr and stops.

use crate::coalesce::trace::{Call, Event, Header, Outcome};
use crate::coalesce::{CoalesceConfig, Coalescer};
use crate::config::TEST_SWITCHES;
use crate::gpu::Driver;
use once_cell::sync::OnceCell;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::{Mutex, TryLockError};
use std::time::Instant;

/// Lines between flushes.
const FLUSH_EVERY: u64 = 1024;

struct Tracer {
    out: BufWriter<File>,
    path: String,
    /// The process that opened the file: a forked child's copy of the buffer is never written.
    pid: u32,
    /// The first event's time.
    start: Option<Instant>,
    lines: u64,
    failed: bool,
}

static TRACER: OnceCell<Mutex<Tracer>> = OnceCell::new();

impl Tracer {
    fn write(&mut self, e: Event<'_>) {
        if self.failed || std::process::id() != self.pid {
            return;
        }
        if let Err(err) = writeln!(self.out, "{e}") {
            return self.fail(err);
        }
        self.lines += 1;
        if self.lines.is_multiple_of(FLUSH_EVERY) {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.failed || std::process::id() != self.pid {
            return;
        }
        if let Err(err) = self.out.flush() {
            self.fail(err);
        }
    }

    fn fail(&mut self, err: std::io::Error) {
        self.failed = true;
        log::warn!(
            "EXPSEG_TEST_TRACE: writing {} failed ({err}); the trace stops here",
            self.path
        );
    }
}

/// The coalescers were made (with `cfg`, on the devices `granularity` lists): start the trace
/// if `EXPSEG_TEST_TRACE` asks for one (`prefix`), with its header.
pub(crate) fn begin(
    prefix: Option<&str>,
    cfg: &CoalesceConfig,
    keep_host: bool,
    granularity: &[(i32, u64)],
) {
    let Some(prefix) = prefix.filter(|_| TEST_SWITCHES) else {
        return;
    };
    let pid = std::process::id();
    let path = format!("{prefix}.{pid}.trace");
    // Never through a symbolic link, as the exit report.
    let file = match crate::stats::create_no_follow(&path) {
        Ok(f) => f,
        Err(err) => {
            log::warn!("EXPSEG_TEST_TRACE: cannot write {path} ({err}); no trace");
            return;
        }
    };
    let mut t = Tracer {
        out: BufWriter::with_capacity(1 << 16, file),
        path,
        pid,
        start: None,
        lines: 0,
        failed: false,
    };
    if let Err(err) = t
        .out
        .write_all(Header::lines(pid, cfg, keep_host, granularity).as_bytes())
    {
        t.fail(err);
    }
    t.flush();
    let _ = TRACER.set(Mutex::new(t));
}

/// `c` was called (`call`) and answered `out`: one line, if a trace is on.
#[inline]
pub(crate) fn record<D: Driver>(c: &Coalescer<D>, call: Call<'_>, out: impl Into<Outcome>) {
    if !TEST_SWITCHES {
        return;
    }
    let Some(t) = TRACER.get() else {
        return;
    };
    let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    let start = *t.start.get_or_insert(now);
    let e = Event {
        t_ns: u64::try_from(now.duration_since(start).as_nanos()).unwrap_or(u64::MAX),
        dev: c.driver().device(),
        moves: c.moves_allowed(),
        call,
        out: out.into(),
    };
    t.write(e);
}

/// At exit (or SIGTERM): write what is buffered. Waits a little for a thread that is writing,
/// then leaves its lines unwritten rather than hang the exit.
pub(crate) fn finish() {
    if !TEST_SWITCHES {
        return;
    }
    let Some(t) = TRACER.get() else {
        return;
    };
    for _ in 0..50 {
        match t.try_lock() {
            Ok(mut g) => return g.flush(),
            Err(TryLockError::Poisoned(p)) => return p.into_inner().flush(),
            Err(TryLockError::WouldBlock) => {
                std::thread::sleep(std::time::Duration::from_millis(2))
            }
        }
    }
}
