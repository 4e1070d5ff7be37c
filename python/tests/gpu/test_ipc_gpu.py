"""moonbright.ipc between two processes on a GPU: tensors MoonBright allocated in one process
(its PyTorch allocator) are sent over a Unix socket and read and written in another process
whose PyTorch runs on its own allocator. Each scenario runs in fresh processes; skipped without
PyTorch or a CUDA device.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

CHILD = """
import gc, json, os, socket
import torch
import moonbright, moonbright.ipc
from moonbright import _moonbright
s = socket.socket(fileno=int(os.environ["MB_IPC_FD"]))
res = {}
big = moonbright.ipc.recv_tensor(s)
res["big"] = bool(torch.equal(big, torch.arange(1 << 28, dtype=torch.int32, device="cuda")))
stitched = moonbright.ipc.recv_tensor(s)
res["stitched"] = bool((stitched == 7).all())
small = moonbright.ipc.recv_tensor(s)
res["small"] = small[:3].tolist()
view = moonbright.ipc.recv_tensor(s)
ref = torch.arange(1 << 20, dtype=torch.float32, device="cuda").reshape(1024, 1024)[::2, 3:]
res["view"] = bool(torch.equal(view, ref)) and view.stride() == ref.stride()
small.mul_(2)
view.zero_()
torch.cuda.synchronize()
del ref
res["imports"] = len(_moonbright.ipc_imports())
res["torch_allocated"] = torch.cuda.memory_allocated()
del big, stitched, small, view
gc.collect()
res["imports_after_gc"] = len(_moonbright.ipc_imports())
s.sendall(json.dumps(res).encode() + b"\\n")
"""

# The parents' common part: `start(code)` runs `code` in a child given one end of a socket pair
# (`MB_IPC_FD`) and returns the other end; `answer(sock)` reads the JSON line the child sends.
SPAWN = """
import json, os, socket, subprocess, sys
import torch
import moonbright, moonbright.torch, moonbright.ipc
moonbright.torch.enable()

def start(code):
    global proc
    parent, child = socket.socketpair()
    env = dict(os.environ, MB_IPC_FD=str(child.fileno()))
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child.fileno()], env=env)
    child.close()
    return parent

def answer(sock):
    line = b""
    while not line.endswith(b"\\n"):
        part = sock.recv(4096)
        assert part, "the child closed the socket"
        line += part
    res = json.loads(line)
    res["returncode"] = proc.wait(timeout=300)
    return res
"""

PARENT = SPAWN + """
parent = start(CHILD)
big = torch.arange(1 << 28, dtype=torch.int32, device="cuda")
# 64 MiB stitched from 32 scattered pages: the cap leaves no room for new ones.
holes = [torch.empty(2 << 20, dtype=torch.uint8, device="cuda") for _ in range(64)]
del holes[::2]
torch.cuda.synchronize()
cap = moonbright.cap()
moonbright.set_cap(moonbright.memory_stats()["reserved_bytes.all.current"])
stitched = torch.full((16 << 20,), 7.0, device="cuda")
moonbright.set_cap(cap)
# A page (2 MiB) of its own: a tensor below a page shares its page with other allocations,
# and is refused (docs/security.md).
small = torch.zeros(1 << 19, device="cuda")
small[:3] = torch.tensor([1.5, 2.5, 3.5], device="cuda")
tiny = torch.tensor([1.0], device="cuda")
try:
    moonbright.ipc.send_tensor(parent, tiny)
    tiny_refused = "sent"
except RuntimeError as e:
    tiny_refused = str(e)
base = torch.arange(1 << 20, dtype=torch.float32, device="cuda").reshape(1024, 1024)
torch.cuda.synchronize()
exports = []
for t in (big, stitched, small, base[::2, 3:]):
    before = moonbright.memory_stats()["moonbright.driver_calls.export"]
    moonbright.ipc.send_tensor(parent, t)
    exports.append(moonbright.memory_stats()["moonbright.driver_calls.export"] - before)
res = answer(parent)
res["exports"] = exports
res["tiny_refused"] = tiny_refused
res["small_after"] = small[:3].tolist()
ref = torch.arange(1 << 20, dtype=torch.float32, device="cuda").reshape(1024, 1024)
ref[::2, 3:] = 0
res["base_after"] = bool(torch.equal(base, ref))
print(json.dumps(res))
"""


def run(args):
    """Runs `python3 *args` with the GPU backend and returns the last JSON line it printed."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    # Not the CPU tests' host-backend configuration (conftest.py).
    env["MOONBRIGHT_ALLOC_CONF"] = ""
    r = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    out = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    print(f"\n{json.dumps(out)}")
    return out


def test_tensors_cross_processes_both_ways():
    out = run(["-c", f"CHILD = {CHILD!r}\n" + textwrap.dedent(PARENT)])
    assert out["returncode"] == 0
    assert out["big"] and out["stitched"] and out["view"], out
    assert out["small"] == [1.5, 2.5, 3.5]
    assert out["exports"][1] >= 2, "the 64 MiB tensor was stitched from scattered pages"
    assert out["exports"][2] == 1 and out["exports"][0] >= 1
    assert out["imports"] == 4 and out["imports_after_gc"] == 0
    assert out["torch_allocated"] == 0, "the child's tensors are views of imported memory"
    assert out["small_after"] == [3.0, 5.0, 7.0], "the child's write reached the parent"
    assert "other allocations share" in out["tiny_refused"], out["tiny_refused"]
    assert out["base_after"], "the child zeroed exactly its strided view of the parent's tensor"


MP_SCRIPT = """
import gc, json
import torch
import torch.multiprocessing as tmp
from multiprocessing.reduction import ForkingPickler
import moonbright, moonbright.torch


def ref():
    return torch.arange(1 << 20, dtype=torch.float32, device="cuda")


def child(q, out):
    x, p, view, storage, typed = q.get(timeout=300)
    out.put({
        # A typed storage pickles its untyped storage, which goes through moonbright.ipc.
        "typed": isinstance(typed, torch.TypedStorage) and typed.dtype == torch.float32
        and typed.size() == 1 << 19 and typed.is_cuda
        and bool((torch.empty(0, device="cuda").set_(typed._untyped_storage) == 2.5).all()),
        "x": bool(torch.equal(x, ref())),
        "storage": storage.is_cuda and storage.nbytes() == 2 << 20
        and bool((torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage) == 9).all()),
        "param": isinstance(p, torch.nn.Parameter) and p.requires_grad and bool((p == 1).all()),
        "view": bool(torch.equal(view, ref().reshape(1024, 1024)[1::2, :7])),
        "allocator_is_torchs": torch.cuda.memory_allocated() == 0,
    })
    x.mul_(3)
    torch.cuda.synchronize()
    del x, p, view, storage, typed
    gc.collect()
    out.put(len(moonbright._moonbright.ipc_imports()))


if __name__ == "__main__":
    moonbright.torch.enable()
    ctx = tmp.get_context("spawn")
    x = ref()
    # Each a page (2 MiB) or more: a tensor below a page shares its page with other
    # allocations, and is refused (docs/security.md), as `tiny` shows.
    p = torch.nn.Parameter(torch.ones(1 << 19, device="cuda"))
    base = ref().reshape(1024, 1024)
    try:
        tmp.reductions.reduce_tensor(x)
        own = "no error"
    except Exception as e:  # PyTorch's own CUDA sharing, for the record
        own = f"{type(e).__name__}: {e}"[:300]
    q, out = ctx.Queue(), ctx.Queue()
    c = ctx.Process(target=child, args=(q, out))
    c.start()
    s = torch.full((2 << 20,), 9, dtype=torch.uint8, device="cuda").untyped_storage()
    typed = torch.full((1 << 19,), 2.5, device="cuda").storage()
    try:
        ForkingPickler.dumps(torch.ones(10, device="cuda"))
        tiny = "pickled"
    except RuntimeError as e:
        tiny = str(e)
    q.put((x, p, base[1::2, :7], s, typed))
    ok = out.get(timeout=300)
    left = out.get(timeout=120)
    c.join(120)
    print(json.dumps({"ok": ok, "imports_left": left, "exitcode": c.exitcode,
                      "x_after": bool(torch.equal(x, 3 * ref())), "torch_own": own,
                      "tiny": tiny}))
"""


def test_torch_multiprocessing_sends_moonbright_tensors(tmp_path):
    script = tmp_path / "mp_torch.py"
    script.write_text(MP_SCRIPT)
    out = run([str(script)])
    assert out["exitcode"] == 0
    assert out["ok"] == {
        "typed": True, "x": True, "storage": True, "param": True, "view": True,
        "allocator_is_torchs": True,
    }
    assert out["imports_left"] == 0, "the child's imports close with its tensors"
    assert out["x_after"], "the child's write reached the parent"
    assert "other allocations share" in out["tiny"], out["tiny"]


CHILD_ON_GPU1 = """
import json, os, socket
import torch
import moonbright, moonbright.ipc
s = socket.socket(fileno=int(os.environ["MB_IPC_FD"]))
torch.cuda.set_device(1)
x = moonbright.ipc.recv_tensor(s)
ref = torch.arange(1 << 26, dtype=torch.float32, device="cuda:1")
res = {"device": str(x.device), "read": bool(torch.equal(x, ref))}
x.mul_(2)  # a kernel on GPU 1 writing GPU 0's memory
torch.cuda.synchronize(1)
del x
s.sendall(json.dumps(res).encode() + b"\\n")
"""

PARENT_ON_GPU0 = SPAWN + """
parent = start(CHILD_ON_GPU1)
x = torch.arange(1 << 26, dtype=torch.float32, device="cuda:0")
torch.cuda.synchronize()
moonbright.ipc.send_tensor(parent, x)
res = answer(parent)
res["written"] = bool(torch.equal(x, 2 * torch.arange(1 << 26, dtype=torch.float32, device="cuda:0")))
print(json.dumps(res))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_tensor_imported_on_another_gpu_is_read_and_written_over_the_link():
    """The child imports GPU 0's memory on GPU 1 (its allocator there maps it, with access for
    GPU 1), reads it and writes it with a kernel on GPU 1; the parent sees the write."""
    out = run(["-c", f"CHILD_ON_GPU1 = {CHILD_ON_GPU1!r}\n" + textwrap.dedent(PARENT_ON_GPU0)])
    assert out["returncode"] == 0
    assert out["device"] == "cuda:1" and out["read"] and out["written"], out
