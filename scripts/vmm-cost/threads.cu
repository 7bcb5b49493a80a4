// Do VMM driver calls scale across host threads? 2400 pages of 20 MiB (PyTorch's large page).
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>
#include <thread>
#include <vector>
#include <functional>
static double now_ms(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec*1e3+t.tv_nsec/1e6; }
#define PG (20ull<<20)
static CUmemAllocationProp P; static CUmemAccessDesc A; static CUcontext ctx;
static int N = 2400; static CUdeviceptr va, va2; static std::vector<CUmemGenericAllocationHandle> h, h2;
static int errs = 0;
static void par(int T, std::function<void(int,int)> f){ // f(begin,end) over N pages
  std::vector<std::thread> th; for(int t=0;t<T;t++){ int b=N*t/T, e=N*(t+1)/T; th.emplace_back([=]{ cuCtxSetCurrent(ctx); f(b,e); }); } for(auto& x: th) x.join(); }
static void run(int T, const char* label){
  double t0=now_ms(); par(T,[](int b,int e){ for(int i=b;i<e;i++) if(cuMemCreate(&h[i],PG,&P,0)) __atomic_add_fetch(&errs,1,0); });
  double t1=now_ms(); par(T,[](int b,int e){ for(int i=b;i<e;i++) if(cuMemMap(va+i*PG,PG,0,h[i],0)) __atomic_add_fetch(&errs,1,0); });
  double t2=now_ms(); par(T,[](int b,int e){ if(cuMemSetAccess(va+b*PG,(e-b)*PG,&A,1)) __atomic_add_fetch(&errs,1,0); });
  double t3=now_ms(); par(T,[](int b,int e){ for(int i=b;i<e;i++) if(cuMemUnmap(va+i*PG,PG)) __atomic_add_fetch(&errs,1,0); });
  double t4=now_ms(); par(T,[](int b,int e){ for(int i=b;i<e;i++) if(cuMemRelease(h[i])) __atomic_add_fetch(&errs,1,0); });
  double t5=now_ms();
  printf("%-10s T=%d  create %7.1f  map %6.1f  access %7.1f  unmap %7.1f  release %7.1f  total %7.1f ms  errs=%d\n", label, T, t1-t0,t2-t1,t3-t2,t4-t3,t5-t4,t5-t0, errs);
}
int main(){
  setvbuf(stdout,NULL,_IONBF,0); cudaFree(0); cuInit(0); cuCtxGetCurrent(&ctx);
  memset(&P,0,sizeof P); P.type=CU_MEM_ALLOCATION_TYPE_PINNED; P.location.type=CU_MEM_LOCATION_TYPE_DEVICE; P.location.id=0; P.requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  memset(&A,0,sizeof A); A.location.type=CU_MEM_LOCATION_TYPE_DEVICE; A.location.id=0; A.flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  h.resize(N); h2.resize(N);
  if(cuMemAddressReserve(&va, (size_t)N*PG, 0,0,0) || cuMemAddressReserve(&va2, (size_t)N*PG, 0,0,0)){ printf("reserve failed\n"); return 1; }
  run(1,"warmup");
  for(int T: {1,2,4,8,16}) run(T,"parallel");
  run(1,"serial");
  // setAccess per mapping vs once over the range (serial)
  for(int i=0;i<N;i++) cuMemCreate(&h[i],PG,&P,0);
  for(int i=0;i<N;i++) cuMemMap(va+i*PG,PG,0,h[i],0);
  double a=now_ms(); for(int i=0;i<N;i++) cuMemSetAccess(va+i*PG,PG,&A,1); double b=now_ms();
  printf("setAccess once per mapping: %.1f ms\n", b-a);
  // overlap: teardown of set 1 on a background thread while the main thread builds set 2
  double c=now_ms();
  std::thread bg([]{ cuCtxSetCurrent(ctx); for(int i=0;i<N;i++){ cuMemUnmap(va+i*PG,PG); cuMemRelease(h[i]); } });
  double d0=now_ms(); for(int i=0;i<N;i++) cuMemCreate(&h2[i],PG,&P,0); for(int i=0;i<N;i++) cuMemMap(va2+i*PG,PG,0,h2[i],0); cuMemSetAccess(va2,(size_t)N*PG,&A,1); double d1=now_ms();
  bg.join(); double e=now_ms();
  printf("overlap: main build %.1f ms while bg teardown; both done %.1f ms\n", d1-d0, e-c);
  double f=now_ms(); for(int i=0;i<N;i++){ cuMemUnmap(va2+i*PG,PG); cuMemRelease(h2[i]); } double g=now_ms();
  printf("serial teardown alone %.1f ms\n", g-f);
  // cudaMalloc/cudaFree of the same 48 GiB as 150 tensors of 320 MiB, for scale
  std::vector<void*> q(150); double m0=now_ms(); for(auto& p: q) cudaMalloc(&p, 320ull<<20); double m1=now_ms(); for(auto p: q) cudaFree(p); double m2=now_ms();
  printf("cudaMalloc 150 x 320 MiB %.1f ms, cudaFree %.1f ms\n", m1-m0, m2-m1);
  return 0;
}
