//! Peer access on the host backend (which models devices 0..8, itself device 0): a peer enabled
//! later reaches every allocation mapped before, and every one mapped after, of every kind
//! (sub-page, ranges, cached ranges served again, the window, growables); refused peers and
//! driver failures leave no peer added and the allocator working; and an enable racing requests
//! that map leaves none of their ranges out. Two GPUs run the same through PyTorch
//! (python/tests/gpu/test_multi_gpu.py).

use std::sync::{Arc, Barrier};

use moonbright::driver::host::HostDriver;
use moonbright::{Allocator, CallKind, Error, Options, StreamHandle};

const PAGE: usize = 64 << 10;

fn opts(background: bool) -> Options {
    Options {
        cap_fraction: 1.0,
        background,
        max_chunk_bytes: 4 * PAGE as u64,
        prefetch_window_min: 8 * PAGE as u64,
        prefetch_window_max: 16 * PAGE as u64,
        ..Options::host(512 * PAGE as u64, PAGE)
    }
}

fn host(a: &Allocator) -> &HostDriver {
    a.driver().inner().as_host().unwrap()
}

/// Whether `peer` may access the whole allocation at `ptr` (its usable size).
fn reaches(a: &Allocator, peer: i32, ptr: u64) -> bool {
    let len = a.usable_size(ptr).expect("a live allocation") as u64;
    host(a).peer_can_access(peer, ptr, len)
}

#[test]
fn a_peer_reaches_every_allocation_mapped_before_and_after_it_was_enabled() {
    let a = Allocator::new(opts(true)).unwrap();
    let sizes = [100, 5000, PAGE, 3 * PAGE + 1, 9 * PAGE, 40 * PAGE];
    let before: Vec<u64> = sizes.iter().map(|&n| a.malloc(n).unwrap()).collect();
    let g = a.reserve_growable(32 * PAGE).unwrap();
    a.resize(g, 5 * PAGE).unwrap();
    // A cached range, mapped and free when the peer comes.
    a.free(a.malloc(6 * PAGE).unwrap()).unwrap();
    assert!(before.iter().all(|&p| !reaches(&a, 2, p)), "no peer was enabled yet");

    a.enable_peer_access(2).unwrap();
    assert_eq!(a.peers(), vec![2]);
    for &p in &before {
        assert!(reaches(&a, 2, p), "allocation {p:#x} mapped before the enable");
    }
    assert!(host(&a).peer_can_access(2, g, 5 * PAGE as u64), "the growable's committed pages");
    let hits = a.stats().cache_hits;
    let again = a.malloc(6 * PAGE).unwrap();
    assert_eq!(a.stats().cache_hits, hits + 1, "served from the cache");
    assert!(reaches(&a, 2, again), "a cached range served again");
    let after: Vec<u64> = sizes.iter().map(|&n| a.malloc(n).unwrap()).collect();
    for &p in &after {
        assert!(reaches(&a, 2, p), "allocation {p:#x} mapped after the enable");
    }
    a.resize(g, 20 * PAGE).unwrap();
    assert!(host(&a).peer_can_access(2, g, 20 * PAGE as u64), "pages the growable gained");
    assert!(!reaches(&a, 3, after[3]), "only the peer enabled");
    a.enable_peer_access(2).unwrap();
    assert_eq!(a.peers(), vec![2], "enabling twice adds nothing");
    a.enable_peer_access(5).unwrap();
    assert_eq!(a.peers(), vec![2, 5]);
    let late = a.malloc(7 * PAGE).unwrap();
    assert!(reaches(&a, 2, late) && reaches(&a, 5, late));
    assert!(a.stats().window_hits + a.stats().cache_hits > 0);
    a.check_invariants().unwrap();
}

#[test]
fn a_window_mapped_before_the_enable_serves_the_peer_too() {
    let a = Allocator::new(opts(true)).unwrap();
    // Demand makes the mapper fill the window; wait until it holds pages.
    let p = a.malloc(3 * PAGE).unwrap();
    let start = std::time::Instant::now();
    while a.stats().window_bytes.current < 4 * PAGE as u64 {
        assert!(start.elapsed().as_secs() < 30, "the window never filled");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    a.enable_peer_access(1).unwrap();
    let hits = a.stats().window_hits;
    let w = a.malloc(2 * PAGE).unwrap();
    assert_eq!(a.stats().window_hits, hits + 1, "served by the window");
    assert!(reaches(&a, 1, w) && reaches(&a, 1, p));
}

#[test]
fn refused_peers_and_driver_failures_add_no_peer_and_lose_nothing() {
    let a = Allocator::new(opts(false)).unwrap();
    let live: Vec<u64> = (1..6).map(|i| a.malloc(i * PAGE).unwrap()).collect();
    for bad in [0, 8, -1] {
        match a.enable_peer_access(bad) {
            Err(Error::Driver(e)) => {
                assert_eq!(e.call, CallKind::PeerAccess, "{e}");
                assert!(e.message.contains(&format!("device {bad}")), "{e}");
            }
            other => panic!("peer {bad}: {other:?}"),
        }
    }
    assert!(a.peers().is_empty());

    a.driver().fail_nth(CallKind::PeerAccess, 1, None);
    assert!(
        matches!(a.enable_peer_access(1), Err(Error::Driver(e)) if e.call == CallKind::PeerAccess)
    );
    assert!(a.peers().is_empty());

    // The third re-grant fails: the peer is not added, and later maps do not name it.
    a.driver().fail_nth(CallKind::SetAccess, 3, None);
    match a.enable_peer_access(1) {
        Err(Error::Driver(e)) => assert_eq!(e.call, CallKind::SetAccess, "{e}"),
        other => panic!("{other:?}"),
    }
    assert!(a.peers().is_empty());
    let next = a.malloc(2 * PAGE).unwrap();
    assert!(!reaches(&a, 1, next), "a failed enable leaves later maps to this device alone");
    for &p in &live {
        a.write(p, &[7; 64]).unwrap();
    }
    a.check_invariants().unwrap();

    a.enable_peer_access(1).unwrap();
    assert_eq!(a.peers(), vec![1]);
    assert!(live.iter().chain([&next]).all(|&p| reaches(&a, 1, p)));
}

#[test]
fn an_enable_racing_requests_that_map_leaves_none_of_their_ranges_out() {
    for round in 0..20 {
        let o = Options { validate: false, ..opts(true) };
        let a =
            Arc::new(Allocator::new(Options { host_capacity: 4096 * PAGE as u64, ..o }).unwrap());
        let threads = 4;
        let start = Arc::new(Barrier::new(threads + 1));
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (a, start) = (a.clone(), start.clone());
                std::thread::spawn(move || {
                    let stream = StreamHandle(0);
                    let mut kept = Vec::new();
                    start.wait();
                    for i in 0..60 {
                        // Sizes that rarely repeat, so most requests map.
                        let n = PAGE * (1 + (i * 7 + t * 13) % 11) + 1;
                        let p = a.malloc_async(n, stream).unwrap();
                        if i % 3 == 0 {
                            kept.push(p);
                        } else {
                            a.free_async(p, stream).unwrap();
                        }
                    }
                    kept
                })
            })
            .collect();
        start.wait();
        std::thread::sleep(std::time::Duration::from_micros(200 * (round % 5)));
        a.enable_peer_access(4).unwrap();
        let kept: Vec<u64> = workers.into_iter().flat_map(|w| w.join().unwrap()).collect();
        for &p in &kept {
            assert!(reaches(&a, 4, p), "round {round}: allocation {p:#x} was left out");
        }
        a.check_invariants().unwrap();
    }
}
