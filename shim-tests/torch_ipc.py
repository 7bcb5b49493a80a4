"""IPC of PyTorch tensors, as RL frameworks and vLLM do it, in one process configuration.

1. `cudaIpcGetMemHandle` through ctypes on `tensor.data_ptr()` (vLLM's custom all-reduce);
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
    rt = ctypes.CDLL("libcudart.so.13")
    h = (ctypes.c_byte * 64)()
    rc = rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(t.data_ptr()))
    if rc:
        rt.cudaGetLastError()
    return rc


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
    out["ctypes_rc"] = [ctypes_handle(t) for t in tensors]
    ctx = mp.get_context("spawn")
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
    ok = (
        all(rc == 0 for rc in out["ctypes_rc"])
        and out.get("child_read")
        and out.get("parent_sees_child_writes")
        and out.get("versions_seen") == 10
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
