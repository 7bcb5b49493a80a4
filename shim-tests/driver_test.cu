// GPU test of driver-API allocations under expseg (issue 11): a program that never calls the
// runtime's allocator, only cuMemAlloc/cuMemFree/cuIpcGetMemHandle, as numba-cuda, JAX with
// the platform allocator and libraries on libcuda do. Built with nvcc (host code only) and
// -lcuda.
//
//   driver_test run CONSUMER_PRELOAD|-   sizes 2 MiB..1 GiB: allocate, fill, check range
//       queries and (EXPECT_POOL=1) that the memory is VMM (the pool's); share each through
//       cuIpcGetMemHandle with a consumer process (this binary, "consume", LD_PRELOAD=
//       CONSUMER_PRELOAD) that checks every word and writes a marker; free; a context of its
//       own (cuCtxCreate) whose allocations pass through; cuMemGetInfo. Last line:
//       "N passed, M failed".
#include <cuda.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

extern char** environ;
#define MIB ((size_t)1 << 20)
static int passed, failed;
#define CHECK(c, ...) do { if (!(c)) { printf("FAIL " __VA_ARGS__); printf(" (line %d)\n", __LINE__); return 0; } } while (0)

// VMM memory: the driver has an allocation handle for it. (Not the legacy-IPC attribute:
// expseg answers it for pool memory as for cuMemAlloc memory.)
static int is_vmm(CUdeviceptr p) {
  CUmemGenericAllocationHandle h;
  if (cuMemRetainAllocationHandle(&h, (void*)p) != CUDA_SUCCESS) return 0;
  cuMemRelease(h);
  return 1;
}

static std::vector<uint32_t> pattern(size_t words, uint32_t seed) {
  std::vector<uint32_t> v(words);
  for (size_t i = 0; i < words; i++) v[i] = (uint32_t)(i * 2654435761u) ^ seed;
  return v;
}

static int check_words(CUdeviceptr p, size_t bytes, uint32_t seed) {
  std::vector<uint32_t> got(bytes / 4), want = pattern(bytes / 4, seed);
  if (cuMemcpyDtoH(got.data(), p, bytes)) return 0;
  return memcmp(got.data(), want.data(), bytes) == 0;
}

static int consume() {
  // argv-less: handle bytes, size and seed come as hex in the environment.
  cuInit(0);
  CUdevice d; cuDeviceGet(&d, 0);
  CUcontext c; cuDevicePrimaryCtxRetain(&c, d); cuCtxSetCurrent(c);
  CUipcMemHandle h; const char* hex = getenv("HANDLE");
  for (int i = 0; i < 64; i++) { unsigned b; sscanf(hex + 2 * i, "%2x", &b); h.reserved[i] = (char)b; }
  size_t size = strtoull(getenv("SIZE"), 0, 10); uint32_t seed = strtoul(getenv("SEED"), 0, 10);
  CUdeviceptr p;
  CUresult r = cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r) { printf("open=%d\n", r); return 1; }
  int ok = check_words(p, size, seed);
  uint32_t marker = 0xC0FFEE;
  cuMemcpyHtoD(p, &marker, 4);
  cuCtxSynchronize();
  cuIpcCloseMemHandle(p);
  printf("data=%d\n", ok);
  return ok ? 0 : 1;
}

static const char* self; static const char* consumer_preload;
static int share(CUdeviceptr p, size_t size, uint32_t seed, int* both_ways) {
  CUipcMemHandle h;
  CUresult r = cuIpcGetMemHandle(&h, p);
  CHECK(r == CUDA_SUCCESS, "cuIpcGetMemHandle: %d", r);
  char hex[129]; for (int i = 0; i < 64; i++) sprintf(hex + 2 * i, "%02x", (unsigned char)h.reserved[i]);
  char e1[200], e2[64], e3[64], e4[4200];
  snprintf(e1, sizeof e1, "HANDLE=%s", hex); snprintf(e2, sizeof e2, "SIZE=%zu", size);
  snprintf(e3, sizeof e3, "SEED=%u", seed);
  std::vector<char*> env;
  for (char** e = environ; *e; e++) if (strncmp(*e, "LD_PRELOAD=", 11)) env.push_back(*e);
  if (strcmp(consumer_preload, "-")) { snprintf(e4, sizeof e4, "LD_PRELOAD=%s", consumer_preload); env.push_back(e4); }
  env.push_back(e1); env.push_back(e2); env.push_back(e3); env.push_back(0);
  char* argv[] = {(char*)self, (char*)"consume", 0};
  pid_t pid; int st = 0;
  CHECK(posix_spawn(&pid, self, 0, 0, argv, env.data()) == 0, "spawn");
  waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "consumer of %zu MiB failed (status %d)", size / MIB, st);
  uint32_t first = 0; cuMemcpyDtoH(&first, p, 4);
  *both_ways = first == 0xC0FFEE;
  return 1;
}

static int t_sizes() {
  const size_t sizes[] = {2 * MIB, 20 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB};
  int expect_pool = getenv("EXPECT_POOL") && atoi(getenv("EXPECT_POOL"));
  for (size_t s : sizes) {
    CUdeviceptr p = 0;
    CUresult r = cuMemAlloc(&p, s);
    CHECK(r == CUDA_SUCCESS && p, "cuMemAlloc(%zu MiB): %d", s / MIB, r);
    if (expect_pool) CHECK(is_vmm(p) == 1, "%zu MiB not from the pool", s / MIB);
    int cap = -1;
    CHECK(cuPointerGetAttribute(&cap, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p) == CUDA_SUCCESS && cap == 1,
          "%zu MiB: legacy IPC capable %d, as cuMemAlloc memory is", s / MIB, cap);
    CUdeviceptr base = 0; size_t got = 0;
    CHECK(cuMemGetAddressRange(&base, &got, p + s / 2) == CUDA_SUCCESS && base == p && got == s,
          "range of %zu MiB: base %llx size %zu", s / MIB, (unsigned long long)base, got);
    uint32_t seed = (uint32_t)(s >> 20);
    std::vector<uint32_t> v = pattern(s / 4, seed);
    CHECK(cuMemcpyHtoD(p, v.data(), s) == CUDA_SUCCESS, "fill");
    CHECK(check_words(p, s, seed), "%zu MiB read back", s / MIB);
    int both = 0;
    if (!share(p, s, seed, &both)) return 0;
    printf("  %5zu MiB: consumer (%s) read every word; its write %s\n", s / MIB,
           strcmp(consumer_preload, "-") ? "expseg" : "plain", both ? "reached the producer (both ways)" : "did not reach the producer (one-way)");
    // Natively and to a consumer under expseg (which maps the memory itself) sharing is both
    // ways; only a plain consumer of expseg's memory may get a one-way mirror.
    const char* pre = getenv("LD_PRELOAD");
    int producer_expseg = pre && strstr(pre, "expseg");
    CHECK(both || (producer_expseg && !strcmp(consumer_preload, "-")), "%zu MiB: the consumer's write did not reach the producer", s / MIB);
    CHECK(cuMemFree(p) == CUDA_SUCCESS, "cuMemFree");
  }
  CHECK(cuMemFree((CUdeviceptr)0x1000) != CUDA_SUCCESS, "a bad pointer is refused");
  return 1;
}

static int t_own_context() {
  CUdevice d; cuDeviceGet(&d, 0);
  CUcontext primary, mine;
  cuCtxGetCurrent(&primary);
#if CUDA_VERSION >= 13000
  CHECK(cuCtxCreate(&mine, NULL, 0, d) == CUDA_SUCCESS, "cuCtxCreate");
#else
  CHECK(cuCtxCreate(&mine, 0, d) == CUDA_SUCCESS, "cuCtxCreate");
#endif
  CUdeviceptr p;
  CHECK(cuMemAlloc(&p, 64 * MIB) == CUDA_SUCCESS, "cuMemAlloc in an own context");
  std::vector<uint32_t> v = pattern(16 * MIB, 9);
  CHECK(cuMemcpyHtoD(p, v.data(), 64 * MIB) == CUDA_SUCCESS && check_words(p, 64 * MIB, 9), "data in an own context");
  CHECK(cuMemFree(p) == CUDA_SUCCESS, "free in an own context");
  cuCtxDestroy(mine);
  cuCtxSetCurrent(primary);
  return 1;
}

static int t_meminfo() {
  size_t f0, t0, f1, t1;
  CHECK(cuMemGetInfo(&f0, &t0) == CUDA_SUCCESS, "cuMemGetInfo");
  CUdeviceptr p; CHECK(cuMemAlloc(&p, 512 * MIB) == CUDA_SUCCESS, "alloc");
  CHECK(cuMemGetInfo(&f1, &t1) == CUDA_SUCCESS && t1 == t0, "cuMemGetInfo again");
  CHECK(f1 + 400 * MIB <= f0, "free fell by the allocation: %zu -> %zu MiB", f0 / MIB, f1 / MIB);
  cuMemFree(p);
  return 1;
}

int main(int argc, char** argv) {
  if (argc > 1 && !strcmp(argv[1], "consume")) return consume();
  if (argc < 3 || strcmp(argv[1], "run")) { fprintf(stderr, "usage: driver_test run CONSUMER_PRELOAD|-\n"); return 2; }
  static char path[4096]; ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return 2;
  path[n] = 0; self = path; consumer_preload = argv[2];
  cuInit(0);
  CUdevice d; cuDeviceGet(&d, 0);
  CUcontext c; cuDevicePrimaryCtxRetain(&c, d); cuCtxSetCurrent(c);
  struct { const char* name; int (*f)(); } tests[] = {{"sizes_and_ipc", t_sizes}, {"own_context", t_own_context}, {"meminfo", t_meminfo}};
  for (auto& t : tests) {
    int ok = t.f();
    printf("%s %s\n", ok ? "PASS" : "FAIL", t.name);
    ok ? passed++ : failed++;
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}
