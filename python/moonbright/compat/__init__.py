"""Drop-in shapes of other projects' sleep/wake APIs, over :func:`moonbright.tag`,
:func:`moonbright.sleep` and :func:`moonbright.wake`.

- :mod:`moonbright.compat.torch_memory_saver`: ``torch_memory_saver`` (``region``, ``pause``,
  ``resume``, ``cuda_graph``), as SGLang and the RL frameworks built on it call it.
- :mod:`moonbright.compat.vllm`: vLLM's ``CuMemAllocator`` (``use_memory_pool``, ``sleep``,
  ``wake_up``, ``get_current_usage``).

Each module says what differs from the original. Both tag what is allocated inside their scopes
in whichever mode MoonBright serves the allocation: PyTorch's global allocator
(``moonbright.torch.enable()``), a MoonBright memory pool per tag (``moonbright.torch.pool()``,
when PyTorch is imported and enable() was not called), or MoonBright's own functions (the host
backend, no PyTorch).
"""
