#!/usr/bin/env bash
# The Python wheel, without a GPU (run by .ci/run): build it from this checkout (cargo runs in
# the build hook), install it into a fresh virtual environment, and check what it puts on
# PATH, `python -m expseg --lib`, and `expseg.active()`/`expseg.stats()` in processes on the
# fake CUDA runtime of the tests (tests/c), against the exit report's figures.
#     scripts/test-wheel.sh [WHEEL]      (a given wheel is installed instead of building one)
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
check() { if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "PASS $1"; else failed=$((failed + 1)); echo "FAIL $1${3:+: $3}"; fi; }

if [ $# -ge 1 ]; then
  wheel=$(readlink -f "$1")
else
  python3 -m pip wheel --quiet --no-deps -w "$work/wheel" "$root" >"$work/build.log" 2>&1
  check "wheel builds from the checkout" $? "$(tail -5 "$work/build.log")"
  wheel=$(ls "$work"/wheel/expseg-*.whl 2>/dev/null | head -1)
fi
[ -f "${wheel:-}" ] || { echo "FAIL no wheel"; exit 1; }
echo "wheel: $(basename "$wheel")"
version=$(sed -n '/^\[package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$root/Cargo.toml")
case "$(basename "$wheel")" in expseg-"$version"-py3-none-*) r=0 ;; *) r=1 ;; esac
check "wheel version is Cargo.toml's ($version), tagged py3-none-<platform>" $r
unzip -l "$wheel" | grep -q ' torch' && r=1 || r=0
grep -qi '^Requires-Dist' <(unzip -p "$wheel" '*/METADATA') && r=1
check "wheel depends on nothing" $r
lics=$(unzip -Z1 "$wheel" | grep -c '\.dist-info/licenses/LICENSE-\(MIT\|APACHE\)$')
metalic=$(unzip -p "$wheel" '*/METADATA' | grep -c '^License-File: LICENSE-\(MIT\|APACHE\)$')
[ "$lics" = 2 ] && [ "$metalic" = 2 ]
check "wheel carries LICENSE-MIT and LICENSE-APACHE, named in its metadata" $? "$lics files, $metalic License-File lines"

python3 -m venv "$work/venv" && "$work/venv/bin/pip" install --quiet --no-index --no-deps "$wheel" >"$work/install.log" 2>&1
check "installs into a fresh virtual environment" $? "$(tail -3 "$work/install.log")"
ls "$work"/venv/lib/python*/site-packages/expseg-*.dist-info/licenses/LICENSE-MIT "$work"/venv/lib/python*/site-packages/expseg-*.dist-info/licenses/LICENSE-APACHE >/dev/null 2>&1
check "the installed package has its license files" $?
bin=$work/venv/bin
py=$bin/python
# From here, nothing of the checkout: the installed files only.
cd "$work"
lib=$("$py" -m expseg --lib)
[ -f "$lib" ] && case "$lib" in "$work"/venv/*) true ;; *) false ;; esac
check "python -m expseg --lib names the installed library ($lib)" $?
[ "$("$py" -c 'import expseg; print(expseg.library_path())')" = "$lib" ]
check "expseg.library_path() is the same" $?
[ "$("$py" -m expseg --version)" = "expseg $version" ] && [ "$("$bin/expseg" -V)" = "expseg $version" ] &&
  [ "$("$py" -c 'import expseg; print(expseg.__version__)')" = "$version" ]
check "versions are $version" $?
for t in "expseg --help" "expseg doctor --help" "expseg-run --help" "expseg-srun --help" "expseg-report-merge --help" "python -m expseg --help"; do
  set -- $t
  cmd=$bin/$1; shift
  out=$("$cmd" "$@" 2>&1)
  r=$?; [ $r = 0 ] && echo "$out" | grep -qi usage || r=1
  check "on PATH: $t" $r "$(echo "$out" | head -2)"
done
# The command line as a user meets it (tests/cli.rs checks the binary's cases one by one):
# help, help CMD = CMD --help, one line with a hint and exit 2 for what it cannot read, and
# installed names, not checkout paths, in every help text.
ok=0
for c in doctor pause resume paused glibc run srun report-merge; do
  a=$("$bin/expseg" help $c 2>&1) && b=$("$bin/expseg" $c --help 2>&1) && [ "$a" = "$b" ] &&
    case "$a" in usage:*) true ;; *) false ;; esac || { ok=1; echo "  expseg help $c: $(head -2 <<<"$a")"; }
done
check "expseg help CMD and expseg CMD --help print the same usage, exit 0" $ok
for t in "expseg --help" "expseg pause --help" "expseg-run --help" "expseg-srun --help" "expseg-report-merge --help"; do
  set -- $t
  cmd=$1; shift
  "$bin/$cmd" "$@" 2>&1 | grep -q 'scripts/' && { ok=1; echo "  $t names a checkout path"; }
done
check "help texts name installed commands, not checkout paths" $ok
refused() { # WANT_LINE COMMAND...: one line on stderr, nothing on stdout, exit 2
  local want=$1; shift
  local o e r; o=$("$@" 2>"$work/refused.err"); r=$?; e=$(cat "$work/refused.err")
  [ "$r" = 2 ] && [ -z "$o" ] && [ "$e" = "$want" ] || { echo "  $*: rc $r, stdout '$o', stderr '$e'"; return 1; }
}
refused "expseg: unknown command 'frobnicate' (see 'expseg --help')" "$bin/expseg" frobnicate &&
  refused "expseg: unknown command 'frobnicate' (see 'expseg --help')" "$bin/expseg" help frobnicate &&
  refused "expseg: unknown option '--frobnicate' (see 'expseg --help')" "$bin/expseg" --frobnicate &&
  refused "expseg pause: unknown option '--frob' (see 'expseg pause --help')" "$bin/expseg" pause --frob &&
  refused "expseg paused: unknown argument '12x' (see 'expseg paused --help')" "$py" -m expseg paused 12x &&
  refused "expseg-run: unknown option '--frob' (see 'expseg-run --help')" "$bin/expseg-run" --frob &&
  refused "expseg-run: CMD missing (usage: expseg-run [--] CMD [ARGS...]; see 'expseg-run --help')" "$bin/expseg-run" &&
  refused "expseg-run: CMD missing (usage: expseg-run [--] CMD [ARGS...]; see 'expseg-run --help')" "$bin/expseg-run" -- &&
  refused "expseg-report-merge: unknown option '--frob' (see 'expseg-report-merge --help')" "$bin/expseg-report-merge" --frob
check "unknown commands, options and arguments: one line with a hint, exit 2" $?
# expseg-run: `--` ends its options, so a command may start with -; a command not found is one
# line, as a shell says it, with a shell's exit status 127 (no script name or line number).
mkdir -p "$work/dash"
printf '#!/bin/sh\necho "ran $*"\n' >"$work/dash/-tool" && chmod +x "$work/dash/-tool"
ok=0
for t in "no-such-command-4711" "-- no-such-command-4711" "-- -h"; do
  set -- $t
  want="expseg-run: ${!#}: command not found"
  o=$(EXPSEG_REPORT=none "$bin/expseg-run" "$@" 2>"$work/nf.err"); r=$?; e=$(cat "$work/nf.err")
  [ $r = 127 ] && [ -z "$o" ] && [ "$e" = "$want" ] || { ok=1; echo "  expseg-run $t: rc $r, stdout '$o', stderr '$e' (want '$want', 127)"; }
done
o=$(PATH="$work/dash:$PATH" EXPSEG_REPORT=none "$bin/expseg-run" -- -tool a b 2>"$work/nf.err"); r=$?
[ $r = 0 ] && [ "$o" = "ran a b" ] || { ok=1; echo "  expseg-run -- -tool a b: rc $r, stdout '$o', stderr '$(cat "$work/nf.err")'"; }
check "expseg-run -- -CMD runs -CMD; a command not found: one line, exit 127" $ok
mkdir -p "$work/ipc" "$work/smi"
printf '#!/bin/sh
case "$1" in --query-gpu=*) echo "0, GPU-0000" ;; esac
' >"$work/smi/nvidia-smi"
chmod +x "$work/smi/nvidia-smi"
ok=0
for sel in "--all" "--tree 999999999" "--gpu 0"; do
  o=$(PATH="$work/smi:$PATH" EXPSEG_IPC_DIR=$work/ipc "$bin/expseg" paused $sel 2>&1)
  r=$?
  case "$o" in "expseg paused: $sel: no expseg process found"*) [ $r = 1 ] ;; *) false ;; esac || { ok=1; echo "  paused $sel: rc $r: $o"; }
done
check "--all, --tree, --gpu that find no expseg process say so, exit 1" $ok
o=$(EXPSEG_IPC_DIR=$work/ipc "$bin/expseg" pause 999999999 2>&1)
r=$?
[ $r = 1 ] && [ "$o" = "pid 999999999: pause failed: no such process" ]
check "expseg pause PID of no process: says so plainly, exit 1" $? "rc $r: $o"
out=$("$bin/expseg" doctor 2>&1)
echo "$out" | grep -q "glibc needed by libexpseg.so .*($lib)"
check "expseg doctor checks the installed library" $? "$(echo "$out" | grep glibc)"
head -1 <<<"$out" | grep -q '^expseg can\(not\)\? work here'
check "expseg doctor says its verdict first" $? "$(head -1 <<<"$out")"
out=$(EXPSEG_DISABEL=1 "$bin/expseg" doctor --json 2>&1)
case "$out" in
  '{"verdict":'*'"unknown_variables":[{"variable":"EXPSEG_DISABEL","did_you_mean":"EXPSEG_DISABLE"}]}')
    [ "$(wc -l <<<"$out")" = 1 ] && "$py" -c 'import json, sys; json.loads(sys.argv[1])' "$out" ;;
  *) false ;;
esac
check "expseg doctor --json: one JSON object, the misspelled EXPSEG_DISABEL named" $? "$(head -c 300 <<<"$out")"

# Stand-in CUDA: the fake runtime and driver of the preload tests.
fakes=$work/fakes
mkdir -p "$fakes"
(cd "$fakes" &&
  cc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o libcuda.so.1 "$root/tests/c/fake_cuda.c" &&
  cc -shared -fPIC -O1 -Wl,-soname,libcudart.so.13 "-Wl,--version-script=$root/tests/c/cudart.map" \
    -o libcudart.so.13 "$root/tests/c/fake_cudart.c" ./libcuda.so.1) >"$work/fakes.log" 2>&1
check "fake CUDA runtime builds" $? "$(tail -3 "$work/fakes.log")"
export LD_LIBRARY_PATH=$fakes
cat >"$work/app.py" <<'PY'
import ctypes, json, os, sys
import expseg
rt = ctypes.CDLL("libcudart.so.13")
p, q = ctypes.c_void_p(), ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(p), 64 << 20) == 0
assert rt.cudaMalloc(ctypes.byref(q), 8 << 20) == 0
live = expseg.stats()
assert rt.cudaFree(q) == 0
end = expseg.stats()
print(json.dumps({"active": expseg.active(), "live": live, "end": end}))
PY
cat >"$work/compare.py" <<'PY'
import json, sys
run = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
mode = sys.argv[3]
report = json.load(open(sys.argv[2])) if mode == "on" else None
errors = []
if mode == "off":
    if run["active"] or run["end"].get("active") or "why" not in run["end"]:
        errors.append(f"outside expseg: {run['end']}")
else:
    live, end = run["live"], run["end"]
    if not run["active"] or not live.get("active"):
        errors.append(f"not active: {live.get('why')}")
    d = live["devices"][0]
    if d["live_user_bytes"] != 72 << 20 or d["allocs"] != 2:
        errors.append(f"live figures: {d['live_user_bytes']} bytes in {d['allocs']} allocations, want 72 MiB in 2")
    # Nothing happens between the last stats() and the exit: the report has the same figures.
    r, e = report["devices"][0], end["devices"][0]
    for k in ("allocs", "frees", "live_user_bytes", "live_bytes", "cached_bytes", "peak_held_bytes", "peak_live_user_bytes", "created_bytes", "released_bytes", "ipc_mirrored"):
        if r[k] != e[k]:
            errors.append(f"{k}: stats() {e[k]}, exit report {r[k]}")
    if e["frees"] != 1 or e["live_user_bytes"] != 64 << 20:
        errors.append(f"after the free: {e['frees']} frees, {e['live_user_bytes']} bytes live")
    if end["library"] != sys.argv[4]:
        errors.append(f"library {end['library']} != {sys.argv[4]}")
print("; ".join(errors) or "same figures")
sys.exit(1 if errors else 0)
PY
EXPSEG_REPORT=$work/r-preload.txt LD_PRELOAD=$lib "$py" app.py >"$work/preload.out" 2>"$work/preload.err"
r=$?; msg=$("$py" compare.py "$work/preload.out" "$work/r-preload.txt.json" on "$lib" 2>&1) || r=1
check "LD_PRELOAD=\$(python -m expseg --lib): expseg.stats() live, and equal to the exit report" $r "$msg $(head -3 "$work/preload.err")"
EXPSEG_REPORT=$work/r-run.txt "$bin/expseg-run" "$py" app.py >"$work/run.out" 2>"$work/run.err"
r=$?; msg=$("$py" compare.py "$work/run.out" "$work/r-run.txt.json" on "$lib" 2>&1) || r=1
check "expseg-run python: the installed launcher finds the installed library; stats() equal to the report" $r "$msg $(head -3 "$work/run.err")"
"$py" -m expseg run "$py" -c 'import expseg, sys; sys.exit(0 if expseg.active() else 1)' 2>/dev/null
check "python -m expseg run: active" $?
"$py" app.py >"$work/off.out" 2>&1
r=$?; msg=$("$py" compare.py "$work/off.out" /dev/null off 2>&1) || r=1
check "without expseg: active() is False and stats() says why" $r "$msg"
EXPSEG_DISABLE=1 LD_PRELOAD=$lib "$py" -c 'import expseg, sys; s = expseg.stats(); sys.exit(0 if not expseg.active() and "EXPSEG_DISABLE" in s["why"] else 1)' 2>/dev/null
check "EXPSEG_DISABLE=1: active() is False, stats() names the variable" $?
# pause() and resume() where expseg passes every call through: an error naming why, not 0.
EXPSEG_DISABLE=1 LD_PRELOAD=$lib "$py" -c '
import expseg, sys
for f in (expseg.pause, expseg.resume):
    try:
        f()
    except expseg.NotActive as e:
        if "EXPSEG_DISABLE" not in str(e):
            sys.exit(1)
    else:
        sys.exit(1)
' 2>/dev/null
check "EXPSEG_DISABLE=1: pause() and resume() raise NotActive, naming the variable" $?
out=$(EXPSEG_DISABLE=2 LD_PRELOAD=$lib "$py" -c 'import expseg; print(expseg.active())' 2>&1)
[ "$out" = "$(printf 'expseg: invalid EXPSEG_DISABLE="2" (expected 1/0, true/false, yes/no or on/off); using the default false\nTrue')" ]
check "EXPSEG_DISABLE=2: one line naming it, and the default (active)" $? "$out"
out=$(EXPSEG_DISABEL=1 LD_PRELOAD=$lib "$py" -c 'import expseg; print(expseg.active())' 2>&1)
[ "$out" = "$(printf 'expseg: EXPSEG_DISABEL is not an expseg variable (did you mean EXPSEG_DISABLE?); ignored\nTrue')" ]
check "EXPSEG_DISABEL=1 (misspelled): one line naming it and EXPSEG_DISABLE; expseg stays on" $? "$out"
# No driver: where libcuda.so.1 cannot be loaded without the fakes (a machine without the
# NVIDIA driver), expseg passes everything through and says so, as expseg doctor does.
if env -u LD_LIBRARY_PATH "$py" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>/dev/null; then
  echo "SKIP no driver: active() is False (libcuda.so.1 loads here)"
else
  out=$(env -u LD_LIBRARY_PATH LD_PRELOAD=$lib "$py" -c 'import expseg; print(expseg.active(), expseg.stats().get("why"))' 2>&1)
  [ "$out" = "False pass-through: libcuda.so.1 cannot be loaded" ]
  check "no NVIDIA driver: active() is False, stats() says why" $? "$out"
  # There expandable segments would cost step time and buy nothing: expseg-run leaves PyTorch's
  # allocator alone (the library too, told by EXPSEG_TORCH_DEFAULTS=0) and says so once.
  out=$(env -u LD_LIBRARY_PATH EXPSEG_REPORT=none "$bin/expseg-run" "$py" -c 'import os; print(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))' 2>"$work/nodrv.err")
  [ "$out" = None ] && [ "$(cat "$work/nodrv.err")" = "expseg-run: no NVIDIA driver here (libcuda.so.1 cannot be loaded): PyTorch's allocator left as it is" ]
  check "no NVIDIA driver: expseg-run leaves PyTorch's allocator alone, in one line" $? "PYTORCH_CUDA_ALLOC_CONF=$out; $(head -3 "$work/nodrv.err")"
fi
cat >"$work/trim.py" <<'PY'
import ctypes, sys
import expseg
rt = ctypes.CDLL("libcudart.so.13")
p = ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(p), 64 << 20) == 0
assert rt.cudaFree(p) == 0
held = expseg.stats()["process"]["held_beyond_live_bytes"]
given = expseg.trim()
after = expseg.stats()["process"]["held_beyond_live_bytes"]
want = int(sys.argv[1])
ok = (held, given, after) == (want, want, 0)
print(f"held {held}, trim() {given}, then held {after}; want {want}, {want}, 0")
sys.exit(0 if ok else 1)
PY
msg=$(LD_PRELOAD=$lib "$py" "$work/trim.py" 0 2>&1)
check "defaults: a freed allocation is not held (held_beyond_live_bytes 0, trim() 0)" $? "$msg"
msg=$(EXPSEG_CACHE_MAX=1G LD_PRELOAD=$lib "$py" "$work/trim.py" $((64 << 20)) 2>&1)
check "EXPSEG_CACHE_MAX=1G: stats() shows the cached 64 MiB, trim() gives them back" $? "$msg"
"$py" -c 'import expseg, sys; sys.exit(0 if expseg.trim() == 0 else 1)' 2>/dev/null
check "without expseg: trim() returns 0" $?
# A live process paused from outside by the installed CLI: sizes for people, and --json.
cat >"$work/sleeper.py" <<'PY'
import ctypes, os, sys, time
rt = ctypes.CDLL("libcudart.so.13")
p = ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(p), 64 << 20) == 0
open(sys.argv[1] + ".ready", "w").close()
while not os.path.exists(sys.argv[1] + ".go"):
    time.sleep(0.02)
PY
EXPSEG_IPC_DIR=$work/ipc LD_PRELOAD=$lib "$py" "$work/sleeper.py" "$work/sleeper" 2>"$work/sleeper.err" &
sleeper=$!
for _ in $(seq 500); do [ -e "$work/sleeper.ready" ] || ! kill -0 $sleeper 2>/dev/null && break; sleep 0.02; done
cli() { EXPSEG_IPC_DIR=$work/ipc "$bin/expseg" "$@" 2>&1; }
p=$(cli pause --pool $sleeper) && q=$(cli paused $sleeper) && j=$(cli paused $sleeper --json) && r=$(cli resume $sleeper --json)
rc=$?
touch "$work/sleeper.go"
wait $sleeper
[ $rc = 0 ] && [[ $p =~ ^"pid $sleeper: paused 64.0 MiB in "[0-9.]+" s"$ ]] && [ "$q" = "pid $sleeper: 64.0 MiB paused" ] &&
  [ "$j" = "{\"pid\":$sleeper,\"command\":\"paused\",\"bytes\":67108864}" ] &&
  [[ $r =~ ^"{\"pid\":$sleeper,\"command\":\"resume\",\"bytes\":67108864,\"seconds\":"[0-9.]+"}"$ ]]
check "expseg pause/paused/resume PID: sizes for people, --json in bytes" $? "$p | $q | $j | $r $(head -2 "$work/sleeper.err")"
# A report directory that cannot be made costs one warning line, not the run.
o=$(EXPSEG_REPORT_DIR=/proc/nope "$bin/expseg-run" "$py" -c 'import expseg, sys; print(expseg.active()); sys.exit(3)' 2>"$work/nope.err")
r=$?
[ $r = 3 ] && [ "$o" = True ] && [ "$(grep -c 'expseg-run: warning: no report: cannot create /proc/nope' "$work/nope.err")" = 1 ]
check "EXPSEG_REPORT_DIR=/proc/nope expseg-run CMD: one warning, CMD runs with its own exit status" $? "rc $r, $o: $(head -3 "$work/nope.err")"
"$bin/expseg-report-merge" "$work/r-preload.txt.json" "$work/r-run.txt.json" >"$work/merge.out" 2>&1
grep -q '| all |' "$work/merge.out"
check "expseg-report-merge merges the reports" $? "$(head -3 "$work/merge.out")"
out=$("$root/shim-tests/run.sh" "$("$py" -m expseg --lib)" 2>&1)
r=$?
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "$out" | tail -1 | grep -q ' 0 failed' || r=1
else
  echo "$out" | grep -q '^SKIP' || r=1
fi
check "the GPU tests with the installed library: shim-tests/run.sh \"\$(python3 -m expseg --lib)\"" $r "$(echo "$out" | tail -2)"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
