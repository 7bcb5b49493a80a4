#!/usr/bin/env python3
"""Replay recorded coalescer traces under several placement policies, side by side.

    cargo build --release --features test-switches --bin expseg-replay
    python3 scripts/replay_policies.py --traces DIR 'defaults:' 'off:EXPSEG_LEARN_CUTS=0' ...

Each POLICY is LABEL:VAR=VALUE VAR=VALUE (EXPSEG_* settings for expseg-replay). Traces are
recorded on a GPU machine with a library built with `--features test-switches`, e.g.
`BENCH_EXPSEG_ENV=EXPSEG_TEST_TRACE=/tmp/tr/W python3 scripts/bench_torch.py --lib LIB
--workloads W --modes expseg-preload` (one PREFIX.<pid>.trace per process).

Prints, per trace and policy: peak stranded / peak held, peak held, handles created, and an
estimate of the driver time of the trace's second half (its steady state), weighted with the
mean cost of each call in H200 exit reports (the RL trainer and worker and the small GPT,
2026-11-27: create 57 us, release 73, map 10, unmap 35, access 80, mem_get_info 15; the costs
vary 0.5-2x between programs, the ratios between policies little), relative to the first
policy. An estimate to choose what to measure on the GPU, not a measurement."""
import argparse, glob, json, os, subprocess, sys

US = dict(create=57, release=73, map=10, unmap=35, set_access=80, meminfo=15)
HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="/tmp/tr", help="folder of *.trace files")
    ap.add_argument("--replay", default=os.path.join(HERE, "..", "target", "release", "expseg-replay"))
    ap.add_argument("policies", nargs="*", default=["defaults:"])
    a = ap.parse_args()
    traces = sorted(glob.glob(os.path.join(a.traces, "*.trace")))
    if not traces:
        sys.exit(f"no traces in {a.traces}")
    for t in traces:
        base = None
        for pol in a.policies:
            label, _, settings = pol.partition(":")
            env = {k: v for k, v in os.environ.items() if not k.startswith("EXPSEG_")}
            for kv in settings.split():
                k, _, v = kv.partition("=")
                env[k] = v
            n = sum(1 for _ in open(t))
            out = subprocess.run([a.replay, "--every", str(max(1, n // 2)), t], env=env, capture_output=True, text=True)
            lines = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
            if not lines:
                print(f"{os.path.basename(t)} {label}: replay failed: {out.stderr.strip()[:200]}")
                continue
            end, half = lines[-1], lines[0]["calls"]
            ms = sum(US.get(k, 0) * (v - half.get(k, 0)) for k, v in end["calls"].items()) / 1000
            base = base or ms or 1
            print(f"{os.path.basename(t)[:24]:24} {label:12} stranded {100 * end['stranded_over_held']:5.2f} %"
                  f"  held {end['peak_held_bytes'] / 2**30:6.2f} GiB  creates {end['calls']['create']:6}"
                  f"  driver (2nd half) {ms:8.1f} ms {ms / base:5.2f}x  moves {end['compactions'] + end['held_moves']}"
                  f"  mismatches {end['mismatches'] + end['skipped']}")
        print()


if __name__ == "__main__":
    main()
