//! The range table: every mapped range the heap serves from (live, arena, pending, cached), by
//! id and by base address. It keeps the two in step; what a range is for is its `Use`.

use std::collections::BTreeMap;

use super::RangeId;
use crate::core::chunks::Chunks;

/// What a mapped range is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Use {
    /// Backs one allocation of a page or more.
    Alloc,
    /// An arena of the sub-page allocator.
    Arena,
    /// A carved arena: blocks of a page or more cut out of a cached range (`Options::carve`).
    Carved,
    /// Freed on a stream whose work may still use it: only that stream may reuse it.
    Pending,
    /// An arena with no block in use whose space one stream still holds (`Emptied::held`): as
    /// `Pending`, but its blocks' frees are in the history already, and no allocation's is.
    PendingArena,
    /// Free, still mapped, reusable as it is; `seq` orders the cache from least recently freed.
    Cached { seq: u64 },
}

/// Chunks mapped back to back at `va`.
#[derive(Clone, Debug)]
pub(super) struct Range {
    pub(super) va: u64,
    pub(super) pages: u64,
    pub(super) chunks: Chunks,
    pub(super) use_: Use,
    /// Its tag is asleep: unmapped (no chunks), its address kept (`sleep.rs`).
    pub(super) asleep: bool,
}

/// Ranges by id (ids of removed ranges are reused) and by base address.
#[derive(Debug, Default)]
pub(super) struct Ranges {
    pub(super) slots: Vec<Option<Range>>,
    pub(super) free_ids: Vec<RangeId>,
    /// Live, pending and cached ranges by base address.
    pub(super) by_va: BTreeMap<u64, RangeId>,
}

impl Ranges {
    #[inline]
    pub(super) fn get(&self, id: RangeId) -> &Range {
        self.slots[id as usize].as_ref().expect("no such range")
    }

    #[inline]
    pub(super) fn get_mut(&mut self, id: RangeId) -> &mut Range {
        self.slots[id as usize].as_mut().expect("no such range")
    }

    /// The range `id`, if there is one.
    pub(super) fn try_get(&self, id: RangeId) -> Option<&Range> {
        self.slots.get(id as usize).and_then(|r| r.as_ref())
    }

    /// Adds a range of `pages` pages mapped at `va`; returns its id.
    pub(super) fn add(&mut self, va: u64, pages: u64, chunks: Chunks, use_: Use) -> RangeId {
        let range = Range { va, pages, chunks, use_, asleep: false };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.slots[id as usize] = Some(range);
                id
            }
            None => {
                self.slots.push(Some(range));
                (self.slots.len() - 1) as RangeId
            }
        };
        self.by_va.insert(va, id);
        id
    }

    /// Takes range `id` out of the table.
    pub(super) fn remove(&mut self, id: RangeId) -> Range {
        let range = self.slots[id as usize].take().expect("range missing");
        self.free_ids.push(id);
        self.by_va.remove(&range.va);
        range
    }

    /// The range that starts at or below `ptr`, nearest first: (base, id).
    pub(super) fn at_or_below(&self, ptr: u64) -> Option<(u64, RangeId)> {
        self.by_va.range(..=ptr).next_back().map(|(&va, &id)| (va, id))
    }

    /// Every range, with its id.
    pub(super) fn iter(&self) -> impl Iterator<Item = (RangeId, &Range)> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, r)| r.as_ref().map(|r| (i as RangeId, r)))
    }
}
