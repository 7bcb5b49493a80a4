// What the driver answers for range and pointer queries at an address inside a reservation
// where nothing is mapped (what a program sees natively past the pages it mapped, where expseg
// may keep memory grown ahead or handles of released pages), next to a mapped address and an
// address outside any reservation. Prints one line per (address, call): rc and values.
//
//     nvcc -O2 -o range_unmapped scripts/vmm-cost/range_unmapped.cu -lcuda && ./range_unmapped
#include "probe.cuh"

int main() {
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  size_t g = 0;
  CK(cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUdeviceptr va = 0;
  CK(cuMemAddressReserve(&va, 32 * g, 0, 0, 0));
  CUmemGenericAllocationHandle h;
  CK(cuMemCreate(&h, 4 * g, &p, 0));
  CK(cuMemMap(va, 4 * g, 0, h, 0));
  CUmemAccessDesc a = {};
  a.location = p.location;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(va, 4 * g, &a, 1));
  struct {
    const char* name;
    CUdeviceptr at;
  } where[] = {{"mapped", va + g}, {"reserved_unmapped", va + 8 * g}, {"unreserved", (CUdeviceptr)4096}};
  for (int i = 0; i < 3; i++) {
    CUdeviceptr at = where[i].at, b = 7;
    size_t s = 7;
    int rc = cuMemGetAddressRange_v2(&b, &s, at);
    unsigned long long off = b - va;
    printf("%s cuMemGetAddressRange rc=%d base_off=%llu size=%zu\n", where[i].name, rc, off, s);
    unsigned long long v = 7;
    rc = cuPointerGetAttribute(&v, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, at);
    printf("%s cuPointerGetAttribute(RANGE_START_ADDR) rc=%d value_off=%llu\n", where[i].name, rc, v - va);
    v = 7;
    rc = cuPointerGetAttribute(&v, CU_POINTER_ATTRIBUTE_RANGE_SIZE, at);
    printf("%s cuPointerGetAttribute(RANGE_SIZE) rc=%d value=%llu\n", where[i].name, rc, v);
    unsigned mt = 77;
    rc = cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, at);
    printf("%s cuPointerGetAttribute(MEMORY_TYPE) rc=%d value=%u\n", where[i].name, rc, mt);
    CUpointer_attribute attrs[5] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                    CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                    CU_POINTER_ATTRIBUTE_MAPPED};
    unsigned long long start = 7, size = 7;
    unsigned type = 77;
    int ordinal = 77;
    int mapped = 77;
    void* data[5] = {&start, &size, &type, &ordinal, &mapped};
    rc = cuPointerGetAttributes(5, attrs, data, at);
    unsigned long long start_off = start - va;
    printf("%s cuPointerGetAttributes rc=%d start_off=%llu size=%llu type=%u ordinal=%d mapped=%d\n", where[i].name, rc,
           start_off, size, type, ordinal, mapped);
    cudaPointerAttributes pa;
    memset(&pa, 0x5a, sizeof pa);
    int rrc = (int)cudaPointerGetAttributes(&pa, (void*)at);
    int rtype = (int)pa.type;
    cudaGetLastError();
    printf("%s cudaPointerGetAttributes rc=%d type=%d\n", where[i].name, rrc, rtype);
  }
  printf("granularity=%zu\n", g);
  CK(cuMemUnmap(va, 4 * g));
  CK(cuMemRelease(h));
  CK(cuMemAddressFree(va, 32 * g));
  return 0;
}
