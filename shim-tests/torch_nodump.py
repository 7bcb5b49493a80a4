"""torch.multiprocessing of expandable-segment tensors where pidfd_getfd is denied.

PyTorch shares expandable-segment memory by letting the consumer take the producer's
descriptors with pidfd_getfd, which needs ptrace rights over the producer. Each process here
makes itself non-dumpable (prctl(PR_SET_DUMPABLE, 0)) before it shares, so that run as a user
without CAP_SYS_PTRACE every pidfd_getfd is denied by the kernel. Both ways: the parent shares
tensors with a spawned child, which checks them and writes into them (the parent checks the
writes), and the child shares a tensor of its own back.

Run it as an unprivileged user (shim-tests/run.sh uses setpriv to uid 65534 when root) with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: under expseg on both sides it passes;
without expseg it must fail with PyTorch's pidfd_getfd error (the control run).
Prints one JSON line; exit code 0 when every check passed."""
import ctypes
import json
import os
import sys

import torch
import torch.multiprocessing as mp

PR_SET_DUMPABLE = 4


def no_dump():
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def child(q_in, q_out):
    try:
        torch.cuda.set_device(0)
        tensors = q_in.get()
        ok = all(bool((t == float(i + 1)).all()) for i, t in enumerate(tensors))
        for t in tensors:
            t.add_(100.0)
        torch.cuda.synchronize()
        no_dump()
        mine = torch.full((5 << 20,), 7.0, device="cuda")  # 20 MiB of the child's own
        q_out.put({"child_read": ok, "error": None})
        q_out.put(mine)
        q_in.get()  # the parent is done with it
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q_out.put({"child_read": False, "error": f"{type(e).__name__}: {e}"[:400]})


def main():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q_in, q_out))
    p.start()
    torch.cuda.set_device(0)
    sizes = [1, 20, 96]  # MiB
    tensors = [torch.full((s << 18,), float(i + 1), device="cuda") for i, s in enumerate(sizes)]
    torch.cuda.synchronize()
    no_dump()
    q_in.put(tensors)
    res = q_out.get(timeout=300)
    back_ok = None
    if res["error"] is None:
        mine = q_out.get(timeout=300)
        try:
            back_ok = bool((mine == 7.0).all())
        except Exception as e:  # noqa: BLE001
            res["error"] = f"parent: {type(e).__name__}: {e}"[:400]
        del mine
        q_in.put("done")
    p.join(timeout=120)
    writes = all(bool((t == float(i + 101)).all()) for i, t in enumerate(tensors)) if res["error"] is None else False
    out = {
        "uid": os.getuid(),
        "expandable": "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "child_read": res["child_read"],
        "parent_sees_child_writes": writes,
        "parent_reads_child_tensor": back_ok,
        "child_exit": p.exitcode,
        "error": res["error"],
    }
    print(json.dumps(out))
    return 0 if (res["child_read"] and writes and back_ok and p.exitcode == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
