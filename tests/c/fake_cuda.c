/* A fake libcuda.so.1 for expseg's preload tests. "Device" memory is host memory: physical
 * chunks are memfds, reservations are PROT_NONE mappings, cuMemMap maps the memfd over the
 * reservation, so test programs can read and write pool memory and check it.
 * Environment: FAKE_DEVICES (default 1), FAKE_CAPACITY bytes (default 1 GiB),
 * FAKE_NO_VMM_ATTR=1 (device says no VMM). Built with -DNO_VMM it lacks the VMM symbols. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <pthread.h>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef uint64_t CUdeviceptr;
typedef uint64_t CUmemGenericAllocationHandle;
typedef struct { int type; int requestedHandleTypes; struct { int type; int id; } location; void* win32; unsigned char flags[8]; } CUmemAllocationProp;
typedef struct { struct { int type; int id; } location; int flags; } CUmemAccessDesc;

#define GRAN (2u << 20)
static __thread int bound = 0;
static int initialised = 0;
static long counts[16];
enum { C_CREATE, C_RELEASE, C_RESERVE, C_FREEVA, C_MAP, C_UNMAP, C_ACCESS, C_NCOUNT };
static const char* names[] = {"cuMemCreate", "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree", "cuMemMap", "cuMemUnmap", "cuMemSetAccess"};
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static long envl(const char* n, long d) { const char* v = getenv(n); return v ? atol(v) : d; }
static int ndev(void) { return (int)envl("FAKE_DEVICES", 1); }

/* helpers for the fake runtime and the tests */
void fakecu_bind(void) { bound = 1; initialised = 1; }
long fakecu_count(const char* what) { for (int i = 0; i < C_NCOUNT; i++) if (!strcmp(names[i], what)) return counts[i]; return -1; }

CUresult cuInit(unsigned f) { (void)f; initialised = 1; return 0; }
CUresult cuCtxGetCurrent(CUcontext* c) { if (!initialised) return 3; *c = bound ? (void*)0x1 : 0; return 0; }
CUresult cuDeviceGet(CUdevice* d, int o) { if (o < 0 || o >= ndev()) return 101; *d = o; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = ndev(); return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
  if (d < 0 || d >= ndev()) return 101;
  if (attr == 102) *v = getenv("FAKE_NO_VMM_ATTR") ? 0 : 1; /* VMM supported */
  else if (attr == 103) *v = 1;                             /* POSIX fd handles */
  else *v = 0;
  return 0;
}

#ifndef NO_VMM
#define MAXH 65536
static struct { int fd; size_t size; int mapped; int retained; } handles[MAXH];
static size_t used;
#define MAXM 65536
static struct { uint64_t va; size_t size; int h; unsigned access; } maps[MAXM];

CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* p, int f) { (void)p; (void)f; *g = GRAN; return 0; }
CUresult cuMemCreate(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* p, unsigned long long f) {
  (void)f;
  pthread_mutex_lock(&mu); counts[C_CREATE]++;
  CUresult r = 0;
  if (size == 0 || size % GRAN || p->location.id >= ndev()) r = 1;
  else if (used + size > (size_t)envl("FAKE_CAPACITY", 1L << 30)) r = 2;
  else {
    int i = 1; while (i < MAXH && handles[i].size) i++;
    int fd = memfd_create("fakecu", 0);
    if (i == MAXH || fd < 0 || ftruncate(fd, (off_t)size)) r = 2;
    else { handles[i].fd = fd; handles[i].size = size; used += size; *h = (uint64_t)i; }
  }
  pthread_mutex_unlock(&mu); return r;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  pthread_mutex_lock(&mu); counts[C_RELEASE]++;
  CUresult r = 0;
  if (h > 0 && h < MAXH && handles[h].retained) handles[h].retained--;
  else if (h == 0 || h >= MAXH || !handles[h].size || handles[h].mapped) r = 1;
  else { close(handles[h].fd); used -= handles[h].size; handles[h].size = 0; }
  pthread_mutex_unlock(&mu); return r;
}
static uint64_t last_freed_va; static size_t last_freed_size;
/* For the fake runtime's cudaMalloc: the last freed reservation if it has this size (it then
 * lands there, as the real cudaMalloc does for small sizes). */
uint64_t fakecu_take_freed(size_t size) {
  pthread_mutex_lock(&mu);
  uint64_t va = last_freed_size == size ? last_freed_va : 0;
  if (va) last_freed_size = 0;
  pthread_mutex_unlock(&mu); return va;
}
CUresult cuMemAddressReserve(CUdeviceptr* va, size_t size, size_t align, CUdeviceptr addr, unsigned long long f) {
  (void)align; (void)f;
  pthread_mutex_lock(&mu); counts[C_RESERVE]++; pthread_mutex_unlock(&mu);
  if (size == 0 || size % GRAN) return 1;
  if (addr) { /* a hint: honoured when the range is free */
    void* p = mmap((void*)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == (void*)addr) { *va = addr; return 0; }
    if (p != MAP_FAILED) munmap(p, size);
  }
  char* p = mmap(0, size + GRAN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return 2;
  uintptr_t a = ((uintptr_t)p + GRAN - 1) & ~(uintptr_t)(GRAN - 1);
  if (a > (uintptr_t)p) munmap(p, a - (uintptr_t)p);
  munmap((char*)a + size, (uintptr_t)p + GRAN - a);
  *va = a; return 0;
}
CUresult cuMemAddressFree(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&mu); counts[C_FREEVA]++;
  for (int i = 0; i < MAXM; i++) if (maps[i].size && maps[i].va >= va && maps[i].va < va + size) { pthread_mutex_unlock(&mu); return 1; }
  last_freed_va = va; last_freed_size = size;
  pthread_mutex_unlock(&mu);
  return munmap((void*)va, size) ? 1 : 0;
}
CUresult cuMemMap(CUdeviceptr va, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long f) {
  (void)f;
  pthread_mutex_lock(&mu); counts[C_MAP]++;
  CUresult r = 0;
  if (off || h == 0 || h >= MAXH || handles[h].size != size) r = 1;
  else if (mmap((void*)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handles[h].fd, 0) == MAP_FAILED) r = 2;
  else {
    int i = 0; while (i < MAXM && maps[i].size) i++;
    maps[i].va = va; maps[i].size = size; maps[i].h = (int)h; maps[i].access = 0; handles[h].mapped++;
  }
  pthread_mutex_unlock(&mu); return r;
}
CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&mu); counts[C_UNMAP]++;
  size_t covered = 0;
  for (int i = 0; i < MAXM; i++) if (maps[i].size && maps[i].va >= va && maps[i].va < va + size) {
    covered += maps[i].size; handles[maps[i].h].mapped--; maps[i].size = 0;
  }
  pthread_mutex_unlock(&mu);
  if (covered != size) return 1;
  mmap((void*)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return 0;
}
CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc* d, size_t n) {
  /* Under the lock throughout: a query never reports access the memory does not have yet. */
  pthread_mutex_lock(&mu); counts[C_ACCESS]++;
  size_t covered = 0;
  for (int i = 0; i < MAXM; i++) if (maps[i].size && maps[i].va >= va && maps[i].va < va + size) covered += maps[i].size;
  if (covered != size) { pthread_mutex_unlock(&mu); return 1; }
  int any = 0;
  for (int i = 0; i < MAXM; i++) if (maps[i].size && maps[i].va >= va && maps[i].va < va + size) {
    unsigned acc = maps[i].access;
    for (size_t k = 0; k < n; k++) {
      unsigned bit = 1u << d[k].location.id;
      if (d[k].flags == 3) acc |= bit; else acc &= ~bit;
    }
    if (acc) any = 1;
  }
  /* the host stands in for every device: readable while any device has access */
  mprotect((void*)va, size, any ? PROT_READ | PROT_WRITE : PROT_NONE);
  for (int i = 0; i < MAXM; i++) if (maps[i].size && maps[i].va >= va && maps[i].va < va + size) {
    for (size_t k = 0; k < n; k++) {
      unsigned bit = 1u << d[k].location.id;
      if (d[k].flags == 3) maps[i].access |= bit; else maps[i].access &= ~bit;
    }
  }
  pthread_mutex_unlock(&mu);
  return 0;
}
/* POSIX-fd sharing: the chunk's memfd, duplicated; importing makes a handle of the fd. */
CUresult cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h, int type, unsigned long long f) {
  (void)f;
  if (type != 1 || h == 0 || h >= MAXH || !handles[h].size) return 1;
  *(int*)out = dup(handles[h].fd);
  return *(int*)out < 0 ? 2 : 0;
}
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os, int type) {
  if (type != 1) return 1;
  int fd = dup((int)(intptr_t)os);
  off_t size = fd < 0 ? -1 : lseek(fd, 0, SEEK_END);
  if (size <= 0) return 1;
  pthread_mutex_lock(&mu);
  int i = 1; while (i < MAXH && handles[i].size) i++;
  handles[i].fd = fd; handles[i].size = (size_t)size; handles[i].mapped = 0;
  used += (size_t)size; /* released like any handle: the books balance */
  pthread_mutex_unlock(&mu);
  *h = (uint64_t)i; return 0;
}
/* Like the real driver on VMM memory: the range of the one mapping that contains ptr. */
CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXM; i++) if (maps[i].size && ptr >= maps[i].va && ptr < maps[i].va + maps[i].size) {
    if (base) *base = maps[i].va; if (size) *size = maps[i].size;
    pthread_mutex_unlock(&mu); return 0;
  }
  pthread_mutex_unlock(&mu); return 1;
}
CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr ptr) {
  CUdeviceptr b; size_t n;
  if ((attr < 9 || attr > 12) || cuMemGetAddressRange_v2(&b, &n, ptr)) return 1;
  if (attr == 9 || attr == 10) { *(int*)data = 0; return 0; } /* device 0; VMM: no legacy IPC */
  *(uint64_t*)data = attr == 11 ? b : n; return 0;
}
/* The handle mapped at ptr, with one more reference (released by cuMemRelease). */
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* h, void* ptr) {
  pthread_mutex_lock(&mu); CUresult r = 1;
  for (int i = 0; i < MAXM; i++) if (maps[i].size && (uint64_t)ptr >= maps[i].va && (uint64_t)ptr < maps[i].va + maps[i].size) {
    *h = (uint64_t)maps[i].h; handles[maps[i].h].retained++; r = 0; break;
  }
  pthread_mutex_unlock(&mu); return r;
}
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* p, CUmemGenericAllocationHandle h) {
  if (h == 0 || h >= MAXH || !handles[h].size) return 1;
  memset(p, 0, sizeof *p); p->type = 1; p->requestedHandleTypes = 1; p->location.type = 1; p->location.id = 0;
  return 0;
}
/* Access flags of the mapping containing ptr for one device (3: read-write, 0: none). */
CUresult cuMemGetAccess(unsigned long long* flags, const int* location, CUdeviceptr ptr) {
  pthread_mutex_lock(&mu); CUresult r = 1;
  for (int i = 0; i < MAXM; i++) if (maps[i].size && ptr >= maps[i].va && ptr < maps[i].va + maps[i].size) {
    *flags = (maps[i].access >> location[1]) & 1 ? 3 : 0; r = 0; break;
  }
  pthread_mutex_unlock(&mu); return r;
}
/* Which devices may access the mapping containing va (bit mask), -1 if unmapped. */
long fakecu_access(uint64_t va) {
  pthread_mutex_lock(&mu); long r = -1;
  for (int i = 0; i < MAXM; i++) if (maps[i].size && va >= maps[i].va && va < maps[i].va + maps[i].size) r = maps[i].access;
  pthread_mutex_unlock(&mu); return r;
}
long fakecu_used(void) { return (long)used; }
#endif
