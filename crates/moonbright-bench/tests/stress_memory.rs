//! The fragmentation stress's memory target, peak reserved at most 1.05 of peak allocated, at
//! many seeds. The benchmark runs one fixed seed on the H200; another seed went over the target
//! with `carve` at 0.005, the default before 0.0025 (seed 4: 1.049-1.057 with the background
//! worker, whose timing changes which ranges are cached when). Here the worker is off, so a run
//! is deterministic, and which requests map, carve or steal is the policy's own; the bound
//! leaves the worker's 0.01 of margin (`MARGIN_FOR_THE_WORKER`). At 0.005 seed 4 holds 1.049
//! here, and this test fails; at 0.0025 the seeds hold 1.026-1.034.

use moonbright::{driver::prelude::*, Allocator, BackendKind, Options};
use moonbright_bench::workload::{stress_ops, Op, StressSpec};
use moonbright_bench::GIB;

/// The benchmark's sequence at `seed`, through the default options: its statistics at the end.
fn stress_stats(seed: u64) -> moonbright::Stats {
    let (ops, _) = stress_ops(&StressSpec::issue3(seed));
    let a = Allocator::new(Options {
        backend: BackendKind::Host,
        host_capacity: 140 * GIB,
        background: false,
        ..Options::default()
    })
    .expect("a host-backend allocator");
    let s = a.driver().create_stream().expect("a host stream");
    let mut live = std::collections::HashMap::new();
    for op in ops {
        match op {
            Op::Alloc { id, size } => {
                let p =
                    a.malloc_async(size as usize, s).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
                live.insert(id, p);
            }
            Op::Free { id, .. } => {
                let p = live.remove(&id).expect("freed once");
                a.free_async(p, s).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            }
        }
    }
    a.stats()
}

/// (peak reserved, peak allocated) of the benchmark's sequence at `seed`.
fn stress_peaks(seed: u64) -> (u64, u64) {
    let stats = stress_stats(seed);
    (stats.reserved_bytes.peak, stats.allocated_bytes.peak)
}

/// How much the background worker's timing moved one seed's figure (1.049 without it, up to
/// 1.057 with it, with `carve` at 0.005).
const MARGIN_FOR_THE_WORKER: f64 = 0.01;

#[test]
fn the_stress_holds_its_peak_within_the_target_at_every_seed() {
    let bound = 1.05 - MARGIN_FOR_THE_WORKER;
    let mut over = Vec::new();
    for seed in (1..=12).chain([20_261_129]) {
        let (reserved, allocated) = stress_peaks(seed);
        let ratio = reserved as f64 / allocated as f64;
        if ratio > bound {
            over.push(format!("seed {seed}: {ratio:.4}"));
        }
    }
    assert!(over.is_empty(), "peak reserved over peak allocated above {bound}: {over:?}");
}

/// The placement policy's fingerprint on the benchmark's own seed: deterministic without the
/// worker, so these move only when the policy is meant to change (as the traces' figures in
/// `crates/moonbright-cli/tests/deterministic_replays.rs`).
#[test]
fn the_stress_keeps_its_figures_at_the_benchmarks_seed() {
    let s = stress_stats(20_261_129);
    let got = [
        s.reserved_bytes.peak,
        s.allocated_bytes.peak,
        s.request_maps,
        s.request_mapped_handles,
        s.cache_hits,
        s.subpage_allocations,
        s.carved_allocations,
        s.cached_ranges_stolen,
    ];
    assert_eq!(got, EXPECTED_STRESS, "the stress's figures moved");
}

/// Peak reserved and allocated bytes, request maps and their handles, cache hits, sub-page and
/// carved allocations, cached ranges stolen.
const EXPECTED_STRESS: [u64; 8] =
    [67_169_681_408, 65_377_501_217, 2008, 6946, 2733, 6219, 2304, 1900];
