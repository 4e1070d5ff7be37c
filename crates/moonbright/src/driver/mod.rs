//! The driver contract: every call MoonBright makes to a GPU driver goes through [`Driver`].
//!
//! Two backends implement it: [`cuda`] (the CUDA virtual-memory API through cudarc, libcuda loaded
//! at run time) and [`host`] (a faithful CPU model with real bytes, used by CI and by trace replay).
//! [`Instrumented`] wraps either one to count calls by kind and to fail the Nth call on request.

pub mod cuda;
pub mod host;

use std::fmt;
use std::os::fd::OwnedFd;

use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::Mutex;

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

/// The kinds of driver call, for counters and fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum CallKind {
    /// `cuMemGetInfo`.
    MemInfo,
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemAddressFree`.
    FreeReservation,
    /// `cuMemCreate`.
    Create,
    /// `cuMemRelease`.
    Release,
    /// `cuMemMap`.
    Map,
    /// `cuMemSetAccess`.
    SetAccess,
    /// `cuMemUnmap`.
    Unmap,
    /// `cuMemcpyHtoD` / `cuMemcpyDtoH` (tests and tools only).
    Copy,
    /// `cuStreamCreate`.
    StreamCreate,
    /// `cuStreamDestroy`.
    StreamDestroy,
    /// `cuEventCreate`.
    EventCreate,
    /// `cuEventRecord`.
    EventRecord,
    /// `cuEventQuery`.
    EventQuery,
    /// `cuEventDestroy`.
    EventDestroy,
    /// `cuEventSynchronize`.
    EventSynchronize,
    /// `cuStreamIsCapturing`.
    StreamIsCapturing,
    /// `cuDeviceCanAccessPeer`, checking a peer for [`Driver::set_peers`].
    PeerAccess,
    /// `cuMemExportToShareableHandle`.
    Export,
    /// `cuMemImportFromShareableHandle`.
    Import,
}

impl CallKind {
    /// Every kind, in counter order.
    pub const ALL: [CallKind; 20] = [
        CallKind::MemInfo,
        CallKind::Reserve,
        CallKind::FreeReservation,
        CallKind::Create,
        CallKind::Release,
        CallKind::Map,
        CallKind::SetAccess,
        CallKind::Unmap,
        CallKind::Copy,
        CallKind::StreamCreate,
        CallKind::StreamDestroy,
        CallKind::EventCreate,
        CallKind::EventRecord,
        CallKind::EventQuery,
        CallKind::EventDestroy,
        CallKind::EventSynchronize,
        CallKind::StreamIsCapturing,
        CallKind::PeerAccess,
        CallKind::Export,
        CallKind::Import,
    ];

    /// The driver function this kind stands for.
    pub fn driver_name(self) -> &'static str {
        match self {
            CallKind::MemInfo => "cuMemGetInfo",
            CallKind::Reserve => "cuMemAddressReserve",
            CallKind::FreeReservation => "cuMemAddressFree",
            CallKind::Create => "cuMemCreate",
            CallKind::Release => "cuMemRelease",
            CallKind::Map => "cuMemMap",
            CallKind::SetAccess => "cuMemSetAccess",
            CallKind::Unmap => "cuMemUnmap",
            CallKind::Copy => "cuMemcpy",
            CallKind::StreamCreate => "cuStreamCreate",
            CallKind::StreamDestroy => "cuStreamDestroy",
            CallKind::EventCreate => "cuEventCreate",
            CallKind::EventRecord => "cuEventRecord",
            CallKind::EventQuery => "cuEventQuery",
            CallKind::EventDestroy => "cuEventDestroy",
            CallKind::EventSynchronize => "cuEventSynchronize",
            CallKind::StreamIsCapturing => "cuStreamIsCapturing",
            CallKind::PeerAccess => "cuDeviceCanAccessPeer",
            CallKind::Export => "cuMemExportToShareableHandle",
            CallKind::Import => "cuMemImportFromShareableHandle",
        }
    }

    /// A short snake_case name, used as a statistics key.
    pub fn key(self) -> &'static str {
        match self {
            CallKind::MemInfo => "mem_info",
            CallKind::Reserve => "reserve",
            CallKind::FreeReservation => "free_reservation",
            CallKind::Create => "create",
            CallKind::Release => "release",
            CallKind::Map => "map",
            CallKind::SetAccess => "set_access",
            CallKind::Unmap => "unmap",
            CallKind::Copy => "copy",
            CallKind::StreamCreate => "stream_create",
            CallKind::StreamDestroy => "stream_destroy",
            CallKind::EventCreate => "event_create",
            CallKind::EventRecord => "event_record",
            CallKind::EventQuery => "event_query",
            CallKind::EventDestroy => "event_destroy",
            CallKind::EventSynchronize => "event_synchronize",
            CallKind::StreamIsCapturing => "stream_is_capturing",
            CallKind::PeerAccess => "peer_access",
            CallKind::Export => "export",
            CallKind::Import => "import",
        }
    }
}

impl fmt::Display for CallKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.driver_name())
    }
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

/// The narrow contract between MoonBright and a GPU driver.
///
/// Rules every backend enforces (those of the CUDA virtual-memory API): sizes and addresses are
/// multiples of [`Driver::granularity`]; a chunk is mapped whole (offset 0) and only onto addresses
/// inside a reservation that nothing maps yet; an unmap covers whole mappings (it may span several);
/// memory is readable and writable only after `set_access`; a chunk may be mapped at several
/// addresses at once, and releasing a mapped chunk frees its memory only once its last mapping goes.
/// No call waits for work running on the device.
pub trait Driver: Send + Sync + fmt::Debug {
    /// `"cuda"` or `"host"`.
    fn name(&self) -> &'static str;
    /// The mapping granularity in bytes (2 MiB on an H200).
    fn granularity(&self) -> usize;
    /// Free and total device memory.
    fn mem_info(&self) -> DriverResult<MemInfo>;
    /// Reserves `size` bytes of virtual addresses aligned to `alignment` (0: granularity).
    fn reserve(&self, size: usize, alignment: usize) -> DriverResult<DevicePtr>;
    /// Gives back a whole reservation; nothing in it may still be mapped.
    fn free_reservation(&self, base: DevicePtr, size: usize) -> DriverResult<()>;
    /// Creates a physical chunk of `size` bytes, a multiple of the granularity.
    fn create_chunk(&self, size: usize) -> DriverResult<ChunkHandle>;
    /// Releases a chunk; its memory is freed once it is mapped nowhere.
    fn release_chunk(&self, handle: ChunkHandle) -> DriverResult<()>;
    /// Maps the whole of `handle` (of `size` bytes) at `va`.
    fn map(&self, va: DevicePtr, size: usize, handle: ChunkHandle) -> DriverResult<()>;
    /// Makes `[va, va + size)`, which must be mapped, readable and writable by the device and
    /// by its peers (`set_peers`).
    fn set_access(&self, va: DevicePtr, size: usize) -> DriverResult<()>;
    /// Sets the other devices that later `set_access` calls grant access to, beside this one
    /// (kernels and copies on a peer then reach this device's memory directly). Fails, leaving
    /// the list as it was, if a device cannot access this one peer to peer.
    fn set_peers(&self, peers: &[i32]) -> DriverResult<()>;
    /// Makes this device the calling thread's for good (MoonBright's own threads), so its calls
    /// need not switch contexts. Callers' threads are left as they are.
    fn bind_thread(&self) -> DriverResult<()> {
        Ok(())
    }
    /// Starts a batch of calls on the calling thread (one plan's creates, maps and set access,
    /// or an unmap batch's calls): set-up each call would otherwise repeat (the CUDA backend's
    /// context and stream-capture mode) is done once here and undone by `end_batch`, which the
    /// caller must call on the same thread with what this returned (`batched` does both). No
    /// other code may run on the thread in between. A batch begun inside another does nothing.
    fn begin_batch(&self) -> Batch {
        Batch(false)
    }
    /// Ends a batch `begin_batch` began.
    fn end_batch(&self, batch: Batch) {
        let _ = batch;
    }
    /// Unmaps `[va, va + size)`, which must consist of whole mappings.
    fn unmap(&self, va: DevicePtr, size: usize) -> DriverResult<()>;
    /// Copies host bytes to accessible device memory (synchronous; for tests and tools).
    fn write(&self, dst: DevicePtr, src: &[u8]) -> DriverResult<()>;
    /// Copies accessible device memory to host bytes (synchronous; for tests and tools).
    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> DriverResult<()>;
    /// Creates a non-blocking stream.
    fn create_stream(&self) -> DriverResult<StreamHandle>;
    /// Destroys a stream.
    fn destroy_stream(&self, stream: StreamHandle) -> DriverResult<()>;
    /// Creates an event without timing.
    fn create_event(&self) -> DriverResult<EventHandle>;
    /// Records `event` on `stream`.
    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> DriverResult<()>;
    /// Whether all work captured by the event's last record has completed.
    fn event_done(&self, event: EventHandle) -> DriverResult<bool>;
    /// Destroys an event.
    fn destroy_event(&self, event: EventHandle) -> DriverResult<()>;
    /// Blocks the calling thread until the event's work has completed (never the device).
    fn synchronize_event(&self, event: EventHandle) -> DriverResult<()>;
    /// Whether `stream` is being captured into a CUDA graph.
    fn is_capturing(&self, stream: StreamHandle) -> DriverResult<bool>;
    /// The id of the capture `stream` is part of (unique in the process), or `None` when it is
    /// not being captured, or the backend cannot tell (the default: its captures are then
    /// refused, as without a graph pool). Counted as `StreamIsCapturing`.
    fn capture_id(&self, stream: StreamHandle) -> DriverResult<Option<u64>> {
        let _ = stream;
        Ok(None)
    }
    /// Exports chunk `handle` (of `size` bytes) for another process. The chunk's memory then
    /// lives until this process releases the chunk and every importer has released its own
    /// handle, whichever comes last. Fails with `NOT_SUPPORTED` when the chunk was created
    /// without a shareable handle type (`Driver::shareable`).
    fn export_chunk(&self, handle: ChunkHandle, size: usize) -> DriverResult<SharedChunk> {
        let _ = (handle, size);
        Err(DriverError::new(
            CallKind::Export,
            code::NOT_SUPPORTED,
            "this backend cannot share memory with other processes",
        ))
    }
    /// Imports a chunk another process exported: a handle of this driver's, mapped, given
    /// access and released like one `create_chunk` made. The descriptor stays the caller's.
    fn import_chunk(&self, chunk: &SharedChunk) -> DriverResult<ChunkHandle> {
        let _ = chunk;
        Err(DriverError::new(
            CallKind::Import,
            code::NOT_SUPPORTED,
            "this backend cannot share memory with other processes",
        ))
    }
    /// Whether the chunks `create_chunk` makes can be exported.
    fn shareable(&self) -> bool {
        false
    }
}

/// Whether `Driver::begin_batch` began a batch (and `end_batch` must undo it).
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

/// Counts of driver calls by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCounts(pub [u64; CallKind::ALL.len()]);

impl CallCounts {
    /// Calls of one kind.
    pub fn get(&self, kind: CallKind) -> u64 {
        self.0[kind as usize]
    }

    /// All calls.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// `(kind, count)` for every kind.
    pub fn iter(&self) -> impl Iterator<Item = (CallKind, u64)> + '_ {
        CallKind::ALL.iter().map(move |&k| (k, self.get(k)))
    }

    /// Counts since `earlier`.
    pub fn since(&self, earlier: &CallCounts) -> CallCounts {
        let mut out = CallCounts::default();
        for k in CallKind::ALL {
            out.0[k as usize] = self.get(k).saturating_sub(earlier.get(k));
        }
        out
    }
}

/// Time spent in the virtual-memory calls (reserve, create, release, map, set access, unmap),
/// by kind: the total and the longest single call, in nanoseconds. Other kinds stay at zero
/// (their calls are sub-microsecond and on fast paths, where two clock reads would show).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallTimes {
    pub total_ns: [u64; CallKind::ALL.len()],
    pub max_ns: [u64; CallKind::ALL.len()],
}

impl CallTimes {
    /// Whether calls of `kind` are timed.
    pub fn timed(kind: CallKind) -> bool {
        use CallKind::*;
        matches!(kind, Reserve | Create | Release | Map | SetAccess | Unmap)
    }
}

// The calls each thread made through any `Instrumented` driver, and the time in its timed
// ones: how a replay tells a slow request's own calls from those other threads made beside it.
// Cells, not a `RefCell`: every call (the capture query of a cache hit too) adds to them.
#[cfg(not(loom))]
thread_local! {
    static THREAD_COUNTS: [std::cell::Cell<u64>; CallKind::ALL.len()] =
        const { [const { std::cell::Cell::new(0) }; CallKind::ALL.len()] };
    static THREAD_NS: [std::cell::Cell<u64>; CallKind::ALL.len()] =
        const { [const { std::cell::Cell::new(0) }; CallKind::ALL.len()] };
}

/// Adds `n` to a thread's counter of kind `kind`.
#[cfg(not(loom))]
fn add_to(cells: &[std::cell::Cell<u64>; CallKind::ALL.len()], kind: CallKind, n: u64) {
    let c = &cells[kind as usize];
    c.set(c.get() + n);
}

/// The calls the calling thread has made so far through any [`Instrumented`] driver, and the
/// time in its virtual-memory calls (the maximum is not kept). All zero under loom.
pub fn thread_calls() -> (CallCounts, CallTimes) {
    #[cfg(not(loom))]
    {
        let mut counts = CallCounts::default();
        let mut times = CallTimes::default();
        THREAD_COUNTS.with(|c| counts.0 = std::array::from_fn(|k| c[k].get()));
        THREAD_NS.with(|c| times.total_ns = std::array::from_fn(|k| c[k].get()));
        (counts, times)
    }
    #[cfg(loom)]
    {
        Default::default()
    }
}

/// A planned failure: the `nth` next call of `kind` (1 = the very next) fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PlannedFailure {
    kind: CallKind,
    remaining: u64,
    code: i32,
}

/// Wraps a backend: counts every call by kind and fails planned calls.
///
/// Counting is lock-free (one atomic per kind). Planned failures sit behind a mutex that is taken
/// only while at least one failure is planned, so the common path pays one atomic load.
#[derive(Debug)]
pub struct Instrumented<D> {
    inner: D,
    counts: [AtomicU64; CallKind::ALL.len()],
    /// Nanoseconds in timed calls, total and longest (not kept under loom).
    #[cfg(not(loom))]
    nanos: [(AtomicU64, AtomicU64); CallKind::ALL.len()],
    armed: AtomicU64,
    plans: Mutex<Vec<PlannedFailure>>,
}

impl<D: Driver> Instrumented<D> {
    /// Wraps `inner`.
    pub fn new(inner: D) -> Self {
        Instrumented {
            inner,
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            #[cfg(not(loom))]
            nanos: std::array::from_fn(|_| (AtomicU64::new(0), AtomicU64::new(0))),
            armed: AtomicU64::new(0),
            plans: Mutex::new(Vec::new()),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Calls made so far, by kind.
    pub fn counts(&self) -> CallCounts {
        let mut out = CallCounts::default();
        for k in CallKind::ALL {
            out.0[k as usize] = self.counts[k as usize].load(Ordering::Relaxed);
        }
        out
    }

    /// Time spent in the virtual-memory calls so far (all zero under loom).
    pub fn times(&self) -> CallTimes {
        #[cfg_attr(loom, allow(unused_mut))]
        let mut out = CallTimes::default();
        #[cfg(not(loom))]
        for k in CallKind::ALL {
            let (total, max) = &self.nanos[k as usize];
            out.total_ns[k as usize] = total.load(Ordering::Relaxed);
            out.max_ns[k as usize] = max.load(Ordering::Relaxed);
        }
        out
    }

    /// Runs a virtual-memory call, adding its duration to the kind's total and maximum.
    #[inline]
    fn timed<T>(&self, kind: CallKind, call: impl FnOnce() -> DriverResult<T>) -> DriverResult<T> {
        #[cfg(not(loom))]
        {
            let start = std::time::Instant::now();
            let r = call();
            let ns = start.elapsed().as_nanos() as u64;
            THREAD_NS.with(|c| add_to(c, kind, ns));
            let (total, max) = &self.nanos[kind as usize];
            total.fetch_add(ns, Ordering::Relaxed);
            // A compare-and-swap loop only when this call is a new maximum.
            if ns > max.load(Ordering::Relaxed) {
                max.fetch_max(ns, Ordering::Relaxed);
            }
            r
        }
        #[cfg(loom)]
        {
            let _ = kind;
            call()
        }
    }

    /// Makes the `nth` next call of `kind` (1 = the next one) fail with `CUDA_ERROR_UNKNOWN`,
    /// or with `error_code` when given (for example `code::OUT_OF_MEMORY`).
    pub fn fail_nth(&self, kind: CallKind, nth: u64, error_code: Option<i32>) {
        assert!(nth >= 1, "fail_nth counts from 1");
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        plans.push(PlannedFailure {
            kind,
            remaining: nth,
            code: error_code.unwrap_or(code::UNKNOWN),
        });
        self.armed.store(plans.len() as u64, Ordering::SeqCst);
    }

    /// Forgets every planned failure that has not fired.
    pub fn clear_failures(&self) {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        plans.clear();
        self.armed.store(0, Ordering::SeqCst);
    }

    /// Counts the call and decides whether it is one planned to fail.
    fn enter(&self, kind: CallKind) -> DriverResult<()> {
        self.counts[kind as usize].fetch_add(1, Ordering::Relaxed);
        #[cfg(not(loom))]
        THREAD_COUNTS.with(|c| add_to(c, kind, 1));
        if self.armed.load(Ordering::SeqCst) == 0 {
            return Ok(());
        }
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        // Every plan of this kind counts the call; all that reach zero fire together, as one
        // failure of this call.
        let mut fired = None;
        plans.retain_mut(|plan| {
            if plan.kind != kind {
                return true;
            }
            plan.remaining -= 1;
            if plan.remaining == 0 {
                fired.get_or_insert(plan.code);
                return false;
            }
            true
        });
        self.armed.store(plans.len() as u64, Ordering::SeqCst);
        match fired {
            Some(code) => Err(DriverError::new(kind, code, "injected failure")),
            None => Ok(()),
        }
    }
}

impl<D: Driver> Driver for Instrumented<D> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn granularity(&self) -> usize {
        self.inner.granularity()
    }
    fn mem_info(&self) -> DriverResult<MemInfo> {
        self.enter(CallKind::MemInfo)?;
        self.inner.mem_info()
    }
    fn reserve(&self, size: usize, alignment: usize) -> DriverResult<DevicePtr> {
        self.enter(CallKind::Reserve)?;
        self.timed(CallKind::Reserve, || self.inner.reserve(size, alignment))
    }
    fn free_reservation(&self, base: DevicePtr, size: usize) -> DriverResult<()> {
        self.enter(CallKind::FreeReservation)?;
        self.inner.free_reservation(base, size)
    }
    fn create_chunk(&self, size: usize) -> DriverResult<ChunkHandle> {
        self.enter(CallKind::Create)?;
        self.timed(CallKind::Create, || self.inner.create_chunk(size))
    }
    fn release_chunk(&self, handle: ChunkHandle) -> DriverResult<()> {
        self.enter(CallKind::Release)?;
        self.timed(CallKind::Release, || self.inner.release_chunk(handle))
    }
    fn map(&self, va: DevicePtr, size: usize, handle: ChunkHandle) -> DriverResult<()> {
        self.enter(CallKind::Map)?;
        self.timed(CallKind::Map, || self.inner.map(va, size, handle))
    }
    fn set_access(&self, va: DevicePtr, size: usize) -> DriverResult<()> {
        self.enter(CallKind::SetAccess)?;
        self.timed(CallKind::SetAccess, || self.inner.set_access(va, size))
    }
    fn unmap(&self, va: DevicePtr, size: usize) -> DriverResult<()> {
        self.enter(CallKind::Unmap)?;
        self.timed(CallKind::Unmap, || self.inner.unmap(va, size))
    }
    fn set_peers(&self, peers: &[i32]) -> DriverResult<()> {
        self.enter(CallKind::PeerAccess)?;
        self.inner.set_peers(peers)
    }
    fn bind_thread(&self) -> DriverResult<()> {
        self.inner.bind_thread()
    }
    fn begin_batch(&self) -> Batch {
        self.inner.begin_batch()
    }
    fn end_batch(&self, batch: Batch) {
        self.inner.end_batch(batch)
    }
    fn write(&self, dst: DevicePtr, src: &[u8]) -> DriverResult<()> {
        self.enter(CallKind::Copy)?;
        self.inner.write(dst, src)
    }
    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> DriverResult<()> {
        self.enter(CallKind::Copy)?;
        self.inner.read(src, dst)
    }
    fn create_stream(&self) -> DriverResult<StreamHandle> {
        self.enter(CallKind::StreamCreate)?;
        self.inner.create_stream()
    }
    fn destroy_stream(&self, stream: StreamHandle) -> DriverResult<()> {
        self.enter(CallKind::StreamDestroy)?;
        self.inner.destroy_stream(stream)
    }
    fn create_event(&self) -> DriverResult<EventHandle> {
        self.enter(CallKind::EventCreate)?;
        self.inner.create_event()
    }
    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> DriverResult<()> {
        self.enter(CallKind::EventRecord)?;
        self.inner.record_event(event, stream)
    }
    fn event_done(&self, event: EventHandle) -> DriverResult<bool> {
        self.enter(CallKind::EventQuery)?;
        self.inner.event_done(event)
    }
    fn destroy_event(&self, event: EventHandle) -> DriverResult<()> {
        self.enter(CallKind::EventDestroy)?;
        self.inner.destroy_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> DriverResult<()> {
        self.enter(CallKind::EventSynchronize)?;
        self.inner.synchronize_event(event)
    }
    fn is_capturing(&self, stream: StreamHandle) -> DriverResult<bool> {
        self.enter(CallKind::StreamIsCapturing)?;
        self.inner.is_capturing(stream)
    }
    fn capture_id(&self, stream: StreamHandle) -> DriverResult<Option<u64>> {
        self.enter(CallKind::StreamIsCapturing)?;
        self.inner.capture_id(stream)
    }
    fn export_chunk(&self, handle: ChunkHandle, size: usize) -> DriverResult<SharedChunk> {
        self.enter(CallKind::Export)?;
        self.inner.export_chunk(handle, size)
    }
    fn import_chunk(&self, chunk: &SharedChunk) -> DriverResult<ChunkHandle> {
        self.enter(CallKind::Import)?;
        self.inner.import_chunk(chunk)
    }
    fn shareable(&self) -> bool {
        self.inner.shareable()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A thread's own counts take its calls through any instrumented driver, and not another
    /// thread's.
    #[cfg(not(miri))]
    #[test]
    fn thread_calls_count_only_the_calling_threads_calls() {
        let d = Instrumented::new(
            host::HostDriver::new(host::HostConfig { page_size: 64 << 10, capacity: 1 << 20 })
                .unwrap(),
        );
        let (before, _) = thread_calls();
        let h = d.create_chunk(64 << 10).unwrap();
        let other = std::thread::scope(|s| s.spawn(|| d.create_chunk(64 << 10).unwrap()).join());
        let (after, times) = thread_calls();
        let mine = after.since(&before);
        assert_eq!((mine.get(CallKind::Create), d.counts().get(CallKind::Create)), (1, 2));
        assert!(times.total_ns[CallKind::Create as usize] > 0);
        d.release_chunk(h).unwrap();
        d.release_chunk(other.unwrap()).unwrap();
    }

    #[test]
    fn call_counts_since_subtracts_per_kind() {
        let mut a = CallCounts::default();
        a.0[CallKind::Map as usize] = 5;
        let mut b = a;
        b.0[CallKind::Map as usize] = 8;
        b.0[CallKind::Unmap as usize] = 2;
        let d = b.since(&a);
        assert_eq!(d.get(CallKind::Map), 3);
        assert_eq!(d.get(CallKind::Unmap), 2);
        assert_eq!(d.total(), 5);
    }

    #[test]
    #[cfg_attr(miri, ignore = "the host backend's memfd and mmap calls are outside Miri")]
    fn vmm_calls_are_timed_and_others_are_not() {
        let cfg = host::HostConfig { page_size: 64 << 10, capacity: 1 << 20 };
        let d = Instrumented::new(host::HostDriver::new(cfg).unwrap());
        let h = d.create_chunk(64 << 10).unwrap();
        let va = d.reserve(128 << 10, 0).unwrap();
        d.map(va, 64 << 10, h).unwrap();
        d.map(va + (64 << 10), 64 << 10, h).unwrap();
        d.create_stream().unwrap();
        let t = d.times();
        let map = CallKind::Map as usize;
        assert!(t.max_ns[map] > 0 && t.max_ns[map] <= t.total_ns[map]);
        assert!(t.total_ns[CallKind::Create as usize] > 0);
        assert_eq!(t.total_ns[CallKind::StreamCreate as usize], 0);
        assert!(CallTimes::timed(CallKind::SetAccess) && !CallTimes::timed(CallKind::EventRecord));
    }

    #[test]
    fn call_kind_order_matches_discriminants() {
        for (i, k) in CallKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i);
        }
    }
}
