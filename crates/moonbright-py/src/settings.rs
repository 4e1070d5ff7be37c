//! The options: `configure`, the PyTorch contract's switch, `parse_conf`, `options`, and what
//! the allocators are (`is_initialized`, `backend`, the last error).

use moonbright::conf;
use moonbright::Options;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{
    base_options, created, default_device, device_index, get, lock, py_err, value_text, CONFIG,
    DEVICES, LAST_ERROR,
};

/// Sets the options of the allocators not created yet: keyword arguments named as the keys of
/// `MOONBRIGHT_ALLOC_CONF`, applied over it. Raises ValueError naming a bad key or value, and
/// RuntimeError once an allocator exists.
#[pyfunction]
#[pyo3(signature = (**kwargs))]
pub(crate) fn configure(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    let mut cfg = lock(&CONFIG);
    if let Some((i, _)) = created().next() {
        return Err(py_err(format!(
            "moonbright.configure() must be called before the first allocation: the allocator \
             of device {i} exists already and its options are fixed (set {} before starting \
             the process, or call configure() first)",
            conf::ENV_VAR
        )));
    }
    let base =
        conf::from_env().map_err(|e| PyValueError::new_err(format!("{}: {e}", conf::ENV_VAR)))?;
    let mut pairs = Vec::new();
    if let Some(kw) = kwargs {
        for (k, v) in kw.iter() {
            pairs.push((k.extract::<String>()?, value_text(&v)?));
        }
    }
    let opts = conf::apply_pairs(base, pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    cfg.options = Some(opts);
    cfg.configured = pairs.into_iter().map(|(k, _)| k).collect();
    Ok(())
}

/// Makes allocators created from now on take PyTorch's contract (`captures_announced`,
/// `deferred_free_events`) wherever `MOONBRIGHT_ALLOC_CONF` and `configure` leave it unset:
/// `moonbright.torch.enable()` calls it (and again with `on=False` if it then fails). Returns
/// False, changing nothing, once an allocator exists (its options are fixed).
#[pyfunction]
#[pyo3(signature = (on=true))]
pub(crate) fn _use_torch_contract(on: bool) -> bool {
    let mut cfg = lock(&CONFIG);
    if created().next().is_some() {
        return false;
    }
    cfg.torch_contract = on;
    true
}

/// Parses a `MOONBRIGHT_ALLOC_CONF` string and returns the options it gives as a dict (for
/// checking a string without creating anything). Raises ValueError naming a bad key or value.
#[pyfunction]
pub(crate) fn parse_conf(py: Python<'_>, text: &str) -> PyResult<Py<PyDict>> {
    let o = conf::parse_conf(text).map_err(|e| PyValueError::new_err(e.to_string()))?;
    options_dict(py, &o)
}

pub(crate) fn options_dict(py: Python<'_>, o: &Options) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("profile", o.profile.name())?;
    d.set_item("backend", format!("{:?}", o.backend).to_lowercase())?;
    d.set_item("device", o.device)?;
    d.set_item("cap", o.cap_bytes)?;
    d.set_item("cap_fraction", o.cap_fraction)?;
    d.set_item("host_page_size", o.host_page_size)?;
    d.set_item("host_capacity", o.host_capacity)?;
    d.set_item("max_chunk", o.max_chunk_bytes)?;
    d.set_item("max_chunk_repeated", o.max_chunk_repeated_bytes)?;
    d.set_item("large_chunk", o.large_chunk_bytes)?;
    d.set_item("largest_chunk", o.largest_chunk_bytes)?;
    d.set_item("unmap_batch", o.unmap_batch_ranges)?;
    d.set_item("unmap_batch_bytes", o.unmap_batch_bytes)?;
    d.set_item("unmap_run_handles", o.unmap_run_handles)?;
    d.set_item("reuse_addresses", o.reuse_addresses)?;
    d.set_item("near_fit", o.near_fit)?;
    d.set_item("carve", o.carve)?;
    d.set_item("carve_repeated", o.carve_repeated)?;
    d.set_item("grow_first", o.grow_first)?;
    d.set_item("peer_access", o.peer_access)?;
    d.set_item("background", o.background)?;
    d.set_item("ipc", o.ipc)?;
    d.set_item("captures_announced", o.captures_announced)?;
    d.set_item("deferred_free_events", o.deferred_free_events)?;
    d.set_item("validate", o.validate)?;
    Ok(d.unbind())
}

/// The options in force for `device` (its allocator's, or those it would be created with).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn options(py: Python<'_>, device: Option<i32>) -> PyResult<Py<PyDict>> {
    let d = default_device(device)?;
    device_index(d).map_err(py_err)?;
    if let Some(a) = DEVICES.get(d) {
        return options_dict(py, a.options());
    }
    let cfg = lock(&CONFIG);
    let mut o = base_options(&cfg).map_err(|e| PyValueError::new_err(e.to_string()))?;
    o.device = d;
    options_dict(py, &o)
}

/// Whether the allocator of `device` exists.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn is_initialized(device: Option<i32>) -> PyResult<bool> {
    let i = device_index(default_device(device)?).map_err(py_err)?;
    Ok(DEVICES.get(i as i32).is_some())
}

/// The backend of `device`'s allocator: "cuda" or "host" (creates it).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn backend(device: Option<i32>) -> PyResult<&'static str> {
    Ok(get(device)?.backend_name())
}

/// The last error message of an allocation entry point, or None.
#[pyfunction]
pub(crate) fn last_error() -> Option<String> {
    lock(&LAST_ERROR).as_ref().map(|(m, _)| m.clone())
}

/// Forgets the last error.
#[pyfunction]
pub(crate) fn clear_last_error() {
    *lock(&LAST_ERROR) = None;
}
