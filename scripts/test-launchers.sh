#!/usr/bin/env bash
# The launch recipes of docs/launching.md, run without a GPU: plain LD_PRELOAD, expseg-run,
# torchrun, accelerate launch, Ray (runtime_env env_vars, `ray job submit --runtime-env-json`,
# a wrapped `ray start`), Slurm
# (expseg-srun, srun --export, the expseg.sbatch template), mpirun, and the installed forms
# (`python -m expseg --lib`, `expseg run`, `expseg srun`). Run by .ci/run.
#     scripts/test-launchers.sh [--real] [--torch] [path/to/libexpseg.so]
#
# Every process a launcher starts runs launcher-standins/probe.py, which prints its rank, its
# LD_PRELOAD and EXPSEG_* variables, the libexpseg.so that /proc/self/maps shows loaded, and
# the status of one cudaMalloc through the tests' fake CUDA runtime (tests/c), so that a process
# under expseg also writes its exit report; launcher-standins/verify.py checks those lines (and
# the report files) and names what is wrong.
#
# Where a launcher is installed, the real one runs (PASS ... [real]). Where it is not, a
# stand-in from launcher-standins/ does, one that starts processes with the environment the
# real launcher gives them (PASS ... [stand-in]); each stand-in's header says what it keeps of
# the real launcher. The launchers of scripts/install-launchers.sh's virtual environment
# (torchrun, accelerate, ray) come first on PATH when it exists. Slurm: where slurmctld, slurmd
# and munged are installed, scripts/slurm-local.sh starts a cluster of this one machine for the
# test (and stops it at the end, also on failure), and srun and sbatch (sbatch --wait) are the
# real ones; else srun is real inside an allocation (SLURM_JOB_ID set) and sbatch the stand-in.
# mpirun has no stand-in.
#
# --torch: every process is a rank of a PyTorch job (probe.py's PROBE_TORCH=1: a tensor on its
# GPU, or the CPU where there is none, and an all_reduce over the launcher's ranks, NCCL or
# gloo) instead of calling the fake CUDA runtime. CI runs the test both ways; on a GPU machine
# --torch is the 2-rank PyTorch job of every recipe.
#
# --real (CI): every launcher must be the real one. One that is missing, or whose set-up fails
# (the Slurm cluster, `ray start`), is a FAIL with the launcher's own message; nothing is
# skipped. scripts/install-launchers.sh installs them all.
set -u
t_start=$(date +%s.%N)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
standins=$here/launcher-standins
real_only= torch_job=
while [ $# -gt 0 ]; do
  case $1 in
    --real) real_only=1 ;;
    --torch) torch_job=1 ;;
    *) break ;;
  esac
  shift
done
lib=$(readlink -f "${1:-${EXPSEG_LIB:-$root/target/debug/libexpseg.so}}")
[ -f "$lib" ] || { echo "FAIL: $lib missing"; echo "0 passed, 1 failed"; exit 1; }
export EXPSEG_LIB=$lib
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the checkout from the stand-ins
unset EXPSEG_REPORT EXPSEG_REPORT_DIR LD_PRELOAD PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF RAY_ADDRESS \
  MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK PROBE_TORCH
venv=$("$here/install-launchers.sh" --print-venv)
[ -x "$venv/bin/python" ] && export PATH=$venv/bin:$PATH
work=$(mktemp -d)
# What the launchers leave in the temporary folder (torchrun's torchelastic_* logs, Open MPI's
# session files) goes into the test's folder and goes with it.
mkdir -p "$work/tmp" && export TMPDIR=$work/tmp
# EXPSEG_TEST_KEEP=1 keeps the test's folder (every check's output) and says where.
trap 'ray_stop; slurm_down; if [ -n "${EXPSEG_TEST_KEEP:-}" ]; then echo "kept: $work"; else rm -rf "$work"; fi' EXIT
ray_stop() { [ -n "${ray_cmd:-}" ] && PATH=$ray_path timeout 60 ray stop --force >/dev/null 2>&1; ray_cmd=; }
slurm_down() { [ -z "${slurm_dir:-}" ] || "$here/slurm-local.sh" down "$slurm_dir"; slurm_dir=; }
passed=0 failed=0
t_check=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f s", b - a }'; }
check() { # NAME KIND RC [DETAIL]
  local t
  t=$(elapsed "$t_check")
  case "$2" in
    *missing*) # --real, and a launcher is not installed: whatever ran instead does not count
      failed=$((failed + 1)); echo "FAIL $1 [$2]: $missing_why${4:+ | $4}" ;;
    *)
      if [ "$3" = 0 ]; then
        passed=$((passed + 1)); echo "PASS $1 [$2] ($t)"
      else
        failed=$((failed + 1)); echo "FAIL $1 [$2] ($t)${4:+: $4}"
      fi ;;
  esac
  t_check=$(date +%s.%N)
}
py=$(command -v python3)
probe=$standins/probe.py
# Whether this machine has an NVIDIA driver as expseg-run judges it: the dynamic loader finds a
# libcuda.so.1. Without one (CI), expseg-run leaves PyTorch's allocator alone (expseg passes
# every call through there) and tells the library to (EXPSEG_TORCH_DEFAULTS=0), so every
# process it starts, through any launcher, must see no PYTORCH_CUDA_ALLOC_CONF; with one, each
# must see expandable_segments:True.
driver_here=1
case "$(LD_PRELOAD=libcuda.so.1 /bin/true 2>&1)" in *"cannot be preloaded"*) driver_here= ;; esac
if [ -n "$driver_here" ]; then torch_alloc="expandable segments"; else torch_alloc="PyTorch's allocator left alone (no driver here)"; fi
# verify OUT ARGS...: verify.py's verdict as the exit status, its complaint (and the output's
# tail when no process reported) in $why. --torch (processes started by expseg-run): where
# there is no driver, every process's PYTORCH_CUDA_ALLOC_CONF is unset instead.
verify() {
  local out=$1 a args=() unset_alloc=; shift
  for a in "$@"; do
    if [ "$a" = --torch ] && [ -z "$driver_here" ]; then unset_alloc=1; else args+=("$a"); fi
  done
  why=$("$py" "$standins/verify.py" "$out" --lib "$lib" ${torch_job:+--torch-job} "${args[@]}" 2>&1)
  local r=$?
  if [ -n "$unset_alloc" ] && grep -o ' alloc=[^ ]*' "$out" | grep -qv '^ alloc=-$'; then
    why="${why:+$why; }PYTORCH_CUDA_ALLOC_CONF set without a driver: $(grep -o ' alloc=[^ ]*' "$out" | sort | uniq -c | tr '\n' ' ')"
    r=1
  fi
  [ $r = 0 ] || why="$why | output: $(grep -v '^PROBE' "$out" | tail -n 4 | tr '\n' ' ')"
  return $r
}
# newdir NAME: an empty directory for one check, and cd into it. Its output goes to ./out with
# >> (O_APPEND): processes sharing a file opened with > overwrite each other's lines (Python
# writes at the offset it last knew), which would look like a process that never ran.
# With --torch, the ranks that no torchrun gathers (srun's, mpirun's) meet at MASTER_ADDR and a
# new MASTER_PORT, set here as a user's job script sets them; torchrun sets its own.
newdir() {
  mkdir -p "$work/$1" && cd "$work/$1" || return 1
  if [ -n "$torch_job" ]; then
    export MASTER_ADDR=127.0.0.1
    MASTER_PORT=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    export MASTER_PORT
  fi
}
# use NAME: $path, a PATH on which NAME is the real launcher if installed, else its stand-in
# (alone in a folder, so that it shadows nothing else); $kind says which, $dir is that folder
# (empty for a real one). srun and sbatch count as installed with a cluster to run on (the
# local one, or for srun an allocation). With --real a missing launcher is "missing": the
# check fails whatever ran.
missing_why=
use() {
  local have=
  case $1 in
    srun) [ -n "${slurm_up:-}${SLURM_JOB_ID:-}" ] && command -v srun >/dev/null && have=1 ;;
    sbatch) [ -n "${slurm_up:-}" ] && have=1 ;;
    *) command -v "$1" >/dev/null && have=1 ;;
  esac
  if [ -n "$have" ]; then
    kind=real; dir=
  else
    kind=stand-in; dir=$work/standin-$1
    mkdir -p "$dir" && ln -sf "$standins/bin/$1" "$dir/$1"
    if [ -n "$real_only" ]; then
      kind=missing
      missing_why="--real: no real $1 ($(launcher_missing "$1"))"
    fi
  fi
  path=${dir:+$dir:}$PATH
}
launcher_missing() { # NAME: why NAME is not the real one
  case $1 in
    srun | sbatch)
      if [ -n "${slurm_error:-}" ]; then echo "the local Slurm cluster did not start: $slurm_error"
      else echo "Slurm is not installed: scripts/install-launchers.sh"; fi ;;
    *) echo "$1 is not on PATH: scripts/install-launchers.sh installs it into $venv" ;;
  esac
}

# The fake CUDA runtime of the preload tests, found through its rpath: no LD_LIBRARY_PATH, so
# the launchers themselves (PyTorch's, Ray's) never see it.
mkdir -p "$work/fakes"
(cd "$work/fakes" &&
  cc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o libcuda.so.1 "$root/tests/c/fake_cuda.c" &&
  cc -shared -fPIC -O1 -Wl,-soname,libcudart.so.13 "-Wl,--version-script=$root/tests/c/cudart.map" \
    "-Wl,-rpath,$work/fakes" -o libcudart.so.13 "$root/tests/c/fake_cudart.c" ./libcuda.so.1) >"$work/fakes.log" 2>&1
check "fake CUDA runtime builds" real $? "$(tail -3 "$work/fakes.log")"
# reports: whether the processes write exit reports (they do once they call CUDA: not a
# PyTorch job on a machine without a GPU), so that expseg-report-merge has a table to print.
reports=1
if [ -n "$torch_job" ]; then
  export PROBE_TORCH=1
  gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>"$work/torch.log")
  check "--torch: PyTorch $("$py" -c 'import torch; print(torch.__version__)' 2>&1 | tail -n 1) imports, sees ${gpus:-?} GPUs" real $? "$(tail -n 3 "$work/torch.log" | tr '\n' ' ')"
  [ "${gpus:-0}" -gt 0 ] || reports=
else
  export PROBE_CUDART=$work/fakes/libcudart.so.13
fi

# 1. Plain LD_PRELOAD, the user's own report path.
newdir plain
EXPSEG_REPORT=$PWD/r-%p.txt LD_PRELOAD=$lib "$py" "$probe" >>out 2>&1
verify out --n 1 --report "$PWD/r-%p.txt" --files
check "LD_PRELOAD=\$lib python3: loaded, serves cudaMalloc, writes its report" real $? "$why"

# 2. expseg-run: LD_PRELOAD, per-rank reports in ./expseg-reports, PyTorch's allocator setting.
newdir run
"$here/expseg-run" "$py" "$probe" >>out 2>&1
verify out --n 1 --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files --torch
check "expseg-run python3: library, EXPSEG_REPORT=./expseg-reports/rank%r-pid%p.txt, $torch_alloc" real $? "$why"

# expseg-run's command line: `--` ends its options, and what follows is the command, also one
# whose name starts with -; no command, or one that cannot be found, is one line (no script
# line number) with a shell's exit status.
newdir run-dash
mkdir -p bin && printf '#!/bin/sh\nexec %s %s "$@"\n' "$py" "$probe" >bin/-probe && chmod +x bin/-probe
PATH=$PWD/bin:$PATH "$here/expseg-run" -- -probe >>out 2>&1
verify out --n 1 --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files --torch
check "expseg-run -- -probe: a command whose name starts with - runs under expseg" real $? "$why"
# said WANT_RC WANT_STDERR COMMAND...: COMMAND prints nothing on stdout, exactly WANT_STDERR (one
# line) on stderr, and exits WANT_RC; else $why says what it did.
said() {
  local rc=$1 want=$2 o e r; shift 2
  o=$("$@" 2>stderr); r=$?; e=$(cat stderr)
  [ "$r" = "$rc" ] && [ -z "$o" ] && [ "$e" = "$want" ] && return 0
  why="$why${why:+ | }$*: rc $r (want $rc), stdout '$o', stderr '$e' (want '$want')"
  return 1
}
newdir run-usage
why= r=0
missing="expseg-run: CMD missing (usage: expseg-run [--] CMD [ARGS...]; see 'expseg-run --help')"
said 2 "$missing" "$here/expseg-run" || r=1
said 2 "$missing" "$here/expseg-run" -- || r=1
said 127 "expseg-run: no-such-command-4711: command not found" "$here/expseg-run" no-such-command-4711 || r=1
said 127 "expseg-run: -h: command not found" "$here/expseg-run" -- -h || r=1
said 127 "expseg-run: ./no-such-file: No such file or directory" "$here/expseg-run" ./no-such-file || r=1
touch not-executable
said 126 "expseg-run: ./not-executable: Permission denied" "$here/expseg-run" ./not-executable || r=1
[ ! -e expseg-reports ] || { r=1; why="$why | ./expseg-reports made for a command that did not run"; }
check "expseg-run, expseg-run --, a command not found or not executable: one line, exit 2, 127 or 126" real $r "$why"

# PyTorch's allocator: expandable segments only where expseg can work. The child's
# PYTORCH_CUDA_ALLOC_CONF is what the program sees (expseg-run's export, or the library's own
# default at load time), and expseg-run says once what it did.
newdir run-alloc
alloc() { # [VAR=VALUE...]: what expseg-run's child sees, and expseg-run's lines on stderr
  got=$(env "$@" "$here/expseg-run" sh -c 'echo "${PYTORCH_CUDA_ALLOC_CONF:--} ${EXPSEG_TORCH_DEFAULTS:--}"' 2>stderr)
  lines=$(cat stderr)
}
why= r=0
alloc EXPSEG_DISABLE=1
[ "$got" = "- -" ] && [ "$lines" = "expseg-run: EXPSEG_DISABLE=1: PyTorch's allocator left as it is" ] ||
  { r=1; why="EXPSEG_DISABLE=1: child sees '$got', expseg-run said '$lines'"; }
check "EXPSEG_DISABLE=1 expseg-run: PyTorch's allocator left alone, said in one line" real $r "$why"
# torch_memory_saver's hook preloaded (a stand-in of its name): it refuses expandable segments.
why= r=0
tms_so="$work/torch_memory_saver_hook_mode_preload.so"
cc -shared -fPIC -o "$tms_so" -x c /dev/null 2>/dev/null || r=1
alloc LD_PRELOAD="$tms_so" LD_LIBRARY_PATH="$work/fakes${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ "$got" = "- 0" ] && [ "$lines" = "expseg-run: torch_memory_saver is preloaded: PyTorch's allocator left as it is (it refuses expandable segments)" ] ||
  { r=1; why="child sees '$got', expseg-run said '$lines'"; }
check "expseg-run beside torch_memory_saver's preloaded hook: PyTorch's allocator left alone (EXPSEG_TORCH_DEFAULTS=0 for the library), said in one line" real $r "$why"
# A driver for the loader: the fake libcuda.so.1, through LD_LIBRARY_PATH.
why= r=0
alloc LD_LIBRARY_PATH="$work/fakes${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ "$got" = "expandable_segments:True -" ] && [ "$(grep -c 'expandable_segments:True' stderr)" = 1 ] &&
  [ "$(wc -l <stderr)" = 1 ] || { r=1; why="child sees '$got', expseg-run said '$lines'"; }
check "expseg-run where libcuda.so.1 loads: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, said in one line" real $r "$why"
if [ -z "$driver_here" ]; then
  why= r=0
  alloc
  [ "$got" = "- 0" ] && [ "$lines" = "expseg-run: no NVIDIA driver here (libcuda.so.1 cannot be loaded): PyTorch's allocator left as it is" ] ||
    { r=1; why="no driver: child sees '$got', expseg-run said '$lines'"; }
  alloc EXPSEG_TORCH_DEFAULTS=1
  [ "$got" = "expandable_segments:True 1" ] || { r=1; why="$why | EXPSEG_TORCH_DEFAULTS=1: child sees '$got', expseg-run said '$lines'"; }
  check "expseg-run without a driver: PyTorch's allocator left alone (EXPSEG_TORCH_DEFAULTS=0 for the library), said in one line; EXPSEG_TORCH_DEFAULTS=1 applies it" real $r "$why"
else
  echo "SKIP expseg-run without a driver: libcuda.so.1 loads here"
fi

# 3. torchrun under expseg-run: every worker.
use torchrun
newdir torchrun
PATH=$path "$here/expseg-run" torchrun --standalone --nproc-per-node 2 "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files --torch
check "expseg-run torchrun --nproc-per-node 2: both workers under expseg, one report per rank" "$kind" $? "$why"

# 4. accelerate launch under expseg-run (--multi_gpu: accelerate hands over to torchrun's launcher).
use accelerate
newdir accelerate
PATH=$path "$here/expseg-run" accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
  --mixed_precision no --dynamo_backend no "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files --torch
check "expseg-run accelerate launch --num_processes 2: both processes under expseg" "$kind" $? "$why"

# 5, 6. Ray. The driver does not run under expseg in either: only the workers must. Ray's
# nodes here are on the loopback (--node-ip-address 127.0.0.1): Ray would take the machine's
# outward address otherwise, and this test talks to 127.0.0.1 only (Slurm's node and
# MASTER_ADDR are 127.0.0.1 too; Open MPI is held to lo). Ray's token authentication (on by
# default for a new local cluster since Ray 2.5x, with a token it writes to ~/.ray) is off:
# it is Ray's access control, not the environment the recipes are about, and the test leaves
# nothing in $HOME. Every Ray session's files are in the test's folder.
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray to 127.0.0.1 (its head otherwise advertises, and
# connects to, the machine's outward address, --node-ip-address 127.0.0.1 notwithstanding).
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
if "$py" -c 'import ray' 2>/dev/null && command -v ray >/dev/null; then
  kind=real; ray_path=$PATH; ray_py=
else
  kind=stand-in; mkdir -p "$work/standin-ray" && ln -sf "$standins/bin/ray" "$work/standin-ray/ray"; ray_path=$work/standin-ray:$PATH; ray_py=$standins/python
  if [ -n "$real_only" ]; then
    kind=missing
    missing_why="--real: no real Ray for $py ($(launcher_missing ray))"
  fi
fi
cat >"$work/ray_driver.py" <<'PY'
# python3 ray_driver.py local|auto|job LIB|- PROBE TASKS: TASKS tasks, each runs probe.py's code
# in its worker and returns what it printed. LIB: given to every worker through runtime_env
# env_vars. job: a job's entrypoint, which probes itself first and takes the job's runtime_env.
import os, sys
import ray
address, lib, probe, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if address == "job":  # the entrypoint of `ray job submit`: the driver itself, then its tasks
    exec(open(probe).read(), {"__name__": "__main__"})
    address = None
kw = {}
if address == "local" and not ray.__version__.endswith("standin"):
    kw = dict(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
              _temp_dir=os.environ["RAY_TEMP_DIR"])
if lib != "-":
    kw["runtime_env"] = {"env_vars": {"LD_PRELOAD": lib, "EXPSEG_REPORT": os.environ["RAY_REPORT"]}}
ray.init(address=None if address == "local" else address, **kw)

@ray.remote
def run_probe(src):
    import contextlib, io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(src, {"__name__": "__main__"})
    return buf.getvalue()

src = open(probe).read()
print("".join(ray.get([run_probe.remote(src) for _ in range(n)])), end="")
ray.shutdown()
PY
newdir ray-runtime-env
RAY_TEMP_DIR=$work/ray-local RAY_REPORT=$PWD/ray-%p.txt PYTHONPATH=$ray_py${PYTHONPATH:+:$PYTHONPATH} PATH=$ray_path \
  timeout 180 "$py" "$work/ray_driver.py" local "$lib" "$probe" 3 >>out 2>&1
# Ray ends its workers with a signal at shutdown: no exit reports to look for.
verify out --n 3 --report "$PWD/ray-%p.txt"
check "ray.init(runtime_env={\"env_vars\": {\"LD_PRELOAD\": lib}}): every task's worker under expseg" "$kind" $? "$why"

# ray job submit --runtime-env-json: the entrypoint (the driver) and every worker of the job.
# Needs Ray's dashboard (ray[default]).
newdir ray-job
if [ "$kind" = stand-in ] || "$py" -c 'import aiohttp, ray.dashboard.modules.job.sdk' 2>/dev/null; then
  export RAY_STANDIN_DIR=$work/ray-standin-job
  ray_cmd=1
  PATH=$ray_path timeout 180 ray start --head --node-ip-address 127.0.0.1 --num-cpus 2 --temp-dir "$work/rayj" >start.log 2>&1
  r=$?
  PYTHONPATH=$ray_py${PYTHONPATH:+:$PYTHONPATH} PATH=$ray_path timeout 180 ray job submit \
    --runtime-env-json "{\"env_vars\": {\"LD_PRELOAD\": \"$lib\", \"EXPSEG_REPORT\": \"$PWD/job-%p.txt\"}}" \
    -- "$py" "$work/ray_driver.py" job - "$probe" 2 >>out 2>&1 || r=1
  verify out --n 3 --report "$PWD/job-%p.txt" || r=1
  [ $r = 0 ] || why="$why | ray start: $(tail -n 3 start.log | tr '\n' ' ')"
  ray_stop
  check "ray job submit --runtime-env-json '{\"env_vars\": {\"LD_PRELOAD\": lib}}': the job's driver and workers under expseg" "$kind" $r "$why"
elif [ -n "$real_only" ]; then
  missing_why="--real: Ray without its dashboard (ray[default]: scripts/install-launchers.sh)"
  check "ray job submit --runtime-env-json" missing 1
else
  echo "SKIP ray job submit: Ray without its dashboard (ray[default])"
fi

newdir ray-start
ray_cmd=1
export RAY_STANDIN_DIR=$work/ray-standin-start
PATH=$ray_path timeout 180 "$here/expseg-run" ray start --head --node-ip-address 127.0.0.1 --num-cpus 2 --include-dashboard=false \
  --temp-dir "$work/ray" >start.log 2>&1
r=$?
PYTHONPATH=$ray_py${PYTHONPATH:+:$PYTHONPATH} PATH=$ray_path \
  timeout 180 "$py" "$work/ray_driver.py" auto - "$probe" 2 >>out 2>&1
verify out --n 2 --report "$PWD/expseg-reports/rank%r-pid%p.txt" --torch || r=1
[ $r = 0 ] || why="$why | ray start: $(tail -n 3 start.log | tr '\n' ' ')"
ray_stop
check "expseg-run ray start --head; ray.init(address=\"auto\"): workers of the node under expseg" "$kind" $r "$why"

# 7. Slurm. Installed: a cluster of this machine (scripts/slurm-local.sh), for srun and sbatch;
# the caller's own allocation or cluster, if any, is left out of it (its SLURM_* unset).
slurm_up= slurm_error= slurm_dir=
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
  for v in $(compgen -e | grep '^SLURM_'); do unset "$v"; done
  slurm_dir=$work/slurm
  if conf=$("$here/slurm-local.sh" up "$slurm_dir" 2>"$work/slurm-up.log"); then
    export "${conf?}"
    slurm_up=1
    check "scripts/slurm-local.sh up: slurmctld, slurmd and munged of a one-node cluster ($(sinfo -h -o '%P %D node, %c CPUs, %G' 2>&1))" real 0
  else
    slurm_error=$(tail -n 20 "$work/slurm-up.log" | tr '\n' ' ')
    slurm_dir=
    check "scripts/slurm-local.sh up: a one-node Slurm cluster" real 1 "$slurm_error"
  fi
fi

# expseg-srun, every task through expseg-run with a rank-local report name.
use srun
newdir srun
PATH=$path "$here/expseg-srun" -N 1 --ntasks-per-node=2 -- "$py" "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank{rank}-local{local}-pid%p.txt" --files --torch
check "expseg-srun -N 1 --ntasks-per-node=2 -- python3: every task under expseg, rank<i>-local<j> reports" "$kind" $? "$why"
if [ -n "$reports" ]; then
  "$py" "$here/expseg-report-merge" expseg-reports >merge.out 2>&1
  grep -q '| all |' merge.out
  check "expseg-report-merge expseg-reports: one table of the tasks' reports" real $? "$(head -n 3 merge.out | tr '\n' ' ')"
fi

newdir srun-export
PATH=$path srun -n 2 --export="ALL,LD_PRELOAD=$lib,EXPSEG_REPORT=$PWD/rank%r-pid%p.txt" "$py" "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/rank%r-pid%p.txt" --files
check "srun -n 2 --export=ALL,LD_PRELOAD=\$lib: every task under expseg" "$kind" $? "$why"

# expseg-srun with an --export list without ALL (sites that keep the submitting environment out
# of jobs): the tasks get only the listed variables and SLURM_*; no PATH, so the program by its
# full path. The probe's own variables are listed too.
newdir srun-export-list
probe_vars=PROBE_CUDART
[ -z "$torch_job" ] || probe_vars=PROBE_TORCH,MASTER_ADDR,MASTER_PORT
# The GPU machines' settings that keep NVLink multicast off go along wherever they are set.
for v in NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS; do
  [ -z "${!v+x}" ] || probe_vars=$probe_vars,$v
done
PATH=$path "$here/expseg-srun" --export="EXPSEG_LIB,EXPSEG_REPORT_DIR,$probe_vars" -N 1 --ntasks-per-node=2 -- "$py" "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank{rank}-local{local}-pid%p.txt" --files --torch
check "expseg-srun --export=EXPSEG_LIB,EXPSEG_REPORT_DIR,...: every task under expseg with only the listed variables" "$kind" $? "$why"

# expseg-srun -- CMD where CMD's name starts with -: each task's expseg-run takes it as the command.
use srun
newdir srun-dash
mkdir -p bin && printf '#!/bin/sh\nexec %s %s "$@"\n' "$py" "$probe" >bin/-probe && chmod +x bin/-probe
PATH=$PWD/bin:$path "$here/expseg-srun" -N 1 --ntasks-per-node=2 -- -probe >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank{rank}-local{local}-pid%p.txt" --files --torch
check "expseg-srun -N 1 --ntasks-per-node=2 -- -probe: a command whose name starts with -, every task under expseg" "$kind" $? "$why"

# torchrun under Slurm, one agent per node: each agent's workers inherit its task's report name.
use torchrun; tkind=$kind; tdir=$dir
use srun
newdir srun-torchrun
PATH=${tdir:+$tdir:}$path "$here/expseg-srun" -N 1 --ntasks-per-node=1 -- torchrun --nproc-per-node 2 "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank0-local0-pid%p.txt" --files --torch
check "expseg-srun -N 1 --ntasks-per-node=1 -- torchrun --nproc-per-node 2: the agent's workers under expseg" "$kind srun, $tkind torchrun" $? "$why"

# 8. The sbatch template, as a user runs it: EXPSEG_HOME at this checkout, the job line as is
# (python train.py, `python` on the PATH the job inherits).
# sbatch_job CMD...: CMD submits job.sbatch in the current folder (the real sbatch with
# --parsable --wait, which $sbatch names); the job's output (the real one's
# --output=%x-%j.out) is appended to ./out. Exit status: the job's. $jobid: the job's id.
sbatch_job() {
  local r=0
  "$@" >submit.out 2>&1 || r=$?
  if [ "$sbatch_kind" = real ]; then
    jobid=$(grep -Eo '^[0-9]+' submit.out | tail -n 1)
    cat "expseg-job-$jobid.out" >>out 2>/dev/null || echo "no job output expseg-job-$jobid.out: $(tail -n 3 submit.out)" >>out
  else
    jobid='[0-9]*'
    cat submit.out >>out
  fi
  [ $r = 0 ] || why_job="sbatch: $(grep -v '^[0-9]*$' submit.out | tail -n 3 | tr '\n' ' ')"
  return $r
}
# pybin: ./bin/python, the python3 of this test (a venv's, with PyTorch, for --torch), for the
# job line `python train.py`. A script: a link to a venv's python outside the venv is no venv.
pybin() { mkdir -p bin && printf '#!/bin/sh\nexec %s "$@"\n' "$py" >bin/python && chmod +x bin/python; }
use sbatch; sbatch_kind=$kind
use srun; srun_kind=$kind # $path: the one for srun, which the job's tasks are started with
if [ "$sbatch_kind" = real ]; then sbatch=(sbatch --parsable --wait); else sbatch=("$py" "$standins/bin/sbatch"); fi
newdir sbatch
cp "$here/expseg.sbatch" job.sbatch && cp "$probe" train.py
pybin
why_job=
EXPSEG_HOME=$root PATH=$work/sbatch/bin:$path sbatch_job timeout 300 "${sbatch[@]}" job.sbatch
r=$?
verify out --n 2 --ranks --report "{reportdir}/rank{rank}-local{local}-pid%p.txt" --files --torch || r=1
grep -q "^PROBE .* reportdir=$PWD/expseg-reports-$jobid " out || { r=1; why="$why | no report dir expseg-reports-$jobid"; }
[ -z "$reports" ] || grep -q '| all |' out || { r=1; why="$why | no merged table"; }
check "sbatch scripts/expseg.sbatch: tasks under expseg, reports in ./expseg-reports-\$SLURM_JOB_ID, merged" "$sbatch_kind sbatch, $srun_kind srun" $r "$why_job${why_job:+ | }$why"

# The template when the job line fails: the job fails with its status (sbatch --wait's exit
# status), and the reports the tasks wrote are merged all the same.
newdir sbatch-fail
cp "$here/expseg.sbatch" job.sbatch && cp "$probe" train.py
pybin
why_job=
PROBE_EXIT=3 EXPSEG_HOME=$root PATH=$work/sbatch-fail/bin:$path sbatch_job timeout 300 "${sbatch[@]}" job.sbatch
r=$?
verify out --n 2 --ranks --report "{reportdir}/rank{rank}-local{local}-pid%p.txt" --files --torch
v=$?
[ $r = 3 ] && [ $v = 0 ] && { [ -z "$reports" ] || grep -q '| all |' out; }
check "sbatch scripts/expseg.sbatch, a job line that exits 3: the job's status is 3, the reports are merged" "$sbatch_kind sbatch, $srun_kind srun" $? \
  "job status $r, want 3${why:+ | $why}$(grep -q '| all |' out || echo ' | no merged table')"

# 9. mpirun (Open MPI): no stand-in. As root, Open MPI wants --allow-run-as-root.
if command -v mpirun >/dev/null; then
  newdir mpirun
  asroot=()
  [ "$(id -u)" = 0 ] && asroot=(--allow-run-as-root)
  OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo \
    "$here/expseg-run" mpirun "${asroot[@]}" --oversubscribe -np 2 "$py" "$probe" >>out 2>&1
  verify out --n 2 --ranks --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files
  check "expseg-run mpirun -np 2: both ranks under expseg ($(mpirun --version 2>&1 | head -n 1))" real $? "$why"
elif [ -n "$real_only" ]; then
  missing_why="--real: no mpirun (Open MPI is not installed: scripts/install-launchers.sh)"
  check "expseg-run mpirun -np 2" missing 1
else
  echo "SKIP mpirun: not installed"
fi

# 10. The installed forms, from a copy of the package laid out as the wheel installs it
# (expseg/_lib/ holds the library and the launchers), with no EXPSEG_LIB: the launchers must
# find the installed library themselves.
site=$work/site
mkdir -p "$site/expseg/_lib"
cp "$root"/python/expseg/*.py "$site/expseg/" 2>/dev/null
cp "$lib" "$here/expseg-run" "$here/expseg-srun" "$here/expseg-report-merge" "$site/expseg/_lib/"
ilib=$site/expseg/_lib/libexpseg.so
newdir installed
got=$(env -u EXPSEG_LIB PYTHONPATH=$site "$py" -m expseg --lib 2>&1)
[ "$got" = "$ilib" ]
check "python3 -m expseg --lib prints the installed library" real $? "$got"
use torchrun
env -u EXPSEG_LIB PYTHONPATH=$site PATH=$path EXPSEG_REPORT="$PWD/a-rank%r-pid%p.txt" \
  bash -c 'LD_PRELOAD=$(python3 -m expseg --lib) exec torchrun --nproc-per-node 2 "$0"' "$probe" >>out 2>&1
lib=$ilib verify out --n 2 --ranks --report "$PWD/a-rank%r-pid%p.txt" --files
check "LD_PRELOAD=\$(python3 -m expseg --lib) torchrun --nproc-per-node 2" "$kind" $? "$why"
newdir installed-run
env -u EXPSEG_LIB PYTHONPATH=$site PATH=$path "$py" -m expseg run torchrun --nproc-per-node 2 "$probe" >>out 2>&1
lib=$ilib verify out --n 2 --ranks --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files --torch
check "expseg-run torchrun (installed: python3 -m expseg run, what the expseg-run command runs)" "$kind" $? "$why"
use srun
newdir installed-srun
env -u EXPSEG_LIB PYTHONPATH=$site PATH=$path "$py" -m expseg srun -N 1 --ntasks-per-node=2 -- "$py" "$probe" >>out 2>&1
lib=$ilib verify out --n 2 --ranks --report "$PWD/expseg-reports/rank{rank}-local{local}-pid%p.txt" --files --torch
check "expseg-srun (installed: python3 -m expseg srun) -N 1 --ntasks-per-node=2" "$kind" $? "$why"

# The sbatch template with the wheel: EXPSEG_HOME is the installed package's _lib/ folder, where
# expseg-srun and expseg-report-merge lie next to the library (the template's second layout).
newdir installed-sbatch
cp "$here/expseg.sbatch" job.sbatch && cp "$probe" train.py
pybin
why_job=
sbatch_job env -u EXPSEG_LIB PYTHONPATH=$site PATH=$work/installed-sbatch/bin:$path \
  bash -c 'EXPSEG_HOME=$(dirname "$(python3 -m expseg --lib)") exec timeout 300 "$@"' - "${sbatch[@]}" job.sbatch
r=$?
lib=$ilib verify out --n 2 --ranks --report "{reportdir}/rank{rank}-local{local}-pid%p.txt" --files --torch || r=1
[ -z "$reports" ] || grep -q '| all |' out || { r=1; why="$why | no merged table"; }
check "EXPSEG_HOME=\$(dirname \$(python3 -m expseg --lib)) sbatch expseg.sbatch: the installed launchers" "$sbatch_kind sbatch, $kind srun" $r "$why_job${why_job:+ | }$why"

cd "$root"
slurm_down
echo "launchers: $(elapsed "$t_start") in all"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
