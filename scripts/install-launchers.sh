#!/usr/bin/env bash
# Installs the real launchers that scripts/test-launchers.sh runs the recipes of
# docs/launching.md with, on a Debian-like machine without a GPU (CI, a developer's machine):
#   - Slurm (slurmctld, slurmd, srun, sbatch) and munge, and Open MPI (mpirun): Debian's packages
#     slurm-wlm, munge, openmpi-bin (apt-get; needs root);
#   - torchrun (PyTorch), accelerate and Ray (with its dashboard, for `ray job submit`): pip, into
#     a virtual environment under $EXPSEG_LAUNCHERS_HOME (default ~/.cache/expseg-launchers/venv),
#     never into the system's Python.
# Idempotent: what is present at the wanted version is skipped, so a rerun takes seconds. Prints
# the time each install took. Exits non-zero, with the installer's own message, when one fails.
#     scripts/install-launchers.sh            # both
#     scripts/install-launchers.sh --print-venv   # the venv's path, nothing installed
#
# Versions: the ones the recipes were last run with (docs/launching.md, "How the recipes are
# tested"). PyTorch comes from PyPI: its CPU-only wheels live on PyTorch's own index, which this
# project's machines cannot reach, so this is PyPI's CUDA build with its nvidia-* libraries
# (~4 GB installed); it imports and runs torchrun on a machine without a GPU or driver.
set -euo pipefail

TORCH_VERSION=${TORCH_VERSION:-2.15.0}
ACCELERATE_VERSION=${ACCELERATE_VERSION:-1.15.0}
RAY_VERSION=${RAY_VERSION:-2.60.0}
APT_PACKAGES=(slurm-wlm munge openmpi-bin)

home=${EXPSEG_LAUNCHERS_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/expseg-launchers}
venv=$home/venv
if [ "${1:-}" = --print-venv ]; then echo "$venv"; exit 0; fi

now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
t_all=$(now)

# 1. Debian's packages: the commands each package brings, and whether all are there.
t=$(now)
missing=()
for c in slurmctld slurmd srun sbatch munged mpirun; do
  command -v "$c" >/dev/null || missing+=("$c")
done
if [ ${#missing[@]} = 0 ]; then
  echo "install-launchers: apt ${APT_PACKAGES[*]}: present (skipped)"
else
  [ "$(id -u)" = 0 ] || { echo "install-launchers: ${missing[*]} missing and not root: run as root, or apt-get install ${APT_PACKAGES[*]}" >&2; exit 1; }
  echo "install-launchers: apt ${APT_PACKAGES[*]} (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  # Other apt users on the machine: wait for the lock rather than fail.
  apt=(apt-get -q -y -o DPkg::Lock::Timeout=600)
  log=$(mktemp)
  "${apt[@]}" update >"$log" 2>&1 || { tail -n 30 "$log" >&2; echo "install-launchers: apt-get update failed (above)" >&2; exit 1; }
  "${apt[@]}" install --no-install-recommends "${APT_PACKAGES[@]}" >"$log" 2>&1 ||
    { tail -n 30 "$log" >&2; echo "install-launchers: apt-get install ${APT_PACKAGES[*]} failed (above)" >&2; exit 1; }
  rm -f "$log"
  for c in "${missing[@]}"; do
    command -v "$c" >/dev/null || { echo "install-launchers: $c still missing after apt-get install ${APT_PACKAGES[*]}" >&2; exit 1; }
  done
  echo "install-launchers: apt ${APT_PACKAGES[*]}: installed in $(took "$t")"
fi

# 2. The Python launchers, in the venv.
t=$(now)
want="torch==$TORCH_VERSION accelerate==$ACCELERATE_VERSION ray==$RAY_VERSION"
have() {
  [ -x "$venv/bin/python" ] && [ -x "$venv/bin/torchrun" ] && [ -x "$venv/bin/accelerate" ] && [ -x "$venv/bin/ray" ] || return 1
  "$venv/bin/python" - "$TORCH_VERSION" "$ACCELERATE_VERSION" "$RAY_VERSION" <<'PY' 2>/dev/null || return 1
import sys
from importlib.metadata import version
want = dict(zip(("torch", "accelerate", "ray"), sys.argv[1:]))
sys.exit(any(version(p) != v for p, v in want.items()))
PY
  # ray[default]: the dashboard, which `ray job submit` needs
  "$venv/bin/python" -c 'import aiohttp, ray.dashboard.modules.job.sdk' 2>/dev/null
}
if have; then
  echo "install-launchers: pip $want ray[default] in $venv: present (skipped)"
else
  echo "install-launchers: pip $want ray[default] into $venv"
  mkdir -p "$home"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # No pip cache: the venv is the cache (a second copy of ~4 GB of wheels helps no one).
  PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/pip" install -q \
    "torch==$TORCH_VERSION" "accelerate==$ACCELERATE_VERSION" "ray[default]==$RAY_VERSION" ||
    { echo "install-launchers: pip install into $venv failed (above)" >&2; exit 1; }
  have || { echo "install-launchers: $venv lacks torchrun, accelerate or ray after pip install" >&2; exit 1; }
  echo "install-launchers: pip: installed in $(took "$t") ($(du -sh "$venv" | cut -f1))"
fi
echo "install-launchers: all present, $(took "$t_all")"
