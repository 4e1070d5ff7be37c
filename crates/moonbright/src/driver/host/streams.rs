//! The host backend's simulated streams and events (`StreamModel`: an event recorded on a held
//! stream stays pending until the hold ends), and the graph captures tests announce.

use std::collections::HashMap;

use super::{err, HostDriver};
use crate::driver::{
    code, CallKind, Capture, DriverError, DriverResult, EventHandle, StreamHandle, Streams,
};

/// The simulated streams and events, and the graph captures tests announce.
#[derive(Debug)]
pub(super) struct StreamModel {
    pub(super) next_stream: u64,
    /// stream -> the token of its current hold, if held.
    pub(super) streams: HashMap<u64, Option<u64>>,
    pub(super) next_hold: u64,
    pub(super) next_event: u64,
    pub(super) events: HashMap<u64, EventState>,
    /// Streams a test has put into graph capture, with their capture's id.
    pub(super) capturing: HashMap<u64, u64>,
    pub(super) next_capture: u64,
    /// How long `synchronize_event` waits for a held stream's hold to end (another thread of a
    /// test ends it) before it refuses; zero refuses at once.
    pub(super) sync_wait: std::time::Duration,
}

impl StreamModel {
    /// The default stream alone, no events, no captures.
    pub(super) fn new() -> StreamModel {
        let mut streams = HashMap::new();
        streams.insert(StreamHandle::DEFAULT.0, None);
        StreamModel {
            next_stream: 1,
            streams,
            next_hold: 1,
            next_event: 1,
            events: HashMap::new(),
            capturing: HashMap::new(),
            next_capture: 1,
            sync_wait: std::time::Duration::ZERO,
        }
    }
}

/// Where an event's last record stands.
#[derive(Debug, Clone, Copy)]
pub(super) enum EventState {
    /// Never recorded, or recorded on a stream that was not held: done.
    Done,
    /// Recorded on `stream` during its hold `hold`: done once that hold ends.
    Pending { stream: u64, hold: u64 },
}

impl Streams for HostDriver {
    fn create_stream(&self) -> DriverResult<StreamHandle> {
        let mut st = self.lock();
        let id = st.streams.next_stream;
        st.streams.next_stream += 1;
        st.streams.streams.insert(id, None);
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
        match self.lock().streams.streams.remove(&stream.0) {
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
        let id = st.streams.next_event;
        st.streams.next_event += 1;
        st.streams.events.insert(id, EventState::Done);
        Ok(EventHandle(id))
    }

    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> DriverResult<()> {
        let call = CallKind::EventRecord;
        let mut st = self.lock();
        if st.streams.capturing.contains_key(&stream.0) {
            // On CUDA the record would join the graph being captured instead.
            return Err(err(
                call,
                code::STREAM_CAPTURE_UNSUPPORTED,
                format!("record_event: stream {} is being captured into a graph", stream.0),
            ));
        }
        let Some(&hold) = st.streams.streams.get(&stream.0) else {
            return Err(err(
                call,
                code::INVALID_HANDLE,
                format!("record_event: stream {} is unknown", stream.0),
            ));
        };
        let Some(ev) = st.streams.events.get_mut(&event.0) else {
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
        match st.streams.events.get(&event.0) {
            Some(EventState::Done) => Ok(true),
            Some(&EventState::Pending { stream, hold }) => {
                Ok(st.streams.streams.get(&stream).copied().flatten() != Some(hold))
            }
            None => Err(err(
                CallKind::EventQuery,
                code::INVALID_HANDLE,
                format!("event_done: event {} is unknown", event.0),
            )),
        }
    }

    fn destroy_event(&self, event: EventHandle) -> DriverResult<()> {
        match self.lock().streams.events.remove(&event.0) {
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
        let (limit, start) = (self.lock().streams.sync_wait, crate::sync::Instant::now());
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
        Ok(self.lock().streams.capturing.contains_key(&stream.0))
    }

    fn capture_id(&self, stream: StreamHandle) -> DriverResult<Option<u64>> {
        Ok(self.lock().streams.capturing.get(&stream.0).copied())
    }
}
