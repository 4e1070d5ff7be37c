//! The C API of MoonBright: `extern "C"` functions over the core [`moonbright::Allocator`],
//! the C structures they fill, the status codes and the per-thread last error. The header
//! `include/moonbright.h` is generated from this file by cbindgen (see `tests/header.rs`).
//!
//! Conventions, for every function:
//! - Fallible functions return an `int` status, `MB_OK` (0) on success. On failure the output
//!   arguments are left untouched and `mb_last_error()` describes what went wrong.
//! - Every pointer argument is checked for NULL (`MB_ERR_INVALID_ARGUMENT`).
//! - No Rust panic crosses the boundary: a panic is caught and reported as `MB_ERR_INTERNAL`,
//!   with its message as the last error.

#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

mod paged;
pub use paged::*;

use moonbright::{Allocator, BackendKind, CallKind, Error, Options, Stat, Stats, StreamHandle};

mod growable;
pub use growable::*;

mod ipc;
pub use ipc::*;

/// Success.
pub const MB_OK: c_int = 0;
/// A NULL pointer argument, a size of 0, or a bad option value (the last error names it).
pub const MB_ERR_INVALID_ARGUMENT: c_int = 1;
/// Not enough free memory under the cap (or no virtual address space left); freeing memory or a
/// larger cap may help.
pub const MB_ERR_OUT_OF_MEMORY: c_int = 2;
/// A request larger than the cap: it can never succeed with this allocator.
pub const MB_ERR_TOO_LARGE: c_int = 3;
/// A free of a pointer this allocator did not return, of one freed already, or of an address
/// inside an allocation.
pub const MB_ERR_INVALID_POINTER: c_int = 4;
/// A driver call failed; the allocator's state is as it was before the request.
pub const MB_ERR_DRIVER: c_int = 5;
/// No backend could be opened (no CUDA driver or device, say).
pub const MB_ERR_NO_BACKEND: c_int = 6;
/// A bug in MoonBright (a caught panic); the last error says where.
pub const MB_ERR_INTERNAL: c_int = 7;
/// A stream-ordered request on a stream being captured into a CUDA graph (refused).
pub const MB_ERR_STREAM_CAPTURE: c_int = 8;
/// Memory could not be shared with, or taken from, another process (`mb_ipc_*`). (Codes 9 to 12
/// are the paged pool's, `MB_ERR_UNKNOWN_SEQUENCE` and after.)
pub const MB_ERR_IPC: c_int = 13;

/// `mb_options.backend`: CUDA when a GPU is present, the host backend otherwise.
pub const MB_BACKEND_AUTO: c_int = 0;
/// `mb_options.backend`: the CUDA driver.
pub const MB_BACKEND_CUDA: c_int = 1;
/// `mb_options.backend`: the host backend, a CPU model of the CUDA virtual-memory API (for tests).
pub const MB_BACKEND_HOST: c_int = 2;

/// An allocator (opaque). Made by `mb_create`, destroyed by `mb_destroy`. Any number of threads
/// may call `mb_malloc`, `mb_free` and the other functions on one allocator at once; only
/// `mb_destroy` must not overlap any other call on it.
pub struct mb_allocator {
    inner: Allocator,
}

/// Options of an allocator. Fill with `mb_options_default`, then change what you need. A field
/// of 0 means its default everywhere (except `backend` and `device`, where 0 is itself a value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct mb_options {
    /// Which backend: `MB_BACKEND_AUTO` (0), `MB_BACKEND_CUDA` (1) or `MB_BACKEND_HOST` (2).
    pub backend: c_int,
    /// CUDA device ordinal.
    pub device: i32,
    /// Cap on physical bytes held; 0: 95% of the device's total memory.
    pub cap_bytes: u64,
    /// Host backend: page size in bytes, a power of two from 4096 to 1 GiB; 0: 2 MiB.
    pub host_page_size: u64,
    /// Host backend: bytes of simulated device memory; 0: 64 GiB.
    pub host_capacity: u64,
    /// Largest physical chunk in bytes, a power of two; 0: 64 MiB.
    pub max_chunk_bytes: u64,
    /// Retired ranges that trigger an unmap batch; 0: 256.
    pub unmap_batch_ranges: u64,
}

/// One statistic: its current value, its peak, and its cumulative increases and decreases.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct mb_stat {
    /// Now.
    pub current: u64,
    /// Highest `current` since the allocator was created.
    pub peak: u64,
    /// Sum of all increases.
    pub allocated: u64,
    /// Sum of all decreases.
    pub freed: u64,
}

/// A snapshot of an allocator's statistics (`mb_get_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct mb_stats {
    /// Bytes of live allocations, as requested.
    pub allocated_bytes: mb_stat,
    /// Bytes of physical memory held.
    pub reserved_bytes: mb_stat,
    /// Bytes of live allocations after rounding (to 256 B below a page, to pages above).
    pub active_bytes: mb_stat,
    /// Rounded minus requested bytes of live allocations.
    pub rounding_waste_bytes: mb_stat,
    /// Virtual bytes mapped (live, cached and retired ranges).
    pub mapped_bytes: mb_stat,
    /// Live allocations.
    pub allocations: mb_stat,
    /// Allocations served by a cached range without any driver call.
    pub cache_hits: u64,
    /// Cached ranges broken up to reuse their pages elsewhere.
    pub cached_ranges_stolen: u64,
    /// Chunks released and recreated smaller under pressure.
    pub chunk_splits: u64,
    /// Unmap batches flushed.
    pub unmap_batches: u64,
    /// Requests refused for lack of memory.
    pub num_ooms: u64,
    /// Driver errors met outside a request, recovered by retrying later.
    pub deferred_errors: u64,
    /// `cuMemMap` calls.
    pub map_calls: u64,
    /// `cuMemUnmap` calls.
    pub unmap_calls: u64,
    /// `cuMemSetAccess` calls.
    pub set_access_calls: u64,
    /// `cuMemCreate` calls.
    pub create_calls: u64,
    /// `cuMemRelease` calls.
    pub release_calls: u64,
    /// `cuMemAddressReserve` calls.
    pub reserve_calls: u64,
    /// Bytes of pages committed to growable allocations.
    pub growable_committed_bytes: mb_stat,
    /// Resizes of growable allocations that mapped or gave back pages (none copies).
    pub growable_resizes: u64,
}

impl From<Stat> for mb_stat {
    fn from(s: Stat) -> Self {
        mb_stat { current: s.current, peak: s.peak, allocated: s.allocated, freed: s.freed }
    }
}

impl From<&Stats> for mb_stats {
    fn from(s: &Stats) -> Self {
        let calls = |k| s.driver_calls.get(k);
        mb_stats {
            allocated_bytes: s.allocated_bytes.into(),
            reserved_bytes: s.reserved_bytes.into(),
            active_bytes: s.active_bytes.into(),
            rounding_waste_bytes: s.rounding_waste_bytes.into(),
            mapped_bytes: s.mapped_bytes.into(),
            allocations: s.allocations.into(),
            cache_hits: s.cache_hits,
            cached_ranges_stolen: s.cached_ranges_stolen,
            chunk_splits: s.chunk_splits,
            unmap_batches: s.unmap_batches,
            num_ooms: s.num_ooms,
            deferred_errors: s.deferred_errors,
            map_calls: calls(CallKind::Map),
            unmap_calls: calls(CallKind::Unmap),
            set_access_calls: calls(CallKind::SetAccess),
            create_calls: calls(CallKind::Create),
            release_calls: calls(CallKind::Release),
            reserve_calls: calls(CallKind::Reserve),
            growable_committed_bytes: s.growable_committed_bytes.into(),
            growable_resizes: s.growable_resizes,
        }
    }
}

// ---- errors ------------------------------------------------------------------------------------

thread_local! {
    /// This thread's last error message, NUL-terminated; empty when the last call succeeded.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// A failed call: its status and the message for `mb_last_error`.
#[derive(Debug)]
struct Failure {
    status: c_int,
    message: String,
}

impl Failure {
    fn invalid(message: impl Into<String>) -> Self {
        Failure { status: MB_ERR_INVALID_ARGUMENT, message: message.into() }
    }

    fn null(arg: &str) -> Self {
        Failure::invalid(format!("invalid argument: `{arg}` is NULL"))
    }
}

/// The status for each core error.
fn status_of(e: &Error) -> c_int {
    match e {
        Error::OutOfMemory { .. } | Error::AddressSpaceExhausted { .. } => MB_ERR_OUT_OF_MEMORY,
        Error::TooLarge { .. } | Error::BeyondCapacity { .. } => MB_ERR_TOO_LARGE,
        Error::ZeroSize
        | Error::InvalidOption { .. }
        | Error::GrowableStreamUse { .. }
        | Error::InvalidArgument(_) => MB_ERR_INVALID_ARGUMENT,
        Error::Ipc(_) => MB_ERR_IPC,
        Error::UnknownPointer { .. }
        | Error::DoubleFree { .. }
        | Error::InteriorPointer { .. }
        | Error::NotGrowable { .. }
        | Error::Released { .. } => MB_ERR_INVALID_POINTER,
        Error::NoBackend(_) => MB_ERR_NO_BACKEND,
        Error::StreamCapture { .. } | Error::GraphPool { .. } => MB_ERR_STREAM_CAPTURE,
        Error::Driver(_) => MB_ERR_DRIVER,
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure { status: status_of(&e), message: e.to_string() }
    }
}

fn set_last_error(message: &str) {
    // A C string cannot hold NUL; no message has one, but never fail over it.
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; then there is nowhere to write.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = c);
}

fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|slot| {
        let mut slot = slot.borrow_mut();
        if !slot.as_bytes().is_empty() {
            *slot = CString::default();
        }
    });
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message");
    format!("internal error (a bug in MoonBright): {what}")
}

/// Runs one API call: clears the last error, runs `f` with panics caught, and turns its outcome
/// into a status, setting the last error on failure.
fn call(f: impl FnOnce() -> Result<(), Failure>) -> c_int {
    clear_last_error();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => MB_OK,
        Ok(Err(failure)) => {
            set_last_error(&failure.message);
            failure.status
        }
        Err(payload) => {
            let message = panic_message(&*payload);
            // Dropping a payload runs arbitrary code that could itself panic; keep even that in.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            set_last_error(&message);
            MB_ERR_INTERNAL
        }
    }
}

/// The allocator behind a handle, or the failure for a NULL one.
///
/// # Safety
/// `alloc` is NULL or a handle from `mb_create` not yet passed to `mb_destroy`.
unsafe fn allocator<'a>(alloc: *const mb_allocator) -> Result<&'a Allocator, Failure> {
    // SAFETY: the caller guarantees a non-NULL `alloc` is a live handle, a `Box<mb_allocator>`
    // leaked by `mb_create`; it is only read through shared references (`Allocator` is `Sync`).
    match unsafe { alloc.as_ref() } {
        Some(a) => Ok(&a.inner),
        None => Err(Failure::null("alloc")),
    }
}

/// Writes `value` to `out`.
///
/// # Safety
/// `out` is NULL (a failure naming `name`) or valid for a write of a `T`.
unsafe fn write_out<T>(out: *mut T, name: &str, value: T) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::null(name));
    }
    // SAFETY: `out` is non-NULL and, by the caller's contract, valid for writes of a `T`;
    // `write_unaligned` asks nothing of its alignment.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

/// Stores `f(allocator)` in `*out`, or returns `f`'s error: the shape of every call with an
/// out-parameter.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out` is NULL or valid for a write of `T`.
unsafe fn query<T>(
    alloc: *mut mb_allocator,
    out: *mut T,
    name: &str,
    f: impl FnOnce(&Allocator) -> Result<T, Failure>,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        if out.is_null() {
            return Err(Failure::null(name));
        }
        let value = f(a)?;
        // SAFETY: `out` is non-NULL and, by the caller's contract, valid for a `T`.
        unsafe { write_out(out, name, value) }
    })
}

// ---- options -----------------------------------------------------------------------------------

fn non_zero_or<T>(value: u64, name: &'static str, default: T) -> Result<T, Failure>
where
    T: TryFrom<u64>,
{
    if value == 0 {
        return Ok(default);
    }
    T::try_from(value).map_err(|_| {
        Error::InvalidOption { name, reason: format!("{value} does not fit this platform") }.into()
    })
}

/// The core options for C options.
fn to_options(o: &mb_options) -> Result<Options, Failure> {
    let d = Options::default();
    let backend = match o.backend {
        MB_BACKEND_AUTO => BackendKind::Auto,
        MB_BACKEND_CUDA => BackendKind::Cuda,
        MB_BACKEND_HOST => BackendKind::Host,
        other => {
            return Err(Error::InvalidOption {
                name: "backend",
                reason: format!(
                    "{other} is not one of MB_BACKEND_AUTO (0), MB_BACKEND_CUDA (1), \
                     MB_BACKEND_HOST (2)"
                ),
            }
            .into())
        }
    };
    let options = Options {
        backend,
        device: o.device,
        cap_bytes: (o.cap_bytes != 0).then_some(o.cap_bytes),
        host_page_size: non_zero_or(o.host_page_size, "host_page_size", d.host_page_size)?,
        host_capacity: non_zero_or(o.host_capacity, "host_capacity", d.host_capacity)?,
        max_chunk_bytes: non_zero_or(o.max_chunk_bytes, "max_chunk_bytes", d.max_chunk_bytes)?,
        unmap_batch_ranges: non_zero_or(
            o.unmap_batch_ranges,
            "unmap_batch_ranges",
            d.unmap_batch_ranges,
        )?,
        ..d
    };
    options.check()?;
    Ok(options)
}

/// Fills `*out` with the default options: the auto backend on device 0, and every other field at
/// its default value (written out, so a caller can read it). Does nothing when `out` is NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of an `mb_options`.
#[no_mangle]
pub unsafe extern "C" fn mb_options_default(out: *mut mb_options) {
    let _ = call(|| {
        let d = Options::default();
        let o = mb_options {
            backend: MB_BACKEND_AUTO,
            device: d.device,
            cap_bytes: d.cap_bytes.unwrap_or(0),
            host_page_size: d.host_page_size as u64,
            host_capacity: d.host_capacity,
            max_chunk_bytes: d.max_chunk_bytes,
            unmap_batch_ranges: d.unmap_batch_ranges as u64,
        };
        // SAFETY: the caller passes NULL or a pointer valid for a write of an `mb_options`.
        unsafe { write_out(out, "out", o) }
    });
}

// ---- the allocator -----------------------------------------------------------------------------

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

// ---- strings -----------------------------------------------------------------------------------

/// The message of the last failed call on this thread, or "" when the last call succeeded. Every
/// call except `mb_last_error`, `mb_status_string` and `mb_version` clears it first. The string
/// is valid until the next such call on this thread; copy it to keep it. Never NULL.
#[no_mangle]
pub extern "C" fn mb_last_error() -> *const c_char {
    let got = catch_unwind(|| {
        LAST_ERROR.try_with(|slot| slot.borrow().as_ptr()).unwrap_or_else(|_| c"".as_ptr())
    });
    got.unwrap_or_else(|_| c"".as_ptr())
}

/// A short static description of a status code ("ok", "out of memory", ...); "unknown status"
/// for a code that is none of them. Never NULL.
#[no_mangle]
pub extern "C" fn mb_status_string(status: c_int) -> *const c_char {
    let s: &'static CStr = match status {
        MB_OK => c"ok",
        MB_ERR_INVALID_ARGUMENT => c"invalid argument",
        MB_ERR_OUT_OF_MEMORY => c"out of memory",
        MB_ERR_TOO_LARGE => c"request larger than the cap",
        MB_ERR_INVALID_POINTER => c"invalid pointer",
        MB_ERR_DRIVER => c"driver call failed",
        MB_ERR_NO_BACKEND => c"no backend available",
        MB_ERR_INTERNAL => c"internal error",
        MB_ERR_STREAM_CAPTURE => c"stream is being captured",
        MB_ERR_UNKNOWN_SEQUENCE => c"unknown sequence",
        MB_ERR_FREED_SEQUENCE => c"sequence was freed",
        MB_ERR_CAPACITY => c"capacity exceeded",
        MB_ERR_INVALID_REQUEST => c"invalid request",
        MB_ERR_IPC => c"inter-process sharing failed",
        _ => c"unknown status",
    };
    s.as_ptr()
}

/// MoonBright's version, as "MAJOR.MINOR.PATCH". Static; never NULL.
#[no_mangle]
pub extern "C" fn mb_version() -> *const c_char {
    const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    VERSION.as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_internal_errors() {
        let status = call(|| panic!("boom {}", 42));
        assert_eq!(status, MB_ERR_INTERNAL);
        // SAFETY: `mb_last_error` returns a valid NUL-terminated string.
        let msg = unsafe { CStr::from_ptr(mb_last_error()) }.to_str().unwrap();
        assert!(msg.contains("boom 42"), "{msg}");
        assert_eq!(call(|| std::panic::panic_any(7_u32)), MB_ERR_INTERNAL);
        assert_eq!(call(|| Ok(())), MB_OK);
        // SAFETY: as above.
        assert!(unsafe { CStr::from_ptr(mb_last_error()) }.to_bytes().is_empty());
    }

    #[test]
    fn every_core_error_has_a_status() {
        let cases = [
            (Error::ZeroSize, MB_ERR_INVALID_ARGUMENT),
            (Error::TooLarge { requested: 2, cap: 1 }, MB_ERR_TOO_LARGE),
            (Error::DoubleFree { ptr: 1 }, MB_ERR_INVALID_POINTER),
            (Error::UnknownPointer { ptr: 1 }, MB_ERR_INVALID_POINTER),
            (Error::InteriorPointer { ptr: 2, base: 1, offset: 1 }, MB_ERR_INVALID_POINTER),
            (Error::NoBackend("x".into()), MB_ERR_NO_BACKEND),
            (Error::StreamCapture { stream: 1 }, MB_ERR_STREAM_CAPTURE),
            (Error::AddressSpaceExhausted { reserved: 1, limit: 1 }, MB_ERR_OUT_OF_MEMORY),
            (Error::Driver(moonbright::DriverError::new(CallKind::Map, 1, "x")), MB_ERR_DRIVER),
        ];
        for (e, status) in cases {
            assert_eq!(status_of(&e), status, "{e}");
        }
    }

    #[test]
    fn zero_options_are_the_defaults() {
        let o = to_options(&mb_options::default()).unwrap();
        assert_eq!(o, Options::default());
        let mut filled = mb_options::default();
        // SAFETY: `filled` is a live local.
        unsafe { mb_options_default(&mut filled) };
        assert_eq!(to_options(&filled).unwrap(), Options::default());
    }
}
