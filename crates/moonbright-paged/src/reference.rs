//! The host reference of the table kernels: [`HostTables`] applies a [`Delta`] to host copies of
//! the block table, lengths, batch list and slot mapping exactly as `kernels.cu` does on the
//! device. The host backend uses it as its "device"; tests compare the GPU's tables with it.

use crate::delta::{Delta, DEAD_ROW, OP_BATCH, OP_BLOCK, OP_CLEAR, OP_LEN};

/// Host copies of the device tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostTables {
    /// Tokens per page.
    pub tokens_per_page: u32,
    /// Columns of the block table.
    pub max_pages_per_seq: u32,
    /// `[max_seqs, max_pages_per_seq]`, row-major; -1 where no page.
    pub block_table: Vec<i32>,
    /// `[max_seqs]` token count per row.
    pub seq_lens: Vec<i32>,
    /// `[max_seqs]` the rows of the batch, in order (only the first `n` mean anything).
    pub batch_rows: Vec<i32>,
    /// The last step's slot mapping (its length is that step's token count).
    pub slot_mapping: Vec<i64>,
}

impl HostTables {
    /// Fresh tables, as the device ones start: no pages, zero lengths, zero rows.
    pub fn new(max_seqs: u32, max_pages_per_seq: u32, tokens_per_page: u32) -> Self {
        HostTables {
            tokens_per_page,
            max_pages_per_seq,
            block_table: vec![-1; max_seqs as usize * max_pages_per_seq as usize],
            seq_lens: vec![0; max_seqs as usize],
            batch_rows: vec![0; max_seqs as usize],
            slot_mapping: Vec::new(),
        }
    }

    /// The slot of token `pos` of `row` by the block table now: page * tokens_per_page +
    /// offset, or -1 when that page does not exist.
    pub fn slot(&self, row: u32, pos: u32) -> i64 {
        let t = self.tokens_per_page;
        let m = self.max_pages_per_seq;
        let col = pos / t;
        if col >= m || row == DEAD_ROW {
            return -1;
        }
        let page = self.block_table[(row * m + col) as usize];
        if page < 0 {
            -1
        } else {
            page as i64 * t as i64 + (pos % t) as i64
        }
    }

    /// Applies `delta` as the kernels do (page copies excepted: see [`copy_pages`]).
    pub fn apply(&mut self, delta: &Delta) {
        for op in &delta.ops {
            let i = op.index as usize;
            match op.kind {
                OP_BLOCK => self.block_table[i] = op.value,
                OP_LEN => self.seq_lens[i] = op.value,
                OP_BATCH => self.batch_rows[i] = op.value,
                OP_CLEAR => self.block_table[i..i + op.value as usize].fill(-1),
                other => unreachable!("unknown table op kind {other}"),
            }
        }
        self.slot_mapping.clear();
        self.slot_mapping.resize(delta.step_tokens() as usize, -1);
        for run in &delta.runs {
            for k in 0..run.len {
                self.slot_mapping[(run.out + k) as usize] = self.slot(run.row, run.start + k);
            }
        }
        let e = delta.explicit_tokens as usize;
        for j in 0..delta.decode_rows as usize {
            let row = self.batch_rows[j] as u32;
            let pos = self.seq_lens[row as usize];
            self.slot_mapping[e + j] = self.slot(row, pos as u32);
            self.seq_lens[row as usize] = pos + 1;
        }
    }
}

/// Applies `delta`'s page copies to `pool` (the pages' bytes, `page_bytes` each).
pub fn copy_pages(delta: &Delta, pool: &mut [u8], page_bytes: usize) {
    for c in &delta.copies {
        let (s, d) = (c.src as usize * page_bytes, c.dst as usize * page_bytes);
        pool.copy_within(s..s + page_bytes, d);
    }
}
