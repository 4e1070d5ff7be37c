"""Tags, sleep and wake through the Python package, on the host backend (the allocator this
process's conftest configures: 64 KiB pages, an 8 MiB cap). Device addresses are host
addresses there, so ctypes reads and writes them."""

import ctypes
import threading

import pytest

import moonbright

PAGE = 64 << 10


def alloc(lib, size, name=None):
    if name is None:
        return lib.moonbright_alloc(size, 0, None)
    with moonbright.tag(name):
        return lib.moonbright_alloc(size, 0, None)


def fill(ptr, size, byte):
    ctypes.memset(ptr, byte, size)


def holds(ptr, size, byte):
    return ctypes.string_at(ptr, size) == bytes([byte]) * size


def test_tag_scopes_nest_and_are_per_thread():
    assert moonbright.current_tag() is None
    with moonbright.tag("py-outer"):
        assert moonbright.current_tag() == "py-outer"
        with moonbright.tag("py-inner"):
            assert moonbright.current_tag() == "py-inner"
            seen = []
            t = threading.Thread(target=lambda: seen.append(moonbright.current_tag()))
            t.start()
            t.join()
            assert seen == [None]
        assert moonbright.current_tag() == "py-outer"
        with moonbright.tag(None):
            assert moonbright.current_tag() is None
        assert moonbright.current_tag() == "py-outer"
    assert moonbright.current_tag() is None
    with pytest.raises(RuntimeError, match="tag"):
        with moonbright.tag(""):
            pass


def test_sleep_and_wake_keep_bytes_and_addresses(lib):
    blocks = [(alloc(lib, size, "py-weights"), size, i + 1) for i, size in
              enumerate([700, 5000, PAGE, 3 * PAGE + 100])]
    for ptr, size, byte in blocks:
        fill(ptr, size, byte)
    other = alloc(lib, 2 * PAGE)
    fill(other, 2 * PAGE, 9)
    def held():  # less the background mapper's window, which moves on its own time
        s = moonbright.memory_stats()
        return s["reserved_bytes.all.current"] - s["moonbright.window_bytes.current"]

    before = held()
    info = moonbright.tags()["py-weights"]
    assert info["allocations"] == 4 and not info["asleep"]

    slept = moonbright.sleep("py-weights")
    assert slept["backed_up"] == slept["bytes"] == slept["released"] > 0
    assert held() <= before - slept["released"]
    assert moonbright.memory_stats()["moonbright.asleep_bytes.current"] == slept["bytes"]
    assert moonbright.tags()["py-weights"]["asleep"]
    assert moonbright.host_memory() >= slept["bytes"]
    assert holds(other, 2 * PAGE, 9)

    with pytest.raises(RuntimeError, match="asleep"):
        moonbright.sleep("py-weights")
    with moonbright.tag("py-weights"):
        assert lib.moonbright_alloc(100, 0, None) is None
    assert "asleep" in moonbright.last_error()

    woke = moonbright.wake(["py-weights"])
    assert woke["restored"] == slept["bytes"]
    for ptr, size, byte in blocks:
        assert holds(ptr, size, byte)
    with pytest.raises(RuntimeError, match="awake"):
        moonbright.wake("py-weights")
    for ptr, size, _ in blocks:
        lib.moonbright_free(ptr, size, 0, None)
    lib.moonbright_free(other, 2 * PAGE, 0, None)
    moonbright.check_invariants()


def test_discarded_tags_and_a_wake_short_of_memory(lib):
    kv = alloc(lib, 4 * PAGE, "py-kv")
    slept = moonbright.sleep("py-kv", backup=False)
    assert slept["backed_up"] == 0
    # Untagged memory takes everything under the cap, what the tag gave back included.
    filler = []
    while (ptr := alloc(lib, PAGE)) is not None:
        filler.append(ptr)
    with pytest.raises(MemoryError):
        moonbright.wake("py-kv")
    assert moonbright.tags()["py-kv"]["asleep"]
    for ptr in filler:
        lib.moonbright_free(ptr, PAGE, 0, None)
    moonbright.wake("py-kv")
    fill(kv, 4 * PAGE, 3)
    assert holds(kv, 4 * PAGE, 3)
    lib.moonbright_free(kv, 4 * PAGE, 0, None)
    moonbright.empty_cache()
    moonbright.check_invariants()


def test_host_memory_is_pinned_ahead_and_given_back():
    moonbright.release_host_memory()
    held = moonbright.reserve_host_memory(1 << 20)
    assert held >= 1 << 20 and moonbright.host_memory() == held
    assert moonbright.release_host_memory() == held
    assert moonbright.host_memory() == 0
