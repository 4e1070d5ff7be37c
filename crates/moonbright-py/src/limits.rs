//! The cap, the memory fraction, peer access, the page size and the invariant check.

use moonbright::Error;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::{get, py_err};

/// The cap on physical bytes of `device`'s allocator.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn cap(device: Option<i32>) -> PyResult<u64> {
    Ok(get(device)?.cap())
}

/// Sets the cap on physical bytes `device`'s allocator may hold (rounded down to a page,
/// limited to the device's memory) and returns it. Lowering it below what is held gives back
/// every page no allocation uses; past that, live allocations keep their memory, and what is
/// held serves requests but does not grow until it is back under the cap. A cap below one page
/// is 0: every request fails until it is raised (PyTorch's memory fraction 0). Raises
/// RuntimeError if the release fails.
#[pyfunction]
#[pyo3(signature = (bytes, device=None))]
pub(crate) fn set_cap(bytes: u64, device: Option<i32>) -> PyResult<u64> {
    get(device)?.set_cap(bytes).map_err(|e| match e {
        Error::InvalidOption { .. } => PyValueError::new_err(e.to_string()),
        e => py_err(e.to_string()),
    })
}

/// Sets the cap to `fraction` of the device's memory (PyTorch's
/// `set_per_process_memory_fraction`, which `moonbright.torch.enable()` routes here) and
/// returns the cap in bytes; as `set_cap` otherwise.
#[pyfunction]
#[pyo3(signature = (fraction, device=None))]
pub(crate) fn set_memory_fraction(fraction: f64, device: Option<i32>) -> PyResult<u64> {
    if !(0.0..=1.0).contains(&fraction) {
        return Err(PyValueError::new_err(format!("memory fraction {fraction} is not in [0, 1]")));
    }
    let a = get(device)?;
    set_cap((fraction * a.total_memory() as f64) as u64, device)
}

/// The cap over the device's memory (PyTorch's `get_per_process_memory_fraction`).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn memory_fraction(device: Option<i32>) -> PyResult<f64> {
    let a = get(device)?;
    Ok(a.cap() as f64 / a.total_memory() as f64)
}

/// Grants GPU `peer` access to the memory of `device`'s allocator, mapped now and later (see
/// `moonbright.enable_peer_access`). Raises RuntimeError when the two GPUs cannot reach each other
/// peer to peer.
#[pyfunction]
#[pyo3(signature = (peer, device=None))]
pub(crate) fn enable_peer_access(peer: i32, device: Option<i32>) -> PyResult<()> {
    get(device)?.enable_peer_access(peer).map_err(|e| py_err(e.to_string()))
}

/// The GPUs granted access to the memory of `device`'s allocator.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn peers(device: Option<i32>) -> PyResult<Vec<i32>> {
    Ok(get(device)?.peers())
}

/// The page size (mapping granularity) of `device`'s allocator.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn page_size(device: Option<i32>) -> PyResult<usize> {
    Ok(get(device)?.page_size())
}

/// Checks every invariant of `device`'s allocator; raises RuntimeError naming a broken one.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn check_invariants(device: Option<i32>) -> PyResult<()> {
    get(device)?.check_invariants().map_err(py_err)
}
