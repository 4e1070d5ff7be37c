//! MoonBright's own cost of a cache hit, with no GPU: `malloc_async` + `free_async` of one size
//! on one stream of the host backend (whose driver calls are a mutex and a map), in a tight
//! loop with the background worker running, under the default options and under PyTorch's
//! contract (`captures_announced`, `deferred_free_events`). For work on the hot path between
//! device sessions; the H200's figures come from `latency`, which adds the driver's calls.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use moonbright::driver::Driver;
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

fn main() -> ExitCode {
    main_wrapper("hostpair", || {
        let args = Args::parse();
        println!("{:>8}  {:>10}  {:>10}", "size", "defaults", "contract");
        for size in [256, 64 << 10, 2 * MIB as usize, 64 * MIB as usize] {
            let d = ns_per_pair(false, size, &args)?;
            let c = ns_per_pair(true, size, &args)?;
            println!("{:>8}  {d:>7.0} ns  {c:>7.0} ns", human(size as u64));
        }
        Ok(())
    })
}
