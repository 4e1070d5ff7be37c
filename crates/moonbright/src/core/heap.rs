//! The heap: MoonBright's allocator state and every policy decision, always used under the
//! allocator's lock and never calling the driver itself. Fast paths (a stream's own pending frees,
//! the cache of freed ranges, the mapped window, sub-page arenas) complete here; everything that
//! needs the driver is turned into a plan (`mapping.rs`) whose outcome is committed here.

use std::collections::{hash_map::Entry, BTreeMap, BTreeSet, VecDeque};

// Keys are the allocator's own pointers and ids, hashed on every request: a fast hash, not a
// DoS-resistant one.
use foldhash::{HashMap, HashMapExt};

use super::chunks::Chunks;
use super::history::{
    shown_stream, BlockInfo, BlockState, History, HistoryAction, HistoryEvent, SegmentInfo,
};
use super::mapping::{Executed, MapPlan};
use super::pool::{chunk_plan, ChunkId, Pool};
use super::sizes::RecentSizes;
use super::stats::Stats;
use super::streams::{Pending, Streams};
use super::subpage::{Emptied, Owner, SubPage, SUBPAGE_ALIGN};
use super::vaspace::{Retired, UnmapRun, VaSpace};
use super::window::Window;
use crate::driver::{ChunkHandle, DriverError, EventHandle};
use crate::error::{Error, Result};

mod growable;
use growable::Growable;
pub(crate) use growable::Resize;

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

/// How many recently freed pointers are remembered to tell a double free from an unknown pointer.
const RECENT_FREES: usize = 4096;
/// Room the tables requests insert into keep beyond what they hold, at least, once the worker
/// has grown them ahead (`grow_tables_ahead`).
const TABLE_HEADROOM: usize = 64;

/// The entries to reserve in a table of `len` entries and room for `cap`: none while at least
/// half of `max(len, TABLE_HEADROOM)` is free, else that many.
fn room_to_add(len: usize, cap: usize) -> Option<usize> {
    let room = len.max(TABLE_HEADROOM);
    (cap.saturating_sub(len) < room / 2).then_some(room)
}

/// A whole window chunk up to 1/8 larger than a fresh request serves it (no driver call).
const WINDOW_FIT_DIVISOR: u64 = 8;

/// A run of chunks split off a cached range may hold up to 1/SPLIT_SLACK more than the request,
/// where no run holds it exactly.
const SPLIT_SLACK: u64 = 64;

/// A run of chunks in a cached range: (its cache sequence number, first chunk, one past the last).
type CachedRun = (u64, usize, usize);

/// Cached ranges and groups of cached neighbours a new carved arena is chosen from (the smallest
/// first), and the chunks looked at in all. The search runs under the lock on every miss that
/// the cache serves no other way while the budget has room; with 64 of each and 2,048 chunks
/// it took 9 µs a call on the host backend (2-core machine, GPT-2's trace) and raised the
/// trace's alloc p99 by a third, for no fewer maps (session 34).
const CARVE_RANGES: usize = 16;
const CARVE_GROUPS: usize = 8;
const CARVE_CHUNKS_SEEN: usize = 512;

/// A repeated size's carving budget (`Options::carve_repeated`) is of the lesser of the peak
/// bytes in use and this many times the headroom below the peak: whole up to half the peak,
/// none at the peak. A training step reaches its peak every step, and the pages a carving near
/// it leaves unused are held there; a random mix stays near its peak, where a taper would
/// turn carving off, so other sizes' budget has none (docs/design.md, "Carved arenas").
const CARVE_TAPER: u64 = 2;

/// Where a carved arena is cut from: a cached range (its sequence number), or a group of cached
/// neighbours (its start and end).
#[derive(Clone, Copy)]
enum Carve {
    Range(u64),
    Group(u64, u64),
}

/// A carved arena's largest size: the sub-page allocator's extents keep lengths in 32 bits.
const CARVED_ARENA_LIMIT: u64 = 1 << 31;

/// Cached ranges, smallest first, that a request looks into for a run of chunks to split off,
/// and the chunks it looks at in all: a miss that then maps anyway pays for the search under
/// the heap lock, so the search is bounded (a few microseconds).
const SPLIT_CANDIDATES: usize = 64;
const SPLIT_CHUNKS_SEEN: usize = 2048;

/// Chunks a request that found no run in any one cached range looks at in all, in groups of
/// cached neighbours large enough, smallest first, for a run across them (`Heap::split_joined`).
const JOIN_CHUNKS_SEEN: usize = 512;

/// Cached ranges, least recently freed first, a plan looks into for the one with the largest
/// chunk no larger than what it still needs (`Heap::fitting_cached`) each time it steals one,
/// and in all: the search runs under the heap lock.
const STEAL_CANDIDATES: usize = 256;
const STEAL_LOOKS: usize = 1024;

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

/// The first run of consecutive chunks, of `size(i)` pages each for `i` below `len`, that holds
/// at least `pages` pages and at most `most`: (first, one past the last).
fn chunk_run(
    len: usize,
    size: impl Fn(usize) -> u64,
    pages: u64,
    most: u64,
) -> Option<(usize, usize)> {
    let (mut end, mut sum) = (0, 0);
    for start in 0..len {
        // The shortest run from `start` that holds the request.
        while end < len && sum < pages {
            sum += size(end);
            end += 1;
        }
        if sum < pages {
            return None;
        }
        if sum <= most {
            return Some((start, end));
        }
        sum -= size(start);
    }
    None
}

/// The run of consecutive items (of `len`, each `size(i)` pages) that holds `pages` with the
/// fewest to spare, the last such (carving then leaves the range's front cached, as a split
/// does): (first, one past the last, spare pages). Each run looked at is the shortest from its
/// start, so the spare is less than its first item and its last.
fn tightest_run(
    len: usize,
    size: impl Fn(usize) -> u64,
    pages: u64,
) -> Option<(usize, usize, u64)> {
    let (mut end, mut sum, mut best) = (0, 0, None::<(usize, usize, u64)>);
    for start in 0..len {
        while end < len && sum < pages {
            sum += size(end);
            end += 1;
        }
        if sum < pages {
            break;
        }
        if best.map_or(true, |b| sum - pages <= b.2) {
            best = Some((start, end, sum - pages));
        }
        sum -= size(start);
    }
    best
}

/// Events a stream keeps recorded and unpolled before its frees record its newest one again
/// (`StreamFrees::event_to_record`): a burst of frees between two polls neither drains the
/// event stock nor lists an event a free.
const EVENTS_IN_FLIGHT: usize = 8;

/// What a mapped range is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    /// Backs one allocation of a page or more.
    Alloc,
    /// An arena of the sub-page allocator.
    Arena,
    /// A carved arena: blocks of a page or more cut out of a cached range (`Options::carve`).
    Carved,
    /// Freed on a stream whose work may still use it: only that stream may reuse it.
    Pending,
    /// An arena with no block in use whose space one stream still holds (`Emptied::held`): as
    /// `Pending`, but its blocks' frees are in the history already, and no allocation's is.
    PendingArena,
    /// Free, still mapped, reusable as it is; `seq` orders the cache from least recently freed.
    Cached { seq: u64 },
}

/// Chunks mapped back to back at `va`.
#[derive(Clone, Debug)]
struct Range {
    va: u64,
    pages: u64,
    chunks: Chunks,
    use_: Use,
}

/// Where a live allocation lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backing {
    Range(RangeId),
    Sub { arena: RangeId, offset: u64 },
}

#[derive(Clone, Debug)]
struct Live {
    size: u64,
    rounded: u64,
    stream: u64,
    backing: Backing,
    /// Other streams whose work uses it (`record_use`), if any: a free on a stream waits for
    /// them too.
    uses: Vec<u64>,
    /// Freed by its user into the graph pool that owns it (`pool_keep`): still the pool's and
    /// mapped, but no longer counted as allocated or active, nor shown as a block in use.
    pooled: bool,
}

/// What a plan in flight, or a release in flight, holds until it commits.
#[derive(Debug, Default)]
struct Claim {
    /// Chunks neither bare nor in a range meanwhile.
    chunks: Vec<ChunkId>,
    /// The plan's fresh addresses (va, len); none for a release.
    va: Option<(u64, u64)>,
    /// Chunks it took from its stream's pending frees: (chunk, stream, epoch). If the plan
    /// fails they are quarantined, not made bare.
    same_stream: Vec<(ChunkId, u64, u64)>,
}

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

/// What `Heap::take_exact` found: a range, or the near run (a cached range's seq, and the
/// run's first and last chunk) its search found for `take_near`.
enum Taken {
    Range(RangeId),
    Missed { near_run: Option<CachedRun> },
}

/// The outcome of a fast-path attempt.
#[derive(Debug)]
pub(crate) enum Fast {
    /// Served: the pointer.
    Done(u64),
    /// A range of this many pages is needed (for an allocation, or a new arena).
    NeedRange { pages: u64, arena: bool },
}

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
    streams: Streams,
    window: Window,
    /// The address slab the window grows in: (next, end).
    window_slab: (u64, u64),
    ranges: Vec<Option<Range>>,
    free_range_ids: Vec<RangeId>,
    /// Live, pending and cached ranges by base address.
    by_va: BTreeMap<u64, RangeId>,
    /// Cached ranges as (pages, address, seq), seq -> range in freeing order, and address ->
    /// (seq, pages, range).
    cached_by_size: BTreeSet<(u64, u64, u64)>,
    cached_lru: BTreeMap<u64, RangeId>,
    cached_by_va: BTreeMap<u64, (u64, u64, RangeId)>,
    /// Groups of cached neighbours: each run of two or more cached ranges back to back in one
    /// reservation, as start -> end, and as (pages, start) for `split_joined`, which so finds
    /// the smallest group large enough with no scan of the cache.
    cached_groups: BTreeMap<u64, u64>,
    cached_groups_by_size: BTreeSet<(u64, u64)>,
    cached_pages: u64,
    next_seq: u64,
    live: HashMap<u64, Live>,
    /// Recently freed pointers, to tell a double free from an unknown pointer: pointer -> the
    /// generation of its last free, and the frees in order (stale entries are skipped when
    /// they reach the front), so both remembering and forgetting cost O(1).
    recent_frees: VecDeque<(u64, u64)>,
    recent_free_gen: HashMap<u64, u64>,
    free_generation: u64,
    /// What plans and releases in flight hold, by plan id.
    inflight: HashMap<u64, Claim>,
    /// Chunks that only become bare once their stream's epoch has completed.
    quarantine: Vec<(ChunkId, u64, u64)>,
    inflight_create_pages: u64,
    next_plan: u64,
    /// Retired runs being unmapped with the lock released.
    unmapping: usize,
    /// Those of them inside growables' private reservations: (va, len).
    unmapping_private: Vec<(u64, u64)>,
    /// Growable allocations by base address (released ones until their addresses are unmapped).
    growables: BTreeMap<u64, Growable>,
    /// Pages served at fresh addresses (window or new mapping) since the mapper last looked.
    fresh_pages: u64,
    /// The largest of those requests since then, in pages (what the mapper shapes whole
    /// window chunks by).
    fresh_largest: u64,
    /// When a request last finished mapping a range itself (the mapper keeps out of its way).
    last_request_map: Option<crate::sync::Instant>,
    /// Events the background worker created ahead of need, for frees on any stream that has no
    /// spare event of its own, so that a burst of frees records events without creating them.
    event_stock: Vec<EventHandle>,
    /// Frees on streams (and shrinks) whose own event records are still to be settled: until
    /// then their pages are neither free nor covered by an event anyone could wait for.
    records_in_flight: u32,
    stats: Stats,
    /// The last driver error met outside a request (a deferred unmap, say).
    deferred_error: Option<DriverError>,
    /// The bytes held when the cap was last lowered below them: held memory may exceed the cap
    /// until frees and releases bring it under, but never grows past this (the headroom is 0
    /// while over the cap).
    over_cap: Option<u64>,
    history: Option<History>,
    /// Sizes of recent requests of a page or more: carving's larger budget for repeated sizes
    /// (`Options::carve_repeated`).
    sizes: RecentSizes,
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
            window: Window::new(lim.page),
            window_slab: (0, 0),
            ranges: Vec::new(),
            free_range_ids: Vec::new(),
            by_va: BTreeMap::new(),
            cached_by_size: BTreeSet::new(),
            cached_lru: BTreeMap::new(),
            cached_by_va: BTreeMap::new(),
            cached_groups: BTreeMap::new(),
            cached_groups_by_size: BTreeSet::new(),
            cached_pages: 0,
            next_seq: 0,
            live: HashMap::new(),
            recent_frees: VecDeque::new(),
            recent_free_gen: HashMap::new(),
            free_generation: 0,
            inflight: HashMap::new(),
            quarantine: Vec::new(),
            inflight_create_pages: 0,
            next_plan: 0,
            unmapping: 0,
            unmapping_private: Vec::new(),
            growables: BTreeMap::new(),
            fresh_pages: 0,
            fresh_largest: 0,
            last_request_map: None,
            event_stock: Vec::new(),
            records_in_flight: 0,
            stats: Stats::default(),
            deferred_error: None,
            over_cap: None,
            history: None,
            sizes: RecentSizes::default(),
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
        let held = self.bytes(self.pool.held_pages() + self.inflight_create_pages);
        self.over_cap = (held > cap).then_some(held);
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn reset_peaks(&mut self) {
        self.stats.reset_peaks();
    }

    pub fn take_deferred_error(&mut self) -> Option<DriverError> {
        self.deferred_error.take()
    }

    pub fn note_deferred_error(&mut self, e: DriverError) {
        self.stats.deferred_errors += 1;
        self.deferred_error = Some(e);
    }

    /// The usable size of a live allocation (its rounded size), if `ptr` is one.
    pub fn usable_size(&self, ptr: u64) -> Option<u64> {
        self.live.get(&ptr).map(|l| l.rounded)
    }

    /// What exporting the live allocation (or growable) at `ptr` shares (`Allocator::export`):
    /// the chunks that back it, in address order, as (handle, bytes); where it starts in the
    /// first; and its size. An allocation below a page shares its arena's page. A growable
    /// shares the chunks committed now. Refuses any other pointer as `free` would.
    pub fn shared_chunks(&self, ptr: u64) -> Result<SharedChunks> {
        let chunks = |ids: &[ChunkId]| -> Vec<(ChunkHandle, u64)> {
            ids.iter()
                .map(|&c| (self.pool.get(c).handle, self.bytes(self.pool.get(c).pages)))
                .collect()
        };
        if let Some(live) = self.live.get(&ptr).filter(|l| !l.pooled) {
            let (id, offset) = match live.backing {
                Backing::Range(id) => (id, 0),
                Backing::Sub { arena, offset } => (arena, offset),
            };
            let r = self.range(id);
            return Ok(SharedChunks { chunks: chunks(&r.chunks), offset, size: live.size });
        }
        if let Ok(g) = self.live_growable(ptr) {
            if g.chunks.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "growable allocation {ptr:#x} has no memory committed to share; resize it first"
                )));
            }
            return Ok(SharedChunks { chunks: chunks(&g.chunks), offset: 0, size: g.size });
        }
        Err(self.classify_bad_free(ptr))
    }

    fn range(&self, id: RangeId) -> &Range {
        self.ranges[id as usize].as_ref().expect("no such range")
    }

    fn range_mut(&mut self, id: RangeId) -> &mut Range {
        self.ranges[id as usize].as_mut().expect("no such range")
    }

    fn bytes(&self, pages: u64) -> u64 {
        pages * self.lim.page
    }

    // ---- history --------------------------------------------------------------------------------

    /// Starts recording up to `max` events (dropping the oldest), or stops with `None`.
    pub fn set_history(&mut self, max: Option<usize>) {
        self.history = max.map(|m| History::new(m, crate::sync::Instant::now()));
    }

    /// The events recorded so far.
    pub fn history(&self) -> Vec<HistoryEvent> {
        self.history.as_ref().map(History::events).unwrap_or_default()
    }

    fn note(&mut self, action: HistoryAction, addr: u64, size: u64, stream: u64) {
        if let Some(h) = &mut self.history {
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
            return self.take_range_fast(1, stream).map(|id| match id {
                Some(id) => Fast::Done(self.start_arena(id, size, stream)),
                None => Fast::NeedRange { pages: 1, arena: true },
            });
        }
        let pages = size.div_ceil(self.lim.page);
        if let Some(ptr) = self.take_carved(size, pages, stream) {
            return Ok(Fast::Done(ptr));
        }
        let near_run = match self.take_exact(pages, stream) {
            Taken::Range(id) => return Ok(Fast::Done(self.finish_range(id, size, stream))),
            Taken::Missed { near_run } => near_run,
        };
        if let Some(id) = self.take_near(pages, near_run) {
            return Ok(Fast::Done(self.finish_range(id, size, stream)));
        }
        let repeated = self.tells_repeated() && self.sizes.contains(size);
        if let Some(ptr) = self.start_carving(size, pages, stream, repeated) {
            return Ok(Fast::Done(ptr));
        }
        Ok(Fast::NeedRange { pages, arena: false })
    }

    /// A block of `pages` pages from a carved arena (`Options::carve`), by best fit over their
    /// free extents that `stream` may take.
    fn take_carved(&mut self, size: u64, pages: u64, stream: u64) -> Option<u64> {
        if !self.carving() {
            return None;
        }
        let (arena, offset) = self.carved.alloc(self.bytes(pages), stream)?;
        let ptr = self.range(arena).va + offset;
        self.stats.carved_allocations += 1;
        self.stats.cache_hits += 1;
        self.finish_live(ptr, size, self.bytes(pages), stream, Backing::Sub { arena, offset });
        Some(ptr)
    }

    /// Whether carving is on (`Options::carve`; 0 turns it off, repeated sizes included).
    fn carving(&self) -> bool {
        self.lim.carve_per_1024 > 0
    }

    /// Whether requests' sizes are kept (`sizes`), for carving's budget for repeated sizes
    /// (none: every size carves under `carve_per_1024`).
    fn tells_repeated(&self) -> bool {
        self.carving() && self.lim.carve_repeated_per_1024 > 0
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

    /// Carves a request out of a mapped run of cached chunks where it lies: of the smallest
    /// cached ranges larger than `pages`, and then of the smallest groups of cached neighbours
    /// (`cached_groups`), the run of consecutive chunks that holds the request with the fewest
    /// pages to spare (`tightest_run`; the smaller range or group on a tie) becomes a carved
    /// arena, and the request is cut from its end. What lies before and after the run stays
    /// cached, so what the arena leaves unused lies inside its first chunk; and the run is
    /// taken only if the carved arenas' unused bytes then stay within the budget: of the peak
    /// bytes in use (what held memory is measured against; a training step's low points would
    /// otherwise carve nothing), `carve_per_1024`; for a size a recent request had
    /// (`repeated`), `carve_repeated_per_1024` of the peak or of `CARVE_TAPER` times the
    /// headroom below it, whichever is less.
    fn start_carving(&mut self, size: u64, pages: u64, stream: u64, repeated: bool) -> Option<u64> {
        if !self.carving() {
            return None;
        }
        // The pages a new arena may leave unused; none left, no search (most misses in a
        // repeated training step's later passes, where carving has used up the budget).
        let now = self.stats.active_bytes.current + self.bytes(pages);
        let peak = self.stats.active_bytes.peak.max(now);
        let budget = if repeated {
            peak.min(CARVE_TAPER * (peak - now)) / 1024 * self.lim.carve_repeated_per_1024
        } else {
            peak / 1024 * self.lim.carve_per_1024
        };
        let allowed = budget.checked_sub(self.carved.free_bytes())? / self.lim.page;
        // (spare pages, where the run lies: a cached range's sequence number, or the start
        // and end of a group of cached neighbours; the run's first chunk and one past its
        // last, in those ranges' chunks).
        // A range or group with more chunks than are left to look at is looked at in part: a
        // range's last chunks, a group's first.
        let mut best: Option<(u64, Carve, usize, usize)> = None;
        // Takes the tightest run of `len` chunks (of `size(i)` pages, the first at `skip`) in
        // place of the best so far if it spares fewer pages, and no more than allowed.
        let mut consider = |at: Carve, skip: usize, len: usize, size: &dyn Fn(usize) -> u64| {
            if let Some((a, b, spare)) = tightest_run(len, size, pages) {
                if spare <= allowed && best.map_or(true, |b| spare < b.0) {
                    best = Some((spare, at, skip + a, skip + b));
                }
            }
            best.is_some_and(|b| b.0 == 0)
        };
        let mut seen = 0;
        // A run that spares nothing ends the search.
        'search: {
            for &(_, _, seq) in self.cached_by_size.range((pages + 1, 0, 0)..).take(CARVE_RANGES) {
                if seen >= CARVE_CHUNKS_SEEN {
                    break;
                }
                let chunks = &self.range(self.cached_lru[&seq]).chunks;
                let skip = chunks.len().saturating_sub(CARVE_CHUNKS_SEEN - seen);
                seen += chunks.len() - skip;
                let size = |i: usize| self.pool.get(chunks[skip + i]).pages;
                if consider(Carve::Range(seq), skip, chunks.len() - skip, &size) {
                    break 'search;
                }
            }
            let mut ids: Vec<ChunkId> = Vec::new();
            for &(p, start) in self.cached_groups_by_size.range((pages + 1, 0)..).take(CARVE_GROUPS)
            {
                if seen >= CARVE_CHUNKS_SEEN {
                    break;
                }
                let end = start + self.bytes(p);
                ids.clear();
                for (_, &(_, _, id)) in self.cached_by_va.range(start..end) {
                    if ids.len() >= CARVE_CHUNKS_SEEN - seen {
                        break;
                    }
                    ids.extend(self.range(id).chunks.iter().copied());
                }
                ids.truncate(CARVE_CHUNKS_SEEN - seen);
                seen += ids.len();
                let size = |i: usize| self.pool.get(ids[i]).pages;
                if consider(Carve::Group(start, end), 0, ids.len(), &size) {
                    break 'search;
                }
            }
        }
        let (spare, at, a, b) = best?;
        if self.bytes(pages + spare) >= CARVED_ARENA_LIMIT {
            return None;
        }
        let group: Vec<u64> = match at {
            Carve::Range(seq) => vec![seq],
            Carve::Group(start, end) => {
                self.cached_by_va.range(start..end).map(|(_, &(seq, _, _))| seq).collect()
            }
        };
        let id = self.join_run(&group, a, b);
        let tail = pages + spare;
        self.stats.carved_arenas += 1;
        self.range_mut(id).use_ = Use::Carved;
        self.carved.add_arena(id, self.bytes(tail));
        self.take_carved(size, pages, stream)
    }

    /// A range of `pages` pages with no driver call, exact before near: one of exactly that size
    /// from the stream's own pending frees or the cache, the lowest address first; else a run of
    /// chunks of exactly that size split off a larger cached range (`split_cached`) or across
    /// cached neighbours (`split_joined`); else the smallest cached range up to `near_fit` larger
    /// (an eighth by default; the extra pages stay with the allocation until it is freed,
    /// counted as rounding); else a run up to `SPLIT_SLACK` larger split off a cached range;
    /// else the window. Lowest address first (not newest), so that the same requests in the
    /// same order get the same ranges back whether or not their frees have completed, as from
    /// PyTorch's allocator.
    ///
    /// Exact before near: extra pages held by live allocations are held at the peak too. With
    /// near fits before exact splits, ResNet-50's trace held 1.015 of its peak (host backend)
    /// against 1.010 now, its page-rounding floor plus its arenas' spare room (design.md,
    /// "Exact before near").
    fn take_range_fast(&mut self, pages: u64, stream: u64) -> Result<Option<RangeId>> {
        Ok(match self.take_exact(pages, stream) {
            Taken::Range(id) => Some(id),
            Taken::Missed { near_run } => self.take_near(pages, near_run),
        })
    }

    /// The exact half of `take_range_fast`: the stream's own pending frees, the cache, a run
    /// split off a cached range or across cached neighbours. A miss hands on the near run its
    /// search found, for `take_near`.
    fn take_exact(&mut self, pages: u64, stream: u64) -> Taken {
        let exact =
            self.cached_by_size.range((pages, 0, 0)..=(pages, u64::MAX, u64::MAX)).next().copied();
        let own = self.streams.get_mut(stream).and_then(|f| {
            let (va, seq) = f.peek_range(pages)?;
            (!exact.is_some_and(|c| c.1 < va)).then(|| f.take(seq))
        });
        if let Some(id) = own {
            self.streams.range_left(pages);
            let r = self.range(id);
            if r.use_ == Use::Pending {
                self.note(HistoryAction::FreeCompleted, r.va, self.bytes(pages), stream);
            }
            self.stats.cache_hits += 1;
            return Taken::Range(id);
        }
        if let Some((_, _, seq)) = exact {
            self.stats.cache_hits += 1;
            return Taken::Range(self.uncache(seq));
        }
        let (exact_run, near_run) = self.split_cached(pages);
        let exact_run = exact_run.map(|(seq, start, end)| self.split_off(seq, start, end));
        if let Some(id) = exact_run.or_else(|| self.split_joined(pages)) {
            self.stats.cache_hits += 1;
            return Taken::Range(id);
        }
        Taken::Missed { near_run }
    }

    /// The near half of `take_range_fast`: a cached range up to `near_fit` larger, whole; a
    /// run up to `SPLIT_SLACK` larger split off a cached range; the window.
    fn take_near(&mut self, pages: u64, near_run: Option<CachedRun>) -> Option<RangeId> {
        let slack = pages * self.lim.near_fit_per_1024 / 1024;
        let near = self.cached_by_size.range((pages + 1, 0, 0)..(pages + slack + 1, 0, 0)).next();
        if let Some(&(_, _, seq)) = near {
            self.stats.cache_hits += 1;
            return Some(self.uncache(seq));
        }
        if let Some((seq, start, end)) = near_run {
            self.stats.cache_hits += 1;
            return Some(self.split_off(seq, start, end));
        }
        if let Some((va, got, chunks)) = self.window.take(pages, pages + pages / WINDOW_FIT_DIVISOR)
        {
            self.stats.window_hits += 1;
            self.stats.window_bytes.sub(self.bytes(got));
            self.note_fresh(pages, got);
            return Some(self.add_range(va, got, chunks, Use::Alloc));
        }
        None
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
        self.last_request_map = Some(crate::sync::Instant::now());
        if arena {
            self.start_arena(id, size, stream)
        } else {
            self.finish_range(id, size, stream)
        }
    }

    /// Counts a request of `asked` pages served `got` pages at fresh addresses (the mapper's
    /// measure of demand).
    fn note_fresh(&mut self, asked: u64, got: u64) {
        self.fresh_pages += got;
        self.fresh_largest = self.fresh_largest.max(asked);
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
            self.sizes.insert(size);
        }
        self.recent_free_gen.remove(&ptr);
        self.note(HistoryAction::Alloc, ptr, size, stream);
        let live = Live { size, rounded, stream, backing, uses: Vec::new(), pooled: false };
        let prev = self.live.insert(ptr, live);
        debug_assert!(prev.is_none(), "pointer handed out twice");
    }

    /// Grows the tables requests insert into (live allocations, ranges, recent frees) ahead of
    /// need, on the worker's time: a table grows on the insert that fills it, rehashing or
    /// copying every entry, and a fresh allocator's 4th, 8th, 15th and 29th window hits took
    /// 2-3.6 µs on the host backend against 0.3-0.5 for the others
    /// (`bench/results/h200-session20/n7-`). Once less than half its room is left, a table is
    /// grown to hold twice its entries (at least `TABLE_HEADROOM` more), so a burst of requests
    /// between two of the worker's ticks does not grow it.
    pub fn grow_tables_ahead(&mut self) {
        if let Some(n) = room_to_add(self.live.len(), self.live.capacity()) {
            self.live.reserve(n);
        }
        if let Some(n) = room_to_add(self.ranges.len(), self.ranges.capacity()) {
            self.ranges.reserve(n);
        }
        let (len, cap) = (self.recent_free_gen.len(), self.recent_free_gen.capacity());
        if let Some(n) = room_to_add(len, cap) {
            self.recent_free_gen.reserve(n.min(RECENT_FREES));
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
        let live = match self.live.entry(ptr) {
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
        let Some(live) = self.live.get_mut(&ptr).filter(|l| !l.pooled) else { return };
        live.pooled = true;
        let (size, rounded) = (live.size, live.rounded);
        self.uncount(size, rounded);
    }

    /// A graph pool hands its kept block at `ptr` to a request of `size` bytes on `stream`: it
    /// counts as allocated again. Does nothing to a block not kept.
    pub fn pool_reuse(&mut self, ptr: u64, size: u64, stream: u64) {
        let Some(live) = self.live.get_mut(&ptr).filter(|l| l.pooled) else { return };
        live.pooled = false;
        live.size = size.min(live.rounded);
        live.stream = stream;
        let (size, rounded) = (live.size, live.rounded);
        self.count(size, rounded);
    }

    /// A graph pool makes its kept block at `ptr` live again as it was (a checkpointed pool
    /// state set back), for `stream`: it counts as allocated again, with the size last asked.
    pub fn pool_revive(&mut self, ptr: u64, stream: u64) {
        let Some(size) = self.live.get(&ptr).filter(|l| l.pooled).map(|l| l.size) else { return };
        self.pool_reuse(ptr, size, stream);
    }

    /// Remembers a freed pointer, to tell a double free from an unknown pointer.
    fn remember_free(&mut self, ptr: u64) {
        if self.recent_frees.len() == RECENT_FREES {
            if let Some((old, generation)) = self.recent_frees.pop_front() {
                if self.recent_free_gen.get(&old) == Some(&generation) {
                    self.recent_free_gen.remove(&old);
                }
            }
        }
        self.free_generation += 1;
        self.recent_frees.push_back((ptr, self.free_generation));
        self.recent_free_gen.insert(ptr, self.free_generation);
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
        let Some(live) = self.live.get_mut(&ptr) else {
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
            return Ok(Freed::CheckUses(self.live[&ptr].uses.clone()));
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
        self.records_in_flight += 1;
        let spare = self
            .streams
            .entry(stream)
            .event_to_record(EVENTS_IN_FLIGHT)
            .or_else(|| self.event_stock.pop());
        (stream, epoch, spare)
    }

    /// How many events the stock lacks, once it is down to half of `target` (0 otherwise).
    pub fn event_stock_wanted(&self, target: usize) -> usize {
        if self.event_stock.len() <= target / 2 {
            target - self.event_stock.len()
        } else {
            0
        }
    }

    /// Takes out the events the stock holds beyond `target`, once it holds more than twice
    /// that: events of forgotten streams come back to the stock, and a burst of many streams
    /// would otherwise leave thousands created for good.
    pub fn event_stock_excess(&mut self, target: usize) -> Vec<EventHandle> {
        if self.event_stock.len() > 2 * target {
            self.event_stock.split_off(target)
        } else {
            Vec::new()
        }
    }

    /// Events in the stock.
    pub fn events_stocked(&self) -> usize {
        self.event_stock.len()
    }

    /// Adds events created ahead of need to the stock.
    pub fn stock_events(&mut self, events: Vec<EventHandle>) {
        self.event_stock.extend(events);
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
            self.records_in_flight -= 1;
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
        let mut out = Vec::new();
        for (s, f) in self.streams.iter_mut() {
            if f.needs_event() {
                let epoch = f.newest_epoch().expect("a stream with frees has an epoch");
                let ev = f.event_to_record(EVENTS_IN_FLIGHT).or_else(|| self.event_stock.pop());
                out.push((s, epoch, ev));
            }
        }
        out
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
        self.quarantine.retain(|q| {
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
                    let (&va, &arena) =
                        self.by_va.range(..=ptr).next_back().expect("block's arena");
                    self.release_backing(Backing::Sub { arena, offset: ptr - va });
                }
                // A growable's shrink (its chunks left the quarantine above), or a joined free's
                // mark on this stream (the free itself completes with its last mark).
                Pending::Mark => {}
            }
        }
        if let Some(spare) = self.streams.forget_if_idle(stream) {
            self.event_stock.extend(spare);
        }
    }

    /// Whether some plan holds claimed chunks or addresses while it runs, or a free's own event
    /// record is still to be settled: a request short of memory waits for either.
    pub fn has_inflight(&self) -> bool {
        !self.inflight.is_empty() || self.records_in_flight > 0
    }

    /// Whether frees on streams are still waiting for their events.
    pub fn has_pending_frees(&self) -> bool {
        self.streams.any_pending() || !self.quarantine.is_empty()
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

    /// Gives the whole chunks that lie in free space of carved arenas back (`uncarve`), for
    /// the arenas where free space grew.
    fn uncarve_freed(&mut self) {
        for id in self.carved.take_freed() {
            self.uncarve(id);
        }
    }

    /// Cuts every run of whole chunks that lies in one free extent of carved arena `id` out of
    /// it, where it is mapped: so pages no block uses are held in carved arenas only in chunks
    /// a block also uses, and the cache can serve, join, or steal the rest. A run of open space
    /// is cached; one held for a stream goes pending for it until that epoch, as an arena
    /// emptied by its frees does, so it comes back to the stream the same whether or not the
    /// free has completed (Address stability). What is left on either side stays a carved arena
    /// (the part before the run keeps the range's id; a part after gets a new one, and its
    /// blocks move to it). Done as frees come, not as they complete, for the same reason.
    fn uncarve(&mut self, id: RangeId) {
        let cuts = self.free_chunk_runs(id);
        // From the end, so the cuts still to make keep their offsets in `id`.
        for (start, end, owner) in cuts.into_iter().rev() {
            if end < self.bytes(self.range(id).pages) {
                let after = self.split_range_at(id, end);
                self.carved.split_arena(id, end, after);
                let va = self.range(after).va;
                // Its blocks move with it (a block whose joined free is pending is not live:
                // it is found by address when the free completes).
                for off in self.carved.used_offsets(after) {
                    if let Some(live) = self.live.get_mut(&(va + off)) {
                        live.backing = Backing::Sub { arena: after, offset: off };
                    }
                }
            }
            let run = if start > 0 {
                let run = self.split_range_at(id, start);
                self.carved.split_arena(id, start, run);
                run
            } else {
                id
            };
            self.stats.carved_chunks_uncarved += self.range(run).chunks.len() as u64;
            self.arena_emptied(Emptied {
                arena: run,
                held: match owner {
                    Owner::Open => None,
                    Owner::Held { stream, epoch } => Some((stream, epoch)),
                },
            });
        }
    }

    /// The runs of whole chunks that lie in one free extent of carved arena `id`, as (start,
    /// end, the extent's owner) in address order.
    fn free_chunk_runs(&self, id: RangeId) -> Vec<(u64, u64, Owner)> {
        let free = self.carved.free_extents(id);
        if free.is_empty() {
            return Vec::new();
        }
        let mut bounds = vec![0];
        for &c in self.range(id).chunks.iter() {
            bounds.push(bounds[bounds.len() - 1] + self.bytes(self.pool.get(c).pages));
        }
        free.into_iter()
            .filter_map(|(off, len, owner)| {
                let first = *bounds.iter().find(|&&b| b >= off)?;
                let last = *bounds.iter().rev().find(|&&b| b <= off + len)?;
                (first < last).then_some((first, last, owner))
            })
            .collect()
    }

    /// Cuts range `id` at `at` bytes (a boundary between its chunks): it keeps what lies
    /// before, and what lies after becomes a new range of the same use (returned).
    fn split_range_at(&mut self, id: RangeId, at: u64) -> RangeId {
        let pages = at / self.lim.page;
        let r = self.range(id);
        let (va, total, use_) = (r.va, r.pages, r.use_);
        let mut acc = 0;
        let k = r
            .chunks
            .iter()
            .position(|&c| {
                let here = acc == pages;
                acc += self.pool.get(c).pages;
                here
            })
            .expect("a cut at a chunk boundary inside the range");
        let mut ids =
            std::mem::replace(&mut self.range_mut(id).chunks, Chunks::from(Vec::new())).into_vec();
        let after = ids.split_off(k);
        let r = self.range_mut(id);
        r.chunks = Chunks::from(ids);
        r.pages = pages;
        self.add_range(va + at, total - pages, Chunks::from(after), use_)
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
        if let Some((_, &id)) = self.by_va.range(..=ptr).next_back() {
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
        if self.recent_free_gen.contains_key(&ptr) {
            Error::DoubleFree { ptr }
        } else {
            Error::UnknownPointer { ptr }
        }
    }

    // ---- planning new ranges --------------------------------------------------------------------

    /// Free pages under the cap that no plan has claimed. A chunk being released still counts
    /// as held until its release commits: another plan that created in its place could run
    /// before the release and take the device past the cap (or out of memory).
    fn headroom(&self) -> u64 {
        let held = self.pool.held_pages() + self.inflight_create_pages;
        (self.lim.cap / self.lim.page).saturating_sub(held)
    }

    /// The step for a request of `stream` `short` pages short of `requested` bytes: wait if
    /// work in flight may free some; try the fast paths again if the request now fits in an
    /// arena, sub-page or carved (another thread's arena committed since this one missed, or a
    /// block it waited for came back), as arena space is found by nothing else; else out of
    /// memory. A growable's growth (`arenas` false) takes no arena space: waiting for it would
    /// never end.
    fn short_of(&self, requested: u64, short: u64, stream: u64, arenas: bool) -> Step {
        let rounded = requested.next_multiple_of(SUBPAGE_ALIGN);
        let arena_fits = if !arenas {
            false
        } else if requested < self.lim.page {
            self.sub.fits(rounded, stream)
        } else {
            self.carving() && self.carved.fits(requested.next_multiple_of(self.lim.page), stream)
        };
        if self.has_inflight() || arena_fits {
            Step::Wait
        } else {
            Step::OutOfMemory(self.out_of_memory(requested, short))
        }
    }

    /// Held pages no allocation uses, outside the window: bare chunks and cached ranges.
    pub fn free_held_pages(&self) -> u64 {
        self.pool.bare_pages() + self.cached_pages
    }

    /// Pages free for a new range right now, wherever they are.
    fn free_pages(&self) -> u64 {
        self.pool.bare_pages() + self.cached_pages + self.window.pages() + self.headroom()
    }

    /// Pages free for a new range on `stream`: those free for everyone, and the chunks the
    /// stream itself gave back that wait in the quarantine.
    fn free_pages_for(&self, stream: u64) -> u64 {
        let own: u64 = self
            .quarantine
            .iter()
            .filter(|q| q.1 == stream)
            .map(|q| self.pool.get(q.0).pages)
            .sum();
        let pending = self.streams.get(stream).map_or(0, |f| f.range_pages());
        self.free_pages() + own + pending
    }

    /// Plans a new range of `pages` pages at a fresh address, claiming what it uses.
    pub fn plan_range(&mut self, pages: u64, requested: u64, stream: u64) -> Step {
        let free = self.free_pages_for(stream);
        if free < pages {
            return self.short_of(requested, pages - free, stream, true);
        }
        let len = self.bytes(pages);
        let Some(va) = self.va.take_fresh(len) else {
            if self.va.unmap_could_free(len) || self.unmapping > self.unmapping_private.len() {
                self.stats.flushes_for_addresses += 1;
                return Step::Flush(None);
            }
            let size = self.lim.reserve_bytes.max(len);
            let reserved = self.va.reserved_bytes();
            if reserved + size > self.lim.va_limit {
                return Step::OutOfMemory(Error::AddressSpaceExhausted {
                    reserved,
                    limit: self.lim.va_limit,
                });
            }
            return Step::Reserve(size);
        };
        self.plan_at(va, pages, requested, stream, true)
    }

    /// Plans `pages` pages of chunks mapped at `va` (fresh addresses, or a growable allocation's
    /// tail), claiming what it uses. If the plan cannot go ahead, `va` is recycled (a no-op for
    /// a growable's private addresses, which stay with it). `large`: new memory may come in
    /// chunks up to `large_chunk_pages` (not for growables, which shrink by whole chunks).
    fn plan_at(&mut self, va: u64, pages: u64, requested: u64, stream: u64, large: bool) -> Step {
        let len = self.bytes(pages);
        let mut got: Vec<ChunkId> = Vec::new();
        let mut same_stream: Vec<(ChunkId, u64, u64)> = Vec::new();
        let mut left = pages;
        // Where the search for a cached range worth stealing goes on from (`fitting_cached`).
        let mut steal_scan = (0, 0);
        loop {
            while left > 0 {
                match self.pool.take_bare_at_most(left) {
                    Some(c) => {
                        left -= self.pool.get(c).pages;
                        got.push(c);
                    }
                    None => break,
                }
            }
            if left == 0 {
                break;
            }
            if let Some(seq) = self.fitting_cached(&mut steal_scan, left) {
                self.steal_cached(seq);
                continue;
            }
            if self.steal_window(left) {
                continue;
            }
            // Chunks the stream itself gave back (a growable's shrink): stream order makes them
            // safe for it at once. If the plan fails they return to the quarantine.
            let own = self
                .quarantine
                .iter()
                .enumerate()
                .filter(|(_, q)| q.1 == stream && self.pool.get(q.0).pages <= left)
                .max_by_key(|(_, q)| self.pool.get(q.0).pages)
                .map(|(i, _)| i);
            if let Some(i) = own {
                let q = self.quarantine.swap_remove(i);
                left -= self.pool.get(q.0).pages;
                got.push(q.0);
                same_stream.push(q);
                continue;
            }
            // The stream's own pending frees: its later work is ordered after its earlier work,
            // so their pages may serve it now; the old addresses are unmapped only once the
            // earlier work has completed. Their chunks go straight into this range, never bare.
            if let Some((id, p, epoch)) =
                self.streams.get_mut(stream).and_then(|f| f.take_covered_range_at_most(left))
            {
                self.streams.range_left(p);
                let range = self.remove_range(id);
                left -= p;
                got.extend(range.chunks.iter().copied());
                same_stream.extend(range.chunks.iter().map(|&c| (c, stream, epoch)));
                self.stats.cached_ranges_stolen += 1;
                self.retire_after(
                    range.va,
                    self.bytes(p),
                    range.chunks.into_vec(),
                    Some((stream, epoch)),
                );
                continue;
            }
            // A larger pending range of the stream's own, with a chunk that fits: break it up.
            // Its chunks wait in the quarantine, where this stream takes them at once (above)
            // and others once its work has passed them.
            if self.break_up_own_pending(stream, left) {
                continue;
            }
            // No cached range has a chunk that fits: break up the least recently freed one for
            // its chunks to be split below, unless a bare chunk can be split already.
            if !self.pool.has_bare_larger_than(left) {
                if let Some((&seq, _)) = self.cached_lru.iter().next() {
                    self.steal_cached(seq);
                    continue;
                }
            }
            // Whole window chunks larger than what is left come last, as they must be split
            // (below): one, only when no new memory can be made and no bare chunk can be split
            // instead.
            if self.headroom() < left
                && !self.pool.has_bare_larger_than(left)
                && self.steal_window_whole()
            {
                continue;
            }
            break;
        }
        let mut release = Vec::new();
        let mut create = Vec::new();
        let mut spare = Vec::new();
        // A size asked for before (`requested` is the request's bytes) will likely come back
        // beside other sizes, as a training step's do: smaller chunks let later requests of
        // other sizes reuse its memory with fewer pages to spare.
        let repeated = large && self.cuts_repeated() && self.sizes.contains(requested);
        let cap = self.chunk_cap(left, large, repeated);
        if left > 0 && self.pool.has_bare_larger_than(left) {
            match self.pool.take_unmapped_bare_larger_than(left) {
                Some(c) => {
                    let chunk = self.pool.get(c);
                    release.push((c, chunk.handle, chunk.pages));
                    create = chunk_plan(left, cap);
                    spare = chunk_plan(
                        chunk.pages - left,
                        self.chunk_cap(chunk.pages - left, large, false),
                    );
                    left = 0;
                }
                None => {
                    // Every candidate is still mapped by retired ranges: unmap one's first.
                    let candidate = self.split_candidate(left);
                    self.give_back(got, same_stream);
                    self.va.recycle(va, len);
                    self.stats.flushes_for_split += 1;
                    return Step::Flush(candidate);
                }
            }
        }
        if left > 0 {
            if self.headroom() < left {
                self.give_back(got, same_stream);
                self.va.recycle(va, len);
                return self.short_of(requested, left, stream, true);
            }
            create = chunk_plan(left, cap);
        }
        let step = self.claim(va, len, got, release, create, spare);
        match &step {
            // Most plans take nothing from their stream's pending frees: no second lookup.
            Step::Map(plan) if !same_stream.is_empty() => {
                if let Some(claim) = self.inflight.get_mut(&plan.id) {
                    claim.same_stream = same_stream;
                }
            }
            _ => {}
        }
        step
    }

    /// The largest chunk to create `pages` new pages in. A need this large costs one handle per
    /// chunk either way (set access and unmap cost per handle), so from `large_chunk_pages` up
    /// it is the largest power of two the need holds (up to `largest_chunk_pages`): a large
    /// need below twice that then takes at most two handles, where a lone `cuMemCreate` takes
    /// one. Smaller needs, and growables (`large` false, they shrink by whole chunks), keep
    /// `max_chunk_pages` so that stitching keeps its freedom, and a smaller need of a size
    /// asked for before (`repeated`) `repeated_chunk_pages`.
    fn chunk_cap(&self, pages: u64, large: bool, repeated: bool) -> u64 {
        if large && pages >= self.lim.large_chunk_pages {
            (1u64 << pages.ilog2()).clamp(self.lim.large_chunk_pages, self.lim.largest_chunk_pages)
        } else if repeated {
            self.lim.repeated_chunk_pages
        } else {
            self.lim.max_chunk_pages
        }
    }

    /// Breaks up the oldest covered pending range of `stream` that holds a chunk of at most
    /// `fit` pages: its chunks go to the quarantine under its epoch, its addresses are retired
    /// after that epoch. Returns whether it found one.
    fn break_up_own_pending(&mut self, stream: u64, fit: u64) -> bool {
        let pool = &self.pool;
        let ranges = &self.ranges;
        let has_fit = |id: u32| {
            ranges[id as usize]
                .as_ref()
                .is_some_and(|r| r.chunks.iter().any(|&c| pool.get(c).pages <= fit))
        };
        let Some((id, pages, epoch)) =
            self.streams.get_mut(stream).and_then(|f| f.take_covered_range_where(has_fit))
        else {
            return false;
        };
        self.streams.range_left(pages);
        let range = self.remove_range(id);
        self.quarantine.extend(range.chunks.iter().map(|&c| (c, stream, epoch)));
        self.stats.cached_ranges_stolen += 1;
        self.retire_after(
            range.va,
            self.bytes(pages),
            range.chunks.into_vec(),
            Some((stream, epoch)),
        );
        true
    }

    /// Returns chunks a plan gathered but will not use: bare, except those taken from a stream's
    /// pending frees, which wait in quarantine until that stream's work has passed them.
    fn give_back(&mut self, chunks: Vec<ChunkId>, same_stream: Vec<(ChunkId, u64, u64)>) {
        for c in chunks {
            match same_stream.iter().find(|q| q.0 == c) {
                Some(&q) => self.quarantine.push(q),
                None => self.pool.put_bare(c),
            }
        }
    }

    fn claim(
        &mut self,
        va: u64,
        len: u64,
        got: Vec<ChunkId>,
        release: Vec<(ChunkId, ChunkHandle, u64)>,
        create: Vec<u64>,
        spare: Vec<u64>,
    ) -> Step {
        let id = self.next_plan;
        self.next_plan += 1;
        let existing: Vec<(ChunkId, ChunkHandle, u64)> = got
            .iter()
            .map(|&c| {
                let ch = self.pool.get(c);
                (c, ch.handle, ch.pages)
            })
            .collect();
        let plan = MapPlan { id, va, len, page: self.lim.page, existing, release, create, spare };
        self.inflight_create_pages += plan.created_pages();
        let chunks = got.into_iter().chain(plan.release.iter().map(|r| r.0)).collect();
        self.inflight.insert(id, Claim { chunks, va: Some((va, len)), same_stream: Vec::new() });
        Step::Map(plan)
    }

    /// Adds a reservation made for a plan that found no free addresses.
    pub fn add_reservation(&mut self, base: u64, len: u64) {
        self.va.add_reservation(base, len);
    }

    /// Commits an executed plan: on success the new range (a live range for the caller), on
    /// failure everything claimed goes back and the driver's error is returned.
    pub fn commit(&mut self, plan: MapPlan, ex: Executed) -> Result<RangeId> {
        let (va, pages) = (plan.va, plan.len / self.lim.page);
        let chunks = self.commit_mapping(plan, ex)?;
        Ok(self.add_range(va, pages, chunks.into(), Use::Alloc))
    }

    /// Commits an executed plan's driver effects: on success the chunks now mapped at
    /// `plan.va`, in order; on failure everything claimed goes back.
    fn commit_mapping(&mut self, plan: MapPlan, ex: Executed) -> Result<Vec<ChunkId>> {
        let same_stream = self.inflight.remove(&plan.id).map(|c| c.same_stream).unwrap_or_default();
        self.inflight_create_pages -= plan.created_pages();
        for &(c, _, pages) in &plan.release[..ex.released] {
            self.pool.remove(c);
            self.stats.reserved_bytes.sub(self.bytes(pages));
            self.stats.chunks.sub(1);
        }
        if ex.released > 0 {
            self.stats.chunk_splits += 1;
        }
        for &(c, _, _) in &plan.release[ex.released..] {
            self.pool.put_bare(c);
        }
        for &(h, pages) in &ex.spares {
            let c = self.insert_chunk(h, pages);
            self.pool.put_bare(c);
        }
        let mut chunks = Vec::with_capacity(plan.existing.len() + ex.created.len());
        chunks.extend(plan.existing.iter().map(|e| e.0));
        for &(h, pages) in &ex.created {
            chunks.push(self.insert_chunk(h, pages));
        }
        match ex.result {
            Ok(()) => {
                for &c in &chunks {
                    self.pool.add_mapping(c);
                }
                self.stats.mapped_handles.add(chunks.len() as u64);
                self.stats.mapped_bytes.add(plan.len);
                self.note(HistoryAction::SegmentMap, plan.va, plan.len, 0);
                Ok(chunks)
            }
            Err(e) => {
                let mut unused_from = plan.va;
                if let Some((stuck_len, n)) = ex.stuck {
                    // Mapped and not unmappable now: the retired queue owns these mappings.
                    let stuck: Vec<ChunkId> = chunks[..n].to_vec();
                    for &c in &stuck {
                        self.pool.add_mapping(c);
                    }
                    self.stats.mapped_handles.add(n as u64);
                    self.stats.mapped_bytes.add(stuck_len);
                    self.stats.retired_ranges.add(1);
                    self.note_deferred_error(e.clone());
                    self.va.retire(Retired {
                        va: plan.va,
                        len: stuck_len,
                        chunks: stuck,
                        after: None,
                    });
                    unused_from += stuck_len;
                }
                if plan.va + plan.len > unused_from {
                    self.va.recycle(unused_from, plan.va + plan.len - unused_from);
                }
                // Chunks created for the range that could not be released again stay, bare.
                self.give_back(chunks, same_stream);
                Err(if e.is_out_of_memory() {
                    self.out_of_memory_because(plan.len, plan.len / self.lim.page, Some(e))
                } else {
                    e.into()
                })
            }
        }
    }

    fn insert_chunk(&mut self, handle: ChunkHandle, pages: u64) -> ChunkId {
        self.stats.reserved_bytes.add(self.bytes(pages));
        self.stats.chunks.add(1);
        self.pool.insert(handle, pages)
    }

    fn add_range(&mut self, va: u64, pages: u64, chunks: Chunks, use_: Use) -> RangeId {
        let range = Range { va, pages, chunks, use_ };
        let id = match self.free_range_ids.pop() {
            Some(id) => {
                self.ranges[id as usize] = Some(range);
                id
            }
            None => {
                self.ranges.push(Some(range));
                (self.ranges.len() - 1) as RangeId
            }
        };
        self.by_va.insert(va, id);
        id
    }

    fn out_of_memory(&self, requested: u64, short_pages: u64) -> Error {
        self.out_of_memory_because(requested, short_pages, None)
    }

    /// Out of memory, with the driver's refusal when a call of the request's failed for lack of
    /// memory: the books alone would say memory must be freed when it may be free already.
    fn out_of_memory_because(
        &self,
        requested: u64,
        short_pages: u64,
        driver: Option<DriverError>,
    ) -> Error {
        Error::OutOfMemory {
            requested,
            allocated: self.stats.allocated_bytes.current,
            reserved: self.bytes(self.pool.held_pages()),
            free_in_pool: self
                .bytes(self.pool.bare_pages() + self.cached_pages + self.window.pages()),
            cap: self.lim.cap,
            short: self.bytes(short_pages),
            driver,
        }
    }

    // ---- the cache and the window ---------------------------------------------------------------

    fn cache_range(&mut self, id: RangeId) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let (pages, va) = (self.range(id).pages, self.range(id).va);
        self.range_mut(id).use_ = Use::Cached { seq };
        self.cached_by_size.insert((pages, va, seq));
        self.cached_lru.insert(seq, id);
        self.cached_by_va.insert(va, (seq, pages, id));
        self.group_cached(va, va + self.bytes(pages));
        self.cached_pages += pages;
        self.stats.cached_ranges.add(1);
    }

    /// Puts the cached range at `va..end` into its group of neighbours: the groups (or lone
    /// cached ranges) that end where it starts and start where it ends become one with it.
    fn group_cached(&mut self, va: u64, end: u64) {
        let mut start = va;
        if let Some((&at, &(_, p, _))) = self.cached_by_va.range(..va).next_back() {
            if at + self.bytes(p) == va && self.same_reservation(at, va) {
                start = match self.cached_groups.range(..va).next_back() {
                    Some((&s, &e)) if e == va => {
                        self.remove_group(s, e);
                        s
                    }
                    _ => at,
                };
            }
        }
        let mut stop = end;
        if let Some(&(_, p, _)) = self.cached_by_va.get(&end) {
            if self.same_reservation(va, end) {
                stop = match self.cached_groups.get(&end) {
                    Some(&e) => {
                        self.remove_group(end, e);
                        e
                    }
                    None => end + self.bytes(p),
                };
            }
        }
        if (start, stop) != (va, end) {
            self.add_group(start, stop);
        }
    }

    /// Takes the cached range at `va..end` (already out of `cached_by_va`) out of its group:
    /// what lies before and after it stays a group where two or more ranges are left.
    fn ungroup_cached(&mut self, va: u64, end: u64) {
        let Some((&start, &stop)) = self.cached_groups.range(..=va).next_back() else {
            return;
        };
        if stop < end {
            return; // The range was in no group.
        }
        self.remove_group(start, stop);
        let lone = |at: u64, to: u64| {
            self.cached_by_va.get(&at).is_some_and(|&(_, p, _)| at + self.bytes(p) == to)
        };
        let (before, after) = (start < va && !lone(start, va), end < stop && !lone(end, stop));
        if before {
            self.add_group(start, va);
        }
        if after {
            self.add_group(end, stop);
        }
    }

    fn add_group(&mut self, start: u64, end: u64) {
        self.cached_groups.insert(start, end);
        self.cached_groups_by_size.insert(((end - start) / self.lim.page, start));
    }

    fn remove_group(&mut self, start: u64, end: u64) {
        self.cached_groups.remove(&start);
        self.cached_groups_by_size.remove(&((end - start) / self.lim.page, start));
    }

    /// Whether two addresses lie in one reservation: ranges side by side in two reservations
    /// never join (one `cuMemUnmap` may not span both).
    fn same_reservation(&self, a: u64, b: u64) -> bool {
        self.va.reservation_of(a) == self.va.reservation_of(b)
    }

    fn uncache(&mut self, seq: u64) -> RangeId {
        let id = self.cached_lru.remove(&seq).expect("cached range missing");
        let (pages, va) = (self.range(id).pages, self.range(id).va);
        self.cached_by_size.remove(&(pages, va, seq));
        self.cached_by_va.remove(&va);
        self.ungroup_cached(va, va + self.bytes(pages));
        self.cached_pages -= pages;
        self.stats.cached_ranges.sub(1);
        id
    }

    fn remove_range(&mut self, id: RangeId) -> Range {
        let range = self.ranges[id as usize].take().expect("range missing");
        self.free_range_ids.push(id);
        self.by_va.remove(&range.va);
        range
    }

    /// Runs of whole chunks in larger cached ranges to split off with no driver call (each
    /// chunk is mapped on its own, so the pieces are mapped ranges as they are; what is left on
    /// either side stays cached): one of exactly `pages` pages, and else the first found that
    /// holds them to within `SPLIT_SLACK`, as (cached range, first chunk, one past the last).
    /// Takes nothing: the caller splits the run it picks (`split_off`).
    fn split_cached(&self, pages: u64) -> (Option<CachedRun>, Option<CachedRun>) {
        let most = pages + pages / SPLIT_SLACK;
        let (mut seen, mut near) = (0, None);
        let mut exact = None;
        for &(_, _, seq) in self.cached_by_size.range((pages + 1, 0, 0)..).take(SPLIT_CANDIDATES) {
            let chunks = &self.range(self.cached_lru[&seq]).chunks;
            seen += chunks.len();
            if seen > SPLIT_CHUNKS_SEEN {
                break;
            }
            let size = |i: usize| self.pool.get(chunks[i]).pages;
            if let Some((start, end)) = chunk_run(chunks.len(), size, pages, pages) {
                exact = Some((seq, start, end));
                break;
            }
            if near.is_none() {
                near = chunk_run(chunks.len(), size, pages, most).map(|(a, b)| (seq, a, b));
            }
        }
        (exact, near)
    }

    /// Splits chunks `start..end` off cached range `seq`, as a range of their own at the
    /// address where they are mapped (returned, out of the cache); what is left on either side
    /// stays cached.
    fn split_off(&mut self, seq: u64, start: usize, end: usize) -> RangeId {
        let id = self.uncache(seq);
        let range = self.remove_range(id);
        self.stats.cached_ranges_split += 1;
        self.split_chunks(range.va, range.pages, range.chunks.into_vec(), start, end)
    }

    /// Makes chunks `start..end` of `ids`, mapped back to back from `base` (`pages` pages in
    /// all), a range of their own (returned, out of the cache); what is left on either side is
    /// cached.
    fn split_chunks(
        &mut self,
        base: u64,
        pages: u64,
        ids: Vec<ChunkId>,
        start: usize,
        end: usize,
    ) -> RangeId {
        let pages_of = |cs: &[ChunkId]| cs.iter().map(|&c| self.pool.get(c).pages).sum::<u64>();
        let (before, run, after) = (&ids[..start], &ids[start..end], &ids[end..]);
        let (p_before, p_run) = (pages_of(before), pages_of(run));
        let va = base + self.bytes(p_before);
        if !before.is_empty() {
            let id = self.add_range(base, p_before, Chunks::from(before.to_vec()), Use::Alloc);
            self.cache_range(id);
        }
        if !after.is_empty() {
            let p_after = pages - p_before - p_run;
            let at = va + self.bytes(p_run);
            let id = self.add_range(at, p_after, Chunks::from(after.to_vec()), Use::Alloc);
            self.cache_range(id);
        }
        self.add_range(va, p_run, Chunks::from(run.to_vec()), Use::Alloc)
    }

    /// A run of whole chunks of exactly `pages` pages across cached ranges that lie back to back
    /// in one reservation, when no single cached range holds one. The smallest such group
    /// (in pages) that holds a run serves; the ranges the run touches are joined into one, and
    /// the run is split off it. The others keep their sizes for exact-size reuse.
    ///
    /// Exact, where `split_cached` allows `SPLIT_SLACK`: with that slack here too, the recorded
    /// traces held 0.1-0.3% more memory on the host backend (ResNet 1.016 against 1.013) for
    /// 5% fewer set-access calls on GPT-2 and Llama, none fewer on ResNet.
    ///
    /// Joining is a matter of bookkeeping: each chunk was mapped by a call of its own and its
    /// access set, so neighbours form one mapped range as they stand, and later unmaps cover
    /// whole chunks still. Ranges join only here, when a request would otherwise map: joined
    /// when freed, a freed range would no longer come back whole to an exact-size request,
    /// and where it went would depend on when its free completed (Address stability).
    fn split_joined(&mut self, pages: u64) -> Option<RangeId> {
        if self.cached_pages < pages {
            return None;
        }
        // The smallest group large enough with a run of exactly `pages` pages: where it lies,
        // and the run in its chunks.
        let mut best = None;
        let mut ids: Vec<ChunkId> = Vec::new();
        for &(group_pages, start) in self.cached_groups_by_size.range((pages, 0)..) {
            if ids.len() >= JOIN_CHUNKS_SEEN {
                break;
            }
            let end = start + self.bytes(group_pages);
            let first = ids.len();
            for (_, &(_, _, id)) in self.cached_by_va.range(start..end) {
                ids.extend(self.range(id).chunks.iter().copied());
            }
            let size = |i: usize| self.pool.get(ids[first + i]).pages;
            if let Some((a, b)) = chunk_run(ids.len() - first, size, pages, pages) {
                best = Some((start, end, a, b));
                break;
            }
        }
        let (start, end, run_start, run_end) = best?;
        let group: Vec<u64> =
            self.cached_by_va.range(start..end).map(|(_, &(q, _, _))| q).collect();
        Some(self.join_run(&group, run_start, run_end))
    }

    /// Joins the cached ranges of `group` (back to back, in address order) that chunks
    /// `start..end` of theirs touch, and splits that run off as a range of its own (returned,
    /// out of the cache): what is left on either side stays cached.
    fn join_run(&mut self, group: &[u64], start: usize, end: usize) -> RangeId {
        // Join the ranges the run touches: from the one holding its first chunk to the one
        // holding its last.
        let (mut first, mut offset, mut last) = (None, 0, 0);
        let mut at = 0;
        for (i, seq) in group.iter().enumerate() {
            let n = self.range(self.cached_lru[seq]).chunks.len();
            if first.is_none() && start < at + n {
                first = Some(i);
                offset = at;
            }
            if end <= at + n {
                last = i;
                break;
            }
            at += n;
        }
        let first = first.expect("the run starts in the group");
        let (mut va, mut joined_pages, mut chunks) = (0, 0, Vec::new());
        for (i, &seq) in group[first..=last].iter().enumerate() {
            let id = self.uncache(seq);
            let range = self.remove_range(id);
            if i == 0 {
                va = range.va;
            }
            joined_pages += range.pages;
            chunks.extend(range.chunks.into_vec());
        }
        self.stats.cached_ranges_joined += (last - first) as u64;
        self.split_chunks(va, joined_pages, chunks, start - offset, end - offset)
    }

    /// The cached range to steal for a plan that still needs `left` pages: of the first
    /// `STEAL_CANDIDATES` in freeing order (least recently freed first), the one with the
    /// largest chunk of at most `left` pages, the first such on a tie. A range whose chunks are
    /// all larger would give the plan nothing it can map (they go bare), yet retire a mapped
    /// range a later request could have hit; and the largest chunk that fits stitches the
    /// request from the fewest handles, as bare chunks are taken largest first. `scan`: where
    /// the plan's search goes on from (`left` only shrinks, so a range passed over for having
    /// no chunk that fits stays of no use to the plan), and the ranges looked at so far, at most
    /// `STEAL_LOOKS` for the plan.
    fn fitting_cached(&self, scan: &mut (u64, usize), left: u64) -> Option<u64> {
        let mut best: Option<(u64, u64)> = None;
        for (looked, (&seq, &id)) in self.cached_lru.range(scan.0..).enumerate() {
            if looked >= STEAL_CANDIDATES || scan.1 >= STEAL_LOOKS {
                break;
            }
            scan.1 += 1;
            let chunks = self.range(id).chunks.iter().map(|&c| self.pool.get(c).pages);
            match chunks.filter(|&p| p <= left).max() {
                Some(p) if best.map_or(true, |b| p > b.1) => best = Some((seq, p)),
                None if best.is_none() => scan.0 = seq + 1,
                _ => {}
            }
            if best.is_some_and(|b| b.1 == left) {
                break;
            }
        }
        best.map(|b| b.0)
    }

    /// Breaks up a cached range: its chunks become bare at once (a chunk may be mapped at a second
    /// address before the first is unmapped) and its addresses are retired.
    fn steal_cached(&mut self, seq: u64) {
        let id = self.uncache(seq);
        let range = self.remove_range(id);
        for &c in range.chunks.iter() {
            self.pool.put_bare(c);
        }
        self.stats.cached_ranges_stolen += 1;
        let len = self.bytes(range.pages);
        self.retire(range.va, len, range.chunks.into_vec());
    }

    /// Takes up to `pages` pages back from the window's tail (`Window::take_tail`): bare
    /// chunks, retired addresses. Returns whether it took any.
    fn steal_window(&mut self, pages: u64) -> bool {
        let taken = self.window.take_tail(pages);
        self.steal_from_window(taken)
    }

    /// Takes the window's smallest whole chunk back, whatever its size.
    fn steal_window_whole(&mut self) -> bool {
        let taken = self.window.take_smallest_whole();
        self.steal_from_window(taken)
    }

    fn steal_from_window(&mut self, taken: Option<(u64, u64, Vec<ChunkId>)>) -> bool {
        let Some((va, got, chunks)) = taken else {
            return false;
        };
        let len = self.bytes(got);
        self.stats.window_bytes.sub(len);
        for &c in &chunks {
            self.pool.put_bare(c);
        }
        self.retire(va, len, chunks);
        true
    }

    fn retire(&mut self, va: u64, len: u64, chunks: Vec<ChunkId>) {
        self.retire_after(va, len, chunks, None);
    }

    fn retire_after(&mut self, va: u64, len: u64, chunks: Vec<ChunkId>, after: Option<(u64, u64)>) {
        self.stats.retired_ranges.add(1);
        self.va.retire(Retired { va, len, chunks, after });
    }

    /// Since the last call (the mapper's measure of demand): the pages fresh allocations took,
    /// and the largest of their requests, in pages.
    pub fn take_fresh_demand(&mut self) -> (u64, u64) {
        (std::mem::take(&mut self.fresh_pages), std::mem::take(&mut self.fresh_largest))
    }

    /// Whether a request mapped a range of its own within `recent`: the driver seems to
    /// serialise VMM calls across threads, so the mapper's calls would lengthen such requests.
    pub fn requests_mapping_within(&self, recent: std::time::Duration) -> bool {
        self.last_request_map.is_some_and(|t| t.elapsed() < recent)
    }

    pub fn window_pages(&self) -> u64 {
        self.window.pages()
    }

    /// The size, in pages, of the whole window chunks to map for fresh requests of up to
    /// `largest` pages: `largest` itself if new memory of that size would be created as large
    /// chunks (`chunk_cap`) and one chunk can hold it; else 0, one-page chunks.
    pub fn whole_window_chunk(&self, largest: u64) -> u64 {
        let large = self.lim.large_chunk_pages..=self.lim.largest_chunk_pages;
        if self.lim.largest_chunk_pages > self.lim.max_chunk_pages && large.contains(&largest) {
            largest
        } else {
            0
        }
    }

    /// Plans mapping more into the window: with `whole` > 0, one chunk of `whole` pages mapped
    /// alone (a bare chunk of that size, else a new one if `create` allows it); otherwise, or if
    /// neither is there, up to `want` one-page chunks, bare ones first, creating at most
    /// `create`. `None` if nothing is to be done; `Step::Reserve` or `Step::Flush` if addresses
    /// must be found first.
    pub fn plan_window_refill(&mut self, want: u64, create: u64, whole: u64) -> Option<Step> {
        let (next, end) = self.window_slab;
        let slab_left = (end - next) / self.lim.page;
        let mut got = Vec::new();
        let mut new = Vec::new();
        if whole > 0 {
            match self.pool.take_bare_of(whole) {
                Some(c) => got.push(c),
                None if create >= whole && self.headroom() >= whole => new.push(whole),
                None => {}
            }
        }
        if got.is_empty() && new.is_empty() {
            if want == 0 {
                return None;
            }
            let n = if slab_left > 0 {
                want.min(slab_left)
            } else {
                want.min(self.lim.window_slab_pages)
            };
            while (got.len() as u64) < n {
                match self.pool.take_bare_at_most(1) {
                    Some(c) => got.push(c),
                    None => break,
                }
            }
            let created = (n - got.len() as u64).min(create).min(self.headroom());
            new = vec![1; created as usize];
            if got.is_empty() && new.is_empty() {
                return None;
            }
        }
        let pages =
            got.iter().map(|&c| self.pool.get(c).pages).sum::<u64>() + new.iter().sum::<u64>();
        let va = if slab_left >= pages {
            self.window_slab.0 += self.bytes(pages);
            next
        } else {
            if slab_left > 0 {
                self.va.recycle(next, end - next);
            }
            let slab = self.bytes(self.lim.window_slab_pages.max(pages));
            let Some(base) = self.va.take_fresh(slab) else {
                self.window_slab = (0, 0);
                for c in got {
                    self.pool.put_bare(c);
                }
                if self.va.unmap_could_free(slab) || self.unmapping > self.unmapping_private.len() {
                    return Some(Step::Flush(None));
                }
                let size = self.lim.reserve_bytes.max(slab);
                if self.va.reserved_bytes() + size > self.lim.va_limit {
                    return None;
                }
                return Some(Step::Reserve(size));
            };
            self.window_slab = (base + self.bytes(pages), base + slab);
            base
        };
        Some(self.claim(va, self.bytes(pages), got, Vec::new(), new, Vec::new()))
    }

    /// Commits a window refill: the pages join the window.
    pub fn commit_window(&mut self, plan: MapPlan, ex: Executed) -> Result<()> {
        // Straight into the window, never a range: the range table and the address index are
        // what a window hit writes next, and the mapper's thread should leave them alone.
        let (va, pages) = (plan.va, plan.len / self.lim.page);
        let chunks = self.commit_mapping(plan, ex)?;
        self.stats.window_bytes.add(self.bytes(pages));
        match chunks[..] {
            [c] if pages > 1 => self.window.add_whole(va, c, pages),
            _ => self.window.add(va, chunks),
        }
        Ok(())
    }

    // ---- unmapping ------------------------------------------------------------------------------

    /// Whether an unmap batch is due (by count, bytes or age).
    pub fn unmap_due(&self) -> bool {
        let n = self.va.retired_count();
        n > 0
            && (n >= self.lim.unmap_batch_ranges
                || self.va.retired_bytes() >= self.lim.unmap_batch_bytes
                || self.va.retired_age() >= self.lim.unmap_batch_age)
    }

    /// The chunk to split when every bare chunk larger than `pages` is still mapped by retired
    /// ranges, and when its ranges can go: of the first `CHUNK_SPLIT_CANDIDATES`, smallest
    /// first, one whose ranges may all be unmapped now, so that the request unmaps those alone;
    /// else one whose ranges wait only for another thread's unmap batch; else the smallest.
    fn split_candidate(&self, pages: u64) -> Option<ChunkId> {
        let mut best: Option<(ChunkId, Unmappable)> = None;
        for c in self.pool.bare_larger_than(pages).take(CHUNK_SPLIT_CANDIDATES) {
            let when = self.unmappable(c);
            if when == Unmappable::Now {
                return Some(c);
            }
            if best.map_or(true, |b| when < b.1) {
                best = Some((c, when));
            }
        }
        best.map(|b| b.0)
    }

    /// When the mappings of bare chunk `c`, all retired ranges, may be unmapped.
    fn unmappable(&self, c: ChunkId) -> Unmappable {
        let mappings = self.pool.try_get(c).map_or(0, |ch| ch.mappings as usize);
        let (n, all_ready) = self
            .va
            .retired()
            .filter(|r| r.chunks.contains(&c))
            .fold((0, true), |(n, ok), r| (n + 1, ok && retired_ready(&self.streams, r)));
        match (all_ready, n == mappings) {
            (true, true) if n > 0 => Unmappable::Now,
            (true, _) => Unmappable::AfterBatch,
            (false, _) => Unmappable::AfterWork,
        }
    }

    /// Whether a request that `Step::Flush(only)` found nothing to unmap waits for another
    /// thread's unmap batch (not for stream work): for a chunk to split, some of its ranges are
    /// in one; for addresses, some batch is in flight.
    pub fn waits_for_batch(&self, only: Option<ChunkId>) -> bool {
        match only {
            Some(c) => self.unmappable(c) == Unmappable::AfterBatch,
            None => self.unmapping > 0,
        }
    }

    /// Takes retired ranges whose stream work has completed out for unmapping, merged into runs:
    /// with `only`, the ranges that map that chunk if that is every mapping it has and all can
    /// go now (so it can be split), else none; otherwise all of them.
    pub fn take_unmap_batch(&mut self, only: Option<ChunkId>) -> Vec<UnmapRun> {
        let streams = &self.streams;
        let ready = |r: &Retired| retired_ready(streams, r);
        let max = self.lim.unmap_run_handles;
        let runs = match only.map(|c| (c, self.unmappable(c))) {
            Some((c, Unmappable::Now)) => {
                self.stats.targeted_flushes += 1;
                self.va.take_retired_runs(max, |r| r.chunks.contains(&c))
            }
            // Its ranges are in another thread's batch (the caller waits for it to land; the
            // worker's stops early when asked), or wait for their streams' work: unmapping
            // others would not help, and would put all of them on the request's path.
            Some((_, Unmappable::AfterBatch | Unmappable::AfterWork)) => Vec::new(),
            None => self.va.take_retired_runs(max, ready),
        };
        self.unmapping += runs.len();
        for run in &runs {
            if self.va.is_private(run.va) {
                self.unmapping_private.push((run.va, run.len));
            }
        }
        runs
    }

    /// Commits an unmap batch of which the first `done` runs were unmapped; the rest stay retired.
    pub fn commit_unmap(&mut self, runs: Vec<UnmapRun>, done: usize, error: Option<DriverError>) {
        self.unmapping -= runs.len();
        self.unmapping_private.retain(|&(va, _)| !runs.iter().any(|r| r.va == va));
        if !runs.is_empty() {
            self.stats.unmap_batches += 1;
            self.stats.unmap_calls_in_batches += (done + error.is_some() as usize) as u64;
        }
        let mut runs = runs.into_iter();
        for run in runs.by_ref().take(done) {
            for part in &run.parts {
                if let Some(h) = &mut self.history {
                    h.push(HistoryAction::SegmentUnmap, part.va, part.len, 0);
                }
                for &c in &part.chunks {
                    self.pool.remove_mapping(c);
                }
                self.stats.mapped_handles.sub(part.chunks.len() as u64);
                self.stats.retired_ranges.sub(1);
            }
            self.stats.mapped_bytes.sub(run.len);
            self.va.recycle(run.va, run.len);
        }
        self.va.put_back_runs(runs);
        if let Some(e) = error {
            self.note_deferred_error(e);
        }
    }

    /// Every span mapped for use, as (address, bytes): ranges of every kind (live, arenas,
    /// pending, cached), window segments and growables' committed pages. What a new peer must
    /// be granted access to; retired spans, on their way to be unmapped, are left out.
    pub fn mapped_spans(&self) -> Vec<(u64, u64)> {
        let ranges = self.ranges.iter().flatten().map(|r| (r.va, self.bytes(r.pages)));
        let window = self.window.segments().map(|(va, pages, _)| (va, self.bytes(pages)));
        let growables = self
            .growables
            .values()
            .filter(|g| !g.released && g.committed > 0)
            .map(|g| (g.base, self.bytes(g.committed)));
        ranges.chain(window).chain(growables).collect()
    }

    /// Whether an unmap batch taken out of the queue has not committed yet.
    pub fn unmaps_in_flight(&self) -> bool {
        self.unmapping > 0
    }

    /// Retires every cached range and the window, for `release_unused`.
    pub fn retire_all_free(&mut self) {
        while let Some((&seq, _)) = self.cached_lru.iter().next() {
            self.steal_cached(seq);
        }
        while self.steal_window(u64::MAX) {}
        debug_assert_eq!(self.window.pages(), 0);
    }

    /// Takes out every bare chunk that is mapped nowhere, for release: a claim id (as a plan's)
    /// and the chunks.
    pub fn take_releasable(&mut self) -> (u64, Vec<(ChunkId, ChunkHandle, u64)>) {
        let mut out = Vec::new();
        while let Some(c) = self.pool.take_unmapped_bare() {
            let ch = self.pool.get(c);
            out.push((c, ch.handle, ch.pages));
        }
        let id = self.next_plan;
        self.next_plan += 1;
        let chunks = out.iter().map(|r| r.0).collect();
        self.inflight.insert(id, Claim { chunks, ..Claim::default() });
        (id, out)
    }

    /// Commits the releases of claim `id`: `released[i]` says whether chunk i went; the others
    /// stay bare.
    pub fn commit_releases(
        &mut self,
        id: u64,
        chunks: Vec<(ChunkId, ChunkHandle, u64)>,
        released: &[bool],
    ) {
        self.inflight.remove(&id);
        for (&(c, _, pages), &gone) in chunks.iter().zip(released) {
            if gone {
                self.pool.remove(c);
                self.stats.reserved_bytes.sub(self.bytes(pages));
                self.stats.chunks.sub(1);
            } else {
                self.pool.put_bare(c);
            }
        }
    }

    /// Everything the driver must undo at teardown: every range and window page retired, and the
    /// runs to unmap; every chunk to release; every reservation; every event. Leaves the heap
    /// empty. Returns the number of allocations still live too.
    pub fn teardown(&mut self) -> Teardown {
        let leaked = self.live.len();
        let ids: Vec<RangeId> = self.by_va.values().copied().collect();
        for id in ids {
            let r = self.remove_range(id);
            let len = self.bytes(r.pages);
            self.retire(r.va, len, r.chunks.into_vec());
        }
        for (va, pages, chunks) in self.window.drain() {
            self.retire(va, self.bytes(pages), chunks);
        }
        let growables = std::mem::take(&mut self.growables);
        for g in growables.values().filter(|g| g.committed > 0) {
            let len = self.bytes(g.committed);
            self.retire(g.base, len, g.chunks.clone());
        }
        let leaked = leaked + growables.values().filter(|g| !g.released).count();
        let runs = self.va.take_retired_runs(0, |_| true);
        let chunks = self.pool.iter().map(|(_, c)| c.handle).collect();
        let mut reservations = self.va.reservations().to_vec();
        reservations.extend(growables.values().map(|g| (g.base, g.capacity)));
        let events = self
            .streams
            .iter()
            .flat_map(|(_, f)| f.all_events())
            .chain(self.event_stock.drain(..))
            .collect();
        *self = Heap::new(self.lim);
        Teardown { leaked, runs, chunks, reservations, events }
    }

    // ---- invariants -----------------------------------------------------------------------------

    /// Every mapped range and its blocks, in address order.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let mut by_range: HashMap<RangeId, Vec<BlockInfo>> = HashMap::new();
        let mut streams: HashMap<RangeId, u64> = HashMap::new();
        for (&ptr, l) in &self.live {
            let id = match l.backing {
                Backing::Range(id) => id,
                Backing::Sub { arena, .. } => arena,
            };
            streams.insert(id, l.stream);
            if l.pooled {
                // A graph pool's free block: free space of the range, as PyTorch shows it.
                by_range.entry(id).or_default();
                continue;
            }
            by_range.entry(id).or_default().push(BlockInfo {
                addr: ptr,
                size: l.rounded,
                requested_size: l.size,
                state: BlockState::ActiveAllocated,
            });
        }
        let mut out = Vec::new();
        for (&va, &id) in &self.by_va {
            let r = self.range(id);
            let size = self.bytes(r.pages);
            let mut blocks = by_range.remove(&id).unwrap_or_default();
            blocks.sort_by_key(|b| b.addr);
            // Free space between used blocks shows as inactive blocks, as PyTorch shows it.
            let mut filled = Vec::new();
            let mut at = va;
            for b in blocks {
                if b.addr > at {
                    filled.push(BlockInfo {
                        addr: at,
                        size: b.addr - at,
                        requested_size: 0,
                        state: BlockState::Inactive,
                    });
                }
                at = b.addr + b.size;
                filled.push(b);
            }
            if at < va + size {
                filled.push(BlockInfo {
                    addr: at,
                    size: va + size - at,
                    requested_size: 0,
                    state: BlockState::Inactive,
                });
            }
            let kind = match r.use_ {
                Use::Alloc => "alloc",
                Use::Arena => "arena",
                Use::Carved => "carved",
                Use::Pending | Use::PendingArena => "pending",
                Use::Cached { .. } => "cached",
            };
            out.push(SegmentInfo {
                addr: va,
                size,
                stream: shown_stream(streams.get(&id).copied().unwrap_or(0)),
                kind,
                chunks: r.chunks.len(),
                blocks: filled,
            });
        }
        out.extend(self.growable_segments());
        out.sort_by_key(|seg| seg.addr);
        out
    }

    /// Checks every invariant that spans the heap's structures (see docs/design.md).
    pub fn check(&self) -> std::result::Result<(), String> {
        self.pool.check()?;
        self.sub.check()?;
        self.carved.check()?;
        let page = self.lim.page;
        // Each chunk is in exactly one place: a live, pending or cached range, the window, a plan
        // in flight, or bare. Its mapping count is the number of ranges (any, retired included)
        // and window slots that map it.
        let mut owners: HashMap<ChunkId, u32> = HashMap::new();
        let mut maps: HashMap<ChunkId, u32> = HashMap::new();
        let mut spans: Vec<(u64, u64, &str)> = Vec::new();
        let mut cached = 0;
        let mut cached_pages = 0;
        let small: std::collections::HashSet<RangeId> = self.sub.arena_ids().collect();
        let carved: std::collections::HashSet<RangeId> = self.carved.arena_ids().collect();
        for (id, r) in
            self.ranges.iter().enumerate().filter_map(|(i, r)| r.as_ref().map(|r| (i, r)))
        {
            let sum: u64 = r.chunks.iter().map(|&c| self.pool.get(c).pages).sum();
            if sum != r.pages {
                return Err(format!(
                    "range {id} at {:#x}: chunks hold {sum} pages, range has {}",
                    r.va, r.pages
                ));
            }
            for &c in r.chunks.iter() {
                *owners.entry(c).or_default() += 1;
                *maps.entry(c).or_default() += 1;
            }
            if self.by_va.get(&r.va) != Some(&(id as RangeId)) {
                return Err(format!("range {id} missing from the address index"));
            }
            if let Use::Cached { seq } = r.use_ {
                cached += 1;
                cached_pages += r.pages;
                if self.cached_lru.get(&seq) != Some(&(id as RangeId))
                    || !self.cached_by_size.contains(&(r.pages, r.va, seq))
                    || self.cached_by_va.get(&r.va) != Some(&(seq, r.pages, id as RangeId))
                {
                    return Err(format!("cached range {id} missing from the cache indexes"));
                }
            }
            if r.use_ == Use::Carved && !self.free_chunk_runs(id as RangeId).is_empty() {
                return Err(format!("carved arena {id} holds a whole chunk of free space"));
            }
            let (in_small, in_carved) =
                (small.contains(&(id as RangeId)), carved.contains(&(id as RangeId)));
            if (r.use_ == Use::Arena) != in_small || (r.use_ == Use::Carved) != in_carved {
                return Err(format!(
                    "range {id} in use as {:?}: a sub-page arena {in_small}, a carved one {in_carved}",
                    r.use_
                ));
            }
            spans.push((r.va, r.pages * page, "range"));
        }
        if cached != self.cached_lru.len()
            || cached != self.cached_by_size.len()
            || cached != self.cached_by_va.len()
            || cached_pages != self.cached_pages
        {
            return Err("cache indexes disagree with the ranges".into());
        }
        // Groups of cached neighbours, from the cached ranges in address order.
        let mut groups: Vec<(u64, u64, usize)> = Vec::new();
        for (&a, &(_, p, _)) in &self.cached_by_va {
            match groups.last_mut() {
                Some(g) if g.1 == a && self.same_reservation(g.0, a) => {
                    g.1 = a + p * page;
                    g.2 += 1;
                }
                _ => groups.push((a, a + p * page, 1)),
            }
        }
        let groups: BTreeMap<u64, u64> =
            groups.into_iter().filter(|g| g.2 > 1).map(|g| (g.0, g.1)).collect();
        let by_size: BTreeSet<(u64, u64)> =
            groups.iter().map(|(&s, &e)| ((e - s) / page, s)).collect();
        if groups != self.cached_groups || by_size != self.cached_groups_by_size {
            return Err(format!(
                "groups of cached neighbours {:?} by size {:?}, expected {groups:?}",
                self.cached_groups, self.cached_groups_by_size
            ));
        }
        let mut pending_ranges = 0;
        // Every range marked pending is in exactly one stream's list or joined free, and back.
        let mut pending_ids = BTreeSet::new();
        let items = self.streams.iter().flat_map(|(_, f)| f.items()).chain(self.streams.joined());
        for item in items {
            if let Pending::Range { id, pages, .. } = item {
                pending_ranges += pages;
                match self.ranges.get(id as usize).and_then(|r| r.as_ref()) {
                    Some(r) if matches!(r.use_, Use::Pending | Use::PendingArena) => {}
                    _ => return Err(format!("pending range {id} is not marked pending")),
                }
                if !pending_ids.insert(id) {
                    return Err(format!("pending range {id} waits twice"));
                }
            }
        }
        let marked = self
            .ranges
            .iter()
            .flatten()
            .filter(|r| matches!(r.use_, Use::Pending | Use::PendingArena))
            .count();
        if marked != pending_ids.len() {
            return Err(format!(
                "{marked} ranges are marked pending, {} wait for a stream",
                pending_ids.len()
            ));
        }
        if pending_ranges != self.streams.pending_pages() {
            return Err("pending page count drifted".into());
        }
        for (va, pages, chunks) in self.window.segments() {
            let mut sum = 0;
            for &c in &chunks {
                *owners.entry(c).or_default() += 1;
                *maps.entry(c).or_default() += 1;
                let p = self.pool.get(c).pages;
                if chunks.len() > 1 && p != 1 {
                    return Err(format!("window chunk {c} of {p} pages is in a segment"));
                }
                sum += p;
            }
            if sum != pages {
                return Err(format!("window span at {va:#x}: {pages} pages, chunks of {sum}"));
            }
            spans.push((va, pages * page, "window"));
        }
        let (grow_allocated, grow_active) =
            self.check_growables(&mut owners, &mut maps, &mut spans)?;
        for claim in self.inflight.values() {
            for &c in &claim.chunks {
                *owners.entry(c).or_default() += 1;
            }
            if let Some((va, len)) = claim.va {
                spans.push((va, len, "in flight"));
            }
        }
        for &(c, _, _) in &self.quarantine {
            *owners.entry(c).or_default() += 1;
        }
        for r in self.va.retired() {
            for &c in r.chunks.iter() {
                *maps.entry(c).or_default() += 1;
            }
            spans.push((r.va, r.len, "retired"));
        }
        if self.unmapping > 0 {
            // Runs being unmapped are out of every structure; mapping counts cannot be checked.
            return Ok(());
        }
        for (c, chunk) in self.pool.iter() {
            let owned = owners.get(&c).copied().unwrap_or(0);
            if owned + chunk.bare as u32 != 1 {
                return Err(format!("chunk {c} has {owned} owners and bare={}", chunk.bare));
            }
            let found = maps.get(&c).copied().unwrap_or(0);
            if found != chunk.mappings {
                return Err(format!("chunk {c} counts {} mappings, {found} found", chunk.mappings));
            }
        }
        if owners.keys().any(|&c| self.pool.try_get(c).is_none()) {
            return Err("a range holds a chunk the pool does not know".into());
        }
        // Mapped, retired, recycled, slab and never-used addresses are disjoint and inside
        // reservations.
        spans.extend(self.va.recycled().map(|(a, l)| (a, l, "recycled")));
        let (f, fe) = self.va.frontier();
        if fe > f {
            spans.push((f, fe - f, "frontier"));
        }
        let (sn, se) = self.window_slab;
        if se > sn {
            spans.push((sn, se - sn, "window slab"));
        }
        spans.sort();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "{} at {:#x} overlaps {} at {:#x}",
                    w[0].2, w[0].0, w[1].2, w[1].0
                ));
            }
        }
        for &(a, l, what) in &spans {
            if a % page != 0 || l % page != 0 {
                return Err(format!("{what} at {a:#x} is not page-aligned"));
            }
            let mut all = self.va.reservations().iter().chain(self.va.private_reservations());
            if !all.any(|&(b, bl)| a >= b && a + l <= b + bl) {
                return Err(format!("{what} at {a:#x} lies outside every reservation"));
            }
        }
        // Live allocations lie inside their ranges; the statistics match them.
        let mut allocated = grow_allocated;
        let mut active = grow_active;
        for (&ptr, l) in &self.live {
            if !l.pooled {
                allocated += l.size;
                active += l.rounded;
            }
            let (id, off) = match l.backing {
                Backing::Range(id) => (id, 0),
                Backing::Sub { arena, offset } => (arena, offset),
            };
            let r = self
                .ranges
                .get(id as usize)
                .and_then(|r| r.as_ref())
                .ok_or("live allocation without range")?;
            if r.va + off != ptr || off + l.rounded > r.pages * page || ptr % SUBPAGE_ALIGN != 0 {
                return Err(format!("live allocation {ptr:#x} does not fit its range"));
            }
        }
        if allocated != self.stats.allocated_bytes.current
            || active != self.stats.active_bytes.current
        {
            return Err("allocated or active byte statistics drifted".into());
        }
        if self.bytes(self.pool.held_pages()) != self.stats.reserved_bytes.current {
            return Err("reserved byte statistic drifted".into());
        }
        if self.bytes(self.window.pages()) != self.stats.window_bytes.current {
            return Err("window byte statistic drifted".into());
        }
        let handles: u64 = self.pool.iter().map(|(_, c)| c.mappings as u64).sum();
        if handles != self.stats.mapped_handles.current {
            return Err(format!(
                "{handles} chunk mappings, statistics say {}",
                self.stats.mapped_handles.current
            ));
        }
        let held = self.bytes(self.pool.held_pages());
        if held > self.lim.cap && self.over_cap.map_or(true, |h| held > h) {
            return Err("more memory held than the cap allows".into());
        }
        Ok(())
    }
}

/// What the driver must undo when an allocator goes away.
#[derive(Debug)]
pub(crate) struct Teardown {
    pub leaked: usize,
    pub runs: Vec<UnmapRun>,
    pub chunks: Vec<ChunkHandle>,
    pub reservations: Vec<(u64, u64)>,
    pub events: Vec<EventHandle>,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_chunks_is_found_at_either_end_or_in_the_middle() {
        let run = |sizes: &[u64], pages, most| chunk_run(sizes.len(), |i| sizes[i], pages, most);
        assert_eq!(run(&[4, 4, 1], 1, 1), Some((2, 3)), "the tail");
        assert_eq!(run(&[4, 4, 1], 4, 4), Some((0, 1)), "the head");
        assert_eq!(run(&[1, 4, 4], 4, 4), Some((1, 2)), "the middle");
        assert_eq!(run(&[1, 2, 1, 8], 3, 3), Some((0, 2)));
        assert_eq!(run(&[1, 2, 1, 8], 4, 4), Some((0, 3)));
        assert_eq!(run(&[2, 2, 8], 5, 5), None, "4 is short, 10 and 12 too much");
        assert_eq!(run(&[2, 2, 8], 5, 6), None);
        assert_eq!(run(&[2, 2, 8], 9, 10), Some((1, 3)), "2 + 8, within the slack");
        assert_eq!(run(&[3], 4, 8), None, "not enough pages at all");
        assert_eq!(run(&[], 1, 1), None);
    }

    #[test]
    fn the_tightest_run_spares_the_fewest_pages() {
        let run = |sizes: &[u64], pages| tightest_run(sizes.len(), |i| sizes[i], pages);
        assert_eq!(run(&[4, 4, 4], 3), Some((2, 3, 1)), "the last of equals");
        assert_eq!(run(&[8, 4, 2], 3), Some((1, 2, 1)), "the middle");
        assert_eq!(run(&[2, 8, 2, 2], 4), Some((2, 4, 0)));
        assert_eq!(run(&[2, 8, 3, 2], 4), Some((2, 4, 1)), "a run of two beats one chunk of 8");
        assert_eq!(run(&[2, 8, 2, 1], 4), Some((1, 2, 4)), "2 + 1 is short");
        assert_eq!(run(&[3, 3], 7), None, "not enough pages at all");
        assert_eq!(run(&[], 1), None);
    }

    proptest::proptest! {
        /// Against every run, by brute force: the fewest pages spared, the last such run.
        #[test]
        fn the_tightest_run_is_the_brute_forces(
            sizes in proptest::collection::vec(1u64..40, 0..24),
            pages in 1u64..200,
        ) {
            let mut want = None;
            for a in 0..sizes.len() {
                for b in a + 1..=sizes.len() {
                    let sum: u64 = sizes[a..b].iter().sum();
                    let shortest = sum - sizes[b - 1] < pages;
                    let better = want.map_or(true, |w: (usize, usize, u64)| sum - pages <= w.2);
                    if sum >= pages && shortest && better {
                        want = Some((a, b, sum - pages));
                    }
                }
            }
            proptest::prop_assert_eq!(tightest_run(sizes.len(), |i| sizes[i], pages), want);
        }
    }

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
            defer_free_events: false,
        };
        let mut h = Heap::new(lim);
        let caps =
            |h: &Heap| (h.live.capacity(), h.ranges.capacity(), h.recent_free_gen.capacity());
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
