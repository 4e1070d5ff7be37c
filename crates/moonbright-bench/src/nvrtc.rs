//! Run-time compilation of the benchmark kernels: the core's NVRTC wrapper
//! (`moonbright::nvrtc`), for one compute capability.

use crate::Res;

/// Compiles `src` to PTX for compute capability `cc`.
pub fn compile(src: &str, cc: (i32, i32)) -> Res<String> {
    let arch = format!("--gpu-architecture=compute_{}{}", cc.0, cc.1);
    moonbright::nvrtc::compile_ptx(src, "moonbright_bench.cu", vec![arch])
}
