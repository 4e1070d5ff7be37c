//! The background worker: records events for stream frees and polls them, unmaps retired ranges
//! in batches (away from the mapping of new ranges, which is what keeps running kernels
//! undisturbed), keeps the mapped window filled to a size taken from recent demand, keeps a
//! stock of events created for frees, and grows the heap's tables ahead of requests.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::sync::Instant;

use super::Shared;
use crate::core::heap::Step;
use crate::core::mapping::execute;
use crate::driver::prelude::*;

/// The window's share of allocated memory: its pages are held but unused, which is exactly what
/// the fragmentation figures count, so it may grow past `prefetch_window_min` only to 1/64th
/// (1.6%) of what is allocated.
const WINDOW_SHARE: u64 = 64;
/// How far ahead of demand the window reaches.
const WINDOW_HORIZON: Duration = Duration::from_millis(50);
/// Tick while there is mapping work in flight, and the longest sleep when idle.
const BUSY_TICK: Duration = Duration::from_micros(200);
const IDLE_TICK: Duration = Duration::from_millis(20);
/// Tick while frees wait only for their events. Completing them sooner serves no request: the
/// freeing stream reuses their memory at once, and one short of memory polls for itself (and
/// wakes the worker). And in a launch-bound loop, where frees are always pending, each pass's
/// event calls and lock take time from the thread launching kernels: at 200 µs, greedy decoding
/// of a small Llama ran 25% slower with the process on one core (H200).
const EVENT_TICK: Duration = Duration::from_millis(2);
/// The longest tick while frees wait only for their events, no request has missed its
/// stream's cache since the last pass and the worker had no mapping work: the tick doubles from
/// `EVENT_TICK` up to this. In a loop
/// whose frees all go back to their own stream (one stream, the cache warm) the worker's event
/// records and queries, on the stream the loop launches on, serve nothing: a ResNet-50 training
/// step made 1.8 worker calls instead of 8.7 (H100). A miss brings the tick back: settled frees
/// are what the placement policies reuse across sizes, and stretched through misses too the
/// tick let a GPT-2 training step hold 11.9 GiB instead of 11.15. A request that needs other
/// streams' frees records their events itself (`Shared::map_new`).
const EVENT_TICK_MAX: Duration = Duration::from_millis(32);
/// The mapper refills the window only when no request has mapped a range of its own for this
/// long: during a burst of such requests its calls would only queue in the driver beside theirs.
const QUIET_BEFORE_REFILL: Duration = Duration::from_millis(2);

/// Events kept created ahead of need: a burst of frees between two ticks records these instead
/// of creating its own (`cuEventCreate` on the free path).
const EVENT_STOCK: usize = if cfg!(loom) { 2 } else { 256 };

/// Recent demand for fresh pages, in pages a second (an exponential moving average).
#[derive(Debug)]
struct Demand {
    rate: f64,
    last: Instant,
}

impl Demand {
    fn update(&mut self, pages: u64) -> f64 {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64().max(1e-4);
        self.last = now;
        let sample = pages as f64 / dt;
        // Rise fast, decay slowly: a burst needs the window now, an idle spell can wait.
        let alpha = if sample > self.rate { 0.5 } else { 0.05 };
        self.rate += alpha * (sample - self.rate);
        self.rate
    }
}

/// The worker's state between passes.
pub(crate) struct Worker {
    demand: Demand,
    page: u64,
    min_pages: u64,
    max_pages: u64,
    /// The pages of the whole chunks the window is refilled with (`Heap::whole_window_chunk` of
    /// the largest fresh request last seen); 0: one-page chunks. Fresh demand of small requests
    /// only sets it back to 0.
    whole: u64,
    /// The tick while frees wait only for their events (`EVENT_TICK` to `EVENT_TICK_MAX`).
    event_tick: Duration,
    /// The heap's count of requests served beyond their stream's cache at the last pass
    /// (`cache_misses`): when it moves, the tick goes back to `EVENT_TICK`.
    misses: u64,
}

impl Worker {
    pub fn new(shared: &Shared) -> Self {
        let page = shared.driver.granularity() as u64;
        Worker {
            demand: Demand { rate: 0.0, last: Instant::now() },
            page,
            min_pages: shared.options.prefetch_window_min / page,
            max_pages: shared.options.prefetch_window_max / page,
            whole: 0,
            event_tick: EVENT_TICK,
            misses: 0,
        }
    }

    /// One pass: records missing events, polls, unmaps a due batch, refills the window, tops
    /// up the event stock. Returns how long to sleep before the next pass.
    pub fn tick(&mut self, shared: &Shared) -> Duration {
        shared.record_missing_events();
        shared.poll_events();
        let mut busy = false;
        if shared.heap().unmap_due() {
            // A failed unmap stays retired and is retried; the error is recorded for the user.
            if let Err(crate::Error::Driver(e)) = shared.flush_in_background() {
                shared.heap().note_deferred_error(e);
            }
            busy = true;
        }
        if self.max_pages > 0 {
            busy |= self.refill_window(shared);
        }
        shared.stock_events(EVENT_STOCK);
        let (pending, unmap_due, misses) = {
            let mut heap = shared.heap();
            heap.grow_tables_ahead();
            (heap.has_pending_frees(), heap.unmap_due(), cache_misses(heap.stats()))
        };
        let missed = std::mem::replace(&mut self.misses, misses) != misses;
        if busy || unmap_due || missed {
            self.event_tick = EVENT_TICK;
        } else if pending {
            self.event_tick = (self.event_tick * 2).min(EVENT_TICK_MAX);
        }
        if busy || unmap_due {
            BUSY_TICK
        } else if pending {
            self.event_tick
        } else {
            IDLE_TICK
        }
    }

    /// Maps one batch into the window if it is below its target. Returns whether it mapped any.
    fn refill_window(&mut self, shared: &Shared) -> bool {
        let (min_pages, max_pages, page) = (self.min_pages, self.max_pages, self.page);
        let plan = {
            let mut heap = shared.heap();
            let (fresh, largest) = heap.take_fresh_demand();
            let rate = self.demand.update(fresh);
            if fresh > 0 {
                self.whole = heap.whole_window_chunk(largest);
            }
            if heap.requests_mapping_within(QUIET_BEFORE_REFILL) && heap.window_pages() >= min_pages
            {
                return false;
            }
            let allocated_pages = heap.stats().allocated_bytes.current / page;
            let share = min_pages.max(allocated_pages / WINDOW_SHARE).min(max_pages);
            let target =
                ((rate * WINDOW_HORIZON.as_secs_f64()).ceil() as u64).clamp(min_pages, share);
            let have = heap.window_pages();
            let short = target.saturating_sub(have);
            // Large fresh requests get whole chunks of their size, one handle each, once the
            // window has room for one; otherwise one-page chunks, a few at a time.
            let whole = if self.whole > 0 && short >= self.whole { self.whole } else { 0 };
            let want = short.min(shared.options.window_refill_pages);
            // New chunks up to the minimum the user asked for; beyond it only when no held memory
            // is free (creating while free chunks sit idle would raise what is held for nothing).
            let create = if have < min_pages || heap.free_held_pages() == 0 { short } else { 0 };
            heap.plan_window_refill(want, create, whole)
        };
        let plan = match plan {
            None | Some(Step::Wait | Step::OutOfMemory(_) | Step::RecordOwnFrees) => return false,
            Some(Step::Flush(_)) => {
                if let Err(crate::Error::Driver(e)) = shared.flush_in_background() {
                    shared.heap().note_deferred_error(e);
                }
                return true;
            }
            Some(Step::Reserve(len)) => {
                match shared.reserve(len) {
                    Ok(base) => shared.heap().add_reservation(base, len),
                    Err(e) => shared.heap().note_deferred_error(e),
                }
                return true;
            }
            Some(Step::Map(plan)) => plan,
        };
        let _mapping = shared.mapping_scope();
        let ex = execute(&shared.driver, &plan);
        let mut heap = shared.heap();
        if let Err(crate::Error::Driver(e)) = heap.commit_window(plan, ex) {
            heap.note_deferred_error(e);
        }
        true
    }
}

/// Requests so far that found no memory in their stream's cache: served at fresh addresses
/// (window hits, maps), from other ranges' chunks (stolen), or after waiting for pending frees.
/// Only its changes matter (a reset of the statistics changes it too).
fn cache_misses(s: &crate::core::stats::Stats) -> u64 {
    s.window_hits + s.request_maps + s.cached_ranges_stolen + s.pending_free_waits
}

/// The worker's loop; returns when `shared.stop` is set.
pub(crate) fn run(shared: Arc<Shared>) {
    // The worker's thread is MoonBright's: its calls need not switch contexts each time. A
    // failure leaves each call to switch for itself.
    let _ = shared.driver.bind_thread();
    let mut worker = Worker::new(&shared);
    while !shared.stop.load(Ordering::Acquire) {
        let sleep = worker.tick(&shared);
        shared.worker_wait(sleep);
    }
}
