// What one VMM call of PyTorch's expandable segments costs, by kind, natively and under expseg:
// the calls are looked up through the runtime's entry point API, as libc10_cuda does (run under
// expseg with EXPSEG_COALESCE=all, since this program is not libc10_cuda), in PyTorch's pattern:
// a segment grows by N 2 MiB pages (cuMemCreate of each, then cuMemMap of each, then one
// cuMemSetAccess for the N), and shrinks page by page (cuMemUnmap and cuMemRelease of each). Each cycle grows and shrinks
// one segment; prints, per kind, calls and mean microseconds per call over the timed cycles.
// Then the context calls expseg makes around its hooks, natively, 200,000 times each.
//
//   nvcc -O2 -cudart shared -o hook_cost hook_cost.cu -lcuda   (the shared runtime: expseg hands its hooks out
//   through its entry point lookups)
//   ./hook_cost [PAGES=64] [CYCLES=400]
//   EXPSEG_COALESCE=all EXPSEG_REPORT=stderr LD_PRELOAD=libexpseg.so ./hook_cost 64 400
// Under expseg, the exit report's coalescer driver time set against these totals gives the
// time of expseg's own work per hook call.
#include "probe.cuh"

typedef CUresult (*create_t)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
typedef CUresult (*release_t)(CUmemGenericAllocationHandle);
typedef CUresult (*map_t)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*unmap_t)(CUdeviceptr, size_t);
typedef CUresult (*reserve_t)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*addrfree_t)(CUdeviceptr, size_t);
typedef CUresult (*access_t)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);

static void* entry(const char* name) {
  void* f = 0;
  cudaDriverEntryPointQueryResult q;
  CKRT(cudaGetDriverEntryPoint(name, &f, cudaEnableDefault, &q));
  if (!f) {
    printf("no entry point %s\n", name);
    exit(1);
  }
  return f;
}

enum { CREATE, MAP, ACCESS, UNMAP, RELEASE, NK };
static const char* kind[NK] = {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"};
static double tot[NK];
static long cnt[NK];

#define TIMED(k, call)          \
  do {                          \
    double t0_ = now_ms();      \
    CK(call);                   \
    tot[k] += now_ms() - t0_;   \
    cnt[k]++;                   \
  } while (0)

int main(int argc, char** argv) {
  int pages = argc > 1 ? atoi(argv[1]) : 64;
  int cycles = argc > 2 ? atoi(argv[2]) : 400;
  const size_t page = 2ull << 20;
  CKRT(cudaSetDevice(0));
  CKRT(cudaFree(0));
  create_t create = (create_t)entry("cuMemCreate");
  release_t release = (release_t)entry("cuMemRelease");
  map_t map = (map_t)entry("cuMemMap");
  unmap_t unmap = (unmap_t)entry("cuMemUnmap");
  access_t access = (access_t)entry("cuMemSetAccess");
  // The reservation too (expseg coalesces pages only inside reservations it saw made).
  reserve_t reserve = (reserve_t)entry("cuMemAddressReserve");
  addrfree_t addrfree = (addrfree_t)entry("cuMemAddressFree");
  CUdeviceptr va;
  CK(reserve(&va, pages * page, 0, 0, 0));
  CUmemAllocationProp p = pinned_prop(0);
  CUmemAccessDesc a = rw_access(0);
  CUmemGenericAllocationHandle* h = (CUmemGenericAllocationHandle*)calloc(pages, sizeof *h);
  int warm = cycles / 10 + 2;
  double t0 = 0;
  for (int c = 0; c < warm + cycles; c++) {
    if (c == warm) {
      memset(tot, 0, sizeof tot);
      memset(cnt, 0, sizeof cnt);
      t0 = now_ms();
    }
    for (int i = 0; i < pages; i++) TIMED(CREATE, create(&h[i], page, &p, 0));
    for (int i = 0; i < pages; i++) TIMED(MAP, map(va + i * page, page, 0, h[i], 0));
    TIMED(ACCESS, access(va, pages * page, &a, 1));
    for (int i = 0; i < pages; i++) {
      TIMED(UNMAP, unmap(va + i * page, page));
      TIMED(RELEASE, release(h[i]));
    }
  }
  double all = now_ms() - t0;
  long calls = 0;
  for (int k = 0; k < NK; k++) {
    printf("%-16s %8ld calls %9.3f us/call %9.1f ms\n", kind[k], cnt[k], tot[k] * 1e3 / cnt[k], tot[k]);
    calls += cnt[k];
  }
  printf("cycles %d pages %d: %.1f ms, %.3f us/call over %ld calls, %.1f us/cycle\n", cycles, pages, all, all * 1e3 / calls, calls, all * 1e3 / cycles);
  CK(addrfree(va, pages * page));

  // The context calls around expseg's hooks, natively.
  const int n = 200000;
  CUcontext cur, prim;
  CUdevice d;
  unsigned flags;
  int active;
  CK(cuDevicePrimaryCtxRetain(&prim, 0));
  double t = now_ms();
  for (int i = 0; i < n; i++) CK(cuCtxGetCurrent(&cur));
  printf("cuCtxGetCurrent %.3f us\n", (now_ms() - t) * 1e3 / n);
  t = now_ms();
  for (int i = 0; i < n; i++) CK(cuCtxGetDevice(&d));
  printf("cuCtxGetDevice %.3f us\n", (now_ms() - t) * 1e3 / n);
  t = now_ms();
  for (int i = 0; i < n; i++) CK(cuDevicePrimaryCtxGetState(0, &flags, &active));
  printf("cuDevicePrimaryCtxGetState %.3f us\n", (now_ms() - t) * 1e3 / n);
  t = now_ms();
  for (int i = 0; i < n; i++) {
    CK(cuCtxPushCurrent(prim));
    CK(cuCtxPopCurrent(&cur));
  }
  printf("cuCtxPushCurrent+cuCtxPopCurrent %.3f us\n", (now_ms() - t) * 1e3 / n);
  size_t fr, to;
  t = now_ms();
  for (int i = 0; i < 2000; i++) CK(cuMemGetInfo(&fr, &to));
  printf("cuMemGetInfo %.3f us\n", (now_ms() - t) * 1e3 / 2000);
  return 0;
}
