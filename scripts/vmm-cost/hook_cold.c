/* What a hook costs the program when the program's own work has evicted the caches between
 * allocator calls (as a training step's kernels launches and Python do), measured from the
 * caller's side with the TSC, so that nothing the hook does escapes the figure (the exit
 * report's own timing starts after its first clock read). No GPU: it runs on the preload
 * tests' fake driver, whose own cost is in every figure alike; compare two libraries.
 *
 * Built as libc10_cuda.so (the name expseg coalesces for) and run by the tests' pages_main:
 *   cargo test --test preload pytorch_pages_are_coalesced   # builds the fakes in target/tmp/preload
 *   d=target/tmp/preload; mkdir -p /tmp/hc
 *   gcc -O2 -shared -fPIC -o /tmp/hc/libc10_cuda.so scripts/vmm-cost/hook_cold.c $d/libcudart.so.13
 *   (cd $d && FAKE_CAPACITY=8589934592 LD_LIBRARY_PATH=. LD_PRELOAD=LIB ./pages_main /tmp/hc/libc10_cuda.so 400)
 * Prints median cycles per call for create, map, access, unmap and release over ROUNDS
 * rounds of a PyTorch-like batch (8 pages of 2 MiB: creates, maps, one access; then unmap
 * and release page by page), EVICT_MB (default 16) written between calls. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

typedef int CUresult;
typedef struct { int type; int requestedHandleTypes; struct { int type; int id; } location; void* win32; unsigned char flags[8]; } Prop;
typedef struct { struct { int type; int id; } location; int flags; } Access;
int cudaGetDriverEntryPointByVersion(const char*, void**, unsigned, unsigned long long, int*);

#define PAGE (2ull << 20)
#define NP 8
static void* get(const char* name) {
  void* f = 0; int st = 0;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, 0, &st) || !f) { fprintf(stderr, "no %s\n", name); exit(2); }
  return f;
}
static char* junk; static size_t junk_n;
static void evict(void) { for (size_t i = 0; i < junk_n; i += 64) junk[i]++; }
static int cmp(const void* a, const void* b) { uint64_t x = *(const uint64_t*)a, y = *(const uint64_t*)b; return x < y ? -1 : x > y; }
static uint64_t median(uint64_t* v, int n) { qsort(v, n, sizeof *v, cmp); return v[n / 2]; }
#define TIMED(slot, call) do { evict(); _mm_lfence(); uint64_t t0_ = __rdtsc(); _mm_lfence(); \
  if (call) { fprintf(stderr, "call failed: %s\n", #call); return 3; } \
  _mm_lfence(); s[slot][ns[slot]++] = __rdtsc() - t0_; } while (0)

int expandable(const char* what) {
  int rounds = atoi(what); if (rounds <= 0) rounds = 200;
  const char* e = getenv("EVICT_MB"); junk_n = (size_t)(e ? atoi(e) : 16) << 20;
  junk = malloc(junk_n + 64); memset(junk, 1, junk_n + 64);
  CUresult (*create)(uint64_t*, size_t, const Prop*, unsigned long long) = get("cuMemCreate");
  CUresult (*release)(uint64_t) = get("cuMemRelease");
  CUresult (*reserve)(uint64_t*, size_t, size_t, uint64_t, unsigned long long) = get("cuMemAddressReserve");
  CUresult (*map)(uint64_t, size_t, size_t, uint64_t, unsigned long long) = get("cuMemMap");
  CUresult (*unmap)(uint64_t, size_t) = get("cuMemUnmap");
  CUresult (*access_)(uint64_t, size_t, const Access*, size_t) = get("cuMemSetAccess");
  uint64_t va = 0, h[NP];
  if (reserve(&va, NP * PAGE, 0, 0, 0)) return 2;
  static const char* names[5] = {"create", "map", "access", "unmap", "release"};
  uint64_t* s[5]; int ns[5] = {0};
  for (int k = 0; k < 5; k++) s[k] = malloc(sizeof(uint64_t) * rounds * NP);
  Prop p; memset(&p, 0, sizeof p); p.type = 1; p.requestedHandleTypes = 1; p.location.type = 1;
  Access a = {{1, 0}, 3};
  for (int r = 0; r < rounds; r++) {
    for (int i = 0; i < NP; i++) TIMED(0, create(&h[i], PAGE, &p, 0));
    for (int i = 0; i < NP; i++) TIMED(1, map(va + i * PAGE, PAGE, 0, h[i], 0));
    TIMED(2, access_(va, NP * PAGE, &a, 1));
    for (int i = 0; i < NP; i++) { TIMED(3, unmap(va + i * PAGE, PAGE)); TIMED(4, release(h[i])); }
  }
  for (int k = 0; k < 5; k++) printf("%s %llu ", names[k], (unsigned long long)median(s[k], ns[k]));
  printf("(median cycles a call, %d rounds, %zu MiB evicted between calls)\n", rounds, junk_n >> 20);
  return 0;
}
