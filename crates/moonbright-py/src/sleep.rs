//! Tags, sleep and wake for Python: the calling thread's tag (`moonbright.tag`, a context
//! manager over `tag_enter` / `tag_restore`), and `sleep`, `wake`, `tags` and the pinned host
//! memory they keep, per device.

use moonbright::tags::{self, Backup};
use moonbright::Error;
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{get, py_err};

/// A core error as a Python exception: `MemoryError` for a lack of memory (a wake that cannot
/// get its memory back), `RuntimeError` otherwise.
fn raise(e: Error) -> PyErr {
    match e {
        Error::OutOfMemory { .. } | Error::AddressSpaceExhausted { .. } => {
            PyMemoryError::new_err(e.to_string())
        }
        e => py_err(e.to_string()),
    }
}

/// Makes `name` the calling thread's tag (None: no tag) until `tag_restore` is given what this
/// returned (the tag before).
#[pyfunction]
#[pyo3(signature = (name))]
pub(crate) fn tag_enter(name: Option<&str>) -> PyResult<u32> {
    match name {
        Some(name) => tags::enter(name).map_err(raise),
        None => Ok(tags::enter_untagged()),
    }
}

/// Ends a tag `tag_enter` began.
#[pyfunction]
pub(crate) fn tag_restore(previous: u32) -> PyResult<()> {
    tags::restore(previous).map_err(raise)
}

/// The calling thread's tag, or None.
#[pyfunction]
pub(crate) fn current_tag() -> Option<String> {
    tags::current_name().map(|n| n.to_string())
}

/// Puts `tag` to sleep on `device`'s allocator, without the GIL (`Allocator::sleep`).
#[pyfunction]
#[pyo3(signature = (tag, backup=true, device=None))]
pub(crate) fn sleep_tag<'py>(
    py: Python<'py>,
    tag: &str,
    backup: bool,
    device: Option<i32>,
) -> PyResult<Bound<'py, PyDict>> {
    let a = get(device)?;
    let how = if backup { Backup::Host } else { Backup::Discard };
    let r = py.allow_threads(|| a.sleep(tag, how)).map_err(raise)?;
    let d = PyDict::new(py);
    d.set_item("bytes", r.bytes)?;
    d.set_item("released", r.released)?;
    d.set_item("backed_up", r.backed_up)?;
    d.set_item("seconds", r.seconds)?;
    Ok(d)
}

/// Wakes `tag` on `device`'s allocator, without the GIL (`Allocator::wake`).
#[pyfunction]
#[pyo3(signature = (tag, device=None))]
pub(crate) fn wake_tag<'py>(
    py: Python<'py>,
    tag: &str,
    device: Option<i32>,
) -> PyResult<Bound<'py, PyDict>> {
    let a = get(device)?;
    let r = py.allow_threads(|| a.wake(tag)).map_err(raise)?;
    let d = PyDict::new(py);
    d.set_item("bytes", r.bytes)?;
    d.set_item("created", r.created)?;
    d.set_item("restored", r.restored)?;
    d.set_item("seconds", r.seconds)?;
    Ok(d)
}

/// Every tag with live allocations or asleep on `device`: name -> {allocations, bytes, asleep,
/// backed_up}.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn tags_info(py: Python<'_>, device: Option<i32>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for t in get(device)?.tags() {
        let d = PyDict::new(py);
        d.set_item("allocations", t.allocations)?;
        d.set_item("bytes", t.bytes)?;
        d.set_item("asleep", t.asleep)?;
        d.set_item("backed_up", t.backed_up)?;
        out.set_item(&*t.name, d)?;
    }
    Ok(out)
}

/// Bytes of pinned host memory `device`'s allocator holds for sleeps.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn host_memory(device: Option<i32>) -> PyResult<u64> {
    Ok(get(device)?.host_memory())
}

/// Pins host memory for sleeps until at least `bytes` are held, without the GIL; returns the
/// bytes held.
#[pyfunction]
#[pyo3(signature = (bytes, device=None))]
pub(crate) fn reserve_host_memory(
    py: Python<'_>,
    bytes: u64,
    device: Option<i32>,
) -> PyResult<u64> {
    let a = get(device)?;
    py.allow_threads(|| a.reserve_host_memory(bytes)).map_err(raise)
}

/// Gives back the pinned host memory no tag asleep holds; returns the bytes.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn release_host_memory(device: Option<i32>) -> PyResult<u64> {
    get(device)?.release_host_memory().map_err(raise)
}
