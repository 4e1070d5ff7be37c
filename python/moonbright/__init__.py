"""MoonBright: a GPU memory allocator on the CUDA virtual-memory API.

Physical memory is a pool of pages; every allocation of a page or more is stitched from any free
pages into one contiguous virtual range, so free memory is never unusable for being scattered.
Without a GPU the same allocator runs on the *host backend*, a CPU model of the CUDA
virtual-memory API (``MOONBRIGHT_ALLOC_CONF=backend:host``; ``backend:auto``, the default,
picks it when no GPU is found).

One allocator per CUDA device, process-wide, created at first use from the environment variable
``MOONBRIGHT_ALLOC_CONF`` (``key:value,key:value``, as ``PYTORCH_ALLOC_CONF``), or from
:func:`configure` called before the first allocation::

    import moonbright
    moonbright.configure(backend="host", cap="1GiB")
    moonbright.memory_stats()["reserved_bytes.all.current"]

Keys: ``backend`` (auto|cuda|host), ``device``, ``cap`` (bytes, suffixes KiB MiB GiB KB MB GB:
``cap:12GiB``), ``cap_fraction``, ``host_page_size``, ``host_capacity``, ``max_chunk``,
``max_chunk_repeated`` (the largest new chunk for a size asked for recently), ``large_chunk``, ``largest_chunk``, ``unmap_batch``, ``unmap_batch_bytes``, ``unmap_run_handles``, ``reuse_addresses`` (true|false),
``near_fit`` (0 to 1: how much larger a cached range may be and still serve a request whole),
``carve`` (0 to 1: the unused pages carving may leave in cached ranges it cuts, of the peak in
use), ``carve_repeated`` (0 to 1: that budget for a request of a size asked for recently, as a
training step's are), ``grow_first`` (0 to 10: latency before memory; new memory, one chunk
per request, before stealing cached ranges while held memory stays this far above the peak in
use; 0, the default, is off),
``peer_access`` (true|false), ``ipc`` (true|false: chunks can be sent to other processes,
:mod:`moonbright.ipc`),
``validate`` (true|false).

PyTorch: see :mod:`moonbright.torch` (``moonbright.torch.enable()`` or
``moonbright.torch.pool()``).

``device=None`` in these functions means the calling thread's current CUDA device (the one
``torch.cuda.set_device`` selects, as ``torch.cuda.memory_stats()`` does), or, on a thread
with no CUDA context yet, the configured ``device`` (option ``device``, 0 by default). A call
for a device with no allocator yet creates one there.

Several GPUs in one process: each GPU's allocator grants every other GPU the process allocates
on access to its memory (:func:`enable_peer_access`), so copies between GPUs
(``tensor.to("cuda:1")``) work as with ``cudaMalloc``'s memory; ``cudaDeviceEnablePeerAccess``,
which PyTorch calls, does not reach virtual-memory mappings. A process on one GPU pays nothing
for it; with several, each mapping sets access for each of them (``peer_access:false`` turns it
off, and copies between the GPUs then fail). MoonBright's calls leave each thread's current
device as they find it.

The C entry points ``moonbright_alloc(size, device, stream)`` and
``moonbright_free(ptr, size, device, stream)`` (PyTorch's CUDAPluggableAllocator signatures) are
exported by the extension module itself, :func:`library_path`. They return null on failure and
leave the message for :func:`last_error`.
"""

from __future__ import annotations

import glob
import os
import pickle
import re
import sys
from typing import Any


def _pip_nvrtc(paths: list[str]) -> list[str]:
    """The libnvrtc files of NVIDIA's pip packages under ``paths`` (``sys.path`` entries):
    ``nvidia/cuda_nvrtc/lib`` (CUDA 12's nvidia-cuda-nvrtc-cu12), ``nvidia/cu13/lib`` (CUDA
    13's nvidia-cuda-nvrtc, which PyTorch's CUDA 13 wheels install), newest version first."""
    found: list[tuple[tuple[int, ...], str]] = []
    for base in dict.fromkeys(p for p in paths if isinstance(p, str) and p):
        nvidia = os.path.join(base, "nvidia")
        if not os.path.isdir(nvidia):
            continue
        for path in glob.glob(os.path.join(nvidia, "*", "lib", "libnvrtc.so*")):
            m = re.fullmatch(r"libnvrtc\.so((?:\.\d+)*)", os.path.basename(path))
            if m is not None:
                found.append((tuple(int(n) for n in m.group(1).split(".")[1:]), path))
    found.sort(key=lambda item: item[0], reverse=True)
    return [path for _, path in found]


# MoonBright looks for libnvrtc (the paged pool compiles its kernels with it) where
# MOONBRIGHT_NVRTC says first, then on the loader path, which a process cannot change once it
# runs: point it at pip's nvidia-cuda-nvrtc, unless it is set already.
if not os.environ.get("MOONBRIGHT_NVRTC"):
    _found = _pip_nvrtc(sys.path)
    if _found:
        os.environ["MOONBRIGHT_NVRTC"] = os.pathsep.join(_found)
    del _found

from . import _moonbright, ipc  # noqa: E402
from ._moonbright import (  # noqa: E402
    CONF_KEYS,
    ENV_VAR,
    Growable,
    __version__,
    backend,
    begin_allocate_to_pool,
    begin_graph_capture,
    cap,
    capture_finished,
    capture_starting,
    check_invariants,
    clear_last_error,
    configure,
    empty_cache,
    enable_peer_access,
    end_allocate_to_pool,
    end_graph_capture,
    free_async,
    graph_pool_free,
    graph_pool_live,
    graph_replayed,
    is_initialized,
    last_error,
    memory_fraction,
    memory_stats,
    options,
    page_size,
    parse_conf,
    peers,
    record_memory_history,
    record_stream,
    nvrtc_version,
    release_graph_pool,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    set_cap,
    set_graph_pool_live,
    set_memory_fraction,
    snapshot,
)

__all__ = [
    "CONF_KEYS",
    "ENV_VAR",
    "Growable",
    "__version__",
    "backend",
    "begin_allocate_to_pool",
    "begin_graph_capture",
    "cap",
    "capture_finished",
    "capture_starting",
    "check_invariants",
    "clear_last_error",
    "configure",
    "dump_snapshot",
    "empty_cache",
    "enable_peer_access",
    "end_allocate_to_pool",
    "end_graph_capture",
    "free_async",
    "graph_pool_free",
    "graph_pool_live",
    "graph_replayed",
    "ipc",
    "is_initialized",
    "last_error",
    "library_path",
    "memory_fraction",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "nvrtc_version",
    "options",
    "page_size",
    "parse_conf",
    "peers",
    "record_memory_history",
    "record_stream",
    "release_graph_pool",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_cap",
    "set_graph_pool_live",
    "set_memory_fraction",
    "snapshot",
]


def library_path() -> str:
    """The path of the shared library exporting ``moonbright_alloc`` / ``moonbright_free``
    (and ``moonbright_torch_alloc``), for ``torch.cuda.memory.CUDAPluggableAllocator`` or
    ``ctypes.CDLL``. It is this package's extension module: one copy of the allocator state."""
    return _moonbright.__file__


def dump_snapshot(path: str, device: int | None = None) -> None:
    """Writes :func:`snapshot` to ``path`` as a pickle, as ``torch.cuda.memory._dump_snapshot``
    does: the file opens in PyTorch's memory viewer (pytorch.org/memory_viz) and in
    ``python -m torch.cuda._memory_viz``."""
    with open(path, "wb") as f:
        pickle.dump(snapshot(device), f)


def memory_stats_as_nested_dict(device: int | None = None) -> dict[str, Any]:
    """:func:`memory_stats` nested at the dots, as ``torch._C._cuda_memoryStats`` returns
    PyTorch's (``{"allocated_bytes": {"all": {"current": ...}}}``)."""
    out: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        node = out
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
