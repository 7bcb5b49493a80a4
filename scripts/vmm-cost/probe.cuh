// What the probes of this folder share: a monotonic clock in milliseconds and checks that stop
// the probe at the first failed call (driver API: CK, runtime API: CKRT), naming the call.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

// Properties of pinned device memory of `dev` exportable as a POSIX descriptor (what expseg
// creates), and read-write access for `dev`.
static inline CUmemAllocationProp pinned_prop(int dev) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}
static inline CUmemAccessDesc rw_access(int dev) {
  CUmemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = dev;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return a;
}

// A hold of a stream by one batch of stream memory operations, [write *reached = g; wait until
// *release >= g]: nothing of another thread falls between the two; the host releases it by
// writing g at `release` (mapped page-locked host memory).
static inline void hold_ops(CUstreamBatchMemOpParams ops[2], CUdeviceptr reached, CUdeviceptr release, unsigned g) {
  memset(ops, 0, 2 * sizeof *ops);
  ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  ops[0].writeValue.address = reached;
  ops[0].writeValue.value = g;
  ops[0].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  ops[1].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
  ops[1].waitValue.address = release;
  ops[1].waitValue.value = g;
  ops[1].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
}
