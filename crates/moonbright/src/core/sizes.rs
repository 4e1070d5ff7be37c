//! Which request sizes came before: a small direct-mapped table of exact byte sizes, so that
//! the heap can tell a repeated step's requests (the same sizes every step, as in a training
//! loop) from a random mix's: for carving's budget (`Options::carve_repeated`) and for the
//! size of new chunks (`Options::max_chunk_repeated_bytes`; docs/design.md "Carved arenas").

/// Slots of the table: a step with more distinct sizes than this forgets some between steps.
const SLOTS: usize = 4096;

/// The sizes of recent requests, one per slot by a multiplicative hash of the size: a size is
/// known only by exact match, so a collision forgets a size but never makes one up.
#[derive(Debug)]
pub(crate) struct RecentSizes {
    slots: Box<[u64; SLOTS]>,
}

impl Default for RecentSizes {
    fn default() -> Self {
        RecentSizes { slots: Box::new([0; SLOTS]) }
    }
}

impl RecentSizes {
    /// Whether `size` is in the table (not for 0, which every empty slot holds).
    pub fn contains(&self, size: u64) -> bool {
        self.slots[slot_of(size)] == size
    }

    /// Puts `size` in its slot, in place of the size there.
    pub fn insert(&mut self, size: u64) {
        self.slots[slot_of(size)] = size;
    }
}

/// Fibonacci hashing: the top bits of the size times 2^64 / phi.
fn slot_of(size: u64) -> usize {
    (size.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SLOTS.trailing_zeros())) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_is_known_once_inserted() {
        let mut r = RecentSizes::default();
        assert!(!r.contains(12_345));
        r.insert(12_345);
        assert!(r.contains(12_345));
        assert!(!r.contains(12_346));
    }

    #[test]
    fn a_colliding_size_takes_the_slot_and_the_other_is_forgotten() {
        let mut r = RecentSizes::default();
        let a = 2 << 20;
        let b = (a + 1..).find(|&b| slot_of(b) == slot_of(a)).unwrap();
        r.insert(a);
        r.insert(b);
        assert!(r.contains(b));
        assert!(!r.contains(a), "b took a's slot");
    }
}
