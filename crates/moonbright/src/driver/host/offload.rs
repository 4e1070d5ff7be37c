//! The host backend's [`Offload`]: "pinned" buffers from the heap, each registered so that a
//! copy outside one, or a free of something it never gave, is refused as the driver would; and
//! copies done at once (the host backend's streams run nothing, so a copy queued on one has
//! completed when the call returns).

use std::alloc::{alloc, dealloc, Layout};
use std::collections::BTreeMap;

use super::{err, HostDriver};
use crate::driver::{code, CallKind, DevicePtr, DriverResult, HostBuffer, Offload, StreamHandle};

/// Alignment of host buffers (a page, as pinned memory's).
const ALIGN: usize = 4096;

/// The host buffers given out and not freed: address -> length.
#[derive(Debug, Default)]
pub(super) struct HostBuffers {
    live: BTreeMap<usize, usize>,
}

impl HostBuffers {
    /// Whether `[ptr, ptr + len)` lies in one live buffer.
    fn covers(&self, ptr: usize, len: usize) -> bool {
        self.live.range(..=ptr).next_back().is_some_and(|(&b, &l)| ptr + len <= b + l)
    }

    /// Frees every buffer still live (the driver is going away).
    pub(super) fn free_all(&mut self) {
        for (ptr, len) in std::mem::take(&mut self.live) {
            // SAFETY: allocated by `alloc_host` with this layout and not freed since (it is
            // still registered).
            unsafe { dealloc(ptr as *mut u8, Layout::from_size_align_unchecked(len, ALIGN)) };
        }
    }
}

impl Offload for HostDriver {
    fn alloc_host(&self, bytes: usize) -> DriverResult<HostBuffer> {
        let kind = CallKind::HostAlloc;
        let layout = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|_| err(kind, code::INVALID_VALUE, format!("host buffer of {bytes} bytes")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc(layout) };
        if ptr.is_null() {
            return Err(err(kind, code::OUT_OF_MEMORY, format!("host buffer of {bytes} bytes")));
        }
        self.lock().host.live.insert(ptr as usize, layout.size());
        Ok(HostBuffer { ptr, bytes })
    }

    unsafe fn free_host(&self, buffer: HostBuffer) -> DriverResult<()> {
        let kind = CallKind::HostFree;
        let Some(len) = self.lock().host.live.remove(&(buffer.ptr as usize)) else {
            return Err(err(kind, code::INVALID_VALUE, "not a host buffer of this driver's"));
        };
        // SAFETY: allocated by `alloc_host` with this layout (registered until just now).
        unsafe { dealloc(buffer.ptr, Layout::from_size_align_unchecked(len, ALIGN)) };
        Ok(())
    }

    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> DriverResult<()> {
        let _ = stream;
        let st = self.lock();
        if !st.host.covers(dst as usize, bytes) {
            return Err(err(
                CallKind::CopyAsync,
                code::INVALID_VALUE,
                "copy outside a host buffer",
            ));
        }
        st.space.check_copy(src, bytes).map_err(|e| e.with_kind(CallKind::CopyAsync))?;
        // SAFETY: the source is mapped readable (checked above) and stays so while we hold the
        // lock; the destination lies in a live host buffer that the caller leaves to this copy.
        unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst, bytes) };
        Ok(())
    }

    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> DriverResult<()> {
        let _ = stream;
        let st = self.lock();
        if !st.host.covers(src as usize, bytes) {
            return Err(err(
                CallKind::CopyAsync,
                code::INVALID_VALUE,
                "copy outside a host buffer",
            ));
        }
        st.space.check_copy(dst, bytes).map_err(|e| e.with_kind(CallKind::CopyAsync))?;
        // SAFETY: the destination is mapped read-write (checked above) and stays so while we
        // hold the lock; the source lies in a live host buffer, which device memory never
        // overlaps.
        unsafe { std::ptr::copy_nonoverlapping(src, dst as usize as *mut u8, bytes) };
        Ok(())
    }
}
