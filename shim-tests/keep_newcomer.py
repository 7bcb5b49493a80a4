"""A plain process arriving on the GPU while an expseg process keeps what it released
(EXPSEG_KEEP=auto, opt-in) gets its memory: a trainer under expseg fills 80 % of the free
memory, frees it and calls empty_cache() (alone on the GPU, it keeps the handles), then a plain
process that has imported torch creates its context at a random moment 0-2 s later (0 included)
and asks at once for 70 % of what was free at the start. ROUNDS rounds; PASS/FAIL lines.

    python3 keep_newcomer.py LIB [ROUNDS]
"""
import os
import random
import subprocess
import sys
import time

GIB = 1 << 30


def trainer(fill):
    import torch

    for line in sys.stdin:
        if line.strip() != "round":
            break
        xs = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(fill)]
        for x in xs:
            x.fill_(1)
        torch.cuda.synchronize()
        del xs, x
        torch.cuda.empty_cache()
        print("EC", flush=True)


def consumer(need):
    import torch

    torch.cuda.is_available()
    print("READY", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    try:
        x = torch.empty(need, dtype=torch.uint8, device="cuda")
        x.fill_(2)
        torch.cuda.synchronize()
        print(f"OK {1e3 * (time.perf_counter() - t0):.1f}", flush=True)
    except RuntimeError as e:
        print(f"OOM {str(e)[:200]}", flush=True)


def main():
    if sys.argv[1] == "--trainer":
        return trainer(int(sys.argv[2]))
    if sys.argv[1] == "--consumer":
        return consumer(int(sys.argv[2]))
    lib, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[0])"], capture_output=True, text=True)
    free = int(probe.stdout.split()[-1])
    plain = {k: v for k, v in os.environ.items() if not k.startswith(("EXPSEG_", "PYTORCH_CUDA_ALLOC_CONF"))}
    plain.pop("LD_PRELOAD", None)
    tenv = dict(plain, LD_PRELOAD=lib, EXPSEG_LOG="info", EXPSEG_KEEP="auto")
    if "EXPSEG_KEEP_GIVEBACK" in os.environ:  # the bound under test, where one is given
        tenv["EXPSEG_KEEP_GIVEBACK"] = os.environ["EXPSEG_KEEP_GIVEBACK"]
    t = subprocess.Popen([sys.executable, __file__, "--trainer", str(int(0.8 * free / GIB))], env=tenv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rng = random.Random(int(os.environ.get("SEED", "1")))
    ok = 0
    for r in range(rounds):
        c = subprocess.Popen([sys.executable, __file__, "--consumer", str(int(0.7 * free))], env=plain, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert c.stdout.readline().strip() == "READY"  # torch imported, no context yet
        t.stdin.write("round\n")
        t.stdin.flush()
        assert t.stdout.readline().strip() == "EC"
        delay = 0.0 if r == 0 else rng.uniform(0, 2)
        time.sleep(delay)
        c.stdin.write("go\n")
        c.stdin.flush()
        out = c.stdout.readline().strip()
        c.wait()
        good = out.startswith("OK")
        ok += good
        print(f"round {r}: consumer at +{delay:.2f} s after empty_cache(): {out}", flush=True)
    t.stdin.write("end\n")
    t.stdin.flush()
    t.wait()
    print(f"{'PASS' if ok == rounds else 'FAIL'} keep_newcomer {ok}/{rounds} plain newcomers got 70 % of the free memory")
    sys.exit(0 if ok == rounds else 1)


if __name__ == "__main__":
    main()
