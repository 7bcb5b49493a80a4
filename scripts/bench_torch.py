#!/usr/bin/env python3
"""PyTorch under expseg, side by side with PyTorch's own allocator settings.

    python3 scripts/bench_torch.py [--lib path/to/libexpseg.so] [--out DIR] [--workloads ...]

Each workload runs in a fresh process per mode, under a fixed memory budget made real by a
filler process that holds the rest of the card:
  frag   step-2 fragmentation: a transient buffer of 55 % of the budget, then 40 medium buffers
         of 0.4-2 %, every fourth kept into the next step (the seed's OOM at step 2);
  moe    MoE-like: per-step activation sizes that follow random expert loads;
  churn  ~48 GiB per step in 0.05-0.6 GiB tensors, a third touched, all freed, and
         torch.cuda.empty_cache() every step (frameworks handing memory to a colocated engine);
  train  a small GPT-like model, a few hundred steps: step time and losses;
  train_ec the same model with varying shapes and torch.cuda.empty_cache() every step.
Modes: default, expandable (expandable_segments:True), expandable_256 (the same with
large_segment_size_mb:256), max_split (max_split_size_mb:64, not run unless asked), expseg
(scripts/expseg-run, the launch path), expseg-preload (LD_PRELOAD alone, which applies
expandable_segments:True itself when nothing is set) and expseg-release0 (the same with
EXPSEG_RELEASE_DELAY=0: released pages go back to the driver at once, no reuse); not run unless
asked: expseg-keep200 (EXPSEG_RELEASE_DELAY=200: released handles kept through 200 ms of quiet). Under expseg PyTorch's pages are
coalesced. Prints a table (completed steps or OOM, peak device memory, peak reserved, median
step time, ratios to expandable_segments and default), writes results.json and memory.png to
DIR, and with --json a summary (device, driver, date, commit; per workload and mode: steps,
median ms, peak reserved and device GiB; --append adds to the file of an earlier run of the same
commit on the same device). Diagnosis: --steps N runs N steps instead of the
workload's own count, --repeat N runs every mode N times interleaved (step time: the median of
the runs' medians, each kept), --alt-lib PATH runs a second build as mode expseg-alt (LD_PRELOAD
alone), --reports DIR keeps the expseg modes' exit reports, --cpus LIST
pins every worker to those CPUs. Steps of a few ms (moe) are launch-bound and vary by up to 40 %
between processes and over time within one, pinned or not (H100, 2026-11-23: the machine has a
fast and a slow state, whatever the allocator; scripts/vmm-cost/torch_bookkeeping.py): compare
them with --steps 300 --repeat 5 or more.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GIB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = {  # name: (budget GiB, steps)
    "frag": (24, 5),
    "moe": (24, 30),
    "churn": (56, 20),
    "train": (24, 300),
    "train_ec": (24, 120),
}
ALT_LIB = [None]  # --alt-lib: a second library, as mode expseg-alt (LD_PRELOAD alone)
MODES = ["default", "expandable", "expandable_256", "expseg", "expseg-preload", "expseg-release0"]


def mode_env(mode, lib):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPSEG_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))}
    env.pop("LD_PRELOAD", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    cmd = []
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif mode == "expandable_256":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True,large_segment_size_mb:256"
    elif mode == "max_split":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:64"
    elif mode == "expseg-preload":
        env["LD_PRELOAD"] = lib
    elif mode == "expseg-keep200":
        env["LD_PRELOAD"] = lib
        env["EXPSEG_RELEASE_DELAY"] = "200"
    elif mode == "expseg-alt":
        env["LD_PRELOAD"] = ALT_LIB[0]
    elif mode == "expseg-release0":
        env["LD_PRELOAD"] = lib
        env["EXPSEG_RELEASE_DELAY"] = "0"
    elif mode == "expseg":
        env["EXPSEG_LIB"] = lib
        env["EXPSEG_REPORT"] = "none"
        cmd = [os.path.join(HERE, "expseg-run")]
    return env, cmd


# ---------------------------------------------------------------- the worker side


def device_used():
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("BENCH_NVML_INDEX", "0")))
    return pynvml.nvmlDeviceGetMemoryInfo(h).used


def cpu_list(text):
    """ "4-7,9" -> {4, 5, 6, 7, 9}"""
    out = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def worker(name):
    if os.environ.get("BENCH_CPUS"):
        os.sched_setaffinity(0, cpu_list(os.environ["BENCH_CPUS"]))
    import pynvml
    import random

    import torch

    pynvml.nvmlInit()
    budget, steps = WORKLOADS[name]
    steps = int(os.environ.get("BENCH_STEPS") or steps)
    B = budget * GIB
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    base_used = device_used()
    rng = random.Random(1234)
    u8 = torch.uint8
    res = {"steps": 0, "oom": None, "step_ms": [], "mem": [], "losses": []}
    state = {}
    if name in ("train", "train_ec"):
        torch.manual_seed(0)
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        sys.path.insert(0, os.path.join(HERE, "..", "shim-tests"))
        from gpt import gpt

        vocab = 8192
        model = gpt(dim=512, layers=6, vocab=vocab, heads=8, positions=2048)
        model = model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        gen = torch.Generator().manual_seed(1)

    def step(i):
        if name == "frag":
            big = torch.empty(int(0.55 * B), dtype=u8, device="cuda")
            big[:: 1 << 20].fill_(1)
            del big
            keep = []
            for j in range(40):
                t = torch.empty(int(rng.uniform(0.004, 0.02) * B), dtype=u8, device="cuda")
                t[:: 1 << 20].fill_(2)
                if j % 4 == 0:
                    keep.append(t)
            state["keep"] = keep  # the previous step's keepers go now
        elif name == "moe":
            experts = 32
            loads = [rng.random() ** 3 for _ in range(experts)]
            total = sum(loads)
            acts = []
            for layer in range(4):
                for e in range(experts):
                    n = int(0.5 * B / 4 * loads[e] / total) // 2 * 2 + 4096
                    a = torch.empty(n, dtype=u8, device="cuda")
                    a[:: 1 << 20].fill_(3)
                    acts.append(a)
                if layer % 2 == 1:
                    acts = acts[len(acts) // 2 :]  # half the activations live on
            state["kept"] = acts[: experts // 4]
        elif name == "churn":
            ts, total = [], 0
            while total < 48 * GIB:
                n = int(rng.uniform(0.05, 0.6) * GIB)
                t = torch.empty(n, dtype=u8, device="cuda")
                if len(ts) % 3 == 0:
                    t.fill_(4)
                ts.append(t)
                total += n
            del ts
            torch.cuda.empty_cache()
        elif name in ("train", "train_ec"):
            batch, seq = 16 + 8 * (i % 3), 256 + 128 * (i % 4)
            data = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to("cuda")
            logits = model(data[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            res["losses"].append(loss.item())
            if name == "train_ec":
                torch.cuda.empty_cache()

    # The device memory of the process, sampled every 2 ms by a thread: the true peak, not
    # just the step ends.
    import threading

    peak = {"v": 0, "run": True}

    def sample():
        while peak["run"]:
            peak["v"] = max(peak["v"], device_used() - base_used)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for i in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            res["step_ms"].append((time.perf_counter() - t0) * 1e3)
            res["mem"].append((device_used() - base_used, torch.cuda.memory_reserved()))
            res["steps"] = i + 1
    except torch.OutOfMemoryError as e:
        res["oom"] = str(e).split("\n")[0][:200]
    peak["run"] = False
    sampler.join()
    res["peak_device"] = max([peak["v"]] + [m[0] for m in res["mem"]])
    res["peak_reserved"] = torch.cuda.max_memory_reserved()
    res["median_step_ms"] = statistics.median(res["step_ms"][1:] or res["step_ms"] or [0])
    print("RESULT " + json.dumps(res))


def filler(gib):
    import torch

    x = torch.empty(int(gib * GIB), dtype=torch.uint8, device="cuda")
    x[:: 1 << 20].fill_(9)
    torch.cuda.synchronize()
    print("FILLED", flush=True)
    sys.stdin.read()  # hold until the orchestrator closes our stdin


# ---------------------------------------------------------------- the orchestrator


def free_now():
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return pynvml.nvmlDeviceGetMemoryInfo(h).free


def run_all(args):
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for w in args.workloads:
        budget, _ = WORKLOADS[w]
        # Hold everything but the budget (plus room for one CUDA context) in another process.
        fill = free_now() / GIB - budget - 0.75
        fp = None
        if fill > 0:
            fp = subprocess.Popen([sys.executable, __file__, "--fill", str(fill)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            fp.stdout.readline()
        # With --repeat N the modes run N times, interleaved (mode order rotated each round),
        # so that drift of the machine hits every mode alike; a mode's step time is then the
        # median of its runs' medians, and the runs' medians are kept.
        for rep in range(args.repeat):
            k = rep % len(args.modes)
            for m in args.modes[k:] + args.modes[:k]:
                env, pre = mode_env(m, args.lib)
                if args.steps:
                    env["BENCH_STEPS"] = str(args.steps)
                if args.cpus:
                    env["BENCH_CPUS"] = args.cpus
                if args.reports and m.startswith("expseg"):
                    os.makedirs(args.reports, exist_ok=True)
                    env["EXPSEG_REPORT"] = os.path.join(os.path.abspath(args.reports), f"{w}_{m}_{rep}.txt")
                t0 = time.time()
                p = subprocess.run(pre + [sys.executable, __file__, "--worker", w], env=env, capture_output=True, text=True, timeout=600)
                line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
                r = json.loads(line[-1][7:]) if line else {"steps": 0, "oom": None, "error": (p.stderr or p.stdout)[-400:]}
                r["wall_s"] = round(time.time() - t0, 1)
                prev = results.setdefault(w, {}).get(m)
                runs = (prev or {}).get("run_medians_ms", []) + [round(r.get("median_step_ms", 0), 3)]
                if prev and (prev.get("oom") or prev.get("error")):
                    r = prev  # a failed run stands for the mode
                r["run_medians_ms"] = runs
                r["median_step_ms"] = statistics.median(runs)
                r["peak_device"] = max(r.get("peak_device", 0), (prev or {}).get("peak_device", 0))
                r["peak_reserved"] = max(r.get("peak_reserved", 0), (prev or {}).get("peak_reserved", 0))
                results[w][m] = r
                # This run's figures as they come, and the results so far on disk: a run cut
                # short by a time limit keeps what it measured.
                print(
                    f"{w:6} {m:11} steps {r['steps']:4} median {runs[-1]:.2f} ms peak {r['peak_device'] / GIB:.2f} GiB"
                    f" wall {r['wall_s']} s {'OOM' if r.get('oom') else ''} {r.get('error', '')[:200]}",
                    flush=True,
                )
                json.dump(results, open(os.path.join(args.out, "results.json"), "w"))
        if fp:
            fp.stdin.close()
            fp.wait()
    table(results)
    plot(results, os.path.join(args.out, "memory.png"))
    if args.json:
        summary(results, args)


def summary(results, args):
    import datetime

    import pynvml
    import torch

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    def text(x):
        return x.decode() if isinstance(x, bytes) else x

    out = {
        "device": text(pynvml.nvmlDeviceGetName(h)),
        "driver": text(pynvml.nvmlSystemGetDriverVersion()),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "command": " ".join(sys.argv[1:]),
        "workloads": {},
    }
    if args.append and os.path.exists(args.json):
        prev = json.load(open(args.json))
        if (prev.get("device"), prev.get("commit")) == (out["device"], out["commit"]):
            out["workloads"] = prev.get("workloads", {})
            out["command"] = prev.get("command", "") + "; then " + " ".join(sys.argv[1:])
    for w, modes in results.items():
        out["workloads"][w] = {
            m: {
                "steps": r.get("steps", 0),
                "of": WORKLOADS[w][1],
                "oom": bool(r.get("oom")),
                "error": bool(r.get("error")),
                "median_ms": round(r.get("median_step_ms", 0), 2),
                "run_medians_ms": r.get("run_medians_ms", []),
                "peak_reserved_gib": round(r.get("peak_reserved", 0) / GIB, 3),
                "peak_device_gib": round(r.get("peak_device", 0) / GIB, 3),
            }
            for m, r in modes.items()
        }
        d = results[w].get("default", {}).get("losses")
        if d:
            for m, r in modes.items():
                if r.get("losses"):
                    out["workloads"][w][m]["losses_identical_to_default"] = r["losses"] == d
    json.dump(out, open(args.json, "w"), indent=1)


def table(results):
    print("\n| workload | mode | steps | peak device GiB | peak reserved GiB | median step ms | device vs expandable | step vs expandable | step vs default |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for w, modes in results.items():
        ref, dflt = modes.get("expandable", {}), modes.get("default", {})
        for m, r in modes.items():
            steps = f"{r['steps']}/{WORKLOADS[w][1]}" + (" OOM" if r.get("oom") else "") + (" error" if r.get("error") else "")
            pd, pr, st = r.get("peak_device", 0) / GIB, r.get("peak_reserved", 0) / GIB, r.get("median_step_ms", 0)

            def ratio(a, b):
                return f"{a / b:.3f}" if a and b else "-"

            print(
                f"| {w} | {m} | {steps} | {pd:.2f} | {pr:.2f} | {st:.1f} | {ratio(r.get('peak_device', 0), ref.get('peak_device', 0))}"
                f" | {ratio(st, ref.get('median_step_ms', 0))} | {ratio(st, dflt.get('median_step_ms', 0))} |"
            )
    for w in ("train", "train_ec"):
        d = results.get(w, {}).get("default", {}).get("losses")
        for m, r in results.get(w, {}).items():
            if d and r.get("losses"):
                print(f"{w} losses, {m} vs default: {'identical' if r['losses'] == d else 'DIFFERENT'} ({len(r['losses'])} steps)")


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (w, modes) in zip(axes[0], results.items()):
        for m, r in modes.items():
            ax.plot([x[0] / GIB for x in r.get("mem", [])], label=m + (" (OOM)" if r.get("oom") else ""))
        ax.set_title(f"{w}: device memory of the process")
        ax.set_xlabel("step")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.path.join(HERE, "..", "target", "release", "libexpseg.so"))
    ap.add_argument("--out", default="bench-torch-out")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--modes", nargs="*", default=MODES)
    ap.add_argument("--json", help="also write a summary with device, driver, date and commit")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--append", action="store_true", help="add this run's workloads to the --json file when it is of the same device and commit")
    ap.add_argument("--steps", type=int, help="steps per workload instead of the default (diagnosis)")
    ap.add_argument("--reports", help="keep the expseg modes' exit reports in this folder")
    ap.add_argument("--repeat", type=int, default=1, help="run every mode this many times, interleaved")
    ap.add_argument("--cpus", help="pin every worker to these CPUs (e.g. 4-7)")
    ap.add_argument("--alt-lib", help="another libexpseg.so, run as mode expseg-alt (LD_PRELOAD alone): two builds side by side")
    ap.add_argument("--worker")
    ap.add_argument("--fill", type=float)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
    elif args.fill is not None:
        filler(args.fill)
    else:
        args.lib = os.path.abspath(args.lib)
        if args.alt_lib:
            ALT_LIB[0] = os.path.abspath(args.alt_lib)
        if args.steps:
            for w in WORKLOADS:
                WORKLOADS[w] = (WORKLOADS[w][0], args.steps)
        run_all(args)


if __name__ == "__main__":
    main()
