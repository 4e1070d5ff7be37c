//! The sub-page allocator: requests smaller than a page are carved out of *arenas* (one-page
//! ranges) by best fit over free extents across all arenas, in units of 256 bytes (cudaMalloc's
//! alignment). An arena that empties is handed back to the heap whole. Pure bookkeeping.

use std::collections::{BTreeMap, BTreeSet};

/// Alignment and rounding unit of sub-page allocations, as cudaMalloc guarantees.
pub const SUBPAGE_ALIGN: u64 = 256;

/// Arenas are identified by the heap's range id.
pub(crate) type ArenaId = u32;

#[derive(Debug)]
struct Arena {
    len: u64,
    /// Free extents, offset -> len, coalesced.
    free: BTreeMap<u64, u64>,
    /// Used blocks, offset -> len (for interior-pointer errors and checks).
    used: BTreeMap<u64, u64>,
    used_bytes: u64,
}

#[derive(Debug, Default)]
pub(crate) struct SubPage {
    arenas: BTreeMap<ArenaId, Arena>,
    /// Every free extent as (len, arena, offset): best fit is one range query; ties go to the
    /// oldest arena and lowest offset, which packs blocks and lets younger arenas empty.
    by_size: BTreeSet<(u64, ArenaId, u64)>,
}

impl SubPage {
    pub fn add_arena(&mut self, id: ArenaId, len: u64) {
        let mut free = BTreeMap::new();
        free.insert(0, len);
        self.by_size.insert((len, id, 0));
        let prev =
            self.arenas.insert(id, Arena { len, free, used: BTreeMap::new(), used_bytes: 0 });
        debug_assert!(prev.is_none());
    }

    /// Forgets an empty arena.
    pub fn remove_arena(&mut self, id: ArenaId) {
        let a = self.arenas.remove(&id).expect("remove_arena: no such arena");
        debug_assert_eq!(a.used_bytes, 0);
        for (off, len) in a.free {
            self.by_size.remove(&(len, id, off));
        }
    }

    /// Whether some free extent holds `size` bytes (what `alloc` would find).
    pub fn fits(&self, size: u64) -> bool {
        self.by_size.range((size, 0, 0)..).next().is_some()
    }

    /// Best fit for `size` bytes (a multiple of `SUBPAGE_ALIGN`): (arena, offset).
    pub fn alloc(&mut self, size: u64) -> Option<(ArenaId, u64)> {
        debug_assert!(size > 0 && size % SUBPAGE_ALIGN == 0);
        let &(len, id, off) = self.by_size.range((size, 0, 0)..).next()?;
        self.by_size.remove(&(len, id, off));
        let a = self.arenas.get_mut(&id).expect("free extent of a missing arena");
        a.free.remove(&off);
        if len > size {
            a.free.insert(off + size, len - size);
            self.by_size.insert((len - size, id, off + size));
        }
        a.used.insert(off, size);
        a.used_bytes += size;
        Some((id, off))
    }

    /// Frees the block at `off` in arena `id`; returns whether the arena is now empty.
    pub fn free(&mut self, id: ArenaId, off: u64) -> bool {
        let a = self.arenas.get_mut(&id).expect("free in a missing arena");
        let size = a.used.remove(&off).expect("free of a block that is not used");
        a.used_bytes -= size;
        let (mut start, mut len) = (off, size);
        if let Some((&p, &pl)) = a.free.range(..off).next_back() {
            if p + pl == off {
                a.free.remove(&p);
                self.by_size.remove(&(pl, id, p));
                start = p;
                len += pl;
            }
        }
        if let Some(&nl) = a.free.get(&(off + size)) {
            a.free.remove(&(off + size));
            self.by_size.remove(&(nl, id, off + size));
            len += nl;
        }
        a.free.insert(start, len);
        self.by_size.insert((len, id, start));
        a.used_bytes == 0
    }

    /// The used block of arena `id` containing `off`, as (block offset, len).
    pub fn block_containing(&self, id: ArenaId, off: u64) -> Option<(u64, u64)> {
        let a = self.arenas.get(&id)?;
        let (&o, &l) = a.used.range(..=off).next_back()?;
        (off < o + l).then_some((o, l))
    }

    #[cfg(all(test, not(loom)))]
    pub fn arena_count(&self) -> usize {
        self.arenas.len()
    }

    pub fn arena_ids(&self) -> impl Iterator<Item = ArenaId> + '_ {
        self.arenas.keys().copied()
    }

    /// Checks that every arena is tiled exactly by its used and free extents, and that the size
    /// index matches the free extents.
    pub fn check(&self) -> Result<(), String> {
        let mut extents = 0;
        for (&id, a) in &self.arenas {
            let mut all: Vec<(u64, u64, bool)> =
                a.free.iter().map(|(&o, &l)| (o, l, false)).collect();
            all.extend(a.used.iter().map(|(&o, &l)| (o, l, true)));
            all.sort();
            let mut at = 0;
            let mut prev_free = false;
            for (o, l, used) in all {
                if o != at {
                    return Err(format!(
                        "arena {id}: gap or overlap at offset {at} (next extent at {o})"
                    ));
                }
                if !used && prev_free {
                    return Err(format!("arena {id}: adjacent free extents at {o} not coalesced"));
                }
                if o % SUBPAGE_ALIGN != 0 || l == 0 {
                    return Err(format!("arena {id}: bad extent ({o}, {l})"));
                }
                prev_free = !used;
                at = o + l;
            }
            if at != a.len {
                return Err(format!("arena {id}: extents cover {at} of {} bytes", a.len));
            }
            if a.used.values().sum::<u64>() != a.used_bytes {
                return Err(format!("arena {id}: used byte count drifted"));
            }
            for (&o, &l) in &a.free {
                if !self.by_size.contains(&(l, id, o)) {
                    return Err(format!(
                        "arena {id}: free extent ({o}, {l}) missing from the index"
                    ));
                }
            }
            extents += a.free.len();
        }
        if extents != self.by_size.len() {
            return Err(format!(
                "size index has {} entries for {extents} free extents",
                self.by_size.len()
            ));
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: u64 = SUBPAGE_ALIGN;

    #[test]
    fn best_fit_prefers_the_smallest_hole() {
        let mut s = SubPage::default();
        s.add_arena(7, 16 * A);
        let (_, a) = s.alloc(4 * A).unwrap();
        let (_, b) = s.alloc(A).unwrap();
        let (_, _c) = s.alloc(8 * A).unwrap();
        s.free(7, a); // hole of 4 at 0, hole of 3 at the end
        assert!(!s.free(7, b)); // merges with the hole before it: 5 at 0
        let (_, d) = s.alloc(3 * A).unwrap();
        assert_eq!(d, 13 * A, "took the 3-unit hole at the end, not the 5-unit one");
        s.check().unwrap();
    }

    #[test]
    fn arena_empties_and_is_removed() {
        let mut s = SubPage::default();
        s.add_arena(1, 4 * A);
        let (_, a) = s.alloc(A).unwrap();
        let (_, b) = s.alloc(3 * A).unwrap();
        assert_eq!(s.alloc(A), None);
        assert_eq!(s.block_containing(1, b + 10), Some((b, 3 * A)));
        assert!(!s.free(1, a));
        assert!(s.free(1, b));
        s.remove_arena(1);
        assert_eq!(s.arena_count(), 0);
        s.check().unwrap();
    }

    proptest! {
        #[test]
        fn random_mixes_keep_arenas_tiled(ops in proptest::collection::vec((any::<bool>(), 1u64..40), 1..400)) {
            let mut s = SubPage::default();
            s.add_arena(0, 64 * A);
            s.add_arena(1, 64 * A);
            let mut live: Vec<(ArenaId, u64, u64)> = Vec::new();
            for (alloc, units) in ops {
                if alloc {
                    if let Some((id, off)) = s.alloc(units * A) {
                        for &(i, o, l) in &live {
                            prop_assert!(i != id || off + units * A <= o || o + l <= off, "overlap");
                        }
                        live.push((id, off, units * A));
                    }
                } else if !live.is_empty() {
                    let (id, off, _) = live.swap_remove(units as usize % live.len());
                    s.free(id, off);
                }
                s.check().map_err(TestCaseError::fail)?;
            }
        }
    }
}
