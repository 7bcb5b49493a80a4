#!/usr/bin/env bash
# What scripts/bench_torch.py's deepspeed workloads need on a GPU machine that has no internet.
#
#   scripts/bench-deps.sh DIR            on a machine with internet: download them into DIR
#   scripts/bench-deps.sh --install DIR  on the GPU machine: install them from DIR
#
# DeepSpeed 0.19.8 is a pure-Python sdist: built with DS_BUILD_OPS=0 it compiles nothing, and
# the bench gives it torch's AdamW, so no DeepSpeed op is ever built. Its own needs and
# pydantic's come as CPython 3.12 x86_64 wheels (torch, numpy, packaging, psutil, tqdm and
# nvidia-ml-py are on the GPU machine already). Versions are pinned: pydantic names the one
# pydantic-core it works with, and two versions of a package in DIR stop the whole install.
# --install installs a wheel only where the package is missing or older than the wheel (the
# image holds einops, msgpack, ninja, py-cpuinfo and typing-extensions; nothing is downgraded),
# into the environment `python3 -m pip` installs into, the one torch runs in (a plain `pip`
# there may be another).
set -euo pipefail

WHEELS=(
  hjson==3.1.0
  py-cpuinfo==9.0.0
  einops==0.8.2
  msgpack==1.2.4
  ninja==1.13.2
  pydantic==2.14.4
  pydantic-core==2.50.5        # the version pydantic 2.14.4 asks for (==)
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0    # pydantic 2.14.4 and pydantic-core need >= 4.16.0
)
DEEPSPEED=deepspeed==0.19.8
MAX_MIB=40

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

install() {
  local dir=$1
  [ -f "$dir/deepspeed-0.19.8.tar.gz" ] || { echo "bench-deps: no $dir/deepspeed-0.19.8.tar.gz" >&2; exit 1; }
  # The wheels whose package is missing here or older than the wheel.
  mapfile -t need < <(python3 - "$dir" <<'EOF'
import glob, os, sys
from importlib.metadata import PackageNotFoundError, version
try:
    from packaging.version import Version
except ImportError:  # pip's own copy
    from pip._vendor.packaging.version import Version
for whl in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    name, ver = os.path.basename(whl).split("-")[:2]
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have is None or Version(have) < Version(ver):
        print(whl)
    else:
        print(f"bench-deps: {name} {have} already here (wheel {ver})", file=sys.stderr)
EOF
)
  if [ ${#need[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation "${need[@]}"
  fi
  if [ "$(python3 -c 'from importlib.metadata import version; print(version("deepspeed"))' 2>/dev/null)" != 0.19.8 ]; then
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation "$dir/deepspeed-0.19.8.tar.gz"
  fi
  python3 -c 'from importlib.metadata import version; print("bench-deps: deepspeed", version("deepspeed"), "pydantic", version("pydantic"))'
}

download() {
  local dir=$1
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "${WHEELS[@]}"
  python3 -m pip download -q --no-deps --no-binary :all: -d "$dir" "$DEEPSPEED"
  # One version of each package: an older download left in DIR would stop the install.
  local dups
  dups=$(for f in "$dir"/*.whl "$dir"/*.tar.gz; do basename "$f" | cut -d- -f1 | tr 'A-Z-' 'a-z_'; done | sort | uniq -d)
  if [ -n "$dups" ]; then
    echo "bench-deps: more than one version in $dir of: $dups (remove the others)" >&2
    exit 1
  fi
  ls -l "$dir"
  local kib
  kib=$(du -sk "$dir" | cut -f1)
  echo "bench-deps: $((kib / 1024)).$(( (kib % 1024) * 10 / 1024 )) MiB in $dir"
  if [ "$kib" -gt $((MAX_MIB * 1024)) ]; then
    echo "bench-deps: more than $MAX_MIB MiB" >&2
    exit 1
  fi
}

case "${1:-}" in
  --install) [ $# -eq 2 ] || usage; install "$2" ;;
  -h | --help | "") usage ;;
  -*) usage ;;
  *) [ $# -eq 1 ] || usage; download "$1" ;;
esac
