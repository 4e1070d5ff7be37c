//! The decode step: every live sequence grows by one token, visiting only the rows that start a
//! page (one phase bucket) and those whose last page is shared, then the step is committed.

use super::PagedPool;
use crate::delta::Delta;
use crate::error::{PagedError, PagedResult};
use crate::seq::SeqId;

impl PagedPool<'_> {
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
        &self.tables.delta
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
        for &row in &self.phases.phase_rows[b] {
            let len = self.len_of(row as usize);
            if len % t == 0 {
                too_long |= len as u64 >= max;
                starting += 1;
                probe ^= self.rows.pages.next_cell(row as usize);
            }
        }
        std::hint::black_box(probe);
        let mut need = starting;
        if too_long {
            // Name the first such row in batch order.
            let row = *self
                .rows
                .batch
                .iter()
                .find(|&&r| self.len_of(r as usize) as u64 >= max)
                .expect("found above");
            let r = row as usize;
            return Err(PagedError::SequenceTooLong {
                seq: SeqId::new(row, self.rows.generation[r]),
                requested: self.len_of(r) as u64 + 1,
                max,
            });
        }
        for &row in &self.rows.shared_rows {
            let r = row as usize;
            if self.rows.tail_shared[r] && self.tail_needs_copy(r) {
                need += 1;
            }
        }
        self.check_step_tokens(self.rows.batch.len() as u64)?;
        self.ensure_free_pages(need)?;
        // Nothing can fail from here on.
        let due = std::mem::take(&mut self.phases.phase_rows[b]);
        let mut fresh = std::mem::take(&mut self.page_books.fresh_pages);
        fresh.clear();
        self.page_books.take_pages(starting as u32, &mut fresh);
        let mut fresh_pages = fresh.iter();
        for &row in &due {
            let r = row as usize;
            let len = self.len_of(r);
            if len % t == 0 {
                let p = *fresh_pages.next().expect("one page per row starting one");
                self.rows.pages.push(r, p);
                let c = len / t;
                self.mark_blocks(row, c, c + 1);
            }
        }
        self.phases.phase_rows[b] = due;
        self.page_books.fresh_pages = fresh;
        let mut shared = std::mem::take(&mut self.rows.shared_rows);
        shared.retain(|&row| {
            let r = row as usize;
            // A row starting a page writes into its new private page: it keeps the mark, to be
            // looked at again in the next step.
            if self.rows.tail_shared[r] && self.len_of(r) % t == 0 {
                return true;
            }
            if self.rows.tail_shared[r] && self.tail_needs_copy(r) {
                self.copy_tail(row);
            }
            self.rows.tail_shared[r] = false;
            self.rows.in_shared[r] = false;
            false
        });
        self.rows.shared_rows = shared;
        // Every live row grows by one token.
        self.phases.decodes = self.phases.decodes.wrapping_add(1);
        self.phases.decode_phase =
            if self.phases.decode_phase + 1 == t { 0 } else { self.phases.decode_phase + 1 };
        Ok(())
    }
}
