"""Sleep and wake on a GPU under moonbright.torch.enable() (run on the GPU machine:
python3 -m pytest python/tests/gpu/test_sleep_gpu.py -x -q).

MoonBright becomes PyTorch's allocator for a whole process, so each scenario runs in a fresh
Python process and prints a JSON line (see test_torch_gpu.py). Skipped without PyTorch or a CUDA
device; the Hugging Face test also without transformers.
"""

import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_torch_gpu import run  # noqa: E402

MIB = 1 << 20

PRELUDE = """
import json, os, torch, moonbright, moonbright.torch
moonbright.torch.enable()

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

def free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]
"""


def script(*parts):
    """PRELUDE and the scenario's parts, each dedented on its own, as one program."""
    return "\n".join(textwrap.dedent(p) for p in (PRELUDE, *parts))


# Device and host memory after 100 cycles, against the figures after the first cycle (which sets
# up the pinned pool that later cycles reuse): 32 MiB of device memory and 64 MiB of host memory.
# A leak of anything per cycle grows linearly: over 100 cycles these bounds catch a device leak
# of 320 KiB a cycle (less than one 2 MiB page) and a host leak of 640 KiB a cycle (a thousandth
# of the 512 MiB backup), while leaving room for what neither MoonBright nor the test holds: the
# driver's own page tables and bookkeeping, and the host allocator's arenas.
DEVICE_SLACK = 32 * MIB
HOST_SLACK = 64 * MIB
# Where free memory is compared, the background mapper keeps no window of pages mapped ahead of
# need: the window's size follows demand (up to 1 GiB) and would move the figures by itself.
NO_WINDOW = "prefetch_window_max:0"


def test_a_hundred_cycles_give_device_and_host_memory_back_to_their_start():
    r = run(script("""
        with moonbright.tag("weights"):
            weights = [torch.randn(16 << 20, device="cuda") for _ in range(8)]  # 8 x 64 MiB
        with moonbright.tag("kv"):
            kv = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        ref = [w.clone() for w in weights]
        held = sum(w.numel() * 4 for w in weights) + kv.numel()
        rss_before_first = rss()

        def cycle(i):
            awake = free()
            moonbright.sleep("weights", backup=True)
            moonbright.sleep("kv", backup=False)
            freed = free() - awake
            moonbright.wake(["weights", "kv"])
            kv.fill_(i & 0xFF)
            return freed

        # The fill's kernel loads lazily, into device memory of the driver's, at its first
        # launch: launch it once before any figure is taken.
        kv.fill_(0)
        freed = [cycle(0)]
        torch.cuda.empty_cache()
        free0, rss0 = free(), rss()
        frees, rsss = [], []
        for i in range(1, 101):
            freed.append(cycle(i))
            frees.append(free())
            rsss.append(rss())
        print(json.dumps({
            "held": held, "freed_min": min(freed),
            "free0": free0, "free_min": min(frees), "free_last": frees[-1],
            "rss_before_first": rss_before_first, "rss0": rss0, "rss_max": max(rsss),
            "rss_last": rsss[-1],
            "intact": all(torch.equal(w, x) for w, x in zip(weights, ref)),
            "tags": moonbright.tags(),
        }))
        """), conf=NO_WINDOW)
    assert r["intact"], r
    # Asleep, the tags' memory is free on the device, to within 1%, in every cycle.
    assert r["freed_min"] >= 0.99 * r["held"], r
    assert r["free0"] - r["free_min"] <= DEVICE_SLACK, r
    assert r["rss_max"] - r["rss0"] <= HOST_SLACK, r
    assert not r["tags"]["weights"]["asleep"] and not r["tags"]["kv"]["asleep"]


def test_sleep_issued_while_kernels_still_write_keeps_what_they_wrote():
    r = run(script("""
        n = 64 << 20  # 256 MiB of float32
        out = {}
        for case in ("same stream", "side stream, record_stream"):
            tag = case.replace(" ", "-").replace(",", "")
            with moonbright.tag(tag):
                x = torch.arange(n, device="cuda", dtype=torch.float32).remainder_(1000)
            torch.cuda.synchronize()
            stream = torch.cuda.current_stream()
            if case.startswith("side"):
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                x.record_stream(stream)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1_000_000_000)  # about half a second: the writes queue behind
                for k in range(1, 21):
                    x.add_(k)  # exact in float32: the values stay below 2^24
                done = torch.cuda.Event()
                done.record(stream)
            pending = not done.query()
            moonbright.sleep(tag, backup=True)
            asleep = moonbright.tags()[tag]["asleep"]
            moonbright.wake(tag)
            expected = torch.arange(n, device="cuda", dtype=torch.float32).remainder_(1000) + 210
            out[case] = {"pending": pending, "asleep": asleep, "equal": torch.equal(x, expected)}
            del x, expected
        print(json.dumps(out))
        """))
    for case, c in r.items():
        assert c["pending"], f"{case}: the writes had finished before sleep was called: {r}"
        assert c["asleep"] and c["equal"], (case, r)


def test_a_llama_generates_the_same_tokens_after_sleep_and_wake():
    pytest.importorskip("transformers")
    r = run(script("""
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        cfg = LlamaConfig(
            vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
            attn_implementation="eager",
        )
        with moonbright.tag("weights"):
            model = LlamaForCausalLM(cfg).cuda().eval()
        ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
        with torch.no_grad():
            model(ids)  # PyTorch's lazily made workspaces: untagged, awake throughout

        def generate():
            with torch.no_grad(), moonbright.tag("kv"):
                out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0,
                                     return_dict_in_generate=True)
            return out.sequences.tolist(), out.past_key_values

        before, cache = generate()  # the cache keeps its KV tensors, tagged "kv", alive
        tags_awake = moonbright.tags()
        slept = [moonbright.sleep("weights", backup=True), moonbright.sleep("kv", backup=False)]
        tags_asleep = moonbright.tags()
        woke = moonbright.wake(["weights", "kv"])
        after, cache2 = generate()
        del cache, cache2
        print(json.dumps({
            "before": before, "after": after, "awake": tags_awake, "asleep": tags_asleep,
            "slept": slept, "woke": woke,
        }))
        """))
    assert r["before"] == r["after"]
    assert r["awake"]["kv"]["bytes"] > 0 and r["awake"]["weights"]["bytes"] > 0, r["awake"]
    assert r["asleep"]["weights"]["asleep"] and r["asleep"]["weights"]["backed_up"]
    assert r["asleep"]["kv"]["asleep"] and not r["asleep"]["kv"]["backed_up"]
    assert r["slept"][0]["backed_up"] > 0 and r["slept"][1]["backed_up"] == 0, r["slept"]


GRAPH_MODEL = """
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
with moonbright.tag("weights"):
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024),
    ).cuda().eval()
static_in = torch.randn(64, 1024, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.no_grad(), torch.cuda.stream(side):
    for _ in range(3):
        model(static_in)
torch.cuda.current_stream().wait_stream(side)
"""


def test_a_cuda_graph_captured_before_sleep_replays_the_same_after_wake():
    r = run(script(GRAPH_MODEL, """
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            static_out = model(static_in)
        g.replay()
        before = static_out.clone()
        moonbright.sleep("weights", backup=True)
        moonbright.wake("weights")
        g.replay()
        after = static_out.clone()
        static_in.copy_(torch.randn(64, 1024, device="cuda"))
        g.replay()
        with torch.no_grad():
            eager = model(static_in)
        print(json.dumps({
            "same": torch.equal(before, after),
            "matches_eager": torch.allclose(static_out, eager, rtol=1e-5, atol=1e-5),
        }))
        """))
    assert r["same"] and r["matches_eager"], r


def test_a_graphs_own_memory_sleeps_with_the_torch_memory_saver_adapter():
    # torch_memory_saver's cuda_graph: the graph's intermediate tensors (its graph pool) carry a
    # tag and are discarded at pause, as the weights are backed up; a replay after resume
    # recomputes them.
    r = run(script(GRAPH_MODEL, """
        from moonbright.compat.torch_memory_saver import torch_memory_saver as tms
        with tms.region(tag="weights", enable_cpu_backup=True):
            pass  # the weights' tag, allocated above, is backed up at pause
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), tms.cuda_graph(g, tag="graph"):
            static_out = model(static_in)
        g.replay()
        before = static_out.clone()
        graph_bytes = moonbright.tags().get("graph", {}).get("bytes", 0)
        paused = tms.pause()
        asleep = {t: s["asleep"] for t, s in moonbright.tags().items() if t in ("weights", "graph")}
        tms.resume()
        g.replay()
        print(json.dumps({
            "same": torch.equal(before, static_out), "graph_bytes": graph_bytes,
            "paused": paused, "asleep": asleep,
        }))
        """))
    assert r["graph_bytes"] > 0, r
    assert r["asleep"] == {"weights": True, "graph": True}, r
    assert r["same"], r


# MODE and ADAPTER are set in front of it.
ADAPTERS = """
import json, torch, moonbright
if MODE == "global":
    import moonbright.torch
    moonbright.torch.enable()
if ADAPTER == "vllm":
    from moonbright.compat.vllm import CuMemAllocator
    a = CuMemAllocator.get_instance()
    weights_scope, kv_scope = a.use_memory_pool("weights"), a.use_memory_pool("kv")
    sleep, wake = (lambda: a.sleep(offload_tags=("weights",))), a.wake_up
else:
    from moonbright.compat.torch_memory_saver import torch_memory_saver as a
    weights_scope = a.region(tag="weights", enable_cpu_backup=True)
    kv_scope = a.region(tag="kv")
    sleep, wake = a.pause, a.resume

def free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]

with weights_scope:
    w = torch.randn(64 << 20, device="cuda")  # 256 MiB
with kv_scope:
    kv = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
ref = w.clone()
torch.cuda.synchronize()
awake = free()
slept = sleep()
asleep = free()
tags = moonbright.tags()
woke = wake()
kv.fill_(3)
print(json.dumps({
    "held": w.numel() * 4 + kv.numel(), "released": asleep - awake, "slept": slept,
    "woke": woke, "tags": tags, "equal": torch.equal(w, ref), "kv": int(kv.sum()),
}))
"""


@pytest.mark.parametrize("mode,adapter", [("global", "tms"), ("pool", "vllm"),
                                          ("global", "vllm"), ("pool", "tms")])
def test_the_adapters_in_each_torch_mode(mode, adapter):
    # global: moonbright.torch.enable(), scopes only tag; pool: PyTorch's allocator stays, and
    # each tag's tensors come from a MoonBright pool of its own.
    r = run(f"MODE, ADAPTER = {mode!r}, {adapter!r}\n" + ADAPTERS, conf=NO_WINDOW)
    assert r["tags"]["weights"]["asleep"] and r["tags"]["weights"]["backed_up"], r
    assert r["tags"]["kv"]["asleep"] and not r["tags"]["kv"]["backed_up"], r
    assert r["slept"]["backed_up"] == 256 * MIB, r
    assert r["released"] >= 0.99 * r["held"], r
    assert r["woke"]["restored"] == 256 * MIB, r
    assert r["equal"] and r["kv"] == 3 * (256 << 20), r


def test_a_wake_refused_under_the_cap_leaves_the_tag_asleep_until_the_cap_allows_it():
    r = run(script("""
        with moonbright.tag("weights"):
            w = torch.randn(64 << 20, device="cuda")  # 256 MiB
        ref = w.clone()
        size = w.numel() * 4
        torch.cuda.empty_cache()
        reserved = lambda: moonbright.memory_stats()["reserved_bytes.all.current"]
        held_awake = reserved()
        moonbright.sleep("weights", backup=True)
        torch.cuda.empty_cache()
        held_asleep = reserved()
        cap = moonbright.cap()
        # Room for half the tag: the wake must get all of it or nothing.
        moonbright.set_cap(held_asleep + size // 2)
        free_before = free()
        error = None
        try:
            moonbright.wake("weights")
        except MemoryError as e:
            error = [type(e).__name__, str(e)]
        torch.cuda.empty_cache()  # what the refused wake created may stay cached: give it back
        after_refusal = {
            "asleep": moonbright.tags()["weights"]["asleep"],
            "backed_up": moonbright.tags()["weights"]["backed_up"],
            "reserved": reserved(), "free": free(),
        }
        moonbright.set_cap(cap)
        woke = moonbright.wake("weights")
        print(json.dumps({
            "size": size, "held_awake": held_awake, "held_asleep": held_asleep,
            "free_before": free_before, "error": error, "after_refusal": after_refusal,
            "woke": woke, "equal": torch.equal(w, ref),
        }))
        """), conf=NO_WINDOW)
    assert r["held_awake"] - r["held_asleep"] >= r["size"], r
    assert r["error"] is not None, r
    a = r["after_refusal"]
    assert a["asleep"] and a["backed_up"], r
    # Nothing of the refused wake stays held once the cache is emptied.
    assert a["reserved"] <= r["held_asleep"], r
    assert abs(a["free"] - r["free_before"]) <= DEVICE_SLACK, r
    assert r["woke"]["restored"] == r["size"] and r["equal"], r
