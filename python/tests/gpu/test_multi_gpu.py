"""PyTorch on two or more GPUs under MoonBright (run on a machine with two GPUs:
python3 -m pytest python/tests/gpu/test_multi_gpu.py -q).

One process using several GPUs (a model split across them, as `device_map="auto"` does), copies
between GPUs, PyTorch's current device, and NCCL collectives in two processes. Each scenario runs
in a fresh Python process (see `test_torch_gpu.run`). Skipped with fewer than two CUDA devices.
"""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("fewer than two CUDA devices", allow_module_level=True)

from test_torch_gpu import run  # noqa: E402


def test_the_current_device_is_left_as_pytorch_set_it():
    """MoonBright's calls for one GPU must not change which GPU PyTorch's current device is:
    allocating and freeing a tensor on cuda:0 while cuda:1 is current, from the main thread and
    from a thread that never set a device, leaves each thread's current device as it was."""
    out = run(
        """
        import json, threading, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        torch.cuda.set_device(1)
        seen = {}
        a = torch.ones(1 << 20, device="cuda:0")
        seen["after_alloc_0"] = torch.cuda.current_device()
        b = torch.ones(3 << 20, device="cuda:0")
        del a
        seen["after_free_0"] = torch.cuda.current_device()
        torch.cuda.synchronize(0)
        del b
        c = torch.empty(1000, device="cuda")
        seen["plain_cuda_goes_to"] = c.device.index
        def other():
            seen["thread_before"] = torch.cuda.current_device()
            x = torch.ones(5 << 20, device="cuda:1")
            del x
            seen["thread_after_1"] = torch.cuda.current_device()
        t = threading.Thread(target=other); t.start(); t.join()
        seen["main_at_end"] = torch.cuda.current_device()
        print(json.dumps(seen))
        """
    )
    assert out == {
        "after_alloc_0": 1,
        "after_free_0": 1,
        "plain_cuda_goes_to": 1,
        "thread_before": 0,
        "thread_after_1": 0,
        "main_at_end": 1,
    }, out


def test_module_functions_default_to_the_current_device():
    """moonbright.memory_stats() and the other module functions with no device describe the
    calling thread's current GPU, as torch.cuda.memory_stats() does, and create no allocator on
    a GPU the process does not use."""
    out = run(
        """
        import json, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        torch.cuda.set_device(1)
        x = torch.empty(48 << 20, dtype=torch.uint8, device="cuda")
        s = moonbright.memory_stats()
        print(json.dumps({
            "allocated": s["allocated_bytes.all.current"],
            "torch_allocated": torch.cuda.memory_allocated(),
            "init0": moonbright.is_initialized(0),
            "init1": moonbright.is_initialized(1),
            "cap_is_device_1": moonbright.cap() == moonbright.cap(1),
            "x_device": x.device.index, "torch_initialized": torch.cuda.is_initialized(),
            "mb1": moonbright.memory_stats(1)["allocated_bytes.all.current"],
        }))
        """
    )
    assert out["allocated"] == out["torch_allocated"] == 48 << 20, out
    assert out["init1"] and not out["init0"], out
    assert out["cap_is_device_1"], out


SPLIT_MODEL = """
import json, sys, torch
if MODE == "moonbright":
    import moonbright, moonbright.torch
    moonbright.torch.enable()
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
first = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU()).to("cuda:0")
second = torch.nn.Sequential(torch.nn.Linear(2048, 512), torch.nn.GELU(),
                             torch.nn.Linear(512, 10)).to("cuda:1")
opt = torch.optim.AdamW(list(first.parameters()) + list(second.parameters()), lr=1e-3)
g = torch.Generator().manual_seed(1)
losses = []
for step in range(10):
    x = torch.randn(256, 512, generator=g).to("cuda:0")
    y = torch.randint(0, 10, (256,), generator=g).to("cuda:1")
    h = first(x).to("cuda:1")
    loss = torch.nn.functional.cross_entropy(second(h), y)
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item().hex())
# Copies both ways, synchronous and on side streams, of sizes below and above a page.
copies_ok = True
for n in (1000, 1 << 20, (3 << 20) + 7, 100 << 20):
    a = torch.arange(n, dtype=torch.int32, device="cuda:0")
    b = a.to("cuda:1")
    c = b.to("cuda:0", non_blocking=True)
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    copies_ok &= bool((c == a).all()) and bool((b.cpu() == a.cpu()).all())
out = {"losses": losses, "copies_ok": copies_ok,
       "peer": torch.cuda.can_device_access_peer(0, 1)}
if MODE == "moonbright":
    out["peers"] = [moonbright.peers(d) for d in (0, 1)]
    out["deferred_errors"] = [moonbright.memory_stats(d)["moonbright.deferred_errors"] for d in (0, 1)]
    out["mb"] = [moonbright.memory_stats(d)["allocated_bytes.all.peak"] for d in (0, 1)]
    for d in (0, 1):
        moonbright.check_invariants(d)
print(json.dumps(out))
"""


def test_a_model_split_across_two_gpus_trains_as_under_pytorch():
    """Two halves of a model on two GPUs (activations and gradients copied between them), ten
    AdamW steps: the same losses, bit for bit, as under PyTorch's allocator; copies between the
    GPUs both ways are correct; both GPUs' allocators served memory."""
    ref = run("MODE = 'default'\n" + SPLIT_MODEL)
    got = run("MODE = 'moonbright'\n" + SPLIT_MODEL)
    assert got["copies_ok"] and ref["copies_ok"], (got, ref)
    assert got["losses"] == ref["losses"], (got, ref)
    assert all(p > 0 for p in got["mb"]), got
    assert got["peers"] == [[1], [0]], got
    assert got["deferred_errors"] == [0, 0], got
    print("peer access between the GPUs:", got["peer"])


NCCL = """
import json, os, sys, time, torch, torch.distributed as dist
import torch.multiprocessing as mp

PREMISE = sys.argv[2] == "premise"

def rank_main(rank, path, mode, q):
    if mode == "moonbright":
        import moonbright, moonbright.torch
        moonbright.torch.enable()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="file://" + path, rank=rank, world_size=2)
    n = 16 << 20
    warm = torch.ones(n, device="cuda")
    dist.all_reduce(warm)
    torch.cuda.synchronize()
    dist.barrier()
    out = {}
    # Collective: rank 1 joins late, so rank 0's all-gather is still waiting in its NCCL kernel
    # while rank 0 frees the input and writes a same-size tensor on its own stream.
    buf = torch.empty(2 * n, device="cuda")
    if rank == 1:
        time.sleep(0.5)
    t = torch.full((n,), float(rank + 1), device="cuda")
    work = dist.all_gather_into_tensor(buf, t, async_op=True)
    if PREMISE:
        t.fill_(99.0)  # what a reuse of t's memory would do
    del t
    u = torch.full((n,), 99.0, device="cuda")
    work.wait()
    torch.cuda.synchronize()
    out["all_gather_ok"] = bool((buf[:n] == 1).all()) and bool((buf[n:] == 2).all())
    # Point to point: the sender frees the tensor it sends before the receiver has posted its
    # receive, and writes a same-size tensor at once.
    dist.barrier()
    if rank == 0:
        s = torch.full((n,), 5.0, device="cuda")
        w = dist.isend(s, 1)
        if PREMISE:
            s.fill_(77.0)
        del s
        v = torch.full((n,), 77.0, device="cuda")
        w.wait()
    else:
        time.sleep(0.5)
        r = torch.empty(n, device="cuda")
        dist.recv(r, 0)
        torch.cuda.synchronize()
        out["send_ok"] = bool((r == 5).all())
    torch.cuda.synchronize()
    dist.barrier()
    if mode == "moonbright":
        out["deferred_errors"] = moonbright.memory_stats()["moonbright.deferred_errors"]
    dist.destroy_process_group()
    q.put((rank, out))

if __name__ == "__main__":
    import tempfile
    path = tempfile.mktemp()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, path, sys.argv[1], q)) for r in range(2)]
    for p in ps: p.start()
    res = dict(q.get(timeout=300) for _ in ps)
    for p in ps: p.join()
    print(json.dumps({"rank0": res[0], "rank1": res[1], "codes": [p.exitcode for p in ps]}))
"""


def run_nccl(tmp_path, *args):
    script = tmp_path / "nccl_check.py"
    script.write_text(NCCL)
    env = dict(os.environ)
    env["MOONBRIGHT_ALLOC_CONF"] = ""
    env.pop("TORCH_NCCL_AVOID_RECORD_STREAMS", None)
    r = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    out = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    assert out["codes"] == [0, 0], out
    return out


def test_nccl_collectives_whose_inputs_are_freed_before_they_run(tmp_path):
    """An asynchronous all-gather and an isend whose input tensors are freed, and the memory
    written by a new tensor on the rank's own stream, before the NCCL kernel has read them (the
    peer joins late). PyTorch's process group keeps such tensors alive until the work completes
    (by default since 2.7, without recordStream, which MoonBright would not see from C++); the
    results must be right. The premise run writes the inputs themselves instead of freeing
    them, and must see the write: the kernels had not read them yet."""
    out = run_nccl(tmp_path, "moonbright", "freed")
    assert out["rank0"]["all_gather_ok"] and out["rank1"]["all_gather_ok"], out
    assert out["rank1"]["send_ok"], out
    assert out["rank0"]["deferred_errors"] == 0 and out["rank1"]["deferred_errors"] == 0, out
    premise = run_nccl(tmp_path, "moonbright", "premise")
    assert not premise["rank0"]["all_gather_ok"], premise
    assert not premise["rank1"]["send_ok"], premise


HF_SPLIT = """
import json, sys, tempfile, torch
if MODE == "moonbright":
    import moonbright, moonbright.torch
    moonbright.torch.enable()
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                  attn_implementation="eager")
path = tempfile.mkdtemp()
LlamaForCausalLM(cfg).save_pretrained(path)
# What device_map="auto" does on a model too large for one GPU: layers 0-1 on GPU 0, the rest
# on GPU 1, activations copied between them by accelerate's hooks.
device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
              "model.layers.1": 0, "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1,
              "lm_head": 1}
model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, dtype=torch.float32)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 1000, (2, 24), generator=g).to("cuda:0")
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
res = {"generated": out.tolist(), "devices": sorted({str(p.device) for p in model.parameters()})}
if MODE == "moonbright":
    res["mb_peak"] = [moonbright.memory_stats(d)["allocated_bytes.all.peak"] for d in (0, 1)]
print(json.dumps(res))
"""


def test_a_transformers_model_split_over_two_gpus_generates_as_under_pytorch():
    """A Llama model loaded with a device map over two GPUs (what device_map="auto" gives a
    model too large for one; accelerate's hooks copy activations between them) generates the
    same tokens under MoonBright as under PyTorch's allocator."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ref = run("MODE = 'default'\n" + HF_SPLIT)
    got = run("MODE = 'moonbright'\n" + HF_SPLIT)
    assert got["devices"] == ["cuda:0", "cuda:1"], got
    assert got["generated"] == ref["generated"], (got, ref)
    assert all(p > 0 for p in got["mb_peak"]), got


def test_a_paged_pool_on_the_other_gpu_leaves_the_current_device_alone():
    """A paged KV pool on GPU 1, driven from a thread whose current device is GPU 0: its table
    kernels run on GPU 1 (under its context for the call only), its tables read back right, and
    PyTorch's current device stays GPU 0."""
    out = run(
        """
        import json, torch, moonbright.torch
        from moonbright.paged import PagedKVPool
        moonbright.torch.enable()
        torch.cuda.set_device(0)
        s1 = torch.cuda.Stream(device=1)
        pool = PagedKVPool(16, 256, 64, 8, 8, stream=s1.cuda_stream, device=1)
        seqs = pool.add_many([5, 40, 17])
        pool.commit()
        after_commit = torch.cuda.current_device()
        s1.synchronize()
        lens = pool.seq_lens.cpu().tolist()
        rows = [pool.row(s) for s in seqs]
        pool.check_invariants()
        print(json.dumps({"after_commit": after_commit, "end": torch.cuda.current_device(),
                          "lens": [lens[r] for r in rows], "table_device": str(pool.block_table.device),
                          "on_device": pool._pool.on_device()}))
        """
    )
    assert out["after_commit"] == 0 and out["end"] == 0, out
    assert out["lens"] == [5, 40, 17], out
    assert out["table_device"] == "cuda:1" and out["on_device"], out


def test_without_peer_access_copies_between_gpus_fail():
    """The control of the peering: with `peer_access:false` no allocator grants the other GPU
    access, and a copy between the GPUs fails as it did before peering existed (CUDA's
    "invalid argument"); the same copy works with the default."""
    code = """
        import json, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        a = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0")
        b = torch.empty(1, device="cuda:1")
        try:
            ok = bool((a.to("cuda:1").cpu() == a.cpu()).all())
            err = ""
        except Exception as e:
            ok, err = False, str(e).splitlines()[0]
        print(json.dumps({"ok": ok, "err": err, "peers": [moonbright.peers(d) for d in (0, 1)]}))
        """
    off = run(code, conf="peer_access:false")
    assert off["peers"] == [[], []], off
    assert not off["ok"] and "invalid argument" in off["err"], off
    on = run(code)
    assert on["ok"] and on["peers"] == [[1], [0]], on
