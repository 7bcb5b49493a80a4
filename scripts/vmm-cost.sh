#!/usr/bin/env bash
# What PyTorch's expandable segments cost in driver calls, and why expseg cannot take it away
# (docs/failed-approaches.md, "Serving expandable segments faster"). On a GPU machine:
#
#     scripts/vmm-cost.sh [OUT_DIR]
#
# 1. pages: sub-range semantics (partial unmap, sliced maps) and per-call costs of 20 MiB pages
#    against one big chunk and cudaMalloc;
# 2. threads: whether create/map/access/unmap/release of 2400 pages scale over host threads;
# 3. profile: an LD_PRELOAD profiler of PyTorch's VMM calls (through the runtime's driver entry
#    point API) on a churn loop (48 GiB per step, empty_cache every step), default allocator
#    and expandable_segments, with the step times with and without the profiler;
# 4. release_behind: a churn step by how released physical memory is handled (synchronous
#    release, release on a background thread, reuse of released handles, cudaMalloc);
# 5. churn_phases: where a PyTorch churn step's time goes, per allocator mode (with LIB set,
#    also under expseg: LIB=target/release/libexpseg.so scripts/vmm-cost.sh).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-vmm-cost-out}
mkdir -p "$out"
build=$(mktemp -d)
nvcc -O2 -o "$build/pages" "$here/vmm-cost/pages.cu" -lcuda
nvcc -O2 -std=c++17 -o "$build/threads" "$here/vmm-cost/threads.cu" -lcuda
gcc -shared -fPIC -O2 -o "$build/profile.so" "$here/vmm-cost/profile.c" -ldl
"$build/pages" | tee "$out/pages.txt"
"$build/threads" | tee "$out/threads.txt"
for m in default expandable; do
  if [ $m = expandable ]; then export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; else unset PYTORCH_CUDA_ALLOC_CONF; fi
  PROF_OUT="$out/profile-$m.txt" LD_PRELOAD="$build/profile.so" python3 "$here/vmm-cost/churn.py" "$m (profiled)"
  python3 "$here/vmm-cost/churn.py" "$m"
done | tee "$out/churn.txt"
cat "$out"/profile-*.txt
nvcc -O2 -std=c++17 -o "$build/release_behind" "$here/vmm-cost/release_behind.cu" -lcuda -lpthread
"$build/release_behind" 40 | tee "$out/release_behind.txt"
{
  python3 "$here/vmm-cost/churn_phases.py" default
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$here/vmm-cost/churn_phases.py" expandable
  if [ -n "${LIB:-}" ]; then LD_PRELOAD="$LIB" python3 "$here/vmm-cost/churn_phases.py" expseg; fi
} | tee "$out/churn_phases.txt"
