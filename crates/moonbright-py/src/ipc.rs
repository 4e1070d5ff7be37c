//! Sharing with other processes: sending, receiving, exporting and importing allocations.

use moonbright::{Allocator, Error};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::{get, py_err, DEVICES};

/// Sends the live MoonBright allocation at `ptr` to another process over `socket_fd`, a
/// connected Unix socket (`socket.fileno()`): its chunks travel as file descriptors. The
/// allocation must stay live until the receiver has closed it. `device=None` means the
/// allocator that holds `ptr`. Raises RuntimeError for a pointer that is not a live allocation,
/// with sharing off (option `ipc`), or when the socket fails.
#[pyfunction]
#[pyo3(signature = (ptr, socket_fd, device=None))]
pub(crate) fn ipc_send(
    py: Python<'_>,
    ptr: u64,
    socket_fd: i32,
    device: Option<i32>,
) -> PyResult<()> {
    let a = holder(ptr, device)?;
    let socket = borrowed_fd(socket_fd)?;
    py.allow_threads(|| a.export(ptr)?.send(socket)).map_err(|e| py_err(e.to_string()))
}

/// The allocator of `device`, or with `device=None` the one that holds `ptr` (else the
/// current device's).
pub(crate) fn holder(ptr: u64, device: Option<i32>) -> PyResult<&'static Allocator> {
    match device {
        None => match DEVICES.owner(ptr) {
            Some((_, a)) => Ok(a),
            None => get(None),
        },
        Some(d) => get(Some(d)),
    }
}

/// Exports the live allocation at `ptr` for a transport of the caller's: the bytes that
/// describe it and one file descriptor per chunk, which the caller owns and must close
/// (`moonbright.ipc` hands them to `multiprocessing`). `ipc_import` reverses it.
#[pyfunction]
#[pyo3(signature = (ptr, device=None))]
pub(crate) fn ipc_export(
    py: Python<'_>,
    ptr: u64,
    device: Option<i32>,
) -> PyResult<(Py<pyo3::types::PyBytes>, Vec<i32>)> {
    use std::os::fd::IntoRawFd;
    let a = holder(ptr, device)?;
    let (bytes, fds) =
        py.allow_threads(|| a.export(ptr)).map_err(|e| py_err(e.to_string()))?.into_parts();
    let fds = fds.into_iter().map(|fd| fd.into_raw_fd()).collect();
    Ok((pyo3::types::PyBytes::new(py, &bytes).unbind(), fds))
}

/// Maps on `device` what `ipc_export` gave in another process (its bytes, and descriptors of
/// the same files, which stay the caller's); returns the address and size, as `ipc_recv`.
#[pyfunction]
#[pyo3(signature = (data, fds, device=None))]
pub(crate) fn ipc_import(
    py: Python<'_>,
    data: &[u8],
    fds: Vec<i32>,
    device: Option<i32>,
) -> PyResult<(u64, u64)> {
    let a = get(device)?;
    let owned = fds
        .iter()
        .map(|&fd| {
            borrowed_fd(fd)?
                .try_clone_to_owned()
                .map_err(|e| py_err(format!("dup of descriptor {fd}: {e}")))
        })
        .collect::<PyResult<Vec<_>>>()?;
    py.allow_threads(|| {
        let e = moonbright::Export::from_parts(data, owned)?;
        Ok((a.import(&e)?, e.size()))
    })
    .map_err(|e: Error| py_err(e.to_string()))
}

/// The device whose allocator holds a live allocation starting at `ptr`, or None.
#[pyfunction]
pub(crate) fn ipc_owner(ptr: u64) -> Option<usize> {
    DEVICES.owner(ptr).map(|(d, _)| d)
}

/// Receives an allocation `ipc_send` sent over `socket_fd` and maps it on `device`; returns its
/// address and size. `ipc_close` unmaps it, once the work that uses it has completed.
#[pyfunction]
#[pyo3(signature = (socket_fd, device=None))]
pub(crate) fn ipc_recv(
    py: Python<'_>,
    socket_fd: i32,
    device: Option<i32>,
) -> PyResult<(u64, u64)> {
    let a = get(device)?;
    let socket = borrowed_fd(socket_fd)?;
    py.allow_threads(|| {
        let e = moonbright::Export::recv(socket)?;
        Ok((a.import(&e)?, e.size()))
    })
    .map_err(|e: Error| py_err(e.to_string()))
}

/// Unmaps memory `ipc_recv` mapped on `device`. The unmap is immediate.
#[pyfunction]
#[pyo3(signature = (ptr, device=None))]
pub(crate) fn ipc_close(ptr: u64, device: Option<i32>) -> PyResult<()> {
    get(device)?.close_import(ptr).map_err(|e| py_err(e.to_string()))
}

/// The imports `device`'s allocator holds, as (address, size).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn ipc_imports(device: Option<i32>) -> PyResult<Vec<(u64, u64)>> {
    Ok(get(device)?.imports())
}

pub(crate) fn borrowed_fd(fd: i32) -> PyResult<std::os::fd::BorrowedFd<'static>> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!("descriptor {fd} is not open")));
    }
    // SAFETY: the caller passed an open descriptor (`socket.fileno()`, or one it holds) and
    // keeps it open for the whole call, which is the borrow's only use.
    Ok(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
}
