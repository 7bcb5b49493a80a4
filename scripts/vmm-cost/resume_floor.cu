// The driver's floor for resuming discarded memory (issue 23: "resume of discarded memory
// <= 2x cudaMalloc of it"): TOTAL GiB given back, then, after QUIET ms (0: at once), made again
// at the same addresses, each way timed (ms, median of 5):
//   vmm1g        1 GiB handles: create, map, set access per handle (what expseg's resume does)
//   vmm1g-once   1 GiB handles: create and map each, one set access over the whole range
//   vmmall       one handle of TOTAL: create, map, access
//   cudaMalloc   cudaMalloc of 1 GiB each (after cudaFree of the same)
// nvcc -O2 -o resume_floor resume_floor.cu -lcuda ; ./resume_floor [TOTAL_GIB=40] [QUIET_MS=1000]
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <vector>
#include "probe.cuh"

static const size_t G = 1ull << 30;

int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 40;
  int quiet = argc > 2 ? atoi(argv[2]) : 1000;
  cudaFree(0);
  CUdevice dev;
  CK(cuCtxGetDevice(&dev));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemAccessDesc acc = {};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, n * G, 0, 0, 0));
  const char* modes[] = {"vmm1g", "vmm1g-once", "vmmall", "cudaMalloc"};
  printf("%d GiB, made again %d ms after it was given back; median of 5 (ms)\n", n, quiet);
  for (int m = 0; m < 4; m++) {
    std::vector<double> ts;
    std::vector<CUmemGenericAllocationHandle> hs(n);
    std::vector<void*> ps(n);
    for (int rep = 0; rep < 6; rep++) {
      double t0 = now_ms();
      if (m == 3) {
        for (int i = 0; i < n; i++)
          if (cudaMalloc(&ps[i], G)) { printf("cudaMalloc failed\n"); return 1; }
      } else if (m == 2) {
        CK(cuMemCreate(&hs[0], n * G, &prop, 0));
        CK(cuMemMap(va, n * G, 0, hs[0], 0));
        CK(cuMemSetAccess(va, n * G, &acc, 1));
      } else {
        for (int i = 0; i < n; i++) {
          CK(cuMemCreate(&hs[i], G, &prop, 0));
          CK(cuMemMap(va + i * G, G, 0, hs[i], 0));
          if (m == 0) CK(cuMemSetAccess(va + i * G, G, &acc, 1));
        }
        if (m == 1) CK(cuMemSetAccess(va, n * G, &acc, 1));
      }
      double t = now_ms() - t0;
      if (rep > 0) ts.push_back(t);  // the first makes the memory the process's at all
      // Touch it, then give it back.
      if (m == 3) {
        for (int i = 0; i < n; i++) cudaMemset(ps[i], 1, G);
        cudaDeviceSynchronize();
        for (int i = 0; i < n; i++) cudaFree(ps[i]);
      } else {
        CK(cuMemsetD8(va, 1, n * G));
        CK(cuCtxSynchronize());
        if (m == 2) {
          CK(cuMemUnmap(va, n * G));
          CK(cuMemRelease(hs[0]));
        } else {
          for (int i = 0; i < n; i++) {
            CK(cuMemUnmap(va + i * G, G));
            CK(cuMemRelease(hs[i]));
          }
        }
      }
      if (quiet) usleep(quiet * 1000);
    }
    std::sort(ts.begin(), ts.end());
    printf("%-11s %8.2f ms  (min %.2f, max %.2f)\n", modes[m], ts[2], ts[0], ts[4]);
    fflush(stdout);
  }
  return 0;
}
