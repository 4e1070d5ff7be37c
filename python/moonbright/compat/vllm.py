"""vLLM's ``CuMemAllocator`` (``vllm/device_allocator/cumem.py``) over MoonBright's tags, sleep
and wake::

    from moonbright.compat.vllm import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        model = load_model()
    with allocator.use_memory_pool(tag="kv_cache"):
        kv_caches = allocate_kv()
    allocator.sleep(offload_tags=("weights",))   # weights to host memory, the rest discarded
    allocator.wake_up(tags=["weights"])
    allocator.wake_up(tags=["kv_cache"])          # memory back, its contents undefined

The semantics are vLLM's: ``sleep`` puts every tag of the pool to sleep, backing up the tags
in ``offload_tags`` (None: ``("default",)``; a string: that tag) and discarding the others;
``wake_up(tags)`` wakes the tags named (None: all); ``get_current_usage`` is the bytes allocated
under the pool's tags, asleep or awake. ``sleep`` then runs ``gc.collect()`` and, when PyTorch
has initialised CUDA, ``torch.cuda.empty_cache()``, as vLLM does. ``sleep`` and ``wake_up``
return MoonBright's result (bytes, backed-up or restored bytes, seconds) where vLLM returns
None.

What differs from vLLM:

- **Where the memory comes from.** vLLM's pool is a ``torch.cuda.MemPool`` over its own
  pluggable allocator. Here, under ``moonbright.torch.enable()`` every CUDA tensor is
  MoonBright's already and ``use_memory_pool`` only tags; without enable(), each tag gets a
  MoonBright memory pool of its own (``moonbright.torch.pool()``) that PyTorch's caching
  allocator carves tensors from. In that mode PyTorch keeps freed blocks cached in the pool
  (vLLM gives unused segments back when the scope exits): they are part of the tag, and sleep
  with it.
- **The tag is the calling thread's.** vLLM's current tag is one attribute of the allocator,
  read by whichever thread allocates; MoonBright's tag is thread-local, so other threads'
  allocations inside ``use_memory_pool`` are untagged and never sleep. ``current_tag`` is kept
  up to date for code that reads it.
- **Repeated calls are harmless.** ``sleep`` leaves tags that are asleep already as they are
  and ``wake_up`` tags that are awake (vLLM would unmap or map them a second time); tags in
  ``offload_tags`` or ``tags`` that hold no memory are ignored, as in vLLM. Entering
  ``use_memory_pool`` with a sleeping tag, or freeing a tensor of one, raises ``RuntimeError``
  (keep tensors alive until ``wake_up``: under enable() a refused free loses the memory to the
  tag).
- **All or nothing per tag.** A wake that cannot get its memory raises ``MemoryError`` and
  leaves that tag asleep with its backup intact; vLLM unmaps again what it had mapped, and
  the backups of the allocations it had restored are gone.
- **No device-wide synchronisation.** Sleep waits by events for the work queued on the
  allocations' streams and copies in large pipelined pieces into a pinned pool reused across
  cycles (``moonbright.release_host_memory()`` gives its spare pieces back); vLLM
  synchronises the device at each free and copies each allocation with a synchronous
  ``cudaMemcpy`` into pinned memory allocated at each sleep.
- **Arguments.** ``offload_tags`` may be any iterable of strings, not only a tuple.
- **Several GPUs.** A tag sleeps and wakes on every device ``use_memory_pool`` was entered on
  with it (PyTorch's current device at entry); vLLM's one allocator serves one device.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import moonbright

from . import _scope

__all__ = ["CuMemAllocator"]


class CuMemAllocator:
    """vLLM's ``CuMemAllocator`` on MoonBright (see the module documentation). A singleton:
    call :meth:`get_instance`."""

    instance: CuMemAllocator | None = None
    default_tag: str = "default"

    @staticmethod
    def get_instance() -> CuMemAllocator:
        """The process's allocator, made at the first call."""
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    def __init__(self) -> None:
        self.current_tag: str = CuMemAllocator.default_tag
        # tag -> the devices use_memory_pool was entered on with it.
        self._devices: dict[str, set[int | None]] = {}

    @contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """What the calling thread allocates inside carries ``tag`` (None: ``"default"``) and
        sleeps and wakes with it."""
        if tag is None:
            tag = CuMemAllocator.default_tag
        if not isinstance(tag, str):
            raise TypeError(f"tag must be a str, not {type(tag).__name__}")
        kind = _scope.mode()
        device = _scope.current_device(kind)
        old_tag = self.current_tag
        with _scope.tagged(tag, kind, device):
            self._devices.setdefault(tag, set()).add(device)
            self.current_tag = tag
            try:
                yield
            finally:
                self.current_tag = old_tag

    def sleep(self, offload_tags: Iterable[str] | str | None = None) -> dict[str, Any]:
        """Releases the device memory of every tag: those in ``offload_tags`` (None:
        ``("default",)``) are backed up to host memory, the others discarded."""
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        offload = set(offload_tags)
        results = []
        for device, tags in _scope.plan(None, self._devices, asleep=False).items():
            for backup in (True, False):
                group = [t for t in tags if (t in offload) == backup]
                if group:
                    results.append(moonbright.sleep(group, backup=backup, device=device))
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return _scope.sum_results(results, _scope.SLEEP_KEYS)

    def wake_up(self, tags: Iterable[str] | None = None) -> dict[str, Any]:
        """Maps memory again at the same addresses for the sleeping tags among ``tags`` (None:
        every sleeping tag), restoring the bytes of those that were backed up."""
        wanted = None if tags is None else {tags} if isinstance(tags, str) else set(tags)
        results = []
        for device, asleep in _scope.plan(None, self._devices, asleep=True).items():
            group = [t for t in asleep if wanted is None or t in wanted]
            if group:
                results.append(moonbright.wake(group, device=device))
        return _scope.sum_results(results, _scope.WAKE_KEYS)

    def get_current_usage(self) -> int:
        """The bytes allocated under this allocator's tags, asleep or awake, on every device."""
        total = 0
        for device in dict.fromkeys(d for ds in self._devices.values() for d in ds):
            states = moonbright.tags(device)
            total += sum(
                states[t]["bytes"]
                for t in self._devices
                if device in self._devices[t] and t in states
            )
        return total
