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
res["small"] = small.tolist()
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

PARENT = """
import json, os, socket, subprocess, sys
import torch
import moonbright, moonbright.torch, moonbright.ipc
moonbright.torch.enable()
parent, child = socket.socketpair()
env = dict(os.environ, MB_IPC_FD=str(child.fileno()))
proc = subprocess.Popen([sys.executable, "-c", CHILD], pass_fds=[child.fileno()], env=env)
child.close()
big = torch.arange(1 << 28, dtype=torch.int32, device="cuda")
# 64 MiB stitched from 32 scattered pages: the cap leaves no room for new ones.
holes = [torch.empty(2 << 20, dtype=torch.uint8, device="cuda") for _ in range(64)]
del holes[::2]
torch.cuda.synchronize()
cap = moonbright.cap()
moonbright.set_cap(moonbright.memory_stats()["reserved_bytes.all.current"])
stitched = torch.full((16 << 20,), 7.0, device="cuda")
moonbright.set_cap(cap)
small = torch.tensor([1.5, 2.5, 3.5], device="cuda")
base = torch.arange(1 << 20, dtype=torch.float32, device="cuda").reshape(1024, 1024)
torch.cuda.synchronize()
exports = []
for t in (big, stitched, small, base[::2, 3:]):
    before = moonbright.memory_stats()["moonbright.driver_calls.export"]
    moonbright.ipc.send_tensor(parent, t)
    exports.append(moonbright.memory_stats()["moonbright.driver_calls.export"] - before)
line = b""
while not line.endswith(b"\\n"):
    part = parent.recv(4096)
    assert part, "the child closed the socket"
    line += part
res = json.loads(line)
res["returncode"] = proc.wait(timeout=300)
res["exports"] = exports
res["small_after"] = small.tolist()
ref = torch.arange(1 << 20, dtype=torch.float32, device="cuda").reshape(1024, 1024)
ref[::2, 3:] = 0
res["base_after"] = bool(torch.equal(base, ref))
print(json.dumps(res))
"""


def test_tensors_cross_processes_both_ways():
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    # Not the CPU tests' host-backend configuration (conftest.py).
    env["MOONBRIGHT_ALLOC_CONF"] = ""
    code = f"CHILD = {CHILD!r}\n" + textwrap.dedent(PARENT)
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    out = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    print(f"\n{json.dumps(out)}")
    assert out["returncode"] == 0
    assert out["big"] and out["stitched"] and out["view"], out
    assert out["small"] == [1.5, 2.5, 3.5]
    assert out["exports"][1] >= 2, "the 64 MiB tensor was stitched from scattered pages"
    assert out["exports"][2] == 1 and out["exports"][0] >= 1
    assert out["imports"] == 4 and out["imports_after_gc"] == 0
    assert out["torch_allocated"] == 0, "the child's tensors are views of imported memory"
    assert out["small_after"] == [3.0, 5.0, 7.0], "the child's write reached the parent"
    assert out["base_after"], "the child zeroed exactly its strided view of the parent's tensor"
