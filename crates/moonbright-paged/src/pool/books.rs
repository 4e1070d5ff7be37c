//! The pool's books: the rows (`RowBooks`: free rows, each row's pages and length), the phase
//! buckets (`PhaseBuckets`), the pages (`PageBooks`: free pages, the page store that grows and
//! shrinks by whole granules, shared pages and copy-on-write), and the marks of what this step
//! changed (`StepMarks`), which the commit turns into the delta.

use std::collections::HashMap;

use super::PagedPool;
use crate::delta::{PageCopy, TokenRun, DEAD_ROW};
use crate::error::{PagedError, PagedResult};
use crate::ids::FreeIds;
use crate::rows::{PageLists, RowHot};
use crate::store::PageStore;

/// The books of the rows: which hold a live sequence (of which generation), each row's pages,
/// length and block marks, its place in the batch, and whether its last page may be shared.
pub(super) struct RowBooks {
    pub(super) generation: Vec<u32>,
    pub(super) live: Vec<bool>,
    /// The row's length (less `PhaseBuckets::decodes`, wrapping: a decode step grows every
    /// length by bumping `decodes` alone; see `PagedPool::len_of`) and this step's block marks.
    pub(super) hot: Vec<RowHot>,
    pub(super) pages: PageLists,
    /// The rows of the batch, in slot-mapping order for decode tokens.
    pub(super) batch: Vec<u32>,
    pub(super) batch_pos: Vec<u32>,
    /// The row's last page may be shared (checked against its reference count before a write).
    pub(super) tail_shared: Vec<bool>,
    /// Rows whose `tail_shared` may be set (each once; `in_shared` marks them).
    pub(super) shared_rows: Vec<u32>,
    pub(super) in_shared: Vec<bool>,
    pub(super) free_rows: FreeIds,
    /// Rows freed this step: reusable once it is committed.
    pub(super) pending_rows: Vec<u32>,
    pub(super) live_rows: u32,
}

impl RowBooks {
    /// `max_seqs` free rows of at most `max_pages_per_seq` pages each.
    pub(super) fn new(max_seqs: u32, max_pages_per_seq: usize) -> RowBooks {
        let seqs = max_seqs as usize;
        let mut free_rows = FreeIds::new();
        free_rows.grow_to(max_seqs);
        RowBooks {
            generation: vec![0; seqs],
            live: vec![false; seqs],
            hot: vec![RowHot::default(); seqs],
            pages: PageLists::new(seqs, max_pages_per_seq),
            batch: Vec::with_capacity(seqs),
            batch_pos: vec![0; seqs],
            tail_shared: vec![false; seqs],
            shared_rows: Vec::new(),
            in_shared: vec![false; seqs],
            free_rows,
            pending_rows: Vec::new(),
            live_rows: 0,
        }
    }

    pub(super) fn peek_free_row(&self) -> Option<u32> {
        self.free_rows.peek_lowest()
    }

    pub(super) fn set_tail_shared(&mut self, r: usize, shared: bool) {
        self.tail_shared[r] = shared;
        if shared && !self.in_shared[r] {
            self.in_shared[r] = true;
            self.shared_rows.push(r as u32);
        }
    }
}

/// The decode count and the live rows by phase: a row whose length is `len` when the decode
/// phase is `ph` sits in bucket `(len - ph) mod tokens_per_page`, reduced mod the number of
/// buckets. The phase moves with the lengths, so a row changes bucket only when its length
/// changes otherwise; a decode step visits the one bucket that holds the rows starting a page.
pub(super) struct PhaseBuckets {
    /// Decode steps so far (wrapping).
    pub(super) decodes: u32,
    /// `decodes % tokens_per_page`.
    pub(super) decode_phase: u32,
    /// The buckets' rows.
    pub(super) phase_rows: Vec<Vec<u32>>,
    /// Per row: its bucket, and its index in it.
    pub(super) phase_bucket: Vec<u32>,
    pub(super) phase_pos: Vec<u32>,
}

impl PhaseBuckets {
    /// `buckets` empty buckets for `seqs` rows.
    pub(super) fn new(seqs: usize, buckets: usize) -> PhaseBuckets {
        PhaseBuckets {
            decodes: 0,
            decode_phase: 0,
            phase_rows: vec![Vec::new(); buckets],
            phase_bucket: vec![0; seqs],
            phase_pos: vec![0; seqs],
        }
    }

    /// Takes a live row out of its bucket.
    pub(super) fn unplace(&mut self, row: u32) {
        let r = row as usize;
        let bucket = &mut self.phase_rows[self.phase_bucket[r] as usize];
        let i = self.phase_pos[r] as usize;
        let last = bucket.pop().expect("a live row is in its bucket");
        if last != row {
            bucket[i] = last;
            self.phase_pos[last as usize] = i as u32;
        }
    }
}

/// The pages: the store that grows and shrinks by whole granules, the free set below its top,
/// the shared pages, and those freed this step.
pub(super) struct PageBooks<'a> {
    pub(super) store: Box<dyn PageStore + 'a>,
    pub(super) free_pages: FreeIds,
    /// Pages held by more than one sequence, with their holders beyond the first. Any other
    /// page has one holder while a row lists it and none when free or pending, so freeing a
    /// sequence looks nothing up unless some page is shared (no per-page count to touch: a
    /// sequence's pages lie far apart, and each count would be a cache miss).
    pub(super) extra_refs: HashMap<u32, u32>,
    /// Pages whose last holder let go this step: free once it is committed.
    pub(super) pending_pages: Vec<u32>,
    /// Scratch: a step's new pages.
    pub(super) fresh_pages: Vec<u32>,
}

impl<'a> PageBooks<'a> {
    /// The books of `store`'s pages, none committed yet.
    pub(super) fn new(store: Box<dyn PageStore + 'a>) -> PageBooks<'a> {
        PageBooks {
            store,
            free_pages: FreeIds::new(),
            extra_refs: HashMap::new(),
            pending_pages: Vec::new(),
            fresh_pages: Vec::new(),
        }
    }

    /// Takes the `n` lowest free pages (ensure_free_pages ran first) into `out`.
    pub(super) fn take_pages(&mut self, n: u32, out: &mut Vec<u32>) {
        self.free_pages.pop_lowest_n(n, out);
    }

    pub(super) fn take_page(&mut self) -> u32 {
        self.free_pages.pop_lowest().expect("ensure_free_pages ran first")
    }

    /// One holder of page `p` lets it go; the last one makes it pending (free at the commit).
    pub(super) fn drop_ref(&mut self, p: u32) {
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
}

/// This step's changes, as marks the commit turns into the delta: the rows whose lengths and
/// batch slots changed (stamped with the step, so each is listed once), the token runs that
/// get slots, and the page copies. The block marks live in `RowBooks::hot`.
pub(super) struct StepMarks {
    /// The step's stamp: never 0, so a zeroed stamp is from no step.
    pub(super) step: u32,
    /// Rows with block marks this step (the marks are in `RowBooks::hot`).
    pub(super) blk_rows: Vec<u32>,
    pub(super) len_stamp: Vec<u32>,
    pub(super) len_rows: Vec<u32>,
    /// The step in which the row last had tokens added.
    pub(super) token_stamp: Vec<u32>,
    pub(super) bat_stamp: Vec<u32>,
    pub(super) bat_idx: Vec<u32>,
    pub(super) runs: Vec<TokenRun>,
    pub(super) copies: Vec<PageCopy>,
    /// Copy destination -> its source, this step (a copy of a copy reads the original).
    pub(super) copied_from: HashMap<u32, u32>,
    pub(super) explicit_tokens: u32,
}

impl StepMarks {
    /// The marks of the first step, for `seqs` rows.
    pub(super) fn new(seqs: usize) -> StepMarks {
        StepMarks {
            step: 1,
            blk_rows: Vec::new(),
            len_stamp: vec![0; seqs],
            len_rows: Vec::new(),
            token_stamp: vec![0; seqs],
            bat_stamp: vec![0; seqs],
            bat_idx: Vec::new(),
            runs: Vec::new(),
            copies: Vec::new(),
            copied_from: HashMap::new(),
            explicit_tokens: 0,
        }
    }

    pub(super) fn mark_len(&mut self, row: u32) {
        let r = row as usize;
        if self.len_stamp[r] != self.step {
            self.len_stamp[r] = self.step;
            self.len_rows.push(row);
        }
    }

    pub(super) fn mark_batch(&mut self, i: u32) {
        let k = i as usize;
        if self.bat_stamp[k] != self.step {
            self.bat_stamp[k] = self.step;
            self.bat_idx.push(i);
        }
    }

    /// Tokens of `row` added this step at or past `new_len` get no slot (-1): a later extend in
    /// the same step may add those positions again, and two slots for one position would race.
    pub(super) fn clip_runs(&mut self, row: u32, new_len: u32) {
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

    pub(super) fn push_run(&mut self, row: u32, start: u32, len: u32) {
        if len == 0 {
            return;
        }
        self.token_stamp[row as usize] = self.step;
        self.runs.push(TokenRun { row, start, len, out: self.explicit_tokens });
        self.explicit_tokens += len;
    }
}

impl PagedPool<'_> {
    pub(super) fn check_usable(&self) -> PagedResult<()> {
        match &self.poisoned {
            Some(why) => Err(PagedError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    pub(super) fn check_step_tokens(&self, more: u64) -> PagedResult<()> {
        let requested = self.marks.explicit_tokens as u64 + more;
        if requested > self.cfg.max_step_tokens as u64 {
            return Err(PagedError::StepTooLarge { requested, capacity: self.cfg.max_step_tokens });
        }
        Ok(())
    }

    /// Pages per allocator page: the store grows and shrinks by whole granules.
    pub(super) fn granule_pages(&self) -> u32 {
        (self.alloc.page_size().div_ceil(self.cfg.page_bytes()) as u32).max(1)
    }

    /// Makes sure `n` pages can be taken without failing, growing the store if needed. The
    /// growth is not undone if the request is refused later: it changes no sequence.
    pub(super) fn ensure_free_pages(&mut self, n: u64) -> PagedResult<()> {
        let free = self.page_books.free_pages.count() as u64;
        if n <= free {
            return Ok(());
        }
        let available = free + (self.cfg.max_pages - self.page_books.free_pages.limit()) as u64;
        if n > available {
            return Err(PagedError::OutOfPages {
                needed: n,
                available,
                max_pages: self.cfg.max_pages,
            });
        }
        let want = self.page_books.free_pages.limit() as u64 + (n - free);
        // Grow by at least a quarter of what is committed, by whole granules.
        let g = self.granule_pages() as u64;
        let want = want.max(self.page_books.free_pages.limit() as u64 * 5 / 4);
        let target = (want.div_ceil(g) * g).min(self.cfg.max_pages as u64) as u32;
        self.page_books.store.resize(target as usize * self.cfg.page_bytes(), self.stream)?;
        self.page_books.free_pages.grow_to(target);
        Ok(())
    }

    /// Gives back the committed memory above the highest page in use. Returns the bytes
    /// released.
    pub fn shrink(&mut self) -> PagedResult<u64> {
        self.check_usable()?;
        let before = self.page_books.store.committed();
        let granule = self.granule_pages();
        let used_top = self.page_books.free_pages.trim_trailing(0);
        let target = used_top.div_ceil(granule) * granule;
        let target = target.min(self.cfg.max_pages);
        // Give the granule's rounding back to the free set.
        self.page_books.free_pages.grow_to(target);
        self.page_books.store.resize(target as usize * self.cfg.page_bytes(), self.stream)?;
        Ok(before.saturating_sub(self.page_books.store.committed()) as u64)
    }

    /// The token count of row `r` (live).
    #[inline]
    pub(super) fn len_of(&self, r: usize) -> u32 {
        self.rows.hot[r].len_rel.wrapping_add(self.phases.decodes)
    }

    /// The phase bucket of a live row of length `len`.
    pub(super) fn bucket_for(&self, len: u32) -> u32 {
        let t = self.cfg.tokens_per_page;
        let key = (len % t + t - self.phases.decode_phase) % t;
        key % self.phases.phase_rows.len() as u32
    }

    /// The bucket holding the rows whose length is a whole number of pages.
    pub(super) fn due_bucket(&self) -> usize {
        self.bucket_for(0) as usize
    }

    /// Gives a row that just became live its length, and puts it in its bucket.
    pub(super) fn place(&mut self, row: u32, len: u32) {
        let r = row as usize;
        self.rows.hot[r].len_rel = len.wrapping_sub(self.phases.decodes);
        let b = self.bucket_for(len);
        self.phases.phase_bucket[r] = b;
        self.phases.phase_pos[r] = self.phases.phase_rows[b as usize].len() as u32;
        self.phases.phase_rows[b as usize].push(row);
    }

    /// Changes a live row's length (not by a decode step).
    pub(super) fn set_len(&mut self, row: u32, len: u32) {
        let r = row as usize;
        if self.bucket_for(len) == self.phases.phase_bucket[r] {
            self.rows.hot[r].len_rel = len.wrapping_sub(self.phases.decodes);
        } else {
            self.phases.unplace(row);
            self.place(row, len);
        }
    }

    /// Whether writing into the row's last page needs a copy first: the page is partly filled
    /// and held by another sequence too.
    pub(super) fn tail_needs_copy(&self, r: usize) -> bool {
        self.len_of(r) % self.cfg.tokens_per_page != 0
            && self.rows.pages.last(r).is_some_and(|p| self.page_books.extra_refs.contains_key(&p))
    }

    /// Gives the row a private copy of its shared last page.
    pub(super) fn copy_tail(&mut self, row: u32) {
        let r = row as usize;
        let c = self.rows.pages.len(r) - 1;
        let old = self.rows.pages.get(r)[c];
        let new = self.page_books.take_page();
        // A page copied earlier this step has the same bytes as its source until the step's
        // tokens are written, which happens after the commit: read the original, so that the
        // kernel's copies are independent of one another.
        let src = self.marks.copied_from.get(&old).copied().unwrap_or(old);
        self.marks.copies.push(PageCopy { src, dst: new });
        self.marks.copied_from.insert(new, src);
        self.page_books.drop_ref(old); // shared, so another row still holds it
        self.rows.pages.set(r, c, new);
        self.mark_blocks(row, c as u32, c as u32 + 1);
    }

    pub(super) fn mark_blocks(&mut self, row: u32, lo: u32, hi: u32) {
        if lo >= hi {
            return;
        }
        let r = row as usize;
        let h = &mut self.rows.hot[r];
        if h.blk_stamp != self.marks.step {
            h.blk_stamp = self.marks.step;
            h.blk_lo = lo;
            h.blk_hi = hi;
            self.marks.blk_rows.push(row);
        } else {
            h.blk_lo = h.blk_lo.min(lo);
            h.blk_hi = h.blk_hi.max(hi);
        }
    }
}
