//! The physical chunk pool's bookkeeping: every chunk MoonBright holds, how many virtual mappings
//! each has, and which are *bare* (in no live or cached range, free to be stitched anywhere).
//! Pure bookkeeping: the heap makes the driver calls and tells the pool what happened.

use std::collections::BTreeSet;

use crate::driver::ChunkHandle;

/// Index of a chunk in the pool.
pub(crate) type ChunkId = u32;

/// One physical chunk: a driver handle of `pages` pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub handle: ChunkHandle,
    pub pages: u64,
    /// Virtual mappings of this chunk, live, cached or retired (not yet unmapped).
    pub mappings: u32,
    /// In no live or cached range.
    pub bare: bool,
    /// Shared with another process (`Heap::export_chunks`): another process may map it for
    /// as long as it likes, so it is never bare again (never reused here); once in no range
    /// it waits in `Pool::doomed` to be released.
    pub exported: bool,
}

/// The chunks held, and an index of the bare ones by size.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    chunks: Vec<Option<Chunk>>,
    free_ids: Vec<ChunkId>,
    /// Bare chunks as (pages, id): ordered so the largest that fits a need is one range query.
    bare: BTreeSet<(u64, ChunkId)>,
    bare_pages: u64,
    held_pages: u64,
    /// Exported chunks in no range (`put_bare` of an exported chunk): never reused, released
    /// once mapped nowhere (`take_doomed`, `take_unmapped_bare`).
    doomed: BTreeSet<ChunkId>,
    /// Whether any chunk was ever exported: until then frees need not look.
    any_exported: bool,
}

/// How a need of `pages` is cut into chunks no larger than `max_pages`: as many of the largest
/// as fit, then one chunk of what is left, so an allocation costs as few handles as the limit
/// allows (set access and unmap cost per handle). Sizes need not be powers of two: a chunk of
/// any size serves any range at least as large. (Power-of-two pieces, the earlier rule, cost
/// up to log2(max) more handles a range: in the fragmentation stress, 2.6 times as many
/// requests mapped 16 or more handles.)
pub(crate) fn chunk_plan(pages: u64, max_pages: u64) -> Vec<u64> {
    let mut plan = vec![max_pages; (pages / max_pages) as usize];
    if pages % max_pages > 0 {
        plan.push(pages % max_pages);
    }
    plan
}

impl Pool {
    /// Records a new chunk, not yet bare (the caller is about to use it or calls `put_bare`).
    pub fn insert(&mut self, handle: ChunkHandle, pages: u64) -> ChunkId {
        let chunk = Chunk { handle, pages, mappings: 0, bare: false, exported: false };
        self.held_pages += pages;
        match self.free_ids.pop() {
            Some(id) => {
                self.chunks[id as usize] = Some(chunk);
                id
            }
            None => {
                self.chunks.push(Some(chunk));
                (self.chunks.len() - 1) as ChunkId
            }
        }
    }

    /// Forgets a chunk (after its release). It must be mapped nowhere and not bare.
    pub fn remove(&mut self, id: ChunkId) -> Chunk {
        let chunk = self.chunks[id as usize].take().expect("remove: no such chunk");
        debug_assert_eq!(chunk.mappings, 0);
        debug_assert!(!chunk.bare);
        self.held_pages -= chunk.pages;
        self.free_ids.push(id);
        chunk
    }

    pub fn get(&self, id: ChunkId) -> &Chunk {
        self.chunks[id as usize].as_ref().expect("no such chunk")
    }

    /// The chunk `id`, if it is still held.
    pub fn try_get(&self, id: ChunkId) -> Option<&Chunk> {
        self.chunks.get(id as usize)?.as_ref()
    }

    fn get_mut(&mut self, id: ChunkId) -> &mut Chunk {
        self.chunks[id as usize].as_mut().expect("no such chunk")
    }

    pub fn add_mapping(&mut self, id: ChunkId) {
        self.get_mut(id).mappings += 1;
    }

    pub fn remove_mapping(&mut self, id: ChunkId) {
        let c = self.get_mut(id);
        debug_assert!(c.mappings > 0);
        c.mappings -= 1;
    }

    /// Marks a chunk exported: from now on `put_bare` dooms it instead.
    pub fn mark_exported(&mut self, id: ChunkId) {
        self.get_mut(id).exported = true;
        self.any_exported = true;
    }

    /// Whether any chunk was ever exported.
    pub fn any_exported(&self) -> bool {
        self.any_exported
    }

    /// Whether some doomed chunk is mapped nowhere (`take_doomed` would take it).
    pub fn has_doomed_unmapped(&self) -> bool {
        self.doomed.iter().any(|&id| self.get(id).mappings == 0)
    }

    /// How many chunks are doomed (exported, in no range, waiting to be released), mapped or not.
    pub fn doomed_count(&self) -> usize {
        self.doomed.len()
    }

    /// Whether the chunk is doomed: exported, in no range, waiting to be released.
    pub fn is_doomed(&self, id: ChunkId) -> bool {
        self.doomed.contains(&id)
    }

    /// Takes every doomed chunk that is mapped nowhere, for release.
    pub fn take_doomed(&mut self) -> Vec<ChunkId> {
        let out: Vec<ChunkId> =
            self.doomed.iter().copied().filter(|&id| self.get(id).mappings == 0).collect();
        for id in &out {
            self.doomed.remove(id);
        }
        out
    }

    /// Makes a chunk bare: free to be stitched into any range. An exported chunk is doomed
    /// instead: never reused, released once mapped nowhere.
    pub fn put_bare(&mut self, id: ChunkId) {
        let c = self.get_mut(id);
        debug_assert!(!c.bare);
        if c.exported {
            self.doomed.insert(id);
            return;
        }
        c.bare = true;
        let pages = c.pages;
        self.bare.insert((pages, id));
        self.bare_pages += pages;
    }

    fn unbare(&mut self, pages: u64, id: ChunkId) -> ChunkId {
        self.bare.remove(&(pages, id));
        self.bare_pages -= pages;
        self.get_mut(id).bare = false;
        id
    }

    /// Takes this chunk if it is bare; returns whether it was.
    pub fn take_if_bare(&mut self, id: ChunkId) -> bool {
        let c = self.get(id);
        if !c.bare {
            return false;
        }
        let pages = c.pages;
        self.unbare(pages, id);
        true
    }

    /// Takes the largest bare chunk of at most `max_pages` pages.
    pub fn take_bare_at_most(&mut self, max_pages: u64) -> Option<ChunkId> {
        let &(pages, id) = self.bare.range(..=(max_pages, ChunkId::MAX)).next_back()?;
        Some(self.unbare(pages, id))
    }

    /// Takes a bare chunk of exactly `pages` pages.
    pub fn take_bare_of(&mut self, pages: u64) -> Option<ChunkId> {
        let &(p, id) = self.bare.range((pages, 0)..=(pages, ChunkId::MAX)).next()?;
        Some(self.unbare(p, id))
    }

    /// Takes the smallest bare chunk larger than `pages` that is mapped nowhere, for splitting.
    pub fn take_unmapped_bare_larger_than(&mut self, pages: u64) -> Option<ChunkId> {
        let &(p, id) =
            self.bare.range((pages + 1, 0)..).find(|&&(_, id)| self.get(id).mappings == 0)?;
        Some(self.unbare(p, id))
    }

    /// The bare chunks larger than `pages` (mapped or not), smallest first, left bare.
    pub fn bare_larger_than(&self, pages: u64) -> impl Iterator<Item = ChunkId> + '_ {
        self.bare.range((pages + 1, 0)..).map(|&(_, id)| id)
    }

    /// Whether some bare chunk larger than `pages` exists (mapped or not).
    pub fn has_bare_larger_than(&self, pages: u64) -> bool {
        self.bare.range((pages + 1, 0)..).next().is_some()
    }

    /// Takes any bare or doomed chunk that is mapped nowhere (for releasing memory).
    pub fn take_unmapped_bare(&mut self) -> Option<ChunkId> {
        if let Some(&id) = self.doomed.iter().find(|&&id| self.get(id).mappings == 0) {
            self.doomed.remove(&id);
            return Some(id);
        }
        let &(p, id) = self.bare.iter().find(|&&(_, id)| self.get(id).mappings == 0)?;
        Some(self.unbare(p, id))
    }

    pub fn bare_pages(&self) -> u64 {
        self.bare_pages
    }

    pub fn held_pages(&self) -> u64 {
        self.held_pages
    }

    /// Every chunk held, with its id.
    pub fn iter(&self) -> impl Iterator<Item = (ChunkId, &Chunk)> {
        self.chunks.iter().enumerate().filter_map(|(i, c)| c.as_ref().map(|c| (i as ChunkId, c)))
    }

    /// Checks the pool's own invariants; the heap checks the ones that span structures.
    pub fn check(&self) -> Result<(), String> {
        let mut bare_pages = 0;
        let mut held = 0;
        let mut bare_count = 0;
        for &id in &self.doomed {
            match self.try_get(id) {
                Some(c) if c.exported && !c.bare => {}
                _ => return Err(format!("doomed chunk {id} is not an exported chunk out of use")),
            }
        }
        for (id, c) in self.iter() {
            held += c.pages;
            if c.bare {
                bare_pages += c.pages;
                bare_count += 1;
                if !self.bare.contains(&(c.pages, id)) {
                    return Err(format!("bare chunk {id} missing from the bare index"));
                }
            }
        }
        if bare_count != self.bare.len() {
            return Err(format!(
                "bare index has {} entries, {bare_count} chunks are bare",
                self.bare.len()
            ));
        }
        if bare_pages != self.bare_pages || held != self.held_pages {
            return Err(format!(
                "page counts drifted: bare {} vs {bare_pages}, held {} vs {held}",
                self.bare_pages, self.held_pages
            ));
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plan_uses_the_fewest_chunks_the_limit_allows() {
        assert_eq!(chunk_plan(100, 32), vec![32, 32, 32, 4]);
        assert_eq!(chunk_plan(7, 32), vec![7]);
        assert_eq!(chunk_plan(45, 32), vec![32, 13]);
        assert_eq!(chunk_plan(5, 1), vec![1; 5]);
    }

    #[test]
    fn takes_largest_bare_that_fits() {
        let mut p = Pool::default();
        let a = p.insert(ChunkHandle(1), 4);
        let b = p.insert(ChunkHandle(2), 1);
        let c = p.insert(ChunkHandle(3), 8);
        for id in [a, b, c] {
            p.put_bare(id);
        }
        assert_eq!(p.take_bare_at_most(5), Some(a));
        assert_eq!(p.take_bare_at_most(5), Some(b));
        assert_eq!(p.take_bare_at_most(5), None);
        assert_eq!(p.bare_pages(), 8);
        p.check().unwrap();
    }

    #[test]
    fn takes_a_bare_chunk_of_exactly_the_size() {
        let mut p = Pool::default();
        let a = p.insert(ChunkHandle(1), 4);
        let b = p.insert(ChunkHandle(2), 8);
        let c = p.insert(ChunkHandle(3), 4);
        for id in [a, b, c] {
            p.put_bare(id);
        }
        assert_eq!(p.take_bare_of(5), None, "none of 5, though 8 would hold it");
        let first = p.take_bare_of(4).unwrap();
        assert!([a, c].contains(&first));
        assert_eq!(p.take_bare_of(8), Some(b));
        assert_eq!(p.bare_pages(), 4);
        p.check().unwrap();
    }

    #[test]
    fn split_candidates_must_be_unmapped() {
        let mut p = Pool::default();
        let a = p.insert(ChunkHandle(1), 4);
        p.add_mapping(a);
        p.put_bare(a);
        assert!(p.has_bare_larger_than(2));
        assert_eq!(p.take_unmapped_bare_larger_than(2), None);
        p.remove_mapping(a);
        assert_eq!(p.take_unmapped_bare_larger_than(2), Some(a));
    }

    proptest! {
        #[test]
        fn plan_sums_and_respects_max(pages in 1u64..100_000, max_log in 0u32..12) {
            let max = 1u64 << max_log;
            let plan = chunk_plan(pages, max);
            prop_assert_eq!(plan.iter().sum::<u64>(), pages);
            prop_assert!(plan.iter().all(|&p| p > 0 && p <= max));
            prop_assert!(plan.windows(2).all(|w| w[0] >= w[1]));
            prop_assert_eq!(plan.len() as u64, pages.div_ceil(max));
        }

        #[test]
        fn pool_bookkeeping_stays_consistent(ops in proptest::collection::vec((0u8..4, 1u64..9), 1..200)) {
            let mut p = Pool::default();
            let mut taken: Vec<ChunkId> = Vec::new();
            let mut h = 0;
            for (op, pages) in ops {
                match op {
                    0 => { h += 1; let id = p.insert(ChunkHandle(h), pages); p.put_bare(id); }
                    1 => if let Some(id) = p.take_bare_at_most(pages) {
                        prop_assert!(p.get(id).pages <= pages);
                        taken.push(id);
                    },
                    2 => if let Some(id) = taken.pop() { p.put_bare(id); },
                    _ => if let Some(id) = taken.pop() { p.remove(id); },
                }
                p.check().map_err(TestCaseError::fail)?;
            }
        }
    }
}
