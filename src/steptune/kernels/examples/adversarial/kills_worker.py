"""Starts a daemon in a new session, then SIGKILLs its ancestors (found through /proc) so that nobody is
left to reap the daemon (found by review). As root each candidate is process 1 of its own PID namespace:
the kill cannot reach outside it, the daemon is counted and dies with the namespace."""

# expect: rejected
# runtime: rejected
from torch import nn

from steptune.kernels.cext import load_c

lib = load_c(
    r"""
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static int parent_of(int pid) {
    char path[64], buf[512]; snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE* f = fopen(path, "r"); if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f); fclose(f); buf[n] = 0;
    char* p = buf; char* close = 0; for (char* q = buf; *q; q++) if (*q == ')') close = q;
    if (!close) return 0; p = close + 4; return atoi(p);
}
void go(void) {
    if (fork() == 0) { setsid(); execlp("sleep", "sleep", "61.25", (char*)0); _exit(0); }
    usleep(200000);
    char self[64]; ssize_t k = readlink("/proc/self", self, sizeof self - 1); self[k > 0 ? k : 0] = 0;
    int host_self = atoi(self), up = host_self;
    for (int i = 0; i < 3 && up > 1; i++) { up = parent_of(up); if (up > 1) kill(up, SIGKILL); }
    sleep(5);
}
""",
    flags=("-O2", "-std=gnu11", "-fPIC", "-shared"),
)
lib.go()


class ModelNew(nn.Module):
    def forward(self, x):
        return x
