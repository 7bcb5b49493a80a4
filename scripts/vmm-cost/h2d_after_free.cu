// What a resume pays right after another process gave its GPU memory back (issue 23: resume
// <= 1.2x a pinned H2D copy): COPY GiB of pinned host memory copied into COPY GiB just
// allocated, (a) right after another process (this program, run again as "hog") wrote BIG GiB
// and exited, (b) the same after QUIET ms of quiet, (c) into a buffer that already existed
// (the pinned-memcpy baseline). Times in ms, median of 3.
// nvcc -O2 -o h2d_after_free h2d_after_free.cu ; ./h2d_after_free [COPY_GIB=8] [BIG_GIB=60] [QUIET_MS=2000]
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <vector>
#include "probe.cuh"

int main(int argc, char** argv) {
  if (argc > 2 && !strcmp(argv[1], "hog")) {  // the other process: take, write, exit
    size_t n = (size_t)(atof(argv[2]) * (1ull << 30));
    void* b;
    CKRT(cudaMalloc(&b, n));
    CKRT(cudaMemset(b, 1, n));
    CKRT(cudaDeviceSynchronize());
    return 0;
  }
  char hog[4096];
  snprintf(hog, sizeof hog, "%s hog %s", argv[0], argc > 2 ? argv[2] : "60");
  size_t copy = (size_t)(atof(argc > 1 ? argv[1] : "8") * (1ull << 30));
  size_t big = (size_t)(atof(argc > 2 ? argv[2] : "60") * (1ull << 30));
  int quiet = argc > 3 ? atoi(argv[3]) : 2000;
  void* host;
  CKRT(cudaMallocHost(&host, copy));
  for (size_t i = 0; i < copy; i += 4096) ((char*)host)[i] = 1;
  std::vector<double> after, later, existing;
  for (int rep = 0; rep < 3; rep++) {
    if (system(hog) != 0) {
      printf("the other process failed\n");
      return 1;
    }
    double t0 = now_ms();
    void* d;
    CKRT(cudaMalloc(&d, copy));
    CKRT(cudaMemcpy(d, host, copy, cudaMemcpyHostToDevice));
    after.push_back(now_ms() - t0);
    t0 = now_ms();
    CKRT(cudaMemcpy(d, host, copy, cudaMemcpyHostToDevice));
    existing.push_back(now_ms() - t0);
    CKRT(cudaFree(d));
    usleep(quiet * 1000);
    t0 = now_ms();
    CKRT(cudaMalloc(&d, copy));
    CKRT(cudaMemcpy(d, host, copy, cudaMemcpyHostToDevice));
    later.push_back(now_ms() - t0);
    CKRT(cudaFree(d));
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  printf("%.1f GiB copied after %.1f GiB were freed: allocate+copy at once %.1f ms, after %d ms %.1f ms, "
         "copy into an existing buffer %.1f ms; at once / existing = %.2f\n",
         copy / double(1ull << 30), big / double(1ull << 30), med(after), quiet, med(later), med(existing),
         med(after) / med(existing));
  return 0;
}
