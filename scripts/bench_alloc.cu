// Allocation benchmark: cudaMalloc+cudaFree pairs, timed on the host (both calls are
// synchronous). Run natively and under expseg by scripts/bench-alloc.sh, which prints ratios.
// Output lines: "repeat SIZE_BYTES MEDIAN_US" and "mixed OPS TOTAL_US".
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>
#include <time.h>

static double now_us() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
#define CK(x) do { cudaError_t e = (x); if (e) { fprintf(stderr, "%s -> %d at line %d\n", #x, e, __LINE__); exit(1); } } while (0)

int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 25;
  CK(cudaFree(0));
  size_t free_b, total;
  CK(cudaMemGetInfo(&free_b, &total));
  const size_t MIB = 1 << 20;
  size_t sizes[] = {2 * MIB, 8 * MIB, 32 * MIB, 128 * MIB, 512 * MIB, 1024 * MIB, 4096 * MIB, 16384 * MIB};
  for (size_t s : sizes) {
    if (s > free_b / 2) continue;
    std::vector<double> t;
    for (int i = 0; i < reps + 2; i++) {
      void* p;
      double t0 = now_us();
      CK(cudaMalloc(&p, s));
      CK(cudaFree(p));
      if (i >= 2) t.push_back(now_us() - t0);
    }
    std::sort(t.begin(), t.end());
    printf("repeat %zu %.2f\n", s, t[t.size() / 2]);
  }
  // Mixed sizes: 32 slots, each op frees a random slot or fills it with a random size.
  size_t mix[] = {2 * MIB, 6 * MIB, 20 * MIB, 64 * MIB, 130 * MIB, 512 * MIB, 1024 * MIB};
  void* live[32] = {0};
  unsigned seed = 42;
  int ops = 4000;
  double t0 = now_us();
  for (int i = 0; i < ops; i++) {
    seed = seed * 1664525u + 1013904223u;
    int k = (seed >> 10) % 32;
    if (live[k]) { CK(cudaFree(live[k])); live[k] = 0; }
    else CK(cudaMalloc(&live[k], mix[(seed >> 20) % 7] + ((seed >> 3) % 4) * MIB));
  }
  for (auto& p : live) if (p) CK(cudaFree(p));
  printf("mixed %d %.1f\n", ops, now_us() - t0);
  return 0;
}
