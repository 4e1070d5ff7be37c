//! The heap: MoonBright's allocator state and every policy decision, always used under the
//! allocator's lock and never calling the driver itself. Fast paths (a stream's own pending frees,
//! the cache of freed ranges, the mapped window, sub-page arenas) complete here; everything that
//! needs the driver is turned into a plan (`mapping.rs`) whose outcome is committed here.
//!
//! This file holds the state, the requests' fast paths and the frees; the rest is beside it:
//! `plan.rs` (new ranges), `cache.rs` (cached ranges and the window), `carve.rs` (carved
//! arenas), `unmap.rs` (unmap batches, releases, teardown), `check.rs` (segments and
//! invariants) and `growable.rs` (growable allocations).

use std::collections::{hash_map::Entry, BTreeMap};

use super::history::{History, HistoryAction, HistoryEvent};
use super::mapping::MapPlan;
use super::pool::{ChunkId, Pool};
use super::sizes::RecentSizes;
use super::stats::Stats;
use super::streams::{Pending, Streams};
use super::subpage::{Emptied, Owner, SubPage, SUBPAGE_ALIGN};
use super::vaspace::{Retired, VaSpace};
use crate::driver::{CallCounts, ChunkHandle, DriverError, EventHandle};
use crate::error::{Error, Result};

mod cache;
mod carve;
mod check;
mod claims;
mod growable;
mod live;
mod plan;
mod policy;
mod ranges;
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

/// The chunks behind one allocation, for an export (`Heap::shared_chunks`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SharedChunks {
    /// (handle, bytes) in address order.
    pub chunks: Vec<(ChunkHandle, u64)>,
    /// Where the allocation starts in the first chunk.
    pub offset: u64,
    /// The allocation's size in bytes.
    pub size: u64,
}

/// Limits the heap works within, fixed at creation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Page (granularity) in bytes.
    pub page: u64,
    /// Cap on physical bytes held.
    pub cap: u64,
    /// Largest chunk, in pages.
    pub max_chunk_pages: u64,
    /// Largest new chunk for a request whose exact size a recent request had too (at most
    /// `max_chunk_pages`; `Options::max_chunk_repeated_bytes`).
    pub repeated_chunk_pages: u64,
    /// A new range that needs at least this many new pages creates them in large chunks (at
    /// least `max_chunk_pages`).
    pub large_chunk_pages: u64,
    /// Largest of those (at least `large_chunk_pages`).
    pub largest_chunk_pages: u64,
    /// Size of each virtual reservation.
    pub reserve_bytes: u64,
    /// Limit on all reservations together.
    pub va_limit: u64,
    /// Retired ranges that trigger an unmap batch.
    pub unmap_batch_ranges: usize,
    /// Retired bytes that trigger an unmap batch.
    pub unmap_batch_bytes: u64,
    /// Most chunk mappings one unmap call covers (0: no limit).
    pub unmap_run_handles: usize,
    /// Retired ranges older than this are unmapped at the next chance.
    pub unmap_batch_age: std::time::Duration,
    /// Pages of address space the window grows in at a time: at least the largest window, so
    /// the whole window can be one contiguous segment.
    pub window_slab_pages: u64,
    /// New ranges go to recycled addresses before the frontier (`Options::reuse_addresses`).
    pub reuse_addresses: bool,
    /// A cached range up to this many 1024ths larger than a request serves it whole
    /// (`Options::near_fit`).
    pub near_fit_per_1024: u64,
    /// Carved arenas may leave this many 1024ths of the peak bytes in use unused
    /// (`Options::carve`; 0: no carving).
    pub carve_per_1024: u64,
    /// That budget for a request whose exact size a recent request had too, of the lesser of
    /// the peak and `CARVE_TAPER` times the headroom below it (`Options::carve_repeated`).
    pub carve_repeated_per_1024: u64,
    /// New memory before stealing while held memory stays within this many 1,024ths above the
    /// peak in use (`Options::grow_first`; 0: off).
    pub grow_first_per_1024: u64,
    /// A free on one stream records no event; the worker records one for the stream's latest
    /// frees (`Options::deferred_free_events`).
    pub defer_free_events: bool,
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

    pub fn reset_peaks(&mut self) {
        self.stats.reset_peaks();
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

    /// What exporting the live allocation (or growable) at `ptr` shares (`Allocator::export`):
    /// the chunks that back it, in address order, as (handle, bytes), only those its bytes lie
    /// in; where it starts in the first; and its size. With `mark`, marks them exported, before
    /// the driver exports them (so that a free meanwhile cannot hand them to another
    /// allocation): from then on they are never reused here, and once freed they go back to
    /// the driver (`Pool::put_bare`, `discard_range`), even if the export then fails. A block
    /// carved from an arena (below a page, or cut from cached chunks) shares its chunks with
    /// other allocations, which the importer would reach: it is refused (docs/security.md). A
    /// growable shares the chunks committed now. Refuses any other pointer as `free` would.
    pub fn shared_chunks(&mut self, ptr: u64, mark: bool) -> Result<SharedChunks> {
        if let Some(live) = self.live.allocs.get(&ptr).filter(|l| !l.pooled) {
            let id = match live.backing {
                Backing::Range(id) => id,
                Backing::Sub { arena, .. } => {
                    let (what, remedy) = if self.range(arena).use_ == Use::Arena {
                        (
                            "a block below a page, carved from a page",
                            format!("allocate what you share with {} bytes or more", self.lim.page),
                        )
                    } else {
                        (
                            "a block carved from a run of cached chunks (option `carve`)",
                            "set options `carve` and `carve_repeated` to 0 in a process that \
                             shares what it allocates"
                                .to_string(),
                        )
                    };
                    return Err(Error::Ipc(format!(
                        "{ptr:#x} ({} bytes) is {what} that other allocations share: an \
                         importer would reach their memory, so it is not exported; {remedy} \
                         (docs/security.md)",
                        live.size
                    )));
                }
            };
            let size = live.size;
            let chunks = self.range(id).chunks.to_vec();
            let shared = self.export_covering(&chunks, size, mark);
            return Ok(SharedChunks { chunks: shared, offset: 0, size });
        }
        if let Ok(g) = self.live_growable(ptr) {
            if g.chunks.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "growable allocation {ptr:#x} has no memory committed to share; resize it first"
                )));
            }
            let (chunks, size) = (g.chunks.clone(), g.size);
            let shared = self.export_covering(&chunks, size.max(1), mark);
            return Ok(SharedChunks { chunks: shared, offset: 0, size });
        }
        Err(self.classify_bad_free(ptr))
    }

    /// The leading chunks of `chunks` that `size` bytes from the first's start lie in, as
    /// (handle, bytes); with `mark`, marked exported.
    fn export_covering(
        &mut self,
        chunks: &[ChunkId],
        size: u64,
        mark: bool,
    ) -> Vec<(ChunkHandle, u64)> {
        let mut out = Vec::new();
        let mut covered = 0;
        for &c in chunks {
            if covered >= size {
                break;
            }
            if mark {
                self.pool.mark_exported(c);
            }
            let bytes = self.bytes(self.pool.get(c).pages);
            out.push((self.pool.get(c).handle, bytes));
            covered += bytes;
        }
        out
    }

    /// Whether range `id` holds an exported chunk (checked only once anything was exported).
    fn holds_exported(&self, id: RangeId) -> bool {
        self.pool.any_exported() && self.range(id).chunks.iter().any(|&c| self.pool.get(c).exported)
    }

    /// Takes apart a freed range that holds exported chunks instead of caching it: its
    /// addresses are retired (unmapped once `after`, a stream's epoch, has passed), its
    /// exported chunks doomed (released once unmapped, never reused), the others bare.
    fn discard_range(&mut self, id: RangeId, after: Option<(u64, u64)>) {
        let range = self.remove_range(id);
        for &c in range.chunks.iter() {
            self.pool.put_bare(c);
        }
        let len = self.bytes(range.pages);
        self.retire_after(range.va, len, range.chunks.into_vec(), after);
    }

    /// How many exported chunks wait to be released, still mapped by retired ranges or not: held
    /// memory no request can use until they go.
    pub fn doomed_chunks(&self) -> usize {
        self.pool.doomed_count()
    }

    /// Whether an exported chunk waits, unmapped, to be released (`take_doomed`).
    pub fn has_doomed(&self) -> bool {
        self.pool.any_exported() && self.pool.has_doomed_unmapped()
    }

    /// Takes out the exported chunks that no range uses and that are mapped nowhere, for
    /// release, as `take_releasable` does (a claim id, and the chunks).
    pub fn take_doomed(&mut self) -> (u64, Vec<(ChunkId, ChunkHandle, u64)>) {
        let out: Vec<_> = self
            .pool
            .take_doomed()
            .into_iter()
            .map(|c| (c, self.pool.get(c).handle, self.pool.get(c).pages))
            .collect();
        let chunks = out.iter().map(|r| r.0).collect();
        let id = self.claims.add(Claim { chunks, ..Claim::default() });
        (id, out)
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

    /// Serves `size` bytes for `stream` without the driver if it can: the stream's own pending
    /// frees, the cache, an arena, the window. Otherwise says what range is needed.
    pub fn try_fast(&mut self, size: u64, stream: u64) -> Result<Fast> {
        self.check_size(size)?;
        if size < self.lim.page {
            let rounded = size.next_multiple_of(SUBPAGE_ALIGN);
            if let Some((arena, offset)) = self.sub.alloc(rounded, stream) {
                let ptr = self.range(arena).va + offset;
                self.finish_live(ptr, size, rounded, stream, Backing::Sub { arena, offset });
                return Ok(Fast::Done(ptr));
            }
            return Ok(match self.place_arena_page(&mut Ask::new(size, 1, stream)) {
                Some(Placed::Range(id)) => Fast::Done(self.start_arena(id, size, stream)),
                Some(Placed::Block(_)) => unreachable!("an arena's page is a range"),
                None => Fast::NeedRange { pages: 1, arena: true },
            });
        }
        let pages = size.div_ceil(self.lim.page);
        Ok(match self.place_pages(&mut Ask::new(size, pages, stream)) {
            Some(Placed::Range(id)) => Fast::Done(self.finish_range(id, size, stream)),
            Some(Placed::Block(ptr)) => Fast::Done(ptr),
            None => Fast::NeedRange { pages, arena: false },
        })
    }

    /// Whether a repeated size's new memory comes in smaller chunks
    /// (`Options::max_chunk_repeated_bytes`).
    fn cuts_repeated(&self) -> bool {
        self.lim.repeated_chunk_pages < self.lim.max_chunk_pages
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

    /// Completes a request with a range mapped for it: a new arena's first block, or the
    /// allocation itself.
    pub fn finish(&mut self, id: RangeId, size: u64, stream: u64, arena: bool) -> u64 {
        let pages = self.range(id).pages;
        self.note_fresh(pages, pages);
        self.window.last_request_map = Some(crate::sync::Instant::now());
        if arena {
            self.start_arena(id, size, stream)
        } else {
            self.finish_range(id, size, stream)
        }
    }

    /// Counts a request of `asked` pages served `got` pages at fresh addresses (the mapper's
    /// measure of demand).
    fn note_fresh(&mut self, asked: u64, got: u64) {
        self.window.note_fresh(asked, got);
    }

    fn start_arena(&mut self, id: RangeId, size: u64, stream: u64) -> u64 {
        self.range_mut(id).use_ = Use::Arena;
        self.sub.add_arena(id, self.lim.page);
        let rounded = size.next_multiple_of(SUBPAGE_ALIGN);
        let (arena, offset) =
            self.sub.alloc(rounded, stream).expect("a fresh arena fits any sub-page request");
        let ptr = self.range(arena).va + offset;
        self.finish_live(ptr, size, rounded, stream, Backing::Sub { arena, offset });
        ptr
    }

    fn finish_range(&mut self, id: RangeId, size: u64, stream: u64) -> u64 {
        self.range_mut(id).use_ = Use::Alloc;
        let r = self.range(id);
        let (ptr, rounded) = (r.va, self.bytes(r.pages));
        self.finish_live(ptr, size, rounded, stream, Backing::Range(id));
        ptr
    }

    fn finish_live(&mut self, ptr: u64, size: u64, rounded: u64, stream: u64, backing: Backing) {
        if matches!(backing, Backing::Sub { arena, .. } if self.range(arena).use_ == Use::Arena) {
            self.stats.subpage_allocations += 1;
        }
        self.count(size, rounded);
        if size >= self.lim.page && self.keeps_sizes() {
            self.notes.sizes.insert(size);
        }
        self.live.forget_free(ptr);
        self.note(HistoryAction::Alloc, ptr, size, stream);
        let live = Live { size, rounded, stream, backing, uses: Vec::new(), pooled: false };
        let prev = self.live.allocs.insert(ptr, live);
        debug_assert!(prev.is_none(), "pointer handed out twice");
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

    // ---- freeing --------------------------------------------------------------------------------

    fn take_live(&mut self, ptr: u64) -> Result<Live> {
        self.take_live_unless(ptr, |_| false).map(|l| l.expect("never kept"))
    }

    /// `take_live`, unless `keep` says to leave the allocation as it is (`Ok(None)`): one hash
    /// lookup either way, on the free path.
    fn take_live_unless(
        &mut self,
        ptr: u64,
        keep: impl FnOnce(&Live) -> bool,
    ) -> Result<Option<Live>> {
        let live = match self.live.allocs.entry(ptr) {
            Entry::Occupied(e) if keep(e.get()) => return Ok(None),
            Entry::Occupied(e) => Some(e.remove()),
            Entry::Vacant(_) => None,
        };
        let Some(live) = live else {
            return Err(self.classify_bad_free(ptr));
        };
        // A pooled block left the counts when its pool kept it.
        if !live.pooled {
            self.uncount(live.size, live.rounded);
        }
        self.remember_free(ptr);
        Ok(Some(live))
    }

    /// Adds an allocation of `size` bytes (`rounded` held) to the statistics.
    fn count(&mut self, size: u64, rounded: u64) {
        self.stats.allocated_bytes.add(size);
        self.stats.active_bytes.add(rounded);
        self.stats.rounding_waste_bytes.add(rounded - size);
        self.stats.allocations.add(1);
    }

    /// Takes an allocation of `size` bytes (`rounded` held) out of the statistics.
    fn uncount(&mut self, size: u64, rounded: u64) {
        self.stats.allocated_bytes.sub(size);
        self.stats.active_bytes.sub(rounded);
        self.stats.rounding_waste_bytes.sub(rounded - size);
        self.stats.allocations.sub(1);
    }

    // ---- graph pools' blocks --------------------------------------------------------------------

    /// A graph pool keeps the block at `ptr` that its user freed: it stays live here (the
    /// pool's, mapped), but no longer counts as allocated or active, as PyTorch counts a
    /// graph-private pool's free blocks, and shows as free space in `segments`. The history
    /// keeps it allocated until the pool hands it back to the heap, so that its events pair up.
    /// Does nothing to a block not live, or kept already.
    pub fn pool_keep(&mut self, ptr: u64) {
        let Some(live) = self.live.allocs.get_mut(&ptr).filter(|l| !l.pooled) else { return };
        live.pooled = true;
        let (size, rounded) = (live.size, live.rounded);
        self.uncount(size, rounded);
    }

    /// A graph pool hands its kept block at `ptr` to a request of `size` bytes on `stream`: it
    /// counts as allocated again. Does nothing to a block not kept.
    pub fn pool_reuse(&mut self, ptr: u64, size: u64, stream: u64) {
        let Some(live) = self.live.allocs.get_mut(&ptr).filter(|l| l.pooled) else { return };
        live.pooled = false;
        live.size = size.min(live.rounded);
        live.stream = stream;
        let (size, rounded) = (live.size, live.rounded);
        self.count(size, rounded);
    }

    /// A graph pool makes its kept block at `ptr` live again as it was (a checkpointed pool
    /// state set back), for `stream`: it counts as allocated again, with the size last asked.
    pub fn pool_revive(&mut self, ptr: u64, stream: u64) {
        let Some(size) = self.live.allocs.get(&ptr).filter(|l| l.pooled).map(|l| l.size) else {
            return;
        };
        self.pool_reuse(ptr, size, stream);
    }

    /// Remembers a freed pointer, to tell a double free from an unknown pointer.
    fn remember_free(&mut self, ptr: u64) {
        self.live.remember_free(ptr);
    }

    /// Frees at once: the caller guarantees no device work uses the memory any more.
    pub fn free_now(&mut self, ptr: u64) -> Result<()> {
        let live = self.take_live(ptr)?;
        self.note(HistoryAction::FreeRequested, ptr, live.size, live.stream);
        self.note(HistoryAction::FreeCompleted, ptr, live.size, live.stream);
        self.release_backing(live.backing);
        Ok(())
    }

    /// Notes that work on `stream` uses the live allocation at `ptr` (PyTorch's
    /// `recordStream`): a later `free_on_stream` waits for `stream`'s work queued before it too.
    /// Refuses a pointer that is not the start of a live allocation, and changes nothing then.
    pub fn record_use(&mut self, ptr: u64, stream: u64) -> Result<()> {
        let Some(live) = self.live.allocs.get_mut(&ptr) else {
            return Err(match self.classify_bad_free(ptr) {
                Error::DoubleFree { ptr } => Error::UnknownPointer { ptr },
                e => e,
            });
        };
        if !live.uses.contains(&stream) {
            live.uses.push(stream);
        }
        Ok(())
    }

    /// Frees in `stream`'s order: reusable at once by `stream`, by others once an event recorded
    /// after this free has completed. Returns the events the caller must record now: one on
    /// `stream`, or, for an allocation other streams use too (`record_use`), one on each of
    /// those streams and on `stream`. Such a free is joined (`Streams::push_joined`): no stream,
    /// `stream` included, reuses it until each one's work queued before the free has completed.
    /// Until `uses_checked`, such a free changes nothing and asks the caller to check that none
    /// of those streams is capturing (`Freed::CheckUses`), as it must for `stream`.
    pub fn free_on_stream(&mut self, ptr: u64, stream: u64, uses_checked: bool) -> Result<Freed> {
        let keep = |l: &Live| !uses_checked && l.uses.iter().any(|&u| u != stream);
        let Some(live) = self.take_live_unless(ptr, keep)? else {
            // Kept live for the check (a second lookup, on this rare path only).
            return Ok(Freed::CheckUses(self.live.allocs[&ptr].uses.clone()));
        };
        self.note(HistoryAction::FreeRequested, ptr, live.size, stream);
        let what = match live.backing {
            Backing::Range(id) => {
                self.range_mut(id).use_ = Use::Pending;
                Pending::Range { id, va: self.range(id).va, pages: self.range(id).pages }
            }
            Backing::Sub { .. } => Pending::Block { ptr, rounded: live.rounded },
        };
        if live.uses.iter().all(|&u| u == stream) {
            let epoch = match what {
                // Exported: never reused, not even by `stream`; unmapped once its work passes.
                Pending::Range { id, va, pages } if self.holds_exported(id) => {
                    let epoch = self.streams.push(stream, Pending::Mark);
                    self.discard_range(id, Some((stream, epoch)));
                    self.note(HistoryAction::FreeCompleted, va, self.bytes(pages), stream);
                    epoch
                }
                // Free at once, held for the stream in its arena until the epoch completes
                // (`SubPage`): as PyTorch's allocator, the history shows the free complete now.
                Pending::Block { ptr, rounded } => {
                    let Backing::Sub { arena, offset } = live.backing else {
                        unreachable!("a block is backed by an arena")
                    };
                    let epoch = self.streams.hold(stream);
                    // A sub-page arena this empties goes back when `settle` opens its space; a
                    // carved one's whole free chunks go pending for the stream at once.
                    self.arenas_of(arena).free(arena, offset, Owner::Held { stream, epoch });
                    self.uncarve_freed();
                    self.note(HistoryAction::FreeCompleted, ptr, rounded, stream);
                    epoch
                }
                _ => self.streams.push(stream, what),
            };
            if self.lim.defer_free_events {
                // `streams_needing_events` lists the stream until a record covers `epoch`.
                self.streams.entry(stream).leave_unrecorded(epoch);
                return Ok(Freed::Deferred);
            }
            return Ok(Freed::One(self.record_for(stream, epoch)));
        }
        let mut streams = vec![stream];
        streams.extend(live.uses.iter().filter(|&&u| u != stream));
        self.stats.joined_frees += 1;
        let waits = self.streams.push_joined(&streams, what);
        Ok(Freed::Joined(waits.into_iter().map(|(s, epoch)| self.record_for(s, epoch)).collect()))
    }

    /// The event record a free of `epoch` on `stream` asks for, counted in flight.
    fn record_for(&mut self, stream: u64, epoch: u64) -> StreamRecord {
        self.claims.records_in_flight += 1;
        let spare = self
            .streams
            .entry(stream)
            .event_to_record(EVENTS_IN_FLIGHT)
            .or_else(|| self.streams.stock.pop());
        (stream, epoch, spare)
    }

    /// How many events the stock lacks, once it is down to half of `target` (0 otherwise).
    pub fn event_stock_wanted(&self, target: usize) -> usize {
        if self.streams.stock.len() <= target / 2 {
            target - self.streams.stock.len()
        } else {
            0
        }
    }

    /// Takes out the events the stock holds beyond `target`, once it holds more than twice
    /// that: events of forgotten streams come back to the stock, and a burst of many streams
    /// would otherwise leave thousands created for good.
    pub fn event_stock_excess(&mut self, target: usize) -> Vec<EventHandle> {
        if self.streams.stock.len() > 2 * target {
            self.streams.stock.split_off(target)
        } else {
            Vec::new()
        }
    }

    /// Events in the stock.
    pub fn events_stocked(&self) -> usize {
        self.streams.stock.len()
    }

    /// Adds events created ahead of need to the stock.
    pub fn stock_events(&mut self, events: Vec<EventHandle>) {
        self.streams.stock.extend(events);
    }

    /// Settles a record of an event on `stream` for the free of `epoch`: `Ok(event)` was
    /// recorded after it; `Err(event)` failed (the event, if one was made, becomes a spare, and
    /// the worker records one for the free later). `own` says whether it was the record the free
    /// itself asked for (`free_on_stream`, a shrink on a stream), which is in flight until now.
    pub fn record_settled(
        &mut self,
        stream: u64,
        epoch: u64,
        outcome: std::result::Result<EventHandle, Option<EventHandle>>,
        own: bool,
    ) {
        if own {
            self.claims.records_in_flight -= 1;
        }
        let f = self.streams.entry(stream);
        match outcome {
            Ok(event) => f.recorded(epoch, event),
            Err(spare) => {
                f.record_failed(epoch);
                if let Some(event) = spare {
                    f.return_event(event);
                }
            }
        }
    }

    /// Streams with a free whose own event record failed and that no record since covers:
    /// (stream, newest epoch, spare event). Never a stream whose frees wait only for their own
    /// records still in flight (see `StreamFrees::needs_event`).
    pub fn streams_needing_events(&mut self) -> Vec<(u64, u64, Option<EventHandle>)> {
        self.streams.needing_events(EVENTS_IN_FLIGHT)
    }

    /// Whether any recorded event is not known complete (what `events_to_query` would list).
    pub fn has_listed_events(&self) -> bool {
        self.streams.iter().any(|(_, f)| f.events().next().is_some())
    }

    /// Every recorded event not known complete, per stream, oldest epoch first. Frees on one
    /// stream from two threads may record their events in the other order than their epochs
    /// (each records after leaving the lock), so the list is sorted: a poll queries the newest
    /// epoch's event, which covers every older one (its record came after all their frees).
    pub fn events_to_query(&self) -> Vec<(u64, Vec<(u64, EventHandle)>)> {
        self.streams
            .iter()
            .map(|(s, f)| {
                let mut evs = f.events().collect::<Vec<_>>();
                evs.sort_unstable_by_key(|&(epoch, _)| epoch);
                (s, evs)
            })
            .filter(|(_, evs)| !evs.is_empty())
            .collect()
    }

    /// Notes that every event of `stream` up to `event` has completed: what they cover becomes
    /// free for every stream.
    pub fn events_completed(&mut self, stream: u64, epoch: u64, event: EventHandle) {
        // A stream already forgotten: another poller applied this completion.
        let Some(f) = self.streams.get_mut(stream) else { return };
        let done = f.completed(epoch, event);
        // Quarantined chunks of this stream whose epoch is now done become bare, in order.
        let pool = &mut self.pool;
        self.claims.quarantine.retain(|q| {
            let free = q.1 == stream && f.is_done(q.2);
            if free {
                pool.put_bare(q.0);
            }
            !free
        });
        // Sub-page blocks it freed become free for every stream.
        if let Some(upto) = f.done_epoch() {
            let emptied = self.sub.settle(stream, upto);
            for e in emptied.into_iter().chain(self.carved.settle(stream, upto)) {
                self.arena_emptied(e);
            }
            self.uncarve_freed();
        }
        // Then the joined frees this completion finished: their other streams were done before.
        let joined = self.streams.take_joined_done();
        for item in done.into_iter().chain(joined) {
            match item {
                Pending::Range { id, pages, va } => {
                    self.streams.range_left(pages);
                    if self.range(id).use_ == Use::Pending {
                        self.note(HistoryAction::FreeCompleted, va, self.bytes(pages), stream);
                    }
                    self.cache_range(id);
                }
                Pending::Block { ptr, rounded } => {
                    self.note(HistoryAction::FreeCompleted, ptr, rounded, stream);
                    let (va, arena) = self.ranges.at_or_below(ptr).expect("block's arena");
                    self.release_backing(Backing::Sub { arena, offset: ptr - va });
                }
                // A growable's shrink (its chunks left the quarantine above), or a joined free's
                // mark on this stream (the free itself completes with its last mark).
                Pending::Mark => {}
            }
        }
        if let Some(spare) = self.streams.forget_if_idle(stream) {
            self.streams.stock.extend(spare);
        }
    }

    /// Whether some plan holds claimed chunks or addresses while it runs, or a free's own event
    /// record is still to be settled: a request short of memory waits for either.
    pub fn has_inflight(&self) -> bool {
        self.claims.any()
    }

    /// Whether frees on streams are still waiting for their events.
    pub fn has_pending_frees(&self) -> bool {
        self.streams.any_pending() || !self.claims.quarantine.is_empty()
    }

    fn release_backing(&mut self, backing: Backing) {
        match backing {
            Backing::Range(id) => self.cache_range(id),
            Backing::Sub { arena, offset } => {
                if let Some(e) = self.arenas_of(arena).free(arena, offset, Owner::Open) {
                    self.arena_emptied(e);
                }
                self.uncarve_freed();
            }
        }
    }

    /// The allocator that owns arena `id`.
    fn arenas_of(&mut self, id: RangeId) -> &mut SubPage {
        if self.range(id).use_ == Use::Arena {
            &mut self.sub
        } else {
            &mut self.carved
        }
    }

    /// Takes back an arena with no block in use: cached, or pending for the stream that still
    /// holds its space, until the epoch it holds it for (a freed range's way back to it).
    fn arena_emptied(&mut self, e: Emptied) {
        self.arenas_of(e.arena).remove_arena(e.arena);
        match e.held {
            None => self.cache_range(e.arena),
            Some((stream, epoch)) => {
                let r = self.range_mut(e.arena);
                r.use_ = Use::PendingArena;
                let what = Pending::Range { id: e.arena, va: r.va, pages: r.pages };
                self.streams.push_held(stream, epoch, what);
            }
        }
    }

    fn classify_bad_free(&self, ptr: u64) -> Error {
        if let Some((_, id)) = self.ranges.at_or_below(ptr) {
            let r = self.range(id);
            if ptr < r.va + self.bytes(r.pages) {
                match r.use_ {
                    Use::Alloc => {
                        return Error::InteriorPointer { ptr, base: r.va, offset: ptr - r.va };
                    }
                    Use::Arena | Use::Carved => {
                        let arenas = if r.use_ == Use::Arena { &self.sub } else { &self.carved };
                        if let Some((off, _)) = arenas.block_containing(id, ptr - r.va) {
                            let base = r.va + off;
                            if base != ptr {
                                return Error::InteriorPointer { ptr, base, offset: ptr - base };
                            }
                        }
                    }
                    Use::Cached { .. } | Use::Pending | Use::PendingArena => {}
                }
            }
        }
        if self.live.freed_lately(ptr) {
            Error::DoubleFree { ptr }
        } else {
            Error::UnknownPointer { ptr }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn tables_grow_ahead_once_half_their_room_is_gone() {
        assert_eq!(room_to_add(0, 0), Some(TABLE_HEADROOM));
        assert_eq!(room_to_add(0, TABLE_HEADROOM), None);
        assert_eq!(room_to_add(40, 64), Some(TABLE_HEADROOM), "24 left, under 32");
        assert_eq!(room_to_add(100, 150), None, "50 left of 100");
        assert_eq!(room_to_add(100, 140), Some(100));
        assert_eq!(room_to_add(10, 4), Some(TABLE_HEADROOM), "a capacity below the length");
    }

    #[test]
    fn growing_ahead_gives_every_request_table_room_and_is_idempotent() {
        let lim = Limits {
            page: 1,
            cap: 1 << 20,
            max_chunk_pages: 1,
            repeated_chunk_pages: 1,
            large_chunk_pages: 1,
            largest_chunk_pages: 1,
            reserve_bytes: 1 << 20,
            va_limit: 1 << 30,
            unmap_batch_ranges: 8,
            unmap_batch_bytes: 1 << 20,
            unmap_run_handles: 0,
            unmap_batch_age: std::time::Duration::from_millis(50),
            window_slab_pages: 1,
            reuse_addresses: true,
            near_fit_per_1024: 128,
            carve_per_1024: 0,
            carve_repeated_per_1024: 0,
            grow_first_per_1024: 0,
            defer_free_events: false,
        };
        let mut h = Heap::new(lim);
        let caps = |h: &Heap| {
            (h.live.allocs.capacity(), h.ranges.slots.capacity(), h.live.recent_free_gen.capacity())
        };
        assert_eq!(caps(&h), (0, 0, 0), "a new heap holds no room yet");
        h.grow_tables_ahead();
        let grown = caps(&h);
        assert!(
            grown.0 >= TABLE_HEADROOM && grown.1 >= TABLE_HEADROOM && grown.2 >= TABLE_HEADROOM
        );
        h.grow_tables_ahead();
        assert_eq!(caps(&h), grown, "room enough: nothing grows again");
    }
}
