//! Stream-ordered semantics on the host backend, whose streams can be held so that their events
//! stay pending: reuse by the freeing stream at once, by other streams only after the event,
//! waiting for pending frees before an OOM, graph capture refused, the background worker's
//! events, unmap batches and mapped window.

use std::time::{Duration, Instant};

use moonbright::{Allocator, CallKind, Error, Options, StreamHandle};
use moonbright_testkit::scenario::{stamp, verify};

const PAGE: usize = 64 << 10;

fn opts(background: bool) -> Options {
    Options {
        cap_fraction: 1.0,
        background,
        max_chunk_bytes: 4 * PAGE as u64,
        ..Options::host(64 * PAGE as u64, PAGE)
    }
}

fn streams(a: &Allocator, n: usize) -> Vec<StreamHandle> {
    (0..n).map(|_| a.driver().create_stream().unwrap()).collect()
}

use moonbright::driver::prelude::*;

fn host(a: &Allocator) -> &moonbright::driver::host::HostDriver {
    a.driver().inner().as_host().unwrap()
}

/// Waits until `cond` holds, for at most 30 seconds (a sanitizer build on a busy machine is
/// slow; a pass takes milliseconds).
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(30), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn the_freeing_stream_reuses_at_once_others_wait_for_the_event() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    host(&a).hold_stream(s[0]);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    stamp(&a, p, 3 * PAGE, 1).unwrap();
    a.free_async(p, s[0]).unwrap();
    assert_eq!(a.stats().driver_calls.get(CallKind::EventRecord), 1);

    // Another stream must not get the memory while s0's work may still use it.
    let q = a.malloc_async(3 * PAGE, s[1]).unwrap();
    assert_ne!(q, p);
    stamp(&a, q, 3 * PAGE, 2).unwrap();
    assert!(verify(&a, p, 3 * PAGE, 1).unwrap(), "the pending range was handed to another stream");
    a.free_async(q, s[1]).unwrap();

    // The freeing stream gets it back at once, with no driver call.
    let maps = a.stats().driver_calls.get(CallKind::Map);
    let again = a.malloc_async(3 * PAGE, s[0]).unwrap();
    assert_eq!(again, p);
    assert_eq!(a.stats().driver_calls.get(CallKind::Map), maps);
    a.free_async(again, s[0]).unwrap();

    // Until the event completes, s1 still cannot have it, however often the allocator polls
    // (q's free on s1 completes; s0 is held); afterwards it can.
    a.poll();
    let pending = a.malloc_async(3 * PAGE, s[1]).unwrap();
    assert_ne!(pending, p, "s1 got a range whose free is still pending on s0");
    a.free_async(pending, s[1]).unwrap();
    host(&a).release_stream(s[0]);
    assert!(a.poll());
    let hits = a.stats().cache_hits;
    let r = a.malloc_async(3 * PAGE, s[1]).unwrap();
    assert!(r == p || r == q, "a completed free should be reused as it is");
    assert_eq!(a.stats().cache_hits, hits + 1);
    a.free_async(r, s[1]).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn malloc_never_takes_a_free_pending_on_any_stream_the_null_stream_included() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 1)[0];
    for stream in [StreamHandle::DEFAULT, s] {
        host(&a).hold_stream(stream);
        for size in [1000, 3 * PAGE] {
            let p = a.malloc_async(size, stream).unwrap();
            a.free_async(p, stream).unwrap();
            // `cudaMalloc`'s memory may be used on any stream at once, a non-blocking one too,
            // which is not ordered after the null stream's queued work.
            let q = a.malloc(size).unwrap();
            assert_ne!(q, p, "malloc took a free pending on {stream:?}");
            // A range q, freed, would be an exact fit too, and the lowest address wins: q may
            // lie below p (served by joining cached neighbours there), so it stays live here.
            let range = size >= PAGE;
            if !range {
                a.free(q).unwrap();
            }
            assert_eq!(a.malloc_async(size, stream).unwrap(), p, "the stream itself reuses it");
            if range {
                a.free(q).unwrap();
            }
            a.free_async(p, stream).unwrap();
        }
        host(&a).release_stream(stream);
    }
}

#[test]
fn a_completed_free_found_by_the_requests_own_poll_is_a_cache_hit() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    host(&a).hold_stream(s[0]);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    host(&a).release_stream(s[0]);
    // Nobody has polled: s1's request finds the completed event itself, then takes the range
    // as it is (a cache hit), with no driver call to map it again.
    let (hits, maps) = (a.stats().cache_hits, a.stats().driver_calls.get(CallKind::Map));
    let q = a.malloc_async(3 * PAGE, s[1]).unwrap();
    assert_eq!(q, p);
    assert_eq!(a.stats().cache_hits, hits + 1);
    assert_eq!(a.stats().driver_calls.get(CallKind::Map), maps);
    a.free_async(q, s[1]).unwrap();
    a.check_invariants().unwrap();
}

/// A poll (or the worker) records an event only for a free whose own record failed. A free
/// whose record succeeded is left alone: the user may destroy its stream as soon as the free
/// returns, and a record on a destroyed stream is an error (on a GPU, a crash).
#[test]
fn only_a_free_whose_own_record_failed_gets_a_later_event() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 3);
    let records = || a.stats().driver_calls.get(CallKind::EventRecord);
    let q = a.malloc_async(3 * PAGE, s[1]).unwrap();
    host(&a).hold_stream(s[0]);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    host(&a).release_stream(s[0]);
    a.driver().destroy_stream(s[0]).unwrap();
    let r = records();
    assert!(a.poll(), "the free's own event completes");
    assert_eq!(records(), r, "a poll recorded on a stream whose frees had their events");
    assert!(a.take_deferred_error().is_none());

    // s1's free cannot record its event: the next poll records one, and then the range
    // reaches another stream as it is.
    a.driver().fail_nth(CallKind::EventRecord, 1, None);
    a.free_async(q, s[1]).unwrap();
    assert!(a.take_deferred_error().is_some(), "the failed record was not reported");
    let r = records();
    assert!(a.poll());
    assert_eq!(records(), r + 1);
    assert!(a.take_deferred_error().is_none());
    let x = a.malloc_async(3 * PAGE, s[2]).unwrap();
    let y = a.malloc_async(3 * PAGE, s[2]).unwrap();
    assert_eq!([x.min(y), x.max(y)], [p.min(q), p.max(q)], "both ranges are reused as they are");
    a.check_invariants().unwrap();
}

/// `release_unused` gives back only what no queued work may use; `empty_cache` first waits on
/// the host for the pending frees' stream work (as `torch.cuda.empty_cache` does under
/// PyTorch's allocator), then gives that back too. Under either option set.
#[test]
fn empty_cache_waits_for_pending_frees_and_release_unused_does_not() {
    for contract in [false, true] {
        let a = Allocator::new(Options {
            captures_announced: contract,
            deferred_free_events: contract,
            ..opts(false)
        })
        .unwrap();
        let s = streams(&a, 2);
        let reserved = || a.stats().reserved_bytes.current;
        let q = a.malloc_async(2 * PAGE, s[1]).unwrap();
        a.release_unused().unwrap();
        let live_only = reserved();
        host(&a).wait_on_held_streams(Duration::from_secs(10));
        host(&a).hold_stream(s[0]);
        let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
        stamp(&a, p, 3 * PAGE, 1).unwrap();
        a.free_async(p, s[0]).unwrap();
        assert_eq!(a.release_unused().unwrap(), 0, "released a range s0's work may still use");
        assert!(reserved() >= live_only + 3 * PAGE as u64);

        let waits = a.stats().pending_free_waits;
        let ended = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|t| {
            t.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                ended.store(true, std::sync::atomic::Ordering::SeqCst);
                host(&a).release_stream(s[0]);
            });
            let released = a.empty_cache().unwrap();
            assert!(ended.load(std::sync::atomic::Ordering::SeqCst), "returned before s0's work");
            assert!(released >= 3 * PAGE as u64, "released {released}");
        });
        assert_eq!(reserved(), live_only, "contract {contract}");
        assert_eq!(a.stats().pending_free_waits, waits + 1, "PyTorch's num_sync_all_streams");
        a.free_async(q, s[1]).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(reserved(), 0);
        assert_eq!(host(&a).live_chunk_bytes(), 0);
        a.check_invariants().unwrap();
    }
}

/// A failed wait is reported, and nothing is lost: what was free is released anyway, and the
/// free whose wait failed stays pending until a later call finds its work done.
#[test]
fn a_failed_wait_in_empty_cache_is_reported_and_loses_nothing() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    let live = a.malloc_async(PAGE, s[1]).unwrap();
    let q = a.malloc_async(2 * PAGE, s[1]).unwrap();
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    a.free_async(q, s[1]).unwrap();
    assert!(a.poll());
    host(&a).hold_stream(s[0]);
    a.free_async(p, s[0]).unwrap();
    let before = a.stats().reserved_bytes.current;
    a.driver().fail_nth(CallKind::EventSynchronize, 1, None);
    let e = a.empty_cache().unwrap_err();
    assert!(matches!(e, Error::Driver(ref d) if d.call == CallKind::EventSynchronize), "{e}");
    let after = a.stats().reserved_bytes.current;
    assert!(after < before, "the completed free was not released: {before} -> {after}");
    assert!(after >= (3 + 1) * PAGE as u64, "the pending range or the live one was released");
    host(&a).release_stream(s[0]);
    assert!(a.empty_cache().unwrap() >= 3 * PAGE as u64);
    a.free_async(live, s[1]).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
    a.check_invariants().unwrap();
}

/// A stream a request, as a server may make them: each frees once and is destroyed. Once a
/// stream's frees have completed, the allocator forgets it and its events go back to the
/// stock, so 500 streams reuse one event instead of creating one each (and polls do not walk
/// every stream ever used).
#[test]
fn streams_used_once_and_destroyed_leave_nothing_behind() {
    let a = Allocator::new(opts(false)).unwrap();
    let creates = || a.stats().driver_calls.get(CallKind::EventCreate);
    for i in 0..500 {
        let s = a.driver().create_stream().unwrap();
        let len = if i % 2 == 0 { 3 * PAGE } else { 1000 };
        let p = a.malloc_async(len, s).unwrap();
        stamp(&a, p, len, i).unwrap();
        a.free_async(p, s).unwrap();
        assert!(a.poll(), "stream {i}'s free did not complete");
        a.driver().destroy_stream(s).unwrap();
    }
    assert_eq!(creates(), 1, "events created for 500 streams");
    assert!(a.take_deferred_error().is_none());
    a.check_invariants().unwrap();
}

/// A sub-page block freed on a stream is its alone until the free completes, and free space
/// next to it joins it (the arena's tail here): another stream gets a new arena meanwhile.
#[test]
fn sub_page_blocks_follow_the_same_order() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    host(&a).hold_stream(s[0]);
    let keep = a.malloc_async(1000, s[0]).unwrap();
    let p = a.malloc_async(1000, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    let q = a.malloc_async(1000, s[1]).unwrap();
    assert!(q.abs_diff(keep) >= PAGE as u64, "s1 got space in the arena s0 holds");
    assert_eq!(a.malloc_async(1000, s[0]).unwrap(), p, "the freeing stream reuses its block");
    a.free_async(p, s[0]).unwrap();
    a.free_async(keep, s[0]).unwrap();
    assert_eq!(a.stats().allocations.current, 1);
    host(&a).release_stream(s[0]);
    a.poll();
    // Completed: the arena, empty, goes back to the cache for any stream.
    assert_eq!(a.stats().cached_ranges.current, 1);
    a.free(q).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocations.current, 0);
}

/// An arena whose blocks are all freed on a stream goes back to the heap pending for that
/// stream, as a freed range does: another stream does not get it, the freeing stream does, at
/// once, and once the free completes it is cached for all. The history shows the block's own
/// events only, each free completing as it is requested (the stream may reuse it at once).
#[test]
fn an_arena_freed_on_a_stream_comes_back_to_it_as_a_pending_range() {
    let a = Allocator::new(opts(false)).unwrap();
    a.record_history(Some(100));
    let s = streams(&a, 2);
    host(&a).hold_stream(s[0]);
    let p = a.malloc_async(1000, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    let page = a.malloc_async(PAGE, s[1]).unwrap();
    // Blocks are cut from the end of an arena: p's arena starts a page before its end.
    let arena = p + 1024 - PAGE as u64;
    assert!(page + PAGE as u64 <= arena || page > p, "another stream got the arena s0 holds");
    let maps = a.stats().driver_calls.get(CallKind::Map);
    assert_eq!(a.malloc_async(1000, s[0]).unwrap(), p, "s0 gets its block back");
    assert_eq!(a.stats().driver_calls.get(CallKind::Map), maps, "with no driver call");
    a.free_async(p, s[0]).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().cached_ranges.current, 0);
    host(&a).release_stream(s[0]);
    a.poll();
    assert_eq!(a.stats().cached_ranges.current, 1, "completed: cached for every stream");
    a.check_invariants().unwrap();
    let block: Vec<&str> =
        a.history().iter().filter(|e| e.addr == p).map(|e| e.action.torch_name()).collect();
    assert_eq!(
        block,
        ["alloc", "free_requested", "free_completed", "alloc", "free_requested", "free_completed"]
    );
    a.free(page).unwrap();
}

#[test]
fn an_allocation_waits_for_pending_frees_before_reporting_oom() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    let big = 40 * PAGE;
    let p = a.malloc_async(big, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    // Not polled yet: only waiting on s0's event makes room for s1.
    let q = a.malloc_async(big, s[1]).unwrap();
    a.free_async(q, s[1]).unwrap();

    // While s0 is held, its frees cannot complete: the host model refuses to wait forever.
    host(&a).hold_stream(s[0]);
    let p = a.malloc_async(big, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    host(&a).hold_stream(s[1]);
    let err = a.malloc_async(big, s[1]).unwrap_err();
    assert!(matches!(err, Error::Driver(_) | Error::OutOfMemory { .. }), "{err}");
    host(&a).release_stream(s[0]);
    host(&a).release_stream(s[1]);
    let r = a.malloc_async(big, s[1]).unwrap();
    a.free(r).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn capture_is_refused_and_changes_nothing() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 1)[0];
    let p = a.malloc_async(PAGE, s).unwrap();
    host(&a).begin_capture(s);
    let before = a.stats().allocations;
    assert_eq!(a.malloc_async(100, s), Err(Error::StreamCapture { stream: s.0 }));
    assert_eq!(a.free_async(p, s), Err(Error::StreamCapture { stream: s.0 }));
    assert!(a.stats().allocations == before);
    assert!(Error::StreamCapture { stream: 1 }.to_string().contains("captured into a CUDA graph"));
    host(&a).end_capture(s);
    a.free_async(p, s).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn the_worker_completes_frees_and_unmaps_in_batches() {
    let a = Allocator::new(Options {
        unmap_batch_ranges: 1000,
        unmap_batch_age_us: 1_000,
        prefetch_window_max: 0,
        ..opts(true)
    })
    .unwrap();
    let s = streams(&a, 2);
    let p = a.malloc_async(5 * PAGE, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    // Without any call from us, the worker sees the event complete and caches the range.
    eventually("the free to complete", || a.stats().cached_ranges.current == 1);
    // A size that no run of its chunks (4 pages and 1) holds steals the cached pages; the old
    // addresses retire and, by age, unmap.
    let q = a.malloc_async(3 * PAGE, s[1]).unwrap();
    assert!(a.stats().cached_ranges_stolen >= 1);
    eventually("the retired range to be unmapped", || {
        let st = a.stats();
        st.retired_ranges.current == 0 && st.unmap_batches >= 1
    });
    a.free(q).unwrap();
    a.check_invariants().unwrap();
}

/// The worker keeps events created ahead of need: a burst of frees records them and creates
/// none on its own path.
#[test]
fn a_burst_of_frees_records_stocked_events_without_creating_any() {
    let a = Allocator::new(Options { prefetch_window_max: 0, ..opts(true) }).unwrap();
    let s = streams(&a, 1)[0];
    let created = || a.stats().driver_calls.get(CallKind::EventCreate);
    eventually("the event stock", || created() >= 256);
    let (c0, r0) = (created(), a.stats().driver_calls.get(CallKind::EventRecord));
    let ptrs: Vec<u64> = (0..100).map(|_| a.malloc_async(1000, s).unwrap()).collect();
    for p in ptrs {
        a.free_async(p, s).unwrap();
    }
    assert_eq!(created(), c0, "a free created an event while the stock had some");
    assert!(a.stats().driver_calls.get(CallKind::EventRecord) >= r0 + 100);
    a.check_invariants().unwrap();
}

/// A burst of frees keeps at most 8 events in flight; a poll asks each stream's newest event
/// first, so a burst whose events have all completed costs one query, and every event comes
/// back for the next frees.
#[test]
fn a_poll_after_a_burst_of_frees_asks_one_event_per_stream() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    let queries = || a.stats().driver_calls.get(CallKind::EventQuery);
    let records = || a.stats().driver_calls.get(CallKind::EventRecord);
    let creates = || a.stats().driver_calls.get(CallKind::EventCreate);
    host(&a).hold_stream(s[0]);
    let ptrs: Vec<u64> = (0..50).map(|_| a.malloc_async(1000, s[0]).unwrap()).collect();
    for p in ptrs {
        a.free_async(p, s[0]).unwrap();
    }
    assert_eq!(records(), 50);
    // Past 8 events in flight, each free records the stream's newest again.
    assert_eq!(creates(), 8, "a stream kept more than 8 events in flight");
    // Held: the newest is pending, then the oldest is, and the poll stops there.
    let q0 = queries();
    assert!(!a.poll());
    assert_eq!(queries(), q0 + 2);
    host(&a).release_stream(s[0]);
    let q1 = queries();
    assert!(a.poll());
    assert_eq!(queries(), q1 + 1, "the newest event covers the whole burst");
    let q2 = queries();
    assert!(!a.poll());
    assert_eq!(queries(), q2, "no event is left to ask");
    // Every event is spare again: another burst creates none.
    let created = creates();
    let ptrs: Vec<u64> = (0..50).map(|_| a.malloc_async(1000, s[1]).unwrap()).collect();
    for p in ptrs {
        a.free_async(p, s[0]).unwrap();
    }
    assert_eq!(creates(), created);
    a.check_invariants().unwrap();
}

/// A failed query of the newest event falls back to the older ones: what they cover completes
/// at once, the rest at the next poll, and the error is kept for the user.
#[test]
fn a_failed_query_of_the_newest_event_still_completes_the_older_ones() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    host(&a).hold_stream(s[0]);
    let ptrs: Vec<u64> = (0..3).map(|_| a.malloc_async(3 * PAGE, s[0]).unwrap()).collect();
    for &p in &ptrs {
        a.free_async(p, s[0]).unwrap();
    }
    host(&a).release_stream(s[0]);
    a.driver().fail_nth(CallKind::EventQuery, 1, None);
    assert!(a.poll(), "the older events completed");
    assert!(a.take_deferred_error().is_some(), "the failed query went unrecorded");
    // The first two frees are another stream's at once; the third waits for the next poll.
    let hits = a.stats().cache_hits;
    let got: Vec<u64> = (0..2).map(|_| a.malloc_async(3 * PAGE, s[1]).unwrap()).collect();
    assert_eq!(a.stats().cache_hits, hits + 2);
    assert!(got.iter().all(|g| ptrs[..2].contains(g)));
    assert!(a.poll());
    assert_eq!(a.malloc_async(3 * PAGE, s[1]).unwrap(), ptrs[2]);
    a.check_invariants().unwrap();
}

#[test]
fn the_window_serves_new_sizes_without_mapping() {
    let a = Allocator::new(Options {
        prefetch_window_min: 16 * PAGE as u64,
        prefetch_window_max: 32 * PAGE as u64,
        ..opts(true)
    })
    .unwrap();
    let s = streams(&a, 1)[0];
    eventually("the window to fill", || a.stats().window_bytes.current >= 16 * PAGE as u64);
    let hits = a.stats().window_hits;
    let p = a.malloc_async(3 * PAGE, s).unwrap();
    let q = a.malloc_async(5 * PAGE, s).unwrap();
    assert_eq!(a.stats().window_hits, hits + 2);
    stamp(&a, p, 3 * PAGE, 1).unwrap();
    stamp(&a, q, 5 * PAGE, 2).unwrap();
    assert!(verify(&a, p, 3 * PAGE, 1).unwrap() && verify(&a, q, 5 * PAGE, 2).unwrap());
    a.free_async(p, s).unwrap();
    a.free_async(q, s).unwrap();
    // Memory pressure takes pages back from the window: a request for all of memory succeeds.
    eventually("frees to complete", || a.stats().cached_ranges.current == 2);
    let all = a.malloc_async(64 * PAGE, s).unwrap();
    a.free(all).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn threads_on_their_own_streams_keep_their_bytes() {
    let a = Allocator::new(Options {
        validate: true,
        prefetch_window_min: 8 * PAGE as u64,
        unmap_batch_ranges: 4,
        ..Options { host_capacity: 256 * PAGE as u64, ..opts(true) }
    })
    .unwrap();
    let s = streams(&a, 4);
    std::thread::scope(|sc| {
        for (t, &stream) in s.iter().enumerate() {
            let (a, s) = (&a, &s);
            sc.spawn(move || {
                let mut live = Vec::new();
                for i in 0..300u64 {
                    let size = ((t as u64 * 7919 + i * 104_729) % (5 * PAGE as u64)) as usize + 1;
                    let id = t as u64 * 10_000 + i;
                    match a.malloc_async(size, stream) {
                        Ok(p) => {
                            stamp(a, p, size, id).unwrap();
                            live.push((p, size, id));
                        }
                        Err(Error::OutOfMemory { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                    if live.len() > 6 || (i % 3 == 0 && !live.is_empty()) {
                        let (p, size, id) = live.remove(0);
                        assert!(verify(a, p, size, id).unwrap(), "allocation {id} corrupted");
                        // Half the frees cross streams.
                        let on = if id % 2 == 0 { stream } else { s[(t + 1) % s.len()] };
                        a.free_async(p, on).unwrap();
                    }
                }
                for (p, size, id) in live {
                    assert!(verify(a, p, size, id).unwrap());
                    a.free_async(p, stream).unwrap();
                }
            });
        }
    });
    eventually("every free to complete", || {
        a.poll();
        a.stats().allocations.current == 0 && a.check_invariants().is_ok()
    });
}

#[test]
fn a_stream_remaps_its_own_pending_frees_and_unmaps_them_after_its_work() {
    let a = Allocator::new(Options { unmap_batch_ranges: 1, ..opts(false) }).unwrap();
    let s = streams(&a, 2);
    host(&a).hold_stream(s[0]);
    let p = a.malloc_async(4 * PAGE, s[0]).unwrap();
    stamp(&a, p, 4 * PAGE, 1).unwrap();
    a.free_async(p, s[0]).unwrap();
    // A larger request on the same stream takes the pending pages at once (stream order)...
    let creates = a.stats().driver_calls.get(CallKind::Create);
    let q = a.malloc_async(6 * PAGE, s[0]).unwrap();
    let created_pages = a.stats().reserved_bytes.current / PAGE as u64;
    assert!(created_pages <= 6, "the pending pages were not reused ({created_pages} pages held)");
    assert!(a.stats().driver_calls.get(CallKind::Create) > creates);
    // ...but the old addresses stay mapped while the stream's earlier work may read them.
    a.flush().unwrap();
    assert!(verify(&a, p, 4 * PAGE, 1).unwrap(), "unmapped while the stream was still busy");
    assert_eq!(a.stats().retired_ranges.current, 1);
    host(&a).release_stream(s[0]);
    a.poll();
    a.flush().unwrap();
    assert_eq!(a.stats().retired_ranges.current, 0);
    a.free(q).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn pending_pages_of_a_failed_plan_never_reach_another_stream() {
    // One-page chunks, so another stream's one-page requests could take them one by one.
    let a = Allocator::new(Options {
        unmap_batch_ranges: 1000,
        max_chunk_bytes: PAGE as u64,
        ..opts(false)
    })
    .unwrap();
    let s = streams(&a, 2);
    host(&a).hold_stream(s[0]);
    let p = a.malloc_async(4 * PAGE, s[0]).unwrap();
    stamp(&a, p, 4 * PAGE, 1).unwrap();
    a.free_async(p, s[0]).unwrap();
    a.driver().fail_nth(CallKind::Map, 1, None);
    assert!(matches!(a.malloc_async(6 * PAGE, s[0]), Err(Error::Driver(_))));
    a.check_invariants().unwrap();
    // Another stream fills what is left: it must not be handed the quarantined pages.
    let mut others = Vec::new();
    while let Ok(x) = a.malloc_async(PAGE, s[1]) {
        stamp(&a, x, PAGE, 2).unwrap();
        others.push(x);
        if others.len() > 64 {
            break;
        }
    }
    assert!(verify(&a, p, 4 * PAGE, 1).unwrap(), "a quarantined page went to another stream");
    host(&a).release_stream(s[0]);
    a.poll();
    for x in others {
        a.free(x).unwrap();
    }
    a.check_invariants().unwrap();
}

/// A stress of `release_unused` from two threads beside requests on two streams, with every
/// invariant checked after every operation.
#[test]
fn release_unused_races_with_requests_and_itself() {
    let a = Allocator::new(Options { validate: true, ..opts(true) }).unwrap();
    let s = streams(&a, 2);
    std::thread::scope(|sc| {
        for _ in 0..2 {
            let a = &a;
            sc.spawn(move || {
                for _ in 0..3000 {
                    a.release_unused().unwrap();
                }
            });
        }
        for (t, &stream) in s.iter().enumerate() {
            let a = &a;
            sc.spawn(move || {
                for i in 0..3000u64 {
                    let size = ((t as u64 * 31 + i * 7) % 6 + 1) as usize * PAGE / 2;
                    let p = a.malloc_async(size, stream).unwrap();
                    stamp(a, p, size, i).unwrap();
                    assert!(verify(a, p, size, i).unwrap());
                    a.free_async(p, stream).unwrap();
                }
            });
        }
    });
    a.poll();
    a.release_unused().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocations.current, 0);
}

#[test]
fn a_stream_breaks_up_its_own_larger_pending_free_without_waiting() {
    // 64 pages, all in one freed range still pending on s0: a smaller request on s0 takes
    // chunks out of it at once (stream order), with no new chunk and no wait for the event.
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 1);
    let p = a.malloc_async(64 * PAGE, s[0]).unwrap();
    host(&a).hold_stream(s[0]);
    a.free_async(p, s[0]).unwrap();
    let created = a.stats().driver_calls.get(CallKind::Create);
    let q = a.malloc_async(12 * PAGE, s[0]).unwrap();
    let r = a.malloc_async(40 * PAGE, s[0]).unwrap();
    assert_eq!(a.stats().driver_calls.get(CallKind::Create), created, "new chunks were made");
    assert_eq!(a.stats().pending_free_waits, 0);
    a.check_invariants().unwrap();
    host(&a).release_stream(s[0]);
    a.free_async(q, s[0]).unwrap();
    a.free_async(r, s[0]).unwrap();
    a.poll();
    a.check_invariants().unwrap();
}

#[test]
fn a_split_unmaps_only_the_ranges_that_still_map_its_chunk() {
    let a = Allocator::new(Options { unmap_batch_age_us: 60_000_000, ..opts(false) }).unwrap();
    // A one-page range, freed, then stolen by a larger request: its old addresses stay retired
    // while its chunk lives on in `big`.
    let k = a.malloc(PAGE).unwrap();
    a.free(k).unwrap();
    let big = a.malloc(4 * PAGE).unwrap();
    stamp(&a, big, 4 * PAGE, 7).unwrap();
    assert_eq!(a.stats().retired_ranges.current, 1);
    // A four-page chunk, freed and cached; a two-page request must split it, which needs its
    // cached addresses unmapped first.
    let c = a.malloc(4 * PAGE).unwrap();
    a.free(c).unwrap();
    let d = a.malloc(2 * PAGE).unwrap();
    stamp(&a, d, 2 * PAGE, 8).unwrap();
    let st = a.stats();
    assert_eq!((st.flushes_for_split, st.targeted_flushes, st.chunk_splits), (1, 1, 1));
    assert_eq!(st.retired_ranges.current, 1, "the unrelated retired range was unmapped too");
    assert!(verify(&a, big, 4 * PAGE, 7).unwrap() && verify(&a, d, 2 * PAGE, 8).unwrap());
    a.check_invariants().unwrap();
    // The full batch still takes it.
    a.flush().unwrap();
    assert_eq!(a.stats().retired_ranges.current, 0);
    a.free(big).unwrap();
    a.free(d).unwrap();
}

/// `record_stream` (PyTorch's `Tensor.record_stream`): an allocation made and freed on s0 but
/// also used by s1's work is reused by no stream, s0 included, until both streams have passed
/// the free. Without it, s0 would reuse the range at once while s1 still reads it.
#[test]
fn a_free_recorded_on_another_stream_waits_for_both() {
    for size in [3 * PAGE, 1000] {
        let a = Allocator::new(opts(false)).unwrap();
        let s = streams(&a, 3);
        let p = a.malloc_async(size, s[0]).unwrap();
        stamp(&a, p, size, 1).unwrap();
        a.record_stream(p, s[1]).unwrap();
        a.record_stream(p, s[1]).unwrap(); // twice is once
        host(&a).hold_stream(s[1]);
        let records = a.stats().driver_calls.get(CallKind::EventRecord);
        a.free_async(p, s[0]).unwrap();
        assert_eq!(a.stats().driver_calls.get(CallKind::EventRecord), records + 2);
        assert_eq!(a.stats().joined_frees, 1);

        // s0's own work is done, s1's is not: nobody gets the memory, not even s0.
        a.poll();
        let q = a.malloc_async(size, s[0]).unwrap();
        let r = a.malloc_async(size, s[2]).unwrap();
        assert!(q != p && r != p, "{size} B: reused while s1 may still use it");
        stamp(&a, q, size, 2).unwrap();
        stamp(&a, r, size, 3).unwrap();
        assert!(verify(&a, p, size, 1).unwrap());
        a.check_invariants().unwrap();

        // Once s1 has passed the free too, it is free for every stream, as it is.
        host(&a).release_stream(s[1]);
        assert!(a.poll());
        let hits = a.stats().cache_hits;
        let again = a.malloc_async(size, s[2]).unwrap();
        assert_eq!(again, p, "{size} B: the completed free was not reused as it is");
        if size >= PAGE {
            assert_eq!(a.stats().cache_hits, hits + 1);
        }
        for x in [q, r, again] {
            a.free_async(x, s[2]).unwrap();
        }
        a.check_invariants().unwrap();
    }
}

/// The stream the free is ordered on may itself be among those recorded, and the allocation
/// may be freed on any stream: the free waits for that stream and each recorded one, once.
#[test]
fn record_stream_on_the_freeing_stream_adds_nothing() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    a.record_stream(p, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    assert_eq!(a.stats().joined_frees, 0);
    assert_eq!(a.malloc_async(3 * PAGE, s[0]).unwrap(), p, "the freeing stream reuses at once");

    // Freed on s1 alone: no wait for s0 (as with cudaFreeAsync, the caller orders s0's work
    // before s1's). Recorded on s0 (and s1), freed on s1: waits for both.
    a.record_stream(p, s[1]).unwrap();
    a.free_async(p, s[1]).unwrap();
    assert_eq!(a.stats().joined_frees, 0);
    assert_eq!(a.malloc_async(3 * PAGE, s[1]).unwrap(), p);
    a.record_stream(p, s[0]).unwrap();
    a.record_stream(p, s[1]).unwrap();
    host(&a).hold_stream(s[0]);
    a.free_async(p, s[1]).unwrap();
    assert_eq!(a.stats().joined_frees, 1);
    a.poll();
    assert_ne!(a.malloc_async(3 * PAGE, s[1]).unwrap(), p);
    host(&a).release_stream(s[0]);
    assert!(a.poll());
    assert_eq!(a.malloc_async(3 * PAGE, s[1]).unwrap(), p);
    a.check_invariants().unwrap();
}

/// Bad pointers are refused and change nothing; a synchronous free ignores recorded uses (its
/// caller vouches that the device is done); a growable allocation is refused.
#[test]
fn record_stream_refuses_what_is_not_a_live_allocation() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    let small = a.malloc_async(1000, s[0]).unwrap();
    assert!(matches!(a.record_stream(p + 256, s[1]), Err(Error::InteriorPointer { .. })));
    assert!(matches!(a.record_stream(small + 256, s[1]), Err(Error::InteriorPointer { .. })));
    assert!(matches!(a.record_stream(0x1234, s[1]), Err(Error::UnknownPointer { .. })));
    let g = a.reserve_growable(8 * PAGE).unwrap();
    let e = a.record_stream(g, s[1]).unwrap_err();
    assert!(matches!(e, Error::GrowableStreamUse { .. }), "{e}");
    assert!(e.to_string().contains("growable"), "{e}");
    a.free(g).unwrap();

    a.record_stream(p, s[1]).unwrap();
    host(&a).hold_stream(s[1]);
    a.free(p).unwrap();
    assert_eq!(a.stats().joined_frees, 0);
    assert_eq!(a.malloc(3 * PAGE).unwrap(), p, "a synchronous free waits for no stream");
    a.free(p).unwrap();
    let e = a.record_stream(p, s[1]).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer { .. }), "a freed pointer: {e}");
    assert!(e.to_string().starts_with("unknown pointer"), "{e}");
    a.free_async(small, s[0]).unwrap();
    host(&a).release_stream(s[1]);
    a.check_invariants().unwrap();
}

/// While a recorded stream is being captured into a graph, the free is refused and changes
/// nothing (an event recorded there would join the graph); after the capture it goes through.
#[test]
fn a_free_recorded_on_a_capturing_stream_is_refused() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    a.record_stream(p, s[1]).unwrap();
    host(&a).begin_capture(s[1]);
    assert!(matches!(a.free_async(p, s[0]), Err(Error::StreamCapture { .. })));
    assert_eq!(a.usable_size(p), Some(3 * PAGE), "the refused free changed something");
    host(&a).end_capture(s[1]);
    a.free_async(p, s[0]).unwrap();
    assert!(a.poll());
    assert_eq!(a.malloc_async(3 * PAGE, s[1]).unwrap(), p);
    a.check_invariants().unwrap();
}

/// When the event on a recorded stream cannot be recorded, the free still completes: a poll
/// records the missing event, and nothing is lost. A request short of memory waits for a
/// joined free instead of failing.
#[test]
fn a_joined_free_survives_a_failed_record_and_serves_a_request_short_of_memory() {
    let a = Allocator::new(Options { cap_bytes: Some(8 * PAGE as u64), ..opts(false) }).unwrap();
    let s = streams(&a, 2);
    let p = a.malloc_async(8 * PAGE, s[0]).unwrap();
    a.record_stream(p, s[1]).unwrap();
    // The second record of the free (on s1) fails.
    a.driver().fail_nth(CallKind::EventRecord, 2, None);
    a.free_async(p, s[0]).unwrap();
    assert!(a.take_deferred_error().is_some(), "the failed record was not reported");
    // Every page is in the joined free: another stream's request waits for it, then reuses it.
    let q = a.malloc_async(8 * PAGE, s[1]).unwrap();
    assert_eq!(q, p);
    assert!(a.take_deferred_error().is_none());
    assert_eq!(a.stats().num_ooms, 0);
    a.free_async(q, s[1]).unwrap();
    a.check_invariants().unwrap();
}

/// The capture check of a recorded stream fails in the driver: the free returns the error and
/// changes nothing, and the allocation can still be freed afterwards.
#[test]
fn a_failed_capture_check_of_a_recorded_stream_changes_nothing() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = streams(&a, 2);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    stamp(&a, p, 3 * PAGE, 4).unwrap();
    a.record_stream(p, s[1]).unwrap();
    // The first query is the freeing stream's, the second the recorded stream's.
    a.driver().fail_nth(CallKind::StreamIsCapturing, 2, None);
    assert!(matches!(a.free_async(p, s[0]), Err(Error::Driver(_))));
    assert_eq!(a.usable_size(p), Some(3 * PAGE), "the failed free changed something");
    assert!(verify(&a, p, 3 * PAGE, 4).unwrap());
    assert_eq!(a.stats().joined_frees, 0);
    a.free_async(p, s[0]).unwrap();
    assert_eq!(a.stats().joined_frees, 1);
    assert!(a.poll());
    assert_eq!(a.malloc_async(3 * PAGE, s[1]).unwrap(), p);
    a.check_invariants().unwrap();
}

#[test]
fn deferred_free_events_are_recorded_later_and_order_reuse_the_same() {
    let a = Allocator::new(Options { deferred_free_events: true, ..opts(false) }).unwrap();
    let s = streams(&a, 2);
    let records = || a.stats().driver_calls.get(CallKind::EventRecord);
    host(&a).hold_stream(s[0]);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    stamp(&a, p, 3 * PAGE, 1).unwrap();
    a.free_async(p, s[0]).unwrap();
    assert_eq!(records(), 0, "the free recorded its own event");
    assert_eq!(a.malloc_async(3 * PAGE, s[0]), Ok(p), "the freeing stream reuses at once");
    a.free_async(p, s[0]).unwrap();

    // Another stream waits for an event recorded after the free, and for its completion.
    let q = a.malloc_async(3 * PAGE, s[1]).unwrap();
    assert_ne!(q, p);
    assert!(!a.poll(), "completed while the stream is held");
    assert_eq!(records(), 1, "poll records the event the free left");
    let q2 = a.malloc_async(3 * PAGE, s[1]).unwrap();
    assert_ne!(q2, p, "handed to another stream before its event completed");
    assert!(verify(&a, p, 3 * PAGE, 1).unwrap());
    host(&a).release_stream(s[0]);
    assert!(a.poll());
    assert_eq!(a.malloc_async(3 * PAGE, s[1]), Ok(p), "not reused after the event completed");
    for x in [p, q, q2] {
        a.free_async(x, s[1]).unwrap();
    }
    a.check_invariants().unwrap();
}

/// Under the memory profile, a request about to make new memory while its stream's own frees
/// wait for an event no thread has recorded (`deferred_free_events`) records that event itself
/// and remaps their pages: nothing new is held. The default makes new memory instead, and so
/// does the memory profile when the record fails (asked once, never in a loop).
#[test]
fn the_memory_profile_serves_a_stream_from_its_own_unrecorded_frees() {
    use moonbright::Profile;
    for (profile, record_fails) in
        [(Profile::Memory, false), (Profile::Balanced, false), (Profile::Memory, true)]
    {
        let o = Options { deferred_free_events: true, prefetch_window_max: 0, ..opts(false) };
        let a = Allocator::new(o.with_profile(profile)).unwrap();
        let s = streams(&a, 1)[0];
        host(&a).hold_stream(s);
        let p = a.malloc_async(8 * PAGE, s).unwrap();
        a.free_async(p, s).unwrap();
        let (held, records) =
            (a.stats().reserved_bytes.current, a.stats().driver_calls.get(CallKind::EventRecord));
        if record_fails {
            a.driver().fail_nth(CallKind::EventRecord, 1, None);
        }
        // Half the size: no exact fit, and only the pending range's chunks could serve it.
        let q = a.malloc_async(4 * PAGE, s).unwrap();
        stamp(&a, q, 4 * PAGE, 7).unwrap();
        let grew = a.stats().reserved_bytes.current > held;
        let case = format!("{profile:?}, record fails: {record_fails}");
        assert_eq!(grew, profile != Profile::Memory || record_fails, "{case}");
        let recorded = a.stats().driver_calls.get(CallKind::EventRecord) - records;
        assert_eq!(recorded, (profile == Profile::Memory) as u64, "{case}");
        assert!(verify(&a, q, 4 * PAGE, 7).unwrap(), "{case}");
        a.free_async(q, s).unwrap();
        host(&a).release_stream(s);
        a.check_invariants().unwrap();
    }
}

/// `Stats::held_at_peak` says where held memory went when it last rose: live bytes as asked,
/// their rounding to pages, and a free still pending on its stream, beside which a request of
/// another size made new memory. The parts add up to what was held.
#[test]
fn held_memory_at_its_peak_is_split_by_where_it_goes() {
    let a = Allocator::new(Options { prefetch_window_max: 0, ..opts(false) }).unwrap();
    let s = streams(&a, 1)[0];
    host(&a).hold_stream(s);
    let p = a.malloc_async(4 * PAGE, s).unwrap();
    a.free_async(p, s).unwrap();
    // 2.5 pages: no exact fit, and the pending range's one chunk of 4 pages is too large.
    let q = a.malloc_async(5 * PAGE / 2, s).unwrap();
    let st = a.stats();
    let h = st.held_at_peak;
    let page = PAGE as u64;
    assert_eq!((h.reserved, st.reserved_bytes.peak), (7 * page, 7 * page));
    assert_eq!((h.requested, h.rounding, h.pending), (5 * page / 2, page / 2, 4 * page));
    let parts = [h.requested, h.rounding, h.arena_free, h.cached, h.pending, h.window, h.bare];
    assert_eq!((parts.iter().sum::<u64>(), h.other), (h.reserved, 0), "{h:?}");
    a.free_async(q, s).unwrap();
    host(&a).release_stream(s);
    a.check_invariants().unwrap();
}

/// A loop that frees on a stream whose work never ends (a launch-bound decoder's) keeps frees
/// pending for good: the worker then records and queries their events every 2 ms, not at its
/// 200 µs mapping tick, so its driver calls stay few beside the thread that launches kernels.
/// An upper bound only: a slow machine makes fewer passes, never more.
#[test]
fn frees_that_only_wait_for_events_get_the_worker_every_2_ms() {
    let o = Options { deferred_free_events: true, prefetch_window_max: 0, ..opts(true) };
    let a = Allocator::new(o).unwrap();
    let s = streams(&a, 1)[0];
    host(&a).hold_stream(s);
    let records = || a.stats().driver_calls.get(CallKind::EventRecord);
    let (r0, t) = (records(), Instant::now());
    while t.elapsed() < Duration::from_millis(200) {
        for len in [1000, 3 * PAGE] {
            let p = a.malloc_async(len, s).unwrap();
            a.free_async(p, s).unwrap();
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    // A loaded machine may not have run the worker yet.
    eventually("the worker's event record for the pending frees", || records() > r0);
    let made = records() - r0;
    let passes = t.elapsed().as_micros() as u64 / 2000 + 2;
    assert!(made <= passes, "{made} event records in {:?}: the worker ticked faster", t.elapsed());
    host(&a).release_stream(s);
    a.check_invariants().unwrap();
}

#[test]
fn deferred_free_events_come_from_the_worker_and_release_unused() {
    let o = Options { deferred_free_events: true, prefetch_window_max: 0, ..opts(true) };
    let a = Allocator::new(o).unwrap();
    let s = streams(&a, 2);
    let p = a.malloc_async(3 * PAGE, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    eventually("the worker to record and poll the free's event", || {
        a.stats().driver_calls.get(CallKind::EventRecord) > 0 && a.stats().cached_ranges.current > 0
    });
    assert_eq!(a.malloc_async(3 * PAGE, s[1]), Ok(p), "another stream reuses it once completed");

    let b = Allocator::new(Options { deferred_free_events: true, ..opts(false) }).unwrap();
    let s = streams(&b, 1)[0];
    let p = b.malloc_async(5 * PAGE, s).unwrap();
    b.free_async(p, s).unwrap();
    b.release_unused().unwrap();
    assert_eq!(b.stats().reserved_bytes.current, 0, "release_unused left a deferred free's memory");
}

/// Carved blocks (`Options::carve`) follow the stream order of sub-page blocks: a block freed
/// on a stream is its alone until the free completes, when every stream may take it; and a
/// chunk whose blocks are all freed on a stream goes pending for it as a range, as a freed
/// range does (its stream takes it back at once for its size, others after the free).
#[test]
fn carved_blocks_follow_the_same_order() {
    // Every size under `carve`, repeated ones too (`carve_repeated` 0).
    let a = Allocator::new(Options { carve: 1.0, carve_repeated: 0.0, ..opts(false) }).unwrap();
    let s = streams(&a, 2);
    let keep = a.malloc(8 * PAGE).unwrap();
    let eight = a.malloc(8 * PAGE).unwrap();
    a.free(eight).unwrap();
    let calls = |a: &Allocator| a.stats().driver_calls.get(CallKind::Map);
    let maps = calls(&a);
    host(&a).hold_stream(s[0]);
    // One page, then three: the second chunk of the cached eight, whole.
    let p = a.malloc_async(PAGE, s[0]).unwrap();
    let q = a.malloc_async(3 * PAGE, s[0]).unwrap();
    assert_eq!((p, q), (eight + 7 * PAGE as u64, eight + 4 * PAGE as u64));
    a.free_async(p, s[0]).unwrap();
    // s1 does not get p's page while s0's free is pending: it carves the first chunk instead.
    let r = a.malloc_async(PAGE, s[1]).unwrap();
    assert_eq!(r, eight + 3 * PAGE as u64);
    assert_eq!(a.malloc_async(PAGE, s[0]).unwrap(), p, "the freeing stream reuses it at once");
    a.free_async(p, s[0]).unwrap();
    host(&a).release_stream(s[0]);
    a.poll();
    assert_eq!(a.malloc_async(PAGE, s[1]).unwrap(), p, "completed: s1 takes it");
    assert_eq!(a.stats().carved_allocations, 5);
    a.free(p).unwrap();
    // q and p freed on a held s0 leave their chunk unused: it goes pending for s0, whole.
    host(&a).hold_stream(s[0]);
    let p = a.malloc_async(PAGE, s[0]).unwrap();
    a.free_async(q, s[0]).unwrap();
    a.free_async(p, s[0]).unwrap();
    assert_eq!(a.stats().carved_chunks_uncarved, 1);
    let other = a.malloc_async(4 * PAGE, s[1]).unwrap();
    assert_ne!(other, q, "s1 got the chunk s0's frees left before they completed");
    let maps_s1 = calls(&a);
    assert_eq!(a.malloc_async(4 * PAGE, s[0]).unwrap(), q, "s0 takes its chunk back, whole");
    assert_eq!(calls(&a), maps_s1, "with no driver call");
    assert_eq!(maps_s1, maps + 1, "only s1's four pages mapped");
    a.check_invariants().unwrap();
    host(&a).release_stream(s[0]);
    for x in [q, r, other, keep] {
        a.free(x).unwrap();
    }
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocations.current, 0);
}

/// Under PyTorch's contract (frees record no event of their own), a loop whose frees all go back
/// to their own stream needs no event: the worker's records slow down to one pass in 32 ms or
/// so, instead of one every 2 ms.
#[test]
fn the_worker_records_fewer_events_while_frees_go_back_to_their_stream() {
    let a = Allocator::new(Options {
        deferred_free_events: true,
        captures_announced: true,
        prefetch_window_max: 0,
        ..opts(true)
    })
    .unwrap();
    let s = streams(&a, 1)[0];
    // The device runs behind, as in a loop that launches faster than its kernels run: events
    // recorded on the stream stay pending.
    host(&a).hold_stream(s);
    let pair = || {
        let p = a.malloc_async(3 * PAGE, s).unwrap();
        a.free_async(p, s).unwrap();
    };
    pair();
    // Warm: the next pairs are cache hits, which the worker's tick does not count as misses.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(100) {
        pair();
    }
    let records = || a.stats().driver_calls.get(CallKind::EventRecord);
    let (r0, t0) = (records(), Instant::now());
    while t0.elapsed() < Duration::from_millis(400) {
        pair();
        std::thread::sleep(Duration::from_micros(100));
    }
    let recorded = records() - r0;
    // At a 2 ms tick, about 200; at 32 ms, about 13 (a slow machine ticks less, never more).
    assert!(recorded <= 40, "the worker recorded {recorded} events in 400 ms of cache hits");
    assert_eq!(a.stats().request_maps, 1);
    host(&a).release_stream(s);
    a.check_invariants().unwrap();
}
