#!/usr/bin/env python3
"""PyTorch under expseg, side by side with PyTorch's own allocator settings.

    python3 scripts/bench_torch.py [--lib path/to/libexpseg.so] [--out DIR] [--workloads ...]

Each workload runs in a fresh process per mode, under a fixed memory budget made real by a
filler process that holds the rest of the card:
  frag   step-2 fragmentation: a transient buffer of 55 % of the budget, then 40 medium buffers
         of 0.4-2 %, every fourth kept into the next step (the seed's OOM at step 2);
  moe    MoE-like: per-step activation sizes that follow random expert loads;
  churn  ~48 GiB per step in 0.05-0.6 GiB tensors, a third touched, all freed, and
         torch.cuda.empty_cache() every step (frameworks handing memory to a colocated engine);
  train  a small GPT-like model, a few hundred steps: step time and losses;
  train_ec the same model with varying shapes and torch.cuda.empty_cache() every step;
  gpt2_ec  a GPT-2-sized (124M) Hugging Face model (transformers' GPT2LMHeadModel, built from
         its config: no download), AdamW, bf16 autocast, batches of 8 with dynamic padding
         (sequence lengths 512-1024), torch.cuda.empty_cache() every step;
  rl     a colocated RL loop: a train step of the small GPT, empty_cache(), the weights packed
         into one bucket shipped to a worker process over torch.multiprocessing (the worker
         copies them into its own model), a rollout phase in the worker that takes and frees a
         KV-cache-sized block set (12 GiB of 64 MiB blocks) and runs its model, empty_cache() in
         both; the step is the trainer's whole round;
  ddp_ec   two ranks (torchrun, one GPU each, NCCL) of DDP over the small GPT with varying
         shapes and torch.cuda.empty_cache() every step; rank 0's step time, device memory and
         losses; needs two GPUs (skipped with fewer), no filler; ddp: the same without
         empty_cache(). The other two-rank workloads are alike:
  fsdp2_ec PyTorch FSDP2 (fully_shard on each block and the root, bf16 parameters, fp32
         gradient reduction) over a GPT-2-sized decoder (12 layers of 768, GPT-2's vocabulary;
         shim-tests/gpt.py), AdamW, batches of 8 of 512-1024 tokens, 60 steps,
         torch.cuda.empty_cache() every step; fsdp2: the same without empty_cache();
  deepspeed_ec DeepSpeed ZeRO stage 3 (0.19.8; bf16, no offload, torch's AdamW so that no
         DeepSpeed op is built) over the same decoder of 8 layers, 60 steps, empty_cache()
         every step; deepspeed: without. Skipped, with the reason, when deepspeed cannot be
         imported: scripts/bench-deps.sh brings it to a machine without internet;
  prefetch one process, two threads: a data thread makes batches on the CPU in pinned memory
         (the small GPT's tokens, in train_ec's varying shapes, and 32 MiB of other data) and
         moves each to the GPU on a stream of its own (non-blocking copies, an event per
         batch, at most 2 waiting), while the trainer waits on each batch's event, checks its
         checksums on the GPU against the CPU's, trains and calls torch.cuda.empty_cache()
         every step (150 steps). A checksum mismatch or a CUDA error fails the run (error in
         the results; mismatches and batches_checked in the summary);
  refit  weight refit over CUDA IPC (vLLM-style weight sync): the trainer holds 8 GiB of bf16
         weights in 246 tensors of 8-64 MiB, bumps one value each step and sends all 246
         (torch.multiprocessing's pickling: CUDA IPC handles, over a pipe) to a worker process
         that opens them, copies them into its own tensors, drops them and sends back the
         bumped value (checked); the step is the round, and each round's parts are timed
         (refit_parts_median_ms: share, open, copy, close). The worker runs in the trainer's
         environment (under expseg when the mode is); refit_plain: the worker runs without
         LD_PRELOAD (a plain consumer). Not in the default list (--workloads refit refit_plain);
  handoff two processes on the whole card (no filler): a trainer takes 80 % of the free memory,
         frees it, empties its cache and writes one line to a pipe; a second process reads
         the line and at once asks for 70 % of the free memory (one torch.empty).
         --handoff-rounds (else --rounds, else 20) rounds per pair of trainer mode and
         consumer (plain PyTorch, or under expseg); the
         trainer also as a plain CUDA program (shim-tests/handoff_fill.cu, the cudaMalloc
         path; built with nvcc when missing). Not in the default list (--workloads handoff).
Modes: default, expandable (expandable_segments:True), expandable_256 (the same with
large_segment_size_mb:256), max_split (max_split_size_mb:64, not run unless asked), noec (not
run unless asked: the default allocator with torch.cuda.empty_cache() a no-op, the floor of
the workloads that empty the cache), floor-now and floor-late (not run unless asked: noec plus,
at each empty_cache(), the bytes the step needed beyond what stays allocated given back to the
driver and made again as one handle, right away or after the next forward pass (floor-late:
gpt2_ec and the small-GPT workloads only): the driver's floor under the contract, see
DriverFloor), expseg
(scripts/expseg-run, the launch path), expseg-preload (LD_PRELOAD alone, which applies
expandable_segments:True itself when nothing is set) and expseg-release0 (the same with
EXPSEG_RELEASE_DELAY=0: released pages go back to the driver at once, no reuse); not run unless
asked: expseg-keep200 (EXPSEG_RELEASE_DELAY=200: released handles kept through 200 ms of quiet). Under expseg PyTorch's pages are
coalesced.

Rounds: --rounds N (default 1; --repeat N is its older name) runs every mode of a workload
once per round, the order of the modes rotated by one each round (round r starts at mode
r mod len), so that drift of the machine falls on every mode alike. A mode's step time is the
median of its runs' medians (each kept); per round, each mode's median and its ratios to the
default and expandable runs of the same round, and whether its losses equal those of the first
default run. Every run is a fresh process (a fresh torchrun for two ranks), so start-up weighs
as much as the steps: plan on roughly 15-25 s a run of a two-rank workload (deepspeed the
slowest) and 10-20 s of the others, times modes times rounds.

Stranded bytes: every expseg mode writes its exit reports (EXPSEG_REPORT, one table and one
JSON per process) to DIR/reports (or --reports DIR), named WORKLOAD_MODE_ROUND_rank%r-pid%p.txt;
from the JSON each run records coalesce_peak_stranded_bytes and, where the library writes them,
coalesce_peak_beyond_bytes (stranded plus bytes grown ahead) and coalesce_peak_held_bytes
(physical bytes behind PyTorch's pages), with stranded/held: those of the process that ran the
steps (rank 0), and the max over every process that wrote one (both ranks; rl's inference
worker too). A mode's figures are the peaks over its rounds. Each run also records expseg's own
work per hook call (own_us_per_hook_call: the report's hook time less its coalescers' driver
time, over the hook calls; one entry a run).

Prints a table (completed steps or OOM, peak device memory, peak reserved, median step time,
ratios to expandable_segments and default; with rounds or reports a second one: per-round
ratios' mean and 95 % interval, peak stranded bytes and their share of peak held), writes
results.json (each run as it ends: a run cut short keeps what it did) and memory.png to DIR,
and with --json a summary (device, driver, date, commit; per workload and mode: steps, median
ms, run medians, peak reserved and device GiB, losses_identical_to_default; vs_default,
vs_expandable and vs_alt (against expseg-alt) each _per_round, _mean and _ci95 (Student t, mean +- t(0.975, n-1) s/sqrt(n);
null with one round); peak_stranded_bytes, peak_beyond_bytes, peak_held_bytes,
stranded_of_held and each _max_over_ranks; --append adds to the file of an earlier run of the
same commit on the same device). Diagnosis: --steps N runs N steps instead of the workload's
own count, --alt-lib PATH runs a second build as mode expseg-alt (LD_PRELOAD alone), --cpus
LIST pins every worker to those CPUs. Steps of a few ms (moe) are launch-bound and vary by up
to 40 % between processes and over time within one, pinned or not (H100, 2026-11-23: the
machine has a fast and a slow state, whatever the allocator;
scripts/vmm-cost/torch_bookkeeping.py): compare them with --steps 300 --rounds 5 or more.
--selftest checks the orchestrator on the CPU (no GPU, no torch needed).
"""
import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

GIB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = {  # name: (budget GiB, steps)
    "frag": (24, 5),
    "moe": (24, 30),
    "churn": (56, 20),
    "train": (24, 300),
    "train_ec": (24, 120),
    "gpt2_ec": (40, 40),
    "rl": (40, 30),
    "ddp": (0, 120),
    "ddp_ec": (0, 120),
    "fsdp2": (0, 60),
    "fsdp2_ec": (0, 60),
    "deepspeed": (0, 60),
    "deepspeed_ec": (0, 60),
    "prefetch": (24, 150),
    "refit": (40, 20),
    "refit_plain": (40, 20),
}
# Workloads not run unless named.
NOT_DEFAULT = ("refit", "refit_plain")
# The refit workloads' tensors: 246 of 8-64 MiB (8.0 GiB of bf16), as a model's weights.
REFIT_MIB = [(8, 16, 32, 48, 64, 32)[i % 6] for i in range(246)]
REFIT_PARTS = ("share", "open", "copy", "close")
# Workloads of two ranks: torchrun, one GPU a rank, NCCL; rank 0's figures.
TWO_RANK = ("ddp", "ddp_ec", "fsdp2", "fsdp2_ec", "deepspeed", "deepspeed_ec")
# The prefetch workload's batches: besides the tokens, this many bytes of other data (images,
# features) that travel with each batch and are checked, not used.
PAYLOAD = 32 << 20
# Trainer modes of the handoff workload: PyTorch ones (mode_env), and a plain CUDA program.
HANDOFF_MODES = [
    "default", "expandable", "expseg", "expseg-preload", "expseg-keep",
    "expseg-cudamalloc", "expseg-cudamalloc-keep", "c-native", "c-expseg", "c-expseg-keep",
]
ALT_LIB = [None]  # --alt-lib: a second library, as mode expseg-alt (LD_PRELOAD alone)
MODES = ["default", "expandable", "expandable_256", "expseg", "expseg-preload", "expseg-release0"]
# Every mode mode_env knows (a name it does not know would run as the default allocator).
KNOWN_MODES = set(MODES) | set(HANDOFF_MODES) | {
    "noec", "floor-now", "floor-late", "max_split", "expseg-keep200", "expseg-alt", "expseg-noahead", "expseg-nolearn",
    "expseg-tail", "expseg-tail-noahead", "expseg-compact", "expseg-keepoff", "expseg-keepauto",
    "expseg-keepauto-unbounded", "expseg-keepauto-60",
}


def mode_env(mode, lib):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPSEG_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))}
    env.pop("LD_PRELOAD", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    cmd = []
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif mode == "expandable_256":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True,large_segment_size_mb:256"
    elif mode == "noec":
        # The floor: the default allocator with torch.cuda.empty_cache() a no-op, so nothing
        # is given back and nothing made again; no allocator that gives memory back is faster.
        env["BENCH_NO_EC"] = "1"
    elif mode in ("floor-now", "floor-late"):
        env["BENCH_NO_EC"] = "1"
        env["BENCH_FLOOR"] = mode.split("-")[1]
    elif mode == "max_split":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:64"
    elif mode == "expseg-preload":
        env["LD_PRELOAD"] = lib
    elif mode in ("expseg-keep", "c-expseg-keep"):
        # Opt-in keeping: released handles kept through 2 ms of quiet, 1 GiB of freed
        # cudaMalloc memory cached per device (the defaults before issue 21).
        env["LD_PRELOAD"] = lib
        env["EXPSEG_RELEASE_DELAY"] = "2"
        env["EXPSEG_CACHE_MAX"] = "1G" if mode == "expseg-keep" else "64G"
    elif mode == "c-expseg":
        env["LD_PRELOAD"] = lib
    elif mode in ("expseg-cudamalloc", "expseg-cudamalloc-keep"):
        # PyTorch's own caching allocator (cudaMalloc segments) under expseg's pool.
        env["LD_PRELOAD"] = lib
        env["EXPSEG_TORCH_DEFAULTS"] = "0"
        if mode.endswith("-keep"):
            env["EXPSEG_CACHE_MAX"] = "64G"
    elif mode == "expseg-keep200":
        env["LD_PRELOAD"] = lib
        env["EXPSEG_RELEASE_DELAY"] = "200"
    elif mode == "expseg-alt":
        env["LD_PRELOAD"] = ALT_LIB[0]
    elif mode == "expseg-release0":
        env["LD_PRELOAD"] = lib
        env["EXPSEG_RELEASE_DELAY"] = "0"
    elif mode.startswith("expseg-keepauto"):
        # Opt-in: released memory kept while only expseg processes share the GPU
        # (EXPSEG_KEEP=auto: api::keep); run with --fill-expseg so the filler is one of them.
        # -unbounded: what is kept has no bound on its give-back (EXPSEG_KEEP_GIVEBACK=0);
        # -60: a bound of 60 ms instead of the default 40.
        env["LD_PRELOAD"] = lib
        env["EXPSEG_KEEP"] = "auto"
        bound = {"expseg-keepauto-unbounded": "0", "expseg-keepauto-60": "60"}.get(mode)
        if bound:
            env["EXPSEG_KEEP_GIVEBACK"] = bound
    elif mode == "expseg-keepoff":
        # Released memory always back at once (EXPSEG_KEEP=off), even where only expseg
        # processes share the GPU (the default keeps it there: api::keep).
        env["LD_PRELOAD"] = lib
        env["EXPSEG_KEEP"] = "off"
    elif mode in ("expseg-tail", "expseg-tail-noahead"):
        # The last page of each batch alone (EXPSEG_SPLIT_TAIL=1), with or without growing ahead.
        env["LD_PRELOAD"] = lib
        env["EXPSEG_SPLIT_TAIL"] = "1"
        if mode.endswith("noahead"):
            env["EXPSEG_GROW_AHEAD"] = "0"
    elif mode == "expseg-compact":
        # Opt-in: live pages move to give stranded bytes back (EXPSEG_COMPACT=1).
        env["LD_PRELOAD"] = lib
        env["EXPSEG_COMPACT"] = "1"
    elif mode == "expseg-nolearn":
        # Without learned placement (EXPSEG_LEARN_CUTS=0): one handle a batch from the first use.
        env["LD_PRELOAD"] = lib
        env["EXPSEG_LEARN_CUTS"] = "0"
    elif mode == "expseg-noahead":
        # Without growing ahead (EXPSEG_GROW_AHEAD=0): a handle per batch of new pages.
        env["LD_PRELOAD"] = lib
        env["EXPSEG_GROW_AHEAD"] = "0"
    elif mode == "expseg":
        env["EXPSEG_LIB"] = lib
        env["EXPSEG_REPORT"] = "none"
        cmd = [os.path.join(HERE, "expseg-run")]
    # BENCH_EXPSEG_ENV="EXPSEG_X=1 EXPSEG_Y=2": more settings for every expseg mode but expseg-alt (a policy
    # to measure, EXPSEG_TEST_TRACE to record the coalescer's calls), applied after the mode's.
    if (mode.startswith("expseg") and mode != "expseg-alt") or mode == "c-expseg":
        for kv in os.environ.get("BENCH_EXPSEG_ENV", "").split():
            k, _, v = kv.partition("=")
            env[k] = v
    # Timing (two clock reads a call; scripts/vmm-cost/profile.c): BENCH_PROF_LIB=libprof.so
    # times the allocation calls and the waits for the device of the default allocator and of
    # expandable segments (cudaMalloc/cudaFree; PyTorch's VMM calls); BENCH_PROF_SYNC_LIB (the
    # same built with -DSYNC_ONLY) the waits alone of every mode that preloads expseg, put
    # before it (expseg's own report times its hooks).
    if mode in ("default", "expandable") and os.environ.get("BENCH_PROF_LIB"):
        env["LD_PRELOAD"] = os.environ["BENCH_PROF_LIB"]
    elif (env.get("LD_PRELOAD") or cmd) and os.environ.get("BENCH_PROF_SYNC_LIB"):
        # (expseg-run puts libexpseg.so first; expseg defines no synchronize call, so the
        # order does not matter.)
        env["LD_PRELOAD"] = ":".join(filter(None, [os.environ["BENCH_PROF_SYNC_LIB"], env.get("LD_PRELOAD")]))
    return env, cmd


# ---------------------------------------------------------------- the worker side


def device_used():
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("BENCH_NVML_INDEX", "0")))
    return pynvml.nvmlDeviceGetMemoryInfo(h).used


def cpu_list(text):
    """ "4-7,9" -> {4, 5, 6, 7, 9}"""
    out = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


class DriverFloor:
    """Modes floor-now and floor-late: the driver's floor for a workload that empties the cache
    every step, under the contract (every byte given back is back in the driver when the call
    returns). The default allocator keeps its cache (noec), and at each empty_cache() the bytes
    the step needed beyond what stays allocated (its peak of allocated bytes minus the bytes
    allocated at that call, rounded up to the 2 MiB granularity: the least any allocator that
    gives everything back must make again) are given back to the driver as one handle (unmap,
    release) and made again as one (create, map, set access): the fewest driver calls any
    allocator that gives that memory back and makes it again can make. floor-now makes it
    right after the release (the next step's first pages), floor-late after the next step's
    forward pass (the driver
    has had the forward's time to make released memory ready; gpt2_ec and the small-GPT
    workloads mark that point). The step time is the floor's; the driver calls' own times go
    into the result as floor_ms (per call, medians over steps) and floor_gib."""

    def __init__(self, when):
        import ctypes

        import torch

        self.when, self.ct, self.torch = when, ctypes, torch
        self.cu = ctypes.CDLL("libcuda.so.1")
        dev = ctypes.c_int()
        self.ck(self.cu.cuCtxGetDevice(ctypes.byref(dev)))
        self.dev = dev.value
        # CUmemAllocationProp: pinned (1), no shareable handle, location device (1) dev.
        self.prop = (ctypes.c_int * 8)(1, 0, 1, self.dev, 0, 0, 0, 0)
        self.desc = (ctypes.c_int * 3)(1, self.dev, 3)  # device dev, read and write
        self.span = 64 * GIB
        self.va = ctypes.c_uint64()
        self.ck(self.cu.cuMemAddressReserve(ctypes.byref(self.va), ctypes.c_size_t(self.span), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)))
        self.handle, self.size, self.want = None, 0, 0
        self.times = {k: [] for k in ("unmap", "release", "create", "map", "access")}
        self.sizes = []
        self.max_reserved = 0

    def ck(self, r):
        if r != 0:
            raise RuntimeError(f"driver floor: CUresult {r}")

    def timed(self, name, f):
        t0 = time.perf_counter()
        self.ck(f())
        self.times[name].append((time.perf_counter() - t0) * 1e3)

    def give_back(self):
        ct, cu = self.ct, self.cu
        if self.handle is not None:
            self.timed("unmap", lambda: cu.cuMemUnmap(ct.c_uint64(self.va.value), ct.c_size_t(self.size)))
            self.timed("release", lambda: cu.cuMemRelease(ct.c_uint64(self.handle)))
            self.handle = None
        # What the step needed beyond what stays allocated: the least any allocator that gives
        # everything back at empty_cache() must make again next step.
        gran = 2 << 20
        cuda = self.torch.cuda
        need = cuda.max_memory_allocated() - cuda.memory_allocated()
        self.max_reserved = max(self.max_reserved, cuda.max_memory_reserved())
        cuda.reset_peak_memory_stats()
        self.want = min(self.span, (need + gran - 1) // gran * gran)
        self.sizes.append(self.want)

    def make(self):
        ct, cu = self.ct, self.cu
        if self.handle is not None or not self.want:
            return
        h = ct.c_uint64()
        size = self.want
        self.timed("create", lambda: cu.cuMemCreate(ct.byref(h), ct.c_size_t(size), ct.byref(self.prop), ct.c_uint64(0)))
        self.timed("map", lambda: cu.cuMemMap(ct.c_uint64(self.va.value), ct.c_size_t(size), ct.c_size_t(0), h, ct.c_uint64(0)))
        self.timed("access", lambda: cu.cuMemSetAccess(ct.c_uint64(self.va.value), ct.c_size_t(size), ct.byref(self.desc), ct.c_size_t(1)))
        self.handle, self.size = h.value, size

    def empty_cache(self):
        self.give_back()
        if self.when == "now":
            self.make()

    def point(self):
        """The next step's forward pass has been launched."""
        if self.when == "late":
            self.make()

    def result(self):
        med = statistics.median
        return {k: round(med(v), 3) for k, v in self.times.items() if v}, round(med(self.sizes) / GIB, 3) if self.sizes else 0


FLOOR = [None]


def no_ec():
    """Mode noec: torch.cuda.empty_cache() does nothing in this process (floor modes: it gives
    back and makes again as DriverFloor says)."""
    if os.environ.get("BENCH_NO_EC"):
        import torch

        torch.cuda.empty_cache = lambda: None
        if os.environ.get("BENCH_FLOOR"):

            def floor_ec():
                # Made at the first call, on the device the workload has chosen by then.
                if FLOOR[0] is None:
                    FLOOR[0] = DriverFloor(os.environ["BENCH_FLOOR"])
                FLOOR[0].empty_cache()

            torch.cuda.empty_cache = floor_ec


def floor_point():
    if FLOOR[0]:
        FLOOR[0].point()


def worker(name):
    if os.environ.get("BENCH_FAKE"):
        return fake_worker(name)
    if os.environ.get("BENCH_CPUS"):
        os.sched_setaffinity(0, cpu_list(os.environ["BENCH_CPUS"]))
    import pynvml
    import random

    import torch

    pynvml.nvmlInit()
    no_ec()
    budget, steps = WORKLOADS[name]
    if os.environ.get("BENCH_FLOOR") == "late" and name not in ("train_ec", "ddp_ec", "gpt2_ec"):
        raise SystemExit(f"floor-late: {name} marks no point after its forward pass")
    steps = int(os.environ.get("BENCH_STEPS") or steps)
    B = budget * GIB
    if name in TWO_RANK:
        import torch.distributed as dist

        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        os.environ["BENCH_NVML_INDEX"] = str(local)
        dist.init_process_group("nccl")
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    base_used = device_used()
    rng = random.Random(1234)
    u8 = torch.uint8
    res = {"steps": 0, "oom": None, "step_ms": [], "mem": [], "losses": [], "pid": os.getpid()}
    state = {}
    if name in ("train", "train_ec", "ddp", "ddp_ec"):
        torch.manual_seed(0)
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        sys.path.insert(0, os.path.join(HERE, "..", "shim-tests"))
        from gpt import gpt

        vocab = 8192
        model = gpt(dim=512, layers=6, vocab=vocab, heads=8, positions=2048)
        model = model.cuda()
        gen = torch.Generator().manual_seed(1)
        if name in ("ddp", "ddp_ec"):
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
            gen.manual_seed(1 + dist.get_rank())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    if name in ("fsdp2", "fsdp2_ec", "deepspeed", "deepspeed_ec"):
        # A GPT-2-sized decoder (dim 768, 12 heads, GPT-2's vocabulary; 12 layers under FSDP2,
        # 8 under DeepSpeed), built alike on both ranks, sharded by the framework, AdamW.
        torch.manual_seed(0)
        # warn_only: the frameworks' own kernels need not all have deterministic forms.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        sys.path.insert(0, os.path.join(HERE, "..", "shim-tests"))
        from gpt import gpt

        vocab = 50257
        model = gpt(dim=768, layers=12 if name.startswith("fsdp2") else 8, vocab=vocab, heads=12, positions=1024).cuda()
        gen = torch.Generator().manual_seed(1 + dist.get_rank())
        if name.startswith("fsdp2"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            import logging

            import deepspeed

            deepspeed.utils.logger.setLevel(logging.WARNING)
            # ZeRO stage 3, bf16, no offload; torch's AdamW, so that no DeepSpeed op is built
            # (installed with DS_BUILD_OPS=0).
            config = {
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 1,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 1 << 30,
                "wall_clock_breakdown": False,
            }
            model, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
    if name == "prefetch":
        torch.manual_seed(0)
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        sys.path.insert(0, os.path.join(HERE, "..", "shim-tests"))
        from gpt import gpt

        vocab = 8192
        model = gpt(dim=512, layers=6, vocab=vocab, heads=8, positions=2048).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        state["queue"] = start_prefetch(steps, vocab)
        res["batches_checked"], res["mismatches"] = 0, 0
    if name == "gpt2_ec":
        torch.manual_seed(0)
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config()).cuda()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1)
    if name in ("refit", "refit_plain"):
        import torch.multiprocessing as mp

        state["ws"] = [torch.ones(m << 19, dtype=torch.bfloat16, device="cuda") for m in REFIT_MIB]
        ctx = mp.get_context("spawn")
        # A pipe, pickled by hand on both sides, so that a round's parts are timed apart:
        # sharing (the trainer's pickling: IPC handles), opening (the worker's unpickling),
        # copying, closing (dropping the opened tensors).
        state["conn"], theirs = ctx.Pipe()
        # A plain worker: started without the library (spawn's child takes this environment).
        saved = os.environ.pop("LD_PRELOAD", None) if name == "refit_plain" else None
        try:
            state["proc"] = ctx.Process(target=refit_worker, args=(theirs,))
            state["proc"].start()
        finally:
            if saved is not None:
                os.environ["LD_PRELOAD"] = saved
        assert state["conn"].poll(300) and state["conn"].recv() == "ready"
        res["refit_mismatches"] = 0
        res["refit_parts_ms"] = {k: [] for k in REFIT_PARTS}
    if name == "rl":
        torch.manual_seed(0)
        sys.path.insert(0, os.path.join(HERE, "..", "shim-tests"))
        from gpt import gpt

        import torch.multiprocessing as mp

        vocab = 8192
        model = gpt(dim=1024, layers=8, vocab=vocab, heads=16, positions=1024).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1)
        ctx = mp.get_context("spawn")
        state["q_in"], state["q_out"] = ctx.Queue(), ctx.Queue()
        state["proc"] = ctx.Process(target=rl_worker, args=(state["q_in"], state["q_out"]))
        state["proc"].start()
        assert state["q_out"].get(timeout=300) == "ready"

    def step(i):
        if name == "frag":
            big = torch.empty(int(0.55 * B), dtype=u8, device="cuda")
            big[:: 1 << 20].fill_(1)
            del big
            keep = []
            for j in range(40):
                t = torch.empty(int(rng.uniform(0.004, 0.02) * B), dtype=u8, device="cuda")
                t[:: 1 << 20].fill_(2)
                if j % 4 == 0:
                    keep.append(t)
            state["keep"] = keep  # the previous step's keepers go now
        elif name == "moe":
            experts = 32
            loads = [rng.random() ** 3 for _ in range(experts)]
            total = sum(loads)
            acts = []
            for layer in range(4):
                for e in range(experts):
                    n = int(0.5 * B / 4 * loads[e] / total) // 2 * 2 + 4096
                    a = torch.empty(n, dtype=u8, device="cuda")
                    a[:: 1 << 20].fill_(3)
                    acts.append(a)
                if layer % 2 == 1:
                    acts = acts[len(acts) // 2 :]  # half the activations live on
            state["kept"] = acts[: experts // 4]
        elif name == "churn":
            ts, total = [], 0
            while total < 48 * GIB:
                n = int(rng.uniform(0.05, 0.6) * GIB)
                t = torch.empty(n, dtype=u8, device="cuda")
                if len(ts) % 3 == 0:
                    t.fill_(4)
                ts.append(t)
                total += n
            del ts
            torch.cuda.empty_cache()
        elif name in ("train", "train_ec", "ddp", "ddp_ec"):
            batch, seq = 16 + 8 * (i % 3), 256 + 128 * (i % 4)
            data = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to("cuda")
            logits = model(data[:, :-1])
            floor_point()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            res["losses"].append(loss.item())
            if name in ("train_ec", "ddp_ec"):
                torch.cuda.empty_cache()
        elif name in ("fsdp2", "fsdp2_ec", "deepspeed", "deepspeed_ec"):
            seq = 512 + 128 * (i % 5)
            data = torch.randint(0, vocab, (8, seq + 1), generator=gen).to("cuda")
            logits = model(data[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), data[:, 1:].reshape(-1))
            del logits
            if name.startswith("deepspeed"):
                model.backward(loss)  # the engine: backward, then its ZeRO-3 step
                model.step()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            res["losses"].append(loss.item())
            if name.endswith("_ec"):
                torch.cuda.empty_cache()
        elif name == "prefetch":
            # The batch the data thread moved on its own stream: wait for its copies on this
            # stream (the event), keep its memory from going back to the data thread's stream
            # while this one may still use it (record_stream), check it against the CPU's sums.
            item = state["queue"].get(timeout=300)
            if isinstance(item, BaseException):
                raise item
            tokens, payload, event, sums, _pinned = item
            main = torch.cuda.current_stream()
            main.wait_event(event)
            tokens.record_stream(main)
            payload.record_stream(main)
            got = batch_sums(tokens, payload)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            res["losses"].append(loss.item())
            res["batches_checked"] += 1
            res["mismatches"] += not torch.equal(got.cpu(), sums)
            del logits, loss
            torch.cuda.empty_cache()  # while the data thread copies the next batches
        elif name == "gpt2_ec":
            seq = 512 + 128 * (i % 5)
            data = torch.randint(0, 50257, (8, seq), generator=gen).to("cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=data, labels=data).loss
            floor_point()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            res["losses"].append(loss.item())
            torch.cuda.empty_cache()
        elif name == "rl":
            batch, seq = 8 + 4 * (i % 3), 512
            data = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to("cuda")
            logits = model(data[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            res["losses"].append(loss.item())
            del logits, loss
            torch.cuda.empty_cache()
            # Weight sync: one bf16 bucket, shared by CUDA IPC (torch.multiprocessing).
            with torch.no_grad():
                bucket = torch.cat([p.detach().reshape(-1).to(torch.bfloat16) for p in model.parameters()])
            torch.cuda.synchronize()
            state["q_in"].put(("weights", bucket))
            assert state["q_out"].get(timeout=300) == "loaded"
            del bucket
            state["q_in"].put(("rollout", i))
            assert state["q_out"].get(timeout=300) == "rolled"
            torch.cuda.empty_cache()

        elif name in ("refit", "refit_plain"):
            ws = state["ws"]
            with torch.no_grad():
                ws[i % len(ws)][-1] += 1  # the step's update (bf16 holds small integers exactly)
            want = ws[i % len(ws)][-1].item()
            from multiprocessing.reduction import ForkingPickler

            t0 = time.perf_counter()
            msg = ForkingPickler.dumps(("weights", (i % len(ws), ws)))
            share_ms = (time.perf_counter() - t0) * 1e3
            state["conn"].send_bytes(msg)
            assert state["conn"].poll(300)
            what, got, parts = state["conn"].recv()
            if what != "loaded" or got != want:
                res["refit_mismatches"] += 1
            for k, v in {"share": share_ms, **parts}.items():
                res["refit_parts_ms"][k].append(round(v, 3))

    # The device memory of the process, sampled every 2 ms by a thread: the true peak, not
    # just the step ends.
    import threading

    peak = {"v": 0, "run": True}

    def sample():
        while peak["run"]:
            peak["v"] = max(peak["v"], device_used() - base_used)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for i in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            res["step_ms"].append((time.perf_counter() - t0) * 1e3)
            res["mem"].append((device_used() - base_used, torch.cuda.memory_reserved()))
            res["steps"] = i + 1
    except torch.OutOfMemoryError as e:
        res["oom"] = str(e).split("\n")[0][:200]
    except Exception as e:
        if name != "prefetch":
            raise
        # A CUDA error (an illegal memory access) or the data thread's failure: a failure of
        # the run, recorded as such.
        res["error"] = f"step {res['steps']}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    if res.get("refit_mismatches"):
        res["error"] = f"{res['refit_mismatches']} of {res['steps']} refits did not carry the trainer's update"
    if name == "prefetch" and res["mismatches"] and not res.get("error"):
        res["error"] = f"{res['mismatches']} of {res['batches_checked']} batches differ from their CPU checksums"
    peak["run"] = False
    sampler.join()
    if name == "rl":
        state["q_in"].put(("stop", 0))
    if name in ("refit", "refit_plain"):
        state["conn"].send(("stop", 0))
    if name in ("rl", "refit", "refit_plain"):
        state["proc"].join(timeout=60)
    if name in TWO_RANK:
        dist.barrier()
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    res["peak_device"] = max([peak["v"]] + [m[0] for m in res["mem"]])
    res["peak_reserved"] = torch.cuda.max_memory_reserved()
    res["median_step_ms"] = statistics.median(res["step_ms"][1:] or res["step_ms"] or [0])
    # The steady state alone (a diagnostic beside the median, never instead of it): steps of
    # the run's second half, after what an allocator learns in the first.
    res["median_2nd_half_ms"] = statistics.median(res["step_ms"][len(res["step_ms"]) // 2 :] or [0])
    if FLOOR[0]:
        res["floor_ms"], res["floor_gib"] = FLOOR[0].result()
        res["peak_reserved"] = max(res["peak_reserved"], FLOOR[0].max_reserved)
    print("RESULT " + json.dumps(res))


def batch_sums(tokens, payload):
    """Checksums of a prefetch batch, on the CPU or the GPU alike: sums of all and of every
    other token, of all and of every third byte of the payload (int64)."""
    import torch

    i64 = torch.int64
    return torch.stack([tokens.sum(dtype=i64), tokens[:, ::2].sum(dtype=i64), payload.sum(dtype=i64), payload[::3].sum(dtype=i64)])


def make_batch(i, vocab, gen, pool, pin=True):
    """Prefetch batch i on the CPU (pinned): tokens of train_ec's varying shapes, and PAYLOAD
    bytes that differ from batch to batch (the pool rotated and shifted)."""
    import torch

    batch, seq = 16 + 8 * (i % 3), 256 + 128 * (i % 4)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    payload = torch.empty(len(pool), dtype=torch.uint8, pin_memory=pin)
    k = (i * 4099) % len(pool)
    torch.add(pool[k:], i % 251, out=payload[: len(pool) - k])
    torch.add(pool[:k], i % 251, out=payload[len(pool) - k :])
    return (tokens.pin_memory() if pin else tokens), payload


def start_prefetch(n, vocab):
    """The prefetch workload's data thread: n batches made on the CPU in pinned memory, each
    moved to the GPU on a stream of the thread's own (non-blocking copies, an event recorded
    after them), at most 2 waiting in the queue it returns. An item: (tokens and payload on
    the GPU, the event, their CPU checksums, the pinned tensors), or the exception that
    stopped the thread."""
    import queue
    import threading

    import torch

    q = queue.Queue(maxsize=2)

    def run():
        try:
            stream = torch.cuda.Stream()
            gen = torch.Generator().manual_seed(1)
            pool = torch.randint(0, 256, (PAYLOAD,), dtype=torch.uint8, generator=gen)
            for i in range(n):
                tokens, payload = make_batch(i, vocab, gen, pool)
                sums = batch_sums(tokens, payload)
                with torch.cuda.stream(stream):
                    g_tokens = tokens.to("cuda", non_blocking=True)
                    g_payload = payload.to("cuda", non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                q.put((g_tokens, g_payload, event, sums, (tokens, payload)))
        except BaseException as e:  # handed to the trainer, which records it
            q.put(e)

    threading.Thread(target=run, daemon=True).start()
    return q


def handoff_trainer():
    """Each stdin line: take that many bytes, free them, empty the cache, signal the pipe."""
    import random

    import torch

    torch.zeros(1, device="cuda")
    out = os.fdopen(int(os.environ["HANDOFF_FD"]), "w")
    rng = random.Random(5)
    print("READY", flush=True)
    for line in sys.stdin:
        want, got, ts, ok = int(line), 0, [], True
        try:
            while got < want:
                n = min(int(rng.uniform(0.05, 0.6) * GIB), want - got)
                t = torch.empty(n, dtype=torch.uint8, device="cuda")
                t[:: 1 << 16].fill_(1)
                ts.append(t)
                got += n
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            ok = False
        ts = t = None
        torch.cuda.empty_cache()
        out.write("emptied\n")
        out.flush()
        print("EMPTIED" if ok else "FILLFAIL", flush=True)


def handoff_consumer():
    """Each stdin line: wait for the trainer's line on the pipe, then at once take that many
    bytes (one tensor), write them, give them back; print ROUND ok ms."""
    import torch

    torch.zeros(1, device="cuda")
    inp = os.fdopen(int(os.environ["HANDOFF_FD"]), "r")
    print("READY", flush=True)
    for line in sys.stdin:
        want = int(line)
        inp.readline()
        t0 = time.perf_counter()
        try:
            x = torch.empty(want, dtype=torch.uint8, device="cuda")
            x[:: 1 << 16].fill_(2)
            torch.cuda.synchronize()
            ok = 1
        except torch.OutOfMemoryError:
            ok = 0
        ms = (time.perf_counter() - t0) * 1e3
        x = None
        torch.cuda.empty_cache()
        print(f"ROUND {ok} {ms:.1f}", flush=True)


def c_trainer_binary():
    """shim-tests/handoff_fill.cu, built once next to this script's run (nvcc)."""
    src = os.path.join(HERE, "..", "shim-tests", "handoff_fill.cu")
    exe = os.path.join(os.environ.get("TMPDIR", "/tmp"), "expseg_handoff_fill")
    if not os.path.exists(exe):
        subprocess.run(["nvcc", "-O2", "-cudart", "shared", "-o", exe, src], check=True)
    return exe


def run_handoff(args, results):
    """Every trainer mode against a plain and an expseg consumer, --handoff-rounds (else
    --rounds, else 20) rounds each."""
    rounds = args.handoff_rounds or args.rounds or 20
    def readline_until(p, words):
        while True:
            l = p.stdout.readline()
            if not l:
                return None
            if l.split()[0:1] and l.split()[0] in words:
                return l.split()

    for m in args.handoff_modes:
        for consumer in ("plain", "expseg"):
            rfd, wfd = os.pipe()
            tenv, pre = mode_env(m if not m.startswith("c-") else ("default" if m == "c-native" else m), args.lib)
            tenv["HANDOFF_FD"] = str(wfd)
            cmd = [c_trainer_binary()] if m.startswith("c-") else [sys.executable, __file__, "--handoff-trainer"]
            cenv, _ = mode_env("expseg-preload" if consumer == "expseg" else "default", args.lib)
            cenv["HANDOFF_FD"] = str(rfd)
            t = subprocess.Popen(pre + cmd, env=tenv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(wfd,))
            c = subprocess.Popen([sys.executable, __file__, "--handoff-consumer"], env=cenv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(rfd,))
            os.close(rfd)
            os.close(wfd)
            r = {"ok": 0, "of": rounds, "fill_failed": 0, "consumer_ms": [], "error": ""}
            if readline_until(t, ("READY",)) is None or readline_until(c, ("READY",)) is None:
                r["error"] = "a process did not start"
            else:
                time.sleep(0.5)
                free = free_now()
                for i in range(rounds):
                    c.stdin.write(f"{int(0.70 * free)}\n")
                    c.stdin.flush()
                    t.stdin.write(f"{int(0.80 * free)}\n")
                    t.stdin.flush()
                    tl, cl = readline_until(t, ("EMPTIED", "FILLFAIL")), readline_until(c, ("ROUND",))
                    if tl is None or cl is None:
                        r["error"] = "a process died"
                        break
                    r["fill_failed"] += tl[0] == "FILLFAIL"
                    r["ok"] += int(cl[1])
                    r["consumer_ms"].append(float(cl[2]))
                    time.sleep(0.05)
            for p in (t, c):
                try:
                    p.stdin.close()
                    p.wait(timeout=30)
                except Exception:
                    p.kill()
            key = f"{m}+{consumer}"
            results.setdefault("handoff", {})[key] = r
            print(f"handoff {key:34} {r['ok']}/{r['of']} consumer got its memory; trainer fills failed {r['fill_failed']} {r['error']}", flush=True)
            json.dump(results, open(os.path.join(args.out, "results.json"), "w"))


def rl_worker(q_in, q_out):
    """The inference side of the rl workload: its own copy of the model, weights loaded from
    the trainer's bucket, a rollout that takes and frees a KV-cache-sized block set."""
    import torch

    no_ec()
    sys.path.insert(0, os.path.join(HERE, "..", "shim-tests"))
    from gpt import gpt

    model = gpt(dim=1024, layers=8, vocab=8192, heads=16, positions=1024).cuda().to(torch.bfloat16)
    q_out.put("ready")
    while True:
        what, arg = q_in.get()
        if what == "stop":
            return
        if what == "weights":
            with torch.no_grad():
                off = 0
                for p in model.parameters():
                    n = p.numel()
                    p.copy_(arg[off : off + n].view_as(p))
                    off += n
            torch.cuda.synchronize()
            del arg
            q_out.put("loaded")
        elif what == "rollout":
            blocks = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(192)]
            for b in blocks[::8]:
                b.fill_(1)
            with torch.no_grad():
                x = torch.randint(0, 8192, (16, 256), device="cuda")
                for _ in range(4):
                    model(x)
            torch.cuda.synchronize()
            del blocks
            torch.cuda.empty_cache()
            q_out.put("rolled")


def refit_worker(conn):
    """The inference side of the refit workloads: its own copy of the weights, loaded from the
    trainer's tensors over CUDA IPC each round; answers with the value the trainer bumped and
    the round's parts in ms (open: unpickling, which opens the IPC handles; copy; close:
    dropping the opened tensors, which closes them)."""
    import torch
    from multiprocessing.reduction import ForkingPickler

    mine = [torch.empty(m << 19, dtype=torch.bfloat16, device="cuda") for m in REFIT_MIB]
    conn.send("ready")
    while True:
        msg = conn.recv_bytes()
        t0 = time.perf_counter()
        what, arg = ForkingPickler.loads(msg)
        if what == "stop":
            return
        t1 = time.perf_counter()
        bumped, theirs = arg
        with torch.no_grad():
            for d, t in zip(mine, theirs):
                d.copy_(t)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        del theirs, arg
        t3 = time.perf_counter()
        parts = {"open": (t1 - t0) * 1e3, "copy": (t2 - t1) * 1e3, "close": (t3 - t2) * 1e3}
        conn.send(("loaded", mine[bumped][-1].item(), parts))


def filler(gib):
    import torch

    x = torch.empty(int(gib * GIB), dtype=torch.uint8, device="cuda")
    x[:: 1 << 20].fill_(9)
    torch.cuda.synchronize()
    print("FILLED", flush=True)
    sys.stdin.read()  # hold until the orchestrator closes our stdin


# ---------------------------------------------------------------- the orchestrator


def free_now():
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return pynvml.nvmlDeviceGetMemoryInfo(h).free


DEEPSPEED = {}


def deepspeed_missing():
    """Why `import deepspeed` fails in a worker's Python, or None when it works (asked once, in
    a process of its own: importing it here would start CUDA in the orchestrator)."""
    if "why" not in DEEPSPEED:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            DEEPSPEED["why"] = "not installed"
        else:
            p = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True, timeout=300)
            DEEPSPEED["why"] = (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:200] if p.returncode else None
    return DEEPSPEED["why"]


# t_{0.975, df} for df = 1..29: the half-width of a 95 % interval of a mean of n = df + 1
# rounds is T975[n - 2] * s / sqrt(n). Past n = 30 the last value stands (a little wide).
T975 = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
]


def mean_ci95(xs):
    """Mean of the rounds' values and its 95 % interval (Student t): mean +- t * s / sqrt(n);
    rounds with no value (a failed run) are left out; fewer than two values give no interval."""
    xs = [x for x in xs if x is not None]
    n = len(xs)
    if n == 0:
        return None, None
    m = sum(xs) / n
    if n < 2:
        return round(m, 4), None
    h = T975[min(n - 2, len(T975) - 1)] * statistics.stdev(xs) / n**0.5
    return round(m, 4), [round(m - h, 4), round(m + h, 4)]


def round_order(modes, r):
    """The modes of round r: the list rotated by r, so that round r starts at mode r mod len and
    drift of the machine falls on every mode alike."""
    k = r % len(modes)
    return modes[k:] + modes[:k]


def round_ratios(medians):
    """{mode: median ms or None} of one round -> {mode: (vs default, vs expandable)}: each mode
    against the default and expandable runs of the same round (None where one is missing)."""

    def ratio(a, b):
        return round(a / b, 4) if a and b else None

    d, e = medians.get("default"), medians.get("expandable")
    return {m: (ratio(v, d), ratio(v, e)) for m, v in medians.items()}


def alt_ratios(medians):
    """{mode: median ms or None} of one round -> {mode: against the expseg-alt run of the round}
    (the other library: the baseline an issue names), or {} without one."""
    a = medians.get("expseg-alt")
    return {m: round(v / a, 4) for m, v in medians.items() if v and a}


# Figures of the exit report (EXPSEG_REPORT's JSON, its "process" object; a library that
# gives them per device only is summed over its devices) -> the names the results use. Only
# the first is in every library; the other two are newer.
REPORT_KEYS = {
    "coalesce_peak_stranded_bytes": "peak_stranded_bytes",
    "coalesce_peak_beyond_bytes": "peak_beyond_bytes",  # stranded plus bytes grown ahead, peak
    "coalesce_peak_held_bytes": "peak_held_bytes",  # physical bytes behind PyTorch's pages, peak
}


def report_figures(rep):
    """One exit report (parsed JSON) -> its figures, or None for a process that coalesced
    nothing (torchrun's launcher, a library that predates the figures)."""
    proc, fig = rep.get("process", {}), {}
    for key, name in REPORT_KEYS.items():
        if key in proc:
            fig[name] = proc[key]
        elif any(key in d for d in rep.get("devices", [])):
            fig[name] = sum(d.get(key, 0) for d in rep["devices"])
    if "peak_stranded_bytes" not in fig:
        return None
    if fig.get("peak_held_bytes"):
        fig["stranded_of_held"] = round(fig["peak_stranded_bytes"] / fig["peak_held_bytes"], 5)
    own = own_us_per_call(proc)
    if own is not None:
        fig["own_us_per_call"] = own
    return fig


def own_us_per_call(proc):
    """expseg's own work per hook call of PyTorch's pages (the hooks' time less the coalescers'
    driver calls, `coalesce_*_ns`, over the hook calls), in microseconds; None without them."""
    calls = sum(proc.get(k.replace("_ns", "_calls"), 0) for k in VMM_NS)
    if not calls:
        return None
    hooks = sum(proc.get(k, 0) for k in VMM_NS)
    driver = sum(v for k, v in proc.items() if k.startswith("coalesce_") and k.endswith("_ns"))
    return round((hooks - driver) / calls / 1e3, 3)


def read_reports(folder, prefix, pid=None):
    """The exit reports of one run (folder/prefix*.json): the figures of the process that
    printed the result (its pid; else the one of rank 0), and of each, the max over every
    process that wrote one (`*_max_over_ranks`: both ranks of a 2-rank workload, rl's
    inference worker too). None when no report has them."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, glob.escape(prefix) + "*.json"))):
        try:
            rep = json.load(open(path))
        except (OSError, ValueError):
            continue
        fig = report_figures(rep)
        if fig:
            found.append((rep.get("pid"), str(rep.get("rank")), fig))
    if not found:
        return None
    mine = [f for p, _, f in found if pid is not None and p == pid] or [f for _, rank, f in found if rank == "0"]
    out = dict(mine[0] if mine else found[0][2])
    out["reports"] = len(found)
    for name in list(REPORT_KEYS.values()) + ["stranded_of_held"]:
        vals = [f[name] for _, _, f in found if name in f]
        if vals:
            out[name + "_max_over_ranks"] = max(vals)
    return out


# The allocation calls a process made, timed: an expseg report's VMM hooks (PyTorch's page calls
# through expseg, the coalescer's driver calls inside them) or profile.c's lines (BENCH_PROF_LIB).
VMM_NS = ["vmm_create_ns", "vmm_map_ns", "vmm_access_ns", "vmm_unmap_ns", "vmm_release_ns"]
PROF_CALLS = ["cudaMalloc", "cudaFree", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"]


def alloc_call_ms(folder, prefix, pid):
    """Milliseconds process pid spent in allocation calls during one run, or None."""
    rep = glob.glob(os.path.join(folder, glob.escape(prefix) + f"*pid{pid}.txt.json"))
    if rep:
        try:
            proc = json.load(open(rep[0])).get("process", {})
        except (OSError, ValueError):
            return None
        return round(sum(proc.get(k, 0) for k in VMM_NS) / 1e6, 3) if any(k in proc for k in VMM_NS) else None
    return prof_ms(folder, prefix, pid, PROF_CALLS)


SYNC_CALLS = ["cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"]


def prof_ms(folder, prefix, pid, calls):
    """Milliseconds process pid spent in `calls` by profile.c's lines, or None."""
    try:
        lines = open(os.path.join(folder, prefix + f"prof-{pid}.txt")).read().splitlines()
    except OSError:
        return None
    ms = []
    for line in lines:
        words = line.split()
        if not words or words[0] not in calls or words[-1] != "GiB":
            continue  # another call's line, or one cut short
        f = dict(re.findall(r"(\w+)=\s*([0-9.]+)", line))
        try:
            ms.append(float(f["total"]) - float(f.get("first", 0)))
        except (KeyError, ValueError):
            continue
    return round(sum(ms), 3) if ms else None


def per_run(prev, key, value):
    """The mode's list of `key`, one entry a run: the earlier rounds' (from prev) and value."""
    return (prev or {}).get(key, []) + [value]


def merge_max(a, b):
    """Two runs' report figures -> the larger of each (a mode's peak over its rounds)."""
    if not a or not b:
        return a or b
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b)}


def run_all(args):
    os.makedirs(args.out, exist_ok=True)
    results = {}
    ref_losses = {}  # workload: the losses of its first default run
    reports = os.path.abspath(args.reports or os.path.join(args.out, "reports"))
    for w in args.workloads:
        if w == "handoff":
            run_handoff(args, results)
            continue
        budget, _ = WORKLOADS[w]
        launch = []
        if w in TWO_RANK:
            import torch

            if torch.cuda.device_count() < 2:
                print(f"SKIP {w}: {torch.cuda.device_count()} GPU(s), it needs two", flush=True)
                continue
            launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        if w.startswith("deepspeed") and deepspeed_missing():
            print(f"SKIP {w}: deepspeed cannot be imported ({deepspeed_missing()}); scripts/bench-deps.sh --install DIR installs it", flush=True)
            continue
        # Hold everything but the budget (plus room for one CUDA context) in another process.
        fill = free_now() / GIB - budget - 0.75 if budget else 0
        fp = None
        if fill > 0:
            # --fill-expseg: the filler runs expseg too (every process on the GPU does: what
            # EXPSEG_KEEP=auto keeps released memory for); else it is a plain process.
            fenv = dict(os.environ, LD_PRELOAD=args.lib, EXPSEG_KEEP="auto") if args.fill_expseg else None
            fp = subprocess.Popen([sys.executable, __file__, "--fill", str(fill)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=fenv)
            fp.stdout.readline()
        # With --rounds N the modes run N times, interleaved (mode order rotated each round),
        # so that drift of the machine hits every mode alike; a mode's step time is then the
        # median of its runs' medians, and the runs' medians are kept, and each round's
        # ratios to the default and expandable runs of that round.
        for rep in range(args.rounds or args.repeat):
            medians, same, figs = {}, {}, {}
            for m in round_order(args.modes, rep):
                env, pre = mode_env(m, args.lib)
                if args.steps:
                    env["BENCH_STEPS"] = str(args.steps)
                if args.cpus:
                    env["BENCH_CPUS"] = args.cpus
                # Every expseg mode writes its exit reports (a table, and JSON beside it), one
                # per process: stranded bytes come from them.
                prefix = f"{w}_{m}_{rep}_"
                profs = [os.environ.get(k) for k in ("BENCH_PROF_LIB", "BENCH_PROF_SYNC_LIB")]
                profiled = any(p and p in env.get("LD_PRELOAD", "").split(":") for p in profs)
                if profiled:
                    os.makedirs(reports, exist_ok=True)
                    for old in glob.glob(os.path.join(reports, glob.escape(prefix) + "prof-*")):
                        os.remove(old)  # an earlier invocation's (profile.c appends)
                    env["PROF_OUT"] = os.path.join(reports, prefix + "prof-%p.txt")
                if m.startswith("expseg"):
                    os.makedirs(reports, exist_ok=True)
                    for old in glob.glob(os.path.join(reports, glob.escape(prefix) + "*")):
                        os.remove(old)  # an earlier invocation's, of the same name
                    env["EXPSEG_REPORT"] = os.path.join(reports, prefix + "rank%r-pid%p.txt")
                t0 = time.time()
                p = subprocess.run(pre + [sys.executable] + launch + [__file__, "--worker", w], env=env, capture_output=True, text=True, timeout=600)
                line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
                r = json.loads(line[-1][7:]) if line else {"steps": 0, "oom": None, "error": (p.stderr or p.stdout)[-400:]}
                r["wall_s"] = round(time.time() - t0, 1)
                fig = read_reports(reports, prefix, r.get("pid")) if m.startswith("expseg") else None
                prev = results.setdefault(w, {}).get(m)
                runs = (prev or {}).get("run_medians_ms", []) + [round(r.get("median_step_ms", 0), 3)]
                halves = (prev or {}).get("run_2nd_half_medians_ms", []) + [round(r.get("median_2nd_half_ms", 0), 3)]
                failed = bool(r.get("oom") or r.get("error"))
                medians[m] = None if failed else r.get("median_step_ms") or None
                if r.get("losses"):
                    if m == "default" and w not in ref_losses and not failed:
                        ref_losses[w] = r["losses"]
                    same[m] = r["losses"]
                pid = r.get("pid")
                steps = r.get("steps") or 0
                if prev and (prev.get("oom") or prev.get("error")):
                    r = prev  # a failed run stands for the mode
                r["run_medians_ms"] = runs
                r["run_2nd_half_medians_ms"] = halves
                # Allocation-call time a step of the printing process (expseg modes; default with
                # BENCH_PROF_LIB): process totals (setup included; each call's first, which may
                # make the context, left out) over the steps run; None where not timed, so that
                # the lists stay in line with run_medians_ms.
                call_ms = alloc_call_ms(reports, prefix, pid) if steps else None
                if profiled:
                    r["profiled"] = True
                r["alloc_call_ms_per_step"] = per_run(prev, "alloc_call_ms_per_step", call_ms and round(call_ms / steps, 3))
                # Waits for the device a step (cudaStream/Device/EventSynchronize), where timed.
                sync_ms = prof_ms(reports, prefix, pid, SYNC_CALLS) if profiled and steps else None
                r["sync_ms_per_step"] = per_run(prev, "sync_ms_per_step", sync_ms and round(sync_ms / steps, 3))
                # The refit workloads: each part's median a round (the first round left out), a
                # dict a run.
                parts = r.pop("refit_parts_ms", None)
                if parts is not None or prev and "refit_parts_median_ms" in prev:
                    med = {k: round(statistics.median(v[1:] or v), 3) for k, v in (parts or {}).items() if v}
                    r["refit_parts_median_ms"] = per_run(prev, "refit_parts_median_ms", med or None)
                # expseg's own work per hook call (the report's hooks less its driver calls), a
                # run each; the peaks below are figures of memory only.
                own = fig.pop("own_us_per_call", None) if fig else None
                if m.startswith("expseg"):
                    r["own_us_per_hook_call"] = per_run(prev, "own_us_per_hook_call", own)
                r["rounds"] = (prev or {}).get("rounds", [])
                r["stranded"] = merge_max((prev or {}).get("stranded"), fig)
                figs[m] = fig
                r["median_step_ms"] = statistics.median(runs)
                r["peak_device"] = max(r.get("peak_device", 0), (prev or {}).get("peak_device", 0))
                r["peak_reserved"] = max(r.get("peak_reserved", 0), (prev or {}).get("peak_reserved", 0))
                results[w][m] = r
                # This run's figures as they come, and the results so far on disk: a run cut
                # short by a time limit keeps what it measured.
                print(
                    f"{w:6} {m:11} steps {r['steps']:4} median {runs[-1]:.2f} ms peak {r['peak_device'] / GIB:.2f} GiB"
                    f" wall {r['wall_s']} s {'OOM' if r.get('oom') else ''} {r.get('error', '')[-300:]}"
                    + (f" floor {r['floor_gib']} GiB, driver ms {r['floor_ms']}" if r.get("floor_ms") else "")
                    + (f" alloc calls {r['alloc_call_ms_per_step'][-1]} ms/step" if call_ms is not None else "")
                    + (f" waits {r['sync_ms_per_step'][-1]} ms/step" if sync_ms is not None else "")
                    + (f" refit parts ms {r['refit_parts_median_ms'][-1]}" if r.get("refit_parts_median_ms") else "")
                    + (f" stranded peak {fig['peak_stranded_bytes'] / 2**20:.0f} MiB" if fig else "")
                    + (f" of held {fig['peak_held_bytes'] / 2**20:.0f} MiB ({100 * fig['stranded_of_held']:.2f} %)" if fig and fig.get("stranded_of_held") is not None else "")
                    + (f" own {own} us/hook call" if own is not None else ""),
                    flush=True,
                )
                json.dump(results, open(os.path.join(args.out, "results.json"), "w"))
            # The round is complete: each mode against the default and expandable runs of it.
            alt = alt_ratios(medians)
            for m, (vd, ve) in round_ratios(medians).items():
                entry = {"round": rep, "median_ms": medians[m] and round(medians[m], 3), "vs_default": vd, "vs_expandable": ve}
                if "expseg-alt" in medians:
                    entry["vs_alt"] = alt.get(m)
                if m in same and w in ref_losses:
                    entry["losses_identical_to_default"] = same[m] == ref_losses[w]
                if figs.get(m):
                    entry["report"] = figs[m]
                results[w][m]["rounds"].append(entry)
            json.dump(results, open(os.path.join(args.out, "results.json"), "w"))
        if fp:
            fp.stdin.close()
            fp.wait()
    table(results)
    plot(results, os.path.join(args.out, "memory.png"))
    if args.json:
        summary(results, args)


def summary(results, args):
    import datetime

    import pynvml
    import torch

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    def text(x):
        return x.decode() if isinstance(x, bytes) else x

    out = {
        "device": text(pynvml.nvmlDeviceGetName(h)),
        "driver": text(pynvml.nvmlSystemGetDriverVersion()),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "command": " ".join(sys.argv[1:]),
        "workloads": {},
    }
    if args.append and os.path.exists(args.json):
        prev = json.load(open(args.json))
        if (prev.get("device"), prev.get("commit")) == (out["device"], out["commit"]):
            out["workloads"] = prev.get("workloads", {})
            out["command"] = prev.get("command", "") + "; then " + " ".join(sys.argv[1:])
    out["workloads"].update(summarize(results))
    json.dump(out, open(args.json, "w"), indent=1)


def summarize(results):
    """The summary's figures of each workload and mode (--json's "workloads")."""
    out = {}
    for w, modes in results.items():
        if w == "handoff":
            out[w] = {k: {"ok": r["ok"], "of": r["of"], "fill_failed": r["fill_failed"], "error": r["error"]} for k, r in modes.items()}
            continue
        out[w] = {
            m: {
                "steps": r.get("steps", 0),
                "of": WORKLOADS[w][1],
                "oom": bool(r.get("oom")),
                "error": bool(r.get("error")),
                "median_ms": round(r.get("median_step_ms", 0), 2),
                "run_medians_ms": r.get("run_medians_ms", []),
                "run_2nd_half_medians_ms": r.get("run_2nd_half_medians_ms", []),
                "peak_reserved_gib": round(r.get("peak_reserved", 0) / GIB, 3),
                "peak_device_gib": round(r.get("peak_device", 0) / GIB, 3),
                **({"floor_driver_ms": r["floor_ms"], "floor_gib": r["floor_gib"]} if r.get("floor_ms") else {}),
                # Allocation-call time a step per run (expseg's VMM hooks; the default
                # allocator's cudaMalloc/cudaFree where it ran with BENCH_PROF_LIB, "profiled").
                **{k: r[k] for k in ("alloc_call_ms_per_step", "sync_ms_per_step") if any(x is not None for x in r.get(k, []))},
                **({"profiled": True} if r.get("profiled") else {}),
                # From the exit reports: peaks over the rounds, of rank 0 (the process that ran
                # the steps) and the max over every process that wrote one.
                **(r.get("stranded") or {}),
                **({"batches_checked": r["batches_checked"], "mismatches": r["mismatches"]} if "mismatches" in r else {}),
                **({"refit_mismatches": r["refit_mismatches"]} if "refit_mismatches" in r else {}),
                **({"refit_parts_median_ms": r["refit_parts_median_ms"]} if "refit_parts_median_ms" in r else {}),
            }
            for m, r in modes.items()
        }
        d = results[w].get("default", {}).get("losses")
        for m, r in modes.items():
            o = out[w][m]
            flags = [e["losses_identical_to_default"] for e in r.get("rounds", []) if "losses_identical_to_default" in e]
            if flags:  # every round's run against the first default run
                o["losses_identical_to_default"] = all(flags)
            elif d and r.get("losses"):
                o["losses_identical_to_default"] = r["losses"] == d
            # Per round: the ratio to the default and expandable runs of the same round; their
            # mean and 95 % interval (null with one round).
            for ref in ("default", "expandable", "alt"):
                per = [e.get(f"vs_{ref}") for e in r.get("rounds", [])]
                if any(x is not None for x in per):
                    o[f"vs_{ref}_per_round"] = per
                    o[f"vs_{ref}_mean"], o[f"vs_{ref}_ci95"] = mean_ci95(per)
    return out


def table(results):
    print("\n| workload | mode | steps | peak device GiB | peak reserved GiB | median step ms | device vs expandable | step vs expandable | step vs default |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for w, modes in results.items():
        if w == "handoff":
            continue
        ref, dflt = modes.get("expandable", {}), modes.get("default", {})
        for m, r in modes.items():
            steps = f"{r['steps']}/{WORKLOADS[w][1]}" + (" OOM" if r.get("oom") else "") + (" error" if r.get("error") else "")
            pd, pr, st = r.get("peak_device", 0) / GIB, r.get("peak_reserved", 0) / GIB, r.get("median_step_ms", 0)

            def ratio(a, b):
                return f"{a / b:.3f}" if a and b else "-"

            print(
                f"| {w} | {m} | {steps} | {pd:.2f} | {pr:.2f} | {st:.1f} | {ratio(r.get('peak_device', 0), ref.get('peak_device', 0))}"
                f" | {ratio(st, ref.get('median_step_ms', 0))} | {ratio(st, dflt.get('median_step_ms', 0))} |"
            )
    # Rounds: each mode's ratios to the default and expandable runs of the same round, their
    # mean and 95 % interval; stranded bytes from the exit reports (peak over the rounds).
    if any(len(r.get("rounds", [])) > 1 or r.get("stranded") for modes in results.values() for r in modes.values()):
        print("\n| workload | mode | rounds | vs default, mean [95 % interval] | vs expandable, mean [95 % interval] | vs expseg-alt, mean [95 % interval] | peak stranded MiB (max over ranks) | of peak held |")
        print("|---|---|---:|---|---|---|---:|---:|")
        for w, modes in results.items():
            if w == "handoff":
                continue
            for m, r in modes.items():

                def interval(ref):
                    mean, ci = mean_ci95([e.get(f"vs_{ref}") for e in r.get("rounds", [])])
                    return "-" if mean is None else f"{mean:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")

                st = r.get("stranded") or {}
                mib = lambda k: f"{st[k] / 2**20:.0f}" if k in st else "-"
                held = f"{100 * st['stranded_of_held']:.2f} %" if "stranded_of_held" in st else "-"
                print(f"| {w} | {m} | {len(r.get('rounds', []))} | {interval('default')} | {interval('expandable')} | {interval('alt')}"
                      f" | {mib('peak_stranded_bytes')} ({mib('peak_stranded_bytes_max_over_ranks')}) | {held} |")
    for w, modes in results.items():
        d = modes.get("default", {}).get("losses") if w != "handoff" else None
        for m, r in modes.items():
            flags = [e["losses_identical_to_default"] for e in r.get("rounds", []) if "losses_identical_to_default" in e]
            if flags:
                print(f"{w} losses, {m} vs default: {'identical' if all(flags) else 'DIFFERENT'} (identical in {sum(flags)} of {len(flags)} runs, {len(r.get('losses', []))} steps)")
            elif d and r.get("losses"):
                print(f"{w} losses, {m} vs default: {'identical' if r['losses'] == d else 'DIFFERENT'} ({len(r['losses'])} steps)")


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    results = {w: m for w, m in results.items() if w != "handoff"}
    if not results:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (w, modes) in zip(axes[0], results.items()):
        for m, r in modes.items():
            ax.plot([x[0] / GIB for x in r.get("mem", [])], label=m + (" (OOM)" if r.get("oom") else ""))
        ax.set_title(f"{w}: device memory of the process")
        ax.set_xlabel("step")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


# ---------------------------------------------------------------- the self-test (no GPU)


def fake_worker(name):
    """--selftest's stand-in for a worker: no CUDA; a step time by mode (expseg 90 ms,
    expandable 120, else 100, a few % of noise), losses (different under
    EXPSEG_RELEASE_DELAY=0), and for an expseg mode three exit reports as the library and
    torchrun would leave them: its own, a launcher's without coalescer figures, rank 1's."""
    import random

    pid, mine = os.getpid(), os.environ.get("EXPSEG_REPORT")
    base = 90.0 if mine else 120.0 if "expandable" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") else 100.0
    ms = base * (1 + random.random() / 20)
    losses = [2.0, 1.5, 1.25] if os.environ.get("EXPSEG_RELEASE_DELAY") != "0" else [2.0, 1.5, 1.3]
    if mine:
        figs = {"coalesce_peak_stranded_bytes": 3 << 20, "coalesce_peak_beyond_bytes": 5 << 20, "coalesce_peak_held_bytes": 300 << 20}
        for p, rank, process in ((pid, "0", figs), (1, "0", {"allocs": 0}), (2, "1", {k: 2 * v for k, v in figs.items()})):
            with open(mine.replace("%p", str(p)).replace("%r", rank) + ".json", "w") as f:
                json.dump({"pid": p, "rank": rank, "status": "pool never started", "process": process, "devices": [], "config": {}}, f)
    steps = int(os.environ["BENCH_FAKE"])
    print("RESULT " + json.dumps({"steps": steps, "oom": None, "step_ms": [ms] * steps, "mem": [], "losses": losses, "pid": pid,
                                  "median_step_ms": ms, "peak_device": GIB, "peak_reserved": GIB}))


def selftest():
    """CPU-only checks of the orchestrator (--selftest): the t interval, the rotation of modes,
    the per-round ratios, reading exit reports, and three rounds of four modes run end to end
    by fake workers (fake_worker). Prints 'N passed, N failed'; exits 1 on a failure."""
    import argparse
    import tempfile

    counts = [0, 0]

    def check(what, cond):
        counts[not cond] += 1
        if not cond:
            print(f"FAIL {what}", flush=True)

    # The interval: n = 5, s = sqrt(2.5), t(4) = 2.776: 3 +- 1.9629.
    check("interval of 1..5", mean_ci95([1, 2, 3, 4, 5]) == (3.0, [1.0371, 4.9629]))
    check("interval of two", mean_ci95([1.0, 3.0]) == (2.0, [-10.706, 14.706]))
    check("one round: no interval", mean_ci95([1.1]) == (1.1, None))
    check("failed rounds left out", mean_ci95([None, 2.0, None]) == (2.0, None))
    check("no rounds", mean_ci95([]) == (None, None))
    check("t table: df 1..29, falling", len(T975) == 29 and T975[0] == 12.706 and T975[-1] == 2.045 and T975 == sorted(T975, reverse=True))
    check("n over 30 takes df 29's t", mean_ci95([1.0, 2.0] * 20)[1] == [round(1.5 - 2.045 * statistics.stdev([1.0, 2.0] * 20) / 40**0.5, 4), round(1.5 + 2.045 * statistics.stdev([1.0, 2.0] * 20) / 40**0.5, 4)])
    # Rotation: round r starts at mode r mod len; over len rounds each mode takes each place once.
    modes = ["default", "expandable", "expseg-preload", "expseg-alt"]
    orders = [round_order(modes, r) for r in range(8)]
    check("round 0 is the order given", orders[0] == modes)
    check("round r starts at mode r mod len", [o[0] for o in orders] == modes + modes)
    check("each round runs every mode once", all(sorted(o) == sorted(modes) for o in orders))
    check("each mode in each place once in len rounds", all(len({o[k] for o in orders[:4]}) == 4 for k in range(4)))
    # Ratios within one round.
    rr = round_ratios({"default": 100.0, "expandable": 125.0, "expseg-preload": 110.0, "failed": None})
    check("ratios to default and expandable", rr["expseg-preload"] == (1.1, 0.88) and rr["default"] == (1.0, 0.8) and rr["expandable"] == (1.25, 1.0))
    check("a failed run has no ratio", rr["failed"] == (None, None))
    check("no expandable in the round", round_ratios({"default": 100.0, "x": 50.0})["x"] == (0.5, None))
    check("against the other library", alt_ratios({"expseg-alt": 100.0, "expseg-preload": 103.0, "failed": None}) == {"expseg-alt": 1.0, "expseg-preload": 1.03}
          and alt_ratios({"default": 1.0}) == {})
    # Exit reports.
    with tempfile.TemporaryDirectory() as d:
        def report(name, pid, rank, process, devices=()):
            with open(os.path.join(d, name), "w") as f:
                json.dump({"pid": pid, "rank": rank, "status": "", "process": process, "devices": list(devices), "config": {}}, f)

        new = {"coalesce_peak_stranded_bytes": 10, "coalesce_peak_beyond_bytes": 30, "coalesce_peak_held_bytes": 1000}
        report("w_m_0_rank0-pid7.txt.json", 7, "0", {"allocs": 1})  # torchrun's launcher
        report("w_m_0_rank0-pid8.txt.json", 8, "0", new)
        report("w_m_0_rank1-pid9.txt.json", 9, "1", {k: 3 * v for k, v in new.items()})
        report("w_m_1_rank0-pid10.txt.json", 10, "0", {"coalesce_peak_stranded_bytes": 99})  # another round
        report("w_m2_0_rank0-pid11.txt.json", 11, "0", {"coalesce_peak_stranded_bytes": 5})  # an older library
        report("w_m3_0_rank0-pid12.txt.json", 12, "0", {}, [{"device": 0, "coalesce_peak_stranded_bytes": 4, "coalesce_peak_held_bytes": 400}])
        with open(os.path.join(d, "w_m4_0_rank0-pid13.txt.json"), "w") as f:
            f.write('{"pid":13,')  # cut short
        fig = read_reports(d, "w_m_0_", pid=8)
        check("the stepping process's figures", fig and fig["peak_stranded_bytes"] == 10 and fig["peak_beyond_bytes"] == 30 and fig["peak_held_bytes"] == 1000 and fig["stranded_of_held"] == 0.01)
        check("max over ranks", fig and fig["peak_stranded_bytes_max_over_ranks"] == 30 and fig["peak_held_bytes_max_over_ranks"] == 3000 and fig["reports"] == 2)
        check("rank 0 without a pid", read_reports(d, "w_m_0_")["peak_stranded_bytes"] == 10)
        old = read_reports(d, "w_m2_0_", pid=11)
        check("an older library: stranded bytes alone", old == {"peak_stranded_bytes": 5, "reports": 1, "peak_stranded_bytes_max_over_ranks": 5})
        check("figures per device only", read_reports(d, "w_m3_0_")["stranded_of_held"] == 0.01)
        check("no report, or a broken one", read_reports(d, "w_m9_0_") is None and read_reports(d, "w_m4_0_") is None)
        proc = {"vmm_create_ns": 5000, "vmm_create_calls": 3, "vmm_access_ns": 9000, "vmm_access_calls": 1, "coalesce_create_ns": 4000, "coalesce_set_access_ns": 2000, "coalesce_create": 1}
        check("own work per hook call", own_us_per_call(proc) == 2.0 and own_us_per_call({"coalesce_create_ns": 5}) is None)
        check("merge over rounds", merge_max({"a": 1, "b": 5}, {"a": 3}) == {"a": 3, "b": 5} and merge_max(None, {"a": 1}) == {"a": 1})
        report("w_c_0_rank0-pid20.txt.json", 20, "0", {"vmm_create_ns": 2_000_000, "vmm_release_ns": 500_000, "allocs": 3})
        with open(os.path.join(d, "w_p_0_prof-21.txt"), "w") as f:
            f.write("cudaMalloc             n=       4 total=       3.5 ms mean=  875.00 us bytes=1.0 GiB\n"
                    "cudaFree               n=       4 total=       1.0 ms mean=  250.00 us bytes=0.0 GiB\n"
                    "cudaStreamSynchronize  n=       9 total=      50.0 ms mean= 5555.56 us bytes=0.0 GiB\n")
        check("waits for the device from profile.c's lines", prof_ms(d, "w_p_0_", 21, SYNC_CALLS) == 50.0 and prof_ms(d, "w_x_0_", 5, SYNC_CALLS) is None)
        with open(os.path.join(d, "w_f_0_prof-22.txt"), "w") as f:
            f.write("cudaMalloc             n=       4 total=     303.5 ms mean=75875.00 us first=   300.0 ms bytes=1.0 GiB\n"
                    "cudaFree               n=       4 total=       1")  # cut short
        check("a call's first left out, a line cut short skipped", prof_ms(d, "w_f_0_", 22, PROF_CALLS) == 3.5)
        check("allocation-call time: expseg report, profile.c lines (syncs not counted), none",
              alloc_call_ms(d, "w_c_0_", 20) == 2.5 and alloc_call_ms(d, "w_p_0_", 21) == 4.5
              and alloc_call_ms(d, "w_m_0_", 8) is None and alloc_call_ms(d, "w_x_0_", 5) is None)
    # Three rounds of four modes, end to end.
    with tempfile.TemporaryDirectory() as d:
        WORKLOADS["fake"] = (0, 3)
        os.environ["BENCH_FAKE"] = "3"  # steps
        args = argparse.Namespace(out=d, workloads=["fake"], modes=["default", "expandable", "expseg-preload", "expseg-release0"], rounds=3, repeat=1,
                                  steps=None, cpus=None, reports=None, json=None, lib=os.path.join(d, "libexpseg.so"))
        run_all(args)
        del os.environ["BENCH_FAKE"]
        res = json.load(open(os.path.join(d, "results.json")))["fake"]
        check("three rounds a mode", all(len(r["rounds"]) == 3 and len(r["run_medians_ms"]) == 3 for r in res.values()))
        for k in range(3):
            med = {m: r["rounds"][k]["median_ms"] for m, r in res.items()}
            check(f"round {k}: ratios of that round's runs", all(  # (medians kept to 3 decimals)
                abs(r["rounds"][k]["vs_default"] - med[m] / med["default"]) < 2e-4 and abs(r["rounds"][k]["vs_expandable"] - med[m] / med["expandable"]) < 2e-4
                for m, r in res.items()))
            check(f"round {k}: medians are the runs'", all(r["rounds"][k]["median_ms"] == r["run_medians_ms"][k] for r in res.values()))
        check("losses compared each round", [e["losses_identical_to_default"] for e in res["expseg-preload"]["rounds"]] == [True] * 3
              and [e["losses_identical_to_default"] for e in res["expseg-release0"]["rounds"]] == [False] * 3)
        check("reports of expseg modes only", all(("stranded" in r and r["stranded"] is not None) == m.startswith("expseg") for m, r in res.items()))
        st = res["expseg-preload"]["stranded"]
        check("stranded bytes per mode", st["peak_stranded_bytes"] == 3 << 20 and st["peak_stranded_bytes_max_over_ranks"] == 6 << 20 and st["stranded_of_held"] == 0.01)
        check("every round's report", all(e["report"]["peak_held_bytes"] == 300 << 20 for e in res["expseg-preload"]["rounds"]))
        sm = summarize({"fake": res})["fake"]
        check("summary: per-round ratios, mean, interval", all(len(o["vs_default_per_round"]) == 3 and len(o["vs_default_ci95"]) == 2 and len(o["vs_expandable_ci95"]) == 2 for o in sm.values()))
        check("summary: default against itself", sm["default"]["vs_default_mean"] == 1.0 and sm["default"]["vs_default_ci95"] == [1.0, 1.0])
        check("summary: expseg about 0.9 of default", 0.8 < sm["expseg-preload"]["vs_default_mean"] < 1.0)
        check("summary: losses", sm["expseg-preload"]["losses_identical_to_default"] is True and sm["expseg-release0"]["losses_identical_to_default"] is False)
        check("summary: stranded bytes", sm["expseg-preload"]["peak_held_bytes"] == 300 << 20 and "peak_stranded_bytes" not in sm["default"])
        del WORKLOADS["fake"]
    # The prefetch batches (CPU only), where torch is here.
    try:
        import torch
    except ImportError:
        print("prefetch batch checks skipped: no torch here", flush=True)
    else:
        gen = torch.Generator().manual_seed(1)
        pool = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen)
        t0, p0 = make_batch(0, 8192, gen, pool, pin=False)
        t5, p5 = make_batch(5, 8192, gen, pool, pin=False)
        check("batch shapes vary", tuple(t0.shape) == (16, 257) and tuple(t5.shape) == (32, 385))
        check("payloads differ from batch to batch", not torch.equal(batch_sums(t0, p0)[2:], batch_sums(t5, p5)[2:]))
        check("payload 5 is the pool rotated and shifted", torch.equal(p5, pool.roll(-(5 * 4099 % len(pool))) + 5))
        q = p5.clone()
        q[7] ^= 1
        check("a changed byte changes the sums", not torch.equal(batch_sums(t5, q), batch_sums(t5, p5)))
    print(f"{counts[0]} passed, {counts[1]} failed", flush=True)
    return counts[1] == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.path.join(HERE, "..", "target", "release", "libexpseg.so"))
    ap.add_argument("--out", default="bench-torch-out")
    ap.add_argument("--workloads", nargs="*", default=[w for w in WORKLOADS if w not in NOT_DEFAULT], help=f"default: {' '.join(w for w in WORKLOADS if w not in NOT_DEFAULT)}; also: handoff, {', '.join(NOT_DEFAULT)}."
                    f" Two ranks (skipped with fewer than 2 GPUs): {' '.join(TWO_RANK)}; deepspeed*: skipped when deepspeed cannot be imported")
    ap.add_argument("--modes", nargs="*", default=MODES)
    ap.add_argument("--json", help="also write a summary with device, driver, date and commit")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--append", action="store_true", help="add this run's workloads to the --json file when it is of the same device and commit")
    ap.add_argument("--steps", type=int, help="steps per workload instead of each one's own count (WORKLOADS)")
    ap.add_argument("--reports", help="write the expseg modes' exit reports to this folder (default OUT/reports)")
    ap.add_argument("--repeat", type=int, default=1, help="the older name of --rounds (workloads other than handoff)")
    ap.add_argument("--cpus", help="pin every worker to these CPUs (e.g. 4-7)")
    ap.add_argument("--alt-lib", help="another libexpseg.so, run as mode expseg-alt (LD_PRELOAD alone): two builds side by side")
    ap.add_argument("--rounds", type=int, help="run every mode of a workload once per round, the order of modes rotated by one each round;"
                    " per round each mode's ratio to default and expandable, their mean and 95 %% interval in --json (default 1;"
                    " handoff: rounds per pair, default 20)")
    ap.add_argument("--handoff-rounds", type=int, help="handoff: rounds per pair (default: --rounds, else 20)")
    ap.add_argument("--handoff-modes", nargs="*", default=HANDOFF_MODES, help="handoff: trainer modes")
    ap.add_argument("--fill-expseg", action="store_true", help="the process that holds all but the budget runs expseg too, with EXPSEG_KEEP=auto (every process on the GPU runs expseg and keeps)")
    ap.add_argument("--handoff-trainer", action="store_true")
    ap.add_argument("--handoff-consumer", action="store_true")
    ap.add_argument("--worker")
    ap.add_argument("--fill", type=float)
    ap.add_argument("--selftest", action="store_true", help="check the orchestrator's arithmetic and bookkeeping on the CPU (fake workers, no GPU) and exit")
    args = ap.parse_args()
    if args.selftest:
        sys.exit(0 if selftest() else 1)
    if args.handoff_trainer:
        handoff_trainer()
    elif args.handoff_consumer:
        handoff_consumer()
    elif args.worker:
        worker(args.worker)
    elif args.fill is not None:
        filler(args.fill)
    else:
        unknown = [m for m in args.modes + args.handoff_modes if m not in KNOWN_MODES]
        unknown += [w for w in args.workloads if w not in WORKLOADS and w != "handoff"]
        if unknown:
            ap.error(f"unknown mode or workload: {' '.join(unknown)} (modes: {' '.join(sorted(KNOWN_MODES))}; "
                     f"workloads: {' '.join(WORKLOADS)} handoff)")
        if "expseg-alt" in args.modes and not args.alt_lib:
            ap.error("mode expseg-alt needs --alt-lib")
        args.lib = os.path.abspath(args.lib)
        if args.alt_lib:
            ALT_LIB[0] = os.path.abspath(args.alt_lib)
        if args.steps:
            for w in WORKLOADS:
                WORKLOADS[w] = (WORKLOADS[w][0], args.steps)
        run_all(args)


if __name__ == "__main__":
    main()
