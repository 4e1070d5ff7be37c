//! `moonbright.Growable`: a growable allocation seen from Python. It reserves virtual capacity
//! from the device's process-wide allocator (the one serving PyTorch in global mode), commits and
//! gives back pages at its end in place, and exposes the whole capacity through
//! `__cuda_array_interface__` so `torch.as_tensor` views it without a copy.

use moonbright::{Error, StreamHandle};
use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{get, py_err};

/// The Python exception for a core error: bad input is a `ValueError`, lack of memory a
/// `MemoryError`, anything else a `RuntimeError`.
fn to_py(e: Error) -> PyErr {
    match e {
        Error::BeyondCapacity { .. }
        | Error::NotGrowable { .. }
        | Error::Released { .. }
        | Error::ZeroSize
        | Error::StreamCapture { .. } => PyValueError::new_err(e.to_string()),
        Error::OutOfMemory { .. }
        | Error::TooLarge { .. }
        | Error::AddressSpaceExhausted { .. } => PyMemoryError::new_err(e.to_string()),
        other => py_err(other.to_string()),
    }
}

/// A growable device allocation: `capacity` bytes of addresses reserved, none backed until
/// `resize`. Its address never changes. Released by `release()` or when collected (ordered on
/// the stream of its last resize).
#[pyclass(module = "moonbright")]
pub struct Growable {
    device: i32,
    ptr: u64,
    capacity: u64,
    /// The stream of the last resize: where a release by the collector is ordered.
    stream: u64,
    released: bool,
}

impl Growable {
    fn live(&self) -> PyResult<&'static moonbright::Allocator> {
        if self.released {
            return Err(PyValueError::new_err(format!(
                "growable allocation {:#x} was released; it cannot be used any more",
                self.ptr
            )));
        }
        get(Some(self.device))
    }
}

#[pymethods]
impl Growable {
    #[new]
    #[pyo3(signature = (capacity, device=None))]
    fn new(py: Python<'_>, capacity: usize, device: Option<i32>) -> PyResult<Self> {
        let a = get(device)?;
        let device = a.options().device;
        let ptr = py.allow_threads(|| a.reserve_growable(capacity)).map_err(to_py)?;
        let capacity = a.growable_info(ptr).map_or(capacity as u64, |i| i.capacity);
        Ok(Growable { device, ptr, capacity, stream: 0, released: false })
    }

    /// The device address of its first byte; never changes.
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes of addresses reserved (the requested capacity rounded up to pages).
    #[getter]
    fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes asked for by the last resize.
    #[getter]
    fn size(&self) -> PyResult<u64> {
        Ok(self.live()?.growable_info(self.ptr).map_or(0, |i| i.size))
    }

    /// Bytes backed by physical pages.
    #[getter]
    fn committed(&self) -> PyResult<u64> {
        Ok(self.live()?.growable_info(self.ptr).map_or(0, |i| i.committed))
    }

    #[getter]
    fn device(&self) -> i32 {
        self.device
    }

    #[getter]
    fn released(&self) -> bool {
        self.released
    }

    /// Grows or shrinks to `nbytes`, in place, ordered on `stream` (a `CUstream` handle as an
    /// int, e.g. `torch.cuda.current_stream().cuda_stream`; None: the default stream). Growing
    /// within the committed pages costs nothing; nothing is ever copied. Raises `ValueError`
    /// beyond the capacity, `MemoryError` when no pages are free.
    #[pyo3(signature = (nbytes, stream=None))]
    fn resize(&mut self, py: Python<'_>, nbytes: usize, stream: Option<u64>) -> PyResult<()> {
        let a = self.live()?;
        let s = stream.unwrap_or(0);
        let ptr = self.ptr;
        py.allow_threads(|| a.resize_async(ptr, nbytes, StreamHandle(s))).map_err(to_py)?;
        self.stream = s;
        Ok(())
    }

    /// Gives the pages and the addresses back, ordered on `stream` (None: the stream of the last
    /// resize). Any later use raises `ValueError`; releasing twice does nothing.
    #[pyo3(signature = (stream=None))]
    fn release(&mut self, py: Python<'_>, stream: Option<u64>) -> PyResult<()> {
        if self.released {
            return Ok(());
        }
        let a = get(Some(self.device))?;
        let s = stream.unwrap_or(self.stream);
        let ptr = self.ptr;
        py.allow_threads(|| a.free_async(ptr, StreamHandle(s))).map_err(to_py)?;
        self.released = true;
        Ok(())
    }

    /// The whole capacity as a one-dimensional uint8 array (version 3 of the interface).
    /// Device work may touch only the first `committed` bytes. Resize before viewing it: PyTorch
    /// asks the driver about the first byte, which must be mapped.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.live()?;
        let d = PyDict::new(py);
        d.set_item("shape", (self.capacity,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr, false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        match (self.released, get(Some(self.device)).ok().and_then(|a| a.growable_info(self.ptr))) {
            (false, Some(i)) => format!(
                "Growable(ptr={:#x}, size={}, committed={}, capacity={})",
                i.base, i.size, i.committed, i.capacity
            ),
            _ => format!("Growable(ptr={:#x}, released)", self.ptr),
        }
    }
}

impl Drop for Growable {
    fn drop(&mut self) {
        if !self.released {
            if let Ok(a) = get(Some(self.device)) {
                // Nowhere to report an error from a destructor; the allocator's teardown
                // accounts for anything left.
                let _ = a.free_async(self.ptr, StreamHandle(self.stream));
            }
        }
    }
}
