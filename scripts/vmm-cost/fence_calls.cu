// Which driver calls a move makes still return while a host function holds the device's legacy
// default stream (the fence a move would put in front of kernels no hook sees): each step of a
// compaction, timed, with a watchdog that names the step that does not return in 3 s. With
// an argument N > 0, another thread launches empty kernels on the legacy stream meanwhile (N
// of them before the steps begin: the launch queue fills behind the fence). With a second
// argument "ctx", the copies go through a context of the probe's own on the same device;
// "green": through a green context of the fewest SMs (ctx_cost.cu: 6 MiB against 524);
// "graph": the copy and the fence are one graph (captured on an own stream: the copy, then the
// host function) launched on the legacy stream, so that under the fence only the driver's
// VMM calls remain.
//
//   nvcc -O2 -o fence_calls fence_calls.cu -lcuda -lpthread && ./fence_calls [N] [ctx]
#include <pthread.h>
#include <unistd.h>
#include "watch.cuh"

static volatile int running = 0, released = 0;

static void CUDA_CB hold(void*) {
  running = 1;
  while (!released) usleep(50);
}

__global__ void empty_kernel() {}
static volatile long launched = 0;
static volatile int stop_launcher = 0;
static CUcontext g_ctx;
static void* launch_loop(void*) {
  cuCtxSetCurrent(g_ctx);
  while (!stop_launcher) {
    empty_kernel<<<1, 1, 0, 0>>>();
    launched = launched + 1;
  }
  return 0;
}

#define STEP(name, call)                                           \
  do {                                                             \
    probe_begin(name);                                             \
    CUresult r_ = (call);                                          \
    printf("%-28s rc=%d %.3f ms\n", name, (int)r_, probe_end());   \
    fflush(stdout);                                                \
  } while (0)

int main(int argc, char** argv) {
  long pre = argc > 1 ? atol(argv[1]) : 0;
  int own_ctx = argc > 2 && (argv[2][0] == 'c' || argv[2][0] == 'g');
  int green = argc > 2 && argv[2][0] == 'g' && argv[2][1] == 'r' && argv[2][2] == 'e';
  int graph = argc > 2 && argv[2][0] == 'g' && argv[2][2] == 'a';
  if (graph) own_ctx = 0;
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  g_ctx = ctx;
  CKRT(cudaSetDevice(0));
  empty_kernel<<<1, 1>>>();
  CKRT(cudaDeviceSynchronize());
  probe_watch(3000);
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t sz = 64 << 20;
  CUmemAccessDesc acc = {};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUmemGenericAllocationHandle a, b;
  CUdeviceptr va, tmp;
  CK(cuMemCreate(&a, sz, &prop, 0));
  CK(cuMemAddressReserve(&va, sz, 0, 0, 0));
  CK(cuMemMap(va, sz, 0, a, 0));
  CK(cuMemSetAccess(va, sz, &acc, 1));
  CK(cuMemsetD8_v2(va, 7, sz));
  CK(cuCtxSynchronize());
  CUstream s;
  CUcontext copy_ctx = ctx;
  if (own_ctx) {
    size_t f0, f1, tt;
    CK(cuMemGetInfo_v2(&f0, &tt));
    if (green) {
      CUdevResource sms, part, rest;
      unsigned n = 1;
      CK(cuDeviceGetDevResource(dev, &sms, CU_DEV_RESOURCE_TYPE_SM));
      CK(cuDevSmResourceSplitByCount(&part, &n, &sms, &rest, 0, 1));
      CUdevResourceDesc desc;
      CK(cuDevResourceGenerateDesc(&desc, &part, 1));
      CUgreenCtx gc;
      CK(cuGreenCtxCreate(&gc, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
      CK(cuCtxFromGreenCtx(&copy_ctx, gc));
      CK(cuCtxSetCurrent(copy_ctx));
    } else {
      CUctxCreateParams* none = 0;
      CK(cuCtxCreate(&copy_ctx, none, 0, dev));  // made current
    }
    CK(cuMemGetInfo_v2(&f1, &tt));
    printf("own copy context: %.1f MiB of device memory\n", (f0 - f1) / 1048576.0);
  }
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CK(cuCtxSetCurrent(ctx));
  CUmemGenericAllocationHandle gb = 0;
  CUdeviceptr gtmp = 0;
  double t0 = now_ms();
  if (graph) {
    // The new handle and its temporary mapping first; then [copy, hold] as one launch.
    CK(cuMemCreate(&gb, sz, &prop, 0));
    CK(cuMemAddressReserve(&gtmp, sz, 0, 0, 0));
    CK(cuMemMap(gtmp, sz, 0, gb, 0));
    CK(cuMemSetAccess(gtmp, sz, &acc, 1));
    double tg = now_ms();
    CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    CK(cuMemcpyDtoDAsync_v2(gtmp, va, sz, s));
    CK(cuLaunchHostFunc(s, hold, 0));
    CUgraph g;
    CK(cuStreamEndCapture(s, &g));
    CUgraphExec ge;
    CK(cuGraphInstantiate(&ge, g, 0));
    CK(cuGraphLaunch(ge, CU_STREAM_LEGACY));
    printf("graph captured, made and launched in %.3f ms\n", now_ms() - tg);
  } else {
    CK(cuLaunchHostFunc(CU_STREAM_LEGACY, hold, 0));
  }
  while (!running) usleep(10);
  printf("fence running after %.3f ms\n", now_ms() - t0);
  pthread_t lt;
  if (pre > 0) {
    pthread_create(&lt, 0, launch_loop, 0);
    double t1 = now_ms();
    while (launched < pre && now_ms() - t1 < 2000) usleep(100);
    printf("launcher: %ld launches queued behind the fence in %.1f ms\n", (long)launched, now_ms() - t1);
  }
  if (graph) {
    STEP("cuMemUnmap va", cuMemUnmap(va, sz));
    STEP("cuMemUnmap tmp", cuMemUnmap(gtmp, sz));
    STEP("cuMemMap va", cuMemMap(va, sz, 0, gb, 0));
    STEP("cuMemSetAccess va", cuMemSetAccess(va, sz, &acc, 1));
    STEP("cuMemAddressFree tmp", cuMemAddressFree(gtmp, sz));
    STEP("cuMemRelease a", cuMemRelease(a));
    size_t f, t;
    STEP("cuMemGetInfo", cuMemGetInfo_v2(&f, &t));
    released = 1;
    stop_launcher = 1;
    if (pre > 0) pthread_join(lt, 0);
    printf("launcher: %ld launches in all\n", (long)launched);
    char host[4096];
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH_v2(host, va + sz - sizeof host, sizeof host));
    printf("data %s\n", host[0] == 7 && host[4095] == 7 ? "intact" : "WRONG");
    printf("done\n");
    return 0;
  }
  STEP("cuMemCreate", cuMemCreate(&b, sz, &prop, 0));
  STEP("cuMemAddressReserve", cuMemAddressReserve(&tmp, sz, 0, 0, 0));
  STEP("cuMemMap tmp", cuMemMap(tmp, sz, 0, b, 0));
  STEP("cuMemSetAccess tmp", cuMemSetAccess(tmp, sz, &acc, 1));
  if (own_ctx) CK(cuCtxSetCurrent(copy_ctx));
  STEP("cuMemcpyDtoDAsync own stream", cuMemcpyDtoDAsync_v2(tmp, va, sz, s));
  STEP("cuStreamSynchronize own", cuStreamSynchronize(s));
  if (own_ctx) CK(cuCtxSetCurrent(ctx));
  STEP("cuMemUnmap va", cuMemUnmap(va, sz));
  STEP("cuMemUnmap tmp", cuMemUnmap(tmp, sz));
  STEP("cuMemMap va", cuMemMap(va, sz, 0, b, 0));
  STEP("cuMemSetAccess va", cuMemSetAccess(va, sz, &acc, 1));
  STEP("cuMemAddressFree tmp", cuMemAddressFree(tmp, sz));
  STEP("cuMemRelease a", cuMemRelease(a));
  size_t f, t;
  STEP("cuMemGetInfo", cuMemGetInfo_v2(&f, &t));
  char host[4096];
  if (own_ctx) CK(cuCtxSetCurrent(copy_ctx));
  STEP("cuMemcpyDtoHAsync own", cuMemcpyDtoHAsync_v2(host, va, sizeof host, s));
  STEP("cuStreamSynchronize own 2", cuStreamSynchronize(s));
  if (own_ctx) CK(cuCtxSetCurrent(ctx));
  printf("data %s\n", host[0] == 7 && host[4095] == 7 ? "intact" : "WRONG");
  released = 1;
  stop_launcher = 1;
  if (pre > 0) pthread_join(lt, 0);
  printf("launcher: %ld launches in all\n", (long)launched);
  STEP("cuCtxSynchronize after", cuCtxSynchronize());
  printf("done\n");
  return 0;
}
