//! Run-time compilation of the benchmark kernels with NVRTC (cudarc, libnvrtc loaded at run
//! time), with a clear error when libnvrtc is not on the loader path.

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use crate::Res;

/// Compiles `src` to PTX for compute capability `cc`.
pub fn compile(src: &str, cc: (i32, i32)) -> Res<String> {
    // SAFETY: only tries to dlopen libnvrtc under each candidate name and drops it again.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        let mut names = cudarc::get_lib_name_candidates("nvrtc");
        names.sort();
        names.dedup();
        return Err(format!(
            "libnvrtc not found on the loader path (tried {}); put the directory of \
             libnvrtc.so* on LD_LIBRARY_PATH, with a libnvrtc.so link if only libnvrtc.so.13 \
             exists (bench/run-h200.sh does this)",
            names.join(", ")
        ));
    }
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{}{}", cc.0, cc.1)],
        ..Default::default()
    };
    let out = catch_unwind(AssertUnwindSafe(|| compile_ptx_with_opts(src, opts)));
    match out {
        Ok(Ok(ptx)) => Ok(ptx.to_src()),
        Ok(Err(e)) => Err(format!("NVRTC compilation failed: {e:?}")),
        Err(_) => Err("NVRTC panicked (libnvrtc lacks a symbol cudarc needs?)".into()),
    }
}
