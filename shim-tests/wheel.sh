#!/usr/bin/env bash
# The wheel on a GPU machine, with no cargo: install it with pip (into a folder on
# PYTHONPATH, beside the Python that has PyTorch), run shim-tests' PyTorch training under the
# installed `expseg-run` and under `LD_PRELOAD=$(python -m expseg --lib)`, and check that
# `expseg.stats()` taken inside the training equals the exit report's figures, that the
# losses equal the native run's, and that `expseg doctor` passes.
#     shim-tests/wheel.sh WHEEL [LOG_DIR]
set -u
here=$(cd "$(dirname "$0")" && pwd)
wheel=$(readlink -f "${1:?usage: shim-tests/wheel.sh WHEEL [LOG_DIR]}")
logs=${2:-$(mktemp -d)}
mkdir -p "$logs"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIP: no NVIDIA GPU (scripts/test-wheel.sh checks the wheel on the fake runtime)"
  exit 0
fi
passed=0 failed=0
check() { if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "PASS $1"; else failed=$((failed + 1)); echo "FAIL $1${3:+: $3}"; fi; }
echo "wheel: $(basename "$wheel"); cargo: $(command -v cargo || echo none)"
# Into a folder of its own next to the Python that has PyTorch (a venv made from a venv's
# Python would not see PyTorch): what pip puts on PATH lands in $site/bin.
site=$logs/site
python3 -m pip install --quiet --no-index --no-deps --target "$site" "$wheel" >"$logs/install.log" 2>&1
check "wheel installs (no index, no cargo)" $? "$(tail -3 "$logs/install.log")"
export PATH=$site/bin:$PATH PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
py=python3
lib=$("$py" -m expseg --lib)
echo "library: $lib"
"$site/bin/expseg" doctor >"$logs/doctor.log" 2>&1
check "expseg doctor (installed)" $? "$(tail -3 "$logs/doctor.log")"
cat >"$logs/compare.py" <<'PY'
import json, sys
native = json.load(open(sys.argv[1]))
run = json.load(open(sys.argv[2]))
report = json.load(open(sys.argv[3]))
errors = []
if run["losses"] != native["losses"]:
    errors.append("losses differ from the native run")
live = run.get("expseg")
if not live or not live.get("active"):
    errors.append(f"expseg.stats() inside the training: {live}")
else:
    if live["library"] != sys.argv[4]:
        errors.append(f"library {live['library']}")
    # Figures that nothing after the last step changes (kept handles may still be released).
    keys = ("coalesce_pages_created", "coalesce_handles_created", "coalesce_compactions",
            "coalesce_exact_creates", "coalesce_peak_stranded_bytes", "passthrough_allocs", "ipc_handle_requests")
    for k in keys:
        if live["process"].get(k) != report["process"].get(k):
            errors.append(f"{k}: stats() {live['process'].get(k)}, report {report['process'].get(k)}")
    if not live["process"].get("coalesce_pages_created"):
        errors.append("no PyTorch pages counted")
    for a, b in zip(live["devices"], report["devices"]):
        for k in ("allocs", "peak_held_bytes", "peak_live_user_bytes", "created_bytes"):
            if a[k] != b[k]:
                errors.append(f"device {a['device']} {k}: stats() {a[k]}, report {b[k]}")
    if len(live["devices"]) != len(report["devices"]):
        errors.append("device lists differ")
    p = live["process"]
    print(f"stats(): {p.get('coalesce_pages_created')} pages in {p.get('coalesce_handles_created')} handles, "
          f"{p.get('coalesce_compactions')} compactions; status {live['status']!r}")
print("; ".join(errors) or "same losses, stats() equal to the exit report")
sys.exit(1 if errors else 0)
PY
cd "$here"
python3 torch_train.py "$logs/native.json" 300 >"$logs/native.log" 2>&1
check "torch_train native" $? "$(tail -2 "$logs/native.log")"
EXPSEG_REPORT_DIR=$logs/run-reports "$site/bin/expseg-run" "$py" torch_train.py "$logs/run.json" 300 >"$logs/run.log" 2>&1
r=$?; msg=$("$py" "$logs/compare.py" "$logs/native.json" "$logs/run.json" "$(ls "$logs"/run-reports/*.json | head -1)" "$lib" 2>&1) || r=1
check "expseg-run python torch_train.py (installed launcher)" $r "$msg"
echo "$msg" | sed 's/^/    /'
EXPSEG_REPORT=$logs/preload.txt LD_PRELOAD=$lib "$py" torch_train.py "$logs/preload.json" 300 >"$logs/preload.log" 2>&1
r=$?; msg=$("$py" "$logs/compare.py" "$logs/native.json" "$logs/preload.json" "$logs/preload.txt.json" "$lib" 2>&1) || r=1
check "LD_PRELOAD=\$(python -m expseg --lib) python torch_train.py" $r "$msg"
echo "$msg" | sed 's/^/    /'
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
