//! Tests of the host backend: CUDA's rules enforced, bytes kept, memory given back. Not under
//! Miri, which cannot interpret the memfd and mmap calls.

use super::*;
use crate::driver::prelude::*;
use crate::driver::{Batch, ChunkHandle, EventHandle, MemInfo};

const PS: usize = 64 << 10;

fn driver(capacity: u64) -> HostDriver {
    match HostDriver::new(HostConfig { page_size: PS, capacity, ..Default::default() }) {
        Ok(d) => d,
        Err(e) => panic!("host driver: {e}"),
    }
}

fn small() -> HostDriver {
    driver(64 * PS as u64)
}

#[track_caller]
fn expect_code<T: fmt::Debug>(r: DriverResult<T>, call: CallKind, code: i32) -> DriverError {
    match r {
        Ok(v) => panic!("expected {call} to fail with code {code}, got Ok({v:?})"),
        Err(e) => {
            assert_eq!((e.call, e.code), (call, code), "wrong error: {e}");
            e
        }
    }
}

/// A reservation of `pages` pages with one chunk of `chunk_pages` mapped at its start.
fn mapped(d: &HostDriver, pages: usize, chunk_pages: usize) -> (u64, ChunkHandle) {
    let base = d.reserve(pages * PS, 0).unwrap();
    let c = d.create_chunk(chunk_pages * PS).unwrap();
    d.map(base, chunk_pages * PS, c).unwrap();
    (base, c)
}

#[test]
fn is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<HostDriver>();
}

#[test]
fn new_rejects_bad_config() {
    for (page_size, capacity) in [(0, 1 << 30), (3 << 16, 1 << 30), (1024, 1 << 30), (PS, 0)] {
        let r = HostDriver::new(HostConfig { page_size, capacity, ..Default::default() });
        expect_code(r, CallKind::MemInfo, code::INVALID_VALUE);
    }
    let d = HostDriver::new(HostConfig::default()).unwrap();
    assert_eq!(d.granularity(), 2 << 20);
    assert_eq!(d.mem_info().unwrap(), MemInfo { free: 64 << 30, total: 64 << 30 });
    assert_eq!(d.name(), "host");
}

#[test]
fn reserve_honours_alignment_and_rejects_bad_sizes() {
    let d = small();
    let big = 16 * PS;
    for _ in 0..4 {
        let va = d.reserve(PS, big).unwrap();
        assert_eq!(va % big as u64, 0);
    }
    assert_eq!(d.reserve(3 * PS, 0).unwrap() % PS as u64, 0);
    expect_code(d.reserve(0, 0), CallKind::Reserve, code::INVALID_VALUE);
    expect_code(d.reserve(PS + 1, 0), CallKind::Reserve, code::INVALID_VALUE);
    expect_code(d.reserve(PS, 3 * PS), CallKind::Reserve, code::INVALID_VALUE);
}

#[test]
fn create_rejects_sizes_off_the_granularity() {
    let d = small();
    expect_code(d.create_chunk(0), CallKind::Create, code::INVALID_VALUE);
    expect_code(d.create_chunk(PS / 2), CallKind::Create, code::INVALID_VALUE);
    expect_code(d.create_chunk(PS + 4096), CallKind::Create, code::INVALID_VALUE);
    let a = d.create_chunk(PS).unwrap();
    let b = d.create_chunk(PS).unwrap();
    assert!(b.0 > a.0, "handles increase");
    d.release_chunk(b).unwrap();
    let c = d.create_chunk(PS).unwrap();
    assert!(c.0 > b.0, "handles are never reused");
}

#[test]
fn map_rejects_misaligned_va_and_size() {
    let d = small();
    let base = d.reserve(4 * PS, 0).unwrap();
    let c = d.create_chunk(PS).unwrap();
    let e = expect_code(d.map(base + 4096, PS, c), CallKind::Map, code::INVALID_VALUE);
    assert!(e.message.contains("not aligned"), "{e}");
    expect_code(d.map(base, PS + 4096, c), CallKind::Map, code::INVALID_VALUE);
    expect_code(d.map(base, 0, c), CallKind::Map, code::INVALID_VALUE);
    expect_code(d.map(0, PS, c), CallKind::Map, code::INVALID_VALUE);
    assert_eq!(d.mapping_count(), 0);
    d.map(base, PS, c).unwrap();
    assert_eq!(d.mapping_count(), 1);
}

#[test]
fn map_rejects_a_size_other_than_the_chunks() {
    let d = small();
    let base = d.reserve(4 * PS, 0).unwrap();
    let c = d.create_chunk(2 * PS).unwrap();
    expect_code(d.map(base, PS, c), CallKind::Map, code::INVALID_VALUE);
    expect_code(d.map(base, 3 * PS, c), CallKind::Map, code::INVALID_VALUE);
    d.map(base, 2 * PS, c).unwrap();
}

#[test]
fn map_rejects_already_mapped_ranges() {
    let d = small();
    let (base, c) = mapped(&d, 4, 2);
    let e = expect_code(d.map(base, 2 * PS, c), CallKind::Map, code::INVALID_VALUE);
    assert!(e.message.contains("already mapped"), "{e}");
    let other = d.create_chunk(2 * PS).unwrap();
    // Overlapping the tail of the existing mapping, from inside it.
    let e = expect_code(d.map(base + PS as u64, 2 * PS, other), CallKind::Map, code::INVALID_VALUE);
    assert!(e.message.contains("already mapped"), "{e}");
    d.map(base + 2 * PS as u64, 2 * PS, other).unwrap();
    assert_eq!(d.mapping_count(), 2);
}

#[test]
fn map_rejects_ranges_outside_one_reservation() {
    let d = small();
    let base = d.reserve(2 * PS, 0).unwrap();
    let c = d.create_chunk(2 * PS).unwrap();
    // Runs past the end of the reservation.
    let e = expect_code(d.map(base + PS as u64, 2 * PS, c), CallKind::Map, code::INVALID_VALUE);
    assert!(e.message.contains("reservation"), "{e}");
    // Wholly outside any reservation (just past it: munmapped tail or someone else's).
    let past = base + 64 * PS as u64;
    expect_code(d.map(past, 2 * PS, c), CallKind::Map, code::INVALID_VALUE);
    // A freed reservation no longer counts.
    let gone = d.reserve(2 * PS, 0).unwrap();
    d.free_reservation(gone, 2 * PS).unwrap();
    expect_code(d.map(gone, 2 * PS, c), CallKind::Map, code::INVALID_VALUE);
    assert_eq!(d.mapping_count(), 0);
}

#[test]
fn map_rejects_released_and_unknown_handles() {
    let d = small();
    let base = d.reserve(4 * PS, 0).unwrap();
    let c = d.create_chunk(PS).unwrap();
    d.release_chunk(c).unwrap();
    expect_code(d.map(base, PS, c), CallKind::Map, code::INVALID_HANDLE);
    expect_code(d.map(base, PS, ChunkHandle(9999)), CallKind::Map, code::INVALID_HANDLE);
    // Released while mapped: the live mapping stays, but no new one may be made.
    let m = d.create_chunk(PS).unwrap();
    d.map(base, PS, m).unwrap();
    d.release_chunk(m).unwrap();
    expect_code(d.map(base + PS as u64, PS, m), CallKind::Map, code::INVALID_HANDLE);
}

#[test]
fn unmap_rejects_part_of_a_mapping() {
    let d = small();
    let (base, _) = mapped(&d, 4, 2);
    for (va, size) in
        [(base, PS), (base + PS as u64, PS), (base + PS as u64, 3 * PS), (base, 3 * PS)]
    {
        expect_code(d.unmap(va, size), CallKind::Unmap, code::INVALID_VALUE);
    }
    assert_eq!(d.mapping_count(), 1);
    d.unmap(base, 2 * PS).unwrap();
    assert_eq!(d.mapping_count(), 0);
}

#[test]
fn unmap_spanning_two_mappings_is_accepted() {
    let d = small();
    let (base, a) = mapped(&d, 4, 1);
    let b = d.create_chunk(2 * PS).unwrap();
    d.map(base + PS as u64, 2 * PS, b).unwrap();
    d.set_access(base, 3 * PS).unwrap();
    d.write(base + PS as u64 - 2, &[7, 8, 9, 10]).unwrap();
    let mut got = [0u8; 4];
    d.read(base + PS as u64 - 2, &mut got).unwrap();
    assert_eq!(got, [7, 8, 9, 10]);
    d.unmap(base, 3 * PS).unwrap();
    assert_eq!(d.mapping_count(), 0);
    // Both chunks survive the unmap (not released), and the addresses stay reserved.
    d.map(base, 2 * PS, b).unwrap();
    d.map(base + 2 * PS as u64, PS, a).unwrap();
}

#[test]
fn unmap_rejects_unmapped_ranges() {
    let d = small();
    let base = d.reserve(4 * PS, 0).unwrap();
    let e = expect_code(d.unmap(base, PS), CallKind::Unmap, code::INVALID_VALUE);
    assert!(e.message.contains("nothing is mapped"), "{e}");
    let c = d.create_chunk(PS).unwrap();
    d.map(base, PS, c).unwrap();
    // Mapped then a gap.
    expect_code(d.unmap(base, 2 * PS), CallKind::Unmap, code::INVALID_VALUE);
    d.unmap(base, PS).unwrap();
    expect_code(d.unmap(base, PS), CallKind::Unmap, code::INVALID_VALUE);
    expect_code(d.unmap(base + 4096, PS), CallKind::Unmap, code::INVALID_VALUE);
}

#[test]
fn set_access_rejects_gaps_and_allows_sub_ranges() {
    let d = small();
    let (base, _) = mapped(&d, 4, 1);
    let c = d.create_chunk(2 * PS).unwrap();
    d.map(base + 2 * PS as u64, 2 * PS, c).unwrap();
    // Page 1 is a hole.
    let e = expect_code(d.set_access(base, 4 * PS), CallKind::SetAccess, code::INVALID_VALUE);
    assert!(e.message.contains("not all mapped"), "{e}");
    expect_code(d.set_access(base + PS as u64, PS), CallKind::SetAccess, code::INVALID_VALUE);
    expect_code(
        d.set_access(base + 3 * PS as u64, 2 * PS),
        CallKind::SetAccess,
        code::INVALID_VALUE,
    );
    expect_code(d.set_access(base + 1, PS), CallKind::SetAccess, code::INVALID_VALUE);
    // A sub-range of one mapping: only that part becomes accessible.
    d.set_access(base + 3 * PS as u64, PS).unwrap();
    d.write(base + 3 * PS as u64, &[1; 16]).unwrap();
    expect_code(d.write(base + 2 * PS as u64, &[1; 16]), CallKind::Copy, code::INVALID_VALUE);
    expect_code(d.write(base + 3 * PS as u64 - 8, &[1; 16]), CallKind::Copy, code::INVALID_VALUE);
}

#[test]
fn read_and_write_need_set_access() {
    let d = small();
    let (base, c) = mapped(&d, 2, 1);
    let mut buf = [0u8; 8];
    let e = expect_code(d.write(base, &[1; 8]), CallKind::Copy, code::INVALID_VALUE);
    assert!(e.message.contains("not accessible"), "{e}");
    expect_code(d.read(base, &mut buf), CallKind::Copy, code::INVALID_VALUE);
    d.set_access(base, PS).unwrap();
    d.write(base, &[1; 8]).unwrap();
    d.read(base, &mut buf).unwrap();
    assert_eq!(buf, [1; 8]);
    // Past the end of the accessible range, and on unmapped memory.
    expect_code(d.read(base + PS as u64 - 4, &mut buf), CallKind::Copy, code::INVALID_VALUE);
    expect_code(d.read(base + PS as u64, &mut buf), CallKind::Copy, code::INVALID_VALUE);
    // A remap starts inaccessible again.
    d.unmap(base, PS).unwrap();
    d.map(base, PS, c).unwrap();
    expect_code(d.read(base, &mut buf), CallKind::Copy, code::INVALID_VALUE);
    d.set_access(base, PS).unwrap();
    d.read(base, &mut buf).unwrap();
    assert_eq!(buf, [1; 8], "the chunk kept its bytes across the remap");
}

#[test]
fn free_reservation_rejects_mapped_and_inexact_ranges() {
    let d = small();
    let (base, _) = mapped(&d, 4, 1);
    let e = expect_code(
        d.free_reservation(base, 4 * PS),
        CallKind::FreeReservation,
        code::INVALID_VALUE,
    );
    assert!(e.message.contains("still mapped"), "{e}");
    expect_code(d.free_reservation(base, 2 * PS), CallKind::FreeReservation, code::INVALID_VALUE);
    expect_code(
        d.free_reservation(base + PS as u64, 3 * PS),
        CallKind::FreeReservation,
        code::INVALID_VALUE,
    );
    d.unmap(base, PS).unwrap();
    d.free_reservation(base, 4 * PS).unwrap();
    expect_code(d.free_reservation(base, 4 * PS), CallKind::FreeReservation, code::INVALID_VALUE);
}

#[test]
fn data_written_through_one_mapping_reads_through_another() {
    let d = small();
    let (a, c) = mapped(&d, 2, 2);
    let b = d.reserve(2 * PS, 0).unwrap();
    d.map(b, 2 * PS, c).unwrap();
    d.set_access(a, 2 * PS).unwrap();
    d.set_access(b, 2 * PS).unwrap();
    let data: Vec<u8> = (0..3 * PS / 2).map(|i| (i * 31 % 251) as u8).collect();
    d.write(a + 100, &data).unwrap();
    let mut got = vec![0u8; data.len()];
    d.read(b + 100, &mut got).unwrap();
    assert_eq!(got, data);
    assert_eq!(d.mapping_count(), 2);
}

#[test]
fn release_while_mapped_frees_at_the_last_unmap() {
    let cap = 8 * PS as u64;
    let d = driver(cap);
    let (a, c) = mapped(&d, 4, 4);
    let b = d.reserve(4 * PS, 0).unwrap();
    d.map(b, 4 * PS, c).unwrap();
    d.set_access(a, 4 * PS).unwrap();
    d.set_access(b, 4 * PS).unwrap();
    d.write(a, b"moonbright").unwrap();
    d.release_chunk(c).unwrap();
    expect_code(d.release_chunk(c), CallKind::Release, code::INVALID_HANDLE);
    assert_eq!(d.live_chunk_bytes(), 4 * PS as u64);
    assert_eq!(d.mem_info().unwrap().free, cap - 4 * PS as u64);
    let mut got = [0u8; 10];
    d.unmap(a, 4 * PS).unwrap();
    d.read(b, &mut got).unwrap();
    assert_eq!(&got, b"moonbright");
    assert_eq!(d.live_chunk_bytes(), 4 * PS as u64, "still mapped at b");
    d.unmap(b, 4 * PS).unwrap();
    assert_eq!(d.live_chunk_bytes(), 0);
    assert_eq!(d.mem_info().unwrap(), MemInfo { free: cap, total: cap });
    expect_code(d.release_chunk(c), CallKind::Release, code::INVALID_HANDLE);
}

#[test]
fn create_fails_at_capacity_and_succeeds_after_a_release() {
    let d = driver(4 * PS as u64);
    let a = d.create_chunk(3 * PS).unwrap();
    let e = expect_code(d.create_chunk(2 * PS), CallKind::Create, code::OUT_OF_MEMORY);
    assert!(e.is_out_of_memory());
    let b = d.create_chunk(PS).unwrap();
    assert_eq!(d.mem_info().unwrap().free, 0);
    expect_code(d.create_chunk(PS), CallKind::Create, code::OUT_OF_MEMORY);
    d.release_chunk(a).unwrap();
    d.create_chunk(2 * PS).unwrap();
    d.release_chunk(b).unwrap();
    assert_eq!(d.live_chunk_bytes(), 2 * PS as u64);
}

#[test]
fn freed_offsets_are_reused_and_come_back_zeroed() {
    let d = small();
    let a = d.create_chunk(2 * PS).unwrap();
    let b = d.create_chunk(PS).unwrap();
    let base = d.reserve(2 * PS, 0).unwrap();
    d.map(base, 2 * PS, a).unwrap();
    d.set_access(base, 2 * PS).unwrap();
    d.write(base, &[0xAB; 64]).unwrap();
    d.unmap(base, 2 * PS).unwrap();
    d.release_chunk(a).unwrap();
    let len = d.lock().memory.file_len;
    // Fits in a's old offsets: the file does not grow, and the hole reads as zeros.
    let c = d.create_chunk(2 * PS).unwrap();
    assert_eq!(d.lock().memory.file_len, len);
    assert_eq!(d.lock().memory.chunks[&c.0].offset, 0);
    d.map(base, 2 * PS, c).unwrap();
    d.set_access(base, 2 * PS).unwrap();
    let mut got = [0xFFu8; 64];
    d.read(base, &mut got).unwrap();
    assert_eq!(got, [0; 64]);
    d.unmap(base, 2 * PS).unwrap();
    d.release_chunk(c).unwrap();
    d.release_chunk(b).unwrap();
    let st = d.lock();
    assert_eq!(
        (st.memory.file_end, st.memory.free_offsets.len()),
        (0, 0),
        "everything coalesced back"
    );
}

#[test]
fn untouched_chunks_cost_no_ram_and_freed_chunks_are_punched() {
    let gib = 1usize << 30;
    let d = driver(4 << 30);
    let base = d.reserve(gib, 0).unwrap();
    let c = d.create_chunk(gib).unwrap();
    d.map(base, gib, c).unwrap();
    d.set_access(base, gib).unwrap();
    assert_eq!(d.resident_bytes(), 0, "a mapped, accessible, untouched GiB costs nothing");
    for i in 0..4u64 {
        d.write(base + i * (256 << 20), &[1; 4096]).unwrap();
    }
    let touched = d.resident_bytes();
    // Four pages, or four huge pages where shmem uses transparent huge pages.
    assert!((4 * 4096..=4 * (2 << 20)).contains(&touched), "resident {touched}");
    d.release_chunk(c).unwrap();
    assert_eq!(d.resident_bytes(), touched, "still mapped: not freed yet");
    d.unmap(base, gib).unwrap();
    assert_eq!(d.resident_bytes(), 0, "freed chunk punched out");
}

#[test]
fn forty_gib_of_chunks_cost_only_the_bytes_touched() {
    // More device memory than a 24 GiB CI machine has RAM: fine while most of it is untouched.
    let d = HostDriver::new(HostConfig::default()).unwrap();
    let gib = 1usize << 30;
    let base = d.reserve(40 * gib, 0).unwrap();
    for i in 0..40u64 {
        let c = d.create_chunk(gib).unwrap();
        d.map(base + i * gib as u64, gib, c).unwrap();
        d.release_chunk(c).unwrap();
    }
    d.set_access(base, 40 * gib).unwrap();
    for i in 0..40u64 {
        d.write(base + i * gib as u64 + 12345, &[i as u8]).unwrap();
    }
    assert_eq!(d.mem_info().unwrap().free, 24 << 30);
    assert!(d.resident_bytes() <= 40 * (2 << 20), "resident {}", d.resident_bytes());
    let mut got = [0u8];
    d.read(base + 39 * gib as u64 + 12345, &mut got).unwrap();
    assert_eq!(got, [39]);
    d.unmap(base, 40 * gib).unwrap();
    assert_eq!((d.resident_bytes(), d.live_chunk_bytes()), (0, 0));
    d.free_reservation(base, 40 * gib).unwrap();
}

#[test]
fn a_held_streams_event_stays_pending_until_release() {
    let d = small();
    let s = d.create_stream().unwrap();
    let e = d.create_event().unwrap();
    assert!(d.event_done(e).unwrap(), "never recorded: done");
    d.record_event(e, s).unwrap();
    assert!(d.event_done(e).unwrap());
    d.hold_stream(s);
    d.record_event(e, s).unwrap();
    let other = d.create_event().unwrap();
    d.record_event(other, StreamHandle::DEFAULT).unwrap();
    assert!(!d.event_done(e).unwrap());
    assert!(d.event_done(other).unwrap(), "another stream is not held");
    d.release_stream(s);
    assert!(d.event_done(e).unwrap());
    // A new hold does not revive events of the old one.
    d.hold_stream(s);
    assert!(d.event_done(e).unwrap());
    d.record_event(e, s).unwrap();
    assert!(!d.event_done(e).unwrap());
    // Re-recording on a free stream supersedes the pending record.
    d.record_event(e, StreamHandle::DEFAULT).unwrap();
    assert!(d.event_done(e).unwrap());
    // Destroying a held stream lets its work finish.
    d.record_event(e, s).unwrap();
    d.destroy_stream(s).unwrap();
    assert!(d.event_done(e).unwrap());
    // The default stream can be held too.
    d.hold_stream(StreamHandle::DEFAULT);
    d.record_event(e, StreamHandle::DEFAULT).unwrap();
    assert!(!d.event_done(e).unwrap());
    d.release_stream(StreamHandle::DEFAULT);
    assert!(d.event_done(e).unwrap());
}

#[test]
fn unknown_handles_are_rejected() {
    let d = small();
    let s = d.create_stream().unwrap();
    let e = d.create_event().unwrap();
    expect_code(d.release_chunk(ChunkHandle(42)), CallKind::Release, code::INVALID_HANDLE);
    expect_code(d.destroy_stream(StreamHandle(42)), CallKind::StreamDestroy, code::INVALID_HANDLE);
    expect_code(
        d.destroy_stream(StreamHandle::DEFAULT),
        CallKind::StreamDestroy,
        code::INVALID_HANDLE,
    );
    expect_code(d.record_event(e, StreamHandle(42)), CallKind::EventRecord, code::INVALID_HANDLE);
    expect_code(d.record_event(EventHandle(42), s), CallKind::EventRecord, code::INVALID_HANDLE);
    expect_code(d.event_done(EventHandle(42)), CallKind::EventQuery, code::INVALID_HANDLE);
    expect_code(d.destroy_event(EventHandle(42)), CallKind::EventDestroy, code::INVALID_HANDLE);
    d.destroy_stream(s).unwrap();
    d.destroy_event(e).unwrap();
    expect_code(d.destroy_stream(s), CallKind::StreamDestroy, code::INVALID_HANDLE);
    expect_code(
        d.record_event(e, StreamHandle::DEFAULT),
        CallKind::EventRecord,
        code::INVALID_HANDLE,
    );
    expect_code(d.event_done(e), CallKind::EventQuery, code::INVALID_HANDLE);
    expect_code(d.destroy_event(e), CallKind::EventDestroy, code::INVALID_HANDLE);
}

#[test]
fn concurrent_use_from_threads() {
    let d = driver(256 * PS as u64);
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let d = &d;
            scope.spawn(move || {
                for i in 0..20u8 {
                    let base = d.reserve(2 * PS, 0).unwrap();
                    let c = d.create_chunk(2 * PS).unwrap();
                    d.map(base, 2 * PS, c).unwrap();
                    d.set_access(base, 2 * PS).unwrap();
                    d.write(base + PS as u64, &[t, i]).unwrap();
                    d.release_chunk(c).unwrap();
                    let mut got = [0u8; 2];
                    d.read(base + PS as u64, &mut got).unwrap();
                    assert_eq!(got, [t, i]);
                    d.unmap(base, 2 * PS).unwrap();
                    d.free_reservation(base, 2 * PS).unwrap();
                }
            });
        }
    });
    assert_eq!((d.live_chunk_bytes(), d.mapping_count(), d.resident_bytes()), (0, 0, 0));
}

#[test]
fn drop_unmaps_everything_and_closes_the_memfd() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let d = small();
    let (base, _) = mapped(&d, 4, 2);
    d.set_access(base, 2 * PS).unwrap();
    d.write(base, &[5; 8]).unwrap();
    let fd = d.lock().memory.fd.as_raw_fd();
    // Inode numbers tell this memfd apart from those of tests running alongside.
    let ino = std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap().ino();
    let maps_it = || {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().any(|l| l.split_whitespace().nth(4) == Some(&ino.to_string()))
    };
    let opens_it = || {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .any(|e| std::fs::metadata(e.path()).is_ok_and(|m| m.ino() == ino && m.nlink() == 0))
    };
    assert!(maps_it() && opens_it(), "the probe must see the live driver");
    drop(d);
    assert!(!maps_it(), "a mapping of the memfd survived drop");
    assert!(!opens_it(), "the memfd is still open after drop");
}

fn costed(costs: HostDriverCosts) -> HostDriver {
    match HostDriver::new(HostConfig { page_size: PS, capacity: 64 * PS as u64, costs }) {
        Ok(d) => d,
        Err(e) => panic!("host driver: {e}"),
    }
}

/// Makes `n` one-page chunks, maps them back to back and sets access (in one batch when
/// `batch`), unmaps them all with one call (its own batch when `batch`), and releases them.
/// Returns the time it took.
fn map_set_unmap(d: &HostDriver, n: usize, batch: bool) -> std::time::Duration {
    let start = std::time::Instant::now();
    let base = d.reserve(n * PS, 0).unwrap();
    let chunks: Vec<ChunkHandle> = (0..n).map(|_| d.create_chunk(PS).unwrap()).collect();
    let b = if batch { d.begin_batch() } else { Batch(false) };
    assert_eq!(b.0, batch && d.costs() == HostDriverCosts::DeviceTables);
    for (i, &c) in chunks.iter().enumerate() {
        d.map(base + (i * PS) as u64, PS, c).unwrap();
    }
    d.set_access(base, n * PS).unwrap();
    d.end_batch(b);
    let b = if batch { d.begin_batch() } else { Batch(false) };
    d.unmap(base, n * PS).unwrap();
    d.end_batch(b);
    for c in chunks {
        d.release_chunk(c).unwrap();
    }
    start.elapsed()
}

#[test]
fn each_cost_model_charges_what_it_claims() {
    use cuda_costs as cu;
    use device_table_costs::{LAUNCH, TLB_INVALIDATION};
    let n = 8u32;
    let driver_side = cu::RESERVE + (cu::CREATE + cu::RELEASE) * n;
    for (costs, batch, want) in [
        (HostDriverCosts::None, true, std::time::Duration::ZERO),
        (HostDriverCosts::None, false, std::time::Duration::ZERO),
        (HostDriverCosts::Cuda, true, driver_side + cu::MAP * n + cu::SET_ACCESS + cu::UNMAP),
        (HostDriverCosts::Cuda, false, driver_side + cu::MAP * n + cu::SET_ACCESS + cu::UNMAP),
        // A batch of n maps and a set access is one launch; an unmap batch one launch and one
        // TLB invalidation.
        (HostDriverCosts::DeviceTables, true, driver_side + LAUNCH * 2 + TLB_INVALIDATION),
        // Outside a batch each call is a launch of its own.
        (HostDriverCosts::DeviceTables, false, driver_side + LAUNCH * (n + 2) + TLB_INVALIDATION),
    ] {
        let d = costed(costs);
        let took = map_set_unmap(&d, n as usize, batch);
        assert_eq!(d.charged_cost(), want, "{costs:?}, batch {batch}");
        // The charge is spent, not only counted (a lower bound only: a busy machine is slower).
        assert!(took >= want, "{costs:?}: {took:?} < {want:?}");
        assert_eq!((d.mapping_count(), d.live_chunk_bytes()), (0, 0));
    }
}

#[test]
fn costs_change_no_outcome() {
    // The same calls, refused ones among them, give the same outcomes under every model.
    let outcomes = |costs| {
        let d = costed(costs);
        let mut out: Vec<Result<(), (CallKind, i32)>> = Vec::new();
        let mut note = |r: DriverResult<()>| out.push(r.map_err(|e| (e.call, e.code)));
        let base = d.reserve(4 * PS, 0).unwrap();
        let a = d.create_chunk(2 * PS).unwrap();
        let b = d.begin_batch();
        note(d.map(base, 2 * PS, a));
        note(d.map(base, 2 * PS, a)); // already mapped
        note(d.set_access(base, 4 * PS)); // half unmapped
        note(d.set_access(base, 2 * PS));
        d.end_batch(b);
        note(d.unmap(base, PS)); // inside a mapping
        note(d.release_chunk(a));
        note(d.unmap(base, 2 * PS));
        note(d.release_chunk(a)); // released already
        note(d.create_chunk(128 * PS).map(|_| ())); // beyond the capacity
        note(d.free_reservation(base, 4 * PS));
        (out, d.mapping_count(), d.live_chunk_bytes())
    };
    let none = outcomes(HostDriverCosts::None);
    assert_eq!(none.0.iter().filter(|r| r.is_err()).count(), 5, "{none:?}");
    for costs in [HostDriverCosts::Cuda, HostDriverCosts::DeviceTables] {
        assert_eq!(outcomes(costs), none, "{costs:?}");
    }
}

#[test]
fn a_batch_absorbs_only_its_own_backends_calls() {
    let (d, other) = (costed(HostDriverCosts::DeviceTables), costed(HostDriverCosts::DeviceTables));
    let (va, c) = (d.reserve(PS, 0).unwrap(), d.create_chunk(PS).unwrap());
    let (ova, oc) = (other.reserve(PS, 0).unwrap(), other.create_chunk(PS).unwrap());
    let before = (d.charged_cost(), other.charged_cost());
    let b = d.begin_batch();
    assert!(b.0);
    let inner = d.begin_batch();
    assert!(!inner.0, "a batch begun inside another does nothing");
    d.map(va, PS, c).unwrap();
    d.end_batch(inner);
    assert_eq!(d.charged_cost(), before.0, "the write waits for the batch's launch");
    other.map(ova, PS, oc).unwrap();
    assert_eq!(other.charged_cost() - before.1, device_table_costs::LAUNCH, "not in d's batch");
    d.end_batch(b);
    assert_eq!(d.charged_cost() - before.0, device_table_costs::LAUNCH);
    // An empty batch launches nothing.
    let b = d.begin_batch();
    d.end_batch(b);
    assert_eq!(d.charged_cost() - before.0, device_table_costs::LAUNCH);
}
