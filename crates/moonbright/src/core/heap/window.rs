//! The heap's side of the window (`core/window.rs`): the mapped window itself, the address slab
//! it grows in, and the demand at fresh addresses that the background mapper shapes it by.

use crate::core::window::Window;

#[derive(Debug)]
pub(super) struct WindowBooks {
    /// Chunks mapped ahead at fresh addresses.
    pub(super) mapped: Window,
    /// The address slab the window grows in: (next, end).
    pub(super) slab: (u64, u64),
    /// Pages served at fresh addresses (window or new mapping) since the mapper last looked.
    pub(super) fresh_pages: u64,
    /// The largest of those requests since then, in pages (what the mapper shapes whole
    /// window chunks by).
    pub(super) fresh_largest: u64,
    /// When a request last finished mapping a range itself (the mapper keeps out of its way).
    pub(super) last_request_map: Option<crate::sync::Instant>,
}

impl WindowBooks {
    pub(super) fn new(page: u64) -> Self {
        WindowBooks {
            mapped: Window::new(page),
            slab: (0, 0),
            fresh_pages: 0,
            fresh_largest: 0,
            last_request_map: None,
        }
    }

    /// Counts a request of `asked` pages served `got` pages at fresh addresses (the mapper's
    /// measure of demand).
    #[inline]
    pub(super) fn note_fresh(&mut self, asked: u64, got: u64) {
        self.fresh_pages += got;
        self.fresh_largest = self.fresh_largest.max(asked);
    }

    /// Since the last call: the pages fresh allocations took, and the largest of their
    /// requests, in pages.
    pub(super) fn take_fresh_demand(&mut self) -> (u64, u64) {
        (std::mem::take(&mut self.fresh_pages), std::mem::take(&mut self.fresh_largest))
    }
}
