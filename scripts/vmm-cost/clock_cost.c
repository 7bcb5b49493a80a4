/* One clock read, cold and warm: clock_gettime(CLOCK_MONOTONIC) (what Instant::now() does) after
 * 16 MiB written (the program's work between two allocator calls) and right after another
 * read, against a bare rdtsc, in TSC cycles.  gcc -O2 -o clock_cost clock_cost.c && ./clock_cost */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <x86intrin.h>
static char *buf; static size_t N=16<<20;
static void evict(){ for(size_t i=0;i<N;i+=64) buf[i]++; }
int main(){ buf=malloc(N); memset(buf,1,N); struct timespec t; unsigned long long a,b,cold=0,warm=0,rd=0; int R=2000;
 for(int i=0;i<R;i++){ evict(); _mm_lfence(); a=__rdtsc(); _mm_lfence(); clock_gettime(CLOCK_MONOTONIC,&t); _mm_lfence(); b=__rdtsc(); cold+=b-a;
   a=__rdtsc(); _mm_lfence(); clock_gettime(CLOCK_MONOTONIC,&t); _mm_lfence(); b=__rdtsc(); warm+=b-a;
   evict(); a=__rdtsc(); _mm_lfence(); unsigned long long x=__rdtsc(); _mm_lfence(); b=__rdtsc(); rd+=b-a; (void)x; }
 printf("cycles: clock_gettime cold %.0f warm %.0f; rdtsc cold %.0f\n",(double)cold/R,(double)warm/R,(double)rd/R);
 a=__rdtsc(); struct timespec s,e; clock_gettime(CLOCK_MONOTONIC,&s); for(volatile int i=0;i<100000000;i++); clock_gettime(CLOCK_MONOTONIC,&e); b=__rdtsc();
 printf("tsc GHz %.3f\n",(b-a)/((e.tv_sec-s.tv_sec)*1e9+(e.tv_nsec-s.tv_nsec)));
 return 0;}
