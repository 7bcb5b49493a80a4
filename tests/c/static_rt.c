/* A fake *statically linked* CUDA runtime, compiled into the program as nvcc's default
 * (-cudart static) does: there is no libcudart.so. It reaches the driver as the real one does:
 * dlopen libcuda.so.1, dlsym cuGetProcAddress, ask it for cuGetProcAddress_v2 (version
 * 12000), and get every other driver function through that. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef int CUresult;
typedef void* CUcontext;
typedef CUresult (*GetProc1)(const char*, void**, int, unsigned long long);
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
} d;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static void* get(const char* name) {
  void* f = 0; int st = 0;
  if (d.get_proc(name, &f, 12080, 0, &st) || !f) abort();
  return f;
}
static void load(void) {
  void* l = dlopen("libcuda.so.1", RTLD_NOW);
  GetProc1 v1 = l ? (GetProc1)dlsym(l, "cuGetProcAddress") : 0;
  if (!v1 || v1("cuGetProcAddress", (void**)&d.get_proc, 12000, 0)) abort();
  d.init = get("cuInit"); d.current = get("cuCtxGetCurrent"); d.retain = get("cuDevicePrimaryCtxRetain");
  d.set = get("cuCtxSetCurrent"); d.alloc = get("cuMemAlloc"); d.free = get("cuMemFree"); d.info = get("cuMemGetInfo");
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
