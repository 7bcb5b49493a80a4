// What a weight refit over PyTorch's IPC of expandable segments could cost at best (issue 61's
// refit row: later refits <= 1.2x the default allocator). A producer process holds TENSORS
// tensors of 8 GiB in all, laid out in 20 MiB pages as PyTorch's expandable segments lay them,
// and exports their handles as POSIX descriptors (sent over a socket, as pidfd_getfd would
// give them); a consumer process opens and closes every tensor ROUNDS times, the way PyTorch's
// `ExpandableSegment::fromShared` and its destructor do, under four designs:
//
//   legacy   the default allocator's: cuIpcOpenMemHandle / cuIpcCloseMemHandle per tensor
//   pages    PyTorch's expandable IPC as it is: per tensor a reservation of the device's size,
//            per page an import of its own handle, a map, one cuMemSetAccess per tensor; on
//            close an unmap and a release per page and the reservation freed
//   runs     what an expseg consumer could do when the producer's pages lie in coalesced
//            handles of 1020 MiB: each coalesced handle imported once a round and, since a
//            handle maps only whole (cuMemMap of a part at an offset: 801, first run of this
//            probe), mapped whole per tensor where its first page falls, inside a reservation
//            with a lead in front; one cuMemSetAccess over the mapped handles
//   kept     as `runs` with the imports kept across rounds (imported once while the producer
//            lives): what is left is the reservations, maps, access and unmaps PyTorch asks for
//
// Each design's open and close time a round (median of the rounds after the first) and the
// driver time by call, so the floor of each design stands beside the legacy handles' cost.
//
//   nvcc -O2 -o refit_floor refit_floor.c -lcuda && ./refit_floor [TENSORS] [ROUNDS]
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK(x)                                                      \
  do {                                                             \
    CUresult r_ = (x);                                             \
    if (r_) {                                                      \
      printf("%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)r_); \
      exit(1);                                                     \
    }                                                              \
  } while (0)

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

#define PAGE (20ull << 20)
#define GROUP 51 /* pages a coalesced handle */
#define MAXT 4096
#define MAXP 8192

static int tensors = 246, rounds = 6;
static size_t tbytes, npages, nruns;

static CUmemAllocationProp prop(int dev) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

static void send_fds(int sock, const int* fds, size_t n) {
  for (size_t i = 0; i < n; i += 200) {
    size_t k = n - i < 200 ? n - i : 200;
    char buf[CMSG_SPACE(200 * sizeof(int))];
    memset(buf, 0, sizeof buf);
    char byte = 0;
    struct iovec io = {&byte, 1};
    struct msghdr m = {0};
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    m.msg_control = buf;
    m.msg_controllen = CMSG_SPACE(k * sizeof(int));
    struct cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(k * sizeof(int));
    memcpy(CMSG_DATA(c), fds + i, k * sizeof(int));
    if (sendmsg(sock, &m, 0) != 1) { perror("sendmsg"); exit(1); }
  }
}

static void recv_fds(int sock, int* fds, size_t n) {
  for (size_t i = 0; i < n;) {
    char buf[CMSG_SPACE(200 * sizeof(int))];
    char byte;
    struct iovec io = {&byte, 1};
    struct msghdr m = {0};
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    m.msg_control = buf;
    m.msg_controllen = sizeof buf;
    if (recvmsg(sock, &m, 0) != 1) { perror("recvmsg"); exit(1); }
    struct cmsghdr* c = CMSG_FIRSTHDR(&m);
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    memcpy(fds + i, CMSG_DATA(c), k * sizeof(int));
    i += k;
  }
}

static void full(int fd, void* p, size_t n, int out) {
  char* b = (char*)p;
  while (n) {
    ssize_t r = out ? write(fd, b, n) : read(fd, b, n);
    if (r <= 0) { perror("pipe"); exit(1); }
    b += r;
    n -= (size_t)r;
  }
}

static void producer(int sock) {
  CUdevice d;
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&d, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, d));
  CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp p = prop(0);
  static int fds[MAXP];
  static CUmemGenericAllocationHandle h[MAXP];
  // pages: a handle a page
  for (size_t i = 0; i < npages; i++) {
    CK(cuMemCreate(&h[i], PAGE, &p, 0));
    CK(cuMemExportToShareableHandle(&fds[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  }
  send_fds(sock, fds, npages);
  // runs: coalesced handles of GROUP pages
  for (size_t i = 0; i < nruns; i++) {
    CK(cuMemCreate(&h[npages + i], PAGE * GROUP, &p, 0));
    CK(cuMemExportToShareableHandle(&fds[npages + i], h[npages + i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  }
  send_fds(sock, fds + npages, nruns);
  // legacy: a cudaMalloc'd buffer a tensor
  static CUipcMemHandle ih[MAXT];
  for (int i = 0; i < tensors; i++) {
    CUdeviceptr x;
    CK(cuMemAlloc(&x, tbytes));
    CK(cuIpcGetMemHandle(&ih[i], x));
  }
  full(sock, ih, sizeof(CUipcMemHandle) * tensors, 1);
  char done;
  full(sock, &done, 1, 0);  // the consumer is finished
}

enum { RES, IMP, MAP, ACC, UNMAP, REL, FREE, OPEN, CLOSE, NCALL };
static const char* names[] = {"reserve", "import", "map", "access", "unmap", "release", "free", "ipc open", "ipc close"};

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

static void consumer(int sock) {
  CUdevice d;
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&d, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, d));
  CK(cuCtxSetCurrent(ctx));
  size_t total;
  CK(cuDeviceTotalMem(&total, d));
  size_t reserve = (total + PAGE - 1) / PAGE * PAGE;  // PyTorch reserves the device's size
  static int fp[MAXP], fr[MAXP];
  recv_fds(sock, fp, npages);
  recv_fds(sock, fr, nruns);
  static CUipcMemHandle ih[MAXT];
  full(sock, ih, sizeof(CUipcMemHandle) * tensors, 0);
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = 0;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const char* modes[] = {"legacy", "pages", "runs", "kept"};
  static CUmemGenericAllocationHandle runh[MAXP];
  CUmemGenericAllocationHandle* ph = calloc((size_t)tensors * 64, sizeof *ph);  // a tensor's own imports
  static int imported[MAXP];
  static CUdeviceptr va[MAXT], lp[MAXT];
  for (int mode = 0; mode < 4; mode++) {
    double open_ms[64], close_ms[64], calls[NCALL] = {0};
    memset(imported, 0, sizeof imported);
    for (int r = 0; r < rounds; r++) {
      double t[NCALL] = {0}, t0 = now_ms(), a;
#define TIME(k, x) do { a = now_ms(); CK(x); t[k] += now_ms() - a; } while (0)
      for (int i = 0; i < tensors; i++) {
        size_t start = (size_t)i * tbytes, p0 = start / PAGE, p1 = (start + tbytes - 1) / PAGE;
        if (mode == 0) {
          TIME(OPEN, cuIpcOpenMemHandle(&lp[i], ih[i], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
          continue;
        }
        if (mode == 1) {
          TIME(RES, cuMemAddressReserve(&va[i], reserve, 0, 0, 0));
          for (size_t k = p0; k <= p1; k++) {
            int f = dup(fp[k]);  // pidfd_getfd's copy of the producer's descriptor
            TIME(IMP, cuMemImportFromShareableHandle(&ph[i * 64 + (k - p0)], (void*)(uintptr_t)f, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
            close(f);
            TIME(MAP, cuMemMap(va[i] + (k - p0) * PAGE, PAGE, 0, ph[i * 64 + (k - p0)], 0));
          }
          TIME(ACC, cuMemSetAccess(va[i], (p1 - p0 + 1) * PAGE, &acc, 1));
          continue;
        }
        // A handle maps only whole: each coalesced handle the tensor's pages lie in is mapped
        // whole where its first page falls, inside a reservation with a lead in front.
        size_t g0 = p0 / GROUP, g1 = p1 / GROUP, lead = GROUP * PAGE;
        TIME(RES, cuMemAddressReserve(&va[i], reserve + lead, 0, 0, 0));
        CUdeviceptr at = va[i] + lead - (p0 - g0 * GROUP) * PAGE;  // where handle g0 starts
        for (size_t g = g0; g <= g1; g++) {
          if (!imported[g]) {
            int f = dup(fr[g]);
            TIME(IMP, cuMemImportFromShareableHandle(&runh[g], (void*)(uintptr_t)f, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
            close(f);
            imported[g] = 1;
          }
          TIME(MAP, cuMemMap(at + (g - g0) * lead, lead, 0, runh[g], 0));
        }
        TIME(ACC, cuMemSetAccess(at, (g1 - g0 + 1) * lead, &acc, 1));
      }
      CK(cuCtxSynchronize());
      double t1 = now_ms();
      for (int i = 0; i < tensors; i++) {
        size_t start = (size_t)i * tbytes, p0 = start / PAGE, p1 = (start + tbytes - 1) / PAGE;
        if (mode == 0) {
          TIME(CLOSE, cuIpcCloseMemHandle(lp[i]));
          continue;
        }
        if (mode == 1) {
          for (size_t k = p0; k <= p1; k++) {
            TIME(UNMAP, cuMemUnmap(va[i] + (k - p0) * PAGE, PAGE));
            TIME(REL, cuMemRelease(ph[i * 64 + (k - p0)]));
          }
          TIME(FREE, cuMemAddressFree(va[i], reserve));
          continue;
        }
        size_t g0 = p0 / GROUP, g1 = p1 / GROUP, lead = GROUP * PAGE;
        CUdeviceptr at = va[i] + lead - (p0 - g0 * GROUP) * PAGE;
        for (size_t g = g0; g <= g1; g++) TIME(UNMAP, cuMemUnmap(at + (g - g0) * lead, lead));
        TIME(FREE, cuMemAddressFree(va[i], reserve + lead));
      }
      if (mode == 2)
        for (size_t g = 0; g < nruns; g++)
          if (imported[g]) { TIME(REL, cuMemRelease(runh[g])); imported[g] = 0; }
      double t2 = now_ms();
      open_ms[r] = t1 - t0;
      close_ms[r] = t2 - t1;
      if (r > 0)
        for (int k = 0; k < NCALL; k++) calls[k] += t[k] / (rounds - 1);
    }
    qsort(open_ms + 1, rounds - 1, sizeof(double), cmp);
    qsort(close_ms + 1, rounds - 1, sizeof(double), cmp);
    printf("%-6s open %7.2f ms  close %7.2f ms  (first round %.2f / %.2f) | mean a round:", modes[mode],
           open_ms[1 + (rounds - 1) / 2], close_ms[1 + (rounds - 1) / 2], open_ms[0], close_ms[0]);
    for (int k = 0; k < NCALL; k++)
      if (calls[k] > 0) printf(" %s %.2f", names[k], calls[k]);
    printf("\n");
    fflush(stdout);
  }
  char done = 1;
  full(sock, &done, 1, 1);
}

int main(int argc, char** argv) {
  if (argc > 1) tensors = atoi(argv[1]);
  if (argc > 2) rounds = atoi(argv[2]);
  tbytes = ((8ull << 30) / (tensors > 0 ? tensors : 1)) & ~((2ull << 20) - 1);
  if (tensors < 1 || tensors > MAXT || rounds > 64 || rounds < 2 || tbytes > 60 * PAGE) {
    printf("%d <= TENSORS <= %d, 2 <= ROUNDS <= 64\n", (int)((8ull << 30) / (60 * PAGE)) + 1, MAXT);
    return 1;
  }
  npages = ((size_t)tensors * tbytes + PAGE - 1) / PAGE;
  nruns = (npages + GROUP - 1) / GROUP;
  printf("%d tensors of %.1f MiB, %zu pages of 20 MiB, %zu coalesced handles of %d pages, %d rounds\n",
         tensors, tbytes / 1048576.0, npages, nruns, GROUP, rounds);
  fflush(stdout);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { perror("socketpair"); return 1; }
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    producer(sv[1]);
    _exit(0);
  }
  close(sv[1]);
  consumer(sv[0]);
  int st;
  waitpid(pid, &st, 0);
  return 0;
}
