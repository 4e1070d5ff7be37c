"""Helpers shared by the PyTorch benchmark scripts: percentiles as the Rust side computes them."""
import math
import os


def summary(xs):
    """n, p50, p99, mean, min, max with nearest-rank percentiles (as moonbright-bench's Summary)."""
    if not xs:
        return {"n": 0, "p50": 0.0, "p99": 0.0, "mean": 0.0, "min": 0.0, "max": 0.0}
    v = sorted(xs)
    def pct(p):
        i = min(max(math.ceil(p / 100.0 * len(v)), 1), len(v)) - 1
        return v[i]
    return {"n": len(v), "p50": pct(50), "p99": pct(99), "mean": sum(v) / len(v),
            "min": v[0], "max": v[-1]}


def backend_label(torch):
    """'native', 'native+expandable_segments' or 'cudaMallocAsync', from the allocator in use."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    b = torch.cuda.get_allocator_backend()
    if b == "native" and "expandable_segments:True" in conf.replace(" ", ""):
        return "native+expandable_segments"
    return b

