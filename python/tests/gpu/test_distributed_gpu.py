"""torch.distributed and NCCL on MoonBright memory, one process per GPU (issue 50): small runs of
bench/multigpu.py, one part at a time, under PyTorch's allocator and MoonBright's.

The script checks its own results (collectives against the values they must give, registered
buffers, DDP bit for bit against PyTorch's allocator, IPC both ways, sleep and wake beside
collectives) and lists every failed check in its JSON; these tests run it with small sizes and
assert that list is empty, plus what each part must show. Correctness only: bandwidth is for
the benchmark. World size: every GPU (one is enough for most; what needs two says so and is
skipped on one). Skipped without PyTorch or a CUDA device.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

REPO = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = REPO / "bench" / "multigpu.py"
GPUS = torch.cuda.device_count()
PRELOAD_LIB = pathlib.Path(
    os.environ.get("MOONBRIGHT_PRELOAD_LIB", REPO / "target/release/libmoonbright_preload.so")
)
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
# Small versions of the parts: one round, few iterations, one all-reduce size, tensors of 192
# MiB and 1 GiB to register (3 and 16 MoonBright chunks), 50 DDP steps.
SMALL = ["--rounds", "1", "--warmup", "2", "--iters", "3", "--sizes", "64",
         "--register-sizes", "192,1024", "--steps", "50", "--timeout", "240"]
_results: dict = {}


def run_part(tmp_path_factory, part, *configs, extra=()):
    """bench/multigpu.py's JSON for `part` under `configs` (run once per module, failed or
    not); fails with the script's failures and output unless it reported none."""
    key = (part, configs, tuple(extra))
    if key not in _results:
        out = tmp_path_factory.mktemp("multigpu") / f"{part}.json"
        env = dict(os.environ)
        env["MOONBRIGHT_ALLOC_CONF"] = ""  # not the CPU tests' host backend
        cmd = [sys.executable, str(SCRIPT), "--parts", part, "--nproc", str(GPUS), "--json",
               str(out), *SMALL, *(f"--config={c}" for c in configs), *extra]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                           check=False)
        print(r.stdout)
        doc = json.loads(out.read_text()) if out.exists() else None
        if doc is None:
            problem = f"no JSON written; status {r.returncode}\n{r.stdout}\n{r.stderr[-6000:]}"
        elif r.returncode != 0 or doc["failures"]:
            problem = ("failures:\n  " + "\n  ".join(doc["failures"])
                       + f"\n{r.stdout}\n{r.stderr[-6000:]}")
        else:
            problem = None
        _results[key] = (doc, problem)
    doc, problem = _results[key]
    assert problem is None, problem
    return doc


def ran(doc, part):
    """The process sets that ran `part`, by mode."""
    return {r["mode"]: r for r in doc["runs"] if r["part"] == part and "skipped" not in r}


def test_collectives_are_correct_on_moonbright_memory(tmp_path_factory):
    """all_reduce, all_gather_into_tensor and reduce_scatter_tensor of odd, unaligned and
    64 MiB sizes give the values computed on the host, under enable() as under PyTorch's
    allocator, and the all-reduce is timed at 64 MiB on both."""
    doc = run_part(tmp_path_factory, "collectives", "torch", "mb")
    runs = ran(doc, "collectives")
    assert set(runs) == {"torch", "mb"}, runs.keys()
    for run in runs.values():
        assert len(run["ranks"]) == GPUS
        for rank in run["ranks"]:
            assert len(rank["checks"]) >= 10 and all(rank["checks"].values()), rank["checks"]
    assert set(doc["summary"]["collectives"]["mb"]) == {"64"}


def test_nccl_registers_buffers_stitched_from_several_chunks(tmp_path_factory):
    """register_mem_pool of a moonbright.torch.pool() holding tensors stitched from several
    chunks, and ncclCommRegister of such tensors (pool and global allocator) and of PyTorch's
    own memory: every registration succeeds and every collective on registered memory is
    correct."""
    doc = run_part(tmp_path_factory, "register", "torch", "mb")
    runs = ran(doc, "register")
    assert set(runs) == {"torch", "mb", "mb-pool"}, runs.keys()
    pool = runs["mb-pool"]["ranks"][0]
    assert pool["register_mem_pool"]["ok"], pool["register_mem_pool"]
    assert pool["handles"]["192 MiB"]["chunks"] >= 3, pool["handles"]
    assert pool["handles"]["1024 MiB"]["chunks"] >= 16, pool["handles"]
    for mode in ("torch", "mb", "mb-pool"):
        direct = runs[mode]["ranks"][0]["direct"]
        assert set(direct["sizes"]) == {"192 MiB", "1024 MiB"}, direct
        for size in direct["sizes"].values():
            assert size["register"]["ok"], (mode, size)
    stitched = runs["mb"]["ranks"][0]["direct"]["sizes"]["1024 MiB"]["handles"]
    assert stitched["chunks"] >= 16, stitched


def test_ddp_training_is_bit_identical_to_pytorchs_allocator(tmp_path_factory):
    """50 steps of DDP on every GPU: the replicas agree, and the losses and final weights under
    enable() are PyTorch's allocator's, bit for bit."""
    doc = run_part(tmp_path_factory, "ddp", "torch", "mb")
    s = doc["summary"]["ddp"]
    assert s["torch"]["replicas_agree"] and s["mb"]["replicas_agree"], s
    assert s["mb"]["identical_to_torch"], s
    assert ran(doc, "ddp")["mb"]["ranks"][0]["steps"] == 50


def test_ipc_between_processes(tmp_path_factory):
    """A tensor sent through a torch.multiprocessing queue is read and written by the other
    process, and the sender sees the writes: PyTorch's CUDA IPC, and moonbright.ipc under
    enable() (300 MiB stitched from two chunks, and a strided view)."""
    doc = run_part(tmp_path_factory, "ipc", "torch", "mb")
    s = doc["summary"]["ipc"]
    assert s["torch"]["ok"] and s["mb"]["ok"], s
    sender = ran(doc, "ipc")["mb"]["ranks"][0]
    assert sender["handles"]["big"]["chunks"] >= 2, sender["handles"]


@two_gpus
def test_ipc_reaches_the_other_gpu(tmp_path_factory):
    """With two GPUs the receiver runs on GPU 1: under enable() it maps the sender's memory
    there and reads and writes it through peer access."""
    doc = run_part(tmp_path_factory, "ipc", "torch", "mb")
    s = doc["summary"]["ipc"]
    assert s["mb"]["from"] == 0 and s["mb"]["to"] == 1, s
    assert s["mb"]["received_on"] == ["cuda:1"], s
    assert s["torch"]["to"] == 1, s


def test_ipc_through_the_interposer(tmp_path_factory):
    """PyTorch's own CUDA IPC under the LD_PRELOAD interposer, whose cudaIpc* serve it."""
    if not PRELOAD_LIB.is_file():
        pytest.skip(f"no interposer library at {PRELOAD_LIB}")
    doc = run_part(tmp_path_factory, "ipc", "preload", extra=("--preload-lib", str(PRELOAD_LIB)))
    assert doc["summary"]["ipc"]["preload"]["ok"], doc["summary"]


def test_sleep_and_wake_beside_collectives(tmp_path_factory):
    """Rank 0 puts 1 GiB of tagged tensors to sleep while its all-reduces are in flight:
    those, the all-reduces while it sleeps, the tag's bytes after wake and an all-reduce of a
    woken tensor are all correct, and the sleep gave the memory back."""
    doc = run_part(tmp_path_factory, "sleep", "mb")
    s = doc["summary"]["sleep"]
    assert s["ok"], s
    assert s["freed_bytes"] >= 0.95 * (1 << 30), s


@two_gpus
def test_sleep_does_not_wait_for_the_other_ranks_collectives(tmp_path_factory):
    """Rank 1 joins rank 0's all-reduces half a second late; rank 0's sleep waits only for the
    streams its tag used, so it returns while those all-reduces are still in flight."""
    doc = run_part(tmp_path_factory, "sleep", "mb")
    s = doc["summary"]["sleep"]
    assert s["in_flight_when_sleep_returned"], s
