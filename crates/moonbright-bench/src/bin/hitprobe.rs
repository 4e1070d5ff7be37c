//! Where a large window hit's time goes (README, window hits: 8-18 us at 1-8 GiB on the H200,
//! 0.75 us on the host backend in a loop). Each repetition waits, untimed, until the mapper has
//! filled a window of two requests and gone idle, then times, back to back:
//!
//! - `async`: `malloc_async` twice (the first hit after the refill, then a second one);
//! - `sync`: `malloc` twice (the same fast path without the `cuStreamIsCapturing` query);
//! - `query`: the capture query alone, then `malloc`.
//!
//! If the first hit costs far more than the second, the cost is the coldness the refill leaves
//! behind (caches, TLB), not the hit's own work. The cases rotate from one repetition to the
//! next. On the GPU, `pool` does the same with `cuMemAllocAsync` from a warm default pool (after
//! the same idle spell, two allocations back to back): the comparator's own first and second.
//! `--host` runs MoonBright's cases on the host backend, on any machine.
//!
//! `--disturb` asks why a first hit is slow: it times hits of MoonBright and of the pool right
//! after this thread evicted the CPU caches, or unmapped memory (a TLB flush), as a mapper's
//! driver calls on another core may do.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use moonbright::driver::prelude::*;
use moonbright::{Allocator, BackendKind, StreamHandle};
use moonbright_bench::cu::{Gpu, Stream};
use moonbright_bench::paths::window_for;
use moonbright_bench::stats::{us_since, Summary};
use moonbright_bench::{human, main_wrapper, mb_options, Res, GIB, MIB};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(
    about = "Window hits: the first after a refill against the next, with and without the capture query"
)]
struct Args {
    /// Repetitions of each case at 2 MiB (fewer at larger sizes).
    #[arg(long, default_value_t = 60)]
    reps: usize,
    /// Microseconds to wait (spinning) after the window is full, so the mapper is asleep.
    #[arg(long, default_value_t = 2000)]
    settle_us: u64,
    /// The host backend instead of the GPU.
    #[arg(long)]
    host: bool,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Instead: runs of this many hits back to back, each timed (`run` mode, see `run_probe`).
    #[arg(long)]
    run: Option<usize>,
    /// Instead: where a cache-hit pair's time goes (`free_parts`).
    #[arg(long)]
    free_parts: bool,
    /// Instead: hits right after the CPU caches or the TLB were disturbed (`disturb_probe`).
    #[arg(long)]
    disturb: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Case {
    Async,
    Sync,
    Query,
    Pool,
}

#[derive(Debug, Serialize)]
struct Row {
    case: Case,
    size: u64,
    /// The capture query (`query`) or the first hit (`async`, `sync`).
    first_us: Summary,
    /// The hit that follows at once.
    second_us: Summary,
}

struct Probe {
    alloc: Allocator,
    stream: StreamHandle,
    settle: Duration,
    held: Vec<u64>,
}

impl Probe {
    /// Waits until the window holds `bytes` and then `settle` more, spinning.
    fn wait_full(&self, bytes: u64) -> Res<()> {
        let t = Instant::now();
        while self.alloc.stats().window_bytes.current < bytes {
            if t.elapsed() > Duration::from_secs(30) {
                return Err(format!("the window did not reach {} in 30 s", human(bytes)));
            }
            std::hint::spin_loop();
        }
        spin(self.settle);
        Ok(())
    }

    /// Gives everything back, so the next refill starts again from nothing.
    fn reset(&mut self) -> Res<()> {
        for p in self.held.drain(..) {
            self.alloc.free(p).map_err(|e| format!("free: {e}"))?;
        }
        self.alloc.release_unused().map_err(|e| format!("release_unused: {e}"))?;
        Ok(())
    }

    fn timed(&mut self, f: impl FnOnce(&Allocator) -> moonbright::Result<u64>) -> Res<f64> {
        let t = Instant::now();
        let p = f(&self.alloc).map_err(|e| format!("allocation: {e}"))?;
        let us = us_since(t);
        self.held.push(p);
        Ok(us)
    }

    /// One repetition of `case`: (first, second) in microseconds.
    fn once(&mut self, case: Case, size: u64) -> Res<(f64, f64)> {
        let (s, n) = (self.stream, size as usize);
        let hits0 = self.alloc.stats().window_hits;
        let r = match case {
            Case::Async => {
                (self.timed(|a| a.malloc_async(n, s))?, self.timed(|a| a.malloc_async(n, s))?)
            }
            Case::Sync => (self.timed(|a| a.malloc(n))?, self.timed(|a| a.malloc(n))?),
            Case::Pool => unreachable!("the pool case has no MoonBright allocator"),
            Case::Query => {
                let t = Instant::now();
                let capturing = self.alloc.driver().is_capturing(s);
                let q = us_since(t);
                capturing.map_err(|e| format!("is_capturing: {e}"))?;
                (q, self.timed(|a| a.malloc(n))?)
            }
        };
        let hits = self.alloc.stats().window_hits - hits0;
        let want = if case == Case::Query { 1 } else { 2 };
        if hits != want {
            return Err(format!("{case:?} {}: {hits} window hits, not {want}", human(size)));
        }
        Ok(r)
    }
}

fn probe(args: &Args) -> Res<Vec<Row>> {
    // Kept alive for the whole run: the stream lives in the context `Gpu::open` retained.
    let gpu = if args.host { None } else { Some(Gpu::open()?) };
    let gpu_stream = gpu.as_ref().map(|_| Stream::new(true)).transpose()?;
    let mut rows = Vec::new();
    for size in [2 * MIB, 64 * MIB, GIB, 8 * GIB] {
        let window = window_for(size);
        let mut opts = mb_options(None, moonbright_bench::max_chunk(), (window, window), true);
        if args.host {
            opts.backend = BackendKind::Host;
            opts.host_capacity = 64 * GIB;
        }
        let alloc = Allocator::new(opts).map_err(|e| format!("MoonBright: {e}"))?;
        let stream = gpu_stream.as_ref().map_or(StreamHandle(0), |s| s.handle());
        let mut p =
            Probe { alloc, stream, settle: Duration::from_micros(args.settle_us), held: vec![] };
        let reps = (args.reps as u64 * 2 * MIB / size).clamp(8, args.reps as u64) as usize;
        let cases = [Case::Async, Case::Sync, Case::Query];
        let mut times: Vec<(Vec<f64>, Vec<f64>)> = vec![(vec![], vec![]); cases.len()];
        // Held memory stays under 8 GiB between resets (at least one repetition each).
        let per_reset = (8 * GIB / (2 * size)).max(1) as usize;
        for i in 0..reps * cases.len() {
            if i % per_reset == 0 {
                p.reset()?;
            }
            p.wait_full(window)?;
            let k = i % cases.len();
            let (a, b) = p.once(cases[k], size)?;
            times[k].0.push(a);
            times[k].1.push(b);
        }
        p.reset()?;
        drop(p);
        if let Some(gpu) = &gpu {
            times.push(pool_times(gpu, size, reps, Duration::from_micros(args.settle_us))?);
        }
        for (case, (a, b)) in cases.iter().chain([&Case::Pool]).zip(times) {
            rows.push(Row {
                case: *case,
                size,
                first_us: Summary::of(&a),
                second_us: Summary::of(&b),
            });
        }
    }
    Ok(rows)
}

/// `cuMemAllocAsync` twice from a warm default pool after an idle spell of `settle`, `reps`
/// times: (first, second) in microseconds. Frees and syncs untimed.
fn pool_times(gpu: &Gpu, size: u64, reps: usize, settle: Duration) -> Res<(Vec<f64>, Vec<f64>)> {
    use moonbright_bench::paths::{AllocPath, CuAsync};
    let mut pool = CuAsync::new(gpu)?;
    let (mut first, mut second) = (Vec::new(), Vec::new());
    for _ in 0..reps + 1 {
        spin(settle);
        let t = Instant::now();
        let a = pool.alloc(size)?;
        first.push(us_since(t));
        let t = Instant::now();
        let b = pool.alloc(size)?;
        second.push(us_since(t));
        pool.free(a)?;
        pool.free(b)?;
    }
    // The first repetition grew the pool: not a warm pool's figure.
    first.remove(0);
    second.remove(0);
    Ok((first, second))
}

/// Where a cache hit's alloc+free pair spends its time, on one stream, `reps` times each
/// (p50, p99 in us): the pair's alloc and free, then the capture query and an event record
/// alone, the two driver calls a stream free makes.
fn free_parts(args: &Args) -> Res<Vec<(String, Summary)>> {
    let _gpu = Gpu::open()?;
    let stream = Stream::new(true)?;
    let s = stream.handle();
    let mut rows = Vec::new();
    // By default, and under PyTorch's contract (no capture query, frees' events left to the
    // worker): pairs, and batches of 200 allocations then their 200 frees (as a step frees its
    // tensors while hundreds are pending), each call timed.
    for contract in [false, true] {
        let tag = if contract { ", contract" } else { "" };
        for size in [256, 2 * MIB, GIB] {
            let mut opts = mb_options(
                None,
                moonbright_bench::max_chunk(),
                moonbright_bench::default_window(),
                true,
            );
            opts.captures_announced = contract;
            opts.deferred_free_events = contract;
            let alloc = Allocator::new(opts).map_err(|e| format!("MoonBright: {e}"))?;
            let (mut a, mut f) = (vec![], vec![]);
            for i in 0..args.reps * 50 + 100 {
                let t = Instant::now();
                let p = alloc.malloc_async(size as usize, s).map_err(|e| format!("malloc: {e}"))?;
                let ta = us_since(t);
                let t = Instant::now();
                alloc.free_async(p, s).map_err(|e| format!("free: {e}"))?;
                let tf = us_since(t);
                if i >= 100 {
                    a.push(ta);
                    f.push(tf);
                }
            }
            rows.push((format!("cache-hit alloc {}{tag}", human(size)), Summary::of(&a)));
            rows.push((format!("cache-hit free {}{tag}", human(size)), Summary::of(&f)));
            if size >= GIB {
                continue; // 200 live at 1 GiB would not fit every card
            }
            let (mut a, mut f) = (vec![], vec![]);
            for round in 0..args.reps + 5 {
                let mut ptrs = Vec::with_capacity(200);
                for _ in 0..200 {
                    let t = Instant::now();
                    ptrs.push(
                        alloc.malloc_async(size as usize, s).map_err(|e| format!("malloc: {e}"))?,
                    );
                    if round >= 5 {
                        a.push(us_since(t));
                    }
                }
                for p in ptrs {
                    let t = Instant::now();
                    alloc.free_async(p, s).map_err(|e| format!("free: {e}"))?;
                    if round >= 5 {
                        f.push(us_since(t));
                    }
                }
            }
            rows.push((format!("batch-200 alloc {}{tag}", human(size)), Summary::of(&a)));
            rows.push((format!("batch-200 free {}{tag}", human(size)), Summary::of(&f)));
        }
    }
    let alloc = Allocator::new(mb_options(None, moonbright_bench::max_chunk(), (0, 0), false))
        .map_err(|e| format!("MoonBright: {e}"))?;
    let d = alloc.driver();
    let ev = d.create_event().map_err(|e| format!("create_event: {e}"))?;
    let (mut q, mut r) = (vec![], vec![]);
    for _ in 0..args.reps * 50 {
        let t = Instant::now();
        d.is_capturing(s).map_err(|e| format!("is_capturing: {e}"))?;
        q.push(us_since(t));
        let t = Instant::now();
        d.record_event(ev, s).map_err(|e| format!("record_event: {e}"))?;
        r.push(us_since(t));
    }
    stream.sync()?;
    d.destroy_event(ev).map_err(|e| format!("destroy_event: {e}"))?;
    rows.push(("cuStreamIsCapturing".into(), Summary::of(&q)));
    rows.push(("cuEventRecord".into(), Summary::of(&r)));
    Ok(rows)
}

/// What `disturb_probe` does to the CPU just before a timed request.
#[derive(Clone, Copy, Debug)]
enum Disturb {
    None,
    /// Writes a buffer twice the size of any last-level cache, a line at a time.
    EvictCaches,
    /// Maps, touches and unmaps 64 MiB (above glibc's largest mmap threshold, so the free
    /// unmaps): the kernel flushes this thread's TLB.
    FlushTlb,
}

impl Disturb {
    const ALL: [Disturb; 3] = [Disturb::None, Disturb::EvictCaches, Disturb::FlushTlb];

    fn run(self, buf: &mut [u8]) {
        match self {
            Disturb::None => {}
            Disturb::EvictCaches => {
                for i in (0..buf.len()).step_by(64) {
                    buf[i] = buf[i].wrapping_add(1);
                }
                std::hint::black_box(&buf);
            }
            Disturb::FlushTlb => {
                let mut v = vec![0u8; 64 << 20];
                for i in (0..v.len()).step_by(4096) {
                    v[i] = 1;
                }
                std::hint::black_box(&v);
            }
        }
    }
}

/// Hits of 64 MiB right after each `Disturb`, interleaved (p50, p99 in us), for MoonBright's
/// window hit (kept live; the window holds 64 requests and is refilled, and the mapper left
/// idle 2 ms, after every 48), MoonBright's cache hit (an alloc+free pair, the alloc timed),
/// and on the GPU `cuMemAllocAsync` kept live from a pool warmed with 48, and its pair. If a
/// disturbed hit costs what the first hit after a refill costs, the refill's cost to the
/// request is the CPU state it leaves, and the gap to the pool is how much state each path
/// touches.
fn disturb_probe(args: &Args) -> Res<Vec<(String, Summary)>> {
    const SIZE: u64 = 64 * MIB;
    const PER_FILL: usize = 48;
    let gpu = if args.host { None } else { Some(Gpu::open()?) };
    let gpu_stream = gpu.as_ref().map(|_| Stream::new(true)).transpose()?;
    let stream = gpu_stream.as_ref().map_or(StreamHandle(0), |s| s.handle());
    let mut buf = vec![1u8; 1 << 30];
    let reps = args.reps.max(PER_FILL / Disturb::ALL.len());
    let mut opts = mb_options(None, moonbright_bench::max_chunk(), (64 * SIZE, 64 * SIZE), true);
    if args.host {
        opts.backend = BackendKind::Host;
        opts.host_capacity = 64 * GIB;
    }
    let alloc = Allocator::new(opts).map_err(|e| format!("MoonBright: {e}"))?;
    let mut p = Probe { alloc, stream, settle: Duration::from_millis(2), held: vec![] };
    let mut rows = Vec::new();
    let mut window: Vec<Vec<f64>> = vec![vec![]; Disturb::ALL.len()];
    let mut cache = window.clone();
    for i in 0..reps * Disturb::ALL.len() {
        if i % PER_FILL == 0 {
            p.reset()?;
            p.wait_full(64 * SIZE)?;
        }
        let k = i % Disturb::ALL.len();
        Disturb::ALL[k].run(&mut buf);
        let hits = p.alloc.stats().window_hits;
        window[k].push(p.timed(|a| a.malloc_async(SIZE as usize, stream))?);
        if p.alloc.stats().window_hits != hits + 1 {
            return Err("a disturbed request was not a window hit".into());
        }
    }
    p.reset()?;
    // The cache path: one range freed and taken again.
    let a = &p.alloc;
    let warm = a.malloc_async(SIZE as usize, stream).map_err(|e| format!("malloc: {e}"))?;
    a.free_async(warm, stream).map_err(|e| format!("free: {e}"))?;
    for i in 0..reps * Disturb::ALL.len() {
        let k = i % Disturb::ALL.len();
        Disturb::ALL[k].run(&mut buf);
        let t = Instant::now();
        let q = a.malloc_async(SIZE as usize, stream).map_err(|e| format!("malloc: {e}"))?;
        cache[k].push(us_since(t));
        a.free_async(q, stream).map_err(|e| format!("free: {e}"))?;
    }
    for (k, d) in Disturb::ALL.iter().enumerate() {
        rows.push((format!("mb window hit, {d:?}"), Summary::of(&window[k])));
        rows.push((format!("mb cache hit, {d:?}"), Summary::of(&cache[k])));
    }
    drop(p);
    if let Some(gpu) = &gpu {
        use moonbright_bench::paths::{AllocPath, CuAsync};
        let mut pool = CuAsync::new(gpu)?;
        let (mut kept, mut pair) = (window, cache);
        kept.iter_mut().chain(pair.iter_mut()).for_each(Vec::clear);
        let mut live = Vec::new();
        for i in 0..=reps * Disturb::ALL.len() {
            if i % PER_FILL == 0 {
                for q in live.drain(..) {
                    pool.free(q)?;
                }
                moonbright_bench::cu::ctx_sync()?;
                if i == 0 {
                    // Warm the pool with a fill's worth.
                    let warmup: Vec<u64> =
                        (0..PER_FILL).map(|_| pool.alloc(SIZE)).collect::<Res<_>>()?;
                    for q in warmup {
                        pool.free(q)?;
                    }
                    moonbright_bench::cu::ctx_sync()?;
                }
                spin(Duration::from_millis(2));
            }
            let k = i % Disturb::ALL.len();
            Disturb::ALL[k].run(&mut buf);
            let t = Instant::now();
            live.push(pool.alloc(SIZE)?);
            if i > 0 {
                kept[k].push(us_since(t));
            }
        }
        for q in live.drain(..) {
            pool.free(q)?;
        }
        for i in 0..reps * Disturb::ALL.len() {
            let k = i % Disturb::ALL.len();
            Disturb::ALL[k].run(&mut buf);
            let t = Instant::now();
            let q = pool.alloc(SIZE)?;
            pair[k].push(us_since(t));
            pool.free(q)?;
        }
        moonbright_bench::cu::ctx_sync()?;
        for (k, d) in Disturb::ALL.iter().enumerate() {
            rows.push((format!("pool kept live, {d:?}"), Summary::of(&kept[k])));
            rows.push((format!("pool pair, {d:?}"), Summary::of(&pair[k])));
        }
    }
    Ok(rows)
}

/// One run mode's figures at one size: p50 over runs of each position in the run, and of
/// positions 3 and later together (the warm loop).
#[derive(Debug, Serialize)]
struct RunRow {
    mode: &'static str,
    size: u64,
    by_position_p50_us: Vec<f64>,
    warm_us: Summary,
}

/// Runs of `k` fresh allocations back to back, each timed, kept live until the run ends:
///
/// - `idle`: MoonBright, after the mapper has filled a window of `k` requests and gone idle;
/// - `busy`: MoonBright, while the mapper is still refilling (window target `2k` requests,
///   the run starts once it holds `k`);
/// - `pool`: `cuMemAllocAsync` from a default pool warmed with `k` such allocations.
///
/// A fresh range that stays live is what a window hit serves; a warm pool serves the same from
/// memory it already holds. Positions 3 and later are the warm loop.
fn run_probe(args: &Args, k: usize) -> Res<Vec<RunRow>> {
    let gpu = if args.host { None } else { Some(Gpu::open()?) };
    let gpu_stream = gpu.as_ref().map(|_| Stream::new(true)).transpose()?;
    let stream = gpu_stream.as_ref().map_or(StreamHandle(0), |s| s.handle());
    let settle = Duration::from_micros(args.settle_us);
    let mut rows = Vec::new();
    let k_all = k;
    for size in [2 * MIB, 64 * MIB, GIB, 8 * GIB] {
        // An 8 GiB run of 16 would hold 128 GiB: runs of 4 there (32 GiB, twice in busy mode).
        let k = if size > GIB { k_all.min(4) } else { k_all };
        let runs = (args.reps as u64 * 2 * MIB / size).clamp(6, args.reps as u64) as usize;
        for mode in ["idle", "busy", "pool"] {
            let mut by_pos: Vec<Vec<f64>> = vec![vec![]; k];
            if mode == "pool" {
                let Some(gpu) = &gpu else { continue };
                use moonbright_bench::paths::{AllocPath, CuAsync};
                let mut pool = CuAsync::new(gpu)?;
                for r in 0..runs + 1 {
                    spin(settle);
                    let mut ptrs = Vec::with_capacity(k);
                    let mut ts = Vec::with_capacity(k);
                    for _ in 0..k {
                        let t = Instant::now();
                        ptrs.push(pool.alloc(size)?);
                        ts.push(us_since(t));
                    }
                    for p in ptrs {
                        pool.free(p)?;
                    }
                    moonbright_bench::cu::ctx_sync()?;
                    if r > 0 {
                        // The first run grew the pool.
                        ts.into_iter().zip(by_pos.iter_mut()).for_each(|(t, v)| v.push(t));
                    }
                }
            } else {
                let bytes = k as u64 * size;
                let target = if mode == "busy" { 2 * bytes } else { bytes };
                let mut opts =
                    mb_options(None, moonbright_bench::max_chunk(), (target, target), true);
                if args.host {
                    opts.backend = BackendKind::Host;
                    opts.host_capacity = 64 * GIB;
                }
                let alloc = Allocator::new(opts).map_err(|e| format!("MoonBright: {e}"))?;
                // Busy: no settle, so the mapper is still refilling when the run starts.
                let settle = if mode == "busy" { Duration::ZERO } else { settle };
                let mut p = Probe { alloc, stream, settle, held: vec![] };
                for _ in 0..runs {
                    p.reset()?;
                    p.wait_full(bytes)?;
                    let hits0 = p.alloc.stats().window_hits;
                    for v in by_pos.iter_mut() {
                        let t = p.timed(|a| a.malloc_async(size as usize, stream))?;
                        v.push(t);
                    }
                    let hits = p.alloc.stats().window_hits - hits0;
                    if hits != k as u64 {
                        return Err(format!("{mode} {}: {hits} window hits of {k}", human(size)));
                    }
                }
                p.reset()?;
            }
            let warm: Vec<f64> = by_pos.iter().skip(2).flatten().copied().collect();
            rows.push(RunRow {
                mode,
                size,
                by_position_p50_us: by_pos.iter().map(|v| Summary::of(v).p50).collect(),
                warm_us: Summary::of(&warm),
            });
        }
    }
    Ok(rows)
}

/// Waits `d`, spinning (a sleep would leave the core idle, and the next request cold).
fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn main() -> ExitCode {
    main_wrapper("hitprobe", || {
        let args = Args::parse();
        if args.free_parts {
            for (what, s) in free_parts(&args)? {
                println!("{what:<40} p50 {:.3} p99 {:.3} us", s.p50, s.p99);
            }
            return Ok(());
        }
        if args.disturb {
            let rows = disturb_probe(&args)?;
            println!("hitprobe --disturb: 64 MiB requests right after a disturbance, alloc only");
            for (what, s) in &rows {
                println!("{what:<34} p50 {:.2} p99 {:.2} us", s.p50, s.p99);
            }
            if let Some(p) = &args.json {
                let rows: Vec<_> = rows.iter().map(|(w, s)| (w, s)).collect();
                moonbright_bench::write_json(p, &rows)?;
            }
            return Ok(());
        }
        if let Some(k) = args.run {
            let rows = run_probe(&args, k.max(3))?;
            println!("hitprobe runs of {k} fresh allocations: p50 by position; warm = 3rd on");
            for r in &rows {
                let pos: Vec<String> =
                    r.by_position_p50_us.iter().map(|x| format!("{x:.2}")).collect();
                println!(
                    "{:<5} {:>8}  warm p50 {:.2} p99 {:.2}  | {}",
                    r.mode,
                    human(r.size),
                    r.warm_us.p50,
                    r.warm_us.p99,
                    pos.join(" ")
                );
            }
            if let Some(p) = &args.json {
                moonbright_bench::write_json(p, &rows)?;
            }
            return Ok(());
        }
        let rows = probe(&args)?;
        println!(
            "hitprobe ({}, settle {} us): p50 (p99) us; async/sync: first hit after the refill, \
             then the next; query: the capture query alone, then a hit; pool: cuMemAllocAsync \
             from a warm pool, first after the idle spell, then the next",
            if args.host { "host backend" } else { "CUDA" },
            args.settle_us
        );
        println!("{:<6} {:>8} {:>18} {:>18}", "case", "size", "first", "second");
        for r in &rows {
            let f = |s: &Summary| format!("{:.2} ({:.2})", s.p50, s.p99);
            println!(
                "{:<6} {:>8} {:>18} {:>18}",
                format!("{:?}", r.case).to_lowercase(),
                human(r.size),
                f(&r.first_us),
                f(&r.second_us)
            );
        }
        if let Some(p) = &args.json {
            moonbright_bench::write_json(p, &rows)?;
        }
        Ok(())
    })
}
