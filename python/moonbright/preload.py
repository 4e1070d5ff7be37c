"""The LD_PRELOAD interposer (``libmoonbright_preload.so``) seen from Python: whether this
process runs under it, and what it has done. ::

    LD_PRELOAD=libmoonbright_preload.so python3 train.py
    # in train.py:
    import moonbright.preload
    moonbright.preload.report()   # None without the interposer

The interposer needs nothing from this package: it serves the CUDA runtime's calls of an
unmodified program. This module only reads its report.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any


def report() -> dict[str, Any] | None:
    """The interposer's report (``moonbright_preload_report``): the allocation calls it served
    and passed on to the runtime, its CUDA IPC handles given and opened, and each device's
    statistics; ``None`` when the interposer is not loaded in this process."""
    try:
        f = ctypes.CDLL(None).moonbright_preload_report
    except AttributeError:
        return None
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    n = f(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    f(buf, n + 1)
    return json.loads(buf.value)
