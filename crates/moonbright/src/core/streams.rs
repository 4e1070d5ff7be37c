//! Stream-ordered frees: what each stream has freed but its own work may still use. Items wait
//! here until an event recorded after their free has completed; until then only their own stream
//! may reuse them (stream order makes that safe): ranges by exact size, lowest address first, as
//! the heap's cache hands them out. Sub-page blocks wait in their arenas instead, held for their
//! stream (`SubPage`); a stream here only notes the newest such free's epoch. A free that other
//! streams also used (`record_stream`) is *joined*: it waits for a mark on each of those streams
//! and no stream may reuse it before every mark has completed. Pure bookkeeping.

// Keys are the allocator's own pointers and ids, hashed on every request: a fast hash, not a
// DoS-resistant one.
#[cfg(not(loom))]
use foldhash::HashMap;
/// Under loom, a fixed seed: polls walk the streams in map order, and each model's runs must
/// make the same calls in the same order.
#[cfg(loom)]
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

use crate::driver::EventHandle;

/// The heap's stream for requests on no stream (`malloc`, and a graph pool's new blocks): no
/// real stream, so that they come only from memory no stream's pending work uses (`cudaMalloc`'s
/// promise; a graph's replays are ordered with no stream's work). Snapshots and the history show
/// it as 0 (`history::shown_stream`).
pub(crate) const NO_STREAM: u64 = u64::MAX;

/// Something freed on a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pending {
    /// A whole range of `pages` pages at `va` (an allocation of a page or more).
    Range { id: u32, va: u64, pages: u64 },
    /// A block of an arena (sub-page or carved) of a joined free, still marked used in its
    /// arena. Found by address when the free completes: a carved arena may be cut meanwhile.
    Block { ptr: u64, rounded: u64 },
    /// A point in the stream's order with nothing attached: a growable allocation shrank here,
    /// and the chunks it gave back wait in the heap's quarantine for this epoch.
    Mark,
}

/// A free that several streams' work may still use: it completes once every stream has passed
/// its mark, `waits` as (stream, epoch of the mark there).
#[derive(Debug)]
struct Joined {
    what: Pending,
    waits: Vec<(u64, u64)>,
}

/// The pending frees of every stream.
#[derive(Debug, Default)]
pub(crate) struct Streams {
    by_stream: HashMap<u64, StreamFrees>,
    /// Frees waiting for several streams, oldest first.
    joined: Vec<Joined>,
    next_seq: u64,
    /// Pages of pending ranges, joined ones included.
    pending_pages: u64,
    /// Events the background worker created ahead of need, for frees on any stream that has no
    /// spare event of its own, so that a burst of frees records events without creating them.
    pub(crate) stock: Vec<EventHandle>,
}

impl Streams {
    pub fn get(&self, stream: u64) -> Option<&StreamFrees> {
        self.by_stream.get(&stream)
    }

    pub fn get_mut(&mut self, stream: u64) -> Option<&mut StreamFrees> {
        self.by_stream.get_mut(&stream)
    }

    pub fn entry(&mut self, stream: u64) -> &mut StreamFrees {
        let next_seq = self.next_seq;
        self.by_stream.entry(stream).or_insert_with(|| StreamFrees::new(next_seq))
    }

    /// Records a free on `stream`; returns its epoch.
    pub fn push(&mut self, stream: u64, what: Pending) -> u64 {
        let seq = self.next_seq;
        if let Pending::Range { pages, .. } = what {
            self.pending_pages += pages;
        }
        let epoch = self.entry(stream).push(seq, what);
        self.next_seq += 1;
        epoch
    }

    /// Records a sub-page free on `stream`, whose block waits held in its arena; returns its
    /// epoch.
    pub fn hold(&mut self, stream: u64) -> u64 {
        let seq = self.next_seq;
        let epoch = self.entry(stream).hold(seq);
        self.next_seq += 1;
        epoch
    }

    /// Records `what` (a range) as pending on `stream` until its earlier free of `epoch` has
    /// completed.
    pub fn push_held(&mut self, stream: u64, epoch: u64, what: Pending) {
        let seq = self.next_seq;
        if let Pending::Range { pages, .. } = what {
            self.pending_pages += pages;
        }
        self.entry(stream).push_at(seq, epoch, what);
        self.next_seq += 1;
    }

    /// Records a free of `what` (a range or a block) that the work of every stream in `streams`
    /// (at least two, no repeats) may still use: each gets a mark, and no stream reuses `what`
    /// until all the marks have completed. Returns (stream, epoch of its mark), in `streams`'
    /// order; each mark needs an event recorded on its stream, as a free does.
    pub fn push_joined(&mut self, streams: &[u64], what: Pending) -> Vec<(u64, u64)> {
        debug_assert!(streams.len() >= 2, "a free on one stream is not joined");
        debug_assert!(!matches!(what, Pending::Mark), "a mark waits for nothing");
        if let Pending::Range { pages, .. } = what {
            self.pending_pages += pages;
        }
        let waits: Vec<(u64, u64)> =
            streams.iter().map(|&s| (s, self.push(s, Pending::Mark))).collect();
        self.joined.push(Joined { what, waits: waits.clone() });
        waits
    }

    /// Takes out the joined frees whose marks have all completed, oldest first. A stream no
    /// longer known was forgotten, which it is only once everything it handed out is done.
    pub fn take_joined_done(&mut self) -> Vec<Pending> {
        if self.joined.is_empty() {
            return Vec::new();
        }
        let by_stream = &self.by_stream;
        let mut done = Vec::new();
        self.joined.retain(|j| {
            let complete =
                j.waits.iter().all(|&(s, e)| by_stream.get(&s).map_or(true, |f| f.is_done(e)));
            if complete {
                done.push(j.what);
            }
            !complete
        });
        done
    }

    /// The joined frees still waiting, for checks.
    pub fn joined(&self) -> impl Iterator<Item = Pending> + '_ {
        self.joined.iter().map(|j| j.what)
    }

    /// Forgets `stream` if it is idle (`StreamFrees::is_idle`), returning its spare events: a
    /// program that makes a stream per task and destroys it leaves nothing behind, and polls
    /// walk only the streams with something pending. A stream forgotten and seen again starts
    /// with every earlier epoch done (`StreamFrees::new`).
    pub fn forget_if_idle(&mut self, stream: u64) -> Option<Vec<EventHandle>> {
        if !self.by_stream.get(&stream)?.is_idle() {
            return None;
        }
        self.by_stream.remove(&stream).map(|mut f| f.take_spare_events())
    }

    /// Notes that a range left the pending lists (reused or completed).
    pub fn range_left(&mut self, pages: u64) {
        self.pending_pages -= pages;
    }

    /// Pages in ranges freed on a stream and not completed yet.
    pub fn pending_pages(&self) -> u64 {
        self.pending_pages
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &StreamFrees)> {
        self.by_stream.iter().map(|(&s, f)| (s, f))
    }

    /// Streams with a free whose own event record failed and that no record since covers:
    /// (stream, newest epoch, an event to record: a spare of the stream's, else one from the
    /// stock), with at most `cap` events in flight a stream (`StreamFrees::event_to_record`).
    pub fn needing_events(&mut self, cap: usize) -> Vec<(u64, u64, Option<EventHandle>)> {
        let stock = &mut self.stock;
        let needing = self.by_stream.iter_mut().filter(|(_, f)| f.needs_event());
        needing
            .map(|(&s, f)| (s, f.newest_epoch_event(cap, stock)))
            .map(|(s, (e, ev))| (s, e, ev))
            .collect()
    }

    /// `needing_events` for `stream` alone.
    pub fn needing_event(&mut self, stream: u64, cap: usize) -> Option<(u64, Option<EventHandle>)> {
        let f = self.by_stream.get_mut(&stream).filter(|f| f.needs_event())?;
        Some(f.newest_epoch_event(cap, &mut self.stock))
    }

    /// Whether any stream has frees waiting.
    pub fn any_pending(&self) -> bool {
        !self.joined.is_empty() || self.by_stream.values().any(|f| !f.is_empty())
    }
}

mod frees;
pub(crate) use frees::StreamFrees;

#[cfg(all(test, not(loom)))]
mod tests;

/// A loom model of the event-completion protocol (see the module).
#[cfg(all(test, loom))]
mod loom_model;
