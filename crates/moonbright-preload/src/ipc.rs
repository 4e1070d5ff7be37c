//! CUDA IPC handles for MoonBright's memory under the interposer: what `cudaIpcGetMemHandle`
//! writes into the 64-byte `cudaIpcMemHandle_t` ([`Handle`]), the exporting process's broker
//! that hands the memory's file descriptors to an importer ([`Broker`]), and the importer's
//! books of what it opened.
//!
//! The runtime's own `cudaIpcGetMemHandle` refuses virtual-memory allocations, and a CUDA IPC
//! handle is 64 bytes of plain data, while MoonBright's memory crosses processes only as file
//! descriptors (`moonbright::ipc`). So the handle names where to fetch them: the exporter's
//! pid, a random name of its broker, and a random token for the allocation. The broker is a
//! thread of the exporting process, started at its first export, listening on an abstract Unix
//! socket; it serves only processes of the same user (`SO_PEERCRED`) that present a token it
//! gave out, and it forgets an allocation's token when the allocation is freed, as the
//! runtime's handle of freed memory is void. `cudaIpcOpenMemHandle` in the importer (which runs
//! the interposer too: `LD_PRELOAD` is inherited) connects, receives the descriptors and maps
//! them with `Allocator::import`; opening a handle it has open already returns the same address
//! and counts, and `cudaIpcCloseMemHandle` unmaps at the last close.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use moonbright::ipc::Export;

/// `cudaIpcMemHandle_t`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcMemHandle {
    pub reserved: [u8; 64],
}

/// The first bytes of a handle MoonBright wrote: a name and a format version.
const MAGIC: [u8; 8] = *b"MBcuIPC\x01";

/// An allocation's token: random, so that only a process given the handle can fetch it.
type Token = [u8; 16];

/// What a handle says, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    /// The exporting process.
    pub pid: u32,
    /// The exporter's device.
    pub device: i32,
    /// Its broker's random name.
    pub broker: [u8; 8],
    pub token: Token,
}

impl Handle {
    pub fn encode(&self) -> IpcMemHandle {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.device.to_le_bytes());
        b[16..24].copy_from_slice(&self.broker);
        b[24..40].copy_from_slice(&self.token);
        IpcMemHandle { reserved: b }
    }

    /// The handle's fields if MoonBright wrote it; `None` for the runtime's own handles.
    pub fn decode(h: &IpcMemHandle) -> Option<Handle> {
        let b = &h.reserved;
        if b[..8] != MAGIC || b[40..].iter().any(|&x| x != 0) {
            return None;
        }
        Some(Handle {
            pid: u32::from_le_bytes(b[8..12].try_into().ok()?),
            device: i32::from_le_bytes(b[12..16].try_into().ok()?),
            broker: b[16..24].try_into().ok()?,
            token: b[24..40].try_into().ok()?,
        })
    }
}

/// The broker's answer before an export: sent, refused (another user), unknown token.
const SENT: u8 = 0;
const REFUSED: u8 = 1;
const UNKNOWN: u8 = 2;

/// How long either side waits for the other's next bytes before giving up on a connection.
const PATIENCE: Duration = Duration::from_secs(10);

/// The abstract socket name of broker `name` of process `pid`.
fn address(pid: u32, name: &[u8; 8]) -> std::io::Result<SocketAddr> {
    let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
    SocketAddr::from_abstract_name(format!("moonbright-ipc.{pid}.{hex}"))
}

fn random<const N: usize>() -> Result<[u8; N], String> {
    let mut b = [0u8; N];
    let mut got = 0;
    while got < N {
        match rustix::rand::getrandom(&mut b[got..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => got += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(format!("getrandom: {e}")),
        }
    }
    Ok(b)
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A broker's listening thread, for one process (a forked child starts its own).
#[derive(Debug)]
struct Listening {
    pid: u32,
    name: [u8; 8],
}

/// The handle an import came from, as its key: exporter pid, broker, token.
type Key = (u32, [u8; 8], Token);

/// One open import: its allocator's device, the handle it came from, how many opens.
#[derive(Debug)]
struct Opened {
    device: i32,
    key: Key,
    count: usize,
}

/// What a process exported, and the thread that serves it.
#[derive(Debug)]
struct Exports {
    listening: Option<Listening>,
    /// Token by address, and (address, device) by token.
    tokens: BTreeMap<u64, Token>,
    by_token: BTreeMap<Token, (u64, i32)>,
}

/// What a process imported: by address, and by handle for a second open.
#[derive(Debug)]
struct Imports {
    opened: BTreeMap<u64, Opened>,
    by_handle: BTreeMap<Key, u64>,
}

/// The IPC handles of one interposer (a process has one; tests make several).
///
/// The broker keeps no descriptor: it exports an allocation again for each importer (the CUDA
/// backend keeps a chunk's first export, so a later one costs about 2 µs), under its lock. A
/// free forgets the token under the same lock right after the allocator has freed the memory;
/// an importer served between the two gets an error (the export fails). CUDA's contract, which
/// the interposer keeps, is that the exporter keeps an allocation live while importers open it,
/// and does not free it while asking for its handle.
///
/// Exports and imports have a lock each: an import holds its lock across a socket round trip
/// and driver calls, and a free (which looks at the exports) must not wait for it.
#[derive(Debug)]
pub struct Broker {
    exports: Mutex<Exports>,
    imports: Mutex<Imports>,
    /// Whether anything was ever exported: until then a free needs no look at the exports. Set
    /// under their lock before an export is checked, so a free that follows that check sees it.
    exported_ever: AtomicBool,
}

impl Default for Broker {
    fn default() -> Self {
        Self::new()
    }
}

impl Broker {
    pub const fn new() -> Self {
        Broker {
            exports: Mutex::new(Exports {
                listening: None,
                tokens: BTreeMap::new(),
                by_token: BTreeMap::new(),
            }),
            imports: Mutex::new(Imports { opened: BTreeMap::new(), by_handle: BTreeMap::new() }),
            exported_ever: AtomicBool::new(false),
        }
    }

    /// The handle of the allocation at `ptr` on `device`: the one given before if it was
    /// exported already, else a new token, once `check` has exported it (and so made sure it
    /// can be). The first handle of the process starts its broker: `start` runs the listener
    /// on a thread of its own (calling [`Broker::serve`]).
    pub fn handle(
        &self,
        ptr: u64,
        device: i32,
        check: impl FnOnce() -> Result<Export, String>,
        start: impl FnOnce(UnixListener) -> std::io::Result<()>,
    ) -> Result<IpcMemHandle, String> {
        let mut books = locked(&self.exports);
        self.exported_ever.store(true, Ordering::SeqCst);
        let pid = std::process::id();
        if books.listening.as_ref().is_some_and(|l| l.pid != pid) {
            // Inherited from the parent across a fork: its thread and its exports are not here.
            books.listening = None;
            books.tokens.clear();
            books.by_token.clear();
        }
        if let Some(&t) = books.tokens.get(&ptr) {
            let name = books.listening.as_ref().expect("a token has its broker").name;
            return Ok(Handle { pid, device, broker: name, token: t }.encode());
        }
        drop(check()?);
        let name = listen(&mut books, start)?;
        let token = random::<16>()?;
        books.tokens.insert(ptr, token);
        books.by_token.insert(token, (ptr, device));
        Ok(Handle { pid, device, broker: name, token }.encode())
    }

    /// Forgets the export of `ptr`, if any, once its allocation is freed: the handle is void.
    /// Importers keep what they mapped.
    pub fn forget(&self, ptr: u64) {
        if !self.exported_ever.load(Ordering::SeqCst) {
            return;
        }
        let mut b = locked(&self.exports);
        if let Some(t) = b.tokens.remove(&ptr) {
            b.by_token.remove(&t);
        }
    }

    /// Allocations exported and not yet freed.
    pub fn exported(&self) -> usize {
        locked(&self.exports).tokens.len()
    }

    /// The listener's loop: one connection at a time (each is a lookup, an export and a send);
    /// `export` exports the allocation at an address on a device.
    pub fn serve(
        &self,
        listener: UnixListener,
        export: impl Fn(u64, i32) -> Result<Export, String>,
    ) {
        for conn in listener.incoming() {
            let Ok(stream) = conn else { continue };
            let _ = self.serve_one(stream, &export);
        }
    }

    fn serve_one(
        &self,
        mut stream: UnixStream,
        export: &impl Fn(u64, i32) -> Result<Export, String>,
    ) -> std::io::Result<()> {
        stream.set_read_timeout(Some(PATIENCE))?;
        stream.set_write_timeout(Some(PATIENCE))?;
        let peer = rustix::net::sockopt::socket_peercred(stream.as_fd())?;
        if peer.uid != rustix::process::geteuid() {
            return send_all(&stream, &[REFUSED]);
        }
        let mut token = [0u8; 16];
        stream.read_exact(&mut token)?;
        let found = {
            let books = locked(&self.exports);
            books.by_token.get(&token).map(|&(p, d)| export(p, d))
        };
        match found {
            Some(Ok(e)) => {
                send_all(&stream, &[SENT])?;
                e.send(&stream).map_err(std::io::Error::other)
            }
            Some(Err(_)) | None => send_all(&stream, &[UNKNOWN]),
        }
    }

    /// Opens `h` on `device`: the address it has if this process has it open already (one more
    /// open), else the export fetched from its broker, mapped by `import`. The lock is held
    /// throughout, so a second open of the same handle waits for the first.
    pub fn open(
        &self,
        h: &Handle,
        device: i32,
        import: impl FnOnce(&Export) -> Result<u64, String>,
    ) -> Result<u64, Fetch> {
        let key = (h.pid, h.broker, h.token);
        let mut books = locked(&self.imports);
        if let Some(&ptr) = books.by_handle.get(&key) {
            let o = books.opened.get_mut(&ptr).expect("an open import has its entry");
            if o.device == device {
                o.count += 1;
                return Ok(ptr);
            }
        }
        let export = fetch(h)?;
        let ptr = import(&export).map_err(Fetch::Import)?;
        books.by_handle.insert(key, ptr);
        books.opened.insert(ptr, Opened { device, key, count: 1 });
        Ok(ptr)
    }

    /// Closes one open of the import at `ptr`. On the last, `unmap` runs (under the lock, so
    /// that an open of the same handle waits for it); if it fails the open is kept, to be
    /// closed again. `None` if `ptr` is no import of this broker.
    pub fn close(
        &self,
        ptr: u64,
        unmap: impl FnOnce(i32) -> Result<(), String>,
    ) -> Option<Result<(), String>> {
        let mut books = locked(&self.imports);
        let o = books.opened.get_mut(&ptr)?;
        if o.count > 1 {
            o.count -= 1;
            return Some(Ok(()));
        }
        if let Err(m) = unmap(o.device) {
            return Some(Err(m));
        }
        let o = books.opened.remove(&ptr).expect("just found");
        if books.by_handle.get(&o.key) == Some(&ptr) {
            books.by_handle.remove(&o.key);
        }
        Some(Ok(()))
    }
}

/// The name of this process's broker, started by `start` if it is not running yet.
fn listen(
    books: &mut Exports,
    start: impl FnOnce(UnixListener) -> std::io::Result<()>,
) -> Result<[u8; 8], String> {
    if let Some(l) = &books.listening {
        return Ok(l.name);
    }
    let pid = std::process::id();
    let name = random::<8>()?;
    let addr = address(pid, &name).map_err(|e| format!("the broker's socket name: {e}"))?;
    let listener =
        UnixListener::bind_addr(&addr).map_err(|e| format!("cannot listen for importers: {e}"))?;
    start(listener).map_err(|e| format!("cannot start the broker's thread: {e}"))?;
    books.listening = Some(Listening { pid, name });
    Ok(name)
}

/// Why an open failed: the export could not be fetched (the exporter is gone, freed it, or is
/// another user's), or it could not be mapped here.
#[derive(Debug)]
pub enum Fetch {
    Unreachable(String),
    Import(String),
}

/// Writes all of `bytes`, without the `SIGPIPE` a write to a closed socket raises (a C program
/// has not ignored it, as Rust's and Python's runtimes have).
fn send_all(stream: &UnixStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match rustix::net::send(stream, bytes, rustix::net::SendFlags::NOSIGNAL) {
            Ok(n) => bytes = &bytes[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Fetches the export `h` names from its broker.
fn fetch(h: &Handle) -> Result<Export, Fetch> {
    let gone = |what: &str, e: &dyn std::fmt::Display| {
        Fetch::Unreachable(format!("{what} the exporting process {} (has it exited?): {e}", h.pid))
    };
    let addr = address(h.pid, &h.broker).map_err(|e| gone("cannot name", &e))?;
    let mut stream = UnixStream::connect_addr(&addr).map_err(|e| gone("cannot reach", &e))?;
    stream.set_read_timeout(Some(PATIENCE)).map_err(|e| gone("cannot wait for", &e))?;
    send_all(&stream, &h.token).map_err(|e| gone("cannot ask", &e))?;
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).map_err(|e| gone("no answer from", &e))?;
    match status[0] {
        SENT => Export::recv(&stream).map_err(|e| gone("a bad export from", &e)),
        REFUSED => Err(Fetch::Unreachable(format!(
            "process {} serves its memory only to its own user",
            h.pid
        ))),
        _ => Err(Fetch::Unreachable(format!(
            "process {} has no such export: freed, or a stale handle",
            h.pid
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_round_trips_and_the_runtimes_handles_are_not_ours() {
        let h = Handle { pid: 4242, device: 3, broker: [1; 8], token: [9; 16] };
        let raw = h.encode();
        assert_eq!(Handle::decode(&raw), Some(h));
        let mut other = raw;
        other.reserved[0] ^= 1;
        assert_eq!(Handle::decode(&other), None);
        let mut tail = raw;
        tail.reserved[63] = 1;
        assert_eq!(Handle::decode(&tail), None, "the runtime's handle that starts like ours");
        assert_eq!(Handle::decode(&IpcMemHandle { reserved: [0; 64] }), None);
    }

    #[test]
    fn a_token_nobody_was_given_is_unknown_and_a_missing_broker_unreachable() {
        static B: Broker = Broker::new();
        let b = &B;
        let start = |l: UnixListener| {
            std::thread::spawn(move || b.serve(l, |_, _| Err("nothing".to_string())));
            Ok(())
        };
        // A failed check exports nothing and starts no broker.
        assert_eq!(b.handle(0x1000, 0, || Err("no".into()), start), Err("no".to_string()));
        assert_eq!(b.exported(), 0);
        assert!(locked(&b.exports).listening.is_none());
        let name = listen(&mut locked(&b.exports), start).unwrap();
        let h = Handle { pid: std::process::id(), device: 0, broker: name, token: [7; 16] };
        match fetch(&h) {
            Err(Fetch::Unreachable(m)) => assert!(m.contains("no such export"), "{m}"),
            other => panic!("{other:?}"),
        }
        let h = Handle { broker: [0xee; 8], ..h };
        match fetch(&h) {
            Err(Fetch::Unreachable(m)) => assert!(m.contains("cannot reach"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(b.close(0x1000, |_| Ok(())).is_none());
    }

    #[test]
    fn a_free_does_not_wait_for_an_import_in_progress() {
        let b = &Broker::new();
        // Exports were made (the check fails, but a free must now look at the exports).
        let start = |_: UnixListener| Ok(());
        assert!(b.handle(0x1000, 0, || Err("no".into()), start).is_err());
        assert!(b.exported_ever.load(Ordering::SeqCst));
        // A broker that accepts and never answers: the import holds its lock meanwhile.
        let name = random::<8>().unwrap();
        let listener =
            UnixListener::bind_addr(&address(std::process::id(), &name).unwrap()).unwrap();
        let h = Handle { pid: std::process::id(), device: 0, broker: name, token: [1; 16] };
        std::thread::scope(|s| {
            let opening = s.spawn(|| b.open(&h, 0, |_| Ok(0)));
            let (conn, _) = listener.accept().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            s.spawn(move || {
                b.forget(0x2000);
                tx.send(()).unwrap();
            });
            let freed = rx.recv_timeout(Duration::from_secs(2));
            // Unblocks the import (and, if the free was waiting for it, the free).
            drop(conn);
            assert!(freed.is_ok(), "the free waited for the import");
            assert!(matches!(opening.join().unwrap(), Err(Fetch::Unreachable(_))));
        });
    }
}
