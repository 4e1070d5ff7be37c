//! The pool's books: free rows and pages (the page store grows and shrinks by whole granules),
//! each row's length and phase bucket, page references (shared pages and copy-on-write), and
//! the marks of what this step changed, which the commit turns into the delta.

use super::PagedPool;
use crate::delta::{PageCopy, TokenRun, DEAD_ROW};
use crate::error::{PagedError, PagedResult};

impl PagedPool<'_> {
    pub(super) fn check_usable(&self) -> PagedResult<()> {
        match &self.poisoned {
            Some(why) => Err(PagedError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    pub(super) fn peek_free_row(&self) -> Option<u32> {
        self.free_rows.peek_lowest()
    }

    pub(super) fn check_step_tokens(&self, more: u64) -> PagedResult<()> {
        let requested = self.explicit_tokens as u64 + more;
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

    /// The token count of row `r` (live).
    #[inline]
    pub(super) fn len_of(&self, r: usize) -> u32 {
        self.hot[r].len_rel.wrapping_add(self.decodes)
    }

    /// The phase bucket of a live row of length `len`.
    pub(super) fn bucket_for(&self, len: u32) -> u32 {
        let t = self.cfg.tokens_per_page;
        let key = (len % t + t - self.decode_phase) % t;
        key % self.phase_rows.len() as u32
    }

    /// The bucket holding the rows whose length is a whole number of pages.
    pub(super) fn due_bucket(&self) -> usize {
        self.bucket_for(0) as usize
    }

    /// Gives a row that just became live its length, and puts it in its bucket.
    pub(super) fn place(&mut self, row: u32, len: u32) {
        let r = row as usize;
        self.hot[r].len_rel = len.wrapping_sub(self.decodes);
        let b = self.bucket_for(len);
        self.phase_bucket[r] = b;
        self.phase_pos[r] = self.phase_rows[b as usize].len() as u32;
        self.phase_rows[b as usize].push(row);
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

    /// Changes a live row's length (not by a decode step).
    pub(super) fn set_len(&mut self, row: u32, len: u32) {
        let r = row as usize;
        if self.bucket_for(len) == self.phase_bucket[r] {
            self.hot[r].len_rel = len.wrapping_sub(self.decodes);
        } else {
            self.unplace(row);
            self.place(row, len);
        }
    }

    pub(super) fn set_tail_shared(&mut self, r: usize, shared: bool) {
        self.tail_shared[r] = shared;
        if shared && !self.in_shared[r] {
            self.in_shared[r] = true;
            self.shared_rows.push(r as u32);
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

    /// Whether writing into the row's last page needs a copy first: the page is partly filled
    /// and held by another sequence too.
    pub(super) fn tail_needs_copy(&self, r: usize) -> bool {
        self.len_of(r) % self.cfg.tokens_per_page != 0
            && self.pages.last(r).is_some_and(|p| self.extra_refs.contains_key(&p))
    }

    /// Gives the row a private copy of its shared last page.
    pub(super) fn copy_tail(&mut self, row: u32) {
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

    pub(super) fn mark_blocks(&mut self, row: u32, lo: u32, hi: u32) {
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
