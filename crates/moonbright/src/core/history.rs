//! Allocation history and the segment snapshot: what PyTorch's memory viewer reads
//! (`device_traces` and `segments`), recorded by the heap when switched on, in a bounded ring.

use crate::sync::Instant;
use std::cell::Cell;
use std::collections::VecDeque;

use super::streams::NO_STREAM;

/// What happened, in PyTorch's trace vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryAction {
    /// An allocation was made.
    Alloc,
    /// The user freed an allocation (on a stream: reuse by other streams waits for it).
    FreeRequested,
    /// The memory became reusable everywhere.
    FreeCompleted,
    /// A range was mapped (PyTorch's `segment_map`).
    SegmentMap,
    /// A range was unmapped (PyTorch's `segment_unmap`).
    SegmentUnmap,
    /// A request failed for lack of memory.
    Oom,
}

impl HistoryAction {
    /// PyTorch's name for it.
    pub fn torch_name(self) -> &'static str {
        match self {
            HistoryAction::Alloc => "alloc",
            HistoryAction::FreeRequested => "free_requested",
            HistoryAction::FreeCompleted => "free_completed",
            HistoryAction::SegmentMap => "segment_map",
            HistoryAction::SegmentUnmap => "segment_unmap",
            HistoryAction::Oom => "oom",
        }
    }
}

/// One recorded event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryEvent {
    /// What happened.
    pub action: HistoryAction,
    /// Address (the allocation's, or the range's).
    pub addr: u64,
    /// Bytes (requested for allocations, mapped for segments).
    pub size: u64,
    /// The stream, as the raw handle (0: default, and allocations made on no stream).
    pub stream: u64,
    /// Microseconds since the allocator was made.
    pub time_us: u64,
    /// What the caller attached to the request that recorded it ([`with_context`]): the Python
    /// extension's id of the Python stack that asked. 0: none.
    pub context: u64,
}

thread_local! {
    /// The context the events this thread records carry (`with_context`); 0: none.
    static CONTEXT: Cell<u64> = const { Cell::new(0) };
}

/// Runs `f` with `context` attached to every history event this thread records meanwhile (a
/// request's own events: its allocation, the ranges it maps, its free). The caller gives the
/// ids and knows what they mean; 0 is none. Costs nothing when history is off.
pub fn with_context<T>(context: u64, f: impl FnOnce() -> T) -> T {
    /// Puts the previous context back, even if `f` unwinds.
    struct Restore(u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = CONTEXT.try_with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CONTEXT.try_with(|c| c.replace(context)).unwrap_or(0));
    f()
}

/// The stream a snapshot or history shows for the heap's stream `s`: the raw handle, and 0 (the
/// default stream, as PyTorch shows memory from `cudaMalloc`) for requests made on no stream.
pub(crate) fn shown_stream(s: u64) -> u64 {
    if s == NO_STREAM {
        0
    } else {
        s
    }
}

/// A bounded ring of events.
#[derive(Debug)]
pub(crate) struct History {
    max: usize,
    events: VecDeque<HistoryEvent>,
    start: Instant,
}

impl History {
    pub fn new(max: usize, start: Instant) -> Self {
        History { max: max.max(1), events: VecDeque::new(), start }
    }

    pub fn push(&mut self, action: HistoryAction, addr: u64, size: u64, stream: u64) {
        if self.events.len() == self.max {
            self.events.pop_front();
        }
        let time_us = self.start.elapsed().as_micros() as u64;
        let stream = shown_stream(stream);
        let context = CONTEXT.try_with(Cell::get).unwrap_or(0);
        self.events.push_back(HistoryEvent { action, addr, size, stream, time_us, context });
    }

    pub fn events(&self) -> Vec<HistoryEvent> {
        self.events.iter().copied().collect()
    }
}

/// What a block in a segment snapshot is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// In use.
    ActiveAllocated,
    /// Free.
    Inactive,
}

/// A block of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Its address.
    pub addr: u64,
    /// Its size after rounding.
    pub size: u64,
    /// Bytes asked for (0 for free blocks).
    pub requested_size: u64,
    /// In use or free.
    pub state: BlockState,
}

/// One mapped range, as a PyTorch segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Base address.
    pub addr: u64,
    /// Bytes mapped.
    pub size: u64,
    /// The stream of its last allocation (0: default).
    pub stream: u64,
    /// `"alloc"` (one allocation), `"arena"` (sub-page blocks), `"carved"` (blocks of a page or
    /// more cut out of a cached range), `"pending"` (freed on a stream),
    /// `"cached"` (free, mapped) or `"growable"` (a growable allocation's committed pages).
    pub kind: &'static str,
    /// Physical chunks mapped there.
    pub chunks: usize,
    /// Its blocks, in address order.
    pub blocks: Vec<BlockInfo>,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn events_carry_the_context_of_the_thread_that_recorded_them() {
        let mut h = History::new(8, Instant::now());
        h.push(HistoryAction::Alloc, 1, 1, 0);
        with_context(7, || {
            h.push(HistoryAction::Alloc, 2, 1, 0);
            with_context(9, || h.push(HistoryAction::FreeRequested, 2, 1, 0));
            h.push(HistoryAction::FreeCompleted, 2, 1, 0);
        });
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_context(5, || panic!("unwinds"));
        }));
        assert!(r.is_err());
        std::thread::scope(|s| {
            s.spawn(|| with_context(3, || h.push(HistoryAction::Alloc, 3, 1, 0)));
        });
        h.push(HistoryAction::Alloc, 4, 1, 0);
        let contexts: Vec<u64> = h.events().iter().map(|e| e.context).collect();
        assert_eq!(contexts, [0, 7, 9, 7, 3, 0]);
    }
}
