//! A set of free ids (pages of the pool, rows of the block table) that hands out the lowest one
//! first, so that the tail of the pool stays free and can be released. A bitmap with a hint of
//! the lowest word that may hold a free id: pop and insert are O(1) amortised.

/// Free ids below `limit`, lowest first.
#[derive(Clone, Debug, Default)]
pub(crate) struct FreeIds {
    words: Vec<u64>,
    limit: u32,
    count: u32,
    /// No word below this one has a set bit.
    hint: usize,
}

impl FreeIds {
    /// An empty set over no ids.
    pub(crate) fn new() -> Self {
        FreeIds::default()
    }

    /// How many ids are free.
    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    /// Ids below this are tracked (free or in use); ids at or above it do not exist yet.
    pub(crate) fn limit(&self) -> u32 {
        self.limit
    }

    /// Whether `id` is free.
    pub(crate) fn contains(&self, id: u32) -> bool {
        id < self.limit && self.words[(id / 64) as usize] & (1 << (id % 64)) != 0
    }

    /// Extends the tracked range to `limit`; the new ids are free.
    pub(crate) fn grow_to(&mut self, limit: u32) {
        debug_assert!(limit >= self.limit);
        self.words.resize(limit.div_ceil(64) as usize, 0);
        for id in self.limit..limit {
            self.words[(id / 64) as usize] |= 1 << (id % 64);
        }
        self.hint = self.hint.min((self.limit / 64) as usize);
        self.count += limit - self.limit;
        self.limit = limit;
    }

    /// Marks `id` (below the limit, in use) free again.
    pub(crate) fn insert(&mut self, id: u32) {
        debug_assert!(id < self.limit && !self.contains(id), "id {id} inserted twice");
        let w = (id / 64) as usize;
        self.words[w] |= 1 << (id % 64);
        self.count += 1;
        self.hint = self.hint.min(w);
    }

    /// The lowest free id, left free.
    pub(crate) fn peek_lowest(&self) -> Option<u32> {
        if self.count == 0 {
            return None;
        }
        let w = (self.hint..self.words.len()).find(|&w| self.words[w] != 0)?;
        Some(w as u32 * 64 + self.words[w].trailing_zeros())
    }

    /// Takes the lowest free id.
    pub(crate) fn pop_lowest(&mut self) -> Option<u32> {
        if self.count == 0 {
            return None;
        }
        while self.words[self.hint] == 0 {
            self.hint += 1;
        }
        let w = self.hint;
        let bit = self.words[w].trailing_zeros();
        self.words[w] &= !(1 << bit);
        self.count -= 1;
        Some(w as u32 * 64 + bit)
    }

    /// Drops the free ids at the top of the range, so that `limit` is one past the highest id
    /// in use (or 0), but not below `floor`. Returns the new limit.
    pub(crate) fn trim_trailing(&mut self, floor: u32) -> u32 {
        while self.limit > floor && self.contains(self.limit - 1) {
            let id = self.limit - 1;
            self.words[(id / 64) as usize] &= !(1 << (id % 64));
            self.count -= 1;
            self.limit -= 1;
        }
        self.words.truncate(self.limit.div_ceil(64) as usize);
        self.hint = self.hint.min(self.words.len().saturating_sub(1));
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        #[test]
        fn behaves_like_a_sorted_set(ops in proptest::collection::vec((0u8..4, 0u32..300), 1..300)) {
            let mut ids = FreeIds::new();
            let mut model = BTreeSet::new();
            let mut limit = 0u32;
            let mut used = BTreeSet::new();
            for (op, x) in ops {
                match op {
                    0 => {
                        let new = (limit + x % 70).min(400);
                        ids.grow_to(new);
                        model.extend(limit..new);
                        limit = new;
                    }
                    1 => {
                        let got = ids.pop_lowest();
                        let want = model.pop_first();
                        prop_assert_eq!(got, want);
                        if let Some(g) = got { used.insert(g); }
                    }
                    2 => {
                        if let Some(&u) = used.iter().nth((x as usize) % used.len().max(1)) {
                            used.remove(&u);
                            ids.insert(u);
                            model.insert(u);
                        }
                    }
                    _ => {
                        let floor = x % (limit + 1);
                        let l = ids.trim_trailing(floor);
                        while limit > floor && model.contains(&(limit - 1)) {
                            model.remove(&(limit - 1));
                            limit -= 1;
                        }
                        prop_assert_eq!(l, limit);
                    }
                }
                prop_assert_eq!(ids.count() as usize, model.len());
                prop_assert_eq!(ids.limit(), limit);
            }
        }
    }
}
