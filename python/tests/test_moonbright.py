"""CPU tests of the moonbright package on the host backend (no GPU, no PyTorch needed)."""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import moonbright

PAGE = 64 << 10


def run_py(code, conf=None):
    env = dict(os.environ)
    env.pop("MOONBRIGHT_ALLOC_CONF", None)
    if conf is not None:
        env["MOONBRIGHT_ALLOC_CONF"] = conf
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )


def test_import_and_version():
    assert moonbright.__version__
    assert os.path.exists(moonbright.library_path())
    assert moonbright.backend() == "host"
    assert moonbright.page_size() == PAGE


def test_parse_conf_profiles():
    assert moonbright.parse_conf("")["profile"] == "balanced"
    o = moonbright.parse_conf("profile:latency")
    assert (o["profile"], o["grow_first"]) == ("latency", 0.3)
    o = moonbright.parse_conf("profile:memory,grow_first:0.1")
    assert (o["profile"], o["carve"], o["grow_first"]) == ("memory", 0.0, 0.1)
    with pytest.raises(ValueError, match="profile"):
        moonbright.parse_conf("profile:fastest")


def test_parse_conf_values_and_errors():
    o = moonbright.parse_conf("backend:host,cap:12GiB,unmap_batch:8,validate:false")
    assert o["backend"] == "host" and o["cap"] == 12 << 30 and o["unmap_batch"] == 8
    assert o["unmap_run_handles"] == 32
    assert moonbright.parse_conf("unmap_run_handles:0")["unmap_run_handles"] == 0
    assert o["reuse_addresses"] is True
    assert moonbright.parse_conf("reuse_addresses:false")["reuse_addresses"] is False
    assert o["peer_access"] is True
    assert moonbright.parse_conf("peer_access:off")["peer_access"] is False
    assert o["near_fit"] == 0.125
    assert moonbright.parse_conf("near_fit:0.25")["near_fit"] == 0.25
    assert o["carve"] == 0.0025 and o["carve_repeated"] == 0.01
    assert o["max_chunk"] == 64 << 20 and o["max_chunk_repeated"] == 0
    assert moonbright.parse_conf("max_chunk_repeated:8MiB")["max_chunk_repeated"] == 8 << 20
    with pytest.raises(ValueError, match="max_chunk_repeated"):
        moonbright.parse_conf("max_chunk_repeated:3MiB")
    assert moonbright.parse_conf("carve_repeated:0.02")["carve_repeated"] == 0.02
    assert o["grow_first"] == 0.0
    assert moonbright.parse_conf("grow_first:0.3")["grow_first"] == 0.3
    with pytest.raises(ValueError, match="grow_first"):
        moonbright.parse_conf("grow_first:11")
    with pytest.raises(ValueError, match="carve_repeated"):
        moonbright.parse_conf("carve_repeated:2")
    with pytest.raises(ValueError, match="near_fit"):
        moonbright.parse_conf("near_fit:2")
    with pytest.raises(ValueError, match="cap_fraction") as e:
        moonbright.parse_conf("cap_fraction:2")
    assert "(0, 1]" in str(e.value)
    with pytest.raises(ValueError) as e:
        moonbright.parse_conf("prefetch:3")
    msg = str(e.value)
    assert "prefetch" in msg
    for key, _ in moonbright.CONF_KEYS:
        assert key in msg


def test_configure_after_first_use_is_refused():
    moonbright.memory_stats()  # creates the allocator
    with pytest.raises(RuntimeError, match="before the first allocation"):
        moonbright.configure(cap="1GiB")


def test_configure_keywords_in_a_fresh_process():
    r = run_py(
        """
        import moonbright
        try:
            moonbright.configure(backend="host", bogus=1)
        except ValueError as e:
            print("ERR", e)
        try:
            moonbright.configure(backend="host", cap="lots")
        except ValueError as e:
            print("ERR", e)
        moonbright.configure(backend="host", host_capacity="64MiB", cap=16 << 20, validate=True)
        print("OPTS", moonbright.options()["cap"], moonbright.backend(), moonbright.cap())
        """
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "bogus" in lines[0] and "backend" in lines[0]
    assert "`cap`" in lines[1] and "GiB" in lines[1]
    assert lines[2] == f"OPTS {16 << 20} host {16 << 20}"


def test_bad_env_conf_names_the_key():
    r = run_py("import moonbright; moonbright.memory_stats()", conf="backend:host,cap:-3")
    assert r.returncode != 0
    assert "MOONBRIGHT_ALLOC_CONF" in r.stderr and "`cap`" in r.stderr


def test_stats_after_allocations_through_the_c_symbols(lib):
    before = moonbright.memory_stats()
    p = lib.moonbright_alloc(3 * PAGE, 0, None)
    q = lib.moonbright_alloc(1000, 0, None)
    assert p and q and p % 256 == 0 and q % 256 == 0
    s = moonbright.memory_stats()
    for fam in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes",
                "allocation", "active", "segment", "inactive_split_bytes", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            for k in ("current", "peak", "allocated", "freed"):
                assert isinstance(s[f"{fam}.{pool}.{k}"], int)
    for k in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
              "moonbright.rounding_waste_bytes.current", "moonbright.cache_hits",
              "moonbright.driver_calls.map", "moonbright.driver_calls.total"):
        assert k in s
    grew = s["allocated_bytes.all.current"] - before["allocated_bytes.all.current"]
    assert grew == 3 * PAGE + 1000
    assert s["requested_bytes.all.current"] == s["allocated_bytes.all.current"]
    assert s["active_bytes.all.current"] - before["active_bytes.all.current"] == 3 * PAGE + 1024
    assert s["reserved_bytes.all.current"] >= s["active_bytes.all.current"]
    assert s["allocation.all.current"] - before["allocation.all.current"] == 2
    assert s["num_device_alloc"] > before["num_device_alloc"] or s["moonbright.cache_hits"] > 0
    # where held memory went at its peak: parts that add up to it
    parts = ("requested", "rounding", "arena_free", "cached", "pending", "window", "bare", "other")
    held = s["moonbright.held_at_peak.reserved"]
    assert 0 < held <= s["reserved_bytes.all.peak"]
    assert sum(s[f"moonbright.held_at_peak.{k}"] for k in parts) == held
    # data lands where the pointer says
    moonbright._moonbright._write(p, b"moonbright")
    assert moonbright._moonbright._read(p, 10) == b"moonbright"
    lib.moonbright_free(q, 1000, 0, None)
    lib.moonbright_free(p, 3 * PAGE, 0, None)
    s2 = moonbright.memory_stats()
    assert s2["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert s2["allocated_bytes.all.freed"] - before["allocated_bytes.all.freed"] == 3 * PAGE + 1000
    moonbright.check_invariants()


def test_size_zero_and_null_free_are_no_ops(lib):
    moonbright.clear_last_error()
    assert lib.moonbright_alloc(0, 0, None) is None
    lib.moonbright_free(None, 0, 0, None)
    assert moonbright.last_error() is None


def test_reset_peak(lib):
    p = lib.moonbright_alloc(4 * PAGE, 0, None)
    lib.moonbright_free(p, 0, 0, None)
    s = moonbright.memory_stats()
    assert s["allocated_bytes.all.peak"] >= 4 * PAGE > s["allocated_bytes.all.current"]
    moonbright.reset_peak_memory_stats()
    s = moonbright.memory_stats()
    assert s["allocated_bytes.all.peak"] == s["allocated_bytes.all.current"]
    assert s["reserved_bytes.all.peak"] == s["reserved_bytes.all.current"]


def test_oom_returns_null_and_last_error_says_out_of_memory(lib):
    cap = moonbright.cap()
    held = [lib.moonbright_alloc(PAGE, 0, None) for _ in range(cap // PAGE)]
    assert all(held)
    ooms = moonbright.memory_stats()["num_ooms"]
    assert lib.moonbright_alloc(2 * PAGE, 0, None) is None
    assert "out of memory" in moonbright.last_error()
    assert moonbright.memory_stats()["num_ooms"] == ooms + 1
    assert lib.moonbright_alloc(cap * 4, 0, None) is None
    assert "larger than the cap" in moonbright.last_error()
    for p in held[::2]:
        lib.moonbright_free(p, 0, 0, None)
    # scattered pages, stitched: a request larger than any hole succeeds
    big = lib.moonbright_alloc(4 * PAGE, 0, None)
    assert big
    lib.moonbright_free(big, 0, 0, None)
    for p in held[1::2]:
        lib.moonbright_free(p, 0, 0, None)
    moonbright.check_invariants()


def test_bad_frees_do_not_crash(lib, capfd):
    moonbright.clear_last_error()
    lib.moonbright_free(0x1234, 16, 0, None)
    assert "unknown pointer" in moonbright.last_error()
    p = lib.moonbright_alloc(2 * PAGE, 0, None)
    lib.moonbright_free(p + 256, 0, 0, None)
    assert "points 256 bytes into" in moonbright.last_error()
    lib.moonbright_free(p, 0, 0, None)
    lib.moonbright_free(p, 0, 0, None)
    assert "free" in moonbright.last_error()
    lib.moonbright_free(p, 0, 99, None)  # a device out of range
    assert "device 99" in moonbright.last_error()
    assert "moonbright: free failed" in capfd.readouterr().err
    moonbright.check_invariants()


def test_negative_size_is_refused(lib):
    assert lib.moonbright_alloc(-5, 0, None) is None
    assert "negative" in moonbright.last_error()


def test_snapshot_structure(lib, tmp_path):
    moonbright.record_memory_history(True, max_entries=1000)
    p = lib.moonbright_alloc(2 * PAGE + 5, 0, None)
    q = lib.moonbright_alloc(300, 0, None)
    lib.moonbright_free(q, 0, 0, None)
    snap = moonbright.snapshot()
    assert set(snap) == {"segments", "device_traces"}
    seg = next(s for s in snap["segments"] if s["address"] == p)
    for k in ("device", "address", "total_size", "allocated_size", "active_size",
              "requested_size", "stream", "segment_type", "segment_pool_id", "is_expandable",
              "frames", "blocks"):
        assert k in seg
    assert seg["segment_type"] == "large" and seg["segment_pool_id"] == (0, 0)
    assert seg["requested_size"] == 2 * PAGE + 5
    assert seg["blocks"][0] == {"address": p, "size": 3 * PAGE, "requested_size": 2 * PAGE + 5,
                                "state": "active_allocated", "frames": []}
    trace = snap["device_traces"][0]
    actions = [e["action"] for e in trace]
    assert "alloc" in actions and "free_requested" in actions and "free_completed" in actions
    ev = next(e for e in trace if e["action"] == "alloc" and e["addr"] == p)
    assert ev["size"] == 2 * PAGE + 5 and set(ev) == {"action", "addr", "size", "stream",
                                                     "time_us", "frames"}
    path = tmp_path / "snap.pickle"
    moonbright.dump_snapshot(str(path))
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"]
    lib.moonbright_free(p, 0, 0, None)
    moonbright.record_memory_history(False)


def test_snapshot_opens_in_pytorch_memory_viz(lib):
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    moonbright.record_memory_history(True, context="all")
    try:
        ptrs = [_allocate_here(lib, n) for n in (PAGE, 3 * PAGE, 500, 7000)]
        for p in ptrs[::2]:
            _free_here(lib, p)
        snap = moonbright.snapshot()
        # The viewer's pages carry the snapshot with its frames: who allocated, who freed.
        for page in (memory_viz.segment_plot(snap), memory_viz.trace_plot(snap)):
            shown = viewer_snapshot(page)
            assert shown["device_traces"] == snap["device_traces"]
            assert shown["segments"] == snap["segments"]
        names = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
        assert {"_allocate_here", "_free_here"} <= names
        # Its flame graph of live blocks names the allocating frame.
        lines = memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
        assert "test_moonbright.py:" in lines and ":_allocate_here" in lines
        for p in ptrs[1::2]:
            lib.moonbright_free(p, 0, 0, None)
    finally:
        moonbright.record_memory_history(False)


def viewer_snapshot(page):
    """The snapshot a memory_viz HTML page hands its viewer (a base64 pickle)."""
    import base64
    import json
    import re

    files = json.loads(re.search(r'(\[\{"name": "snapshot\.pickle".*?\}\])', page).group(1))
    return pickle.loads(base64.b64decode(files[0]["base64"]))


def _allocate_here(lib, n):
    return lib.moonbright_alloc(n, 0, None)


def _free_here(lib, p):
    lib.moonbright_free(p, 0, 0, None)


def _event(snap, action, addr):
    return next(e for e in snap["device_traces"][0] if e["action"] == action and e["addr"] == addr)


def _block(snap, addr):
    return next(b for s in snap["segments"] for b in s["blocks"] if b["address"] == addr)


def test_history_with_stacks_records_python_frames(lib):
    moonbright.record_memory_history(True, context="all")
    try:
        p = _allocate_here(lib, 2 * PAGE)  # ctypes releases the GIL, as PyTorch's ops do
        snap = moonbright.snapshot()
        frames = _event(snap, "alloc", p)["frames"]
        assert [set(f) for f in frames[:1]] == [{"filename", "line", "name"}]
        names = [f["name"] for f in frames]
        assert names[0] == "_allocate_here", names
        assert "test_history_with_stacks_records_python_frames" in names
        assert frames[0]["filename"] == __file__ and frames[0]["line"] > 0
        assert _block(snap, p)["frames"] == frames, "a live block shows who allocated it"
        _free_here(lib, p)
        snap = moonbright.snapshot()
        assert _event(snap, "free_requested", p)["frames"][0]["name"] == "_free_here"

        # From another thread: that thread's frames.
        import threading

        out = []

        def worker_allocates():
            out.append(_allocate_here(lib, PAGE))

        t = threading.Thread(target=worker_allocates)
        t.start()
        t.join()
        snap = moonbright.snapshot()
        names = [f["name"] for f in _event(snap, "alloc", out[0])["frames"]]
        assert names[:2] == ["_allocate_here", "worker_allocates"], names
        assert "test_history_with_stacks_records_python_frames" not in names
        _free_here(lib, out[0])
    finally:
        moonbright.record_memory_history(False)


def test_history_context_choices(lib):
    # "alloc": frames of allocations only.
    moonbright.record_memory_history(True, context="alloc")
    try:
        p = _allocate_here(lib, PAGE)
        _free_here(lib, p)
        snap = moonbright.snapshot()
        assert _event(snap, "alloc", p)["frames"][0]["name"] == "_allocate_here"
        assert _event(snap, "free_requested", p)["frames"] == []
    finally:
        moonbright.record_memory_history(False)
    # No context: no frames, and stopping forgot the earlier ones.
    moonbright.record_memory_history(True)
    try:
        p = _allocate_here(lib, PAGE)
        snap = moonbright.snapshot()
        assert _event(snap, "alloc", p)["frames"] == []
        assert _block(snap, p)["frames"] == []
        _free_here(lib, p)
    finally:
        moonbright.record_memory_history(False)
    with pytest.raises(ValueError, match="context"):
        moonbright.record_memory_history(True, context="python")


def test_reset_accumulated_memory_stats(lib):
    p = lib.moonbright_alloc(PAGE, 0, None)
    q = lib.moonbright_alloc(300, 0, None)
    lib.moonbright_free(q, 0, 0, None)
    before = moonbright.memory_stats()
    assert before["allocation.all.allocated"] >= 2 and before["allocation.all.freed"] >= 1
    moonbright.reset_accumulated_memory_stats()
    s = moonbright.memory_stats()
    for family in ("allocated_bytes", "requested_bytes", "active_bytes", "reserved_bytes",
                   "allocation", "active", "segment"):
        assert s[f"{family}.all.allocated"] == 0 and s[f"{family}.all.freed"] == 0, family
        assert s[f"{family}.all.current"] == before[f"{family}.all.current"], family
        assert s[f"{family}.all.peak"] == before[f"{family}.all.peak"], family
    assert s["num_ooms"] == 0 and s["num_device_alloc"] == 0 and s["num_device_free"] == 0
    assert s["moonbright.driver_calls.total"] == 0
    lib.moonbright_free(p, 0, 0, None)
    s = moonbright.memory_stats()
    assert s["allocation.all.freed"] == 1 and s["allocation.all.allocated"] == 0


def test_empty_cache(lib):
    p = lib.moonbright_alloc(PAGE, 0, None)
    lib.moonbright_free(p, 0, 0, None)
    assert not hasattr(moonbright, "memory_summary"), "torch.cuda.memory_summary() is the one"
    assert moonbright.empty_cache(wait=False) >= PAGE  # nothing pending: both release it
    p = lib.moonbright_alloc(PAGE, 0, None)
    lib.moonbright_free(p, 0, 0, None)
    assert moonbright.empty_cache() >= PAGE
    assert moonbright.memory_stats()["reserved_bytes.all.current"] == 0
    nested = moonbright.memory_stats_as_nested_dict()
    assert nested["allocated_bytes"]["all"]["current"] == moonbright.memory_stats()["allocated_bytes.all.current"]
    assert nested["moonbright"]["driver_calls"]["map"] >= 1


def test_torch_module_imports_without_torch():
    import moonbright.torch as mt

    assert not mt.is_enabled()


def test_record_stream_checks_its_pointer(lib):
    p = lib.moonbright_alloc(3 * PAGE, 0, None)
    assert moonbright.record_stream(p, 0) is True
    with pytest.raises(RuntimeError, match="into the live allocation"):
        moonbright.record_stream(p + 256, 0)
    assert moonbright.record_stream(p + 256, 0, missing_ok=True) is False
    g = moonbright.Growable(4 * PAGE)
    with pytest.raises(RuntimeError, match="growable"):
        moonbright.record_stream(g.ptr, 0)
    assert moonbright.record_stream(g.ptr, 0, missing_ok=True) is False
    g.release()
    lib.moonbright_free(p, 3 * PAGE, 0, None)
    with pytest.raises(RuntimeError, match="unknown pointer"):
        moonbright.record_stream(p, 0)
    moonbright.check_invariants()


def test_graph_pool_calls_without_a_capture_are_refused():
    with pytest.raises(RuntimeError, match="not being captured"):
        moonbright.begin_graph_capture(0, (0, 1))
    with pytest.raises(RuntimeError, match="no graph capture was begun"):
        moonbright.end_graph_capture(0)
    with pytest.raises(RuntimeError, match="no graph to release"):
        moonbright.release_graph_pool((0, 1))
    moonbright.graph_replayed((0, 1), 0)
    assert moonbright.graph_pool_free() == (0, 0)
    moonbright.capture_starting()
    moonbright.capture_finished()
    moonbright.capture_finished()  # an extra finish is ignored
    moonbright.check_invariants()


def test_a_thread_routed_into_a_graph_pool_and_the_pools_live_set(lib):
    # What moonbright.torch does for PyTorch's CUDA-graph trees (torch.compile's
    # "reduce-overhead"): warm-up allocations into the trees' pool, its state read and set back.
    pool = (7, 7)
    moonbright.begin_allocate_to_pool(pool)
    with pytest.raises(RuntimeError, match="already allocates"):
        moonbright.begin_allocate_to_pool(pool)
    p = lib.moonbright_alloc(3 * PAGE, 0, None)
    q = lib.moonbright_alloc(1000, 0, None)
    assert moonbright.end_allocate_to_pool() == pool
    with pytest.raises(RuntimeError, match="does not allocate into a graph pool"):
        moonbright.end_allocate_to_pool()
    r = lib.moonbright_alloc(1000, 0, None)
    state = [ptr for ptr, _ in moonbright.graph_pool_live(pool)]
    assert state == sorted([p, q]), "the route's two blocks, not the later one"
    moonbright.free_async(q, 0)
    assert moonbright.graph_pool_free()[0] == 1
    assert moonbright.set_graph_pool_live(pool, state, 0) == ([q], [])
    assert moonbright.graph_pool_free()[0] == 0
    assert moonbright.set_graph_pool_live(pool, [p], 0) == ([], [q])
    with pytest.raises(RuntimeError, match="not a block of pool"):
        moonbright.set_graph_pool_live(pool, [p, r], 0)
    assert [ptr for ptr, _ in moonbright.graph_pool_live(pool)] == [p], "the refusal changed nothing"
    moonbright.free_async(p, 0)
    with pytest.raises(RuntimeError, match="double free"):
        moonbright.free_async(p, 0)
    moonbright.release_graph_pool(pool)  # the route was its only user: its blocks go back
    assert moonbright.graph_pool_free() == (0, 0)
    assert moonbright.graph_pool_live(pool) == []
    lib.moonbright_free(r, 1000, 0, None)
    moonbright.check_invariants()


def test_set_cap_and_memory_fraction():
    # In a process of its own: the cap outlives the test.
    r = run_py(
        """
        import moonbright
        page = moonbright.page_size()
        total = moonbright.options()["host_capacity"]
        old = moonbright.cap()
        assert moonbright.set_cap(5 * page + 1) == 5 * page
        assert moonbright.cap() == 5 * page
        assert abs(moonbright.memory_fraction() - 5 * page / total) < 1e-12
        assert moonbright.set_cap(page - 1) == 0
        assert moonbright.set_memory_fraction(0.0) == 0 and moonbright.memory_fraction() == 0.0
        assert moonbright.set_cap(5 * page) == 5 * page
        for bad in (-0.1, 1.5):
            try:
                moonbright.set_memory_fraction(bad)
                raise SystemExit(f"fraction {bad} was accepted")
            except ValueError:
                pass
        cap = moonbright.set_memory_fraction(0.5)
        assert cap == int(0.5 * total) // page * page, (cap, total)
        moonbright.check_invariants()
        print("ok")
        """,
        conf="backend:host,host_capacity:64MiB,host_page_size:64KiB",
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_enable_peer_access_on_the_host_backend(lib):
    # The host backend is device 0 and models devices 0..8, all peers of it.
    p = lib.moonbright_alloc(3 * PAGE, 0, None)
    assert p
    before = moonbright.peers()
    moonbright.enable_peer_access(3)
    moonbright.enable_peer_access(3)
    assert moonbright.peers() == sorted(set(before + [3]))
    with pytest.raises(RuntimeError, match="peer"):
        moonbright.enable_peer_access(0)
    assert moonbright.memory_stats()["moonbright.driver_calls.peer_access"] >= 2
    moonbright.check_invariants()
    lib.moonbright_free(p, 3 * PAGE, 0, None)


def test_torch_contract_fills_only_what_the_user_left_unset():
    # What moonbright.torch.enable() does to the options before the first allocator exists.
    code = """
        import moonbright
        from moonbright import _moonbright
        assert moonbright.options()["captures_announced"] is False
        assert moonbright.options()["deferred_free_events"] is False
        assert _moonbright._use_torch_contract()
        o = moonbright.options()
        print(o["captures_announced"], o["deferred_free_events"])
    """
    r = run_py(code, conf="backend:host,host_page_size:64KiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]
    # Set in MOONBRIGHT_ALLOC_CONF: kept.
    r = run_py(code.replace('assert moonbright.options()["deferred_free_events"] is False', ""),
               conf="backend:host,host_page_size:64KiB,deferred_free_events:false")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]
    # Set by configure(): kept, and the allocator is created with the rest of the contract.
    r = run_py("""
        import moonbright
        from moonbright import _moonbright
        moonbright.configure(captures_announced=False)
        assert _moonbright._use_torch_contract()
        moonbright.memory_stats()  # creates the allocator
        o = moonbright.options()
        print(o["captures_announced"], o["deferred_free_events"])
        assert not _moonbright._use_torch_contract(False)  # fixed once an allocator exists
    """, conf="backend:host,host_page_size:64KiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]
    # Turned off again (enable() failed): the defaults.
    r = run_py("""
        import moonbright
        from moonbright import _moonbright
        assert _moonbright._use_torch_contract() and _moonbright._use_torch_contract(False)
        o = moonbright.options()
        print(o["captures_announced"], o["deferred_free_events"])
    """, conf="backend:host,host_page_size:64KiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]
