// Can a move of live pages hold a non-blocking stream that another thread keeps busy? A worker
// thread adds 1 to every int of a VMM buffer on a non-blocking stream of its own, as fast as it
// can launch (the launch queue fills and the worker waits inside the driver, as a GPU-bound
// PyTorch thread does), while the main thread moves the buffer again and again (copy to a new
// handle, unmap, map the new handle at the same address, release the old one). At the end
// every int must equal the number of additions launched.
//
//   none:   wait for the context, copy, remap (no hold)
//   legacy: the landed design: the copy and a host function holding the legacy default stream
//           in one graph (the worker's non-blocking stream is not held)
//   hold:   the worker's stream is held by one stream memory operation batch queued on it, [write
//           reached = g; wait until release >= g] (one call: nothing of another thread falls
//           between the two), and the graph on the legacy stream first waits for reached >= g
//           (a batch memory operation node), then copies, then runs the host function; the
//           flags live in mapped page-locked host memory, release is written by the host
//
// With EXTRA > 0, that many idle non-blocking streams are held too (PyTorch makes a pool of
// them at the first torch.cuda.Stream()), each by its own batch after the worker's stream's
// (hold), or all of them after the graph's launch (hold_late: the graph first waits for them).
// A watchdog ends the probe with HANG and the step if a call does not return in 5 s.
//
// H100, driver 580.159.04, 2026-11-25, 64 MiB moved 20-100 times: legacy and none end in an
// illegal memory access; hold keeps every addition (100/100 moves, a worker flooding its
// stream). With idle streams held too, under the default 8 hardware connections: 4 exact, 16
// HANG (queueing an idle stream's hold), 28, 32 and 96 HANG (waiting for the hold, also with
// hold_late); with CUDA_DEVICE_MAX_CONNECTIONS=32: 4, 16 and 28 exact. Streams share hardware
// queues, and a held stream's wait stops the writes and copies queued behind it on its queue.
// PyTorch's first torch.cuda.Stream() makes 128 non-blocking streams on the device: more than
// any setting of connections (at most 32) gives queues. docs/failed-approaches.md.
//
//   nvcc -O2 -o stream_hold stream_hold.cu -lcuda -lpthread && ./stream_hold MODE [MOVES] [MIB] [EXTRA]
#include <pthread.h>
#include <string.h>
#include <unistd.h>
#include "watch.cuh"

__global__ void add1(int* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] += 1;
}

static CUcontext g_ctx;
static CUstream g_side;
static CUdeviceptr g_va;
static size_t g_n;
static volatile long launched = 0;
static volatile int stop_worker = 0;
static volatile int worker_err = 0;
static void* worker(void*) {
  cuCtxSetCurrent(g_ctx);
  while (!stop_worker) {
    add1<<<264, 512, 0, (cudaStream_t)g_side>>>((int*)g_va, g_n);
    cudaError_t e = cudaGetLastError();
    if (e) {
      worker_err = e;
      break;
    }
    launched = launched + 1;
  }
  return 0;
}

static void note_launched(void) { printf(" (worker launched %ld)", (long)launched); }
#define STEP(name, call) \
  do {                   \
    probe_begin(name);   \
    CK(call);            \
    probe_end();         \
  } while (0)

static volatile int running = 0, released = 0;
static void CUDA_CB hold(void*) {
  running = 1;
  while (!released) usleep(20);
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "hold";
  int moves = argc > 2 ? atoi(argv[2]) : 50;
  size_t sz = (size_t)(argc > 3 ? atoi(argv[3]) : 64) << 20;
  int extra = argc > 4 ? atoi(argv[4]) : 0;
  int late = !strcmp(mode, "hold_late");
  int m_none = !strcmp(mode, "none"), m_legacy = !strcmp(mode, "legacy"), m_hold = !strcmp(mode, "hold") || late;
  if (!m_none && !m_legacy && !m_hold) {
    printf("mode: none | legacy | hold | hold_late\n");
    return 2;
  }
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&g_ctx, dev));
  CK(cuCtxSetCurrent(g_ctx));
  CKRT(cudaSetDevice(0));
  int memops = -1;
  cuDeviceGetAttribute(&memops, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, dev);
  printf("mode %s, %d moves of %zu MiB; stream wait value NOR attribute %d\n", mode, moves, sz >> 20, memops);
  probe_hang_note = note_launched;
  probe_watch(5000);
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc acc = {};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUmemGenericAllocationHandle a;
  CK(cuMemCreate(&a, sz, &prop, 0));
  CK(cuMemAddressReserve(&g_va, sz, 0, 0, 0));
  CK(cuMemMap(g_va, sz, 0, a, 0));
  CK(cuMemSetAccess(g_va, sz, &acc, 1));
  CK(cuMemsetD8_v2(g_va, 0, sz));
  CK(cuCtxSynchronize());
  g_n = sz / sizeof(int);
  CK(cuStreamCreate(&g_side, CU_STREAM_NON_BLOCKING));
  CUstream own;
  CK(cuStreamCreate(&own, CU_STREAM_NON_BLOCKING));
  CUstream* idle = (CUstream*)calloc(extra + 1, sizeof(CUstream));
  for (int i = 0; i < extra; i++) CK(cuStreamCreate(&idle[i], CU_STREAM_NON_BLOCKING));
  volatile unsigned* flags = 0;  // [0] reached, [1] release
  CUdeviceptr dflags = 0;
  CK(cuMemHostAlloc((void**)&flags, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  CK(cuMemHostGetDevicePointer(&dflags, (void*)flags, 0));
  flags[0] = flags[1] = 0;
  pthread_t wt;
  pthread_create(&wt, 0, worker, 0);
  while (launched < 100) usleep(100);
  double t_build = 0, t_sync = 0, t_hold = 0, t_vmm = 0, t_total = 0;
  int capture_ok = 1;
  for (unsigned g = 1; g <= (unsigned)moves && !worker_err; g++) {
    double t0 = now_ms();
    CUmemGenericAllocationHandle b;
    CUdeviceptr tmp;
    STEP("create", cuMemCreate(&b, sz, &prop, 0));
    STEP("reserve tmp", cuMemAddressReserve(&tmp, sz, 0, 0, 0));
    STEP("map tmp", cuMemMap(tmp, sz, 0, b, 0));
    STEP("access tmp", cuMemSetAccess(tmp, sz, &acc, 1));
    CUgraphExec ge = 0;
    running = 0;
    released = 0;
    double tb = now_ms();
    if (m_legacy || m_hold) {
      CK(cuStreamBeginCapture(own, CU_STREAM_CAPTURE_MODE_RELAXED));
      if (m_hold) {
        CUstreamBatchMemOpParams w[129];
        memset(w, 0, sizeof w);
        int nw = 1 + (extra < 128 ? extra : 128);
        for (int k = 0; k < nw; k++) {
          w[k].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
          w[k].waitValue.address = k == 0 ? dflags : dflags + 4 * (k + 1);
          w[k].waitValue.value = g;
          w[k].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
        }
        CUresult r = cuStreamBatchMemOp(own, nw, w, 0);
        if (r) {
          printf("capturing a batch memory operation: rc=%d\n", (int)r);
          capture_ok = 0;
        }
      }
      CK(cuMemcpyDtoDAsync_v2(tmp, g_va, sz, own));
      CK(cuLaunchHostFunc(own, hold, 0));
      CUgraph gr;
      CK(cuStreamEndCapture(own, &gr));
      CK(cuGraphInstantiate(&ge, gr, 0));
      CK(cuGraphDestroy(gr));
      if (!capture_ok) return 1;
    }
    double ts = now_ms();
    t_build += ts - tb;
    STEP("ctx synchronize", cuCtxSynchronize());
    double th = now_ms();
    t_sync += th - ts;
    if (m_none) {
      STEP("copy", cuMemcpyDtoDAsync_v2(tmp, g_va, sz, own));
      STEP("copy wait", cuStreamSynchronize(own));
    } else {
      if (m_hold) {
        CUstreamBatchMemOpParams ops[2];
        hold_ops(ops, dflags, dflags + 4, g);
        if (!late) STEP("hold the side stream", cuStreamBatchMemOp(g_side, 2, ops, 0));
        if (late) STEP("graph launch", cuGraphLaunch(ge, CU_STREAM_LEGACY));
        for (int k = 0; k < extra && k < 128; k++) {
          ops[0].writeValue.address = dflags + 4 * (k + 2);
          STEP("hold an idle stream", cuStreamBatchMemOp(idle[k], 2, ops, 0));
        }
        if (late) {
          ops[0].writeValue.address = dflags;
          STEP("hold the side stream", cuStreamBatchMemOp(g_side, 2, ops, 0));
        }
      }
      if (!late) STEP("graph launch", cuGraphLaunch(ge, CU_STREAM_LEGACY));
      probe_begin("wait for the hold");
      while (!running) usleep(10);
      probe_end();
    }
    double tv = now_ms();
    t_hold += tv - th;
    STEP("unmap va", cuMemUnmap(g_va, sz));
    STEP("unmap tmp", cuMemUnmap(tmp, sz));
    STEP("map va", cuMemMap(g_va, sz, 0, b, 0));
    STEP("access va", cuMemSetAccess(g_va, sz, &acc, 1));
    STEP("free tmp", cuMemAddressFree(tmp, sz));
    STEP("release old", cuMemRelease(a));
    a = b;
    t_vmm += now_ms() - tv;
    if (m_hold) {
      flags[1] = g;
      __sync_synchronize();
    }
    released = 1;
    if (ge) CK(cuGraphExecDestroy(ge));
    t_total += now_ms() - t0;
  }
  stop_worker = 1;
  pthread_join(wt, 0);
  probe_begin("final synchronize");
  CUresult fin = cuCtxSynchronize();
  probe_end();
  long bad = -1;
  if (fin == 0 && !worker_err) {
    int* host = (int*)malloc(sz);
    CK(cuMemcpyDtoH_v2(host, g_va, sz));
    bad = 0;
    for (size_t i = 0; i < g_n; i++) bad += host[i] != (int)launched;
  }
  printf("{\"mode\": \"%s\", \"moves\": %d, \"launched\": %ld, \"worker_err\": %d, \"final_sync\": %d, \"wrong_ints\": %ld, "
         "\"ms_per_move\": %.3f, \"build_ms\": %.3f, \"sync_ms\": %.3f, \"hold_ms\": %.3f, \"vmm_ms\": %.3f}\n",
         mode, moves, (long)launched, worker_err, (int)fin, bad, t_total / moves, t_build / moves, t_sync / moves,
         t_hold / moves, t_vmm / moves);
  return (fin == 0 && !worker_err && bad == 0) ? 0 : 1;
}
