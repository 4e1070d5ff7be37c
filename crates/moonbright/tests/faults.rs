//! Driver failures injected at every call kind, at many positions: each failed request leaves no
//! half-mapped range, no leaked chunk or mapping, every live allocation intact, and the allocator
//! able to go on. The host backend's own books are compared with the allocator's after every step.

use moonbright::driver::code;
use moonbright::driver::prelude::*;
use moonbright::{Allocator, CallKind, Error, Options};
use moonbright_testkit::scenario::{stamp, verify};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const PAGE: usize = 64 << 10;

/// A tight allocator: 96 pages, chunks up to 4 pages (for a need of 8 or more new pages, the
/// largest power of two it holds, up to 16), small unmap batches, so a short workload creates,
/// splits, steals, maps, flushes and reserves; with `carve`, carving that much, and with
/// `grow_first`, growing before stealing that far above the peak in use.
fn tight_carving(carve: f64, grow_first: f64) -> Allocator {
    let opts = Options {
        carve,
        grow_first,
        // At `carve` 1.0 every size carves that much, repeated ones too.
        carve_repeated: if carve == 1.0 { 0.0 } else { Options::default().carve_repeated },
        cap_fraction: 1.0,
        max_chunk_bytes: 4 * PAGE as u64,
        large_chunk_bytes: 8 * PAGE as u64,
        largest_chunk_bytes: 16 * PAGE as u64,
        unmap_batch_ranges: 3,
        va_reserve_factor: 1,
        va_limit_factor: 64,
        ..Options::host(96 * PAGE as u64, PAGE)
    };
    Allocator::new(opts).unwrap()
}

fn tight() -> Allocator {
    tight_carving(Options::default().carve, 0.0)
}

/// The allocator's books agree with the host backend's: chunk bytes and mappings.
fn books_agree(a: &Allocator) {
    a.check_invariants().unwrap();
    let host = a.driver().inner().as_host().unwrap();
    let s = a.stats();
    assert_eq!(
        host.live_chunk_bytes(),
        s.reserved_bytes.current,
        "chunk bytes differ from the driver's"
    );
    assert_eq!(
        host.mapping_count() as u64,
        s.mapped_handles.current,
        "mappings differ from the driver's"
    );
}

/// A seeded workload of mixed sizes. Requests that fail because of an injected fault are counted
/// and skipped; anything else that fails is a bug.
fn workload(a: &Allocator, seed: u64, ops: usize) -> usize {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut live: Vec<(u64, usize, u64)> = Vec::new();
    let mut failed = 0;
    // A growable allocation beside them: (address, its first page stamped with this id).
    let mut grow: Option<(u64, Option<u64>)> = None;
    for id in 0..ops as u64 {
        if rng.gen_bool(0.15) {
            match grow {
                None => match a.reserve_growable(16 * PAGE) {
                    Ok(g) => grow = Some((g, None)),
                    Err(Error::Driver(e)) => {
                        assert_eq!(e.message, "injected failure", "{e}");
                        failed += 1;
                    }
                    Err(e) => panic!("unexpected error: {e}"),
                },
                Some((g, stamped)) => {
                    if let Some(sid) = stamped {
                        assert!(verify(a, g, PAGE, sid).unwrap(), "growable lost its bytes");
                    }
                    if rng.gen_bool(0.1) {
                        a.free(g).unwrap();
                        grow = None;
                    } else {
                        let len = rng.gen_range(0..16 * PAGE);
                        match a.resize(g, len) {
                            Ok(()) if len >= PAGE => {
                                if stamped.is_none() {
                                    stamp(a, g, PAGE, id).unwrap();
                                    grow = Some((g, Some(id)));
                                }
                            }
                            Ok(()) => grow = Some((g, None)),
                            Err(Error::Driver(e)) => {
                                assert_eq!(e.message, "injected failure", "{e}");
                                failed += 1;
                            }
                            Err(Error::OutOfMemory { .. }) => {}
                            Err(e) => panic!("unexpected error: {e}"),
                        }
                    }
                }
            }
            books_agree(a);
            continue;
        }
        if rng.gen_bool(0.6) || live.is_empty() {
            let size = match rng.gen_range(0..4) {
                0 => rng.gen_range(1..PAGE),
                1 => rng.gen_range(PAGE..4 * PAGE),
                2 => rng.gen_range(4 * PAGE..12 * PAGE),
                _ => 8 * PAGE,
            };
            match a.malloc(size) {
                Ok(p) => {
                    stamp(a, p, size, id).unwrap();
                    live.push((p, size, id));
                }
                Err(Error::Driver(e)) => {
                    assert_eq!(e.message, "injected failure", "{e}");
                    failed += 1;
                }
                Err(Error::OutOfMemory { .. }) => {
                    // Make room: free the oldest third.
                    for (p, size, id) in live.drain(..live.len() / 3) {
                        assert!(verify(a, p, size, id).unwrap());
                        a.free(p).unwrap();
                    }
                }
                Err(e) => panic!("unexpected error: {e}"),
            }
        } else {
            let (p, size, id) = live.swap_remove(rng.gen_range(0..live.len()));
            assert!(verify(a, p, size, id).unwrap(), "allocation {id} lost its bytes");
            a.free(p).unwrap();
        }
        books_agree(a);
    }
    for (p, size, id) in live {
        assert!(verify(a, p, size, id).unwrap(), "allocation {id} lost its bytes");
        a.free(p).unwrap();
    }
    if let Some((g, _)) = grow {
        a.free(g).unwrap();
    }
    failed
}

/// After the workload, everything can be given back: no chunk or mapping is stranded.
fn drains_clean(a: &Allocator) {
    a.driver().clear_failures();
    a.release_unused().unwrap();
    books_agree(a);
    let host = a.driver().inner().as_host().unwrap();
    assert_eq!(host.live_chunk_bytes(), 0);
    assert_eq!(host.mapping_count(), 0);
}

/// The driver calls a request or the worker makes for the heap.
const HEAP_CALLS: [CallKind; 6] = [
    CallKind::Create,
    CallKind::Map,
    CallKind::SetAccess,
    CallKind::Unmap,
    CallKind::Release,
    CallKind::Reserve,
];

fn fail_each_position(kind: CallKind) {
    fail_each_position_carving(kind, Options::default().carve, 0.0);
}

fn fail_each_position_carving(kind: CallKind, carve: f64, grow_first: f64) {
    // How many calls of this kind the workload makes when nothing fails, its drain included:
    // some kinds (a released growable's addresses freed after their unmap) come in the
    // workload only if the worker flushed in time, which a busy machine may not give it.
    let calls = {
        let a = tight_carving(carve, grow_first);
        workload(&a, 7, 250);
        drains_clean(&a);
        if carve == 1.0 {
            assert!(a.stats().carved_allocations > 0, "the workload carved nothing");
        }
        a.stats().driver_calls.get(kind)
    };
    assert!(calls > 0, "the workload makes no {kind} call");
    let positions: Vec<u64> = if calls <= 40 {
        (1..=calls).collect()
    } else {
        (1..=calls).step_by((calls / 40) as usize).collect()
    };
    let (mut seen_failures, mut fired_count) = (0, 0);
    for n in positions {
        let a = tight_carving(carve, grow_first);
        let before = a.stats().driver_calls.get(kind);
        a.driver().fail_nth(kind, n, None);
        let failed = workload(&a, 7, 250);
        // Whether the workload made the call planned to fail (else the drain would, after its
        // `clear_failures`).
        let fired = a.stats().driver_calls.get(kind) - before >= n;
        let (deferred, last) = (a.stats().deferred_errors, a.take_deferred_error());
        drains_clean(&a);
        seen_failures += failed;
        if !fired {
            assert_eq!((failed, deferred), (0, 0), "{kind} call {n}: a failure that never fired");
            continue;
        }
        fired_count += 1;
        // A failure must surface: as a failed request, or (unmaps, releases, addresses freed
        // after an unmap: the work of a free or of the worker) as a deferred error recorded in
        // the statistics and kept for `take_deferred_error`.
        if failed == 0 {
            assert!(
                deferred > 0,
                "{kind} call {n} failed, and no request or deferred error said so"
            );
            let e = last.expect("a deferred error counted but not kept");
            assert_eq!((e.call, e.message.as_str()), (kind, "injected failure"), "{e}");
        }
    }
    assert!(fired_count > 0, "no injected {kind} failure fired within the workload");
    if !matches!(kind, CallKind::Unmap | CallKind::Release | CallKind::FreeReservation) {
        assert!(seen_failures > 0, "no request failed from an injected {kind} failure");
    }
}

#[test]
fn create_failures() {
    fail_each_position(CallKind::Create);
}

#[test]
fn map_failures() {
    fail_each_position(CallKind::Map);
}

#[test]
fn set_access_failures() {
    fail_each_position(CallKind::SetAccess);
}

#[test]
fn unmap_failures() {
    fail_each_position(CallKind::Unmap);
}

#[test]
fn release_failures() {
    fail_each_position(CallKind::Release);
}

#[test]
fn free_reservation_failures() {
    fail_each_position(CallKind::FreeReservation);
}

#[test]
fn reserve_failures() {
    fail_each_position(CallKind::Reserve);
}

/// The same failures with carving at its most (carved arenas cut and given back beside every
/// failed call): nothing is lost, and the books agree.
#[test]
fn failures_of_every_kind_while_carving() {
    for kind in HEAP_CALLS {
        fail_each_position_carving(kind, 1.0, 0.0);
    }
}

/// The same with `grow_first`: new memory made in one chunk rather than stolen, up to 1.5x of
/// the peak in use (the tight allocator's cap stops it sooner).
#[test]
fn failures_of_every_kind_while_growing_first() {
    for kind in HEAP_CALLS {
        fail_each_position_carving(kind, Options::default().carve, 0.5);
    }
}

#[test]
fn a_failed_map_rollback_that_cannot_unmap_is_retired_not_leaked() {
    let a = tight();
    // The third map of a stitched range fails, then the rollback unmap fails too.
    let p = a.malloc(5 * PAGE).unwrap();
    a.free(p).unwrap();
    a.driver().fail_nth(CallKind::Map, 2, None);
    a.driver().fail_nth(CallKind::Unmap, 1, None);
    assert!(matches!(a.malloc(7 * PAGE), Err(Error::Driver(_))));
    books_agree(&a);
    assert!(a.stats().retired_ranges.current >= 1);
    a.flush().unwrap();
    books_agree(&a);
    drains_clean(&a);
}

#[test]
fn deferred_unmap_failure_is_recorded_and_retried() {
    let a = tight();
    let ptrs: Vec<u64> = (0..4).map(|_| a.malloc(3 * PAGE).unwrap()).collect();
    for p in ptrs {
        a.free(p).unwrap();
    }
    // Steal the cached ranges (13 pages: more than the four hold together, so they are not
    // joined to serve it where they are), then let the batch's first unmap fail.
    a.driver().fail_nth(CallKind::Unmap, 1, None);
    let big = a.malloc(13 * PAGE).unwrap();
    for _ in 0..3 {
        let q = a.malloc(PAGE).unwrap();
        a.free(q).unwrap();
    }
    a.flush().ok();
    let err = a.take_deferred_error().or_else(|| {
        a.flush().err().map(|e| match e {
            Error::Driver(d) => d,
            other => panic!("{other}"),
        })
    });
    assert!(err.is_some() || a.stats().deferred_errors > 0, "the unmap failure went unnoticed");
    a.flush().unwrap();
    books_agree(&a);
    assert_eq!(a.stats().retired_ranges.current, 0);
    a.free(big).unwrap();
    drains_clean(&a);
}

/// A create or a map the driver refuses for lack of memory is an out-of-memory error that
/// carries the refusal (the books alone would ask to free memory that may be free already);
/// nothing is lost, and the next request succeeds.
#[test]
fn driver_out_of_memory_becomes_an_oom_error_with_the_drivers_refusal() {
    let a = tight();
    for kind in [CallKind::Create, CallKind::Map] {
        a.release_unused().unwrap();
        let keep = a.malloc(PAGE).unwrap();
        stamp(&a, keep, PAGE, 3).unwrap();
        a.driver().fail_nth(kind, 1, Some(code::OUT_OF_MEMORY));
        let err = a.malloc(2 * PAGE).unwrap_err();
        let Error::OutOfMemory { driver: Some(d), .. } = &err else {
            panic!("{kind:?}: expected out of memory with the driver's refusal, got {err:?}")
        };
        assert_eq!((d.call, d.code), (kind, code::OUT_OF_MEMORY));
        assert!(err.to_string().contains("the driver refused"), "{err}");
        books_agree(&a);
        assert!(verify(&a, keep, PAGE, 3).unwrap(), "{kind:?}: a live allocation changed");
        let p = a.malloc(2 * PAGE).unwrap();
        a.free(p).unwrap();
        a.free(keep).unwrap();
    }
    // Out of memory by the books alone names no driver call.
    let big = a.malloc(80 * PAGE).unwrap();
    let err = a.malloc(32 * PAGE).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { driver: None, .. }), "{err}");
    assert!(err.to_string().contains("more must be freed"), "{err}");
    a.free(big).unwrap();
    drains_clean(&a);
}

#[test]
fn release_unused_failure_keeps_the_chunk() {
    let a = tight();
    let p = a.malloc(6 * PAGE).unwrap();
    a.free(p).unwrap();
    a.driver().fail_nth(CallKind::Release, 1, None);
    assert!(a.release_unused().is_err());
    books_agree(&a);
    assert!(a.stats().reserved_bytes.current > 0);
    drains_clean(&a);
}

/// A lowered cap whose release of unused memory fails: the error is returned, the cap is set,
/// and the unreleased chunk stays held. Over the cap, held memory still serves requests but
/// does not grow; the next release gives the chunk back.
#[test]
fn a_lowered_cap_whose_release_fails_keeps_the_chunk_and_the_cap() {
    let a = tight();
    let keep = a.malloc(2 * PAGE).unwrap();
    stamp(&a, keep, 2 * PAGE, 9).unwrap();
    let p = a.malloc(4 * PAGE).unwrap();
    a.free(p).unwrap();
    a.driver().fail_nth(CallKind::Release, 1, None);
    assert!(matches!(a.set_cap(3 * PAGE as u64), Err(Error::Driver(_))));
    assert_eq!(a.cap(), 3 * PAGE as u64);
    books_agree(&a);
    let held = a.stats().reserved_bytes.current;
    assert!(held > 3 * PAGE as u64);
    let q = [a.malloc(2 * PAGE).unwrap(), a.malloc(2 * PAGE).unwrap()];
    assert_eq!(a.stats().reserved_bytes.current, held, "grew over the cap");
    assert!(matches!(a.malloc(PAGE), Err(Error::OutOfMemory { .. })), "grew over the cap");
    books_agree(&a);
    q.into_iter().for_each(|q| a.free(q).unwrap());
    a.release_unused().unwrap();
    books_agree(&a);
    assert!(a.stats().reserved_bytes.current <= 3 * PAGE as u64);
    assert!(verify(&a, keep, 2 * PAGE, 9).unwrap());
    a.free(keep).unwrap();
    drains_clean(&a);
}

#[test]
fn setup_failure_is_an_error_not_a_panic() {
    let opts = Options { host_page_size: 3 << 20, ..Options::host(1 << 30, 2 << 20) };
    assert!(matches!(
        Allocator::new(opts),
        Err(Error::InvalidOption { name: "host_page_size", .. })
    ));
}

#[test]
fn teardown_failures_are_reported_not_panicked() {
    for kind in [CallKind::FreeReservation, CallKind::Unmap, CallKind::Release] {
        let a = tight();
        let _live = a.malloc(3 * PAGE).unwrap();
        let _small = a.malloc(100).unwrap();
        a.driver().fail_nth(kind, 1, None);
        drop(a);
    }
}

/// Event failures never lose a free: the free takes effect, the error is recorded, and a later
/// event on the stream (recorded by `poll` or the worker) covers it.
#[test]
fn event_failures_delay_reuse_but_lose_nothing() {
    for kind in [CallKind::EventCreate, CallKind::EventRecord, CallKind::EventQuery] {
        let a = tight();
        let s = a.driver().create_stream().unwrap();
        let t = a.driver().create_stream().unwrap();
        let p = a.malloc_async(3 * PAGE, s).unwrap();
        stamp(&a, p, 3 * PAGE, 1).unwrap();
        a.driver().fail_nth(kind, 1, None);
        a.free_async(p, s).unwrap();
        a.poll();
        books_agree(&a);
        if kind != CallKind::EventQuery {
            assert!(a.take_deferred_error().is_some(), "{kind}: the failure went unrecorded");
        }
        // Once an event covers the free, another stream gets the range back as it is.
        a.poll();
        let q = a.malloc_async(3 * PAGE, t).unwrap();
        assert_eq!(q, p, "{kind}: the free never completed");
        a.free(q).unwrap();
        drains_clean(&a);
    }
}
