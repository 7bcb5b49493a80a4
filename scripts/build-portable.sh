#!/usr/bin/env bash
# Build libexpseg.so (and its helpers) that load on glibc 2.28 (RHEL 8, Ubuntu 20.04) and
# later, with cargo-zigbuild and zig from PyPI; check the requirement; put the result in
# dist/ with the launch scripts.
#
#     scripts/build-portable.sh [GLIBC_VERSION]     (default 2.28)
set -euo pipefail
cd "$(dirname "$0")/.."
glibc=${1:-2.28}
target=x86_64-unknown-linux-gnu
if ! python3 -m ziglang version >/dev/null 2>&1; then
  python3 -m pip install --quiet ziglang
fi
if ! cargo zigbuild --help >/dev/null 2>&1; then
  cargo install --quiet --locked cargo-zigbuild
fi
cargo zigbuild --release --target "$target.$glibc"
out=target/$target/release
need=$("$out/expseg" glibc "$out/libexpseg.so")
echo "libexpseg.so requires glibc $need (target $glibc)"
newest=$(printf '%s\n%s\n' "$need" "$glibc" | sort -V | tail -n 1)
[ "$newest" = "$glibc" ] || { echo "FAIL: the portable build needs glibc $need > $glibc" >&2; exit 1; }
for f in expseg expseg-ipc-check; do
  n=$("$out/expseg" glibc "$out/$f")
  [ "$(printf '%s\n%s\n' "$n" "$glibc" | sort -V | tail -n 1)" = "$glibc" ] || { echo "FAIL: $f needs glibc $n" >&2; exit 1; }
done
mkdir -p dist
cp "$out/libexpseg.so" "$out/expseg" "$out/expseg-ipc-check" scripts/expseg-run scripts/expseg-srun scripts/expseg-report-merge dist/
echo "dist/: $(ls dist | tr '\n' ' ')"
