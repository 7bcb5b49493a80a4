"""Checks the PROBE lines (probe.py) that a launcher's processes printed, for
scripts/test-launchers.sh. Prints what is wrong (nothing when all is right); exit 1 if anything.
    verify.py OUTPUT_FILE --n N --lib LIB [--ranks] [--report TEMPLATE] [--files] [--torch] [--torch-job]
--n: how many processes; --ranks: their ranks are 0..N-1 (and local ranks set); --lib: the
library every process must have in LD_PRELOAD and loaded (/proc/self/maps), and its fake cudaMalloc
must succeed; --report: each process's EXPSEG_REPORT, with {rank}, {local} and {reportdir}
filled in per process; --files: the exit report (TEMPLATE with %r, %p expanded, and .json) was
written; --torch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as expseg-run sets it.
--torch-job: the processes ran probe.py's PyTorch job (PROBE_TORCH=1) instead of the fake
runtime: with --ranks and N > 1 their all_reduce (NCCL or gloo) summed 1..N, else each made its
tensor alone; a process on a GPU made its tensor there (cuda=0) and its exit report is checked
(--files), one on the CPU wrote none (nothing of CUDA was called) and is not asked for one."""
import argparse
import os
import re
import sys

a = argparse.ArgumentParser()
a.add_argument("output")
a.add_argument("--n", type=int, required=True)
a.add_argument("--lib", required=True)
a.add_argument("--ranks", action="store_true")
a.add_argument("--report")
a.add_argument("--files", action="store_true")
a.add_argument("--torch", action="store_true")
a.add_argument("--torch-job", action="store_true")
o = a.parse_args()
lib = os.path.realpath(o.lib)
probes = []
# Split at each "PROBE " too: a line another process wrote into the middle of ours stays whole.
for chunk in re.split(r"(?=PROBE rank=)", open(o.output, errors="replace").read()):
    if chunk.startswith("PROBE rank="):
        probes.append(dict(kv.split("=", 1) for kv in chunk.splitlines()[0].split()[1:] if "=" in kv))
errors = []
if len(probes) != o.n:
    errors.append(f"{len(probes)} processes reported, want {o.n}")
if o.ranks and sorted(p["rank"] for p in probes) != [str(i) for i in range(o.n)]:
    errors.append(f"ranks {sorted(p['rank'] for p in probes)}, want 0..{o.n - 1}")
for p in probes:
    who = f"rank {p['rank']} (pid {p['pid']})"
    preload = p["preload"].replace(" ", ":").split(":")
    if not any(e and os.path.exists(e) and os.path.realpath(e) == lib for e in preload):
        errors.append(f"{who}: LD_PRELOAD={p['preload']} lacks {lib}")
    if p["mapped"] == "-" or os.path.realpath(p["mapped"]) != lib:
        errors.append(f"{who}: {lib} not loaded (maps: {p['mapped']})")
    job = p.get("torch", "-")
    if o.torch_job:
        backend, _, rest = job.partition(":")
        total, _, dev = rest.partition("/")
        want = (float(o.n * (o.n + 1) // 2), ("nccl", "gloo")) if o.ranks and o.n > 1 else (None, ("world",))
        try:
            ok = backend in want[1] and (want[0] is None or float(total) == want[0]) and dev
        except ValueError:
            ok = False
        if not ok:
            what = f"all_reduce over {o.n} ranks giving {want[0]}" if want[0] else "its tensor alone"
            errors.append(f"{who}: PyTorch job torch={job}, want {what}")
        if p["cuda"] != ("0" if dev.startswith("cuda") else "-"):
            errors.append(f"{who}: PyTorch job on {dev} with cuda={p['cuda']}")
    elif p["cuda"] != "0":
        errors.append(f"{who}: cudaMalloc on the fake runtime returned {p['cuda']}")
    if o.torch and p["alloc"] != "expandable_segments:True":
        errors.append(f"{who}: PYTORCH_CUDA_ALLOC_CONF={p['alloc']}")
    if o.report:
        want = o.report.replace("{rank}", p["rank"]).replace("{local}", p["local"]).replace("{reportdir}", p["reportdir"])
        if p["report"] != want:
            errors.append(f"{who}: EXPSEG_REPORT={p['report']}, want {want}")
        elif o.files and p["cuda"] == "0":
            rank = p["rank"] if p["rank"] != "-" else "0"
            path = want.replace("%r", rank).replace("%p", p["pid"])
            for f in (path, path + ".json"):
                if not os.path.isfile(f):
                    errors.append(f"{who}: no exit report {f}")
print("; ".join(errors))
sys.exit(1 if errors else 0)
