//! Interference: a TLB-bound random gather over tens of GiB and a streaming
//! copy, each timed with CUDA events over many repetitions: alone; while MoonBright serves an
//! allocation churn from another thread (malloc_async/free_async on its own stream), with its
//! default options and with `reuse_addresses` off (every new range at never-mapped addresses);
//! and while an eager baseline churns (maps fresh pages and unmaps each range as soon as it is freed, page by
//! page). Reports kernel p50/p99 and the slowdowns.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use cudarc::driver::sys;
use moonbright::Allocator;
use moonbright_bench::cu::{
    ck, ctx_sync, mem_alloc, mem_free, memset_d32, Arg, Event, Function, Gpu, Module, Stream,
};
use moonbright_bench::stats::Summary;
use moonbright_bench::{call_delta, kernels, main_wrapper, mb_options, Res, GIB, MIB};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Kernel slowdown under allocation churn: MoonBright against eager unmapping")]
struct Args {
    /// GiB the random gather spans (TLB-bound from a few tens of GiB).
    #[arg(long, default_value_t = 48)]
    gather_gib: u64,
    /// Random 4-byte reads per gather kernel, in millions.
    #[arg(long, default_value_t = 32)]
    gather_mreads: u64,
    /// GiB copied by the streaming copy kernel.
    #[arg(long, default_value_t = 2)]
    copy_gib: u64,
    /// Repetitions of the gather kernel per condition.
    #[arg(long, default_value_t = 100)]
    gather_reps: usize,
    /// Repetitions of the copy kernel per condition.
    #[arg(long, default_value_t = 200)]
    copy_reps: usize,
    /// Churn rate the churning thread aims at (operations per second; it may fall short).
    #[arg(long, default_value_t = 20_000)]
    churn_rate: u64,
    /// Live bytes the churn holds at most, GiB.
    #[arg(long, default_value_t = 12)]
    churn_live_gib: u64,
    /// MoonBright's cap in the churn, GiB (below live + cached, so cached pages get stolen,
    /// remapped, and their old ranges unmapped).
    #[arg(long, default_value_t = 20)]
    churn_cap_gib: u64,
    #[arg(long)]
    json: Option<PathBuf>,
}

struct Kernels {
    gather: Function,
    copy: Function,
    spin: Function,
    data: u64,
    idx: u64,
    out: u64,
    n_idx: u64,
    src: u64,
    dst: u64,
    n16: u64,
    grid: u32,
}

impl Kernels {
    fn setup(gpu: &Gpu, m: &Module, a: &Args) -> Res<Kernels> {
        let sms = gpu.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "MULTIPROCESSOR_COUNT",
        )? as u32;
        let words = a.gather_gib * GIB / 4;
        let n_idx = a.gather_mreads * 1_000_000;
        let data = mem_alloc((a.gather_gib * GIB) as usize)?;
        memset_d32(data, 0x5a5a_5a5a, words as usize)?;
        let idx = mem_alloc((n_idx * 8) as usize)?;
        let out = mem_alloc((n_idx * 4) as usize)?;
        let copy_bytes = a.copy_gib * GIB;
        let src = mem_alloc(copy_bytes as usize)?;
        let dst = mem_alloc(copy_bytes as usize)?;
        memset_d32(src, 1, (copy_bytes / 4) as usize)?;
        ctx_sync()?;
        let k = Kernels {
            gather: m.function("gather")?,
            copy: m.function("copy")?,
            spin: m.function("spin")?,
            data,
            idx,
            out,
            n_idx,
            src,
            dst,
            n16: copy_bytes / 16,
            grid: sms * 8,
        };
        let s = Stream::new(true)?;
        // SAFETY: make_idx(u64* idx, u64 n, u64 range, u64 seed): `idx` holds n u64.
        unsafe {
            m.function("make_idx")?.launch(
                k.grid,
                512,
                &s,
                &[Arg::U64(idx), Arg::U64(n_idx), Arg::U64(words), Arg::U64(0x1234_5678)],
            )?
        };
        s.sync()?;
        Ok(k)
    }

    /// Times `reps` launches of one kernel on `s`, queued behind a 20 ms spin so that the host
    /// enqueues them all before the first runs (host delays never land between the events).
    fn time(&self, which: &str, reps: usize, s: &Stream) -> Res<Vec<f64>> {
        let evs: Vec<(Event, Event)> =
            (0..reps).map(|_| Ok((Event::new(true)?, Event::new(true)?))).collect::<Res<_>>()?;
        // SAFETY: spin(u64 ns, u64* sink) with a null sink, never written.
        unsafe { self.spin.launch(1, 1, s, &[Arg::U64(20_000_000), Arg::U64(0)])? };
        for (e0, e1) in &evs {
            e0.record(s)?;
            match which {
                // SAFETY: gather(const u32* data, const u64* idx, u32* out, u64 n): every index
                // is below the data's word count (make_idx), `out` holds n u32.
                "gather" => unsafe {
                    self.gather.launch(
                        self.grid,
                        512,
                        s,
                        &[
                            Arg::U64(self.data),
                            Arg::U64(self.idx),
                            Arg::U64(self.out),
                            Arg::U64(self.n_idx),
                        ],
                    )?
                },
                // SAFETY: copy(const uint4* src, uint4* dst, u64 n16): both hold n16 * 16 bytes.
                _ => unsafe {
                    self.copy.launch(
                        self.grid,
                        512,
                        s,
                        &[Arg::U64(self.src), Arg::U64(self.dst), Arg::U64(self.n16)],
                    )?
                },
            }
            e1.record(s)?;
        }
        s.sync()?;
        evs.iter().map(|(a, b)| Ok(a.elapsed_ms(b)? as f64)).collect()
    }

    fn free(&self) {
        for p in [self.data, self.idx, self.out, self.src, self.dst] {
            let _ = mem_free(p);
        }
    }
}

/// One churn operation: allocate `size` bytes, or free the live allocation at index `victim`.
enum ChurnOp {
    Alloc(u64),
    Free(usize),
}

/// The churn's operation mix: 60% small (256 B to 1 MiB), 30% medium (2 to 64 MiB), 10% large
/// (128 MiB to 1 GiB), each log-uniform, so page counts rarely repeat and new large allocations
/// need pages taken from freed ranges; half allocations, half frees, within `live_max` bytes.
struct ChurnGen {
    rng: ChaCha8Rng,
    live_max: u64,
}

impl ChurnGen {
    fn next(&mut self, live: &[(u64, u64)], live_bytes: u64) -> ChurnOp {
        let r = &mut self.rng;
        let (lo, hi) = match r.gen_range(0..10) {
            0..=5 => (256f64, MIB as f64),
            6..=8 => (2.0 * MIB as f64, 64.0 * MIB as f64),
            _ => (128.0 * MIB as f64, GIB as f64),
        };
        let size = r.gen_range(lo.ln()..hi.ln()).exp() as u64;
        let must_free = live_bytes + size > self.live_max || live.len() >= 512;
        if !live.is_empty() && (must_free || r.gen_bool(0.5)) {
            ChurnOp::Free(r.gen_range(0..live.len()))
        } else {
            ChurnOp::Alloc(size)
        }
    }
}

/// What a churn thread did.
#[derive(Debug, Default, Serialize)]
struct ChurnReport {
    ops: u64,
    seconds: f64,
    ops_per_s: f64,
    pages_mapped: u64,
    pages_unmapped: u64,
    /// MoonBright: every driver call it made (background workers included), and its unmap
    /// batches and stolen cached ranges.
    driver_calls: BTreeMap<String, u64>,
    unmap_batches: u64,
    cached_ranges_stolen: u64,
    error: Option<String>,
}

/// Paces a loop at `rate` iterations per second.
fn pace(start: Instant, done: u64, rate: u64) {
    let due = Duration::from_secs_f64(done as f64 / rate as f64);
    let el = start.elapsed();
    if due > el {
        std::thread::sleep((due - el).min(Duration::from_millis(2)));
    }
}

fn mb_churn(gpu: &Gpu, a: &Args, stop: &AtomicBool) -> Res<ChurnReport> {
    mb_churn_with(gpu, a, stop, true)
}

/// The same churn with `reuse_addresses` off: every new range at never-mapped addresses.
fn mb_churn_fresh(gpu: &Gpu, a: &Args, stop: &AtomicBool) -> Res<ChurnReport> {
    mb_churn_with(gpu, a, stop, false)
}

fn mb_churn_with(gpu: &Gpu, a: &Args, stop: &AtomicBool, reuse: bool) -> Res<ChurnReport> {
    gpu.make_current()?;
    let opts = moonbright::Options {
        reuse_addresses: reuse,
        ..mb_options(
            Some(a.churn_cap_gib * GIB),
            moonbright_bench::max_chunk(),
            moonbright_bench::default_window(),
            true,
        )
    };
    let alloc = Allocator::new(opts).map_err(|e| format!("MoonBright: {e}"))?;
    let s = Stream::new(true)?;
    let mut g = ChurnGen { rng: ChaCha8Rng::seed_from_u64(11), live_max: a.churn_live_gib * GIB };
    let (mut live, mut live_bytes) = (Vec::<(u64, u64)>::new(), 0u64);
    let c0 = alloc.driver().counts();
    let st0 = alloc.stats();
    let start = Instant::now();
    let mut ops = 0u64;
    let mut err = None;
    while !stop.load(Ordering::Relaxed) {
        let r = match g.next(&live, live_bytes) {
            ChurnOp::Alloc(size) => alloc.malloc_async(size as usize, s.handle()).map(|p| {
                live.push((p, size));
                live_bytes += size;
            }),
            ChurnOp::Free(i) => {
                let (p, size) = live.swap_remove(i);
                live_bytes -= size;
                alloc.free_async(p, s.handle())
            }
        };
        if let Err(e) = r {
            err = Some(e.to_string());
            break;
        }
        ops += 1;
        pace(start, ops, a.churn_rate);
    }
    let seconds = start.elapsed().as_secs_f64();
    let c1 = alloc.driver().counts();
    let st = alloc.stats();
    for (p, _) in live {
        let _ = alloc.free_async(p, s.handle());
    }
    s.sync()?;
    Ok(ChurnReport {
        ops,
        seconds,
        ops_per_s: ops as f64 / seconds,
        pages_mapped: c1.since(&c0).get(moonbright::CallKind::Map),
        pages_unmapped: 0,
        driver_calls: call_delta(&c1, &c0),
        unmap_batches: st.unmap_batches - st0.unmap_batches,
        cached_ranges_stolen: st.cached_ranges_stolen - st0.cached_ranges_stolen,
        error: err,
    })
}

/// The eager baseline: each allocation reserves its range and creates, maps and sets access on
/// each 2 MiB page in turn; each free unmaps and releases each page in turn, at once.
struct Eager {
    prop: sys::CUmemAllocationProp,
    access: sys::CUmemAccessDesc,
    page: u64,
}

impl Eager {
    fn alloc(&self, size: u64) -> Res<(u64, Vec<u64>)> {
        let len = size.next_multiple_of(self.page);
        let mut va = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe { sys::cuMemAddressReserve(&mut va, len as usize, 0, 0, 0) };
        ck(r, "cuMemAddressReserve")?;
        let mut hs = Vec::new();
        let mut mapped = 0;
        for i in 0..len / self.page {
            let at = va + i * self.page;
            let mut h = 0;
            // SAFETY: valid out-pointer and a fully initialised property struct.
            let r = ck(
                unsafe { sys::cuMemCreate(&mut h, self.page as usize, &self.prop, 0) },
                "cuMemCreate",
            )
            .and_then(|_| {
                hs.push(h);
                // SAFETY: `at` lies in the reservation; the handle is one page.
                ck(unsafe { sys::cuMemMap(at, self.page as usize, 0, h, 0) }, "cuMemMap")
            })
            .and_then(|_| {
                mapped += 1;
                // SAFETY: the page at `at` is mapped; one access descriptor.
                let r = unsafe { sys::cuMemSetAccess(at, self.page as usize, &self.access, 1) };
                ck(r, "cuMemSetAccess")
            });
            if let Err(e) = r {
                self.unwind(va, len, mapped, &hs);
                return Err(e);
            }
        }
        Ok((va, hs))
    }

    /// Best-effort cleanup after a failed `alloc`.
    fn unwind(&self, va: u64, len: u64, mapped: u64, hs: &[u64]) {
        // SAFETY: the first `mapped` pages are mapped, every handle in `hs` was created, and the
        // reservation is `len` bytes at `va`; each is undone once.
        unsafe {
            for i in 0..mapped {
                let _ = sys::cuMemUnmap(va + i * self.page, self.page as usize);
            }
            for &h in hs {
                let _ = sys::cuMemRelease(h);
            }
            let _ = sys::cuMemAddressFree(va, len as usize);
        }
    }

    fn free(&self, va: u64, hs: &[u64]) -> Res<()> {
        for (i, &h) in hs.iter().enumerate() {
            let at = va + i as u64 * self.page;
            // SAFETY: `at` maps handle `h`, made by `alloc`; nothing uses it; done once.
            ck(unsafe { sys::cuMemUnmap(at, self.page as usize) }, "cuMemUnmap")?;
            // SAFETY: `h` was created by `alloc` and is released once.
            ck(unsafe { sys::cuMemRelease(h) }, "cuMemRelease")?;
        }
        let len = hs.len() as u64 * self.page;
        // SAFETY: the reservation made by `alloc` (one page per handle), now unmapped.
        ck(unsafe { sys::cuMemAddressFree(va, len as usize) }, "cuMemAddressFree")
    }
}

fn eager_churn(gpu: &Gpu, a: &Args, stop: &AtomicBool) -> Res<ChurnReport> {
    gpu.make_current()?;
    let e = Eager {
        prop: gpu.alloc_prop(),
        access: sys::CUmemAccessDesc {
            location: gpu.location(),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        },
        page: gpu.granularity()? as u64,
    };
    let mut g = ChurnGen { rng: ChaCha8Rng::seed_from_u64(11), live_max: a.churn_live_gib * GIB };
    let mut live: Vec<(u64, u64)> = vec![];
    let mut handles: Vec<Vec<u64>> = vec![];
    let mut live_bytes = 0;
    let (mut ops, mut mapped, mut unmapped) = (0u64, 0u64, 0u64);
    let mut err = None;
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let r = match g.next(&live, live_bytes) {
            ChurnOp::Alloc(size) => e.alloc(size).map(|(va, hs)| {
                mapped += hs.len() as u64;
                live.push((va, size));
                handles.push(hs);
                live_bytes += size;
            }),
            ChurnOp::Free(i) => {
                let (va, size) = live.swap_remove(i);
                let hs = handles.swap_remove(i);
                live_bytes -= size;
                unmapped += hs.len() as u64;
                e.free(va, &hs)
            }
        };
        if let Err(x) = r {
            err = Some(x);
            break;
        }
        ops += 1;
        pace(start, ops, a.churn_rate);
    }
    let seconds = start.elapsed().as_secs_f64();
    for ((va, _), hs) in live.into_iter().zip(handles) {
        let _ = e.free(va, &hs);
    }
    Ok(ChurnReport {
        ops,
        seconds,
        ops_per_s: ops as f64 / seconds,
        pages_mapped: mapped,
        pages_unmapped: unmapped,
        error: err,
        ..Default::default()
    })
}

#[derive(Debug, Serialize)]
struct Condition {
    condition: String,
    gather_ms: Summary,
    copy_ms: Summary,
    gather_slowdown_p50: f64,
    gather_slowdown_p99: f64,
    copy_slowdown_p50: f64,
    copy_slowdown_p99: f64,
    churn: Option<ChurnReport>,
}

#[derive(Debug, Serialize)]
struct Report {
    gpu: String,
    gather_gib: u64,
    gather_reads: u64,
    copy_gib: u64,
    conditions: Vec<Condition>,
}

type Churn = fn(&Gpu, &Args, &AtomicBool) -> Res<ChurnReport>;

fn measure(
    gpu: &Gpu,
    k: &Kernels,
    a: &Args,
    s: &Stream,
    churn: Option<Churn>,
) -> Res<(Summary, Summary, Option<ChurnReport>)> {
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::scope(|scope| {
        let h = churn.map(|f| {
            let stop = stop.clone();
            scope.spawn(move || f(gpu, a, &stop))
        });
        if h.is_some() {
            std::thread::sleep(Duration::from_millis(300)); // reach a steady state
        }
        let g = k.time("gather", a.gather_reps, s);
        let c = k.time("copy", a.copy_reps, s);
        stop.store(true, Ordering::Relaxed);
        let report = match h {
            Some(h) => Some(h.join().map_err(|_| "churn thread panicked".to_string())??),
            None => None,
        };
        Ok((Summary::of(&g?), Summary::of(&c?), report))
    })
}

fn run() -> Res<()> {
    let a = Args::parse();
    let gpu = Gpu::open()?;
    let m = Module::compile(&gpu, kernels::SOURCE)?;
    let k = Kernels::setup(&gpu, &m, &a)?;
    let s = Stream::new(true)?;
    let result = (|| {
        let mut conds: Vec<Condition> = vec![];
        let runs: [(&str, Option<Churn>); 5] = [
            ("alone", None),
            ("MoonBright churn", Some(mb_churn)),
            ("MB fresh addresses", Some(mb_churn_fresh)),
            ("eager churn", Some(eager_churn)),
            ("alone (again)", None),
        ];
        for (name, churn) in runs {
            let t = Instant::now();
            let (g, c, report) = measure(&gpu, &k, &a, &s, churn)?;
            eprintln!("  {name}: gather p50 {:.3} ms ({:.1} s)", g.p50, t.elapsed().as_secs_f64());
            let base = conds.first();
            let ratio = |x: f64, y: Option<f64>| y.map_or(1.0, |y| x / y);
            conds.push(Condition {
                condition: name.into(),
                gather_slowdown_p50: ratio(g.p50, base.map(|b| b.gather_ms.p50)),
                gather_slowdown_p99: ratio(g.p99, base.map(|b| b.gather_ms.p99)),
                copy_slowdown_p50: ratio(c.p50, base.map(|b| b.copy_ms.p50)),
                copy_slowdown_p99: ratio(c.p99, base.map(|b| b.copy_ms.p99)),
                gather_ms: g,
                copy_ms: c,
                churn: report,
            });
        }
        Ok::<_, String>(conds)
    })();
    k.free();
    let conds = result?;
    println!(
        "interference on {}: gather of {}M random 4-byte reads over {} GiB, copy of {} GiB",
        gpu.name, a.gather_mreads, a.gather_gib, a.copy_gib
    );
    println!(
        "{:<18} {:>10} {:>10} {:>8} {:>8}  {:>9} {:>9} {:>8} {:>8}  {:>8} {:>8}",
        "condition",
        "gather p50",
        "p99",
        "x p50",
        "x p99",
        "copy p50",
        "p99",
        "x p50",
        "x p99",
        "churn/s",
        "unmaps"
    );
    for c in &conds {
        let (rate, unm) = c.churn.as_ref().map_or(("-".into(), "-".into()), |r| {
            let unmaps = r.driver_calls.get("unmap").copied().unwrap_or(r.pages_unmapped);
            (format!("{:.0}", r.ops_per_s), unmaps.to_string())
        });
        println!(
            "{:<18} {:>10.3} {:>10.3} {:>8.3} {:>8.3}  {:>9.3} {:>9.3} {:>8.3} {:>8.3}  {:>8} {:>8}",
            c.condition,
            c.gather_ms.p50,
            c.gather_ms.p99,
            c.gather_slowdown_p50,
            c.gather_slowdown_p99,
            c.copy_ms.p50,
            c.copy_ms.p99,
            c.copy_slowdown_p50,
            c.copy_slowdown_p99,
            rate,
            unm
        );
        if let Some(e) = c.churn.as_ref().and_then(|r| r.error.as_ref()) {
            println!("    churn stopped early: {e}");
        }
    }
    println!("(kernel times in ms by CUDA events; x: over 'alone'; target MoonBright gather p50 <= 1.02x,");
    println!(
        " eager measured 4.4x; unmaps: MoonBright's cuMemUnmap calls, eager's pages unmapped)"
    );
    if let Some(mb) = conds.iter().find(|c| c.condition == "MoonBright churn") {
        let met = mb.gather_slowdown_p50 <= 1.02;
        println!(
            "target [{}]: MoonBright churn gather slowdown p50 {:.3}x (<= 1.02x), churn {:.0} ops/s (>= 10000)",
            if met { "met" } else { "MISSED" },
            mb.gather_slowdown_p50,
            mb.churn.as_ref().map_or(0.0, |r| r.ops_per_s)
        );
    }
    if let Some(path) = &a.json {
        let report = Report {
            gpu: gpu.name.clone(),
            gather_gib: a.gather_gib,
            gather_reads: a.gather_mreads * 1_000_000,
            copy_gib: a.copy_gib,
            conditions: conds,
        };
        moonbright_bench::write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    main_wrapper("interference", run)
}
