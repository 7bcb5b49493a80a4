"""Randomized stress of PyTorch's expandable segments on expseg's coalesced pages.

Tensors are filled with known byte values; the loop frees at random, rewrites, calls
empty_cache() (which unmaps pages and strands parts of coalesced handles, compacted by expseg),
forces out-of-memory retries (PyTorch frees its cache and retries; expseg compacts before a
create would fail), and shares tensors (ctypes cudaIpcGetMemHandle, and PyTorch's own
expandable-segment export, _share_cuda_). After every compaction point and every 100
operations each live tensor's every byte is checked (its smallest and largest byte against its
value, one reduction a tensor and one wait a device for them all; STRESS_SELFTEST=1 changes one
byte of a live tensor at the end and fails unless the check finds it).

    LD_PRELOAD=libexpseg.so python3 torch_coalesce_stress.py [OPS] [DEVICES] [LIVE_GIB]

STRESS_FREE_GIB=N: before the loop, a plain process (no LD_PRELOAD, PyTorch's default
allocator) holds all but N GiB of each device's free memory until the stress ends, so the
device looks like a smaller card. The two out-of-memory operations make PyTorch map 20 MiB
pages until the driver refuses; on a 141 GB card that is most of the stress's time, and the
operations, the checks and the pressure they put on expseg are the same on a smaller one.

Prints one JSON line; exit 1 on any mismatch or unexpected error, and on any allocation that
finds no memory other than the forced ones (live tensors stay far below the device's memory,
and the near-full retry asks for 80 % of what is free or cached).
"""
import ctypes
import json
import os
import random
import subprocess
import sys
import time

import torch

MIB = 1 << 20
# STRESS_SYNC_ALL=1: wait for every device before empty_cache() (diagnosis: PyTorch's own wait
# before unmapping is on the current device's default stream).
SYNC_ALL = os.environ.get("STRESS_SYNC_ALL") == "1"
# STRESS_KEEP=1: no torch.cuda.mem_get_info() after empty_cache() (which gives expseg's kept
# handles back), so released handles live on into the next allocations: kept handles serve
# new pages, parked ones where they are mapped (run with a long EXPSEG_RELEASE_DELAY).
KEEP = os.environ.get("STRESS_KEEP") == "1"
SELFTEST = os.environ.get("STRESS_SELFTEST") == "1"
GIB = 1 << 30

BALLAST = r"""
import sys, torch
keep = float(sys.argv[1]) * (1 << 30)
held = []
for d in range(int(sys.argv[2])):
    free, _ = torch.cuda.mem_get_info(d)
    n = int(free - keep) >> 21 << 21
    if n > 0:
        held.append(torch.empty(n, dtype=torch.uint8, device=d))
print("held", [t.numel() >> 20 for t in held], flush=True)
sys.stdin.read()  # until the stress ends (its end closes this pipe)
"""


def hold_all_but(free_gib, ndev):
    """A plain process that holds all but free_gib of each device; returns it once it holds."""
    env = {k: v for k, v in os.environ.items()
           if k != "LD_PRELOAD" and not k.startswith("EXPSEG_") and k != "PYTORCH_CUDA_ALLOC_CONF"}
    p = subprocess.Popen([sys.executable, "-c", BALLAST, str(free_gib), str(ndev)], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if not line.startswith("held"):
        p.kill()
        raise SystemExit(f"STRESS_FREE_GIB: the process holding memory did not start ({line!r})")
    return p, line


def main():
    ops = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
    ndev = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    live_cap = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    devices = [torch.device("cuda", i) for i in range(ndev)]
    ballast = None
    if os.environ.get("STRESS_FREE_GIB"):
        ballast, held = hold_all_but(float(os.environ["STRESS_FREE_GIB"]), ndev)
    rt = ctypes.CDLL("libcudart.so.13")
    rng = random.Random(1234)
    live = {}  # key -> (tensor, value)
    nxt = 0
    stats = {"ops": 0, "allocs": 0, "frees": 0, "rewrites": 0, "empty_cache": 0, "oom_forced": 0,
             "oom_retry_ok": 0, "oom_retry_failed": 0, "oom_unexpected": 0, "ipc_ctypes": 0, "ipc_ctypes_fail": 0, "ipc_ctypes_oom": 0, "share_cuda": 0,
             "share_cuda_fail": 0, "checks": 0, "checked_bytes": 0, "mismatches": 0, "errors": [],
             "check_s": 0.0}
    op_s = {}  # seconds spent in each kind of operation, checks included
    start = time.perf_counter()

    def live_bytes(dev=None):
        return sum(t.numel() for t, _ in live.values() if dev is None or t.device == dev)

    def check_all():
        t0 = time.perf_counter()
        # Every byte equals the value iff the smallest and the largest do: one reduction a
        # tensor (no temporary the size of the tensor), read back once a device.
        ends = {}
        for k, (t, v) in live.items():
            ends.setdefault(t.device, []).append((k, torch.stack(torch.aminmax(t))))
        for dev_ends in ends.values():
            got = torch.stack([e for _, e in dev_ends]).cpu().tolist()
            for (k, _), (lo, hi) in zip(dev_ends, got):
                t, v = live[k]
                stats["checks"] += 1
                stats["checked_bytes"] += t.numel()
                if lo != v or hi != v:
                    bad = sum(bool((t[o : o + 64 * MIB] != v).any().item()) for o in range(0, t.numel(), 64 * MIB))
                    stats["mismatches"] += 1
                    stats["errors"].append(f"tensor {k}: {bad} of {t.numel() // (64 * MIB) + 1} 64 MiB slices differ")
        stats["check_s"] += time.perf_counter() - t0

    def size():
        r = rng.random()
        if r < 0.3:
            return rng.randint(1, 4) * MIB + rng.randint(0, 4095)
        if r < 0.9:
            return rng.randint(20, 300) * MIB + rng.randint(0, MIB)
        return rng.randint(512, 2048) * MIB

    for i in range(ops):
        stats["ops"] += 1
        dev = rng.choice(devices)
        op = rng.random()
        t_op = time.perf_counter()
        try:
            if op < 0.40:
                n = size()
                if live_bytes(dev) + n > live_cap * GIB / ndev:
                    op = 0.5  # free instead
                else:
                    v = rng.randint(1, 250)
                    t = torch.full((n,), v, dtype=torch.uint8, device=dev)
                    live[nxt] = (t, v)
                    nxt += 1
                    stats["allocs"] += 1
            if 0.40 <= op < 0.75 and live:
                k = rng.choice(list(live))
                del live[k]
                stats["frees"] += 1
            elif 0.75 <= op < 0.80 and live:
                k = rng.choice(list(live))
                t, _ = live[k]
                v = rng.randint(1, 250)
                t.fill_(v)
                live[k] = (t, v)
                stats["rewrites"] += 1
            elif 0.80 <= op < 0.87:
                if SYNC_ALL:
                    for d in devices:
                        torch.cuda.synchronize(d)
                torch.cuda.empty_cache()
                if not KEEP:
                    for d in devices:
                        torch.cuda.mem_get_info(d)  # expseg compacts before answering
                stats["empty_cache"] += 1
                check_all()
            elif 0.87 <= op < 0.89:
                # More than the device has: PyTorch frees its cache, retries, and fails.
                free, total = torch.cuda.mem_get_info(dev)
                try:
                    torch.empty(total, dtype=torch.uint8, device=dev)
                    stats["errors"].append("an allocation of the whole card succeeded")
                except torch.OutOfMemoryError:
                    stats["oom_forced"] += 1
                check_all()
            elif 0.89 <= op < 0.91:
                # Nearly all that is free or cached: succeeds only after PyTorch releases its
                # cache, and expseg compacts what that strands.
                free, _ = torch.cuda.mem_get_info(dev)
                cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
                n = int((free + cached) * 0.8) // MIB * MIB
                if n > 0:
                    try:
                        big = torch.full((n,), 7, dtype=torch.uint8, device=dev)
                        ok = bool((big[:: 1 << 16] == 7).all().item())
                        del big
                        stats["oom_retry_ok"] += 1
                        if not ok:
                            stats["mismatches"] += 1
                    except torch.OutOfMemoryError:
                        stats["oom_retry_failed"] += 1
                        stats["errors"].append(f"op {i}: {n >> 20} MiB of {free >> 20} MiB free and "
                                               f"{cached >> 20} MiB cached did not fit")
                check_all()
            elif 0.91 <= op < 0.92 and live:
                k = rng.choice(list(live))
                t, _ = live[k]
                h = (ctypes.c_byte * 64)()
                torch.cuda.set_device(t.device)
                rc = rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(t.data_ptr()))
                if rc:
                    rt.cudaGetLastError()
                # Out of memory (2) is a legitimate answer: the mirror for plain consumers covers
                # the pages from the tensor's to the end of the segment, and the producer says
                # so rather than hand out a handle they could not open.
                if rc == 2:
                    stats["ipc_ctypes_oom"] += 1
                elif rc:
                    stats["ipc_ctypes_fail"] += 1
                stats["ipc_ctypes"] += 1
                check_all()
            elif 0.92 <= op < 0.95 and live and stats["share_cuda"] < 60:
                # PyTorch keeps every storage shared this way alive (its IPC reference
                # counting waits for a consumer), so only small ones, and a bounded number.
                small = [k for k, (t, _) in live.items() if t.numel() <= 64 * MIB]
                if not small:
                    continue
                t, _ = live[rng.choice(small)]
                try:
                    t.untyped_storage()._share_cuda_()
                    stats["share_cuda"] += 1
                except Exception as e:  # noqa: BLE001
                    stats["share_cuda_fail"] += 1
                    stats["errors"].append(f"_share_cuda_: {str(e)[:200]}")
                check_all()
        except torch.OutOfMemoryError as e:
            # Live tensors stay within LIVE_GIB, far below the device: an allocation that
            # finds no memory is memory lost (stranded, or not given back).
            stats["oom_unexpected"] += 1
            stats["errors"].append(f"op {i}: out of memory: {str(e)[:200]}")
        except Exception as e:  # noqa: BLE001
            stats["errors"].append(f"op {i}: {type(e).__name__}: {str(e)[:200]}")
            break
        kind = ("alloc" if op < 0.40 else "free" if op < 0.75 else "rewrite" if op < 0.80 else "empty_cache"
                if op < 0.87 else "oom_forced" if op < 0.89 else "oom_retry" if op < 0.91 else "ipc_ctypes"
                if op < 0.92 else "share_cuda")
        if i % 100 == 99:
            check_all()
        op_s[kind] = op_s.get(kind, 0.0) + time.perf_counter() - t_op
    check_all()
    if SELFTEST and live:
        # The check must see one changed byte in the middle of a live tensor.
        k = rng.choice(list(live))
        t, v = live[k]
        t[t.numel() // 2] = (v + 1) % 256
        before = stats["mismatches"]
        check_all()
        stats["selftest"] = "detected" if stats["mismatches"] == before + 1 else "missed"
        if stats["selftest"] == "detected":
            stats["mismatches"] = before
            stats["errors"].pop()
        else:
            stats["errors"].append("selftest: a changed byte went unseen")
    stats["check_s"] = round(stats["check_s"], 2)
    stats["op_s"] = {k: round(v, 2) for k, v in sorted(op_s.items(), key=lambda kv: -kv[1])}
    stats["wall_s"] = round(time.perf_counter() - start, 2)
    if ballast:
        stats["ballast_mib"] = held
        ballast.stdin.close()
        ballast.wait()
    stats["errors"] = stats["errors"][:10]
    stats["live_at_end"] = len(live)
    print(json.dumps(stats))
    sys.exit(0 if stats["mismatches"] == 0 and not stats["errors"] and stats["ipc_ctypes_fail"] == 0 else 1)


if __name__ == "__main__":
    main()
