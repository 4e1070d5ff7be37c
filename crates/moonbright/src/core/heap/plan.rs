//! Planning new ranges: where a request's pages come from when no fast path serves it (bare
//! chunks, cached ranges it steals, the window, its stream's own pending frees, new chunks; with
//! `Options::grow_first`, one new chunk before any cached range while its budget allows),
//! claimed under the lock as a plan (`core/mapping.rs`) that runs without it, then committed, or
//! given back if the driver failed.

use super::policy::{Gather, Gathered};
use super::{Claim, Heap, RangeId, Step, Use};
use crate::core::chunks::Chunks;
use crate::core::history::HistoryAction;
use crate::core::mapping::{Executed, MapPlan};
use crate::core::pool::{chunk_plan, ChunkId};
use crate::core::subpage::SUBPAGE_ALIGN;
use crate::core::vaspace::Retired;
use crate::driver::{ChunkHandle, DriverError};
use crate::error::{Error, Result};
use crate::tags::TagId;

impl Heap {
    /// Free pages under the cap that no plan has claimed. A chunk being released still counts
    /// as held until its release commits: another plan that created in its place could run
    /// before the release and take the device past the cap (or out of memory).
    pub(super) fn headroom(&self) -> u64 {
        let held = self.pool.held_pages() + self.claims.create_pages;
        (self.lim.cap / self.lim.page).saturating_sub(held)
    }

    /// The step for a request of `stream` `short` pages short of `requested` bytes: wait if
    /// work in flight may free some; try the fast paths again if the request now fits in an
    /// arena, sub-page or carved (another thread's arena committed since this one missed, or a
    /// block it waited for came back), as arena space is found by nothing else; else out of
    /// memory. A growable's growth (`arenas` false) takes no arena space: waiting for it would
    /// never end. `arenas`: the request's tag, `None` for a growable's growth.
    pub(super) fn short_of(
        &self,
        requested: u64,
        short: u64,
        stream: u64,
        arenas: Option<TagId>,
    ) -> Step {
        let rounded = requested.next_multiple_of(SUBPAGE_ALIGN);
        let arena_fits = match arenas {
            None => false,
            Some(tag) if requested < self.lim.page => self.sub.fits(rounded, stream, tag),
            Some(tag) => {
                tag == 0
                    && self.carving()
                    && self.carved.fits(requested.next_multiple_of(self.lim.page), stream, 0)
            }
        };
        if self.has_inflight() || arena_fits {
            Step::Wait
        } else {
            Step::OutOfMemory(self.out_of_memory(requested, short))
        }
    }

    /// Held pages no allocation uses, outside the window: bare chunks and cached ranges.
    pub fn free_held_pages(&self) -> u64 {
        self.pool.bare_pages() + self.cache.pages
    }

    /// Pages free for a new range right now, wherever they are.
    fn free_pages(&self) -> u64 {
        self.pool.bare_pages() + self.cache.pages + self.window.mapped.pages() + self.headroom()
    }

    /// Pages free for a new range on `stream`: those free for everyone, and the chunks the
    /// stream itself gave back that wait in the quarantine (not exported ones: those go back to
    /// the driver, never to another allocation).
    pub(super) fn free_pages_for(&self, stream: u64) -> u64 {
        let own: u64 = self
            .claims
            .quarantine
            .iter()
            .filter(|q| q.1 == stream && !self.pool.get(q.0).exported)
            .map(|q| self.pool.get(q.0).pages)
            .sum();
        let pending = self.streams.get(stream).map_or(0, |f| f.range_pages());
        self.free_pages() + own + pending
    }

    /// Plans a new range of `pages` pages at a fresh address, claiming what it uses.
    pub fn plan_range(&mut self, pages: u64, requested: u64, stream: u64, tag: TagId) -> Step {
        let free = self.free_pages_for(stream);
        if free < pages {
            return self.short_of(requested, pages - free, stream, Some(tag));
        }
        let len = self.bytes(pages);
        let Some(va) = self.va.take_fresh(len) else {
            if self.va.unmap_could_free(len)
                || self.claims.unmapping > self.claims.unmapping_private.len()
            {
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
        self.plan_at(va, pages, requested, stream, true, tag)
    }

    /// Plans `pages` pages of chunks mapped at `va` (fresh addresses, or a growable allocation's
    /// tail), claiming what it uses. If the plan cannot go ahead, `va` is recycled (a no-op for
    /// a growable's private addresses, which stay with it). `large`: new memory may come in
    /// chunks up to `chunks.large_pages` (not for growables, which shrink by whole chunks).
    /// `tag`: the request's, for whether its arenas may serve it after a wait (`short_of`).
    pub(super) fn plan_at(
        &mut self,
        va: u64,
        pages: u64,
        requested: u64,
        stream: u64,
        large: bool,
        tag: TagId,
    ) -> Step {
        let len = self.bytes(pages);
        let mut plan = Gather {
            stream,
            len,
            large,
            left: pages,
            got: Vec::new(),
            same_stream: Vec::new(),
            steal_scan: (0, 0),
        };
        // Whether what bare chunks leave is made new, in one chunk (`GrowFirst`).
        let mut grown = false;
        loop {
            while plan.left > 0 {
                match self.pool.take_bare_at_most(plan.left) {
                    Some(c) => {
                        plan.left -= self.pool.get(c).pages;
                        plan.got.push(c);
                    }
                    None => break,
                }
            }
            if plan.left == 0 {
                break;
            }
            match self.gather_next(&mut plan) {
                Gathered::Took => continue,
                Gathered::Grow => {
                    grown = true;
                    break;
                }
                Gathered::Nothing => break,
            }
        }
        let Gather { mut left, got, same_stream, .. } = plan;
        let mut release = Vec::new();
        let mut create = Vec::new();
        let mut spare = Vec::new();
        // A size asked for before (`requested` is the request's bytes) will likely come back
        // beside other sizes, as a training step's do: smaller chunks let later requests of
        // other sizes reuse its memory with fewer pages to spare.
        let repeated = large && self.cuts_repeated() && self.notes.sizes.contains(requested);
        let cap = if grown {
            left.min(self.lim.chunks.largest_pages)
        } else {
            self.chunk_cap(left, large, repeated)
        };
        if left > 0 && !grown && self.pool.has_bare_larger_than(left) {
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
        // New memory while the stream's own pending frees could serve the plan once an event
        // covers them: have the request record one first (`Limits::own_frees_before_new`).
        let own_first = left > 0 && large && !grown && self.lim.own_frees_before_new;
        if own_first && self.streams.get_mut(stream).is_some_and(|f| f.ask_to_cover()) {
            self.give_back(got, same_stream);
            self.va.recycle(va, len);
            return Step::RecordOwnFrees;
        }
        if left > 0 {
            if self.headroom() < left {
                self.give_back(got, same_stream);
                self.va.recycle(va, len);
                return self.short_of(requested, left, stream, Some(tag));
            }
            create = chunk_plan(left, cap);
        }
        let step = self.claim(va, len, got, release, create, spare);
        match &step {
            // Most plans take nothing from their stream's pending frees: no second lookup.
            Step::Map(plan) if !same_stream.is_empty() => {
                if let Some(claim) = self.claims.plans.get_mut(&plan.id) {
                    claim.same_stream = same_stream;
                }
            }
            _ => {}
        }
        step
    }

    /// The largest chunk to create `pages` new pages in. A need this large costs one handle per
    /// chunk either way (set access and unmap cost per handle), so from `chunks.large_pages` up
    /// it is the largest power of two the need holds (up to `chunks.largest_pages`): a large
    /// need below twice that then takes at most two handles, where a lone `cuMemCreate` takes
    /// one. Smaller needs, and growables (`large` false, they shrink by whole chunks), keep
    /// `chunks.max_pages` so that stitching keeps its freedom, and a smaller need of a size
    /// asked for before (`repeated`) `chunks.repeated_pages`.
    fn chunk_cap(&self, pages: u64, large: bool, repeated: bool) -> u64 {
        if large && pages >= self.lim.chunks.large_pages {
            (1u64 << pages.ilog2())
                .clamp(self.lim.chunks.large_pages, self.lim.chunks.largest_pages)
        } else if repeated {
            self.lim.chunks.repeated_pages
        } else {
            self.lim.chunks.max_pages
        }
    }

    /// Returns chunks a plan gathered but will not use: bare, except those taken from a stream's
    /// pending frees, which wait in quarantine until that stream's work has passed them.
    fn give_back(&mut self, chunks: Vec<ChunkId>, same_stream: Vec<(ChunkId, u64, u64)>) {
        for c in chunks {
            match same_stream.iter().find(|q| q.0 == c) {
                Some(&q) => self.claims.quarantine.push(q),
                None => self.pool.put_bare(c),
            }
        }
    }

    pub(super) fn claim(
        &mut self,
        va: u64,
        len: u64,
        got: Vec<ChunkId>,
        release: Vec<(ChunkId, ChunkHandle, u64)>,
        create: Vec<u64>,
        spare: Vec<u64>,
    ) -> Step {
        let id = self.claims.new_id();
        let existing: Vec<(ChunkId, ChunkHandle, u64)> = got
            .iter()
            .map(|&c| {
                let ch = self.pool.get(c);
                (c, ch.handle, ch.pages)
            })
            .collect();
        let plan = MapPlan { id, va, len, page: self.lim.page, existing, release, create, spare };
        self.claims.create_pages += plan.created_pages();
        let chunks = got.into_iter().chain(plan.release.iter().map(|r| r.0)).collect();
        self.claims
            .plans
            .insert(id, Claim { chunks, va: Some((va, len)), same_stream: Vec::new() });
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
    pub(super) fn commit_mapping(&mut self, plan: MapPlan, ex: Executed) -> Result<Vec<ChunkId>> {
        let same_stream =
            self.claims.plans.remove(&plan.id).map(|c| c.same_stream).unwrap_or_default();
        self.claims.create_pages -= plan.created_pages();
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
        let reserved = &self.stats.reserved_bytes;
        self.notes.held_peak_due |= reserved.current == reserved.peak;
        self.stats.chunks.add(1);
        self.pool.insert(handle, pages)
    }

    pub(super) fn add_range(&mut self, va: u64, pages: u64, chunks: Chunks, use_: Use) -> RangeId {
        self.ranges.add(va, pages, chunks, use_)
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
                .bytes(self.pool.bare_pages() + self.cache.pages + self.window.mapped.pages()),
            cap: self.lim.cap,
            short: self.bytes(short_pages),
            driver,
        }
    }
}
