//! MoonBright's own cost of a cache hit, with no GPU: `malloc_async` + `free_async` of one size
//! on one stream of the host backend (whose driver calls are a mutex and a map), in a tight
//! loop with the background worker running, under the default options and under PyTorch's
//! contract (`captures_announced`, `deferred_free_events`). For work on the hot path between
//! device sessions; the H200's figures come from `latency`, which adds the driver's calls.
//!
//! `--cold`: instead, the allocator's own work in a cold map (the `latency` benchmark's cold
//! path: no window, `release_unused` before each request), that is the request's time less its
//! time inside the backend's create/map/set-access calls, at p50.
//!
//! `--miss`: the allocator's own work in a request no cached range serves, beside thousands of
//! cached ranges laid out so that every cache search runs to its bounds: ranges with no cached
//! neighbour, pairs of neighbours too small for the request, and pairs that hold enough pages
//! but no run of exactly the request's (the joins' walk, `Heap::split_joined`).

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use moonbright::driver::{prelude::*, CallTimes};
use moonbright::{Allocator, Options};
use moonbright_bench::stats::median;
use moonbright_bench::{human, main_wrapper, Res, MIB};

#[derive(Parser, Debug)]
#[command(about = "Cache-hit alloc+free pairs on the host backend, in ns")]
struct Args {
    /// Pairs a round; the best of `--rounds` rounds is printed.
    #[arg(long, default_value_t = 1_000_000)]
    pairs: u64,
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Time cold maps instead (`--pairs` of them, at most 200,000, each after a
    /// `release_unused`).
    #[arg(long)]
    cold: bool,
    /// Time misses beside many cached ranges instead (see the module's comment).
    #[arg(long)]
    miss: bool,
    /// With `--miss`: cached ranges (at most 12,000).
    #[arg(long, default_value_t = 4_000)]
    ranges: usize,
}

fn ns_per_pair(contract: bool, size: usize, args: &Args) -> Res<f64> {
    let opts = Options {
        background: true,
        captures_announced: contract,
        deferred_free_events: contract,
        validate: false,
        cap_fraction: 1.0,
        ..Options::host(4 << 30, 2 << 20)
    };
    let a = Allocator::new(opts).map_err(|e| e.to_string())?;
    let s = a.driver().create_stream().map_err(|e| e.to_string())?;
    let pair = || -> Res<()> {
        let p = a.malloc_async(size, s).map_err(|e| e.to_string())?;
        a.free_async(p, s).map_err(|e| e.to_string())
    };
    for _ in 0..10_000 {
        pair()?;
    }
    let mut best = f64::MAX;
    for _ in 0..args.rounds {
        let t = Instant::now();
        for _ in 0..args.pairs {
            pair()?;
        }
        best = best.min(t.elapsed().as_nanos() as f64 / args.pairs as f64);
    }
    a.driver().destroy_stream(s).map_err(|e| e.to_string())?;
    Ok(best)
}

/// p50 of a cold map's whole time and of its time outside the timed backend calls, in ns.
fn cold_ns(size: usize, beside_live: bool, args: &Args) -> Res<(f64, f64)> {
    let opts = Options {
        validate: false,
        cap_fraction: 1.0,
        prefetch_window_min: 0,
        prefetch_window_max: 0,
        ..Options::host(4 << 30, 2 << 20)
    };
    let a = Allocator::new(opts).map_err(|e| e.to_string())?;
    let s = a.driver().create_stream().map_err(|e| e.to_string())?;
    let live = if beside_live {
        Some(a.malloc(2 * MIB as usize).map_err(|e| e.to_string())?)
    } else {
        None
    };
    // Only the VMM calls are timed (`CallTimes::timed`); the other kinds stay at 0.
    let timed = |t: &CallTimes| -> u64 { t.total_ns.iter().sum() };
    let (mut whole, mut own) = (Vec::new(), Vec::new());
    for i in 0..args.pairs.min(200_000) + 1_000 {
        a.release_unused().map_err(|e| e.to_string())?;
        let before = timed(&a.driver().times());
        let t = Instant::now();
        let p = a.malloc_async(size, s).map_err(|e| e.to_string())?;
        let ns = t.elapsed().as_nanos() as u64;
        let inside = timed(&a.driver().times()) - before;
        a.free_async(p, s).map_err(|e| e.to_string())?;
        if i >= 1_000 {
            whole.push(ns);
            own.push(ns.saturating_sub(inside));
        }
    }
    if let Some(p) = live {
        a.free(p).map_err(|e| e.to_string())?;
    }
    a.driver().destroy_stream(s).map_err(|e| e.to_string())?;
    Ok((median(&whole) as f64, median(&own) as f64))
}

/// How the cached ranges of `--miss` lie: each pattern repeats, `c` a cached range and `L` a
/// live one, of `pages` pages each (one chunk); the request is `want` pages.
struct Layout {
    name: &'static str,
    pattern: &'static [bool],
    pages: usize,
    want: usize,
}

const LAYOUTS: [Layout; 3] = [
    Layout { name: "no cached neighbour (c L)", pattern: &[true, false], pages: 1, want: 2 },
    Layout { name: "neighbours too few (c c L)", pattern: &[true, true, false], pages: 1, want: 3 },
    Layout { name: "no exact run (c c L)", pattern: &[true, true, false], pages: 4, want: 5 },
];

/// p50 of a miss's time outside the timed backend calls beside `ranges` cached ranges laid out
/// as `layout` (or none), in ns. Each miss steals a little of the cache (the oldest ranges), so
/// only a few are timed (200, after 20 untimed), and each stays live to the end: freed, it would
/// be cached and serve the next request.
fn miss_ns(layout: &Layout, ranges: usize, empty: bool) -> Res<f64> {
    const PAGE: usize = 64 << 10;
    let opts = Options {
        validate: false,
        cap_fraction: 1.0,
        prefetch_window_min: 0,
        prefetch_window_max: 0,
        max_chunk_bytes: 4 * PAGE as u64,
        ..Options::host(4 << 30, PAGE)
    };
    let a = Allocator::new(opts).map_err(|e| e.to_string())?;
    let e = |e: moonbright::Error| e.to_string();
    let mut live = Vec::new();
    if !empty {
        let mut cached = Vec::new();
        while cached.len() < ranges {
            for &c in layout.pattern {
                let p = a.malloc(layout.pages * PAGE).map_err(e)?;
                if c {
                    cached.push(p)
                } else {
                    live.push(p)
                }
            }
        }
        for p in cached {
            a.free(p).map_err(e)?;
        }
    }
    let timed = |t: &CallTimes| -> u64 { t.total_ns.iter().sum() };
    let mut own = Vec::new();
    for i in 0..220 {
        let before = timed(&a.driver().times());
        let t = Instant::now();
        let p = a.malloc(layout.want * PAGE).map_err(e)?;
        let ns = t.elapsed().as_nanos() as u64;
        let inside = timed(&a.driver().times()) - before;
        if i >= 20 {
            own.push(ns.saturating_sub(inside));
        }
        live.push(p);
    }
    for p in live {
        a.free(p).map_err(e)?;
    }
    Ok(median(&own) as f64)
}

fn main() -> ExitCode {
    main_wrapper("hostpair", || {
        let args = Args::parse();
        if args.miss {
            let ranges = args.ranges.min(12_000);
            println!(
                "misses beside {ranges} cached ranges, p50 ns outside the timed backend calls"
            );
            for layout in &LAYOUTS {
                let base = miss_ns(layout, ranges, true)?;
                let beside = miss_ns(layout, ranges, false)?;
                println!("  {:<28} {beside:>8.0}   (empty allocator {base:.0})", layout.name);
            }
            return Ok(());
        }
        if args.cold {
            println!("cold maps, p50 ns: whole request / outside the timed backend calls");
            println!("{:>8}  {:>20}  {:>20}", "size", "empty allocator", "beside a live one");
            for size in [256, 64 << 10, 2 * MIB as usize, 64 * MIB as usize] {
                let (w, o) = cold_ns(size, false, &args)?;
                let (wl, ol) = cold_ns(size, true, &args)?;
                println!("{:>8}  {w:>9.0} / {o:>7.0}  {wl:>9.0} / {ol:>7.0}", human(size as u64));
            }
            return Ok(());
        }
        println!("{:>8}  {:>10}  {:>10}", "size", "defaults", "contract");
        for size in [256, 64 << 10, 2 * MIB as usize, 64 * MIB as usize] {
            let d = ns_per_pair(false, size, &args)?;
            let c = ns_per_pair(true, size, &args)?;
            println!("{:>8}  {d:>7.0} ns  {c:>7.0} ns", human(size as u64));
        }
        Ok(())
    })
}
