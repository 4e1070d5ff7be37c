//! The near fit: with no exact fit, the smallest cached range up to `Options::near_fit` larger,
//! whole; else a run of chunks up to `SPLIT_SLACK` larger split off a cached range (the exact
//! fit's search found it); else a prefix of a window segment, or a whole window chunk up to
//! `WINDOW_FIT_DIVISOR` larger. The extra pages stay with the allocation until it is freed,
//! counted as rounding (docs/design.md, "Exact before near, and the slack").

use super::{Ask, Placed, Placement};
use crate::core::heap::{Heap, Use};

/// A whole window chunk up to 1/8 larger than a fresh request serves it (no driver call).
const WINDOW_FIT_DIVISOR: u64 = 8;

/// A run of chunks split off a cached range may hold up to 1/SPLIT_SLACK more than the request,
/// where no run holds it exactly.
pub(super) const SPLIT_SLACK: u64 = 64;

pub(in crate::core::heap) struct NearFit;

impl Placement for NearFit {
    #[inline]
    fn serve(heap: &mut Heap, ask: &mut Ask) -> Option<Placed> {
        let pages = ask.pages;
        let slack = pages * heap.lim.shares.near_fit_per_1024 / 1024;
        let near = heap.cache.by_size.range((pages + 1, 0, 0)..(pages + slack + 1, 0, 0)).next();
        if let Some(&(_, _, seq)) = near {
            heap.stats.cache_hits += 1;
            return Some(Placed::Range(heap.uncache(seq)));
        }
        if let Some((seq, start, end)) = ask.near_run {
            heap.stats.cache_hits += 1;
            return Some(Placed::Range(heap.split_off(seq, start, end)));
        }
        if let Some((va, got, chunks)) =
            heap.window.mapped.take(pages, pages + pages / WINDOW_FIT_DIVISOR)
        {
            heap.stats.window_hits += 1;
            heap.stats.window_bytes.sub(heap.bytes(got));
            heap.note_fresh(pages, got);
            return Some(Placed::Range(heap.add_range(va, got, chunks, Use::Alloc)));
        }
        None
    }
}
