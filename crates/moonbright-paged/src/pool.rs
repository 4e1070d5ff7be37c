//! [`PagedPool`]: its state (per row, per page, and this step's marks), its creation (the fixed
//! tables, the page store, the applier), its queries, and reading the tables back. The requests,
//! the decode step, the commit, the books and the invariants are in `pool/`, one file each.

mod books;
mod check;
mod commit;
mod decode;
mod requests;

use std::collections::HashMap;
use std::fmt;

use moonbright::driver::Kernels as _;
use moonbright::{Allocator, DevicePtr, StreamHandle};

use crate::config::{PagedConfig, TablePointers};
use crate::delta::{Delta, PageCopy, TokenRun};
use crate::device::DeviceTables;
use crate::error::{PagedError, PagedResult};
use crate::ids::FreeIds;
use crate::reference::HostTables;
use crate::rows::{PageLists, RowHot};
use crate::seq::SeqId;
use crate::store::{GrowableStore, PageStore};

/// Bytes of the step kernel's counters (three u32, padded).
const SYNC_BYTES: usize = 16;

/// Most phase buckets (see `PagedPool::phase_rows`): with larger pages, a decode step's bucket
/// also holds rows that do not start a page, one in `tokens_per_page / MAX_PHASE_BUCKETS`.
const MAX_PHASE_BUCKETS: u32 = 64;

/// Who applies the deltas: kernels on the GPU, or the reference on host memory.
enum Applier {
    Device(DeviceTables),
    Host(HostTables),
}

/// A paged KV-cache pool on one stream. Not `Sync`: one thread drives it (as one scheduler
/// does); every device update is ordered on the stream given at creation.
pub struct PagedPool<'a> {
    alloc: &'a Allocator,
    cfg: PagedConfig,
    stream: StreamHandle,
    store: Box<dyn PageStore + 'a>,
    ptrs: TablePointers,
    /// The step kernel's block counters (`SYNC_BYTES`, zero between launches; see kernels.cu).
    sync: DevicePtr,
    applier: Applier,
    poisoned: Option<String>,

    // Per row.
    generation: Vec<u32>,
    live: Vec<bool>,
    /// The row's length (less `decodes`, wrapping: a decode step grows every length by bumping
    /// `decodes` alone; see [`len_of`](Self::len_of)) and this step's block marks.
    hot: Vec<RowHot>,
    /// Decode steps so far (wrapping).
    decodes: u32,
    /// `decodes % tokens_per_page`.
    decode_phase: u32,
    /// Live rows by phase: a row whose length is `len` when the decode phase is `ph` sits in
    /// bucket `(len - ph) mod tokens_per_page`, reduced mod the number of buckets. The phase
    /// moves with the lengths, so a row changes bucket only when its length changes otherwise;
    /// a decode step visits the one bucket that holds the rows starting a page.
    phase_rows: Vec<Vec<u32>>,
    /// Per row: its bucket, and its index in it.
    phase_bucket: Vec<u32>,
    phase_pos: Vec<u32>,
    /// Rows whose `tail_shared` may be set (each once; `in_shared` marks them).
    shared_rows: Vec<u32>,
    in_shared: Vec<bool>,
    pages: PageLists,
    batch_pos: Vec<u32>,
    /// The row's last page may be shared (checked against its reference count before a write).
    tail_shared: Vec<bool>,
    free_rows: FreeIds,
    live_rows: u32,
    // Per page.
    /// Pages held by more than one sequence, with their holders beyond the first. Any other
    /// page has one holder while a row lists it and none when free or pending, so freeing a
    /// sequence looks nothing up unless some page is shared (no per-page count to touch: a
    /// sequence's pages lie far apart, and each count would be a cache miss).
    extra_refs: HashMap<u32, u32>,
    free_pages: FreeIds,
    /// The rows of the batch, in slot-mapping order for decode tokens.
    batch: Vec<u32>,

    // This step's changes.
    step: u32,
    /// Rows with block marks this step (the marks are in `hot`).
    blk_rows: Vec<u32>,
    len_stamp: Vec<u32>,
    /// The step in which the row last had tokens added.
    token_stamp: Vec<u32>,
    len_rows: Vec<u32>,
    bat_stamp: Vec<u32>,
    bat_idx: Vec<u32>,
    runs: Vec<TokenRun>,
    copies: Vec<PageCopy>,
    /// Copy destination -> its source, this step (a copy of a copy reads the original).
    copied_from: HashMap<u32, u32>,
    explicit_tokens: u32,
    pending_rows: Vec<u32>,
    pending_pages: Vec<u32>,
    /// Scratch: a decode step's new pages.
    fresh_pages: Vec<u32>,
    delta: Delta,
}

impl fmt::Debug for PagedPool<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagedPool")
            .field("config", &self.cfg)
            .field("live_sequences", &self.live_rows)
            .field("pages_in_use", &self.pages_in_use())
            .field("committed_pages", &self.free_pages.limit())
            .finish_non_exhaustive()
    }
}

impl<'a> PagedPool<'a> {
    /// A pool of `cfg` shape whose pages and tables come from `alloc`, updated on `stream`.
    /// On the CUDA backend this compiles the table kernels (once per device) with NVRTC.
    pub fn new(alloc: &'a Allocator, cfg: PagedConfig, stream: StreamHandle) -> PagedResult<Self> {
        cfg.check()?;
        let seqs = cfg.max_seqs as usize;
        let cells = seqs * cfg.max_pages_per_seq as usize;
        let mut bufs = Vec::new();
        let mut take = |bytes: usize| -> PagedResult<DevicePtr> {
            let p = alloc.malloc(bytes)?;
            bufs.push(p);
            Ok(p)
        };
        let made = (|| {
            let block_table = take(cells * 4)?;
            let seq_lens = take(seqs * 4)?;
            let batch_rows = take(seqs * 4)?;
            let slot_mapping = take(cfg.max_step_tokens as usize * 8)?;
            let sync = take(SYNC_BYTES)?;
            alloc.write(sync, &[0; SYNC_BYTES])?;
            alloc.write(block_table, &vec![0xff; cells * 4])?;
            alloc.write(seq_lens, &vec![0; seqs * 4])?;
            alloc.write(batch_rows, &vec![0; seqs * 4])?;
            alloc.write(slot_mapping, &vec![0xff; cfg.max_step_tokens as usize * 8])?;
            let store = GrowableStore::new(alloc, cfg.page_bytes() * cfg.max_pages as usize)?;
            let ptrs = TablePointers {
                block_table,
                seq_lens,
                batch_rows,
                slot_mapping,
                pages: store.base(),
            };
            Ok::<_, PagedError>((store, ptrs, sync))
        })();
        let (mut store, ptrs, sync) = match made {
            Ok(x) => x,
            Err(e) => {
                for p in bufs {
                    let _ = alloc.free(p);
                }
                return Err(e);
            }
        };
        // A driver that runs kernels keeps the tables on the device; else they stay on the host.
        let driver = alloc.driver().inner();
        let applier = if driver.runs_kernels() {
            match DeviceTables::new(driver, stream, sync) {
                Ok(t) => Applier::Device(t),
                Err(e) => {
                    let _ = store.release(stream);
                    for p in bufs {
                        let _ = alloc.free(p);
                    }
                    return Err(e);
                }
            }
        } else {
            Applier::Host(HostTables::new(cfg.max_seqs, cfg.max_pages_per_seq, cfg.tokens_per_page))
        };
        let mut free_rows = FreeIds::new();
        free_rows.grow_to(cfg.max_seqs);
        Ok(PagedPool {
            alloc,
            stream,
            store: Box::new(store),
            ptrs,
            sync,
            applier,
            poisoned: None,
            generation: vec![0; seqs],
            live: vec![false; seqs],
            hot: vec![RowHot::default(); seqs],
            decodes: 0,
            decode_phase: 0,
            phase_rows: vec![Vec::new(); cfg.tokens_per_page.min(MAX_PHASE_BUCKETS) as usize],
            phase_bucket: vec![0; seqs],
            phase_pos: vec![0; seqs],
            shared_rows: Vec::new(),
            in_shared: vec![false; seqs],
            pages: PageLists::new(seqs, cfg.max_pages_per_seq as usize),
            batch_pos: vec![0; seqs],
            tail_shared: vec![false; seqs],
            free_rows,
            live_rows: 0,
            extra_refs: HashMap::new(),
            free_pages: FreeIds::new(),
            batch: Vec::with_capacity(seqs),
            step: 1,
            blk_rows: Vec::new(),
            len_stamp: vec![0; seqs],
            token_stamp: vec![0; seqs],
            len_rows: Vec::new(),
            bat_stamp: vec![0; seqs],
            bat_idx: Vec::new(),
            runs: Vec::new(),
            copies: Vec::new(),
            copied_from: HashMap::new(),
            explicit_tokens: 0,
            pending_rows: Vec::new(),
            pending_pages: Vec::new(),
            fresh_pages: Vec::new(),
            delta: Delta::default(),
            cfg,
        })
    }

    // ---- queries ------------------------------------------------------------------------------

    /// The pool's shape.
    pub fn config(&self) -> &PagedConfig {
        &self.cfg
    }

    /// The stream every update is ordered on.
    pub fn stream(&self) -> StreamHandle {
        self.stream
    }

    /// Whether kernels update the tables (CUDA backend) rather than the host reference.
    pub fn on_device(&self) -> bool {
        matches!(self.applier, Applier::Device(_))
    }

    /// Device addresses of the tables and pages (fixed for the pool's life).
    pub fn pointers(&self) -> TablePointers {
        self.ptrs
    }

    /// Sequences alive now.
    pub fn live_sequences(&self) -> u32 {
        self.live_rows
    }

    /// Pages held by some sequence (or freed this step, until its commit).
    pub fn pages_in_use(&self) -> u32 {
        self.free_pages.limit() - self.free_pages.count()
    }

    /// Pages whose memory is committed now (page ids below this exist).
    pub fn committed_pages(&self) -> u32 {
        self.free_pages.limit()
    }

    /// Bytes of the page store committed now.
    pub fn committed_bytes(&self) -> usize {
        self.store.committed()
    }

    /// The rows of the batch in order: the decode tokens' order in the slot mapping.
    pub fn batch(&self) -> &[u32] {
        &self.batch
    }

    /// The delta of the last commit.
    pub fn last_delta(&self) -> &Delta {
        &self.delta
    }

    /// The row of a live sequence.
    pub fn row(&self, seq: SeqId) -> PagedResult<u32> {
        self.live_row(seq, "query")
    }

    /// The token count of a live sequence.
    pub fn len(&self, seq: SeqId) -> PagedResult<u32> {
        Ok(self.len_of(self.live_row(seq, "query")? as usize))
    }

    /// The pages of a live sequence, in order.
    pub fn pages(&self, seq: SeqId) -> PagedResult<&[u32]> {
        Ok(self.pages.get(self.live_row(seq, "query")? as usize))
    }

    /// How many sequences hold page `page`.
    pub fn page_refs(&self, page: u32) -> u32 {
        if let Some(&extra) = self.extra_refs.get(&page) {
            return 1 + extra;
        }
        let unused = page >= self.free_pages.limit()
            || self.free_pages.contains(page)
            || self.pending_pages.contains(&page);
        u32::from(!unused)
    }

    /// The live sequence in `row`, if any.
    pub fn seq_at(&self, row: u32) -> Option<SeqId> {
        let r = row as usize;
        (r < self.live.len() && self.live[r]).then(|| SeqId::new(row, self.generation[r]))
    }

    fn live_row(&self, seq: SeqId, op: &'static str) -> PagedResult<u32> {
        let row = seq.row();
        let g = seq.generation();
        let r = row as usize;
        if r >= self.generation.len() || g == 0 || g > self.generation[r] {
            return Err(PagedError::UnknownSequence(seq));
        }
        if g < self.generation[r] || !self.live[r] {
            return Err(match op {
                "free" => PagedError::DoubleFree(seq),
                "fork" => PagedError::ForkOfFreed(seq),
                _ => PagedError::FreedSequence { seq, op },
            });
        }
        Ok(row)
    }

    // ---- reading and writing the memory, for tests and tools -------------------------------

    /// Waits on the host until every update queued so far has run (for tests and tools).
    pub fn synchronize(&self) -> PagedResult<()> {
        if let Applier::Device(_) = self.applier {
            let d = self.alloc.driver();
            use moonbright::driver::prelude::*;
            let e = d.create_event().map_err(moonbright::Error::from)?;
            let r = d.record_event(e, self.stream).and_then(|_| d.synchronize_event(e));
            let _ = d.destroy_event(e);
            r.map_err(moonbright::Error::from)?;
        }
        Ok(())
    }

    /// Reads the tables back from the pool's memory (after [`synchronize`](Self::synchronize)),
    /// with the slot mapping of the last step.
    pub fn read_tables(&self) -> PagedResult<HostTables> {
        self.synchronize()?;
        let c = &self.cfg;
        let mut t = HostTables::new(c.max_seqs, c.max_pages_per_seq, c.tokens_per_page);
        let read_i32 = |ptr: DevicePtr, out: &mut [i32]| -> PagedResult<()> {
            let mut bytes = vec![0u8; out.len() * 4];
            self.alloc.read(ptr, &mut bytes)?;
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = i32::from_le_bytes(b.try_into().expect("4 bytes"));
            }
            Ok(())
        };
        read_i32(self.ptrs.block_table, &mut t.block_table)?;
        read_i32(self.ptrs.seq_lens, &mut t.seq_lens)?;
        read_i32(self.ptrs.batch_rows, &mut t.batch_rows)?;
        let n = self.delta.step_tokens() as usize;
        let mut bytes = vec![0u8; n * 8];
        self.alloc.read(self.ptrs.slot_mapping, &mut bytes)?;
        t.slot_mapping =
            bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8"))).collect();
        Ok(t)
    }

    /// The bytes of page `page` (synchronous; for tests).
    pub fn read_page(&self, page: u32) -> PagedResult<Vec<u8>> {
        self.synchronize()?;
        let pb = self.cfg.page_bytes();
        let mut out = vec![0u8; pb];
        self.alloc.read(self.ptrs.pages + page as u64 * pb as u64, &mut out)?;
        Ok(out)
    }

    /// Writes the bytes of page `page` (synchronous, after the stream's work; for tests).
    pub fn write_page(&self, page: u32, bytes: &[u8]) -> PagedResult<()> {
        self.synchronize()?;
        let pb = self.cfg.page_bytes();
        assert!(bytes.len() <= pb, "more bytes than a page");
        self.alloc.write(self.ptrs.pages + page as u64 * pb as u64, bytes)?;
        Ok(())
    }
}

impl Drop for PagedPool<'_> {
    fn drop(&mut self) {
        // Kernels may still read the tables: free them in the stream's order.
        if let Applier::Device(t) = &mut self.applier {
            t.release();
        }
        let _ = self.store.release(self.stream);
        let p = self.ptrs;
        for ptr in [p.block_table, p.seq_lens, p.batch_rows, p.slot_mapping, self.sync] {
            let _ = self.alloc.free_async(ptr, self.stream);
        }
    }
}
