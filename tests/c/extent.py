"""Preload test program (Python, on the fake runtime and driver): another allocator's VMM run of
16 mappings of 2 MiB, a handle asked for its start, and the mirror's size read back from the
live report. argv[1]: "torch" puts a stand-in `torch` module in sys.modules whose caching
allocator has one live block over the first 5 MiB of the run (and a free one after it),
asked by a thread without the GIL (ctypes.CDLL releases it: expseg asks through its helper
thread); "torch-gil" the same through ctypes.PyDLL (the caller keeps the GIL: expseg asks at
once); "none" has no torch; "vllm": the stand-in's blocks are 5 MiB at the run's start and 6
MiB at 20 MiB, and the handle is asked as vLLM's custom all-reduce asks it, for the
RANGE_START_ADDR of a tensor 1 MiB into the second block, the consumer's offset taken from it
(the mirror must cover offset + the tensor's 4 MiB). Prints key=value lines."""
import ctypes
import json
import sys
import types

MIB = 1 << 20
PIECE, N = 2 * MIB, 16

cu = ctypes.CDLL("libcuda.so.1")
rt = ctypes.CDLL("libcudart.so.13")


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", Loc),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]


class Access(ctypes.Structure):
    _fields_ = [("location", Loc), ("flags", ctypes.c_int)]


def foreign_run():
    prop = Prop(type=1, handle_types=1, location=Loc(1, 0))
    acc = Access(location=Loc(1, 0), flags=3)
    va = ctypes.c_uint64(0)
    assert cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(N * PIECE), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0)) == 0
    for i in range(N):
        h = ctypes.c_uint64(0)
        assert cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(PIECE), ctypes.byref(prop), ctypes.c_ulonglong(0)) == 0
        assert cu.cuMemMap(ctypes.c_uint64(va.value + i * PIECE), ctypes.c_size_t(PIECE), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)) == 0
    assert cu.cuMemSetAccess(ctypes.c_uint64(va.value), ctypes.c_size_t(N * PIECE), ctypes.byref(acc), ctypes.c_size_t(1)) == 0
    return va.value


def stand_in_torch(va, vllm=False):
    """The parts of torch.cuda the extent query reads."""
    calls = {"snapshots": 0}
    blocks = [
        {"size": 5 * MIB, "state": "active_allocated"},
        {"size": N * PIECE - 5 * MIB, "state": "inactive"},
    ]
    if vllm:
        blocks = [
            {"size": 5 * MIB, "state": "active_allocated"},
            {"size": 15 * MIB, "state": "inactive"},
            {"size": 6 * MIB, "state": "active_allocated"},
            {"size": N * PIECE - 26 * MIB, "state": "inactive"},
        ]

    def snapshot():
        calls["snapshots"] += 1
        return [{"address": va, "total_size": N * PIECE, "blocks": blocks}]

    cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        device_count=lambda: 1,
        memory_stats=lambda d: {"allocation.all.allocated": 1, "allocation.all.freed": 0},
        memory_snapshot=snapshot,
    )
    sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)
    return calls


def process_rows():
    lib = ctypes.CDLL(None)
    f = lib.expseg_stats_json
    f.restype = ctypes.c_size_t
    buf = ctypes.create_string_buffer(1 << 20)
    f(buf, ctypes.c_size_t(len(buf)))
    return json.loads(buf.value.decode()).get("process", {})


def vllm(va):
    """The handle of RANGE_START_ADDR, the offset from it, and the mirror's reach."""
    stand_in_torch(va, vllm=True)
    ptr = va + 21 * MIB
    base = ctypes.c_uint64(0)
    arc = cu.cuPointerGetAttribute(ctypes.byref(base), 11, ctypes.c_uint64(ptr))
    h = (ctypes.c_ubyte * 64)()
    rc = rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base.value))
    p = process_rows()
    off = ptr - base.value
    print(f"attr_rc={arc}")
    print(f"get_rc={rc}")
    print(f"offset_mib={off // MIB}")
    print(f"mirror_bytes={p.get('foreign_mirror_bytes')}")
    print(f"covers_tensor={int(off + 4 * MIB <= (p.get('foreign_mirror_bytes') or 0))}")


def main():
    rt.cudaSetDevice(0)
    va = foreign_run()
    if sys.argv[1] == "vllm":
        return vllm(va)
    calls = stand_in_torch(va) if sys.argv[1].startswith("torch") else None
    lib = ctypes.PyDLL("libcudart.so.13") if sys.argv[1] == "torch-gil" else rt
    h = (ctypes.c_ubyte * 64)()
    rc = lib.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(va))
    rc2 = lib.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(va + 1))
    p = process_rows()
    print(f"get_rc={rc}")
    print(f"again_rc={rc2}")
    print(f"mirror_bytes={p.get('foreign_mirror_bytes')}")
    print(f"made_bytes={p.get('foreign_mirror_bytes_made')}")
    print(f"bounded={p.get('foreign_mirrors_bounded')}")
    print(f"spared={p.get('foreign_mirror_bytes_spared')}")
    if calls is not None:
        print(f"snapshots={calls['snapshots']}")


if __name__ == "__main__":
    main()
