"""Compare torch_train.py's native and expseg runs and the expseg exit report; exit 1 on any
difference. Usage: python3 torch_compare.py NATIVE.json SHIM.json REPORT.json"""
import json
import sys

native, shim, report = (json.load(open(p)) for p in sys.argv[1:4])
ok = True


def check(cond, what):
    global ok
    print(("  ok   " if cond else "  FAIL ") + what)
    ok &= bool(cond)


n, s = native["losses"], shim["losses"]
check(len(n) == len(s) and len(n) > 0, f"{len(s)} steps in both runs")
diff = [i for i, (a, b) in enumerate(zip(n, s)) if a != b]
check(not diff, f"losses identical bit for bit (first difference at step {diff[0] if diff else '-'})")
proc = report["process"]
if proc.get("coalesce_pages_created", 0) > 0:
    # PyTorch on expandable segments (expseg's default under LD_PRELOAD): its pages are
    # coalesced into fewer handles, empty_cache gives them back, nothing is lost.
    pages, handles = proc["coalesce_pages_created"], proc["coalesce_handles_created"]
    check(handles < pages, f"{pages} PyTorch pages served by {handles} physical handles")
    check(proc["coalesce_handles_released"] > 0, f"empty_cache reached the driver: {proc['coalesce_handles_released']} handles released")
    check(proc["coalesce_compaction_failures"] == 0, f"compactions {proc['coalesce_compactions']}, failures {proc['coalesce_compaction_failures']}")
    print(f"  stranded at exit {proc['coalesce_stranded_bytes'] >> 20} MiB, peak {proc['coalesce_peak_stranded_bytes'] >> 20} MiB")
else:
    check(report["status"] == "pool active", f"report status: {report['status']}")
    dev = report["devices"][0] if report["devices"] else {}
    check(dev.get("allocs", 0) >= shim["segments_allocated"] * 0.9,
          f"pool allocations {dev.get('allocs', 0)} cover PyTorch's {shim['segments_allocated']} segments")
    check(dev.get("peak_held_bytes", 0) >= 0.9 * shim["max_reserved"],
          f"pool peak {dev.get('peak_held_bytes', 0) >> 20} MiB vs PyTorch peak reserved {shim['max_reserved'] >> 20} MiB")
    pt = proc["passthrough_alloc_bytes"]
    check(pt < 0.05 * shim["max_reserved"] + (64 << 20), f"pass-through bytes {pt >> 20} MiB (small requests only)")
    check(dev.get("frees", 0) > 0, f"empty_cache reached the pool: {dev.get('frees', 0)} frees")
print(f"  peak reserved native {native['max_reserved'] >> 20} MiB, expseg {shim['max_reserved'] >> 20} MiB")
sys.exit(0 if ok else 1)
