//! [`PagedPool`]: its state (the books of `pool/books.rs` and the tables of `pool/commit.rs`),
//! its creation (the fixed tables, the page store, the applier), its queries, and reading the
//! tables back. The requests, the decode step, the commit, the books and the invariants are in
//! `pool/`, one file each.

mod books;
mod check;
mod commit;
mod decode;
mod requests;

use std::fmt;

use moonbright::driver::Kernels as _;
use moonbright::{Allocator, DevicePtr, StreamHandle};

use crate::config::{PagedConfig, TablePointers};
use crate::delta::Delta;
use crate::device::DeviceTables;
use crate::error::{PagedError, PagedResult};
use crate::reference::HostTables;
use crate::seq::SeqId;
use crate::store::{GrowableStore, PageStore as _};
use books::{PageBooks, PhaseBuckets, RowBooks, StepMarks};
use commit::{Applier, Tables};

/// Bytes of the step kernel's counters (three u32, padded).
const SYNC_BYTES: usize = 16;

/// Most phase buckets (see `PhaseBuckets::phase_rows`): with larger pages, a decode step's bucket
/// also holds rows that do not start a page, one in `tokens_per_page / MAX_PHASE_BUCKETS`.
const MAX_PHASE_BUCKETS: u32 = 64;

/// A paged KV-cache pool on one stream. Not `Sync`: one thread drives it (as one scheduler
/// does); every device update is ordered on the stream given at creation.
pub struct PagedPool<'a> {
    alloc: &'a Allocator,
    cfg: PagedConfig,
    stream: StreamHandle,
    /// Why the pool refuses every request, after a failed apply.
    poisoned: Option<String>,
    /// Per row: the sequences, their pages and the batch.
    rows: RowBooks,
    /// The decode count and the rows by phase.
    phases: PhaseBuckets,
    /// The page store and its free, shared and pending pages.
    page_books: PageBooks<'a>,
    /// This step's changes, which the commit turns into the delta.
    marks: StepMarks,
    /// The tables' memory, the last delta, and who applies it.
    tables: Tables,
}

impl fmt::Debug for PagedPool<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagedPool")
            .field("config", &self.cfg)
            .field("live_sequences", &self.rows.live_rows)
            .field("pages_in_use", &self.pages_in_use())
            .field("committed_pages", &self.page_books.free_pages.limit())
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
        Ok(PagedPool {
            alloc,
            stream,
            poisoned: None,
            rows: RowBooks::new(cfg.max_seqs, cfg.max_pages_per_seq as usize),
            phases: PhaseBuckets::new(seqs, cfg.tokens_per_page.min(MAX_PHASE_BUCKETS) as usize),
            page_books: PageBooks::new(Box::new(store)),
            marks: StepMarks::new(seqs),
            tables: Tables { applier, ptrs, sync, delta: Delta::default() },
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
        matches!(self.tables.applier, Applier::Device(_))
    }

    /// Device addresses of the tables and pages (fixed for the pool's life).
    pub fn pointers(&self) -> TablePointers {
        self.tables.ptrs
    }

    /// Sequences alive now.
    pub fn live_sequences(&self) -> u32 {
        self.rows.live_rows
    }

    /// Pages held by some sequence (or freed this step, until its commit).
    pub fn pages_in_use(&self) -> u32 {
        self.page_books.free_pages.limit() - self.page_books.free_pages.count()
    }

    /// Pages whose memory is committed now (page ids below this exist).
    pub fn committed_pages(&self) -> u32 {
        self.page_books.free_pages.limit()
    }

    /// Bytes of the page store committed now.
    pub fn committed_bytes(&self) -> usize {
        self.page_books.store.committed()
    }

    /// The rows of the batch in order: the decode tokens' order in the slot mapping.
    pub fn batch(&self) -> &[u32] {
        &self.rows.batch
    }

    /// The delta of the last commit.
    pub fn last_delta(&self) -> &Delta {
        &self.tables.delta
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
        Ok(self.rows.pages.get(self.live_row(seq, "query")? as usize))
    }

    /// How many sequences hold page `page`.
    pub fn page_refs(&self, page: u32) -> u32 {
        if let Some(&extra) = self.page_books.extra_refs.get(&page) {
            return 1 + extra;
        }
        let unused = page >= self.page_books.free_pages.limit()
            || self.page_books.free_pages.contains(page)
            || self.page_books.pending_pages.contains(&page);
        u32::from(!unused)
    }

    /// The live sequence in `row`, if any.
    pub fn seq_at(&self, row: u32) -> Option<SeqId> {
        let r = row as usize;
        (r < self.rows.live.len() && self.rows.live[r])
            .then(|| SeqId::new(row, self.rows.generation[r]))
    }

    fn live_row(&self, seq: SeqId, op: &'static str) -> PagedResult<u32> {
        let row = seq.row();
        let g = seq.generation();
        let r = row as usize;
        if r >= self.rows.generation.len() || g == 0 || g > self.rows.generation[r] {
            return Err(PagedError::UnknownSequence(seq));
        }
        if g < self.rows.generation[r] || !self.rows.live[r] {
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
        if let Applier::Device(_) = self.tables.applier {
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
        read_i32(self.tables.ptrs.block_table, &mut t.block_table)?;
        read_i32(self.tables.ptrs.seq_lens, &mut t.seq_lens)?;
        read_i32(self.tables.ptrs.batch_rows, &mut t.batch_rows)?;
        let n = self.tables.delta.step_tokens() as usize;
        let mut bytes = vec![0u8; n * 8];
        self.alloc.read(self.tables.ptrs.slot_mapping, &mut bytes)?;
        t.slot_mapping =
            bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8"))).collect();
        Ok(t)
    }

    /// The bytes of page `page` (synchronous; for tests).
    pub fn read_page(&self, page: u32) -> PagedResult<Vec<u8>> {
        self.synchronize()?;
        let pb = self.cfg.page_bytes();
        let mut out = vec![0u8; pb];
        self.alloc.read(self.tables.ptrs.pages + page as u64 * pb as u64, &mut out)?;
        Ok(out)
    }

    /// Writes the bytes of page `page` (synchronous, after the stream's work; for tests).
    pub fn write_page(&self, page: u32, bytes: &[u8]) -> PagedResult<()> {
        self.synchronize()?;
        let pb = self.cfg.page_bytes();
        assert!(bytes.len() <= pb, "more bytes than a page");
        self.alloc.write(self.tables.ptrs.pages + page as u64 * pb as u64, bytes)?;
        Ok(())
    }
}

impl Drop for PagedPool<'_> {
    fn drop(&mut self) {
        // Kernels may still read the tables: free them in the stream's order.
        if let Applier::Device(t) = &mut self.tables.applier {
            t.release();
        }
        let _ = self.page_books.store.release(self.stream);
        let p = self.tables.ptrs;
        for ptr in [p.block_table, p.seq_lens, p.batch_rows, p.slot_mapping, self.tables.sync] {
            let _ = self.alloc.free_async(ptr, self.stream);
        }
    }
}
