//! The CUDA backend's kernel calls: loading modules into the device's primary context (for good),
//! looking up their kernels, pinned host memory that kernels read, and launches on a stream.
//! Each call enters the primary context for itself, as every call of the backend does.

use std::ffi::{c_void, CString};
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::load::{check, require_symbols, KERNEL_SYMBOLS};
use super::CudaDriver;
use crate::driver::{
    code, CallKind, DriverError, DriverResult, KernelHandle, Kernels, ModuleHandle, PinnedBuffer,
    StreamHandle,
};

/// The kind kernel calls' errors carry: the contract's kind for set-up (they are not counted).
const KIND: CallKind = CallKind::MemInfo;

/// `Ok` once libcuda is known to have every kernel symbol (looked up once per process).
fn kernel_symbols() -> DriverResult<()> {
    static PRESENT: OnceLock<Result<(), String>> = OnceLock::new();
    PRESENT
        .get_or_init(|| require_symbols(&KERNEL_SYMBOLS, ""))
        .clone()
        .map_err(|m| DriverError::new(KIND, code::NOT_SUPPORTED, m))
}

impl Kernels for CudaDriver {
    fn runs_kernels(&self) -> bool {
        true
    }

    fn module_context(&self) -> DriverResult<u64> {
        Ok(self.context() as u64)
    }

    fn compute_capability(&self) -> DriverResult<(i32, i32)> {
        kernel_symbols()?;
        let attr = |a, what: &str| -> DriverResult<i32> {
            let mut v = 0;
            // SAFETY: valid out-pointer; `cu_device` came from cuDeviceGet in `new`.
            let r = unsafe { sys::cuDeviceGetAttribute(&mut v, a, self.cu_device) };
            check(KIND, r, || format!("cuDeviceGetAttribute({what})"))?;
            Ok(v)
        };
        use sys::CUdevice_attribute::*;
        Ok((
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "CC major")?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "CC minor")?,
        ))
    }

    /// Also takes a reference on the device's primary context that is never given back: a
    /// primary context whose last reference goes is destroyed with its modules, and may come back
    /// at the same address, which would leave a caller's cache of modules by context stale.
    fn load_module(&self, image: &[u8]) -> DriverResult<ModuleHandle> {
        kernel_symbols()?;
        if image.is_empty() {
            return Err(DriverError::new(KIND, code::INVALID_VALUE, "an empty module image"));
        }
        let _ctx = self.enter(KIND)?;
        let mut module: sys::CUmodule = ptr::null_mut();
        // SAFETY: `image` is a PTX image ending in NUL or a CUBIN (the caller's contract; the
        // driver reads no further than either), alive for the call; a context is current.
        let r = unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) };
        check(KIND, r, || format!("cuModuleLoadData(bytes={})", image.len()))?;
        let mut held: sys::CUcontext = ptr::null_mut();
        // SAFETY: valid out-pointer; `cu_device` came from cuDeviceGet. The reference is never
        // released (see above).
        let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut held, self.cu_device) };
        check(KIND, r, || "cuDevicePrimaryCtxRetain".into())?;
        Ok(ModuleHandle(module as u64))
    }

    fn kernel_function(&self, module: ModuleHandle, name: &str) -> DriverResult<KernelHandle> {
        kernel_symbols()?;
        let c = CString::new(name).map_err(|_| {
            DriverError::new(KIND, code::INVALID_VALUE, format!("kernel name {name:?} has a NUL"))
        })?;
        let _ctx = self.enter(KIND)?;
        let mut f: sys::CUfunction = ptr::null_mut();
        // SAFETY: valid out-pointer; the module was loaded by `load_module` and never unloaded;
        // `c` outlives the call.
        let r = unsafe { sys::cuModuleGetFunction(&mut f, module.0 as sys::CUmodule, c.as_ptr()) };
        check(KIND, r, || name.to_owned())?;
        Ok(KernelHandle(f as u64))
    }

    fn alloc_pinned(&self, bytes: usize) -> DriverResult<PinnedBuffer> {
        kernel_symbols()?;
        let _ctx = self.enter(KIND)?;
        let mut h: *mut c_void = ptr::null_mut();
        // CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
        // SAFETY: valid out-pointer; a context is current.
        check(KIND, unsafe { sys::cuMemHostAlloc(&mut h, bytes, 0x01 | 0x02) }, "cuMemHostAlloc")?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `h` is mapped pinned memory just allocated.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, h, 0) };
        if let Err(e) = check(KIND, r, "cuMemHostGetDevicePointer") {
            // SAFETY: allocated just above, never used.
            let _ = unsafe { sys::cuMemFreeHost(h) };
            return Err(e);
        }
        Ok(PinnedBuffer { host: h.cast(), device, bytes })
    }

    unsafe fn free_pinned(&self, buffer: PinnedBuffer) -> DriverResult<()> {
        let _ctx = self.enter(KIND)?;
        // SAFETY: allocated by `alloc_pinned`, freed once, read by no kernel any more (the
        // caller's contract).
        let r = unsafe { sys::cuMemFreeHost(buffer.host.cast()) };
        check(KIND, r, "cuMemFreeHost")
    }

    unsafe fn launch(
        &self,
        kernel: KernelHandle,
        grid: u32,
        block: u32,
        stream: StreamHandle,
        params: &mut [*mut c_void],
    ) -> DriverResult<()> {
        let _ctx = self.enter(KIND)?;
        // SAFETY: the kernel came from `kernel_function` (its module is never unloaded); the
        // caller vouches that `params` match its parameters and that every address they hold
        // outlives the kernel; the driver copies the arguments during the call.
        let r = unsafe {
            sys::cuLaunchKernel(
                kernel.0 as sys::CUfunction,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream.0 as sys::CUstream,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        };
        check(KIND, r, "cuLaunchKernel")
    }
}
