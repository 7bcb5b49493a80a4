"""Sleep mode: expseg.pause() gives a training process's GPU memory back, resume() brings it
back at the same addresses, and training goes on as if nothing happened.

    python3 torch_sleep.py LIBDIR --json OUT [--gib 24] [--discard-gib 40]

Re-executes itself under LD_PRELOAD=LIBDIR/libexpseg.so when not preloaded. Steps:
a) an MLP whose weights, grads and AdamW state total >= --gib GiB trains 3 steps;
b) a small CUDA graph is captured and replayed; c) every parameter, grad and optimizer state
is hashed on the GPU; d) pause() with the bytes copied to the host, timed; e) a plain process
(no expseg) allocates the memory the pause gave back; f) resume(), timed: hashes equal, graph
output equal, 3 more steps; g) the 6 losses equal bit for bit a run without pause;
h) pinned-memcpy baselines of the same bytes (pause/D2H and resume/H2D: targets <= 1.2,
reported); i) pause and resume twice (the second pause and resume against the same baselines,
scaled to their bytes); j) a tagged KV cache dropped with
pause("kv_cache", offload=False) (target <= 50 ms for 40 GiB) and resumed (target <= 2x a
plain allocation of the same tensors), the model untouched; k) raw IPC handles (ctypes, as
vLLM) while a tagged tensor pair is paused: an awake weight's handle resumes nothing, a paused
tensor's handle resumes its pages with their bytes. Targets are reported, not asserted. Prints PASS/FAIL lines; JSON rewritten after every step; exit 1 on any failure.
Internal modes: --reference (6 steps, no pause, prints LOSSES), --child-alloc BYTES and
--child-alloc-list GIB (plain processes)."""
import argparse
import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30
DIM, BATCH = 8192, 256
HASH_CHUNK = 997 * (1 << 14)  # a multiple of 997: every chunk has the same index weights


def plain_env():
    """This environment without expseg (or torch_memory_saver): no LD_PRELOAD, no allocator
    settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPSEG_", "TMS_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))}
    env.pop("LD_PRELOAD", None)
    return env


def child_alloc(n):
    import torch

    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    t.fill_(7)
    torch.cuda.synchronize()
    assert t[-1].item() == 7
    print(f"OK allocated and wrote {n} bytes")


def child_alloc_list(k):
    """The plain allocator's cost for what a discarded resume does: k x 1 GiB taken, written,
    given back (empty_cache), then, after the same 1 s of quiet the resume had, taken again:
    that second allocation is timed."""
    import torch

    keep = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(k)]
    for t in keep:
        t.fill_(1)
    torch.cuda.synchronize()
    del keep, t
    torch.cuda.empty_cache()
    time.sleep(1.0)
    t0 = time.perf_counter()
    keep = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(k)]
    torch.cuda.synchronize()
    print(f"ALLOC_S {time.perf_counter() - t0:.6f} ({len(keep)} x 1 GiB, given back 1 s before)")


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
    per_layer = 4 * 4 * (DIM * DIM + DIM)  # fp32 weights + grads + 2 AdamW states
    model = Stack(max(1, math.ceil(gib * GIB / per_layer)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, torch.Generator().manual_seed(1)


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
        opt.zero_grad(set_to_none=False)  # grads stay allocated: part of what is paused
        losses.append(loss.item())
    return losses


def state_tensors(model, opt):
    out = list(model.parameters()) + [p.grad for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if hasattr(v, "is_cuda")]
    return out


def digest(tensors):
    """Exact per-tensor hashes: sum of int32 words times (index % 997 + 1), in int64 on the GPU."""
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
        self.data = {"checks": {}, "figures": {}, "targets": {}}

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

    def target(self, name, value, limit):
        ok = value is not None and value <= limit
        print(f"{'MET' if ok else 'MISSED'} target {name}: {value if value is None else round(value, 4)} (target <= {limit})", flush=True)
        self.data["targets"][name] = {"value": value, "limit": limit, "met": ok}
        self.save()

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def timed(f, *a, **kw):
    t0 = time.perf_counter()
    r = f(*a, **kw)
    return r, time.perf_counter() - t0


def run(args, r):
    import torch
    import torch.nn as nn

    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import expseg

    def resume_synced(tag=None):  # timed to the end of any copy it left running
        n = expseg.resume(tag)
        torch.cuda.synchronize()
        return n

    r.check("expseg_active", expseg.active(), str(expseg.stats().get("why", "")), fatal=True)
    r.fig(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
    # a) model, 3 steps
    model, opt, gen = build(args.gib)
    losses = train(model, opt, gen, 3)
    tensors = state_tensors(model, opt)
    model_bytes = sum(t.nbytes for t in tensors if t.is_cuda)
    r.fig(layers=len(model.layers), model_bytes=model_bytes, losses_first3=losses)
    r.check("a_train_3_steps", len(losses) == 3 and all(math.isfinite(x) for x in losses), f"{model_bytes / GIB:.2f} GiB of weights, grads and AdamW state")
    # b) a small CUDA graph of its own module
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
        with torch.cuda.graph(graph):
            static_out = net(static_in)
        graph.replay()
        expected = static_out.clone()
    r.check("b_graph_captured", True)
    # c) hashes
    watched = tensors + list(net.parameters()) + [static_in, expected]
    hashes = digest(watched)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what a sleep mode does first: PyTorch's cache goes back
    r.check("c_hashed", True, f"{len(hashes)} tensors")
    # d) pause with offload
    free_before, total = torch.cuda.mem_get_info()
    paused, pause_s = timed(expseg.pause)
    free_after, _ = torch.cuda.mem_get_info()
    st_paused = expseg.stats().get("process", {}).get("paused_bytes")
    r.fig(paused_bytes=paused, pause_s=pause_s, free_before_pause=free_before, free_after_pause=free_after,
          total=total, stats_paused_bytes=st_paused, paused_now=expseg.paused())
    r.check("d_pause_covers_model", paused >= model_bytes, f"paused {paused / GIB:.2f} GiB in {pause_s:.3f} s, model "
            f"{model_bytes / GIB:.2f} GiB, free {free_before / GIB:.1f} -> {free_after / GIB:.1f} GiB", fatal=True)
    r.check("d_paused_reported", expseg.paused() == paused and st_paused == paused, f"paused() {expseg.paused()}, stats {st_paused}")
    # e) a plain process takes the memory: what was free anyway (less 2 GiB for its context) + 95 % of the paused bytes
    n = int(0.95 * paused) + max(0, free_before - 2 * GIB)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-alloc", str(n)], env=plain_env(), capture_output=True, text=True)
    r.fig(child_alloc_bytes=n, child_rc=p.returncode)
    r.check("e_plain_process_allocates_paused_memory", p.returncode == 0 and "OK" in p.stdout, f"{n / GIB:.2f} GiB: {(p.stdout + p.stderr).strip()[-300:]}")
    # f) resume
    resumed, resume_s = timed(resume_synced)
    r.fig(resumed_bytes=resumed, resume_s=resume_s)
    r.check("f_resume", resumed == paused and expseg.paused() == 0, f"{resumed / GIB:.2f} GiB in {resume_s:.3f} s", fatal=True)
    after = digest(watched)
    bad = [i for i, (a, b) in enumerate(zip(hashes, after)) if a != b]
    r.check("f_hashes_equal", not bad, f"{len(bad)} of {len(hashes)} tensors differ")
    with torch.no_grad():
        graph.replay()
        same = torch.equal(static_out, expected)
    r.check("f_graph_replay_equal", same)
    losses += train(model, opt, gen, 3)
    r.fig(losses=losses)
    r.check("f_train_3_more_steps", all(math.isfinite(x) for x in losses[3:]), f"losses {losses}")
    # g) the same 6 steps without pause, in the same environment
    p = subprocess.run([sys.executable, os.path.abspath(__file__), args.libdir, "--reference", "--gib", str(args.gib)], capture_output=True, text=True)
    ref = [json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("LOSSES ")]
    ref = ref[0] if ref else None
    r.fig(losses_reference=ref)
    r.check("g_losses_equal_reference", ref == losses, "" if ref else f"reference failed: {p.stderr.strip()[-300:]}")
    # h) baselines: pinned host memory, D2H and H2D of the same bytes
    host, pin_s = timed(torch.empty, paused, dtype=torch.uint8, pin_memory=True)
    dbuf = torch.ones(min(paused, 8 * GIB), dtype=torch.uint8, device="cuda")

    def copy(d2h):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for o in range(0, paused, dbuf.numel()):
            c = min(dbuf.numel(), paused - o)
            if d2h:
                host[o : o + c].copy_(dbuf[:c], non_blocking=True)
            else:
                dbuf[:c].copy_(host[o : o + c], non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    d2h_s, h2d_s = min(copy(True) for _ in range(2)), min(copy(False) for _ in range(2))
    host = dbuf = None  # freed (the copy closure holds their cells)
    torch.cuda.empty_cache()
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # PyTorch keeps freed pinned memory
    # PyTorch's host allocator pins a power of two: pin_bytes, not the bytes paused
    r.fig(pin_s=pin_s, pin_bytes=1 << (paused - 1).bit_length(), d2h_s=d2h_s, h2d_s=h2d_s, d2h_gbps=paused / d2h_s / 1e9, h2d_gbps=paused / h2d_s / 1e9,
          ratio_pause_d2h=pause_s / d2h_s, ratio_resume_h2d=resume_s / h2d_s)
    print(f"baseline {paused / GIB:.2f} GiB: pin {pin_s:.3f} s, D2H {d2h_s:.3f} s, H2D {h2d_s:.3f} s", flush=True)
    r.target("pause_over_d2h", pause_s / d2h_s, 1.2)
    r.target("resume_over_h2d", resume_s / h2d_s, 1.2)
    # i) pause and resume twice; resume with nothing paused
    r.check("i_resume_without_pause", expseg.resume() == 0)
    before = digest(watched)
    torch.cuda.empty_cache()
    p1, pause2_s = timed(expseg.pause)
    p2 = expseg.pause()
    now = expseg.paused()
    r1, resume2_s = timed(resume_synced)
    r2 = expseg.resume()
    r.fig(pause2_s=pause2_s, resume2_s=resume2_s, pause2_bytes=p1)
    # The second pause finds the first one's host buffers kept (EXPSEG_PAUSE_KEEP_HOST=auto,
    # while the host has room): the copy alone.
    r.fig(ratio_pause2_d2h=pause2_s / d2h_s * paused / max(p1, 1), ratio_resume2_h2d=resume2_s / h2d_s * paused / max(p1, 1))
    r.target("pause2_over_d2h", pause2_s / d2h_s * paused / max(p1, 1), 1.2)
    r.target("resume2_over_h2d", resume2_s / h2d_s * paused / max(p1, 1), 1.2)
    r.check("i_pause_twice", p1 > 0 and p2 == 0 and now == p1, f"{p1} then {p2}, paused() {now}")
    r.check("i_resume_twice", r1 == p1 and r2 == 0 and expseg.paused() == 0, f"{r1} then {r2}")
    with torch.no_grad():
        graph.replay()
        same = torch.equal(static_out, expected)
    r.check("i_hashes_and_graph_equal", digest(watched) == before and same)
    # j) a tagged KV cache, dropped and made again
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    k = int(min(args.discard_gib, (free - 4 * GIB) // GIB))
    if k < 1:
        r.check("j_kv_cache", False, f"only {free / GIB:.1f} GiB free")
        return
    model_hashes = digest(tensors)
    torch.cuda.empty_cache()  # no cached untagged pages for the KV tensors to start in
    with expseg.tag("kv_cache"):
        kv = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(k)]
        for i, t in enumerate(kv):
            t.fill_(i)
    torch.cuda.synchronize()
    kvp, kv_pause_s = timed(expseg.pause, "kv_cache", offload=False)
    now = expseg.paused()
    r.fig(kv_bytes=k * GIB, kv_paused_bytes=kvp, kv_pause_s=kv_pause_s)
    # Pages are shared at the edges (the first KV tensor may start in the last untagged page):
    # a few tens of MiB either way. Nothing is allocated while paused: a new tensor could land
    # in the free end of the last (paused) KV page.
    r.check("j_kv_pause_only_tagged", abs(kvp - k * GIB) <= 64 * (1 << 20) and now == kvp,
            f"{k} GiB: paused {kvp / GIB:.3f} GiB in {kv_pause_s * 1e3:.1f} ms, paused() {now / GIB:.3f} GiB")
    r.target("kv_pause_s_per_40GiB", kv_pause_s * 40 / k, 0.050)
    # Resumed a while later, as a sleeping engine is (the plain allocation it is compared
    # with also comes seconds after the memory was freed: a process start).
    time.sleep(1.0)
    kvr, kv_resume_s = timed(resume_synced, "kv_cache")
    r.check("j_kv_resume", kvr == kvp and expseg.paused() == 0, f"{kvr / GIB:.3f} GiB in {kv_resume_s * 1e3:.1f} ms")
    r.check("j_model_intact_after_kv", digest(tensors) == model_hashes, "(nothing of the model was dropped)")
    del kv, t
    torch.cuda.empty_cache()
    # the same tensors made by a plain process with PyTorch's default allocator
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-alloc-list", str(k)], env=plain_env(), capture_output=True, text=True)
    plain = [float(l.split()[1]) for l in p.stdout.splitlines() if l.startswith("ALLOC_S ")]
    plain_s = plain[0] if plain else None
    r.fig(kv_resumed_bytes=kvr, kv_resume_s=kv_resume_s, plain_alloc_s=plain_s, ratio_kv_resume_plain=kv_resume_s / plain_s if plain_s else None)
    r.check("j_plain_allocation_ran", plain_s is not None, f"{k} x 1 GiB in {plain_s} s {p.stderr.strip()[-300:]}")
    if plain_s:
        r.target("kv_resume_over_plain_alloc", kv_resume_s / plain_s, 2.0)
    ipc_of_paused_memory(r, tensors)


def ipc_of_paused_memory(r, tensors):
    """k) Raw IPC (vLLM-style, through ctypes) while part of the memory is paused: a handle of
    an awake weight leaves the paused memory paused; a handle of a paused tensor resumes the
    pages it shares, with their bytes, before the handle is made."""
    import torch
    import expseg

    sys.path.insert(0, HERE)
    from torch_ipc import ctypes_handle

    torch.cuda.empty_cache()
    with expseg.tag("kv_ipc"):
        kv = [torch.full((GIB // 4,), float(i + 1), device="cuda") for i in range(2)]
    torch.cuda.synchronize()
    paused = expseg.pause("kv_ipc")
    r.check("k_paused", paused >= 2 * GIB - 64 * (1 << 20), f"{paused / GIB:.3f} GiB")
    rc, _, _ = ctypes_handle(tensors[0])
    r.check("k_ipc_of_awake_weight_leaves_paused_memory_paused", rc == 0 and expseg.paused() == paused,
            f"rc {rc}, paused {paused} -> {expseg.paused()}")
    rc, _, _ = ctypes_handle(kv[1])
    after = expseg.paused()
    ok = rc == 0 and after < paused and bool((kv[1] == 2.0).all().item())
    r.check("k_ipc_of_paused_tensor_resumes_its_pages_with_their_bytes", ok,
            f"rc {rc}, paused {paused} -> {after}")
    expseg.resume("kv_ipc")
    r.check("k_rest_resumes", expseg.paused() == 0 and bool((kv[0] == 1.0).all().item()) and bool((kv[1] == 2.0).all().item()))
    del kv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("libdir", nargs="?", help="folder of libexpseg.so")
    ap.add_argument("--json", help="results file")
    ap.add_argument("--gib", type=float, default=24, help="weights + grads + AdamW state, GiB")
    ap.add_argument("--discard-gib", type=int, default=40, help="KV cache of step j, GiB (capped at free - 4)")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--child-alloc", type=int)
    ap.add_argument("--child-alloc-list", type=int)
    args = ap.parse_args()
    if args.child_alloc is not None:
        return child_alloc(args.child_alloc)
    if args.child_alloc_list is not None:
        return child_alloc_list(args.child_alloc_list)
    if not args.libdir:
        ap.error("LIBDIR is needed")
    lib = os.path.join(os.path.abspath(args.libdir), "libexpseg.so")
    if not os.path.isfile(lib):
        sys.exit(f"FAIL: {lib} is missing")
    if "libexpseg" not in os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = lib
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:])
    if args.reference:
        model, opt, gen = build(args.gib)
        print("LOSSES " + json.dumps(train(model, opt, gen, 6)), flush=True)
        return
    if not args.json:
        ap.error("--json OUT is needed")
    r = Report(args.json)
    try:
        run(args, r)
    except Exception as e:  # recorded, then the process leaves with nothing paused
        import traceback

        traceback.print_exc()
        r.data["error"] = f"{type(e).__name__}: {e}"
        r.check("no_exception", False, r.data["error"])
        try:
            import expseg

            if expseg.paused():
                expseg.resume()
        except Exception:
            pass
    n = len(r.data["checks"])
    print(f"{n - r.failed} passed, {r.failed} failed")
    sys.exit(1 if r.failed else 0)


if __name__ == "__main__":
    main()
