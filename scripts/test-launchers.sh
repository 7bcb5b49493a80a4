#!/usr/bin/env bash
# The launch recipes of docs/launching.md, run without a GPU: plain LD_PRELOAD, expseg-run,
# torchrun, accelerate launch, Ray (runtime_env env_vars, `ray job submit --runtime-env-json`,
# a wrapped `ray start`), Slurm
# (expseg-srun, srun --export, the expseg.sbatch template), mpirun, and the installed forms
# (`python -m expseg --lib`, `expseg run`, `expseg srun`). Run by .ci/run.
#     scripts/test-launchers.sh [path/to/libexpseg.so]
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
# the real launcher. Real Slurm runs only inside an allocation (SLURM_JOB_ID set); sbatch is
# always the stand-in (a test must not queue jobs). mpirun has no stand-in: skipped if absent.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
standins=$here/launcher-standins
lib=$(readlink -f "${1:-${EXPSEG_LIB:-$root/target/debug/libexpseg.so}}")
[ -f "$lib" ] || { echo "FAIL: $lib missing"; echo "0 passed, 1 failed"; exit 1; }
export EXPSEG_LIB=$lib
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the checkout from the stand-ins
unset EXPSEG_REPORT EXPSEG_REPORT_DIR LD_PRELOAD PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF RAY_ADDRESS
work=$(mktemp -d)
trap 'ray_stop; rm -rf "$work"' EXIT
ray_stop() { [ -n "${ray_cmd:-}" ] && PATH=$ray_path timeout 60 ray stop --force >/dev/null 2>&1; ray_cmd=; }
passed=0 failed=0
check() { # NAME KIND RC [DETAIL]
  if [ "$3" = 0 ]; then
    passed=$((passed + 1)); echo "PASS $1 [$2]"
  else
    failed=$((failed + 1)); echo "FAIL $1 [$2]${4:+: $4}"
  fi
}
py=$(command -v python3)
probe=$standins/probe.py
# verify OUT ARGS...: verify.py's verdict as the exit status, its complaint (and the output's
# tail when no process reported) in $why.
verify() {
  local out=$1; shift
  why=$("$py" "$standins/verify.py" "$out" --lib "$lib" "$@" 2>&1)
  local r=$?
  [ $r = 0 ] || why="$why | output: $(grep -v '^PROBE' "$out" | tail -n 4 | tr '\n' ' ')"
  return $r
}
# newdir NAME: an empty directory for one check, and cd into it. Its output goes to ./out with
# >> (O_APPEND): processes sharing a file opened with > overwrite each other's lines (Python
# writes at the offset it last knew), which would look like a process that never ran.
newdir() { mkdir -p "$work/$1" && cd "$work/$1"; }
# use NAME: $path, a PATH on which NAME is the real launcher if installed, else its stand-in
# (alone in a folder, so that it shadows nothing else); $kind says which, $dir is that folder
# (empty for a real one). srun counts as installed only inside an allocation.
use() {
  if command -v "$1" >/dev/null && { [ "$1" != srun ] || [ -n "${SLURM_JOB_ID:-}" ]; }; then
    kind=real; dir=
  else
    kind=stand-in; dir=$work/standin-$1
    mkdir -p "$dir" && ln -sf "$standins/bin/$1" "$dir/$1"
  fi
  path=${dir:+$dir:}$PATH
}

# The fake CUDA runtime of the preload tests, found through its rpath: no LD_LIBRARY_PATH, so
# the launchers themselves (PyTorch's, Ray's) never see it.
mkdir -p "$work/fakes"
(cd "$work/fakes" &&
  cc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o libcuda.so.1 "$root/tests/c/fake_cuda.c" &&
  cc -shared -fPIC -O1 -Wl,-soname,libcudart.so.13 "-Wl,--version-script=$root/tests/c/cudart.map" \
    "-Wl,-rpath,$work/fakes" -o libcudart.so.13 "$root/tests/c/fake_cudart.c" ./libcuda.so.1) >"$work/fakes.log" 2>&1
check "fake CUDA runtime builds" real $? "$(tail -3 "$work/fakes.log")"
export PROBE_CUDART=$work/fakes/libcudart.so.13

# 1. Plain LD_PRELOAD, the user's own report path.
newdir plain
EXPSEG_REPORT=$PWD/r-%p.txt LD_PRELOAD=$lib "$py" "$probe" >>out 2>&1
verify out --n 1 --report "$PWD/r-%p.txt" --files
check "LD_PRELOAD=\$lib python3: loaded, serves cudaMalloc, writes its report" real $? "$why"

# 2. expseg-run: LD_PRELOAD, per-rank reports in ./expseg-reports, PyTorch's allocator setting.
newdir run
"$here/expseg-run" "$py" "$probe" >>out 2>&1
verify out --n 1 --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files --torch
check "expseg-run python3: library, EXPSEG_REPORT=./expseg-reports/rank%r-pid%p.txt, expandable segments" real $? "$why"

# 3. torchrun under expseg-run: every worker.
use torchrun
newdir torchrun
PATH=$path "$here/expseg-run" torchrun --standalone --nproc-per-node 2 "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files --torch
check "expseg-run torchrun --nproc-per-node 2: both workers under expseg, one report per rank" $kind $? "$why"

# 4. accelerate launch under expseg-run (--multi_gpu: accelerate hands over to torchrun's launcher).
use accelerate
newdir accelerate
PATH=$path "$here/expseg-run" accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
  --mixed_precision no --dynamo_backend no "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files --torch
check "expseg-run accelerate launch --num_processes 2: both processes under expseg" $kind $? "$why"

# 5, 6. Ray. The driver does not run under expseg in either: only the workers must.
if "$py" -c 'import ray' 2>/dev/null && command -v ray >/dev/null; then
  kind=real; ray_path=$PATH; ray_py=
else
  kind=stand-in; mkdir -p "$work/standin-ray" && ln -sf "$standins/bin/ray" "$work/standin-ray/ray"; ray_path=$work/standin-ray:$PATH; ray_py=$standins/python
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
    kw = dict(num_cpus=2, include_dashboard=False, log_to_driver=False)
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
RAY_REPORT=$PWD/ray-%p.txt PYTHONPATH=$ray_py${PYTHONPATH:+:$PYTHONPATH} PATH=$ray_path \
  timeout 180 "$py" "$work/ray_driver.py" local "$lib" "$probe" 3 >>out 2>&1
# Ray ends its workers with a signal at shutdown: no exit reports to look for.
verify out --n 3 --report "$PWD/ray-%p.txt"
check "ray.init(runtime_env={\"env_vars\": {\"LD_PRELOAD\": lib}}): every task's worker under expseg" $kind $? "$why"

# ray job submit --runtime-env-json: the entrypoint (the driver) and every worker of the job.
# Needs Ray's dashboard (ray[default]); token authentication off for this local head.
newdir ray-job
if [ $kind = stand-in ] || "$py" -c 'import aiohttp, ray.dashboard.modules.job.sdk' 2>/dev/null; then
  export RAY_STANDIN_DIR=$work/ray-standin-job
  ray_cmd=1
  RAY_AUTH_MODE=disabled PATH=$ray_path timeout 180 ray start --head --num-cpus 2 --temp-dir "$work/rayj" >start.log 2>&1
  r=$?
  RAY_AUTH_MODE=disabled PYTHONPATH=$ray_py${PYTHONPATH:+:$PYTHONPATH} PATH=$ray_path timeout 180 ray job submit \
    --runtime-env-json "{\"env_vars\": {\"LD_PRELOAD\": \"$lib\", \"EXPSEG_REPORT\": \"$PWD/job-%p.txt\"}}" \
    -- "$py" "$work/ray_driver.py" job - "$probe" 2 >>out 2>&1 || r=1
  verify out --n 3 --report "$PWD/job-%p.txt" || r=1
  [ $r = 0 ] || why="$why | ray start: $(tail -n 3 start.log | tr '\n' ' ')"
  ray_stop
  check "ray job submit --runtime-env-json '{\"env_vars\": {\"LD_PRELOAD\": lib}}': the job's driver and workers under expseg" $kind $r "$why"
else
  echo "SKIP ray job submit: Ray without its dashboard (ray[default])"
fi

newdir ray-start
ray_cmd=1
export RAY_STANDIN_DIR=$work/ray-standin-start
PATH=$ray_path timeout 180 "$here/expseg-run" ray start --head --num-cpus 2 --include-dashboard=false \
  --temp-dir "$work/ray" >start.log 2>&1
r=$?
PYTHONPATH=$ray_py${PYTHONPATH:+:$PYTHONPATH} PATH=$ray_path \
  timeout 180 "$py" "$work/ray_driver.py" auto - "$probe" 2 >>out 2>&1
verify out --n 2 --report "$PWD/expseg-reports/rank%r-pid%p.txt" --torch || r=1
[ $r = 0 ] || why="$why | ray start: $(tail -n 3 start.log | tr '\n' ' ')"
ray_stop
check "expseg-run ray start --head; ray.init(address=\"auto\"): workers of the node under expseg" $kind $r "$why"

# 7. Slurm: expseg-srun, every task through expseg-run with a rank-local report name.
use srun
newdir srun
PATH=$path "$here/expseg-srun" -N 1 --ntasks-per-node=2 -- "$py" "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank{rank}-local{local}-pid%p.txt" --files --torch
check "expseg-srun -N 1 --ntasks-per-node=2 -- python3: every task under expseg, rank<i>-local<j> reports" $kind $? "$why"
"$py" "$here/expseg-report-merge" expseg-reports >merge.out 2>&1
grep -q '| all |' merge.out
check "expseg-report-merge expseg-reports: one table of the tasks' reports" real $? "$(head -n 3 merge.out | tr '\n' ' ')"

newdir srun-export
PATH=$path srun -n 2 --export="ALL,LD_PRELOAD=$lib,EXPSEG_REPORT=$PWD/rank%r-pid%p.txt" "$py" "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/rank%r-pid%p.txt" --files
check "srun -n 2 --export=ALL,LD_PRELOAD=\$lib: every task under expseg" $kind $? "$why"

# torchrun under Slurm, one agent per node: each agent's workers inherit its task's report name.
use torchrun; tkind=$kind; tdir=$dir
use srun
newdir srun-torchrun
PATH=${tdir:+$tdir:}$path "$here/expseg-srun" -N 1 --ntasks-per-node=1 -- torchrun --nproc-per-node 2 "$probe" >>out 2>&1
verify out --n 2 --ranks --report "$PWD/expseg-reports/rank0-local0-pid%p.txt" --files --torch
check "expseg-srun -N 1 --ntasks-per-node=1 -- torchrun --nproc-per-node 2: the agent's workers under expseg" "$kind srun, $tkind torchrun" $? "$why"

# 8. The sbatch template, as a user runs it: EXPSEG_HOME at this checkout, the job line as is
# (python train.py). sbatch is the stand-in, always; srun the one chosen above.
newdir sbatch
cp "$here/expseg.sbatch" job.sbatch && cp "$probe" train.py
mkdir -p bin && ln -s "$py" bin/python
EXPSEG_HOME=$root PATH=$work/sbatch/bin:$path \
  "$py" "$standins/bin/sbatch" job.sbatch >>out 2>&1
r=$?
verify out --n 2 --ranks --report "{reportdir}/rank{rank}-local{local}-pid%p.txt" --files --torch || r=1
grep -q "^PROBE .* reportdir=$PWD/expseg-reports-[0-9]* " out && grep -q '| all |' out || { r=1; why="$why | no report dir or merged table"; }
check "sbatch scripts/expseg.sbatch: tasks under expseg, reports in ./expseg-reports-\$SLURM_JOB_ID, merged" "stand-in sbatch, $kind srun" $r "$why"

# 9. mpirun (Open MPI): no stand-in.
if command -v mpirun >/dev/null; then
  newdir mpirun
  "$here/expseg-run" mpirun --allow-run-as-root --oversubscribe -np 2 "$py" "$probe" >>out 2>&1
  verify out --n 2 --ranks --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files
  check "expseg-run mpirun -np 2: both ranks under expseg" real $? "$why"
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
check "LD_PRELOAD=\$(python3 -m expseg --lib) torchrun --nproc-per-node 2" $kind $? "$why"
newdir installed-run
env -u EXPSEG_LIB PYTHONPATH=$site PATH=$path "$py" -m expseg run torchrun --nproc-per-node 2 "$probe" >>out 2>&1
lib=$ilib verify out --n 2 --ranks --report "$PWD/expseg-reports/rank%r-pid%p.txt" --files --torch
check "expseg-run torchrun (installed: python3 -m expseg run, what the expseg-run command runs)" $kind $? "$why"
use srun
newdir installed-srun
env -u EXPSEG_LIB PYTHONPATH=$site PATH=$path "$py" -m expseg srun -N 1 --ntasks-per-node=2 -- "$py" "$probe" >>out 2>&1
lib=$ilib verify out --n 2 --ranks --report "$PWD/expseg-reports/rank{rank}-local{local}-pid%p.txt" --files --torch
check "expseg-srun (installed: python3 -m expseg srun) -N 1 --ntasks-per-node=2" $kind $? "$why"

# The sbatch template with the wheel: EXPSEG_HOME is the installed package's _lib/ folder, where
# expseg-srun and expseg-report-merge lie next to the library (the template's second layout).
newdir installed-sbatch
cp "$here/expseg.sbatch" job.sbatch && cp "$probe" train.py
mkdir -p bin && ln -s "$py" bin/python
env -u EXPSEG_LIB PYTHONPATH=$site PATH=$work/installed-sbatch/bin:$path \
  bash -c 'EXPSEG_HOME=$(dirname "$(python3 -m expseg --lib)") exec "$0" "$1"' "$standins/bin/sbatch" job.sbatch >>out 2>&1
r=$?
lib=$ilib verify out --n 2 --ranks --report "{reportdir}/rank{rank}-local{local}-pid%p.txt" --files --torch || r=1
grep -q '| all |' out || { r=1; why="$why | no merged table"; }
check "EXPSEG_HOME=\$(dirname \$(python3 -m expseg --lib)) sbatch expseg.sbatch: the installed launchers" "stand-in sbatch, $kind srun" $r "$why"

cd "$root"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
