//! Statistics and history: `memory_stats` in PyTorch's flat keys, the resets, `empty_cache`,
//! the allocation history and `snapshot`.

use std::collections::BTreeMap;

use moonbright::core::history::BlockState;
use moonbright::{Allocator, CallKind, Stat, Stats};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::stacks;
use crate::{allocator, created, device_index, get, lock, py_err, CONFIG};

pub(crate) fn put_stat(out: &mut BTreeMap<String, i64>, prefix: &str, s: &Stat) {
    out.insert(format!("{prefix}.current"), s.current as i64);
    out.insert(format!("{prefix}.peak"), s.peak as i64);
    out.insert(format!("{prefix}.allocated"), s.allocated as i64);
    out.insert(format!("{prefix}.freed"), s.freed as i64);
}

/// PyTorch's flat statistics from MoonBright's.
pub(crate) fn flat_stats(s: &Stats, cap: u64, page: usize) -> BTreeMap<String, i64> {
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
    let held = &s.held_at_peak;
    out.insert("moonbright.held_at_peak.reserved".into(), held.reserved as i64);
    for (part, n) in held.parts() {
        out.insert(format!("moonbright.held_at_peak.{part}"), n as i64);
    }
    out
}

/// Statistics of `device`'s allocator with PyTorch's flat key names
/// (`allocated_bytes.all.current`, ...) and MoonBright's own under `moonbright.`.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn memory_stats(py: Python<'_>, device: Option<i32>) -> PyResult<Py<PyDict>> {
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
pub(crate) fn reset_peak_memory_stats(device: Option<i32>) -> PyResult<()> {
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
pub(crate) fn reset_accumulated_memory_stats(device: Option<i32>) -> PyResult<()> {
    get(device)?.reset_accumulated_stats();
    Ok(())
}

/// Gives every physical page no allocation uses back to the driver; returns the bytes released.
/// With `wait` (the default, as `torch.cuda.empty_cache` under PyTorch's own allocator), first
/// waits, without the GIL, for the stream work of every pending free; without it, such frees'
/// memory stays held.
#[pyfunction]
#[pyo3(signature = (device=None, wait=true))]
pub(crate) fn empty_cache(py: Python<'_>, device: Option<i32>, wait: bool) -> PyResult<u64> {
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
pub(crate) fn record_memory_history(
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
pub(crate) fn snapshot(py: Python<'_>, device: Option<i32>) -> PyResult<Py<PyDict>> {
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
