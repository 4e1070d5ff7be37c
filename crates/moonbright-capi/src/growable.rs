//! The C API of growable allocations: reserve virtual capacity, resize in place (stream-ordered
//! or not), and read their sizes. `mb_free` / `mb_free_async` release them. The conventions of
//! `lib.rs` hold: an `int` status, NULL checks, no panic across the boundary.

use std::ffi::{c_int, c_void};

use moonbright::StreamHandle;

use crate::status::{allocator, call, query, Failure};
use crate::types::mb_allocator;

/// The sizes of a growable allocation, in bytes (`mb_get_growable_info`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct mb_growable_info {
    /// Its address, fixed for its life.
    pub base: u64,
    /// Addresses reserved: the most it can grow to.
    pub capacity: u64,
    /// The size of the last resize.
    pub size: u64,
    /// Bytes backed by physical pages.
    pub committed: u64,
}

/// Reserves `capacity` bytes of addresses (rounded up to pages) for a growable allocation and
/// stores its address, which never changes, in `*out_ptr`. No physical memory is used until it
/// grows. `mb_free` or `mb_free_async` releases it.
///
/// Returns `MB_ERR_INVALID_ARGUMENT` for NULL arguments or a capacity of 0,
/// `MB_ERR_OUT_OF_MEMORY` when the address space cannot hold it, `MB_ERR_DRIVER` when the
/// reservation fails.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_ptr` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_reserve_growable(
    alloc: *mut mb_allocator,
    capacity: usize,
    out_ptr: *mut u64,
) -> c_int {
    // SAFETY: passed on from the caller's contract above.
    unsafe { query(alloc, out_ptr, "out_ptr", |a| Ok(a.reserve_growable(capacity)?)) }
}

/// Resizes the growable allocation at `ptr` to `len` bytes in `stream`'s order (a `CUstream`,
/// NULL for the default stream), in place: growing maps pages at its end, none while the pages
/// already committed hold `len`; shrinking gives back whole chunks beyond `len`, reusable by other
/// streams once the work queued on `stream` before this call has completed. Nothing is copied.
///
/// Returns `MB_ERR_TOO_LARGE` beyond its capacity, `MB_ERR_INVALID_POINTER` for a pointer that
/// is not a live growable allocation, `MB_ERR_OUT_OF_MEMORY` when not enough memory is free,
/// `MB_ERR_STREAM_CAPTURE` while `stream` is being captured, `MB_ERR_DRIVER` when a driver call
/// fails. On failure nothing changes.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `stream` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn mb_resize_async(
    alloc: *mut mb_allocator,
    ptr: u64,
    len: usize,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        Ok(a.resize_async(ptr, len, StreamHandle(stream as u64))?)
    })
}

/// `mb_resize_async` for a caller that orders device work itself (as `mb_free`): what a shrink
/// gives back is reusable at once.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_resize(alloc: *mut mb_allocator, ptr: u64, len: usize) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        Ok(a.resize(ptr, len)?)
    })
}

/// Stores the sizes of the growable allocation at `ptr` in `*out`.
///
/// Returns `MB_ERR_INVALID_POINTER` for a pointer that is not a live growable allocation.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_get_growable_info(
    alloc: *mut mb_allocator,
    ptr: u64,
    out: *mut mb_growable_info,
) -> c_int {
    // SAFETY: passed on from the caller's contract above.
    unsafe {
        query(alloc, out, "out", |a| match a.growable_info(ptr) {
            Some(i) => Ok(mb_growable_info {
                base: i.base,
                capacity: i.capacity,
                size: i.size,
                committed: i.committed,
            }),
            None => Err(Failure {
                status: crate::MB_ERR_INVALID_POINTER,
                message: format!("{ptr:#x} is not a live growable allocation"),
            }),
        })
    }
}
