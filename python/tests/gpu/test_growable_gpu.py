"""moonbright.Growable on a GPU, viewed by PyTorch without a copy: kernels write the committed
part, the buffer grows in place under a tensor view that never moves, shrinking hands pages to
PyTorch allocations (MoonBright as PyTorch's allocator), and nothing is lost. Each scenario runs in
a fresh process (see test_torch_gpu.py)."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_torch_gpu import run  # noqa: E402


def test_growable_views_grow_in_place_under_pytorch():
    out = run(
        """
        import json, torch, moonbright, moonbright.torch
        moonbright.torch.enable()
        page = moonbright.page_size()
        s = torch.cuda.current_stream()
        g = moonbright.Growable(64 * page)
        # PyTorch asks the driver about the first byte: commit before viewing.
        g.resize(3 * page, stream=s.cuda_stream)
        whole = torch.as_tensor(g, device="cuda")          # uint8 over the capacity, no copy
        assert whole.data_ptr() == g.ptr and whole.numel() == g.capacity
        f = whole.view(torch.float32)
        n = page // 4
        f[: 3 * n] = torch.arange(3 * n, device="cuda", dtype=torch.float32)
        ok = True
        for pages in (7, 19, 64):
            g.resize(pages * page, stream=s.cuda_stream)
            f[(pages - 1) * n : pages * n] = float(pages)   # touch the new last page
            ok &= bool((f[: 3 * n] == torch.arange(3 * n, device="cuda", dtype=torch.float32)).all())
        torch.cuda.synchronize()
        committed = moonbright.memory_stats()["moonbright.growable_committed_bytes.current"]
        # Shrink on the stream, then let PyTorch allocate from the pages given back.
        reserved = torch.cuda.memory_reserved()
        g.resize(4 * page, stream=s.cuda_stream)
        x = torch.ones(50 * page // 4, device="cuda")
        torch.cuda.synchronize()
        reused = torch.cuda.memory_reserved() <= reserved
        ok &= bool((f[: 3 * n] == torch.arange(3 * n, device="cuda", dtype=torch.float32)).all())
        del x
        g.release()
        moonbright.check_invariants()
        print(json.dumps({"ok": ok, "committed": committed, "capacity": g.capacity, "reused": reused}))
        """
    )
    assert out["ok"], out
    assert out["committed"] == out["capacity"]
    assert out["reused"], "the pages a shrink gave back did not serve PyTorch"
