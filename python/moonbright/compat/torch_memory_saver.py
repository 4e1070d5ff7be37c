"""torch_memory_saver's shape over MoonBright's tags, sleep and wake::

    from moonbright.compat.torch_memory_saver import torch_memory_saver

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = build_model()                     # backed up at pause, restored at resume
    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty(..., device="cuda")      # discarded at pause
    torch_memory_saver.pause("kv_cache")
    torch_memory_saver.pause()                    # every tag still awake
    torch_memory_saver.resume()                   # every tag asleep

``region``, ``pause``, ``resume``, ``cuda_graph``, ``disable`` and ``enabled`` take
torch_memory_saver 0.0.10's arguments. ``pause(tag)`` is :func:`moonbright.sleep` of the tag's
memory, ``resume(tag)`` :func:`moonbright.wake`; both return MoonBright's result (bytes,
backed-up or restored bytes, seconds) where torch_memory_saver returns None.

What differs from torch_memory_saver:

- **Where the memory comes from.** No ``LD_PRELOAD`` and no hook mode: call
  ``moonbright.torch.enable()`` first thing (every CUDA tensor is then MoonBright's, and a region
  only tags), or leave PyTorch's allocator in place and each region allocates from a MoonBright
  memory pool of its tag (as torch_memory_saver's torch hook mode does with its own pools).
  Setting ``hook_mode`` is accepted and does nothing.
- **Backup is per tag, not per allocation.** torch_memory_saver remembers
  ``enable_cpu_backup`` for each allocation; MoonBright sleeps a tag as a whole, so a tag is
  backed up at pause if any region of it asked for a backup (its other allocations' bytes are
  kept too, which costs copy time but loses nothing). Give memory to be discarded a tag of its
  own.
- **Errors instead of exiting.** Pausing a paused tag or resuming an awake one raises
  ``RuntimeError`` (torch_memory_saver prints a message and exits the process), and so do
  entering a region of a paused tag and freeing a paused tensor (keep tensors alive until
  resume: under enable() a refused free loses the memory to the tag). ``pause()`` and
  ``resume()`` without a tag take every tag of this object that is awake, respectively asleep,
  where torch_memory_saver exits if any is not. A resume that cannot get the memory raises
  ``MemoryError`` and leaves the tag paused and intact; torch_memory_saver keeps what it
  mapped so far. A tag whose memory was all freed is not paused: it has nothing to release.
- **No device-wide synchronisation.** Pause waits for the work queued on the allocations'
  streams (by events) and copies in large pipelined pieces to a pinned pool that later cycles
  reuse (``moonbright.release_host_memory()`` gives its spare pieces back);
  torch_memory_saver synchronises the device at each free and copies each allocation with a
  synchronous ``cudaMemcpy``.
- **Backups are pinned host memory.** ``cpu_backup_backend`` (``"pinned"`` or ``"mmap"``) is
  accepted and both mean MoonBright's pinned pool; ``enable_disk_backup``, ``get_cpu_backup``,
  ``retain_cpu_backup`` and ``memory_margin_bytes`` are not offered.
- **Threads.** A region tags what the calling thread allocates, as with torch_memory_saver
  (whose region state is thread-local too); other threads' allocations are untagged.
- **Several GPUs.** A tag is paused and resumed on every device a region of it was entered on
  (PyTorch's current device at entry; MoonBright's default device without PyTorch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import moonbright

from . import _scope

__all__ = ["TorchMemorySaver", "torch_memory_saver"]

_TAG_DEFAULT = "default"
_BACKUP_BACKENDS = ("pinned", "mmap")


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver`` on MoonBright (see the module documentation).
    One per process is enough: :data:`torch_memory_saver` is it."""

    def __init__(self) -> None:
        # tag -> whether pause backs it up (any region of the tag asked).
        self._backup: dict[str, bool] = {}
        # tag -> the devices a region of it was entered on (None: MoonBright's default).
        self._devices: dict[str, set[int | None]] = {}

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> str:
        raise AttributeError("hook_mode can be set, not read (as in torch_memory_saver)")

    @hook_mode.setter
    def hook_mode(self, value: str) -> None:
        # MoonBright needs no hook: enable() or a pool per tag (the module documentation).
        if value not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', not {value!r}")

    def _remember(self, tag: str, enable_cpu_backup: bool, device: int | None) -> None:
        self._backup[tag] = self._backup.get(tag, False) or bool(enable_cpu_backup)
        self._devices.setdefault(tag, set()).add(device)

    @staticmethod
    def _check_backup_args(enable_cpu_backup: bool, cpu_backup_backend: str | None) -> None:
        if cpu_backup_backend is None:
            return
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend not in _BACKUP_BACKENDS:
            raise ValueError(
                f"cpu_backup_backend must be one of {_BACKUP_BACKENDS}, not {cpu_backup_backend!r}"
            )

    @contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        """Memory the calling thread allocates inside is paused with ``tag``; its bytes are
        backed up at pause if ``enable_cpu_backup`` (for any region of the tag)."""
        if enable_disk_backup:
            raise NotImplementedError("MoonBright backs up to pinned host memory only, not to disk")
        self._check_backup_args(enable_cpu_backup, cpu_backup_backend)
        kind = _scope.mode()
        device = _scope.current_device(kind)
        with _scope.tagged(tag, kind, device):
            self._remember(tag, enable_cpu_backup, device)
            yield

    @contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        """``torch.cuda.graph(cuda_graph, pool, stream, capture_error_mode)`` whose memory
        (the graph's intermediate tensors) is paused with ``tag``. In memory-pool mode the
        graph allocates from the tag's MoonBright pool unless ``pool`` is given."""
        self._check_backup_args(enable_cpu_backup, cpu_backup_backend)
        kind = _scope.mode()
        if kind == "plain":
            raise RuntimeError(
                "cuda_graph needs MoonBright to serve PyTorch's CUDA memory: import torch and "
                "call moonbright.torch.enable(), or leave the host backend"
            )
        import torch

        device = _scope.current_device(kind)
        _scope.refuse_if_asleep(tag, device)
        if kind == "pool" and pool is None:
            pool = _scope.tag_pool(tag, device).id
        with torch.cuda.graph(
            cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
        ), moonbright.tag(tag):
            self._remember(tag, enable_cpu_backup, device)
            yield

    @contextmanager
    def disable(self) -> Iterator[None]:
        """Inside a region, memory allocated here is not paused: it is untagged (in memory-pool
        mode it comes from a fresh pool of PyTorch's own allocator, as in torch_memory_saver)."""
        if _scope.mode() == "pool":
            import torch

            with torch.cuda.use_mem_pool(torch.cuda.MemPool()), _scope.untagged():
                yield
        else:
            with _scope.untagged():
                yield

    def pause(self, tag: str | None = None) -> dict[str, Any]:
        """Releases the device memory of ``tag`` (None: of every awake tag), backing up the
        tags that asked for it. The addresses stay reserved."""
        results = []
        for device, tags in _scope.plan(tag, self._devices, asleep=False).items():
            for backup in (True, False):
                group = [t for t in tags if self._backup[t] == backup]
                if group:
                    results.append(moonbright.sleep(group, backup=backup, device=device))
        return _scope.sum_results(results, _scope.SLEEP_KEYS)

    def resume(self, tag: str | None = None) -> dict[str, Any]:
        """Maps memory again at the same addresses for ``tag`` (None: every paused tag) and
        restores the backed-up bytes."""
        results = [
            moonbright.wake(tags, device=device)
            for device, tags in _scope.plan(tag, self._devices, asleep=True).items()
        ]
        return _scope.sum_results(results, _scope.WAKE_KEYS)


torch_memory_saver = TorchMemorySaver()
