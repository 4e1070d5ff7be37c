//! A small ordered map for the bookkeeping on the allocation path: an arena's free extents and
//! used blocks (`SubPage`), a stream's pending ranges of one size (`Streams`). Those hold a few
//! dozen entries and change at their ends (blocks are cut from the end of their extent, so an
//! arena's newest block is most often its lowest and its oldest its highest; a stream reuses its
//! lowest pending range and frees higher ones), where a sorted deque beats a B-tree: on the host
//! backend a sub-page free in batches of 200 took 166 ns against 243.

use std::collections::{BTreeMap, VecDeque};

/// An ordered map from `u64` keys. Small, it is a deque sorted by key: a binary search, and no
/// move at either end, where a B-tree walks and allocates nodes; past `SMALL_MAX` entries it is
/// a B-tree, and back below `SMALL_MIN`, so that thousands of entries changed in the middle
/// cost a B-tree's log, not a move of half of them.
#[derive(Debug, Clone)]
pub(crate) enum SortedMap<V> {
    Small(VecDeque<(u64, V)>),
    Large(BTreeMap<u64, V>),
}

/// Entries above which a map becomes a B-tree, and below which it goes back to a deque.
const SMALL_MAX: usize = 256;
const SMALL_MIN: usize = 64;

impl<V> Default for SortedMap<V> {
    fn default() -> Self {
        SortedMap::Small(VecDeque::new())
    }
}

impl<V> SortedMap<V> {
    pub(crate) fn from_sorted(entries: impl IntoIterator<Item = (u64, V)>) -> Self {
        let mut m = SortedMap::Small(entries.into_iter().collect());
        m.rebalance();
        m
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            SortedMap::Small(d) => d.len(),
            SortedMap::Large(t) => t.len(),
        }
    }

    /// Switches representation when the size crossed a bound.
    pub(crate) fn rebalance(&mut self) {
        let to = match self {
            SortedMap::Small(d) if d.len() > SMALL_MAX => {
                SortedMap::Large(std::mem::take(d).into_iter().collect())
            }
            SortedMap::Large(t) if t.len() < SMALL_MIN => {
                SortedMap::Small(std::mem::take(t).into_iter().collect())
            }
            _ => return,
        };
        *self = to;
    }

    pub(crate) fn get(&self, key: u64) -> Option<&V> {
        match self {
            SortedMap::Small(d) => d.binary_search_by_key(&key, |e| e.0).ok().map(|i| &d[i].1),
            SortedMap::Large(t) => t.get(&key),
        }
    }

    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        match self {
            SortedMap::Small(d) => {
                d.binary_search_by_key(&key, |e| e.0).ok().map(move |i| &mut d[i].1)
            }
            SortedMap::Large(t) => t.get_mut(&key),
        }
    }

    /// Inserts or replaces.
    pub(crate) fn insert(&mut self, key: u64, value: V) {
        match self {
            SortedMap::Small(d) => match d.binary_search_by_key(&key, |e| e.0) {
                Ok(i) => d[i].1 = value,
                Err(i) => d.insert(i, (key, value)),
            },
            SortedMap::Large(t) => {
                t.insert(key, value);
            }
        }
        self.rebalance();
    }

    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        let v = match self {
            SortedMap::Small(d) => {
                let i = d.binary_search_by_key(&key, |e| e.0).ok()?;
                d.remove(i).map(|e| e.1)
            }
            SortedMap::Large(t) => t.remove(&key),
        };
        self.rebalance();
        v
    }

    /// The entry with the greatest key below `key`.
    pub(crate) fn last_below(&self, key: u64) -> Option<(u64, &V)> {
        match self {
            SortedMap::Small(d) => {
                let i = d.partition_point(|e| e.0 < key).checked_sub(1)?;
                Some((d[i].0, &d[i].1))
            }
            SortedMap::Large(t) => t.range(..key).next_back().map(|(k, v)| (*k, v)),
        }
    }

    /// The entry with the greatest key at or below `key`.
    pub(crate) fn last_at_or_below(&self, key: u64) -> Option<(u64, &V)> {
        match self {
            SortedMap::Small(d) => {
                let i = d.partition_point(|e| e.0 <= key).checked_sub(1)?;
                Some((d[i].0, &d[i].1))
            }
            SortedMap::Large(t) => t.range(..=key).next_back().map(|(k, v)| (*k, v)),
        }
    }

    /// Takes out the entries at or above `key`, in order.
    pub(crate) fn split_off(&mut self, key: u64) -> Vec<(u64, V)> {
        let out: Vec<(u64, V)> = match self {
            SortedMap::Small(d) => {
                let i = d.partition_point(|e| e.0 < key);
                d.split_off(i).into_iter().collect()
            }
            SortedMap::Large(t) => t.split_off(&key).into_iter().collect(),
        };
        self.rebalance();
        out
    }

    pub(crate) fn iter(&self) -> Box<dyn Iterator<Item = (u64, &V)> + '_> {
        match self {
            SortedMap::Small(d) => Box::new(d.iter().map(|(k, v)| (*k, v))),
            SortedMap::Large(t) => Box::new(t.iter().map(|(k, v)| (*k, v))),
        }
    }

    pub(crate) fn into_entries(self) -> Vec<(u64, V)> {
        match self {
            SortedMap::Small(d) => d.into_iter().collect(),
            SortedMap::Large(t) => t.into_iter().collect(),
        }
    }

    pub(crate) fn first(&self) -> Option<(u64, &V)> {
        match self {
            SortedMap::Small(d) => d.front().map(|(k, v)| (*k, v)),
            SortedMap::Large(t) => t.iter().next().map(|(k, v)| (*k, v)),
        }
    }
}

impl<V> SortedMap<V> {
    /// Checks that the entries are strictly increasing and that the representation matches the
    /// size bounds.
    pub(crate) fn check(&self) -> Result<(), String> {
        if let SortedMap::Small(d) = self {
            if d.len() > SMALL_MAX {
                return Err(format!("a deque of {} entries, above {SMALL_MAX}", d.len()));
            }
            if d.iter().zip(d.iter().skip(1)).any(|(a, b)| a.0 >= b.0) {
                return Err("deque entries out of order or repeated".into());
            }
        }
        if let SortedMap::Large(t) = self {
            if t.len() < SMALL_MIN {
                return Err(format!("a B-tree of {} entries, below {SMALL_MIN}", t.len()));
            }
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        SplitOff(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Keys from a range narrow enough to collide, wide enough to grow past SMALL_MAX.
        prop_oneof![
            8 => (0u64..1_200, any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            3 => (0u64..1_200).prop_map(Op::Remove),
            1 => (0u64..1_200).prop_map(Op::SplitOff),
        ]
    }

    proptest! {
        /// Every operation gives what a B-tree gives, through both representations and the
        /// switches between them.
        #[test]
        fn behaves_as_a_btree(ops in proptest::collection::vec(op(), 0..2_500)) {
            let mut m = SortedMap::default();
            let mut model = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => {
                        m.insert(k, v);
                        model.insert(k, v);
                    }
                    Op::Remove(k) => prop_assert_eq!(m.remove(k), model.remove(&k)),
                    Op::SplitOff(k) => {
                        let got = m.split_off(k);
                        let want: Vec<(u64, u32)> = model.split_off(&k).into_iter().collect();
                        prop_assert_eq!(got, want);
                    }
                }
                prop_assert!(m.check().is_ok(), "{:?}", m.check());
                prop_assert_eq!(m.len(), model.len());
                for probe in [0, 1, 599, 600, 1_199, 1_200] {
                    prop_assert_eq!(m.get(probe), model.get(&probe));
                    let below = model.range(..probe).next_back().map(|(k, v)| (*k, v));
                    prop_assert_eq!(m.last_below(probe), below);
                    let at = model.range(..=probe).next_back().map(|(k, v)| (*k, v));
                    prop_assert_eq!(m.last_at_or_below(probe), at);
                }
                prop_assert_eq!(m.first(), model.iter().next().map(|(k, v)| (*k, v)));
            }
            let all: Vec<(u64, u32)> = m.iter().map(|(k, v)| (k, *v)).collect();
            prop_assert_eq!(all, model.into_iter().collect::<Vec<_>>());
        }
    }

    #[test]
    fn switches_to_a_btree_and_back() {
        let mut m = SortedMap::default();
        for k in 0..=SMALL_MAX as u64 {
            m.insert(k, ());
        }
        assert!(matches!(m, SortedMap::Large(_)));
        for k in 0..=(SMALL_MAX - SMALL_MIN) as u64 + 1 {
            m.remove(k);
        }
        assert!(matches!(m, SortedMap::Small(_)), "{} entries", m.len());
        assert!(m.check().is_ok());
        *m.get_mut(SMALL_MAX as u64).expect("kept") = ();
        assert_eq!(m.into_entries().len(), SMALL_MIN - 1);
    }
}
