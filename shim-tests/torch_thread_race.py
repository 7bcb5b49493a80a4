"""A thread that launches kernels on its tensors while another thread's allocation moves them
(expseg's compaction): no write is lost and no address is illegal.

PyTorch runs a CUDA backward pass on its autograd device thread, and its Python bindings let
go of the GIL while an operation runs, so another Python thread of the program launches
kernels meanwhile. Here the worker thread adds 1 to its tensors in a loop. Each round the main
thread makes a pad and a new worker tensor `x` in one coalesced handle (grown ahead after a
high mark), runs a forward pass, frees the pad and calls empty_cache(): the pad's pages are
released while `x`'s page after them lives, so the handle's live pages move (at once, or at
the next allocation, the first of the backward pass) while the worker launches adds on `x`.
Natively (expandable segments) nothing moves. expseg copies the pages and holds the device's
default stream until they are back at their address (`coalesce_held_moves`), so the
worker's kernels queued meanwhile run after the move; with EXPSEG_MOVE_FENCE=0 they meet the
pages while they are away (an illegal memory access). RACE_STREAM=side: the worker adds on a
non-blocking side stream of its own, which the fence does not hold (docs/configuration.md,
EXPSEG_COMPACT: moves are only for programs whose other threads launch no GPU work meanwhile).
RACE_STREAM=peer (two GPUs, CuPy): the worker adds from device 1, a kernel on device 1's
default stream writing `x` on device 0 through peer access (as PyTorch's copies between
devices run on the source device); expseg holds device 1's default stream through the move
only with EXPSEG_PEER_HOLD=1 (`coalesce_peer_holds`), and where the hold does not start the
move waits for a later call (`coalesce_moves_put_off`).

    [LD_PRELOAD=libexpseg.so] python3 torch_thread_race.py [ROUNDS]

Prints one JSON line; exit 0 when every worker tensor holds exactly its count of additions
and CUDA raised no error.
"""
import ctypes
import json
import os
import sys
import threading
import time

import torch

MIB = 1 << 20
GIB = 1 << 30


def expseg_figures():
    """The moves and the gate's waits so far, from expseg's live report (None without expseg)."""
    try:
        f = ctypes.CDLL(None).expseg_stats_json
    except AttributeError:
        return None
    f.restype = ctypes.c_size_t
    buf = ctypes.create_string_buffer(1 << 20)
    f(buf, len(buf))
    try:
        p = json.loads(buf.value.decode())["process"]
    except (ValueError, KeyError):
        return None
    keys = ("coalesce_compactions", "coalesce_held_moves", "coalesce_compaction_failures",
            "coalesce_peer_holds", "coalesce_peer_holds_let_go", "coalesce_moves_put_off")
    return {k: p.get(k) for k in keys}


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    dev = torch.device("cuda", 0)
    mode = os.environ.get("RACE_STREAM", "default")
    peer_kernel = None
    if mode == "peer":
        # RACE_PEER_DEVICE=0: the kernels from device 0 itself through CuPy (a check of this
        # script on one GPU: the same stream as PyTorch's, held by the fence).
        pd = int(os.environ.get("RACE_PEER_DEVICE", "1"))
        if pd != 0 and (torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(pd, 0)):
            print(json.dumps({"skipped": "RACE_STREAM=peer needs two GPUs with peer access"}))
            return 0
        try:
            import cupy as cp
            import numpy as np
        except ImportError:
            print(json.dumps({"skipped": "RACE_STREAM=peer needs CuPy"}))
            return 0
        # PyTorch gives device 1 access to device 0's pages (its copies between devices
        # enable peer access, and expandable segments set access for the peer).
        for a, b in ((pd, 0), (0, pd)):
            torch.zeros(1, device=f"cuda:{a}").copy_(torch.zeros(1, device=f"cuda:{b}"))
        with cp.cuda.Device(pd):
            k = cp.RawKernel(r"""extern "C" __global__ void add1(int* p, long long n) {
                for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
                     i += (long long)gridDim.x * blockDim.x) p[i] += 1; }""", "add1")

        def peer_kernel(x):
            with cp.cuda.Device(pd):  # its default (legacy) stream
                k((256,), (256,), (np.uint64(x.data_ptr()), np.int64(x.numel())))
    # A high mark: later handles grow ahead (up to 1/64 of the most held), so the pad and the
    # worker's tensor made next share one handle.
    big = torch.empty(40 * GIB, dtype=torch.uint8, device=dev)
    del big
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, device=dev) for _ in range(4)])
    inp = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()

    xs, adds = [], []  # the worker's tensors and their additions
    stop, err = threading.Event(), []

    side = torch.cuda.Stream(dev) if mode == "side" else None

    def worker():
        try:
            if side is not None:
                torch.cuda.set_stream(side)
            while not stop.is_set():
                for i in range(len(xs)):
                    if peer_kernel is not None:
                        peer_kernel(xs[i])
                    else:
                        xs[i].add_(1)
                    adds[i] += 1
                time.sleep(0)
        except Exception as e:  # noqa: BLE001
            err.append(f"worker: {str(e).splitlines()[0][:200]}")

    # RACE_NO_WORKER=1: the same rounds with no other thread (diagnosis); RACE_MARKS=1: each
    # step of a round on stderr, between expseg's debug lines.
    marks = os.environ.get("RACE_MARKS") == "1"
    t = threading.Thread(target=worker)
    if os.environ.get("RACE_NO_WORKER") != "1":
        t.start()
    out = {"rounds": rounds, "stream": mode}
    try:
        for _ in range(rounds):
            pad = torch.empty(100 * MIB, dtype=torch.uint8, device=dev)
            x = torch.zeros(64 * MIB, dtype=torch.int32, device=dev)  # 256 MiB
            adds.append(0)
            xs.append(x)
            del x
            loss = model(inp).square().mean()
            del pad
            if marks:
                print(f"MARK empty_cache {len(xs)}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()  # the pad's pages go; x's stay in their handle
            if marks:
                print("MARK backward", file=sys.stderr, flush=True)
            loss.backward()  # first allocation: on the autograd thread, the move
            if marks:
                print("MARK backward done", file=sys.stderr, flush=True)
            model.zero_grad(set_to_none=True)
            time.sleep(0.01)
        stop.set()
        if t.is_alive():
            t.join()
        for d in range(torch.cuda.device_count() if mode == "peer" else 1):
            torch.cuda.synchronize(d)
        bad = 0
        for x, n in zip(xs, adds):
            lo, hi = (int(v) for v in torch.aminmax(x))
            bad += lo != n or hi != n
        out["wrong_tensors"] = bad
        out["adds"] = adds
    except Exception as e:  # noqa: BLE001
        stop.set()
        err.append(str(e).splitlines()[0][:200])
    if t.is_alive():
        t.join()
    out["cuda_error"] = err[0] if err else None
    out["expseg"] = expseg_figures()
    out["ok"] = not err and out.get("wrong_tensors") == 0
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0 if out["ok"] else 1)  # no teardown after a sticky CUDA error


if __name__ == "__main__":
    main()
