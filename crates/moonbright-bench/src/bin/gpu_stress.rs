//! GPU stress test: several threads, each with its own stream, allocate random
//! sizes with malloc_async, fill each allocation with its id by a kernel, and check it by a kernel
//! before free_async; some allocations are handed to another thread and freed on its stream
//! (after an event); others are checked on a second stream of the thread's, behind a spin,
//! recorded there (`record_stream`) and freed on the thread's own stream at once, after which
//! the same size is allocated and filled on the own stream right away: without the recorded
//! use, that allocation would take the memory the second stream's check still reads. The checks
//! count mismatches in a device counter read back at the end. Exits non-zero on any mismatch.
//! Meant to run under `compute-sanitizer --tool memcheck` too.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use clap::Parser;
use cudarc::driver::sys;
use moonbright::Allocator;
use moonbright_bench::cu::{
    copy_dtoh_u64, ctx_sync, mem_alloc, mem_free, memset_d32, Arg, Event, Function, Gpu, Module,
    Stream,
};
use moonbright_bench::{call_delta, kernels, main_wrapper, mb_options, Res, GIB, MIB};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Multi-stream allocation stress with device-side fill and check")]
struct Args {
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Operations per thread.
    #[arg(long, default_value_t = 3000)]
    ops: usize,
    /// Largest allocation, MiB (sizes are log-uniform from 256 B).
    #[arg(long, default_value_t = 256)]
    max_mib: u64,
    /// Live bytes per thread at most, GiB.
    #[arg(long, default_value_t = 4)]
    live_gib: u64,
    /// MoonBright's cap, GiB (low enough that cached ranges get stolen and unmapped).
    #[arg(long, default_value_t = 24)]
    cap_gib: u64,
    /// Fraction of frees handed to the next thread's stream.
    #[arg(long, default_value_t = 0.1)]
    cross: f64,
    /// Fraction of frees checked on the thread's second stream and recorded there.
    #[arg(long, default_value_t = 0.05)]
    recorded: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// An allocation handed to another thread: it waits for `ready` on its own stream, checks, frees.
struct Handoff {
    ptr: u64,
    size: u64,
    id: u32,
    ready: Event,
}

struct Shared<'a> {
    gpu: &'a Gpu,
    alloc: &'a Allocator,
    fill: Function,
    check: Function,
    spin: Function,
    sms: u32,
    inbox: Vec<Mutex<Vec<Handoff>>>,
    args: &'a Args,
}

#[derive(Debug, Default, Serialize)]
struct ThreadReport {
    allocations: u64,
    frees: u64,
    cross_stream_frees: u64,
    recorded_frees: u64,
    bytes_filled: u64,
    mismatches: u64,
}

impl Shared<'_> {
    fn grid(&self, words: u64) -> u32 {
        (words.div_ceil(256).max(1)).min(self.sms as u64 * 4) as u32
    }

    fn fill(&self, s: &Stream, ptr: u64, size: u64, id: u32) -> Res<()> {
        let n = size / 4;
        // SAFETY: fill(u32* p, u64 n, u32 id): the allocation holds at least n u32, and it stays
        // allocated until a later free on this stream (or after an event recorded after this).
        unsafe {
            self.fill.launch(self.grid(n), 256, s, &[Arg::U64(ptr), Arg::U64(n), Arg::U32(id)])
        }
    }

    fn check_and_free(&self, s: &Stream, bad: u64, ptr: u64, size: u64, id: u32) -> Res<()> {
        let n = size / 4;
        // SAFETY: check(const u32* p, u64 n, u32 id, u64* bad): the allocation holds n u32 and is
        // freed only after this kernel in stream order; `bad` is a live u64 counter.
        unsafe {
            self.check.launch(
                self.grid(n),
                256,
                s,
                &[Arg::U64(ptr), Arg::U64(n), Arg::U32(id), Arg::U64(bad)],
            )?
        };
        self.alloc.free_async(ptr, s.handle()).map_err(|e| format!("free_async: {e}"))
    }

    /// Checks the allocation on `side` behind a spin, records it there, frees it on `s` at once
    /// and allocates and fills the same size on `s` right away; returns that allocation.
    fn free_recorded(
        &self,
        s: &Stream,
        side: &Stream,
        bad: u64,
        (ptr, size, id): (u64, u64, u32),
        new_id: u32,
    ) -> Res<(u64, u64, u32)> {
        let ready = Event::new(false)?;
        ready.record(s)?;
        side.wait(&ready)?;
        let n = size / 4;
        // SAFETY: spin(u64 ns, u64* sink) with a null sink, never written; check(const u32* p,
        // u64 n, u32 id, u64* bad) reads n u32 of an allocation whose free below waits for
        // `side` (record_stream), and `bad` is a live u64 counter.
        unsafe {
            self.spin.launch(1, 1, side, &[Arg::U64(100_000), Arg::U64(0)])?;
            self.check.launch(
                self.grid(n),
                256,
                side,
                &[Arg::U64(ptr), Arg::U64(n), Arg::U32(id), Arg::U64(bad)],
            )?;
        }
        self.alloc.record_stream(ptr, side.handle()).map_err(|e| format!("record_stream: {e}"))?;
        self.alloc.free_async(ptr, s.handle()).map_err(|e| format!("free_async: {e}"))?;
        let again = self
            .alloc
            .malloc_async(size as usize, s.handle())
            .map_err(|e| format!("malloc_async({size}): {e}"))?;
        self.fill(s, again, size, new_id)?;
        Ok((again, size, new_id))
    }

    fn drain(&self, me: usize, s: &Stream, bad: u64, r: &mut ThreadReport) -> Res<()> {
        let items = std::mem::take(&mut *self.inbox[me].lock().unwrap_or_else(|e| e.into_inner()));
        for h in items {
            s.wait(&h.ready)?;
            self.check_and_free(s, bad, h.ptr, h.size, h.id)?;
            r.frees += 1;
            r.cross_stream_frees += 1;
        }
        Ok(())
    }

    fn worker(&self, me: usize) -> Res<ThreadReport> {
        self.gpu.make_current()?;
        let a = self.args;
        let s = Stream::new(true)?;
        let side = Stream::new(true)?;
        let bad = mem_alloc(8)?;
        memset_d32(bad, 0, 2)?;
        ctx_sync()?;
        let mut rng = ChaCha8Rng::seed_from_u64(a.seed * 1000 + me as u64);
        let (lo, hi) = (256f64.ln(), ((a.max_mib * MIB) as f64).ln());
        let mut live: Vec<(u64, u64, u32)> = vec![];
        let mut live_bytes = 0u64;
        let mut r = ThreadReport::default();
        let mut next_id = 1u32;
        for op in 0..a.ops {
            self.drain(me, &s, bad, &mut r)?;
            if op % 64 == 0 {
                // Keep the stream busy for a while, so that frees are still pending on it when
                // other threads allocate.
                // SAFETY: spin(u64 ns, u64* sink) with a null sink, never written.
                unsafe { self.spin.launch(1, 1, &s, &[Arg::U64(200_000), Arg::U64(0)])? };
            }
            let size = (rng.gen_range(lo..hi).exp() as u64).next_multiple_of(4);
            let can_alloc = live.len() < 64 && live_bytes + size <= a.live_gib * GIB;
            if live.is_empty() || (can_alloc && rng.gen_bool(0.55)) {
                if !can_alloc {
                    continue;
                }
                let id = ((me as u32) << 24) | next_id;
                next_id += 1;
                let ptr = self
                    .alloc
                    .malloc_async(size as usize, s.handle())
                    .map_err(|e| format!("malloc_async({size}): {e}"))?;
                self.fill(&s, ptr, size, id)?;
                live.push((ptr, size, id));
                live_bytes += size;
                r.allocations += 1;
                r.bytes_filled += size;
            } else {
                let (ptr, size, id) = live.swap_remove(rng.gen_range(0..live.len()));
                if rng.gen_bool(a.recorded) {
                    let new_id = ((me as u32) << 24) | next_id;
                    next_id += 1;
                    live.push(self.free_recorded(&s, &side, bad, (ptr, size, id), new_id)?);
                    r.frees += 1;
                    r.recorded_frees += 1;
                    r.allocations += 1;
                    r.bytes_filled += size;
                    continue;
                }
                live_bytes -= size;
                if self.args.threads > 1 && rng.gen_bool(a.cross) {
                    let ready = Event::new(false)?;
                    ready.record(&s)?;
                    let to = (me + 1) % self.args.threads;
                    self.inbox[to].lock().unwrap_or_else(|e| e.into_inner()).push(Handoff {
                        ptr,
                        size,
                        id,
                        ready,
                    });
                } else {
                    self.check_and_free(&s, bad, ptr, size, id)?;
                    r.frees += 1;
                }
            }
        }
        for (ptr, size, id) in live.drain(..) {
            self.check_and_free(&s, bad, ptr, size, id)?;
            r.frees += 1;
        }
        s.sync()?;
        side.sync()?;
        let mut out = [0u64];
        copy_dtoh_u64(&mut out, bad)?;
        mem_free(bad)?;
        r.mismatches = out[0];
        Ok(r)
    }
}

#[derive(Debug, Serialize)]
struct Report {
    gpu: String,
    threads: usize,
    ops_per_thread: usize,
    seconds: f64,
    per_thread: Vec<ThreadReport>,
    leftover_handoffs: ThreadReport,
    mismatches: u64,
    joined_frees: u64,
    cache_hits: u64,
    /// Of those, blocks carved out of cached ranges (`Options::carve`).
    carved_allocations: u64,
    unmap_batches: u64,
    cached_ranges_stolen: u64,
    peak_reserved: u64,
    deferred_errors: u64,
    driver_calls: BTreeMap<String, u64>,
}

fn run() -> Res<()> {
    let args = Args::parse();
    if args.threads == 0
        || !(0.0..=1.0).contains(&args.cross)
        || !(0.0..=1.0).contains(&args.recorded)
    {
        return Err("--threads must be at least 1, --cross and --recorded in [0, 1]".into());
    }
    let gpu = Gpu::open()?;
    let m = Module::compile(&gpu, kernels::SOURCE)?;
    let opts = mb_options(
        Some(args.cap_gib * GIB),
        moonbright_bench::max_chunk(),
        moonbright_bench::default_window(),
        true,
    );
    let alloc = Allocator::new(opts).map_err(|e| format!("MoonBright: {e}"))?;
    let sms = gpu.attribute(
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        "MULTIPROCESSOR_COUNT",
    )? as u32;
    let shared = Shared {
        gpu: &gpu,
        alloc: &alloc,
        fill: m.function("fill")?,
        check: m.function("check")?,
        spin: m.function("spin")?,
        sms,
        inbox: (0..args.threads).map(|_| Mutex::new(vec![])).collect(),
        args: &args,
    };
    let c0 = alloc.driver().counts();
    let start = Instant::now();
    let results: Vec<Res<ThreadReport>> = std::thread::scope(|scope| {
        let hs: Vec<_> = (0..args.threads)
            .map(|i| {
                scope.spawn({
                    let sh = &shared;
                    move || sh.worker(i)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("worker thread panicked".into())))
            .collect()
    });
    // Handoffs posted after their receiver finished: check and free them here.
    let s = Stream::new(true)?;
    let bad = mem_alloc(8)?;
    memset_d32(bad, 0, 2)?;
    ctx_sync()?;
    let mut left = ThreadReport::default();
    for i in 0..args.threads {
        shared.drain(i, &s, bad, &mut left)?;
    }
    s.sync()?;
    let mut out = [0u64];
    copy_dtoh_u64(&mut out, bad)?;
    mem_free(bad)?;
    left.mismatches = out[0];
    let seconds = start.elapsed().as_secs_f64();
    let per_thread: Vec<ThreadReport> = results.into_iter().collect::<Res<_>>()?;
    let mismatches = per_thread.iter().map(|r| r.mismatches).sum::<u64>() + left.mismatches;
    alloc.flush().map_err(|e| format!("flush: {e}"))?;
    let st = alloc.stats();
    let report = Report {
        gpu: gpu.name.clone(),
        threads: args.threads,
        ops_per_thread: args.ops,
        seconds,
        mismatches,
        joined_frees: st.joined_frees,
        cache_hits: st.cache_hits,
        carved_allocations: st.carved_allocations,
        unmap_batches: st.unmap_batches,
        cached_ranges_stolen: st.cached_ranges_stolen,
        peak_reserved: st.reserved_bytes.peak,
        deferred_errors: st.deferred_errors,
        driver_calls: call_delta(&alloc.driver().counts(), &c0),
        per_thread,
        leftover_handoffs: left,
    };
    let allocs: u64 = report.per_thread.iter().map(|r| r.allocations).sum();
    let cross: u64 = report.per_thread.iter().map(|r| r.cross_stream_frees).sum::<u64>()
        + report.leftover_handoffs.cross_stream_frees;
    let filled: u64 = report.per_thread.iter().map(|r| r.bytes_filled).sum();
    let recorded: u64 = report.per_thread.iter().map(|r| r.recorded_frees).sum();
    println!(
        "gpu_stress on {}: {} threads x {} ops in {:.1} s: {} allocations ({:.1} GiB filled and \
         checked), {} freed on another stream, {} checked on a second stream and recorded there \
         ({} joined frees); cache hits {} ({} carved), unmap batches {}, stolen ranges {}, peak reserved \
         {:.2} GiB, deferred errors {}",
        report.gpu,
        args.threads,
        args.ops,
        seconds,
        allocs,
        filled as f64 / GIB as f64,
        cross,
        recorded,
        report.joined_frees,
        report.cache_hits,
        report.carved_allocations,
        report.unmap_batches,
        report.cached_ranges_stolen,
        report.peak_reserved as f64 / GIB as f64,
        report.deferred_errors
    );
    println!("driver calls: {:?}", report.driver_calls);
    if let Some(path) = &args.json {
        moonbright_bench::write_json(path, &report)?;
    }
    if let Some(e) = alloc.take_deferred_error() {
        return Err(format!("deferred driver error: {e}"));
    }
    if mismatches > 0 {
        return Err(format!("FAILED: {mismatches} mismatching words"));
    }
    println!("gpu_stress: PASSED (0 mismatches)");
    Ok(())
}

fn main() -> ExitCode {
    main_wrapper("gpu_stress", run)
}
