"""One rank of a torchrun job under scripts/expseg-run: allocate, all-reduce over NCCL, and take
a legacy IPC handle of a tensor through ctypes. Prints one line per rank; exits non-zero on a
wrong sum or a failed handle. shim-tests/run.sh launches it with 1 and 2 processes."""
import ctypes
import os
import sys

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank))
torch.cuda.set_device(local % torch.cuda.device_count())
dist.init_process_group("nccl" if torch.cuda.device_count() >= world else "gloo")
x = torch.full((64 << 18,), float(rank + 1), device="cuda")  # 64 MiB
if dist.get_backend() == "nccl":
    dist.all_reduce(x)
else:
    y = x.cpu()
    dist.all_reduce(y)
    x.copy_(y)
want = world * (world + 1) / 2
ok = bool((x == want).all().item())
h = (ctypes.c_byte * 64)()
rc = ctypes.CDLL("libcudart.so.13").cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(x.data_ptr()))
preloaded = "libexpseg.so" in os.environ.get("LD_PRELOAD", "")
print(f"rank {rank}/{world} device {torch.cuda.current_device()}: all_reduce {'ok' if ok else 'WRONG'}, ipc handle rc {rc}, expseg preloaded {preloaded}", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.exit(0 if ok and rc == 0 and preloaded else 1)
