"""One process, one model split over two GPUs (issue 24): 8 blocks of 2048x2048 linear layers,
the first four on cuda:0, the rest and the head on cuda:1 (pipeline stages in one process,
Accelerate's device_map="auto"), trained STEPS steps with AdamW, temporaries of varied sizes on
both devices and torch.cuda.empty_cache() every 7th step. The parent runs it twice at once,
natively (PyTorch's default allocator, no expseg) and under LD_PRELOAD=LIB with the caller's
EXPSEG_* settings, and compares every loss bit for bit.

    python3 torch_two_gpu_model.py LIB [STEPS=300]

Prints one JSON line; exit code 0 when both runs finished and every loss is equal."""
import json
import os
import subprocess
import sys
import time

STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 300


def child():
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    blocks = [torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU()).to(d0 if i < 4 else d1) for i in range(8)]
    head = torch.nn.Linear(2048, 10).to(d1)
    params = [p for b in blocks for p in b.parameters()] + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(1)
    losses = []
    t0 = time.time()
    for step in range(STEPS):
        x = torch.randn(512, 2048, generator=g).to(d0)
        y = torch.randint(0, 10, (512,), generator=g).to(d1)
        # Temporaries of varied sizes on both devices: pages mapped and freed in between.
        tmp = [torch.empty(int((step * 37 % 23 + 1) * (1 << 24)), dtype=torch.uint8, device=d) for d in (d0, d1)]
        h = x
        for i, b in enumerate(blocks):
            if i == 4:
                h = h.to(d1)
            h = b(h)
        loss = torch.nn.functional.cross_entropy(head(h), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del tmp
        losses.append(loss.item())
        if step % 7 == 6:
            torch.cuda.empty_cache()
    torch.cuda.synchronize(d0)
    torch.cuda.synchronize(d1)
    print("RESULT " + json.dumps({"losses": losses, "s": round(time.time() - t0, 1)}))


def main():
    lib = os.path.abspath(sys.argv[1])
    base = {k: v for k, v in os.environ.items() if not k.startswith(("EXPSEG_", "PYTORCH_CUDA_ALLOC_CONF", "LD_PRELOAD"))}
    base["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    under = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", LD_PRELOAD=lib)
    procs = {
        name: subprocess.Popen([sys.executable, __file__, "--child", str(STEPS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, env in (("native", base), ("expseg", under))
    }
    out, runs = {"steps": STEPS}, {}
    for name, p in procs.items():
        so, se = p.communicate(timeout=900)
        line = [l for l in so.splitlines() if l.startswith("RESULT ")]
        runs[name] = json.loads(line[-1][7:]) if line else None
        out[name] = {"rc": p.returncode, "s": runs[name]["s"] if runs[name] else None, "error": None if line else se[-300:]}
    ok = all(runs.values()) and runs["native"]["losses"] == runs["expseg"]["losses"] and len(runs["native"]["losses"]) == STEPS
    out["losses_equal"] = ok
    if all(runs.values()):
        out["last_loss"] = [runs["native"]["losses"][-1], runs["expseg"]["losses"][-1]]
    print(json.dumps(out))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    if "--child" in sys.argv:
        STEPS = int(sys.argv[sys.argv.index("--child") + 1])
        child()
    else:
        main()
