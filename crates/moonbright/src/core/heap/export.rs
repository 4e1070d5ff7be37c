//! Sharing with other processes (`ipc.rs`): the chunks behind an allocation an export shares,
//! and the exported chunks that are never reused here, released once unmapped.

use super::{Backing, Claim, Heap, RangeId, Use};
use crate::core::pool::ChunkId;
use crate::driver::ChunkHandle;
use crate::error::{Error, Result};

/// The chunks behind one allocation, for an export (`Heap::shared_chunks`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SharedChunks {
    /// (handle, bytes) in address order.
    pub chunks: Vec<(ChunkHandle, u64)>,
    /// Where the allocation starts in the first chunk.
    pub offset: u64,
    /// The allocation's size in bytes.
    pub size: u64,
}

impl Heap {
    /// What exporting the live allocation (or growable) at `ptr` shares (`Allocator::export`):
    /// the chunks that back it, in address order, as (handle, bytes), only those its bytes lie
    /// in; where it starts in the first; and its size. With `mark`, marks them exported, before
    /// the driver exports them (so that a free meanwhile cannot hand them to another
    /// allocation): from then on they are never reused here, and once freed they go back to
    /// the driver (`Pool::put_bare`, `discard_range`), even if the export then fails. A block
    /// carved from an arena (below a page, or cut from cached chunks) shares its chunks with
    /// other allocations, which the importer would reach: it is refused (docs/security.md). A
    /// growable shares the chunks committed now. Refuses any other pointer as `free` would.
    pub fn shared_chunks(&mut self, ptr: u64, mark: bool) -> Result<SharedChunks> {
        if let Some(live) = self.live.allocs.get(&ptr).filter(|l| !l.pooled) {
            let id = match live.backing {
                Backing::Range(id) => id,
                Backing::Sub { arena, .. } => {
                    let (what, remedy) = if self.range(arena).use_ == Use::Arena {
                        (
                            "a block below a page, carved from a page",
                            format!("allocate what you share with {} bytes or more", self.lim.page),
                        )
                    } else {
                        (
                            "a block carved from a run of cached chunks (option `carve`)",
                            "set options `carve` and `carve_repeated` to 0 in a process that \
                             shares what it allocates"
                                .to_string(),
                        )
                    };
                    return Err(Error::Ipc(format!(
                        "{ptr:#x} ({} bytes) is {what} that other allocations share: an \
                         importer would reach their memory, so it is not exported; {remedy} \
                         (docs/security.md)",
                        live.size
                    )));
                }
            };
            let size = live.size;
            let chunks = self.range(id).chunks.to_vec();
            let shared = self.export_covering(&chunks, size, mark);
            return Ok(SharedChunks { chunks: shared, offset: 0, size });
        }
        if let Ok(g) = self.live_growable(ptr) {
            if g.chunks.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "growable allocation {ptr:#x} has no memory committed to share; resize it first"
                )));
            }
            let (chunks, size) = (g.chunks.clone(), g.size);
            let shared = self.export_covering(&chunks, size.max(1), mark);
            return Ok(SharedChunks { chunks: shared, offset: 0, size });
        }
        Err(self.classify_bad_free(ptr))
    }

    /// The leading chunks of `chunks` that `size` bytes from the first's start lie in, as
    /// (handle, bytes); with `mark`, marked exported.
    pub(super) fn export_covering(
        &mut self,
        chunks: &[ChunkId],
        size: u64,
        mark: bool,
    ) -> Vec<(ChunkHandle, u64)> {
        let mut out = Vec::new();
        let mut covered = 0;
        for &c in chunks {
            if covered >= size {
                break;
            }
            if mark {
                self.pool.mark_exported(c);
            }
            let bytes = self.bytes(self.pool.get(c).pages);
            out.push((self.pool.get(c).handle, bytes));
            covered += bytes;
        }
        out
    }

    /// Whether range `id` holds an exported chunk (checked only once anything was exported).
    pub(super) fn holds_exported(&self, id: RangeId) -> bool {
        self.pool.any_exported() && self.range(id).chunks.iter().any(|&c| self.pool.get(c).exported)
    }

    /// Takes apart a freed range that holds exported chunks instead of caching it: its
    /// addresses are retired (unmapped once `after`, a stream's epoch, has passed), its
    /// exported chunks doomed (released once unmapped, never reused), the others bare.
    pub(super) fn discard_range(&mut self, id: RangeId, after: Option<(u64, u64)>) {
        let range = self.remove_range(id);
        for &c in range.chunks.iter() {
            self.pool.put_bare(c);
        }
        let len = self.bytes(range.pages);
        self.retire_after(range.va, len, range.chunks.into_vec(), after);
    }

    /// How many exported chunks wait to be released, still mapped by retired ranges or not: held
    /// memory no request can use until they go.
    pub fn doomed_chunks(&self) -> usize {
        self.pool.doomed_count()
    }

    /// Whether an exported chunk waits, unmapped, to be released (`take_doomed`).
    pub fn has_doomed(&self) -> bool {
        self.pool.any_exported() && self.pool.has_doomed_unmapped()
    }

    /// Takes out the exported chunks that no range uses and that are mapped nowhere, for
    /// release, as `take_releasable` does (a claim id, and the chunks).
    pub fn take_doomed(&mut self) -> (u64, Vec<(ChunkId, ChunkHandle, u64)>) {
        let out: Vec<_> = self
            .pool
            .take_doomed()
            .into_iter()
            .map(|c| (c, self.pool.get(c).handle, self.pool.get(c).pages))
            .collect();
        let chunks = out.iter().map(|r| r.0).collect();
        let id = self.claims.add(Claim { chunks, ..Claim::default() });
        (id, out)
    }
}
