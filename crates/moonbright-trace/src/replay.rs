//! Replay: a trace's allocations and frees run through an [`Allocator`], timed, with the
//! slowest allocations' driver calls and a series of allocated and reserved bytes for a plot.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use moonbright::driver::{self, CallCounts, CallKind, CallTimes, DevicePtr};
use moonbright::{Allocator, StreamHandle};

use crate::format::{Action, Trace};
use crate::stats::quantile;

/// What a replay does besides allocating and freeing.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// Replay at most this many events.
    pub limit: Option<usize>,
    /// Keep about this many points of allocated and reserved bytes over events for a plot
    /// (each point the highest values in its stretch of events); 0 keeps none.
    pub series_points: usize,
    /// Keep the recording's pace, sped up this many times: each event waits until the
    /// recorded time since the first (the sum of `dt_us`), divided by this, has passed; a
    /// late event goes at once. `None`: as fast as it goes. Paced, the background worker sees
    /// the idle spells a program leaves it; unpaced, it sees none.
    pub pace: Option<f64>,
    /// Free in stream order, as PyTorch does under `moonbright.torch.enable()`: each
    /// `free_completed` is a `free_async` on the stream the block was allocated on, so its
    /// memory waits, pending on that stream, until an event settles it (recorded by the
    /// background worker, or by a request that needs it). `false`: a synchronous `free`, the
    /// memory settled at once (the recorder saw the free complete).
    pub stream_frees: bool,
}

/// One point of a replay's series: the highest allocated and reserved bytes over a stretch of
/// events ending at `event`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeriesPoint {
    /// Index of the stretch's last event.
    pub event: u64,
    /// Highest allocated (requested, live) bytes in the stretch.
    pub allocated: u64,
    /// Highest reserved (physical) bytes in the stretch.
    pub reserved: u64,
}

/// What a replay measured. Peaks and driver calls are in the allocator's [`moonbright::Stats`].
#[derive(Clone, Debug, Default)]
pub struct ReplayReport {
    /// Events replayed (all actions).
    pub events: u64,
    /// `alloc` events replayed.
    pub allocs: u64,
    /// `free_completed` events that freed one of our allocations.
    pub frees: u64,
    /// `free_completed` events of addresses the replay never allocated (skipped).
    pub unknown_frees: u64,
    /// `free_completed` events of blocks whose allocation failed (skipped).
    pub frees_of_failed: u64,
    /// Allocations that failed (out of memory, or any other error).
    pub failed_allocs: u64,
    /// The first failure's message.
    pub first_error: Option<String>,
    /// Allocations still live at the end of the events, freed afterwards (not timed).
    pub live_at_end: u64,
    /// Time spent replaying, without loading the trace or the final frees.
    pub wall: Duration,
    /// Latency of each successful allocation, in nanoseconds, sorted.
    pub alloc_latency_ns: Vec<u64>,
    /// Latency of each free, in nanoseconds, sorted.
    pub free_latency_ns: Vec<u64>,
    /// Allocated and reserved bytes over events (see [`ReplayOptions::series_points`]).
    pub series: Vec<SeriesPoint>,
    /// The slowest allocations, slowest first (at most [`SLOWEST_KEPT`]).
    pub slowest: Vec<SlowAlloc>,
}

/// How many of the slowest allocations a replay describes.
pub const SLOWEST_KEPT: usize = 5;

/// One of a replay's slowest allocations: which, how long, and the driver calls made while it
/// ran, by any thread (the background worker's too) and by the request's own thread, to tell
/// what a tail is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlowAlloc {
    /// The event's index in the trace.
    pub event: u64,
    pub size: u64,
    pub ns: u64,
    /// Calls by kind meanwhile, by any thread.
    pub calls: CallCounts,
    /// Nanoseconds in the virtual-memory calls of each kind meanwhile, by any thread (calls of
    /// two threads at once both count).
    pub call_ns: [u64; CallKind::ALL.len()],
    /// Of those, the calls the request's own thread made, and their nanoseconds.
    pub own_calls: CallCounts,
    pub own_ns: [u64; CallKind::ALL.len()],
}

impl SlowAlloc {
    /// `(kind, calls, nanoseconds)` for each kind called meanwhile, by any thread.
    pub fn calls_made(&self) -> impl Iterator<Item = (CallKind, u64, u64)> + '_ {
        CallKind::ALL
            .iter()
            .map(|&k| (k, self.calls.get(k), self.call_ns[k as usize]))
            .filter(|&(_, n, _)| n > 0)
    }

    /// The same for the calls the request's own thread made.
    pub fn own_calls_made(&self) -> impl Iterator<Item = (CallKind, u64, u64)> + '_ {
        CallKind::ALL
            .iter()
            .map(|&k| (k, self.own_calls.get(k), self.own_ns[k as usize]))
            .filter(|&(_, n, _)| n > 0)
    }

    /// The same for the calls other threads made meanwhile (the worker's, in a replay).
    pub fn others_calls_made(&self) -> impl Iterator<Item = (CallKind, u64, u64)> + '_ {
        CallKind::ALL
            .iter()
            .map(|&k| {
                let i = k as usize;
                (
                    k,
                    self.calls.get(k).saturating_sub(self.own_calls.get(k)),
                    self.call_ns[i].saturating_sub(self.own_ns[i]),
                )
            })
            .filter(|&(_, n, _)| n > 0)
    }
}

/// Keeps `a` among the slowest (slowest first, at most `SLOWEST_KEPT`).
fn keep_if_slow(slowest: &mut Vec<SlowAlloc>, a: SlowAlloc) {
    if slowest.len() == SLOWEST_KEPT && slowest.last().is_some_and(|s| s.ns >= a.ns) {
        return;
    }
    let at = slowest.partition_point(|s| s.ns >= a.ns);
    slowest.insert(at, a);
    slowest.truncate(SLOWEST_KEPT);
}

impl ReplayReport {
    /// The `q`-quantile (0..=1) of the allocation latencies in nanoseconds (nearest rank).
    pub fn alloc_latency_quantile(&self, q: f64) -> Option<u64> {
        quantile(&self.alloc_latency_ns, q)
    }

    /// The `q`-quantile (0..=1) of the free latencies in nanoseconds (nearest rank).
    pub fn free_latency_quantile(&self, q: f64) -> Option<u64> {
        quantile(&self.free_latency_ns, q)
    }
}

/// Waits until `t`: sleeps through all but the last 200 µs of a long wait, spins the rest (a
/// sleep overshoots by tens of microseconds, and most of a trace's gaps are shorter).
fn wait_until(t: Instant) {
    const SPIN: Duration = Duration::from_micros(200);
    let now = Instant::now();
    if t > now + SPIN {
        std::thread::sleep(t - now - SPIN);
    }
    while Instant::now() < t {
        std::hint::spin_loop();
    }
}

/// How often [`replay`] reports progress, in events.
pub const PROGRESS_EVERY: usize = 1 << 14;

/// Replays `trace` through `alloc`: each `alloc` is a `malloc_async(size, StreamHandle(stream))`
/// and each `free_completed` a `free` of the allocation made for that address; other events are
/// skipped. Failed allocations are counted and the replay goes on. `progress` is called with the
/// number of events done every [`PROGRESS_EVERY`] events and at the end. Allocations still live
/// at the end are freed after the timed part.
pub fn replay(
    alloc: &Allocator,
    trace: &Trace,
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(u64),
) -> ReplayReport {
    let events = match opts.limit {
        Some(n) => &trace.events[..n.min(trace.events.len())],
        None => &trace.events[..],
    };
    let mut rep = ReplayReport::default();
    // The recorder's address -> ours and the stream it was allocated on.
    let mut ours: HashMap<u64, (DevicePtr, u64)> = HashMap::new();
    let mut failed: HashMap<u64, ()> = HashMap::new();
    rep.alloc_latency_ns.reserve(events.len() / 3 + 1);
    rep.free_latency_ns.reserve(events.len() / 3 + 1);
    let stretch = if opts.series_points > 0 {
        events.len().div_ceil(opts.series_points).max(1)
    } else {
        usize::MAX
    };
    let mut point = SeriesPoint { event: 0, allocated: 0, reserved: 0 };
    let start = Instant::now();
    let mut due_us = 0.0;
    for (i, e) in events.iter().enumerate() {
        if let Some(speed) = opts.pace.filter(|s| *s > 0.0) {
            due_us += e.dt_us.unwrap_or(0) as f64 / speed;
            wait_until(start + Duration::from_secs_f64(due_us / 1e6));
        }
        match e.action {
            Action::Alloc => {
                rep.allocs += 1;
                let driver = alloc.driver();
                let (calls, times) = (driver.counts(), driver.times());
                let (own_calls, own_times) = driver::thread_calls();
                let t = Instant::now();
                let r = alloc.malloc_async(e.size as usize, StreamHandle(e.stream));
                let dt = t.elapsed().as_nanos() as u64;
                match r {
                    Ok(ptr) => {
                        rep.alloc_latency_ns.push(dt);
                        if rep.slowest.len() < SLOWEST_KEPT
                            || rep.slowest.last().is_some_and(|s| s.ns < dt)
                        {
                            let spent = |after: CallTimes, before: CallTimes| {
                                std::array::from_fn(|k| after.total_ns[k] - before.total_ns[k])
                            };
                            let (own_after, own_times_after) = driver::thread_calls();
                            let a = SlowAlloc {
                                event: i as u64,
                                size: e.size,
                                ns: dt,
                                calls: driver.counts().since(&calls),
                                call_ns: spent(driver.times(), times),
                                own_calls: own_after.since(&own_calls),
                                own_ns: spent(own_times_after, own_times),
                            };
                            keep_if_slow(&mut rep.slowest, a);
                        }
                        if let Some((old, _)) = ours.insert(e.addr, (ptr, e.stream)) {
                            // The recorder reused an address without a free: drop the old block.
                            let _ = alloc.free(old);
                        }
                        failed.remove(&e.addr);
                    }
                    Err(err) => {
                        rep.failed_allocs += 1;
                        rep.first_error.get_or_insert_with(|| err.to_string());
                        failed.insert(e.addr, ());
                    }
                }
            }
            Action::FreeCompleted => match ours.remove(&e.addr) {
                Some((ptr, stream)) => {
                    let t = Instant::now();
                    let r = if opts.stream_frees {
                        alloc.free_async(ptr, StreamHandle(stream))
                    } else {
                        alloc.free(ptr)
                    };
                    rep.free_latency_ns.push(t.elapsed().as_nanos() as u64);
                    if let Err(err) = r {
                        rep.first_error.get_or_insert_with(|| format!("free: {err}"));
                    }
                    rep.frees += 1;
                }
                None if failed.remove(&e.addr).is_some() => rep.frees_of_failed += 1,
                None => rep.unknown_frees += 1,
            },
            _ => {}
        }
        if stretch != usize::MAX {
            let s = alloc.stats();
            point.allocated = point.allocated.max(s.allocated_bytes.current);
            point.reserved = point.reserved.max(s.reserved_bytes.current);
            if (i + 1) % stretch == 0 || i + 1 == events.len() {
                point.event = i as u64;
                rep.series.push(point);
                point = SeriesPoint { event: 0, allocated: 0, reserved: 0 };
            }
        }
        if (i + 1) % PROGRESS_EVERY == 0 {
            progress(i as u64 + 1);
        }
    }
    rep.wall = start.elapsed();
    rep.events = events.len() as u64;
    progress(rep.events);
    rep.live_at_end = ours.len() as u64;
    for (_, (ptr, _)) in ours.drain() {
        let _ = alloc.free(ptr);
    }
    rep.alloc_latency_ns.sort_unstable();
    rep.free_latency_ns.sort_unstable();
    rep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_allocations_are_kept_slowest_first() {
        let mut kept = Vec::new();
        let slow = |ns| SlowAlloc {
            event: ns,
            size: 1,
            ns,
            calls: CallCounts::default(),
            call_ns: [0; CallKind::ALL.len()],
            own_calls: CallCounts::default(),
            own_ns: [0; CallKind::ALL.len()],
        };
        for ns in [5, 1, 9, 3, 7, 8, 2, 10, 4] {
            keep_if_slow(&mut kept, slow(ns));
        }
        let ns: Vec<u64> = kept.iter().map(|s| s.ns).collect();
        assert_eq!(ns, [10, 9, 8, 7, 5]);
    }
}
