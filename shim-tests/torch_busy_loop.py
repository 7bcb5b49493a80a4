"""A busy PyTorch training loop that knows nothing of expseg, for pauses from outside
(shim-tests/pause_busy.sh): an MLP trains --steps steps without waiting, in one of these modes,
and prints the SHA-256 of its weights at the end. An outside tool pauses it at random moments;
its hash must equal an undisturbed run's.

  default  forward, backward and AdamW on the default stream
  side     the same on a torch.cuda.Stream() of its own (non-blocking, as FSDP2's are)
  graph    one step (forward, backward, SGD update) captured in a CUDA graph, replayed
  thread   default, while a second thread adds 1 to a tensor of its own on a side stream (its
           count is part of the hash)

    python3 torch_busy_loop.py MODE [--steps 3000] [--mib 256] [--ready FILE]

--ready FILE is written after the first 20 steps (warm-up: kernels loaded, memory made).
"""
import argparse
import hashlib
import os
import threading

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, BATCH = 2048, 512


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["default", "side", "graph", "thread"])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--mib", type=int, default=256, help="weights' size (fp32)")
    ap.add_argument("--ready")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    layers = max(1, (a.mib << 20) // (4 * DIM * DIM))
    model = nn.Sequential(*[nn.Linear(DIM, DIM, device="cuda") for _ in range(layers)])
    params = list(model.parameters())
    x = torch.randn(BATCH, DIM, device="cuda")
    y = torch.randn(BATCH, DIM, device="cuda")

    def step_eager():
        loss = F.mse_loss(torch.tanh(model(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    counter = None
    stop = threading.Event()
    worker = None
    if a.mode == "graph":
        lr = 1e-3

        def step_sgd():
            loss = F.mse_loss(torch.tanh(model(x)), y)
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.sub_(lr * g)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step_sgd()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step_sgd()
        run = g.replay
        warm = 3
    else:
        opt = torch.optim.AdamW(params, lr=1e-4)
        run = step_eager
        warm = 0
    if a.mode == "side":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(side)
    else:
        side, ctx = None, None
    if a.mode == "thread":
        counter = torch.zeros(64 << 20 >> 2, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()

        def add():
            ws = torch.cuda.Stream()
            with torch.cuda.stream(ws):
                n = 0
                while not stop.is_set():
                    counter.add_(1)
                    n += 1
                    if n % 64 == 0:
                        ws.synchronize()
                ws.synchronize()

        worker = threading.Thread(target=add)
        worker.start()
    for i in range(a.steps):
        if ctx is not None:
            with ctx:
                run()
        else:
            run()
        if i == 19 and a.ready:
            torch.cuda.synchronize()
            open(a.ready, "w").close()
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    if worker is not None:
        stop.set()
        worker.join()
    torch.cuda.synchronize()
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().numpy().tobytes())
    extra = ""
    if counter is not None:
        lo, hi = int(counter.min()), int(counter.max())
        extra = f" counter {'uniform' if lo == hi else f'TORN {lo}..{hi}'}"
    print(f"mode {a.mode} steps {a.steps + warm} sha256 {h.hexdigest()}{extra}", flush=True)


if __name__ == "__main__":
    main()
