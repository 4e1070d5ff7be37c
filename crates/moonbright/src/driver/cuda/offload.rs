//! The CUDA backend's [`Offload`]: pinned host memory (`cuMemHostAlloc`) and copies between it
//! and device memory queued on a stream (`cuMemcpyDtoHAsync` / `cuMemcpyHtoDAsync`), for a tag's
//! sleep and wake.

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;

use super::load::check;
use super::CudaDriver;
use crate::driver::{CallKind, DevicePtr, DriverResult, HostBuffer, Offload, StreamHandle};

impl Offload for CudaDriver {
    fn alloc_host(&self, bytes: usize) -> DriverResult<HostBuffer> {
        let kind = CallKind::HostAlloc;
        let _ctx = self.enter(kind)?;
        let mut h: *mut c_void = ptr::null_mut();
        // CU_MEMHOSTALLOC_PORTABLE: the buffer serves copies of every context.
        // SAFETY: valid out-pointer; a context is current.
        let r = unsafe { sys::cuMemHostAlloc(&mut h, bytes, 0x01) };
        check(kind, r, || format!("cuMemHostAlloc(bytes={bytes:#x})"))?;
        Ok(HostBuffer { ptr: h.cast(), bytes })
    }

    unsafe fn free_host(&self, buffer: HostBuffer) -> DriverResult<()> {
        let kind = CallKind::HostFree;
        let _ctx = self.enter(kind)?;
        // SAFETY: allocated by `alloc_host`, freed once, no copy on it in flight (the caller's
        // contract).
        let r = unsafe { sys::cuMemFreeHost(buffer.ptr.cast()) };
        check(kind, r, "cuMemFreeHost")
    }

    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> DriverResult<()> {
        let kind = CallKind::CopyAsync;
        let _ctx = self.enter(kind)?;
        // SAFETY: `dst` lies in pinned memory that stays valid and untouched until the copy
        // completes (the caller's contract); the driver validates the device range.
        let r =
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream.0 as sys::CUstream) };
        check(kind, r, || format!("cuMemcpyDtoHAsync_v2(src={src:#x}, bytes={bytes:#x})"))
    }

    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> DriverResult<()> {
        let kind = CallKind::CopyAsync;
        let _ctx = self.enter(kind)?;
        // SAFETY: as in `copy_to_host`, for reads of `src`.
        let r =
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream.0 as sys::CUstream) };
        check(kind, r, || format!("cuMemcpyHtoDAsync_v2(dst={dst:#x}, bytes={bytes:#x})"))
    }
}
