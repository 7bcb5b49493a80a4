"""The sleep-mode scenario of torch_sleep.py on torch_memory_saver 0.0.10 (no expseg), for
comparison: pause with a CPU backup, a plain process allocating the memory given back,
resume, every hash and the CUDA graph's output equal, losses equal a run without pause, and
the pause/resume times against pinned-memcpy baselines of the same bytes.

    pip install --no-deps --target DIR torch_memory_saver-0.0.10-...whl
    python3 tms_sleep.py --tms-dir DIR --json OUT [--gib 24] [--no-warm]

torch_memory_saver's hook is an LD_PRELOAD library (its default hook mode, "preload"): the
script re-executes itself with LD_PRELOAD=DIR/torch_memory_saver_hook_mode_preload_cu<N>.abi3.so
and, as its training-engine mode does, TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1, so
that every cudaMalloc of every thread is pauseable with a CPU backup (region() routes only
the calling thread's allocations; autograd's device thread makes the grads). The bytes paused
are what torch.cuda.mem_get_info() sees given back (pause() returns nothing). With
retain_cpu_backup (not --no-warm) a second and third cycle time pause/resume with the pinned
backups already made. PASS/FAIL lines; JSON rewritten after each step; exit 1 on failure."""
import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
GIB = 1 << 30
DIM, BATCH = 8192, 256
HASH_CHUNK = 997 * (1 << 14)
HOOK = "torch_memory_saver_hook_mode_preload"


def plain_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "EXPSEG_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))}
    env.pop("LD_PRELOAD", None)
    return env


def reexec_preloaded(tms_dir):
    """Start this script again with torch_memory_saver's hook preloaded (and nothing else)."""
    import torch  # its CUDA major picks the .so; its libcudart is the one the hook needs

    major = torch.version.cuda.split(".")[0]
    hooks = glob.glob(os.path.join(tms_dir, f"{HOOK}_cu{major}.*.so")) or glob.glob(os.path.join(tms_dir, "torch_memory_saver", f"{HOOK}_cu{major}.*.so"))
    if len(hooks) != 1:
        sys.exit(f"FAIL tms_hook_found: {len(hooks)} files {HOOK}_cu{major}.*.so in {tms_dir}")
    env = plain_env()
    env.update(LD_PRELOAD=hooks[0], TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    # The hook needs libcudart.so.<major> at process start: pip's CUDA runtime is not on the
    # loader's path, so add the folder of the one torch loaded.
    rt = [l.split()[-1] for l in open("/proc/self/maps") if "libcudart.so" in l]
    if rt:
        env["LD_LIBRARY_PATH"] = os.path.dirname(rt[0]) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env)


def child_alloc(n):
    import torch

    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    t.fill_(7)
    torch.cuda.synchronize()
    assert t[-1].item() == 7
    print(f"OK allocated and wrote {n} bytes")


def build(gib):
    import torch
    import torch.nn as nn

    class Stack(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(DIM, DIM, device="cuda") for _ in range(n))

        def forward(self, x):
            for layer in self.layers:
                x = x + torch.tanh(layer(x))
            return x

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # torch.empty stays a bare allocation
    torch.backends.cuda.matmul.allow_tf32 = False
    model = Stack(max(1, math.ceil(gib * GIB / (16 * (DIM * DIM + DIM)))))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.Generator().manual_seed(1)


def train(model, opt, gen, steps):
    import torch
    import torch.nn.functional as F

    losses = []
    for _ in range(steps):
        x = torch.randn(BATCH, DIM, generator=gen).cuda()
        y = torch.randn(BATCH, DIM, generator=gen).cuda()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses


def state_tensors(model, opt):
    out = list(model.parameters()) + [p.grad for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if hasattr(v, "is_cuda")]
    return out


def digest(tensors):
    import torch

    w = torch.arange(HASH_CHUNK, device="cuda", dtype=torch.int64) % 997 + 1
    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        flat = flat.cuda() if not flat.is_cuda else flat
        flat = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.uint8)
        s = torch.zeros((), dtype=torch.int64, device="cuda")
        for o in range(0, flat.numel(), HASH_CHUNK):
            part = flat[o : o + HASH_CHUNK].to(torch.int64)
            s += (part * w[: part.numel()]).sum()
        sums.append(s)
    return torch.stack(sums).tolist()


class Report:
    def __init__(self, path):
        self.path, self.failed = path, 0
        self.data = {"allocator": "torch_memory_saver 0.0.10", "checks": {}, "figures": {}}

    def fig(self, **kw):
        self.data["figures"].update(kw)
        self.save()

    def check(self, name, ok, detail="", fatal=False):
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}".rstrip(), flush=True)
        self.data["checks"][name] = bool(ok)
        self.failed += not ok
        self.save()
        if fatal and not ok:
            raise RuntimeError(f"{name} failed: cannot go on")

    def save(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".tmp", self.path)


def run(args, r):
    import torch
    import torch.nn as nn
    from torch_memory_saver import torch_memory_saver as tms

    preloaded = any(HOOK in l for l in open("/proc/self/maps"))
    r.check("tms_hook_preloaded", preloaded, os.environ.get("LD_PRELOAD", ""), fatal=True)
    r.fig(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda, hook=os.environ["LD_PRELOAD"])

    def sync_timed(f):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # a) model, 3 steps (every allocation pauseable: TMS_INIT_ENABLE)
    model, opt, gen = build(args.gib)
    losses = train(model, opt, gen, 3)
    tensors = state_tensors(model, opt)
    model_bytes = sum(t.nbytes for t in tensors if t.is_cuda)
    r.fig(layers=len(model.layers), model_bytes=model_bytes, losses_first3=losses)
    r.check("a_train_3_steps", all(math.isfinite(x) for x in losses), f"{model_bytes / GIB:.2f} GiB of weights, grads and AdamW state")
    # b) CUDA graph through tms.cuda_graph (its memory pauseable, with a CPU backup)
    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024)).cuda()
    static_in = torch.randn(64, 1024, device="cuda")
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                net(static_in)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with tms.cuda_graph(graph, enable_cpu_backup=True):
            static_out = net(static_in)
        graph.replay()
        expected = static_out.clone()
    r.check("b_graph_captured", True)
    # c) hashes
    watched = tensors + list(net.parameters()) + [static_in, expected]
    hashes = digest(watched)
    torch.cuda.empty_cache()
    r.check("c_hashed", True, f"{len(hashes)} tensors")
    # d) pause
    free_before, total = torch.cuda.mem_get_info()
    pause_s = sync_timed(tms.pause)
    free_after, _ = torch.cuda.mem_get_info()
    paused = free_after - free_before
    r.fig(paused_bytes=paused, pause_s=pause_s, free_before_pause=free_before, free_after_pause=free_after, total=total)
    r.check("d_pause_covers_model", paused >= 0.95 * model_bytes,
            f"{paused / GIB:.2f} GiB given back in {pause_s:.3f} s, model {model_bytes / GIB:.2f} GiB", fatal=True)
    # e) a plain process takes it: what was free anyway (less 2 GiB) + 95 % of the paused bytes
    n = int(0.95 * paused) + max(0, free_before - 2 * GIB)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-alloc", str(n)], env=plain_env(), capture_output=True, text=True)
    r.fig(child_alloc_bytes=n, child_rc=p.returncode)
    r.check("e_plain_process_allocates_paused_memory", p.returncode == 0 and "OK" in p.stdout, f"{n / GIB:.2f} GiB: {(p.stdout + p.stderr).strip()[-300:]}")
    # f) resume
    resume_s = sync_timed(tms.resume)
    free_resumed, _ = torch.cuda.mem_get_info()
    r.fig(resume_s=resume_s, free_after_resume=free_resumed)
    r.check("f_resume", abs(free_resumed - free_before) <= paused * 0.05 + 256 * (1 << 20),
            f"in {resume_s:.3f} s; free {free_resumed / GIB:.1f} GiB", fatal=True)
    bad = [i for i, (a, b) in enumerate(zip(hashes, digest(watched))) if a != b]
    r.check("f_hashes_equal", not bad, f"{len(bad)} of {len(hashes)} tensors differ")
    with torch.no_grad():
        graph.replay()
        same = torch.equal(static_out, expected)
    r.check("f_graph_replay_equal", same)
    losses += train(model, opt, gen, 3)
    r.fig(losses=losses)
    r.check("f_train_3_more_steps", all(math.isfinite(x) for x in losses[3:]), f"losses {losses}")
    # g) reference: 6 steps without pause, same environment
    cmd = [sys.executable, os.path.abspath(__file__), "--tms-dir", args.tms_dir, "--reference", "--gib", str(args.gib)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    ref = [json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("LOSSES ")]
    ref = ref[0] if ref else None
    r.fig(losses_reference=ref)
    r.check("g_losses_equal_reference", ref == losses, "" if ref else f"reference failed: {p.stderr.strip()[-300:]}")
    # h) baselines of the same bytes
    t0 = time.perf_counter()
    host = torch.empty(paused, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - t0
    dbuf = torch.ones(min(paused, 8 * GIB), dtype=torch.uint8, device="cuda")

    def copy(d2h):
        for o in range(0, paused, dbuf.numel()):
            c = min(dbuf.numel(), paused - o)
            if d2h:
                host[o : o + c].copy_(dbuf[:c], non_blocking=True)
            else:
                dbuf[:c].copy_(host[o : o + c], non_blocking=True)

    d2h_s = min(sync_timed(lambda: copy(True)) for _ in range(2))
    h2d_s = min(sync_timed(lambda: copy(False)) for _ in range(2))
    host = dbuf = None  # freed (the copy closure holds their cells)
    torch.cuda.empty_cache()
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # PyTorch keeps freed pinned memory
    # PyTorch's host allocator pins a power of two: pin_bytes, not the bytes paused
    r.fig(pin_s=pin_s, pin_bytes=1 << (paused - 1).bit_length(), d2h_s=d2h_s, h2d_s=h2d_s, d2h_gbps=paused / d2h_s / 1e9, h2d_gbps=paused / h2d_s / 1e9,
          ratio_pause_d2h=pause_s / d2h_s, ratio_resume_h2d=resume_s / h2d_s)
    print(f"baseline {paused / GIB:.2f} GiB: pin {pin_s:.3f} s, D2H {d2h_s:.3f} s, H2D {h2d_s:.3f} s; "
          f"pause/D2H {pause_s / d2h_s:.2f}, resume/H2D {resume_s / h2d_s:.2f}", flush=True)
    # i) warm cycles: pinned backups kept from the previous cycle (retain_cpu_backup)
    if not args.no_warm:
        before = digest(watched)
        torch.cuda.empty_cache()
        tms.retain_cpu_backup = True
        cold = (sync_timed(tms.pause), sync_timed(tms.resume))
        warm = (sync_timed(tms.pause), sync_timed(tms.resume))
        tms.retain_cpu_backup = False
        r.fig(pause_retain_first_s=cold[0], resume_retain_first_s=cold[1], pause_warm_s=warm[0], resume_warm_s=warm[1],
              ratio_pause_warm_d2h=warm[0] / d2h_s, ratio_resume_warm_h2d=warm[1] / h2d_s)
        with torch.no_grad():
            graph.replay()
            same = torch.equal(static_out, expected)
        r.check("i_warm_cycles_intact", digest(watched) == before and same, f"pause {warm[0]:.3f} s, resume {warm[1]:.3f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tms-dir", help="folder where the wheel was installed (pip install --no-deps --target DIR)")
    ap.add_argument("--json", help="results file")
    ap.add_argument("--gib", type=float, default=24, help="weights + grads + AdamW state, GiB")
    ap.add_argument("--no-warm", action="store_true", help="skip the cycles with retained CPU backups")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--child-alloc", type=int)
    args = ap.parse_args()
    if args.child_alloc is not None:
        return child_alloc(args.child_alloc)
    if not args.tms_dir:
        ap.error("--tms-dir DIR is needed")
    args.tms_dir = os.path.abspath(args.tms_dir)
    sys.path.insert(0, args.tms_dir)
    if HOOK not in os.environ.get("LD_PRELOAD", ""):
        reexec_preloaded(args.tms_dir)
    if args.reference:
        model, opt, gen = build(args.gib)
        print("LOSSES " + json.dumps(train(model, opt, gen, 6)), flush=True)
        return
    if not args.json:
        ap.error("--json OUT is needed")
    r = Report(args.json)
    try:
        run(args, r)
    except Exception as e:
        import traceback

        traceback.print_exc()
        r.data["error"] = f"{type(e).__name__}: {e}"
        r.check("no_exception", False, r.data["error"])
    n = len(r.data["checks"])
    print(f"{n - r.failed} passed, {r.failed} failed")
    sys.exit(1 if r.failed else 0)


if __name__ == "__main__":
    main()
