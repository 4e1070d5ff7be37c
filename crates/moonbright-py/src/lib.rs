//! `moonbright._moonbright`: MoonBright's Python extension module, and the C entry points
//! PyTorch's `CUDAPluggableAllocator` loads from this same shared library.
//!
//! One allocator per CUDA device, process-wide, created at its first use from
//! `MOONBRIGHT_ALLOC_CONF` (and `configure(**kwargs)` if called before). The C entry points never
//! unwind: a panic or an error returns null (or is ignored, for free) and leaves its message
//! for `last_error()`.
//!
//! This file holds the per-device allocators, the configuration they are created with, the last
//! error, and the module's table of functions; `entry.rs` the C entry points; `settings.rs`,
//! `stats.rs`, `limits.rs`, `ipc.rs`, `streams.rs`, `growable.rs`, `paged.rs`, `sleep.rs` and
//! `tools.rs` the Python functions by concern; `stacks.rs` the Python stacks recorded with the
//! history.

mod entry;
mod growable;
mod ipc;
mod limits;
mod paged;
mod settings;
mod sleep;
mod stacks;
mod stats;
mod streams;
mod tools;

use std::sync::{Mutex, MutexGuard};

use moonbright::conf;
use moonbright::devices::Devices;
use moonbright::{Allocator, BackendKind, Error, Options};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyString};

/// One allocator per device, created at first use.
pub(crate) static DEVICES: Devices = Devices::new();

/// Configuration for allocators not created yet; taken under this lock when one is created.
pub(crate) struct Config {
    /// Set by `configure`; `None`: read `MOONBRIGHT_ALLOC_CONF` at first use.
    options: Option<Options>,
    /// History to switch on in allocators when they are created.
    history: Option<usize>,
    /// Keys `configure` was given (over `MOONBRIGHT_ALLOC_CONF`'s).
    configured: Vec<String>,
    /// Set by `moonbright.torch.enable()`: new allocators take PyTorch's contract
    /// (`TORCH_CONTRACT`) for every key of it the user did not set.
    torch_contract: bool,
}

pub(crate) static CONFIG: Mutex<Config> = Mutex::new(Config {
    options: None,
    history: None,
    configured: Vec::new(),
    torch_contract: false,
});

/// The options PyTorch's own wrapping makes safe, which `moonbright.torch.enable()` turns on
/// unless the user set them: captures are announced by the `torch.cuda.CUDAGraph` wrapper (as
/// PyTorch's allocator learns of them only from it), and PyTorch's streams outlive the
/// allocator, so frees may leave their events to the background worker. Then a cache hit
/// makes no driver call: in a ResNet-50 training step each allocation otherwise made three
/// (two capture queries and an event record), and those cost the step a third of its speed.
pub(crate) const TORCH_CONTRACT: [&str; 2] = ["captures_announced", "deferred_free_events"];

/// The last error met by an entry point: its message, and whether it was out of memory.
pub(crate) static LAST_ERROR: Mutex<Option<(String, bool)>> = Mutex::new(None);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn set_last_error(message: String, oom: bool) {
    *lock(&LAST_ERROR) = Some((message, oom));
}

pub(crate) fn is_oom(e: &Error) -> bool {
    matches!(e, Error::OutOfMemory { .. } | Error::TooLarge { .. })
}

/// The options new allocators get: `configure`'s, else `MOONBRIGHT_ALLOC_CONF`'s; under
/// `moonbright.torch.enable()`, with PyTorch's contract where the user left it unset.
pub(crate) fn base_options(cfg: &Config) -> Result<Options, Error> {
    let mut opts = match &cfg.options {
        Some(o) => o.clone(),
        None => conf::from_env()?,
    };
    if cfg.torch_contract {
        let env = std::env::var(conf::ENV_VAR).unwrap_or_default();
        let from_env = conf::split_conf(&env)?;
        let set = |key: &str| {
            cfg.configured.iter().any(|k| k == key) || from_env.iter().any(|(k, _)| *k == key)
        };
        for key in TORCH_CONTRACT.into_iter().filter(|k| !set(k)) {
            conf::apply(&mut opts, key, "true")?;
        }
    }
    Ok(opts)
}

pub(crate) fn device_index(device: i32) -> Result<usize, String> {
    Devices::index(device)
}

/// The allocator of `device`, created on first use (with `configure`'s options, else
/// `MOONBRIGHT_ALLOC_CONF`'s) and peered with the others (`Devices::get_or_create`).
pub(crate) fn allocator(device: i32) -> Result<&'static Allocator, String> {
    if let Some(a) = DEVICES.get(device) {
        return Ok(a);
    }
    // Held across the creation, so that `configure` cannot change the options in between.
    let cfg = lock(&CONFIG);
    let create = || {
        let mut opts = base_options(&cfg).map_err(|e| format!("{}: {e}", conf::ENV_VAR))?;
        opts.device = device;
        let a = Allocator::new(opts).map_err(|e| format!("cannot create the allocator: {e}"))?;
        if let Some(n) = cfg.history {
            a.record_history(Some(n));
        }
        Ok(a)
    };
    DEVICES.get_or_create(device, create, |msg| set_last_error(msg, false))
}

pub(crate) fn created() -> impl Iterator<Item = (usize, &'static Allocator)> {
    DEVICES.created()
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

// Helpers of the Python functions.

pub(crate) fn py_err(msg: impl Into<String>) -> PyErr {
    PyRuntimeError::new_err(msg.into())
}

/// The device a call with `device=None` means: the calling thread's current CUDA device (the
/// device of its current context, which `torch.cuda.set_device` selects), else the configured
/// one (device 0 unless `MOONBRIGHT_ALLOC_CONF` or `configure` says otherwise).
pub(crate) fn default_device(device: Option<i32>) -> PyResult<i32> {
    if let Some(d) = device {
        return Ok(d);
    }
    let opts = base_options(&lock(&CONFIG)).ok();
    let host = opts.as_ref().is_some_and(|o| o.backend == BackendKind::Host);
    if !host {
        if let Some(d) = moonbright::driver::cuda::current_device() {
            return Ok(d);
        }
    }
    Ok(opts.map_or(0, |o| o.device))
}

pub(crate) fn get(device: Option<i32>) -> PyResult<&'static Allocator> {
    allocator(default_device(device)?).map_err(py_err)
}

pub(crate) fn value_text(v: &Bound<'_, PyAny>) -> PyResult<String> {
    if v.is_instance_of::<PyBool>() {
        return Ok(if v.extract::<bool>()? { "true" } else { "false" }.into());
    }
    if v.is_instance_of::<PyInt>()
        || v.is_instance_of::<PyFloat>()
        || v.is_instance_of::<PyString>()
    {
        return Ok(v.str()?.to_string());
    }
    Err(PyValueError::new_err(format!(
        "a value of type {} is not an option value (give a str, int, float or bool)",
        v.get_type().name()?
    )))
}

/// Version of the package.
const VERSION: &str = env!("CARGO_PKG_VERSION");

#[pymodule]
fn _moonbright(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", VERSION)?;
    m.add("ENV_VAR", conf::ENV_VAR)?;
    m.add(
        "CONF_KEYS",
        conf::KEYS.iter().map(|(k, a)| (k.to_string(), a.to_string())).collect::<Vec<_>>(),
    )?;
    m.add_class::<growable::Growable>()?;
    m.add_function(wrap_pyfunction!(settings::configure, m)?)?;
    m.add_function(wrap_pyfunction!(settings::_use_torch_contract, m)?)?;
    m.add_function(wrap_pyfunction!(sleep::tag_enter, m)?)?;
    m.add_function(wrap_pyfunction!(sleep::tag_restore, m)?)?;
    m.add_function(wrap_pyfunction!(sleep::current_tag, m)?)?;
    m.add_function(wrap_pyfunction!(sleep::sleep_tag, m)?)?;
    m.add_function(wrap_pyfunction!(sleep::wake_tag, m)?)?;
    m.add_function(wrap_pyfunction!(sleep::tags_info, m)?)?;
    m.add_function(wrap_pyfunction!(sleep::host_memory, m)?)?;
    m.add_function(wrap_pyfunction!(sleep::release_host_memory, m)?)?;
    m.add_function(wrap_pyfunction!(sleep::reserve_host_memory, m)?)?;
    m.add_function(wrap_pyfunction!(ipc::ipc_send, m)?)?;
    m.add_function(wrap_pyfunction!(ipc::ipc_recv, m)?)?;
    m.add_function(wrap_pyfunction!(ipc::ipc_close, m)?)?;
    m.add_function(wrap_pyfunction!(ipc::ipc_imports, m)?)?;
    m.add_function(wrap_pyfunction!(ipc::ipc_export, m)?)?;
    m.add_function(wrap_pyfunction!(ipc::ipc_import, m)?)?;
    m.add_function(wrap_pyfunction!(ipc::ipc_owner, m)?)?;
    m.add_function(wrap_pyfunction!(settings::parse_conf, m)?)?;
    m.add_function(wrap_pyfunction!(settings::options, m)?)?;
    m.add_function(wrap_pyfunction!(settings::is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(settings::backend, m)?)?;
    m.add_function(wrap_pyfunction!(settings::last_error, m)?)?;
    m.add_function(wrap_pyfunction!(settings::clear_last_error, m)?)?;
    m.add_function(wrap_pyfunction!(stats::memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(stats::reset_peak_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(stats::reset_accumulated_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(tools::cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(tools::nvrtc_version, m)?)?;
    m.add_function(wrap_pyfunction!(tools::_nvrtc_compile, m)?)?;
    m.add_function(wrap_pyfunction!(stats::empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(stats::record_memory_history, m)?)?;
    m.add_function(wrap_pyfunction!(stats::snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(limits::cap, m)?)?;
    m.add_function(wrap_pyfunction!(limits::page_size, m)?)?;
    m.add_function(wrap_pyfunction!(limits::enable_peer_access, m)?)?;
    m.add_function(wrap_pyfunction!(limits::peers, m)?)?;
    m.add_function(wrap_pyfunction!(limits::check_invariants, m)?)?;
    m.add_function(wrap_pyfunction!(streams::record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(streams::begin_graph_capture, m)?)?;
    m.add_function(wrap_pyfunction!(streams::capture_starting, m)?)?;
    m.add_function(wrap_pyfunction!(streams::capture_finished, m)?)?;
    m.add_function(wrap_pyfunction!(streams::end_graph_capture, m)?)?;
    m.add_function(wrap_pyfunction!(streams::graph_replayed, m)?)?;
    m.add_function(wrap_pyfunction!(streams::release_graph_pool, m)?)?;
    m.add_function(wrap_pyfunction!(streams::graph_pool_free, m)?)?;
    m.add_function(wrap_pyfunction!(streams::begin_allocate_to_pool, m)?)?;
    m.add_function(wrap_pyfunction!(streams::end_allocate_to_pool, m)?)?;
    m.add_function(wrap_pyfunction!(streams::graph_pool_live, m)?)?;
    m.add_function(wrap_pyfunction!(streams::set_graph_pool_live, m)?)?;
    m.add_function(wrap_pyfunction!(streams::free_async, m)?)?;
    m.add_function(wrap_pyfunction!(limits::set_cap, m)?)?;
    m.add_function(wrap_pyfunction!(limits::set_memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(limits::memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(streams::_write, m)?)?;
    m.add_function(wrap_pyfunction!(streams::_read, m)?)?;
    m.add_function(wrap_pyfunction!(tools::_set_torch_oom_type, m)?)?;
    paged::register(m)?;
    Ok(())
}
