#!/usr/bin/env python3
"""The README's performance table, written from shim-tests/bench-torch.json.

    python3 scripts/readme_table.py                 # print the table
    python3 scripts/readme_table.py --check README.md   # fail if the README's differs
    python3 scripts/readme_table.py --write README.md   # put it in the README
    python3 scripts/readme_table.py --self-test

Each row is one workload, from the runs of one library build: the newest build (runs are
newest last) with rounds of the default allocator and expseg (`expseg-preload`, `expseg`), on
one device; every call (run) of that build and device counts. A round's ratio is expseg's
median step over the default allocator's in the same round (modes alternate within a call);
the row says the mean and a 95 % interval (Student's t). Where rounds come from several
calls, the call is the unit (one mean a call; rounds of one call are not independent of each
other across machines and hours); from one call, the rounds are. Expandable segments' ratio
comes from the same runs where they have it, else from the newest runs of the same device
that have it (marked *). The table sits in the README between the markers BEGIN and END
below; its last column names the date and rounds (--builds: the build too; the README names
no commits)."""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "shim-tests", "bench-torch.json")
BEGIN = "<!-- performance table: scripts/readme_table.py writes it from shim-tests/bench-torch.json -->"
END = "<!-- end of performance table -->"
EXPSEG = ("expseg-preload", "expseg")
# Whether rows name their build (--builds; the README names no commits: tests/readme.rs).
BUILDS = [False]
# README row, workload: in the README's order.
ROWS = [
    ("GPT-2 (124M), `empty_cache()` every step", "gpt2_ec"),
    ("small GPT, varying shapes, `empty_cache()` every step", "train_ec"),
    ("the same, prefetching on a side stream", "prefetch"),
    ("colocated RL loop", "rl"),
    ("DeepSpeed ZeRO-3, `empty_cache()` every step", "deepspeed_ec"),
    ("DeepSpeed ZeRO-3", "deepspeed"),
    ("FSDP2, `empty_cache()` every step", "fsdp2_ec"),
    ("FSDP2", "fsdp2"),
    ("DDP, `empty_cache()` every step", "ddp_ec"),
    ("weight sync, 8 GiB, 246 tensors", "refit"),
    ("fragmentation, 24 GiB budget", "frag"),
]
# Two-sided 95 % quantiles of Student's t, by degrees of freedom.
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
       2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
       2.052, 2.048, 2.045, 2.042]


def interval(xs):
    """Mean and 95 % interval of xs (None for the interval with fewer than two)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, None
    h = T95[min(len(xs) - 1, len(T95)) - 1] * statistics.stdev(xs) / len(xs) ** 0.5
    return m, (m - h, m + h)


def build(run):
    """The build of expseg-preload in a run: the first word of its commit ("a vs b": a)."""
    return run.get("commit", "?").split()[0]


def rounds_of(mode):
    return [x for x in mode.get("run_medians_ms") or [] if x]


def ratios(runs, w, mode):
    """Per call, the rounds' ratios of `mode` over the default allocator in `w`."""
    out = []
    for r in runs:
        ms = r["workloads"][w]
        if mode not in ms or "default" not in ms:
            continue
        a, d = rounds_of(ms[mode]), rounds_of(ms["default"])
        per = [x / y for x, y in zip(a, d)]
        if per:
            out.append(per)
    return out


def summary(calls):
    """(mean, interval, rounds, calls): the call as the unit where there are several."""
    n = sum(len(c) for c in calls)
    if len(calls) > 1:
        m, ci = interval([statistics.fmean(c) for c in calls])
    else:
        m, ci = interval(calls[0])
    return m, ci, n, len(calls)


def fmt_ratio(m, ci):
    return f"{m:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def peak(runs, w, mode):
    ps = [r["workloads"][w][mode].get("peak_device_gib") for r in runs if mode in r["workloads"][w]]
    ps = [p for p in ps if p]
    return f", {max(ps):.2f} GiB" if ps else ""


def pick(data, w):
    """The runs of `w` of its newest build and device with the default allocator and expseg."""
    found = [r for r in data["runs"] if w in r["workloads"] and "default" in r["workloads"][w]
             and any(m in r["workloads"][w] and rounds_of(r["workloads"][w][m]) for m in EXPSEG)]
    if not found:
        return None, []
    last = found[-1]
    same = [r for r in found if build(r) == build(last) and r["device"] == last["device"]]
    mode = next(m for m in EXPSEG if m in last["workloads"][w])
    return mode, same


def expandable(data, runs, w, n):
    """Expandable segments' ratio: from the row's runs, else from the newest runs of the same
    device that have it (the library plays no part in it), with their build and date said."""
    own = ratios(runs, w, "expandable")
    src = runs
    if not own:
        dev = runs[-1]["device"]
        src = [r for r in data["runs"] if w in r["workloads"] and r["device"] == dev and ratios([r], w, "expandable")]
        if not src:
            return "-"
        src = [r for r in src if build(r) == build(src[-1])]
        own = ratios(src, w, "expandable")
    m, ci, xn, _ = summary(own)
    if src is not runs:
        return f"{fmt_ratio(m, ci)}*"
    return fmt_ratio(m, ci) + (f" ({xn} round{'s' if xn != 1 else ''})" if xn != n else "")


def row(data, label, w):
    mode, runs = pick(data, w)
    if not runs:
        return f"| {label} | - | - | - | no run in bench-torch.json |"
    last = runs[-1]
    where = (f"{build(last)}, " if BUILDS[0] else "") + last["date"]
    if w == "frag":
        def steps(m, among):
            e = [r["workloads"][w][m] for r in among if m in r["workloads"][w]]
            if not e:
                return None
            e = e[-1]
            return f"OOM at step {e['steps'] + 1}" if e.get("oom") else f"{e['steps']}/{e['of']} steps"
        dev = last["device"]
        others = [r for r in data["runs"] if w in r["workloads"] and r["device"] == dev]
        exp = steps("expandable", runs) or (steps("expandable", others) or "-") + "*"
        return f"| {label} | {steps('default', runs)} | {exp} | **{steps(mode, runs)}** | {where} |"
    e_m, e_ci, n, calls = summary(ratios(runs, w, mode))
    default = statistics.median(x for r in runs for x in rounds_of(r["workloads"][w]["default"]))
    exp = expandable(data, runs, w, n)
    unit = f"{n} round{'s' if n != 1 else ''}" + (f" in {calls} calls" if calls > 1 else "")
    bold = "**" if e_ci and e_ci[1] < 1.0 else ""
    return (f"| {label} | {default:.1f} ms{peak(runs, w, 'default')} | {exp} | "
            f"{bold}{fmt_ratio(e_m, e_ci)}{bold}{peak(runs, w, mode)} | {where}, {unit} |")


def table(data):
    lines = [
        "| workload | default allocator | `expandable_segments:True` | expseg | " + ("build, " if BUILDS[0] else "") + "date, rounds |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [row(data, label, w) for label, w in ROWS]
    lines.append("")
    lines.append("\\* from the newest runs with expandable segments.")
    return "\n".join(lines)


def self_test():
    m, ci = interval([1.0, 1.2])
    assert abs(m - 1.1) < 1e-12 and abs(ci[1] - (1.1 + 12.706 * 0.1414213562 / 1.4142135623)) < 1e-6
    assert interval([0.9])[1] is None
    # Two calls: the call is the unit (two means), not the six rounds.
    m, ci, n, calls = summary([[1.0, 1.0, 1.0], [0.8, 0.8, 0.8]])
    assert (n, calls) == (6, 2) and abs(m - 0.9) < 1e-12 and ci[0] < 0 < ci[1] - 1.5
    run = lambda c, d, e: {"commit": c, "device": "NVIDIA H200", "date": "2026-11-29",
                           "workloads": {"w": {"default": {"run_medians_ms": d}, "expseg-preload": {"run_medians_ms": e}}}}
    data = {"runs": [run("old", [10, 10], [20, 20]), run("new vs old", [10, 10], [9, 9]), run("new", [10, 10], [8, 8])]}
    mode, runs = pick(data, "w")
    assert mode == "expseg-preload" and [build(r) for r in runs] == ["new", "new"], runs
    assert "0.85x [" in row(data, "w", "w") and "| 2026-11-29, 4 rounds in 2 calls |" in row(data, "w", "w")
    BUILDS[0] = True
    assert "| new, 2026-11-29, 4 rounds in 2 calls |" in row(data, "w", "w")
    BUILDS[0] = False
    print("readme_table self-test: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", metavar="README")
    ap.add_argument("--write", metavar="README")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--bench", default=BENCH)
    ap.add_argument("--builds", action="store_true", help="name each row's library build (not in the README)")
    a = ap.parse_args()
    BUILDS[0] = a.builds
    if a.self_test:
        return self_test()
    t = table(json.load(open(a.bench)))
    path = a.check or a.write
    if not path:
        print(t)
        return
    text = open(path).read()
    if BEGIN not in text or END not in text:
        sys.exit(f"{path}: no performance table markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{t}\n{END}{tail}"
    if a.write:
        open(path, "w").write(new)
    elif new != text:
        sys.exit(f"{path}: its performance table differs from what scripts/readme_table.py writes from bench-torch.json (run it with --write)")


if __name__ == "__main__":
    main()
