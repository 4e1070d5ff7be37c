//! The CUDA C sources of the benchmark kernels, compiled at run time with NVRTC.

/// Every kernel the benchmarks launch.
pub const SOURCE: &str = r#"
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One thread spins for `ns` nanoseconds of wall time (clock64 counts SM cycles, whose rate
// varies with boost; the global timer does not), touching clock64 so the loop is not elided.
extern "C" __global__ void spin(u64 ns, u64* sink) {
    u64 start = globaltimer();
    long long c = 0;
    while (globaltimer() - start < ns) { c += clock64() & 1; }
    if (c == -1 && sink) { *sink = (u64)c; }
}

__device__ __forceinline__ u32 pattern(u32 id, u64 i) {
    u32 x = id * 0x9E3779B1u ^ (u32)(i * 0x85EBCA6Bull) ^ (u32)(i >> 32);
    return x ^ (x >> 15);
}

extern "C" __global__ void fill(u32* p, u64 n, u32 id) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        p[i] = pattern(id, i);
}

extern "C" __global__ void check(const u32* p, u64 n, u32 id, u64* bad) {
    u64 mine = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        mine += (p[i] != pattern(id, i));
    if (mine) atomicAdd(bad, mine);
}

__device__ __forceinline__ u64 splitmix(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

extern "C" __global__ void make_idx(u64* idx, u64 n, u64 range, u64 seed) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        idx[i] = splitmix(i ^ seed) % range;
}

// Random gather: TLB-bound when `data` spans tens of GiB.
extern "C" __global__ void gather(const u32* data, const u64* idx, u32* out, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = data[idx[i]];
}

// Streaming copy, 16 bytes a thread a step.
extern "C" __global__ void copy(const uint4* src, uint4* dst, u64 n16) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n16; i += (u64)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"#;
