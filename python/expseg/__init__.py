"""expseg from Python: is this process running under expseg, and how is its memory doing.

    import expseg
    expseg.active()        # True when libexpseg.so serves this process
    expseg.stats()         # the exit report's figures, now (a dict)
    expseg.trim()          # give back now what is held beyond live memory; bytes given back
    expseg.library_path()  # the installed libexpseg.so, for LD_PRELOAD

No torch import: the figures come from the loaded library through C functions it exports
(``expseg_stats_json``, ``expseg_trim``), called with ctypes.
"""

import ctypes
import json
import os

__all__ = ["active", "stats", "trim", "library_path", "__version__"]

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
    - ``status``, ``pid``, ``rank``, ``version``, ``library``;
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
    """Whether libexpseg.so is loaded in this process and serves it (not disabled by
    ``EXPSEG_DISABLE``, not a forked child, VMM available)."""
    return stats().get("active") is True
