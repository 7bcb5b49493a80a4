#!/usr/bin/env bash
# One call of the GPU machine (the device tool) as a unit of work: each PART runs under its
# own time bound and its summary lines go to $OUT/summary.txt as soon as it ends, so a call
# cut at its limit still brings back what it did. Nothing is built here but C probes: build
# libexpseg.so and the CLI where Rust is (cargo build --release) and carry them in an ignored
# folder (DEV, default .dev). Keep what comes back small: the device tool returns a handful
# of files (summary.txt and the bench's JSON; logs stay on the machine unless KEEP_LOGS=1).
#
#   DEV=.dev scripts/gpu-call.sh 'suite share threads' 'bench gpt2_ec rl --rounds 3' keep
#
# PARTs:
#   suite SECTION...         shim-tests/run.sh with ONLY="SECTION..." (its PASS/FAIL lines)
#   bench WORKLOAD... [ARGS] scripts/bench_torch.py --workloads ... (ARGS: --modes, --rounds,
#                            --fill-expseg ...); JSON to $OUT/bench-N.json for scripts/bench_add.py
#   keep [ROUNDS]            shim-tests/keep_newcomer.py (EXPSEG_KEEP=auto beside plain newcomers)
#   dmabuf                   shim-tests/torch_dmabuf_pause.py
#   probe FILE.c|cu [ARGS]   a probe of scripts/vmm-cost built with nvcc and run
#   newcomer                 scripts/vmm-cost/newcomer.c watching while a PyTorch and a C newcomer
#                            arrive (device-file opens, NVML listing, their own timestamps)
# PART_LIMIT: seconds each part may take (default 300).
set -u
out=${OUT:-/tmp/gpu-call}; mkdir -p "$out"
dev=${DEV:-.dev}; lib=$PWD/$dev/libexpseg.so
limit=${PART_LIMIT:-300}
logs=${KEEP_LOGS:+$out/logs}; logs=${logs:-/tmp/gpu-call-logs}; mkdir -p "$logs"
say() { echo "$*" | tee -a "$out/summary.txt"; }
[ -f "$lib" ] || { say "no $lib: build it (cargo build --release) and carry $dev"; exit 1; }
say "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1) lib $(sha256sum "$lib" | cut -c1-12)"
n=0
for part in "$@"; do
  n=$((n + 1)); set -- $part; kind=$1; shift
  t0=$SECONDS
  case "$kind" in
    suite)
      LOG_DIR=$logs/suite-$n ONLY="$*" timeout "$limit" shim-tests/run.sh "$lib" >"$logs/suite-$n.log" 2>&1
      say "suite $* rc=$? ($((SECONDS - t0)) s)"; grep -E '^(PASS|FAIL|SKIP)|passed' "$logs/suite-$n.log" | cut -c1-400 | tee -a "$out/summary.txt" ;;
    bench)
      w=(); while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do w+=("$1"); shift; done
      timeout "$limit" python3 scripts/bench_torch.py --lib "$lib" --workloads "${w[@]}" "$@" --out "$logs/bench-$n" --json "$out/bench-$n.json" >"$logs/bench-$n.log" 2>&1
      say "bench ${w[*]} $* rc=$? ($((SECONDS - t0)) s)"; grep -A40 'rounds | vs default' "$logs/bench-$n.log" | grep '^|' | tee -a "$out/summary.txt" ;;
    keep)
      timeout "$limit" python3 shim-tests/keep_newcomer.py "$lib" "${1:-10}" >"$logs/keep-$n.log" 2>&1
      say "keep rc=$? ($((SECONDS - t0)) s)"; grep -E '^(round|PASS|FAIL)|gave back' "$logs/keep-$n.log" | cut -c1-220 | tee -a "$out/summary.txt" ;;
    dmabuf)
      env -u PYTORCH_CUDA_ALLOC_CONF LD_PRELOAD="$lib" PYTHONPATH=python timeout "$limit" python3 shim-tests/torch_dmabuf_pause.py >"$logs/dmabuf-$n.log" 2>&1
      say "dmabuf rc=$? $(tail -1 "$logs/dmabuf-$n.log" | cut -c1-400)" ;;
    probe)
      src=scripts/vmm-cost/$1; shift; exe=/tmp/probe-$n
      if nvcc -O2 -o "$exe" "$src" -lcuda -lpthread -ldl >"$logs/probe-$n.build" 2>&1; then
        timeout "$limit" "$exe" "$@" >"$logs/probe-$n.log" 2>&1
        say "probe $src $* rc=$?"; cut -c1-400 "$logs/probe-$n.log" | tail -40 | tee -a "$out/summary.txt"
      else
        say "probe $src: build failed: $(tail -3 "$logs/probe-$n.build")"
      fi ;;
    newcomer)
      exe=/tmp/newcomer-$n
      if nvcc -O2 -o "$exe" scripts/vmm-cost/newcomer.c -lcuda -ldl >"$logs/newcomer-$n.build" 2>&1; then
        { "$exe" watch 8 & sleep 1; python3 scripts/vmm-cost/newcomer_torch.py; sleep 1; "$exe" newcomer; wait; } >"$logs/newcomer-$n.log" 2>&1
        say "newcomer rc=$?"; grep -E '^(mode|listed|opened|free_drop|polls)' "$logs/newcomer-$n.log" | cut -c1-200 | head -40 | tee -a "$out/summary.txt"
      else
        say "newcomer: build failed: $(tail -3 "$logs/newcomer-$n.build")"
      fi ;;
    *) say "unknown part '$kind' (suite, bench, keep, dmabuf, probe, newcomer)" ;;
  esac
done
