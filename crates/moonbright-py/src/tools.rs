//! The rest: PyTorch's OOM exception type, the `moonbright` command, and NVRTC.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use pyo3::prelude::*;

use crate::{lock, panic_message, py_err};

extern "C" {
    fn moonbright_cxx_set_oom_type(ty: *mut c_void);
}

/// Registers the Python exception class (torch.OutOfMemoryError) that `moonbright_torch_alloc`
/// raises on out of memory; None switches back to RuntimeError. The class is kept alive.
#[pyfunction]
#[pyo3(signature = (cls))]
pub(crate) fn _set_torch_oom_type(cls: Option<Bound<'_, PyAny>>) -> PyResult<()> {
    static KEEP: Mutex<Option<Py<PyAny>>> = Mutex::new(None);
    let ptr = cls.as_ref().map(|c| c.as_ptr() as *mut c_void).unwrap_or(std::ptr::null_mut());
    *lock(&KEEP) = cls.map(|c| c.unbind());
    // SAFETY: stores a pointer; the object stays alive in KEEP until replaced, and replacing
    // happens only after the pointer was swapped out here.
    unsafe { moonbright_cxx_set_oom_type(ptr) };
    Ok(())
}

/// Runs the `moonbright` command (`moonbright.cli`, the console script pip installs) with
/// `argv` (its first item the program's name) and returns its exit status: the same code as
/// the `moonbright` binary cargo builds (crates/moonbright-cli), without the GIL.
#[pyfunction]
pub(crate) fn cli_main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> i32 {
    py.allow_threads(|| {
        catch_unwind(AssertUnwindSafe(|| moonbright_cli::run(argv))).unwrap_or_else(|p| {
            eprintln!("moonbright: internal error (panic): {}", panic_message(&*p));
            101
        })
    })
}

/// The version of the libnvrtc MoonBright finds (where `MOONBRIGHT_NVRTC` says, which the
/// package points at pip's `nvidia-cuda-nvrtc`, else on the loader path), as (major, minor).
/// Raises RuntimeError saying where it looked when there is none. The paged pool compiles its
/// kernels with it.
#[pyfunction]
pub(crate) fn nvrtc_version() -> PyResult<(i32, i32)> {
    moonbright::nvrtc::version().map_err(py_err)
}

/// Compiles CUDA C `src` to PTX with that libnvrtc (for tests; no GPU needed).
#[pyfunction]
#[pyo3(signature = (src, name="moonbright.cu", options=Vec::new()))]
pub(crate) fn _nvrtc_compile(
    py: Python<'_>,
    src: &str,
    name: &str,
    options: Vec<String>,
) -> PyResult<String> {
    py.allow_threads(|| moonbright::nvrtc::compile_ptx(src, name, options)).map_err(py_err)
}
