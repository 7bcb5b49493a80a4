// A watchdog for the probes whose calls may never return: the step under way is named
// (probe_begin before it, probe_end after), and one that takes longer than the limit ends the
// probe with "HANG at STEP" (exit 3), plus what probe_hang_note prints when it is set.
#pragma once
#include <pthread.h>
#include <unistd.h>
#include "probe.cuh"

static const char* volatile probe_step = "start";
static volatile double probe_step_t0 = 0;
static double probe_limit_ms = 3000;
static void (*probe_hang_note)(void) = 0;

static inline void probe_begin(const char* step) {
  probe_step = step;
  probe_step_t0 = now_ms();
}

// Milliseconds since probe_begin; the watchdog stops watching.
static inline double probe_end(void) {
  double t = now_ms() - probe_step_t0;
  probe_step_t0 = 0;
  return t;
}

static void* probe_watchdog(void*) {
  for (;;) {
    usleep(100000);
    double t0 = probe_step_t0;
    if (t0 > 0 && now_ms() - t0 > probe_limit_ms) {
      printf("HANG at %s", probe_step);
      if (probe_hang_note) probe_hang_note();
      printf("\n");
      fflush(stdout);
      _exit(3);
    }
  }
}

// Start watching, with a step that may take at most `limit_ms`.
static inline void probe_watch(double limit_ms) {
  probe_limit_ms = limit_ms;
  pthread_t t;
  pthread_create(&t, 0, probe_watchdog, 0);
}
