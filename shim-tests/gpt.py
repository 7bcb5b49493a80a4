"""The small GPT-like model both PyTorch loops train: shim-tests/torch_train.py (losses under
expseg must equal the native run's) and scripts/bench_torch.py's `train` workload."""
import torch
import torch.nn as nn


def gpt(dim, layers, vocab, heads, positions):
    """A decoder of `layers` blocks; parameters are created in a fixed order, so a seeded run
    initialises them identically."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-1, -2)) / (dim // heads) ** 0.5
            mask = torch.ones(t, t, device=x.device, dtype=torch.bool).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, dim))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.head = nn.Linear(dim, vocab)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            return self.head(self.blocks(self.tok(idx) + self.pos(pos)))

    return GPT()
