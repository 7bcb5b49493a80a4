#!/usr/bin/env bash
# Checks, without a GPU, that processes started by launchers under scripts/expseg-run carry
# the library: mpirun ranks and Ray workers of a wrapped `ray start`. Each part is skipped
# (with a line saying so) when its launcher is not installed. Run by .ci/run.
#     scripts/test-launchers.sh [path/to/libexpseg.so]
set -u
here=$(cd "$(dirname "$0")" && pwd)
export EXPSEG_LIB=$(readlink -f "${1:-${EXPSEG_LIB:-$here/../target/debug/libexpseg.so}}")
export EXPSEG_REPORT=none
[ -f "$EXPSEG_LIB" ] || { echo "FAIL: $EXPSEG_LIB missing"; exit 1; }
passed=0 failed=0
check() { if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "PASS $1"; else failed=$((failed + 1)); echo "FAIL $1"; fi; }

if command -v mpirun >/dev/null; then
  out=$("$here/expseg-run" mpirun --allow-run-as-root --oversubscribe -np 2 sh -c 'echo "rank=$OMPI_COMM_WORLD_RANK preload=$LD_PRELOAD"' 2>&1)
  [ "$(echo "$out" | grep -c "preload=$EXPSEG_LIB")" = 2 ]
  check "mpirun: both ranks run under expseg" $?
else
  echo "SKIP mpirun: not installed"
fi

if python3 -c 'import ray' 2>/dev/null; then
  tmp=$(mktemp -d)
  cat >"$tmp/task.py" <<'PY'
import os, ray
ray.init(address="auto", log_to_driver=False)
@ray.remote
def preload():
    return os.environ.get("LD_PRELOAD", "")
print("workers:", ray.get([preload.remote() for _ in range(2)]))
PY
  timeout 120 "$here/expseg-run" ray start --head --num-cpus 2 --include-dashboard=false --temp-dir "$tmp/ray" >"$tmp/start.log" 2>&1
  out=$(timeout 120 python3 "$tmp/task.py" 2>&1)
  ray stop --force >/dev/null 2>&1
  [ "$(echo "$out" | grep -o "$EXPSEG_LIB" | wc -l)" = 2 ]
  check "ray: workers of a wrapped ray start run under expseg" $?
  rm -rf "$tmp"
else
  echo "SKIP ray: not installed"
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
