// A minimal pluggable allocator for PyTorch: a per-size LIFO cache (no stream semantics, one
// stream only) over cuMemAlloc_v2. It times the floor of CUDAPluggableAllocator's interface.
#include <dlfcn.h>
#include <mutex>
#include <unordered_map>
#include <vector>
#include <cstddef>
typedef int (*alloc_fn)(unsigned long long*, size_t);
static alloc_fn cu_alloc;
static std::mutex mu;
static std::unordered_map<size_t, std::vector<void*>> cache;
static std::unordered_map<void*, size_t> sizes;
extern "C" void* min_alloc(ptrdiff_t size, int device, void* stream) {
  std::lock_guard<std::mutex> g(mu);
  size_t s = ((size_t)size + 511) & ~(size_t)511;
  auto it = cache.find(s);
  if (it != cache.end() && !it->second.empty()) {
    void* p = it->second.back();
    it->second.pop_back();
    return p;
  }
  if (!cu_alloc) cu_alloc = (alloc_fn)dlsym(dlopen("libcuda.so.1", RTLD_NOW), "cuMemAlloc_v2");
  unsigned long long p = 0;
  if (cu_alloc(&p, s) != 0) return nullptr;
  sizes[(void*)p] = s;
  return (void*)p;
}
extern "C" void min_free(void* ptr, ptrdiff_t size, int device, void* stream) {
  std::lock_guard<std::mutex> g(mu);
  cache[sizes[ptr]].push_back(ptr);
}
