"""A real consumer of the paged pool on a GPU: K/V written through the slot mapping, decode
attention reading them through the block table (a PyTorch gather), compared with dense
attention for many sequences of different lengths, with forks (copy-on-write), departures and
arrivals between steps. Also checks the device tables against the pool's metadata after every
step. Skipped without PyTorch or a CUDA device (python3 -m pytest python/tests/gpu -q)."""

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import moonbright  # noqa: E402

if not moonbright.is_initialized():
    # conftest.py points the process at the host backend; this file needs the GPU.
    moonbright.configure(backend="cuda", cap="8GiB", validate=False)
elif moonbright.backend() != "cuda":
    pytest.skip(
        "the allocator of this process was made on the host backend; run this file alone",
        allow_module_level=True,
    )

from moonbright.paged import PagedKVPool  # noqa: E402

H, D, T = 4, 64, 16


def paged_decode_attention(q, kv_flat, block_table, seq_lens, rows):
    """q: [B, H, D]; kv_flat: [slots, 2, H, D]; attends each query to its row's tokens."""
    rows_t = torch.tensor(rows, device=q.device, dtype=torch.long)
    lens = seq_lens[rows_t].long()
    L = int(lens.max())
    pos = torch.arange(L, device=q.device)
    bt = block_table[rows_t].long()  # [B, M]
    pages = bt[:, pos // T]  # [B, L]
    slots = pages * T + (pos % T)
    valid = pos[None, :] < lens[:, None]
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    kv = kv_flat[slots]  # [B, L, 2, H, D]
    k, v = kv[:, :, 0].float(), kv[:, :, 1].float()
    s = torch.einsum("bhd,blhd->bhl", q.float(), k) / math.sqrt(D)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", s.softmax(-1), v)


def test_paged_decode_attention_matches_dense():
    assert moonbright.backend() == "cuda"
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    max_pages, max_seqs, M = 8192, 256, 64
    pool = PagedKVPool(T, 2 * H * D * 2, max_pages, max_seqs, M, max_step_tokens=65536)
    assert pool._pool.on_device()
    kv_flat = pool.kv_pages(torch.bfloat16).view(max_pages * T, 2, H, D)
    dense = {}  # seq -> [len, 2, H, D] float32 (bf16-rounded) reference

    def write(tokens):
        """tokens: list of (seq, kv [n, 2, H, D]) in slot-mapping order."""
        if not tokens:
            return
        vals = torch.cat([t for _, t in tokens]).to(torch.bfloat16)
        slots = pool.slot_mapping
        assert slots.shape[0] == vals.shape[0]
        keep = slots >= 0
        kv_flat[slots[keep]] = vals[keep]

    def rand(n):
        return torch.randn(n, 2, H, D, device=dev, generator=g)

    lens = torch.randint(1, 600, (120,), generator=g, device=dev).tolist()
    seqs = pool.add_many(lens)
    new = [(s, rand(n)) for s, n in zip(seqs, lens)]
    pool.commit()
    write(new)
    for s, t in new:
        dense[s] = t.to(torch.bfloat16).float()
    checked = 0
    for step in range(40):
        if step % 7 == 3:  # departures
            for s in list(dense)[:5]:
                pool.free(s)
                del dense[s]
        if step % 5 == 1:  # forks: children share pages, copy on write
            for s in list(dense)[:3]:
                c = pool.fork(s)
                dense[c] = dense[s].clone()
        arrivals = []
        if step % 4 == 2:
            for n in torch.randint(1, 300, (4,), generator=g, device=dev).tolist():
                s = pool.add(n)
                arrivals.append((s, rand(n)))
        n = pool.decode_step()
        rows = pool.batch()
        assert n == sum(t.shape[0] for _, t in arrivals) + len(rows)
        decode = [(pool._pool.seq_at(r), rand(1)) for r in rows]
        write(arrivals + decode)
        for s, t in arrivals:
            dense[s] = t.to(torch.bfloat16).float()
        for s, t in decode:
            dense[s] = torch.cat([dense[s], t.to(torch.bfloat16).float()])
        # Device tables against the pool's metadata.
        bt = pool.block_table.cpu()
        lens_dev = pool.seq_lens.cpu()
        for s in dense:
            r, pages = pool.row(s), pool.pages(s)
            assert bt[r, : len(pages)].tolist() == pages
            assert int(lens_dev[r]) == pool.seq_len(s) == dense[s].shape[0]
        # Attention through the block table against dense attention.
        q = torch.randn(len(rows), H, D, device=dev, generator=g)
        out = paged_decode_attention(q, kv_flat, pool.block_table, pool.seq_lens, rows)
        for i, r in enumerate(rows):
            s = pool._pool.seq_at(r)
            k, v = dense[s][:, 0], dense[s][:, 1]
            p = (torch.einsum("hd,lhd->hl", q[i], k) / math.sqrt(D)).softmax(-1)
            ref = torch.einsum("hl,lhd->hd", p, v)
            torch.testing.assert_close(out[i], ref, atol=2e-2, rtol=2e-2)
            checked += 1
    pool.check_invariants()
    print(f"{checked} decode attentions matched dense attention")
