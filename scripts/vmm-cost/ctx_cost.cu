// What a second context on a device costs in device memory, and how much of that its limits
// give back (a context used only for copies runs no kernel): made, then stack, printf FIFO and
// heap set to their least; then a green context with the fewest SMs, if the driver has them.
//
//   nvcc -O2 -o ctx_cost ctx_cost.cu -lcuda && ./ctx_cost
#include "probe.cuh"

static double free_mib() {
  size_t f, t;
  CK(cuMemGetInfo_v2(&f, &t));
  return f / 1048576.0;
}

int main() {
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext primary;
  CK(cuDevicePrimaryCtxRetain(&primary, dev));
  CK(cuCtxSetCurrent(primary));
  double f0 = free_mib();
  CUcontext c;
  CUctxCreateParams* none = 0;
  CK(cuCtxCreate(&c, none, 0, dev));
  double f1 = free_mib();
  printf("context: %.1f MiB\n", f0 - f1);
  CUresult r1 = cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 0);
  CUresult r2 = cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE, 4096);
  CUresult r3 = cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 0);
  double f2 = free_mib();
  printf("limits set (rc %d %d %d): %.1f MiB\n", r1, r2, r3, f0 - f2);
  CK(cuCtxDestroy(c));
  CK(cuCtxSetCurrent(primary));
  double f3 = free_mib();
  // Green context: a partition of the fewest SMs.
  CUdevResource sms;
  CUresult g = cuDeviceGetDevResource(dev, &sms, CU_DEV_RESOURCE_TYPE_SM);
  if (g) {
    printf("no green contexts: %d\n", g);
    return 0;
  }
  CUdevResource part;
  unsigned n = 1;
  CUdevResource rest;
  CK(cuDevSmResourceSplitByCount(&part, &n, &sms, &rest, 0, 1));
  CUdevResourceDesc desc;
  CK(cuDevResourceGenerateDesc(&desc, &part, 1));
  CUgreenCtx gc;
  CK(cuGreenCtxCreate(&gc, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
  double f4 = free_mib();
  printf("green context (%u SMs): %.1f MiB\n", part.sm.smCount, f3 - f4);
  return 0;
}
