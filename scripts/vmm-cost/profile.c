// LD_PRELOAD profiler of the allocation calls PyTorch makes: the runtime's cudaMalloc/cudaFree
// (the default allocator's) and the driver VMM calls it reaches through the runtime's entry point
// API (expandable segments'), and the waits for the device (stream, device and event
// synchronizes). PROF_OUT=FILE appends the totals at exit (%p: the pid), with each kind's first
// call apart (`first=`: it may make the CUDA context). Counts are atomic (any thread may call).
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
static void* realf[NK] __attribute__((unused));
static uint64_t tot[NK], cnt[NK], bytes[NK], first[NK];  // ns, calls, bytes, ns of the first
static uint64_t now(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return (uint64_t)t.tv_sec*1000000000u+t.tv_nsec; }
static void note(int k, uint64_t t0, uint64_t b){
  uint64_t d=now()-t0;
  if(__atomic_fetch_add(&cnt[k],1,__ATOMIC_RELAXED)==0) __atomic_store_n(&first[k],d,__ATOMIC_RELAXED);
  __atomic_fetch_add(&tot[k],d,__ATOMIC_RELAXED); __atomic_fetch_add(&bytes[k],b,__ATOMIC_RELAXED); }
#define W(k, b, ...) uint64_t a=now(); int r=((int(*)())realf[k])(__VA_ARGS__); note(k,a,b); return r;
#ifndef SYNC_ONLY
static int w_create(void* h, size_t s, void* p, unsigned long long f){ W(CREATE,s,h,s,p,f) }
static int w_map(uint64_t v, size_t s, size_t o, uint64_t h, unsigned long long f){ W(MAP,s,v,s,o,h,f) }
static int w_access(uint64_t v, size_t s, void* d, size_t c){ W(ACCESS,s,v,s,d,c) }
static int w_unmap(uint64_t v, size_t s){ W(UNMAP,s,v,s) }
static int w_release(uint64_t h){ W(RELEASE,0,h) }
static int w_reserve(void* p, size_t s, size_t al, uint64_t ad, unsigned long long f){ W(RESERVE,s,p,s,al,ad,f) }
static int w_freeva(uint64_t v, size_t s){ W(FREEVA,0,v,s) }
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
int cudaStreamSynchronize(void* s){ static int(*n)(void*); if(!n) n=dlsym(RTLD_NEXT,"cudaStreamSynchronize"); uint64_t a=now(); int r=n(s); note(SYNC,a,0); return r; }
int cudaDeviceSynchronize(void){ static int(*n)(void); if(!n) n=dlsym(RTLD_NEXT,"cudaDeviceSynchronize"); uint64_t a=now(); int r=n(); note(DEVSYNC,a,0); return r; }
int cudaEventSynchronize(void* e){ static int(*n)(void*); if(!n) n=dlsym(RTLD_NEXT,"cudaEventSynchronize"); uint64_t a=now(); int r=n(e); note(EVSYNC,a,0); return r; }
#ifndef SYNC_ONLY
int cudaMalloc(void** p, size_t s){ static int(*n)(void**,size_t); if(!n) n=dlsym(RTLD_NEXT,"cudaMalloc"); uint64_t a=now(); int r=n(p,s); note(MALLOC,a,s); return r; }
int cudaFree(void* p){ static int(*n)(void*); if(!n) n=dlsym(RTLD_NEXT,"cudaFree"); uint64_t a=now(); int r=n(p); note(FREE,a,0); return r; }
#endif
__attribute__((destructor)) static void fin(){ const char* o=getenv("PROF_OUT"); char path[4096]; FILE* f=stderr;
  if(o){ const char* q=strstr(o,"%p"); if(q) snprintf(path,sizeof path,"%.*s%d%s",(int)(q-o),o,(int)getpid(),q+2); else snprintf(path,sizeof path,"%s",o); f=fopen(path,"a"); }
  if(!f) return;
  for(int k=0;k<NK;k++) if(cnt[k]) fprintf(f,"%-22s n=%8lu total=%12.3f ms mean=%9.2f us first=%10.3f ms bytes=%.1f GiB\n",names[k],(unsigned long)cnt[k],tot[k]/1e6,tot[k]/1e3/cnt[k],first[k]/1e6,bytes[k]/1073741824.0);
  if(f!=stderr) fclose(f); }
