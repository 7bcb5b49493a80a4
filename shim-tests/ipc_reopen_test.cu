// GPU test of a handle opened, read, written and closed again each round (a weight sync that
// shares the same buffer every step), and of the memory coming back when the producer frees
// it or exits. Built with `nvcc -cudart shared`; shim-tests/run.sh runs it.
//
//   ipc_reopen_test run MIB ROUNDS CONSUMER_PRELOAD   starts the producer (this binary, in
//       this environment: under expseg or not) and the consumer (this binary, with
//       LD_PRELOAD=CONSUMER_PRELOAD, "-" for none), joined by two pipes. Each round
//       the producer fills the buffer with the round's value and synchronizes; the consumer
//       opens the handle, checks both ends, writes its answer into the first word and closes;
//       the producer checks the answer. Then the producer frees the buffer and the consumer
//       measures how much device memory came back (cudaMemGetInfo before and after); then a
//       second buffer is shared, opened and closed once, and the producer exits without a
//       free: the consumer measures again 300 ms after its exit.
// Prints JSON lines: the producer's answers seen and its free's time; the consumer's rounds
// right, open and close medians (rounds 2 on), MiB back after the free and after the exit; exit
// status 0 when every round was right both ways.
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <vector>

#define MIB ((size_t)1 << 20)
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(2); } } while (0)
static double now_ms() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
static void put(int fd, const void* b, size_t n) { if (write(fd, b, n) != (ssize_t)n) exit(3); }
static void get(int fd, void* b, size_t n) { if (read(fd, b, n) != (ssize_t)n) exit(4); }
static double median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
static double free_mib() { size_t f, t; CK(cudaMemGetInfo(&f, &t)); return f / (double)MIB; }

static int consume(size_t bytes, int rounds, int from, int to) {
  CK(cudaFree(0));
  std::vector<double> opens, closes;
  int right = 0;
  for (int r = 0; r < rounds; r++) {
    cudaIpcMemHandle_t h;
    get(from, &h, sizeof h);
    double t0 = now_ms();
    unsigned char* q = 0;
    cudaError_t e = cudaIpcOpenMemHandle((void**)&q, h, cudaIpcMemLazyEnablePeerAccess);
    double t1 = now_ms();
    unsigned char head = 0, tail = 0;
    if (e == cudaSuccess) {
      CK(cudaMemcpy(&head, q + 4, 1, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&tail, q + bytes - 1, 1, cudaMemcpyDeviceToHost));
      unsigned answer = 1000 + r;
      CK(cudaMemcpy(q, &answer, 4, cudaMemcpyHostToDevice));
      CK(cudaDeviceSynchronize());
    }
    double t2 = now_ms();
    if (e == cudaSuccess) CK(cudaIpcCloseMemHandle(q));
    double t3 = now_ms();
    right += e == cudaSuccess && head == (unsigned char)(r + 1) && tail == (unsigned char)(r + 1);
    if (r > 0) { opens.push_back(t1 - t0); closes.push_back(t3 - t2); }
    put(to, "a", 1);
  }
  // The producer frees the buffer: how much came back.
  double before = free_mib();
  put(to, "m", 1);
  char c;
  get(from, &c, 1);
  double after_free = free_mib() - before;
  // A second buffer, opened and closed once; the producer then exits without freeing it.
  cudaIpcMemHandle_t h2;
  get(from, &h2, sizeof h2);
  unsigned char* q2 = 0;
  int second = cudaIpcOpenMemHandle((void**)&q2, h2, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess;
  if (second) CK(cudaIpcCloseMemHandle(q2));
  before = free_mib();
  put(to, "x", 1);
  while (read(from, &c, 1) > 0) {}  // EOF: the producer exited
  usleep(300 * 1000);
  double after_exit = free_mib() - before;
  printf("{\"rounds\": %d, \"right\": %d, \"open_ms_median\": %.4f, \"close_ms_median\": %.4f, "
         "\"mib\": %zu, \"back_after_free_mib\": %.0f, \"second_opened\": %d, \"back_after_exit_mib\": %.0f}\n",
         rounds, right, median(opens), median(closes), bytes / MIB, after_free, second, after_exit);
  fflush(stdout);
  // What came back is checked by run.sh (natively a free of memory another process opened
  // through IPC gives nothing back at once: measured, H200).
  return right == rounds && second ? 0 : 1;
}

static int produce(size_t bytes, int rounds, int to, int from) {
  unsigned char* p = 0;
  CK(cudaMalloc((void**)&p, bytes));
  cudaIpcMemHandle_t h;
  CK(cudaIpcGetMemHandle(&h, p));
  int answers = 0;
  for (int r = 0; r < rounds; r++) {
    CK(cudaMemset(p, r + 1, bytes));
    CK(cudaDeviceSynchronize());
    put(to, &h, sizeof h);
    char c;
    get(from, &c, 1);
    unsigned answer = 0;
    CK(cudaMemcpy(&answer, p, 4, cudaMemcpyDeviceToHost));
    answers += answer == (unsigned)(1000 + r);
  }
  char c;
  get(from, &c, 1);
  double t0 = now_ms();
  CK(cudaFree(p));
  double free_ms = now_ms() - t0;
  put(to, "f", 1);
  unsigned char* p2 = 0;
  CK(cudaMalloc((void**)&p2, bytes));
  CK(cudaMemset(p2, 7, bytes));
  CK(cudaDeviceSynchronize());
  CK(cudaIpcGetMemHandle(&h, p2));
  put(to, &h, sizeof h);
  get(from, &c, 1);
  printf("{\"producer_answers_seen\": %d, \"free_ms\": %.3f}\n", answers, free_ms);
  fflush(stdout);
  // Exit without freeing p2: the consumer looks what comes back.
  _exit(answers == rounds ? 0 : 1);
}

// The launcher touches no GPU: it starts both sides, joined by two pipes, and waits for them.
int main(int argc, char** argv) {
  if (argc == 6 && !strcmp(argv[1], "consume"))
    return consume(strtoull(argv[2], 0, 10), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
  if (argc == 6 && !strcmp(argv[1], "produce"))
    return produce(strtoull(argv[2], 0, 10), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
  if (argc != 5 || strcmp(argv[1], "run")) {
    fprintf(stderr, "usage: %s run MIB ROUNDS CONSUMER_PRELOAD\n", argv[0]);
    return 2;
  }
  size_t bytes = strtoull(argv[2], 0, 10) * MIB;
  int down[2], up[2];
  if (pipe(down) || pipe(up)) return 2;
  char b[32], d0[16], d1[16], u0[16], u1[16];
  snprintf(b, sizeof b, "%zu", bytes);
  snprintf(d0, sizeof d0, "%d", down[0]); snprintf(d1, sizeof d1, "%d", down[1]);
  snprintf(u0, sizeof u0, "%d", up[0]); snprintf(u1, sizeof u1, "%d", up[1]);
  fflush(stdout);
  pid_t prod = fork();
  if (prod == 0) {
    close(down[0]); close(up[1]);
    execl(argv[0], argv[0], "produce", b, argv[3], d1, u0, (char*)0);
    _exit(127);
  }
  pid_t cons = fork();
  if (cons == 0) {
    close(down[1]); close(up[0]);
    if (!strcmp(argv[4], "-")) unsetenv("LD_PRELOAD"); else setenv("LD_PRELOAD", argv[4], 1);
    execl(argv[0], argv[0], "consume", b, argv[3], d0, u1, (char*)0);
    _exit(127);
  }
  close(down[0]); close(down[1]); close(up[0]); close(up[1]);
  int sp, sc;
  waitpid(prod, &sp, 0);
  waitpid(cons, &sc, 0);
  int rp = WIFEXITED(sp) ? WEXITSTATUS(sp) : 1, rc = WIFEXITED(sc) ? WEXITSTATUS(sc) : 1;
  printf("{\"producer_rc\": %d, \"consumer_rc\": %d}\n", rp, rc);
  return rp || rc;
}
