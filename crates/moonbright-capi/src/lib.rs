//! The C API of MoonBright: `extern "C"` functions over the core [`moonbright::Allocator`],
//! the C structures they fill, the status codes and the per-thread last error. The header
//! `include/moonbright.h` is generated from this crate by cbindgen (see `tests/header.rs`).
//!
//! `options.rs` turns `mb_options` into the core's; `calls.rs` holds the allocator's entry
//! points; `status.rs` the status codes, the last error, the wrapper every entry point runs in
//! and the strings; `types.rs` the C structures; `paged.rs`, `growable.rs` and `ipc.rs` the
//! paged pool's, growable allocations' and sharing's entry points; `tags.rs` the tags', sleep's
//! and wake's.
//!
//! Conventions, for every function:
//! - Fallible functions return an `int` status, `MB_OK` (0) on success. On failure the output
//!   arguments are left untouched and `mb_last_error()` describes what went wrong.
//! - Every pointer argument is checked for NULL (`MB_ERR_INVALID_ARGUMENT`).
//! - No Rust panic crosses the boundary: a panic is caught and reported as `MB_ERR_INTERNAL`,
//!   with its message as the last error.

#![allow(non_camel_case_types)]

// cbindgen writes the header's functions in the order of these modules (and its constants
// and structures too): keep it.
mod options;

mod calls;

mod status;

mod types;

mod paged;

mod growable;

mod ipc;

mod tags;

pub use calls::*;
pub use growable::*;
pub use ipc::*;
pub use options::*;
pub use paged::*;
pub use status::*;
pub use tags::*;
pub use types::*;
