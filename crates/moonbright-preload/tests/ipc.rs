//! CUDA IPC handles under the interposer, over a fake runtime and the host backend: a handle of
//! MoonBright's memory opens in another interposer (of this process, and of a child process)
//! onto the same bytes; handles and memory that are not MoonBright's go to the runtime; and every
//! failure (a freed or unknown export, a failed import, a failed unmap) is an error that loses
//! nothing.

mod common;

use std::ffi::c_void;
use std::io::{BufRead, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

    // Freed, its handle is void; a new allocation of the same size gets a new one, and other
    // memory: the exported memory is never handed out again.
    assert_eq!(ex.free(p as *mut c_void, None), code::SUCCESS);
    assert_eq!(open(im, h).0, code::INVALID_RESOURCE_HANDLE);
    assert!(im.last_error().unwrap().contains("no such export"), "{:?}", im.last_error());
    let (_, p2) = malloc(ex, 5 * MIB, None);
    allocator(ex).write(p2, b"a new allocation!").unwrap();
    let (r, h2) = handle(ex, p2);
    assert_eq!(r, code::SUCCESS);
    assert_ne!(h2, h);
    assert_eq!(open(im, h).0, code::INVALID_RESOURCE_HANDLE, "the old handle never reaches it");
    let (r, q2) = open(im, h2);
    assert_eq!(r, code::SUCCESS);
    assert_eq!(read(b, q2, 17), b"a new allocation!");
    // Closed and opened again: exported afresh by the broker.
    assert_eq!(im.ipc_close_mem_handle(q2 as *mut c_void), code::SUCCESS);
    let (r, q3) = open(im, h2);
    assert_eq!(r, code::SUCCESS);
    assert_eq!(read(b, q3, 17), b"a new allocation!");
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

/// The abstract socket name of broker `name` of process `pid`, as the interposer names it.
fn broker_address(pid: u32, name: [u8; 8]) -> SocketAddr {
    let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
    SocketAddr::from_abstract_name(format!("moonbright-ipc.{pid}.{hex}")).unwrap()
}

/// A handle naming broker `name` of process `pid`.
fn handle_of(pid: u32, name: [u8; 8]) -> IpcMemHandle {
    Handle { pid, device: 0, broker: name, token: [0x5a; 16] }.encode()
}

/// Plays a broker on `listener`: accepts one connection, reads what the importer sends (for
/// up to a second), answers `SENT`, and returns the bytes it was sent. Stalls after `SENT`.
fn fake_broker(listener: UnixListener) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut got = vec![0u8; 16];
        let n = s.read(&mut got).unwrap_or(0);
        got.truncate(n);
        let _ = s.write_all(&[0]);
        std::thread::sleep(Duration::from_millis(500));
        got
    })
}

#[test]
fn a_handle_whose_name_another_process_holds_gets_no_token() {
    let im = leaked(host_options);
    // The exporter (pid 1 here: not this process) has exited; this process took its name.
    let name = [0x31; 8];
    let listener = UnixListener::bind_addr(&broker_address(1, name)).unwrap();
    let broker = fake_broker(listener);
    let (r, q) = open(im, handle_of(1, name));
    assert_eq!((r, q), (code::INVALID_RESOURCE_HANDLE, 0));
    let m = im.last_error().unwrap();
    assert!(m.contains("not by the exporting process 1"), "{m}");
    assert_eq!(broker.join().unwrap(), Vec::<u8>::new(), "the token was sent to an impostor");
}

/// The environment variable that makes `other_users_broker` the child: a name, in hex.
const IMPOSTOR: &str = "MOONBRIGHT_PRELOAD_IPC_TEST_IMPOSTOR";

/// The child of `a_handle_whose_name_another_user_holds_gets_no_token`, running as another
/// user: binds its own broker name, says so, and reports what an importer sends it.
#[test]
fn other_users_broker() {
    let Ok(hex) = std::env::var(IMPOSTOR) else { return };
    let mut name = [0u8; 8];
    for (i, b) in name.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let listener = UnixListener::bind_addr(&broker_address(std::process::id(), name)).unwrap();
    println!("listening as uid {}", rustix::process::geteuid().as_raw());
    let got = fake_broker(listener).join().unwrap();
    println!("received {} bytes", got.len());
}

#[test]
fn a_handle_whose_name_another_user_holds_gets_no_token() {
    use std::os::unix::process::CommandExt;
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: playing another user needs root (CI runs as root)");
        return;
    }
    let im = leaked(host_options);
    let name = [0x42; 8];
    let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
    // The other user (nobody) holds the name with the right pid: its own.
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "other_users_broker", "--nocapture", "--test-threads", "1"])
        .env(IMPOSTOR, hex)
        .uid(65534)
        .gid(65534)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("listening") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child did not start");
    }
    assert!(line.contains("uid 65534"), "{line}");
    let (r, q) = open(im, handle_of(child.id(), name));
    assert_eq!((r, q), (code::INVALID_RESOURCE_HANDLE, 0));
    let m = im.last_error().unwrap();
    assert!(m.contains("of user 65534"), "{m}");
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(child.wait().unwrap().success(), "{rest}");
    assert!(rest.contains("received 0 bytes"), "the token was sent to another user: {rest}");
}

#[test]
fn an_exporter_that_stops_answering_times_out_and_closes_do_not_wait_for_it() {
    let (ex, im) = (leaked(host_options), leaked(host_options));
    im.set_ipc_timeout(Duration::from_millis(300));
    // An import to close while another open hangs.
    let (_, p) = malloc(ex, 2 * MIB, None);
    let (r, q) = open(im, handle(ex, p).1);
    assert_eq!(r, code::SUCCESS);
    // A broker of this process that answers `SENT`, then sends nothing.
    let name = [0x77; 8];
    let listener = UnixListener::bind_addr(&broker_address(std::process::id(), name)).unwrap();
    let broker = fake_broker(listener);
    let (tx, rx) = std::sync::mpsc::channel();
    let hung = handle_of(std::process::id(), name);
    std::thread::spawn(move || {
        let t = Instant::now();
        let r = open(im, hung);
        tx.send((r, t.elapsed(), im.last_error())).unwrap();
    });
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    assert_eq!(im.ipc_close_mem_handle(q as *mut c_void), code::SUCCESS);
    assert!(t.elapsed() < Duration::from_millis(200), "a close waited {:?}", t.elapsed());
    let (r, took, m) = rx.recv_timeout(Duration::from_secs(5)).expect("the open hangs");
    assert_eq!(r, (code::INVALID_RESOURCE_HANDLE, 0));
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(m.unwrap().contains("timed out"));
    assert_eq!(broker.join().unwrap().len(), 16, "the token went to this process's broker");
}

#[test]
fn a_broker_whose_queue_is_full_times_the_connect_out() {
    use rustix::net::{bind, listen, socket, AddressFamily, SocketAddrUnix, SocketType};
    let im = leaked(host_options);
    im.set_ipc_timeout(Duration::from_millis(300));
    let name = [0x99; 8];
    let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
    let path = format!("moonbright-ipc.{}.{hex}", std::process::id());
    // A listener that accepts nothing, with no room in its queue once one connection waits.
    let fd = socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
    bind(&fd, &SocketAddrUnix::new_abstract_name(path.as_bytes()).unwrap()).unwrap();
    listen(&fd, 0).unwrap();
    let _waiting = UnixStream::connect_addr(&broker_address(std::process::id(), name)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let t = Instant::now();
        let r = open(im, handle_of(std::process::id(), name));
        tx.send((r, t.elapsed(), im.last_error())).unwrap();
    });
    let (r, took, m) = rx.recv_timeout(Duration::from_secs(5)).expect("the connect hangs");
    assert_eq!(r, (code::INVALID_RESOURCE_HANDLE, 0));
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(m.unwrap().contains("timed out"));
}

/// The environment variable that makes `other_users_importer` the child: a handle, in hex.
const INTRUDER: &str = "MOONBRIGHT_PRELOAD_IPC_TEST_INTRUDER";

/// The child of `another_users_importer_is_refused_by_the_broker`, running as another user:
/// connects to the handle's broker as a raw client (no check of its own), sends the token, and
/// prints the broker's answer byte.
#[test]
fn other_users_importer() {
    let Ok(hex) = std::env::var(INTRUDER) else { return };
    let mut raw = IpcMemHandle { reserved: [0; 64] };
    for (i, b) in raw.reserved.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let h = Handle::decode(&raw).unwrap();
    let mut s = UnixStream::connect_addr(&broker_address(h.pid, h.broker)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(&h.token);
    let mut answer = [0xffu8; 1];
    let _ = s.read_exact(&mut answer);
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    println!("answer {} then {} bytes", answer[0], rest.len());
}

#[test]
fn another_users_importer_is_refused_by_the_broker() {
    use std::os::unix::process::CommandExt;
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: playing another user needs root (CI runs as root)");
        return;
    }
    let ex = leaked(host_options);
    let (_, p) = malloc(ex, 2 * MIB, None);
    let (_, h) = handle(ex, p);
    let hex: String = h.reserved.iter().map(|b| format!("{b:02x}")).collect();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "other_users_importer", "--nocapture", "--test-threads", "1"])
        .env(INTRUDER, hex)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("answer 1 then 0 bytes"), "not refused: {text}");
    assert_eq!(ex.free(p as *mut c_void, None), code::SUCCESS);
}

#[test]
fn a_tag_whose_memory_was_shared_does_not_sleep() {
    let ip = leaked(host_options);
    // SAFETY: the name is NUL-terminated.
    let previous = unsafe { ip.tag_begin(c"preload-ipc-shared".as_ptr()) };
    let (_, p) = malloc(ip, 4 * MIB, None);
    assert_eq!(ip.tag_end(previous), code::SUCCESS);
    allocator(ip).write(p, b"shared").unwrap();
    assert_eq!(handle(ip, p).0, code::SUCCESS, "{:?}", ip.last_error());
    let tag = c"preload-ipc-shared".as_ptr();
    // SAFETY: the name is NUL-terminated.
    assert_eq!(unsafe { ip.sleep(tag, moonbright_preload::BACKUP_HOST) }, code::ILLEGAL_STATE);
    assert!(ip.last_error().unwrap().contains("exported"), "{:?}", ip.last_error());
    assert_eq!(read(allocator(ip), p, 6), b"shared");
    assert_eq!(allocator(ip).stats().asleep_bytes.current, 0, "the tag is awake");
    assert_eq!(ip.free(p as *mut c_void, None), code::SUCCESS);
}
