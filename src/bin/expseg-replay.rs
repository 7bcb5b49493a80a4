//! expseg-replay [--every N] TRACE...
//!
//! Replays coalescer traces (recorded with `EXPSEG_TEST_TRACE=PREFIX` by a library built with
//! the cargo feature `test-switches`: one `PREFIX.<pid>.trace` per process) on the fake driver,
//! one coalescer per device, under the coalescing configuration of this process's `EXPSEG_*`
//! variables (so `EXPSEG_SPLIT_TAIL=0 expseg-replay t.trace` measures that policy on the same
//! calls). `REPLAY_MEM_GIB` (default 140) is each fake device's memory. Prints one line of JSON
//! per trace at its end, and with `--every N` one after every N events too.

use expseg::coalesce::replay::Replay;
use expseg::coalesce::CoalesceConfig;
use expseg::config::Config;
use std::io::Write;
use std::process::ExitCode;

const HELP: &str = "\
usage: expseg-replay [--every N] TRACE...

Replays coalescer traces (EXPSEG_TEST_TRACE=PREFIX writes PREFIX.<pid>.trace in builds with
the cargo feature test-switches) on the fake driver under the EXPSEG_* configuration of this
environment (EXPSEG_SPLIT_TAIL, EXPSEG_COMPACT, EXPSEG_COALESCE_MAX, EXPSEG_GROW_AHEAD,
EXPSEG_RELEASE_DELAY, ...), and prints one line of JSON per trace: events, peak stranded,
held and beyond bytes, moves, driver calls per kind. REPLAY_MEM_GIB: each fake device's
memory in GiB (default 140).

  --every N   also print the figures after every N events (\"at_end\":false)
";

fn main() -> ExitCode {
    // The coalescer's own lines (EXPSEG_LOG, as in the library: stranded handles, cuts), on
    // stderr.
    env_logger::Builder::new()
        .parse_filters(&std::env::var("EXPSEG_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    let mut every = None;
    let mut files = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "-h" | "--help" => {
                print!("{HELP}");
                return ExitCode::SUCCESS;
            }
            "--every" => match args.next().and_then(|n| n.parse::<u64>().ok()) {
                Some(n) if n > 0 => every = Some(n),
                _ => return usage("--every takes a number of events above 0"),
            },
            s if s.starts_with("--every=") => match s["--every=".len()..].parse::<u64>() {
                Ok(n) if n > 0 => every = Some(n),
                _ => return usage("--every takes a number of events above 0"),
            },
            s if s.starts_with('-') && s != "-" => return usage(&format!("unknown option {s}")),
            _ => files.push(a),
        }
    }
    if files.is_empty() {
        return usage("no trace given");
    }
    let gib = match std::env::var("REPLAY_MEM_GIB") {
        Err(_) => 140,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(g) if (1..=1 << 20).contains(&g) => g,
            _ => return usage(&format!("REPLAY_MEM_GIB={v:?} is not a number of GiB")),
        },
    };
    let config = Config::from_env();
    let cfg = CoalesceConfig::from_config(&config, true);
    let mut failed = false;
    for file in &files {
        let input: Box<dyn std::io::Read> = match file.as_str() {
            "-" => Box::new(std::io::stdin()),
            path => match std::fs::File::open(path) {
                Ok(f) => Box::new(f),
                Err(e) => {
                    eprintln!("expseg-replay: {path}: {e}");
                    failed = true;
                    continue;
                }
            },
        };
        let mut replay = Replay::new(cfg, config.pause_keep_host.keeps(), gib << 30);
        let out = std::io::stdout();
        let read = replay.read(std::io::BufReader::new(input), every, |s| {
            let _ = writeln!(out.lock(), "{}", s.json(Some(file), false));
        });
        if let Err(e) = read {
            eprintln!("expseg-replay: {file}: reading stopped: {e}");
            failed = true;
        }
        let s = replay.summary();
        if s.skipped > 0 {
            eprintln!(
                "expseg-replay: {file}: {} lines skipped (first: {})",
                s.skipped,
                s.first_skipped.as_deref().unwrap_or("?")
            );
        }
        let _ = writeln!(out.lock(), "{}", s.json(Some(file), true));
    }
    match failed {
        true => ExitCode::FAILURE,
        false => ExitCode::SUCCESS,
    }
}

fn usage(why: &str) -> ExitCode {
    eprintln!("expseg-replay: {why}\n{HELP}");
    ExitCode::from(2)
}
