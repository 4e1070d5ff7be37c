//! The cache of freed ranges and the mapped window: ranges kept mapped for reuse as they are,
//! their groups of cached neighbours, runs split off or joined at chunk boundaries, ranges stolen
//! for a plan, and the window of pages the background worker maps ahead.

use std::collections::{BTreeMap, BTreeSet};

use super::{Heap, Range, RangeId, Ranges, Step, Use};
use crate::core::chunks::Chunks;
use crate::core::mapping::{Executed, MapPlan};
use crate::core::pool::ChunkId;
use crate::core::vaspace::{Retired, VaSpace};
use crate::error::Result;

/// The cached ranges: free, still mapped, reusable as they are. Indexed as (pages, address,
/// seq) for size searches, seq -> range in freeing order (least recently freed first), and
/// address -> (seq, pages, range); with the groups of cached neighbours: each run of two or more
/// cached ranges back to back in one reservation, as start -> end, and as (pages, start) for
/// `split_joined`, which so finds the smallest group large enough with no scan of the cache.
/// Every index holds every cached range, and the groups are exactly the runs of neighbours
/// (`Heap::check`).
#[derive(Debug, Default)]
pub(super) struct Cache {
    pub(super) by_size: BTreeSet<(u64, u64, u64)>,
    pub(super) lru: BTreeMap<u64, RangeId>,
    pub(super) by_va: BTreeMap<u64, (u64, u64, RangeId)>,
    pub(super) groups: BTreeMap<u64, u64>,
    pub(super) groups_by_size: BTreeSet<(u64, u64)>,
    /// Pages in cached ranges.
    pub(super) pages: u64,
    pub(super) next_seq: u64,
}

/// Whether two addresses lie in one reservation: ranges side by side in two reservations
/// never join (one `cuMemUnmap` may not span both).
fn same_reservation(va: &VaSpace, a: u64, b: u64) -> bool {
    va.reservation_of(a) == va.reservation_of(b)
}

impl Cache {
    /// Caches range `id` of `pages` pages at `va`: returns its sequence number.
    fn insert(&mut self, id: RangeId, va: u64, pages: u64, space: &VaSpace, page: u64) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.by_size.insert((pages, va, seq));
        self.lru.insert(seq, id);
        self.by_va.insert(va, (seq, pages, id));
        self.group(va, va + pages * page, space, page);
        self.pages += pages;
        seq
    }

    /// Takes cached range `seq` (of `pages` pages at `va`) out of the cache: returns its id.
    fn remove(&mut self, seq: u64, ranges: &Ranges, page: u64) -> RangeId {
        let id = self.lru.remove(&seq).expect("cached range missing");
        let (pages, va) = (ranges.get(id).pages, ranges.get(id).va);
        self.by_size.remove(&(pages, va, seq));
        self.by_va.remove(&va);
        self.ungroup(va, va + pages * page, page);
        self.pages -= pages;
        id
    }

    /// Puts the cached range at `va..end` into its group of neighbours: the groups (or lone
    /// cached ranges) that end where it starts and start where it ends become one with it.
    fn group(&mut self, va: u64, end: u64, space: &VaSpace, page: u64) {
        let mut start = va;
        if let Some((&at, &(_, p, _))) = self.by_va.range(..va).next_back() {
            if at + p * page == va && same_reservation(space, at, va) {
                start = match self.groups.range(..va).next_back() {
                    Some((&s, &e)) if e == va => {
                        self.remove_group(s, e, page);
                        s
                    }
                    _ => at,
                };
            }
        }
        let mut stop = end;
        if let Some(&(_, p, _)) = self.by_va.get(&end) {
            if same_reservation(space, va, end) {
                stop = match self.groups.get(&end) {
                    Some(&e) => {
                        self.remove_group(end, e, page);
                        e
                    }
                    None => end + p * page,
                };
            }
        }
        if (start, stop) != (va, end) {
            self.add_group(start, stop, page);
        }
    }

    /// Takes the cached range at `va..end` (already out of `by_va`) out of its group: what
    /// lies before and after it stays a group where two or more ranges are left.
    fn ungroup(&mut self, va: u64, end: u64, page: u64) {
        let Some((&start, &stop)) = self.groups.range(..=va).next_back() else {
            return;
        };
        if stop < end {
            return; // The range was in no group.
        }
        self.remove_group(start, stop, page);
        let lone =
            |at: u64, to: u64| self.by_va.get(&at).is_some_and(|&(_, p, _)| at + p * page == to);
        let (before, after) = (start < va && !lone(start, va), end < stop && !lone(end, stop));
        if before {
            self.add_group(start, va, page);
        }
        if after {
            self.add_group(end, stop, page);
        }
    }

    fn add_group(&mut self, start: u64, end: u64, page: u64) {
        self.groups.insert(start, end);
        self.groups_by_size.insert(((end - start) / page, start));
    }

    fn remove_group(&mut self, start: u64, end: u64, page: u64) {
        self.groups.remove(&start);
        self.groups_by_size.remove(&((end - start) / page, start));
    }
}

impl Heap {
    pub(super) fn cache_range(&mut self, id: RangeId) {
        if self.holds_exported(id) {
            // Exported memory is never reused here: another process may still map it.
            self.discard_range(id, None);
            return;
        }
        let r = self.ranges.get_mut(id);
        r.use_ = Use::Cached { seq: self.cache.insert(id, r.va, r.pages, &self.va, self.lim.page) };
        self.stats.cached_ranges.add(1);
    }

    /// Whether two addresses lie in one reservation: ranges side by side in two reservations
    /// never join (one `cuMemUnmap` may not span both).
    pub(super) fn same_reservation(&self, a: u64, b: u64) -> bool {
        self.va.reservation_of(a) == self.va.reservation_of(b)
    }

    pub(super) fn uncache(&mut self, seq: u64) -> RangeId {
        let id = self.cache.remove(seq, &self.ranges, self.lim.page);
        self.stats.cached_ranges.sub(1);
        id
    }

    pub(super) fn remove_range(&mut self, id: RangeId) -> Range {
        self.ranges.remove(id)
    }

    /// Splits chunks `start..end` off cached range `seq`, as a range of their own at the
    /// address where they are mapped (returned, out of the cache); what is left on either side
    /// stays cached.
    pub(super) fn split_off(&mut self, seq: u64, start: usize, end: usize) -> RangeId {
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

    /// Joins the cached ranges of `group` (back to back, in address order) that chunks
    /// `start..end` of theirs touch, and splits that run off as a range of its own (returned,
    /// out of the cache): what is left on either side stays cached.
    pub(super) fn join_run(&mut self, group: &[u64], start: usize, end: usize) -> RangeId {
        // Join the ranges the run touches: from the one holding its first chunk to the one
        // holding its last.
        let (mut first, mut offset, mut last) = (None, 0, 0);
        let mut at = 0;
        for (i, seq) in group.iter().enumerate() {
            let n = self.range(self.cache.lru[seq]).chunks.len();
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

    /// Breaks up a cached range: its chunks become bare at once (a chunk may be mapped at a second
    /// address before the first is unmapped) and its addresses are retired.
    pub(super) fn steal_cached(&mut self, seq: u64) {
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
    pub(super) fn steal_window(&mut self, pages: u64) -> bool {
        let taken = self.window.mapped.take_tail(pages);
        self.steal_from_window(taken)
    }

    /// Takes the window's smallest whole chunk back, whatever its size.
    pub(super) fn steal_window_whole(&mut self) -> bool {
        let taken = self.window.mapped.take_smallest_whole();
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

    pub(super) fn retire(&mut self, va: u64, len: u64, chunks: Vec<ChunkId>) {
        self.retire_after(va, len, chunks, None);
    }

    pub(super) fn retire_after(
        &mut self,
        va: u64,
        len: u64,
        chunks: Vec<ChunkId>,
        after: Option<(u64, u64)>,
    ) {
        self.stats.retired_ranges.add(1);
        self.va.retire(Retired { va, len, chunks, after });
    }

    /// Since the last call (the mapper's measure of demand): the pages fresh allocations took,
    /// and the largest of their requests, in pages.
    pub fn take_fresh_demand(&mut self) -> (u64, u64) {
        self.window.take_fresh_demand()
    }

    /// Whether a request mapped a range of its own within `recent`: the driver seems to
    /// serialise VMM calls across threads, so the mapper's calls would lengthen such requests.
    pub fn requests_mapping_within(&self, recent: std::time::Duration) -> bool {
        self.window.last_request_map.is_some_and(|t| t.elapsed() < recent)
    }

    pub fn window_pages(&self) -> u64 {
        self.window.mapped.pages()
    }

    /// The size, in pages, of the whole window chunks to map for fresh requests of up to
    /// `largest` pages: `largest` itself if new memory of that size would be created as large
    /// chunks (`chunk_cap`) and one chunk can hold it; else 0, one-page chunks.
    pub fn whole_window_chunk(&self, largest: u64) -> u64 {
        let large = self.lim.chunks.large_pages..=self.lim.chunks.largest_pages;
        if self.lim.chunks.largest_pages > self.lim.chunks.max_pages && large.contains(&largest) {
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
        let (next, end) = self.window.slab;
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
            self.window.slab.0 += self.bytes(pages);
            next
        } else {
            if slab_left > 0 {
                self.va.recycle(next, end - next);
            }
            let slab = self.bytes(self.lim.window_slab_pages.max(pages));
            let Some(base) = self.va.take_fresh(slab) else {
                self.window.slab = (0, 0);
                for c in got {
                    self.pool.put_bare(c);
                }
                if self.va.unmap_could_free(slab)
                    || self.claims.unmapping > self.claims.unmapping_private.len()
                {
                    return Some(Step::Flush(None));
                }
                let size = self.lim.reserve_bytes.max(slab);
                if self.va.reserved_bytes() + size > self.lim.va_limit {
                    return None;
                }
                return Some(Step::Reserve(size));
            };
            self.window.slab = (base + self.bytes(pages), base + slab);
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
            [c] if pages > 1 => self.window.mapped.add_whole(va, c, pages),
            _ => self.window.mapped.add(va, chunks),
        }
        Ok(())
    }
}
