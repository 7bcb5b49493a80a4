/* A fake *statically linked* CUDA runtime, compiled into the program as nvcc's default
 * (-cudart static) does: there is no libcudart.so. It reaches the driver as the real one does
 * (traced: CUDA 13's libcudart_static.a): dlopen libcuda.so.1, dlsym cuGetProcAddress_v2, ask
 * it for cuGetProcAddress (version 12000) and use that, and get every other driver function
 * through it, the allocation functions at version 3020. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef int CUresult;
typedef void* CUcontext;
struct IpcHandle { unsigned char b[64]; };
typedef CUresult (*GetProc2)(const char*, void**, int, unsigned long long, int*);
static struct {
  GetProc2 get_proc;
  CUresult (*init)(unsigned);
  CUresult (*current)(CUcontext*);
  CUresult (*retain)(CUcontext*, int);
  CUresult (*set)(CUcontext);
  CUresult (*alloc)(uint64_t*, size_t);
  CUresult (*free)(uint64_t);
  CUresult (*info)(size_t*, size_t*);
  CUresult (*ipc_get)(void*, uint64_t);
  CUresult (*ipc_open)(uint64_t*, struct IpcHandle, unsigned);
  CUresult (*ipc_close)(uint64_t);
} d;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static void* get(const char* name, int version) {
  void* f = 0; int st = 0;
  if (d.get_proc(name, &f, version, 0, &st) || !f) abort();
  return f;
}
static void load(void) {
  void* l = dlopen("libcuda.so.1", RTLD_NOW);
  d.get_proc = l ? (GetProc2)dlsym(l, "cuGetProcAddress_v2") : 0;
  if (!d.get_proc) abort();
  d.get_proc = get("cuGetProcAddress", 12000);
  d.init = get("cuInit", 2000); d.current = get("cuCtxGetCurrent", 4000); d.retain = get("cuDevicePrimaryCtxRetain", 7000);
  d.set = get("cuCtxSetCurrent", 4000); d.alloc = get("cuMemAlloc", 3020); d.free = get("cuMemFree", 3020); d.info = get("cuMemGetInfo", 3020);
  d.ipc_get = get("cuIpcGetMemHandle", 4010); d.ipc_open = get("cuIpcOpenMemHandle", 11000); d.ipc_close = get("cuIpcCloseMemHandle", 4010);
}
/* Initialise the driver and make device 0's primary context current, as the runtime does. */
static void bind(void) {
  pthread_once(&once, load);
  CUcontext c = 0;
  if (d.init(0) || d.current(&c)) abort();
  if (!c && (d.retain(&c, 0) || d.set(c))) abort();
}
int cudaMalloc(void** p, size_t n) {
  bind();
  if (!p) return 1;
  if (n == 0) { *p = 0; return 0; }
  uint64_t u = 0;
  CUresult r = d.alloc(&u, n);
  if (r) return r; /* the codes that matter here are the same numbers in both APIs */
  *p = (void*)(uintptr_t)u; return 0;
}
int cudaFree(void* p) { bind(); return p && d.free((uint64_t)(uintptr_t)p) ? 1 : 0; }
int cudaMemGetInfo(size_t* f, size_t* t) { bind(); return d.info(f, t) ? 1 : 0; }
int cudaIpcGetMemHandle(void* h, void* p) { bind(); return d.ipc_get(h, (uint64_t)(uintptr_t)p); }
int cudaIpcOpenMemHandle(void** p, struct IpcHandle h, unsigned flags) {
  bind();
  uint64_t u = 0;
  CUresult r = d.ipc_open(&u, h, flags);
  if (!r) *p = (void*)(uintptr_t)u;
  return r;
}
int cudaIpcCloseMemHandle(void* p) { bind(); return d.ipc_close((uint64_t)(uintptr_t)p); }
/* The real static runtime's reset reaches neither cudaDeviceReset's nor
 * cuDevicePrimaryCtxReset_v2's hook (measured on an H100, session 19): the fake driver's
 * internal reset stands for that path. */
int cudaDeviceReset(void) {
  bind();
  void (*reset)(int) = (void (*)(int))dlsym(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "fakecu_internal_reset");
  if (!reset) abort();
  reset(0);
  return 0;
}
