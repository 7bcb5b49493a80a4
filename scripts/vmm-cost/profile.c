// LD_PRELOAD profiler of the allocation calls PyTorch makes: the runtime's cudaMalloc/cudaFree
// (the default allocator's) and the driver VMM calls it reaches through the runtime's entry point
// API (expandable segments'), and the waits for the device (stream, device and event
// synchronizes). PROF_OUT=FILE appends the totals at exit (%p: the pid).
//   gcc -O2 -shared -fPIC -o libprof.so profile.c -ldl
// Built with -DSYNC_ONLY it times the waits alone, so it can go before libexpseg.so in
// LD_PRELOAD (expseg hands its VMM hooks only to PyTorch's own entry-point lookups).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <stdlib.h>
#include <unistd.h>
typedef int (*f5)(void*,void*,void*,void*,void*);
enum { CREATE, MAP, ACCESS, UNMAP, RELEASE, RESERVE, FREEVA, SYNC, MALLOC, FREE, DEVSYNC, EVSYNC, NK };
static const char* names[NK]={"cuMemCreate","cuMemMap","cuMemSetAccess","cuMemUnmap","cuMemRelease","cuMemAddressReserve","cuMemAddressFree","cudaStreamSynchronize","cudaMalloc","cudaFree","cudaDeviceSynchronize","cudaEventSynchronize"};
static void* realf[NK] __attribute__((unused)); static double tot[NK]; static long cnt[NK]; static unsigned long long bytes[NK];
static double now(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec*1e6+t.tv_nsec/1e3; }
#define W(k, ...) double a=now(); int r=((int(*)())realf[k])(__VA_ARGS__); tot[k]+=now()-a; cnt[k]++; return r;
#ifndef SYNC_ONLY
static int w_create(void* h, size_t s, void* p, unsigned long long f){ bytes[CREATE]+=s; W(CREATE,h,s,p,f) }
static int w_map(uint64_t v, size_t s, size_t o, uint64_t h, unsigned long long f){ bytes[MAP]+=s; W(MAP,v,s,o,h,f) }
static int w_access(uint64_t v, size_t s, void* d, size_t c){ bytes[ACCESS]+=s; W(ACCESS,v,s,d,c) }
static int w_unmap(uint64_t v, size_t s){ bytes[UNMAP]+=s; W(UNMAP,v,s) }
static int w_release(uint64_t h){ W(RELEASE,h) }
static int w_reserve(void* p, size_t s, size_t al, uint64_t ad, unsigned long long f){ bytes[RESERVE]+=s; W(RESERVE,p,s,al,ad,f) }
static int w_freeva(uint64_t v, size_t s){ W(FREEVA,v,s) }
static void* wrap(const char* n, void* p){
  if(!p) return p;
  struct { const char* n; int k; void* w; } t[] = {{"cuMemCreate",CREATE,w_create},{"cuMemMap",MAP,w_map},{"cuMemSetAccess",ACCESS,w_access},{"cuMemUnmap",UNMAP,w_unmap},{"cuMemRelease",RELEASE,w_release},{"cuMemAddressReserve",RESERVE,w_reserve},{"cuMemAddressFree",FREEVA,w_freeva}};
  for(unsigned i=0;i<sizeof t/sizeof t[0];i++) if(!strcmp(n,t[i].n)){ realf[t[i].k]=p; return t[i].w; }
  return p;
}
int cudaGetDriverEntryPoint(const char* s, void** pfn, unsigned long long fl, void* st){
  static int(*n)(const char*,void**,unsigned long long,void*); if(!n) n=dlsym(RTLD_NEXT,"cudaGetDriverEntryPoint");
  int r=n(s,pfn,fl,st); if(!r && pfn) *pfn=wrap(s,*pfn); return r; }
int cudaGetDriverEntryPointByVersion(const char* s, void** pfn, unsigned v, unsigned long long fl, void* st){
  static int(*n)(const char*,void**,unsigned,unsigned long long,void*); if(!n) n=dlsym(RTLD_NEXT,"cudaGetDriverEntryPointByVersion");
  int r=n(s,pfn,v,fl,st); if(!r && pfn) *pfn=wrap(s,*pfn); return r; }
#endif
int cudaStreamSynchronize(void* s){ static int(*n)(void*); if(!n) n=dlsym(RTLD_NEXT,"cudaStreamSynchronize"); double a=now(); int r=n(s); tot[SYNC]+=now()-a; cnt[SYNC]++; return r; }
int cudaDeviceSynchronize(void){ static int(*n)(void); if(!n) n=dlsym(RTLD_NEXT,"cudaDeviceSynchronize"); double a=now(); int r=n(); tot[DEVSYNC]+=now()-a; cnt[DEVSYNC]++; return r; }
int cudaEventSynchronize(void* e){ static int(*n)(void*); if(!n) n=dlsym(RTLD_NEXT,"cudaEventSynchronize"); double a=now(); int r=n(e); tot[EVSYNC]+=now()-a; cnt[EVSYNC]++; return r; }
#ifndef SYNC_ONLY
int cudaMalloc(void** p, size_t s){ static int(*n)(void**,size_t); if(!n) n=dlsym(RTLD_NEXT,"cudaMalloc"); double a=now(); int r=n(p,s); tot[MALLOC]+=now()-a; cnt[MALLOC]++; bytes[MALLOC]+=s; return r; }
int cudaFree(void* p){ static int(*n)(void*); if(!n) n=dlsym(RTLD_NEXT,"cudaFree"); double a=now(); int r=n(p); tot[FREE]+=now()-a; cnt[FREE]++; return r; }
#endif
__attribute__((destructor)) static void fin(){ const char* o=getenv("PROF_OUT"); char path[512]; FILE* f=stderr;
  if(o){ const char* q=strstr(o,"%p"); if(q) snprintf(path,sizeof path,"%.*s%d%s",(int)(q-o),o,(int)getpid(),q+2); else snprintf(path,sizeof path,"%s",o); f=fopen(path,"a"); }
  if(!f) return;
  for(int k=0;k<NK;k++) if(cnt[k]) fprintf(f,"%-22s n=%8ld total=%10.1f ms mean=%7.2f us bytes=%.1f GiB\n",names[k],cnt[k],tot[k]/1e3,tot[k]/cnt[k],bytes[k]/1073741824.0);
  if(f!=stderr) fclose(f); }
