// The limit of a churn step (40 GiB acquired as 0.05-0.6 GiB tensors, a third touched, all
// released; new sizes every step) by how physical memory is handled:
//   sync:     one handle per tensor, unmapped and released before the step ends (expseg today)
//   behind:   the same, but cuMemRelease runs on a background thread while the next step builds
//   reuse:    released handles kept (memory withheld from other processes) and re-mapped for
//             the next step's tensors, greedily, several handles back to back per tensor;
//             the rest created fresh; left-overs released at the end of the step
//   cudaMalloc: cudaMalloc/cudaFree per tensor
// nvcc -O2 -std=c++17 -o release_behind release_behind.cu -lcuda -lpthread ; ./release_behind
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vector>
#include <map>
#include <algorithm>
#include <thread>
#include <mutex>
#include <condition_variable>
#include <deque>
static double now_ms(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec*1e3+t.tv_nsec/1e6; }
#define PG (20ull<<20)
#define CK(x) do{ CUresult r_=(x); if(r_){ printf("%s:%d %s -> %d\n",__FILE__,__LINE__,#x,(int)r_); exit(1);} }while(0)
__global__ void touch(unsigned char* p, size_t n){ size_t i=(blockIdx.x*(size_t)blockDim.x+threadIdx.x); for(;i<n/16;i+=(size_t)gridDim.x*blockDim.x) ((uint4*)p)[i]=make_uint4(1,2,3,4); }
static std::mutex mu; static std::condition_variable cv; static std::deque<CUmemGenericAllocationHandle> q; static int busy=0; static bool stop=false;
static void releaser(CUcontext ctx){ cuCtxSetCurrent(ctx); for(;;){ std::unique_lock<std::mutex> l(mu); cv.wait(l,[]{return stop||!q.empty();}); if(q.empty()&&stop) return; auto h=q.front(); q.pop_front(); busy++; l.unlock(); CK(cuMemRelease(h)); l.lock(); busy--; cv.notify_all(); } }
static void drain(){ std::unique_lock<std::mutex> l(mu); cv.wait(l,[]{return q.empty()&&busy==0;}); }
int main(int argc, char** argv){
  double total = argc>1 ? atof(argv[1]) : 40.0;
  setvbuf(stdout,NULL,_IONBF,0); cudaFree(0); CUcontext ctx; cuCtxGetCurrent(&ctx);
  CUmemAllocationProp P; memset(&P,0,sizeof P); P.type=CU_MEM_ALLOCATION_TYPE_PINNED; P.location.type=CU_MEM_LOCATION_TYPE_DEVICE; P.location.id=0; P.requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemAccessDesc A; memset(&A,0,sizeof A); A.location.type=CU_MEM_LOCATION_TYPE_DEVICE; A.location.id=0; A.flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t vasz = (size_t)(total*1.3*(1ull<<30)/PG + 64)*PG; CUdeviceptr va; CK(cuMemAddressReserve(&va, vasz, 0,0,0));
  std::thread th(releaser, ctx);
  const int STEPS=11; const char* names[4]={"sync release","release behind","reuse released handles","cudaMalloc per tensor"};
  std::vector<double> res[4]; std::vector<double> reuse_frac;
  unsigned seed=1; (void)seed;
  // Each mode runs its steps back to back (a release behind overlaps the next step of its own
  // mode), twice in turn; the first step of each block is not counted.
  for(int round=0;round<2;round++) for(int m=0;m<4;m++) for(int s=0;s<STEPS;s++){
    srand(1 + s + 100*round); std::vector<size_t> sz; double got=0;
    while(got < total*(1ull<<30)){ size_t n=(size_t)((0.05+0.55*(rand()/(double)RAND_MAX))*(1ull<<30)); sz.push_back(n); got+=n; }
    static std::multimap<size_t, CUmemGenericAllocationHandle> cache; // size -> handle (mode 2)
    cudaDeviceSynchronize(); double t0=now_ms(); size_t reused=0, all=0;
    if(m<3){
      std::vector<std::pair<CUmemGenericAllocationHandle,size_t>> hs; std::vector<std::pair<CUdeviceptr,size_t>> maps; CUdeviceptr cur=va;
      for(size_t n: sz){ size_t np=(n+PG-1)/PG, need=np*PG; CUdeviceptr b=cur; all+=need;
        if(m==2){ while(need){ auto it=cache.upper_bound(need); if(it==cache.begin()) break; --it; size_t hsz=it->first; auto h=it->second; cache.erase(it);
                    CK(cuMemMap(cur,hsz,0,h,0)); maps.push_back({cur,hsz}); hs.push_back({h,hsz}); cur+=hsz; need-=hsz; reused+=hsz; } }
        if(need){ CUmemGenericAllocationHandle h; CK(cuMemCreate(&h,need,&P,0)); CK(cuMemMap(cur,need,0,h,0)); maps.push_back({cur,need}); hs.push_back({h,need}); cur+=need; }
        CK(cuMemSetAccess(b, np*PG, &A, 1)); touch<<<512,256>>>((unsigned char*)b, (hs.size()%3==0)? n : 4096); }
      cudaDeviceSynchronize();
      for(auto& mp: maps) CK(cuMemUnmap(mp.first, mp.second));
      if(m==0) for(auto h: hs) CK(cuMemRelease(h.first));
      if(m==1){ std::lock_guard<std::mutex> l(mu); for(auto h: hs) q.push_back(h.first); cv.notify_all(); }
      if(m==2){ for(auto h: hs) cache.insert({h.second,h.first}); }
    } else {
      std::vector<void*> ps; for(size_t n: sz){ void* p; if(cudaMalloc(&p,n)){ printf("cudaMalloc failed\n"); exit(1);} ps.push_back(p); touch<<<512,256>>>((unsigned char*)p, (ps.size()%3==1)? n : 4096); }
      cudaDeviceSynchronize(); for(void* p: ps) cudaFree(p);
    }
    cudaDeviceSynchronize(); if(s>0) res[m].push_back(now_ms()-t0);
    if(m==1 && s==STEPS-1) drain();   // the next mode starts from a quiet driver
    if(m==2){ if(s>0) reuse_frac.push_back(all? (double)reused/all : 0); if(s==STEPS-1){ for(auto& c: cache) CK(cuMemRelease(c.second)); cache.clear(); } }
  }
  { std::lock_guard<std::mutex> l(mu); stop=true; cv.notify_all(); } th.join();
  for(int m=0;m<4;m++){ auto v=res[m]; std::sort(v.begin()+0,v.end()); printf("%-26s median %.1f ms/step (min %.1f max %.1f)\n", names[m], v[v.size()/2], v[0], v.back()); }
  std::sort(reuse_frac.begin(), reuse_frac.end()); printf("reuse: median %.0f%% of each step's bytes came from released handles\n", 100*reuse_frac[reuse_frac.size()/2]);
  return 0;
}
