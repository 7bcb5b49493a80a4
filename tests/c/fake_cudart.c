/* A fake libcudart.so.13 (versioned symbols, like the real one) for expseg's preload tests.
 * Its cudaMalloc hands out host memory; it calls the fake driver to bind a context as the
 * real runtime does. Counters are read by the tests through fakert_count(). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>

void fakecu_bind(void);
uint64_t fakecu_take_freed(size_t size) __attribute__((weak));
static __thread int last_error, cur_dev;
static long n_malloc, n_free, n_sync, n_ipc, n_peer_on, n_peer_off;
#define MAXA 65536
static struct { void* p; size_t n; int mapped; } allocs[MAXA];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int ndev(void) { const char* v = getenv("FAKE_DEVICES"); return v ? atoi(v) : 1; }
static int err(int e) { if (e) last_error = e; return e; }

long fakert_count(const char* w) {
  if (!strcmp(w, "cudaMalloc")) return n_malloc;
  if (!strcmp(w, "cudaFree")) return n_free;
  if (!strcmp(w, "cudaDeviceSynchronize")) return n_sync;
  if (!strcmp(w, "cudaIpcGetMemHandle")) return n_ipc;
  if (!strcmp(w, "cudaDeviceEnablePeerAccess")) return n_peer_on;
  if (!strcmp(w, "cudaDeviceDisablePeerAccess")) return n_peer_off;
  return -1;
}

int cudaMalloc(void** p, size_t n) {
  if (!p) return err(1);
  fakecu_bind();
  __atomic_add_fetch(&n_malloc, 1, __ATOMIC_RELAXED);
  if (n == 0) { *p = 0; return 0; }
  if (n >= ((size_t)1 << 48)) return err(2);
  void* m = 0; int mapped = 0;
  /* FAKE_MALLOC_REUSES_VA: land on a just-freed reservation of the same size, as the real
   * cudaMalloc does for small sizes (what makes an IPC move in place possible). */
  if (getenv("FAKE_MALLOC_REUSES_VA") && fakecu_take_freed) {
    uint64_t va = fakecu_take_freed(n);
    if (va) {
      void* p = mmap((void*)va, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
      if (p == (void*)va) { m = p; mapped = 1; } else if (p != MAP_FAILED) munmap(p, n);
    }
  }
  if (!m) m = aligned_alloc(256, (n + 255) & ~(size_t)255);
  if (!m) return err(2);
  pthread_mutex_lock(&mu);
  int i = 0; while (i < MAXA && allocs[i].p) i++;
  if (i == MAXA) { pthread_mutex_unlock(&mu); free(m); return err(2); }
  allocs[i].p = m; allocs[i].n = n; allocs[i].mapped = mapped;
  pthread_mutex_unlock(&mu);
  *p = m; return 0;
}
int cudaFree(void* p) {
  fakecu_bind();
  __atomic_add_fetch(&n_free, 1, __ATOMIC_RELAXED);
  if (!p) return 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXA; i++) if (allocs[i].p == p) {
    allocs[i].p = 0; pthread_mutex_unlock(&mu);
    if (allocs[i].mapped) munmap(p, allocs[i].n); else free(p);
    return 0;
  }
  pthread_mutex_unlock(&mu);
  return err(1); /* cudaErrorInvalidValue, as the real runtime answers any unknown pointer */
}
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
int cudaGetDevice(int* d) { *d = cur_dev; return 0; }
int cudaSetDevice(int d) { if (d < 0 || d >= ndev()) return err(101); cur_dev = d; fakecu_bind(); return 0; }
int cudaDeviceSynchronize(void) { __atomic_add_fetch(&n_sync, 1, __ATOMIC_RELAXED); return 0; }
int cudaMemGetInfo(size_t* f, size_t* t) { *f = 100u << 20; *t = 8ull << 30; return 0; }
int cudaIpcGetMemHandle(void* h, void* p) {
  __atomic_add_fetch(&n_ipc, 1, __ATOMIC_RELAXED);
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXA; i++) if (allocs[i].p && (char*)p >= (char*)allocs[i].p && (char*)p < (char*)allocs[i].p + allocs[i].n) {
    /* bytes 24..31 carry the allocation's start, so tests can "open" the handle */
    pthread_mutex_unlock(&mu); memset(h, 0xAB, 64); memcpy((char*)h + 24, &allocs[i].p, 8); return 0; }
  pthread_mutex_unlock(&mu);
  return err(1);
}
int cudaMemcpy(void* d, const void* s, size_t n, int kind) { (void)kind; memmove(d, s, n); return 0; }
int cudaDeviceEnablePeerAccess(int peer, unsigned f) {
  (void)f; n_peer_on++;
  if (peer < 0 || peer >= ndev()) return err(101);
  if (peer == cur_dev) return err(217);
  return 0;
}
int cudaDeviceDisablePeerAccess(int peer) {
  n_peer_off++;
  if (peer < 0 || peer >= ndev()) return err(101);
  return 0;
}
