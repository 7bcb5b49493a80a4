/* A library loaded with RTLD_LOCAL that links the runtime, as Python extensions do: its
 * cudaMalloc reaches expseg, which must find the runtime with the RTLD_NOLOAD fallback. */
#include <stddef.h>
int cudaMalloc(void**, size_t);
int cudaFree(void*);
int plugin_alloc(void** p, size_t n) { return cudaMalloc(p, n); }
int plugin_free(void* p) { return cudaFree(p); }
