"""A caller other than PyTorch retains the handle behind a PyTorch page and maps it elsewhere,
as NCCL's user-buffer registration does (ncclCommRegister, graph capture): range query at a
pointer inside a tensor, cuMemRetainAllocationHandle at the range's base, export to a file
descriptor, import, map the range's size from offset 0 at a new address, read. The bytes must
be the page's own: under expseg the page may sit inside a larger coalesced handle whose offset
0 is another page's, so expseg splits the page's handle out first (hooks.rs, 143a5ee).

The functions are reached both ways NCCL could: ctypes on libcuda.so.1 (dlsym on the driver's
handle) and cuGetProcAddress_v2. Natively (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
the same script passes: each page is its own handle. The tensor is made, given back and made
again first, so that its pages are at addresses expseg has seen (pages at new addresses get
handles of their own, nothing to split). After the retains the tensor is written,
freed and the cache emptied, and a second tensor checked, so the split pages keep working.

Usage: [LD_PRELOAD=libexpseg.so] python3 torch_foreign_retain.py
Prints one JSON line; exit 0 when every mapped page held its own bytes and, under expseg, the
tensor's pages had been coalesced (else the test did not test)."""
import ctypes
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

MIB = 1 << 20
POSIX_FD = 1
cu = ctypes.CDLL("libcuda.so.1")
U64, SZ, VP = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def proc(name):
    """`name` through cuGetProcAddress_v2 at CUDA 12.0 (NCCL's way), as a ctypes function."""
    pfn, status = VP(), ctypes.c_int(0)
    rc = cu.cuGetProcAddress_v2(name.encode(), ctypes.byref(pfn), 12000, 0, ctypes.byref(status))
    if rc != 0 or not pfn.value:
        raise RuntimeError(f"cuGetProcAddress_v2({name}) = {rc}")
    return ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(U64), U64)(pfn.value)


def retain_direct(addr):
    h = U64(0)
    rc = cu.cuMemRetainAllocationHandle(ctypes.byref(h), VP(addr))
    return rc, h.value


def retain_by_proc():
    f = proc("cuMemRetainAllocationHandle")

    def retain(addr):
        h = U64(0)
        rc = f(ctypes.byref(h), U64(addr))
        return rc, h.value

    return retain


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} = {rc}")


def read_back(handle, size, dev, via_fd):
    """Map `size` bytes of `handle` from offset 0 at a new address (through an exported and
    imported descriptor when `via_fd`) and copy them to the host."""
    h, fd = handle, None
    if via_fd:
        fdv = ctypes.c_int(-1)
        check(cu.cuMemExportToShareableHandle(ctypes.byref(fdv), U64(handle), POSIX_FD, U64(0)), "export")
        fd = fdv.value
        imp = U64(0)
        check(cu.cuMemImportFromShareableHandle(ctypes.byref(imp), VP(fd), POSIX_FD), "import")
        h = imp.value
    va = U64(0)
    check(cu.cuMemAddressReserve(ctypes.byref(va), SZ(size), SZ(0), U64(0), U64(0)), "reserve")
    try:
        check(cu.cuMemMap(va, SZ(size), SZ(0), U64(h), U64(0)), "map")
        desc = AccessDesc(Location(1, dev), 3)
        check(cu.cuMemSetAccess(va, SZ(size), ctypes.byref(desc), SZ(1)), "set access")
        buf = ctypes.create_string_buffer(size)
        check(cu.cuMemcpyDtoH_v2(buf, va, SZ(size)), "copy to host")
        check(cu.cuMemUnmap(va, SZ(size)), "unmap")
        return buf.raw
    finally:
        cu.cuMemAddressFree(va, SZ(size))
        if via_fd:
            cu.cuMemRelease(U64(h))
            os.close(fd)


def stats():
    try:
        import expseg

        return expseg.stats()
    except ImportError:
        return {"active": False}


def coalesce_rows(s):
    p = s.get("process", {}) if s.get("active") else {}
    return {k: p.get(k) for k in ("coalesce_pages_live", "coalesce_handles_live", "coalesce_exports_split")}


def main():
    torch.cuda.init()
    dev = torch.cuda.current_device()
    torch.cuda.set_device(dev)
    cu.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(U64), ctypes.POINTER(SZ), U64]
    # 400 MiB of distinct words: every 20 MiB page's bytes differ from every other's.
    n = 400 * MIB // 4
    # Made once and given back first: expseg gives pages at addresses never mapped before a
    # handle each (EXPSEG_LEARN_CUTS), and coalesces them where the program maps again.
    x = torch.empty(n, dtype=torch.int32, device="cuda")
    del x
    torch.cuda.empty_cache()
    x = torch.arange(n, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    before = coalesce_rows(stats())
    host = x.cpu().numpy().tobytes()
    lo, hi = x.data_ptr(), x.data_ptr() + n * 4
    out = {"pages": 0, "right": 0, "wrong": [], "outside": 0, "errors": [], "before": before}
    ways = [("dlsym", retain_direct, False), ("proc", retain_by_proc(), False), ("dlsym+fd", retain_direct, True)]
    # Pages at varied places in the tensor, several per way; never the first, which would be a
    # coalesced handle's offset 0 either way.
    for i, k in enumerate([3, 7, 1, 12, 5, 17, 9, 14, 2]):
        name, retain, via_fd = ways[i % len(ways)]
        p = lo + k * 20 * MIB + 4096 * (i + 1)
        base, size = U64(0), SZ(0)
        rc = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), U64(p))
        if rc != 0:
            out["errors"].append(f"range {k}: {rc}")
            continue
        b, s = base.value, size.value
        if b < lo or b + s > hi:
            out["outside"] += 1  # a range reaching past the tensor: not compared
            continue
        rc, h = retain(b)
        if rc != 0:
            out["errors"].append(f"retain {k} ({name}): {rc}")
            continue
        try:
            got = read_back(h, s, dev, via_fd)
        except RuntimeError as e:
            out["errors"].append(f"{name} page {k}: {e}")
            continue
        finally:
            cu.cuMemRelease(U64(h))
        out["pages"] += 1
        if got == host[b - lo : b - lo + s]:
            out["right"] += 1
        else:
            first = int.from_bytes(got[:4], "little")
            out["wrong"].append({"way": name, "page": k, "size": s, "first_word": first, "want": (b - lo) // 4})
    # The split pages keep working: write, free, empty the cache, allocate and check again.
    x.add_(1)
    ok_after = bool((x[:: 1 << 20] == torch.arange(0, n, 1 << 20, dtype=torch.int32, device="cuda") + 1).all())
    del x
    torch.cuda.empty_cache()
    y = torch.arange(n, dtype=torch.int32, device="cuda")
    ok_after = ok_after and int(y[-1]) == n - 1 and int(y.sum(dtype=torch.int64)) == n * (n - 1) // 2
    out["after_ok"] = ok_after
    s = stats()
    out["expseg"] = s.get("active", False)
    out["after"] = coalesce_rows(s)
    coalesced = (before.get("coalesce_pages_live") or 0) > (before.get("coalesce_handles_live") or 0)
    out["coalesced_before"] = coalesced
    print(json.dumps(out), flush=True)
    good = out["pages"] >= 6 and out["right"] == out["pages"] and not out["errors"] and ok_after
    if out["expseg"] and not coalesced:
        print("the tensor's pages were not coalesced: the test did not test", flush=True)
        good = False
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
