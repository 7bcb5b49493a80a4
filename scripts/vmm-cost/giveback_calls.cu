// What giving back N adjacent handles costs by the shape of the calls (the per-handle share
// of a GPT-2 step under expseg: about 35 handles, 8.5 GiB, given back in one empty_cache()).
// Each round creates N handles of SIZE MiB back to back in one reservation, maps them, sets
// access per handle, writes 4 KiB of each, waits, then gives them back in one of these ways
// (rounds interleaved, 60 ms of quiet after each so that creation is not what is measured):
//   each          cuMemUnmap + cuMemRelease per handle (what expseg does today)
//   unmap-all     cuMemUnmap of the whole range in one call, then cuMemRelease per handle
//   early         cuMemRelease right after each map (the mapping keeps the memory alive),
//                 then cuMemUnmap per handle frees it
//   early-all     released right after each map, then one cuMemUnmap of the whole range
// Prints, per way, the median time of the give-back and of the making (create, map, release
// right after map where the way does so, access), and checks after each give-back that the
// driver's free memory is back where it was before the round (the contract: given back before
// the call returns).
// nvcc -O2 -o giveback_calls giveback_calls.cu -lcuda   ./giveback_calls [N=34] [SIZE_MIB=256] [ROUNDS=9]
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <vector>
#include "probe.cuh"

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 34;
  size_t size = (size_t)(argc > 2 ? atoi(argv[2]) : 256) << 20;
  int rounds = argc > 3 ? atoi(argv[3]) : 9;
  setvbuf(stdout, NULL, _IONBF, 0);
  cudaFree(0);
  CUmemAllocationProp P;
  memset(&P, 0, sizeof P);
  P.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  P.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  P.location.id = 0;
  CUmemAccessDesc A;
  A.location = P.location;
  A.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, (size_t)n * size, 0, 0, 0));
  const char* ways[] = {"each", "unmap-all", "early", "early-all"};
  std::vector<double> give[4], make[4];
  std::vector<CUmemGenericAllocationHandle> hs(n);
  int bad = 0;
  for (int r = 0; r < rounds; r++) {
    for (int w0 = 0; w0 < 4; w0++) {
      int w = (w0 + r) % 4;
      bool early = w >= 2, all = w % 2 == 1;
      size_t free0, total;
      CK(cuMemGetInfo(&free0, &total));
      double t0 = now_ms();
      for (int i = 0; i < n; i++) {
        CUdeviceptr at = va + (size_t)i * size;
        CK(cuMemCreate(&hs[i], size, &P, 0));
        CK(cuMemMap(at, size, 0, hs[i], 0));
        if (early) CK(cuMemRelease(hs[i]));
        CK(cuMemSetAccess(at, size, &A, 1));
      }
      double t1 = now_ms();
      for (int i = 0; i < n; i++) CK(cuMemsetD8(va + (size_t)i * size, (unsigned char)(i + 1), 4096));
      CK(cuCtxSynchronize());
      double t2 = now_ms();
      if (all) CK(cuMemUnmap(va, (size_t)n * size));
      for (int i = 0; i < n; i++) {
        if (!all) CK(cuMemUnmap(va + (size_t)i * size, size));
        if (!early) CK(cuMemRelease(hs[i]));
      }
      double t3 = now_ms();
      size_t free1;
      CK(cuMemGetInfo(&free1, &total));
      if (free1 + (64ull << 20) < free0) {
        printf("%s round %d: %.0f MiB not back after the give-back\n", ways[w], r, (free0 - free1) / 1048576.0);
        bad++;
      }
      if (r > 0) {  // the first round warms up
        make[w].push_back(t1 - t0);
        give[w].push_back(t3 - t2);
      }
      usleep(60000);
    }
  }
  printf("%d handles of %zu MiB (%.1f GiB), %d rounds (first not counted)\n", n, size >> 20, n * (double)size / (1 << 30), rounds);
  printf("%-10s %12s %12s\n", "way", "give back ms", "make ms");
  for (int w = 0; w < 4; w++) printf("%-10s %12.2f %12.2f\n", ways[w], median(give[w]), median(make[w]));
  CK(cuMemAddressFree(va, (size_t)n * size));
  printf("memory not back after a give-back: %d\n", bad);
  return bad ? 1 : 0;
}
