//! Sharing allocations with other processes: what an export carries ([`Export`]), how it
//! travels over a Unix socket ([`Export::send`], [`Export::recv`]), and how an importer maps it
//! (`Imports`, used by `Allocator::import` and `Allocator::close_import`).
//!
//! An allocation is stitched from chunks, so an export is a list of them: one file descriptor
//! per chunk (`cuMemExportToShareableHandle`, POSIX file descriptors), the chunks' sizes, and
//! where the allocation starts in the first. The importer imports each chunk, maps them back to
//! back at addresses it reserves for this import alone, and sets access once: the same bytes,
//! contiguous at another address. Descriptors cross processes only as `SCM_RIGHTS` over a Unix
//! socket (a process cannot open another's), which is what `send` and `recv` do.
//!
//! Lifetimes follow `cudaIpcGetMemHandle`: the exporter keeps the allocation live until every
//! importer has closed it (once it is freed, importers' writes reach nobody), and an importer
//! closes only once its own work on the memory has completed (the unmap is immediate). The
//! physical memory itself lives until both sides have let go, as the driver counts references;
//! the exporter never hands exported memory to another allocation (`Heap::shared_chunks`).
//! What each side trusts: docs/security.md.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;
use std::time::Instant;

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

use crate::driver::{prelude::*, reservation_alignment, DevicePtr, SharedChunk};
use crate::error::{Error, Result};

/// The first bytes of every export on the wire: a name and a format version.
const MAGIC: [u8; 8] = *b"MBIPC\0\x01\0";

/// Descriptors one message carries at most (Linux allows 253 a message).
const FDS_PER_MESSAGE: usize = 250;

/// Chunks an export may have at most: a whole 141 GiB H200 in 2 MiB pages is 72,000.
const MAX_CHUNKS: usize = 1 << 20;

/// The wire's fixed prefix: magic, body length, descriptor count.
const PREFIX: usize = 16;

/// The body's fixed part: backend, device, pid, reserved, size, offset.
const BODY_FIXED: usize = 32;

/// One allocation, exported for another process: the chunks that back it (each with its
/// descriptor), where it starts in the first, and its size. Dropping it closes the
/// descriptors; the allocation stays the exporter's.
#[derive(Debug)]
pub struct Export {
    backend: String,
    device: i32,
    pid: u32,
    size: u64,
    offset: u64,
    chunks: Vec<SharedChunk>,
}

impl Export {
    pub(crate) fn new(
        backend: &str,
        device: i32,
        size: u64,
        offset: u64,
        chunks: Vec<SharedChunk>,
    ) -> Export {
        // The driver's descriptor may lack close-on-exec (`cuMemExportToShareableHandle` does
        // not promise it): without it, a fork and exec anywhere in the process would hand the
        // new program this memory. Setting the flag on a valid descriptor cannot fail in a
        // way that matters here; a failure leaves it as the driver made it.
        for c in &chunks {
            let _ = rustix::io::fcntl_setfd(&c.fd, rustix::io::FdFlags::CLOEXEC);
        }
        Export {
            backend: backend.to_owned(),
            device,
            pid: std::process::id(),
            size,
            offset,
            chunks,
        }
    }

    /// The exporter's backend (`"cuda"` or `"host"`); an importer must run the same one.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// The exporter's device ordinal (in its own process's numbering).
    pub fn device(&self) -> i32 {
        self.device
    }

    /// The exporter's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The allocation's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Where the allocation starts in its first chunk (non-zero below a page, in an arena).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The chunks, in address order.
    pub fn chunks(&self) -> &[SharedChunk] {
        &self.chunks
    }

    /// The bytes that describe the export; the descriptors travel beside them.
    fn encode(&self) -> Vec<u8> {
        let backend: u32 = if self.backend == "cuda" { 0 } else { 1 };
        let body = BODY_FIXED + 16 * self.chunks.len();
        let mut out = Vec::with_capacity(PREFIX + body);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&(body as u32).to_le_bytes());
        out.extend_from_slice(&(self.chunks.len() as u32).to_le_bytes());
        out.extend_from_slice(&backend.to_le_bytes());
        out.extend_from_slice(&self.device.to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        for c in &self.chunks {
            out.extend_from_slice(&c.offset.to_le_bytes());
            out.extend_from_slice(&c.size.to_le_bytes());
        }
        out
    }

    /// Reads what `encode` wrote, given the descriptors that came with it, in order.
    fn decode(body: &[u8], fds: Vec<OwnedFd>) -> Result<Export> {
        let u32_at = |i: usize| u32::from_le_bytes(body[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(body[i..i + 8].try_into().unwrap());
        if body.len() != BODY_FIXED + 16 * fds.len() {
            return Err(bad_wire(format!(
                "{} bytes describe {} descriptors; expected {}",
                body.len(),
                fds.len(),
                BODY_FIXED + 16 * fds.len()
            )));
        }
        let backend = match u32_at(0) {
            0 => "cuda",
            1 => "host",
            other => return Err(bad_wire(format!("unknown backend {other}"))),
        };
        let (size, offset) = (u64_at(16), u64_at(24));
        let chunks: Vec<SharedChunk> = fds
            .into_iter()
            .enumerate()
            .map(|(i, fd)| {
                let at = BODY_FIXED + 16 * i;
                SharedChunk { fd, offset: u64_at(at), size: u64_at(at + 8) }
            })
            .collect();
        let total = chunks.iter().try_fold(0u64, |t, c| t.checked_add(c.size));
        if size == 0 || total.and_then(|t| offset.checked_add(size).filter(|&e| e <= t)).is_none() {
            return Err(bad_wire(format!(
                "{size} bytes at offset {offset} do not fit the {} chunks sent",
                chunks.len()
            )));
        }
        Ok(Export {
            backend: backend.into(),
            device: u32_at(4) as i32,
            pid: u32_at(8),
            size,
            offset,
            chunks,
        })
    }

    /// Sends the export over a connected Unix socket: its description and, as `SCM_RIGHTS`, a
    /// copy of each descriptor (in messages of up to 250). The export stays usable, and may be
    /// sent again. A non-blocking socket is waited on for as long as it takes; a blocking one
    /// with a send time-out (`SO_SNDTIMEO`) fails once it expires.
    pub fn send(&self, socket: impl AsFd) -> Result<()> {
        self.send_by(socket, None)
    }

    /// [`Export::send`], failing with [`Error::Ipc`] if it has not completed by `deadline`.
    pub fn send_by(&self, socket: impl AsFd, deadline: Option<Instant>) -> Result<()> {
        let socket = socket.as_fd();
        let bytes = self.encode();
        let fds: Vec<_> = self.chunks.iter().map(|c| c.fd.as_fd()).collect();
        let mut groups = fds.chunks(FDS_PER_MESSAGE);
        send_with(socket, &bytes, groups.next().unwrap_or(&[]), deadline)?;
        for group in groups {
            send_with(socket, b"+", group, deadline)?;
        }
        Ok(())
    }

    /// Receives an export `send` sent, from a connected Unix socket. Refuses (and closes every
    /// descriptor received) anything malformed, and never takes in more descriptors than the
    /// export announces. A non-blocking socket is waited on for as long as it takes; a blocking
    /// one with a receive time-out (`SO_RCVTIMEO`) fails once it expires.
    ///
    /// The socket is the caller's: whoever is at its other end chooses what arrives (see
    /// docs/security.md). The export is checked for form, not for origin: check the peer
    /// (`SO_PEERCRED`) before, if it matters who sent it.
    pub fn recv(socket: impl AsFd) -> Result<Export> {
        Export::recv_by(socket, None)
    }

    /// [`Export::recv`], failing with [`Error::Ipc`] if it has not completed by `deadline`.
    pub fn recv_by(socket: impl AsFd, deadline: Option<Instant>) -> Result<Export> {
        let socket = socket.as_fd();
        // The descriptors travel with the first bytes: learn how many are announced before
        // taking any in (a peek installs none).
        let mut prefix = [0u8; PREFIX];
        peek_exact(socket, &mut prefix, deadline)?;
        let (body_len, count) = match read_prefix(&prefix) {
            Ok(r) => r,
            Err(e) => {
                // Taken off the socket as a read would have (any descriptor with them is
                // closed by the kernel: there is no room for one).
                let _ = recv_exact(socket, &mut prefix, &mut Vec::new(), 0, deadline);
                return Err(e);
            }
        };
        let mut fds = Vec::new();
        recv_exact(socket, &mut prefix, &mut fds, count, deadline)?;
        let mut body = vec![0u8; body_len];
        recv_exact(socket, &mut body, &mut fds, count, deadline)?;
        while fds.len() < count {
            let mut mark = [0u8; 1];
            recv_exact(socket, &mut mark, &mut fds, count, deadline)?;
            if mark != *b"+" {
                return Err(bad_wire("a message of descriptors without its mark".into()));
            }
        }
        if fds.len() != count {
            return Err(bad_wire(format!("{} descriptors for {count} chunks", fds.len())));
        }
        Export::decode(&body, fds)
    }
}

impl Export {
    /// The export as bytes and descriptors, for a transport of the caller's (Python's
    /// `multiprocessing` sends descriptors its own way): what `send` writes, and the
    /// descriptors, in order. [`Export::from_parts`] reverses it.
    pub fn into_parts(self) -> (Vec<u8>, Vec<OwnedFd>) {
        let bytes = self.encode();
        (bytes, self.chunks.into_iter().map(|c| c.fd).collect())
    }

    /// An export from what [`Export::into_parts`] gave, checked as `recv` checks.
    pub fn from_parts(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<Export> {
        let prefix: &[u8; PREFIX] = bytes
            .get(..PREFIX)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| bad_wire(format!("{} bytes are too few", bytes.len())))?;
        let (body_len, count) = read_prefix(prefix)?;
        if bytes.len() != PREFIX + body_len || fds.len() != count {
            return Err(bad_wire(format!(
                "{} bytes and {} descriptors for {count} chunks",
                bytes.len(),
                fds.len()
            )));
        }
        Export::decode(&bytes[PREFIX..], fds)
    }
}

/// Checks the wire's prefix; returns the body's length and the descriptor count.
fn read_prefix(prefix: &[u8; PREFIX]) -> Result<(usize, usize)> {
    if prefix[..8] != MAGIC {
        return Err(bad_wire("not a MoonBright export (bad magic or version)".into()));
    }
    let body_len = u32::from_le_bytes(prefix[8..12].try_into().unwrap()) as usize;
    let count = u32::from_le_bytes(prefix[12..16].try_into().unwrap()) as usize;
    if count == 0 || count > MAX_CHUNKS || body_len != BODY_FIXED + 16 * count {
        return Err(bad_wire(format!("{count} chunks in {body_len} bytes")));
    }
    Ok((body_len, count))
}

fn bad_wire(reason: String) -> Error {
    Error::Ipc(format!("malformed export: {reason}"))
}

fn io_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Ipc(format!("{what}: {e}"))
}

/// Whether a failed socket call should be made again: after an interruption, or once the
/// socket is ready (Python's sockets with a timeout are non-blocking). The wait ends at
/// `deadline`, if any, with an error. Without a deadline, `EAGAIN` on a blocking socket means
/// its own time-out (`SO_RCVTIMEO`, `SO_SNDTIMEO`) expired: an error too, never a wait.
fn retry(
    socket: BorrowedFd<'_>,
    e: rustix::io::Errno,
    ready: PollFlags,
    deadline: Option<Instant>,
) -> Result<bool> {
    use rustix::io::Errno;
    if e == Errno::INTR {
        return Ok(true);
    }
    if e != Errno::AGAIN {
        return Ok(false);
    }
    // With a deadline every call is made with `DONTWAIT`: `AGAIN` is no time-out then.
    if deadline.is_none() {
        let blocking = rustix::fs::fcntl_getfl(socket)
            .map(|f| !f.contains(rustix::fs::OFlags::NONBLOCK))
            .map_err(|e| io_error("reading the socket's flags", e))?;
        if blocking {
            return Err(Error::Ipc(
                "the socket's own time-out expired (SO_RCVTIMEO or SO_SNDTIMEO)".into(),
            ));
        }
    }
    wait(socket, ready, deadline).map(|()| true)
}

/// Waits until `socket` is ready for `ready`, or fails at `deadline`.
fn wait(socket: BorrowedFd<'_>, ready: PollFlags, deadline: Option<Instant>) -> Result<()> {
    use rustix::io::Errno;
    let mut fds = [PollFd::from_borrowed_fd(socket, ready)];
    loop {
        let timeout = match deadline {
            None => None,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(timed_out());
                }
                Some(Timespec::try_from(left).unwrap_or(Timespec { tv_sec: i64::MAX, tv_nsec: 0 }))
            }
        };
        match poll(&mut fds, timeout.as_ref()) {
            Ok(0) => continue, // The deadline is checked above.
            Ok(_) => return Ok(()),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(io_error("waiting for the socket", e)),
        }
    }
}

/// `flag` (`DONTWAIT`) when there is a deadline (a blocking call could outlast it), else none.
fn dont_wait<F>(deadline: Option<Instant>, flag: F, none: F) -> F {
    if deadline.is_some() {
        flag
    } else {
        none
    }
}

fn timed_out() -> Error {
    Error::Ipc("timed out waiting for the other side of the socket".into())
}

/// Sends all of `bytes`, with `fds` attached to the first message.
fn send_with(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Option<Instant>,
) -> Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Error::Ipc(format!("{} descriptors do not fit one message", fds.len())));
    }
    let mut sent = 0;
    while sent < bytes.len() {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(timed_out());
        }
        let flags =
            SendFlags::NOSIGNAL | dont_wait(deadline, SendFlags::DONTWAIT, SendFlags::empty());
        let r = sendmsg(socket, &[IoSlice::new(&bytes[sent..])], &mut control, flags);
        let n = match r {
            Ok(n) => n,
            Err(e) if retry(socket, e, PollFlags::OUT, deadline)? => continue,
            Err(e) => return Err(io_error("sending an export", e)),
        };
        // The descriptors went with the first bytes.
        control = SendAncillaryBuffer::new(&mut []);
        sent += n;
    }
    Ok(())
}

/// Fills `buf` with the next bytes on the socket without taking them (nor any descriptor).
fn peek_exact(socket: BorrowedFd<'_>, buf: &mut [u8], deadline: Option<Instant>) -> Result<()> {
    loop {
        let flags = RecvFlags::PEEK | dont_wait(deadline, RecvFlags::DONTWAIT, RecvFlags::empty());
        match rustix::net::recv(socket, &mut *buf, flags) {
            Ok((_, 0)) => {
                return Err(Error::Ipc("receiving an export: the socket was closed".into()))
            }
            Ok((_, n)) if n >= buf.len() => return Ok(()),
            // Part of it so far: wait for more (a peek returns what is there, from the start).
            // The bytes there keep the socket readable: sleep a little instead of spinning,
            // unless the other side has closed, when no more will come.
            Ok(_) => {
                let mut fds = [PollFd::from_borrowed_fd(socket, PollFlags::RDHUP)];
                let _ = poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 1_000_000 }));
                let gone = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR;
                if fds[0].revents().intersects(gone) {
                    return Err(Error::Ipc(
                        "receiving an export: the socket was closed part-way".into(),
                    ));
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(timed_out());
                }
            }
            Err(e) if retry(socket, e, PollFlags::IN, deadline)? => {}
            Err(e) => return Err(io_error("receiving an export", e)),
        }
    }
}

/// Fills `buf` from the socket, keeping every descriptor that arrives meanwhile, up to `count`
/// in all: more is refused (the kernel closes what does not fit; `CTRUNC` says so).
fn recv_exact(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    count: usize,
    deadline: Option<Instant>,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let room = count.saturating_sub(fds.len()).min(FDS_PER_MESSAGE);
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
        let space = &mut space[..rustix::cmsg_space!(ScmRights(room))];
        let mut control = RecvAncillaryBuffer::new(if room == 0 { &mut [] } else { space });
        let r = recvmsg(
            socket,
            &mut [IoSliceMut::new(&mut buf[got..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | dont_wait(deadline, RecvFlags::DONTWAIT, RecvFlags::empty()),
        );
        let r = match r {
            Ok(r) => r,
            Err(e) if retry(socket, e, PollFlags::IN, deadline)? => continue,
            Err(e) => return Err(io_error("receiving an export", e)),
        };
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = msg {
                fds.extend(received);
            }
        }
        if r.flags.contains(ReturnFlags::CTRUNC) {
            return Err(Error::Ipc(format!(
                "receiving an export: more descriptors than the {count} announced, or the \
                 process's limit on open files was reached; the extra ones were dropped"
            )));
        }
        if r.bytes == 0 {
            return Err(Error::Ipc("receiving an export: the socket was closed".into()));
        }
        got += r.bytes;
    }
    Ok(())
}

/// One import, mapped: its reservation (which nothing else uses) and the allocation's address
/// and size in it.
#[derive(Debug)]
struct Imported {
    base: DevicePtr,
    len: usize,
    size: u64,
}

/// The imports an allocator holds, by the address it handed out. Its lock is held across an
/// import's, a close's and a grant's driver calls, never with the heap's.
#[derive(Debug, Default)]
pub(crate) struct Imports {
    map: Mutex<HashMap<DevicePtr, Imported>>,
}

impl Imports {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<DevicePtr, Imported>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Maps `export` on `driver`: a reservation of its own, each chunk imported and mapped
    /// there in order (each handle released once mapped: the mapping keeps the memory), access
    /// set once. Any failure undoes all of it and says which step failed.
    pub fn import(&self, driver: &dyn Driver, export: &Export) -> Result<DevicePtr> {
        // Held throughout, so that `grant` sees every import whose access was set before the
        // driver's peer list changed.
        let mut map = self.map();
        if export.backend != driver.name() {
            return Err(Error::Ipc(format!(
                "an export of the {} backend cannot be imported on the {} backend",
                export.backend,
                driver.name()
            )));
        }
        let page = driver.granularity() as u64;
        if let Some(c) = export.chunks.iter().find(|c| c.size == 0 || c.size % page != 0) {
            return Err(Error::Ipc(format!(
                "a chunk of {} bytes is not a multiple of this device's granularity ({page})",
                c.size
            )));
        }
        let len: u64 = export.chunks.iter().map(|c| c.size).sum();
        let len = usize::try_from(len).map_err(|_| Error::Ipc("export too large".into()))?;
        let base = driver.reserve(len, reservation_alignment(len, page as usize))?;
        let mut mapped = 0u64;
        let mapping = (|| -> Result<()> {
            for c in &export.chunks {
                let handle = driver.import_chunk(c)?;
                let r = driver.map(base + mapped, c.size as usize, handle);
                // Mapped, the memory lives until the unmap; unmapped, the release frees it.
                let released = driver.release_chunk(handle);
                r?;
                mapped += c.size;
                released?;
            }
            driver.set_access(base, len)?;
            Ok(())
        })();
        if let Err(e) = mapping {
            if mapped > 0 {
                let _ = driver.unmap(base, mapped as usize);
            }
            let _ = driver.free_reservation(base, len);
            return Err(e);
        }
        let ptr = base + export.offset;
        map.insert(ptr, Imported { base, len, size: export.size });
        Ok(ptr)
    }

    /// Sets access again on every import, for the peers the driver's list has now
    /// (`Allocator::enable_peer_access`).
    pub fn grant(&self, driver: &dyn Driver) -> Result<()> {
        let map = self.map();
        for imp in map.values() {
            driver.set_access(imp.base, imp.len)?;
        }
        Ok(())
    }

    /// Unmaps and forgets the import at `ptr`. If the unmap fails the import stays, to be
    /// closed again.
    pub fn close(&self, driver: &dyn Driver, ptr: DevicePtr) -> Result<()> {
        let mut map = self.map();
        let Some(imp) = map.get(&ptr) else {
            return Err(Error::Ipc(format!("{ptr:#x} is not an import of this allocator")));
        };
        driver.unmap(imp.base, imp.len)?;
        let imp = map.remove(&ptr).expect("looked up above");
        drop(map);
        // Unmapped, the addresses are ours alone; a failure to give them back loses only them.
        driver.free_reservation(imp.base, imp.len)?;
        Ok(())
    }

    /// Imports held: (address, size), by address.
    pub fn list(&self) -> Vec<(DevicePtr, u64)> {
        let mut v: Vec<_> = self.map().iter().map(|(&p, i)| (p, i.size)).collect();
        v.sort_unstable();
        v
    }

    /// Closes every import (the allocator is going away); failures are ignored.
    pub fn close_all(&self, driver: &dyn Driver) {
        let ptrs: Vec<DevicePtr> = self.map().keys().copied().collect();
        for p in ptrs {
            let _ = self.close(driver, p);
        }
    }
}

#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn chunks(n: usize) -> Vec<SharedChunk> {
        let file = std::fs::File::open("/dev/null").unwrap();
        (0..n)
            .map(|i| SharedChunk {
                fd: OwnedFd::from(file.try_clone().unwrap()),
                offset: 4096 * i as u64,
                size: 2 << 20,
            })
            .collect()
    }

    #[test]
    fn an_export_survives_the_wire_with_hundreds_of_descriptors() {
        for n in [1, 250, 251, 600] {
            let e = Export::new("host", 3, (2 << 20) * n as u64 - 100, 64, chunks(n));
            let (a, b) = UnixStream::pair().unwrap();
            let sender = std::thread::spawn(move || e.send(&a).map(|_| e));
            let got = Export::recv(&b).unwrap();
            let e = sender.join().unwrap().unwrap();
            assert_eq!((got.backend(), got.device(), got.pid()), ("host", 3, std::process::id()));
            assert_eq!((got.size(), got.offset()), (e.size(), e.offset()));
            let sizes = |x: &Export| -> Vec<(u64, u64)> {
                x.chunks().iter().map(|c| (c.offset, c.size)).collect()
            };
            assert_eq!(sizes(&got), sizes(&e), "{n} chunks");
        }
    }

    #[test]
    fn an_export_of_another_backend_is_refused_before_any_driver_call() {
        let cfg = crate::driver::host::HostConfig {
            page_size: 64 << 10,
            capacity: 1 << 20,
            ..Default::default()
        };
        let d =
            crate::driver::Instrumented::new(crate::driver::host::HostDriver::new(cfg).unwrap());
        let imports = Imports::default();
        let cuda = Export::new("cuda", 0, 64 << 10, 0, chunks(1));
        assert!(
            matches!(imports.import(&d, &cuda), Err(Error::Ipc(m)) if m.contains("cuda backend"))
        );
        let mut odd = Export::new("host", 0, 4096, 0, chunks(1));
        odd.chunks[0].size = 4096;
        assert!(
            matches!(imports.import(&d, &odd), Err(Error::Ipc(m)) if m.contains("granularity"))
        );
        assert_eq!(d.counts().total(), 0);
        assert!(matches!(imports.close(&d, 0x1000), Err(Error::Ipc(_))));
    }

    #[test]
    fn an_export_survives_its_parts_and_bad_parts_are_refused() {
        let e = Export::new("host", 1, 3 << 20, 4096, chunks(2));
        let (bytes, fds) = e.into_parts();
        assert_eq!(fds.len(), 2);
        let bad = |b: &[u8], n: usize| {
            let fds = chunks(n).into_iter().map(|c| c.fd).collect();
            matches!(Export::from_parts(b, fds), Err(Error::Ipc(_)))
        };
        assert!(bad(&bytes, 1), "a descriptor short");
        assert!(bad(&bytes[..bytes.len() - 1], 2), "a byte short");
        assert!(bad(&bytes[..10], 2), "no whole prefix");
        let back = Export::from_parts(&bytes, fds).unwrap();
        assert_eq!(
            (back.size(), back.offset(), back.device(), back.chunks().len()),
            (3 << 20, 4096, 1, 2)
        );
    }

    #[test]
    fn non_blocking_sockets_wait_instead_of_failing() {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        let receiver = std::thread::spawn(move || Export::recv(&b).map(|e| e.chunks().len()));
        std::thread::sleep(std::time::Duration::from_millis(50));
        // 600 descriptors take three messages; the receiver finds nothing at first.
        Export::new("host", 0, 1 << 20, 0, chunks(600)).send(&a).unwrap();
        assert_eq!(receiver.join().unwrap().unwrap(), 600);
    }

    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }

    #[test]
    fn more_descriptors_than_announced_are_never_taken_in() {
        // One chunk announced, 200 descriptors sent with it: the receiver takes in at most one
        // (the kernel closes the rest) and refuses the export.
        let one = Export::new("host", 0, 4096, 0, chunks(1));
        let (bytes, _) = one.into_parts();
        let extra = chunks(200);
        let fds: Vec<_> = extra.iter().map(|c| c.fd.as_fd()).collect();
        let (a, b) = UnixStream::pair().unwrap();
        send_with(a.as_fd(), &bytes, &fds, None).unwrap();
        drop(extra);
        let before = open_fds();
        match Export::recv(&b) {
            Err(Error::Ipc(m)) => {
                assert!(m.contains("more descriptors than the 1 announced"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(open_fds(), before, "every descriptor received was closed");
    }

    #[test]
    fn exported_descriptors_are_close_on_exec() {
        use rustix::io::{fcntl_getfd, FdFlags};
        let file = std::fs::File::open("/dev/null").unwrap();
        // `dup` gives a descriptor without close-on-exec, as a driver may.
        let fd = rustix::io::dup(&file).unwrap();
        assert!(!fcntl_getfd(&fd).unwrap().contains(FdFlags::CLOEXEC));
        let e = Export::new("host", 0, 4096, 0, vec![SharedChunk { fd, offset: 0, size: 4096 }]);
        assert!(fcntl_getfd(&e.chunks()[0].fd).unwrap().contains(FdFlags::CLOEXEC));
        // Received descriptors are too.
        let (a, b) = UnixStream::pair().unwrap();
        e.send(&a).unwrap();
        let got = Export::recv(&b).unwrap();
        assert!(fcntl_getfd(&got.chunks()[0].fd).unwrap().contains(FdFlags::CLOEXEC));
    }

    /// Runs `f` on a thread; its result if it returns within `limit`, else `None` (the thread
    /// is left behind).
    fn within<T: Send + 'static>(
        limit: std::time::Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(limit).ok()
    }

    #[test]
    fn a_sender_that_stops_half_way_times_out() {
        use std::time::Duration;
        let e = Export::new("host", 0, 1 << 20, 0, chunks(300));
        let bytes = e.encode();
        // The description and the first 250 descriptors, then nothing: the socket stays open.
        let (a, b) = UnixStream::pair().unwrap();
        let fds: Vec<_> = e.chunks().iter().take(FDS_PER_MESSAGE).map(|c| c.fd.as_fd()).collect();
        send_with(a.as_fd(), &bytes, &fds, None).unwrap();
        // A blocking socket with its own time-out: it holds.
        b.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let b2 = b.try_clone().unwrap();
        let r = within(Duration::from_secs(5), move || Export::recv(&b2).map(|_| ()));
        match r {
            Some(Err(Error::Ipc(m))) => assert!(m.contains("time-out"), "{m}"),
            Some(other) => panic!("{other:?}"),
            None => panic!("recv waited past the socket's time-out"),
        }
        // A deadline holds on any socket, blocking or not, with no time-out of its own.
        b.set_read_timeout(None).unwrap();
        let b3 = b.try_clone().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_millis(200);
        let r = within(Duration::from_secs(5), move || Export::recv_by(&b3, Some(deadline)));
        assert!(matches!(r, Some(Err(Error::Ipc(m))) if m.contains("timed out")));
        b.set_nonblocking(true).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_millis(200);
        let r = within(Duration::from_secs(5), move || Export::recv_by(&b, Some(deadline)));
        assert!(matches!(r, Some(Err(Error::Ipc(m))) if m.contains("timed out")));
        drop(a);
    }

    #[test]
    fn a_prefix_cut_short_by_a_close_is_refused_at_once() {
        let (a, b) = UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut &a, &MAGIC[..6]).unwrap();
        drop(a);
        let r = within(std::time::Duration::from_secs(5), move || Export::recv(&b).map(|_| ()));
        assert!(matches!(r, Some(Err(Error::Ipc(m))) if m.contains("closed")));
    }

    #[test]
    fn malformed_exports_are_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut &a, b"NOTANEXPORT_____").unwrap();
        assert!(matches!(Export::recv(&b), Err(Error::Ipc(m)) if m.contains("magic")));
        // A size that does not fit the chunks.
        let e = Export::new("host", 0, 4 << 20, 0, chunks(1));
        let bytes = e.encode();
        let fds: Vec<OwnedFd> = chunks(1).into_iter().map(|c| c.fd).collect();
        assert!(
            matches!(Export::decode(&bytes[PREFIX..], fds), Err(Error::Ipc(m)) if m.contains("do not fit"))
        );
        // Fewer descriptors than chunks: the sender died half-way.
        let (a, b) = UnixStream::pair().unwrap();
        let e = Export::new("host", 0, 1 << 20, 0, chunks(300));
        send_with(a.as_fd(), &e.encode(), &[], None).unwrap();
        drop(a);
        assert!(matches!(Export::recv(&b), Err(Error::Ipc(m)) if m.contains("closed")));
    }
}
