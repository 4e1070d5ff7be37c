//! Stealing: where a plan's pages come from once bare chunks run out (and `GrowFirst` did not
//! make them new), in order: a cached range with a chunk that fits (`StealFitting`), the
//! window's tail (`WindowTail`), the stream's own quarantined chunks (`OwnQuarantine`) and
//! pending ranges that fit (`OwnPending`), a larger pending range of its own broken up
//! (`BreakOwnPending`), the least recently freed cached range for a chunk to split
//! (`StealOldest`), and last a whole window chunk (`WindowWhole`). Stealing and splitting come
//! before creating, so reserved memory stays close to what is in use (docs/design.md, "Why
//! only ranges with a chunk that fits").

use super::{Gather, Gathered, Placement};
use crate::core::heap::Heap;

/// Cached ranges, least recently freed first, a plan looks into for the one with the largest
/// chunk no larger than what it still needs (`Heap::fitting_cached`) each time it steals one,
/// and in all: the search runs under the heap lock.
const STEAL_CANDIDATES: usize = 256;
const STEAL_LOOKS: usize = 1024;

/// Took something: `Gathered::Took`, else `Gathered::Nothing`.
#[inline]
fn took(yes: bool) -> Gathered {
    if yes {
        Gathered::Took
    } else {
        Gathered::Nothing
    }
}

/// The cached range with the largest chunk that fits what the plan still needs, broken up.
pub(in crate::core::heap) struct StealFitting;

impl Placement for StealFitting {
    fn gather(heap: &mut Heap, plan: &mut Gather) -> Gathered {
        let Some(seq) = heap.fitting_cached(&mut plan.steal_scan, plan.left) else {
            return Gathered::Nothing;
        };
        heap.steal_cached(seq);
        Gathered::Took
    }
}

/// Pages back from the window's tail.
pub(in crate::core::heap) struct WindowTail;

impl Placement for WindowTail {
    fn gather(heap: &mut Heap, plan: &mut Gather) -> Gathered {
        took(heap.steal_window(plan.left))
    }
}

/// Chunks the stream itself gave back (a growable's shrink): stream order makes them safe for
/// it at once. If the plan fails they return to the quarantine. Exported ones wait there to be
/// doomed, never reused: an importer may still map them.
pub(in crate::core::heap) struct OwnQuarantine;

impl Placement for OwnQuarantine {
    fn gather(heap: &mut Heap, plan: &mut Gather) -> Gathered {
        let (stream, left) = (plan.stream, plan.left);
        let own = heap
            .claims
            .quarantine
            .iter()
            .enumerate()
            .filter(|(_, q)| {
                let c = heap.pool.get(q.0);
                q.1 == stream && c.pages <= left && !c.exported
            })
            .max_by_key(|(_, q)| heap.pool.get(q.0).pages)
            .map(|(i, _)| i);
        let Some(i) = own else {
            return Gathered::Nothing;
        };
        let q = heap.claims.quarantine.swap_remove(i);
        plan.left -= heap.pool.get(q.0).pages;
        plan.got.push(q.0);
        plan.same_stream.push(q);
        Gathered::Took
    }
}

/// The stream's own pending frees: its later work is ordered after its earlier work, so their
/// pages may serve it now; the old addresses are unmapped only once the earlier work has
/// completed. Their chunks go straight into this range, never bare.
pub(in crate::core::heap) struct OwnPending;

impl Placement for OwnPending {
    fn gather(heap: &mut Heap, plan: &mut Gather) -> Gathered {
        let (stream, left) = (plan.stream, plan.left);
        let Some((id, p, epoch)) =
            heap.streams.get_mut(stream).and_then(|f| f.take_covered_range_at_most(left))
        else {
            return Gathered::Nothing;
        };
        heap.streams.range_left(p);
        let range = heap.remove_range(id);
        plan.left -= p;
        plan.got.extend(range.chunks.iter().copied());
        plan.same_stream.extend(range.chunks.iter().map(|&c| (c, stream, epoch)));
        heap.stats.cached_ranges_stolen += 1;
        heap.retire_after(range.va, heap.bytes(p), range.chunks.into_vec(), Some((stream, epoch)));
        Gathered::Took
    }
}

/// A larger pending range of the stream's own, with a chunk that fits: broken up. Its chunks
/// wait in the quarantine, where this stream takes them at once (`OwnQuarantine`) and others
/// once its work has passed them.
pub(in crate::core::heap) struct BreakOwnPending;

impl Placement for BreakOwnPending {
    fn gather(heap: &mut Heap, plan: &mut Gather) -> Gathered {
        took(heap.break_up_own_pending(plan.stream, plan.left))
    }
}

/// No cached range has a chunk that fits: the least recently freed one, broken up for its
/// chunks to be split, unless a bare chunk can be split already.
pub(in crate::core::heap) struct StealOldest;

impl Placement for StealOldest {
    fn gather(heap: &mut Heap, plan: &mut Gather) -> Gathered {
        if heap.pool.has_bare_larger_than(plan.left) {
            return Gathered::Nothing;
        }
        let Some((&seq, _)) = heap.cache.lru.iter().next() else {
            return Gathered::Nothing;
        };
        heap.steal_cached(seq);
        Gathered::Took
    }
}

/// Whole window chunks larger than what is left come last, as they must be split: one, only
/// when no new memory can be made and no bare chunk can be split instead.
pub(in crate::core::heap) struct WindowWhole;

impl Placement for WindowWhole {
    fn gather(heap: &mut Heap, plan: &mut Gather) -> Gathered {
        took(
            heap.headroom() < plan.left
                && !heap.pool.has_bare_larger_than(plan.left)
                && heap.steal_window_whole(),
        )
    }
}

impl Heap {
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
        for (looked, (&seq, &id)) in self.cache.lru.range(scan.0..).enumerate() {
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

    /// Breaks up the oldest covered pending range of `stream` that holds a chunk of at most
    /// `fit` pages: its chunks go to the quarantine under its epoch, its addresses are retired
    /// after that epoch. Returns whether it found one.
    fn break_up_own_pending(&mut self, stream: u64, fit: u64) -> bool {
        let pool = &self.pool;
        let ranges = &self.ranges;
        let has_fit = |id: u32| {
            ranges.try_get(id).is_some_and(|r| r.chunks.iter().any(|&c| pool.get(c).pages <= fit))
        };
        let Some((id, pages, epoch)) =
            self.streams.get_mut(stream).and_then(|f| f.take_covered_range_where(has_fit))
        else {
            return false;
        };
        self.streams.range_left(pages);
        let range = self.remove_range(id);
        self.claims.quarantine.extend(range.chunks.iter().map(|&c| (c, stream, epoch)));
        self.stats.cached_ranges_stolen += 1;
        self.retire_after(
            range.va,
            self.bytes(pages),
            range.chunks.into_vec(),
            Some((stream, epoch)),
        );
        true
    }
}
