"""CuPy under expseg (issue 11). CuPy links the CUDA runtime statically, so only driver-level
interposition sees it. With CuPy's memory pool off, arrays of 2 MiB to 1 GiB are allocated,
filled and checked; each is shared with cupy.cuda.runtime.ipcGetMemHandle to a consumer
process (a plain one, or one under expseg: CONSUMER_PRELOAD) that checks every element and
writes a marker; the producer reports whether it sees the write (both ways), which it must
natively and to a consumer under expseg.

    python3 cupy_test.py run CONSUMER_PRELOAD|-
Prints one JSON line; exit code 0 when every check passed. SKIP (exit 0) without CuPy."""
import json
import os
import subprocess
import sys

try:
    import cupy as cp
except ImportError:
    print("SKIP cupy not installed")
    sys.exit(0)

SIZES_MIB = [2, 20, 64, 256, 1024]


def consume():
    h = bytes.fromhex(os.environ["HANDLE"])
    n = int(os.environ["N"])
    seed = int(os.environ["SEED"])
    ptr = cp.cuda.runtime.ipcOpenMemHandle(h)
    mem = cp.cuda.UnownedMemory(ptr, n * 4, None)
    a = cp.ndarray((n,), dtype=cp.uint32, memptr=cp.cuda.MemoryPointer(mem, 0))
    want = (cp.arange(n, dtype=cp.uint32) * cp.uint32(2654435761)) ^ cp.uint32(seed)
    ok = bool((a == want).all())
    a[0] = 0xC0FFEE
    cp.cuda.runtime.deviceSynchronize()
    cp.cuda.runtime.ipcCloseMemHandle(ptr)
    print(json.dumps({"data": ok}))
    return 0 if ok else 1


def run(consumer):
    cp.cuda.set_allocator(None)  # every array is a cudaMalloc of its own
    out = {"consumer": "plain" if consumer == "-" else "expseg", "sizes": []}
    ok_all = True
    for mib in SIZES_MIB:
        n = (mib << 20) // 4
        seed = mib
        a = (cp.arange(n, dtype=cp.uint32) * cp.uint32(2654435761)) ^ cp.uint32(seed)
        cp.cuda.runtime.deviceSynchronize()
        h = cp.cuda.runtime.ipcGetMemHandle(a.data.ptr)
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        if consumer != "-":
            env["LD_PRELOAD"] = consumer
        env.update(HANDLE=bytes(h).hex(), N=str(n), SEED=str(seed))
        p = subprocess.run([sys.executable, __file__, "consume"], env=env, capture_output=True, text=True, timeout=300)
        both = int(a[0]) == 0xC0FFEE
        r = {"mib": mib, "consumer_rc": p.returncode, "both_ways": both}
        if p.returncode:
            r["consumer_err"] = (p.stdout + p.stderr)[-300:]
            ok_all = False
        # Natively and to a consumer under expseg (which maps the memory itself) sharing is
        # both ways; only a plain consumer of expseg's memory may get a one-way mirror.
        if not both and (consumer != "-" or "expseg" not in os.environ.get("LD_PRELOAD", "")):
            ok_all = False
        out["sizes"].append(r)
        del a
    print(json.dumps(out))
    return 0 if ok_all else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "consume":
        sys.exit(consume())
    sys.exit(run(sys.argv[2] if len(sys.argv) > 2 else "-"))
