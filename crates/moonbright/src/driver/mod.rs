//! The driver contract: every call MoonBright makes to a GPU driver goes through it.
//!
//! The contract is split by concern, one trait each (`contract.rs`): [`VirtualMemory`] (reserve,
//! create, map, set access, unmap, release; and the batching and thread binding that serve those
//! calls), [`Peers`], [`Streams`] (streams and events), [`Capture`] (graph capture queries),
//! [`Ipc`] (export and import of chunks), [`Copies`] (synchronous copies, for tests and tools)
//! and [`Kernels`] (loading and launching kernels, for the paged pool). [`Driver`] bundles every
//! trait the allocator needs (all but `Kernels`) and is implemented for whatever implements them.
//!
//! Two backends implement the traits: [`cuda`] (the CUDA virtual-memory API through cudarc,
//! libcuda loaded at run time) and [`host`] (a faithful CPU model with real bytes, used by CI and
//! by trace replay). [`Backend`] is either one, chosen at run time; [`Instrumented`] wraps a
//! driver to count calls by kind and to fail the Nth call on request. Both forward every call
//! through one list per trait (`forward_calls!`, next to each trait): a new call is added to its
//! trait, to each backend's impl, and to that list.

mod backend;
mod calls;
mod contract;
pub mod cuda;
mod forward;
pub mod host;
mod instrumented;

use std::os::fd::OwnedFd;

pub use backend::Backend;
pub use calls::{CallCounts, CallKind, CallTimes};
pub use contract::{
    Capture, Copies, Driver, HostBuffer, Ipc, KernelHandle, Kernels, ModuleHandle, Offload, Peers,
    PinnedBuffer, Streams, VirtualMemory,
};
pub use instrumented::{thread_calls, Instrumented};

/// Every trait of the contract, for callers that name concrete drivers (`use
/// moonbright::driver::prelude::*`): a trait's methods are in scope only where it is imported.
pub mod prelude {
    pub use super::{
        Capture, Copies, Driver, Ipc, Kernels, Offload, Peers, Streams, VirtualMemory,
    };
}

/// A device virtual address (on the host backend, a host address).
pub type DevicePtr = u64;

/// A physical memory chunk: a `cuMemCreate` handle, or the host backend's equivalent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHandle(pub u64);

/// A stream (a `CUstream`, or the host backend's id). `StreamHandle::DEFAULT` is the legacy
/// default stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamHandle(pub u64);

impl StreamHandle {
    /// The default (null) stream.
    pub const DEFAULT: StreamHandle = StreamHandle(0);
}

/// An event (a `CUevent`, or the host backend's id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventHandle(pub u64);

/// Free and total device memory in bytes, as `cuMemGetInfo` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes the device can still give out.
    pub free: u64,
    /// Bytes of device memory in all.
    pub total: u64,
}

/// `CUresult` values the core looks at; other codes pass through as they are.
pub mod code {
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: i32 = 1;
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: i32 = 2;
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    pub const NOT_INITIALIZED: i32 = 3;
    /// `CUDA_ERROR_NO_DEVICE`.
    pub const NO_DEVICE: i32 = 100;
    /// `CUDA_ERROR_INVALID_HANDLE`.
    pub const INVALID_HANDLE: i32 = 400;
    /// `CUDA_ERROR_NOT_READY`.
    pub const NOT_READY: i32 = 600;
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: i32 = 801;
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: an operation not allowed on a capturing stream.
    pub const STREAM_CAPTURE_UNSUPPORTED: i32 = 900;
    /// `CUDA_ERROR_UNKNOWN`: what an injected failure reports.
    pub const UNKNOWN: i32 = 999;
}

/// A chunk shared with other processes: a file descriptor that names its physical memory, and
/// where in that file the chunk lies. On CUDA the descriptor is `cuMemExportToShareableHandle`'s
/// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) and names the chunk alone, at offset 0; on the
/// host backend it is the backend's memfd, and the chunk is `[offset, offset + size)` of it.
#[derive(Debug)]
pub struct SharedChunk {
    /// The descriptor; whoever holds it may import the chunk.
    pub fd: OwnedFd,
    /// Where the chunk starts in the descriptor's file (0 on CUDA).
    pub offset: u64,
    /// The chunk's size in bytes.
    pub size: u64,
}

/// A failed driver call: which call, the driver's status code, and what went wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed (code {code}): {message}")]
pub struct DriverError {
    /// The call that failed.
    pub call: CallKind,
    /// The `CUresult` (the host backend uses the same codes).
    pub code: i32,
    /// A readable reason.
    pub message: String,
}

impl DriverError {
    /// A new error.
    pub fn new(call: CallKind, code: i32, message: impl Into<String>) -> Self {
        DriverError { call, code, message: message.into() }
    }

    /// The same error, reported as a call of `kind`.
    pub fn with_kind(self, kind: CallKind) -> Self {
        DriverError { call: kind, ..self }
    }

    /// Whether the driver ran out of physical memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == code::OUT_OF_MEMORY
    }
}

/// Result of a driver call.
pub type DriverResult<T> = Result<T, DriverError>;

/// The span of addresses one level of the GPU's page tables covers: on an H200 the first mapping
/// in an empty 1 GiB-aligned region costs 14-18 µs more (docs/design.md, Known limits).
pub const PAGE_TABLE_REGION: usize = 1 << 30;

/// The alignment to reserve `size` bytes of addresses with: whole page-table regions for a
/// reservation of one or more, so that a range at its start spans no more regions than its size
/// needs (a 1 GiB range at an address aligned to 2 MiB only may straddle two); the granularity
/// `page` otherwise.
pub fn reservation_alignment(size: usize, page: usize) -> usize {
    if size >= PAGE_TABLE_REGION {
        PAGE_TABLE_REGION.max(page)
    } else {
        page
    }
}

/// Whether `VirtualMemory::begin_batch` began a batch (and `end_batch` must undo it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a batch must be ended"]
pub struct Batch(pub(crate) bool);

/// Runs `f`, whose driver calls are all `driver`'s on this thread, as one batch of them.
pub(crate) fn batched<R>(driver: &dyn Driver, f: impl FnOnce() -> R) -> R {
    struct End<'a>(&'a dyn Driver, Batch);
    impl Drop for End<'_> {
        fn drop(&mut self) {
            self.0.end_batch(self.1);
        }
    }
    let _end = End(driver, driver.begin_batch());
    f()
}
