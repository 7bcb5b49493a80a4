// Which calls another thread may make while a stream of the program captures a CUDA graph in
// global mode, without failing and without invalidating the capture: what a share from
// another thread (cudaIpcGetMemHandle, a mirror's copy, a split's VMM calls) may do then.
//
//     nvcc -O2 -o capture_calls capture_calls.cu -lcuda -lpthread && ./capture_calls
//
// For each call and each capture mode of the calling thread (its own mode left global, or
// exchanged for relaxed): a fresh capture on a non-blocking stream (a kernel before and after
// the call), the call's result, the capture's end, and whether the graph replays right.
#include <pthread.h>

#include "probe.cuh"

__global__ void add1(int *p, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1;
}

static int *buf;            // the captured kernels' data
static void *shared_buf;    // cudaMalloc memory asked for a handle
static cudaStream_t own;    // the calling thread's non-blocking stream
static void *scratch_a, *scratch_b;
static const int n = 1 << 20;

static int run_call(const char *op) {
  if (!strcmp(op, "device_sync")) return cudaDeviceSynchronize();
  if (!strcmp(op, "ctx_sync")) return cuCtxSynchronize();
  if (!strcmp(op, "malloc_free")) {
    void *p;
    int r = cudaMalloc(&p, 2 << 20);
    if (r) return r;
    return cudaFree(p);
  }
  if (!strcmp(op, "malloc")) {
    void *p;
    return cudaMalloc(&p, 2 << 20);  // kept: cudaFree may synchronize
  }
  if (!strcmp(op, "ipc_get")) {
    cudaIpcMemHandle_t h;
    return cudaIpcGetMemHandle(&h, shared_buf);
  }
  if (!strcmp(op, "copy_own_stream")) {
    int r = cudaMemcpyAsync(scratch_b, scratch_a, 64 << 20, cudaMemcpyDeviceToDevice, own);
    if (r) return r;
    return cudaStreamSynchronize(own);
  }
  if (!strcmp(op, "copy_drv_own_stream")) {
    CUresult r = cuMemcpyDtoDAsync((CUdeviceptr)scratch_b, (CUdeviceptr)scratch_a, 64 << 20,
                                   (CUstream)own);
    if (r) return r;
    return cuStreamSynchronize((CUstream)own);
  }
  if (!strcmp(op, "copy_legacy_stream")) {
    int r = cudaMemcpyAsync(scratch_b, scratch_a, 64 << 20, cudaMemcpyDeviceToDevice, 0);
    if (r) return r;
    return cudaStreamSynchronize(0);
  }
  if (!strcmp(op, "event_own_stream")) {
    cudaEvent_t e;
    int r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (r) return r;
    r = cudaEventRecord(e, own);
    if (r) return r;
    r = cudaEventSynchronize(e);
    cudaEventDestroy(e);
    return r;
  }
  if (!strcmp(op, "mem_get_info")) {
    size_t f, t;
    return cudaMemGetInfo(&f, &t);
  }
  if (!strcmp(op, "host_alloc")) {
    void *h;
    int r = cudaHostAlloc(&h, 2 << 20, cudaHostAllocPortable);
    if (r) return r;
    return cudaFreeHost(h);
  }
  if (!strcmp(op, "stream_create")) {
    cudaStream_t s;
    int r = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (r) return r;
    return cudaStreamDestroy(s);
  }
  if (!strcmp(op, "vmm")) {
    CUmemAllocationProp p = pinned_prop(0);
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CUresult r = cuMemCreate(&h, 2 << 20, &p, 0);
    if (r) return 1000 + r;
    r = cuMemAddressReserve(&va, 2 << 20, 0, 0, 0);
    if (r) return 2000 + r;
    r = cuMemMap(va, 2 << 20, 0, h, 0);
    if (r) return 3000 + r;
    CUmemAccessDesc a = rw_access(0);
    r = cuMemSetAccess(va, 2 << 20, &a, 1);
    if (r) return 4000 + r;
    r = cuMemUnmap(va, 2 << 20);
    if (r) return 5000 + r;
    r = cuMemRelease(h);
    if (r) return 6000 + r;
    return cuMemAddressFree(va, 2 << 20) ? 7000 : 0;
  }
  if (!strcmp(op, "vmm_export")) {
    CUmemAllocationProp p = pinned_prop(0);
    CUmemGenericAllocationHandle h;
    CUresult r = cuMemCreate(&h, 2 << 20, &p, 0);
    if (r) return 1000 + r;
    int fd = -1;
    r = cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    cuMemRelease(h);
    return r;
  }
  if (!strcmp(op, "is_capturing_other")) return 0;  // handled by the caller
  return -1;
}

struct Turn {
  const char *op;
  int relaxed;
  pthread_mutex_t m;
  pthread_cond_t c;
  int stage;  // 1: capture open, 2: call made
  int rc;
};

static void *caller(void *arg) {
  Turn *t = (Turn *)arg;
  cudaSetDevice(0);
  pthread_mutex_lock(&t->m);
  while (t->stage < 1) pthread_cond_wait(&t->c, &t->m);
  pthread_mutex_unlock(&t->m);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (t->relaxed) cudaThreadExchangeStreamCaptureMode(&mode);
  t->rc = run_call(t->op);
  if (t->relaxed) cudaThreadExchangeStreamCaptureMode(&mode);
  pthread_mutex_lock(&t->m);
  t->stage = 2;
  pthread_cond_signal(&t->c);
  pthread_mutex_unlock(&t->m);
  return NULL;
}

int main(int argc, char **argv) {
  const char *ops[] = {"device_sync",       "ctx_sync",         "malloc",
                       "malloc_free",       "ipc_get",          "copy_own_stream",
                       "copy_drv_own_stream", "copy_legacy_stream", "event_own_stream",
                       "mem_get_info",      "host_alloc",       "stream_create",
                       "vmm",               "vmm_export"};
  CKRT(cudaSetDevice(0));
  CK(cuInit(0));
  CKRT(cudaMalloc(&buf, n * sizeof(int)));
  CKRT(cudaMalloc(&shared_buf, 64 << 20));
  CKRT(cudaMalloc(&scratch_a, 64 << 20));
  CKRT(cudaMalloc(&scratch_b, 64 << 20));
  CKRT(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  cudaStream_t cap;
  CKRT(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking));
  for (int relaxed = 0; relaxed < 2; relaxed++) {
    for (unsigned k = 0; k < sizeof ops / sizeof ops[0]; k++) {
      if (argc > 1 && strcmp(argv[1], ops[k])) continue;
      CKRT(cudaMemset(buf, 0, n * sizeof(int)));
      CKRT(cudaDeviceSynchronize());
      Turn t = {ops[k], relaxed, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, -2};
      pthread_t th;
      pthread_create(&th, NULL, caller, &t);
      int begin = cudaStreamBeginCapture(cap, cudaStreamCaptureModeGlobal);
      add1<<<(n + 255) / 256, 256, 0, cap>>>(buf, n);
      pthread_mutex_lock(&t.m);
      t.stage = 1;
      pthread_cond_signal(&t.c);
      while (t.stage < 2) pthread_cond_wait(&t.c, &t.m);
      pthread_mutex_unlock(&t.m);
      pthread_join(th, NULL);
      add1<<<(n + 255) / 256, 256, 0, cap>>>(buf, n);
      cudaGraph_t g = NULL;
      int end = cudaStreamEndCapture(cap, &g);
      int launched = -1, right = 0;
      if (!end && g) {
        cudaGraphExec_t ge;
        if (!cudaGraphInstantiate(&ge, g, 0)) {
          launched = cudaGraphLaunch(ge, cap);
          cudaStreamSynchronize(cap);
          int first, last;
          cudaMemcpy(&first, buf, 4, cudaMemcpyDeviceToHost);
          cudaMemcpy(&last, buf + n - 1, 4, cudaMemcpyDeviceToHost);
          right = first == 2 && last == 2;
          cudaGraphExecDestroy(ge);
        }
        cudaGraphDestroy(g);
      }
      cudaGetLastError();  // clear a sticky-free error a refused call left
      printf("CAPTURE_CALL %-20s caller_mode %-7s call_rc %5d begin %d end %d graph_launch %d replay_right %d\n",
             ops[k], relaxed ? "relaxed" : "global", t.rc, begin, end, launched, right);
      fflush(stdout);
    }
  }
  return 0;
}
