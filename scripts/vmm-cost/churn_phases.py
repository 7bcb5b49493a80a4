"""Where a churn step's time goes (scripts/bench_torch.py's churn: ~48 GiB per step in
0.05-0.6 GiB tensors, a third filled, all freed, empty_cache every step), by phase:
allocation (torch.empty, cudaMalloc or VMM pages), fill, free (del), empty_cache. Median ms of
steps 3-12. Usage: python3 churn_phases.py LABEL"""
import random, statistics, sys, time
import torch
GIB = 1 << 30
rng = random.Random(1234)
torch.zeros(1, device="cuda")
ph = {"alloc": [], "fill": [], "free": [], "empty_cache": [], "step": []}
def now():
    torch.cuda.synchronize()
    return time.perf_counter()
for i in range(12):
    t0 = now()
    ts, total, ta, tf = [], 0, 0.0, 0.0
    while total < 48 * GIB:
        n = int(rng.uniform(0.05, 0.6) * GIB)
        a = now(); t = torch.empty(n, dtype=torch.uint8, device="cuda"); b = now()
        if len(ts) % 3 == 0: t.fill_(4)
        c = now(); ta += b - a; tf += c - b
        ts.append(t); total += n
    t1 = now(); del ts; t2 = now()
    torch.cuda.empty_cache(); t3 = now()
    if i >= 2:
        for k, v in (("alloc", ta), ("fill", tf), ("free", t2 - t1), ("empty_cache", t3 - t2), ("step", t3 - t0)):
            ph[k].append(v * 1e3)
print(sys.argv[1], " ".join(f"{k} {statistics.median(v):.1f}" for k, v in ph.items()), flush=True)
