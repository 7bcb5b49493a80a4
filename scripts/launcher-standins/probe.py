"""What a process started by a launcher sees, on one line, for scripts/test-launchers.sh:
    PROBE rank=R local=L pid=P mapped=PATH cuda=RC preload=... report=... reportdir=... alloc=... torch=...
mapped: the libexpseg.so that /proc/self/maps shows loaded ('-': none). cuda: with
PROBE_CUDART (the tests' fake CUDA runtime) set, the status of one cudaMalloc through it, so a
process that serves it under expseg writes its exit report ('-': not tried).

PROBE_TORCH=1 makes the process a rank of a PyTorch job instead (the fake runtime is not used:
its libcudart.so.13 would stand in for PyTorch's): a 4 MiB tensor on the rank's GPU
(LOCAL_RANK modulo the GPUs it sees; the CPU where there is none), and with more than one rank
and MASTER_ADDR/MASTER_PORT set, a process group (NCCL on GPUs, gloo on the CPU) whose
all_reduce sums every rank's tensor. torch=BACKEND:SUM/DEVICE, e.g. nccl:3.0/cuda:1 for rank 1
of 2 (world:1 alone); cuda is 0 once the GPU tensor is made, '-' on the CPU. Rank and world
size: RANK/WORLD_SIZE (torchrun, accelerate), else SLURM_PROCID/SLURM_NTASKS, else
OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE.

PROBE_EXIT=N: exit with status N after printing (a job that fails)."""
import ctypes
import os
import sys

maps = [l.split()[-1] for l in open("/proc/self/maps") if l.rstrip().endswith("libexpseg.so")]
env = os.environ.get
rank = env("RANK") or env("SLURM_PROCID") or env("OMPI_COMM_WORLD_RANK") or "-"
local = env("LOCAL_RANK") or env("SLURM_LOCALID") or env("OMPI_COMM_WORLD_LOCAL_RANK") or "-"
cuda = "-"
if env("PROBE_CUDART"):
    rt = ctypes.CDLL(env("PROBE_CUDART"))
    ptr = ctypes.c_void_p()
    cuda = str(rt.cudaMalloc(ctypes.byref(ptr), 1 << 20))
job = "-"
if env("PROBE_TORCH"):
    try:
        import torch

        r = int(rank) if rank != "-" else 0
        world = int(env("WORLD_SIZE") or env("SLURM_NTASKS") or env("OMPI_COMM_WORLD_SIZE") or "1")
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            dev = torch.device("cuda", (int(local) if local != "-" else 0) % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        x = torch.full((1 << 20,), float(r + 1), device=dev)
        if on_gpu:
            torch.cuda.synchronize()
            cuda = "0"
        backend = "world"
        if world > 1 and env("MASTER_ADDR") and env("MASTER_PORT"):
            import torch.distributed as dist

            backend = "nccl" if on_gpu else "gloo"
            # NVLink multicast stays off (a launcher that passes only a list of variables may
            # have left out the machine's own setting of it).
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("RANK", str(r))
            os.environ.setdefault("WORLD_SIZE", str(world))
            dist.init_process_group(backend, rank=r, world_size=world)
            dist.all_reduce(x)
            dist.barrier()
            dist.destroy_process_group()
        job = f"{backend}:{x[0].item()}/{dev}"
    except Exception as e:  # the verdict is verify.py's: say what went wrong, on the line
        job = "error:" + f"{type(e).__name__}:{e}".replace(" ", "_").replace("\n", "_")[:300]
# One write of the whole line: print() may write the text and its newline separately, and
# another process's line can land between them.
sys.stdout.write(f"PROBE rank={rank} local={local} pid={os.getpid()} mapped={maps[0] if maps else '-'} cuda={cuda}"
                 f" preload={env('LD_PRELOAD', '-')} report={env('EXPSEG_REPORT', '-')}"
                 f" reportdir={env('EXPSEG_REPORT_DIR', '-')} alloc={env('PYTORCH_CUDA_ALLOC_CONF', '-')}"
                 f" torch={job}\n")
sys.stdout.flush()
if env("PROBE_EXIT"):  # not otherwise: Ray runs this in its workers (exec), where SystemExit ends the worker
    sys.exit(int(env("PROBE_EXIT")))
