//! `moonbright replay TRACE`: loads a trace, replays it through MoonBright and reports.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use moonbright::driver::cuda;
use moonbright::{Allocator, BackendKind, CallKind, HeldAtPeak, Options, Stats};
use moonbright_trace::{
    self as trace, Format, RecordedFigures, ReplayOptions, ReplayReport, Trace,
};
use serde_json::{json, Value};

use crate::{ReplayArgs, GIB, MIB};

/// Points kept for a plot.
pub(crate) const PLOT_POINTS: usize = 2000;
/// Traces with fewer events than this replay without a progress bar.
const PROGRESS_MIN_EVENTS: usize = 200_000;

/// Everything one replay measured.
pub(crate) struct Outcome {
    pub path: PathBuf,
    pub format: Format,
    pub load: Duration,
    pub recorded: RecordedFigures,
    pub backend: &'static str,
    pub page: usize,
    pub cap: u64,
    /// The pace the replay kept (`--pace`), if any.
    pub pace: Option<f64>,
    /// Whether frees were stream-ordered (`--stream-frees`).
    pub stream_frees: bool,
    /// The last repetition's report (the only one's without `--repeat`).
    pub report: ReplayReport,
    /// Each repetition's figures, with `--repeat` 2 or more (else empty).
    pub repetitions: Vec<Repetition>,
    pub stats: Stats,
    /// The recorder's reserved bytes over events, bucketed as `report.series` (plots only).
    pub recorded_series: Vec<u64>,
}

/// One repetition of a `--repeat` replay: its own latencies and driver work, and the
/// allocator's peaks so far.
pub(crate) struct Repetition {
    pub failed_allocs: u64,
    pub alloc_p50_us: Option<f64>,
    pub alloc_p99_us: Option<f64>,
    pub alloc_max_us: Option<f64>,
    /// Requests that mapped a range of their own, and the handles they mapped.
    pub request_maps: u64,
    pub request_mapped_handles: u64,
    pub created_chunks: u64,
    pub unmaps: u64,
    /// Peak reserved over peak allocated bytes, from the first repetition to this one.
    pub ratio_so_far: f64,
    pub wall_s: f64,
}

impl Repetition {
    fn of(report: &ReplayReport, before: &Stats, after: &Stats) -> Self {
        let us = |q| report.alloc_latency_quantile(q).map(|ns| ns as f64 / 1000.0);
        let calls = |k| after.driver_calls.get(k) - before.driver_calls.get(k);
        Repetition {
            failed_allocs: report.failed_allocs,
            alloc_p50_us: us(0.5),
            alloc_p99_us: us(0.99),
            alloc_max_us: report.alloc_latency_ns.last().map(|ns| *ns as f64 / 1000.0),
            request_maps: after.request_maps - before.request_maps,
            request_mapped_handles: after.request_mapped_handles - before.request_mapped_handles,
            created_chunks: calls(CallKind::Create),
            unmaps: calls(CallKind::Unmap),
            ratio_so_far: after.reserved_over_allocated_peak(),
            wall_s: report.wall.as_secs_f64(),
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "failed_allocs": self.failed_allocs,
            "alloc_p50_us": self.alloc_p50_us,
            "alloc_p99_us": self.alloc_p99_us,
            "alloc_max_us": self.alloc_max_us,
            "request_maps": self.request_maps,
            "request_mapped_handles": self.request_mapped_handles,
            "created_chunks": self.created_chunks,
            "unmaps": self.unmaps,
            "reserved_over_allocated_so_far": self.ratio_so_far,
            "wall_s": self.wall_s,
        })
    }
}

impl Outcome {
    /// Allocations that failed, in every repetition.
    pub fn failed_allocs(&self) -> u64 {
        match self.repetitions.as_slice() {
            [] => self.report.failed_allocs,
            reps => reps.iter().map(|r| r.failed_allocs).sum(),
        }
    }

    /// The trace's file name.
    pub fn name(&self) -> String {
        self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    }

    /// MoonBright's peak reserved over its peak allocated bytes.
    pub fn ratio(&self) -> f64 {
        self.stats.reserved_over_allocated_peak()
    }

    /// Allocation latency quantile in microseconds.
    pub fn alloc_us(&self, q: f64) -> Option<f64> {
        self.report.alloc_latency_quantile(q).map(|ns| ns as f64 / 1000.0)
    }

    /// Free latency quantile in microseconds.
    pub fn free_us(&self, q: f64) -> Option<f64> {
        self.report.free_latency_quantile(q).map(|ns| ns as f64 / 1000.0)
    }

    pub fn to_json(&self) -> Value {
        let s = &self.stats;
        let r = &self.report;
        let rec = &self.recorded;
        let calls: serde_json::Map<String, Value> =
            s.driver_calls.iter().map(|(k, n)| (k.key().to_string(), json!(n))).collect();
        let lat = |v: &[u64]| {
            json!({
                "samples": v.len(),
                "p50_us": trace::quantile(v, 0.5).map(|n| n as f64 / 1000.0),
                "p90_us": trace::quantile(v, 0.9).map(|n| n as f64 / 1000.0),
                "p99_us": trace::quantile(v, 0.99).map(|n| n as f64 / 1000.0),
                "p999_us": trace::quantile(v, 0.999).map(|n| n as f64 / 1000.0),
                "max_us": v.last().map(|n| *n as f64 / 1000.0),
                "mean_us": if v.is_empty() { None } else {
                    Some(v.iter().sum::<u64>() as f64 / v.len() as f64 / 1000.0)
                },
            })
        };
        json!({
            "trace": self.path.display().to_string(),
            "format": format!("{:?}", self.format),
            "load_s": self.load.as_secs_f64(),
            "recorded": {
                "events": rec.events,
                "allocs": rec.allocs,
                "frees": rec.frees,
                "unknown_frees": rec.unknown_frees,
                "live_at_end": rec.live_at_end,
                "streams": rec.streams,
                "duration_us": rec.duration_us,
                "peak_requested_bytes": rec.peak_requested,
                "peak_reserved_bytes": rec.peak_reserved,
                "reserved_over_requested": rec.reserved_over_requested(),
            },
            "backend": self.backend,
            "page_bytes": self.page,
            "cap_bytes": self.cap,
            "replay": {
                "events": r.events,
                "allocs": r.allocs,
                "frees": r.frees,
                "unknown_frees": r.unknown_frees,
                "frees_of_failed_allocs": r.frees_of_failed,
                "failed_allocs": r.failed_allocs,
                "first_error": r.first_error,
                "live_at_end": r.live_at_end,
                "wall_s": r.wall.as_secs_f64(),
                "pace": self.pace,
                "stream_frees": self.stream_frees,
                "repeat": self.repetitions.len().max(1),
                "repetitions": self.repetitions.iter().map(Repetition::to_json).collect::<Vec<_>>(),
                "alloc_latency": lat(&r.alloc_latency_ns),
                "free_latency": lat(&r.free_latency_ns),
                "slowest_allocs": r.slowest.iter().map(|a| serde_json::json!({
                    "event": a.event,
                    "size": a.size,
                    "us": a.ns as f64 / 1000.0,
                    "calls_meanwhile": calls_json(a.calls_made()),
                    "own_calls": calls_json(a.own_calls_made()),
                })).collect::<Vec<_>>(),
            },
            "moonbright": {
                "peak_allocated_bytes": s.allocated_bytes.peak,
                "peak_reserved_bytes": s.reserved_bytes.peak,
                "peak_active_bytes": s.active_bytes.peak,
                "peak_mapped_bytes": s.mapped_bytes.peak,
                "peak_mapped_handles": s.mapped_handles.peak,
                "peak_chunks": s.chunks.peak,
                "reserved_over_allocated": self.ratio(),
                "cache_hits": s.cache_hits,
                "subpage_allocations": s.subpage_allocations,
                "carved_allocations": s.carved_allocations,
                "carved_arenas": s.carved_arenas,
                "carved_chunks_uncarved": s.carved_chunks_uncarved,
                "cached_ranges_stolen": s.cached_ranges_stolen,
                "cached_ranges_split": s.cached_ranges_split,
                "cached_ranges_joined": s.cached_ranges_joined,
                "chunk_splits": s.chunk_splits,
                "flushes_for_addresses": s.flushes_for_addresses,
                "flushes_for_split": s.flushes_for_split,
                "targeted_flushes": s.targeted_flushes,
                "unmap_batches": s.unmap_batches,
                "unmap_calls_in_batches": s.unmap_calls_in_batches,
                "num_ooms": s.num_ooms,
                "deferred_errors": s.deferred_errors,
                "driver_calls": calls,
                "driver_calls_total": s.driver_calls.total(),
                "held_at_peak": held_json(&s.held_at_peak),
            },
        })
    }
}

/// Options for replaying a trace with `recorded` figures: on the host backend the simulated
/// device is made big enough for the trace (its pages cost nothing until touched, and a replay
/// never touches them).
fn options(args: &ReplayArgs, recorded: &RecordedFigures) -> Result<Options, String> {
    let backend: BackendKind =
        args.backend.parse().map_err(|e: moonbright::Error| e.to_string())?;
    let host = match backend {
        BackendKind::Host => true,
        BackendKind::Cuda => false,
        BackendKind::Auto => cuda::probe().is_err(),
    };
    let mut o = Options {
        backend,
        validate: args.validate,
        host_page_size: args.host_page_kib.saturating_mul(1024),
        ..Options::default()
    };
    if host {
        o.backend = BackendKind::Host;
        o.host_capacity =
            ((recorded.peak_requested as f64 * 1.5) as u64).div_ceil(GIB).max(1) * GIB;
        o.cap_fraction = 1.0;
    }
    if let Some(gib) = args.cap_gib {
        if !(gib > 0.0 && gib.is_finite()) {
            return Err(format!("--cap-gib {gib} must be a positive number"));
        }
        let cap = (gib * GIB as f64) as u64;
        o.cap_bytes = Some(cap);
        if host {
            o.host_capacity = o.host_capacity.max(cap.next_multiple_of(o.host_page_size as u64));
        }
    }
    moonbright::conf::parse_conf_over(o, &args.conf).map_err(|e| e.to_string())
}

/// Loads `path` and replays it. `series_points` > 0 keeps series for a plot.
pub(crate) fn run(
    path: &Path,
    args: &ReplayArgs,
    limit: Option<usize>,
    series_points: usize,
) -> Result<Outcome, String> {
    if let Some(p) = args.pace.filter(|p| !(*p > 0.0 && p.is_finite())) {
        return Err(format!("--pace {p} must be a positive number"));
    }
    if args.repeat == 0 {
        return Err("--repeat must be 1 or more".into());
    }
    let t = Instant::now();
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (mut trace, format) =
        Trace::load_reader(file).map_err(|e| format!("{}: {e}", path.display()))?;
    if let Some(n) = limit {
        trace.events.truncate(n);
    }
    let load = t.elapsed();
    let recorded = trace.recorded();
    let opts = options(args, &recorded)?;
    if args.pace.is_some() && recorded.duration_us == 0 {
        return Err(format!("--pace: {} records no times (dt_us)", path.display()));
    }
    let alloc = Allocator::new(opts).map_err(|e| e.to_string())?;

    let n = trace.events.len();
    let reps = args.repeat as u64;
    let bar = if n as u64 * reps >= PROGRESS_MIN_EVENTS as u64 && std::io::stdout().is_terminal() {
        ProgressBar::with_draw_target(Some(n as u64 * reps), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "replay {bar:40} {human_pos}/{human_len} events {elapsed} (eta {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let ropts = ReplayOptions {
        limit: None,
        series_points,
        pace: args.pace,
        stream_frees: args.stream_frees,
    };
    let mut repetitions = Vec::new();
    let mut report = ReplayReport::default();
    for i in 0..reps {
        let before = alloc.stats();
        let done_before = i * n as u64;
        report =
            trace::replay(&alloc, &trace, &ropts, &mut |done| bar.set_position(done_before + done));
        if reps > 1 {
            repetitions.push(Repetition::of(&report, &before, &alloc.stats()));
        }
    }
    bar.finish_and_clear();
    let stats = alloc.stats();
    let recorded_series =
        if series_points > 0 { trace.recorded_reserved_series(series_points) } else { vec![] };
    Ok(Outcome {
        path: path.to_path_buf(),
        format,
        load,
        recorded,
        backend: alloc.backend_name(),
        page: alloc.page_size(),
        cap: alloc.cap(),
        pace: args.pace,
        stream_frees: args.stream_frees,
        report,
        repetitions,
        stats,
        recorded_series,
    })
}

fn held_json(h: &HeldAtPeak) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    m.insert("reserved".into(), h.reserved.into());
    for (name, bytes) in h.parts() {
        m.insert(name.into(), bytes.into());
    }
    m.into()
}

/// One line: each part of held memory at its peak with its share, the parts with none left out.
fn held_line(h: &HeldAtPeak) -> String {
    let parts: Vec<String> = h
        .parts()
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(name, b)| {
            let share = 100.0 * *b as f64 / h.reserved.max(1) as f64;
            format!("{} {} ({share:.1}%)", name.replace('_', " "), gib(*b))
        })
        .collect();
    format!("  held at its peak ({}): {}", gib(h.reserved), parts.join(" | "))
}

pub(crate) fn gib(b: u64) -> String {
    if b >= GIB {
        format!("{:.2} GiB", b as f64 / GIB as f64)
    } else {
        format!("{:.1} MiB", b as f64 / MIB as f64)
    }
}

pub(crate) fn us(v: Option<f64>) -> String {
    match v {
        Some(v) if v < 10.0 => format!("{v:.2} µs"),
        Some(v) => format!("{v:.1} µs"),
        None => "-".into(),
    }
}

/// Driver calls made, by kind, as `name n, ...`.
pub(crate) fn calls(s: &Stats) -> String {
    let v: Vec<String> = s
        .driver_calls
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{} {n}", k.key()))
        .collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

pub(crate) fn print_summary(o: &Outcome) {
    let rec = &o.recorded;
    let r = &o.report;
    let s = &o.stats;
    println!(
        "trace: {} ({:?}; {} events, {} allocs, {} stream{}), loaded in {:.2} s",
        o.path.display(),
        o.format,
        rec.events,
        rec.allocs,
        rec.streams,
        if rec.streams == 1 { "" } else { "s" },
        o.load.as_secs_f64()
    );
    println!("backend: {} | page {} KiB | cap {}", o.backend, o.page >> 10, gib(o.cap));
    let paced = match o.pace {
        Some(p) => format!(" (paced: the recording's gaps / {p})"),
        None => String::new(),
    };
    let reps = o.repetitions.len().max(1) as u64;
    let last = if reps > 1 { format!(", the last of {reps} repetitions") } else { String::new() };
    println!(
        "replayed {} events in {:.2} s{paced}{last}: {} allocs ({} failed), {} frees{}, {} frees of unknown addresses skipped",
        r.events,
        r.wall.as_secs_f64(),
        r.allocs,
        r.failed_allocs,
        r.frees,
        if o.stream_frees { " (stream-ordered)" } else { "" },
        r.unknown_frees,
    );
    if let Some(e) = &r.first_error {
        println!("first failure: {e}");
    }
    print_repetitions(&o.repetitions);
    println!();
    println!("  {:<34} {:>12}   / peak allocated", "", "peak");
    println!("  {:<34} {:>12}", "requested, as the trace records it", gib(rec.peak_requested));
    println!("  {:<34} {:>12}", "MoonBright allocated", gib(s.allocated_bytes.peak));
    println!(
        "  {:<34} {:>12}   {:.3}",
        "MoonBright reserved",
        gib(s.reserved_bytes.peak),
        o.ratio()
    );
    if let (Some(pr), Some(ratio)) = (rec.peak_reserved, rec.reserved_over_requested()) {
        println!("  {:<34} {:>12}   {:.3}", "reserved, as the trace records it", gib(pr), ratio);
    }
    println!("{}", held_line(&s.held_at_peak));
    println!();
    println!(
        "alloc latency: p50 {} | p90 {} | p99 {} | p99.9 {} | max {}",
        us(o.alloc_us(0.5)),
        us(o.alloc_us(0.9)),
        us(o.alloc_us(0.99)),
        us(o.alloc_us(0.999)),
        us(r.alloc_latency_ns.last().map(|n| *n as f64 / 1000.0)),
    );
    println!(
        "free latency:  p50 {} | p99 {} | max {}",
        us(o.free_us(0.5)),
        us(o.free_us(0.99)),
        us(r.free_latency_ns.last().map(|n| *n as f64 / 1000.0)),
    );
    // The allocator's counters cover every repetition, each of the same allocations.
    let allocs = r.allocs * reps;
    let pct = |n: u64| if allocs == 0 { 0.0 } else { 100.0 * n as f64 / allocs as f64 };
    if reps > 1 {
        print!("over all {reps} repetitions: ");
    }
    println!(
        "cache hits {} ({:.1}% of allocs; {} split off larger cached ranges, {} joins of neighbours, {} carved out of {} ranges) | sub-page allocs {} ({:.1}%) | cached ranges stolen {} | chunk splits {} ({} waited for unmaps, {} of them only their chunk's) | unmap batches {} | OOMs {}",
        s.cache_hits,
        pct(s.cache_hits),
        s.cached_ranges_split,
        s.cached_ranges_joined,
        s.carved_allocations,
        s.carved_arenas,
        s.subpage_allocations,
        pct(s.subpage_allocations),
        s.cached_ranges_stolen,
        s.chunk_splits,
        s.flushes_for_split,
        s.targeted_flushes,
        s.unmap_batches,
        s.num_ooms,
    );
    println!("driver calls ({}): {}", s.driver_calls.total(), calls(s));
    println!(
        "slowest allocs{} (driver calls it made | other threads' calls meanwhile; VMM time in µs):",
        if reps > 1 { " of the last repetition" } else { "" }
    );
    for a in &r.slowest {
        println!(
            "  event {:>8}: {:>10} bytes, {}: {} | {}",
            a.event,
            a.size,
            us(Some(a.ns as f64 / 1000.0)),
            calls_text(a.own_calls_made()),
            calls_text(a.others_calls_made()),
        );
    }
}

/// The `--repeat` table: one line a repetition.
fn print_repetitions(reps: &[Repetition]) {
    if reps.is_empty() {
        return;
    }
    println!(
        "repeated {} times through one allocator; below, the last repetition's latencies and \
         the whole run's peaks",
        reps.len()
    );
    println!(
        "  {:>4} {:>7} {:>12} {:>10} {:>10} {:>11} {:>6} {:>9} {:>8} {:>7}",
        "rep", "failed", "res/alc", "p50", "p99", "max", "maps", "handles", "creates", "unmaps"
    );
    for (i, r) in reps.iter().enumerate() {
        println!(
            "  {:>4} {:>7} {:>12.4} {:>10} {:>10} {:>11} {:>6} {:>9} {:>8} {:>7}",
            i + 1,
            r.failed_allocs,
            r.ratio_so_far,
            us(r.alloc_p50_us),
            us(r.alloc_p99_us),
            us(r.alloc_max_us),
            r.request_maps,
            r.request_mapped_handles,
            r.created_chunks,
            r.unmaps,
        );
    }
}

/// `kind n (µs), ...` for `(kind, calls, nanoseconds)`; `none` if empty.
fn calls_text(calls: impl Iterator<Item = (CallKind, u64, u64)>) -> String {
    let made: Vec<String> = calls
        .map(|(k, n, ns)| match ns {
            0 => format!("{} {n}", k.key()),
            _ => format!("{} {n} ({:.0})", k.key(), ns as f64 / 1000.0),
        })
        .collect();
    if made.is_empty() {
        "none".to_string()
    } else {
        made.join(", ")
    }
}

/// `{kind: {calls, us}}` for `(kind, calls, nanoseconds)`.
fn calls_json(
    calls: impl Iterator<Item = (CallKind, u64, u64)>,
) -> serde_json::Map<String, serde_json::Value> {
    calls
        .map(|(k, n, ns)| {
            (k.key().to_string(), serde_json::json!({"calls": n, "us": ns as f64 / 1000.0}))
        })
        .collect()
}
