"""PyTorch on a GPU under MoonBright (run on the H200: python3 -m pytest python/tests/gpu -x -q).

MoonBright becomes PyTorch's allocator for a whole process and cannot be switched back, so every
test runs its scenario in a fresh Python process and checks what it prints (a JSON line).
Skipped without PyTorch or without a CUDA device.
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


def run(code, conf="", timeout=600):
    env = dict(os.environ)
    env["MOONBRIGHT_ALLOC_CONF"] = conf
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    assert lines, f"no result printed:\n{r.stdout}\n{r.stderr}"
    return json.loads(lines[-1])


LLAMA = """
import hashlib, json, sys
import torch
if sys.argv[1:] == ["moonbright"] or MODE == "moonbright":
    import moonbright.torch
    moonbright.torch.enable()
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
cfg = LlamaConfig(
    vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    attn_implementation="eager",
)
model = LlamaForCausalLM(cfg).cuda()
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 1000, (2, 24), generator=g).cuda()
model.eval()
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    logits = model(ids).logits
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss = model(ids, labels=ids).loss
loss.backward()
opt.step()
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().float().cpu().numpy().tobytes())
h2 = hashlib.sha256(logits.float().cpu().numpy().tobytes())
stats = {}
if MODE == "moonbright":
    import moonbright
    s = torch.cuda.memory_stats()
    stats = {
        "allocated": torch.cuda.memory_allocated(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "backend": moonbright.backend(),
        "summary": "PyTorch CUDA memory summary" in torch.cuda.memory_summary(),
    }
print(json.dumps({
    "generated": out.tolist(), "loss": loss.item().hex(), "params": h.hexdigest(),
    "logits": h2.hexdigest(), "stats": stats,
}))
"""


# enable() takes PyTorch's own contract for captures and streams (MoonBright's hot path then
# makes no driver call); this turns it off, for the checked path.
NO_TORCH_CONTRACT = "captures_announced:false,deferred_free_events:false"


def test_enable_takes_torchs_contract_and_cache_hits_make_no_driver_call():
    r = run(
        """
        import json, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        x = torch.empty(3 << 20, device="cuda")
        y = torch.empty(1000, device="cuda")
        del x, y
        torch.cuda.synchronize()
        before = moonbright.memory_stats()["moonbright.driver_calls.total"]
        for _ in range(1000):
            x = torch.empty(3 << 20, device="cuda")
            y = torch.empty(1000, device="cuda")
            del x, y
        calls = moonbright.memory_stats()["moonbright.driver_calls.total"] - before
        o = moonbright.options()
        print(json.dumps({"calls": calls, "announced": o["captures_announced"],
                          "deferred": o["deferred_free_events"]}))
        """
    )
    assert r["announced"] and r["deferred"]
    # The background worker may record an event or two meanwhile; 2,000 allocations made none.
    assert r["calls"] < 20, r


@pytest.mark.parametrize("conf", ["", NO_TORCH_CONTRACT])
def test_llama_generate_and_train_bit_identical(conf):
    pytest.importorskip("transformers")
    ref = run("MODE = 'default'\n" + LLAMA)
    got = run("MODE = 'moonbright'\n" + LLAMA, conf=conf)
    assert got["stats"]["backend"] == "cuda"
    assert got["stats"]["summary"]
    assert 0 < got["stats"]["allocated"] <= got["stats"]["max_allocated"] <= got["stats"]["reserved"]
    for key in ("generated", "logits", "loss", "params"):
        assert got[key] == ref[key], key


def test_stats_match_live_tensor_bytes():
    r = run(
        """
        import json, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        base = torch.cuda.memory_allocated()
        sizes = [1, 255, 256, 1000, 4096, 1 << 20, (2 << 20) + 1, 3 << 20, 100 << 20, 7777777]
        ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        live = sum(t.untyped_storage().nbytes() for t in ts)
        a1 = torch.cuda.memory_allocated() - base
        s = torch.cuda.memory_stats()
        flat = moonbright.memory_stats()
        del ts[::2]
        live2 = sum(t.untyped_storage().nbytes() for t in ts)
        a2 = torch.cuda.memory_allocated() - base
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        peak_after_reset = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        print(json.dumps({
            "live": live, "a1": a1, "live2": live2, "a2": a2, "peak": peak,
            "peak_after_reset": peak_after_reset, "now": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(), "n": len(sizes),
            "same": s["allocated_bytes.all.current"] == flat["allocated_bytes.all.current"],
            "active": s["active_bytes.all.current"],
        }))
        """
    )
    slack = 512 * r["n"]  # "within rounding": PyTorch may round a request
    assert r["live"] <= r["a1"] <= r["live"] + slack
    assert r["live2"] <= r["a2"] <= r["live2"] + slack
    assert r["peak"] >= r["a1"]
    assert r["peak_after_reset"] == r["now"]
    assert r["reserved"] >= r["now"]
    assert r["active"] >= r["a1"]
    assert r["same"]


def test_oom_raises_torch_out_of_memory_and_recovers():
    r = run(
        """
        import json, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        a = torch.ones(512 << 20, dtype=torch.uint8, device="cuda")
        err, kind = "", ""
        try:
            b = torch.empty(768 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            kind, err = "OutOfMemoryError", str(e)
        except RuntimeError as e:
            kind, err = "RuntimeError", str(e)
        del a
        b = torch.full((768 << 20,), 3, dtype=torch.uint8, device="cuda")
        # A strided sample: summing all of b would need a 6 GiB int64 copy, over the 1 GiB cap.
        ok = int(b[-1].item()) == 3 and int(b[::4096].sum(dtype=torch.int64).item()) == 3 * ((768 << 20) // 4096)
        print(json.dumps({
            "kind": kind, "err": err, "ok": ok, "last": moonbright.last_error() or "",
            "ooms": torch.cuda.memory_stats()["num_ooms"],
            "torch_error": moonbright.torch.oom_as_torch_error(),
        }))
        """,
        conf="cap:1GiB",
    )
    assert r["torch_error"], "the installed PyTorch's torch::PyTorchError did not match"
    assert r["kind"] == "OutOfMemoryError", r
    assert "out of memory" in r["err"] and "MoonBright" in r["err"]
    assert "out of memory" in r["last"]
    assert r["ooms"] >= 1
    assert r["ok"]


def test_snapshot_opens_in_memory_viz(tmp_path):
    path = tmp_path / "snap.pickle"
    r = run(
        f"""
        import json, pickle, torch, moonbright, moonbright.torch
        from torch.cuda import _memory_viz
        moonbright.torch.enable()
        torch.cuda.memory._record_memory_history(max_entries=10000)
        xs = [torch.empty(n, device="cuda") for n in (10, 1 << 18, 3 << 20, 5000)]
        del xs[1]
        y = (xs[0].sum() + 1).item()
        snap = moonbright.snapshot()
        moonbright.dump_snapshot({str(path)!r})
        with open({str(path)!r}, "rb") as f:
            loaded = pickle.load(f)
        seg = _memory_viz.segment_plot(loaded)
        trace = _memory_viz.trace_plot(loaded)
        via_torch = torch.cuda.memory._snapshot()
        print(json.dumps({{
            "segments": len(snap["segments"]), "seg_plot": len(seg), "trace_plot": len(trace),
            "actions": sorted({{e["action"] for e in snap["device_traces"][0]}}),
            "torch_segments": len(via_torch["segments"]),
            "memory_snapshot": len(torch.cuda.memory_snapshot()),
        }}))
        """
    )
    assert r["segments"] > 0 and r["seg_plot"] > 0 and r["trace_plot"] > 0
    assert "alloc" in r["actions"] and "free_requested" in r["actions"]
    assert r["torch_segments"] == r["segments"]
    assert r["memory_snapshot"] == r["segments"]


def test_snapshot_with_stacks_names_the_python_caller():
    r = run(
        """
        import json, torch, moonbright.torch
        from torch.cuda import _memory_viz
        moonbright.torch.enable()
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all", stacks="python", max_entries=10000)

        def make_activation():
            return torch.empty(3 << 20, device="cuda")

        x = make_activation()
        p = x.data_ptr()
        snap = torch.cuda.memory._snapshot()
        alloc = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] == p]
        block = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == p]
        flame = _memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
        del x
        snap = torch.cuda.memory._snapshot()
        free = [e for e in snap["device_traces"][0]
                if e["action"] == "free_requested" and e["addr"] == p]
        names = lambda es: [f["name"] for f in es[-1]["frames"]] if es else []
        print(json.dumps({
            "alloc": names(alloc), "block": names(block), "free": names(free),
            "flame": ":make_activation" in flame,
        }))
        """
    )
    assert r["alloc"][:2] == ["make_activation", "<module>"], r
    assert r["block"] == r["alloc"]
    assert r["free"][:1] == ["<module>"], r
    assert r["flame"]


def test_mempool_mode():
    r = run(
        """
        import json, torch, moonbright, moonbright.torch
        pool = moonbright.torch.pool()
        with torch.cuda.use_mem_pool(pool):
            x = torch.full((10 << 20,), 7, dtype=torch.uint8, device="cuda")
        y = torch.ones(1 << 20, device="cuda")  # outside: PyTorch's own memory
        ok = int(x.sum(dtype=torch.int64).item()) == 7 * (10 << 20)
        s = moonbright.memory_stats()
        print(json.dumps({
            "ok": ok, "mb_allocated": s["allocated_bytes.all.current"],
            "torch_allocated": torch.cuda.memory_allocated(),
        }))
        """
    )
    assert r["ok"]
    assert r["mb_allocated"] >= 10 << 20
    assert r["torch_allocated"] >= 4 << 20


def test_enable_after_cuda_init_is_a_clear_error():
    r = run(
        """
        import json, torch, moonbright.torch
        torch.zeros(1, device="cuda")
        try:
            moonbright.torch.enable()
            msg = ""
        except RuntimeError as e:
            msg = str(e)
        print(json.dumps({"msg": msg}))
        """
    )
    assert "before PyTorch initialises CUDA" in r["msg"]


RECORD_STREAM = """
import json, torch, moonbright, moonbright.torch
moonbright.torch.enable()
n = 16 << 20                                   # 64 MiB of float32, and 1,000 B below a page
main, side = torch.cuda.current_stream(), torch.cuda.Stream()
# Load every kernel first: the first launch of one loads its module, which waits for the device.
w = torch.ones(256, device="cuda")
with torch.cuda.stream(side):
    torch.cuda._sleep(1000)
    w = w * 2
w = torch.full((256,), 7.0, device="cuda")
torch.cuda.synchronize()
del w
out = {}
for numel in (n, 250):
    x = torch.ones(numel, device="cuda")
    ptr = x.data_ptr()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)         # about 0.1 s: side's read of x comes late
        y = x * 2
    if RECORD:
        x.record_stream(side)
    del x                                      # freed on main, its allocation stream
    z = [torch.full((numel,), 7.0, device="cuda")]  # same size on main, at once
    early = z[0].data_ptr() == ptr
    # Below a page, a freed block joins the free space beside it and best fit may take other
    # holes first: take blocks of its size (an arena holds 2,048) until one overlaps it.
    while numel < n and not early and len(z) < 3000:
        z.append(torch.full((numel,), 7.0, device="cuda"))
        early = abs(z[-1].data_ptr() - ptr) < 4 * numel
    busy = not side.query()                    # the premise: side has not read x yet
    torch.cuda.synchronize()
    out[str(numel)] = {
        "reused_early": early, "side_busy": busy, "side_read_ok": bool((y == 2).all())
    }
    del y, z
torch.cuda.synchronize()
# A view of a growable buffer: not an allocation of MoonBright's, ignored as PyTorch ignores
# storages it did not make.
g = moonbright.Growable(4 * moonbright.page_size())
g.resize(moonbright.page_size(), stream=main.cuda_stream)
v = torch.as_tensor(g, device="cuda")
v.record_stream(side)
del v
g.release()
moonbright.check_invariants()
out["joined_frees"] = moonbright.memory_stats()["moonbright.joined_frees"]
print(json.dumps(out))
"""


@pytest.mark.parametrize("conf", ["", NO_TORCH_CONTRACT])
def test_record_stream_keeps_memory_from_its_own_stream_until_the_side_stream_is_done(conf):
    """A tensor read on a side stream, recorded there, and freed on its own stream: the next
    allocation of the same size on its own stream must not get its memory while the side stream
    still has to read it. The control run, without record_stream, shows the hazard is real:
    the same-stream reuse happens at once (and the side stream then reads the new values)."""
    out = run("RECORD = True\n" + RECORD_STREAM, conf=conf)
    for numel in ("16777216", "250"):
        assert out[numel]["side_busy"], out
        assert not out[numel]["reused_early"], out
        assert out[numel]["side_read_ok"], out
    assert out["joined_frees"] == 2, out
    control = run("RECORD = False\n" + RECORD_STREAM, conf=conf)
    for numel in ("16777216", "250"):
        assert control[numel]["side_busy"], control
        assert control[numel]["reused_early"], control
    assert control["joined_frees"] == 0, control
    print("control, without record_stream:", control)


@pytest.mark.parametrize("conf", ["", NO_TORCH_CONTRACT])
def test_empty_cache_gives_back_memory_freed_behind_running_work(conf):
    """`del x; torch.cuda.empty_cache()` while the GPU still runs work queued before the free:
    under PyTorch's allocator the memory goes back to the driver (its cudaFree waits for the
    device), and so it must under MoonBright (the host waits for the free's stream work). The
    control, moonbright.empty_cache(wait=False), shows that the free was still pending."""
    out = run(
        """
        import json, time, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        keep = torch.ones(1 << 20, device="cuda")
        torch.cuda.synchronize(); torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        res = {}
        for wait in (False, True):
            x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            torch.cuda._sleep(300_000_000)  # about 0.15 s queued behind x's last use
            x.fill_(1)
            del x
            t = time.perf_counter()
            if wait:
                torch.cuda.empty_cache()
            else:
                moonbright.empty_cache(wait=False)
            took = time.perf_counter() - t
            res[str(wait)] = {"reserved_over_base": torch.cuda.memory_reserved() - base,
                              "busy_after": not torch.cuda.current_stream().query(),
                              "took_s": took}
            torch.cuda.synchronize(); torch.cuda.empty_cache()
        res["final_over_base"] = torch.cuda.memory_reserved() - base
        moonbright.check_invariants()
        print(json.dumps(res))
        """,
        conf=conf,
    )
    assert out["False"]["busy_after"], out  # the premise: the work was still running
    assert out["False"]["reserved_over_base"] >= 256 << 20, out
    assert out["True"]["reserved_over_base"] == 0, out
    assert not out["True"]["busy_after"], out
    assert out["final_over_base"] == 0, out


def test_set_per_process_memory_fraction_sets_the_cap():
    """PyTorch's pluggable allocator ignores set_per_process_memory_fraction; under
    moonbright.torch.enable() it sets MoonBright's cap: past it, allocations raise
    torch.OutOfMemoryError naming the cap, and raising the fraction lets them through."""
    out = run(
        """
        import json, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(0.05)
        cap = moonbright.cap()
        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get() if get else None
        # 3% of the card fits under a cap of 5%; twice that does not, whatever the card.
        n = int(0.03 * total) // (2 << 20) * (2 << 20)
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        try:
            y = torch.empty(n, dtype=torch.uint8, device="cuda")
            refused, msg = False, ""
        except torch.OutOfMemoryError as e:
            refused, msg = True, str(e)
        torch.cuda.set_per_process_memory_fraction(0.5)
        y = torch.empty(n, dtype=torch.uint8, device="cuda")
        y.fill_(1)
        torch.cuda.synchronize()
        moonbright.check_invariants()
        print(json.dumps({"total": total, "cap": cap, "fraction": fraction, "refused": refused,
                          "msg": msg, "cap_after": moonbright.cap()}))
        """
    )
    assert abs(out["cap"] - 0.05 * out["total"]) < 4 << 20, out
    assert out["fraction"] is None or abs(out["fraction"] - 0.05) < 1e-3, out
    assert out["refused"] and "cap" in out["msg"], out
    assert abs(out["cap_after"] - 0.5 * out["total"]) < 4 << 20, out


@pytest.mark.parametrize("conf", ["", NO_TORCH_CONTRACT])
def test_a_graph_captured_while_another_thread_allocates(conf):
    """torch.cuda.graph captures in global mode, in which a "potentially unsafe" driver call
    from any other thread invalidates the capture. MoonBright's maps, unmaps and event queries
    (another thread's allocations of new sizes, the worker's polls) must not."""
    out = run(
        """
        import json, threading, time, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        a = torch.ones(1 << 20, device="cuda"); b = torch.empty_like(a)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(500_000_000)
            tmp = [torch.ones((1 << 18) * (i + 1), device="cuda") for i in range(20)]
            del tmp
        stop, count = threading.Event(), [0]
        def churn():
            with torch.cuda.stream(torch.cuda.Stream()):
                i = 0
                while not stop.is_set() or i < 32:
                    x = torch.empty((1 << 20) * (1 + i % 37), dtype=torch.uint8, device="cuda")
                    del x
                    i += 1
                count[0] = i
        t = threading.Thread(target=churn); t.start(); time.sleep(0.05)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                for _ in range(1000):
                    torch.mul(a, 2, out=b)
                    b.add_(1)
        stop.set(); t.join()
        g.replay(); torch.cuda.synchronize()
        out = {"ok": bool((b == 3).all()), "allocs": count[0],
               "deferred": moonbright.memory_stats()["moonbright.deferred_errors"]}
        # Allocating inside a capture works (test_graphs_gpu.py has more).
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            y = a * 2
        g2.replay(); torch.cuda.synchronize()
        out["inside"] = bool((y == 2).all())
        print(json.dumps(out))
        """,
        conf=conf,
    )
    assert out["ok"] and out["allocs"] >= 32 and out["deferred"] == 0, out
    assert out["inside"], out


def test_a_capture_into_a_moonbright_pool_allocates_its_segments():
    """torch.cuda.graph(g, pool=pool.id) makes PyTorch's caching allocator ask the pool's
    allocator for a segment on the capturing stream; it keeps that segment in its graph-private
    pool. MoonBright serves it from memory no stream's queued work uses (malloc_for_graph); it
    used to refuse. Tensors made before the capture work inside
    it too."""
    code = textwrap.dedent(
        """
        import json, torch, moonbright, moonbright.torch
        pool = moonbright.torch.pool()
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(1 << 20, device="cuda")
            y = torch.empty_like(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.mul(x, 2, out=y)
        g.replay(); torch.cuda.synchronize()
        out = {"static_ok": bool((y == 2).all())}
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, pool=pool.id):
            z = x * 3
            w = z + 1
        x.fill_(2)
        g2.replay(); torch.cuda.synchronize()
        out["inside_ok"] = bool((z == 6).all() and (w == 7).all())
        out["error"] = moonbright.last_error()
        print(json.dumps(out))
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, "MOONBRIGHT_ALLOC_CONF": ""},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    assert out["static_ok"] and out["inside_ok"], (out, r.stderr)


def test_record_stream_with_a_generic_torch_stream():
    """Tensor.record_stream also takes a device-generic torch.Stream (what
    torch.accelerator.current_stream() returns); the wrapper turns it into its CUstream."""
    out = run(
        """
        import json, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        w = torch.ones(256, device="cuda")
        with torch.cuda.stream(side):
            torch.cuda._sleep(1000); w = w * 2
        w = torch.full((256,), 7.0, device="cuda"); torch.cuda.synchronize(); del w
        with torch.cuda.stream(side):
            generic = torch.accelerator.current_stream()
        x = torch.ones(250, device="cuda"); ptr = x.data_ptr()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000); y = x * 2
        x.record_stream(generic)
        del x
        z = torch.full((250,), 7.0, device="cuda")
        out = {"type": type(generic).__name__, "reused_early": z.data_ptr() == ptr,
               "side_busy": not side.query()}
        torch.cuda.synchronize()
        out["side_read_ok"] = bool((y == 2).all())
        out["joined"] = moonbright.memory_stats()["moonbright.joined_frees"]
        print(json.dumps(out))
        """
    )
    assert out == {"type": "Stream", "reused_early": False, "side_busy": True,
                   "side_read_ok": True, "joined": 1}, out
