"""A plain PyTorch training loop that knows nothing of expseg, for torch_sleep_external.sh:
an MLP of about --gib GiB (fp32 weights, grads and AdamW state) trains --steps steps with a
fixed seed and prints each step's loss exactly (repr); after step --wait-after it writes
DIR/ready and waits, polling every 50 ms, until DIR/go appears (exit 1 after --timeout s).
Meanwhile an outside tool may pause and resume its GPU memory.

    python3 plain_train_wait.py DIR [--gib 8] [--steps 6] [--wait-after 3] [--timeout 120]
"""
import argparse
import math
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, BATCH = 8192, 256


class Stack(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM, device="cuda") for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--wait-after", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = Stack(max(1, math.ceil(args.gib * (1 << 30) / (16 * (DIM * DIM + DIM)))))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    print(f"pid {os.getpid()}: {len(model.layers)} layers", flush=True)
    for step in range(1, args.steps + 1):
        x = torch.randn(BATCH, DIM, generator=gen).cuda()
        y = torch.randn(BATCH, DIM, generator=gen).cuda()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        print(f"step {step} loss {loss.item()!r}", flush=True)
        if step == args.wait_after:
            torch.cuda.synchronize()
            open(os.path.join(args.dir, "ready"), "w").close()
            deadline = time.monotonic() + args.timeout
            while not os.path.exists(os.path.join(args.dir, "go")):
                if time.monotonic() > deadline:
                    print(f"no {args.dir}/go after {args.timeout:.0f} s", flush=True)
                    sys.exit(1)
                time.sleep(0.05)
    print("done", flush=True)


if __name__ == "__main__":
    main()
