//! Live allocations by pointer, and the recently freed pointers that tell a double free from an
//! unknown pointer.

use std::collections::VecDeque;

// Keys are the allocator's own pointers, hashed on every request: a fast hash, not a
// DoS-resistant one.
use foldhash::HashMap;

use super::RangeId;
use crate::tags::TagId;

/// How many recently freed pointers are remembered to tell a double free from an unknown pointer.
pub(super) const RECENT_FREES: usize = 4096;

/// Where a live allocation lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Backing {
    Range(RangeId),
    Sub { arena: RangeId, offset: u64 },
}

#[derive(Clone, Debug)]
pub(super) struct Live {
    pub(super) size: u64,
    pub(super) rounded: u64,
    pub(super) stream: u64,
    pub(super) backing: Backing,
    /// Other streams whose work uses it (`record_use`), if any: a free on a stream waits for
    /// them too.
    pub(super) uses: Vec<u64>,
    /// Freed by its user into the graph pool that owns it (`pool_keep`): still the pool's and
    /// mapped, but no longer counted as allocated or active, nor shown as a block in use.
    pub(super) pooled: bool,
    /// Its tag (0: none), `crate::tags`.
    pub(super) tag: TagId,
}

/// Live allocations, and recently freed pointers: pointer -> the generation of its last free,
/// and the frees in order (stale entries are skipped when they reach the front), so both
/// remembering and forgetting cost O(1).
#[derive(Debug, Default)]
pub(super) struct LiveTable {
    pub(super) allocs: HashMap<u64, Live>,
    pub(super) recent_frees: VecDeque<(u64, u64)>,
    pub(super) recent_free_gen: HashMap<u64, u64>,
    pub(super) free_generation: u64,
}

impl LiveTable {
    /// Remembers a freed pointer, to tell a double free from an unknown pointer.
    pub(super) fn remember_free(&mut self, ptr: u64) {
        if self.recent_frees.len() == RECENT_FREES {
            if let Some((old, generation)) = self.recent_frees.pop_front() {
                if self.recent_free_gen.get(&old) == Some(&generation) {
                    self.recent_free_gen.remove(&old);
                }
            }
        }
        self.free_generation += 1;
        self.recent_frees.push_back((ptr, self.free_generation));
        self.recent_free_gen.insert(ptr, self.free_generation);
    }

    /// Forgets that `ptr` was freed: it is handed out again.
    #[inline]
    pub(super) fn forget_free(&mut self, ptr: u64) {
        self.recent_free_gen.remove(&ptr);
    }

    /// Whether `ptr` was freed lately (and not handed out since).
    pub(super) fn freed_lately(&self, ptr: u64) -> bool {
        self.recent_free_gen.contains_key(&ptr)
    }
}
