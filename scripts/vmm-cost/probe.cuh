// What the probes of this folder share: a monotonic clock in milliseconds and checks that stop
// the probe at the first failed call (driver API: CK, runtime API: CKRT), naming the call.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static inline double now_ms() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

#define CK(x)                                                      \
  do {                                                             \
    CUresult r_ = (x);                                             \
    if (r_) {                                                      \
      printf("%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)r_); \
      exit(1);                                                     \
    }                                                              \
  } while (0)

#define CKRT(x)                                                                   \
  do {                                                                            \
    cudaError_t r_ = (x);                                                         \
    if (r_) {                                                                     \
      printf("%s:%d %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(r_)); \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)
