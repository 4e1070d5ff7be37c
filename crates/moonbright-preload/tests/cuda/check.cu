// A plain CUDA program for the LD_PRELOAD interposer (python/tests/gpu/test_preload_gpu.py builds
// it with `nvcc -cudart shared` and runs it with and without the interposer). Each allocation
// is filled by a kernel with its id and checked by a kernel before its free: cudaMalloc and
// cudaFree from four threads, cudaMallocAsync and cudaFreeAsync on non-blocking streams with a
// free on another stream than the allocating one, a double free, and a request far beyond the
// device's memory. Prints one JSON line; exits 1 on a wrong byte or an unexpected error.

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

static std::atomic<long> failures{0};
// Bytes found wrong by `check`, in device memory of the program's own (not allocated).
__device__ unsigned long long bad_count;

#define CHECK(call)                                                                         \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      failures++;                                                                           \
      return;                                                                               \
    }                                                                                       \
  } while (0)

__global__ void fill(unsigned *p, size_t n, unsigned id) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = id ^ (unsigned)i;
}

__global__ void check(const unsigned *p, size_t n, unsigned id) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    if (p[i] != (id ^ (unsigned)i)) atomicAdd(&bad_count, 1ull);
}

static size_t size_for(unsigned x) {
  switch (x % 4) {
    case 0: return 256 + x % 4096;                      // below a page
    case 1: return (1u << 20) + (x % 7) * 4096;         // about a page
    case 2: return (size_t)(5 + x % 40) << 20;          // several pages
    default: return (size_t)(64 + x % 200) << 20;       // large
  }
}

// cudaMalloc / fill / check / cudaFree, `rounds` allocations at a time.
static void sync_churn(unsigned seed, int rounds) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int r = 0; r < rounds; r++) {
    std::vector<unsigned *> ptrs;
    std::vector<size_t> ns;
    for (int k = 0; k < 8; k++) {
      unsigned x = seed * 7919u + r * 131u + k;
      size_t bytes = size_for(x);
      unsigned *p;
      CHECK(cudaMalloc(&p, bytes));
      size_t n = bytes / 4;
      fill<<<256, 256, 0, s>>>(p, n, x);
      ptrs.push_back(p);
      ns.push_back(n);
    }
    for (int k = 0; k < 8; k++) {
      unsigned x = seed * 7919u + r * 131u + k;
      check<<<256, 256, 0, s>>>(ptrs[k], ns[k], x);
      // The kernels above may still run: cudaFree must wait for them.
      CHECK(cudaFree(ptrs[k]));
    }
  }
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaStreamDestroy(s));
}

// cudaMallocAsync on one stream, freed on another after an event (cross-stream free), and
// freed and reused on its own stream.
static void async_churn(int rounds) {
  cudaStream_t a, b;
  cudaEvent_t ev;
  CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  for (int r = 0; r < rounds; r++) {
    unsigned x = 100000u + r;
    size_t bytes = size_for(x);
    size_t n = bytes / 4;
    unsigned *p, *q;
    CHECK(cudaMallocAsync(&p, bytes, a));
    fill<<<256, 256, 0, a>>>(p, n, x);
    CHECK(cudaEventRecord(ev, a));
    CHECK(cudaStreamWaitEvent(b, ev, 0));
    check<<<256, 256, 0, b>>>(p, n, x);
    CHECK(cudaFreeAsync(p, b));
    CHECK(cudaMallocAsync(&q, bytes, a));
    fill<<<256, 256, 0, a>>>(q, n, x + 1);
    check<<<256, 256, 0, a>>>(q, n, x + 1);
    CHECK(cudaFreeAsync(q, a));
  }
  CHECK(cudaStreamSynchronize(a));
  CHECK(cudaStreamSynchronize(b));
  CHECK(cudaStreamDestroy(a));
  CHECK(cudaStreamDestroy(b));
  CHECK(cudaEventDestroy(ev));
}

static void errors(int *double_free, int *oom, int *after_oom) {
  void *p;
  CHECK(cudaMalloc(&p, 1 << 20));
  CHECK(cudaFree(p));
  *double_free = (int)cudaFree(p);
  cudaGetLastError();
  size_t free_b, total_b;
  CHECK(cudaMemGetInfo(&free_b, &total_b));
  void *huge = nullptr;
  *oom = (int)cudaMalloc(&huge, total_b * 4);
  cudaGetLastError();
  *after_oom = (int)cudaMalloc(&p, 1 << 20);
  if (*after_oom == cudaSuccess) CHECK(cudaFree(p));
}

int main() {
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; t++) threads.emplace_back(sync_churn, t + 1, 12);
  threads.emplace_back(async_churn, 200);
  for (auto &t : threads) t.join();
  unsigned long long bad = ~0ull;
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(&bad, bad_count, sizeof bad) != cudaSuccess)
    failures++;
  int double_free = -1, oom = -1, after_oom = -1;
  errors(&double_free, &oom, &after_oom);

  // The interposer's report, when it is loaded.
  char report[4096] = "null";
  using Report = size_t (*)(char *, size_t);
  if (auto f = (Report)dlsym(RTLD_DEFAULT, "moonbright_preload_report")) f(report, sizeof report);
  printf("{\"bad\": %llu, \"failures\": %ld, \"double_free\": %d, \"oom\": %d, \"after_oom\": %d, "
         "\"report\": %s}\n",
         bad, failures.load(), double_free, oom, after_oom, report);
  return bad == 0 && failures == 0 ? 0 : 1;
}
