/* Test program for expseg's preload tests, run against the fake runtime and driver.
 * Usage: prog SCENARIO. Prints key=value lines that tests/preload.rs checks; exits 1 on a
 * failed in-program check. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>

int cudaMalloc(void**, size_t);
int cudaFree(void*);
int cudaGetLastError(void);
int cudaSetDevice(int);
int cudaGetDevice(int*);
int cudaMemGetInfo(size_t*, size_t*);
int cudaIpcGetMemHandle(void*, void*);
int cudaDeviceEnablePeerAccess(int, unsigned);
typedef struct { unsigned char b[64]; } IpcHandle;
int cudaIpcOpenMemHandle(void**, IpcHandle, unsigned);
int cudaIpcCloseMemHandle(void*);
int cudaDeviceDisablePeerAccess(int);
long fakert_count(const char*);
long fakecu_count(const char*);
long fakecu_access(uint64_t);
void fakecu_set_sync_ms(int);
void* fakecu_real(const char*);
void* fakert_driver_fn(const char*);
int cudaGetDriverEntryPoint(const char*, void**, unsigned long long, int*);
int cuMemAllocPitch_v2(uint64_t*, size_t*, size_t, size_t, unsigned);
int cuMemFree_v2(uint64_t);
int cuInit(unsigned);
int cuDevicePrimaryCtxRetain(void**, int);
int cuCtxSetCurrent(void*);

#define MIB ((size_t)1 << 20)
#define CHECK(c) do { if (!(c)) { printf("check_failed=%s:%d %s\n", __FILE__, __LINE__, #c); exit(1); } } while (0)

static void fill(void* p, size_t n, unsigned char v) { memset(p, v, n); }
static int holds(const void* p, size_t n, unsigned char v) {
  const unsigned char* c = p; for (size_t i = 0; i < n; i += 4093) if (c[i] != v) return 0; return c[n - 1] == v;
}

static int basic(void) {
  void *p = 0, *q = 0, *z = (void*)1, *s = 0, *big = 0;
  printf("malloc_rc=%d\n", cudaMalloc(&p, 4 * MIB));
  fill(p, 4 * MIB, 0x5a); CHECK(holds(p, 4 * MIB, 0x5a));
  printf("creates=%ld\n", fakecu_count("cuMemCreate"));
  long syncs = fakert_count("cudaDeviceSynchronize");
  printf("free_rc=%d\n", cudaFree(p));
  printf("free_synced=%ld\n", fakert_count("cudaDeviceSynchronize") - syncs);
  printf("remalloc_rc=%d\n", cudaMalloc(&q, 4 * MIB - 100));
  printf("same_ptr=%d\n", p == q);
  printf("creates_after_reuse=%ld\n", fakecu_count("cuMemCreate"));
  int rc = cudaMalloc(&z, 0);
  printf("zero_rc=%d zero_null=%d\n", rc, z == 0);
  long rt = fakert_count("cudaMalloc");
  rc = cudaMalloc(&s, 1000);
  printf("small_rc=%d small_to_runtime=%ld\n", rc, fakert_count("cudaMalloc") - rt);
  printf("small_free_rc=%d\n", cudaFree(s));
  rc = cudaFree((char*)q + 4096);
  printf("interior_free_rc=%d interior_lasterr=%d\n", rc, cudaGetLastError());
  size_t fr = 0, tot = 0;
  printf("free_null_rc=%d\n", cudaFree(0));
  printf("q_free_rc=%d\n", cudaFree(q));
  rc = cudaFree(q);
  printf("double_free_rc=%d double_lasterr=%d\n", rc, cudaGetLastError());
  rc = cudaMemGetInfo(&fr, &tot);
  printf("meminfo_rc=%d meminfo_free_mib=%zu\n", rc, fr >> 20);
  printf("oom_rc=%d", cudaMalloc(&big, 2048 * MIB)); printf(" oom_lasterr=%d\n", cudaGetLastError());
  printf("null_out_rc=%d\n", cudaMalloc(0, 4 * MIB));
  return 0;
}

/* The fake runtime's handle carries the allocation's start in bytes 24..31. */
static unsigned char* opened(const unsigned char* h) { uint64_t p; memcpy(&p, h + 24, 8); return (unsigned char*)p; }

static int ipc(void) {
  unsigned char h[64], h2[64];
  unsigned char* p = 0;
  CHECK(cudaMalloc((void**)&p, 4 * MIB) == 0);
  printf("vmm_before=%d\n", fakecu_access((uint64_t)p) >= 0);
  fill(p, 4 * MIB, 0x11);
  long frees = fakert_count("cudaFree");
  int rc = cudaIpcGetMemHandle(h, p + 4096);
  printf("ipc_rc=%d\n", rc);
  unsigned char* o = opened(h);
  printf("same_address=%d vmm_after=%d\n", o == p, fakecu_access((uint64_t)p) >= 0);
  printf("data_ok=%d\n", holds(o, 4 * MIB, 0x11) && holds(p, 4 * MIB, 0x11));
  fill(p, 4 * MIB, 0x22);
  rc = cudaIpcGetMemHandle(h2, p);
  printf("again_rc=%d same_bytes=%d\n", rc, memcmp(h, h2, 64) == 0);
  printf("refreshed=%d\n", holds(opened(h2), 4 * MIB, 0x22));
  /* a consumer's write: shared when moved, not seen through a mirror */
  fill(o, 4 * MIB, 0x33);
  printf("write_back_seen=%d\n", holds(p, 4 * MIB, 0x33));
  printf("free_rc=%d", cudaFree(p));
  printf(" runtime_frees=%ld\n", fakert_count("cudaFree") - frees);
  return 0;
}

static int retry(void) {
  void *a, *b, *c;
  CHECK(cudaMalloc(&a, 8 * MIB) == 0 && cudaMalloc(&b, 8 * MIB) == 0);
  printf("first_try_rc=%d\n", cudaMalloc(&c, 12 * MIB));
  CHECK(cudaFree(a) == 0 && cudaFree(b) == 0);
  long before = fakecu_count("cuMemCreate") + fakecu_count("cuMemRelease");
  printf("retry_rc=%d\n", cudaMalloc(&c, 12 * MIB));
  printf("driver_calls_for_retry=%ld\n", fakecu_count("cuMemCreate") + fakecu_count("cuMemRelease") - before);
  fill(c, 12 * MIB, 7); CHECK(holds(c, 12 * MIB, 7));
  CHECK(cudaFree(c) == 0);
  return 0;
}

static unsigned rnd(unsigned* s) { *s = *s * 1103515245u + 12345u; return *s >> 8; }
static void* worker(void* arg) {
  unsigned seed = (unsigned)(uintptr_t)arg, tag = (unsigned char)(uintptr_t)arg;
  void* live[4] = {0}; size_t sz[4] = {0};
  for (int it = 0; it < 1500; it++) {
    int k = rnd(&seed) % 4;
    if (live[k]) {
      if (!holds(live[k], sz[k], (unsigned char)tag)) { printf("corrupt=1\n"); exit(1); }
      if (cudaFree(live[k])) { printf("thread_free_failed=1\n"); exit(1); }
      live[k] = 0;
    } else {
      sz[k] = (rnd(&seed) % 4 == 0) ? 1 + rnd(&seed) % 4096 : (1 + rnd(&seed) % 8) * MIB - rnd(&seed) % 1000;
      if (cudaMalloc(&live[k], sz[k])) { printf("thread_malloc_failed=1\n"); exit(1); }
      fill(live[k], sz[k], (unsigned char)tag);
    }
  }
  for (int k = 0; k < 4; k++) if (live[k]) cudaFree(live[k]);
  return 0;
}
static int threads(void) {
  pthread_t t[8];
  for (uintptr_t i = 0; i < 8; i++) pthread_create(&t[i], 0, worker, (void*)(i + 1));
  for (int i = 0; i < 8; i++) pthread_join(t[i], 0);
  printf("threads_ok=1 pooled=%d\n", fakecu_count("cuMemCreate") > 0);
  return 0;
}

void fakecu_launch(int, uint64_t, size_t);
/* Device 1 has peer access to device 0's allocation and work in flight on it when the program
 * asks a handle (twice: the mirror made, then refreshed): the mirror's copy comes after that
 * work, as after device 0's own. */
static int peer_mirror(void) {
  void* q;
  CHECK(cudaSetDevice(1) == 0);
  printf("enable_rc=%d\n", cudaDeviceEnablePeerAccess(0, 0));
  CHECK(cudaSetDevice(0) == 0);
  CHECK(cudaMalloc(&q, 4 * MIB) == 0);
  unsigned char h[64];
  long s0 = fakecu_count("stale_read");
  fakecu_launch(1, (uint64_t)q, 4 * MIB);
  printf("get_rc=%d", cudaIpcGetMemHandle(h, q));
  fakecu_launch(1, (uint64_t)q, 4 * MIB);
  printf(" again_rc=%d", cudaIpcGetMemHandle(h, q));
  printf(" stale_reads=%ld free_rc=%d\n", fakecu_count("stale_read") - s0, cudaFree(q));
  return 0;
}

static int peer(void) {
  void *p, *q, *r;
  CHECK(cudaSetDevice(1) == 0);
  CHECK(cudaMalloc(&p, 4 * MIB) == 0);
  printf("dev1_access=%ld\n", fakecu_access((uint64_t)p));
  CHECK(cudaSetDevice(0) == 0);
  printf("enable_rc=%d\n", cudaDeviceEnablePeerAccess(1, 0));
  printf("after_enable=%ld\n", fakecu_access((uint64_t)p));
  CHECK(cudaSetDevice(1) == 0);
  CHECK(cudaMalloc(&q, 6 * MIB) == 0);
  printf("new_mapping=%ld\n", fakecu_access((uint64_t)q));
  CHECK(cudaSetDevice(0) == 0);
  CHECK(cudaMalloc(&r, 2 * MIB) == 0);
  printf("dev0_alloc=%ld\n", fakecu_access((uint64_t)r));
  printf("disable_rc=%d\n", cudaDeviceDisablePeerAccess(1));
  printf("after_disable=%ld\n", fakecu_access((uint64_t)p));
  printf("cross_free_rc=%d", cudaFree(p));
  int d = -1; cudaGetDevice(&d); printf(" device_after=%d\n", d);
  /* A context the program made stays its thread's context across a free of another device's
   * memory (expseg waits for device 1 there, then puts the thread back as it was). */
  int (*create_)(void**, unsigned, int) = (int (*)(void**, unsigned, int))dlsym(RTLD_DEFAULT, "cuCtxCreate_v2");
  int (*current_)(void**) = (int (*)(void**))dlsym(RTLD_DEFAULT, "cuCtxGetCurrent");
  void *mine = 0, *after = 0;
  CHECK(create_ && current_ && create_(&mine, 0, 0) == 0);
  printf("own_ctx_free_rc=%d", cudaFree(q));
  current_(&after);
  printf(" own_ctx_kept=%d\n", after == mine);
  CHECK(cudaFree(r) == 0);
  return 0;
}

static int forked(void) {
  void* p; CHECK(cudaMalloc(&p, 4 * MIB) == 0);
  fflush(stdout);
  pid_t k = fork();
  if (k == 0) {
    long rt = fakert_count("cudaMalloc"); void* c;
    int rc = cudaMalloc(&c, 4 * MIB);
    printf("child_rc=%d child_to_runtime=%ld\n", rc, fakert_count("cudaMalloc") - rt);
    fflush(stdout); _exit(0);
  }
  int st; waitpid(k, &st, 0);
  printf("child_exit=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  printf("parent_free_rc=%d\n", cudaFree(p));
  return 0;
}

/* Consumer half of "share": open the handle, check, write, close. */
static int consume(const char* hex, int expect, int write) {
  IpcHandle h;
  for (int i = 0; i < 64; i++) { unsigned v; sscanf(hex + 2 * i, "%2x", &v); h.b[i] = (unsigned char)v; }
  unsigned char* q = 0;
  /* CONSUMER_PEER=before|after: device 1 gets peer access to device 0 before the open or
   * after it (then loses it again): memory opened on device 0 is device 1's to reach while
   * it has peer access, as legacy IPC memory of device 0's context is. */
  const char* peer = getenv("CONSUMER_PEER");
  if (peer && !strcmp(peer, "before")) { cudaSetDevice(1); cudaDeviceEnablePeerAccess(0, 0); cudaSetDevice(0); }
  int rc = cudaIpcOpenMemHandle((void**)&q, h, 1);
  printf("open_rc=%d", rc);
  if (rc == 0 && getenv("CONSUMER_TWICE")) {
    /* CUDA: a second open of one handle in a context is the same pointer, one more reference
     * (measured natively on an H100: scripts/vmm-cost/ipc_open_twice.cu). */
    unsigned char* q2 = 0;
    int rc2 = cudaIpcOpenMemHandle((void**)&q2, h, 1);
    int c1 = cudaIpcCloseMemHandle(q2);
    int kept = fakecu_access((uint64_t)q) != -1 && holds(q, 32 * MIB, (unsigned char)expect);
    int c2 = cudaIpcCloseMemHandle(q);
    int gone = fakecu_access((uint64_t)q) == -1;
    int c3 = cudaIpcCloseMemHandle(q);
    printf(" open2_rc=%d same_ptr=%d close_1=%d kept_after_one_close=%d close_2=%d unmapped=%d close_3=%d\n", rc2, q2 == q,
           c1, kept, c2, gone, c3 != 0);
    return 0;
  }
  if (rc == 0 && getenv("CONSUMER_RESET")) {
    /* A reset ends memory opened through IPC: a close after it fails (measured natively). */
    extern int cudaDeviceReset(void);
    int r = cudaDeviceReset();
    int mapped = fakecu_access((uint64_t)q) != -1;
    int c = cudaIpcCloseMemHandle(q);
    printf(" reset_rc=%d after_reset_mapped=%d close_after_reset_fails=%d\n", r, mapped, c != 0);
    return 0;
  }
  if (rc == 0 && peer) {
    printf(" import_access=%ld", fakecu_access((uint64_t)q));
    if (!strcmp(peer, "after")) {
      cudaSetDevice(1); cudaDeviceEnablePeerAccess(0, 0);
      printf(" access_enabled=%ld", fakecu_access((uint64_t)q));
      cudaDeviceDisablePeerAccess(0);
      printf(" access_disabled=%ld", fakecu_access((uint64_t)q));
      cudaSetDevice(0);
    }
  }
  if (rc == 0) {
    printf(" consumer_sees=%d", holds(q, 32 * MIB, (unsigned char)expect));
    fill(q, 32 * MIB, (unsigned char)write);
    printf(" close_rc=%d", cudaIpcCloseMemHandle(q));
  }
  printf("\n");
  return 0;
}

static void run_consumer(const char* self, const char* how, const unsigned char* h, int expect, int write) {
  char hex[129], e[8], w[8];
  for (int i = 0; i < 64; i++) sprintf(hex + 2 * i, "%02x", h[i]);
  snprintf(e, sizeof e, "%d", expect); snprintf(w, sizeof w, "%d", write);
  fflush(stdout);
  pid_t k = fork();
  if (k == 0) {
    if (!strcmp(how, "plain")) unsetenv("LD_PRELOAD");
    if (!strcmp(how, "nobody") && (setgid(65534) || setuid(65534))) _exit(126);
    execl(self, self, "consume", hex, e, w, (char*)0);
    _exit(127);
  }
  int st; waitpid(k, &st, 0);
}

/* Producer: a 32 MiB pool allocation (above the move limit) shared with consumers. */
static int share(const char* self, const char* how) {
  unsigned char* p = 0; unsigned char h[64];
  CHECK(cudaMalloc((void**)&p, 32 * MIB) == 0);
  fill(p, 32 * MIB, 0x41);
  printf("get_rc=%d", cudaIpcGetMemHandle(h, p));
  printf(" ticket=%d\n", memcmp(h, "XSG1", 4) == 0);
  run_consumer(self, how, h, 0x41, 0x42);
  printf("producer_sees_write=%d\n", holds(p, 32 * MIB, 0x42));
  unsigned char forged[64]; memcpy(forged, h, 64); forged[16] ^= 1; /* nonce */
  run_consumer(self, how, forged, 0x41, 0x43);
  CHECK(cudaFree(p) == 0);
  run_consumer(self, how, h, 0x41, 0x44); /* the allocation is gone */
  return 0;
}

/* Consumer half of "share_kept": open, close (kept mapped unless EXPSEG_IPC_KEEP_CLOSED=0),
 * open again, close; then tell the producer (fd `ready`) and wait for its free (fd `go`):
 * by then the kept mapping is gone. */
static int consume_kept(const char* hex, int ready, int go) {
  IpcHandle h;
  for (int i = 0; i < 64; i++) { unsigned v; sscanf(hex + 2 * i, "%2x", &v); h.b[i] = (unsigned char)v; }
  unsigned char *q = 0, *q2 = 0;
  int rc = cudaIpcOpenMemHandle((void**)&q, h, 1);
  int sees = rc == 0 && holds(q, 32 * MIB, 0x41);
  long before = fakecu_count("cuMemMap");
  int c1 = cudaIpcCloseMemHandle(q);
  int mapped_after_close = fakecu_access((uint64_t)q) != -1;
  int rc2 = cudaIpcOpenMemHandle((void**)&q2, h, 1);
  int sees2 = rc2 == 0 && holds(q2, 32 * MIB, 0x41);
  long maps = fakecu_count("cuMemMap") - before;
  if (rc2 == 0) fill(q2, 32 * MIB, 0x45);
  int c2 = cudaIpcCloseMemHandle(q2);
  int c3 = cudaIpcCloseMemHandle(q2);
  printf("kept_open_rc=%d kept_sees=%d kept_close_rc=%d mapped_after_close=%d reopen_rc=%d same_ptr=%d reopen_sees=%d reopen_maps=%ld close2_rc=%d close3_fails=%d\n",
         rc, sees, c1, mapped_after_close, rc2, q2 == q, sees2, maps, c2, c3 != 0);
  fflush(stdout);
  char b = 'r';
  if (write(ready, &b, 1) != 1 || read(go, &b, 1) != 1) return 1;
  printf("unmapped_after_producer_free=%d\n", fakecu_access((uint64_t)q) == -1);
  fflush(stdout);
  return 0;
}

/* Producer of "share_kept": a 32 MiB allocation shared with one consumer that closes and opens
 * it again, then freed while the consumer still runs. */
static int share_kept(const char* self) {
  unsigned char* p = 0; unsigned char h[64];
  CHECK(cudaMalloc((void**)&p, 32 * MIB) == 0);
  fill(p, 32 * MIB, 0x41);
  CHECK(cudaIpcGetMemHandle(h, p) == 0);
  char hex[129], r[16], g[16];
  for (int i = 0; i < 64; i++) sprintf(hex + 2 * i, "%02x", h[i]);
  int ready[2], go[2];
  CHECK(pipe(ready) == 0 && pipe(go) == 0);
  snprintf(r, sizeof r, "%d", ready[1]); snprintf(g, sizeof g, "%d", go[0]);
  fflush(stdout);
  pid_t k = fork();
  if (k == 0) {
    execl(self, self, "consume_kept", hex, r, g, (char*)0);
    _exit(127);
  }
  char b;
  int got = read(ready[0], &b, 1) == 1;
  printf("producer_sees_consumer_write=%d\n", got && holds(p, 32 * MIB, 0x45));
  printf("free_rc=%d\n", cudaFree(p));
  fflush(stdout);
  if (write(go[1], &b, 1) != 1) return 1;
  int st; waitpid(k, &st, 0);
  printf("consumer_exit=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  return 0;
}

int cuMemGetAddressRange_v2(uint64_t*, size_t*, uint64_t);
int cuPointerGetAttribute(void*, int, uint64_t);
int cuPointerGetAttributes(unsigned, int*, void**, uint64_t);
static unsigned char* foreign_run(int n, size_t piece);

/* Functions fetched through a runtime handle reach expseg; the driver's range queries
 * describe the allocation; other lookups are untouched. */
static int lookup(void) {
  void* rt = dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD);
  CHECK(rt);
  int (*m)(void**, size_t) = (int (*)(void**, size_t))dlsym(rt, "cudaMalloc");
  int (*get)(void*, void*) = (int (*)(void*, void*))dlsym(rt, "cudaIpcGetMemHandle");
  printf("handle_lookup_is_hook=%d\n", (void*)m == dlsym(RTLD_DEFAULT, "cudaMalloc") && (void*)m != 0);
  long creates = fakecu_count("cuMemCreate");
  unsigned char* p = 0;
  CHECK(m((void**)&p, 6 * MIB) == 0);
  printf("pooled_through_handle=%d\n", fakecu_count("cuMemCreate") > creates);
  unsigned char h[64];
  printf("ipc_through_handle_rc=%d\n", get(h, p));
  uint64_t base = 0, start = 0, rsize = 0; size_t size = 0;
  int rc = cuMemGetAddressRange_v2(&base, &size, (uint64_t)(p + 12345));
  printf("range_rc=%d range_ok=%d\n", rc, base == (uint64_t)p && size == 6 * MIB);
  rc = cuPointerGetAttribute(&start, 11, (uint64_t)(p + 5)) | cuPointerGetAttribute(&rsize, 12, (uint64_t)(p + 5));
  printf("attr_rc=%d attr_ok=%d\n", rc, start == (uint64_t)p && rsize == 6 * MIB);
  /* Legacy IPC capable, as cuMemAlloc memory is (the driver says no to VMM memory), through
   * the singular and the plural call; VMM memory of another allocator keeps the driver's no. */
  int legacy = 0, legacy2 = 0, legacy_foreign = 7;
  rc = cuPointerGetAttribute(&legacy, 10, (uint64_t)(p + 5));
  int attrs[2] = {10, 12}; uint64_t rs2 = 0; void* slots[2] = {&legacy2, &rs2};
  rc |= cuPointerGetAttributes(2, attrs, slots, (uint64_t)(p + 5));
  unsigned char* f = foreign_run(1, 2 * MIB);
  rc |= cuPointerGetAttribute(&legacy_foreign, 10, (uint64_t)f);
  printf("legacy_rc=%d legacy=%d legacy_plural=%d legacy_foreign=%d\n", rc, legacy, legacy2, legacy_foreign);
  printf("other_lookup_ok=%d\n", dlsym(rt, "cudaGetLastError") != 0 && dlsym(RTLD_NEXT, "malloc") != 0);
  /* A wheel's runtime under a hashed name (vLLM finds it by "libcudart" in /proc/self/maps
   * and opens it with ctypes): its lookups reach expseg too. */
  void* hashed = dlopen("libcudart-1a2b3c4d.so.13", RTLD_NOW | RTLD_LOCAL);
  printf("hashed_lookup_is_hook=%d\n", hashed && dlsym(hashed, "cudaIpcGetMemHandle") == dlsym(RTLD_DEFAULT, "cudaIpcGetMemHandle"));
  return 0;
}

typedef struct { int type; int requestedHandleTypes; struct { int type; int id; } location; void* win32; unsigned char flags[8]; } Prop;
typedef struct { struct { int type; int id; } location; int flags; } Access;
int cuMemCreate(uint64_t*, size_t, const Prop*, unsigned long long);
int cuMemAddressReserve(uint64_t*, size_t, size_t, uint64_t, unsigned long long);
int cuMemMap(uint64_t, size_t, size_t, uint64_t, unsigned long long);
int cuMemSetAccess(uint64_t, size_t, const Access*, size_t);
int cuMemUnmap(uint64_t, size_t);
int cuMemRelease(uint64_t);

/* VMM memory made by another allocator, mapped in pieces as PyTorch's expandable segments
 * do: `n` back-to-back mappings of `piece` bytes. */
static unsigned char* foreign_run(int n, size_t piece) {
  Prop p; memset(&p, 0, sizeof p); p.type = 1; p.location.type = 1; p.requestedHandleTypes = 1;
  Access a; memset(&a, 0, sizeof a); a.location.type = 1; a.flags = 3;
  uint64_t h, va;
  CHECK(cuMemAddressReserve(&va, n * piece, 0, 0, 0) == 0);
  for (int i = 0; i < n; i++) CHECK(cuMemCreate(&h, piece, &p, 0) == 0 && cuMemMap(va + i * piece, piece, 0, h, 0) == 0);
  CHECK(cuMemSetAccess(va, n * piece, &a, 1) == 0);
  return (unsigned char*)va;
}

/* IPC of such memory: a mirror of the run of mappings from the one containing the pointer. */
static int foreign(void) {
  unsigned char* m = foreign_run(2, 4 * MIB);
  fill(m, 8 * MIB, 0x61);
  unsigned char hd[64], hd2[64];
  int rc = cudaIpcGetMemHandle(hd, m + 100);
  printf("foreign_rc=%d lasterr=%d\n", rc, cudaGetLastError());
  printf("foreign_data=%d\n", rc == 0 && holds(opened(hd), 8 * MIB, 0x61));
  fill(m, 8 * MIB, 0x62);
  rc = cudaIpcGetMemHandle(hd2, m);
  printf("foreign_again_rc=%d same=%d refreshed=%d\n", rc, !memcmp(hd, hd2, 64), holds(opened(hd2), 8 * MIB, 0x62));
  rc = cudaIpcGetMemHandle(hd2, m + 4 * MIB + 1);
  printf("second_piece_rc=%d second_piece_data=%d\n", rc, rc == 0 && holds(opened(hd2), 4 * MIB, 0x62));
  int x; printf("host_rc=%d\n", cudaIpcGetMemHandle(hd, &x));
  return 0;
}

/* Producer of foreign memory: four 8 MiB mappings (or FOREIGN_PIECES of 2 MiB), shared with
 * a consumer, which checks the first 32 MiB. */
static int share_foreign(const char* self, const char* how) {
  int n = getenv("FOREIGN_PIECES") ? atoi(getenv("FOREIGN_PIECES")) : 4;
  size_t piece = getenv("FOREIGN_PIECES") ? 2 * MIB : 8 * MIB;
  unsigned char* m = foreign_run(n, piece);
  unsigned char h[64];
  fill(m, n * piece, 0x41);
  printf("get_rc=%d", cudaIpcGetMemHandle(h, m + 5));
  printf(" ticket=%d\n", memcmp(h, "XSG1", 4) == 0);
  unsigned char again[64];
  int again_rc = cudaIpcGetMemHandle(again, m);
  printf("again_rc=%d same_handle=%d\n", again_rc, !memcmp(h, again, 64));
  run_consumer(self, how, h, 0x41, 0x42);
  printf("producer_sees_write=%d\n", holds(m, 32 * MIB, 0x42));
  /* References on primary contexts that expseg's threads took and kept (the program takes none). */
  printf("primary_refs=%ld\n", fakecu_count("cuDevicePrimaryCtxRetain") - fakecu_count("cuDevicePrimaryCtxRelease_v2"));
  return 0;
}

/* A page of a shared foreign run swapped for another while the producer sends the run's
 * descriptors (EXPSEG_TEST_SLOW_EXPORT holds the export after the first one): the consumer
 * maps the memory that was there when its open was decided (the pages the producer had), never
 * the page mapped there since, whose bytes differ. */
int cuMemRetainAllocationHandle(uint64_t*, void*);
static int foreign_swap(const char* self) {
  unsigned char* m = foreign_run(4, 8 * MIB);
  fill(m, 32 * MIB, 0x41);
  unsigned char h[64], hex[129];
  printf("get_rc=%d\n", cudaIpcGetMemHandle(h, m));
  for (int i = 0; i < 64; i++) sprintf((char*)hex + 2 * i, "%02x", h[i]);
  long e0 = fakecu_count("cuMemExportToShareableHandle");
  fflush(stdout);
  pid_t k = fork();
  if (k == 0) { execl(self, self, "consume", (char*)hex, "65", "66", (char*)0); _exit(127); }
  /* The open is decided once the first descriptor is exported; then page 2 goes. */
  int seen = 0;
  for (int i = 0; i < 5000 && !seen; i++) if (fakecu_count("cuMemExportToShareableHandle") > e0) seen = 1; else usleep(1000);
  uint64_t old = 0, fresh = 0, va = (uint64_t)m + 16 * MIB;
  int rc = cuMemRetainAllocationHandle(&old, (void*)va) | cuMemUnmap(va, 8 * MIB) | cuMemRelease(old) | cuMemRelease(old);
  Prop p; memset(&p, 0, sizeof p); p.type = 1; p.location.type = 1; p.requestedHandleTypes = 1;
  Access a; memset(&a, 0, sizeof a); a.location.type = 1; a.flags = 3;
  rc |= cuMemCreate(&fresh, 8 * MIB, &p, 0) | cuMemMap(va, 8 * MIB, 0, fresh, 0) | cuMemSetAccess(va, 8 * MIB, &a, 1);
  fill((unsigned char*)va, 8 * MIB, 0x99);
  int done = fakecu_count("cuMemExportToShareableHandle") - e0 < 4; /* swapped before the rest went */
  int st; waitpid(k, &st, 0);
  printf("export_seen=%d swap_rc=%d swapped_in_window=%d\n", seen, rc, done);
  return 0;
}

/* Handle requests on a foreign run from two threads while a third grows and shrinks it (each
 * change of extent replaces the share and its mirror): no request may copy into a mirror
 * another thread freed. */
static uint64_t race_va; static volatile int race_stop;
static void* race_requester(void* arg) {
  (void)arg; unsigned char h[64]; long ok = 0;
  while (!race_stop) if (cudaIpcGetMemHandle(h, (void*)race_va) == 0) ok++; else cudaGetLastError();
  return (void*)ok;
}
static void* race_mutator(void* arg) {
  (void)arg;
  Prop p; memset(&p, 0, sizeof p); p.type = 1; p.location.type = 1; p.requestedHandleTypes = 1;
  Access a; memset(&a, 0, sizeof a); a.location.type = 1; a.flags = 3;
  for (int i = 0; i < 300; i++) {
    uint64_t h;
    if (cuMemCreate(&h, 2 * MIB, &p, 0)) continue;
    if (cuMemMap(race_va + 4 * MIB, 2 * MIB, 0, h, 0) == 0) {
      cuMemSetAccess(race_va + 4 * MIB, 2 * MIB, &a, 1);
      usleep(200);
      cuMemUnmap(race_va + 4 * MIB, 2 * MIB);
    }
    cuMemRelease(h);
    usleep(200);
  }
  race_stop = 1;
  return 0;
}
static int mirror_race(void) {
  /* Two 2 MiB mappings, room for a third right after them. */
  Prop p; memset(&p, 0, sizeof p); p.type = 1; p.location.type = 1; p.requestedHandleTypes = 1;
  Access a; memset(&a, 0, sizeof a); a.location.type = 1; a.flags = 3;
  uint64_t h; CHECK(cuMemAddressReserve(&race_va, 6 * MIB, 0, 0, 0) == 0);
  for (int i = 0; i < 2; i++) CHECK(cuMemCreate(&h, 2 * MIB, &p, 0) == 0 && cuMemMap(race_va + i * 2 * MIB, 2 * MIB, 0, h, 0) == 0);
  CHECK(cuMemSetAccess(race_va, 4 * MIB, &a, 1) == 0);
  pthread_t r1, r2, m;
  pthread_create(&r1, 0, race_requester, 0); pthread_create(&r2, 0, race_requester, 0);
  pthread_create(&m, 0, race_mutator, 0);
  void *a1, *a2; pthread_join(m, 0); pthread_join(r1, &a1); pthread_join(r2, &a2);
  printf("race_done=1 handles=%ld\n", (long)a1 + (long)a2);
  return 0;
}

/* The one-time ticket check (made slow with EXPSEG_TEST_SLOW_CHECK) must not hold up another
 * thread's allocations: the worst cudaMalloc+cudaFree of a second thread during it. */
static volatile int slow_stop;
static double now_ms(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
static void* slow_allocator(void* arg) {
  double worst = 0;
  while (!slow_stop) {
    double t = now_ms(); void* q = 0;
    if (cudaMalloc(&q, 4 * MIB) == 0) cudaFree(q);
    double d = now_ms() - t; if (d > worst) worst = d;
    usleep(1000);
  }
  *(double*)arg = worst;
  return 0;
}
static int slow_check(void) {
  void* p = 0; CHECK(cudaMalloc(&p, 32 * MIB) == 0);
  double worst = 0; pthread_t t; pthread_create(&t, 0, slow_allocator, &worst);
  usleep(100 * 1000);
  unsigned char h[64]; double t0 = now_ms();
  int rc = cudaIpcGetMemHandle(h, p);
  double took = now_ms() - t0;
  usleep(100 * 1000); slow_stop = 1; pthread_join(t, 0);
  printf("get_rc=%d get_ms=%.0f worst_other_ms=%.0f\n", rc, took, worst);
  return 0;
}

/* The same while a second thread asks for the handle of a 4 MiB allocation, which
 * EXPSEG_IPC_MOVE_MAX lets it move (the fake's cudaMalloc never lands on the address, so the
 * move falls back to a mirror): neither that request nor the other thread's allocations wait
 * for the check. */
struct second_ipc { void* p; int rc; double ms; };
static void* second_ipc(void* arg) {
  struct second_ipc* s = arg; unsigned char h[64];
  usleep(100 * 1000);
  double t0 = now_ms(); s->rc = cudaIpcGetMemHandle(h, s->p); s->ms = now_ms() - t0;
  return 0;
}
/* A 2 MiB allocation moved in place by its first handle request, which also starts the
 * ticket check (its own 2 MiB cudaMalloc on another thread). */
static int move_beside_check_malloc(void) {
  unsigned char* p = 0; CHECK(cudaMalloc((void**)&p, 2 * MIB) == 0);
  fill(p, 2 * MIB, 0x3c);
  unsigned char h[64];
  int rc = cudaIpcGetMemHandle(h, p);
  printf("ipc_rc=%d pool_after=%d data_ok=%d", rc, fakecu_access((uint64_t)p) >= 0, holds(p, 2 * MIB, 0x3c));
  usleep(300 * 1000); /* the check ends */
  printf(" free_rc=%d\n", cudaFree(p));
  return 0;
}

static int slow_check_beside_a_move(void) {
  void *p = 0, *s = 0; CHECK(cudaMalloc(&p, 32 * MIB) == 0 && cudaMalloc(&s, 4 * MIB) == 0);
  double worst = 0; pthread_t t, u; pthread_create(&t, 0, slow_allocator, &worst);
  usleep(100 * 1000);
  struct second_ipc second = {s, -1, 0}; pthread_create(&u, 0, second_ipc, &second);
  unsigned char h[64]; double t0 = now_ms();
  int rc = cudaIpcGetMemHandle(h, p);
  double took = now_ms() - t0;
  pthread_join(u, 0);
  usleep(100 * 1000); slow_stop = 1; pthread_join(t, 0);
  printf("get_rc=%d get_ms=%.0f second_rc=%d second_ms=%.0f worst_other_ms=%.0f\n", rc, took, second.rc, second.ms, worst);
  return 0;
}

/* EXPSEG_TEST_PANIC=pool:2: the second pool allocation panics inside the pools' lock, right
 * after the pool booked it. Then new allocations are the runtime's, and a pointer the pool
 * handed out before is freed once (answered, its memory left in place), never released. */
static int poisoned(void) {
  void *a = 0, *b = 0, *c = 0;
  CHECK(cudaMalloc(&a, 4 * MIB) == 0 && fakecu_access((uint64_t)a) >= 0);
  fill(a, 4 * MIB, 0x21);
  long rt = fakert_count("cudaMalloc"), rel = fakecu_count("cuMemRelease"), unm = fakecu_count("cuMemUnmap");
  printf("panic_rc=%d\n", cudaMalloc(&b, 4 * MIB));
  int rc = cudaMalloc(&c, 4 * MIB);
  printf("after_rc=%d after_to_runtime=%ld after_pool=%d\n", rc, fakert_count("cudaMalloc") - rt,
         fakecu_access((uint64_t)c) >= 0);
  fill(c, 4 * MIB, 0x43);
  rc = cudaFree(a);
  printf("old_free_rc=%d", rc);
  printf(" old_data_kept=%d", holds(a, 4 * MIB, 0x21));
  rc = cudaFree(a);
  printf(" old_again_rc=%d old_again_lasterr=%d\n", rc, cudaGetLastError());
  printf("new_free_rc=%d\n", cudaFree(c));
  printf("released=%ld unmapped=%ld\n", fakecu_count("cuMemRelease") - rel, fakecu_count("cuMemUnmap") - unm);
  return 0;
}

/* A thread keeps writing to a 4 MiB pool allocation while the main thread asks for its IPC
 * handle again and again. */
static volatile int writer_stop;
static void* writer(void* arg) {
  while (!writer_stop) memset(arg, 0x5c, 4 * MIB);
  return 0;
}
static int move_race(void) {
  unsigned char* p = 0; CHECK(cudaMalloc((void**)&p, 4 * MIB) == 0);
  pthread_t t; pthread_create(&t, 0, writer, p);
  int ok = 0; unsigned char h[64];
  for (int i = 0; i < 200; i++) if (cudaIpcGetMemHandle(h, p) == 0) ok++;
  writer_stop = 1; pthread_join(t, 0);
  printf("requests_ok=%d still_pool_memory=%d\n", ok, fakecu_access((uint64_t)p) >= 0);
  return 0;
}

/* A foreign run shared through a mirror, then unmapped by its allocator with `un`: the mirror
 * goes. */
static int unmap_shared_run(int (*un)(uint64_t, size_t)) {
  unsigned char* m = foreign_run(2, 4 * MIB);
  unsigned char h[64];
  printf(" get_rc=%d", cudaIpcGetMemHandle(h, m));
  long frees = fakert_count("cudaFree");
  CHECK(un((uint64_t)m, 4 * MIB) == 0 && un((uint64_t)m + 4 * MIB, 4 * MIB) == 0);
  printf(" mirror_freed=%ld\n", fakert_count("cudaFree") - frees);
  return 0;
}

/* Through the driver's exported cuMemUnmap. */
static int foreign_unmap(void) { return unmap_shared_run(cuMemUnmap); }

/* Through PyTorch's way of getting cuMemUnmap (the runtime's entry point API; expseg's VMM
 * hook under EXPSEG_COALESCE=all): pages expseg did not make pass through it to the driver,
 * and their shares end as above. */
static int foreign_unmap_hooked(void) {
  int (*un)(uint64_t, size_t) = 0; int st = 0;
  CHECK(cudaGetDriverEntryPoint("cuMemUnmap", (void**)&un, 0, &st) == 0 && un);
  printf("hooked=%d", (void*)un != (void*)cuMemUnmap && (void*)un != fakecu_real("cuMemUnmap"));
  return unmap_shared_run(un);
}

/* Refreshing a pool allocation's mirror waits for the device without the global lock: another
 * thread's cudaMalloc meanwhile is not held up. Then a free beside refreshes. */
static volatile int refresh_stop;
static void* timed_mallocs(void* arg) {
  /* Allocations are kept until the end: a cudaFree waits for the device (as the real one
   * does), and a thread waiting there could not notice the lock being held. */
  double worst = 0; void* kept[128]; int n = 0;
  while (!refresh_stop) {
    double t = now_ms(); void* q = 0;
    if (n < 128 && cudaMalloc(&q, 2 * MIB) == 0) {
      double d = now_ms() - t; if (d > worst) worst = d; kept[n++] = q;
    }
    usleep(5000);
  }
  if (n < 10) worst = 1e9; /* too few allocations to tell */
  while (n) cudaFree(kept[--n]);
  *(double*)arg = worst;
  return 0;
}
static void* refresher(void* arg) {
  unsigned char h[64]; long ok = 0;
  while (!refresh_stop) if (cudaIpcGetMemHandle(h, arg) == 0) ok++; else cudaGetLastError();
  return (void*)ok;
}
static int refresh_wait(void) {
  unsigned char* p = 0; CHECK(cudaMalloc((void**)&p, 32 * MIB) == 0);
  unsigned char h[64]; CHECK(cudaIpcGetMemHandle(h, p) == 0); /* the mirror exists */
  double worst = 0; pthread_t t; pthread_create(&t, 0, timed_mallocs, &worst);
  usleep(50 * 1000);
  fakecu_set_sync_ms(400);
  double t0 = now_ms();
  int rc = cudaIpcGetMemHandle(h, p);
  double took = now_ms() - t0;
  fakecu_set_sync_ms(0);
  refresh_stop = 1; pthread_join(t, 0);
  printf("refresh_rc=%d refresh_ms=%.0f worst_malloc_ms=%.0f\n", rc, took, worst);
  /* The first mirror of another allocation: its copy waits for the device too. */
  unsigned char* q = 0; CHECK(cudaMalloc((void**)&q, 32 * MIB) == 0);
  fill(q, 32 * MIB, 7);
  refresh_stop = 0; worst = 0; pthread_create(&t, 0, timed_mallocs, &worst);
  usleep(50 * 1000);
  fakecu_set_sync_ms(400);
  t0 = now_ms();
  rc = cudaIpcGetMemHandle(h, q);
  took = now_ms() - t0;
  fakecu_set_sync_ms(0);
  refresh_stop = 1; pthread_join(t, 0);
  printf("first_rc=%d first_ms=%.0f first_worst_malloc_ms=%.0f\n", rc, took, worst);
  CHECK(cudaFree(q) == 0);
  /* A free beside a stream of refreshes. */
  refresh_stop = 0;
  pthread_t r; pthread_create(&r, 0, refresher, p);
  usleep(30 * 1000);
  int frc = cudaFree(p);
  usleep(30 * 1000);
  refresh_stop = 1; void* ok; pthread_join(r, &ok);
  printf("free_rc=%d refreshes=%ld\n", frc, (long)ok);
  return 0;
}

/* A mirror brought up to date at the program's orderings: a context synchronize, and the
 * record of an event it made a handle of (not the record of another event). */
typedef int (*drv0_t)(void);
typedef int (*drv2_t)(void*, void*);
static int mirror_sync(void) {
  unsigned char h[64], eh[64];
  unsigned char* p = 0; CHECK(cudaMalloc((void**)&p, 4 * MIB) == 0);
  fill(p, 4 * MIB, 0x11);
  CHECK(cudaIpcGetMemHandle(h, p) == 0);
  unsigned char* o = opened(h);
  fill(p, 4 * MIB, 0x22);
  drv0_t ctx_sync = (drv0_t)dlsym(RTLD_DEFAULT, "cuCtxSynchronize");
  drv2_t ipc_event = (drv2_t)dlsym(RTLD_DEFAULT, "cuIpcGetEventHandle");
  drv2_t record = (drv2_t)dlsym(RTLD_DEFAULT, "cuEventRecord");
  CHECK(ctx_sync && ipc_event && record);
  printf("stale_before=%d ", holds(o, 4 * MIB, 0x11));
  int rc = ctx_sync(); /* (called before the check: argument order is unspecified) */
  printf("sync_rc=%d after_sync=%d\n", rc, holds(o, 4 * MIB, 0x22));
  fill(p, 4 * MIB, 0x33);
  void* ev = (void*)(uintptr_t)0x77;
  printf("event_handle_rc=%d ", ipc_event(eh, ev));
  rc = record(ev, (void*)(uintptr_t)1);
  printf("record_rc=%d after_record=%d\n", rc, holds(o, 4 * MIB, 0x33));
  fill(p, 4 * MIB, 0x44);
  rc = record((void*)(uintptr_t)0x78, (void*)(uintptr_t)1);
  printf("other_record_rc=%d other_copied=%d\n", rc, holds(o, 4 * MIB, 0x44));
  return 0;
}

/* Three allocations shared one after another: how many lines say how they are shared. */
static int ipc_many(void) {
  int bad = 0;
  for (int i = 0; i < 3; i++) {
    unsigned char* p = 0; CHECK(cudaMalloc((void**)&p, 4 * MIB) == 0);
    unsigned char h[64]; bad += cudaIpcGetMemHandle(h, p) != 0;
  }
  printf("share_failures=%d\n", bad);
  return 0;
}

/* Allocate, say so, and wait to be terminated. */
static int wait_for_term(void) {
  void* p = 0; int rc = cudaMalloc(&p, 4 * MIB);
  /* ANY_RC: the allocation may fail (the process is there to be terminated). */
  CHECK(rc == 0 || getenv("ANY_RC"));
  printf("ready=1\n"); fflush(stdout);
  sleep(20);
  return 0;
}

/* Reclaim: "hold N" takes N MiB, frees it and holds on (its memory kept where keeping is
 * opted into) until its stdin closes; "need N" takes N MiB at once and says whether it got it
 * (NEED_PITCH=1: through the driver's cuMemAllocPitch_v2 instead of cudaMalloc). */
static int hold(size_t mib) {
  void* p = 0; CHECK(cudaMalloc(&p, mib * MIB) == 0);
  fill(p, mib * MIB, 7);
  CHECK(cudaFree(p) == 0);
  printf("held=1\n"); fflush(stdout);
  char buf[64];
  while (fread(buf, 1, sizeof buf, stdin) > 0) {}
  return 0;
}

static int need(size_t mib) {
  void* p = 0;
  int rc;
  if (getenv("NEED_PITCH")) {
    /* The driver's pitched allocation in the primary context: rows of 4 MiB. */
    void* c = 0; uint64_t d = 0; size_t pitch = 0;
    CHECK(cuInit(0) == 0 && cuDevicePrimaryCtxRetain(&c, 0) == 0 && cuCtxSetCurrent(c) == 0);
    rc = cuMemAllocPitch_v2(&d, &pitch, 4 * MIB, mib / 4, 4);
    printf("need_rc=%d\n", rc);
    if (rc) return 0;
    CHECK(pitch == 4 * MIB);
    fill((void*)(uintptr_t)d, mib * MIB, 9); CHECK(holds((void*)(uintptr_t)d, mib * MIB, 9));
    CHECK(cuMemFree_v2(d) == 0);
    return 0;
  }
  rc = cudaMalloc(&p, mib * MIB);
  printf("need_rc=%d\n", rc);
  if (rc) return 0;
  fill(p, mib * MIB, 9); CHECK(holds(p, mib * MIB, 9));
  CHECK(cudaFree(p) == 0);
  return 0;
}

static int simple(void) {
  void* p; long rt = fakert_count("cudaMalloc");
  int rc = cudaMalloc(&p, 4 * MIB);
  printf("malloc_rc=%d to_runtime=%ld\n", rc, fakert_count("cudaMalloc") - rt);
  if (rc) return 0;
  fill(p, 4 * MIB, 1);
  /* The driver's own answer to a pointer query (CU_POINTER_ATTRIBUTE_MEMORY_TYPE). */
  unsigned type = 0;
  int type_rc = cuPointerGetAttribute(&type, 2, (uint64_t)p);
  printf("type_rc=%d type=%u\n", type_rc, type);
  printf("free_rc=%d\n", cudaFree(p));
  return 0;
}

/* The shared runtime calls the driver too (through cuGetProcAddress): expseg must serve each
 * allocation once, at the runtime level, and give the runtime the driver's own functions. */
static int layers(void) {
  printf("runtime_got_driver=%d\n", fakert_driver_fn("cuMemAlloc") == fakecu_real("cuMemAlloc_v2") &&
         fakert_driver_fn("cuMemFree") == fakecu_real("cuMemFree_v2") && fakert_driver_fn("cuMemGetInfo") == fakecu_real("cuMemGetInfo_v2"));
  printf("runtime_getproc_is_hook=%d\n", fakert_driver_fn("cuGetProcAddress") == dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"));
  long creates = fakecu_count("cuMemCreate"), allocs = fakecu_count("cuMemAlloc_v2"), frees = fakecu_count("cuMemFree_v2");
  void *s = 0, *p = 0;
  CHECK(cudaMalloc(&s, 1000) == 0);
  printf("small_driver_allocs=%ld small_creates=%ld\n", fakecu_count("cuMemAlloc_v2") - allocs, fakecu_count("cuMemCreate") - creates);
  CHECK(cudaFree(s) == 0);
  printf("small_driver_frees=%ld\n", fakecu_count("cuMemFree_v2") - frees);
  allocs = fakecu_count("cuMemAlloc_v2");
  CHECK(cudaMalloc(&p, 4 * MIB) == 0);
  printf("large_driver_allocs=%ld large_creates=%ld\n", fakecu_count("cuMemAlloc_v2") - allocs, fakecu_count("cuMemCreate") - creates);
  /* The program's own driver calls, through the runtime's entry point API: the pool. */
  int (*alloc)(uint64_t*, size_t) = 0;
  int (*dfree)(uint64_t) = 0;
  int st = 0;
  CHECK(cudaGetDriverEntryPoint("cuMemAlloc", (void**)&alloc, 0, &st) == 0);
  CHECK(cudaGetDriverEntryPoint("cuMemFree", (void**)&dfree, 0, &st) == 0);
  printf("entry_point_is_hook=%d\n", (void*)alloc == dlsym(RTLD_DEFAULT, "cuMemAlloc_v2") && (void*)dfree == dlsym(RTLD_DEFAULT, "cuMemFree_v2"));
  uint64_t d = 0;
  CHECK(alloc(&d, 6 * MIB) == 0);
  printf("entry_point_pooled=%d\n", fakecu_count("cuMemAlloc_v2") == allocs && fakecu_count("cuMemCreate") - creates == 2);
  printf("entry_point_free_rc=%d\n", dfree(d));
  CHECK(cudaFree(p) == 0);
  size_t fr = 0, tot = 0;
  CHECK(cudaMemGetInfo(&fr, &tot) == 0);
  printf("meminfo_free_mib=%zu\n", fr >> 20);
  return 0;
}

static void print_figure(const char* when, const char* key);

int cuMemGetHandleForAddressRange(void*, uint64_t, size_t, int, unsigned long long);
/* A dma-buf of a pool allocation, made through the driver's lookup as a statically linked
 * runtime (NCCL's network plugin) makes it: that allocation is not paused, the other one is. */
static int dmabuf(void) {
  int (*getproc)(const char*, void**, int, unsigned long long, int*) =
      (int (*)(const char*, void**, int, unsigned long long, int*))dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2");
  int (*pause_)(const char*, int, uint64_t*, double*) = dlsym(RTLD_DEFAULT, "expseg_pause");
  int (*resume_)(const char*, uint64_t*, double*) = dlsym(RTLD_DEFAULT, "expseg_resume");
  CHECK(getproc && pause_ && resume_);
  void* fn = 0; int st = 0;
  CHECK(getproc("cuMemGetHandleForAddressRange", &fn, 12000, 0, &st) == 0 && fn);
  int (*range)(void*, uint64_t, size_t, int, unsigned long long) =
      (int (*)(void*, uint64_t, size_t, int, unsigned long long))fn;
  void *p = 0, *q = 0, *r = 0;
  CHECK(cudaMalloc(&p, 32 * MIB) == 0 && cudaMalloc(&q, 32 * MIB) == 0 && cudaMalloc(&r, 32 * MIB) == 0);
  fill(p, 32 * MIB, 7); fill(q, 32 * MIB, 8); fill(r, 32 * MIB, 9);
  int fd = -1, fd2 = -1;
  printf("range_rc=%d\n", range(&fd, (uint64_t)p + MIB, 8 * MIB, 1, 0));
  /* and by its symbol, as a program linked against libcuda calls it */
  printf("direct_rc=%d\n", cuMemGetHandleForAddressRange(&fd2, (uint64_t)r, 32 * MIB, 1, 0));
  uint64_t n = 0;
  printf("pause_rc=%d\n", pause_(0, 0, &n, 0));
  printf("paused_mib=%lu\n", (unsigned long)(n >> 20));
  printf("p_intact=%d r_intact=%d\n", holds(p, 32 * MIB, 7), holds(r, 32 * MIB, 9));
  printf("resume_rc=%d\n", resume_(0, &n, 0));
  printf("q_back=%d\n", holds(q, 32 * MIB, 8));
  close(fd); close(fd2);
  return 0;
}

/* Pausing from inside: expseg's C functions (found with dlsym, as Python's ctypes does). */
static int pause_self(void) {
  int (*pause_)(const char*, int, uint64_t*, double*) = dlsym(RTLD_DEFAULT, "expseg_pause");
  int (*resume_)(const char*, uint64_t*, double*) = dlsym(RTLD_DEFAULT, "expseg_resume");
  uint64_t (*paused_)(void) = dlsym(RTLD_DEFAULT, "expseg_paused_bytes");
  int (*tag_)(const char*) = dlsym(RTLD_DEFAULT, "expseg_set_tag");
  CHECK(pause_ && resume_ && paused_ && tag_);
  void *kv = 0, *w = 0;
  CHECK(tag_("kv_cache") == 0);
  CHECK(cudaMalloc(&kv, 16 * MIB) == 0);
  CHECK(tag_(0) == 0);
  CHECK(cudaMalloc(&w, 8 * MIB) == 0);
  fill(kv, 16 * MIB, 3); fill(w, 8 * MIB, 4);
  uint64_t n = 0; double secs = -1;
  printf("bad_tag_rc=%d\n", tag_(""));
  printf("pause_kv_rc=%d\n", pause_("kv_cache", 1, &n, &secs));
  printf("pause_kv_mib=%lu secs_set=%d\n", (unsigned long)(n >> 20), secs >= 0);
  printf("paused_mib=%lu\n", (unsigned long)(paused_() >> 20));
  printf("w_intact=%d\n", holds(w, 8 * MIB, 4));
  printf("pause_all_rc=%d\n", pause_(0, 0, &n, 0));
  printf("pause_all_mib=%lu\n", (unsigned long)(n >> 20));
  printf("paused_all_mib=%lu\n", (unsigned long)(paused_() >> 20));
  printf("resume_rc=%d\n", resume_(0, &n, 0));
  printf("resume_mib=%lu\n", (unsigned long)(n >> 20));
  printf("w_back=%d\n", holds(w, 8 * MIB, 4));
  fill(kv, 16 * MIB, 5);
  printf("kv_usable=%d\n", holds(kv, 16 * MIB, 5));
  print_figure("after_resume", "pause_host_kept_bytes");
  /* HOST_SHORT_AFTER: the host runs short after the resume (the test switch's file). */
  const char* hp = getenv("EXPSEG_TEST_HOST_AVAILABLE");
  if (hp && getenv("HOST_SHORT_AFTER")) {
    FILE* hf = fopen(hp, "w");
    CHECK(hf && fputs("0\n", hf) >= 0 && fclose(hf) == 0);
  }
  usleep(300 * 1000); /* the watcher looks ten times a second */
  print_figure("later", "pause_host_kept_bytes");
  printf("resume_again_rc=%d\n", resume_(0, &n, 0));
  printf("resume_again_mib=%lu\n", (unsigned long)(n >> 20));
  /* Freeing paused memory: its host copy goes, nothing to resume. */
  CHECK(pause_(0, 0, &n, 0) == 0);
  printf("free_paused_rc=%d\n", cudaFree(w));
  printf("paused_after_free_mib=%lu\n", (unsigned long)(paused_() >> 20));
  CHECK(resume_(0, &n, 0) == 0);
  printf("kv_back=%d\n", holds(kv, 16 * MIB, 5));
  /* Paused memory freed: its host buffer empties outside any pause or resume. */
  CHECK(pause_(0, 0, &n, 0) == 0);
  usleep(300 * 1000); /* a watcher that rests when nothing is kept would be resting now */
  CHECK(cudaFree(kv) == 0);
  usleep(300 * 1000);
  print_figure("freed_paused", "pause_host_kept_bytes");
  return 0;
}

/* Paused from outside (expseg pause PID): takes and fills 64 MiB, then answers "check" lines
 * on stdin with whether its bytes are intact, until stdin closes. */
/* 64 MiB in two allocations of 32 (a resume with room for one resumes one), checked on
 * "check". */
/* Beside torch_memory_saver's preload hook (tests/c/fake_tms.c, preloaded after expseg): in a
 * region its cudaMalloc serves (the pool makes nothing), outside expseg's pool does. */
static int tms(void) {
  void (*set)(int) = (void (*)(int))dlsym(RTLD_DEFAULT, "tms_set_interesting_region");
  long (*served)(void) = (long (*)(void))dlsym(RTLD_DEFAULT, "fake_tms_served");
  CHECK(set && served);
  void *a = 0, *b = 0;
  long creates = fakecu_count("cuMemCreate");
  set(1);
  CHECK(cudaMalloc(&a, 64 * MIB) == 0);
  set(0);
  printf("region_tms_served=%ld region_pool_creates=%ld\n", served(), fakecu_count("cuMemCreate") - creates);
  creates = fakecu_count("cuMemCreate");
  CHECK(cudaMalloc(&b, 64 * MIB) == 0);
  printf("outside_tms_served=%ld outside_pool_creates=%ld\n", served(), fakecu_count("cuMemCreate") - creates);
  printf("free_a=%d free_b=%d\n", cudaFree(a), cudaFree(b));
  const char* conf = getenv("PYTORCH_CUDA_ALLOC_CONF");
  printf("torch_conf=%s\n", conf && *conf ? conf : "-");
  return 0;
}

static int sleeper(void) {
  void *p = 0, *q = 0;
  CHECK(cudaMalloc(&p, 32 * MIB) == 0 && cudaMalloc(&q, 32 * MIB) == 0);
  fill(p, 32 * MIB, 7); fill(q, 32 * MIB, 8);
  printf("ready=1\n"); fflush(stdout);
  char line[64];
  while (fgets(line, sizeof line, stdin)) {
    if (!strncmp(line, "check", 5)) {
      int ok = holds(p, 32 * MIB, 7) && holds(q, 32 * MIB, 8);
      printf("intact=%d\n", ok); fflush(stdout);
    }
    if (!strncmp(line, "share", 5)) { /* an IPC handle of p: its memory is shared */
      unsigned char h[64];
      printf("shared=%d\n", cudaIpcGetMemHandle(h, p)); fflush(stdout);
    }
    if (!strncmp(line, "open", 4)) { /* an IPC open (of nothing valid): it maps another's */
      IpcHandle h; void* o = 0;
      memset(&h, 0, sizeof h);
      printf("opened=%d\n", cudaIpcOpenMemHandle(&o, h, 1)); fflush(stdout);
    }
  }
  return 0;
}

/* "keep N": takes N MiB and keeps it until its stdin closes, then frees it (the fake's shared
 * counter does not see a process end). */
static int keep(size_t mib) {
  void* p = 0;
  int rc = cudaMalloc(&p, mib * MIB);
  printf("keep_rc=%d\n", rc); fflush(stdout);
  char buf[64];
  while (fread(buf, 1, sizeof buf, stdin) > 0) {}
  return rc == 0 && cudaFree(p) != 0;
}

/* cudaMalloc while a context of the program's own is current (cuCtxCreate: PyCUDA, TensorRT,
 * green contexts): the runtime allocates in that context, which owns the memory; expseg's
 * pool belongs to the primary context, so the call is the runtime's. Then the primary
 * context again: the pool. */
int cuCtxCreate_v2(void**, unsigned, int);
int cuCtxPopCurrent_v2(void**);
static int own_context(void) {
  CHECK(cuInit(0) == 0);
  void* mine = 0; unsigned char* p = 0;
  CHECK(cuCtxCreate_v2(&mine, 0, 0) == 0);
  long rt = fakert_count("cudaMalloc"), creates = fakecu_count("cuMemCreate"), allocs = fakecu_count("cuMemAlloc_v2");
  printf("own_rc=%d", cudaMalloc((void**)&p, 64 * MIB));
  printf(" own_to_runtime=%d own_pool_creates=%ld own_driver_allocs=%ld\n", fakert_count("cudaMalloc") - rt == 1,
         fakecu_count("cuMemCreate") - creates, fakecu_count("cuMemAlloc_v2") - allocs);
  printf("own_free_rc=%d\n", cudaFree(p));
  CHECK(cuCtxPopCurrent_v2(&mine) == 0);
  creates = fakecu_count("cuMemCreate");
  printf("primary_rc=%d", cudaMalloc((void**)&p, 64 * MIB));
  printf(" primary_pool_creates=%ld primary_free_rc=%d\n", fakecu_count("cuMemCreate") - creates, cudaFree(p));
  return 0;
}

/* cudaDeviceReset destroys the runtime's allocations and gives their memory back: pool memory
 * too, then a cudaFree of it is an error, and allocating goes on. */
int cudaDeviceReset(void);
long fakecu_used(void);
static int reset(void) {
  unsigned char* p = 0;
  CHECK(cudaMalloc((void**)&p, 64 * MIB) == 0);
  fill(p, 64 * MIB, 3);
  printf("used_before_mib=%ld", fakecu_used() >> 20);
  int reset_rc = cudaDeviceReset();
  printf(" reset_rc=%d resets=%ld", reset_rc, fakert_count("cudaDeviceReset"));
  printf(" used_after_mib=%ld\n", fakecu_used() >> 20);
  printf("stale_free_rc=%d\n", cudaFree(p));
  cudaGetLastError();
  CHECK(cudaMalloc((void**)&p, 64 * MIB) == 0);
  fill(p, 64 * MIB, 4);
  int again_ok = holds(p, 64 * MIB, 4);
  printf("again_ok=%d again_free_rc=%d\n", again_ok, cudaFree(p));
  return 0;
}

/* One figure of expseg.stats() (the library's expseg_stats_json): WHEN_KEY=N (-1: absent). */
static void print_figure(const char* when, const char* key) {
  size_t (*f)(char*, size_t) = (size_t (*)(char*, size_t))dlsym(RTLD_DEFAULT, "expseg_stats_json");
  static char buf[1 << 16];
  char pat[128];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char* at = f && f(buf, sizeof buf) ? strstr(buf, pat) : 0;
  printf("%s_%s=%lld\n", when, key, at ? atoll(at + strlen(pat)) : -1LL);
}

/* What expseg.stats() reads (the library's expseg_stats_json): WHEN_active=0|1 and, when not
 * active, WHEN_why=... with spaces as '_'. */
static void print_stats(const char* when) {
  size_t (*f)(char*, size_t) = (size_t (*)(char*, size_t))dlsym(RTLD_DEFAULT, "expseg_stats_json");
  static char buf[1 << 16];
  if (!f || f(buf, sizeof buf) == 0) { printf("%s_loaded=0\n", when); return; }
  printf("%s_active=%d\n", when, strstr(buf, "\"active\":true") != 0);
  const char* w = strstr(buf, "\"why\":\"");
  if (!w) return;
  printf("%s_why=", when);
  for (w += 7; *w && *w != '"'; w++) putchar(*w == ' ' ? '_' : *w);
  putchar('\n');
}

/* expseg.stats()'s view before and after one allocation. */
static int stats(void) {
  print_stats("before");
  void* p = 0;
  int rc = cudaMalloc(&p, 4 * MIB);
  printf("malloc_rc=%d\n", rc);
  print_stats("after");
  if (!rc) cudaFree(p);
  return 0;
}

int main(int argc, char** argv) {
  const char* s = argc > 1 ? argv[1] : "basic";
  if (!strcmp(s, "consume") && argc > 4) return consume(argv[2], atoi(argv[3]), atoi(argv[4]));
  if (!strcmp(s, "share") && argc > 2) return share(argv[0], argv[2]);
  if (!strcmp(s, "consume_kept") && argc > 4) return consume_kept(argv[2], atoi(argv[3]), atoi(argv[4]));
  if (!strcmp(s, "share_kept")) return share_kept(argv[0]);
  if (!strcmp(s, "share_foreign") && argc > 2) return share_foreign(argv[0], argv[2]);
  if (!strcmp(s, "foreign_swap")) return foreign_swap(argv[0]);
  if (!strcmp(s, "hold") && argc > 2) return hold((size_t)atol(argv[2]));
  if (!strcmp(s, "need") && argc > 2) return need((size_t)atol(argv[2]));
  if (!strcmp(s, "keep") && argc > 2) return keep((size_t)atol(argv[2]));
  if (!strcmp(s, "basic")) return basic();
  if (!strcmp(s, "pause_self")) return pause_self();
  if (!strcmp(s, "tms")) return tms();
  if (!strcmp(s, "dmabuf")) return dmabuf();
  if (!strcmp(s, "sleeper")) return sleeper();
  if (!strcmp(s, "retry")) return retry();
  if (!strcmp(s, "foreign_unmap_hooked")) return foreign_unmap_hooked();
  if (!strcmp(s, "threads")) return threads();
  if (!strcmp(s, "peer")) return peer();
  if (!strcmp(s, "peer_mirror")) return peer_mirror();
  if (!strcmp(s, "fork")) return forked();
  if (!strcmp(s, "simple")) return simple();
  if (!strcmp(s, "stats")) return stats();
  if (!strcmp(s, "mirror_race")) return mirror_race();
  if (!strcmp(s, "move_race")) return move_race();
  if (!strcmp(s, "wait")) return wait_for_term();
  if (!strcmp(s, "refresh_wait")) return refresh_wait();
  if (!strcmp(s, "foreign_unmap")) return foreign_unmap();
  if (!strcmp(s, "slow_check")) return slow_check();
  if (!strcmp(s, "poisoned")) return poisoned();
  if (!strcmp(s, "slow_check_beside_a_move")) return slow_check_beside_a_move();
  if (!strcmp(s, "move_beside_check_malloc")) return move_beside_check_malloc();
  if (!strcmp(s, "ipc")) return ipc();
  if (!strcmp(s, "ipc_many")) return ipc_many();
  if (!strcmp(s, "mirror_sync")) return mirror_sync();
  if (!strcmp(s, "lookup")) return lookup();
  if (!strcmp(s, "layers")) return layers();
  if (!strcmp(s, "foreign")) return foreign();
  if (!strcmp(s, "own_context")) return own_context();
  if (!strcmp(s, "reset")) return reset();
  fprintf(stderr, "unknown scenario %s\n", s);
  return 2;
}
