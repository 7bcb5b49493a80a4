#!/usr/bin/env python3
"""How much of a MoE step is PyTorch's own allocator bookkeeping, per allocator setting.

    python3 scripts/vmm-cost/torch_bookkeeping.py [--lib path/to/libexpseg.so] [--steps 300]

Runs scripts/bench_torch.py's MoE allocation pattern (4 layers x 32 experts of random size,
half of them kept into the next layer, 128 torch.empty a step) in a fresh process per mode:
  alloc  the pattern alone: torch.empty and del, no kernel, so the step is allocator CPU time;
  fill   the same tensors each written once (one strided fill kernel each) but allocated
         before the timed step: launch cost without the allocator;
  moe    the bench's step (allocate, fill, free).
Each variant runs 50 warm-up steps, then --steps timed ones; prints the median step time and,
for "alloc", the time per torch.empty/free pair. The modes: default, expandable
(expandable_segments:True), expseg-preload (LD_PRELOAD alone, which puts PyTorch on expandable
segments and serves its pages with coalesced handles). In the steady state expseg makes no
driver call at all (its report), so "alloc" of expseg-preload minus default is the part of the
step that belongs to PyTorch's expandable-segment bookkeeping, not to the handle layer.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

GIB = 1 << 30


def worker(steps):
    if os.environ.get("BENCH_CPUS"):
        cpus = set()
        for part in os.environ["BENCH_CPUS"].split(","):
            a, _, b = part.partition("-")
            cpus.update(range(int(a), int(b or a) + 1))
        os.sched_setaffinity(0, cpus)
    import torch

    torch.zeros(1, device="cuda")
    B = 24 * GIB
    u8 = torch.uint8

    def sizes(rng):
        loads = [rng.random() ** 3 for _ in range(32)]
        total = sum(loads)
        return [int(0.5 * B / 4 * loads[e] / total) // 2 * 2 + 4096 for e in range(32)]

    def step(rng, fill, pre=None):
        acts = []
        for layer in range(4):
            for n in sizes(rng):
                a = pre.pop() if pre is not None else torch.empty(n, dtype=u8, device="cuda")
                if fill:
                    a[:: 1 << 20].fill_(3)
                acts.append(a)
            if layer % 2 == 1:
                acts = acts[len(acts) // 2 :]
        return acts[:8]

    out = {}
    for variant in ("alloc", "fill", "moe"):
        rng = random.Random(1234)
        kept = None
        times = []
        for i in range(50 + steps):
            pre = None
            if variant == "fill":
                pre = [torch.empty(n, dtype=u8, device="cuda") for n in sizes(random.Random(i)) * 4]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            kept = step(rng, variant != "alloc", pre)
            torch.cuda.synchronize()
            if i >= 50:
                times.append((time.perf_counter() - t0) * 1e3)
            del pre
        del kept
        out[variant] = statistics.median(times)
    out["reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    print("RESULT " + json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--lib", default=os.path.join(here, "..", "..", "target", "release", "libexpseg.so"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpus", help="pin every worker to these CPUs, e.g. 4-7")
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        worker(a.steps)
        return
    modes = ["default", "expandable", "expseg-preload"]
    res = {m: [] for m in modes}
    for rep in range(a.repeat):
        for m in modes[rep % 3 :] + modes[: rep % 3]:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPSEG_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))}
            env.pop("LD_PRELOAD", None)
            if a.cpus:
                env["BENCH_CPUS"] = a.cpus
            if m == "expandable":
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            elif m == "expseg-preload":
                env["LD_PRELOAD"] = os.path.abspath(a.lib)
            p = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(a.steps)], env=env, capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                print(f"{m}: failed: {p.stderr[-400:]}")
                continue
            res[m].append(json.loads(line[-1][7:]))
    print("median of %d runs' medians, ms per step (%d timed steps each):" % (a.repeat, a.steps))
    print("| mode | alloc (CPU only) | per empty+free pair, us | fill (launch only) | moe step | moe vs default | reserved GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = None
    for m in modes:
        if not res[m]:
            continue
        med = {k: statistics.median(r[k] for r in res[m]) for k in ("alloc", "fill", "moe", "reserved_gib")}
        base = base or med["moe"]
        print(f"| {m} | {med['alloc']:.3f} | {med['alloc'] * 1e3 / 128:.2f} | {med['fill']:.3f} | {med['moe']:.3f} | {med['moe'] / base:.3f} | {med['reserved_gib']:.2f} |")
    print("runs: " + json.dumps(res))


if __name__ == "__main__":
    main()
