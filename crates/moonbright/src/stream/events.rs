//! Events of stream-ordered frees: recording those that a free's own thread could not, keeping
//! a stock of spare events, polling them for completion, and waiting on the host for every
//! pending free.

use super::Shared;
use crate::driver::{prelude::*, EventHandle, StreamHandle};
use crate::error::Result;
use crate::sync::atomic::Ordering;

impl Shared {
    /// Records an event on every stream with a free whose own record failed, or that recorded
    /// none (`deferred_free_events`), and that no event covers yet. Frees whose own records are
    /// still to come are left to their threads: the user may destroy a stream as soon as its
    /// frees have returned. Returns whether it recorded any.
    ///
    /// Such a record is made by another thread than the stream's user, so it must not land in a
    /// capture (it would join the graph): with `captures_announced`, none is made while a capture
    /// is announced (`capture_starting` waits for a pass in progress), and otherwise each stream
    /// is asked first. A stream skipped keeps needing its event.
    pub fn record_missing_events(&self) -> bool {
        let _gate = self.record_gate.lock().unwrap_or_else(|e| e.into_inner());
        if self.options.captures_announced && self.captures_in_progress.load(Ordering::SeqCst) > 0 {
            return false;
        }
        let needing = self.heap().streams_needing_events();
        let mut any = false;
        for (stream, epoch, spare) in needing {
            any |= self.record_unless_capturing(stream, epoch, spare);
        }
        any
    }

    /// Records `spare` (or a new event) on `stream` for the free of `epoch`, unless the stream
    /// is being captured (asked only without `captures_announced`; the callers skip recording
    /// while an announced capture runs): the free then keeps needing its event. Returns whether
    /// it recorded (or tried to).
    fn record_unless_capturing(&self, stream: u64, epoch: u64, spare: Option<EventHandle>) -> bool {
        if !self.options.captures_announced {
            match self.driver.is_capturing(StreamHandle(stream)) {
                Ok(false) => {}
                capturing => {
                    self.heap().record_settled(stream, epoch, Err(spare), false);
                    if let Err(e) = capturing {
                        self.heap().note_deferred_error(e);
                    }
                    return false;
                }
            }
        }
        if let Err(e) = self.record(stream, epoch, spare, false) {
            self.heap().note_deferred_error(e);
        }
        true
    }

    /// Records an event on `stream` for its frees that no event covers and whose own threads
    /// record none (`Step::RecordOwnFrees`): called by a request on `stream`, which shows the
    /// stream alive. As in `record_missing_events`, never into a capture.
    pub(super) fn record_own_frees(&self, stream: u64) {
        let _gate = self.record_gate.lock().unwrap_or_else(|e| e.into_inner());
        if self.options.captures_announced && self.captures_in_progress.load(Ordering::SeqCst) > 0 {
            return;
        }
        let needing = self.heap().stream_needing_event(stream);
        if let Some((epoch, spare)) = needing {
            self.record_unless_capturing(stream, epoch, spare);
        }
    }

    /// Tops the stock of events up to `target` once it is down to half, creating them here, off
    /// any request's path: a free records a stocked event when its stream has no spare one of its
    /// own, instead of creating one. A failed creation ends this top-up and is not reported: the
    /// stock is only a shortcut, and a free that finds it empty creates its event itself (and
    /// reports that failure). A stock grown past twice `target` (forgotten streams give their
    /// events back to it) is trimmed to `target`, destroying the rest.
    pub fn stock_events(&self, target: usize) {
        let (excess, want) = {
            let mut heap = self.heap();
            (heap.event_stock_excess(target), heap.event_stock_wanted(target))
        };
        for ev in excess {
            if let Err(e) = self.driver.destroy_event(ev) {
                // The event is lost to the allocator either way; the error is the user's to see.
                self.heap().note_deferred_error(e);
            }
        }
        let mut made = Vec::with_capacity(want);
        for _ in 0..want {
            match self.driver.create_event() {
                Ok(e) => made.push(e),
                Err(_) => break,
            }
        }
        if !made.is_empty() {
            self.heap().stock_events(made);
        }
    }

    /// Queries recorded events and frees what the completed ones cover. Returns whether anything
    /// completed. Safe to run from several threads at once: a completion that another thread
    /// already applied changes nothing.
    ///
    /// Events on one stream complete in the order they were recorded, and each covers every free
    /// of its stream before it. So per stream it asks the newest first (done: everything listed
    /// is, in one step), else the oldest onwards until one is still pending: a burst of frees
    /// costs a query or two a poll, not one per free.
    pub fn poll_events(&self) -> bool {
        let to_query = self.heap().events_to_query();
        let mut any = false;
        for (stream, events) in to_query {
            let Some((&newest, older)) = events.split_last() else { continue };
            if self.poll_one(stream, newest) == Some(true) {
                any = true;
                continue;
            }
            for &pair in older {
                match self.poll_one(stream, pair) {
                    Some(true) => any = true,
                    Some(false) => break,
                    None => {}
                }
            }
        }
        any
    }

    /// Queries one recorded event and applies its completion: whether it had completed (`None`
    /// if the query failed; the error is kept for the user).
    pub(super) fn poll_one(&self, stream: u64, (epoch, ev): (u64, EventHandle)) -> Option<bool> {
        match self.driver.event_done(ev) {
            Ok(true) => {
                let mut heap = self.heap();
                heap.events_completed(stream, epoch, ev);
                self.validated(&heap);
                Some(true)
            }
            Ok(false) => Some(false),
            Err(e) => {
                self.heap().note_deferred_error(e);
                None
            }
        }
    }

    /// Waits (on the host, never the device) until every stream's pending frees have completed.
    pub(super) fn wait_for_pending_frees(&self) -> Result<()> {
        self.heap().note_pending_free_wait();
        self.record_missing_events();
        let to_wait = self.heap().events_to_query();
        for (stream, events) in to_wait {
            // The event of the newest epoch covers every free before it.
            if let Some(&(epoch, ev)) = events.iter().max_by_key(|e| e.0) {
                self.driver.synchronize_event(ev)?;
                let mut heap = self.heap();
                heap.events_completed(stream, epoch, ev);
                self.validated(&heap);
            }
        }
        Ok(())
    }
}
