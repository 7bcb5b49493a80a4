/* A fake libcudart.so.13 (versioned symbols, like the real one) for expseg's preload tests.
 * Its cudaMalloc hands out host memory; it calls the fake driver to bind a context as the
 * real runtime does. Counters are read by the tests through fakert_count(). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

void fakecu_bind(void);
uint64_t fakecu_take_freed(size_t size) __attribute__((weak));
static __thread int last_error, cur_dev;
static long n_malloc, n_free, n_sync, n_ipc, n_peer_on, n_peer_off;
#define MAXA 65536
/* Allocations are memfd mappings, so another process can open them by handle
 * (/proc/PID/fd/FD): the fake's legacy IPC. */
static struct { void* p; size_t n; int fd; } allocs[MAXA];
static struct { void* p; size_t n; } opened[256];
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
  /* FAKE_RT_MALLOC_MAX: larger requests run out of memory. */
  if (getenv("FAKE_RT_MALLOC_MAX") && n > (size_t)atol(getenv("FAKE_RT_MALLOC_MAX"))) return err(2);
  int fd = memfd_create("fakert", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)n)) return err(2);
  void* m = MAP_FAILED;
  /* FAKE_MALLOC_REUSES_VA: land on a just-freed reservation of the same size, as the real
   * cudaMalloc does for small sizes (what makes an IPC move in place possible). */
  if (getenv("FAKE_MALLOC_REUSES_VA") && fakecu_take_freed) {
    uint64_t va = fakecu_take_freed(n);
    if (va) {
      m = mmap((void*)va, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
      if (m != MAP_FAILED && m != (void*)va) { munmap(m, n); m = MAP_FAILED; }
    }
  }
  if (m == MAP_FAILED) m = mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) { close(fd); return err(2); }
  pthread_mutex_lock(&mu);
  int i = 0; while (i < MAXA && allocs[i].p) i++;
  if (i == MAXA) { pthread_mutex_unlock(&mu); munmap(m, n); close(fd); return err(2); }
  allocs[i].p = m; allocs[i].n = n; allocs[i].fd = fd;
  pthread_mutex_unlock(&mu);
  *p = m; return 0;
}
int cudaFree(void* p) {
  fakecu_bind();
  __atomic_add_fetch(&n_free, 1, __ATOMIC_RELAXED);
  if (!p) return 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXA; i++) if (allocs[i].p == p) {
    size_t n = allocs[i].n; int fd = allocs[i].fd;
    allocs[i].p = 0; pthread_mutex_unlock(&mu);
    munmap(p, n); close(fd);
    return 0;
  }
  pthread_mutex_unlock(&mu);
  return err(1); /* cudaErrorInvalidValue, as the real runtime answers any unknown pointer */
}
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
int cudaGetDevice(int* d) { *d = cur_dev; return 0; }
int cudaSetDevice(int d) { if (d < 0 || d >= ndev()) return err(101); cur_dev = d; fakecu_bind(); return 0; }
/* FAKE_SYNC_MS (read at each call): the device has that much work pending. */
int cudaDeviceSynchronize(void) {
  __atomic_add_fetch(&n_sync, 1, __ATOMIC_RELAXED);
  const char* ms = getenv("FAKE_SYNC_MS");
  if (ms) usleep((useconds_t)atoi(ms) * 1000);
  return 0;
}
long fakecu_used(void) __attribute__((weak));
/* FAKE_MEMINFO_REAL=1: free is FAKE_CAPACITY less the fake driver's chunks. */
int cudaMemGetInfo(size_t* f, size_t* t) {
  const char* real = getenv("FAKE_MEMINFO_REAL");
  if (real && *real == '1' && fakecu_used) {
    const char* c = getenv("FAKE_CAPACITY");
    size_t cap = c ? (size_t)atol(c) : (1ul << 30);
    *f = cap - (size_t)fakecu_used(); *t = cap; return 0;
  }
  *f = 100u << 20; *t = 8ull << 30; return 0;
}
#include <dlfcn.h>
/* The runtime's driver entry point API: the driver's own functions. */
int cudaGetDriverEntryPointByVersion(const char* sym, void** fn, unsigned ver, unsigned long long flags, int* status) {
  (void)ver; (void)flags;
  void* l = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  *fn = l ? dlsym(l, sym) : 0;
  if (status) *status = *fn ? 0 : 1;
  return *fn ? 0 : 500;
}
int cudaIpcGetMemHandle(void* h, void* p) {
  __atomic_add_fetch(&n_ipc, 1, __ATOMIC_RELAXED);
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXA; i++) if (allocs[i].p && (char*)p >= (char*)allocs[i].p && (char*)p < (char*)allocs[i].p + allocs[i].n) {
    /* Bytes 0..23 are ignored on open, as on the real driver. 24..31: the allocation's start
     * (tests read it); 32..35 pid; 36..39 memfd; 40..47 size; 48..55 a checked magic. */
    int pid = getpid(); uint64_t sz = allocs[i].n;
    memset(h, 0xAB, 64); memcpy((char*)h + 24, &allocs[i].p, 8); memcpy((char*)h + 32, &pid, 4);
    memcpy((char*)h + 36, &allocs[i].fd, 4); memcpy((char*)h + 40, &sz, 8); memcpy((char*)h + 48, "FAKEIPC!", 8);
    pthread_mutex_unlock(&mu); return 0; }
  pthread_mutex_unlock(&mu);
  return err(1);
}
int cudaMemcpy(void* d, const void* s, size_t n, int kind) { (void)kind; memmove(d, s, n); return 0; }
typedef struct { unsigned char b[64]; } IpcHandle;
int cudaIpcOpenMemHandle(void** p, IpcHandle h, unsigned flags) {
  (void)flags;
  int pid, fd; uint64_t sz;
  if (memcmp(h.b + 48, "FAKEIPC!", 8)) return err(400);
  memcpy(&pid, h.b + 32, 4); memcpy(&fd, h.b + 36, 4); memcpy(&sz, h.b + 40, 8);
  if (pid == getpid()) return err(1);
  char path[64]; snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
  int f = open(path, O_RDWR);
  if (f < 0) return err(400);
  void* m = mmap(0, sz, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  close(f);
  if (m == MAP_FAILED) return err(2);
  for (int i = 0; i < 256; i++) if (!opened[i].p) { opened[i].p = m; opened[i].n = sz; break; }
  *p = m; return 0;
}
int cudaIpcCloseMemHandle(void* p) {
  for (int i = 0; i < 256; i++) if (opened[i].p == p) { munmap(p, opened[i].n); opened[i].p = 0; return 0; }
  return err(1);
}
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
