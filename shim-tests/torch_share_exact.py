"""Sharing is exact: a share moves nothing another stream may be using, works while another
thread captures a CUDA graph, and a consumer without expseg reads what the producer ordered.

    [LD_PRELOAD=libexpseg.so] python3 torch_share_exact.py PART [ARGS]

PART race ROUTE WRITER ROUNDS: each round the main thread makes a tensor `x` for a worker
  thread and a weight `w` right after it (one handle under expseg: PyTorch maps them back to
  back), and shares `w` (ROUTE raw: ctypes `cudaIpcGetMemHandle`, as vLLM does; reduce:
  `torch.multiprocessing.reductions.reduce_tensor`) with a consumer process that checks its
  values; the worker adds 1 to every `x` in a loop (WRITER side: on a non-blocking stream of
  its own; default: on the default stream; graph: a CUDA graph per tensor replayed on its
  stream). Exact: every `x` holds its count, every `w` read right, no CUDA error.
  CONSUMER=plain runs the consumer without LD_PRELOAD.
PART capture [ROUTE]: one thread captures a CUDA graph (global mode, PyTorch's default) while
  another shares a tensor made right after another (ROUTE raw, the default: `cudaIpcGetMemHandle`;
  reduce: `reduce_tensor`): both succeed and the graph replays right.
PART sync MIB MODE [ROUTE]: a producer takes the handle of a buffer once (ROUTE raw, the
  default, or reduce: the consumer rebuilds the tensor once and keeps it; SIDE=1: the producer
  has a non-blocking stream), then 10 times
  rewrites it, orders it (MODE host: `torch.cuda.synchronize()`; event: records an
  interprocess event the consumer waits on) and signals; the consumer (CONSUMER=plain: without
  expseg) reads it each time. Then 30 training steps with the handle live (`loss.item()` each
  step): their median.
PART writeback: a weight made right after another tensor (one handle under expseg) is shared
  by `reduce_tensor`; the consumer adds 1 to it and synchronizes, 5 times; the producer reads
  each result (natively exact both ways) and checks the neighbour is untouched. SIDE=1: the
  producer has a non-blocking stream (under expseg the export goes through a one-way copy: the
  producer does not see the consumer's writes, the case docs/contract.md names).

Prints one JSON line; exit 0 when every check passed.
"""
import ctypes
import json
import os
import sys
import threading
import time

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

MIB = 1 << 20
GIB = 1 << 30


def expseg_figures():
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
    keys = ("coalesce_compactions", "coalesce_held_moves", "coalesce_exports_split",
            "coalesce_splits_refused", "coalesce_moves_refused_capture", "export_mirrors_made",
            "ipc_mirror_sync_copies", "ipc_mirror_event_copies",
            "ipc_mirror_sync_bytes", "ipc_tickets_issued")
    return {k: p.get(k) for k in keys}


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * 64)]


def raw_handle(t):
    """(rc, 64 handle bytes, offset of the tensor from the handle's base), as vLLM asks it."""
    rt = ctypes.CDLL("libcudart.so.13")
    cu = ctypes.CDLL("libcuda.so.1")
    base = ctypes.c_uint64(0)
    cu.cuPointerGetAttribute(ctypes.byref(base), 11, ctypes.c_uint64(t.data_ptr()))
    h = (ctypes.c_byte * 64)()
    rc = rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base.value))
    if rc:
        rt.cudaGetLastError()
    return rc, bytes(h), t.data_ptr() - base.value


def read_floats(rt, addr, idx):
    out = []
    for i in idx:
        v = ctypes.c_float()
        rt.cudaMemcpy(ctypes.byref(v), ctypes.c_void_p(addr + 4 * i), 4, 2)
        out.append(v.value)
    return out


def consumer(q_in, q_out):
    """Opens what it is sent and answers whether it reads the values it is told."""
    torch.cuda.set_device(0)
    rt = ctypes.CDLL("libcudart.so.13")
    rt.cudaSetDevice(0)
    opened = {}
    ev = ev_t = kept = None
    while True:
        msg = q_in.get()
        kind = msg[0]
        if kind == "stop":
            break
        if kind == "raw":  # (raw, key, handle bytes, offset, numel, value)
            _, key, raw, off, numel, value = msg
            if key not in opened:
                p = ctypes.c_void_p()
                orc = rt.cudaIpcOpenMemHandle(ctypes.byref(p), IpcHandle.from_buffer_copy(raw), 1)
                if orc:
                    q_out.put(("open_failed", orc))
                    continue
                opened[key] = p.value + off
            if ev is not None:
                rt.cudaStreamWaitEvent(ctypes.c_void_p(0), ev, 0)
                rt.cudaDeviceSynchronize()
            got = read_floats(rt, opened[key], [0, numel // 2, numel - 1])
            q_out.put(("read", all(g == value for g in got), got))
        elif kind == "event":
            h = IpcHandle.from_buffer_copy(msg[1])
            e = ctypes.c_void_p()
            rc = rt.cudaIpcOpenEventHandle(ctypes.byref(e), h)
            ev = e if rc == 0 else None
            ev_t = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), msg[1]) if rc == 0 else None
            q_out.put(("event", rc))
        elif kind == "keep":  # (keep, rebuilt tensor): kept for later rereads and writes
            kept = msg[1]
            torch.cuda.synchronize()
            q_out.put(("kept",))
        elif kind == "reread":  # (reread, value): the kept tensor read again
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev_t)
            torch.cuda.synchronize()
            n = kept.numel()
            got = [float(kept[i].item()) for i in (0, n // 2, n - 1)]
            q_out.put(("read", all(g == msg[1] for g in got), got))
        elif kind == "add":  # the kept tensor written back: one added to every element
            kept.add_(1)
            torch.cuda.synchronize()
            q_out.put(("added",))
        elif kind == "tensor":  # (tensor, key, rebuilt tensor, value)
            _, key, t, value = msg
            torch.cuda.synchronize()
            ok = bool((t == value).all().item())
            q_out.put(("read", ok, None))
            del t
    q_out.put(("bye",))


def start_consumer(ctx):
    plain = os.environ.get("CONSUMER") == "plain"
    saved = os.environ.get("LD_PRELOAD")
    if plain:
        os.environ.pop("LD_PRELOAD", None)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q_in, q_out))
    p.start()
    if saved is not None:
        os.environ["LD_PRELOAD"] = saved
    return p, q_in, q_out


def race(route, writer, rounds):
    dev = torch.device("cuda", 0)
    ctx = mp.get_context("spawn")
    proc, q_in, q_out = start_consumer(ctx)
    grown_ahead(dev)  # `x` and `w` made back to back share one handle under expseg
    xs, adds, ws = [], [], []
    stop, err = threading.Event(), []
    side = torch.cuda.Stream(dev) if writer in ("side", "graph") else None
    graphs = []

    def add_once(i):
        if writer == "graph":
            if i == len(graphs):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
                    xs[i].add_(1)
                graphs.append(g)
            graphs[i].replay()
        else:
            xs[i].add_(1)
        adds[i] += 1

    def worker():
        try:
            if side is not None:
                torch.cuda.set_stream(side)
            while not stop.is_set():
                for i in range(len(xs)):
                    add_once(i)
                time.sleep(0)
        except Exception as e:  # noqa: BLE001
            err.append(f"worker: {str(e).splitlines()[0][:200]}")

    t = threading.Thread(target=worker)
    t.start()
    out = {"part": "race", "route": route, "writer": writer, "rounds": rounds,
           "consumer": os.environ.get("CONSUMER", "same")}
    reads_ok = 0
    try:
        for r in range(rounds):
            x = torch.zeros(16 * MIB, dtype=torch.int32, device=dev)  # 64 MiB
            w = torch.full((16 * MIB,), float(r + 1), device=dev)  # 64 MiB, right after
            adds.append(0)
            xs.append(x)
            ws.append(w)
            torch.cuda.current_stream().synchronize()  # w's values are written
            if route == "raw":
                rc, raw, off = raw_handle(w)
                if rc:
                    err.append(f"cudaIpcGetMemHandle returned {rc}")
                    break
                q_in.put(("raw", r, raw, off, w.numel(), float(r + 1)))
            else:
                q_in.put(("tensor", r, w, float(r + 1)))
            ans = q_out.get(timeout=120)
            reads_ok += int(ans[0] == "read" and ans[1])
            if ans[0] != "read" or not ans[1]:
                out.setdefault("bad_reads", []).append(str(ans)[:160])
            time.sleep(0.01)
        stop.set()
        t.join()
        torch.cuda.synchronize()
        bad = 0
        for x, n in zip(xs, adds):
            lo, hi = (int(v) for v in torch.aminmax(x))
            bad += lo != n or hi != n
        out["wrong_tensors"] = bad
        out["reads_ok"] = reads_ok
        out["adds"] = sum(adds)
    except Exception as e:  # noqa: BLE001
        stop.set()
        err.append(str(e).splitlines()[0][:200])
    if t.is_alive():
        t.join()
    q_in.put(("stop",))
    out["cuda_error"] = err[0] if err else None
    out["expseg"] = expseg_figures()
    out["ok"] = not err and out.get("wrong_tensors") == 0 and reads_ok == rounds
    return out


def capture(route="raw"):
    dev = torch.device("cuda", 0)
    a = torch.ones(1 << 20, device=dev)
    shared = torch.full((8 * MIB,), 3.0, device=dev)
    torch.cuda.synchronize()
    opened, share_done = threading.Event(), threading.Event()
    result = {}

    def sharer():
        opened.wait()
        try:
            if route == "raw":
                result["rc"], _, _ = raw_handle(shared)
            else:
                reduce_tensor(shared)
                result["rc"] = 0
        except Exception as e:  # noqa: BLE001
            result["rc"] = str(e).splitlines()[0][:200]
        share_done.set()

    th = threading.Thread(target=sharer)
    th.start()
    g = torch.cuda.CUDAGraph()
    capture_error = None
    try:
        with torch.cuda.graph(g):  # global capture mode (PyTorch's default)
            b = a * 2
            opened.set()
            share_done.wait(30)
            c = b + 1
    except Exception as e:  # noqa: BLE001
        capture_error = str(e).splitlines()[0][:200]
    th.join()
    right = None
    if capture_error is None:
        g.replay()
        torch.cuda.synchronize()
        right = bool((c == 3).all().item())
    out = {"part": "capture", "route": route, "share_rc": result.get("rc"), "capture_error": capture_error,
           "replay_right": right, "expseg": expseg_figures()}
    out["ok"] = result.get("rc") == 0 and capture_error is None and right is True
    return out


def sync(mib, mode, route="raw"):
    dev = torch.device("cuda", 0)
    ctx = mp.get_context("spawn")
    proc, q_in, q_out = start_consumer(ctx)
    # SIDE=1: under expseg a page inside a coalesced handle is then exported as a copy kept
    # current at the orderings (the buffer starts inside a handle grown ahead, after a pad).
    side = side_stream(dev)
    if side is not None:
        grown_ahead(dev)
    pad = torch.empty(4 * MIB, device=dev)
    buf = torch.zeros(mib * MIB // 4, device=dev)
    torch.cuda.synchronize()
    rc, raw, off = raw_handle(buf) if route == "raw" else (0, None, 0)
    out = {"part": "sync", "mib": mib, "mode": mode, "route": route, "side": side is not None,
           "consumer": os.environ.get("CONSUMER", "same")}
    if route == "reduce":
        q_in.put(("keep", buf))
        q_out.get(timeout=120)
    if rc:
        out.update(ok=False, error=f"cudaIpcGetMemHandle {rc}")
        q_in.put(("stop",))
        return out
    ev = None
    if mode == "event":
        ev = torch.cuda.Event(interprocess=True)
        q_in.put(("event", bytes(ev.ipc_handle())))
        out["event_open"] = q_out.get(timeout=60)[1]
    right, times = 0, []
    for k in range(1, 11):
        t0 = time.perf_counter()
        buf.fill_(float(k))
        if mode == "host":
            torch.cuda.synchronize()
        else:
            ev.record()
        t1 = time.perf_counter()
        if route == "raw":
            q_in.put(("raw", 0, raw, off, buf.numel(), float(k)))
        else:
            q_in.put(("reread", float(k)))
        ans = q_out.get(timeout=120)
        right += int(ans[0] == "read" and ans[1])
        if not (ans[0] == "read" and ans[1]):
            out.setdefault("bad", []).append(str(ans)[:120])
        times.append((t1 - t0) * 1e3)
    if mode == "event":
        torch.cuda.synchronize()
    out["right"] = right
    out["order_ms_median"] = sorted(times)[len(times) // 2]
    # A training step with the handle live: a small MLP, loss.item() each step.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, device=dev) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    inp = torch.randn(1024, 2048, device=dev)
    steps = []
    for _ in range(30):
        t0 = time.perf_counter()
        loss = model(inp).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        steps.append((time.perf_counter() - t0) * 1e3)
    out["step_ms_median"] = sorted(steps[5:])[len(steps[5:]) // 2]
    q_in.put(("stop",))
    proc.join(timeout=60)
    del pad
    out["expseg"] = expseg_figures()
    out["ok"] = right == 10
    return out


def grown_ahead(dev):
    """A high mark first: later handles grow ahead, so tensors made back to back share one
    (under expseg; natively nothing changes)."""
    big = torch.empty(40 * GIB, dtype=torch.uint8, device=dev)
    del big
    torch.cuda.empty_cache()


def side_stream(dev):
    """SIDE=1: a non-blocking stream of the program's (PyTorch then makes its pool of them),
    as a trainer with side streams has."""
    return torch.cuda.Stream(dev) if os.environ.get("SIDE") == "1" else None


def writeback():
    dev = torch.device("cuda", 0)
    ctx = mp.get_context("spawn")
    proc, q_in, q_out = start_consumer(ctx)
    side = side_stream(dev)
    if side is not None:
        grown_ahead(dev)
    x = torch.zeros(16 * MIB, dtype=torch.int32, device=dev)  # the neighbour, 64 MiB
    w = torch.zeros(16 * MIB, device=dev)  # the weight right after it
    torch.cuda.synchronize()
    out = {"part": "writeback", "route": "reduce", "side": side is not None,
           "consumer": os.environ.get("CONSUMER", "same")}
    q_in.put(("keep", w))
    q_out.get(timeout=120)
    seen = []
    for k in range(1, 6):
        q_in.put(("add",))
        q_out.get(timeout=120)
        torch.cuda.synchronize()
        seen.append(float(w[len(w) // 2].item()))
    q_in.put(("stop",))
    proc.join(timeout=60)
    out["seen"] = seen
    out["x_intact"] = bool((x == 0).all().item())
    out["expseg"] = expseg_figures()
    out["ok"] = seen == [1.0, 2.0, 3.0, 4.0, 5.0] and out["x_intact"]
    return out


def main():
    part = sys.argv[1]
    if part == "race":
        out = race(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif part == "capture":
        out = capture(*(sys.argv[2:3]))
    elif part == "writeback":
        out = writeback()
    else:
        out = sync(int(sys.argv[2]), sys.argv[3], *(sys.argv[4:5]))
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
