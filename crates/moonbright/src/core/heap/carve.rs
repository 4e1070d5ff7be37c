//! Carved arenas' books (`Options::carve`, docs/design.md, "Carved arenas"): chunks whose
//! blocks are all freed go back to the cache as frees come, cut out of their arena where they
//! are mapped. Where arenas are carved from, and their budget, is a placement policy
//! (`policy/carve.rs`).

use super::{Backing, Heap, RangeId};
use crate::core::chunks::Chunks;
use crate::core::subpage::{Emptied, Owner};

impl Heap {
    /// Gives the whole chunks that lie in free space of carved arenas back (`uncarve`), for
    /// the arenas where free space grew.
    pub(super) fn uncarve_freed(&mut self) {
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
                    if let Some(live) = self.live.allocs.get_mut(&(va + off)) {
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
    pub(super) fn free_chunk_runs(&self, id: RangeId) -> Vec<(u64, u64, Owner)> {
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
}
