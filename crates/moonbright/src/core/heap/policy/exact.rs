//! The exact fit: a range of exactly the pages asked for with no driver call. The stream's own
//! pending frees and the cache, lowest address first; else a run of whole chunks split off a
//! larger cached range, or across cached neighbours joined (docs/design.md, "Why splits", "Why
//! joins"). Its search of the cached ranges also finds the near fit's run.

use super::near::SPLIT_SLACK;
use super::{Ask, CachedRun, Placed, Placement};
use crate::core::heap::{Heap, RangeId, Use};
use crate::core::history::HistoryAction;
use crate::core::pool::ChunkId;

/// Cached ranges, smallest first, that a request looks into for a run of chunks to split off,
/// and the chunks it looks at in all: a miss that then maps anyway pays for the search under
/// the heap lock, so the search is bounded (a few microseconds).
const SPLIT_CANDIDATES: usize = 64;
const SPLIT_CHUNKS_SEEN: usize = 2048;

/// Chunks a request that found no run in any one cached range looks at in all, in groups of
/// cached neighbours large enough, smallest first, for a run across them (`Heap::split_joined`).
const JOIN_CHUNKS_SEEN: usize = 512;

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

/// Exact before near: extra pages held by live allocations are held at the peak too. With
/// near fits before exact splits, ResNet-50's trace held 1.015 of its peak (host backend)
/// against 1.010 now, its page-rounding floor plus its arenas' spare room (design.md,
/// "Exact before near"). Lowest address first (not newest), so that the same requests in the
/// same order get the same ranges back whether or not their frees have completed, as from
/// PyTorch's allocator.
pub(in crate::core::heap) struct ExactFit;

impl Placement for ExactFit {
    /// The stream's own pending frees, the cache, a run split off a cached range or across
    /// cached neighbours. A miss hands on the near run its search found, for `NearFit`.
    #[inline]
    fn serve(heap: &mut Heap, ask: &mut Ask) -> Option<Placed> {
        let (pages, stream) = (ask.pages, ask.stream);
        let exact =
            heap.cache.by_size.range((pages, 0, 0)..=(pages, u64::MAX, u64::MAX)).next().copied();
        let own = heap.streams.get_mut(stream).and_then(|f| {
            let (va, seq) = f.peek_range(pages)?;
            (!exact.is_some_and(|c| c.1 < va)).then(|| f.take(seq))
        });
        if let Some(id) = own {
            heap.streams.range_left(pages);
            let r = heap.range(id);
            if r.use_ == Use::Pending {
                heap.note(HistoryAction::FreeCompleted, r.va, heap.bytes(pages), stream);
            }
            heap.stats.cache_hits += 1;
            return Some(Placed::Range(id));
        }
        if let Some((_, _, seq)) = exact {
            heap.stats.cache_hits += 1;
            return Some(Placed::Range(heap.uncache(seq)));
        }
        let (exact_run, near_run) = heap.split_cached(pages);
        let exact_run = exact_run.map(|(seq, start, end)| heap.split_off(seq, start, end));
        if let Some(id) = exact_run.or_else(|| heap.split_joined(pages)) {
            heap.stats.cache_hits += 1;
            return Some(Placed::Range(id));
        }
        ask.near_run = near_run;
        None
    }
}

impl Heap {
    /// Runs of whole chunks in larger cached ranges to split off with no driver call (each
    /// chunk is mapped on its own, so the pieces are mapped ranges as they are; what is left on
    /// either side stays cached): one of exactly `pages` pages, and else the first found that
    /// holds them to within `SPLIT_SLACK`, as (cached range, first chunk, one past the last).
    /// Takes nothing: the caller splits the run it picks (`split_off`).
    fn split_cached(&self, pages: u64) -> (Option<CachedRun>, Option<CachedRun>) {
        let most = pages + pages / SPLIT_SLACK;
        let (mut seen, mut near) = (0, None);
        let mut exact = None;
        for &(_, _, seq) in self.cache.by_size.range((pages + 1, 0, 0)..).take(SPLIT_CANDIDATES) {
            let chunks = &self.range(self.cache.lru[&seq]).chunks;
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
        if self.cache.pages < pages {
            return None;
        }
        // The smallest group large enough with a run of exactly `pages` pages: where it lies,
        // and the run in its chunks.
        let mut best = None;
        let mut ids: Vec<ChunkId> = Vec::new();
        for &(group_pages, start) in self.cache.groups_by_size.range((pages, 0)..) {
            if ids.len() >= JOIN_CHUNKS_SEEN {
                break;
            }
            let end = start + self.bytes(group_pages);
            let first = ids.len();
            for (_, &(_, _, id)) in self.cache.by_va.range(start..end) {
                ids.extend(self.range(id).chunks.iter().copied());
            }
            let size = |i: usize| self.pool.get(ids[first + i]).pages;
            if let Some((a, b)) = chunk_run(ids.len() - first, size, pages, pages) {
                best = Some((start, end, a, b));
                break;
            }
        }
        let (start, end, run_start, run_end) = best?;
        let group: Vec<u64> = self.cache.by_va.range(start..end).map(|(_, &(q, _, _))| q).collect();
        Some(self.join_run(&group, run_start, run_end))
    }
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
}
