//! The heap: MoonBright's allocator state, always used under the allocator's lock and never
//! calling the driver itself. Fast paths (a stream's own pending frees, the cache of freed
//! ranges, the mapped window, sub-page and carved arenas) complete here; everything that needs
//! the driver is turned into a plan (`mapping.rs`) whose outcome is committed here.
//!
//! This file holds the `Heap` and a request's entry (`try_fast`, `finish`). Beside it, the
//! books: `ranges.rs` (the range table), `cache.rs` (cached ranges, their groups, splits and
//! steals), `live.rs` (live allocations, recent frees), `claims.rs` (work in flight, the
//! quarantine), `window.rs` (the window and its demand), `carve.rs` (carved arenas giving chunks
//! back); the placement policies in `policy/` (exact fit, near fit, carving, grow-first, steals,
//! one interface); and the operations: `plan.rs` (new ranges), `free.rs`, `events.rs` (stream
//! events), `unmap.rs` (unmap batches, releases, teardown), `export.rs`, `growable.rs`,
//! `check.rs` (segments and invariants).

use std::collections::BTreeMap;

use super::history::{History, HistoryAction, HistoryEvent};
use super::mapping::MapPlan;
use super::pool::{ChunkId, Pool};
use super::sizes::RecentSizes;
use super::stats::{HeldAtPeak, Stats};
use super::streams::Streams;
use super::subpage::{SubPage, SUBPAGE_ALIGN};
use super::vaspace::{Retired, VaSpace};
use crate::driver::{CallCounts, DriverError, EventHandle};
use crate::error::{Error, Result};
use crate::tags::TagId;

mod cache;
mod carve;
mod check;
mod claims;
mod events;
mod export;
mod free;
mod growable;
mod live;
mod plan;
mod policy;
mod ranges;
mod sleep;
mod unmap;
mod window;
use cache::Cache;
use claims::{Claim, Claims};
use growable::Growable;
pub use growable::GrowableInfo;
pub(crate) use growable::Resize;
use live::{Backing, Live, LiveTable, RECENT_FREES};
use policy::{Ask, Placed};
use ranges::{Range, Ranges, Use};
use sleep::Sleepers;
pub(crate) use sleep::{SleepWork, WakeWork};
use window::WindowBooks;

/// Index of a range in the heap.
pub(crate) type RangeId = u32;

/// An event a free asks its caller to record: (stream, epoch it covers, a spare event to record,
/// if there is one).
pub(crate) type StreamRecord = (u64, u64, Option<EventHandle>);

/// What a stream-ordered free asks of its caller (`Heap::free_on_stream`).
#[derive(Debug)]
pub(crate) enum Freed {
    /// Freed; record this event.
    One(StreamRecord),
    /// Freed, joined with other streams' uses; record every one of these events.
    Joined(Vec<StreamRecord>),
    /// Freed; an event is recorded later (`Limits::defer_free_events`).
    Deferred,
    /// Nothing done yet: check that none of these streams (the allocation's recorded uses) is
    /// being captured, then free again with the uses checked.
    CheckUses(Vec<u64>),
}

/// Room the tables requests insert into keep beyond what they hold, at least, once the worker
/// has grown them ahead (`grow_tables_ahead`).
const TABLE_HEADROOM: usize = 64;

/// The entries to reserve in a table of `len` entries and room for `cap`: none while at least
/// half of `max(len, TABLE_HEADROOM)` is free, else that many.
fn room_to_add(len: usize, cap: usize) -> Option<usize> {
    let room = len.max(TABLE_HEADROOM);
    (cap.saturating_sub(len) < room / 2).then_some(room)
}

/// Chunks a release-and-recreate split looks at to find one whose retired mappings can all be
/// unmapped now (each look scans the retired ranges).
const CHUNK_SPLIT_CANDIDATES: usize = 8;

/// When the retired ranges that map a bare chunk may be unmapped (`Heap::unmappable`), soonest
/// first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Unmappable {
    Now,
    /// Once another thread's unmap batch, which holds some of them, lands.
    AfterBatch,
    /// Once their streams' work has passed their frees.
    AfterWork,
}

/// Whether a retired range may be unmapped now: its stream's work has passed its free.
fn retired_ready(streams: &Streams, r: &Retired) -> bool {
    match r.after {
        None => true,
        // A stream forgotten had every epoch done (`Streams::forget_if_idle`).
        Some((s, epoch)) => streams.get(s).map_or(true, |f| f.is_done(epoch)),
    }
}

/// Events a stream keeps recorded and unpolled before its frees record its newest one again
/// (`StreamFrees::event_to_record`): a burst of frees between two polls neither drains the
/// event stock nor lists an event a free.
const EVENTS_IN_FLIGHT: usize = 8;

/// Limits the heap works within, fixed at creation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Page (granularity) in bytes.
    pub page: u64,
    /// Cap on physical bytes held.
    pub cap: u64,
    /// The sizes new chunks are made in.
    pub chunks: ChunkLimits,
    /// Size of each virtual reservation.
    pub reserve_bytes: u64,
    /// Limit on all reservations together.
    pub va_limit: u64,
    /// When retired ranges are unmapped.
    pub unmap: UnmapLimits,
    /// Pages of address space the window grows in at a time: at least the largest window, so
    /// the whole window can be one contiguous segment.
    pub window_slab_pages: u64,
    /// New ranges go to recycled addresses before the frontier (`Options::reuse_addresses`).
    pub reuse_addresses: bool,
    /// The placement policies' allowances.
    pub shares: PolicyShares,
    /// A free on one stream records no event; the worker records one for the stream's latest
    /// frees (`Options::deferred_free_events`).
    pub defer_free_events: bool,
    /// A request about to make new memory first records an event on its stream, so that the
    /// stream's pending frees no event covers yet may serve it (`Step::RecordOwnFrees`): less
    /// memory held when frees record no event of their own, and more remaps in repeated steps
    /// (`Profile::Memory`).
    pub own_frees_before_new: bool,
}

/// The sizes new chunks are made in, in pages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkLimits {
    /// Largest chunk.
    pub max_pages: u64,
    /// Largest new chunk for a request whose exact size a recent request had too (at most
    /// `max_pages`; `Options::max_chunk_repeated_bytes`).
    pub repeated_pages: u64,
    /// A new range that needs at least this many new pages creates them in large chunks (at
    /// least `max_pages`).
    pub large_pages: u64,
    /// Largest of those (at least `large_pages`).
    pub largest_pages: u64,
}

/// When retired ranges are unmapped, in batches.
#[derive(Clone, Copy, Debug)]
pub(crate) struct UnmapLimits {
    /// Retired ranges that trigger a batch.
    pub batch_ranges: usize,
    /// Retired bytes that trigger a batch.
    pub batch_bytes: u64,
    /// Most chunk mappings one unmap call covers (0: no limit).
    pub run_handles: usize,
    /// Retired ranges older than this are unmapped at the next chance.
    pub batch_age: std::time::Duration,
}

/// The placement policies' allowances, in 1024ths.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PolicyShares {
    /// A cached range up to this much larger than a request serves it whole
    /// (`Options::near_fit`).
    pub near_fit_per_1024: u64,
    /// Carved arenas may leave this share of the peak bytes in use unused (`Options::carve`;
    /// 0: no carving).
    pub carve_per_1024: u64,
    /// That budget for a request whose exact size a recent request had too, of the lesser of
    /// the peak and `CARVE_TAPER` times the headroom below it (`Options::carve_repeated`).
    pub carve_repeated_per_1024: u64,
    /// New memory before stealing while held memory stays within this share above the peak in
    /// use (`Options::grow_first`; 0: off).
    pub grow_first_per_1024: u64,
}

/// What a request that missed every fast path needs next.
#[derive(Debug)]
pub(crate) enum Step {
    /// Run this plan with the driver, then commit it.
    Map(MapPlan),
    /// Reserve this many more bytes of addresses, then plan again.
    Reserve(u64),
    /// Unmap retired ranges, then plan again: with a chunk, only the ranges that still map it
    /// (a chunk to split) when they can all go now; otherwise every one whose work has completed
    /// (to free addresses). A request makes these calls itself, so the narrower the better: a
    /// whole batch takes milliseconds.
    Flush(Option<ChunkId>),
    /// Record an event on the request's stream, then plan again: new memory would be made while
    /// the stream's own pending frees that no event covers yet could serve it
    /// (`StreamFrees::ask_to_cover`). The request's thread may record there: its call on the
    /// stream shows the stream alive.
    RecordOwnFrees,
    /// Not enough free memory now, but plans or releases in flight hold some, or (below a
    /// page) an arena has room since the request missed: wait a moment, then try the fast
    /// paths and plan again. (Decided under the same lock as the shortfall: a request that
    /// looked later could miss work that committed meanwhile, and fail with memory free.)
    Wait,
    /// Not enough free memory, counting everything that is free now.
    OutOfMemory(Error),
}

/// The outcome of a fast-path attempt.
#[derive(Debug)]
pub(crate) enum Fast {
    /// Served: the pointer.
    Done(u64),
    /// A range of this many pages is needed (for an allocation, or a new arena).
    NeedRange { pages: u64, arena: bool },
}

/// What the heap notes beside its books: reports, the cap's past, and recent request sizes.
#[derive(Debug, Default)]
struct Notes {
    /// The driver's call counts when accumulated statistics were last reset: `Allocator::stats`
    /// reports the calls made since.
    calls_at_reset: CallCounts,
    /// The last driver error met outside a request (a deferred unmap, say).
    deferred_error: Option<DriverError>,
    /// The bytes held when the cap was last lowered below them: held memory may exceed the cap
    /// until frees and releases bring it under, but never grows past this (the headroom is 0
    /// while over the cap).
    over_cap: Option<u64>,
    history: Option<History>,
    /// Sizes of recent requests of a page or more: carving's larger budget for repeated sizes
    /// (`Options::carve_repeated`) and smaller chunks for them (`max_chunk_repeated_bytes`).
    sizes: RecentSizes,
    /// Held memory rose to a new peak since `Stats::held_at_peak` was last taken.
    held_peak_due: bool,
}

/// MoonBright's allocator state: the books (chunks, addresses, ranges, the cache, arenas,
/// streams, live allocations, work in flight) and the placement policies run over them
/// (`policy/`).
#[derive(Debug)]
pub(crate) struct Heap {
    lim: Limits,
    pool: Pool,
    va: VaSpace,
    sub: SubPage,
    /// Carved arenas: runs of cached chunks cut page-granular into allocations of a
    /// page or more (`Options::carve`), by the same best fit and stream holds as `sub`. The
    /// range's use (`Use::Arena` or `Use::Carved`) says which of the two owns an arena.
    carved: SubPage,
    /// Stream-ordered frees, and the events stocked for them.
    streams: Streams,
    /// The window, the address slab it grows in, and the demand the mapper shapes it by.
    window: WindowBooks,
    /// Live, pending, arena and cached ranges, by id and by address.
    ranges: Ranges,
    /// The cached ranges, indexed for the placement policies.
    cache: Cache,
    /// Live allocations and recently freed pointers.
    live: LiveTable,
    /// What plans, releases, unmap batches and event records in flight hold.
    claims: Claims,
    /// Growable allocations by base address (released ones until their addresses are unmapped).
    growables: BTreeMap<u64, Growable>,
    /// Tags asleep, or on their way to sleep or back.
    sleepers: Sleepers,
    stats: Stats,
    notes: Notes,
}

impl Heap {
    pub fn new(lim: Limits) -> Self {
        Heap {
            lim,
            pool: Pool::default(),
            va: VaSpace::new(lim.reuse_addresses),
            sub: SubPage::default(),
            carved: SubPage::tracking_freed(),
            streams: Streams::default(),
            window: WindowBooks::new(lim.page),
            ranges: Ranges::default(),
            cache: Cache::default(),
            live: LiveTable::default(),
            claims: Claims::default(),
            growables: BTreeMap::new(),
            sleepers: Sleepers::default(),
            stats: Stats::default(),
            notes: Notes::default(),
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.lim
    }

    /// Sets the cap on physical bytes held (a whole number of pages, checked by the caller).
    /// Below what is held now, held memory still serves requests (a split recreates no more
    /// than it releases) but does not grow until frees and releases bring it under the cap; the
    /// caller releases what no allocation uses.
    pub fn set_cap(&mut self, cap: u64) {
        self.lim.cap = cap;
        let held = self.bytes(self.pool.held_pages() + self.claims.create_pages);
        self.notes.over_cap = (held > cap).then_some(held);
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Takes `Stats::held_at_peak` now if held memory is at a new peak no allocation has seen
    /// since (the worker's window refills raise it between requests).
    pub fn settle_held_at_peak(&mut self) {
        let reserved = &self.stats.reserved_bytes;
        if self.notes.held_peak_due && reserved.current == reserved.peak {
            self.stats.held_at_peak = self.held_breakdown();
            self.notes.held_peak_due = false;
        }
    }

    pub fn reset_peaks(&mut self) {
        self.stats.reset_peaks();
        self.notes.held_peak_due = true;
    }

    /// Where held memory goes now (`Stats::held_at_peak`).
    fn held_breakdown(&self) -> HeldAtPeak {
        let s = &self.stats;
        let requested = s.allocated_bytes.current;
        let mut held = HeldAtPeak {
            reserved: s.reserved_bytes.current,
            requested,
            rounding: s.active_bytes.current.saturating_sub(requested),
            arena_free: self.sub.free_bytes() + self.carved.free_bytes(),
            cached: self.bytes(self.cache.pages),
            pending: self.bytes(self.streams.pending_pages()),
            window: self.bytes(self.window.mapped.pages()),
            bare: self.bytes(self.pool.bare_pages()),
            other: 0,
        };
        let known = held.requested
            + held.rounding
            + held.arena_free
            + held.cached
            + held.pending
            + held.window
            + held.bare;
        held.other = held.reserved.saturating_sub(known);
        held
    }

    /// Zeroes every cumulative figure (see `Stats::reset_accumulated`); `calls_now`, the
    /// driver's call counts, becomes the base the reported counts start from.
    pub fn reset_accumulated(&mut self, calls_now: CallCounts) {
        self.stats.reset_accumulated();
        self.notes.calls_at_reset = calls_now;
    }

    /// The driver's call counts at the last reset of accumulated statistics.
    pub fn calls_at_reset(&self) -> &CallCounts {
        &self.notes.calls_at_reset
    }

    pub fn take_deferred_error(&mut self) -> Option<DriverError> {
        self.notes.deferred_error.take()
    }

    pub fn note_deferred_error(&mut self, e: DriverError) {
        self.stats.deferred_errors += 1;
        self.notes.deferred_error = Some(e);
    }

    /// The usable size of a live allocation (its rounded size), if `ptr` is one.
    pub fn usable_size(&self, ptr: u64) -> Option<u64> {
        self.live.allocs.get(&ptr).map(|l| l.rounded)
    }

    #[inline]
    fn range(&self, id: RangeId) -> &Range {
        self.ranges.get(id)
    }

    #[inline]
    fn range_mut(&mut self, id: RangeId) -> &mut Range {
        self.ranges.get_mut(id)
    }

    fn bytes(&self, pages: u64) -> u64 {
        pages * self.lim.page
    }

    // ---- history --------------------------------------------------------------------------------

    /// Starts recording up to `max` events (dropping the oldest), or stops with `None`.
    pub fn set_history(&mut self, max: Option<usize>) {
        self.notes.history = max.map(|m| History::new(m, crate::sync::Instant::now()));
    }

    /// The events recorded so far.
    pub fn history(&self) -> Vec<HistoryEvent> {
        self.notes.history.as_ref().map(History::events).unwrap_or_default()
    }

    fn note(&mut self, action: HistoryAction, addr: u64, size: u64, stream: u64) {
        if let Some(h) = &mut self.notes.history {
            h.push(action, addr, size, stream);
        }
    }

    // ---- allocation -----------------------------------------------------------------------------

    /// Checks a request's size: the pages it needs, or why it can never succeed.
    fn check_size(&self, size: u64) -> Result<()> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        if size > self.lim.cap {
            return Err(Error::TooLarge { requested: size, cap: self.lim.cap });
        }
        Ok(())
    }

    /// Serves `size` bytes of `tag` (0: untagged) for `stream` without the driver if it can:
    /// the stream's own pending frees, the cache, an arena, the window. Otherwise says what
    /// range is needed. A tagged request gets memory no other tag shares (a range of its own,
    /// or space in the tag's own arenas), so that the tag can sleep alone (`sleep.rs`).
    pub fn try_fast(&mut self, size: u64, stream: u64, tag: TagId) -> Result<Fast> {
        self.check_size(size)?;
        if tag != 0 {
            self.check_awake(tag, "an allocation")?;
        }
        if size < self.lim.page {
            let rounded = size.next_multiple_of(SUBPAGE_ALIGN);
            if let Some((arena, offset)) = self.sub.alloc(rounded, stream, tag) {
                let ptr = self.range(arena).va + offset;
                self.finish_live(ptr, size, rounded, stream, Backing::Sub { arena, offset }, tag);
                return Ok(Fast::Done(ptr));
            }
            return Ok(match self.place_arena_page(&mut Ask::new(size, 1, stream, tag)) {
                Some(Placed::Range(id)) => Fast::Done(self.start_arena(id, size, stream, tag)),
                Some(Placed::Block(_)) => unreachable!("an arena's page is a range"),
                None => self.need_range(1, true, tag),
            });
        }
        let pages = size.div_ceil(self.lim.page);
        Ok(match self.place_pages(&mut Ask::new(size, pages, stream, tag)) {
            Some(Placed::Range(id)) => Fast::Done(self.finish_range(id, size, stream, tag)),
            Some(Placed::Block(ptr)) => Fast::Done(ptr),
            None => self.need_range(pages, false, tag),
        })
    }

    /// A request of `tag` leaves the fast paths to map a range; a tagged one is counted until
    /// it finishes or comes back (`end_tagged_request`), so that its tag cannot go to sleep
    /// meanwhile.
    #[inline]
    fn need_range(&mut self, pages: u64, arena: bool, tag: TagId) -> Fast {
        if tag != 0 {
            self.note_tagged_request(tag);
        }
        Fast::NeedRange { pages, arena }
    }

    /// Whether a repeated size's new memory comes in smaller chunks
    /// (`Options::max_chunk_repeated_bytes`).
    fn cuts_repeated(&self) -> bool {
        self.lim.chunks.repeated_pages < self.lim.chunks.max_pages
    }

    /// Whether requests' sizes are kept (`sizes`), for either use of them.
    fn keeps_sizes(&self) -> bool {
        self.tells_repeated() || self.cuts_repeated()
    }

    /// Counts a request's own synchronous map (attempted, whether or not it succeeded).
    pub fn note_request_map(&mut self, plan: &MapPlan) {
        self.stats.request_maps += 1;
        self.stats.request_mapped_handles += (plan.existing.len() + plan.create.len()) as u64;
        self.stats.request_created_chunks += (plan.create.len() + plan.spare.len()) as u64;
        self.stats.request_released_chunks += plan.release.len() as u64;
    }

    /// Completes a request of `tag` with a range mapped for it: a new arena's first block, or
    /// the allocation itself. The tag cannot have gone to sleep meanwhile: a sleep is refused
    /// while requests of its tag are in flight (`sleep.rs`).
    pub fn finish(&mut self, id: RangeId, size: u64, stream: u64, arena: bool, tag: TagId) -> u64 {
        self.end_tagged_request(tag);
        let pages = self.range(id).pages;
        self.note_fresh(pages, pages);
        self.window.last_request_map = Some(crate::sync::Instant::now());
        if arena {
            self.start_arena(id, size, stream, tag)
        } else {
            self.finish_range(id, size, stream, tag)
        }
    }

    /// Counts a request of `asked` pages served `got` pages at fresh addresses (the mapper's
    /// measure of demand).
    fn note_fresh(&mut self, asked: u64, got: u64) {
        self.window.note_fresh(asked, got);
    }

    fn start_arena(&mut self, id: RangeId, size: u64, stream: u64, tag: TagId) -> u64 {
        self.range_mut(id).use_ = Use::Arena;
        self.sub.add_arena(id, self.lim.page, tag);
        let rounded = size.next_multiple_of(SUBPAGE_ALIGN);
        let (arena, offset) =
            self.sub.alloc(rounded, stream, tag).expect("a fresh arena fits any sub-page request");
        let ptr = self.range(arena).va + offset;
        self.finish_live(ptr, size, rounded, stream, Backing::Sub { arena, offset }, tag);
        ptr
    }

    fn finish_range(&mut self, id: RangeId, size: u64, stream: u64, tag: TagId) -> u64 {
        self.range_mut(id).use_ = Use::Alloc;
        let r = self.range(id);
        let (ptr, rounded) = (r.va, self.bytes(r.pages));
        self.finish_live(ptr, size, rounded, stream, Backing::Range(id), tag);
        ptr
    }

    fn finish_live(
        &mut self,
        ptr: u64,
        size: u64,
        rounded: u64,
        stream: u64,
        backing: Backing,
        tag: TagId,
    ) {
        if matches!(backing, Backing::Sub { arena, .. } if self.range(arena).use_ == Use::Arena) {
            self.stats.subpage_allocations += 1;
        }
        self.count(size, rounded);
        if size >= self.lim.page && self.keeps_sizes() {
            self.notes.sizes.insert(size);
        }
        self.live.forget_free(ptr);
        self.note(HistoryAction::Alloc, ptr, size, stream);
        let live = Live { size, rounded, stream, backing, uses: Vec::new(), pooled: false, tag };
        let prev = self.live.allocs.insert(ptr, live);
        debug_assert!(prev.is_none(), "pointer handed out twice");
        if self.notes.held_peak_due {
            self.settle_held_at_peak();
        }
    }

    /// Grows the tables requests insert into (live allocations, ranges, recent frees) ahead of
    /// need, on the worker's time: a table grows on the insert that fills it, rehashing or
    /// copying every entry, and a fresh allocator's 4th, 8th, 15th and 29th window hits took
    /// 2-3.6 µs on the host backend against 0.3-0.5 for the others, and the same points showed
    /// in the H200 latency benchmark's 8 GiB window hits. Once less than half its room is left,
    /// a table is grown to hold twice its entries (at least `TABLE_HEADROOM` more), so a burst
    /// of requests between two of the worker's ticks does not grow it.
    pub fn grow_tables_ahead(&mut self) {
        if let Some(n) = room_to_add(self.live.allocs.len(), self.live.allocs.capacity()) {
            self.live.allocs.reserve(n);
        }
        if let Some(n) = room_to_add(self.ranges.slots.len(), self.ranges.slots.capacity()) {
            self.ranges.slots.reserve(n);
        }
        let (len, cap) = (self.live.recent_free_gen.len(), self.live.recent_free_gen.capacity());
        if let Some(n) = room_to_add(len, cap) {
            self.live.recent_free_gen.reserve(n.min(RECENT_FREES));
        }
    }

    /// Counts a host wait for pending frees.
    pub fn note_pending_free_wait(&mut self) {
        self.stats.pending_free_waits += 1;
    }

    /// Counts an allocation refused for lack of memory.
    pub fn note_oom(&mut self, size: u64, stream: u64) {
        self.stats.num_ooms += 1;
        self.note(HistoryAction::Oom, 0, size, stream);
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
