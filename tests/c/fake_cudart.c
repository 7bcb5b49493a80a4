/* A fake libcudart.so.13 (versioned symbols, like the real one) for expseg's preload tests.
 * Like the real runtime (traced: CUDA 13's libcudart.so.13) it reaches the driver through
 * cuGetProcAddress: dlsym finds cuGetProcAddress_v2 in libcuda.so.1, which gives
 * cuGetProcAddress (version 12000) and, at 3020, cuMemAlloc, cuMemFree and cuMemGetInfo;
 * cudaMalloc, cudaFree and cudaMemGetInfo call those. (The old cuGetProcAddress is looked up
 * with dlsym too, and must work alike.) It binds the primary context as the real runtime does. Counters are read by the
 * tests through fakert_count(); fakert_driver_fn() tells which functions it got. */
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
void fakecu_bind_dev(int);
int fakecu_current_device(void);
int fakecu_lookup(const void* p, void** base, size_t* n, int* fd);
static __thread int last_error, cur_dev;
static long n_malloc, n_free, n_sync, n_ipc, n_peer_on, n_peer_off;
static long n_reset;
/* Allocations are the driver's memfd mappings, so another process can open them by handle
 * (/proc/PID/fd/FD): the fake's legacy IPC. */
static struct { void* p; size_t n; } opened[256];
static int ndev(void) { const char* v = getenv("FAKE_DEVICES"); return v ? atoi(v) : 1; }
static int err(int e) { if (e) last_error = e; return e; }

long fakert_count(const char* w) {
  if (!strcmp(w, "cudaMalloc")) return n_malloc;
  if (!strcmp(w, "cudaFree")) return n_free;
  if (!strcmp(w, "cudaDeviceSynchronize")) return n_sync;
  if (!strcmp(w, "cudaDeviceReset")) return n_reset;
  if (!strcmp(w, "cudaIpcGetMemHandle")) return n_ipc;
  if (!strcmp(w, "cudaDeviceEnablePeerAccess")) return n_peer_on;
  if (!strcmp(w, "cudaDeviceDisablePeerAccess")) return n_peer_off;
  return -1;
}

#include <dlfcn.h>
typedef int (*GetProc2)(const char*, void**, int, unsigned long long, int*);
typedef int (*GetProc1)(const char*, void**, int, unsigned long long);
static struct {
  GetProc2 get_proc;
  int (*alloc)(uint64_t*, size_t);
  int (*free)(uint64_t);
  int (*info)(size_t*, size_t*);
} drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static void drv_load(void) {
  void* l = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  GetProc2 v2 = l ? (GetProc2)dlsym(l, "cuGetProcAddress_v2") : 0;
  GetProc1 v1 = l ? (GetProc1)dlsym(l, "cuGetProcAddress") : 0;
  void* again = 0;
  int st = 0;
  if (!v1 || !v2 || v1("cuGetProcAddress", &again, 12000, 0) || v2("cuGetProcAddress", (void**)&drv.get_proc, 12000, 0, &st) ||
      again != (void*)drv.get_proc) abort();
  if (drv.get_proc("cuMemAlloc", (void**)&drv.alloc, 3020, 0, &st) || drv.get_proc("cuMemFree", (void**)&drv.free, 3020, 0, &st) ||
      drv.get_proc("cuMemGetInfo", (void**)&drv.info, 3020, 0, &st)) abort();
}
static void load(void) { pthread_once(&drv_once, drv_load); }
/* The driver function the runtime got for a base name (tests compare it with the driver's). */
void* fakert_driver_fn(const char* name) {
  load();
  if (!strcmp(name, "cuMemAlloc")) return (void*)drv.alloc;
  if (!strcmp(name, "cuMemFree")) return (void*)drv.free;
  if (!strcmp(name, "cuMemGetInfo")) return (void*)drv.info;
  if (!strcmp(name, "cuGetProcAddress")) return (void*)drv.get_proc;
  return 0;
}

int cudaMalloc(void** p, size_t n) {
  if (!p) return err(1);
  fakecu_bind();
  load();
  __atomic_add_fetch(&n_malloc, 1, __ATOMIC_RELAXED);
  if (n == 0) { *p = 0; return 0; }
  uint64_t d = 0;
  int r = drv.alloc(&d, n);
  if (r) return err(r == 2 ? 2 : 1);
  *p = (void*)(uintptr_t)d; return 0;
}
int cudaFree(void* p) {
  fakecu_bind();
  load();
  __atomic_add_fetch(&n_free, 1, __ATOMIC_RELAXED);
  if (!p) return 0;
  /* cudaErrorInvalidValue, as the real runtime answers any unknown pointer */
  return drv.free((uint64_t)(uintptr_t)p) ? err(1) : 0;
}
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
int cudaGetDevice(int* d) { int c = fakecu_current_device(); *d = c >= 0 ? c : cur_dev; return 0; }
int cudaSetDevice(int d) { if (d < 0 || d >= ndev()) return err(101); cur_dev = d; fakecu_bind_dev(d); return 0; }
/* FAKE_SYNC_MS (fakecu_sync_ms): the device has that much work pending. */
void fakecu_sync_dev(int);
int fakecu_sync_ms(void);
void fakecu_legacy_wait(void);
/* A reset frees the runtime's allocations (here: counted only; the fake's memory of them stays,
 * and tests check what expseg did with its own). */
int cudaDeviceReset(void) { __atomic_add_fetch(&n_reset, 1, __ATOMIC_RELAXED); return 0; }
int cudaDeviceSynchronize(void) {
  __atomic_add_fetch(&n_sync, 1, __ATOMIC_RELAXED);
  fakecu_legacy_wait();
  { int c = fakecu_current_device(); fakecu_sync_dev(c >= 0 ? c : cur_dev); }
  int ms = fakecu_sync_ms();
  if (ms > 0) usleep((useconds_t)ms * 1000);
  return 0;
}
/* The legacy default stream (0) of the current device: its work in flight ends (fakecu_launch).
 * Other streams are not modelled. */
int cudaStreamSynchronize(void* s) {
  if (!s || s == (void*)1) fakecu_legacy_wait();
  if (!s) { int c = fakecu_current_device(); fakecu_sync_dev(c >= 0 ? c : cur_dev); }
  return 0;
}
int cudaMemGetInfo(size_t* f, size_t* t) {
  fakecu_bind();
  load();
  return drv.info(f, t) ? err(1) : 0;
}
/* The runtime's driver entry point API: the driver's cuGetProcAddress. */
int cudaGetDriverEntryPointByVersion(const char* sym, void** fn, unsigned ver, unsigned long long flags, int* status) {
  load();
  int r = drv.get_proc(sym, fn, (int)ver, flags, status);
  return r ? 500 : 0;
}
int cudaGetDriverEntryPoint(const char* sym, void** fn, unsigned long long flags, int* status) {
  return cudaGetDriverEntryPointByVersion(sym, fn, 13000, flags, status);
}
int cudaIpcGetMemHandle(void* h, void* p) {
  __atomic_add_fetch(&n_ipc, 1, __ATOMIC_RELAXED);
  void* base; size_t n; int fd;
  if (!fakecu_lookup(p, &base, &n, &fd)) return err(1);
  /* Bytes 0..23 are ignored on open, as on the real driver. 24..31: the allocation's start
   * (tests read it); 32..35 pid; 36..39 memfd; 40..47 size; 48..55 a checked magic. */
  int pid = getpid(); uint64_t sz = n;
  memset(h, 0xAB, 64); memcpy((char*)h + 24, &base, 8); memcpy((char*)h + 32, &pid, 4);
  memcpy((char*)h + 36, &fd, 4); memcpy((char*)h + 40, &sz, 8); memcpy((char*)h + 48, "FAKEIPC!", 8);
  return 0;
}
void fakecu_read(uint64_t va, size_t n);
int cudaMemcpy(void* d, const void* s, size_t n, int kind) { (void)kind; fakecu_read((uint64_t)(uintptr_t)s, n); memmove(d, s, n); return 0; }
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
