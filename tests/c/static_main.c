/* A program built with the fake static runtime (static_rt.c) and linked against neither
 * libcudart nor libcuda, for expseg's preload tests. Prints key=value lines. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int cudaMalloc(void**, size_t);
int cudaFree(void*);
int cudaMemGetInfo(size_t*, size_t*);

#define MIB ((size_t)1 << 20)
#define CHECK(c) do { if (!(c)) { printf("check_failed=%s:%d %s\n", __FILE__, __LINE__, #c); exit(1); } } while (0)

static long (*count)(const char*);

struct IpcHandle { unsigned char b[64]; };
int cudaIpcGetMemHandle(void*, void*);
int cudaIpcOpenMemHandle(void**, struct IpcHandle, unsigned);
int cudaIpcCloseMemHandle(void*);

/* IPC of a pool allocation through the static runtime (the driver's cuIpc* functions): a
 * consumer (this program again, with or without expseg) opens the handle, checks the data
 * and writes; the producer reports whether it sees the write (both ways: a ticket). */
static int consume(void) {
  struct IpcHandle h; const char* hex = getenv("HANDLE");
  for (int i = 0; i < 64; i++) { unsigned b; sscanf(hex + 2 * i, "%2x", &b); h.b[i] = (unsigned char)b; }
  void* p = 0;
  int rc = cudaIpcOpenMemHandle(&p, h, 1);
  printf("open_rc=%d", rc);
  if (rc) { printf("\n"); return 0; }
  const unsigned char* c = p; int ok = 1;
  for (size_t i = 0; i < 64 * MIB; i += 4093) ok &= c[i] == 0x5a;
  ((unsigned char*)p)[0] = 0x77;
  printf(" consumer_data_ok=%d close_rc=%d\n", ok, cudaIpcCloseMemHandle(p));
  return 0;
}
static int ipc(const char* self, int expseg_consumer) {
  void* p = 0;
  CHECK(cudaMalloc(&p, 64 * MIB) == 0);
  memset(p, 0x5a, 64 * MIB);
  unsigned char h[64];
  int rc = cudaIpcGetMemHandle(h, p);
  printf("get_rc=%d\n", rc);
  if (rc) return 0;
  char hex[140] = "HANDLE=";
  for (int i = 0; i < 64; i++) sprintf(hex + 7 + 2 * i, "%02x", h[i]);
  putenv(hex);
  if (!expseg_consumer) unsetenv("LD_PRELOAD");
  fflush(stdout);
  char cmd[4200]; snprintf(cmd, sizeof cmd, "%s consume", self);
  int st = system(cmd);
  printf("consumer_status=%d both_ways=%d\n", st, ((unsigned char*)p)[0] == 0x77);
  printf("free_rc=%d\n", cudaFree(p));
  return 0;
}

int cudaDeviceReset(void);
long fakecu_used_via(void) { long (*u)(void) = (long (*)(void))dlsym(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "fakecu_used"); return u ? u() : -1; }

/* The static runtime's cudaDeviceReset: natively the runtime's memory goes with the context
 * and a later cudaFree of it fails (measured: 1); expseg sees the reset through the primary
 * context's new id at the next driver call and frees the pool's allocations likewise. */
static int reset(void) {
  void *p = 0, *q = 0, *r = 0;
  /* Seen at the free of an old pointer. */
  CHECK(cudaMalloc(&p, 8 * MIB) == 0);
  long used = fakecu_used_via();
  CHECK(cudaDeviceReset() == 0);
  printf("free_after_reset=%d", cudaFree(p));
  printf(" pool_gave_back=%d", fakecu_used_via() < used);
  /* Seen at the memory question, before the driver answers it. */
  CHECK(cudaMalloc(&r, 8 * MIB) == 0);
  used = fakecu_used_via();
  CHECK(cudaDeviceReset() == 0);
  size_t f0 = 0, t0 = 0, f1 = 0, t1 = 0;
  CHECK(cudaMemGetInfo(&f0, &t0) == 0);
  printf(" meminfo_gave_back=%d", fakecu_used_via() < used);
  printf(" free_after_second_reset=%d", cudaFree(r));
  CHECK(cudaMemGetInfo(&f1, &t1) == 0);
  printf(" meminfo_same=%d", f0 == f1);
  /* The pool serves the new context. */
  CHECK(cudaMalloc(&q, 8 * MIB) == 0);
  memset(q, 0x11, 8 * MIB);
  int ok = ((unsigned char*)q)[8 * MIB - 1] == 0x11;
  printf(" new_alloc_ok=%d", ok);
  printf(" new_free=%d\n", cudaFree(q));
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && !strcmp(argv[1], "consume")) return consume();
  if (argc > 1 && !strcmp(argv[1], "reset")) return reset();
  if (argc > 2 && !strcmp(argv[1], "ipc")) {
    char self[4096]; ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 2;
    self[n] = 0;
    return ipc(self, !strcmp(argv[2], "expseg"));
  }
  void *p = 0, *q = 0, *s = 0, *big = 0;
  int rc = cudaMalloc(&p, 8 * MIB);
  printf("malloc_rc=%d\n", rc);
  if (rc) return 0;
  count = (long (*)(const char*))dlsym(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "fakecu_count");
  CHECK(count);
  printf("pooled=%d\n", count("cuMemCreate") == 1 && count("cuMemAlloc_v2") == 0);
  memset(p, 0x3c, 8 * MIB);
  const unsigned char* c = p;
  int ok = 1;
  for (size_t i = 0; i < 8 * MIB; i += 4093) ok &= c[i] == 0x3c;
  printf("data_ok=%d\n", ok);
  printf("free_rc=%d\n", cudaFree(p));
  printf("free_synced=%ld\n", count("cuCtxSynchronize"));
  CHECK(cudaMalloc(&q, 8 * MIB) == 0);
  printf("same_ptr=%d creates=%ld\n", p == q, count("cuMemCreate"));
  CHECK(cudaFree(q) == 0);
  size_t fr = 0, tot = 0;
  CHECK(cudaMemGetInfo(&fr, &tot) == 0);
  printf("meminfo_free_mib=%zu\n", fr >> 20);
  CHECK(cudaMalloc(&s, 1000) == 0);
  printf("small_to_driver=%ld\n", count("cuMemAlloc_v2"));
  CHECK(cudaFree(s) == 0);
  printf("small_free_to_driver=%ld\n", count("cuMemFree_v2"));
  printf("oom_rc=%d\n", cudaMalloc(&big, 2048 * MIB));
  printf("bad_free_rc=%d\n", cudaFree((char*)q + 4096));
  return 0;
}
