//! Where the pool's KV pages live: one contiguous virtual range, so that page `p` is at
//! `base + p * page_bytes`. [`PageStore`] hides how it grows and shrinks; today's
//! [`FixedStore`] allocates the whole capacity once, until the core's growable allocations
//! (`reserve_growable` / `resize_async`) land and a second implementation commits pages at the
//! tail on demand.

use crate::{Allocator, DevicePtr, Result, StreamHandle};

/// The backing of a pool's pages.
pub(crate) trait PageStore: Send {
    /// The address of page 0; never changes.
    fn base(&self) -> DevicePtr;
    /// Makes the first `bytes` usable (growing or shrinking at the tail), stream-ordered on
    /// `stream`. Never above the capacity the store was made with.
    fn resize(&mut self, bytes: usize, stream: StreamHandle) -> Result<()>;
    /// Bytes usable now.
    fn committed(&self) -> usize;
    /// Gives the memory back, stream-ordered on `stream`.
    fn release(&mut self, stream: StreamHandle) -> Result<()>;
}

/// The whole capacity allocated at once from MoonBright; `resize` only keeps the books.
pub(crate) struct FixedStore<'a> {
    alloc: &'a Allocator,
    base: DevicePtr,
    committed: usize,
    live: bool,
}

impl<'a> FixedStore<'a> {
    /// Allocates `capacity` bytes on `stream`.
    pub(crate) fn new(alloc: &'a Allocator, capacity: usize, stream: StreamHandle) -> Result<Self> {
        let base = alloc.malloc_async(capacity, stream)?;
        Ok(FixedStore { alloc, base, committed: 0, live: true })
    }
}

impl PageStore for FixedStore<'_> {
    fn base(&self) -> DevicePtr {
        self.base
    }
    fn resize(&mut self, bytes: usize, _stream: StreamHandle) -> Result<()> {
        self.committed = bytes;
        Ok(())
    }
    fn committed(&self) -> usize {
        self.committed
    }
    fn release(&mut self, stream: StreamHandle) -> Result<()> {
        if std::mem::take(&mut self.live) {
            self.alloc.free_async(self.base, stream)?;
        }
        Ok(())
    }
}
