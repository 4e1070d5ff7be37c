//! The pool's shape ([`PagedConfig`] and its checks), the ids of its sequences ([`SeqId`]) and
//! the device addresses of its fixed buffers ([`TablePointers`]).

use std::fmt;

use moonbright::DevicePtr;

use crate::{PagedError, PagedResult};

/// A sequence: its block-table row in the low 32 bits, the row's generation in the high ones,
/// so an id outlives its sequence without ever naming the next one in the same row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl SeqId {
    pub(crate) fn new(row: u32, generation: u32) -> Self {
        SeqId((generation as u64) << 32 | row as u64)
    }
    /// Its block-table row.
    pub fn row(self) -> u32 {
        self.0 as u32
    }
    pub(crate) fn generation(self) -> u32 {
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
