"""The sleep-mode scenario of torch_sleep.py on torch_memory_saver 0.0.10 (no expseg), for
comparison: pause with a CPU backup, a plain process allocating the memory given back,
resume, every hash and the CUDA graph's output equal, losses equal a run without pause, and
the pause/resume times against pinned-memcpy baselines of the same bytes.

    pip install --no-deps --target DIR torch_memory_saver-0.0.10-...whl
    python3 tms_sleep.py --tms-dir DIR --json OUT [--gib 24] [--no-warm]
    expseg-run python3 tms_sleep.py --tms-dir DIR --json OUT --beside after|before

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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The scenario's pieces are torch_sleep.py's (importing it sets CUBLAS_WORKSPACE_CONFIG and
# loads no torch).
from torch_sleep import GIB, Report, build, child_alloc, digest, plain_env, state_tensors, train  # noqa: E402

HOOK = "torch_memory_saver_hook_mode_preload"


def reexec_preloaded(tms_dir, beside=None):
    """Start this script again with torch_memory_saver's hook preloaded (and nothing else), or
    with `beside` ("after" or "before"): the hook put after or before what LD_PRELOAD names now
    (expseg, under expseg-run), the launcher's environment kept."""
    import torch  # its CUDA major picks the .so; its libcudart is the one the hook needs

    major = torch.version.cuda.split(".")[0]
    hooks = glob.glob(os.path.join(tms_dir, f"{HOOK}_cu{major}.*.so")) or glob.glob(os.path.join(tms_dir, "torch_memory_saver", f"{HOOK}_cu{major}.*.so"))
    if len(hooks) != 1:
        sys.exit(f"FAIL tms_hook_found: {len(hooks)} files {HOOK}_cu{major}.*.so in {tms_dir}")
    env = plain_env() if beside is None else dict(os.environ)
    now = os.environ.get("LD_PRELOAD", "")
    pre = {None: hooks[0], "after": f"{now}:{hooks[0]}", "before": f"{hooks[0]}:{now}"}[beside]
    env.update(LD_PRELOAD=pre.strip(":"), TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    # The hook needs libcudart.so.<major> at process start: pip's CUDA runtime is not on the
    # loader's path, so add the folder of the one torch loaded.
    rt = [l.split()[-1] for l in open("/proc/self/maps") if "libcudart.so" in l]
    if rt:
        env["LD_LIBRARY_PATH"] = os.path.dirname(rt[0]) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env)


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
    ap.add_argument("--beside", choices=["after", "before"],
                    help="keep what LD_PRELOAD names (expseg under expseg-run), the hook after or before it")
    args = ap.parse_args()
    if args.child_alloc is not None:
        return child_alloc(args.child_alloc)
    if not args.tms_dir:
        ap.error("--tms-dir DIR is needed")
    args.tms_dir = os.path.abspath(args.tms_dir)
    sys.path.insert(0, args.tms_dir)
    if HOOK not in os.environ.get("LD_PRELOAD", ""):
        reexec_preloaded(args.tms_dir, args.beside)
    if args.reference:
        model, opt, gen = build(args.gib)
        print("LOSSES " + json.dumps(train(model, opt, gen, 6)), flush=True)
        return
    if not args.json:
        ap.error("--json OUT is needed")
    r = Report(args.json)
    r.data["allocator"] = "torch_memory_saver 0.0.10" + (f" beside {os.environ['LD_PRELOAD']}" if args.beside else "")
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
