"""Sharing MoonBright memory with other processes, over a connected Unix socket.

An allocation is stitched from chunks; sending it sends one file descriptor per chunk
(``SCM_RIGHTS``), and the receiver maps them back to back at addresses of its own: the same
bytes, contiguous, in both processes. No copy is made, and nothing is shared but that
allocation. ::

    a, b = socket.socketpair()          # or a socket.AF_UNIX connection between processes
    moonbright.ipc.send_tensor(a, x)    # x allocated by MoonBright (moonbright.torch.enable())
    y = moonbright.ipc.recv_tensor(b)   # in the other process: a tensor over x's memory

The rules are those of CUDA's own IPC (``cudaIpcGetMemHandle``): the sender keeps the
allocation (the tensor) alive until every receiver is done with it (once it is freed, what
receivers write there is seen by nobody: exported memory goes back to the driver, never to
another allocation); and writes on one side are seen on the other once the writer's stream
work has completed (order it with your own synchronisation). A received tensor unmaps its
memory when it is garbage collected, after waiting for its device's work to complete.

The memory must be MoonBright's: a tensor from PyTorch's own allocator raises RuntimeError
(send it with ``torch.multiprocessing`` instead). Only the allocation's own memory is shared:
an allocation below a page (2 MiB on CUDA), or carved from other memory, shares its page with
other allocations and raises RuntimeError. Option ``ipc:false`` turns sharing off. What a
receiver trusts, and what it can reach: docs/security.md.

``multiprocessing`` carries the same through its own pickling: a :class:`Shareable` (any
allocation) arrives as an :class:`Imported`, and once :func:`enable_torch_multiprocessing` has
run (``moonbright.torch.enable()`` runs it) a CUDA tensor MoonBright allocated, put on a
``torch.multiprocessing`` queue or passed to a process, arrives as a tensor over the same
memory, where PyTorch's own CUDA sharing (``cudaIpcGetMemHandle``) cannot take it.
"""

from __future__ import annotations

import json
import multiprocessing.context
import multiprocessing.util
import os
import socket
import struct
from multiprocessing.reduction import DupFd
from typing import Any, Callable

from . import _moonbright

__all__ = [
    "Imported",
    "Shareable",
    "enable_torch_multiprocessing",
    "recv",
    "recv_tensor",
    "send",
    "send_tensor",
]


def send(sock: socket.socket, ptr: int, device: int | None = None) -> None:
    """Sends the live MoonBright allocation at ``ptr`` (a tensor's
    ``untyped_storage().data_ptr()``) over ``sock``. ``device=None``: whichever of this
    process's allocators holds it."""
    _moonbright.ipc_send(ptr, sock.fileno(), device)


class Imported:
    """Memory another process sent, mapped here: ``ptr`` and ``size`` (bytes). ``close()``
    unmaps it at once, so the work that uses it must have completed; garbage collection closes
    it too, after ``on_close`` (if set) has run. Exposes ``__cuda_array_interface__`` as
    bytes."""

    def __init__(self, ptr: int, size: int, device: int | None) -> None:
        self.ptr = ptr
        self.size = size
        self.device = device
        self.on_close: Callable[[], None] | None = None
        self._open = True

    @property
    def closed(self) -> bool:
        return not self._open

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if not self._open:
            raise ValueError("the import is closed")
        return {
            "shape": (self.size,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }

    def close(self) -> None:
        """Unmaps the memory (once; later calls do nothing)."""
        if not self._open:
            return
        if self.on_close is not None:
            self.on_close()
        _moonbright.ipc_close(self.ptr, self.device)
        self._open = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing can be raised from a finaliser
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Imported(ptr={self.ptr:#x}, size={self.size}, device={self.device}, {state})"


def recv(sock: socket.socket, device: int | None = None) -> Imported:
    """Receives an allocation :func:`send` sent, and maps it on ``device`` (``None``: the
    current one).

    Trust: the socket is yours, and whoever holds its other end decides what arrives. The
    message is checked for form (sizes, counts, at most as many descriptors as it announces,
    every one closed on any error), not for origin: what is mapped is whatever memory the
    sender's descriptors name, which the sender can read and write. Receive only from a peer
    you trust with that memory (check it, e.g. with ``SO_PEERCRED``, on a socket others can
    reach). See docs/security.md."""
    ptr, size = _moonbright.ipc_recv(sock.fileno(), device)
    return Imported(ptr, size, device)


_HEADER = struct.Struct("<I")

# The most bytes a tensor's description (JSON) may take: a few hundred in practice; the
# length on the wire is a 32-bit count, which a broken or hostile peer could set to 4 GiB.
_MAX_META = 1 << 20

# The fields a description must have, and their types.
_META_FIELDS = {"dtype": str, "shape": list, "stride": list, "offset": int, "nbytes": int}


def _send_all(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_meta(sock: socket.socket) -> dict[str, Any]:
    """A tensor's description, as ``send_tensor`` sent it after the memory: its length (at
    most ``_MAX_META``), then that much JSON, checked field by field."""
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > _MAX_META:
        raise ValueError(f"a tensor's description of {n} bytes is too large (at most {_MAX_META})")
    meta = json.loads(_recv_exact(sock, n))
    return _checked_meta(meta)


def _checked_meta(meta: Any) -> dict[str, Any]:
    """``meta`` if it describes a tensor view (see ``_tensor_meta``), else ValueError."""
    if not isinstance(meta, dict):
        raise ValueError("a tensor's description must be a JSON object")
    for key, kind in _META_FIELDS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"a tensor's description has no valid {key!r}: {value!r}")
    for key in ("shape", "stride"):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in meta[key]):
            raise ValueError(f"a tensor's {key} must be a list of integers: {meta[key]!r}")
    if len(meta["shape"]) != len(meta["stride"]):
        raise ValueError("a tensor's shape and stride differ in length")
    if meta["offset"] < 0 or meta["nbytes"] < 0 or any(v < 0 for v in meta["shape"]):
        raise ValueError("a tensor's offset, size and shape cannot be negative")
    return meta


def _dtype(name: Any) -> Any:
    """The ``torch.dtype`` called ``name`` (as ``str(dtype)`` less ``torch.``): only a dtype,
    never another attribute of ``torch``."""
    import torch

    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError("the socket closed in the middle of a tensor's description")
        out += part
    return bytes(out)


def send_tensor(sock: socket.socket, tensor: Any) -> None:
    """Sends a CUDA tensor whose storage MoonBright allocated: its storage's memory, then its
    dtype, shape, strides and offset, so that :func:`recv_tensor` rebuilds the same view."""
    send(sock, tensor.untyped_storage().data_ptr(), tensor.device.index)
    _send_all(sock, json.dumps(_tensor_meta(tensor)).encode())


def recv_tensor(sock: socket.socket, device: int | None = None) -> Any:
    """Receives a tensor :func:`send_tensor` sent: a view of the sender's memory on ``device``
    (``None``: the current CUDA device). Its memory is unmapped when the tensor's storage is
    freed, after ``torch.cuda.synchronize`` of that device."""
    import torch

    if device is None:
        device = torch.cuda.current_device()
    imported = recv(sock, device)
    try:
        meta = _recv_meta(sock)
    except BaseException:
        imported.close()
        raise
    return _tensor_over(imported, meta)


def _tensor_meta(tensor: Any) -> dict[str, Any]:
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "offset": tensor.storage_offset(),
        "nbytes": tensor.untyped_storage().nbytes(),
        "requires_grad": bool(tensor.requires_grad),
        "parameter": type(tensor).__name__ == "Parameter",
    }


def _tensor_over(imported: Imported, meta: dict[str, Any]) -> Any:
    """A tensor over an import's memory, as `meta` describes it; it owns the import."""
    import torch

    device = imported.device
    try:
        meta = _checked_meta(meta)
        dtype = _dtype(meta["dtype"])
        imported.on_close = lambda: torch.cuda.synchronize(device)
        # The tensor holds `imported` until its storage is freed (PyTorch keeps a reference to
        # the object whose __cuda_array_interface__ it wraps).
        raw = torch.as_tensor(imported, device=f"cuda:{device}")
    except BaseException:
        imported.close()
        raise
    t = raw[: meta["nbytes"]].view(dtype).as_strided(meta["shape"], meta["stride"], meta["offset"])
    if meta.get("parameter"):
        return torch.nn.Parameter(t, requires_grad=meta.get("requires_grad", True))
    return t.requires_grad_(meta.get("requires_grad", False))


# ---- through multiprocessing's pickling -----------------------------------------------------


def _export_for_pickle(ptr: int, device: int | None) -> tuple[bytes, list[DupFd]]:
    """The export of `ptr` with its descriptors as multiprocessing's `DupFd`s, which reach the
    unpickling process however it gets the pickle (a queue's or a new process's)."""
    data, fds = _moonbright.ipc_export(ptr, device)
    try:
        return data, [_dup_fd(fd) for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


def _dup_fd(fd: int) -> Any:
    """``DupFd(fd)``, which may then be closed. A queue's pickling copies the descriptor at
    once; a new process's (spawn, forkserver) only names it, to be passed when the process
    starts, so a copy of it is kept until the process's ``Popen`` object is collected."""
    popen = multiprocessing.context.get_spawning_popen()
    if popen is None:
        return DupFd(fd)
    kept = os.dup(fd)
    multiprocessing.util.Finalize(popen, os.close, args=(kept,))
    return DupFd(kept)


def _import_from_pickle(data: bytes, dups: list[DupFd], device: int | None) -> Imported:
    fds: list[int] = []
    try:
        # Each detach() receives a descriptor (or takes one over): if one fails, those taken
        # so far are closed below all the same.
        for d in dups:
            fds.append(d.detach())
        ptr, size = _moonbright.ipc_import(data, fds, device)
    finally:
        for fd in fds:
            os.close(fd)
    return Imported(ptr, size, device)


class Shareable:
    """A MoonBright allocation to pickle for another process through ``multiprocessing`` (a
    queue, a pipe, a new process's arguments): it arrives there as an :class:`Imported`,
    mapped on ``device`` (``None``: the receiver's current device). The rules of :func:`send`
    hold: the allocation stays live until the receiver is done."""

    def __init__(self, ptr: int, device: int | None = None) -> None:
        self.ptr = ptr
        self.device = device

    def __reduce__(self) -> tuple[Any, ...]:
        data, dups = _export_for_pickle(self.ptr, self.device)
        return (_import_from_pickle, (data, dups, None))


def _rebuild_tensor(data: bytes, dups: list[DupFd], meta: dict[str, Any]) -> Any:
    import torch

    return _tensor_over(_import_from_pickle(data, dups, torch.cuda.current_device()), meta)


def _reduce_tensor(tensor: Any, fallback: Callable[[Any], Any]) -> Any:
    storage_ptr = tensor.untyped_storage().data_ptr() if tensor.is_cuda else 0
    if not storage_ptr or _moonbright.ipc_owner(storage_ptr) is None:
        return fallback(tensor)
    data, dups = _export_for_pickle(storage_ptr, tensor.device.index)
    return (_rebuild_tensor, (data, dups, _tensor_meta(tensor)))


def _rebuild_storage(data: bytes, dups: list[DupFd], nbytes: int) -> Any:
    import torch

    imported = _import_from_pickle(data, dups, torch.cuda.current_device())
    meta = {"dtype": "uint8", "shape": [nbytes], "stride": [1], "offset": 0, "nbytes": nbytes}
    return _tensor_over(imported, meta).untyped_storage()


def _reduce_storage(storage: Any, fallback: Callable[[Any], Any]) -> Any:
    ptr = storage.data_ptr() if storage.is_cuda else 0
    if not ptr or _moonbright.ipc_owner(ptr) is None:
        return fallback(storage)
    data, dups = _export_for_pickle(ptr, storage.device.index)
    return (_rebuild_storage, (data, dups, storage.nbytes()))


_torch_multiprocessing_enabled = False


def enable_torch_multiprocessing() -> None:
    """Makes ``torch.multiprocessing`` send CUDA tensors (and untyped storages) that MoonBright
    allocated through :mod:`moonbright.ipc` (PyTorch's own sharing needs
    ``cudaIpcGetMemHandle``, which virtual-memory allocations do not support, and its
    pluggable-allocator interface refuses it); every other tensor goes PyTorch's way. The
    receiving process needs ``moonbright`` installed; it rebuilds the tensor on its current
    device. Calling it again does nothing."""
    global _torch_multiprocessing_enabled
    if _torch_multiprocessing_enabled:
        return
    import torch
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    fallback = reductions.reduce_tensor

    def reduce(tensor: Any) -> Any:
        return _reduce_tensor(tensor, fallback)

    for cls in (*torch._tensor_classes, torch.Tensor, torch.nn.parameter.Parameter):
        ForkingPickler.register(cls, reduce)

    def reduce_storage(storage: Any) -> Any:
        return _reduce_storage(storage, reductions.reduce_storage)

    ForkingPickler.register(torch.UntypedStorage, reduce_storage)
    _torch_multiprocessing_enabled = True
