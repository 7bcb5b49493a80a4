// How fast can a process that kept released memory (EXPSEG_KEEP=auto, issue 65) give it back
// when a newcomer shows? A newcomer asks for memory ~100 ms after NVML lists it; a give-back of
// 119 GB took 46-261 ms (keep_newcomer.py). This probe fills GIB GiB with handles of one size
// (created, mapped, written, unmapped: what a kept handle is), then releases them all with
// THREADS threads, each its share, and prints the give-back time and rate, twice per setting
// (the first fill of a process against a later one).
//
//   nvcc -O2 -o release_parallel release_parallel.c -lcuda -lpthread && ./release_parallel [GIB]
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK(x)                                                      \
  do {                                                             \
    CUresult r_ = (x);                                             \
    if (r_) {                                                      \
      printf("%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)r_); \
      exit(1);                                                     \
    }                                                              \
  } while (0)

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static CUcontext ctx;
static CUmemGenericAllocationHandle* hs;
static size_t nh;
static int nthreads;

static void* releaser(void* arg) {
  size_t k = (size_t)arg;
  CK(cuCtxSetCurrent(ctx));
  for (size_t i = k; i < nh; i += (size_t)nthreads) CK(cuMemRelease(hs[i]));
  return NULL;
}

int main(int argc, char** argv) {
  size_t gib = argc > 1 ? (size_t)atoll(argv[1]) : 100;
  CUdevice d;
  CK(cuInit(0));
  CK(cuDeviceGet(&d, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, d));
  CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location = p.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t sizes[] = {20ull << 20, 256ull << 20, 2ull << 30};
  int threads[] = {1, 4, 8};
  size_t total = gib << 30;
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, total, 0, 0, 0));
  hs = calloc(total / sizes[0] + 1, sizeof *hs);
  printf("give-back of %zu GiB: handle size, threads, round: ms (GB/ms)\n", gib);
  for (int s = 0; s < 3; s++)
    for (int t = 0; t < 3; t++)
      for (int round = 0; round < 2; round++) {
        size_t sz = sizes[s];
        nh = total / sz;
        double c0 = now_ms();
        for (size_t i = 0; i < nh; i++) {
          CK(cuMemCreate(&hs[i], sz, &p, 0));
          CK(cuMemMap(va + i * sz, sz, 0, hs[i], 0));
        }
        CK(cuMemSetAccess(va, nh * sz, &acc, 1));
        CK(cuMemsetD8(va, 1, nh * sz));
        CK(cuCtxSynchronize());
        CK(cuMemUnmap(va, nh * sz));
        double made = now_ms() - c0;
        nthreads = threads[t];
        pthread_t th[8];
        double t0 = now_ms();
        for (int k = 0; k < nthreads; k++) pthread_create(&th[k], NULL, releaser, (void*)(size_t)k);
        for (int k = 0; k < nthreads; k++) pthread_join(th[k], NULL);
        double ms = now_ms() - t0;
        printf("%5zu MiB x %5zu, %d threads, round %d: %7.1f ms (%.2f GB/ms; filled in %.0f ms)\n",
               sz >> 20, nh, nthreads, round, ms, nh * sz / 1e9 / ms, made);
        fflush(stdout);
      }
  return 0;
}
