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

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use moonbright::driver::Driver;
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
        let t = Instant::now();
        while t.elapsed() < self.settle {
            std::hint::spin_loop();
        }
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
        let t = Instant::now();
        while t.elapsed() < settle {
            std::hint::spin_loop();
        }
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

fn main() -> ExitCode {
    main_wrapper("hitprobe", || {
        let args = Args::parse();
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
