//! Streams and CUDA graphs: `record_stream`, graph captures and their pools, stream-ordered
//! frees, and the raw reads and writes the tests use.

use moonbright::{Error, StreamHandle};
use pyo3::prelude::*;

use crate::stacks;
use crate::{default_device, get, py_err};

/// Notes that work queued on `stream` (a CUstream handle as an int, 0 for the default stream)
/// uses the allocation at `ptr`, so that its stream-ordered free waits for that work too:
/// PyTorch's `Tensor.record_stream`, which `moonbright.torch.enable()` routes here. Returns True.
/// A pointer that is not the start of a live allocation, or a growable one, raises
/// RuntimeError, or with `missing_ok` returns False (PyTorch ignores storages its allocator did
/// not make, such as a growable buffer viewed as a tensor).
#[pyfunction]
#[pyo3(signature = (ptr, stream, device=None, missing_ok=false))]
pub(crate) fn record_stream(
    ptr: u64,
    stream: u64,
    device: Option<i32>,
    missing_ok: bool,
) -> PyResult<bool> {
    match get(device)?.record_stream(ptr, StreamHandle(stream)) {
        Ok(()) => Ok(true),
        Err(
            Error::UnknownPointer { .. }
            | Error::InteriorPointer { .. }
            | Error::GrowableStreamUse { .. },
        ) if missing_ok => Ok(false),
        Err(e) => Err(py_err(e.to_string())),
    }
}

/// Makes the graph capture in progress on `stream` (a CUstream handle as an int) allocate into
/// graph pool `pool` (a pair of ints, PyTorch's `CUDAGraph.pool()`), until
/// `end_graph_capture(stream)`: what it allocates stays the pool's while a graph of the pool
/// exists. `moonbright.torch.enable()` calls it from `torch.cuda.CUDAGraph.capture_begin`.
#[pyfunction]
#[pyo3(signature = (stream, pool, device=None))]
pub(crate) fn begin_graph_capture(
    stream: u64,
    pool: (u64, u64),
    device: Option<i32>,
) -> PyResult<()> {
    get(device)?.begin_graph_capture(StreamHandle(stream), pool).map_err(|e| py_err(e.to_string()))
}

/// Announces that a CUDA graph capture is about to begin on `device` (before the driver begins
/// it). With option `captures_announced:true`, streams are checked for a capture only between
/// this and the matching `capture_finished`. `moonbright.torch.enable()` calls both from
/// `torch.cuda.CUDAGraph`.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn capture_starting(device: Option<i32>) -> PyResult<()> {
    get(device)?.capture_starting();
    Ok(())
}

/// Announces that a capture announced with `capture_starting` has ended, or failed to begin.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn capture_finished(device: Option<i32>) -> PyResult<()> {
    get(device)?.capture_finished();
    Ok(())
}

/// Ends the capture begun on `stream` by `begin_graph_capture`, after the graph's capture ended.
#[pyfunction]
#[pyo3(signature = (stream, device=None))]
pub(crate) fn end_graph_capture(stream: u64, device: Option<i32>) -> PyResult<()> {
    get(device)?.end_graph_capture(StreamHandle(stream)).map_err(|e| py_err(e.to_string()))
}

/// Notes that a graph of `pool` was replayed on `stream`: the pool's memory goes back to other
/// allocations only after the work queued there before its release.
#[pyfunction]
#[pyo3(signature = (pool, stream, device=None))]
pub(crate) fn graph_replayed(pool: (u64, u64), stream: u64, device: Option<i32>) -> PyResult<()> {
    get(device)?.graph_replayed(pool, StreamHandle(stream));
    Ok(())
}

/// One graph of `pool` is gone; with the last, the pool's memory goes back to other allocations.
#[pyfunction]
#[pyo3(signature = (pool, device=None))]
pub(crate) fn release_graph_pool(pool: (u64, u64), device: Option<i32>) -> PyResult<()> {
    get(device)?.release_graph_pool(pool).map_err(|e| py_err(e.to_string()))
}

/// Routes this thread's allocations outside captures into graph pool `pool` until
/// `end_allocate_to_pool()` (PyTorch's `beginAllocateCurrentThreadToPool`, which CUDA-graph trees
/// use for their warm-up runs); one more user of the pool, released with `release_graph_pool`.
#[pyfunction]
#[pyo3(signature = (pool, device=None))]
pub(crate) fn begin_allocate_to_pool(pool: (u64, u64), device: Option<i32>) -> PyResult<()> {
    get(device)?.begin_allocate_to_pool(pool).map_err(|e| py_err(e.to_string()))
}

/// Ends this thread's route into a graph pool; returns the pool.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn end_allocate_to_pool(device: Option<i32>) -> PyResult<(u64, u64)> {
    get(device)?.end_allocate_to_pool().map_err(|e| py_err(e.to_string()))
}

/// The live blocks of graph pool `pool`: a list of (pointer, usable bytes) in address order.
#[pyfunction]
#[pyo3(signature = (pool, device=None))]
pub(crate) fn graph_pool_live(pool: (u64, u64), device: Option<i32>) -> PyResult<Vec<(u64, u64)>> {
    Ok(get(device)?.graph_pool_live(pool))
}

/// Makes `keep` (pointers) the live set of graph pool `pool`, as PyTorch's
/// `setCheckpointPoolState`: returns (revived, freed) pointers. Blocks freed go back to the pool
/// as freed on `stream`.
#[pyfunction]
#[pyo3(signature = (pool, keep, stream, device=None))]
pub(crate) fn set_graph_pool_live(
    pool: (u64, u64),
    keep: Vec<u64>,
    stream: u64,
    device: Option<i32>,
) -> PyResult<(Vec<u64>, Vec<u64>)> {
    get(device)?
        .set_graph_pool_live(pool, &keep, StreamHandle(stream))
        .map_err(|e| py_err(e.to_string()))
}

/// Frees `ptr`, an allocation MoonBright made, in `stream`'s order (a CUstream handle as an
/// int): what the pluggable allocator's free does, for memory PyTorch no longer tracks.
#[pyfunction]
#[pyo3(signature = (ptr, stream, device=None))]
pub(crate) fn free_async(ptr: u64, stream: u64, device: Option<i32>) -> PyResult<()> {
    let d = default_device(device)?;
    let a = get(Some(d))?;
    stacks::forget_live(d as usize, ptr); // before: the address may be reused once freed
    a.free_async(ptr, StreamHandle(stream)).map_err(|e| py_err(e.to_string()))
}

/// (blocks, bytes) that graph pools hold free for their graphs on `device`.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn graph_pool_free(device: Option<i32>) -> PyResult<(usize, u64)> {
    Ok(get(device)?.graph_pool_free())
}

/// Copies bytes into device memory (synchronous; for tests).
#[pyfunction]
#[pyo3(signature = (ptr, data, device=None))]
pub(crate) fn _write(ptr: u64, data: &[u8], device: Option<i32>) -> PyResult<()> {
    get(device)?.write(ptr, data).map_err(|e| py_err(e.to_string()))
}

/// Reads bytes of device memory (synchronous; for tests).
#[pyfunction]
#[pyo3(signature = (ptr, len, device=None))]
pub(crate) fn _read(ptr: u64, len: usize, device: Option<i32>) -> PyResult<Vec<u8>> {
    let mut buf = vec![0u8; len];
    get(device)?.read(ptr, &mut buf).map_err(|e| py_err(e.to_string()))?;
    Ok(buf)
}
