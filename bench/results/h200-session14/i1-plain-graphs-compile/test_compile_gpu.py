"""torch.compile(mode="reduce-overhead") under moonbright.torch.enable() (run on the H200:
python3 -m pytest python/tests/gpu -x -q). enable() makes Inductor capture plain CUDA graphs
(CUDA-graph trees need allocator calls PyTorch's pluggable allocator does not forward); these
check that compiled functions are then captured into graphs, replay what eager code computes,
and train as under PyTorch's own allocator. Each scenario runs in a fresh process.
"""

import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_graphs_gpu import run_mode  # noqa: E402

PRELUDE = """
import json, sys, torch, moonbright
MB = sys.argv[1] == "moonbright"
if MB:
    import moonbright.torch
    moonbright.torch.enable()
inductor_imported_at_enable = "torch._inductor.config" in sys.modules
if sys.argv[1] == "plain":  # PyTorch's allocator, with the graphs MoonBright makes Inductor use
    import torch._inductor.config
    torch._inductor.config.triton.cudagraph_trees = False
captures = []
original_begin = torch.cuda.CUDAGraph.capture_begin
def counting_begin(self, *a, **k):
    captures.append(1)
    return original_begin(self, *a, **k)
torch.cuda.CUDAGraph.capture_begin = counting_begin
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)

def report(**kw):
    import torch._dynamo.utils as du
    import torch._inductor.config as ic
    skips = du.counters["inductor"].get("cudagraph_skips", 0)
    print(json.dumps({"captures": len(captures), "skips": skips,
                      "trees": ic.triton.cudagraph_trees,
                      "imported_at_enable": inductor_imported_at_enable,
                      "errors": moonbright.last_error(), **kw}))
"""


def both(body):
    """The scenario under MoonBright and under PyTorch's allocator, both with Inductor's plain
    CUDA graphs (so the two differ only in the allocator)."""
    code = PRELUDE + textwrap.dedent(body)
    return run_mode(code, "moonbright"), run_mode(code, "plain")


def test_reduce_overhead_inference_replays_what_eager_code_computes():
    ours, theirs = both(
        """
        model = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024),
        ).cuda().eval()
        f = torch.compile(model, mode="reduce-overhead")
        diffs, outs = [], []
        with torch.no_grad():
            for i in range(8):
                x = torch.randn(64, 1024, device="cuda")
                y = f(x).clone()
                diffs.append((y - model(x)).abs().max().item())
                outs.append(y.sum().item())
                # Other allocations between calls must not be handed the graph's memory.
                junk = [torch.full((1 << 18,), float(j), device="cuda") for j in range(16)]
                assert all(bool((t == float(j)).all()) for j, t in enumerate(junk))
        torch.cuda.synchronize()
        report(max_diff=max(diffs), outs=outs)
        """
    )
    assert not ours["imported_at_enable"], "enable() must not import Inductor"
    assert ours["trees"] is False, ours
    assert ours["captures"] >= 1 and ours["skips"] == 0, ours
    assert ours["max_diff"] < 1e-3 and theirs["max_diff"] < 1e-3, (ours, theirs)
    assert ours["outs"] == pytest.approx(theirs["outs"], rel=1e-5), (ours, theirs)


def test_reduce_overhead_training_steps_match_pytorchs_allocator():
    """A forward and a backward graph, replayed for every step of SGD: the losses are those
    of the same compiled model under PyTorch's allocator."""
    ours, theirs = both(
        """
        model = torch.nn.Sequential(
            torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512),
        ).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        f = torch.compile(model, mode="reduce-overhead")
        data = [torch.randn(32, 512, device="cuda") for _ in range(10)]
        losses = []
        for x in data:
            torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=False)
            loss = f(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        report(losses=losses)
        """
    )
    assert ours["captures"] >= 2 and ours["skips"] == 0, ours
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-4), (ours, theirs)


def test_new_shapes_and_mutated_inputs_stay_correct():
    """A second batch size captures a second graph; a function that mutates its input runs
    without a graph (Inductor's plain graphs skip it) and still computes the right thing."""
    ours, _ = both(
        """
        def g(x):
            return torch.nn.functional.silu(x @ x.T).sum(dim=1)
        def acc(buf, x):
            buf.add_(x.sum(dim=0))
            return buf * 2
        fg = torch.compile(g, mode="reduce-overhead")
        fa = torch.compile(acc, mode="reduce-overhead")
        ok = True
        for n in (16, 32, 16, 32, 48):
            x = torch.randn(n, 256, device="cuda")
            ok &= bool(torch.allclose(fg(x).clone(), g(x), rtol=1e-3, atol=1e-3))
        buf, ref = torch.zeros(256, device="cuda"), torch.zeros(256, device="cuda")
        for _ in range(4):
            x = torch.randn(8, 256, device="cuda")
            out = fa(buf, x).clone()
            expect = acc(ref, x)
            ok &= bool(torch.allclose(buf, ref, rtol=1e-4, atol=1e-4))
            ok &= bool(torch.allclose(out, expect, rtol=1e-4, atol=1e-4))
        report(ok=ok)
        """
    )
    assert ours["ok"], ours
    assert ours["captures"] >= 3, ours
