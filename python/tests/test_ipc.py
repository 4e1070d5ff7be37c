"""moonbright.ipc on the host backend: an allocation sent over a Unix socket and mapped again,
in this process and in a child process (the host backend's memory is a memfd, which crosses
processes as CUDA's file descriptors do); refusals; closing."""

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import types

import pytest

import moonbright
import moonbright.ipc
from moonbright import _moonbright

PAGE = 64 << 10


def pattern(n, seed):
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def test_an_allocation_round_trips_through_a_socket(lib):
    p = lib.moonbright_alloc(3 * PAGE + 100, 0, None)
    _moonbright._write(p, pattern(3 * PAGE + 100, 1))
    a, b = socket.socketpair()
    # A timeout makes Python's sockets non-blocking; MoonBright waits on them all the same.
    a.settimeout(30)
    b.settimeout(30)
    moonbright.ipc.send(a, p)
    imp = moonbright.ipc.recv(b)
    assert imp.ptr != p and imp.size == 3 * PAGE + 100
    assert _moonbright._read(imp.ptr, imp.size) == pattern(imp.size, 1)
    _moonbright._write(imp.ptr + 5, b"written by the importer")
    assert _moonbright._read(p + 5, 23) == b"written by the importer"
    assert _moonbright.ipc_imports() == [(imp.ptr, imp.size)]
    assert imp.__cuda_array_interface__["data"] == (imp.ptr, False)
    imp.close()
    imp.close()
    assert imp.closed and _moonbright.ipc_imports() == []
    with pytest.raises(ValueError):
        imp.__cuda_array_interface__
    with pytest.raises(RuntimeError, match="not an import"):
        _moonbright.ipc_close(imp.ptr)
    lib.moonbright_free(p, 0, 0, None)
    moonbright.check_invariants()


def test_garbage_collection_closes_an_import(lib):
    p = lib.moonbright_alloc(PAGE, 0, None)
    a, b = socket.socketpair()
    moonbright.ipc.send(a, p)
    closed = []
    imp = moonbright.ipc.recv(b)
    imp.on_close = lambda: closed.append(True)
    del imp
    assert closed == [True] and _moonbright.ipc_imports() == []
    lib.moonbright_free(p, 0, 0, None)


def test_bad_pointers_sockets_and_messages_are_refused(lib):
    a, b = socket.socketpair()
    with pytest.raises(RuntimeError, match="unknown pointer"):
        moonbright.ipc.send(a, 0x1234000)
    with pytest.raises(ValueError):
        _moonbright.ipc_send(0x1234000, -1)
    a.sendall(b"this is not an export at all")
    with pytest.raises(RuntimeError, match="malformed export"):
        moonbright.ipc.recv(b)
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        moonbright.ipc.recv(b)
    assert _moonbright.ipc_imports() == []


def test_pickling_and_parts_refuse_bad_input_and_keep_nothing():
    import pickle

    with pytest.raises(RuntimeError, match="unknown pointer"):
        pickle.dumps(moonbright.ipc.Shareable(0x1234000))
    with pytest.raises(RuntimeError, match="malformed export"):
        _moonbright.ipc_import(b"MBIPC but not really", [])
    with pytest.raises(ValueError, match="not open"):
        _moonbright.ipc_import(b"", [-1])
    assert _moonbright.ipc_owner(0x1234000) is None
    assert _moonbright.ipc_imports() == []


def test_a_child_process_sees_and_changes_the_same_bytes(lib):
    n = 5 * PAGE
    p = lib.moonbright_alloc(n, 0, None)
    _moonbright._write(p, pattern(n, 2))
    parent, child = socket.socketpair()
    code = textwrap.dedent(
        f"""
        import socket, moonbright.ipc
        from moonbright import _moonbright
        s = socket.socket(fileno={child.fileno()})
        imp = moonbright.ipc.recv(s)
        want = bytes((i * 31 + 2) & 0xFF for i in range({n}))
        ok = _moonbright._read(imp.ptr, imp.size) == want
        _moonbright._write(imp.ptr, b"child was here")
        imp.close()
        s.sendall(b"ok" if ok else b"no")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child.fileno()], env=os.environ)
    child.close()
    moonbright.ipc.send(parent, p)
    verdict = parent.recv(2)
    assert proc.wait(timeout=60) == 0
    assert verdict == b"ok"
    assert _moonbright._read(p, 14) == b"child was here"
    lib.moonbright_free(p, 0, 0, None)
    moonbright.check_invariants()


MP_SCRIPT = '''
import ctypes, multiprocessing as mp
import moonbright, moonbright.ipc
from moonbright import _moonbright

N = {n}
WANT = bytes((i * 31 + 3) & 0xFF for i in range(N))


def check(imp, out, mark):
    out.put(_moonbright._read(imp.ptr, imp.size) == WANT and imp.size == N)
    _moonbright._write(imp.ptr, mark)
    imp.close()


def from_queue(q, out):
    check(q.get(timeout=60), out, b"via a queue")


def from_args(imp, out):
    check(imp, out, b"via the args")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    lib = ctypes.CDLL(moonbright.library_path())
    lib.moonbright_alloc.restype = ctypes.c_void_p
    lib.moonbright_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    p = lib.moonbright_alloc(N, 0, None)
    _moonbright._write(p, WANT)
    q, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=from_queue, args=(q, out))
    child.start()
    q.put(moonbright.ipc.Shareable(p))
    queued = out.get(timeout=60)
    child.join(60)
    seen_queue = _moonbright._read(p, 11)
    _moonbright._write(p, WANT)
    child = ctx.Process(target=from_args, args=(moonbright.ipc.Shareable(p), out))
    child.start()
    passed = out.get(timeout=60)
    child.join(60)
    print(queued, seen_queue == b"via a queue", passed, _moonbright._read(p, 12) == b"via the args")
'''


def test_multiprocessing_carries_a_shareable_through_a_queue_and_a_processs_args(tmp_path):
    script = tmp_path / "mp_share.py"
    script.write_text(MP_SCRIPT.format(n=3 * PAGE + 5))
    r = subprocess.run(
        [sys.executable, str(script)], env=os.environ, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"] * 4, r.stdout + r.stderr


def test_an_allocation_that_shares_its_page_is_refused(lib):
    """A block below a page shares its page with other allocations: exporting it would hand
    the importer their memory (docs/security.md)."""
    ps = [lib.moonbright_alloc(1000, 0, None) for _ in range(3)]
    a, b = socket.socketpair()
    with pytest.raises(RuntimeError, match="other allocations share"):
        moonbright.ipc.send(a, ps[1])
    with pytest.raises(RuntimeError, match="other allocations share"):
        _moonbright.ipc_export(ps[1], None)
    for p in ps:
        lib.moonbright_free(p, 0, 0, None)


@pytest.fixture
def fake_torch(monkeypatch):
    """A stand-in for ``torch`` (not installed here) with one dtype and calls recorded: enough
    for ``recv_tensor`` to get as far as its checks."""
    torch = types.ModuleType("torch")

    class dtype:
        pass

    torch.dtype = dtype
    torch.uint8 = dtype()
    torch.calls = []

    def as_tensor(*args, **kwargs):
        torch.calls.append("as_tensor")
        raise RuntimeError("as_tensor called")

    torch.as_tensor = as_tensor
    torch.load = lambda *a, **k: torch.calls.append("load")
    torch.cuda = types.SimpleNamespace(synchronize=lambda d=None: None, current_device=lambda: 0)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def test_a_tensors_description_is_capped_before_it_is_read(lib, fake_torch):
    p = lib.moonbright_alloc(PAGE, 0, None)
    a, b = socket.socketpair()
    b.settimeout(5)
    moonbright.ipc.send(a, p)
    # A length of nearly 4 GiB: refused before any of it is read (or allocated).
    a.sendall(struct.pack("<I", 0xFFFF_FFF0) + b"{}")
    with pytest.raises(ValueError, match="too large"):
        moonbright.ipc.recv_tensor(b, 0)
    assert _moonbright.ipc_imports() == [], "the memory received is unmapped again"
    lib.moonbright_free(p, 0, 0, None)


@pytest.mark.parametrize(
    "meta",
    [
        {"dtype": "cuda"},
        {"dtype": "load"},
        {"dtype": "__class__"},
        {"dtype": 3},
        {"shape": "[1]"},
        {"stride": [1, 2]},
        {"offset": -1},
        {"shape": [True]},
    ],
)
def test_a_tensors_description_names_only_a_torch_dtype_and_integers(lib, fake_torch, meta):
    p = lib.moonbright_alloc(PAGE, 0, None)
    a, b = socket.socketpair()
    moonbright.ipc.send(a, p)
    good = {"dtype": "uint8", "shape": [PAGE], "stride": [1], "offset": 0, "nbytes": PAGE}
    body = json.dumps({**good, **meta}).encode()
    a.sendall(struct.pack("<I", len(body)) + body)
    with pytest.raises(ValueError):
        moonbright.ipc.recv_tensor(b, 0)
    assert fake_torch.calls == [], "torch was used with a description that is not a tensor's"
    assert _moonbright.ipc_imports() == []
    lib.moonbright_free(p, 0, 0, None)


def test_a_failed_detach_closes_the_descriptors_taken_so_far():
    fd = os.open("/dev/null", os.O_RDONLY)

    class Arrived:
        def detach(self):
            return fd

    class Lost:
        def detach(self):
            raise OSError("the descriptor did not arrive")

    with pytest.raises(OSError, match="did not arrive"):
        moonbright.ipc._import_from_pickle(b"", [Arrived(), Lost()], None)
    with pytest.raises(OSError):
        os.fstat(fd)
