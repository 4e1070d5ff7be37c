//! `moonbright._moonbright.PagedPool`: the paged KV pool for Python, on the process-wide
//! allocator of a device. Requests map to the Rust pool one to one; errors become the Python
//! exceptions below (a refused request changes nothing). `python/moonbright/paged.py` wraps it
//! with tensors over the tables and pages.

use moonbright::StreamHandle;
use moonbright_paged::{PagedConfig, PagedError, PagedPool as Pool, SeqId};
use std::sync::{Mutex, MutexGuard};

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

create_exception!(_moonbright, PagedPoolError, PyRuntimeError, "A refused paged-pool request.");
create_exception!(
    _moonbright,
    UnknownSequenceError,
    PagedPoolError,
    "A sequence id the pool never made."
);
create_exception!(
    _moonbright,
    FreedSequenceError,
    PagedPoolError,
    "A request on a freed sequence (a double free, a fork of a freed sequence, ...)."
);
create_exception!(
    _moonbright,
    CapacityError,
    PagedPoolError,
    "A capacity would be exceeded: sequence length, pages, rows or step tokens."
);
create_exception!(
    _moonbright,
    InvalidRequestError,
    PagedPoolError,
    "A request invalid as asked (bad truncate, fork of uncommitted tokens, bad config)."
);

fn err(e: PagedError) -> PyErr {
    use PagedError::*;
    let m = e.to_string();
    match e {
        UnknownSequence(_) => UnknownSequenceError::new_err(m),
        FreedSequence { .. } | DoubleFree(_) | ForkOfFreed(_) => FreedSequenceError::new_err(m),
        SequenceTooLong { .. }
        | OutOfPages { .. }
        | TooManySequences { .. }
        | StepTooLarge { .. } => CapacityError::new_err(m),
        InvalidConfig(_) | BadTruncate { .. } | ForkOfUncommitted(_) => {
            InvalidRequestError::new_err(m)
        }
        StreamCapture { .. } | Device(_) | Poisoned(_) | Alloc(_) => PagedPoolError::new_err(m),
    }
}

/// Adds one sequence per prompt length; stops at the first refusal (those before it stay).
fn add_all(pool: &mut Pool<'static>, prompt_lens: Vec<u32>) -> PyResult<Vec<u64>> {
    prompt_lens.into_iter().map(|n| pool.add(n).map(|s| s.0).map_err(err)).collect()
}

/// Frees every sequence; stops at the first refusal (those before it stay freed).
fn free_all(pool: &mut Pool<'static>, seqs: Vec<u64>) -> PyResult<()> {
    seqs.into_iter().try_for_each(|s| pool.free(SeqId(s)).map_err(err))
}

/// A paged KV pool on the allocator of `device`, updated on `stream` (a `CUstream` as an int,
/// 0 for the default stream). One thread at a time uses it.
#[pyclass(module = "moonbright._moonbright")]
pub struct PagedPool {
    // The Python object may be shared between threads; the pool is driven by one at a time.
    inner: Mutex<Pool<'static>>,
}

impl PagedPool {
    fn pool(&self) -> MutexGuard<'_, Pool<'static>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PagedPool {
    #[new]
    #[pyo3(signature = (tokens_per_page, bytes_per_token, max_pages, max_seqs, max_pages_per_seq, max_step_tokens, stream=0, device=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        tokens_per_page: u32,
        bytes_per_token: usize,
        max_pages: u32,
        max_seqs: u32,
        max_pages_per_seq: u32,
        max_step_tokens: u32,
        stream: u64,
        device: Option<i32>,
    ) -> PyResult<Self> {
        let a = crate::get(device)?;
        let cfg = PagedConfig {
            tokens_per_page,
            bytes_per_token,
            max_pages,
            max_seqs,
            max_pages_per_seq,
            max_step_tokens,
        };
        let inner = Pool::new(a, cfg, StreamHandle(stream)).map_err(err)?;
        Ok(PagedPool { inner: Mutex::new(inner) })
    }

    /// Adds a sequence of `prompt_len` tokens (they get slots this step); returns its id.
    #[pyo3(signature = (prompt_len=0))]
    fn add(&mut self, prompt_len: u32) -> PyResult<u64> {
        self.pool().add(prompt_len).map(|s| s.0).map_err(err)
    }

    /// Adds one sequence per prompt length; stops at the first refusal (those before it stay).
    fn add_many(&mut self, prompt_lens: Vec<u32>) -> PyResult<Vec<u64>> {
        add_all(&mut self.pool(), prompt_lens)
    }

    /// Adds `n` tokens to `seq` (they get slots this step).
    fn extend(&mut self, seq: u64, n: u32) -> PyResult<()> {
        self.pool().extend(SeqId(seq), n).map_err(err)
    }

    /// A new sequence sharing `seq`'s pages, copy-on-write.
    fn fork(&mut self, seq: u64) -> PyResult<u64> {
        self.pool().fork(SeqId(seq)).map(|s| s.0).map_err(err)
    }

    /// Shortens `seq` to `new_len` tokens.
    fn truncate(&mut self, seq: u64, new_len: u32) -> PyResult<()> {
        self.pool().truncate(SeqId(seq), new_len).map_err(err)
    }

    /// Frees `seq`.
    fn free(&mut self, seq: u64) -> PyResult<()> {
        self.pool().free(SeqId(seq)).map_err(err)
    }

    /// Frees every sequence of `seqs`; stops at the first refusal (those before it stay freed).
    fn free_many(&mut self, seqs: Vec<u64>) -> PyResult<()> {
        free_all(&mut self.pool(), seqs)
    }

    /// One decode step in one call: frees `free`, adds a sequence per prompt length of `add`,
    /// gives every live sequence its decode token and commits (`free_many`, `add_many`,
    /// `decode_step`). Returns the new sequences' ids. A refusal stops it where it happened:
    /// what came before stays done, not yet committed.
    #[pyo3(signature = (free=Vec::new(), add=Vec::new()))]
    fn step(&mut self, free: Vec<u64>, add: Vec<u32>) -> PyResult<Vec<u64>> {
        let mut pool = self.pool();
        free_all(&mut pool, free)?;
        let ids = add_all(&mut pool, add)?;
        pool.decode_step().map_err(err)?;
        Ok(ids)
    }

    /// Commits the step (kernels on the stream, no host wait); returns its token count.
    fn commit(&mut self) -> PyResult<u32> {
        self.pool().commit_step().map(|d| d.step_tokens()).map_err(err)
    }

    /// Extends every live sequence by one token and commits; returns the step's token count.
    fn decode_step(&mut self) -> PyResult<u32> {
        self.pool().decode_step().map(|d| d.step_tokens()).map_err(err)
    }

    /// The block-table row of `seq`.
    fn row(&self, seq: u64) -> PyResult<u32> {
        self.pool().row(SeqId(seq)).map_err(err)
    }

    /// The token count of `seq`.
    fn seq_len(&self, seq: u64) -> PyResult<u32> {
        self.pool().len(SeqId(seq)).map_err(err)
    }

    /// The pages of `seq`, in order.
    fn pages(&self, seq: u64) -> PyResult<Vec<u32>> {
        self.pool().pages(SeqId(seq)).map(|p| p.to_vec()).map_err(err)
    }

    /// The batch's rows in decode-token order.
    fn batch(&self) -> Vec<u32> {
        self.pool().batch().to_vec()
    }

    /// The live sequence in `row`, or None.
    fn seq_at(&self, row: u32) -> Option<u64> {
        self.pool().seq_at(row).map(|s| s.0)
    }

    /// Token count of the last step's slot mapping.
    fn step_tokens(&self) -> u32 {
        self.pool().last_delta().step_tokens()
    }

    /// Sequences alive now.
    fn live_sequences(&self) -> u32 {
        self.pool().live_sequences()
    }

    /// Pages held now.
    fn pages_in_use(&self) -> u32 {
        self.pool().pages_in_use()
    }

    /// Bytes of page memory committed now.
    fn committed_bytes(&self) -> usize {
        self.pool().committed_bytes()
    }

    /// Gives back committed page memory above the highest page in use; returns the bytes.
    fn shrink(&mut self) -> PyResult<u64> {
        self.pool().shrink().map_err(err)
    }

    /// Waits on the host for the pool's queued updates (tests and tools).
    fn synchronize(&self) -> PyResult<()> {
        self.pool().synchronize().map_err(err)
    }

    /// Whether kernels update the tables (CUDA backend).
    fn on_device(&self) -> bool {
        self.pool().on_device()
    }

    /// Checks the host metadata's invariants; raises naming a broken one.
    fn check_invariants(&self) -> PyResult<()> {
        self.pool().check_invariants().map_err(PagedPoolError::new_err)
    }

    /// The device addresses of the tables and pages, and the shape.
    fn layout(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let pool = self.pool();
        let p = pool.pointers();
        let c = pool.config();
        let d = PyDict::new(py);
        d.set_item("block_table", p.block_table)?;
        d.set_item("seq_lens", p.seq_lens)?;
        d.set_item("batch_rows", p.batch_rows)?;
        d.set_item("slot_mapping", p.slot_mapping)?;
        d.set_item("pages", p.pages)?;
        d.set_item("tokens_per_page", c.tokens_per_page)?;
        d.set_item("bytes_per_token", c.bytes_per_token)?;
        d.set_item("page_bytes", c.page_bytes())?;
        d.set_item("max_pages", c.max_pages)?;
        d.set_item("max_seqs", c.max_seqs)?;
        d.set_item("max_pages_per_seq", c.max_pages_per_seq)?;
        d.set_item("max_step_tokens", c.max_step_tokens)?;
        d.set_item("stream", pool.stream().0)?;
        Ok(d.unbind())
    }
}

/// Adds the pool and its exceptions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PagedPool>()?;
    m.add("PagedPoolError", py.get_type::<PagedPoolError>())?;
    m.add("UnknownSequenceError", py.get_type::<UnknownSequenceError>())?;
    m.add("FreedSequenceError", py.get_type::<FreedSequenceError>())?;
    m.add("CapacityError", py.get_type::<CapacityError>())?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    Ok(())
}
