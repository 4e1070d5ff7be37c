//! The C entry points PyTorch's `CUDAPluggableAllocator` calls (its signatures), in this same
//! shared library as the Python module so that both reach one allocator per device. They never
//! unwind: an error or a panic returns null (or is ignored, for a free) and leaves its message
//! for `last_error()`.

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use moonbright::core::history;
use moonbright::{Error, StreamHandle};

use crate::stacks;
use crate::{allocator, is_oom, lock, panic_message, set_last_error, LAST_ERROR};

/// Allocates `size` bytes on `device` for use on `stream`. Returns null for a size of 0 (what
/// PyTorch asks for empty tensors), and null on any error, leaving the message for
/// `moonbright.last_error()`.
#[no_mangle]
pub extern "C" fn moonbright_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    alloc_entry(size, device, stream, false)
}

/// `moonbright_alloc` for `moonbright.torch.pool()`, whose failures PyTorch's caching allocator
/// reports as its own out-of-memory error, without MoonBright's message. A segment asked for
/// while its stream is being captured (`torch.cuda.graph(g, pool=pool.id)`) goes to PyTorch's
/// graph-private pool, which keeps it until the graph is gone and its cache emptied: it comes
/// from memory no stream's queued work uses (`Allocator::malloc_for_graph`). A refusal for
/// graph capture, if any, is printed to stderr too, saying it is no lack of memory.
#[no_mangle]
pub extern "C" fn moonbright_pool_alloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    alloc_entry(size, device, stream, true)
}

/// The allocation entry points' body. `pool_mode`: for `moonbright.torch.pool()`, whose segments
/// asked for in a capture come from `malloc_for_graph`, and whose refusals are printed.
pub(crate) fn alloc_entry(
    size: isize,
    device: c_int,
    stream: *mut c_void,
    pool_mode: bool,
) -> *mut c_void {
    if size == 0 {
        return std::ptr::null_mut();
    }
    let r = catch_unwind(AssertUnwindSafe(|| {
        if size < 0 {
            return Err((format!("cannot allocate a negative size ({size} bytes)"), false, false));
        }
        let a = allocator(device).map_err(|e| (e, false, false))?;
        // Taken before the allocator's lock: waiting for the GIL must hold nothing of ours.
        let stack = stacks::for_alloc();
        let malloc = || match a.malloc_async(size as usize, StreamHandle(stream as u64)) {
            Err(Error::StreamCapture { .. }) if pool_mode => a.malloc_for_graph(size as usize),
            r => r,
        };
        let r = if stack == 0 { malloc() } else { history::with_context(stack, malloc) };
        if let (Ok(p), true) = (&r, stack != 0) {
            stacks::note_live(device as usize, *p, stack);
        }
        r.map_err(|e| {
            let capture = matches!(e, Error::StreamCapture { .. });
            (format!("device {device}: {e}"), is_oom(&e), capture)
        })
    }));
    match r {
        Ok(Ok(p)) => p as *mut c_void,
        Ok(Err((msg, oom, capture))) => {
            if capture && pool_mode {
                let _ = catch_unwind(|| {
                    eprintln!("moonbright: {msg} (PyTorch reports this as out of memory)")
                });
            }
            set_last_error(msg, oom);
            std::ptr::null_mut()
        }
        Err(p) => {
            set_last_error(format!("internal error (panic): {}", panic_message(&*p)), false);
            std::ptr::null_mut()
        }
    }
}

/// Frees `ptr` on `device`, stream-ordered on `stream`. A null pointer is ignored; an error
/// (an unknown pointer, say) is printed to stderr and left for `moonbright.last_error()`:
/// PyTorch's deleters cannot report one.
#[no_mangle]
pub extern "C" fn moonbright_free(
    ptr: *mut c_void,
    size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    let _ = size;
    if ptr.is_null() {
        return;
    }
    let r = catch_unwind(AssertUnwindSafe(|| {
        let a = allocator(device)?;
        // Forgotten before the free: once freed, another thread may get the same address and
        // note its own frames there.
        stacks::forget_live(device as usize, ptr as u64);
        let free = || a.free_async(ptr as u64, StreamHandle(stream as u64));
        match stacks::for_free() {
            0 => free(),
            stack => history::with_context(stack, free),
        }
        .map_err(|e| format!("device {device}: {e}"))?;
        Ok(())
    }));
    let msg = match r {
        Ok(Ok(())) => return,
        Ok(Err(msg)) => msg,
        Err(p) => format!("internal error (panic): {}", panic_message(&*p)),
    };
    let _ = catch_unwind(|| eprintln!("moonbright: free failed: {msg}"));
    set_last_error(msg, false);
}

/// Copies the last error message into `buf` (at most `len - 1` bytes and a NUL) and returns its
/// full length in bytes. With a null `buf`, only the length.
///
/// # Safety
///
/// `buf` is null or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn moonbright_last_error_copy(buf: *mut c_char, len: usize) -> usize {
    catch_unwind(|| {
        let g = lock(&LAST_ERROR);
        let msg = g.as_ref().map(|(m, _)| m.as_bytes()).unwrap_or(b"");
        if !buf.is_null() && len > 0 {
            let n = msg.len().min(len - 1);
            // SAFETY: the caller gives `len` writable bytes at `buf`; n + 1 <= len.
            unsafe {
                std::ptr::copy_nonoverlapping(msg.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
        }
        msg.len()
    })
    .unwrap_or(0)
}

/// 1 when the last error was out of memory, else 0.
#[no_mangle]
pub extern "C" fn moonbright_last_error_is_oom() -> c_int {
    catch_unwind(|| lock(&LAST_ERROR).as_ref().is_some_and(|(_, oom)| *oom) as c_int).unwrap_or(0)
}

extern "C-unwind" {
    fn moonbright_cxx_torch_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void;
}

/// `moonbright_alloc` for PyTorch's global allocator: on failure it throws a C++ exception that
/// PyTorch raises in Python (torch.OutOfMemoryError on out of memory, once
/// `moonbright.torch.enable()` has set that up), instead of returning null, which PyTorch's
/// CUDAPluggableAllocator would hand out as a tensor's data pointer. Never call it from
/// anything but C++ that catches exceptions.
#[no_mangle]
#[allow(clippy::not_unsafe_ptr_arg_deref)] // `stream` is an opaque handle, never dereferenced
pub extern "C-unwind" fn moonbright_torch_alloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // SAFETY: a plain C++ function; the exception it may throw unwinds through this frame,
    // which owns nothing, to PyTorch's C++ caller (the "C-unwind" ABI allows it).
    unsafe { moonbright_cxx_torch_alloc(size, device, stream) }
}
