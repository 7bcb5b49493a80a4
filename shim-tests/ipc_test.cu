// GPU test and benchmark of cudaIpcGetMemHandle on pool memory. Built with
// `nvcc -cudart shared`; shim-tests/run.sh runs it.
//
//   ipc_test run CONSUMER_PRELOAD SIZES_MIB...   producer (run under expseg); spawns a
//       consumer (this binary, "consume") with LD_PRELOAD=CONSUMER_PRELOAD ("-" for none).
//       Per size: share an interior pointer, the consumer opens the handle and checks all of
//       the data, then ten refill-and-reshare rounds (weight sync) each checked by the
//       consumer, then the consumer writes and the producer looks: shared (moved) or one-way
//       (mirror). Last line: "N passed, M failed".
//   ipc_test bench                               move success rate after a cluttered history,
//       export time against a device-to-device copy of the same size, mirror refresh rate.
#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <string>
#include <vector>

extern char** environ;
#define MIB ((size_t)1 << 20)
static double now_ms() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }

#include "pattern.cuh"

// Flags ping-pong, like a custom all-reduce: each side waits for its turn on word 0 of the
// shared buffer and hands the turn over; works only if both sides see one memory.
__global__ void pingpong_k(volatile unsigned* flag, int rounds, unsigned me, int* ok) {
  long long t0 = clock64();
  for (int i = 0; i < rounds; i++) {
    unsigned want = 2 * i + me;
    while (*flag != want) {
      if (clock64() - t0 > 20000000000ll) { *ok = 0; return; }  // ~10 s
    }
    __threadfence_system();
    *flag = want + 1;
    __threadfence_system();
  }
  *ok = 1;
}
static int* pingpong_ok;
static void pingpong_start(void* p, int rounds, unsigned me) {
  if (!pingpong_ok) cudaMallocHost(&pingpong_ok, sizeof *pingpong_ok);
  *pingpong_ok = -1;
  pingpong_k<<<1, 1>>>((volatile unsigned*)p, rounds, me, pingpong_ok);
}
static int pingpong_wait() {
  cudaDeviceSynchronize();
  return *pingpong_ok == 1;
}

static void fill(void* p, size_t bytes, uint32_t seed) {
  fill_k<<<2048, 256>>>((uint32_t*)p, bytes / 4, seed);
  cudaDeviceSynchronize();
}
static unsigned long long mismatches(const void* p, size_t bytes, uint32_t seed) {
  static unsigned long long* bad = 0;
  if (!bad) cudaMallocHost(&bad, sizeof *bad);
  *bad = 0;
  verify_k<<<2048, 256>>>((const uint32_t*)p, bytes / 4, seed, bad);
  if (cudaDeviceSynchronize() != cudaSuccess) return ~0ull;
  return *bad;
}
// 1 if `p` is standard (cudaMalloc) memory, 0 if VMM memory (the driver has an allocation
// handle for it), as the legacy-IPC attribute would say natively. expseg answers that attribute
// for pool memory as for cudaMalloc memory, so a move is told by the handle.
static int legacy_capable(void* p) {
  CUmemGenericAllocationHandle h;
  if (cuMemRetainAllocationHandle(&h, p) != CUDA_SUCCESS) return 1;
  cuMemRelease(h);
  return 0;
}
static void hex(const cudaIpcMemHandle_t& h, char* out) {
  for (int i = 0; i < 64; i++) sprintf(out + 2 * i, "%02x", (unsigned char)h.reserved[i]);
}
static void unhex(const char* s, cudaIpcMemHandle_t* h) {
  for (int i = 0; i < 64; i++) { unsigned v; sscanf(s + 2 * i, "%2x", &v); h->reserved[i] = (char)v; }
}

// The consumer: commands on stdin, one answer line each on stdout.
static int consume() {
  char line[512], arg[256];
  void* q = 0;
  size_t size = 0;
  setvbuf(stdout, 0, _IOLBF, 0);
  while (fgets(line, sizeof line, stdin)) {
    unsigned long long a = 0, b = 0;
    if (sscanf(line, "open %200s %llu", arg, &a) == 2) {
      cudaIpcMemHandle_t h;
      unhex(arg, &h);
      size = a;
      double t0 = now_ms();
      cudaError_t e = cudaIpcOpenMemHandle(&q, h, cudaIpcMemLazyEnablePeerAccess);
      double t = now_ms() - t0;
      if (e == cudaSuccess) printf("ok %.3f\n", t); else printf("err %d\n", e);
    } else if (sscanf(line, "check %llu", &b) == 1) {
      unsigned long long bad = mismatches(q, size, (uint32_t)b);
      printf(bad == 0 ? "ok\n" : "bad %llu\n", bad);
    } else if (sscanf(line, "write %llu", &b) == 1) {
      fill(q, size, (uint32_t)b);
      printf("ok\n");
    } else if (sscanf(line, "pingpong %llu", &b) == 1) {
      pingpong_start(q, (int)b, 1);
      printf("ok\n");
    } else if (!strncmp(line, "wait", 4)) {
      printf(pingpong_wait() ? "ok\n" : "bad pingpong\n");
    } else if (sscanf(line, "peercheck %llu", &b) == 1) {
      // The consumer's device 1 reads the memory opened on device 0 once it has peer access
      // to device 0 (as any memory of device 0's context).
      int cur = 0;
      cudaGetDevice(&cur);
      cudaSetDevice(1);
      cudaError_t e = cudaDeviceEnablePeerAccess(0, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      unsigned long long bad = ~0ull, *d = 0;
      if ((e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled) && cudaMalloc(&d, sizeof *d) == cudaSuccess) {
        cudaMemset(d, 0, sizeof *d);
        verify_k<<<2048, 256>>>((const uint32_t*)q, size / 4, (uint32_t)b, d);
        if (cudaMemcpy(&bad, d, sizeof bad, cudaMemcpyDeviceToHost) != cudaSuccess) bad = ~0ull;
        cudaFree(d);
      }
      cudaSetDevice(cur);
      if (bad == 0) printf("ok\n"); else printf("bad %llu (enable %d)\n", bad, e);
    } else if (!strncmp(line, "peeron", 6)) {
      // Device 1 given access to device 0 before anything is opened (then opened memory of
      // device 0 is device 0's for the consumer's device 1 as any other, if the driver maps it).
      int cur = 0;
      cudaGetDevice(&cur);
      cudaSetDevice(1);
      cudaError_t e = cudaDeviceEnablePeerAccess(0, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) { cudaGetLastError(); e = cudaSuccess; }
      cudaSetDevice(cur);
      if (e == cudaSuccess) printf("ok\n"); else printf("err %d\n", e);
    } else if (!strncmp(line, "close", 5)) {
      cudaError_t e = cudaIpcCloseMemHandle(q);
      printf(e == cudaSuccess ? "ok\n" : "err %d\n", e);
    } else {
      break;
    }
  }
  return 0;
}

struct Consumer { pid_t pid; FILE* to; FILE* from; };
static Consumer spawn_consumer(const char* self, const char* preload) {
  int in[2], out[2];
  if (pipe(in) || pipe(out)) { perror("pipe"); exit(2); }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_addclose(&fa, in[1]);
  posix_spawn_file_actions_addclose(&fa, out[0]);
  std::vector<char*> env;
  static char pre[1024];
  for (char** e = environ; *e; e++)
    if (strncmp(*e, "LD_PRELOAD=", 11) && strncmp(*e, "EXPSEG_REPORT=", 14)) env.push_back(*e);
  if (strcmp(preload, "-")) { snprintf(pre, sizeof pre, "LD_PRELOAD=%s", preload); env.push_back(pre); }
  env.push_back(0);
  char* argv[] = {(char*)self, (char*)"consume", 0};
  Consumer c;
  if (posix_spawn(&c.pid, self, &fa, 0, argv, env.data())) { perror("spawn"); exit(2); }
  close(in[0]);
  close(out[1]);
  c.to = fdopen(in[1], "w");
  c.from = fdopen(out[0], "r");
  setvbuf(c.to, 0, _IOLBF, 0);
  return c;
}
static int count_fds() {
  int n = 0;
  for (int fd = 0; fd < 4096; fd++)
    if (fcntl(fd, F_GETFD) != -1) n++;
  return n;
}

static char last_answer[128];
static int ask(Consumer& c, const char* fmt, ...) {
  char cmd[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  fputs(cmd, c.to);
  fflush(c.to);
  char* ans = last_answer;
  memset(last_answer, 0, sizeof last_answer);
  if (!fgets(ans, sizeof last_answer, c.from)) return 0;
  if (strncmp(ans, "ok", 2)) printf("    consumer: %s -> %s", cmd, ans);
  return !strncmp(ans, "ok", 2);
}

static int run(const char* self, const char* preload, int nsizes, char** sizes) {
  int passed = 0, failed = 0;
  int consumer_expseg = strcmp(preload, "-") != 0;
  Consumer c = spawn_consumer(self, preload);
  size_t free_b, total;
  cudaMemGetInfo(&free_b, &total);
  for (int i = 0; i < nsizes; i++) {
    size_t size = (size_t)atoll(sizes[i]) * MIB;
    if (size * 3 > free_b) { printf("SKIP %zu MiB (too large for this GPU)\n", size >> 20); continue; }
    uint32_t seed = 1000 * (i + 1);
    void* p;
    int ok = cudaMalloc(&p, size) == cudaSuccess;
    int vmm = legacy_capable(p) == 0;
    fill(p, size, seed);
    cudaIpcMemHandle_t h, h2;
    double t0 = now_ms();
    cudaError_t e = cudaIpcGetMemHandle(&h, (char*)p + size / 2);
    double t_export = now_ms() - t0;
    ok &= e == cudaSuccess;
    int moved = legacy_capable(p) == 1;  // standard memory now (or all along, natively)
    ok &= mismatches(p, size, seed) == 0;  // the producer's own view is intact
    char hx[129];
    hex(h, hx);
    ok &= ok && ask(c, "open %s %zu\n", hx, size);
    double t_open = atof(last_answer + 2);
    ok &= ask(c, "check %u\n", seed);
    // Weight sync: refill, re-share, the consumer checks every version.
    int versions = 0;
    for (int v = 1; ok && v <= 10; v++) {
      fill(p, size, seed + v);
      ok &= cudaIpcGetMemHandle(&h2, p) == cudaSuccess && memcmp(&h, &h2, sizeof h) == 0;
      ok &= ask(c, "check %u\n", seed + v);
      versions += ok;
    }
    // The consumer writes. Moved memory is shared both ways; a mirror is one-way for a plain
    // consumer, while a consumer running expseg maps the original through the ticket.
    ok &= ask(c, "write %u\n", seed + 77);
    unsigned long long seen = mismatches(p, size, seed + 77);
    int shared = seen == 0;
    int expect_shared = moved || consumer_expseg;
    ok &= shared == expect_shared;
    // Both sides take turns on a flag word while running concurrently: shared memory only.
    int pingpong = -1;
    if (ok && expect_shared) {
      cudaMemset(p, 0, 4);
      cudaDeviceSynchronize();
      ok &= ask(c, "pingpong 100\n");
      pingpong_start(p, 100, 0);
      pingpong = pingpong_wait();
      pingpong &= ask(c, "wait\n");
      ok &= pingpong;
    }
    // A consumer mapping outlives the producer's free (ticket path): the memory stays valid.
    int outlived = -1;
    if (ok && consumer_expseg && !moved) {
      fill(p, size, seed + 99);
      ok &= cudaFree(p) == cudaSuccess;
      p = 0;
      outlived = ask(c, "check %u\n", seed + 99);
      ok &= outlived;
    }
    ok &= ask(c, "close\n");
    if (p) ok &= cudaFree(p) == cudaSuccess;
    printf("%s ipc %6zu MiB: %s (was VMM: %d), export %.2f ms, open %.3f ms, %d/10 versions seen, consumer writes %s\n",
           ok ? "PASS" : "FAIL", size >> 20, moved ? "moved/standard" : (consumer_expseg ? "mirror+ticket" : "mirror"), vmm,
           t_export, t_open, versions,
           shared ? (pingpong == 1 ? "shared, 100 ping-pong rounds" : "shared") : "not shared (one-way)");
    if (outlived == 1) printf("     (consumer still read it after the producer freed it)\n");
    ok ? passed++ : failed++;
  }
  // A consumer running expseg refuses a ticket with a forged nonce and the ticket of a freed
  // allocation: an error, never memory.
  if (consumer_expseg && getenv("LD_PRELOAD")) {
    size_t size = 64 * MIB;
    void* p;
    cudaIpcMemHandle_t h;
    int ok = cudaMalloc(&p, size) == cudaSuccess && cudaIpcGetMemHandle(&h, p) == cudaSuccess;
    int ticketed = ok && !memcmp(&h, "XSG1", 4);
    char hx[129];
    cudaIpcMemHandle_t forged = h;
    forged.reserved[16] ^= 1;
    hex(forged, hx);
    ok &= ticketed && !ask(c, "open %s %zu\n", hx, size);
    cudaFree(p);
    hex(h, hx);
    ok &= !ask(c, "open %s %zu\n", hx, size);
    printf("%s ipc tickets: forged nonce and freed allocation refused (ticketed handle: %d)\n", ok ? "PASS" : "FAIL", ticketed);
    ok ? passed++ : failed++;
  }
  // No descriptor or memory leaks: 20 more share/open/close/free cycles leave the producer with
  // the descriptors and free memory it had before them.
  {
    size_t size = 64 * MIB, f0, f1, total;
    int ok = 1;
    int fds0 = count_fds();
    cudaMemGetInfo(&f0, &total);
    for (int i = 0; ok && i < 20; i++) {
      void* p;
      cudaIpcMemHandle_t h;
      char hx[129];
      ok &= cudaMalloc(&p, size) == cudaSuccess && cudaIpcGetMemHandle(&h, p) == cudaSuccess;
      hex(h, hx);
      ok &= ask(c, "open %s %zu\n", hx, size) && ask(c, "close\n");
      ok &= cudaFree(p) == cudaSuccess;
    }
    int fds1 = count_fds();
    cudaMemGetInfo(&f1, &total);
    ok &= fds1 <= fds0 && f1 + 4 * MIB >= f0;
    printf("%s ipc: 20 share cycles: producer descriptors %d -> %d, free memory %zu -> %zu MiB\n", ok ? "PASS" : "FAIL", fds0,
           fds1, f0 >> 20, f1 >> 20);
    ok ? passed++ : failed++;
  }
  fputs("quit\n", c.to);
  fclose(c.to);
  int st;
  waitpid(c.pid, &st, 0);
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}

// Two GPUs: device 1 writes device 0's allocation through peer access just before the handle
// request, with no wait in between (the program waits after it, before handing the handle
// over): the consumer sees those writes (a mirror is copied after them, as after device 0's
// own work); whether the consumer's device 1 reads the opened memory is below.
__global__ void spin_k(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
// The consumer's device 1 reading memory opened on device 0 is printed (PEER_READ 1|0), not
// counted here: natively it depends on when device 1 got peer access (run.sh compares each
// consumer's answer with the native one, with peer access enabled after the open and, with
// `early`, before it).
static int two_gpus(const char* self, const char* preload, int early) {
  int n = 0, can = 0;
  cudaGetDeviceCount(&n);
  if (n >= 2) cudaDeviceCanAccessPeer(&can, 1, 0);
  if (n < 2 || !can) {
    printf("SKIP ipc two GPUs: %d GPU(s), device 1 %s device 0\n", n, can ? "reaches" : "cannot reach");
    printf("0 passed, 0 failed, 1 skipped\n");
    return 0;
  }
  Consumer c = spawn_consumer(self, preload);
  size_t size = 256 * MIB;
  void* p = 0;
  int ok = cudaSetDevice(0) == cudaSuccess && cudaMalloc(&p, size) == cudaSuccess;
  if (ok) fill(p, size, 5000);
  cudaSetDevice(1);
  cudaError_t e = cudaDeviceEnablePeerAccess(0, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
  ok &= e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled;
  spin_k<<<1, 1>>>(400000000ll);  // about 0.2 s, then device 1 writes the new version
  fill_k<<<2048, 256>>>((uint32_t*)p, size / 4, 5001);
  cudaSetDevice(0);
  cudaIpcMemHandle_t h;
  ok &= cudaIpcGetMemHandle(&h, p) == cudaSuccess;
  cudaSetDevice(1);
  ok &= cudaDeviceSynchronize() == cudaSuccess;
  cudaSetDevice(0);
  int producer = mismatches(p, size, 5001) == 0;
  char hx[129];
  hex(h, hx);
  int on = !early || ask(c, "peeron\n");
  int opened = ok && on && ask(c, "open %s %zu\n", hx, size);
  int seen = opened && ask(c, "check 5001\n");
  int peer = opened && ask(c, "peercheck 5001\n");
  if (opened) ask(c, "close\n");
  ok &= producer && seen && cudaFree(p) == cudaSuccess;
  printf("%s ipc two GPUs (consumer's peer access %s the open): device 1's writes before the request %s; the consumer's device 1 %s\n",
         ok ? "PASS" : "FAIL", early ? "before" : "after",
         seen ? "reach the consumer" : (opened ? "MISSING for the consumer" : "(not opened)"),
         peer ? "reads the opened memory" : "cannot read the opened memory");
  printf("PEER_READ %d\n", peer);
  fputs("quit\n", c.to);
  fclose(c.to);
  int st;
  waitpid(c.pid, &st, 0);
  printf("%d passed, %d failed\n", ok, !ok);
  return !ok;
}

static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v.empty() ? 0 : v[v.size() / 2]; }

static int bench() {
  // A cluttered history: 1000 mixed allocations and frees, about 100 left live.
  std::vector<void*> live;
  uint32_t s = 7;
  for (int i = 0; i < 1000; i++) {
    s = s * 1664525u + 1013904223u;
    if (live.size() > 100 || (live.size() > 20 && s % 3 == 0)) {
      size_t k = (s >> 8) % live.size();
      cudaFree(live[k]);
      live.erase(live.begin() + k);
    } else {
      void* p;
      size_t n = (s >> 4) % 4 == 0 ? 1 + (s >> 6) % MIB : (1 + (s >> 6) % 48) * MIB;
      if (cudaMalloc(&p, n) == cudaSuccess) live.push_back(p);
    }
  }
  printf("| size | moved | mirror | failed | export ms (moved) | export ms (mirror) | refresh ms | D2D copy ms | refresh / copy bandwidth |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  size_t sizes[] = {2, 8, 20, 32, 40, 64, 256, 1024, 4096};
  for (size_t mb : sizes) {
    size_t size = mb * MIB;
    int moved = 0, mirrored = 0, failures = 0, trials = mb <= 40 ? 100 : 10;
    std::vector<double> tm, tmi, tr, tc;
    for (int t = 0; t < trials; t++) {
      void* p;
      if (cudaMalloc(&p, size)) break;
      fill(p, size, t);
      cudaIpcMemHandle_t h;
      double t0 = now_ms();
      cudaError_t e = cudaIpcGetMemHandle(&h, p);
      double dt = now_ms() - t0;
      if (e != cudaSuccess) { failures++; cudaGetLastError(); continue; }
      if (legacy_capable(p) == 1) { moved++; tm.push_back(dt); }
      else {
        mirrored++;
        tmi.push_back(dt);
        t0 = now_ms();
        cudaIpcGetMemHandle(&h, p);  // refresh
        tr.push_back(now_ms() - t0);
      }
      cudaFree(p);
    }
    void *a, *b;
    if (cudaMalloc(&a, size) == cudaSuccess && cudaMalloc(&b, size) == cudaSuccess) {
      for (int t = 0; t < 5; t++) {
        double t0 = now_ms();
        cudaMemcpy(b, a, size, cudaMemcpyDeviceToDevice);
        cudaDeviceSynchronize();
        tc.push_back(now_ms() - t0);
      }
      cudaFree(a);
      cudaFree(b);
    }
    double r = median(tr), c = median(tc);
    printf("| %zu MiB | %d/%d | %d | %d | %.3f | %.3f | %.3f | %.3f | %s |\n", mb, moved, trials, mirrored, failures, median(tm), median(tmi), r, c,
           r > 0 ? (char*)std::to_string(c / r).c_str() : "-");
  }
  for (void* p : live) cudaFree(p);
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && !strcmp(argv[1], "consume")) return consume();
  cuInit(0);
  cudaFree(0);
  static char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) { perror("readlink"); return 2; }
  self[n] = 0;
  if (argc > 3 && !strcmp(argv[1], "run")) return run(self, argv[2], argc - 3, argv + 3);
  if (argc > 1 && !strcmp(argv[1], "bench")) return bench();
  if (argc > 2 && !strcmp(argv[1], "two")) return two_gpus(self, argv[2], argc > 3 && !strcmp(argv[3], "early"));
  fprintf(stderr, "usage: ipc_test run CONSUMER_PRELOAD|- SIZES_MIB... | two CONSUMER_PRELOAD|- [early] | bench\n");
  return 2;
}
