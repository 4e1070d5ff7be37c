//! Growable allocations: a private reservation of virtual capacity whose pages are committed and
//! given back at its tail, in place, so the address never moves (CUDA graphs that captured it
//! stay valid). Pages come from the same pool as every other allocation.
//!
//! - **Growing** maps chunks at the tail: a plan like any new range's (`Heap::plan_at`), run
//!   without the lock. Growing within the committed pages costs nothing.
//! - **Shrinking** keeps the chunks that hold the first `size` bytes and retires the rest,
//!   stream-ordered: the tail's chunks wait in the quarantine until an event recorded after the
//!   shrink has completed, and its addresses are unmapped by a later batch, never at once.
//! - **Growing over a tail not yet unmapped** takes its chunks back, still mapped, when nobody else
//!   has taken them (no driver call); otherwise it waits for that tail's unmap.
//! - **Release** shrinks to nothing; the reservation is freed once its last tail is unmapped.

use super::{Heap, Step};
use crate::core::history::{BlockInfo, BlockState, SegmentInfo};
use crate::core::mapping::{Executed, MapPlan};
use crate::core::pool::ChunkId;
use crate::core::streams::Pending;
use crate::driver::{DevicePtr, EventHandle};
use crate::error::{Error, Result};

/// The sizes of a growable allocation, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrowableInfo {
    /// Its address, fixed for its life.
    pub base: DevicePtr,
    /// Addresses reserved: the most it can grow to.
    pub capacity: u64,
    /// The size of the last resize.
    pub size: u64,
    /// Bytes backed by physical pages: `size` rounded up to the chunks that hold it.
    pub committed: u64,
}

/// One growable allocation.
#[derive(Debug)]
pub(crate) struct Growable {
    /// Its private reservation: the allocation's address, and its capacity in bytes.
    pub base: u64,
    pub capacity: u64,
    /// Bytes asked for by the last resize.
    pub size: u64,
    /// Chunks mapped back to back from `base`.
    pub chunks: Vec<ChunkId>,
    /// Pages those chunks hold.
    pub committed: u64,
    /// The plan growing it, while one runs without the lock.
    pub plan: Option<u64>,
    /// Released by its owner; waits for its tails' unmaps before its reservation is freed.
    pub released: bool,
}

/// What a resize (or release) needs next.
#[derive(Debug)]
pub(crate) enum Resize {
    /// Done. If pages were given back on a stream: record an event on it covering this epoch
    /// (stream, epoch, a spare event if the stream has one).
    Done(Option<(u64, u64, Option<EventHandle>)>),
    /// Run this plan with the driver, then `commit_grow` it.
    Map(MapPlan),
    /// Another thread is growing it, or its old tail is being unmapped: try again shortly.
    Busy,
    /// Its old tail's addresses must be unmapped first (once the shrink's stream has passed it).
    Flush,
    /// Not enough free memory, counting everything that is free now.
    OutOfMemory(Error),
}

impl Heap {
    /// Registers a growable allocation over a fresh private reservation.
    pub fn add_growable(&mut self, base: u64, capacity: u64) {
        self.va.add_private(base, capacity);
        self.live.forget_free(base);
        self.growables.insert(
            base,
            Growable {
                base,
                capacity,
                size: 0,
                chunks: Vec::new(),
                committed: 0,
                plan: None,
                released: false,
            },
        );
        self.stats.allocations.add(1);
    }

    /// Whether `ptr` is a live growable allocation. Every free asks first, so the common case,
    /// no growable at all, costs one branch.
    #[inline]
    pub fn is_growable(&self, ptr: u64) -> bool {
        !self.growables.is_empty() && self.growables.get(&ptr).is_some_and(|g| !g.released)
    }

    pub fn growable_info(&self, ptr: u64) -> Option<GrowableInfo> {
        let g = self.growables.get(&ptr).filter(|g| !g.released)?;
        Some(GrowableInfo {
            base: g.base,
            capacity: g.capacity,
            size: g.size,
            committed: g.committed * self.lim.page,
        })
    }

    pub(super) fn live_growable(&self, ptr: u64) -> Result<&Growable> {
        match self.growables.get(&ptr) {
            Some(g) if !g.released => Ok(g),
            _ if self.live.freed_lately(ptr) => Err(Error::Released { ptr }),
            _ => Err(Error::NotGrowable { ptr }),
        }
    }

    /// Plans a resize of the growable at `ptr` to `len` bytes, ordered on `stream` (`None`: the
    /// caller guarantees no device work uses what a shrink gives back). Bad input changes nothing.
    pub fn plan_resize(&mut self, ptr: u64, len: u64, stream: Option<u64>) -> Result<Resize> {
        let page = self.lim.page;
        let g = self.live_growable(ptr)?;
        if len > g.capacity {
            return Err(Error::BeyondCapacity { ptr, requested: len, capacity: g.capacity });
        }
        if g.plan.is_some() {
            return Ok(Resize::Busy);
        }
        let want = len.div_ceil(page);
        if want <= g.committed {
            let event = self.shrink_to(ptr, want, stream);
            self.set_size(ptr, len);
            return Ok(Resize::Done(event));
        }
        let s = stream.unwrap_or(0);
        self.reclaim_tail(ptr, s, want);
        let g = &self.growables[&ptr];
        if want <= g.committed {
            self.set_size(ptr, len);
            return Ok(Resize::Done(None));
        }
        let va = g.base + g.committed * page;
        let need = want - g.committed;
        let need_len = need * page;
        if self.claims.unmapping_private.iter().any(|&(a, l)| a < va + need_len && va < a + l) {
            return Ok(Resize::Busy);
        }
        if self.va.retired_overlaps(va, need_len) {
            return Ok(Resize::Flush);
        }
        let free = self.free_pages_for(s);
        let step = if free < need {
            self.short_of(need_len, need - free, s, None)
        } else {
            self.plan_at(va, need, need_len, s, false, 0)
        };
        Ok(match step {
            Step::Map(plan) => {
                self.growables.get_mut(&ptr).expect("checked above").plan = Some(plan.id);
                Resize::Map(plan)
            }
            Step::Flush(_) => Resize::Flush,
            Step::Wait => Resize::Busy,
            Step::OutOfMemory(e) => Resize::OutOfMemory(e),
            Step::Reserve(_) => unreachable!("a growable's tail needs no new reservation"),
            Step::RecordOwnFrees => unreachable!("a growable's plan makes no ask (`large` false)"),
        })
    }

    /// Commits a grow plan: the chunks join the tail and the size becomes `len`. On failure
    /// nothing changes and the driver's error is returned.
    pub fn commit_grow(&mut self, ptr: u64, len: u64, plan: MapPlan, ex: Executed) -> Result<()> {
        self.growables.get_mut(&ptr).expect("a growable with a plan in flight").plan = None;
        let bytes = plan.len;
        let chunks = self.commit_mapping(plan, ex)?;
        let pages: u64 = chunks.iter().map(|&c| self.pool.get(c).pages).sum();
        let g = self.growables.get_mut(&ptr).expect("still registered");
        g.chunks.extend(chunks);
        g.committed += pages;
        self.stats.active_bytes.add(bytes);
        self.stats.growable_committed_bytes.add(bytes);
        self.stats.growable_resizes += 1;
        self.set_size(ptr, len);
        Ok(())
    }

    /// Releases the growable at `ptr`, ordered on `stream` as a shrink to nothing.
    pub fn release_growable(&mut self, ptr: u64, stream: Option<u64>) -> Result<Resize> {
        if self.live_growable(ptr)?.plan.is_some() {
            return Ok(Resize::Busy);
        }
        let event = self.shrink_to(ptr, 0, stream);
        self.set_size(ptr, 0);
        self.growables.get_mut(&ptr).expect("checked above").released = true;
        self.stats.allocations.sub(1);
        self.remember_free(ptr);
        Ok(Resize::Done(event))
    }

    /// Released growables whose addresses are all unmapped: their reservations, to free.
    pub fn take_dead_growables(&mut self) -> Vec<(u64, u64)> {
        let busy = |base: u64, cap: u64| {
            self.va.retired_overlaps(base, cap)
                || self.claims.unmapping_private.iter().any(|&(a, _)| a >= base && a < base + cap)
        };
        let dead: Vec<(u64, u64)> = self
            .growables
            .values()
            .filter(|g| g.released && !busy(g.base, g.capacity))
            .map(|g| (g.base, g.capacity))
            .collect();
        for &(base, _) in &dead {
            self.growables.remove(&base);
            self.va.remove_private(base);
        }
        dead
    }

    fn set_size(&mut self, ptr: u64, len: u64) {
        let g = self.growables.get_mut(&ptr).expect("a live growable");
        let old = std::mem::replace(&mut g.size, len);
        if len > old {
            self.stats.allocated_bytes.add(len - old);
        } else {
            self.stats.allocated_bytes.sub(old - len);
        }
    }

    /// Keeps the chunks holding the first `want` pages and retires the rest (see the module).
    fn shrink_to(
        &mut self,
        ptr: u64,
        want: u64,
        stream: Option<u64>,
    ) -> Option<(u64, u64, Option<EventHandle>)> {
        let page = self.lim.page;
        let g = self.growables.get_mut(&ptr).expect("a live growable");
        let mut keep = 0;
        let mut kept = 0;
        while keep < g.chunks.len() && kept < want {
            kept += self.pool.get(g.chunks[keep]).pages;
            keep += 1;
        }
        if keep == g.chunks.len() {
            return None;
        }
        let tail = g.chunks.split_off(keep);
        let va = g.base + kept * page;
        let len = (g.committed - kept) * page;
        g.committed = kept;
        self.stats.active_bytes.sub(len);
        self.stats.growable_committed_bytes.sub(len);
        self.stats.growable_resizes += 1;
        match stream {
            Some(s) => {
                let epoch = self.streams.push(s, Pending::Mark);
                self.claims.quarantine.extend(tail.iter().map(|&c| (c, s, epoch)));
                self.retire_after(va, len, tail, Some((s, epoch)));
                self.claims.records_in_flight += 1;
                Some((s, epoch, self.streams.entry(s).event_to_record(super::EVENTS_IN_FLIGHT)))
            }
            None => {
                for &c in &tail {
                    self.pool.put_bare(c);
                }
                self.retire(va, len, tail);
                None
            }
        }
    }

    /// Takes back retired tails that start at the growable's end, still mapped there, until it
    /// commits `want` pages, when no other range has taken the chunks it takes back and
    /// `stream` may use them (its own shrink, or one whose stream work has completed). Only the
    /// chunks the grow needs come back: the rest of a tail stays retired, its chunks free for
    /// any request, rather than sit committed and unused.
    fn reclaim_tail(&mut self, ptr: u64, stream: u64, want: u64) {
        let page = self.lim.page;
        loop {
            let g = &self.growables[&ptr];
            if g.committed >= want {
                return;
            }
            let end = g.base + g.committed * page;
            let need = want - g.committed;
            let Some(mut r) = self.va.take_retired_at(end) else { return };
            let (mut k, mut pages) = (0, 0);
            while k < r.chunks.len() && pages < need {
                pages += self.pool.get(r.chunks[k]).pages;
                k += 1;
            }
            let free = |c: ChunkId| {
                self.pool.get(c).bare
                    || self.claims.quarantine.iter().any(|q| {
                        q.0 == c
                            && (q.1 == stream
                                || self.streams.get(q.1).map_or(true, |f| f.is_done(q.2)))
                    })
            };
            if !r.chunks[..k].iter().all(|&c| free(c)) {
                self.va.retire(r);
                return;
            }
            let taken: Vec<ChunkId> = r.chunks.drain(..k).collect();
            for &c in &taken {
                if !self.pool.take_if_bare(c) {
                    self.claims.quarantine.retain(|q| q.0 != c);
                }
            }
            let len = pages * page;
            if r.chunks.is_empty() {
                self.stats.retired_ranges.sub(1);
            } else {
                // The rest stays retired, at the addresses after the part taken back.
                r.va += len;
                r.len -= len;
                self.va.retire(r);
            }
            self.stats.active_bytes.add(len);
            self.stats.growable_committed_bytes.add(len);
            self.stats.growable_reclaims += 1;
            let g = self.growables.get_mut(&ptr).expect("still registered");
            g.committed += pages;
            g.chunks.extend(taken);
        }
    }

    /// Each growable with committed pages as a segment: its size as one active block, the rest
    /// of its committed pages inactive.
    pub(super) fn growable_segments(&self) -> Vec<SegmentInfo> {
        let page = self.lim.page;
        let mut out = Vec::new();
        for g in self.growables.values().filter(|g| g.committed > 0) {
            let size = g.committed * page;
            let mut blocks = Vec::new();
            if g.size > 0 {
                blocks.push(BlockInfo {
                    addr: g.base,
                    size: g.size,
                    requested_size: g.size,
                    state: BlockState::ActiveAllocated,
                });
            }
            if g.size < size {
                blocks.push(BlockInfo {
                    addr: g.base + g.size,
                    size: size - g.size,
                    requested_size: 0,
                    state: BlockState::Inactive,
                });
            }
            out.push(SegmentInfo {
                addr: g.base,
                size,
                stream: 0,
                kind: "growable",
                chunks: g.chunks.len(),
                blocks,
            });
        }
        out
    }

    /// Adds the growables to the checks of `Heap::check`: chunk owners and mappings, mapped
    /// spans, and the allocated and active bytes they account for.
    pub(super) fn check_growables(
        &self,
        owners: &mut foldhash::HashMap<ChunkId, u32>,
        maps: &mut foldhash::HashMap<ChunkId, u32>,
        spans: &mut Vec<(u64, u64, &'static str)>,
    ) -> std::result::Result<(u64, u64), String> {
        let page = self.lim.page;
        let (mut allocated, mut active) = (0, 0);
        for g in self.growables.values() {
            let pages: u64 = g.chunks.iter().map(|&c| self.pool.get(c).pages).sum();
            if pages != g.committed || g.committed * page > g.capacity || g.size > g.capacity {
                return Err(format!("growable at {:#x}: its pages do not add up", g.base));
            }
            if g.released && (g.committed > 0 || g.size > 0) {
                return Err(format!("released growable at {:#x} still holds pages", g.base));
            }
            if g.size.div_ceil(page) > g.committed {
                return Err(format!("growable at {:#x}: size beyond its committed pages", g.base));
            }
            for &c in &g.chunks {
                *owners.entry(c).or_default() += 1;
                *maps.entry(c).or_default() += 1;
            }
            if g.committed > 0 {
                spans.push((g.base, g.committed * page, "growable"));
            }
            allocated += g.size;
            active += g.committed * page;
        }
        Ok((allocated, active))
    }
}
