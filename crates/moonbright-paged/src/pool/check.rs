//! The host metadata's invariants, checked on request (the tests check them after every step):
//! reference counts, free sets, phase buckets, batch positions.

use super::PagedPool;

impl PagedPool<'_> {
    /// Checks the host metadata's invariants: reference counts, free sets, batch positions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut refs = vec![0u32; self.cfg.max_pages as usize];
        let t = self.cfg.tokens_per_page;
        for r in 0..self.rows.live.len() {
            if !self.rows.live[r] {
                if self.rows.pages.len(r) != 0 {
                    return Err(format!("free row {r} holds pages"));
                }
                continue;
            }
            let len = self.len_of(r);
            if self.rows.pages.len(r) as u32 != len.div_ceil(t) {
                return Err(format!("row {r}: {} pages for {len} tokens", self.rows.pages.len(r)));
            }
            let b = self.phases.phase_bucket[r] as usize;
            if self.phases.phase_bucket[r] != self.bucket_for(len)
                || self.phases.phase_rows[b].get(self.phases.phase_pos[r] as usize)
                    != Some(&(r as u32))
            {
                return Err(format!("row {r} is not in its phase bucket"));
            }
            if self.rows.tail_shared[r] && !self.rows.in_shared[r] {
                return Err(format!("row {r}: tail_shared but not listed"));
            }
            for &p in self.rows.pages.get(r) {
                refs[p as usize] += 1;
            }
            let i = self.rows.batch_pos[r] as usize;
            if self.rows.batch.get(i) != Some(&(r as u32)) {
                return Err(format!("row {r} is not at its batch position {i}"));
            }
        }
        for &p in &self.page_books.pending_pages {
            if refs[p as usize] != 0 || self.page_books.extra_refs.contains_key(&p) {
                return Err(format!("pending page {p} still referenced"));
            }
        }
        for (&p, &extra) in &self.page_books.extra_refs {
            if extra == 0 || refs.get(p as usize) != Some(&(extra + 1)) {
                return Err(format!("page {p}: {} holders beyond the first counted", extra));
            }
        }
        for (p, &a) in refs.iter().enumerate() {
            if a > 1 && !self.page_books.extra_refs.contains_key(&(p as u32)) {
                return Err(format!("page {p}: {a} holders, not counted as shared"));
            }
            let p32 = p as u32;
            let free = self.page_books.free_pages.contains(p32);
            if a > 0 && free {
                return Err(format!("page {p} is held and free"));
            }
            if a == 0
                && p32 < self.page_books.free_pages.limit()
                && !free
                && !self.page_books.pending_pages.contains(&p32)
            {
                return Err(format!("page {p} leaked: neither held nor free"));
            }
        }
        let placed: usize = self.phases.phase_rows.iter().map(Vec::len).sum();
        if placed as u32 != self.rows.live_rows {
            return Err(format!(
                "{placed} rows in the phase buckets, {} live",
                self.rows.live_rows
            ));
        }
        if self.rows.batch.len() as u32 != self.rows.live_rows {
            return Err(format!(
                "{} rows in the batch, {} live",
                self.rows.batch.len(),
                self.rows.live_rows
            ));
        }
        Ok(())
    }
}
