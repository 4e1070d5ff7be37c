//! Per-row host metadata laid out for a decode step's memory traffic. A decode step touches the
//! rows that start a page, scattered over the table; each random cache line costs far more than
//! the work done on it once the serving loop around the pool has evicted the pool's data. So:
//!
//! - [`RowHot`]: the fields every such row reads or writes (its length and this step's block
//!   marks), packed in 16 bytes;
//! - [`PageLists`]: every row's pages, in order, in one flat `max_seqs x max_pages_per_seq`
//!   array (the host's twin of the block table): giving a row its next page writes one word,
//!   where a list per row would first chase a pointer to a heap block of its own.

/// The fields of a row that a decode step touches, kept together.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(16))]
pub(crate) struct RowHot {
    /// The row's length minus the pool's decode count (wrapping); see `PagedPool::len_of`.
    pub len_rel: u32,
    /// The step in which the row's block-table columns were last marked.
    pub blk_stamp: u32,
    /// The marked columns of that step: `blk_lo .. blk_hi`.
    pub blk_lo: u32,
    pub blk_hi: u32,
}

/// Every row's pages in one flat array.
#[derive(Clone, Debug)]
pub(crate) struct PageLists {
    cells: Vec<u32>,
    len: Vec<u32>,
    /// Columns per row (`max_pages_per_seq`).
    m: usize,
}

impl PageLists {
    pub fn new(rows: usize, m: usize) -> Self {
        PageLists { cells: vec![0; rows * m], len: vec![0; rows], m }
    }

    /// The pages of row `r`, in order.
    #[inline]
    pub fn get(&self, r: usize) -> &[u32] {
        &self.cells[r * self.m..r * self.m + self.len[r] as usize]
    }

    #[inline]
    pub fn len(&self, r: usize) -> usize {
        self.len[r] as usize
    }

    #[inline]
    pub fn last(&self, r: usize) -> Option<u32> {
        self.get(r).last().copied()
    }

    /// The word row `r`'s next page will be written to (read early, so that the write finds
    /// its cache line present).
    #[inline]
    pub fn next_cell(&self, r: usize) -> u32 {
        self.cells.get(r * self.m + self.len[r] as usize).copied().unwrap_or(0)
    }

    /// Appends page `p` to row `r`. The pool never lets a row outgrow `max_pages_per_seq`.
    #[inline]
    pub fn push(&mut self, r: usize, p: u32) {
        let n = self.len[r] as usize;
        assert!(n < self.m, "row {r} has all {} columns", self.m);
        self.cells[r * self.m + n] = p;
        self.len[r] += 1;
    }

    /// Appends `pages` to row `r`.
    pub fn extend(&mut self, r: usize, pages: &[u32]) {
        let n = self.len[r] as usize;
        assert!(n + pages.len() <= self.m, "row {r} would outgrow {} columns", self.m);
        self.cells[r * self.m + n..r * self.m + n + pages.len()].copy_from_slice(pages);
        self.len[r] += pages.len() as u32;
    }

    /// Column `c` of row `r` becomes page `p`.
    #[inline]
    pub fn set(&mut self, r: usize, c: usize, p: u32) {
        assert!(c < self.len[r] as usize, "row {r} has no column {c}");
        self.cells[r * self.m + c] = p;
    }

    /// Row `r` keeps its first `n` pages.
    pub fn truncate(&mut self, r: usize, n: usize) {
        self.len[r] = self.len[r].min(n as u32);
    }

    /// Row `dst` gets a copy of row `src`'s pages.
    pub fn copy_row(&mut self, src: usize, dst: usize) {
        let n = self.len[src] as usize;
        self.cells.copy_within(src * self.m..src * self.m + n, dst * self.m);
        self.len[dst] = n as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_behave_like_lists() {
        let mut p = PageLists::new(3, 4);
        p.push(1, 7);
        p.extend(1, &[8, 9]);
        assert_eq!(p.get(1), &[7, 8, 9]);
        assert_eq!((p.get(0), p.last(1), p.len(1)), (&[][..], Some(9), 3));
        p.set(1, 0, 5);
        p.copy_row(1, 2);
        p.truncate(1, 1);
        assert_eq!((p.get(1), p.get(2)), (&[5][..], &[5, 8, 9][..]));
        p.truncate(2, 0);
        assert!(p.get(2).is_empty() && p.last(2).is_none());
        assert_eq!(std::mem::size_of::<RowHot>(), 16);
    }

    #[test]
    #[should_panic(expected = "columns")]
    fn a_full_row_refuses_a_page() {
        let mut p = PageLists::new(1, 2);
        p.extend(0, &[1, 2]);
        p.push(0, 3);
    }
}
