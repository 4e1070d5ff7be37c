//! The host backend's simulated streams and events (an event recorded on a held stream stays
//! pending until the hold ends), and the graph captures tests announce.

use super::{err, EventState, HostDriver};
use crate::driver::{
    code, CallKind, Capture, DriverError, DriverResult, EventHandle, StreamHandle, Streams,
};

impl Streams for HostDriver {
    fn create_stream(&self) -> DriverResult<StreamHandle> {
        let mut st = self.lock();
        let id = st.next_stream;
        st.next_stream += 1;
        st.streams.insert(id, None);
        Ok(StreamHandle(id))
    }

    fn destroy_stream(&self, stream: StreamHandle) -> DriverResult<()> {
        if stream == StreamHandle::DEFAULT {
            return Err(err(
                CallKind::StreamDestroy,
                code::INVALID_HANDLE,
                "destroy_stream: the default stream cannot be destroyed",
            ));
        }
        // Work pending on a destroyed stream still completes, so its events become done: their
        // hold token no longer matches any stream's.
        match self.lock().streams.remove(&stream.0) {
            Some(_) => Ok(()),
            None => Err(err(
                CallKind::StreamDestroy,
                code::INVALID_HANDLE,
                format!("destroy_stream: stream {} is unknown", stream.0),
            )),
        }
    }

    fn create_event(&self) -> DriverResult<EventHandle> {
        let mut st = self.lock();
        let id = st.next_event;
        st.next_event += 1;
        st.events.insert(id, EventState::Done);
        Ok(EventHandle(id))
    }

    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> DriverResult<()> {
        let call = CallKind::EventRecord;
        let mut st = self.lock();
        if st.capturing.contains_key(&stream.0) {
            // On CUDA the record would join the graph being captured instead.
            return Err(err(
                call,
                code::STREAM_CAPTURE_UNSUPPORTED,
                format!("record_event: stream {} is being captured into a graph", stream.0),
            ));
        }
        let Some(&hold) = st.streams.get(&stream.0) else {
            return Err(err(
                call,
                code::INVALID_HANDLE,
                format!("record_event: stream {} is unknown", stream.0),
            ));
        };
        let Some(ev) = st.events.get_mut(&event.0) else {
            return Err(err(
                call,
                code::INVALID_HANDLE,
                format!("record_event: event {} is unknown", event.0),
            ));
        };
        *ev = match hold {
            Some(hold) => EventState::Pending { stream: stream.0, hold },
            None => EventState::Done,
        };
        Ok(())
    }

    fn event_done(&self, event: EventHandle) -> DriverResult<bool> {
        let st = self.lock();
        match st.events.get(&event.0) {
            Some(EventState::Done) => Ok(true),
            Some(&EventState::Pending { stream, hold }) => {
                Ok(st.streams.get(&stream).copied().flatten() != Some(hold))
            }
            None => Err(err(
                CallKind::EventQuery,
                code::INVALID_HANDLE,
                format!("event_done: event {} is unknown", event.0),
            )),
        }
    }

    fn destroy_event(&self, event: EventHandle) -> DriverResult<()> {
        match self.lock().events.remove(&event.0) {
            Some(_) => Ok(()),
            None => Err(err(
                CallKind::EventDestroy,
                code::INVALID_HANDLE,
                format!("destroy_event: event {} is unknown", event.0),
            )),
        }
    }

    fn synchronize_event(&self, event: EventHandle) -> DriverResult<()> {
        // Nothing runs on the host model, so a held stream finishes only when a test ends the
        // hold: wait as long as `wait_on_held_streams` allows (by default not at all), then
        // refuse rather than hang.
        let (limit, start) = (self.lock().sync_wait, crate::sync::Instant::now());
        let mut done = self.event_done(event);
        while matches!(done, Ok(false)) && start.elapsed() < limit {
            crate::sync::pause(std::time::Duration::from_millis(1));
            done = self.event_done(event);
        }
        match done {
            Ok(true) => Ok(()),
            Ok(false) => Err(err(
                CallKind::EventSynchronize,
                code::NOT_READY,
                format!("synchronize_event: event {} waits on a held stream", event.0),
            )),
            Err(e) => Err(DriverError { call: CallKind::EventSynchronize, ..e }),
        }
    }
}

impl Capture for HostDriver {
    fn is_capturing(&self, stream: StreamHandle) -> DriverResult<bool> {
        Ok(self.lock().capturing.contains_key(&stream.0))
    }

    fn capture_id(&self, stream: StreamHandle) -> DriverResult<Option<u64>> {
        Ok(self.lock().capturing.get(&stream.0).copied())
    }
}
