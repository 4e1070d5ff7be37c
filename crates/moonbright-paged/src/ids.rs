//! A set of free ids (pages of the pool, rows of the block table) that hands out the lowest one
//! first, so that the tail of the pool stays free and can be released. A bitmap of the ids with
//! a summary bitmap of its non-empty words, and a hint of the lowest summary word that may have
//! a set bit: finding the lowest free id reads a few summary words instead of every full word
//! below it, so pop and insert stay cheap however the free ids are scattered.

/// Free ids below `limit`, lowest first.
#[derive(Clone, Debug, Default)]
pub(crate) struct FreeIds {
    words: Vec<u64>,
    /// Bit `w % 64` of `summary[w / 64]` is set when `words[w]` is not 0.
    summary: Vec<u64>,
    limit: u32,
    count: u32,
    /// No summary word below this one has a set bit.
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

    fn set(&mut self, id: u32) {
        let w = (id / 64) as usize;
        self.words[w] |= 1 << (id % 64);
        self.summary[w / 64] |= 1 << (w % 64);
        self.hint = self.hint.min(w / 64);
    }

    fn clear(&mut self, id: u32) {
        let w = (id / 64) as usize;
        self.words[w] &= !(1 << (id % 64));
        if self.words[w] == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
    }

    /// Extends the tracked range to `limit`; the new ids are free.
    pub(crate) fn grow_to(&mut self, limit: u32) {
        debug_assert!(limit >= self.limit);
        let words = limit.div_ceil(64) as usize;
        self.words.resize(words, 0);
        self.summary.resize(words.div_ceil(64), 0);
        for id in self.limit..limit {
            self.set(id);
        }
        self.count += limit - self.limit;
        self.limit = limit;
    }

    /// Marks `id` (below the limit, in use) free again.
    pub(crate) fn insert(&mut self, id: u32) {
        debug_assert!(id < self.limit && !self.contains(id), "id {id} inserted twice");
        self.set(id);
        self.count += 1;
    }

    /// The word holding the lowest free id; moves the hint up past empty summary words.
    fn lowest_word(&mut self) -> Option<usize> {
        if self.count == 0 {
            return None;
        }
        while self.summary[self.hint] == 0 {
            self.hint += 1;
        }
        Some(self.hint * 64 + self.summary[self.hint].trailing_zeros() as usize)
    }

    /// The lowest free id, left free.
    pub(crate) fn peek_lowest(&self) -> Option<u32> {
        if self.count == 0 {
            return None;
        }
        let s = (self.hint..self.summary.len()).find(|&s| self.summary[s] != 0)?;
        let w = s * 64 + self.summary[s].trailing_zeros() as usize;
        Some(w as u32 * 64 + self.words[w].trailing_zeros())
    }

    /// Takes the lowest free id.
    pub(crate) fn pop_lowest(&mut self) -> Option<u32> {
        let w = self.lowest_word()?;
        let id = w as u32 * 64 + self.words[w].trailing_zeros();
        self.clear(id);
        self.count -= 1;
        Some(id)
    }

    /// Takes the `n` lowest free ids (there must be as many), appending them to `out` in
    /// increasing order: as `n` calls of [`pop_lowest`](Self::pop_lowest), a word at a time.
    pub(crate) fn pop_lowest_n(&mut self, n: u32, out: &mut Vec<u32>) {
        assert!(n <= self.count, "{n} ids asked for, {} free", self.count);
        let mut left = n;
        while left > 0 {
            let w = self.lowest_word().expect("counted above");
            let mut bits = self.words[w];
            while bits != 0 && left > 0 {
                out.push(w as u32 * 64 + bits.trailing_zeros());
                bits &= bits - 1;
                left -= 1;
            }
            self.words[w] = bits;
            if bits == 0 {
                self.summary[w / 64] &= !(1 << (w % 64));
            }
        }
        self.count -= n;
    }

    /// Drops the free ids at the top of the range, so that `limit` is one past the highest id
    /// in use (or 0), but not below `floor`. Returns the new limit.
    pub(crate) fn trim_trailing(&mut self, floor: u32) -> u32 {
        while self.limit > floor && self.contains(self.limit - 1) {
            self.clear(self.limit - 1);
            self.count -= 1;
            self.limit -= 1;
        }
        let words = self.limit.div_ceil(64) as usize;
        self.words.truncate(words);
        self.summary.truncate(words.div_ceil(64));
        self.hint = self.hint.min(self.summary.len().saturating_sub(1));
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
        fn behaves_like_a_sorted_set(ops in proptest::collection::vec((0u8..5, 0u32..300), 1..600)) {
            let mut ids = FreeIds::new();
            let mut model = BTreeSet::new();
            let mut limit = 0u32;
            let mut used = BTreeSet::new();
            for (op, x) in ops {
                match op {
                    0 => {
                        let new = (limit + x % 300).min(9000);
                        ids.grow_to(new);
                        model.extend(limit..new);
                        limit = new;
                    }
                    1 => {
                        prop_assert_eq!(ids.peek_lowest(), model.first().copied());
                        let got = ids.pop_lowest();
                        let want = model.pop_first();
                        prop_assert_eq!(got, want);
                        if let Some(g) = got { used.insert(g); }
                    }
                    4 => {
                        let n = (x % 90).min(ids.count());
                        let mut got = Vec::new();
                        ids.pop_lowest_n(n, &mut got);
                        let want: Vec<u32> = (0..n).map(|_| model.pop_first().unwrap()).collect();
                        prop_assert_eq!(&got, &want);
                        used.extend(got);
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
