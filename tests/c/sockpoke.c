/* sockpoke PATH ID NONCE: connect to an expseg socket, send one request (ticket protocol:
 * id u32, zero u32, nonce u64, little-endian), and say what came back: "poke=status:N" (the
 * answer's status, 0 granted), "poke=closed" (closed before a byte of answer) or
 * "poke=unreachable" (the connect itself failed: no access to the socket). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

int main(int argc, char** argv) {
  if (argc != 4) { fprintf(stderr, "usage: sockpoke PATH ID NONCE\n"); return 2; }
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  strncpy(a.sun_path, argv[1], sizeof a.sun_path - 1);
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  if (s < 0 || connect(s, (struct sockaddr*)&a, sizeof a) != 0) {
    printf("poke=unreachable errno=%d\n", errno);
    return 0;
  }
  struct timeval tv = {.tv_sec = 5};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  uint32_t id = (uint32_t)strtoul(argv[2], 0, 10);
  uint64_t nonce = strtoull(argv[3], 0, 10);
  unsigned char req[16] = {0};
  memcpy(req, &id, 4);
  memcpy(req + 8, &nonce, 8);
  if (send(s, req, sizeof req, MSG_NOSIGNAL) != (ssize_t)sizeof req) { printf("poke=closed\n"); return 0; }
  unsigned char head[16];
  size_t got = 0;
  while (got < sizeof head) {
    ssize_t n = read(s, head + got, sizeof head - got);
    if (n <= 0) break;
    got += (size_t)n;
  }
  if (got < 4) { printf("poke=closed\n"); return 0; }
  uint32_t status;
  memcpy(&status, head, 4);
  printf("poke=status:%u\n", status);
  return 0;
}
