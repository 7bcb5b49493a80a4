#!/usr/bin/env bash
# Allocation benchmark, on a GPU machine: native cudaMalloc/cudaFree against expseg in the
# same run, in three configurations: the default cache bound (1 GiB), EXPSEG_CACHE_MAX=0
# (every pair goes to the driver: first-touch cost) and EXPSEG_CACHE_MAX=64G.
#
#     scripts/bench-alloc.sh [path/to/libexpseg.so] [OUT_DIR]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
lib=$(readlink -f "${1:-${EXPSEG_LIB:-$here/../target/release/libexpseg.so}}")
out=${2:-$(mktemp -d)}
mkdir -p "$out"
nvcc -O2 -cudart shared -o "$out/bench_alloc" "$here/bench_alloc.cu"
"$out/bench_alloc" >"$out/bench_native.txt"
LD_PRELOAD="$lib" "$out/bench_alloc" >"$out/bench_expseg_default.txt"
EXPSEG_CACHE_MAX=0 LD_PRELOAD="$lib" "$out/bench_alloc" >"$out/bench_expseg_cache0.txt"
EXPSEG_CACHE_MAX=64G LD_PRELOAD="$lib" "$out/bench_alloc" >"$out/bench_expseg_cache64G.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 "$here/bench_report.py" "$out" | tee "$out/bench_table.md"
