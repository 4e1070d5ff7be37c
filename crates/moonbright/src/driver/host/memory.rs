//! The host backend's physical memory (`Memory`): the memfd's offsets (first fit, coalesced,
//! punched when freed) and chunks' lifetimes.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::sys;

/// The physical memory: one sparse memfd whose offsets are handed to chunks.
#[derive(Debug)]
pub(super) struct Memory {
    pub(super) fd: OwnedFd,
    /// The memfd's size; grows only, since holes cost nothing.
    pub(super) file_len: u64,
    /// Everything at or past this offset is unused.
    pub(super) file_end: u64,
    /// Unused offset ranges below `file_end`: start -> length, disjoint and coalesced.
    pub(super) free_offsets: BTreeMap<u64, u64>,
    pub(super) next_chunk: u64,
    pub(super) chunks: HashMap<u64, Chunk>,
    pub(super) live_chunk_bytes: u64,
}

/// A physical chunk: a range of memfd offsets.
#[derive(Debug)]
pub(super) struct Chunk {
    pub(super) offset: u64,
    pub(super) size: u64,
    /// How many mappings show this chunk now.
    pub(super) maps: usize,
    /// `release_chunk` was called; the chunk goes at its last unmap.
    pub(super) released: bool,
    /// Imported from another backend (`import_chunk`): the file its bytes are in, which is not
    /// this backend's memfd, and whose space this backend neither counts nor frees.
    pub(super) imported: Option<Arc<OwnedFd>>,
    /// Exported (`export_chunk`): another process may map its offsets for as long as it likes,
    /// so once released they are neither punched nor given to a new chunk (CUDA keeps an
    /// exported chunk's memory until its importers release it too).
    pub(super) exported: bool,
}

impl Chunk {
    pub(super) fn new(offset: u64, size: u64) -> Chunk {
        Chunk { offset, size, maps: 0, released: false, imported: None, exported: false }
    }
}

impl Memory {
    /// No chunks yet, on the empty memfd `fd`.
    pub(super) fn new(fd: OwnedFd) -> Memory {
        Memory {
            fd,
            file_len: 0,
            file_end: 0,
            free_offsets: BTreeMap::new(),
            next_chunk: 1,
            chunks: HashMap::new(),
            live_chunk_bytes: 0,
        }
    }

    /// Books `chunk` under a new id.
    pub(super) fn add_chunk(&mut self, chunk: Chunk) -> u64 {
        let id = self.next_chunk;
        self.next_chunk += 1;
        self.chunks.insert(id, chunk);
        id
    }

    /// First fit among freed offsets, else the end of the file (grown as needed).
    pub(super) fn alloc_offsets(&mut self, size: u64) -> io::Result<u64> {
        let fit = self.free_offsets.iter().find(|(_, &len)| len >= size).map(|(&s, &l)| (s, l));
        if let Some((start, len)) = fit {
            self.free_offsets.remove(&start);
            if len > size {
                self.free_offsets.insert(start + size, len - size);
            }
            return Ok(start);
        }
        let start = self.file_end;
        let end = start + size;
        if end > self.file_len {
            sys::set_len(&self.fd, end)?;
            self.file_len = end;
        }
        self.file_end = end;
        Ok(start)
    }

    /// Returns offsets to the free list, coalescing; a range touching the end lowers the end.
    pub(super) fn free_offsets(&mut self, mut start: u64, mut len: u64) {
        if let Some((&s, &l)) = self.free_offsets.range(..start).next_back() {
            if s + l == start {
                self.free_offsets.remove(&s);
                start = s;
                len += l;
            }
        }
        if let Some(l) = self.free_offsets.remove(&(start + len)) {
            len += l;
        }
        if start + len == self.file_end {
            self.file_end = start;
        } else {
            self.free_offsets.insert(start, len);
        }
    }

    /// Frees a chunk's memory: its RAM goes back to the OS and its offsets to the free list.
    pub(super) fn free_chunk(&mut self, id: u64) {
        if let Some(c) = self.chunks.remove(&id) {
            if c.imported.is_some() {
                return;
            }
            self.live_chunk_bytes -= c.size;
            if c.exported {
                return;
            }
            // A failed punch (tmpfs always supports it) would only keep RAM busy; CUDA leaves a
            // fresh chunk's contents unspecified, so reusing unpunched offsets is still correct.
            let _ = sys::punch_hole(&self.fd, c.offset, c.size);
            self.free_offsets(c.offset, c.size);
        }
    }
}
