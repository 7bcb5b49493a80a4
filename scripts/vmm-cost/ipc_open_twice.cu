// Legacy IPC in the consumer, natively: opening one handle twice in a process (same pointer?
// how many closes?), and what a cudaDeviceReset does to memory opened through a handle.
//   nvcc -cudart shared -o ipc_open_twice ipc_open_twice.cu && ./ipc_open_twice
// The producer is the parent (cudaMalloc, cudaIpcGetMemHandle); the consumer a child forked
// before either touches CUDA, which gets the handle over a pipe.
#include "probe.cuh"
#include <sys/wait.h>
#include <unistd.h>

int main() {
  setvbuf(stdout, NULL, _IONBF, 0);  // the child leaves with _exit
  int to_child[2], to_parent[2];
  if (pipe(to_child) || pipe(to_parent)) return 1;
  pid_t k = fork();
  if (k == 0) {
    cudaIpcMemHandle_t h;
    if (read(to_child[0], &h, sizeof h) != sizeof h) _exit(1);
    CKRT(cudaSetDevice(0));
    void *a = 0, *b = 0;
    int ra = cudaIpcOpenMemHandle(&a, h, cudaIpcMemLazyEnablePeerAccess);
    int rb = cudaIpcOpenMemHandle(&b, h, cudaIpcMemLazyEnablePeerAccess);
    printf("open_a=%d open_b=%d same_ptr=%d\n", ra, rb, a == b);
    int c1 = cudaIpcCloseMemHandle(b);
    unsigned char v = 0;
    int read_after_one_close = (int)cudaMemcpy(&v, a, 1, cudaMemcpyDeviceToHost);
    int c2 = cudaIpcCloseMemHandle(a);
    int c3 = cudaIpcCloseMemHandle(a);
    cudaGetLastError();
    printf("close_1=%d read_after_one_close=%d (value %d) close_2=%d close_3=%d\n", c1, read_after_one_close, v, c2, c3);
    void* c = 0;
    int rc = cudaIpcOpenMemHandle(&c, h, cudaIpcMemLazyEnablePeerAccess);
    int rr = cudaDeviceReset();
    cudaFree(0);
    int cr = cudaIpcCloseMemHandle(c);
    cudaGetLastError();
    void* d = 0;
    int rd = cudaIpcOpenMemHandle(&d, h, cudaIpcMemLazyEnablePeerAccess);
    printf("open_c=%d reset=%d close_after_reset=%d open_after_reset=%d\n", rc, rr, cr, rd);
    if (rd == 0) cudaIpcCloseMemHandle(d);
    char done = 1;
    if (write(to_parent[1], &done, 1) != 1) _exit(1);
    _exit(0);
  }
  CKRT(cudaSetDevice(0));
  void* p = 0;
  CKRT(cudaMalloc(&p, 64 << 20));
  CKRT(cudaMemset(p, 7, 64 << 20));
  CKRT(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h;
  CKRT(cudaIpcGetMemHandle(&h, p));
  if (write(to_child[1], &h, sizeof h) != sizeof h) return 1;
  char done;
  if (read(to_parent[0], &done, 1) != 1) return 1;
  int st;
  waitpid(k, &st, 0);
  printf("child_exit=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  CKRT(cudaFree(p));
  return 0;
}
