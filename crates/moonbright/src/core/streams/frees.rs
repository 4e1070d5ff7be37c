//! One stream's pending frees (`StreamFrees`): its items in free order, its pending ranges by
//! size for reuse by exact size, lowest address first, and the events recorded to complete
//! them, with the epochs they cover.

use std::collections::VecDeque;

use super::{HashMap, Pending};
use crate::core::sorted::SortedMap;
use crate::driver::EventHandle;

#[derive(Clone, Copy, Debug)]
pub(super) struct Item {
    pub(super) epoch: u64,
    pub(super) what: Pending,
}

/// A stream's pending items in the order of their sequence numbers, which only grow: a deque
/// with a hole where an item was taken out of the middle (a range reused by its stream), so
/// that a free is an append and a reuse a binary search, with no tree to rebalance on the
/// allocation path. Holes at either end are dropped at once, the others once they outnumber
/// the items.
#[derive(Debug, Default)]
pub(super) struct Items {
    pub(super) slots: VecDeque<(u64, Option<Item>)>,
    pub(super) len: usize,
}

impl Items {
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[cfg(all(test, not(loom)))]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn push(&mut self, seq: u64, item: Item) {
        debug_assert!(self.slots.back().map_or(true, |&(s, _)| s < seq), "sequence numbers grow");
        self.slots.push_back((seq, Some(item)));
        self.len += 1;
    }

    pub(super) fn remove(&mut self, seq: u64) -> Option<Item> {
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
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, &Item)> + '_ {
        self.slots.iter().filter_map(|(s, it)| it.as_ref().map(|it| (*s, it)))
    }
}

/// A stream's pending ranges by size: for each page count, address -> sequence number (addresses
/// are unique among pending ranges), so that the lowest-addressed range of a size is the first
/// of its map. Maps of sizes no longer pending are kept for reuse (a training step frees and asks
/// for the same sizes again), and dropped once they outnumber the sizes in use.
#[derive(Debug, Default)]
pub(super) struct RangesBySize {
    pub(super) by_pages: HashMap<u64, SortedMap<u64>>,
    pub(super) sizes_in_use: usize,
}

impl RangesBySize {
    pub(super) fn insert(&mut self, pages: u64, va: u64, seq: u64) {
        let map = self.by_pages.entry(pages).or_default();
        if map.len() == 0 {
            self.sizes_in_use += 1;
        }
        map.insert(va, seq);
    }

    pub(super) fn remove(&mut self, pages: u64, va: u64, seq: u64) {
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

    pub(super) fn first(&self, pages: u64) -> Option<(u64, u64)> {
        self.by_pages.get(&pages)?.first().map(|(va, &seq)| (va, seq))
    }

    /// (pages, address, sequence number) of every range, for checks.
    pub(super) fn all(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
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
    /// The newest epoch when a request of this stream last asked for an event to be recorded
    /// here (`ask_to_cover`): one ask per run of frees, whatever the record's outcome.
    asked: Option<u64>,
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

    /// Whether a request of this stream, about to make new memory, should record an event here
    /// first, so that its pending ranges no event covers yet may serve it (`OwnPending`): some
    /// wait for a record no thread of theirs will make (`needs_event`), and no request asked
    /// since the newest free. Noted as asked.
    pub fn ask_to_cover(&mut self) -> bool {
        if !self.needs_event() || self.asked >= self.newest {
            return false;
        }
        let covered = self.covered;
        let uncovered = self.items.slots.iter().rev().filter_map(|(_, it)| it.as_ref());
        let any = uncovered
            .take_while(|it| Some(it.epoch) > covered)
            .any(|it| matches!(it.what, Pending::Range { .. }));
        if any {
            self.asked = self.newest;
        }
        any
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

    /// The newest epoch handed out (an event recorded now covers it) and an event to record
    /// for it (`event_to_record`, else one from `stock`), for a stream that needs one
    /// (`needs_event`).
    pub fn newest_epoch_event(
        &mut self,
        cap: usize,
        stock: &mut Vec<EventHandle>,
    ) -> (u64, Option<EventHandle>) {
        let epoch = self.newest.expect("a stream with frees has an epoch");
        (epoch, self.event_to_record(cap).or_else(|| stock.pop()))
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
