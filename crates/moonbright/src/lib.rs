//! MoonBright: a GPU memory allocator on the CUDA virtual-memory API.
//!
//! Physical memory is a pool of chunks; every allocation of a page or more is stitched from any
//! free chunks into one contiguous range at a fresh virtual address; freed ranges are retired and
//! unmapped later in batches. Smaller allocations are carved from pages. See `docs/design.md`.

pub mod driver;
pub(crate) mod sync;
