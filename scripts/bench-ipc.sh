#!/usr/bin/env bash
# IPC benchmark, on a GPU machine: after a cluttered history (1000 mixed allocations and
# frees), for each size, how often cudaIpcGetMemHandle moves pool memory in place (with
# EXPSEG_IPC_MOVE_MAX raised so every size is tried), how long the export takes, how fast a
# mirror refresh runs against a device-to-device copy of the same size.
#
#     scripts/bench-ipc.sh [path/to/libexpseg.so] [OUT_DIR]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
lib=$(readlink -f "${1:-${EXPSEG_LIB:-$here/../target/release/libexpseg.so}}")
out=${2:-$(mktemp -d)}
mkdir -p "$out"
nvcc -O2 -cudart shared -o "$out/ipc_test" "$here/../shim-tests/ipc_test.cu" -lcuda
echo "move tried at every size (EXPSEG_IPC_MOVE_MAX=64G):"
EXPSEG_IPC_MOVE_MAX=64G EXPSEG_LOG=error EXPSEG_REPORT="$out/ipc_bench_move_report.txt" LD_PRELOAD="$lib" "$out/ipc_test" bench | tee "$out/ipc_bench_move.md"
grep -E "ipc_|driver call|cudaMalloc \(IPC\)" "$out/ipc_bench_move_report.txt"
echo "default configuration:"
EXPSEG_LOG=error LD_PRELOAD="$lib" "$out/ipc_test" bench | tee "$out/ipc_bench_default.md"
