//! The events that tell stream-ordered frees complete: the record each free asks for, the
//! stock of events made ahead, records settled, polls, and completions that make pending frees
//! free for every stream.

use super::{Backing, Heap, StreamRecord, Use, EVENTS_IN_FLIGHT};
use crate::core::history::HistoryAction;
use crate::core::streams::Pending;
use crate::driver::EventHandle;

impl Heap {
    /// The event record a free of `epoch` on `stream` asks for, counted in flight.
    pub(super) fn record_for(&mut self, stream: u64, epoch: u64) -> StreamRecord {
        self.claims.records_in_flight += 1;
        let spare = self
            .streams
            .entry(stream)
            .event_to_record(EVENTS_IN_FLIGHT)
            .or_else(|| self.streams.stock.pop());
        (stream, epoch, spare)
    }

    /// How many events the stock lacks, once it is down to half of `target` (0 otherwise).
    pub fn event_stock_wanted(&self, target: usize) -> usize {
        if self.streams.stock.len() <= target / 2 {
            target - self.streams.stock.len()
        } else {
            0
        }
    }

    /// Takes out the events the stock holds beyond `target`, once it holds more than twice
    /// that: events of forgotten streams come back to the stock, and a burst of many streams
    /// would otherwise leave thousands created for good.
    pub fn event_stock_excess(&mut self, target: usize) -> Vec<EventHandle> {
        if self.streams.stock.len() > 2 * target {
            self.streams.stock.split_off(target)
        } else {
            Vec::new()
        }
    }

    /// Events in the stock.
    pub fn events_stocked(&self) -> usize {
        self.streams.stock.len()
    }

    /// Adds events created ahead of need to the stock.
    pub fn stock_events(&mut self, events: Vec<EventHandle>) {
        self.streams.stock.extend(events);
    }

    /// Settles a record of an event on `stream` for the free of `epoch`: `Ok(event)` was
    /// recorded after it; `Err(event)` failed (the event, if one was made, becomes a spare, and
    /// the worker records one for the free later). `own` says whether it was the record the free
    /// itself asked for (`free_on_stream`, a shrink on a stream), which is in flight until now.
    pub fn record_settled(
        &mut self,
        stream: u64,
        epoch: u64,
        outcome: std::result::Result<EventHandle, Option<EventHandle>>,
        own: bool,
    ) {
        if own {
            self.claims.records_in_flight -= 1;
        }
        let f = self.streams.entry(stream);
        match outcome {
            Ok(event) => f.recorded(epoch, event),
            Err(spare) => {
                f.record_failed(epoch);
                if let Some(event) = spare {
                    f.return_event(event);
                }
            }
        }
    }

    /// Streams with a free whose own event record failed and that no record since covers:
    /// (stream, newest epoch, spare event). Never a stream whose frees wait only for their own
    /// records still in flight (see `StreamFrees::needs_event`).
    pub fn streams_needing_events(&mut self) -> Vec<(u64, u64, Option<EventHandle>)> {
        self.streams.needing_events(EVENTS_IN_FLIGHT)
    }

    /// `streams_needing_events` for `stream` alone: (newest epoch, spare event).
    pub fn stream_needing_event(&mut self, stream: u64) -> Option<(u64, Option<EventHandle>)> {
        self.streams.needing_event(stream, EVENTS_IN_FLIGHT)
    }

    /// Whether any recorded event is not known complete (what `events_to_query` would list).
    pub fn has_listed_events(&self) -> bool {
        self.streams.iter().any(|(_, f)| f.events().next().is_some())
    }

    /// Every recorded event not known complete, per stream, oldest epoch first. Frees on one
    /// stream from two threads may record their events in the other order than their epochs
    /// (each records after leaving the lock), so the list is sorted: a poll queries the newest
    /// epoch's event, which covers every older one (its record came after all their frees).
    pub fn events_to_query(&self) -> Vec<(u64, Vec<(u64, EventHandle)>)> {
        self.streams
            .iter()
            .map(|(s, f)| {
                let mut evs = f.events().collect::<Vec<_>>();
                evs.sort_unstable_by_key(|&(epoch, _)| epoch);
                (s, evs)
            })
            .filter(|(_, evs)| !evs.is_empty())
            .collect()
    }

    /// Notes that every event of `stream` up to `event` has completed: what they cover becomes
    /// free for every stream.
    pub fn events_completed(&mut self, stream: u64, epoch: u64, event: EventHandle) {
        // A stream already forgotten: another poller applied this completion.
        let Some(f) = self.streams.get_mut(stream) else { return };
        let done = f.completed(epoch, event);
        // Quarantined chunks of this stream whose epoch is now done become bare, in order.
        let pool = &mut self.pool;
        self.claims.quarantine.retain(|q| {
            let free = q.1 == stream && f.is_done(q.2);
            if free {
                pool.put_bare(q.0);
            }
            !free
        });
        // Sub-page blocks it freed become free for every stream.
        if let Some(upto) = f.done_epoch() {
            let emptied = self.sub.settle(stream, upto);
            for e in emptied.into_iter().chain(self.carved.settle(stream, upto)) {
                self.arena_emptied(e);
            }
            self.uncarve_freed();
        }
        // Then the joined frees this completion finished: their other streams were done before.
        let joined = self.streams.take_joined_done();
        for item in done.into_iter().chain(joined) {
            match item {
                Pending::Range { id, pages, va } => {
                    self.streams.range_left(pages);
                    if self.range(id).use_ == Use::Pending {
                        self.note(HistoryAction::FreeCompleted, va, self.bytes(pages), stream);
                    }
                    self.cache_range(id);
                }
                Pending::Block { ptr, rounded } => {
                    self.note(HistoryAction::FreeCompleted, ptr, rounded, stream);
                    let (va, arena) = self.ranges.at_or_below(ptr).expect("block's arena");
                    self.release_backing(Backing::Sub { arena, offset: ptr - va });
                }
                // A growable's shrink (its chunks left the quarantine above), or a joined free's
                // mark on this stream (the free itself completes with its last mark).
                Pending::Mark => {}
            }
        }
        if let Some(spare) = self.streams.forget_if_idle(stream) {
            self.streams.stock.extend(spare);
        }
    }

    /// Whether some plan holds claimed chunks or addresses while it runs, or a free's own event
    /// record is still to be settled: a request short of memory waits for either.
    pub fn has_inflight(&self) -> bool {
        self.claims.any()
    }

    /// Whether frees on streams are still waiting for their events.
    pub fn has_pending_frees(&self) -> bool {
        self.streams.any_pending() || !self.claims.quarantine.is_empty()
    }
}
