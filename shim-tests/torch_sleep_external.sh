#!/usr/bin/env bash
# External sleep: the expseg CLI pauses and resumes the GPU memory of a PyTorch program that
# nobody changed (shim-tests/plain_train_wait.py: no expseg import), and its losses stay
# those of a native run, bit for bit.
#
#     shim-tests/torch_sleep_external.sh path/to/libexpseg.so path/to/expseg OUTDIR
#
# Steps: a native run (no LD_PRELOAD) gives the reference losses; a run under LD_PRELOAD
# stops after step 3 (writes OUTDIR/expseg/ready, waits for .../go); `expseg pause --pool PID`; a
# plain process takes the memory given back (and nvidia-smi shows it); `expseg paused PID`;
# another user (uid 65534, via setpriv, su or sudo; skipped when none works) is refused;
# a resume while a plain process leaves room for about half fails and says how much it resumed;
# `expseg resume PID` resumes the rest; the program finishes and its 6 losses must equal the
# native ones.
# Logs in OUTDIR. Prints PASS/FAIL lines, last "N passed, M failed"; exit 1 on any failure.
set -u
[ $# = 3 ] || { echo "usage: $0 LIB CLI OUTDIR"; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
lib=$(readlink -f "$1") cli=$(readlink -f "$2") out=$3
[ -f "$lib" ] || { echo "FAIL: $lib is missing"; exit 1; }
[ -x "$cli" ] || { echo "FAIL: $cli is missing or not executable"; exit 1; }
mkdir -p "$out" && out=$(readlink -f "$out")
passed=0 failed=0 pid=""
result() { # name status detail
  if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "PASS $1 $3"; else failed=$((failed + 1)); echo "FAIL $1 $3"; fi
}
finish() {
  echo "$passed passed, $failed failed"
  [ "$failed" = 0 ] && exit 0 || exit 1
}
cleanup() { # our own training process only, if it is still there
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && kill "$pid" 2>/dev/null
  [ -n "${tmp:-}" ] && rm -rf "$tmp"
}
trap cleanup EXIT
plain() { env -u LD_PRELOAD -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF "$@"; }
gpu=${CUDA_VISIBLE_DEVICES:-0}
gpu=${gpu%%,*}
smi() { nvidia-smi -i "$gpu" --query-gpu="$1" --format=csv,noheader,nounits | head -n 1 | tr -d ' '; }
# The CLI runs with --json: one object per process, sizes in bytes ("bytes":N).
bytes_of() { sed -n 's/.*"bytes":\([0-9]*\).*/\1/p' | head -n 1; }
echo "library: $lib"
echo "cli: $cli"
echo "logs: $out"

# 1. Native reference: `go` is there from the start, so it never waits.
rm -rf "$out/native" "$out/expseg"
mkdir -p "$out/native" "$out/expseg"
touch "$out/native/go"
plain python3 "$here/plain_train_wait.py" "$out/native" >"$out/native.log" 2>&1
result native_run $? "$(tail -n 1 "$out/native.log")"

# 2. The same program under expseg, in the background, until it waits after step 3.
env -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF LD_PRELOAD="$lib" \
  python3 "$here/plain_train_wait.py" "$out/expseg" >"$out/expseg.log" 2>&1 &
pid=$!
for _ in $(seq 3000); do # up to 300 s
  [ -e "$out/expseg/ready" ] || ! kill -0 "$pid" 2>/dev/null && break
  sleep 0.1
done
if [ ! -e "$out/expseg/ready" ]; then
  result expseg_run_ready 1 "pid $pid never wrote ready: $(tail -n 3 "$out/expseg.log" | tr '\n' ' ')"
  finish
fi
result expseg_run_ready 0 "pid $pid after step 3"

# 3. Pause from outside.
used0=$(smi memory.used) free0=$(smi memory.free)
t0=$(date +%s%N)
pause_out=$("$cli" pause --pool "$pid" --json 2>"$out/pause.err")
rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
echo "$pause_out" >"$out/pause.out"
bytes=$(bytes_of <<<"$pause_out")
bytes=${bytes:-0}
[ "$rc" = 0 ] && [ "$bytes" -gt 0 ]
result cli_pause $? "rc $rc, ${ms} ms wall: $pause_out $(head -c 300 "$out/pause.err")"

if [ "$bytes" -gt 0 ]; then
  sleep 0.2
  used1=$(smi memory.used)
  drop=$(((used0 - used1) * 1048576))
  [ "$drop" -ge $((bytes * 8 / 10)) ]
  result nvidia_smi_used_dropped $? "used ${used0} -> ${used1} MiB; paused $((bytes >> 20)) MiB"
  # A plain process asks for what was free anyway (less 2 GiB for its context) + 90 % of the
  # paused bytes: it fits only if the pause really gave the memory back.
  spare=$((free0 * 1048576 - (2 << 30)))
  [ "$spare" -lt 0 ] && spare=0
  n=$((bytes * 9 / 10 + spare))
  plain python3 - "$n" >"$out/child.log" 2>&1 <<'PY'
import sys
import torch
n = int(sys.argv[1])
t = torch.empty(n, dtype=torch.uint8, device="cuda")
t.fill_(7)
torch.cuda.synchronize()
assert t[-1].item() == 7
print(f"OK allocated and wrote {n} bytes")
PY
  result plain_process_allocates_paused_memory $? "$((n >> 20)) MiB: $(tail -n 1 "$out/child.log")"
fi

# 4. What is paused, as the CLI tells it.
paused_out=$("$cli" paused "$pid" --json 2>&1)
rc=$?
now=$(bytes_of <<<"$paused_out")
[ "$rc" = 0 ] && [ "${now:-x}" = "$bytes" ]
result cli_paused $? "$paused_out"
# The same through --gpu 0 (the processes nvidia-smi lists on GPU 0), where nvidia-smi sees pids.
gpu_out=$("$cli" paused --gpu 0 --json 2>&1)
if grep -q "lists no process" <<<"$gpu_out"; then
  echo "SKIP cli_paused_gpu: nvidia-smi lists no process here ($gpu_out)"
else
  grep -q "^{\"pid\":$pid,\"command\":\"paused\",\"bytes\":$bytes}" <<<"$gpu_out"
  result cli_paused_gpu $? "$(head -c 300 <<<"$gpu_out")"
fi

# 5. Another user is refused (uid 65534), with the CLI copied where that user can run it.
asuser=()
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
  asuser=(setpriv --reuid=65534 --regid=65534 --clear-groups)
elif [ "$(id -u)" = 0 ] && su nobody -s /bin/sh -c true 2>/dev/null; then
  asuser=(su nobody -s /bin/sh -c 'exec "$0" "$@"')
elif sudo -n -u nobody true 2>/dev/null; then
  asuser=(sudo -n -u nobody --)
fi
tmp=$(mktemp -d)
chmod 755 "$tmp" && cp "$cli" "$lib" "$tmp/" && chmod 755 "$tmp"/*
if [ ${#asuser[@]} = 0 ]; then
  echo "SKIP other_user_refused: not root and no sudo for nobody (cannot act as another user)"
elif ! "${asuser[@]}" /bin/sh -c 'test -x "$0"' "$tmp/$(basename "$cli")" 2>/dev/null; then
  echo "SKIP other_user_refused: ${asuser[0]} cannot run the CLI as uid 65534 here"
else
  other=$("${asuser[@]}" "$tmp/$(basename "$cli")" pause --pool "$pid" 2>&1)
  rc=$?
  after=$("$cli" paused "$pid" --json 2>&1)
  # exit 1 is a refusal; 126/127 would be a failure to run at all
  [ "$rc" = 1 ] && [ "$after" = "$paused_out" ]
  result other_user_refused $? "rc $rc: $(head -c 300 <<<"$other")"
fi

# 6a. A resume without room for all of it: a plain process leaves free about half of what is
# paused. The resume fails, says how many bytes it resumed before the failure (what fits), and
# the rest stays paused (`expseg paused`).
early=0
if [ "$bytes" -gt 0 ]; then
  rm -f "$out/holder.ready" "$out/holder.go"
  plain python3 - "$((bytes / 2))" "$out/holder" >"$out/holder.log" 2>&1 <<'PY' &
import os, sys, time
import torch
leave, flag = int(sys.argv[1]), sys.argv[2]
free, _ = torch.cuda.mem_get_info()
t = torch.empty(max(free - leave, 0), dtype=torch.uint8, device="cuda")
print(f"holding {t.numel()} bytes, leaving {leave}", flush=True)
open(flag + ".ready", "w").close()
while not os.path.exists(flag + ".go"):
    time.sleep(0.05)
PY
  holder=$!
  for _ in $(seq 600); do [ -e "$out/holder.ready" ] || ! kill -0 $holder 2>/dev/null && break; sleep 0.1; done
  partial=$("$cli" resume "$pid" --json 2>&1)
  rc=$?
  early=$(bytes_of <<<"$partial")
  left=$("$cli" paused "$pid" --json 2>&1)
  now=$(bytes_of <<<"$left")
  touch "$out/holder.go"
  wait $holder
  [ "$rc" = 1 ] && grep -q "not enough free GPU memory" <<<"$partial" && [ -n "$early" ] &&
    [ "$early" -lt "$bytes" ] && [ "${now:-x}" = "$((bytes - early))" ]
  result cli_resume_without_room $? "rc $rc: $(head -c 400 <<<"$partial"); then: $left ($(head -n 1 "$out/holder.log"))"
  early=${early:-0}
fi

# 6. Resume; the program goes on.
t0=$(date +%s%N)
resume_out=$("$cli" resume "$pid" --json 2>"$out/resume.err")
rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
back=$(bytes_of <<<"$resume_out")
[ "$rc" = 0 ] && [ "${back:-x}" = "$((bytes - early))" ]
result cli_resume $? "rc $rc, ${ms} ms wall: $resume_out $(head -c 300 "$out/resume.err")"
after=$("$cli" paused "$pid" --json 2>&1)
grep -q "^{\"pid\":$pid,\"command\":\"paused\",\"bytes\":0}" <<<"$after"
result cli_paused_after_resume $? "$after"
touch "$out/expseg/go"
for _ in $(seq 1200); do # up to 120 s
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$pid" 2>/dev/null; then
  result expseg_run_finished 1 "still running 120 s after go"
else
  wait "$pid"
  result expseg_run_finished $? "$(tail -n 1 "$out/expseg.log")"
fi
pid=""

# 7. The losses: identical to the native run's.
grep '^step' "$out/native.log" >"$out/native.losses"
grep '^step' "$out/expseg.log" >"$out/expseg.losses"
[ "$(wc -l <"$out/native.losses")" = 6 ] && cmp -s "$out/native.losses" "$out/expseg.losses"
result losses_equal_native $? "$(wc -l <"$out/expseg.losses") of 6 steps; last: $(tail -n 1 "$out/expseg.losses")"
finish
