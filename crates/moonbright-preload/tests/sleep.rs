//! Tags, sleep and wake through the interposer, over a fake CUDA runtime and MoonBright's host
//! backend: what a thread `cudaMalloc`s under a tag sleeps, after the device's work, and wakes
//! with its bytes at its addresses, on the current device only; every refusal is a
//! `cudaError_t` with its message.

mod common;

use std::ffi::{c_void, CStr};
use std::sync::atomic::Ordering;

use common::*;
use moonbright::{Allocator, Options};
use moonbright_preload::{code, Interposer, BACKUP_DISCARD, BACKUP_HOST};

/// `cudaMalloc`s `sizes` under `tag`, each filled with a pattern of its own.
fn tagged(ip: &Interposer<Fake>, tag: &CStr, sizes: &[usize]) -> Vec<(u64, Vec<u8>)> {
    // SAFETY: `tag` is NUL-terminated.
    let previous = unsafe { ip.tag_begin(tag.as_ptr()) };
    assert!(previous >= 0, "{:?}", ip.last_error());
    let blocks = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let (r, p) = malloc(ip, size, None);
            assert_eq!(r, code::SUCCESS, "{:?}", ip.last_error());
            let bytes: Vec<u8> = (0..size).map(|j| (j * 3 + i * 11 + 5) as u8).collect();
            allocator(ip, p).write(p, &bytes).unwrap();
            (p, bytes)
        })
        .collect();
    assert_eq!(ip.tag_end(previous), code::SUCCESS);
    blocks
}

fn allocator(ip: &Interposer<Fake>, p: u64) -> &Allocator {
    ip.devices().owner(p).expect("MoonBright's memory").1
}

fn intact(ip: &Interposer<Fake>, blocks: &[(u64, Vec<u8>)]) -> bool {
    blocks.iter().all(|(p, bytes)| {
        let mut back = vec![0u8; bytes.len()];
        allocator(ip, *p).read(*p, &mut back).unwrap();
        &back == bytes
    })
}

/// The report's entry for `tag` on `device`.
fn reported(ip: &Interposer<Fake>, device: i64, tag: &str) -> serde_json::Value {
    let report: serde_json::Value = serde_json::from_str(&ip.report()).unwrap();
    let d = report["devices"].as_array().unwrap().iter().find(|d| d["device"] == device).unwrap();
    d["tags"].as_array().unwrap().iter().find(|t| t["name"] == tag).cloned().unwrap_or_default()
}

/// Below a page, a page, several pages (2 MiB pages).
const SIZES: [usize; 3] = [1000, 2 * MIB, 5 * MIB + 512];

#[test]
fn a_tags_cuda_mallocs_sleep_and_wake_with_their_bytes_at_their_addresses() {
    let ip = new(host_options);
    let weights = tagged(&ip, c"preload-weights", &SIZES);
    let other = tagged(&ip, c"preload-other", &SIZES);
    let (_, untagged) = malloc(&ip, 3 * MIB, None);
    let a = allocator(&ip, untagged);
    let reserved = a.stats().reserved_bytes.current;

    // SAFETY: the names are NUL-terminated.
    unsafe {
        assert_eq!(ip.sleep(c"preload-weights".as_ptr(), BACKUP_HOST), code::SUCCESS);
        let asleep = a.stats().asleep_bytes.current;
        assert!(asleep >= SIZES.iter().sum::<usize>() as u64, "{asleep}");
        assert_eq!(a.stats().reserved_bytes.current, reserved - asleep, "given back");
        assert!(a.host_memory() >= asleep);
        let t = reported(&ip, 0, "preload-weights");
        assert_eq!((t["asleep"].as_bool(), t["backed_up"].as_bool()), (Some(true), Some(true)));
        assert_eq!(t["allocations"], SIZES.len());
        let report: serde_json::Value = serde_json::from_str(&ip.report()).unwrap();
        assert_eq!(report["devices"][0]["asleep_bytes"], asleep);
        assert!(intact(&ip, &other), "another tag was touched");
        // A cudaMalloc's memory has no stream for the sleep to wait on: it waits for the device.
        assert_eq!(runtime(&ip).take(), vec![Call::Synchronize(0)]);

        assert_eq!(ip.wake(c"preload-weights".as_ptr()), code::SUCCESS, "{:?}", ip.last_error());
        assert!(intact(&ip, &weights), "bytes or addresses changed");
        assert_eq!(a.stats().asleep_bytes.current, 0);
        assert_eq!(reported(&ip, 0, "preload-weights")["asleep"], false);
        assert!(runtime(&ip).take().is_empty(), "a wake does not wait for the device");

        // What the sleep held is kept for the next one until given back.
        assert!(a.host_memory() > 0);
        assert_eq!(ip.release_host_memory(), code::SUCCESS);
        assert_eq!(a.host_memory(), 0);
    }
    for (p, _) in weights.iter().chain(&other) {
        assert_eq!(ip.free(*p as *mut c_void, None), code::SUCCESS, "{:?}", ip.last_error());
    }
    assert_eq!(ip.free(untagged as *mut c_void, None), code::SUCCESS);
    a.check_invariants().unwrap();
}

#[test]
fn a_discarded_tag_wakes_usable_and_holds_no_host_memory() {
    let ip = new(host_options);
    let kv = tagged(&ip, c"preload-kv", &SIZES);
    let a = allocator(&ip, kv[0].0);
    // SAFETY: the name is NUL-terminated.
    unsafe {
        assert_eq!(ip.sleep(c"preload-kv".as_ptr(), BACKUP_DISCARD), code::SUCCESS);
        assert_eq!(a.host_memory(), 0);
        assert_eq!(reported(&ip, 0, "preload-kv")["backed_up"], false);
        assert_eq!(ip.wake(c"preload-kv".as_ptr()), code::SUCCESS, "{:?}", ip.last_error());
    }
    let rewritten: Vec<(u64, Vec<u8>)> =
        kv.iter().map(|(p, bytes)| (*p, bytes.iter().map(|b| !b).collect())).collect();
    for (p, bytes) in &rewritten {
        a.write(*p, bytes).unwrap();
    }
    assert!(intact(&ip, &rewritten), "woken memory is not usable at its addresses");
    for (p, _) in kv {
        assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    }
}

#[test]
fn a_sleeping_tag_refuses_what_would_change_it_with_illegal_state() {
    let ip = new(host_options);
    let blocks = tagged(&ip, c"preload-state", &SIZES);
    let tag = c"preload-state".as_ptr();
    // SAFETY: the names are NUL-terminated.
    unsafe {
        assert_eq!(ip.wake(tag), code::ILLEGAL_STATE, "awake");
        assert!(ip.last_error().unwrap().contains("awake"), "{:?}", ip.last_error());
        assert_eq!(ip.sleep(tag, BACKUP_HOST), code::SUCCESS);
        assert_eq!(ip.sleep(tag, BACKUP_HOST), code::ILLEGAL_STATE);
        assert!(ip.last_error().unwrap().contains("asleep already"), "{:?}", ip.last_error());
        // cudaMalloc under the tag, cudaFree and cudaFreeAsync of its memory.
        let previous = ip.tag_begin(tag);
        assert_eq!(malloc(&ip, 100, None), (code::ILLEGAL_STATE, 0));
        assert!(ip.last_error().unwrap().contains("asleep"), "{:?}", ip.last_error());
        assert_eq!(malloc(&ip, 4 * MIB, Some(0)), (code::ILLEGAL_STATE, 0));
        assert_eq!(ip.tag_end(previous), code::SUCCESS);
        for (p, _) in &blocks {
            assert_eq!(ip.free(*p as *mut c_void, None), code::ILLEGAL_STATE);
            assert_eq!(ip.free(*p as *mut c_void, Some(0)), code::ILLEGAL_STATE);
        }
        // Untagged requests carry on.
        let (r, p) = malloc(&ip, 100, None);
        assert_eq!(r, code::SUCCESS);
        assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
        assert_eq!(ip.wake(tag), code::SUCCESS, "{:?}", ip.last_error());
        assert_eq!(ip.wake(tag), code::ILLEGAL_STATE, "woken already");
    }
    assert!(intact(&ip, &blocks));
    for (p, _) in blocks {
        assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    }
}

#[test]
fn a_wake_short_of_memory_fails_and_leaves_the_tag_asleep_and_whole() {
    fn capped() -> Result<Options, String> {
        Ok(Options { cap_bytes: Some(64 * MIB as u64), ..Options::host(256 * MIB as u64, 2 * MIB) })
    }
    let ip = new(capped);
    let blocks = tagged(&ip, c"preload-oom", &[8 * MIB]);
    let a = allocator(&ip, blocks[0].0);
    let tag = c"preload-oom".as_ptr();
    // SAFETY: the name is NUL-terminated.
    unsafe {
        assert_eq!(ip.sleep(tag, BACKUP_HOST), code::SUCCESS);
        let (r, filler) = malloc(&ip, 58 * MIB, None);
        assert_eq!(r, code::SUCCESS, "{:?}", ip.last_error());
        assert_eq!(ip.wake(tag), code::MEMORY_ALLOCATION);
        assert!(ip.last_error().unwrap().contains("device 0"), "{:?}", ip.last_error());
        assert_eq!(reported(&ip, 0, "preload-oom")["asleep"], true);
        assert_eq!(ip.free(filler as *mut c_void, None), code::SUCCESS);
        assert_eq!(ip.wake(tag), code::SUCCESS, "{:?}", ip.last_error());
    }
    assert!(intact(&ip, &blocks), "the failed wake lost bytes");
    a.check_invariants().unwrap();
}

#[test]
fn sleep_and_wake_act_on_the_current_device_only() {
    let ip = new(host_options);
    let on0 = tagged(&ip, c"preload-devices", &SIZES);
    runtime(&ip).device.store(1, Ordering::SeqCst);
    let on1 = tagged(&ip, c"preload-devices", &SIZES);
    assert_eq!(ip.devices().owner(on1[0].0).unwrap().0, 1);
    let tag = c"preload-devices".as_ptr();
    // SAFETY: the name is NUL-terminated.
    unsafe {
        assert_eq!(ip.sleep(tag, BACKUP_HOST), code::SUCCESS);
        assert_eq!(reported(&ip, 1, "preload-devices")["asleep"], true);
        assert_eq!(reported(&ip, 0, "preload-devices")["asleep"], false);
        assert!(intact(&ip, &on0), "device 0's memory is awake");
        runtime(&ip).device.store(0, Ordering::SeqCst);
        assert_eq!(ip.wake(tag), code::ILLEGAL_STATE, "awake on device 0");
        runtime(&ip).device.store(1, Ordering::SeqCst);
        assert_eq!(ip.wake(tag), code::SUCCESS, "{:?}", ip.last_error());
    }
    assert!(intact(&ip, &on1));
}

#[test]
fn bad_names_and_arguments_are_invalid_values_and_change_nothing() {
    let ip = new(host_options);
    let blocks = tagged(&ip, c"preload-args", &SIZES[..1]);
    let not_utf8 = c"preload-\xff";
    let too_long = std::ffi::CString::new("t".repeat(moonbright::tags::MAX_TAG_LEN + 1)).unwrap();
    // SAFETY: every name is NUL-terminated or null where the test means it.
    unsafe {
        for (name, expected) in [
            (std::ptr::null(), "null"),
            (c"".as_ptr(), "1 to 256 bytes"),
            (too_long.as_ptr(), "1 to 256 bytes"),
            (not_utf8.as_ptr(), "not UTF-8"),
        ] {
            assert_eq!(ip.tag_begin(name), -1, "{expected}");
            assert!(ip.last_error().unwrap().contains(expected), "{:?}", ip.last_error());
            assert_eq!(moonbright::tags::current_name(), None, "the thread's tag is unchanged");
            assert_eq!(ip.sleep(name, BACKUP_HOST), code::INVALID_VALUE, "{expected}");
            assert!(ip.last_error().unwrap().contains(expected), "{:?}", ip.last_error());
            assert_eq!(ip.wake(name), code::INVALID_VALUE, "{expected}");
        }
        assert_eq!(ip.sleep(c"preload-args".as_ptr(), 2), code::INVALID_VALUE);
        assert!(ip.last_error().unwrap().contains("backup 2"), "{:?}", ip.last_error());
        assert_eq!(ip.sleep(c"preload-args".as_ptr(), -1), code::INVALID_VALUE);
        assert_eq!(ip.tag_end(-1), code::INVALID_VALUE, "a failed begin's -1");
        assert_eq!(moonbright::tags::current_name(), None);
    }
    assert_eq!(reported(&ip, 0, "preload-args")["asleep"], false);
    assert!(intact(&ip, &blocks));
    assert!(runtime(&ip).take().is_empty());
}

#[test]
fn without_moonbrights_allocator_there_is_nothing_to_sleep() {
    // The device's allocator cannot be made: its memory is the runtime's.
    let ip = new(bad_options);
    // SAFETY: the name is NUL-terminated.
    unsafe {
        assert_eq!(ip.sleep(c"preload-refused".as_ptr(), BACKUP_HOST), code::NOT_SUPPORTED);
        assert!(ip.last_error().unwrap().contains("CUDA runtime"), "{:?}", ip.last_error());
        assert_eq!(ip.wake(c"preload-refused".as_ptr()), code::NOT_SUPPORTED);
        assert_eq!(ip.release_host_memory(), code::NOT_SUPPORTED);
    }
    // The runtime's error for the current device comes back.
    let ip = new(host_options);
    runtime(&ip).fail_get_device.store(100, Ordering::SeqCst);
    // SAFETY: the name is NUL-terminated.
    assert_eq!(unsafe { ip.sleep(c"preload-refused".as_ptr(), BACKUP_HOST) }, 100);
    assert!(ip.last_error().unwrap().contains("cudaGetDevice"), "{:?}", ip.last_error());
    assert!(ip.devices().created().next().is_none());
}

#[test]
fn a_failed_synchronisation_leaves_the_tag_awake() {
    let ip = new(host_options);
    let blocks = tagged(&ip, c"preload-sync", &SIZES);
    runtime(&ip).fail_sync.store(700, Ordering::SeqCst);
    // SAFETY: the name is NUL-terminated.
    assert_eq!(unsafe { ip.sleep(c"preload-sync".as_ptr(), BACKUP_HOST) }, 700);
    assert!(ip.last_error().unwrap().contains("synchronising"), "{:?}", ip.last_error());
    assert_eq!(reported(&ip, 0, "preload-sync")["asleep"], false);
    runtime(&ip).fail_sync.store(0, Ordering::SeqCst);
    assert!(intact(&ip, &blocks));
    for (p, _) in blocks {
        assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    }
}

#[test]
fn a_sleep_before_any_allocation_makes_the_allocator_and_refuses_the_tag_until_woken() {
    let ip = new(host_options);
    // SAFETY: the name is NUL-terminated.
    unsafe {
        assert_eq!(ip.sleep(c"preload-early".as_ptr(), BACKUP_DISCARD), code::SUCCESS);
        assert!(ip.devices().get(0).is_some());
        let previous = ip.tag_begin(c"preload-early".as_ptr());
        assert_eq!(malloc(&ip, 100, None).0, code::ILLEGAL_STATE);
        assert_eq!(ip.wake(c"preload-early".as_ptr()), code::SUCCESS);
        let (r, p) = malloc(&ip, 100, None);
        assert_eq!(r, code::SUCCESS);
        assert_eq!(ip.tag_end(previous), code::SUCCESS);
        assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
    }
}
