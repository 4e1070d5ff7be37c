//! The whole device in one-page chunks. The brief warns that an entire GPU in 2 MiB handles is
//! about 70,000 handles and asks that the driver and MoonBright's metadata be shown to scale to
//! it. Every chunk here is one page (`max_chunk`, `large_chunk` and `largest_chunk` all the
//! page), the mapped window is off, and the run goes through these phases:
//!
//! 1. `raw`: the driver layer alone, no allocator: create N one-page handles, map them back to
//!    back in one reservation, set access once over all of them, unmap, release. The baseline
//!    for what N handles cost the driver, measured in the same run.
//! 2. `fill`: MoonBright makes N one-page allocations, each a cold map of one new handle; the
//!    first and last thousand are compared, so a cost that grows with what is held shows.
//! 3. `hits`: with N allocations live, 10,000 times a random one is freed and a page asked for
//!    again (cache hits).
//! 4. `scatter`: every other allocation is freed, then one allocation of N/2 pages is made,
//!    stitched from the freed ranges' chunks, which lie one page apart; then `flush` unmaps the
//!    ranges it retired. Unmap batches wait for these flushes (their thresholds are set out of
//!    reach), so that no phase counts the worker's calls beside its own requests'.
//! 5. `whole`: everything is freed, then one allocation of all N pages: the whole device,
//!    stitched from N handles in one range; then `flush` again.
//! 6. `bookkeeping`: statistics, segments (what a memory snapshot lists) and a full invariant
//!    check, with N one-page ranges live (after `fill`) and with the whole device in one.
//! 7. `release`: the whole allocation freed and `release_unused`: N handles unmapped and
//!    released.
//!
//! Every page of every allocation gets one word written and read back through the allocator;
//! on a GPU, a kernel also fills and checks every byte of the whole-device allocation.
//! `--host` runs it on the host backend (64 KiB pages, 16,384 of them by default: Linux allows
//! about 65,000 mappings a process), where only the call counts and the shape of the costs mean
//! anything.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cudarc::driver::sys;
use moonbright::driver::{prelude::*, CallCounts, CallKind, CallTimes, Instrumented};
use moonbright::{Allocator, BackendKind, Options};
use moonbright_bench::cu::{
    copy_dtoh_u64, ctx_sync, mem_alloc, mem_free, memset_d32, Arg, Function, Gpu, Module, Stream,
};
use moonbright_bench::stats::Summary;
use moonbright_bench::{call_delta, kernels, main_wrapper, write_json, Res, GIB, MIB};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(
    about = "The whole device in one-page chunks: what N handles cost, raw and in MoonBright"
)]
struct Args {
    /// Pages (handles) to use. Default: all that MoonBright's cap holds, less 16 (CUDA);
    /// 16,384 (host).
    #[arg(long)]
    pages: Option<u64>,
    /// Run on the host backend (no GPU needed).
    #[arg(long)]
    host: bool,
    /// Leave out the raw driver baseline.
    #[arg(long)]
    no_baseline: bool,
    /// Run MoonBright without its background worker (no deferred unmaps, no events).
    #[arg(long)]
    no_worker: bool,
    /// Skip the flush after `scatter`: the whole-device request then finds its ranges still
    /// retired, scattered one page apart (what a request with no addresses does with them).
    #[arg(long)]
    keep_retired: bool,
    /// Write every figure as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One phase: its wall time, the driver calls it made and the time spent inside the timed
/// virtual-memory calls (create, map, set access, unmap, release, reserve).
#[derive(Debug, Default, Serialize)]
struct Phase {
    name: String,
    wall_ms: f64,
    vmm_ms: f64,
    /// Wall time outside the timed calls: the allocator's own work and untimed driver calls.
    own_ms: f64,
    calls: BTreeMap<String, u64>,
    /// Mean time a call of each timed kind, in µs.
    call_us: BTreeMap<String, f64>,
    /// Per-request latencies, where the phase makes many (µs).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    latency_us: BTreeMap<String, Summary>,
    /// Words written and read back that came back wrong, and bytes a kernel found wrong.
    bad_words: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel_bad_bytes: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    device: String,
    page_bytes: u64,
    pages: u64,
    bytes: u64,
    phases: Vec<Phase>,
}

/// Counts and times of a driver before a phase.
struct Mark {
    at: Instant,
    counts: CallCounts,
    times: CallTimes,
}

fn mark<D: Driver>(d: &Instrumented<D>) -> Mark {
    Mark { at: Instant::now(), counts: d.counts(), times: d.times() }
}

fn vmm_ns(t: &CallTimes) -> u64 {
    t.total_ns.iter().sum()
}

/// The phase from `m` to now.
fn phase<D: Driver>(name: &str, d: &Instrumented<D>, m: &Mark) -> Phase {
    let wall_ms = m.at.elapsed().as_secs_f64() * 1e3;
    let (counts, times) = (d.counts(), d.times());
    let vmm_ms = (vmm_ns(&times) - vmm_ns(&m.times)) as f64 / 1e6;
    let since = counts.since(&m.counts);
    let call_us = CallKind::ALL
        .iter()
        .filter(|&&k| CallTimes::timed(k) && since.get(k) > 0)
        .map(|&k| {
            let ns = times.total_ns[k as usize] - m.times.total_ns[k as usize];
            (k.key().to_string(), ns as f64 / 1e3 / since.get(k) as f64)
        })
        .collect();
    Phase {
        name: name.into(),
        wall_ms,
        vmm_ms,
        own_ms: wall_ms - vmm_ms,
        calls: call_delta(&counts, &m.counts),
        call_us,
        ..Phase::default()
    }
}

fn options(args: &Args) -> Options {
    let mut o = if args.host {
        let pages = args.pages.unwrap_or(16_384);
        Options { cap_fraction: 1.0, ..Options::host(pages * (64 << 10) + 64 * MIB, 64 << 10) }
    } else {
        Options { backend: BackendKind::Cuda, ..moonbright_bench::env_options() }
    };
    o.validate = false;
    o.background = !args.no_worker;
    o.prefetch_window_min = 0;
    o.prefetch_window_max = 0;
    // Retired ranges wait for the `flush` phase: the worker's unmap batches would otherwise run
    // beside a phase's requests, and its calls' times would count in that phase.
    o.unmap_batch_ranges = 1 << 30;
    o.unmap_batch_bytes = 1 << 60;
    o.unmap_batch_age_us = 3_600_000_000;
    o
}

/// Writes one word at the start of each page of `[ptr, ptr + pages * page)`, then reads them
/// back; returns how many came back wrong.
fn probe_pages(a: &Allocator, ptr: u64, pages: u64, page: u64, salt: u64) -> Res<u64> {
    let word = |i: u64| (i ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes();
    for i in 0..pages {
        a.write(ptr + i * page, &word(i)).map_err(|e| format!("write: {e}"))?;
    }
    let mut bad = 0;
    let mut got = [0u8; 8];
    for i in 0..pages {
        a.read(ptr + i * page, &mut got).map_err(|e| format!("read: {e}"))?;
        bad += u64::from(got != word(i));
    }
    Ok(bad)
}

/// The driver layer alone: N one-page handles created, mapped back to back, access set once,
/// unmapped in one call and released.
fn raw(opts: &Options, pages: u64) -> Res<Vec<Phase>> {
    let d = Instrumented::new(opts.open_backend().map_err(|e| e.to_string())?);
    let page = d.granularity() as u64;
    let len = (pages * page) as usize;
    let e = |e: moonbright::driver::DriverError| e.to_string();
    let va = d.reserve(len, 0).map_err(e)?;
    let mut out = Vec::new();
    let m = mark(&d);
    let mut handles = Vec::with_capacity(pages as usize);
    let mut lat = Vec::with_capacity(pages as usize);
    for _ in 0..pages {
        let t = Instant::now();
        handles.push(d.create_chunk(page as usize).map_err(e)?);
        lat.push(t.elapsed().as_nanos() as f64 / 1e3);
    }
    let mut p = phase("raw: create N", &d, &m);
    let k = lat.len().min(1_000);
    p.latency_us.insert("create, first 1000".into(), Summary::of(&lat[..k]));
    p.latency_us.insert("create, last 1000".into(), Summary::of(&lat[lat.len() - k..]));
    out.push(p);
    let m = mark(&d);
    for (i, &h) in handles.iter().enumerate() {
        d.map(va + i as u64 * page, page as usize, h).map_err(e)?;
    }
    out.push(phase("raw: map N", &d, &m));
    let m = mark(&d);
    d.set_access(va, len).map_err(e)?;
    out.push(phase("raw: set access over N", &d, &m));
    let m = mark(&d);
    d.unmap(va, len).map_err(e)?;
    out.push(phase("raw: unmap N (one call)", &d, &m));
    let m = mark(&d);
    for h in handles {
        d.release_chunk(h).map_err(e)?;
    }
    out.push(phase("raw: release N", &d, &m));
    d.free_reservation(va, len).map_err(e)?;
    Ok(out)
}

/// The GPU's kernels, for the whole-device check.
struct Kernels {
    _module: Module,
    fill: Function,
    check: Function,
    sms: u32,
}

impl Kernels {
    fn new(gpu: &Gpu) -> Res<Kernels> {
        let module = Module::compile(gpu, kernels::SOURCE)?;
        let sms = gpu.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "MULTIPROCESSOR_COUNT",
        )? as u32;
        Ok(Kernels {
            fill: module.function("fill")?,
            check: module.function("check")?,
            _module: module,
            sms,
        })
    }

    /// Fills every word of `[ptr, ptr + bytes)` by one kernel and checks it by another; returns
    /// how many words were wrong.
    fn fill_and_check(&self, ptr: u64, bytes: u64) -> Res<u64> {
        let s = Stream::new(true)?;
        let bad = mem_alloc(8)?;
        memset_d32(bad, 0, 2)?;
        ctx_sync()?;
        let n = bytes / 4;
        let grid = n.div_ceil(256).clamp(1, u64::from(self.sms) * 8) as u32;
        // SAFETY: fill(u32* p, u64 n, u32 id) and check(const u32* p, u64 n, u32 id, u64* bad):
        // the allocation holds n u32 and outlives both kernels (the stream is synchronised
        // below, before it is freed); `bad` is a live u64 from cuMemAlloc.
        unsafe {
            self.fill.launch(grid, 256, &s, &[Arg::U64(ptr), Arg::U64(n), Arg::U32(7)])?;
            self.check.launch(
                grid,
                256,
                &s,
                &[Arg::U64(ptr), Arg::U64(n), Arg::U32(7), Arg::U64(bad)],
            )?;
        }
        s.sync()?;
        let mut out = [0u64];
        copy_dtoh_u64(&mut out, bad)?;
        mem_free(bad)?;
        Ok(out[0])
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Times the statistics, the segments (what a memory snapshot lists) and a full invariant
/// check, as phases named after `what` is live.
fn bookkeeping(a: &Allocator, what: &str, phases: &mut Vec<Phase>) -> Res<()> {
    let t = Instant::now();
    let st = a.stats();
    let stats_ms = ms(t);
    let t = Instant::now();
    let segments = a.segments();
    let segments_ms = ms(t);
    let t = Instant::now();
    a.check_invariants().map_err(|e| format!("invariants: {e}"))?;
    let check_ms = ms(t);
    for (name, wall_ms) in [
        (format!("stats ({what}, {} chunks)", st.chunks.current), stats_ms),
        (format!("segments ({what}, {} listed)", segments.len()), segments_ms),
        (format!("check_invariants ({what})"), check_ms),
    ] {
        phases.push(Phase { name, wall_ms, own_ms: wall_ms, ..Phase::default() });
    }
    Ok(())
}

fn run(args: &Args) -> Res<Report> {
    let gpu = if args.host { None } else { Some(Gpu::open()?) };
    let kernels = gpu.as_ref().map(Kernels::new).transpose()?;
    let mut opts = options(args);
    let page = match &gpu {
        Some(g) => g.granularity()? as u64,
        None => opts.host_page_size as u64,
    };
    opts.max_chunk_bytes = page;
    opts.large_chunk_bytes = page;
    opts.largest_chunk_bytes = page;
    let a = Allocator::new(opts.clone()).map_err(|e| format!("MoonBright: {e}"))?;
    let pages = args.pages.unwrap_or(a.cap() / page - 16);
    let e = |e: moonbright::Error| e.to_string();
    let d = a.driver();
    let mut phases = Vec::new();
    if !args.no_baseline {
        phases.extend(raw(&opts, pages)?);
    }

    // fill: N cold maps of one page.
    // Each request's time, and its time in create and in set access (the driver's cost per
    // call may grow with what the process holds: first and last thousand compared).
    let m = mark(d);
    let mut live = Vec::with_capacity(pages as usize);
    let (mut lat, mut create, mut access) = (Vec::new(), Vec::new(), Vec::new());
    let us = |t: &CallTimes, k: CallKind| t.total_ns[k as usize] as f64 / 1e3;
    for _ in 0..pages {
        let before = d.times();
        let t = Instant::now();
        live.push(a.malloc(page as usize).map_err(e)?);
        lat.push(t.elapsed().as_nanos() as f64 / 1e3);
        let after = d.times();
        create.push(us(&after, CallKind::Create) - us(&before, CallKind::Create));
        access.push(us(&after, CallKind::SetAccess) - us(&before, CallKind::SetAccess));
    }
    let mut p = phase("fill: N one-page allocations", d, &m);
    let k = lat.len().min(1_000);
    for (what, xs) in [("malloc", &lat), ("its create", &create), ("its set access", &access)] {
        p.latency_us.insert(format!("{what}, all"), Summary::of(xs));
        p.latency_us.insert(format!("{what}, first 1000"), Summary::of(&xs[..k]));
        p.latency_us.insert(format!("{what}, last 1000"), Summary::of(&xs[xs.len() - k..]));
    }
    for (i, &ptr) in live.iter().enumerate() {
        p.bad_words += probe_pages(&a, ptr, 1, page, i as u64)?;
    }
    phases.push(p);

    // bookkeeping with N one-page ranges live: what a memory snapshot walks.
    bookkeeping(&a, "N ranges", &mut phases)?;

    // hits: a random allocation freed and a page asked for again, with N live.
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    let m = mark(d);
    let mut lat = Vec::with_capacity(10_000);
    for _ in 0..10_000 {
        let i = rng.gen_range(0..live.len());
        a.free(live[i]).map_err(e)?;
        let t = Instant::now();
        live[i] = a.malloc(page as usize).map_err(e)?;
        lat.push(t.elapsed().as_nanos() as f64 / 1e3);
    }
    let mut p = phase("hits: 10,000 free+malloc, N live", d, &m);
    p.latency_us.insert("malloc".into(), Summary::of(&lat));
    phases.push(p);

    // scatter: every other page freed, then one allocation of N/2 pages from their chunks.
    let half = pages / 2;
    let (mut kept, mut freed) = (Vec::new(), 0u64);
    for (i, ptr) in live.drain(..).enumerate() {
        if i % 2 == 1 && freed < half {
            a.free(ptr).map_err(e)?;
            freed += 1;
        } else {
            kept.push(ptr);
        }
    }
    let m = mark(d);
    let stitched = a.malloc((half * page) as usize).map_err(e)?;
    let mut p = phase("scatter: N/2 pages stitched", d, &m);
    p.bad_words = probe_pages(&a, stitched, half, page, 1)?;
    phases.push(p);

    // The ranges the stitch retired (N/2 one-page mappings) unmapped, as the worker's batches
    // would have done.
    if !args.keep_retired {
        let m = mark(d);
        a.flush().map_err(e)?;
        phases.push(phase("flush: what scatter retired", d, &m));
    }

    // whole: everything freed, then all N pages in one allocation.
    a.free(stitched).map_err(e)?;
    for ptr in kept {
        a.free(ptr).map_err(e)?;
    }
    let m = mark(d);
    let whole = a.malloc((pages * page) as usize).map_err(e)?;
    let mut p = phase("whole: N pages in one allocation", d, &m);
    p.bad_words = probe_pages(&a, whole, pages, page, 2)?;
    if let Some(k) = &kernels {
        p.kernel_bad_bytes = Some(4 * k.fill_and_check(whole, pages * page)?);
    }
    phases.push(p);

    // bookkeeping with N chunks held and the whole device live.
    bookkeeping(&a, "one range", &mut phases)?;

    // The ranges the whole-device stitch retired (N one-page mappings) unmapped.
    let m = mark(d);
    a.flush().map_err(e)?;
    phases.push(phase("flush: what whole retired", d, &m));

    // release: N handles unmapped and released.
    a.free(whole).map_err(e)?;
    let m = mark(d);
    a.release_unused().map_err(e)?;
    phases.push(phase("release: release_unused", d, &m));
    if let Some(err) = a.take_deferred_error() {
        return Err(format!("deferred driver error: {err}"));
    }
    Ok(Report {
        backend: a.backend_name().to_string(),
        device: gpu.as_ref().map_or("host".to_string(), |g| g.name.clone()),
        page_bytes: page,
        pages,
        bytes: pages * page,
        phases,
    })
}

fn print(r: &Report) {
    println!(
        "scale on {} ({}): {} one-page chunks of {} KiB, {:.2} GiB",
        r.device,
        r.backend,
        r.pages,
        r.page_bytes >> 10,
        r.bytes as f64 / GIB as f64
    );
    println!(
        "{:<36} {:>10} {:>10} {:>10}  calls (mean µs a call)",
        "phase", "wall ms", "in VMM ms", "own ms"
    );
    for p in &r.phases {
        let calls: Vec<String> = p
            .calls
            .iter()
            .map(|(k, n)| match p.call_us.get(k) {
                Some(us) => format!("{k} {n} ({us:.1})"),
                None => format!("{k} {n}"),
            })
            .collect();
        println!(
            "{:<36} {:>10.1} {:>10.1} {:>10.1}  {}",
            p.name,
            p.wall_ms,
            p.vmm_ms,
            p.own_ms,
            calls.join(", ")
        );
        for (k, s) in &p.latency_us {
            println!("{:<36} {k}: p50 {:.2} µs, p99 {:.2}, max {:.1}", "", s.p50, s.p99, s.max);
        }
        if p.bad_words > 0 || p.kernel_bad_bytes.is_some_and(|b| b > 0) {
            println!("{:<36} WRONG: {} words, {:?} bytes", "", p.bad_words, p.kernel_bad_bytes);
        }
    }
    let wall = |prefixes: &[&str]| -> Option<f64> {
        prefixes
            .iter()
            .map(|n| r.phases.iter().find(|p| p.name.starts_with(n)).map(|p| p.wall_ms))
            .sum()
    };
    let whole = r.phases.iter().find(|p| p.name.starts_with("whole"));
    if let Some(w) = whole {
        println!(
            "MoonBright's own time in the whole-device allocation: {:.3} µs a handle",
            w.own_ms * 1e3 / r.pages as f64
        );
    }
    let pairs = [
        ("N pages in one allocation", &["whole"][..], &["raw: map", "raw: set access"][..]),
        ("N handles unmapped and released", &["release"][..], &["raw: unmap", "raw: release"][..]),
    ];
    for (what, mb, raw) in pairs {
        if let (Some(m), Some(x)) = (wall(mb), wall(raw)) {
            println!("{what}: {m:.0} ms against the raw driver's {x:.0} ms ({:.2}x)", m / x);
        }
    }
}

fn main() -> ExitCode {
    main_wrapper("scale", || {
        let args = Args::parse();
        let report = run(&args)?;
        print(&report);
        if let Some(p) = &args.json {
            write_json(p, &report)?;
        }
        let bad: u64 =
            report.phases.iter().map(|p| p.bad_words + p.kernel_bad_bytes.unwrap_or(0)).sum();
        if bad > 0 {
            return Err(format!("FAILED: {bad} words or bytes read back wrong"));
        }
        println!("scale: PASSED (every page read back right)");
        Ok(())
    })
}
