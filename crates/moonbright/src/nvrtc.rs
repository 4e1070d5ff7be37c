//! Run-time compilation of CUDA C to PTX with NVRTC, called through the handle `crate::libs`
//! finds (where `MOONBRIGHT_NVRTC` says, pip's `nvidia-cuda-nvrtc` under the Python package,
//! or the loader path), failing with a message, never a panic, when libnvrtc is missing or the
//! source does not compile. Used by the paged pool's kernels (`moonbright-paged`) and by the GPU
//! benchmarks.
//!
//! The calls are the seven of NVRTC's C API a compile needs, resolved from that handle: cudarc
//! finds libnvrtc by names that miss CUDA 13's `libnvrtc.so.13`, and not where pip puts it.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use libloading::os::unix::{Library, Symbol};

/// `nvrtcProgram`: an opaque handle.
type Program = *mut c_void;
/// `nvrtcResult`: 0 is success.
type Status = c_int;

/// The NVRTC functions a compile uses.
struct Api<'a> {
    lib: &'a Library,
}

impl Api<'_> {
    /// The function `name` of libnvrtc, with the C signature `F`.
    ///
    /// # Safety
    /// `F` is the function pointer type of `name`'s declaration in nvrtc.h.
    unsafe fn get<F>(&self, name: &str) -> Result<Symbol<F>, String> {
        // SAFETY: the caller gives `name`'s true signature as `F`; the library stays loaded for
        // the life of the process (`crate::libs::libnvrtc`), so the symbol cannot dangle.
        unsafe { self.lib.get(name.as_bytes()) }
            .map_err(|e| format!("libnvrtc has no {name} ({e}); is it NVRTC?"))
    }

    /// NVRTC's text for `status`.
    fn error_string(&self, status: Status) -> String {
        // SAFETY: nvrtc.h declares `const char* nvrtcGetErrorString(nvrtcResult)`.
        let f = unsafe {
            self.get::<unsafe extern "C" fn(Status) -> *const c_char>("nvrtcGetErrorString")
        };
        match f {
            // SAFETY: it returns a static NUL-terminated string (or NULL, checked).
            Ok(f) => match unsafe { f(status) } {
                p if p.is_null() => format!("NVRTC error {status}"),
                // SAFETY: a non-NULL result is a static NUL-terminated string.
                p => unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned(),
            },
            Err(_) => format!("NVRTC error {status}"),
        }
    }

    fn check(&self, what: &str, status: Status) -> Result<(), String> {
        match status {
            0 => Ok(()),
            s => Err(format!("{what} failed: {}", self.error_string(s))),
        }
    }
}

/// The version of the libnvrtc found, as (major, minor).
pub fn version() -> Result<(i32, i32), String> {
    let api = Api { lib: crate::libs::libnvrtc()? };
    // SAFETY: nvrtc.h declares `nvrtcResult nvrtcVersion(int* major, int* minor)`.
    let f = unsafe {
        api.get::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status>("nvrtcVersion")
    }?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are live locals.
    api.check("nvrtcVersion", unsafe { f(&mut major, &mut minor) })?;
    Ok((major, minor))
}

/// Compiles `src` (named `name` in NVRTC's messages) with NVRTC's `options` to PTX.
pub fn compile_ptx(src: &str, name: &str, options: Vec<String>) -> Result<String, String> {
    let api = Api { lib: crate::libs::libnvrtc()? };
    let c_src = CString::new(src).map_err(|_| format!("{name}: the source holds a NUL byte"))?;
    let c_name = CString::new(name).map_err(|_| format!("{name}: the name holds a NUL byte"))?;
    let c_opts = options
        .iter()
        .map(|o| CString::new(o.as_str()).map_err(|_| format!("option {o:?} holds a NUL byte")))
        .collect::<Result<Vec<_>, _>>()?;
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();

    type Create = unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status;
    type Compile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
    type Size = unsafe extern "C" fn(Program, *mut usize) -> Status;
    type Read = unsafe extern "C" fn(Program, *mut c_char) -> Status;
    type Destroy = unsafe extern "C" fn(*mut Program) -> Status;
    // SAFETY: each type is the signature nvrtc.h declares for that name.
    let (create, compile, ptx_size, ptx, log_size, log, destroy) = unsafe {
        (
            api.get::<Create>("nvrtcCreateProgram")?,
            api.get::<Compile>("nvrtcCompileProgram")?,
            api.get::<Size>("nvrtcGetPTXSize")?,
            api.get::<Read>("nvrtcGetPTX")?,
            api.get::<Size>("nvrtcGetProgramLogSize")?,
            api.get::<Read>("nvrtcGetProgramLog")?,
            api.get::<Destroy>("nvrtcDestroyProgram")?,
        )
    };

    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: `prog` is a live local; the source and name are NUL-terminated and outlive the
    // call; no headers are passed (0 and NULLs).
    let status = unsafe {
        create(&mut prog, c_src.as_ptr(), c_name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
    };
    api.check("nvrtcCreateProgram", status)?;

    /// Reads one of the program's outputs (the PTX or the log) through its size and copy calls.
    fn read(prog: Program, size: &Symbol<Size>, copy: &Symbol<Read>) -> Result<String, Status> {
        let mut n = 0usize;
        // SAFETY: `prog` is a live program; `n` a live local.
        match unsafe { size(prog, &mut n) } {
            0 => {}
            s => return Err(s),
        }
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it writes (the NUL included).
        match unsafe { copy(prog, buf.as_mut_ptr().cast()) } {
            0 => {}
            s => return Err(s),
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        buf.truncate(end);
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    // SAFETY: `prog` is live; the options are NUL-terminated strings that outlive the call,
    // `opt_ptrs.len()` of them.
    let status = unsafe { compile(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    let result = if status == 0 {
        read(prog, &ptx_size, &ptx)
            .map_err(|s| format!("reading {name}'s PTX: {}", api.error_string(s)))
    } else {
        let log = read(prog, &log_size, &log).unwrap_or_default();
        Err(format!("NVRTC failed to compile {name}: {}\n{log}", api.error_string(status)))
    };
    // SAFETY: `prog` came from nvrtcCreateProgram and is destroyed once, here.
    let _ = unsafe { destroy(&mut prog) };
    result
}

#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;

    /// With libnvrtc found (scripts/test.sh provides one), a good source compiles and a bad one
    /// fails with NVRTC's log; without it, both say where it was looked for, and the compile is
    /// a skipped GPU test (counted; a failure under `MOONBRIGHT_REQUIRE_GPU=1`).
    #[test]
    fn compiles_or_says_why_not() {
        let good = "extern \"C\" __global__ void mb_probe(int* x) { x[threadIdx.x] = 1; }";
        let bad = "extern \"C\" __global__ void mb_probe(int* x) { x[threadIdx.x] = nope; }";
        let opts = || vec!["--gpu-architecture=compute_80".to_string()];
        if !crate::libs::libnvrtc_present() {
            let e = compile_ptx(good, "probe.cu", opts()).unwrap_err();
            assert!(e.contains("libnvrtc not found") && e.contains("MOONBRIGHT_NVRTC"), "{e}");
            assert!(version().is_err());
            crate::testing::skip(&e);
            return;
        }
        let (major, _) = version().unwrap();
        assert!(major >= 11, "NVRTC {major}");
        let ptx = compile_ptx(good, "probe.cu", opts()).unwrap_or_else(|e| panic!("{e}"));
        assert!(ptx.contains(".entry mb_probe"), "{ptx}");
        let e = compile_ptx(bad, "probe.cu", opts()).unwrap_err();
        assert!(e.contains("NVRTC failed to compile probe.cu") && e.contains("nope"), "{e}");
        assert!(compile_ptx("x\0y", "probe.cu", opts()).unwrap_err().contains("NUL"));
    }
}
