//! The heap: MoonBright's single-threaded allocator state and every policy decision. It stitches
//! chunks into ranges at fresh addresses, keeps freed ranges mapped for reuse as they are, steals
//! their pages when other sizes need them, retires ranges for a batched unmap, and carves sub-page
//! requests out of arenas. Every driver call it makes is undone on failure.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use super::history::{BlockInfo, BlockState, History, HistoryAction, HistoryEvent, SegmentInfo};
use super::pool::{chunk_plan, ChunkId, Pool};
use super::stats::Stats;
use super::subpage::{SubPage, SUBPAGE_ALIGN};
use super::vaspace::{Retired, VaSpace};
use crate::driver::{Driver, DriverError};
use crate::error::{Error, Result};

/// Index of a range in the heap.
pub(crate) type RangeId = u32;

/// How many recently freed pointers are remembered to tell a double free from an unknown pointer.
const RECENT_FREES: usize = 4096;

/// What a mapped range is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    /// Backs one allocation of a page or more.
    Alloc,
    /// An arena of the sub-page allocator.
    Arena,
    /// Free, still mapped, reusable as it is; `seq` orders the cache from least recently freed.
    Cached { seq: u64 },
}

/// Chunks mapped back to back at `va`.
#[derive(Clone, Debug)]
struct Range {
    va: u64,
    pages: u64,
    chunks: Vec<ChunkId>,
    use_: Use,
}

/// Where a live allocation lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backing {
    Range(RangeId),
    Sub { arena: RangeId, offset: u64 },
}

#[derive(Clone, Copy, Debug)]
struct Live {
    size: u64,
    rounded: u64,
    backing: Backing,
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
    /// Size of each virtual reservation.
    pub reserve_bytes: u64,
    /// Limit on all reservations together.
    pub va_limit: u64,
    /// Retired ranges that trigger an unmap batch.
    pub unmap_batch_ranges: usize,
    /// Retired bytes that trigger an unmap batch.
    pub unmap_batch_bytes: u64,
}

#[derive(Debug)]
pub(crate) struct Heap {
    lim: Limits,
    pool: Pool,
    va: VaSpace,
    sub: SubPage,
    ranges: Vec<Option<Range>>,
    free_range_ids: Vec<RangeId>,
    /// Live and cached ranges by base address.
    by_va: BTreeMap<u64, RangeId>,
    /// Cached ranges as (pages, seq), and seq -> range in freeing order.
    cached_by_size: BTreeSet<(u64, u64)>,
    cached_lru: BTreeMap<u64, RangeId>,
    cached_pages: u64,
    next_seq: u64,
    live: HashMap<u64, Live>,
    recent_frees: VecDeque<u64>,
    recent_free_set: HashSet<u64>,
    stats: Stats,
    /// The last driver error met outside a request (a deferred unmap, say).
    deferred_error: Option<DriverError>,
    /// Recorded events, when switched on.
    history: Option<History>,
}

fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

impl Heap {
    pub fn new(lim: Limits) -> Self {
        Heap {
            lim,
            pool: Pool::default(),
            va: VaSpace::default(),
            sub: SubPage::default(),
            ranges: Vec::new(),
            free_range_ids: Vec::new(),
            by_va: BTreeMap::new(),
            cached_by_size: BTreeSet::new(),
            cached_lru: BTreeMap::new(),
            cached_pages: 0,
            next_seq: 0,
            live: HashMap::new(),
            recent_frees: VecDeque::new(),
            recent_free_set: HashSet::new(),
            stats: Stats::default(),
            deferred_error: None,
            history: None,
        }
    }

    /// Starts recording up to `max` events (dropping the oldest), or stops with `None`.
    pub fn set_history(&mut self, max: Option<usize>) {
        self.history = max.map(|m| History::new(m, std::time::Instant::now()));
    }

    /// The events recorded so far.
    pub fn history(&self) -> Vec<HistoryEvent> {
        self.history.as_ref().map(History::events).unwrap_or_default()
    }

    fn note(&mut self, action: HistoryAction, addr: u64, size: u64) {
        if let Some(h) = &mut self.history {
            h.push(action, addr, size, 0);
        }
    }

    /// Every mapped range with its blocks, in address order.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let mut by_range: HashMap<RangeId, Vec<BlockInfo>> = HashMap::new();
        for (&ptr, l) in &self.live {
            let id = match l.backing {
                Backing::Range(id) => id,
                Backing::Sub { arena, .. } => arena,
            };
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
                Use::Cached { .. } => "cached",
            };
            out.push(SegmentInfo {
                addr: va,
                size,
                stream: 0,
                kind,
                chunks: r.chunks.len(),
                blocks: filled,
            });
        }
        out
    }

    pub fn limits(&self) -> &Limits {
        &self.lim
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

    /// The usable size of a live allocation (its rounded size), if `ptr` is one.
    pub fn usable_size(&self, ptr: u64) -> Option<u64> {
        self.live.get(&ptr).map(|l| l.rounded)
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

    // ---- requests -------------------------------------------------------------------------------

    /// Allocates `size` bytes: below a page from an arena, otherwise a range of whole pages.
    pub fn malloc(&mut self, driver: &dyn Driver, size: u64) -> Result<u64> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        if size > self.lim.cap {
            return Err(Error::TooLarge { requested: size, cap: self.lim.cap });
        }
        let result = if size < self.lim.page {
            self.malloc_subpage(driver, size)
        } else {
            self.malloc_pages(driver, size)
        };
        match &result {
            Ok(ptr) => {
                if self.recent_free_set.remove(ptr) {
                    self.recent_frees.retain(|p| p != ptr);
                }
                self.note(HistoryAction::Alloc, *ptr, size);
            }
            Err(Error::OutOfMemory { .. }) => {
                self.stats.num_ooms += 1;
                self.note(HistoryAction::Oom, 0, size);
            }
            Err(_) => {}
        }
        self.flush_if_due(driver);
        result
    }

    fn malloc_subpage(&mut self, driver: &dyn Driver, size: u64) -> Result<u64> {
        let rounded = size.next_multiple_of(SUBPAGE_ALIGN);
        let (arena, offset) = match self.sub.alloc(rounded) {
            Some(found) => found,
            None => {
                let id = self.map_range(driver, 1, Use::Arena, size)?;
                self.sub.add_arena(id, self.lim.page);
                self.sub.alloc(rounded).expect("a fresh arena fits any sub-page request")
            }
        };
        let ptr = self.range(arena).va + offset;
        self.stats.subpage_allocations += 1;
        self.record_live(ptr, Live { size, rounded, backing: Backing::Sub { arena, offset } });
        Ok(ptr)
    }

    fn malloc_pages(&mut self, driver: &dyn Driver, size: u64) -> Result<u64> {
        let pages = div_ceil(size, self.lim.page);
        let id = self.map_range(driver, pages, Use::Alloc, size)?;
        let ptr = self.range(id).va;
        self.record_live(
            ptr,
            Live { size, rounded: self.bytes(pages), backing: Backing::Range(id) },
        );
        Ok(ptr)
    }

    fn record_live(&mut self, ptr: u64, live: Live) {
        self.stats.allocated_bytes.add(live.size);
        self.stats.active_bytes.add(live.rounded);
        self.stats.rounding_waste_bytes.add(live.rounded - live.size);
        self.stats.allocations.add(1);
        let prev = self.live.insert(ptr, live);
        debug_assert!(prev.is_none(), "pointer handed out twice");
    }

    /// Frees a live allocation; an unknown, interior or already freed pointer changes nothing.
    pub fn free(&mut self, driver: &dyn Driver, ptr: u64) -> Result<()> {
        let Some(live) = self.live.remove(&ptr) else {
            return Err(self.classify_bad_free(ptr));
        };
        self.stats.allocated_bytes.sub(live.size);
        self.stats.active_bytes.sub(live.rounded);
        self.stats.rounding_waste_bytes.sub(live.rounded - live.size);
        self.stats.allocations.sub(1);
        self.note(HistoryAction::FreeRequested, ptr, live.size);
        self.note(HistoryAction::FreeCompleted, ptr, live.size);
        match live.backing {
            Backing::Range(id) => self.cache_range(id),
            Backing::Sub { arena, offset } => {
                if self.sub.free(arena, offset) {
                    self.sub.remove_arena(arena);
                    self.cache_range(arena);
                }
            }
        }
        if self.recent_frees.len() == RECENT_FREES {
            if let Some(old) = self.recent_frees.pop_front() {
                self.recent_free_set.remove(&old);
            }
        }
        self.recent_frees.push_back(ptr);
        self.recent_free_set.insert(ptr);
        self.flush_if_due(driver);
        Ok(())
    }

    fn classify_bad_free(&self, ptr: u64) -> Error {
        if let Some((_, &id)) = self.by_va.range(..=ptr).next_back() {
            let r = self.range(id);
            if ptr < r.va + self.bytes(r.pages) {
                match r.use_ {
                    Use::Alloc => {
                        return Error::InteriorPointer { ptr, base: r.va, offset: ptr - r.va };
                    }
                    Use::Arena => {
                        if let Some((off, _)) = self.sub.block_containing(id, ptr - r.va) {
                            let base = r.va + off;
                            return Error::InteriorPointer { ptr, base, offset: ptr - base };
                        }
                    }
                    Use::Cached { .. } => {}
                }
            }
        }
        if self.recent_free_set.contains(&ptr) {
            Error::DoubleFree { ptr }
        } else {
            Error::UnknownPointer { ptr }
        }
    }

    // ---- ranges ---------------------------------------------------------------------------------

    /// A mapped range of `pages` pages for `use_`: a cached range of exactly that size as it is,
    /// else chunks from anywhere stitched at a fresh address.
    fn map_range(
        &mut self,
        driver: &dyn Driver,
        pages: u64,
        use_: Use,
        requested: u64,
    ) -> Result<RangeId> {
        if let Some(&(p, seq)) =
            self.cached_by_size.range((pages, 0)..=(pages, u64::MAX)).next_back()
        {
            debug_assert_eq!(p, pages);
            let id = self.uncache(seq);
            self.range_mut(id).use_ = use_;
            self.stats.cache_hits += 1;
            return Ok(id);
        }
        let headroom = (self.lim.cap - self.bytes(self.pool.held_pages())) / self.lim.page;
        let free_pages = self.pool.bare_pages() + self.cached_pages + headroom;
        if free_pages < pages {
            return Err(self.out_of_memory(requested, pages - free_pages));
        }
        let len = self.bytes(pages);
        let va = self.fresh_va(driver, len)?;
        let mut created = Vec::new();
        let chunks = match self.gather(driver, pages, &mut created) {
            Ok(chunks) => chunks,
            Err(e) => {
                self.va.recycle(va, len);
                return Err(e);
            }
        };
        if let Err(e) = self.map_chunks(driver, va, len, &chunks) {
            self.return_chunks(driver, chunks, &created);
            return Err(e.into());
        }
        self.stats.mapped_bytes.add(len);
        self.note(HistoryAction::SegmentMap, va, len);
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
        Ok(id)
    }

    fn out_of_memory(&self, requested: u64, short_pages: u64) -> Error {
        let reserved = self.bytes(self.pool.held_pages());
        Error::OutOfMemory {
            requested,
            allocated: self.stats.allocated_bytes.current,
            reserved,
            free_in_pool: self.bytes(self.pool.bare_pages() + self.cached_pages),
            cap: self.lim.cap,
            short: self.bytes(short_pages),
        }
    }

    /// Maps `chunks` back to back at `va` and sets access over the whole range of `len` bytes. On
    /// failure nothing stays mapped and the addresses are recycled; if the rollback unmap fails too,
    /// the mapped part is retired instead, for a later flush to unmap.
    fn map_chunks(
        &mut self,
        driver: &dyn Driver,
        va: u64,
        len: u64,
        chunks: &[ChunkId],
    ) -> std::result::Result<(), DriverError> {
        let mut at = va;
        let mut mapped = 0;
        let mut failure = None;
        for &c in chunks {
            let chunk = self.pool.get(c);
            let len = self.bytes(chunk.pages);
            if let Err(e) = driver.map(at, len as usize, chunk.handle) {
                failure = Some(e);
                break;
            }
            self.pool.add_mapping(c);
            self.stats.mapped_handles.add(1);
            at += len;
            mapped += 1;
        }
        if failure.is_none() {
            match driver.set_access(va, (at - va) as usize) {
                Ok(()) => return Ok(()),
                Err(e) => failure = Some(e),
            }
        }
        let failure = failure.expect("the loop ended early or set_access failed");
        let mut unused_from = va;
        if mapped > 0 {
            let done = &chunks[..mapped];
            if driver.unmap(va, (at - va) as usize).is_ok() {
                for &c in done {
                    self.pool.remove_mapping(c);
                }
                self.stats.mapped_handles.sub(mapped as u64);
            } else {
                // This part stays mapped and goes through the retired queue, which owns one
                // mapping of each of these chunks until its unmap succeeds.
                self.stats.mapped_bytes.add(at - va);
                self.stats.retired_ranges.add(1);
                self.stats.deferred_errors += 1;
                self.va.retire(Retired { va, len: at - va, chunks: done.to_vec() });
                unused_from = at;
            }
        }
        if va + len > unused_from {
            self.va.recycle(unused_from, va + len - unused_from);
        }
        Err(failure)
    }

    /// Gives chunks of a failed request back: those created for it are released, the rest bare.
    fn return_chunks(&mut self, driver: &dyn Driver, chunks: Vec<ChunkId>, created: &[ChunkId]) {
        for c in chunks {
            if created.contains(&c)
                && self.pool.get(c).mappings == 0
                && self.release_chunk(driver, c).is_ok()
            {
                continue;
            }
            self.pool.put_bare(c);
        }
    }

    /// Chunks adding up to exactly `pages`: bare ones first, then pages of cached ranges (which are
    /// retired), then bare chunks too large split by release-and-recreate, then new chunks.
    /// `created` collects the chunks made for this request. On error every chunk gathered is bare
    /// again or released.
    fn gather(
        &mut self,
        driver: &dyn Driver,
        pages: u64,
        created: &mut Vec<ChunkId>,
    ) -> Result<Vec<ChunkId>> {
        let mut got = Vec::new();
        let mut left = pages;
        let outcome = loop {
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
                break Ok(());
            }
            if let Some((&seq, _)) = self.cached_lru.iter().next() {
                self.steal_cached(seq);
                continue;
            }
            if self.pool.has_bare_larger_than(left) {
                match self.split_one(driver, left, created) {
                    Ok(()) => continue,
                    Err(e) => break Err(e),
                }
            }
            let headroom = (self.lim.cap - self.bytes(self.pool.held_pages())) / self.lim.page;
            if headroom < left {
                break Err(self.out_of_memory(self.bytes(pages), left - headroom));
            }
            let mut failed = None;
            for p in chunk_plan(left, self.lim.max_chunk_pages) {
                match self.create_chunk(driver, p) {
                    Ok(c) => {
                        created.push(c);
                        got.push(c);
                        left -= p;
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            break match failed {
                None => Ok(()),
                Some(e) if e.is_out_of_memory() => Err(self.out_of_memory(self.bytes(pages), left)),
                Some(e) => Err(e.into()),
            };
        };
        match outcome {
            Ok(()) => Ok(got),
            Err(e) => {
                self.return_chunks(driver, got, created);
                Err(e)
            }
        }
    }

    /// Releases the smallest unmapped bare chunk larger than `need` pages and recreates its memory
    /// as chunks of `need` pages and of the rest, all bare. Flushes retired ranges first if every
    /// candidate is still mapped somewhere.
    fn split_one(
        &mut self,
        driver: &dyn Driver,
        need: u64,
        created: &mut Vec<ChunkId>,
    ) -> Result<()> {
        let c = match self.pool.take_unmapped_bare_larger_than(need) {
            Some(c) => c,
            None => {
                self.flush_retired(driver)?;
                self.pool
                    .take_unmapped_bare_larger_than(need)
                    .expect("after a flush every bare chunk is unmapped")
            }
        };
        let total = self.pool.get(c).pages;
        if let Err(e) = self.release_chunk(driver, c) {
            self.pool.put_bare(c);
            return Err(e.into());
        }
        self.stats.chunk_splits += 1;
        let mut plan = chunk_plan(need, self.lim.max_chunk_pages);
        plan.extend(chunk_plan(total - need, self.lim.max_chunk_pages));
        for p in plan {
            let n = self.create_chunk(driver, p)?;
            created.push(n);
            self.pool.put_bare(n);
        }
        Ok(())
    }

    fn create_chunk(
        &mut self,
        driver: &dyn Driver,
        pages: u64,
    ) -> std::result::Result<ChunkId, DriverError> {
        let handle = driver.create_chunk(self.bytes(pages) as usize)?;
        self.stats.reserved_bytes.add(self.bytes(pages));
        self.stats.chunks.add(1);
        Ok(self.pool.insert(handle, pages))
    }

    /// Releases a chunk that is mapped nowhere and not bare; on failure it stays in the pool.
    fn release_chunk(
        &mut self,
        driver: &dyn Driver,
        c: ChunkId,
    ) -> std::result::Result<(), DriverError> {
        let chunk = self.pool.get(c);
        debug_assert_eq!(chunk.mappings, 0);
        driver.release_chunk(chunk.handle)?;
        let chunk = self.pool.remove(c);
        self.stats.reserved_bytes.sub(self.bytes(chunk.pages));
        self.stats.chunks.sub(1);
        Ok(())
    }

    /// A fresh virtual range: the frontier, recycled addresses, recycled after a flush, or a new
    /// reservation, in that order.
    fn fresh_va(&mut self, driver: &dyn Driver, len: u64) -> Result<u64> {
        if let Some(va) = self.va.take_fresh(len) {
            return Ok(va);
        }
        if self.va.retired_count() > 0 {
            self.flush_retired(driver)?;
            if let Some(va) = self.va.take_fresh(len) {
                return Ok(va);
            }
        }
        let size = self.lim.reserve_bytes.max(len.next_multiple_of(self.lim.page));
        let reserved = self.va.reserved_bytes();
        if reserved + size > self.lim.va_limit {
            return Err(Error::AddressSpaceExhausted { reserved, limit: self.lim.va_limit });
        }
        let base = driver.reserve(size as usize, self.lim.page as usize)?;
        self.va.add_reservation(base, size);
        Ok(self.va.take_fresh(len).expect("a new reservation fits the request"))
    }

    fn cache_range(&mut self, id: RangeId) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let pages = self.range(id).pages;
        self.range_mut(id).use_ = Use::Cached { seq };
        self.cached_by_size.insert((pages, seq));
        self.cached_lru.insert(seq, id);
        self.cached_pages += pages;
        self.stats.cached_ranges.add(1);
    }

    fn uncache(&mut self, seq: u64) -> RangeId {
        let id = self.cached_lru.remove(&seq).expect("cached range missing");
        let pages = self.range(id).pages;
        self.cached_by_size.remove(&(pages, seq));
        self.cached_pages -= pages;
        self.stats.cached_ranges.sub(1);
        id
    }

    /// Breaks up a cached range: its chunks become bare at once (a chunk may be mapped at a second
    /// address before the first is unmapped) and its addresses are retired.
    fn steal_cached(&mut self, seq: u64) {
        let id = self.uncache(seq);
        let range = self.ranges[id as usize].take().expect("cached range missing");
        self.free_range_ids.push(id);
        self.by_va.remove(&range.va);
        for &c in &range.chunks {
            self.pool.put_bare(c);
        }
        self.stats.cached_ranges_stolen += 1;
        self.stats.retired_ranges.add(1);
        let len = self.bytes(range.pages);
        self.va.retire(Retired { va: range.va, len, chunks: range.chunks });
    }

    // ---- unmapping ------------------------------------------------------------------------------

    fn flush_if_due(&mut self, driver: &dyn Driver) {
        let due = self.va.retired_count() >= self.lim.unmap_batch_ranges
            || self.va.retired_bytes() >= self.lim.unmap_batch_bytes;
        if due {
            if let Err(Error::Driver(e)) = self.flush_retired(driver) {
                self.stats.deferred_errors += 1;
                self.deferred_error = Some(e);
            }
        }
    }

    /// Unmaps every retired range, adjacent ones in one call, and recycles their addresses. A run
    /// whose unmap fails stays retired, with every run after it, for a later flush.
    pub fn flush_retired(&mut self, driver: &dyn Driver) -> Result<()> {
        let runs = self.va.take_retired_runs();
        if runs.is_empty() {
            return Ok(());
        }
        self.stats.unmap_batches += 1;
        let mut runs = runs.into_iter();
        while let Some(run) = runs.next() {
            self.stats.unmap_calls_in_batches += 1;
            if let Err(e) = driver.unmap(run.va, run.len as usize) {
                self.va.put_back_runs(std::iter::once(run).chain(runs));
                return Err(e.into());
            }
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
        Ok(())
    }

    /// Gives back every page no allocation uses: cached ranges are retired, everything retired is
    /// unmapped, and every bare chunk released. Returns the bytes released.
    pub fn release_unused(&mut self, driver: &dyn Driver) -> Result<u64> {
        while let Some((&seq, _)) = self.cached_lru.iter().next() {
            self.steal_cached(seq);
        }
        self.flush_retired(driver)?;
        let mut released = 0;
        while let Some(c) = self.pool.take_unmapped_bare() {
            let pages = self.pool.get(c).pages;
            if let Err(e) = self.release_chunk(driver, c) {
                self.pool.put_bare(c);
                return Err(e.into());
            }
            released += self.bytes(pages);
        }
        Ok(released)
    }

    /// Unmaps and releases everything, live allocations included, and frees the reservations.
    /// Returns the number of allocations that were still live and the first driver error met.
    pub fn teardown(&mut self, driver: &dyn Driver) -> (usize, Option<DriverError>) {
        let leaked = self.live.len();
        let mut first_error = None;
        let mut note = |r: std::result::Result<(), DriverError>| {
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        };
        for (id, slot) in self.ranges.iter_mut().enumerate() {
            if let Some(r) = slot.take() {
                let len = r.pages * self.lim.page;
                self.stats.retired_ranges.add(1);
                self.va.retire(Retired { va: r.va, len, chunks: r.chunks });
                self.free_range_ids.push(id as RangeId);
            }
        }
        self.by_va.clear();
        if let Err(Error::Driver(e)) = self.flush_retired(driver) {
            note(Err(e));
        }
        let ids: Vec<ChunkId> = self.pool.iter().map(|(id, _)| id).collect();
        for c in ids {
            let chunk = self.pool.get(c);
            if chunk.mappings == 0 {
                note(driver.release_chunk(chunk.handle));
            }
        }
        for &(base, len) in self.va.reservations() {
            note(driver.free_reservation(base, len as usize));
        }
        *self = Heap::new(self.lim);
        (leaked, first_error)
    }

    // ---- invariants -----------------------------------------------------------------------------

    /// Checks every invariant that spans the heap's structures (see docs/design.md).
    pub fn check(&self) -> std::result::Result<(), String> {
        self.pool.check()?;
        self.sub.check()?;
        let page = self.lim.page;
        // Each chunk is in exactly one live or cached range or bare, and its mapping count is the
        // number of ranges (live, cached, retired) that map it.
        let mut owners: HashMap<ChunkId, u32> = HashMap::new();
        let mut maps: HashMap<ChunkId, u32> = HashMap::new();
        let mut spans: Vec<(u64, u64, &str)> = Vec::new();
        let mut cached = 0;
        let mut cached_pages = 0;
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
            for &c in &r.chunks {
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
                    || !self.cached_by_size.contains(&(r.pages, seq))
                {
                    return Err(format!("cached range {id} missing from the cache indexes"));
                }
            }
            if r.use_ == Use::Arena && !self.sub.arena_ids().any(|a| a == id as RangeId) {
                return Err(format!("arena range {id} unknown to the sub-page allocator"));
            }
            spans.push((r.va, r.pages * page, "range"));
        }
        if cached != self.cached_lru.len()
            || cached != self.cached_by_size.len()
            || cached_pages != self.cached_pages
        {
            return Err("cache indexes disagree with the ranges".into());
        }
        for r in self.va.retired() {
            for &c in &r.chunks {
                *maps.entry(c).or_default() += 1;
            }
            spans.push((r.va, r.len, "retired"));
        }
        for (c, chunk) in self.pool.iter() {
            let owned = owners.get(&c).copied().unwrap_or(0);
            if owned + chunk.bare as u32 != 1 {
                return Err(format!("chunk {c} is in {owned} ranges and bare={}", chunk.bare));
            }
            if maps.get(&c).copied().unwrap_or(0) != chunk.mappings {
                return Err(format!(
                    "chunk {c} counts {} mappings, {} found",
                    chunk.mappings,
                    maps.get(&c).copied().unwrap_or(0)
                ));
            }
        }
        if owners.keys().any(|&c| !self.pool.iter().any(|(id, _)| id == c)) {
            return Err("a range holds a chunk the pool does not know".into());
        }
        // Mapped, retired, recycled and never-used addresses are disjoint and inside reservations.
        spans.extend(self.va.recycled().map(|(a, l)| (a, l, "recycled")));
        let (f, fe) = self.va.frontier();
        if fe > f {
            spans.push((f, fe - f, "frontier"));
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
            if !self.va.reservations().iter().any(|&(b, bl)| a >= b && a + l <= b + bl) {
                return Err(format!("{what} at {a:#x} lies outside every reservation"));
            }
        }
        // Live allocations lie inside their ranges; the statistics match them.
        let mut allocated = 0;
        let mut active = 0;
        for (&ptr, l) in &self.live {
            allocated += l.size;
            active += l.rounded;
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
        let handles: u64 = self.pool.iter().map(|(_, c)| c.mappings as u64).sum();
        if handles != self.stats.mapped_handles.current {
            return Err(format!(
                "{handles} chunk mappings, statistics say {}",
                self.stats.mapped_handles.current
            ));
        }
        if self.bytes(self.pool.held_pages()) > self.lim.cap {
            return Err("more memory held than the cap allows".into());
        }
        Ok(())
    }
}
