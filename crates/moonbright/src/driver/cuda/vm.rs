//! The CUDA backend's virtual-memory calls (reserve, create, map, set access, unmap, release),
//! its batches of them, its peers, and its synchronous copies.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cudarc::driver::sys;

use super::context::{relaxed, CtxScope, OpenBatch, BATCH};
use super::load::check;
use super::{device_location, CudaDriver, FD_HANDLE, INVALID_DEVICE};
use crate::driver::{
    code, Batch, CallKind, ChunkHandle, Copies, DevicePtr, DriverError, DriverResult, MemInfo,
    Peers, VirtualMemory,
};

impl VirtualMemory for CudaDriver {
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

    fn unmap(&self, va: DevicePtr, size: usize) -> DriverResult<()> {
        let kind = CallKind::Unmap;
        let _ctx = self.enter(kind)?;
        // SAFETY: plain values; the driver validates that the range is whole mappings.
        let r = relaxed(|| unsafe { sys::cuMemUnmap(va, size) });
        check(kind, r, || format!("cuMemUnmap(va={va:#x}, size={size:#x})"))
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
}

impl Peers for CudaDriver {
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
}

impl Copies for CudaDriver {
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
}
