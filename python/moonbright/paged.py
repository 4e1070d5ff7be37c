"""A paged KV-cache pool whose block table and slot mapping live in fixed device buffers,
updated every step by kernels from a compact delta (see "Paged KV pool" in docs/design.md).

    from moonbright.paged import PagedKVPool
    pool = PagedKVPool(tokens_per_page=16, bytes_per_token=2 * 8 * 128 * 2,
                       max_pages=65536, max_seqs=4096, max_pages_per_seq=256)
    s = pool.add(prompt_len=100)          # prompt tokens get slots this step
    pool.commit()                         # kernels on the pool's stream, no host wait
    n = pool.decode_step()                # every sequence +1 token, committed
    pool.block_table                      # int32 [max_seqs, max_pages_per_seq], a view
    pool.slot_mapping[:n]                 # int64, the step's slots (-1: skip)
    pool.kv_pages(torch.bfloat16)         # [max_pages, page_bytes / 2], a view

The tensors are views of the pool's memory, made without copies: on the CUDA backend through
``__cuda_array_interface__`` (``torch.as_tensor``), on the host backend through numpy's
``__array_interface__`` (numpy arrays, or CPU tensors when torch is installed). Their
addresses never change, so CUDA graphs may capture kernels that read them. Errors are the
exceptions of ``moonbright._moonbright`` re-exported here; a refused request changes nothing.
"""

from __future__ import annotations

from typing import Any

from ._moonbright import (
    CapacityError,
    FreedSequenceError,
    InvalidRequestError,
    PagedPool,
    PagedPoolError,
    UnknownSequenceError,
)

__all__ = [
    "PagedKVPool",
    "PagedPoolError",
    "UnknownSequenceError",
    "FreedSequenceError",
    "CapacityError",
    "InvalidRequestError",
]


class _DeviceArray:
    """A typed view of device (or host-backend) memory, for torch.as_tensor / numpy."""

    def __init__(self, owner: Any, ptr: int, shape: tuple[int, ...], typestr: str, cuda: bool):
        self._owner = owner  # keeps the pool (and so the memory) alive
        iface = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3}
        if cuda:
            iface["strides"] = None
            self.__cuda_array_interface__ = iface
        else:
            self.__array_interface__ = iface


def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None


class PagedKVPool:
    """The pool, with tensor views of its tables and pages. ``stream``: a ``CUstream`` as an
    int; by default PyTorch's current stream on the CUDA backend, else 0."""

    def __init__(
        self,
        tokens_per_page: int,
        bytes_per_token: int,
        max_pages: int,
        max_seqs: int,
        max_pages_per_seq: int,
        max_step_tokens: int | None = None,
        stream: int | None = None,
        device: int | None = None,
    ):
        from . import backend

        self.cuda = backend(device) == "cuda"
        torch = _torch()
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream if (self.cuda and torch) else 0
        if max_step_tokens is None:
            max_step_tokens = max_seqs + 8 * tokens_per_page * max_pages_per_seq
        self._pool = PagedPool(
            tokens_per_page,
            bytes_per_token,
            max_pages,
            max_seqs,
            max_pages_per_seq,
            max_step_tokens,
            stream,
            device,
        )
        self.layout = self._pool.layout()
        self.device = device if device is not None else 0
        L = self.layout
        self.tokens_per_page = L["tokens_per_page"]
        self.page_bytes = L["page_bytes"]
        self.block_table = self._view(L["block_table"], (L["max_seqs"], L["max_pages_per_seq"]), "<i4")
        self.seq_lens = self._view(L["seq_lens"], (L["max_seqs"],), "<i4")
        self.batch_rows = self._view(L["batch_rows"], (L["max_seqs"],), "<i4")
        self._slot_mapping = self._view(L["slot_mapping"], (L["max_step_tokens"],), "<i8")
        self._pages = self._view(L["pages"], (L["max_pages"], self.page_bytes), "|u1")

    def _view(self, ptr: int, shape: tuple[int, ...], typestr: str):
        arr = _DeviceArray(self._pool, ptr, shape, typestr, self.cuda)
        torch = _torch()
        if self.cuda:
            return torch.as_tensor(arr, device=f"cuda:{self.device}")
        import numpy as np

        a = np.asarray(arr)
        return torch.from_numpy(a) if torch is not None else a

    # Requests: each refused one raises and changes nothing.
    def add(self, prompt_len: int = 0) -> int:
        return self._pool.add(prompt_len)

    def add_many(self, prompt_lens: list[int]) -> list[int]:
        return self._pool.add_many(prompt_lens)

    def extend(self, seq: int, n: int) -> None:
        self._pool.extend(seq, n)

    def fork(self, seq: int) -> int:
        return self._pool.fork(seq)

    def truncate(self, seq: int, new_len: int) -> None:
        self._pool.truncate(seq, new_len)

    def free(self, seq: int) -> None:
        self._pool.free(seq)

    def free_many(self, seqs: list[int]) -> None:
        self._pool.free_many(seqs)

    def commit(self) -> int:
        """Ships the step's delta and launches the table kernels; returns its token count."""
        return self._pool.commit()

    def step(self, free: list[int] = (), add: list[int] = ()) -> list[int]:
        """One serving step in one call: frees ``free``, adds one sequence per prompt length in
        ``add`` (their prompt tokens get slots), gives every live sequence its decode token and
        commits. Returns the new sequences' ids."""
        return self._pool.step(free, add)

    def decode_step(self) -> int:
        """Every live sequence +1 token, committed; returns the step's token count."""
        return self._pool.decode_step()

    # Queries.
    def row(self, seq: int) -> int:
        return self._pool.row(seq)

    def seq_len(self, seq: int) -> int:
        return self._pool.seq_len(seq)

    def pages(self, seq: int) -> list[int]:
        return self._pool.pages(seq)

    def batch(self) -> list[int]:
        return self._pool.batch()

    @property
    def step_tokens(self) -> int:
        return self._pool.step_tokens()

    @property
    def slot_mapping(self):
        """The last step's slot mapping (a view of its first ``step_tokens`` entries)."""
        return self._slot_mapping[: self._pool.step_tokens()]

    def kv_pages(self, dtype: Any = None):
        """The pages as ``[max_pages, page_bytes]`` bytes, or viewed as ``dtype``."""
        if dtype is None:
            return self._pages
        return self._pages.view(dtype)

    def live_sequences(self) -> int:
        return self._pool.live_sequences()

    def shrink(self) -> int:
        return self._pool.shrink()

    def synchronize(self) -> None:
        self._pool.synchronize()

    def check_invariants(self) -> None:
        self._pool.check_invariants()
