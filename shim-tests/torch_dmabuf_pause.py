"""A tensor with a dma-buf of its range (cuMemGetHandleForAddressRange, how RDMA registers GPU
memory) is never paused: expseg.pause() pauses the other tensors, the registered one stays
mapped with its bytes (read during the pause), and everything is back after resume. One JSON
line; exit 1 on a wrong answer.

    LD_PRELOAD=libexpseg.so PYTHONPATH=python python3 torch_dmabuf_pause.py
"""
import ctypes
import json
import sys

import torch

import expseg

# y first, x after it on a page of its own (PyTorch's pages are 20 MiB): the pages from x's on
# never pause, y's do.
y = torch.full((240 << 20,), 5, dtype=torch.uint8, device="cuda")
x = torch.full((60 << 20,), 3, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
cu = ctypes.CDLL("libcuda.so.1")
fd = ctypes.c_int(-1)
rc = cu.cuMemGetHandleForAddressRange(ctypes.byref(fd), ctypes.c_uint64(x.data_ptr()), ctypes.c_size_t(x.numel()), ctypes.c_int(1), ctypes.c_ulonglong(0))
out = {"range_rc": rc}
if rc == 0:
    n = expseg.pause()
    out["paused_bytes"] = n
    out["x_read_while_paused"] = int(x.sum().item()) == 3 * x.numel()
    torch.cuda.synchronize()
    expseg.resume()
    out["y_back"] = bool((y == 5).all().item())
    out["x_back"] = bool((x == 3).all().item())
out["ok"] = rc == 0 and out.get("paused_bytes", 0) > 0 and out.get("x_read_while_paused") and out.get("y_back") and out.get("x_back")
print(json.dumps(out), flush=True)
sys.exit(0 if out["ok"] else 1)
