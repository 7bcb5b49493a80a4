"""A PyTorch newcomer for newcomer.c's watcher: prints CLOCK_MONOTONIC milliseconds at its
start, after `import torch`, after `torch.cuda.is_available()` (as keep_newcomer.py's
consumer does before it is told to allocate), and after its first tensor of 1 GiB, so that
the watcher's device-file opens and NVML listing can be placed between them.

    ./newcomer watch 8 & sleep 1; python3 newcomer_torch.py; ./newcomer newcomer; wait
"""
import time


def ms():
    return time.clock_gettime(time.CLOCK_MONOTONIC) * 1e3


t0 = ms()
import torch  # noqa: E402

t1 = ms()
torch.cuda.is_available()
t2 = ms()
time.sleep(0.5)  # keep_newcomer.py's consumer waits here for its signal
t3 = ms()
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
t4 = ms()
print(f"mode=torch_newcomer start={t0:.3f} imported={t1:.3f} is_available={t2:.3f} asks={t3:.3f} allocated={t4:.3f}")
