"""CPU test of moonbright.torch's shim for PyTorch's CUDA-graph trees (``_patch_graph_trees``,
what ``torch.compile(mode="reduce-overhead")`` calls), on the host backend with a stand-in for
the few ``torch`` pieces it touches: the ``torch._C`` functions it replaces, storages and their
weak references. It plays the trees' calls in their order: warm-up into the pool, the state read
after a recording, outputs dying, the state set back beside a live replayed output, checks,
deleter calls, and the output's death. The H200 runs the real thing
(python/tests/gpu/test_compile_gpu.py)."""

import subprocess
import sys
import textwrap

SCRIPT = r"""
import ctypes, sys, threading, types, weakref
import moonbright

# --- a stand-in for torch -------------------------------------------------------------------
calls = []


def original(name):
    def f(*args):
        calls.append((name, args))
        return "torch's" if name == "_has_Standard_Deleter" else None
    return f


NAMES = ["_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool",
         "_cuda_releasePool", "_cuda_getCheckpointState", "_cuda_setCheckpointPoolState",
         "_cuda_checkPoolLiveAllocations", "_cuda_cudaCachingAllocator_raw_delete",
         "_free_And_Remove_DeleterFn", "_has_Standard_Deleter"]
C = types.SimpleNamespace(**{n: original(n) for n in NAMES})
storages = weakref.WeakValueDictionary()  # cdata -> storage, while alive


class Storage:
    def __init__(self, ptr):
        self.ptr, self.cdata = ptr, 1000 + ptr % 997
        storages[self.cdata] = self

    def data_ptr(self):
        return self.ptr

    @staticmethod
    def _new_with_weak_ptr(cdata):
        return storages.get(cdata)


class StorageWeakRef:
    def __init__(self, storage):
        self.cdata, self._ref = storage.cdata, weakref.ref(storage)

    def expired(self):
        return self._ref() is None


class Stream:
    cuda_stream = 0


torch = types.ModuleType("torch")
torch._C = C
torch.UntypedStorage = Storage
torch.cuda = types.SimpleNamespace(current_stream=lambda device=None: Stream())
reductions = types.ModuleType("torch.multiprocessing.reductions")
reductions.StorageWeakRef = StorageWeakRef
sys.modules.update({"torch": torch, "torch.multiprocessing": types.ModuleType("m"),
                    "torch.multiprocessing.reductions": reductions})

import moonbright.torch as mt

# The graph wrappers' pool map, as _patch_graphs leaves it (no CUDAGraph here).
users = {}
def drop_user(pool):
    users[pool] -= 1
    if users[pool] == 0:
        del users[pool]
mt._graph_pool_keys.update(keys={}, users=users, drop_user=drop_user, reap=lambda: None)
mt._patch_graph_trees(torch)

lib = ctypes.CDLL(moonbright.library_path())
lib.moonbright_alloc.restype = ctypes.c_void_p
lib.moonbright_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.moonbright_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
alloc = lambda n: lib.moonbright_alloc(n, 0, None)       # what PyTorch's pluggable calls
free = lambda p: lib.moonbright_free(p, 0, 0, None)
PAGE = moonbright.page_size()
P = (0, 1)
live = lambda: [p for p, _ in moonbright.graph_pool_live(P)]

# The trees' manager keeps its pool alive with a graph; here, a route begun on another thread.
t = threading.Thread(target=lambda: moonbright.begin_allocate_to_pool(P)); t.start(); t.join()

# Warm-up: this thread's requests go to the pool.
C._cuda_beginAllocateCurrentThreadToPool(0, P)
a, b = alloc(3 * PAGE), alloc(1000)
free(b)  # an intermediate: back to the pool
C._cuda_endAllocateToPool(0, P)
C._cuda_releasePool(0, P)
assert live() == [a], live()
other = alloc(1000)
assert live() == [a], "after the route, requests are not the pool's"
assert not calls, f"nothing reached PyTorch's functions: {calls}"

# After a recording: the state; then the output dies (the pluggable frees it).
state = C._cuda_getCheckpointState(0, P)
assert state.live == (a,), state
free(a)
assert live() == [] and C._cuda_checkPoolLiveAllocations(0, P, set())

# A replay made output storage `s` at a, still live; a new recording sets the state back.
s = Storage(a)
C._cuda_setCheckpointPoolState(0, state, [], [s.cdata])
assert live() == [a], "a is live again"
assert C._has_Standard_Deleter(s.cdata) is True
assert C._cuda_checkPoolLiveAllocations(0, P, {a})
assert not C._cuda_checkPoolLiveAllocations(0, P, set())
assert C._has_Standard_Deleter(999) == "torch's", "other storages: PyTorch's answer"
assert calls == [("_has_Standard_Deleter", (999,))]
calls.clear()
try:
    C._cuda_setCheckpointPoolState(0, state, [5], [])
    raise SystemExit("stale storages were accepted")
except RuntimeError as e:
    assert "stale" in str(e)

# s dies: its block is freed at the next call from the trees.
del s
assert live() == [a] and C._cuda_checkPoolLiveAllocations(0, P, set())
assert live() == [] and moonbright.graph_pool_free()[0] == 2

# Set back again: the trees free one revived block themselves (raw_delete) and another
# through the deleter they were told the storage has.
c = Storage(a)
C._cuda_setCheckpointPoolState(0, state, [], [c.cdata])
C._free_And_Remove_DeleterFn(c.cdata)
assert live() == [] and not calls
C._cuda_setCheckpointPoolState(0, state, [], [])
C._cuda_cudaCachingAllocator_raw_delete(a)
assert live() == []
C._cuda_cudaCachingAllocator_raw_delete(12345)
C._free_And_Remove_DeleterFn(c.cdata)
C._cuda_releasePool(0, (9, 9))
assert [n for n, _ in calls] == ["_cuda_cudaCachingAllocator_raw_delete",
    "_free_And_Remove_DeleterFn", "_cuda_releasePool"], calls
assert moonbright.last_error() is None, moonbright.last_error()

# The pool's last user goes: its memory goes back.
moonbright.release_graph_pool(P)
assert moonbright.graph_pool_free() == (0, 0) and live() == []
free(other)
moonbright.check_invariants()
assert moonbright.memory_stats()["allocation.all.current"] == 0
print("OK")
"""


def test_the_graph_trees_shim_plays_the_trees_calls():
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
