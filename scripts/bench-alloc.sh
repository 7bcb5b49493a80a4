#!/usr/bin/env bash
# Allocation benchmark, on a GPU machine. Each run times native cudaMalloc/cudaFree and
# expseg's alternately in one process (see bench_alloc.cu), in three configurations:
# EXPSEG_CACHE_MAX=0 (the default: every pair goes to the driver, the first-touch cost),
# EXPSEG_CACHE_MAX=1G (opt-in keeping, the default before 2026-11-23) and
# EXPSEG_CACHE_MAX=64G (opt-in); and first-touch with 2 GiB chunks.
#
#     scripts/bench-alloc.sh [path/to/libexpseg.so] [OUT_DIR]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
lib=$(readlink -f "${1:-${EXPSEG_LIB:-$here/../target/release/libexpseg.so}}")
out=${2:-$(mktemp -d)}
mkdir -p "$out"
nvcc -O2 -cudart shared -o "$out/bench_alloc" "$here/bench_alloc.cu"
EXPSEG_CACHE_MAX=0 LD_PRELOAD="$lib" EXPSEG_REPORT="$out/report_cache0.txt" "$out/bench_alloc" >"$out/bench_cache0.txt"
EXPSEG_CACHE_MAX=1G LD_PRELOAD="$lib" EXPSEG_REPORT="$out/report_cache1G.txt" "$out/bench_alloc" >"$out/bench_cache1G.txt"
EXPSEG_CACHE_MAX=64G LD_PRELOAD="$lib" EXPSEG_REPORT="$out/report_cache64G.txt" "$out/bench_alloc" >"$out/bench_cache64G.txt"
# The chunk-size choice: first-touch cost with chunks of at most 2 GiB instead of one per
# allocation (the default).
EXPSEG_CACHE_MAX=0 EXPSEG_MAX_CHUNK=2G LD_PRELOAD="$lib" "$out/bench_alloc" >"$out/bench_cache0_chunk2G.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 "$here/bench_report.py" "$out" | tee "$out/bench_table.md"
# CuPy (static runtime: seen only through driver-level interposition), memory pool off:
# median microseconds per allocate+free pair, native against expseg in the same run.
if python3 -c 'import cupy' 2>/dev/null; then
  python3 "$here/bench_cupy.py" >"$out/cupy_native.json"
  LD_PRELOAD="$lib" EXPSEG_REPORT="$out/report_cupy.txt" python3 "$here/bench_cupy.py" >"$out/cupy_expseg.json"
  python3 - "$out/cupy_native.json" "$out/cupy_expseg.json" <<'PY' | tee -a "$out/bench_table.md"
import json, sys
n, e = (json.load(open(f)) for f in sys.argv[1:3])
print("\n| CuPy, pool off (us per pair) | native | expseg | ratio |\n| --- | ---: | ---: | ---: |")
for k in n:
    print(f"| {k} | {n[k]} | {e[k]} | {e[k] / n[k]:.2f}x |")
PY
else
  echo "CuPy column skipped: cupy not installed"
fi
