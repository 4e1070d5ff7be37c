//! Latency before memory (`Options::grow_first`, docs/design.md): while held memory stays
//! within the budget above the peak in use, the pages a plan still needs after bare chunks are
//! made new, in one chunk, instead of stolen; and carving may leave the budget's room unused.

use super::{Gather, Gathered, Placement};
use crate::core::heap::Heap;

pub(in crate::core::heap) struct GrowFirst;

impl Placement for GrowFirst {
    #[inline]
    fn gather(heap: &mut Heap, plan: &mut Gather) -> Gathered {
        if plan.large && heap.grows_first(plan.left, plan.len) {
            Gathered::Grow
        } else {
            Gathered::Nothing
        }
    }
}

impl Heap {
    /// Whether a request `len` bytes long makes its `left` missing pages new rather than steal
    /// cached ranges for them (`Options::grow_first`): held memory, with them and what plans
    /// in flight create, stays within `grow_first_per_1024` 1,024ths above the peak in use
    /// (the request counted as in use), and under the cap. They come as one chunk (up to
    /// `chunks.largest_pages`), one handle to map, as `cudaMalloc` makes a segment; a bare chunk
    /// larger than they need is not split for them (a release and two creates).
    fn grows_first(&self, left: u64, len: u64) -> bool {
        self.headroom() >= left && self.grow_first_room_bytes(len) >= self.bytes(left)
    }

    /// The pages `grow_first`'s budget has room for above held memory (and what plans in
    /// flight create), for a request `len` bytes long: carving may leave that many unused.
    pub(in crate::core::heap) fn grow_first_room(&self, pages: u64) -> u64 {
        self.grow_first_room_bytes(self.bytes(pages)) / self.lim.page
    }

    /// `grow_first_per_1024` 1,024ths above the peak in use (the request counted as in use),
    /// less held memory: in bytes.
    fn grow_first_room_bytes(&self, len: u64) -> u64 {
        let per_1024 = self.lim.shares.grow_first_per_1024;
        if per_1024 == 0 {
            return 0;
        }
        let allocated = &self.stats.allocated_bytes;
        let peak = allocated.peak.max(allocated.current + len) as u128;
        let held = self.bytes(self.pool.held_pages() + self.claims.create_pages) as u128;
        (peak * (1024 + per_1024 as u128) / 1024).saturating_sub(held).min(u64::MAX as u128) as u64
    }
}
