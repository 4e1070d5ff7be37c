//! Sharing allocations between processes (`Allocator::export`, `Export::send`/`recv`,
//! `Allocator::import`/`close_import`) on the host backend, whose chunks live in a memfd that
//! another process can map: the same bytes seen from both sides, in this process and in a child
//! process; every refusal; and every driver failure on the way, with nothing left behind.
#![cfg(not(miri))]

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};

use moonbright::{Allocator, CallKind, Error, Export, Options};
use moonbright_testkit::stats::median;

const PAGE: usize = 64 << 10;

/// A host allocator capped at `pages` pages.
fn host(pages: u64) -> Allocator {
    let bytes = pages * PAGE as u64;
    Allocator::new(Options { cap_bytes: Some(bytes), ..Options::host(bytes, PAGE) }).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// An allocation of `pages` pages stitched from that many chunks scattered over the pool: the
/// cap leaves no room but the pages freed between live ones.
fn stitched(a: &Allocator, pages: usize) -> u64 {
    let singles: Vec<u64> = (0..2 * pages).map(|_| a.malloc(PAGE).unwrap()).collect();
    for p in singles.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    a.malloc(pages * PAGE).unwrap()
}

/// Sends `export` through a socket pair and returns what came out the other end.
fn through_socket(export: &Export) -> Export {
    let (x, y) = UnixStream::pair().unwrap();
    export.send(&x).unwrap();
    Export::recv(&y).unwrap()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Held by every test here for its whole run: some count the process's open descriptors, which
/// the others' memfds and sockets would change if they ran at once (`cargo test` runs a file's
/// tests on parallel threads).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn an_import_sees_the_exporters_bytes_and_the_exporter_sees_its_writes() {
    let _one = one_at_a_time();
    let a = host(8);
    let b = host(8);
    let p = stitched(&a, 4);
    let len = 4 * PAGE - 1000;
    a.write(p, &pattern(len, 1)).unwrap();
    let export = a.export(p).unwrap();
    assert_eq!(export.chunks().len(), 4, "stitched from four chunks");
    assert_eq!((export.size(), export.offset(), export.backend()), (4 * PAGE as u64, 0, "host"));
    let q = b.import(&through_socket(&export)).unwrap();
    assert_ne!(q, p);
    let mut seen = vec![0u8; len];
    b.read(q, &mut seen).unwrap();
    assert_eq!(seen, pattern(len, 1));
    b.write(q + 10, &pattern(5000, 9)).unwrap();
    let mut back = vec![0u8; 5000];
    a.read(p + 10, &mut back).unwrap();
    assert_eq!(back, pattern(5000, 9), "the exporter sees the importer's writes");
    assert_eq!(b.imports(), vec![(q, 4 * PAGE as u64)]);
    assert_eq!(b.stats().allocated_bytes.current, 0, "an import is not the importer's memory");
    let maps = b.driver().inner().as_host().unwrap().mapping_count();
    b.close_import(q).unwrap();
    assert_eq!(b.driver().inner().as_host().unwrap().mapping_count(), maps - 4);
    assert!(b.imports().is_empty());
    assert!(matches!(b.close_import(q), Err(Error::Ipc(_))), "a second close is refused");
    a.free(p).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn growables_are_shared_and_blocks_that_share_their_page_are_refused() {
    let _one = one_at_a_time();
    let a = host(8);
    let b = host(8);
    // Three blocks below a page, carved from one page: exporting one would hand the importer
    // the other two (and whatever later lands in that page).
    let small: Vec<u64> = (0..3).map(|_| a.malloc(1000).unwrap()).collect();
    a.write(small[2], &pattern(1000, 7)).unwrap();
    let calls = a.stats().driver_calls.get(CallKind::Export);
    match a.export(small[2]) {
        Err(Error::Ipc(m)) => assert!(m.contains("other allocations share"), "{m}"),
        other => panic!("a block below a page was exported: {other:?}"),
    }
    assert_eq!(a.stats().driver_calls.get(CallKind::Export), calls, "refused before the driver");
    for p in small {
        a.free(p).unwrap();
    }

    let g = a.reserve_growable(4 * PAGE).unwrap();
    assert!(matches!(a.export(g), Err(Error::InvalidArgument(_))), "nothing committed yet");
    a.resize(g, 2 * PAGE).unwrap();
    a.write(g, &pattern(2 * PAGE, 3)).unwrap();
    let e = a.export(g).unwrap();
    let q = b.import(&through_socket(&e)).unwrap();
    let mut seen = vec![0u8; 2 * PAGE];
    b.read(q, &mut seen).unwrap();
    assert_eq!(seen, pattern(2 * PAGE, 3));
    b.close_import(q).unwrap();
    a.check_invariants().unwrap();
}

/// A host allocator that carves (`carve` 1.0) cached chunks of four pages.
fn carving() -> Allocator {
    Allocator::new(Options {
        carve: 1.0,
        cap_fraction: 1.0,
        max_chunk_bytes: 4 * PAGE as u64,
        ..Options::host(256 * PAGE as u64, PAGE)
    })
    .unwrap()
}

#[test]
fn an_export_never_reaches_memory_beyond_the_allocation() {
    let _one = one_at_a_time();
    let a = carving();
    let page = PAGE as u64;
    let kind = |at: u64| a.segments().into_iter().find(|s| s.addr <= at && at < s.addr + s.size);
    let _keep = a.malloc(9 * PAGE).unwrap();
    // Twelve pages in three chunks of four, freed: cached.
    let twelve = a.malloc(12 * PAGE).unwrap();
    let whole = a.export(twelve).unwrap();
    assert_eq!(whole.chunks().len(), 3, "an allocation of its own range shares its chunks");
    assert_eq!(whole.chunks().iter().map(|c| c.size).sum::<u64>(), 12 * page);
    drop(whole);
    a.free(twelve).unwrap();
    // The exported range was not cached: carving needs a cached range of fresh memory.
    let twelve = a.malloc(12 * PAGE).unwrap();
    a.free(twelve).unwrap();
    // Carved out of those chunks: three pages at the end, five across the first two's seam,
    // and three at the start, which hold a secret of their own.
    let three = a.malloc(3 * PAGE).unwrap();
    let five = a.malloc(5 * PAGE).unwrap();
    let neighbour = a.malloc(3 * PAGE).unwrap();
    assert_eq!(kind(five).unwrap().kind, "carved", "carving set up as intended");
    a.write(neighbour, &pattern(3 * PAGE, 42)).unwrap();
    for p in [three, five, neighbour] {
        match a.export(p) {
            Err(Error::Ipc(m)) => assert!(m.contains("carved from a run of cached chunks"), "{m}"),
            Ok(e) => panic!(
                "{p:#x} ({} bytes) exported with {} bytes of chunks at offset {}",
                e.size(),
                e.chunks().iter().map(|c| c.size).sum::<u64>(),
                e.offset()
            ),
            Err(other) => panic!("{other:?}"),
        }
    }
    a.check_invariants().unwrap();
}

#[test]
fn freed_exported_memory_goes_back_to_the_driver_and_never_to_another_allocation() {
    let _one = one_at_a_time();
    let a = host(8);
    let b = host(8);
    let p = stitched(&a, 2);
    a.write(p, &pattern(2 * PAGE, 1)).unwrap();
    let e = a.export(p).unwrap();
    assert_eq!(e.chunks().len(), 2);
    let q = b.import(&e).unwrap();
    let released = a.stats().driver_calls.get(CallKind::Release);
    a.free(p).unwrap();
    // The same request again: before, the cache handed the exported range back as it was.
    let again = a.malloc(2 * PAGE).unwrap();
    a.write(again, &pattern(2 * PAGE, 77)).unwrap();
    let mut seen = vec![0u8; 2 * PAGE];
    b.read(q, &mut seen).unwrap();
    assert_eq!(seen, pattern(2 * PAGE, 1), "the importer sees another allocation's bytes");
    b.write(q, &pattern(PAGE, 5)).unwrap();
    let mut mine = vec![0u8; PAGE];
    a.read(again, &mut mine).unwrap();
    assert_eq!(mine, pattern(PAGE, 77), "the importer wrote into another allocation");
    // Unmapped (the next batch), the two chunks go back to the driver, not to the pool.
    a.flush().unwrap();
    assert_eq!(a.stats().driver_calls.get(CallKind::Release), released + 2);
    a.check_invariants().unwrap();
    // Freed and flushed again, the new allocation's chunks are cached as ever.
    a.free(again).unwrap();
    a.flush().unwrap();
    assert_eq!(a.stats().driver_calls.get(CallKind::Release), released + 2);
    b.close_import(q).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn freed_exported_memory_does_not_count_against_the_cap_for_long() {
    let _one = one_at_a_time();
    let a = host(8);
    let b = host(8);
    let p = a.malloc(6 * PAGE).unwrap();
    let q = b.import(&a.export(p).unwrap()).unwrap();
    a.free(p).unwrap();
    // Six of the eight pages are doomed (exported, freed, not yet released): a request of six
    // gives them back to the driver first rather than fail.
    let again = a.malloc(6 * PAGE).unwrap();
    a.check_invariants().unwrap();
    a.free(again).unwrap();
    b.close_import(q).unwrap();
}

#[test]
fn a_failed_release_of_freed_exported_memory_is_reported_and_retried() {
    let _one = one_at_a_time();
    let a = host(8);
    let p = a.malloc(2 * PAGE).unwrap();
    drop(a.export(p).unwrap());
    a.free(p).unwrap();
    let reserved = a.stats().reserved_bytes.current;
    let released = a.stats().driver_calls.get(CallKind::Release);
    a.driver().fail_nth(CallKind::Release, 1, None);
    // The unmap goes through; the release of the doomed chunk fails: a deferred error, and the
    // chunk stays held, doomed, never reused.
    a.flush().unwrap();
    match a.take_deferred_error() {
        Some(e) => assert_eq!(e.call, CallKind::Release),
        None => panic!("the failed release was not reported"),
    }
    assert_eq!(a.stats().reserved_bytes.current, reserved);
    a.check_invariants().unwrap();
    // The next release of unused memory retries it.
    a.release_unused().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, reserved - 2 * PAGE as u64);
    assert!(a.stats().driver_calls.get(CallKind::Release) > released);
    a.check_invariants().unwrap();
}

#[test]
fn an_exported_growables_shrunk_tail_is_not_reused_by_its_stream() {
    let _one = one_at_a_time();
    let a = host(8);
    let b = host(8);
    // A stream the host backend cannot record on: its frees stay pending, so the shrunk tail
    // stays in the quarantine, where the stream itself could take it back at once.
    let s = moonbright::StreamHandle(9);
    let g = a.reserve_growable(6 * PAGE).unwrap();
    // Grown twice, it holds two chunks: the second one can be given back.
    a.resize_async(g, 2 * PAGE, s).unwrap();
    a.resize_async(g, 6 * PAGE, s).unwrap();
    a.write(g, &pattern(6 * PAGE, 4)).unwrap();
    let q = b.import(&a.export(g).unwrap()).unwrap();
    a.resize_async(g, 2 * PAGE, s).unwrap();
    let committed = a.growable_info(g).unwrap().committed as usize;
    assert_eq!(committed, 2 * PAGE, "the shrink gave the second chunk back");
    // Only the exported tail could serve this request: it must fail rather than take it.
    let rest = 8 * PAGE - committed;
    match a.malloc_async(rest, s) {
        Err(Error::OutOfMemory { .. }) => {}
        Ok(p) => {
            a.write(p, &pattern(rest, 66)).unwrap();
            let mut seen = vec![0u8; 6 * PAGE];
            b.read(q, &mut seen).unwrap();
            assert_eq!(seen, pattern(6 * PAGE, 4), "the stream reused the exported tail");
            a.free_async(p, s).unwrap();
        }
        Err(e) => panic!("{e}"),
    }
    let mut seen = vec![0u8; 6 * PAGE];
    b.read(q, &mut seen).unwrap();
    assert_eq!(seen, pattern(6 * PAGE, 4));
    a.check_invariants().unwrap();
    b.close_import(q).unwrap();
    a.free(g).unwrap();
}

#[test]
fn a_graph_pools_block_is_not_exported() {
    let _one = one_at_a_time();
    let a = host(8);
    // A block of a graph's private pool: freed, the pool keeps it for its next allocations.
    a.begin_allocate_to_pool((1, 1)).unwrap();
    let p = a.malloc(2 * PAGE).unwrap();
    a.end_allocate_to_pool().unwrap();
    match a.export(p) {
        Err(Error::Ipc(m)) => assert!(m.contains("graph's private pool"), "{m}"),
        other => panic!("a graph pool's block was exported: {other:?}"),
    }
    a.free(p).unwrap();
    a.release_graph_pool((1, 1)).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn an_exported_allocation_freed_on_a_stream_is_not_reused_by_that_stream() {
    let _one = one_at_a_time();
    let a = host(8);
    let b = host(8);
    let s = moonbright::StreamHandle(7);
    let p = a.malloc_async(2 * PAGE, s).unwrap();
    a.write(p, &pattern(2 * PAGE, 3)).unwrap();
    let q = b.import(&a.export(p).unwrap()).unwrap();
    a.free_async(p, s).unwrap();
    // The same stream may reuse its own frees at once: never an exported one.
    let again = a.malloc_async(2 * PAGE, s).unwrap();
    a.write(again, &pattern(2 * PAGE, 88)).unwrap();
    let mut seen = vec![0u8; 2 * PAGE];
    b.read(q, &mut seen).unwrap();
    assert_eq!(seen, pattern(2 * PAGE, 3), "the stream's next allocation is the exported memory");
    a.check_invariants().unwrap();
    b.close_import(q).unwrap();
    a.free_async(again, s).unwrap();
}

#[test]
fn bad_pointers_and_sharing_off_are_refused_and_change_nothing() {
    let _one = one_at_a_time();
    let a = host(8);
    let p = a.malloc(2 * PAGE).unwrap();
    assert!(matches!(a.export(0xdead_0000), Err(Error::UnknownPointer { .. })));
    assert!(matches!(a.export(p + 256), Err(Error::InteriorPointer { .. })));
    a.free(p).unwrap();
    assert!(matches!(a.export(p), Err(Error::DoubleFree { .. })));
    let off = Allocator::new(Options { ipc: false, ..Options::host(8 * PAGE as u64, PAGE) });
    let off = off.unwrap();
    let q = off.malloc(PAGE).unwrap();
    assert!(matches!(off.export(q), Err(Error::Ipc(m)) if m.contains("`ipc` is off")));
    assert_eq!(off.stats().driver_calls.get(CallKind::Export), 0);
    off.free(q).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_failed_export_closes_what_it_opened_and_keeps_the_allocation() {
    let _one = one_at_a_time();
    let a = host(8);
    let p = stitched(&a, 4);
    let before = open_fds();
    a.driver().fail_nth(CallKind::Export, 3, None);
    match a.export(p) {
        Err(Error::Driver(e)) => assert_eq!(e.call, CallKind::Export),
        other => panic!("expected the injected failure, got {other:?}"),
    }
    assert_eq!(open_fds(), before, "the two descriptors exported before the failure are closed");
    let e = a.export(p).unwrap();
    drop(e);
    assert_eq!(open_fds(), before);
    a.free(p).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn every_failure_of_an_import_leaves_nothing_mapped_or_reserved() {
    let _one = one_at_a_time();
    let a = host(8);
    let p = stitched(&a, 4);
    a.write(p, &pattern(4 * PAGE, 5)).unwrap();
    let export = a.export(p).unwrap();
    let b = host(8);
    let host_b = || b.driver().inner().as_host().unwrap();
    for (kind, nth) in [
        (CallKind::Reserve, 1),
        (CallKind::Import, 1),
        (CallKind::Import, 3),
        (CallKind::Map, 1),
        (CallKind::Map, 4),
        (CallKind::Release, 2),
        (CallKind::SetAccess, 1),
    ] {
        let (maps, calls) = (host_b().mapping_count(), b.stats().driver_calls);
        b.driver().fail_nth(kind, nth, None);
        match b.import(&export) {
            Err(Error::Driver(e)) => assert_eq!(e.call, kind),
            other => panic!("{kind:?} #{nth}: expected its failure, got {other:?}"),
        }
        b.driver().clear_failures();
        let made = b.stats().driver_calls.since(&calls);
        assert_eq!(host_b().mapping_count(), maps, "{kind:?} #{nth}: a mapping stayed");
        let reserved = made.get(CallKind::Reserve) - u64::from(kind == CallKind::Reserve);
        assert_eq!(
            reserved,
            made.get(CallKind::FreeReservation),
            "{kind:?} #{nth}: the reservation was not given back"
        );
        assert!(b.imports().is_empty());
    }
    // Nothing of it is lost: the next import works, and unmap failures keep it for a retry.
    let q = b.import(&export).unwrap();
    b.driver().fail_nth(CallKind::Unmap, 1, None);
    assert!(matches!(b.close_import(q), Err(Error::Driver(_))));
    assert_eq!(b.imports().len(), 1, "an import whose unmap failed is kept");
    let mut seen = vec![0u8; 4 * PAGE];
    b.read(q, &mut seen).unwrap();
    assert_eq!(seen, pattern(4 * PAGE, 5));
    b.close_import(q).unwrap();
    a.free(p).unwrap();
}

#[test]
fn a_released_exported_chunk_keeps_its_bytes_for_the_importer() {
    let _one = one_at_a_time();
    let a = host(8);
    let b = host(8);
    let p = a.malloc(PAGE).unwrap();
    a.write(p, &pattern(PAGE, 2)).unwrap();
    let e = a.export(p).unwrap();
    let q = b.import(&e).unwrap();
    // The exporter frees and gives its memory back; the importer's mapping still holds it
    // (CUDA counts the importer's reference; the host backend never reuses exported offsets).
    a.free(p).unwrap();
    a.release_unused().unwrap();
    let again = a.malloc(PAGE).unwrap();
    a.write(again, &pattern(PAGE, 99)).unwrap();
    let mut seen = vec![0u8; PAGE];
    b.read(q, &mut seen).unwrap();
    assert_eq!(seen, pattern(PAGE, 2), "a released exported chunk is not given to a new one");
    b.close_import(q).unwrap();
    a.free(again).unwrap();
}

/// The child's half of `a_child_process_reads_and_writes_an_export`: run only when the parent
/// names a socket.
#[test]
#[ignore = "the child process of a_child_process_reads_and_writes_an_export"]
fn ipc_child() {
    let Some(path) = std::env::var_os("MOONBRIGHT_IPC_TEST_SOCKET") else { return };
    let mut s = UnixStream::connect(path).unwrap();
    let b = host(8);
    let e = Export::recv(&s).unwrap();
    assert_ne!(e.pid(), std::process::id());
    let q = b.import(&e).unwrap();
    let mut seen = vec![0u8; e.size() as usize];
    b.read(q, &mut seen).unwrap();
    let ok = seen == pattern(seen.len(), 4);
    b.write(q, &pattern(seen.len(), 8)).unwrap();
    b.close_import(q).unwrap();
    s.write_all(if ok { b"ok" } else { b"no" }).unwrap();
}

#[test]
fn a_child_process_reads_and_writes_an_export() {
    let _one = one_at_a_time();
    let dir = std::env::temp_dir().join(format!("moonbright-ipc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ipc_child", "--ignored", "--nocapture"])
        .env("MOONBRIGHT_IPC_TEST_SOCKET", &path)
        .spawn()
        .unwrap();
    let (mut s, _) = listener.accept().unwrap();
    let a = host(8);
    let p = stitched(&a, 3);
    let len = 3 * PAGE;
    a.write(p, &pattern(len, 4)).unwrap();
    a.export(p).unwrap().send(&s).unwrap();
    let mut verdict = [0u8; 2];
    s.read_exact(&mut verdict).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the child failed");
    assert_eq!(&verdict, b"ok", "the child saw other bytes than the exporter wrote");
    let mut back = vec![0u8; len];
    a.read(p, &mut back).unwrap();
    assert_eq!(back, pattern(len, 8), "the child's writes reached the exporter");
    a.free(p).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_peer_enabled_after_an_import_reaches_it_and_a_failed_grant_adds_no_peer() {
    let _one = one_at_a_time();
    let a = host(8);
    let b = host(8);
    let p = stitched(&a, 2);
    let e = a.export(p).unwrap();
    let q = b.import(&e).unwrap();
    let len = 2 * PAGE as u64;
    let host_b = || b.driver().inner().as_host().unwrap();
    assert!(!host_b().peer_can_access(1, q, len));
    // Heap memory first, then the import: fail the import's grant (b maps nothing else).
    let own = b.malloc(PAGE).unwrap();
    b.driver().fail_nth(CallKind::SetAccess, 2, None);
    assert!(matches!(b.enable_peer_access(1), Err(Error::Driver(_))));
    assert!(b.peers().is_empty(), "a failed grant adds no peer");
    b.enable_peer_access(1).unwrap();
    assert!(host_b().peer_can_access(1, q, len), "the import was granted to the new peer");
    assert!(host_b().peer_can_access(1, own, PAGE as u64));
    b.close_import(q).unwrap();
    b.free(own).unwrap();
    a.free(p).unwrap();
}

/// What each way of exporting an allocation that shares its chunks costs on the host backend
/// (docs/security.md, "What an importer can reach"): refusing it, and the least that moving it
/// to chunks of its own would take (a fresh allocation of its own range, its bytes copied, the
/// copy exported) before the part no move can do, giving the block's address those chunks.
/// And what a free of exported memory costs against a free to the cache: the chunks are
/// unmapped and released at the next flush instead of kept. Prints µs per operation (medians).
/// Run: `cargo test --release -p moonbright --test ipc -- --ignored --nocapture measure_`.
#[test]
#[ignore = "a measurement, not a check"]
fn measure_export_costs() {
    let _one = one_at_a_time();
    let us = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e6;
    let reps = 2000;
    let a = host(64);
    let blocks: Vec<u64> = (0..8).map(|_| a.malloc(4096).unwrap()).collect();
    let (mut refuse, mut moved) = (Vec::new(), Vec::new());
    let mut bytes = vec![0u8; 4096];
    for _ in 0..reps {
        let t = std::time::Instant::now();
        assert!(a.export(blocks[3]).is_err());
        refuse.push(us(t));
        let t = std::time::Instant::now();
        let own = a.malloc(PAGE).unwrap();
        a.read(blocks[3], &mut bytes).unwrap();
        a.write(own, &bytes).unwrap();
        let e = a.export(own).unwrap();
        moved.push(us(t));
        drop(e);
        a.free(own).unwrap();
        a.flush().unwrap();
    }
    println!("export of a 4 KiB block that shares its page: refused {:.2} µs", median(&refuse));
    println!(
        "  a copy into a page of its own, exported (the least a move costs): {:.2} µs",
        median(&moved)
    );
    let (mut cached, mut released) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let p = a.malloc(2 * PAGE).unwrap();
        let t = std::time::Instant::now();
        a.free(p).unwrap();
        a.flush().unwrap();
        cached.push(us(t));
        let p = a.malloc(2 * PAGE).unwrap();
        drop(a.export(p).unwrap());
        let t = std::time::Instant::now();
        a.free(p).unwrap();
        a.flush().unwrap();
        released.push(us(t));
    }
    println!(
        "free + flush of 2 pages: cached {:.2} µs, exported (unmapped, released) {:.2} µs",
        median(&cached),
        median(&released)
    );
    for p in blocks {
        a.free(p).unwrap();
    }
}
