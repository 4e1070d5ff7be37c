//! The contract between MoonBright and a GPU driver, one trait per concern, each followed by its
//! forwarding list (`forward_calls!`): the calls [`Instrumented`] and [`Backend`] pass on.
//!
//! Rules every backend enforces (those of the CUDA virtual-memory API): sizes and addresses are
//! multiples of [`VirtualMemory::granularity`]; a chunk is mapped whole (offset 0) and only onto
//! addresses inside a reservation that nothing maps yet; an unmap covers whole mappings (it may
//! span several); memory is readable and writable only after `set_access`; a chunk may be mapped
//! at several addresses at once, and releasing a mapped chunk frees its memory only once its last
//! mapping goes. No call waits for work running on the device.

use std::ffi::c_void;
use std::fmt;

use super::forward::forward_calls;
use super::{
    code, Batch, CallKind, ChunkHandle, DevicePtr, DriverError, DriverResult, EventHandle, MemInfo,
    SharedChunk, StreamHandle,
};
#[cfg(doc)]
use super::{Backend, Instrumented};

/// Virtual addresses and physical chunks: reserve, create, map, set access, unmap, release.
///
/// Batching and thread binding are here too: they exist to make runs of these calls cheaper.
pub trait VirtualMemory {
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
    /// by its peers ([`Peers::set_peers`]).
    fn set_access(&self, va: DevicePtr, size: usize) -> DriverResult<()>;
    /// Unmaps `[va, va + size)`, which must consist of whole mappings.
    fn unmap(&self, va: DevicePtr, size: usize) -> DriverResult<()>;
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
}

forward_calls! {
    VirtualMemory {
        fn name(&self) -> &'static str;
        fn granularity(&self) -> usize;
        fn mem_info(&self) -> DriverResult<MemInfo> => counted(MemInfo);
        fn reserve(&self, size: usize, alignment: usize) -> DriverResult<DevicePtr>
            => timed(Reserve);
        fn free_reservation(&self, base: DevicePtr, size: usize) -> DriverResult<()>
            => counted(FreeReservation);
        fn create_chunk(&self, size: usize) -> DriverResult<ChunkHandle> => timed(Create);
        fn release_chunk(&self, handle: ChunkHandle) -> DriverResult<()> => timed(Release);
        fn map(&self, va: DevicePtr, size: usize, handle: ChunkHandle) -> DriverResult<()>
            => timed(Map);
        fn set_access(&self, va: DevicePtr, size: usize) -> DriverResult<()> => timed(SetAccess);
        fn unmap(&self, va: DevicePtr, size: usize) -> DriverResult<()> => timed(Unmap);
        fn bind_thread(&self) -> DriverResult<()>;
        fn begin_batch(&self) -> Batch;
        fn end_batch(&self, batch: Batch) -> ();
    }
}

/// Other devices that reach this device's memory directly.
pub trait Peers {
    /// Sets the other devices that later `set_access` calls grant access to, beside this one
    /// (kernels and copies on a peer then reach this device's memory directly). Fails, leaving
    /// the list as it was, if a device cannot access this one peer to peer.
    fn set_peers(&self, peers: &[i32]) -> DriverResult<()>;
}

forward_calls! {
    Peers {
        fn set_peers(&self, peers: &[i32]) -> DriverResult<()> => counted(PeerAccess);
    }
}

/// Streams, and the events that order frees after the work on them.
pub trait Streams {
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
}

forward_calls! {
    Streams {
        fn create_stream(&self) -> DriverResult<StreamHandle> => counted(StreamCreate);
        fn destroy_stream(&self, stream: StreamHandle) -> DriverResult<()>
            => counted(StreamDestroy);
        fn create_event(&self) -> DriverResult<EventHandle> => counted(EventCreate);
        fn record_event(&self, event: EventHandle, stream: StreamHandle) -> DriverResult<()>
            => counted(EventRecord);
        fn event_done(&self, event: EventHandle) -> DriverResult<bool> => counted(EventQuery);
        fn destroy_event(&self, event: EventHandle) -> DriverResult<()> => counted(EventDestroy);
        fn synchronize_event(&self, event: EventHandle) -> DriverResult<()>
            => counted(EventSynchronize);
    }
}

/// Whether a stream is being captured into a CUDA graph.
pub trait Capture {
    /// Whether `stream` is being captured into a CUDA graph.
    fn is_capturing(&self, stream: StreamHandle) -> DriverResult<bool>;
    /// The id of the capture `stream` is part of (unique in the process), or `None` when it is
    /// not being captured, or the backend cannot tell (the default: its captures are then
    /// refused, as without a graph pool). Counted as `StreamIsCapturing`.
    fn capture_id(&self, stream: StreamHandle) -> DriverResult<Option<u64>> {
        let _ = stream;
        Ok(None)
    }
}

forward_calls! {
    Capture {
        fn is_capturing(&self, stream: StreamHandle) -> DriverResult<bool>
            => counted(StreamIsCapturing);
        fn capture_id(&self, stream: StreamHandle) -> DriverResult<Option<u64>>
            => counted(StreamIsCapturing);
    }
}

/// Sharing chunks with other processes.
pub trait Ipc {
    /// Exports chunk `handle` (of `size` bytes) for another process. The chunk's memory then
    /// lives until this process releases the chunk and every importer has released its own
    /// handle, whichever comes last. Fails with `NOT_SUPPORTED` when the chunk was created
    /// without a shareable handle type ([`Ipc::shareable`]).
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

forward_calls! {
    Ipc {
        fn export_chunk(&self, handle: ChunkHandle, size: usize) -> DriverResult<SharedChunk>
            => counted(Export);
        fn import_chunk(&self, chunk: &SharedChunk) -> DriverResult<ChunkHandle>
            => counted(Import);
        fn shareable(&self) -> bool;
    }
}

/// Synchronous copies between host bytes and accessible device memory: for tests and tools, and
/// for filling small tables once (the paged pool's); never on an allocation's path.
pub trait Copies {
    /// Copies host bytes to accessible device memory.
    fn write(&self, dst: DevicePtr, src: &[u8]) -> DriverResult<()>;
    /// Copies accessible device memory to host bytes.
    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> DriverResult<()>;
}

forward_calls! {
    Copies {
        fn write(&self, dst: DevicePtr, src: &[u8]) -> DriverResult<()> => counted(Copy);
        fn read(&self, src: DevicePtr, dst: &mut [u8]) -> DriverResult<()> => counted(Copy);
    }
}

/// Pinned host memory (`Offload::alloc_host`): `bytes` at `ptr`, until `Offload::free_host`.
#[derive(Debug)]
pub struct HostBuffer {
    pub ptr: *mut u8,
    pub bytes: usize,
}

// SAFETY: a HostBuffer is an owned allocation of plain bytes (page-locked host memory); nothing
// about it is tied to the thread that allocated it, and its users order their accesses (copies
// are synchronised by events before the buffer is reused or freed).
unsafe impl Send for HostBuffer {}

/// Copies of device memory to pinned host memory and back, queued on a stream: what a tag's
/// sleep (with a backup) and wake do with its bytes.
pub trait Offload {
    /// `bytes` of pinned (page-locked) host memory, which copies reach at link speed.
    fn alloc_host(&self, bytes: usize) -> DriverResult<HostBuffer>;
    /// Frees what [`Offload::alloc_host`] gave.
    ///
    /// # Safety
    /// `buffer` came from this driver's `alloc_host`, is freed once, and no copy queued on it
    /// is still to complete.
    unsafe fn free_host(&self, buffer: HostBuffer) -> DriverResult<()>;
    /// Queues a copy of `bytes` from device memory at `src` to host memory at `dst` on `stream`.
    ///
    /// # Safety
    /// `[dst, dst + bytes)` lies in a live [`HostBuffer`] of this driver's that nothing else
    /// touches until the copy has completed (an event recorded after it).
    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> DriverResult<()>;
    /// Queues a copy of `bytes` from host memory at `src` to device memory at `dst` on `stream`.
    ///
    /// # Safety
    /// As [`Offload::copy_to_host`]: `[src, src + bytes)` stays valid and unchanged until the
    /// copy has completed.
    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> DriverResult<()>;
}

forward_calls! {
    Offload {
        fn alloc_host(&self, bytes: usize) -> DriverResult<HostBuffer> => counted(HostAlloc);
    }
    unsafe {
        fn free_host(&self, buffer: HostBuffer) -> DriverResult<()> => counted(HostFree);
        fn copy_to_host(
            &self,
            dst: *mut u8,
            src: DevicePtr,
            bytes: usize,
            stream: StreamHandle,
        ) -> DriverResult<()> => counted(CopyAsync);
        fn copy_to_device(
            &self,
            dst: DevicePtr,
            src: *const u8,
            bytes: usize,
            stream: StreamHandle,
        ) -> DriverResult<()> => counted(CopyAsync);
    }
}

/// Every trait the allocator needs of a driver; implemented for whatever implements them all.
pub trait Driver:
    VirtualMemory + Peers + Streams + Capture + Ipc + Copies + Offload + Send + Sync + fmt::Debug
{
}

impl<T> Driver for T where
    T: VirtualMemory
        + Peers
        + Streams
        + Capture
        + Ipc
        + Copies
        + Offload
        + Send
        + Sync
        + fmt::Debug
{
}

/// A module of kernels loaded on the device (a `CUmodule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModuleHandle(pub u64);

/// A kernel of a loaded module (a `CUfunction`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelHandle(pub u64);

/// Pinned host memory that kernels read directly, at `device`.
#[derive(Debug)]
pub struct PinnedBuffer {
    /// Its host address.
    pub host: *mut u8,
    /// The address kernels read it at.
    pub device: DevicePtr,
    /// Its size in bytes.
    pub bytes: usize,
}

/// Kernels: loading modules and launching their kernels on a stream (the paged pool's tables).
///
/// A backend without kernels (the host backend) keeps the defaults: [`Kernels::runs_kernels`]
/// says no, and every call fails with `NOT_SUPPORTED`. Each call makes the device's context
/// current for itself and leaves the thread's own as it was. Kernel calls are not counted; their
/// errors carry [`CallKind::MemInfo`], the contract's kind for set-up.
pub trait Kernels {
    /// Whether this backend loads and runs kernels.
    fn runs_kernels(&self) -> bool {
        false
    }
    /// The context modules load into, as a number: drivers of one device share it, and a module
    /// loaded by one serves them all.
    fn module_context(&self) -> DriverResult<u64> {
        Err(no_kernels())
    }
    /// The device's compute capability, (major, minor).
    fn compute_capability(&self) -> DriverResult<(i32, i32)> {
        Err(no_kernels())
    }
    /// Loads a module from a PTX image (NUL-terminated) or a CUBIN, for good: modules are never
    /// unloaded, and the backend keeps the context alive for them.
    fn load_module(&self, image: &[u8]) -> DriverResult<ModuleHandle> {
        let _ = image;
        Err(no_kernels())
    }
    /// The kernel `name` (its `extern "C"` name) of a loaded module.
    fn kernel_function(&self, module: ModuleHandle, name: &str) -> DriverResult<KernelHandle> {
        let _ = (module, name);
        Err(no_kernels())
    }
    /// `bytes` of pinned host memory that kernels may read.
    fn alloc_pinned(&self, bytes: usize) -> DriverResult<PinnedBuffer> {
        let _ = bytes;
        Err(no_kernels())
    }
    /// Frees what [`Kernels::alloc_pinned`] gave.
    ///
    /// # Safety
    /// `buffer` came from this driver's `alloc_pinned`, is freed once, and no kernel reads it
    /// any more.
    unsafe fn free_pinned(&self, buffer: PinnedBuffer) -> DriverResult<()> {
        let _ = buffer;
        Err(no_kernels())
    }
    /// Launches `kernel` on `stream`: `grid` blocks of `block` threads (one dimension each),
    /// no dynamic shared memory; `params` points at each of its arguments in turn.
    ///
    /// # Safety
    /// `params` must match the kernel's parameters in number and types (the driver copies the
    /// arguments during the call), and every address among them must stay valid for the
    /// accesses the kernel makes until it completes.
    unsafe fn launch(
        &self,
        kernel: KernelHandle,
        grid: u32,
        block: u32,
        stream: StreamHandle,
        params: &mut [*mut c_void],
    ) -> DriverResult<()> {
        let _ = (kernel, grid, block, stream, params);
        Err(no_kernels())
    }
}

/// What a backend without kernels answers.
fn no_kernels() -> DriverError {
    DriverError::new(CallKind::MemInfo, code::NOT_SUPPORTED, "this backend runs no kernels")
}

forward_calls! {
    Kernels {
        fn runs_kernels(&self) -> bool;
        fn module_context(&self) -> DriverResult<u64>;
        fn compute_capability(&self) -> DriverResult<(i32, i32)>;
        fn load_module(&self, image: &[u8]) -> DriverResult<ModuleHandle>;
        fn kernel_function(&self, module: ModuleHandle, name: &str) -> DriverResult<KernelHandle>;
        fn alloc_pinned(&self, bytes: usize) -> DriverResult<PinnedBuffer>;
    }
    unsafe {
        fn free_pinned(&self, buffer: PinnedBuffer) -> DriverResult<()>;
        fn launch(
            &self,
            kernel: KernelHandle,
            grid: u32,
            block: u32,
            stream: StreamHandle,
            params: &mut [*mut c_void],
        ) -> DriverResult<()>;
    }
}
