//! The CUDA backend: [`CudaDriver`] implements [`Driver`] on the CUDA virtual-memory API through
//! cudarc's `sys` layer (libcuda loaded at run time). It owns the device's primary context (and
//! which context each call runs under), the peers granted access, and the conversion of every
//! `CUresult` into a [`DriverError`].

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
// Not `crate::sync`: the CUDA backend is never run under loom.
use std::sync::Mutex;

use cudarc::driver::sys;

use super::{
    code, Batch, CallKind, ChunkHandle, DevicePtr, Driver, DriverError, DriverResult, EventHandle,
    MemInfo, SharedChunk, StreamHandle,
};

/// `CUDA_ERROR_INVALID_DEVICE`, for an ordinal outside `0..device_count`.
const INVALID_DEVICE: i32 = sys::CUresult::CUDA_ERROR_INVALID_DEVICE as i32;

/// Every libcuda symbol this file calls, checked once in [`CudaDriver::new`] so that a driver too
/// old to have one gives an error there instead of a panic (cudarc's lazy loader panics on a
/// missing symbol) in the middle of a later call.
const REQUIRED_SYMBOLS: [&str; 36] = [
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxGetDevice",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemGetAllocationGranularity",
    "cuMemGetInfo_v2",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuEventSynchronize",
    "cuStreamIsCapturing",
    "cuStreamGetCaptureInfo_v2",
    "cuThreadExchangeStreamCaptureMode",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
];

/// The shareable handle MoonBright asks `cuMemCreate` for, and exports: a POSIX file descriptor,
/// which another process receives over a Unix socket (`ipc`).
const FD_HANDLE: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

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
/// Inside a batch (`Driver::begin_batch`) that switched the mode already, it just runs `call`.
fn relaxed<T>(call: impl FnOnce() -> T) -> T {
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

/// The names among `symbols` that libcuda lacks (all of them when there is no libcuda): cudarc
/// resolves each symbol at its first call and panics if it is missing, so callers check first.
pub fn missing_symbols<'a>(symbols: &[&'a str]) -> Vec<&'a str> {
    if !crate::libs::libcuda_present() {
        return symbols.to_vec();
    }
    symbols
        .iter()
        .copied()
        .filter(|name| {
            // SAFETY: the library is present (checked above), so `culib` returns it; `get` only
            // looks the name up (dlsym) and the symbol is dropped unused.
            let found = unsafe { sys::culib().get::<unsafe extern "C" fn()>(name.as_bytes()) };
            found.is_err()
        })
        .collect()
}

/// The name and description of a `CUresult`, from `cuGetErrorName` / `cuGetErrorString`
/// (public for tools that make driver calls of their own, such as the benchmarks).
pub fn describe(result: sys::CUresult) -> String {
    let lookup = |f: unsafe fn(sys::CUresult, *mut *const std::ffi::c_char) -> sys::CUresult| {
        let mut s: *const std::ffi::c_char = ptr::null();
        // SAFETY: `s` is a valid out-pointer; on success the driver points it at a static,
        // NUL-terminated string that lives as long as the library stays loaded (for good: cudarc
        // never unloads it).
        unsafe {
            if f(result, &mut s) == sys::CUresult::CUDA_SUCCESS && !s.is_null() {
                Some(CStr::from_ptr(s).to_string_lossy().into_owned())
            } else {
                None
            }
        }
    };
    let name = lookup(sys::cuGetErrorName).unwrap_or_else(|| format!("{result:?}"));
    match lookup(sys::cuGetErrorString) {
        Some(text) => format!("{name} ({text})"),
        None => name,
    }
}

/// The one conversion from `CUresult` to [`DriverResult`]: success is `Ok`, anything else a
/// [`DriverError`] of `kind` carrying the code and `"<call>(<args>) -> <NAME> (<description>)"`.
/// `call` is formatted only on failure.
fn check(kind: CallKind, result: sys::CUresult, call: impl FnOnce() -> String) -> DriverResult<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(DriverError::new(kind, result as i32, format!("{} -> {}", call(), describe(result))))
}

/// Whether a usable CUDA driver and at least one device are present: the device count, or why
/// not. Never panics.
pub fn probe() -> Result<i32, String> {
    let outcome = catch_unwind(|| {
        if !crate::libs::libcuda_present() {
            return Err(no_libcuda());
        }
        // SAFETY: cuInit takes flags by value; the library is present (checked above).
        check(CallKind::MemInfo, unsafe { sys::cuInit(0) }, || "cuInit(0)".into())
            .map_err(|e| e.message)?;
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer; cuInit has succeeded.
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        check(CallKind::MemInfo, r, || "cuDeviceGetCount()".into()).map_err(|e| e.message)?;
        if count < 1 {
            return Err("libcuda loaded but it reports no CUDA device".into());
        }
        Ok(count)
    });
    outcome.unwrap_or_else(|p| Err(format!("probing libcuda panicked: {}", panic_text(&p))))
}

/// The message for "there is no libcuda to load".
fn no_libcuda() -> String {
    let mut names = cudarc::get_lib_name_candidates("cuda");
    names.sort();
    names.dedup();
    format!(
        "libcuda not found (no NVIDIA driver installed, or not on the loader path); tried {}",
        names.join(", ")
    )
}

/// The text of a caught panic payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

/// A batch of calls open on this thread (`Driver::begin_batch`): the context it made current,
/// whether it pushed it, and the capture mode it replaced with relaxed (`None`: the switch
/// failed, and each call tries for itself).
#[derive(Clone, Copy)]
struct OpenBatch {
    ctx: sys::CUcontext,
    pushed: bool,
    mode: Option<sys::CUstreamCaptureMode>,
}

thread_local! {
    static BATCH: Cell<Option<OpenBatch>> = const { Cell::new(None) };
}

/// The primary context of a device.
#[derive(Clone, Copy, Debug)]
struct PrimaryContext(sys::CUcontext);

/// The context [`CudaDriver::enter`] (or [`CudaDriver::context_scope`]) pushed, popped when the
/// scope ends.
#[must_use = "the context is popped when the scope is dropped"]
pub struct CtxScope {
    pushed: bool,
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

/// The CUDA backend for one device: its primary context (retained for the driver's life) and the
/// physical-memory granularity of device-pinned allocations.
#[derive(Debug)]
pub struct CudaDriver {
    ordinal: i32,
    cu_device: sys::CUdevice,
    ctx: PrimaryContext,
    granularity: usize,
    /// Other devices `set_access` grants access to, beside this one (`Driver::set_peers`).
    peers: Mutex<Vec<i32>>,
    /// Whether `create_chunk` asks for chunks that can be exported (`set_shareable`); turned
    /// off for good by the first create the driver refuses for it.
    shareable: AtomicBool,
    /// The descriptor of each chunk exported so far, until its release: an export costs
    /// `cuMemExportToShareableHandle` (about 850 µs on an H200) the first time and a `dup`
    /// after. Emptied of a handle by its release, since the driver may reuse the value.
    exported: Mutex<HashMap<u64, OwnedFd>>,
    /// Whether `exported` may hold anything, so that a release looks only then.
    any_exported: AtomicBool,
    /// Releases completed so far: an export keeps its descriptor only if no release completed
    /// while it ran, since the handle it exported may be one of them.
    releases: std::sync::atomic::AtomicU64,
}

/// Descriptors `CudaDriver::exported` keeps at most (they count against the process's limit on
/// open files, often 1,024); past it, exports are not kept.
const EXPORTS_KEPT: usize = 256;

// Every method is usable from any thread (the primary context is made current on demand).
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<CudaDriver>();
};

impl CudaDriver {
    /// Opens device `device_ordinal`: `cuInit(0)`, `cuDeviceGet`, `cuDevicePrimaryCtxRetain`, and
    /// the minimum mapping granularity of device-pinned memory. Fails (never panics) when libcuda
    /// is missing or too old, there is no device, or the ordinal is out of range. Errors raised
    /// before any memory call carry [`CallKind::MemInfo`] (the contract has no set-up kind).
    pub fn new(device_ordinal: i32) -> DriverResult<Self> {
        let setup = |code: i32, message: String| DriverError::new(CallKind::MemInfo, code, message);
        // Checked before any other cudarc call, each of which would panic without the library.
        if !crate::libs::libcuda_present() {
            return Err(setup(code::NOT_INITIALIZED, no_libcuda()));
        }
        match catch_unwind(AssertUnwindSafe(|| Self::open(device_ordinal))) {
            Ok(result) => result,
            Err(p) => Err(setup(
                code::NOT_INITIALIZED,
                format!("opening CUDA device {device_ordinal} panicked: {}", panic_text(&p)),
            )),
        }
    }

    /// The body of [`CudaDriver::new`], once libcuda is known to load.
    fn open(ordinal: i32) -> DriverResult<Self> {
        let kind = CallKind::MemInfo;
        let missing = missing_symbols(&REQUIRED_SYMBOLS);
        if !missing.is_empty() {
            return Err(DriverError::new(
                kind,
                code::NOT_SUPPORTED,
                format!("libcuda lacks {missing:?}: the NVIDIA driver is too old (CUDA 12.2 or later needed)"),
            ));
        }
        // SAFETY: every symbol is present (checked above); cuInit takes flags by value.
        check(kind, unsafe { sys::cuInit(0) }, || "cuInit(0)".into())?;
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer.
        check(kind, unsafe { sys::cuDeviceGetCount(&mut count) }, || "cuDeviceGetCount()".into())?;
        if count < 1 {
            return Err(DriverError::new(
                kind,
                code::NO_DEVICE,
                "libcuda loaded but it reports no CUDA device",
            ));
        }
        if !(0..count).contains(&ordinal) {
            return Err(DriverError::new(
                kind,
                INVALID_DEVICE,
                format!(
                    "CUDA device ordinal {ordinal} out of range: {count} device(s), 0..{count}"
                ),
            ));
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer; the ordinal is in range.
        let r = unsafe { sys::cuDeviceGet(&mut device, ordinal) };
        check(kind, r, || format!("cuDeviceGet(ordinal={ordinal})"))?;
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; `device` came from cuDeviceGet.
        let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) };
        check(kind, r, || format!("cuDevicePrimaryCtxRetain(device={device})"))?;
        // From here on, dropping `driver` releases the retain, on the error paths too.
        let mut driver = CudaDriver {
            ordinal,
            cu_device: device,
            ctx: PrimaryContext(ctx),
            granularity: 0,
            peers: Mutex::new(Vec::new()),
            shareable: AtomicBool::new(false),
            exported: Mutex::new(HashMap::new()),
            any_exported: AtomicBool::new(false),
            releases: std::sync::atomic::AtomicU64::new(0),
        };
        let _ctx = driver.enter(kind)?;
        let prop = driver.allocation_prop();
        let mut granularity = 0usize;
        // SAFETY: both pointers are valid for the call; `prop` is a fully initialised
        // CUmemAllocationProp.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        check(kind, r, || format!("cuMemGetAllocationGranularity(device={ordinal}, MINIMUM)"))?;
        if !granularity.is_power_of_two() {
            return Err(DriverError::new(
                kind,
                code::NOT_SUPPORTED,
                format!("cuMemGetAllocationGranularity gave {granularity}, not a power of two"),
            ));
        }
        driver.granularity = granularity;
        Ok(driver)
    }

    /// Makes the chunks `create_chunk` makes from now on exportable (`Driver::export_chunk`), or
    /// not. If the driver refuses to create a chunk with a shareable handle (a container or a
    /// platform without POSIX file descriptor handles), the chunk is created without one and
    /// sharing stays off.
    pub fn set_shareable(&self, on: bool) {
        self.shareable.store(on, Ordering::Relaxed);
    }

    /// Drops the descriptor kept for `handle`'s export, if any.
    fn forget_export(&self, handle: ChunkHandle) {
        if self.any_exported.load(Ordering::SeqCst) {
            self.exported.lock().unwrap_or_else(|e| e.into_inner()).remove(&handle.0);
        }
    }

    /// The device ordinal this driver serves.
    pub fn device(&self) -> i32 {
        self.ordinal
    }

    /// The device's primary context (retained for as long as this driver lives).
    pub fn context(&self) -> sys::CUcontext {
        self.ctx.0
    }

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
    fn enter(&self, kind: CallKind) -> DriverResult<CtxScope> {
        let ctx = self.ctx.0;
        if BATCH.with(|b| b.get().is_some_and(|b| b.ctx == ctx)) || current_context(kind)? == ctx {
            return Ok(CtxScope { pushed: false });
        }
        // SAFETY: `ctx` is the primary context retained by `new` and not yet released.
        let r = unsafe { sys::cuCtxPushCurrent_v2(ctx) };
        check(kind, r, || format!("cuCtxPushCurrent_v2(ctx={ctx:p})"))?;
        Ok(CtxScope { pushed: true })
    }

    /// Device-pinned memory on this device, every other field zero.
    fn allocation_prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: CUmemAllocationProp is a plain C struct of integers, an enum whose zero value is
        // a declared variant (CU_MEM_*_INVALID / no handle type), a raw pointer and bytes: all
        // zeroes is a valid value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = self.location();
        prop
    }

    /// This device, as a memory location.
    fn location(&self) -> sys::CUmemLocation {
        device_location(self.ordinal)
    }
}

/// Device `ordinal`, as a memory location.
fn device_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        let device = self.cu_device;
        // SAFETY: `new` retained this device's primary context exactly once for this driver; this
        // is the matching release. The symbol was checked present in `new`, and a panic (which
        // should not happen) is caught so that drop never unwinds.
        let _ = catch_unwind(|| unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) });
    }
}

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn mem_info(&self) -> DriverResult<MemInfo> {
        let kind = CallKind::MemInfo;
        let _ctx = self.enter(kind)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers; a context is current.
        let r = relaxed(|| unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) });
        check(kind, r, || "cuMemGetInfo_v2()".into())?;
        Ok(MemInfo { free: free as u64, total: total as u64 })
    }

    fn reserve(&self, size: usize, alignment: usize) -> DriverResult<DevicePtr> {
        let kind = CallKind::Reserve;
        let _ctx = self.enter(kind)?;
        let alignment = if alignment == 0 { self.granularity } else { alignment };
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: `va` is a valid out-pointer; the driver checks sizes and alignment.
        let r = relaxed(|| unsafe { sys::cuMemAddressReserve(&mut va, size, alignment, 0, 0) });
        check(kind, r, || {
            format!("cuMemAddressReserve(size={size:#x}, alignment={alignment:#x})")
        })?;
        Ok(va)
    }

    fn free_reservation(&self, base: DevicePtr, size: usize) -> DriverResult<()> {
        let kind = CallKind::FreeReservation;
        let _ctx = self.enter(kind)?;
        // SAFETY: plain values; the driver validates that they name a reservation.
        let r = relaxed(|| unsafe { sys::cuMemAddressFree(base, size) });
        check(kind, r, || format!("cuMemAddressFree(va={base:#x}, size={size:#x})"))
    }

    fn create_chunk(&self, size: usize) -> DriverResult<ChunkHandle> {
        let kind = CallKind::Create;
        let _ctx = self.enter(kind)?;
        let mut prop = self.allocation_prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let shareable = self.shareable.load(Ordering::Relaxed);
        if shareable {
            prop.requestedHandleTypes = FD_HANDLE;
        }
        // SAFETY: `handle` is a valid out-pointer and `prop` a fully initialised struct.
        let mut r = relaxed(|| unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) });
        use sys::CUresult::{CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED};
        if shareable && matches!(r, CUDA_ERROR_NOT_SUPPORTED | CUDA_ERROR_NOT_PERMITTED) {
            // No POSIX file descriptor handles here: chunks are made without, as they would be
            // with sharing off, and exports fail with NOT_SUPPORTED.
            self.shareable.store(false, Ordering::Relaxed);
            prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
            // SAFETY: as above.
            r = relaxed(|| unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) });
        }
        check(kind, r, || format!("cuMemCreate(size={size:#x}, device={})", self.ordinal))?;
        Ok(ChunkHandle(handle))
    }

    fn release_chunk(&self, handle: ChunkHandle) -> DriverResult<()> {
        let kind = CallKind::Release;
        // The handle's kept descriptor goes before the release (the driver may give the value
        // to a new chunk as soon as it returns) and, should an export have kept one meanwhile,
        // after it too. `releases` counts up in between: an export that ran across this
        // release keeps nothing (`export_chunk`).
        self.forget_export(handle);
        let _ctx = self.enter(kind)?;
        // SAFETY: a plain value; the driver validates the handle.
        let r = relaxed(|| unsafe { sys::cuMemRelease(handle.0) });
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.forget_export(handle);
        check(kind, r, || format!("cuMemRelease(handle={:#x})", handle.0))
    }

    fn map(&self, va: DevicePtr, size: usize, handle: ChunkHandle) -> DriverResult<()> {
        let kind = CallKind::Map;
        let _ctx = self.enter(kind)?;
        // SAFETY: plain values; the driver validates that `va` lies in a reservation and that the
        // handle and size match. Mapping only changes device page tables, not host memory.
        let r = relaxed(|| unsafe { sys::cuMemMap(va, size, 0, handle.0, 0) });
        check(kind, r, || format!("cuMemMap(va={va:#x}, size={size:#x}, handle={:#x})", handle.0))
    }

    fn set_access(&self, va: DevicePtr, size: usize) -> DriverResult<()> {
        let kind = CallKind::SetAccess;
        let _ctx = self.enter(kind)?;
        let rw = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        let desc = |id| sys::CUmemAccessDesc { location: device_location(id), flags: rw };
        let descs: Vec<sys::CUmemAccessDesc> = std::iter::once(self.ordinal)
            .chain(self.peers.lock().unwrap_or_else(|e| e.into_inner()).iter().copied())
            .map(desc)
            .collect();
        // SAFETY: `descs` holds `descs.len()` valid descriptors for the whole call.
        let r = relaxed(|| unsafe { sys::cuMemSetAccess(va, size, descs.as_ptr(), descs.len()) });
        check(kind, r, || {
            let devices: Vec<i32> = descs.iter().map(|d| d.location.id).collect();
            format!("cuMemSetAccess(va={va:#x}, size={size:#x}, devices={devices:?}, RW)")
        })
    }

    fn set_peers(&self, peers: &[i32]) -> DriverResult<()> {
        let kind = CallKind::PeerAccess;
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer; cuInit ran in `new`.
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        check(kind, r, || "cuDeviceGetCount()".into())?;
        for &peer in peers {
            if peer == self.ordinal || !(0..count).contains(&peer) {
                return Err(DriverError::new(
                    kind,
                    INVALID_DEVICE,
                    format!(
                        "device {peer} cannot be a peer of device {}: {count} device(s), and a \
                         device is not its own peer",
                        self.ordinal
                    ),
                ));
            }
            let mut dev: sys::CUdevice = 0;
            // SAFETY: `dev` is a valid out-pointer; the ordinal is in range.
            let r = unsafe { sys::cuDeviceGet(&mut dev, peer) };
            check(kind, r, || format!("cuDeviceGet(ordinal={peer})"))?;
            let mut can = 0;
            // SAFETY: `can` is a valid out-pointer; both devices came from cuDeviceGet.
            let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, self.cu_device) };
            check(kind, r, || {
                format!("cuDeviceCanAccessPeer(device={peer}, peer={})", self.ordinal)
            })?;
            if can == 0 {
                return Err(DriverError::new(
                    kind,
                    code::NOT_SUPPORTED,
                    format!(
                        "cuDeviceCanAccessPeer: device {peer} cannot access device {}'s memory \
                         directly (no peer-to-peer path between them)",
                        self.ordinal
                    ),
                ));
            }
        }
        *self.peers.lock().unwrap_or_else(|e| e.into_inner()) = peers.to_vec();
        Ok(())
    }

    fn bind_thread(&self) -> DriverResult<()> {
        self.bind_context()
    }

    /// Makes the context current and the capture mode relaxed once for the batch, instead of a
    /// `cuCtxGetCurrent` and two `cuThreadExchangeStreamCaptureMode` calls around every call
    /// (`enter`, `relaxed`). If the context cannot be entered, no batch begins and each call
    /// does its own set-up (and reports its failure), as outside a batch.
    fn begin_batch(&self) -> Batch {
        if BATCH.with(|b| b.get().is_some()) {
            return Batch(false);
        }
        let Ok(scope) = self.enter(CallKind::MemInfo) else {
            return Batch(false);
        };
        // `end_batch` pops what this pushed.
        let pushed = scope.pushed;
        std::mem::forget(scope);
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out pointer; the driver swaps the thread's mode into it.
        let swapped = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
            == sys::CUresult::CUDA_SUCCESS;
        let open = OpenBatch { ctx: self.ctx.0, pushed, mode: swapped.then_some(mode) };
        BATCH.with(|b| b.set(Some(open)));
        Batch(true)
    }

    fn end_batch(&self, batch: Batch) {
        if !batch.0 {
            return;
        }
        let Some(open) = BATCH.with(|b| b.take()) else {
            return;
        };
        if let Some(mut mode) = open.mode {
            // SAFETY: as in `begin_batch`; this restores the thread's earlier mode.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
        drop(CtxScope { pushed: open.pushed });
    }

    fn unmap(&self, va: DevicePtr, size: usize) -> DriverResult<()> {
        let kind = CallKind::Unmap;
        let _ctx = self.enter(kind)?;
        // SAFETY: plain values; the driver validates that the range is whole mappings.
        let r = relaxed(|| unsafe { sys::cuMemUnmap(va, size) });
        check(kind, r, || format!("cuMemUnmap(va={va:#x}, size={size:#x})"))
    }

    fn write(&self, dst: DevicePtr, src: &[u8]) -> DriverResult<()> {
        if src.is_empty() {
            return Ok(());
        }
        let kind = CallKind::Copy;
        let _ctx = self.enter(kind)?;
        let len = src.len();
        // SAFETY: `src` is valid for reads of `len` bytes for the whole (synchronous) copy; the
        // driver validates the device range.
        let r = unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast::<c_void>(), len) };
        check(kind, r, || format!("cuMemcpyHtoD_v2(dst={dst:#x}, bytes={len:#x})"))
    }

    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> DriverResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let kind = CallKind::Copy;
        let _ctx = self.enter(kind)?;
        let len = dst.len();
        // SAFETY: `dst` is valid for writes of `len` bytes, borrowed exclusively for the whole
        // (synchronous) copy; any byte pattern is a valid u8. The driver validates the source.
        let r = unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src, len) };
        check(kind, r, || format!("cuMemcpyDtoH_v2(src={src:#x}, bytes={len:#x})"))
    }

    fn create_stream(&self) -> DriverResult<StreamHandle> {
        let kind = CallKind::StreamCreate;
        let _ctx = self.enter(kind)?;
        let mut stream: sys::CUstream = ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: `stream` is a valid out-pointer; a context is current.
        let r = unsafe { sys::cuStreamCreate(&mut stream, flags) };
        check(kind, r, || "cuStreamCreate(NON_BLOCKING)".into())?;
        Ok(StreamHandle(stream as u64))
    }

    fn destroy_stream(&self, stream: StreamHandle) -> DriverResult<()> {
        let kind = CallKind::StreamDestroy;
        if stream == StreamHandle::DEFAULT {
            return Err(DriverError::new(
                kind,
                code::INVALID_HANDLE,
                "cuStreamDestroy_v2(stream=0x0): the default stream cannot be destroyed",
            ));
        }
        let _ctx = self.enter(kind)?;
        // SAFETY: the handle came from `create_stream` (the driver rejects stale ones it can
        // detect); it is only passed back to the driver.
        let r = unsafe { sys::cuStreamDestroy_v2(stream.0 as sys::CUstream) };
        check(kind, r, || format!("cuStreamDestroy_v2(stream={:#x})", stream.0))
    }

    fn create_event(&self) -> DriverResult<EventHandle> {
        let kind = CallKind::EventCreate;
        let _ctx = self.enter(kind)?;
        let mut event: sys::CUevent = ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `event` is a valid out-pointer; a context is current.
        let r = relaxed(|| unsafe { sys::cuEventCreate(&mut event, flags) });
        check(kind, r, || "cuEventCreate(DISABLE_TIMING)".into())?;
        Ok(EventHandle(event as u64))
    }

    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> DriverResult<()> {
        let kind = CallKind::EventRecord;
        let _ctx = self.enter(kind)?;
        // SAFETY: the handles came from `create_event` / `create_stream` (or are the null
        // stream); they are only passed back to the driver.
        let r = unsafe { sys::cuEventRecord(event.0 as sys::CUevent, stream.0 as sys::CUstream) };
        check(kind, r, || format!("cuEventRecord(event={:#x}, stream={:#x})", event.0, stream.0))
    }

    fn event_done(&self, event: EventHandle) -> DriverResult<bool> {
        let kind = CallKind::EventQuery;
        let _ctx = self.enter(kind)?;
        // SAFETY: the handle came from `create_event`; it is only passed back to the driver.
        let r = relaxed(|| unsafe { sys::cuEventQuery(event.0 as sys::CUevent) });
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(kind, r, || format!("cuEventQuery(event={:#x})", event.0))?;
        Ok(true)
    }

    fn destroy_event(&self, event: EventHandle) -> DriverResult<()> {
        let kind = CallKind::EventDestroy;
        let _ctx = self.enter(kind)?;
        // SAFETY: the handle came from `create_event`; it is only passed back to the driver.
        let r = relaxed(|| unsafe { sys::cuEventDestroy_v2(event.0 as sys::CUevent) });
        check(kind, r, || format!("cuEventDestroy_v2(event={:#x})", event.0))
    }

    fn synchronize_event(&self, event: EventHandle) -> DriverResult<()> {
        let kind = CallKind::EventSynchronize;
        let _ctx = self.enter(kind)?;
        // SAFETY: the handle came from `create_event`; it is only passed back to the driver.
        let r = relaxed(|| unsafe { sys::cuEventSynchronize(event.0 as sys::CUevent) });
        check(kind, r, || format!("cuEventSynchronize(event={:#x})", event.0))
    }

    fn is_capturing(&self, stream: StreamHandle) -> DriverResult<bool> {
        let kind = CallKind::StreamIsCapturing;
        let _ctx = self.enter(kind)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the stream is the caller's (or null for the default stream) and `status` is a
        // valid out-pointer for the duration of the call.
        let r = unsafe { sys::cuStreamIsCapturing(stream.0 as sys::CUstream, &mut status) };
        check(kind, r, || format!("cuStreamIsCapturing(stream={:#x})", stream.0))?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn capture_id(&self, stream: StreamHandle) -> DriverResult<Option<u64>> {
        let kind = CallKind::StreamIsCapturing;
        let _ctx = self.enter(kind)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        // SAFETY: the stream is the caller's (or null for the default stream); `status` and `id`
        // are valid out-pointers for the call, and the optional outputs are null, as allowed.
        let r = unsafe {
            let s = stream.0 as sys::CUstream;
            let (graph, deps, n) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
            sys::cuStreamGetCaptureInfo_v2(s, &mut status, &mut id, graph, deps, n)
        };
        check(kind, r, || format!("cuStreamGetCaptureInfo_v2(stream={:#x})", stream.0))?;
        let active = status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE;
        Ok(active.then_some(id))
    }

    fn export_chunk(&self, handle: ChunkHandle, size: usize) -> DriverResult<SharedChunk> {
        let kind = CallKind::Export;
        let dup = |fd: &OwnedFd| {
            fd.try_clone().map_err(|e| {
                DriverError::new(kind, code::UNKNOWN, format!("dup of an exported descriptor: {e}"))
            })
        };
        let mut kept = self.exported.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(fd) = kept.get(&handle.0) {
            return Ok(SharedChunk { fd: dup(fd)?, offset: 0, size: size as u64 });
        }
        drop(kept);
        self.any_exported.store(true, Ordering::SeqCst);
        let releases = self.releases.load(Ordering::SeqCst);
        let _ctx = self.enter(kind)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for a POSIX file descriptor handle the out-pointer is an `int`, which `fd`
        // is; the driver validates the handle.
        let r = relaxed(|| unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle.0,
                FD_HANDLE,
                0,
            )
        });
        check(kind, r, || {
            format!("cuMemExportToShareableHandle(handle={:#x}, POSIX fd)", handle.0)
        })?;
        if fd < 0 {
            return Err(DriverError::new(
                kind,
                code::UNKNOWN,
                format!(
                    "cuMemExportToShareableHandle(handle={:#x}) gave descriptor {fd}",
                    handle.0
                ),
            ));
        }
        // SAFETY: the driver just opened `fd` for the caller, who owns it from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        kept = self.exported.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < EXPORTS_KEPT && self.releases.load(Ordering::SeqCst) == releases {
            if let Ok(copy) = dup(&fd) {
                kept.insert(handle.0, copy);
            }
        }
        Ok(SharedChunk { fd, offset: 0, size: size as u64 })
    }

    fn import_chunk(&self, shared: &SharedChunk) -> DriverResult<ChunkHandle> {
        let kind = CallKind::Import;
        if shared.offset != 0 {
            return Err(DriverError::new(
                kind,
                code::INVALID_VALUE,
                format!("a CUDA chunk starts at offset 0 of its descriptor, not {}", shared.offset),
            ));
        }
        let _ctx = self.enter(kind)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let raw = shared.fd.as_raw_fd();
        // SAFETY: `handle` is a valid out-pointer; for a POSIX file descriptor the driver reads
        // the descriptor from the pointer's value (it is not dereferenced) and does not take it.
        let r = relaxed(|| unsafe {
            sys::cuMemImportFromShareableHandle(&mut handle, raw as usize as *mut c_void, FD_HANDLE)
        });
        check(kind, r, || format!("cuMemImportFromShareableHandle(fd={raw}, POSIX fd)"))?;
        Ok(ChunkHandle(handle))
    }

    fn shareable(&self) -> bool {
        self.shareable.load(Ordering::Relaxed)
    }
}

// Not under Miri: these tests run the host backend's memfd and mmap calls (or the CUDA
// driver), which Miri cannot interpret.
#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Device 0, with the GPU-test lock, or `None` when this machine has no usable GPU (the
    /// skip counted, or a failure under `MOONBRIGHT_REQUIRE_GPU=1`: see `crate::testing`).
    fn gpu() -> Option<(crate::testing::Gpu, CudaDriver)> {
        let gpu = crate::testing::gpu()?;
        let d = CudaDriver::new(0).expect("probe found a device but CudaDriver::new(0) failed");
        Some((gpu, d))
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn no_gpu_fails_cleanly_and_bad_ordinals_are_refused() {
        match probe() {
            Err(why) => {
                assert!(!why.is_empty());
                let e = CudaDriver::new(0).expect_err("probe failed, so new must fail");
                println!("no GPU here: probe: {why}; new(0): {e}");
                assert!(!e.message.is_empty());
                assert_eq!(e.call, CallKind::MemInfo);
            }
            Ok(count) => {
                for bad in [-1, count] {
                    let e = CudaDriver::new(bad).expect_err("an out-of-range ordinal must fail");
                    assert_eq!(e.code, INVALID_DEVICE);
                    assert!(e.message.contains("out of range"), "{e}");
                }
            }
        }
    }

    #[test]
    fn granularity_and_mem_info() {
        let Some((_gpu, d)) = gpu() else { return };
        let g = d.granularity();
        assert!(g.is_power_of_two() && g >= 64 << 10, "granularity {g}");
        let info = d.mem_info().unwrap();
        assert!(info.total > 0 && info.free <= info.total, "{info:?}");
        assert_eq!(d.name(), "cuda");
        assert_eq!(d.device(), 0);
        assert!(!d.context().is_null());
    }

    /// A chunk exported (a POSIX file descriptor) and imported again shows the same bytes at a
    /// second address; a second export of it reuses the kept descriptor, and its release
    /// forgets it; without `set_shareable` an export is refused.
    #[test]
    fn exported_chunks_import_again_and_their_descriptors_are_kept_until_release() {
        let Some((_gpu, d)) = gpu() else { return };
        let g = d.granularity();
        let plain = d.create_chunk(g).unwrap();
        let e = d.export_chunk(plain, g).unwrap_err();
        assert_eq!(e.call, CallKind::Export, "{e}");
        d.release_chunk(plain).unwrap();

        d.set_shareable(true);
        let a = d.create_chunk(g).unwrap();
        assert!(d.shareable(), "the H200's driver gives POSIX file descriptor handles");
        let first = d.export_chunk(a, g).unwrap();
        let t = std::time::Instant::now();
        let second = d.export_chunk(a, g).unwrap();
        println!("second export: {:?}", t.elapsed());
        assert_ne!(first.fd.as_raw_fd(), second.fd.as_raw_fd());
        assert_eq!(d.exported.lock().unwrap().len(), 1);
        let b = d.import_chunk(&second).unwrap();
        let base = d.reserve(2 * g, 0).unwrap();
        d.map(base, g, a).unwrap();
        d.map(base + g as u64, g, b).unwrap();
        d.set_access(base, 2 * g).unwrap();
        let p = pattern(g, 33);
        d.write(base, &p).unwrap();
        let mut got = vec![0u8; g];
        d.read(base + g as u64, &mut got).unwrap();
        assert!(got == p, "the imported chunk shows other bytes");
        d.unmap(base, 2 * g).unwrap();
        d.free_reservation(base, 2 * g).unwrap();
        d.release_chunk(b).unwrap();
        d.release_chunk(a).unwrap();
        assert!(d.exported.lock().unwrap().is_empty(), "the release forgot the descriptor");
    }

    #[test]
    fn map_alias_read_write_unmap() {
        let Some((_gpu, d)) = gpu() else { return };
        let g = d.granularity();
        let g64 = g as u64;
        let base = d.reserve(3 * g, 0).unwrap();
        assert_eq!(base % g64, 0);
        let a = d.create_chunk(g).unwrap();
        let b = d.create_chunk(g).unwrap();
        d.map(base, g, a).unwrap();
        d.map(base + 2 * g64, g, b).unwrap();
        d.set_access(base, g).unwrap();
        d.set_access(base + 2 * g64, g).unwrap();

        let pa = pattern(g, 7);
        let pb = pattern(g, 101);
        d.write(base, &pa).unwrap();
        d.write(base + 2 * g64, &pb).unwrap();
        let mut got = vec![0u8; g];
        d.read(base, &mut got).unwrap();
        assert!(got == pa, "chunk a read back wrong");
        d.read(base + 2 * g64, &mut got).unwrap();
        assert!(got == pb, "chunk b read back wrong");

        // The same physical chunk at a second address shows the same bytes, both ways.
        d.map(base + g64, g, a).unwrap();
        d.set_access(base + g64, g).unwrap();
        d.read(base + g64, &mut got).unwrap();
        assert!(got == pa, "alias of chunk a shows different bytes");
        d.write(base + g64 + 100, &[0xAB; 16]).unwrap();
        let mut small = [0u8; 16];
        d.read(base + 100, &mut small).unwrap();
        assert_eq!(small, [0xAB; 16]);

        // One unmap spanning three mappings, as the contract allows.
        d.unmap(base, 3 * g).unwrap();
        d.release_chunk(a).unwrap();
        d.release_chunk(b).unwrap();
        d.free_reservation(base, 3 * g).unwrap();
    }

    #[test]
    fn released_chunk_lives_while_mapped() {
        let Some((_gpu, d)) = gpu() else { return };
        let g = d.granularity();
        let base = d.reserve(g, 0).unwrap();
        let a = d.create_chunk(g).unwrap();
        d.map(base, g, a).unwrap();
        d.set_access(base, g).unwrap();
        d.release_chunk(a).unwrap();
        let p = pattern(4096, 3);
        d.write(base, &p).unwrap();
        let mut got = vec![0u8; p.len()];
        d.read(base, &mut got).unwrap();
        assert_eq!(got, p);
        d.unmap(base, g).unwrap();
        d.free_reservation(base, g).unwrap();
    }

    #[test]
    fn event_on_fresh_stream_completes() {
        let Some((_gpu, d)) = gpu() else { return };
        let s = d.create_stream().unwrap();
        assert_ne!(s, StreamHandle::DEFAULT);
        for stream in [s, StreamHandle::DEFAULT] {
            let e = d.create_event().unwrap();
            d.record_event(e, stream).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while !d.event_done(e).unwrap() {
                assert!(Instant::now() < deadline, "event on an idle stream never completed");
                std::thread::sleep(Duration::from_millis(1));
            }
            d.destroy_event(e).unwrap();
        }
        d.destroy_stream(s).unwrap();
        let e = d.destroy_stream(StreamHandle::DEFAULT).unwrap_err();
        assert_eq!(e.call, CallKind::StreamDestroy);
    }

    #[test]
    fn errors_are_values_with_the_right_kind() {
        let Some((_gpu, d)) = gpu() else { return };
        let g = d.granularity();
        let base = d.reserve(2 * g, 0).unwrap();
        let a = d.create_chunk(g).unwrap();
        let e = d.map(base + 4096, g, a).unwrap_err();
        assert_eq!(e.call, CallKind::Map);
        assert_ne!(e.code, 0);
        assert!(e.message.starts_with("cuMemMap(va=0x"), "{e}");
        assert!(e.message.contains("CUDA_ERROR_"), "{e}");
        println!("expected error: {e}");
        let e = d.create_chunk(g + 1).unwrap_err();
        assert_eq!(e.call, CallKind::Create);
        d.release_chunk(a).unwrap();
        d.free_reservation(base, 2 * g).unwrap();
        let e = check(CallKind::Unmap, sys::CUresult::CUDA_ERROR_INVALID_VALUE, || "x()".into())
            .unwrap_err();
        assert_eq!(e.code, code::INVALID_VALUE);
        assert!(e.message.starts_with("x() -> CUDA_ERROR_INVALID_VALUE"), "{e}");
    }

    #[test]
    fn usable_from_a_thread_without_a_current_context() {
        let Some((_gpu, d)) = gpu() else { return };
        let d = std::sync::Arc::new(d);
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let d = d.clone();
                std::thread::spawn(move || {
                    let g = d.granularity();
                    let va = d.reserve(g, 0).unwrap();
                    let c = d.create_chunk(g).unwrap();
                    d.map(va, g, c).unwrap();
                    d.set_access(va, g).unwrap();
                    d.write(va, &[5; 64]).unwrap();
                    let mut got = [0u8; 64];
                    d.read(va, &mut got).unwrap();
                    assert_eq!(got, [5; 64]);
                    d.unmap(va, g).unwrap();
                    d.release_chunk(c).unwrap();
                    d.free_reservation(va, g).unwrap();
                    let s = d.create_stream().unwrap();
                    d.destroy_stream(s).unwrap();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn calls_leave_the_threads_current_context_as_they_find_it() {
        let Some((_gpu, d)) = gpu() else { return };
        let d = std::sync::Arc::new(d);
        let d2 = d.clone();
        std::thread::spawn(move || {
            assert!(current_device().is_none(), "a fresh thread has no current context");
            let g = d2.granularity();
            let va = d2.reserve(g, 0).unwrap();
            let c = d2.create_chunk(g).unwrap();
            d2.map(va, g, c).unwrap();
            d2.set_access(va, g).unwrap();
            let e = d2.create_event().unwrap();
            d2.record_event(e, StreamHandle::DEFAULT).unwrap();
            d2.synchronize_event(e).unwrap();
            d2.destroy_event(e).unwrap();
            assert!(current_device().is_none(), "a call left its context current");
            d2.bind_context().unwrap();
            assert_eq!(current_device(), Some(d2.device()), "bound for good");
            d2.unmap(va, g).unwrap();
            d2.release_chunk(c).unwrap();
            d2.free_reservation(va, g).unwrap();
            assert_eq!(current_device(), Some(d2.device()));
        })
        .join()
        .unwrap();
    }

    /// The thread's capture mode, read by swapping it with itself.
    fn capture_mode() -> sys::CUstreamCaptureMode {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
        // SAFETY: `mode` is a valid in/out pointer; the second swap puts the first's result back.
        unsafe {
            assert_eq!(
                sys::cuThreadExchangeStreamCaptureMode(&mut mode),
                sys::CUresult::CUDA_SUCCESS
            );
            let mut again = mode;
            sys::cuThreadExchangeStreamCaptureMode(&mut again);
        }
        mode
    }

    #[test]
    fn a_batch_sets_up_once_and_leaves_the_thread_as_it_found_it() {
        let Some((_gpu, d)) = gpu() else { return };
        let d = std::sync::Arc::new(d);
        let d2 = d.clone();
        std::thread::spawn(move || {
            let global = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
            assert_eq!(capture_mode(), global, "the default mode");
            assert!(current_device().is_none());
            let g = d2.granularity();
            let va = d2.reserve(g, 0).unwrap();
            let batch = d2.begin_batch();
            assert_eq!(batch, Batch(true));
            assert_eq!(d2.begin_batch(), Batch(false), "a batch inside another does nothing");
            assert_eq!(current_device(), Some(d2.device()), "current for the batch");
            assert_eq!(capture_mode(), sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED);
            let c = d2.create_chunk(g).unwrap();
            d2.map(va, g, c).unwrap();
            d2.set_access(va, g).unwrap();
            assert_eq!(
                capture_mode(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                "calls in the batch leave its mode alone"
            );
            d2.end_batch(batch);
            assert!(current_device().is_none(), "the batch popped its context");
            assert_eq!(capture_mode(), global, "and restored the mode");
            d2.write(va, &[7; 64]).unwrap();
            let mut got = [0u8; 64];
            d2.read(va, &mut got).unwrap();
            assert_eq!(got, [7; 64]);
            crate::driver::batched(&*d2, || {
                d2.unmap(va, g).unwrap();
                d2.release_chunk(c).unwrap();
            });
            assert!(current_device().is_none());
            d2.free_reservation(va, g).unwrap();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn peers_are_checked_and_named_in_set_access() {
        let Some((gpu, d)) = gpu() else { return };
        let count = gpu.devices;
        for bad in [d.device(), count, -1] {
            let e = d.set_peers(&[bad]).unwrap_err();
            assert_eq!(e.call, CallKind::PeerAccess, "{e}");
        }
        if count < 2 {
            println!("one GPU: peers beyond the refusals are tested on two (test_multi_gpu.py)");
            return;
        }
        d.set_peers(&[1]).unwrap();
        let g = d.granularity();
        let va = d.reserve(g, 0).unwrap();
        let c = d.create_chunk(g).unwrap();
        d.map(va, g, c).unwrap();
        d.set_access(va, g).unwrap();
        let mut flags = 0u64;
        let loc = device_location(1);
        // SAFETY: `flags` and `loc` are valid for the call; `va` is mapped.
        let r = unsafe { sys::cuMemGetAccess(&mut flags, &loc, va) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        assert_eq!(
            flags,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64,
            "device 1 was granted access"
        );
        d.unmap(va, g).unwrap();
        d.release_chunk(c).unwrap();
        d.free_reservation(va, g).unwrap();
    }
}
