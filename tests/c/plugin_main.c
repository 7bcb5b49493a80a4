/* Loads libplugin.so with RTLD_LOCAL (it links the fake runtime) and allocates through it:
 * the runtime is then not in the global scope, as in a Python process. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB ((size_t)1 << 20)
#define CHECK(c) do { if (!(c)) { printf("check_failed=%s:%d %s\n", __FILE__, __LINE__, #c); exit(1); } } while (0)
static void fill(void* p, size_t n, unsigned char v) { memset(p, v, n); }
static int holds(const void* p, size_t n, unsigned char v) {
  const unsigned char* c = p; for (size_t i = 0; i < n; i += 4093) if (c[i] != v) return 0; return c[n - 1] == v;
}

static int plugin(void) {
  void* h = dlopen("libplugin.so", RTLD_NOW | RTLD_LOCAL);
  CHECK(h);
  int (*pa)(void**, size_t) = (int (*)(void**, size_t))dlsym(h, "plugin_alloc");
  int (*pf)(void*) = (int (*)(void*))dlsym(h, "plugin_free");
  void* cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  long (*count)(const char*) = (long (*)(const char*))dlsym(cu, "fakecu_count");
  void* p; printf("plugin_malloc_rc=%d\n", pa(&p, 4 * MIB));
  printf("plugin_pooled=%d\n", count("cuMemCreate") > 0);
  fill(p, 4 * MIB, 3); CHECK(holds(p, 4 * MIB, 3));
  printf("plugin_free_rc=%d\n", pf(p));
  return 0;
}


int main(void) { return plugin(); }
