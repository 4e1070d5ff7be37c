//! The virtual-address space's bookkeeping: reservations, the bump frontier of never-mapped
//! addresses, retired ranges waiting for their batched unmap, and recycled addresses (unmapped, so
//! no stale translation of them can exist either). New ranges go to recycled addresses first, best
//! fit, when `reuse_first` is set (the default, `Options::reuse_addresses`), else to the frontier
//! until it runs out. Growable allocations own *private* reservations: their retired tails are
//! unmapped by the same batches, but their addresses go back to their owner, never to the
//! recycled list. Pure bookkeeping.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::pool::ChunkId;

/// A range taken out of service: still mapped, waiting for its unmap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Retired {
    pub va: u64,
    pub len: u64,
    /// The chunks mapped there, in address order; each counts this mapping until the unmap.
    pub chunks: Vec<ChunkId>,
    /// Work queued on this stream up to this free's epoch may still use the addresses: the
    /// unmap waits until that epoch has completed. `None`: nothing can still use them.
    pub after: Option<(u64, u64)>,
}

/// One run of retired ranges that are adjacent in address space: one unmap call covers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UnmapRun {
    pub va: u64,
    pub len: u64,
    pub parts: Vec<Retired>,
}

#[derive(Debug, Default)]
pub(crate) struct VaSpace {
    /// (base, len) of every reservation.
    reservations: Vec<(u64, u64)>,
    /// (base, len) of every private reservation (one per growable allocation).
    private: Vec<(u64, u64)>,
    /// Next fresh address and the end of the reservation it is in.
    frontier: u64,
    frontier_end: u64,
    /// Unmapped addresses ready for reuse, start -> len, coalesced.
    recycled: BTreeMap<u64, u64>,
    /// The same as (len, start), for best fit.
    recycled_by_len: BTreeSet<(u64, u64)>,
    /// Place new ranges at recycled addresses before the frontier.
    reuse_first: bool,
    retired: VecDeque<Retired>,
    retired_bytes: u64,
    /// Spans of ranges asleep (`Heap::sleep`), start -> len: unmapped, but mapped again in
    /// place at wake, so never recycled.
    kept: BTreeMap<u64, u64>,
    /// When the retired queue last went from empty to non-empty (the age of the batch).
    retired_since: Option<crate::sync::Instant>,
}

impl VaSpace {
    /// An empty address space; `reuse_first`: see the module's description.
    pub fn new(reuse_first: bool) -> Self {
        VaSpace { reuse_first, ..VaSpace::default() }
    }

    /// Adds a reservation and moves the frontier into it; what the old frontier had left (never
    /// mapped) is recycled.
    pub fn add_reservation(&mut self, base: u64, len: u64) {
        if self.frontier < self.frontier_end {
            self.recycle(self.frontier, self.frontier_end - self.frontier);
        }
        self.reservations.push((base, len));
        self.frontier = base;
        self.frontier_end = base + len;
    }

    pub fn reserved_bytes(&self) -> u64 {
        self.reservations.iter().map(|r| r.1).sum()
    }

    pub fn reservations(&self) -> &[(u64, u64)] {
        &self.reservations
    }

    /// A range of `len` bytes mapped nowhere: recycled addresses (best fit) first if `reuse_first`,
    /// the frontier if it has room, else recycled addresses. `None` if neither has room.
    ///
    /// Recycled first is the default because of what the H200 measured (the `interference`
    /// benchmark, docs/design.md, Glossary): a TLB-bound gather ran 1.002x-1.005x beside the
    /// allocation churn with recycled addresses and 1.046x-1.055x with the frontier, in seven
    /// runs of each. Mapping at addresses never mapped before seems to make the driver build new page
    /// tables, which disturbs running kernels.
    pub fn take_fresh(&mut self, len: u64) -> Option<u64> {
        if self.reuse_first {
            if let Some(va) = self.take_recycled(len) {
                return Some(va);
            }
        }
        if self.frontier_end - self.frontier >= len {
            let va = self.frontier;
            self.frontier += len;
            return Some(va);
        }
        self.take_recycled(len)
    }

    /// The smallest recycled range that holds `len` bytes (the lowest address among equals),
    /// less its first `len` bytes, which it returns.
    fn take_recycled(&mut self, len: u64) -> Option<u64> {
        let &(have, start) = self.recycled_by_len.range((len, 0)..).next()?;
        self.remove_recycled(start);
        if have > len {
            self.insert_recycled(start + len, have - len);
        }
        Some(start)
    }

    fn insert_recycled(&mut self, start: u64, len: u64) {
        self.recycled.insert(start, len);
        self.recycled_by_len.insert((len, start));
    }

    fn remove_recycled(&mut self, start: u64) -> u64 {
        let len = self.recycled.remove(&start).expect("recycled range missing");
        self.recycled_by_len.remove(&(len, start));
        len
    }

    /// The reservation (shared or private) holding `va`, as its base.
    pub fn reservation_of(&self, va: u64) -> Option<u64> {
        self.reservations
            .iter()
            .chain(&self.private)
            .find(|&&(b, l)| va >= b && va < b + l)
            .map(|r| r.0)
    }

    /// Adds a private reservation, owned by one growable allocation.
    pub fn add_private(&mut self, base: u64, len: u64) {
        self.private.push((base, len));
    }

    /// Forgets a private reservation (its owner freed it; nothing in it is mapped or retired).
    pub fn remove_private(&mut self, base: u64) {
        debug_assert!(!self
            .retired
            .iter()
            .any(|r| r.va >= base && self.reservation_of(r.va) == Some(base)));
        self.private.retain(|r| r.0 != base);
    }

    pub fn private_reservations(&self) -> &[(u64, u64)] {
        &self.private
    }

    pub fn is_private(&self, va: u64) -> bool {
        self.private.iter().any(|&(b, l)| va >= b && va < b + l)
    }

    /// Whether a retired range (or one being unmapped, which the caller tracks) overlaps
    /// `[va, va + len)`.
    pub fn retired_overlaps(&self, va: u64, len: u64) -> bool {
        self.retired.iter().any(|r| r.va < va + len && va < r.va + r.len)
    }

    /// Takes the retired range that starts exactly at `va`, if any.
    pub fn take_retired_at(&mut self, va: u64) -> Option<Retired> {
        let i = self.retired.iter().position(|r| r.va == va)?;
        let r = self.retired.remove(i).expect("position is in range");
        self.retired_bytes -= r.len;
        if self.retired.is_empty() {
            self.retired_since = None;
        }
        Some(r)
    }

    /// Returns addresses that are mapped nowhere (never mapped, or unmapped) for reuse; those of a
    /// private reservation stay with its owner. Free neighbours merge, but never across two reservations, even adjacent ones: a mapping must
    /// lie inside one reservation.
    pub fn recycle(&mut self, va: u64, len: u64) {
        debug_assert!(len > 0);
        if self.is_private(va) {
            // A growable allocation's addresses: its owner maps them again, in place.
            return;
        }
        // A range asleep keeps its addresses: recycle only what lies outside such spans.
        let end = va + len;
        let mut at = va;
        let kept: Vec<(u64, u64)> = self
            .kept
            .range(..end)
            .rev()
            .take_while(|(&b, &l)| b + l > va)
            .map(|(&b, &l)| (b, l))
            .collect();
        for (b, l) in kept.into_iter().rev() {
            if b > at {
                self.recycle_free(at, b - at);
            }
            at = at.max(b + l);
        }
        if at < end {
            self.recycle_free(at, end - at);
        }
    }

    /// Keeps `[va, va + len)`, unmapped, for its owner (a range asleep) until `unkeep`.
    pub fn keep(&mut self, va: u64, len: u64) {
        let prev = self.kept.insert(va, len);
        debug_assert!(prev.is_none(), "a span kept twice");
    }

    /// Ends `keep` of the span at `va`.
    pub fn unkeep(&mut self, va: u64) {
        let gone = self.kept.remove(&va);
        debug_assert!(gone.is_some(), "unkeep of a span not kept");
    }

    /// `recycle` of addresses none of which is private or kept.
    fn recycle_free(&mut self, mut va: u64, mut len: u64) {
        let home = self.reservation_of(va);
        if let Some((&prev, &plen)) = self.recycled.range(..va).next_back() {
            debug_assert!(prev + plen <= va, "recycled ranges overlap");
            if prev + plen == va && self.reservation_of(prev) == home {
                self.remove_recycled(prev);
                va = prev;
                len += plen;
            }
        }
        if self.recycled.contains_key(&(va + len)) && self.reservation_of(va + len) == home {
            len += self.remove_recycled(va + len);
        }
        self.insert_recycled(va, len);
    }

    pub fn retire(&mut self, r: Retired) {
        if self.retired.is_empty() {
            self.retired_since = Some(crate::sync::Instant::now());
        }
        self.retired_bytes += r.len;
        self.retired.push_back(r);
    }

    /// Whether unmapping the retired shared ranges would give `len` bytes of recycled
    /// addresses in one run: each merges with the recycled addresses and the other retired
    /// ranges beside it, inside one reservation. A request flushes for addresses only then;
    /// otherwise only a new reservation helps. (`scale` on the H200: a request for the whole
    /// device flushed 33,991 scattered one-page ranges, 663 ms, and then
    /// reserved anyway.) Linear in the retired and recycled ranges, on a path taken only when
    /// neither recycled addresses nor the frontier have room.
    pub fn unmap_could_free(&self, len: u64) -> bool {
        let mut spans: Vec<(u64, u64)> =
            self.retired.iter().filter(|r| !self.is_private(r.va)).map(|r| (r.va, r.len)).collect();
        if spans.is_empty() {
            return false;
        }
        spans.extend(self.recycled());
        spans.sort_unstable();
        let mut run: Option<(u64, u64, Option<u64>)> = None;
        for (va, l) in spans {
            let home = self.reservation_of(va);
            run = match run {
                Some((start, end, h)) if end == va && h == home => Some((start, end + l, h)),
                _ => Some((va, va + l, home)),
            };
            if run.is_some_and(|(start, end, _)| end - start >= len) {
                return true;
            }
        }
        false
    }

    pub fn retired_count(&self) -> usize {
        self.retired.len()
    }

    pub fn retired_bytes(&self) -> u64 {
        self.retired_bytes
    }

    /// How long the oldest retired range has waited.
    pub fn retired_age(&self) -> std::time::Duration {
        self.retired_since.map_or(std::time::Duration::ZERO, |t| t.elapsed())
    }

    /// Takes every retired range that `ready` allows, merged into runs of adjacent ranges (one
    /// unmap each) of at most `max_handles` chunk mappings (0: no limit) unless one range alone
    /// holds more; the others stay retired. Unmap costs about 20 us a handle on an H200 and the
    /// driver serialises VMM calls, so the limit bounds how long a mapping request waits.
    pub fn take_retired_runs(
        &mut self,
        max_handles: usize,
        ready: impl Fn(&Retired) -> bool,
    ) -> Vec<UnmapRun> {
        let (mut all, waiting): (Vec<Retired>, Vec<Retired>) =
            self.retired.drain(..).partition(|r| ready(r));
        self.retired_bytes = 0;
        // Those left keep the oldest's age (an overestimate at worst), so that taking a few
        // out never postpones the batch that the age limit is due to start.
        let since = self.retired_since.take();
        for r in waiting {
            self.retire(r);
        }
        if !self.retired.is_empty() {
            self.retired_since = since;
        }
        all.sort_by_key(|r| r.va);
        let mut runs: Vec<UnmapRun> = Vec::new();
        for r in all {
            let same_reservation =
                |run: &UnmapRun| self.reservation_of(run.va) == self.reservation_of(r.va);
            let handles = |run: &UnmapRun| run.parts.iter().map(|p| p.chunks.len()).sum::<usize>();
            match runs.last_mut() {
                Some(run)
                    if run.va + run.len == r.va
                        && same_reservation(run)
                        && (max_handles == 0 || handles(run) + r.chunks.len() <= max_handles) =>
                {
                    run.len += r.len;
                    run.parts.push(r);
                }
                _ => runs.push(UnmapRun { va: r.va, len: r.len, parts: vec![r] }),
            }
        }
        runs
    }

    /// Puts back runs whose unmap did not happen.
    pub fn put_back_runs(&mut self, runs: impl IntoIterator<Item = UnmapRun>) {
        for run in runs {
            for r in run.parts {
                self.retire(r);
            }
        }
    }

    pub fn retired(&self) -> impl Iterator<Item = &Retired> {
        self.retired.iter()
    }

    pub fn recycled(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.recycled.iter().map(|(&a, &l)| (a, l))
    }

    /// The never-used tail of the current reservation.
    pub fn frontier(&self) -> (u64, u64) {
        (self.frontier, self.frontier_end)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn frontier_then_recycled() {
        let mut v = VaSpace::default();
        v.add_reservation(1000, 100);
        assert_eq!(v.take_fresh(60), Some(1000));
        assert_eq!(v.take_fresh(60), None);
        v.recycle(1000, 30);
        v.recycle(1030, 30);
        // Coalesced into one range of 60: the frontier has only 40 left, so recycled serves it.
        assert_eq!(v.take_fresh(60), Some(1000));
        assert_eq!(v.take_fresh(40), Some(1060));
    }

    #[test]
    fn reuse_first_takes_the_best_fitting_recycled_range_before_the_frontier() {
        let mut v = VaSpace::new(true);
        v.add_reservation(1000, 1000);
        assert_eq!(v.take_fresh(100), Some(1000), "nothing recycled yet: the frontier");
        v.take_fresh(300);
        v.recycle(1000, 100);
        v.recycle(1200, 50);
        assert_eq!(v.take_fresh(40), Some(1200), "the smaller of the two that fit");
        assert_eq!(v.take_fresh(60), Some(1000));
        assert_eq!(v.take_fresh(60), Some(1400), "40 left at 1060: the frontier");
        assert_eq!(v.recycled().collect::<Vec<_>>(), vec![(1060, 40), (1240, 10)]);
        let mut frontier_first = VaSpace::new(false);
        frontier_first.add_reservation(1000, 1000);
        frontier_first.take_fresh(100);
        frontier_first.recycle(1000, 100);
        assert_eq!(frontier_first.take_fresh(40), Some(1100));
    }

    fn one_page_retired(va: u64) -> Retired {
        Retired { va, len: 10, chunks: vec![0], after: None }
    }

    #[test]
    fn an_unmap_could_free_a_run_only_where_retired_ranges_meet_recycled_or_retired_ones() {
        let mut v = VaSpace::new(true);
        v.add_reservation(1000, 100);
        assert_eq!(v.take_fresh(100), Some(1000));
        assert!(!v.unmap_could_free(10), "nothing retired");
        // Retired every other 10 bytes, with live ranges between: no unmap gives 20 in a row.
        for va in [1000, 1020, 1040] {
            v.retire(one_page_retired(va));
        }
        assert!(v.unmap_could_free(10));
        assert!(!v.unmap_could_free(20));
        // A recycled neighbour, or a retired one, makes a run of 20.
        v.recycle(1050, 10);
        assert!(v.unmap_could_free(20));
        assert!(!v.unmap_could_free(30));
        v.retire(one_page_retired(1030));
        assert!(v.unmap_could_free(40), "1020-1060: retired, retired, retired, recycled");
        assert!(!v.unmap_could_free(50));
        // Never across two reservations, even adjacent ones.
        let mut w = VaSpace::new(true);
        w.add_reservation(0, 10);
        w.take_fresh(10);
        w.add_reservation(10, 10);
        w.take_fresh(10);
        w.retire(one_page_retired(0));
        w.retire(one_page_retired(10));
        assert!(!w.unmap_could_free(20));
    }

    #[test]
    fn new_reservation_recycles_old_frontier_tail() {
        let mut v = VaSpace::default();
        v.add_reservation(0, 100);
        v.take_fresh(70);
        v.add_reservation(1000, 100);
        assert_eq!(v.recycled().collect::<Vec<_>>(), vec![(70, 30)]);
        assert_eq!(v.take_fresh(100), Some(1000));
        assert_eq!(v.take_fresh(30), Some(70));
    }

    #[test]
    fn recycled_space_never_merges_across_adjacent_reservations() {
        let mut v = VaSpace::default();
        v.add_reservation(0, 100);
        v.take_fresh(100);
        v.add_reservation(100, 100); // adjacent, as the OS may place them
        v.take_fresh(100);
        v.recycle(50, 50);
        v.recycle(100, 50);
        assert_eq!(v.recycled().collect::<Vec<_>>(), vec![(50, 50), (100, 50)]);
        assert_eq!(v.take_fresh(80), None, "a range must not span two reservations");
        v.retire(Retired { va: 50, len: 50, chunks: vec![1], after: None });
        v.retire(Retired { va: 100, len: 50, chunks: vec![2], after: None });
        assert_eq!(
            v.take_retired_runs(0, |_| true).len(),
            2,
            "one unmap must not span two reservations"
        );
    }

    #[test]
    fn kept_spans_are_never_recycled() {
        let mut v = VaSpace::default();
        v.add_reservation(0, 100);
        v.take_fresh(100);
        v.keep(20, 10);
        v.keep(50, 10);
        v.recycle(20, 10);
        assert_eq!(v.recycled().count(), 0, "a kept span alone");
        v.recycle(10, 60);
        assert_eq!(v.recycled().collect::<Vec<_>>(), vec![(10, 10), (30, 20), (60, 10)]);
        v.unkeep(20);
        v.recycle(20, 10);
        assert_eq!(v.recycled().collect::<Vec<_>>(), vec![(10, 40), (60, 10)]);
    }

    #[test]
    fn adjacent_retired_ranges_merge_into_one_unmap() {
        let mut v = VaSpace::default();
        v.retire(Retired { va: 20, len: 10, chunks: vec![2], after: None });
        v.retire(Retired { va: 0, len: 10, chunks: vec![0], after: None });
        v.retire(Retired { va: 10, len: 10, chunks: vec![1], after: None });
        v.retire(Retired { va: 50, len: 10, chunks: vec![3], after: None });
        let runs = v.take_retired_runs(0, |_| true);
        assert_eq!(runs.len(), 2);
        assert_eq!((runs[0].va, runs[0].len, runs[0].parts.len()), (0, 30, 3));
        assert_eq!((runs[1].va, runs[1].len), (50, 10));
        assert_eq!(v.retired_count(), 0);
        v.put_back_runs(runs);
        assert_eq!(v.retired_bytes(), 40);
    }

    #[test]
    fn merged_runs_hold_a_bounded_number_of_handles() {
        let mut v = VaSpace::default();
        // 40 adjacent ranges of 3 chunks each, then one range of 50 chunks on its own.
        for i in 0..40u64 {
            v.retire(Retired { va: i * 10, len: 10, chunks: vec![0, 1, 2], after: None });
        }
        v.retire(Retired { va: 400, len: 10, chunks: (0..50).collect(), after: None });
        let mut unbounded = VaSpace::default();
        for r in v.retired() {
            unbounded.retire(r.clone());
        }
        assert_eq!(unbounded.take_retired_runs(0, |_| true).len(), 1, "0: no limit");
        let runs = v.take_retired_runs(32, |_| true);
        let handles: Vec<usize> =
            runs.iter().map(|r| r.parts.iter().map(|p| p.chunks.len()).sum()).collect();
        assert_eq!(handles, vec![30, 30, 30, 30, 50]);
        assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), 410);
        for w in runs.windows(2) {
            assert_eq!(w[0].va + w[0].len, w[1].va, "runs still cover the ranges in order");
        }
    }

    proptest! {
        /// Ranges handed out never overlap one another while taken, and recycled space is reused.
        #[test]
        fn fresh_ranges_never_overlap(
            reuse_first in any::<bool>(),
            ops in proptest::collection::vec((any::<bool>(), 1u64..8), 1..300),
        ) {
            let mut v = VaSpace::new(reuse_first);
            v.add_reservation(0, 64);
            let mut taken: Vec<(u64, u64)> = Vec::new();
            for (take, len) in ops {
                if take {
                    if let Some(va) = v.take_fresh(len) {
                        prop_assert!(va + len <= 64);
                        for &(a, l) in &taken {
                            prop_assert!(va + len <= a || a + l <= va, "overlap");
                        }
                        taken.push((va, len));
                    }
                } else if let Some((a, l)) = taken.pop() {
                    v.recycle(a, l);
                }
                let (f, fe) = v.frontier();
                let free: u64 = v.recycled().map(|r| r.1).sum::<u64>() + (fe - f);
                let used: u64 = taken.iter().map(|t| t.1).sum();
                prop_assert_eq!(free + used, 64);
                let by_len: Vec<(u64, u64)> = v.recycled_by_len.iter().map(|&(l, a)| (a, l)).collect();
                let mut by_start: Vec<(u64, u64)> = v.recycled().collect();
                by_start.sort_by_key(|&(a, l)| (l, a));
                prop_assert_eq!(by_len, by_start, "the two indexes agree");
            }
        }
    }
}
