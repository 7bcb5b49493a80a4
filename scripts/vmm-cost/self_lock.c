// Can a process hold all of its own CUDA work with the driver's checkpoint lock, and still make
// a move's calls (create, reserve, map, access, copy, unmap) while the lock holds? If so, a split
// of a coalesced handle (issue 61) could hold every user of the memory by design: every thread,
// every stream, graphs and statically linked runtimes alike. A worker thread keeps queueing
// memsets on a non-blocking stream of its own (its count of calls made is watched during the
// lock); the lock is taken on the process's own pid from the main thread ("same") or from a
// thread started for it ("thread"); every call that follows is timed and a watchdog names the
// one that never returns. One line of key=value a step.
//
//   gcc -O2 -o self_lock self_lock.c -I$CUDA_HOME/include -lcuda -lpthread
//   ./self_lock same|thread [LOCK_TIMEOUT_MS]
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static const char* volatile step = "start";
static volatile double step_t0 = 0;
static volatile long calls = 0;
static volatile int stop = 0;
static CUcontext ctx;
static CUdeviceptr buf;
static const size_t BUF = 64 << 20;
static unsigned lock_timeout = 2000;

static void begin(const char* s) {
  step = s;
  step_t0 = now_ms();
}

static double end(void) {
  double t = now_ms() - step_t0;
  step_t0 = 0;
  return t;
}

static void* watchdog(void* arg) {
  (void)arg;
  for (;;) {
    usleep(50000);
    double t0 = step_t0;
    if (t0 > 0 && now_ms() - t0 > 6000) {
      printf("HANG at=%s worker_calls=%ld\n", step, calls);
      fflush(stdout);
      _exit(3);
    }
  }
}

static void* worker(void* arg) {
  (void)arg;
  cuCtxSetCurrent(ctx);
  CUstream s;
  cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  unsigned v = 0;
  while (!stop) {
    cuMemsetD32Async(buf, ++v, BUF / 4, s);
    calls++;
    if (v % 64 == 0) cuStreamSynchronize(s);
  }
  cuStreamSynchronize(s);
  unsigned got = 0;
  cuMemcpyDtoH(&got, buf + BUF - 4, 4);
  printf("worker_last=%u worker_read=%u\n", v, got);
  return NULL;
}

#define STEP(name, call)                                                            \
  do {                                                                              \
    begin(name);                                                                    \
    long c0 = calls;                                                                \
    CUresult r_ = (call);                                                           \
    double t_ = end();                                                              \
    printf("step=%s rc=%d ms=%.3f worker_calls_meanwhile=%ld\n", name, (int)r_, t_, \
           calls - c0);                                                             \
    fflush(stdout);                                                                 \
  } while (0)

static void* locker(void* arg) {
  (void)arg;
  cuCtxSetCurrent(ctx);
  int pid = getpid();
  CUcheckpointLockArgs la;
  memset(&la, 0, sizeof la);
  la.timeoutMs = lock_timeout;
  CUprocessState st = 0;
  STEP("state", cuCheckpointProcessGetState(pid, &st));
  printf("state=%d\n", (int)st);
  begin("lock");
  long c0 = calls;
  CUresult rl = cuCheckpointProcessLock(pid, &la);
  double tl = end();
  printf("step=lock rc=%d ms=%.3f worker_calls_meanwhile=%ld\n", (int)rl, tl, calls - c0);
  fflush(stdout);
  if (rl != CUDA_SUCCESS) return NULL;
  long held0 = calls;
  usleep(100000);
  printf("worker_calls_in_100ms_locked=%ld\n", calls - held0);
  fflush(stdout);
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  size_t sz = 2 << 20;
  STEP("create", cuMemCreate(&h, sz, &p, 0));
  STEP("reserve", cuMemAddressReserve(&va, sz, 0, 0, 0));
  STEP("map", cuMemMap(va, sz, 0, h, 0));
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location = p.location;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  STEP("access", cuMemSetAccess(va, sz, &d, 1));
  STEP("copy", cuMemcpyDtoD(va, buf, sz));
  CUstream own;
  STEP("stream", cuStreamCreate(&own, CU_STREAM_NON_BLOCKING));
  STEP("copy_async", cuMemcpyDtoDAsync(va, buf, sz, own));
  STEP("stream_sync", cuStreamSynchronize(own));
  STEP("unmap", cuMemUnmap(va, sz));
  STEP("release", cuMemRelease(h));
  STEP("free_va", cuMemAddressFree(va, sz));
  long before = calls;
  STEP("unlock", cuCheckpointProcessUnlock(pid, NULL));
  usleep(100000);
  printf("worker_calls_in_100ms_after=%ld\n", calls - before);
  return NULL;
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "thread";
  if (argc > 2) lock_timeout = (unsigned)atoi(argv[2]);
  setvbuf(stdout, NULL, _IOLBF, 0);
  pthread_t wd, w, l;
  pthread_create(&wd, NULL, watchdog, NULL);
  if (cuInit(0)) return printf("error=cuInit\n"), 1;
  CUdevice dev;
  cuDeviceGet(&dev, 0);
  cuDevicePrimaryCtxRetain(&ctx, dev);
  cuCtxSetCurrent(ctx);
  int drv = 0;
  cuDriverGetVersion(&drv);
  printf("mode=%s driver=%d\n", mode, drv);
  if (cuMemAlloc(&buf, BUF)) return printf("error=cuMemAlloc\n"), 1;
  pthread_create(&w, NULL, worker, NULL);
  usleep(200000);
  printf("worker_calls_before=%ld\n", calls);
  if (strcmp(mode, "same") == 0) {
    locker(NULL);
  } else {
    pthread_create(&l, NULL, locker, NULL);
    pthread_join(l, NULL);
  }
  begin("stop worker");
  stop = 1;
  pthread_join(w, NULL);
  end();
  printf("done=1\n");
  return 0;
}
