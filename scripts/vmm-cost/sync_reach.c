/* Which of a program's synchronizing and event calls reach a library that stands in front of
 * the driver's lookup: PyTorch links its CUDA runtime statically, and its kernel launches
 * never reach a hook; do its synchronizations, event records and captures? An LD_PRELOAD
 * library that wraps the functions `cuGetProcAddress` hands out (and the exported driver
 * symbols) and counts their calls, printed to stderr at exit.
 *
 *     gcc -shared -fPIC -O2 -o libsyncreach.so sync_reach.c -ldl
 *     LD_PRELOAD=$PWD/libsyncreach.so python3 sync_reach.py
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef uint64_t (*fn6)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);

static const char *names[] = {
    "cuCtxSynchronize",     "cuStreamSynchronize",  "cuEventSynchronize",
    "cuEventRecord",        "cuEventRecordWithFlags", "cuStreamQuery",
    "cuEventQuery",         "cuStreamBeginCapture", "cuStreamEndCapture",
    "cuIpcGetEventHandle",  "cuStreamWaitEvent",    "cuEventCreate",
    "cuLaunchKernel",       "cuMemcpyAsync",        "cuMemcpyDtoDAsync",
    "cuStreamCreate",       "cuStreamBeginCaptureToGraph", "cuThreadExchangeStreamCaptureMode",
    "cuStreamIsCapturing",  "cuStreamGetCaptureInfo", "cuGraphLaunch",
};
#define N (sizeof(names) / sizeof(names[0]))
/* Up to 4 variants a name (flags of the lookup: per-thread default stream or not). */
#define V 4
static fn6 real_[N][V];
static _Atomic long calls[N][V];
static long lookups[N][V];
static uint64_t lookup_flags[N][V];

#define W(i, v)                                                                          \
    static uint64_t w_##i##_##v(uint64_t a, uint64_t b, uint64_t c, uint64_t d,          \
                                uint64_t e, uint64_t f) {                                \
        atomic_fetch_add(&calls[i][v], 1);                                               \
        return real_[i][v](a, b, c, d, e, f);                                            \
    }
#define W4(i) W(i, 0) W(i, 1) W(i, 2) W(i, 3)
W4(0) W4(1) W4(2) W4(3) W4(4) W4(5) W4(6) W4(7) W4(8) W4(9) W4(10) W4(11) W4(12) W4(13)
W4(14) W4(15) W4(16) W4(17) W4(18) W4(19) W4(20)
#define R(i) {w_##i##_0, w_##i##_1, w_##i##_2, w_##i##_3}
static fn6 wrappers[N][V] = {R(0),  R(1),  R(2),  R(3),  R(4),  R(5),  R(6),
                             R(7),  R(8),  R(9),  R(10), R(11), R(12), R(13),
                             R(14), R(15), R(16), R(17), R(18), R(19), R(20)};

static void wrap(const char *sym, void **pfn, uint64_t flags) {
    if (!sym || !pfn || !*pfn) return;
    for (unsigned i = 0; i < N; i++) {
        if (strcmp(sym, names[i])) continue;
        for (unsigned v = 0; v < V; v++) {
            if (real_[i][v] == (fn6)*pfn || real_[i][v] == NULL) {
                real_[i][v] = (fn6)*pfn;
                lookups[i][v]++;
                lookup_flags[i][v] = flags;
                *pfn = (void *)wrappers[i][v];
                return;
            }
        }
    }
}

typedef int (*gpa2_t)(const char *, void **, int, uint64_t, void *);
typedef int (*gpa_t)(const char *, void **, int, uint64_t);
typedef void *(*dlsym_t)(void *, const char *);
static gpa2_t real_gpa2;
static gpa_t real_gpa;

static dlsym_t real_dlsym(void) {
    static dlsym_t real;
    if (!real) real = (dlsym_t)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    return real;
}

int cuGetProcAddress(const char *sym, void **pfn, int version, uint64_t flags);
int cuGetProcAddress_v2(const char *sym, void **pfn, int version, uint64_t flags, void *st);

/* A runtime that looks the lookup up through the lookup (CUDA 12's runtime asks for
 * `cuGetProcAddress` at version 12000 and gets `_v2`) keeps going through this library. */
static int lookup_itself(const char *sym, void **pfn, int version) {
    if (!sym || !pfn || !*pfn || strcmp(sym, "cuGetProcAddress")) return 0;
    if (version >= 12000) {
        real_gpa2 = (gpa2_t)*pfn;
        *pfn = (void *)cuGetProcAddress_v2;
    } else {
        real_gpa = (gpa_t)*pfn;
        *pfn = (void *)cuGetProcAddress;
    }
    return 1;
}

int cuGetProcAddress_v2(const char *sym, void **pfn, int version, uint64_t flags, void *st) {
    if (!real_gpa2) real_gpa2 = (gpa2_t)real_dlsym()(RTLD_NEXT, "cuGetProcAddress_v2");
    int r = real_gpa2(sym, pfn, version, flags, st);
    if (r == 0 && !lookup_itself(sym, pfn, version)) wrap(sym, pfn, flags);
    return r;
}

int cuGetProcAddress(const char *sym, void **pfn, int version, uint64_t flags) {
    if (!real_gpa) real_gpa = (gpa_t)real_dlsym()(RTLD_NEXT, "cuGetProcAddress");
    int r = real_gpa(sym, pfn, version, flags);
    if (r == 0 && !lookup_itself(sym, pfn, version)) wrap(sym, pfn, flags);
    return r;
}

/* The runtime dlopens the driver and looks `cuGetProcAddress` up by handle, where LD_PRELOAD
 * does not reach: hand out the wrappers above there too (lookups by handle only). */
void *dlsym(void *handle, const char *name) {
    void *p = real_dlsym()(handle, name);
    if (p && handle != RTLD_NEXT && handle != RTLD_DEFAULT) {
        if (!strcmp(name, "cuGetProcAddress_v2")) {
            real_gpa2 = (gpa2_t)p;
            return (void *)cuGetProcAddress_v2;
        }
        if (!strcmp(name, "cuGetProcAddress")) {
            real_gpa = (gpa_t)p;
            return (void *)cuGetProcAddress;
        }
    }
    return p;
}

__attribute__((destructor)) static void report(void) {
    for (unsigned i = 0; i < N; i++)
        for (unsigned v = 0; v < V; v++)
            if (lookups[i][v])
                fprintf(stderr, "REACH %-34s flags %llu lookups %ld calls %ld\n", names[i],
                        (unsigned long long)lookup_flags[i][v], lookups[i][v],
                        atomic_load(&calls[i][v]));
}
