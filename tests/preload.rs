//! Preload tests: build a fake versioned `libcudart.so.13` and a fake `libcuda.so.1` with the
//! system C compiler, run small C programs under `LD_PRELOAD=libexpseg.so`, and check what the
//! programs saw. The fakes hand out host memory (memfd-backed VMM), so programs check data too.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

struct Fixture {
    dir: PathBuf,
    shim: PathBuf,
}

fn cc(args: &[&str], cwd: &Path) {
    let out = Command::new("cc")
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "cc {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("preload");
        let novmm = dir.join("novmm");
        std::fs::create_dir_all(&novmm).unwrap();
        let s = |f: &str| src.join(f).to_str().unwrap().to_string();
        let d = dir.to_str().unwrap();
        // -Bsymbolic: like the real driver, the fake's own references (the function table
        // cuGetProcAddress answers from, internal calls) are its own functions, never the
        // preloaded hooks of the same names.
        cc(
            &[
                "-shared",
                "-fPIC",
                "-O1",
                "-Wl,-soname,libcuda.so.1",
                "-Wl,-Bsymbolic",
                "-o",
                "libcuda.so.1",
                &s("fake_cuda.c"),
            ],
            &dir,
        );
        cc(
            &[
                "-shared",
                "-fPIC",
                "-O1",
                "-DNO_VMM",
                "-Wl,-soname,libcuda.so.1",
                "-Wl,-Bsymbolic",
                "-o",
                "novmm/libcuda.so.1",
                &s("fake_cuda.c"),
            ],
            &dir,
        );
        let map = format!("-Wl,--version-script={}", s("cudart.map"));
        cc(
            &[
                "-shared",
                "-fPIC",
                "-O1",
                "-Wl,-soname,libcudart.so.13",
                &map,
                "-o",
                "libcudart.so.13",
                &s("fake_cudart.c"),
                "./libcuda.so.1",
            ],
            &dir,
        );
        cc(
            &[
                "-shared",
                "-fPIC",
                "-O1",
                "-o",
                "libplugin.so",
                &s("plugin.c"),
                "./libcudart.so.13",
                &format!("-Wl,-rpath,{d}"),
            ],
            &dir,
        );
        cc(
            &[
                "-O1",
                "-pthread",
                "-o",
                "prog",
                &s("prog.c"),
                "./libcudart.so.13",
                "./libcuda.so.1",
            ],
            &dir,
        );
        cc(
            &["-O1", "-o", "plugin_main", &s("plugin_main.c"), "-ldl"],
            &dir,
        );
        // A driver API program (libcuda only) and one with a static runtime (neither library).
        cc(
            &[
                "-O1",
                "-pthread",
                "-o",
                "drv",
                &s("drv.c"),
                "./libcuda.so.1",
                "-ldl",
            ],
            &dir,
        );
        cc(
            &[
                "-O1",
                "-pthread",
                "-o",
                "static_prog",
                &s("static_main.c"),
                &s("static_rt.c"),
                "-ldl",
            ],
            &dir,
        );
        for lib in ["libc10_cuda.so", "libother.so"] {
            cc(
                &[
                    "-shared",
                    "-fPIC",
                    "-O1",
                    "-o",
                    lib,
                    &s("c10_pages.c"),
                    "./libcudart.so.13",
                    "./libcuda.so.1",
                    &format!("-Wl,-rpath,{d}"),
                ],
                &dir,
            );
        }
        cc(
            &["-O1", "-o", "pages_main", &s("pages_main.c"), "-ldl"],
            &dir,
        );
        cc(&["-O1", "-o", "sockpoke", &s("sockpoke.c")], &dir);
        // `cargo test` builds the crate as an rlib only: build the cdylib of this very source,
        // with the test switches (EXPSEG_TEST_*), which builds without the feature ignore, and
        // the programs next to it (the ticket check's helper it runs, `expseg doctor`, which
        // checks the library beside it). In a target directory of its own
        // (target/test-switches/<profile>): the user's `cargo build [--release]` library,
        // which `expseg-run` picks up, is never replaced by this one, nor raced by the build.
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap();
        let profile = profile_dir.file_name().unwrap().to_os_string();
        let target = profile_dir.parent().unwrap().join("test-switches");
        let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        build
            .args(["build", "--lib", "--bins", "--quiet"])
            .args(["--features", "test-switches", "--target-dir"])
            .arg(&target)
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile == "release" {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build");
        assert!(status.success(), "cargo build --lib failed");
        let shim = target.join(&profile).join("libexpseg.so");
        assert!(
            shim.exists(),
            "{} is missing after the build",
            shim.display()
        );
        Fixture { dir, shim }
    })
}

struct Run {
    out: Output,
}

impl Run {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.stdout).into_owned()
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.out.stderr).into_owned()
    }

    /// The value of `key=` in the program's output.
    fn get(&self, key: &str) -> String {
        let pat = format!("{key}=");
        for tok in self.stdout().split_whitespace() {
            if let Some(v) = tok.strip_prefix(&pat) {
                return v.to_string();
            }
        }
        panic!(
            "no {key} in output:\n{}\nstderr:\n{}",
            self.stdout(),
            self.stderr()
        );
    }

    fn ok(self) -> Self {
        assert!(
            self.out.status.success(),
            "program failed ({:?})\nstdout:\n{}\nstderr:\n{}",
            self.out.status,
            self.stdout(),
            self.stderr()
        );
        // Nothing but the program's own key=value output on stdout.
        for tok in self.stdout().split_whitespace() {
            assert!(tok.contains('='), "stray stdout output {tok:?}");
        }
        self
    }
}

fn run_in(libdir: &Path, prog: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    let f = fixture();
    let mut c = Command::new(f.dir.join(prog));
    c.args(args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LD_LIBRARY_PATH", libdir)
        .env("LD_PRELOAD", &f.shim)
        // Driver-level service is on by default; set here too, so that every scenario checks
        // that shared-runtime programs are served once whatever the default. "<unset>"
        // removes it.
        .env("EXPSEG_DRIVER_API", "1");
    // The per-user socket directory inside the fixture (a test program killed at its limit, or
    // by its test, leaves its socket behind): /tmp stays clean. A test that names a place of
    // its own (EXPSEG_IPC_DIR, XDG_RUNTIME_DIR) gets that.
    if !env
        .iter()
        .any(|(k, _)| *k == "EXPSEG_IPC_DIR" || *k == "XDG_RUNTIME_DIR")
    {
        c.env("EXPSEG_IPC_DIR", ipc_dir(false));
    }
    for (k, v) in env {
        if *v == "<unset>" {
            c.env_remove(k);
        } else {
            c.env(k, v);
        }
    }
    Run {
        out: output_within(c, RUN_LIMIT),
    }
}

/// Where the test programs' per-user socket directories go (`EXPSEG_IPC_DIR`) instead of
/// /tmp: in the fixture, sticky and open to all (`shared`: for programs run as another user)
/// or the test user's own.
fn ipc_dir(shared: bool) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = fixture()
        .dir
        .join(if shared { "ipc-shared" } else { "ipc" });
    std::fs::create_dir_all(&dir).unwrap();
    let mode = if shared { 0o1777 } else { 0o700 };
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
    dir
}

/// The longest a test program may run: a deadlock fails its test instead of hanging the suite.
const RUN_LIMIT: std::time::Duration = std::time::Duration::from_secs(240);

/// `c.output()`, but the program (SIGKILL) and the test (panic) end after `limit`.
fn output_within(mut c: Command, limit: std::time::Duration) -> Output {
    use std::process::Stdio;
    let child = c
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run test program");
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("run test program"),
        Err(_) => {
            // SAFETY: kill(2) on the child we spawned (not reaped yet: its waiter still waits).
            unsafe { libc_kill(pid, 9) };
            // A grandchild may hold the pipes: wait a little for what was written, not for ever.
            let out = rx
                .recv_timeout(std::time::Duration::from_secs(5))
                .ok()
                .and_then(Result::ok);
            panic!(
                "test program still running after {limit:?} (killed): a deadlock?\nstdout:\n{}\nstderr:\n{}",
                out.as_ref().map_or(String::new(), |o| String::from_utf8_lossy(&o.stdout).into_owned()),
                out.as_ref().map_or(String::new(), |o| String::from_utf8_lossy(&o.stderr).into_owned()),
            );
        }
    }
}

/// Keeping opted in (the defaults give freed memory back at once): for the tests of the cache.
const KEEP: &[(&str, &str)] = &[("EXPSEG_CACHE_MAX", "1G")];

fn run(scenario: &str, env: &[(&str, &str)]) -> Run {
    run_in(&fixture().dir, "prog", &[scenario], env)
}

#[test]
fn references_are_versioned_like_the_real_runtime() {
    let f = fixture();
    let out = Command::new("readelf")
        .args(["--dyn-syms", "-W"])
        .arg(f.dir.join("prog"))
        .output();
    let Ok(out) = out else {
        eprintln!("readelf not found; skipping the version check");
        return;
    };
    let syms = String::from_utf8_lossy(&out.stdout);
    assert!(syms.contains("cudaMalloc@libcudart.so.13"), "{syms}");
}

#[test]
fn pool_serves_and_mimics_the_runtime() {
    // The defaults give freed memory back at once: the same size again is a new create, and
    // the free memory reported is the driver's alone.
    // (Whether the new range lands at the old address is the fake's mmap's choice, which the
    // process's other threads' mappings can take first under load: not asserted here.)
    let d = run("basic", &[]).ok();
    assert_eq!(
        d.get("creates_after_reuse"),
        "2",
        "released at cudaFree, created again"
    );
    assert_eq!(d.get("meminfo_free_mib"), "100");
    // Keeping opted in: the cache serves the same size with no driver call.
    let r = run("basic", KEEP).ok();
    assert_eq!(r.get("malloc_rc"), "0");
    assert_eq!(r.get("creates"), "1", "4 MiB came from cuMemCreate");
    assert_eq!(r.get("free_rc"), "0");
    assert_eq!(
        r.get("free_synced"),
        "1",
        "cudaFree waits for the device like the real call"
    );
    assert_eq!(r.get("same_ptr"), "1");
    assert_eq!(
        r.get("creates_after_reuse"),
        "1",
        "same size reused from the cache"
    );
    assert_eq!(
        (r.get("zero_rc"), r.get("zero_null")),
        ("0".into(), "1".into())
    );
    assert_eq!(
        (r.get("small_rc"), r.get("small_to_runtime")),
        ("0".into(), "1".into())
    );
    assert_eq!(r.get("small_free_rc"), "0");
    assert_eq!(
        (r.get("interior_free_rc"), r.get("interior_lasterr")),
        ("1".into(), "1".into())
    );
    assert_eq!(r.get("free_null_rc"), "0");
    assert_eq!(r.get("q_free_rc"), "0");
    assert_eq!(
        (r.get("double_free_rc"), r.get("double_lasterr")),
        ("1".into(), "1".into())
    );
    // The fake runtime reports 100 MiB free; the pool keeps 4 MiB cached for the program.
    assert_eq!(r.get("meminfo_free_mib"), "104");
    assert_eq!(
        (r.get("oom_rc"), r.get("oom_lasterr")),
        ("2".into(), "2".into())
    );
    assert_eq!(r.get("null_out_rc"), "1");
    assert_eq!(r.stderr(), "", "no noise on stderr either");
}

#[test]
fn release_and_retry_reuses_freed_memory_without_the_driver() {
    let r = run(
        "retry",
        // A bound, however small, opts into keeping: frees after a failure are kept for the
        // retry (without one, nothing is kept: pool::tests).
        &[("FAKE_CAPACITY", "16777216"), ("EXPSEG_CACHE_MAX", "1M")],
    )
    .ok();
    assert_eq!(r.get("first_try_rc"), "2");
    assert_eq!(r.get("retry_rc"), "0");
    assert_eq!(r.get("driver_calls_for_retry"), "0");
}

#[test]
fn threads_allocate_and_free_concurrently_without_corruption() {
    let r = run("threads", &[("FAKE_CAPACITY", "4294967296")]).ok();
    assert_eq!(r.get("threads_ok"), "1");
    assert_eq!(r.get("pooled"), "1");
}

#[test]
fn peer_access_reaches_existing_and_future_pool_mappings() {
    let r = run("peer", &[("FAKE_DEVICES", "2")]).ok();
    assert_eq!(
        r.get("dev1_access"),
        "2",
        "device 1's memory: device 1 only"
    );
    assert_eq!(r.get("enable_rc"), "0");
    assert_eq!(
        r.get("after_enable"),
        "3",
        "device 0 granted on the existing mapping"
    );
    assert_eq!(r.get("new_mapping"), "3", "and on a later one");
    assert_eq!(r.get("dev0_alloc"), "1", "device 0's own pool is untouched");
    assert_eq!(r.get("disable_rc"), "0");
    assert_eq!(r.get("after_disable"), "2", "revoked");
    assert_eq!(r.get("cross_free_rc"), "0");
    assert_eq!(
        r.get("device_after"),
        "0",
        "freeing device 1 memory leaves the current device alone"
    );
    assert_eq!(r.get("own_ctx_free_rc"), "0");
    assert_eq!(
        r.get("own_ctx_kept"),
        "1",
        "and a context of the program's own stays current"
    );
}

#[test]
fn a_forked_child_passes_through() {
    let r = run("fork", &[]).ok();
    assert_eq!(r.get("child_exit"), "0");
    assert_eq!(
        (r.get("child_rc"), r.get("child_to_runtime")),
        ("0".into(), "1".into())
    );
    assert_eq!(r.get("parent_free_rc"), "0");
}

#[test]
fn a_privately_loaded_runtime_is_found_with_rtld_noload() {
    let f = fixture();
    let r = run_in(&f.dir, "plugin_main", &[], &[]).ok();
    assert_eq!(r.get("plugin_malloc_rc"), "0");
    assert_eq!(r.get("plugin_pooled"), "1");
    assert_eq!(r.get("plugin_free_rc"), "0");
}

#[test]
fn off_switch_passes_everything_through() {
    let r = run("simple", &[("EXPSEG_DISABLE", "1")]).ok();
    assert_eq!(
        (r.get("malloc_rc"), r.get("to_runtime")),
        ("0".into(), "1".into())
    );
    assert_eq!(r.get("free_rc"), "0");
    assert_eq!(r.stderr(), "");
}

#[test]
fn missing_vmm_symbols_pass_through_with_one_line() {
    let f = fixture();
    let dirs = std::env::join_paths([f.dir.join("novmm"), f.dir.clone()]).unwrap();
    let r = run_in(Path::new(&dirs), "prog", &["simple"], &[]).ok();
    assert_eq!(
        (r.get("malloc_rc"), r.get("to_runtime")),
        ("0".into(), "1".into())
    );
    assert_eq!(r.get("free_rc"), "0");
    assert_eq!(
        (r.get("type_rc"), r.get("type")),
        ("0".into(), "2".into()),
        "pointer queries are the driver's answers, not CUDA_ERROR_NOT_INITIALIZED"
    );
    let err = r.stderr();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("libcuda.so.1 lacks cuMem") && err.contains("passes through"),
        "{err}"
    );
}

#[test]
fn a_device_without_vmm_passes_through_with_one_line() {
    let r = run("simple", &[("FAKE_NO_VMM_ATTR", "1")]).ok();
    assert_eq!(r.get("to_runtime"), "1");
    let err = r.stderr();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("does not support virtual memory management"),
        "{err}"
    );
}

#[test]
fn stats_say_active_only_where_the_pool_serves_and_why_not() {
    let both = |r: &Run| (r.get("before_active"), r.get("after_active"));
    let r = run("stats", &[]).ok();
    assert_eq!(both(&r), ("1".into(), "1".into()));
    for on in ["1", "on", "TRUE"] {
        let r = run("stats", &[("EXPSEG_DISABLE", on)]).ok();
        assert_eq!(both(&r), ("0".into(), "0".into()), "EXPSEG_DISABLE={on}");
        assert_eq!(r.get("after_why"), "disabled_by_EXPSEG_DISABLE");
    }
    // A word that is not a switch's: one line naming it, and the default (enabled).
    let r = run("stats", &[("EXPSEG_DISABLE", "2")]).ok();
    assert_eq!(both(&r), ("1".into(), "1".into()));
    let err = r.stderr();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("EXPSEG_DISABLE=\"2\""), "{err}");
    // A driver without the VMM calls: known before the first allocation.
    let f = fixture();
    let dirs = std::env::join_paths([f.dir.join("novmm"), f.dir.clone()]).unwrap();
    let r = run_in(Path::new(&dirs), "prog", &["stats"], &[]).ok();
    assert_eq!(both(&r), ("0".into(), "0".into()));
    assert!(r
        .get("before_why")
        .starts_with("pass-through:_libcuda.so.1_lacks_cuMem"));
    // A device without VMM: found out at its first allocation.
    let r = run("stats", &[("FAKE_NO_VMM_ATTR", "1")]).ok();
    assert_eq!(both(&r), ("1".into(), "0".into()));
    assert!(
        r.get("after_why").contains("virtual_memory_management"),
        "{}",
        r.get("after_why")
    );
}

#[test]
fn a_panic_becomes_an_error_code_not_a_crash() {
    let r = run("simple", &[("EXPSEG_TEST_PANIC", "cudaMalloc")]).ok();
    assert_eq!(
        r.get("malloc_rc"),
        "999",
        "cudaErrorUnknown, and the process lives on"
    );
    assert!(
        r.stderr().contains("internal error caught"),
        "{}",
        r.stderr()
    );
    let r = run("simple", &[("EXPSEG_TEST_PANIC", "cudaFree")]).ok();
    assert_eq!(r.get("free_rc"), "999");
}

/// The one line a process gets once a panic poisoned a lock of expseg's books.
const BOOKS_UNSURE: &str = "[expseg ERROR] a panic inside expseg may have left the books of";

#[test]
fn after_a_panic_inside_the_pools_lock_allocations_pass_through_and_old_frees_release_nothing() {
    let r = run("poisoned", &[("EXPSEG_TEST_PANIC", "pool:2")]).ok();
    assert_eq!(
        r.get("panic_rc"),
        "999",
        "the panic's own call: cudaErrorUnknown"
    );
    assert_eq!(
        (
            r.get("after_rc"),
            r.get("after_to_runtime"),
            r.get("after_pool")
        ),
        ("0".into(), "1".into(), "0".into()),
        "the next allocation is the runtime's: the pool's books are not trusted again"
    );
    assert_eq!(
        (r.get("old_free_rc"), r.get("old_data_kept")),
        ("0".into(), "1".into()),
        "a pointer the pool handed out before is freed as far as the program can tell; its memory stays"
    );
    assert_eq!(
        r.get("old_again_rc"),
        "1",
        "freeing it again is the runtime's answer to a bad pointer, as a double free"
    );
    assert_eq!(r.get("new_free_rc"), "0");
    assert_eq!(
        (r.get("released"), r.get("unmapped")),
        ("0".into(), "0".into()),
        "nothing released or unmapped on half-made books"
    );
    assert_eq!(
        r.stderr().matches(BOOKS_UNSURE).count(),
        1,
        "one line:\n{}",
        r.stderr()
    );
    assert!(r.stderr().contains("the pools"), "{}", r.stderr());
}

#[test]
fn after_a_panic_inside_the_coalescers_lock_pages_are_the_drivers_and_old_ones_stay() {
    let r = pages(
        "libc10_cuda.so",
        "poisoned",
        &[("EXPSEG_TEST_PANIC", "coalescer:9")],
    )
    .ok();
    for (k, v) in [
        ("grow_rc", "0"),
        ("panic_rc", "999"),
        ("after_grow_rc", "0"),
        // One driver create per page: not coalesced any more.
        ("after_creates", "4"),
        ("intact", "1"),
        // Given up, answered, and left as they are: no handle goes back on unsure books.
        ("old_shrink_rc", "0"),
        ("old_released", "0"),
        ("old_still_there", "1"),
        // The driver's own pages go back as natively.
        ("new_shrink_rc", "0"),
        ("new_released", "4"),
    ] {
        assert_eq!(r.get(k), v, "{k}\nstderr:\n{}", r.stderr());
    }
    assert_eq!(
        r.stderr().matches(BOOKS_UNSURE).count(),
        1,
        "{}",
        r.stderr()
    );
}

#[test]
fn a_bad_variable_gets_one_line_and_the_default() {
    let r = run("simple", &[("EXPSEG_CACHE_MAX", "lots")]).ok();
    assert_eq!(r.get("malloc_rc"), "0");
    assert_eq!(r.get("to_runtime"), "0", "the pool still runs");
    let err = r.stderr();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("EXPSEG_CACHE_MAX") && err.contains("\"lots\""),
        "{err}"
    );
}

#[test]
fn report_is_written_at_exit_with_placeholders() {
    let f = fixture();
    let dir = f.dir.join("reports");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let tpl = format!("{}/rep-%p-%r.txt", dir.display());
    run("simple", &[("EXPSEG_REPORT", &tpl), ("RANK", "3")]).ok();
    let files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let txt = files
        .iter()
        .find(|n| n.ends_with("-3.txt"))
        .expect("table written");
    let table = std::fs::read_to_string(dir.join(txt)).unwrap();
    assert!(
        table.contains("device 0 pool") && table.contains("pool active"),
        "{table}"
    );
    assert!(table.contains("cuMemCreate"), "{table}");
    let json = std::fs::read_to_string(dir.join(format!("{txt}.json"))).unwrap();
    assert!(
        json.contains("\"allocs\":1") && json.contains("\"frees\":1"),
        "{json}"
    );
}

#[test]
fn processes_that_never_touch_cuda_are_not_disturbed() {
    let f = fixture();
    let dir = f.dir.join("quiet");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new("/bin/echo")
        .arg("hello")
        .env("LD_PRELOAD", &f.shim)
        .env("EXPSEG_CACHE_MAX", "lots")
        .env("EXPSEG_REPORT", dir.join("r.txt"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "",
        "not even the bad variable"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no report");
}

#[test]
fn ipc_moves_in_place_when_cudamalloc_lands_on_the_address() {
    // Moves are opt-in (EXPSEG_IPC_MOVE_MAX): they unmap the allocation for a moment. Tickets
    // off: their one-time check makes its own cudaMalloc and cudaFree on a thread of its own,
    // which the runtime's free count below could catch (a flaky failure in .ci/run).
    let r = run(
        "ipc",
        &[
            ("FAKE_MALLOC_REUSES_VA", "1"),
            ("EXPSEG_IPC_MOVE_MAX", "20M"),
            ("EXPSEG_IPC_TICKETS", "0"),
        ],
    )
    .ok();
    assert_eq!(r.get("vmm_before"), "1");
    assert_eq!(r.get("ipc_rc"), "0");
    assert_eq!(
        r.get("same_address"),
        "1",
        "the handle opens the program's own address"
    );
    assert_eq!(r.get("vmm_after"), "0", "now standard memory");
    assert_eq!(r.get("data_ok"), "1");
    assert_eq!(
        (r.get("again_rc"), r.get("same_bytes")),
        ("0".into(), "1".into())
    );
    assert_eq!(r.get("refreshed"), "1");
    assert_eq!(r.get("write_back_seen"), "1", "truly shared both ways");
    assert_eq!(
        (r.get("free_rc"), r.get("runtime_frees")),
        ("0".into(), "1".into())
    );
    assert_eq!(r.stderr(), "", "a move is silent");
}

#[test]
fn the_line_that_says_how_shares_reach_other_processes_comes_once_a_process() {
    // A weight sync shares thousands of allocations: the first share is warned of, the rest
    // only at debug level.
    let r = run("ipc_many", &[("EXPSEG_IPC_TICKETS", "0")]).ok();
    assert_eq!(r.get("share_failures"), "0");
    let err = r.stderr();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("said for the first share only"), "{err}");
    let r = run(
        "ipc_many",
        &[("EXPSEG_IPC_TICKETS", "0"), ("EXPSEG_LOG", "expseg=debug")],
    )
    .ok();
    let shared = r.stderr().matches("is shared through a mirror").count();
    assert_eq!(shared, 3, "each share at debug level\n{}", r.stderr());
}

#[test]
fn a_plain_consumers_mirror_follows_the_programs_synchronizes_and_shared_events() {
    // Tickets off: the mirror alone. The program rewrites its buffer after the handle was
    // taken once; a context synchronize, and the record of an event it made a handle of, bring
    // the mirror up to date; the record of another event does not.
    let r = run("mirror_sync", &[("EXPSEG_IPC_TICKETS", "0")]).ok();
    for (k, v) in [
        ("stale_before", "1"),
        ("sync_rc", "0"),
        ("after_sync", "1"),
        ("event_handle_rc", "0"),
        ("record_rc", "0"),
        ("after_record", "1"),
        ("other_record_rc", "0"),
        ("other_copied", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
    // Off: the mirror keeps the copy of the handle request.
    let r = run(
        "mirror_sync",
        &[
            ("EXPSEG_IPC_TICKETS", "0"),
            ("EXPSEG_IPC_MIRROR_SYNC", "off"),
        ],
    )
    .ok();
    assert_eq!(
        (r.get("after_sync"), r.get("after_record")),
        ("0".into(), "0".into())
    );
}

#[test]
fn inside_a_torch_memory_saver_region_its_hook_serves_and_outside_the_pool() {
    let f = fixture();
    let dir = f.dir.join("tms");
    std::fs::create_dir_all(&dir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/fake_tms.c");
    cc(
        &[
            "-shared",
            "-fPIC",
            "-o",
            "libtorch_memory_saver_fake.so",
            src.to_str().unwrap(),
            "-ldl",
        ],
        &dir,
    );
    // expseg first, as expseg-run puts it.
    let preload = format!(
        "{}:{}",
        f.shim.display(),
        dir.join("libtorch_memory_saver_fake.so").display()
    );
    let r = run("tms", &[("LD_PRELOAD", &preload)]).ok();
    assert_eq!(r.get("region_tms_served"), "1", "{}", r.stderr());
    assert_eq!(
        r.get("region_pool_creates"),
        "0",
        "the hook's, not the pool's"
    );
    assert_eq!(r.get("outside_tms_served"), "1");
    assert_ne!(
        r.get("outside_pool_creates"),
        "0",
        "outside, the pool serves"
    );
    assert_eq!((r.get("free_a"), r.get("free_b")), ("0".into(), "0".into()));
    // At load, PyTorch's allocator is left alone (the hook refuses expandable segments), and
    // nothing is said in each process.
    assert_eq!(r.get("torch_conf"), "-");
    assert!(!r.stderr().contains("torch_memory_saver"), "{}", r.stderr());
    // Started by torch_memory_saver's configure_subprocess() under a parent that runs expseg:
    // the setting expseg applied there is taken back; the user's own stays.
    let conf = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True");
    let applied = ("EXPSEG_TORCH_DEFAULTS_APPLIED", "expandable_segments:True");
    let r = run("tms", &[("LD_PRELOAD", &preload), conf, applied]).ok();
    assert_eq!(r.get("torch_conf"), "-", "{}", r.stderr());
    let r = run("tms", &[("LD_PRELOAD", &preload), conf]).ok();
    assert_eq!(r.get("torch_conf"), "expandable_segments:True");
    let user = (
        "PYTORCH_CUDA_ALLOC_CONF",
        "expandable_segments:True,max_split_size_mb:64",
    );
    let r = run("tms", &[("LD_PRELOAD", &preload), user, applied]).ok();
    assert_eq!(r.get("torch_conf"), user.1);
}

#[test]
fn a_range_with_a_dma_buf_is_never_paused() {
    // NCCL's network plugins register GPU memory for RDMA with a dma-buf of the range, made
    // through the driver's lookup: a NIC may write it until the descriptor closes.
    let r = run("dmabuf", &[]).ok();
    assert_eq!(r.get("range_rc"), "0", "{}", r.stderr());
    assert_eq!(r.get("pause_rc"), "0");
    assert_eq!(
        r.get("paused_mib"),
        "32",
        "only the allocation without a dma-buf"
    );
    assert_eq!(r.get("direct_rc"), "0");
    assert_eq!(
        (r.get("p_intact"), r.get("r_intact")),
        ("1".into(), "1".into()),
        "left mapped, bytes in place"
    );
    assert_eq!(
        (r.get("resume_rc"), r.get("q_back")),
        ("0".into(), "1".into())
    );
}

#[test]
fn with_expseg_sockets_0_no_socket_is_made_at_all() {
    // A sandbox whose seccomp filter kills a process on socket(): here a socket() that aborts.
    let f = fixture();
    let dir = f.dir.join("nosocket");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("nosocket.c"),
        "#include <stdlib.h>\nint socket(int d, int t, int p) { (void)d; (void)t; (void)p; abort(); }\n",
    )
    .unwrap();
    cc(
        &["-shared", "-fPIC", "-o", "libnosocket.so", "nosocket.c"],
        &dir,
    );
    let preload = format!(
        "{}:{}",
        dir.join("libnosocket.so").display(),
        f.shim.display()
    );
    // Allocation, a handle (a mirror: no ticket), its open, a free: no socket.
    let r = run("ipc", &[("LD_PRELOAD", &preload), ("EXPSEG_SOCKETS", "0")]).ok();
    assert_eq!(r.get("ipc_rc"), "0");
    assert_eq!(r.get("data_ok"), "1", "{}", r.stderr());
    assert_eq!(
        r.get("same_address"),
        "0",
        "a mirror, not the producer's memory"
    );
    // EXPSEG_PIDFD_RESCUE=0 alone leaves the other sockets: such a sandbox kills the process.
    let r = run(
        "ipc",
        &[("LD_PRELOAD", &preload), ("EXPSEG_PIDFD_RESCUE", "0")],
    );
    assert!(!r.out.status.success(), "{}", r.stderr());
}

#[test]
fn ipc_falls_back_to_a_mirror_and_says_so_once() {
    // Tickets off: the plain mirror behaviour (tickets have their own tests).
    let r = run("ipc", &[("EXPSEG_IPC_TICKETS", "0")]).ok();
    assert_eq!(r.get("ipc_rc"), "0");
    assert_eq!(
        (r.get("same_address"), r.get("vmm_after")),
        ("0".into(), "1".into())
    );
    assert_eq!(r.get("data_ok"), "1");
    assert_eq!(
        (r.get("again_rc"), r.get("same_bytes")),
        ("0".into(), "1".into())
    );
    assert_eq!(r.get("refreshed"), "1", "each request refreshes the mirror");
    assert_eq!(
        r.get("write_back_seen"),
        "0",
        "one-way: the consumer's writes stay in the mirror"
    );
    assert_eq!(r.get("free_rc"), "0");
    // No move is tried by default: one free, the mirror's, with the allocation.
    assert_eq!(
        r.get("runtime_frees"),
        "1",
        "freeing the allocation freed its mirror"
    );
    // With moves allowed, one more: the move's cudaMalloc landed elsewhere and went back.
    let r = run(
        "ipc",
        &[("EXPSEG_IPC_TICKETS", "0"), ("EXPSEG_IPC_MOVE_MAX", "20M")],
    )
    .ok();
    assert_eq!(r.get("same_address"), "0");
    assert_eq!(r.get("runtime_frees"), "2");
    let err = r.stderr();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("mirror") && err.contains("reads a copy"),
        "{err}"
    );
}

#[test]
fn a_move_failing_at_any_step_keeps_the_data_and_still_gives_a_handle() {
    for step in [
        "sync",
        "temp_reserve",
        "temp_map",
        "unmap",
        "free_range",
        "alloc",
        "placement",
        "copy",
        "handle",
    ] {
        let r = run(
            "ipc",
            &[
                ("FAKE_MALLOC_REUSES_VA", "1"),
                ("EXPSEG_IPC_MOVE_MAX", "20M"),
                ("EXPSEG_TEST_FAIL_MOVE", step),
            ],
        )
        .ok();
        assert_eq!(r.get("ipc_rc"), "0", "{step}");
        assert_eq!(r.get("vmm_after"), "1", "{step}: restored as pool memory");
        assert_eq!(r.get("data_ok"), "1", "{step}: data intact");
        assert_eq!(r.get("refreshed"), "1", "{step}");
        assert_eq!(r.get("free_rc"), "0", "{step}");
    }
}

fn share(how: &str, extra: &[(&str, &str)]) -> Run {
    share_in("share", how, extra)
}

fn share_in(scenario: &str, how: &str, extra: &[(&str, &str)]) -> Run {
    let f = fixture();
    // One directory per distinct call (tests run in parallel and each clears its own), named
    // short: a socket's path must fit in 108 bytes.
    let tag = extra.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, (k, v)| {
        format!("{k}={v};")
            .bytes()
            .fold(h, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
    });
    let dir = f
        .dir
        .join(format!("sock-{scenario}-{how}-{:08x}", tag as u32));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prog = f.dir.join("prog");
    let mut env: Vec<(&str, &str)> = vec![("EXPSEG_IPC_DIR", dir.to_str().unwrap())];
    env.extend_from_slice(extra);
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    run_in(&f.dir, prog.to_str().unwrap(), &[scenario, how], &env)
}

/// The `n`-th value of `key` in the output (several consumers print the same keys).
fn nth(r: &Run, key: &str, n: usize) -> String {
    let pat = format!("{key}=");
    r.stdout()
        .split_whitespace()
        .filter_map(|t| t.strip_prefix(&pat).map(str::to_string))
        .nth(n)
        .unwrap_or_else(|| panic!("no {key} #{n} in:\n{}\n{}", r.stdout(), r.stderr()))
}

#[test]
fn a_consumer_running_expseg_maps_the_original_memory_through_the_ticket() {
    let reports = fixture().dir.join("ticket-reports");
    let _ = std::fs::remove_dir_all(&reports);
    std::fs::create_dir_all(&reports).unwrap();
    let template = reports.join("r-%p.txt");
    let r = share("expseg", &[("EXPSEG_REPORT", template.to_str().unwrap())]).ok();
    // The reports count tickets: issued and granted by the producer, the forged and the stale
    // one refused, one opened by a consumer.
    let mut sums = std::collections::HashMap::new();
    for e in std::fs::read_dir(&reports).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        for key in [
            "ipc_tickets_issued",
            "ipc_tickets_granted",
            "ipc_tickets_refused",
            "ipc_tickets_opened",
        ] {
            let pat = format!("\"{key}\":");
            if let Some(i) = text.find(&pat) {
                let v: u64 = text[i + pat.len()..]
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap();
                *sums.entry(key).or_insert(0) += v;
            }
        }
    }
    assert_eq!(sums.get("ipc_tickets_issued"), Some(&1), "{sums:?}");
    assert!(sums.get("ipc_tickets_granted") >= Some(&1), "{sums:?}");
    assert_eq!(sums.get("ipc_tickets_refused"), Some(&2), "{sums:?}");
    assert_eq!(sums.get("ipc_tickets_opened"), Some(&1), "{sums:?}");
    assert_eq!((r.get("get_rc"), r.get("ticket")), ("0".into(), "1".into()));
    assert_eq!(nth(&r, "open_rc", 0), "0");
    assert_eq!(nth(&r, "consumer_sees", 0), "1");
    assert_eq!(nth(&r, "close_rc", 0), "0");
    assert_eq!(r.get("producer_sees_write"), "1", "shared both ways");
    assert_eq!(nth(&r, "open_rc", 1), "400", "a forged nonce is refused");
    assert_eq!(
        nth(&r, "open_rc", 2),
        "400",
        "a freed allocation's ticket is refused"
    );
    assert!(
        r.stderr().contains("refused the ticket (Unknown)"),
        "{}",
        r.stderr()
    );
    assert!(
        r.stderr().contains("refused the ticket (Stale)"),
        "{}",
        r.stderr()
    );
}

#[test]
fn memory_opened_through_a_ticket_is_reachable_from_devices_with_peer_access() {
    // A consumer on two GPUs opens the handle on device 0. Device 1 has peer access to device
    // 0 before the open, or gets it after (and loses it again): as with legacy IPC memory of
    // device 0's context, device 1 reaches the memory while it has peer access. Bits of
    // import_access: device 0 is 1, device 1 is 2.
    for (when, keys) in [
        ("before", vec![("import_access", "3")]),
        (
            "after",
            vec![
                ("import_access", "1"),
                ("access_enabled", "3"),
                ("access_disabled", "1"),
            ],
        ),
    ] {
        let r = share("expseg", &[("FAKE_DEVICES", "2"), ("CONSUMER_PEER", when)]).ok();
        assert_eq!(nth(&r, "open_rc", 0), "0", "{when}");
        for (k, v) in keys {
            assert_eq!(
                nth(&r, k, 0),
                v,
                "{when}: {k}\n{}\n{}",
                r.stdout(),
                r.stderr()
            );
        }
        assert_eq!(nth(&r, "consumer_sees", 0), "1", "{when}");
        assert_eq!(
            r.get("producer_sees_write"),
            "1",
            "{when}: shared both ways"
        );
    }
}

#[test]
fn a_mirror_copies_after_the_work_of_devices_with_peer_access() {
    // Device 1's kernels may write device 0's allocation through peer access: the mirror a
    // plain consumer opens is copied after them (made at the first request, refreshed at the
    // second), as after device 0's own.
    let r = run("peer_mirror", &[("FAKE_DEVICES", "2")]).ok();
    for (k, v) in [
        ("enable_rc", "0"),
        ("get_rc", "0"),
        ("again_rc", "0"),
        ("stale_reads", "0"),
        ("free_rc", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

#[test]
fn another_allocators_vmm_memory_is_shared_both_ways_with_an_expseg_consumer() {
    for pieces in [None, Some("80")] {
        // Four 8 MiB mappings; then 80 of 2 MiB (the descriptors travel in two batches).
        let extra: Vec<(&str, &str)> = pieces.map(|n| ("FOREIGN_PIECES", n)).into_iter().collect();
        let r = share_in("share_foreign", "expseg", &extra).ok();
        assert_eq!((r.get("get_rc"), r.get("ticket")), ("0".into(), "1".into()));
        assert_eq!(
            (r.get("again_rc"), r.get("same_handle")),
            ("0".into(), "1".into()),
            "a second request returns the same 64 bytes"
        );
        assert_eq!(nth(&r, "open_rc", 0), "0", "{pieces:?}");
        assert_eq!(nth(&r, "consumer_sees", 0), "1", "{pieces:?}");
        assert_eq!(nth(&r, "close_rc", 0), "0", "{pieces:?}");
        assert_eq!(
            r.get("producer_sees_write"),
            "1",
            "the consumer mapped the producer's own pages ({pieces:?})"
        );
        assert_eq!(
            r.get("primary_refs"),
            "0",
            "the thread that answered the ticket keeps no reference on the primary context ({pieces:?})"
        );
    }
}

#[test]
fn a_consumer_gets_the_pages_its_open_found_even_if_the_program_swaps_one_meanwhile() {
    // The producer replaces page 2 of the shared run (bytes 0x99) while its ticket's
    // descriptors are being sent. Before, pages 2..n were looked up by address as they were
    // sent, and the consumer mapped the new page: consumer_sees 0.
    let r = share_in(
        "foreign_swap",
        "expseg",
        &[("EXPSEG_TEST_SLOW_EXPORT", "300")],
    )
    .ok();
    for (k, v) in [
        ("get_rc", "0"),
        ("export_seen", "1"),
        ("swap_rc", "0"),
        ("swapped_in_window", "1"),
        ("open_rc", "0"),
        ("consumer_sees", "1"),
    ] {
        assert_eq!(nth(&r, k, 0), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

#[test]
fn a_plain_consumer_gets_a_mirror_of_the_whole_run_of_another_allocators_mappings() {
    let r = share_in("share_foreign", "plain", &[]).ok();
    assert_eq!((r.get("get_rc"), r.get("ticket")), ("0".into(), "1".into()));
    assert_eq!(nth(&r, "open_rc", 0), "0");
    assert_eq!(
        nth(&r, "consumer_sees", 0),
        "1",
        "all 32 MiB, four mappings"
    );
    assert_eq!(r.get("producer_sees_write"), "0", "a mirror is one-way");
    let r = share_in("share_foreign", "expseg", &[("EXPSEG_IPC_PEERS", "expseg")]).ok();
    assert_eq!(nth(&r, "consumer_sees", 0), "1");
    assert_eq!(r.get("producer_sees_write"), "1", "ticket only, no mirror");
}

#[test]
fn without_memory_for_a_mirror_the_handle_serves_expseg_consumers_and_fails_plain_ones() {
    // The runtime refuses anything above 16 MiB: no 32 MiB mirror, for another allocator's
    // run of mappings ("share_foreign") and for a pool allocation ("share").
    let low = [("FAKE_RT_MALLOC_MAX", "16777216")];
    for scenario in ["share_foreign", "share"] {
        // A consumer running expseg maps the memory itself: both ways, no mirror needed.
        let r = share_in(scenario, "expseg", &low).ok();
        assert_eq!(
            (r.get("get_rc"), r.get("ticket")),
            ("0".into(), "1".into()),
            "{scenario}: {}",
            r.stderr()
        );
        assert_eq!(nth(&r, "consumer_sees", 0), "1", "{scenario}");
        assert_eq!(r.get("producer_sees_write"), "1", "{scenario}");
        assert!(
            r.stderr()
                .contains("has no mirror: no device memory for one"),
            "{scenario}: the producer says which handle has no mirror and why: {}",
            r.stderr()
        );
        assert!(
            !r.stderr().contains("cudaIpcGetMemHandle(0x"),
            "the producer did not fail: {}",
            r.stderr()
        );
        // A plain consumer gets an error code, never wrong data.
        let r = share_in(scenario, "plain", &low).ok();
        assert_eq!(r.get("get_rc"), "0", "{scenario}");
        assert_ne!(
            nth(&r, "open_rc", 0),
            "0",
            "{scenario}: a plain consumer cannot open it"
        );
        assert_eq!(r.get("producer_sees_write"), "0");
    }
    // Without tickets there is no way to share it: out of memory in the producer, said clearly.
    let r = share_in(
        "share_foreign",
        "plain",
        &[low[0], ("EXPSEG_IPC_TICKETS", "0")],
    )
    .ok();
    assert_eq!(r.get("get_rc"), "2", "out of memory, in the producer");
    let errors: Vec<String> = r
        .stderr()
        .lines()
        .filter(|l| l.contains("[expseg ERROR]"))
        .map(str::to_string)
        .collect();
    assert!(
        !errors.is_empty() && errors.iter().all(|l| l.contains("no tickets here")),
        "a clear line: {}",
        r.stderr()
    );
    // Every consumer runs expseg (EXPSEG_IPC_PEERS=expseg): no mirror is tried at all.
    let r = share_in(
        "share_foreign",
        "expseg",
        &[low[0], ("EXPSEG_IPC_PEERS", "expseg")],
    )
    .ok();
    assert_eq!((r.get("get_rc"), r.get("ticket")), ("0".into(), "1".into()));
    assert_eq!(nth(&r, "consumer_sees", 0), "1");
    assert_eq!(r.get("producer_sees_write"), "1");
    assert_eq!(
        (r.get("again_rc"), r.get("same_handle")),
        ("0".into(), "1".into())
    );
    assert!(!r.stderr().contains("has no mirror"), "{}", r.stderr());
}

#[test]
fn a_plain_consumer_opens_the_ticketed_mirror() {
    let r = share("plain", &[]).ok();
    assert_eq!((r.get("get_rc"), r.get("ticket")), ("0".into(), "1".into()));
    assert_eq!(
        nth(&r, "open_rc", 0),
        "0",
        "the driver ignores the ticket bytes"
    );
    assert_eq!(nth(&r, "consumer_sees", 0), "1");
    assert_eq!(r.get("producer_sees_write"), "0", "a mirror is one-way");
}

#[test]
fn when_every_peer_runs_expseg_no_mirror_is_made() {
    let r = share("expseg", &[("EXPSEG_IPC_PEERS", "expseg")]).ok();
    assert_eq!((r.get("get_rc"), r.get("ticket")), ("0".into(), "1".into()));
    assert_eq!(nth(&r, "consumer_sees", 0), "1");
    assert_eq!(r.get("producer_sees_write"), "1");
    assert_eq!(nth(&r, "open_rc", 2), "400");
    assert!(!r.stderr().contains("mirror at"), "{}", r.stderr());
}

#[test]
fn only_allowed_users_map_shared_memory() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc_geteuid() } != 0 {
        eprintln!("not root: cannot start a consumer as another user; skipping");
        return;
    }
    // Default: the socket directory is closed to other users, and the fallback mirror of the
    // fake runtime is too: another user gets an error, never the memory.
    let r = share("nobody", &[]).ok();
    assert_eq!(nth(&r, "open_rc", 0), "400");
    assert_eq!(r.get("producer_sees_write"), "0");
    // Allowed by uid: the ticket maps the memory, both ways.
    let r = share("nobody", &[("EXPSEG_IPC_ALLOW_UIDS", "65534")]).ok();
    assert_eq!(nth(&r, "open_rc", 0), "0", "{}", r.stderr());
    assert_eq!(r.get("producer_sees_write"), "1");
    // Reachable but not allowed: closed by the producer's uid check before it reads a byte.
    let r = share("nobody", &[("EXPSEG_IPC_ALLOW_UIDS", "12345")]).ok();
    assert_eq!(nth(&r, "open_rc", 0), "400");
    assert!(
        r.stderr().contains("closed a connection from uid 65534"),
        "{}",
        r.stderr()
    );
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

#[test]
fn lookups_through_a_runtime_handle_reach_expseg_and_ranges_describe_the_allocation() {
    // A copy of the runtime under a wheel's hashed name, opened by the program.
    let f = fixture();
    std::fs::copy(
        f.dir.join("libcudart.so.13"),
        f.dir.join("libcudart-1a2b3c4d.so.13"),
    )
    .unwrap();
    // 2 MiB chunks: the 6 MiB allocation is three mappings, each of which the driver alone
    // would report as the range.
    let r = run(
        "lookup",
        &[("EXPSEG_IPC_TICKETS", "0"), ("EXPSEG_MAX_CHUNK", "2M")],
    )
    .ok();
    assert_eq!(
        r.get("handle_lookup_is_hook"),
        "1",
        "dlsym(libcudart handle) gives expseg's hook"
    );
    assert_eq!(
        r.get("hashed_lookup_is_hook"),
        "1",
        "dlsym on a wheel's libcudart-<hash>.so gives expseg's hook"
    );
    assert_eq!(r.get("pooled_through_handle"), "1");
    assert_eq!(r.get("ipc_through_handle_rc"), "0");
    assert_eq!(
        (r.get("range_rc"), r.get("range_ok")),
        ("0".into(), "1".into())
    );
    assert_eq!(
        (r.get("attr_rc"), r.get("attr_ok")),
        ("0".into(), "1".into())
    );
    assert_eq!(
        (
            r.get("legacy_rc"),
            r.get("legacy"),
            r.get("legacy_plural"),
            r.get("legacy_foreign")
        ),
        ("0".into(), "1".into(), "1".into(), "0".into()),
        "pool memory is legacy-IPC capable, as cuMemAlloc memory is; other VMM memory is not"
    );
    assert_eq!(
        r.get("other_lookup_ok"),
        "1",
        "other lookups, RTLD_NEXT included, untouched"
    );
}

#[test]
fn vmm_memory_of_another_allocator_is_shared_through_a_mirror() {
    let r = run("foreign", &[]).ok();
    assert_eq!(
        (r.get("foreign_rc"), r.get("lasterr")),
        ("0".into(), "0".into())
    );
    assert_eq!(
        r.get("foreign_data"),
        "1",
        "the mirror covers both mappings"
    );
    assert_eq!(r.get("foreign_again_rc"), "0");
    assert_eq!(
        (r.get("second_piece_rc"), r.get("second_piece_data")),
        ("0".into(), "1".into()),
        "a pointer in the second mapping: a handle based there"
    );
    assert_eq!(
        (r.get("same"), r.get("refreshed")),
        ("1".into(), "1".into())
    );
    assert_eq!(
        r.get("host_rc"),
        "1",
        "a host pointer still gets the runtime's error"
    );
    assert!(
        r.stderr().contains("VMM memory expseg does not own"),
        "{}",
        r.stderr()
    );
}

// ---- launching: scripts/expseg-run, expseg-srun, the report merge, expseg doctor

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(name)
}

/// Run `scripts/expseg-run env` (or another command) with a clean environment plus `extra`.
fn wrapped(cmd: &[&str], extra: &[(&str, &str)]) -> Output {
    let f = fixture();
    let mut c = Command::new(script("expseg-run"));
    c.args(cmd)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("EXPSEG_LIB", &f.shim);
    for (k, v) in extra {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn env_of(out: &Output, key: &str) -> Option<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")).map(str::to_string))
}

#[test]
fn the_wrapper_prepends_the_library_once_and_keeps_what_was_there() {
    let f = fixture();
    let lib = f.shim.to_str().unwrap();
    let dir = f.dir.join("wrap-reports");
    let d = dir.to_str().unwrap();
    let out = wrapped(&["env"], &[("EXPSEG_REPORT_DIR", d)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        env_of(&out, "LD_PRELOAD").as_deref(),
        Some(lib),
        "empty before"
    );
    let m = "/lib/x86_64-linux-gnu/libm.so.6";
    if Path::new(m).exists() {
        let out = wrapped(&["env"], &[("LD_PRELOAD", m), ("EXPSEG_REPORT_DIR", d)]);
        assert_eq!(
            env_of(&out, "LD_PRELOAD"),
            Some(format!("{lib}:{m}")),
            "existing entry kept"
        );
        let spaced = format!("{m} {m}");
        let out = wrapped(
            &["env"],
            &[("LD_PRELOAD", &spaced), ("EXPSEG_REPORT_DIR", d)],
        );
        assert_eq!(
            env_of(&out, "LD_PRELOAD"),
            Some(format!("{lib}:{spaced}")),
            "space-separated list kept"
        );
    }
    // Wrapping twice (a wrapped launcher starting wrapped workers) adds it once.
    let twice = script("expseg-run");
    let out = wrapped(
        &[twice.to_str().unwrap(), "env"],
        &[("EXPSEG_REPORT_DIR", d)],
    );
    assert_eq!(env_of(&out, "LD_PRELOAD").as_deref(), Some(lib));
    // A per-rank, per-process report path in the report directory, created.
    assert_eq!(
        env_of(&out, "EXPSEG_REPORT"),
        Some(format!("{d}/rank%r-pid%p.txt"))
    );
    assert!(dir.is_dir());
    let out = wrapped(&["env"], &[("EXPSEG_REPORT", "/x/r.txt")]);
    assert_eq!(
        env_of(&out, "EXPSEG_REPORT").as_deref(),
        Some("/x/r.txt"),
        "the user's path wins"
    );
    let out = wrapped(&["env"], &[("EXPSEG_REPORT", "none")]);
    assert_eq!(env_of(&out, "EXPSEG_REPORT"), None, "none turns it off");
}

#[test]
fn the_wrapper_sets_pytorch_defaults_only_when_none_are_set() {
    let d = fixture().dir.join("wrap-reports");
    let d = d.to_str().unwrap();
    let said = |out: &std::process::Output| {
        String::from_utf8_lossy(&out.stderr)
            .contains("PyTorch allocator set to expandable_segments:True")
    };
    // With a driver the loader finds (the fake one): expandable segments.
    let drv = fixture().dir.to_str().unwrap().to_string();
    let out = wrapped(
        &["env"],
        &[("EXPSEG_REPORT_DIR", d), ("LD_LIBRARY_PATH", &drv)],
    );
    assert_eq!(
        env_of(&out, "PYTORCH_CUDA_ALLOC_CONF").as_deref(),
        Some("expandable_segments:True")
    );
    assert!(said(&out), "one line says what was set and how to opt out");
    // Without one, expseg passes everything through: PyTorch's allocator is left alone (that
    // setting alone costs 1.2-1.44x step time), and one line says why.
    let out = wrapped(&["env"], &[("EXPSEG_REPORT_DIR", d)]);
    assert_eq!(env_of(&out, "PYTORCH_CUDA_ALLOC_CONF"), None);
    assert_eq!(env_of(&out, "EXPSEG_TORCH_DEFAULTS").as_deref(), Some("0"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("PyTorch's allocator left as it is"), "{err}");
    for var in ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"] {
        let out = wrapped(
            &["env"],
            &[("EXPSEG_REPORT_DIR", d), (var, "max_split_size_mb:128")],
        );
        assert_eq!(
            env_of(&out, var).as_deref(),
            Some("max_split_size_mb:128"),
            "the user's own setting is kept"
        );
        if var == "PYTORCH_ALLOC_CONF" {
            assert_eq!(env_of(&out, "PYTORCH_CUDA_ALLOC_CONF"), None);
        }
        assert!(!said(&out));
    }
    // Off in every spelling the configuration reads, and when expseg or coalescing is off: by
    // the wrapper, and by the library alone at load time.
    let f = fixture();
    for opt_out in [
        ("EXPSEG_TORCH_DEFAULTS", "0"),
        ("EXPSEG_TORCH_DEFAULTS", "false"),
        ("EXPSEG_TORCH_DEFAULTS", "Off"),
        ("EXPSEG_DISABLE", "1"),
        ("EXPSEG_DISABLE", "true"),
        ("EXPSEG_COALESCE", "off"),
        ("EXPSEG_COALESCE", "0"),
    ] {
        let out = wrapped(&["env"], &[("EXPSEG_REPORT_DIR", d), opt_out]);
        assert_eq!(env_of(&out, "PYTORCH_CUDA_ALLOC_CONF"), None, "{opt_out:?}");
        assert!(!said(&out), "{opt_out:?}");
        let out = Command::new("env")
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("LD_PRELOAD", &f.shim)
            .env(opt_out.0, opt_out.1)
            .output()
            .unwrap();
        assert_eq!(
            env_of(&out, "PYTORCH_CUDA_ALLOC_CONF"),
            None,
            "library, {opt_out:?}"
        );
    }
    // The library alone with nothing set applies it.
    let out = Command::new("env")
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LD_PRELOAD", &f.shim)
        .output()
        .unwrap();
    assert_eq!(
        env_of(&out, "PYTORCH_CUDA_ALLOC_CONF").as_deref(),
        Some("expandable_segments:True")
    );
}

#[test]
fn the_wrapper_fails_clearly_without_a_usable_library() {
    let out = wrapped(&["true"], &[("EXPSEG_LIB", "/nonexistent/libexpseg.so")]);
    assert_eq!(out.status.code(), Some(127));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("EXPSEG_LIB=/nonexistent/libexpseg.so"),
        "the message names the path: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Not a loadable library at all (here: a text file): the loader's reason is passed on.
    let bogus = fixture().dir.join("bogus.so");
    std::fs::write(&bogus, "not an ELF file").unwrap();
    let out = wrapped(&["true"], &[("EXPSEG_LIB", bogus.to_str().unwrap())]);
    assert_eq!(out.status.code(), Some(127));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot be preloaded"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Built for a newer glibc than this system's: a copy whose version requirement names a
    // glibc that does not exist (same length, so the ELF stays valid).
    let lib = std::fs::read(&fixture().shim).unwrap();
    let from = b"GLIBC_2.2.5\0";
    if let Some(at) = lib.windows(from.len()).position(|w| w == from) {
        let mut newer = lib.clone();
        newer[at..at + from.len()].copy_from_slice(b"GLIBC_9.9.5\0");
        let path = fixture().dir.join("newer-glibc.so");
        std::fs::write(&path, newer).unwrap();
        let out = wrapped(&["true"], &[("EXPSEG_LIB", path.to_str().unwrap())]);
        assert_eq!(out.status.code(), Some(127));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("needs a newer glibc") && err.contains("build-portable"),
            "{err}"
        );
    }
    // A path LD_PRELOAD cannot carry.
    let spaced = fixture().dir.join("with space");
    std::fs::create_dir_all(&spaced).unwrap();
    std::fs::copy(&fixture().shim, spaced.join("libexpseg.so")).unwrap();
    let out = wrapped(
        &["true"],
        &[("EXPSEG_LIB", spaced.join("libexpseg.so").to_str().unwrap())],
    );
    assert_eq!(out.status.code(), Some(127));
    assert!(String::from_utf8_lossy(&out.stderr).contains("space"));
}

#[test]
fn an_unusable_report_directory_costs_one_warning_not_the_run() {
    let out = wrapped(
        &["sh", "-c", "echo \"report=${EXPSEG_REPORT:-none}\"; exit 3"],
        &[
            ("EXPSEG_REPORT_DIR", "/proc/nope"),
            ("EXPSEG_TORCH_DEFAULTS", "0"),
        ],
    );
    assert_eq!(out.status.code(), Some(3), "the command's own exit status");
    assert_eq!(env_of(&out, "report").as_deref(), Some("none"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("expseg-run: warning: no report: cannot create /proc/nope"),
        "{err}"
    );
    // Unknown options are named; `--` lets a command start with a dash.
    let out = wrapped(&["--frob"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "expseg-run: unknown option '--frob' (see 'expseg-run --help')\n"
    );
}

#[test]
fn srun_tasks_get_rank_aware_reports_and_the_sbatch_template_parses() {
    let f = fixture();
    // A stand-in srun: runs the task once as Slurm rank 3, local rank 1.
    let bin = f.dir.join("fake-slurm");
    std::fs::create_dir_all(&bin).unwrap();
    let srun = bin.join("srun");
    std::fs::write(&srun, "#!/bin/sh\nwhile [ \"${1#-}\" != \"$1\" ]; do shift; done\nSLURM_PROCID=3 SLURM_LOCALID=1 exec \"$@\"\n").unwrap();
    Command::new("chmod").arg("+x").arg(&srun).status().unwrap();
    let dir = f.dir.join("srun-reports");
    let out = Command::new(script("expseg-srun"))
        .args(["-N1", "--", "env"])
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("EXPSEG_LIB", &f.shim)
        .env("EXPSEG_REPORT_DIR", &dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        env_of(&out, "EXPSEG_REPORT"),
        Some(format!("{}/rank3-local1-pid%p.txt", dir.display()))
    );
    assert!(env_of(&out, "LD_PRELOAD").unwrap().contains("libexpseg.so"));
    let st = Command::new("bash")
        .arg("-n")
        .arg(script("expseg.sbatch"))
        .status()
        .unwrap();
    assert!(st.success(), "bash -n expseg.sbatch");
}

#[test]
fn per_rank_reports_merge_into_one_table() {
    let f = fixture();
    let dir = f.dir.join("merge-reports");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for rank in ["0", "1"] {
        let tpl = format!("{}/rank%r-pid%p.txt", dir.display());
        run("simple", &[("EXPSEG_REPORT", &tpl), ("RANK", rank)]).ok();
    }
    let out = Command::new("python3")
        .arg(script("expseg-report-merge"))
        .arg(&dir)
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{t}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        t.lines().any(|l| l.starts_with("| 0 |")) && t.lines().any(|l| l.starts_with("| 1 |")),
        "{t}"
    );
    assert!(t.contains("| all |") && t.contains("pool active"), "{t}");
    // A process whose PyTorch pages were coalesced: its row counts them.
    let tpl = format!("{}/rank%r-pid%p.txt", dir.display());
    pages(
        "libc10_cuda.so",
        "full",
        &[("EXPSEG_REPORT", &tpl), ("RANK", "2")],
    )
    .ok();
    let out = Command::new("python3")
        .arg(script("expseg-report-merge"))
        .arg(&dir)
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&out.stdout);
    let row = t.lines().find(|l| l.starts_with("| 2 |")).expect("rank 2");
    assert!(
        t.contains("PyTorch pages") && row.contains("coalescing PyTorch's pages"),
        "{t}"
    );
    assert!(
        !row.contains("| 0 | 0 | coalescing"),
        "pages and handles counted: {row}"
    );
}

fn doctor(libdir: &Path, extra: &[(&str, &str)]) -> Output {
    let f = fixture();
    let exe = f.shim.parent().unwrap().join("expseg");
    let mut c = Command::new(exe);
    c.arg("doctor")
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LD_LIBRARY_PATH", libdir)
        .env("EXPSEG_CUDART", f.dir.join("libcudart.so.13"));
    for (k, v) in extra {
        c.env(k, v);
    }
    c.output().unwrap()
}

#[test]
fn doctor_passes_on_a_working_driver_and_names_bad_values() {
    let out = doctor(&fixture().dir, &[("EXPSEG_CACHE_MAX", "lots")]);
    let t = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("device 0 VMM") && t.contains("expseg can work here"),
        "{t}"
    );
    assert!(t.contains("ticketed IPC handle (child process)  ok"), "{t}");
    assert!(
        t.lines()
            .any(|l| l.starts_with("EXPSEG_CACHE_MAX") && l.contains("warn") && l.contains("lots")),
        "{t}"
    );
    assert!(t.contains("glibc needed by libexpseg.so"), "{t}");
    // What expseg does with released memory, and beside the others' sleep tools.
    assert!(
        t.lines()
            .any(|l| l.starts_with("released memory (EXPSEG_KEEP)")
                && l.contains("off (the default)")),
        "{t}"
    );
    assert!(
        t.contains("beside sleep tools") && t.contains("torch_memory_saver"),
        "{t}"
    );
    // Opted in where NVML cannot list the fake GPU's processes: said, per GPU.
    let out = doctor(&fixture().dir, &[("EXPSEG_KEEP", "auto")]);
    let t = String::from_utf8_lossy(&out.stdout);
    assert!(
        t.lines()
            .any(|l| l.starts_with("released memory kept, GPU 0")
                && l.contains("warn")
                && l.contains("NVML cannot list")),
        "{t}"
    );
}

#[test]
fn doctor_fails_without_vmm() {
    let f = fixture();
    let dirs = std::env::join_paths([f.dir.join("novmm"), f.dir.clone()]).unwrap();
    let out = doctor(Path::new(&dirs), &[]);
    let t = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("FAIL") && t.contains("lacks cuMem"), "{t}");
    let out = doctor(&f.dir, &[("FAKE_NO_VMM_ATTR", "1")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout)
        .contains("not supported: its allocations pass through"));
    // One device of two without VMM: a warning; expseg serves the other.
    let out = doctor(
        &f.dir,
        &[("FAKE_DEVICES", "2"), ("FAKE_NO_VMM_DEVICE", "1")],
    );
    let t = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{t}");
    assert!(
        t.lines()
            .any(|l| l.starts_with("device 1 VMM") && l.contains("warn")),
        "{t}"
    );
    assert!(t.contains("expseg can work here"), "{t}");
}

fn pages(lib: &str, what: &str, env: &[(&str, &str)]) -> Run {
    // These programs count one handle per batch from the first use on: the batch's last
    // page alone (the default EXPSEG_SPLIT_TAIL=1) and pages at new addresses alone (the
    // default EXPSEG_LEARN_CUTS=1) are asked for where a test wants them.
    let mut all = vec![
        ("FAKE_MEMINFO_REAL", "1"),
        ("FAKE_CAPACITY", "4294967296"),
        ("EXPSEG_SPLIT_TAIL", "0"),
        ("EXPSEG_LEARN_CUTS", "0"),
    ];
    all.extend_from_slice(env);
    let path = fixture().dir.join(lib);
    run_in(
        &fixture().dir,
        "pages_main",
        &[path.to_str().unwrap(), what],
        &all,
    )
}

#[test]
fn pytorchs_mappings_of_another_processs_pages_are_kept_for_the_next_open_until_the_producer_lets_them_go(
) {
    // torch.multiprocessing of expandable segments, both sides under expseg: three tensors
    // opened, read and closed three rounds. In the second round their reservations come
    // back with the pages mapped and access set: no reserve, map, access or unmap call reaches
    // the driver, and each read sees what the producer wrote last (page 0 is rewritten each
    // round). The third opens them in the other order: the guesses are wrong, the reads right. A page the producer releases, and a number it gives to another page, take the
    // views holding them; the others stay.
    let dir = fixture().dir.join("sock-views");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let r = pages(
        "libc10_cuda.so",
        "share_views",
        &[
            ("EXPSEG_IPC_DIR", dir.to_str().unwrap()),
            ("FAKE_RELEASE_MAPPED", "1"),
        ],
    )
    .ok();
    let want = [
        ("round1_right", "1"),
        ("round2_right", "1"),
        ("round3_right", "1"),
        ("round2_maps", "0"),
        ("round2_access", "0"),
        ("round2_reserves", "0"),
        ("round2_unmaps", "0"),
        // The third round opens them in the other order: right all the same.
        ("round3_reserves", "0"),
        ("reexport_rc", "0"),
        ("same_number", "1"),
        ("release_rc", "0"),
        ("released_view_gone", "1"),
        ("renumbered_view_gone", "1"),
        ("other_view_kept", "1"),
        ("ipc_views_reused", "6"),
        // Imports of pages mapped in a view already wait for a call that needs them: 4 in the
        // second round, 2 in the third (the pages whose views no wrong guess unmapped first).
        ("ipc_imports_deferred", "6"),
        ("consumer_exit", "0"),
    ];
    for (k, v) in want {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
    assert_ne!(r.get("round1_maps"), "0", "the first open maps");
    assert!(!r.stderr().contains("did not answer"), "{}", r.stderr());
    // The producer exits without freeing: the view still kept goes.
    let r = pages(
        "libc10_cuda.so",
        "share_views",
        &[
            ("EXPSEG_IPC_DIR", dir.to_str().unwrap()),
            ("FAKE_RELEASE_MAPPED", "1"),
            ("VIEWS_EXIT", "1"),
        ],
    );
    assert_eq!(
        r.get("exit_view_gone"),
        "1",
        "{}\n{}",
        r.stdout(),
        r.stderr()
    );
}

#[test]
fn with_expseg_keep_auto_released_pages_stay_kept_until_another_process_is_listed() {
    // A stand-in NVML lists the pids of the file FAKE_NVML_PIDS on the fake GPU.
    let f = fixture();
    let dir = f.dir.join("nvml");
    std::fs::create_dir_all(&dir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/fake_nvml.c");
    cc(
        &[
            "-shared",
            "-fPIC",
            "-o",
            "libnvidia-ml.so.1",
            src.to_str().unwrap(),
        ],
        &dir,
    );
    let pids = dir.join("pids");
    std::fs::write(&pids, "self\n").unwrap();
    let libs = std::env::join_paths([dir.clone(), f.dir.clone()]).unwrap();
    let report = dir.join("report.txt");
    let env = [
        ("LD_LIBRARY_PATH", libs.to_str().unwrap()),
        ("FAKE_UUID", "1"),
        ("FAKE_NVML_PIDS", pids.to_str().unwrap()),
        ("EXPSEG_KEEP", "auto"),
        ("EXPSEG_REPORT", report.to_str().unwrap()),
    ];
    let r = pages("libc10_cuda.so", "keep", &env).ok();
    // Alone on the GPU: the 8 pages released are kept (one handle of 160 MiB).
    assert_eq!(r.get("kept_mib"), "160", "{}", r.stderr());
    // Process 1 (not an expseg process of this user) is listed: given back, and from then on
    // released at once.
    assert_eq!(r.get("after_stranger_mib"), "0");
    assert_eq!(r.get("released_at_once_mib"), "0");
    let text = std::fs::read_to_string(&report).unwrap();
    assert!(
        text.contains(
            "GPU 0: releasing at once (process 1 on the GPU is not an expseg process of this user with EXPSEG_KEEP=auto)"
        ),
        "{text}"
    );
    // Without EXPSEG_KEEP=auto (the default), released at once from the start.
    std::fs::write(&pids, "self\n").unwrap();
    let r = pages("libc10_cuda.so", "keep", &env[..3]).ok();
    assert_eq!(r.get("kept_mib"), "0");
}

#[test]
fn pytorch_pages_are_coalesced_compacted_and_exported_page_by_page() {
    // Compaction is opt-in (EXPSEG_COMPACT=1).
    let r = pages("libc10_cuda.so", "full", &[("EXPSEG_COMPACT", "1")]).ok();
    for (k, v) in [
        ("grow_rc", "0"),
        ("batch_creates", "1"),
        ("batch_maps", "1"),
        ("range_rc", "0"),
        ("range_is_page", "1"),
        ("attr_is_page", "1"),
        ("shrink_rc", "0"),
        ("hidden_range_rc", "500"),
        ("hidden_range_zero", "1"),
        ("hidden_attr_rc", "1"),
        ("used_stranded_mib", "160"),
        ("used_compacted_mib", "80"),
        ("live_intact", "1"),
        ("regrow_rc", "0"),
        ("all_intact", "1"),
        ("export_rc", "0"),
        ("shared_both_ways", "1"),
        ("after_export_intact", "1"),
        ("retain_rc", "0"),
        ("same_handle", "1"),
        ("props_rc", "0"),
        ("props_dev", "0"),
        ("props_posix", "1"),
        ("release_rc", "0"),
        ("final_shrink_rc", "0"),
        ("free_va_rc", "0"),
        ("used_end", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}", r.stdout());
    }
    // The one line saying PyTorch's allocator default was applied (nothing was set).
    assert_eq!(
        r.stderr(),
        "expseg: PyTorch allocator set to expandable_segments:True (EXPSEG_TORCH_DEFAULTS=0 keeps PyTorch's default)\n"
    );
    // A monitor thread's cudaMemGetInfo moves no live page (the allocator's thread may be
    // launching work on them); the allocator's thread's next call compacts.
    let m = pages(
        "libc10_cuda.so",
        "full",
        &[("MEMINFO_THREAD", "1"), ("EXPSEG_COMPACT", "1")],
    )
    .ok();
    for (k, v) in [
        ("used_stranded_mib", "160"),
        ("used_after_other_thread_mib", "160"),
        ("used_compacted_mib", "80"),
        ("live_intact", "1"),
        ("used_end", "0"),
    ] {
        assert_eq!(m.get(k), v, "{k}\n{}", m.stdout());
    }
    // A forked child's cudaMemGetInfo leaves the parent's coalesced pages alone.
    let k = pages(
        "libc10_cuda.so",
        "full",
        &[("FORK_CHILD", "1"), ("EXPSEG_COMPACT", "1")],
    )
    .ok();
    for (k_, v) in [
        ("child_driver_calls", "0"),
        ("child_exit", "0"),
        ("used_compacted_mib", "80"),
        ("live_intact", "1"),
        ("used_end", "0"),
    ] {
        assert_eq!(k.get(k_), v, "{k_}\n{}\n{}", k.stdout(), k.stderr());
    }
    // The program's own expseg_trim() gives everything back, from whichever of its threads.
    let t = pages(
        "libc10_cuda.so",
        "full",
        &[("TRIM_THREAD", "1"), ("EXPSEG_COMPACT", "1")],
    )
    .ok();
    for (k, v) in [
        ("used_stranded_mib", "160"),
        ("trim_thread_mib", "80"),
        ("used_compacted_mib", "80"),
        ("live_intact", "1"),
        ("used_end", "0"),
    ] {
        assert_eq!(t.get(k), v, "{k}\n{}", t.stdout());
    }
    // The program's own expseg_pause() from such a thread pauses only the live pages: what is
    // held beyond them goes back first (moving nothing, it paused the whole handle: 160).
    let p = pages(
        "libc10_cuda.so",
        "full",
        &[("PAUSE_THREAD", "1"), ("EXPSEG_COMPACT", "1")],
    )
    .ok();
    for (k, v) in [
        ("pause_rc", "0"),
        ("paused_mib", "80"),
        ("resume_rc", "0"),
        ("live_intact", "1"),
        ("all_intact", "1"),
        ("used_end", "0"),
    ] {
        assert_eq!(p.get(k), v, "{k}\n{}", p.stdout());
    }
    let quiet = pages("libc10_cuda.so", "full", &[("EXPSEG_TORCH_DEFAULTS", "0")]).ok();
    assert_eq!(quiet.stderr(), "");
    assert_eq!(
        quiet.get("batch_creates"),
        "1",
        "coalescing does not depend on it"
    );
}

#[test]
fn a_page_inside_a_coalesced_handle_is_exported_as_a_copy_where_the_program_has_a_side_stream() {
    // PyTorch after torch.cuda.Stream(): a non-blocking stream no hold of a move reaches. The
    // export moves nothing: the importer maps a copy, made again at a synchronize; its own
    // writes stay there (one-way, said once).
    // Also from a thread with no context current (torch.multiprocessing's queue feeder).
    for thread in ["", "1"] {
        let mut env = vec![("SIDE_STREAM", "1")];
        if !thread.is_empty() {
            env.push(("EXPORT_THREAD", thread));
        }
        let r = pages("libc10_cuda.so", "full", &env).ok();
        for (k, v) in [
            ("side_stream_rc", "0"),
            ("export_rc", "0"),
            ("importer_sees_page", "1"),
            ("shared_both_ways", "0"),
            ("sync_rc", "0"),
            ("after_sync_seen", "1"),
            ("export_mirrors_made", "1"),
            ("export_wrong_context", "0"),
            ("coalesce_exports_split", "0"),
            ("after_export_intact", "1"),
            ("used_end", "0"),
        ] {
            assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
        }
        assert!(
            r.stderr().contains("is exported as a copy"),
            "said once: {}",
            r.stderr()
        );
    }
}

#[test]
fn an_export_that_would_split_while_a_stream_captures_a_graph_moves_nothing_then_splits_after() {
    let r = pages("libc10_cuda.so", "full", &[("CAPTURE_STREAM", "1")]).ok();
    for (k, v) in [
        ("capture_export_rc", "900"),
        ("capture_intact", "1"),
        ("coalesce_moves_refused_capture", "1"),
        ("export_rc", "0"),
        ("shared_both_ways", "1"),
        ("after_export_intact", "1"),
        ("used_end", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
    assert!(
        r.stderr().contains("captures a CUDA graph"),
        "the cause is named: {}",
        r.stderr()
    );
}

#[test]
fn other_callers_and_the_off_switch_get_the_drivers_own_pages() {
    for (lib, env) in [
        ("libother.so", vec![]),
        ("libc10_cuda.so", vec![("EXPSEG_COALESCE", "off")]),
        ("libc10_cuda.so", vec![("EXPSEG_DISABLE", "1")]),
    ] {
        let r = pages(lib, "full", &env).ok();
        assert_eq!(r.get("batch_creates"), "8", "{lib} {env:?}");
        assert_eq!(r.get("batch_maps"), "8", "{lib} {env:?}");
        assert_eq!(r.get("all_intact"), "1", "{lib} {env:?}");
        assert_eq!(r.get("shared_both_ways"), "1", "{lib} {env:?}");
        assert_eq!(r.get("used_end"), "0", "{lib} {env:?}");
        // The range attributes name the mapping (natively its reservation), as expseg's IPC
        // handle of it starts there: a raw IPC consumer's offset from RANGE_START_ADDR lands
        // in the handle. Disabled, the driver's own answer.
        let disabled = env.iter().any(|(k, _)| *k == "EXPSEG_DISABLE");
        let want = if disabled { "0" } else { "1" };
        assert_eq!(r.get("attr_is_page"), want, "{lib} {env:?}");
        assert_eq!(r.get("range_is_page"), "1", "{lib} {env:?}");
    }
    // `all` coalesces any caller of the entry points.
    let r = pages("libother.so", "full", &[("EXPSEG_COALESCE", "all")]).ok();
    assert_eq!(r.get("batch_creates"), "1");
    // ...without the line about PyTorch's allocator, which only PyTorch's lookup prints.
    assert!(!r.stderr().contains("PyTorch allocator"), "{}", r.stderr());
}

#[test]
fn coalesced_creates_run_out_of_memory_exactly_where_the_drivers_pages_do() {
    let cap = [("FAKE_CAPACITY", "268435456")];
    let native = pages("libother.so", "oom", &cap).ok();
    assert_eq!(native.get("pages_before_oom"), "12");
    for margin in ["0", "64M", "1G"] {
        let r = pages(
            "libc10_cuda.so",
            "oom",
            &[cap[0], ("EXPSEG_COALESCE_MARGIN", margin)],
        )
        .ok();
        assert_eq!(r.get("pages_before_oom"), "12", "margin {margin}");
        assert_eq!(r.get("oom_rc"), "2", "margin {margin}");
        assert_eq!(r.get("used_end"), "0", "margin {margin}");
    }
}

#[test]
fn every_device_of_a_process_is_coalesced() {
    let r = pages("libc10_cuda.so", "two", &[("FAKE_DEVICES", "2")]).ok();
    for (k, v) in [
        ("dev0_rc", "0"),
        ("dev0_creates", "1"),
        ("dev1_rc", "0"),
        ("dev1_creates", "1"),
        ("intact", "1"),
        ("shrink_rc", "0"),
        ("used_end", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}", r.stdout());
    }
}

#[test]
fn a_threads_cudamemgetinfo_moves_only_the_live_pages_of_its_own_devices() {
    // A model split over two GPUs: device 1's allocator runs in its own thread (autograd's
    // worker), which may be launching work on device 1's pages while device 0's thread asks
    // cudaMemGetInfo or frees an address range. Only device 0's pages move then; device 1's
    // at its own thread's call. (With one allocator thread per process, device 0's
    // cudaMemGetInfo compacted both: 160 MiB; then its cuMemAddressFree still did.)
    let r = pages(
        "libc10_cuda.so",
        "two_threads",
        &[("FAKE_DEVICES", "2"), ("EXPSEG_COMPACT", "1")],
    )
    .ok();
    for (k, v) in [
        ("dev1_rc", "0"),
        ("dev0_rc", "0"),
        ("used_stranded_mib", "320"),
        ("used_after_dev0_thread_mib", "240"),
        ("addrfree_rc", "0"),
        ("used_after_dev0_addrfree_mib", "240"),
        ("used_after_dev1_thread_mib", "160"),
        ("live_intact", "1"),
        ("final_shrink_rc", "0"),
        ("used_end", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

/// The name of user `uid`'s socket directory in this pid namespace, as expseg gives it
/// (`sockdir::socket_dir`): `expseg-<uid>` in the host's, `expseg-<uid>-ns<inode>` elsewhere.
fn socket_dir_name(uid: u32) -> String {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata("/proc/self/ns/pid").map(|m| m.ino()) {
        Ok(ino) if ino != 0xEFFF_FFFC => format!("expseg-{uid}-ns{ino}"),
        _ => format!("expseg-{uid}"),
    }
}

#[test]
fn a_socket_directory_name_another_user_took_is_skipped_and_all_taken_turn_tickets_off_loudly() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc_geteuid() } != 0 {
        eprintln!("not root: cannot give a directory to another user; skipping");
        return;
    }
    let f = fixture();
    // The usual name and `taken - 1` fallback names (`.1` ...) made by another user first.
    let run_with = |taken: usize, peers: Option<&str>| {
        let base = f
            .dir
            .join(format!("sockets-squatted-{taken}-{}", peers.is_some()));
        let _ = std::fs::remove_dir_all(&base);
        for n in 0..taken {
            let name = match n {
                0 => socket_dir_name(0),
                n => format!("{}.{n}", socket_dir_name(0)),
            };
            let squatted = base.join(name);
            std::fs::create_dir_all(&squatted).unwrap();
            std::os::unix::fs::chown(&squatted, Some(65534), Some(65534)).unwrap();
        }
        let mut env = vec![("EXPSEG_IPC_DIR", base.to_str().unwrap().to_string())];
        if let Some(p) = peers {
            env.push(("EXPSEG_IPC_PEERS", p.to_string()));
        }
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        run_in(
            &f.dir,
            f.dir.join("prog").to_str().unwrap(),
            &["share", "expseg"],
            &env,
        )
        .ok()
    };
    // The usual name taken: the next one serves, and consumers find it there; one warning
    // says which name was skipped and where the socket is.
    let r = run_with(1, Some("expseg"));
    assert_eq!(r.get("get_rc"), "0", "{}", r.stderr());
    assert_eq!(nth(&r, "consumer_sees", 0), "1", "{}", r.stderr());
    assert_eq!(r.get("producer_sees_write"), "1", "the memory itself");
    assert!(
        r.stderr().contains("this process's socket is in")
            && r.stderr().contains(&format!("{}.1", socket_dir_name(0))),
        "{}",
        r.stderr()
    );
    // Every name taken. Every consumer is promised the memory itself: no silent mirror, a
    // loud failure.
    let r = run_with(1 + 8, Some("expseg")); // the usual name and its 8 fallbacks
    assert_eq!(r.get("get_rc"), "801", "{}", r.stderr());
    assert!(
        r.stderr().contains("EXPSEG_IPC_PEERS=expseg needs tickets")
            && r.stderr().contains(&socket_dir_name(0)),
        "the line says why: {}",
        r.stderr()
    );
    // Otherwise a mirror, and a warning that tickets are off and why.
    let r = run_with(1 + 8, None);
    assert_eq!((r.get("get_rc"), r.get("ticket")), ("0".into(), "0".into()));
    assert_eq!(nth(&r, "consumer_sees", 0), "1");
    assert!(
        r.stderr().contains("IPC tickets disabled"),
        "{}",
        r.stderr()
    );
}

#[test]
fn every_tool_answers_help_and_a_missing_srun_is_named_before_anything_is_created() {
    let tools: Vec<(PathBuf, Vec<&str>)> = vec![
        (script("expseg-run"), vec!["--help"]),
        (script("expseg-srun"), vec!["--help"]),
        (script("expseg-report-merge"), vec!["--help"]),
        (PathBuf::from(env!("CARGO_BIN_EXE_expseg")), vec!["--help"]),
        (
            PathBuf::from(env!("CARGO_BIN_EXE_expseg")),
            vec!["doctor", "--help"],
        ),
    ];
    for (tool, args) in tools {
        let out = Command::new(&tool).args(&args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{} {args:?}: {:?}",
            tool.display(),
            out
        );
        assert!(
            text.starts_with("usage") || text.contains("\nusage"),
            "{} {args:?}: {text}",
            tool.display()
        );
    }
    let dir = fixture().dir.join("no-srun");
    let _ = std::fs::remove_dir_all(&dir);
    // A PATH of the tools the script needs and no srun (the machine may have Slurm's client).
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for tool in ["bash", "dirname", "readlink", "mkdir"] {
        let found = ["/usr/bin", "/bin"]
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("{tool} not found"));
        std::os::unix::fs::symlink(found, bin.join(tool)).unwrap();
    }
    let out = Command::new(script("expseg-srun"))
        .args(["-N1", "--", "true"])
        .current_dir(&dir)
        .env("PATH", &bin)
        .env_remove("EXPSEG_REPORT_DIR")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
    assert!(String::from_utf8_lossy(&out.stderr).contains("srun not found"));
    assert!(!dir.join("expseg-reports").exists(), "nothing created");
}

#[test]
fn handle_requests_beside_a_changing_foreign_run_never_touch_a_freed_mirror() {
    // Before: the lock was dropped during a refresh and another thread freed the mirror.
    for round in 0..3 {
        let r = run("mirror_race", &[]);
        assert!(
            r.out.status.success(),
            "round {round}: {:?}\n{}",
            r.out.status,
            r.stderr()
        );
        assert_eq!(r.get("race_done"), "1");
        let handles: u64 = r.get("handles").parse().unwrap();
        assert!(
            handles > 0,
            "round {round}: no handle was issued: the race did not run"
        );
    }
}

#[test]
fn the_one_time_ticket_check_does_not_hold_up_other_threads() {
    let f = fixture();
    let dir = f.dir.join("sockets-slow-check");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let r = run(
        "slow_check",
        &[
            ("EXPSEG_TEST_SLOW_CHECK", "1500"),
            ("EXPSEG_IPC_DIR", dir.to_str().unwrap()),
        ],
    )
    .ok();
    assert_eq!(r.get("get_rc"), "0");
    let got: f64 = r.get("get_ms").parse().unwrap();
    let worst: f64 = r.get("worst_other_ms").parse().unwrap();
    assert!(got >= 1400.0, "the check ran: {got} ms");
    assert!(
        worst < 500.0,
        "another thread's cudaMalloc waited {worst} ms"
    );
}

#[test]
fn a_handle_request_beside_the_running_ticket_check_never_waits_for_it_under_the_lock() {
    // The first request waits for the check (a hanging helper); a second thread's request
    // that needs no ticket (a move allowed by EXPSEG_IPC_MOVE_MAX, falling back to a mirror)
    // takes the pools' lock meanwhile: before, it waited there for the check, and a third
    // thread's cudaMalloc with it.
    let f = fixture();
    let dir = f.dir.join("sockets-slow-check-move");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let r = run(
        "slow_check_beside_a_move",
        &[
            ("EXPSEG_TEST_SLOW_CHECK", "1500"),
            ("EXPSEG_IPC_MOVE_MAX", "20M"),
            ("EXPSEG_IPC_DIR", dir.to_str().unwrap()),
        ],
    )
    .ok();
    assert_eq!(
        (r.get("get_rc"), r.get("second_rc")),
        ("0".into(), "0".into())
    );
    let ms = |k: &str| -> f64 { r.get(k).parse().unwrap() };
    assert!(ms("get_ms") >= 1400.0, "the check ran: {} ms", ms("get_ms"));
    assert!(
        ms("second_ms") < 500.0,
        "the second request waited {} ms for the check",
        ms("second_ms")
    );
    assert!(
        ms("worst_other_ms") < 500.0,
        "another thread's cudaMalloc waited {} ms",
        ms("worst_other_ms")
    );
}

#[test]
fn a_writer_thread_beside_a_handle_request_is_never_cut_off() {
    // Before: the default moved allocations up to 20 MiB in place, unmapping them for a
    // moment; a thread writing to one crashed. Moves are opt-in now: mirror (and ticket).
    for round in 0..3 {
        let r = run("move_race", &[("FAKE_MALLOC_REUSES_VA", "1")]);
        assert!(
            r.out.status.success(),
            "round {round}: {:?}\n{}",
            r.out.status,
            r.stderr()
        );
        assert_eq!(r.get("requests_ok"), "200");
        assert_eq!(r.get("still_pool_memory"), "1", "no move happened");
    }
}

/// `prog wait` under `env` (besides the preload), terminated with SIGTERM once it has asked
/// for its allocation: how it ended.
fn terminated(env: &[(&str, &str)]) -> std::process::ExitStatus {
    use std::io::BufRead;
    let f = fixture();
    let mut child = Command::new(f.dir.join("prog"))
        .arg("wait")
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LD_LIBRARY_PATH", &f.dir)
        .env("LD_PRELOAD", &f.shim)
        // Killed, it leaves its socket: in the fixture, not in /tmp.
        .env("EXPSEG_IPC_DIR", ipc_dir(false))
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        // What it says (a deliberate panic's message, under EXPSEG_TEST_PANIC) is not the
        // test's output.
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready=1");
    // SAFETY: sends a signal to our own child.
    unsafe {
        libc_kill(child.id() as i32, 15);
    }
    child.wait().unwrap()
}

#[test]
fn a_report_is_written_when_the_job_is_terminated() {
    use std::os::unix::process::ExitStatusExt;
    let f = fixture();
    let report = f.dir.join("term-report.txt");
    let _ = std::fs::remove_file(&report);
    let _ = std::fs::remove_file(f.dir.join("term-report.txt.json"));
    let status = terminated(&[("EXPSEG_REPORT", report.to_str().unwrap())]);
    assert_eq!(status.signal(), Some(15), "still ends by SIGTERM");
    let json = std::fs::read_to_string(f.dir.join("term-report.txt.json")).expect("report written");
    assert!(json.contains("\"allocs\":1"), "{json}");
}

#[test]
fn a_panic_reading_the_configuration_never_unwinds_into_c() {
    // Every later read of the configuration panics too: each path from C must catch it (a
    // panic leaving an `extern "C"` function aborts the process).
    use std::os::unix::process::ExitStatusExt;
    let f = fixture();
    let report = f.dir.join("config-panic-report.txt");
    let panics = [
        ("EXPSEG_TEST_PANIC", "config"),
        ("EXPSEG_REPORT", report.to_str().unwrap()),
    ];
    // The lookups (PyTorch's VMM functions through the entry point API): the driver's own
    // functions are handed out, and the program runs on them.
    let r = pages("libc10_cuda.so", "oom", &panics).ok();
    assert_ne!(r.get("pages_before_oom"), "0", "{}", r.stderr());
    assert!(
        r.stderr().contains("internal error caught"),
        "{}",
        r.stderr()
    );
    // The hooks, and the report at exit.
    let r = run("simple", &panics).ok();
    assert_eq!(r.get("malloc_rc"), "999");
    // The report on SIGTERM: still death by SIGTERM, not an abort.
    let status = terminated(&[("ANY_RC", "1"), panics[0], panics[1]]);
    assert_eq!(status.signal(), Some(15), "{status:?}");
    // A pidfd_getfd the kernel refuses: its refusal, not an abort.
    if let Some(r) = pages_unprivileged("share_fd_nodump", &panics[..1]) {
        let r = r.ok();
        assert_eq!(r.get("consumer_exit"), "0", "{}", r.stderr());
        assert_eq!(r.get("getfd_errno"), libc::EPERM.to_string());
    }
}

#[test]
fn a_panic_in_the_thread_that_gives_kept_handles_back_is_caught_and_said() {
    let r = pages(
        "libc10_cuda.so",
        "oom",
        &[
            ("EXPSEG_TEST_PANIC", "releaser"),
            ("EXPSEG_RELEASE_DELAY", "5"),
        ],
    )
    .ok();
    assert!(
        r.stderr().contains(
            "expseg-release: internal error caught; kept handles are no longer given back"
        ),
        "{}",
        r.stderr()
    );
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

#[test]
fn the_mirror_of_a_foreign_run_goes_when_its_allocator_unmaps_it() {
    let r = run("foreign_unmap", &[]).ok();
    assert_eq!(r.get("get_rc"), "0");
    assert_eq!(r.get("mirror_freed"), "1", "{}", r.stderr());
}

#[test]
fn unmapping_through_the_vmm_hook_ends_the_shares_of_pages_it_passes_through() {
    let r = run("foreign_unmap_hooked", &[("EXPSEG_COALESCE", "all")]).ok();
    assert_eq!(
        r.get("hooked"),
        "1",
        "the entry point API gave expseg's hook"
    );
    assert_eq!(r.get("get_rc"), "0");
    assert_eq!(r.get("mirror_freed"), "1", "{}", r.stderr());
}

#[test]
fn a_panic_in_a_vmm_hook_becomes_an_error_code_and_one_line() {
    let r = pages(
        "libc10_cuda.so",
        "oom",
        &[("EXPSEG_TEST_PANIC", "cuMemCreate")],
    )
    .ok();
    assert_eq!(r.get("pages_before_oom"), "0");
    assert_eq!(
        r.get("oom_rc"),
        "999",
        "CUDA_ERROR_UNKNOWN, the process lives on"
    );
    assert!(
        r.stderr()
            .contains("cuMemCreate: internal error caught; returning CUDA_ERROR_UNKNOWN"),
        "{}",
        r.stderr()
    );
}

#[test]
fn a_mirror_refresh_waits_for_the_device_without_holding_up_allocations_or_frees() {
    let f = fixture();
    let dir = f.dir.join("sockets-refresh-wait");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for round in 0..3 {
        let r = run("refresh_wait", &[("EXPSEG_IPC_DIR", dir.to_str().unwrap())]);
        assert!(
            r.out.status.success(),
            "round {round}: {:?}\n{}",
            r.out.status,
            r.stderr()
        );
        assert_eq!(r.get("refresh_rc"), "0");
        let took: f64 = r.get("refresh_ms").parse().unwrap();
        let worst: f64 = r.get("worst_malloc_ms").parse().unwrap();
        assert!(
            took >= 380.0,
            "the refresh waited for the device: {took} ms"
        );
        assert!(
            worst < 200.0,
            "round {round}: a cudaMalloc waited {worst} ms"
        );
        assert_eq!(r.get("free_rc"), "0");
        // A first mirror: allocated under the lock, copied without it.
        assert_eq!(r.get("first_rc"), "0");
        let took: f64 = r.get("first_ms").parse().unwrap();
        let worst: f64 = r.get("first_worst_malloc_ms").parse().unwrap();
        assert!(
            took >= 380.0,
            "the first mirror waited for the device: {took} ms"
        );
        assert!(
            worst < 200.0,
            "round {round}: a cudaMalloc waited {worst} ms beside a first mirror"
        );
    }
}

/// `pages_main` with libc10_cuda.so, two fake devices, the scenario `two_random` or
/// `two_recycle` at release delay `delay`: every step, every page checked, books empty at the
/// end, no driver call made from another device's context.
fn two_devices(scenario: &str, delay: &str, steps: &str) -> Run {
    let r = pages(
        "libc10_cuda.so",
        scenario,
        &[("FAKE_DEVICES", "2"), ("EXPSEG_RELEASE_DELAY", delay)],
    );
    assert!(
        r.out.status.success(),
        "{scenario} {delay}: {:?}\n{}",
        r.out.status,
        r.stderr()
    );
    assert_eq!(r.get("two_steps"), steps, "{scenario} {delay}");
    assert_eq!(r.get("two_bad"), "0", "{scenario} {delay}: {}", r.stderr());
    assert_eq!(r.get("used_end"), "0", "{scenario} {delay}");
    assert_eq!(
        r.get("wrong_context"),
        "0",
        "{scenario} {delay}: {}",
        r.stderr()
    );
    r
}

#[test]
fn a_handle_for_one_devices_pages_leaves_the_other_devices_paused_pages_alone() {
    // Before, cudaIpcGetMemHandle on device 0's pages went through every device's coalescer
    // and woke device 1's paused pages (paused_after=0).
    let r = pages(
        "libc10_cuda.so",
        "two_isolate",
        &[("FAKE_DEVICES", "2"), ("EXPSEG_IPC_PEERS", "expseg")],
    )
    .ok();
    let four = ((4u64 * 20) << 20).to_string();
    for (k, v) in [
        ("dev0_rc", "0"),
        ("dev1_rc", "0"),
        ("pause_rc", "0"),
        ("paused_before", four.as_str()),
        ("paused_after", four.as_str()),
        ("resume_rc", "0"),
        ("intact", "1"),
        ("shrink_rc", "0"),
        ("used_end", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

#[test]
fn two_devices_coalesced_in_one_process_keep_their_data() {
    // Both devices coalesced (the default since 2026-11-24): the bookkeeping across devices,
    // checked granule by granule on the fake driver. The program never switches devices (as
    // PyTorch empties every device's cache from one thread): every driver call for a
    // device's memory is still made in that device's context. At release at once, and with
    // released handles kept (opt-in), as the defaults of 2026-11-23 did.
    for delay in ["0", "2", "60000"] {
        two_devices("two_random", delay, "400");
    }
}

#[test]
fn two_devices_whose_segment_ranges_travel_between_them_keep_their_data() {
    // A device's freed segment range reserved again by the other device (as the driver may
    // hand it out), at release at once and with released handles kept.
    for delay in ["0", "60000"] {
        let r = two_devices("two_recycle", delay, "300");
        let moved: u32 = r.get("moved").parse().unwrap();
        assert!(moved > 0, "{delay}: no range travelled: {}", r.stdout());
    }
}

/// `pages_main` with libc10_cuda.so as a user without ptrace rights over others: nobody
/// (through setpriv) when the tests run as root, else the user itself. `None`: cannot drop
/// root here.
fn pages_unprivileged(what: &str, env: &[(&str, &str)]) -> Option<Run> {
    let f = fixture();
    let lib = f.dir.join("libc10_cuda.so");
    let prog = f.dir.join("pages_main");
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::getuid() } == 0;
    let mut c = if root {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&prog);
        c
    } else {
        Command::new(&prog)
    };
    c.args([lib.to_str().unwrap(), what])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LD_LIBRARY_PATH", &f.dir)
        .env("LD_PRELOAD", &f.shim)
        .env("FAKE_MEMINFO_REAL", "1")
        .env("FAKE_CAPACITY", "4294967296")
        // The unprivileged user's socket directory in the fixture, not in /tmp.
        .env("EXPSEG_IPC_DIR", ipc_dir(true));
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().ok()?;
    if root && String::from_utf8_lossy(&out.stderr).contains("setpriv:") {
        return None;
    }
    Some(Run { out })
}

#[test]
fn torch_multiprocessing_descriptors_reach_consumers_whose_pidfd_getfd_is_denied() {
    let Some(r) = pages_unprivileged("share_fd_nodump", &[("EXPSEG_LOG", "expseg=debug")]) else {
        eprintln!("skipped: running as root without setpriv to drop to an unprivileged user");
        return;
    };
    let r = r.ok();
    // The producer is not dumpable: the kernel refuses; the producer's expseg hands over the
    // page it exported, and nothing else.
    assert_eq!(r.get("consumer_exit"), "0", "{}", r.stderr());
    assert_eq!(r.get("getfd_ok"), "1", "{}", r.stderr());
    assert_eq!(r.get("data_ok"), "1", "the descriptor is the exported page");
    assert_eq!(
        r.get("secret_fd"),
        "0",
        "a descriptor never exported stays out of reach"
    );
    assert_eq!(r.get("secret_errno"), libc::EPERM.to_string());
    assert!(
        r.stderr().contains("its expseg served it"),
        "{}",
        r.stderr()
    );
    // Once PyTorch released the page, its descriptor is not served any more.
    assert_eq!(r.get("r2_consumer_exit"), "0");
    assert_eq!(r.get("r2_getfd_ok"), "0", "{}", r.stderr());
    assert_eq!(r.get("r2_getfd_errno"), libc::EPERM.to_string());

    // The same without expseg: the kernel's refusal is what PyTorch would see (so the test
    // above can fail).
    let off = pages_unprivileged("share_fd_nodump", &[("EXPSEG_DISABLE", "1")])
        .unwrap()
        .ok();
    assert_eq!(off.get("getfd_ok"), "0");
    assert_eq!(off.get("getfd_errno"), libc::EPERM.to_string());

    // Turned off: the kernel's refusal stands, nothing is asked.
    let no_rescue = pages_unprivileged(
        "share_fd_nodump",
        &[("EXPSEG_PIDFD_RESCUE", "0"), ("EXPSEG_LOG", "expseg=debug")],
    )
    .unwrap()
    .ok();
    assert_eq!(no_rescue.get("getfd_ok"), "0", "{}", no_rescue.stderr());
    assert_eq!(no_rescue.get("getfd_errno"), libc::EPERM.to_string());
    assert!(
        !no_rescue.stderr().contains("its expseg"),
        "{}",
        no_rescue.stderr()
    );

    // Where the kernel allows it, its answer stands and the socket is not asked.
    let open = pages_unprivileged("share_fd", &[("EXPSEG_LOG", "expseg=debug")])
        .unwrap()
        .ok();
    assert_eq!(open.get("getfd_ok"), "1", "{}", open.stderr());
    assert_eq!(open.get("data_ok"), "1");
    assert!(
        !open.stderr().contains("its expseg served it"),
        "{}",
        open.stderr()
    );
}

/// The checks every way of reaching the driver's allocation functions shares (`drv.c`).
fn driver_calls_are_served_like_runtime_calls(r: &Run) {
    assert_eq!(r.get("alloc_rc"), "0");
    assert_eq!(
        r.get("pooled"),
        "1",
        "4 MiB from cuMemCreate, not cuMemAlloc"
    );
    assert_eq!(r.get("data_ok"), "1");
    assert_eq!(r.get("free_rc"), "0");
    assert_eq!(r.get("free_synced"), "1", "cuMemFree waits for the context");
    assert_eq!(
        (r.get("same_ptr"), r.get("creates_after_reuse")),
        ("1".into(), "1".into()),
        "the same size again comes from the cache"
    );
    assert_eq!(
        (r.get("info_rc"), r.get("info_free_mib")),
        ("0".into(), "104".into()),
        "100 MiB free in the driver plus 4 MiB cached"
    );
    assert_eq!(
        (r.get("small_rc"), r.get("small_to_driver")),
        ("0".into(), "1".into())
    );
    assert_eq!(
        (r.get("small_free_rc"), r.get("small_free_to_driver")),
        ("0".into(), "1".into())
    );
    assert_eq!(
        (r.get("unknown_free_rc"), r.get("double_free_rc")),
        ("1".into(), "1".into()),
        "unknown pointers and double frees: the driver's own answer"
    );
    assert_eq!(r.get("oom_rc"), "2", "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(r.get("null_out_rc"), "1", "the driver's answer");
    assert_eq!(
        (r.get("pitch_rc"), r.get("pitch"), r.get("pitch_pooled")),
        ("0".into(), "3072".into(), "1".into()),
        "the driver's pitch, pitch x height from the pool"
    );
    assert_eq!(r.get("pitch_probes"), "1", "one row asked of the driver");
    assert_eq!(
        (r.get("pitch_data_ok"), r.get("pitch_free_rc")),
        ("1".into(), "0".into())
    );
    assert_eq!(
        (
            r.get("small_pitch_rc"),
            r.get("small_pitch"),
            r.get("small_pitch_to_driver")
        ),
        ("0".into(), "512".into(), "1".into())
    );
    assert_eq!(r.get("bad_elem_rc"), "1", "the driver's own answer");
    assert_eq!(
        (r.get("own_ctx_rc"), r.get("own_ctx_to_driver")),
        ("0".into(), "1".into()),
        "a context of the program's own passes through"
    );
    assert_eq!(r.get("own_ctx_info_free_mib"), "100", "nothing added there");
    assert_eq!(
        (r.get("own_ctx_free_rc"), r.get("own_ctx_free_to_driver")),
        ("0".into(), "1".into())
    );
    assert_eq!(
        (
            r.get("pool_free_in_own_ctx_rc"),
            r.get("synced"),
            r.get("to_driver")
        ),
        ("0".into(), "1".into(), "0".into()),
        "pool memory freed from another context: the pool's, after the primary context's wait"
    );
    assert_eq!(r.stderr(), "");
}

#[test]
fn a_program_linking_the_driver_is_served_by_the_pool() {
    let r = run_in(&fixture().dir, "drv", &["direct"], KEEP).ok();
    driver_calls_are_served_like_runtime_calls(&r);
}

#[test]
fn dlsym_on_the_driver_gives_the_allocation_hooks() {
    let r = run_in(&fixture().dir, "drv", &["dlsym"], KEEP).ok();
    assert_eq!(r.get("dlsym_is_hook"), "1");
    assert_eq!(
        r.get("dlsym_v1_is_driver"),
        "1",
        "the pre-3020 cuMemAlloc (32-bit) is not interposed"
    );
    assert_eq!(r.get("dlsym_getproc_is_hook"), "1");
    driver_calls_are_served_like_runtime_calls(&r);
}

#[test]
fn cu_get_proc_address_gives_the_hooks_for_every_version_and_flag() {
    let r = run_in(&fixture().dir, "drv", &["getproc"], KEEP).ok();
    assert_eq!(
        (r.get("getproc_all_hooks"), r.get("lookups")),
        ("1".into(), "144".into()),
        "cuGetProcAddress and _v2, four functions, versions 3020 to 13000, flags 0 to 2"
    );
    assert_eq!(r.get("old_version_is_driver"), "1");
    assert_eq!(r.get("getproc_of_getproc_is_hook"), "1");
    assert_eq!(r.get("vmm_lookup_is_driver"), "1");
    driver_calls_are_served_like_runtime_calls(&r);
    // PyTorch's page hooks come only from the runtime's entry point API, even with `all`.
    let r = run_in(
        &fixture().dir,
        "drv",
        &["getproc"],
        &[("EXPSEG_COALESCE", "all")],
    )
    .ok();
    assert_eq!(r.get("vmm_lookup_is_driver"), "1");
}

#[test]
fn a_statically_linked_runtime_is_served_through_cu_get_proc_address() {
    let f = fixture();
    let dir = f.dir.join("static-report");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let report = dir.join("r.txt");
    let r = run_in(
        &f.dir,
        "static_prog",
        &[],
        &[KEEP[0], ("EXPSEG_REPORT", report.to_str().unwrap())],
    )
    .ok();
    assert_eq!(r.get("malloc_rc"), "0");
    assert_eq!(r.get("pooled"), "1");
    assert_eq!(r.get("data_ok"), "1");
    assert_eq!(
        (r.get("free_rc"), r.get("free_synced")),
        ("0".into(), "1".into())
    );
    assert_eq!(
        (r.get("same_ptr"), r.get("creates")),
        ("1".into(), "1".into())
    );
    assert_eq!(
        r.get("meminfo_free_mib"),
        "108",
        "8 MiB cached, counted once"
    );
    assert_eq!(
        (r.get("small_to_driver"), r.get("small_free_to_driver")),
        ("1".into(), "1".into())
    );
    assert_eq!(r.get("oom_rc"), "2");
    assert_eq!(r.get("bad_free_rc"), "1");
    assert_eq!(r.stderr(), "");
    let json = std::fs::read_to_string(dir.join("r.txt.json")).unwrap();
    assert!(
        json.contains("\"driver_allocs\":2") && json.contains("\"driver_frees\":2"),
        "{json}"
    );
    assert!(json.contains("pool active"), "{json}");
    // With a debug log, each memory function the runtime looked up says whose it got.
    let r = run_in(
        &f.dir,
        "static_prog",
        &[],
        &[("EXPSEG_LOG", "expseg=debug")],
    )
    .ok();
    let err = r.stderr();
    assert!(
        err.contains("lookup cuMemAlloc (version 3020, cuGetProcAddress): expseg's"),
        "{err}"
    );
}

#[test]
fn a_shared_runtime_is_served_once_and_keeps_the_drivers_own_functions() {
    let r = run("layers", KEEP).ok();
    assert_eq!(
        r.get("runtime_got_driver"),
        "1",
        "the runtime's cuGetProcAddress lookups give it the driver's allocation functions"
    );
    assert_eq!(
        r.get("runtime_getproc_is_hook"),
        "1",
        "while its cuGetProcAddress still goes through expseg"
    );
    assert_eq!(
        (r.get("small_driver_allocs"), r.get("small_creates")),
        ("1".into(), "0".into()),
        "a pass-through cudaMalloc reaches the driver's cuMemAlloc exactly once"
    );
    assert_eq!(r.get("small_driver_frees"), "1");
    assert_eq!(
        (r.get("large_driver_allocs"), r.get("large_creates")),
        ("0".into(), "1".into()),
        "a pooled cudaMalloc never reaches cuMemAlloc"
    );
    assert_eq!(r.get("entry_point_is_hook"), "1");
    assert_eq!(r.get("entry_point_pooled"), "1");
    assert_eq!(r.get("entry_point_free_rc"), "0");
    assert_eq!(
        r.get("meminfo_free_mib"),
        "110",
        "100 MiB plus 10 MiB cached, added once"
    );
    assert_eq!(r.stderr(), "");
}

#[test]
fn driver_hooks_pass_through_when_off_and_catch_panics() {
    let r = run_in(
        &fixture().dir,
        "drv",
        &["direct"],
        &[("EXPSEG_DISABLE", "1")],
    )
    .ok();
    assert_eq!(
        (r.get("alloc_rc"), r.get("pooled")),
        ("0".into(), "0".into())
    );
    assert_eq!(r.get("info_free_mib"), "100");
    // The driver API alone off: its calls are the driver's, the runtime's still served.
    let r = run_in(
        &fixture().dir,
        "drv",
        &["direct"],
        &[("EXPSEG_DRIVER_API", "0")],
    )
    .ok();
    assert_eq!(
        (r.get("alloc_rc"), r.get("pooled"), r.get("info_free_mib")),
        ("0".into(), "0".into(), "100".into())
    );
    let r = run("simple", &[("EXPSEG_DRIVER_API", "0")]).ok();
    assert_eq!(r.get("to_runtime"), "0");
    // On by default.
    for prog in ["drv", "static_prog"] {
        let args: &[&str] = if prog == "drv" { &["direct"] } else { &[] };
        let r = run_in(
            &fixture().dir,
            prog,
            args,
            &[("EXPSEG_DRIVER_API", "<unset>")],
        )
        .ok();
        assert_eq!(
            r.get("pooled"),
            "1",
            "{prog}: served from the pool by default"
        );
    }
    let r = run_in(
        &fixture().dir,
        "static_prog",
        &[],
        &[("EXPSEG_TEST_PANIC", "cuMemAlloc_v2")],
    );
    assert_eq!(
        r.get("malloc_rc"),
        "999",
        "CUDA_ERROR_UNKNOWN, and no crash"
    );
    assert!(
        r.stderr().contains("internal error caught"),
        "{}",
        r.stderr()
    );
}

#[test]
fn a_static_runtime_shares_pool_memory_through_the_drivers_ipc() {
    // IPC at the driver (cuIpcGetMemHandle/cuIpcOpenMemHandle_v2/cuIpcCloseMemHandle, what a
    // static runtime calls): the pool allocation is mirrored and ticketed with no shared
    // runtime in the process (copies and handles through the driver); a consumer running
    // expseg maps the original memory (both ways), a plain one opens the mirror (one-way).
    let f = fixture();
    for (consumer, both) in [("expseg", "1"), ("plain", "0")] {
        let dir = f.dir.join(format!("sockets-static-{consumer}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let r = run_in(
            &f.dir,
            "static_prog",
            &["ipc", consumer],
            &[("EXPSEG_IPC_DIR", dir.to_str().unwrap())],
        )
        .ok();
        assert_eq!(r.get("get_rc"), "0", "{consumer}: {}", r.stderr());
        assert_eq!(r.get("open_rc"), "0", "{consumer}: {}", r.stderr());
        assert_eq!(r.get("consumer_data_ok"), "1", "{consumer}");
        assert_eq!(r.get("close_rc"), "0", "{consumer}");
        assert_eq!(r.get("both_ways"), both, "{consumer}: {}", r.stderr());
        assert_eq!(r.get("free_rc"), "0", "{consumer}");
        assert!(
            !r.stderr().contains("no CUDA runtime defines"),
            "nothing asked for a shared runtime: {}",
            r.stderr()
        );
    }
}

#[test]
fn peer_access_enabled_at_the_driver_reaches_pool_mappings() {
    // cuCtxEnablePeerAccess (a static runtime's cudaDeviceEnablePeerAccess): device 1's pool
    // memory gets device 0's access, as through the runtime, and loses it on disable.
    let r = run_in(&fixture().dir, "drv", &["peer"], &[("FAKE_DEVICES", "2")]).ok();
    assert_eq!(r.get("dev1_access"), "2", "device 1 only");
    assert_eq!(r.get("enable_rc"), "0");
    assert_eq!(r.get("after_enable"), "3", "{}", r.stderr());
    assert_eq!(r.get("disable_rc"), "0");
    assert_eq!(r.get("after_disable"), "2");
}

#[test]
fn the_plural_pointer_query_describes_the_allocation() {
    // cuPointerGetAttributes (cudaPointerGetAttributes of a static runtime): the range
    // attributes are the allocation's (4 MiB), not one 2 MiB chunk's; others are the driver's.
    let r = run_in(
        &fixture().dir,
        "drv",
        &["ranges"],
        &[("EXPSEG_MAX_CHUNK", "2M")],
    )
    .ok();
    assert_eq!(r.get("attrs_rc"), "0");
    assert_eq!(r.get("start_ok"), "1", "{}", r.stderr());
    assert_eq!(r.get("size_mib"), "4");
    assert_eq!(r.get("dev"), "0");
}

/// A process on the one fake GPU of 96 MiB that every process started with it shares
/// (FAKE_SHARED_USED: one memory counter in `dir`), with its expseg socket in `dir`.
fn one_shared_gpu(c: &mut Command, dir: &Path) {
    c.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LD_LIBRARY_PATH", &fixture().dir)
        .env("FAKE_CAPACITY", (96u64 << 20).to_string())
        .env("FAKE_MEMINFO_REAL", "1")
        .env("FAKE_SHARED_USED", dir.join("used"))
        .env("EXPSEG_IPC_DIR", dir);
}

#[test]
fn an_allocation_on_an_unknown_device_asks_each_peer_once_not_once_per_gpu() {
    // A peer that never answers (a listener of this process, named by its pid, accepting
    // nothing) and a process on four GPUs whose allocation in its own context finds no memory.
    let f = fixture();
    let dir = f.dir.join("unknown-device");
    let _ = std::fs::remove_dir_all(&dir);
    // SAFETY: geteuid cannot fail.
    let sockets = dir.join(socket_dir_name(unsafe { libc_geteuid() }));
    std::fs::create_dir_all(&sockets).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&sockets, std::fs::Permissions::from_mode(0o700)).unwrap();
    let _silent = std::os::unix::net::UnixListener::bind(
        sockets.join(format!("{}.sock", std::process::id())),
    )
    .unwrap();
    let report = dir.join("r.txt");
    let t = std::time::Instant::now();
    let r = run_in(
        &f.dir,
        "drv",
        &["own_ctx_oom"],
        &[
            ("FAKE_DEVICES", "4"),
            ("EXPSEG_IPC_DIR", dir.to_str().unwrap()),
            ("EXPSEG_REPORT", report.to_str().unwrap()),
        ],
    )
    .ok();
    let took = t.elapsed();
    assert_eq!(r.get("own_ctx_oom_rc"), "2", "{}", r.stderr());
    let json = std::fs::read_to_string(dir.join("r.txt.json")).unwrap();
    // Before: one request per GPU, one after another (four, 500 ms each).
    assert!(json.contains("\"reclaim_asks\":1,"), "{json}");
    assert!(took < std::time::Duration::from_millis(1800), "{took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two processes on one fake GPU (FAKE_SHARED_USED: one memory counter, 96 MiB): one takes
/// and frees 64 MiB and holds on, then another asks for 48 MiB at once. Returns the second's
/// `need_rc` and both reports' JSON.
fn handoff(holder_env: &[(&str, &str)], second_preloaded: bool) -> (String, String, String) {
    handoff_to(holder_env, second_preloaded, &[])
}

/// `handoff` with `second_env` set for the second process.
fn handoff_to(
    holder_env: &[(&str, &str)],
    second_preloaded: bool,
    second_env: &[(&str, &str)],
) -> (String, String, String) {
    use std::io::{BufRead as _, Write as _};
    let f = fixture();
    // One folder (shared GPU counter, sockets) a call: tests run in parallel.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "expseg-handoff-{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let common = |c: &mut Command| one_shared_gpu(c, &dir);
    let mut h = Command::new(f.dir.join("prog"));
    common(&mut h);
    h.args(["hold", "64"])
        .env("LD_PRELOAD", &f.shim)
        .env("EXPSEG_REPORT", dir.join("holder.txt"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    for (k, v) in holder_env {
        h.env(k, v);
    }
    let mut holder = h.spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "held=1");
    let mut s = Command::new(f.dir.join("prog"));
    common(&mut s);
    s.args(["need", "48"])
        .env("EXPSEG_REPORT", dir.join("second.txt"));
    for (k, v) in second_env {
        s.env(k, v);
    }
    if second_preloaded {
        s.env("LD_PRELOAD", &f.shim);
    }
    let out = s.output().unwrap();
    let _ = holder.stdin.take().unwrap().write_all(b"done\n");
    assert!(holder.wait().unwrap().success());
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let rc = stdout
        .lines()
        .find_map(|l| l.strip_prefix("need_rc="))
        .unwrap_or_else(|| {
            panic!(
                "no need_rc in {stdout:?} / {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
        .to_string();
    let read = |n: &str| std::fs::read_to_string(dir.join(n)).unwrap_or_default();
    let r = (rc, read("holder.txt.json"), read("second.txt.json"));
    let _ = std::fs::remove_dir_all(&dir);
    r
}

#[test]
fn freed_memory_goes_back_at_once_and_kept_memory_is_reclaimed_by_expseg_processes() {
    // Defaults: the holder's cudaFree gave the 64 MiB back before it returned, so a plain
    // second process gets its 48 MiB (as natively).
    let (rc, holder, _) = handoff(&[], false);
    assert_eq!(rc, "0", "plain second process after a default holder");
    assert!(holder.contains("\"cached_bytes\":0"), "{holder}");
    // Keeping opted in: a plain process cannot get memory the holder keeps...
    let keep = [("EXPSEG_CACHE_MAX", "1G")];
    let (rc, _, _) = handoff(&keep, false);
    assert_eq!(rc, "2", "a plain process cannot reclaim");
    // ...but an expseg process asks the holder, which gives it back, and gets its memory.
    let (rc, holder, second) = handoff(&keep, true);
    assert_eq!(rc, "0", "reclaimed: {second}");
    assert!(
        second.contains(&format!("\"reclaimed_bytes\":{}", 64u64 << 20)),
        "{second}"
    );
    assert!(
        holder.contains(&format!("\"given_back_bytes\":{}", 64u64 << 20)),
        "{holder}"
    );
}

#[test]
fn a_disabled_expseg_asks_no_other_process_for_memory() {
    // EXPSEG_DISABLE=1 is pure pass-through: its out of memory is the driver's, and the
    // holder keeps what it keeps (before 2026-11-25 the failed call still asked it).
    let keep = [("EXPSEG_CACHE_MAX", "1G")];
    let (rc, holder, _) = handoff_to(&keep, true, &[("EXPSEG_DISABLE", "1")]);
    assert_eq!(rc, "2");
    assert!(holder.contains("\"given_back_bytes\":0"), "{holder}");
}

#[test]
fn a_pitched_driver_allocation_that_finds_no_memory_reclaims_and_tries_again() {
    // cuMemAllocPitch_v2 as cuMemAlloc_v2: the holder keeps 64 MiB (opted in); the second
    // process's pitched 48 MiB finds none, asks the holder, and gets it on the second try.
    let keep = [("EXPSEG_CACHE_MAX", "1G")];
    let (rc, holder, second) = handoff_to(&keep, true, &[("NEED_PITCH", "1")]);
    assert_eq!(rc, "0", "reclaimed: {second}");
    assert!(
        holder.contains(&format!("\"given_back_bytes\":{}", 64u64 << 20)),
        "{holder}"
    );
    // Without expseg in the second process nothing is asked: the driver's out of memory.
    let (rc, _, _) = handoff_to(&keep, false, &[("NEED_PITCH", "1")]);
    assert_eq!(rc, "2");
}

#[test]
fn pause_and_resume_from_inside_keep_bytes_and_tags() {
    // expseg_pause/expseg_resume as Python calls them: a tagged block paused alone and
    // discarded, then everything offloaded and brought back at the same addresses.
    let roomy = fixture().dir.join("hostkeep-roomy");
    std::fs::write(&roomy, format!("{}\n", 1u64 << 40)).unwrap();
    let r = run(
        "pause_self",
        &[("EXPSEG_TEST_HOST_AVAILABLE", roomy.to_str().unwrap())],
    )
    .ok();
    assert_eq!(r.get("bad_tag_rc"), "1", "an empty tag name is refused");
    assert_eq!(r.get("pause_kv_rc"), "0", "{}", r.stderr());
    assert_eq!(r.get("pause_kv_mib"), "16");
    assert_eq!(r.get("secs_set"), "1");
    assert_eq!(r.get("paused_mib"), "16");
    assert_eq!(r.get("w_intact"), "1", "the untagged block was not paused");
    assert_eq!(r.get("pause_all_rc"), "0");
    assert_eq!(
        r.get("pause_all_mib"),
        "8",
        "paused twice: only what was awake"
    );
    assert_eq!(r.get("paused_all_mib"), "24");
    assert_eq!(r.get("resume_rc"), "0");
    assert_eq!(r.get("resume_mib"), "24");
    assert_eq!(r.get("w_back"), "1", "offloaded bytes are back");
    assert_eq!(r.get("kv_usable"), "1", "discarded memory is memory again");
    // The host has room (EXPSEG_PAUSE_KEEP_HOST=auto, the default): the buffer stays.
    assert_eq!(
        r.get("after_resume_pause_host_kept_bytes"),
        (256u64 << 20).to_string()
    );
    assert_eq!(
        r.get("later_pause_host_kept_bytes"),
        (256u64 << 20).to_string()
    );
    assert_eq!(r.get("resume_again_rc"), "0");
    assert_eq!(r.get("resume_again_mib"), "0");
    assert_eq!(r.get("free_paused_rc"), "0");
    assert_eq!(
        r.get("paused_after_free_mib"),
        "16",
        "the freed block is not paused any more"
    );
    assert_eq!(r.get("kv_back"), "1");
}

#[test]
fn host_buffers_kept_after_a_resume_go_when_the_host_runs_short_or_when_told() {
    let dir = fixture().dir.join("hostkeep");
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, bytes: u64| {
        let p = dir.join(name);
        std::fs::write(&p, format!("{bytes}\n")).unwrap();
        p.to_str().unwrap().to_string()
    };
    let kept = (256u64 << 20).to_string();
    // Room (EXPSEG_PAUSE_KEEP_HOST=auto, the default): kept.
    let roomy = file("roomy", 1 << 40);
    let r = run("pause_self", &[("EXPSEG_TEST_HOST_AVAILABLE", &roomy)]).ok();
    assert_eq!(r.get("after_resume_pause_host_kept_bytes"), kept);
    assert_eq!(r.get("later_pause_host_kept_bytes"), kept);
    assert_eq!(r.get("freed_paused_pause_host_kept_bytes"), kept);
    // Short of host memory when the resume is done: freed at once.
    let short = file("short", 1 << 30);
    let r = run("pause_self", &[("EXPSEG_TEST_HOST_AVAILABLE", &short)]).ok();
    assert_eq!(r.get("resume_rc"), "0");
    assert_eq!(r.get("after_resume_pause_host_kept_bytes"), "0");
    // Room at the resume, none a moment later: the watcher frees them.
    let later = file("later", 1 << 40);
    let r = run(
        "pause_self",
        &[
            ("EXPSEG_TEST_HOST_AVAILABLE", &later),
            ("HOST_SHORT_AFTER", "1"),
        ],
    )
    .ok();
    assert_eq!(r.get("after_resume_pause_host_kept_bytes"), kept);
    assert_eq!(r.get("later_pause_host_kept_bytes"), "0", "{}", r.stderr());
    // Still short when a paused allocation is freed (its buffer empties outside any pause or
    // resume): the watcher frees it too.
    assert_eq!(r.get("freed_paused_pause_host_kept_bytes"), "0");
    // 0: never kept; 1: kept whatever the host has.
    let r = run("pause_self", &[("EXPSEG_PAUSE_KEEP_HOST", "0")]).ok();
    assert_eq!(r.get("after_resume_pause_host_kept_bytes"), "0");
    let short = file("short1", 1 << 30);
    let r = run(
        "pause_self",
        &[
            ("EXPSEG_PAUSE_KEEP_HOST", "1"),
            ("EXPSEG_TEST_HOST_AVAILABLE", &short),
        ],
    )
    .ok();
    assert_eq!(r.get("later_pause_host_kept_bytes"), kept);
}

#[test]
fn a_clock_the_kernel_refuses_at_load_prints_nothing() {
    // A sandbox that refuses clock_gettime: expseg's load-time constructor takes no reading
    // (std's Instant::now() would panic, and the caught panic's message print in every process).
    let f = fixture();
    let dir = f.dir.join("noclock");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("noclock.c"),
        "#include <errno.h>\n#include <time.h>\nint clock_gettime(clockid_t c, struct timespec* t) { (void)c; (void)t; errno = EPERM; return -1; }\n",
    )
    .unwrap();
    cc(
        &["-shared", "-fPIC", "-o", "libnoclock.so", "noclock.c"],
        &dir,
    );
    let preload = format!(
        "{}:{}",
        dir.join("libnoclock.so").display(),
        f.shim.display()
    );
    let o = Command::new("/bin/true")
        .env("LD_PRELOAD", &preload)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_whole_process_pause_is_the_drivers_checkpoint_and_says_why_when_it_did_not_happen() {
    // The fake driver keeps each pid's checkpoint state in a file (tests/c/fake_cuda.c).
    let f = fixture();
    let dir = f.dir.join("whole-pause");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut target = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = target.id().to_string();
    let state = || {
        std::fs::read_to_string(dir.join(&pid))
            .unwrap()
            .trim()
            .to_string()
    };
    std::fs::write(dir.join(&pid), "0\n").unwrap();
    let cli = |env: &[(&str, &str)], args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_expseg"));
        one_shared_gpu(&mut c, &dir);
        c.env("FAKE_CKPT_DIR", &dir).envs(env.iter().copied());
        let o = c.args(args).output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
        (o.status.code(), text(&o.stdout), text(&o.stderr))
    };
    // A process without expseg cannot say whether it maps another's memory by IPC (which the
    // driver cannot restore): paused only with --force.
    let (rc, _, err) = cli(&[], &["pause", &pid]);
    assert_eq!(rc, Some(1));
    assert!(
        err.contains("no expseg in it to ask") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(state(), "0");
    // Paused: locked, then checkpointed; the line says so, and `paused` reads the driver.
    let (rc, out, err) = cli(&[], &["pause", "--force", &pid]);
    assert_eq!(rc, Some(0), "{err}");
    assert!(
        out.starts_with(&format!("pid {pid}: paused the whole process")),
        "{out}"
    );
    assert_eq!(state(), "2");
    let (_, out, _) = cli(&[], &["paused", &pid]);
    assert_eq!(
        out,
        format!("pid {pid}: the whole process is paused (driver state Checkpointed)")
    );
    let (rc, out, _) = cli(&[], &["pause", "--force", &pid, "--json"]);
    assert_eq!(rc, Some(0));
    assert!(
        out.contains("\"mode\":\"whole\"") && out.contains("\"already\":true"),
        "{out}"
    );
    // Resumed: restored, then unlocked.
    let (rc, out, err) = cli(&[], &["resume", &pid]);
    assert_eq!(rc, Some(0), "{err}");
    assert!(
        out.starts_with(&format!("pid {pid}: resumed the whole process in ")),
        "{out}"
    );
    assert_eq!(state(), "0");
    // Work that does not stop in time: not paused, and why; nothing changed.
    let (rc, _, err) = cli(
        &[("FAKE_CKPT_LOCK_RC", "909")],
        &["pause", "--force", "--timeout", "2.5", &pid],
    );
    assert_eq!(rc, Some(1));
    assert!(
        err.contains("did not come to a stop within 2.5 s") && err.contains("nothing changed"),
        "{err}"
    );
    assert_eq!(state(), "0");
    // A checkpoint the driver refuses: unlocked again, runs on.
    let (rc, _, err) = cli(&[("FAKE_CKPT_RC", "801")], &["pause", "--force", &pid]);
    assert_eq!(rc, Some(1));
    assert!(
        err.contains("could not checkpoint it") && err.contains("it was unlocked and runs on"),
        "{err}"
    );
    assert_eq!(state(), "0");
    // A process without CUDA: named, it fails; found by --tree, it is skipped.
    let mut plain = Command::new("sleep").arg("60").spawn().unwrap();
    let other = plain.id().to_string();
    let (rc, _, err) = cli(&[], &["pause", &other]);
    assert_eq!(rc, Some(1));
    assert!(err.contains("no CUDA in this process"), "{err}");
    let (rc, _, err) = cli(&[], &["pause", "--tree", &other]);
    assert_eq!(rc, Some(1), "nothing found");
    assert!(
        err.contains(&format!(
            "pid {other}: no CUDA in this process (yet): skipped"
        )),
        "{err}"
    );
    assert!(err.contains("no expseg process found"), "{err}");
    for c in [&mut target, &mut plain] {
        let _ = c.kill();
        let _ = c.wait();
    }
    // A process of another pid namespace (a container's, here a child namespace): not paused,
    // --force or not.
    if let Ok(mut boxed) = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "sleep", "60"])
        .spawn()
    {
        let children = format!("/proc/{}/task/{}/children", boxed.id(), boxed.id());
        let mut inner = String::new();
        for _ in 0..100 {
            inner = std::fs::read_to_string(&children)
                .unwrap_or_default()
                .trim()
                .to_string();
            if !inner.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if let Some(inner) = inner.split_whitespace().next().filter(|p| !p.is_empty()) {
            std::fs::write(dir.join(inner), "0\n").unwrap();
            let (rc, _, err) = cli(&[], &["pause", "--force", inner]);
            assert_eq!(rc, Some(1), "{err}");
            assert!(err.contains("pid namespace"), "{err}");
            assert_eq!(
                std::fs::read_to_string(dir.join(inner)).unwrap().trim(),
                "0"
            );
        } else {
            eprintln!("skipped: unshare --pid --fork is not allowed here");
        }
        let _ = boxed.kill();
        let _ = boxed.wait();
    }
    // Processes under expseg say whether they share memory by IPC: one that shares nothing is
    // paused whole without --force; one that made a handle, or opened one, is not.
    for (ask, refusal) in [
        ("share", "it shared its memory with another process (IPC)"),
        (
            "open",
            "it maps memory another process shared with it (IPC)",
        ),
    ] {
        use std::io::{BufRead as _, Write as _};
        // The fake's shared counter does not see a process end: each sleeper starts afresh.
        let _ = std::fs::remove_file(dir.join("used"));
        let mut s = Command::new(f.dir.join("prog"));
        one_shared_gpu(&mut s, &dir);
        let mut p = s
            .arg("sleeper")
            .env("LD_PRELOAD", &f.shim)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let id = p.id().to_string();
        std::fs::write(dir.join(&id), "0\n").unwrap();
        let mut out = std::io::BufReader::new(p.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready=1");
        let (rc, _, err) = cli(&[], &["pause", &id]);
        assert_eq!(rc, Some(0), "nothing shared yet: {err}");
        assert_eq!(cli(&[], &["resume", &id]).0, Some(0));
        let mut stdin = p.stdin.take().unwrap();
        stdin.write_all(format!("{ask}\n").as_bytes()).unwrap();
        line.clear();
        out.read_line(&mut line).unwrap();
        let (rc, _, err) = cli(&[], &["pause", &id]);
        assert_eq!(rc, Some(1), "{ask}: {line}");
        assert!(err.contains(refusal) && err.contains("--pool"), "{err}");
        assert_eq!(std::fs::read_to_string(dir.join(&id)).unwrap().trim(), "0");
        drop(stdin);
        let _ = p.wait();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_pause_line_says_what_happens_to_torch_memory_savers_memory() {
    let f = fixture();
    let dir = f.dir.join("whole-pause-tms");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A process with torch_memory_saver loaded: its maps name it (here, its program's name).
    let exe = dir.join("torch_memory_saver_hook_mode_preload_sleep");
    std::fs::copy("/bin/sleep", &exe).unwrap();
    let mut target = Command::new(&exe).arg("60").spawn().unwrap();
    let pid = target.id().to_string();
    std::fs::write(dir.join(&pid), "0\n").unwrap();
    let cli = |args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_expseg"));
        one_shared_gpu(&mut c, &dir);
        let o = c.env("FAKE_CKPT_DIR", &dir).args(args).output().unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).trim().to_string(),
        )
    };
    let (rc, out) = cli(&["pause", "--force", &pid]);
    assert_eq!(rc, Some(0), "{out}");
    assert!(
        out.starts_with(&format!("pid {pid}: paused the whole process"))
            && out.ends_with("torch_memory_saver's memory in it is paused too"),
        "{out}"
    );
    let (rc, _) = cli(&["resume", &pid]);
    assert_eq!(rc, Some(0));
    target.kill().unwrap();
    target.wait().unwrap();
}

#[test]
fn a_process_paused_from_outside_gives_its_memory_to_a_plain_one() {
    use std::io::{BufRead as _, Write as _};
    use std::process::Stdio;
    let f = fixture();
    let dir = std::env::temp_dir().join(format!("expseg-sleeper-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let common = |c: &mut Command| one_shared_gpu(c, &dir);
    let mut s = Command::new(f.dir.join("prog"));
    common(&mut s);
    s.arg("sleeper")
        .env("LD_PRELOAD", &f.shim)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut sleeper = s.spawn().unwrap();
    let pid = sleeper.id().to_string();
    let mut out = std::io::BufReader::new(sleeper.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready=1");
    let cli = |args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_expseg"));
        common(&mut c);
        c.args(args).output().unwrap()
    };
    let text = |o: &Output| String::from_utf8_lossy(&o.stdout).trim().to_string();
    let need = |c: &mut Command| {
        common(c);
        let o = c.args(["need", "48"]).output().unwrap();
        text(&o)
    };
    // While it holds its 64 MiB, a plain process cannot get 48.
    assert!(need(&mut Command::new(f.dir.join("prog"))).starts_with("need_rc=2"));
    let p = cli(&["pause", "--pool", &pid]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    assert!(
        text(&p).starts_with(&format!("pid {pid}: paused 64.0 MiB in "))
            && text(&p).ends_with(" s"),
        "{}",
        text(&p)
    );
    assert!(need(&mut Command::new(f.dir.join("prog"))).starts_with("need_rc=0"));
    assert_eq!(
        text(&cli(&["paused", &pid])),
        format!("pid {pid}: 64.0 MiB paused")
    );
    // --json: the bytes, for scripts.
    assert_eq!(
        text(&cli(&["paused", &pid, "--json"])),
        format!(
            "{{\"pid\":{pid},\"command\":\"paused\",\"bytes\":{}}}",
            64u64 << 20
        )
    );
    // --all addresses every expseg process of the user (here: the sleeper alone serves).
    let all = cli(&["paused", "--all"]);
    assert!(
        text(&all).contains(&format!("pid {pid}: 64.0 MiB paused")),
        "{}",
        text(&all)
    );
    // --tree: the sleeper has no children; the test process's tree holds it.
    let me = std::process::id().to_string();
    let tree = cli(&["paused", "--tree", &me]);
    assert!(text(&tree).contains(&format!("pid {pid}: ")));
    // The tree's other processes (this test, its other programs) are skipped, not failures.
    assert!(
        tree.status.success(),
        "{}",
        String::from_utf8_lossy(&tree.stderr)
    );
    // SAFETY: geteuid cannot fail.
    if unsafe { libc_geteuid() } == 0 {
        use std::os::unix::process::CommandExt as _;
        let mut c = Command::new(env!("CARGO_BIN_EXE_expseg"));
        common(&mut c);
        let o = c
            .args(["pause", "--pool", &pid])
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        assert!(!o.status.success(), "another user is refused");
        assert!(String::from_utf8_lossy(&o.stderr).contains("belongs to uid"));
    }
    let r = cli(&["resume", &pid, "--json"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(
        text(&r).starts_with(&format!(
            "{{\"pid\":{pid},\"command\":\"resume\",\"bytes\":{},\"seconds\":",
            64u64 << 20
        )),
        "{}",
        text(&r)
    );
    let mut stdin = sleeper.stdin.take().unwrap();
    stdin.write_all(b"check\n").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "intact=1", "the bytes came back");
    // A resume with room for one of its two allocations resumes that one, fails, and says
    // how much it resumed; the rest stays paused until there is room.
    assert!(cli(&["pause", "--pool", &pid]).status.success());
    let mut k = Command::new(f.dir.join("prog"));
    common(&mut k);
    let mut keeper = k
        .args(["keep", "48"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut kept = String::new();
    std::io::BufReader::new(keeper.stdout.take().unwrap())
        .read_line(&mut kept)
        .unwrap();
    assert_eq!(kept.trim(), "keep_rc=0");
    let r = cli(&["resume", &pid]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(
        err.contains("not enough free GPU memory")
            && err.contains("(32.0 MiB resumed before the failure"),
        "{err}"
    );
    assert_eq!(
        text(&cli(&["paused", &pid])),
        format!("pid {pid}: 32.0 MiB paused")
    );
    drop(keeper.stdin.take());
    assert!(keeper.wait().unwrap().success());
    let r = cli(&["resume", &pid]);
    assert!(text(&r).starts_with(&format!("pid {pid}: resumed 32.0 MiB in ")));
    stdin.write_all(b"check\n").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "intact=1", "both came back");
    // Not an expseg process: a clear failure.
    let o = cli(&["pause", "999999999"]);
    assert!(!o.status.success());
    drop(stdin);
    assert!(sleeper.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `prog sleeper` (64 MiB, its socket serving) with its socket directory under `dir` and
/// `env`: the process, once it is ready.
fn sleeper_in(dir: &Path, env: &[(&str, &str)]) -> std::process::Child {
    use std::io::BufRead as _;
    std::fs::create_dir_all(dir).unwrap();
    let mut s = Command::new(fixture().dir.join("prog"));
    one_shared_gpu(&mut s, dir);
    s.arg("sleeper")
        .env("LD_PRELOAD", &fixture().shim)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    for (k, v) in env {
        s.env(k, v);
    }
    let mut sleeper = s.spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(sleeper.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready=1");
    sleeper
}

#[test]
fn who_may_do_what_on_a_live_process_is_the_contracts_table_row_by_row() {
    let f = fixture();
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc_geteuid() };
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/contract.md"))
            .unwrap();
    let table: Vec<Vec<String>> = doc[doc.find("### Who may do what").unwrap()..]
        .lines()
        .skip_while(|l| !l.starts_with("| peer |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect();
    assert_eq!(table.len(), 6);
    // One process as started by default, one that allows uid 65534 and remote discard.
    let base = std::env::temp_dir().join(format!("expseg-rows-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (plain_dir, open_dir) = (base.join("plain"), base.join("open"));
    let mut plain = sleeper_in(&plain_dir, &[]);
    let mut open = sleeper_in(
        &open_dir,
        &[
            ("EXPSEG_IPC_ALLOW_UIDS", "65534"),
            ("EXPSEG_ALLOW_REMOTE_DISCARD", "1"),
        ],
    );
    let socket = |dir: &Path, p: &std::process::Child| {
        dir.join(socket_dir_name(uid))
            .join(format!("{}.sock", p.id()))
    };
    let (plain_sock, open_sock) = (socket(&plain_dir, &plain), socket(&open_dir, &open));
    // One request per column: a ticket nobody issued, a descriptor nobody exported, the bytes
    // paused, a discarding pause of a tag nothing carries (it drops nothing).
    let requests = [
        (1u32, 12345u64),
        (u32::MAX, 3),
        (u32::MAX - 4, 0),
        (u32::MAX - 2, (1 << 32) | 77),
    ];
    // How a row's peer is made: (run as another uid, in another pid namespace, in another
    // user namespace whose root maps to this uid).
    let peer_of = |row: &str| -> (Option<u32>, bool, bool) {
        match row {
            "same uid, same pid namespace" => (None, false, false),
            "same uid (another user namespace mapping to it), same pid namespace" => {
                (None, false, true)
            }
            "same uid, other pid namespace" => (None, true, false),
            "uid in EXPSEG_IPC_ALLOW_UIDS, same pid namespace" => (Some(65534), false, false),
            "uid in EXPSEG_IPC_ALLOW_UIDS, other pid namespace" => (Some(65534), true, false),
            "other uid" => (Some(65533), false, false),
            r => panic!("a row the test does not know: {r}"),
        }
    };
    let poke = |sock: &Path,
                (as_uid, other_ns, other_userns): (Option<u32>, bool, bool),
                (id, nonce): (u32, u64)| {
        let mut argv: Vec<String> = Vec::new();
        if other_userns {
            argv.extend(["unshare", "--user", "--map-root-user"].map(String::from));
        }
        if other_ns {
            argv.extend(["unshare", "--pid", "--fork", "--kill-child"].map(String::from));
        }
        if let Some(u) = as_uid {
            argv.push("setpriv".into());
            argv.push(format!("--reuid={u}"));
            argv.push(format!("--regid={u}"));
            argv.push("--clear-groups".into());
        }
        argv.push(f.dir.join("sockpoke").to_str().unwrap().into());
        argv.push(sock.to_str().unwrap().into());
        argv.push(id.to_string());
        argv.push(nonce.to_string());
        let out = Command::new(&argv[0]).args(&argv[1..]).output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.split_whitespace()
            .find_map(|t| t.strip_prefix("poke="))
            .map(str::to_string)
    };
    let mut checked = 0;
    for row in &table {
        let peer = peer_of(&row[0]);
        if peer.0.is_some() && uid != 0 {
            eprintln!("{}: skipped (not root: cannot be another uid)", row[0]);
            continue;
        }
        let sock = match peer.0 {
            Some(_) => &open_sock,
            None => &plain_sock,
        };
        for (cell, request) in row[1..].iter().zip(requests) {
            let Some(got) = poke(sock, peer, request) else {
                eprintln!("{}: skipped (unshare is not allowed here)", row[0]);
                break;
            };
            let ok = match cell.as_str() {
                "yes" => got == "status:0" || got == "status:1",
                "refused" => got == "status:3",
                "closed unread" => got == "closed" || got == "unreachable",
                "only with EXPSEG_ALLOW_REMOTE_DISCARD=1" => {
                    got == "status:3"
                        && poke(&open_sock, peer, request).as_deref() == Some("status:0")
                }
                c => panic!("a cell the test does not know: {c}"),
            };
            assert!(
                ok,
                "row {:?}, request {request:?}: {cell:?} in the table, {got:?} from the process",
                row[0]
            );
            checked += 1;
        }
    }
    assert!(checked >= 4, "the first row at least");
    // The other uid could not even reach the default process's socket.
    if uid == 0 {
        let got = poke(&plain_sock, (Some(65533), false, false), requests[2]);
        assert_eq!(got.as_deref(), Some("unreachable"));
    }
    for p in [&mut plain, &mut open] {
        drop(p.stdin.take());
        assert!(p.wait().unwrap().success());
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn discarding_a_processs_memory_from_outside_needs_its_own_opt_in() {
    use std::io::{BufRead as _, Write as _};
    let f = fixture();
    for (round, opt_in) in [false, true].into_iter().enumerate() {
        let dir =
            std::env::temp_dir().join(format!("expseg-discard-{}-{round}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = Command::new(f.dir.join("prog"));
        one_shared_gpu(&mut s, &dir);
        s.arg("sleeper")
            .env("LD_PRELOAD", &f.shim)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        if opt_in {
            s.env("EXPSEG_ALLOW_REMOTE_DISCARD", "1");
        }
        let mut sleeper = s.spawn().unwrap();
        let pid = sleeper.id().to_string();
        let mut line = String::new();
        std::io::BufReader::new(sleeper.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready=1");
        let cli = |args: &[&str]| {
            let mut c = Command::new(env!("CARGO_BIN_EXE_expseg"));
            one_shared_gpu(&mut c, &dir);
            c.args(args).output().unwrap()
        };
        let o = cli(&["pause", "--discard", &pid]);
        let paused = cli(&["paused", &pid]);
        let paused = String::from_utf8_lossy(&paused.stdout).trim().to_string();
        if opt_in {
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            assert_eq!(paused, format!("pid {pid}: 64.0 MiB paused"));
            assert!(cli(&["resume", &pid]).status.success());
        } else {
            // Refused, saying how to allow it; nothing paused, nothing lost.
            assert!(!o.status.success());
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                err.contains("EXPSEG_ALLOW_REMOTE_DISCARD=1")
                    && err.contains("(0 B paused before the failure"),
                "{err}"
            );
            assert_eq!(paused, format!("pid {pid}: 0 B paused"));
            // An offloading pause is served as before.
            assert!(cli(&["pause", "--pool", &pid]).status.success());
            assert!(cli(&["resume", &pid]).status.success());
        }
        let _ = sleeper.stdin.take().unwrap().write_all(b"");
        assert!(sleeper.wait().unwrap().success());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `tests/c/extent.py` under the shim with python3 (skipped without it): the mirror of another
/// allocator's run, with a stand-in PyTorch whose live block ends 5 MiB in, or without one.
fn extent_run(torch: &str, env: &[(&str, &str)]) -> Option<Run> {
    let f = fixture();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/extent.py");
    let mut c = Command::new("python3");
    c.arg(script)
        .arg(torch)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LD_LIBRARY_PATH", &f.dir)
        .env("LD_PRELOAD", &f.shim)
        // No child process checks tickets: a mirror is what is asked for.
        .env("EXPSEG_IPC_TICKETS", "0");
    for (k, v) in env {
        c.env(k, v);
    }
    match c.output() {
        Ok(out) => Some(Run { out }),
        Err(e) => {
            eprintln!("python3 not found ({e}); skipping");
            None
        }
    }
}

#[test]
fn a_foreign_mirror_ends_where_pytorchs_live_blocks_over_its_page_end() {
    const MIB: u64 = 1 << 20;
    // Asked from a thread without the GIL (through the helper thread), and with it (at once).
    for how in ["torch", "torch-gil"] {
        let Some(r) = extent_run(how, &[]) else {
            return;
        };
        let r = r.ok();
        assert_eq!(
            (r.get("get_rc"), r.get("again_rc")),
            ("0".into(), "0".into())
        );
        assert_eq!(
            r.get("mirror_bytes"),
            (5 * MIB).to_string(),
            "{how}: the block's 5 MiB, not the 32 MiB run: {}",
            r.stderr()
        );
        assert_eq!(
            r.get("made_bytes"),
            (5 * MIB).to_string(),
            "{how}: made once"
        );
        assert_eq!(r.get("bounded"), "1");
        assert_eq!(r.get("spared"), (27 * MIB).to_string());
        assert_eq!(
            r.get("snapshots"),
            "1",
            "{how}: reused while nothing was allocated"
        );
    }
    // Without PyTorch, or with EXPSEG_IPC_EXTENT=run: the whole run.
    for (torch, env) in [
        ("none", &[][..]),
        ("torch", &[("EXPSEG_IPC_EXTENT", "run")][..]),
    ] {
        let r = extent_run(torch, env).unwrap().ok();
        assert_eq!(r.get("get_rc"), "0");
        assert_eq!(
            r.get("mirror_bytes"),
            (32 * MIB).to_string(),
            "{torch} {env:?}"
        );
        assert_eq!(r.get("bounded"), "0");
    }
}

#[test]
fn a_raw_ipc_consumer_offset_from_range_start_addr_stays_inside_the_mirror() {
    // vLLM's custom all-reduce asks the handle of RANGE_START_ADDR and adds ptr minus it in
    // the consumer. Natively the attribute names the reservation (the fake's answer too), so
    // the handle would name the run's first page, whose mirror (PyTorch's first block, 5 MiB)
    // lies short of a tensor at 21 MiB: a plain consumer read wrong bytes (H100, 2026-11-26).
    let Some(r) = extent_run("vllm", &[]) else {
        return;
    };
    let r = r.ok();
    assert_eq!(
        (r.get("attr_rc"), r.get("get_rc")),
        ("0".into(), "0".into())
    );
    assert_eq!(
        r.get("offset_mib"),
        "1",
        "the handle starts at the tensor's mapping"
    );
    assert_eq!(
        r.get("mirror_bytes"),
        (6u64 << 20).to_string(),
        "the second block"
    );
    assert_eq!(r.get("covers_tensor"), "1");
}

/// `two_inflight` (tests/c/c10_pages.c) on two fake devices: PyTorch's empty_cache() waits on
/// the current device's default stream only, then unmaps every device's freed pages while the
/// other device still has work on them (issue 24). Pages expseg holds must not be unmapped
/// under that work.
fn inflight(whole: bool, env: &[(&str, &str)]) -> Run {
    let mut all = vec![
        ("FAKE_DEVICES", "2"),
        ("INFLIGHT_WHOLE", if whole { "1" } else { "0" }),
    ];
    all.extend_from_slice(env);
    let r = pages("libc10_cuda.so", "two_inflight", &all);
    assert!(
        r.out.status.success(),
        "{env:?}: {:?}\n{}",
        r.out.status,
        r.stderr()
    );
    assert_eq!(r.get("inflight_bad"), "0", "{env:?}\n{}", r.stdout());
    assert_eq!(r.get("live_intact"), "1", "{env:?}\n{}", r.stdout());
    assert_eq!(r.get("used_end"), "0", "{env:?}\n{}", r.stdout());
    r
}

const KEEPING: [&[(&str, &str)]; 3] = [
    &[],
    &[("EXPSEG_RELEASE_DELAY", "2")],
    &[("EXPSEG_RELEASE_DELAY", "60000")],
];

#[test]
fn a_partly_freed_batch_of_either_device_is_not_unmapped_under_work_in_flight() {
    // At c904993 the second device's pages passed through (first device only), and PyTorch's
    // own unmap ran under device 1's work (illegal_address=2 there).
    for env in KEEPING {
        let r = inflight(false, env);
        assert_eq!(r.get("illegal_address"), "0", "{env:?}\n{}", r.stdout());
        assert_eq!(r.get("wrong_context"), "0", "{env:?}\n{}", r.stdout());
    }
}

#[test]
fn a_wholly_freed_batch_waits_for_its_device_before_it_leaves() {
    // Before the wait (up to 728e8aa) a handle all of whose pages were freed left its address
    // at once (or when a kept one was given back) under device 1's work: illegal_address=1.
    for env in KEEPING {
        let r = inflight(true, env);
        assert_eq!(r.get("illegal_address"), "0", "{env:?}\n{}", r.stdout());
        assert_eq!(
            r.get("waits"),
            "1",
            "device 1's handle: {env:?}\n{}",
            r.stdout()
        );
        assert_eq!(r.get("wrong_context"), "0", "{env:?}\n{}", r.stdout());
    }
}

#[test]
fn pages_freed_with_their_own_device_current_add_no_wait() {
    for whole in [true, false] {
        let r = inflight(whole, &[("INFLIGHT_GUARDED", "1")]);
        assert_eq!(r.get("illegal_address"), "0", "{}", r.stdout());
        assert_eq!(r.get("waits"), "0", "{}", r.stdout());
        // Which context the caller runs in: one cuCtxGetCurrent against the primary context
        // seen before, not a look at its state each unmap (three driver calls until 2026-11-27).
        assert_eq!(r.get("state_calls"), "0", "{}", r.stdout());
    }
}

#[test]
fn natively_the_race_is_pytorchs() {
    // The control: without coalescing the program's own unmaps run under device 1's work.
    let r = inflight(false, &[("EXPSEG_COALESCE", "off")]);
    assert_eq!(r.get("illegal_address"), "2", "{}", r.stdout());
}

/// `launch_race` (tests/c/c10_pages.c): a thread launches kernels on the legacy default stream
/// over live pages while the allocator's thread releases the rest of their batch and asks
/// cudaMemGetInfo, which moves them (compaction). The fake kernel runs in the launching thread
/// on host memory: one that meets the pages while they are away faults the process, one
/// beside the copy loses its additions. The fake driver runs a launched graph on a thread of
/// its own and holds the legacy stream while its host function runs.
fn launch_race(env: &[(&str, &str)]) -> Run {
    pages("libc10_cuda.so", "launch_race", env)
}

#[test]
fn kernels_another_thread_queues_on_the_default_stream_wait_for_a_move() {
    let r = launch_race(&[("EXPSEG_COMPACT", "1")]);
    assert!(
        r.out.status.success(),
        "{:?}\n{}\n{}",
        r.out.status,
        r.stdout(),
        r.stderr()
    );
    assert_eq!(r.get("race_bad"), "0", "{}", r.stdout());
    assert_eq!(
        r.get("race_moved"),
        "20",
        "every cycle moved the pages: {}",
        r.stdout()
    );
    assert_eq!(
        r.get("graphs"),
        "20",
        "one fenced move a cycle: {}",
        r.stdout()
    );
    assert_eq!(
        r.get("fence_deadlock"),
        "0",
        "nothing waited for the fence it was inside: {}",
        r.stdout()
    );
    assert!(
        r.get("race_launches").parse::<u64>().unwrap() > 20,
        "{}",
        r.stdout()
    );
}

#[test]
fn without_the_fence_the_same_race_faults_or_loses_additions() {
    // The control (the behaviour before the fence): the launcher meets the pages while they
    // are away (a segmentation fault here, an illegal address on a GPU), or beside the copy.
    let r = launch_race(&[("EXPSEG_COMPACT", "1"), ("EXPSEG_MOVE_FENCE", "0")]);
    assert!(
        !r.out.status.success() || r.get("race_bad") != "0",
        "the race did not show: {}",
        r.stdout()
    );
}

#[test]
fn cuda_malloc_in_a_context_of_the_programs_own_is_the_runtimes() {
    let r = run("own_context", &[]).ok();
    assert_eq!(r.get("own_rc"), "0");
    assert_eq!(
        (
            r.get("own_to_runtime"),
            r.get("own_pool_creates"),
            r.get("own_driver_allocs")
        ),
        ("1".into(), "0".into(), "1".into()),
        "the runtime allocates in the program's context; the pool stays out\n{}",
        r.stderr()
    );
    assert_eq!(r.get("own_free_rc"), "0");
    assert_eq!(
        (
            r.get("primary_rc"),
            r.get("primary_pool_creates"),
            r.get("primary_free_rc")
        ),
        ("0".into(), "1".into(), "0".into()),
        "back in the primary context: the pool"
    );
}

#[test]
fn multicast_binding_of_pytorch_pages_gets_real_handles_and_moves_nothing() {
    let r = pages("libc10_cuda.so", "multicast", &[]).ok();
    for (k, v) in [
        ("bind_addr_rc", "0"),
        ("bind_addr_split", "0"),
        ("bind_mem_rc", "0"),
        ("shrink_rc", "0"),
        ("intact", "1"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

#[test]
fn a_device_reset_frees_the_pools_allocations_as_it_frees_the_runtimes() {
    let r = run("reset", &[]).ok();
    for (k, v) in [
        ("used_before_mib", "64"),
        ("reset_rc", "0"),
        ("resets", "1"),
        ("used_after_mib", "0"),
        ("stale_free_rc", "1"),
        ("again_ok", "1"),
        ("again_free_rc", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

#[test]
fn a_primary_context_reset_frees_the_pools_allocations_for_driver_programs() {
    let r = run_in(&fixture().dir, "drv", &["reset"], &[]).ok();
    for round in ["r0", "r1"] {
        for (k, v) in [
            ("used_before_mib", "64"),
            ("reset_rc", "0"),
            ("used_after_mib", "0"),
            ("stale_free_rc", "1"),
        ] {
            let key = format!("{round}_{k}");
            assert_eq!(r.get(&key), v, "{key}\n{}\n{}", r.stdout(), r.stderr());
        }
    }
    assert_eq!(r.get("resets"), "2");
}

#[test]
fn a_reset_between_an_id_read_and_its_record_frees_nothing_made_after_it() {
    // One thread's allocation reads the primary context's id just before another thread's
    // hooked reset and answers after it: recorded, the old id would make the next call take
    // the new one for a reset no hook saw, and free the allocation made after the reset.
    let r = run_in(&fixture().dir, "drv", &["reset_race"], &[]).ok();
    for (k, v) in [
        ("racer_alloc_rc", "0"),
        ("reset_rc", "0"),
        ("after_alloc_rc", "0"),
        ("racer_free_rc", "0"),
        ("after_free_rc", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
    assert!(
        !r.stderr().contains("was reset (context id"),
        "{}",
        r.stderr()
    );
}

#[test]
fn opening_a_ticket_twice_is_one_more_reference_to_the_same_memory() {
    // Unkept: the last close unmaps (kept mappings: the next test).
    let r = share(
        "expseg",
        &[("CONSUMER_TWICE", "1"), ("EXPSEG_IPC_KEEP_CLOSED", "0")],
    )
    .ok();
    for (k, v) in [
        ("open_rc", "0"),
        ("open2_rc", "0"),
        ("same_ptr", "1"),
        ("close_1", "0"),
        ("kept_after_one_close", "1"),
        ("close_2", "0"),
        ("unmapped", "1"),
        ("close_3", "1"),
    ] {
        assert_eq!(nth(&r, k, 0), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

#[test]
fn a_consumer_keeps_memory_it_closed_mapped_until_the_producer_frees_it() {
    // The consumer closes, opens the same handle again (nothing mapped anew, the same
    // address, the same memory both ways), closes; the producer's free then returns only
    // once the consumer unmapped it (natively the memory is back on the GPU at the free).
    // With EXPSEG_IPC_KEEP_CLOSED=0 the close unmaps and the open maps again.
    for (keep, mapped, maps) in [("1", "1", "0"), ("0", "0", "1")] {
        let same = if keep == "1" { "1" } else { r#"either"# };
        let r = share_in("share_kept", "expseg", &[("EXPSEG_IPC_KEEP_CLOSED", keep)]).ok();
        assert!(
            !r.stderr().contains("did not answer"),
            "keep {keep}: the consumer answers, or keeps nothing\n{}",
            r.stderr()
        );
        for (k, v) in [
            ("kept_open_rc", "0"),
            ("kept_sees", "1"),
            ("kept_close_rc", "0"),
            ("mapped_after_close", mapped),
            ("reopen_rc", "0"),
            ("same_ptr", same),
            ("reopen_sees", "1"),
            ("reopen_maps", maps),
            ("close2_rc", "0"),
            ("close3_fails", "1"),
            ("producer_sees_consumer_write", "1"),
            ("free_rc", "0"),
            ("unmapped_after_producer_free", "1"),
            ("consumer_exit", "0"),
        ] {
            if v == "either" {
                continue; // the reservation freed at the close may be the open's again
            }
            assert_eq!(
                nth(&r, k, 0),
                v,
                "keep {keep}: {k}\n{}\n{}",
                r.stdout(),
                r.stderr()
            );
        }
    }
}

#[test]
fn a_device_reset_ends_memory_opened_through_a_ticket() {
    let r = share("expseg", &[("CONSUMER_RESET", "1")]).ok();
    for (k, v) in [
        ("open_rc", "0"),
        ("reset_rc", "0"),
        ("after_reset_mapped", "0"),
        ("close_after_reset_fails", "1"),
    ] {
        assert_eq!(nth(&r, k, 0), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

#[test]
fn a_static_runtimes_device_reset_frees_the_pool_as_the_runtimes_memory_goes() {
    // The static runtime's reset reaches no hook; expseg sees the primary context's new id at
    // the next driver call. Before: the pool kept the allocation and its cudaFree answered 0
    // (native: 1, H100, scripts/vmm-cost/reset_vmm.cu).
    let f = fixture();
    let r = run_in(&f.dir, "static_prog", &["reset"], &[]).ok();
    for (k, v) in [
        ("free_after_reset", "1"),
        ("pool_gave_back", "1"),
        ("meminfo_gave_back", "1"),
        ("free_after_second_reset", "1"),
        ("meminfo_same", "1"),
        ("new_alloc_ok", "1"),
        ("new_free", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

#[test]
fn a_ticket_of_coalesced_pages_opens_while_the_coalescers_run() {
    // The ticket's thread used to ask whether the run's pages were parked while its own read
    // was registered, and the coalescers' lock waits for every read to end: it waited for
    // itself, holding that lock (PyTorch IPC to an expseg consumer hung, H100, 2026-11-25).
    let r = pages("libc10_cuda.so", "share_ticket", &[]).ok();
    for (k, v) in [
        ("ipc_rc", "0"),
        ("ticket", "1"),
        ("open_rc", "0"),
        ("consumer_sees", "1"),
        ("close_rc", "0"),
        ("consumer_exit", "0"),
        ("written", "1"),
        ("shrink_rc", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

#[test]
fn nccl_buffer_registration_of_pytorch_pages_exports_the_page_itself() {
    let r = pages("libc10_cuda.so", "nccl_register", &[]).ok();
    for (k, v) in [
        ("range_rc", "0"),
        ("range_is_page", "1"),
        ("retain_rc", "0"),
        ("export_rc", "0"),
        ("peer_sees_page", "1"),
        ("shrink_rc", "0"),
        ("intact", "1"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}\n{}", r.stdout(), r.stderr());
    }
}

/// The library's own defaults (`pages` turns the tail's handle off for the handle counts), but
/// for learned placement (`EXPSEG_LEARN_CUTS`): with it, pages at new addresses get handles of
/// their own and this program strands nothing, and it is the no-move rule that is tested
/// where a handle strands (learned placement: src/coalesce/tests/cuts.rs).
const DEFAULTS: [(&str, &str); 2] = [("EXPSEG_SPLIT_TAIL", "1"), ("EXPSEG_LEARN_CUTS", "0")];

#[test]
fn at_the_defaults_no_live_page_moves() {
    // Released pages of a live handle stay held (EXPSEG_COMPACT off): cudaMemGetInfo moves
    // nothing, and the data, the pages mapped again there and the export are as they were.
    let r = pages("libc10_cuda.so", "full", &DEFAULTS).ok();
    for (k, v) in [
        ("used_stranded_mib", "160"),
        ("used_compacted_mib", "160"),
        ("live_intact", "1"),
        ("regrow_rc", "0"),
        ("all_intact", "1"),
        ("export_rc", "0"),
        ("shared_both_ways", "1"),
        ("used_end", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}", r.stdout());
    }
    // The program's own trim and pause move nothing either: the stranded bytes stay held
    // (trim), or go with their handle and come back with it (pause).
    let t = pages(
        "libc10_cuda.so",
        "full",
        &[DEFAULTS[0], DEFAULTS[1], ("TRIM_THREAD", "1")],
    )
    .ok();
    let p = pages(
        "libc10_cuda.so",
        "full",
        &[DEFAULTS[0], DEFAULTS[1], ("PAUSE_THREAD", "1")],
    )
    .ok();
    for (r, k, v) in [
        (&t, "trim_thread_mib", "0"),
        (&t, "used_compacted_mib", "160"),
        (&t, "all_intact", "1"),
        (&p, "pause_rc", "0"),
        (&p, "paused_mib", "160"),
        (&p, "resume_rc", "0"),
        (&p, "all_intact", "1"),
        (&p, "used_end", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}", r.stdout());
    }
    // A thread launching on the pages while the allocator's thread releases the rest of their
    // batch and asks cudaMemGetInfo: nothing moves, so nothing is met or lost.
    let r = launch_race(&DEFAULTS);
    assert!(r.out.status.success(), "{}\n{}", r.stdout(), r.stderr());
    for (k, v) in [("race_bad", "0"), ("race_moved", "0"), ("graphs", "0")] {
        assert_eq!(r.get(k), v, "{k}\n{}", r.stdout());
    }
    // Two devices' threads: no call moves another's pages, or its own.
    let r = pages(
        "libc10_cuda.so",
        "two_threads",
        &[DEFAULTS[0], DEFAULTS[1], ("FAKE_DEVICES", "2")],
    )
    .ok();
    for (k, v) in [
        ("used_stranded_mib", "320"),
        ("used_after_dev0_thread_mib", "320"),
        ("used_after_dev0_addrfree_mib", "320"),
        ("used_after_dev1_thread_mib", "320"),
        ("live_intact", "1"),
        ("used_end", "0"),
    ] {
        assert_eq!(r.get(k), v, "{k}\n{}", r.stdout());
    }
}

#[test]
fn a_move_in_place_beside_the_ticket_checks_own_cudamalloc_keeps_its_address() {
    // The first handle request starts the ticket check on its own thread; its 2 MiB
    // cudaMalloc must not take the range a move has just released (GPU, e91e84d: the move's
    // cudaMalloc landed elsewhere, the range was lost, and the program's pointer addressed the
    // check's buffer).
    let f = fixture();
    let dir = f.dir.join("sock-move-check");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for round in 0..3 {
        let r = run(
            "move_beside_check_malloc",
            &[
                ("FAKE_MALLOC_REUSES_VA", "1"),
                ("FAKE_FREEVA_MS", "200"),
                ("EXPSEG_TEST_SLOW_CHECK", "20"),
                ("EXPSEG_IPC_MOVE_MAX", "20M"),
                ("EXPSEG_IPC_DIR", dir.to_str().unwrap()),
            ],
        )
        .ok();
        assert_eq!(r.get("ipc_rc"), "0", "round {round}: {}", r.stderr());
        assert_eq!(
            r.get("pool_after"),
            "0",
            "round {round}: not moved: {}",
            r.stderr()
        );
        assert_eq!(r.get("data_ok"), "1", "round {round}");
        assert_eq!(r.get("free_rc"), "0", "round {round}");
    }
}

/// The figure `key` of a JSON exit report (0 where the report leaves it out: no such calls).
#[cfg(feature = "test-switches")]
fn report_figure(json: &str, key: &str) -> u64 {
    let pat = format!("\"{key}\":");
    json.find(&pat).map_or(0, |at| {
        let rest = &json[at + pat.len()..];
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        rest[..end].parse().unwrap()
    })
}

#[cfg(feature = "test-switches")]
#[test]
fn a_trace_of_the_coalescers_calls_replays_to_the_figures_of_the_run() {
    use expseg::coalesce::replay::Replay;
    use expseg::coalesce::CoalesceConfig;
    use expseg::config::Config;
    use expseg::gpu::Op;
    const CAPACITY: u64 = 140 << 30;
    let cap = CAPACITY.to_string();
    let dir = fixture().dir.join("trace");
    // PyTorch's pages on two devices, at random, with cudaMemGetInfo now and then: released at
    // once, kept for 2 ms (the releaser thread's calls are in the trace), and segment ranges
    // travelling between devices; one device's full scenario with compaction, export, retain
    // and pause.
    let runs: [(&str, &[(&str, &str)]); 4] = [
        ("two_random", &[("FAKE_DEVICES", "2")]),
        (
            "two_random",
            &[("FAKE_DEVICES", "2"), ("EXPSEG_RELEASE_DELAY", "2")],
        ),
        ("two_recycle", &[("FAKE_DEVICES", "2")]),
        ("full", &[("EXPSEG_COMPACT", "1"), ("PAUSE_THREAD", "1")]),
    ];
    for (scenario, extra) in runs {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let prefix = dir.join("t");
        let report = dir.join("report.txt");
        let mut env: Vec<(&str, &str)> = vec![
            ("FAKE_CAPACITY", &cap),
            ("EXPSEG_TEST_TRACE", prefix.to_str().unwrap()),
            ("EXPSEG_REPORT", report.to_str().unwrap()),
        ];
        env.extend_from_slice(extra);
        let what = format!("{scenario} {extra:?}");
        let report_json = dir.join("report.txt.json");
        // The report leaves the coalescers' figures out when their lock is busy at exit (the
        // releaser thread's pass): then once more.
        let mut r = pages("libc10_cuda.so", scenario, &env).ok();
        for _ in 0..3 {
            let json = std::fs::read_to_string(&report_json).unwrap_or_default();
            if json.contains("\"coalesce_peak_held_bytes\"") {
                break;
            }
            std::fs::remove_dir_all(&dir).unwrap();
            std::fs::create_dir_all(&dir).unwrap();
            r = pages("libc10_cuda.so", scenario, &env).ok();
        }
        let traces: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "trace"))
            .collect();
        assert_eq!(traces.len(), 1, "{what}: {traces:?}\n{}", r.stderr());
        let json = std::fs::read_to_string(&report_json).unwrap();
        assert!(
            json.contains("\"coalesce_peak_held_bytes\""),
            "{what}: {json}"
        );
        // The replay's configuration: the run's own variables (`pages` sets some).
        let mut vars = vec![
            ("FAKE_MEMINFO_REAL", "1"),
            ("EXPSEG_SPLIT_TAIL", "0"),
            ("EXPSEG_LEARN_CUTS", "0"),
        ];
        vars.extend_from_slice(&env);
        let config = Config::from_lookup(
            |name| {
                vars.iter()
                    .rev()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| Ok(v.to_string()))
            },
            |bad| panic!("{bad}"),
        );
        let mut replay = Replay::new(
            CoalesceConfig::from_config(&config, true),
            config.pause_keep_host.keeps(),
            CAPACITY,
        );
        // Up to the report's queries (its figures): a thread may still call a coalescer
        // (the releaser) between the report and the trace's last flush.
        let text = std::fs::read_to_string(&traces[0]).unwrap();
        let end = text
            .rfind(" stranded_now = ")
            .map_or(text.len(), |at| at + text[at..].find('\n').unwrap() + 1);
        let mut progress = 0;
        replay
            .read(&text.as_bytes()[..end], Some(10), |_| progress += 1)
            .unwrap();
        let s = replay.summary();
        let line = s.json(None, true);
        assert!(s.events > 50 && progress == s.events / 10, "{what}: {line}");
        assert_eq!(s.skipped, 0, "{what}: {line}");
        assert_eq!(s.mismatches, 0, "{what}: {line}");
        assert_eq!(s.va_conflicts, 0, "{what}: {line}");
        assert!(s.recorded_releaser, "{what}: {line}");
        assert!(s.peak_held > 0, "{what}: {line}");
        let devices = extra.iter().any(|(k, v)| *k == "FAKE_DEVICES" && *v == "2");
        assert_eq!(s.devices, if devices { 2 } else { 1 }, "{what}: {line}");
        for (key, got) in [
            ("coalesce_peak_stranded_bytes", s.peak_stranded),
            ("coalesce_peak_held_bytes", s.peak_held),
            ("coalesce_peak_beyond_bytes", s.peak_beyond),
            ("coalesce_stranded_bytes", s.final_stranded),
            ("coalesce_handles_created", s.phys_created),
            ("coalesce_handles_released", s.phys_released),
            ("coalesce_compactions", s.compactions),
            ("coalesce_compacted_bytes", s.compacted_bytes),
            ("coalesce_moves_declined", s.moves_declined),
            ("coalesce_create", s.calls_of(Op::Create)),
            ("coalesce_release", s.calls_of(Op::Release)),
            ("coalesce_map", s.calls_of(Op::Map)),
            ("coalesce_unmap", s.calls_of(Op::Unmap)),
            ("coalesce_set_access", s.calls_of(Op::SetAccess)),
            ("coalesce_copy", s.calls_of(Op::Copy)),
            ("coalesce_reserve", s.calls_of(Op::Reserve)),
            ("coalesce_meminfo", s.meminfo_calls()),
        ] {
            assert_eq!(
                report_figure(&json, key),
                got,
                "{what}: {key}\nreplay: {line}\nreport: {json}"
            );
        }
        if scenario == "full" {
            assert!(s.compactions > 0, "{what}: {line}");
        }
    }
}
