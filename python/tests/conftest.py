import os

import pytest

# Every test in this process uses a small host-backend allocator, checked after every operation.
# (The allocator is process-wide and fixed at first use; tests that configure differently run
# in a subprocess.)
HOST_CONF = "backend:host,host_capacity:256MiB,host_page_size:64KiB,cap:8MiB,validate:true"
os.environ.setdefault("MOONBRIGHT_ALLOC_CONF", HOST_CONF)


@pytest.fixture(scope="session")
def lib():
    """The extension module as a C library: PyTorch's pluggable-allocator entry points
    ``moonbright_alloc(size, device, stream)`` and ``moonbright_free(ptr, size, device, stream)``."""
    import ctypes

    import moonbright

    lib = ctypes.CDLL(moonbright.library_path())
    lib.moonbright_alloc.restype = ctypes.c_void_p
    lib.moonbright_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.moonbright_free.restype = None
    lib.moonbright_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    return lib
