//! MoonBright's own cost of a cache hit, with no GPU: `malloc_async` + `free_async` of one size
//! on one stream of the host backend (whose driver calls are a mutex and a map), in a tight
//! loop with the background worker running, under the default options and under PyTorch's
//! contract (`captures_announced`, `deferred_free_events`). For work on the hot path between
//! device sessions; the H200's figures come from `latency`, which adds the driver's calls.
//!
//! `--cold`: instead, the allocator's own work in a cold map (the `latency` benchmark's cold
//! path: no window, `release_unused` before each request), that is the request's time less its
//! time inside the backend's create/map/set-access calls, at p50.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use moonbright::driver::{CallTimes, Driver};
use moonbright::{Allocator, Options};
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
    let p50 = |v: &mut Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2] as f64
    };
    Ok((p50(&mut whole), p50(&mut own)))
}

fn main() -> ExitCode {
    main_wrapper("hostpair", || {
        let args = Args::parse();
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
