//! `expseg doctor`: can expseg work on this machine? The verdict, then a table with a verdict
//! per line, problems first and defaults last (`--json`: one object); exits 1 when it cannot
//! (no driver, no device it can serve, a library built for a newer glibc); a device it cannot
//! serve beside others it can, an invalid value and an `EXPSEG_*` variable expseg does not
//! read are warnings.
//!
//! `expseg glibc FILE`: the highest glibc version FILE requires (the portable-build check).
//!
//! `expseg pause|resume|paused PID...`: pause and resume the GPU memory of running expseg
//! processes of the calling user, over their sockets (`expseg::ipc::control`). Processes
//! found by `--tree`, `--gpu` or `--all` that are not expseg processes of the user's are
//! skipped with a note, and a way of finding that finds none says so; a named PID that does
//! not exist ("no such process") or does not answer is a failure (exit 1), and so is finding
//! none that answers. Sizes are printed for people (`16.2 GiB`), or in bytes as JSON lines
//! with `--json`.
//!
//! Every command answers `--help` (the same text as `expseg help CMD`); a command line it
//! cannot read is named in one line with a hint, exit status 2, as git and cargo do.

mod control;
mod whole;

use expseg::config::Config;
use expseg::real::{self, DriverTable};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Verdict {
    Info,
    Ok,
    Warn,
    Fail,
}

impl Verdict {
    fn tag(self) -> &'static str {
        match self {
            Verdict::Info => "info",
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One line of the table: what was checked, its verdict, what was found.
struct Row {
    check: String,
    value: String,
    verdict: Verdict,
}

/// An `EXPSEG_*` variable of the library's table: its effective value, whether it is set, and
/// what is wrong with what is set (an invalid value: the default is used).
struct ConfigRow {
    name: &'static str,
    value: String,
    set: bool,
    problem: Option<String>,
}

impl ConfigRow {
    fn row(&self) -> Row {
        match &self.problem {
            Some(p) => Row {
                check: self.name.into(),
                value: p.clone(),
                verdict: Verdict::Warn,
            },
            None => Row {
                check: self.name.into(),
                value: format!("{}{}", self.value, if self.set { "" } else { " (default)" }),
                verdict: Verdict::Info,
            },
        }
    }
}

/// What `expseg doctor` found: the machine's checks, the configuration, and the `EXPSEG_*`
/// variables expseg does not read.
struct Report {
    rows: Vec<Row>,
    config: Vec<ConfigRow>,
    unknown: Vec<expseg::config::Unknown>,
}

impl Report {
    fn add(&mut self, check: impl Into<String>, value: impl Into<String>, verdict: Verdict) {
        self.rows.push(Row {
            check: check.into(),
            value: value.into(),
            verdict,
        });
    }

    fn works(&self) -> bool {
        self.rows.iter().all(|r| r.verdict != Verdict::Fail)
    }

    /// Why the verdict is what it is: the FAIL lines, then the warnings (the machine's, invalid
    /// values, unknown variables).
    fn reasons(&self) -> Vec<Row> {
        let mut out: Vec<Row> = Vec::new();
        for v in [Verdict::Fail, Verdict::Warn] {
            out.extend(self.rows.iter().filter(|r| r.verdict == v).map(|r| Row {
                check: r.check.clone(),
                value: r.value.clone(),
                verdict: r.verdict,
            }));
        }
        out.extend(
            self.config
                .iter()
                .filter(|c| c.problem.is_some())
                .map(ConfigRow::row),
        );
        out.extend(self.unknown.iter().map(|u| Row {
            check: u.name.clone(),
            value: u.message(),
            verdict: Verdict::Warn,
        }));
        out
    }

    /// The verdict in one line.
    fn summary(&self) -> String {
        let warnings = self.reasons().len();
        if !self.works() {
            "expseg cannot work here (FAIL lines); programs run under it pass everything through."
                .into()
        } else if warnings > 0 {
            let s = if warnings == 1 { "" } else { "s" };
            format!("expseg can work here, with {warnings} warning{s} (below).")
        } else {
            "expseg can work here.".into()
        }
    }

    /// For people: the verdict first, then what is wrong, the machine's other checks, the
    /// variables set, and the defaults last; one table, each row once.
    fn print(&self) {
        let reasons = self.reasons();
        let machine: Vec<&Row> = self
            .rows
            .iter()
            .filter(|r| r.verdict <= Verdict::Ok)
            .collect();
        let fine = |set: bool| -> Vec<Row> {
            self.config
                .iter()
                .filter(|c| c.problem.is_none() && c.set == set)
                .map(ConfigRow::row)
                .collect()
        };
        let (set, defaults) = (fine(true), fine(false));
        let w = reasons
            .iter()
            .chain(machine.iter().copied())
            .chain(&set)
            .chain(&defaults)
            .map(|r| r.check.len())
            .chain(["configuration".len()])
            .max()
            .unwrap_or(0);
        let table = |title: &str, rows: &mut dyn Iterator<Item = &Row>| {
            println!("\n{title:<w$}  {:<7}  value", "verdict");
            for r in rows {
                let (check, tag, value) = (&r.check, r.verdict.tag(), &r.value);
                println!("{check:<w$}  {tag:<7}  {value}");
            }
        };
        println!("{}", self.summary());
        if !reasons.is_empty() {
            table("problems", &mut reasons.iter());
        }
        table("check", &mut machine.into_iter());
        table("configuration", &mut set.iter().chain(&defaults));
    }

    /// One JSON object: the verdict, the reasons, the machine's checks, the configuration and
    /// the unknown variables.
    fn json(&self) -> String {
        use control::json_str;
        let row = |r: &Row| {
            format!(
                "{{\"check\":{},\"verdict\":{},\"value\":{}}}",
                json_str(&r.check),
                json_str(&r.verdict.tag().to_ascii_lowercase()),
                json_str(&r.value)
            )
        };
        let list = |items: Vec<String>| format!("[{}]", items.join(","));
        let reasons = self.reasons();
        let verdict = if !self.works() {
            "fail"
        } else if reasons.is_empty() {
            "ok"
        } else {
            "warn"
        };
        let config = self.config.iter().map(|c| {
            let problem = c
                .problem
                .as_ref()
                .map_or(String::new(), |p| format!(",\"problem\":{}", json_str(p)));
            format!(
                "{{\"variable\":{},\"value\":{},\"set\":{}{problem}}}",
                json_str(c.name),
                json_str(&c.value),
                c.set
            )
        });
        let unknown = self.unknown.iter().map(|u| {
            format!(
                "{{\"variable\":{},\"did_you_mean\":{}}}",
                json_str(&u.name),
                json_str(u.closest)
            )
        });
        format!(
            "{{\"verdict\":{},\"works\":{},\"summary\":{},\"reasons\":{},\"checks\":{},\"config\":{},\"unknown_variables\":{}}}",
            json_str(verdict),
            self.works(),
            json_str(&self.summary()),
            list(reasons.iter().map(row).collect()),
            list(self.rows.iter().map(row).collect()),
            list(config.collect()),
            list(unknown.collect()),
        )
    }
}

fn exe_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."))
}

fn libc_version() -> String {
    extern "C" {
        fn gnu_get_libc_version() -> *const c_char;
    }
    // SAFETY: returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(gnu_get_libc_version()) }
        .to_string_lossy()
        .into_owned()
}

fn check_glibc(r: &mut Report, lib: &Path) {
    let system = libc_version();
    r.add("glibc (system)", system.clone(), Verdict::Info);
    match std::fs::read(lib)
        .map_err(|e| e.to_string())
        .and_then(|b| expseg::elf::glibc_requirement(&b).map_err(str::to_string))
    {
        Ok(Some(need)) => {
            let ok = expseg::elf::parse_version(&system) >= expseg::elf::parse_version(&need);
            r.add(
                "glibc needed by libexpseg.so",
                format!("{need} ({})", lib.display()),
                if ok { Verdict::Ok } else { Verdict::Fail },
            );
        }
        Ok(None) => r.add("glibc needed by libexpseg.so", "none", Verdict::Ok),
        Err(e) => r.add(
            "libexpseg.so",
            format!("{}: {e}", lib.display()),
            Verdict::Fail,
        ),
    }
}

fn check_driver(r: &mut Report) -> Option<(&'static DriverTable, i32)> {
    let t = match real::driver() {
        Ok(t) => t,
        Err(e) => {
            r.add("NVIDIA driver", e, Verdict::Fail);
            return None;
        }
    };
    // SAFETY: driver calls with valid out-pointers.
    unsafe {
        if (t.cuInit)(0) != 0 {
            r.add(
                "NVIDIA driver",
                "cuInit failed (no usable GPU?)",
                Verdict::Fail,
            );
            return None;
        }
        let mut v = 0;
        if let Some(f) = t.cuDriverGetVersion {
            f(&mut v);
        }
        r.add(
            "driver CUDA version",
            format!("{}.{}", v / 1000, v % 1000 / 10),
            Verdict::Info,
        );
        let mut n = 0;
        (t.cuDeviceGetCount)(&mut n);
        r.add(
            "devices",
            n.to_string(),
            if n > 0 { Verdict::Ok } else { Verdict::Fail },
        );
        Some((t, n))
    }
}

/// One row per device; whether expseg can serve any of them (VMM, and its pool opens). A
/// device it cannot serve is a warning (its allocations pass through); none at all fails.
fn check_devices(r: &mut Report, t: &'static DriverTable, n: i32) -> bool {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let mut any_served = false;
    for d in 0..n {
        let mut name = [0 as c_char; 128];
        let attr = |a: A| {
            let mut v = 0;
            // SAFETY: valid out-pointer and device ordinal.
            unsafe { (t.cuDeviceGetAttribute)(&mut v, a, d) };
            v
        };
        if let Some(f) = t.cuDeviceGetName {
            // SAFETY: the buffer holds 128 bytes.
            unsafe { f(name.as_mut_ptr(), name.len() as c_int, d) };
        }
        // SAFETY: NUL-terminated by the driver (or zeroed).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let vmm = attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 0;
        let fd = attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) != 0;
        r.add(format!("device {d}"), name, Verdict::Info);
        r.add(
            format!("device {d} VMM"),
            if vmm {
                "supported"
            } else {
                "not supported: its allocations pass through"
            },
            if vmm { Verdict::Ok } else { Verdict::Warn },
        );
        r.add(
            format!("device {d} POSIX-fd handles"),
            if fd {
                "supported"
            } else {
                "not supported: no IPC tickets"
            },
            if fd { Verdict::Ok } else { Verdict::Warn },
        );
        if vmm {
            let mut drv = match expseg::gpu::cuda::CudaDriver::open(t, d) {
                Ok(drv) => drv,
                Err(e) => {
                    r.add(
                        format!("device {d} pool"),
                        format!("{e}: its allocations pass through"),
                        Verdict::Warn,
                    );
                    continue;
                }
            };
            any_served = true;
            use expseg::gpu::Driver;
            r.add(
                format!("device {d} granularity"),
                format!("{} KiB", drv.granularity() / 1024),
                Verdict::Info,
            );
            let g = drv.granularity();
            let exported = drv.create(g).and_then(|h| {
                let fd = drv.export_fd(h);
                let _ = drv.release(h);
                fd
            });
            match exported {
                Ok(_) => r.add(format!("device {d} POSIX-fd export"), "works", Verdict::Ok),
                Err(e) => r.add(
                    format!("device {d} POSIX-fd export"),
                    format!("failed ({e}): no IPC tickets"),
                    Verdict::Warn,
                ),
            }
        }
    }
    any_served
}

/// EXPSEG_KEEP: whether released memory is kept where only expseg processes share a GPU, and
/// whether NVML can list each GPU's processes for it.
fn check_keep(r: &mut Report, t: &'static DriverTable, n: i32) {
    let c = Config::from_lookup(Config::env_value, |_| {});
    if !c.keep_auto {
        r.add(
            "released memory (EXPSEG_KEEP)",
            "off (the default): memory the program releases goes back to the driver at once; EXPSEG_KEEP=auto keeps it while only expseg processes of yours share the GPU (opt-in: a plain process arriving may find it not yet given back)",
            Verdict::Info,
        );
        return;
    }
    if !c.sockets {
        r.add(
            "released memory (EXPSEG_KEEP)",
            "auto, but EXPSEG_SOCKETS=0: nothing is kept (no other process could ask for it)",
            Verdict::Warn,
        );
        return;
    }
    if c.release_delay_ms > 0 {
        r.add(
            "released memory (EXPSEG_KEEP)",
            format!("auto, but EXPSEG_RELEASE_DELAY={} is set and rules: kept for that long whoever shares the GPU", c.release_delay_ms),
            Verdict::Info,
        );
        return;
    }
    for d in 0..n {
        let listed = expseg::gpu::cuda::device_uuid(t, d).and_then(|u| real::nvml::gpu(&u));
        match listed {
            Some(_) => r.add(
                format!("released memory kept, GPU {d}"),
                format!("auto: NVML lists the GPU's processes; kept while all others are expseg processes of yours, given back when another arrives; {}", match c.keep_giveback_ms {
                    0 => "EXPSEG_KEEP_GIVEBACK=0: no bound on what is kept (a plain process arriving may find it not yet given back)".to_string(),
                    ms => format!("at most what gives back in about {ms} ms (EXPSEG_KEEP_GIVEBACK)"),
                }),
                match c.keep_giveback_ms {
                    0 => Verdict::Warn,
                    _ => Verdict::Ok,
                },
            ),
            None => r.add(
                format!("released memory kept, GPU {d}"),
                "auto, but NVML cannot list the GPU's processes (no libnvidia-ml.so.1, or a MIG instance): released memory goes back at once there",
                Verdict::Warn,
            ),
        }
    }
}

fn check_pidfd(r: &mut Report) {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "absent".into());
    // Asked of this process by a child, as a torch.multiprocessing consumer asks its parent
    // producer (a process asking itself is always allowed, whatever the settings).
    // SAFETY: the child makes only plain syscalls and leaves with _exit.
    let permitted = unsafe {
        match libc::fork() {
            0 => {
                let pfd = libc::syscall(libc::SYS_pidfd_open, libc::getppid(), 0) as c_int;
                let ok = pfd >= 0 && libc::syscall(libc::SYS_pidfd_getfd, pfd, 0, 0) >= 0;
                libc::_exit(if ok { 0 } else { 1 })
            }
            k if k > 0 => {
                let mut st = 0;
                libc::waitpid(k, &mut st, 0) == k
                    && libc::WIFEXITED(st)
                    && libc::WEXITSTATUS(st) == 0
            }
            _ => false,
        }
    };
    r.add(
        "pidfd_getfd",
        format!("{} (ptrace_scope {scope}); expseg passes descriptors over a Unix socket and does not need it, and where the kernel denies PyTorch's pidfd_getfd it serves the request when both processes run expseg", if permitted { "permitted" } else { "denied" }),
        Verdict::Info,
    );
}

/// The libcudart a PyTorch process loads, by asking one.
fn torch_cudart() -> Option<String> {
    let code = "import torch\ntorch.zeros(1, device='cuda')\nprint([l.split()[-1] for l in open('/proc/self/maps') if 'libcudart' in l][0])";
    let out = std::process::Command::new("python3")
        .args(["-c", code])
        .env_remove("LD_PRELOAD")
        .output()
        .ok()?;
    let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

fn check_ipc(r: &mut Report, cudart: Option<String>) {
    let path = std::env::var("EXPSEG_CUDART")
        .ok()
        .or(cudart)
        .unwrap_or_else(|| "libcudart.so.13".into());
    let Ok(c) = CString::new(path.clone()) else {
        return;
    };
    // SAFETY: loading the runtime and calling documented entry points with valid arguments.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
        if h.is_null() {
            r.add(
                "ticketed IPC handle (child process)",
                format!("cannot load {path}"),
                Verdict::Warn,
            );
            return;
        }
        let f = |n: &CStr| expseg::real::lookup::real(h, n);
        let (m, cp, g, fr) = (
            f(c"cudaMalloc"),
            f(c"cudaMemcpy"),
            f(c"cudaIpcGetMemHandle"),
            f(c"cudaFree"),
        );
        if m.is_null() || cp.is_null() || g.is_null() || fr.is_null() {
            r.add(
                "ticketed IPC handle (child process)",
                format!("{path} lacks the IPC functions"),
                Verdict::Warn,
            );
            return;
        }
        type Malloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
        type Copy = unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
        type Get = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
        type Free = unsafe extern "C" fn(*mut c_void) -> c_int;
        let m = std::mem::transmute::<*mut c_void, Malloc>(m);
        let cp = std::mem::transmute::<*mut c_void, Copy>(cp);
        let g = std::mem::transmute::<*mut c_void, Get>(g);
        let fr = std::mem::transmute::<*mut c_void, Free>(fr);
        let pattern: Vec<u8> = (0..64u8).map(|i| i ^ 0xa5).collect();
        let mut p: *mut c_void = std::ptr::null_mut();
        let mut handle = [0u8; 64];
        let made = m(&mut p, 2 << 20) == 0
            && cp(p, pattern.as_ptr().cast(), pattern.len(), 1) == 0
            && g(handle.as_mut_ptr().cast(), p) == 0;
        let result = if made {
            expseg::ipc::check_ticketed_handle(
                &exe_dir().join("expseg-ipc-check"),
                &path,
                handle,
                &pattern,
                0,
            )
        } else {
            Err("could not allocate and export a test buffer".into())
        };
        if !p.is_null() {
            fr(p);
        }
        match result {
            Ok(()) => r.add(
                "ticketed IPC handle (child process)",
                "opens with the plain driver: tickets on",
                Verdict::Ok,
            ),
            Err(e) => r.add(
                "ticketed IPC handle (child process)",
                format!("{e}: mirrors carry plain handles"),
                Verdict::Warn,
            ),
        }
    }
}

fn check_config(r: &mut Report) {
    let mut bad = Vec::new();
    let c = Config::from_lookup(Config::env_value, |l| bad.push(l));
    for (name, value) in c.effective() {
        if name.starts_with("EXPSEG_TEST_") && value.is_empty() {
            continue;
        }
        let problem = bad
            .iter()
            .find(|l| l.contains(&format!("invalid {name}=")))
            .map(|l| l.trim_start_matches("expseg: ").to_string());
        r.config.push(ConfigRow {
            name,
            value,
            // An empty value is as if unset.
            set: std::env::var_os(name).is_some_and(|v| !v.to_string_lossy().trim().is_empty()),
            problem,
        });
    }
    r.unknown = expseg::config::unknown_vars(std::env::vars_os());
}

fn doctor(json: bool) -> ExitCode {
    let mut r = Report {
        rows: Vec::new(),
        config: Vec::new(),
        unknown: Vec::new(),
    };
    let lib = std::env::var_os("EXPSEG_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| exe_dir().join("libexpseg.so"));
    check_glibc(&mut r, &lib);
    let cudart = torch_cudart();
    r.add(
        "libcudart of a PyTorch process",
        cudart
            .clone()
            .unwrap_or_else(|| "none found (no python3 with CUDA PyTorch)".into()),
        Verdict::Info,
    );
    if let Some((t, n)) = check_driver(&mut r) {
        if !check_devices(&mut r, t, n) && n > 0 {
            r.add(
                "VMM",
                "no device can be served (no VMM, or no context): expseg passes everything through",
                Verdict::Fail,
            );
        }
        check_keep(&mut r, t, n);
    }
    r.add(
        "beside sleep tools",
        "torch_memory_saver's preload hook serves cudaMalloc inside its regions (expseg passes those calls to it) and, where LD_PRELOAD names it, PyTorch's allocator keeps its default, as the hook needs; its torch mode and vLLM's sleep mode need EXPSEG_TORCH_DEFAULTS=0; 'expseg pause PID' (whole) pauses their memory too, 'expseg pause --pool' only expseg's",
        Verdict::Info,
    );
    check_pidfd(&mut r);
    if r.works() {
        check_ipc(&mut r, cudart);
    }
    check_config(&mut r);
    if json {
        println!("{}", r.json());
    } else {
        r.print();
    }
    if r.works() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

const HELP: &str = "\
usage: expseg COMMAND [ARGS...]

commands:
  doctor          can expseg work on this machine? one verdict per line
  pause PID...    pause running CUDA processes of yours, their GPU memory to host memory
  resume PID...   bring them back, at the same addresses
  paused PID...   how much memory is paused now
  glibc FILE      the highest GLIBC_ version FILE requires
  help COMMAND    a command's help (the same as expseg COMMAND --help)

options:
  -h, --help      this text
  -V, --version   expseg's version

Run a program under expseg with expseg-run CMD (or LD_PRELOAD=/path/to/libexpseg.so CMD).
The EXPSEG_* variables are listed in docs/configuration.md.
";

const DOCTOR_HELP: &str = "\
usage: expseg doctor [--json]

Can expseg work on this machine? One verdict per line (ok, info, warn, FAIL): the system's
glibc and the one libexpseg.so needs, the NVIDIA driver's CUDA version, each device's VMM
support, POSIX-fd handles, granularity and export, whether pidfd_getfd is permitted, whether
a ticketed IPC handle opens in a child process, which libcudart a PyTorch process loads, and
every EXPSEG_* variable with its effective value (invalid values named, and set variables
that expseg does not read, with the closest name it does).

output:
  the verdict first, then the problems (FAIL and warn lines), the other checks, the
  variables set, and the defaults last;
  --json: one JSON object instead:
    {\"verdict\":\"ok\",\"works\":true,\"summary\":\"expseg can work here.\",\"reasons\":[],
     \"checks\":[{\"check\":\"devices\",\"verdict\":\"ok\",\"value\":\"1\"},...],
     \"config\":[{\"variable\":\"EXPSEG_CACHE_MAX\",\"value\":\"0\",\"set\":false},...],
     \"unknown_variables\":[]}
  verdict is ok, warn or fail; reasons are the problems' lines, as in checks; a config
  entry with an invalid value has a \"problem\" (value is the default used); a variable
  expseg does not read is an entry of unknown_variables:
    {\"variable\":\"EXPSEG_DISABEL\",\"did_you_mean\":\"EXPSEG_DISABLE\"}

The library checked is $EXPSEG_LIB, else the libexpseg.so next to this program.
Exit status: 0 when expseg can work here, 1 when it cannot (FAIL lines).
";

const GLIBC_HELP: &str = "\
usage: expseg glibc FILE

Prints the highest GLIBC_ version the ELF file FILE requires (\"none\" if it needs none): the
check of the portable build. Exit status 2 when FILE cannot be read or is not ELF.
";

/// What `pause`, `resume` and `paused` share in their help: choosing processes, output, exit.
const SELECT_HELP: &str = "\
processes (any mix, at least one):
  PID             this process (it must answer)
  --all           every expseg process of yours
  --tree PID      PID and its descendants (a launcher and its workers)
  --gpu N         the processes nvidia-smi lists on GPU N (an index or a UUID)
Processes found by --all, --tree or --gpu that are not expseg processes of yours are
skipped with a note.

output:
  one line per process, sizes for people (\"pid 4242: paused 16.2 GiB in 0.87 s\");
  --json: one JSON object per process and line instead, sizes in bytes:
    {\"pid\":4242,\"command\":\"pause\",\"bytes\":17421041664,\"seconds\":0.871}
    {\"pid\":4243,\"command\":\"pause\",\"error\":\"...\",\"bytes\":0}  (bytes done before it failed)

Exit status: 0; 1 when a named PID does not exist or does not answer or a request fails, or
when no expseg process is found; 2 for a command line it cannot read.
";

const PAUSE_HELP: &str = "\
usage: expseg pause (PID | --all | --tree PID | --gpu N)... [--timeout S] [--json]
       expseg pause --pool (PID | --all | --tree PID | --gpu N)... [--discard] [--tag NAME] [--json]

Pauses running CUDA processes of yours, whole, with the driver's process checkpoint (driver
570 or later): each process's CUDA calls stop and the GPU work it queued finishes, then the
driver copies all its GPU memory (the context's, NCCL's and every library's too) to host memory
and gives the GPU back. Its threads run on; a CUDA call waits until 'expseg resume', which
brings the memory back at the same addresses. A program busy on the GPU is paused exactly. One
whose work does not stop within --timeout is not paused, nor one the driver cannot checkpoint
(UVM memory; on some drivers memory shared by IPC): the line says why, and it runs on.

  --timeout S     how long its work may take to stop (seconds, default 10)
  --pool          pause only the memory of the expseg pool (no driver checkpoint; live bytes
                  only, the context stays): the program must run no GPU work on paused
                  memory until it is resumed (pause between steps); memory shared with
                  other processes by IPC is left alone
  --discard       (--pool) drop the bytes instead of copying them (they come back
                  undefined); only where the process runs with EXPSEG_ALLOW_REMOTE_DISCARD=1
  --tag NAME      (--pool) only memory allocated under expseg.tag(NAME)
";

const RESUME_HELP: &str = "\
usage: expseg resume (PID | --all | --tree PID | --gpu N)... [--pool] [--tag NAME] [--json]

Brings a paused process back. Paused whole: the driver restores its GPU memory at the same
addresses and lets its CUDA calls go on. Paused with --pool: the pool's memory is made again,
at the same addresses, and its bytes copied back; where the GPU has too little free memory,
what fits is resumed and the rest stays paused with its bytes (exit status 1): resume again
once memory is free.

  --pool          only the pool's memory (not a driver checkpoint)
  --tag NAME      only memory allocated under expseg.tag(NAME)
";

const PAUSED_HELP: &str = "\
usage: expseg paused (PID | --all | --tree PID | --gpu N)... [--json]

How much GPU memory each process has paused now (a process the driver holds paused whole
says so).
";

/// A command's help text, whole.
fn command_help(cmd: &str) -> Option<String> {
    Some(match cmd {
        "doctor" => DOCTOR_HELP.to_string(),
        "glibc" => GLIBC_HELP.to_string(),
        "pause" => format!("{PAUSE_HELP}\n{SELECT_HELP}"),
        "resume" => format!("{RESUME_HELP}\n{SELECT_HELP}"),
        "paused" => format!("{PAUSED_HELP}\n{SELECT_HELP}"),
        "help" => HELP.to_string(),
        _ => return None,
    })
}

/// A command line expseg cannot read: one line naming what, a hint, exit status 2.
fn bad_usage(cmd: Option<&str>, what: &str) -> ExitCode {
    let who = cmd.map_or("expseg".to_string(), |c| format!("expseg {c}"));
    eprintln!("{who}: {what} (see '{who} --help')");
    ExitCode::from(2)
}

fn is_help(a: &str) -> bool {
    a == "--help" || a == "-h"
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(first) = args.first().map(String::as_str) else {
        eprint!("{HELP}");
        return ExitCode::from(2);
    };
    let rest = &args[1..];
    match first {
        "-h" | "--help" => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        "-V" | "--version" => {
            println!("expseg {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        "help" => {
            return match rest {
                [] => {
                    print!("{HELP}");
                    ExitCode::SUCCESS
                }
                [cmd] => match command_help(cmd) {
                    Some(h) => {
                        print!("{h}");
                        ExitCode::SUCCESS
                    }
                    None => bad_usage(None, &format!("unknown command '{cmd}'")),
                },
                [_, extra, ..] => bad_usage(Some("help"), &format!("unknown argument '{extra}'")),
            };
        }
        _ => {}
    }
    let Some(help) = command_help(first) else {
        let what = if first.starts_with('-') {
            "option"
        } else {
            "command"
        };
        return bad_usage(None, &format!("unknown {what} '{first}'"));
    };
    // `expseg CMD --help`: the same text as `expseg help CMD`, whatever else is on the line.
    if rest.iter().any(|a| is_help(a)) {
        print!("{help}");
        return ExitCode::SUCCESS;
    }
    match first {
        "doctor" => match rest.iter().find(|a| *a != "--json") {
            None => doctor(!rest.is_empty()),
            Some(a) if a.starts_with('-') => {
                bad_usage(Some("doctor"), &format!("unknown option '{a}'"))
            }
            Some(a) => bad_usage(Some("doctor"), &format!("unknown argument '{a}'")),
        },
        "glibc" => match rest {
            [file] if !file.starts_with('-') => glibc(file),
            [] => bad_usage(Some("glibc"), "FILE missing"),
            [a] => bad_usage(Some("glibc"), &format!("unknown option '{a}'")),
            [_, extra, ..] => bad_usage(Some("glibc"), &format!("unknown argument '{extra}'")),
        },
        cmd => control::control(cmd, rest),
    }
}

fn glibc(file: &str) -> ExitCode {
    match std::fs::read(file)
        .map_err(|e| e.to_string())
        .and_then(|b| expseg::elf::glibc_requirement(&b).map_err(str::to_string))
    {
        Ok(v) => {
            println!("{}", v.unwrap_or_else(|| "none".into()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("expseg glibc: {file}: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_has_its_help() {
        for cmd in ["doctor", "glibc", "pause", "resume", "paused", "help"] {
            let h = command_help(cmd).unwrap();
            assert!(h.starts_with("usage: expseg"), "{cmd}: {h}");
            assert!(!h.contains("scripts/"), "{cmd}: installed names only");
        }
        assert!(command_help("frobnicate").is_none());
    }
}
