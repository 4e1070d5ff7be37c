//! The allocator's entry points: creation and destruction, allocation and free (plain and
//! stream-ordered), graph captures and their pools, the cache, statistics and the cap.

use std::ffi::{c_char, c_int, c_void, CStr};

use moonbright::{Allocator, Options, StreamHandle};

use crate::options::to_options;
use crate::status::{allocator, call, query, status_of, write_out, Failure};
use crate::types::{mb_allocator, mb_options, mb_stats};

/// Creates an allocator with `*opts` (NULL: the defaults) and stores it in `*out`. Nothing is
/// reserved from the device until the first `mb_malloc`.
///
/// Returns `MB_ERR_INVALID_ARGUMENT` for a NULL `out` or a bad option (the last error names it),
/// `MB_ERR_NO_BACKEND` when the backend cannot be opened, `MB_ERR_DRIVER` when a driver call fails.
///
/// # Safety
/// `opts` is NULL or points to a valid `mb_options`; `out` is NULL or valid for a write of a
/// pointer.
#[no_mangle]
pub unsafe extern "C" fn mb_create(opts: *const mb_options, out: *mut *mut mb_allocator) -> c_int {
    call(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        // SAFETY: the caller passes NULL or a pointer to a valid `mb_options`; it is copied out.
        let options = match unsafe { opts.as_ref() } {
            Some(o) => to_options(o)?,
            None => Options::default(),
        };
        let inner = Allocator::new(options)?;
        let handle = Box::into_raw(Box::new(mb_allocator { inner }));
        // SAFETY: `out` is non-NULL and, by the caller's contract, valid for a write of a pointer.
        unsafe { write_out(out, "out", handle) }
    })
}

/// Creates an allocator with the options a configuration string names and stores it in `*out`:
/// `key:value` pairs separated by commas, the keys and syntax of `MOONBRIGHT_ALLOC_CONF`
/// (`"backend:host,cap:12GiB,unmap_batch:32"`), over the defaults. NULL or "" gives the
/// defaults. Every option MoonBright has is reachable this way, including those added after
/// `mb_options` was laid out, so a program compiled against this header keeps working as
/// options are added. The environment variable itself is not read.
///
/// Returns `MB_ERR_INVALID_ARGUMENT` for a NULL `out`, a string that is not UTF-8, an unknown
/// key, an item that is not `key:value` or a bad value (the last error names the key and what
/// it allows); `MB_ERR_NO_BACKEND` and `MB_ERR_DRIVER` as `mb_create`. `*out` is untouched on
/// failure.
///
/// # Safety
/// `conf` is NULL or a NUL-terminated string; `out` is NULL or valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn mb_create_conf(conf: *const c_char, out: *mut *mut mb_allocator) -> c_int {
    call(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let options = if conf.is_null() {
            Options::default()
        } else {
            // SAFETY: a non-NULL `conf` is, by the caller's contract, a NUL-terminated string,
            // read here only.
            let text = unsafe { CStr::from_ptr(conf) }.to_str().map_err(|e| {
                Failure::invalid(format!("invalid argument: `conf` is not UTF-8 ({e})"))
            })?;
            options_from_conf(text)?
        };
        let inner = Allocator::new(options)?;
        let handle = Box::into_raw(Box::new(mb_allocator { inner }));
        // SAFETY: `out` is non-NULL and, by the caller's contract, valid for a write of a pointer.
        unsafe { write_out(out, "out", handle) }
    })
}

/// The options a configuration string gives, through the one validation path there is
/// (`moonbright::conf`), its errors prefixed so that a C caller sees where they came from.
fn options_from_conf(text: &str) -> Result<Options, Failure> {
    moonbright::conf::parse_conf(text).map_err(|e| Failure {
        status: status_of(&e),
        message: format!("mb_create_conf(\"{}\"): {e}", text.escape_debug()),
    })
}

/// Destroys an allocator, giving all its memory back to the driver. Allocations still live are
/// freed with it (a count of them is printed to stderr). NULL is accepted and does nothing. No
/// other call may use the handle during or after this one.
///
/// # Safety
/// `alloc` is NULL or a handle from `mb_create` not yet destroyed, which no other call uses now
/// or later.
#[no_mangle]
pub unsafe extern "C" fn mb_destroy(alloc: *mut mb_allocator) -> c_int {
    call(|| {
        if !alloc.is_null() {
            // SAFETY: a non-NULL `alloc` is, by the caller's contract, a handle from `mb_create`
            // (a leaked `Box<mb_allocator>`) that no other call uses now or later.
            drop(unsafe { Box::from_raw(alloc) });
        }
        Ok(())
    })
}

/// Allocates `size` bytes of device memory and stores its device address in `*out_ptr`. The
/// address is aligned to at least 256 bytes, and to the page from a page up.
///
/// Returns `MB_ERR_INVALID_ARGUMENT` for NULL arguments or a size of 0, `MB_ERR_TOO_LARGE` for a
/// size over the cap, `MB_ERR_OUT_OF_MEMORY` when not enough memory is free, `MB_ERR_DRIVER` when
/// a driver call fails.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_ptr` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_malloc(
    alloc: *mut mb_allocator,
    size: usize,
    out_ptr: *mut u64,
) -> c_int {
    // SAFETY: passed on from the caller's contract above.
    unsafe { query(alloc, out_ptr, "out_ptr", |a| Ok(a.malloc(size)?)) }
}

/// Allocates `size` bytes for use on `stream` (a `CUstream`, NULL for the default stream), as
/// `cudaMallocAsync`: the memory may come from frees queued on `stream`, or from frees on other
/// streams that have completed. No driver call on the common path.
///
/// Returns what `mb_malloc` returns, and `MB_ERR_STREAM_CAPTURE` while `stream` is being captured
/// into a CUDA graph.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_ptr` is NULL or valid for a write;
/// `stream` is NULL or a live stream of the allocator's device.
#[no_mangle]
pub unsafe extern "C" fn mb_malloc_async(
    alloc: *mut mb_allocator,
    size: usize,
    stream: *mut c_void,
    out_ptr: *mut u64,
) -> c_int {
    // SAFETY: passed on from the caller's contract above.
    unsafe {
        query(alloc, out_ptr, "out_ptr", |a| Ok(a.malloc_async(size, StreamHandle(stream as u64))?))
    }
}

/// Frees an allocation in `stream`'s order, as `cudaFreeAsync`: work queued on `stream` before
/// this call may still use it; later work on `stream` may reuse it at once, other streams once an
/// event recorded here has completed. Never waits for the device.
///
/// Returns what `mb_free` returns, and `MB_ERR_STREAM_CAPTURE` while `stream` is being captured.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `stream` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn mb_free_async(
    alloc: *mut mb_allocator,
    ptr: u64,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        a.free_async(ptr, StreamHandle(stream as u64))?;
        Ok(())
    })
}

/// Notes that work queued on `stream` (a `CUstream`, NULL for the default stream) uses the
/// allocation at `ptr`, made for another stream: PyTorch's `Tensor.record_stream`. Its
/// `mb_free_async` then also records an event on `stream`, and no stream (the freeing one
/// included) reuses the memory until every such event has completed. No driver call here;
/// `stream` must still exist when the allocation is freed. `mb_free` ignores these uses.
///
/// Returns `MB_ERR_INVALID_POINTER` for a pointer that is not the start of a live allocation,
/// `MB_ERR_INVALID_ARGUMENT` for a NULL `alloc` or a growable allocation; nothing changes then.
/// The `mb_free_async` that follows returns `MB_ERR_STREAM_CAPTURE`, and frees nothing, while
/// `stream` is being captured into a CUDA graph.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_record_stream(
    alloc: *mut mb_allocator,
    ptr: u64,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        a.record_stream(ptr, StreamHandle(stream as u64))?;
        Ok(())
    })
}

/// Makes the capture in progress on `stream` (begun with `cuStreamBeginCapture`) allocate into
/// the graph pool `(pool_hi, pool_lo)`, a pair the caller picks: until
/// `mb_end_graph_capture(stream)`, `mb_malloc_async` on a stream of that capture serves the
/// request from the pool, and the memory stays the pool's (its frees give it back to the pool)
/// until `mb_release_graph_pool` is called once for each capture begun into the pool. A block
/// freed during the capture is reused in it only on the stream that freed it; after it, by
/// later captures into the pool, whose graphs must then not run concurrently with this one's.
/// `mb_free_async` of other memory on a stream of the capture is done at its end.
///
/// Returns `MB_ERR_STREAM_CAPTURE` if `stream` is not being captured or its capture was begun
/// already, `MB_ERR_DRIVER` if the capture query fails; nothing changes then.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_begin_graph_capture(
    alloc: *mut mb_allocator,
    stream: *mut c_void,
    pool_hi: u64,
    pool_lo: u64,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        Ok(a.begin_graph_capture(StreamHandle(stream as u64), (pool_hi, pool_lo))?)
    })
}

/// Announces that a CUDA graph capture is about to begin on one of the allocator's device's
/// streams (call it before `cuStreamBeginCapture`). With option `captures_announced:true`,
/// streams are checked for a capture (`cuStreamIsCapturing`) only between this and the matching
/// `mb_capture_finished`. Returns `MB_ERR_INVALID_ARGUMENT` for a NULL handle.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_capture_starting(alloc: *mut mb_allocator) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        unsafe { allocator(alloc) }?.capture_starting();
        Ok(())
    })
}

/// Announces that a capture announced with `mb_capture_starting` has ended (after
/// `cuStreamEndCapture`) or failed to begin. Extra calls are ignored. Returns
/// `MB_ERR_INVALID_ARGUMENT` for a NULL handle.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_capture_finished(alloc: *mut mb_allocator) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        unsafe { allocator(alloc) }?.capture_finished();
        Ok(())
    })
}

/// Ends the capture begun on `stream` by `mb_begin_graph_capture`, after `cuStreamEndCapture`.
/// Returns `MB_ERR_STREAM_CAPTURE` if none was begun there.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_end_graph_capture(
    alloc: *mut mb_allocator,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        Ok(a.end_graph_capture(StreamHandle(stream as u64))?)
    })
}

/// Notes that a graph of pool `(pool_hi, pool_lo)` was launched on `stream`: the pool's memory
/// is reused by nothing else before the work queued there at its release has completed. Once a
/// stream is enough.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_graph_replayed(
    alloc: *mut mb_allocator,
    pool_hi: u64,
    pool_lo: u64,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        a.graph_replayed((pool_hi, pool_lo), StreamHandle(stream as u64));
        Ok(())
    })
}

/// One graph of pool `(pool_hi, pool_lo)` is destroyed. With the last, the pool's free memory
/// goes back to other allocations, after the streams its graphs were launched on; its live
/// blocks follow as they are freed. Returns `MB_ERR_STREAM_CAPTURE` for a pool with no graph.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_release_graph_pool(
    alloc: *mut mb_allocator,
    pool_hi: u64,
    pool_lo: u64,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        Ok(a.release_graph_pool((pool_hi, pool_lo))?)
    })
}

/// Routes the calling thread's requests outside captures into graph pool `(pool_hi, pool_lo)`
/// until `mb_end_allocate_to_pool` (PyTorch's `beginAllocateCurrentThreadToPool`, which
/// CUDA-graph trees use for warm-up runs): `mb_malloc_async` and `mb_malloc` on this thread
/// take a block the pool holds free (one freed before the route began, on any stream; one freed
/// during it, on its freeing stream only) or new memory, which stays the pool's. The caller
/// orders the route after the work of the pool's graphs (PyTorch's trees synchronise first).
/// The route is one more user of the pool: call `mb_release_graph_pool` after ending it.
/// Returns `MB_ERR_STREAM_CAPTURE` if this thread is routed already.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_begin_allocate_to_pool(
    alloc: *mut mb_allocator,
    pool_hi: u64,
    pool_lo: u64,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        Ok(a.begin_allocate_to_pool((pool_hi, pool_lo))?)
    })
}

/// Ends the calling thread's route into a graph pool. Returns `MB_ERR_STREAM_CAPTURE` if it
/// had none.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_end_allocate_to_pool(alloc: *mut mb_allocator) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        a.end_allocate_to_pool()?;
        Ok(())
    })
}

/// The live blocks of graph pool `(pool_hi, pool_lo)` (handed out and not freed back): their
/// count in `*count`, and the first `cap` of their addresses, in address order, in `ptrs`
/// (NULL when `cap` is 0, to ask for the count). A pool's state to set back later with
/// `mb_set_graph_pool_live`. An unknown pool has none.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `ptrs` is NULL or valid for writes of
/// `cap` values; `count` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_graph_pool_live(
    alloc: *mut mb_allocator,
    pool_hi: u64,
    pool_lo: u64,
    ptrs: *mut u64,
    cap: usize,
    count: *mut usize,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        if ptrs.is_null() && cap > 0 {
            return Err(Failure::null("ptrs"));
        }
        let live = a.graph_pool_live((pool_hi, pool_lo));
        // SAFETY: `count` is NULL (refused) or valid for a write, by the caller's contract.
        unsafe { write_out(count, "count", live.len()) }?;
        for (i, &(p, _)) in live.iter().take(cap).enumerate() {
            // SAFETY: `ptrs` is non-NULL here and valid for `cap` writes, and `i < cap`.
            unsafe { ptrs.add(i).write_unaligned(p) };
        }
        Ok(())
    })
}

/// Makes the `n` addresses at `keep` the live set of graph pool `(pool_hi, pool_lo)`, as
/// PyTorch's `setCheckpointPoolState` sets back a state `mb_graph_pool_live` read: blocks among
/// them that the pool holds free count as allocated again at the same addresses, and the
/// pool's other live blocks go back to it as freed on `stream`. Each block is then freed once,
/// as any other. Returns `MB_ERR_STREAM_CAPTURE`, with nothing changed, while a capture into
/// the pool is in progress, for a pool with no graph, or for an address that is not a block of
/// the pool.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `keep` is NULL (only with `n` 0) or valid
/// for reads of `n` values.
#[no_mangle]
pub unsafe extern "C" fn mb_set_graph_pool_live(
    alloc: *mut mb_allocator,
    pool_hi: u64,
    pool_lo: u64,
    keep: *const u64,
    n: usize,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        let keep: Vec<u64> = match (keep.is_null(), n) {
            (_, 0) => Vec::new(),
            (true, _) => return Err(Failure::null("keep")),
            // SAFETY: `keep` is non-NULL and valid for `n` reads, by the caller's contract;
            // each is read unaligned, so its alignment does not matter.
            (false, _) => (0..n).map(|i| unsafe { keep.add(i).read_unaligned() }).collect(),
        };
        a.set_graph_pool_live((pool_hi, pool_lo), &keep, StreamHandle(stream as u64))?;
        Ok(())
    })
}

/// Frees an allocation made by `mb_malloc` on this allocator. No device work may still use it.
///
/// Returns `MB_ERR_INVALID_POINTER` for an address this allocator did not return, one freed
/// already, or one inside an allocation; `MB_ERR_INVALID_ARGUMENT` for a NULL `alloc`.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_free(alloc: *mut mb_allocator, ptr: u64) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        a.free(ptr)?;
        Ok(())
    })
}

/// Gives every physical page no allocation uses back to the driver, without waiting: the memory
/// of frees whose stream work may still be running stays held (`mb_empty_cache` waits for it).
/// Stores the bytes released in `*out_bytes` unless it is NULL.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_release_unused(alloc: *mut mb_allocator, out_bytes: *mut u64) -> c_int {
    // SAFETY: the caller's contract is `release_with`'s.
    unsafe { release_with(alloc, out_bytes, Allocator::release_unused) }
}

/// Waits on the calling thread for the stream work of every pending free, then gives every
/// physical page no allocation uses back to the driver, as `torch.cuda.empty_cache` does under
/// PyTorch's own allocator. No kernel waits. A failed wait is reported (its error code) after
/// the release, which still gives back what is free; `*out_bytes` is then not written. Stores
/// the bytes released in `*out_bytes` unless it is NULL.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_empty_cache(alloc: *mut mb_allocator, out_bytes: *mut u64) -> c_int {
    // SAFETY: the caller's contract is `release_with`'s.
    unsafe { release_with(alloc, out_bytes, Allocator::empty_cache) }
}

/// The body of `mb_release_unused` and `mb_empty_cache`.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
unsafe fn release_with(
    alloc: *mut mb_allocator,
    out_bytes: *mut u64,
    release: fn(&Allocator) -> moonbright::Result<u64>,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        let released = release(a)?;
        if !out_bytes.is_null() {
            // SAFETY: `out_bytes` is non-NULL and, by the caller's contract, valid for a write.
            unsafe { write_out(out_bytes, "out_bytes", released) }?;
        }
        Ok(())
    })
}

/// Unmaps every retired range now rather than at the next unmap batch.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_flush(alloc: *mut mb_allocator) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        a.flush()?;
        Ok(())
    })
}

/// Stores a snapshot of the allocator's statistics in `*out`.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out` is NULL or valid for a write of an
/// `mb_stats`.
#[no_mangle]
pub unsafe extern "C" fn mb_get_stats(alloc: *mut mb_allocator, out: *mut mb_stats) -> c_int {
    // SAFETY: passed on from the caller's contract above.
    unsafe { query(alloc, out, "out", |a| Ok(mb_stats::from(&a.stats()))) }
}

/// Stores the cap on physical bytes the allocator may hold in `*out_bytes`.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_get_cap(alloc: *mut mb_allocator, out_bytes: *mut u64) -> c_int {
    // SAFETY: passed on from the caller's contract above.
    unsafe { query(alloc, out_bytes, "out_bytes", |a| Ok(a.cap())) }
}

/// Sets the cap on physical bytes the allocator may hold to `bytes` (rounded down to a page,
/// limited to the device's memory) and stores the cap set in `*out_bytes` unless it is NULL.
/// Lowering it below what is held releases every page no allocation uses; past that, live
/// allocations keep their memory, and the held memory serves requests but does not grow until
/// it is back under the cap.
///
/// A cap below one page is 0: every request fails with `MB_ERR_TOO_LARGE` until it is raised.
/// Returns `MB_ERR_DRIVER` when releasing unused memory fails (the cap is set).
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_set_cap(
    alloc: *mut mb_allocator,
    bytes: u64,
    out_bytes: *mut u64,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        let cap = a.set_cap(bytes)?;
        if !out_bytes.is_null() {
            // SAFETY: `out_bytes` is non-NULL and, by the caller's contract, valid for a write.
            unsafe { write_out(out_bytes, "out_bytes", cap) }?;
        }
        Ok(())
    })
}

/// Grants device `peer` access to all of this allocator's memory, mapped now and later, so that
/// kernels and copies on `peer` reach it directly: needed for copies between GPUs in one process,
/// since `cudaDeviceEnablePeerAccess` does not cover virtual-memory mappings. Enabling a peer
/// twice, or a CUDA allocator's own device, does nothing (the host backend, device 0 of 8
/// modelled devices, refuses 0 as a peer). Each later mapping's set access names
/// every peer, and costs more for it; enable only the devices that use this memory.
///
/// Returns `MB_ERR_DRIVER` when `peer` cannot reach this device peer to peer or a driver call
/// fails; no peer is added then, and allocations keep working.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_enable_peer_access(alloc: *mut mb_allocator, peer: c_int) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        Ok(a.enable_peer_access(peer)?)
    })
}

/// Stores the page size (the mapping granularity) in bytes in `*out_bytes`.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_get_page_size(alloc: *mut mb_allocator, out_bytes: *mut u64) -> c_int {
    // SAFETY: passed on from the caller's contract above.
    unsafe { query(alloc, out_bytes, "out_bytes", |a| Ok(a.page_size() as u64)) }
}
