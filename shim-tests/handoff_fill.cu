// The trainer side of the handoff workload (scripts/bench_torch.py, workload handoff) for
// plain CUDA programs: the cudaMalloc path. Each line on stdin names a byte count: the program
// takes that much in cudaMalloc allocations of 64-600 MiB, writes them, frees them all, and
// then, with cudaFree returned, writes one line to the descriptor named by HANDOFF_FD (the
// second process reads it and at once allocates) and prints EMPTIED. A failed allocation
// prints FILLFAIL instead (the memory the second process held was not back yet).
// nvcc -O2 -cudart shared -o handoff_fill handoff_fill.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <vector>

int main() {
  setvbuf(stdout, NULL, _IONBF, 0);
  const char* fd_text = getenv("HANDOFF_FD");
  if (!fd_text) {
    fprintf(stderr, "HANDOFF_FD is not set\n");
    return 2;
  }
  int fd = atoi(fd_text);
  if (cudaFree(0) != cudaSuccess) {
    fprintf(stderr, "no CUDA device\n");
    return 2;
  }
  printf("READY\n");
  unsigned long long seed = 5;
  char line[64];
  while (fgets(line, sizeof line, stdin)) {
    size_t want = strtoull(line, NULL, 10), got = 0;
    std::vector<void*> ps;
    bool ok = true;
    while (got < want) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      size_t n = (64ull << 20) + (seed >> 33) % (536ull << 20);
      if (n > want - got) n = want - got;
      void* p;
      if (cudaMalloc(&p, n) != cudaSuccess) {
        cudaGetLastError();
        ok = false;
        break;
      }
      cudaMemset(p, 1, n);
      ps.push_back(p);
      got += n;
    }
    cudaDeviceSynchronize();
    for (void* p : ps) cudaFree(p);
    if (write(fd, "emptied\n", 8) != 8) return 3;
    printf(ok ? "EMPTIED\n" : "FILLFAIL\n");
  }
  return 0;
}
