"""expseg from Python: is this process running under expseg, and how is its memory doing.

    import expseg
    expseg.active()        # True when libexpseg.so serves this process
    expseg.stats()         # the exit report's figures, now (a dict)
    expseg.trim()          # give back now what is held beyond live memory; bytes given back
    expseg.library_path()  # the installed libexpseg.so, for LD_PRELOAD
    expseg.pause()         # give this process's GPU memory back, bytes kept on the host
    expseg.resume()        # the same memory again, at the same addresses, bytes back
    with expseg.tag("kv_cache"):   # allocations made inside carry the tag
        ...                        # expseg.pause("kv_cache", offload=False) drops only them

No torch import: the figures come from the loaded library through C functions it exports
(``expseg_stats_json``, ``expseg_trim``, ``expseg_pause``, ...), called with ctypes.
"""

import contextlib
import ctypes
import json
import os
import sys
import threading

__all__ = [
    "active",
    "stats",
    "trim",
    "pause",
    "resume",
    "paused",
    "tag",
    "NotActive",
    "PausedMemoryError",
    "ResumeOutOfMemory",
    "library_path",
    "__version__",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIB_DIR = os.path.join(_HERE, "_lib")

try:
    from ._version import __version__
except ImportError:  # a source checkout that was never built
    __version__ = "0+unknown"

NOT_LOADED = (
    "libexpseg.so is not loaded in this process: start it with expseg-run CMD, "
    "or LD_PRELOAD=$(python -m expseg --lib) CMD"
)


def library_path():
    """The libexpseg.so installed with this package (what ``python -m expseg --lib`` prints).

    Raises FileNotFoundError when the package carries no library (a source checkout: build
    it with ``pip install .`` or ``cargo build --release``)."""
    path = os.path.join(_LIB_DIR, "libexpseg.so")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: this expseg package was installed without its library "
            "(install the wheel, or pip install . in a checkout with cargo)"
        )
    return path


def _stats_function():
    """expseg_stats_json of the library loaded in this process (LD_PRELOAD puts it in the
    global scope), or None."""
    try:
        f = ctypes.CDLL(None).expseg_stats_json
    except (AttributeError, OSError):
        return None
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    f.restype = ctypes.c_size_t
    return f


def stats():
    """The live figures of this process, as the exit report has them (``EXPSEG_REPORT``):

    - ``active``: whether expseg serves this process; ``why`` says why not;
    - ``status``, ``pid``, ``rank``, ``version``, ``library`` (with ``EXPSEG_KEEP=auto``, the
      status ends with each GPU's keeping mode and why);
    - ``devices``: per device, the pool's figures (``live_bytes``, ``cached_bytes``,
      ``peak_held_bytes``, ``allocs``, ``ipc_moved``, ``ipc_mirrored``, ...);
    - ``process``: pass-throughs, IPC handle requests, tickets (``ipc_tickets_issued``,
      ``_granted``, ``_refused``, ``_opened``), driver-API allocations, and ``coalesce_*`` rows
      when PyTorch's expandable segments are coalesced;
    - ``config``: the effective ``EXPSEG_*`` settings.

    Outside expseg this does not fail: it returns ``{"active": False, "why": ...}``."""
    f = _stats_function()
    if f is None:
        return {"active": False, "why": NOT_LOADED}
    size = 1 << 16
    for _ in range(8):
        buf = ctypes.create_string_buffer(size)
        need = f(buf, size)
        if need == 0:
            return {"active": False, "why": "libexpseg.so could not produce its figures (internal error)"}
        if need < size:
            return json.loads(buf.value.decode("utf-8", "replace"))
        size = need + 1
    return {"active": False, "why": "libexpseg.so's figures kept growing while being read"}


def trim():
    """Give back to the driver, now, everything this process's expseg holds beyond its
    program's live memory on every device: handles kept for reuse (``EXPSEG_RELEASE_DELAY``),
    cached blocks (``EXPSEG_CACHE_MAX``), and released pages still inside a partly live handle
    (compacted). Returns the bytes given back (0 with the defaults, which keep nothing, and
    outside expseg). ``stats()["process"]["held_beyond_live_bytes"]`` shows what is held."""
    try:
        f = ctypes.CDLL(None).expseg_trim
    except (AttributeError, OSError):
        return 0
    f.argtypes = []
    f.restype = ctypes.c_uint64
    return int(f())


def active():
    """Whether libexpseg.so is loaded in this process and serves it: False where it passes
    every call through (disabled by ``EXPSEG_DISABLE``, a forked child, no NVIDIA driver, a
    driver without VMM, no device served), and ``stats()["why"]`` says which. A device
    without VMM is found out at the first allocation on it; until then this is True."""
    return stats().get("active") is True


def _function(name, argtypes, restype):
    """Function `name` of the libexpseg.so loaded in this process, or None."""
    try:
        f = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    f.argtypes = argtypes
    f.restype = restype
    return f


def _tag_arg(tag):
    if tag is None:
        return None
    if not isinstance(tag, str) or not tag:
        raise ValueError("a tag is a non-empty string")
    return tag.encode("utf-8")


class NotActive(RuntimeError):
    """pause() or resume() in a process where libexpseg.so is loaded but passes every call
    through (``EXPSEG_DISABLE``, no NVIDIA driver, a driver without VMM, a forked child):
    nothing can be paused there, and returning 0 would hide it until a later out-of-memory
    error. ``why`` is ``stats()["why"]``."""

    def __init__(self, what, why):
        super().__init__(f"expseg.{what}(): expseg is loaded but passes every call through ({why}); nothing was paused or resumed")
        self.why = why


class PausedMemoryError(RuntimeError):
    """A pause or resume failed; ``code`` is the CUDA error code and ``bytes`` what it paused
    or resumed anyway. On resume nothing is lost: what could not be made stays paused with
    its host copy, and resume() may be called again (a MemoryError subclass,
    ``ResumeOutOfMemory``, when memory was short)."""

    def __init__(self, what, code, nbytes=0):
        super().__init__(f"expseg.{what}() failed with CUDA error {code} ({nbytes} bytes done)")
        self.code = code
        self.bytes = nbytes


class ResumeOutOfMemory(PausedMemoryError, MemoryError):
    """resume() found too little free GPU memory; what is still paused stays paused."""


def _call(what, f, *args):
    if f is None:
        raise RuntimeError(NOT_LOADED)
    st = stats()
    if st.get("active") is not True:
        raise NotActive(what, st.get("why", "unknown"))
    nbytes = ctypes.c_uint64(0)
    secs = ctypes.c_double(0.0)
    code = f(*args, ctypes.byref(nbytes), ctypes.byref(secs))
    if code == 2 and what == "resume":
        raise ResumeOutOfMemory(what, code, int(nbytes.value))
    if code != 0:
        raise PausedMemoryError(what, code, int(nbytes.value))
    return int(nbytes.value)


def _empty_torch_cache():
    """PyTorch's cached free blocks are mapped memory expseg cannot tell from live tensors:
    give them back first, so they are neither copied nor held (only if torch is in use)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # a torch without CUDA, or a partly imported one
        pass


def pause(tag=None, offload=True, empty_cache=True):
    """Pause this process's GPU memory (every device), or only what was allocated under
    ``tag``: wait for the GPU, copy the live bytes to page-locked host memory
    (``offload=True``) or drop them (``offload=False``), and give the physical memory back
    to the driver, so another process can allocate it. Addresses stay reserved: tensors,
    pointers and captured CUDA graphs stay valid for after ``resume()``.

    No GPU work may touch paused memory until it is resumed (a kernel that does faults).
    Memory shared with other processes by IPC is not paused (the log says how much).
    With ``empty_cache`` (default), PyTorch's cached free blocks are given back first
    (``torch.cuda.empty_cache()``, when torch is imported and its CUDA started), so only
    live tensors are copied. Returns the bytes paused; pausing again pauses what is still
    awake. Raises ``NotActive`` where expseg is loaded but passes every call through (the
    reason in the message and in ``stats()["why"]``)."""
    f = _function(
        "expseg_pause",
        [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_double)],
        ctypes.c_int,
    )
    arg = _tag_arg(tag)
    if f is not None and empty_cache:
        _empty_torch_cache()
    return _call("pause", f, arg, 0 if offload else 1)


def resume(tag=None):
    """Make paused memory (all, or ``tag``'s) again at the same addresses and copy its bytes
    back (discarded memory comes back with undefined contents). Returns the bytes resumed
    (0 when nothing was paused). Raises ``ResumeOutOfMemory`` when the GPU has too little
    free memory: nothing is lost, call again once it is free; ``NotActive`` where expseg
    passes every call through."""
    f = _function(
        "expseg_resume",
        [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_double)],
        ctypes.c_int,
    )
    return _call("resume", f, _tag_arg(tag))


def paused():
    """Bytes of GPU memory paused now (0: nothing is paused, or expseg is not loaded)."""
    f = _function("expseg_paused_bytes", [], ctypes.c_uint64)
    return int(f()) if f is not None else 0


_tags = threading.local()


def _torch_pool():
    """A new PyTorch memory pool on the current device (None without torch, CUDA or
    MemPool): tensors made in it live in segments no other tensor shares. It is the `with`
    block's alone: once the block is left and its tensors are freed, PyTorch's
    ``empty_cache()`` gives its memory back as any other."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return None
        return torch.cuda.MemPool()
    except Exception:  # an older torch without MemPool
        return None


@contextlib.contextmanager
def tag(name, own_pool=True):
    """GPU memory allocated inside the block by the calling thread carries tag ``name``, for
    ``pause(name)`` / ``resume(name)``. Blocks nest; the outer tag comes back at the end.

    With ``own_pool`` (default) and PyTorch in use, tensors made inside come from a PyTorch
    memory pool of the tag's own (``torch.cuda.use_mem_pool``), as torch_memory_saver's
    regions do: PyTorch packs tensors into shared 20 MiB pages, and an untagged tensor in a
    tagged page would be paused with it. Outside expseg this does nothing (no pool either)."""
    arg = _tag_arg(name)
    f = _function("expseg_set_tag", [ctypes.c_char_p], ctypes.c_int)
    if f is None:
        yield
        return
    stack = getattr(_tags, "stack", None)
    if stack is None:
        stack = _tags.stack = []
    pool = _torch_pool() if own_pool else None
    with contextlib.ExitStack() as ctx:
        if pool is not None:
            ctx.enter_context(sys.modules["torch"].cuda.use_mem_pool(pool))
        stack.append(arg)
        f(arg)
        try:
            yield
        finally:
            stack.pop()
            f(stack[-1] if stack else None)
