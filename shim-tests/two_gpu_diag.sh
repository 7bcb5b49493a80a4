#!/usr/bin/env bash
# Diagnosis of the two-GPU fault of coalesced pages (issue 10), for nvidia-h200-x2: the torch
# stress in one process on two GPUs, in the configurations that separate the suspects, each
# with a short run. Prints one line per configuration: PASS/FAIL and the stress's JSON (or its
# last error). Logs under LOG_DIR.
#     shim-tests/two_gpu_diag.sh LIBEXPSEG [OPS]
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
DEVICES=2 run coalesce_off EXPSEG_COALESCE=off
DEVICES=2 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python3 "$here/torch_coalesce_stress.py" "$ops" 2 16 >"$logs/native_expandable.log" 2>&1 \
  && echo "PASS native_expandable" || echo "FAIL native_expandable: $(tail -n 1 "$logs/native_expandable.log" | cut -c1-200)"
# The default: only the first device's pages coalesced.
DEVICES=2 run first_device_only
# Device 1 alone coalesced, in a process that sees only it, and in one that sees both.
DEVICES=1 run device1_alone CUDA_VISIBLE_DEVICES=1
DEVICES=2 run both_coalesced EXPSEG_TEST_ALL_DEVICES=1
# The same with synchronous launches (the failing call, not a later one, reports the fault),
# without compaction at settle and with handles released at once.
DEVICES=2 run both_blocking EXPSEG_TEST_ALL_DEVICES=1 CUDA_LAUNCH_BLOCKING=1 EXPSEG_LOG=expseg=debug
DEVICES=2 run both_no_settle EXPSEG_TEST_ALL_DEVICES=1 EXPSEG_STRAND_MAX=1T EXPSEG_RELEASE_DELAY=0
# Every device waited for before empty_cache() (PyTorch waits on the current device's stream).
DEVICES=2 run both_synced EXPSEG_TEST_ALL_DEVICES=1 STRESS_SYNC_ALL=1
# One handle per page (no coalescing across pages), everything else as coalesced.
DEVICES=2 run both_page_handles EXPSEG_TEST_ALL_DEVICES=1 EXPSEG_COALESCE_MAX=20M
# Where the fault is: memcheck names the kernel and the address; the debug log has every
# map, unmap and compaction of expseg to hold it against (few operations: memcheck is slow).
if command -v compute-sanitizer >/dev/null; then
  # The library goes in through env, inside the sanitizer (which sets up its own injection).
  EXPSEG_TEST_ALL_DEVICES=1 EXPSEG_LOG=expseg=debug EXPSEG_REPORT="$logs/memcheck.txt" \
    timeout 400 compute-sanitizer --tool memcheck --print-limit 5 --target-processes all \
    env LD_PRELOAD="$lib" python3 "$here/torch_coalesce_stress.py" 400 2 16 >"$logs/memcheck.log" 2>&1
  echo "memcheck rc=$?: $(grep -m3 -E 'Invalid|Address|at .* in ' "$logs/memcheck.log" | cut -c1-200 | tr '\n' ' ')"
fi
echo "logs: $logs"
