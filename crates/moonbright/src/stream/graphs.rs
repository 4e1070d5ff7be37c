//! CUDA graphs in the front end: requests on a stream being captured into a graph, for a capture
//! begun into a graph pool (`begin_graph_capture`), requests a thread routes into a pool outside
//! captures (`begin_allocate_to_pool`), a pool's live set read and set back, and the handback of
//! a pool's memory once its last graph is released. The pools' bookkeeping is `core::graphs`;
//! this file makes its calls.
//!
//! During a capture no event may be recorded on the capturing stream (it would join the graph),
//! so nothing here records one then: a pool's blocks need none (they stay the pool's), and a free
//! of other memory on the capturing stream waits for the capture's end.

use super::Shared;
use crate::core::graphs::{HandBack, PoolFree, PoolId};
use crate::driver::{prelude::*, DevicePtr, StreamHandle};
use crate::error::{Error, Result};
use crate::sync::atomic::Ordering;

/// This thread's token for routes (`begin_allocate_to_pool`): a number no other live thread has.
fn thread_token() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TOKEN.with(|t| *t)
}

pub(super) use crate::core::streams::NO_STREAM;

impl Shared {
    /// Notes that the capture in progress on `stream` allocates into graph pool `pool`: until
    /// `end_graph_capture(stream)`, requests of that capture (on `stream`, or on streams it has
    /// forked) are served from the pool, and their memory stays the pool's.
    pub fn begin_graph_capture(&self, stream: StreamHandle, pool: PoolId) -> Result<()> {
        let Some(capture) = self.driver.capture_id(stream)? else {
            return Err(Error::GraphPool {
                reason: format!("stream {:#x} is not being captured into a graph", stream.0),
            });
        };
        self.with_graphs(|g| g.begin(capture, stream.0, pool))
            .map_err(|reason| Error::GraphPool { reason })
    }

    /// Ends the capture begun on `stream` (after the driver has ended it): what it freed is
    /// reusable by later captures into its pool, and the frees of other memory it deferred are
    /// done now.
    pub fn end_graph_capture(&self, stream: StreamHandle) -> Result<()> {
        let Some((_, deferred)) = self.with_graphs(|g| g.end(stream.0)) else {
            return Err(Error::GraphPool {
                reason: format!("no graph capture was begun on stream {:#x}", stream.0),
            });
        };
        let mut first = self.retry_stranded().err();
        for (ptr, s) in deferred {
            if let Err(e) = self.free_async_heap(ptr, StreamHandle(s)) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Notes that a graph of `pool` was replayed on `stream`: the pool's memory goes back to the
    /// heap only after the work queued there before its release.
    pub fn graph_replayed(&self, pool: PoolId, stream: StreamHandle) {
        self.with_graphs(|g| g.replayed(pool, stream.0));
    }

    /// One graph of `pool` is gone (PyTorch's `releasePool`). With the last, the pool's free
    /// blocks go back to the heap, ordered after every stream its graphs were replayed on.
    pub fn release_graph_pool(&self, pool: PoolId) -> Result<()> {
        let back =
            self.with_graphs(|g| g.release(pool)).map_err(|reason| Error::GraphPool { reason })?;
        let mut first = self.retry_stranded().err();
        if let Err(e) = self.hand_back(back) {
            first.get_or_insert(e);
        }
        first.map_or(Ok(()), Err)
    }

    /// Routes this thread's requests outside captures into graph pool `pool` (PyTorch's
    /// `beginAllocateCurrentThreadToPool`), until `end_allocate_to_pool`; one more user of the
    /// pool, released by `release_graph_pool` as a graph is.
    pub fn begin_allocate_to_pool(&self, pool: PoolId) -> Result<()> {
        self.with_graphs(|g| g.begin_route(thread_token(), pool))
            .map_err(|reason| Error::GraphPool { reason })
    }

    /// Ends this thread's route (PyTorch's `endAllocateToPool`): its pool.
    pub fn end_allocate_to_pool(&self) -> Result<PoolId> {
        self.with_graphs(|g| g.end_route(thread_token())).ok_or_else(|| Error::GraphPool {
            reason: "this thread does not allocate into a graph pool".into(),
        })
    }

    /// The pool this thread's requests are routed into, if any (one atomic load when no thread
    /// routes).
    pub(super) fn routed_pool(&self) -> Option<PoolId> {
        if !self.graphs_routing.load(Ordering::Acquire) {
            return None;
        }
        self.with_graphs(|g| g.route_of(thread_token()))
    }

    /// A routed request on `stream`: a free block of the pool (`GraphPools::reuse_routed`), or
    /// new memory that no stream's queued work uses, kept by the pool.
    pub(super) fn malloc_routed(&self, size: u64, stream: u64, pool: PoolId) -> Result<DevicePtr> {
        let page = self.driver.granularity() as u64;
        let reused = self.with_graphs(|g| {
            let reused = g.reuse_routed(thread_token(), stream, size, page);
            if let Some(ptr) = reused {
                self.heap().pool_reuse(ptr, size, stream);
            }
            reused
        });
        if let Some(ptr) = reused {
            return Ok(ptr);
        }
        let ptr = self.malloc_on(size, NO_STREAM)?;
        let usable = self.heap().usable_size(ptr).unwrap_or(size);
        self.with_graphs(|g| g.adopt(pool, ptr, usable));
        Ok(ptr)
    }

    /// The live blocks of `pool`, (pointer, usable bytes) in address order (PyTorch's
    /// checkpointed pool state, and what `checkPoolLiveAllocations` compares).
    pub fn graph_pool_live(&self, pool: PoolId) -> Vec<(u64, u64)> {
        self.with_graphs(|g| g.live_blocks(pool))
    }

    /// Makes `keep` the live set of `pool` (PyTorch's `setCheckpointPoolState`): blocks in it
    /// that the pool holds free count as allocated again, and live blocks not in it go back to
    /// the pool as freed on `stream`. Returns (revived, freed); refused with nothing changed
    /// while a capture into the pool is in progress, or for a pointer that is not the pool's.
    pub fn set_graph_pool_live(
        &self,
        pool: PoolId,
        keep: &[u64],
        stream: StreamHandle,
    ) -> Result<(Vec<u64>, Vec<u64>)> {
        self.with_graphs(|g| {
            let (revived, freed) = g.set_live(pool, keep, stream.0)?;
            // Under the pools' lock, as a free or a reuse counts its block.
            let mut heap = self.heap();
            for &p in &revived {
                heap.pool_revive(p, stream.0);
            }
            for &p in &freed {
                heap.pool_keep(p);
            }
            Ok((revived, freed))
        })
        .map_err(|reason| Error::GraphPool { reason })
    }

    /// Memory no stream's queued work may still use, kept by the caller for a graph.
    pub fn malloc_for_graph(&self, size: u64) -> Result<DevicePtr> {
        self.malloc_on(size, NO_STREAM)
    }

    /// Blocks and bytes graph pools hold free for their graphs.
    pub fn graph_pool_free(&self) -> (usize, u64) {
        self.with_graphs(|g| g.free_blocks())
    }

    /// Tries again the handbacks a capture held up.
    pub(super) fn retry_stranded(&self) -> Result<()> {
        let stranded = self.with_graphs(|g| g.take_stranded());
        self.hand_back(stranded)
    }

    /// A request on `stream`, which is being captured: served from the capture's pool if one
    /// was begun for it, else refused.
    pub(super) fn malloc_in_capture(&self, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        let capture = self.driver.capture_id(stream)?;
        let page = self.driver.granularity() as u64;
        let found = self.with_graphs(|g| {
            let capture = capture?;
            let pool = g.pool_of_capture(capture)?;
            let reused = g.reuse(pool, capture, stream.0, size, page);
            if let Some(ptr) = reused {
                self.heap().pool_reuse(ptr, size, stream.0);
            }
            Some((pool, reused))
        });
        match found {
            None => Err(Error::StreamCapture { stream: stream.0 }),
            Some((_, Some(ptr))) => Ok(ptr),
            Some((pool, None)) => {
                let ptr = self.malloc_on(size, NO_STREAM)?;
                let usable = self.heap().usable_size(ptr).unwrap_or(size);
                self.with_graphs(|g| g.adopt(pool, ptr, usable));
                Ok(ptr)
            }
        }
    }

    /// Whether a graph pool owns the block at `ptr`: freed, it is kept for the pool's next
    /// allocations (`Allocator::export` refuses it).
    pub(crate) fn graph_pool_owns(&self, ptr: DevicePtr) -> bool {
        self.graphs_active.load(Ordering::Acquire) && self.with_graphs(|g| g.owns(ptr))
    }

    /// A free of `ptr` on `stream` (`None`: a synchronous free) as the graph pools see it:
    /// `Some` outcome if they took it (a pool's block, or a free deferred to a capture's end),
    /// `None` for the heap to free it as usual.
    pub(super) fn free_for_graphs(
        &self,
        ptr: DevicePtr,
        stream: Option<StreamHandle>,
    ) -> Option<Result<()>> {
        if !self.graphs_active.load(Ordering::Acquire) {
            return None;
        }
        let (owned, capturing) = self.with_graphs(|g| (g.owns(ptr), g.capturing()));
        if !owned && !capturing {
            return None;
        }
        // Which capture the free is part of matters only while one is in progress.
        let capture = match stream.filter(|_| capturing).map(|s| self.driver.capture_id(s)) {
            Some(Err(e)) => return Some(Err(e.into())),
            Some(Ok(c)) => c,
            None => None,
        };
        let s = stream.map_or(0, |s| s.0);
        if !owned {
            // Only a live allocation's free is deferred; anything else gets the heap's answer.
            let live = capture.is_some() && self.heap().usable_size(ptr).is_some();
            let deferred =
                live && capture.is_some_and(|c| self.with_graphs(|g| g.defer_free(c, ptr, s)));
            return deferred.then_some(Ok(()));
        }
        let outcome = self.with_graphs(|g| {
            let outcome = g.free(ptr, s, capture);
            if matches!(outcome, PoolFree::Kept | PoolFree::HandBack { .. }) {
                // Under the pools' lock, so that no capture reuses the block before it is kept.
                self.heap().pool_keep(ptr);
            }
            outcome
        });
        match outcome {
            PoolFree::NotPooled => None,
            PoolFree::Kept => Some(Ok(())),
            PoolFree::DoubleFree => Some(Err(Error::DoubleFree { ptr })),
            PoolFree::HandBack { uses } => {
                Some(self.hand_back(vec![HandBack { ptr, stream: s, uses }]))
            }
        }
    }

    /// Frees released pools' blocks to the heap, each on its stream and joined with the streams
    /// the graphs were replayed on. One held up by a capture on one of them is kept for later.
    fn hand_back(&self, blocks: Vec<HandBack>) -> Result<()> {
        let mut first = None;
        for b in blocks {
            let mut heap = self.heap();
            for &u in &b.uses {
                // The block is live (a pool's), so only a growable could refuse, and none is.
                let _ = heap.record_use(b.ptr, u);
            }
            drop(heap);
            match self.free_async_heap(b.ptr, StreamHandle(b.stream)) {
                Ok(()) => {}
                Err(Error::StreamCapture { .. }) => self.with_graphs(|g| g.strand(b)),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Runs `f` on the graph pools under their lock, and keeps `graphs_active` and
    /// `graphs_routing` in step. `f` may
    /// take the heap's lock (to count a pool's block in or out); nothing takes the pools' lock
    /// while holding the heap's.
    fn with_graphs<T>(&self, f: impl FnOnce(&mut crate::core::graphs::GraphPools) -> T) -> T {
        let mut g = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut g);
        self.graphs_active.store(g.active(), Ordering::Release);
        self.graphs_routing.store(g.routing(), Ordering::Release);
        out
    }
}
