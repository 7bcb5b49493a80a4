// What a pause and resume of many 20 MiB page handles cost, and which calls can cover several
// handles at once: cuMemSetAccess and cuMemUnmap over a range of adjacent mappings of separate
// handles. Usage: unmap_range [pages, default 2048 = 40 GiB]. Prints one line per way.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now_ms() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
#define PG (20ull << 20)
__global__ void fill(unsigned* p, size_t n, unsigned v) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; for (; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v + (unsigned)i; }
static CUmemAllocationProp P;
static CUmemAccessDesc A;
static int ok(int r, const char* what) { if (r) printf("  %s: CUresult %d\n", what, r); return r == 0; }

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IONBF, 0);
  size_t n = argc > 1 ? strtoull(argv[1], 0, 10) : 2048;
  cudaFree(0);
  cuInit(0);
  memset(&P, 0, sizeof P);
  P.type = CU_MEM_ALLOCATION_TYPE_PINNED; P.location.type = CU_MEM_LOCATION_TYPE_DEVICE; P.location.id = 0;
  P.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  memset(&A, 0, sizeof A);
  A.location.type = CU_MEM_LOCATION_TYPE_DEVICE; A.location.id = 0; A.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va;
  if (!ok(cuMemAddressReserve(&va, n * PG, 0, 0, 0), "reserve")) return 1;
  CUmemGenericAllocationHandle* h = (CUmemGenericAllocationHandle*)calloc(n, sizeof *h);
  // 1. Semantics on 3 pages: one access call and one unmap call over 3 separate mappings.
  for (int i = 0; i < 3; i++) { ok(cuMemCreate(&h[i], PG, &P, 0), "create"); ok(cuMemMap(va + i * PG, PG, 0, h[i], 0), "map"); }
  int r = cuMemSetAccess(va, 3 * PG, &A, 1);
  printf("access over 3 mappings of 3 handles: %d\n", r);
  fill<<<1024, 256>>>((unsigned*)va, 3 * PG / 4, 1);
  printf("kernel over them: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
  r = cuMemUnmap(va, 3 * PG);
  printf("unmap over 3 mappings of 3 handles: %d\n", r);
  if (r) for (int i = 0; i < 3; i++) cuMemUnmap(va + i * PG, PG);
  for (int i = 0; i < 3; i++) cuMemRelease(h[i]);
  int range_unmap = r == 0;
  // 2. n page handles: PyTorch's way (access per page), then expseg's pause (unmap and release
  // each) and resume (create, map each, access per page).
  double t0 = now_ms();
  for (size_t i = 0; i < n; i++) { ok(cuMemCreate(&h[i], PG, &P, 0), "create"); ok(cuMemMap(va + i * PG, PG, 0, h[i], 0), "map"); ok(cuMemSetAccess(va + i * PG, PG, &A, 1), "access"); }
  double t1 = now_ms();
  for (size_t i = 0; i < n; i++) { ok(cuMemUnmap(va + i * PG, PG), "unmap"); ok(cuMemRelease(h[i]), "release"); }
  double t2 = now_ms();
  printf("%zu page handles: create+map+access each %.1f ms; unmap+release each %.1f ms\n", n, t1 - t0, t2 - t1);
  // 3. The same with one access call for the range, and (where the driver takes it) one unmap.
  t0 = now_ms();
  for (size_t i = 0; i < n; i++) { ok(cuMemCreate(&h[i], PG, &P, 0), "create"); ok(cuMemMap(va + i * PG, PG, 0, h[i], 0), "map"); }
  double tm = now_ms();
  ok(cuMemSetAccess(va, n * PG, &A, 1), "access range");
  t1 = now_ms();
  if (range_unmap) ok(cuMemUnmap(va, n * PG), "unmap range");
  else for (size_t i = 0; i < n; i++) cuMemUnmap(va + i * PG, PG);
  double tu = now_ms();
  for (size_t i = 0; i < n; i++) ok(cuMemRelease(h[i]), "release");
  t2 = now_ms();
  printf("%zu page handles: create+map each %.1f ms, one access %.1f ms; %s %.1f ms, release each %.1f ms\n", n, tm - t0, t1 - tm,
         range_unmap ? "one unmap" : "unmap each", tu - t1, t2 - tu);
  // 4. Handles of 1 GiB (51 pages) for the same bytes: the resume that remakes adjacent paused
  // page handles as one.
  size_t per = 51, m = (n + per - 1) / per;
  t0 = now_ms();
  for (size_t j = 0; j < m; j++) {
    size_t pages = (j + 1) * per <= n ? per : n - j * per;
    ok(cuMemCreate(&h[j], pages * PG, &P, 0), "create big");
    ok(cuMemMap(va + j * per * PG, pages * PG, 0, h[j], 0), "map big");
  }
  ok(cuMemSetAccess(va, n * PG, &A, 1), "access big");
  t1 = now_ms();
  for (size_t j = 0; j < m; j++) { size_t pages = (j + 1) * per <= n ? per : n - j * per; ok(cuMemUnmap(va + j * per * PG, pages * PG), "unmap big"); ok(cuMemRelease(h[j]), "release big"); }
  t2 = now_ms();
  printf("%zu handles of up to %zu pages: create+map each, one access %.1f ms; unmap+release each %.1f ms\n", m, per, t1 - t0, t2 - t1);
  // 5. A plain allocation of the same bytes (cudaMalloc, 1 GiB tensors).
  void** p = (void**)calloc(m, sizeof *p);
  t0 = now_ms();
  for (size_t j = 0; j < m; j++) ok(cudaMalloc(&p[j], 1ull << 30), "cudaMalloc");
  t1 = now_ms();
  for (size_t j = 0; j < m; j++) cudaFree(p[j]);
  t2 = now_ms();
  printf("cudaMalloc of %zu x 1 GiB %.1f ms, cudaFree %.1f ms\n", m, t1 - t0, t2 - t1);
  return 0;
}
