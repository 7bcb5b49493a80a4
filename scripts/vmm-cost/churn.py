"""Churn loop for scripts/vmm-cost.sh: ~48 GiB per step in 0.05-0.6 GiB tensors, a third
touched, all freed, torch.cuda.empty_cache() every step; prints the median step time."""
import random, time, statistics, torch, sys
GIB = 1 << 30
rng = random.Random(1234)
torch.zeros(1, device="cuda")
times = []
for i in range(12):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    ts, total = [], 0
    while total < 48 * GIB:
        n = int(rng.uniform(0.05, 0.6) * GIB)
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        if len(ts) % 3 == 0: t.fill_(4)
        ts.append(t); total += n
    del ts
    torch.cuda.empty_cache()
    torch.cuda.synchronize(); times.append((time.perf_counter() - t0) * 1e3)
print(sys.argv[1], "median step ms %.1f" % statistics.median(times[2:]), flush=True)
