//! The paged KV-cache pool: pages of `tokens_per_page x bytes_per_token` in one contiguous range
//! of MoonBright memory, and per sequence the list of pages it owns (reference-counted, so that
//! forks share their prefix and copy a shared page only when it is written).
//!
//! This file owns the host side: the metadata, the validation of every request (a refused
//! request changes nothing) and the [`Delta`] each step ships to the device. The device tables
//! (block table, lengths, batch list, slot mapping) sit in fixed buffers, so their addresses
//! never change; `device.rs` updates them with kernels on the CUDA backend, and on the host
//! backend `reference.rs` does the same on host memory. See "Paged KV pool" in docs/design.md.

mod delta;
mod device;
mod ids;
pub mod reference;
mod rows;
mod store;

use std::collections::HashMap;
use std::fmt;

pub use delta::{
    Delta, PageCopy, TableOp, TokenRun, DEAD_ROW, OP_BATCH, OP_BLOCK, OP_CLEAR, OP_LEN,
};
pub use device::{kernel_source, nvrtc_options, NvrtcOptions};
use ids::FreeIds;
use reference::HostTables;
use rows::{PageLists, RowHot};
use store::{GrowableStore, PageStore};

use moonbright::driver::Kernels as _;
use moonbright::{Allocator, DevicePtr, StreamHandle};

/// Everything a paged-pool call can refuse. A refused request changes nothing.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PagedError {
    /// A bad configuration value.
    #[error("invalid paged pool configuration: {0}")]
    InvalidConfig(String),
    /// An id this pool never handed out.
    #[error("unknown sequence {0}: this pool never created it")]
    UnknownSequence(SeqId),
    /// An operation on a sequence that was freed.
    #[error("sequence {seq} was freed: cannot {op} it")]
    FreedSequence {
        /// The sequence.
        seq: SeqId,
        /// What was asked ("extend", "truncate", ...).
        op: &'static str,
    },
    /// A second free of a sequence.
    #[error("double free of sequence {0}: it was freed already")]
    DoubleFree(SeqId),
    /// A fork of a freed sequence.
    #[error("cannot fork sequence {0}: it was freed")]
    ForkOfFreed(SeqId),
    /// A fork of a sequence whose tokens added this step are not written yet (they are written
    /// after the commit, and a copy-on-write copy made at the commit would miss them).
    #[error("cannot fork sequence {0}: it has tokens added this step; commit the step first")]
    ForkOfUncommitted(SeqId),
    /// A sequence would outgrow its row of the block table.
    #[error(
        "sequence {seq} cannot grow to {requested} tokens: a sequence holds at most {max} \
         (max_pages_per_seq x tokens_per_page)"
    )]
    SequenceTooLong {
        /// The sequence (the new one, for `add`).
        seq: SeqId,
        /// The length it would have.
        requested: u64,
        /// The most it may have.
        max: u64,
    },
    /// Not enough free pages in the pool.
    #[error("out of KV pages: the request needs {needed} new pages, {available} of {max_pages} are free")]
    OutOfPages {
        /// Pages the request needs.
        needed: u64,
        /// Pages free (committed or not).
        available: u64,
        /// The pool's capacity in pages.
        max_pages: u32,
    },
    /// Every row of the block table is taken.
    #[error("too many sequences: all {max_seqs} rows of the block table are in use (rows freed this step come back at its commit)")]
    TooManySequences {
        /// Rows of the block table.
        max_seqs: u32,
    },
    /// The step's tokens would not fit the slot mapping.
    #[error("this step would write {requested} tokens; the slot mapping holds {capacity} (max_step_tokens)")]
    StepTooLarge {
        /// Tokens the step would have.
        requested: u64,
        /// The slot mapping's length.
        capacity: u32,
    },
    /// A truncation that would lengthen.
    #[error("cannot truncate sequence {seq} to {new_len} tokens: it has {len}")]
    BadTruncate {
        /// The sequence.
        seq: SeqId,
        /// Its length.
        len: u32,
        /// The length asked for.
        new_len: u32,
    },
    /// A commit on a stream being captured into a CUDA graph. The table kernel reads the step's
    /// delta from staging memory that later steps reuse, so a replay would apply stale data.
    #[error(
        "the pool's stream {stream:#x} is being captured into a CUDA graph: a commit is refused \
         there (a replay would apply a stale delta); commit outside the capture, where the graph \
         may read the tables"
    )]
    StreamCapture {
        /// The stream.
        stream: u64,
    },
    /// A kernel could not be compiled, loaded or launched (the message says which).
    #[error("device tables: {0}")]
    Device(String),
    /// An earlier commit failed on the device; the device tables are not known to match.
    #[error("the pool is unusable: an earlier commit failed on the device ({0})")]
    Poisoned(String),
    /// The allocator refused memory for the pool.
    #[error(transparent)]
    Alloc(#[from] moonbright::Error),
}

/// Result of a paged-pool call.
pub type PagedResult<T> = std::result::Result<T, PagedError>;

/// A sequence: its block-table row in the low 32 bits, the row's generation in the high ones,
/// so an id outlives its sequence without ever naming the next one in the same row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl SeqId {
    fn new(row: u32, generation: u32) -> Self {
        SeqId((generation as u64) << 32 | row as u64)
    }
    /// Its block-table row.
    pub fn row(self) -> u32 {
        self.0 as u32
    }
    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x} (row {}, generation {})", self.0, self.row(), self.generation())
    }
}

/// The shape of a pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PagedConfig {
    /// Tokens per page (vLLM's block size), e.g. 16.
    pub tokens_per_page: u32,
    /// KV bytes per token (all layers and heads this pool serves, K and V).
    pub bytes_per_token: usize,
    /// Capacity of the pool in pages.
    pub max_pages: u32,
    /// Rows of the block table: sequences alive at once.
    pub max_seqs: u32,
    /// Columns of the block table: pages per sequence.
    pub max_pages_per_seq: u32,
    /// Length of the slot mapping: tokens one step may write.
    pub max_step_tokens: u32,
}

impl PagedConfig {
    /// Bytes per page.
    pub fn page_bytes(&self) -> usize {
        self.tokens_per_page as usize * self.bytes_per_token
    }

    /// Tokens a sequence may hold.
    pub fn max_seq_len(&self) -> u64 {
        self.max_pages_per_seq as u64 * self.tokens_per_page as u64
    }

    /// Checks every field; the error names the first bad one.
    pub fn check(&self) -> PagedResult<()> {
        let bad = |s: String| Err(PagedError::InvalidConfig(s));
        for (name, v) in [
            ("tokens_per_page", self.tokens_per_page as u64),
            ("bytes_per_token", self.bytes_per_token as u64),
            ("max_pages", self.max_pages as u64),
            ("max_seqs", self.max_seqs as u64),
            ("max_pages_per_seq", self.max_pages_per_seq as u64),
            ("max_step_tokens", self.max_step_tokens as u64),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if self.max_pages > i32::MAX as u32 {
            return bad(format!(
                "max_pages {} exceeds 2^31 - 1 (page ids are int32)",
                self.max_pages
            ));
        }
        let cells = self.max_seqs as u64 * self.max_pages_per_seq as u64;
        if cells > i32::MAX as u64 {
            return bad(format!("the block table has {cells} entries; at most 2^31 - 1"));
        }
        if self.max_seq_len() > i32::MAX as u64 {
            return bad("max_pages_per_seq x tokens_per_page exceeds 2^31 - 1".into());
        }
        if self.page_bytes() as u64 * self.max_pages as u64 > 1 << 48 {
            return bad("the pool's capacity exceeds 2^48 bytes".into());
        }
        Ok(())
    }
}

/// Device addresses of the pool's fixed buffers (they never change for the pool's life).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TablePointers {
    /// int32 `[max_seqs, max_pages_per_seq]`.
    pub block_table: DevicePtr,
    /// int32 `[max_seqs]`.
    pub seq_lens: DevicePtr,
    /// int32 `[max_seqs]`.
    pub batch_rows: DevicePtr,
    /// int64 `[max_step_tokens]`.
    pub slot_mapping: DevicePtr,
    /// Page 0 of the KV pages (`max_pages x page_bytes` bytes).
    pub pages: DevicePtr,
}

/// Bytes of the step kernel's counters (three u32, padded).
const SYNC_BYTES: usize = 16;

/// Most phase buckets (see `PagedPool::phase_rows`): with larger pages, a decode step's bucket
/// also holds rows that do not start a page, one in `tokens_per_page / MAX_PHASE_BUCKETS`.
const MAX_PHASE_BUCKETS: u32 = 64;

/// Who applies the deltas: kernels on the GPU, or the reference on host memory.
enum Applier {
    Device(device::DeviceTables),
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
            match device::DeviceTables::new(driver, stream, sync) {
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

    // ---- requests -----------------------------------------------------------------------------

    /// A new sequence of `prompt_len` tokens (written this step: they get slots).
    pub fn add(&mut self, prompt_len: u32) -> PagedResult<SeqId> {
        self.check_usable()?;
        let Some(row) = self.peek_free_row() else {
            return Err(PagedError::TooManySequences { max_seqs: self.cfg.max_seqs });
        };
        let next = SeqId::new(row, self.generation[row as usize] + 1);
        if prompt_len as u64 > self.cfg.max_seq_len() {
            return Err(PagedError::SequenceTooLong {
                seq: next,
                requested: prompt_len as u64,
                max: self.cfg.max_seq_len(),
            });
        }
        self.check_step_tokens(prompt_len as u64)?;
        let np = prompt_len.div_ceil(self.cfg.tokens_per_page);
        self.ensure_free_pages(np as u64)?;
        // Nothing can fail from here on.
        let row = self.free_rows.pop_lowest().expect("peeked");
        let r = row as usize;
        self.generation[r] += 1;
        self.live[r] = true;
        self.live_rows += 1;
        self.place(row, prompt_len);
        self.tail_shared[r] = false;
        let mut fresh = std::mem::take(&mut self.fresh_pages);
        fresh.clear();
        self.take_pages(np, &mut fresh);
        self.pages.truncate(r, 0);
        self.pages.extend(r, &fresh);
        self.fresh_pages = fresh;
        self.batch_pos[r] = self.batch.len() as u32;
        self.batch.push(row);
        self.mark_batch(self.batch.len() as u32 - 1);
        self.mark_blocks(row, 0, np);
        self.mark_len(row);
        self.push_run(row, 0, prompt_len);
        Ok(SeqId::new(row, self.generation[r]))
    }

    /// Adds `n` tokens to `seq` (written this step: they get slots). Copies its last page first
    /// if that page is shared.
    pub fn extend(&mut self, seq: SeqId, n: u32) -> PagedResult<()> {
        self.check_usable()?;
        let row = self.live_row(seq, "extend")?;
        let r = row as usize;
        let len = self.len_of(r);
        let new_len = len as u64 + n as u64;
        if new_len > self.cfg.max_seq_len() {
            return Err(PagedError::SequenceTooLong {
                seq,
                requested: new_len,
                max: self.cfg.max_seq_len(),
            });
        }
        if n == 0 {
            return Ok(());
        }
        self.check_step_tokens(n as u64)?;
        let t = self.cfg.tokens_per_page;
        let cur_np = len.div_ceil(t);
        let new_np = (new_len as u32).div_ceil(t);
        let cow = self.tail_needs_copy(r);
        self.ensure_free_pages((new_np - cur_np) as u64 + cow as u64)?;
        if cow {
            self.copy_tail(row);
        }
        self.tail_shared[r] = false;
        for _ in cur_np..new_np {
            let p = self.take_page();
            self.pages.push(r, p);
        }
        self.mark_blocks(row, cur_np, new_np);
        self.set_len(row, new_len as u32);
        self.mark_len(row);
        self.push_run(row, len, n);
        Ok(())
    }

    /// A new sequence sharing every page of `parent` (copy-on-write), with its length.
    pub fn fork(&mut self, parent: SeqId) -> PagedResult<SeqId> {
        self.check_usable()?;
        let prow = self.live_row(parent, "fork")? as usize;
        if self.token_stamp[prow] == self.step {
            return Err(PagedError::ForkOfUncommitted(parent));
        }
        if self.peek_free_row().is_none() {
            return Err(PagedError::TooManySequences { max_seqs: self.cfg.max_seqs });
        }
        let row = self.free_rows.pop_lowest().expect("peeked");
        let r = row as usize;
        self.generation[r] += 1;
        self.live[r] = true;
        self.live_rows += 1;
        let len = self.len_of(prow);
        self.place(row, len);
        self.pages.copy_row(prow, r);
        for &p in self.pages.get(r) {
            *self.extra_refs.entry(p).or_insert(0) += 1;
        }
        let np = self.pages.len(r) as u32;
        let partial = len % self.cfg.tokens_per_page != 0;
        self.set_tail_shared(r, partial);
        if partial {
            self.set_tail_shared(prow, true);
        }
        self.batch_pos[r] = self.batch.len() as u32;
        self.batch.push(row);
        self.mark_batch(self.batch.len() as u32 - 1);
        self.mark_blocks(row, 0, np);
        self.mark_len(row);
        Ok(SeqId::new(row, self.generation[r]))
    }

    /// Shortens `seq` to `new_len` tokens, releasing the pages past it.
    pub fn truncate(&mut self, seq: SeqId, new_len: u32) -> PagedResult<()> {
        self.check_usable()?;
        let row = self.live_row(seq, "truncate")?;
        let r = row as usize;
        let len = self.len_of(r);
        if new_len > len {
            return Err(PagedError::BadTruncate { seq, len, new_len });
        }
        let keep = new_len.div_ceil(self.cfg.tokens_per_page);
        let old_np = self.pages.len(r) as u32;
        for c in keep..old_np {
            self.drop_ref(self.pages.get(r)[c as usize]);
        }
        self.pages.truncate(r, keep as usize);
        self.mark_blocks(row, keep, old_np);
        if self.token_stamp[r] == self.step {
            self.clip_runs(row, new_len);
        }
        self.set_len(row, new_len);
        let shared = new_len % self.cfg.tokens_per_page != 0
            && self.pages.last(r).is_some_and(|p| self.extra_refs.contains_key(&p));
        self.set_tail_shared(r, shared);
        self.mark_len(row);
        Ok(())
    }

    /// Frees `seq`: its pages lose a reference, its row leaves the batch. The row and the pages
    /// that became free are reused from the next step on.
    pub fn free(&mut self, seq: SeqId) -> PagedResult<()> {
        self.check_usable()?;
        let row = self.live_row(seq, "free")?;
        let r = row as usize;
        let np = self.pages.len(r) as u32;
        for c in 0..np {
            self.drop_ref(self.pages.get(r)[c as usize]);
        }
        self.pages.truncate(r, 0);
        self.mark_blocks(row, 0, np);
        self.unplace(row);
        self.live[r] = false;
        self.live_rows -= 1;
        self.tail_shared[r] = false;
        self.mark_len(row);
        let i = self.batch_pos[r];
        let last = self.batch.pop().expect("a live row is in the batch");
        if last != row {
            self.batch[i as usize] = last;
            self.batch_pos[last as usize] = i;
            self.mark_batch(i);
        }
        self.pending_rows.push(row);
        Ok(())
    }

    /// Extends every live sequence by one token, then commits the step: the decode tokens'
    /// slots follow the explicit ones in the slot mapping, in batch order. On any error
    /// nothing changes (and nothing is committed).
    pub fn decode_step(&mut self) -> PagedResult<&Delta> {
        self.check_usable()?;
        self.refuse_capture()?;
        self.decode_tokens()?;
        self.commit(true)
    }

    /// [`decode_step`](Self::decode_step) in three stages that a benchmark of the host side
    /// (`moonbright-bench`'s `paged_host`) times apart: the decode tokens, then
    /// [`bench_close_step`](Self::bench_close_step) (the delta), then
    /// [`bench_apply_delta`](Self::bench_apply_delta) (its shipping). Until the last, the
    /// tables lag the metadata. Not for other uses.
    #[doc(hidden)]
    pub fn bench_decode_tokens(&mut self) -> PagedResult<()> {
        self.check_usable()?;
        self.decode_tokens()
    }

    /// The second stage of [`bench_decode_tokens`](Self::bench_decode_tokens).
    #[doc(hidden)]
    pub fn bench_close_step(&mut self) -> &Delta {
        self.close_step(true);
        &self.delta
    }

    /// The third stage of [`bench_decode_tokens`](Self::bench_decode_tokens).
    #[doc(hidden)]
    pub fn bench_apply_delta(&mut self) -> PagedResult<()> {
        self.apply_delta()
    }

    /// The host side of [`decode_step`](Self::decode_step) before its commit: validates, then
    /// gives every live sequence its decode token. On an error nothing changed.
    fn decode_tokens(&mut self) -> PagedResult<()> {
        let t = self.cfg.tokens_per_page;
        let max = self.cfg.max_seq_len();
        // The rows starting a page are those of one bucket (with others when tokens_per_page
        // exceeds the buckets). A row at the longest length starts a page too (the longest
        // length is a whole number of pages, and no row is longer), so it is among them.
        let b = self.due_bucket();
        let mut starting = 0u64;
        let mut too_long = false;
        let mut probe = 0u32;
        for &row in &self.phase_rows[b] {
            let len = self.len_of(row as usize);
            if len % t == 0 {
                too_long |= len as u64 >= max;
                starting += 1;
                probe ^= self.pages.next_cell(row as usize);
            }
        }
        std::hint::black_box(probe);
        let mut need = starting;
        if too_long {
            // Name the first such row in batch order.
            let row = *self
                .batch
                .iter()
                .find(|&&r| self.len_of(r as usize) as u64 >= max)
                .expect("found above");
            let r = row as usize;
            return Err(PagedError::SequenceTooLong {
                seq: SeqId::new(row, self.generation[r]),
                requested: self.len_of(r) as u64 + 1,
                max,
            });
        }
        for &row in &self.shared_rows {
            let r = row as usize;
            if self.tail_shared[r] && self.tail_needs_copy(r) {
                need += 1;
            }
        }
        self.check_step_tokens(self.batch.len() as u64)?;
        self.ensure_free_pages(need)?;
        // Nothing can fail from here on.
        let due = std::mem::take(&mut self.phase_rows[b]);
        let mut fresh = std::mem::take(&mut self.fresh_pages);
        fresh.clear();
        self.take_pages(starting as u32, &mut fresh);
        let mut fresh_pages = fresh.iter();
        for &row in &due {
            let r = row as usize;
            let len = self.len_of(r);
            if len % t == 0 {
                let p = *fresh_pages.next().expect("one page per row starting one");
                self.pages.push(r, p);
                let c = len / t;
                self.mark_blocks(row, c, c + 1);
            }
        }
        self.phase_rows[b] = due;
        self.fresh_pages = fresh;
        let mut shared = std::mem::take(&mut self.shared_rows);
        shared.retain(|&row| {
            let r = row as usize;
            // A row starting a page writes into its new private page: it keeps the mark, to be
            // looked at again in the next step.
            if self.tail_shared[r] && self.len_of(r) % t == 0 {
                return true;
            }
            if self.tail_shared[r] && self.tail_needs_copy(r) {
                self.copy_tail(row);
            }
            self.tail_shared[r] = false;
            self.in_shared[r] = false;
            false
        });
        self.shared_rows = shared;
        // Every live row grows by one token.
        self.decodes = self.decodes.wrapping_add(1);
        self.decode_phase = if self.decode_phase + 1 == t { 0 } else { self.decode_phase + 1 };
        Ok(())
    }

    /// Commits the step without decode tokens: ships the delta and launches the kernels (or
    /// applies it on host memory with the host backend). Never waits for the device.
    pub fn commit_step(&mut self) -> PagedResult<&Delta> {
        self.check_usable()?;
        self.refuse_capture()?;
        self.commit(false)
    }

    /// Gives back the committed memory above the highest page in use. Returns the bytes
    /// released.
    pub fn shrink(&mut self) -> PagedResult<u64> {
        self.check_usable()?;
        let before = self.store.committed();
        let granule = self.granule_pages();
        let used_top = self.free_pages.trim_trailing(0);
        let target = used_top.div_ceil(granule) * granule;
        let target = target.min(self.cfg.max_pages);
        // Give the granule's rounding back to the free set.
        self.free_pages.grow_to(target);
        self.store.resize(target as usize * self.cfg.page_bytes(), self.stream)?;
        Ok(before.saturating_sub(self.store.committed()) as u64)
    }

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

    /// Checks the host metadata's invariants: reference counts, free sets, batch positions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut refs = vec![0u32; self.cfg.max_pages as usize];
        let t = self.cfg.tokens_per_page;
        for r in 0..self.live.len() {
            if !self.live[r] {
                if self.pages.len(r) != 0 {
                    return Err(format!("free row {r} holds pages"));
                }
                continue;
            }
            let len = self.len_of(r);
            if self.pages.len(r) as u32 != len.div_ceil(t) {
                return Err(format!("row {r}: {} pages for {len} tokens", self.pages.len(r)));
            }
            let b = self.phase_bucket[r] as usize;
            if self.phase_bucket[r] != self.bucket_for(len)
                || self.phase_rows[b].get(self.phase_pos[r] as usize) != Some(&(r as u32))
            {
                return Err(format!("row {r} is not in its phase bucket"));
            }
            if self.tail_shared[r] && !self.in_shared[r] {
                return Err(format!("row {r}: tail_shared but not listed"));
            }
            for &p in self.pages.get(r) {
                refs[p as usize] += 1;
            }
            let i = self.batch_pos[r] as usize;
            if self.batch.get(i) != Some(&(r as u32)) {
                return Err(format!("row {r} is not at its batch position {i}"));
            }
        }
        for &p in &self.pending_pages {
            if refs[p as usize] != 0 || self.extra_refs.contains_key(&p) {
                return Err(format!("pending page {p} still referenced"));
            }
        }
        for (&p, &extra) in &self.extra_refs {
            if extra == 0 || refs.get(p as usize) != Some(&(extra + 1)) {
                return Err(format!("page {p}: {} holders beyond the first counted", extra));
            }
        }
        for (p, &a) in refs.iter().enumerate() {
            if a > 1 && !self.extra_refs.contains_key(&(p as u32)) {
                return Err(format!("page {p}: {a} holders, not counted as shared"));
            }
            let p32 = p as u32;
            let free = self.free_pages.contains(p32);
            if a > 0 && free {
                return Err(format!("page {p} is held and free"));
            }
            if a == 0
                && p32 < self.free_pages.limit()
                && !free
                && !self.pending_pages.contains(&p32)
            {
                return Err(format!("page {p} leaked: neither held nor free"));
            }
        }
        let placed: usize = self.phase_rows.iter().map(Vec::len).sum();
        if placed as u32 != self.live_rows {
            return Err(format!("{placed} rows in the phase buckets, {} live", self.live_rows));
        }
        if self.batch.len() as u32 != self.live_rows {
            return Err(format!("{} rows in the batch, {} live", self.batch.len(), self.live_rows));
        }
        Ok(())
    }

    // ---- internals ----------------------------------------------------------------------------

    fn check_usable(&self) -> PagedResult<()> {
        match &self.poisoned {
            Some(why) => Err(PagedError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    /// Refuses a commit on a capturing stream, before anything changes.
    fn refuse_capture(&self) -> PagedResult<()> {
        use moonbright::driver::prelude::*;
        if self.alloc.driver().is_capturing(self.stream).map_err(moonbright::Error::from)? {
            return Err(PagedError::StreamCapture { stream: self.stream.0 });
        }
        Ok(())
    }

    fn peek_free_row(&self) -> Option<u32> {
        self.free_rows.peek_lowest()
    }

    fn check_step_tokens(&self, more: u64) -> PagedResult<()> {
        let requested = self.explicit_tokens as u64 + more;
        if requested > self.cfg.max_step_tokens as u64 {
            return Err(PagedError::StepTooLarge { requested, capacity: self.cfg.max_step_tokens });
        }
        Ok(())
    }

    /// Pages per allocator page: the store grows and shrinks by whole granules.
    fn granule_pages(&self) -> u32 {
        (self.alloc.page_size().div_ceil(self.cfg.page_bytes()) as u32).max(1)
    }

    /// Makes sure `n` pages can be taken without failing, growing the store if needed. The
    /// growth is not undone if the request is refused later: it changes no sequence.
    fn ensure_free_pages(&mut self, n: u64) -> PagedResult<()> {
        let free = self.free_pages.count() as u64;
        if n <= free {
            return Ok(());
        }
        let available = free + (self.cfg.max_pages - self.free_pages.limit()) as u64;
        if n > available {
            return Err(PagedError::OutOfPages {
                needed: n,
                available,
                max_pages: self.cfg.max_pages,
            });
        }
        let want = self.free_pages.limit() as u64 + (n - free);
        // Grow by at least a quarter of what is committed, by whole granules.
        let g = self.granule_pages() as u64;
        let want = want.max(self.free_pages.limit() as u64 * 5 / 4);
        let target = (want.div_ceil(g) * g).min(self.cfg.max_pages as u64) as u32;
        self.store.resize(target as usize * self.cfg.page_bytes(), self.stream)?;
        self.free_pages.grow_to(target);
        Ok(())
    }

    /// The token count of row `r` (live).
    #[inline]
    fn len_of(&self, r: usize) -> u32 {
        self.hot[r].len_rel.wrapping_add(self.decodes)
    }

    /// The phase bucket of a live row of length `len`.
    fn bucket_for(&self, len: u32) -> u32 {
        let t = self.cfg.tokens_per_page;
        let key = (len % t + t - self.decode_phase) % t;
        key % self.phase_rows.len() as u32
    }

    /// The bucket holding the rows whose length is a whole number of pages.
    fn due_bucket(&self) -> usize {
        self.bucket_for(0) as usize
    }

    /// Gives a row that just became live its length, and puts it in its bucket.
    fn place(&mut self, row: u32, len: u32) {
        let r = row as usize;
        self.hot[r].len_rel = len.wrapping_sub(self.decodes);
        let b = self.bucket_for(len);
        self.phase_bucket[r] = b;
        self.phase_pos[r] = self.phase_rows[b as usize].len() as u32;
        self.phase_rows[b as usize].push(row);
    }

    /// Takes a live row out of its bucket.
    fn unplace(&mut self, row: u32) {
        let r = row as usize;
        let bucket = &mut self.phase_rows[self.phase_bucket[r] as usize];
        let i = self.phase_pos[r] as usize;
        let last = bucket.pop().expect("a live row is in its bucket");
        if last != row {
            bucket[i] = last;
            self.phase_pos[last as usize] = i as u32;
        }
    }

    /// Changes a live row's length (not by a decode step).
    fn set_len(&mut self, row: u32, len: u32) {
        let r = row as usize;
        if self.bucket_for(len) == self.phase_bucket[r] {
            self.hot[r].len_rel = len.wrapping_sub(self.decodes);
        } else {
            self.unplace(row);
            self.place(row, len);
        }
    }

    fn set_tail_shared(&mut self, r: usize, shared: bool) {
        self.tail_shared[r] = shared;
        if shared && !self.in_shared[r] {
            self.in_shared[r] = true;
            self.shared_rows.push(r as u32);
        }
    }

    /// Takes the `n` lowest free pages (ensure_free_pages ran first) into `out`.
    fn take_pages(&mut self, n: u32, out: &mut Vec<u32>) {
        self.free_pages.pop_lowest_n(n, out);
    }

    fn take_page(&mut self) -> u32 {
        self.free_pages.pop_lowest().expect("ensure_free_pages ran first")
    }

    /// One holder of page `p` lets it go; the last one makes it pending (free at the commit).
    fn drop_ref(&mut self, p: u32) {
        if !self.extra_refs.is_empty() {
            if let Some(extra) = self.extra_refs.get_mut(&p) {
                *extra -= 1;
                if *extra == 0 {
                    self.extra_refs.remove(&p);
                }
                return;
            }
        }
        self.pending_pages.push(p);
    }

    /// Whether writing into the row's last page needs a copy first: the page is partly filled
    /// and held by another sequence too.
    fn tail_needs_copy(&self, r: usize) -> bool {
        self.len_of(r) % self.cfg.tokens_per_page != 0
            && self.pages.last(r).is_some_and(|p| self.extra_refs.contains_key(&p))
    }

    /// Gives the row a private copy of its shared last page.
    fn copy_tail(&mut self, row: u32) {
        let r = row as usize;
        let c = self.pages.len(r) - 1;
        let old = self.pages.get(r)[c];
        let new = self.take_page();
        // A page copied earlier this step has the same bytes as its source until the step's
        // tokens are written, which happens after the commit: read the original, so that the
        // kernel's copies are independent of one another.
        let src = self.copied_from.get(&old).copied().unwrap_or(old);
        self.copies.push(PageCopy { src, dst: new });
        self.copied_from.insert(new, src);
        self.drop_ref(old); // shared, so another row still holds it
        self.pages.set(r, c, new);
        self.mark_blocks(row, c as u32, c as u32 + 1);
    }

    fn mark_blocks(&mut self, row: u32, lo: u32, hi: u32) {
        if lo >= hi {
            return;
        }
        let r = row as usize;
        let h = &mut self.hot[r];
        if h.blk_stamp != self.step {
            h.blk_stamp = self.step;
            h.blk_lo = lo;
            h.blk_hi = hi;
            self.blk_rows.push(row);
        } else {
            h.blk_lo = h.blk_lo.min(lo);
            h.blk_hi = h.blk_hi.max(hi);
        }
    }

    fn mark_len(&mut self, row: u32) {
        let r = row as usize;
        if self.len_stamp[r] != self.step {
            self.len_stamp[r] = self.step;
            self.len_rows.push(row);
        }
    }

    fn mark_batch(&mut self, i: u32) {
        let k = i as usize;
        if self.bat_stamp[k] != self.step {
            self.bat_stamp[k] = self.step;
            self.bat_idx.push(i);
        }
    }

    /// Tokens of `row` added this step at or past `new_len` get no slot (-1): a later extend in
    /// the same step may add those positions again, and two slots for one position would race.
    fn clip_runs(&mut self, row: u32, new_len: u32) {
        let mut i = 0;
        while i < self.runs.len() {
            let run = self.runs[i];
            if run.row == row && run.start + run.len > new_len {
                if run.start >= new_len {
                    self.runs[i].row = DEAD_ROW;
                } else {
                    let keep = new_len - run.start;
                    self.runs[i].len = keep;
                    let rest = TokenRun {
                        row: DEAD_ROW,
                        start: 0,
                        len: run.len - keep,
                        out: run.out + keep,
                    };
                    self.runs.insert(i + 1, rest);
                    i += 1;
                }
            }
            i += 1;
        }
    }

    fn push_run(&mut self, row: u32, start: u32, len: u32) {
        if len == 0 {
            return;
        }
        self.token_stamp[row as usize] = self.step;
        self.runs.push(TokenRun { row, start, len, out: self.explicit_tokens });
        self.explicit_tokens += len;
    }

    /// Turns this step's marks into the delta, returns freed rows and pages to their free sets,
    /// and applies the delta.
    fn commit(&mut self, decode: bool) -> PagedResult<&Delta> {
        self.close_step(decode);
        self.apply_delta()?;
        Ok(&self.delta)
    }

    /// Turns this step's marks into the delta and returns freed rows and pages to their free
    /// sets: the host side of a commit. Cannot fail.
    fn close_step(&mut self, decode: bool) {
        let m = self.cfg.max_pages_per_seq;
        let d = &mut self.delta;
        d.clear();
        for &row in &self.blk_rows {
            let r = row as usize;
            let pages = self.pages.get(r);
            let (lo, hi) = (self.hot[r].blk_lo, self.hot[r].blk_hi);
            // Columns the row holds get their page; those past its end are cleared in one op.
            let held = (pages.len() as u32).clamp(lo, hi);
            for c in lo..held {
                let value = pages[c as usize] as i32;
                d.ops.push(TableOp { kind: OP_BLOCK, index: row * m + c, value });
            }
            if held < hi {
                let index = row * m + held;
                d.ops.push(TableOp { kind: OP_CLEAR, index, value: (hi - held) as i32 });
            }
        }
        for &row in &self.len_rows {
            let r = row as usize;
            // The decode kernel adds the decode token itself. A freed row's length is 0.
            let len = self.hot[r].len_rel.wrapping_add(self.decodes);
            let value = if self.live[r] { len - decode as u32 } else { 0 };
            d.ops.push(TableOp { kind: OP_LEN, index: row, value: value as i32 });
        }
        for &i in &self.bat_idx {
            if let Some(&row) = self.batch.get(i as usize) {
                d.ops.push(TableOp { kind: OP_BATCH, index: i, value: row as i32 });
            }
        }
        std::mem::swap(&mut d.runs, &mut self.runs);
        std::mem::swap(&mut d.copies, &mut self.copies);
        d.explicit_tokens = self.explicit_tokens;
        d.decode_rows = if decode { self.batch.len() as u32 } else { 0 };
        // The step is closed: its freed rows and pages become reusable.
        for row in self.pending_rows.drain(..) {
            self.free_rows.insert(row);
        }
        for p in self.pending_pages.drain(..) {
            self.free_pages.insert(p);
        }
        self.step = self.step.wrapping_add(1).max(1);
        if self.step == 1 {
            // The stamps wrapped around: forget them all.
            self.hot.iter_mut().for_each(|h| h.blk_stamp = 0);
            self.len_stamp.iter_mut().for_each(|s| *s = 0);
            self.bat_stamp.iter_mut().for_each(|s| *s = 0);
            self.token_stamp.iter_mut().for_each(|s| *s = 0);
        }
        self.blk_rows.clear();
        self.len_rows.clear();
        self.bat_idx.clear();
        self.runs.clear();
        self.copies.clear();
        self.copied_from.clear();
        self.explicit_tokens = 0;
    }

    /// Ships the delta of [`close_step`](Self::close_step) to the tables (kernels, or the host
    /// reference). A failure poisons the pool.
    fn apply_delta(&mut self) -> PagedResult<()> {
        let applied = match &mut self.applier {
            Applier::Device(t) => {
                t.launch(&self.delta, &self.ptrs, &self.cfg).map_err(PagedError::Device)
            }
            Applier::Host(h) => apply_on_host(self.alloc, h, &self.delta, &self.ptrs, &self.cfg),
        };
        if let Err(e) = applied {
            self.poisoned = Some(e.to_string());
            return Err(e);
        }
        Ok(())
    }
}

/// The host backend's "kernels": the reference applied to host copies, written to the pool's
/// memory, and page copies through the allocator.
fn apply_on_host(
    alloc: &Allocator,
    h: &mut HostTables,
    d: &Delta,
    ptrs: &TablePointers,
    cfg: &PagedConfig,
) -> PagedResult<()> {
    let pb = cfg.page_bytes();
    let mut buf = vec![0u8; pb];
    for c in &d.copies {
        alloc.read(ptrs.pages + c.src as u64 * pb as u64, &mut buf)?;
        alloc.write(ptrs.pages + c.dst as u64 * pb as u64, &buf)?;
    }
    h.apply(d);
    let bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    alloc.write(ptrs.block_table, &bytes(&h.block_table))?;
    alloc.write(ptrs.seq_lens, &bytes(&h.seq_lens))?;
    alloc.write(ptrs.batch_rows, &bytes(&h.batch_rows))?;
    let slots: Vec<u8> = h.slot_mapping.iter().flat_map(|x| x.to_le_bytes()).collect();
    alloc.write(ptrs.slot_mapping, &slots)?;
    Ok(())
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
