// GPU test of a handle grown ahead that cannot be mapped (f13cfb9): a program that gets its
// VMM functions from the runtime's entry point API, as PyTorch does (coalesced under
// EXPSEG_COALESCE=all), maps a handle of its own, through the driver's exported cuMemMap that
// expseg does not see, two pages past the end of its pages. expseg's next handle, grown ahead
// over that spot, cannot be mapped there: its pages must get memory without the bytes ahead,
// cuMemSetAccess must succeed, and the program's own mapping and every page's data must stay.
// Natively the same calls pass (the control); under expseg the log must show the path ran.
// Built with nvcc -cudart shared (the entry point API of the shared runtime is what expseg
// answers) and -lcuda.
//
//   grow_ahead_test          last line: "N passed, M failed" (exit 0 when none failed)
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <vector>

#define MIB ((size_t)1 << 20)
static int passed, failed;
static void check(bool ok, const char* what, long long got) {
  printf("%s %s (%lld)\n", ok ? "ok  " : "FAIL", what, got);
  ok ? passed++ : failed++;
}

typedef CUresult (*Create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
typedef CUresult (*Release)(CUmemGenericAllocationHandle);
typedef CUresult (*Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*Unmap)(CUdeviceptr, size_t);
typedef CUresult (*SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
typedef CUresult (*Reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*AddressFree)(CUdeviceptr, size_t);
static Create create;
static Release release;
static Map map;
static Unmap unmap;
static SetAccess set_access;
static Reserve reserve;
static AddressFree address_free;

static bool lookup(const char* name, void** fn) {
  cudaDriverEntryPointQueryResult q;
  return cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
         q == cudaDriverEntryPointSuccess && *fn;
}

static CUmemAllocationProp prop0() {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  return p;
}

static CUmemAccessDesc rw0() {
  CUmemAccessDesc a;
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = 0;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return a;
}

// PyTorch's pattern: create every page, map each back to back, one cuMemSetAccess over them.
static CUresult pages(CUdeviceptr va, size_t page, int n, std::vector<CUmemGenericAllocationHandle>& hs) {
  CUmemAllocationProp p = prop0();
  CUresult r;
  for (int i = 0; i < n; i++) {
    CUmemGenericAllocationHandle h;
    if ((r = create(&h, page, &p, 0))) return r;
    hs.push_back(h);
    if ((r = map(va + i * page, page, 0, h, 0))) return r;
  }
  CUmemAccessDesc a = rw0();
  return set_access(va, n * page, &a, 1);
}

static void drop(CUdeviceptr va, size_t page, std::vector<CUmemGenericAllocationHandle>& hs) {
  for (size_t i = 0; i < hs.size(); i++) {
    unmap(va + i * page, page);
    release(hs[i]);
  }
  hs.clear();
}

// Every byte of [va, va+n) equals v.
static bool all(CUdeviceptr va, size_t n, unsigned char v) {
  std::vector<unsigned char> host(n);
  if (cudaMemcpy(host.data(), (void*)va, n, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  for (size_t i = 0; i < n; i++)
    if (host[i] != v) return false;
  return true;
}

int main() {
  if (cudaSetDevice(0) != cudaSuccess || cudaFree(0) != cudaSuccess) {
    printf("SKIP no device\n");
    return 0;
  }
  if (!lookup("cuMemCreate", (void**)&create) || !lookup("cuMemRelease", (void**)&release) ||
      !lookup("cuMemMap", (void**)&map) || !lookup("cuMemUnmap", (void**)&unmap) ||
      !lookup("cuMemSetAccess", (void**)&set_access) ||
      !lookup("cuMemAddressReserve", (void**)&reserve) || !lookup("cuMemAddressFree", (void**)&address_free)) {
    printf("FAIL the entry point API did not answer\n0 passed, 1 failed\n");
    return 1;
  }
  CUmemAllocationProp p = prop0();
  size_t gran = 0;
  cuMemGetAllocationGranularity(&gran, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  const size_t page = 10 * gran;  // 20 MiB on H100/H200, PyTorch's page
  const size_t span = 256 * page;
  CUdeviceptr va = 0;
  CUresult r = reserve(&va, span, 0, 0, 0);
  check(r == CUDA_SUCCESS, "reserve through the entry point API", r);
  if (r) return 1;

  // 1. A peak of 150 pages (3 GiB at 20 MiB) held at once: growing ahead is allowed up to 1/64
  //    of it (two pages), then everything goes back.
  std::vector<CUmemGenericAllocationHandle> peak;
  r = pages(va, page, 150, peak);
  check(r == CUDA_SUCCESS, "150 pages created, mapped, given access", r);
  check(cudaMemset((void*)va, 0x5a, 150 * page) == cudaSuccess && all(va, page, 0x5a) &&
            all(va + 149 * page, page, 0x5a), "150 pages written, the first and last read", 0);
  drop(va, page, peak);

  // 2. The program's own handle two pages on, through the driver's exported calls (expseg's
  //    books do not see it), filled with 0xab.
  CUmemGenericAllocationHandle own;
  r = cuMemCreate(&own, page, &p, 0);
  if (!r) r = cuMemMap(va + 2 * page, page, 0, own, 0);
  CUmemAccessDesc a = rw0();
  if (!r) r = cuMemSetAccess(va + 2 * page, page, &a, 1);
  check(r == CUDA_SUCCESS, "own handle mapped two pages on (driver's exported calls)", r);
  if (r) return 1;
  check(cudaMemset((void*)(va + 2 * page), 0xab, page) == cudaSuccess, "own page written", 0);

  // 3. One page at the start: a handle grown ahead would cover the own mapping.
  std::vector<CUmemGenericAllocationHandle> first;
  r = pages(va, page, 1, first);
  check(r == CUDA_SUCCESS, "one page at the start: cuMemSetAccess succeeds", r);
  check(cudaMemset((void*)va, 0x11, page) == cudaSuccess && all(va, page, 0x11), "its bytes written and read", 0);
  check(all(va + 2 * page, page, 0xab), "the own page keeps its bytes", 0);

  // 4. The next page right after it (growing ahead is off now under expseg).
  std::vector<CUmemGenericAllocationHandle> second;
  r = pages(va + page, page, 1, second);
  check(r == CUDA_SUCCESS, "the next page: cuMemSetAccess succeeds", r);
  check(cudaMemset((void*)(va + page), 0x22, page) == cudaSuccess && all(va + page, page, 0x22), "its bytes written and read", 0);
  check(all(va, page, 0x11) && all(va + 2 * page, page, 0xab), "the first page and the own page keep theirs", 0);
  check(cudaDeviceSynchronize() == cudaSuccess, "no error on the device", cudaGetLastError());

  drop(va + page, page, second);
  drop(va, page, first);
  check(cuMemUnmap(va + 2 * page, page) == CUDA_SUCCESS && cuMemRelease(own) == CUDA_SUCCESS, "own handle unmapped and released", 0);
  check(address_free(va, span) == CUDA_SUCCESS, "reservation freed", 0);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
