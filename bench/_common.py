"""Helpers shared by the PyTorch benchmark scripts: percentiles as the Rust side computes them,
the allocator under test, and the environment that picks it."""
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



def is_moonbright(name):
    """Whether configuration `name` runs on MoonBright (`mb`, `mb[CONF]`, `mb@SITE`, ...)."""
    return name.startswith("mb")


def allocator_env(name, others=(), script="bench"):
    """The environment (over the caller's; None: unset) of a process running configuration
    `name`: `torch`, `torch-expandable` (`expandable_segments:True`), `torch-async`
    (`backend:cudaMallocAsync`), `mb`, `mb[CONF]` (`MOONBRIGHT_ALLOC_CONF=CONF`), any of the
    MoonBright ones with `@SITE` (that build's package first on `PYTHONPATH`), or one of
    `others`, which set nothing here. An unknown name ends the program."""
    env = {"PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": None,
           "MOONBRIGHT_ALLOC_CONF": None}
    if is_moonbright(name) and "@" in name:
        name, site = name.split("@", 1)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    if name == "torch-expandable":
        env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    elif name == "torch-async":
        env["PYTORCH_ALLOC_CONF"] = "backend:cudaMallocAsync"
    elif name.startswith("mb[") and name.endswith("]"):
        env["MOONBRIGHT_ALLOC_CONF"] = name[3:-1]
    elif name not in ("torch", "mb", *others):
        raise SystemExit(f"{script}: unknown configuration {name!r}")
    return env
