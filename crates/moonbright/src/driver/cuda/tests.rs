//! Tests of the CUDA backend: each skips without a GPU (counted; a failure under
//! `MOONBRIGHT_REQUIRE_GPU=1`). Not under Miri, which cannot interpret the driver.

use std::os::fd::AsRawFd;

use super::*;
use crate::driver::prelude::*;
use crate::driver::{Batch, StreamHandle};
use std::time::{Duration, Instant};

/// Device 0, with the GPU-test lock, or `None` when this machine has no usable GPU (the
/// skip counted, or a failure under `MOONBRIGHT_REQUIRE_GPU=1`: see `crate::testing`).
fn gpu() -> Option<(crate::testing::Gpu, CudaDriver)> {
    let gpu = crate::testing::gpu()?;
    let d = CudaDriver::new(0).expect("probe found a device but CudaDriver::new(0) failed");
    Some((gpu, d))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn no_gpu_fails_cleanly_and_bad_ordinals_are_refused() {
    match probe() {
        Err(why) => {
            assert!(!why.is_empty());
            let e = CudaDriver::new(0).expect_err("probe failed, so new must fail");
            println!("no GPU here: probe: {why}; new(0): {e}");
            assert!(!e.message.is_empty());
            assert_eq!(e.call, CallKind::MemInfo);
        }
        Ok(count) => {
            for bad in [-1, count] {
                let e = CudaDriver::new(bad).expect_err("an out-of-range ordinal must fail");
                assert_eq!(e.code, INVALID_DEVICE);
                assert!(e.message.contains("out of range"), "{e}");
            }
        }
    }
}

#[test]
fn granularity_and_mem_info() {
    let Some((_gpu, d)) = gpu() else { return };
    let g = d.granularity();
    assert!(g.is_power_of_two() && g >= 64 << 10, "granularity {g}");
    let info = d.mem_info().unwrap();
    assert!(info.total > 0 && info.free <= info.total, "{info:?}");
    assert_eq!(d.name(), "cuda");
    assert_eq!(d.device(), 0);
    assert!(!d.context().is_null());
}

/// A chunk exported (a POSIX file descriptor) and imported again shows the same bytes at a
/// second address; a second export of it reuses the kept descriptor, and its release
/// forgets it; without `set_shareable` an export is refused.
#[test]
fn exported_chunks_import_again_and_their_descriptors_are_kept_until_release() {
    let Some((_gpu, d)) = gpu() else { return };
    let g = d.granularity();
    let plain = d.create_chunk(g).unwrap();
    let e = d.export_chunk(plain, g).unwrap_err();
    assert_eq!(e.call, CallKind::Export, "{e}");
    d.release_chunk(plain).unwrap();

    d.set_shareable(true);
    let a = d.create_chunk(g).unwrap();
    assert!(d.shareable(), "the H200's driver gives POSIX file descriptor handles");
    let first = d.export_chunk(a, g).unwrap();
    let t = std::time::Instant::now();
    let second = d.export_chunk(a, g).unwrap();
    println!("second export: {:?}", t.elapsed());
    assert_ne!(first.fd.as_raw_fd(), second.fd.as_raw_fd());
    assert_eq!(d.exported.lock().unwrap().len(), 1);
    let b = d.import_chunk(&second).unwrap();
    let base = d.reserve(2 * g, 0).unwrap();
    d.map(base, g, a).unwrap();
    d.map(base + g as u64, g, b).unwrap();
    d.set_access(base, 2 * g).unwrap();
    let p = pattern(g, 33);
    d.write(base, &p).unwrap();
    let mut got = vec![0u8; g];
    d.read(base + g as u64, &mut got).unwrap();
    assert!(got == p, "the imported chunk shows other bytes");
    d.unmap(base, 2 * g).unwrap();
    d.free_reservation(base, 2 * g).unwrap();
    d.release_chunk(b).unwrap();
    d.release_chunk(a).unwrap();
    assert!(d.exported.lock().unwrap().is_empty(), "the release forgot the descriptor");
}

#[test]
fn map_alias_read_write_unmap() {
    let Some((_gpu, d)) = gpu() else { return };
    let g = d.granularity();
    let g64 = g as u64;
    let base = d.reserve(3 * g, 0).unwrap();
    assert_eq!(base % g64, 0);
    let a = d.create_chunk(g).unwrap();
    let b = d.create_chunk(g).unwrap();
    d.map(base, g, a).unwrap();
    d.map(base + 2 * g64, g, b).unwrap();
    d.set_access(base, g).unwrap();
    d.set_access(base + 2 * g64, g).unwrap();

    let pa = pattern(g, 7);
    let pb = pattern(g, 101);
    d.write(base, &pa).unwrap();
    d.write(base + 2 * g64, &pb).unwrap();
    let mut got = vec![0u8; g];
    d.read(base, &mut got).unwrap();
    assert!(got == pa, "chunk a read back wrong");
    d.read(base + 2 * g64, &mut got).unwrap();
    assert!(got == pb, "chunk b read back wrong");

    // The same physical chunk at a second address shows the same bytes, both ways.
    d.map(base + g64, g, a).unwrap();
    d.set_access(base + g64, g).unwrap();
    d.read(base + g64, &mut got).unwrap();
    assert!(got == pa, "alias of chunk a shows different bytes");
    d.write(base + g64 + 100, &[0xAB; 16]).unwrap();
    let mut small = [0u8; 16];
    d.read(base + 100, &mut small).unwrap();
    assert_eq!(small, [0xAB; 16]);

    // One unmap spanning three mappings, as the contract allows.
    d.unmap(base, 3 * g).unwrap();
    d.release_chunk(a).unwrap();
    d.release_chunk(b).unwrap();
    d.free_reservation(base, 3 * g).unwrap();
}

/// Pinned host memory: device bytes copied out and back on a stream of the driver's, then
/// waited for by an event, arrive whole.
#[test]
fn offload_copies_to_pinned_memory_and_back() {
    let Some((_gpu, d)) = gpu() else { return };
    let g = d.granularity();
    let base = d.reserve(g, 0).unwrap();
    let c = d.create_chunk(g).unwrap();
    d.map(base, g, c).unwrap();
    d.set_access(base, g).unwrap();
    let p = pattern(g, 42);
    d.write(base, &p).unwrap();
    let host = d.alloc_host(g).unwrap();
    let s = d.create_stream().unwrap();
    let ev = d.create_event().unwrap();
    // SAFETY: `host` is a live buffer of `g` bytes that nothing else touches until the event
    // recorded after the copies has completed.
    unsafe { d.copy_to_host(host.ptr, base, g, s).unwrap() };
    d.record_event(ev, s).unwrap();
    d.synchronize_event(ev).unwrap();
    // SAFETY: the copy into it has completed (the event above).
    let copied = unsafe { std::slice::from_raw_parts(host.ptr, g) };
    assert!(copied == &p[..], "device bytes did not reach host memory");
    d.write(base, &vec![0u8; g]).unwrap();
    // SAFETY: as above, for reads of `host`.
    unsafe { d.copy_to_device(base + 1, host.ptr, g - 1, s).unwrap() };
    d.record_event(ev, s).unwrap();
    d.synchronize_event(ev).unwrap();
    let mut got = vec![0u8; g];
    d.read(base, &mut got).unwrap();
    assert!(got[0] == 0 && got[1..] == p[..g - 1], "host bytes did not come back");
    // SAFETY: no copy on it is in flight (waited for above).
    unsafe { d.free_host(host).unwrap() };
    d.destroy_event(ev).unwrap();
    d.destroy_stream(s).unwrap();
    d.unmap(base, g).unwrap();
    d.release_chunk(c).unwrap();
    d.free_reservation(base, g).unwrap();
}

#[test]
fn released_chunk_lives_while_mapped() {
    let Some((_gpu, d)) = gpu() else { return };
    let g = d.granularity();
    let base = d.reserve(g, 0).unwrap();
    let a = d.create_chunk(g).unwrap();
    d.map(base, g, a).unwrap();
    d.set_access(base, g).unwrap();
    d.release_chunk(a).unwrap();
    let p = pattern(4096, 3);
    d.write(base, &p).unwrap();
    let mut got = vec![0u8; p.len()];
    d.read(base, &mut got).unwrap();
    assert_eq!(got, p);
    d.unmap(base, g).unwrap();
    d.free_reservation(base, g).unwrap();
}

#[test]
fn event_on_fresh_stream_completes() {
    let Some((_gpu, d)) = gpu() else { return };
    let s = d.create_stream().unwrap();
    assert_ne!(s, StreamHandle::DEFAULT);
    for stream in [s, StreamHandle::DEFAULT] {
        let e = d.create_event().unwrap();
        d.record_event(e, stream).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !d.event_done(e).unwrap() {
            assert!(Instant::now() < deadline, "event on an idle stream never completed");
            std::thread::sleep(Duration::from_millis(1));
        }
        d.destroy_event(e).unwrap();
    }
    d.destroy_stream(s).unwrap();
    let e = d.destroy_stream(StreamHandle::DEFAULT).unwrap_err();
    assert_eq!(e.call, CallKind::StreamDestroy);
}

#[test]
fn errors_are_values_with_the_right_kind() {
    let Some((_gpu, d)) = gpu() else { return };
    let g = d.granularity();
    let base = d.reserve(2 * g, 0).unwrap();
    let a = d.create_chunk(g).unwrap();
    let e = d.map(base + 4096, g, a).unwrap_err();
    assert_eq!(e.call, CallKind::Map);
    assert_ne!(e.code, 0);
    assert!(e.message.starts_with("cuMemMap(va=0x"), "{e}");
    assert!(e.message.contains("CUDA_ERROR_"), "{e}");
    println!("expected error: {e}");
    let e = d.create_chunk(g + 1).unwrap_err();
    assert_eq!(e.call, CallKind::Create);
    d.release_chunk(a).unwrap();
    d.free_reservation(base, 2 * g).unwrap();
    let e = check(CallKind::Unmap, sys::CUresult::CUDA_ERROR_INVALID_VALUE, || "x()".into())
        .unwrap_err();
    assert_eq!(e.code, code::INVALID_VALUE);
    assert!(e.message.starts_with("x() -> CUDA_ERROR_INVALID_VALUE"), "{e}");
}

#[test]
fn usable_from_a_thread_without_a_current_context() {
    let Some((_gpu, d)) = gpu() else { return };
    let d = std::sync::Arc::new(d);
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let d = d.clone();
            std::thread::spawn(move || {
                let g = d.granularity();
                let va = d.reserve(g, 0).unwrap();
                let c = d.create_chunk(g).unwrap();
                d.map(va, g, c).unwrap();
                d.set_access(va, g).unwrap();
                d.write(va, &[5; 64]).unwrap();
                let mut got = [0u8; 64];
                d.read(va, &mut got).unwrap();
                assert_eq!(got, [5; 64]);
                d.unmap(va, g).unwrap();
                d.release_chunk(c).unwrap();
                d.free_reservation(va, g).unwrap();
                let s = d.create_stream().unwrap();
                d.destroy_stream(s).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn calls_leave_the_threads_current_context_as_they_find_it() {
    let Some((_gpu, d)) = gpu() else { return };
    let d = std::sync::Arc::new(d);
    let d2 = d.clone();
    std::thread::spawn(move || {
        assert!(current_device().is_none(), "a fresh thread has no current context");
        let g = d2.granularity();
        let va = d2.reserve(g, 0).unwrap();
        let c = d2.create_chunk(g).unwrap();
        d2.map(va, g, c).unwrap();
        d2.set_access(va, g).unwrap();
        let e = d2.create_event().unwrap();
        d2.record_event(e, StreamHandle::DEFAULT).unwrap();
        d2.synchronize_event(e).unwrap();
        d2.destroy_event(e).unwrap();
        assert!(current_device().is_none(), "a call left its context current");
        d2.bind_context().unwrap();
        assert_eq!(current_device(), Some(d2.device()), "bound for good");
        d2.unmap(va, g).unwrap();
        d2.release_chunk(c).unwrap();
        d2.free_reservation(va, g).unwrap();
        assert_eq!(current_device(), Some(d2.device()));
    })
    .join()
    .unwrap();
}

/// The thread's capture mode, read by swapping it with itself.
fn capture_mode() -> sys::CUstreamCaptureMode {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: `mode` is a valid in/out pointer; the second swap puts the first's result back.
    unsafe {
        assert_eq!(sys::cuThreadExchangeStreamCaptureMode(&mut mode), sys::CUresult::CUDA_SUCCESS);
        let mut again = mode;
        sys::cuThreadExchangeStreamCaptureMode(&mut again);
    }
    mode
}

#[test]
fn a_batch_sets_up_once_and_leaves_the_thread_as_it_found_it() {
    let Some((_gpu, d)) = gpu() else { return };
    let d = std::sync::Arc::new(d);
    let d2 = d.clone();
    std::thread::spawn(move || {
        let global = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
        assert_eq!(capture_mode(), global, "the default mode");
        assert!(current_device().is_none());
        let g = d2.granularity();
        let va = d2.reserve(g, 0).unwrap();
        let batch = d2.begin_batch();
        assert_eq!(batch, Batch(true));
        assert_eq!(d2.begin_batch(), Batch(false), "a batch inside another does nothing");
        assert_eq!(current_device(), Some(d2.device()), "current for the batch");
        assert_eq!(capture_mode(), sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED);
        let c = d2.create_chunk(g).unwrap();
        d2.map(va, g, c).unwrap();
        d2.set_access(va, g).unwrap();
        assert_eq!(
            capture_mode(),
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            "calls in the batch leave its mode alone"
        );
        d2.end_batch(batch);
        assert!(current_device().is_none(), "the batch popped its context");
        assert_eq!(capture_mode(), global, "and restored the mode");
        d2.write(va, &[7; 64]).unwrap();
        let mut got = [0u8; 64];
        d2.read(va, &mut got).unwrap();
        assert_eq!(got, [7; 64]);
        crate::driver::batched(&*d2, || {
            d2.unmap(va, g).unwrap();
            d2.release_chunk(c).unwrap();
        });
        assert!(current_device().is_none());
        d2.free_reservation(va, g).unwrap();
    })
    .join()
    .unwrap();
}

#[test]
fn peers_are_checked_and_named_in_set_access() {
    let Some((gpu, d)) = gpu() else { return };
    let count = gpu.devices;
    for bad in [d.device(), count, -1] {
        let e = d.set_peers(&[bad]).unwrap_err();
        assert_eq!(e.call, CallKind::PeerAccess, "{e}");
    }
    if count < 2 {
        println!("one GPU: peers beyond the refusals are tested on two (test_multi_gpu.py)");
        return;
    }
    d.set_peers(&[1]).unwrap();
    let g = d.granularity();
    let va = d.reserve(g, 0).unwrap();
    let c = d.create_chunk(g).unwrap();
    d.map(va, g, c).unwrap();
    d.set_access(va, g).unwrap();
    let mut flags = 0u64;
    let loc = device_location(1);
    // SAFETY: `flags` and `loc` are valid for the call; `va` is mapped.
    let r = unsafe { sys::cuMemGetAccess(&mut flags, &loc, va) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert_eq!(
        flags,
        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64,
        "device 1 was granted access"
    );
    d.unmap(va, g).unwrap();
    d.release_chunk(c).unwrap();
    d.free_reservation(va, g).unwrap();
}
