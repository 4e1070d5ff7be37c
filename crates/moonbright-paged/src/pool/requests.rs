//! The requests of one step: a new sequence, more tokens, a fork, a truncation, a free. Each
//! validates first (a refused request changes nothing), then updates the books and marks what
//! the step's delta must carry.

use super::PagedPool;
use crate::error::{PagedError, PagedResult};
use crate::seq::SeqId;

impl PagedPool<'_> {
    /// A new sequence of `prompt_len` tokens (written this step: they get slots).
    pub fn add(&mut self, prompt_len: u32) -> PagedResult<SeqId> {
        self.check_usable()?;
        let Some(row) = self.rows.peek_free_row() else {
            return Err(PagedError::TooManySequences { max_seqs: self.cfg.max_seqs });
        };
        let next = SeqId::new(row, self.rows.generation[row as usize] + 1);
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
        let row = self.rows.free_rows.pop_lowest().expect("peeked");
        let r = row as usize;
        self.rows.generation[r] += 1;
        self.rows.live[r] = true;
        self.rows.live_rows += 1;
        self.place(row, prompt_len);
        self.rows.tail_shared[r] = false;
        let mut fresh = std::mem::take(&mut self.page_books.fresh_pages);
        fresh.clear();
        self.page_books.take_pages(np, &mut fresh);
        self.rows.pages.truncate(r, 0);
        self.rows.pages.extend(r, &fresh);
        self.page_books.fresh_pages = fresh;
        self.rows.batch_pos[r] = self.rows.batch.len() as u32;
        self.rows.batch.push(row);
        self.marks.mark_batch(self.rows.batch.len() as u32 - 1);
        self.mark_blocks(row, 0, np);
        self.marks.mark_len(row);
        self.marks.push_run(row, 0, prompt_len);
        Ok(SeqId::new(row, self.rows.generation[r]))
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
        self.rows.tail_shared[r] = false;
        for _ in cur_np..new_np {
            let p = self.page_books.take_page();
            self.rows.pages.push(r, p);
        }
        self.mark_blocks(row, cur_np, new_np);
        self.set_len(row, new_len as u32);
        self.marks.mark_len(row);
        self.marks.push_run(row, len, n);
        Ok(())
    }

    /// A new sequence sharing every page of `parent` (copy-on-write), with its length.
    pub fn fork(&mut self, parent: SeqId) -> PagedResult<SeqId> {
        self.check_usable()?;
        let prow = self.live_row(parent, "fork")? as usize;
        if self.marks.token_stamp[prow] == self.marks.step {
            return Err(PagedError::ForkOfUncommitted(parent));
        }
        if self.rows.peek_free_row().is_none() {
            return Err(PagedError::TooManySequences { max_seqs: self.cfg.max_seqs });
        }
        let row = self.rows.free_rows.pop_lowest().expect("peeked");
        let r = row as usize;
        self.rows.generation[r] += 1;
        self.rows.live[r] = true;
        self.rows.live_rows += 1;
        let len = self.len_of(prow);
        self.place(row, len);
        self.rows.pages.copy_row(prow, r);
        for &p in self.rows.pages.get(r) {
            *self.page_books.extra_refs.entry(p).or_insert(0) += 1;
        }
        let np = self.rows.pages.len(r) as u32;
        let partial = len % self.cfg.tokens_per_page != 0;
        self.rows.set_tail_shared(r, partial);
        if partial {
            self.rows.set_tail_shared(prow, true);
        }
        self.rows.batch_pos[r] = self.rows.batch.len() as u32;
        self.rows.batch.push(row);
        self.marks.mark_batch(self.rows.batch.len() as u32 - 1);
        self.mark_blocks(row, 0, np);
        self.marks.mark_len(row);
        Ok(SeqId::new(row, self.rows.generation[r]))
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
        let old_np = self.rows.pages.len(r) as u32;
        for c in keep..old_np {
            self.page_books.drop_ref(self.rows.pages.get(r)[c as usize]);
        }
        self.rows.pages.truncate(r, keep as usize);
        self.mark_blocks(row, keep, old_np);
        if self.marks.token_stamp[r] == self.marks.step {
            self.marks.clip_runs(row, new_len);
        }
        self.set_len(row, new_len);
        let shared = new_len % self.cfg.tokens_per_page != 0
            && self.rows.pages.last(r).is_some_and(|p| self.page_books.extra_refs.contains_key(&p));
        self.rows.set_tail_shared(r, shared);
        self.marks.mark_len(row);
        Ok(())
    }

    /// Frees `seq`: its pages lose a reference, its row leaves the batch. The row and the pages
    /// that became free are reused from the next step on.
    pub fn free(&mut self, seq: SeqId) -> PagedResult<()> {
        self.check_usable()?;
        let row = self.live_row(seq, "free")?;
        let r = row as usize;
        let np = self.rows.pages.len(r) as u32;
        for c in 0..np {
            self.page_books.drop_ref(self.rows.pages.get(r)[c as usize]);
        }
        self.rows.pages.truncate(r, 0);
        self.mark_blocks(row, 0, np);
        self.phases.unplace(row);
        self.rows.live[r] = false;
        self.rows.live_rows -= 1;
        self.rows.tail_shared[r] = false;
        self.marks.mark_len(row);
        let i = self.rows.batch_pos[r];
        let last = self.rows.batch.pop().expect("a live row is in the batch");
        if last != row {
            self.rows.batch[i as usize] = last;
            self.rows.batch_pos[last as usize] = i;
            self.marks.mark_batch(i);
        }
        self.rows.pending_rows.push(row);
        Ok(())
    }
}
