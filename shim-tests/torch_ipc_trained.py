"""Raw IPC of a trained model's tensors (vLLM-style weight sync through ctypes), under expseg:
a model of 7 parameter shapes up to 1.2 GB trains 3 AdamW steps with temporaries of varied
sizes, a ballast of --ballast-gib GiB stays allocated after it (so the tensors sit in long
runs of PyTorch's pages, whose mirrors do not all fit), and every parameter is shared with
`cudaIpcGetMemHandle` on `cuPointerGetAttribute(RANGE_START_ADDR)` of its pointer, as
shim-tests/torch_ipc.py does. A consumer running expseg must open 7/7 and share them both
ways; with mirrors bounded by PyTorch's blocks (default) a plain consumer opens 7/7 with the
right bytes; with EXPSEG_IPC_EXTENT=run (mirrors of whole runs, most of which do not fit) it
may fail to open a handle that has no mirror, but any handle it opens must hold the right
bytes. Prints one JSON line (with the mirror bytes before and after);
exit code 0 when those hold. Run under LD_PRELOAD=libexpseg.so."""
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from torch_ipc import ctypes_handle, ctypes_round  # noqa: E402

SHAPES = [(17408, 17408), (12288, 12288), (8192, 16384), (1024, 50000), (8192, 8192), (4096, 4096), (3000, 700)]


def process_rows():
    import expseg

    p = expseg.stats().get("process", {})
    keys = ("foreign_mirror_bytes", "foreign_mirror_bytes_made", "foreign_mirrors_bounded", "foreign_mirror_bytes_spared", "ipc_ticket_only")
    return {k: p.get(k) for k in keys}


def ballast_arg():
    return float(sys.argv[sys.argv.index("--ballast-gib") + 1]) if "--ballast-gib" in sys.argv else 30


def trained(ballast_gib):
    """The 7 parameters after 3 AdamW steps with temporaries, and the ballast after them."""
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.01) for s in SHAPES]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for step in range(3):
        tmp = [torch.randn(int(n) << 18, device="cuda") for n in (3, 40, 200 * (step + 1), 7)]
        loss = sum((p * p).sum() for p in params) + sum(t.sum() for t in tmp) * 0
        loss.backward()
        opt.step()
        opt.zero_grad()
        del tmp
    ballast = torch.empty(int(ballast_gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    return params, ballast


def main():
    ballast_gib = ballast_arg()
    params, ballast = trained(ballast_gib)
    tensors = [p.data.view(-1) for p in params]
    for i, t in enumerate(tensors):
        t.fill_(float(i + 1))
    torch.cuda.synchronize()
    out = {"bytes": [t.numel() * 4 for t in tensors], "ballast_gib": ballast_gib, "before": process_rows()}
    t0 = time.perf_counter()
    handles = [ctypes_handle(t) for t in tensors]
    t1 = time.perf_counter()
    again = [ctypes_handle(t) for t in tensors]  # weight sync's next round: refreshes
    t2 = time.perf_counter()
    out["handles_ms"] = [round((t1 - t0) * 1e3, 1), round((t2 - t1) * 1e3, 1)]
    out["same_handles_again"] = all(a[1] == h[1] for a, h in zip(again, handles))
    out["ctypes_rc"] = [h[0] for h in handles]
    out["after_handles"] = process_rows()
    ctx = torch.multiprocessing.get_context("spawn")
    out["expseg_consumer"] = ctypes_round(ctx, tensors, handles, plain=False)
    out["plain_consumer"] = ctypes_round(ctx, tensors, handles, plain=True)
    out["after"] = process_rows()
    free, total = torch.cuda.mem_get_info()
    out["free_gib"] = round(free / (1 << 30), 2)
    del ballast
    print(json.dumps(out))
    # With mirrors bounded by PyTorch's blocks (the default EXPSEG_IPC_EXTENT=torch) every
    # mirror fits: the plain consumer opens 7/7 with the right bytes.
    bounded = os.environ.get("EXPSEG_IPC_EXTENT", "torch") != "run"
    out["plain_must_open"] = bounded
    ok = (
        all(rc == 0 for rc in out["ctypes_rc"])
        and out["same_handles_again"]
        and all(c == "both-ways" for c in out["expseg_consumer"])
        and all(c in (("one-way",) if bounded else ("one-way", "open-fails")) for c in out["plain_consumer"])
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
