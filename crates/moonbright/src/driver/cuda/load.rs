//! Loading libcuda and checking what it says: the symbols a caller needs (cudarc resolves each
//! at its first call and panics if it is missing), the one check of a `CUresult` (its name and
//! description on failure), and the probe for a usable driver and device. Public for tools that
//! make driver calls of their own, such as the benchmarks.

use std::ffi::CStr;
use std::panic::catch_unwind;
use std::ptr;

use cudarc::driver::sys;

use crate::driver::{CallKind, DriverError, DriverResult};

/// Every libcuda symbol the CUDA backend calls outside [`KERNEL_SYMBOLS`], checked once in
/// [`CudaDriver::new`](super::CudaDriver::new) so that a driver too
/// old to have one gives an error there instead of a panic (cudarc's lazy loader panics on a
/// missing symbol) in the middle of a later call.
pub(super) const REQUIRED_SYMBOLS: [&str; 40] = [
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
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
];

/// The libcuda symbols of the backend's kernel calls ([`Kernels`](crate::driver::Kernels)),
/// checked before the first of them: the allocator runs without them.
pub(super) const KERNEL_SYMBOLS: [&str; 5] = [
    "cuDeviceGetAttribute",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    "cuMemHostGetDevicePointer_v2",
];

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

/// `Ok` when libcuda has every one of `symbols`, else `"libcuda lacks [...]"`, naming those
/// missing, then `why` when given (what a caller needs them for).
pub fn require_symbols(symbols: &[&str], why: &str) -> Result<(), String> {
    let missing = missing_symbols(symbols);
    match (missing.is_empty(), why.is_empty()) {
        (true, _) => Ok(()),
        (false, true) => Err(format!("libcuda lacks {missing:?}")),
        (false, false) => Err(format!("libcuda lacks {missing:?}: {why}")),
    }
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

/// How a failed call is named in an error: text, or a closure that writes it, run only on
/// failure (so that a successful call formats nothing).
pub trait CallText {
    /// The call's name and arguments, as `"cuMemMap(va=0x..., size=0x...)"`.
    fn text(self) -> String;
}

impl CallText for &str {
    fn text(self) -> String {
        self.to_owned()
    }
}

impl CallText for String {
    fn text(self) -> String {
        self
    }
}

impl<F: FnOnce() -> String> CallText for F {
    fn text(self) -> String {
        self()
    }
}

/// The one check of a `CUresult`: success is `Ok`, anything else the message
/// `"<call> -> <NAME> (<description>)"`.
#[inline]
pub fn cu_check(result: sys::CUresult, call: impl CallText) -> Result<(), String> {
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(format!("{} -> {}", call.text(), describe(result)))
}

/// [`cu_check`] as a [`DriverResult`]: a failure is a [`DriverError`] of `kind` carrying the code.
#[inline]
pub(super) fn check(
    kind: CallKind,
    result: sys::CUresult,
    call: impl CallText,
) -> DriverResult<()> {
    cu_check(result, call).map_err(|message| DriverError::new(kind, result as i32, message))
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
pub(super) fn no_libcuda() -> String {
    let mut names = cudarc::get_lib_name_candidates("cuda");
    names.sort();
    names.dedup();
    format!(
        "libcuda not found (no NVIDIA driver installed, or not on the loader path); tried {}",
        names.join(", ")
    )
}

/// The text of a caught panic payload.
pub(super) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}
