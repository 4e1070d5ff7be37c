//! Which context the CUDA backend's calls run under: the device's primary context, entered for
//! each call and left as the thread had it (or once for a batch of calls), the stream-capture
//! mode relaxed around calls that could otherwise break another thread's capture, and the
//! device a thread's current context belongs to.

use std::cell::Cell;
use std::panic::catch_unwind;
use std::ptr;

use cudarc::driver::sys;

use super::load::{check, missing_symbols};
use super::CudaDriver;
use crate::driver::{CallKind, DriverResult};

/// Runs `call` with the calling thread's stream-capture mode set to relaxed, then restores it.
///
/// While any thread captures a stream into a graph in the default *global* mode (PyTorch's
/// `torch.cuda.graph` does), a "potentially unsafe" call from any other thread in the default
/// mode fails and invalidates that capture. MoonBright's virtual-memory calls and event
/// queries are such calls to the driver, yet they touch no stream being captured: no captured
/// work uses memory being mapped, unmapped or released, and the events are recorded outside
/// any capture. Measured on the H200 before the switch: a thread allocating beside a
/// global-mode capture invalidated it, and the worker's calls failed over 2,000 times. The
/// mode is per thread, so this changes nothing for the caller's own calls. A failure to switch
/// is ignored: the call then runs in the thread's own mode, as before.
///
/// Inside a batch (`VirtualMemory::begin_batch`) that switched the mode already, it just runs `call`.
pub(super) fn relaxed<T>(call: impl FnOnce() -> T) -> T {
    if BATCH.with(|b| b.get().is_some_and(|b| b.mode.is_some())) {
        return call();
    }
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid in/out pointer; the driver swaps the thread's mode into it.
    let swapped =
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) } == sys::CUresult::CUDA_SUCCESS;
    let out = call();
    if swapped {
        // SAFETY: as above; `mode` now holds the thread's earlier mode, which this restores.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
    out
}

/// A batch of calls open on this thread (`VirtualMemory::begin_batch`): the context it made current,
/// whether it pushed it, and the capture mode it replaced with relaxed (`None`: the switch
/// failed, and each call tries for itself).
#[derive(Clone, Copy)]
pub(super) struct OpenBatch {
    pub(super) ctx: sys::CUcontext,
    pub(super) pushed: bool,
    pub(super) mode: Option<sys::CUstreamCaptureMode>,
}

thread_local! {
    pub(super) static BATCH: Cell<Option<OpenBatch>> = const { Cell::new(None) };
}

/// The primary context of a device.
#[derive(Clone, Copy, Debug)]
pub(super) struct PrimaryContext(pub(super) sys::CUcontext);

/// The context [`CudaDriver::enter`] (or [`CudaDriver::context_scope`]) pushed, popped when the
/// scope ends.
#[must_use = "the context is popped when the scope is dropped"]
pub struct CtxScope {
    pub(super) pushed: bool,
}

impl Drop for CtxScope {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped: sys::CUcontext = ptr::null_mut();
            // SAFETY: `enter` pushed a context on this thread and nothing since has popped it
            // (the scope lives within one call on one thread); `popped` is a valid out-pointer.
            unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        }
    }
}

/// The calling thread's current context (null when none is).
fn current_context(kind: CallKind) -> DriverResult<sys::CUcontext> {
    let mut cur: sys::CUcontext = ptr::null_mut();
    // SAFETY: `cur` is a valid out-pointer.
    let r = unsafe { sys::cuCtxGetCurrent(&mut cur) };
    check(kind, r, || "cuCtxGetCurrent()".into())?;
    Ok(cur)
}

/// The device of the calling thread's current CUDA context, if a context is current: the
/// device a CUDA runtime user (PyTorch's `torch.cuda.current_device()`) has selected on this
/// thread. `None` without libcuda, before `cuInit`, or with no current context. Never panics.
pub fn current_device() -> Option<i32> {
    // Without libcuda, every symbol is missing.
    if !missing_symbols(&["cuCtxGetCurrent", "cuCtxGetDevice"]).is_empty() {
        return None;
    }
    catch_unwind(|| {
        let ctx = current_context(CallKind::MemInfo).ok()?;
        if ctx.is_null() {
            return None;
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer; a context is current on this thread.
        let r = unsafe { sys::cuCtxGetDevice(&mut device) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer; cuInit has run (a context exists).
        if unsafe { sys::cuDeviceGetCount(&mut count) } != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        (0..count).find(|&i| {
            let mut d: sys::CUdevice = -1;
            // SAFETY: `d` is a valid out-pointer; `i` is in range.
            let r = unsafe { sys::cuDeviceGet(&mut d, i) };
            r == sys::CUresult::CUDA_SUCCESS && d == device
        })
    })
    .ok()
    .flatten()
}

// SAFETY: a `CUcontext` is an opaque handle the driver accepts from any thread; a primary context
// in particular may be made current on, and used from, any number of threads at once (that is
// what the runtime API does with it). We never dereference the pointer, and the retain/release
// pair in `CudaDriver::new`/`Drop` keeps it alive while the handle exists.
unsafe impl Send for PrimaryContext {}
// SAFETY: as for `Send`: shared use from several threads is what the driver API supports for a
// primary context; the wrapper exposes nothing but the handle's value.
unsafe impl Sync for PrimaryContext {}

impl CudaDriver {
    /// Makes the device's primary context current on the calling thread, and leaves it so: for
    /// MoonBright's own threads (the worker) and callers that want it so. Cheap when it is
    /// current already. A user's thread wants [`CudaDriver::context_scope`] instead.
    pub fn bind_context(&self) -> DriverResult<()> {
        let kind = CallKind::MemInfo;
        if current_context(kind)? == self.ctx.0 {
            return Ok(());
        }
        let ctx = self.ctx.0;
        // SAFETY: `ctx` is the primary context retained by `new` and not yet released.
        let r = unsafe { sys::cuCtxSetCurrent(ctx) };
        check(kind, r, || format!("cuCtxSetCurrent(ctx={ctx:p})"))
    }

    /// Makes the device's primary context current until the returned scope is dropped, then
    /// restores the thread's own (as every MoonBright call does): for callers that make
    /// context-bound calls of their own on a user's thread, such as the paged pool's launches.
    pub fn context_scope(&self) -> DriverResult<CtxScope> {
        self.enter(CallKind::MemInfo)
    }

    /// Runs the rest of a call under this device's primary context, and leaves the calling
    /// thread's own current context as it was: when another context (or none) is current, ours
    /// is pushed, and the returned scope pops it. The caller's current device is theirs: PyTorch
    /// reads its current device from the current context, so setting ours for good on a thread
    /// that frees a tensor of another GPU would move the thread's later tensors to that GPU.
    /// Failures are reported as `kind`, the call that needed the context.
    #[inline]
    pub(super) fn enter(&self, kind: CallKind) -> DriverResult<CtxScope> {
        let ctx = self.ctx.0;
        if BATCH.with(|b| b.get().is_some_and(|b| b.ctx == ctx)) || current_context(kind)? == ctx {
            return Ok(CtxScope { pushed: false });
        }
        // SAFETY: `ctx` is the primary context retained by `new` and not yet released.
        let r = unsafe { sys::cuCtxPushCurrent_v2(ctx) };
        check(kind, r, || format!("cuCtxPushCurrent_v2(ctx={ctx:p})"))?;
        Ok(CtxScope { pushed: true })
    }
}
