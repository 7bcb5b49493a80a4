// Two GPUs: can a move of device 0's live pages hold device 1's legacy default stream too, so
// that kernels another thread queues on device 1 that write those pages through peer access
// (PyTorch's cross-device copies run on the source device's stream) wait until the pages are
// back? A thread per device launches one-thread kernels on its legacy stream, each adding 1 to
// its own word of a 64 MiB page on device 0 (device 1 through peer access). The move is
// fence_calls.cu's graph mode (the copy and a hold on device 0's legacy stream, one graph),
// then unmap, map of the new handle, access for both devices, release of the old one, each
// step timed under a watchdog that names a step that does not return in 3 s. After the holds
// are released, each word must equal its thread's launches: a kernel that ran on the old
// handle after the copy loses its addition; one that ran while the page was unmapped faults.
//
//   ./fence_peer peer   holds device 1's legacy stream too (running before the copy starts)
//   ./fence_peer own    device 0's hold only, after waiting for device 1's queued work (what
//                       expseg does until this shows the other safe)
//
//   nvcc -O2 -o fence_peer fence_peer.cu -lcuda -lpthread && ./fence_peer peer
#include <string.h>
#include "watch.cuh"

struct Hold {
  volatile int running, released;
};
static void CUDA_CB hold_fn(void* p) {
  Hold* h = (Hold*)p;
  h->running = 1;
  while (!h->released) usleep(50);
}

__global__ void bump(int* p) { *p += 1; }

static CUcontext ctx[2];
static int* word[2];
static volatile long launched[2];
static volatile int stop_launchers = 0;
static void* launch_loop(void* arg) {
  int d = (int)(long)arg;
  cuCtxSetCurrent(ctx[d]);
  while (!stop_launchers) {
    bump<<<1, 1, 0, 0>>>(word[d]);
    if (cudaGetLastError() != cudaSuccess) break;
    launched[d] = launched[d] + 1;
  }
  return 0;
}

#define STEP(name, call)                                         \
  do {                                                           \
    probe_begin(name);                                           \
    CUresult r_ = (call);                                        \
    printf("%-28s rc=%d %.3f ms\n", name, (int)r_, probe_end()); \
    fflush(stdout);                                              \
  } while (0)

int main(int argc, char** argv) {
  int peer_hold = !(argc > 1 && !strcmp(argv[1], "own"));
  CK(cuInit(0));
  int n = 0;
  CK(cuDeviceGetCount(&n));
  if (n < 2) {
    printf("SKIP: %d device(s); this probe needs two\n", n);
    return 0;
  }
  CUdevice dev[2];
  for (int d = 0; d < 2; d++) {
    CK(cuDeviceGet(&dev[d], d));
    CK(cuDevicePrimaryCtxRetain(&ctx[d], dev[d]));
  }
  int can = 0;
  CK(cuDeviceCanAccessPeer(&can, dev[1], dev[0]));
  if (!can) {
    printf("SKIP: device 1 cannot access device 0's memory\n");
    return 0;
  }
  CK(cuCtxSetCurrent(ctx[1]));
  CK(cuCtxEnablePeerAccess(ctx[0], 0));
  CK(cuCtxSetCurrent(ctx[0]));
  CK(cuCtxEnablePeerAccess(ctx[1], 0));
  CKRT(cudaSetDevice(0));
  probe_watch(3000);

  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t sz = 64 << 20;
  CUmemAccessDesc both[2] = {};
  for (int d = 0; d < 2; d++) {
    both[d].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    both[d].location.id = d;
    both[d].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  CUmemGenericAllocationHandle a, b;
  CUdeviceptr va, tmp;
  CK(cuMemCreate(&a, sz, &prop, 0));
  CK(cuMemAddressReserve(&va, sz, 0, 0, 0));
  CK(cuMemMap(va, sz, 0, a, 0));
  CK(cuMemSetAccess(va, sz, both, 2));
  CK(cuMemsetD8_v2(va, 0, sz));
  CK(cuCtxSynchronize());
  word[0] = (int*)va;
  word[1] = (int*)(va + 4096);

  pthread_t lt[2];
  for (long d = 0; d < 2; d++) pthread_create(&lt[d], 0, launch_loop, (void*)d);
  usleep(200 * 1000);
  printf("mode %s; launches before the move: %ld on device 0, %ld on device 1\n",
         peer_hold ? "peer (both legacy streams held)" : "own (device 0 held, device 1 waited for)",
         (long)launched[0], (long)launched[1]);

  // The new handle and its temporary mapping (device 0's access only, as expseg maps it).
  CK(cuMemCreate(&b, sz, &prop, 0));
  CK(cuMemAddressReserve(&tmp, sz, 0, 0, 0));
  CK(cuMemMap(tmp, sz, 0, b, 0));
  CK(cuMemSetAccess(tmp, sz, both, 1));
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

  Hold h0 = {0, 0}, h1 = {0, 0};
  double t0 = now_ms();
  if (peer_hold) {
    // Device 1's stream first: once its hold runs, none of its kernels is left to write.
    CK(cuCtxSetCurrent(ctx[1]));
    STEP("hold device 1 (launch)", cuLaunchHostFunc(CU_STREAM_LEGACY, hold_fn, &h1));
    probe_begin("hold device 1 running");
    while (!h1.running) usleep(10);
    printf("%-28s %.3f ms\n", "hold device 1 running", probe_end());
    CK(cuCtxSetCurrent(ctx[0]));
  } else {
    CK(cuCtxSetCurrent(ctx[1]));
    STEP("device 1 synchronize", cuCtxSynchronize());
    CK(cuCtxSetCurrent(ctx[0]));
  }
  CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
  CK(cuMemcpyDtoDAsync_v2(tmp, va, sz, s));
  CK(cuLaunchHostFunc(s, hold_fn, &h0));
  CUgraph g;
  CK(cuStreamEndCapture(s, &g));
  CUgraphExec ge;
  CK(cuGraphInstantiate(&ge, g, 0));
  STEP("copy+hold device 0 (launch)", cuGraphLaunch(ge, CU_STREAM_LEGACY));
  probe_begin("hold device 0 running");
  while (!h0.running) usleep(10);
  printf("%-28s %.3f ms\n", "hold device 0 running", probe_end());
  // Some time for device 1's thread to queue (or, unheld, run) kernels on the old handle.
  usleep(20 * 1000);
  STEP("cuMemUnmap va", cuMemUnmap(va, sz));
  STEP("cuMemUnmap tmp", cuMemUnmap(tmp, sz));
  STEP("cuMemMap va", cuMemMap(va, sz, 0, b, 0));
  STEP("cuMemSetAccess va (both)", cuMemSetAccess(va, sz, both, 2));
  STEP("cuMemAddressFree tmp", cuMemAddressFree(tmp, sz));
  STEP("cuMemRelease a", cuMemRelease(a));
  printf("move under the holds took %.3f ms\n", now_ms() - t0);
  h0.released = 1;
  h1.released = 1;
  usleep(100 * 1000);
  stop_launchers = 1;
  for (int d = 0; d < 2; d++) pthread_join(lt[d], 0);
  int got[2] = {0, 0};
  for (int d = 0; d < 2; d++) {
    CK(cuCtxSetCurrent(ctx[d]));
    probe_begin("synchronize after");
    CUresult r = cuCtxSynchronize();
    probe_end();
    if (r) {
      printf("device %d: synchronize -> %d (a kernel met the page while it was away)\n", d, (int)r);
      return 1;
    }
  }
  CK(cuCtxSetCurrent(ctx[0]));
  CK(cuMemcpyDtoH_v2(&got[0], (CUdeviceptr)word[0], sizeof(int)));
  CK(cuMemcpyDtoH_v2(&got[1], (CUdeviceptr)word[1], sizeof(int)));
  int ok = got[0] == launched[0] && got[1] == launched[1];
  printf("device 0 word %d of %ld launches, device 1 word %d of %ld launches: %s\n", got[0],
         (long)launched[0], got[1], (long)launched[1], ok ? "intact" : "LOST");
  return ok ? 0 : 2;
}
