"""Train a small GPT-like model for a few hundred steps and write its losses and memory figures
as JSON. shim-tests/run.sh runs it with and without expseg and compares: the losses must be
identical and the exit report must show PyTorch's segments came from the pool.

Usage: python3 torch_train.py OUT.json [STEPS]

Where the expseg Python module is importable (the wheel), the JSON also holds
`expseg.stats()` taken after the last step, for comparison with the exit report."""
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
import torch.nn.functional as F

from gpt import gpt

VOCAB = 2048


def main():
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    model = gpt(dim=256, layers=4, vocab=VOCAB, heads=8, positions=1024).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        # Varying shapes make the caching allocator create and split segments of many sizes.
        batch, seq = 16 + 8 * (step % 3), 128 + 64 * (step % 5)
        data = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen).to(dev)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 49:
            torch.cuda.empty_cache()  # hand segments back: cudaFree through expseg
    torch.cuda.synchronize()
    try:
        import expseg

        live = expseg.stats()
    except ImportError:
        live = None
    json.dump(
        {
            "expseg": live,
            "losses": losses,
            "max_reserved": torch.cuda.max_memory_reserved(),
            "max_allocated": torch.cuda.max_memory_allocated(),
            "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
            "segments_allocated": torch.cuda.memory_stats().get("segment.all.allocated", 0),
        },
        open(out, "w"),
    )
    print(f"trained {steps} steps, final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
