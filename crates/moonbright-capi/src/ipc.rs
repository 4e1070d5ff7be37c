//! The C API of sharing memory between processes: send an allocation over a connected Unix
//! socket, receive and map one, and unmap it. The conventions of `lib.rs` hold: an `int`
//! status, NULL checks, no panic across the boundary.

use std::ffi::c_int;
use std::os::fd::BorrowedFd;

use moonbright::Export;

use crate::status::{allocator, call, write_out, Failure};
use crate::types::mb_allocator;

/// The socket a caller passed, borrowed for the call.
///
/// # Safety
/// A non-negative `fd` is an open descriptor for the whole call.
unsafe fn socket<'a>(fd: c_int) -> Result<BorrowedFd<'a>, Failure> {
    if fd < 0 {
        return Err(Failure::invalid(format!("invalid argument: socket descriptor {fd}")));
    }
    // SAFETY: by the caller's contract the descriptor stays open while the call runs, and the
    // borrow does not outlive it.
    Ok(unsafe { BorrowedFd::borrow_raw(fd) })
}

/// Sends the live allocation at `ptr` over `socket_fd`, a connected Unix socket, to a process
/// that calls `mb_ipc_recv`: its chunks travel as file descriptors (`SCM_RIGHTS`). The
/// allocation must stay live until the receiver has closed its import (`mb_ipc_close`).
///
/// Returns `MB_ERR_INVALID_POINTER` for a pointer that is not a live allocation, `MB_ERR_IPC`
/// when sharing is off (option `ipc`) or the socket fails, `MB_ERR_DRIVER` when an export
/// fails. The allocation is unchanged either way.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; a non-negative `socket_fd` is an open
/// descriptor.
#[no_mangle]
pub unsafe extern "C" fn mb_ipc_send(
    alloc: *mut mb_allocator,
    ptr: u64,
    socket_fd: c_int,
) -> c_int {
    call(|| {
        // SAFETY: passed on from the caller's contract above.
        let (a, s) = unsafe { (allocator(alloc)?, socket(socket_fd)?) };
        a.export(ptr)?.send(s)?;
        Ok(())
    })
}

/// Receives an allocation `mb_ipc_send` sent over `socket_fd` and maps it on this allocator's
/// device at addresses of its own; stores its address in `*out_ptr` and its size in
/// `*out_size`. The memory is not this allocator's: `mb_ipc_close` unmaps it.
///
/// Returns `MB_ERR_IPC` for a malformed message, a closed socket, or an export from another
/// backend; `MB_ERR_DRIVER` when importing or mapping fails (nothing stays mapped).
///
/// Trust: the socket is the caller's, and whoever holds its other end decides what arrives.
/// The message is checked for form (sizes, counts, no more descriptors than it announces,
/// every one closed on error), not for origin: what is mapped is whatever memory the
/// sender's descriptors name, which the sender can read and write. Receive only from a peer
/// trusted with that memory (check it, e.g. with `SO_PEERCRED`, on a socket others can
/// reach); see docs/security.md. A blocking socket's own receive time-out (`SO_RCVTIMEO`)
/// holds; a non-blocking socket is waited on.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`; a non-negative `socket_fd` is an open
/// descriptor; `out_ptr` and `out_size` are NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_ipc_recv(
    alloc: *mut mb_allocator,
    socket_fd: c_int,
    out_ptr: *mut u64,
    out_size: *mut u64,
) -> c_int {
    call(|| {
        // SAFETY: passed on from the caller's contract above.
        let (a, s) = unsafe { (allocator(alloc)?, socket(socket_fd)?) };
        if out_ptr.is_null() || out_size.is_null() {
            return Err(Failure::null(if out_ptr.is_null() { "out_ptr" } else { "out_size" }));
        }
        let export = Export::recv(s)?;
        let ptr = a.import(&export)?;
        // SAFETY: both are non-NULL and, by the caller's contract, valid for a write.
        unsafe {
            write_out(out_ptr, "out_ptr", ptr)?;
            write_out(out_size, "out_size", export.size())
        }
    })
}

/// Unmaps memory `mb_ipc_recv` mapped. The unmap is immediate: work that uses it must have
/// completed. Returns `MB_ERR_IPC` for an address that is not an import.
///
/// # Safety
/// `alloc` is NULL or a live handle from `mb_create`.
#[no_mangle]
pub unsafe extern "C" fn mb_ipc_close(alloc: *mut mb_allocator, ptr: u64) -> c_int {
    call(|| {
        // SAFETY: passed on from the caller's contract above.
        unsafe { allocator(alloc) }?.close_import(ptr)?;
        Ok(())
    })
}
