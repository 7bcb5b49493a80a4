#!/usr/bin/env bash
# A busy program paused from outside: `expseg pause PID` (the whole process, by the driver's
# checkpoint) of a PyTorch training loop under expseg that never waits (shim-tests/
# torch_busy_loop.py), PAUSE_COUNT times at random moments, each held for a random
# 0.1-PAUSE_HOLD_MAX s, then `expseg resume PID`. The loop's weights must hash as an undisturbed
# native run's, every pause and resume must succeed, and while paused nvidia-smi must list the
# process with no memory (or not at all).
#
#     shim-tests/pause_busy.sh LIB CLI OUTDIR
#
# PAUSE_MODES (default "default thread side graph"), PAUSE_COUNT (20), PAUSE_HOLD_MAX (2.0),
# PAUSE_STEPS (2500). Logs and each pause's JSON line in OUTDIR. Prints PASS/FAIL lines, last
# "N passed, M failed"; exit 1 on any failure.
set -u
[ $# = 3 ] || { echo "usage: $0 LIB CLI OUTDIR"; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
lib=$(readlink -f "$1") cli=$(readlink -f "$2") out=$3
mkdir -p "$out" && out=$(readlink -f "$out")
modes=${PAUSE_MODES:-default thread side graph} count=${PAUSE_COUNT:-20}
hold_max=${PAUSE_HOLD_MAX:-2.0} steps=${PAUSE_STEPS:-2500}
passed=0 failed=0 pid=""
result() { # name status detail
  if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "PASS $1 $3"; else failed=$((failed + 1)); echo "FAIL $1 $3"; fi
}
cleanup() { [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && kill "$pid" 2>/dev/null; }
trap cleanup EXIT
command -v nvidia-smi >/dev/null || { echo "SKIP pause_busy: no nvidia-smi (no GPU)"; exit 0; }
rnd() { python3 -c "import random; print(round(random.uniform($1, $2), 3))"; }
plain() { env -u LD_PRELOAD -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF "$@"; }
hash_of() { grep -o 'sha256 [0-9a-f]*' "$1" | tail -n 1; }
declare -A ref
for mode in $modes; do
  key=$mode
  [ "$mode" = graph ] || key=eager # default, side and thread compute the same weights
  if [ -z "${ref[$key]:-}" ]; then
    plain python3 "$here/torch_busy_loop.py" "$mode" --steps "$steps" >"$out/ref-$key.log" 2>&1
    ref[$key]=$(hash_of "$out/ref-$key.log")
    [ -n "${ref[$key]}" ] || { result "reference_$key" 1 "$(tail -n 2 "$out/ref-$key.log")"; continue; }
  fi
  log=$out/$mode.log js=$out/$mode.jsonl
  rm -f "$out/$mode.ready" "$js"
  env -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF LD_PRELOAD="$lib" \
    python3 "$here/torch_busy_loop.py" "$mode" --steps "$steps" --ready "$out/$mode.ready" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do [ -e "$out/$mode.ready" ] || ! kill -0 $pid 2>/dev/null && break; sleep 0.1; done
  ok=0 tried=0 listed=""
  for i in $(seq "$count"); do
    sleep "$(rnd 0.05 0.4)"
    kill -0 $pid 2>/dev/null || break
    tried=$((tried + 1))
    p=$("$cli" pause "$pid" --json 2>&1)
    echo "$p" >>"$js"
    if [ "$i" = 1 ]; then # while paused: what nvidia-smi lists for it
      listed=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | awk -F', ' -v p=$pid '$1 == p {print $2}')
    fi
    sleep "$(rnd 0.1 "$hold_max")"
    r=$("$cli" resume "$pid" --json 2>&1)
    echo "$r" >>"$js"
    case "$p$r" in *'"mode":"whole"'*'"command":"resume","mode":"whole"'*) ok=$((ok + 1)) ;; esac
  done
  wait $pid
  rc=$?
  pid=""
  h=$(hash_of "$log")
  torn=$(grep -c TORN "$log")
  [ $rc = 0 ] && [ "$h" = "${ref[$key]}" ] && [ "$ok" = "$tried" ] && [ "$tried" -gt 0 ] && [ "$torn" = 0 ]
  result "busy_$mode" $? "paused and resumed $ok/$tried, exit $rc, weights $([ "$h" = "${ref[$key]}" ] && echo equal || echo "DIFFER ($h vs ${ref[$key]})")$( [ "$mode" = thread ] && grep -o 'counter [A-Za-z0-9.]*' "$log")"
  [ -z "$listed" ] || [ "$listed" = 0 ]
  result "given_back_$mode" $? "nvidia-smi while paused: ${listed:-not listed}"
done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
