//! [`SeqId`]: a sequence's id, its block-table row and that row's generation, so that a freed
//! id is told from an unknown one forever.

use std::fmt;

/// A sequence: its block-table row in the low 32 bits, the row's generation in the high ones,
/// so an id outlives its sequence without ever naming the next one in the same row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl SeqId {
    pub(crate) fn new(row: u32, generation: u32) -> Self {
        SeqId((generation as u64) << 32 | row as u64)
    }
    /// Its block-table row.
    pub fn row(self) -> u32 {
        self.0 as u32
    }
    pub(crate) fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x} (row {}, generation {})", self.0, self.row(), self.generation())
    }
}
