//! [`Backend`]: the driver an allocator runs on, CUDA or the host model, chosen at run time
//! (`Options::open_backend`). Its impls of the contract's traits are generated from their
//! forwarding lists (`forward_calls!`): a `match`, so each call is a static one.

use super::cuda::CudaDriver;
use super::host::HostDriver;

/// The backends MoonBright can run on.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per allocator; boxing buys nothing
pub enum Backend {
    /// The CUDA driver.
    Cuda(CudaDriver),
    /// The CPU model.
    Host(HostDriver),
}

impl Backend {
    /// The host backend, if this is it (for its test hooks).
    pub fn as_host(&self) -> Option<&HostDriver> {
        match self {
            Backend::Host(h) => Some(h),
            Backend::Cuda(_) => None,
        }
    }
}
