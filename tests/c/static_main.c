/* A program built with the fake static runtime (static_rt.c) and linked against neither
 * libcudart nor libcuda, for expseg's preload tests. Prints key=value lines. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cudaMalloc(void**, size_t);
int cudaFree(void*);
int cudaMemGetInfo(size_t*, size_t*);

#define MIB ((size_t)1 << 20)
#define CHECK(c) do { if (!(c)) { printf("check_failed=%s:%d %s\n", __FILE__, __LINE__, #c); exit(1); } } while (0)

static long (*count)(const char*);

int main(void) {
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
