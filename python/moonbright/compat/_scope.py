"""The scope both adapters open: a MoonBright tag on the calling thread, and in PyTorch's
memory-pool mode a ``torch.cuda.MemPool`` of MoonBright's per tag and device, so that PyTorch
never carves one tag's tensor out of another tag's segment."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import moonbright

# (tag, device) -> the MemPool its tensors come from, in memory-pool mode. PyTorch keeps raw
# pointers into pools, so they live as long as the process.
_pools: dict[tuple[str, int], Any] = {}


def mode() -> str:
    """``"global"`` under ``moonbright.torch.enable()``; ``"pool"`` when PyTorch is imported,
    sees a GPU and MoonBright is not on the host backend (tensors then come from a MoonBright
    pool per tag); ``"plain"`` otherwise (MoonBright's own functions allocate)."""
    if "torch" not in sys.modules:
        return "plain"
    import moonbright.torch as mbt

    if mbt.is_enabled():
        return "global"
    torch = sys.modules["torch"]
    if moonbright.options()["backend"] != "host" and torch.cuda.is_available():
        return "pool"
    return "plain"


def current_device(kind: str) -> int | None:
    """The device a scope opened now allocates on: PyTorch's current device in the torch modes,
    None (MoonBright's own default) in plain mode."""
    if kind == "plain":
        return None
    return int(sys.modules["torch"].cuda.current_device())


def tag_pool(tag: str, device: int) -> Any:
    """The MoonBright memory pool whose segments carry ``tag`` on ``device``."""
    pool = _pools.get((tag, device))
    if pool is None:
        torch = sys.modules["torch"]
        import moonbright.torch as mbt

        with torch.cuda.device(device):
            pool = mbt.pool()
        _pools[(tag, device)] = pool
    return pool


def is_asleep(tag: str, device: int | None) -> bool:
    return bool(moonbright.tags(device).get(tag, {}).get("asleep", False))


def refuse_if_asleep(tag: str, device: int | None) -> None:
    """In memory-pool mode PyTorch may carve a tensor out of a sleeping segment it caches,
    without asking MoonBright, and the tensor's memory would be unmapped: refuse the scope as
    MoonBright refuses an allocation into a sleeping tag."""
    if is_asleep(tag, device):
        raise RuntimeError(
            f"tag {tag!r} is asleep: wake it before allocating into it (its memory is unmapped)"
        )


@contextmanager
def tagged(tag: str, kind: str, device: int | None) -> Iterator[None]:
    """Allocations of the calling thread inside carry ``tag``; in pool mode they also come
    from the tag's own MoonBright pool."""
    refuse_if_asleep(tag, device)
    if kind == "pool":
        torch = sys.modules["torch"]
        with torch.cuda.use_mem_pool(tag_pool(tag, device)), moonbright.tag(tag):
            yield
    else:
        with moonbright.tag(tag):
            yield


SLEEP_KEYS = ("bytes", "released", "backed_up", "seconds")
WAKE_KEYS = ("bytes", "created", "restored", "seconds")


def sum_results(results: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """One result from several calls of :func:`moonbright.sleep` (``keys``: SLEEP_KEYS) or
    :func:`moonbright.wake` (WAKE_KEYS): each number summed (``seconds`` too: the calls ran
    one after another); zeros for no call."""
    out: dict[str, Any] = {key: 0.0 if key == "seconds" else 0 for key in keys}
    for r in results:
        for key, value in r.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
    return out


@contextmanager
def untagged() -> Iterator[None]:
    """Allocations of the calling thread inside carry no tag, whatever scope encloses this one."""
    with moonbright.tag(None):
        yield


def plan(
    tag: str | None, devices: dict[str, set[int | None]], asleep: bool
) -> dict[int | None, list[str]]:
    """The tags a sleep (``asleep=False``: it acts on awake tags) or a wake (``asleep=True``)
    acts on, by device: ``tag`` wherever it is asleep or holds memory (MoonBright then refuses it
    if it is in the wrong state), or, for None, every tag of ``devices`` (tag -> the devices an
    adapter saw it on) in the state acted on. An awake tag without memory is left alone: it has
    nothing to release, and left awake it takes new allocations."""
    if tag is None:
        names = list(devices)
    else:
        names = [tag] if tag in devices else []
    out: dict[int | None, list[str]] = {}
    seen = dict.fromkeys(d for name in names for d in sorted(devices[name], key=_device_order))
    for device in seen:
        states = moonbright.tags(device)
        for name in names:
            state = states.get(name)
            if device not in devices[name] or state is None:
                continue
            if not state["asleep"] and not state["bytes"]:
                continue
            if tag is None and state["asleep"] != asleep:
                continue
            out.setdefault(device, []).append(name)
    return out


def _device_order(device: int | None) -> int:
    return -1 if device is None else device
