#!/usr/bin/env python3
"""The trace-replay regression check: placement on recorded calls stays what it was.

    python3 scripts/replay_check.py            # replay shim-tests/traces/*.trace[.gz], compare
    python3 scripts/replay_check.py --update   # accept today's figures (say why in the commit)

Each committed trace (recorded with EXPSEG_TEST_TRACE by a library built with the cargo
feature test-switches: on the GPU from the bench's workloads, or on the fake driver from the
preload programs, the `fake_` ones) is replayed by expseg-replay under the default
configuration (no EXPSEG_* variable), and the figures that placement decides (handles made and
released, peak held, stranded and beyond bytes, moves, driver calls per kind, and the events
whose result differs from the recorded one) are compared with shim-tests/traces/expected.json.
A change that alters them fails here until --update records the new figures. Builds
expseg-replay (target/test-switches) unless --replay names one."""
import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
TRACES = os.path.join(ROOT, "shim-tests", "traces")
EXPECTED = os.path.join(TRACES, "expected.json")
KEYS = ("events", "skipped", "mismatches", "va_conflicts", "peak_stranded_bytes", "peak_held_bytes",
        "peak_beyond_bytes", "final_stranded_bytes", "final_held_bytes", "compactions", "held_moves",
        "moves_declined", "handles_created", "handles_released", "calls")


def replay_binary(given):
    if given:
        return given
    target = os.path.join(ROOT, "target", "test-switches")
    subprocess.run(["cargo", "build", "--quiet", "--features", "test-switches", "--bin", "expseg-replay",
                    "--target-dir", target], cwd=ROOT, check=True)
    return os.path.join(target, "debug", "expseg-replay")


def figures(binary, path, tmp):
    if path.endswith(".gz"):
        plain = os.path.join(tmp, os.path.basename(path)[:-3])
        with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
            dst.write(src.read())
        path = plain
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPSEG_") and k != "REPLAY_MEM_GIB"}
    out = subprocess.run([binary, path], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"expseg-replay {path}: exit {out.returncode}: {out.stderr.strip()[-500:]}")
    last = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: last.get(k) for k in KEYS}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--update", action="store_true")
    ap.add_argument("--replay", help="an expseg-replay binary (default: build one)")
    a = ap.parse_args()
    names = sorted(f for f in os.listdir(TRACES) if f.endswith((".trace", ".trace.gz")))
    if not names:
        sys.exit(f"no traces in {TRACES}")
    binary = replay_binary(a.replay)
    with tempfile.TemporaryDirectory() as tmp:
        now = {n: figures(binary, os.path.join(TRACES, n), tmp) for n in names}
    if a.update:
        with open(EXPECTED, "w") as f:
            json.dump(now, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"replay_check: {len(now)} traces recorded in {EXPECTED}")
        return
    expected = json.load(open(EXPECTED)) if os.path.exists(EXPECTED) else {}
    bad = []
    for n, fig in now.items():
        if n not in expected:
            bad.append(f"{n}: no expected figures (run with --update)")
            continue
        for k in KEYS:
            if fig.get(k) != expected[n].get(k):
                bad.append(f"{n}: {k} {expected[n].get(k)} -> {fig.get(k)}")
    for n in expected:
        if n not in now:
            bad.append(f"{n}: expected, but the trace is gone")
    for b in bad:
        print(b)
    print(f"replay_check: {len(now)} traces, {len(bad)} differences")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
