"""A library constructor starts a worker thread at load time; forward hands it the work and returns at once
(found by review: it measured 71-112x before the thread baseline moved before the import)."""

# expect: rejected
# runtime: rejected
import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

lib = load_c(
    r"""
#include <pthread.h>
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static const float* gx; static float* gy; static long gn; static int pending;
static void* bg(void* a) {
    for (;;) {
        pthread_mutex_lock(&mu);
        while (!pending) pthread_cond_wait(&cv, &mu);
        const float* x = gx; float* y = gy; long n = gn; pending = 0;
        pthread_mutex_unlock(&mu);
        for (long i = 0; i < n; i++) y[i] = x[i] > 0 ? x[i] : 0;
    }
    return a;
}
__attribute__((constructor)) static void start(void) { pthread_t t; pthread_create(&t, 0, bg, 0); }
void relu_async(const float* x, float* y, long n) {
    pthread_mutex_lock(&mu); gx = x; gy = y; gn = n; pending = 1;
    pthread_cond_signal(&cv); pthread_mutex_unlock(&mu);
}
""",
    flags=("-O2", "-std=c11", "-fPIC", "-shared", "-pthread"),
)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        lib.relu_async(ptr(x), ptr(y), x.numel())
        return y
