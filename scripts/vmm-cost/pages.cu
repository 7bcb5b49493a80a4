// Sub-range semantics and costs of VMM calls with PyTorch's 20 MiB pages (run by
// scripts/vmm-cost.sh). Findings on H200 / driver 580.159.04 (docs/failed-approaches.md):
// unmapping one page of a multi-page mapping fails (1); mapping a handle in slices
// (offset != 0 or size != handle size) does not give working memory (the check kernel faults,
// so sections 2 and 5 print garbage after it); only whole handles can be mapped and unmapped.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>
static double now_us(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec*1e6+t.tv_nsec/1e3; }
#define PG (20ull<<20)
__global__ void fill(unsigned* p, size_t n, unsigned v){ size_t i=blockIdx.x*(size_t)blockDim.x+threadIdx.x; for(;i<n;i+=(size_t)gridDim.x*blockDim.x) p[i]=v+(unsigned)i; }
__global__ void check(const unsigned* p, size_t n, unsigned v, int* bad){ size_t i=blockIdx.x*(size_t)blockDim.x+threadIdx.x; for(;i<n;i+=(size_t)gridDim.x*blockDim.x) if(p[i]!=v+(unsigned)i) atomicAdd(bad,1); }
CUmemAllocationProp P; CUmemAccessDesc A;
int chk(CUdeviceptr va, size_t bytes, unsigned v){ int* bad=0; if(cudaMallocManaged(&bad,4)||!bad){ printf("  (context broken: %s)\n", cudaGetErrorString(cudaGetLastError())); return -1; } *bad=0; check<<<1024,256>>>((const unsigned*)va, bytes/4, v, bad); cudaError_t e=cudaDeviceSynchronize(); int r = e? -1000-(int)e : *bad; cudaFree(bad); return r; }
int main(){
  setvbuf(stdout,NULL,_IONBF,0); cudaFree(0); cuInit(0);
  memset(&P,0,sizeof P); P.type=CU_MEM_ALLOCATION_TYPE_PINNED; P.location.type=CU_MEM_LOCATION_TYPE_DEVICE; P.location.id=0; P.requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  memset(&A,0,sizeof A); A.location.type=CU_MEM_LOCATION_TYPE_DEVICE; A.location.id=0; A.flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va; cuMemAddressReserve(&va, 64*PG, 0,0,0);
  CUmemGenericAllocationHandle h; int r;
  // 1. one chunk of 8 pages mapped by one call; unmap one page in the middle.
  r=cuMemCreate(&h, 8*PG, &P, 0); printf("create 8 pages: %d\n", r);
  r=cuMemMap(va, 8*PG, 0, h, 0); printf("map whole: %d\n", r);
  r=cuMemSetAccess(va, 8*PG, &A, 1); printf("access: %d\n", r);
  fill<<<1024,256>>>((unsigned*)va, 8*PG/4, 7); cudaDeviceSynchronize();
  r=cuMemUnmap(va+2*PG, PG); printf("PARTIAL unmap of page 2 of a mapping: %d\n", r);
  if(r==0){ printf("  pages 0-1 check bad=%d, pages 3-7 check bad=%d\n", chk(va,2*PG,7), chk(va+3*PG,5*PG,7+(unsigned)(3*PG/4)));
    r=cuMemMap(va+2*PG, PG, 2*PG, h, 0); printf("  remap page 2 at offset: %d access %d\n", r, cuMemSetAccess(va+2*PG, PG, &A,1));
    printf("  page 2 data bad=%d\n", chk(va+2*PG, PG, 7+(unsigned)(2*PG/4)));
    r=cuMemUnmap(va, 8*PG); printf("  unmap whole range spanning 3 mappings: %d\n", r);
    if(r){ cuMemUnmap(va,2*PG); cuMemUnmap(va+2*PG,PG); cuMemUnmap(va+3*PG,5*PG);} }
  else { r=cuMemUnmap(va, 8*PG); printf("  unmap whole: %d\n", r); }
  // 2. map pages of one chunk by separate calls; unmap a range spanning several mappings.
  for(int i=0;i<8;i++) cuMemMap(va+i*PG, PG, i*PG, h, 0);
  cuMemSetAccess(va, 8*PG, &A, 1);
  printf("data after 8 separate maps bad=%d\n", chk(va, 8*PG, 7));
  r=cuMemUnmap(va, 8*PG); printf("unmap one range over 8 mappings: %d\n", r);
  if(r) for(int i=0;i<8;i++) cuMemUnmap(va+i*PG, PG);
  // 3. release while mapped: memory stays until unmapped.
  cuMemMap(va, 8*PG, 0, h, 0); cuMemSetAccess(va, 8*PG, &A, 1);
  r=cuMemRelease(h); printf("release while mapped: %d; data bad=%d\n", r, chk(va, 8*PG, 7));
  cuMemUnmap(va, 8*PG);
  // 4. costs, 48 pages (960 MiB), 15 rounds each, median-ish by mean.
  int N=48; CUmemGenericAllocationHandle hs[64];
  double t[8]={0}; int R=15;
  for(int k=0;k<R;k++){
    double a=now_us(); for(int i=0;i<N;i++) cuMemCreate(&hs[i], PG, &P, 0);
    double b=now_us(); for(int i=0;i<N;i++) cuMemMap(va+i*PG, PG, 0, hs[i], 0);
    double c=now_us(); cuMemSetAccess(va, N*PG, &A, 1);
    double d=now_us(); for(int i=0;i<N;i++) cuMemUnmap(va+i*PG, PG);
    double e=now_us(); for(int i=0;i<N;i++) cuMemRelease(hs[i]);
    double f=now_us(); t[0]+=b-a; t[1]+=c-b; t[2]+=d-c; t[3]+=e-d; t[4]+=f-e; }
  printf("per-page (48 x 20MiB): create %.1f map %.1f access(total) %.1f unmap %.1f release %.1f us/page\n", t[0]/R/N, t[1]/R/N, t[2]/R, t[3]/R/N, t[4]/R/N);
  double u[8]={0};
  for(int k=0;k<R;k++){
    double a=now_us(); cuMemCreate(&h, N*PG, &P, 0);
    double b=now_us(); cuMemMap(va, N*PG, 0, h, 0);
    double c=now_us(); cuMemSetAccess(va, N*PG, &A, 1);
    double d=now_us(); cuMemUnmap(va, N*PG);
    double e=now_us(); cuMemRelease(h);
    double f=now_us(); u[0]+=b-a; u[1]+=c-b; u[2]+=d-c; u[3]+=e-d; u[4]+=f-e; }
  printf("one chunk (960MiB): create %.1f map %.1f access %.1f unmap %.1f release %.1f us\n", u[0]/R, u[1]/R, u[2]/R, u[3]/R, u[4]/R);
  // 5. one chunk mapped per page (separate cuMemMap of each 20 MiB slice) and unmapped per page
  double w[8]={0};
  for(int k=0;k<R;k++){
    double a=now_us(); cuMemCreate(&h, N*PG, &P, 0);
    double b=now_us(); for(int i=0;i<N;i++) cuMemMap(va+i*PG, PG, i*PG, h, 0);
    double c=now_us(); cuMemSetAccess(va, N*PG, &A, 1);
    double d=now_us(); for(int i=0;i<N;i++) cuMemUnmap(va+i*PG, PG);
    double e=now_us(); cuMemRelease(h);
    double f=now_us(); w[0]+=b-a; w[1]+=c-b; w[2]+=d-c; w[3]+=e-d; w[4]+=f-e; }
  printf("one chunk mapped by slices: create %.1f map %.1f(total) access %.1f unmap %.1f(total) release %.1f us\n", w[0]/R, w[1]/R, w[2]/R, w[3]/R, w[4]/R);
  // 6. partial unmaps of one mapping, page by page (if supported)
  double z[4]={0}; int okp=1;
  for(int k=0;k<R;k++){
    cuMemCreate(&h, N*PG, &P, 0); cuMemMap(va, N*PG, 0, h, 0); cuMemSetAccess(va, N*PG, &A, 1);
    double d=now_us(); for(int i=0;i<N;i++) if(cuMemUnmap(va+i*PG, PG)) okp=0;
    double e=now_us(); if(!okp) cuMemUnmap(va, N*PG); cuMemRelease(h); z[0]+=e-d; }
  printf("page-by-page unmap of one mapping: ok=%d %.1f us total\n", okp, z[0]/R);
  // 7. cudaMalloc/cudaFree of 960 MiB for reference
  double m[2]={0};
  for(int k=0;k<R;k++){ void* q; double a=now_us(); cudaMalloc(&q, N*PG); double b=now_us(); cudaFree(q); double c=now_us(); m[0]+=b-a; m[1]+=c-b; }
  printf("cudaMalloc 960MiB %.1f us, cudaFree %.1f us\n", m[0]/R, m[1]/R);
  return 0;
}
