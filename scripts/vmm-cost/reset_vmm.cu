// What cudaDeviceReset does to memory of each kind, natively and under expseg: is a
// cuMemCreate handle (mapped) given back by the reset, can its handle, mapping and reservation
// still be released after it, and is cudaMalloc memory (the pool's, under expseg) given back?
// And how would a library see that a reset happened (a static runtime's reset reaches none of
// expseg's hooks): the current context's pointer and id (cuCtxGetId), and the primary
// context's state, before the reset, right after it, and once the runtime is used again.
//   nvcc -o reset_vmm reset_vmm.cu -lcuda && ./reset_vmm [LD_PRELOAD=libexpseg.so]
#include "probe.cuh"

static void ctx_state(const char* when) {
  CUcontext c = 0;
  unsigned long long id = 0;
  unsigned flags = 0;
  int active = -1;
  CUresult rc = cuCtxGetCurrent(&c);
  CUresult rid = c ? cuCtxGetId(c, &id) : CUDA_ERROR_INVALID_CONTEXT;
  cuDevicePrimaryCtxGetState(0, &flags, &active);
  printf("%s: current_rc=%d ctx=%p id_rc=%d id=%llu primary_active=%d\n", when, (int)rc, (void*)c, (int)rid, id, active);
}

static size_t free_now() {
  size_t f = 0, t = 0;
  CKRT(cudaMemGetInfo(&f, &t));
  return f;
}

int main() {
  const size_t G = 1ull << 30;
  CKRT(cudaSetDevice(0));
  CKRT(cudaFree(0));
  size_t f0 = free_now();

  // A VMM allocation of the program's own, mapped and accessible.
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  CUmemGenericAllocationHandle h;
  CUdeviceptr va;
  CK(cuMemCreate(&h, G, &p, 0));
  CK(cuMemAddressReserve(&va, G, 0, 0, 0));
  CK(cuMemMap(va, G, 0, h, 0));
  CUmemAccessDesc a;
  a.location = p.location;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(va, G, &a, 1));
  // And runtime memory (the pool's under expseg).
  void* m = 0;
  CKRT(cudaMalloc(&m, G));
  size_t f1 = free_now();
  printf("before_reset_used_mib=%zu\n", (f0 - f1) >> 20);
  ctx_state("before_reset");

  CKRT(cudaDeviceReset());
  ctx_state("right_after_reset");
  CKRT(cudaFree(0));
  ctx_state("after_runtime_again");
  size_t f2 = free_now();
  printf("after_reset_used_mib=%zd (2048 = neither given back, 1024 = one, 0 = both)\n",
         (ssize_t)(f0 - f2) / (1 << 20));
  printf("cudaFree_after_reset=%d\n", (int)cudaFree(m));
  cudaGetLastError();
  printf("cuMemUnmap_after_reset=%d cuMemRelease_after_reset=%d cuMemAddressFree_after_reset=%d\n",
         (int)cuMemUnmap(va, G), (int)cuMemRelease(h), (int)cuMemAddressFree(va, G));
  size_t f3 = free_now();
  printf("after_releases_used_mib=%zd\n", (ssize_t)(f0 - f3) / (1 << 20));
  return 0;
}
