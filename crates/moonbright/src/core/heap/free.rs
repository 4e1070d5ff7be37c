//! Frees: a live allocation taken out (an unknown pointer, a pointer into an allocation and a
//! double free told apart), freed at once or in a stream's order (joined with other streams'
//! uses), graph pools' kept blocks, and the way a freed range or block goes back to the cache,
//! its arena or its stream.

use std::collections::hash_map::Entry;

use super::{Backing, Freed, Heap, Live, RangeId, Use};
use crate::core::history::HistoryAction;
use crate::core::streams::Pending;
use crate::core::subpage::{Emptied, Owner, SubPage};
use crate::error::{Error, Result};

impl Heap {
    pub(super) fn take_live(&mut self, ptr: u64) -> Result<Live> {
        self.take_live_unless(ptr, |_| false).map(|l| l.expect("never kept"))
    }

    /// `take_live`, unless `keep` says to leave the allocation as it is (`Ok(None)`): one hash
    /// lookup either way, on the free path.
    pub(super) fn take_live_unless(
        &mut self,
        ptr: u64,
        keep: impl FnOnce(&Live) -> bool,
    ) -> Result<Option<Live>> {
        if self.any_tag_asleep() {
            if let Some(tag) = self.live.allocs.get(&ptr).map(|l| l.tag).filter(|&t| t != 0) {
                self.check_awake(tag, "a free")?;
            }
        }
        let live = match self.live.allocs.entry(ptr) {
            Entry::Occupied(e) if keep(e.get()) => return Ok(None),
            Entry::Occupied(e) => Some(e.remove()),
            Entry::Vacant(_) => None,
        };
        let Some(live) = live else {
            return Err(self.classify_bad_free(ptr));
        };
        // A pooled block left the counts when its pool kept it.
        if !live.pooled {
            self.uncount(live.size, live.rounded);
        }
        self.remember_free(ptr);
        Ok(Some(live))
    }

    /// Adds an allocation of `size` bytes (`rounded` held) to the statistics.
    pub(super) fn count(&mut self, size: u64, rounded: u64) {
        self.stats.allocated_bytes.add(size);
        self.stats.active_bytes.add(rounded);
        self.stats.rounding_waste_bytes.add(rounded - size);
        self.stats.allocations.add(1);
    }

    /// Takes an allocation of `size` bytes (`rounded` held) out of the statistics.
    pub(super) fn uncount(&mut self, size: u64, rounded: u64) {
        self.stats.allocated_bytes.sub(size);
        self.stats.active_bytes.sub(rounded);
        self.stats.rounding_waste_bytes.sub(rounded - size);
        self.stats.allocations.sub(1);
    }

    // ---- graph pools' blocks --------------------------------------------------------------------

    /// A graph pool keeps the block at `ptr` that its user freed: it stays live here (the
    /// pool's, mapped), but no longer counts as allocated or active, as PyTorch counts a
    /// graph-private pool's free blocks, and shows as free space in `segments`. The history
    /// keeps it allocated until the pool hands it back to the heap, so that its events pair up.
    /// Does nothing to a block not live, or kept already.
    pub fn pool_keep(&mut self, ptr: u64) {
        let Some(live) = self.live.allocs.get_mut(&ptr).filter(|l| !l.pooled) else { return };
        live.pooled = true;
        let (size, rounded) = (live.size, live.rounded);
        self.uncount(size, rounded);
    }

    /// A graph pool hands its kept block at `ptr` to a request of `size` bytes on `stream`: it
    /// counts as allocated again. Does nothing to a block not kept.
    pub fn pool_reuse(&mut self, ptr: u64, size: u64, stream: u64) {
        let Some(live) = self.live.allocs.get_mut(&ptr).filter(|l| l.pooled) else { return };
        live.pooled = false;
        live.size = size.min(live.rounded);
        live.stream = stream;
        let (size, rounded) = (live.size, live.rounded);
        self.count(size, rounded);
    }

    /// A graph pool makes its kept block at `ptr` live again as it was (a checkpointed pool
    /// state set back), for `stream`: it counts as allocated again, with the size last asked.
    pub fn pool_revive(&mut self, ptr: u64, stream: u64) {
        let Some(size) = self.live.allocs.get(&ptr).filter(|l| l.pooled).map(|l| l.size) else {
            return;
        };
        self.pool_reuse(ptr, size, stream);
    }

    /// Remembers a freed pointer, to tell a double free from an unknown pointer.
    pub(super) fn remember_free(&mut self, ptr: u64) {
        self.live.remember_free(ptr);
    }

    /// Frees at once: the caller guarantees no device work uses the memory any more.
    pub fn free_now(&mut self, ptr: u64) -> Result<()> {
        let live = self.take_live(ptr)?;
        self.note(HistoryAction::FreeRequested, ptr, live.size, live.stream);
        self.note(HistoryAction::FreeCompleted, ptr, live.size, live.stream);
        self.release_backing(live.backing);
        Ok(())
    }

    /// Notes that work on `stream` uses the live allocation at `ptr` (PyTorch's
    /// `recordStream`): a later `free_on_stream` waits for `stream`'s work queued before it too.
    /// Refuses a pointer that is not the start of a live allocation, and changes nothing then.
    pub fn record_use(&mut self, ptr: u64, stream: u64) -> Result<()> {
        let Some(live) = self.live.allocs.get_mut(&ptr) else {
            return Err(match self.classify_bad_free(ptr) {
                Error::DoubleFree { ptr } => Error::UnknownPointer { ptr },
                e => e,
            });
        };
        if !live.uses.contains(&stream) {
            live.uses.push(stream);
        }
        Ok(())
    }

    /// Frees in `stream`'s order: reusable at once by `stream`, by others once an event recorded
    /// after this free has completed. Returns the events the caller must record now: one on
    /// `stream`, or, for an allocation other streams use too (`record_use`), one on each of
    /// those streams and on `stream`. Such a free is joined (`Streams::push_joined`): no stream,
    /// `stream` included, reuses it until each one's work queued before the free has completed.
    /// Until `uses_checked`, such a free changes nothing and asks the caller to check that none
    /// of those streams is capturing (`Freed::CheckUses`), as it must for `stream`.
    pub fn free_on_stream(&mut self, ptr: u64, stream: u64, uses_checked: bool) -> Result<Freed> {
        let keep = |l: &Live| !uses_checked && l.uses.iter().any(|&u| u != stream);
        let Some(live) = self.take_live_unless(ptr, keep)? else {
            // Kept live for the check (a second lookup, on this rare path only).
            return Ok(Freed::CheckUses(self.live.allocs[&ptr].uses.clone()));
        };
        self.note(HistoryAction::FreeRequested, ptr, live.size, stream);
        let what = match live.backing {
            Backing::Range(id) => {
                self.range_mut(id).use_ = Use::Pending;
                Pending::Range { id, va: self.range(id).va, pages: self.range(id).pages }
            }
            Backing::Sub { .. } => Pending::Block { ptr, rounded: live.rounded },
        };
        if live.uses.iter().all(|&u| u == stream) {
            let epoch = match what {
                // Exported: never reused, not even by `stream`; unmapped once its work passes.
                Pending::Range { id, va, pages } if self.holds_exported(id) => {
                    let epoch = self.streams.push(stream, Pending::Mark);
                    self.discard_range(id, Some((stream, epoch)));
                    self.note(HistoryAction::FreeCompleted, va, self.bytes(pages), stream);
                    epoch
                }
                // Free at once, held for the stream in its arena until the epoch completes
                // (`SubPage`): as PyTorch's allocator, the history shows the free complete now.
                Pending::Block { ptr, rounded } => {
                    let Backing::Sub { arena, offset } = live.backing else {
                        unreachable!("a block is backed by an arena")
                    };
                    let epoch = self.streams.hold(stream);
                    // A sub-page arena this empties goes back when `settle` opens its space; a
                    // carved one's whole free chunks go pending for the stream at once.
                    self.arenas_of(arena).free(arena, offset, Owner::Held { stream, epoch });
                    self.uncarve_freed();
                    self.note(HistoryAction::FreeCompleted, ptr, rounded, stream);
                    epoch
                }
                _ => self.streams.push(stream, what),
            };
            if self.lim.defer_free_events {
                // `streams_needing_events` lists the stream until a record covers `epoch`.
                self.streams.entry(stream).leave_unrecorded(epoch);
                return Ok(Freed::Deferred);
            }
            return Ok(Freed::One(self.record_for(stream, epoch)));
        }
        let mut streams = vec![stream];
        streams.extend(live.uses.iter().filter(|&&u| u != stream));
        self.stats.joined_frees += 1;
        let waits = self.streams.push_joined(&streams, what);
        Ok(Freed::Joined(waits.into_iter().map(|(s, epoch)| self.record_for(s, epoch)).collect()))
    }

    pub(super) fn release_backing(&mut self, backing: Backing) {
        match backing {
            Backing::Range(id) => self.cache_range(id),
            Backing::Sub { arena, offset } => {
                if let Some(e) = self.arenas_of(arena).free(arena, offset, Owner::Open) {
                    self.arena_emptied(e);
                }
                self.uncarve_freed();
            }
        }
    }

    /// The allocator that owns arena `id`.
    pub(super) fn arenas_of(&mut self, id: RangeId) -> &mut SubPage {
        if self.range(id).use_ == Use::Arena {
            &mut self.sub
        } else {
            &mut self.carved
        }
    }

    /// Takes back an arena with no block in use: cached, or pending for the stream that still
    /// holds its space, until the epoch it holds it for (a freed range's way back to it).
    pub(super) fn arena_emptied(&mut self, e: Emptied) {
        self.arenas_of(e.arena).remove_arena(e.arena);
        match e.held {
            None => self.cache_range(e.arena),
            Some((stream, epoch)) => {
                let r = self.range_mut(e.arena);
                r.use_ = Use::PendingArena;
                let what = Pending::Range { id: e.arena, va: r.va, pages: r.pages };
                self.streams.push_held(stream, epoch, what);
            }
        }
    }

    pub(super) fn classify_bad_free(&self, ptr: u64) -> Error {
        if let Some((_, id)) = self.ranges.at_or_below(ptr) {
            let r = self.range(id);
            if ptr < r.va + self.bytes(r.pages) {
                match r.use_ {
                    Use::Alloc => {
                        return Error::InteriorPointer { ptr, base: r.va, offset: ptr - r.va };
                    }
                    Use::Arena | Use::Carved => {
                        let arenas = if r.use_ == Use::Arena { &self.sub } else { &self.carved };
                        if let Some((off, _)) = arenas.block_containing(id, ptr - r.va) {
                            let base = r.va + off;
                            if base != ptr {
                                return Error::InteriorPointer { ptr, base, offset: ptr - base };
                            }
                        }
                    }
                    Use::Cached { .. } | Use::Pending | Use::PendingArena => {}
                }
            }
        }
        if self.live.freed_lately(ptr) {
            Error::DoubleFree { ptr }
        } else {
            Error::UnknownPointer { ptr }
        }
    }
}
