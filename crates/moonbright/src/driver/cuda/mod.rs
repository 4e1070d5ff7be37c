//! The CUDA backend: [`CudaDriver`] implements the driver contract on the CUDA virtual-memory API
//! through cudarc's `sys` layer (libcuda loaded at run time). This file owns the driver itself:
//! opening a device, its primary context and granularity; beside it `load` (libcuda, symbols, the
//! `CUresult` check), `context` (which context each call runs under), `vm` (virtual memory,
//! peers, batches, copies), `streams` (streams, events, capture), `ipc` (export and import) and
//! `kernels` (modules and launches, for the paged pool).

mod context;
mod ipc;
mod kernels;
mod load;
mod offload;
mod streams;
#[cfg(all(test, not(loom), not(miri)))]
mod tests;
mod vm;

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
// Not `crate::sync`: the CUDA backend is never run under loom.
use std::sync::Mutex;

use cudarc::driver::sys;

use context::PrimaryContext;
pub use context::{current_device, CtxScope};
use load::{check, no_libcuda, panic_text, REQUIRED_SYMBOLS};
pub use load::{cu_check, describe, missing_symbols, probe, require_symbols, CallText};

use super::{code, CallKind, ChunkHandle, DriverError, DriverResult};

/// `CUDA_ERROR_INVALID_DEVICE`, for an ordinal outside `0..device_count`.
const INVALID_DEVICE: i32 = sys::CUresult::CUDA_ERROR_INVALID_DEVICE as i32;

/// The shareable handle MoonBright asks `cuMemCreate` for, and exports: a POSIX file descriptor,
/// which another process receives over a Unix socket (`ipc`).
const FD_HANDLE: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// The CUDA backend for one device: its primary context (retained for the driver's life) and the
/// physical-memory granularity of device-pinned allocations.
#[derive(Debug)]
pub struct CudaDriver {
    ordinal: i32,
    cu_device: sys::CUdevice,
    ctx: PrimaryContext,
    granularity: usize,
    /// Other devices `set_access` grants access to, beside this one (`Peers::set_peers`).
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
        let why = "the NVIDIA driver is too old (CUDA 12.2 or later needed)";
        require_symbols(&REQUIRED_SYMBOLS, why)
            .map_err(|m| DriverError::new(kind, code::NOT_SUPPORTED, m))?;
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

    /// Makes the chunks `create_chunk` makes from now on exportable (`Ipc::export_chunk`), or
    /// not. If the driver refuses to create a chunk with a shareable handle (a container or a
    /// platform without POSIX file descriptor handles), the chunk is created without one and
    /// sharing stays off.
    pub fn set_shareable(&self, on: bool) {
        self.shareable.store(on, Ordering::Relaxed);
    }

    /// Drops the descriptor kept for `handle`'s export, if any.
    pub(super) fn forget_export(&self, handle: ChunkHandle) {
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

    /// Device-pinned memory on this device, every other field zero.
    pub(super) fn allocation_prop(&self) -> sys::CUmemAllocationProp {
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
pub(super) fn device_location(ordinal: i32) -> sys::CUmemLocation {
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
