"""Alloc+free pairs of unmodified PyTorch (`torch.empty` and its release) at several sizes, for
the LD_PRELOAD interposer against the CUDA runtime's own calls. Run it twice, with and without
LD_PRELOAD=libmoonbright_preload.so, under PYTORCH_NO_CUDA_MEMORY_CACHING=1 (each pair is a
cudaMalloc and a cudaFree) or PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (a
cudaMallocAsync and a cudaFreeAsync). Prints one JSON line: microseconds per pair at p50 and
p99 over 2,000 timed pairs per size (after 200 untimed), and whether the interposer served them.
"""

import json
import statistics
import time

import torch
from moonbright.preload import report

SIZES = [512, 1 << 16, 2 << 20, 64 << 20, 1 << 30]


def served():
    r = report()
    return None if r is None else r["served_allocs"]


def main():
    torch.zeros(1, device="cuda")
    out = {}
    for size in SIZES:
        for _ in range(200):
            torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        times = []
        for _ in range(2000):
            t = time.perf_counter()
            torch.empty(size, dtype=torch.uint8, device="cuda")
            times.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        times.sort()
        out[size] = {"p50": statistics.median(times), "p99": times[int(len(times) * 0.99)]}
    print(json.dumps({"pairs_us": out, "served_allocs": served()}))


if __name__ == "__main__":
    main()
