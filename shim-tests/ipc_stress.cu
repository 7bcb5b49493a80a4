// Threads sharing allocations while they are in use: 8 host threads, each on its own stream,
// allocate (2 MiB-128 MiB, from expseg's pool), fill with a per-allocation pattern, ask for IPC
// handles of their allocations while kernels still write them, rewrite, check every word, and
// free, in random order; 10,000 operations in all. Any CUDA error is a fault; any word that is
// not its pattern is a mismatch.
//
//   nvcc -O2 -cudart shared -o ipc_stress ipc_stress.cu -lpthread
//   LD_PRELOAD=libexpseg.so ./ipc_stress [OPS] [THREADS]
// Last line: "N passed, M failed" (passed = operations without fault or mismatch).
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <atomic>
#include <vector>

__global__ void fill(uint32_t* p, size_t n, uint32_t tag) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = tag ^ (uint32_t)(i * 2654435761u);
}
__global__ void check(const uint32_t* p, size_t n, uint32_t tag, unsigned long long* bad) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    mine += p[i] != (tag ^ (uint32_t)(i * 2654435761u));
  if (mine) atomicAdd(bad, mine);
}

static std::atomic<long> ops_left, faults, mismatches, handles, done_ops;
static const size_t SIZES_MIB[] = {2, 4, 8, 20, 64, 128};

struct Alloc { uint32_t* p; size_t words; uint32_t tag; };

static void* worker(void* arg) {
  long id = (long)arg;
  unsigned seed = 12345u + (unsigned)id * 7919u;
  auto rnd = [&]() { seed = seed * 1103515245u + 12345u; return seed >> 8; };
  cudaSetDevice(0);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  unsigned long long* bad; cudaMalloc(&bad, sizeof *bad);
  std::vector<Alloc> live;
  auto fault = [&](const char* what, cudaError_t e) {
    faults++; fprintf(stderr, "thread %ld: %s: %s\n", id, what, cudaGetErrorString(e));
  };
  auto verify = [&](const Alloc& a) {
    cudaMemsetAsync(bad, 0, sizeof *bad, s);
    check<<<256, 256, 0, s>>>(a.p, a.words, a.tag, bad);
    unsigned long long h = 0;
    cudaError_t e = cudaMemcpyAsync(&h, bad, sizeof h, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) fault("check", e);
    else if (h) { mismatches++; fprintf(stderr, "thread %ld: %llu words differ\n", id, h); }
  };
  while (ops_left.fetch_sub(1) > 0) {
    unsigned op = rnd() % 100;
    if (live.empty() || (op < 30 && live.size() < 12)) {
      size_t mib = SIZES_MIB[rnd() % 6];
      Alloc a; a.words = mib * (1 << 20) / 4; a.tag = rnd();
      cudaError_t e = cudaMalloc(&a.p, a.words * 4);
      if (e == cudaErrorMemoryAllocation) { cudaGetLastError(); continue; }
      if (e != cudaSuccess) { fault("cudaMalloc", e); continue; }
      fill<<<256, 256, 0, s>>>(a.p, a.words, a.tag);
      live.push_back(a);
    } else if (op < 55) {
      // Share while in use: a rewrite of the same pattern is still running on the stream.
      Alloc& a = live[rnd() % live.size()];
      fill<<<256, 256, 0, s>>>(a.p, a.words, a.tag);
      cudaIpcMemHandle_t h;
      cudaError_t e = cudaIpcGetMemHandle(&h, a.p);
      if (e != cudaSuccess) fault("cudaIpcGetMemHandle", e); else handles++;
    } else if (op < 70) {
      Alloc& a = live[rnd() % live.size()];
      a.tag = rnd();
      fill<<<256, 256, 0, s>>>(a.p, a.words, a.tag);
    } else if (op < 85) {
      verify(live[rnd() % live.size()]);
    } else {
      size_t i = rnd() % live.size();
      verify(live[i]);
      cudaError_t e = cudaFree(live[i].p);
      if (e != cudaSuccess) fault("cudaFree", e);
      live.erase(live.begin() + i);
    }
    done_ops++;
  }
  for (auto& a : live) { verify(a); cudaFree(a.p); }
  cudaFree(bad); cudaStreamDestroy(s);
  return 0;
}

int main(int argc, char** argv) {
  long ops = argc > 1 ? atol(argv[1]) : 10000;
  int threads = argc > 2 ? atoi(argv[2]) : 8;
  ops_left = ops;
  cudaFree(0);
  std::vector<pthread_t> t(threads);
  for (int i = 0; i < threads; i++) pthread_create(&t[i], 0, worker, (void*)(long)i);
  for (int i = 0; i < threads; i++) pthread_join(t[i], 0);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { faults++; fprintf(stderr, "final sync: %s\n", cudaGetErrorString(e)); }
  printf("threads=%d ops=%ld handles=%ld mismatches=%ld faults=%ld\n", threads, done_ops.load(), handles.load(),
         mismatches.load(), faults.load());
  long failed = mismatches.load() + faults.load();
  printf("%ld passed, %ld failed\n", done_ops.load() - failed, failed);
  return failed ? 1 : 0;
}
