//! The `expseg` command line as a user meets it: help for every command, the same text from
//! `expseg help CMD` and `expseg CMD --help`, one line with a hint and exit status 2 for what
//! it cannot read, and a way of finding processes that finds none saying so. (Pausing a live
//! process, with sizes for people and `--json`, is in tests/preload.rs: it needs the fake
//! runtime.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A directory of this test's own, empty at the start.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `expseg ARGS` with PATH cut down to the system's and its sockets in a directory of its own
/// (no expseg process of this user is found there).
fn expseg(args: &[&str]) -> Output {
    expseg_with(args, &[])
}

fn expseg_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    // Shared by the tests running in parallel: made, never emptied.
    let ipc = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-ipc");
    std::fs::create_dir_all(&ipc).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_expseg"));
    c.args(args)
        .env_remove("LD_PRELOAD")
        .env("PATH", "/usr/bin:/bin")
        .env("EXPSEG_IPC_DIR", &ipc);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn help_and_version_print_on_stdout_and_exit_0() {
    for args in [&["--help"][..], &["-h"], &["help"]] {
        let o = expseg(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}");
        let text = out(&o);
        assert!(
            text.starts_with("usage: expseg COMMAND"),
            "{args:?}: {text}"
        );
        for cmd in ["doctor", "pause", "resume", "paused", "glibc", "help"] {
            assert!(
                text.contains(&format!("\n  {cmd} ")),
                "{cmd} listed: {text}"
            );
        }
        assert!(
            text.contains("expseg-run CMD") && !text.contains("scripts/"),
            "{text}"
        );
    }
    for args in [&["--version"][..], &["-V"]] {
        let o = expseg(args);
        assert_eq!(o.status.code(), Some(0));
        assert_eq!(out(&o), format!("expseg {}\n", env!("CARGO_PKG_VERSION")));
    }
}

#[test]
fn help_cmd_and_cmd_help_say_the_same() {
    for cmd in ["doctor", "pause", "resume", "paused", "glibc"] {
        let a = expseg(&["help", cmd]);
        let b = expseg(&[cmd, "--help"]);
        let c = expseg(&[cmd, "-h"]);
        for o in [&a, &b, &c] {
            assert_eq!(o.status.code(), Some(0), "{cmd}: {}", err(o));
            assert_eq!(err(o), "", "{cmd}");
        }
        assert!(
            out(&a).starts_with(&format!("usage: expseg {cmd}")),
            "{}",
            out(&a)
        );
        assert_eq!(out(&a), out(&b), "{cmd}");
        assert_eq!(out(&a), out(&c), "{cmd}");
    }
    // Help wins wherever it is on the line, as with git and cargo.
    let o = expseg(&["pause", "123", "--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(out(&o), out(&expseg(&["help", "pause"])));
    let text = out(&expseg(&["help", "pause"]));
    assert!(
        text.contains("--json") && text.contains("16.2 GiB"),
        "{text}"
    );
}

/// One line on stderr, nothing on stdout, exit status 2.
fn refused(args: &[&str], line: &str) {
    let o = expseg(args);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {}", err(&o));
    assert_eq!(out(&o), "", "{args:?}");
    assert_eq!(err(&o), format!("{line}\n"), "{args:?}");
}

#[test]
fn what_it_cannot_read_is_named_in_one_line_with_a_hint() {
    refused(
        &["frobnicate"],
        "expseg: unknown command 'frobnicate' (see 'expseg --help')",
    );
    refused(
        &["help", "frobnicate"],
        "expseg: unknown command 'frobnicate' (see 'expseg --help')",
    );
    refused(
        &["--frobnicate"],
        "expseg: unknown option '--frobnicate' (see 'expseg --help')",
    );
    refused(
        &["pause", "--frob"],
        "expseg pause: unknown option '--frob' (see 'expseg pause --help')",
    );
    refused(
        &["paused", "12x"],
        "expseg paused: unknown argument '12x' (see 'expseg paused --help')",
    );
    refused(
        &["resume", "--discard", "1"],
        "expseg resume: unknown option '--discard' (see 'expseg resume --help')",
    );
    refused(
        &["doctor", "now"],
        "expseg doctor: unknown argument 'now' (see 'expseg doctor --help')",
    );
    refused(
        &["glibc"],
        "expseg glibc: FILE missing (see 'expseg glibc --help')",
    );
    refused(
        &["pause", "--tag"],
        "expseg pause: --tag needs a name (see 'expseg pause --help')",
    );
    refused(
        &["resume"],
        "expseg resume: name the processes: PID..., --all, --tree PID or --gpu N (see 'expseg resume --help')",
    );
    // No command at all: the whole help, on stderr.
    let o = expseg(&[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(err(&o).starts_with("usage: expseg COMMAND"));
}

#[test]
fn a_way_of_finding_processes_that_finds_none_says_so() {
    let o = expseg(&["paused", "--all"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(out(&o), "");
    assert_eq!(err(&o), "expseg paused: --all: no expseg process found\n");

    let o = expseg(&["pause", "--tree", "999999999"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        err(&o),
        "expseg pause: --tree 999999999: no expseg process found (there is no process 999999999)\n"
    );

    // A tree that exists but holds no expseg process: its members are skipped, then the line.
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id().to_string();
    let o = expseg(&["resume", "--tree", &pid, "--json"]);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(out(&o), "", "--json: nothing answered, no object");
    let e = err(&o);
    assert!(
        e.ends_with(&format!(
            "expseg resume: --tree {pid}: no expseg process found\n"
        )),
        "{e}"
    );

    // --gpu: nvidia-smi lists no process on the GPU (a stand-in), or cannot run at all.
    let bin = scratch("fake-smi");
    let smi = bin.join("nvidia-smi");
    std::fs::write(
        &smi,
        "#!/bin/sh\ncase \"$1\" in --query-gpu=*) echo '0, GPU-aaaa' ;; esac\n",
    )
    .unwrap();
    Command::new("chmod").arg("+x").arg(&smi).status().unwrap();
    let path = format!("{}:/usr/bin:/bin", bin.display());
    let o = expseg_with(&["paused", "--gpu", "0"], &[("PATH", &path)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err(&o).starts_with(
            "expseg paused: --gpu 0: no expseg process found (nvidia-smi lists no process on GPU 0"
        ),
        "{}",
        err(&o)
    );
    let o = expseg_with(&["paused", "--gpu", "0"], &[("PATH", "/nonexistent")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err(&o)
            .starts_with("expseg paused: --gpu 0: no expseg process found (cannot run nvidia-smi"),
        "{}",
        err(&o)
    );
    // Several ways: each that finds none says so, in one line.
    let o = expseg(&["paused", "--all", "--tree", "999999999"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(err(&o).lines().count(), 2, "{}", err(&o));
}

#[test]
fn a_named_process_that_does_not_answer_is_a_failure_in_either_form() {
    // A live process that is no expseg process: no answer.
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id().to_string();
    let plain = expseg(&["paused", &pid]);
    let json = expseg(&["paused", &pid, "--json"]);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(plain.status.code(), Some(1));
    assert!(
        err(&plain).starts_with(&format!("pid {pid}: paused failed: no answer")),
        "{}",
        err(&plain)
    );
    assert_eq!(json.status.code(), Some(1));
    let line = out(&json);
    assert!(
        line.starts_with(&format!(
            "{{\"pid\":{pid},\"command\":\"paused\",\"error\":\"no answer"
        )) && line.ends_with(",\"bytes\":0}\n"),
        "{line}"
    );
}

#[test]
fn a_named_process_that_does_not_exist_is_said_plainly() {
    for cmd in ["pause", "resume", "paused"] {
        let o = expseg(&[cmd, "999999999"]);
        assert_eq!(o.status.code(), Some(1), "{cmd}");
        assert_eq!(out(&o), "", "{cmd}");
        assert_eq!(
            err(&o),
            format!("pid 999999999: {cmd} failed: no such process\n")
        );
        let o = expseg(&[cmd, "999999999", "--json"]);
        assert_eq!(o.status.code(), Some(1), "{cmd}");
        assert_eq!(
            out(&o),
            format!(
                "{{\"pid\":999999999,\"command\":\"{cmd}\",\"error\":\"no such process\",\"bytes\":0}}\n"
            )
        );
    }
    // Numbers that would name process groups to kill(2), not a process.
    for pid in ["0", "4000000000"] {
        let o = expseg(&["paused", pid]);
        assert_eq!(o.status.code(), Some(1), "{pid}");
        assert_eq!(
            err(&o),
            format!("pid {pid}: paused failed: no such process\n")
        );
    }
}

/// `expseg doctor` in this test's environment plus `env` (whatever the machine: the
/// configuration's rows do not need a GPU); exit 0 or 1.
fn doctor(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut all = vec!["doctor"];
    all.extend_from_slice(args);
    let o = expseg_with(&all, env);
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "{:?}: {}",
        o.status,
        err(&o)
    );
    o
}

/// The findings are the doctor's output; on stderr at most the lines of the configuration's
/// own reading, where a working driver's lookups reach expseg's hooks in the doctor.
fn only_config_lines(o: &Output) {
    let e = err(o);
    assert!(e.lines().all(|l| l.starts_with("expseg: ")), "{e}");
}

#[test]
fn doctor_names_a_misspelled_variable_with_the_closest_one() {
    let o = doctor(&[], &[("EXPSEG_DISABEL", "1"), ("EXPSEG_LOG", "debug")]);
    let text = out(&o);
    only_config_lines(&o);
    let row = text
        .lines()
        .find(|l| l.starts_with("EXPSEG_DISABEL "))
        .unwrap_or_else(|| panic!("no row: {text}"));
    assert!(
        row.contains(" warn ")
            && row.ends_with(
                "EXPSEG_DISABEL is not an expseg variable (did you mean EXPSEG_DISABLE?); ignored"
            ),
        "{row}"
    );
    // Known names (the tools' too), and an empty value, say nothing.
    let o = doctor(
        &[],
        &[
            ("EXPSEG_LIB", "/nonexistent/libexpseg.so"),
            ("EXPSEG_REPORT_DIR", "/tmp"),
            ("EXPSEG_DISABEL", ""),
        ],
    );
    assert!(!out(&o).contains("not an expseg variable"), "{}", out(&o));
}

#[test]
fn doctor_says_its_verdict_and_problems_first_and_defaults_last() {
    let o = doctor(
        &[],
        &[
            ("EXPSEG_DISABEL", "1"),
            ("EXPSEG_CACHE_MAX", "lots"),
            ("EXPSEG_LOG", "debug"),
        ],
    );
    let text = out(&o);
    let lines: Vec<&str> = text.lines().collect();
    let works = o.status.code() == Some(0);
    // Two warnings of the configuration's, and whatever the machine has.
    assert!(
        if works {
            lines[0].starts_with("expseg can work here, with ")
                && lines[0].ends_with(" warnings (below).")
        } else {
            lines[0]
                == "expseg cannot work here (FAIL lines); programs run under it pass everything through."
        },
        "{text}"
    );
    let at = |what: &dyn Fn(&str) -> bool| {
        lines
            .iter()
            .position(|l| what(l))
            .unwrap_or_else(|| panic!("{text}"))
    };
    let problems = at(&|l| l.starts_with("problems "));
    let bad = at(&|l| l.starts_with("EXPSEG_CACHE_MAX ") && l.contains(" warn "));
    let unknown = at(&|l| l.starts_with("EXPSEG_DISABEL "));
    let glibc = at(&|l| l.starts_with("glibc (system) "));
    let set = at(&|l| l.starts_with("EXPSEG_LOG ") && l.ends_with(" debug"));
    let default = at(&|l| l.starts_with("EXPSEG_DISABLE ") && l.ends_with("false (default)"));
    assert!(
        problems < bad && bad < glibc && unknown < glibc && glibc < set && set < default,
        "{text}"
    );
    // Every row once, every default after every row that is not one.
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.starts_with("EXPSEG_CACHE_MAX "))
            .count(),
        1
    );
    let first_default = at(&|l| l.ends_with(" (default)"));
    assert!(
        lines[first_default..]
            .iter()
            .all(|l| l.ends_with(" (default)")),
        "{text}"
    );
    // Without problems, no problems table.
    let o = doctor(&[], &[]);
    if o.status.code() == Some(0) {
        assert!(!out(&o).contains("\nproblems "), "{}", out(&o));
    }
}

#[test]
fn doctor_json_is_one_object_with_the_verdict_reasons_checks_and_configuration() {
    let o = doctor(
        &["--json"],
        &[("EXPSEG_DISABEL", "1"), ("EXPSEG_CACHE_MAX", "lots")],
    );
    let text = out(&o);
    only_config_lines(&o);
    assert_eq!(text.lines().count(), 1, "{text}");
    let obj = text.trim_end();
    json::check(obj).unwrap_or_else(|e| panic!("{e}: {obj}"));
    let works = o.status.code() == Some(0);
    assert!(
        obj.starts_with(if works {
            "{\"verdict\":\"warn\",\"works\":true,"
        } else {
            "{\"verdict\":\"fail\",\"works\":false,"
        }),
        "{obj}"
    );
    for part in [
        "\"reasons\":[",
        "{\"check\":\"EXPSEG_DISABEL\",\"verdict\":\"warn\",\"value\":\"EXPSEG_DISABEL is not an expseg variable (did you mean EXPSEG_DISABLE?); ignored\"}",
        "\"checks\":[{\"check\":\"glibc (system)\",\"verdict\":\"info\",\"value\":",
        "{\"variable\":\"EXPSEG_CACHE_MAX\",\"value\":\"0\",\"set\":true,\"problem\":\"invalid EXPSEG_CACHE_MAX=\\\"lots\\\"",
        "{\"variable\":\"EXPSEG_DISABLE\",\"value\":\"false\",\"set\":false}",
        "\"unknown_variables\":[{\"variable\":\"EXPSEG_DISABEL\",\"did_you_mean\":\"EXPSEG_DISABLE\"}]",
    ] {
        assert!(obj.contains(part), "{part} in {obj}");
    }
    // The same verdict and exit status as the table; --json with anything else is refused.
    assert_eq!(doctor(&[], &[]).status, doctor(&["--json"], &[]).status);
    refused(
        &["doctor", "--json", "--frob"],
        "expseg doctor: unknown option '--frob' (see 'expseg doctor --help')",
    );
}

/// A JSON syntax check (no dependencies): one value, nothing after it.
mod json {
    pub fn check(s: &str) -> Result<(), String> {
        let b = s.as_bytes();
        let end = value(b, ws(b, 0))?;
        match ws(b, end) == b.len() {
            true => Ok(()),
            false => Err(format!("text after the value at {end}")),
        }
    }

    fn ws(b: &[u8], mut i: usize) -> usize {
        while i < b.len() && b" \t\r\n".contains(&b[i]) {
            i += 1;
        }
        i
    }

    fn value(b: &[u8], i: usize) -> Result<usize, String> {
        let lit = |w: &[u8]| match b[i..].starts_with(w) {
            true => Ok(i + w.len()),
            false => Err(format!("bad literal at {i}")),
        };
        match b.get(i) {
            Some(b'{') => seq(b, i, b'}', true),
            Some(b'[') => seq(b, i, b']', false),
            Some(b'"') => string(b, i),
            Some(b't') => lit(b"true"),
            Some(b'f') => lit(b"false"),
            Some(b'n') => lit(b"null"),
            Some(c) if c.is_ascii_digit() || *c == b'-' => {
                let mut j = i + 1;
                while j < b.len() && (b[j].is_ascii_digit() || b"+-.eE".contains(&b[j])) {
                    j += 1;
                }
                Ok(j)
            }
            _ => Err(format!("no value at {i}")),
        }
    }

    fn string(b: &[u8], mut i: usize) -> Result<usize, String> {
        i += 1;
        while i < b.len() {
            match b[i] {
                b'"' => return Ok(i + 1),
                b'\\' => match b.get(i + 1) {
                    Some(b'u') => i += 6,
                    Some(c) if b"\"\\/bfnrt".contains(c) => i += 2,
                    _ => return Err(format!("bad escape at {i}")),
                },
                c if c < 0x20 => return Err(format!("control character at {i}")),
                _ => i += 1,
            }
        }
        Err("unterminated string".into())
    }

    /// An object (`pairs`: string keys and a colon before each value) or an array.
    fn seq(b: &[u8], i: usize, close: u8, pairs: bool) -> Result<usize, String> {
        let mut i = ws(b, i + 1);
        if b.get(i) == Some(&close) {
            return Ok(i + 1);
        }
        loop {
            if pairs {
                if b.get(i) != Some(&b'"') {
                    return Err(format!("no key at {i}"));
                }
                i = ws(b, string(b, i)?);
                if b.get(i) != Some(&b':') {
                    return Err(format!("no colon at {i}"));
                }
                i = ws(b, i + 1);
            }
            i = ws(b, value(b, i)?);
            match b.get(i) {
                Some(b',') => i = ws(b, i + 1),
                Some(c) if *c == close => return Ok(i + 1),
                _ => return Err(format!("expected , or {} at {i}", close as char)),
            }
        }
    }
}
