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

import contextlib
import glob
import os
import pickle
import re
import sys
from typing import Any, Iterable, Iterator


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
    current_tag,
    empty_cache,
    enable_peer_access,
    end_allocate_to_pool,
    end_graph_capture,
    free_async,
    graph_pool_free,
    graph_pool_live,
    graph_replayed,
    host_memory,
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
    release_host_memory,
    reserve_host_memory,
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
    "current_tag",
    "dump_snapshot",
    "empty_cache",
    "enable_peer_access",
    "end_allocate_to_pool",
    "end_graph_capture",
    "free_async",
    "graph_pool_free",
    "graph_pool_live",
    "graph_replayed",
    "host_memory",
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
    "release_host_memory",
    "reserve_host_memory",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_cap",
    "set_graph_pool_live",
    "set_memory_fraction",
    "sleep",
    "snapshot",
    "tag",
    "tags",
    "wake",
]


@contextlib.contextmanager
def tag(name: str | None) -> Iterator[None]:
    """Tags the calling thread's allocations with ``name`` inside the ``with`` block (blocks
    nest; other threads are not tagged; ``None``: untagged, whatever block encloses this one),
    so that :func:`sleep` and :func:`wake` take them as one
    group: a model's weights, its KV cache. Works in every mode, since the tag is read on the
    allocating thread: ``moonbright.torch.enable()``, ``moonbright.torch.pool()`` (give each tag
    a pool of its own: PyTorch's caching allocator reuses a pool's segments for whatever is
    allocated into it later), and the interposer (``moonbright_tag_begin``). A tagged
    allocation never shares memory with another tag or with untagged ones, so a tag's small
    tensors take arenas of their own (at most one page per tag is left partly empty).

    PyTorch's autograd runs the backward pass on threads of its own: gradients are untagged
    unless allocated beforehand (``zero_grad(set_to_none=False)``) in the block."""
    previous = _moonbright.tag_enter(name)
    try:
        yield
    finally:
        _moonbright.tag_restore(previous)


def _tag_list(tags: str | Iterable[str]) -> list[str]:
    return [tags] if isinstance(tags, str) else list(tags)


def sleep(
    tags: str | Iterable[str], *, backup: bool = True, device: int | None = None
) -> dict[str, Any]:
    """Puts every allocation tagged with ``tags`` (one name or several) on ``device`` to sleep:
    waits for the work queued on the streams they were allocated or recorded on (by events: no
    device-wide synchronisation, and other streams' kernels keep running), copies their bytes
    to pinned host memory if ``backup`` (else drops them), then unmaps their memory and gives it
    back to the driver, so ``torch.cuda.mem_get_info`` counts it free. Their virtual addresses
    stay reserved: tensors, pointers and CUDA graphs that hold them are valid again after
    :func:`wake`. Until then, allocating with the tag, freeing its tensors and sleeping it
    again raise ``RuntimeError`` (a tensor of a sleeping tag must outlive its sleep: under
    ``moonbright.torch.enable()`` its free would be refused, and its memory lost to the tag).

    Tags go to sleep one at a time, in order; if one fails, those before it stay asleep and it
    stays awake, as it was. Pinned host memory is kept for the next sleep once a wake returns
    it (:func:`host_memory`, :func:`release_host_memory`); pinning runs at a few GiB/s, so a
    first sleep is slower than the next ones unless :func:`reserve_host_memory` pinned it ahead.
    Returns the totals:
    ``{"bytes", "released", "backed_up", "seconds"}``."""
    total = {"bytes": 0, "released": 0, "backed_up": 0, "seconds": 0.0}
    for name in _tag_list(tags):
        for key, value in _moonbright.sleep_tag(name, backup, device).items():
            total[key] += value
    return total


def wake(tags: str | Iterable[str], *, device: int | None = None) -> dict[str, Any]:
    """Wakes ``tags`` on ``device``: maps their memory again at the same addresses and copies
    their bytes back if their sleep kept them (a tag slept without backup holds whatever the new
    memory held); returns once the bytes are in place. All or nothing per tag: a tag whose
    memory cannot be had raises ``MemoryError`` (any other failure ``RuntimeError``) and stays
    asleep with its bytes; free memory and call again. Returns the totals: ``{"bytes",
    "created", "restored", "seconds"}`` (``created``: bytes of new physical memory; the rest came
    from memory MoonBright held free)."""
    total = {"bytes": 0, "created": 0, "restored": 0, "seconds": 0.0}
    for name in _tag_list(tags):
        for key, value in _moonbright.wake_tag(name, device).items():
            total[key] += value
    return total


def tags(device: int | None = None) -> dict[str, dict[str, Any]]:
    """Every tag with live allocations or asleep on ``device``: name -> ``{"allocations",
    "bytes", "asleep", "backed_up"}``."""
    return _moonbright.tags_info(device)


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
