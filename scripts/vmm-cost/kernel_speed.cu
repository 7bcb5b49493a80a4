// Whether kernels run slower on VMM memory than on cudaMalloc memory, by how the memory is cut
// into physical handles (the question behind a step gap that the allocation calls do not
// explain: DeepSpeed ZeRO-3 under expseg, session 27). The same GiB of device memory as:
//   cudaMalloc     one cudaMalloc
//   one            one handle, mapped once
//   20M            20 MiB handles back to back (PyTorch's expandable segments' pages)
//   2M             2 MiB handles back to back (the granularity)
// and three kernels on each, median of REPS: a streaming copy of half onto the other half
// (bandwidth), a gather of 4-byte words at random addresses over all of it (address
// translation), and the same gather confined to one 2 MiB window per thread block (locality).
//   nvcc -O2 -o kernel_speed kernel_speed.cu -lcuda && ./kernel_speed [GIB=8] [REPS=7]
#include "probe.cuh"
#include <algorithm>
#include <vector>

__global__ void copy_half(const uint4* src, uint4* dst, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) dst[i] = src[i];
}

// Each thread follows its own random walk of `steps` reads over `words` words (window: the
// walk stays inside a 2 MiB window chosen by the block).
__global__ void gather(const unsigned* p, size_t words, int steps, int window, unsigned* out) {
  unsigned long long x = 0x9e3779b97f4a7c15ull * (blockIdx.x * (size_t)blockDim.x + threadIdx.x + 1);
  size_t base = 0, span = words;
  if (window) {
    span = (2u << 20) / 4;
    base = ((size_t)blockIdx.x * 2654435761u % (words / span)) * span;
  }
  unsigned acc = 0;
  for (int s = 0; s < steps; s++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    acc += p[base + (x + acc) % span];
  }
  if (acc == 0x12345678u) *out = acc;
}

static float time_kernel(int reps, void (*launch)(void*), void* arg) {
  cudaEvent_t a, b;
  CKRT(cudaEventCreate(&a));
  CKRT(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < reps + 1; r++) {
    CKRT(cudaEventRecord(a));
    launch(arg);
    CKRT(cudaEventRecord(b));
    CKRT(cudaEventSynchronize(b));
    float ms;
    CKRT(cudaEventElapsedTime(&ms, a, b));
    if (r) t.push_back(ms);  // the first is a warm-up
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Buf { char* p; size_t size; unsigned* out; };
static void l_copy(void* v) { Buf* b = (Buf*)v; size_t n = b->size / 2 / sizeof(uint4); copy_half<<<1056, 512>>>((uint4*)b->p, (uint4*)(b->p + b->size / 2), n); }
static void l_gather(void* v) { Buf* b = (Buf*)v; gather<<<1056, 256>>>((unsigned*)b->p, b->size / 4, 256, 0, b->out); }
static void l_local(void* v) { Buf* b = (Buf*)v; gather<<<1056, 256>>>((unsigned*)b->p, b->size / 4, 256, 1, b->out); }

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IONBF, 0);
  size_t gib = argc > 1 ? strtoull(argv[1], 0, 10) : 8;
  int reps = argc > 2 ? atoi(argv[2]) : 7;
  size_t size = gib << 30;
  CKRT(cudaFree(0));
  CK(cuInit(0));
  cudaDeviceProp prop;
  CKRT(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %zu GiB, median of %d\n", prop.name, gib, reps);
  unsigned* out;
  CKRT(cudaMalloc(&out, 4));
  CUmemAllocationProp P = pinned_prop(0);
  CUmemAccessDesc A = rw_access(0);
  const char* names[] = {"cudaMalloc", "one", "20M", "2M"};
  size_t chunks[] = {0, size, 20ull << 20, 2ull << 20};
  printf("%-11s %10s %10s %10s %10s\n", "memory", "handles", "copy ms", "gather ms", "local ms");
  for (int m = 0; m < 4; m++) {
    Buf b = {nullptr, size, out};
    std::vector<CUmemGenericAllocationHandle> hs;
    CUdeviceptr va = 0;
    size_t mapped = size;
    if (m == 0) {
      CKRT(cudaMalloc(&b.p, size));
    } else {
      size_t c = chunks[m];
      mapped = (size + c - 1) / c * c;
      CK(cuMemAddressReserve(&va, mapped, 2ull << 20, 0, 0));
      for (size_t off = 0; off < mapped; off += c) {
        CUmemGenericAllocationHandle h;
        CK(cuMemCreate(&h, c, &P, 0));
        CK(cuMemMap(va + off, c, 0, h, 0));
        hs.push_back(h);
      }
      CK(cuMemSetAccess(va, mapped, &A, 1));
      b.p = (char*)va;
    }
    CKRT(cudaMemset(b.p, 1, size));
    CKRT(cudaDeviceSynchronize());
    float c = time_kernel(reps, l_copy, &b), g = time_kernel(reps, l_gather, &b), l = time_kernel(reps, l_local, &b);
    printf("%-11s %10zu %10.3f %10.3f %10.3f\n", names[m], m ? hs.size() : (size_t)1, c, g, l);
    if (m == 0) {
      CKRT(cudaFree(b.p));
    } else {
      CK(cuMemUnmap(va, mapped));
      for (auto h : hs) CK(cuMemRelease(h));
      CK(cuMemAddressFree(va, mapped));
    }
  }
  return 0;
}
