"""Join bench_alloc outputs of several configurations (files named CONFIG.txt) and print a
markdown table of median pair times and ratios against native cudaMalloc from the same run.
Usage: python3 bench_report.py DIR"""
import os
import sys

d = sys.argv[1]
runs = {}
for f in sorted(os.listdir(d)):
    if f.endswith(".txt") and f.startswith("bench_"):
        name = f[len("bench_"):-4]
        rows = {}
        for line in open(os.path.join(d, f)):
            p = line.split()
            if p and p[0] == "repeat":
                rows[int(p[1])] = float(p[2])
            elif p and p[0] == "mixed":
                rows["mixed"] = float(p[2]) / int(p[1])
        runs[name] = rows
native = runs.pop("native")
order = [c for c in ("expseg_default", "expseg_cache0", "expseg_cache64G") if c in runs]


def size(b):
    return f"{b >> 30} GiB" if b >= 1 << 30 else f"{b >> 20} MiB"


print("| alloc+free pair | native µs | " + " | ".join(f"{c} µs (speed-up)" for c in order) + " |")
print("|---|---:|" + "---:|" * len(order))
for k in list(native):
    label = "mixed sizes, per op" if k == "mixed" else size(k)
    cells = []
    for c in order:
        v = runs[c].get(k)
        cells.append(f"{v:.1f} ({native[k] / v:.1f}×)" if v else "-")
    print(f"| {label} | {native[k]:.1f} | " + " | ".join(cells) + " |")
