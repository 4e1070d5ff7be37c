"""CUDA graphs under moonbright.torch.enable() (run on the H200: python3 -m pytest
python/tests/gpu -x -q). Tensors allocated inside a capture come from a graph pool
(docs/design.md, CUDA graphs): replays give what eager code gives, other allocations never
receive a graph's memory while the graph exists, captures sharing a pool reuse its memory, and
deleting the graphs gives it back. Each scenario runs in a fresh process (see test_torch_gpu.py).
"""

import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_torch_gpu import run  # noqa: E402

MODEL = """
import json, sys, torch, moonbright
MB = sys.argv[1:] != ["pytorch"]
if MB:
    import moonbright.torch
    moonbright.torch.enable()
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096), torch.nn.GELU(),
    torch.nn.Linear(4096, 1024),
).cuda().eval()
"""


def with_model(body):
    return MODEL + textwrap.dedent(body)


def test_a_graph_allocating_inside_its_capture_replays_as_eager_code_runs():
    body = with_model(
        """
        static_in = torch.randn(64, 1024, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):
                model(static_in)
        torch.cuda.current_stream().wait_stream(side)
        allocated = torch.cuda.memory_allocated()
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            static_out = model(static_in)
        held = moonbright.graph_pool_free() if MB else (0, 0)
        # Other allocations while the graph exists, filled with a pattern its replays must spare.
        others = [torch.full(((1 << 18) * (1 + i % 7),), float(i), device="cuda") for i in range(64)]
        diffs = []
        for i in range(5):
            x = torch.randn(64, 1024, device="cuda")
            static_in.copy_(x)
            g.replay()
            with torch.no_grad():
                diffs.append((static_out - model(x)).abs().max().item())
            del x
            tmp = [torch.empty((1 << 20) * (1 + j % 5), device="cuda") for j in range(20)]
            del tmp
        torch.cuda.synchronize()
        spared = all(bool((t == float(i)).all()) for i, t in enumerate(others))
        graph_ptrs_in_others = static_out.data_ptr() in {t.data_ptr() for t in others}
        del others, static_out
        del g
        torch.cuda.synchronize()
        print(json.dumps({
            "max_diff": max(diffs), "spared": spared, "held": list(held),
            "after": list(moonbright.graph_pool_free()) if MB else None,
            "clash": graph_ptrs_in_others,
            "allocated_before": allocated, "allocated_after": torch.cuda.memory_allocated(),
            "errors": moonbright.last_error(),
        }))
        """
    )
    out = run(body)
    assert out["max_diff"] < 1e-4, out
    assert out["spared"] and not out["clash"], out
    assert out["held"][0] > 0, f"intermediates freed inside the capture stay the pool's: {out}"
    assert out["after"] == [0, 0], out
    # What stays allocated once the graph is gone (cuBLAS keeps a workspace for each stream it
    # ran on, the capture's among them) is what stays under PyTorch's own allocator.
    control = run_mode(body, "pytorch")
    ours, theirs = (o["allocated_after"] - o["allocated_before"] for o in (out, control))
    assert abs(ours - theirs) < 1 << 20, (out, control)


def test_a_capture_forked_onto_a_second_stream_allocates_on_both():
    """A capture that forks onto a side stream (as overlapped branches do): requests on the
    side stream belong to the same capture, come from its pool, and the replay computes what
    eager code computes. Intermediates freed inside count as reserved, not allocated."""
    body = with_model(
        """
        a = torch.randn(64, 1024, device="cuda")
        b = torch.randn(64, 1024, device="cuda")
        side = torch.cuda.Stream()
        def branches():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            y1 = model(a)
            with torch.cuda.stream(side):
                y2 = model(b) * 2
            cur.wait_stream(side)
            return y1 + y2
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(warm):
            for _ in range(3):
                branches()
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            out = branches()
        torch.cuda.synchronize()
        held = moonbright.graph_pool_free() if MB else (0, 0)
        grown = torch.cuda.memory_allocated() - allocated
        diffs = []
        for _ in range(4):
            a.copy_(torch.randn_like(a)); b.copy_(torch.randn_like(b))
            g.replay()
            with torch.no_grad():
                diffs.append((out - (model(a) + model(b) * 2)).abs().max().item())
        torch.cuda.synchronize()
        del g, out
        torch.cuda.synchronize()
        print(json.dumps({"max_diff": max(diffs), "held": list(held), "grown": grown,
                          "after": list(moonbright.graph_pool_free()) if MB else None}))
        """
    )
    out = run(body)
    assert out["max_diff"] < 1e-4, out
    assert out["held"][0] > 0, f"intermediates of both streams stay the pool's: {out}"
    assert out["after"] == [0, 0], out
    # Allocated grows by the output and cuBLAS's workspaces, not by the freed intermediates:
    # as much as under PyTorch's allocator.
    control = run_mode(body, "pytorch")
    assert control["max_diff"] < 1e-4, control
    assert abs(out["grown"] - control["grown"]) < 1 << 20, (out, control)


def test_with_captures_announced_graphs_capture_and_eager_requests_ask_nothing():
    """Option captures_announced (on under enable()): streams are checked for a capture only while
    torch.cuda.CUDAGraph has one in progress. The graph still allocates from its pool and
    replays right; eager requests outside it make no capture query."""
    body = with_model(
        """
        def queries():
            return moonbright.memory_stats()["moonbright.driver_calls.stream_is_capturing"]
        static_in = torch.randn(64, 1024, device="cuda")
        with torch.no_grad():
            model(static_in)
        torch.cuda.synchronize()
        before = queries()
        for _ in range(1000):
            t = torch.empty(4096, device="cuda")
            del t
        eager = queries() - before
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            static_out = model(static_in)
        in_capture = queries() - before - eager
        held = moonbright.graph_pool_free()
        x = torch.randn(64, 1024, device="cuda")
        static_in.copy_(x)
        g.replay()
        with torch.no_grad():
            diff = (static_out - model(x)).abs().max().item()
        torch.cuda.synchronize()
        print(json.dumps({"eager": eager, "in_capture": in_capture, "held": list(held),
                          "diff": diff}))
        """
    )
    out = run(body)  # enable() announces captures unless told otherwise
    assert out["eager"] == 0, out
    assert out["in_capture"] > 0 and out["held"][0] > 0, out
    assert out["diff"] < 1e-4, out
    checked = run(body, conf="captures_announced:false")
    assert checked["eager"] >= 2000, f"then every request and free asks: {checked}"


def test_graphs_sharing_a_pool_reuse_its_memory():
    """vLLM captures one graph per batch size, largest first, into one pool."""
    out = run(
        with_model(
            """
        pool = torch.cuda.graph_pool_handle()
        graphs, ins, outs, reserved = {}, {}, {}, []
        s = torch.cuda.Stream()  # one warm-up stream: cuBLAS keeps a workspace for each
        with torch.no_grad():
            for n in (256, 128, 64, 32, 16, 8):
                ins[n] = torch.randn(n, 1024, device="cuda")
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    model(ins[n])
                torch.cuda.current_stream().wait_stream(s)
                graphs[n] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[n], pool=pool):
                    outs[n] = model(ins[n])
                reserved.append(torch.cuda.memory_reserved())
            ok = True
            for n in graphs:
                x = torch.randn(n, 1024, device="cuda")
                ins[n].copy_(x)
                graphs[n].replay()
                ok &= bool(torch.allclose(outs[n], model(x), rtol=1e-4, atol=1e-4))
        torch.cuda.synchronize()
        keys_live = len(moonbright.torch._graph_pool_keys["keys"]) if MB else None
        del graphs, outs
        torch.cuda.synchronize()
        # Graphs captured and dropped one after another, each into a fresh pool, and pairs
        # sharing one (pool=g.pool()): none leaves its pool's key behind.
        torch.set_grad_enabled(False)
        for i in range(50):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = model(ins[8])
            if i % 2:
                h = torch.cuda.CUDAGraph()
                with torch.cuda.graph(h, pool=g.pool()):
                    z = model(ins[8])
                del h, z
            del g, y
        mbk = moonbright.torch._graph_pool_keys if MB else {"keys": [], "users": []}
        print(json.dumps({"ok": ok, "reserved": reserved,
                          "after": list(moonbright.graph_pool_free()) if MB else None,
                          "keys_live": keys_live, "keys_after": len(mbk["keys"]),
                          "users_after": len(mbk["users"])}))
        """
        )
    )
    assert out["ok"], out
    first, last = out["reserved"][0], out["reserved"][-1]
    assert last - first < 16 << 20, f"smaller captures should reuse the pool: {out}"
    assert out["after"] == [0, 0], out
    assert out["keys_live"] == 1, out  # the six graphs share one pool while they live
    assert out["keys_after"] == 0 and out["users_after"] == 0, out


def test_make_graphed_callables_trains_as_under_pytorchs_allocator():
    """The graphed module's losses, step by step, are those the same module graphed under
    PyTorch's own allocator gives (a forward and a backward graph sharing one pool)."""
    code = """
        import json, sys, torch, moonbright
        if sys.argv[1] == "moonbright":
            import moonbright.torch
            moonbright.torch.enable()
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)
        ).cuda()
        data = [torch.randn(32, 512, device="cuda") for _ in range(8)]
        m = torch.cuda.make_graphed_callables(m, (torch.randn(32, 512, device="cuda"),))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for x in data:
            opt.zero_grad(set_to_none=False)
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        held = list(moonbright.graph_pool_free()) if sys.argv[1] == "moonbright" else None
        print(json.dumps({"losses": losses, "held": held}))
        """
    ours = run_mode(code, "moonbright")
    theirs = run_mode(code, "pytorch")
    assert ours["losses"] == theirs["losses"], (ours, theirs)


def run_mode(code, mode):
    import json, os, subprocess, sys

    env = {**os.environ, "MOONBRIGHT_ALLOC_CONF": "", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), mode],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, f"{mode}:\n{r.stdout}\n{r.stderr}"
    return json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
