//! The CUDA backend's streams and events, and its queries of a stream's graph capture.

use std::ptr;

use cudarc::driver::sys;

use super::context::relaxed;
use super::load::check;
use super::CudaDriver;
use crate::driver::{
    code, CallKind, Capture, DriverError, DriverResult, EventHandle, StreamHandle, Streams,
};

impl Streams for CudaDriver {
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
}

impl Capture for CudaDriver {
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
}
