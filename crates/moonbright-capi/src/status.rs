//! Statuses and errors: the status codes, the per-thread last error, the wrapper every entry
//! point runs in (no panic crosses the boundary), the checks of pointer arguments, and the
//! strings (`mb_last_error`, `mb_status_string`, `mb_version`).

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use moonbright::{Allocator, Error};

use crate::types::mb_allocator;

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
/// The paged KV pool (`mb_paged_*`): an unknown sequence id (never handed out by this pool).
pub const MB_ERR_UNKNOWN_SEQUENCE: c_int = 9;
/// A request on a freed sequence: a double free, a fork of a freed sequence, an extend of one.
pub const MB_ERR_FREED_SEQUENCE: c_int = 10;
/// A capacity would be exceeded: a sequence's length, the pool's pages, the block table's rows,
/// or the step's slot mapping.
pub const MB_ERR_CAPACITY: c_int = 11;
/// A request that is invalid as asked (a truncation that lengthens, a fork of tokens added
/// this step before the commit).
pub const MB_ERR_INVALID_REQUEST: c_int = 12;
/// Memory could not be shared with, or taken from, another process (`mb_ipc_*`).
pub const MB_ERR_IPC: c_int = 13;
/// A tag that is not awake: an allocation into it or a free of its memory while it sleeps, a
/// sleep of a tag asleep already, a wake of one awake (`mb_sleep`, `mb_wake`).
pub const MB_ERR_TAG_STATE: c_int = 14;

/// `mb_options.backend`: CUDA when a GPU is present, the host backend otherwise.
pub const MB_BACKEND_AUTO: c_int = 0;
/// `mb_options.backend`: the CUDA driver.
pub const MB_BACKEND_CUDA: c_int = 1;
/// `mb_options.backend`: the host backend, a CPU model of the CUDA virtual-memory API (for tests).
pub const MB_BACKEND_HOST: c_int = 2;

thread_local! {
    /// This thread's last error message, NUL-terminated; empty when the last call succeeded.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// A failed call: its status and the message for `mb_last_error`.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: c_int,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Failure { status: MB_ERR_INVALID_ARGUMENT, message: message.into() }
    }

    pub(crate) fn null(arg: &str) -> Self {
        Failure::invalid(format!("invalid argument: `{arg}` is NULL"))
    }
}

/// The status for each core error.
pub(crate) fn status_of(e: &Error) -> c_int {
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
        Error::TagAsleep { .. } | Error::TagState { .. } => MB_ERR_TAG_STATE,
        Error::Driver(_) => MB_ERR_DRIVER,
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure { status: status_of(&e), message: e.to_string() }
    }
}

pub(crate) fn set_last_error(message: &str) {
    // A C string cannot hold NUL; no message has one, but never fail over it.
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; then there is nowhere to write.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = c);
}

pub(crate) fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|slot| {
        let mut slot = slot.borrow_mut();
        if !slot.as_bytes().is_empty() {
            *slot = CString::default();
        }
    });
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message");
    format!("internal error (a bug in MoonBright): {what}")
}

/// Runs one API call: clears the last error, runs `f` with panics caught, and turns its outcome
/// into a status, setting the last error on failure.
pub(crate) fn call(f: impl FnOnce() -> Result<(), Failure>) -> c_int {
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
pub(crate) unsafe fn allocator<'a>(alloc: *const mb_allocator) -> Result<&'a Allocator, Failure> {
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
pub(crate) unsafe fn write_out<T>(out: *mut T, name: &str, value: T) -> Result<(), Failure> {
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
pub(crate) unsafe fn query<T>(
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
        MB_ERR_TAG_STATE => c"tag is not in the state the call needs",
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
    use moonbright::{CallKind, DriverError};

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
            (Error::Driver(DriverError::new(CallKind::Map, 1, "x")), MB_ERR_DRIVER),
        ];
        for (e, status) in cases {
            assert_eq!(status_of(&e), status, "{e}");
        }
    }
}
