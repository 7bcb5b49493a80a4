"""Range and pointer queries on PyTorch's expandable-segment memory, asked of libcuda through
ctypes as another library asks them: inside a tensor's page, and just past the pages PyTorch
mapped (inside its reservation, where expseg may have memory grown ahead). Natively
(measured: scripts/vmm-cost/range_unmapped.cu) cuMemGetAddressRange names the page, the
RANGE_START_ADDR/RANGE_SIZE attributes the reservation around it; past the pages,
cuMemGetAddressRange answers 500 and the attribute 1. Under expseg the same, except that the
attributes name the page too (docs/contract.md: raw IPC offsets from RANGE_START_ADDR must
stay inside the handle's mirror).

    [LD_PRELOAD=libexpseg.so] python3 shim-tests/torch_range_query.py

Prints one JSON line; exit 1 on a wrong answer."""
import ctypes
import json
import sys

import torch

cu = ctypes.CDLL("libcuda.so.1")
cu.cuMemGetAddressRange_v2.argtypes = [
    ctypes.POINTER(ctypes.c_uint64),
    ctypes.POINTER(ctypes.c_size_t),
    ctypes.c_uint64,
]
cu.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
RANGE_START_ADDR, RANGE_SIZE = 11, 12


def address_range(p):
    b, s = ctypes.c_uint64(7), ctypes.c_size_t(7)
    rc = cu.cuMemGetAddressRange_v2(ctypes.byref(b), ctypes.byref(s), p)
    return rc, b.value, s.value


def attribute(p, a):
    v = ctypes.c_uint64(7)
    rc = cu.cuPointerGetAttribute(ctypes.byref(v), a, p)
    return rc, v.value


# A peak of 4 GiB given back, then a small tensor: under expseg its handle may grow ahead
# past the pages PyTorch maps (bounded by the peak), which is what the query past them meets.
big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
del big
torch.cuda.empty_cache()
x = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
p = x.data_ptr()
seg = next(
    s
    for s in torch.cuda.memory_snapshot()
    if s["address"] <= p < s["address"] + s["total_size"]
)
end = seg["address"] + seg["total_size"]
out = {"segment_mib": seg["total_size"] >> 20}
rc, b, s = address_range(p + 5)
page = (b, s)
out["page"] = {"rc": rc, "size_mib": s >> 20, "contains": b <= p + 5 < b + s}
ra, start = attribute(p + 5, RANGE_START_ADDR)
rs, size = attribute(p + 5, RANGE_SIZE)
out["attributes"] = {
    "rc": [ra, rs],
    "size_mib": size >> 20,
    "reservation": ra == 0 and rs == 0 and start <= seg["address"] and end <= start + size,
    "page": ra == 0 and rs == 0 and (start, size) == page,
}
try:
    ctypes.CDLL(None).expseg_stats_json
    out["expseg"] = True
except AttributeError:
    out["expseg"] = False
rc, b, s = address_range(end)
out["past"] = {"range_rc": rc, "range_zero": b == 0 and s == 0, "attr_rc": attribute(end, RANGE_START_ADDR)[0]}
ok = (
    out["page"]["rc"] == 0
    and out["page"]["contains"]
    and out["page"]["size_mib"] in (2, 20)
    and (out["attributes"]["page"] if out["expseg"] else
         out["attributes"]["reservation"] and out["attributes"]["size_mib"] > out["page"]["size_mib"])
    and out["past"] == {"range_rc": 500, "range_zero": True, "attr_rc": 1}
)
out["ok"] = ok
print(json.dumps(out))
sys.exit(0 if ok else 1)
