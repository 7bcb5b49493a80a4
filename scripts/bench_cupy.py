"""CuPy allocation churn with its memory pool off (every array a cudaMalloc/cudaFree of the
static runtime), for scripts/bench-alloc.sh's CuPy column: run once natively and once under
expseg, each prints one JSON line of median microseconds per allocate+free pair per size.

    python3 scripts/bench_cupy.py [PAIRS]"""
import json
import statistics
import sys
import time

try:
    import cupy as cp
except ImportError:
    print(json.dumps({"skip": "cupy not installed"}))
    sys.exit(0)

cp.cuda.set_allocator(None)
pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 200
res = {}
for mib in [2, 8, 32, 128, 512]:
    n = mib << 20
    times = []
    for i in range(pairs):
        t0 = time.perf_counter()
        a = cp.empty(n, dtype=cp.uint8)
        del a
        times.append(time.perf_counter() - t0)
    res[f"{mib}MiB"] = round(statistics.median(times[pairs // 10:]) * 1e6, 1)
print(json.dumps(res))
