//! `moonbright._moonbright`: MoonBright's Python extension module, and the C entry points
//! PyTorch's `CUDAPluggableAllocator` loads from this same shared library.
//!
//! One allocator per CUDA device, process-wide, created at its first use from
//! `MOONBRIGHT_ALLOC_CONF` (and `configure(**kwargs)` if called before). The C entry points never
//! unwind: a panic or an error returns null (or is ignored, for free) and leaves its message
//! for `last_error()`.

mod growable;
mod paged;
mod stacks;

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};

use moonbright::conf;
use moonbright::core::history::{self, BlockState};
use moonbright::devices::Devices;
use moonbright::{Allocator, BackendKind, CallKind, Error, Options, Stat, Stats, StreamHandle};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString};

/// One allocator per device, created at first use.
static DEVICES: Devices = Devices::new();

/// Configuration for allocators not created yet; taken under this lock when one is created.
struct Config {
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

static CONFIG: Mutex<Config> = Mutex::new(Config {
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
const TORCH_CONTRACT: [&str; 2] = ["captures_announced", "deferred_free_events"];

/// The last error met by an entry point: its message, and whether it was out of memory.
static LAST_ERROR: Mutex<Option<(String, bool)>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn set_last_error(message: String, oom: bool) {
    *lock(&LAST_ERROR) = Some((message, oom));
}

fn is_oom(e: &Error) -> bool {
    matches!(e, Error::OutOfMemory { .. } | Error::TooLarge { .. })
}

/// The options new allocators get: `configure`'s, else `MOONBRIGHT_ALLOC_CONF`'s; under
/// `moonbright.torch.enable()`, with PyTorch's contract where the user left it unset.
fn base_options(cfg: &Config) -> Result<Options, Error> {
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

fn device_index(device: i32) -> Result<usize, String> {
    Devices::index(device)
}

/// The allocator of `device`, created on first use (with `configure`'s options, else
/// `MOONBRIGHT_ALLOC_CONF`'s) and peered with the others (`Devices::get_or_create`).
fn allocator(device: i32) -> Result<&'static Allocator, String> {
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

fn created() -> impl Iterator<Item = (usize, &'static Allocator)> {
    DEVICES.created()
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

// ---------------------------------------------------------------------------------------------
// C entry points (PyTorch's CUDAPluggableAllocator signatures).

/// Allocates `size` bytes on `device` for use on `stream`. Returns null for a size of 0 (what
/// PyTorch asks for empty tensors), and null on any error, leaving the message for
/// `moonbright.last_error()`.
#[no_mangle]
pub extern "C" fn moonbright_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    alloc_entry(size, device, stream, false)
}

/// `moonbright_alloc` for `moonbright.torch.pool()`, whose failures PyTorch's caching allocator
/// reports as its own out-of-memory error, without MoonBright's message. A segment asked for
/// while its stream is being captured (`torch.cuda.graph(g, pool=pool.id)`) goes to PyTorch's
/// graph-private pool, which keeps it until the graph is gone and its cache emptied: it comes
/// from memory no stream's queued work uses (`Allocator::malloc_for_graph`). A refusal for
/// graph capture, if any, is printed to stderr too, saying it is no lack of memory.
#[no_mangle]
pub extern "C" fn moonbright_pool_alloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    alloc_entry(size, device, stream, true)
}

/// The allocation entry points' body. `pool_mode`: for `moonbright.torch.pool()`, whose segments
/// asked for in a capture come from `malloc_for_graph`, and whose refusals are printed.
fn alloc_entry(size: isize, device: c_int, stream: *mut c_void, pool_mode: bool) -> *mut c_void {
    if size == 0 {
        return std::ptr::null_mut();
    }
    let r = catch_unwind(AssertUnwindSafe(|| {
        if size < 0 {
            return Err((format!("cannot allocate a negative size ({size} bytes)"), false, false));
        }
        let a = allocator(device).map_err(|e| (e, false, false))?;
        // Taken before the allocator's lock: waiting for the GIL must hold nothing of ours.
        let stack = stacks::for_alloc();
        let malloc = || match a.malloc_async(size as usize, StreamHandle(stream as u64)) {
            Err(Error::StreamCapture { .. }) if pool_mode => a.malloc_for_graph(size as usize),
            r => r,
        };
        let r = if stack == 0 { malloc() } else { history::with_context(stack, malloc) };
        if let (Ok(p), true) = (&r, stack != 0) {
            stacks::note_live(device as usize, *p, stack);
        }
        r.map_err(|e| {
            let capture = matches!(e, Error::StreamCapture { .. });
            (format!("device {device}: {e}"), is_oom(&e), capture)
        })
    }));
    match r {
        Ok(Ok(p)) => p as *mut c_void,
        Ok(Err((msg, oom, capture))) => {
            if capture && pool_mode {
                let _ = catch_unwind(|| {
                    eprintln!("moonbright: {msg} (PyTorch reports this as out of memory)")
                });
            }
            set_last_error(msg, oom);
            std::ptr::null_mut()
        }
        Err(p) => {
            set_last_error(format!("internal error (panic): {}", panic_message(&*p)), false);
            std::ptr::null_mut()
        }
    }
}

/// Frees `ptr` on `device`, stream-ordered on `stream`. A null pointer is ignored; an error
/// (an unknown pointer, say) is printed to stderr and left for `moonbright.last_error()`:
/// PyTorch's deleters cannot report one.
#[no_mangle]
pub extern "C" fn moonbright_free(
    ptr: *mut c_void,
    size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    let _ = size;
    if ptr.is_null() {
        return;
    }
    let r = catch_unwind(AssertUnwindSafe(|| {
        let a = allocator(device)?;
        // Forgotten before the free: once freed, another thread may get the same address and
        // note its own frames there.
        stacks::forget_live(device as usize, ptr as u64);
        let free = || a.free_async(ptr as u64, StreamHandle(stream as u64));
        match stacks::for_free() {
            0 => free(),
            stack => history::with_context(stack, free),
        }
        .map_err(|e| format!("device {device}: {e}"))?;
        Ok(())
    }));
    let msg = match r {
        Ok(Ok(())) => return,
        Ok(Err(msg)) => msg,
        Err(p) => format!("internal error (panic): {}", panic_message(&*p)),
    };
    let _ = catch_unwind(|| eprintln!("moonbright: free failed: {msg}"));
    set_last_error(msg, false);
}

/// Copies the last error message into `buf` (at most `len - 1` bytes and a NUL) and returns its
/// full length in bytes. With a null `buf`, only the length.
///
/// # Safety
///
/// `buf` is null or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn moonbright_last_error_copy(buf: *mut c_char, len: usize) -> usize {
    catch_unwind(|| {
        let g = lock(&LAST_ERROR);
        let msg = g.as_ref().map(|(m, _)| m.as_bytes()).unwrap_or(b"");
        if !buf.is_null() && len > 0 {
            let n = msg.len().min(len - 1);
            // SAFETY: the caller gives `len` writable bytes at `buf`; n + 1 <= len.
            unsafe {
                std::ptr::copy_nonoverlapping(msg.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
        }
        msg.len()
    })
    .unwrap_or(0)
}

/// 1 when the last error was out of memory, else 0.
#[no_mangle]
pub extern "C" fn moonbright_last_error_is_oom() -> c_int {
    catch_unwind(|| lock(&LAST_ERROR).as_ref().is_some_and(|(_, oom)| *oom) as c_int).unwrap_or(0)
}

extern "C-unwind" {
    fn moonbright_cxx_torch_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void;
}
extern "C" {
    fn moonbright_cxx_set_oom_type(ty: *mut c_void);
}

/// `moonbright_alloc` for PyTorch's global allocator: on failure it throws a C++ exception that
/// PyTorch raises in Python (torch.OutOfMemoryError on out of memory, once
/// `moonbright.torch.enable()` has set that up), instead of returning null, which PyTorch's
/// CUDAPluggableAllocator would hand out as a tensor's data pointer. Never call it from
/// anything but C++ that catches exceptions.
#[no_mangle]
#[allow(clippy::not_unsafe_ptr_arg_deref)] // `stream` is an opaque handle, never dereferenced
pub extern "C-unwind" fn moonbright_torch_alloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // SAFETY: a plain C++ function; the exception it may throw unwinds through this frame,
    // which owns nothing, to PyTorch's C++ caller (the "C-unwind" ABI allows it).
    unsafe { moonbright_cxx_torch_alloc(size, device, stream) }
}

// ---------------------------------------------------------------------------------------------
// Python functions.

fn py_err(msg: impl Into<String>) -> PyErr {
    PyRuntimeError::new_err(msg.into())
}

/// The device a call with `device=None` means: the calling thread's current CUDA device (the
/// device of its current context, which `torch.cuda.set_device` selects), else the configured
/// one (device 0 unless `MOONBRIGHT_ALLOC_CONF` or `configure` says otherwise).
fn default_device(device: Option<i32>) -> PyResult<i32> {
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

fn get(device: Option<i32>) -> PyResult<&'static Allocator> {
    allocator(default_device(device)?).map_err(py_err)
}

fn value_text(v: &Bound<'_, PyAny>) -> PyResult<String> {
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

/// Sets the options of the allocators not created yet: keyword arguments named as the keys of
/// `MOONBRIGHT_ALLOC_CONF`, applied over it. Raises ValueError naming a bad key or value, and
/// RuntimeError once an allocator exists.
#[pyfunction]
#[pyo3(signature = (**kwargs))]
fn configure(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
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
fn _use_torch_contract(on: bool) -> bool {
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
fn parse_conf(py: Python<'_>, text: &str) -> PyResult<Py<PyDict>> {
    let o = conf::parse_conf(text).map_err(|e| PyValueError::new_err(e.to_string()))?;
    options_dict(py, &o)
}

fn options_dict(py: Python<'_>, o: &Options) -> PyResult<Py<PyDict>> {
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
fn options(py: Python<'_>, device: Option<i32>) -> PyResult<Py<PyDict>> {
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
fn is_initialized(device: Option<i32>) -> PyResult<bool> {
    let i = device_index(default_device(device)?).map_err(py_err)?;
    Ok(DEVICES.get(i as i32).is_some())
}

/// The backend of `device`'s allocator: "cuda" or "host" (creates it).
#[pyfunction]
#[pyo3(signature = (device=None))]
fn backend(device: Option<i32>) -> PyResult<&'static str> {
    Ok(get(device)?.backend_name())
}

/// The last error message of an allocation entry point, or None.
#[pyfunction]
fn last_error() -> Option<String> {
    lock(&LAST_ERROR).as_ref().map(|(m, _)| m.clone())
}

/// Forgets the last error.
#[pyfunction]
fn clear_last_error() {
    *lock(&LAST_ERROR) = None;
}

fn put_stat(out: &mut BTreeMap<String, i64>, prefix: &str, s: &Stat) {
    out.insert(format!("{prefix}.current"), s.current as i64);
    out.insert(format!("{prefix}.peak"), s.peak as i64);
    out.insert(format!("{prefix}.allocated"), s.allocated as i64);
    out.insert(format!("{prefix}.freed"), s.freed as i64);
}

/// PyTorch's flat statistics from MoonBright's.
fn flat_stats(s: &Stats, cap: u64, page: usize) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    let zero = Stat::default();
    // PyTorch's families, each for the pools all / large_pool / small_pool. MoonBright has one
    // pool: large_pool repeats all, small_pool is zero.
    let families: [(&str, &Stat); 9] = [
        ("allocated_bytes", &s.allocated_bytes),
        ("requested_bytes", &s.allocated_bytes),
        ("active_bytes", &s.active_bytes),
        ("reserved_bytes", &s.reserved_bytes),
        ("inactive_split_bytes", &zero),
        ("allocation", &s.allocations),
        ("active", &s.allocations),
        ("segment", &s.chunks),
        ("inactive_split", &zero),
    ];
    for (name, stat) in families {
        put_stat(&mut out, &format!("{name}.all"), stat);
        put_stat(&mut out, &format!("{name}.large_pool"), stat);
        put_stat(&mut out, &format!("{name}.small_pool"), &zero);
    }
    put_stat(&mut out, "oversize_allocations", &zero);
    put_stat(&mut out, "oversize_segments", &zero);
    out.insert("num_alloc_retries".into(), 0);
    out.insert("num_ooms".into(), s.num_ooms as i64);
    out.insert("num_sync_all_streams".into(), s.pending_free_waits as i64);
    out.insert("num_device_alloc".into(), s.driver_calls.get(CallKind::Map) as i64);
    out.insert("num_device_free".into(), s.driver_calls.get(CallKind::Unmap) as i64);
    out.insert("max_split_size".into(), -1);
    // MoonBright's own.
    for (name, stat) in s.named() {
        put_stat(&mut out, &format!("moonbright.{name}"), stat);
    }
    for (name, v) in [
        ("cache_hits", s.cache_hits),
        ("window_hits", s.window_hits),
        ("events_stocked", s.events_stocked),
        ("request_maps", s.request_maps),
        ("request_mapped_handles", s.request_mapped_handles),
        ("subpage_allocations", s.subpage_allocations),
        ("carved_allocations", s.carved_allocations),
        ("carved_arenas", s.carved_arenas),
        ("carved_chunks_uncarved", s.carved_chunks_uncarved),
        ("cached_ranges_stolen", s.cached_ranges_stolen),
        ("cached_ranges_split", s.cached_ranges_split),
        ("cached_ranges_joined", s.cached_ranges_joined),
        ("chunk_splits", s.chunk_splits),
        ("unmap_batches", s.unmap_batches),
        ("unmap_calls_in_batches", s.unmap_calls_in_batches),
        ("deferred_errors", s.deferred_errors),
        ("growable_resizes", s.growable_resizes),
        ("pending_free_waits", s.pending_free_waits),
        ("joined_frees", s.joined_frees),
        ("growable_reclaims", s.growable_reclaims),
        ("cap_bytes", cap),
        ("page_size", page as u64),
        ("driver_calls.total", s.driver_calls.total()),
    ] {
        out.insert(format!("moonbright.{name}"), v as i64);
    }
    for (kind, n) in s.driver_calls.iter() {
        out.insert(format!("moonbright.driver_calls.{}", kind.key()), n as i64);
    }
    out
}

/// Statistics of `device`'s allocator with PyTorch's flat key names
/// (`allocated_bytes.all.current`, ...) and MoonBright's own under `moonbright.`.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn memory_stats(py: Python<'_>, device: Option<i32>) -> PyResult<Py<PyDict>> {
    let a = get(device)?;
    let flat = flat_stats(&a.stats(), a.cap(), a.page_size());
    let d = PyDict::new(py);
    for (k, v) in flat {
        d.set_item(k, v)?;
    }
    d.set_item(
        "moonbright.reserved_over_allocated_peak",
        a.stats().reserved_over_allocated_peak(),
    )?;
    Ok(d.unbind())
}

/// Resets every peak to its current value.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn reset_peak_memory_stats(device: Option<i32>) -> PyResult<()> {
    get(device)?.reset_peak_stats();
    Ok(())
}

/// Zeroes the cumulative figures of `device`'s allocator (PyTorch's
/// `reset_accumulated_memory_stats`, which `moonbright.torch.enable()` routes here): every
/// statistic's `.allocated` and `.freed`, `num_ooms`, `num_sync_all_streams`,
/// `num_device_alloc` and `num_device_free`, and MoonBright's own counters. Current values and
/// peaks stay.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn reset_accumulated_memory_stats(device: Option<i32>) -> PyResult<()> {
    get(device)?.reset_accumulated_stats();
    Ok(())
}

/// Gives every physical page no allocation uses back to the driver; returns the bytes released.
/// With `wait` (the default, as `torch.cuda.empty_cache` under PyTorch's own allocator), first
/// waits, without the GIL, for the stream work of every pending free; without it, such frees'
/// memory stays held.
#[pyfunction]
#[pyo3(signature = (device=None, wait=true))]
fn empty_cache(py: Python<'_>, device: Option<i32>, wait: bool) -> PyResult<u64> {
    let a = get(device)?;
    let r = if wait { py.allow_threads(|| a.empty_cache()) } else { a.release_unused() };
    r.map_err(|e| py_err(e.to_string()))
}

/// Starts (or with enabled=False stops) recording up to `max_entries` allocation events, for
/// `snapshot()`'s `device_traces`. With `device=None` it applies to every allocator that exists
/// and to those created later. `context` records the Python stack of each request, in the
/// `frames` of its trace entries and of the blocks it holds, as PyTorch's
/// `_record_memory_history(context=...)`: None (no frames), "state" or "alloc" (allocations),
/// "all" (allocations and frees). Frames cost a trip through the GIL per request; without
/// them the entry points pay one atomic load. Stopping with `device=None` forgets them.
#[pyfunction]
#[pyo3(signature = (enabled=true, max_entries=100_000, device=None, context=None))]
fn record_memory_history(
    py: Python<'_>,
    enabled: bool,
    max_entries: usize,
    device: Option<i32>,
    context: Option<&str>,
) -> PyResult<()> {
    let mode = stacks::Mode::parse(context).map_err(PyValueError::new_err)?;
    let n = enabled.then_some(max_entries.max(1));
    match device {
        Some(d) => allocator(d).map_err(py_err)?.record_history(n),
        None => {
            let mut cfg = lock(&CONFIG);
            cfg.history = n;
            for (_, a) in created() {
                a.record_history(n);
            }
        }
    }
    if enabled {
        stacks::set_mode(py, mode)?;
    } else if device.is_none() {
        stacks::set_mode(py, stacks::Mode::Off)?;
    }
    Ok(())
}

/// A snapshot in the format of `torch.cuda.memory._snapshot()`: `segments` of every allocator
/// (or of `device`'s) and `device_traces`, one list per device up to the highest, for PyTorch's
/// memory viewer (`torch.cuda._memory_viz`).
#[pyfunction]
#[pyo3(signature = (device=None))]
fn snapshot(py: Python<'_>, device: Option<i32>) -> PyResult<Py<PyDict>> {
    let devices: Vec<(usize, &'static Allocator)> = match device {
        Some(d) => vec![(device_index(d).map_err(py_err)?, allocator(d).map_err(py_err)?)],
        None => created().collect(),
    };
    let segments = PyList::empty(py);
    let n_traces = devices.iter().map(|(i, _)| i + 1).max().unwrap_or(0);
    let traces: Vec<Bound<'_, PyList>> = (0..n_traces).map(|_| PyList::empty(py)).collect();
    for (i, a) in &devices {
        // Stream frees whose work has completed show as completed, not as still pending.
        a.poll();
        for seg in a.segments() {
            let blocks = PyList::empty(py);
            let (mut allocated, mut requested) = (0u64, 0u64);
            for b in &seg.blocks {
                let active = b.state == BlockState::ActiveAllocated;
                if active {
                    allocated += b.size;
                    requested += b.requested_size;
                }
                let bd = PyDict::new(py);
                bd.set_item("address", b.addr)?;
                bd.set_item("size", b.size)?;
                bd.set_item("requested_size", b.requested_size)?;
                bd.set_item("state", if active { "active_allocated" } else { "inactive" })?;
                let frames =
                    if active { stacks::block_frames(py, *i, b.addr)? } else { PyList::empty(py) };
                bd.set_item("frames", frames)?;
                blocks.append(bd)?;
            }
            let sd = PyDict::new(py);
            sd.set_item("device", *i)?;
            sd.set_item("address", seg.addr)?;
            sd.set_item("total_size", seg.size)?;
            sd.set_item("allocated_size", allocated)?;
            sd.set_item("active_size", allocated)?;
            sd.set_item("requested_size", requested)?;
            sd.set_item("stream", seg.stream)?;
            sd.set_item("segment_type", "large")?;
            sd.set_item("segment_pool_id", (0, 0))?;
            sd.set_item("is_expandable", true)?;
            sd.set_item("frames", PyList::empty(py))?;
            sd.set_item("blocks", blocks)?;
            sd.set_item("moonbright_kind", seg.kind)?;
            sd.set_item("moonbright_chunks", seg.chunks)?;
            segments.append(sd)?;
        }
        for ev in a.history() {
            let e = PyDict::new(py);
            e.set_item("action", ev.action.torch_name())?;
            e.set_item("addr", ev.addr)?;
            e.set_item("size", ev.size)?;
            e.set_item("stream", ev.stream)?;
            e.set_item("time_us", ev.time_us)?;
            e.set_item("frames", stacks::frames(py, ev.context)?)?;
            traces[*i].append(e)?;
        }
    }
    let out = PyDict::new(py);
    out.set_item("segments", segments)?;
    out.set_item("device_traces", PyList::new(py, traces)?)?;
    Ok(out.unbind())
}

/// The cap on physical bytes of `device`'s allocator.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn cap(device: Option<i32>) -> PyResult<u64> {
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
fn set_cap(bytes: u64, device: Option<i32>) -> PyResult<u64> {
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
fn set_memory_fraction(fraction: f64, device: Option<i32>) -> PyResult<u64> {
    if !(0.0..=1.0).contains(&fraction) {
        return Err(PyValueError::new_err(format!("memory fraction {fraction} is not in [0, 1]")));
    }
    let a = get(device)?;
    set_cap((fraction * a.total_memory() as f64) as u64, device)
}

/// The cap over the device's memory (PyTorch's `get_per_process_memory_fraction`).
#[pyfunction]
#[pyo3(signature = (device=None))]
fn memory_fraction(device: Option<i32>) -> PyResult<f64> {
    let a = get(device)?;
    Ok(a.cap() as f64 / a.total_memory() as f64)
}

/// Grants GPU `peer` access to the memory of `device`'s allocator, mapped now and later (see
/// `moonbright.enable_peer_access`). Raises RuntimeError when the two GPUs cannot reach each other
/// peer to peer.
#[pyfunction]
#[pyo3(signature = (peer, device=None))]
fn enable_peer_access(peer: i32, device: Option<i32>) -> PyResult<()> {
    get(device)?.enable_peer_access(peer).map_err(|e| py_err(e.to_string()))
}

/// The GPUs granted access to the memory of `device`'s allocator.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn peers(device: Option<i32>) -> PyResult<Vec<i32>> {
    Ok(get(device)?.peers())
}

/// Sends the live MoonBright allocation at `ptr` to another process over `socket_fd`, a
/// connected Unix socket (`socket.fileno()`): its chunks travel as file descriptors. The
/// allocation must stay live until the receiver has closed it. `device=None` means the
/// allocator that holds `ptr`. Raises RuntimeError for a pointer that is not a live allocation,
/// with sharing off (option `ipc`), or when the socket fails.
#[pyfunction]
#[pyo3(signature = (ptr, socket_fd, device=None))]
fn ipc_send(py: Python<'_>, ptr: u64, socket_fd: i32, device: Option<i32>) -> PyResult<()> {
    let a = holder(ptr, device)?;
    let socket = borrowed_fd(socket_fd)?;
    py.allow_threads(|| a.export(ptr)?.send(socket)).map_err(|e| py_err(e.to_string()))
}

/// The allocator of `device`, or with `device=None` the one that holds `ptr` (else the
/// current device's).
fn holder(ptr: u64, device: Option<i32>) -> PyResult<&'static Allocator> {
    match device {
        None => match DEVICES.owner(ptr) {
            Some((_, a)) => Ok(a),
            None => get(None),
        },
        Some(d) => get(Some(d)),
    }
}

/// Exports the live allocation at `ptr` for a transport of the caller's: the bytes that
/// describe it and one file descriptor per chunk, which the caller owns and must close
/// (`moonbright.ipc` hands them to `multiprocessing`). `ipc_import` reverses it.
#[pyfunction]
#[pyo3(signature = (ptr, device=None))]
fn ipc_export(
    py: Python<'_>,
    ptr: u64,
    device: Option<i32>,
) -> PyResult<(Py<pyo3::types::PyBytes>, Vec<i32>)> {
    use std::os::fd::IntoRawFd;
    let a = holder(ptr, device)?;
    let (bytes, fds) =
        py.allow_threads(|| a.export(ptr)).map_err(|e| py_err(e.to_string()))?.into_parts();
    let fds = fds.into_iter().map(|fd| fd.into_raw_fd()).collect();
    Ok((pyo3::types::PyBytes::new(py, &bytes).unbind(), fds))
}

/// Maps on `device` what `ipc_export` gave in another process (its bytes, and descriptors of
/// the same files, which stay the caller's); returns the address and size, as `ipc_recv`.
#[pyfunction]
#[pyo3(signature = (data, fds, device=None))]
fn ipc_import(
    py: Python<'_>,
    data: &[u8],
    fds: Vec<i32>,
    device: Option<i32>,
) -> PyResult<(u64, u64)> {
    let a = get(device)?;
    let owned = fds
        .iter()
        .map(|&fd| {
            borrowed_fd(fd)?
                .try_clone_to_owned()
                .map_err(|e| py_err(format!("dup of descriptor {fd}: {e}")))
        })
        .collect::<PyResult<Vec<_>>>()?;
    py.allow_threads(|| {
        let e = moonbright::Export::from_parts(data, owned)?;
        Ok((a.import(&e)?, e.size()))
    })
    .map_err(|e: Error| py_err(e.to_string()))
}

/// The device whose allocator holds a live allocation starting at `ptr`, or None.
#[pyfunction]
fn ipc_owner(ptr: u64) -> Option<usize> {
    DEVICES.owner(ptr).map(|(d, _)| d)
}

/// Receives an allocation `ipc_send` sent over `socket_fd` and maps it on `device`; returns its
/// address and size. `ipc_close` unmaps it, once the work that uses it has completed.
#[pyfunction]
#[pyo3(signature = (socket_fd, device=None))]
fn ipc_recv(py: Python<'_>, socket_fd: i32, device: Option<i32>) -> PyResult<(u64, u64)> {
    let a = get(device)?;
    let socket = borrowed_fd(socket_fd)?;
    py.allow_threads(|| {
        let e = moonbright::Export::recv(socket)?;
        Ok((a.import(&e)?, e.size()))
    })
    .map_err(|e: Error| py_err(e.to_string()))
}

/// Unmaps memory `ipc_recv` mapped on `device`. The unmap is immediate.
#[pyfunction]
#[pyo3(signature = (ptr, device=None))]
fn ipc_close(ptr: u64, device: Option<i32>) -> PyResult<()> {
    get(device)?.close_import(ptr).map_err(|e| py_err(e.to_string()))
}

/// The imports `device`'s allocator holds, as (address, size).
#[pyfunction]
#[pyo3(signature = (device=None))]
fn ipc_imports(device: Option<i32>) -> PyResult<Vec<(u64, u64)>> {
    Ok(get(device)?.imports())
}

fn borrowed_fd(fd: i32) -> PyResult<std::os::fd::BorrowedFd<'static>> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!("descriptor {fd} is not open")));
    }
    // SAFETY: the caller passed an open descriptor (`socket.fileno()`, or one it holds) and
    // keeps it open for the whole call, which is the borrow's only use.
    Ok(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
}

/// The page size (mapping granularity) of `device`'s allocator.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn page_size(device: Option<i32>) -> PyResult<usize> {
    Ok(get(device)?.page_size())
}

/// Checks every invariant of `device`'s allocator; raises RuntimeError naming a broken one.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn check_invariants(device: Option<i32>) -> PyResult<()> {
    get(device)?.check_invariants().map_err(py_err)
}

/// Notes that work queued on `stream` (a CUstream handle as an int, 0 for the default stream)
/// uses the allocation at `ptr`, so that its stream-ordered free waits for that work too:
/// PyTorch's `Tensor.record_stream`, which `moonbright.torch.enable()` routes here. Returns True.
/// A pointer that is not the start of a live allocation, or a growable one, raises
/// RuntimeError, or with `missing_ok` returns False (PyTorch ignores storages its allocator did
/// not make, such as a growable buffer viewed as a tensor).
#[pyfunction]
#[pyo3(signature = (ptr, stream, device=None, missing_ok=false))]
fn record_stream(ptr: u64, stream: u64, device: Option<i32>, missing_ok: bool) -> PyResult<bool> {
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
fn begin_graph_capture(stream: u64, pool: (u64, u64), device: Option<i32>) -> PyResult<()> {
    get(device)?.begin_graph_capture(StreamHandle(stream), pool).map_err(|e| py_err(e.to_string()))
}

/// Announces that a CUDA graph capture is about to begin on `device` (before the driver begins
/// it). With option `captures_announced:true`, streams are checked for a capture only between
/// this and the matching `capture_finished`. `moonbright.torch.enable()` calls both from
/// `torch.cuda.CUDAGraph`.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn capture_starting(device: Option<i32>) -> PyResult<()> {
    get(device)?.capture_starting();
    Ok(())
}

/// Announces that a capture announced with `capture_starting` has ended, or failed to begin.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn capture_finished(device: Option<i32>) -> PyResult<()> {
    get(device)?.capture_finished();
    Ok(())
}

/// Ends the capture begun on `stream` by `begin_graph_capture`, after the graph's capture ended.
#[pyfunction]
#[pyo3(signature = (stream, device=None))]
fn end_graph_capture(stream: u64, device: Option<i32>) -> PyResult<()> {
    get(device)?.end_graph_capture(StreamHandle(stream)).map_err(|e| py_err(e.to_string()))
}

/// Notes that a graph of `pool` was replayed on `stream`: the pool's memory goes back to other
/// allocations only after the work queued there before its release.
#[pyfunction]
#[pyo3(signature = (pool, stream, device=None))]
fn graph_replayed(pool: (u64, u64), stream: u64, device: Option<i32>) -> PyResult<()> {
    get(device)?.graph_replayed(pool, StreamHandle(stream));
    Ok(())
}

/// One graph of `pool` is gone; with the last, the pool's memory goes back to other allocations.
#[pyfunction]
#[pyo3(signature = (pool, device=None))]
fn release_graph_pool(pool: (u64, u64), device: Option<i32>) -> PyResult<()> {
    get(device)?.release_graph_pool(pool).map_err(|e| py_err(e.to_string()))
}

/// Routes this thread's allocations outside captures into graph pool `pool` until
/// `end_allocate_to_pool()` (PyTorch's `beginAllocateCurrentThreadToPool`, which CUDA-graph trees
/// use for their warm-up runs); one more user of the pool, released with `release_graph_pool`.
#[pyfunction]
#[pyo3(signature = (pool, device=None))]
fn begin_allocate_to_pool(pool: (u64, u64), device: Option<i32>) -> PyResult<()> {
    get(device)?.begin_allocate_to_pool(pool).map_err(|e| py_err(e.to_string()))
}

/// Ends this thread's route into a graph pool; returns the pool.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn end_allocate_to_pool(device: Option<i32>) -> PyResult<(u64, u64)> {
    get(device)?.end_allocate_to_pool().map_err(|e| py_err(e.to_string()))
}

/// The live blocks of graph pool `pool`: a list of (pointer, usable bytes) in address order.
#[pyfunction]
#[pyo3(signature = (pool, device=None))]
fn graph_pool_live(pool: (u64, u64), device: Option<i32>) -> PyResult<Vec<(u64, u64)>> {
    Ok(get(device)?.graph_pool_live(pool))
}

/// Makes `keep` (pointers) the live set of graph pool `pool`, as PyTorch's
/// `setCheckpointPoolState`: returns (revived, freed) pointers. Blocks freed go back to the pool
/// as freed on `stream`.
#[pyfunction]
#[pyo3(signature = (pool, keep, stream, device=None))]
fn set_graph_pool_live(
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
fn free_async(ptr: u64, stream: u64, device: Option<i32>) -> PyResult<()> {
    let d = default_device(device)?;
    let a = get(Some(d))?;
    stacks::forget_live(d as usize, ptr); // before: the address may be reused once freed
    a.free_async(ptr, StreamHandle(stream)).map_err(|e| py_err(e.to_string()))
}

/// (blocks, bytes) that graph pools hold free for their graphs on `device`.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn graph_pool_free(device: Option<i32>) -> PyResult<(usize, u64)> {
    Ok(get(device)?.graph_pool_free())
}

/// Copies bytes into device memory (synchronous; for tests).
#[pyfunction]
#[pyo3(signature = (ptr, data, device=None))]
fn _write(ptr: u64, data: &[u8], device: Option<i32>) -> PyResult<()> {
    get(device)?.write(ptr, data).map_err(|e| py_err(e.to_string()))
}

/// Reads bytes of device memory (synchronous; for tests).
#[pyfunction]
#[pyo3(signature = (ptr, len, device=None))]
fn _read(ptr: u64, len: usize, device: Option<i32>) -> PyResult<Vec<u8>> {
    let mut buf = vec![0u8; len];
    get(device)?.read(ptr, &mut buf).map_err(|e| py_err(e.to_string()))?;
    Ok(buf)
}

/// Registers the Python exception class (torch.OutOfMemoryError) that `moonbright_torch_alloc`
/// raises on out of memory; None switches back to RuntimeError. The class is kept alive.
#[pyfunction]
#[pyo3(signature = (cls))]
fn _set_torch_oom_type(cls: Option<Bound<'_, PyAny>>) -> PyResult<()> {
    static KEEP: Mutex<Option<Py<PyAny>>> = Mutex::new(None);
    let ptr = cls.as_ref().map(|c| c.as_ptr() as *mut c_void).unwrap_or(std::ptr::null_mut());
    *lock(&KEEP) = cls.map(|c| c.unbind());
    // SAFETY: stores a pointer; the object stays alive in KEEP until replaced, and replacing
    // happens only after the pointer was swapped out here.
    unsafe { moonbright_cxx_set_oom_type(ptr) };
    Ok(())
}

/// Runs the `moonbright` command (`moonbright.cli`, the console script pip installs) with
/// `argv` (its first item the program's name) and returns its exit status: the same code as
/// the `moonbright` binary cargo builds (crates/moonbright-cli), without the GIL.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> i32 {
    py.allow_threads(|| {
        catch_unwind(AssertUnwindSafe(|| moonbright_cli::run(argv))).unwrap_or_else(|p| {
            eprintln!("moonbright: internal error (panic): {}", panic_message(&*p));
            101
        })
    })
}

/// The version of the libnvrtc MoonBright finds (where `MOONBRIGHT_NVRTC` says, which the
/// package points at pip's `nvidia-cuda-nvrtc`, else on the loader path), as (major, minor).
/// Raises RuntimeError saying where it looked when there is none. The paged pool compiles its
/// kernels with it.
#[pyfunction]
fn nvrtc_version() -> PyResult<(i32, i32)> {
    moonbright::nvrtc::version().map_err(py_err)
}

/// Compiles CUDA C `src` to PTX with that libnvrtc (for tests; no GPU needed).
#[pyfunction]
#[pyo3(signature = (src, name="moonbright.cu", options=Vec::new()))]
fn _nvrtc_compile(py: Python<'_>, src: &str, name: &str, options: Vec<String>) -> PyResult<String> {
    py.allow_threads(|| moonbright::nvrtc::compile_ptx(src, name, options)).map_err(py_err)
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
    m.add_function(wrap_pyfunction!(configure, m)?)?;
    m.add_function(wrap_pyfunction!(_use_torch_contract, m)?)?;
    m.add_function(wrap_pyfunction!(ipc_send, m)?)?;
    m.add_function(wrap_pyfunction!(ipc_recv, m)?)?;
    m.add_function(wrap_pyfunction!(ipc_close, m)?)?;
    m.add_function(wrap_pyfunction!(ipc_imports, m)?)?;
    m.add_function(wrap_pyfunction!(ipc_export, m)?)?;
    m.add_function(wrap_pyfunction!(ipc_import, m)?)?;
    m.add_function(wrap_pyfunction!(ipc_owner, m)?)?;
    m.add_function(wrap_pyfunction!(parse_conf, m)?)?;
    m.add_function(wrap_pyfunction!(options, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(backend, m)?)?;
    m.add_function(wrap_pyfunction!(last_error, m)?)?;
    m.add_function(wrap_pyfunction!(clear_last_error, m)?)?;
    m.add_function(wrap_pyfunction!(memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_accumulated_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_version, m)?)?;
    m.add_function(wrap_pyfunction!(_nvrtc_compile, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(record_memory_history, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(cap, m)?)?;
    m.add_function(wrap_pyfunction!(page_size, m)?)?;
    m.add_function(wrap_pyfunction!(enable_peer_access, m)?)?;
    m.add_function(wrap_pyfunction!(peers, m)?)?;
    m.add_function(wrap_pyfunction!(check_invariants, m)?)?;
    m.add_function(wrap_pyfunction!(record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(begin_graph_capture, m)?)?;
    m.add_function(wrap_pyfunction!(capture_starting, m)?)?;
    m.add_function(wrap_pyfunction!(capture_finished, m)?)?;
    m.add_function(wrap_pyfunction!(end_graph_capture, m)?)?;
    m.add_function(wrap_pyfunction!(graph_replayed, m)?)?;
    m.add_function(wrap_pyfunction!(release_graph_pool, m)?)?;
    m.add_function(wrap_pyfunction!(graph_pool_free, m)?)?;
    m.add_function(wrap_pyfunction!(begin_allocate_to_pool, m)?)?;
    m.add_function(wrap_pyfunction!(end_allocate_to_pool, m)?)?;
    m.add_function(wrap_pyfunction!(graph_pool_live, m)?)?;
    m.add_function(wrap_pyfunction!(set_graph_pool_live, m)?)?;
    m.add_function(wrap_pyfunction!(free_async, m)?)?;
    m.add_function(wrap_pyfunction!(set_cap, m)?)?;
    m.add_function(wrap_pyfunction!(set_memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(_write, m)?)?;
    m.add_function(wrap_pyfunction!(_read, m)?)?;
    m.add_function(wrap_pyfunction!(_set_torch_oom_type, m)?)?;
    paged::register(m)?;
    Ok(())
}
