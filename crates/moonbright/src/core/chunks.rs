//! A range's chunk ids: owned, or a slice of an id buffer shared with the window the range came
//! from. Sharing is what lets a window hit hand over any number of pages without copying their
//! ids on the allocation path: a 1 GiB hit would copy 512 ids, an 8 GiB one 4,096, and on the
//! H200 that copy, into a new buffer from ids the mapper wrote on another core, was most of a
//! large hit's cost. Pure data; reads go through `Deref<Target = [ChunkId]>`.

use std::ops::Deref;
use std::sync::Arc;

use super::pool::ChunkId;

/// Chunk ids in address order.
#[derive(Clone, Debug)]
pub(crate) struct Chunks(Repr);

#[derive(Clone, Debug)]
enum Repr {
    Owned(Vec<ChunkId>),
    /// `buf[start..start + len]`; the owner of `buf` never changes those ids (it only appends
    /// past them, or copies on write).
    Shared {
        buf: Arc<Vec<ChunkId>>,
        start: usize,
        len: usize,
    },
}

impl Chunks {
    /// `buf[start..start + len]`, sharing `buf`.
    pub fn shared(buf: &Arc<Vec<ChunkId>>, start: usize, len: usize) -> Chunks {
        debug_assert!(start + len <= buf.len());
        Chunks(Repr::Shared { buf: Arc::clone(buf), start, len })
    }

    /// The ids as a vector of their own (a copy only if shared).
    pub fn into_vec(self) -> Vec<ChunkId> {
        match self.0 {
            Repr::Owned(v) => v,
            Repr::Shared { .. } => self.to_vec(),
        }
    }
}

impl From<Vec<ChunkId>> for Chunks {
    fn from(v: Vec<ChunkId>) -> Chunks {
        Chunks(Repr::Owned(v))
    }
}

impl Deref for Chunks {
    type Target = [ChunkId];

    fn deref(&self) -> &[ChunkId] {
        match &self.0 {
            Repr::Owned(v) => v,
            Repr::Shared { buf, start, len } => &buf[*start..*start + *len],
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn shared_and_owned_read_the_same() {
        let buf = Arc::new(vec![5, 6, 7, 8]);
        let s = Chunks::shared(&buf, 1, 2);
        assert_eq!(&*s, &[6, 7]);
        assert_eq!(*s, *Chunks::from(vec![6, 7]));
        assert_eq!(Arc::strong_count(&buf), 2);
        assert_eq!(s.into_vec(), vec![6, 7]);
        assert_eq!(Arc::strong_count(&buf), 1, "into_vec lets go of the shared buffer");
        assert_eq!(Chunks::from(vec![1]).into_vec(), vec![1]);
    }
}
