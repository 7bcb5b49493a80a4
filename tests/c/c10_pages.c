/* PyTorch's expandable segments, as far as the driver sees them, for expseg's preload tests.
 * Built as libc10_cuda.so (the name expseg recognises PyTorch's allocator by) and as
 * libother.so. Driver functions come from the runtime's entry point API, as in c10/cuda/
 * driver_api.cpp; pages are 20 MiB; map() creates, maps and sets access per batch; unmap()
 * unmaps and releases page by page. "Device" memory is host memory (the fake driver). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int CUresult;
typedef struct { int type; int requestedHandleTypes; struct { int type; int id; } location; void* win32; unsigned char flags[8]; } Prop;
typedef struct { struct { int type; int id; } location; int flags; } Access;
int cudaGetDriverEntryPointByVersion(const char*, void**, unsigned, unsigned long long, int*);
int cudaMemGetInfo(size_t*, size_t*);
int cudaIpcGetMemHandle(void*, void*);
long fakecu_count(const char*);
long fakecu_used(void);

static CUresult (*create)(uint64_t*, size_t, const Prop*, unsigned long long);
static CUresult (*release)(uint64_t);
static CUresult (*reserve)(uint64_t*, size_t, size_t, uint64_t, unsigned long long);
static CUresult (*addrfree)(uint64_t, size_t);
static CUresult (*map)(uint64_t, size_t, size_t, uint64_t, unsigned long long);
static CUresult (*unmap)(uint64_t, size_t);
static CUresult (*access_)(uint64_t, size_t, const Access*, size_t);
static CUresult (*export_)(void*, uint64_t, int, unsigned long long);
static CUresult (*import_)(uint64_t*, void*, int);
static CUresult (*retain)(uint64_t*, void*);
static CUresult (*props)(Prop*, uint64_t);

#define PAGE (20ull << 20)
#define NP 64
static uint64_t va, h[NP];

static void* get_at(const char* name, unsigned version) {
  void* f = 0; int st = 0;
  if (cudaGetDriverEntryPointByVersion(name, &f, version, 0, &st) || !f) { fprintf(stderr, "no %s\n", name); exit(2); }
  return f;
}
static void* get(const char* name) { return get_at(name, 12000); }
static int dev_ = 0;
/* A monitor's cudaMemGetInfo, from a thread that is not the allocator's. */
static void* meminfo_thread(void* arg) { size_t f, t; (void)arg; cudaMemGetInfo(&f, &t); return 0; }
/* The program's own expseg_pause(), from a thread that made no allocator call. */
static void* pause_thread(void* arg) {
  struct { int (*f)(const char*, int, uint64_t*, double*); int rc; }* a = arg;
  a->rc = a->f(NULL, 0, 0, 0);
  return 0;
}
/* The program's own expseg_trim(), from a thread that made no allocator call. */
static void* trim_thread(void* arg) {
  uint64_t (*trim)(void) = (uint64_t (*)(void))dlsym(RTLD_DEFAULT, "expseg_trim");
  *(uint64_t*)arg = trim ? trim() : (uint64_t)-1;
  return 0;
}
/* One figure of the library's expseg_stats_json: KEY=N (-1: absent). */
static void print_stat(const char* key) {
  size_t (*f)(char*, size_t) = (size_t (*)(char*, size_t))dlsym(RTLD_DEFAULT, "expseg_stats_json");
  static char buf[1 << 16];
  char pat[128];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char* at = f && f(buf, sizeof buf) ? strstr(buf, pat) : 0;
  printf("%s=%lld\n", key, at ? atoll(at + strlen(pat)) : -1LL);
}

/* An export from a thread with no context current (torch.multiprocessing's queue feeder). */
static int export_fd = -1; static CUresult export_rc = 0;
static void* export_thread(void* arg) { export_rc = export_(&export_fd, *(uint64_t*)arg, 1, 0); return 0; }

static Prop prop(void) { Prop p; memset(&p, 0, sizeof p); p.type = 1; p.requestedHandleTypes = 1; p.location.type = 1; p.location.id = dev_; return p; }
static int grow(int at, int n) {
  Prop p = prop();
  for (int i = 0; i < n; i++) {
    CUresult r = create(&h[at + i], PAGE, &p, 0);
    if (r) { for (int j = 0; j < i; j++) release(h[at + j]); return r; }
  }
  for (int i = 0; i < n; i++) if (map(va + (at + i) * PAGE, PAGE, 0, h[at + i], 0)) return -1;
  Access a = {{1, dev_}, 3};
  return access_(va + at * PAGE, n * PAGE, &a, 1) ? -2 : 0;
}
static int shrink(int at, int n) {
  for (int i = at; i < at + n; i++) { if (unmap(va + i * PAGE, PAGE) || release(h[i])) return -1; h[i] = 0; }
  return 0;
}
static void fill(int i) { memset((char*)(va + i * PAGE), 'A' + i, PAGE); }
static int holds(const char* p, int i) { for (size_t k = 0; k < PAGE; k += 4096) if (p[k] != 'A' + i) return 0; return p[PAGE - 1] == 'A' + i; }

/* `two_threads`: device 1's allocator runs in a thread of its own (a model split's autograd
 * worker): it grows and strands its pages, then waits while device 0's thread does the same
 * and asks cudaMemGetInfo, then asks it itself. */
static pthread_barrier_t two_threads_bar;
static void* dev1_thread(void* arg) {
  (void)arg;
  dev_ = 1;
  int rc = grow(16, 8);
  for (int i = 16; i < 24; i++) fill(i);
  rc |= shrink(18, 4);
  printf("dev1_rc=%d\n", rc);
  fflush(stdout);
  pthread_barrier_wait(&two_threads_bar); /* device 0's turn */
  pthread_barrier_wait(&two_threads_bar); /* device 0's thread asked */
  size_t f, t; cudaMemGetInfo(&f, &t);
  printf("used_after_dev1_thread_mib=%ld\n", fakecu_used() >> 20);
  return 0;
}
static int two_threads(void) {
  pthread_t t;
  pthread_barrier_init(&two_threads_bar, 0, 2);
  pthread_create(&t, 0, dev1_thread, 0);
  pthread_barrier_wait(&two_threads_bar);
  dev_ = 0;
  int rc = grow(0, 8);
  for (int i = 0; i < 8; i++) fill(i);
  rc |= shrink(2, 4);
  printf("dev0_rc=%d\n", rc);
  printf("used_stranded_mib=%ld\n", fakecu_used() >> 20);
  size_t f, tot; cudaMemGetInfo(&f, &tot);
  printf("used_after_dev0_thread_mib=%ld\n", fakecu_used() >> 20);
  {
    /* Device 0's thread frees an address range (empty_cache() destroying a segment): device
     * 1's compaction is still left to device 1's thread. */
    uint64_t x = 0;
    int rr = reserve(&x, PAGE, 0, 0, 0), fr = addrfree(x, PAGE);
    printf("addrfree_rc=%d used_after_dev0_addrfree_mib=%ld\n", rr | fr, fakecu_used() >> 20);
  }
  fflush(stdout);
  pthread_barrier_wait(&two_threads_bar);
  pthread_join(t, 0);
  int ok = 1;
  static const int live[] = {0, 1, 6, 7, 16, 17, 22, 23};
  for (int k = 0; k < 8; k++) ok &= holds((char*)(va + live[k] * PAGE), live[k]);
  printf("live_intact=%d\n", ok);
  printf("final_shrink_rc=%d\n", shrink(0, 2) | shrink(6, 2) | shrink(16, 2) | shrink(22, 2));
  cudaMemGetInfo(&f, &tot);
  printf("used_end=%ld\n", fakecu_used());
  return 0;
}

/* Two devices' segments in one process, each grown and shrunk at random runs of pages
 * starting within the first `span`, data checked after every step and after cudaMemGetInfo
 * (which settles). With `recycle`, a segment left with no page is replaced: the device
 * reserves a new range at the one the other device freed last (when it is free), then frees
 * its own, so ranges travel between devices as the driver may hand them out. */
static int two_devices(int nsteps, int span, int recycle) {
  uint64_t seg[2], gone[2] = {0, 0}; seg[0] = va;
  if (reserve(&seg[1], NP * PAGE, 0, 0, 0)) return 2;
  static uint64_t hh[2][NP]; static unsigned char tagv[2][NP];
  unsigned r = recycle ? 11 : 7; int bad = 0, steps = 0, recycled = 0, moved = 0;
  for (int step = 0; step < nsteps; step++) {
    r = r * 1103515245u + 12345u; int d = (r >> 16) & 1;
    r = r * 1103515245u + 12345u; int at = (r >> 16) % span;
    r = r * 1103515245u + 12345u; int n = 1 + (r >> 16) % 5;
    va = seg[d]; dev_ = d;
    int free_run = 1; for (int i = at; i < at + n; i++) if (hh[d][i]) free_run = 0;
    if (free_run) {
      for (int i = at; i < at + n; i++) h[i] = 0;
      if (grow(at, n) == 0) for (int i = at; i < at + n; i++) { hh[d][i] = h[i]; tagv[d][i] = (unsigned char)(1 + (r >> 8) % 250); memset((char*)(va + i * PAGE), tagv[d][i], PAGE); }
    } else {
      for (int i = at; i < at + n; i++) if (hh[d][i]) { if (unmap(va + i * PAGE, PAGE) || release(hh[d][i])) bad++; hh[d][i] = 0; }
      int empty = 1; for (int i = 0; i < NP; i++) if (hh[d][i]) empty = 0;
      if (recycle && empty && (r >> 4) % 3 == 0) {
        uint64_t nv = 0, hint = gone[1 - d] != seg[1 - d] ? gone[1 - d] : 0;
        if (reserve(&nv, NP * PAGE, 0, hint, 0)) return 3;
        moved += hint && nv == hint;
        if (addrfree(seg[d], NP * PAGE)) bad++;
        gone[d] = seg[d]; seg[d] = nv; recycled++;
      }
    }
    if (step % (recycle ? 5 : 7) == 0) { size_t fr, tot; cudaMemGetInfo(&fr, &tot); }
    for (int e = 0; e < 2; e++) for (int i = 0; i < NP; i++) if (hh[e][i]) {
      const unsigned char* q = (const unsigned char*)(seg[e] + i * PAGE);
      for (size_t k = 0; k < PAGE; k += 1 << 20) if (q[k] != tagv[e][i]) { bad++; break; }
    }
    steps++;
  }
  for (int e = 0; e < 2; e++) { va = seg[e]; dev_ = e; for (int i = 0; i < NP; i++) if (hh[e][i]) { unmap(va + i * PAGE, PAGE); release(hh[e][i]); } }
  size_t fr, tot; cudaMemGetInfo(&fr, &tot);
  printf("two_steps=%d two_bad=%d recycled=%d moved=%d used_end=%ld wrong_context=%ld\n", steps, bad, recycled, moved, fakecu_used(), fakecu_count("wrong_context"));
  return 0;
}

/* torch.cuda.empty_cache() on two devices from a thread whose current device is 0, with the
 * freed blocks' last kernels still running on each device (a tensor filled, then deleted, as
 * torch_coalesce_stress.py does): PyTorch's unmapHandles waits on the segment's stream, for the
 * default stream cudaStreamSynchronize(nullptr), i.e. the legacy stream of the *current* device,
 * then unmaps and releases page by page, device after device. Each device has one
 * batch of 4 pages; INFLIGHT_WHOLE=1 frees all 4, else pages 2-3 (pages 0-1 stay live). */
void fakecu_launch(int, uint64_t, size_t);
int cudaDeviceSynchronize(void);
int cudaStreamSynchronize(void*);
int cudaSetDevice(int);
static int two_inflight(void) {
  int whole = getenv("INFLIGHT_WHOLE") && atoi(getenv("INFLIGHT_WHOLE"));
  /* INFLIGHT_GUARDED=1: each device's pages are freed with that device current (a caller whose
   * wait covered them). */
  int guarded = getenv("INFLIGHT_GUARDED") && atoi(getenv("INFLIGHT_GUARDED"));
  cudaSetDevice(0);
  uint64_t seg[2], hh[2][4]; seg[0] = va;
  if (reserve(&seg[1], NP * PAGE, 0, 0, 0)) return 2;
  for (int d = 0; d < 2; d++) {
    va = seg[d]; dev_ = d;
    if (grow(0, 4)) return 3;
    for (int i = 0; i < 4; i++) { hh[d][i] = h[i]; memset((char*)(va + i * PAGE), 'a' + 4 * d + i, PAGE); }
  }
  int from = whole ? 0 : 2, bad = 0;
  for (int d = 0; d < 2; d++) fakecu_launch(d, seg[d] + from * PAGE, (4 - from) * PAGE);
  long w0 = fakecu_count("legacy_sync"), s0 = fakecu_count("cuDevicePrimaryCtxGetState");
  for (int d = 0; d < 2; d++) {
    if (guarded) cudaSetDevice(d);
    cudaStreamSynchronize(0); /* PyTorch's wait: the legacy stream of the current device (0) */
    for (int i = from; i < 4; i++) if (unmap(seg[d] + i * PAGE, PAGE) || release(hh[d][i])) bad++;
  }
  size_t fr, tot;
  long waits = fakecu_count("legacy_sync") - w0;
  /* Driver calls made to learn which context the caller runs in, beyond cuCtxGetCurrent. */
  long state_calls = fakecu_count("cuDevicePrimaryCtxGetState") - s0;
  for (int d = 0; d < 2; d++) { cudaSetDevice(d); cudaMemGetInfo(&fr, &tot); } /* torch.cuda.mem_get_info(d) */
  cudaSetDevice(0);
  usleep(20 * 1000); /* quiet: a releaser thread (kept handles) has its turn */
  long faults = fakecu_count("illegal_address");
  int intact = 1;
  for (int d = 0; d < 2; d++) for (int i = 0; i < from; i++) {
    const unsigned char* q = (const unsigned char*)(seg[d] + i * PAGE);
    for (size_t k = 0; k < PAGE; k += 1 << 20) if (q[k] != 'a' + 4 * d + i) { intact = 0; break; }
  }
  for (int d = 1; d >= 0; d--) { cudaSetDevice(d); cudaDeviceSynchronize(); }
  for (int d = 0; d < 2; d++) for (int i = 0; i < from; i++) if (unmap(seg[d] + i * PAGE, PAGE) || release(hh[d][i])) bad++;
  cudaMemGetInfo(&fr, &tot);
  printf("inflight_bad=%d illegal_address=%ld live_intact=%d used_end=%ld wrong_context=%ld waits=%ld state_calls=%ld\n", bad, faults, intact, fakecu_used(), fakecu_count("wrong_context"), waits, state_calls);
  return 0;
}

/* Another thread launches kernels on live pages (pages 0-1 of a batch of 8, every launch adds 1
 * to a word of every 4 KiB, on the legacy default stream) while this one, the allocator's,
 * releases the rest of the batch and asks cudaMemGetInfo, which compacts: the live pages move.
 * Every word must hold the number of launches at the end of each cycle, and the process must
 * not fault. */
typedef CUresult (*Launch)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**);
static Launch launch_;
static uint64_t race_at;
static int race_busy, race_stop;
static long race_done;
static void* launcher(void* arg) {
  (void)arg;
  while (!__atomic_load_n(&race_stop, __ATOMIC_SEQ_CST)) {
    __atomic_store_n(&race_busy, 1, __ATOMIC_SEQ_CST);
    uint64_t at = __atomic_load_n(&race_at, __ATOMIC_SEQ_CST);
    if (at) {
      void* params[1] = {&at};
      if (launch_(0, 2 * PAGE / 4096, 1, 1, 1, 1, 1, 0, 0, params, 0) == 0) __atomic_add_fetch(&race_done, 1, __ATOMIC_SEQ_CST);
    }
    __atomic_store_n(&race_busy, 0, __ATOMIC_SEQ_CST);
    if (!at) usleep(50);
  }
  return 0;
}
static int launch_race(int cycles) {
  launch_ = (Launch)get("cuLaunchKernel");
  pthread_t t; pthread_create(&t, 0, launcher, 0);
  int bad = 0, moved = 0; long launches = 0;
  for (int c = 0; c < cycles; c++) {
    if (grow(0, 8)) return 3;
    memset((void*)va, 0, 2 * PAGE);
    __atomic_store_n(&race_done, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&race_at, va, __ATOMIC_SEQ_CST);
    usleep(2000);
    if (shrink(2, 6)) return 4;
    size_t fr, tot; cudaMemGetInfo(&fr, &tot); /* the allocator's thread: compacts */
    moved += fakecu_used() == (long)(2 * PAGE);
    usleep(2000);
    __atomic_store_n(&race_at, 0, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&race_busy, __ATOMIC_SEQ_CST)) usleep(10);
    long n = __atomic_load_n(&race_done, __ATOMIC_SEQ_CST);
    launches += n;
    for (uint64_t o = 0; o < 2 * PAGE; o += 4096) if (*(volatile uint32_t*)(uintptr_t)(va + o) != (uint32_t)n) { bad++; break; }
    if (shrink(0, 2)) return 5;
  }
  __atomic_store_n(&race_stop, 1, __ATOMIC_SEQ_CST);
  pthread_join(t, 0);
  printf("race_cycles=%d race_bad=%d race_moved=%d race_launches=%ld fence_deadlock=%ld graphs=%ld\n", cycles, bad, moved, launches,
         fakecu_count("fence_deadlock"), fakecu_count("cuGraphLaunch"));
  return 0;
}

int expandable(const char* what);
/* In a forked child: this program again, with this library, running `what` (a consumer that
 * runs expseg afresh). Never returns. */
static void exec_self(const char* what) {
  char self[4096]; ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) _exit(4);
  self[n] = 0;
  Dl_info di; char lib[4096] = "libc10_cuda.so";
  if (dladdr((void*)&expandable, &di) && di.dli_fname) snprintf(lib, sizeof lib, "%s", di.dli_fname);
  execl(self, self, lib, what, (char*)0);
  _exit(5);
}

int expandable(const char* what) {
  create = get("cuMemCreate"); release = get("cuMemRelease"); reserve = get("cuMemAddressReserve");
  addrfree = get("cuMemAddressFree"); map = get("cuMemMap"); unmap = get("cuMemUnmap");
  access_ = get("cuMemSetAccess"); export_ = get("cuMemExportToShareableHandle");
  import_ = get("cuMemImportFromShareableHandle"); retain = get("cuMemRetainAllocationHandle");
  props = get("cuMemGetAllocationPropertiesFromHandle");
  if (reserve(&va, NP * PAGE, 0, 0, 0)) return 2;
  if (!strcmp(what, "nccl_register")) {
    /* NCCL's user-buffer registration of a tensor in PyTorch's pages, with NCCL's own driver
     * functions (cuGetProcAddress, not PyTorch's table): the range query's base, the handle
     * retained there, exported; the peer maps the range's size from the handle's offset 0 and
     * must see that page's bytes. */
    CUresult (*getproc)(const char*, void**, int, unsigned long long, int*) = dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2");
    void *range_p = 0, *retain_p = 0, *export_p = 0, *import_p = 0, *map_p = 0, *access_p = 0, *release_p = 0, *unmap_p = 0;
    if (!getproc || getproc("cuMemGetAddressRange", &range_p, 12000, 0, 0) || getproc("cuMemRetainAllocationHandle", &retain_p, 12000, 0, 0) ||
        getproc("cuMemExportToShareableHandle", &export_p, 12000, 0, 0) || getproc("cuMemImportFromShareableHandle", &import_p, 12000, 0, 0) ||
        getproc("cuMemMap", &map_p, 12000, 0, 0) || getproc("cuMemSetAccess", &access_p, 12000, 0, 0) ||
        getproc("cuMemRelease", &release_p, 12000, 0, 0) || getproc("cuMemUnmap", &unmap_p, 12000, 0, 0)) return 4;
    CUresult (*range_)(uint64_t*, size_t*, uint64_t) = range_p;
    CUresult (*dretain)(uint64_t*, void*) = retain_p;
    CUresult (*dexport)(void*, uint64_t, int, unsigned long long) = export_p;
    CUresult (*dimport)(uint64_t*, void*, int) = import_p;
    CUresult (*dmap)(uint64_t, size_t, size_t, uint64_t, unsigned long long) = map_p;
    CUresult (*daccess)(uint64_t, size_t, const Access*, size_t) = access_p;
    CUresult (*drelease)(uint64_t) = release_p;
    CUresult (*dunmap)(uint64_t, size_t) = unmap_p;
    if (grow(0, 6)) return 3;
    for (int i = 0; i < 6; i++) fill(i);
    uint64_t base = 0, rh = 0, ih = 0, peer = 0; size_t size = 0; int fd = -1;
    int rr = range_(&base, &size, va + 3 * PAGE + 5);
    int rt = dretain(&rh, (void*)base);
    int ex = dexport(&fd, rh, 1, 0);
    drelease(rh);
    int ok = 0;
    if (!ex && !dimport(&ih, (void*)(intptr_t)fd, 1) && !reserve(&peer, size, 0, 0, 0) && !dmap(peer, size, 0, ih, 0)) {
      Access a = {{1, 0}, 3}; daccess(peer, size, &a, 1);
      ok = holds((char*)peer, 3);
      dunmap(peer, size); drelease(ih);
    }
    printf("range_rc=%d range_is_page=%d retain_rc=%d export_rc=%d peer_sees_page=%d", rr, base == va + 3 * PAGE && size == PAGE, rt, ex, ok);
    /* Later moves leave the registered page where it is. */
    printf(" shrink_rc=%d", shrink(0, 3));
    size_t f, t; cudaMemGetInfo(&f, &t);
    printf(" intact=%d\n", holds((char*)(va + 3 * PAGE), 3) && holds((char*)(va + 5 * PAGE), 5));
    return 0;
  }
  if (!strcmp(what, "multicast")) {
    /* PyTorch's symmetric memory binds its pages to a multicast object by handle (and may
     * by address): the driver must get a real handle (the coalesced one, at the page's
     * offset in it), nothing may move for it, and the bound pages must stay. */
    CUresult (*bind_mem)(uint64_t, size_t, uint64_t, size_t, size_t, unsigned long long) = get_at("cuMulticastBindMem", 12030);
    CUresult (*bind_addr)(uint64_t, size_t, uint64_t, size_t, unsigned long long) = get_at("cuMulticastBindAddr", 12030);
    if (grow(0, 4)) return 3;
    for (int i = 0; i < 4; i++) fill(i);
    long creates = fakecu_count("cuMemCreate");
    printf("bind_addr_rc=%d", bind_addr(1, 0, va + 2 * PAGE, PAGE, 0));
    printf(" bind_addr_split=%d", fakecu_count("cuMemCreate") > creates);
    printf(" bind_mem_rc=%d\n", bind_mem(1, PAGE, h[1], 0, PAGE, 0));
    /* Pages released around them do not move them (they are single now), and data holds. */
    printf("shrink_rc=%d", shrink(0, 1));
    size_t f, t; cudaMemGetInfo(&f, &t);
    printf(" intact=%d\n", holds((char*)(va + PAGE), 1) && holds((char*)(va + 2 * PAGE), 2) && holds((char*)(va + 3 * PAGE), 3));
    return 0;
  }
  if (!strcmp(what, "two_inflight")) return two_inflight();
  if (!strcmp(what, "launch_race")) return launch_race(20);
  if (!strcmp(what, "consume_fd")) {
    /* torch.multiprocessing's consumer: the producer's descriptor by pidfd_getfd (PRODUCER_PID,
     * PRODUCER_FD); the page behind it must hold 'B'. Then a descriptor the producer never
     * exported (SECRET_FD) must stay out of reach. */
    int pid = atoi(getenv("PRODUCER_PID")), pfd = atoi(getenv("PRODUCER_FD")), sfd = atoi(getenv("SECRET_FD"));
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    errno = 0;
    int got = (int)syscall(SYS_pidfd_getfd, pidfd, pfd, 0);
    int err = got < 0 ? errno : 0, data = 0;
    if (got >= 0) {
      char* p = mmap(0, PAGE, PROT_READ, MAP_SHARED, got, 0);
      data = p != MAP_FAILED && holds(p, 1);
    }
    errno = 0;
    int secret = (int)syscall(SYS_pidfd_getfd, pidfd, sfd, 0);
    const char* r = getenv("ROUND") ? getenv("ROUND") : "";
    printf("%sgetfd_ok=%d %sgetfd_errno=%d %sdata_ok=%d %ssecret_fd=%d %ssecret_errno=%d\n", r, got >= 0, r, err, r, data, r,
           secret >= 0, r, secret < 0 ? errno : 0);
    return 0;
  }
  if (!strcmp(what, "share_ticket")) {
    /* A legacy IPC handle of coalesced pages (the run from page 1 on, bytes 'A'), opened by a
     * consumer running expseg through its ticket (prog's consumer, which checks 32 MiB and
     * writes 'B'): the producer exports the run's pages (split from their handle first)
     * while its coalescers run. */
    if (grow(0, 4)) return 3;
    memset((char*)va, 'A', 4 * PAGE);
    unsigned char hd[64]; char hex[129];
    printf("ipc_rc=%d", cudaIpcGetMemHandle(hd, (void*)(va + PAGE)));
    printf(" ticket=%d\n", !memcmp(hd, "XSG1", 4));
    for (int i = 0; i < 64; i++) sprintf(hex + 2 * i, "%02x", hd[i]);
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) {
      char self[4096]; ssize_t n = readlink("/proc/self/exe", self, sizeof self - 12);
      if (n <= 0) _exit(4);
      self[n] = 0;
      strcpy(strrchr(self, '/') + 1, "prog");
      execl(self, self, "consume", hex, "65", "66", (char*)0);
      _exit(5);
    }
    int st = 0; waitpid(c, &st, 0);
    /* The producer's allocator still answers (no lock left held by the ticket's thread). */
    int written = ((char*)va)[PAGE] == 'B' && ((char*)va)[PAGE + (32u << 20) - 1] == 'B';
    printf("consumer_exit=%d written=%d", WIFEXITED(st) ? WEXITSTATUS(st) : 128, written);
    printf(" shrink_rc=%d\n", shrink(0, 4));
    return 0;
  }
  if (!strcmp(what, "consume_views")) {
    /* torch.multiprocessing's consumer of expandable segments (ExpandableSegment::fromShared
     * and its close), as a weight refit does it: three tensors (pages 0-1, 2, 3) opened, read,
     * then closed, three rounds, the third in the other order (wrong guesses); the producer
     * rewrites page 0 between rounds. Then the
     * producer gives page 3's number to another export and releases page 2: those views go. */
    int pid = atoi(getenv("PRODUCER_PID")), from = atoi(getenv("DOWN")), to = atoi(getenv("UP"));
    int fds[4]; sscanf(getenv("PRODUCER_FDS"), "%d,%d,%d,%d", &fds[0], &fds[1], &fds[2], &fds[3]);
    int tensors[3][2] = {{0, 1}, {2, -1}, {3, -1}};
    uint64_t at[3], hs[3][2];
    char c;
    for (int round = 1; round <= 3; round++) {
      long m0 = fakecu_count("cuMemMap"), a0 = fakecu_count("cuMemSetAccess"), r0 = fakecu_count("cuMemAddressReserve"),
           u0 = fakecu_count("cuMemUnmap");
      int right = 1;
      for (int k = 0; k < 3; k++) {
        int t = round == 3 ? 2 - k : k; /* round 3 opens them in the other order */
        int n = tensors[t][1] < 0 ? 1 : 2;
        uint64_t seg = 0;
        if (reserve(&seg, NP * PAGE, 0, 0, 0)) return 6;
        at[t] = seg;
        int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
        for (int i = 0; i < n; i++) {
          int mine = (int)syscall(SYS_pidfd_getfd, pidfd, fds[tensors[t][i]], 0);
          if (mine < 0 || import_(&hs[t][i], (void*)(intptr_t)mine, 1)) return 7;
          close(mine);
          if (map(seg + i * PAGE, PAGE, 0, hs[t][i], 0)) return 8;
        }
        close(pidfd);
        Access a = {{1, 0}, 3};
        if (access_(seg, n * PAGE, &a, 1)) return 9;
        for (int i = 0; i < n; i++) {
          int page = tensors[t][i];
          int want = page == 0 ? round - 1 + 10 : page; /* page 0 is rewritten each round */
          right &= holds((char*)(seg + i * PAGE), want);
        }
      }
      for (int t = 0; t < 3; t++) {
        int n = tensors[t][1] < 0 ? 1 : 2;
        for (int i = 0; i < n; i++) {
          int ur = unmap(at[t] + i * PAGE, PAGE), rr = release(hs[t][i]);
          if (ur || rr) { printf("close_unmap_rc=%d close_release_rc=%d\n", ur, rr); return 10; }
        }
        if (addrfree(at[t], NP * PAGE)) return 11;
      }
      printf("round%d_right=%d round%d_maps=%ld round%d_access=%ld round%d_reserves=%ld round%d_unmaps=%ld\n", round, right, round,
             fakecu_count("cuMemMap") - m0, round, fakecu_count("cuMemSetAccess") - a0, round, fakecu_count("cuMemAddressReserve") - r0,
             round, fakecu_count("cuMemUnmap") - u0);
      fflush(stdout);
      if (write(to, "r", 1) != 1 || read(from, &c, 1) != 1) return 12;
    }
    /* Meanwhile the producer gave page 3's number to another export and released page 2. */
    extern long fakecu_access(uint64_t);
    printf("released_view_gone=%d renumbered_view_gone=%d other_view_kept=%d\n", fakecu_access(at[1]) == -1,
           fakecu_access(at[2]) == -1, fakecu_access(at[0]) != -1);
    print_stat("ipc_views_reused");
    print_stat("ipc_imports_deferred");
    fflush(stdout);
    if (getenv("VIEWS_EXIT")) {
      /* The producer exits now: the view still kept goes (looked at every 100 ms). */
      if (write(to, "x", 1) != 1) return 13;
      while (read(from, &c, 1) > 0) {}
      int gone = 0;
      for (int i = 0; i < 40 && !gone; i++) { usleep(50 * 1000); gone = fakecu_access(at[0]) == -1; }
      printf("exit_view_gone=%d\n", gone);
    }
    return 0;
  }
  if (!strcmp(what, "share_views")) {
    /* Producer of consume_views: four pages exported, their numbers sent. */
    if (grow(0, 4)) return 3;
    for (int i = 0; i < 4; i++) fill(i);
    memset((char*)va, 'A' + 10, PAGE);
    int fds[4];
    for (int i = 0; i < 4; i++) if (export_(&fds[i], h[i], 1, 0)) { printf("export_rc=1\n"); return 3; }
    int down[2], up[2];
    if (pipe(down) || pipe(up)) return 3;
    char b[4][64];
    snprintf(b[0], 64, "%d", getpid()); snprintf(b[1], 64, "%d,%d,%d,%d", fds[0], fds[1], fds[2], fds[3]);
    snprintf(b[2], 64, "%d", down[0]); snprintf(b[3], 64, "%d", up[1]);
    setenv("PRODUCER_PID", b[0], 1); setenv("PRODUCER_FDS", b[1], 1); setenv("DOWN", b[2], 1); setenv("UP", b[3], 1);
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) {
      close(down[1]); close(up[0]);
      exec_self("consume_views");
    }
    close(down[0]); close(up[1]);
    char x;
    for (int round = 1; round <= 3; round++) {
      if (read(up[0], &x, 1) != 1) break;
      if (round < 3) memset((char*)va, 'A' + 10 + round, PAGE); /* page 0 rewritten */
      else {
        /* Page 3's number closed and given to a new export (of page 1: any page will do);
         * then page 2 released (its number closed with it, as PyTorch does). */
        close(fds[3]);
        int again = -1, er = 0;
        if (getenv("VIEWS_STOP")) {
          /* The consumer is stopped: it cannot be told in time, so the number its view holds
           * is not given to the new export (which gets another). */
          kill(c, SIGSTOP);
          er = export_(&again, h[1], 1, 0);
          printf("stopped_number_avoided=%d\n", again != fds[3] && again >= 0);
          kill(c, SIGCONT);
        }
        for (int k = 0; k < 32 && again != fds[3] && !er && !getenv("VIEWS_STOP"); k++) er = export_(&again, h[1], 1, 0);
        close(fds[2]);
        int rr = unmap(va + 2 * PAGE, PAGE) || release(h[2]);
        printf("reexport_rc=%d same_number=%d release_rc=%d\n", er, again == fds[3], rr);
        fflush(stdout);
      }
      if (write(down[1], "g", 1) != 1) break;
    }
    if (getenv("VIEWS_EXIT")) { if (read(up[0], &x, 1) == 1) _exit(0); } /* gone without a free */
    int st = 0; waitpid(c, &st, 0);
    printf("consumer_exit=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : 128);
    return 0;
  }
  if (!strcmp(what, "share_fd") || !strcmp(what, "share_fd_nodump")) {
    /* torch.multiprocessing's producer: a page exported as a POSIX descriptor, its number and
     * the process id sent to a consumer (a child that execs, so it runs expseg afresh), which
     * takes the descriptor with pidfd_getfd. share_fd_nodump makes the producer non-dumpable
     * first: the kernel then refuses everyone without CAP_SYS_PTRACE. */
    if (grow(0, 2)) return 3;
    fill(0); fill(1);
    int fd = -1; CUresult er = export_(&fd, h[1], 1, 0);
    int secret = open("/proc/self/status", O_RDONLY);
    if (er || fd < 0 || secret < 0) { printf("export_rc=%d\n", er); return 3; }
    if (!strcmp(what, "share_fd_nodump")) prctl(PR_SET_DUMPABLE, 0);
    char b[3][32];
    snprintf(b[0], 32, "%d", getpid()); snprintf(b[1], 32, "%d", fd); snprintf(b[2], 32, "%d", secret);
    setenv("PRODUCER_PID", b[0], 1); setenv("PRODUCER_FD", b[1], 1); setenv("SECRET_FD", b[2], 1);
    /* Round 1: the page is live. Round 2: PyTorch released the page (the descriptor number
     * still names the same file here): nothing is served any more. */
    for (int round = 1; round <= 2; round++) {
      if (round == 2) { if (unmap(va + PAGE, PAGE) || release(h[1])) return 3; setenv("ROUND", "r2_", 1); }
      fflush(stdout);
      pid_t c = fork();
      if (c == 0) {
        exec_self("consume_fd");
      }
      int st = 0; waitpid(c, &st, 0);
      printf("%sconsumer_exit=%d\n", round == 2 ? "r2_" : "", WIFEXITED(st) ? WEXITSTATUS(st) : 128);
    }
    return 0;
  }
  if (!strcmp(what, "poisoned")) {
    /* EXPSEG_TEST_PANIC=coalescer:9: the ninth page panics inside the coalescers' lock, right
     * after it was booked. Then new pages are the driver's own (one driver create each), the
     * coalesced pages keep their data, and giving them up is answered without a release. */
    printf("grow_rc=%d", grow(0, 8));
    for (int i = 0; i < 8; i++) fill(i);
    Prop p = prop(); uint64_t x = 0;
    long c0 = fakecu_count("cuMemCreate");
    printf(" panic_rc=%d", create(&x, PAGE, &p, 0));
    printf(" after_grow_rc=%d", grow(8, 4));
    printf(" after_creates=%ld\n", fakecu_count("cuMemCreate") - c0);
    for (int i = 8; i < 12; i++) fill(i);
    int ok = 1; for (int i = 0; i < 12; i++) ok &= holds((char*)(va + i * PAGE), i);
    printf("intact=%d", ok);
    long r0 = fakecu_count("cuMemRelease");
    int rc = shrink(0, 8);
    printf(" old_shrink_rc=%d old_released=%ld", rc, fakecu_count("cuMemRelease") - r0);
    printf(" old_still_there=%d", holds((char*)va, 0));
    r0 = fakecu_count("cuMemRelease");
    rc = shrink(8, 4);
    printf(" new_shrink_rc=%d new_released=%ld\n", rc, fakecu_count("cuMemRelease") - r0);
    return 0;
  }
  if (!strcmp(what, "keep")) {
    /* EXPSEG_KEEP=auto beside a fake NVML (FAKE_NVML_PIDS: the pids listed on the GPU): pages
     * released while only expseg processes are listed stay kept; once another is listed, what
     * is kept goes back, and later releases go back at once. */
    usleep(50 * 1000);
    if (grow(0, 8)) return 3;
    usleep(50 * 1000); /* the watcher looks every 5 ms */
    if (shrink(0, 8)) return 4;
    printf("kept_mib=%ld\n", fakecu_used() >> 20);
    FILE* f = fopen(getenv("FAKE_NVML_PIDS"), "w");
    if (!f || fprintf(f, "self 1\n") < 0 || fclose(f)) return 5;
    usleep(100 * 1000);
    printf("after_stranger_mib=%ld\n", fakecu_used() >> 20);
    if (grow(0, 4) || shrink(0, 4)) return 6;
    printf("released_at_once_mib=%ld\n", fakecu_used() >> 20);
    return 0;
  }
  if (!strcmp(what, "oom")) {
    /* Pages until the driver has none: as many as fit natively, then out of memory (2). */
    Prop p = prop(); int n = 0; CUresult r = 0;
    while (n < NP && !(r = create(&h[n], PAGE, &p, 0))) n++;
    printf("pages_before_oom=%d oom_rc=%d\n", n, r);
    for (int i = 0; i < n; i++) release(h[i]);
    usleep(50 * 1000); /* quiet: kept handles go back to the driver */
    printf("used_end=%ld\n", fakecu_used());
    return 0;
  }
  if (!strcmp(what, "two")) {
    /* Pages of a second device in the same process are coalesced too (one handle per batch). */
    long c0 = fakecu_count("cuMemCreate");
    printf("dev0_rc=%d", grow(0, 8));
    printf(" dev0_creates=%ld", fakecu_count("cuMemCreate") - c0);
    dev_ = 1; c0 = fakecu_count("cuMemCreate");
    printf(" dev1_rc=%d", grow(16, 8));
    printf(" dev1_creates=%ld", fakecu_count("cuMemCreate") - c0);
    for (int i = 0; i < 8; i++) { fill(i); fill(16 + i); }
    int ok = 1; for (int i = 0; i < 8; i++) ok &= holds((char*)(va + i * PAGE), i) && holds((char*)(va + (16 + i) * PAGE), 16 + i);
    printf(" intact=%d", ok);
    printf(" shrink_rc=%d", shrink(16, 8) | shrink(0, 8));
    size_t fr, tot; cudaMemGetInfo(&fr, &tot);
    printf(" used_end=%ld\n", fakecu_used());
    return 0;
  }
  if (!strcmp(what, "two_isolate")) {
    /* A handle asked for device 0's pages (their run made page-sized first) leaves device 1's
     * paused pages paused: only the device of the memory shared is touched. */
    int (*pause_)(const char*, int, uint64_t*, double*) = dlsym(RTLD_DEFAULT, "expseg_pause");
    int (*resume_)(const char*, uint64_t*, double*) = dlsym(RTLD_DEFAULT, "expseg_resume");
    uint64_t (*paused_)(void) = dlsym(RTLD_DEFAULT, "expseg_paused_bytes");
    int (*tag_)(const char*) = dlsym(RTLD_DEFAULT, "expseg_set_tag");
    if (!pause_ || !resume_ || !paused_ || !tag_) { fprintf(stderr, "no expseg API\n"); return 2; }
    printf("dev0_rc=%d", grow(0, 4));
    dev_ = 1; tag_("kv");
    printf(" dev1_rc=%d", grow(16, 4));
    tag_(NULL); dev_ = 0;
    for (int i = 0; i < 4; i++) { fill(i); fill(16 + i); }
    printf(" pause_rc=%d", pause_("kv", 0, 0, 0));
    printf(" paused_before=%lu", (unsigned long)paused_());
    unsigned char hd[64];
    printf(" ipc_rc=%d", cudaIpcGetMemHandle(hd, (void*)(va + PAGE)));
    printf(" paused_after=%lu", (unsigned long)paused_());
    printf(" resume_rc=%d", resume_("kv", 0, 0));
    int ok = 1; for (int i = 0; i < 4; i++) ok &= holds((char*)(va + i * PAGE), i) && holds((char*)(va + (16 + i) * PAGE), 16 + i);
    printf(" intact=%d shrink_rc=%d", ok, shrink(16, 4) | shrink(0, 4));
    size_t fr, tot; cudaMemGetInfo(&fr, &tot);
    printf(" used_end=%ld\n", fakecu_used());
    return 0;
  }
  if (!strcmp(what, "two_threads")) return two_threads();
  if (!strcmp(what, "two_random")) return two_devices(400, NP - 6, 0);
  if (!strcmp(what, "two_recycle")) return two_devices(300, 6, 1);
  long c0 = fakecu_count("cuMemCreate"), m0 = fakecu_count("cuMemMap");
  printf("grow_rc=%d\n", grow(0, 8));
  printf("batch_creates=%ld batch_maps=%ld\n", fakecu_count("cuMemCreate") - c0, fakecu_count("cuMemMap") - m0);
  {
    /* Range queries answer for the page the program mapped, not the batch's handle:
     * cuMemGetAddressRange as natively, the range attributes too (natively its reservation:
     * kept at the page so that raw IPC offsets from RANGE_START_ADDR stay inside a mirror). */
    CUresult (*range_)(uint64_t*, size_t*, uint64_t) = get("cuMemGetAddressRange");
    CUresult (*attr_)(void*, int, uint64_t) = get("cuPointerGetAttribute");
    uint64_t rb = 0, ab = 0, as = 0; size_t rs = 0;
    int rrc = range_(&rb, &rs, va + 3 * PAGE + 5) | attr_(&ab, 11, va + 3 * PAGE + 5) | attr_(&as, 12, va + 3 * PAGE + 5);
    printf("range_rc=%d range_is_page=%d attr_is_page=%d\n", rrc, rb == va + 3 * PAGE && rs == PAGE,
           ab == va + 3 * PAGE && as == PAGE);
  }
  for (int i = 0; i < 8; i++) fill(i);
  printf("shrink_rc=%d\n", shrink(2, 4));
  {
    /* Released pages still mapped inside the handle (not compacted yet): natively nothing is
     * mapped there, and the queries say so. */
    CUresult (*range_)(uint64_t*, size_t*, uint64_t) = get("cuMemGetAddressRange");
    CUresult (*attr_)(void*, int, uint64_t) = get("cuPointerGetAttribute");
    uint64_t rb = 7, ab = 7; size_t rs = 7;
    int r1 = range_(&rb, &rs, va + 3 * PAGE + 5), r2 = attr_(&ab, 11, va + 3 * PAGE + 5);
    printf("hidden_range_rc=%d hidden_range_zero=%d hidden_attr_rc=%d\n", r1, rb == 0 && rs == 0, r2);
  }
  printf("used_stranded_mib=%ld\n", fakecu_used() >> 20);
  if (getenv("FORK_CHILD")) {
    /* A forked child (a DataLoader worker) asks for free memory: CUDA state is not the
     * child's, so expseg does nothing of its own there (no compaction, no lock the parent's
     * threads may have held at the fork). */
    fflush(stdout);
    pid_t k = fork();
    if (k == 0) {
      long before = fakecu_count("cuMemCreate") + fakecu_count("cuMemMap");
      size_t f0, t0; cudaMemGetInfo(&f0, &t0);
      printf("child_driver_calls=%ld\n", fakecu_count("cuMemCreate") + fakecu_count("cuMemMap") - before);
      fflush(stdout); _exit(0);
    }
    int st; waitpid(k, &st, 0);
    printf("child_exit=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  }
  if (getenv("MEMINFO_THREAD")) {
    /* Another thread asks first: it may be running while this one launches work on the live
     * pages, so nothing that needs them moved goes back then. */
    pthread_t t; pthread_create(&t, 0, meminfo_thread, 0); pthread_join(t, 0);
    printf("used_after_other_thread_mib=%ld\n", fakecu_used() >> 20);
  }
  if (getenv("PAUSE_THREAD")) {
    /* The program pauses from a thread that made no allocator call: what is held beyond
     * live memory goes back first (as its trim), so only the live pages are paused. */
    int (*pause_)(const char*, int, uint64_t*, double*) = dlsym(RTLD_DEFAULT, "expseg_pause");
    int (*resume_)(const char*, uint64_t*, double*) = dlsym(RTLD_DEFAULT, "expseg_resume");
    uint64_t (*paused_)(void) = dlsym(RTLD_DEFAULT, "expseg_paused_bytes");
    if (!pause_ || !resume_ || !paused_) { fprintf(stderr, "no expseg API\n"); return 2; }
    struct { int (*f)(const char*, int, uint64_t*, double*); int rc; } a = {pause_, -1};
    pthread_t t; pthread_create(&t, 0, pause_thread, &a); pthread_join(t, 0);
    printf("pause_rc=%d paused_mib=%lu", a.rc, (unsigned long)(paused_() >> 20));
    printf(" resume_rc=%d\n", resume_(NULL, 0, 0));
  }
  if (getenv("TRIM_THREAD")) {
    /* The program asks: everything goes back, whichever of its threads asks. */
    uint64_t got = 0;
    pthread_t t; pthread_create(&t, 0, trim_thread, &got); pthread_join(t, 0);
    printf("trim_thread_mib=%lu\n", (unsigned long)(got >> 20));
  }
  size_t fr, tot; cudaMemGetInfo(&fr, &tot); /* expseg compacts before answering */
  printf("used_compacted_mib=%ld\n", fakecu_used() >> 20);
  int ok = 1; for (int i = 0; i < 8; i++) if (i < 2 || i >= 6) ok &= holds((char*)(va + i * PAGE), i);
  printf("live_intact=%d\n", ok);
  printf("regrow_rc=%d\n", grow(2, 4));
  for (int i = 2; i < 6; i++) fill(i);
  ok = 1; for (int i = 0; i < 8; i++) ok &= holds((char*)(va + i * PAGE), i);
  printf("all_intact=%d\n", ok);
  /* SIDE_STREAM: the program has a non-blocking stream (as PyTorch after torch.cuda.Stream()):
   * a page inside a coalesced handle is exported as a copy (nothing moves), one-way, made again
   * at a synchronize. */
  int side = getenv("SIDE_STREAM") != 0;
  if (side) {
    CUresult (*screate)(void**, unsigned) = dlsym(RTLD_DEFAULT, "cuStreamCreate");
    void* s = 0;
    printf("side_stream_rc=%d\n", screate ? screate(&s, 1) : -1);
  }
  /* CAPTURE_STREAM: a stream of the program's captures a graph while a page inside a coalesced
   * handle is exported (no non-blocking stream: the export would split): nothing moves, the
   * export fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; once the capture ended it splits. */
  if (getenv("CAPTURE_STREAM")) {
    CUresult (*screate)(void**, unsigned) = dlsym(RTLD_DEFAULT, "cuStreamCreate");
    CUresult (*begin)(void*, unsigned) = dlsym(RTLD_DEFAULT, "cuStreamBeginCapture_v2");
    CUresult (*end)(void*, void**) = dlsym(RTLD_DEFAULT, "cuStreamEndCapture");
    void *s = 0, *g = 0;
    int cfd = -1;
    int made = screate && begin && end && !screate(&s, 0) && !begin(s, 2);
    CUresult cr = made ? export_(&cfd, h[1], 1, 0) : (CUresult)-1;
    if (made) end(s, &g);
    free(g);
    int ok = 1; for (int i = 0; i < 8; i++) ok &= holds((char*)(va + i * PAGE), i);
    printf("capture_export_rc=%d capture_intact=%d\n", (int)cr, ok);
    print_stat("coalesce_moves_refused_capture");
  }
  /* A page exported alone and mapped by an importer shows that page's data (EXPORT_THREAD:
   * exported from a thread with no context current, as torch.multiprocessing's feeder). */
  int fd = -1; CUresult er;
  if (getenv("EXPORT_THREAD")) {
    pthread_t t; pthread_create(&t, 0, export_thread, &h[1]); pthread_join(t, 0);
    er = export_rc; fd = export_fd;
  } else {
    er = export_(&fd, h[1], 1, 0);
  }
  uint64_t ih = 0, iva = 0; int shared_ok = 0;
  if (!er && !import_(&ih, (void*)(intptr_t)fd, 1) && !reserve(&iva, PAGE, 0, 0, 0) && !map(iva, PAGE, 0, ih, 0)) {
    Access a = {{1, 0}, 3}; access_(iva, PAGE, &a, 1);
    shared_ok = holds((char*)iva, 1);
    if (side) printf("importer_sees_page=%d\n", shared_ok);
    ((char*)iva)[7] = 'z'; shared_ok &= ((char*)(va + PAGE))[7] == 'z'; ((char*)iva)[7] = 'A' + 1;
    if (side) {
      /* The producer writes and synchronizes: the importer reads it; its own write stays. */
      char keep = ((char*)(va + PAGE))[9];
      ((char*)(va + PAGE))[9] = 'q';
      CUresult (*csync)(void) = dlsym(RTLD_DEFAULT, "cuCtxSynchronize");
      int src = csync ? (int)csync() : -1;
      printf("sync_rc=%d after_sync_seen=%d\n", src, ((char*)iva)[9] == 'q');
      ((char*)(va + PAGE))[9] = keep;
      if (csync) csync();
      printf("export_wrong_context=%ld\n", fakecu_count("wrong_context"));
      print_stat("export_mirrors_made");
      print_stat("coalesce_exports_split");
    }
    unmap(iva, PAGE); release(ih); addrfree(iva, PAGE);
  }
  printf("export_rc=%d shared_both_ways=%d\n", er, shared_ok);
  ok = 1; for (int i = 0; i < 8; i++) ok &= holds((char*)(va + i * PAGE), i);
  printf("after_export_intact=%d\n", ok);
  uint64_t rh = 0; Prop got; memset(&got, 0, sizeof got);
  CUresult rr = retain(&rh, (void*)(va + 3 * PAGE + 5));
  printf("retain_rc=%d same_handle=%d", rr, rh == h[3]);
  CUresult pr = props(&got, rh);
  printf(" props_rc=%d props_dev=%d props_posix=%d", pr, got.location.id, got.requestedHandleTypes);
  printf(" release_rc=%d\n", release(rh));
  printf("final_shrink_rc=%d\n", shrink(0, 8));
  printf("free_va_rc=%d", addrfree(va, NP * PAGE));
  cudaMemGetInfo(&fr, &tot); /* what is free is free: kept handles go back */
  printf(" used_end=%ld\n", fakecu_used());
  return 0;
}
