"""IPC of PyTorch tensors, as RL frameworks and vLLM do it, in one process configuration.

1. `cudaIpcGetMemHandle` through ctypes on `tensor.data_ptr()` (vLLM's custom all-reduce):
   a consumer process opens each handle with ctypes `cudaIpcOpenMemHandle`, finds the tensor
   at the offset the producer computed from `cuPointerGetAttribute(RANGE_START_ADDR)`, checks
   its first and last element and writes both; the parent reports whether it sees the writes
   (shared both ways) — once with a consumer in the same environment, once with a plain one
   (no LD_PRELOAD); the first must share both ways, the plain one at least one way;
2. `torch.multiprocessing` sharing of tensors from many segments with a child process that
   reads every tensor and writes back into it, the parent checking the writes;
3. the weight-sync pattern: one bucket refilled and re-shared 10 times, the child checking
   every version.

Prints one JSON line with the results; exit code 0 when every check passed.
Run it under each mode (shim-tests/run.sh does): default allocator, expandable_segments,
expseg (LD_PRELOAD)."""
import ctypes
import json
import os
import sys

import torch
import torch.multiprocessing as mp

SIZES_MIB = [1, 3, 8, 20, 40, 96, 256]


def ctypes_handle(t):
    """(rc, 64 handle bytes, offset of the tensor from the handle's base)."""
    rt = ctypes.CDLL("libcudart.so.13")
    cu = ctypes.CDLL("libcuda.so.1")
    base = ctypes.c_uint64(0)
    # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, as vLLM does for graph buffers
    cu.cuPointerGetAttribute(ctypes.byref(base), 11, ctypes.c_uint64(t.data_ptr()))
    h = (ctypes.c_byte * 64)()
    rc = rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base.value))
    if rc:
        rt.cudaGetLastError()
    return rc, bytes(h), t.data_ptr() - base.value


class IpcHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: 64 bytes, passed by value to cudaIpcOpenMemHandle."""

    _fields_ = [("reserved", ctypes.c_byte * 64)]


def ctypes_consumer(q_in, q_out):
    """Open each handle, check the tensor's first and last float, write both (+1000)."""
    rt = ctypes.CDLL("libcudart.so.13")
    rt.cudaSetDevice(0)
    results = []
    for i, (rc, raw, off, numel) in enumerate(q_in.get()):
        if rc:
            results.append({"open": None})
            continue
        h = IpcHandle.from_buffer_copy(raw)
        p = ctypes.c_void_p()
        orc = rt.cudaIpcOpenMemHandle(ctypes.byref(p), h, 1)
        r = {"open": orc}
        if orc == 0:
            first, last = ctypes.c_float(), ctypes.c_float()
            a = p.value + off
            rt.cudaMemcpy(ctypes.byref(first), ctypes.c_void_p(a), 4, 2)
            rt.cudaMemcpy(ctypes.byref(last), ctypes.c_void_p(a + 4 * (numel - 1)), 4, 2)
            r["data"] = first.value == i + 1 and last.value == i + 1
            mark = ctypes.c_float(i + 1001)
            rt.cudaMemcpy(ctypes.c_void_p(a), ctypes.byref(mark), 4, 1)
            rt.cudaMemcpy(ctypes.c_void_p(a + 4 * (numel - 1)), ctypes.byref(mark), 4, 1)
            rt.cudaDeviceSynchronize()
            r["close"] = rt.cudaIpcCloseMemHandle(p)
        results.append(r)
    q_out.put(results)


def ctypes_round(ctx, tensors, handles, plain):
    """One consumer process over the ctypes handles; per tensor: opened, data right, writes
    seen by the producer. Restores the tensors afterwards."""
    saved = os.environ.get("LD_PRELOAD")
    if plain:
        os.environ.pop("LD_PRELOAD", None)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=ctypes_consumer, args=(q_in, q_out))
    p.start()
    if saved is not None:
        os.environ["LD_PRELOAD"] = saved
    q_in.put([(rc, raw, off, t.numel()) for (rc, raw, off), t in zip(handles, tensors)])
    res = q_out.get(timeout=120)
    p.join(timeout=60)
    torch.cuda.synchronize()
    out = []
    for i, (r, t) in enumerate(zip(res, tensors)):
        seen = int(t[0].item()) == i + 1001 and int(t[-1].item()) == i + 1001
        out.append("-" if r["open"] is None else "open-fails" if r["open"] else
                   ("both-ways" if seen else "one-way") if r["data"] else "wrong-data")
        t.fill_(float(i + 1))
    torch.cuda.synchronize()
    return out


def child(q_in, q_out):
    torch.cuda.set_device(0)
    tensors = q_in.get()
    ok = all(int(t[0].item()) == i + 1 and int(t[-1].item()) == i + 1 for i, t in enumerate(tensors))
    for t in tensors:
        t.add_(100)  # the parent must see this
    torch.cuda.synchronize()
    q_out.put(("read", ok))
    # Weight sync: the parent refills the bucket and shares it again each round.
    seen = 0
    for v in range(10):
        bucket = q_in.get()
        torch.cuda.synchronize()
        seen += int(bucket[0].item() == v and bucket[-1].item() == v)
        q_out.put(("version", v))
    q_out.put(("versions", seen))
    q_in.get()  # the parent says when to leave, so shared memory outlives its use


def main():
    out = {"mode": os.environ.get("MODE", "?")}
    torch.cuda.set_device(0)
    # Tensors from many segments (sizes spread over PyTorch's small and large pools).
    tensors = [torch.full((s << 18,), float(i + 1), device="cuda") for i, s in enumerate(SIZES_MIB)]
    handles = [ctypes_handle(t) for t in tensors]
    out["ctypes_rc"] = [h[0] for h in handles]
    ctx = mp.get_context("spawn")
    out["ctypes_consumer"] = ctypes_round(ctx, tensors, handles, plain=False)
    if os.environ.get("LD_PRELOAD"):
        out["ctypes_plain_consumer"] = ctypes_round(ctx, tensors, handles, plain=True)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q_in, q_out))
    p.start()
    try:
        q_in.put(tensors)
        kind, read_ok = q_out.get(timeout=120)
        torch.cuda.synchronize()
        out["child_read"] = bool(read_ok)
        out["parent_sees_child_writes"] = all(
            int(t[0].item()) == i + 101 and int(t[-1].item()) == i + 101 for i, t in enumerate(tensors)
        )
        bucket = torch.empty(64 << 18, device="cuda")  # 64 MiB
        for v in range(10):
            bucket.fill_(float(v))
            torch.cuda.synchronize()
            q_in.put(bucket)
            q_out.get(timeout=120)
        out["versions_seen"] = q_out.get(timeout=120)[1]
        q_in.put("bye")
        p.join(timeout=120)
        out["child_exit"] = p.exitcode
    except Exception as e:  # a mode where sharing does not work at all
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        p.kill()
    print(json.dumps(out))
    # A consumer in the producer's environment shares both ways: natively (cudaMalloc memory)
    # and under expseg (the consumer maps the memory itself through its ticket). Only a plain
    # consumer of expseg's memory gets a one-way mirror.
    ok = (
        all(rc == 0 for rc in out["ctypes_rc"])
        and all(c == "both-ways" for c in out["ctypes_consumer"])
        and all(c in ("both-ways", "one-way") for c in out.get("ctypes_plain_consumer", []))
        and out.get("child_exit") == 0
        and out.get("child_read")
        and out.get("parent_sees_child_writes")
        and out.get("versions_seen") == 10
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
