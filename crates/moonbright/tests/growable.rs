//! Growable allocations on the host backend: growth in place with no copy and a fixed address,
//! growth within committed pages at no driver call, stream-ordered shrinking whose pages other
//! streams get only after the event, a shrunk tail taken back still mapped, release, bad input,
//! OOM under the cap, and driver failures at every call kind of a growth. The CUDA backend runs
//! the same cases when a GPU is present.

use moonbright::driver::{code, prelude::*};
use moonbright::{Allocator, BackendKind, CallKind, Error, Options, StreamHandle};
use moonbright_testkit::scenario::{stamp, verify};

const PAGE: usize = 64 << 10;

fn opts(background: bool) -> Options {
    Options {
        cap_fraction: 1.0,
        background,
        max_chunk_bytes: 4 * PAGE as u64,
        unmap_batch_ranges: 4,
        ..Options::host(64 * PAGE as u64, PAGE)
    }
}

fn host(a: &Allocator) -> &moonbright::driver::host::HostDriver {
    a.driver().inner().as_host().unwrap()
}

/// The allocator's books are consistent, and agree with the host backend's: chunk bytes and
/// mappings. A background worker's driver calls reach the books only when its pass commits
/// them, so with one running the two may differ for a moment: then they must agree within 5 s.
fn books_agree(a: &Allocator) {
    a.check_invariants().unwrap();
    if a.driver().inner().as_host().is_none() {
        return;
    }
    let start = std::time::Instant::now();
    loop {
        let s = a.stats();
        let host = (host(a).live_chunk_bytes(), host(a).mapping_count() as u64);
        let books = (s.reserved_bytes.current, s.mapped_handles.current);
        if host == books {
            return;
        }
        if !a.options().background || start.elapsed() > std::time::Duration::from_secs(30) {
            panic!("(chunk bytes, mappings): host backend {host:?}, books {books:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn mapping_calls(a: &Allocator) -> u64 {
    let c = a.stats().driver_calls;
    [CallKind::Create, CallKind::Map, CallKind::SetAccess, CallKind::Unmap, CallKind::Release]
        .iter()
        .map(|&k| c.get(k))
        .sum()
}

fn grows_in_place(a: &Allocator) {
    let page = a.page_size();
    let s = a.driver().create_stream().unwrap();
    let g = a.reserve_growable(40 * page).unwrap();
    let info = a.growable_info(g).unwrap();
    assert_eq!((info.base, info.capacity, info.size, info.committed), (g, 40 * page as u64, 0, 0));
    assert_eq!(a.stats().reserved_bytes.current, 0, "reserving capacity holds no memory");

    a.resize_async(g, 3 * page + 100, s).unwrap();
    stamp(a, g, 3 * page + 100, 7).unwrap();
    let committed = a.growable_info(g).unwrap().committed;
    assert!(committed >= 4 * page as u64);
    // Growing within the committed pages makes no driver call.
    let before = mapping_calls(a);
    a.resize_async(g, committed as usize, s).unwrap();
    assert_eq!(mapping_calls(a), before, "growth within committed pages called the driver");
    // Growing further maps at the end: same address, the old bytes untouched (nothing copied).
    for step in [9, 17, 33, 40] {
        a.resize_async(g, step * page, s).unwrap();
        let info = a.growable_info(g).unwrap();
        assert_eq!(info.base, g);
        assert_eq!(info.size, (step * page) as u64);
        assert!(verify(a, g, 3 * page + 100, 7).unwrap(), "data moved or was lost growing");
    }
    stamp(a, g + 33 * page as u64, 7 * page, 8).unwrap();
    assert_eq!(a.stats().allocated_bytes.current, 40 * page as u64);
    assert_eq!(a.stats().growable_committed_bytes.current, 40 * page as u64);
    books_agree(a);
    a.free_async(g, s).unwrap();
    assert_eq!(a.stats().growable_committed_bytes.current, 0);
    assert_eq!(a.stats().allocated_bytes.current, 0);
    a.flush().unwrap();
    books_agree(a);
}

fn bad_input_changes_nothing(a: &Allocator) {
    let page = a.page_size();
    let s = a.driver().create_stream().unwrap();
    let g = a.reserve_growable(8 * page).unwrap();
    a.resize_async(g, 2 * page, s).unwrap();
    let p = a.malloc(page).unwrap();
    let before = (a.stats().allocated_bytes, a.stats().reserved_bytes, a.growable_info(g));
    assert_eq!(
        a.resize_async(g, 8 * page + 1, s),
        Err(Error::BeyondCapacity {
            ptr: g,
            requested: 8 * page as u64 + 1,
            capacity: 8 * page as u64
        })
    );
    assert_eq!(a.resize_async(p, page, s), Err(Error::NotGrowable { ptr: p }));
    assert_eq!(a.resize_async(g + 256, page, s), Err(Error::NotGrowable { ptr: g + 256 }));
    assert_eq!(a.reserve_growable(0), Err(Error::ZeroSize));
    assert!(matches!(a.reserve_growable(usize::MAX), Err(Error::AddressSpaceExhausted { .. })));
    assert_eq!((a.stats().allocated_bytes, a.stats().reserved_bytes, a.growable_info(g)), before);
    a.free(g).unwrap();
    assert_eq!(a.resize_async(g, page, s), Err(Error::Released { ptr: g }));
    assert_eq!(a.free(g), Err(Error::DoubleFree { ptr: g }));
    assert_eq!(a.growable_info(g), None);
    a.free(p).unwrap();
    books_agree(a);
}

#[test]
fn host_grows_in_place() {
    grows_in_place(&Allocator::new(opts(false)).unwrap());
}

#[test]
fn host_background_grows_in_place() {
    grows_in_place(&Allocator::new(opts(true)).unwrap());
}

#[test]
fn host_bad_input_changes_nothing() {
    bad_input_changes_nothing(&Allocator::new(opts(false)).unwrap());
}

/// A CUDA allocator, with the GPU (held to the test's end); `None` without a GPU (see
/// `moonbright::testing`).
fn cuda() -> Option<(moonbright::testing::Gpu, Allocator)> {
    let gpu = moonbright::testing::gpu()?;
    let o = Options {
        backend: BackendKind::Cuda,
        cap_bytes: Some(2 << 30),
        validate: true,
        ..Options::default()
    };
    Some((gpu, Allocator::new(o).unwrap()))
}

#[test]
fn cuda_grows_in_place() {
    let Some((_gpu, a)) = cuda() else { return };
    grows_in_place(&a);
}

#[test]
fn cuda_bad_input_changes_nothing() {
    let Some((_gpu, a)) = cuda() else { return };
    bad_input_changes_nothing(&a);
}

#[test]
fn a_shrink_gives_pages_to_other_streams_only_after_its_event() {
    let a = Allocator::new(opts(false)).unwrap();
    let s: Vec<StreamHandle> = (0..2).map(|_| a.driver().create_stream().unwrap()).collect();
    let g = a.reserve_growable(64 * PAGE).unwrap();
    a.resize_async(g, 64 * PAGE, s[0]).unwrap();
    host(&a).hold_stream(s[0]);
    a.resize_async(g, 16 * PAGE, s[0]).unwrap();
    assert_eq!(a.growable_info(g).unwrap().committed, 16 * PAGE as u64);
    books_agree(&a);
    // The other stream cannot have the 48 pages while s0's earlier work may still use them.
    let e = a.malloc_async(48 * PAGE, s[1]).unwrap_err();
    assert!(matches!(e, Error::Driver(_) | Error::OutOfMemory { .. }), "{e}");
    books_agree(&a);
    host(&a).release_stream(s[0]);
    a.poll();
    let created = a.stats().driver_calls.get(CallKind::Create);
    let p = a.malloc_async(48 * PAGE, s[1]).unwrap();
    assert_eq!(a.stats().driver_calls.get(CallKind::Create), created, "new chunks were made");
    books_agree(&a);
    a.free_async(p, s[1]).unwrap();
    a.free_async(g, s[0]).unwrap();
}

#[test]
fn regrowing_takes_a_shrunk_tail_back_without_driver_calls() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = a.driver().create_stream().unwrap();
    let g = a.reserve_growable(32 * PAGE).unwrap();
    a.resize_async(g, 32 * PAGE, s).unwrap();
    stamp(&a, g, 8 * PAGE, 3).unwrap();
    a.resize_async(g, 8 * PAGE, s).unwrap();
    let before = mapping_calls(&a);
    a.resize_async(g, 32 * PAGE, s).unwrap();
    assert_eq!(mapping_calls(&a), before);
    assert!(a.stats().growable_reclaims >= 1);
    assert!(verify(&a, g, 8 * PAGE, 3).unwrap());
    books_agree(&a);
}

#[test]
fn regrowing_a_little_takes_back_only_what_it_needs() {
    // One-page chunks and a cap of 8 pages: the growable holds all of it, then shrinks to one.
    let a = Allocator::new(Options {
        cap_bytes: Some(8 * PAGE as u64),
        max_chunk_bytes: PAGE as u64,
        ..opts(false)
    })
    .unwrap();
    let s = a.driver().create_stream().unwrap();
    let g = a.reserve_growable(8 * PAGE).unwrap();
    a.resize_async(g, 8 * PAGE, s).unwrap();
    stamp(&a, g, PAGE, 4).unwrap();
    a.resize_async(g, PAGE, s).unwrap();
    // Growing by one page takes back one chunk of the old tail, still mapped, and no more.
    let before = mapping_calls(&a);
    a.resize_async(g, 2 * PAGE, s).unwrap();
    assert_eq!(mapping_calls(&a), before, "the page came back from the old tail");
    assert_eq!(a.growable_info(g).unwrap().committed, 2 * PAGE as u64);
    assert_eq!(a.stats().growable_reclaims, 1);
    books_agree(&a);
    // The other six pages are free for anyone.
    let p = a.malloc_async(6 * PAGE, s).unwrap();
    stamp(&a, p, 6 * PAGE, 5).unwrap();
    assert!(verify(&a, g, PAGE, 4).unwrap());
    books_agree(&a);
    a.free(p).unwrap();
    a.free(g).unwrap();
    books_agree(&a);
}

#[test]
fn regrowing_after_the_tail_went_elsewhere_maps_afresh() {
    let a = Allocator::new(opts(false)).unwrap();
    let g = a.reserve_growable(48 * PAGE).unwrap();
    a.resize(g, 48 * PAGE).unwrap();
    stamp(&a, g, 16 * PAGE, 5).unwrap();
    a.resize(g, 16 * PAGE).unwrap();
    // The 32 pages given back serve someone else (the cap is 64 pages) ...
    let p = a.malloc(48 * PAGE).unwrap();
    stamp(&a, p, 48 * PAGE, 6).unwrap();
    books_agree(&a);
    // ... so growing again must wait for them, then map at the old tail once it is unmapped.
    assert!(matches!(a.resize(g, 48 * PAGE), Err(Error::OutOfMemory { .. })));
    a.free(p).unwrap();
    a.resize(g, 48 * PAGE).unwrap();
    stamp(&a, g + 16 * PAGE as u64, 32 * PAGE, 7).unwrap();
    assert!(verify(&a, g, 16 * PAGE, 5).unwrap());
    books_agree(&a);
    a.free(g).unwrap();
    a.flush().unwrap();
    // The reservation goes once nothing in it is mapped.
    assert_eq!(
        a.stats().driver_calls.get(CallKind::FreeReservation),
        1,
        "the released growable's reservation was not freed"
    );
    books_agree(&a);
}

#[test]
fn growth_beyond_the_cap_is_out_of_memory_and_changes_nothing() {
    let a = Allocator::new(opts(false)).unwrap();
    let g = a.reserve_growable(256 * PAGE).unwrap();
    a.resize(g, 60 * PAGE).unwrap();
    let before = a.growable_info(g);
    assert!(matches!(a.resize(g, 65 * PAGE), Err(Error::OutOfMemory { .. })));
    assert_eq!(a.growable_info(g), before);
    assert_eq!(a.stats().num_ooms, 1);
    books_agree(&a);
}

#[test]
fn a_failed_growth_changes_nothing() {
    for kind in [CallKind::Create, CallKind::Map, CallKind::SetAccess] {
        for nth in 1..4 {
            let a = Allocator::new(opts(false)).unwrap();
            let g = a.reserve_growable(40 * PAGE).unwrap();
            a.resize(g, 3 * PAGE).unwrap();
            stamp(&a, g, 3 * PAGE, 1).unwrap();
            let before = a.growable_info(g);
            a.driver().fail_nth(kind, nth, Some(code::OUT_OF_MEMORY));
            match a.resize(g, 30 * PAGE) {
                Ok(()) => continue, // the failure fell on a call this growth did not make
                Err(_) => {
                    assert_eq!(a.growable_info(g), before, "{kind:?} #{nth}");
                    books_agree(&a);
                }
            }
            a.driver().clear_failures();
            a.resize(g, 30 * PAGE).unwrap();
            assert!(verify(&a, g, 3 * PAGE, 1).unwrap());
            books_agree(&a);
        }
    }
}

#[test]
fn growables_and_allocations_share_the_pool_across_threads() {
    let a = std::sync::Arc::new(Allocator::new(opts(true)).unwrap());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let s = a.driver().create_stream().unwrap();
                let g = a.reserve_growable(16 * PAGE).unwrap();
                for i in 0..200usize {
                    let len = (i * 7919 + t as usize * 104_729) % (12 * PAGE) + 1;
                    match a.resize_async(g, len, s) {
                        Ok(()) | Err(Error::OutOfMemory { .. }) => {}
                        Err(e) => panic!("resize: {e}"),
                    }
                    if let Ok(p) = a.malloc_async(len / 3 + 1, s) {
                        a.free_async(p, s).unwrap();
                    }
                }
                a.free_async(g, s).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    a.release_unused().unwrap();
    books_agree(&a);
    assert_eq!(a.stats().allocations.current, 0);
}

#[test]
fn a_shrink_whose_event_cannot_be_recorded_loses_nothing() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = a.driver().create_stream().unwrap();
    let g = a.reserve_growable(32 * PAGE).unwrap();
    a.resize_async(g, 32 * PAGE, s).unwrap();
    a.driver().fail_nth(CallKind::EventRecord, 1, None);
    a.resize_async(g, 4 * PAGE, s).unwrap();
    assert!(a.take_deferred_error().is_some(), "the failed record was not reported");
    books_agree(&a);
    // The next poll records the missing event; then the pages serve another request.
    a.poll();
    a.poll();
    let created = a.stats().driver_calls.get(CallKind::Create);
    let p = a.malloc(28 * PAGE).unwrap();
    assert_eq!(a.stats().driver_calls.get(CallKind::Create), created);
    a.free(p).unwrap();
    a.free_async(g, s).unwrap();
    books_agree(&a);
}

#[test]
fn the_shrinking_stream_reuses_the_pages_at_once() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = a.driver().create_stream().unwrap();
    let g = a.reserve_growable(64 * PAGE).unwrap();
    a.resize_async(g, 64 * PAGE, s).unwrap();
    host(&a).hold_stream(s);
    a.resize_async(g, 16 * PAGE, s).unwrap();
    let created = a.stats().driver_calls.get(CallKind::Create);
    let p = a.malloc_async(48 * PAGE, s).unwrap();
    assert_eq!(a.stats().driver_calls.get(CallKind::Create), created, "new chunks were made");
    books_agree(&a);
    host(&a).release_stream(s);
    a.free_async(p, s).unwrap();
    a.free_async(g, s).unwrap();
    a.poll();
    books_agree(&a);
}

#[test]
fn concurrent_resizes_of_one_growable_wait_their_turn() {
    let a = std::sync::Arc::new(Allocator::new(opts(true)).unwrap());
    let g = a.reserve_growable(48 * PAGE).unwrap();
    let threads: Vec<_> = (0..4usize)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let s = a.driver().create_stream().unwrap();
                for i in 0..300usize {
                    let len = (i * 7919 + t * 104_729) % (48 * PAGE) + 1;
                    a.resize_async(g, len, s).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    a.check_invariants().unwrap();
    let info = a.growable_info(g).unwrap();
    assert!(info.committed >= info.size);
    a.free(g).unwrap();
    a.release_unused().unwrap();
    books_agree(&a);
}

#[test]
fn resizing_on_a_capturing_stream_is_refused_and_changes_nothing() {
    let a = Allocator::new(opts(false)).unwrap();
    let s = a.driver().create_stream().unwrap();
    let g = a.reserve_growable(16 * PAGE).unwrap();
    a.resize_async(g, 4 * PAGE, s).unwrap();
    let before = a.growable_info(g);
    host(&a).begin_capture(s);
    assert_eq!(a.resize_async(g, 8 * PAGE, s), Err(Error::StreamCapture { stream: s.0 }));
    assert_eq!(a.resize_async(g, PAGE, s), Err(Error::StreamCapture { stream: s.0 }));
    assert_eq!(a.growable_info(g), before);
    host(&a).end_capture(s);
    a.resize_async(g, 8 * PAGE, s).unwrap();
    books_agree(&a);
}

/// A growth short of memory reports OOM at once even when a carved arena's free pages could
/// hold it: a growable takes no arena space, so waiting for it would never end (it waited
/// 10 s, then failed as a driver error, before the fix).
#[test]
fn a_growth_short_of_memory_does_not_wait_for_carved_space() {
    let a = Allocator::new(Options { carve: 1.0, carve_repeated: 0.0, ..opts(false) }).unwrap();
    let big = a.malloc(60 * PAGE).unwrap();
    a.free(big).unwrap();
    // Thirty pages carved out of the last eight chunks: two pages of them stay free.
    let keep = a.malloc(30 * PAGE).unwrap();
    assert_eq!(a.stats().carved_arenas, 1);
    // The other 28 cached pages and the last 4 under the cap.
    let fill = a.malloc(32 * PAGE).unwrap();
    let g = a.reserve_growable(8 * PAGE).unwrap();
    let t = std::time::Instant::now();
    assert!(matches!(a.resize(g, 2 * PAGE), Err(Error::OutOfMemory { .. })));
    assert!(t.elapsed() < std::time::Duration::from_secs(2), "waited {:?}", t.elapsed());
    books_agree(&a);
    for p in [keep, fill, g] {
        a.free(p).unwrap();
    }
    books_agree(&a);
}
