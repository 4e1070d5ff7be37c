//! The delta of one step: what the host ships to the device so that kernels bring the block
//! table, the per-row lengths, the batch list and the slot mapping up to date. Its layout is
//! shared with `kernels.cu` (each record is `repr(C)`, made of 32-bit words).

/// A [`TableOp`] writing `block_table[index]` (index = row * max_pages_per_seq + column).
pub const OP_BLOCK: u32 = 0;
/// A [`TableOp`] writing `seq_lens[index]` (index = row).
pub const OP_LEN: u32 = 1;
/// A [`TableOp`] writing `batch_rows[index]` (index = position in the batch).
pub const OP_BATCH: u32 = 2;

/// A [`TableOp`] writing -1 into `block_table[index .. index + value]` (columns of one row a
/// freed or shortened sequence no longer holds): one record instead of one per column.
pub const OP_CLEAR: u32 = 3;

/// The row of a [`TokenRun`] whose tokens were truncated later in the same step: slots -1.
pub const DEAD_ROW: u32 = u32::MAX;

/// One write into a device table. A step writes each target at most once, with its final
/// value, so the kernel may apply all writes in parallel.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableOp {
    /// [`OP_BLOCK`], [`OP_LEN`], [`OP_BATCH`] or [`OP_CLEAR`].
    pub kind: u32,
    /// The element written.
    pub index: u32,
    /// Its new value (a page id or -1, a length, a row), or for [`OP_CLEAR`] the number of
    /// entries cleared.
    pub value: i32,
}

/// Tokens `start .. start + len` of `row`, written this step: their slots go to
/// `slot_mapping[out .. out + len]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenRun {
    /// Block-table row.
    pub row: u32,
    /// First token position.
    pub start: u32,
    /// Number of tokens.
    pub len: u32,
    /// Where the first one's slot goes in the slot mapping.
    pub out: u32,
}

/// A copy-on-write: page `dst` gets the bytes of page `src` (both in the pool).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCopy {
    /// Page read.
    pub src: u32,
    /// Page written (fresh this step).
    pub dst: u32,
}

/// Everything one step changes on the device, applied in this order:
///
/// 1. the page copies and the table writes (independent of each other);
/// 2. the slot mapping: `explicit_tokens` slots from `runs` (tokens added by `add`/`extend`),
///    then, when `decode_rows` > 0, one slot for each of the first `decode_rows` rows of
///    `batch_rows`, at position `seq_lens[row]`, after which that length grows by one.
///
/// Slots are computed from the block table as it stands after step 1: a token whose page is
/// gone (its sequence was truncated or freed later in the same step) gets slot -1, vLLM's
/// padding slot that attention kernels skip.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Table writes, each target once.
    pub ops: Vec<TableOp>,
    /// Copy-on-write page copies (sources are never destinations within a step).
    pub copies: Vec<PageCopy>,
    /// Explicit token runs, in slot-mapping order.
    pub runs: Vec<TokenRun>,
    /// Tokens covered by `runs`.
    pub explicit_tokens: u32,
    /// Batch rows that take one decode token each (0 when the step had no decode).
    pub decode_rows: u32,
}

impl Delta {
    /// The length of this step's slot mapping.
    pub fn step_tokens(&self) -> u32 {
        self.explicit_tokens + self.decode_rows
    }

    /// Empties every list, keeping their storage.
    pub(crate) fn clear(&mut self) {
        self.ops.clear();
        self.copies.clear();
        self.runs.clear();
        self.explicit_tokens = 0;
        self.decode_rows = 0;
    }
}
