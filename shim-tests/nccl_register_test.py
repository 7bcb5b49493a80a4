"""One rank of a torchrun job: NCCL user-buffer registration on PyTorch tensors (what
ncclCommRegister and CUDA-graph registration do to expandable-segment memory). Each rank owns a
400 MiB tensor of words that differ page to page; buffers are 20 MiB slices at pages inside it
(never its first), registered with ncclCommRegister through ctypes, then all-reduced in place
and sent/received between ranks. NCCL retains the handle at each buffer's range base, exports
it and has the peer map it; under expseg that page may sit inside a coalesced handle, which
expseg splits first. Wrong bytes (the peer mapping another page) show up as wrong sums.

Its own NCCL communicator (ctypes on the libnccl PyTorch loaded), so the registration calls are
explicit; the unique id travels over a gloo group. Prints one line per rank and NCCL's
registration lines (NCCL_DEBUG_SUBSYS=REG) when there are any; exit 0 when every check holds.

    [LD_PRELOAD=libexpseg.so] torchrun --nproc-per-node 2 nccl_register_test.py"""
import ctypes
import os
import sys

import torch
import torch.distributed as dist

MIB = 1 << 20
PAGE_WORDS = 20 * MIB // 4
N = 400 * MIB // 4
MOD = 1000003


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def nccl_lib():
    """The libnccl PyTorch itself loaded (from /proc/self/maps), else the loader's."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "libnccl.so" in path and os.path.exists(path):
                return ctypes.CDLL(path)
    return ctypes.CDLL("libnccl.so.2")


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: ncclResult {rc}")


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("gloo")
    torch.zeros(1, device="cuda")  # PyTorch's context, and its NCCL linked in
    from torch.cuda import nccl as _loaded  # noqa: F401  (the NCCL PyTorch was built with)

    nccl = nccl_lib()
    ver = ctypes.c_int(0)
    nccl.ncclGetVersion(ctypes.byref(ver))
    uid = UniqueId()
    if rank == 0:
        check(nccl.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    box = [ctypes.string_at(ctypes.addressof(uid), 128) if rank == 0 else None]  # all 128 bytes, NULs too
    dist.broadcast_object_list(box, src=0)
    uid = UniqueId.from_buffer_copy(box[0])
    comm = ctypes.c_void_p()
    check(nccl.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    idx = torch.arange(N, dtype=torch.int64, device="cuda")
    x = ((idx % MOD) * (rank + 1)).to(torch.float32)  # 400 MiB, coalesced under expseg
    del idx
    torch.cuda.synchronize()
    base = x.data_ptr()
    results = {}
    regs = []

    def register(k, words):
        h = ctypes.c_void_p()
        check(nccl.ncclCommRegister(comm, ctypes.c_void_p(base + k * PAGE_WORDS * 4), ctypes.c_size_t(words * 4), ctypes.byref(h)), f"ncclCommRegister page {k}")
        regs.append(h)

    # Out-of-place all_reduce from page k into page k+1 (both registered), summed over the
    # ranks. NCCL 2.28 IPC-registers a ring all-reduce's receive buffer only out of place
    # (coll_reg.cc exits for in-place ring and tree), Simple protocol (run.sh sets
    # NCCL_ALGO=Ring NCCL_PROTO=Simple NCCL_NVLS_ENABLE=0).
    pairs = (3, 11)
    for k in pairs:
        register(k, PAGE_WORDS)
        register(k + 1, PAGE_WORDS)
    for k in pairs:
        src = ctypes.c_void_p(base + k * PAGE_WORDS * 4)
        dst = ctypes.c_void_p(base + (k + 1) * PAGE_WORDS * 4)
        check(nccl.ncclAllReduce(src, dst, ctypes.c_size_t(PAGE_WORDS), 7, 0, comm, stream), f"ncclAllReduce page {k}")
    torch.cuda.synchronize()
    scale = world * (world + 1) // 2
    for k in pairs:
        idx = torch.arange(k * PAGE_WORDS, (k + 1) * PAGE_WORDS, device="cuda") % MOD
        results[f"all_reduce_page{k}"] = bool(torch.equal(x[(k + 1) * PAGE_WORDS : (k + 2) * PAGE_WORDS], (idx * scale).to(torch.float32)))
        results[f"source_page{k}_kept"] = bool(torch.equal(x[k * PAGE_WORDS : (k + 1) * PAGE_WORDS], (idx * (rank + 1)).to(torch.float32)))
    # Send/receive between neighbours: page 5 goes out, page 9 comes in (both registered).
    if world > 1:
        register(5, PAGE_WORDS)
        register(9, PAGE_WORDS)
        to, frm = (rank + 1) % world, (rank - 1) % world
        check(nccl.ncclGroupStart(), "ncclGroupStart")
        check(nccl.ncclSend(ctypes.c_void_p(base + 5 * PAGE_WORDS * 4), ctypes.c_size_t(PAGE_WORDS), 7, to, comm, stream), "ncclSend")
        check(nccl.ncclRecv(ctypes.c_void_p(base + 9 * PAGE_WORDS * 4), ctypes.c_size_t(PAGE_WORDS), 7, frm, comm, stream), "ncclRecv")
        check(nccl.ncclGroupEnd(), "ncclGroupEnd")
        torch.cuda.synchronize()
        want = ((torch.arange(5 * PAGE_WORDS, 6 * PAGE_WORDS, device="cuda") % MOD) * (frm + 1)).to(torch.float32)
        results["send_recv"] = bool(torch.equal(x[9 * PAGE_WORDS : 10 * PAGE_WORDS], want))
    # Pages nobody registered or received are untouched.
    k = 15
    want = ((torch.arange(k * PAGE_WORDS, (k + 1) * PAGE_WORDS, device="cuda") % MOD) * (rank + 1)).to(torch.float32)
    results["untouched_page15"] = bool(torch.equal(x[k * PAGE_WORDS : (k + 1) * PAGE_WORDS], want))
    for h in regs:
        check(nccl.ncclCommDeregister(comm, h), "ncclCommDeregister")
    dist.barrier()
    nccl.ncclCommDestroy(comm)
    del x
    torch.cuda.empty_cache()
    ok = all(results.values())
    preloaded = "libexpseg.so" in os.environ.get("LD_PRELOAD", "")
    print(f"rank {rank}/{world} nccl {ver.value} expseg {preloaded}: {'ok' if ok else 'WRONG'} {results}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
