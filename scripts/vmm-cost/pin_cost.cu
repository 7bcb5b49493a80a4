// What page-locking host memory costs, for pausing a process's GPU memory to the host
// (issue 23): each way of getting DMA-able host memory for TOTAL GiB, then a device-to-host
// and a host-to-device copy of TOTAL GiB into it, then giving it back. Times in ms.
//   alloc1     cuMemHostAlloc, 256 MiB buffers, one thread (torch_memory_saver's way, PyTorch's)
//   allocN     cuMemHostAlloc, 256 MiB buffers, THREADS threads
//   reg1       mmap, pages touched by THREADS threads, cuMemHostRegister per 256 MiB, one thread
//   regN       the same, registered by THREADS threads
//   hugeN      regN on transparent huge pages (madvise MADV_HUGEPAGE)
//   huge1big   huge pages touched by THREADS threads, one cuMemHostRegister of all
//   hugeNraw   huge pages, each 256 MiB registered by THREADS threads with no touch first
//              (the registration faults the pages in)
//   hugeNpop   huge pages populated with madvise(MADV_POPULATE_WRITE) by THREADS threads (the
//              kernel clears them; no user-space write), then registered
//   pageable   no page-locking: cuMemcpy into malloc'd memory (touched first)
// nvcc -O2 -o pin_cost pin_cost.cu -lcuda -lpthread ; ./pin_cost [TOTAL_GIB=8] [THREADS=8] [modes]
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <thread>
#include <vector>
#include "probe.cuh"

static const size_t PIECE = 256ull << 20;
static CUcontext ctx;
static int nthreads = 8;

template <class F>
static void parallel(size_t n, F f) {  // f(i) for i in [0, n), on nthreads threads
  std::vector<std::thread> ts;
  for (int w = 0; w < nthreads; w++)
    ts.emplace_back([&, w] {
      cuCtxSetCurrent(ctx);
      for (size_t i = w; i < n; i += nthreads) f(i);
    });
  for (auto& t : ts) t.join();
}

static void copies(const char* mode, std::vector<char*>& bufs, size_t total, CUdeviceptr dev, double prep, double touch) {
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  double t0 = now_ms();
  size_t piece = total / bufs.size();
  for (size_t i = 0; i < bufs.size(); i++) CK(cuMemcpyDtoHAsync(bufs[i], dev + i * piece, piece, s));
  CK(cuStreamSynchronize(s));
  double d2h = now_ms() - t0;
  t0 = now_ms();
  for (size_t i = 0; i < bufs.size(); i++) CK(cuMemcpyHtoDAsync(dev + i * piece, bufs[i], piece, s));
  CK(cuStreamSynchronize(s));
  double h2d = now_ms() - t0;
  CK(cuStreamDestroy(s));
  printf("%-9s prepare %8.1f ms (touch %7.1f)  D2H %7.1f ms (%5.1f GB/s)  H2D %7.1f ms  ", mode, prep, touch, d2h,
         total / d2h / 1e6, h2d);
  fflush(stdout);
}

int main(int argc, char** argv) {
  double gib = argc > 1 ? atof(argv[1]) : 8;
  if (argc > 2) nthreads = atoi(argv[2]);
  size_t total = (size_t)(gib * (1ull << 30)) / PIECE * PIECE;
  size_t n = total / PIECE;
  auto want = [&](const char* m) {
    if (argc <= 3) return true;
    for (int i = 3; i < argc; i++)
      if (!strcmp(argv[i], m)) return true;
    return false;
  };
  CK(cuInit(0));
  CUdevice d;
  CK(cuDeviceGet(&d, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, d));
  CK(cuCtxSetCurrent(ctx));
  CUdeviceptr dev;
  CK(cuMemAlloc(&dev, total));
  CK(cuMemsetD8(dev, 1, total));
  CK(cuCtxSynchronize());
  printf("%.1f GiB in %zu pieces of 256 MiB, %d threads\n", total / double(1ull << 30), n, nthreads);
  for (int threaded = 0; threaded < 2; threaded++) {
    const char* mode = threaded ? "allocN" : "alloc1";
    if (!want(mode)) continue;
    std::vector<char*> bufs(n);
    double t0 = now_ms();
    if (threaded)
      parallel(n, [&](size_t i) { CK(cuMemHostAlloc((void**)&bufs[i], PIECE, CU_MEMHOSTALLOC_PORTABLE)); });
    else
      for (size_t i = 0; i < n; i++) CK(cuMemHostAlloc((void**)&bufs[i], PIECE, CU_MEMHOSTALLOC_PORTABLE));
    copies(mode, bufs, total, dev, now_ms() - t0, 0);
    t0 = now_ms();
    for (auto b : bufs) CK(cuMemFreeHost(b));
    printf("free %7.1f ms\n", now_ms() - t0);
  }
  const char* regs[] = {"reg1", "regN", "hugeN", "huge1big", "hugeNraw", "hugeNpop"};
  for (int k = 0; k < 6; k++) {
    if (!want(regs[k])) continue;
    double t0 = now_ms();
    char* m = (char*)mmap(0, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) { perror("mmap"); return 1; }
    if (k >= 2) madvise(m, total, MADV_HUGEPAGE);
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    if (k == 5)
      parallel(n, [&](size_t i) {
        if (madvise(m + i * PIECE, PIECE, MADV_POPULATE_WRITE)) memset(m + i * PIECE, 0, PIECE);
      });
    else if (k != 4)
      parallel(n, [&](size_t i) { memset(m + i * PIECE, 0, PIECE); });
    double touch = now_ms() - t0;
    if (k == 3)
      CK(cuMemHostRegister(m, total, CU_MEMHOSTREGISTER_PORTABLE));
    else if (k == 0)
      for (size_t i = 0; i < n; i++) CK(cuMemHostRegister(m + i * PIECE, PIECE, CU_MEMHOSTREGISTER_PORTABLE));
    else
      parallel(n, [&](size_t i) { CK(cuMemHostRegister(m + i * PIECE, PIECE, CU_MEMHOSTREGISTER_PORTABLE)); });
    double prep = now_ms() - t0;
    std::vector<char*> bufs(n);
    for (size_t i = 0; i < n; i++) bufs[i] = m + i * PIECE;
    copies(regs[k], bufs, total, dev, prep, touch);
    t0 = now_ms();
    if (k == 3)
      CK(cuMemHostUnregister(m));
    else
      for (size_t i = 0; i < n; i++) CK(cuMemHostUnregister(m + i * PIECE));
    munmap(m, total);
    printf("free %7.1f ms\n", now_ms() - t0);
  }
  if (want("pageable")) {
    double t0 = now_ms();
    char* m = (char*)malloc(total);
    parallel(n, [&](size_t i) { memset(m + i * PIECE, 0, PIECE); });
    double prep = now_ms() - t0;
    t0 = now_ms();
    CK(cuMemcpyDtoH(m, dev, total));
    double d2h = now_ms() - t0;
    t0 = now_ms();
    CK(cuMemcpyHtoD(dev, m, total));
    double h2d = now_ms() - t0;
    printf("%-9s prepare %8.1f ms (touch %7.1f)  D2H %7.1f ms (%5.1f GB/s)  H2D %7.1f ms\n", "pageable", prep, prep, d2h,
           total / d2h / 1e6, h2d);
    free(m);
  }
  return 0;
}
