"""Print bench_alloc results (files bench_CONFIG.txt in DIR) as a markdown table: for each
configuration expseg's time and its speed-up over native cudaMalloc/cudaFree measured in the
same process, alternately. Usage: python3 bench_report.py DIR"""
import os
import sys

d = sys.argv[1]
order = ["cache1G", "cache0", "cache64G", "cache0_chunk2G", "default"]
runs = {}
for f in os.listdir(d):
    if f.startswith("bench_") and f.endswith(".txt"):
        rows = {}
        for line in open(os.path.join(d, f)):
            p = line.split()
            if len(p) == 4 and p[0] in ("repeat", "newsize", "mixed"):
                rows[(p[0], int(p[1]))] = (float(p[2]), float(p[3]))
        runs[f[len("bench_"):-4]] = rows
configs = [c for c in order if c in runs] + sorted(c for c in runs if c not in order)


def label(kind, n):
    if kind == "mixed":
        return "mixed sizes (per op)"
    size = f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"
    return f"{size} repeated" if kind == "repeat" else f"new size near {size}"


keys = []
for c in configs:
    keys += [k for k in runs[c] if k not in keys]
print("| alloc+free pair | " + " | ".join(f"{c}: native µs / expseg µs (speed-up)" for c in configs) + " |")
print("|---|" + "---:|" * len(configs))
for k in keys:
    cells = []
    for c in configs:
        v = runs[c].get(k)
        cells.append(f"{v[0]:.1f} / {v[1]:.1f} ({v[0] / v[1]:.2f}×)" if v else "-")
    print(f"| {label(*k)} | " + " | ".join(cells) + " |")
