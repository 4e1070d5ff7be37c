//! The sockets of CUDA IPC handles: a peer's credentials (`SO_PEERCRED`), reads and writes
//! bounded by a deadline, connecting to a broker, and the importer's side of the exchange
//! ([`fetch`]: connect, check who serves, present the token, receive the descriptors).

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use moonbright::ipc::Export;

use super::{address_name, Handle, BUSY, REFUSED, SENT};

/// A connected Unix socket's peer, as `SO_PEERCRED` gives it: its pid (0 if not visible from
/// this process's pid namespace) and user.
#[derive(Clone, Copy, Debug)]
pub(super) struct Peer {
    pub(super) pid: u32,
    pub(super) uid: u32,
}

/// The credentials of `stream`'s peer: the process that connected (on the broker's side), or
/// that called `listen` (on the importer's). Read with `getsockopt` into `libc::ucred`, whose
/// pid may be 0, which a `rustix` `Pid` cannot hold.
pub(super) fn peer_credentials(stream: &UnixStream) -> std::io::Result<Peer> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals of the sizes given; the descriptor is the
    // stream's, open for the call.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(std::io::Error::other("SO_PEERCRED gave a short answer"));
    }
    Ok(Peer { pid: u32::try_from(cred.pid).unwrap_or(0), uid: cred.uid })
}

/// Why an open failed: the export could not be fetched (the exporter is gone, freed it, is
/// another user's, or did not answer in time), or it could not be mapped here.
#[derive(Debug)]
pub enum Fetch {
    Unreachable(String),
    Import(String),
}

/// Waits until `fd` is ready for `ready`, or fails at `deadline`.
pub(super) fn wait(fd: impl AsFd, ready: PollFlags, deadline: Instant) -> Result<(), String> {
    let mut fds = [PollFd::new(&fd, ready)];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("timed out".into());
        }
        let t = Timespec::try_from(left).map_err(|e| e.to_string())?;
        match poll(&mut fds, Some(&t)) {
            Ok(0) => {}
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(format!("waiting for the socket: {e}")),
        }
    }
}

/// Writes all of `bytes` by `deadline`, without the `SIGPIPE` a write to a closed socket
/// raises (a C program has not ignored it, as Rust's and Python's runtimes have).
pub(super) fn send_all(
    stream: &UnixStream,
    mut bytes: &[u8],
    deadline: Instant,
) -> Result<(), String> {
    use rustix::net::SendFlags;
    while !bytes.is_empty() {
        match rustix::net::send(stream, bytes, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
            Ok(n) => bytes = &bytes[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => wait(stream, PollFlags::OUT, deadline)?,
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

/// Fills `buf` by `deadline`.
pub(super) fn recv_all(
    stream: &UnixStream,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<(), String> {
    use rustix::net::RecvFlags;
    let mut got = 0;
    while got < buf.len() {
        match rustix::net::recv(stream, &mut buf[got..], RecvFlags::DONTWAIT) {
            Ok((_, 0)) => return Err("the socket was closed".into()),
            Ok((_, n)) => got += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => wait(stream, PollFlags::IN, deadline)?,
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

/// Connects to the abstract socket `name` by `deadline`. A Unix socket's connect does not
/// complete later: while the listener's queue is full it fails with `EAGAIN`, and is tried
/// again every few milliseconds.
pub(super) fn connect(name: &str, deadline: Instant) -> Result<UnixStream, String> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let addr = SocketAddrUnix::new_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| e.to_string())?;
    loop {
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => return Ok(UnixStream::from(fd)),
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => {
                if Instant::now() >= deadline {
                    return Err("timed out: its queue of connections stayed full".into());
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Sends `token` and reads the broker's one-byte answer. A broker that refuses (another user,
/// too many importers) answers and closes without reading the token, so the send may fail
/// with the answer already waiting: it is read anyway. On failure, what failed and why.
fn ask(stream: &UnixStream, token: &[u8], deadline: Instant) -> Result<u8, (&'static str, String)> {
    let sent = send_all(stream, token, deadline);
    let mut status = [0u8; 1];
    match (sent, recv_all(stream, &mut status, deadline)) {
        (_, Ok(())) => Ok(status[0]),
        (Err(e), Err(_)) => Err(("cannot ask", e)),
        (Ok(()), Err(e)) => Err(("no answer from", e)),
    }
}

/// Fetches the export `h` names from its broker, within `patience` in all. The broker must be
/// the process the handle names, of this process's user (`SO_PEERCRED`): abstract socket
/// names are anyone's to take once their process has exited, and the token is not sent to
/// whoever holds one now.
pub(super) fn fetch(h: &Handle, patience: Duration) -> Result<Export, Fetch> {
    let deadline = Instant::now() + patience;
    let gone = |what: &str, e: &dyn std::fmt::Display| {
        Fetch::Unreachable(format!("{what} the exporting process {} (has it exited?): {e}", h.pid))
    };
    let stream =
        connect(&address_name(h.pid, &h.broker), deadline).map_err(|e| gone("cannot reach", &e))?;
    let peer = peer_credentials(&stream).map_err(|e| gone("cannot tell who serves", &e))?;
    let uid = rustix::process::geteuid().as_raw();
    // A pid of 0: a process this one cannot see (another pid namespace), never the exporter.
    if peer.uid != uid || peer.pid != h.pid || peer.pid == 0 {
        return Err(Fetch::Unreachable(format!(
            "the handle's socket is served by process {} of user {}, not by the exporting \
             process {} of user {uid} (a stale handle whose name another process took?): its \
             token was not sent",
            peer.pid, peer.uid, h.pid
        )));
    }
    let status = ask(&stream, &h.token, deadline).map_err(|(what, e)| gone(what, &e))?;
    match status {
        SENT => Export::recv_by(&stream, Some(deadline)).map_err(|e| gone("a bad export from", &e)),
        REFUSED => Err(Fetch::Unreachable(format!(
            "process {} serves its memory only to its own user",
            h.pid
        ))),
        BUSY => Err(Fetch::Unreachable(format!(
            "process {} is serving as many importers as it can at once; try again",
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
    fn a_refusal_sent_before_the_token_is_read_is_still_seen() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        // The broker's side answers BUSY and closes without reading anything.
        send_all(&theirs, &[BUSY], deadline).unwrap();
        drop(theirs);
        let big = vec![0u8; 1 << 20]; // more than the socket buffers: the send must fail
        assert!(send_all(&ours, &big, deadline).is_err(), "a send to a closed peer");
        assert_eq!(ask(&ours, &big, deadline), Ok(BUSY));
    }

    #[test]
    fn a_peer_that_closes_without_answering_is_reported() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        drop(theirs);
        let deadline = Instant::now() + Duration::from_secs(5);
        let (what, _) = ask(&ours, b"token", deadline).unwrap_err();
        assert_eq!(what, "cannot ask");
    }
}
