//! The sub-page allocator: requests smaller than a page are carved out of *arenas* (one-page
//! ranges) by best fit over free extents across all arenas, in units of 256 bytes (cudaMalloc's
//! alignment). An arena that empties is handed back to the heap whole. Pure bookkeeping.
//!
//! Blocks are cut from the end of the extent best fit picks, so that the common pair (a block
//! freed and the same size asked for again) changes one extent's length in place.
//!
//! A block freed on a stream whose work may still use it becomes free at once, but *held* for
//! that stream until its free's epoch has completed (`settle`): the stream may take it (stream
//! order makes that safe), no other stream may. Held and open extents coalesce with each other
//! (the result is held, until the later epoch), so on one stream the extents, and therefore what
//! best fit picks, do not depend on when the frees' events complete: the same requests in the
//! same order get the same blocks back, as they do from PyTorch's allocator (whose CUDA-graph
//! trees re-record a graph when a static input moves). Extents held for different streams stay
//! apart. An arena with no block in use goes back to the heap even when one stream still holds
//! it (`Emptied::held`): the heap keeps it pending for that stream, as a freed range, so that it
//! comes back to the stream the same way whenever the free completes.

use std::collections::BTreeSet;

use super::sorted::SortedMap;
use crate::tags::TagId;

// Keys are arena ids and stream handles: a fast hash, not a DoS-resistant one.
#[cfg(not(loom))]
use foldhash::HashMap;
#[cfg(loom)]
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// Alignment and rounding unit of sub-page allocations, as cudaMalloc guarantees.
pub const SUBPAGE_ALIGN: u64 = 256;

/// Arenas are identified by the heap's range id.
pub(crate) type ArenaId = u32;

/// Who may take a free extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// Any stream.
    Open,
    /// Only `stream`, until its free of `epoch` has completed.
    Held { stream: u64, epoch: u64 },
}

impl Owner {
    /// The owner of two adjacent extents merged into one, if they may merge: open space next to
    /// a held extent joins it; two held for one stream stay held until the later epoch.
    fn merged(self, other: Owner) -> Option<Owner> {
        match (self, other) {
            (Owner::Open, o) | (o, Owner::Open) => Some(o),
            (Owner::Held { stream: a, epoch: x }, Owner::Held { stream: b, epoch: y }) => {
                (a == b).then_some(Owner::Held { stream: a, epoch: x.max(y) })
            }
        }
    }
}

/// A free extent: `len` bytes, and who may take them.
#[derive(Clone, Copy, Debug)]
struct Extent {
    len: u64,
    owner: Owner,
}

#[derive(Debug)]
struct Arena {
    len: u64,
    /// The tag of every block cut from it (0: none): only requests of that tag take its space.
    tag: TagId,
    /// Free extents by offset, coalesced where their owners allow.
    free: SortedMap<Extent>,
    /// Used blocks, offset -> len (for interior-pointer errors and checks).
    used: SortedMap<u64>,
    used_bytes: u64,
    /// Free extents held for a stream: the arena goes back held while any is.
    held: usize,
}

impl Arena {
    /// An arena with no block in use, all of it one free extent, open or held for one stream.
    fn emptied(&self, id: ArenaId) -> Option<Emptied> {
        if self.used_bytes != 0 || self.free.len() != 1 {
            return None;
        }
        let held = match self.free.first() {
            Some((_, &Extent { owner: Owner::Held { stream, epoch }, .. })) => {
                Some((stream, epoch))
            }
            _ => None,
        };
        Some(Emptied { arena: id, held })
    }

    /// The free extent that ends at `off`, if its owner may merge with `owner`.
    fn before(&self, off: u64, owner: Owner) -> Option<(u64, Extent, Owner)> {
        let (p, &e) = self.free.last_below(off)?;
        let merged = e.owner.merged(owner)?;
        (p + e.len == off).then_some((p, e, merged))
    }

    /// The free extent that starts at `off`, if its owner may merge with `owner`.
    fn after(&self, off: u64, owner: Owner) -> Option<(Extent, Owner)> {
        let e = *self.free.get(off)?;
        Some((e, e.owner.merged(owner)?))
    }
}

/// An arena with no block in use, for the heap to take back: `held` = (stream, epoch) when the
/// space is still held for that stream until that epoch has completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Emptied {
    pub arena: ArenaId,
    pub held: Option<(u64, u64)>,
}

/// An extent's place in a size index: (tag, len, arena, offset) in one ordered integer, so that
/// best fit for a tag is the first key at or above `key(tag, size, 0, 0)` and below the next
/// tag's keys. Arenas are at most 4 GiB, so a length and an offset take 32 bits each.
fn key(tag: TagId, len: u64, id: ArenaId, off: u64) -> u128 {
    debug_assert!(len < 1 << 32 && off < 1 << 32);
    (u128::from(tag) << 96) | (u128::from(len) << 64) | (u128::from(id) << 32) | u128::from(off)
}

/// The lowest key of the tag after `tag`.
fn next_tag_key(tag: TagId) -> u128 {
    (u128::from(tag) + 1) << 96
}

/// (len, arena, offset) of a key.
fn unkey(k: u128) -> (u64, ArenaId, u64) {
    ((k >> 64) as u32 as u64, (k >> 32) as u32, k as u32 as u64)
}

fn is_held(o: Owner) -> usize {
    usize::from(matches!(o, Owner::Held { .. }))
}

#[derive(Debug, Default)]
pub(crate) struct SubPage {
    arenas: HashMap<ArenaId, Arena>,
    /// Every open extent: best fit is one range query; ties go to the oldest arena and lowest
    /// offset, which packs blocks and lets younger arenas empty.
    open: BTreeSet<u128>,
    /// Each stream's held extents, the same way. A stream's set stays while it empties and
    /// fills again on the hot path; `settle` drops it once empty.
    held: HashMap<u64, BTreeSet<u128>>,
    /// Bytes of all arenas that no block uses.
    free_bytes: u64,
    /// Arenas where free space grew since `take_freed` (kept only when `track_freed` is set:
    /// the heap's carved arenas give whole free chunks back).
    freed: Vec<ArenaId>,
    track_freed: bool,
}

impl SubPage {
    /// An allocator that lists the arenas where free space grows (`take_freed`).
    pub fn tracking_freed() -> Self {
        SubPage { track_freed: true, ..SubPage::default() }
    }

    /// The arenas where free space grew since the last call, each once.
    pub fn take_freed(&mut self) -> Vec<ArenaId> {
        if self.freed.is_empty() {
            return Vec::new();
        }
        let mut out = std::mem::take(&mut self.freed);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The free extents of arena `id`, as (offset, len, owner) in address order.
    pub fn free_extents(&self, id: ArenaId) -> Vec<(u64, u64, Owner)> {
        let Some(a) = self.arenas.get(&id) else { return Vec::new() };
        a.free.iter().map(|(o, e)| (o, e.len, e.owner)).collect()
    }

    /// The offsets of arena `id`'s used blocks, in address order.
    pub fn used_offsets(&self, id: ArenaId) -> Vec<u64> {
        self.arenas.get(&id).map(|a| a.used.iter().map(|(o, _)| o).collect()).unwrap_or_default()
    }

    /// Cuts arena `id` at `at` (inside it, and not inside a used block): it keeps `0..at`, and
    /// `at..` becomes arena `new`, its offsets less `at`. A free extent across `at` is cut in
    /// two of the same owner. Nothing is freed or used.
    pub fn split_arena(&mut self, id: ArenaId, at: u64, new: ArenaId) {
        debug_assert!(self.block_containing(id, at).map_or(true, |(o, _)| o == at));
        let a = self.arenas.get_mut(&id).expect("split_arena: no such arena");
        let tag = a.tag;
        assert!(at > 0 && at < a.len && at % SUBPAGE_ALIGN == 0, "split_arena: bad offset {at}");
        // A free extent across the cut: its head stays, its tail moves.
        let mut moved_free: Vec<(u64, Extent)> = Vec::new();
        let mut stale: Vec<(u128, Owner)> = Vec::new();
        let mut fresh: Vec<(u128, Owner)> = Vec::new();
        if let Some((p, &e)) = a.free.last_below(at) {
            if p + e.len > at {
                let head = at - p;
                stale.push((key(tag, e.len, id, p), e.owner));
                fresh.push((key(tag, head, id, p), e.owner));
                a.free.get_mut(p).expect("just found").len = head;
                moved_free.push((at, Extent { len: e.len - head, owner: e.owner }));
            }
        }
        for (o, e) in a.free.split_off(at) {
            stale.push((key(tag, e.len, id, o), e.owner));
            a.held -= is_held(e.owner);
            moved_free.push((o, e));
        }
        let used = a.used.split_off(at);
        let moved_used: u64 = used.iter().map(|&(_, l)| l).sum();
        a.used_bytes -= moved_used;
        let len = a.len - at;
        a.len = at;
        let mut b = Arena {
            len,
            tag,
            free: SortedMap::default(),
            used: SortedMap::from_sorted(used.into_iter().map(|(o, l)| (o - at, l))),
            used_bytes: moved_used,
            held: 0,
        };
        for (o, e) in moved_free {
            b.free.insert(o - at, e);
            b.held += is_held(e.owner);
            fresh.push((key(tag, e.len, new, o - at), e.owner));
        }
        let prev = self.arenas.insert(new, b);
        debug_assert!(prev.is_none());
        for (k, o) in stale {
            self.unindex(k, o);
        }
        for (k, o) in fresh {
            self.index(k, o);
        }
    }

    /// Adds arena `id` of `len` bytes, all free, for requests of `tag` (0: untagged ones).
    pub fn add_arena(&mut self, id: ArenaId, len: u64, tag: TagId) {
        assert!(len < 1 << 32, "arenas are at most 4 GiB");
        let mut free = SortedMap::default();
        free.insert(0, Extent { len, owner: Owner::Open });
        self.open.insert(key(tag, len, id, 0));
        let arena = Arena { len, tag, free, used: SortedMap::default(), used_bytes: 0, held: 0 };
        let prev = self.arenas.insert(id, arena);
        debug_assert!(prev.is_none());
        self.free_bytes += len;
    }

    /// Bytes of all arenas that no block uses.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Forgets an arena with no block in use.
    pub fn remove_arena(&mut self, id: ArenaId) {
        let a = self.arenas.remove(&id).expect("remove_arena: no such arena");
        debug_assert!(a.emptied(id).is_some());
        self.free_bytes -= a.len;
        for (off, e) in a.free.into_entries() {
            self.unindex(key(a.tag, e.len, id, off), e.owner);
        }
    }

    fn index(&mut self, k: u128, owner: Owner) {
        match owner {
            Owner::Open => self.open.insert(k),
            Owner::Held { stream, .. } => self.held.entry(stream).or_default().insert(k),
        };
    }

    fn unindex(&mut self, k: u128, owner: Owner) {
        match owner {
            Owner::Open => self.open.remove(&k),
            Owner::Held { stream, .. } => self.held.get_mut(&stream).is_some_and(|s| s.remove(&k)),
        };
    }

    /// The best fit for `size` bytes of `tag` on `stream`: the smallest extent of the tag's
    /// arenas it may take, open or held for it, ties to the oldest arena and lowest offset.
    fn best_fit(&self, size: u64, stream: u64, tag: TagId) -> Option<u128> {
        let span = key(tag, size, 0, 0)..next_tag_key(tag);
        let open = self.open.range(span.clone()).next();
        let held = self.held.get(&stream).and_then(|s| s.range(span).next());
        match (open, held) {
            (Some(a), Some(b)) => Some(*a.min(b)),
            (a, b) => a.or(b).copied(),
        }
    }

    /// Whether `stream` would find an extent of `size` bytes of `tag` (what `alloc` would find).
    pub fn fits(&self, size: u64, stream: u64, tag: TagId) -> bool {
        self.best_fit(size, stream, tag).is_some()
    }

    /// Best fit for `size` bytes (a multiple of `SUBPAGE_ALIGN`) on `stream`, cut from the end
    /// of the extent: (arena, offset). What is left of a held extent stays held.
    pub fn alloc(&mut self, size: u64, stream: u64, tag: TagId) -> Option<(ArenaId, u64)> {
        debug_assert!(size > 0 && size % SUBPAGE_ALIGN == 0);
        let k = self.best_fit(size, stream, tag)?;
        let (len, id, off) = unkey(k);
        let a = self.arenas.get_mut(&id).expect("free extent of a missing arena");
        let e = a.free.get_mut(off).expect("indexed extent missing");
        let owner = e.owner;
        if len == size {
            a.free.remove(off);
            a.held -= is_held(owner);
        } else {
            e.len -= size;
        }
        a.used.insert(off + len - size, size);
        a.used_bytes += size;
        self.free_bytes -= size;
        self.unindex(k, owner);
        if len > size {
            self.index(key(tag, len - size, id, off), owner);
        }
        Some((id, off + len - size))
    }

    /// Frees the block at `off` in arena `id`, for `owner` to take, merging it with the free
    /// extents beside it where their owners allow; returns the arena if no block in it is in
    /// use any more.
    pub fn free(&mut self, id: ArenaId, off: u64, owner: Owner) -> Option<Emptied> {
        let a = self.arenas.get_mut(&id).expect("free in a missing arena");
        let size = a.used.remove(off).expect("free of a block that is not used");
        a.used_bytes -= size;
        self.free_bytes += size;
        self.place(id, off, size, owner)
    }

    /// Makes [off, off + len) of arena `id` a free extent of `owner` (nothing there is indexed),
    /// merged with its neighbours where their owners allow.
    fn place(&mut self, id: ArenaId, off: u64, len: u64, owner: Owner) -> Option<Emptied> {
        let a = self.arenas.get_mut(&id).expect("arena missing");
        let tag = a.tag;
        let before = a.before(off, owner);
        let owner = before.map_or(owner, |b| b.2);
        let after = a.after(off + len, owner);
        let owner = after.map_or(owner, |x| x.1);
        let mut held_change = is_held(owner) as isize;
        let mut total = len;
        let mut stale: [Option<(u128, Owner)>; 2] = [None, None];
        if let Some((e, _)) = after {
            a.free.remove(off + len);
            total += e.len;
            held_change -= is_held(e.owner) as isize;
            stale[1] = Some((key(tag, e.len, id, off + len), e.owner));
        }
        let start = match before {
            Some((p, e, _)) => {
                let ext = a.free.get_mut(p).expect("neighbour missing");
                ext.len += total;
                ext.owner = owner;
                total += e.len;
                held_change -= is_held(e.owner) as isize;
                stale[0] = Some((key(tag, e.len, id, p), e.owner));
                p
            }
            None => {
                a.free.insert(off, Extent { len: total, owner });
                off
            }
        };
        a.held = a.held.checked_add_signed(held_change).expect("held count below zero");
        for (k, o) in stale.into_iter().flatten() {
            self.unindex(k, o);
        }
        self.index(key(tag, total, id, start), owner);
        if self.track_freed {
            self.freed.push(id);
        }
        self.arenas[&id].emptied(id)
    }

    /// Opens every extent held for `stream` whose epoch is at most `done`, merging it with its
    /// neighbours; returns the arenas with no block in use. Linear in the stream's held extents
    /// (few: they merge), once per completion, not per request.
    pub fn settle(&mut self, stream: u64, done: u64) -> Vec<Emptied> {
        let mut touched = Vec::new();
        let due = |this: &Self| -> Vec<(ArenaId, u64)> {
            let Some(set) = this.held.get(&stream) else { return Vec::new() };
            set.iter()
                .map(|&k| unkey(k))
                .filter(|&(_, id, off)| {
                    let e = this.arenas[&id].free.get(off).expect("indexed extent missing");
                    matches!(e.owner, Owner::Held { epoch, .. } if epoch <= done)
                })
                .map(|(_, id, off)| (id, off))
                .collect()
        };
        // Opening one may fold another due one into a held neighbour with a later epoch, or a
        // due one into this: a second pass opens what is left.
        loop {
            let list = due(self);
            if list.is_empty() {
                break;
            }
            for (id, off) in list {
                let Some(a) = self.arenas.get_mut(&id) else { continue };
                let Some(&e) = a.free.get(off) else { continue };
                if !matches!(e.owner, Owner::Held { epoch, .. } if epoch <= done) {
                    continue;
                }
                a.free.remove(off);
                a.held -= 1;
                let tag = a.tag;
                self.unindex(key(tag, e.len, id, off), e.owner);
                self.place(id, off, e.len, Owner::Open);
                touched.push(id);
            }
        }
        if self.held.get(&stream).is_some_and(|s| s.is_empty()) {
            self.held.remove(&stream);
        }
        touched.sort_unstable();
        touched.dedup();
        touched.into_iter().filter_map(|id| self.arenas[&id].emptied(id)).collect()
    }

    /// Whether some extent is held for `stream`.
    #[cfg(all(test, not(loom)))]
    pub fn holds_for(&self, stream: u64) -> bool {
        self.held.get(&stream).is_some_and(|s| !s.is_empty())
    }

    /// The used block of arena `id` containing `off`, as (block offset, len).
    pub fn block_containing(&self, id: ArenaId, off: u64) -> Option<(u64, u64)> {
        let a = self.arenas.get(&id)?;
        let (o, &l) = a.used.last_at_or_below(off)?;
        (off < o + l).then_some((o, l))
    }

    #[cfg(all(test, not(loom)))]
    pub fn arena_count(&self) -> usize {
        self.arenas.len()
    }

    pub fn arena_ids(&self) -> impl Iterator<Item = ArenaId> + '_ {
        self.arenas.keys().copied()
    }

    /// Checks that every arena is tiled exactly by its used and free extents, that no two
    /// adjacent free extents could merge, and that the indexes match the free extents.
    pub fn check(&self) -> Result<(), String> {
        let mut open = 0;
        let mut held = 0;
        for (&id, a) in &self.arenas {
            let mut all: Vec<(u64, u64, Option<Owner>)> =
                a.free.iter().map(|(o, e)| (o, e.len, Some(e.owner))).collect();
            all.extend(a.used.iter().map(|(o, &l)| (o, l, None)));
            all.sort_by_key(|e| e.0);
            let mut at = 0;
            let mut prev: Option<Owner> = None;
            for (o, l, owner) in all {
                if o != at {
                    return Err(format!(
                        "arena {id}: gap or overlap at offset {at} (next extent at {o})"
                    ));
                }
                if let (Some(p), Some(w)) = (prev, owner) {
                    if p.merged(w).is_some() {
                        return Err(format!(
                            "arena {id}: adjacent free extents at {o} not coalesced"
                        ));
                    }
                }
                if o % SUBPAGE_ALIGN != 0 || l == 0 {
                    return Err(format!("arena {id}: bad extent ({o}, {l})"));
                }
                prev = owner;
                at = o + l;
            }
            if at != a.len {
                return Err(format!("arena {id}: extents cover {at} of {} bytes", a.len));
            }
            a.free.check().map_err(|e| format!("arena {id}'s free extents: {e}"))?;
            a.used.check().map_err(|e| format!("arena {id}'s blocks: {e}"))?;
            if a.used.iter().map(|(_, &l)| l).sum::<u64>() != a.used_bytes {
                return Err(format!("arena {id}: used byte count drifted"));
            }
            let mut held_here = 0;
            for (o, e) in a.free.iter() {
                let k = key(a.tag, e.len, id, o);
                let indexed = match e.owner {
                    Owner::Open => {
                        open += 1;
                        self.open.contains(&k)
                    }
                    Owner::Held { stream, .. } => {
                        held_here += 1;
                        self.held.get(&stream).is_some_and(|s| s.contains(&k))
                    }
                };
                if !indexed {
                    return Err(format!(
                        "arena {id}: free extent ({o}, {}, {:?}) missing from the indexes",
                        e.len, e.owner
                    ));
                }
            }
            if held_here != a.held {
                return Err(format!("arena {id}: held extent count drifted"));
            }
            held += held_here;
        }
        let free: u64 = self.arenas.values().map(|a| a.len - a.used_bytes).sum();
        if free != self.free_bytes {
            return Err(format!(
                "free bytes counted {} against {free} in the arenas",
                self.free_bytes
            ));
        }
        let held_entries: usize = self.held.values().map(|s| s.len()).sum();
        if open != self.open.len() || held != held_entries {
            return Err(format!(
                "indexes have {} open and {held_entries} held entries for {open} open and \
                 {held} held extents",
                self.open.len(),
            ));
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: u64 = SUBPAGE_ALIGN;

    #[test]
    fn a_tags_arenas_serve_only_that_tag() {
        let mut s = SubPage::default();
        s.add_arena(1, 4 * A, 0);
        s.add_arena(2, 4 * A, 5);
        s.add_arena(3, 4 * A, 6);
        assert_eq!(s.alloc(A, 0, 5).map(|b| b.0), Some(2));
        assert_eq!(s.alloc(A, 0, 6).map(|b| b.0), Some(3));
        assert_eq!(s.alloc(A, 0, 0).map(|b| b.0), Some(1));
        assert!(s.alloc(4 * A, 0, 5).is_none(), "no tag borrows another's space");
        assert!(!s.fits(A, 0, 7));
        let (_, off) = s.alloc(3 * A, 0, 6).unwrap();
        assert!(s.alloc(A, 0, 6).is_none());
        assert!(s.free(3, off, Owner::Open).is_none());
        assert_eq!(s.alloc(3 * A, 0, 6).map(|b| b.0), Some(3));
        s.check().unwrap();
    }

    #[test]
    fn best_fit_prefers_the_smallest_hole() {
        let mut s = SubPage::default();
        s.add_arena(7, 16 * A, 0);
        // Blocks are cut from the end of their extent.
        let (_, a) = s.alloc(4 * A, 0, 0).unwrap();
        let (_, b) = s.alloc(A, 0, 0).unwrap();
        let (_, c) = s.alloc(8 * A, 0, 0).unwrap();
        assert_eq!((a, b, c), (12 * A, 11 * A, 3 * A));
        s.free(7, a, Owner::Open); // hole of 3 at 0, hole of 4 at the end
        assert!(s.free(7, b, Owner::Open).is_none()); // merges with the hole after it: 5 at 11
        let (_, d) = s.alloc(3 * A, 0, 0).unwrap();
        assert_eq!(d, 0, "took the 3-unit hole at the start, not the 5-unit one");
        s.check().unwrap();
    }

    #[test]
    fn arena_empties_and_is_removed() {
        let mut s = SubPage::default();
        s.add_arena(1, 4 * A, 0);
        let (_, a) = s.alloc(A, 0, 0).unwrap();
        let (_, b) = s.alloc(3 * A, 0, 0).unwrap();
        assert_eq!(s.alloc(A, 0, 0), None);
        assert_eq!(s.block_containing(1, b + 10), Some((b, 3 * A)));
        assert_eq!(s.free(1, a, Owner::Open), None);
        assert_eq!(s.free(1, b, Owner::Open), Some(Emptied { arena: 1, held: None }));
        s.remove_arena(1);
        assert_eq!(s.arena_count(), 0);
        s.check().unwrap();
    }

    fn held(stream: u64, epoch: u64) -> Owner {
        Owner::Held { stream, epoch }
    }

    #[test]
    fn a_held_extent_is_its_streams_alone_until_settled() {
        let mut s = SubPage::default();
        s.add_arena(3, 4 * A, 0);
        let (_, x) = s.alloc(A, 1, 0).unwrap();
        let (_, a) = s.alloc(3 * A, 1, 0).unwrap();
        assert_eq!(s.free(3, a, held(1, 10)), None);
        assert_eq!(s.alloc(A, 2, 0), None, "another stream must wait");
        assert!(s.fits(A, 1, 0) && !s.fits(A, 2, 0));
        assert!(s.settle(1, 9).is_empty(), "epoch 10 has not completed");
        assert_eq!(s.alloc(A, 2, 0), None);
        assert!(s.settle(1, 10).is_empty(), "settled, one block still in use");
        assert!(!s.holds_for(1));
        let (_, y) = s.alloc(A, 2, 0).unwrap();
        assert_eq!(y, 2 * A);
        s.check().unwrap();
        // An arena with nothing in use goes back, still held when its stream holds it.
        assert_eq!(s.free(3, x, held(1, 11)), None, "the block at 2A is in use");
        assert_eq!(s.free(3, y, held(1, 12)), Some(Emptied { arena: 3, held: Some((1, 12)) }));
        s.check().unwrap();
        s.remove_arena(3);
        assert!(!s.holds_for(1));
        s.check().unwrap();
    }

    #[test]
    fn held_extents_merge_with_open_space_and_their_own_streams_only() {
        let mut s = SubPage::default();
        s.add_arena(0, 8 * A, 0);
        let b: Vec<u64> = (0..4).map(|_| s.alloc(2 * A, 1, 0).unwrap().1).collect();
        assert_eq!(b, [6 * A, 4 * A, 2 * A, 0]);
        s.free(0, b[3], Owner::Open);
        s.free(0, b[2], held(1, 5)); // joins the open space before it: held [0, 4)
        s.free(0, b[0], held(2, 6)); // another stream's: apart
        s.check().unwrap();
        assert_eq!(s.alloc(4 * A, 1, 0), Some((0, 0)), "stream 1 takes the merged extent");
        assert_eq!(s.alloc(A, 1, 0), None, "nothing else is stream 1's");
        s.free(0, 0, held(1, 7));
        s.free(0, b[1], held(1, 8)); // [0, 6) held for 1 until epoch 8, [6, 8) for 2
        assert!(s.settle(1, 7).is_empty(), "the merged extent waits for its later epoch");
        assert_eq!(s.alloc(A, 2, 0), Some((0, 7 * A)), "stream 2 takes only its own");
        // Opened, [0, 6) joins stream 2's held [6, 7).
        assert!(s.settle(1, 8).is_empty());
        assert!(!s.holds_for(1) && s.holds_for(2));
        assert_eq!(s.alloc(6 * A, 3, 0), None);
        assert_eq!(s.alloc(6 * A, 2, 0), Some((0, A)));
        s.check().unwrap();
    }

    proptest! {
        #[test]
        fn random_mixes_keep_arenas_tiled(
            ops in proptest::collection::vec((0u8..4, 1u64..40, 0u64..3), 1..400)
        ) {
            let mut s = SubPage::default();
            s.add_arena(0, 64 * A, 0);
            s.add_arena(1, 64 * A, 0);
            let mut live: Vec<(ArenaId, u64, u64)> = Vec::new();
            let mut epoch = 0;
            for (op, units, stream) in ops {
                match op {
                    0 | 1 => {
                        if let Some((id, off)) = s.alloc(units * A, stream, 0) {
                            for &(i, o, l) in &live {
                                prop_assert!(i != id || off + units * A <= o || o + l <= off, "overlap");
                            }
                            live.push((id, off, units * A));
                        }
                    }
                    2 if !live.is_empty() => {
                        let (id, off, _) = live.swap_remove(units as usize % live.len());
                        epoch += 1;
                        let owner = if stream == 0 { Owner::Open } else { held(stream, epoch) };
                        s.free(id, off, owner);
                    }
                    _ => {
                        s.settle(stream, epoch.saturating_sub(units % 3));
                    }
                }
                s.check().map_err(TestCaseError::fail)?;
            }
        }

        /// Arenas cut anywhere outside a used block (as the heap cuts carved arenas at chunk
        /// boundaries) stay tiled and indexed, and every live block stays used where it moved.
        #[test]
        fn arenas_split_between_blocks_stay_tiled(
            ops in proptest::collection::vec((0u8..5, 1u64..40, 0u64..3), 1..400)
        ) {
            let mut s = SubPage::default();
            s.add_arena(0, 64 * A, 0);
            let mut next_id = 1;
            let mut live: Vec<(ArenaId, u64, u64)> = Vec::new();
            let mut epoch = 0;
            for (op, units, stream) in ops {
                match op {
                    0 | 1 => {
                        if let Some((id, off)) = s.alloc(units * A, stream, 0) {
                            live.push((id, off, units * A));
                        }
                    }
                    2 if !live.is_empty() => {
                        let (id, off, _) = live.swap_remove(units as usize % live.len());
                        epoch += 1;
                        let owner = if stream == 0 { Owner::Open } else { held(stream, epoch) };
                        if let Some(e) = s.free(id, off, owner) {
                            if e.held.is_none() && units % 2 == 0 {
                                s.remove_arena(id);
                            }
                        }
                    }
                    3 => {
                        s.settle(stream, epoch.saturating_sub(units % 3));
                    }
                    _ => {
                        // Cut the arena of the `units`-th id at the first unit boundary from
                        // `units` on that no used block straddles.
                        let ids: Vec<ArenaId> = s.arena_ids().collect();
                        if ids.is_empty() {
                            continue;
                        }
                        let id = ids[units as usize % ids.len()];
                        let len = s.arenas[&id].len;
                        let at = (units * A..len).step_by(A as usize).find(|&o| {
                            s.block_containing(id, o).map_or(true, |(b, _)| b == o)
                        });
                        if let Some(at) = at.filter(|&o| o > 0) {
                            let free = s.free_bytes();
                            s.split_arena(id, at, next_id);
                            for b in live.iter_mut().filter(|b| b.0 == id && b.1 >= at) {
                                *b = (next_id, b.1 - at, b.2);
                            }
                            next_id += 1;
                            prop_assert_eq!(s.free_bytes(), free);
                        }
                    }
                }
                s.check().map_err(TestCaseError::fail)?;
                for &(id, off, len) in &live {
                    prop_assert_eq!(s.block_containing(id, off), Some((off, len)));
                }
            }
        }

        /// On one stream, what best fit hands out does not depend on when frees settle.
        #[test]
        fn one_streams_blocks_do_not_depend_on_when_frees_settle(
            ops in proptest::collection::vec((any::<bool>(), 1u64..40, any::<bool>()), 1..300)
        ) {
            let run = |settle_now: bool| {
                let mut s = SubPage::default();
                let mut live: Vec<(ArenaId, u64)> = Vec::new();
                let mut got = Vec::new();
                // An emptied arena goes back to the heap, whose cache hands the lowest address
                // out first: here, the lowest id.
                let mut removed = std::collections::BTreeSet::new();
                let mut next = 0;
                let mut epoch = 0;
                for &(alloc, units, settle) in &ops {
                    if alloc {
                        let at = s.alloc(units * A, 7, 0).or_else(|| {
                            let id = removed.pop_first().unwrap_or_else(|| {
                                next += 1;
                                next - 1
                            });
                            s.add_arena(id, 64 * A, 0);
                            s.alloc(units * A, 7, 0)
                        });
                        got.push(at);
                        live.extend(at);
                    } else if !live.is_empty() {
                        let (id, off) = live.remove(units as usize % live.len());
                        epoch += 1;
                        // An arena with nothing in use goes back to the heap, open (cached) or
                        // held (pending for the stream): the stream gets either back the same way.
                        let mut emptied: Vec<Emptied> =
                            s.free(id, off, held(7, epoch)).into_iter().collect();
                        for e in emptied.drain(..) {
                            s.remove_arena(e.arena);
                            removed.insert(e.arena);
                        }
                        if settle_now || settle {
                            emptied.extend(s.settle(7, epoch));
                        }
                        for e in emptied {
                            s.remove_arena(e.arena);
                            removed.insert(e.arena);
                        }
                    }
                }
                got
            };
            prop_assert_eq!(run(true), run(false));
        }
    }
}
