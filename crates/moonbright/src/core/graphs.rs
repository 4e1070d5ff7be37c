//! Graph pools: the memory CUDA graphs own. An allocation made while a stream is captured into a
//! graph has its address baked into the graph, and every replay uses it again, so it must stay
//! the graph's for as long as the graph exists: a free hands it back to its pool, never to the
//! heap. Allocations of later captures into the same pool reuse the pool's free blocks, as
//! PyTorch's graph-private pools do, and a block freed during a capture is reused within that
//! capture only on the stream that freed it (where the graph orders the reuse after the free).
//! When the last graph of a pool goes, its free blocks are handed back to the heap, joined with
//! every stream the graphs were replayed on, and its live blocks are handed back as they are
//! freed. Pure bookkeeping: the heap still counts every block as a live allocation, and
//! `stream::graphs` makes the calls.
//!
//! Two more uses serve PyTorch's CUDA-graph trees (`torch.compile(mode="reduce-overhead")`):
//! a *route* sends one thread's requests into a pool outside any capture (their warm-up runs,
//! PyTorch's `beginAllocateCurrentThreadToPool`), and a pool's live set can be read and set
//! back (`live_blocks`, `set_live`: PyTorch's checkpointed pool state), so that a new graph is
//! recorded beside the outputs of the graphs replayed before it.

use std::collections::{HashMap, HashSet};

/// A pool's identity: PyTorch's `MempoolId_t` (a pair), or any pair a C caller picks.
pub type PoolId = (u64, u64);

/// A free block of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FreeBlock {
    ptr: u64,
    /// Usable bytes.
    size: u64,
    /// The capture and stream it was freed in, while that capture lasts: only that capture's
    /// later allocations on that stream may reuse it. `None`: any later capture may.
    freed_in: Option<(u64, u64)>,
    /// The stream its last free was ordered on (its handback to the heap waits for it).
    stream: u64,
    /// When it was freed, in the pools' count of frees (a route reuses on other streams only
    /// blocks freed before it began).
    seq: u64,
}

#[derive(Debug, Default)]
struct Pool {
    /// Captures begun into the pool whose graphs have not been released.
    graphs: u32,
    /// Blocks handed out and not yet freed back.
    live: usize,
    free: Vec<FreeBlock>,
    /// Streams the pool's graphs were replayed on.
    replayed_on: Vec<u64>,
}

/// What a free of a pointer means to the pools.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PoolFree {
    /// Not a pool's block: the heap frees it.
    NotPooled,
    /// Kept by its pool for reuse.
    Kept,
    /// A block its pool holds free already: a double free, refused (nothing changes).
    DoubleFree,
    /// Its pool is released: hand it back to the heap, waiting for these streams too (where the
    /// graphs were replayed).
    HandBack { uses: Vec<u64> },
}

/// A block to hand back to the heap: freed on `stream`, used by `uses` too.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HandBack {
    pub ptr: u64,
    pub stream: u64,
    pub uses: Vec<u64>,
}

/// Every graph pool of one allocator.
#[derive(Debug, Default)]
pub(crate) struct GraphPools {
    pools: HashMap<PoolId, Pool>,
    /// Captures in progress: capture id -> (pool, capturing stream it was begun on).
    captures: HashMap<u64, (PoolId, u64)>,
    /// Every block of every pool, live or free: pointer -> (pool, usable bytes).
    owner: HashMap<u64, (PoolId, u64)>,
    /// Frees of other memory on a stream during a capture: (capture, pointer, stream). No event
    /// can be recorded on a capturing stream, so they are done when the capture ends.
    deferred: Vec<(u64, u64, u64)>,
    /// Blocks whose handback failed because a stream they wait for was being captured; tried
    /// again at the next capture end, release or `release_unused`.
    stranded: Vec<HandBack>,
    /// Routes: a thread's token -> the pool its requests go to outside any capture, and the
    /// count of frees when the route began.
    routes: HashMap<u64, (PoolId, u64)>,
    /// Frees into pools so far (`FreeBlock::seq`).
    frees: u64,
}

/// A free block serves a request of `size` if it is no more than twice as large (plus a page's
/// worth of slack for small requests), so a small request does not take a block a later large
/// one needs.
fn fits(block: u64, size: u64, page: u64) -> bool {
    block >= size && block <= 2 * size + page
}

impl GraphPools {
    /// Whether a free must check the pools: some pool holds a block, or a capture is begun
    /// (whose frees of other memory are deferred).
    pub fn active(&self) -> bool {
        !self.owner.is_empty() || !self.captures.is_empty()
    }

    /// Whether `ptr` is a block of a pool.
    pub fn owns(&self, ptr: u64) -> bool {
        self.owner.contains_key(&ptr)
    }

    /// Whether a capture begun into a pool is in progress.
    pub fn capturing(&self) -> bool {
        !self.captures.is_empty()
    }

    /// Whether some thread's requests are routed into a pool.
    pub fn routing(&self) -> bool {
        !self.routes.is_empty()
    }

    /// The pool thread `token`'s requests are routed into, if any.
    pub fn route_of(&self, token: u64) -> Option<PoolId> {
        self.routes.get(&token).map(|&(p, _)| p)
    }

    /// Routes thread `token`'s requests outside captures into `pool` (one more user of the pool,
    /// released with [`Self::release`] as a graph is), until [`Self::end_route`]. A thread
    /// routed already is refused.
    pub fn begin_route(&mut self, token: u64, pool: PoolId) -> Result<(), String> {
        if let Some((p, _)) = self.routes.get(&token) {
            return Err(format!("this thread already allocates into pool {p:?}"));
        }
        self.routes.insert(token, (pool, self.frees));
        self.pools.entry(pool).or_default().graphs += 1;
        Ok(())
    }

    /// Ends thread `token`'s route: its pool, or `None` if it had none.
    pub fn end_route(&mut self, token: u64) -> Option<PoolId> {
        self.routes.remove(&token).map(|(p, _)| p)
    }

    /// A free block of `pool` for a request of `size` bytes on `stream` from thread `token`'s
    /// route: the smallest that fits among those no capture in progress freed, and that were
    /// freed on `stream` or before the route began (the caller ordered its start after the work
    /// that used them, as PyTorch's trees do by synchronising).
    pub fn reuse_routed(&mut self, token: u64, stream: u64, size: u64, page: u64) -> Option<u64> {
        let &(pool, began) = self.routes.get(&token)?;
        let p = self.pools.get_mut(&pool)?;
        let usable = |b: &FreeBlock| {
            fits(b.size, size, page)
                && b.freed_in.is_none()
                && (b.stream == stream || b.seq <= began)
        };
        let (i, _) =
            p.free.iter().enumerate().filter(|(_, b)| usable(b)).min_by_key(|(_, b)| b.size)?;
        let b = p.free.swap_remove(i);
        p.live += 1;
        Some(b.ptr)
    }

    /// The live blocks of `pool` (handed out and not freed back), as (pointer, usable bytes),
    /// in address order.
    pub fn live_blocks(&self, pool: PoolId) -> Vec<(u64, u64)> {
        let Some(p) = self.pools.get(&pool) else { return Vec::new() };
        let free: HashSet<u64> = p.free.iter().map(|b| b.ptr).collect();
        let mut live: Vec<(u64, u64)> = self
            .owner
            .iter()
            .filter(|(ptr, (o, _))| *o == pool && !free.contains(*ptr))
            .map(|(&ptr, &(_, size))| (ptr, size))
            .collect();
        live.sort_unstable();
        live
    }

    /// Makes `keep` the live set of `pool` (PyTorch's `setCheckpointPoolState`): its free blocks
    /// in `keep` are live again, and its live blocks not in `keep` are freed back to it, as
    /// freed on `stream`. Returns (revived, freed). Refused, with nothing changed, while a
    /// capture into the pool is in progress, or if `keep` names a pointer that is no block of
    /// the pool.
    pub fn set_live(
        &mut self,
        pool: PoolId,
        keep: &[u64],
        stream: u64,
    ) -> Result<(Vec<u64>, Vec<u64>), String> {
        if self.captures.values().any(|&(p, _)| p == pool) {
            return Err(format!("a capture into pool {pool:?} is in progress"));
        }
        let Some(p) = self.pools.get_mut(&pool).filter(|p| p.graphs > 0) else {
            return Err(format!("pool {pool:?} has no graph"));
        };
        let outside = |ptr: &&u64| self.owner.get(ptr).map_or(true, |&(o, _)| o != pool);
        if let Some(bad) = keep.iter().find(outside) {
            return Err(format!("{bad:#x} is not a block of pool {pool:?}"));
        }
        let keep: HashSet<u64> = keep.iter().copied().collect();
        let (revive, stay): (Vec<FreeBlock>, Vec<FreeBlock>) =
            p.free.drain(..).partition(|b| keep.contains(&b.ptr));
        p.free = stay;
        let free_now: HashSet<u64> = p.free.iter().map(|b| b.ptr).collect();
        let mut freed: Vec<(u64, u64)> = self
            .owner
            .iter()
            .filter(|(ptr, (o, _))| *o == pool && !keep.contains(ptr) && !free_now.contains(ptr))
            .map(|(&ptr, &(_, size))| (ptr, size))
            .collect();
        freed.sort_unstable();
        p.live = p.live + revive.len() - freed.len(); // `freed` were live
        for &(ptr, size) in &freed {
            self.frees += 1;
            p.free.push(FreeBlock { ptr, size, freed_in: None, stream, seq: self.frees });
        }
        let mut revived: Vec<u64> = revive.iter().map(|b| b.ptr).collect();
        revived.sort_unstable();
        Ok((revived, freed.into_iter().map(|(ptr, _)| ptr).collect()))
    }

    /// The pool that capture `capture` allocates into, if one was begun for it.
    pub fn pool_of_capture(&self, capture: u64) -> Option<PoolId> {
        self.captures.get(&capture).map(|&(p, _)| p)
    }

    /// Notes that capture `capture`, begun on `stream`, allocates into `pool` (one more graph
    /// of that pool). A capture begun twice is refused.
    pub fn begin(&mut self, capture: u64, stream: u64, pool: PoolId) -> Result<(), String> {
        if let Some(&(p, _)) = self.captures.get(&capture) {
            return Err(format!("capture {capture} already allocates into pool {p:?}"));
        }
        self.captures.insert(capture, (pool, stream));
        self.pools.entry(pool).or_default().graphs += 1;
        Ok(())
    }

    /// Ends the capture begun on `stream`: blocks freed during it become reusable by any later
    /// capture into its pool. Returns its pool and the frees deferred during it, (pointer,
    /// stream) each, to do now; or `None` if no capture was begun on `stream`.
    pub fn end(&mut self, stream: u64) -> Option<(PoolId, Vec<(u64, u64)>)> {
        let capture = self.captures.iter().find(|(_, &(_, s))| s == stream).map(|(&c, _)| c)?;
        let (pool, _) = self.captures.remove(&capture)?;
        if let Some(p) = self.pools.get_mut(&pool) {
            for b in p.free.iter_mut().filter(|b| b.freed_in.is_some_and(|(c, _)| c == capture)) {
                b.freed_in = None;
            }
        }
        let (now, later) = self.deferred.drain(..).partition(|&(c, _, _)| c == capture);
        self.deferred = later;
        Some((pool, now.into_iter().map(|(_, p, s)| (p, s)).collect()))
    }

    /// Defers a free of `ptr` (not a pool's block) on `stream`, which capture `capture`
    /// captures, to the capture's end. `false` if no capture was begun for `capture` (the free
    /// is refused then, as on any capturing stream).
    pub fn defer_free(&mut self, capture: u64, ptr: u64, stream: u64) -> bool {
        if !self.captures.contains_key(&capture) {
            return false;
        }
        self.deferred.push((capture, ptr, stream));
        true
    }

    /// Keeps handbacks that could not be done now, for [`Self::take_stranded`].
    pub fn strand(&mut self, back: HandBack) {
        self.stranded.push(back);
    }

    /// Handbacks to try again.
    pub fn take_stranded(&mut self) -> Vec<HandBack> {
        std::mem::take(&mut self.stranded)
    }

    /// A free block of `pool` for a request of `size` bytes in capture `capture` on `stream`:
    /// the smallest that fits and that this capture may reuse. The block is live again.
    pub fn reuse(
        &mut self,
        pool: PoolId,
        capture: u64,
        stream: u64,
        size: u64,
        page: u64,
    ) -> Option<u64> {
        let p = self.pools.get_mut(&pool)?;
        let usable = |b: &FreeBlock| {
            fits(b.size, size, page) && b.freed_in.map_or(true, |f| f == (capture, stream))
        };
        let (i, _) =
            p.free.iter().enumerate().filter(|(_, b)| usable(b)).min_by_key(|(_, b)| b.size)?;
        let b = p.free.swap_remove(i);
        p.live += 1;
        Some(b.ptr)
    }

    /// Makes a new allocation of `size` usable bytes at `ptr` a live block of `pool`.
    pub fn adopt(&mut self, pool: PoolId, ptr: u64, size: u64) {
        self.owner.insert(ptr, (pool, size));
        self.pools.entry(pool).or_default().live += 1;
    }

    /// A free of `ptr` on `stream`, which is in capture `capture` if any.
    pub fn free(&mut self, ptr: u64, stream: u64, capture: Option<u64>) -> PoolFree {
        let Some(&(pool, size)) = self.owner.get(&ptr) else { return PoolFree::NotPooled };
        let p = self.pools.get_mut(&pool).expect("an owned block's pool exists");
        if p.free.iter().any(|b| b.ptr == ptr) {
            return PoolFree::DoubleFree;
        }
        p.live -= 1;
        if p.graphs == 0 {
            let uses = p.replayed_on.clone();
            self.owner.remove(&ptr);
            self.forget_if_empty(pool);
            return PoolFree::HandBack { uses };
        }
        let freed_in = capture.map(|c| (c, stream));
        self.frees += 1;
        p.free.push(FreeBlock { ptr, size, freed_in, stream, seq: self.frees });
        PoolFree::Kept
    }

    /// Notes that a graph of `pool` was replayed on `stream`.
    pub fn replayed(&mut self, pool: PoolId, stream: u64) {
        if let Some(p) = self.pools.get_mut(&pool) {
            if !p.replayed_on.contains(&stream) {
                p.replayed_on.push(stream);
            }
        }
    }

    /// One graph of `pool` is gone. When it was the last, returns the pool's free blocks to hand
    /// back to the heap (its live ones follow as they are freed). Unknown pools are refused.
    pub fn release(&mut self, pool: PoolId) -> Result<Vec<HandBack>, String> {
        let p = match self.pools.get_mut(&pool) {
            Some(p) if p.graphs > 0 => p,
            _ => return Err(format!("pool {pool:?} has no graph to release")),
        };
        p.graphs -= 1;
        if p.graphs > 0 {
            return Ok(Vec::new());
        }
        let uses = p.replayed_on.clone();
        let back: Vec<HandBack> = p
            .free
            .drain(..)
            .map(|b| HandBack { ptr: b.ptr, stream: b.stream, uses: uses.clone() })
            .collect();
        for b in &back {
            self.owner.remove(&b.ptr);
        }
        self.forget_if_empty(pool);
        Ok(back)
    }

    /// Drops a released pool with no block left.
    fn forget_if_empty(&mut self, pool: PoolId) {
        if self.pools.get(&pool).is_some_and(|p| p.graphs == 0 && p.live == 0 && p.free.is_empty())
        {
            self.pools.remove(&pool);
        }
    }

    /// Blocks and bytes the pools hold free (kept for their graphs, in no tensor).
    pub fn free_blocks(&self) -> (usize, u64) {
        let blocks = self.pools.values().flat_map(|p| &p.free);
        blocks.fold((0, 0), |(n, b), f| (n + 1, b + f.size))
    }

    /// Pools that still exist (with a graph, or blocks to hand back).
    #[cfg(test)]
    pub fn pools(&self) -> usize {
        self.pools.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 1 << 21;
    const P: PoolId = (0, 1);

    #[test]
    fn a_block_freed_in_a_capture_is_reused_there_only_on_its_stream() {
        let mut g = GraphPools::default();
        g.begin(7, 100, P).unwrap();
        g.adopt(P, 0x1000, 4096);
        assert_eq!(g.free(0x1000, 100, Some(7)), PoolFree::Kept);
        assert_eq!(g.reuse(P, 7, 200, 4096, PAGE), None, "another stream of the capture");
        assert_eq!(g.free(0x1000, 100, Some(7)), PoolFree::DoubleFree);
        assert_eq!(g.reuse(P, 7, 100, 4096, PAGE), Some(0x1000));
        assert_eq!(g.reuse(P, 7, 100, 4096, PAGE), None, "handed out once");
        assert_eq!(g.free(0x1000, 100, Some(7)), PoolFree::Kept);
        assert_eq!(g.end(100), Some((P, vec![])));
        g.begin(8, 200, P).unwrap();
        assert_eq!(g.reuse(P, 8, 200, 4096, PAGE), Some(0x1000), "a later capture, any stream");
    }

    #[test]
    fn reuse_takes_the_smallest_block_that_fits_and_no_block_far_too_large() {
        let mut g = GraphPools::default();
        g.begin(1, 5, P).unwrap();
        for (ptr, size) in [(0xa, 64 * PAGE), (0xb, 8 * PAGE), (0xc, 3 * PAGE)] {
            g.adopt(P, ptr, size);
            g.free(ptr, 5, None);
        }
        assert_eq!(g.reuse(P, 1, 5, 100, PAGE), None, "100 bytes would take a 3-page block");
        assert_eq!(g.reuse(P, 1, 5, 2 * PAGE, PAGE), Some(0xc));
        assert_eq!(g.reuse(P, 1, 5, 20 * PAGE, PAGE), None, "64 pages is over twice 20");
        assert_eq!(g.reuse(P, 1, 5, 40 * PAGE, PAGE), Some(0xa));
        assert_eq!(g.reuse((0, 2), 1, 5, 8 * PAGE, PAGE), None, "another pool's block");
    }

    #[test]
    fn releasing_the_last_graph_hands_back_free_blocks_then_live_ones_as_they_are_freed() {
        let mut g = GraphPools::default();
        g.begin(1, 5, P).unwrap();
        g.begin(2, 6, P).unwrap();
        g.adopt(P, 0xa, 4096);
        g.adopt(P, 0xb, 4096);
        g.end(5);
        g.end(6);
        g.free(0xa, 9, None);
        g.replayed(P, 11);
        g.replayed(P, 11);
        g.replayed(P, 12);
        assert_eq!(g.release(P).unwrap(), vec![], "one graph of the pool is left");
        let back = g.release(P).unwrap();
        assert_eq!(back, vec![HandBack { ptr: 0xa, stream: 9, uses: vec![11, 12] }]);
        assert!(g.owns(0xb) && g.active(), "0xb is still live");
        assert_eq!(g.free(0xb, 5, None), PoolFree::HandBack { uses: vec![11, 12] });
        assert!(!g.owns(0xb) && !g.active());
        assert_eq!(g.pools(), 0);
        assert!(g.release(P).is_err(), "no graph left to release");
        assert_eq!(g.free(0xb, 5, None), PoolFree::NotPooled);
    }

    #[test]
    fn a_route_reuses_on_other_streams_only_what_was_freed_before_it_began() {
        let mut g = GraphPools::default();
        g.adopt(P, 0xa, 4096);
        g.adopt(P, 0xb, 4096);
        g.begin_route(1, P).unwrap();
        assert!(g.routing() && g.route_of(1) == Some(P) && g.route_of(2).is_none());
        assert!(g.begin_route(1, P).is_err(), "routed already");
        g.free(0xa, 5, None);
        assert_eq!(g.end_route(1), Some(P));
        g.begin_route(1, P).unwrap();
        g.free(0xb, 5, None);
        assert_eq!(g.reuse_routed(1, 6, 4096, PAGE), Some(0xa), "freed before the route");
        assert_eq!(g.reuse_routed(1, 6, 4096, PAGE), None, "0xb: freed since, on stream 5");
        assert_eq!(g.reuse_routed(1, 5, 4096, PAGE), Some(0xb));
        assert_eq!(g.reuse_routed(2, 5, 4096, PAGE), None, "thread 2 has no route");
        assert_eq!(g.end_route(1), Some(P));
        assert!(!g.routing() && g.end_route(1).is_none());
    }

    #[test]
    fn setting_a_live_set_revives_and_frees_and_refuses_what_is_not_the_pools() {
        let mut g = GraphPools::default();
        g.begin(1, 5, P).unwrap();
        for ptr in [0xa, 0xb, 0xc] {
            g.adopt(P, ptr, 4096);
        }
        g.adopt((0, 2), 0xd, 4096);
        assert!(g.set_live(P, &[0xa], 5).is_err(), "a capture into the pool is in progress");
        g.end(5);
        g.free(0xb, 5, None);
        assert_eq!(g.live_blocks(P), vec![(0xa, 4096), (0xc, 4096)]);
        assert!(g.set_live(P, &[0xa, 0xd], 5).is_err(), "0xd is another pool's");
        assert!(g.set_live((0, 9), &[], 5).is_err(), "no such pool");
        assert_eq!(g.live_blocks(P), vec![(0xa, 4096), (0xc, 4096)], "refusals change nothing");
        assert_eq!(g.set_live(P, &[0xa, 0xb], 7), Ok((vec![0xb], vec![0xc])));
        assert_eq!(g.live_blocks(P), vec![(0xa, 4096), (0xb, 4096)]);
        assert_eq!(g.free_blocks(), (1, 4096));
        assert_eq!(g.free(0xc, 7, None), PoolFree::DoubleFree, "0xc is free now");
        // Released: the free block goes back, the live ones as they are freed.
        assert_eq!(g.release(P).unwrap().len(), 1);
        assert!(matches!(g.free(0xa, 7, None), PoolFree::HandBack { .. }));
        assert!(matches!(g.free(0xb, 7, None), PoolFree::HandBack { .. }));
        assert!(g.live_blocks(P).is_empty());
    }

    #[test]
    fn a_capture_is_begun_once_and_ended_by_its_stream() {
        let mut g = GraphPools::default();
        g.begin(1, 5, P).unwrap();
        assert!(g.begin(1, 5, (0, 2)).is_err());
        assert_eq!(g.pool_of_capture(1), Some(P));
        assert!(g.defer_free(1, 0x77, 5));
        assert!(!g.defer_free(2, 0x78, 5), "capture 2 was not begun into a pool");
        assert_eq!(g.end(6), None);
        assert_eq!(g.end(5), Some((P, vec![(0x77, 5)])));
        assert_eq!(g.pool_of_capture(1), None);
        assert_eq!(g.free_blocks(), (0, 0));
    }
}
