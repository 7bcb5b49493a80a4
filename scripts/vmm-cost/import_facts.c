// Facts a consumer needs to map a page that lies inside a coalesced handle of its producer's
// (issue 61's export route): a handle maps only whole, so the consumer maps the whole handle
// where its first page falls; does an access call over only the program's pages of that
// mapping work, how much does one cost by size, and does importing the same descriptor twice
// give the same handle? One process (export, then import of its own descriptor: as a
// consumer would) on device 0. Prints one line per fact.
//
//   nvcc -O2 -o import_facts import_facts.c -lcuda && ./import_facts
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PAGE (20ull << 20)
#define PAGES 51

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

#define TRY(x) r = (x)

int main(void) {
  CUresult r;
  CUdevice d;
  CUcontext ctx;
  if (cuInit(0) || cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&ctx, d) || cuCtxSetCurrent(ctx)) {
    printf("no device\n");
    return 1;
  }
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location = p.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUmemGenericAllocationHandle h, a, b;
  if (cuMemCreate(&h, PAGE * PAGES, &p, 0)) { printf("create failed\n"); return 1; }
  int fd;
  TRY(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  printf("export of a %d-page handle: %d\n", PAGES, (int)r);
  int fd2 = dup(fd);
  TRY(cuMemImportFromShareableHandle(&a, (void*)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CUresult r1 = r;
  TRY(cuMemImportFromShareableHandle(&b, (void*)(uintptr_t)fd2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  printf("import twice (own descriptor, then a dup of it): %d %d, handles %s (%#llx %#llx; created %#llx)\n",
         (int)r1, (int)r, a == b ? "EQUAL" : "different", (unsigned long long)a, (unsigned long long)b,
         (unsigned long long)h);
  CUdeviceptr va;
  cuMemAddressReserve(&va, PAGE * PAGES * 2, 0, 0, 0);
  TRY(cuMemMap(va, PAGE * PAGES, 0, a, 0));
  printf("map the imported handle whole: %d\n", (int)r);
  // Access over three pages in the middle only (a tensor's pages), then a write and a read there.
  TRY(cuMemSetAccess(va + 10 * PAGE, 3 * PAGE, &acc, 1));
  printf("access over 3 pages in the middle of the mapping: %d\n", (int)r);
  if (r == 0) {
    TRY(cuMemsetD32(va + 10 * PAGE, 0x5a5a5a5a, 3 * PAGE / 4));
    CUresult s = cuCtxSynchronize();
    unsigned v = 0;
    CUresult c = cuMemcpyDtoH(&v, va + 12 * PAGE + 4096, 4);
    printf("write and read there: memset %d, sync %d, read %d, value %#x\n", (int)r, (int)s, (int)c, v);
  }
  // A second access call over pages that already have it, and over the whole mapping; timed.
  double t0 = now_ms();
  for (int i = 0; i < 100; i++) cuMemSetAccess(va + 10 * PAGE, 3 * PAGE, &acc, 1);
  double t1 = now_ms();
  for (int i = 0; i < 100; i++) cuMemSetAccess(va, PAGE * PAGES, &acc, 1);
  double t2 = now_ms();
  for (int i = 0; i < 100; i++) cuMemSetAccess(va + 10 * PAGE, PAGE, &acc, 1);
  double t3 = now_ms();
  printf("access call again: 3 pages %.1f us, whole %d pages %.1f us, 1 page %.1f us\n", (t1 - t0) * 10,
         PAGES, (t2 - t1) * 10, (t3 - t2) * 10);
  // Unmap of one page of the whole mapping (PyTorch's close unmaps page by page).
  TRY(cuMemUnmap(va + 10 * PAGE, PAGE));
  printf("unmap of one page of the whole mapping: %d\n", (int)r);
  TRY(cuMemUnmap(va, PAGE * PAGES));
  printf("unmap whole: %d\n", (int)r);
  // Map the same import at two addresses at once (two tensors of one handle).
  TRY(cuMemMap(va, PAGE * PAGES, 0, a, 0));
  CUresult m1 = r;
  CUdeviceptr vb;
  cuMemAddressReserve(&vb, PAGE * PAGES, 0, 0, 0);
  TRY(cuMemMap(vb, PAGE * PAGES, 0, a, 0));
  printf("one import mapped at two addresses: %d %d\n", (int)m1, (int)r);
  cuMemUnmap(va, PAGE * PAGES);
  cuMemUnmap(vb, PAGE * PAGES);
  TRY(cuMemRelease(a));
  CUresult ra = r;
  TRY(cuMemRelease(b));
  printf("release of both imports: %d %d\n", (int)ra, (int)r);
  return 0;
}
