//! Python stack frames for allocation history (`record_memory_history(context=...)`), in the
//! `frames` lists of PyTorch's snapshot format, so that its memory viewer shows who allocated.
//!
//! The allocation entry points run in C++ (PyTorch's pluggable allocator) or behind ctypes,
//! usually with the GIL released but on a thread whose Python frames are still there. With
//! stacks on, an entry point takes the GIL (as PyTorch's own `CapturedTraceback` does), reads
//! the calling thread's frames, interns them under an id, and attaches the id to the history
//! events of its request (`moonbright::core::history::with_context`) and to the block it hands
//! out. With stacks off, the cost is one atomic load per allocation and free.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Once};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::lock;

/// Which requests get frames: none, allocations, or allocations and frees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Off = 0,
    Alloc = 1,
    All = 2,
}

impl Mode {
    /// PyTorch's `context` argument of `_record_memory_history`: None (no frames), "state" or
    /// "alloc" (frames of allocations), "all" (of frees too).
    pub(crate) fn parse(context: Option<&str>) -> Result<Mode, String> {
        match context {
            None => Ok(Mode::Off),
            Some("state") | Some("alloc") => Ok(Mode::Alloc),
            Some("all") => Ok(Mode::All),
            Some(other) => {
                Err(format!("context must be None, \"state\", \"alloc\" or \"all\", not {other:?}"))
            }
        }
    }
}

static MODE: AtomicU8 = AtomicU8::new(Mode::Off as u8);
/// Whether any live block has frames noted, so frees look them up only then.
static LIVE_NOTED: AtomicBool = AtomicBool::new(false);
/// Frames deeper than this are left out.
const MAX_DEPTH: usize = 128;

/// One Python frame, as PyTorch's snapshots give it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Frame {
    pub filename: String,
    pub line: i64,
    pub name: String,
}

/// Interned stacks and the frames of live blocks.
#[derive(Default)]
struct Table {
    /// Id -> frames, innermost first. Ids are never reused, so a stale one finds nothing.
    stacks: HashMap<u64, Arc<[Frame]>>,
    ids: HashMap<Arc<[Frame]>, u64>,
    next: u64,
    /// (device, address) of a live block -> the id of the stack that allocated it.
    live: HashMap<(usize, u64), u64>,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

/// Switches frames on or off (off also forgets every stack, `clear`). The first switch on
/// registers an `atexit` handler that switches them off, so that no thread takes the GIL while
/// the interpreter is finalising.
pub(crate) fn set_mode(py: Python<'_>, mode: Mode) -> PyResult<()> {
    if mode != Mode::Off {
        static AT_EXIT: Once = Once::new();
        let mut registered: PyResult<()> = Ok(());
        AT_EXIT.call_once(|| {
            registered = (|| {
                let off = pyo3::wrap_pyfunction!(stop_stacks, py)?;
                py.import("atexit")?.call_method1("register", (off,))?;
                Ok(())
            })();
        });
        registered?;
    }
    MODE.store(mode as u8, Ordering::Release);
    if mode == Mode::Off {
        clear();
    }
    Ok(())
}

/// Forgets every stack and the frames of live blocks.
pub(crate) fn clear() {
    let mut t = lock(&TABLE);
    if let Some(t) = t.as_mut() {
        t.stacks.clear();
        t.ids.clear();
        t.live.clear();
    }
    LIVE_NOTED.store(false, Ordering::Release);
}

/// Switches stack recording off (registered with `atexit`).
#[pyfunction]
fn stop_stacks() {
    MODE.store(Mode::Off as u8, Ordering::Release);
}

fn mode() -> u8 {
    MODE.load(Ordering::Acquire)
}

/// The id of the calling thread's Python stack for an allocation, or 0 when frames are off or
/// cannot be read. Never panics, never raises.
pub(crate) fn for_alloc() -> u64 {
    if mode() == Mode::Off as u8 {
        return 0;
    }
    capture()
}

/// As `for_alloc`, for a free: frames only with `context="all"`.
pub(crate) fn for_free() -> u64 {
    if mode() != Mode::All as u8 {
        return 0;
    }
    capture()
}

fn capture() -> u64 {
    // SAFETY: a plain query of the interpreter's state, callable without the GIL.
    if unsafe { pyo3::ffi::Py_IsInitialized() } == 0 {
        return 0;
    }
    catch_unwind(AssertUnwindSafe(|| {
        let frames = Python::with_gil(|py| read_frames(py).ok())?;
        (!frames.is_empty()).then(|| intern(frames))
    }))
    .ok()
    .flatten()
    .unwrap_or(0)
}

/// The calling thread's Python frames, innermost first.
fn read_frames(py: Python<'_>) -> PyResult<Vec<Frame>> {
    let mut out = Vec::new();
    let mut f = py.import("sys")?.getattr("_getframe")?.call0()?;
    while !f.is_none() && out.len() < MAX_DEPTH {
        let code = f.getattr(pyo3::intern!(py, "f_code"))?;
        out.push(Frame {
            filename: code.getattr(pyo3::intern!(py, "co_filename"))?.extract()?,
            line: f.getattr(pyo3::intern!(py, "f_lineno"))?.extract().unwrap_or(0),
            name: code.getattr(pyo3::intern!(py, "co_name"))?.extract()?,
        });
        f = f.getattr(pyo3::intern!(py, "f_back"))?;
    }
    Ok(out)
}

fn intern(frames: Vec<Frame>) -> u64 {
    let mut t = lock(&TABLE);
    let t = t.get_or_insert_with(Table::default);
    let frames: Arc<[Frame]> = frames.into();
    if let Some(&id) = t.ids.get(&frames) {
        return id;
    }
    t.next += 1;
    let id = t.next;
    t.ids.insert(frames.clone(), id);
    t.stacks.insert(id, frames);
    id
}

/// Notes that the block at `addr` on `device` was allocated by stack `id` (not 0).
pub(crate) fn note_live(device: usize, addr: u64, id: u64) {
    let mut t = lock(&TABLE);
    t.get_or_insert_with(Table::default).live.insert((device, addr), id);
    LIVE_NOTED.store(true, Ordering::Release);
}

/// Forgets the frames of the block at `addr` on `device`, freed (a no-op unless some were
/// noted since the last `clear`).
pub(crate) fn forget_live(device: usize, addr: u64) {
    if !LIVE_NOTED.load(Ordering::Acquire) {
        return;
    }
    if let Some(t) = lock(&TABLE).as_mut() {
        t.live.remove(&(device, addr));
    }
}

/// Stack `id`'s frames as PyTorch's snapshots list them: `[{"filename", "line", "name"}]`.
pub(crate) fn frames<'py>(py: Python<'py>, id: u64) -> PyResult<Bound<'py, PyList>> {
    let stack = match id {
        0 => None,
        id => lock(&TABLE).as_ref().and_then(|t| t.stacks.get(&id).cloned()),
    };
    let out = PyList::empty(py);
    for f in stack.iter().flat_map(|s| s.iter()) {
        let d = PyDict::new(py);
        d.set_item("filename", &f.filename)?;
        d.set_item("line", f.line)?;
        d.set_item("name", &f.name)?;
        out.append(d)?;
    }
    Ok(out)
}

/// The frames of the live block at `addr` on `device`, as `frames`.
pub(crate) fn block_frames<'py>(
    py: Python<'py>,
    device: usize,
    addr: u64,
) -> PyResult<Bound<'py, PyList>> {
    let id = if LIVE_NOTED.load(Ordering::Acquire) {
        lock(&TABLE).as_ref().and_then(|t| t.live.get(&(device, addr)).copied()).unwrap_or(0)
    } else {
        0
    };
    frames(py, id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contexts_parse_as_pytorch_names_them() {
        assert_eq!(Mode::parse(None), Ok(Mode::Off));
        assert_eq!(Mode::parse(Some("state")), Ok(Mode::Alloc));
        assert_eq!(Mode::parse(Some("alloc")), Ok(Mode::Alloc));
        assert_eq!(Mode::parse(Some("all")), Ok(Mode::All));
        assert!(Mode::parse(Some("python")).unwrap_err().contains("\"all\""));
    }

    #[test]
    fn equal_stacks_share_an_id() {
        let f = |name: &str| Frame { filename: "x.py".into(), line: 3, name: name.into() };
        let a = intern(vec![f("a"), f("main")]);
        let b = intern(vec![f("b"), f("main")]);
        assert_ne!(a, b);
        assert_eq!(intern(vec![f("a"), f("main")]), a);
    }
}
