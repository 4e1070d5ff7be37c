//! Stream-ordered frees: what each stream has freed but its own work may still use. Items wait
//! here until an event recorded after their free has completed; until then only their own stream
//! may reuse them (stream order makes that safe): ranges by exact size, lowest address first, as
//! the heap's cache hands them out. Sub-page blocks wait in their arenas instead, held for their
//! stream (`SubPage`); a stream here only notes the newest such free's epoch. A free that other
//! streams also used (`record_stream`) is *joined*: it waits for a mark on each of those streams
//! and no stream may reuse it before every mark has completed. Pure bookkeeping.

use std::collections::VecDeque;

// Keys are the allocator's own pointers and ids, hashed on every request: a fast hash, not a
// DoS-resistant one.
#[cfg(not(loom))]
use foldhash::HashMap;
/// Under loom, a fixed seed: polls walk the streams in map order, and each model's runs must
/// make the same calls in the same order.
#[cfg(loom)]
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

use super::sorted::SortedMap;
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

#[derive(Clone, Copy, Debug)]
struct Item {
    epoch: u64,
    what: Pending,
}

/// A stream's pending items in the order of their sequence numbers, which only grow: a deque
/// with a hole where an item was taken out of the middle (a range reused by its stream), so
/// that a free is an append and a reuse a binary search, with no tree to rebalance on the
/// allocation path. Holes at either end are dropped at once, the others once they outnumber
/// the items.
#[derive(Debug, Default)]
struct Items {
    slots: VecDeque<(u64, Option<Item>)>,
    len: usize,
}

impl Items {
    fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[cfg(all(test, not(loom)))]
    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, seq: u64, item: Item) {
        debug_assert!(self.slots.back().map_or(true, |&(s, _)| s < seq), "sequence numbers grow");
        self.slots.push_back((seq, Some(item)));
        self.len += 1;
    }

    fn remove(&mut self, seq: u64) -> Option<Item> {
        let i = self.slots.binary_search_by_key(&seq, |&(s, _)| s).ok()?;
        let item = self.slots[i].1.take()?;
        self.len -= 1;
        while self.slots.front().is_some_and(|(_, it)| it.is_none()) {
            self.slots.pop_front();
        }
        while self.slots.back().is_some_and(|(_, it)| it.is_none()) {
            self.slots.pop_back();
        }
        if self.slots.len() > 2 * self.len + 64 {
            self.slots.retain(|(_, it)| it.is_some());
        }
        Some(item)
    }

    /// (sequence number, item), oldest first.
    fn iter(&self) -> impl Iterator<Item = (u64, &Item)> + '_ {
        self.slots.iter().filter_map(|(s, it)| it.as_ref().map(|it| (*s, it)))
    }
}

/// A stream's pending ranges by size: for each page count, address -> sequence number (addresses
/// are unique among pending ranges), so that the lowest-addressed range of a size is the first
/// of its map. Maps of sizes no longer pending are kept for reuse (a training step frees and asks
/// for the same sizes again), and dropped once they outnumber the sizes in use.
#[derive(Debug, Default)]
struct RangesBySize {
    by_pages: HashMap<u64, SortedMap<u64>>,
    sizes_in_use: usize,
}

impl RangesBySize {
    fn insert(&mut self, pages: u64, va: u64, seq: u64) {
        let map = self.by_pages.entry(pages).or_default();
        if map.len() == 0 {
            self.sizes_in_use += 1;
        }
        map.insert(va, seq);
    }

    fn remove(&mut self, pages: u64, va: u64, seq: u64) {
        let Some(map) = self.by_pages.get_mut(&pages) else {
            return;
        };
        if map.get(va) != Some(&seq) {
            return;
        }
        map.remove(va);
        if map.len() == 0 {
            self.sizes_in_use -= 1;
            if self.by_pages.len() > 4 * self.sizes_in_use + 64 {
                self.by_pages.retain(|_, m| m.len() > 0);
            }
        }
    }

    fn first(&self, pages: u64) -> Option<(u64, u64)> {
        self.by_pages.get(&pages)?.first().map(|(va, &seq)| (va, seq))
    }

    /// (pages, address, sequence number) of every range, for checks.
    fn all(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.by_pages.iter().flat_map(|(&p, m)| m.iter().map(move |(va, &seq)| (p, va, seq)))
    }
}

/// One stream's pending frees and the events that will complete them.
#[derive(Debug, Default)]
pub(crate) struct StreamFrees {
    /// Items by a global sequence number, so the oldest come first.
    items: Items,
    /// Ranges by size, lowest address first.
    ranges_by_size: RangesBySize,
    /// The newest free's epoch. Epochs are the frees' global sequence numbers, so they only
    /// grow, across streams and across a stream forgotten and seen again.
    newest: Option<u64>,
    /// Events recorded, oldest first, with the newest epoch each covers.
    events: VecDeque<(u64, EventHandle)>,
    /// Events done and ready to be recorded again.
    spare_events: Vec<EventHandle>,
    /// The highest epoch a recorded event covers.
    covered: Option<u64>,
    /// The highest epoch known to have completed.
    done: Option<u64>,
    /// The highest epoch whose own event record failed: the worker records one for it.
    failed: Option<u64>,
    /// Pages in this stream's pending ranges.
    range_pages: u64,
    /// The newest epoch of a sub-page free, whose block waits in its arena, held for this
    /// stream (`SubPage`), not here.
    held: Option<u64>,
}

impl StreamFrees {
    /// Whether nothing freed here waits: no item, and no sub-page free held in an arena.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty() && self.held <= self.done
    }

    /// Records a sub-page free of sequence number `seq`, whose block waits in its arena held for
    /// this stream; returns its epoch.
    pub fn hold(&mut self, seq: u64) -> u64 {
        self.newest = Some(seq);
        self.held = Some(seq);
        seq
    }

    #[cfg(all(test, not(loom)))]
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// A stream seen for the first time, or again after it was forgotten, when the next free's
    /// sequence number is `next_seq`: every epoch before it that was this stream's had completed
    /// (a stream is forgotten only then), so it counts as done.
    pub fn new(next_seq: u64) -> Self {
        StreamFrees { done: next_seq.checked_sub(1), ..Default::default() }
    }

    /// Records a free, whose epoch is its global sequence number `seq`; returns the epoch.
    pub fn push(&mut self, seq: u64, what: Pending) -> u64 {
        let epoch = seq;
        self.newest = Some(epoch);
        self.items.push(seq, Item { epoch, what });
        match what {
            Pending::Range { pages, va, .. } => {
                self.range_pages += pages;
                self.ranges_by_size.insert(pages, va, seq);
            }
            Pending::Block { .. } => debug_assert!(false, "blocks wait in their arenas"),
            Pending::Mark => {}
        }
        epoch
    }

    /// Records, under sequence number `seq`, something that waits for an earlier free of this
    /// stream, of `epoch`: it completes once that epoch has, and every item recorded before it
    /// (completions are taken in order).
    pub fn push_at(&mut self, seq: u64, epoch: u64, what: Pending) {
        debug_assert!(self.newest.is_some_and(|n| n >= epoch), "an epoch never handed out");
        self.items.push(seq, Item { epoch, what });
        if let Pending::Range { pages, va, .. } = what {
            self.range_pages += pages;
            self.ranges_by_size.insert(pages, va, seq);
        }
    }

    fn remove(&mut self, seq: u64) -> Pending {
        let item = self.items.remove(seq).expect("pending item missing");
        match item.what {
            Pending::Range { pages, va, .. } => {
                self.range_pages -= pages;
                self.ranges_by_size.remove(pages, va, seq);
            }
            Pending::Block { .. } | Pending::Mark => {}
        }
        item.what
    }

    /// The lowest-addressed range of exactly `pages` pages, for reuse by this stream, as
    /// (address, sequence number for `take`).
    pub fn peek_range(&self, pages: u64) -> Option<(u64, u64)> {
        self.ranges_by_size.first(pages)
    }

    /// Takes the pending range that `peek_range` gave `seq` for.
    pub fn take(&mut self, seq: u64) -> u32 {
        match self.remove(seq) {
            Pending::Range { id, .. } => id,
            Pending::Block { .. } | Pending::Mark => unreachable!("peeked a range"),
        }
    }

    /// The lowest-addressed range of exactly `pages` pages (the heap peeks first, to compare
    /// it with the cache's).
    #[cfg(all(test, not(loom)))]
    pub fn take_range(&mut self, pages: u64) -> Option<u32> {
        let (_, seq) = self.peek_range(pages)?;
        Some(self.take(seq))
    }

    /// The oldest range of at most `pages` pages whose free an event already covers, for this
    /// stream to remap its chunks: (range, pages, epoch).
    pub fn take_covered_range_at_most(&mut self, pages: u64) -> Option<(u32, u64, u64)> {
        let covered = self.covered?;
        let (seq, item) = self.items.iter().find(|(_, it)| {
            it.epoch <= covered && matches!(it.what, Pending::Range { pages: p, .. } if p <= pages)
        })?;
        let epoch = item.epoch;
        match self.remove(seq) {
            Pending::Range { id, pages, .. } => Some((id, pages, epoch)),
            Pending::Block { .. } | Pending::Mark => unreachable!("matched a range above"),
        }
    }

    /// The oldest range whose free an event already covers and that `pick` accepts:
    /// (range, pages, epoch).
    pub fn take_covered_range_where(
        &mut self,
        pick: impl Fn(u32) -> bool,
    ) -> Option<(u32, u64, u64)> {
        let covered = self.covered?;
        let (seq, item) = self.items.iter().find(|(_, it)| {
            it.epoch <= covered && matches!(it.what, Pending::Range { id, .. } if pick(id))
        })?;
        let epoch = item.epoch;
        match self.remove(seq) {
            Pending::Range { id, pages, .. } => Some((id, pages, epoch)),
            Pending::Block { .. } | Pending::Mark => unreachable!("matched a range above"),
        }
    }

    /// Pages in this stream's pending ranges.
    pub fn range_pages(&self) -> u64 {
        self.range_pages
    }

    /// Whether the free of `epoch` has completed.
    pub fn is_done(&self, epoch: u64) -> bool {
        self.done.is_some_and(|d| d >= epoch)
    }

    /// The highest epoch known to have completed.
    pub fn done_epoch(&self) -> Option<u64> {
        self.done
    }

    /// The newest epoch handed out, if any free happened: an event recorded now covers it.
    pub fn newest_epoch(&self) -> Option<u64> {
        self.newest
    }

    /// Whether nothing here is left to wait for: no pending free, no event listed, and every
    /// epoch handed out known complete (so nothing retired or quarantined waits for this
    /// stream). Such a stream can be forgotten.
    pub fn is_idle(&self) -> bool {
        self.items.is_empty() && self.events.is_empty() && self.newest <= self.done
    }

    /// Takes the spare events, for the stock, when the stream is forgotten.
    pub fn take_spare_events(&mut self) -> Vec<EventHandle> {
        std::mem::take(&mut self.spare_events)
    }

    /// Whether a free whose own event record failed waits for an event no record since covers:
    /// the worker's to record. A free whose own record is still to come is not: its thread
    /// records it, and once that free returns the user may destroy the stream, after which no
    /// one may record on it.
    pub fn needs_event(&self) -> bool {
        !self.is_empty() && self.failed > self.covered
    }

    /// Notes that the record of an event for the free of `epoch` failed.
    pub fn record_failed(&mut self, epoch: u64) {
        self.failed = self.failed.max(Some(epoch));
    }

    /// Notes that the free of `epoch` records no event of its own: as for a failed record, the
    /// stream needs one until a later record covers it.
    pub fn leave_unrecorded(&mut self, epoch: u64) {
        self.record_failed(epoch);
    }

    /// A spare event, if any.
    #[cfg(all(test, not(loom)))]
    pub fn spare_event(&mut self) -> Option<EventHandle> {
        self.spare_events.pop()
    }

    /// An event to record for the newest free: with `cap` events listed already, the newest of
    /// them, taken off the list (recording it again moves it after this free, and it covers
    /// every epoch its old record did); otherwise a spare one, if any. So a stream freeing
    /// faster than its events are polled keeps at most `cap` events in flight instead of one a
    /// free, and the older ones, never recorded again, complete when the device passes them.
    /// Until the new record is listed, the frees the old one covered wait for it: late, never
    /// early. A poller holding the old pair finds it gone.
    pub fn event_to_record(&mut self, cap: usize) -> Option<EventHandle> {
        if self.events.len() >= cap.max(1) {
            return self.events.pop_back().map(|(_, ev)| ev);
        }
        self.spare_events.pop()
    }

    /// Notes that `event`, recorded after the free of epoch `epoch`, covers every epoch up to it.
    pub fn recorded(&mut self, epoch: u64, event: EventHandle) {
        self.covered = self.covered.max(Some(epoch));
        self.events.push_back((epoch, event));
    }

    /// Gives back an event that could not be recorded.
    pub fn return_event(&mut self, event: EventHandle) {
        self.spare_events.push(event);
    }

    /// Events to query, as (epoch, event).
    pub fn events(&self) -> impl Iterator<Item = (u64, EventHandle)> + '_ {
        self.events.iter().copied()
    }

    /// Notes that `event`, recorded for `epoch`, has completed: every free up to `epoch` has
    /// (the event was recorded after those epochs were handed out, whatever order the events
    /// were recorded in). Returns the items this frees, oldest first. A pair that is no longer
    /// listed (another poller completed it, and the event may since have been recorded again for
    /// a later epoch) changes nothing.
    ///
    /// Events listed for earlier epochs cover nothing more: they are dropped and become spare
    /// too, so a burst of frees gives all its events back at the first completion seen. One of
    /// them may still be pending on the device; recording it again replaces that record, and a
    /// poller still holding its old pair finds the pair gone, as above.
    pub fn completed(&mut self, epoch: u64, event: EventHandle) -> Vec<Pending> {
        let Some(i) = self.events.iter().position(|&e| e == (epoch, event)) else {
            return Vec::new();
        };
        self.events.remove(i);
        self.spare_events.push(event);
        let spare = &mut self.spare_events;
        self.events.retain(|&(e, ev)| {
            let redundant = e <= epoch;
            if redundant {
                spare.push(ev);
            }
            !redundant
        });
        self.done = self.done.max(Some(epoch));
        let done: Vec<u64> =
            self.items.iter().take_while(|(_, it)| it.epoch <= epoch).map(|(s, _)| s).collect();
        done.into_iter().map(|s| self.remove(s)).collect()
    }

    /// Checks the bookkeeping of the items: sequence numbers increasing, no hole at either end
    /// of the deque, the count, and the size index and page count matching the ranges.
    pub fn check(&self) -> Result<(), String> {
        let slots = &self.items.slots;
        if slots.iter().zip(slots.iter().skip(1)).any(|(a, b)| a.0 >= b.0) {
            return Err("pending items out of sequence order".into());
        }
        if slots.front().is_some_and(|s| s.1.is_none())
            || slots.back().is_some_and(|s| s.1.is_none())
        {
            return Err("a hole at an end of the pending items".into());
        }
        if slots.iter().filter(|s| s.1.is_some()).count() != self.items.len {
            return Err("pending item count drifted".into());
        }
        let mut ranges: Vec<(u64, u64, u64)> = self
            .items
            .iter()
            .filter_map(|(seq, it)| match it.what {
                Pending::Range { pages, va, .. } => Some((pages, va, seq)),
                _ => None,
            })
            .collect();
        let mut indexed: Vec<(u64, u64, u64)> = self.ranges_by_size.all().collect();
        ranges.sort_unstable();
        indexed.sort_unstable();
        if ranges != indexed {
            return Err(format!(
                "the size index holds {} ranges for {} pending",
                indexed.len(),
                ranges.len()
            ));
        }
        let in_use = self.ranges_by_size.by_pages.values().filter(|m| m.len() > 0).count();
        if in_use != self.ranges_by_size.sizes_in_use {
            return Err("the size index's count of sizes drifted".into());
        }
        for m in self.ranges_by_size.by_pages.values() {
            m.check()?;
        }
        if ranges.iter().map(|r| r.0).sum::<u64>() != self.range_pages {
            return Err("pending range pages drifted".into());
        }
        Ok(())
    }

    /// Every item, for checks.
    pub fn items(&self) -> impl Iterator<Item = Pending> + '_ {
        self.items.iter().map(|(_, it)| it.what)
    }

    /// Every event this stream holds (recorded and spare), for teardown.
    pub fn all_events(&self) -> Vec<EventHandle> {
        self.events.iter().map(|e| e.1).chain(self.spare_events.iter().copied()).collect()
    }
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
        let mut out = Vec::new();
        for (&s, f) in self.by_stream.iter_mut() {
            if f.needs_event() {
                let epoch = f.newest_epoch().expect("a stream with frees has an epoch");
                let ev = f.event_to_record(cap).or_else(|| self.stock.pop());
                out.push((s, epoch, ev));
            }
        }
        out
    }

    /// Whether any stream has frees waiting.
    pub fn any_pending(&self) -> bool {
        !self.joined.is_empty() || self.by_stream.values().any(|f| !f.is_empty())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn mark(epoch: u64) -> Item {
        Item { epoch, what: Pending::Mark }
    }

    #[test]
    fn items_keep_their_order_through_holes_and_drop_them() {
        let mut items = Items::default();
        for seq in (10..310).step_by(3) {
            items.push(seq, mark(seq));
        }
        // Holes in the middle stay (in order) until they outnumber the items...
        for seq in (13..250).step_by(6) {
            assert_eq!(items.remove(seq).map(|it| it.epoch), Some(seq));
        }
        assert!(items.remove(13).is_none(), "taken twice");
        assert!(items.remove(11).is_none(), "never there");
        let left: Vec<u64> = items.iter().map(|(s, _)| s).collect();
        let want: Vec<u64> =
            (10..310).step_by(3).filter(|s| !(13..250).step_by(6).any(|r| r == *s)).collect();
        assert_eq!(left, want);
        assert_eq!(items.len(), want.len());
        // ...and those at the front go with the item before them.
        assert!(items.remove(10).is_some());
        assert_eq!(items.slots.front().map(|&(s, _)| s), Some(16));
        for &s in &want[1..] {
            assert!(items.remove(s).is_some());
        }
        assert!(items.is_empty() && items.slots.is_empty());
        // Many holes behind a long-lived first item are compacted away.
        items.push(1_000, mark(1));
        for seq in 1_001..2_000 {
            items.push(seq, mark(seq));
            if seq > 1_001 {
                assert!(items.remove(seq - 1).is_some());
            }
        }
        assert!(items.slots.len() <= 2 * items.len() + 64, "{} slots", items.slots.len());
        assert_eq!(items.iter().map(|(s, _)| s).collect::<Vec<_>>(), vec![1_000, 1_999]);
    }

    #[test]
    fn ranges_by_size_give_the_lowest_address_and_forget_sizes_gone() {
        let mut r = RangesBySize::default();
        for (va, seq) in [(500, 1), (100, 2), (300, 3), (200, 4)] {
            r.insert(4, va, seq);
        }
        r.insert(2, 50, 5);
        assert_eq!(r.first(4), Some((100, 2)));
        r.remove(4, 100, 2);
        assert_eq!(r.first(4), Some((200, 4)));
        r.remove(4, 200, 7); // another sequence number at that address: nothing happens
        assert_eq!(r.first(4), Some((200, 4)));
        r.remove(4, 200, 4);
        r.remove(4, 999, 9); // not there: nothing happens
        assert_eq!(r.first(4), Some((300, 3)));
        assert_eq!(r.first(2), Some((50, 5)));
        assert_eq!(r.first(3), None);
        assert_eq!(r.sizes_in_use, 2);
        // A thousand sizes come and go: the lists of gone ones are dropped.
        for pages in 100..1_100 {
            r.insert(pages, pages, pages);
            r.remove(pages, pages, pages);
        }
        assert_eq!(r.sizes_in_use, 2);
        assert!(r.by_pages.len() <= 4 * 2 + 64 + 1, "{} lists kept", r.by_pages.len());
        assert_eq!(r.first(4), Some((300, 3)));
        // Thousands of one size, in a scrambled order: the lowest address first throughout.
        let vas: Vec<u64> = (0..5_000u64).map(|i| (i * 7_919) % 5_000 + 1_000).collect();
        for (i, &va) in vas.iter().enumerate() {
            r.insert(8, va, 10_000 + i as u64);
        }
        for want in 1_000..6_000u64 {
            let (va, seq) = r.first(8).expect("pending");
            assert_eq!(va, want);
            r.remove(8, va, seq);
        }
        assert_eq!(r.first(8), None);
    }

    #[test]
    fn same_stream_reuse_by_exact_size_lowest_address_first() {
        let mut s = StreamFrees::default();
        s.push(1, Pending::Range { id: 10, va: 0x9000, pages: 4 });
        s.push(2, Pending::Range { id: 11, va: 0x5000, pages: 4 });
        s.push(3, Pending::Range { id: 12, va: 0x7000, pages: 4 });
        s.push(4, Pending::Mark);
        assert_eq!(s.take_range(3), None);
        assert_eq!(s.peek_range(4), Some((0x5000, 2)));
        assert_eq!(s.take_range(4), Some(11));
        assert_eq!(s.take_range(4), Some(12));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn a_held_sub_page_free_keeps_the_stream_waiting_and_an_arena_after_it_completes_in_order() {
        let mut s = StreamFrees::new(0);
        let e0 = s.hold(0);
        assert!(!s.is_empty() && !s.is_idle(), "a held block waits for its epoch");
        s.record_failed(e0);
        assert!(s.needs_event(), "held space needs an event to go back to other streams");
        let e1 = s.push(1, Pending::Range { id: 3, va: 0x4000, pages: 1 });
        // An arena emptied later, held until e0: it completes after e1's range, in order.
        s.push_at(2, e0, Pending::Range { id: 4, va: 0x1000, pages: 1 });
        assert_eq!(s.peek_range(1), Some((0x1000, 2)), "lowest address first");
        s.recorded(e0, EventHandle(1));
        assert!(s.completed(e0, EventHandle(1)).is_empty(), "behind e1's range");
        s.recorded(e1, EventHandle(2));
        let done = s.completed(e1, EventHandle(2));
        assert_eq!(done.len(), 2);
        assert!(s.is_empty() && s.is_idle());
    }

    #[test]
    fn only_a_free_whose_own_record_failed_needs_the_workers_event() {
        let mut s = StreamFrees::default();
        let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
        assert!(!s.needs_event(), "the free's own record is still to come");
        s.record_failed(e0);
        assert!(s.needs_event(), "its own record failed");
        let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
        s.recorded(e1, EventHandle(100));
        assert!(!s.needs_event(), "the later free's event covers the failed one");
        let e2 = s.push(3, Pending::Range { id: 3, va: 0, pages: 1 });
        s.record_failed(e2);
        assert!(s.needs_event());
        assert_eq!(s.completed(e1, EventHandle(100)).len(), 2);
        assert!(s.needs_event(), "the third free still waits for an event");
        s.take_range(1).unwrap();
        assert!(!s.needs_event(), "nothing left to cover");
    }

    #[test]
    fn an_idle_stream_is_forgotten_and_seen_again_with_its_past_done() {
        let mut all = Streams::default();
        let e0 = all.push(7, Pending::Range { id: 1, va: 0, pages: 1 });
        assert!(all.forget_if_idle(7).is_none(), "a free is pending");
        all.entry(7).recorded(e0, EventHandle(1));
        assert_eq!(all.entry(7).completed(e0, EventHandle(1)).len(), 1);
        assert_eq!(all.forget_if_idle(7), Some(vec![EventHandle(1)]), "its event goes back");
        assert!(all.get(7).is_none());

        let e1 = all.push(7, Pending::Range { id: 2, va: 0, pages: 1 });
        assert!(e1 > e0, "epochs keep growing across a forgotten stream");
        assert!(all.get(7).unwrap().is_done(e0), "the stream's past counts as done");
        assert!(!all.get(7).unwrap().is_done(e1), "its new free does not");
        // Taken back by its own stream, with its record failed: nothing pending and no event
        // listed, but its epoch is not known done (something retired may wait for it).
        all.entry(7).record_failed(e1);
        all.get_mut(7).unwrap().take_range(1).unwrap();
        assert!(all.forget_if_idle(7).is_none(), "an epoch not known done");
        let e2 = all.push(7, Pending::Range { id: 3, va: 0, pages: 1 });
        all.entry(7).recorded(e2, EventHandle(2));
        assert_eq!(all.entry(7).completed(e2, EventHandle(2)).len(), 1);
        assert!(all.get(7).unwrap().is_done(e1));
        assert_eq!(all.forget_if_idle(7), Some(vec![EventHandle(2)]));
    }

    #[test]
    fn a_joined_free_completes_with_its_last_mark_and_no_stream_reuses_it_before() {
        let mut all = Streams::default();
        let what = Pending::Range { id: 4, va: 0, pages: 3 };
        let waits = all.push_joined(&[1, 2], what);
        assert_eq!(waits.iter().map(|w| w.0).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(all.pending_pages(), 3);
        assert!(all.any_pending());
        // Neither stream can take it back as its own.
        assert_eq!(all.get_mut(1).unwrap().take_range(3), None);
        assert_eq!(all.get_mut(2).unwrap().take_range(3), None);
        let (e1, e2) = (waits[0].1, waits[1].1);
        all.entry(1).recorded(e1, EventHandle(1));
        all.entry(2).recorded(e2, EventHandle(2));
        assert_eq!(all.entry(2).completed(e2, EventHandle(2)), vec![Pending::Mark]);
        assert!(all.take_joined_done().is_empty(), "stream 1 has not passed its mark");
        assert_eq!(all.forget_if_idle(2), Some(vec![EventHandle(2)]), "stream 2 is done");
        assert_eq!(all.entry(1).completed(e1, EventHandle(1)), vec![Pending::Mark]);
        // Stream 2, forgotten, counts as done.
        assert_eq!(all.take_joined_done(), vec![what]);
        assert!(all.take_joined_done().is_empty(), "taken once");
        assert_eq!(all.joined().count(), 0);
    }

    #[test]
    fn an_event_completes_exactly_the_frees_before_it() {
        let mut s = StreamFrees::default();
        let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
        s.recorded(e0, EventHandle(100));
        let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
        s.recorded(e1, EventHandle(101));
        s.push(3, Pending::Range { id: 3, va: 0, pages: 1 });
        assert_eq!(
            s.completed(e0, EventHandle(100)),
            vec![Pending::Range { id: 1, va: 0, pages: 1 }]
        );
        assert_eq!(
            s.completed(e1, EventHandle(101)),
            vec![Pending::Range { id: 2, va: 0, pages: 1 }]
        );
        assert_eq!(s.len(), 1);
        assert_eq!(s.spare_event(), Some(EventHandle(101)));
    }

    #[test]
    fn a_later_event_covers_earlier_frees_that_had_none() {
        let mut s = StreamFrees::default();
        s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
        let e = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
        s.recorded(e, EventHandle(7));
        assert_eq!(s.completed(e, EventHandle(7)).len(), 2);
        assert!(s.is_empty());
    }

    #[test]
    fn reused_items_do_not_complete_twice() {
        let mut s = StreamFrees::default();
        let e = s.push(1, Pending::Range { id: 1, va: 0, pages: 2 });
        s.recorded(e, EventHandle(7));
        assert_eq!(s.take_range(2), Some(1));
        assert!(s.completed(e, EventHandle(7)).is_empty());
    }

    #[test]
    fn a_stale_completion_changes_nothing() {
        let mut s = StreamFrees::default();
        let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
        s.recorded(e0, EventHandle(7));
        assert_eq!(s.completed(e0, EventHandle(7)).len(), 1);
        // Event 7 is spare, then recorded again for a later free that has not completed.
        let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
        let ev = s.spare_event().unwrap();
        s.recorded(e1, ev);
        // A second poller that saw event 7 done for epoch e0 must not complete epoch e1.
        assert!(s.completed(e0, EventHandle(7)).is_empty());
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn events_recorded_out_of_epoch_order_complete_only_what_they_cover() {
        let mut s = StreamFrees::default();
        let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
        let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
        // Two threads: the later epoch's event lands in the list first.
        s.recorded(e1, EventHandle(11));
        s.recorded(e0, EventHandle(10));
        // Event 10 (epoch e0) done: only the first free, even though event 11 is ahead of it.
        assert_eq!(
            s.completed(e0, EventHandle(10)),
            vec![Pending::Range { id: 1, va: 0, pages: 1 }]
        );
        assert_eq!(s.len(), 1);
        assert_eq!(s.completed(e1, EventHandle(11)).len(), 1);
    }

    #[test]
    fn at_the_cap_the_newest_event_is_recorded_again() {
        let mut s = StreamFrees::default();
        s.return_event(EventHandle(50));
        let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
        let ev = s.event_to_record(2).unwrap();
        s.recorded(e0, ev);
        let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
        assert_eq!(s.event_to_record(2), None, "below the cap: no spare, the caller makes one");
        s.recorded(e1, EventHandle(51));
        // At the cap: the newest (51) comes off the list, to be recorded again for epoch e2.
        let e2 = s.push(3, Pending::Range { id: 3, va: 0, pages: 1 });
        assert_eq!(s.event_to_record(2), Some(EventHandle(51)));
        assert_eq!(s.events().count(), 1);
        // A poller that saw 51 done for e1 changes nothing: e1 waits for the new record.
        assert!(s.completed(e1, EventHandle(51)).is_empty());
        s.recorded(e2, EventHandle(51));
        assert_eq!(s.completed(e2, EventHandle(51)).len(), 3);
        assert!(s.is_empty());
    }

    #[test]
    fn a_completion_gives_back_the_events_of_earlier_epochs() {
        let mut s = StreamFrees::default();
        let epochs: Vec<u64> =
            (0..4).map(|i| s.push(i, Pending::Range { id: i as u32, va: 0, pages: 1 })).collect();
        for (i, &e) in epochs.iter().enumerate() {
            s.recorded(e, EventHandle(20 + i as u64));
        }
        // The third event done: the first three frees, and the first three events spare (the
        // first two cover nothing more); the fourth stays listed.
        assert_eq!(s.completed(epochs[2], EventHandle(22)).len(), 3);
        assert_eq!(s.events().collect::<Vec<_>>(), vec![(epochs[3], EventHandle(23))]);
        let mut spare: Vec<u64> = std::iter::from_fn(|| s.spare_event()).map(|e| e.0).collect();
        spare.sort_unstable();
        assert_eq!(spare, vec![20, 21, 22]);
        // A poller that saw event 20 done for its old epoch changes nothing now.
        assert!(s.completed(epochs[0], EventHandle(20)).is_empty());
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn a_redundant_event_recorded_again_covers_only_its_new_free() {
        let mut s = StreamFrees::default();
        let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
        s.recorded(e0, EventHandle(30));
        let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
        s.recorded(e1, EventHandle(31));
        assert_eq!(s.completed(e1, EventHandle(31)).len(), 2);
        // Event 30 may still be pending on the device; it is spare, and a new free records it.
        let e2 = s.push(3, Pending::Range { id: 3, va: 0, pages: 1 });
        let ev = std::iter::from_fn(|| s.spare_event()).find(|e| e.0 == 30).unwrap();
        s.recorded(e2, ev);
        assert!(s.completed(e0, EventHandle(30)).is_empty(), "the old pair is gone");
        assert_eq!(s.len(), 1);
        assert_eq!(
            s.completed(e2, EventHandle(30)),
            vec![Pending::Range { id: 3, va: 0, pages: 1 }]
        );
    }
}

/// A loom model of the event-completion protocol, the part of the stream front end that runs
/// across lock releases: pollers take a snapshot of (epoch, event) pairs under the lock, ask the
/// device without it, and apply what they saw under it again, while a freeing thread reuses a
/// spare event for a later free. The property: a free is never completed before the record of
/// an event that covers it has completed. (An earlier version failed exactly this on an H200.)
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::sync::atomic::{AtomicU64, Ordering};
    use loom::sync::{Arc, Mutex};
    use loom::thread;

    /// The device: for each event handle, the number of its latest record and how many of its
    /// records have completed (records complete in order, as on one stream).
    struct Device {
        latest: [AtomicU64; 2],
        completed: [AtomicU64; 2],
    }

    impl Device {
        fn done(&self, ev: EventHandle) -> bool {
            let i = ev.0 as usize;
            self.completed[i].load(Ordering::SeqCst) >= self.latest[i].load(Ordering::SeqCst)
        }
    }

    /// `Shared::poll_events` for one stream: the newest pair first, then the oldest onwards
    /// until one is pending.
    fn poll(frees: &Mutex<StreamFrees>, device: &Device, out: &Mutex<Vec<Pending>>) {
        let snapshot: Vec<(u64, EventHandle)> = frees.lock().unwrap().events().collect();
        let Some((&newest, older)) = snapshot.split_last() else { return };
        let apply = |(epoch, ev): (u64, EventHandle)| {
            let done = device.done(ev);
            if done {
                let items = frees.lock().unwrap().completed(epoch, ev);
                out.lock().unwrap().extend(items);
            }
            done
        };
        if apply(newest) {
            return;
        }
        for &pair in older {
            if !apply(pair) {
                break;
            }
        }
    }

    /// One model: `setup` lists frees and events (event `i` has `latest[i]` records so far); the
    /// device completes event `completes`'s first record while two pollers run and a late free
    /// (range `late`) records the event `event_to_record(cap)` gives, if any. That record never
    /// completes, so the late free must never be completed.
    fn check_late_free(
        latest: [u64; 2],
        completes: usize,
        cap: usize,
        late: u32,
        setup: fn(&mut StreamFrees),
    ) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            let device = Arc::new(Device {
                latest: latest.map(AtomicU64::new),
                completed: [AtomicU64::new(0), AtomicU64::new(0)],
            });
            let frees = Arc::new(Mutex::new(StreamFrees::default()));
            setup(&mut frees.lock().unwrap());
            let completed_items = Arc::new(Mutex::new(Vec::new()));
            let d = device.clone();
            let dev = thread::spawn(move || d.completed[completes].store(1, Ordering::SeqCst));
            let pollers: Vec<_> = (0..2)
                .map(|_| {
                    let (f, d, o) = (frees.clone(), device.clone(), completed_items.clone());
                    thread::spawn(move || poll(&f, &d, &o))
                })
                .collect();
            let (epoch, event) = {
                let mut f = frees.lock().unwrap();
                let epoch = f.push(u64::from(late), Pending::Range { id: late, va: 0, pages: 1 });
                (epoch, f.event_to_record(cap))
            };
            if let Some(ev) = event {
                device.latest[ev.0 as usize].fetch_add(1, Ordering::SeqCst);
                frees.lock().unwrap().recorded(epoch, ev);
            }
            dev.join().unwrap();
            for p in pollers {
                p.join().unwrap();
            }
            let done = completed_items.lock().unwrap();
            assert!(
                !done.contains(&Pending::Range { id: late, va: 0, pages: 1 }),
                "the late free completed though no record after it did"
            );
        });
    }

    /// A free covered by event 0's first record, which completes; a second free records event
    /// 0 again (at a cap of 1) or the spare event 1 (once a poller has completed event 0).
    #[test]
    fn pollers_never_complete_a_free_early() {
        check_late_free([1, 0], 0, 1, 2, |f| {
            let e = f.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
            f.recorded(e, EventHandle(0));
            f.return_event(EventHandle(1));
        });
    }

    /// Two events listed in the opposite order to their records on the stream: the second
    /// completes first, which makes the first redundant, and it becomes spare while its record
    /// is still pending. A third free may record it again at once.
    #[test]
    fn a_redundant_event_reused_while_pending_completes_nothing_early() {
        check_late_free([1, 1], 1, 2, 3, |f| {
            let e1 = f.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
            let e2 = f.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
            f.recorded(e1, EventHandle(0));
            f.recorded(e2, EventHandle(1));
        });
    }
}
