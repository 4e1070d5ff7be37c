//! CUDA IPC handles under the interposer, over a fake runtime and the host backend: a handle of
//! MoonBright's memory opens in another interposer (of this process, and of a child process)
//! onto the same bytes; handles and memory that are not MoonBright's go to the runtime; and every
//! failure (a freed or unknown export, a failed import, a failed unmap) is an error that loses
//! nothing.

mod common;

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use common::*;
use moonbright::{Allocator, CallKind, Options};
use moonbright_preload::Runtime;
use moonbright_preload::{code, Handle, Interposer, IpcMemHandle};

/// Interposers that live for the rest of the test process, as the library's does (a broker
/// thread may outlive its test), listed here so that LeakSanitizer sees them reachable.
static KEPT: Mutex<Vec<&'static Interposer<Fake>>> = Mutex::new(Vec::new());

fn leaked(options: fn() -> Result<Options, String>) -> &'static Interposer<Fake> {
    let ip = Box::leak(Box::new(new(options)));
    KEPT.lock().unwrap().push(ip);
    ip
}

fn handle(ip: &'static Interposer<Fake>, ptr: u64) -> (i32, IpcMemHandle) {
    let mut h = IpcMemHandle { reserved: [0; 64] };
    // SAFETY: `h` is valid for a handle's write.
    let r = unsafe { ip.ipc_get_mem_handle(&mut h, ptr as *mut c_void) };
    (r, h)
}

fn open(ip: &Interposer<Fake>, h: IpcMemHandle) -> (i32, u64) {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer.
    let r = unsafe { ip.ipc_open_mem_handle(&mut p, h, 1) };
    (r, p as u64)
}

fn allocator(ip: &Interposer<Fake>) -> &Allocator {
    ip.devices().get(0).expect("device 0's allocator")
}

fn read(a: &Allocator, p: u64, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    a.read(p, &mut b).unwrap();
    b
}

#[test]
fn a_handle_opens_in_another_interposer_onto_the_same_bytes() {
    let (ex, im) = (leaked(host_options), leaked(host_options));
    let (_, p) = malloc(ex, 5 * MIB, None);
    allocator(ex).write(p + 3 * MIB as u64, b"from the exporter").unwrap();
    let (r, h) = handle(ex, p);
    assert_eq!(r, code::SUCCESS);
    let decoded = Handle::decode(&h).expect("a MoonBright handle");
    assert_eq!((decoded.pid, decoded.device), (std::process::id(), 0));
    assert_eq!(handle(ex, p), (code::SUCCESS, h), "the same handle until the free");

    let (r, q) = open(im, h);
    assert_eq!(r, code::SUCCESS, "{:?}", im.last_error());
    let b = allocator(im);
    assert_eq!(read(b, q + 3 * MIB as u64, 17), b"from the exporter");
    b.write(q, b"from the importer").unwrap();
    assert_eq!(read(allocator(ex), p, 17), b"from the importer");
    assert_eq!(b.imports(), vec![(q, 5 * MIB as u64)]);
    assert_eq!(b.stats().allocated_bytes.current, 0, "an import is not the importer's memory");

    // A second open is the same mapping, counted; the last close unmaps.
    assert_eq!(open(im, h), (code::SUCCESS, q));
    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::SUCCESS);
    assert_eq!(b.imports().len(), 1);
    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::SUCCESS);
    assert!(b.imports().is_empty());
    assert!(runtime(im).take().is_empty(), "no runtime call for MoonBright's handles");
    // A third close is no longer MoonBright's: the runtime's answer.
    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::SUCCESS);
    assert_eq!(runtime(im).take(), vec![Call::IpcClose(q)]);

    let report: serde_json::Value = serde_json::from_str(&ex.report()).unwrap();
    assert_eq!(
        (report["ipc_handles"].as_u64(), report["ipc_exported"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(serde_json::from_str::<serde_json::Value>(&im.report()).unwrap()["ipc_opens"], 2);

    // Freed, its handle is void; a new allocation at the same address gets a new one.
    assert_eq!(ex.free(p as *mut c_void, None), code::SUCCESS);
    assert_eq!(open(im, h).0, code::INVALID_RESOURCE_HANDLE);
    assert!(im.last_error().unwrap().contains("no such export"), "{:?}", im.last_error());
    let (_, p2) = malloc(ex, 5 * MIB, None);
    assert_eq!(p2, p, "the cache hands the same range back");
    let (r, h2) = handle(ex, p2);
    assert_eq!(r, code::SUCCESS);
    assert_ne!(h2, h);
    assert_eq!(open(im, h).0, code::INVALID_RESOURCE_HANDLE, "the old handle never reaches it");
    let (r, q2) = open(im, h2);
    assert_eq!(r, code::SUCCESS);
    assert_eq!(read(b, q2, 17), b"from the importer", "the same range, with its bytes");
    // Closed and opened again: exported afresh by the broker.
    assert_eq!(im.ipc_close_mem_handle(q2 as *mut c_void), code::SUCCESS);
    let (r, q3) = open(im, h2);
    assert_eq!(r, code::SUCCESS);
    assert_eq!(read(b, q3, 17), b"from the importer");
    assert_eq!(im.ipc_close_mem_handle(q3 as *mut c_void), code::SUCCESS);
    allocator(ex).check_invariants().unwrap();
}

#[test]
fn an_import_outlives_the_exporters_free() {
    let (ex, im) = (leaked(host_options), leaked(host_options));
    let (_, p) = malloc(ex, 3 * MIB, None);
    allocator(ex).write(p, &[42; 256]).unwrap();
    let (_, h) = handle(ex, p);
    let (r, q) = open(im, h);
    assert_eq!(r, code::SUCCESS);
    assert_eq!(ex.free(p as *mut c_void, None), code::SUCCESS);
    allocator(ex).release_unused().unwrap();
    assert_eq!(read(allocator(im), q, 256), vec![42; 256]);
    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::SUCCESS);
    assert!(allocator(im).imports().is_empty());
}

#[test]
fn memory_and_handles_that_are_not_moonbrights_go_to_the_runtime() {
    let ip = leaked(host_options);
    // The runtime's own memory (a zero-byte request passes), and a null pointer.
    let own = {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer.
        unsafe { runtime(ip).malloc(&mut p, 64, None) };
        p as u64
    };
    assert_eq!(handle(ip, own), (code::SUCCESS, IpcMemHandle { reserved: [0xab; 64] }));
    assert_eq!(handle(ip, 0).0, code::INVALID_VALUE);
    assert_eq!(open(ip, IpcMemHandle { reserved: [0xab; 64] }), (code::SUCCESS, 0xdead_0000));
    assert_eq!(ip.ipc_close_mem_handle(0xdead_0000 as *mut c_void), code::SUCCESS);
    assert_eq!(
        runtime(ip).take(),
        vec![
            Call::Malloc(64, None),
            Call::IpcGet(own),
            Call::IpcGet(0),
            Call::IpcOpen(0xab, 1),
            Call::IpcClose(0xdead_0000)
        ]
    );
    // Null outputs are refused before anything is asked.
    // SAFETY: null out-pointers, which must be refused.
    unsafe {
        let h = IpcMemHandle { reserved: [0; 64] };
        assert_eq!(ip.ipc_get_mem_handle(std::ptr::null_mut(), own as _), code::INVALID_VALUE);
        assert_eq!(ip.ipc_open_mem_handle(std::ptr::null_mut(), h, 0), code::INVALID_VALUE);
    }
    assert!(runtime(ip).take().is_empty());
}

#[test]
fn refused_exports_and_unreachable_exporters_are_errors() {
    // An interior pointer is not an allocation's start: the runtime's to refuse.
    let ip = leaked(host_options);
    let (_, p) = malloc(ip, 4 * MIB, None);
    assert_eq!(handle(ip, p + 4096).0, code::INVALID_VALUE);
    assert_eq!(runtime(ip).take(), vec![Call::IpcGet(p + 4096)]);
    // With option `ipc` off, MoonBright's memory cannot be shared, and says why.
    fn no_ipc() -> Result<Options, String> {
        Ok(Options { ipc: false, ..Options::host(256 * MIB as u64, 2 * MIB) })
    }
    let off = leaked(no_ipc);
    let (_, p) = malloc(off, 4 * MIB, None);
    assert_eq!(handle(off, p).0, code::INVALID_VALUE);
    assert!(off.last_error().unwrap().contains("ipc"), "{:?}", off.last_error());
    assert!(off.report().contains("\"ipc_exported\":0"));
    // A handle of a process that is gone, or of a broker that never was.
    let mut gone = Handle::decode(&handle(ip, malloc(ip, 2 * MIB, None).1).1).unwrap();
    gone.broker = [0x55; 8];
    let (r, q) = open(ip, gone.encode());
    assert_eq!((r, q), (code::INVALID_RESOURCE_HANDLE, 0));
    assert!(ip.last_error().unwrap().contains("cannot reach"), "{:?}", ip.last_error());
}

#[test]
fn a_failed_import_maps_nothing_and_a_failed_unmap_keeps_the_import() {
    let (ex, im) = (leaked(host_options), leaked(host_options));
    let (_, p) = malloc(ex, 6 * MIB, None);
    allocator(ex).write(p, &[9; 64]).unwrap();
    let (_, h) = handle(ex, p);
    let (_, keep) = malloc(im, 2 * MIB, None);
    let b = allocator(im);
    for kind in [CallKind::Reserve, CallKind::Import, CallKind::Map, CallKind::SetAccess] {
        b.driver().fail_nth(kind, 1, None);
        let (r, q) = open(im, h);
        assert_eq!((r, q), (code::MAP_BUFFER_OBJECT_FAILED, 0), "{kind:?}");
        assert!(b.imports().is_empty(), "{kind:?}");
        assert!(im.last_error().unwrap().contains("cannot map"), "{:?}", im.last_error());
    }
    let (r, q) = open(im, h);
    assert_eq!(r, code::SUCCESS);
    b.driver().fail_nth(CallKind::Unmap, 1, None);
    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::INVALID_VALUE);
    assert_eq!(read(b, q, 64), vec![9; 64], "kept after the failed unmap");
    assert_eq!(open(im, h), (code::SUCCESS, q), "still open, and counted again");
    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::SUCCESS);
    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::SUCCESS);
    assert!(b.imports().is_empty());
    assert!(runtime(im).take().iter().all(|c| !matches!(c, Call::IpcClose(_))));
    assert_eq!(im.free(keep as *mut c_void, None), code::SUCCESS);
    b.check_invariants().unwrap();
    assert_eq!(ex.counts.served_allocs.load(Ordering::Relaxed), 1);
}

/// The environment variable that makes `child_half` the child: the handle, in hex.
const CHILD: &str = "MOONBRIGHT_PRELOAD_IPC_TEST_HANDLE";

#[test]
fn a_child_process_opens_the_handle_and_writes_back() {
    let ex = leaked(host_options);
    let (_, p) = malloc(ex, 3 * MIB, None);
    allocator(ex).write(p + MIB as u64, b"parent").unwrap();
    let (_, h) = handle(ex, p);
    let hex: String = h.reserved.iter().map(|b| format!("{b:02x}")).collect();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_half", "--nocapture", "--test-threads", "1"])
        .env(CHILD, hex)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("child read: parent"), "{text}");
    assert_eq!(read(allocator(ex), p, 5), b"child");
}

/// The child's half of `a_child_process_opens_the_handle_and_writes_back` (a no-op without it).
#[test]
fn child_half() {
    let Ok(hex) = std::env::var(CHILD) else { return };
    let mut h = IpcMemHandle { reserved: [0; 64] };
    for (i, b) in h.reserved.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let im = &new(host_options);
    let (r, q) = open(im, h);
    assert_eq!(r, code::SUCCESS, "{:?}", im.last_error());
    let b = allocator(im);
    println!("child read: {}", String::from_utf8_lossy(&read(b, q + MIB as u64, 6)));
    b.write(q, b"child").unwrap();
    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::SUCCESS);
}

#[test]
fn threads_opening_and_closing_one_handle_share_one_mapping() {
    let (ex, im) = (leaked(host_options), leaked(host_options));
    let (_, p) = malloc(ex, 4 * MIB, None);
    allocator(ex).write(p, b"shared by threads").unwrap();
    let (_, h) = handle(ex, p);
    let _ = malloc(im, 2 * MIB, None);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    let (r, q) = open(im, h);
                    assert_eq!(r, code::SUCCESS, "{:?}", im.last_error());
                    assert_eq!(read(allocator(im), q, 17), b"shared by threads");
                    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::SUCCESS);
                }
            });
        }
        // Meanwhile the exporter is asked for the handle again and again: the same one.
        s.spawn(|| {
            for _ in 0..200 {
                assert_eq!(handle(ex, p), (code::SUCCESS, h));
            }
        });
    });
    assert!(allocator(im).imports().is_empty(), "every open was closed");
    let report: serde_json::Value = serde_json::from_str(&im.report()).unwrap();
    assert_eq!(report["ipc_opens"], 200);
    allocator(im).check_invariants().unwrap();
}
