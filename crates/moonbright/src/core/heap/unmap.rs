//! Unmapping: retired ranges in batches once the work that used them has completed, chunk splits
//! that wait for their chunk's old mappings, releases of chunks no range uses, and the teardown of
//! a heap that goes away.

use super::{retired_ready, Claim, Heap, RangeId, Unmappable, CHUNK_SPLIT_CANDIDATES};
use crate::core::history::HistoryAction;
use crate::core::pool::ChunkId;
use crate::core::vaspace::{Retired, UnmapRun};
use crate::driver::{ChunkHandle, DriverError, EventHandle};

impl Heap {
    /// Whether an unmap batch is due (by count, bytes or age).
    pub fn unmap_due(&self) -> bool {
        let n = self.va.retired_count();
        n > 0
            && (n >= self.lim.unmap.batch_ranges
                || self.va.retired_bytes() >= self.lim.unmap.batch_bytes
                || self.va.retired_age() >= self.lim.unmap.batch_age)
    }

    /// The chunk to split when every bare chunk larger than `pages` is still mapped by retired
    /// ranges, and when its ranges can go: of the first `CHUNK_SPLIT_CANDIDATES`, smallest
    /// first, one whose ranges may all be unmapped now, so that the request unmaps those alone;
    /// else one whose ranges wait only for another thread's unmap batch; else the smallest.
    pub(super) fn split_candidate(&self, pages: u64) -> Option<ChunkId> {
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
            None => self.claims.unmapping > 0,
        }
    }

    /// Takes retired ranges whose stream work has completed out for unmapping, merged into runs:
    /// with `only`, the ranges that map that chunk if that is every mapping it has and all can
    /// go now (so it can be split), else none; otherwise all of them.
    pub fn take_unmap_batch(&mut self, only: Option<ChunkId>) -> Vec<UnmapRun> {
        let streams = &self.streams;
        let ready = |r: &Retired| retired_ready(streams, r);
        let max = self.lim.unmap.run_handles;
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
        self.claims.unmapping += runs.len();
        for run in &runs {
            if self.va.is_private(run.va) {
                self.claims.unmapping_private.push((run.va, run.len));
            }
        }
        runs
    }

    /// Commits an unmap batch of which the first `done` runs were unmapped; the rest stay retired.
    pub fn commit_unmap(&mut self, runs: Vec<UnmapRun>, done: usize, error: Option<DriverError>) {
        self.claims.unmapping -= runs.len();
        self.claims.unmapping_private.retain(|&(va, _)| !runs.iter().any(|r| r.va == va));
        if !runs.is_empty() {
            self.stats.unmap_batches += 1;
            self.stats.unmap_calls_in_batches += (done + error.is_some() as usize) as u64;
        }
        let mut runs = runs.into_iter();
        for run in runs.by_ref().take(done) {
            for part in &run.parts {
                if let Some(h) = &mut self.notes.history {
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
        let ranges = self
            .ranges
            .iter()
            .map(|(_, r)| r)
            .filter(|r| !r.asleep)
            .map(|r| (r.va, self.bytes(r.pages)));
        let window = self.window.mapped.segments().map(|(va, pages, _)| (va, self.bytes(pages)));
        let growables = self
            .growables
            .values()
            .filter(|g| !g.released && g.committed > 0)
            .map(|g| (g.base, self.bytes(g.committed)));
        ranges.chain(window).chain(growables).collect()
    }

    /// Whether an unmap batch taken out of the queue has not committed yet.
    pub fn unmaps_in_flight(&self) -> bool {
        self.claims.unmapping > 0
    }

    /// Retires every cached range and the window, for `release_unused`.
    pub fn retire_all_free(&mut self) {
        while let Some((&seq, _)) = self.cache.lru.iter().next() {
            self.steal_cached(seq);
        }
        while self.steal_window(u64::MAX) {}
        debug_assert_eq!(self.window.mapped.pages(), 0);
    }

    /// Takes out every bare chunk that is mapped nowhere, for release: a claim id (as a plan's)
    /// and the chunks.
    pub fn take_releasable(&mut self) -> (u64, Vec<(ChunkId, ChunkHandle, u64)>) {
        let mut out = Vec::new();
        while let Some(c) = self.pool.take_unmapped_bare() {
            let ch = self.pool.get(c);
            out.push((c, ch.handle, ch.pages));
        }
        let chunks = out.iter().map(|r| r.0).collect();
        let id = self.claims.add(Claim { chunks, ..Claim::default() });
        (id, out)
    }

    /// Takes out those of `chunks` that are bare and mapped nowhere, for release, as
    /// `take_releasable` does.
    pub(super) fn take_releasable_of(
        &mut self,
        chunks: &[ChunkId],
    ) -> (u64, Vec<(ChunkId, ChunkHandle, u64)>) {
        let mut out = Vec::new();
        for &c in chunks {
            if self.pool.get(c).mappings == 0 && self.pool.take_if_bare(c) {
                let ch = self.pool.get(c);
                out.push((c, ch.handle, ch.pages));
            }
        }
        let ids = out.iter().map(|r| r.0).collect();
        let id = self.claims.add(Claim { chunks: ids, ..Claim::default() });
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
        self.claims.plans.remove(&id);
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
        let leaked = self.live.allocs.len();
        let ids: Vec<RangeId> = self.ranges.by_va.values().copied().collect();
        for id in ids {
            let r = self.remove_range(id);
            if !r.asleep {
                let len = self.bytes(r.pages);
                self.retire(r.va, len, r.chunks.into_vec());
            }
        }
        for (va, pages, chunks) in self.window.mapped.drain() {
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
        let mut events: Vec<EventHandle> =
            self.streams.iter().flat_map(|(_, f)| f.all_events()).collect();
        events.append(&mut self.streams.stock);
        *self = Heap::new(self.lim);
        Teardown { leaked, runs, chunks, reservations, events }
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
