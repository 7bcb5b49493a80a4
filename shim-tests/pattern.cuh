// The data pattern the GPU tests write and check: word i of a buffer holds a hash of i mixed
// with a seed, so a misplaced, stale or foreign page is caught wherever it lands.
#pragma once
#include <stdint.h>

__global__ void fill_k(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (uint32_t)(i * 2654435761u) ^ seed;
}

// Adds the number of words of p[0..n) that do not hold the pattern of `seed` to *bad.
__global__ void verify_k(const uint32_t* p, size_t n, uint32_t seed, unsigned long long* bad) {
  unsigned long long b = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    b += p[i] != ((uint32_t)(i * 2654435761u) ^ seed);
  if (b) atomicAdd(bad, b);
}
