"""The calls sync_reach.c counts, made by PyTorch: each step marked on stderr, so the counts
at exit can be read against what ran (run it once without the library for the baseline)."""
import sys

import torch

x = torch.ones(1 << 20, device="cuda")
x.add_(1)
torch.cuda.synchronize()
print("did device synchronize x1", file=sys.stderr)
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    x.add_(1)
s.synchronize()
print("did stream synchronize x1", file=sys.stderr)
e = torch.cuda.Event(interprocess=True)
e.record(s)
e.synchronize()
e.query()
e.ipc_handle()
print("did interprocess event record, synchronize, query, ipc_handle x1", file=sys.stderr)
s.query()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    x.add_(1)
g.replay()
torch.cuda.synchronize()
print("did graph capture x1, replay x1, device synchronize x1", file=sys.stderr)
x.cpu()
print("did a copy to host (x.cpu()) x1", file=sys.stderr)
