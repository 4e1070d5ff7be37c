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
//! gave out, and it forgets an allocation's token before the allocation is freed, as the
//! runtime's handle of freed memory is void. `cudaIpcOpenMemHandle` in the importer (which runs
//! the interposer too: `LD_PRELOAD` is inherited) connects, checks that the socket is served by
//! the handle's process of its own user (`SO_PEERCRED`) before it sends the token, receives the
//! descriptors and maps them with `Allocator::import`, all by one deadline; opening a handle it
//! has open already returns the same address and counts, and `cudaIpcCloseMemHandle` unmaps at
//! the last close. The trust model: docs/security.md. The socket work (credentials, reads and
//! writes by a deadline, the importer's fetch) is in `ipc/socket.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use moonbright::ipc::Export;

mod socket;

pub use socket::Fetch;
use socket::{fetch, peer_credentials, recv_all, send_all};

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

/// The broker's answer before an export: sent, refused (another user), unknown token, busy
/// (as many connections as it serves at once are open).
const SENT: u8 = 0;
const REFUSED: u8 = 1;
const UNKNOWN: u8 = 2;
const BUSY: u8 = 3;

/// How long a whole fetch may take, from the importer's connect to the last descriptor, unless
/// set otherwise (`Broker::set_patience`); the broker gives each connection as long.
const PATIENCE: Duration = Duration::from_secs(10);

/// How long the broker waits for a connection's token: an importer sends it as soon as it has
/// connected, so a connection that sends nothing is let go long before `PATIENCE`.
const TOKEN_PATIENCE: Duration = Duration::from_secs(1);

/// Connections the broker serves at once, each on a thread of its own; more are answered
/// `BUSY` and closed at once.
const MAX_CONNECTIONS: usize = 8;

/// The longest pause after a failed `accept` (out of descriptors, say), doubling from 1 ms.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The abstract socket name of broker `name` of process `pid`.
fn address(pid: u32, name: &[u8; 8]) -> std::io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(address_name(pid, name))
}

fn address_name(pid: u32, name: &[u8; 8]) -> String {
    let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
    format!("moonbright-ipc.{pid}.{hex}")
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

/// What a process imported: by address, and by handle for a second open; and the handles
/// being fetched now (a second open of one waits for the first).
#[derive(Debug)]
struct Imports {
    opened: BTreeMap<u64, Opened>,
    by_handle: BTreeMap<Key, u64>,
    fetching: BTreeSet<Key>,
}

/// The token of a freed allocation, taken out before the free (`Broker::free`), to put back
/// if the free fails.
#[derive(Debug)]
struct Forgotten {
    ptr: u64,
    token: Token,
    device: i32,
}

/// The IPC handles of one interposer (a process has one; tests make several).
///
/// The broker keeps no descriptor: it exports an allocation again for each importer (the CUDA
/// backend keeps a chunk's first export, so a later one costs about 2 µs), under its lock. A
/// free takes the token out under the same lock *before* the allocator frees the memory
/// (`Broker::free`): no importer is served the token once the memory may be another
/// allocation's. CUDA's contract, which the interposer keeps, is that the exporter keeps an
/// allocation live while importers open it, and does not free it while asking for its handle.
///
/// Exports and imports have a lock each, and neither is held across a socket round trip: an
/// open marks its handle as being fetched and lets the lock go meanwhile. Every step on a
/// socket has a deadline (`set_patience`, 10 s by default).
#[derive(Debug)]
pub struct Broker {
    exports: Mutex<Exports>,
    imports: Mutex<Imports>,
    /// Signalled when a fetch ends (`Imports::fetching`).
    fetched: Condvar,
    /// Whether anything was ever exported: until then a free needs no look at the exports. Set
    /// under their lock before an export is checked, so a free that follows that check sees it.
    exported_ever: AtomicBool,
    /// Whether the listener's thread is serving: cleared when it stops (its loop ends, or it
    /// panics), after which no handle is issued.
    serving: AtomicBool,
    /// Connections being served now.
    connections: AtomicUsize,
    /// The deadline of each fetch and connection, in milliseconds (`set_patience`).
    patience_ms: AtomicU64,
}

impl Default for Broker {
    fn default() -> Self {
        Self::new()
    }
}

/// Clears `Broker::serving` when the listener's thread leaves `serve`, however it leaves.
struct Stopped<'a>(&'a AtomicBool);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Counts a connection served, until dropped.
struct Serving<'a>(&'a AtomicUsize);

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
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
            imports: Mutex::new(Imports {
                opened: BTreeMap::new(),
                by_handle: BTreeMap::new(),
                fetching: BTreeSet::new(),
            }),
            fetched: Condvar::new(),
            exported_ever: AtomicBool::new(false),
            serving: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
            patience_ms: AtomicU64::new(PATIENCE.as_millis() as u64),
        }
    }

    /// How long a fetch (connect, token, answer, export) may take in all before it fails, and
    /// how long the broker gives each connection: 10 s unless set.
    pub fn set_patience(&self, patience: Duration) {
        let ms = u64::try_from(patience.as_millis()).unwrap_or(u64::MAX).max(1);
        self.patience_ms.store(ms, Ordering::Relaxed);
    }

    fn patience(&self) -> Duration {
        Duration::from_millis(self.patience_ms.load(Ordering::Relaxed))
    }

    /// The handle of the allocation at `ptr` on `device`: the one given before if it was
    /// exported already, else a new token, once `check` has exported it (and so made sure it
    /// can be). The first handle of the process starts its broker: `start` runs the listener
    /// on a thread of its own (calling [`Broker::serve`]). Once that thread has stopped, no
    /// handle is issued: an importer could not be served.
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
        if books.listening.is_some() && !self.serving.load(Ordering::SeqCst) {
            return Err("this process's IPC broker has stopped serving importers: no handle \
                        is issued (see stderr or the report for why)"
                .into());
        }
        if let Some(&t) = books.tokens.get(&ptr) {
            let name = books.listening.as_ref().expect("a token has its broker").name;
            return Ok(Handle { pid, device, broker: name, token: t }.encode());
        }
        drop(check()?);
        let name = self.listen(&mut books, start)?;
        let token = random::<16>()?;
        books.tokens.insert(ptr, token);
        books.by_token.insert(token, (ptr, device));
        Ok(Handle { pid, device, broker: name, token }.encode())
    }

    /// Frees the allocation at `ptr` with `free`, having first forgotten its export, if any:
    /// its handle is void from then on, and no importer is served it once the memory may be
    /// another allocation's. If the free fails the export is remembered again. Importers keep
    /// what they mapped.
    pub fn free<E>(&self, ptr: u64, free: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        let forgotten = self.forget(ptr);
        let r = free();
        if r.is_err() {
            if let Some(f) = forgotten {
                self.remember(f);
            }
        }
        r
    }

    /// Takes out the export of `ptr`, if any. Under the exports' lock, which the broker holds
    /// while it looks a token up and exports its allocation: an export in progress completes
    /// first.
    fn forget(&self, ptr: u64) -> Option<Forgotten> {
        if !self.exported_ever.load(Ordering::SeqCst) {
            return None;
        }
        let mut b = locked(&self.exports);
        let token = b.tokens.remove(&ptr)?;
        let (_, device) = b.by_token.remove(&token)?;
        Some(Forgotten { ptr, token, device })
    }

    /// Puts back what `forget` took out (the free failed: the allocation is still live).
    fn remember(&self, f: Forgotten) {
        let mut b = locked(&self.exports);
        if b.listening.as_ref().is_some_and(|l| l.pid == std::process::id())
            && !b.tokens.contains_key(&f.ptr)
        {
            b.tokens.insert(f.ptr, f.token);
            b.by_token.insert(f.token, (f.ptr, f.device));
        }
    }

    /// Allocations exported and not yet freed.
    pub fn exported(&self) -> usize {
        locked(&self.exports).tokens.len()
    }

    /// The listener's loop: each connection on a thread of its own (a lookup, an export and a
    /// send), up to `MAX_CONNECTIONS` at once; `export` exports the allocation at an address
    /// on a device. Returns only when the listener can no longer accept, after which no
    /// handle is issued (`handle`).
    pub fn serve(
        &self,
        listener: UnixListener,
        export: impl Fn(u64, i32) -> Result<Export, String> + Sync,
    ) {
        self.serve_with(|| listener.accept().map(|(s, _)| s), export);
    }

    /// `serve`, with connections from `accept`. A failed accept pauses the loop, from 1 ms to
    /// `MAX_BACKOFF`, doubling while it keeps failing (out of descriptors, a failing accept
    /// would otherwise spin); one that can never succeed (the listener is gone) ends it.
    fn serve_with(
        &self,
        mut accept: impl FnMut() -> std::io::Result<UnixStream>,
        export: impl Fn(u64, i32) -> Result<Export, String> + Sync,
    ) {
        let _stopped = Stopped(&self.serving);
        let export = &export;
        let mut backoff = Duration::ZERO;
        std::thread::scope(|scope| loop {
            let stream = match accept() {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if listener_gone(&e) => {
                    eprintln!("moonbright: the IPC broker stops: its listener failed: {e}");
                    return;
                }
                Err(_) => {
                    backoff = (backoff * 2).clamp(Duration::from_millis(1), MAX_BACKOFF);
                    std::thread::sleep(backoff);
                    continue;
                }
            };
            backoff = Duration::ZERO;
            let Some(stream) = self.admit(stream) else { continue };
            self.connections.fetch_add(1, Ordering::SeqCst);
            let conn = Serving(&self.connections);
            let served = std::thread::Builder::new()
                .name("moonbright-ipc-conn".into())
                .spawn_scoped(scope, move || {
                    let _conn = conn;
                    // A panic ends this connection only.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.serve_one(stream, export)
                    }));
                });
            if served.is_err() {
                // No thread to be had (the count went back with the closure): the importer
                // sees the connection close.
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    }

    /// Decides at once, without reading, whether a connection is served: not if its peer is
    /// another user (`REFUSED`), nor while `MAX_CONNECTIONS` are being served (`BUSY`).
    fn admit(&self, stream: UnixStream) -> Option<UnixStream> {
        let answer = match peer_credentials(&stream) {
            Ok(peer) if peer.uid != rustix::process::geteuid().as_raw() => REFUSED,
            Ok(_) if self.connections.load(Ordering::SeqCst) >= MAX_CONNECTIONS => BUSY,
            Ok(_) => return Some(stream),
            Err(_) => return None,
        };
        let _ = rustix::net::send(
            &stream,
            &[answer],
            rustix::net::SendFlags::NOSIGNAL | rustix::net::SendFlags::DONTWAIT,
        );
        None
    }

    fn serve_one(
        &self,
        stream: UnixStream,
        export: &impl Fn(u64, i32) -> Result<Export, String>,
    ) -> Result<(), String> {
        let now = Instant::now();
        let deadline = now + self.patience();
        let mut token = [0u8; 16];
        recv_all(&stream, &mut token, deadline.min(now + TOKEN_PATIENCE))?;
        let found = {
            let books = locked(&self.exports);
            books.by_token.get(&token).map(|&(p, d)| export(p, d))
        };
        match found {
            Some(Ok(e)) => {
                send_all(&stream, &[SENT], deadline)?;
                e.send_by(&stream, Some(deadline)).map_err(|e| e.to_string())
            }
            Some(Err(_)) | None => send_all(&stream, &[UNKNOWN], deadline),
        }
    }

    /// Opens `h` on `device`: the address it has if this process has it open already (one more
    /// open), else the export fetched from its broker, mapped by `import`. No lock is held
    /// while it fetches: a second open of the same handle waits for the first (no longer than
    /// its deadline), and closes of other imports do not wait at all.
    pub fn open(
        &self,
        h: &Handle,
        device: i32,
        import: impl FnOnce(&Export) -> Result<u64, String>,
    ) -> Result<u64, Fetch> {
        let key = (h.pid, h.broker, h.token);
        let mut books = locked(&self.imports);
        loop {
            if let Some(&ptr) = books.by_handle.get(&key) {
                let o = books.opened.get_mut(&ptr).expect("an open import has its entry");
                if o.device == device {
                    o.count += 1;
                    return Ok(ptr);
                }
            }
            if books.fetching.insert(key) {
                break;
            }
            books = self.fetched.wait(books).unwrap_or_else(|e| e.into_inner());
        }
        drop(books);
        let fetched = fetch(h, self.patience());
        let mapped = fetched.and_then(|e| import(&e).map_err(Fetch::Import));
        let mut books = locked(&self.imports);
        books.fetching.remove(&key);
        self.fetched.notify_all();
        let ptr = mapped?;
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

    /// The name of this process's broker, started by `start` if it is not running yet.
    fn listen(
        &self,
        books: &mut Exports,
        start: impl FnOnce(UnixListener) -> std::io::Result<()>,
    ) -> Result<[u8; 8], String> {
        if let Some(l) = &books.listening {
            return Ok(l.name);
        }
        let pid = std::process::id();
        let name = random::<8>()?;
        let addr = address(pid, &name).map_err(|e| format!("the broker's socket name: {e}"))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| format!("cannot listen for importers: {e}"))?;
        self.serving.store(true, Ordering::SeqCst);
        if let Err(e) = start(listener) {
            self.serving.store(false, Ordering::SeqCst);
            return Err(format!("cannot start the broker's thread: {e}"));
        }
        books.listening = Some(Listening { pid, name });
        Ok(name)
    }
}

/// Whether a failed `accept` says the listener itself can no longer serve (as opposed to a
/// lack of descriptors or memory, or a connection that went away, which pass).
fn listener_gone(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EOPNOTSUPP | libc::EFAULT)
    )
}

#[cfg(test)]
mod tests {
    use super::socket::connect;
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
        let name = b.listen(&mut locked(&b.exports), start).unwrap();
        let h = Handle { pid: std::process::id(), device: 0, broker: name, token: [7; 16] };
        match fetch(&h, PATIENCE) {
            Err(Fetch::Unreachable(m)) => assert!(m.contains("no such export"), "{m}"),
            other => panic!("{other:?}"),
        }
        let h = Handle { broker: [0xee; 8], ..h };
        match fetch(&h, PATIENCE) {
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
                let _ = b.free(0x2000, || Ok::<(), ()>(()));
                tx.send(()).unwrap();
            });
            let freed = rx.recv_timeout(Duration::from_secs(2));
            // Unblocks the import (and, if the free was waiting for it, the free).
            drop(conn);
            assert!(freed.is_ok(), "the free waited for the import");
            assert!(matches!(opening.join().unwrap(), Err(Fetch::Unreachable(_))));
        });
    }

    /// A host allocator's export of a fresh allocation, and the allocator. The allocator lives
    /// for the rest of the process (brokers' threads hold it), listed in a static so that the
    /// leak checker sees it reachable once those threads have ended.
    fn exported() -> (&'static moonbright::Allocator, u64) {
        static KEPT: std::sync::Mutex<Vec<&'static moonbright::Allocator>> =
            std::sync::Mutex::new(Vec::new());
        let a = moonbright::Allocator::new(moonbright::Options::host(1 << 24, 1 << 16)).unwrap();
        let p = a.malloc(1 << 16).unwrap();
        let a: &'static moonbright::Allocator = Box::leak(Box::new(a));
        KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(a);
        (a, p)
    }

    /// `b` serving a host allocator's exports (on a thread of its own), and the handle of an
    /// allocation of it.
    fn serving(b: &'static Broker) -> (&'static moonbright::Allocator, u64, Handle) {
        let (a, p) = exported();
        let start = move |l: UnixListener| {
            std::thread::spawn(move || b.serve(l, |p, _| a.export(p).map_err(|e| e.to_string())));
            Ok(())
        };
        let raw = b.handle(p, 0, || a.export(p).map_err(|e| e.to_string()), start).unwrap();
        (a, p, Handle::decode(&raw).unwrap())
    }

    #[test]
    fn a_token_is_void_before_its_memory_is_freed() {
        static B: Broker = Broker::new();
        let b = &B;
        let (a, p, h) = serving(b);
        assert!(fetch(&h, PATIENCE).is_ok(), "served while the allocation is live");
        // An importer served while the free runs, or at any time after it, gets nothing: the
        // memory may be another allocation's from the moment it is freed.
        let mut during = None;
        b.free(p, || {
            during = Some(fetch(&h, PATIENCE));
            a.free(p)
        })
        .unwrap();
        match during.unwrap() {
            Err(Fetch::Unreachable(m)) => assert!(m.contains("no such export"), "{m}"),
            other => panic!("served the token of memory being freed: {:?}", other.map(|_| ())),
        }
        assert_eq!(b.exported(), 0);
        // A free that fails keeps the token.
        let q = a.malloc(1 << 16).unwrap();
        let raw = b.handle(q, 0, || a.export(q).map_err(|e| e.to_string()), |_| Ok(())).unwrap();
        let r: Result<(), &str> = b.free(q, || Err("refused"));
        assert_eq!(r, Err("refused"));
        assert!(fetch(&Handle::decode(&raw).unwrap(), PATIENCE).is_ok(), "the token is back");
        a.free(q).unwrap();
    }

    #[test]
    fn a_failing_accept_backs_off_and_a_broker_that_stops_issues_no_handle() {
        // Out of descriptors: every accept fails at once. The loop pauses, longer each time,
        // instead of spinning; a listener that is gone ends it.
        let b = &Broker::new();
        let start = Instant::now();
        let mut calls = 0;
        b.serve_with(
            || {
                calls += 1;
                let code = if start.elapsed() < Duration::from_millis(300) {
                    libc::EMFILE
                } else {
                    libc::EBADF
                };
                Err(std::io::Error::from_raw_os_error(code))
            },
            |_, _| Err("nothing".to_string()),
        );
        assert!(calls < 30, "{calls} accepts in 300 ms: the loop spins");

        // A broker whose listener fails for good stops, and then no handle is issued.
        static C: Broker = Broker::new();
        let c = &C;
        let (a, p) = exported();
        let (tx, rx) = std::sync::mpsc::channel();
        let start = |l: UnixListener| {
            tx.send(l.try_clone().unwrap()).unwrap();
            std::thread::spawn(move || c.serve(l, |p, _| a.export(p).map_err(|e| e.to_string())));
            Ok(())
        };
        assert!(c.handle(p, 0, || a.export(p).map_err(|e| e.to_string()), start).is_ok());
        let listener = rx.recv().unwrap();
        rustix::net::shutdown(&listener, rustix::net::Shutdown::Both).unwrap();
        let waited = Instant::now();
        while c.serving.load(Ordering::SeqCst) && waited.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let q = a.malloc(1 << 16).unwrap();
        let check = || a.export(q).map_err(|e| e.to_string());
        match c.handle(q, 0, check, |_| Ok(())) {
            Err(m) => assert!(m.contains("stopped serving"), "{m}"),
            Ok(_) => panic!("a handle was issued with no broker to serve it"),
        }
        assert!(c.handle(p, 0, || unreachable!(), |_| Ok(())).is_err(), "nor the old one again");
    }

    #[test]
    fn idle_connections_do_not_hold_up_an_importer_and_a_flood_is_turned_away() {
        static B: Broker = Broker::new();
        let b = &B;
        b.set_patience(Duration::from_secs(20));
        let (_, _, h) = serving(b);
        let name = address_name(h.pid, &h.broker);
        let idle = |n: usize| -> Vec<UnixStream> {
            (0..n).map(|_| connect(&name, Instant::now() + PATIENCE).unwrap()).collect()
        };
        // Connections that never send a token: served one at a time, each held the broker
        // for its whole patience.
        let some = idle(MAX_CONNECTIONS - 2);
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        assert!(fetch(&h, Duration::from_secs(5)).is_ok(), "an importer waited for idle peers");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // A flood: beyond what it serves at once, connections are answered at once.
        let more = idle(4);
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        match fetch(&h, Duration::from_secs(5)) {
            Err(Fetch::Unreachable(m)) => assert!(m.contains("as many importers"), "{m}"),
            other => panic!("{:?}", other.map(|_| ())),
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // The idle ones are let go after a second without a token; then all is served again.
        std::thread::sleep(TOKEN_PATIENCE + Duration::from_millis(300));
        assert!(fetch(&h, Duration::from_secs(5)).is_ok());
        drop((some, more));
    }
}
