"""empty_cache() while a freed tensor's last kernels still run, called with another context
current (issue 24). PyTorch waits on the legacy default stream of the *current* context before
it unmaps an expandable segment's pages (cudaStreamSynchronize(nullptr)); when that is not the
context the kernels run in, the pages are unmapped under them: natively an illegal memory
access. That happens when empty_cache() frees every device's pages from one thread (device1),
and, on one GPU, with a context of the program's own current (own). expseg waits for the
memory's device's default stream before one of its handles leaves its address whenever the
caller's current context is not that device's primary one.

    [LD_PRELOAD=libexpseg.so] python3 torch_cross_context_free.py [own|primary|device1]

own (default): a context of the program's own is current during empty_cache(); primary: the
primary context is (the control: PyTorch's own wait covers the kernels); device1: the tensors
are on cuda:1 and cuda:0 is current (needs two GPUs). Prints one JSON line; exit 0 when the
kernels' output and a live tensor are right and no CUDA error was raised.
"""
import ctypes
import json
import sys
import time

import torch

MIB = 1 << 20


def own_context(cu):
    """A context of the program's own on device 0, made and popped (the primary one current)."""
    ctx = ctypes.c_void_p()
    # CUDA 13's cuCtxCreate is v4 (no parameters struct: NULL); older drivers have v2.
    rc = cu.cuCtxCreate_v4(ctypes.byref(ctx), None, 0, 0) if hasattr(cu, "cuCtxCreate_v4") else 1
    if rc:
        rc = cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0)
    popped = ctypes.c_void_p()
    if rc or cu.cuCtxPopCurrent_v2(ctypes.byref(popped)):
        raise RuntimeError(f"cuCtxCreate/cuCtxPopCurrent: {rc}")
    return ctx


def main():
    where = sys.argv[1] if len(sys.argv) > 1 else "own"
    if where == "device1" and torch.cuda.device_count() < 2:
        print(json.dumps({"where": where, "skipped": "one GPU"}))
        return 0
    dev = torch.device("cuda", 1 if where == "device1" else 0)
    cu = ctypes.CDLL("libcuda.so.1")
    torch.cuda.set_device(dev)
    # Whole 20 MiB pages: `keep` ends on a page boundary, so `x` has pages of its own that
    # empty_cache() gives back whole.
    keep = torch.full((80 * MIB,), 3, dtype=torch.uint8, device=dev)
    x = torch.empty(512 * MIB, dtype=torch.uint8, device=dev)
    probe = torch.zeros(8, dtype=torch.uint8, device=dev)
    out = {"where": where}
    # Made before the kernels: creating a context takes long enough for them to end.
    ctx = own_context(cu) if where == "own" else None
    if where == "device1":
        torch.zeros(1, device="cuda:0")  # device 0's context exists
    # The spin kernel's cycles per second, for a kernel of about two seconds.
    torch.cuda._sleep(1000)  # loads the kernel
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(int(1e8))
    torch.cuda.synchronize()
    cycles = int(2.0 * 1e8 / (time.perf_counter() - t0))
    # Two seconds of the default stream, then a kernel writing x and copies reading it into
    # live memory: still queued when x is freed and its pages are given back. (Contiguous
    # copies: a strided one would wait for the device.)
    t_launch = time.perf_counter()
    torch.cuda._sleep(cycles)
    x.fill_(7)
    probe[:4].copy_(x[:4])
    probe[4:].copy_(x[-4:])
    del x
    out["host_s"] = round(time.perf_counter() - t_launch, 3)  # microseconds: nothing waited
    if where == "own":
        cu.cuCtxPushCurrent_v2(ctx)
    elif where == "device1":
        torch.cuda.set_device(0)
    t0 = time.perf_counter()
    out["kernels_left_s"] = round(2.0 - (t0 - t_launch), 3)
    torch.cuda.empty_cache()
    out["empty_cache_s"] = round(time.perf_counter() - t0, 3)
    if where == "own":
        popped = ctypes.c_void_p()
        cu.cuCtxPopCurrent_v2(ctypes.byref(popped))
    torch.cuda.set_device(dev)
    try:
        torch.cuda.synchronize()
        out["probe_ok"] = bool((probe == 7).all().item())
        out["keep_ok"] = bool((keep == 3).all().item())
        out["cuda_error"] = None
    except Exception as e:  # noqa: BLE001
        out["probe_ok"] = out["keep_ok"] = False
        out["cuda_error"] = str(e).splitlines()[0][:200]
    if ctx is not None:
        cu.cuCtxDestroy_v2(ctx)
    print(json.dumps(out))
    return 0 if out["probe_ok"] and out["keep_ok"] and not out["cuda_error"] else 1


if __name__ == "__main__":
    sys.exit(main())
