//! The fragmentation stress: 20,000 operations, sizes log-uniform from 1 KiB to
//! 512 MiB, random lifetimes, about 60 GiB live, fixed seed. Reports peak reserved over peak
//! allocated, alloc p50/p99 and operations per second for MoonBright (each profile: memory,
//! balanced, the default, and latency; and balanced without its window) and the no-remap
//! baseline, and writes the operation sequence as CSV for bench/torch_stress.py. With `--host
//! --host-costs`, the default profile on the host backend under each driver cost model instead.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use moonbright::Allocator;
use moonbright_bench::cu::{Gpu, Stream};
use moonbright_bench::stats::{us_since, Summary};
use moonbright_bench::workload::{stress_ops, to_csv, Op, StressSpec};
use moonbright_bench::{main_wrapper, mb_options, mb_options_from, Res, GIB, MIB};
use moonbright_testkit::baseline::NoRemapAllocator;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Fragmentation stress: MoonBright and the no-remap baseline")]
struct Args {
    #[arg(long, default_value_t = 20_261_129)]
    seed: u64,
    #[arg(long, default_value_t = 20_000)]
    ops: usize,
    /// Live bytes the sequence hovers around, in GiB.
    #[arg(long, default_value_t = 60)]
    live_gib: u64,
    /// Write the operation sequence as CSV (op,id,size) and exit unless --run is given too.
    #[arg(long)]
    dump_ops: Option<PathBuf>,
    /// With --dump-ops: also run the allocators.
    #[arg(long)]
    run: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Skip the no-remap baseline.
    #[arg(long)]
    no_baseline: bool,
    /// Run MoonBright on the host backend (no GPU needed): its times mean nothing, but which
    /// requests map synchronously, and how many handles each maps, are the policy's own; with
    /// `MOONBRIGHT_ALLOC_CONF=background:false` the run is deterministic.
    #[arg(long)]
    host: bool,
    /// With --host: instead of the profiles, run the default profile under each of the host
    /// backend's driver cost models (`host_driver_costs`): none, cuda (the CUDA driver's mean
    /// cost per call on an H100) and device_tables (page tables written by a kernel, modelled:
    /// docs/design.md, "Device-written page tables"). The calls, and so the memory held, are
    /// the same under each (exactly so with `background:false`); times differ.
    #[arg(long, requires = "host")]
    host_costs: bool,
}

trait Replay {
    fn alloc(&mut self, size: u64) -> Res<u64>;
    fn free(&mut self, ptr: u64) -> Res<()>;
    /// (peak reserved, peak allocated) as the allocator counts them.
    fn peaks(&self) -> (u64, u64);
    /// Chunk handles requests have mapped synchronously so far, if the allocator counts them.
    fn request_handles(&self) -> Option<u64> {
        None
    }
    /// The allocator's own counters worth reporting, as (name, value).
    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![]
    }
    /// Virtual-memory calls by kind: (kind, calls, mean us, longest us), if timed.
    fn vmm_times(&self) -> Vec<VmmTime> {
        vec![]
    }
    /// The host backend's modelled driver time in ms and its model, when it charges one.
    fn modelled_driver_ms(&self) -> Option<(f64, &'static str)> {
        None
    }
}

#[derive(Debug, Serialize)]
struct VmmTime {
    call: &'static str,
    calls: u64,
    mean_us: f64,
    max_us: f64,
}

struct Mb {
    a: Allocator,
    s: moonbright::StreamHandle,
}

impl Replay for Mb {
    fn alloc(&mut self, size: u64) -> Res<u64> {
        self.a.malloc_async(size as usize, self.s).map_err(|e| e.to_string())
    }
    fn free(&mut self, ptr: u64) -> Res<()> {
        self.a.free_async(ptr, self.s).map_err(|e| e.to_string())
    }
    fn peaks(&self) -> (u64, u64) {
        let s = self.a.stats();
        (s.reserved_bytes.peak, s.allocated_bytes.peak)
    }
    fn request_handles(&self) -> Option<u64> {
        Some(self.a.stats().request_mapped_handles)
    }
    fn vmm_times(&self) -> Vec<VmmTime> {
        let (counts, times) = (self.a.driver().counts(), self.a.driver().times());
        moonbright::CallKind::ALL
            .iter()
            .filter(|&&k| moonbright::driver::CallTimes::timed(k) && counts.get(k) > 0)
            .map(|&k| VmmTime {
                call: k.key(),
                calls: counts.get(k),
                mean_us: times.total_ns[k as usize] as f64 / counts.get(k) as f64 / 1e3,
                max_us: times.max_ns[k as usize] as f64 / 1e3,
            })
            .collect()
    }
    fn modelled_driver_ms(&self) -> Option<(f64, &'static str)> {
        let host = self.a.driver().inner().as_host()?;
        let costs = host.costs();
        (costs != moonbright::driver::host::HostDriverCosts::None)
            .then(|| (host.charged_cost().as_secs_f64() * 1e3, costs.name()))
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = self.a.stats();
        vec![
            ("cache_hits", s.cache_hits),
            ("window_hits", s.window_hits),
            ("request_maps", s.request_maps),
            ("request_mapped_handles", s.request_mapped_handles),
            ("request_created_chunks", s.request_created_chunks),
            ("request_released_chunks", s.request_released_chunks),
            ("cached_ranges_stolen", s.cached_ranges_stolen),
            ("cached_ranges_split", s.cached_ranges_split),
            ("cached_ranges_joined", s.cached_ranges_joined),
            ("carved_allocations", s.carved_allocations),
            ("carved_chunks_uncarved", s.carved_chunks_uncarved),
            ("unmap_batches", s.unmap_batches),
            ("flushes_for_addresses", s.flushes_for_addresses),
            ("flushes_for_split", s.flushes_for_split),
            ("targeted_flushes", s.targeted_flushes),
            ("unmap_calls_in_batches", s.unmap_calls_in_batches),
        ]
    }
}

/// Allocations grouped by how many chunk handles the request mapped itself: 0 (a cache, window
/// or sub-page hit), 1, 2-3, 4-7, 8-15, 16-31, 32 or more.
const CLASS_NAMES: [&str; 7] = ["0", "1", "2-3", "4-7", "8-15", "16-31", "32+"];

fn class_of(handles: u64) -> usize {
    match handles {
        0 => 0,
        h => (h.ilog2() as usize + 1).min(CLASS_NAMES.len() - 1),
    }
}

#[derive(Debug, Serialize)]
struct MapClass {
    handles: &'static str,
    alloc_us: Summary,
}

struct Base(NoRemapAllocator);

impl Replay for Base {
    fn alloc(&mut self, size: u64) -> Res<u64> {
        self.0.malloc(size as usize).map_err(|e| e.to_string())
    }
    fn free(&mut self, ptr: u64) -> Res<()> {
        self.0.free(ptr).map_err(|e| e.to_string())
    }
    fn peaks(&self) -> (u64, u64) {
        (self.0.reserved_bytes().1, self.0.allocated_bytes().1)
    }
}

#[derive(Debug, Serialize)]
struct Outcome {
    allocator: String,
    ops: usize,
    seconds: f64,
    ops_per_s: f64,
    peak_requested: u64,
    peak_reserved: u64,
    peak_allocated: u64,
    reserved_over_requested: f64,
    reserved_over_allocated: f64,
    alloc_us: Summary,
    alloc_ge_64mib_us: Summary,
    free_us: Summary,
    /// By handles mapped in the request (MoonBright only).
    by_handles: Vec<MapClass>,
    /// The allocator's counters at the end (MoonBright only).
    counters: std::collections::BTreeMap<String, u64>,
    /// Its virtual-memory calls, every thread's (MoonBright only).
    vmm_calls: Vec<VmmTime>,
    /// The host backend's driver cost model (`host_driver_costs`) and the time it charged,
    /// teardown included (host rows with a model only).
    driver_costs: Option<String>,
    modelled_driver_ms: Option<f64>,
    ooms: usize,
    first_oom: Option<String>,
}

fn replay(name: &str, r: &mut dyn Replay, ops: &[Op], peak_requested: u64) -> Res<Outcome> {
    let mut live: HashMap<u32, u64> = HashMap::new();
    let (mut a, mut big, mut f) = (vec![], vec![], vec![]);
    let mut classes: Vec<Vec<f64>> = vec![vec![]; CLASS_NAMES.len()];
    let mut handles = r.request_handles();
    let (mut ooms, mut first_oom) = (0, None);
    let start = Instant::now();
    for op in ops {
        match *op {
            Op::Alloc { id, size } => {
                let t = Instant::now();
                match r.alloc(size) {
                    Ok(p) => {
                        let us = us_since(t);
                        a.push(us);
                        if size >= 64 * MIB {
                            big.push(us);
                        }
                        if let (Some(before), Some(now)) = (handles, r.request_handles()) {
                            classes[class_of(now - before)].push(us);
                            handles = Some(now);
                        }
                        live.insert(id, p);
                    }
                    Err(e) => {
                        ooms += 1;
                        first_oom.get_or_insert(format!("alloc {size} B: {e}"));
                    }
                }
            }
            Op::Free { id, .. } => {
                if let Some(p) = live.remove(&id) {
                    let t = Instant::now();
                    r.free(p)?;
                    f.push(us_since(t));
                }
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    for (_, p) in live.drain() {
        r.free(p)?;
    }
    let (res, alloc) = r.peaks();
    let counters = r.counters().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let vmm_calls = r.vmm_times();
    let modelled = r.modelled_driver_ms();
    Ok(Outcome {
        allocator: name.into(),
        ops: ops.len(),
        seconds,
        ops_per_s: ops.len() as f64 / seconds,
        peak_requested,
        peak_reserved: res,
        peak_allocated: alloc,
        reserved_over_requested: res as f64 / peak_requested as f64,
        reserved_over_allocated: res as f64 / alloc.max(1) as f64,
        alloc_us: Summary::of(&a),
        alloc_ge_64mib_us: Summary::of(&big),
        free_us: Summary::of(&f),
        by_handles: CLASS_NAMES
            .iter()
            .zip(&classes)
            .filter(|(_, v)| !v.is_empty())
            .map(|(&handles, v)| MapClass { handles, alloc_us: Summary::of(v) })
            .collect(),
        counters,
        vmm_calls,
        driver_costs: modelled.map(|m| m.1.to_string()),
        modelled_driver_ms: modelled.map(|m| m.0),
        ooms,
        first_oom,
    })
}

#[derive(Debug, Serialize)]
struct Report {
    gpu: String,
    spec: StressSpec,
    outcomes: Vec<Outcome>,
}

fn run() -> Res<()> {
    let args = Args::parse();
    let spec = StressSpec {
        ops: args.ops,
        live_target: args.live_gib * GIB,
        ..StressSpec::issue3(args.seed)
    };
    let (ops, peak_requested) = stress_ops(&spec);
    if let Some(path) = &args.dump_ops {
        std::fs::write(path, to_csv(&ops))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!(
            "stress: wrote {} operations (seed {}, peak requested {:.2} GiB) to {}",
            ops.len(),
            spec.seed,
            peak_requested as f64 / GIB as f64,
            path.display()
        );
        if !args.run {
            return Ok(());
        }
    }
    // On the host backend the stream is a host one, made by the allocator's own driver.
    let gpu = if args.host { None } else { Some(Gpu::open()?) };
    let gpu_name = gpu.as_ref().map_or("host backend".to_string(), |g| g.name.clone());
    let stream = if gpu.is_some() { Some(Stream::new(true)?) } else { None };
    let mut outcomes = vec![];
    let default_window = moonbright_bench::default_window();
    use moonbright::driver::host::HostDriverCosts;
    use moonbright::Profile;
    let rows = if args.host_costs {
        vec![
            (
                "MoonBright, no driver costs",
                Profile::Balanced,
                default_window,
                Some(HostDriverCosts::None),
            ),
            (
                "MoonBright, cuda costs",
                Profile::Balanced,
                default_window,
                Some(HostDriverCosts::Cuda),
            ),
            (
                "MoonBright, device_tables costs",
                Profile::Balanced,
                default_window,
                Some(HostDriverCosts::DeviceTables),
            ),
        ]
    } else {
        vec![
            ("MoonBright (balanced, the default)", Profile::Balanced, default_window, None),
            ("MoonBright (memory)", Profile::Memory, default_window, None),
            ("MoonBright (latency)", Profile::Latency, default_window, None),
            ("MoonBright (balanced, no window)", Profile::Balanced, (0, 0), None),
        ]
    };
    for (name, profile, window, costs) in rows {
        let name = name.to_string();
        // The worker runs unless `MOONBRIGHT_ALLOC_CONF` turns it off (`background:false`,
        // which makes a `--host` run deterministic).
        let background = moonbright_bench::env_options().background;
        let base = moonbright_bench::profile_options(profile);
        let mut opts =
            mb_options_from(base, None, moonbright_bench::max_chunk(), window, background);
        if args.host {
            opts.backend = moonbright::BackendKind::Host;
            opts.host_capacity = 140 * GIB;
            // `None`: as `MOONBRIGHT_ALLOC_CONF` says (no costs unless it sets them).
            if let Some(c) = costs {
                opts.host_driver_costs = c;
            }
        }
        let a = Allocator::new(opts).map_err(|e| format!("MoonBright: {e}"))?;
        let s = match &stream {
            Some(s) => s.handle(),
            None => {
                moonbright::driver::Streams::create_stream(a.driver()).map_err(|e| e.to_string())?
            }
        };
        let mut mb = Mb { a, s };
        outcomes.push(replay(&name, &mut mb, &ops, peak_requested)?);
        if let Some(s) = &stream {
            s.sync()?;
        }
    }
    if !args.no_baseline && !args.host {
        let opts = mb_options(None, moonbright_bench::max_chunk(), (0, 0), false);
        let b = NoRemapAllocator::new(&opts, 20 * MIB).map_err(|e| format!("baseline: {e}"))?;
        outcomes.push(replay(
            "no-remap baseline (20 MiB segments)",
            &mut Base(b),
            &ops,
            peak_requested,
        )?);
    }
    println!(
        "stress on {}: {} ops, seed {}, sizes 1 KiB..512 MiB log-uniform, peak requested {:.2} GiB",
        gpu_name,
        ops.len(),
        spec.seed,
        peak_requested as f64 / GIB as f64
    );
    println!(
        "{:<38} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>10} {:>9} {:>5}",
        "allocator",
        "res GiB",
        "res/req",
        "res/alc",
        "alloc50",
        "alloc99",
        ">=64M p99",
        "free p99",
        "ops/s",
        "OOMs"
    );
    for o in &outcomes {
        println!(
            "{:<38} {:>9.2} {:>9.3} {:>8.3} {:>8.2} {:>9.1} {:>9.1} {:>10.1} {:>9.0} {:>5}",
            o.allocator,
            o.peak_reserved as f64 / GIB as f64,
            o.reserved_over_requested,
            o.reserved_over_allocated,
            o.alloc_us.p50,
            o.alloc_us.p99,
            o.alloc_ge_64mib_us.p99,
            o.free_us.p99,
            o.ops_per_s,
            o.ooms
        );
        if let Some(e) = &o.first_oom {
            println!("    first failure: {e}");
        }
        if !o.counters.is_empty() {
            let list: Vec<String> = o.counters.iter().map(|(k, v)| format!("{k} {v}")).collect();
            println!("    {}", list.join(", "));
        }
        if !o.vmm_calls.is_empty() {
            let list: Vec<String> = o
                .vmm_calls
                .iter()
                .map(|v| format!("{} {} x {:.1} (max {:.0})", v.call, v.calls, v.mean_us, v.max_us))
                .collect();
            println!("    VMM calls, mean (max) us: {}", list.join(", "));
        }
        if let (Some(costs), Some(ms)) = (&o.driver_costs, o.modelled_driver_ms) {
            println!("    modelled driver time ({costs} costs, batch ends included): {ms:.1} ms");
        }
        for c in &o.by_handles {
            println!(
                "    {:>5} handles mapped in the request: {:>6} allocs, p50 {:>8.1}, p99 {:>8.1}, max {:>8.1}",
                c.handles, c.alloc_us.n, c.alloc_us.p50, c.alloc_us.p99, c.alloc_us.max
            );
        }
    }
    println!("(res/req: peak reserved over the sequence's peak requested bytes; res/alc: over the");
    println!(" allocator's own peak allocated; times in us; profiles: memory holds the least,");
    println!(" latency trades memory for the p99 (new memory before stealing while held stays");
    println!(" within 1.3x of the peak in use), balanced is the default between them)");
    if let Some(path) = &args.json {
        let report = Report { gpu: gpu_name, spec, outcomes };
        moonbright_bench::write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    main_wrapper("stress", run)
}
