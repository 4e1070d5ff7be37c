//! Run-time compilation of CUDA C to PTX with NVRTC (libnvrtc loaded at run time through
//! cudarc), failing with a message, never a panic, when libnvrtc is missing or the source does
//! not compile. Used by the paged pool's kernels and by the GPU benchmarks.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Compiles `src` (named `name` in NVRTC's messages) with NVRTC's `options` to PTX.
pub fn compile_ptx(src: &str, name: &str, options: Vec<String>) -> Result<String, String> {
    if !crate::libs::libnvrtc_present() {
        let mut names = cudarc::get_lib_name_candidates("nvrtc");
        names.sort();
        names.dedup();
        return Err(format!(
            "libnvrtc not found on the loader path (tried {}); put the directory of libnvrtc.so \
             on LD_LIBRARY_PATH (a CUDA 13 install may need a libnvrtc.so link to \
             libnvrtc.so.13: scripts/nvrtc-env.sh makes one)",
            names.join(", ")
        ));
    }
    let co =
        cudarc::nvrtc::CompileOptions { options, name: Some(name.into()), ..Default::default() };
    match catch_unwind(AssertUnwindSafe(|| cudarc::nvrtc::compile_ptx_with_opts(src, co))) {
        Ok(Ok(ptx)) => Ok(ptx.to_src()),
        Ok(Err(e)) => Err(format!("NVRTC failed to compile {name}: {e:?}")),
        Err(_) => Err("NVRTC panicked (libnvrtc lacks a symbol cudarc needs?)".into()),
    }
}
