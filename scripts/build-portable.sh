#!/usr/bin/env bash
# Build libexpseg.so (and its helpers) that load on glibc 2.28 (RHEL 8, Ubuntu 20.04) and
# later, with cargo-zigbuild and zig from PyPI; check the requirement; put the result in
# dist/ with the launch scripts, and the wheels (pip install dist/expseg-*.whl, no cargo
# needed on the target) in dist/: manylinux_2_28 for x86_64, and for aarch64 (GH200) where
# rustup can add that target.
#
#     scripts/build-portable.sh [GLIBC_VERSION]     (default 2.28)
#     EXPSEG_ARCHES="x86_64 aarch64" (default; x86_64 alone: EXPSEG_ARCHES=x86_64)
set -euo pipefail
cd "$(dirname "$0")/.."
glibc=${1:-2.28}
if ! python3 -m ziglang version >/dev/null 2>&1; then
  python3 -m pip install --quiet ziglang
fi
if ! cargo zigbuild --help >/dev/null 2>&1; then
  cargo install --quiet --locked cargo-zigbuild
fi
# The newest of two versions.
newest() { printf '%s\n%s\n' "$1" "$2" | sort -V | tail -n 1; }
mkdir -p dist
rm -f dist/expseg-*.whl
for arch in ${EXPSEG_ARCHES:-x86_64 aarch64}; do
  target=$arch-unknown-linux-gnu
  if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    if ! rustup target add "$target" >/dev/null 2>&1; then
      [ "$arch" = x86_64 ] && { echo "FAIL: no Rust target $target" >&2; exit 1; }
      echo "SKIP $arch: rustup cannot add $target here"
      continue
    fi
  fi
  cargo zigbuild --release --target "$target.$glibc"
  out=target/$target/release
  # The checker runs here (x86_64): it reads ELF files of either architecture.
  check=target/x86_64-unknown-linux-gnu/release/expseg
  [ -x "$check" ] || check=target/release/expseg
  [ -x "$check" ] || cargo build --release --bin expseg
  for f in libexpseg.so expseg expseg-ipc-check; do
    n=$("$check" glibc "$out/$f")
    echo "$arch $f requires glibc $n (target $glibc)"
    [ "$(newest "$n" "$glibc")" = "$glibc" ] || { echo "FAIL: $arch $f needs glibc $n > $glibc" >&2; exit 1; }
  done
  if [ "$arch" = x86_64 ]; then
    cp "$out/libexpseg.so" "$out/expseg" "$out/expseg-ipc-check" scripts/expseg-run scripts/expseg-srun scripts/expseg-report-merge dist/
  fi
  # The wheel of these very files (setup.py's hook takes them from EXPSEG_PREBUILT). A build/
  # left by another wheel (scripts/test-wheel.sh's) goes first: setuptools copies a file into it
  # only when newer than the copy there, and a portable build older than that wheel was skipped.
  rm -rf build
  plat=manylinux_${glibc/./_}_$arch
  # Offline with the setuptools at hand where it is new enough, else pip fetches it.
  EXPSEG_PREBUILT=$out EXPSEG_WHEEL_PLAT=$plat python3 -m pip wheel --quiet --no-deps --no-build-isolation -w dist . >/dev/null 2>&1 ||
    EXPSEG_PREBUILT=$out EXPSEG_WHEEL_PLAT=$plat python3 -m pip wheel --quiet --no-deps -w dist .
  wheel=$(ls dist/expseg-*-"$plat".whl)
  # What was packed is what was checked: read the requirement back out of the wheel.
  tmp=$(mktemp -d)
  python3 -m zipfile -e "$wheel" "$tmp"
  for f in libexpseg.so expseg expseg-ipc-check; do
    n=$("$check" glibc "$tmp/expseg/_lib/$f")
    [ "$(newest "$n" "$glibc")" = "$glibc" ] || { echo "FAIL: $f in $wheel needs glibc $n > $glibc" >&2; exit 1; }
  done
  rm -rf "$tmp" build
  echo "$wheel: highest GLIBC_ requirement within $glibc"
done
echo "dist/: $(ls dist | tr '\n' ' ')"
