//! The C API driven through its Rust-visible `extern "C"` functions on the host backend: the
//! happy path, every status a call can return, and the per-thread last error.

use std::ffi::CStr;
use std::ptr;

use moonbright_capi::*;

const MIB: u64 = 1 << 20;

fn host_options() -> mb_options {
    let mut o = mb_options::default();
    // SAFETY: `o` is a live local.
    unsafe { mb_options_default(&mut o) };
    o.backend = MB_BACKEND_HOST;
    o.host_capacity = 256 * MIB;
    o.host_page_size = 64 << 10;
    o
}

/// A host allocator without the background worker, whose window would move held memory on its
/// own time: for tests that compare held bytes before and after a call.
fn create_quiet_host() -> *mut mb_allocator {
    let conf = c"backend:host,host_capacity:256MiB,host_page_size:64KiB,background:false";
    let mut a = ptr::null_mut();
    // SAFETY: `conf` is NUL-terminated; `a` is a live local.
    assert_eq!(unsafe { mb_create_conf(conf.as_ptr(), &mut a) }, MB_OK, "{}", last_error());
    a
}

fn create(o: &mb_options) -> *mut mb_allocator {
    let mut a = ptr::null_mut();
    // SAFETY: `o` and `a` are live locals.
    assert_eq!(unsafe { mb_create(o, &mut a) }, MB_OK, "{}", last_error());
    assert!(!a.is_null());
    a
}

fn last_error() -> String {
    // SAFETY: `mb_last_error` returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mb_last_error()) }.to_str().unwrap().to_owned()
}

fn stats(a: *mut mb_allocator) -> mb_stats {
    let mut s = mb_stats::default();
    // SAFETY: `a` is a live handle (the caller's), `s` a live local.
    assert_eq!(unsafe { mb_get_stats(a, &mut s) }, MB_OK, "{}", last_error());
    s
}

#[test]
fn create_malloc_free_stats_destroy() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let a = create(&host_options());
        let sizes = [100usize, 64 << 10, 3 << 20];
        let mut ptrs = Vec::new();
        for &size in &sizes {
            let mut p = 0u64;
            assert_eq!(mb_malloc(a, size, &mut p), MB_OK, "{}", last_error());
            assert_ne!(p, 0);
            assert_eq!(p % 256, 0);
            ptrs.push(p);
        }
        let s = stats(a);
        assert_eq!(s.allocations.current, 3);
        assert_eq!(s.allocated_bytes.current, sizes.iter().sum::<usize>() as u64);
        assert!(s.active_bytes.current >= s.allocated_bytes.current);
        assert_eq!(
            s.rounding_waste_bytes.current,
            s.active_bytes.current - s.allocated_bytes.current
        );
        assert!(s.reserved_bytes.current >= s.active_bytes.current);
        assert!(s.map_calls > 0 && s.create_calls > 0 && s.reserve_calls > 0);
        assert!(s.set_access_calls > 0);

        let mut page = 0;
        assert_eq!(mb_get_page_size(a, &mut page), MB_OK);
        assert_eq!(page, 64 << 10);
        let mut cap = 0;
        assert_eq!(mb_get_cap(a, &mut cap), MB_OK);
        assert!(cap > 0 && cap <= 256 * MIB && cap % page == 0);

        for &p in &ptrs {
            assert_eq!(mb_free(a, p), MB_OK, "{}", last_error());
        }
        let s = stats(a);
        assert_eq!(s.allocations.current, 0);
        assert_eq!(s.allocations.peak, 3);
        assert_eq!(s.allocations.allocated, 3);
        assert_eq!(s.allocations.freed, 3);
        assert_eq!(s.allocated_bytes.current, 0);

        assert_eq!(mb_flush(a), MB_OK);
        let mut released = u64::MAX;
        assert_eq!(mb_release_unused(a, &mut released), MB_OK, "{}", last_error());
        assert_eq!(stats(a).reserved_bytes.current, 0);
        assert!(released > 0);
        assert_eq!(mb_release_unused(a, ptr::null_mut()), MB_OK);

        // The waiting variant gives back the same (its waits are the Rust tests').
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, 3 * MIB as usize, &mut p), MB_OK);
        assert_eq!(mb_free(a, p), MB_OK);
        assert!(stats(a).reserved_bytes.current >= 3 * MIB);
        let mut released = 0;
        assert_eq!(mb_empty_cache(a, &mut released), MB_OK, "{}", last_error());
        assert!(released >= 3 * MIB, "{released}");
        assert_eq!(stats(a).reserved_bytes.current, 0);
        assert_eq!(mb_empty_cache(a, ptr::null_mut()), MB_OK);
        assert_eq!(mb_destroy(a), MB_OK);
        assert_eq!(last_error(), "");
    }
}

#[test]
fn destroy_frees_what_is_still_live() {
    // SAFETY: `a` is a live handle until `mb_destroy`; `p` is a live local.
    unsafe {
        let a = create(&host_options());
        for size in [100usize, 64 << 10, 3 << 20] {
            let mut p = 0u64;
            assert_eq!(mb_malloc(a, size, &mut p), MB_OK, "{}", last_error());
        }
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, 5 << 20, &mut p), MB_OK);
        assert_eq!(mb_free(a, p), MB_OK);
        assert_eq!(mb_destroy(a), MB_OK, "{}", last_error());
    }
}

#[test]
fn defaults_are_written_out() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let mut o = mb_options { backend: 9, device: 9, cap_bytes: 9, ..Default::default() };
        mb_options_default(&mut o);
        assert_eq!(o.backend, MB_BACKEND_AUTO);
        assert_eq!(o.device, 0);
        assert_eq!(o.cap_bytes, 0);
        assert_eq!(o.host_page_size, 2 * MIB);
        assert!(o.host_capacity > 0 && o.max_chunk_bytes > 0 && o.unmap_batch_ranges > 0);
        // NULL is ignored.
        mb_options_default(ptr::null_mut());
    }
}

#[test]
fn null_arguments_are_invalid() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let a = create(&host_options());
        let mut p = 0u64;
        let mut s = mb_stats::default();
        let mut n = 0u64;
        let cases: Vec<(&str, i32)> = vec![
            ("out", mb_create(&host_options(), ptr::null_mut())),
            ("alloc", mb_malloc(ptr::null_mut(), 16, &mut p)),
            ("out_ptr", mb_malloc(a, 16, ptr::null_mut())),
            ("alloc", mb_free(ptr::null_mut(), 0x1000)),
            ("alloc", mb_release_unused(ptr::null_mut(), &mut n)),
            ("alloc", mb_empty_cache(ptr::null_mut(), &mut n)),
            ("alloc", mb_flush(ptr::null_mut())),
            ("alloc", mb_get_stats(ptr::null_mut(), &mut s)),
            ("out", mb_get_stats(a, ptr::null_mut())),
            ("alloc", mb_get_cap(ptr::null_mut(), &mut n)),
            ("out_bytes", mb_get_cap(a, ptr::null_mut())),
            ("alloc", mb_get_page_size(ptr::null_mut(), &mut n)),
            ("out_bytes", mb_get_page_size(a, ptr::null_mut())),
        ];
        for (i, (arg, status)) in cases.into_iter().enumerate() {
            assert_eq!(status, MB_ERR_INVALID_ARGUMENT, "case {i}");
            let _ = arg;
        }
        // Messages name the argument.
        assert_eq!(mb_malloc(a, 16, ptr::null_mut()), MB_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("`out_ptr` is NULL"), "{}", last_error());
        assert_eq!(mb_create(ptr::null(), ptr::null_mut()), MB_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("`out`"), "{}", last_error());
        // Outputs are left alone on failure.
        assert_eq!(mb_malloc(a, 0, &mut p), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(p, 0);
        assert_eq!(mb_destroy(ptr::null_mut()), MB_OK);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn size_zero_is_invalid() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let a = create(&host_options());
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, 0, &mut p), MB_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("0 bytes"), "{}", last_error());
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn size_over_the_cap_is_too_large() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let a = create(&host_options());
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, (1u64 << 30) as usize, &mut p), MB_ERR_TOO_LARGE);
        assert!(last_error().contains("larger than the cap"), "{}", last_error());
        assert_eq!(mb_malloc(a, usize::MAX, &mut p), MB_ERR_TOO_LARGE);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn exhausting_memory_is_out_of_memory() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let a = create(&host_options());
        let mut ptrs = Vec::new();
        let status = loop {
            let mut p = 0u64;
            match mb_malloc(a, (64 * MIB) as usize, &mut p) {
                MB_OK => ptrs.push(p),
                other => break other,
            }
            assert!(ptrs.len() < 8, "256 MiB of memory took more than 8 allocations of 64 MiB");
        };
        assert_eq!(status, MB_ERR_OUT_OF_MEMORY, "{}", last_error());
        assert!(last_error().contains("out of memory"), "{}", last_error());
        assert_eq!(ptrs.len(), 3);
        assert_eq!(stats(a).num_ooms, 1);
        // Freeing one makes room again.
        assert_eq!(mb_free(a, ptrs.pop().unwrap()), MB_OK);
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, (64 * MIB) as usize, &mut p), MB_OK, "{}", last_error());
        ptrs.push(p);
        for p in ptrs {
            assert_eq!(mb_free(a, p), MB_OK);
        }
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn bad_frees_are_invalid_pointers() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let a = create(&host_options());
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, 1 << 20, &mut p), MB_OK);
        assert_eq!(mb_free(a, p + 4096), MB_ERR_INVALID_POINTER);
        assert!(last_error().contains("into the live allocation"), "{}", last_error());
        assert_eq!(mb_free(a, 0xdead_0000), MB_ERR_INVALID_POINTER);
        assert_eq!(mb_free(a, p), MB_OK);
        assert_eq!(mb_free(a, p), MB_ERR_INVALID_POINTER);
        assert!(!last_error().is_empty());
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn bad_options_are_invalid_arguments_that_name_the_option() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let cases: Vec<(&str, mb_options)> = vec![
            ("host_page_size", mb_options { host_page_size: 3 * MIB, ..host_options() }),
            ("host_page_size", mb_options { host_page_size: 1024, ..host_options() }),
            ("host_capacity", mb_options { host_capacity: 1, ..host_options() }),
            ("max_chunk_bytes", mb_options { max_chunk_bytes: 3 * MIB, ..host_options() }),
            ("device", mb_options { device: -1, ..host_options() }),
            ("backend", mb_options { backend: 3, ..host_options() }),
            ("backend", mb_options { backend: -1, ..host_options() }),
        ];
        for (name, o) in cases {
            let mut a = ptr::null_mut();
            assert_eq!(mb_create(&o, &mut a), MB_ERR_INVALID_ARGUMENT, "{name}");
            assert!(a.is_null());
            let msg = last_error();
            assert!(msg.contains(&format!("`{name}`")), "{name}: {msg}");
        }
    }
}

#[test]
fn a_cap_below_a_page_is_invalid() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let o = mb_options { cap_bytes: 1000, ..host_options() };
        let mut a = ptr::null_mut();
        assert_eq!(mb_create(&o, &mut a), MB_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("`cap`"), "{}", last_error());
        let o = mb_options { cap_bytes: 32 * MIB, ..host_options() };
        let a = create(&o);
        let mut cap = 0;
        assert_eq!(mb_get_cap(a, &mut cap), MB_OK);
        assert_eq!(cap, 32 * MIB);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn last_error_is_per_thread() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        let a = create(&host_options());
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, 0, &mut p), MB_ERR_INVALID_ARGUMENT);
        let here = last_error();
        assert!(here.contains("0 bytes"));
        let there = std::thread::spawn(|| {
            let before = last_error();
            assert_eq!(mb_flush(ptr::null_mut()), MB_ERR_INVALID_ARGUMENT);
            (before, last_error())
        })
        .join()
        .unwrap();
        assert_eq!(there.0, "", "a new thread starts with no error");
        assert!(there.1.contains("`alloc` is NULL"), "{}", there.1);
        assert_eq!(last_error(), here, "another thread's failure leaves this one's error");
        // A successful call clears it.
        assert_eq!(mb_flush(a), MB_OK);
        assert_eq!(last_error(), "");
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn one_allocator_serves_many_threads() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; strings come from `mb_*` functions.
    unsafe {
        struct Handle(*mut mb_allocator);
        // SAFETY: an `mb_allocator` may be used from any thread (`Allocator` is `Send + Sync`).
        unsafe impl Send for Handle {}
        // SAFETY: as above.
        unsafe impl Sync for Handle {}
        let a = Handle(create(&host_options()));
        std::thread::scope(|s| {
            for t in 0..4usize {
                let a = &a;
                s.spawn(move || {
                    for i in 0..50usize {
                        let mut p = 0u64;
                        assert_eq!(mb_malloc(a.0, 1000 + 4096 * (t + i), &mut p), MB_OK);
                        assert_eq!(mb_free(a.0, p), MB_OK);
                    }
                });
            }
        });
        assert_eq!(stats(a.0).allocations.allocated, 200);
        assert_eq!(mb_destroy(a.0), MB_OK);
    }
}

#[test]
fn strings() {
    // SAFETY: both return static NUL-terminated strings.
    let version = unsafe { CStr::from_ptr(mb_version()) }.to_str().unwrap();
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
    let statuses = [
        MB_OK,
        MB_ERR_INVALID_ARGUMENT,
        MB_ERR_OUT_OF_MEMORY,
        MB_ERR_TOO_LARGE,
        MB_ERR_INVALID_POINTER,
        MB_ERR_DRIVER,
        MB_ERR_NO_BACKEND,
        MB_ERR_INTERNAL,
    ];
    let mut seen = std::collections::HashSet::new();
    for s in statuses {
        // SAFETY: as above.
        let text = unsafe { CStr::from_ptr(mb_status_string(s)) }.to_str().unwrap();
        assert!(!text.is_empty() && text != "unknown status", "{s}");
        assert!(seen.insert(text), "{text} twice");
    }
    // SAFETY: as above.
    let unknown = unsafe { CStr::from_ptr(mb_status_string(99)) }.to_str().unwrap();
    assert_eq!(unknown, "unknown status");
}

#[test]
fn stream_ordered_malloc_and_free() {
    let a = create(&host_options());
    let mut p = 0u64;
    // SAFETY: `a` is live, `p` a live local; a NULL stream is the default stream.
    let st = unsafe { mb_malloc_async(a, 3 << 20, std::ptr::null_mut(), &mut p) };
    assert_eq!(st, MB_OK, "{}", last_error());
    assert!(p != 0 && p % 256 == 0);
    // SAFETY: as above.
    assert_eq!(unsafe { mb_free_async(a, p, std::ptr::null_mut()) }, MB_OK, "{}", last_error());
    // A second free of the same pointer is refused, stream-ordered or not.
    // SAFETY: as above.
    assert_eq!(unsafe { mb_free_async(a, p, std::ptr::null_mut()) }, MB_ERR_INVALID_POINTER);
    // SAFETY: as above; a NULL out-pointer is refused, not written.
    let st = unsafe { mb_malloc_async(a, 100, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(st, MB_ERR_INVALID_ARGUMENT);
    // SAFETY: `a` came from `mb_create` and is destroyed once.
    assert_eq!(unsafe { mb_destroy(a) }, MB_OK);
}

#[test]
fn record_stream_statuses() {
    let a = create(&host_options());
    let null = std::ptr::null_mut();
    let (mut p, mut g) = (0u64, 0u64);
    // SAFETY: `a` is live, `p` and `g` live locals; a NULL stream is the default stream.
    unsafe {
        assert_eq!(mb_malloc_async(a, 3 << 20, null, &mut p), MB_OK, "{}", last_error());
        assert_eq!(mb_record_stream(a, p, null), MB_OK, "{}", last_error());
        assert_eq!(mb_record_stream(a, p + 256, null), MB_ERR_INVALID_POINTER);
        assert!(last_error().contains("into the live allocation"), "{}", last_error());
        assert_eq!(mb_record_stream(std::ptr::null_mut(), p, null), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_reserve_growable(a, 8 << 20, &mut g), MB_OK, "{}", last_error());
        assert_eq!(mb_record_stream(a, g, null), MB_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("growable"), "{}", last_error());
        assert_eq!(mb_free(a, g), MB_OK);
        // Recorded on the stream it is freed on: an ordinary stream-ordered free.
        assert_eq!(mb_free_async(a, p, null), MB_OK, "{}", last_error());
        assert_eq!(mb_record_stream(a, p, null), MB_ERR_INVALID_POINTER, "freed already");
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn set_cap_statuses() {
    let a = create(&host_options());
    let (mut cap, mut page, mut p) = (0u64, 0u64, 0u64);
    // SAFETY: `a` is live, the outputs are live locals or NULL.
    unsafe {
        assert_eq!(mb_get_page_size(a, &mut page), MB_OK);
        assert_eq!(mb_set_cap(a, 4 * page + 1, &mut cap), MB_OK, "{}", last_error());
        assert_eq!(cap, 4 * page);
        assert_eq!(mb_malloc(a, 5 * page as usize, &mut p), MB_ERR_TOO_LARGE);
        assert_eq!(mb_set_cap(a, page - 1, &mut cap), MB_OK);
        assert_eq!(cap, 0, "below a page is 0");
        assert_eq!(mb_malloc(a, 1, &mut p), MB_ERR_TOO_LARGE);
        assert!(last_error().contains("cap"), "{}", last_error());
        assert_eq!(mb_set_cap(a, u64::MAX, std::ptr::null_mut()), MB_OK, "the device's memory");
        assert_eq!(mb_malloc(a, 5 * page as usize, &mut p), MB_OK, "{}", last_error());
        assert_eq!(mb_set_cap(std::ptr::null_mut(), page, &mut cap), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn enable_peer_access_statuses() {
    let a = create(&host_options());
    let mut p = 0u64;
    // SAFETY: `a` is live, the outputs are live locals or NULL.
    unsafe {
        assert_eq!(mb_malloc(a, 3 << 16, &mut p), MB_OK);
        assert_eq!(mb_enable_peer_access(a, 1), MB_OK, "{}", last_error());
        assert_eq!(mb_enable_peer_access(a, 1), MB_OK, "twice");
        // The host backend is device 0 and models devices 0..8.
        assert_eq!(mb_enable_peer_access(a, 0), MB_ERR_DRIVER);
        assert!(last_error().contains("peer"), "{}", last_error());
        assert_eq!(mb_enable_peer_access(a, 99), MB_ERR_DRIVER);
        assert_eq!(mb_enable_peer_access(std::ptr::null_mut(), 1), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_free(a, p), MB_OK);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn growable_reserve_resize_info_release() {
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`.
    unsafe {
        let a = create(&host_options());
        let page = 64u64 << 10;
        let mut g = 0u64;
        assert_eq!(mb_reserve_growable(a, (40 * page) as usize, &mut g), MB_OK, "{}", last_error());
        assert_eq!(stats(a).reserved_bytes.current, 0);
        assert_eq!(mb_resize_async(a, g, (3 * page + 1) as usize, ptr::null_mut()), MB_OK);
        let mut info = mb_growable_info::default();
        assert_eq!(mb_get_growable_info(a, g, &mut info), MB_OK);
        assert_eq!((info.base, info.capacity, info.size), (g, 40 * page, 3 * page + 1));
        assert!(info.committed >= 4 * page);
        assert_eq!(stats(a).growable_committed_bytes.current, info.committed);
        assert_eq!(mb_resize(a, g, (40 * page + 1) as usize), MB_ERR_TOO_LARGE);
        assert!(last_error().contains("capacity"), "{}", last_error());
        assert_eq!(mb_resize(a, g, page as usize), MB_OK);
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, 100, &mut p), MB_OK);
        assert_eq!(mb_resize(a, p, 100), MB_ERR_INVALID_POINTER);
        assert_eq!(mb_get_growable_info(a, p, &mut info), MB_ERR_INVALID_POINTER);
        assert_eq!(mb_get_growable_info(a, g, ptr::null_mut()), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_reserve_growable(a, 0, &mut g), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_free_async(a, g, ptr::null_mut()), MB_OK);
        assert_eq!(mb_resize(a, g, page as usize), MB_ERR_INVALID_POINTER);
        assert!(last_error().contains("released"), "{}", last_error());
        assert_eq!(mb_free(a, p), MB_OK);
        assert_eq!(stats(a).growable_committed_bytes.current, 0);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn graph_pool_calls_that_match_no_capture_are_refused() {
    // SAFETY: `a` is a live handle from `mb_create`, destroyed once; NULL where meant.
    unsafe {
        let a = create(&host_options());
        let s = ptr::null_mut();
        assert_eq!(mb_begin_graph_capture(a, s, 0, 1), MB_ERR_STREAM_CAPTURE);
        assert!(last_error().contains("not being captured"), "{}", last_error());
        assert_eq!(mb_end_graph_capture(a, s), MB_ERR_STREAM_CAPTURE);
        assert_eq!(mb_release_graph_pool(a, 0, 1), MB_ERR_STREAM_CAPTURE);
        assert_eq!(mb_graph_replayed(a, 0, 1, s), MB_OK);
        assert_eq!(mb_begin_graph_capture(ptr::null_mut(), s, 0, 1), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_capture_starting(a), MB_OK);
        assert_eq!(mb_capture_finished(a), MB_OK);
        assert_eq!(mb_capture_finished(a), MB_OK, "an extra finish is ignored");
        assert_eq!(mb_capture_starting(ptr::null_mut()), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_capture_finished(ptr::null_mut()), MB_ERR_INVALID_ARGUMENT);
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, 100, &mut p), MB_OK, "the allocator still works");
        assert_eq!(mb_free(a, p), MB_OK);
        mb_destroy(a);
    }
}

#[test]
fn a_routed_thread_fills_a_graph_pool_whose_live_set_is_read_and_set_back() {
    // SAFETY: `a` is a live handle from `mb_create`, destroyed once; NULL where meant; the
    // buffers passed are as long as the counts given.
    unsafe {
        let a = create(&host_options());
        let s = ptr::null_mut();
        assert_eq!(mb_end_allocate_to_pool(a), MB_ERR_STREAM_CAPTURE, "no route");
        assert_eq!(mb_begin_allocate_to_pool(a, 0, 5), MB_OK);
        assert_eq!(mb_begin_allocate_to_pool(a, 0, 5), MB_ERR_STREAM_CAPTURE, "routed already");
        let (mut p, mut q, mut r) = (0u64, 0u64, 0u64);
        assert_eq!(mb_malloc_async(a, 3 << 20, s, &mut p), MB_OK);
        assert_eq!(mb_malloc_async(a, 1000, s, &mut q), MB_OK);
        assert_eq!(mb_end_allocate_to_pool(a), MB_OK);
        assert_eq!(mb_malloc_async(a, 1000, s, &mut r), MB_OK);

        let mut count = 0usize;
        assert_eq!(mb_graph_pool_live(a, 0, 5, ptr::null_mut(), 0, &mut count), MB_OK);
        assert_eq!(count, 2, "the routed requests only");
        let mut state = [0u64; 2];
        assert_eq!(mb_graph_pool_live(a, 0, 5, state.as_mut_ptr(), 2, &mut count), MB_OK);
        let mut expected = [p, q];
        expected.sort_unstable();
        assert_eq!(state, expected);
        assert_eq!(
            mb_graph_pool_live(a, 0, 5, ptr::null_mut(), 1, &mut count),
            MB_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            mb_graph_pool_live(a, 0, 5, ptr::null_mut(), 0, ptr::null_mut()),
            MB_ERR_INVALID_ARGUMENT
        );

        assert_eq!(mb_free_async(a, q, s), MB_OK);
        assert_eq!(mb_graph_pool_live(a, 0, 5, ptr::null_mut(), 0, &mut count), MB_OK);
        assert_eq!(count, 1);
        assert_eq!(mb_set_graph_pool_live(a, 0, 5, state.as_ptr(), 2, s), MB_OK);
        assert_eq!(mb_graph_pool_live(a, 0, 5, ptr::null_mut(), 0, &mut count), MB_OK);
        assert_eq!(count, 2, "q is live again");
        let bad = [p, r];
        assert_eq!(mb_set_graph_pool_live(a, 0, 5, bad.as_ptr(), 2, s), MB_ERR_STREAM_CAPTURE);
        assert!(last_error().contains("not a block of pool"), "{}", last_error());
        assert_eq!(mb_set_graph_pool_live(a, 0, 5, ptr::null(), 1, s), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_set_graph_pool_live(a, 0, 5, ptr::null(), 0, s), MB_OK, "none live");
        assert_eq!(mb_graph_pool_live(a, 0, 5, ptr::null_mut(), 0, &mut count), MB_OK);
        assert_eq!(count, 0);
        assert_eq!(mb_free_async(a, q, s), MB_ERR_INVALID_POINTER, "q is the pool's free block");

        assert_eq!(mb_release_graph_pool(a, 0, 5), MB_OK, "the route's use: the pool goes back");
        assert_eq!(mb_free_async(a, r, s), MB_OK);
        let mut st = std::mem::zeroed::<mb_stats>();
        assert_eq!(mb_get_stats(a, &mut st), MB_OK);
        assert_eq!(st.allocations.current, 0);
        assert_eq!(mb_begin_allocate_to_pool(ptr::null_mut(), 0, 5), MB_ERR_INVALID_ARGUMENT);
        mb_destroy(a);
    }
}

#[test]
fn ipc_send_recv_close_and_their_statuses() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    // SAFETY: every pointer passed is NULL where the test means it, else points to a live
    // local or is a live handle from `mb_create`; the descriptors are the live sockets'.
    unsafe {
        let a = create(&host_options());
        let b = create(&host_options());
        let (x, y) = UnixStream::pair().unwrap();
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, 3 << 20, &mut p), MB_OK, "{}", last_error());
        assert_eq!(mb_ipc_send(a, p, x.as_raw_fd()), MB_OK, "{}", last_error());
        let (mut q, mut size) = (0u64, 0u64);
        assert_eq!(mb_ipc_recv(b, y.as_raw_fd(), &mut q, &mut size), MB_OK, "{}", last_error());
        assert_eq!(size, 3 << 20);
        assert_ne!(q, 0);
        assert_eq!(stats(b).allocations.current, 0, "an import is not the importer's");
        assert_eq!(mb_ipc_close(b, q), MB_OK, "{}", last_error());
        assert_eq!(mb_ipc_close(b, q), MB_ERR_IPC);
        assert!(last_error().contains("not an import"), "{}", last_error());

        assert_eq!(mb_ipc_send(a, 0xdead_0000, x.as_raw_fd()), MB_ERR_INVALID_POINTER);
        assert_eq!(mb_ipc_send(a, p, -1), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_ipc_send(ptr::null_mut(), p, x.as_raw_fd()), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(
            mb_ipc_recv(b, y.as_raw_fd(), ptr::null_mut(), &mut size),
            MB_ERR_INVALID_ARGUMENT
        );
        assert_eq!(mb_ipc_recv(b, y.as_raw_fd(), &mut q, ptr::null_mut()), MB_ERR_INVALID_ARGUMENT);
        (&x).write_all(b"not an export, not at all").unwrap();
        assert_eq!(mb_ipc_recv(b, y.as_raw_fd(), &mut q, &mut size), MB_ERR_IPC);
        assert!(last_error().contains("malformed"), "{}", last_error());
        drop(x);
        assert_eq!(mb_ipc_recv(b, y.as_raw_fd(), &mut q, &mut size), MB_ERR_IPC);
        assert_eq!(mb_free(a, p), MB_OK);
        assert_eq!(mb_destroy(b), MB_OK);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

/// Allocates `sizes` on `a` with the thread's tag `tag`, each filled with a pattern of its own
/// (written through the core allocator: the C API leaves copies to the CUDA runtime).
fn tagged(a: *mut mb_allocator, tag: &CStr, sizes: &[usize]) -> Vec<(u64, Vec<u8>)> {
    let mut previous = u32::MAX;
    // SAFETY: `a` is a live handle (the caller's); `tag` is NUL-terminated; the outputs are
    // live locals.
    unsafe {
        assert_eq!(mb_tag_begin(tag.as_ptr(), &mut previous), MB_OK, "{}", last_error());
        let blocks = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let mut p = 0u64;
                assert_eq!(mb_malloc(a, size, &mut p), MB_OK, "{}", last_error());
                let bytes: Vec<u8> = (0..size).map(|j| (j * 7 + i * 13 + 1) as u8).collect();
                (*a).allocator().write(p, &bytes).unwrap();
                (p, bytes)
            })
            .collect();
        assert_eq!(mb_tag_end(previous), MB_OK);
        blocks
    }
}

fn intact(a: *mut mb_allocator, blocks: &[(u64, Vec<u8>)]) -> bool {
    blocks.iter().all(|(p, bytes)| {
        let mut back = vec![0u8; bytes.len()];
        // SAFETY: `a` is a live handle (the caller's).
        unsafe { (*a).allocator() }.read(*p, &mut back).unwrap();
        &back == bytes
    })
}

/// Sizes below a page (sharing the tag's sub-page arena), of a page, and of several.
const TAGGED_SIZES: [usize; 4] = [1000, 40 << 10, 64 << 10, (3 << 20) + 512];

#[test]
fn tags_nest_and_end_in_reverse_order() {
    let (mut outer, mut inner) = (u32::MAX, u32::MAX);
    // SAFETY: the names are NUL-terminated; the outputs are live locals.
    unsafe {
        assert_eq!(mb_tag_begin(c"capi-nest-outer".as_ptr(), &mut outer), MB_OK);
        assert_eq!(outer, 0, "no tag before");
        assert_eq!(mb_tag_begin(c"capi-nest-inner".as_ptr(), &mut inner), MB_OK);
        assert_ne!(inner, 0, "the outer tag was in effect");
        assert_eq!(moonbright::tags::current_name().as_deref(), Some("capi-nest-inner"));
        assert_eq!(mb_tag_end(inner), MB_OK);
        assert_eq!(moonbright::tags::current_name().as_deref(), Some("capi-nest-outer"));
        assert_eq!(mb_tag_end(outer), MB_OK);
        assert_eq!(moonbright::tags::current_name(), None);
        assert_eq!(last_error(), "");
    }
}

#[test]
fn a_backed_up_tag_wakes_with_its_bytes_at_its_addresses() {
    let a = create_quiet_host();
    let weights = tagged(a, c"capi-sleep-weights", &TAGGED_SIZES);
    let other = tagged(a, c"capi-sleep-other", &TAGGED_SIZES);
    let mut untagged = 0u64;
    // SAFETY: `a` is live; the names are NUL-terminated; the outputs are live locals or NULL.
    unsafe {
        assert_eq!(mb_malloc(a, 2 << 20, &mut untagged), MB_OK);
        let reserved = stats(a).reserved_bytes.current;
        let mut slept = mb_sleep_report { bytes: 1, ..Default::default() };
        let st = mb_sleep(a, c"capi-sleep-weights".as_ptr(), MB_BACKUP_HOST, &mut slept);
        assert_eq!(st, MB_OK, "{}", last_error());
        assert!(slept.bytes >= TAGGED_SIZES.iter().sum::<usize>() as u64, "{slept:?}");
        assert_eq!(slept.backed_up, slept.bytes);
        assert_eq!(slept.released, slept.bytes, "every chunk went back to the driver");
        assert!(slept.seconds >= 0.0);
        let s = stats(a);
        assert_eq!(s.asleep_bytes.current, slept.bytes);
        assert_eq!(s.reserved_bytes.current, reserved - slept.released);
        assert_eq!(s.allocations.current, 2 * TAGGED_SIZES.len() as u64 + 1, "still live");
        let mut host = 0u64;
        assert_eq!(mb_get_host_memory(a, &mut host), MB_OK);
        assert!(host >= slept.bytes, "{host}");
        assert!(intact(a, &other), "another tag was touched");

        let mut woke = mb_wake_report::default();
        assert_eq!(
            mb_wake(a, c"capi-sleep-weights".as_ptr(), &mut woke),
            MB_OK,
            "{}",
            last_error()
        );
        assert_eq!((woke.bytes, woke.restored), (slept.bytes, slept.bytes));
        assert!(intact(a, &weights), "bytes or addresses changed");
        assert_eq!(stats(a).asleep_bytes.current, 0);
        assert_eq!(stats(a).asleep_bytes.peak, slept.bytes);

        // What the sleep held is spare now, kept for the next sleep until released.
        let mut released = 0u64;
        assert_eq!(mb_release_host_memory(a, &mut released), MB_OK, "{}", last_error());
        assert!(released >= slept.bytes, "{released}");
        assert_eq!(mb_get_host_memory(a, &mut host), MB_OK);
        assert_eq!(host, 0);
        assert_eq!(mb_release_host_memory(a, ptr::null_mut()), MB_OK);

        // The report is optional.
        let st = mb_sleep(a, c"capi-sleep-weights".as_ptr(), MB_BACKUP_HOST, ptr::null_mut());
        assert_eq!(st, MB_OK, "{}", last_error());
        assert_eq!(mb_wake(a, c"capi-sleep-weights".as_ptr(), ptr::null_mut()), MB_OK);
        assert!(intact(a, &weights) && intact(a, &other));
        for (p, _) in weights.iter().chain(&other) {
            assert_eq!(mb_free(a, *p), MB_OK, "{}", last_error());
        }
        assert_eq!(mb_free(a, untagged), MB_OK);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn a_discarded_tag_gives_its_memory_back_and_wakes_usable() {
    let a = create_quiet_host();
    let kv = tagged(a, c"capi-sleep-kv", &TAGGED_SIZES);
    // SAFETY: `a` is live; the names are NUL-terminated; the outputs are live locals.
    unsafe {
        let reserved = stats(a).reserved_bytes.current;
        let mut slept = mb_sleep_report::default();
        let st = mb_sleep(a, c"capi-sleep-kv".as_ptr(), MB_BACKUP_DISCARD, &mut slept);
        assert_eq!(st, MB_OK, "{}", last_error());
        assert_eq!(slept.backed_up, 0);
        assert_eq!(stats(a).reserved_bytes.current, reserved - slept.released);
        let mut host = u64::MAX;
        assert_eq!(mb_get_host_memory(a, &mut host), MB_OK);
        assert_eq!(host, 0, "no host memory for a discarded tag");
        let mut woke = mb_wake_report::default();
        assert_eq!(mb_wake(a, c"capi-sleep-kv".as_ptr(), &mut woke), MB_OK, "{}", last_error());
        assert_eq!((woke.bytes, woke.restored), (slept.bytes, 0));
        // Usable at the same addresses.
        let rewritten: Vec<(u64, Vec<u8>)> =
            kv.iter().map(|(p, bytes)| (*p, bytes.iter().map(|b| !b).collect())).collect();
        for (p, bytes) in &rewritten {
            (*a).allocator().write(*p, bytes).unwrap();
        }
        assert!(intact(a, &rewritten));
        for (p, _) in kv {
            assert_eq!(mb_free(a, p), MB_OK);
        }
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn a_tag_not_awake_refuses_with_tag_state() {
    let a = create(&host_options());
    let blocks = tagged(a, c"capi-state", &TAGGED_SIZES);
    let tag = c"capi-state".as_ptr();
    // SAFETY: `a` is live; the names are NUL-terminated; the outputs are live locals or NULL.
    unsafe {
        assert_eq!(mb_wake(a, tag, ptr::null_mut()), MB_ERR_TAG_STATE, "awake");
        assert!(last_error().contains("awake"), "{}", last_error());
        assert_eq!(mb_sleep(a, tag, MB_BACKUP_HOST, ptr::null_mut()), MB_OK, "{}", last_error());
        let mut report = mb_sleep_report { bytes: 77, ..Default::default() };
        assert_eq!(mb_sleep(a, tag, MB_BACKUP_HOST, &mut report), MB_ERR_TAG_STATE);
        assert!(last_error().contains("asleep already"), "{}", last_error());
        assert_eq!(report.bytes, 77, "not written on failure");
        // Allocating into it, freeing its memory, plain or stream-ordered.
        let mut previous = 0u32;
        assert_eq!(mb_tag_begin(tag, &mut previous), MB_OK);
        let mut p = 0u64;
        assert_eq!(mb_malloc(a, 100, &mut p), MB_ERR_TAG_STATE);
        assert!(last_error().contains("asleep"), "{}", last_error());
        assert_eq!(mb_malloc(a, 3 << 20, &mut p), MB_ERR_TAG_STATE);
        assert_eq!(mb_malloc_async(a, 100, ptr::null_mut(), &mut p), MB_ERR_TAG_STATE);
        assert_eq!(p, 0);
        assert_eq!(mb_tag_end(previous), MB_OK);
        for (p, _) in &blocks {
            assert_eq!(mb_free(a, *p), MB_ERR_TAG_STATE);
            assert_eq!(mb_free_async(a, *p, ptr::null_mut()), MB_ERR_TAG_STATE);
        }
        // Untagged requests carry on.
        assert_eq!(mb_malloc(a, 100, &mut p), MB_OK);
        assert_eq!(mb_free(a, p), MB_OK);
        assert_eq!(mb_wake(a, tag, ptr::null_mut()), MB_OK, "{}", last_error());
        assert_eq!(mb_wake(a, tag, ptr::null_mut()), MB_ERR_TAG_STATE, "woken already");
        assert!(intact(a, &blocks));
        for (p, _) in blocks {
            assert_eq!(mb_free(a, p), MB_OK);
        }
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn a_wake_short_of_memory_is_out_of_memory_and_leaves_the_tag_asleep() {
    let a = create(&host_options());
    let blocks = tagged(a, c"capi-wake-oom", &TAGGED_SIZES);
    let tag = c"capi-wake-oom".as_ptr();
    // SAFETY: `a` is live; the names are NUL-terminated; the outputs are live locals or NULL.
    unsafe {
        let mut slept = mb_sleep_report::default();
        assert_eq!(mb_sleep(a, tag, MB_BACKUP_HOST, &mut slept), MB_OK, "{}", last_error());
        // Other memory takes what the tag gave back, under a cap that leaves it no room.
        let mut filler = 0u64;
        assert_eq!(mb_malloc(a, 64 << 20, &mut filler), MB_OK);
        let cap = stats(a).reserved_bytes.current + slept.bytes - (64 << 10);
        assert_eq!(mb_set_cap(a, cap, ptr::null_mut()), MB_OK);
        let mut woke = mb_wake_report { bytes: 5, ..Default::default() };
        assert_eq!(mb_wake(a, tag, &mut woke), MB_ERR_OUT_OF_MEMORY);
        assert!(!last_error().is_empty());
        assert_eq!(woke.bytes, 5, "not written on failure");
        assert_eq!(stats(a).asleep_bytes.current, slept.bytes, "still asleep");
        assert_eq!(mb_free(a, blocks[0].0), MB_ERR_TAG_STATE, "still asleep");
        assert_eq!(mb_free(a, filler), MB_OK);
        assert_eq!(mb_wake(a, tag, &mut woke), MB_OK, "{}", last_error());
        assert!(intact(a, &blocks), "the failed wake lost bytes");
        assert_eq!(mb_destroy(a), MB_OK);
    }
}

#[test]
fn tag_calls_refuse_null_and_bad_arguments() {
    let a = create(&host_options());
    let blocks = tagged(a, c"capi-args", &TAGGED_SIZES[..1]);
    let tag = c"capi-args".as_ptr();
    let too_long = std::ffi::CString::new("t".repeat(moonbright::tags::MAX_TAG_LEN + 1)).unwrap();
    let not_utf8: &CStr = c"capi-\xff\xfe";
    let (mut previous, mut n) = (7u32, 0u64);
    let mut slept = mb_sleep_report::default();
    let mut woke = mb_wake_report::default();
    // SAFETY: `a` is live; the strings are NUL-terminated or NULL where the test means it; the
    // outputs are live locals or NULL.
    unsafe {
        let cases: Vec<(&str, i32)> = vec![
            ("`tag` is NULL", mb_tag_begin(ptr::null(), &mut previous)),
            ("`out_previous` is NULL", mb_tag_begin(tag, ptr::null_mut())),
            ("1 to 256 bytes", mb_tag_begin(c"".as_ptr(), &mut previous)),
            ("1 to 256 bytes", mb_tag_begin(too_long.as_ptr(), &mut previous)),
            ("not UTF-8", mb_tag_begin(not_utf8.as_ptr(), &mut previous)),
            ("`alloc` is NULL", mb_sleep(ptr::null_mut(), tag, MB_BACKUP_HOST, &mut slept)),
            ("`tag` is NULL", mb_sleep(a, ptr::null(), MB_BACKUP_HOST, &mut slept)),
            ("1 to 256 bytes", mb_sleep(a, c"".as_ptr(), MB_BACKUP_HOST, &mut slept)),
            ("not UTF-8", mb_sleep(a, not_utf8.as_ptr(), MB_BACKUP_DISCARD, &mut slept)),
            ("`backup` is 2", mb_sleep(a, tag, 2, &mut slept)),
            ("`backup` is -1", mb_sleep(a, tag, -1, &mut slept)),
            ("`alloc` is NULL", mb_wake(ptr::null_mut(), tag, &mut woke)),
            ("`tag` is NULL", mb_wake(a, ptr::null(), &mut woke)),
            ("1 to 256 bytes", mb_wake(a, c"".as_ptr(), &mut woke)),
            ("not UTF-8", mb_wake(a, not_utf8.as_ptr(), &mut woke)),
            ("`alloc` is NULL", mb_get_host_memory(ptr::null_mut(), &mut n)),
            ("`out_bytes` is NULL", mb_get_host_memory(a, ptr::null_mut())),
            ("`alloc` is NULL", mb_release_host_memory(ptr::null_mut(), &mut n)),
        ];
        for (i, (message, status)) in cases.into_iter().enumerate() {
            assert_eq!(status, MB_ERR_INVALID_ARGUMENT, "case {i}: {message}");
        }
        // Each message says what was wrong (checked one by one: a call clears the last one).
        let messages: Vec<(&str, String)> = vec![
            ("`tag` is NULL", {
                mb_tag_begin(ptr::null(), &mut previous);
                last_error()
            }),
            ("1 to 256 bytes", {
                mb_tag_begin(c"".as_ptr(), &mut previous);
                last_error()
            }),
            ("not UTF-8", {
                mb_sleep(a, not_utf8.as_ptr(), MB_BACKUP_HOST, &mut slept);
                last_error()
            }),
            ("`backup` is 2", {
                mb_sleep(a, tag, 2, &mut slept);
                last_error()
            }),
        ];
        for (expected, message) in messages {
            assert!(message.contains(expected), "{expected:?} not in {message:?}");
        }
        // Nothing changed: no tag on this thread, the outputs untouched, the tag awake.
        assert_eq!(previous, 7);
        assert_eq!(moonbright::tags::current_name(), None);
        assert_eq!(slept, mb_sleep_report::default());
        assert_eq!(stats(a).asleep_bytes.current, 0);
        assert_eq!(mb_free(a, blocks[0].0), MB_OK);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}
