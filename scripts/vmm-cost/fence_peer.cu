// Two GPUs: can a move of device 0's live pages also hold device 1's legacy default stream, so
// that kernels another thread queues on device 1 that write those pages through peer access
// (PyTorch's cross-device copies run on the source device's stream) wait until the pages are
// back? And without a deadlock when the two devices' streams wait on each other's events (as
// PyTorch's copies between devices make them)?
//
// Two launcher threads, one per device, launch one-thread kernels on their device's legacy
// stream, each adding 1 to its own int of a 64 MiB page on device 0 (device 1's through peer
// access). With "xdep", device 1's thread also makes the streams wait on each other after each
// kernel (an event on device 1 that device 0's stream waits for, a kernel on device 0 adding
// to a third int, an event there that device 1's stream waits for). The main thread moves the
// page ROUNDS times: a new handle, the copy and a host function holding device 0's legacy
// stream as one graph (expseg's fence), then unmap, map of the new handle, access for both
// devices, release of the old one. At the end each int must equal its launches: a kernel that
// ran on the old handle after the copy loses its addition; one that ran while the page was
// unmapped faults (the final synchronize says so).
//
//   own     device 1 waited for (context synchronize), not held: what expseg does today
//   host    device 1's legacy stream held by a host function, running before the graph launch
//   memop   held by one batch of stream memory operations [write reached; wait for release]
//   lib     what expseg does with EXPSEG_PEER_HOLD=1 (src/gpu/fence.rs): memop, but a hold that
//           does not start in 200 ms is let go, so is one while device 0's fence does not run
//           in 200 ms, and a watchdog thread lets it go 400 ms after it was queued unless the
//           fence runs (the launch itself may block behind it); the move is always made.
//           Counts the rounds whose hold was kept through the move and each way of letting go;
//           additions lost in let-go rounds are what the hold is for, and are printed.
//
// Order in host and memop: wait for device 1, then device 0 (no synchronize after a hold: with
// xdep it would never return), hold device 1, launch the graph. Each hold that does not start
// within 500 ms aborts the round: every hold is released, the move is not made (the page
// stays where it is, the copy is thrown away), and the round is counted as aborted. Calls
// that do not return within 5 s end the probe with HANG and the step.
//
//   nvcc -O2 -o fence_peer fence_peer.cu -lcuda -lpthread && ./fence_peer MODE [ROUNDS] [xdep]
#include <string.h>
#include "watch.cuh"

struct Hold {
  volatile int running, released;
};
static void CUDA_CB hold_fn(void* p) {
  Hold* h = (Hold*)p;
  h->running = 1;
  while (!h->released) usleep(20);
}

__global__ void bump(int* p) { *p += 1; }

static CUcontext ctx[2];
static int* word[3];
static volatile long launched[3];
static volatile int stop_launchers = 0, launch_err = 0, xdep = 0;
static void* launch_loop(void* arg) {
  int d = (int)(long)arg;
  cuCtxSetCurrent(ctx[d]);
  cudaEvent_t ev[2];
  if (d == 1 && xdep) {
    for (int k = 0; k < 2; k++) {
      cuCtxSetCurrent(ctx[k]);
      cudaEventCreateWithFlags(&ev[k], cudaEventDisableTiming);
    }
    cuCtxSetCurrent(ctx[1]);
  }
  while (!stop_launchers) {
    bump<<<1, 1, 0, 0>>>(word[d]);
    if (cudaGetLastError() != cudaSuccess) {
      launch_err = 1;
      break;
    }
    launched[d] = launched[d] + 1;
    if (d == 1 && xdep) {
      cudaEventRecord(ev[1], 0);
      cuCtxSetCurrent(ctx[0]);
      cudaStreamWaitEvent(0, ev[1], 0);
      bump<<<1, 1, 0, 0>>>(word[2]);
      launched[2] = launched[2] + 1;
      cudaEventRecord(ev[0], 0);
      cuCtxSetCurrent(ctx[1]);
      cudaStreamWaitEvent(0, ev[0], 0);
    }
  }
  return 0;
}

// The lib mode's watchdog: armed with a round's generation and deadline, it releases the
// peer's hold at the deadline unless that round's own fence runs.
static volatile unsigned wd_g = 0, wd_fired_g = 0;
static volatile double wd_deadline = 0;
static Hold* volatile wd_h0 = 0;
static volatile unsigned* wd_release = 0;
static void* lib_watchdog(void*) {
  while (!stop_launchers) {
    unsigned g = wd_g;
    if (g && now_ms() > wd_deadline) {
      if (!wd_h0->running) {
        *wd_release = g;
        __sync_synchronize();
        wd_fired_g = g;
      }
      __sync_bool_compare_and_swap(&wd_g, g, 0);
    }
    usleep(50);
  }
  return 0;
}

static void note(void) {
  printf(" (launched %ld %ld %ld)", (long)launched[0], (long)launched[1], (long)launched[2]);
}

#define STEP(name, call) \
  do {                   \
    probe_begin(name);   \
    CK(call);            \
    probe_end();         \
  } while (0)

// Wait up to `ms` for `*flag == want`: the milliseconds waited, or -1 on timeout.
static double wait_for(volatile unsigned* flag, unsigned want, double ms) {
  double t0 = now_ms();
  while (*flag != want) {
    if (now_ms() - t0 > ms) return -1;
    usleep(10);
  }
  return now_ms() - t0;
}
static double wait_running(Hold* h, double ms) {
  double t0 = now_ms();
  while (!h->running) {
    if (now_ms() - t0 > ms) return -1;
    usleep(10);
  }
  return now_ms() - t0;
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "memop";
  int rounds = argc > 2 ? atoi(argv[2]) : 20;
  xdep = argc > 3 && !strcmp(argv[3], "xdep");
  int m_own = !strcmp(mode, "own"), m_host = !strcmp(mode, "host"), m_memop = !strcmp(mode, "memop");
  int m_lib = !strcmp(mode, "lib");
  if (!m_own && !m_host && !m_memop && !m_lib) {
    printf("mode: own | host | memop | lib\n");
    return 2;
  }
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
  CKRT(cudaFree(0));
  CK(cuCtxSetCurrent(ctx[0]));
  CK(cuCtxEnablePeerAccess(ctx[1], 0));
  CKRT(cudaSetDevice(0));
  probe_hang_note = note;
  probe_watch(5000);

  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t sz = 64 << 20;
  CUmemAccessDesc both[2] = {};
  for (int d = 0; d < 2; d++) {
    both[d].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    both[d].location.id = d;
    both[d].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  CUmemGenericAllocationHandle a;
  CUdeviceptr va;
  CK(cuMemCreate(&a, sz, &prop, 0));
  CK(cuMemAddressReserve(&va, sz, 0, 0, 0));
  CK(cuMemMap(va, sz, 0, a, 0));
  CK(cuMemSetAccess(va, sz, both, 2));
  CK(cuMemsetD8_v2(va, 0, sz));
  CK(cuCtxSynchronize());
  for (int k = 0; k < 3; k++) word[k] = (int*)(va + 4096 * k);
  volatile unsigned* flags = 0;  // [0] reached (device 1's hold), [1] release
  CUdeviceptr dflags = 0;
  CK(cuMemHostAlloc((void**)&flags, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  CK(cuMemHostGetDevicePointer(&dflags, (void*)flags, 0));
  flags[0] = flags[1] = 0;
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

  pthread_t lt[2];
  for (long d = 0; d < 2; d++) pthread_create(&lt[d], 0, launch_loop, (void*)d);
  usleep(100 * 1000);
  printf("mode %s%s, %d rounds; launches before: %ld %ld %ld\n", mode, xdep ? " xdep" : "", rounds,
         (long)launched[0], (long)launched[1], (long)launched[2]);
  fflush(stdout);

  Hold* h0 = (Hold*)calloc(rounds + 1, sizeof(Hold));
  Hold* h1 = (Hold*)calloc(rounds + 1, sizeof(Hold));
  int moved = 0, aborted = 0, kept = 0, let_go_start = 0, let_go_fence = 0, let_go_watchdog = 0;
  if (m_lib) {
    wd_release = &flags[1];
    pthread_t wt;
    pthread_create(&wt, 0, lib_watchdog, 0);
  }
  double worst1 = 0, worst0 = 0, total_ms = 0;
  for (unsigned g = 1; g <= (unsigned)rounds && !launch_err; g++) {
    double t0 = now_ms();
    CUmemGenericAllocationHandle b;
    CUdeviceptr tmp;
    STEP("create", cuMemCreate(&b, sz, &prop, 0));
    STEP("reserve tmp", cuMemAddressReserve(&tmp, sz, 0, 0, 0));
    STEP("map tmp", cuMemMap(tmp, sz, 0, b, 0));
    STEP("access tmp", cuMemSetAccess(tmp, sz, both, 1));
    CUgraphExec ge;
    CUgraph gr;
    CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    CK(cuMemcpyDtoDAsync_v2(tmp, va, sz, s));
    CK(cuLaunchHostFunc(s, hold_fn, &h0[g]));
    CK(cuStreamEndCapture(s, &gr));
    CK(cuGraphInstantiate(&ge, gr, 0));
    CK(cuGraphDestroy(gr));
    // Wait for device 1, then device 0 (as expseg: wait_for_peers, then copy_and_hold's).
    CK(cuCtxSetCurrent(ctx[1]));
    STEP("synchronize device 1", cuCtxSynchronize());
    CK(cuCtxSetCurrent(ctx[0]));
    STEP("synchronize device 0", cuCtxSynchronize());
    int ok = 1;
    if (m_lib) {
      CK(cuCtxSetCurrent(ctx[1]));
      CUstreamBatchMemOpParams ops[2];
      hold_ops(ops, dflags, dflags + 4, g);
      STEP("hold device 1", cuStreamBatchMemOp(CU_STREAM_LEGACY, 2, ops, 0));
      double w = wait_for(&flags[0], g, 200);
      CK(cuCtxSetCurrent(ctx[0]));
      int peer_kept = w >= 0;
      if (!peer_kept) {
        flags[1] = g;
        let_go_start++;
      }
      if (w > worst1) worst1 = w;
      wd_h0 = &h0[g];
      wd_deadline = now_ms() + 400;
      __sync_synchronize();
      wd_g = g;
      STEP("graph launch", cuGraphLaunch(ge, CU_STREAM_LEGACY));
      if (peer_kept && wait_running(&h0[g], 200) < 0) {
        flags[1] = g;
        peer_kept = 0;
        let_go_fence++;
      }
      probe_begin("own fence (peer let go)");
      double w0 = wait_running(&h0[g], 1e9);
      probe_end();
      if (w0 > worst0) worst0 = w0;
      __sync_bool_compare_and_swap(&wd_g, g, 0);
      if (peer_kept && wd_fired_g == g) {
        peer_kept = 0;
        let_go_watchdog++;
      }
      kept += peer_kept;
    } else if (!m_own) {
      CK(cuCtxSetCurrent(ctx[1]));
      double w;
      if (m_host) {
        STEP("hold device 1", cuLaunchHostFunc(CU_STREAM_LEGACY, hold_fn, &h1[g]));
        w = wait_running(&h1[g], 500);
      } else {
        CUstreamBatchMemOpParams ops[2];
        hold_ops(ops, dflags, dflags + 4, g);
        STEP("hold device 1", cuStreamBatchMemOp(CU_STREAM_LEGACY, 2, ops, 0));
        w = wait_for(&flags[0], g, 500);
      }
      CK(cuCtxSetCurrent(ctx[0]));
      if (w < 0) ok = 0;
      if (w > worst1) worst1 = w;
    }
    if (!m_lib) STEP("graph launch", cuGraphLaunch(ge, CU_STREAM_LEGACY));
    if (ok && !m_lib) {
      double w = wait_running(&h0[g], 500);
      if (w < 0) ok = 0;
      if (w > worst0) worst0 = w;
    }
    if (ok) {
      STEP("unmap va", cuMemUnmap(va, sz));
      STEP("unmap tmp", cuMemUnmap(tmp, sz));
      STEP("map va", cuMemMap(va, sz, 0, b, 0));
      STEP("access va (both)", cuMemSetAccess(va, sz, both, 2));
      STEP("free tmp", cuMemAddressFree(tmp, sz));
      STEP("release old", cuMemRelease(a));
      a = b;
      moved++;
    }
    // Release every hold (an aborted round's too, started or not).
    h0[g].released = 1;
    h1[g].released = 1;
    flags[1] = g;
    __sync_synchronize();
    if (!ok) {
      aborted++;
      // The graph's copy still reads the page into the new handle: wait for it, then drop it.
      probe_begin("aborted round: the graph ends");
      while (!h0[g].running) usleep(10);
      probe_end();
      CK(cuStreamSynchronize(s));
      STEP("unmap tmp", cuMemUnmap(tmp, sz));
      STEP("free tmp", cuMemAddressFree(tmp, sz));
      STEP("release new", cuMemRelease(b));
    }
    CK(cuGraphExecDestroy(ge));
    total_ms += now_ms() - t0;
  }
  stop_launchers = 1;
  for (int d = 0; d < 2; d++) pthread_join(lt[d], 0);
  CUresult fin[2];
  for (int d = 0; d < 2; d++) {
    CK(cuCtxSetCurrent(ctx[d]));
    probe_begin("final synchronize");
    fin[d] = cuCtxSynchronize();
    probe_end();
  }
  int got[3] = {-1, -1, -1};
  long bad = -1;
  if (!fin[0] && !fin[1]) {
    CK(cuCtxSetCurrent(ctx[0]));
    for (int k = 0; k < 3; k++) CK(cuMemcpyDtoH_v2(&got[k], (CUdeviceptr)word[k], sizeof(int)));
    bad = 0;
    for (int k = 0; k < 3; k++) bad += got[k] != (int)launched[k];
  }
  printf("{\"mode\": \"%s\", \"xdep\": %d, \"rounds\": %d, \"moved\": %d, \"aborted\": %d, \"final_sync\": [%d, %d], "
         "\"launched\": [%ld, %ld, %ld], \"got\": [%d, %d, %d], \"wrong_words\": %ld, \"worst_hold1_ms\": %.3f, "
         "\"worst_hold0_ms\": %.3f, \"ms_per_round\": %.3f, \"launch_err\": %d, \"kept\": %d, "
         "\"let_go_start\": %d, \"let_go_fence\": %d, \"let_go_watchdog\": %d}\n",
         mode, xdep, rounds, moved, aborted, (int)fin[0], (int)fin[1], (long)launched[0], (long)launched[1],
         (long)launched[2], got[0], got[1], got[2], bad, worst1, worst0, total_ms / rounds, launch_err, kept,
         let_go_start, let_go_fence, let_go_watchdog);
  return (!fin[0] && !fin[1] && bad == 0 && !launch_err) ? 0 : 1;
}
