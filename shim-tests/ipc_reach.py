"""What a raw-IPC consumer reaches, against what the driver and PyTorch say (issue 24, item 2):
the model of torch_ipc_trained.py trains 3 AdamW steps with temporaries, a ballast follows it,
and for each parameter this prints
  range   - cuMemGetAddressRange's answer for the tensor's pointer (what a producer computes the
            handle's base and the consumer's offset from; RANGE_START_ADDR gives the same base),
  reach   - bytes from that base to the tensor's last byte: what a consumer reading the tensor
            at its offset touches (the least a mirror must cover),
  block   - bytes from that base to the end of PyTorch's block holding the tensor
            (torch.cuda.memory_snapshot(): known to PyTorch's allocator, not to the driver),
  run     - bytes of back-to-back mappings from that base on (the most the driver lets anyone
            prove a consumer cannot pass: what expseg's mirror covers),
and the range again after the handle was asked for.
Run it natively (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and under expseg; prints one
JSON line. Exit code 0 when the measurement was taken (a measurement, not a pass/fail test)."""
import ctypes
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_ipc import ctypes_handle  # noqa: E402
from torch_ipc_trained import ballast_arg, trained  # noqa: E402

cu = ctypes.CDLL("libcuda.so.1")


def address_range(p):
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(p))
    return (base.value, size.value) if rc == 0 else (None, rc)


def run_from(base):
    """Bytes of back-to-back ranges from `base` on, and how many."""
    end, n = base, 0
    while n < 100000:
        b, s = address_range(end)
        if b != end or not s:
            break
        end, n = end + s, n + 1
    return end - base, n


def block_end(ptr, snapshot):
    for seg in snapshot:
        a = seg["address"]
        for blk in seg["blocks"]:
            if a <= ptr < a + blk["size"]:
                return a + blk["size"]
            a += blk["size"]
    return None


def main():
    ballast_gib = ballast_arg()
    params, ballast = trained(ballast_gib)
    torch.cuda.synchronize()
    snap = torch.cuda.memory_snapshot()
    rows = []
    for p in params:
        ptr, nbytes = p.data_ptr(), p.numel() * p.element_size()
        base, size = address_range(ptr)
        run, maps = run_from(base)
        be = block_end(ptr, snap)
        rows.append({
            "bytes": nbytes, "range": size, "offset": ptr - base, "reach": ptr + nbytes - base,
            "block": None if be is None else be - base, "run": run, "run_mappings": maps,
        })
    # The range again after each tensor was asked for a handle (expseg splits coalesced
    # handles into PyTorch's pages before sharing; natively the request fails).
    for r, p in zip(rows, params):
        rc, _, _ = ctypes_handle(p.data)
        r["handle_rc"] = rc
        r["range_after"] = address_range(p.data_ptr())[1]
    out = {
        "mode": os.environ.get("MODE", "?"),
        "rows": rows,
        "sum_reach": sum(r["reach"] for r in rows),
        "sum_block": sum(r["block"] or 0 for r in rows),
        "sum_run": sum(r["run"] for r in rows),
        "reach_beyond_range": sum(r["reach"] > r["range"] for r in rows),
        "ballast_gib": ballast_gib,
    }
    del ballast
    print(json.dumps(out))


if __name__ == "__main__":
    main()
