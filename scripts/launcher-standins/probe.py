"""What a process started by a launcher sees, on one line, for scripts/test-launchers.sh:
    PROBE rank=R local=L pid=P mapped=PATH cuda=RC preload=... report=... reportdir=... alloc=...
mapped: the libexpseg.so that /proc/self/maps shows loaded ('-': none). cuda: with
PROBE_CUDART (the tests' fake CUDA runtime) set, the status of one cudaMalloc through it, so a
process that serves it under expseg writes its exit report ('-': not tried)."""
import ctypes
import os
import sys

maps = [l.split()[-1] for l in open("/proc/self/maps") if l.rstrip().endswith("libexpseg.so")]
cuda = "-"
if os.environ.get("PROBE_CUDART"):
    rt = ctypes.CDLL(os.environ["PROBE_CUDART"])
    ptr = ctypes.c_void_p()
    cuda = str(rt.cudaMalloc(ctypes.byref(ptr), 1 << 20))
env = os.environ.get
rank = env("RANK") or env("SLURM_PROCID") or env("OMPI_COMM_WORLD_RANK") or "-"
local = env("LOCAL_RANK") or env("SLURM_LOCALID") or env("OMPI_COMM_WORLD_LOCAL_RANK") or "-"
# One write of the whole line: print() may write the text and its newline separately, and
# another process's line can land between them.
sys.stdout.write(f"PROBE rank={rank} local={local} pid={os.getpid()} mapped={maps[0] if maps else '-'} cuda={cuda}"
                 f" preload={env('LD_PRELOAD', '-')} report={env('EXPSEG_REPORT', '-')}"
                 f" reportdir={env('EXPSEG_REPORT_DIR', '-')} alloc={env('PYTORCH_CUDA_ALLOC_CONF', '-')}\n")
sys.stdout.flush()
