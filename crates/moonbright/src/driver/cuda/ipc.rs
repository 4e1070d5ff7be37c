//! The CUDA backend's sharing of chunks with other processes: exports as POSIX file descriptors
//! (kept per chunk until its release, so that a second export is a `dup`) and imports.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use cudarc::driver::sys;

use super::context::relaxed;
use super::load::check;
use super::{CudaDriver, EXPORTS_KEPT, FD_HANDLE};
use crate::driver::{code, CallKind, ChunkHandle, DriverError, DriverResult, Ipc, SharedChunk};

impl Ipc for CudaDriver {
    fn export_chunk(&self, handle: ChunkHandle, size: usize) -> DriverResult<SharedChunk> {
        let kind = CallKind::Export;
        let dup = |fd: &OwnedFd| {
            fd.try_clone().map_err(|e| {
                DriverError::new(kind, code::UNKNOWN, format!("dup of an exported descriptor: {e}"))
            })
        };
        let mut kept = self.exported.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(fd) = kept.get(&handle.0) {
            return Ok(SharedChunk { fd: dup(fd)?, offset: 0, size: size as u64 });
        }
        drop(kept);
        self.any_exported.store(true, Ordering::SeqCst);
        let releases = self.releases.load(Ordering::SeqCst);
        let _ctx = self.enter(kind)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for a POSIX file descriptor handle the out-pointer is an `int`, which `fd`
        // is; the driver validates the handle.
        let r = relaxed(|| unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle.0,
                FD_HANDLE,
                0,
            )
        });
        check(kind, r, || {
            format!("cuMemExportToShareableHandle(handle={:#x}, POSIX fd)", handle.0)
        })?;
        if fd < 0 {
            return Err(DriverError::new(
                kind,
                code::UNKNOWN,
                format!(
                    "cuMemExportToShareableHandle(handle={:#x}) gave descriptor {fd}",
                    handle.0
                ),
            ));
        }
        // SAFETY: the driver just opened `fd` for the caller, who owns it from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        kept = self.exported.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < EXPORTS_KEPT && self.releases.load(Ordering::SeqCst) == releases {
            if let Ok(copy) = dup(&fd) {
                kept.insert(handle.0, copy);
            }
        }
        Ok(SharedChunk { fd, offset: 0, size: size as u64 })
    }

    fn import_chunk(&self, shared: &SharedChunk) -> DriverResult<ChunkHandle> {
        let kind = CallKind::Import;
        if shared.offset != 0 {
            return Err(DriverError::new(
                kind,
                code::INVALID_VALUE,
                format!("a CUDA chunk starts at offset 0 of its descriptor, not {}", shared.offset),
            ));
        }
        let _ctx = self.enter(kind)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let raw = shared.fd.as_raw_fd();
        // SAFETY: `handle` is a valid out-pointer; for a POSIX file descriptor the driver reads
        // the descriptor from the pointer's value (it is not dereferenced) and does not take it.
        let r = relaxed(|| unsafe {
            sys::cuMemImportFromShareableHandle(&mut handle, raw as usize as *mut c_void, FD_HANDLE)
        });
        check(kind, r, || format!("cuMemImportFromShareableHandle(fd={raw}, POSIX fd)"))?;
        Ok(ChunkHandle(handle))
    }

    fn shareable(&self) -> bool {
        self.shareable.load(Ordering::Relaxed)
    }
}
