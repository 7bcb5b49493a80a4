/* A stand-in for NVML (libnvidia-ml.so.1), the three calls expseg's EXPSEG_KEEP=auto makes: the
 * processes on a GPU are the pids in the file FAKE_NVML_PIDS ("self": the asking process),
 * read at every call; the GPU is the fake driver's (UUID GPU-face0000-...-0000000000NN). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } Proc;

int nvmlInit_v2(void) { return 0; }

int nvmlDeviceGetHandleByUUID(const char* uuid, void** h) {
  if (strncmp(uuid, "GPU-face0000-0000-0000-0000-0000000000", 38) || strlen(uuid) != 40) return 13; /* not found */
  *h = (void*)(strtoul(uuid + 38, 0, 16) + 1);
  return 0;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void* h, unsigned int* count, Proc* out) {
  (void)h;
  const char* path = getenv("FAKE_NVML_PIDS");
  FILE* f = path ? fopen(path, "r") : 0;
  unsigned int n = 0;
  char word[32];
  Proc got[64];
  while (f && n < 64 && fscanf(f, "%31s", word) == 1) {
    memset(&got[n], 0, sizeof got[n]);
    got[n++].pid = !strcmp(word, "self") ? (unsigned int)getpid() : (unsigned int)strtoul(word, 0, 10);
  }
  if (f) fclose(f);
  if (n > *count) { *count = n; return 7; } /* NVML_ERROR_INSUFFICIENT_SIZE */
  memcpy(out, got, n * sizeof(Proc));
  *count = n;
  return 0;
}
