/* A stand-in for torch_memory_saver's preload hook (hook mode): inside a region (a thread's
 * flag, as the real one keeps it) its cudaMalloc is the one that serves; here it counts, and
 * takes the memory from the next cudaMalloc in line. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
static __thread bool region;
static long served;
void tms_set_interesting_region(bool v) { region = v; }
bool tms_get_interesting_region(void) { return region; }
long fake_tms_served(void) { return served; }
int cudaMalloc(void** p, size_t n) {
  if (region) served++;
  int (*next)(void**, size_t) = (int (*)(void**, size_t))dlsym(RTLD_NEXT, "cudaMalloc");
  return next(p, n);
}
