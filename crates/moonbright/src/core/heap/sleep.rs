//! Tags asleep, the heap's side: which ranges a tag's sleep covers (its allocations' own ranges
//! and its sub-page arenas: a tagged request never shares memory with another tag, `try_fast`),
//! and the books' changes when they are unmapped with their addresses kept and when they are
//! mapped again in place. The waits, copies and driver calls are the stream front end's
//! (`stream/sleep.rs`); every step here runs under the heap lock.
//!
//! A tag goes *sleeping* (its ranges mapped still, their bytes being copied out), *asleep* (the
//! ranges unmapped, their chunks bare or released, their addresses kept out of reuse by
//! `VaSpace::keep`), *waking* (the ranges being mapped again), and is awake again once out of the
//! book. In every state but awake its allocations can be neither freed nor added to
//! (`check_awake`).

// Keys are tag ids: a fast hash, not a DoS-resistant one.
use foldhash::HashMap;

use super::{Heap, RangeId, Step};
use crate::core::mapping::{Executed, MapPlan};
use crate::core::pool::ChunkId;
use crate::core::streams::NO_STREAM;
use crate::driver::ChunkHandle;
use crate::error::{Error, Result};
use crate::tags::{self, TagId};

/// A tag's ranges: (id, address, bytes), in address order.
pub(crate) type TagRanges = Vec<(RangeId, u64, u64)>;

/// What a sleep covers, from `begin_sleep`.
#[derive(Debug)]
pub(crate) struct SleepWork {
    pub tag: TagId,
    pub ranges: TagRanges,
    /// Streams whose queued work may use the ranges (the allocations' streams and recorded
    /// uses): the sleep waits for each.
    pub streams: Vec<u64>,
}

/// What a wake covers, from `begin_wake`.
#[derive(Debug)]
pub(crate) struct WakeWork {
    pub tag: TagId,
    pub ranges: TagRanges,
    /// The tag's bytes wait in host memory (the sleep backed them up).
    pub backed_up: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Sleeping,
    Asleep,
    Waking,
}

#[derive(Debug)]
struct Sleeper {
    phase: Phase,
    ranges: TagRanges,
    backed_up: bool,
}

/// The tags not awake, and the tagged requests in flight.
#[derive(Debug, Default)]
pub(super) struct Sleepers {
    tags: HashMap<TagId, Sleeper>,
    /// Tagged requests between `try_fast` and `finish` (mapping a range with the lock
    /// released): a sleep of their tag waits for none of them, so it is refused meanwhile.
    in_flight: HashMap<TagId, u32>,
}

fn state_error(tag: TagId, reason: &str) -> Error {
    Error::TagState { tag: tags::name_of(tag).to_string(), reason: reason.to_string() }
}

impl Heap {
    /// Refuses `what` (an allocation, a free) of a tag that is not awake.
    pub(super) fn check_awake(&self, tag: TagId, what: &'static str) -> Result<()> {
        if self.sleepers.tags.contains_key(&tag) {
            return Err(Error::TagAsleep { tag: tags::name_of(tag).to_string(), what });
        }
        Ok(())
    }

    /// Whether some tag is not awake (the free path looks no further when none is).
    #[inline]
    pub(super) fn any_tag_asleep(&self) -> bool {
        !self.sleepers.tags.is_empty()
    }

    /// Notes a tagged request leaving `try_fast` to map a range (`NeedRange`).
    pub(super) fn note_tagged_request(&mut self, tag: TagId) {
        *self.sleepers.in_flight.entry(tag).or_default() += 1;
    }

    /// Ends what `note_tagged_request` began: the request finished, failed, or goes back to
    /// `try_fast`.
    pub fn end_tagged_request(&mut self, tag: TagId) {
        if tag == 0 {
            return;
        }
        if let Some(n) = self.sleepers.in_flight.get_mut(&tag) {
            *n -= 1;
            if *n == 0 {
                self.sleepers.in_flight.remove(&tag);
            }
        }
    }

    /// Begins the sleep of `tag`: from now its allocations can be neither freed nor added to.
    /// Refused if the tag is not awake, a request of it is mapping a range, or one of its
    /// ranges was exported to another process (whose mappings would keep the memory, and which
    /// would read garbage after a wake).
    pub fn begin_sleep(&mut self, tag: TagId, backup: bool) -> Result<SleepWork> {
        match self.sleepers.tags.get(&tag).map(|s| s.phase) {
            Some(Phase::Sleeping) => return Err(state_error(tag, "it is being put to sleep")),
            Some(Phase::Asleep) => return Err(state_error(tag, "it is asleep already")),
            Some(Phase::Waking) => return Err(state_error(tag, "it is being woken")),
            None => {}
        }
        if self.sleepers.in_flight.contains_key(&tag) {
            return Err(state_error(
                tag,
                "an allocation of it is being mapped on another thread; sleep once it returns",
            ));
        }
        let (ids, streams) = self.tag_ranges(tag);
        let mut ranges = Vec::with_capacity(ids.len());
        for id in ids {
            let r = self.range(id);
            if r.chunks.iter().any(|&c| self.pool.get(c).exported) {
                return Err(state_error(
                    tag,
                    "some of its memory was exported to another process, which keeps it mapped",
                ));
            }
            ranges.push((id, r.va, self.bytes(r.pages)));
        }
        ranges.sort_by_key(|r| r.1);
        let sleeper = Sleeper { phase: Phase::Sleeping, ranges: ranges.clone(), backed_up: backup };
        self.sleepers.tags.insert(tag, sleeper);
        Ok(SleepWork { tag, ranges, streams })
    }

    /// The ranges holding `tag`'s live allocations, and the streams that may use them.
    fn tag_ranges(&self, tag: TagId) -> (Vec<RangeId>, Vec<u64>) {
        let mut ids = Vec::new();
        let mut streams = Vec::new();
        for l in self.live.allocs.values().filter(|l| l.tag == tag) {
            ids.push(match l.backing {
                super::Backing::Range(id) => id,
                super::Backing::Sub { arena, .. } => arena,
            });
            streams.push(l.stream);
            streams.extend(&l.uses);
        }
        ids.sort_unstable();
        ids.dedup();
        streams.retain(|&s| s != NO_STREAM);
        streams.sort_unstable();
        streams.dedup();
        (ids, streams)
    }

    /// Gives up a sleep before any range was unmapped: the tag is awake again, as it was.
    pub fn abort_sleep(&mut self, tag: TagId) {
        let gone = self.sleepers.tags.remove(&tag);
        debug_assert!(gone.is_some_and(|s| s.phase == Phase::Sleeping));
    }

    /// Commits a sleep whose bytes are safe (copied out, or to be discarded) and whose
    /// streams' work has completed: the tag is asleep, its ranges are retired with nothing to
    /// wait for (the caller unmaps them at once, `Shared::flush`) and their chunks are bare,
    /// while their addresses stay kept. Returns the chunks, for `take_releasable_of` once the
    /// unmaps have run.
    pub fn commit_sleep(&mut self, work: &SleepWork) -> Vec<ChunkId> {
        let mut freed = Vec::new();
        for &(id, va, len) in &work.ranges {
            freed.extend(self.put_to_sleep(id, va, len));
        }
        let sleeper = self.sleepers.tags.get_mut(&work.tag).expect("a sleep in progress");
        sleeper.phase = Phase::Asleep;
        freed
    }

    /// Range `id` at `[va, va + len)` asleep: its mapping retired, its chunks bare, its
    /// addresses kept. Returns the chunks.
    fn put_to_sleep(&mut self, id: RangeId, va: u64, len: u64) -> Vec<ChunkId> {
        let r = self.range_mut(id);
        r.asleep = true;
        let chunks = std::mem::replace(&mut r.chunks, Vec::new().into()).into_vec();
        self.va.keep(va, len);
        self.stats.asleep_bytes.add(len);
        self.retire(va, len, chunks.clone());
        for &c in &chunks {
            self.pool.put_bare(c);
        }
        chunks
    }

    /// Takes out those of `chunks` that are bare and mapped nowhere now, for release, as
    /// `take_releasable` does.
    pub fn take_slept_releasable(
        &mut self,
        chunks: &[ChunkId],
    ) -> (u64, Vec<(ChunkId, ChunkHandle, u64)>) {
        self.take_releasable_of(chunks)
    }

    /// Begins the wake of `tag`, asleep.
    pub fn begin_wake(&mut self, tag: TagId) -> Result<WakeWork> {
        let s = match self.sleepers.tags.get_mut(&tag) {
            Some(s) if s.phase == Phase::Asleep => s,
            Some(s) if s.phase == Phase::Waking => {
                return Err(state_error(tag, "it is being woken already"))
            }
            Some(_) => return Err(state_error(tag, "it is being put to sleep")),
            None => return Err(state_error(tag, "it is awake")),
        };
        s.phase = Phase::Waking;
        Ok(WakeWork { tag, ranges: s.ranges.clone(), backed_up: s.backed_up })
    }

    /// Plans the mapping of asleep range `id` again, in place, as a growable's growth is: bare
    /// chunks, stolen cached ranges, new chunks (large ones) within the cap.
    pub fn plan_wake(&mut self, id: RangeId) -> Step {
        let r = self.range(id);
        debug_assert!(r.asleep);
        let (va, pages) = (r.va, r.pages);
        let len = self.bytes(pages);
        if self.va.retired_overlaps(va, len) {
            // A mapping an earlier wake could not undo still waits for its unmap.
            return Step::Flush(None);
        }
        let free = self.free_pages_for(NO_STREAM);
        if free < pages {
            return self.short_of(len, pages - free, NO_STREAM, None);
        }
        self.plan_at(va, pages, len, NO_STREAM, true, 0)
    }

    /// Commits the mapping of asleep range `id` again; on failure it stays asleep and the
    /// driver's error is returned.
    pub fn commit_wake(&mut self, id: RangeId, plan: MapPlan, ex: Executed) -> Result<()> {
        let chunks = self.commit_mapping(plan, ex)?;
        let page = self.lim.page;
        let r = self.range_mut(id);
        r.chunks = chunks.into();
        r.asleep = false;
        let (va, len) = (r.va, r.pages * page);
        self.va.unkeep(va);
        self.stats.asleep_bytes.sub(len);
        Ok(())
    }

    /// Undoes `commit_wake` of range `id` (a later step of the wake failed, and no copy into
    /// it is still in flight): asleep again, as `commit_sleep` leaves a range.
    pub fn unwake(&mut self, id: RangeId) {
        let r = self.range(id);
        let (va, len) = (r.va, self.bytes(r.pages));
        self.put_to_sleep(id, va, len);
    }

    /// Ends a wake: the tag is awake.
    pub fn finish_wake(&mut self, tag: TagId) {
        let gone = self.sleepers.tags.remove(&tag);
        debug_assert!(gone.is_some_and(|s| s.phase == Phase::Waking));
    }

    /// Gives up a wake whose ranges are all asleep again: the tag stays asleep, intact.
    pub fn abort_wake(&mut self, tag: TagId) {
        let s = self.sleepers.tags.get_mut(&tag).expect("a wake in progress");
        debug_assert_eq!(s.phase, Phase::Waking);
        s.phase = Phase::Asleep;
    }

    /// Every tag with live allocations or asleep: (tag, allocations, bytes, asleep, backed up).
    pub fn tag_books(&self) -> Vec<(TagId, u64, u64, bool, bool)> {
        let mut by_tag: std::collections::BTreeMap<TagId, (u64, u64)> = Default::default();
        for l in self.live.allocs.values().filter(|l| l.tag != 0) {
            let e = by_tag.entry(l.tag).or_default();
            e.0 += 1;
            e.1 += l.size;
        }
        for &tag in self.sleepers.tags.keys() {
            by_tag.entry(tag).or_default();
        }
        by_tag
            .into_iter()
            .map(|(tag, (n, bytes))| {
                let s = self.sleepers.tags.get(&tag);
                let asleep = s.is_some_and(|s| s.phase != Phase::Sleeping);
                (tag, n, bytes, asleep, asleep && s.is_some_and(|s| s.backed_up))
            })
            .collect()
    }
}
