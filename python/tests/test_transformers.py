"""moonbright.transformers.GrowableCache on the CPU, over a fake growable buffer.

The fake has moonbright.Growable's interface, backed by a preallocated CPU tensor filled with a
sentinel byte, so the tests can see what the cache wrote and where. A tiny random Llama generates
with DynamicCache and with GrowableCache; the tokens must be identical. Skipped without PyTorch
or transformers.
"""

import gc

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("numpy")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from moonbright.transformers import GrowableCache, GrowableLayer  # noqa: E402

SENTINEL = 0xA5


class FakeGrowable:
    """moonbright.Growable's interface over a CPU tensor; ``pool`` (a one-item list of free
    bytes) makes commits fail with MemoryError as a capped allocator would."""

    def __init__(self, capacity, device=None, page=4096, pool=None):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._page = page
        self._capacity = -(-capacity // page) * page  # reservations are whole pages
        self._mem = torch.full((self._capacity,), SENTINEL, dtype=torch.uint8)
        self._size = 0
        self._committed = 0
        self._pool = pool
        self.released = False
        self.resize_calls = []

    def _live(self):
        if self.released:
            raise ValueError("growable buffer already released")

    @property
    def ptr(self):
        self._live()
        return self._mem.data_ptr()

    @property
    def capacity(self):
        self._live()
        return self._capacity

    @property
    def size(self):
        self._live()
        return self._size

    @property
    def committed(self):
        self._live()
        return self._committed

    def resize(self, nbytes, stream=None):
        self._live()
        if nbytes < 0 or nbytes > self._capacity:
            raise ValueError(f"resize to {nbytes} outside 0..{self._capacity}")
        committed = -(-nbytes // self._page) * self._page
        if self._pool is not None:
            grow = committed - self._committed
            if grow > self._pool[0]:
                raise MemoryError(f"fake pool: {grow} bytes asked, {self._pool[0]} free")
            self._pool[0] -= grow
        self.resize_calls.append(nbytes)
        self._size, self._committed = nbytes, committed

    def release(self, stream=None):
        self._live()
        if self._pool is not None:
            self._pool[0] += self._committed
        self.released = True
        self._size = self._committed = 0

    @property
    def __array_interface__(self):
        self._live()
        return {"version": 3, "shape": (self._capacity,), "typestr": "|u1",
                "data": (self._mem.data_ptr(), False)}


class Factory:
    def __init__(self, pool=None, page=4096):
        self.buffers = []
        self.pool = pool
        self.page = page

    def __call__(self, capacity, device):
        assert torch.device(device).type == "cpu"
        b = FakeGrowable(capacity, page=self.page, pool=self.pool)
        self.buffers.append(b)
        return b


def tiny_model(attn="sdpa", **overrides):
    torch.manual_seed(0)
    kw = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation=attn, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kw.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**kw))
    model.eval()
    return model


def left_padded(lengths, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def generate(model, ids, mask, cache, new=10, **kw):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
            min_new_tokens=new, do_sample=False, pad_token_id=0, **kw,
        )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_tokens_match_dynamic_cache_batched_left_padded(attn):
    model = tiny_model(attn)
    ids, mask = left_padded([5, 12, 9])
    ref = generate(model, ids, mask, DynamicCache())
    factory = Factory()
    got = generate(model, ids, mask, GrowableCache(model.config, buffer_factory=factory))
    assert torch.equal(got, ref)
    assert len(factory.buffers) == 2 * model.config.num_hidden_layers


def test_gqa_attention_matches_sdpa_on_strided_views_and_falls_back_for_prefill():
    """gqa_attention against transformers' sdpa on a sequence-major cache's strided views with a
    padding mask (float32 on the CPU: equal to rounding), and the same tokens from generate."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from moonbright.transformers import gqa_attention, use_gqa_attention

    class Module(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True

    torch.manual_seed(0)
    b, kvh, s, d = 3, 2, 37, 16
    rows = torch.randn(s, b, kvh, d), torch.randn(s, b, kvh, d)
    keys, values = (r.permute(1, 2, 0, 3) for r in rows)  # GrowableCache's views
    assert not keys.is_contiguous()
    mask = (torch.arange(s)[None, :] >= torch.tensor([0, 5, 30])[:, None])[:, None, None, :]
    for q_len in (1, 3):  # 3: prefill-like, handed to sdpa
        q = torch.randn(b, kvh * 4, q_len, d)
        m = mask.expand(b, 1, q_len, s)
        got, _ = gqa_attention(Module(), q, keys, values, m, scaling=d**-0.5)
        ref, _ = sdpa_attention_forward(Module(), q, keys, values, m, scaling=d**-0.5)
        assert got.shape == ref.shape == (b, q_len, kvh * 4, d)
        assert torch.allclose(got, ref, atol=1e-5), (q_len, (got - ref).abs().max())
    model = tiny_model("sdpa")
    ids, am = left_padded([5, 12, 9])
    ref = generate(model, ids, am, DynamicCache())
    use_gqa_attention(model)
    got = generate(model, ids, am, GrowableCache(model.config, buffer_factory=Factory()))
    assert torch.equal(got, ref)


def test_beam_search_matches_dynamic_cache_and_counts_its_copies():
    model = tiny_model()
    ids, mask = left_padded([5, 12, 9])
    ref = generate(model, ids, mask, DynamicCache(), num_beams=3)
    cache = GrowableCache(model.config, buffer_factory=Factory())
    assert torch.equal(generate(model, ids, mask, cache, num_beams=3), ref)
    assert cache.kv_stats()["kv_bytes_copied"] > 0  # reordering beams moves cached tokens


def test_cache_without_config_matches_too():
    model = tiny_model()
    ids, mask = left_padded([7, 3])
    ref = generate(model, ids, mask, DynamicCache(), new=6)
    cache = GrowableCache(max_cache_len=40, buffer_factory=Factory())
    assert torch.equal(generate(model, ids, mask, cache, new=6), ref)
    assert len(cache.layers) == model.config.num_hidden_layers


def test_generate_writes_in_place_and_never_copies(monkeypatch):
    model = tiny_model()
    lengths, new = [6, 11, 2, 9], 12
    ids, mask = left_padded(lengths)
    factory = Factory(page=1024)
    cache = GrowableCache(model.config, buffer_factory=factory)
    assert cache.get_max_length() == model.config.max_position_embeddings
    seen = []  # (layer, keys ptr, values ptr, length) at every update
    update = GrowableLayer.update

    def spy(self, k, v, *a, **kw):
        keys, values = update(self, k, v, *a, **kw)
        seen.append((id(self), keys.data_ptr(), values.data_ptr(), keys.shape[2]))
        # Strided views of the sequence-major buffers, [batch, heads, seq, head_dim].
        assert keys.stride(2) == keys.shape[0] * keys.shape[1] * keys.shape[3]
        return keys, values

    monkeypatch.setattr(GrowableLayer, "update", spy)
    generate(model, ids, mask, cache, new=new)

    layers = model.config.num_hidden_layers
    assert len(factory.buffers) == 2 * layers  # created once, never replaced
    starts = {}
    for layer, kp, vp, _ in seen:
        starts.setdefault(layer, (kp, vp))
        assert (kp, vp) == starts[layer]
    assert {p for kv in starts.values() for p in kv} == {b.ptr for b in factory.buffers}

    tokens = ids.shape[1] + new - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == tokens
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    row = len(lengths) * heads * dim * 4  # float32
    s = cache.kv_stats()
    assert s["kv_bytes_copied"] == 0
    assert s["kv_bytes_written"] == 2 * layers * tokens * row
    assert s["committed_bytes"] == sum(b.committed for b in factory.buffers)
    assert s["reserved_bytes"] == 2 * layers * cache.max_tokens * row
    for b in factory.buffers:
        used = tokens * row
        assert b.committed >= used and b.committed - used < b._page
        # Resized only when the next tokens needed another page, never asking beyond them.
        lengths_seen = [n for layer, *_, n in seen if layer == id(cache.layers[0])]
        pages = [-(-n * row // b._page) for n in lengths_seen]
        assert len(b.resize_calls) == len(set(pages)) < len(lengths_seen)
        assert b.resize_calls == sorted(b.resize_calls) and b.resize_calls[-1] <= used
        # Nothing was written past the tokens in use (on a GPU that would be unmapped memory).
        assert bool((b._mem[used:] == SENTINEL).all())
    cache.release()
    assert all(b.released for b in factory.buffers)
    assert cache.kv_stats()["committed_bytes"] == 0


def test_layout_matches_dynamic_cache_contents():
    torch.manual_seed(3)
    dyn, grow = DynamicCache(), GrowableCache(max_cache_len=32, buffer_factory=Factory())
    for n in (5, 1, 1, 3):
        k, v = torch.randn(2, 3, n, 8), torch.randn(2, 3, n, 4)  # k and v head dims may differ
        a = dyn.update(k, v, 0)
        b = grow.update(k, v, 0)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    dyn.crop(-4)
    grow.crop(-4)
    assert torch.equal(dyn.layers[0].keys, grow.layers[0].keys)
    assert grow.get_seq_length() == 6 and grow.get_mask_sizes(1, 0) == (7, 0)
    idx = torch.tensor([1, 1, 0])
    dyn.batch_select_indices(idx)
    grow.batch_select_indices(idx)
    assert torch.equal(dyn.layers[0].values, grow.layers[0].values)
    dyn.batch_repeat_interleave(2)
    grow.batch_repeat_interleave(2)
    assert torch.equal(dyn.layers[0].keys, grow.layers[0].keys)
    beams = torch.tensor([5, 0, 1, 1, 2, 3])
    dyn.reorder_cache(beams)
    grow.reorder_cache(beams)
    assert torch.equal(dyn.layers[0].keys, grow.layers[0].keys)
    assert torch.equal(dyn.layers[0].values, grow.layers[0].values)
    assert grow.kv_stats()["kv_bytes_copied"] > 0  # these operations must move the cache


def test_crop_gives_pages_back_and_reset_releases():
    factory = Factory(page=256)
    cache = GrowableCache(max_cache_len=100, buffer_factory=factory)
    cache.update(torch.ones(1, 2, 50, 8), torch.ones(1, 2, 50, 8), 0)  # 64 bytes a token
    k = factory.buffers[0]
    assert k.committed == 50 * 64 + 256 - (50 * 64) % 256
    cache.crop(-40)
    assert k.committed == 768 and cache.get_seq_length() == 10  # 640 bytes, whole pages
    cache.crop(3)  # the legacy form: the length to keep
    assert cache.get_seq_length() == 3 and k.committed == 256
    cache.reset()
    assert all(b.released for b in factory.buffers)
    assert cache.get_seq_length() == 0
    # Usable again after reset, for another batch size.
    keys, _ = cache.update(torch.ones(3, 2, 4, 8), torch.ones(3, 2, 4, 8), 0)
    assert keys.shape == (3, 2, 4, 8) and len(factory.buffers) == 4


def test_dropping_the_cache_releases_its_buffers():
    factory = Factory()
    cache = GrowableCache(max_cache_len=16, buffer_factory=factory)
    cache.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), 0)
    del cache
    gc.collect()
    assert factory.buffers and all(b.released for b in factory.buffers)


def test_reserving_capacity_commits_nothing():
    factory = Factory()
    cache = GrowableCache(max_cache_len=1 << 20, buffer_factory=factory)
    assert factory.buffers == []  # buffers appear with the first states (batch, heads known)
    cache.update(torch.ones(2, 2, 0, 4), torch.ones(2, 2, 0, 4), 0)
    assert len(factory.buffers) == 2 and all(b.committed == 0 for b in factory.buffers)
    assert cache.kv_stats()["reserved_bytes"] == 2 * (1 << 20) * 2 * 2 * 4 * 4


def test_out_of_pages_raises_torch_oom_and_recovers():
    pool = [8192]
    factory = Factory(pool=pool, page=1024)
    cache = GrowableCache(max_cache_len=1000, buffer_factory=factory)
    cache.update(torch.ones(1, 1, 100, 4), torch.ones(1, 1, 100, 4), 0)  # 1,600 B each
    with pytest.raises(torch.OutOfMemoryError, match="no pages"):
        cache.update(torch.ones(1, 1, 500, 4), torch.ones(1, 1, 500, 4), 0)
    assert cache.get_seq_length() == 100  # unchanged by the failed update
    cache.release()
    assert pool == [8192]


def test_bad_input():
    model = tiny_model()
    for bad in (0, -5, 2.5, "64", True):
        with pytest.raises(ValueError, match="max_cache_len"):
            GrowableCache(model.config, max_cache_len=bad, buffer_factory=Factory())
    with pytest.raises(ValueError, match="max_cache_len"):
        GrowableCache(buffer_factory=Factory())

    ids, mask = left_padded([10, 4])
    with pytest.raises(ValueError, match="is full"):
        generate(model, ids, mask, GrowableCache(model.config, 12, buffer_factory=Factory()))

    cache = GrowableCache(max_cache_len=8, buffer_factory=Factory())
    cache.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), 0)
    with pytest.raises(ValueError, match="batch=2"):
        cache.update(torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 4), 0)
    with pytest.raises(ValueError, match="float32"):
        cache.update(torch.ones(2, 2, 1, 4, dtype=torch.float64),
                     torch.ones(2, 2, 1, 4, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match=r"\[batch"):
        GrowableCache(max_cache_len=8, buffer_factory=Factory()).update(
            torch.ones(2, 1, 4), torch.ones(2, 1, 4), 0)
    with pytest.raises(ValueError, match="is full"):
        cache.update(torch.ones(2, 2, 8, 4), torch.ones(2, 2, 8, 4), 0)
    assert cache.get_seq_length() == 1

    small = lambda capacity, device: FakeGrowable(capacity // 2, page=1)  # noqa: E731
    with pytest.raises(ValueError, match="were asked for"):
        GrowableCache(max_cache_len=8, buffer_factory=small).update(
            torch.ones(1, 1, 1, 64), torch.ones(1, 1, 1, 64), 0)

    with pytest.raises(ValueError, match="CUDA device memory"):
        GrowableCache(max_cache_len=8).update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), 0)

    sliding = tiny_model(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        GrowableCache(sliding.config, buffer_factory=Factory())
