/* A fake libcuda.so.1 for expseg's preload tests. "Device" memory is host memory: physical
 * chunks are memfds, reservations are PROT_NONE mappings, cuMemMap maps the memfd over the
 * reservation, so test programs can read and write pool memory and check it.
 * Environment: FAKE_DEVICES (default 1), FAKE_CAPACITY bytes (default 1 GiB),
 * FAKE_NO_VMM_ATTR=1 (device says no VMM), FAKE_NO_VMM_DEVICE=N (device N says so). Built with -DNO_VMM it lacks the VMM symbols.
 * Contexts: each device has a primary context (0x100 + device); cuCtxCreate makes others.
 * cuMemAlloc_v2 hands out memfd mappings (the fake runtime's cudaMalloc memory; another
 * process opens them through /proc/PID/fd: the fake's legacy IPC). cuGetProcAddress[_v2]
 * resolves names from a table, never with dlsym, as a real driver does. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
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
static int initialised = 0;
enum { C_CREATE, C_RELEASE, C_RESERVE, C_FREEVA, C_MAP, C_UNMAP, C_ACCESS, C_ALLOC, C_FREE, C_ALLOC_V1, C_SYNC, C_INFO, C_PITCH, C_IPC_GET, C_WRONG_CTX, C_FAULT, C_LEGACY_SYNC, C_LAUNCH, C_FENCE_DEADLOCK, C_GRAPH, C_STALE_READ, C_PRIMARY_RETAIN, C_PRIMARY_RELEASE, C_EXPORT, C_PRIMARY_STATE, C_NCOUNT };
static long counts[C_NCOUNT];
static const char* names[] = {"cuMemCreate", "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
                              "cuMemAlloc_v2", "cuMemFree_v2", "cuMemAlloc", "cuCtxSynchronize", "cuMemGetInfo_v2", "cuMemAllocPitch_v2", "cuIpcGetMemHandle",
                              /* cuMemCreate/Map/Unmap/Release of one device's memory while no context or another
                               * device's is current (allowed by the driver; expseg makes its own calls in the
                               * memory's device's context) */
                              "wrong_context",
                              /* cuMemUnmap of a range a device still has work in flight on (fakecu_launch, not
                               * yet synchronised): what faults a real GPU with an illegal address */
                              "illegal_address",
                              /* cuStreamSynchronize of the legacy default stream (NULL or CU_STREAM_LEGACY) */
                              "legacy_sync", "cuLaunchKernel",
                              /* a wait for the device or its legacy stream while a graph's host function
                               * held that stream: on a GPU that wait never ends when the waiter is the one
                               * to release it; here it gives up after 2 s */
                              "fence_deadlock", "cuGraphLaunch",
                              /* a copy (cuMemcpyDtoD, the runtime's cudaMemcpy) reading a range some
                               * device still has work in flight on: on a GPU it may miss that work's writes */
                              "stale_read",
                              /* references taken and given back on primary contexts */
                              "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuMemExportToShareableHandle",
                              /* looks at a primary context's state (what expseg asks before trusting or
                               * retaining one) */
                              "cuDevicePrimaryCtxGetState"};
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static long envl(const char* n, long d) { const char* v = getenv(n); return v ? atol(v) : d; }
static int ndev(void) { return (int)envl("FAKE_DEVICES", 1); }

/* Contexts: a small per-thread stack; the top is current. */
#define PRIMARY(d) ((CUcontext)(uintptr_t)(0x100 + (d)))
static __thread CUcontext stack[8];
static __thread int depth;
static int created_dev[64], ncreated;
static int ctx_device(CUcontext c) {
  uintptr_t v = (uintptr_t)c;
  if (v >= 0x100 && v < 0x100 + (uintptr_t)ndev()) return (int)(v - 0x100);
  if (v >= 0x200 && v < 0x200 + (uintptr_t)ncreated) return created_dev[v - 0x200];
  return -1;
}
static CUcontext current(void) { return depth ? stack[depth - 1] : 0; }

/* helpers for the fake runtime and the tests */
/* The runtime binds device d's primary context, unless the thread has a context already. */
void fakecu_bind_dev(int d) { initialised = 1; if (!depth) stack[depth++] = PRIMARY(d); else if ((uintptr_t)current() < 0x200) stack[depth - 1] = PRIMARY(d); }
void fakecu_bind(void) { initialised = 1; if (!depth) stack[depth++] = PRIMARY(0); }
/* The device of the thread's current context, -1 if none: the runtime works in the context
 * the driver has current (one pushed with cuCtxPushCurrent included), as the real one does. */
int fakecu_current_device(void) { return ctx_device(current()); }
long fakecu_count(const char* what) { for (int i = 0; i < C_NCOUNT; i++) if (!strcmp(names[i], what)) return counts[i]; return -1; }
static void count(int c) { __atomic_add_fetch(&counts[c], 1, __ATOMIC_RELAXED); }

CUresult cuInit(unsigned f) { (void)f; initialised = 1; return 0; }
CUresult cuCtxGetCurrent(CUcontext* c) { if (!initialised) return 3; *c = current(); return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { if (!c) { if (depth) depth--; return 0; } if (ctx_device(c) < 0) return 201; if (depth) stack[depth - 1] = c; else stack[depth++] = c; return 0; }
CUresult cuCtxPushCurrent_v2(CUcontext c) { if (ctx_device(c) < 0 || depth == 8) return 201; stack[depth++] = c; return 0; }
CUresult cuCtxPopCurrent_v2(CUcontext* c) { if (!depth) return 201; depth--; if (c) *c = stack[depth]; return 0; }
CUresult cuCtxGetDevice(CUdevice* d) { if (!initialised) return 3; int dev = ctx_device(current()); if (dev < 0) return 201; *d = dev; return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) { if (d < 0 || d >= ndev()) return 101; count(C_PRIMARY_RETAIN); *c = PRIMARY(d); return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { if (d < 0 || d >= ndev()) return 101; count(C_PRIMARY_RELEASE); return 0; }
/* A reset: counted, and the primary context gets a new id (the pointer stays, as measured on
 * an H100: scripts/vmm-cost/reset_vmm.cu); the fake's own memory of the context stays. */
static long n_primary_resets;
static unsigned long long primary_gen[64];
CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) {
  if (d < 0 || d >= ndev()) return 101;
  __atomic_add_fetch(&n_primary_resets, 1, __ATOMIC_RELAXED); __atomic_add_fetch(&primary_gen[d], 1, __ATOMIC_RELAXED);
  return 0;
}
long fakecu_primary_resets(void) { return n_primary_resets; }
/* What a statically linked runtime's cudaDeviceReset does: the same reset, reached through the
 * driver's internal tables, never through an exported or looked-up function. */
void fakecu_internal_reset(int d) { if (d >= 0 && d < 64) __atomic_add_fetch(&primary_gen[d], 1, __ATOMIC_RELAXED); }
/* fakecu_slow_next_ctxid(ms): the next cuCtxGetId reads the id, then waits ms before it
 * answers (an id read just before another thread's reset, answered after it). */
static int slow_ctxid_ms;
void fakecu_slow_next_ctxid(int ms) { __atomic_store_n(&slow_ctxid_ms, ms, __ATOMIC_RELAXED); }
CUresult cuCtxGetId(CUcontext c, unsigned long long* id) {
  int d = ctx_device(c);
  if (d < 0) return 201;
  *id = (unsigned long long)(uintptr_t)c * 1000000 + __atomic_load_n(&primary_gen[d], __ATOMIC_RELAXED) * ((uintptr_t)c < 0x200);
  int ms = __atomic_exchange_n(&slow_ctxid_ms, 0, __ATOMIC_RELAXED);
  if (ms) usleep((useconds_t)ms * 1000);
  return 0;
}
CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned* flags, int* active) { if (d < 0 || d >= ndev()) return 101; count(C_PRIMARY_STATE); *flags = 0; *active = initialised; return 0; }
/* Peer access between contexts: only counted and checked (the fake's memory is host memory). */
CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags) {
  (void)flags;
  int me = ctx_device(current()), other = ctx_device(peer);
  if (me < 0 || other < 0) return 201;
  return me == other ? 1 : 0;
}
CUresult cuCtxDisablePeerAccess(CUcontext peer) { return ctx_device(peer) < 0 ? 201 : 0; }
CUresult cuCtxCreate_v2(CUcontext* c, unsigned flags, CUdevice d) {
  (void)flags;
  if (d < 0 || d >= ndev()) return 101;
  pthread_mutex_lock(&mu); int i = ncreated < 64 ? ncreated++ : -1; if (i >= 0) created_dev[i] = d; pthread_mutex_unlock(&mu);
  if (i < 0) return 2;
  *c = (CUcontext)(uintptr_t)(0x200 + i);
  return cuCtxPushCurrent_v2(*c);
}
/* Work in flight: a test launches work of device `dev` over [va, va+n); it ends only when that
 * device is synchronised (cuCtxSynchronize in its context, the runtime's cudaDeviceSynchronize
 * on it). Deterministic stand-in for a kernel still running when its memory is unmapped. */
#define MAXW 256
static struct { int dev; uint64_t va; size_t n; } work[MAXW];
void fakecu_launch(int dev, uint64_t va, size_t n) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXW; i++) if (!work[i].n) { work[i].dev = dev; work[i].va = va; work[i].n = n; break; }
  pthread_mutex_unlock(&mu);
}
void fakecu_sync_dev(int dev) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXW; i++) if (work[i].n && work[i].dev == dev) work[i].n = 0;
  pthread_mutex_unlock(&mu);
}
/* A copy reads [va, va+n): counted when some device still has work in flight on it. */
void fakecu_read(uint64_t va, size_t n) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXW; i++) if (work[i].n && work[i].va < va + n && va < work[i].va + work[i].n) { counts[C_STALE_READ]++; break; }
  pthread_mutex_unlock(&mu);
}
/* Under mu: count an unmap of [va, va+n) while work is in flight on it. */
static void check_inflight(uint64_t va, size_t n) {
  for (int i = 0; i < MAXW; i++) if (work[i].n && work[i].va < va + n && va < work[i].va + work[i].n) { counts[C_FAULT]++; return; }
}
/* The legacy default stream, as far as moves see it: a graph launched there (cuGraphLaunch of
 * a captured [copies, host function]) runs on a thread of its own, after the kernels running
 * on it, and holds the stream while its host function runs: kernels launched meanwhile wait,
 * and a wait for the device counts as a deadlock after 2 s. */
static int legacy_holds, legacy_running;
static int legacy_wait(int deadlock) {
  for (int i = 0; i < 2000 && __atomic_load_n(&legacy_holds, __ATOMIC_SEQ_CST); i++) usleep(1000);
  if (__atomic_load_n(&legacy_holds, __ATOMIC_SEQ_CST)) { if (deadlock) count(C_FENCE_DEADLOCK); return 1; }
  return 0;
}
void fakecu_legacy_wait(void) { legacy_wait(1); }
/* Stream capture: one capturing stream at a time, nodes recorded in order. */
typedef struct { int host; void (*fn)(void*); void* data; CUdeviceptr d, s; size_t n; } Node;
typedef struct { int n; Node nodes[64]; } Graph;
static void* capturing;
static Graph* capture;
CUresult cuStreamBeginCapture_v2(void* st, unsigned mode) {
  (void)mode;
  if (capturing || !st) return 900;
  capture = calloc(1, sizeof(Graph)); capturing = st; return 0;
}
CUresult cuStreamEndCapture(void* st, void** g) { if (st != capturing) return 901; *g = capture; capturing = 0; capture = 0; return 0; }
CUresult cuGraphInstantiateWithFlags(void** e, void* g, unsigned long long f) { (void)f; Graph* c = malloc(sizeof(Graph)); *c = *(Graph*)g; *e = c; return 0; }
CUresult cuGraphDestroy(void* g) { free(g); return 0; }
CUresult cuGraphExecDestroy(void* e) { free(e); return 0; }
static void* graph_thread(void* a) {
  Graph* g = a;
  while (__atomic_load_n(&legacy_running, __ATOMIC_SEQ_CST)) usleep(10); /* earlier kernels end first */
  for (int i = 0; i < g->n; i++) {
    if (g->nodes[i].host) g->nodes[i].fn(g->nodes[i].data);
    else memmove((void*)(uintptr_t)g->nodes[i].d, (void*)(uintptr_t)g->nodes[i].s, g->nodes[i].n);
  }
  free(g);
  __atomic_sub_fetch(&legacy_holds, 1, __ATOMIC_SEQ_CST);
  return 0;
}
CUresult cuGraphLaunch(void* e, void* st) {
  if (st && st != (void*)1) return 1; /* only the legacy stream is modelled */
  Graph* g = malloc(sizeof(Graph)); *g = *(Graph*)e;
  __atomic_add_fetch(&legacy_holds, 1, __ATOMIC_SEQ_CST);
  count(C_GRAPH);
  pthread_t t; pthread_create(&t, 0, graph_thread, g); pthread_detach(t);
  return 0;
}
CUresult cuLaunchHostFunc(void* st, void (*fn)(void*), void* data) {
  if (st && st == capturing && capture->n < 64) { Node* x = &capture->nodes[capture->n++]; x->host = 1; x->fn = fn; x->data = data; return 0; }
  return 801;
}
/* The device's pending work, in ms: FAKE_SYNC_MS, read at the first call, or what a test
 * program sets with fakecu_set_sync_ms (a setenv beside other threads' getenv is a data race
 * in glibc: a test that changed FAKE_SYNC_MS while its threads synchronized crashed). */
static int sync_ms = -1;
int fakecu_sync_ms(void) {
  int v = __atomic_load_n(&sync_ms, __ATOMIC_ACQUIRE);
  if (v < 0) {
    const char* e = getenv("FAKE_SYNC_MS");
    int want = e ? atoi(e) : 0, unread = -1;
    __atomic_compare_exchange_n(&sync_ms, &unread, want, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    v = __atomic_load_n(&sync_ms, __ATOMIC_ACQUIRE);
  }
  return v;
}
void fakecu_set_sync_ms(int ms) { __atomic_store_n(&sync_ms, ms, __ATOMIC_RELEASE); }
static void pending_work(void) { int ms = fakecu_sync_ms(); if (ms > 0) usleep((useconds_t)ms * 1000); }
CUresult cuCtxSynchronize(void) {
  if (!current()) return 201;
  legacy_wait(1);
  fakecu_sync_dev(ctx_device(current()));
  count(C_SYNC);
  pending_work();
  return 0;
}
CUresult cuDeviceGet(CUdevice* d, int o) { if (o < 0 || o >= ndev()) return 101; *d = o; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = ndev(); return 0; }
/* A UUID only with FAKE_UUID set (fa ce 00 .. 00 <device>); else not supported, as before. */
CUresult cuDeviceGetUuid_v2(unsigned char* u, CUdevice d) {
  if (!getenv("FAKE_UUID")) return 801;
  if (d < 0 || d >= ndev()) return 101;
  memset(u, 0, 16); u[0] = 0xfa; u[1] = 0xce; u[15] = (unsigned char)d;
  return 0;
}
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
  if (d < 0 || d >= ndev()) return 101;
  /* VMM supported; FAKE_NO_VMM_ATTR: by no device, FAKE_NO_VMM_DEVICE=N: not by device N */
  if (attr == 102) *v = getenv("FAKE_NO_VMM_ATTR") || envl("FAKE_NO_VMM_DEVICE", -1) == d ? 0 : 1;
  else if (attr == 103) *v = 1;                             /* POSIX fd handles */
  else *v = 0;
  return 0;
}

/* Legacy memory (cuMemAlloc): memfd mappings. */
#define MAXA 65536
static struct { void* p; size_t n; int fd; } allocs[MAXA];
/* Device memory in use. FAKE_SHARED_USED=PATH: one counter in that file for every process
 * that names it (processes sharing one fake GPU, for reclaim tests); legacy allocations then
 * count too and fail beyond FAKE_CAPACITY, as VMM handles do. */
static size_t used_here;
static size_t* used_at(void) {
  static size_t* p;
  if (p) return p;
  const char* path = getenv("FAKE_SHARED_USED");
  if (path) {
    int fd = open(path, O_RDWR | O_CREAT, 0600);
    if (fd >= 0 && ftruncate(fd, sizeof(size_t)) == 0) {
      void* m = mmap(0, sizeof(size_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (m != MAP_FAILED) p = m;
    }
    if (fd >= 0) close(fd);
  }
  if (!p) p = &used_here;
  return p;
}
#define used (*used_at())
static int shared_used(void) { return getenv("FAKE_SHARED_USED") != 0; }
uint64_t fakecu_take_freed(size_t size);
static CUresult mem_alloc(CUdeviceptr* out, size_t n) {
  if (!current()) return 201;
  if (!out || n == 0) return 1;
  if (n >= ((size_t)1 << 48)) return 2;
  /* FAKE_RT_MALLOC_MAX: larger requests run out of memory. */
  if (getenv("FAKE_RT_MALLOC_MAX") && n > (size_t)atol(getenv("FAKE_RT_MALLOC_MAX"))) return 2;
  if (shared_used() && used + n > (size_t)envl("FAKE_CAPACITY", 1L << 30)) return 2;
  int fd = memfd_create("fakert", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)n)) return 2;
  void* m = MAP_FAILED;
#ifndef NO_VMM
  /* FAKE_MALLOC_REUSES_VA: land on a just-freed reservation of the same size, as the real
   * cudaMalloc does for small sizes (what makes an IPC move in place possible). */
  if (getenv("FAKE_MALLOC_REUSES_VA")) {
    uint64_t va = fakecu_take_freed(n);
    if (va) {
      m = mmap((void*)va, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
      if (m != MAP_FAILED && m != (void*)va) { munmap(m, n); m = MAP_FAILED; }
    }
  }
#endif
  if (m == MAP_FAILED) m = mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) { close(fd); return 2; }
  pthread_mutex_lock(&mu);
  int i = 0; while (i < MAXA && allocs[i].p) i++;
  if (i == MAXA) { pthread_mutex_unlock(&mu); munmap(m, n); close(fd); return 2; }
  allocs[i].p = m; allocs[i].n = n; allocs[i].fd = fd;
  if (shared_used()) used += n;
  pthread_mutex_unlock(&mu);
  *out = (CUdeviceptr)(uintptr_t)m; return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t n) { count(C_ALLOC); return mem_alloc(out, n); }
/* Rows padded to 512 bytes; element sizes 4, 8 or 16 only, as the real driver's. */
CUresult cuMemAllocPitch_v2(CUdeviceptr* out, size_t* pitch, size_t w, size_t h, unsigned elem) {
  count(C_PITCH);
  if (!out || !pitch || w == 0 || h == 0 || (elem != 4 && elem != 8 && elem != 16)) return 1;
  size_t p = (w + 511) & ~(size_t)511;
  CUresult r = mem_alloc(out, p * h);
  if (!r) *pitch = p;
  return r;
}
/* The pre-3020 entry point (32-bit pointer and size): counted on its own; it only reports. */
CUresult cuMemAlloc(unsigned* out, unsigned n) { (void)out; (void)n; count(C_ALLOC_V1); return 1; }
CUresult cuMemFree_v2(CUdeviceptr dp) {
  count(C_FREE);
  void* p = (void*)(uintptr_t)dp;
  if (!p) return 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXA; i++) if (allocs[i].p == p) {
    size_t n = allocs[i].n; int fd = allocs[i].fd;
    allocs[i].p = 0;
    if (shared_used()) used -= n;
    pthread_mutex_unlock(&mu);
    munmap(p, n); close(fd);
    return 0;
  }
  pthread_mutex_unlock(&mu);
  return 1; /* CUDA_ERROR_INVALID_VALUE */
}
/* The cuMemAlloc allocation containing p: start, size and memfd (for the fake runtime's IPC). */
int fakecu_lookup(const void* p, void** base, size_t* n, int* fd) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXA; i++) if (allocs[i].p && (const char*)p >= (char*)allocs[i].p && (const char*)p < (char*)allocs[i].p + allocs[i].n) {
    *base = allocs[i].p; *n = allocs[i].n; *fd = allocs[i].fd;
    pthread_mutex_unlock(&mu); return 1;
  }
  pthread_mutex_unlock(&mu); return 0;
}
/* FAKE_MEMINFO_REAL=1: free is FAKE_CAPACITY less the VMM chunks; else 100 MiB of 8 GiB. */
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) {
  count(C_INFO);
  if (!current()) return 201;
  const char* real = getenv("FAKE_MEMINFO_REAL");
  if (real && *real == '1') {
    size_t cap = (size_t)envl("FAKE_CAPACITY", 1L << 30);
    *f = cap - used; *t = cap; return 0;
  }
  *f = 100u << 20; *t = 8ull << 30; return 0;
}

#ifndef NO_VMM
#define MAXH 65536
static struct { int fd; size_t size; int mapped; int retained; int dev; int released; } handles[MAXH];
/* Called under mu: count a call for device `dev`'s memory made from another device's context. */
static void check_ctx(int dev) { if (dev >= 0 && ctx_device(current()) != dev) counts[C_WRONG_CTX]++; }
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
    else { handles[i].fd = fd; handles[i].size = size; handles[i].dev = p->location.id; used += size; *h = (uint64_t)i; check_ctx(p->location.id); }
  }
  pthread_mutex_unlock(&mu); return r;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  pthread_mutex_lock(&mu); counts[C_RELEASE]++;
  CUresult r = 0;
  if (h > 0 && h < MAXH) check_ctx(handles[h].dev);
  if (h > 0 && h < MAXH && handles[h].retained) handles[h].retained--;
  /* FAKE_RELEASE_MAPPED=1: as CUDA documents, a mapped handle's release frees the memory at
   * its last unmap (the default answers 1, so that a release of a page still mapped by
   * expseg's own books shows as an error). */
  else if (h > 0 && h < MAXH && handles[h].size && handles[h].mapped && !handles[h].released && getenv("FAKE_RELEASE_MAPPED")) handles[h].released = 1;
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
/* Reservations, for the pointer attributes RANGE_START_ADDR/RANGE_SIZE, which name the
 * reservation around a VMM mapping (measured: scripts/vmm-cost/range_unmapped.cu). */
#define MAXR 4096
static struct { uint64_t va; size_t size; } resv[MAXR];
static void note_reserved(uint64_t va, size_t size) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXR; i++) if (!resv[i].size) { resv[i].va = va; resv[i].size = size; break; }
  pthread_mutex_unlock(&mu);
}
/* The reservation containing ptr (call with mu held): 0 if none. */
static int reservation_of(uint64_t ptr, uint64_t* va, uint64_t* size) {
  for (int i = 0; i < MAXR; i++) if (resv[i].size && ptr >= resv[i].va && ptr < resv[i].va + resv[i].size) {
    *va = resv[i].va; *size = resv[i].size; return 1;
  }
  return 0;
}
CUresult cuMemAddressReserve(CUdeviceptr* va, size_t size, size_t align, CUdeviceptr addr, unsigned long long f) {
  (void)align; (void)f;
  pthread_mutex_lock(&mu); counts[C_RESERVE]++; pthread_mutex_unlock(&mu);
  if (size == 0 || size % GRAN) return 1;
  if (addr) { /* a hint: honoured when the range is free */
    void* p = mmap((void*)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == (void*)addr) { *va = addr; note_reserved(addr, size); return 0; }
    if (p != MAP_FAILED) munmap(p, size);
  }
  char* p = mmap(0, size + GRAN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return 2;
  uintptr_t a = ((uintptr_t)p + GRAN - 1) & ~(uintptr_t)(GRAN - 1);
  if (a > (uintptr_t)p) munmap(p, a - (uintptr_t)p);
  munmap((char*)a + size, (uintptr_t)p + GRAN - a);
  *va = a; note_reserved(a, size); return 0;
}
CUresult cuMemAddressFree(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&mu); counts[C_FREEVA]++;
  for (int i = 0; i < MAXM; i++) if (maps[i].size && maps[i].va >= va && maps[i].va < va + size) { pthread_mutex_unlock(&mu); return 1; }
  for (int i = 0; i < MAXR; i++) if (resv[i].size && resv[i].va == va) resv[i].size = 0;
  last_freed_va = va; last_freed_size = size;
  pthread_mutex_unlock(&mu);
  int r = munmap((void*)va, size) ? 1 : 0;
  /* FAKE_FREEVA_MS: the first 2 MiB range freed stays free that long before the call
   * returns (the window in which another thread's cudaMalloc may take it). */
  static int slept;
  if (size == GRAN && getenv("FAKE_FREEVA_MS") && !__atomic_exchange_n(&slept, 1, __ATOMIC_RELAXED))
    usleep((useconds_t)envl("FAKE_FREEVA_MS", 0) * 1000);
  return r;
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
    check_ctx(handles[h].dev);
  }
  pthread_mutex_unlock(&mu); return r;
}
CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&mu); counts[C_UNMAP]++; check_inflight(va, size);
  size_t covered = 0;
  for (int i = 0; i < MAXM; i++) if (maps[i].size && maps[i].va >= va && maps[i].va < va + size) {
    int h = maps[i].h;
    covered += maps[i].size; handles[h].mapped--; maps[i].size = 0; check_ctx(handles[h].dev);
    if (!handles[h].mapped && handles[h].released) { close(handles[h].fd); used -= handles[h].size; handles[h].size = 0; handles[h].released = 0; }
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
  count(C_EXPORT);
  if (type != 1 || h == 0 || h >= MAXH || !handles[h].size) return 1;
  *(int*)out = dup(handles[h].fd);
  return *(int*)out < 0 ? 2 : 0;
}
/* A dma-buf of a mapped range (type 1, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD): a descriptor of
 * /dev/null stands for it. */
CUresult cuMemGetHandleForAddressRange(void* out, CUdeviceptr ptr, size_t size, int type, unsigned long long f) {
  (void)f;
  if (type != 1 || !out || !ptr || !size) return 1;
  *(int*)out = open("/dev/null", O_RDONLY);
  return *(int*)out < 0 ? 2 : 0;
}
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os, int type) {
  if (type != 1) return 1;
  int fd = dup((int)(intptr_t)os);
  off_t size = fd < 0 ? -1 : lseek(fd, 0, SEEK_END);
  if (size <= 0) return 1;
  pthread_mutex_lock(&mu);
  int i = 1; while (i < MAXH && handles[i].size) i++;
  handles[i].fd = fd; handles[i].size = (size_t)size; handles[i].mapped = 0; handles[i].dev = -1; handles[i].released = 0;
  used += (size_t)size; /* released like any handle: the books balance */
  pthread_mutex_unlock(&mu);
  *h = (uint64_t)i; return 0;
}
/* Like the real driver on VMM memory: the range of the one mapping that contains ptr. */
/* Nothing mapped at ptr: CUDA_ERROR_NOT_FOUND with 0 and 0 written, as measured. */
CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXM; i++) if (maps[i].size && ptr >= maps[i].va && ptr < maps[i].va + maps[i].size) {
    if (base) *base = maps[i].va; if (size) *size = maps[i].size;
    pthread_mutex_unlock(&mu); return 0;
  }
  pthread_mutex_unlock(&mu);
  if (base) *base = 0; if (size) *size = 0;
  return 500;
}
/* The device of the handle mapped at ptr (0 for an imported one). */
static int device_at(CUdeviceptr ptr) {
  int d = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXM; i++) if (maps[i].size && ptr >= maps[i].va && ptr < maps[i].va + maps[i].size) {
    if (handles[maps[i].h].dev > 0) d = handles[maps[i].h].dev;
    break;
  }
  pthread_mutex_unlock(&mu);
  return d;
}
CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr ptr) {
  CUdeviceptr b; size_t n;
  if ((attr < 9 || attr > 12) || cuMemGetAddressRange_v2(&b, &n, ptr)) return 1;
  if (attr == 9) { *(int*)data = device_at(ptr); return 0; } /* the mapping's device */
  if (attr == 10) { *(int*)data = 0; return 0; }            /* VMM: no legacy IPC */
  /* The range attributes name the reservation around the mapping, as measured. */
  uint64_t rv, rs;
  pthread_mutex_lock(&mu);
  if (reservation_of(ptr, &rv, &rs)) { b = rv; n = rs; }
  pthread_mutex_unlock(&mu);
  *(uint64_t*)data = attr == 11 ? b : n; return 0;
}
CUresult cuPointerGetAttributes(unsigned n, int* attrs, void** data, CUdeviceptr ptr) {
  for (unsigned i = 0; i < n; i++) if (cuPointerGetAttribute(data[i], attrs[i], ptr)) return 1;
  return 0;
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
/* Multicast binding (PyTorch's symmetric memory): only checked, by handle or by a mapped
 * address; a handle the driver never made is an invalid value, as on a GPU. */
CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mc, size_t mco, CUmemGenericAllocationHandle h, size_t off, size_t n, unsigned long long f) {
  (void)mc; (void)mco; (void)f;
  pthread_mutex_lock(&mu); int ok = h > 0 && h < MAXH && handles[h].size && off + n <= handles[h].size; pthread_mutex_unlock(&mu);
  return ok ? 0 : 1;
}
CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mc, size_t mco, CUdeviceptr va, size_t n, unsigned long long f) {
  (void)mc; (void)mco; (void)f; CUdeviceptr b; size_t sz;
  return cuMemGetAddressRange_v2(&b, &sz, va) || va + n > b + sz ? 1 : 0;
}
#else
/* A driver without VMM still answers range and attribute queries: any pointer is memory of
 * device 0 (CU_POINTER_ATTRIBUTE_MEMORY_TYPE, 2: device), nothing else is known. */
CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr ptr) { (void)ptr; if (attr != 2 || !data) return 1; *(unsigned*)data = 2; return 0; }
CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) { (void)base; (void)size; (void)ptr; return 1; }
#endif

/* Legacy IPC and copies at the driver, as the fake runtime's (a handle names the memfd of a
 * cuMemAlloc_v2 allocation: bytes 24..31 its start, 32..35 pid, 36..39 memfd, 40..47 size,
 * 48..55 a magic; bytes 0..23 are ignored on open, as on the real driver). */
typedef struct { unsigned char b[64]; } CUipcMemHandle;
CUresult cuIpcGetMemHandle(CUipcMemHandle* h, CUdeviceptr p) {
  count(C_IPC_GET);
  void* base; size_t n; int fd;
  if (!h || !fakecu_lookup((void*)(uintptr_t)p, &base, &n, &fd)) return 1;
  int pid = getpid(); uint64_t sz = n;
  memset(h->b, 0xAB, 64); memcpy(h->b + 24, &base, 8); memcpy(h->b + 32, &pid, 4);
  memcpy(h->b + 36, &fd, 4); memcpy(h->b + 40, &sz, 8); memcpy(h->b + 48, "FAKEIPC!", 8);
  return 0;
}
static struct { void* p; size_t n; } cu_opened[256];
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* out, CUipcMemHandle h, unsigned flags) {
  (void)flags;
  int pid, fd; uint64_t sz;
  if (!out || memcmp(h.b + 48, "FAKEIPC!", 8)) return 400;
  memcpy(&pid, h.b + 32, 4); memcpy(&fd, h.b + 36, 4); memcpy(&sz, h.b + 40, 8);
  if (pid == getpid()) return 1;
  char path[64]; snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
  int f = open(path, O_RDWR);
  if (f < 0) return 400;
  void* m = mmap(0, sz, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  close(f);
  if (m == MAP_FAILED) return 2;
  for (int i = 0; i < 256; i++) if (!cu_opened[i].p) { cu_opened[i].p = m; cu_opened[i].n = sz; break; }
  *out = (CUdeviceptr)(uintptr_t)m; return 0;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  for (int i = 0; i < 256; i++) if (cu_opened[i].p == (void*)(uintptr_t)p) { munmap(cu_opened[i].p, cu_opened[i].n); cu_opened[i].p = 0; return 0; }
  return 1;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { memmove((void*)(uintptr_t)d, s, n); return 0; }
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) { memmove(d, (void*)(uintptr_t)s, n); return 0; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { fakecu_read(s, n); memmove((void*)(uintptr_t)d, (void*)(uintptr_t)s, n); return 0; }
/* Page-locking host memory and one stream for pausing: registration counted, copies at once. */
static long host_registered;
CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned flags) { (void)p; (void)flags; __atomic_add_fetch(&host_registered, (long)n, __ATOMIC_SEQ_CST); return 0; }
CUresult cuMemHostUnregister(void* p) { (void)p; return 0; }
/* Streams: a handle each (nothing runs on them but captures and the copies above). */
static uintptr_t next_stream = 0x5e;
CUresult cuStreamCreate(void** st, unsigned flags) { (void)flags; *st = (void*)__atomic_fetch_add(&next_stream, 0x100, __ATOMIC_SEQ_CST); return 0; }
CUresult cuStreamCreateWithPriority(void** st, unsigned flags, int prio) { (void)prio; return cuStreamCreate(st, flags); }
CUresult cuStreamDestroy_v2(void* st) { return st ? 0 : 400; }
CUresult cuStreamIsCapturing(void* st, int* status) { *status = st && st == capturing; return 0; }
/* Events: a record is only checked; an interprocess handle is 64 bytes of a pattern. */
CUresult cuEventRecord(void* e, void* st) { (void)st; return e ? 0 : 400; }
CUresult cuIpcGetEventHandle(void* h, void* e) { if (!h || !e) return 1; memset(h, 0xe7, 64); return 0; }
/* The legacy default stream (NULL or CU_STREAM_LEGACY) of the current context: its device's work
 * in flight ends (fakecu_launch models only default-stream work; FAKE_SYNC_MS is that work's
 * time, as for cuCtxSynchronize). Other streams: nothing. */
CUresult cuStreamSynchronize(void* st) {
  if (st && st != (void*)1) return 0;
  if (!current()) return 201;
  legacy_wait(1);
  count(C_LEGACY_SYNC);
  fakecu_sync_dev(ctx_device(current()));
  pending_work();
  return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, void* st) { (void)st; memmove(d, (void*)(uintptr_t)s, n); return 0; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, void* st) { (void)st; memmove((void*)(uintptr_t)d, s, n); return 0; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void* st) {
  if (st && st == capturing && capture->n < 64) { Node* x = &capture->nodes[capture->n++]; x->host = 0; x->d = d; x->s = s; x->n = n; return 0; }
  memmove((void*)(uintptr_t)d, (void*)(uintptr_t)s, n); return 0;
}

/* A kernel, run at once by the launching thread: adds 1 to the first 32-bit word of every
 * 4 KiB of [p, p + gx * 4096), p being the kernel's first parameter. On the legacy stream it
 * waits while a graph holds the stream. Touching memory that is not mapped faults the process
 * (SIGSEGV), as an illegal address ends a real one. */
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shmem, void* st,
                        void** params, void** extra) {
  (void)f; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)extra;
  if (!params || !params[0]) return 1;
  int legacy = !st || st == (void*)1;
  for (;;) {
    if (legacy) legacy_wait(0);
    __atomic_add_fetch(&legacy_running, 1, __ATOMIC_SEQ_CST);
    if (!legacy || !__atomic_load_n(&legacy_holds, __ATOMIC_SEQ_CST)) break;
    __atomic_sub_fetch(&legacy_running, 1, __ATOMIC_SEQ_CST);
  }
  uint64_t p = *(uint64_t*)params[0];
  for (unsigned i = 0; i < gx; i++) { volatile uint32_t* w = (volatile uint32_t*)(uintptr_t)(p + i * 4096ull); *w = *w + 1; }
  __atomic_sub_fetch(&legacy_running, 1, __ATOMIC_SEQ_CST);
  count(C_LAUNCH);
  return 0;
}

CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr ptr);
CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);
CUresult cuGetProcAddress(const char* sym, void** pfn, int ver, unsigned long long flags);
CUresult cuGetProcAddress_v2(const char* sym, void** pfn, int ver, unsigned long long flags, int* status);
/* The entry points by base name and the version that introduced each variant. */
static const struct { const char* name; int since; void* fn; } procs[] = {
  {"cuGetProcAddress", 0, (void*)cuGetProcAddress}, {"cuGetProcAddress", 12000, (void*)cuGetProcAddress_v2},
  {"cuInit", 0, (void*)cuInit}, {"cuCtxGetCurrent", 0, (void*)cuCtxGetCurrent}, {"cuCtxSetCurrent", 0, (void*)cuCtxSetCurrent},
  {"cuCtxGetDevice", 0, (void*)cuCtxGetDevice}, {"cuCtxSynchronize", 0, (void*)cuCtxSynchronize}, {"cuCtxGetId", 12000, (void*)cuCtxGetId},
  {"cuCtxCreate", 3020, (void*)cuCtxCreate_v2}, {"cuCtxPushCurrent", 4000, (void*)cuCtxPushCurrent_v2}, {"cuCtxPopCurrent", 4000, (void*)cuCtxPopCurrent_v2},
  {"cuDevicePrimaryCtxRetain", 7000, (void*)cuDevicePrimaryCtxRetain}, {"cuDevicePrimaryCtxRelease", 11000, (void*)cuDevicePrimaryCtxRelease_v2},
  {"cuDevicePrimaryCtxGetState", 7000, (void*)cuDevicePrimaryCtxGetState}, {"cuDevicePrimaryCtxReset", 11000, (void*)cuDevicePrimaryCtxReset_v2},
  {"cuDeviceGet", 0, (void*)cuDeviceGet}, {"cuDeviceGetCount", 0, (void*)cuDeviceGetCount}, {"cuDeviceGetAttribute", 0, (void*)cuDeviceGetAttribute},
  {"cuMemAlloc", 0, (void*)cuMemAlloc}, {"cuMemAlloc", 3020, (void*)cuMemAlloc_v2}, {"cuMemFree", 3020, (void*)cuMemFree_v2},
  {"cuMemGetInfo", 3020, (void*)cuMemGetInfo_v2}, {"cuMemAllocPitch", 3020, (void*)cuMemAllocPitch_v2},
  {"cuIpcGetMemHandle", 4010, (void*)cuIpcGetMemHandle}, {"cuIpcOpenMemHandle", 11000, (void*)cuIpcOpenMemHandle_v2},
  {"cuIpcCloseMemHandle", 4010, (void*)cuIpcCloseMemHandle},
  {"cuLaunchKernel", 4000, (void*)cuLaunchKernel},
  {"cuMemcpyHtoD", 3020, (void*)cuMemcpyHtoD_v2}, {"cuMemcpyDtoH", 3020, (void*)cuMemcpyDtoH_v2}, {"cuMemcpyDtoD", 3020, (void*)cuMemcpyDtoD_v2},
#ifndef NO_VMM
  {"cuMemGetAddressRange", 3020, (void*)cuMemGetAddressRange_v2}, {"cuPointerGetAttribute", 4000, (void*)cuPointerGetAttribute},
  {"cuMemGetAllocationGranularity", 10020, (void*)cuMemGetAllocationGranularity}, {"cuMemCreate", 10020, (void*)cuMemCreate},
  {"cuMemRelease", 10020, (void*)cuMemRelease}, {"cuMemAddressReserve", 10020, (void*)cuMemAddressReserve},
  {"cuMemAddressFree", 10020, (void*)cuMemAddressFree}, {"cuMemMap", 10020, (void*)cuMemMap}, {"cuMemUnmap", 10020, (void*)cuMemUnmap},
  {"cuMemSetAccess", 10020, (void*)cuMemSetAccess}, {"cuMemExportToShareableHandle", 10020, (void*)cuMemExportToShareableHandle},
  {"cuMemImportFromShareableHandle", 10020, (void*)cuMemImportFromShareableHandle},
  {"cuMemGetHandleForAddressRange", 11070, (void*)cuMemGetHandleForAddressRange},
  {"cuMemRetainAllocationHandle", 11000, (void*)cuMemRetainAllocationHandle},
  {"cuMemGetAllocationPropertiesFromHandle", 10020, (void*)cuMemGetAllocationPropertiesFromHandle},
  {"cuMemGetAccess", 10020, (void*)cuMemGetAccess},
  {"cuMulticastBindMem", 12010, (void*)cuMulticastBindMem}, {"cuMulticastBindAddr", 12010, (void*)cuMulticastBindAddr},
#endif
};
CUresult cuGetProcAddress_v2(const char* sym, void** pfn, int ver, unsigned long long flags, int* status) {
  (void)flags; /* none of these has a _ptds variant */
  void* best = 0; int since = -1;
  for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++)
    if (!strcmp(procs[i].name, sym) && procs[i].since <= ver && procs[i].since > since) { best = procs[i].fn; since = procs[i].since; }
  if (status) *status = best ? 0 : 1;
  if (!pfn) return 1;
  *pfn = best;
  return best ? 0 : 500;
}
CUresult cuGetProcAddress(const char* sym, void** pfn, int ver, unsigned long long flags) { return cuGetProcAddress_v2(sym, pfn, ver, flags, 0); }
/* The driver's own function of that exact symbol name (what a test compares lookups with). */
void* fakecu_real(const char* sym) {
  if (!strcmp(sym, "cuMemAlloc_v2")) return (void*)cuMemAlloc_v2;
  if (!strcmp(sym, "cuMemAlloc")) return (void*)cuMemAlloc;
  if (!strcmp(sym, "cuMemFree_v2")) return (void*)cuMemFree_v2;
  if (!strcmp(sym, "cuMemGetInfo_v2")) return (void*)cuMemGetInfo_v2;
  if (!strcmp(sym, "cuMemAllocPitch_v2")) return (void*)cuMemAllocPitch_v2;
  if (!strcmp(sym, "cuGetProcAddress")) return (void*)cuGetProcAddress;
  if (!strcmp(sym, "cuGetProcAddress_v2")) return (void*)cuGetProcAddress_v2;
#ifndef NO_VMM
  if (!strcmp(sym, "cuMemCreate")) return (void*)cuMemCreate;
#endif
  return 0;
}

/* The process checkpoint (driver 570 on): a state per pid in the file FAKE_CKPT_DIR/<pid> (0
 * running, 1 locked, 2 checkpointed); a pid without a file, or no FAKE_CKPT_DIR, has no CUDA
 * (3). FAKE_CKPT_LOCK_RC / FAKE_CKPT_RC: the lock / the checkpoint fails with that CUresult. */
static int ckpt_get(int pid) {
  const char* d = getenv("FAKE_CKPT_DIR");
  if (!d) return -1;
  char p[512];
  snprintf(p, sizeof p, "%s/%d", d, pid);
  FILE* f = fopen(p, "r");
  if (!f) return -1;
  int s = -1;
  if (fscanf(f, "%d", &s) != 1) s = -1;
  fclose(f);
  return s;
}
static void ckpt_set(int pid, int s) {
  char p[512];
  snprintf(p, sizeof p, "%s/%d", getenv("FAKE_CKPT_DIR"), pid);
  FILE* f = fopen(p, "w");
  if (f) { fprintf(f, "%d\n", s); fclose(f); }
}
CUresult cuCheckpointProcessGetState(int pid, int* st) { int s = ckpt_get(pid); if (s < 0) return 3; *st = s; return 0; }
CUresult cuCheckpointProcessLock(int pid, void* a) {
  (void)a;
  int s = ckpt_get(pid);
  if (s < 0) return 3;
  if (s != 0) return 401;
  long rc = envl("FAKE_CKPT_LOCK_RC", 0);
  if (rc) return (CUresult)rc;
  ckpt_set(pid, 1);
  return 0;
}
CUresult cuCheckpointProcessCheckpoint(int pid, void* a) {
  (void)a;
  if (ckpt_get(pid) != 1) return 401;
  long rc = envl("FAKE_CKPT_RC", 0);
  if (rc) return (CUresult)rc;
  ckpt_set(pid, 2);
  return 0;
}
CUresult cuCheckpointProcessRestore(int pid, void* a) { (void)a; if (ckpt_get(pid) != 2) return 401; ckpt_set(pid, 1); return 0; }
CUresult cuCheckpointProcessUnlock(int pid, void* a) { (void)a; if (ckpt_get(pid) != 1) return 401; ckpt_set(pid, 0); return 0; }
