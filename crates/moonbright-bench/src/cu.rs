//! A thin layer over the CUDA driver API (cudarc's `sys`, libcuda loaded at run time) for the
//! benchmarks: every call's `CUresult` is checked and turned into an error naming the call, and a
//! machine without a GPU gets a clear message instead of a panic.

use std::ffi::{c_void, CStr, CString};
use std::ptr;

use cudarc::driver::sys;
use moonbright::driver::cuda::require_symbols;

use crate::Res;

/// Every libcuda symbol the benchmarks call, checked once in [`Gpu::open`] (cudarc resolves a
/// symbol at first use and panics when it is missing).
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDriverGetVersion",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuDeviceGetDefaultMemPool",
    "cuMemPoolSetAttribute",
    "cuMemPoolTrimTo",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemsetD32_v2",
    "cuMemsetD8_v2",
    "cuMemcpyDtoH_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventElapsedTime",
    "cuEventDestroy_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// `Ok` on success, else an error `"<call> -> <NAME> (<description>)"`: the driver module's one
/// check of a `CUresult`.
pub use moonbright::driver::cuda::cu_check as ck;

#[derive(Clone, Copy, Debug)]
struct Ctx(sys::CUcontext);
// SAFETY: a primary context is an opaque handle the driver lets any thread make current and use;
// the pointer is never dereferenced here, and `Gpu` keeps it retained while it exists.
unsafe impl Send for Ctx {}
// SAFETY: as for `Send`; shared use of a primary context from several threads is supported.
unsafe impl Sync for Ctx {}

/// Device 0, its primary context retained and current on the opening thread.
#[derive(Debug)]
pub struct Gpu {
    pub device: sys::CUdevice,
    ctx: Ctx,
    pub name: String,
    pub total_memory: u64,
    pub driver_version: i32,
    pub cc: (i32, i32),
}

impl Gpu {
    /// Opens device 0, or says clearly why there is no GPU to open.
    pub fn open() -> Res<Gpu> {
        if !moonbright::libs::libcuda_present() {
            return Err(
                "no GPU: libcuda not found (no NVIDIA driver here); these benchmarks need \
                        a CUDA GPU"
                    .into(),
            );
        }
        require_symbols(REQUIRED_SYMBOLS, "driver too old (CUDA 12.2+ needed)")?;
        // SAFETY: flags by value; every symbol is present.
        ck(unsafe { sys::cuInit(0) }, "cuInit(0)").map_err(|e| format!("no usable GPU: {e}"))?;
        let mut count = 0;
        // SAFETY: valid out-pointer.
        ck(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount")?;
        if count < 1 {
            return Err("no GPU: libcuda loaded but reports no CUDA device".into());
        }
        let mut device = 0;
        // SAFETY: valid out-pointer; ordinal 0 < count.
        ck(unsafe { sys::cuDeviceGet(&mut device, 0) }, "cuDeviceGet(0)")?;
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: valid out-pointer; `device` came from cuDeviceGet.
        ck(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) }, "cuDevicePrimaryCtxRetain")?;
        let mut gpu = Gpu {
            device,
            ctx: Ctx(ctx),
            name: String::new(),
            total_memory: 0,
            driver_version: 0,
            cc: (0, 0),
        };
        gpu.make_current()?;
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: `buf` is valid for 256 bytes; the driver writes a NUL-terminated name.
        ck(unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), 256, device) }, "cuDeviceGetName")?;
        // SAFETY: the driver NUL-terminated the name within the buffer.
        gpu.name = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
        let (_, total) = gpu.mem_info()?;
        gpu.total_memory = total;
        // SAFETY: valid out-pointer.
        ck(unsafe { sys::cuDriverGetVersion(&mut gpu.driver_version) }, "cuDriverGetVersion")?;
        let major = gpu.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            "COMPUTE_CAPABILITY_MAJOR",
        )?;
        let minor = gpu.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            "COMPUTE_CAPABILITY_MINOR",
        )?;
        gpu.cc = (major, minor);
        Ok(gpu)
    }

    /// A device attribute.
    pub fn attribute(&self, attr: sys::CUdevice_attribute, what: &str) -> Res<i32> {
        let mut v = 0;
        // SAFETY: valid out-pointer; `device` is valid.
        let r = unsafe { sys::cuDeviceGetAttribute(&mut v, attr, self.device) };
        ck(r, format!("cuDeviceGetAttribute({what})"))?;
        Ok(v)
    }

    /// Makes the primary context current on the calling thread (each new thread needs it).
    pub fn make_current(&self) -> Res<()> {
        // SAFETY: the context is retained for as long as `self` lives.
        ck(unsafe { sys::cuCtxSetCurrent(self.ctx.0) }, "cuCtxSetCurrent")
    }

    /// (free, total) bytes of device memory.
    pub fn mem_info(&self) -> Res<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; a context is current.
        ck(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo_v2")?;
        Ok((free as u64, total as u64))
    }

    /// The minimum VMM granularity of device memory.
    pub fn granularity(&self) -> Res<usize> {
        let prop = self.alloc_prop();
        let mut g = 0usize;
        // SAFETY: valid pointers; `prop` fully initialised.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        ck(r, "cuMemGetAllocationGranularity")?;
        Ok(g)
    }

    /// Device-pinned memory on this device.
    pub fn alloc_prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct for which all zeroes is a valid value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = self.location();
        prop
    }

    /// This device as a memory location.
    pub fn location(&self) -> sys::CUmemLocation {
        sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.device,
        }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let d = self.device;
        // SAFETY: matches the retain in `open`; the symbol was checked present.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(d) };
    }
}

/// `cuMemAlloc_v2`.
pub fn mem_alloc(size: usize) -> Res<u64> {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ck(unsafe { sys::cuMemAlloc_v2(&mut p, size) }, format!("cuMemAlloc_v2({size})"))?;
    Ok(p)
}

/// `cuMemFree_v2`.
pub fn mem_free(p: u64) -> Res<()> {
    // SAFETY: plain value; the driver validates it.
    ck(unsafe { sys::cuMemFree_v2(p) }, format!("cuMemFree_v2({p:#x})"))
}

/// `cuMemsetD32_v2` on the legacy default stream.
pub fn memset_d32(p: u64, value: u32, words: usize) -> Res<()> {
    // SAFETY: the caller passes memory it owns, `words` 4-byte words long.
    ck(unsafe { sys::cuMemsetD32_v2(p, value, words) }, "cuMemsetD32_v2")
}

/// Waits for all work in the current context (after legacy-stream memsets, before kernels on
/// non-blocking streams read what they wrote).
pub fn ctx_sync() -> Res<()> {
    // SAFETY: no arguments; a context is current.
    ck(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

/// Copies `dst.len()` u64 from device memory (synchronous).
pub fn copy_dtoh_u64(dst: &mut [u64], src: u64) -> Res<()> {
    // SAFETY: `dst` is valid for its length in bytes; the driver validates `src`.
    let r = unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, std::mem::size_of_val(dst))
    };
    ck(r, "cuMemcpyDtoH_v2")
}

/// A stream (destroyed on drop).
#[derive(Debug)]
pub struct Stream(pub sys::CUstream);
// SAFETY: a CUstream is an opaque handle usable from any thread with the context current.
unsafe impl Send for Stream {}
// SAFETY: as for `Send`; the driver serialises work on a stream internally.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new stream; `non_blocking`: does not synchronise with the legacy default stream.
    pub fn new(non_blocking: bool) -> Res<Stream> {
        let mut s: sys::CUstream = ptr::null_mut();
        let flags = if non_blocking { 1 } else { 0 };
        // SAFETY: valid out-pointer.
        ck(unsafe { sys::cuStreamCreate(&mut s, flags) }, "cuStreamCreate")?;
        Ok(Stream(s))
    }
    /// Waits for all work on the stream.
    pub fn sync(&self) -> Res<()> {
        // SAFETY: the stream is live.
        ck(unsafe { sys::cuStreamSynchronize(self.0) }, "cuStreamSynchronize")
    }
    /// MoonBright's name for it.
    pub fn handle(&self) -> moonbright::StreamHandle {
        moonbright::StreamHandle(self.0 as u64)
    }
    /// Makes later work on this stream wait for `ev`.
    pub fn wait(&self, ev: &Event) -> Res<()> {
        // SAFETY: both handles are live.
        ck(unsafe { sys::cuStreamWaitEvent(self.0, ev.0, 0) }, "cuStreamWaitEvent")
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created by cuStreamCreate and destroyed once.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}

/// An event (destroyed on drop).
#[derive(Debug)]
pub struct Event(pub sys::CUevent);
// SAFETY: a CUevent is an opaque handle usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as for `Send`.
unsafe impl Sync for Event {}

impl Event {
    /// A timing event (`timing`) or a cheap ordering event.
    pub fn new(timing: bool) -> Res<Event> {
        let mut e: sys::CUevent = ptr::null_mut();
        let flags = if timing { 0 } else { 2 }; // CU_EVENT_DISABLE_TIMING
                                                // SAFETY: valid out-pointer.
        ck(unsafe { sys::cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        Ok(Event(e))
    }
    /// Records the event on `s`.
    pub fn record(&self, s: &Stream) -> Res<()> {
        // SAFETY: both handles are live.
        ck(unsafe { sys::cuEventRecord(self.0, s.0) }, "cuEventRecord")
    }
    /// Waits for the event.
    pub fn sync(&self) -> Res<()> {
        // SAFETY: the event is live.
        ck(unsafe { sys::cuEventSynchronize(self.0) }, "cuEventSynchronize")
    }
    /// Milliseconds from `self` to `end` (both recorded and completed).
    pub fn elapsed_ms(&self, end: &Event) -> Res<f32> {
        let mut ms = 0f32;
        // SAFETY: valid out-pointer; both events are live timing events.
        ck(unsafe { sys::cuEventElapsedTime(&mut ms, self.0, end.0) }, "cuEventElapsedTime")?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate and destroyed once.
        let _ = unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// A kernel argument, passed by value.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    U64(u64),
    U32(u32),
}

/// A module compiled with NVRTC and loaded into the current context.
#[derive(Debug)]
pub struct Module(sys::CUmodule);
// SAFETY: a CUmodule is an opaque handle, usable from any thread with its context current.
unsafe impl Send for Module {}
// SAFETY: as for `Send`; functions are only read from it.
unsafe impl Sync for Module {}

/// A kernel of a [`Module`].
#[derive(Clone, Copy, Debug)]
pub struct Function(sys::CUfunction);
// SAFETY: a CUfunction is an opaque handle valid while its module is loaded.
unsafe impl Send for Function {}
// SAFETY: as for `Send`.
unsafe impl Sync for Function {}

impl Module {
    /// Compiles CUDA C `src` with NVRTC for the device's architecture and loads it.
    pub fn compile(gpu: &Gpu, src: &str) -> Res<Module> {
        let ptx = crate::nvrtc::compile(src, gpu.cc)?;
        let image = CString::new(ptx).map_err(|_| "NVRTC produced PTX with a NUL byte")?;
        let mut m: sys::CUmodule = ptr::null_mut();
        // SAFETY: `image` is a NUL-terminated PTX image that outlives the call.
        let r = unsafe { sys::cuModuleLoadData(&mut m, image.as_ptr() as *const c_void) };
        ck(r, "cuModuleLoadData")?;
        Ok(Module(m))
    }

    /// A kernel by its (extern "C") name.
    pub fn function(&self, name: &str) -> Res<Function> {
        let c = CString::new(name).map_err(|_| "kernel name with a NUL byte")?;
        let mut f: sys::CUfunction = ptr::null_mut();
        // SAFETY: valid out-pointer; the module is loaded; `c` outlives the call.
        let r = unsafe { sys::cuModuleGetFunction(&mut f, self.0, c.as_ptr()) };
        ck(r, format!("cuModuleGetFunction({name})"))?;
        Ok(Function(f))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded by cuModuleLoadData and unloaded once.
        let _ = unsafe { sys::cuModuleUnload(self.0) };
    }
}

impl Function {
    /// Launches the kernel with a 1-D grid on `stream`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number and types, and every device pointer
    /// among them must be valid for the accesses the kernel makes until it completes.
    pub unsafe fn launch(&self, grid: u32, block: u32, stream: &Stream, args: &[Arg]) -> Res<()> {
        let mut vals: Vec<Arg> = args.to_vec();
        let mut ptrs: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|a| match a {
                Arg::U64(v) => v as *mut u64 as *mut c_void,
                Arg::U32(v) => v as *mut u32 as *mut c_void,
            })
            .collect();
        // SAFETY: `ptrs` point into `vals`, alive across the call (the driver copies the
        // arguments at launch); the caller vouches that they match the kernel's signature.
        let r = unsafe {
            sys::cuLaunchKernel(
                self.0,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream.0,
                ptrs.as_mut_ptr(),
                ptr::null_mut(),
            )
        };
        ck(r, "cuLaunchKernel")
    }
}
