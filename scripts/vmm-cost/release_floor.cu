// The driver's floor for a churn step when every released byte goes back to the driver at
// once (the contract of issue 21): what each way of holding physical memory costs per step,
// with the time split per driver call. A step acquires TOTAL GiB as 0.05-0.6 GiB tensors
// (each rounded up to 20 MiB pages, as PyTorch's expandable segments map them), writes every
// third whole and 4 KiB of the others, waits for the device, then unmaps and releases all.
// Nothing is kept between steps in any mode. Modes (each step's bytes and layout identical):
//   tensor         one handle per tensor, new sizes every step (expseg at EXPSEG_RELEASE_DELAY=0)
//   tensor-same    the same, with the same sizes every step
//   tensor-sparse  the same as tensor, 4 KiB written per tensor
//   tensor-pause   the same as tensor, 100 ms of quiet (not timed) after each step's release
//   chunks256      256 MiB handles back to back, plus one for the remainder
//   pow2           handles of power-of-two sizes (2 MiB .. 1 GiB) back to back
//   behind         tensor, cuMemRelease on a helper thread, drained before the step ends
//   cudaMalloc     cudaMalloc/cudaFree per tensor
//   tensor-batched tensor, but every handle unmapped first, then all released
//   tensor-p20/p50 tensor with 20/50 ms of quiet after each step
//   tensor-none    tensor, nothing written
//   pow2-pause     pow2 with 100 ms of quiet after each step
//   pow2min64      power-of-two handles down to 64 MiB, the rest as one handle
//   group2g        handles of up to 2 GiB covering several tensors back to back
//   held           tensor-same, but the handles are created once and kept: each step maps,
//                  sets access, writes, unmaps (what keeping released handles costs; not the
//                  contract: nothing goes back to the driver)
// FLOOR_BUDGET_GIB=N: hold all but N GiB of the device's free memory in this process first
// (cudaMalloc), so that each step must take back the memory the step before gave back, as a
// benchmark under a memory budget does (the bench's churn budget is 56).
// Modes to run may be named after the two numbers (default: all).
// Driver API only (no kernels): nvcc -O2 -o release_floor release_floor.cu -lcuda
//   ./release_floor [TOTAL_GIB=48] [STEPS=9]
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>
#include "probe.cuh"

#define PG (20ull << 20)
#define GR (2ull << 20)

enum { CREATE, MAP, ACCESS, WRITE, SYNC, UNMAP, RELEASE, NOPS };
static const char* OPS[NOPS] = {"create", "map", "access", "write", "sync", "unmap", "release"};
static double op_ms[NOPS];
#define T(op, x)                 \
  do {                           \
    double t_ = now_ms();        \
    CK(x);                       \
    op_ms[op] += now_ms() - t_;  \
  } while (0)

static std::mutex mu;
static std::condition_variable cv;
static std::deque<CUmemGenericAllocationHandle> q;
static int busy = 0;
static bool stop = false;
static void releaser(CUcontext ctx) {
  cuCtxSetCurrent(ctx);
  for (;;) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [] { return stop || !q.empty(); });
    if (q.empty() && stop) return;
    auto h = q.front();
    q.pop_front();
    busy++;
    l.unlock();
    CK(cuMemRelease(h));
    l.lock();
    busy--;
    cv.notify_all();
  }
}
static void drain() {
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [] { return q.empty() && busy == 0; });
}

// The handle sizes that cover `need` bytes in mode m.
static std::vector<size_t> pieces(int chunking, size_t need) {
  std::vector<size_t> out;
  if (chunking == 0 || chunking == 4) {
    out.push_back(need);
  } else if (chunking == 3) {
    for (size_t b = 1ull << 30; b >= (64ull << 20); b >>= 1)
      while (need >= b) { out.push_back(b); need -= b; }
    if (need) out.push_back(need);
  } else if (chunking == 1) {
    const size_t C = 256ull << 20;
    while (need >= C) { out.push_back(C); need -= C; }
    if (need) out.push_back(need);
  } else {
    for (size_t b = 1ull << 30; b >= GR; b >>= 1)
      while (need >= b) { out.push_back(b); need -= b; }
  }
  return out;
}

// write: 0 a third whole, 1 4 KiB each, 2 nothing; pause: ms of quiet after each step.
struct Mode { const char* name; int chunking; bool same; int write; int pause; bool behind; bool malloc; bool batched; bool held; };
static std::vector<CUmemGenericAllocationHandle> held_hs;

int main(int argc, char** argv) {
  double total = argc > 1 ? atof(argv[1]) : 48.0;
  int steps = argc > 2 ? atoi(argv[2]) : 9;
  setvbuf(stdout, NULL, _IONBF, 0);
  cudaFree(0);
  if (getenv("FLOOR_BUDGET_GIB")) {
    size_t fr, tot;
    cudaMemGetInfo(&fr, &tot);
    size_t budget = (size_t)(atof(getenv("FLOOR_BUDGET_GIB")) * (1ull << 30));
    void* fill;
    if (fr > budget && cudaMalloc(&fill, fr - budget) == cudaSuccess)
      printf("budget: %.1f GiB free of %.1f (held %.1f GiB)\n", budget / 1073741824.0, tot / 1073741824.0, (fr - budget) / 1073741824.0);
  }
  CUcontext ctx;
  cuCtxGetCurrent(&ctx);
  CUmemAllocationProp P;
  memset(&P, 0, sizeof P);
  P.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  P.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  P.location.id = 0;
  P.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemAccessDesc A;
  memset(&A, 0, sizeof A);
  A.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  A.location.id = 0;
  A.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t vasz = (size_t)(total * 1.3 * (1ull << 30) / PG + 64) * PG;
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, vasz, 0, 0, 0));
  std::thread th(releaser, ctx);
  const Mode modes[] = {
      {"tensor", 0, false, 0, 0, false, false, false, false},
      {"tensor-same", 0, true, 0, 0, false, false, false, false},
      {"tensor-sparse", 0, false, 1, 0, false, false, false, false},
      {"tensor-pause", 0, false, 0, 100, false, false, false, false},
      {"chunks256", 1, false, 0, 0, false, false, false, false},
      {"pow2", 2, false, 0, 0, false, false, false, false},
      {"behind", 0, false, 0, 0, true, false, false, false},
      {"cudaMalloc", 0, false, 0, 0, false, true, false},
      {"tensor-batched", 0, false, 0, 0, false, false, true, false},
      {"tensor-p20", 0, false, 0, 20, false, false, false, false},
      {"tensor-p50", 0, false, 0, 50, false, false, false, false},
      {"tensor-none", 0, false, 2, 0, false, false, false, false},
      {"pow2-pause", 2, false, 0, 100, false, false, false, false},
      {"pow2min64", 3, false, 0, 0, false, false, false, false},
      {"group2g", 4, false, 0, 0, false, false, false, false},
      {"held", 0, true, 0, 0, false, false, false, true},
  };
  const int M = sizeof modes / sizeof modes[0];
  bool run[M];
  for (int m = 0; m < M; m++) {
    run[m] = argc <= 3;
    for (int a = 3; a < argc; a++) run[m] |= strcmp(argv[a], modes[m].name) == 0;
  }
  std::vector<double> res[M], ops[M][NOPS];
  std::vector<double> handles[M];
  // Modes in turn, each `steps` steps back to back (the first not counted), twice.
  for (int round = 0; round < 2; round++)
    for (int m = 0; m < M; m++) {
      for (int s = 0; s < steps && run[m]; s++) {
        const Mode& md = modes[m];
        srand(md.same ? 7 : 1 + s + 100 * round);
        std::vector<size_t> sz;
        double got = 0;
        while (got < total * (1ull << 30)) {
          size_t n = (size_t)((0.05 + 0.55 * (rand() / (double)RAND_MAX)) * (1ull << 30));
          sz.push_back(n);
          got += n;
        }
        memset(op_ms, 0, sizeof op_ms);
        size_t nh = 0;
        CK(cuCtxSynchronize());
        double t0 = now_ms();
        if (!md.malloc) {
          std::vector<CUmemGenericAllocationHandle> hs;
          std::vector<std::pair<CUdeviceptr, size_t>> maps;
          CUdeviceptr cur = va;
          // group2g: one handle per group of tensors of up to 2 GiB, mapped back to back.
          std::vector<size_t> group_of(sz.size(), 0);
          if (md.chunking == 4) {
            size_t acc = 0, g = 0;
            for (size_t i = 0; i < sz.size(); i++) {
              size_t need = (sz[i] + PG - 1) / PG * PG;
              if (acc + need > (2ull << 30)) { g++; acc = 0; }
              group_of[i] = g;
              acc += need;
            }
          }
          for (size_t i = 0; i < sz.size(); i++) {
            size_t n = sz[i], need = (n + PG - 1) / PG * PG;
            CUdeviceptr b = cur;
            if (md.chunking == 4) {
              if (i == 0 || group_of[i] != group_of[i - 1]) {
                size_t gsz = 0;
                for (size_t j = i; j < sz.size() && group_of[j] == group_of[i]; j++) gsz += (sz[j] + PG - 1) / PG * PG;
                CUmemGenericAllocationHandle h;
                T(CREATE, cuMemCreate(&h, gsz, &P, 0));
                T(MAP, cuMemMap(cur, gsz, 0, h, 0));
                T(ACCESS, cuMemSetAccess(cur, gsz, &A, 1));
                hs.push_back(h);
                maps.push_back({cur, gsz});
              }
              cur += need;
              if (i % 3 == 0 && md.write == 0) T(WRITE, cuMemsetD32Async(b, 4, n / 4, 0));
              continue;
            }
            for (size_t piece : pieces(md.chunking, need)) {
              CUmemGenericAllocationHandle h;
              if (md.held && hs.size() < held_hs.size()) {
                h = held_hs[hs.size()];
              } else {
                T(CREATE, cuMemCreate(&h, piece, &P, 0));
                if (md.held) held_hs.push_back(h);
              }
              T(MAP, cuMemMap(cur, piece, 0, h, 0));
              hs.push_back(h);
              maps.push_back({cur, piece});
              cur += piece;
            }
            T(ACCESS, cuMemSetAccess(b, need, &A, 1));
            if (i % 3 == 0 && md.write == 0)
              T(WRITE, cuMemsetD32Async(b, 4, n / 4, 0));
            else if (md.write < 2)
              T(WRITE, cuMemsetD32Async(b, 4, 1024, 0));
          }
          T(SYNC, cuCtxSynchronize());
          nh = hs.size();
          if (md.batched)
            for (auto& mp : maps) T(UNMAP, cuMemUnmap(mp.first, mp.second));
          for (size_t i = 0; i < maps.size(); i++) {
            if (!md.batched) T(UNMAP, cuMemUnmap(maps[i].first, maps[i].second));
            if (md.behind) {
              std::lock_guard<std::mutex> l(mu);
              q.push_back(hs[i]);
              cv.notify_all();
            } else if (!md.held) {
              T(RELEASE, cuMemRelease(hs[i]));
            }
          }
          if (md.behind) {
            double t = now_ms();
            drain();
            op_ms[RELEASE] += now_ms() - t;
          }
        } else {
          std::vector<void*> ps;
          for (size_t i = 0; i < sz.size(); i++) {
            void* p;
            double t = now_ms();
            if (cudaMalloc(&p, sz[i])) { printf("cudaMalloc failed\n"); exit(1); }
            op_ms[CREATE] += now_ms() - t;
            ps.push_back(p);
            if (i % 3 == 0)
              T(WRITE, cuMemsetD32Async((CUdeviceptr)p, 4, sz[i] / 4, 0));
            else
              T(WRITE, cuMemsetD32Async((CUdeviceptr)p, 4, 1024, 0));
          }
          T(SYNC, cuCtxSynchronize());
          nh = ps.size();
          for (void* p : ps) {
            double t = now_ms();
            cudaFree(p);
            op_ms[RELEASE] += now_ms() - t;
          }
        }
        CK(cuCtxSynchronize());
        double dt = now_ms() - t0;
        if (md.pause) usleep(md.pause * 1000);
        if (s > 0) {
          res[m].push_back(dt);
          for (int o = 0; o < NOPS; o++) ops[m][o].push_back(op_ms[o]);
          handles[m].push_back((double)nh);
        }
      }
      // The kept handles of mode held go back once its steps are done.
      for (auto h : held_hs) CK(cuMemRelease(h));
      held_hs.clear();
    }
  {
    std::lock_guard<std::mutex> l(mu);
    stop = true;
    cv.notify_all();
  }
  th.join();
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  printf("%.0f GiB a step as 0.05-0.6 GiB tensors; median ms per step over %d x 2 steps\n", total, steps - 1);
  printf("%-14s %8s %8s", "mode", "step", "handles");
  for (int o = 0; o < NOPS; o++) printf(" %8s", OPS[o]);
  printf("\n");
  for (int m = 0; m < M; m++) {
    if (!run[m]) continue;
    printf("%-14s %8.1f %8.0f", modes[m].name, med(res[m]), med(handles[m]));
    for (int o = 0; o < NOPS; o++) printf(" %8.1f", med(ops[m][o]));
    printf("\n");
  }
  return 0;
}
