//! MoonBright's paged KV-cache pool: pages of `tokens_per_page x bytes_per_token` in one
//! growable range of MoonBright memory, and per sequence the list of pages it owns
//! (reference-counted, so that forks share their prefix and copy a shared page only when it is
//! written), with the device tables a paged-attention kernel reads (block table, lengths, batch
//! list, slot mapping) kept up to date step by step.
//!
//! The host side ([`PagedPool`], `pool/`) keeps the metadata, validates every request (a refused
//! request changes nothing) and ships each step's [`Delta`]. The tables sit in fixed buffers, so
//! their addresses never change; `device.rs` updates them with kernels (`kernels.cu`, compiled
//! by NVRTC at run time) through the driver contract's `Kernels`, and on a driver that runs no
//! kernels (the host backend) `reference.rs` does the same on host memory. Everything here uses
//! the `moonbright` crate's public API. See "Paged KV pool" in docs/design.md.

mod config;
mod delta;
mod device;
mod error;
mod ids;
mod pool;
pub mod reference;
mod rows;
mod seq;
mod store;

pub use config::{PagedConfig, TablePointers};
pub use delta::{
    Delta, PageCopy, TableOp, TokenRun, DEAD_ROW, OP_BATCH, OP_BLOCK, OP_CLEAR, OP_LEN,
};
pub use device::{kernel_source, nvrtc_options, NvrtcOptions};
pub use error::{PagedError, PagedResult};
pub use pool::PagedPool;
pub use seq::SeqId;
