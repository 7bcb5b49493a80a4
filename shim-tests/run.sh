#!/usr/bin/env bash
# GPU integration tests of libexpseg.so. One command, on a machine with an NVIDIA GPU:
#
#     shim-tests/run.sh [path/to/libexpseg.so]
#
# The library defaults to $EXPSEG_LIB, then target/release/libexpseg.so (built with
# `cargo build --release --features test-switches`: the one section that uses a test switch,
# ipc's move failures, says SKIP with a library built without them). Without a GPU this
# prints SKIP and exits 0; with a GPU but no library or no nvcc it fails. Logs and reports go
# to a new folder inside $LOG_DIR (default: a temporary folder), so that an earlier run's
# reports can never pass this run's checks. The last line is "N passed, M failed".
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIP: no NVIDIA GPU on this machine; shim-tests need one (CPU tests: cargo test)"
  exit 0
fi
lib=${1:-${EXPSEG_LIB:-$root/target/release/libexpseg.so}}
lib=$(readlink -f "$lib" 2>/dev/null || echo "$lib")
[ -f "$lib" ] || { echo "FAIL: $lib is missing: run cargo build --release --features test-switches first"; exit 1; }
command -v nvcc >/dev/null || { echo "FAIL: nvcc not found"; exit 1; }
if [ -n "${LOG_DIR:-}" ]; then
  mkdir -p "$LOG_DIR" && logs=$(mktemp -d "$LOG_DIR/run.XXXXXX") || { echo "FAIL: cannot write to LOG_DIR=$LOG_DIR"; exit 1; }
else
  logs=$(mktemp -d)
fi
build=$(mktemp -d)
passed=0 failed=0
# ONLY="static cupy ..." runs those sections alone (names: alloc ipc static cupy jaxnumba
# ipcstress reopen train coalesce ahead crossctx reclaim threads share twogpu torchipc nodump torchrun sleep pausebusy doctor quiet); unset runs all.
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
result() { # name status detail
  if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "PASS $1 $3"; else failed=$((failed + 1)); echo "FAIL $1 $3"; fi
}
# Sections on PyTorch: without it each says SKIP (never a silent pass).
torch_cuda=$(python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && echo 1)
torch_for() { [ -n "$torch_cuda" ] || { echo "SKIP $1: no PyTorch with CUDA in python3"; return 1; }; }
echo "library: $lib"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
echo "logs: $logs"

# C programs, built against the shared runtime so that LD_PRELOAD can interpose it.
if want alloc; then
nvcc -O2 -cudart shared -o "$build/alloc_test" "$here/alloc_test.cu" -lcuda -lpthread >"$logs/build.log" 2>&1
result build_alloc_test $? "(nvcc -cudart shared)"
fi
if want alloc && [ -x "$build/alloc_test" ]; then
  "$build/alloc_test" >"$logs/alloc_native.log" 2>&1
  result alloc_test_native $? "$(tail -n 1 "$logs/alloc_native.log")"
  EXPSEG_REPORT="$logs/alloc_report.txt" EXPECT_POOL=1 LD_PRELOAD="$lib" "$build/alloc_test" >"$logs/alloc_shim.log" 2>"$logs/alloc_shim.err"
  rc=$?
  [ -s "$logs/alloc_shim.err" ] && { echo "  unexpected stderr:"; head -5 "$logs/alloc_shim.err"; rc=1; }
  grep -q '"allocs":[1-9]' "$logs/alloc_report.txt.json" 2>/dev/null || { echo "  report shows no pool allocations"; rc=1; }
  result alloc_test_expseg $rc "$(tail -n 1 "$logs/alloc_shim.log")"
  grep -E '^(PASS|FAIL|SKIP)|FAIL|skipped' "$logs/alloc_shim.log" | sed 's/^/    /'
  # The same with every allocation built of 2 MiB chunks (stitched-like blocks everywhere).
  EXPSEG_MAX_CHUNK=2M EXPSEG_REPORT="$logs/alloc_chunks_report.txt" EXPECT_POOL=1 LD_PRELOAD="$lib" "$build/alloc_test" >"$logs/alloc_shim_chunks.log" 2>&1
  rc=$?
  grep -q '"allocs":[1-9]' "$logs/alloc_chunks_report.txt.json" 2>/dev/null || { echo "    report shows no pool allocations"; rc=1; }
  result alloc_test_expseg_2MiB_chunks $rc "$(tail -n 1 "$logs/alloc_shim_chunks.log")"
fi

# IPC: cudaIpcGetMemHandle on pool memory, consumers with and without expseg.
if want ipc; then
nvcc -O2 -cudart shared -o "$build/ipc_test" "$here/ipc_test.cu" -lcuda >>"$logs/build.log" 2>&1
result build_ipc_test $? ""
fi
if want ipc && [ -x "$build/ipc_test" ]; then
  sizes="2 20 64 1024 8192"
  "$build/ipc_test" run - $sizes >"$logs/ipc_native.log" 2>&1
  result ipc_native_producer $? "$(tail -n 1 "$logs/ipc_native.log")"
  for consumer in - "$lib"; do
    name=ipc_expseg_producer_$([ "$consumer" = - ] && echo plain || echo expseg)_consumer
    EXPSEG_LOG=expseg=debug EXPSEG_REPORT="$logs/$name.txt" LD_PRELOAD="$lib" "$build/ipc_test" run "$consumer" $sizes >"$logs/$name.log" 2>"$logs/$name.err"
    rc=$?
    # The same program passes natively: the report shows that expseg served the handles.
    grep -q '"ipc_handle_requests":[1-9]' "$logs/$name.txt.json" 2>/dev/null || { echo "    expseg saw no IPC handle request"; rc=1; }
    result "$name" $rc "$(tail -n 1 "$logs/$name.log")"
    grep -E '^(PASS|FAIL|SKIP) ipc' "$logs/$name.log" | sed 's/^/    /'
  done
  grep -h "ticket .* opened" "$logs"/ipc_expseg_producer_expseg_consumer.err | sed 's/^/    /' 
  # Moves in place are opt-in (EXPSEG_IPC_MOVE_MAX): with them, a plain consumer of a small
  # allocation shares it both ways.
  # (64 MiB is mirrored: the ticket socket starts before the descriptor-counting cycles.)
  EXPSEG_IPC_MOVE_MAX=20M LD_PRELOAD="$lib" "$build/ipc_test" run - 2 20 64 >"$logs/ipc_moves.log" 2>&1
  rc=$?
  grep -q "moved/standard" "$logs/ipc_moves.log" || { echo "    no allocation was moved"; rc=1; }
  result ipc_expseg_producer_plain_consumer_with_moves $rc "$(tail -n 1 "$logs/ipc_moves.log")"
  # A move that fails at any step: data intact, a working handle (a mirror) all the same.
  # The failure must have happened: no allocation moved, and the report counts failed moves.
  # EXPSEG_TEST_FAIL_MOVE is a test switch: read only by a library built with
  # `cargo build --release --features test-switches`; any other build says it ignores it, and
  # this section says SKIP.
  rc=0 no_switches=
  for step in sync temp_reserve temp_map unmap free_range alloc placement copy handle; do
    rm -f "$logs/ipc_fail_$step.txt.json"
    EXPSEG_IPC_MOVE_MAX=20M EXPSEG_TEST_FAIL_MOVE=$step EXPSEG_REPORT="$logs/ipc_fail_$step.txt" LD_PRELOAD="$lib" \
      "$build/ipc_test" run - 2 20 >"$logs/ipc_fail_$step.log" 2>&1 \
      || { rc=1; echo "    move failing at $step: $(tail -n 1 "$logs/ipc_fail_$step.log")"; }
    if grep -q "EXPSEG_TEST_FAIL_MOVE is ignored" "$logs/ipc_fail_$step.log"; then no_switches=1; break; fi
    grep -q "moved/standard" "$logs/ipc_fail_$step.log" && { rc=1; echo "    $step: an allocation moved all the same"; }
    grep -q '"ipc_move_failures":[1-9]' "$logs/ipc_fail_$step.txt.json" 2>/dev/null || { rc=1; echo "    $step: no failed move in the report"; }
  done
  if [ -n "$no_switches" ]; then
    echo "SKIP ipc_move_failure_at_each_step: $lib has no test switches (cargo build --release --features test-switches)"
  else
    result ipc_move_failure_at_each_step $rc ""
  fi
fi

# A handle opened, read, written and closed again each round (a weight sync sharing the same
# buffer every step), then the buffer freed, then another shared and the producer gone: 4 GiB,
# 20 rounds, both ways each round; the memory must come back at the free and at the exit (a
# consumer running expseg keeps a closed handle's memory mapped for the next open:
# EXPSEG_IPC_KEEP_CLOSED). The open and close medians print beside the native ones.
if want reopen; then
  nvcc -O2 -cudart shared -o "$build/ipc_reopen_test" "$here/ipc_reopen_test.cu" >>"$logs/build.log" 2>&1
  result build_ipc_reopen_test $? ""
fi
if want reopen && [ -x "$build/ipc_reopen_test" ]; then
  reopen_run() { # name check env...
    local name=$1 check=$2; shift 2
    rm -f "$logs/reopen_$name".*.json
    env "$@" EXPSEG_REPORT="$logs/reopen_$name.%p.txt" "$build/ipc_reopen_test" run 4096 20 "${CONSUMER_LIB:-$lib}" >"$logs/reopen_$name.log" 2>&1
    local rc=$? reopened
    reopened=$(cat "$logs/reopen_$name".*.json 2>/dev/null | grep -o '"ipc_kept_reopened":[0-9]*' | awk -F: '{s += $2} END {print s + 0}')
    if [ $rc = 0 ] && [ -n "$check" ]; then
      [ "${reopened:-0}" $check ] || { echo "    kept reopens: ${reopened:-none}, wanted $check"; rc=1; }
      # Under expseg the memory is back when the free returns and when the producer exits.
      grep '"back_after_free_mib"' "$logs/reopen_$name.log" | python3 -c 'import json,sys; o=json.loads(sys.stdin.read()); sys.exit(0 if min(o["back_after_free_mib"], o["back_after_exit_mib"]) >= 0.9 * o["mib"] else 1)' \
        || { echo "    the memory did not come back"; rc=1; }
    fi
    result "ipc_reopen_$name" $rc "$(grep '^{' "$logs/reopen_$name.log" | tr '\n' ' ' | cut -c1-400) kept_reopened=${reopened:-0}"
  }
  CONSUMER_LIB=- reopen_run native "" LD_PRELOAD=
  reopen_run expseg "-ge 19" LD_PRELOAD="$lib"
  reopen_run expseg_unkept "-eq 0" LD_PRELOAD="$lib" EXPSEG_IPC_KEEP_CLOSED=0
fi

# Programs the shared runtime's interposition never sees (issue 11): nvcc's default static
# runtime, and a program on the driver API alone. Their allocations must come from the pool
# and their IPC handles open in plain and expseg consumers. Driver-level service is on by
# default (EXPSEG_DRIVER_API), so nothing here sets it.
if want static; then
nvcc -O2 -o "$build/alloc_test_static" "$here/alloc_test.cu" -lcuda -lpthread >>"$logs/build.log" 2>&1 &&
  nvcc -O2 -o "$build/ipc_test_static" "$here/ipc_test.cu" -lcuda >>"$logs/build.log" 2>&1 &&
  nvcc -O2 -o "$build/driver_test" "$here/driver_test.cu" -lcuda >>"$logs/build.log" 2>&1
result build_static_and_driver_tests $? "(nvcc default: -cudart static)"
fi
if want static && [ -x "$build/driver_test" ]; then
  EXPSEG_REPORT="$logs/alloc_static_report.txt" EXPECT_POOL=1 LD_PRELOAD="$lib" "$build/alloc_test_static" >"$logs/alloc_static.log" 2>&1
  rc=$?
  grep -q '"allocs":[1-9]' "$logs/alloc_static_report.txt.json" 2>/dev/null || { echo "    report shows no pool allocations"; rc=1; }
  result alloc_test_static_runtime $rc "$(tail -n 1 "$logs/alloc_static.log")"
  for consumer in - "$lib"; do
    name=ipc_static_runtime_$([ "$consumer" = - ] && echo plain || echo expseg)_consumer
    EXPSEG_REPORT="$logs/$name.txt" LD_PRELOAD="$lib" "$build/ipc_test_static" run "$consumer" 2 20 64 1024 >"$logs/$name.log" 2>&1
    rc=$?
    grep -q '"ipc_handle_requests":[1-9]' "$logs/$name.txt.json" 2>/dev/null || { echo "    expseg saw no IPC handle request"; rc=1; }
    result "$name" $rc "$(tail -n 1 "$logs/$name.log")"
    name=driver_api_$([ "$consumer" = - ] && echo plain || echo expseg)_consumer
    EXPSEG_REPORT="$logs/$name.txt" EXPECT_POOL=1 LD_PRELOAD="$lib" "$build/driver_test" run "$consumer" >"$logs/$name.log" 2>&1
    rc=$?
    grep -q '"allocs":[1-9]' "$logs/$name.txt.json" 2>/dev/null || { echo "    report shows no pool allocations"; rc=1; }
    result "$name" $rc "$(tail -n 1 "$logs/$name.log")"
    grep -E '^ +[0-9]+ MiB' "$logs/$name.log" | sed 's/^/    /'
  done
fi

# A handle grown ahead over a mapping expseg's books do not know (the program's own, made
# through the driver's exported cuMemMap inside its reservation): the pages get memory
# without the bytes ahead, access and data as natively (f13cfb9; the native run is the control).
if want ahead; then
  if nvcc -O2 -cudart shared -o "$build/grow_ahead_test" "$here/grow_ahead_test.cu" -lcuda >>"$logs/build.log" 2>&1; then
    "$build/grow_ahead_test" >"$logs/grow_ahead_native.log" 2>&1
    result grow_ahead_test_native $? "$(tail -n 1 "$logs/grow_ahead_native.log")"
    EXPSEG_COALESCE=all EXPSEG_REPORT="$logs/grow_ahead_report.txt" LD_PRELOAD="$lib" "$build/grow_ahead_test" >"$logs/grow_ahead.log" 2>&1
    rc=$?
    grep -q 'growing ahead is off' "$logs/grow_ahead.log" || { echo "    no handle grown ahead met the program's mapping: the test did not test"; rc=1; }
    grep -E '^(ok|FAIL)|growing ahead' "$logs/grow_ahead.log" | sed 's/^/    /'
    result grow_ahead_over_a_mapping_expseg_does_not_know $rc "$(tail -n 1 "$logs/grow_ahead.log")"
  else
    result build_grow_ahead_test 1 "(nvcc failed: $logs/build.log)"
  fi
fi

# CuPy (static runtime): arrays from the pool, ipcGetMemHandle to plain and expseg consumers.
if ! want cupy; then :
elif python3 -c 'import cupy' 2>/dev/null; then
  for consumer in - "$lib"; do
    name=cupy_$([ "$consumer" = - ] && echo plain || echo expseg)_consumer
    EXPSEG_REPORT="$logs/$name.txt" LD_PRELOAD="$lib" python3 "$here/cupy_test.py" run "$consumer" >"$logs/$name.log" 2>&1
    rc=$?
    grep -q '"allocs":[1-9]' "$logs/$name.txt.json" 2>/dev/null || { echo "    report shows no pool allocations"; rc=1; }
    result "$name" $rc "$(grep '^{' "$logs/$name.log" | head -c 400)"
  done
else
  echo "SKIP cupy: not installed"
fi

# JAX (platform allocator, and XLA's default) and numba-cuda: results under expseg equal the
# native run's. numba's must be identical; JAX's within 1e-3 (XLA's autotuning may pick a
# different GEMM algorithm in each process, so even two native runs differ in the last bits;
# memory going wrong changes results by far more).
want jaxnumba && for fw in jax jax_bfc numba; do
  RESULT_FILE="$logs/${fw}_native.npy" python3 "$here/jax_numba_test.py" $fw >"$logs/${fw}_native.log" 2>&1
  if grep -q '^SKIP' "$logs/${fw}_native.log"; then echo "$(grep '^SKIP' "$logs/${fw}_native.log")"; continue; fi
  grep -q '^digest' "$logs/${fw}_native.log" || { result "${fw}_native" 1 "$(tail -n 1 "$logs/${fw}_native.log")"; continue; }
  RESULT_FILE="$logs/${fw}_expseg.npy" EXPSEG_REPORT="$logs/${fw}_report.txt" LD_PRELOAD="$lib" python3 "$here/jax_numba_test.py" $fw >"$logs/${fw}_expseg.log" 2>&1
  rc=$?
  tol=$([ $fw = numba ] && echo 0 || echo 1e-3)
  cmp=$(python3 - "$logs/${fw}_native.npy" "$logs/${fw}_expseg.npy" $tol <<'PY'
import sys
import numpy as np
a, b, tol = np.load(sys.argv[1]), np.load(sys.argv[2]), float(sys.argv[3])
d = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")
print(f"{a.size} values, largest difference {d:.3g} (allowed {tol:g})")
sys.exit(0 if d <= tol else 1)
PY
) || rc=1
  if [ $fw = numba ]; then
    [ "$(grep '^digest' "$logs/${fw}_native.log")" = "$(grep '^digest' "$logs/${fw}_expseg.log")" ] || { echo "    numba: digests differ"; rc=1; }
  fi
  # numba's arrays are cuMemAlloc allocations, so they must come from the pool. JAX 0.11's
  # come from XLA's own VMM and stream-ordered memory, which expseg leaves to the driver
  # (docs/design.md): its pool count is only printed.
  n=$(grep -o '"allocs":[0-9]*' "$logs/${fw}_report.txt.json" 2>/dev/null | head -1 | cut -d: -f2)
  if [ $fw = numba ] && [ "${n:-0}" = 0 ]; then echo "    numba: report shows no pool allocations"; rc=1; fi
  result "${fw}_same_results_under_expseg" $rc "$cmp; pool allocations ${n:-none}"
done

# Threads sharing allocations while in use: 8 threads, 10,000 operations, every word checked.
if want ipcstress; then
nvcc -O2 -cudart shared -o "$build/ipc_stress" "$here/ipc_stress.cu" -lpthread >>"$logs/build.log" 2>&1
result build_ipc_stress $? ""
fi
if want ipcstress && [ -x "$build/ipc_stress" ]; then
  EXPSEG_REPORT="$logs/ipc_stress_report.txt" LD_PRELOAD="$lib" "$build/ipc_stress" "${IPC_STRESS_OPS:-10000}" 8 >"$logs/ipc_stress.log" 2>"$logs/ipc_stress.err"
  rc=$?
  grep -q '"allocs":[1-9]' "$logs/ipc_stress_report.txt.json" 2>/dev/null || { echo "    report shows no pool allocations"; rc=1; }
  result ipc_stress_8_threads $rc "$(head -n 1 "$logs/ipc_stress.log")"
  head -3 "$logs/ipc_stress.err" | sed 's/^/    /'
fi

# PyTorch: same losses with and without expseg, and PyTorch's segments from the pool.
if want train && torch_for train; then
  python3 "$here/torch_train.py" "$logs/torch_native.json" 300 >"$logs/torch_native.log" 2>&1
  result torch_train_native $? "$(tail -n 1 "$logs/torch_native.log")"
  EXPSEG_REPORT="$logs/torch_report.txt" LD_PRELOAD="$lib" python3 "$here/torch_train.py" "$logs/torch_shim.json" 300 >"$logs/torch_shim.log" 2>&1
  result torch_train_expseg $? "$(tail -n 1 "$logs/torch_shim.log")"
  python3 "$here/torch_compare.py" "$logs/torch_native.json" "$logs/torch_shim.json" "$logs/torch_report.txt.json" >"$logs/torch_compare.log" 2>&1
  result torch_same_losses_and_pool $? ""
  sed 's/^/    /' "$logs/torch_compare.log"
fi

# Coalesced expandable segments under stress: known patterns, random frees, empty_cache,
# forced out-of-memory retries, IPC exports; every live tensor checked after each compaction.
if want coalesce && torch_for coalesce; then
  ngpu=$(nvidia-smi -L | wc -l)
  # The check itself: one byte changed at the end must be found.
  STRESS_SELFTEST=1 LD_PRELOAD="$lib" python3 "$here/torch_coalesce_stress.py" 300 1 >"$logs/stress_selftest.log" 2>&1
  rc=$?
  grep '^{' "$logs/stress_selftest.log" | tail -n 1 | grep -q '"selftest": "detected"' || rc=1
  result torch_coalesce_stress_check_finds_a_changed_byte $rc "$(grep '^{' "$logs/stress_selftest.log" | tail -n 1 | grep -o '"selftest": "[a-z]*"')"
  # At the defaults live pages never move (stranded bytes reused in place); with
  # EXPSEG_COMPACT=1 they are compacted (the opt-in, fewer operations).
  for mode in defaults compact; do
    if [ $mode = defaults ]; then ops=${STRESS_OPS:-10000} extra=; else ops=${STRESS_OPS_COMPACT:-2000} extra=EXPSEG_COMPACT=1; fi
    env $extra EXPSEG_REPORT="$logs/stress_${mode}_report.txt" LD_PRELOAD="$lib" python3 "$here/torch_coalesce_stress.py" "$ops" 1 >"$logs/stress_$mode.log" 2>&1
    rc=$?
    python3 - "$logs/stress_${mode}_report.txt.json" $mode <<'PY' || rc=1
import json, sys
p = json.load(open(sys.argv[1]))["process"]
print("    report: " + ", ".join(f"{k[9:]} {v}" for k, v in p.items() if k.startswith("coalesce_")))
ok = p.get("coalesce_compaction_failures", 1) == 0
if sys.argv[2] == "compact":
    ok = ok and p.get("coalesce_held_moves", 0) > 0
else:
    # Only the program's sharing calls (exports, IPC) move pages there.
    ok = ok and p.get("coalesce_held_moves", 1) <= p.get("coalesce_exports_split", 0)
    ok = ok and p.get("coalesce_reused_stranded_bytes", 0) > 0
sys.exit(0 if ok else 1)
PY
    result torch_coalesce_stress_$mode $rc "$(grep '^{' "$logs/stress_$mode.log" | tail -n 1 | cut -c1-400)"
  done
  # The same with released handles kept for a minute (the checks between operations take
  # longer than the default 2 ms) and no mem_get_info() after empty_cache() (which gives them
  # back): kept handles serve new pages, parked ones in place.
  STRESS_KEEP=1 EXPSEG_RELEASE_DELAY=60000 EXPSEG_REPORT="$logs/stress_kept_report.txt" LD_PRELOAD="$lib" python3 "$here/torch_coalesce_stress.py" "${STRESS_OPS:-10000}" 1 >"$logs/stress_kept.log" 2>&1
  rc=$?
  python3 - "$logs/stress_kept_report.txt.json" <<'PY' || rc=1
import json, sys
p = json.load(open(sys.argv[1]))["process"]
print("    report: " + ", ".join(f"{k[9:]} {v}" for k, v in p.items() if k.startswith("coalesce_")))
ok = p.get("coalesce_reused_bytes", 0) > 0  # in place: coalesce_reused_in_place_bytes, shown
sys.exit(0 if ok and p.get("coalesce_compaction_failures", 1) == 0 else 1)
PY
  result torch_coalesce_stress_kept_handles $rc "$(grep '^{' "$logs/stress_kept.log" | tail -n 1 | cut -c1-400)"
  if [ "$ngpu" -ge 2 ]; then
    EXPSEG_REPORT="$logs/stress2_report.txt" LD_PRELOAD="$lib" python3 "$here/torch_coalesce_stress.py" "${STRESS_OPS:-10000}" 2 >"$logs/stress2.log" 2>&1
    result torch_coalesce_stress_two_gpus $? "$(grep '^{' "$logs/stress2.log" | tail -n 1 | cut -c1-400)$(grep -m1 -iE 'illegal|error:' "$logs/stress2.log" | cut -c1-200)"
  fi
fi

# PyTorch IPC side by side: ctypes cudaIpcGetMemHandle opened by a consumer process (data
# checked, writes traced back), torch.multiprocessing both ways, weight sync; under the
# default allocator, expandable_segments, expseg through its launch path (expseg-run: PyTorch
# on expandable_segments) and expseg by LD_PRELOAD alone (PyTorch's default allocator).
# Both expseg modes must pass everything.
if want torchipc && torch_for torchipc; then
  MODE=default python3 "$here/torch_ipc.py" >"$logs/torch_ipc_default.log" 2>&1
  MODE=expandable_segments PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$here/torch_ipc.py" >"$logs/torch_ipc_expandable.log" 2>&1
  # The same script passes natively (default allocator): the reports show that expseg served
  # the handles.
  served() { cat "$logs"/$1_*.txt.json 2>/dev/null | grep -q '"ipc_handle_requests":[1-9]' || { echo "    expseg saw no IPC handle request"; return 1; }; }
  MODE=expseg-run EXPSEG_LIB="$lib" EXPSEG_REPORT="$logs/torch_ipc_run_report_%p.txt" "$root/scripts/expseg-run" python3 "$here/torch_ipc.py" >"$logs/torch_ipc_expseg_run.log" 2>&1
  rc=$?; served torch_ipc_run_report || rc=1
  result torch_ipc_expseg_run $rc ""
  MODE=expseg-preload LD_PRELOAD="$lib" EXPSEG_REPORT="$logs/torch_ipc_report_%p.txt" python3 "$here/torch_ipc.py" >"$logs/torch_ipc_expseg.log" 2>&1
  rc=$?; served torch_ipc_report || rc=1
  result torch_ipc_expseg_preload $rc ""
  for m in default expandable expseg_run expseg; do echo "    $(grep '^{' "$logs/torch_ipc_$m.log" || tail -n 2 "$logs/torch_ipc_$m.log")"; done
  # Raw IPC of a trained model's tensors (issue 24): mirrors bounded by PyTorch's blocks, and
  # of whole runs (EXPSEG_IPC_EXTENT=run, where most do not fit beside the ballast).
  for ext in torch run; do
    EXPSEG_IPC_EXTENT=$ext LD_PRELOAD="$lib" python3 "$here/torch_ipc_trained.py" --ballast-gib 30 >"$logs/torch_ipc_trained_$ext.log" 2>&1
    result torch_ipc_trained_extent_$ext $? "$(grep '^{' "$logs/torch_ipc_trained_$ext.log" | cut -c1-400 || tail -n 2 "$logs/torch_ipc_trained_$ext.log")"
  done
  # NCCL's buffer registration by hand: another library retains the handle behind a PyTorch
  # page and maps it elsewhere; it must hold that page's bytes (coalesced pages split first).
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$here/torch_foreign_retain.py" >"$logs/foreign_retain_native.log" 2>&1
  result torch_foreign_retain_native $? "$(grep '^{' "$logs/foreign_retain_native.log" | cut -c1-300 || tail -n 2 "$logs/foreign_retain_native.log")"
  LD_PRELOAD="$lib" python3 "$here/torch_foreign_retain.py" >"$logs/foreign_retain.log" 2>&1
  result torch_foreign_retain_expseg $? "$(grep '^{' "$logs/foreign_retain.log" | cut -c1-400 || tail -n 2 "$logs/foreign_retain.log")"
  # Range and pointer queries inside a page and just past PyTorch's pages: the driver's
  # native answers, also where expseg keeps memory grown ahead.
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$here/torch_range_query.py" >"$logs/range_query_native.log" 2>&1
  result torch_range_query_native $? "$(grep '^{' "$logs/range_query_native.log" || tail -n 2 "$logs/range_query_native.log")"
  LD_PRELOAD="$lib" python3 "$here/torch_range_query.py" >"$logs/range_query.log" 2>&1
  result torch_range_query_expseg $? "$(grep '^{' "$logs/range_query.log" || tail -n 2 "$logs/range_query.log")"
fi
if want nodump && torch_for nodump; then
  # torch.multiprocessing with pidfd_getfd denied (non-dumpable processes, no CAP_SYS_PTRACE):
  # as uid 65534 when root. The control run without expseg must fail as PyTorch does.
  asuser=""
  [ "$(id -u)" = 0 ] && asuser="setpriv --reuid=65534 --regid=65534 --clear-groups"
  if [ -n "$asuser" ] && ! command -v setpriv >/dev/null; then
    echo "SKIP torch_nodump: root without setpriv"
  else
    chmod -R a+rX "$here" 2>/dev/null; chmod a+rx "$(dirname "$lib")" "$lib" 2>/dev/null
    nd="env HOME=/tmp PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    $asuser $nd python3 "$here/torch_nodump.py" >"$logs/torch_nodump_native.log" 2>&1
    native=$?
    $asuser $nd EXPSEG_IPC_DIR=/tmp LD_PRELOAD="$lib" python3 "$here/torch_nodump.py" >"$logs/torch_nodump_expseg.log" 2>&1
    rc=$?
    grep -q pidfd_getfd "$logs/torch_nodump_native.log" && [ $native != 0 ] || { echo "  control run without expseg did not fail on pidfd_getfd: the test cannot tell"; rc=1; }
    result torch_multiprocessing_pidfd_getfd_denied $rc "$(grep '^{' "$logs/torch_nodump_expseg.log" || tail -n 2 "$logs/torch_nodump_expseg.log")"
  fi
fi

# The launch wrapper under torchrun, 1 process and (with 2 GPUs) 2: every rank runs under
# expseg and writes its own report; the reports merge into one table; expseg doctor passes.
# One process on two GPUs (issue 24), with two or more: the coalescing stress on both devices
# (TWO_GPU_RUNS runs, default 1; STRESS_FREE_GIB=N, passed through, leaves N GiB of each
# device free so its forced out-of-memory operations take fewer pages) and a model split over
# them trained against the native run.
# empty_cache() while a freed tensor's kernels still run, with another context current
# (PyTorch waits on the current context's stream before unmapping, issue 24): natively an
# illegal memory access (printed, not counted: it is PyTorch's); under expseg the handle's
# device is waited for (coalesce_cross_device_waits), also with kept handles; the control with
# the primary context current adds no wait; device1 (two GPUs) is the case of one thread
# emptying every device's cache.
if want crossctx && torch_for crossctx; then
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$here/torch_cross_context_free.py" own >"$logs/crossctx_native.log" 2>&1
  echo "INFO natively (expandable segments, no expseg), rc=$?: $(grep '^{' "$logs/crossctx_native.log" | cut -c1-250)"
  for c in own:1 own_kept:1 primary:0 device1:1; do
    name=${c%%:*} waits=${c##*:} where=${name%_kept}
    env $([ "$name" = own_kept ] && echo EXPSEG_RELEASE_DELAY=2) EXPSEG_REPORT="$logs/crossctx_$name.txt" LD_PRELOAD="$lib" \
      python3 "$here/torch_cross_context_free.py" "$where" >"$logs/crossctx_$name.log" 2>&1
    rc=$?
    if grep -q '"skipped"' "$logs/crossctx_$name.log"; then echo "SKIP cross_context_free_$name: one GPU"; continue; fi
    got=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["process"].get("coalesce_cross_device_waits", -1))' "$logs/crossctx_$name.txt.json" 2>/dev/null)
    if [ "$waits" = 1 ]; then [ "${got:-0}" -ge 1 ] 2>/dev/null || rc=1; else [ "$got" = 0 ] || rc=1; fi
    result "cross_context_free_$name" $rc "waits $got: $(grep '^{' "$logs/crossctx_$name.log" | cut -c1-250)"
  done
fi
# Another expseg process's reclaim while this one adds to a tensor in a handle grown ahead:
# answered on the socket thread, it may move no live page (a copy would miss the additions
# made meanwhile; 728e8aa's library faulted the worker with an illegal address, 3 of 3). The
# same for a monitor thread's torch.cuda.mem_get_info() in the worker itself.
if want reclaim && torch_for reclaim; then
  python3 "$here/torch_reclaim_race.py" both "$lib" >"$logs/reclaim_race.log" 2>&1
  result torch_reclaim_while_the_program_works $? "$(grep '^{' "$logs/reclaim_race.log" | cut -c1-300)"
  d=$(mktemp -d)
  LD_PRELOAD="$lib" python3 "$here/torch_reclaim_race.py" monitor "$d" 6 >"$logs/monitor_race.log" 2>&1
  result torch_mem_get_info_from_a_monitor_thread_while_the_program_works $? "$(grep '^{' "$logs/monitor_race.log" | cut -c1-300)"
fi
# A thread launching kernels on its tensors while another thread frees and allocates (a freed
# pad shared the tensors' handle; empty_cache(); a backward pass). At the defaults nothing
# moves: the worker's additions are exact on the default stream, on a non-blocking stream of
# its own, and replaying CUDA graphs there (RACE_STREAMS picks), RACE_RUNS runs each (natively
# RACE_RUNS_NATIVE), and the pad's
# pages stayed held while the tensors lived (peak stranded bytes > 0: the test tested).
# EXPSEG_COMPACT=1 (opt-in) moves the live pages under a hold of the default stream
# (coalesce_held_moves): counted on the default stream; printed, not counted, the controls
# that fault (without the fence; the worker on a side stream: docs/configuration.md, EXPSEG_COMPACT).
race_runs() { # name runs env... -- checks each run's JSON with $check (python, e = expseg figures)
  local name=$1 runs=$2 ok=0 i line; shift 2
  for i in $(seq "$runs"); do
    env "$@" python3 "$here/torch_thread_race.py" 10 >"$logs/race_${name}_$i.log" 2>&1
    rc=$?
    line=$(grep '^{' "$logs/race_${name}_$i.log" | tail -n 1)
    case $line in *'"skipped"'*) echo "SKIP $name: $line"; return;; esac
    if [ $rc = 0 ] && [ -n "$check" ]; then
      echo "$line" | python3 -c "import json,sys; e=json.loads(sys.stdin.read())['expseg']; sys.exit(0 if ($check) else 1)" 2>/dev/null || rc=1
    fi
    [ $rc = 0 ] && ok=$((ok + 1))
    last=$line
  done
  result "$name" $([ $ok = "$runs" ] && echo 0 || echo 1) "exact $ok/$runs; last: $(echo "$last" | cut -c1-250)"
}
if want threads && torch_for threads; then
  n=${RACE_RUNS:-1}
  for stream in ${RACE_STREAMS:-default side graph}; do
    check="" race_runs "torch_thread_race_${stream}_native" "${RACE_RUNS_NATIVE:-1}" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True RACE_STREAM=$stream
    check='e["coalesce_held_moves"] == 0 and e["coalesce_compactions"] == 0 and e["coalesce_peak_stranded_bytes"] > 0' \
      race_runs "torch_thread_race_${stream}_defaults" "$n" RACE_STREAM=$stream LD_PRELOAD="$lib"
  done
  check='e["coalesce_held_moves"] >= 1' race_runs torch_thread_race_compact_held 1 EXPSEG_COMPACT=1 LD_PRELOAD="$lib"
  EXPSEG_COMPACT=1 EXPSEG_MOVE_FENCE=0 LD_PRELOAD="$lib" python3 "$here/torch_thread_race.py" 10 >"$logs/thread_race_nofence.log" 2>&1
  echo "INFO EXPSEG_COMPACT=1 without the fence, rc=$?: $(grep '^{' "$logs/thread_race_nofence.log" | cut -c1-200)"
  EXPSEG_COMPACT=1 RACE_STREAM=side LD_PRELOAD="$lib" python3 "$here/torch_thread_race.py" 10 >"$logs/thread_race_side.log" 2>&1
  echo "INFO EXPSEG_COMPACT=1, the worker on a side stream (not held), rc=$?: $(grep '^{' "$logs/thread_race_side.log" | cut -c1-200)"
  EXPSEG_COALESCE=off LD_PRELOAD="$lib" python3 "$here/torch_thread_race.py" 10 >"$logs/thread_race_off.log" 2>&1
  result torch_launches_from_another_thread_with_coalescing_off $? "$(grep '^{' "$logs/thread_race_off.log" | cut -c1-250)"
  # The hold of a peer's default stream on one GPU (EXPSEG_PEER_HOLD=self holds the device's
  # own as a peer's would be; moves need EXPSEG_COMPACT=1): it must start (stream memory
  # operations on page-locked words), then be let go when the move's own fence queues behind
  # it, and the move go on exact.
  EXPSEG_COMPACT=1 EXPSEG_PEER_HOLD=self EXPSEG_LOG=expseg=debug LD_PRELOAD="$lib" python3 "$here/torch_thread_race.py" 6 >"$logs/thread_race_selfhold.log" 2>"$logs/thread_race_selfhold.err"
  rc=$?
  figs=$(grep '^{' "$logs/thread_race_selfhold.log" | python3 -c 'import json,sys; e=json.loads(sys.stdin.read())["expseg"]; print(e["coalesce_held_moves"], e["coalesce_peer_holds_let_go"], e["coalesce_peer_holds"])' 2>/dev/null)
  set -- ${figs:-0 0 0}
  started=$(grep -cE "letting 1 go|watchdog let 1 " "$logs/thread_race_selfhold.err")
  [ "$1" -ge 1 ] && [ "$2" -ge 1 ] && [ "$3" = 0 ] && [ "$started" -ge 1 ] 2>/dev/null \
    || { echo "    held moves $1, peer holds let go $2, kept $3, started then let go $started: the hold did not run as designed"; rc=1; }
  result torch_peer_hold_on_one_gpu_starts_and_is_let_go $rc "started and let go $started; $(grep '^{' "$logs/thread_race_selfhold.log" | cut -c1-250)"
fi
# Sharing is exact (torch_share_exact.py): a share while a worker writes the neighbouring
# tensor (raw cudaIpcGetMemHandle and reduce_tensor; the worker on its own stream, the
# default stream, a graph), a share while another thread captures a graph, and a handle
# taken once with a consumer without expseg reading every sync (host and interprocess event),
# the same through reduce_tensor (the export route), and a consumer writing back into a shared
# weight whose neighbour stays untouched. SHARE_ROUNDS rounds a race run (default 20);
# SHARE_PARTS picks parts (race capture sync syncreduce writeback).
share_part() { [ -z "${SHARE_PARTS:-}" ] || [[ " $SHARE_PARTS " == *" $1 "* ]]; }
# SHARE_ROUTES picks the race's routes (raw reduce; unset: both).
share_route() { [ -z "${SHARE_ROUTES:-}" ] || [[ " $SHARE_ROUTES " == *" $1 "* ]]; }
share_run() { # name check env... -- args after --
  local name=$1 check=$2; shift 2
  local envs=() ; while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" python3 "$here/torch_share_exact.py" "$@" >"$logs/share_$name.log" 2>&1
  local rc=$? line
  line=$(grep '^{' "$logs/share_$name.log" | tail -n 1)
  if [ $rc = 0 ] && [ -n "$check" ]; then
    echo "$line" | python3 -c "import json,sys; o=json.loads(sys.stdin.read()); e=o['expseg']; sys.exit(0 if ($check) else 1)" 2>/dev/null || rc=1
  fi
  result "share_$name" $rc "$(echo "${line:-$(tail -n 2 "$logs/share_$name.log" | tr '\n' ' ')}" | cut -c1-330)"
}
if want share && torch_for share; then
  r=${SHARE_ROUNDS:-20}
  if share_part race; then
    share_route raw && share_run race_raw_side_native "" -- race raw side "$r"
    share_route reduce && share_run race_reduce_side_native "" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- race reduce side "$r"
    share_route raw && for w in side default graph; do
      share_run "race_raw_${w}" 'e["coalesce_compactions"] == 0 and e["coalesce_exports_split"] == 0' LD_PRELOAD="$lib" -- race raw "$w" "$r"
    done
    share_route raw && share_run race_raw_side_plain_consumer 'e["coalesce_compactions"] == 0' CONSUMER=plain LD_PRELOAD="$lib" -- race raw side "$r"
    # The export route: with a non-blocking stream in the program (side) a page inside a
    # coalesced handle is exported through a mirror, nothing moves; without one (default) the
    # handle is split, held by the legacy stream's fence (which then holds every stream).
    share_route reduce && share_run race_reduce_side 'e["coalesce_exports_split"] == 0 and e["export_mirrors_made"] > 0' LD_PRELOAD="$lib" -- race reduce side "$r"
    share_route reduce && for w in default; do
      share_run "race_reduce_${w}" 'e["export_mirrors_made"] == 0' LD_PRELOAD="$lib" -- race reduce "$w" "$r"
    done
  fi
  if share_part capture; then
    share_run capture_native "" -- capture
    share_run capture "" LD_PRELOAD="$lib" -- capture
    share_run capture_reduce_native "" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- capture reduce
    share_run capture_reduce "" LD_PRELOAD="$lib" -- capture reduce
  fi
  if share_part sync; then
    share_run sync_512_host_native "" CONSUMER=plain -- sync 512 host
    share_run sync_4096_event_native "" CONSUMER=plain -- sync 4096 event
    for mib in 512 4096; do
      for m in host event; do
        share_run "sync_${mib}_${m}_plain" "" CONSUMER=plain LD_PRELOAD="$lib" -- sync "$mib" "$m"
      done
    done
    share_run sync_512_host_expseg_consumer "" LD_PRELOAD="$lib" -- sync 512 host
    # What keeping a plain consumer's view current costs: the same without it (reads stale).
    EXPSEG_IPC_MIRROR_SYNC=off CONSUMER=plain LD_PRELOAD="$lib" python3 "$here/torch_share_exact.py" sync 4096 host >"$logs/share_sync_off.log" 2>&1
    echo "INFO EXPSEG_IPC_MIRROR_SYNC=off, 4096 MiB, host: $(grep '^{' "$logs/share_sync_off.log" | cut -c1-300)"
  fi
  if share_part syncreduce; then
    share_run sync_512_event_reduce_native "" CONSUMER=plain PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- sync 512 event reduce
    for m in host event; do
      share_run "sync_512_${m}_reduce_plain" "" CONSUMER=plain LD_PRELOAD="$lib" -- sync 512 "$m" reduce
    done
    share_run sync_512_event_reduce_expseg_consumer "" LD_PRELOAD="$lib" -- sync 512 event reduce
    # With a non-blocking stream in the producer: the pages go through copies kept current.
    for m in host event; do
      share_run "sync_512_${m}_reduce_side_plain" 'e["export_mirrors_made"] > 0 and e["coalesce_exports_split"] == 0' SIDE=1 CONSUMER=plain LD_PRELOAD="$lib" -- sync 512 "$m" reduce
    done
    share_run sync_512_host_reduce_side_expseg_consumer 'e["export_mirrors_made"] > 0' SIDE=1 LD_PRELOAD="$lib" -- sync 512 host reduce
  fi
  if share_part writeback; then
    share_run writeback_native "" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- writeback
    share_run writeback_expseg_consumer "" LD_PRELOAD="$lib" -- writeback
    # A consumer without expseg writing back: natively seen by the producer (the case
    # docs/contract.md names where a share reaches it through a copy).
    share_run writeback_plain_consumer "" CONSUMER=plain LD_PRELOAD="$lib" -- writeback
    # With a side stream the export goes through a one-way copy: printed, the case the
    # contract names (natively both ways).
    SIDE=1 LD_PRELOAD="$lib" python3 "$here/torch_share_exact.py" writeback >"$logs/share_writeback_side.log" 2>&1
    echo "INFO writeback with a side stream (one-way copy, docs/contract.md), rc=$?: $(grep '^{' "$logs/share_writeback_side.log" | cut -c1-300)"
  fi
fi
# TWO_GPU_PARTS picks parts of it (stress race model ipc; unset: all): the whole section takes
# more than 10 minutes with RACE_RUNS=20 (2 x H200), longer than one device call.
two_part() { [ -z "${TWO_GPU_PARTS:-}" ] || [[ " $TWO_GPU_PARTS " == *" $1 "* ]]; }
if want twogpu && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)' 2>/dev/null; then
  two_part stress && for i in $(seq "${TWO_GPU_RUNS:-1}"); do
    EXPSEG_REPORT="$logs/stress2_report_$i.txt" LD_PRELOAD="$lib" python3 "$here/torch_coalesce_stress.py" "${STRESS_OPS:-10000}" 2 16 >"$logs/stress2_$i.log" 2>&1
    result torch_coalesce_stress_two_gpus_$i $? "$(grep '^{' "$logs/stress2_$i.log" | tail -n 1 | cut -c1-300)$(grep -m1 -i 'illegal' "$logs/stress2_$i.log")"
  done
  # Device 1's kernels writing device 0's pages (peer access) while another thread frees and
  # allocates: at the defaults nothing moves, counted (RACE_RUNS runs, natively too). With
  # EXPSEG_COMPACT=1: the peer hold off, printed; EXPSEG_PEER_HOLD=1 counted (device 1's
  # default stream held through each move, or the move put off).
  if two_part race; then
  check="" race_runs torch_peer_race_native "${RACE_RUNS_NATIVE:-1}" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True RACE_STREAM=peer
  check='e["coalesce_held_moves"] == 0 and e["coalesce_compactions"] == 0' \
    race_runs torch_peer_race_defaults "${RACE_RUNS:-1}" RACE_STREAM=peer LD_PRELOAD="$lib"
  EXPSEG_COMPACT=1 RACE_STREAM=peer LD_PRELOAD="$lib" python3 "$here/torch_thread_race.py" 10 >"$logs/peer_race_off.log" 2>&1
  echo "INFO EXPSEG_COMPACT=1 peer race, peer hold off (waited for, not held), rc=$?: $(grep '^{' "$logs/peer_race_off.log" | cut -c1-250)"
  EXPSEG_COMPACT=1 EXPSEG_PEER_HOLD=1 RACE_STREAM=peer LD_PRELOAD="$lib" python3 "$here/torch_thread_race.py" 10 >"$logs/peer_race.log" 2>&1
  rc=$?
  if grep -q '"skipped"' "$logs/peer_race.log"; then
    echo "SKIP torch_peer_writes_while_pages_move: $(grep -o '"skipped": "[^"]*"' "$logs/peer_race.log")"
  else
    # Each move that gives bytes back either holds device 1 or waits (put off) until it can.
    held=$(grep '^{' "$logs/peer_race.log" | python3 -c 'import json,sys; e=json.loads(sys.stdin.read())["expseg"]; print(e["coalesce_peer_holds"] + e["coalesce_moves_put_off"])' 2>/dev/null)
    [ "${held:-0}" -ge 1 ] 2>/dev/null || { echo "    no move held device 1 or waited for it: the test did not test"; rc=1; }
    result torch_peer_writes_while_pages_move $rc "$(grep '^{' "$logs/peer_race.log" | cut -c1-250)"
  fi
  fi
  if two_part model; then
    python3 "$here/torch_two_gpu_model.py" "$lib" 300 >"$logs/two_gpu_model.log" 2>&1
    result torch_model_split_over_two_gpus $? "$(grep '^{' "$logs/two_gpu_model.log" || tail -n 2 "$logs/two_gpu_model.log")"
  fi
  # IPC on two GPUs: device 1's writes through peer access reach the consumer (a mirror waits
  # for them), counted. Whether the consumer's device 1 reads memory opened on device 0 after
  # it gets peer access (after the open, and with `early` before it) is the driver's: natively
  # first, then an expseg producer's plain consumer must answer as natively, and an expseg
  # consumer (ticket imports get peer access) at least as well.
  if ! two_part ipc; then
    :
  elif nvcc -O2 -cudart shared -o "$build/ipc_test2" "$here/ipc_test.cu" -lcuda >>"$logs/build.log" 2>&1; then
    for when in late early; do
      "$build/ipc_test2" two - $when >"$logs/ipc2_native_$when.log" 2>&1
      rc=$?
      native=$(sed -n 's/^PEER_READ //p' "$logs/ipc2_native_$when.log")
      result ipc_two_gpus_native_$when $rc "$(grep -E '^(PASS|FAIL|SKIP)' "$logs/ipc2_native_$when.log")"
      for consumer in - "$lib"; do
        name=ipc_two_gpus_expseg_producer_$([ "$consumer" = - ] && echo plain || echo expseg)_consumer_$when
        EXPSEG_REPORT="$logs/$name.txt" LD_PRELOAD="$lib" "$build/ipc_test2" two "$consumer" $when >"$logs/$name.log" 2>&1
        rc=$?
        grep -q '"ipc_handle_requests":[1-9]' "$logs/$name.txt.json" 2>/dev/null || { echo "    expseg saw no IPC handle request"; rc=1; }
        got=$(sed -n 's/^PEER_READ //p' "$logs/$name.log")
        if [ -z "$native" ]; then
          :
        elif [ "$consumer" = - ]; then
          [ "$got" = "$native" ] || { echo "    the consumer's device 1 read: $got, natively $native"; rc=1; }
        else
          [ -n "$got" ] && [ "${got:-0}" -ge "${native:-1}" ] || { echo "    the consumer's device 1 read: $got, natively $native"; rc=1; }
        fi
        result "$name" $rc "$(grep -E '^(PASS|FAIL|SKIP)' "$logs/$name.log")"
      done
    done
  else
    result build_ipc_test_two_gpus 1 "(nvcc failed: $logs/build.log)"
  fi
elif want twogpu; then
  echo "SKIP twogpu: fewer than two GPUs"
fi
if want torchrun && torch_for torchrun; then
  ngpu=$(nvidia-smi -L | wc -l)
  for n in 1 2; do
    if [ "$n" -gt "$ngpu" ]; then echo "SKIP torchrun with $n processes: $ngpu GPU"; continue; fi
    rdir="$logs/torchrun$n-reports"
    EXPSEG_LIB="$lib" EXPSEG_REPORT_DIR="$rdir" "$root/scripts/expseg-run" \
      python3 -m torch.distributed.run --standalone --nproc-per-node "$n" "$here/torchrun_test.py" >"$logs/torchrun$n.log" 2>&1
    rc=$?
    [ "$(ls "$rdir"/*.json 2>/dev/null | wc -l)" -ge "$n" ] || { echo "    missing per-rank reports in $rdir"; rc=1; }
    python3 "$root/scripts/expseg-report-merge" "$rdir" >"$logs/torchrun$n-merged.txt" 2>&1 || { echo "    the reports did not merge"; rc=1; }
    result "torchrun_${n}_processes_under_expseg_run" $rc "$(grep -c 'all_reduce ok' "$logs/torchrun$n.log") ranks ok"
    grep '^rank' "$logs/torchrun$n.log" | sed 's/^/    /'
    sed 's/^/    /' "$logs/torchrun$n-merged.txt"
  done
  # NCCL user-buffer registration (ncclCommRegister) of pages inside coalesced PyTorch tensors:
  # all_reduce and send/recv sums natively (expandable segments) and under expseg. With two
  # ranks NCCL 2.28 maps the peer's registered pages by IPC (retain at the range base, POSIX fd,
  # the peer's proxy maps it) for send/recv and an out-of-place ring all-reduce's receive
  # buffer, Simple protocol; its REG lines must show that path taken, and no failure.
  for n in 1 2; do
    if [ "$n" -gt "$ngpu" ]; then echo "SKIP nccl_register with $n processes: $ngpu GPU"; continue; fi
    for m in native expseg; do
      pre=; [ $m = expseg ] && pre=$lib
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True LD_PRELOAD="$pre" NCCL_ALGO=Ring NCCL_PROTO=Simple NCCL_NVLS_ENABLE=0 \
        NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG NCCL_DEBUG_FILE="$logs/nccl_reg_${m}_$n.%h.%p.txt" \
        python3 -m torch.distributed.run --standalone --nproc-per-node "$n" "$here/nccl_register_test.py" >"$logs/nccl_reg_${m}_$n.log" 2>&1
      rc=$?
      [ "$(grep -c ': ok' "$logs/nccl_reg_${m}_$n.log")" = "$n" ] || rc=1
      reg=$(cat "$logs"/nccl_reg_${m}_$n.*.txt 2>/dev/null)
      ipc=$(grep -c 'IPC register buffer .* regAddr' <<<"$reg"); proxy=$(grep -c 'Proxy rank .* register success' <<<"$reg")
      bad=$(grep -cE 'failed to IPC register|Skipping registration' <<<"$reg")
      if [ "$n" -ge 2 ] && { [ "$ipc" -lt 1 ] || [ "$proxy" -lt 1 ]; }; then echo "    NCCL took no IPC registration path: the test did not test"; rc=1; fi
      [ "$bad" = 0 ] || { echo "    NCCL: $(grep -m2 -E 'failed to IPC register|Skipping registration' <<<"$reg")"; rc=1; }
      result "nccl_register_${n}_processes_$m" $rc "$(grep -c ': ok' "$logs/nccl_reg_${m}_$n.log") ranks ok; NCCL IPC registrations $ipc, peer maps $proxy, failures $bad"
      grep '^rank' "$logs/nccl_reg_${m}_$n.log" | cut -c1-300 | sed 's/^/    /'
    done
  done
fi
# Sleep and wake: a 24 GiB model paused to the host and resumed (bytes, CUDA graph, losses),
# its memory taken by a plain process meanwhile, a tagged KV cache dropped and made again; then
# a training script nobody changed paused and resumed from outside (expseg pause/resume PID).
# With TMS_DIR (torch_memory_saver 0.0.10 installed there: pip install --no-deps --target DIR
# its wheel), the same scenario under torch_memory_saver, for the comparison in RESULTS.md.
if want sleep && torch_for sleep; then
  EXPSEG_LOG=info python3 "$here/torch_sleep.py" "$(dirname "$lib")" --json "$logs/sleep.json" >"$logs/sleep.log" 2>&1
  result torch_pause_resume $? "$(tail -n 1 "$logs/sleep.log")"
  grep -E '^(FAIL|MET|MISSED)|^baseline|INFO\] (paused|resumed)' "$logs/sleep.log" | sed 's/^/    /'
  bash "$here/torch_sleep_external.sh" "$lib" "$(dirname "$lib")/expseg" "$logs/sleep_external" >"$logs/sleep_external.log" 2>&1
  result expseg_pause_resume_pid $? "$(tail -n 1 "$logs/sleep_external.log")"
  if [ -n "${TMS_DIR:-}" ]; then
    python3 "$here/tms_sleep.py" --tms-dir "$TMS_DIR" --json "$logs/tms.json" >"$logs/tms.log" 2>&1
    result torch_memory_saver_comparison $? "$(grep '^baseline' "$logs/tms.log")"
  fi
fi

# A busy training loop (default stream, a side stream, another thread's stream, CUDA graphs)
# paused whole from outside at random moments and resumed: weights equal to a native run's.
if want pausebusy && torch_for pausebusy; then
  bash "$here/pause_busy.sh" "$lib" "$(dirname "$lib")/expseg" "$logs/pause_busy" >"$logs/pause_busy.log" 2>&1
  result expseg_pause_busy_program $? "$(tail -n 1 "$logs/pause_busy.log")"
  grep -E '^(PASS|FAIL)' "$logs/pause_busy.log" | sed 's/^/    /'
fi

doctor=$(dirname "$lib")/expseg
if ! want doctor; then :
elif [ -x "$doctor" ]; then
  EXPSEG_LIB="$lib" "$doctor" doctor >"$logs/doctor.log" 2>&1
  result expseg_doctor $? ""
  sed 's/^/    /' "$logs/doctor.log"
else
  echo "SKIP expseg doctor: $doctor not built"
fi

# A process that never touches CUDA stays undisturbed under the shim.
if want quiet; then
out=$(EXPSEG_REPORT="$logs/quiet_%p.txt" LD_PRELOAD="$lib" python3 -c 'print("hello")' 2>&1)
[ "$out" = hello ] && ! ls "$logs"/quiet_* >/dev/null 2>&1
result non_cuda_process_undisturbed $? ""
fi

rm -rf "$build"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
