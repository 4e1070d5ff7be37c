//! CUDA graph pools on the host backend, whose streams can be put into capture: requests of a
//! capture begun into a pool are served from it with no event recorded on the capturing stream;
//! the pool's blocks never reach other allocations while a graph of the pool exists; blocks freed
//! in a capture are reused there only on the freeing stream, and by later captures into the pool;
//! frees of other memory wait for the capture's end; releasing the last graph hands the pool's
//! memory back ordered after the streams its graphs were replayed on; mismatched calls and driver
//! failures are refused and change nothing. The GPU runs the same through PyTorch's
//! `torch.cuda.graph` (python/tests/gpu/test_graphs.py).

use moonbright::driver::host::HostDriver;
use moonbright::driver::prelude::*;
use moonbright::{Allocator, CallKind, Error, Options, StreamHandle};
use moonbright_testkit::scenario::{stamp, verify};

const PAGE: usize = 64 << 10;
const POOL: (u64, u64) = (0, 1);

fn opts() -> Options {
    Options {
        cap_fraction: 1.0,
        background: false,
        max_chunk_bytes: 4 * PAGE as u64,
        ..Options::host(256 * PAGE as u64, PAGE)
    }
}

fn host(a: &Allocator) -> &HostDriver {
    a.driver().inner().as_host().unwrap()
}

fn streams(a: &Allocator, n: usize) -> Vec<StreamHandle> {
    (0..n).map(|_| a.driver().create_stream().unwrap()).collect()
}

fn records(a: &Allocator) -> u64 {
    a.stats().driver_calls.get(CallKind::EventRecord)
}

/// A capture begun on `s` into `pool`; returns its id.
fn capture(a: &Allocator, s: StreamHandle, pool: (u64, u64)) -> u64 {
    let id = host(a).begin_capture(s);
    a.begin_graph_capture(s, pool).unwrap();
    id
}

fn end(a: &Allocator, s: StreamHandle) {
    host(a).end_capture(s);
    a.end_graph_capture(s).unwrap();
}

#[test]
fn a_capture_allocates_from_its_pool_and_reuses_on_the_freeing_stream_only() {
    let a = Allocator::new(opts()).unwrap();
    let s = streams(&a, 2);
    let before = a.malloc_async(3 * PAGE, s[0]).unwrap();
    let id = capture(&a, s[0], POOL);
    host(&a).join_capture(s[1], id);
    let recorded = records(&a);

    let sizes = [100, 5000, PAGE, 3 * PAGE, 9 * PAGE];
    let ptrs: Vec<u64> = sizes.iter().map(|&n| a.malloc_async(n, s[0]).unwrap()).collect();
    for (&p, &n) in ptrs.iter().zip(&sizes) {
        stamp(&a, p, n, p).unwrap();
    }
    assert!(verify(&a, before, 3 * PAGE, 0).is_ok());
    a.free_async(ptrs[3], s[0]).unwrap();
    assert_eq!(a.malloc_async(3 * PAGE, s[1]).map(|p| p == ptrs[3]), Ok(false), "another stream");
    assert_eq!(a.malloc_async(3 * PAGE, s[0]), Ok(ptrs[3]), "the freeing stream reuses it");
    assert_eq!(records(&a), recorded, "no event recorded during the capture");
    end(&a, s[0]);
    host(&a).end_capture(s[1]);
    a.check_invariants().unwrap();

    // The pool keeps what its graph uses: frees after the capture keep the memory from others.
    for &p in &ptrs {
        a.free_async(p, s[0]).unwrap();
    }
    assert_eq!(a.graph_pool_free().0, ptrs.len());
    assert_eq!(a.free_async(ptrs[0], s[0]), Err(Error::DoubleFree { ptr: ptrs[0] }));
    assert_eq!(a.graph_pool_free().0, ptrs.len(), "a double free changes nothing");
    let others: Vec<u64> = (0..40).map(|_| a.malloc_async(3 * PAGE, s[1]).unwrap()).collect();
    assert!(others.iter().all(|p| !ptrs.contains(p)), "a pool's block went to another allocation");
    for (&p, &n) in ptrs.iter().zip(&sizes) {
        assert!(verify(&a, p, n, p).unwrap(), "a pool's block was overwritten");
    }

    // A later capture into the pool reuses them, on any stream.
    capture(&a, s[1], POOL);
    assert_eq!(a.malloc_async(9 * PAGE, s[1]), Ok(ptrs[4]));
    end(&a, s[1]);
    a.check_invariants().unwrap();
}

#[test]
fn releasing_the_last_graph_hands_the_memory_back_after_its_replays() {
    let a = Allocator::new(opts()).unwrap();
    let s = streams(&a, 3);
    capture(&a, s[0], POOL);
    capture(&a, s[2], POOL);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    let live = a.malloc_async(2 * PAGE, s[0]).unwrap();
    end(&a, s[0]);
    end(&a, s[2]);
    a.free_async(p, s[0]).unwrap();
    a.graph_replayed(POOL, s[1]);
    host(&a).hold_stream(s[1]);

    a.release_graph_pool(POOL).unwrap();
    assert_eq!(a.graph_pool_free().0, 1, "one graph of the pool is left");
    a.release_graph_pool(POOL).unwrap();
    assert_eq!(a.graph_pool_free().0, 0);
    assert_eq!(
        a.release_graph_pool(POOL).map_err(|e| matches!(e, Error::GraphPool { .. })),
        Err(true)
    );
    // The replay stream's work may still use it: no other stream gets it yet.
    a.poll();
    let q = a.malloc_async(3 * PAGE, s[2]).unwrap();
    assert_ne!(q, p, "handed to another stream while the replay stream still ran");
    host(&a).release_stream(s[1]);
    a.poll();
    a.free_async(q, s[2]).unwrap();
    let again = a.malloc_async(3 * PAGE, s[1]).unwrap();
    assert!(again == p || again == q, "the handed-back block is ordinary memory again");

    // A live block of a released pool goes back when freed.
    let before = a.stats().allocations.current;
    a.free_async(live, s[0]).unwrap();
    assert_eq!(a.stats().allocations.current, before - 1);
    assert_eq!(a.free_async(live, s[0]), Err(Error::DoubleFree { ptr: live }));
    a.check_invariants().unwrap();
}

#[test]
fn other_frees_on_the_capturing_stream_wait_for_the_capture_end() {
    let a = Allocator::new(opts()).unwrap();
    let s = streams(&a, 1)[0];
    let p = a.malloc_async(3 * PAGE, s).unwrap();
    let allocations = a.stats().allocations.current;
    capture(&a, s, POOL);
    a.free_async(p, s).unwrap();
    assert_eq!(a.stats().allocations.current, allocations, "freed before the capture ended");
    end(&a, s);
    assert_eq!(a.stats().allocations.current, allocations - 1);
    assert_eq!(a.free_async(p, s), Err(Error::DoubleFree { ptr: p }));
    a.check_invariants().unwrap();
}

#[test]
fn a_handback_held_up_by_a_capture_is_done_later() {
    let a = Allocator::new(opts()).unwrap();
    let s = streams(&a, 2);
    capture(&a, s[0], POOL);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    end(&a, s[0]);
    a.free_async(p, s[0]).unwrap();
    a.graph_replayed(POOL, s[1]);
    let reserved = a.stats().reserved_bytes.current;
    // Another capture on the replay stream, not into a pool: no event can be recorded there.
    host(&a).begin_capture(s[1]);
    a.release_graph_pool(POOL).unwrap();
    a.release_unused().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, reserved, "handed back during the capture");
    host(&a).end_capture(s[1]);
    a.release_unused().unwrap();
    assert!(a.stats().reserved_bytes.current < reserved, "not handed back after the capture");
    a.check_invariants().unwrap();
}

#[test]
fn a_pools_free_blocks_count_as_reserved_not_allocated() {
    // As PyTorch counts a graph-private pool's free blocks, and shows them in its snapshots.
    let a = Allocator::new(Options { validate: true, ..opts() }).unwrap();
    let s = streams(&a, 1)[0];
    let allocated = |a: &Allocator| a.stats().allocated_bytes.current;
    let active = |a: &Allocator| a.stats().active_bytes.current;
    let in_use = |a: &Allocator, p: u64| {
        a.segments().iter().flat_map(|g| &g.blocks).any(|b| {
            b.addr == p && b.state == moonbright::core::history::BlockState::ActiveAllocated
        })
    };
    let base = (allocated(&a), active(&a));
    capture(&a, s, POOL);
    let p = a.malloc_async(3 * PAGE - 100, s).unwrap();
    let q = a.malloc_async(1000, s).unwrap();
    let (reserved, allocations) = (a.stats().reserved_bytes.current, a.stats().allocations.current);
    assert_eq!(allocated(&a), base.0 + 3 * PAGE as u64 - 100 + 1000);
    a.free_async(p, s).unwrap();
    assert_eq!(allocated(&a), base.0 + 1000, "a pool's free block still counts as allocated");
    assert_eq!(active(&a), base.1 + 256 * 4, "or as active");
    assert_eq!(a.stats().allocations.current, allocations - 1);
    assert_eq!(a.stats().reserved_bytes.current, reserved, "it stays reserved");
    assert!(!in_use(&a, p) && in_use(&a, q), "the snapshot shows it in use");
    // Reused by a smaller request: counted again, at the new size, whole pages active.
    assert_eq!(a.malloc_async(2 * PAGE + 5, s), Ok(p));
    assert_eq!(allocated(&a), base.0 + 2 * PAGE as u64 + 5 + 1000);
    assert_eq!(active(&a), base.1 + 3 * PAGE as u64 + 256 * 4);
    assert!(in_use(&a, p));
    end(&a, s);
    a.free_async(p, s).unwrap();
    a.free_async(q, s).unwrap();
    assert_eq!((allocated(&a), active(&a)), base);
    a.release_graph_pool(POOL).unwrap();
    assert_eq!((allocated(&a), active(&a)), base, "handed back without counting it twice");
    assert_eq!(a.graph_pool_free(), (0, 0));
    a.release_unused().unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn with_captures_announced_streams_are_checked_only_while_one_is() {
    let a = Allocator::new(Options { captures_announced: true, ..opts() }).unwrap();
    let s = streams(&a, 1)[0];
    let checks = || a.stats().driver_calls.get(CallKind::StreamIsCapturing);
    let p = a.malloc_async(PAGE, s).unwrap();
    a.free_async(p, s).unwrap();
    assert_eq!(checks(), 0, "no capture announced, yet the stream was checked");

    a.capture_starting();
    host(&a).begin_capture(s);
    assert_eq!(a.malloc_async(100, s), Err(Error::StreamCapture { stream: s.0 }));
    a.begin_graph_capture(s, POOL).unwrap();
    let q = a.malloc_async(100, s).unwrap();
    end(&a, s);
    a.capture_finished();
    assert!(checks() > 0);
    let before = checks();
    a.free_async(q, s).unwrap();
    let r = a.malloc_async(PAGE, s).unwrap();
    assert_eq!(checks(), before, "checked after the capture finished");

    // The contract: a capture not announced is not seen (PyTorch's allocator's, too).
    host(&a).begin_capture(s);
    let unseen = a.malloc_async(PAGE, s);
    host(&a).end_capture(s);
    assert!(unseen.is_ok(), "an unannounced capture was seen: {unseen:?}");
    a.free_async(unseen.unwrap(), s).unwrap();

    // Extra finishes are ignored: the next announcement still counts.
    a.capture_finished();
    a.capture_starting();
    host(&a).begin_capture(s);
    assert_eq!(a.free_async(r, s), Err(Error::StreamCapture { stream: s.0 }));
    host(&a).end_capture(s);
    a.capture_finished();
    a.free_async(r, s).unwrap();
    a.release_graph_pool(POOL).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn events_left_to_later_never_land_in_a_capture() {
    // With deferred_free_events a free's event is recorded later, by another thread or call
    // than the free: never on a stream being captured (it would join the graph).
    for announced in [false, true] {
        let o = Options { deferred_free_events: true, captures_announced: announced, ..opts() };
        let a = Allocator::new(o).unwrap();
        let s = streams(&a, 1)[0];
        let p = a.malloc_async(3 * PAGE, s).unwrap();
        a.free_async(p, s).unwrap();
        a.capture_starting();
        host(&a).begin_capture(s);
        a.poll();
        a.release_unused().unwrap();
        assert_eq!(records(&a), 0, "recorded on a capturing stream (announced: {announced})");
        host(&a).end_capture(s);
        a.capture_finished();
        assert_eq!(a.take_deferred_error(), None);
        a.poll();
        assert_eq!(records(&a), 1, "not recorded after the capture (announced: {announced})");
        a.release_unused().unwrap();
        assert_eq!(a.stats().reserved_bytes.current, 0);
    }
}

#[test]
fn a_failed_capture_query_before_a_later_record_is_reported_and_retried() {
    let o = Options { deferred_free_events: true, ..opts() };
    let a = Allocator::new(o).unwrap();
    let s = streams(&a, 1)[0];
    let p = a.malloc_async(3 * PAGE, s).unwrap();
    a.free_async(p, s).unwrap();
    a.driver().fail_nth(CallKind::StreamIsCapturing, 1, None);
    a.poll();
    assert_eq!(records(&a), 0, "recorded on a stream it could not ask about");
    assert!(a.take_deferred_error().is_some(), "the failed query was not reported");
    a.poll();
    assert_eq!(records(&a), 1, "the free's event was not recorded at the next poll");
    a.release_unused().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
    a.check_invariants().unwrap();
}

#[test]
fn mismatched_calls_are_refused_and_change_nothing() {
    let a = Allocator::new(opts()).unwrap();
    let s = streams(&a, 2);
    let is_pool_error = |r: moonbright::Result<()>| matches!(r, Err(Error::GraphPool { .. }));
    assert!(is_pool_error(a.begin_graph_capture(s[0], POOL)), "not capturing");
    assert!(is_pool_error(a.end_graph_capture(s[0])), "nothing begun");
    assert!(is_pool_error(a.release_graph_pool(POOL)), "no graph");
    capture(&a, s[0], POOL);
    assert!(is_pool_error(a.begin_graph_capture(s[0], (0, 2))), "begun already");
    // A failed capture query at the begin is the driver's error, and begins nothing.
    host(&a).begin_capture(s[1]);
    a.driver().fail_nth(CallKind::StreamIsCapturing, 1, None);
    assert!(matches!(a.begin_graph_capture(s[1], (0, 3)), Err(Error::Driver(_))));
    assert_eq!(a.malloc_async(100, s[1]), Err(Error::StreamCapture { stream: s[1].0 }));
    host(&a).end_capture(s[1]);
    assert!(is_pool_error(a.end_graph_capture(s[1])), "no capture was begun on s[1]");
    // A capture not begun into a pool is refused as before.
    host(&a).begin_capture(s[1]);
    assert_eq!(a.malloc_async(100, s[1]), Err(Error::StreamCapture { stream: s[1].0 }));
    host(&a).end_capture(s[1]);
    // A failed capture query refuses the request and allocates nothing.
    let allocations = a.stats().allocations.current;
    a.driver().fail_nth(CallKind::StreamIsCapturing, 2, None);
    assert!(matches!(a.malloc_async(100, s[0]), Err(Error::Driver(_))));
    assert_eq!(a.stats().allocations.current, allocations);
    let p = a.malloc_async(100, s[0]).unwrap();
    end(&a, s[0]);
    a.free_async(p, s[0]).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn other_threads_never_get_a_pools_memory() {
    let a = Allocator::new(Options { validate: true, ..opts() }).unwrap();
    let s = streams(&a, 3);
    let pooled: Vec<u64> = {
        capture(&a, s[0], POOL);
        let v = (0..12).map(|i| a.malloc_async((i % 4 + 1) * PAGE, s[0]).unwrap()).collect();
        end(&a, s[0]);
        v
    };
    for &p in &pooled {
        a.free_async(p, s[0]).unwrap();
    }
    std::thread::scope(|t| {
        for k in 1..3 {
            let (a, s, pooled) = (&a, s[k], &pooled);
            t.spawn(move || {
                for i in 0..300 {
                    let p = a.malloc_async((i % 5 + 1) * PAGE, s).unwrap();
                    assert!(!pooled.contains(&p), "thread {k} got a pool's block");
                    a.free_async(p, s).unwrap();
                }
            });
        }
        let (a, pooled) = (&a, &pooled);
        t.spawn(move || {
            for _ in 0..50 {
                capture(a, s[0], POOL);
                let p = a.malloc_async(2 * PAGE, s[0]).unwrap();
                assert!(pooled.contains(&p), "a later capture reuses the pool");
                a.free_async(p, s[0]).unwrap();
                end(a, s[0]);
            }
        });
    });
    a.check_invariants().unwrap();
}

#[test]
fn a_pool_takes_no_memory_a_stream_may_still_use() {
    let a = Allocator::new(opts()).unwrap();
    let s = streams(&a, 1)[0];
    let null = StreamHandle::DEFAULT;
    host(&a).hold_stream(null);
    let pending = a.malloc_async(3 * PAGE, null).unwrap();
    a.free_async(pending, null).unwrap();
    capture(&a, s, POOL);
    let p = a.malloc_async(3 * PAGE, s).unwrap();
    assert_ne!(p, pending, "the pool took memory the null stream's work may still use");
    let q = a.malloc_for_graph(3 * PAGE).unwrap();
    assert_ne!(q, pending, "malloc_for_graph took memory the null stream's work may still use");
    a.free_async(q, s).unwrap();
    end(&a, s);
    host(&a).release_stream(null);
    a.check_invariants().unwrap();
}

#[test]
fn out_of_memory_inside_a_capture_changes_nothing() {
    let a = Allocator::new(Options { cap_bytes: Some(8 * PAGE as u64), ..opts() }).unwrap();
    let s = streams(&a, 1)[0];
    capture(&a, s, POOL);
    let p = a.malloc_async(3 * PAGE, s).unwrap();
    a.free_async(p, s).unwrap();
    let (allocations, free) = (a.stats().allocations.current, a.graph_pool_free());
    assert!(matches!(a.malloc_async(6 * PAGE, s), Err(Error::OutOfMemory { .. })));
    assert_eq!((a.stats().allocations.current, a.graph_pool_free()), (allocations, free));
    a.driver().fail_nth(CallKind::Create, 1, None);
    assert!(matches!(a.malloc_async(5 * PAGE, s), Err(Error::Driver(_))));
    assert_eq!((a.stats().allocations.current, a.graph_pool_free()), (allocations, free));
    assert_eq!(a.malloc_async(3 * PAGE, s), Ok(p), "the pool still serves its block");
    end(&a, s);
    a.check_invariants().unwrap();
}

// ---- CUDA-graph trees: routes and a pool's live set ----------------------------------------------

/// A pool kept alive by one empty graph, as PyTorch's trees keep theirs.
fn pool_with_a_graph(a: &Allocator, s: StreamHandle) {
    capture(a, s, POOL);
    end(a, s);
}

#[test]
fn a_routed_thread_allocates_into_the_pool_and_no_other_does() {
    let a = Allocator::new(Options { validate: true, ..opts() }).unwrap();
    let s = streams(&a, 2);
    pool_with_a_graph(&a, s[0]);
    let is_pool_error = |r: moonbright::Result<()>| matches!(r, Err(Error::GraphPool { .. }));
    assert!(matches!(a.end_allocate_to_pool(), Err(Error::GraphPool { .. })), "no route");

    a.begin_allocate_to_pool(POOL).unwrap();
    assert!(is_pool_error(a.begin_allocate_to_pool((0, 9))), "routed already");
    let x = a.malloc_async(3 * PAGE, s[0]).unwrap();
    let y = a.malloc(5000).unwrap();
    let elsewhere =
        std::thread::scope(|t| t.spawn(|| a.malloc_async(3 * PAGE, s[1])).join()).unwrap().unwrap();
    let usable = |p: u64| a.graph_pool_live(POOL).into_iter().find(|&(q, _)| q == p);
    assert!(usable(x).is_some() && usable(y).is_some(), "{:?}", a.graph_pool_live(POOL));
    assert_eq!(usable(elsewhere), None, "another thread's request is not routed");
    assert_eq!(a.graph_pool_live(POOL).len(), 2);

    // A routed free keeps the block in the pool; the route reuses it on the freeing stream only.
    a.free_async(x, s[0]).unwrap();
    assert_eq!(a.graph_pool_free().0, 1);
    let w = a.malloc_async(3 * PAGE, s[1]).unwrap();
    assert!(w != x && usable(w).is_some(), "another stream gets new memory of the pool");
    assert_eq!(a.malloc_async(3 * PAGE, s[0]), Ok(x), "the freeing stream reuses it");
    a.free_async(w, s[1]).unwrap();
    assert_eq!(a.end_allocate_to_pool(), Ok(POOL));
    a.release_graph_pool(POOL).unwrap();

    // A later route reuses on any stream what was freed before it began.
    a.begin_allocate_to_pool(POOL).unwrap();
    assert_eq!(a.malloc_async(3 * PAGE, s[0]), Ok(w));
    a.free_async(w, s[0]).unwrap();
    assert_eq!(a.end_allocate_to_pool(), Ok(POOL));
    a.release_graph_pool(POOL).unwrap();

    // Off the route: ordinary memory again; the pool keeps its graph's blocks.
    let z = a.malloc_async(3 * PAGE, s[0]).unwrap();
    assert_eq!(usable(z), None);
    for p in [x, y] {
        a.free_async(p, s[0]).unwrap();
    }
    assert_eq!(a.graph_pool_free().0, 3);
    assert!(a.graph_pool_live(POOL).is_empty());
    for p in [z, elsewhere] {
        a.free_async(p, s[0]).unwrap();
    }
    a.release_graph_pool(POOL).unwrap();
    assert_eq!(a.graph_pool_free(), (0, 0), "the last graph handed the pool back");
    assert!(is_pool_error(a.release_graph_pool(POOL)), "the route was released already");
    a.check_invariants().unwrap();
}

#[test]
fn a_pools_live_set_is_read_and_set_back() {
    let a = Allocator::new(Options { validate: true, ..opts() }).unwrap();
    let s = streams(&a, 2);
    let allocated = |a: &Allocator| a.stats().allocated_bytes.current;
    pool_with_a_graph(&a, s[0]);
    a.begin_allocate_to_pool(POOL).unwrap();
    let (p, q, r) = (
        a.malloc_async(3 * PAGE, s[0]).unwrap(),
        a.malloc_async(1000, s[0]).unwrap(),
        a.malloc_async(PAGE, s[0]).unwrap(),
    );
    for (ptr, n) in [(p, 3 * PAGE), (q, 1000), (r, PAGE)] {
        stamp(&a, ptr, n, ptr).unwrap();
    }
    // The checkpoint: what a graph recorded then would write to.
    let state: Vec<u64> = a.graph_pool_live(POOL).into_iter().map(|(ptr, _)| ptr).collect();
    let mut expected = vec![p, q, r];
    expected.sort_unstable();
    assert_eq!(state, expected);
    let at_checkpoint = allocated(&a);

    // Its tensors die, and a later request takes other memory of the pool.
    a.free_async(q, s[0]).unwrap();
    a.free_async(r, s[0]).unwrap();
    let later = a.malloc_async(9 * PAGE, s[0]).unwrap();
    assert!(![p, q, r].contains(&later));

    // Set back: q and r are live again where they were, the later block is the pool's free one.
    let (revived, freed) = a.set_graph_pool_live(POOL, &state, s[1]).unwrap();
    let mut both = vec![q, r];
    both.sort_unstable();
    assert_eq!((revived, freed), (both, vec![later]));
    assert_eq!(allocated(&a), at_checkpoint, "counted as at the checkpoint");
    assert_eq!(a.graph_pool_free().0, 1);
    assert!(verify(&a, q, 1000, q).is_ok() && verify(&a, r, PAGE, r).is_ok(), "memory untouched");
    a.check_invariants().unwrap();

    // Refusals change nothing.
    let live = a.graph_pool_live(POOL);
    let other = a.malloc(100);
    assert_eq!(a.end_allocate_to_pool(), Ok(POOL));
    let outside = a.malloc_async(100, s[0]).unwrap();
    let refused =
        |r: moonbright::Result<(Vec<u64>, Vec<u64>)>| matches!(r, Err(Error::GraphPool { .. }));
    assert!(refused(a.set_graph_pool_live(POOL, &[p, outside], s[0])), "not the pool's");
    assert!(refused(a.set_graph_pool_live((0, 7), &[], s[0])), "no such pool");
    let id = host(&a).begin_capture(s[1]);
    a.begin_graph_capture(s[1], POOL).unwrap();
    assert!(refused(a.set_graph_pool_live(POOL, &state, s[0])), "a capture is in progress");
    end(&a, s[1]);
    let _ = id;
    let mut with_other = live.clone();
    let other = other.unwrap();
    with_other.push((other, a.graph_pool_live(POOL).iter().find(|b| b.0 == other).unwrap().1));
    with_other.sort_unstable();
    assert_eq!(a.graph_pool_live(POOL), with_other, "only the routed request was added");

    // A revived block is freed once, like any other.
    a.free_async(q, s[0]).unwrap();
    assert_eq!(a.free_async(q, s[0]), Err(Error::DoubleFree { ptr: q }));
    for ptr in [p, r, other, outside] {
        a.free_async(ptr, s[0]).unwrap();
    }
    a.release_graph_pool(POOL).unwrap(); // the route
    a.release_graph_pool(POOL).unwrap(); // the recorded graph
    a.release_graph_pool(POOL).unwrap(); // the empty graph
    assert_eq!(a.graph_pool_free(), (0, 0));
    assert_eq!(a.stats().allocations.current, 0);
    a.release_unused().unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_failed_routed_request_changes_nothing_and_the_route_goes_on() {
    let a = Allocator::new(Options { cap_bytes: Some(8 * PAGE as u64), ..opts() }).unwrap();
    let s = streams(&a, 1)[0];
    pool_with_a_graph(&a, s);
    a.begin_allocate_to_pool(POOL).unwrap();
    let p = a.malloc_async(3 * PAGE, s).unwrap();
    a.free_async(p, s).unwrap();
    let state = |a: &Allocator| {
        (a.stats().allocations.current, a.graph_pool_free(), a.graph_pool_live(POOL))
    };
    let before = state(&a);
    assert!(matches!(a.malloc_async(6 * PAGE, s), Err(Error::OutOfMemory { .. })));
    assert_eq!(state(&a), before);
    a.driver().fail_nth(CallKind::Create, 1, None);
    assert!(matches!(a.malloc_async(5 * PAGE, s), Err(Error::Driver(_))));
    assert_eq!(state(&a), before);
    assert_eq!(a.malloc_async(3 * PAGE, s), Ok(p), "still routed: the pool serves its block");
    assert_eq!(a.end_allocate_to_pool(), Ok(POOL));
    a.free_async(p, s).unwrap();
    a.release_graph_pool(POOL).unwrap();
    a.release_graph_pool(POOL).unwrap();
    assert_eq!(a.graph_pool_free(), (0, 0));
    a.check_invariants().unwrap();
}
