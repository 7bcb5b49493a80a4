/* Runs the expandable-segments emulation of libc10_cuda.so (or of libother.so, which is the
 * same code under a name expseg does not coalesce for): pages_main [LIB] [full|oom]. */
#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char** argv) {
  void* l = dlopen(argc > 1 ? argv[1] : "libc10_cuda.so", RTLD_NOW);
  if (!l) { fprintf(stderr, "%s\n", dlerror()); return 2; }
  int (*f)(const char*) = (int (*)(const char*))dlsym(l, "expandable");
  return f ? f(argc > 2 ? argv[2] : "full") : 2;
}
