#!/usr/bin/env bash
# Diagnosis of the two-GPU fault of coalesced pages (issues 10 and 24), for nvidia-h200-x2: the torch
# stress in one process on two GPUs, in the configurations that separate the suspects, each
# with a short run. Prints one line per configuration: PASS/FAIL and the stress's JSON (or its
# last error). Logs under LOG_DIR.
#     RUNS=N shim-tests/two_gpu_diag.sh LIBEXPSEG [OPS]   (each configuration N times, default 1)
set -u
here=$(cd "$(dirname "$0")" && pwd)
lib=$(readlink -f "${1:?usage: two_gpu_diag.sh LIBEXPSEG [OPS]}")
ops=${2:-1500}
logs=${LOG_DIR:-$(mktemp -d)}
mkdir -p "$logs"
n=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$n" -ge 2 ] || { echo "SKIP: $n GPU(s); this needs two"; exit 0; }
run() { # name, then env assignments; the stress runs with DEVICES as given
  local name=$1; shift
  env "$@" EXPSEG_REPORT="$logs/$name.txt" LD_PRELOAD="$lib" timeout 300 python3 "$here/torch_coalesce_stress.py" "$ops" "${DEVICES:-2}" 16 >"$logs/$name.log" 2>&1
  local rc=$?
  echo "$([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc") $name: $(grep '^{' "$logs/$name.log" | cut -c1-300 || true)$(grep -m1 -iE 'illegal|error' "$logs/$name.log" | cut -c1-200)"
}
# Controls: no coalescing, and plain expandable segments without expseg.
for i in $(seq "${RUNS:-1}"); do
DEVICES=2 run coalesce_off_$i EXPSEG_COALESCE=off
DEVICES=2 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python3 "$here/torch_coalesce_stress.py" "$ops" 2 16 >"$logs/native_expandable_$i.log" 2>&1 \
  && echo "PASS native_expandable_$i" || echo "FAIL native_expandable_$i: $(tail -n 1 "$logs/native_expandable_$i.log" | cut -c1-200)"
# The default: every device coalesced, released handles given back at once.
DEVICES=2 run both_coalesced_$i
# Device 1 alone, in a process that sees only it.
DEVICES=1 run device1_alone_$i CUDA_VISIBLE_DEVICES=1
# Opt-in keeping (the default of 2026-11-23, when the fault was seen): released handles kept
# 2 ms, parked at their addresses, compacted at a later settle.
DEVICES=2 run both_kept_$i EXPSEG_RELEASE_DELAY=2
# The same with synchronous launches (the failing call, not a later one, reports the fault).
DEVICES=2 run both_kept_blocking_$i EXPSEG_RELEASE_DELAY=2 CUDA_LAUNCH_BLOCKING=1 EXPSEG_LOG=expseg=debug
# Every device waited for before empty_cache() (PyTorch waits on the current device's stream).
DEVICES=2 run both_kept_synced_$i EXPSEG_RELEASE_DELAY=2 STRESS_SYNC_ALL=1
# One handle per page (no coalescing across pages).
DEVICES=2 run both_page_handles_$i EXPSEG_COALESCE_MAX=20M
done
# Where the fault is: memcheck names the kernel and the address; the debug log has every
# map, unmap and compaction of expseg to hold it against (few operations: memcheck is slow).
if command -v compute-sanitizer >/dev/null; then
  # The library goes in through env, inside the sanitizer (which sets up its own injection).
  EXPSEG_RELEASE_DELAY=2 EXPSEG_LOG=expseg=debug EXPSEG_REPORT="$logs/memcheck.txt" \
    timeout 400 compute-sanitizer --tool memcheck --print-limit 5 --target-processes all \
    env LD_PRELOAD="$lib" python3 "$here/torch_coalesce_stress.py" 400 2 16 >"$logs/memcheck.log" 2>&1
  echo "memcheck rc=$?: $(grep -m3 -E 'Invalid|Address|at .* in ' "$logs/memcheck.log" | cut -c1-200 | tr '\n' ' ')"
fi
echo "logs: $logs"
