//! Allocation latency: alloc+free p50/p99 for six sizes and every path, then
//! the same while a 50 ms kernel runs on another stream, then set-access and unmap calls per GiB
//! with and without large chunks. One process; prints a table with ratios and writes JSON.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use moonbright::CallKind;
use moonbright_bench::cu::{Arg, Gpu, Module, Stream};
use moonbright_bench::paths::{AllocPath, CuAsync, CuAsyncFresh, CuMalloc, Mb, MbMode, RawVmm};
use moonbright_bench::stats::{us_since, Summary};
use moonbright_bench::{call_delta, human, kernels, main_wrapper, mb_options, Res, GIB, KIB, MIB};
use serde::Serialize;

mod report;

use report::{find, fmt_ratio, print_rows, targets, Report};

#[derive(Parser, Debug)]
#[command(about = "Allocation latency of MoonBright against the CUDA alternatives")]
struct Args {
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A quarter of the repetitions (a smoke test).
    #[arg(long)]
    quick: bool,
    /// Skip the part with a running kernel.
    #[arg(long)]
    no_kernel: bool,
    /// Skip the large-chunk comparison.
    #[arg(long)]
    no_chunks: bool,
    /// Trials per path and size while the 50 ms kernel runs.
    #[arg(long, default_value_t = 3)]
    kernel_trials: usize,
    /// Time the first window hit after the mapper has refilled the whole window and gone idle,
    /// instead of the third and later hits of runs.
    #[arg(long)]
    window_idle: bool,
    /// Only these sizes, in bytes, comma-separated (each one of the six; default: all).
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<u64>,
    /// Also write each timed repetition's alloc time into the JSON (`alloc_samples_us`, rounds
    /// one after another in the order measured: for window hits at 8 GiB, the third and fourth
    /// of each run alternate).
    #[arg(long)]
    samples: bool,
}

const SIZES: [u64; 6] = [256, 64 * KIB, 2 * MIB, 64 * MIB, GIB, 8 * GIB];

/// Every path a target compares is measured in this many rounds, interleaved with the others at
/// each size, each with a fresh allocator or pool and a share of the repetitions: a slow spell
/// of the machine (driver calls ran 2-3x slower for seconds in some runs) then falls on every
/// side, not on one side's whole row.
const ROUNDS: usize = 3;

/// (warm-up, timed) repetitions for a size.
fn reps(size: u64, quick: bool) -> (usize, usize) {
    let (w, r) = match size {
        s if s <= 2 * MIB => (20, 200),
        s if s <= 64 * MIB => (10, 100),
        s if s <= GIB => (3, 30),
        _ => (1, 8),
    };
    if quick {
        (w.min(2), (r / 4).max(3))
    } else {
        (w, r)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
enum PathKind {
    MbCache,
    MbCacheTorchContract,
    MbWindow,
    MbCold,
    MbColdBesideLive,
    CuMemAlloc,
    CuMemAllocAsync,
    CuMemAllocAsyncFresh,
    RawVmm,
    RawVmmOwnRegion,
    RawVmmPages,
}

impl PathKind {
    fn label(self) -> &'static str {
        match self {
            PathKind::MbCache => "MoonBright cache hit",
            PathKind::MbCacheTorchContract => "MB cache hit, torch rules",
            PathKind::MbWindow => "MoonBright window hit",
            PathKind::MbCold => "MoonBright cold map",
            PathKind::MbColdBesideLive => "MB cold, by a live alloc",
            PathKind::CuMemAlloc => "cuMemAlloc/cuMemFree",
            PathKind::CuMemAllocAsync => "cuMemAllocAsync (warm)",
            PathKind::CuMemAllocAsyncFresh => "cuMemAllocAsync, kept",
            PathKind::RawVmm => "raw VMM, one handle",
            PathKind::RawVmmOwnRegion => "raw VMM, empty region",
            PathKind::RawVmmPages => "raw VMM, 2 MiB pages",
        }
    }

    /// Whether this path is measured at `size`.
    fn applies(self, size: u64) -> bool {
        match self {
            // Below a page a request is carved from an arena: no window involved.
            PathKind::MbWindow | PathKind::CuMemAllocAsyncFresh => size >= 2 * MIB,
            PathKind::RawVmmPages => size >= 2 * MIB,
            _ => true,
        }
    }

    /// The path for requests of `size`; `window_idle`: see `Args::window_idle`.
    fn make(self, gpu: &Gpu, size: u64, window_idle: bool) -> Res<Box<dyn AllocPath>> {
        Ok(match self {
            PathKind::MbCache => Box::new(Mb::new(MbMode::Cache, size)?),
            PathKind::MbCacheTorchContract => Box::new(Mb::new(MbMode::CacheTorchContract, size)?),
            PathKind::MbWindow => {
                let mode = if window_idle { MbMode::WindowIdle } else { MbMode::Window };
                Box::new(Mb::new(mode, size)?)
            }
            PathKind::MbCold => Box::new(Mb::new(MbMode::Cold, size)?),
            PathKind::MbColdBesideLive => Box::new(Mb::new(MbMode::ColdBesideLive, size)?),
            PathKind::CuMemAlloc => Box::new(CuMalloc),
            PathKind::CuMemAllocAsync => Box::new(CuAsync::new(gpu)?),
            PathKind::CuMemAllocAsyncFresh => Box::new(CuAsyncFresh::new(gpu, size)?),
            PathKind::RawVmm => Box::new(RawVmm::new(gpu, false)?),
            PathKind::RawVmmOwnRegion => Box::new(RawVmm::in_own_region(gpu)?),
            PathKind::RawVmmPages => Box::new(RawVmm::new(gpu, true)?),
        })
    }

    /// Measured in `ROUNDS` interleaved rounds (see there): all but cuMemAlloc (its one target
    /// asks for a 10x margin) and raw VMM with 2 MiB pages (no target; seconds at large sizes).
    fn interleaved(self) -> bool {
        !matches!(self, PathKind::CuMemAlloc | PathKind::RawVmmPages)
    }
}

const PATHS: [PathKind; 11] = [
    PathKind::MbCache,
    PathKind::MbCacheTorchContract,
    PathKind::MbWindow,
    PathKind::MbCold,
    PathKind::MbColdBesideLive,
    PathKind::CuMemAlloc,
    PathKind::CuMemAllocAsync,
    PathKind::CuMemAllocAsyncFresh,
    PathKind::RawVmm,
    PathKind::RawVmmOwnRegion,
    PathKind::RawVmmPages,
];

#[derive(Debug, Serialize)]
struct Row {
    path: PathKind,
    label: &'static str,
    size: u64,
    alloc_us: Summary,
    free_us: Summary,
    pair_us: Summary,
    /// MoonBright: cache hits during the timed repetitions.
    cache_hits: Option<u64>,
    /// MoonBright: timed repetitions whose malloc made a create, map or set-access call (a
    /// background worker's call in that window counts too).
    mallocs_with_map_calls: Option<u64>,
    /// MoonBright: every driver call during the timed repetitions (background workers included).
    driver_calls: Option<BTreeMap<String, u64>>,
    /// MoonBright: microseconds a timed repetition spent in each kind of virtual-memory call, on
    /// average (background workers included).
    vmm_us_per_rep: Option<BTreeMap<String, f64>>,
    /// Rounds merged into this row (`ROUNDS` for the interleaved paths).
    rounds: usize,
    /// The alloc's time outside timed virtual-memory calls (reserve, create, map, set access,
    /// unmap, release), for paths that time them: the allocator's own work and other calls.
    alloc_outside_vmm_us: Option<Summary>,
    /// With `--samples`: each timed repetition's alloc, in microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    alloc_samples_us: Option<Vec<f64>>,
    /// Each timed repetition's alloc, free and alloc outside VMM calls, for merging rounds.
    #[serde(skip)]
    samples: (Vec<f64>, Vec<f64>, Vec<f64>),
}

impl Row {
    /// The summaries, from the samples.
    fn summarise(&mut self) {
        let (a, f, outside) = &self.samples;
        let pair: Vec<f64> = a.iter().zip(f).map(|(a, f)| a + f).collect();
        self.alloc_us = Summary::of(a);
        self.free_us = Summary::of(f);
        self.pair_us = Summary::of(&pair);
        self.alloc_outside_vmm_us = (!outside.is_empty()).then(|| Summary::of(outside));
    }

    /// `self` and a later round of the same path and size, as one row.
    fn merge(mut self, o: Row) -> Row {
        let n = |r: &Row| r.samples.0.len() as f64;
        let (n0, n1) = (n(&self), n(&o));
        self.samples.0.extend(o.samples.0);
        self.samples.1.extend(o.samples.1);
        self.samples.2.extend(o.samples.2);
        self.summarise();
        let add = |a: Option<u64>, b: Option<u64>| a.zip(b).map(|(a, b)| a + b);
        self.cache_hits = add(self.cache_hits, o.cache_hits);
        self.mallocs_with_map_calls = add(self.mallocs_with_map_calls, o.mallocs_with_map_calls);
        if let (Some(a), Some(b)) = (self.driver_calls.as_mut(), o.driver_calls) {
            for (k, v) in b {
                *a.entry(k).or_default() += v;
            }
        }
        if let (Some(a), Some(b)) = (self.vmm_us_per_rep.as_mut(), o.vmm_us_per_rep) {
            for v in a.values_mut() {
                *v *= n0;
            }
            for (k, v) in b {
                *a.entry(k).or_default() += v * n1;
            }
            for v in a.values_mut() {
                *v /= n0 + n1;
            }
        }
        self.rounds += o.rounds;
        self
    }
}

fn map_calls(c: &moonbright::driver::CallCounts) -> u64 {
    c.get(CallKind::Create) + c.get(CallKind::Map) + c.get(CallKind::SetAccess)
}

fn measure(gpu: &Gpu, kind: PathKind, size: u64, quick: bool, window_idle: bool) -> Res<Row> {
    // Hits of a warm pool cost the same at every size and take a microsecond: they get many
    // more repetitions (a round of 200 lasts 0.2 ms, within one spell of the machine).
    let cheap = matches!(
        kind,
        PathKind::MbCache | PathKind::MbCacheTorchContract | PathKind::CuMemAllocAsync
    );
    let (warm, n) = match reps(if cheap { 0 } else { size }, quick) {
        (w, n) if cheap => (5 * w, 10 * n),
        other => other,
    };
    let n = if kind.interleaved() { n.div_ceil(ROUNDS).max(3) } else { n };
    let n = if kind == PathKind::RawVmmPages && size > GIB { n.min(3) } else { n };
    let mut p = kind.make(gpu, size, window_idle)?;
    for _ in 0..warm {
        p.prepare()?;
        let x = p.alloc(size)?;
        p.free(x)?;
    }
    let (c0, h0, vmm0) = (p.counts(), p.cache_hits(), p.times());
    let (mut a, mut f) = (Vec::new(), Vec::new());
    let mut outside = Vec::new();
    let mut with_map = 0;
    for _ in 0..n {
        p.prepare()?;
        let (k0, v0) = (p.counts(), p.times());
        let t0 = Instant::now();
        let x = p.alloc(size)?;
        let ta = us_since(t0);
        let (k1, v1) = (p.counts(), p.times());
        if let (Some(v0), Some(v1)) = (v0, v1) {
            let ns: u64 = v1.total_ns.iter().zip(&v0.total_ns).map(|(b, a)| b - a).sum();
            outside.push(ta - ns as f64 / 1e3);
        }
        let t1 = Instant::now();
        p.free(x)?;
        let tf = us_since(t1);
        if let (Some(k0), Some(k1)) = (k0, k1) {
            if map_calls(&k1.since(&k0)) > 0 {
                with_map += 1;
            }
        }
        a.push(ta);
        f.push(tf);
    }
    let (c1, h1, vmm1) = (p.counts(), p.cache_hits(), p.times());
    let vmm_us_per_rep = vmm1.zip(vmm0).map(|(b, a)| {
        moonbright::CallKind::ALL
            .iter()
            .filter(|&&k| b.total_ns[k as usize] > a.total_ns[k as usize])
            .map(|&k| {
                let ns = b.total_ns[k as usize] - a.total_ns[k as usize];
                (k.key().to_string(), ns as f64 / 1e3 / n as f64)
            })
            .collect()
    });
    let mut row = Row {
        path: kind,
        label: kind.label(),
        size,
        alloc_us: Summary::default(),
        free_us: Summary::default(),
        pair_us: Summary::default(),
        cache_hits: h1.zip(h0).map(|(b, a)| b - a),
        mallocs_with_map_calls: c0.as_ref().map(|_| with_map),
        driver_calls: c1.zip(c0).map(|(b, a)| call_delta(&b, &a)),
        vmm_us_per_rep,
        rounds: 1,
        alloc_outside_vmm_us: None,
        alloc_samples_us: None,
        samples: (a, f, outside),
    };
    row.summarise();
    Ok(row)
}

#[derive(Debug, Serialize)]
struct KernelRow {
    path: PathKind,
    label: &'static str,
    size: u64,
    /// Alloc and free times of each trial, each made while the 50 ms kernel ran.
    alloc_us: Vec<f64>,
    free_us: Vec<f64>,
    /// How long the kernel ran, by events, in each trial.
    kernel_ms: Vec<f64>,
    /// Whether any alloc or free took over 10 ms (waited for the kernel).
    waited: bool,
}

/// The 50 ms kernel on its own non-blocking stream, and one alloc and free made while it runs.
fn during_kernel(
    gpu: &Gpu,
    spin: &moonbright_bench::cu::Function,
    kind: PathKind,
    size: u64,
    trials: usize,
) -> Res<KernelRow> {
    let ks = Stream::new(true)?;
    let (e0, e1) =
        (moonbright_bench::cu::Event::new(true)?, moonbright_bench::cu::Event::new(true)?);
    let mut p = kind.make(gpu, size, false)?;
    // Warm the path (for the cache-hit path, the size is then cached).
    p.prepare()?;
    let x = p.alloc(size)?;
    p.free(x)?;
    let mut row = KernelRow {
        path: kind,
        label: kind.label(),
        size,
        alloc_us: vec![],
        free_us: vec![],
        kernel_ms: vec![],
        waited: false,
    };
    for _ in 0..trials {
        p.prepare()?;
        e0.record(&ks)?;
        // SAFETY: spin(u64 ns, u64* sink) with a null sink, which it never writes through.
        unsafe { spin.launch(1, 1, &ks, &[Arg::U64(50_000_000), Arg::U64(0)])? };
        e1.record(&ks)?;
        std::thread::sleep(Duration::from_millis(2)); // the kernel is surely running now
        let t0 = Instant::now();
        let x = p.alloc(size)?;
        let ta = us_since(t0);
        let t1 = Instant::now();
        p.free(x)?;
        let tf = us_since(t1);
        ks.sync()?;
        row.kernel_ms.push(e0.elapsed_ms(&e1)? as f64);
        row.waited |= ta > 10_000.0 || tf > 10_000.0;
        row.alloc_us.push(ta);
        row.free_us.push(tf);
    }
    Ok(row)
}

#[derive(Debug, Serialize)]
struct ChunkRow {
    size: u64,
    max_chunk_bytes: u64,
    reps: usize,
    alloc_us: Summary,
    free_us: Summary,
    /// `release_unused` after the free: the unmap and the release of the range's chunks.
    release_us: Summary,
    /// Calls per GiB allocated, averaged over the repetitions.
    per_gib: BTreeMap<String, f64>,
}

/// Set-access and unmap calls per GiB, and time, with chunks of at most `max_chunk` (also the
/// `large_chunk` and `largest_chunk` sizes, so that one limit holds for every need): 8 GiB (at
/// 8 GiB, the default for that need), 1 GiB, 64 MiB, 2 MiB pages.
fn chunks(size: u64, max_chunk: u64, quick: bool) -> Res<ChunkRow> {
    let n = if quick {
        2
    } else if size > GIB {
        3
    } else {
        5
    };
    let opts = moonbright::Options {
        large_chunk_bytes: max_chunk,
        largest_chunk_bytes: max_chunk,
        ..mb_options(None, max_chunk, (0, 0), false)
    };
    let mut mb = Mb::with_options(MbMode::Cold, size, opts)?;
    let (mut a, mut f, mut r) = (vec![], vec![], vec![]);
    let mut total = moonbright::driver::CallCounts::default();
    for i in 0..=n {
        mb.prepare()?;
        let c0 = mb.inner.driver().counts();
        let t0 = Instant::now();
        let x = mb.alloc(size)?;
        let ta = us_since(t0);
        let t1 = Instant::now();
        mb.free(x)?;
        let tf = us_since(t1);
        let t2 = Instant::now();
        mb.prepare()?; // sync + release_unused: unmap and release
        let tr = us_since(t2);
        if i == 0 {
            continue; // warm-up
        }
        let d = mb.inner.driver().counts().since(&c0);
        for k in CallKind::ALL {
            total.0[k as usize] += d.get(k);
        }
        a.push(ta);
        f.push(tf);
        r.push(tr);
    }
    let gib = (size as f64 / GIB as f64) * n as f64;
    let per_gib = total
        .iter()
        .filter(|(_, c)| *c > 0)
        .map(|(k, c)| (k.key().to_string(), c as f64 / gib))
        .collect();
    Ok(ChunkRow {
        size,
        max_chunk_bytes: max_chunk,
        reps: n,
        alloc_us: Summary::of(&a),
        free_us: Summary::of(&f),
        release_us: Summary::of(&r),
        per_gib,
    })
}

fn run() -> Res<()> {
    let args = Args::parse();
    let gpu = Gpu::open()?;
    println!(
        "latency: {} ({} GiB), driver {}{}",
        gpu.name,
        gpu.total_memory / GIB,
        gpu.driver_version,
        if args.window_idle {
            "; window hits: the first after the mapper went idle"
        } else {
            "; window hits: the third and later of runs of fresh requests"
        }
    );
    if let Some(s) = args.sizes.iter().find(|s| !SIZES.contains(s)) {
        return Err(format!("--sizes: {s} is not one of {SIZES:?}"));
    }
    let sizes: Vec<u64> =
        SIZES.into_iter().filter(|s| args.sizes.is_empty() || args.sizes.contains(s)).collect();
    let mut rows: Vec<Row> = vec![];
    for &size in &sizes {
        for round in 0..ROUNDS {
            for &k in &PATHS {
                if !k.applies(size) || (round > 0 && !k.interleaved()) {
                    continue;
                }
                let t = Instant::now();
                let row = measure(&gpu, k, size, args.quick, args.window_idle)
                    .map_err(|e| format!("{} at {}: {e}", k.label(), human(size)))?;
                eprintln!(
                    "  {:>7} {:<24} pair p50 {:>10.2} us  ({:.1} s{})",
                    human(size),
                    k.label(),
                    row.pair_us.p50,
                    t.elapsed().as_secs_f64(),
                    if k.interleaved() { format!(", round {}", round + 1) } else { String::new() }
                );
                match rows.iter().position(|r| r.path == k && r.size == size) {
                    Some(i) => {
                        let earlier = rows.remove(i);
                        rows.insert(i, earlier.merge(row));
                    }
                    None => rows.push(row),
                }
            }
        }
    }
    if args.samples {
        for r in &mut rows {
            r.alloc_samples_us = Some(r.samples.0.clone());
        }
    }
    println!("\n== alloc+free latency");
    print_rows(&rows);
    println!("\n== cold maps: us per repetition in each virtual-memory call (means)");
    let cold_rows = rows.iter().filter(|r| {
        matches!(
            r.path,
            PathKind::MbCold
                | PathKind::MbColdBesideLive
                | PathKind::RawVmm
                | PathKind::RawVmmOwnRegion
        )
    });
    for r in cold_rows.clone() {
        let calls: Vec<String> =
            r.vmm_us_per_rep.iter().flatten().map(|(k, us)| format!("{k} {us:.1}")).collect();
        println!(
            "  {:>7}  {:<24} alloc p50 {:>8.1}: {}",
            human(r.size),
            r.label,
            r.alloc_us.p50,
            calls.join(", ")
        );
    }
    println!("  alloc p50 outside the timed calls (the allocator's own work, other driver calls):");
    for r in cold_rows {
        if let Some(o) = &r.alloc_outside_vmm_us {
            println!("  {:>7}  {:<24} {:>8.2} (p99 {:.2})", human(r.size), r.label, o.p50, o.p99);
        }
    }
    println!("  alloc p50 over raw VMM's, in its own region / where the driver places it:");
    for &size in &SIZES {
        let p50 = |k| find(&rows, k, size).map_or(f64::NAN, |r: &Row| r.alloc_us.p50);
        let (own, placed) = (p50(PathKind::RawVmmOwnRegion), p50(PathKind::RawVmm));
        println!(
            "  {:>7}  cold, empty allocator {} / {}; cold, beside a live allocation {} / {}",
            human(size),
            fmt_ratio(p50(PathKind::MbCold) / own),
            fmt_ratio(p50(PathKind::MbCold) / placed),
            fmt_ratio(p50(PathKind::MbColdBesideLive) / own),
            fmt_ratio(p50(PathKind::MbColdBesideLive) / placed),
        );
    }

    let mut kernel = vec![];
    if !args.no_kernel {
        let module = Module::compile(&gpu, kernels::SOURCE)?;
        let spin = module.function("spin")?;
        // Every path but raw VMM with 2 MiB pages, whose large sizes take seconds (and the second
        // cold MoonBright path and the kept-live pool, which add nothing here).
        let kpaths: Vec<PathKind> = PATHS
            .iter()
            .copied()
            .filter(|&k| {
                !matches!(
                    k,
                    PathKind::RawVmmPages
                        | PathKind::MbColdBesideLive
                        | PathKind::CuMemAllocAsyncFresh
                        | PathKind::RawVmmOwnRegion
                )
            })
            .collect();
        for &size in &SIZES {
            for &k in &kpaths {
                if k.applies(size) {
                    kernel.push(
                        during_kernel(&gpu, &spin, k, size, args.kernel_trials)
                            .map_err(|e| format!("{} during kernel: {e}", k.label()))?,
                    );
                }
            }
        }
        println!("\n== while a 50 ms kernel runs on another stream (us, each trial)");
        println!("{:>7}  {:<24} {:>12} {:>12}  waited", "size", "path", "alloc max", "free max");
        for r in &kernel {
            let mx = |v: &[f64]| v.iter().fold(0f64, |m, &x| m.max(x));
            println!(
                "{:>7}  {:<24} {:>12.1} {:>12.1}  {}",
                human(r.size),
                r.label,
                mx(&r.alloc_us),
                mx(&r.free_us),
                if r.waited { "YES" } else { "no" }
            );
        }
    }

    let mut chunk_rows = vec![];
    if !args.no_chunks {
        for size in [GIB, 8 * GIB] {
            for mc in [8 * GIB, GIB, 64 * MIB, 2 * MIB].into_iter().filter(|&mc| mc <= size) {
                chunk_rows.push(chunks(size, mc, args.quick)?);
            }
        }
        println!("\n== with and without large chunks (cold map, per GiB allocated; us)");
        println!(
            "{:>6} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10} {:>12}",
            "size", "chunks", "create", "map", "setacc", "alloc p50", "free p50", "unmap+rel p50"
        );
        for c in &chunk_rows {
            let g = |k: &str| c.per_gib.get(k).copied().unwrap_or(0.0);
            println!(
                "{:>6} {:>9} {:>8.1} {:>8.1} {:>8.1} {:>10.0} {:>10.1} {:>12.0}   unmap calls/GiB {:.1}",
                human(c.size),
                human(c.max_chunk_bytes),
                g("create"),
                g("map"),
                g("set_access"),
                c.alloc_us.p50,
                c.free_us.p50,
                c.release_us.p50,
                g("unmap")
            );
        }
        println!(
            "(one cuMemUnmap / cuMemSetAccess call may span many handles; its cost grows with"
        );
        println!(" the handles, i.e. with the map calls)");
    }

    let targets = targets(&rows, &kernel);
    println!("\n== targets");
    for t in &targets {
        println!(
            "  [{}] {}: {:.3} (target {})",
            if t.met { "met" } else { "MISSED" },
            t.what,
            t.value,
            t.target
        );
    }
    if let Some(path) = &args.json {
        let report = Report {
            gpu: gpu.name.clone(),
            driver_version: gpu.driver_version,
            total_memory: gpu.total_memory,
            rows,
            during_kernel: kernel,
            chunks: chunk_rows,
            targets,
        };
        moonbright_bench::write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    main_wrapper("latency", run)
}
