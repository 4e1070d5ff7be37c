//! The stream-ordered front end: every request's path through the heap lock and the driver.
//! Fast paths take the lock once and make no driver call. Everything that needs the driver
//! (new ranges, events, unmaps, releases) is planned under the lock, run without it, and
//! committed under it again, so no lock a request needs is ever held across a driver call.
//! The frees' events are in `events.rs`, growable allocations in `growable.rs`, graph pools in
//! `graphs.rs`, the background worker in `worker.rs`.

mod events;
mod graphs;
mod growable;
#[cfg(all(test, loom))]
mod loom_model;
mod sleep;
pub(crate) mod worker;

use crate::config::Options;
use crate::core::heap::{Fast, Freed, Heap, Step};
use crate::core::mapping::{execute, unmap_all, unmap_runs, Executed, MapPlan};
use crate::driver::{
    prelude::*, Backend, DevicePtr, DriverError, EventHandle, Instrumented, StreamHandle,
};
use crate::error::{Error, Result};
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use crate::sync::{pause, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};

/// How long a request waits for other threads' unmaps or plans in flight before giving up.
const MAX_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long it sleeps between looks while it waits.
const WAIT_STEP: std::time::Duration = std::time::Duration::from_micros(20);
/// How long `release_unused` polls events it has just recorded for deferred frees.
const RECORDED_JUST_NOW: std::time::Duration = std::time::Duration::from_millis(1);

/// The longest an unmap batch pauses between its calls for requests that are mapping.
const GIVE_WAY_MAX: std::time::Duration = std::time::Duration::from_millis(2);

/// What a request has waited for so far, over its tries of the fast paths and the slow one.
struct Waits {
    /// When its plan first came back with anything but a map (a flush, a wait, a
    /// reservation): the clock is read only then, not for the common plan that maps at once.
    start: Option<crate::sync::Instant>,
    /// Whether it has polled the recorded events.
    polled: bool,
    /// Whether it has waited for every stream's pending frees (once at most).
    pending_frees: bool,
}

impl Waits {
    fn new() -> Self {
        Waits { start: None, polled: false, pending_frees: false }
    }

    /// Starts the clock, if it has not started yet.
    fn waiting(&mut self) {
        self.start.get_or_insert_with(crate::sync::Instant::now);
    }

    /// Whether it has waited `MAX_WAIT` since the clock started.
    fn timed_out(&self) -> bool {
        self.start.is_some_and(|t| t.elapsed() >= MAX_WAIT)
    }
}

/// Holds a counter raised by one while it lives.
pub(crate) struct Raised<'a>(&'a AtomicUsize);

impl<'a> Raised<'a> {
    pub(crate) fn new(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::AcqRel);
        Raised(counter)
    }
}

impl Drop for Raised<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The error of a request that waited `MAX_WAIT` for other threads' unmaps or plans.
fn gave_up() -> Error {
    Error::Driver(DriverError::new(
        crate::driver::CallKind::Unmap,
        crate::driver::code::UNKNOWN,
        "gave up after 10 s waiting for unmaps or plans in flight on other threads",
    ))
}

/// What the allocator's handle and its background worker share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub driver: Instrumented<Backend>,
    heap: Mutex<Heap>,
    /// Wakes the worker early (a free to record, demand for the window).
    wake: Condvar,
    /// Whether the worker is sleeping on `wake` (set under the heap lock before it waits): a
    /// request wakes it only then, as a futex wake is a system call (about 1 µs), and a worker
    /// that is awake, or absent, needs none.
    worker_asleep: AtomicBool,
    pub stop: AtomicBool,
    pub options: Options,
    /// Requests making VMM calls of their own now: running a map plan, or unmapping the ranges
    /// a split needs. The driver serialises VMM calls, and a thread that calls again at once
    /// gets in first: a request's one unmap call was seen to wait 14 ms behind 68 of the
    /// worker's (the replay's list of slowest allocations, on the H200). So an unmap batch lets
    /// them go first between its calls (`give_way`) rather than make them wait for all of it.
    requests_mapping: AtomicUsize,
    /// Requests waiting for unmaps that another thread's batch has taken (a chunk to split, or
    /// addresses to reuse, still mapped by ranges in that batch). The worker's batch stops at
    /// its next call, commits and puts the rest back (`flush_in_background`), so that such a
    /// request waits for one unmap call, not a batch of hundreds.
    pub(crate) requests_flushing: AtomicUsize,
    /// The peer devices granted access to this device's memory. Every map plan holds it for
    /// reading from its execution to its commit, and every unmap batch from its calls to its
    /// commit; `enable_peer_access` holds it for writing, so that no mapping is in flight while
    /// it grants the new peer access to every span the heap has mapped.
    peers: RwLock<Vec<i32>>,
    /// The CUDA graphs' pools (`graphs.rs`); never locked with the heap.
    graphs: Mutex<crate::core::graphs::GraphPools>,
    /// Whether a free must look at the graph pools (`GraphPools::active`), kept under their lock.
    graphs_active: AtomicBool,
    /// Whether some thread routes its requests into a graph pool (`GraphPools::routing`), kept
    /// under their lock.
    graphs_routing: AtomicBool,
    /// Captures announced in progress (`capture_starting` less `capture_finished`); with
    /// `Options::captures_announced`, streams are checked for a capture only while it is not 0.
    captures_in_progress: AtomicUsize,
    /// Held by a pass of `record_missing_events`, which records on other threads' streams;
    /// `capture_starting` waits for it.
    record_gate: Mutex<()>,
    /// Sleeps' and wakes' host memory and copy stream (`sleep.rs`); its lock runs them one at
    /// a time, and is never taken with the heap's held.
    offloads: std::sync::Mutex<sleep::Offloads>,
}

impl Shared {
    pub fn new(driver: Instrumented<Backend>, heap: Heap, options: Options) -> Self {
        Shared {
            driver,
            heap: Mutex::new(heap),
            wake: Condvar::new(),
            worker_asleep: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            options,
            requests_mapping: AtomicUsize::new(0),
            requests_flushing: AtomicUsize::new(0),
            peers: RwLock::new(Vec::new()),
            graphs: Mutex::new(Default::default()),
            graphs_active: AtomicBool::new(false),
            graphs_routing: AtomicBool::new(false),
            captures_in_progress: AtomicUsize::new(0),
            record_gate: Mutex::new(()),
            offloads: std::sync::Mutex::new(sleep::Offloads::default()),
        }
    }

    /// Holds off `enable_peer_access` while a mapping or unmapping runs (see `peers`).
    pub(crate) fn mapping_scope(&self) -> RwLockReadGuard<'_, Vec<i32>> {
        self.peers.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The peers granted access so far.
    pub fn peers(&self) -> Vec<i32> {
        self.mapping_scope().clone()
    }

    /// Grants device `peer` access to all of this device's memory, mapped now and later: every
    /// later `set_access` names it, and every span mapped now is given access again with it.
    /// While it runs, requests that must map wait (cache and window hits do not). On a failure
    /// the peer is not added (spans already granted keep their access, which is harmless).
    /// `others` grants the new peer access to mappings the heap does not know of (imports), once
    /// the driver's list has it.
    pub fn enable_peer_access(
        &self,
        peer: i32,
        others: impl FnOnce(&dyn crate::driver::Driver) -> Result<()>,
    ) -> Result<()> {
        let mut peers = self.peers.write().unwrap_or_else(|e| e.into_inner());
        if peers.contains(&peer) {
            return Ok(());
        }
        let old = peers.clone();
        let mut new = old.clone();
        new.push(peer);
        self.driver.set_peers(&new)?;
        let spans = self.heap().mapped_spans();
        let granted = spans
            .into_iter()
            .try_for_each(|(va, len)| self.driver.set_access(va, len as usize))
            .map_err(Error::from)
            .and_then(|()| others(&self.driver));
        if let Err(e) = granted {
            // Leaves the list as it was; `set_peers` accepted it a moment ago.
            let _ = self.driver.set_peers(&old);
            return Err(e);
        }
        *peers = new;
        Ok(())
    }

    /// Runs a request's own map plan (not the window's), counted in `requests_mapping`.
    pub(crate) fn execute_for_request(&self, plan: &MapPlan) -> Executed {
        let _calling = Raised::new(&self.requests_mapping);
        execute(&self.driver, plan)
    }

    /// Waits, at most `GIVE_WAY_MAX`, while requests are mapping (unless runs are unbounded).
    fn give_way(&self) {
        if self.options.unmap_run_handles == 0 {
            return;
        }
        crate::sync::yield_while(
            || self.requests_mapping.load(Ordering::Acquire) > 0,
            GIVE_WAY_MAX,
        );
    }

    pub fn heap(&self) -> MutexGuard<'_, Heap> {
        // A panic while the lock was held can only come from a debug assertion; the heap is
        // consistent between the statements that touch it, so going on is sound.
        self.heap.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn validated(&self, heap: &Heap) {
        if self.options.validate {
            if let Err(e) = heap.check() {
                panic!("MoonBright invariant broken: {e}");
            }
        }
    }

    /// Reserves `len` bytes of addresses, aligned as `driver::reservation_alignment` says.
    pub fn reserve(&self, len: u64) -> std::result::Result<DevicePtr, DriverError> {
        let align = crate::driver::reservation_alignment(len as usize, self.driver.granularity());
        self.driver.reserve(len as usize, align)
    }

    /// Wakes the worker if it is asleep. A worker that is about to sleep may miss it, as it
    /// could miss a notification sent before it waits: it then wakes at its next tick.
    pub fn wake_worker(&self) {
        if self.worker_asleep.load(Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }

    /// After a request has mapped a range of its own: wakes the worker if it has work to do now,
    /// an unmap batch due or a window below its minimum. Anything else waits for its next
    /// pass: it refills the window only once requests have stopped mapping for a while
    /// (`QUIET_BEFORE_REFILL`), so a wake after every new range only put a futex call on the
    /// request's path and a pass contending for the heap lock beside the next request (on the
    /// host backend, 4-5 µs of a cold map's own time of 6-7, `scale --host`).
    pub fn wake_worker_if_due(&self, heap: MutexGuard<'_, Heap>) {
        let window = heap.window_pages() * heap.limits().page;
        let due = heap.unmap_due() || window < self.options.prefetch_window_min;
        drop(heap);
        if due {
            self.wake_worker();
        }
    }

    /// Wakes the worker whatever it is doing (to stop it).
    pub fn wake_worker_always(&self) {
        self.wake.notify_one();
    }

    /// Notes that a CUDA graph capture is about to begin (see `Options::captures_announced`).
    pub fn capture_starting(&self) {
        self.captures_in_progress.fetch_add(1, Ordering::SeqCst);
        // A pass of `record_missing_events` that began before sees no capture: let it end
        // before the capture begins.
        drop(self.record_gate.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Notes that an announced capture has ended (or failed to begin). Extra calls are ignored.
    // `fetch_update` is deprecated for `try_update` on newer toolchains (nightly warns), which
    // Rust 1.80, this crate's `rust-version`, lacks.
    #[allow(deprecated)]
    pub fn capture_finished(&self) {
        let _ = self
            .captures_in_progress
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// Whether `stream` is being captured into a graph. With `Options::captures_announced` and
    /// no capture announced, no: no driver call.
    pub(super) fn is_capturing(&self, stream: StreamHandle) -> Result<bool> {
        if self.options.captures_announced && self.captures_in_progress.load(Ordering::SeqCst) == 0
        {
            return Ok(false);
        }
        Ok(self.driver.is_capturing(stream)?)
    }

    fn refuse_capture(&self, stream: StreamHandle) -> Result<()> {
        if self.is_capturing(stream)? {
            return Err(Error::StreamCapture { stream: stream.0 });
        }
        Ok(())
    }

    // ---- requests -------------------------------------------------------------------------------

    /// Allocates for `stream` (`None`: memory no stream's queued work uses, ordered by the
    /// caller, no capture check).
    /// On a stream being captured into a graph, from the capture's graph pool; on a thread
    /// routed into a graph pool, from that pool (`graphs.rs`).
    pub fn malloc(&self, size: u64, stream: Option<StreamHandle>) -> Result<DevicePtr> {
        let s = match stream {
            Some(s) => {
                if self.is_capturing(s)? {
                    return self.malloc_in_capture(size, s);
                }
                s.0
            }
            // No stream: memory that no stream's queued work still uses, as `cudaMalloc`'s is,
            // never a free still pending on the null stream (a non-blocking stream is not
            // ordered after the null stream's work).
            None => graphs::NO_STREAM,
        };
        if let Some(pool) = self.routed_pool() {
            return self.malloc_routed(size, s, pool);
        }
        self.malloc_on(size, s)
    }

    /// Allocates for the heap's stream `s`, with the calling thread's tag (`crate::tags`).
    fn malloc_on(&self, size: u64, s: u64) -> Result<DevicePtr> {
        let tag = crate::tags::current();
        let mut waits = Waits::new();
        loop {
            let (pages, arena) = {
                let mut heap = self.heap();
                let fast = heap.try_fast(size, s, tag);
                self.validated(&heap);
                match fast? {
                    Fast::Done(ptr) => return Ok(ptr),
                    Fast::NeedRange { pages, arena } => {
                        // Nothing to poll: spare the slow path a lock round trip.
                        waits.polled |= !heap.has_listed_events();
                        (pages, arena)
                    }
                }
            };
            // `None`: it waited for other work, after which a fast path may serve it.
            let plan = |heap: &mut Heap| heap.plan_range(pages, size, s, tag);
            let commit = |heap: &mut Heap, plan, ex| heap.commit(plan, ex);
            match self.map_new(size, s, &mut waits, plan, commit) {
                Ok(Some((id, mut heap))) => {
                    let ptr = heap.finish(id, size, s, arena, tag);
                    self.validated(&heap);
                    self.wake_worker_if_due(heap);
                    return Ok(ptr);
                }
                Ok(None) => self.heap().end_tagged_request(tag),
                Err(e) => {
                    self.heap().end_tagged_request(tag);
                    return Err(e);
                }
            }
        }
    }

    /// Frees at once (the caller guarantees the device is done with it). A graph pool's block
    /// goes back to its pool.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        if let Some(r) = self.free_for_graphs(ptr, None) {
            return r;
        }
        let mut heap = self.heap();
        if heap.is_growable(ptr) {
            drop(heap);
            return self.release_growable(ptr, None);
        }
        let r = heap.free_now(ptr);
        self.validated(&heap);
        r
    }

    /// Frees in `stream`'s order: an event recorded on `stream` right after the free tells when
    /// other streams may reuse the memory.
    ///
    /// An allocation other streams used too (`record_stream`) waits for each of them: an event
    /// is recorded on every one, and no stream reuses the memory before all have completed.
    ///
    /// A graph pool's block goes back to its pool; a free of other memory on a stream being
    /// captured, for a capture begun into a pool, waits for the capture's end (`graphs.rs`).
    pub fn free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        if let Some(r) = self.free_for_graphs(ptr, Some(stream)) {
            return r;
        }
        self.free_async_heap(ptr, stream)
    }

    /// `free_async` for the heap.
    fn free_async_heap(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        self.refuse_capture(stream)?;
        let mut uses_checked = false;
        let freed = loop {
            let mut heap = self.heap();
            if heap.is_growable(ptr) {
                drop(heap);
                return self.release_growable(ptr, Some(stream.0));
            }
            let r = heap.free_on_stream(ptr, stream.0, uses_checked);
            self.validated(&heap);
            drop(heap);
            match r? {
                Freed::CheckUses(uses) => {
                    for &u in uses.iter().filter(|&&u| u != stream.0) {
                        // An event recorded on a capturing stream would join the graph instead.
                        self.refuse_capture(StreamHandle(u))?;
                    }
                    uses_checked = true;
                }
                freed => break freed,
            }
        };
        // A failure here is not the caller's: the free took effect, and a later event on the
        // stream (the worker records one) covers it.
        let record = |(s, epoch, spare)| {
            if let Err(e) = self.record(s, epoch, spare, true) {
                self.heap().note_deferred_error(e);
            }
        };
        match freed {
            Freed::One(r) => record(r),
            Freed::Joined(rs) => rs.into_iter().for_each(record),
            Freed::Deferred => {}
            Freed::CheckUses(_) => unreachable!("uses are checked above"),
        }
        // No wake-up here: a futex wake would double the cost of a free; the worker polls.
        Ok(())
    }

    /// Notes that work on `stream` uses the allocation at `ptr`, so that its stream-ordered
    /// free waits for that work too (PyTorch's `recordStream`). No driver call.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        let mut heap = self.heap();
        if heap.is_growable(ptr) {
            return Err(Error::GrowableStreamUse { ptr });
        }
        heap.record_use(ptr, stream.0)
    }

    /// Records an event on `stream` covering the free of `epoch`: the free's own record
    /// (`own`), or the worker's for a free whose own record failed.
    fn record(
        &self,
        stream: u64,
        epoch: u64,
        spare: Option<EventHandle>,
        own: bool,
    ) -> std::result::Result<(), DriverError> {
        let (outcome, r) = match spare.map_or_else(|| self.driver.create_event(), Ok) {
            Ok(event) => match self.driver.record_event(event, StreamHandle(stream)) {
                Ok(()) => (Ok(event), Ok(())),
                Err(e) => (Err(Some(event)), Err(e)),
            },
            Err(e) => (Err(None), Err(e)),
        };
        self.heap().record_settled(stream, epoch, outcome, own);
        r
    }

    /// A new mapping for a request of `requested` bytes on `stream`: `plan` (a new range at a
    /// fresh address, or a range asleep mapped again in place), run, `commit`, re-planning
    /// after a reservation or a flush. Returns what `commit` made with the heap still locked
    /// from it, for the caller to finish the request; or `None` once it has waited for other
    /// work (completed frees, plans in flight, other streams' pending frees), for the caller to
    /// try its fast paths again: what it waited for may have made a cached range or arena space
    /// that serves it with no driver call, and an arena's space is found by nothing else.
    fn map_new<T>(
        &self,
        requested: u64,
        stream: u64,
        waits: &mut Waits,
        mut plan: impl FnMut(&mut Heap) -> Step,
        commit: impl FnOnce(&mut Heap, MapPlan, Executed) -> Result<T>,
    ) -> Result<Option<(T, MutexGuard<'_, Heap>)>> {
        // Frees whose events have completed are free memory: look before mapping anything new
        // (a few event queries, on the slow path only), rather than wait for the worker's tick.
        if !waits.polled {
            waits.polled = true;
            if self.poll_events() {
                return Ok(None);
            }
        }
        let mut flushing = None;
        while !waits.timed_out() {
            let step = plan(&mut self.heap());
            if !matches!(step, Step::Map(_)) {
                waits.waiting();
            }
            match step {
                Step::Map(plan) => {
                    // No longer waiting for unmaps: let the worker's batches run whole again.
                    drop(flushing.take());
                    let _mapping = self.mapping_scope();
                    let ex = self.execute_for_request(&plan);
                    let mut heap = self.heap();
                    heap.note_request_map(&plan);
                    let r = commit(&mut heap, plan, ex);
                    self.validated(&heap);
                    return r.map(|id| Some((id, heap)));
                }
                Step::Reserve(len) => {
                    let base = self.reserve(len)?;
                    self.heap().add_reservation(base, len);
                }
                Step::Flush(only) => {
                    let flushed = {
                        let _calling = Raised::new(&self.requests_mapping);
                        self.flush_only(only)
                    };
                    if flushed? {
                        drop(flushing.take());
                    } else if self.heap().waits_for_batch(only) {
                        // Another thread's unmap batch holds the ranges: have the worker's stop
                        // early, and let it land.
                        flushing.get_or_insert_with(|| Raised::new(&self.requests_flushing));
                        pause(WAIT_STEP);
                    } else {
                        // The ranges wait for their streams' work: record the events their
                        // frees lack and look for completed ones, rather than wait for the
                        // worker's tick (which stretches while no request needs them).
                        drop(flushing.take());
                        self.record_missing_events();
                        if !self.poll_events() {
                            pause(WAIT_STEP);
                        }
                    }
                }
                Step::RecordOwnFrees => self.record_own_frees(stream),
                Step::Wait => {
                    pause(WAIT_STEP);
                    return Ok(None);
                }
                Step::OutOfMemory(e) => {
                    if self.before_oom(&mut waits.pending_frees)? {
                        return Ok(None);
                    }
                    self.heap().note_oom(requested, stream);
                    return Err(e);
                }
            }
        }
        Err(gave_up())
    }

    /// What a request short of memory, with nothing in flight (`Step::Wait` covers that), tries
    /// before it reports OOM: waiting once for every stream's pending frees, then giving freed
    /// exported memory back to the driver. Returns whether to plan again.
    fn before_oom(&self, waited: &mut bool) -> Result<bool> {
        if !*waited && self.heap().has_pending_frees() {
            *waited = true;
            self.wait_for_pending_frees()?;
            return Ok(true);
        }
        // Exported memory freed (doomed chunks) counts against the cap until it goes back to
        // the driver, which an unmap batch would do later: do it now, and try again if any went.
        let doomed = self.heap().doomed_chunks();
        if doomed > 0 {
            self.flush_only(None)?;
            if self.heap().has_doomed() {
                self.release_doomed();
            }
            return Ok(self.heap().doomed_chunks() < doomed);
        }
        Ok(false)
    }

    // ---- unmapping and releasing ----------------------------------------------------------------

    /// Unmaps every retired range now. Returns whether there was anything to unmap.
    pub fn flush(&self) -> Result<bool> {
        self.flush_only(None)
    }

    /// The background worker's flush: as `flush`, but between its unmap calls it gives way to
    /// requests that are mapping. Once a request waits for runs its batch holds
    /// (`requests_flushing`), it stops before its next call, commits what it has unmapped and
    /// puts the rest back; it waits until the request has taken what it needs (up to
    /// `GIVE_WAY_MAX`), then goes on with what is left. So such a request waits for one unmap
    /// call, and the rest of the batch stays off the requests' path. (Going on at once would
    /// take the request's ranges back before it could: it would wait again, call after call.)
    pub fn flush_in_background(&self) -> Result<bool> {
        let mut any = false;
        loop {
            let (unmapped, stopped) = self.flush_batch(None, true)?;
            any |= unmapped;
            if !stopped {
                return Ok(any);
            }
            crate::sync::yield_while(
                || self.requests_flushing.load(Ordering::Acquire) > 0,
                GIVE_WAY_MAX,
            );
        }
    }

    /// A request's or the user's flush: unmaps the retired ranges `Heap::take_unmap_batch(only)`
    /// gives, all of them. Returns whether there was anything to unmap.
    fn flush_only(&self, only: Option<crate::core::pool::ChunkId>) -> Result<bool> {
        self.flush_batch(only, false).map(|(unmapped, _)| unmapped)
    }

    /// Unmaps the retired ranges `Heap::take_unmap_batch(only)` gives and commits the outcome;
    /// with `yields` (the worker's), it gives way to mapping requests between calls and stops
    /// early while a request waits for runs it holds. Returns whether there was anything to
    /// unmap, and whether it stopped early.
    fn flush_batch(
        &self,
        only: Option<crate::core::pool::ChunkId>,
        yields: bool,
    ) -> Result<(bool, bool)> {
        let mapping = self.mapping_scope();
        let runs = self.heap().take_unmap_batch(only);
        if runs.is_empty() {
            return Ok((false, false));
        }
        let (done, error) = unmap_runs(&self.driver, &runs, || {
            if !yields {
                return true;
            }
            self.give_way();
            self.requests_flushing.load(Ordering::Acquire) == 0
        });
        let stopped = done < runs.len() && error.is_none();
        let mut heap = self.heap();
        heap.commit_unmap(runs, done, error.clone());
        self.validated(&heap);
        if error.is_some() {
            // Reported here, to the caller who asked for the flush, not again later. Taken now,
            // before a failed release of doomed chunks below can record its own.
            heap.take_deferred_error();
        }
        let doomed = heap.has_doomed();
        drop(heap);
        drop(mapping);
        if doomed {
            self.release_doomed();
        }
        self.free_dead_growables();
        match error {
            Some(e) => Err(e.into()),
            None => Ok((true, stopped)),
        }
    }

    /// Waits on this thread for the stream work of every pending free, then gives back every
    /// page no allocation uses (`Allocator::empty_cache`). A failed wait is reported after the
    /// release, which still gives back what is free.
    pub fn empty_cache(&self) -> Result<u64> {
        let waited =
            if self.heap().has_pending_frees() { self.wait_for_pending_frees() } else { Ok(()) };
        let released = self.release_unused();
        waited.and(released)
    }

    /// Gives back every page no allocation or pending free uses. Returns the bytes released.
    pub fn release_unused(&self) -> Result<u64> {
        let stranded = self.retry_stranded();
        if self.record_missing_events() {
            // Frees that left their events to the worker (`deferred_free_events`): on an idle
            // stream the events just recorded complete within microseconds; give them that long.
            let start = crate::sync::Instant::now();
            while !self.poll_events() && start.elapsed() < RECORDED_JUST_NOW {
                pause(WAIT_STEP);
            }
        }
        self.poll_events();
        self.heap().retire_all_free();
        self.flush_landed()?;
        let (claim, chunks) = self.heap().take_releasable();
        let (bytes, first_error) = self.release_claimed(claim, chunks);
        match first_error {
            Some(e) => Err(e.into()),
            None => stranded.map(|()| bytes),
        }
    }

    /// Unmaps every retired range now, and those an unmap batch of the worker's holds once it
    /// lands (it takes milliseconds), so that their chunks can be released by the caller too.
    fn flush_landed(&self) -> Result<()> {
        self.flush()?;
        let start = crate::sync::Instant::now();
        while self.heap().unmaps_in_flight() && start.elapsed() < MAX_WAIT {
            pause(WAIT_STEP);
        }
        self.flush().map(drop)
    }

    /// Releases `chunks`, taken out for release under claim `claim`, and commits the claim:
    /// those that failed stay bare. Returns the bytes released and the first error.
    fn release_claimed(
        &self,
        claim: u64,
        chunks: Vec<(crate::core::pool::ChunkId, crate::driver::ChunkHandle, u64)>,
    ) -> (u64, Option<DriverError>) {
        let (released, first_error) = self.release_chunks(&chunks);
        let page = self.driver.granularity() as u64;
        let bytes = chunks.iter().zip(&released).filter(|(_, &r)| r).map(|(c, _)| c.2 * page).sum();
        let mut heap = self.heap();
        heap.commit_releases(claim, chunks, &released);
        self.validated(&heap);
        (bytes, first_error)
    }

    /// Releases `chunks` (taken out for release, without the heap lock): which went, and the
    /// first error.
    fn release_chunks(
        &self,
        chunks: &[(crate::core::pool::ChunkId, crate::driver::ChunkHandle, u64)],
    ) -> (Vec<bool>, Option<DriverError>) {
        let mut released = vec![false; chunks.len()];
        let mut first_error = None;
        for (i, &(_, handle, _)) in chunks.iter().enumerate() {
            match self.driver.release_chunk(handle) {
                Ok(()) => released[i] = true,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        (released, first_error)
    }

    /// Gives back to the driver the exported chunks that were freed and are now unmapped
    /// (`Heap::take_doomed`): another process may still map them, so they are never reused
    /// here. A failed release keeps the chunk doomed (retried after the next unmap batch, or by
    /// `release_unused`) and is recorded as a deferred error.
    fn release_doomed(&self) {
        let (claim, chunks) = self.heap().take_doomed();
        let (released, first_error) = self.release_chunks(&chunks);
        let mut heap = self.heap();
        heap.commit_releases(claim, chunks, &released);
        if let Some(e) = first_error {
            heap.note_deferred_error(e);
        }
        self.validated(&heap);
    }

    /// Unmaps and releases everything; reports allocations still live and driver errors on
    /// stderr (a destructor cannot return them).
    pub fn teardown(&self) {
        self.teardown_offloads();
        let t = self.heap().teardown();
        let mut first_error: Option<DriverError> = None;
        let (failed, error) = unmap_all(&self.driver, &t.runs);
        if let Some(e) = error {
            first_error.get_or_insert(e);
        }
        let all_unmapped = failed == 0;
        for &h in &t.chunks {
            if let Err(e) = self.driver.release_chunk(h) {
                first_error.get_or_insert(e);
            }
        }
        if all_unmapped {
            for &(base, len) in &t.reservations {
                if let Err(e) = self.driver.free_reservation(base, len as usize) {
                    first_error.get_or_insert(e);
                }
            }
        }
        for &ev in &t.events {
            let _ = self.driver.destroy_event(ev);
        }
        if t.leaked > 0 {
            eprintln!(
                "moonbright: {} allocations were still live when the allocator was dropped",
                t.leaked
            );
        }
        if let Some(e) = first_error {
            eprintln!("moonbright: teardown: {e}");
        }
    }

    /// Sleeps the worker until woken or `timeout` passes.
    pub fn worker_wait(&self, timeout: std::time::Duration) {
        let heap = self.heap();
        if self.stop.load(Ordering::Acquire) {
            return;
        }
        self.worker_asleep.store(true, Ordering::SeqCst);
        let _ = self.wake.wait_timeout(heap, timeout);
        self.worker_asleep.store(false, Ordering::SeqCst);
    }
}
