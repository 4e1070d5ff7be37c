"""Unmodified PyTorch programs under the LD_PRELOAD interposer (libmoonbright_preload.so), on a GPU.

PyTorch's own allocators call the CUDA runtime's cudaMalloc/cudaFree (the caching allocator)
or cudaMallocAsync/cudaFreeAsync (backend:cudaMallocAsync); with the interposer preloaded
those calls reach MoonBright. Each scenario runs in a fresh process, once without the
interposer and once with it, and prints a JSON line: results, timings and, under the
interposer, its report (`moonbright_preload_report`). The library is taken from
MOONBRIGHT_PRELOAD_LIB, else target/release/; skipped without it, PyTorch or a CUDA device.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

REPO = pathlib.Path(__file__).resolve().parents[3]
LIB = pathlib.Path(
    os.environ.get("MOONBRIGHT_PRELOAD_LIB", REPO / "target/release/libmoonbright_preload.so")
)
if not LIB.is_file():
    pytest.skip(f"no interposer library at {LIB}", allow_module_level=True)

PRELUDE = """
import hashlib, json, os, time
import torch
from moonbright.preload import report

def digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()
"""


def run(code, preload, env_extra=None, timeout=600, script=None):
    """Runs `code` after PRELUDE in a fresh Python (from the file `script` if given: spawned
    multiprocessing children import the parent's main module, which `-c` has not)."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    # Not the CPU tests' host-backend configuration (conftest.py), which the interposer refuses.
    env["MOONBRIGHT_ALLOC_CONF"] = ""
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.update(env_extra or {})
    if preload:
        env["LD_PRELOAD"] = str(LIB)
    source = PRELUDE + textwrap.dedent(code)
    if script is not None:
        pathlib.Path(script).write_text(source)
    r = subprocess.run(
        [sys.executable, *(["-c", source] if script is None else [str(script)])],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    assert lines, f"no result printed:\n{r.stdout}\n{r.stderr}"
    out = json.loads(lines[-1])
    print(f"\n{'preload' if preload else 'runtime'}: {json.dumps(out)}")
    return out


LLAMA = """
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=256, attn_implementation="eager")
model = LlamaForCausalLM(cfg).cuda()
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 1000, (2, 24), generator=g).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
for _ in range(3):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
out = model.generate(ids[:, :8], max_new_tokens=16, do_sample=False)
params = digest(*model.parameters())
allocated = torch.cuda.memory_allocated()
torch.cuda.empty_cache()
print(json.dumps({"losses": losses, "tokens": out.tolist(), "params": params,
                  "allocated": allocated, "report": report()}))
"""


def test_llama_training_and_generation_match_the_runtimes_bit_for_bit():
    base = run(LLAMA, preload=False)
    mb = run(LLAMA, preload=True)
    assert base["report"] is None
    for k in ("losses", "tokens", "params", "allocated"):
        assert mb[k] == base[k], k
    r = mb["report"]
    assert r["served_allocs"] > 0, r
    # empty_cache gave every cached segment back through cudaFree, which waited for the device.
    assert r["served_frees"] == r["synchronous_frees"] > 0, r
    assert r["devices"][0]["allocations"] == r["served_allocs"] - r["served_frees"], r


NO_CACHE = """
sizes = [512, 1 << 16, 3 << 20, 40 << 20, 300 << 20]
# Work: each tensor is filled, read back through a kernel, and checked.
total = 0.0
for i in range(200):
    for s in sizes:
        t = torch.full((s // 4,), float(i % 7), device="cuda")
        total += float(t[:: max(1, s // 4096)].sum())
del t
torch.cuda.synchronize()
# Time: alloc+free pairs of each size (PyTorch's caching off: each is cudaMalloc + cudaFree).
pairs = {}
for s in sizes:
    for _ in range(20):
        torch.empty(s, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    n = 400
    t0 = time.perf_counter()
    for _ in range(n):
        torch.empty(s, dtype=torch.uint8, device="cuda")
    pairs[s] = (time.perf_counter() - t0) / n * 1e6
print(json.dumps({"total": total, "pair_us": pairs, "report": report()}))
"""


def test_without_pytorchs_cache_every_tensor_goes_through_it():
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    base = run(NO_CACHE, preload=False, env_extra=env)
    mb = run(NO_CACHE, preload=True, env_extra=env)
    assert mb["total"] == base["total"]
    r = mb["report"]
    assert r["served_allocs"] >= 200 * 5 + 5 * 420, r
    assert r["served_frees"] == r["served_allocs"], r
    assert r["devices"][0]["allocated_bytes"] == 0, r
    for s, us in mb["pair_us"].items():
        print(f"{int(s):>10} B: alloc+free {us:8.2f} us under the interposer, "
              f"{base['pair_us'][s]:8.2f} us with the runtime's cudaMalloc/cudaFree")


ASYNC = """
torch.manual_seed(0)
side = torch.cuda.Stream()
checks = []
for i in range(50):
    a = torch.randn(1 << 20, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b = a * 2 + 1
        c = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        c.fill_(i % 251)
    torch.cuda.current_stream().wait_stream(side)
    b.record_stream(torch.cuda.current_stream())
    checks.append(float((b - (a * 2 + 1)).abs().max()) + float(c[::4096].float().mean()))
    del a, b, c
torch.cuda.synchronize()
print(json.dumps({"checks": checks, "report": report()}))
"""


def test_the_cudamallocasync_backend_is_served_stream_ordered():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    base = run(ASYNC, preload=False, env_extra=env)
    mb = run(ASYNC, preload=True, env_extra=env)
    assert mb["checks"] == base["checks"]
    r = mb["report"]
    assert r["served_allocs"] >= 150 and r["served_frees"] >= 140, r
    assert r["synchronous_frees"] == 0, r


OOM = """
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
x.fill_(5)
try:
    torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    raised = False
except torch.OutOfMemoryError as e:
    raised = "out of memory" in str(e).lower()
y = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
y.fill_(1)
print(json.dumps({"raised": raised, "x": int(x[::1 << 20].sum()), "y": int(y[::1 << 20].sum()),
                  "report": report()}))
"""


def test_out_of_memory_raises_pytorchs_error_and_the_process_goes_on():
    mb = run(OOM, preload=True, env_extra={"MOONBRIGHT_ALLOC_CONF": "cap:4GiB"})
    assert mb["raised"]
    assert mb["x"] == 5 * 2048 and mb["y"] == 1024
    assert mb["report"]["devices"][0]["reserved_bytes"] <= 4 << 30


MEM_INFO = """
f0, total = torch.cuda.mem_get_info()
x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
f1, _ = torch.cuda.mem_get_info()
del x
torch.cuda.synchronize()
f2, _ = torch.cuda.mem_get_info()
print(json.dumps({"f0": f0, "f1": f1, "f2": f2, "total": total, "report": report()}))
"""


def test_mem_get_info_counts_what_moonbright_holds_unused_as_free():
    """Without PyTorch's cache the 4 GiB go back at `del`: to the driver under the runtime, to
    MoonBright's cache under the interposer, where a cudaMalloc would get them again."""
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    for preload in (False, True):
        m = run(MEM_INFO, preload=preload, env_extra=env)
        used = m["f0"] - m["f1"]
        assert 4 << 30 <= used < (4 << 30) + (256 << 20), m
        assert abs(m["f2"] - m["f0"]) < 256 << 20, m
    assert m["report"]["served_frees"] == 1, m


SHARE = """
import torch.multiprocessing as mp

def child(q, back):
    small, big, view = q.get()
    torch.cuda.synchronize()
    seen = [float(small.sum()), int(big[:: 1 << 16].sum()), view.tolist()]
    small.add_(1)
    big[:16].fill_(9)
    view.mul_(-1)
    torch.cuda.synchronize()
    back.put({"seen": seen, "report": report()})
    del small, big, view

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    small = torch.arange(1000, dtype=torch.float32, device="cuda")
    big = torch.full((300 << 20,), 3, dtype=torch.uint8, device="cuda")
    base = torch.arange(64, dtype=torch.int64, device="cuda")
    view = base[3:40:3]
    p = ctx.Process(target=child, args=(q, back))
    p.start()
    q.put((small, big, view))
    got = back.get(timeout=300)
    p.join(timeout=300)
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    after = [float(small.sum()), int(big[:32].sum()), base.tolist()]
    print(json.dumps({"seen": got["seen"], "after": after, "exitcode": p.exitcode,
                      "child": got["report"], "report": report()}))
"""


def test_torch_multiprocessing_shares_cuda_tensors_through_the_interposers_ipc_handles(tmp_path):
    """PyTorch's own CUDA IPC (cudaIpcGetMemHandle on the caching allocator's segment, and
    cudaIpcOpenMemHandle in a spawned child), unmodified: under the interposer the segments are
    MoonBright's, whose handles the runtime refuses, so the interposer gives and opens its own.
    The child reads three tensors (one in a 300 MiB segment of its own, a strided view) and
    writes them; the parent sees the writes, as with the runtime."""
    script = tmp_path / "share.py"
    base = run(SHARE, preload=False, script=script)
    mb = run(SHARE, preload=True, script=script)
    assert base["exitcode"] == mb["exitcode"] == 0
    assert mb["seen"] == base["seen"] and mb["after"] == base["after"], (mb, base)
    assert base["seen"][1] == 3 * (300 << 4) and mb["after"][1] == 16 * 9 + 16 * 3
    r, c = mb["report"], mb["child"]
    assert r["ipc_handles"] >= 2 and r["ipc_exported"] >= 2, r
    assert c["ipc_opens"] >= 2, c


def nvcc():
    import shutil

    found = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return found if os.path.exists(found) else None


@pytest.mark.skipif(nvcc() is None, reason="no nvcc to build the CUDA program")
def test_a_cuda_program_linked_with_the_shared_runtime(tmp_path):
    """crates/moonbright-preload/tests/cuda/check.cu: four threads of cudaMalloc / kernels /
    cudaFree, and cudaMallocAsync freed on another stream, each allocation checked by a kernel;
    a double free and an impossible request get the runtime's errors. Here the runtime is in
    the program's global scope, which the interposer finds with RTLD_NEXT."""
    src = REPO / "crates/moonbright-preload/tests/cuda/check.cu"
    exe = tmp_path / "check"
    build = subprocess.run(
        [nvcc(), "-O2", "-std=c++17", "-arch=native", "-cudart", "shared", "-o", str(exe),
         str(src), "-ldl", "-lpthread"],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    results = {}
    for preload in (False, True):
        env = dict(os.environ, MOONBRIGHT_ALLOC_CONF="")
        env.pop("LD_PRELOAD", None)
        if preload:
            env["LD_PRELOAD"] = str(LIB)
        r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"preload={preload}\n{r.stdout}\n{r.stderr}"
        results[preload] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"\npreload={preload}: {r.stdout.strip()}")
    base, mb = results[False], results[True]
    assert base["report"] is None
    for k in ("bad", "failures", "double_free", "oom", "after_oom"):
        assert mb[k] == base[k], k
    assert mb["double_free"] != 0 and (mb["oom"], mb["after_oom"]) == (2, 0)
    r = mb["report"]
    # 4 threads x 12 rounds x 8, 200 x 2 async, and two in the error checks.
    assert r["served_allocs"] >= 786 and r["served_frees"] >= 786, r
    assert r["synchronous_frees"] >= 386 and r["passed_frees"] >= 1, r
    assert r["devices"][0]["allocations"] == r["served_allocs"] - r["served_frees"], r
