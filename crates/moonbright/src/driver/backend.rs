//! [`Backend`]: the driver an allocator runs on, CUDA or the host model, chosen at run time from
//! [`Options`]. Its impls of the contract's traits are generated from their forwarding lists
//! (`forward_calls!`): a `match`, so each call is a static one.

use crate::config::{BackendKind, Options};
use crate::error::{Error, Result};

use super::cuda::{self, CudaDriver};
use super::host::{HostConfig, HostDriver};
use super::DriverError;

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
    /// Opens the backend `options` ask for; `Auto` takes CUDA when a GPU is present.
    pub fn open(options: &Options) -> Result<Backend> {
        let host = || {
            HostDriver::new(HostConfig {
                page_size: options.host_page_size,
                capacity: options.host_capacity,
                costs: options.host_driver_costs,
            })
            .map(Backend::Host)
            .map_err(Error::from)
        };
        let cuda = || {
            let d = CudaDriver::new(options.device)?;
            d.set_shareable(options.ipc);
            Ok(Backend::Cuda(d))
        };
        match options.backend {
            BackendKind::Host => host(),
            BackendKind::Cuda => {
                cuda().map_err(|e: DriverError| Error::NoBackend(format!("cuda backend: {e}")))
            }
            BackendKind::Auto => match cuda::probe() {
                Ok(_) => cuda().map_err(Error::from),
                Err(_) => host(),
            },
        }
    }

    /// The host backend, if this is it (for its test hooks).
    pub fn as_host(&self) -> Option<&HostDriver> {
        match self {
            Backend::Host(h) => Some(h),
            Backend::Cuda(_) => None,
        }
    }
}
