#!/usr/bin/env python3
"""Add one call's results (bench_torch.py --json FILE) to shim-tests/bench-torch.json, newest
last, with what makes it rerunnable and citable: the library build (--commit, where the call
wrote "unknown"), a label, and the call's device, driver, torch, date and command (kept from
the file; a run without them is refused). --rename OLD=NEW renames a mode in this run (a mode
run with settings the README's rows must not take for the defaults).

    python3 scripts/bench_add.py FILE --label "..." [--commit C] [--rename OLD=NEW ...]"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "shim-tests", "bench-torch.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--label", required=True)
    ap.add_argument("--commit")
    ap.add_argument("--rename", nargs="*", default=[])
    ap.add_argument("--bench", default=BENCH)
    a = ap.parse_args()
    run = json.load(open(a.file))
    if a.commit:
        run["commit"] = a.commit
    missing = [k for k in ("device", "driver", "torch", "date", "commit", "command", "workloads") if not run.get(k) or run.get(k) == "unknown"]
    if missing:
        sys.exit(f"{a.file}: no {', '.join(missing)} (give the library's commit with --commit)")
    for pair in a.rename:
        old, new = pair.split("=", 1)
        for modes in run["workloads"].values():
            if old in modes:
                modes[new] = modes.pop(old)
    run["label"] = a.label
    data = json.load(open(a.bench))
    data["runs"].append(run)
    with open(a.bench, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
