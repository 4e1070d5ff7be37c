"""MoonBright as PyTorch's CUDA allocator: globally, or for a scoped memory pool.

Global mode, :func:`enable`::

    import moonbright.torch
    moonbright.torch.enable()          # before anything touches CUDA
    x = torch.empty(1 << 30, device="cuda")

Every CUDA tensor's memory then comes from MoonBright
(``torch.cuda.memory.CUDAPluggableAllocator`` over this package's own extension module, with
``torch.cuda.memory.change_current_allocator``). Each allocation of a page or more is stitched
from any free physical pages into one fresh virtual range, so **fragmentation cannot cause an
out-of-memory error**: a request fails only when too little memory is free in total. This is the
mode where MoonBright's figures apply (peak reserved close to peak requested).

``torch.cuda.memory_stats()``, ``memory_allocated()``, ``max_memory_allocated()``,
``memory_reserved()``, ``max_memory_reserved()``, ``reset_peak_memory_stats()``,
``reset_accumulated_memory_stats()``, ``memory_summary()``, ``empty_cache()`` and
``torch.cuda.memory._snapshot()`` keep working and report MoonBright's figures (PyTorch's
CUDAPluggableAllocator raises "does not yet support getDeviceStats" for them; :func:`enable`
replaces the ``torch._C`` functions they call).
``torch.cuda.memory._record_memory_history(context="all")`` records the Python frames of each
allocation and free in the snapshot, for PyTorch's memory viewer (C++ frames are not recorded,
whatever ``stacks`` asks).
``set_per_process_memory_fraction()``, which the pluggable allocator ignores, sets MoonBright's
cap (:func:`moonbright.set_memory_fraction`), and ``get_per_process_memory_fraction()`` reads it.
``empty_cache()`` waits, as under PyTorch's allocator, for the GPU work queued before each pending
free, then gives every unused page back to the driver. In
PyTorch's keys, ``allocated_bytes`` and ``requested_bytes`` are the bytes asked for,
``active_bytes`` the bytes after MoonBright's rounding (256 B below a page, whole pages above),
``reserved_bytes`` the physical memory held, ``segment`` the physical chunks; MoonBright has one
pool, so ``large_pool`` repeats ``all`` and ``small_pool`` is zero. MoonBright's own figures are
under ``moonbright.`` in :func:`moonbright.memory_stats`.

``Tensor.record_stream(s)`` works as with PyTorch's own allocator: the tensor's memory is reused
by no stream until the work queued on ``s`` before its free has completed (:func:`enable` routes
it to :func:`moonbright.record_stream`; PyTorch's pluggable allocator alone drops it). C++ code
that records streams itself is not seen; ``torch.distributed``'s NCCL backend no longer does
(since PyTorch 2.7 it keeps the tensors of asynchronous collectives alive until they complete).

Several GPUs in one process work: each GPU's allocator grants the others access to its memory
(copies between GPUs need it), and MoonBright's calls leave each thread's current device as
PyTorch set it.

Other processes: ``torch.multiprocessing`` sends CUDA tensors by PyTorch's own IPC, which its
pluggable-allocator interface refuses; :func:`enable` installs :mod:`moonbright.ipc`'s
reducer instead, so queues and process arguments carry MoonBright's tensors as mappings of the
same memory (the sender keeps them alive while the receiver uses them, as with PyTorch's).

Out of memory raises ``torch.OutOfMemoryError`` with MoonBright's message (what was asked, what
is allocated, reserved and free, and the cap), and the process goes on: free tensors and
allocate again. :func:`moonbright.last_error` holds the message too.

Memory-pool mode, :func:`pool`::

    pool = moonbright.torch.pool()
    with torch.cuda.use_mem_pool(pool):
        kv_cache = torch.empty(..., device="cuda")

PyTorch's caching allocator stays in charge: it asks MoonBright for whole segments (2 MiB and
up) and carves tensors out of them itself, with its own rounding, splitting and caching. Only
the segments come from MoonBright, so PyTorch's fragmentation inside its segments remains; what
MoonBright adds is that segments are stitched from scattered pages, so a large segment never
fails for lack of contiguous memory. PyTorch's own statistics work as usual in this mode (they
describe PyTorch's pools); :func:`moonbright.memory_stats` describes the segments. Out of memory
raises PyTorch's own ``torch.OutOfMemoryError``; MoonBright's explanation is in
:func:`moonbright.last_error`. Use it for scoped work, or when the global allocator is already
initialised.

CUDA graphs: in global mode, ``torch.cuda.graph`` and ``make_graphed_callables`` work as with
PyTorch's allocator. Tensors allocated inside a capture come from a *graph pool*, PyTorch's
``graph.pool()`` (shared when ``pool=`` is passed, as with ``graph_pool_handle()``): their
memory stays the pool's, for later captures into it, until the pool's last graph is reset or
deleted, and then goes back ordered after the streams the graphs were replayed on. A block
freed inside a capture is reused there only on the stream that freed it. (:func:`enable` wraps
``torch.cuda.CUDAGraph``'s methods for this, since the pluggable-allocator interface offers
PyTorch's capture hooks only to C++.) A graph pool's free blocks count as reserved, not as
allocated or active, as under PyTorch's allocator; :func:`moonbright.graph_pool_free` gives
them.

PyTorch's contract: :func:`enable` turns on options ``captures_announced`` and
``deferred_free_events`` (unless ``MOONBRIGHT_ALLOC_CONF`` or :func:`moonbright.configure` sets
them), so that a cache hit makes no driver call. Without them every allocation asks the driver
whether its stream is being captured (``cuStreamIsCapturing``) and every free asks again and
records an event; inside a training step, where the launching thread keeps the driver busy,
those three calls per allocation cost a ResNet-50 step about a third of its speed on an H100
(docs/design.md, "PyTorch's hot path"). What the options assume is what PyTorch's own allocator
assumes: a CUDA graph capture goes through ``torch.cuda.CUDAGraph`` (``torch.cuda.graph``,
``make_graphed_callables``, ``torch.compile``'s CUDA graphs), which :func:`enable` wraps to
announce it, so a capture begun from C++ behind PyTorch's back is not seen; and streams outlive
the allocator (PyTorch's own streams do; a ``torch.cuda.ExternalStream`` that frees were ordered
on must too), since the background worker records one event per stream for its latest frees.
``MOONBRIGHT_ALLOC_CONF=captures_announced:false,deferred_free_events:false`` restores the
checks.

``torch.compile(mode="reduce-overhead")`` works under :func:`enable`. Its CUDA-graph trees
call allocator functions that CUDAPluggableAllocator does not forward (it raises "pluggable does
not yet support checkPoolLiveAllocations"); :func:`enable` replaces the ``torch._C`` functions
they call with MoonBright's (see ``_patch_graph_trees``): warm-up runs allocate into the trees'
graph pool (:func:`moonbright.begin_allocate_to_pool`), the pool's live blocks are read and set
back (:func:`moonbright.graph_pool_live`, :func:`moonbright.set_graph_pool_live`) where PyTorch
checkpoints its allocator's state, and the trees' checks compare MoonBright's live blocks. One
difference from PyTorch's allocator: where the trees hand live tensors of replayed graphs a
deleter (C++ only), MoonBright instead watches those tensors' storages and frees their blocks
once they are dead, at the trees' next allocator call or graph replay (or
``torch.cuda.empty_cache()``), not at once.

In pool mode, PyTorch's caching allocator keeps its own graph-private pools and asks MoonBright
for segments while capturing (``torch.cuda.graph(g, pool=pool.id)``); MoonBright serves them
from memory no stream's queued work uses (``Allocator::malloc_for_graph``).
"""

from __future__ import annotations

import os
import re
from typing import Any

import moonbright
from moonbright import _moonbright

__all__ = ["enable", "is_enabled", "pool", "oom_as_torch_error"]

_enabled = False
_oom_as_torch_error = False
# Pluggable allocators handed to PyTorch: PyTorch keeps raw pointers to them.
_keep: list[Any] = []
# The graph wrappers' pool-id map and use counts (`_patch_graphs`), for tests.
_graph_pool_keys: dict[str, Any] = {}


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("moonbright.torch needs PyTorch (pip install torch)") from e
    return torch


# The PyTorch release enable() is tested with (pyproject's `torch` extra: torch>=2.11,<2.12).
TESTED_TORCH = (2, 11)
# What enable() cannot work without: it raises when one is missing.
_TORCH_NEEDS = (
    "cuda.memory.CUDAPluggableAllocator",
    "cuda.memory.change_current_allocator",
    "cuda.CUDAGraph.capture_begin",
    "cuda.CUDAGraph.capture_end",
    "cuda.CUDAGraph.replay",
    "cuda.CUDAGraph.reset",
    "Tensor.record_stream",
)
# The private torch._C functions enable() replaces, named after PyTorch 2.11's and called with
# its arguments: those behind torch.cuda's statistics (_patch_statistics), and those of the
# CUDA-graph trees (_patch_graph_trees).
_STATISTICS_PATCHES = (
    "_cuda_memoryStats",
    "_cuda_resetPeakMemoryStats",
    "_cuda_resetAccumulatedMemoryStats",
    "_cuda_emptyCache",
    "_cuda_memorySnapshot",
    "_cuda_record_memory_history",
    "_cuda_setMemoryFraction",
    "_cuda_getMemoryFraction",
)
_GRAPH_TREE_PATCHES = (
    "_cuda_beginAllocateCurrentThreadToPool",
    "_cuda_endAllocateToPool",
    "_cuda_releasePool",
    "_cuda_getCheckpointState",
    "_cuda_setCheckpointPoolState",
    "_cuda_checkPoolLiveAllocations",
    "_cuda_cudaCachingAllocator_raw_delete",
    "_free_And_Remove_DeleterFn",
    "_has_Standard_Deleter",
)
_TORCH_PATCHES = _STATISTICS_PATCHES + _GRAPH_TREE_PATCHES


def _torch_version(torch: Any) -> tuple[int, int] | None:
    """(major, minor) of ``torch.__version__`` ("2.11.0+cu130" -> (2, 11)), None if unreadable."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(getattr(torch, "__version__", "")))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_torch_version(torch: Any) -> None:
    """Checks the installed PyTorch against the release :func:`enable` is tested with
    (:data:`TESTED_TORCH`, 2.11.x). Raises RuntimeError when something enable() cannot work
    without is missing (the pluggable allocator, ``CUDAGraph``'s methods,
    ``Tensor.record_stream``). Outside the tested release, or when a private ``torch._C``
    function it replaces is missing, warns (RuntimeWarning) and lets enable() go on: it replaces
    the functions that exist; those whose arguments changed may then fail when called, and
    those missing stay PyTorch's own (under the pluggable allocator, their features raise or
    report nothing)."""
    import warnings

    version = str(getattr(torch, "__version__", "unknown"))
    tested = "{}.{}.x".format(*TESTED_TORCH)

    def lookup(path: str) -> Any:
        obj = torch
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj

    needed = [f"torch.{n}" for n in _TORCH_NEEDS if lookup(n) is None]
    if needed:
        raise RuntimeError(
            f"moonbright.torch.enable(): PyTorch {version} lacks {', '.join(needed)}, which "
            f"MoonBright needs to become its CUDA allocator (it is tested with PyTorch {tested}; "
            "pip install 'moonbright[torch]' installs that release)"
        )
    C = getattr(torch, "_C", None)
    missing = [f"torch._C.{n}" for n in _TORCH_PATCHES if getattr(C, n, None) is None]
    in_range = _torch_version(torch) == TESTED_TORCH
    if in_range and not missing:
        return
    text = [
        f"moonbright.torch.enable(): PyTorch {version} "
        + (f"is outside the release MoonBright is tested with ({tested}). " if not in_range
           else f"is the tested release ({tested}) but not as MoonBright knows it. ")
        + "enable() goes on: MoonBright becomes the allocator through PyTorch's pluggable "
        "allocator, and it replaces private torch._C functions behind torch.cuda's statistics, "
        "snapshots, memory history, memory fraction, empty_cache, record_stream and "
        "CUDA-graph trees, written for PyTorch's "
        f"{tested} arguments; if this release changed them, those calls may fail."
    ]
    if missing:
        text.append(
            f" Missing here, so left as PyTorch's own (their features may raise or report "
            f"nothing under the pluggable allocator): {', '.join(missing)}."
        )
    warnings.warn("".join(text), RuntimeWarning, stacklevel=3)


def is_enabled() -> bool:
    """Whether :func:`enable` made MoonBright PyTorch's global CUDA allocator."""
    return _enabled


def oom_as_torch_error() -> bool:
    """Whether an out-of-memory in global mode raises ``torch.OutOfMemoryError`` (True once
    :func:`enable` has checked the installed PyTorch), rather than ``RuntimeError``."""
    return _oom_as_torch_error


def _pytorch_error_layout_ok(torch: Any) -> bool:
    """Checks that the installed PyTorch declares ``torch::PyTorchError`` as MoonBright's C++
    entry point repeats it (a std::exception with one pure virtual ``python_type()`` and a
    ``std::string msg``) and translates it with ``e.python_type()``."""
    header = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "Exceptions.h")
    try:
        with open(header, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    m = re.search(
        r"struct\s+(?:TORCH_PYTHON_API\s+)?PyTorchError\s*:\s*public\s+std::exception\s*\{(.*?)\n\};",
        text,
        re.S,
    )
    if not m:
        return False
    body = re.sub(r"//[^\n]*", "", m.group(1))
    virtuals = re.findall(r"virtual\s+([^;{]*)", body)
    if [v.strip() for v in virtuals] != ["PyObject* python_type() = 0"]:
        return False
    if not re.search(r"const\s+char\s*\*\s*what\(\)\s*const\s+noexcept\s+override", body):
        return False
    members = re.findall(r"^\s*([A-Za-z_:<>]+)\s+([A-Za-z_]+)\s*;", body, re.M)
    if members != [("std::string", "msg")]:
        return False
    return bool(
        re.search(r"catch\s*\(\s*torch::PyTorchError\s*&\s*e\s*\)", text)
        and "e.python_type()" in text
    )


def _pluggable(alloc_fn: str) -> Any:
    torch = _torch()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        moonbright.library_path(), alloc_fn, "moonbright_free"
    )
    _keep.append(alloc)
    return alloc


def enable(*, oom_as_torch_error: bool = True) -> None:
    """Makes MoonBright PyTorch's CUDA allocator for this process (global mode; see the module
    documentation). Call it before anything initialises CUDA in PyTorch. Calling it again does
    nothing.

    ``oom_as_torch_error``: raise ``torch.OutOfMemoryError`` on out of memory (checked against
    the installed PyTorch's headers; ``RuntimeError`` with the same message when the check
    fails or this is False).
    """
    global _enabled, _oom_as_torch_error
    if _enabled:
        return
    torch = _torch()
    _check_torch_version(torch)
    if not torch.cuda.is_available():
        raise RuntimeError(
            "moonbright.torch.enable(): PyTorch sees no CUDA device (torch.cuda.is_available() "
            "is False); use moonbright's own functions with the host backend instead"
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "moonbright.torch.enable() must be called before PyTorch initialises CUDA: PyTorch's "
            "own allocator is already in use (a CUDA tensor was made, or torch.cuda.init() ran), "
            "and PyTorch cannot swap it. Call enable() first thing after `import torch`, or use "
            "moonbright.torch.pool() for scoped use."
        )
    if moonbright.options()["backend"] == "host":
        raise RuntimeError(
            "moonbright.torch.enable(): MOONBRIGHT_ALLOC_CONF (or configure()) selects the host "
            "backend, whose memory CUDA kernels cannot use; use backend:auto or backend:cuda"
        )
    if not _moonbright._use_torch_contract():
        import warnings

        warnings.warn(
            "moonbright.torch.enable(): a MoonBright allocator was created before enable(), so "
            "its options are fixed without PyTorch's contract (captures_announced, "
            "deferred_free_events): every allocation and free makes driver calls, which slows "
            "PyTorch's steps. Call enable() before any other moonbright call.",
            RuntimeWarning,
            stacklevel=2,
        )
    _oom_as_torch_error = bool(oom_as_torch_error) and _pytorch_error_layout_ok(torch)
    _moonbright._set_torch_oom_type(torch.OutOfMemoryError if _oom_as_torch_error else None)
    alloc = _pluggable("moonbright_torch_alloc")
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        _moonbright._use_torch_contract(False)
        raise RuntimeError(
            "moonbright.torch.enable(): PyTorch refused to change its allocator, because its own "
            "CUDA allocator has already allocated. Call enable() before any CUDA work. "
            f"(PyTorch said: {e})"
        ) from e
    _patch_statistics(torch)
    _patch_record_stream(torch)
    _patch_graphs(torch)
    _patch_graph_trees(torch)
    moonbright.ipc.enable_torch_multiprocessing()
    _enabled = True


def _patch_record_stream(torch: Any) -> None:
    """Makes ``Tensor.record_stream`` reach MoonBright.

    PyTorch's ``record_stream`` calls the allocator's ``recordStream``, which
    CUDAPluggableAllocator forwards only to a C++ hook that Python cannot set, and otherwise
    ignores (torch/csrc/cuda/CUDAPluggableAllocator.cpp). Without this, a tensor recorded on a
    side stream and freed on its own stream would be reused by its own stream at once, while the
    side stream's work may still read it. The wrapper calls PyTorch's method (its checks stay)
    and then :func:`moonbright.record_stream` with the storage's base pointer, the allocation
    MoonBright made. Storages MoonBright did not make are ignored, as PyTorch's allocator
    ignores them. C++ code that calls the allocator's ``recordStream`` directly, not through
    ``Tensor.record_stream``, is not seen.
    """
    original = torch.Tensor.record_stream

    def record_stream(self: Any, stream: Any) -> None:
        original(self, stream)
        if self.device.type != "cuda":
            return
        handle = getattr(stream, "cuda_stream", None)
        if handle is None:  # a generic torch.Stream
            handle = torch.cuda.Stream(
                stream_id=stream.stream_id,
                device_index=stream.device_index,
                device_type=stream.device_type,
            ).cuda_stream
        try:
            ptr = self.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # layouts without one storage (sparse)
            return
        if ptr:
            moonbright.record_stream(ptr, int(handle), self.device.index, missing_ok=True)

    record_stream.__doc__ = original.__doc__
    _keep.append(original)
    torch.Tensor.record_stream = record_stream


def _patch_graphs(torch: Any) -> None:
    """Makes ``torch.cuda.CUDAGraph`` captures allocate into MoonBright graph pools.

    PyTorch tells its allocator about a capture with ``beginAllocateToPool``,
    ``endAllocateToPool`` and ``releasePool``, which CUDAPluggableAllocator forwards only to C++
    hooks that Python cannot set (torch/csrc/cuda/CUDAPluggableAllocator.cpp). The graph's
    Python methods are wrapped instead, and each calls PyTorch's own first:

    - ``capture_begin``: :func:`moonbright.capture_starting` before PyTorch's (see option
      ``captures_announced``), then :func:`moonbright.begin_graph_capture` for the capturing
      stream and the pool passed (shared with the graphs captured into it), or a fresh one;
    - ``capture_end``: :func:`moonbright.end_graph_capture` and
      :func:`moonbright.capture_finished`;
    - ``replay``: :func:`moonbright.graph_replayed` for the current stream, once a stream;
    - ``reset`` and ``__del__``: :func:`moonbright.release_graph_pool`, once a capture.

    So ``torch.cuda.graph``, ``torch.cuda.make_graphed_callables`` and code that drives
    ``CUDAGraph`` itself (vLLM's) allocate inside captures. Captures PyTorch makes without this
    class are refused as before. A failure is not raised from a destructor or in the middle of
    a capture: it is warned about, and left in :func:`moonbright.last_error`.
    """
    import warnings

    graph = torch.cuda.CUDAGraph
    originals = {
        name: getattr(graph, name) for name in ("capture_begin", "capture_end", "replay", "reset")
    }
    _keep.append(originals)

    def warn(what: str, e: BaseException) -> None:
        warnings.warn(f"moonbright: {what}: {e}", RuntimeWarning, stacklevel=3)

    # PyTorch's pool ids -> MoonBright's. `self.pool()` is known only once the capture has
    # ended, so a capture into a fresh pool begins under a key of MoonBright's own, which later
    # captures naming that graph's pool (``pool=g.pool()``) are mapped to. `users` counts the
    # graphs captured into each of MoonBright's pools and not yet released: a pool's keys go
    # with its last graph, so a process that captures graphs without end keeps none of the
    # dead ones'.
    keys: dict[tuple[int, int], tuple[int, int]] = {}
    users: dict[tuple[int, int], int] = {}

    def drop_user(pool: tuple[int, int]) -> None:
        users[pool] -= 1
        if users[pool] == 0:
            del users[pool]
            for k in [k for k, v in keys.items() if v == pool]:
                del keys[k]

    _graph_pool_keys.update(keys=keys, users=users, drop_user=drop_user, reap=lambda: None)
    fresh = iter(range(1, 1 << 62))

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> None:
        device = int(torch.cuda.current_device())
        # Announced before the capture begins and until it has ended: with option
        # captures_announced, streams are checked for a capture only meanwhile.
        moonbright.capture_starting(device)
        self.__dict__["_moonbright_announced"] = device
        try:
            originals["capture_begin"](self, *args, **kwargs)
        except BaseException:
            finish_announced(self)
            raise
        stream = int(torch.cuda.current_stream(device).cuda_stream)
        given = args[0] if args else kwargs.get("pool")
        if given is None:
            pool = ((1 << 64) - 1, next(fresh))
        else:
            given = tuple(int(x) for x in given)
            pool = keys.get(given, given)
        try:
            moonbright.begin_graph_capture(stream, pool, device)
        except RuntimeError as e:
            warn("this capture's allocations will be refused", e)
            return
        self.__dict__["_moonbright"] = {
            "device": device, "stream": stream, "pool": pool, "ended": False, "replayed": set()
        }
        users[pool] = users.get(pool, 0) + 1

    def finish_announced(self: Any) -> None:
        device = self.__dict__.pop("_moonbright_announced", None)
        if device is not None:
            moonbright.capture_finished(device)

    def end_capture(state: dict[str, Any]) -> None:
        if not state["ended"]:
            state["ended"] = True
            moonbright.end_graph_capture(state["stream"], state["device"])

    def capture_end(self: Any) -> None:
        try:
            originals["capture_end"](self)
        finally:
            finish_announced(self)
            state = self.__dict__.get("_moonbright")
            if state is not None:
                try:
                    end_capture(state)
                except RuntimeError as e:  # a deferred free failed: the capture itself is fine
                    warn("ending a capture", e)
        if state is not None:
            keys[tuple(int(x) for x in self.pool())] = state["pool"]

    def replay(self: Any) -> None:
        originals["replay"](self)
        _graph_pool_keys["reap"]()
        state = self.__dict__.get("_moonbright")
        if state is not None:
            stream = int(torch.cuda.current_stream(state["device"]).cuda_stream)
            if stream not in state["replayed"]:
                state["replayed"].add(stream)
                moonbright.graph_replayed(state["pool"], stream, state["device"])

    def release(self: Any) -> None:
        finish_announced(self)  # a capture abandoned without capture_end
        state = self.__dict__.pop("_moonbright", None)
        if state is None:
            return
        pool = state["pool"]
        drop_user(pool)
        try:
            end_capture(state)
            moonbright.release_graph_pool(pool, state["device"])
        except Exception as e:  # noqa: BLE001 - never raise from a destructor
            warn("releasing a graph's memory", e)
        try:
            _graph_pool_keys["reap"]()
        except Exception as e:  # noqa: BLE001 - never raise from a destructor
            warn("freeing a graph pool's blocks", e)

    def reset(self: Any) -> None:
        originals["reset"](self)
        release(self)

    def __del__(self: Any) -> None:
        release(self)

    for f, name in ((capture_begin, "capture_begin"), (capture_end, "capture_end"),
                    (replay, "replay"), (reset, "reset")):
        f.__doc__ = originals[name].__doc__
        setattr(graph, name, f)
    graph.__del__ = __del__


class _PoolState:
    """What ``torch._C._cuda_getCheckpointState`` returns under MoonBright: a graph pool's live
    blocks at that moment, for ``_cuda_setCheckpointPoolState`` to set back."""

    __slots__ = ("device", "pool", "live")

    def __init__(self, device: int, pool: tuple[int, int], live: tuple[int, ...]) -> None:
        self.device, self.pool, self.live = device, pool, live

    def __repr__(self) -> str:
        return f"<MoonBright graph pool {self.pool} state: {len(self.live)} live blocks>"


def _patch_graph_trees(torch: Any) -> None:
    """Serves the allocator calls of PyTorch's CUDA-graph trees
    (``torch._inductor.cudagraph_trees``, behind ``torch.compile(mode="reduce-overhead")``),
    which CUDAPluggableAllocator does not forward. PyTorch 2.11's trees look each up on
    ``torch._C`` at call time and are their only callers (``torch.cuda.use_mem_pool`` binds
    its own copies at import, so pool mode keeps PyTorch's):

    - ``_cuda_beginAllocateCurrentThreadToPool`` / ``_cuda_endAllocateToPool`` /
      ``_cuda_releasePool``: the thread's allocations go to the trees' graph pool
      (:func:`moonbright.begin_allocate_to_pool`) during warm-up runs, as one more user of it;
    - ``_cuda_getCheckpointState``: the pool's live blocks (:func:`moonbright.graph_pool_live`)
      after a graph is recorded;
    - ``_cuda_setCheckpointPoolState``: those blocks live again, the rest of the pool free
      (:func:`moonbright.set_graph_pool_live`), before a new graph is recorded beside replayed
      ones. Blocks made live again belong to no tensor PyTorch's allocator knows: the storages
      the trees name for them are watched (weak references) and their blocks freed once they
      are dead, at the next of these calls, a graph's replay or release, or
      ``torch.cuda.empty_cache()``; the trees free the others with
      ``_cuda_cudaCachingAllocator_raw_delete`` or ``_free_And_Remove_DeleterFn``, which free
      such blocks through MoonBright, and ``_has_Standard_Deleter`` says yes for the watched
      storages;
    - ``_cuda_checkPoolLiveAllocations``: whether the pool's live blocks are exactly the given
      pointers.

    Every other call goes to PyTorch's function, as before.
    """
    import threading

    from torch.multiprocessing.reductions import StorageWeakRef

    C = torch._C
    names = _GRAPH_TREE_PATCHES
    if not all(hasattr(C, n) for n in names):  # another PyTorch: leave it as it is
        return
    originals = {n: getattr(C, n) for n in names}
    _keep.append(originals)
    keys = _graph_pool_keys["keys"]
    users = _graph_pool_keys["users"]
    drop_user = _graph_pool_keys["drop_user"]
    lock = threading.RLock()
    # Routed uses not yet released: (device, MoonBright pool) -> count.
    routed: dict[tuple[int, tuple[int, int]], int] = {}
    # Blocks made live again by a set-back state, which MoonBright frees itself:
    # pointer -> (device, weak reference to the storage that owns it, or None).
    ours: dict[int, tuple[int, Any]] = {}
    _graph_pool_keys.update(routed=routed, ours=ours)

    def mb_pool(pool: Any) -> tuple[int, int]:
        given = tuple(int(x) for x in pool)
        return keys.get(given, given)

    def stream_of(device: int) -> int:
        return int(torch.cuda.current_stream(device).cuda_stream)

    def free(ptr: int, device: int) -> None:
        moonbright.free_async(ptr, stream_of(device), device)

    def reap() -> None:
        if not ours:  # the common case, and every replay asks
            return
        with lock:
            dead = [p for p, (_, ref) in ours.items() if ref is not None and ref.expired()]
            for p in dead:
                device, _ = ours.pop(p)
                try:
                    free(p, device)
                except RuntimeError as e:
                    import warnings

                    warnings.warn(f"moonbright: freeing a graph pool block: {e}", RuntimeWarning)

    _graph_pool_keys["reap"] = reap

    def begin(device: int, pool: Any) -> None:
        mb = mb_pool(pool)
        moonbright.begin_allocate_to_pool(mb, int(device))
        with lock:
            users[mb] = users.get(mb, 0) + 1
            routed[(int(device), mb)] = routed.get((int(device), mb), 0) + 1

    def end(device: int, pool: Any) -> None:
        moonbright.end_allocate_to_pool(int(device))

    def release(device: int, pool: Any) -> None:
        mb = mb_pool(pool)
        with lock:
            n = routed.get((int(device), mb), 0)
            if n == 0:
                return originals["_cuda_releasePool"](device, pool)
            if n == 1:
                del routed[(int(device), mb)]
            else:
                routed[(int(device), mb)] = n - 1
            drop_user(mb)
        moonbright.release_graph_pool(mb, int(device))
        reap()

    def get_state(device: int, pool: Any) -> _PoolState:
        reap()
        mb = mb_pool(pool)
        live = tuple(p for p, _ in moonbright.graph_pool_live(mb, int(device)))
        return _PoolState(int(device), mb, live)

    def set_state(device: int, state: Any, stale: Any, live_storages: Any = ()) -> None:
        if not isinstance(state, _PoolState):
            return originals["_cuda_setCheckpointPoolState"](device, state, stale, live_storages)
        if list(stale):
            raise RuntimeError(
                "moonbright: stale storages passed to setCheckpointPoolState are not supported "
                "(PyTorch 2.11's CUDA-graph trees pass none)"
            )
        reap()
        with lock:
            revived, freed = moonbright.set_graph_pool_live(
                state.pool, list(state.live), stream_of(state.device), state.device
            )
            for p in freed:
                ours.pop(p, None)
            for p in revived:
                ours[p] = (state.device, None)
            for cdata in live_storages:
                storage = torch.UntypedStorage._new_with_weak_ptr(cdata)
                if storage is None:
                    continue
                p = storage.data_ptr()
                if p in ours and ours[p][1] is None:
                    ours[p] = (state.device, StorageWeakRef(storage))
                del storage

    def check_live(device: int, pool: Any, expected: Any) -> bool:
        reap()
        live = {p for p, _ in moonbright.graph_pool_live(mb_pool(pool), int(device))}
        return live == {int(p) for p in expected}

    def raw_delete(ptr: int) -> None:
        with lock:
            entry = ours.pop(int(ptr), None)
        if entry is None:
            return originals["_cuda_cudaCachingAllocator_raw_delete"](ptr)
        free(int(ptr), entry[0])

    def watched(cdata: int) -> int | None:
        """The pointer of storage `cdata` (a StorageImpl's address, as the trees pass it) if
        MoonBright watches that storage for its block."""
        storage = torch.UntypedStorage._new_with_weak_ptr(cdata)
        if storage is None:
            return None
        p = storage.data_ptr()
        del storage
        with lock:
            ref = ours.get(p, (0, None))[1]
        return p if ref is not None and ref.cdata == int(cdata) else None

    def free_and_remove_deleter(cdata: int) -> None:
        p = watched(cdata)
        if p is None:
            return originals["_free_And_Remove_DeleterFn"](cdata)
        with lock:
            device, _ = ours.pop(p)
        free(p, device)

    def has_standard_deleter(cdata: int) -> bool:
        return watched(cdata) is not None or originals["_has_Standard_Deleter"](cdata)

    C._cuda_beginAllocateCurrentThreadToPool = begin
    C._cuda_endAllocateToPool = end
    C._cuda_releasePool = release
    C._cuda_getCheckpointState = get_state
    C._cuda_setCheckpointPoolState = set_state
    C._cuda_checkPoolLiveAllocations = check_live
    C._cuda_cudaCachingAllocator_raw_delete = raw_delete
    C._free_And_Remove_DeleterFn = free_and_remove_deleter
    C._has_Standard_Deleter = has_standard_deleter


def _patch_statistics(torch: Any) -> None:
    """Points the ``torch._C`` functions behind torch.cuda's statistics at MoonBright.

    In torch/cuda/memory.py (PyTorch 2.11), ``memory_stats`` calls
    ``memory_stats_as_nested_dict``, which returns ``torch._C._cuda_memoryStats(device)``;
    ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
    ``max_memory_reserved`` and ``memory_summary`` read ``memory_stats``;
    ``reset_peak_memory_stats`` calls ``torch._C._cuda_resetPeakMemoryStats(device)``, and
    ``reset_accumulated_memory_stats`` ``torch._C._cuda_resetAccumulatedMemoryStats(device)``;
    ``empty_cache`` calls ``torch._C._cuda_emptyCache()``; ``memory_snapshot`` and
    ``_snapshot`` call ``torch._C._cuda_memorySnapshot(...)``; ``_record_memory_history``
    calls ``torch._C._cuda_record_memory_history(...)``; ``set_per_process_memory_fraction``
    calls ``torch._C._cuda_setMemoryFraction(fraction, device)`` (which CUDAPluggableAllocator
    forwards to a C++ hook Python cannot set, and otherwise ignores), and
    ``get_per_process_memory_fraction`` ``torch._C._cuda_getMemoryFraction(device)``. All are
    looked up on ``torch._C`` at call time, so replacing them there reaches every caller.
    """
    C = torch._C
    originals = {name: getattr(C, name, None) for name in _STATISTICS_PATCHES}
    _keep.append(originals)

    def device_of(device: Any) -> int:
        if device is None:
            return int(torch.cuda.current_device())
        return int(device)

    def memory_stats(device: Any = None) -> dict[str, Any]:
        return moonbright.memory_stats_as_nested_dict(device_of(device))

    def reset_peak(device: Any = None) -> None:
        moonbright.reset_peak_memory_stats(device_of(device))

    def reset_accumulated(device: Any = None) -> None:
        moonbright.reset_accumulated_memory_stats(device_of(device))

    def empty_cache(*args: Any, **kwargs: Any) -> None:
        # Waits for pending frees' stream work first: PyTorch's own empty_cache gives back
        # memory freed behind running work too (its cudaFree waits for the device).
        _graph_pool_keys.get("reap", lambda: None)()
        for d in range(torch.cuda.device_count()):
            if moonbright.is_initialized(d):
                moonbright.empty_cache(d)

    def memory_snapshot(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return moonbright.snapshot()

    def record_history(
        enabled: Any = "all",
        context: Any = "all",
        stacks: Any = "all",
        max_entries: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        # PyTorch 2.11's torch.cuda.memory._record_memory_history passes (enabled, context,
        # stacks, max_entries, clear_history, ...). The frames of `context` are Python's,
        # whatever `stacks` asks (MoonBright records no C++ frames).
        if not isinstance(max_entries, int) or isinstance(max_entries, bool):
            max_entries = 100_000
        on = enabled not in (None, False)
        moonbright.record_memory_history(
            on,
            max_entries=max(1, min(int(max_entries), 1 << 24)),
            context=context if on and context in ("state", "alloc", "all") else None,
        )

    def set_fraction(fraction: float, device: Any = None) -> None:
        moonbright.set_memory_fraction(float(fraction), device_of(device))

    def get_fraction(device: Any = None) -> float:
        return moonbright.memory_fraction(device_of(device))

    C._cuda_setMemoryFraction = set_fraction
    if hasattr(C, "_cuda_getMemoryFraction"):
        C._cuda_getMemoryFraction = get_fraction
    C._cuda_memoryStats = memory_stats
    C._cuda_resetPeakMemoryStats = reset_peak
    C._cuda_resetAccumulatedMemoryStats = reset_accumulated
    C._cuda_emptyCache = empty_cache
    C._cuda_memorySnapshot = memory_snapshot
    C._cuda_record_memory_history = record_history


def pool() -> Any:
    """A ``torch.cuda.MemPool`` whose segments come from MoonBright, for
    ``with torch.cuda.use_mem_pool(pool):`` (memory-pool mode; see the module documentation).
    In global mode every allocation comes from MoonBright already, so this raises."""
    torch = _torch()
    if _enabled:
        raise RuntimeError(
            "moonbright.torch.pool(): MoonBright is already PyTorch's global allocator "
            "(enable() was called); every allocation comes from it, no pool is needed"
        )
    alloc = _pluggable("moonbright_pool_alloc")
    return torch.cuda.MemPool(alloc.allocator())
