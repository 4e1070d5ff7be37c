//! The host backend's sharing of chunks with other processes: an export is the memfd (or an
//! imported chunk's own file) and the chunk's offsets in it; an import maps those offsets.

use std::sync::Arc;

use super::memory::Chunk;
use super::{err, os_err, sys, HostDriver};
use crate::driver::{code, CallKind, ChunkHandle, DriverResult, Ipc, SharedChunk};

impl Ipc for HostDriver {
    /// Shares the memfd (or, for a chunk imported here, the file it came from) with the
    /// chunk's offsets. Unlike CUDA's descriptor, which names one chunk, it reaches the whole
    /// file; importers map only `[offset, offset + size)`.
    fn export_chunk(&self, handle: ChunkHandle, size: usize) -> DriverResult<SharedChunk> {
        let call = CallKind::Export;
        let mut st = self.lock();
        let st = &mut *st;
        let chunk = match st.memory.chunks.get_mut(&handle.0) {
            Some(c) if !c.released => c,
            _ => {
                return Err(err(
                    call,
                    code::INVALID_HANDLE,
                    format!("export_chunk: chunk {} is unknown or released", handle.0),
                ))
            }
        };
        if chunk.size != size as u64 {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!(
                    "export_chunk: size {size} differs from chunk {}'s {}",
                    handle.0, chunk.size
                ),
            ));
        }
        let file = chunk.imported.as_deref().unwrap_or(&st.memory.fd);
        let fd = file.try_clone().map_err(|e| os_err(call, "export_chunk: dup", e))?;
        chunk.exported = true;
        Ok(SharedChunk { fd, offset: chunk.offset, size: chunk.size })
    }

    fn import_chunk(&self, shared: &SharedChunk) -> DriverResult<ChunkHandle> {
        let call = CallKind::Import;
        let (offset, size) = (shared.offset, shared.size);
        let ps = self.page_size as u64;
        if size == 0 || size % ps != 0 || offset % ps != 0 {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!(
                    "import_chunk: offset {offset} and size {size} must be multiples of the \
                     granularity {ps}, the size non-zero"
                ),
            ));
        }
        let len = sys::file_len(&shared.fd).map_err(|e| os_err(call, "import_chunk: fstat", e))?;
        if offset.checked_add(size).map_or(true, |end| end > len) {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("import_chunk: [{offset}, +{size}) is past the file's end ({len} bytes)"),
            ));
        }
        let fd = shared.fd.try_clone().map_err(|e| os_err(call, "import_chunk: dup", e))?;
        let mut st = self.lock();
        let chunk = Chunk { imported: Some(Arc::new(fd)), ..Chunk::new(offset, size) };
        let id = st.memory.add_chunk(chunk);
        Ok(ChunkHandle(id))
    }

    fn shareable(&self) -> bool {
        true
    }
}
