//! What the heap shows of itself: its mapped ranges and their blocks for snapshots
//! (`segments`), and the invariants `check` verifies, after every operation when
//! `Options::validate` is set (docs/design.md, Invariants).

use std::collections::{BTreeMap, BTreeSet};

use foldhash::{HashMap, HashMapExt};

use super::{Backing, Heap, RangeId, Use};
use crate::core::history::{shown_stream, BlockInfo, BlockState, SegmentInfo};
use crate::core::pool::ChunkId;
use crate::core::streams::Pending;
use crate::core::subpage::SUBPAGE_ALIGN;

impl Heap {
    /// Every mapped range and its blocks, in address order.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let mut by_range: HashMap<RangeId, Vec<BlockInfo>> = HashMap::new();
        let mut streams: HashMap<RangeId, u64> = HashMap::new();
        for (&ptr, l) in &self.live.allocs {
            let id = match l.backing {
                Backing::Range(id) => id,
                Backing::Sub { arena, .. } => arena,
            };
            streams.insert(id, l.stream);
            if l.pooled {
                // A graph pool's free block: free space of the range, as PyTorch shows it.
                by_range.entry(id).or_default();
                continue;
            }
            by_range.entry(id).or_default().push(BlockInfo {
                addr: ptr,
                size: l.rounded,
                requested_size: l.size,
                state: BlockState::ActiveAllocated,
            });
        }
        let mut out = Vec::new();
        for (&va, &id) in &self.ranges.by_va {
            let r = self.range(id);
            if r.asleep {
                // Unmapped while its tag sleeps: no memory, nothing to show.
                continue;
            }
            let size = self.bytes(r.pages);
            let mut blocks = by_range.remove(&id).unwrap_or_default();
            blocks.sort_by_key(|b| b.addr);
            // Free space between used blocks shows as inactive blocks, as PyTorch shows it.
            let mut filled = Vec::new();
            let mut at = va;
            for b in blocks {
                if b.addr > at {
                    filled.push(BlockInfo {
                        addr: at,
                        size: b.addr - at,
                        requested_size: 0,
                        state: BlockState::Inactive,
                    });
                }
                at = b.addr + b.size;
                filled.push(b);
            }
            if at < va + size {
                filled.push(BlockInfo {
                    addr: at,
                    size: va + size - at,
                    requested_size: 0,
                    state: BlockState::Inactive,
                });
            }
            let kind = match r.use_ {
                Use::Alloc => "alloc",
                Use::Arena => "arena",
                Use::Carved => "carved",
                Use::Pending | Use::PendingArena => "pending",
                Use::Cached { .. } => "cached",
            };
            out.push(SegmentInfo {
                addr: va,
                size,
                stream: shown_stream(streams.get(&id).copied().unwrap_or(0)),
                kind,
                chunks: r.chunks.len(),
                blocks: filled,
            });
        }
        out.extend(self.growable_segments());
        out.sort_by_key(|seg| seg.addr);
        out
    }

    /// Checks every invariant that spans the heap's structures (see docs/design.md).
    pub fn check(&self) -> std::result::Result<(), String> {
        self.pool.check()?;
        self.sub.check()?;
        for (stream, frees) in self.streams.iter() {
            frees.check().map_err(|e| format!("stream {stream:#x}: {e}"))?;
        }
        self.carved.check()?;
        let page = self.lim.page;
        // Each chunk is in exactly one place: a live, pending or cached range, the window, a plan
        // in flight, or bare. Its mapping count is the number of ranges (any, retired included)
        // and window slots that map it.
        let mut owners: HashMap<ChunkId, u32> = HashMap::new();
        let mut maps: HashMap<ChunkId, u32> = HashMap::new();
        let mut spans: Vec<(u64, u64, &str)> = Vec::new();
        let mut cached = 0;
        let mut cached_pages = 0;
        let small: std::collections::HashSet<RangeId> = self.sub.arena_ids().collect();
        let carved: std::collections::HashSet<RangeId> = self.carved.arena_ids().collect();
        for (id, r) in self.ranges.iter().map(|(i, r)| (i as usize, r)) {
            if r.asleep {
                if !r.chunks.is_empty() || !matches!(r.use_, Use::Alloc | Use::Arena) {
                    return Err(format!(
                        "range {id} asleep with chunks, or in use as {:?}",
                        r.use_
                    ));
                }
                if self.ranges.by_va.get(&r.va) != Some(&(id as RangeId)) {
                    return Err(format!("range {id} missing from the address index"));
                }
                continue;
            }
            let sum: u64 = r.chunks.iter().map(|&c| self.pool.get(c).pages).sum();
            if sum != r.pages {
                return Err(format!(
                    "range {id} at {:#x}: chunks hold {sum} pages, range has {}",
                    r.va, r.pages
                ));
            }
            for &c in r.chunks.iter() {
                *owners.entry(c).or_default() += 1;
                *maps.entry(c).or_default() += 1;
            }
            if self.ranges.by_va.get(&r.va) != Some(&(id as RangeId)) {
                return Err(format!("range {id} missing from the address index"));
            }
            if let Use::Cached { seq } = r.use_ {
                cached += 1;
                cached_pages += r.pages;
                if self.cache.lru.get(&seq) != Some(&(id as RangeId))
                    || !self.cache.by_size.contains(&(r.pages, r.va, seq))
                    || self.cache.by_va.get(&r.va) != Some(&(seq, r.pages, id as RangeId))
                {
                    return Err(format!("cached range {id} missing from the cache indexes"));
                }
            }
            if r.use_ == Use::Carved && !self.free_chunk_runs(id as RangeId).is_empty() {
                return Err(format!("carved arena {id} holds a whole chunk of free space"));
            }
            let (in_small, in_carved) =
                (small.contains(&(id as RangeId)), carved.contains(&(id as RangeId)));
            if (r.use_ == Use::Arena) != in_small || (r.use_ == Use::Carved) != in_carved {
                return Err(format!(
                    "range {id} in use as {:?}: a sub-page arena {in_small}, a carved one {in_carved}",
                    r.use_
                ));
            }
            spans.push((r.va, r.pages * page, "range"));
        }
        if cached != self.cache.lru.len()
            || cached != self.cache.by_size.len()
            || cached != self.cache.by_va.len()
            || cached_pages != self.cache.pages
        {
            return Err("cache indexes disagree with the ranges".into());
        }
        // Groups of cached neighbours, from the cached ranges in address order.
        let mut groups: Vec<(u64, u64, usize)> = Vec::new();
        for (&a, &(_, p, _)) in &self.cache.by_va {
            match groups.last_mut() {
                Some(g) if g.1 == a && self.same_reservation(g.0, a) => {
                    g.1 = a + p * page;
                    g.2 += 1;
                }
                _ => groups.push((a, a + p * page, 1)),
            }
        }
        let groups: BTreeMap<u64, u64> =
            groups.into_iter().filter(|g| g.2 > 1).map(|g| (g.0, g.1)).collect();
        let by_size: BTreeSet<(u64, u64)> =
            groups.iter().map(|(&s, &e)| ((e - s) / page, s)).collect();
        if groups != self.cache.groups || by_size != self.cache.groups_by_size {
            return Err(format!(
                "groups of cached neighbours {:?} by size {:?}, expected {groups:?}",
                self.cache.groups, self.cache.groups_by_size
            ));
        }
        let mut pending_ranges = 0;
        // Every range marked pending is in exactly one stream's list or joined free, and back.
        let mut pending_ids = BTreeSet::new();
        let items = self.streams.iter().flat_map(|(_, f)| f.items()).chain(self.streams.joined());
        for item in items {
            if let Pending::Range { id, pages, .. } = item {
                pending_ranges += pages;
                match self.ranges.try_get(id) {
                    Some(r) if matches!(r.use_, Use::Pending | Use::PendingArena) => {}
                    _ => return Err(format!("pending range {id} is not marked pending")),
                }
                if !pending_ids.insert(id) {
                    return Err(format!("pending range {id} waits twice"));
                }
            }
        }
        let marked = self
            .ranges
            .iter()
            .map(|(_, r)| r)
            .filter(|r| matches!(r.use_, Use::Pending | Use::PendingArena))
            .count();
        if marked != pending_ids.len() {
            return Err(format!(
                "{marked} ranges are marked pending, {} wait for a stream",
                pending_ids.len()
            ));
        }
        if pending_ranges != self.streams.pending_pages() {
            return Err("pending page count drifted".into());
        }
        for (va, pages, chunks) in self.window.mapped.segments() {
            let mut sum = 0;
            for &c in &chunks {
                *owners.entry(c).or_default() += 1;
                *maps.entry(c).or_default() += 1;
                let p = self.pool.get(c).pages;
                if chunks.len() > 1 && p != 1 {
                    return Err(format!("window chunk {c} of {p} pages is in a segment"));
                }
                sum += p;
            }
            if sum != pages {
                return Err(format!("window span at {va:#x}: {pages} pages, chunks of {sum}"));
            }
            spans.push((va, pages * page, "window"));
        }
        let (grow_allocated, grow_active) =
            self.check_growables(&mut owners, &mut maps, &mut spans)?;
        for claim in self.claims.plans.values() {
            for &c in &claim.chunks {
                *owners.entry(c).or_default() += 1;
            }
            if let Some((va, len)) = claim.va {
                spans.push((va, len, "in flight"));
            }
        }
        for &(c, _, _) in &self.claims.quarantine {
            *owners.entry(c).or_default() += 1;
        }
        for r in self.va.retired() {
            for &c in r.chunks.iter() {
                *maps.entry(c).or_default() += 1;
            }
            spans.push((r.va, r.len, "retired"));
        }
        if self.claims.unmapping > 0 {
            // Runs being unmapped are out of every structure; mapping counts cannot be checked.
            return Ok(());
        }
        for (c, chunk) in self.pool.iter() {
            let owned = owners.get(&c).copied().unwrap_or(0);
            let doomed = self.pool.is_doomed(c);
            if owned + chunk.bare as u32 + doomed as u32 != 1 {
                return Err(format!(
                    "chunk {c} has {owned} owners, bare={} and doomed={doomed}",
                    chunk.bare
                ));
            }
            let found = maps.get(&c).copied().unwrap_or(0);
            if found != chunk.mappings {
                return Err(format!("chunk {c} counts {} mappings, {found} found", chunk.mappings));
            }
        }
        if owners.keys().any(|&c| self.pool.try_get(c).is_none()) {
            return Err("a range holds a chunk the pool does not know".into());
        }
        // Mapped, retired, recycled, slab and never-used addresses are disjoint and inside
        // reservations.
        spans.extend(self.va.recycled().map(|(a, l)| (a, l, "recycled")));
        let (f, fe) = self.va.frontier();
        if fe > f {
            spans.push((f, fe - f, "frontier"));
        }
        let (sn, se) = self.window.slab;
        if se > sn {
            spans.push((sn, se - sn, "window slab"));
        }
        spans.sort();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "{} at {:#x} overlaps {} at {:#x}",
                    w[0].2, w[0].0, w[1].2, w[1].0
                ));
            }
        }
        for &(a, l, what) in &spans {
            if a % page != 0 || l % page != 0 {
                return Err(format!("{what} at {a:#x} is not page-aligned"));
            }
            let mut all = self.va.reservations().iter().chain(self.va.private_reservations());
            if !all.any(|&(b, bl)| a >= b && a + l <= b + bl) {
                return Err(format!("{what} at {a:#x} lies outside every reservation"));
            }
        }
        // Live allocations lie inside their ranges; the statistics match them.
        let mut allocated = grow_allocated;
        let mut active = grow_active;
        for (&ptr, l) in &self.live.allocs {
            if !l.pooled {
                allocated += l.size;
                active += l.rounded;
            }
            let (id, off) = match l.backing {
                Backing::Range(id) => (id, 0),
                Backing::Sub { arena, offset } => (arena, offset),
            };
            let r = self.ranges.try_get(id).ok_or("live allocation without range")?;
            if r.va + off != ptr || off + l.rounded > r.pages * page || ptr % SUBPAGE_ALIGN != 0 {
                return Err(format!("live allocation {ptr:#x} does not fit its range"));
            }
        }
        if allocated != self.stats.allocated_bytes.current
            || active != self.stats.active_bytes.current
        {
            return Err("allocated or active byte statistics drifted".into());
        }
        if self.bytes(self.pool.held_pages()) != self.stats.reserved_bytes.current {
            return Err("reserved byte statistic drifted".into());
        }
        if self.bytes(self.window.mapped.pages()) != self.stats.window_bytes.current {
            return Err("window byte statistic drifted".into());
        }
        let handles: u64 = self.pool.iter().map(|(_, c)| c.mappings as u64).sum();
        if handles != self.stats.mapped_handles.current {
            return Err(format!(
                "{handles} chunk mappings, statistics say {}",
                self.stats.mapped_handles.current
            ));
        }
        let held = self.bytes(self.pool.held_pages());
        if held > self.lim.cap && self.notes.over_cap.map_or(true, |h| held > h) {
            return Err("more memory held than the cap allows".into());
        }
        Ok(())
    }
}
