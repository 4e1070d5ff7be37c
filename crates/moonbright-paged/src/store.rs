//! Where the pool's KV pages live: one growable allocation, so that page `p` is at
//! `base + p * page_bytes` and the pool grows and shrinks by committing or giving back pages at
//! its tail, in place. [`PageStore`] keeps that choice in one place.

use moonbright::{Allocator, DevicePtr, Result, StreamHandle};

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

/// A growable allocation of the pool's capacity: reserving it holds no memory; pages are
/// committed as the pool grows and given back (whole chunks) as it shrinks.
pub(crate) struct GrowableStore<'a> {
    alloc: &'a Allocator,
    base: DevicePtr,
    size: usize,
    live: bool,
}

impl<'a> GrowableStore<'a> {
    /// Reserves `capacity` bytes of addresses.
    pub(crate) fn new(alloc: &'a Allocator, capacity: usize) -> Result<Self> {
        let base = alloc.reserve_growable(capacity)?;
        Ok(GrowableStore { alloc, base, size: 0, live: true })
    }
}

impl PageStore for GrowableStore<'_> {
    fn base(&self) -> DevicePtr {
        self.base
    }
    fn resize(&mut self, bytes: usize, stream: StreamHandle) -> Result<()> {
        self.alloc.resize_async(self.base, bytes, stream)?;
        self.size = bytes;
        Ok(())
    }
    fn committed(&self) -> usize {
        self.size
    }
    fn release(&mut self, stream: StreamHandle) -> Result<()> {
        if std::mem::take(&mut self.live) {
            self.alloc.free_async(self.base, stream)?;
        }
        Ok(())
    }
}
