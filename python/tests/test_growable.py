"""moonbright.Growable on the host backend: growth in place with a fixed address and the bytes kept,
statistics, the array interface, bad input, release."""

import pytest

import moonbright


def test_grows_in_place_and_keeps_its_bytes():
    page = moonbright.page_size()
    g = moonbright.Growable(40 * page)
    assert g.capacity == 40 * page and g.size == 0 and g.committed == 0
    before = moonbright.memory_stats()
    g.resize(3 * page + 5)
    assert g.size == 3 * page + 5 and g.committed >= 4 * page
    data = bytes(range(256)) * 16
    moonbright._moonbright._write(g.ptr, data)
    ptr = g.ptr
    for n in (9, 17, 40):
        g.resize(n * page)
        assert g.ptr == ptr
        assert bytes(moonbright._moonbright._read(g.ptr, len(data))) == data
    stats = moonbright.memory_stats()
    assert stats["moonbright.growable_committed_bytes.current"] == 40 * page
    assert stats["moonbright.growable_resizes"] > before["moonbright.growable_resizes"]
    assert stats["allocated_bytes.all.current"] - before["allocated_bytes.all.current"] == 40 * page
    segs = [s for s in moonbright.snapshot()["segments"] if s["address"] == g.ptr]
    assert len(segs) == 1 and segs[0]["moonbright_kind"] == "growable", segs
    assert segs[0]["total_size"] == 40 * page and segs[0]["allocated_size"] == 40 * page
    g.resize(page)
    assert g.committed < 40 * page
    g.release()
    assert g.released
    assert moonbright.memory_stats()["moonbright.growable_committed_bytes.current"] == 0
    moonbright.check_invariants()


def test_array_interface_covers_the_capacity():
    page = moonbright.page_size()
    g = moonbright.Growable(5 * page + 1)
    cai = g.__cuda_array_interface__
    assert cai["shape"] == (6 * page,) and cai["typestr"] == "|u1"
    assert cai["data"] == (g.ptr, False) and cai["version"] == 3
    g.release()


def test_bad_input_is_a_clear_error_and_changes_nothing():
    page = moonbright.page_size()
    g = moonbright.Growable(4 * page)
    g.resize(page)
    with pytest.raises(ValueError, match="capacity"):
        g.resize(4 * page + 1)
    assert g.size == page
    with pytest.raises(OverflowError):
        g.resize(-1)
    with pytest.raises(MemoryError, match="out of memory"):
        big = moonbright.Growable(1 << 30)
        big.resize(1 << 30)  # the test allocator's cap is 8 MiB
    big.release()
    with pytest.raises(ValueError):
        moonbright.Growable(0)
    g.release()
    g.release()  # twice does nothing
    with pytest.raises(ValueError, match="released"):
        g.resize(page)
    with pytest.raises(ValueError, match="released"):
        _ = g.__cuda_array_interface__
    moonbright.check_invariants()
