"""moonbright.torch without a GPU: the PyTorch version check against fake ``torch`` modules (no
PyTorch needed), and, where PyTorch is installed, torch.cuda's statistics, summary and memory
history routed to MoonBright's host backend."""

import types
import warnings

import pytest

import moonbright
import moonbright.torch as mt
from test_moonbright import viewer_snapshot

PAGE = 64 << 10


def fake_torch(version="2.11.0+cu130", drop=()):
    """A module object with what enable() needs and the torch._C functions it replaces, as
    PyTorch 2.11 has them, less the dotted names in ``drop``."""

    def f(*args, **kwargs):
        return None

    graph = type("CUDAGraph", (), {n: f for n in ("capture_begin", "capture_end", "replay", "reset")})
    torch = types.SimpleNamespace(
        __version__=version,
        _C=types.SimpleNamespace(**{n: f for n in mt._TORCH_PATCHES}),
        cuda=types.SimpleNamespace(
            memory=types.SimpleNamespace(CUDAPluggableAllocator=f, change_current_allocator=f),
            CUDAGraph=graph,
        ),
        Tensor=type("Tensor", (), {"record_stream": f}),
    )
    for name in drop:
        *path, leaf = name.split(".")
        obj = torch
        for part in path:
            obj = getattr(obj, part)
        delattr(obj, leaf)
    return torch


def check(torch):
    """Runs the check; returns the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mt._check_torch_version(torch)
    return [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_the_tested_release_passes_quietly():
    assert check(fake_torch("2.11.0+cu130")) == []
    assert check(fake_torch("2.11.3")) == []
    assert mt.TESTED_TORCH == (2, 11)


@pytest.mark.parametrize("version", ["2.12.0", "2.10.1+cu128", "3.0.0a0+git1234"])
def test_another_release_warns_naming_the_tested_range(version):
    (w,) = check(fake_torch(version))
    text = str(w.message)
    assert f"PyTorch {version} is outside" in text and "2.11.x" in text
    assert "goes on" in text and "torch._C" in text


def test_missing_patched_functions_are_named():
    (w,) = check(fake_torch("2.12.0", drop=["_C._cuda_getMemoryFraction", "_C._cuda_releasePool"]))
    text = str(w.message)
    assert "torch._C._cuda_getMemoryFraction" in text and "torch._C._cuda_releasePool" in text
    assert "torch._C._cuda_memoryStats" not in text.split("Missing here")[1]
    # Even in the tested release, a missing one is said.
    (w,) = check(fake_torch("2.11.0", drop=["_C._cuda_memorySnapshot"]))
    assert "torch._C._cuda_memorySnapshot" in str(w.message)


def test_an_unreadable_version_warns():
    (w,) = check(fake_torch("weird"))
    assert "PyTorch weird" in str(w.message)


@pytest.mark.parametrize(
    "missing", ["cuda.memory.CUDAPluggableAllocator", "cuda.CUDAGraph.capture_begin",
                "Tensor.record_stream"])
def test_what_enable_cannot_do_without_raises(missing):
    with pytest.raises(RuntimeError, match=f"torch.{missing}") as e:
        check(fake_torch("2.12.0", drop=[missing]))
    assert "2.11.x" in str(e.value)


# ---- with PyTorch installed (CPU is enough) ------------------------------------------------


@pytest.fixture
def patched_torch(monkeypatch):
    """PyTorch with torch.cuda's statistics functions pointed at MoonBright's host backend
    (``_patch_statistics``, as enable() does), put back afterwards; device 0 counts as
    initialised."""
    torch = pytest.importorskip("torch")
    for name in mt._TORCH_PATCHES:
        monkeypatch.setattr(torch._C, name, getattr(torch._C, name, None), raising=False)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    mt._patch_statistics(torch)
    return torch


def test_installed_torch_is_checked(patched_torch):
    torch = patched_torch
    w = check(torch)
    if mt._torch_version(torch) == mt.TESTED_TORCH:
        assert w == [], [str(x.message) for x in w]
    else:
        assert w and "outside" in str(w[0].message)


def test_torch_memory_summary_reads_moonbright_stats(patched_torch, lib):
    torch = patched_torch
    p = lib.moonbright_alloc(3 * PAGE, 0, None)
    try:
        text = torch.cuda.memory_summary(device=0)
        assert "PyTorch CUDA memory summary" in text
        for row in ("Allocated memory", "Requested memory", "GPU reserved memory",
                    "Non-releasable memory", "Allocations", "GPU reserved segments",
                    "Oversize allocations", "CUDA OOMs"):
            assert row in text, row
        assert torch.cuda.memory_allocated(0) == moonbright.memory_stats()["allocated_bytes.all.current"]
        assert torch.cuda.memory_summary(device=0, abbreviated=True)
    finally:
        lib.moonbright_free(p, 0, 0, None)


def test_torch_reset_accumulated_memory_stats_is_routed(patched_torch, lib):
    torch = patched_torch
    p = lib.moonbright_alloc(PAGE, 0, None)
    lib.moonbright_free(p, 0, 0, None)
    assert torch.cuda.memory_stats(0)["allocation.all.allocated"] > 0
    torch.cuda.reset_accumulated_memory_stats(0)
    s = torch.cuda.memory_stats(0)
    assert s["allocation.all.allocated"] == 0 and s["allocation.all.freed"] == 0
    assert s["num_ooms"] == 0


def _torch_allocates_here(lib):
    return lib.moonbright_alloc(2 * PAGE, 0, None)


def test_torch_record_memory_history_with_stacks_gives_frames(patched_torch, lib):
    torch = patched_torch
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=1000)
    try:
        p = _torch_allocates_here(lib)
        snap = torch.cuda.memory._snapshot()
        ev = next(e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] == p)
        assert ev["frames"][0]["name"] == "_torch_allocates_here"
        assert viewer_snapshot(memory_viz.trace_plot(snap))["device_traces"] == snap["device_traces"]
        lines = memory_viz.segments(snap, format_flamegraph=lambda lines: lines)
        assert "test_torch_cpu.py:" in lines and ":_torch_allocates_here" in lines
        lib.moonbright_free(p, 0, 0, None)
        # context=None: history without frames.
        torch.cuda.memory._record_memory_history(enabled="all", context=None)
        q = _torch_allocates_here(lib)
        snap = torch.cuda.memory._snapshot()
        ev = next(e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] == q)
        assert ev["frames"] == []
        lib.moonbright_free(q, 0, 0, None)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert moonbright.snapshot()["device_traces"][0] == []
