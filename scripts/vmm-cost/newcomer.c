// How soon can a process that keeps released memory (issue 65) see another process arrive on its
// device, before that process asks for memory? "watch" polls the driver's list of processes
// with a context on device 0 (NVML, loaded at run time) and the device's free memory
// (cuMemGetInfo) for SECONDS, printing when a new pid is listed and when free memory drops by
// more than 64 MiB, with each poll's cost; "newcomer" is the arriving process: it prints the
// monotonic time at its start, after cuInit, after its context exists and after its first
// allocation of 1 GiB. Times are CLOCK_MONOTONIC milliseconds, comparable across processes.
// The watcher also prints each open of the driver's device files (inotify IN_OPEN on
// /dev/nvidiactl, /dev/nvidia0, /dev/nvidia-uvm; the opener is not named), a possible signal
// earlier than NVML's list.
//
//   gcc -O2 -o newcomer newcomer.c -I$CUDA_HOME/include -lcuda -ldl
//   ./newcomer watch SECONDS & sleep 1; ./newcomer newcomer
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <time.h>
#include <unistd.h>

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

// nvmlProcessInfo_v2_t, as nvmlDeviceGetComputeRunningProcesses_v3 fills it.
typedef struct {
  unsigned int pid;
  unsigned long long used;
  unsigned int gi, ci;
} Proc;

typedef int (*InitFn)(void);
typedef int (*HandleFn)(unsigned int, void**);
typedef int (*ProcsFn)(void*, unsigned int*, Proc*);

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

static int watch(double seconds) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!lib) return printf("error=no libnvidia-ml.so.1\n"), 1;
  InitFn init = (InitFn)dlsym(lib, "nvmlInit_v2");
  HandleFn handle = (HandleFn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
  ProcsFn procs = (ProcsFn)dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
  if (!init || !handle || !procs) return printf("error=nvml symbols\n"), 1;
  void* dev = 0;
  if (init() || handle(0, &dev)) return printf("error=nvml init\n"), 1;
  if (cuInit(0)) return printf("error=cuInit\n"), 1;
  CUdevice d;
  CUcontext c;
  cuDeviceGet(&d, 0);
  cuDevicePrimaryCtxRetain(&c, d);
  cuCtxSetCurrent(c);
  unsigned known[256];
  unsigned nk = 0;
  Proc ps[256];
  unsigned n = 256;
  if (procs(dev, &n, ps) == 0)
    for (unsigned i = 0; i < n && nk < 256; i++) known[nk++] = ps[i].pid;
  size_t free0, total;
  cuMemGetInfo(&free0, &total);
  const char* files[] = {"/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"};
  int wd[3], in = inotify_init1(IN_NONBLOCK);
  for (int i = 0; i < 3; i++) wd[i] = in >= 0 ? inotify_add_watch(in, files[i], IN_OPEN) : -1;
  printf("mode=watch self=%d listed_at_start=%u free_gib=%.2f inotify=%d,%d,%d\n", getpid(), nk,
         free0 / 1073741824.0, wd[0], wd[1], wd[2]);
  fflush(stdout);
  static double nv[1 << 20], mi[1 << 20];
  size_t polls = 0;
  double end = now_ms() + seconds * 1e3;
  size_t last_free = free0;
  while (now_ms() < end && polls < (1 << 20)) {
    double t0 = now_ms();
    n = 256;
    int r = procs(dev, &n, ps);
    double t1 = now_ms();
    size_t f;
    cuMemGetInfo(&f, &total);
    double t2 = now_ms();
    nv[polls] = t1 - t0;
    mi[polls] = t2 - t1;
    polls++;
    if (r == 0)
      for (unsigned i = 0; i < n; i++) {
        int seen = 0;
        for (unsigned k = 0; k < nk; k++) seen |= known[k] == ps[i].pid;
        if (!seen && nk < 256) {
          known[nk++] = ps[i].pid;
          printf("listed pid=%u t=%.3f used_mib=%llu\n", ps[i].pid, t1, ps[i].used >> 20);
          fflush(stdout);
        }
      }
    if (f + (64 << 20) < last_free) {
      printf("free_drop t=%.3f mib=%zu\n", t2, (last_free - f) >> 20);
      fflush(stdout);
    }
    last_free = f;
    char ev[4096] __attribute__((aligned(8)));
    ssize_t got = in >= 0 ? read(in, ev, sizeof ev) : -1;
    for (ssize_t o = 0; o < got;) {
      struct inotify_event* e = (struct inotify_event*)(ev + o);
      for (int i = 0; i < 3; i++)
        if (e->wd == wd[i]) printf("opened %s t=%.3f\n", files[i], now_ms());
      o += (ssize_t)sizeof(struct inotify_event) + e->len;
    }
  }
  qsort(nv, polls, sizeof(double), cmp);
  qsort(mi, polls, sizeof(double), cmp);
  printf("polls=%zu nvml_ms_p50=%.4f nvml_ms_p99=%.4f meminfo_ms_p50=%.4f meminfo_ms_p99=%.4f\n", polls,
         nv[polls / 2], nv[polls * 99 / 100], mi[polls / 2], mi[polls * 99 / 100]);
  return 0;
}

static int newcomer(void) {
  double t0 = now_ms();
  if (cuInit(0)) return printf("error=cuInit\n"), 1;
  double t1 = now_ms();
  CUdevice d;
  CUcontext c;
  cuDeviceGet(&d, 0);
  cuDevicePrimaryCtxRetain(&c, d);
  cuCtxSetCurrent(c);
  double t2 = now_ms();
  CUdeviceptr p;
  CUresult r = cuMemAlloc(&p, 1 << 30);
  double t3 = now_ms();
  printf("mode=newcomer pid=%d start=%.3f init=%.3f context=%.3f alloc=%.3f alloc_rc=%d\n", getpid(), t0, t1, t2, t3,
         (int)r);
  return 0;
}

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc > 1 && strcmp(argv[1], "watch") == 0) return watch(argc > 2 ? atof(argv[2]) : 5);
  if (argc > 1 && strcmp(argv[1], "newcomer") == 0) return newcomer();
  fprintf(stderr, "usage: %s watch SECONDS | newcomer\n", argv[0]);
  return 2;
}
