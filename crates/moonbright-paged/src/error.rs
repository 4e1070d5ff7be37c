//! What a paged-pool call can refuse, and why: [`PagedError`] names the request and the limit it
//! hit. A refused request changes nothing.

use crate::seq::SeqId;

/// Everything a paged-pool call can refuse. A refused request changes nothing.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PagedError {
    /// A bad configuration value.
    #[error("invalid paged pool configuration: {0}")]
    InvalidConfig(String),
    /// An id this pool never handed out.
    #[error("unknown sequence {0}: this pool never created it")]
    UnknownSequence(SeqId),
    /// An operation on a sequence that was freed.
    #[error("sequence {seq} was freed: cannot {op} it")]
    FreedSequence {
        /// The sequence.
        seq: SeqId,
        /// What was asked ("extend", "truncate", ...).
        op: &'static str,
    },
    /// A second free of a sequence.
    #[error("double free of sequence {0}: it was freed already")]
    DoubleFree(SeqId),
    /// A fork of a freed sequence.
    #[error("cannot fork sequence {0}: it was freed")]
    ForkOfFreed(SeqId),
    /// A fork of a sequence whose tokens added this step are not written yet (they are written
    /// after the commit, and a copy-on-write copy made at the commit would miss them).
    #[error("cannot fork sequence {0}: it has tokens added this step; commit the step first")]
    ForkOfUncommitted(SeqId),
    /// A sequence would outgrow its row of the block table.
    #[error(
        "sequence {seq} cannot grow to {requested} tokens: a sequence holds at most {max} \
         (max_pages_per_seq x tokens_per_page)"
    )]
    SequenceTooLong {
        /// The sequence (the new one, for `add`).
        seq: SeqId,
        /// The length it would have.
        requested: u64,
        /// The most it may have.
        max: u64,
    },
    /// Not enough free pages in the pool.
    #[error("out of KV pages: the request needs {needed} new pages, {available} of {max_pages} are free")]
    OutOfPages {
        /// Pages the request needs.
        needed: u64,
        /// Pages free (committed or not).
        available: u64,
        /// The pool's capacity in pages.
        max_pages: u32,
    },
    /// Every row of the block table is taken.
    #[error("too many sequences: all {max_seqs} rows of the block table are in use (rows freed this step come back at its commit)")]
    TooManySequences {
        /// Rows of the block table.
        max_seqs: u32,
    },
    /// The step's tokens would not fit the slot mapping.
    #[error("this step would write {requested} tokens; the slot mapping holds {capacity} (max_step_tokens)")]
    StepTooLarge {
        /// Tokens the step would have.
        requested: u64,
        /// The slot mapping's length.
        capacity: u32,
    },
    /// A truncation that would lengthen.
    #[error("cannot truncate sequence {seq} to {new_len} tokens: it has {len}")]
    BadTruncate {
        /// The sequence.
        seq: SeqId,
        /// Its length.
        len: u32,
        /// The length asked for.
        new_len: u32,
    },
    /// A commit on a stream being captured into a CUDA graph. The table kernel reads the step's
    /// delta from staging memory that later steps reuse, so a replay would apply stale data.
    #[error(
        "the pool's stream {stream:#x} is being captured into a CUDA graph: a commit is refused \
         there (a replay would apply a stale delta); commit outside the capture, where the graph \
         may read the tables"
    )]
    StreamCapture {
        /// The stream.
        stream: u64,
    },
    /// A kernel could not be compiled, loaded or launched (the message says which).
    #[error("device tables: {0}")]
    Device(String),
    /// An earlier commit failed on the device; the device tables are not known to match.
    #[error("the pool is unusable: an earlier commit failed on the device ({0})")]
    Poisoned(String),
    /// The allocator refused memory for the pool.
    #[error(transparent)]
    Alloc(#[from] moonbright::Error),
}

/// Result of a paged-pool call.
pub type PagedResult<T> = std::result::Result<T, PagedError>;
