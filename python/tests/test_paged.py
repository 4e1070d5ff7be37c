"""The paged pool on the host backend: tables seen as arrays without copies, a decode loop
checked against a Python model, copy-on-write, and every bad request refused with its
exception and no change."""

import numpy as np
import pytest

import moonbright
from moonbright.paged import (
    CapacityError,
    FreedSequenceError,
    InvalidRequestError,
    PagedKVPool,
    UnknownSequenceError,
)


def make(**kw):
    args = dict(tokens_per_page=4, bytes_per_token=8, max_pages=64, max_seqs=8, max_pages_per_seq=8)
    args.update(kw)
    return PagedKVPool(**args)


def as_np(t):
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


def expected_slots(pool, runs):
    out = []
    for seq, start, n in runs:
        pages = pool.pages(seq)
        out += [pages[p // 4] * 4 + p % 4 for p in range(start, start + n)]
    return out


def test_tables_follow_a_decode_loop():
    assert moonbright.backend() == "host"
    pool = make()
    a = pool.add(5)
    b = pool.add(3)
    assert pool.commit() == 8
    assert list(as_np(pool.slot_mapping)) == expected_slots(pool, [(a, 0, 5), (b, 0, 3)])
    bt = as_np(pool.block_table)  # a view: it follows later steps without being fetched again
    for step in range(10):
        n = pool.decode_step()
        assert n == 2
        lens = [pool.seq_len(s) for s in (a, b)]
        assert lens == [6 + step, 4 + step]
        rows = pool.batch()
        want = [pool.pages(pool._pool.seq_at(r))[(pool.seq_len(pool._pool.seq_at(r)) - 1) // 4] * 4
                + (pool.seq_len(pool._pool.seq_at(r)) - 1) % 4 for r in rows]
        assert list(as_np(pool.slot_mapping)) == want
        for s in (a, b):
            r = pool.row(s)
            pages = pool.pages(s)
            assert list(bt[r, : len(pages)]) == pages
            assert (bt[r, len(pages):] == -1).all()
            assert as_np(pool.seq_lens)[r] == pool.seq_len(s)
    pool.check_invariants()


def test_step_equals_free_add_decode():
    """step(free, add) leaves the same tables and returns the same ids as free_many, add_many
    and decode_step; a refused step raises and leaves the pool usable."""
    one, two = make(max_seqs=8), make(max_seqs=8)
    ids_one = one.add_many([5, 2, 7])
    ids_two = two.add_many([5, 2, 7])
    one.commit(), two.commit()
    plan = [([], [3]), ([ids_one[1]], [1, 9]), ([], []), ([ids_one[0]], [])]
    for free, add in plan:
        new_two = two.step([ids_two[ids_one.index(s)] for s in free], add)
        one.free_many(free)
        new_one = one.add_many(add)
        one.decode_step()
        assert new_one == new_two
        ids_one += new_one
        ids_two += new_two
        for name in ("block_table", "seq_lens", "batch_rows", "slot_mapping"):
            assert (as_np(getattr(one, name)) == as_np(getattr(two, name))).all(), name
    with pytest.raises(FreedSequenceError):
        two.step([ids_two[0]], [])  # freed in the plan above
    two.step()
    two.check_invariants()


def test_fork_shares_pages_and_copies_on_write():
    pool = make()
    a = pool.add(6)
    pool.commit()
    kv = as_np(pool.kv_pages())
    pa = pool.pages(a)
    kv[pa[1], :] = 7  # the tokens of a's second (partial) page
    c = pool.fork(a)
    assert pool.pages(c) == pa
    pool.extend(c, 1)  # writes into the shared partial page: copied first
    pool.commit()
    pc = pool.pages(c)
    assert pc[0] == pa[0] and pc[1] != pa[1]
    assert (kv[pc[1]] == 7).all()
    pool.free(a)
    pool.free(c)
    pool.commit()
    assert pool.live_sequences() == 0


def test_bad_requests_raise_and_change_nothing():
    pool = make()
    a = pool.add(5)
    pool.commit()
    before = (pool.pages(a), pool.seq_len(a), pool.live_sequences())
    with pytest.raises(CapacityError, match="cannot grow"):
        pool.extend(a, 1000)
    with pytest.raises(UnknownSequenceError):
        pool.extend(0xDEAD << 32, 1)
    b = pool.add(1)
    pool.free(b)
    with pytest.raises(FreedSequenceError, match="double free"):
        pool.free(b)
    with pytest.raises(FreedSequenceError, match="fork"):
        pool.fork(b)
    with pytest.raises(FreedSequenceError):
        pool.extend(b, 1)
    with pytest.raises(InvalidRequestError):
        pool.truncate(a, 99)
    assert pool.commit() == 1  # b's prompt token, slot -1: b is gone
    assert list(as_np(pool.slot_mapping)) == [-1]
    assert (pool.pages(a), pool.seq_len(a), pool.live_sequences()) == before
    with pytest.raises(CapacityError):
        for _ in range(100):
            pool.add(32)
    with pytest.raises(InvalidRequestError):
        make(tokens_per_page=0)
    pool.check_invariants()
