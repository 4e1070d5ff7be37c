//! Tags asleep and awake, on the host backend: bytes and addresses kept, memory given back and
//! taken again, the errors of a tag not awake, all or nothing under the cap and under a driver
//! failure at every call of every kind a sleep or a wake makes, the wait for the streams' work,
//! many cycles back to the same figures, and other threads allocating meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use moonbright::driver::prelude::*;
use moonbright::driver::CallCounts;
use moonbright::tags::{self, Backup};
use moonbright::{Allocator, CallKind, Error, Options, StreamHandle};
use moonbright_testkit::scenario::{stamp, verify};

const PAGE: usize = 64 << 10;

fn host(pages: u64) -> Allocator {
    let opts = Options { validate: true, ..Options::host(pages * PAGE as u64, PAGE) };
    Allocator::new(opts).unwrap()
}

/// Sizes of a tag's allocations: sub-page ones that share arenas, one page, several pages.
const SIZES: [usize; 6] = [1000, 3 << 10, 40 << 10, PAGE, 3 * PAGE + 512, 9 * PAGE];

/// Allocates `SIZES` with tag `tag` and stamps each; returns (ptr, size, stamp id).
fn tagged(a: &Allocator, tag: &str, first_id: u64) -> Vec<(u64, usize, u64)> {
    let _scope = tags::scope(tag).unwrap();
    SIZES
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let p = a.malloc(size).unwrap();
            let id = first_id + i as u64;
            stamp(a, p, size, id).unwrap();
            (p, size, id)
        })
        .collect()
}

fn intact(a: &Allocator, blocks: &[(u64, usize, u64)]) -> bool {
    blocks.iter().all(|&(p, size, id)| verify(a, p, size, id).unwrap())
}

/// The allocator's books agree with the host backend's, and with themselves.
fn books_agree(a: &Allocator) {
    a.check_invariants().unwrap();
    let host = a.driver().inner().as_host().unwrap();
    let s = a.stats();
    assert_eq!(host.live_chunk_bytes(), s.reserved_bytes.current, "chunk bytes differ");
    assert_eq!(host.mapping_count() as u64, s.mapped_handles.current, "mappings differ");
}

fn asleep(a: &Allocator, tag: &str) -> bool {
    a.tags().iter().any(|t| &*t.name == tag && t.asleep)
}

#[test]
fn a_backed_up_tag_wakes_with_its_bytes_at_its_addresses() {
    let a = host(256);
    let weights = tagged(&a, "sleep-test-weights", 1);
    let other = tagged(&a, "sleep-test-other", 100);
    let untagged = a.malloc(2 * PAGE).unwrap();
    stamp(&a, untagged, 2 * PAGE, 7).unwrap();
    let reserved = a.stats().reserved_bytes.current;

    let slept = a.sleep("sleep-test-weights", Backup::Host).unwrap();
    // The tag's sub-page blocks share arenas of their own, one page here.
    let own_pages: usize =
        1 + SIZES.iter().filter(|&&s| s >= PAGE).map(|s| s.div_ceil(PAGE)).sum::<usize>();
    assert_eq!(slept.bytes, (own_pages * PAGE) as u64);
    assert_eq!(slept.backed_up, slept.bytes);
    assert_eq!(slept.released, slept.bytes, "every chunk went back to the driver");
    assert_eq!(a.stats().reserved_bytes.current, reserved - slept.bytes);
    assert_eq!(a.stats().asleep_bytes.current, slept.bytes);
    assert!(a.host_memory() >= slept.bytes);
    assert!(asleep(&a, "sleep-test-weights"));
    assert!(intact(&a, &other) && verify(&a, untagged, 2 * PAGE, 7).unwrap());
    books_agree(&a);

    let woke = a.wake("sleep-test-weights").unwrap();
    assert_eq!((woke.bytes, woke.restored), (slept.bytes, slept.bytes));
    assert!(intact(&a, &weights), "bytes or addresses changed");
    assert!(!asleep(&a, "sleep-test-weights"));
    assert_eq!(a.stats().asleep_bytes.current, 0);
    books_agree(&a);
    for (p, _, _) in weights.into_iter().chain(other) {
        a.free(p).unwrap();
    }
    a.free(untagged).unwrap();
    books_agree(&a);
}

#[test]
fn a_discarded_tag_gives_its_memory_back_and_wakes_usable() {
    let a = host(256);
    let kv = tagged(&a, "sleep-test-kv", 1);
    let reserved = a.stats().reserved_bytes.current;
    let slept = a.sleep("sleep-test-kv", Backup::Discard).unwrap();
    assert_eq!(slept.backed_up, 0);
    assert_eq!(a.host_memory(), 0, "no host memory for a discarded tag");
    assert_eq!(slept.released, slept.bytes);
    assert_eq!(a.stats().reserved_bytes.current, reserved - slept.released);
    let host = a.driver().inner().as_host().unwrap();
    assert_eq!(host.live_chunk_bytes(), reserved - slept.released, "the driver holds it still");
    let woke = a.wake("sleep-test-kv").unwrap();
    assert_eq!(woke.restored, 0);
    for &(p, size, id) in &kv {
        stamp(&a, p, size, id + 50).unwrap();
        assert!(verify(&a, p, size, id + 50).unwrap(), "woken memory is not usable");
    }
    books_agree(&a);
}

#[test]
fn a_tag_not_awake_refuses_what_would_change_it() {
    let a = host(256);
    let blocks = tagged(&a, "sleep-test-refuse", 1);
    let untagged = a.malloc(PAGE).unwrap();
    a.sleep("sleep-test-refuse", Backup::Host).unwrap();
    {
        let _s = tags::scope("sleep-test-refuse").unwrap();
        assert!(matches!(a.malloc(100), Err(Error::TagAsleep { .. })));
        assert!(matches!(a.malloc(3 * PAGE), Err(Error::TagAsleep { .. })));
    }
    for &(p, _, _) in &blocks {
        assert!(matches!(a.free(p), Err(Error::TagAsleep { .. })));
        assert!(matches!(a.free_async(p, StreamHandle::DEFAULT), Err(Error::TagAsleep { .. })));
    }
    assert!(matches!(a.sleep("sleep-test-refuse", Backup::Host), Err(Error::TagState { .. })));
    assert!(matches!(a.wake("sleep-test-other-awake"), Err(Error::TagState { .. })));
    // Untagged memory and other tags carry on.
    a.free(untagged).unwrap();
    let more = tagged(&a, "sleep-test-refuse-other", 30);
    assert!(intact(&a, &more));
    a.wake("sleep-test-refuse").unwrap();
    assert!(matches!(a.wake("sleep-test-refuse"), Err(Error::TagState { .. })));
    assert!(intact(&a, &blocks));
    for (p, _, _) in blocks {
        a.free(p).unwrap();
    }
    books_agree(&a);
}

#[test]
fn a_wake_short_of_memory_leaves_the_tag_asleep_and_whole() {
    let a = host(256);
    let blocks = tagged(&a, "sleep-test-cap", 1);
    let slept = a.sleep("sleep-test-cap", Backup::Host).unwrap();
    // Other memory takes what the tag gave back, under a cap that leaves no room for it.
    let filler = a.malloc(200 * PAGE).unwrap();
    a.set_cap(a.stats().reserved_bytes.current + slept.bytes - PAGE as u64).unwrap();
    match a.wake("sleep-test-cap") {
        Err(Error::OutOfMemory { .. }) => {}
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert!(asleep(&a, "sleep-test-cap"));
    books_agree(&a);
    a.free(filler).unwrap();
    a.wake("sleep-test-cap").unwrap();
    assert!(intact(&a, &blocks));
    books_agree(&a);
}

#[test]
fn sleep_waits_for_the_work_queued_on_the_tags_streams() {
    let a = Arc::new(host(256));
    let hostd = || a.driver().inner().as_host().unwrap();
    let s = a.driver().create_stream().unwrap();
    let p = {
        let _t = tags::scope("sleep-test-stream").unwrap();
        a.malloc_async(3 * PAGE, s).unwrap()
    };
    stamp(&*a, p, 3 * PAGE, 5).unwrap();
    hostd().wait_on_held_streams(std::time::Duration::from_secs(10));
    hostd().hold_stream(s);
    let done = Arc::new(AtomicBool::new(false));
    let sleeper = {
        let (a, done) = (Arc::clone(&a), Arc::clone(&done));
        std::thread::spawn(move || {
            let r = a.sleep("sleep-test-stream", Backup::Host);
            done.store(true, Ordering::SeqCst);
            r
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(!done.load(Ordering::SeqCst), "sleep went on while the stream's work ran");
    assert!(!asleep(&a, "sleep-test-stream"));
    hostd().release_stream(s);
    sleeper.join().unwrap().unwrap();
    a.wake("sleep-test-stream").unwrap();
    assert!(verify(&*a, p, 3 * PAGE, 5).unwrap());
}

/// Calls of each kind between two counts.
fn calls_between(before: &CallCounts, after: &CallCounts) -> Vec<(CallKind, u64)> {
    after.since(before).iter().filter(|&(_, n)| n > 0).collect()
}

#[test]
fn sleep_and_wake_make_no_call_that_waits_for_the_device() {
    let a = host(256);
    let s = a.driver().create_stream().unwrap();
    let _blocks = {
        let _t = tags::scope("sleep-test-calls").unwrap();
        [a.malloc_async(100, s).unwrap(), a.malloc_async(5 * PAGE, s).unwrap()]
    };
    let before = a.driver().counts();
    a.sleep("sleep-test-calls", Backup::Host).unwrap();
    a.wake("sleep-test-calls").unwrap();
    let calls = calls_between(&before, &a.driver().counts());
    // Waits are on events of the tag's stream and of the copy stream, one each per call.
    let allowed = [
        CallKind::EventCreate,
        CallKind::EventRecord,
        CallKind::EventSynchronize,
        CallKind::EventDestroy,
        CallKind::EventQuery,
        CallKind::StreamCreate,
        CallKind::StreamIsCapturing,
        CallKind::HostAlloc,
        CallKind::CopyAsync,
        CallKind::Unmap,
        CallKind::Release,
        CallKind::Create,
        CallKind::Map,
        CallKind::SetAccess,
    ];
    for (kind, n) in &calls {
        assert!(allowed.contains(kind), "{kind:?} called {n} times");
    }
    let syncs = calls.iter().find(|c| c.0 == CallKind::EventSynchronize).map_or(0, |c| c.1);
    assert_eq!(syncs, 3, "one wait for the tag's stream, one for each copy: {calls:?}");
}

#[test]
fn a_hundred_cycles_come_back_to_the_same_figures() {
    let a = host(256);
    let blocks = tagged(&a, "sleep-test-cycles", 1);
    let kv = tagged(&a, "sleep-test-cycles-kv", 50);
    let base = a.stats().reserved_bytes.current;
    a.sleep("sleep-test-cycles", Backup::Host).unwrap();
    a.sleep("sleep-test-cycles-kv", Backup::Discard).unwrap();
    let (asleep_reserved, host_bytes) = (a.stats().reserved_bytes.current, a.host_memory());
    a.wake("sleep-test-cycles").unwrap();
    a.wake("sleep-test-cycles-kv").unwrap();
    for _ in 0..100 {
        a.sleep("sleep-test-cycles", Backup::Host).unwrap();
        a.sleep("sleep-test-cycles-kv", Backup::Discard).unwrap();
        assert_eq!(a.stats().reserved_bytes.current, asleep_reserved);
        assert_eq!(a.host_memory(), host_bytes, "host memory grew");
        a.wake("sleep-test-cycles").unwrap();
        a.wake("sleep-test-cycles-kv").unwrap();
        assert!(a.stats().reserved_bytes.current <= base, "device memory grew");
    }
    assert!(intact(&a, &blocks));
    assert_eq!(a.release_host_memory().unwrap(), host_bytes);
    assert_eq!(a.host_memory(), 0);
    // Pinned ahead, a first sleep pins nothing.
    assert_eq!(a.reserve_host_memory(host_bytes).unwrap(), host_bytes);
    let pinned = a.driver().counts().get(CallKind::HostAlloc);
    a.sleep("sleep-test-cycles", Backup::Host).unwrap();
    assert_eq!(a.driver().counts().get(CallKind::HostAlloc), pinned);
    a.wake("sleep-test-cycles").unwrap();
    drop(kv);
    books_agree(&a);
}

#[test]
fn other_threads_allocate_while_a_tag_sleeps_and_wakes() {
    let a = Arc::new(host(512));
    let blocks = tagged(&a, "sleep-test-busy", 1);
    let stop = Arc::new(AtomicBool::new(false));
    let churn = |tag: Option<&'static str>, seed: u64| {
        let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
        std::thread::spawn(move || {
            let _t = tag.map(|t| tags::scope(t).unwrap());
            let mut n = seed;
            while !stop.load(Ordering::SeqCst) {
                n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let size = [300, 5 << 10, PAGE, 4 * PAGE][(n >> 60) as usize % 4];
                if let Ok(p) = a.malloc(size) {
                    stamp(&*a, p, size, n).unwrap();
                    assert!(verify(&*a, p, size, n).unwrap());
                    a.free(p).unwrap();
                }
            }
        })
    };
    let threads = [churn(None, 1), churn(Some("sleep-test-busy-other"), 2)];
    for _ in 0..50 {
        a.sleep("sleep-test-busy", Backup::Host).unwrap();
        a.wake("sleep-test-busy").unwrap();
        assert!(intact(&a, &blocks));
    }
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    books_agree(&a);
}

/// Calls of every kind a clean sleep and wake make, counted on a fresh allocator.
fn clean_calls(backup: Backup) -> (CallCounts, CallCounts) {
    let a = host(256);
    let _blocks = tagged(&a, "sleep-test-faults", 1);
    let c0 = a.driver().counts();
    a.sleep("sleep-test-faults", backup).unwrap();
    let c1 = a.driver().counts();
    a.wake("sleep-test-faults").unwrap();
    (c1.since(&c0), a.driver().counts().since(&c1))
}

#[test]
fn a_driver_failure_at_any_call_leaves_the_tag_whole() {
    for backup in [Backup::Host, Backup::Discard] {
        let (sleep_calls, wake_calls) = clean_calls(backup);
        for (phase, calls) in [("sleep", sleep_calls), ("wake", wake_calls)] {
            for (kind, n) in calls.iter().filter(|&(_, n)| n > 0) {
                for nth in 1..=n {
                    let a = host(256);
                    let blocks = tagged(&a, "sleep-test-faults", 1);
                    if phase == "wake" {
                        a.sleep("sleep-test-faults", backup).unwrap();
                    }
                    a.driver().fail_nth(kind, nth, None);
                    let r = match phase {
                        "sleep" => a.sleep("sleep-test-faults", backup).map(|_| ()),
                        _ => a.wake("sleep-test-faults").map(|_| ()),
                    };
                    a.driver().clear_failures();
                    let at = format!("{phase} {backup:?}, {kind:?} call {nth}");
                    books_agree(&a);
                    match (phase, r) {
                        // A failed sleep leaves the tag awake, as it was.
                        ("sleep", Err(_)) => {
                            assert!(!asleep(&a, "sleep-test-faults"), "{at}");
                            assert!(intact(&a, &blocks), "{at}: bytes changed");
                        }
                        // A sleep past its point of no return is asleep whatever the unmaps
                        // and releases did; those report a deferred error.
                        ("sleep", Ok(())) => {
                            assert!(asleep(&a, "sleep-test-faults"), "{at}");
                            a.wake("sleep-test-faults").unwrap();
                            if backup == Backup::Host {
                                assert!(intact(&a, &blocks), "{at}: bytes lost");
                            }
                        }
                        // A failed wake leaves the tag asleep with its bytes.
                        (_, Err(_)) => {
                            assert!(asleep(&a, "sleep-test-faults"), "{at}");
                            a.wake("sleep-test-faults").unwrap_or_else(|e| panic!("{at}: {e}"));
                            if backup == Backup::Host {
                                assert!(intact(&a, &blocks), "{at}: bytes lost");
                            }
                        }
                        (_, Ok(())) => panic!("{at}: a wake with a failed call succeeded"),
                    }
                    books_agree(&a);
                    for (p, _, _) in blocks {
                        a.free(p).unwrap();
                    }
                    a.release_unused().ok();
                    a.take_deferred_error();
                    books_agree(&a);
                }
            }
        }
    }
}

#[test]
fn pinning_ahead_and_giving_back_report_driver_failures() {
    let a = host(64);
    a.driver().fail_nth(CallKind::HostAlloc, 2, None);
    assert!(matches!(a.reserve_host_memory(3 << 26), Err(Error::Driver(_))));
    // The piece pinned before the failure stays, spare, and is given back.
    assert_eq!(a.host_memory(), 1 << 26);
    a.driver().fail_nth(CallKind::HostFree, 1, None);
    assert!(matches!(a.release_host_memory(), Err(Error::Driver(_))));
    assert_eq!(a.reserve_host_memory(1 << 26).unwrap(), 1 << 26);
    assert_eq!(a.release_host_memory().unwrap(), 1 << 26);
    assert_eq!(a.host_memory(), 0);
}
