"""CPU tests of the drop-in adapters (moonbright.compat) on the host backend: torch_memory_saver's
shape and vLLM CuMemAllocator's, over moonbright.tag, sleep and wake.

Without PyTorch the adapters' scopes only tag, and the tests allocate through the extension's C
entry points (the ``lib`` fixture) and read and write bytes with ``_read``/``_write``. Every test
uses tags of its own and frees what it allocated awake, since the allocator and its tags live as
long as the process.
"""

import random

import pytest

import moonbright
from moonbright.compat import _scope
from moonbright.compat.torch_memory_saver import TorchMemorySaver, torch_memory_saver
from moonbright.compat.vllm import CuMemAllocator

PAGE = 64 << 10


def pattern(size, seed):
    return random.Random(seed).randbytes(size)


class Allocs:
    """Allocations through the C entry points, each with the bytes written into it (or None)."""

    def __init__(self, lib):
        self.lib = lib
        self.live = {}

    def new(self, size, seed=None):
        p = self.lib.moonbright_alloc(size, 0, None)
        assert p, moonbright.last_error()
        self.live[p] = (size, None)
        if seed is not None:
            self.write(p, seed)
        return p

    def write(self, p, seed):
        size, _ = self.live[p]
        data = pattern(size, seed)
        moonbright._moonbright._write(p, data)
        self.live[p] = (size, data)

    def intact(self, p):
        size, data = self.live[p]
        return moonbright._moonbright._read(p, size) == data

    def free(self, p):
        size, _ = self.live.pop(p)
        self.lib.moonbright_free(p, size, 0, None)

    def free_all(self):
        for p in list(self.live):
            self.free(p)


@pytest.fixture
def allocs(lib):
    a = Allocs(lib)
    yield a
    a.free_all()
    moonbright.check_invariants()


def state(tag):
    return moonbright.tags().get(tag)


def reserved():
    return moonbright.memory_stats()["reserved_bytes.all.current"]


# ---- torch_memory_saver's shape -------------------------------------------------------------


def test_tms_pause_backs_up_the_backup_regions_and_discards_the_rest(allocs):
    saver = TorchMemorySaver()
    with saver.region(tag="tms1-w", enable_cpu_backup=True):
        w = allocs.new(3 * PAGE, seed=1)
    with saver.region(tag="tms1-kv"):
        kv = allocs.new(2 * PAGE, seed=2)
    untagged = allocs.new(PAGE, seed=3)
    assert state("tms1-w")["bytes"] == 3 * PAGE and state("tms1-kv")["bytes"] == 2 * PAGE
    assert not state("tms1-w")["asleep"]
    moonbright.empty_cache()
    held = reserved()

    r = saver.pause()
    assert r["bytes"] == 5 * PAGE and r["backed_up"] == 3 * PAGE, r
    assert r["seconds"] >= 0
    assert state("tms1-w")["asleep"] and state("tms1-w")["backed_up"]
    assert state("tms1-kv")["asleep"] and not state("tms1-kv")["backed_up"]
    # The physical memory went back; untagged memory stayed.
    moonbright.empty_cache()
    assert reserved() <= held - 5 * PAGE
    assert allocs.intact(untagged)

    r = saver.resume()
    assert r["bytes"] == 5 * PAGE and r["restored"] == 3 * PAGE, r
    assert not state("tms1-w")["asleep"] and not state("tms1-kv")["asleep"]
    assert allocs.intact(w) and allocs.intact(untagged)
    moonbright._moonbright._write(kv, b"usable again")
    assert moonbright._moonbright._read(kv, 12) == b"usable again"


def test_tms_pause_and_resume_one_tag_and_the_errors_of_a_wrong_state(allocs):
    saver = TorchMemorySaver()
    with saver.region(tag="tms2-a", enable_cpu_backup=True):
        a = allocs.new(PAGE, seed=4)
    with saver.region(tag="tms2-b", enable_cpu_backup=True):
        b = allocs.new(2 * PAGE, seed=5)

    assert saver.pause("tms2-a")["bytes"] == PAGE
    assert state("tms2-a")["asleep"] and not state("tms2-b")["asleep"]
    with pytest.raises(RuntimeError):
        saver.pause("tms2-a")  # torch_memory_saver exits the process here
    with pytest.raises(RuntimeError):
        saver.resume("tms2-b")
    with pytest.raises(RuntimeError, match="asleep"):
        with saver.region(tag="tms2-a"):
            pass
    # Without a tag: every awake tag, then every paused one.
    assert saver.pause()["bytes"] == 2 * PAGE
    assert state("tms2-b")["asleep"]
    assert saver.resume()["bytes"] == 3 * PAGE
    assert allocs.intact(a) and allocs.intact(b)
    assert saver.resume()["bytes"] == 0


def test_tms_a_tag_is_backed_up_if_any_of_its_regions_asked(allocs):
    saver = TorchMemorySaver()
    with saver.region(tag="tms3"):
        x = allocs.new(PAGE, seed=6)
    with saver.region(tag="tms3", enable_cpu_backup=True):
        y = allocs.new(PAGE, seed=7)
    r = saver.pause("tms3")
    assert r["backed_up"] == 2 * PAGE, r
    saver.resume("tms3")
    assert allocs.intact(x) and allocs.intact(y)


def test_tms_unknown_and_empty_tags_are_left_alone(allocs):
    saver = TorchMemorySaver()
    assert saver.pause("tms4-never")["bytes"] == 0
    assert saver.resume("tms4-never")["bytes"] == 0
    with saver.region(tag="tms4-empty"):
        pass
    with saver.region(tag="tms4-full"):
        allocs.new(PAGE)
    assert saver.pause()["bytes"] == PAGE
    # A tag with no memory was not put to sleep: it still takes allocations.
    with saver.region(tag="tms4-empty"):
        e = allocs.new(PAGE, seed=8)
    assert state("tms4-empty")["bytes"] == PAGE and not state("tms4-empty")["asleep"]
    assert saver.resume()["bytes"] == PAGE
    assert allocs.intact(e)


def test_tms_regions_nest_and_restore_the_outer_tag(allocs):
    saver = TorchMemorySaver()
    with saver.region(tag="tms5-outer"):
        with saver.region(tag="tms5-inner"):
            allocs.new(2 * PAGE)
            with saver.disable():
                allocs.new(PAGE)  # untagged
        allocs.new(3 * PAGE)
    allocs.new(PAGE)  # untagged
    assert state("tms5-inner")["bytes"] == 2 * PAGE
    assert state("tms5-outer")["bytes"] == 3 * PAGE


def test_tms_shape():
    assert isinstance(torch_memory_saver, TorchMemorySaver)
    saver = TorchMemorySaver()
    assert saver.enabled is True
    saver.hook_mode = "torch"
    saver.hook_mode = "preload"
    with pytest.raises(AttributeError):
        saver.hook_mode
    with pytest.raises(ValueError):
        saver.hook_mode = "ptrace"
    with pytest.raises(NotImplementedError):
        with saver.region(tag="tms6", enable_disk_backup=True):
            pass
    with pytest.raises(ValueError):
        with saver.region(tag="tms6", cpu_backup_backend="pinned"):
            pass
    with pytest.raises(ValueError):
        with saver.region(tag="tms6", enable_cpu_backup=True, cpu_backup_backend="disk"):
            pass
    with saver.region(tag="tms6", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        pass
    # A CUDA graph needs PyTorch on MoonBright's memory.
    with pytest.raises(RuntimeError, match="enable"):
        with saver.cuda_graph(object(), tag="tms6"):
            pass


def test_tms_resume_that_cannot_get_its_memory_leaves_the_tag_paused(allocs):
    saver = TorchMemorySaver()
    size = 8 * PAGE
    with saver.region(tag="tms7", enable_cpu_backup=True):
        t = allocs.new(size, seed=9)
    saver.pause("tms7")
    moonbright.empty_cache()
    # Leave one page less free under the cap than the tag needs.
    filler = allocs.new(moonbright.cap() - reserved() - size + PAGE)
    with pytest.raises(MemoryError):
        saver.resume("tms7")
    assert state("tms7")["asleep"] and state("tms7")["backed_up"]
    moonbright.check_invariants()
    allocs.free(filler)
    assert saver.resume("tms7")["restored"] == size
    assert allocs.intact(t)


# ---- vLLM CuMemAllocator's shape ------------------------------------------------------------


@pytest.fixture
def cumem():
    """A fresh singleton, so that no other test's tags are in it."""
    CuMemAllocator.instance = None
    a = CuMemAllocator.get_instance()
    yield a
    CuMemAllocator.instance = None


def test_vllm_sleep_offloads_the_offload_tags_and_discards_the_others(allocs, cumem):
    assert CuMemAllocator.get_instance() is cumem
    assert cumem.current_tag == "default"
    with cumem.use_memory_pool(tag="vllm1-weights"):
        assert cumem.current_tag == "vllm1-weights"
        w = allocs.new(4 * PAGE, seed=10)
    assert cumem.current_tag == "default"
    with cumem.use_memory_pool(tag="vllm1-kv"):
        kv = allocs.new(2 * PAGE, seed=11)
    outside = allocs.new(PAGE, seed=12)
    assert cumem.get_current_usage() == 6 * PAGE

    r = cumem.sleep(offload_tags=("vllm1-weights",))
    assert r["bytes"] == 6 * PAGE and r["backed_up"] == 4 * PAGE, r
    assert state("vllm1-weights")["asleep"] and state("vllm1-kv")["asleep"]
    assert not state("vllm1-kv")["backed_up"]
    assert cumem.get_current_usage() == 6 * PAGE  # asleep bytes still count, as in vLLM
    assert allocs.intact(outside)

    r = cumem.wake_up(tags=["vllm1-weights"])
    assert r["restored"] == 4 * PAGE
    assert not state("vllm1-weights")["asleep"] and state("vllm1-kv")["asleep"]
    assert allocs.intact(w)
    r = cumem.wake_up()
    assert r["bytes"] == 2 * PAGE and r["restored"] == 0
    assert not state("vllm1-kv")["asleep"]
    moonbright._moonbright._write(kv, b"kv again")


def test_vllm_default_tag_is_offloaded_by_default(allocs, cumem):
    with cumem.use_memory_pool():
        d = allocs.new(2 * PAGE, seed=13)
    assert state("default")["bytes"] == 2 * PAGE
    r = cumem.sleep()
    assert r["backed_up"] == 2 * PAGE
    cumem.wake_up()
    assert allocs.intact(d)


def test_vllm_offload_tags_as_a_string_or_a_list(allocs, cumem):
    with cumem.use_memory_pool("vllm3-a"):
        a = allocs.new(PAGE, seed=14)
    with cumem.use_memory_pool("vllm3-b"):
        b = allocs.new(PAGE, seed=15)
    assert cumem.sleep("vllm3-a")["backed_up"] == PAGE
    cumem.wake_up()
    assert allocs.intact(a)
    allocs.write(b, seed=15)  # it was discarded
    assert cumem.sleep(["vllm3-a", "vllm3-b"])["backed_up"] == 2 * PAGE
    cumem.wake_up("vllm3-b")
    assert state("vllm3-a")["asleep"] and not state("vllm3-b")["asleep"]
    cumem.wake_up()
    assert allocs.intact(a) and allocs.intact(b)


def test_vllm_repeated_calls_are_harmless_and_sleeping_tags_refuse_allocations(allocs, cumem):
    with cumem.use_memory_pool("vllm4"):
        x = allocs.new(PAGE, seed=16)
    cumem.sleep(offload_tags="vllm4")
    assert cumem.sleep(offload_tags="vllm4")["bytes"] == 0
    with pytest.raises(RuntimeError, match="asleep"):
        with cumem.use_memory_pool("vllm4"):
            pass
    assert cumem.current_tag == "default"
    assert cumem.wake_up(["vllm4-unknown"])["bytes"] == 0
    cumem.wake_up(["vllm4"])
    assert cumem.wake_up(["vllm4"])["bytes"] == 0
    assert allocs.intact(x)
    with pytest.raises(TypeError):
        with cumem.use_memory_pool(3):
            pass


def test_vllm_wake_that_cannot_get_its_memory_leaves_the_tag_asleep(allocs, cumem):
    size = 8 * PAGE
    with cumem.use_memory_pool("vllm5"):
        t = allocs.new(size, seed=17)
    cumem.sleep(offload_tags=("vllm5",))
    moonbright.empty_cache()
    filler = allocs.new(moonbright.cap() - reserved() - size + PAGE)
    with pytest.raises(MemoryError):
        cumem.wake_up()
    assert state("vllm5")["asleep"]
    allocs.free(filler)
    cumem.wake_up()
    assert allocs.intact(t)


def test_results_of_several_calls_are_summed():
    r = _scope.sum_results(
        [
            {"bytes": 2, "released": 2, "backed_up": 1, "seconds": 0.5},
            {"bytes": 3, "released": 1, "backed_up": 0, "seconds": 0.25},
        ],
        _scope.SLEEP_KEYS,
    )
    assert r == {"bytes": 5, "released": 3, "backed_up": 1, "seconds": 0.75}
    assert _scope.sum_results([], _scope.WAKE_KEYS) == {
        "bytes": 0, "created": 0, "restored": 0, "seconds": 0.0
    }
