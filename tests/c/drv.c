/* A program that uses the driver API itself (linked against libcuda.so.1, no runtime), for
 * expseg's preload tests: drv direct|dlsym|getproc. Each gets cuMemAlloc_v2, cuMemFree_v2 and
 * cuMemGetInfo_v2 its own way and runs the same checks; prints key=value lines. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void* CUcontext;
typedef CUresult (*AllocFn)(uint64_t*, size_t);
typedef CUresult (*FreeFn)(uint64_t);
typedef CUresult (*InfoFn)(size_t*, size_t*);
typedef CUresult (*PitchFn)(uint64_t*, size_t*, size_t, size_t, unsigned);
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext*, int);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxCreate_v2(CUcontext*, unsigned, int);
CUresult cuCtxPopCurrent_v2(CUcontext*);
CUresult cuCtxGetCurrent(CUcontext*);
CUresult cuMemAlloc_v2(uint64_t*, size_t);
CUresult cuMemFree_v2(uint64_t);
CUresult cuMemGetInfo_v2(size_t*, size_t*);
CUresult cuMemAllocPitch_v2(uint64_t*, size_t*, size_t, size_t, unsigned);
CUresult cuGetProcAddress(const char*, void**, int, unsigned long long);
CUresult cuGetProcAddress_v2(const char*, void**, int, unsigned long long, int*);
long fakecu_count(const char*);
void* fakecu_real(const char*);

#define MIB ((size_t)1 << 20)
#define CHECK(c) do { if (!(c)) { printf("check_failed=%s:%d %s\n", __FILE__, __LINE__, #c); exit(1); } } while (0)

static int holds(uint64_t p, size_t n, unsigned char v) {
  const unsigned char* c = (const unsigned char*)(uintptr_t)p;
  for (size_t i = 0; i < n; i += 4093) if (c[i] != v) return 0;
  return c[n - 1] == v;
}

static int exercise(AllocFn A, FreeFn F, InfoFn I, PitchFn P) {
  CUcontext c;
  CHECK(cuInit(0) == 0 && cuDevicePrimaryCtxRetain(&c, 0) == 0 && cuCtxSetCurrent(c) == 0);
  uint64_t p = 0, q = 0, s = 0, o = 0;
  long creates = fakecu_count("cuMemCreate"), allocs = fakecu_count("cuMemAlloc_v2"), syncs = fakecu_count("cuCtxSynchronize");
  printf("alloc_rc=%d\n", A(&p, 4 * MIB));
  printf("pooled=%d\n", fakecu_count("cuMemCreate") - creates == 1 && fakecu_count("cuMemAlloc_v2") == allocs);
  memset((void*)(uintptr_t)p, 0x5a, 4 * MIB);
  printf("data_ok=%d\n", holds(p, 4 * MIB, 0x5a));
  printf("free_rc=%d\n", F(p));
  printf("free_synced=%ld\n", fakecu_count("cuCtxSynchronize") - syncs);
  printf("realloc_rc=%d\n", A(&q, 4 * MIB - 100));
  printf("same_ptr=%d creates_after_reuse=%ld\n", p == q, fakecu_count("cuMemCreate") - creates);
  CHECK(F(q) == 0);
  size_t fr = 0, tot = 0;
  printf("info_rc=%d", I(&fr, &tot)); printf(" info_free_mib=%zu\n", fr >> 20);
  allocs = fakecu_count("cuMemAlloc_v2");
  long frees = fakecu_count("cuMemFree_v2");
  int rc = A(&s, 1000);
  printf("small_rc=%d small_to_driver=%ld\n", rc, fakecu_count("cuMemAlloc_v2") - allocs);
  rc = F(s);
  printf("small_free_rc=%d small_free_to_driver=%ld\n", rc, fakecu_count("cuMemFree_v2") - frees);
  rc = F(12345);
  printf("unknown_free_rc=%d double_free_rc=%d\n", rc, F(q));
  printf("oom_rc=%d\n", A(&o, 2048 * MIB));
  printf("null_out_rc=%d\n", A(0, 4 * MIB));
  /* Pitched: the driver's pitch (one probe row), pitch x height bytes from the pool. */
  uint64_t pp = 0; size_t pitch = 0;
  creates = fakecu_count("cuMemCreate"); allocs = fakecu_count("cuMemAlloc_v2");
  long pitches = fakecu_count("cuMemAllocPitch_v2");
  rc = P(&pp, &pitch, 3000, 2048, 4);
  printf("pitch_rc=%d pitch=%zu pitch_pooled=%d pitch_probes=%ld\n", rc, pitch,
         fakecu_count("cuMemCreate") - creates == 1 && fakecu_count("cuMemAlloc_v2") == allocs, fakecu_count("cuMemAllocPitch_v2") - pitches);
  memset((void*)(uintptr_t)pp, 0x77, pitch * 2048);
  int held = holds(pp, pitch * 2048, 0x77);
  printf("pitch_data_ok=%d pitch_free_rc=%d\n", held, F(pp));
  pitches = fakecu_count("cuMemAllocPitch_v2");
  rc = P(&pp, &pitch, 100, 10, 4);
  printf("small_pitch_rc=%d small_pitch=%zu small_pitch_to_driver=%ld\n", rc, pitch, fakecu_count("cuMemAllocPitch_v2") - pitches);
  CHECK(F(pp) == 0);
  printf("bad_elem_rc=%d\n", P(&pp, &pitch, 3000, 2048, 3));
  /* A context of the program's own: the driver's memory and answers, untouched. */
  uint64_t kept = 0;
  CHECK(A(&kept, 4 * MIB) == 0);
  CUcontext mine;
  CHECK(cuCtxCreate_v2(&mine, 0, 0) == 0);
  creates = fakecu_count("cuMemCreate"); allocs = fakecu_count("cuMemAlloc_v2"); frees = fakecu_count("cuMemFree_v2");
  printf("own_ctx_rc=%d", A(&o, 4 * MIB));
  printf(" own_ctx_to_driver=%d\n", fakecu_count("cuMemAlloc_v2") - allocs == 1 && fakecu_count("cuMemCreate") == creates);
  CHECK(I(&fr, &tot) == 0);
  printf("own_ctx_info_free_mib=%zu\n", fr >> 20);
  rc = F(o);
  printf("own_ctx_free_rc=%d own_ctx_free_to_driver=%ld\n", rc, fakecu_count("cuMemFree_v2") - frees);
  /* Pool memory freed while another context is current: still the pool's, after a wait in
   * the primary context (pushed for it). */
  syncs = fakecu_count("cuCtxSynchronize"); frees = fakecu_count("cuMemFree_v2");
  rc = F(kept);
  printf("pool_free_in_own_ctx_rc=%d synced=%ld to_driver=%ld\n", rc, fakecu_count("cuCtxSynchronize") - syncs, fakecu_count("cuMemFree_v2") - frees);
  CUcontext cur = 0;
  CHECK(cuCtxGetCurrent(&cur) == 0 && cur == mine);
  CHECK(cuCtxPopCurrent_v2(&mine) == 0);
  return 0;
}

/* "own_ctx_oom": an allocation that finds no memory while a context of the program's own is
 * current (its device unknown to expseg, which then asks the other expseg processes). */
static int own_ctx_oom(void) {
  CUcontext c, mine;
  CHECK(cuInit(0) == 0 && cuDevicePrimaryCtxRetain(&c, 0) == 0 && cuCtxSetCurrent(c) == 0);
  CHECK(cuCtxCreate_v2(&mine, 0, 0) == 0);
  uint64_t o = 0;
  printf("own_ctx_oom_rc=%d\n", cuMemAlloc_v2(&o, (size_t)1 << 48));
  return 0;
}

static void* drvsym(const char* name) {
  void* l = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  CHECK(l);
  return dlsym(l, name);
}

static int by_dlsym(void) {
  AllocFn a = (AllocFn)drvsym("cuMemAlloc_v2");
  printf("dlsym_is_hook=%d\n", (void*)a == dlsym(RTLD_DEFAULT, "cuMemAlloc_v2") && (void*)a != fakecu_real("cuMemAlloc_v2"));
  printf("dlsym_v1_is_driver=%d\n", drvsym("cuMemAlloc") == fakecu_real("cuMemAlloc"));
  printf("dlsym_getproc_is_hook=%d\n", drvsym("cuGetProcAddress") == dlsym(RTLD_DEFAULT, "cuGetProcAddress") &&
         drvsym("cuGetProcAddress_v2") == dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"));
  return exercise(a, (FreeFn)drvsym("cuMemFree_v2"), (InfoFn)drvsym("cuMemGetInfo_v2"), (PitchFn)drvsym("cuMemAllocPitch_v2"));
}

static int by_getproc(void) {
  static const char* names[] = {"cuMemAlloc", "cuMemFree", "cuMemGetInfo", "cuMemAllocPitch"};
  static const char* hooks[] = {"cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetInfo_v2", "cuMemAllocPitch_v2"};
  static const int versions[] = {3020, 4000, 11000, 12000, 12080, 13000};
  CUresult (*v1)(const char*, void**, int, unsigned long long) = cuGetProcAddress;
  CUresult (*v2)(const char*, void**, int, unsigned long long, int*) = cuGetProcAddress_v2;
  int all = 1, n = 0;
  for (int k = 0; k < 4; k++) {
    void* hook = dlsym(RTLD_DEFAULT, hooks[k]);
    CHECK(hook && hook != fakecu_real(hooks[k]));
    for (size_t v = 0; v < sizeof versions / sizeof versions[0]; v++)
      for (unsigned long long flags = 0; flags < 3; flags++) {
        void *f1 = 0, *f2 = 0; int st = -1;
        all &= v1(names[k], &f1, versions[v], flags) == 0 && f1 == hook;
        all &= v2(names[k], &f2, versions[v], flags, &st) == 0 && f2 == hook && st == 0;
        n += 2;
      }
  }
  printf("getproc_all_hooks=%d lookups=%d\n", all, n);
  void* f = 0;
  int st = 0;
  CHECK(v2("cuMemAlloc", &f, 3000, 0, &st) == 0);
  printf("old_version_is_driver=%d\n", f == fakecu_real("cuMemAlloc"));
  void *g12 = 0, *g11 = 0;
  CHECK(v1("cuGetProcAddress", &g12, 12000, 0) == 0 && v1("cuGetProcAddress", &g11, 11000, 0) == 0);
  void* create = 0;
  CHECK(v2("cuMemCreate", &create, 12000, 0, &st) == 0);
  printf("vmm_lookup_is_driver=%d\n", create == fakecu_real("cuMemCreate"));
  printf("getproc_of_getproc_is_hook=%d\n", g12 == dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2") && g11 == dlsym(RTLD_DEFAULT, "cuGetProcAddress"));
  /* The entry points a CUDA 12 static runtime would use: through the _v2 it was given. */
  v2 = (CUresult (*)(const char*, void**, int, unsigned long long, int*))g12;
  void *a = 0, *fr = 0, *i = 0, *p = 0;
  CHECK(v2("cuMemAlloc", &a, 12080, 2, &st) == 0 && v2("cuMemFree", &fr, 12080, 2, &st) == 0 && v2("cuMemGetInfo", &i, 12080, 2, &st) == 0 &&
        v2("cuMemAllocPitch", &p, 12080, 2, &st) == 0);
  return exercise((AllocFn)a, (FreeFn)fr, (InfoFn)i, (PitchFn)p);
}

CUresult cuPointerGetAttributes(unsigned, int*, void**, uint64_t);
/* Range attributes through the plural query describe the allocation, not one chunk
 * (run with EXPSEG_MAX_CHUNK=2M: 4 MiB in two chunks). */
static int ranges(void) {
  CUcontext c;
  CHECK(cuInit(0) == 0 && cuDevicePrimaryCtxRetain(&c, 0) == 0 && cuCtxSetCurrent(c) == 0);
  uint64_t p = 0, start = 0, size = 0; int dev = -1;
  CHECK(cuMemAlloc_v2(&p, 4 * MIB) == 0);
  int attrs[3] = {11, 12, 9}; void* data[3] = {&start, &size, &dev};
  int rc = cuPointerGetAttributes(3, attrs, data, p + 3 * MIB);
  printf("attrs_rc=%d start_ok=%d size_mib=%llu dev=%d\n", rc, start == p, (unsigned long long)(size >> 20), dev);
  CHECK(cuMemFree_v2(p) == 0);
  return 0;
}
CUresult cuCtxEnablePeerAccess(CUcontext, unsigned);
CUresult cuCtxDisablePeerAccess(CUcontext);
long fakecu_access(uint64_t);
/* Peer access at the driver (FAKE_DEVICES=2): device 1's pool memory gets device 0's access
 * when device 0's context enables access to device 1's, and loses it on disable. */
static int peer(void) {
  CUcontext c0, c1;
  CHECK(cuInit(0) == 0 && cuDevicePrimaryCtxRetain(&c0, 0) == 0 && cuDevicePrimaryCtxRetain(&c1, 1) == 0);
  CHECK(cuCtxSetCurrent(c1) == 0);
  uint64_t p = 0;
  CHECK(cuMemAlloc_v2(&p, 4 * MIB) == 0);
  printf("dev1_access=%ld\n", fakecu_access(p));
  CHECK(cuCtxSetCurrent(c0) == 0);
  printf("enable_rc=%d\n", cuCtxEnablePeerAccess(c1, 0));
  printf("after_enable=%ld\n", fakecu_access(p));
  printf("disable_rc=%d\n", cuCtxDisablePeerAccess(c1));
  printf("after_disable=%ld\n", fakecu_access(p));
  CHECK(cuCtxSetCurrent(c1) == 0 && cuMemFree_v2(p) == 0);
  return 0;
}

/* A primary context reset (what the runtime's cudaDeviceReset does; a static runtime calls it
 * through cuGetProcAddress): the pool's allocations of the device go, as the driver's do. */
CUresult cuDevicePrimaryCtxReset_v2(int);
long fakecu_used(void);
long fakecu_primary_resets(void);
static int reset(void) {
  CUcontext c;
  CHECK(cuInit(0) == 0 && cuDevicePrimaryCtxRetain(&c, 0) == 0 && cuCtxSetCurrent(c) == 0);
  CUresult (*by_proc)(int) = 0;
  CHECK(cuGetProcAddress_v2("cuDevicePrimaryCtxReset", (void**)&by_proc, 12000, 0, 0) == 0 && by_proc);
  for (int round = 0; round < 2; round++) {
    uint64_t p = 0;
    CHECK(cuMemAlloc_v2(&p, 64 * MIB) == 0);
    memset((void*)(uintptr_t)p, 5, 64 * MIB);
    long used = fakecu_used() >> 20;
    int rc = round == 0 ? cuDevicePrimaryCtxReset_v2(0) : by_proc(0);
    long after = fakecu_used() >> 20;
    int stale = cuMemFree_v2(p);
    printf("r%d_used_before_mib=%ld r%d_reset_rc=%d r%d_used_after_mib=%ld r%d_stale_free_rc=%d\n", round, used, round, rc,
           round, after, round, stale);
  }
  printf("resets=%ld\n", fakecu_primary_resets());
  return 0;
}

/* A racer thread's allocation reads the primary context's id (slowed: it answers 300 ms
 * later) while this thread resets the context through the hook; then one more allocation here.
 * Both allocations made after the reset must stay live. */
#include <pthread.h>
#include <unistd.h>
void fakecu_slow_next_ctxid(int);
static CUcontext race_ctx;
static uint64_t racer_p;
static void* racer(void* rc) {
  CHECK(cuCtxSetCurrent(race_ctx) == 0);
  *(int*)rc = cuMemAlloc_v2(&racer_p, 4 * MIB);
  return 0;
}
static int reset_race(void) {
  CHECK(cuInit(0) == 0 && cuDevicePrimaryCtxRetain(&race_ctx, 0) == 0 && cuCtxSetCurrent(race_ctx) == 0);
  uint64_t first = 0, after = 0;
  CHECK(cuMemAlloc_v2(&first, 4 * MIB) == 0); /* the id is recorded */
  fakecu_slow_next_ctxid(300);
  pthread_t t; int racer_rc = -1;
  pthread_create(&t, 0, racer, &racer_rc);
  usleep(100 * 1000);
  int reset_rc = cuDevicePrimaryCtxReset_v2(0);
  pthread_join(t, 0);
  int after_rc = cuMemAlloc_v2(&after, 4 * MIB);
  printf("racer_alloc_rc=%d reset_rc=%d after_alloc_rc=%d\n", racer_rc, reset_rc, after_rc);
  if (racer_rc == 0) memset((void*)(uintptr_t)racer_p, 6, 4 * MIB);
  int racer_free = racer_rc == 0 ? cuMemFree_v2(racer_p) : -1;
  int after_free = after_rc == 0 ? cuMemFree_v2(after) : -1;
  printf("racer_free_rc=%d after_free_rc=%d\n", racer_free, after_free);
  return 0;
}

int main(int argc, char** argv) {
  const char* s = argc > 1 ? argv[1] : "";
  if (!strcmp(s, "reset_race")) return reset_race();
  if (!strcmp(s, "peer")) return peer();
  if (!strcmp(s, "reset")) return reset();
  if (!strcmp(s, "ranges")) return ranges();
  if (!strcmp(s, "own_ctx_oom")) return own_ctx_oom();
  if (!strcmp(s, "direct")) return exercise(cuMemAlloc_v2, cuMemFree_v2, cuMemGetInfo_v2, cuMemAllocPitch_v2);
  if (!strcmp(s, "dlsym")) return by_dlsym();
  if (!strcmp(s, "getproc")) return by_getproc();
  return 2;
}
