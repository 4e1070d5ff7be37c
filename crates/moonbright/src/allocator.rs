//! The public allocator: opens a backend from [`Options`], sizes the cap and the virtual
//! reservations from device memory, starts the background worker, and hands requests to the
//! stream-ordered front end (`stream/`). Locking is described in docs/design.md.

use std::fmt;

use crate::config::{Options, Profile};
use crate::core::heap::{ChunkLimits, Heap, Limits, PolicyShares, UnmapLimits};
use crate::core::history::{HistoryEvent, SegmentInfo};
use crate::core::stats::Stats;
pub use crate::core::GrowableInfo;
use crate::driver::prelude::*;
use crate::driver::{Backend, DevicePtr, DriverError, Instrumented, StreamHandle};
use crate::error::{Error, Result};
use crate::ipc::{Export, Imports};
use crate::stream::{worker, Shared};
use std::sync::Arc;
use std::thread::JoinHandle;

mod sleep;

/// A MoonBright allocator for one device. `Send + Sync`: any thread may allocate and free, on
/// any stream.
pub struct Allocator {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    total_memory: u64,
    /// Memory other processes exported, mapped here (`import`).
    imports: Imports,
}

impl fmt::Debug for Allocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocator")
            .field("backend", &self.backend_name())
            .field("cap", &self.cap())
            .field("total_memory", &self.total_memory)
            .finish_non_exhaustive()
    }
}

impl Allocator {
    /// Opens the backend `options` name and sets up an empty allocator. Nothing is reserved or
    /// created until the first request (or until the background mapper sees demand).
    pub fn new(options: Options) -> Result<Allocator> {
        options.check()?;
        let backend = options.open_backend()?;
        Allocator::with_backend(backend, options)
    }

    /// An allocator over a backend opened by the caller.
    pub fn with_backend(backend: Backend, options: Options) -> Result<Allocator> {
        options.check()?;
        let driver = Instrumented::new(backend);
        let page = driver.granularity() as u64;
        let info = driver.mem_info()?;
        let device_cap = (info.total as f64 * options.cap_fraction) as u64 / page * page;
        let cap = match options.cap_bytes {
            Some(c) => c.min(info.total) / page * page,
            None => device_cap,
        };
        if cap < page {
            return Err(Error::InvalidOption {
                name: "cap",
                reason: format!("{cap} bytes is less than one page of {page} bytes"),
            });
        }
        let max_chunk_pages = (options.max_chunk_bytes / page).max(1);
        let repeated_chunk_pages = match options.max_chunk_repeated_bytes {
            0 => max_chunk_pages,
            b => (b / page).clamp(1, max_chunk_pages),
        };
        let large_chunk_pages = (options.large_chunk_bytes / page).max(max_chunk_pages);
        let largest_chunk_pages = (options.largest_chunk_bytes / page).max(large_chunk_pages);
        let total_pages = info.total.div_ceil(page);
        let lim = Limits {
            page,
            cap,
            chunks: ChunkLimits {
                max_pages: max_chunk_pages,
                repeated_pages: repeated_chunk_pages,
                large_pages: large_chunk_pages,
                largest_pages: largest_chunk_pages,
            },
            reserve_bytes: total_pages * page * options.va_reserve_factor,
            va_limit: total_pages * page * options.va_limit_factor,
            unmap: UnmapLimits {
                batch_ranges: options.unmap_batch_ranges,
                batch_bytes: options.unmap_batch_bytes,
                run_handles: options.unmap_run_handles,
                batch_age: std::time::Duration::from_micros(options.unmap_batch_age_us),
            },
            window_slab_pages: (options.prefetch_window_max / page).max(512),
            reuse_addresses: options.reuse_addresses,
            shares: PolicyShares {
                near_fit_per_1024: per_1024(options.near_fit),
                carve_per_1024: per_1024(options.carve),
                carve_repeated_per_1024: per_1024(options.carve_repeated),
                grow_first_per_1024: per_1024(options.grow_first),
            },
            defer_free_events: options.deferred_free_events,
            own_frees_before_new: options.profile == Profile::Memory,
        };
        let background = options.background;
        let shared = Arc::new(Shared::new(driver, Heap::new(lim), options));
        let worker = if background {
            let s = shared.clone();
            let handle = std::thread::Builder::new()
                .name("moonbright-worker".into())
                .spawn(move || worker::run(s))
                .map_err(|e| {
                    Error::NoBackend(format!("cannot start the background worker: {e}"))
                })?;
            Some(handle)
        } else {
            None
        };
        Ok(Allocator { shared, worker, total_memory: info.total, imports: Imports::default() })
    }

    /// The state shared with the worker, for the loom models.
    #[cfg(all(test, loom))]
    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// Allocates `size` bytes, aligned to at least 256 bytes (to the page from a page up), as
    /// `cudaMalloc` does: memory that no stream's queued work still uses (never a free still
    /// pending on a stream, the null stream's included), for the caller to order its use; see
    /// `malloc_async` for stream order.
    pub fn malloc(&self, size: usize) -> Result<DevicePtr> {
        self.shared.malloc(size as u64, None)
    }

    /// Allocates `size` bytes that no stream's queued work may still use: for a caller that keeps
    /// them for a CUDA graph itself while a capture is in progress (PyTorch's caching allocator
    /// asking for a segment of its graph-private pool, in `moonbright.torch.pool()` mode). Unlike
    /// `malloc`, it never takes memory pending on the null stream, whose work the graph's
    /// replays are not ordered after. Free it with `free_async` once no graph uses it.
    pub fn malloc_for_graph(&self, size: usize) -> Result<DevicePtr> {
        self.shared.malloc_for_graph(size as u64)
    }

    /// Frees an allocation at once. The caller guarantees no device work still uses it (as after
    /// a stream synchronisation); `free_async` lifts that.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        self.shared.free(ptr)
    }

    /// Allocates `size` bytes for use on `stream`, as `cudaMallocAsync`: the memory may come from
    /// frees on `stream` still queued there (stream order makes that safe), or from frees on
    /// other streams that have completed. Refused while `stream` is being captured into a graph.
    pub fn malloc_async(&self, size: usize, stream: StreamHandle) -> Result<DevicePtr> {
        self.shared.malloc(size as u64, Some(stream))
    }

    /// Frees an allocation in `stream`'s order, as `cudaFreeAsync`: work queued on `stream`
    /// before this call may still use it; later work on `stream` may reuse it at once, other
    /// streams once an event recorded here has completed. Never waits for the device.
    pub fn free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        self.shared.free_async(ptr, stream)
    }

    /// Notes that work queued on `stream` uses the allocation at `ptr`, which was made for (and
    /// will be freed on) another stream: PyTorch's `Tensor.record_stream`. Its `free_async`
    /// then waits for `stream` too. It records an event on `stream` as well as on the freeing
    /// stream, and no stream, the freeing one included, reuses the memory until both events
    /// have completed. No driver call here. `stream` must still exist when the allocation is
    /// freed. A synchronous `free` ignores these uses: its caller vouches that the device is
    /// done. Growable allocations are refused (`Error::GrowableStreamUse`), and so are pointers
    /// that are not the start of a live allocation; either way nothing changes.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        self.shared.record_stream(ptr, stream)
    }

    /// Reserves `capacity` bytes of addresses (rounded up to pages) for a *growable*
    /// allocation and returns its address, which never changes. It holds no physical memory
    /// until resized: [`resize_async`](Self::resize_async) commits pages at its end, in place,
    /// from the same pool as every other allocation. `free`/`free_async` release it.
    pub fn reserve_growable(&self, capacity: usize) -> Result<DevicePtr> {
        self.shared.reserve_growable(capacity as u64)
    }

    /// Resizes a growable allocation to `len` bytes in `stream`'s order, in place: growing
    /// maps pages at its end (none if the committed pages already cover `len`), shrinking gives
    /// back the whole chunks beyond `len`, reusable by other streams once `stream`'s work
    /// queued before this call has completed. Nothing is copied, ever. Bad input (beyond the
    /// capacity, a pointer that is not a live growable allocation) changes nothing.
    pub fn resize_async(&self, ptr: DevicePtr, len: usize, stream: StreamHandle) -> Result<()> {
        self.shared.resize(ptr, len as u64, Some(stream))
    }

    /// `resize_async` for a caller that orders device work itself: what a shrink gives back is
    /// reusable at once.
    pub fn resize(&self, ptr: DevicePtr, len: usize) -> Result<()> {
        self.shared.resize(ptr, len as u64, None)
    }

    /// The sizes of a live growable allocation, or `None`.
    pub fn growable_info(&self, ptr: DevicePtr) -> Option<GrowableInfo> {
        self.shared.heap().growable_info(ptr)
    }

    /// The usable size of a live allocation (its size rounded up), or `None`.
    pub fn usable_size(&self, ptr: DevicePtr) -> Option<usize> {
        self.shared.heap().usable_size(ptr).map(|s| s as usize)
    }

    /// Exports the live allocation (or growable) at `ptr` for another process: the chunks that
    /// back it, each as a file descriptor, to send with [`Export::send`] over a Unix socket.
    /// The allocation must stay live until every importer has closed it, as with
    /// `cudaIpcGetMemHandle`. Only the chunks the allocation's bytes lie in are shared, and
    /// they are never reused here: once the allocation is freed (and unmapped) they go back to
    /// the driver. A block carved from an arena (below a page, or cut from cached chunks under
    /// option `carve`) shares its chunks with other allocations, and a graph pool's block is
    /// reused by the pool once freed: both are refused (`Error::Ipc`; docs/security.md). The
    /// chunks are marked before the driver exports them, so a failed export still sends them
    /// back to the driver when freed (a little memory, never safety). Needs option `ipc` (on by
    /// default) and a driver that gives POSIX file descriptor handles.
    pub fn export(&self, ptr: DevicePtr) -> Result<Export> {
        let driver = self.driver();
        if !self.options().ipc || !driver.shareable() {
            return Err(Error::Ipc(format!(
                "this allocator's chunks cannot be exported: option `ipc` is off, or the {} \
                 driver refused to create chunks with POSIX file descriptor handles",
                driver.name()
            )));
        }
        if self.shared.graph_pool_owns(ptr) {
            return Err(Error::Ipc(format!(
                "{ptr:#x} belongs to a CUDA graph's private pool, which hands its memory to the \
                 pool's next allocations once it is freed: an importer would reach them, so it \
                 is not exported"
            )));
        }
        let shared = self.shared.heap().shared_chunks(ptr, true)?;
        // The driver calls run without the heap lock; the allocation must be unchanged after.
        let chunks = shared
            .chunks
            .iter()
            .map(|&(handle, bytes)| driver.export_chunk(handle, bytes as usize))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        // Checked without marking: another allocation at `ptr` by now is not being exported.
        if self.shared.heap().shared_chunks(ptr, false).as_ref() != Ok(&shared) {
            return Err(Error::Ipc(format!("{ptr:#x} was freed while it was being exported")));
        }
        let device = self.device().unwrap_or(0);
        Ok(Export::new(driver.name(), device, shared.size, shared.offset, chunks))
    }

    /// Maps memory another process exported ([`Export::recv`]) on this allocator's device, at
    /// addresses of its own, and returns its address (`export.size()` bytes). The memory is
    /// not this allocator's: it is not counted, and [`Allocator::close_import`] gives it back.
    /// A failure leaves nothing mapped.
    pub fn import(&self, export: &Export) -> Result<DevicePtr> {
        self.imports.import(self.driver(), export)
    }

    /// Unmaps an import. The unmap is immediate: work that uses the memory must have completed.
    pub fn close_import(&self, ptr: DevicePtr) -> Result<()> {
        self.imports.close(self.driver(), ptr)
    }

    /// The imports held, as (address, size).
    pub fn imports(&self) -> Vec<(DevicePtr, u64)> {
        self.imports.list()
    }

    /// Unmaps every retired range now rather than at the next batch.
    pub fn flush(&self) -> Result<()> {
        self.shared.flush().map(|_| ())
    }

    /// Checks the events of stream frees now (the background worker does this on its own) and
    /// makes what completed reusable by every stream. Returns whether anything completed.
    pub fn poll(&self) -> bool {
        self.shared.record_missing_events();
        self.shared.poll_events()
    }

    /// Gives every physical page no allocation uses back to the driver, without waiting: the
    /// memory of frees whose stream work may still be running stays held (`empty_cache` waits
    /// for it). Returns the bytes released.
    pub fn release_unused(&self) -> Result<u64> {
        self.shared.release_unused()
    }

    /// Waits on this thread for the stream work of every pending free, then gives every
    /// physical page no allocation uses back to the driver: what `torch.cuda.empty_cache` does
    /// under PyTorch's own allocator, whose `cudaFree` waits for the device. Only the caller
    /// waits, never a kernel. Stays held: graph pools' blocks, and frees whose events cannot be
    /// recorded yet (option `deferred_free_events` while an announced capture runs). A failed
    /// wait is reported after the release, which still gives back what is free. Returns the
    /// bytes released.
    pub fn empty_cache(&self) -> Result<u64> {
        self.shared.empty_cache()
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> Stats {
        let mut heap = self.shared.heap();
        heap.settle_held_at_peak();
        let mut s = heap.stats().clone();
        s.events_stocked = heap.events_stocked() as u64;
        let base = *heap.calls_at_reset();
        drop(heap);
        s.driver_calls = self.shared.driver.counts().since(&base);
        s
    }

    /// Starts recording up to `max_events` allocation events (the oldest dropped first), or stops
    /// recording with `None`; for snapshots PyTorch's memory viewer opens.
    pub fn record_history(&self, max_events: Option<usize>) {
        self.shared.heap().set_history(max_events);
    }

    /// The events recorded since `record_history` was switched on.
    pub fn history(&self) -> Vec<HistoryEvent> {
        self.shared.heap().history()
    }

    /// Every mapped range and its blocks, in address order.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.shared.heap().segments()
    }

    /// Resets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        self.shared.heap().reset_peaks();
    }

    /// Zeroes every cumulative figure, as PyTorch's `reset_accumulated_memory_stats`: each
    /// statistic's `allocated` and `freed` totals, the counters (cache hits, out-of-memory
    /// refusals, waits for pending frees, ...) and the driver call counts, which count from
    /// here. Current values and peaks stay.
    pub fn reset_accumulated_stats(&self) {
        let mut heap = self.shared.heap();
        heap.reset_accumulated(self.shared.driver.counts());
    }

    /// The last driver error met outside a request (a deferred unmap that will be retried, an
    /// event that could not be recorded), if any.
    pub fn take_deferred_error(&self) -> Option<DriverError> {
        self.shared.heap().take_deferred_error()
    }

    /// Checks every invariant of the allocator's state.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.shared.heap().check()
    }

    /// Sets the cap on physical bytes held to `bytes`, rounded down to a page and limited to the
    /// device's memory (what `torch.cuda.set_per_process_memory_fraction` asks of PyTorch's
    /// allocator). Returns the cap set. Lowering it below what is held releases every page no
    /// allocation uses (as `release_unused`; if that fails, the cap is set and the error
    /// returned). Past that, live allocations keep their memory, and what is held serves
    /// requests but does not grow until it is back under the cap. A cap below one page is 0:
    /// every request fails until it is raised (PyTorch's memory fraction 0).
    pub fn set_cap(&self, bytes: u64) -> Result<u64> {
        let page = self.page_size() as u64;
        let cap = bytes.min(self.total_memory) / page * page;
        let over = {
            let mut heap = self.shared.heap();
            heap.set_cap(cap);
            heap.stats().reserved_bytes.current > cap
        };
        if over {
            self.release_unused()?;
        }
        Ok(cap)
    }

    /// Makes the capture in progress on `stream` (begun with `cuStreamBeginCapture`, or
    /// PyTorch's `CUDAGraph.capture_begin`) allocate into graph pool `pool`, as PyTorch's
    /// `beginAllocateToPool`. Until [`end_graph_capture`](Self::end_graph_capture):
    /// - `malloc_async` on a stream of that capture (`stream`, or one it forked) serves the
    ///   request from the pool: a block it holds free that this capture may reuse, or new memory
    ///   from the heap, with no driver call that would join the graph. The address is baked into
    ///   the graph, so the block stays the pool's: its free (during the capture or after) gives
    ///   it back to the pool, never to other allocations.
    /// - A block freed during the capture is reused in it only by requests on the stream that
    ///   freed it (where the graph orders them after the free); after the capture, by any later
    ///   capture into the pool. Captures sharing a pool must not replay concurrently, as with
    ///   PyTorch's shared pools.
    /// - `free_async` of other memory on a stream of the capture is done when the capture ends
    ///   (no event can be recorded on a capturing stream).
    ///
    /// A capture not begun into a pool is refused as before (`Error::StreamCapture`). Refused
    /// with `Error::GraphPool` if `stream` is not being captured, or its capture was begun
    /// already.
    pub fn begin_graph_capture(&self, stream: StreamHandle, pool: (u64, u64)) -> Result<()> {
        self.shared.begin_graph_capture(stream, pool)
    }

    /// Ends the capture begun on `stream` by [`begin_graph_capture`](Self::begin_graph_capture),
    /// after the driver has ended it (`cuStreamEndCapture`): its pool's blocks freed during it
    /// become reusable by later captures into the pool, and the frees it deferred are done.
    pub fn end_graph_capture(&self, stream: StreamHandle) -> Result<()> {
        self.shared.end_graph_capture(stream)
    }

    /// Notes that a graph of `pool` was launched on `stream` (`cuGraphLaunch`): when the pool is
    /// released, its memory is reused by nothing before the work queued there has completed.
    /// Call it for every stream a graph of the pool is launched on (once a stream is enough).
    pub fn graph_replayed(&self, pool: (u64, u64), stream: StreamHandle) {
        self.shared.graph_replayed(pool, stream)
    }

    /// One graph of `pool` is destroyed (PyTorch's `releasePool`). When no graph of the pool is
    /// left, its free blocks go back to the heap, each ordered after the streams the graphs were
    /// launched on; blocks still live go back as they are freed. A block whose handback would
    /// record an event on a stream being captured waits for a later capture end, release or
    /// `release_unused`.
    pub fn release_graph_pool(&self, pool: (u64, u64)) -> Result<()> {
        self.shared.release_graph_pool(pool)
    }

    /// Routes the calling thread's requests into graph pool `pool` outside any capture, as
    /// PyTorch's `beginAllocateCurrentThreadToPool` (CUDA-graph trees' warm-up runs, whose
    /// outputs later graphs must see as taken). Until
    /// [`end_allocate_to_pool`](Self::end_allocate_to_pool), `malloc_async` and `malloc` on this
    /// thread (on any stream not being captured) take a block the pool holds free, or new memory
    /// no stream's queued work uses, and the block stays the pool's as a captured one does.
    /// A block freed during the route is reused by it only on the stream that freed it. Blocks
    /// freed before the route began are reused on any stream: the caller orders the route after
    /// the work that used them, replays of the pool's graphs included, as PyTorch's trees do
    /// (they synchronise the device first). The route counts as one more graph of the pool:
    /// release it with [`release_graph_pool`](Self::release_graph_pool) after ending it. A
    /// thread routed already is refused (`Error::GraphPool`).
    pub fn begin_allocate_to_pool(&self, pool: (u64, u64)) -> Result<()> {
        self.shared.begin_allocate_to_pool(pool)
    }

    /// Ends the calling thread's route (PyTorch's `endAllocateToPool`) and returns its pool;
    /// `Error::GraphPool` if it had none.
    pub fn end_allocate_to_pool(&self) -> Result<(u64, u64)> {
        self.shared.end_allocate_to_pool()
    }

    /// The live blocks of graph pool `pool` (handed out, not freed back), as (pointer, usable
    /// bytes) in address order: PyTorch's checkpointed pool state, and what its
    /// `checkPoolLiveAllocations` compares with the tensors it knows. Empty for an unknown pool.
    pub fn graph_pool_live(&self, pool: (u64, u64)) -> Vec<(u64, u64)> {
        self.shared.graph_pool_live(pool)
    }

    /// Makes `keep` the live set of graph pool `pool`, as PyTorch's `setCheckpointPoolState`
    /// sets back a state [`graph_pool_live`](Self::graph_pool_live) read: blocks in `keep` that
    /// the pool holds free count as allocated again at the same addresses (a graph replayed
    /// since writes there), and live blocks not in `keep` go back to the pool as freed on
    /// `stream`. Returns (revived, freed), each in address order. A revived block is freed as
    /// any other, once. Refused with nothing changed (`Error::GraphPool`) while a capture into
    /// the pool is in progress, for a pool with no graph, or for a pointer of `keep` that is
    /// not a block of the pool.
    pub fn set_graph_pool_live(
        &self,
        pool: (u64, u64),
        keep: &[DevicePtr],
        stream: StreamHandle,
    ) -> Result<(Vec<DevicePtr>, Vec<DevicePtr>)> {
        self.shared.set_graph_pool_live(pool, keep, stream)
    }

    /// Blocks and bytes graph pools hold free for their graphs (counted as reserved, not as
    /// allocated, in [`stats`](Self::stats), as PyTorch counts its graph pools' free blocks).
    pub fn graph_pool_free(&self) -> (usize, u64) {
        self.shared.graph_pool_free()
    }

    /// Announces that a CUDA graph capture is about to begin on one of this device's streams
    /// (call it before `cuStreamBeginCapture`). With [`Options::captures_announced`], streams
    /// are checked for a capture only from here to the matching
    /// [`capture_finished`](Self::capture_finished); without it, this only counts.
    pub fn capture_starting(&self) {
        self.shared.capture_starting()
    }

    /// Announces that a capture announced with [`capture_starting`](Self::capture_starting) has
    /// ended (after `cuStreamEndCapture`), or failed to begin. Calls beyond the announced ones
    /// are ignored.
    pub fn capture_finished(&self) {
        self.shared.capture_finished()
    }

    /// Grants device `peer` access to this allocator's memory, mapped now and later, so that
    /// kernels and copies on `peer` reach it directly (what `cudaDeviceEnablePeerAccess` does for
    /// `cudaMalloc` memory, and does not do for virtual-memory mappings). Each mapping's set
    /// access then names the peer too. Enabling a peer twice, or a CUDA allocator's own device,
    /// does nothing (the host backend models devices 0..8, is device 0, and refuses 0 as a
    /// peer). A device that cannot reach this one peer to peer is refused
    /// ([`CallKind::PeerAccess`](crate::CallKind::PeerAccess)), and so is any failure, with no
    /// peer added; allocations keep working. Requests that must map wait while it runs.
    /// Imports ([`Allocator::import`]) are granted too.
    pub fn enable_peer_access(&self, peer: i32) -> Result<()> {
        if self.device() == Some(peer) {
            return Ok(());
        }
        self.shared.enable_peer_access(peer, |driver| self.imports.grant(driver))
    }

    /// The devices granted access by [`Allocator::enable_peer_access`].
    pub fn peers(&self) -> Vec<i32> {
        self.shared.peers()
    }

    /// The CUDA device this allocator serves (`None` on the host backend).
    pub fn device(&self) -> Option<i32> {
        match self.shared.driver.inner() {
            Backend::Cuda(d) => Some(d.device()),
            Backend::Host(_) => None,
        }
    }

    /// The cap on physical bytes held.
    pub fn cap(&self) -> u64 {
        self.shared.heap().limits().cap
    }

    /// `"cuda"` or `"host"`.
    pub fn backend_name(&self) -> &'static str {
        self.shared.driver.name()
    }

    /// The page size (mapping granularity) in bytes.
    pub fn page_size(&self) -> usize {
        self.shared.driver.granularity()
    }

    /// Total device memory as the backend reports it.
    pub fn total_memory(&self) -> u64 {
        self.total_memory
    }

    /// The options this allocator was made with.
    pub fn options(&self) -> &Options {
        &self.shared.options
    }

    /// The backend, wrapped with call counters and fault injection.
    pub fn driver(&self) -> &Instrumented<Backend> {
        &self.shared.driver
    }

    /// Copies bytes into device memory (synchronous; for tests and tools).
    pub fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        Ok(self.shared.driver.write(dst, src)?)
    }

    /// Copies device memory into host bytes (synchronous; for tests and tools).
    pub fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        Ok(self.shared.driver.read(src, dst)?)
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        self.imports.close_all(self.driver());
        self.shared.stop.store(true, std::sync::atomic::Ordering::Release);
        self.shared.wake_worker_always();
        if let Some(w) = self.worker.take() {
            if w.join().is_err() {
                eprintln!("moonbright: the background worker panicked");
            }
        }
        self.shared.teardown();
    }
}

/// A fraction as `Limits` keeps it: in 1,024ths, rounded.
fn per_1024(fraction: f64) -> u64 {
    (fraction * 1024.0).round() as u64
}

// Not under Miri: the host backend's memfd and mmap calls are outside what Miri interprets.
#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;
    use crate::stream::Raised;
    use crate::sync::atomic::Ordering;
    use crate::CallKind;

    /// Resetting accumulated statistics zeroes the totals, the counters and the driver call
    /// counts, keeps current values and peaks, and counts on from there.
    #[test]
    fn reset_accumulated_stats_zeroes_totals_and_keeps_current_and_peak() {
        let a = Allocator::new(Options::host(64 << 20, 64 << 10)).unwrap();
        let p = a.malloc(3 << 20).unwrap();
        let q = a.malloc(1 << 20).unwrap();
        a.free(q).unwrap();
        assert!(matches!(a.malloc(a.cap() as usize), Err(Error::OutOfMemory { .. })));
        let before = a.stats();
        assert!(before.num_ooms > 0 && before.driver_calls.get(CallKind::Map) > 0);
        a.reset_accumulated_stats();
        let s = a.stats();
        assert_eq!(s.allocated_bytes.current, 3 << 20);
        assert_eq!(s.allocated_bytes.peak, before.allocated_bytes.peak);
        assert_eq!(s.reserved_bytes.current, before.reserved_bytes.current);
        assert_eq!((s.allocated_bytes.allocated, s.allocated_bytes.freed), (0, 0));
        assert_eq!((s.allocations.allocated, s.allocations.freed), (0, 0));
        assert_eq!((s.num_ooms, s.driver_calls.total()), (0, 0));
        a.free(p).unwrap();
        let s = a.stats();
        assert_eq!((s.allocated_bytes.allocated, s.allocated_bytes.freed), (0, 3 << 20));
        assert_eq!(s.allocations.freed, 1);
        a.release_unused().unwrap();
        let calls = a.stats().driver_calls;
        assert!(calls.get(CallKind::Release) > 0, "calls after the reset count from zero");
        assert_eq!(
            calls.get(CallKind::Release),
            a.shared.driver.counts().get(CallKind::Release)
                - before.driver_calls.get(CallKind::Release)
        );
    }

    /// The worker's event stock (driven here by hand: no worker) tops up to its target once it is
    /// down to half, a failed creation ends a top-up without reporting anything, a free takes a
    /// stocked event instead of creating one, and teardown destroys every event, stocked or not.
    #[test]
    fn the_event_stock_tops_up_by_halves_and_shrugs_off_failures() {
        let a = Allocator::new(Options::host(64 << 20, 64 << 10)).unwrap();
        let created = || a.stats().driver_calls.get(CallKind::EventCreate);
        a.driver().fail_nth(CallKind::EventCreate, 10, None);
        a.shared.stock_events(32);
        assert_eq!(a.stats().events_stocked, 9, "the tenth creation failed and ended the top-up");
        assert!(a.take_deferred_error().is_none(), "a stock failure is not the user's error");
        a.shared.stock_events(32);
        assert_eq!(a.stats().events_stocked, 32);
        let before = created();
        a.shared.stock_events(32);
        assert_eq!(created(), before, "a stock above half its target is left alone");
        let s = a.driver().create_stream().unwrap();
        let p = a.malloc_async(1000, s).unwrap();
        a.free_async(p, s).unwrap();
        assert_eq!(created(), before, "the free created an event");
        assert_eq!(a.stats().events_stocked, 31);
        a.check_invariants().unwrap();
        a.shared.teardown();
        let calls = a.stats().driver_calls;
        // Every event made is destroyed: all creations but the one that failed.
        assert_eq!(calls.get(CallKind::EventDestroy), calls.get(CallKind::EventCreate) - 1);
        assert_eq!(a.stats().events_stocked, 0);
    }

    /// Streams used once each hand their events back to the stock when forgotten; a stock past
    /// twice its target is trimmed back to it, the rest destroyed, and a failed destroy is
    /// reported, not fatal.
    #[test]
    fn a_stock_swollen_by_forgotten_streams_is_trimmed() {
        let a = Allocator::new(Options::host(64 << 20, 64 << 10)).unwrap();
        // 40 streams, each with a free whose event is still pending, then all complete at once:
        // each forgotten stream gives its event back.
        let host = a.driver().inner().as_host().unwrap();
        let streams: Vec<_> = (0..40).map(|_| a.driver().create_stream().unwrap()).collect();
        for &s in &streams {
            host.hold_stream(s);
            let p = a.malloc_async(1000, s).unwrap();
            a.free_async(p, s).unwrap();
        }
        streams.iter().for_each(|&s| host.release_stream(s));
        assert!(a.poll());
        assert_eq!(a.stats().events_stocked, 40);
        let destroyed = || a.stats().driver_calls.get(CallKind::EventDestroy);
        a.shared.stock_events(20);
        assert_eq!(a.stats().events_stocked, 40, "not past twice the target: kept");
        a.driver().fail_nth(CallKind::EventDestroy, 3, None);
        a.shared.stock_events(16);
        assert_eq!(a.stats().events_stocked, 16);
        assert_eq!(destroyed(), 24, "every event past the target is destroyed (one failing)");
        assert!(a.take_deferred_error().is_some(), "the failed destroy was not reported");
        a.check_invariants().unwrap();
    }

    /// While a request waits for ranges the worker's unmap batch holds (`requests_flushing`),
    /// the batch stops before each next call and commits what it has unmapped, so the request
    /// sees each unmap at once, then goes on with the rest; without a waiter it is one batch.
    /// A flush of the user's or a request's own never stops early.
    #[test]
    fn the_workers_unmap_batch_commits_call_by_call_while_a_request_waits() {
        let page = 64 << 10;
        let opts = Options { background: false, ..Options::host(64 << 20, page) };
        let a = Allocator::new(opts).unwrap();
        // `n` one-page ranges freed between live ones, then stolen by a larger request: `n`
        // retired ranges, apart, each its own unmap call.
        let retire = |n: usize| {
            let r: Vec<_> = (0..2 * n).map(|_| a.malloc(page).unwrap()).collect();
            for p in r.iter().step_by(2) {
                a.free(*p).unwrap();
            }
            let big = a.malloc((n + 1) * page).unwrap();
            assert_eq!(a.stats().retired_ranges.current, n as u64);
            r.into_iter().skip(1).step_by(2).chain([big]).collect::<Vec<_>>()
        };
        let batches = || a.stats().unmap_batches;
        let live = retire(3);
        let waiting = Raised::new(&a.shared.requests_flushing);
        let before = batches();
        assert!(a.shared.flush_in_background().unwrap());
        assert_eq!(batches() - before, 3, "it did not commit after each call");
        assert_eq!(a.stats().retired_ranges.current, 0);
        a.check_invariants().unwrap();
        let live2 = retire(3);
        let before = batches();
        assert!(a.shared.flush().unwrap());
        assert_eq!((batches() - before, a.stats().retired_ranges.current), (1, 0));
        drop(waiting);
        let live3 = retire(3);
        let before = batches();
        assert!(a.shared.flush_in_background().unwrap());
        assert_eq!((batches() - before, a.stats().retired_ranges.current), (1, 0));
        for p in live.into_iter().chain(live2).chain(live3) {
            a.free(p).unwrap();
        }
        a.check_invariants().unwrap();
    }

    /// A host allocator with no worker whose chunks hold at most four 64 KiB pages, and its page.
    fn four_page_chunks() -> (Allocator, usize) {
        let page = 64 << 10;
        let opts = Options {
            background: false,
            max_chunk_bytes: 4 * page as u64,
            ..Options::host(64 << 20, page)
        };
        (Allocator::new(opts).unwrap(), page)
    }

    /// Frees the one-chunk range `p` and retires it (its chunk bare, still mapped there), then
    /// takes its unmap out as another thread's batch would; returns that batch.
    fn held_by_another_batch(a: &Allocator, p: DevicePtr) -> Vec<crate::core::vaspace::UnmapRun> {
        a.free(p).unwrap();
        a.shared.heap().retire_all_free();
        let held = a.shared.heap().take_unmap_batch(None);
        assert_eq!(held.len(), 1);
        held
    }

    /// A split whose smallest candidate chunk is still mapped by ranges another thread is
    /// unmapping takes a larger candidate whose old addresses can go now, and unmaps only those
    /// (a targeted flush) rather than wait for the other batch or unmap everything.
    #[test]
    fn a_split_passes_over_a_chunk_in_another_unmap_batch() {
        let (a, page) = four_page_chunks();
        let three = a.malloc(3 * page).unwrap();
        let four = a.malloc(4 * page).unwrap();
        let held = held_by_another_batch(&a, three);
        a.free(four).unwrap();
        a.shared.heap().retire_all_free();
        let unmaps = || a.stats().driver_calls.get(CallKind::Unmap);
        let two = a.malloc(2 * page).unwrap();
        let st = a.stats();
        assert_eq!((st.chunk_splits, st.flushes_for_split, st.targeted_flushes), (1, 1, 1));
        assert_eq!(unmaps(), 1, "it unmapped more than the four-page chunk's addresses");
        a.shared.heap().commit_unmap(held, 0, None);
        a.check_invariants().unwrap();
        assert!(a.shared.flush().unwrap());
        a.free(two).unwrap();
        a.check_invariants().unwrap();
    }

    /// A split whose only candidate chunk is still mapped by ranges another thread's batch
    /// holds waits for that batch, and says so (`requests_flushing`, which stops the worker's
    /// batches early); once the batch is put back, it unmaps that chunk's ranges itself and
    /// goes on.
    #[test]
    fn a_split_waiting_for_another_batch_asks_it_to_stop() {
        let (a, page) = four_page_chunks();
        let four = a.malloc(4 * page).unwrap();
        let held = held_by_another_batch(&a, four);
        let two = std::thread::scope(|s| {
            let request = s.spawn(|| a.malloc(2 * page));
            let start = std::time::Instant::now();
            while a.shared.requests_flushing.load(Ordering::Acquire) == 0 {
                assert!(start.elapsed().as_secs() < 5, "the request never asked the batch to stop");
                std::thread::yield_now();
            }
            // The other thread's batch stops without unmapping anything and puts its run back.
            a.shared.heap().commit_unmap(held, 0, None);
            request.join().unwrap().unwrap()
        });
        assert_eq!(a.shared.requests_flushing.load(Ordering::Acquire), 0);
        let st = a.stats();
        assert_eq!((st.chunk_splits, st.targeted_flushes), (1, 1));
        a.free(two).unwrap();
        a.check_invariants().unwrap();
    }
}
