"""A reclaim from another expseg process, or a monitor thread's mem_get_info(), while the
program is at work: no write of its is lost.

expseg answers a reclaim (another expseg process of the user found no memory on the GPU) on
its socket thread, while the program's threads may be launching work. Giving back bytes grown
ahead of live pages would take moving those pages (a copy, then a remap), and a copy taken
while kernels keep writing misses their writes. The worker holds a tensor in a handle grown
ahead and adds 1 to it in a loop; the asker, meanwhile, asks again and again for more than the
GPU has free (its allocations fail into reclaims of the worker). The worker's tensor must hold
exactly its count of additions at the end. `monitor` is the same in one process: a thread of the
worker's asks torch.cuda.mem_get_info() every 20 ms (cudaMemGetInfo gives back what expseg
holds, but from a thread other than the allocator's it may move no live page either).

    LD_PRELOAD=libexpseg.so python3 torch_reclaim_race.py worker DIR [SECONDS]
    LD_PRELOAD=libexpseg.so python3 torch_reclaim_race.py asker DIR [TRIES]
    python3 torch_reclaim_race.py both LIBEXPSEG        (runs the two, prints one JSON line)
    LD_PRELOAD=libexpseg.so python3 torch_reclaim_race.py monitor DIR [SECONDS]

The worker writes DIR/ready when it is adding and prints one JSON line; exit 1 when the count
is wrong or CUDA raised an error. `both` also fails when the asker failed or never asked the
worker for memory (its report's reclaim_asks), and `monitor` when the thread never asked.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
GIB = 1 << 30


def worker(d, seconds, monitor=False):
    import threading

    import torch

    # A high mark first, so that a later handle may grow ahead (up to 1/64 of the most held).
    big = torch.empty(40 * GIB, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.empty_cache()
    x = torch.zeros(64 * MIB, dtype=torch.int32, device="cuda")  # 256 MiB
    torch.cuda.synchronize()
    open(os.path.join(d, "ready"), "w").close()
    stop, asked = threading.Event(), [0]

    def watch():
        while not stop.wait(0.02):
            torch.cuda.mem_get_info()
            asked[0] += 1

    watcher = threading.Thread(target=watch)
    if monitor:
        watcher.start()
    n, t0, err = 0, time.perf_counter(), None
    try:
        while time.perf_counter() - t0 < seconds:
            for _ in range(100):
                x.add_(1)
            n += 100
            time.sleep(0)  # let the other threads (expseg's socket) run
        stop.set()
        if monitor:
            watcher.join()
        torch.cuda.synchronize()
        lo, hi = (int(v) for v in torch.aminmax(x))
    except Exception as e:  # noqa: BLE001
        lo = hi = -1
        err = str(e).splitlines()[0][:200]
    stop.set()
    ok = err is None and lo == n and hi == n
    # In monitor mode the race happened only if the thread did ask.
    ok = ok and (not monitor or asked[0] > 0)
    print(json.dumps({"adds": n, "min": lo, "max": hi, "ok": ok, "cuda_error": err, "mem_get_info": asked[0]}))
    return 0 if ok else 1


def asker(d, tries):
    import torch

    while not os.path.exists(os.path.join(d, "ready")):
        time.sleep(0.05)
    torch.zeros(1, device="cuda")
    got = 0
    for _ in range(tries):
        free, _ = torch.cuda.mem_get_info()
        try:
            t = torch.empty(free + 300 * MIB, dtype=torch.uint8, device="cuda")
            got += 1
            del t
        except torch.OutOfMemoryError:
            pass
        torch.cuda.empty_cache()
        time.sleep(0.3)
    print(json.dumps({"tries": tries, "got": got}))
    return 0


def both(lib):
    here = os.path.abspath(__file__)
    d = tempfile.mkdtemp()
    env = dict(os.environ, LD_PRELOAD=lib)
    rep = os.path.join(d, "worker_report.txt")
    arep = os.path.join(d, "asker_report.txt")
    w = subprocess.Popen([sys.executable, here, "worker", d, "6"], env=dict(env, EXPSEG_REPORT=rep),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    a = subprocess.run([sys.executable, here, "asker", d, "12"], env=dict(env, EXPSEG_REPORT=arep),
                       capture_output=True, text=True, timeout=120)
    wout, werr = w.communicate(timeout=120)
    line = lambda s: next((x for x in s.splitlines() if x.startswith("{")), "{}")  # noqa: E731
    out = {"worker": json.loads(line(wout)), "asker": json.loads(line(a.stdout))}
    try:
        p = json.load(open(rep + ".json"))["process"]
        out["worker_report"] = {k: p[k] for k in ("coalesce_compactions", "coalesce_ahead_returned_bytes",
                                                  "given_back_bytes") if k in p}
    except (OSError, ValueError, KeyError):
        pass
    # The race happened only if the asker's failed allocations asked the worker to give back.
    try:
        out["asker_reclaim_asks"] = json.load(open(arep + ".json"))["process"].get("reclaim_asks", 0)
    except (OSError, ValueError, KeyError):
        out["asker_reclaim_asks"] = 0
    if w.returncode and not out["worker"]:
        out["worker_stderr"] = werr[-300:]
    if a.returncode:
        out["asker_stderr"] = a.stderr[-300:]
    print(json.dumps(out))
    return 1 if w.returncode or a.returncode or out["asker_reclaim_asks"] < 1 else 0


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "worker":
        sys.exit(worker(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 6))
    if what == "monitor":
        sys.exit(worker(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 6, monitor=True))
    if what == "asker":
        sys.exit(asker(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 12))
    sys.exit(both(sys.argv[2]))
