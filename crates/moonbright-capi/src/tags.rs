//! Tags, sleep and wake: the calling thread's tag (`mb_tag_begin`, `mb_tag_end`), a tag's
//! memory given back and taken again at the same addresses (`mb_sleep`, `mb_wake`), and the
//! pinned host memory that backs sleeping bytes.

use std::ffi::{c_char, c_int, CStr};

use moonbright::tags::{self, Backup};

use crate::status::{allocator, call, query, write_out, Failure};
use crate::types::{mb_allocator, mb_sleep_report, mb_wake_report};

/// `mb_sleep`'s `backup`: the tag's bytes are dropped; after `mb_wake` its memory holds
/// whatever the new pages held.
pub const MB_BACKUP_DISCARD: c_int = 0;
/// `mb_sleep`'s `backup`: the tag's bytes are copied to pinned host memory, and back at
/// `mb_wake`.
pub const MB_BACKUP_HOST: c_int = 1;

/// A tag name from C: non-NULL, UTF-8 (its length the core checks).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
unsafe fn tag_name<'a>(tag: *const c_char) -> Result<&'a str, Failure> {
    if tag.is_null() {
        return Err(Failure::null("tag"));
    }
    // SAFETY: a non-NULL `tag` is, by the caller's contract, a NUL-terminated string, read here
    // only.
    unsafe { CStr::from_ptr(tag) }
        .to_str()
        .map_err(|e| Failure::invalid(format!("invalid argument: `tag` is not UTF-8 ({e})")))
}

/// Makes `tag` the calling thread's tag: what `mb_malloc` and the other allocating calls of
/// this thread allocate, on every allocator, carries it until `mb_tag_end`. Stores in
/// `*out_previous` the tag in effect before (0: none), to give to `mb_tag_end`. Tags nest:
/// end them in the reverse order of their begins. Names are process-wide: one name is one tag
/// on every allocator.
///
/// Returns `MB_ERR_INVALID_ARGUMENT` for a NULL argument or a name that is empty, longer than
/// 256 bytes or not UTF-8; the thread's tag is unchanged then.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string; `out_previous` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_tag_begin(tag: *const c_char, out_previous: *mut u32) -> c_int {
    call(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string, by the caller's contract.
        let name = unsafe { tag_name(tag) }?;
        if out_previous.is_null() {
            return Err(Failure::null("out_previous"));
        }
        let previous = tags::enter(name)?;
        // SAFETY: `out_previous` is non-NULL and, by the caller's contract, valid for a write.
        unsafe { write_out(out_previous, "out_previous", previous) }
    })
}

/// Ends the tag a `mb_tag_begin` of this thread began: `previous` is what that call stored in
/// `*out_previous`, and becomes the thread's tag again. A value no `mb_tag_begin` stored is
/// refused (`MB_ERR_INVALID_ARGUMENT`), the thread's tag unchanged.
#[no_mangle]
pub extern "C" fn mb_tag_end(previous: u32) -> c_int {
    call(|| tags::restore(previous).map_err(Into::into))
}

/// Puts every allocation of `alloc` tagged `tag` to sleep: after the work queued on their
/// streams (events, never a device-wide synchronisation: the streams of `mb_malloc_async` and
/// `mb_record_stream`; memory from `mb_malloc` has none, and no work may use it any more, as
/// for `mb_free`), their bytes are copied to pinned host memory (`backup` `MB_BACKUP_HOST`) or
/// dropped (`MB_BACKUP_DISCARD`), and their memory is unmapped and given back to the driver. Their addresses stay reserved: pointers and CUDA
/// graphs that hold them are valid again after `mb_wake`. Until then, allocating with the tag
/// and freeing its allocations return `MB_ERR_TAG_STATE`; other tags and untagged memory are
/// untouched. A tag with no allocation sleeps at no cost (and its allocations are refused).
/// Stores what was done in `*out` unless it is NULL.
///
/// Returns `MB_ERR_TAG_STATE` for a tag that is not awake (asleep already, or being put to
/// sleep or woken on another thread), one of whose requests is mapping on another thread, or
/// some of whose memory was exported to another process (`mb_ipc_send`);
/// `MB_ERR_INVALID_ARGUMENT` for a NULL `alloc` or `tag`, a bad name (as `mb_tag_begin`) or an
/// unknown `backup`; `MB_ERR_DRIVER` when a wait or a copy fails. After any failure the tag is
/// as it was.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `tag` is NULL or a NUL-terminated string;
/// `out` is NULL or valid for a write of an `mb_sleep_report`.
#[no_mangle]
pub unsafe extern "C" fn mb_sleep(
    alloc: *mut mb_allocator,
    tag: *const c_char,
    backup: c_int,
    out: *mut mb_sleep_report,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        // SAFETY: `tag` is NULL or a NUL-terminated string, by the caller's contract.
        let name = unsafe { tag_name(tag) }?;
        let backup = match backup {
            MB_BACKUP_HOST => Backup::Host,
            MB_BACKUP_DISCARD => Backup::Discard,
            other => {
                return Err(Failure::invalid(format!(
                    "invalid argument: `backup` is {other}, neither MB_BACKUP_HOST (1) nor \
                     MB_BACKUP_DISCARD (0)"
                )))
            }
        };
        let report = a.sleep(name, backup)?;
        if !out.is_null() {
            // SAFETY: `out` is non-NULL and, by the caller's contract, valid for a write.
            unsafe { write_out(out, "out", mb_sleep_report::from(&report)) }?;
        }
        Ok(())
    })
}

/// Wakes `tag` on `alloc`: maps its memory again at the same addresses, from memory the
/// allocator holds free and new chunks, and copies its bytes back if `mb_sleep` kept them;
/// returns once they are in place. Stores what was done in `*out` unless it is NULL.
///
/// All or nothing: returns `MB_ERR_OUT_OF_MEMORY` when the memory cannot be had (the cap, the
/// device) and `MB_ERR_DRIVER` when a driver call fails, with the tag still asleep and its bytes
/// kept (free memory and call again); `MB_ERR_TAG_STATE` for a tag that is not asleep;
/// `MB_ERR_INVALID_ARGUMENT` for a NULL `alloc` or `tag` or a bad name.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `tag` is NULL or a NUL-terminated string;
/// `out` is NULL or valid for a write of an `mb_wake_report`.
#[no_mangle]
pub unsafe extern "C" fn mb_wake(
    alloc: *mut mb_allocator,
    tag: *const c_char,
    out: *mut mb_wake_report,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        // SAFETY: `tag` is NULL or a NUL-terminated string, by the caller's contract.
        let name = unsafe { tag_name(tag) }?;
        let report = a.wake(name)?;
        if !out.is_null() {
            // SAFETY: `out` is non-NULL and, by the caller's contract, valid for a write.
            unsafe { write_out(out, "out", mb_wake_report::from(&report)) }?;
        }
        Ok(())
    })
}

/// Stores in `*out_bytes` the bytes of pinned host memory `alloc` holds for sleeps: the bytes
/// of tags asleep with `MB_BACKUP_HOST`, and spare pieces kept for the next sleep.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_get_host_memory(
    alloc: *mut mb_allocator,
    out_bytes: *mut u64,
) -> c_int {
    // SAFETY: passed on from the caller's contract above.
    unsafe { query(alloc, out_bytes, "out_bytes", |a| Ok(a.host_memory())) }
}

/// Gives the spare pinned host memory of `alloc` back to the system (what tags asleep hold
/// stays), and stores the bytes freed in `*out_bytes` unless it is NULL. Returns
/// `MB_ERR_DRIVER` when freeing a piece fails (`*out_bytes` is not written then).
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_release_host_memory(
    alloc: *mut mb_allocator,
    out_bytes: *mut u64,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle, by the caller's contract.
        let a = unsafe { allocator(alloc) }?;
        let freed = a.release_host_memory()?;
        if !out_bytes.is_null() {
            // SAFETY: `out_bytes` is non-NULL and, by the caller's contract, valid for a write.
            unsafe { write_out(out_bytes, "out_bytes", freed) }?;
        }
        Ok(())
    })
}
