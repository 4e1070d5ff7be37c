//! The host backend's system calls (memfd, mmap, mprotect, fallocate, ...), each in one small
//! wrapper.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn check_map(p: *mut libc::c_void) -> io::Result<u64> {
    if p == libc::MAP_FAILED {
        Err(io::Error::last_os_error())
    } else {
        Ok(p as usize as u64)
    }
}

fn off(x: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(x).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))
}

pub(super) fn os_page_size() -> usize {
    // SAFETY: sysconf reads a constant and has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

pub(super) fn memfd() -> io::Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated literal; memfd_create touches no caller memory.
    let fd = unsafe { libc::memfd_create(c"moonbright-host".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The size of `fd`'s file.
pub(super) fn file_len(fd: &OwnedFd) -> io::Result<u64> {
    Ok(std::fs::File::from(fd.try_clone()?).metadata()?.len())
}

pub(super) fn set_len(fd: &OwnedFd, len: u64) -> io::Result<()> {
    // SAFETY: ftruncate on an fd we own; a sparse grow allocates nothing.
    check(unsafe { libc::ftruncate(fd.as_raw_fd(), off(len)?) })
}

pub(super) fn punch_hole(fd: &OwnedFd, offset: u64, len: u64) -> io::Result<()> {
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate on an fd we own; the range belongs to a chunk mapped nowhere.
    check(unsafe { libc::fallocate(fd.as_raw_fd(), mode, off(offset)?, off(len)?) })
}

pub(super) fn allocated_bytes(fd: &OwnedFd) -> io::Result<u64> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a whole `stat` into the buffer we pass on success.
    check(unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) })?;
    // SAFETY: fstat succeeded, so the buffer is initialised.
    let stat = unsafe { stat.assume_init() };
    Ok(u64::try_from(stat.st_blocks).unwrap_or(0) * 512)
}

pub(super) const RESERVE_FLAGS: libc::c_int =
    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;

/// Fresh inaccessible address space anywhere; costs no memory.
pub(super) fn reserve_anywhere(len: usize) -> io::Result<u64> {
    // SAFETY: without MAP_FIXED the kernel picks unused addresses, so nothing is replaced.
    check_map(unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, RESERVE_FLAGS, -1, 0)
    })
}

/// Replaces `[va, va + len)` with inaccessible placeholder pages.
///
/// # Safety
/// The range must be address space this driver owns, with no live reference into it.
pub(super) unsafe fn reserve_fixed(va: u64, len: u64) -> io::Result<()> {
    let flags = RESERVE_FLAGS | libc::MAP_FIXED;
    // SAFETY: the caller owns the range and nothing points into it.
    let p =
        unsafe { libc::mmap(va as usize as *mut _, len as usize, libc::PROT_NONE, flags, -1, 0) };
    check_map(p).map(drop)
}

/// Maps `len` bytes of `fd` at `offset` over `[va, va + len)`, inaccessible for now.
///
/// # Safety
/// As for [`reserve_fixed`].
pub(super) unsafe fn map_shared_fixed(
    va: u64,
    len: u64,
    fd: &OwnedFd,
    offset: u64,
) -> io::Result<()> {
    let flags = libc::MAP_SHARED | libc::MAP_FIXED;
    // SAFETY: the caller owns the range and nothing points into it.
    let p = unsafe {
        libc::mmap(
            va as usize as *mut _,
            len as usize,
            libc::PROT_NONE,
            flags,
            fd.as_raw_fd(),
            off(offset)?,
        )
    };
    check_map(p).map(drop)
}

/// Makes `[va, va + len)` readable and writable.
///
/// # Safety
/// The range must be mappings this driver owns.
pub(super) unsafe fn protect_rw(va: u64, len: u64) -> io::Result<()> {
    // SAFETY: the caller owns the range; adding permissions breaks no reference.
    check(unsafe {
        libc::mprotect(va as usize as *mut _, len as usize, libc::PROT_READ | libc::PROT_WRITE)
    })
}

/// Gives `[va, va + len)` back to the OS.
///
/// # Safety
/// As for [`reserve_fixed`].
pub(super) unsafe fn unmap(va: u64, len: u64) -> io::Result<()> {
    // SAFETY: the caller owns the range and nothing points into it.
    check(unsafe { libc::munmap(va as usize as *mut _, len as usize) })
}
