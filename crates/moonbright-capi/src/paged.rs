//! The C API of the paged KV pool (`mb_paged_*`): an opaque pool over an `mb_allocator`, its
//! requests (each refused request changes nothing), the per-step commit that launches the table
//! kernels, and the fixed device addresses of the tables. Same conventions as `lib.rs`: an
//! `int` status, outputs untouched on failure, `mb_last_error()`, no panic across the boundary.

use std::ffi::{c_int, c_void};

use moonbright::StreamHandle;
use moonbright_paged::{PagedConfig, PagedError, PagedPool, SeqId};

use crate::status::{
    allocator, call, status_of, write_out, Failure, MB_ERR_CAPACITY, MB_ERR_DRIVER,
    MB_ERR_FREED_SEQUENCE, MB_ERR_INVALID_REQUEST, MB_ERR_UNKNOWN_SEQUENCE,
};
use crate::types::mb_allocator;

/// A paged KV pool (opaque). Made by `mb_paged_create`, destroyed by `mb_paged_destroy`, which
/// must come before `mb_destroy` of its allocator. One thread at a time may call it.
pub struct mb_paged {
    inner: PagedPool<'static>,
}

/// The shape of a paged pool.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct mb_paged_config {
    /// Tokens per page (16, say).
    pub tokens_per_page: u32,
    /// KV bytes per token.
    pub bytes_per_token: u64,
    /// Capacity of the pool in pages.
    pub max_pages: u32,
    /// Rows of the block table (sequences alive at once).
    pub max_seqs: u32,
    /// Columns of the block table (pages per sequence).
    pub max_pages_per_seq: u32,
    /// Length of the slot mapping (tokens per step).
    pub max_step_tokens: u32,
}

/// Device addresses of a pool's tables and pages; fixed for the pool's life (so CUDA graphs
/// may capture kernels that read them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct mb_paged_tables {
    /// int32 `[max_seqs][max_pages_per_seq]`, -1 where no page.
    pub block_table: u64,
    /// int32 `[max_seqs]`: tokens per row.
    pub seq_lens: u64,
    /// int32 `[max_seqs]`: the batch's rows, in decode-token order.
    pub batch_rows: u64,
    /// int64 `[max_step_tokens]`: the last step's slot per token (-1: skip).
    pub slot_mapping: u64,
    /// Page 0 of the KV pages; page `p` is at `pages + p * tokens_per_page * bytes_per_token`.
    pub pages: u64,
}

fn paged_status(e: &PagedError) -> c_int {
    use PagedError::*;
    match e {
        InvalidConfig(_) => super::MB_ERR_INVALID_ARGUMENT,
        UnknownSequence(_) => MB_ERR_UNKNOWN_SEQUENCE,
        FreedSequence { .. } | DoubleFree(_) | ForkOfFreed(_) => MB_ERR_FREED_SEQUENCE,
        SequenceTooLong { .. }
        | OutOfPages { .. }
        | TooManySequences { .. }
        | StepTooLarge { .. } => MB_ERR_CAPACITY,
        BadTruncate { .. } | ForkOfUncommitted(_) => MB_ERR_INVALID_REQUEST,
        StreamCapture { .. } => super::MB_ERR_STREAM_CAPTURE,
        Device(_) | Poisoned(_) => MB_ERR_DRIVER,
        Alloc(e) => status_of(e),
    }
}

impl From<PagedError> for Failure {
    fn from(e: PagedError) -> Self {
        Failure { status: paged_status(&e), message: e.to_string() }
    }
}

/// The pool behind a handle.
///
/// # Safety
/// `p` is NULL or a live handle from `mb_paged_create`, used by no other thread now.
unsafe fn pool<'a>(p: *mut mb_paged) -> Result<&'a mut PagedPool<'static>, Failure> {
    // SAFETY: by the caller's contract a non-NULL `p` is a live, unshared `Box<mb_paged>`.
    match unsafe { p.as_mut() } {
        Some(p) => Ok(&mut p.inner),
        None => Err(Failure::null("pool")),
    }
}

/// Creates a paged pool of shape `*cfg` on `alloc`, updated on `stream` (a `CUstream`, NULL
/// for the default stream), and stores it in `*out`. On the CUDA backend this compiles the
/// table kernels with NVRTC (libnvrtc must be loadable).
///
/// # Safety
/// `alloc` is NULL or a live handle, which must outlive the pool; `cfg` is NULL or valid;
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_create(
    alloc: *mut mb_allocator,
    cfg: *const mb_paged_config,
    stream: *mut c_void,
    out: *mut *mut mb_paged,
) -> c_int {
    call(|| {
        // SAFETY: `alloc` is NULL or a live handle that outlives the pool (caller's contract),
        // so extending the borrow to the pool's life is sound.
        let a = unsafe { allocator(alloc) }?;
        // SAFETY: NULL or a valid `mb_paged_config`, copied out.
        let c = unsafe { cfg.as_ref() }.ok_or_else(|| Failure::null("cfg"))?;
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let bytes_per_token = usize::try_from(c.bytes_per_token)
            .map_err(|_| Failure::invalid("bytes_per_token does not fit this platform"))?;
        let config = PagedConfig {
            tokens_per_page: c.tokens_per_page,
            bytes_per_token,
            max_pages: c.max_pages,
            max_seqs: c.max_seqs,
            max_pages_per_seq: c.max_pages_per_seq,
            max_step_tokens: c.max_step_tokens,
        };
        let inner = PagedPool::new(a, config, StreamHandle(stream as u64))?;
        let handle = Box::into_raw(Box::new(mb_paged { inner }));
        // SAFETY: `out` is non-NULL and valid for a write (caller's contract).
        unsafe { write_out(out, "out", handle) }
    })
}

/// Destroys a pool: its tables and pages go back to the allocator in its stream's order. NULL
/// does nothing.
///
/// # Safety
/// `p` is NULL or a live handle that no other call uses now or later.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_destroy(p: *mut mb_paged) -> c_int {
    call(|| {
        if !p.is_null() {
            // SAFETY: a live handle from `mb_paged_create`, unused from now on.
            drop(unsafe { Box::from_raw(p) });
        }
        Ok(())
    })
}

/// Adds a sequence of `prompt_len` tokens (they get slots this step); its id goes to `*out_seq`.
///
/// # Safety
/// `p` is NULL or a live handle; `out_seq` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_add(
    p: *mut mb_paged,
    prompt_len: u32,
    out_seq: *mut u64,
) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        let pool = unsafe { pool(p) }?;
        if out_seq.is_null() {
            return Err(Failure::null("out_seq"));
        }
        let s = pool.add(prompt_len)?;
        // SAFETY: non-NULL and valid (caller's contract).
        unsafe { write_out(out_seq, "out_seq", s.0) }
    })
}

/// Adds `n` tokens to sequence `seq` (they get slots this step).
///
/// # Safety
/// `p` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_extend(p: *mut mb_paged, seq: u64, n: u32) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        unsafe { pool(p) }?.extend(SeqId(seq), n)?;
        Ok(())
    })
}

/// Forks `parent`: the child shares its pages (copy-on-write); its id goes to `*out_child`.
///
/// # Safety
/// `p` is NULL or a live handle; `out_child` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_fork(
    p: *mut mb_paged,
    parent: u64,
    out_child: *mut u64,
) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        let pool = unsafe { pool(p) }?;
        if out_child.is_null() {
            return Err(Failure::null("out_child"));
        }
        let c = pool.fork(SeqId(parent))?;
        // SAFETY: non-NULL and valid (caller's contract).
        unsafe { write_out(out_child, "out_child", c.0) }
    })
}

/// Shortens `seq` to `new_len` tokens.
///
/// # Safety
/// `p` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_truncate(p: *mut mb_paged, seq: u64, new_len: u32) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        unsafe { pool(p) }?.truncate(SeqId(seq), new_len)?;
        Ok(())
    })
}

/// Frees `seq`.
///
/// # Safety
/// `p` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_free(p: *mut mb_paged, seq: u64) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        unsafe { pool(p) }?.free(SeqId(seq))?;
        Ok(())
    })
}

/// Shared body of the two commits.
///
/// # Safety
/// As for `mb_paged_commit`.
unsafe fn commit(p: *mut mb_paged, decode: bool, out_tokens: *mut u32) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        let pool = unsafe { pool(p) }?;
        let d = if decode { pool.decode_step()? } else { pool.commit_step()? };
        let n = d.step_tokens();
        if !out_tokens.is_null() {
            // SAFETY: non-NULL and valid (caller's contract).
            unsafe { write_out(out_tokens, "out_tokens", n) }?;
        }
        Ok(())
    })
}

/// Commits the step: launches the kernels that update the tables on the pool's stream (no host
/// synchronisation). Stores the step's slot-mapping length in `*out_tokens` unless NULL.
///
/// # Safety
/// `p` is NULL or a live handle; `out_tokens` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_commit(p: *mut mb_paged, out_tokens: *mut u32) -> c_int {
    // SAFETY: passed on.
    unsafe { commit(p, false, out_tokens) }
}

/// Extends every live sequence by one token and commits the step (decode tokens come after
/// the explicit ones in the slot mapping, in `batch_rows` order).
///
/// # Safety
/// As for `mb_paged_commit`.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_decode_step(p: *mut mb_paged, out_tokens: *mut u32) -> c_int {
    // SAFETY: passed on.
    unsafe { commit(p, true, out_tokens) }
}

/// Stores the block-table row of live sequence `seq` in `*out_row`.
///
/// # Safety
/// `p` is NULL or a live handle; `out_row` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_row(p: *mut mb_paged, seq: u64, out_row: *mut u32) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        let row = unsafe { pool(p) }?.row(SeqId(seq))?;
        // SAFETY: caller's contract.
        unsafe { write_out(out_row, "out_row", row) }
    })
}

/// Stores the token count of live sequence `seq` in `*out_len`.
///
/// # Safety
/// `p` is NULL or a live handle; `out_len` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_len(p: *mut mb_paged, seq: u64, out_len: *mut u32) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        let n = unsafe { pool(p) }?.len(SeqId(seq))?;
        // SAFETY: caller's contract.
        unsafe { write_out(out_len, "out_len", n) }
    })
}

/// Stores the device addresses of the tables and pages in `*out`.
///
/// # Safety
/// `p` is NULL or a live handle; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_get_tables(p: *mut mb_paged, out: *mut mb_paged_tables) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        let t = unsafe { pool(p) }?.pointers();
        let v = mb_paged_tables {
            block_table: t.block_table,
            seq_lens: t.seq_lens,
            batch_rows: t.batch_rows,
            slot_mapping: t.slot_mapping,
            pages: t.pages,
        };
        // SAFETY: caller's contract.
        unsafe { write_out(out, "out", v) }
    })
}

/// Gives back committed pool memory above the highest page in use; the bytes released go to
/// `*out_bytes` unless NULL.
///
/// # Safety
/// `p` is NULL or a live handle; `out_bytes` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mb_paged_shrink(p: *mut mb_paged, out_bytes: *mut u64) -> c_int {
    call(|| {
        // SAFETY: caller's contract.
        let n = unsafe { pool(p) }?.shrink()?;
        if !out_bytes.is_null() {
            // SAFETY: caller's contract.
            unsafe { write_out(out_bytes, "out_bytes", n) }?;
        }
        Ok(())
    })
}
