//! Carving (`Options::carve`, docs/design.md, "Carved arenas"): a request that no cached range
//! holds exactly takes its pages out of the run of cached chunks that spares the fewest, where
//! they are mapped (`NewCarving`); what it leaves there serves later requests page-granular,
//! through a second instance of the sub-page allocator (`CarvedBlock`, before every other fast
//! policy). The budget for the pages carved arenas leave unused is decided here too.

use super::{Ask, Placed, Placement};
use crate::core::heap::{Backing, Heap, Use};
use crate::core::pool::ChunkId;

/// Cached ranges and groups of cached neighbours a new carved arena is chosen from (the smallest
/// first), and the chunks looked at in all. The search runs under the lock on every miss that
/// the cache serves no other way while the budget has room; with 64 of each and 2,048 chunks
/// it took 9 µs a call on the host backend (2-core machine, GPT-2's trace) and raised the
/// trace's alloc p99 by a third, for no fewer maps.
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

/// A block of a carved arena, by best fit over their free extents the stream may take.
pub(in crate::core::heap) struct CarvedBlock;

impl Placement for CarvedBlock {
    #[inline]
    fn serve(heap: &mut Heap, ask: &mut Ask) -> Option<Placed> {
        if ask.tag != 0 {
            return None;
        }
        heap.take_carved(ask.size, ask.pages, ask.stream).map(Placed::Block)
    }
}

/// A new carved arena cut from the tightest run of cached chunks, within the budget; a size a
/// recent request had too (`core/sizes.rs`) carves under `carve_repeated`.
pub(in crate::core::heap) struct NewCarving;

impl Placement for NewCarving {
    #[inline]
    fn serve(heap: &mut Heap, ask: &mut Ask) -> Option<Placed> {
        if ask.tag != 0 {
            return None;
        }
        let repeated = heap.tells_repeated() && heap.notes.sizes.contains(ask.size);
        heap.start_carving(ask.size, ask.pages, ask.stream, repeated).map(Placed::Block)
    }
}

impl Heap {
    /// Whether carving is on (`Options::carve`; 0 turns it off, repeated sizes included).
    pub(in crate::core::heap) fn carving(&self) -> bool {
        self.lim.shares.carve_per_1024 > 0
    }

    /// Whether requests' sizes are kept (`sizes`), for carving's budget for repeated sizes
    /// (none: every size carves under `carve_per_1024`).
    pub(in crate::core::heap) fn tells_repeated(&self) -> bool {
        self.carving() && self.lim.shares.carve_repeated_per_1024 > 0
    }

    /// A block of `pages` pages from a carved arena (`Options::carve`), by best fit over their
    /// free extents that `stream` may take.
    fn take_carved(&mut self, size: u64, pages: u64, stream: u64) -> Option<u64> {
        if !self.carving() {
            return None;
        }
        let (arena, offset) = self.carved.alloc(self.bytes(pages), stream, 0)?;
        let ptr = self.range(arena).va + offset;
        self.stats.carved_allocations += 1;
        self.stats.cache_hits += 1;
        self.finish_live(ptr, size, self.bytes(pages), stream, Backing::Sub { arena, offset }, 0);
        Some(ptr)
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
            peak.min(CARVE_TAPER * (peak - now)) / 1024 * self.lim.shares.carve_repeated_per_1024
        } else {
            peak / 1024 * self.lim.shares.carve_per_1024
        };
        // With `grow_first`, whatever room its budget has left above held memory too.
        let room = self.grow_first_room(pages);
        let allowed = match budget.checked_sub(self.carved.free_bytes()) {
            Some(b) => (b / self.lim.page).max(room),
            None if room > 0 => room,
            None => return None,
        };
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
            for &(_, _, seq) in self.cache.by_size.range((pages + 1, 0, 0)..).take(CARVE_RANGES) {
                if seen >= CARVE_CHUNKS_SEEN {
                    break;
                }
                let chunks = &self.range(self.cache.lru[&seq]).chunks;
                let skip = chunks.len().saturating_sub(CARVE_CHUNKS_SEEN - seen);
                seen += chunks.len() - skip;
                let size = |i: usize| self.pool.get(chunks[skip + i]).pages;
                if consider(Carve::Range(seq), skip, chunks.len() - skip, &size) {
                    break 'search;
                }
            }
            let mut ids: Vec<ChunkId> = Vec::new();
            for &(p, start) in self.cache.groups_by_size.range((pages + 1, 0)..).take(CARVE_GROUPS)
            {
                if seen >= CARVE_CHUNKS_SEEN {
                    break;
                }
                let end = start + self.bytes(p);
                ids.clear();
                for (_, &(_, _, id)) in self.cache.by_va.range(start..end) {
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
                self.cache.by_va.range(start..end).map(|(_, &(seq, _, _))| seq).collect()
            }
        };
        let id = self.join_run(&group, a, b);
        let tail = pages + spare;
        self.stats.carved_arenas += 1;
        self.range_mut(id).use_ = Use::Carved;
        self.carved.add_arena(id, self.bytes(tail), 0);
        self.take_carved(size, pages, stream)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

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
                    if sum < pages || !shortest {
                        continue;
                    }
                    if want.map_or(true, |w: (usize, usize, u64)| sum - pages <= w.2) {
                        want = Some((a, b, sum - pages));
                    }
                }
            }
            proptest::prop_assert_eq!(tightest_run(sizes.len(), |i| sizes[i], pages), want);
        }
    }
}
