// Can the driver's checkpoint API pause a busy CUDA program from outside, exactly? A process
// that keeps launching work (shim-tests/torch_busy_loop.py) is locked, checkpointed (its device
// memory copied to host by the driver, its GPU resources released), kept so for a random time,
// restored and unlocked, PAUSES times at random moments. One JSON line per pause: each call's
// CUresult and time, and the device memory freed as this process's cuMemGetInfo sees it. At the
// end, a pinned copy of the largest freed size each way, for the ratio.
//
//   gcc -O2 -o ckpt_pause ckpt_pause.c -I$CUDA_HOME/include -lcuda
//   ./ckpt_pause PID PAUSES MIN_MS MAX_MS [LOCK_TIMEOUT_MS] [SEED]
#include <cuda.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void sleep_ms(double ms) {
  struct timespec t = {(time_t)(ms / 1000), (long)((ms - 1000 * (long)(ms / 1000)) * 1e6)};
  nanosleep(&t, NULL);
}

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s PID PAUSES MIN_MS MAX_MS [LOCK_TIMEOUT_MS] [SEED]\n", argv[0]);
    return 2;
  }
  int pid = atoi(argv[1]), pauses = atoi(argv[2]);
  double lo = atof(argv[3]), hi = atof(argv[4]);
  unsigned timeout = argc > 5 ? (unsigned)atoi(argv[5]) : 10000;
  srand(argc > 6 ? atoi(argv[6]) : 1);
  if (cuInit(0)) return printf("{\"error\":\"cuInit\"}\n"), 1;
  CUdevice d;
  CUcontext c;
  cuDeviceGet(&d, 0);
  cuDevicePrimaryCtxRetain(&c, d);
  cuCtxSetCurrent(c);
  size_t most = 0;
  int done = 0, smi = 1;
  for (int i = 0; i < pauses; i++) {
    sleep_ms(50 + rand() % 350);
    if (kill(pid, 0)) break;
    CUprocessState st;
    CUresult rs = cuCheckpointProcessGetState(pid, &st);
    size_t f0, f1, tot;
    cuMemGetInfo(&f0, &tot);
    CUcheckpointLockArgs la = {0};
    la.timeoutMs = timeout;
    double t0 = now();
    CUresult rl = cuCheckpointProcessLock(pid, &la);
    double t1 = now();
    CUresult rc = (CUresult)-1, rr = (CUresult)-1, ru = (CUresult)-1; // -1: not tried
    double t2 = t1, t3 = t1, t4 = t1, t5 = t1;
    f1 = f0;
    double hold = lo + (hi - lo) * (rand() / (double)RAND_MAX);
    if (rl == CUDA_SUCCESS) {
      rc = cuCheckpointProcessCheckpoint(pid, NULL);
      t2 = now();
      cuMemGetInfo(&f1, &tot);
      if (rc == CUDA_SUCCESS && smi) {
        smi = 0;
        fflush(stdout);
        if (system("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 1>&2")) {}
      }
      sleep_ms(hold);
      t3 = now();
      if (rc == CUDA_SUCCESS) rr = cuCheckpointProcessRestore(pid, NULL);
      t4 = now();
      ru = cuCheckpointProcessUnlock(pid, NULL);
      t5 = now();
    }
    size_t freed = f1 > f0 ? f1 - f0 : 0;
    if (freed > most) most = freed;
    printf(
        "{\"pause\":%d,\"state_rc\":%d,\"state\":%d,\"lock\":%d,\"checkpoint\":%d,\"restore\":%d,\"unlock\":%d,"
        "\"lock_s\":%.4f,\"checkpoint_s\":%.4f,\"held_ms\":%.0f,\"restore_s\":%.4f,\"unlock_s\":%.4f,\"freed\":%zu}\n",
        i, rs, (int)st, rl, rc, rr, ru, t1 - t0, t2 - t1, hold, t4 - t3, t5 - t4, freed);
    fflush(stdout);
    if (rl == CUDA_SUCCESS && rc == CUDA_SUCCESS && rr == CUDA_SUCCESS && ru == CUDA_SUCCESS) done++;
  }
  if (most) {
    void* h;
    CUdeviceptr p;
    if (!cuMemHostAlloc(&h, most, 0) && !cuMemAlloc(&p, most)) {
      cuMemcpyDtoH(h, p, most);
      double a = now();
      cuMemcpyDtoH(h, p, most);
      double b = now();
      cuMemcpyHtoD(p, h, most);
      double e = now();
      printf("{\"pinned_bytes\":%zu,\"dtoh_s\":%.4f,\"htod_s\":%.4f}\n", most, b - a, e - b);
    }
  }
  printf("{\"pauses_done\":%d}\n", done);
  return 0;
}
