//! The pool's shape ([`PagedConfig`] and its checks) and the device addresses of its fixed
//! buffers ([`TablePointers`]).

use moonbright::DevicePtr;

use crate::error::{PagedError, PagedResult};

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
