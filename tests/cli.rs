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
    let o = expseg(&["paused", "999999999"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err(&o).starts_with("pid 999999999: paused failed: no answer"),
        "{}",
        err(&o)
    );
    let o = expseg(&["paused", "999999999", "--json"]);
    assert_eq!(o.status.code(), Some(1));
    let line = out(&o);
    assert!(
        line.starts_with("{\"pid\":999999999,\"command\":\"paused\",\"error\":\"no answer")
            && line.ends_with(",\"bytes\":0}\n"),
        "{line}"
    );
}
