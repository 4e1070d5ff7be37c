//! The interposer over a fake CUDA runtime and MoonBright's host backend: what it serves, what
//! it passes on, how `cudaFree` waits for the device, and every failure path.

mod common;

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use common::*;
use moonbright::driver::prelude::*;
use moonbright::Options;
use moonbright_preload::code;

#[test]
fn malloc_is_served_and_free_waits_for_the_device_then_frees() {
    let ip = new(host_options);
    let (r, p) = malloc(&ip, 3 * MIB, None);
    assert_eq!(r, code::SUCCESS);
    let (dev, a) = ip.devices().owner(p).expect("MoonBright's memory");
    assert_eq!(dev, 0);
    assert!(a.usable_size(p).unwrap() >= 3 * MIB);
    a.write(p, &[7; 64]).unwrap();
    assert!(runtime(&ip).take().is_empty(), "no runtime call for a served malloc");

    assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    assert_eq!(runtime(&ip).take(), vec![Call::Synchronize(0)]);
    assert!(ip.devices().owner(p).is_none());
    let c = &ip.counts;
    assert_eq!(c.served_allocs.load(Ordering::Relaxed), 1);
    assert_eq!(c.served_frees.load(Ordering::Relaxed), 1);
    assert_eq!(c.synchronous_frees.load(Ordering::Relaxed), 1);
    let report: serde_json::Value = serde_json::from_str(&ip.report()).unwrap();
    assert_eq!(report["served_allocs"], 1);
    assert_eq!(report["devices"][0]["device"], 0);
    assert_eq!(report["devices"][0]["allocated_bytes"], 0);
}

#[test]
fn free_on_another_device_waits_for_that_device_and_restores_the_current_one() {
    let ip = new(host_options);
    runtime(&ip).device.store(2, Ordering::SeqCst);
    let (r, p) = malloc(&ip, 1000, None);
    assert_eq!(r, code::SUCCESS);
    assert_eq!(ip.devices().owner(p).map(|(d, _)| d), Some(2));
    runtime(&ip).device.store(0, Ordering::SeqCst);
    assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    assert_eq!(
        runtime(&ip).take(),
        vec![Call::SetDevice(2), Call::Synchronize(2), Call::SetDevice(0)]
    );
}

#[test]
fn a_failed_synchronisation_keeps_the_allocation() {
    let ip = new(host_options);
    let (_, p) = malloc(&ip, 1000, None);
    runtime(&ip).fail_sync.store(700, Ordering::SeqCst);
    assert_eq!(ip.free(p as *mut c_void, None), 700);
    assert!(ip.last_error().unwrap().contains("synchronising"));
    assert!(ip.devices().owner(p).is_some(), "work may still use it");
    runtime(&ip).fail_sync.store(0, Ordering::SeqCst);
    assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
}

#[test]
fn what_moonbright_does_not_own_goes_to_the_runtime() {
    let ip = new(host_options);
    // Zero bytes: the runtime's answer, whatever it is.
    let (r, q) = malloc(&ip, 0, None);
    assert_eq!((r, q), (code::SUCCESS, 0x1000));
    assert_eq!(runtime(&ip).take(), vec![Call::Malloc(0, None)]);
    // cudaFree(NULL), which creates the context; a pointer of the runtime's; one of nobody's.
    assert_eq!(ip.free(std::ptr::null_mut(), None), code::SUCCESS);
    assert_eq!(ip.free(q as *mut c_void, None), code::SUCCESS);
    assert_eq!(ip.free(0xdead_0000 as *mut c_void, Some(5)), code::INVALID_VALUE);
    assert_eq!(
        runtime(&ip).take(),
        vec![Call::Free(0, None), Call::Free(q, None), Call::Free(0xdead_0000, Some(5))]
    );
    assert_eq!(ip.counts.passed_frees.load(Ordering::Relaxed), 3);
    assert_eq!(ip.counts.passed_allocs.load(Ordering::Relaxed), 1);
}

#[test]
fn a_double_free_is_the_runtimes_error_and_harms_nothing() {
    let ip = new(host_options);
    let (_, keep) = malloc(&ip, 4096, None);
    let a = ip.devices().owner(keep).unwrap().1;
    a.write(keep, &[9; 256]).unwrap();
    let (_, p) = malloc(&ip, 4096, None);
    assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    // Not MoonBright's any more: the runtime does not know it either.
    assert_eq!(ip.free(p as *mut c_void, None), code::INVALID_VALUE);
    // An interior pointer of a live allocation is not one MoonBright handed out.
    assert_eq!(ip.free((keep + 256) as *mut c_void, None), code::INVALID_VALUE);
    let mut back = [0u8; 256];
    a.read(keep, &mut back).unwrap();
    assert_eq!(back, [9; 256]);
    assert!(ip.devices().owner(keep).is_some());
}

#[test]
fn out_of_memory_and_bad_arguments_are_errors_and_lose_nothing() {
    let ip = new(host_options);
    let (_, keep) = malloc(&ip, 8 * MIB, None);
    let a = ip.devices().owner(keep).unwrap().1;
    a.write(keep, &[3; 128]).unwrap();
    let (r, p) = malloc(&ip, 1 << 40, None);
    assert_eq!((r, p), (code::MEMORY_ALLOCATION, 0));
    assert!(ip.last_error().unwrap().contains("device 0"), "{:?}", ip.last_error());
    let (r, _) = malloc(&ip, usize::MAX, Some(0));
    assert_eq!(r, code::MEMORY_ALLOCATION);
    // SAFETY: a null out-pointer, which must be refused before any use.
    assert_eq!(unsafe { ip.malloc(std::ptr::null_mut(), 64, None) }, code::INVALID_VALUE);
    let mut back = [0u8; 128];
    a.read(keep, &mut back).unwrap();
    assert_eq!(back, [3; 128]);
    assert!(runtime(&ip).take().is_empty(), "nothing of this reaches the runtime");
}

#[test]
fn the_runtimes_device_error_comes_back_and_nothing_is_made() {
    let ip = new(host_options);
    runtime(&ip).fail_get_device.store(100, Ordering::SeqCst);
    assert_eq!(malloc(&ip, 64, None).0, 100);
    assert!(ip.devices().created().next().is_none());
}

#[test]
fn a_device_whose_allocator_cannot_be_made_passes_through_for_good() {
    let ip = new(bad_options);
    let (r, p) = malloc(&ip, 64, None);
    assert_eq!((r, p), (code::SUCCESS, 0x1000), "the runtime's memory");
    let e = ip.last_error().unwrap();
    assert!(e.contains("host_page_size") && e.contains("go to the CUDA runtime"), "{e}");
    assert_eq!(malloc(&ip, 64, Some(7)).1, 0x2000);
    assert_eq!(runtime(&ip).take(), vec![Call::Malloc(64, None), Call::Malloc(64, Some(7))]);
    assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    assert_eq!(ip.counts.served_allocs.load(Ordering::Relaxed), 0);
}

#[test]
fn stream_ordered_calls_reuse_on_the_stream_and_free_without_waiting() {
    let ip = new(host_options);
    let (_, first) = malloc(&ip, 64, None);
    let a = ip.devices().owner(first).unwrap().1;
    let host = a.driver().inner().as_host().unwrap();
    let stream = a.driver().create_stream().unwrap();
    let s = stream.0;
    // The stream's work never completes until released: its frees stay pending.
    host.hold_stream(stream);
    let (r, p) = malloc(&ip, 5 * MIB, Some(s));
    assert_eq!(r, code::SUCCESS);
    assert_eq!(ip.free(p as *mut c_void, Some(s)), code::SUCCESS);
    assert!(runtime(&ip).take().is_empty(), "a stream-ordered free does not wait");
    // cudaMalloc never takes memory still pending on a stream.
    let (_, sync) = malloc(&ip, 5 * MIB, None);
    assert_ne!(sync, p);
    let (_, again) = malloc(&ip, 5 * MIB, Some(s));
    assert_eq!(again, p, "the same stream reuses its free at once");
    // Freed on the stream, then freed synchronously: an error, and the memory stays free.
    assert_eq!(ip.free(again as *mut c_void, Some(s)), code::SUCCESS);
    assert_eq!(ip.free(again as *mut c_void, None), code::INVALID_VALUE);
    host.release_stream(stream);
    assert_eq!(ip.free(sync as *mut c_void, None), code::SUCCESS);
}

#[test]
fn cuda_malloc_never_takes_memory_pending_on_the_null_stream() {
    let ip = new(host_options);
    let (_, first) = malloc(&ip, 64, None);
    let a = ip.devices().owner(first).unwrap().1;
    let host = a.driver().inner().as_host().unwrap();
    host.hold_stream(moonbright::StreamHandle(0));
    let (_, p) = malloc(&ip, 6 * MIB, Some(0));
    assert_eq!(ip.free(p as *mut c_void, Some(0)), code::SUCCESS);
    // The null stream's queued work may still use it; cudaMalloc's memory is for any stream.
    let (_, q) = malloc(&ip, 6 * MIB, None);
    assert_ne!(q, p);
    host.release_stream(moonbright::StreamHandle(0));
}

/// A long churn of served allocations, with the background worker running: sizes below a
/// page and above, freed synchronously, on their stream or on another; every allocation keeps
/// its bytes until freed.
#[test]
fn a_long_churn_keeps_every_allocations_bytes() {
    use moonbright_testkit::scenario::{stamp, verify};
    fn opts() -> Result<Options, String> {
        Ok(Options { background: true, ..Options::host(512 * MIB as u64, 2 * MIB) })
    }
    let ip = new(opts);
    let (_, first) = malloc(&ip, 64, None);
    let a = ip.devices().owner(first).unwrap().1;
    let streams: Vec<u64> = (0..3).map(|_| a.driver().create_stream().unwrap().0).collect();
    let mut live: Vec<(u64, usize, u64)> = Vec::new();
    let mut x = 12345u64;
    let mut rand = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for id in 0..4000u64 {
        if live.len() > 24 || (rand(3) == 0 && !live.is_empty()) {
            let (p, size, pid) = live.swap_remove(rand(live.len() as u64) as usize);
            assert!(verify(a, p, size, pid).unwrap(), "allocation {pid} changed");
            let how = match rand(3) {
                0 => None,
                _ => Some(streams[rand(3) as usize]),
            };
            assert_eq!(ip.free(p as *mut c_void, how), code::SUCCESS, "{:?}", ip.last_error());
        }
        let size = match rand(4) {
            0 => 1 + rand(4096) as usize,
            1 => 1 + rand(2 * MIB as u64) as usize,
            _ => 1 + rand(24 * MIB as u64) as usize,
        };
        let stream = match rand(2) {
            0 => None,
            _ => Some(streams[rand(3) as usize]),
        };
        let (r, p) = malloc(&ip, size, stream);
        assert_eq!(r, code::SUCCESS, "{:?}", ip.last_error());
        stamp(a, p, size, id).unwrap();
        live.push((p, size, id));
    }
    for (p, size, id) in live {
        assert!(verify(a, p, size, id).unwrap(), "allocation {id} changed");
        assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    }
    a.check_invariants().unwrap();
}

#[test]
fn only_the_cuda_backend_is_served() {
    let auto = moonbright_preload::cuda_only(Options::default()).unwrap();
    assert_eq!(auto.backend, moonbright::BackendKind::Cuda, "auto must not fall back to the host");
    let e = moonbright_preload::cuda_only(Options::host(1 << 30, 2 * MIB)).unwrap_err();
    assert!(e.contains("MOONBRIGHT_ALLOC_CONF") && e.contains("backend:cuda"), "{e}");
    // Through the interposer: the device's calls go to the runtime.
    fn host_refused() -> Result<Options, String> {
        moonbright_preload::cuda_only(Options::host(1 << 30, 2 * MIB))
    }
    let ip = new(host_refused);
    assert_eq!(malloc(&ip, 4096, None), (code::SUCCESS, 0x1000));
    assert!(ip.last_error().unwrap().contains("backend:cuda"));
    assert!(ip.devices().created().next().is_none());
}

#[test]
fn a_driver_failure_is_an_error_and_loses_nothing() {
    use moonbright::CallKind;
    let ip = new(host_options);
    let (_, keep) = malloc(&ip, 4 * MIB, None);
    let a = ip.devices().owner(keep).unwrap().1;
    a.write(keep, &[5; 64]).unwrap();
    for kind in [CallKind::Create, CallKind::Map, CallKind::SetAccess] {
        a.release_unused().unwrap();
        a.driver().fail_nth(kind, 1, None);
        let (r, p) = malloc(&ip, 6 * MIB, None);
        assert_eq!((r, p), (code::UNKNOWN, 0), "{kind:?}");
        assert!(ip.last_error().unwrap().contains("device 0"), "{:?}", ip.last_error());
        let (r, p) = malloc(&ip, 6 * MIB, None);
        assert_eq!(r, code::SUCCESS, "the next request after a failed {kind:?}");
        assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    }
    let mut back = [0u8; 64];
    a.read(keep, &mut back).unwrap();
    assert_eq!(back, [5; 64]);
    a.check_invariants().unwrap();
}

#[test]
fn mem_get_info_counts_memory_held_unused_as_free() {
    fn capped() -> Result<Options, String> {
        Ok(Options { cap_bytes: Some(64 * MIB as u64), ..Options::host(256 * MIB as u64, 2 * MIB) })
    }
    let ip = new(capped);
    *runtime(&ip).info.lock().unwrap() = (100 * MIB, 140 * MIB);
    // Asked first, it makes the allocator: its cap bounds what a cudaMalloc could get.
    assert_eq!(ip.mem_get_info(), Ok((64 * MIB, 140 * MIB)));
    assert!(ip.devices().get(0).is_some());
    let (_, p) = malloc(&ip, 10 * MIB, None);
    let (_, q) = malloc(&ip, 20 * MIB, None);
    assert_eq!(ip.free(q as *mut c_void, None), code::SUCCESS);
    let a = ip.devices().owner(p).unwrap().1;
    let s = a.stats();
    let (reserved, allocated) =
        (s.reserved_bytes.current as usize, s.allocated_bytes.current as usize);
    assert!(reserved >= 30 * MIB && allocated == 10 * MIB, "{reserved} {allocated}");
    // The driver reports the memory MoonBright holds as used; what it holds unused is free to
    // a cudaMalloc, and what it may still create is bounded by its cap.
    *runtime(&ip).info.lock().unwrap() = (100 * MIB - reserved, 140 * MIB);
    let (free, total) = ip.mem_get_info().unwrap();
    assert_eq!(total, 140 * MIB);
    assert_eq!(free, (64 * MIB - reserved) + (reserved - allocated));
    // The driver's free memory bounds it too.
    *runtime(&ip).info.lock().unwrap() = (MIB, 140 * MIB);
    assert_eq!(ip.mem_get_info().unwrap().0, MIB + (reserved - allocated));
    // The runtime's error comes back.
    runtime(&ip).fail_get_device.store(100, Ordering::SeqCst);
    assert_eq!(ip.mem_get_info(), Err(100));
}

#[test]
fn mem_get_info_of_a_device_passed_through_is_the_drivers() {
    let ip = new(bad_options);
    *runtime(&ip).info.lock().unwrap() = (100 * MIB, 140 * MIB);
    assert_eq!(ip.mem_get_info(), Ok((100 * MIB, 140 * MIB)));
}
