//! A CPU micro-benchmark of the paged pool's host side: the workload of
//! `bench/paged_bench.py` (N live sequences, +1 token each per step, departures at 1/512 per
//! sequence per step replaced by arrivals of 16..512-token prompts, pages of 16 tokens), timing
//! the frees, the adds and the decode step's metadata and delta, but not the delta's
//! application (on the host backend that rewrites whole tables through the allocator, which the
//! GPU path does not pay). With `MB_PAGED_BACKEND=cuda` (on a GPU machine) the pool is on the
//! CUDA backend and the delta's launch is timed too: what a step costs the host in all.
//!
//! `MB_PAGED_SIZES` (`256,1024,4096,16384`) and `MB_PAGED_STEPS` (3000) set the sizes and the
//! steps; `MB_PAGED_EVICT=<MiB>` sweeps that much other memory between steps.
//!
//!     cargo run --release -p moonbright-bench --bin paged_host
//!     MB_PAGED_BACKEND=cuda carry/bin/paged_host

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use moonbright::driver::prelude::*;
use moonbright::{Allocator, BackendKind, Options, StreamHandle};
use moonbright_bench::stats::median;
use moonbright_paged::{PagedConfig, PagedPool, SeqId};

const T: u32 = 16;
const MAX_LEN: u32 = 4096;
const PROMPT: (u32, u32) = (16, 512);

/// Per step: indices into the live list that depart (applied in order, swap-remove), then the
/// arrivals' prompt lengths.
type Events = Vec<(Vec<usize>, Vec<u32>)>;

fn workload(n: usize, steps: usize, seed: u64) -> (Vec<u32>, Events) {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let init: Vec<u32> = (0..n).map(|_| r.gen_range(1..1536)).collect();
    let mut lens = init.clone();
    let mut events = Vec::with_capacity(steps);
    for _ in 0..steps {
        let mut gone = Vec::new();
        let k = (0..lens.len()).filter(|_| r.gen_bool(1.0 / 512.0)).count();
        for _ in 0..k {
            let i = r.gen_range(0..lens.len());
            gone.push(i);
            lens.swap_remove(i);
        }
        let mut i = 0;
        while i < lens.len() {
            if lens[i] >= MAX_LEN - 1 {
                gone.push(i);
                lens.swap_remove(i);
            } else {
                i += 1;
            }
        }
        let arrive: Vec<u32> =
            (0..n - lens.len()).map(|_| r.gen_range(PROMPT.0..PROMPT.1)).collect();
        lens.extend(&arrive);
        lens.iter_mut().for_each(|x| *x += 1);
        events.push((gone, arrive));
    }
    (init, events)
}

fn main() {
    let sizes: Vec<usize> = std::env::var("MB_PAGED_SIZES")
        .unwrap_or_else(|_| "256,1024,4096,16384".into())
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    let steps: usize = std::env::var("MB_PAGED_STEPS").map_or(3000, |s| s.parse().unwrap());
    let warmup = 200;
    for n in sizes {
        let cfg = PagedConfig {
            tokens_per_page: T,
            bytes_per_token: 16,
            max_pages: n as u32 * 160 + 4096,
            max_seqs: n as u32 + 1024,
            max_pages_per_seq: MAX_LEN / T,
            max_step_tokens: n as u32 + 64 * PROMPT.1 + 4096,
        };
        let bytes = (cfg.max_pages as u64 * cfg.page_bytes() as u64).next_power_of_two() * 2;
        let cuda = std::env::var("MB_PAGED_BACKEND").is_ok_and(|b| b == "cuda");
        let opts = if cuda {
            Options { backend: BackendKind::Cuda, cap_bytes: Some(bytes), ..Options::default() }
        } else {
            Options { cap_fraction: 1.0, ..Options::host(bytes, 64 << 10) }
        };
        let a = Allocator::new(opts).unwrap();
        let stream = if cuda { a.driver().create_stream().unwrap() } else { StreamHandle::DEFAULT };
        let mut pool = PagedPool::new(&a, cfg, stream).unwrap();
        let (init, events) = workload(n, warmup + steps, 7);
        let mut live: Vec<SeqId> = Vec::new();
        for chunk in init.chunks(32) {
            for &p in chunk {
                live.push(pool.add(p).unwrap());
            }
            pool.commit_step().unwrap();
        }
        let (mut free_add, mut decode, mut total) = (Vec::new(), Vec::new(), Vec::new());
        let (mut close, mut launch) = (Vec::new(), Vec::new());
        let mut ops = 0usize;
        // MB_PAGED_EVICT=<MiB>: between steps, sweep that much other memory, as the rest of a
        // serving loop would, so that each step starts with the caches of a real one.
        let evict_mib: usize = std::env::var("MB_PAGED_EVICT").map_or(0, |s| s.parse().unwrap());
        let mut other = vec![1u64; evict_mib << 17];
        for (k, (gone, arrive)) in events.iter().enumerate() {
            let mut acc = 0u64;
            for x in other.iter_mut().step_by(8) {
                *x = x.wrapping_add(acc);
                acc = acc.wrapping_add(*x);
            }
            std::hint::black_box(acc);
            let dep: Vec<SeqId> = gone.iter().map(|&i| live.swap_remove(i)).collect();
            let t0 = Instant::now();
            for &s in &dep {
                pool.free(s).unwrap();
            }
            for &p in arrive {
                live.push(pool.add(p).unwrap());
            }
            let t1 = Instant::now();
            pool.bench_decode_tokens().unwrap();
            let tm = Instant::now();
            let step_ops = pool.bench_close_step().ops.len();
            let t2 = Instant::now();
            if cuda {
                // The host backend's apply rewrites whole tables; only the launch is timed.
                pool.bench_apply_delta().unwrap();
            }
            let t3 = Instant::now();
            if k >= warmup {
                close.push((t2 - tm).as_secs_f64() * 1e6);
                launch.push((t3 - t2).as_secs_f64() * 1e6);
            }
            ops += step_ops;
            if k >= warmup {
                free_add.push((t1 - t0).as_secs_f64() * 1e6);
                decode.push((t2 - t1).as_secs_f64() * 1e6);
                total.push((t2 - t0).as_secs_f64() * 1e6);
            }
        }
        pool.check_invariants().unwrap();
        if cuda {
            pool.synchronize().unwrap();
            println!("N={n:6}: launch (cuda) us/step median {:6.2}", median(&launch));
        }
        println!(
            "N={n:6}: host us/step median: total {:7.2}  free+add {:6.2}  decode+delta {:7.2} \
             (of which delta {:6.2}; {:.2} ns/seq; {:.0} table ops/step)",
            median(&total),
            median(&free_add),
            median(&decode),
            median(&close),
            median(&decode) * 1e3 / n as f64,
            ops as f64 / events.len() as f64,
        );
    }
}
