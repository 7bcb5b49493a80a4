// GPU integration test of expseg's cudaMalloc/cudaFree: run natively and under the shim
// (built with `nvcc -cudart shared` so the runtime's symbols can be interposed).
// Every case asserts; the last line is "N passed, M failed, K skipped" (a case this machine
// cannot run, such as two GPUs on one, is skipped, not passed). With EXPECT_POOL=1 it also
// asserts that requests of at least 2 MiB were served by VMM memory (the pool).
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int passed, failed, skipped;
// What a case returns when this machine cannot run it (counted apart, never as a pass).
#define SKIPPED 2
static int expect_pool;
#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

#define CHECK(cond, ...)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      printf("  FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
      printf(__VA_ARGS__);                                            \
      printf("\n");                                                   \
      return 0;                                                       \
    }                                                                 \
  } while (0)

#include "pattern.cuh"

// Spins for about `ns` nanoseconds, then writes `v` over the buffer: a late writer.
__global__ void late_write_k(uint32_t* p, size_t n, uint32_t v, long long ns) {
  long long t0 = clock64();
  while (clock64() - t0 < ns * 2) {}
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}
__global__ void count_ne_k(const uint32_t* p, size_t n, uint32_t v, unsigned long long* bad) {
  unsigned long long b = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) b += p[i] != v;
  if (b) atomicAdd(bad, b);
}

// Fill the whole buffer (whole 32-bit words, then the tail bytes) and verify all of it.
static int fill_verify(void* p, size_t bytes, uint32_t seed, cudaStream_t s = 0) {
  size_t n = bytes / 4;
  unsigned long long* bad;
  if (cudaMallocHost(&bad, sizeof *bad) != cudaSuccess) return 0;
  *bad = 0;
  if (n) {
    fill_k<<<1024, 256, 0, s>>>((uint32_t*)p, n, seed);
    verify_k<<<1024, 256, 0, s>>>((const uint32_t*)p, n, seed, bad);
  }
  unsigned char tail[4] = {1, 2, 3, 4}, back[4] = {0};
  size_t t = bytes % 4;
  if (t) cudaMemcpyAsync((char*)p + n * 4, tail, t, cudaMemcpyHostToDevice, s);
  if (t) cudaMemcpyAsync(back, (char*)p + n * 4, t, cudaMemcpyDeviceToHost, s);
  cudaError_t e = cudaStreamSynchronize(s);
  int ok = e == cudaSuccess && *bad == 0 && memcmp(tail, back, t) == 0;
  if (!ok) printf("  fill_verify(%zu bytes): err=%d bad=%llu\n", bytes, e, *bad);
  cudaFreeHost(bad);
  return ok;
}

// 1 if `p` is VMM memory (the driver has an allocation handle for it), 0 if cudaMalloc memory.
// (Not the legacy-IPC attribute: expseg answers it for pool memory as cudaMalloc memory does.)
static int is_vmm(void* p) {
  CUmemGenericAllocationHandle h;
  if (cuMemRetainAllocationHandle(&h, p) != CUDA_SUCCESS) return 0;
  cuMemRelease(h);
  return 1;
}
// What the legacy-IPC attribute says (-1: the query failed).
static int legacy_ipc_capable(void* p) {
  int cap = -1;
  if (cuPointerGetAttribute(&cap, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, (CUdeviceptr)p) != CUDA_SUCCESS) return -1;
  return cap;
}

static int t_sizes(void) {
  size_t free_b, total;
  cudaMemGetInfo(&free_b, &total);
  size_t sizes[] = {1, 17, 4096, MIB, 2 * MIB - 1, 2 * MIB, 2 * MIB + 1, 3 * MIB, 20 * MIB, 64 * MIB,
                    100 * MIB + 7, GIB, 4 * GIB + 12345, 16 * GIB};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    size_t n = sizes[i];
    if (n > free_b / 2) continue;
    void* p = 0;
    cudaError_t e = cudaMalloc(&p, n);
    CHECK(e == cudaSuccess && p, "cudaMalloc(%zu) -> %d", n, e);
    CHECK(fill_verify(p, n, (uint32_t)i), "data at %zu bytes", n);
    if (expect_pool) CHECK(is_vmm(p) == (n >= 2 * MIB), "size %zu: vmm=%d", n, is_vmm(p));
    CHECK(legacy_ipc_capable(p) == 1, "size %zu: legacy IPC capable %d, as cudaMalloc memory is", n, legacy_ipc_capable(p));
    CHECK(cudaFree(p) == cudaSuccess, "cudaFree(%zu)", n);
  }
  return 1;
}

static int t_semantics(void) {
  void* z = (void*)1;
  CHECK(cudaMalloc(&z, 0) == cudaSuccess && z == 0, "cudaMalloc(0) gives success and NULL");
  CHECK(cudaFree(0) == cudaSuccess, "cudaFree(NULL)");
  void* p;
  CHECK(cudaMalloc(&p, 8 * MIB) == cudaSuccess, "alloc");
  cudaError_t e = cudaFree((char*)p + 4096);
  CHECK(e == cudaErrorInvalidValue, "interior free -> %d", e);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue, "last error after interior free");
  CHECK(cudaFree(p) == cudaSuccess, "free");
  e = cudaFree(p);
  CHECK(e == cudaErrorInvalidValue, "double free -> %d", e);
  cudaGetLastError();
  size_t fr, tot;
  cudaMemGetInfo(&fr, &tot);
  void* big = 0;
  e = cudaMalloc(&big, tot + GIB);
  CHECK(e == cudaErrorMemoryAllocation, "oversized cudaMalloc -> %d", e);
  CHECK(cudaGetLastError() == cudaErrorMemoryAllocation, "last error after OOM");
  CHECK(cudaGetLastError() == cudaSuccess, "last error cleared");
  CHECK(cudaMalloc(&p, 8 * MIB) == cudaSuccess && fill_verify(p, 8 * MIB, 9), "allocation after OOM");
  CHECK(cudaFree(p) == cudaSuccess, "free");
  return 1;
}

// cudaFree must not let memory be handed out again while a kernel still writes to it.
static int t_free_waits_for_gpu(void) {
  size_t n = 64 * MIB;
  for (int round = 0; round < 3; round++) {
    uint32_t *a, *b;
    CHECK(cudaMalloc((void**)&a, n) == cudaSuccess, "alloc a");
    late_write_k<<<256, 256>>>(a, n / 4, 0xdeadbeef, 50 * 1000 * 1000);  // ~50 ms, then writes
    CHECK(cudaFree(a) == cudaSuccess, "free a while the kernel runs");
    CHECK(cudaMalloc((void**)&b, n) == cudaSuccess, "alloc b");
    // b is written on a non-blocking stream, which does not wait for a's kernel on the
    // legacy stream: if b were a's memory while that kernel still ran, its late writes would
    // land after these and the count below would find them.
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
    CHECK(cudaMemsetAsync(b, 0x11, n, s) == cudaSuccess, "memset b");
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync b's stream");
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
    cudaStreamDestroy(s);
    unsigned long long* bad;
    cudaMallocHost(&bad, sizeof *bad);
    *bad = 0;
    count_ne_k<<<512, 256>>>(b, n / 4, 0x11111111u, bad);
    cudaDeviceSynchronize();
    CHECK(*bad == 0, "round %d: %llu words of b overwritten by a's late kernel (same memory: %d)", round, *bad, a == b);
    cudaFreeHost(bad);
    CHECK(cudaFree(b) == cudaSuccess, "free b");
  }
  return 1;
}

// Many small frees then one large request: freed chunks are stitched.
static int t_stitch(void) {
  void* small[16];
  for (int i = 0; i < 16; i++) {
    CHECK(cudaMalloc(&small[i], 2 * MIB) == cudaSuccess, "small %d", i);
    CHECK(fill_verify(small[i], 2 * MIB, 100 + i), "small data");
  }
  for (int i = 0; i < 16; i++) CHECK(cudaFree(small[i]) == cudaSuccess, "free small");
  void* big;
  CHECK(cudaMalloc(&big, 30 * MIB) == cudaSuccess, "big");
  CHECK(fill_verify(big, 30 * MIB, 77), "big data");
  CHECK(cudaFree(big) == cudaSuccess, "free big");
  return 1;
}

// Random alloc/free history with every live buffer checked before it is freed.
static int t_random_history(void) {
  enum { LIVE = 48 };
  void* live[LIVE] = {0};
  size_t sz[LIVE] = {0};
  uint32_t seed = 12345;
  for (int it = 0; it < 1500; it++) {
    seed = seed * 1664525u + 1013904223u;
    int k = (seed >> 8) % LIVE;
    if (live[k]) {
      CHECK(fill_verify(live[k], sz[k], k), "it %d size %zu", it, sz[k]);
      CHECK(cudaFree(live[k]) == cudaSuccess, "free");
      live[k] = 0;
    } else {
      uint32_t r = seed >> 4;
      sz[k] = (r % 5 == 0) ? 1 + r % (1 << 20) : (1 + r % 96) * MIB - (r % 3) * 4096;
      CHECK(cudaMalloc(&live[k], sz[k]) == cudaSuccess, "alloc %zu", sz[k]);
    }
  }
  for (int k = 0; k < LIVE; k++)
    if (live[k]) CHECK(cudaFree(live[k]) == cudaSuccess, "final free");
  return 1;
}

// cudaMemGetInfo counts memory the pool keeps cached as free.
static int t_meminfo(void) {
  size_t f0, f1, f2, tot;
  void* p;
  cudaMemGetInfo(&f0, &tot);
  CHECK(cudaMalloc(&p, 256 * MIB) == cudaSuccess, "alloc");
  cudaMemGetInfo(&f1, &tot);
  CHECK(f1 + 250 * MIB <= f0, "free dropped by the allocation: %zu -> %zu", f0 >> 20, f1 >> 20);
  CHECK(cudaFree(p) == cudaSuccess, "free");
  cudaMemGetInfo(&f2, &tot);
  CHECK(f2 + 8 * MIB >= f0, "freed memory counted as free again: %zu MiB vs %zu MiB before", f2 >> 20, f0 >> 20);
  return 1;
}

// The driver's range queries describe the allocation the program made (also when expseg
// built it of several chunks: run with EXPSEG_MAX_CHUNK=2M).
static int t_ranges(void) {
  size_t sizes[] = {6 * MIB, 64 * MIB + 4096};
  for (size_t n : sizes) {
    char* p;
    CHECK(cudaMalloc((void**)&p, n) == cudaSuccess, "alloc");
    CUdeviceptr base = 0, start = 0;
    size_t size = 0;
    unsigned long long rsize = 0;
    CHECK(cuMemGetAddressRange(&base, &size, (CUdeviceptr)(p + n - 1)) == CUDA_SUCCESS, "cuMemGetAddressRange");
    CHECK(base == (CUdeviceptr)p && size >= n && size < n + 2 * MIB, "range %zu: base off %lld size %zu", n,
          (long long)(base - (CUdeviceptr)p), size);
    CHECK(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, (CUdeviceptr)(p + n / 2)) == CUDA_SUCCESS &&
              start == (CUdeviceptr)p, "range start attribute");
    CHECK(cuPointerGetAttribute(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, (CUdeviceptr)(p + n / 2)) == CUDA_SUCCESS &&
              rsize == size, "range size attribute %llu vs %zu", rsize, size);
    CHECK(cudaFree(p) == cudaSuccess, "free");
  }
  return 1;
}

struct Th { int id; int ok; };
static void* thread_main(void* arg) {
  Th* t = (Th*)arg;
  cudaSetDevice(0);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  uint32_t seed = 777 + t->id;
  t->ok = 1;
  for (int it = 0; it < 150 && t->ok; it++) {
    seed = seed * 1664525u + 1013904223u;
    size_t n = (1 + (seed >> 8) % 48) * MIB + (seed % 1000);
    void* p;
    if (cudaMalloc(&p, n) != cudaSuccess) { t->ok = 0; break; }
    if (!fill_verify(p, n, seed, s)) t->ok = 0;
    if (cudaFree(p) != cudaSuccess) t->ok = 0;
  }
  cudaStreamDestroy(s);
  return 0;
}
static int t_threads(void) {
  pthread_t th[8];
  Th a[8];
  for (int i = 0; i < 8; i++) { a[i].id = i; pthread_create(&th[i], 0, thread_main, &a[i]); }
  for (int i = 0; i < 8; i++) pthread_join(th[i], 0);
  for (int i = 0; i < 8; i++) CHECK(a[i].ok, "thread %d", i);
  return 1;
}

__global__ void read_remote_k(const uint32_t* p, size_t n, uint32_t seed, unsigned long long* bad) {
  unsigned long long b = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    b += p[i] != ((uint32_t)(i * 2654435761u) ^ seed);
  if (b) atomicAdd(bad, b);
}

// Two GPUs: memory of device 1 read by a kernel on device 0 after peer access is enabled,
// including an allocation made after enabling; freeing device-1 memory from device 0.
static int t_two_gpus(void) {
  int n = 0;
  cudaGetDeviceCount(&n);
  if (n < 2) { printf("  (skipped: %d GPU)\n", n); return SKIPPED; }
  int can = 0;
  cudaDeviceCanAccessPeer(&can, 0, 1);
  if (!can) { printf("  (skipped: no peer access 0->1)\n"); return SKIPPED; }
  size_t sz = 64 * MIB;
  uint32_t *a, *b;
  CHECK(cudaSetDevice(1) == cudaSuccess, "set 1");
  CHECK(cudaMalloc((void**)&a, sz) == cudaSuccess && fill_verify(a, sz, 5), "alloc on 1");
  if (expect_pool) CHECK(is_vmm(a) == 1, "device 1 memory from the pool");
  CHECK(cudaSetDevice(0) == cudaSuccess, "set 0");
  CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaSuccess, "enable peer");
  CHECK(cudaSetDevice(1) == cudaSuccess, "set 1");
  CHECK(cudaMalloc((void**)&b, sz) == cudaSuccess && fill_verify(b, sz, 6), "alloc on 1 after enabling");
  CHECK(cudaSetDevice(0) == cudaSuccess, "set 0");
  unsigned long long* bad;
  cudaMallocHost(&bad, sizeof *bad);
  *bad = 0;
  read_remote_k<<<256, 256>>>(a, sz / 4, 5, bad);
  read_remote_k<<<256, 256>>>(b, sz / 4, 6, bad);
  cudaError_t e = cudaDeviceSynchronize();
  CHECK(e == cudaSuccess && *bad == 0, "device 0 reads device 1 memory: err %d, bad %llu", e, *bad);
  cudaFreeHost(bad);
  CHECK(cudaDeviceDisablePeerAccess(1) == cudaSuccess, "disable peer");
  CHECK(cudaFree(a) == cudaSuccess && cudaFree(b) == cudaSuccess, "free device 1 memory from device 0");
  int d = -1;
  cudaGetDevice(&d);
  CHECK(d == 0, "current device unchanged: %d", d);
  return 1;
}

int main() {
  expect_pool = getenv("EXPECT_POOL") && atoi(getenv("EXPECT_POOL"));
  cuInit(0);
  struct { const char* name; int (*f)(void); } tests[] = {
      {"sizes_1B_to_16GiB", t_sizes}, {"semantics", t_semantics}, {"free_waits_for_gpu", t_free_waits_for_gpu},
      {"stitch", t_stitch}, {"random_history", t_random_history}, {"meminfo", t_meminfo},
      {"threads", t_threads}, {"two_gpus", t_two_gpus}, {"ranges", t_ranges},
  };
  for (size_t i = 0; i < sizeof tests / sizeof *tests; i++) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int ok = tests[i].f();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%s %s (%.0f ms)\n", ok == SKIPPED ? "SKIP" : ok ? "PASS" : "FAIL", tests[i].name,
           (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
    ok == SKIPPED ? skipped++ : ok ? passed++ : failed++;
  }
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed != 0;
}
