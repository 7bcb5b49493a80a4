// Allocation benchmark: native cudaMalloc/cudaFree against expseg's, side by side in one
// process. Run under LD_PRELOAD=libexpseg.so: plain calls go through expseg, while the real
// runtime's functions are taken straight from libcudart.so (dlopen RTLD_NOLOAD + dlsym on its
// handle), and the two are timed alternately so both see the same driver state. Without the
// preload both columns are native (a sanity check: ratios near 1).
//
// Output lines (microseconds, medians over the repetitions):
//   repeat SIZE NATIVE EXPSEG     the same size allocated and freed again and again
//   newsize SIZE NATIVE EXPSEG    a size this process has not used before, each repetition
//   mixed OPS NATIVE EXPSEG       per operation, random sizes over 32 live slots
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <algorithm>
#include <vector>

typedef cudaError_t (*malloc_fn)(void**, size_t);
typedef cudaError_t (*free_fn)(void*);
struct Api { malloc_fn m; free_fn f; };

static double now_us() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static void ck(cudaError_t e, const char* what) { if (e) { fprintf(stderr, "%s -> %d\n", what, e); exit(1); } }
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

static double pair(Api a, size_t s) {
  void* p;
  double t0 = now_us();
  ck(a.m(&p, s), "cudaMalloc");
  ck(a.f(p), "cudaFree");
  return now_us() - t0;
}

static double mixed(Api a, int ops) {
  const size_t MIB = 1 << 20;
  size_t mix[] = {2 * MIB, 6 * MIB, 20 * MIB, 64 * MIB, 130 * MIB, 512 * MIB, 1024 * MIB};
  void* live[32] = {0};
  unsigned seed = 42;
  double t0 = now_us();
  for (int i = 0; i < ops; i++) {
    seed = seed * 1664525u + 1013904223u;
    int k = (seed >> 10) % 32;
    if (live[k]) { ck(a.f(live[k]), "free"); live[k] = 0; }
    else ck(a.m(&live[k], mix[(seed >> 20) % 7] + ((seed >> 3) % 4) * MIB), "malloc");
  }
  for (auto& p : live) if (p) ck(a.f(p), "free");
  return (now_us() - t0) / ops;
}

int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 21;
  ck(cudaFree(0), "init");
  void* rt = dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD);
  if (!rt) rt = dlopen("libcudart.so.12", RTLD_NOW | RTLD_NOLOAD);
  if (!rt) { fprintf(stderr, "libcudart not loaded\n"); return 1; }
  // dlvsym, not dlsym: expseg gives its own hooks to dlsym lookups on a runtime handle (so
  // that ctypes users reach it), but not to versioned lookups.
  const char* ver = dlvsym(rt, "cudaMalloc", "libcudart.so.13") ? "libcudart.so.13" : "libcudart.so.12";
  Api native = {(malloc_fn)dlvsym(rt, "cudaMalloc", ver), (free_fn)dlvsym(rt, "cudaFree", ver)};
  if (!native.m || !native.f) {
    fprintf(stderr, "cannot find the runtime's own cudaMalloc\n");
    return 1;
  }
  Api shim = {cudaMalloc, cudaFree};
  size_t free_b, total;
  ck(cudaMemGetInfo(&free_b, &total), "meminfo");
  const size_t MIB = 1 << 20;
  size_t sizes[] = {2 * MIB, 8 * MIB, 32 * MIB, 128 * MIB, 512 * MIB, 1024 * MIB, 4096 * MIB, 16384 * MIB};
  for (size_t s : sizes) {
    if (s > free_b / 3) continue;
    std::vector<double> tn, ts;
    for (int i = 0; i < reps + 2; i++) {
      // Alternate which goes first, so neither always inherits the other's driver state.
      double a, b;
      if (i % 2) { a = pair(native, s); b = pair(shim, s); } else { b = pair(shim, s); a = pair(native, s); }
      if (i >= 2) { tn.push_back(a); ts.push_back(b); }
    }
    printf("repeat %zu %.2f %.2f\n", s, median(tn), median(ts));
  }
  for (size_t base : {64 * MIB, 1024 * MIB, 4096 * MIB}) {
    if (base > free_b / 3) continue;
    std::vector<double> tn, ts;
    for (int i = 0; i < reps; i++) {
      size_t s = base + (size_t)(i + 1) * 2 * MIB;  // never seen before by either side
      if (i % 2) { tn.push_back(pair(native, s)); ts.push_back(pair(shim, s)); }
      else { ts.push_back(pair(shim, s)); tn.push_back(pair(native, s)); }
    }
    printf("newsize %zu %.2f %.2f\n", base, median(tn), median(ts));
  }
  int ops = 3000;
  double n1 = mixed(native, ops), s1 = mixed(shim, ops), s2 = mixed(shim, ops), n2 = mixed(native, ops);
  printf("mixed %d %.2f %.2f\n", ops, (n1 + n2) / 2, (s1 + s2) / 2);
  return 0;
}
