//! MoonBright: a GPU memory allocator on the CUDA virtual-memory API.
//!
//! Physical memory is a pool of chunks; every allocation of a page or more is stitched from any
//! free chunks into one contiguous range at a fresh virtual address; freed ranges stay mapped for
//! reuse as they are until their pages are needed elsewhere, then are retired and unmapped later
//! in batches. Smaller allocations are carved from pages. See `docs/design.md`.
//!
//! ```no_run
//! use moonbright::{Allocator, Options};
//! let alloc = Allocator::new(Options::default())?;
//! let p = alloc.malloc(3 << 20)?;
//! alloc.free(p)?;
//! # Ok::<(), moonbright::Error>(())
//! ```

mod allocator;
pub mod conf;
pub mod config;
pub mod core;
pub mod devices;
pub mod driver;
mod error;
pub mod ipc;
pub mod libs;
pub mod nvrtc;
mod stream;
pub(crate) mod sync;
pub mod tags;
#[doc(hidden)]
pub mod testing;

pub use allocator::{Allocator, GrowableInfo};
pub use config::{BackendKind, Options, Profile};
pub use core::stats::{HeldAtPeak, Stat, Stats};
pub use driver::{Backend, CallKind, DevicePtr, DriverError, StreamHandle};
pub use error::{Error, Result};
pub use ipc::Export;
pub use tags::{Backup, SleepReport, TagInfo, WakeReport};
