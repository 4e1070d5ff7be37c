//! Allocator options: what can be configured, the defaults, and validation that names the option
//! and what is allowed.

use crate::driver::cuda::CudaDriver;
use crate::driver::host::{HostConfig, HostDriver, HostDriverCosts};
use crate::driver::{self, Backend, DriverError};
use crate::error::{Error, Result};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Which driver backend to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// CUDA when a GPU is present, the host backend otherwise.
    #[default]
    Auto,
    /// The CUDA driver.
    Cuda,
    /// The CPU model of the CUDA virtual-memory API.
    Host,
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(BackendKind::Auto),
            "cuda" => Ok(BackendKind::Cuda),
            "host" => Ok(BackendKind::Host),
            other => Err(Error::InvalidOption {
                name: "backend",
                reason: format!("`{other}` is not one of auto, cuda, host"),
            }),
        }
    }
}

/// A placement policy chosen as a whole: which of held memory and allocation latency comes first
/// when a request finds no mapped memory of its size. A profile sets the tuning options below
/// (`near_fit`, `carve`, `carve_repeated`, `grow_first`); options set beside it win.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Profile {
    /// The least memory: no carving, and a request about to make new memory first records an
    /// event on its stream, so that the stream's own frees waiting for the background worker's
    /// event (`deferred_free_events`, as under PyTorch) serve it, remapped. Holds the least on
    /// every trace and on the fragmentation stress, and maps the most often.
    Memory,
    /// The default: a little memory (a budget of 0.25% of the peak in use, 1% for sizes asked
    /// for recently) spent on carving, which maps far less often in repeated steps.
    #[default]
    Balanced,
    /// Latency first: new memory in one chunk rather than stealing and remapping cached
    /// ranges while held memory stays within 30% above the peak in use (`grow_first`), which
    /// PyTorch's own allocator holds on the fragmentation stress, with its alloc p99.
    Latency,
}

impl Profile {
    pub const ALL: [Profile; 3] = [Profile::Memory, Profile::Balanced, Profile::Latency];

    /// The profile's name in `MOONBRIGHT_ALLOC_CONF` (`profile:NAME`).
    pub fn name(self) -> &'static str {
        match self {
            Profile::Memory => "memory",
            Profile::Balanced => "balanced",
            Profile::Latency => "latency",
        }
    }

    /// Sets the tuning options this profile stands for, and notes it in `opts.profile`.
    pub fn apply(self, opts: &mut Options) {
        let base = Options::default();
        opts.near_fit = base.near_fit;
        opts.carve = base.carve;
        opts.carve_repeated = base.carve_repeated;
        opts.grow_first = base.grow_first;
        match self {
            Profile::Memory => opts.carve = 0.0,
            Profile::Balanced => {}
            Profile::Latency => opts.grow_first = 0.3,
        }
        opts.profile = self;
    }
}

impl std::str::FromStr for Profile {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Profile::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| Error::InvalidOption {
            name: "profile",
            reason: format!("`{s}` is not one of memory, balanced, latency"),
        })
    }
}

/// Options of an allocator. `Options::default()` suits one process owning one GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Which backend.
    pub backend: BackendKind,
    /// CUDA device ordinal.
    pub device: i32,
    /// Cap on physical bytes held; `None`: `cap_fraction` of the device's total memory.
    pub cap_bytes: Option<u64>,
    /// Fraction of device memory usable when `cap_bytes` is `None`, in (0, 1].
    pub cap_fraction: f64,
    /// Host backend: page size (its granularity).
    pub host_page_size: usize,
    /// Host backend: bytes of simulated device memory.
    pub host_capacity: u64,
    /// Host backend: the driver costs each virtual-memory call is charged, by spinning, so that
    /// benchmarks see a GPU's times (`None`, the default, charges nothing). Time only: every
    /// call does and returns the same under each. Needs a backend other than `Cuda`.
    pub host_driver_costs: HostDriverCosts,
    /// Largest physical chunk in bytes (a power-of-two multiple of the page). Larger chunks cut
    /// set-access and unmap calls, which cost per handle; 2 MiB pages keep stitching free.
    pub max_chunk_bytes: u64,
    /// Largest new chunk for a request whose exact size a recent request had too (the sizes
    /// `carve_repeated` knows), when that request must create memory below
    /// `large_chunk_bytes`; 0 (the default): `max_chunk_bytes`, as for other sizes. A training
    /// step asks for the same sizes every step, and its memory is reused by other sizes
    /// between them: smaller chunks leave fewer pages to spare when it is stitched or carved
    /// for those, so later steps map less, while a random mix of sizes rarely repeats one and
    /// keeps its fewer handles a request. At 32 MiB, ResNet-50's later passes mapped 10-25%
    /// fewer times on the H200 and GPT-2's up to a third fewer, for as much memory or less.
    /// The price, and why it is not the default: a cold request of 33-64 MiB of a size asked
    /// for before maps two handles instead of one, 1.2-1.6x raw VMM's time where one handle
    /// meets it (docs/design.md, "Chunks for repeated sizes"). 0 or a power of two of at most
    /// 64 GiB; at or above `max_chunk_bytes` it changes nothing.
    pub max_chunk_repeated_bytes: u64,
    /// A request that must create at least this many bytes of new memory creates it in large
    /// chunks instead of chunks of `max_chunk_bytes`: a cold 1 GiB allocation maps one handle
    /// instead of 16. Smaller needs, and growable allocations, keep `max_chunk_bytes`, so
    /// stitching keeps its freedom below it. 128 MiB by default: in the fragmentation stress
    /// the requests mapped 13% fewer handles than with 1 GiB, for the same reserved memory
    /// (docs/design.md, Known limits). A power of two of at most 64 GiB; at or below
    /// `max_chunk_bytes` it changes nothing.
    pub large_chunk_bytes: u64,
    /// The largest of those large chunks: a need of `large_chunk_bytes` or more is created in
    /// chunks of the largest power of two it holds, up to this size (then one chunk of what is
    /// left), so a cold 8 GiB allocation maps one handle, as a raw `cuMemCreate` of 8 GiB
    /// would, and a large need below twice this size at most two. A chunk is mapped whole, so
    /// a large one serves a smaller request only after a release-and-recreate split
    /// (docs/design.md, Known limits). A power of two of at most 64 GiB; at or below
    /// `large_chunk_bytes`, large chunks are of exactly that size.
    pub largest_chunk_bytes: u64,
    /// Retired ranges that trigger an unmap batch.
    pub unmap_batch_ranges: usize,
    /// Retired bytes that trigger an unmap batch.
    pub unmap_batch_bytes: u64,
    /// Most chunk mappings one `cuMemUnmap` of a batch covers; between its calls the background
    /// worker's batch gives way (up to 2 ms) to requests that are mapping, since the driver
    /// serialises VMM calls. 0: runs of any length, no giving way. (On the H200 stress this
    /// changed nothing measurable; see README.)
    pub unmap_run_handles: usize,
    /// Age in microseconds at which retired ranges are unmapped even if the batch is small.
    pub unmap_batch_age_us: u64,
    /// Run the background worker: it records and polls events, unmaps retired ranges in batches,
    /// and keeps the mapped window filled. Without it, this work happens on the slow path of
    /// requests and in `flush`.
    pub background: bool,
    /// Smallest mapped window the background mapper keeps, in bytes.
    pub prefetch_window_min: u64,
    /// Largest mapped window, in bytes; 0 turns the window off (every new range maps on demand).
    /// Fresh requests of `large_chunk_bytes` to `largest_chunk_bytes` get whole window chunks
    /// of their size (docs/design.md, The background worker).
    pub prefetch_window_max: u64,
    /// Most one-page chunks the background mapper maps into the window in one step: smaller
    /// steps keep each step short, since the driver seems to serialise VMM calls across
    /// threads. (A whole chunk for large requests is one step of its own.)
    pub window_refill_pages: u64,
    /// Place new ranges at addresses an unmap batch has freed (best fit) before fresh ones at the
    /// frontier. Both are mapped nowhere, so neither can have a stale translation. On an H200 the
    /// recycled ones kept a TLB-bound kernel beside the allocation churn at 1.00x instead of
    /// 1.05x (README, interference).
    pub reuse_addresses: bool,
    /// A cached range at most this fraction larger than a request serves it whole, with no
    /// driver call, when no cached range holds a run of exactly its pages (docs/design.md,
    /// "Exact before near"). The extra pages stay with the allocation until it is freed, at
    /// the peak too. Larger fractions map less often when steps of mixed sizes repeat, for
    /// more memory held (README, "Over a longer run"); 0 serves only exact runs. 0 to 1.
    pub near_fit: f64,
    /// Carve cached ranges: a request of a page or more that no cached range holds exactly
    /// takes its pages out of the run of cached chunks (in one larger cached range, or across
    /// cached neighbours) that holds it with the fewest pages to spare, where they are mapped,
    /// and what it leaves of those chunks serves later requests of a page or more,
    /// page-granular, with no driver call (docs/design.md, "Carved arenas"); a chunk whose
    /// blocks are all freed goes back to the cache. Carving starts only while the pages carved
    /// arenas leave unused stay within this fraction of the peak bytes in use: they cannot be
    /// stolen for other ranges, so they count as held memory. Frees can leave more unused than
    /// this (a chunk whose other block stays live), which is why it is small: at 0.005 the
    /// fragmentation stress held up to 1.057 of its peak over fifteen seeds, at 0.0025 up to
    /// 1.034 (docs/design.md, "Carved arenas"). Kept in 1,024ths, rounded (0.0025 is 3/1,024);
    /// 0 turns carving off. 0 to 1.
    pub carve: f64,
    /// Carving's budget for a request whose exact size a recent request had too, in place of
    /// `carve`. A training loop asks for the same sizes every step, and there the pages
    /// carving leaves unused serve the next step's requests; in a random mix of sizes they
    /// mostly stay unused. So a larger budget here lets repeated steps carve more without
    /// letting a random mix hold more. It is a fraction of the peak bytes in use or of twice
    /// the headroom below that peak, whichever is less: a step reaches its peak every step,
    /// and pages a carving near it leaves unused are held there (docs/design.md, "Carved
    /// arenas"). 0: no budget of their own, every size carves under `carve` (and `carve` 0
    /// turns all carving off). 0 to 1.
    pub carve_repeated: f64,
    /// Latency before memory: while held memory stays within this fraction above the peak bytes
    /// in use, a request that no mapped memory serves gets new memory, in one chunk, instead
    /// of stealing cached ranges (which remaps their chunks, a set access per handle, and
    /// unmaps their old addresses later); beyond it, or at the cap, it steals and stitches as
    /// usual. Carving may also leave unused as many pages as the budget has room for above
    /// held memory, beside its own budgets (`carve`, `carve_repeated`; raised to this fraction
    /// instead, the pages carved arenas left unused took the stress past it, 1.12 at 0.1). At
    /// 0.3 the fragmentation stress holds 1.30 of its peak, about what PyTorch's default
    /// allocator holds there (1.317), with an alloc p99 about PyTorch's (98-129 against
    /// 113-120 µs in one H200 call, 613-769 at 0), and a training loop's later passes map
    /// almost never (README, "Latency before memory"). Below about 0.2 a training loop maps
    /// no less often than at 0. 0 (the default): off. 0 to 10.
    pub grow_first: f64,
    /// For a process that keeps one allocator per GPU (the Python package): whether each GPU's
    /// allocator grants the other GPUs it allocates on access to its memory (copies between
    /// GPUs need it; each peer makes every new mapping's set access cost more). An `Allocator`
    /// alone grants no peer unless asked (`Allocator::enable_peer_access`).
    pub peer_access: bool,
    /// Create chunks that can be shared with other processes (`Allocator::export`, module
    /// `ipc`): on CUDA, `cuMemCreate` asks for a POSIX file descriptor handle. Where the driver
    /// refuses one, chunks are made without and exports fail. Off: exports fail.
    pub ipc: bool,
    /// Check a stream for a CUDA graph capture (`cuStreamIsCapturing`, about 0.4 µs on an H200,
    /// on every stream-ordered request and free) only while a capture announced with
    /// `Allocator::capture_starting` is in progress. This is the contract of PyTorch's own
    /// allocator, which learns of captures from `torch.cuda.CUDAGraph`; a capture begun behind
    /// the allocator's back is then not seen, and memory allocated in it is not protected. Off:
    /// every request and free asks the driver, and an unannounced capture is refused.
    pub captures_announced: bool,
    /// A stream-ordered free records no event itself (`cuEventRecord`, about 0.5 µs on an H200):
    /// the background worker records one per stream for its latest frees at its next pass
    /// (within 2 ms while frees are pending, 20 ms when it was idle), and `poll`,
    /// `release_unused`, `empty_cache` and a request short of memory record them too. Memory
    /// freed on a stream is reused by that stream at once either way; other streams, and
    /// unmapping, wait for the later event. The worker then records on the freeing stream
    /// after `free_async` has returned, so a stream that frees were ordered on must not be
    /// destroyed while the allocator lives (PyTorch never destroys its streams). Off: every
    /// free records its own event, and a stream may be destroyed as soon as its frees return.
    pub deferred_free_events: bool,
    /// Size of each virtual reservation, as a multiple of the device's total memory.
    pub va_reserve_factor: u64,
    /// Limit on all virtual reservations together, as a multiple of the device's total memory.
    pub va_limit_factor: u64,
    /// Check every invariant after every operation (slow; for tests and debugging).
    pub validate: bool,
    /// The profile the tuning options came from (`Profile::apply`); options set after it may
    /// have changed some of them.
    pub profile: Profile,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backend: BackendKind::Auto,
            device: 0,
            cap_bytes: None,
            cap_fraction: 0.95,
            host_page_size: 2 * MIB as usize,
            host_capacity: 64 * GIB,
            host_driver_costs: HostDriverCosts::None,
            max_chunk_bytes: 64 * MIB,
            max_chunk_repeated_bytes: 0,
            large_chunk_bytes: 128 * MIB,
            largest_chunk_bytes: 64 * GIB,
            unmap_batch_ranges: 256,
            unmap_run_handles: 32,
            unmap_batch_bytes: 8 * GIB,
            unmap_batch_age_us: 50_000,
            background: true,
            prefetch_window_min: 0,
            prefetch_window_max: GIB,
            window_refill_pages: 8,
            reuse_addresses: true,
            near_fit: 0.125,
            carve: 0.0025,
            carve_repeated: 0.01,
            grow_first: 0.0,
            peer_access: true,
            ipc: true,
            captures_announced: false,
            deferred_free_events: false,
            va_reserve_factor: 2,
            va_limit_factor: 16,
            validate: false,
            profile: Profile::Balanced,
        }
    }
}

/// Whether `bytes` may be a chunk-size option: a power of two of at most 64 GiB.
pub(crate) fn valid_chunk_size(bytes: u64) -> bool {
    bytes.is_power_of_two() && bytes <= 64 * GIB
}

impl Options {
    /// Opens the backend these options ask for; `Auto` takes CUDA when a GPU is present.
    pub fn open_backend(&self) -> Result<Backend> {
        let options = self;
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
            BackendKind::Auto => match driver::cuda::probe() {
                Ok(_) => cuda().map_err(Error::from),
                Err(_) => host(),
            },
        }
    }

    /// These options with `profile`'s tuning (`Profile::apply`).
    pub fn with_profile(mut self, profile: Profile) -> Self {
        profile.apply(&mut self);
        self
    }

    /// Options for the host backend with `capacity` bytes of simulated memory and `page` bytes a
    /// page, checking invariants after every operation: the set-up tests use.
    pub fn host(capacity: u64, page: usize) -> Self {
        Options {
            backend: BackendKind::Host,
            host_capacity: capacity,
            host_page_size: page,
            validate: true,
            background: false,
            ..Options::default()
        }
    }

    /// Checks every option; the error names the first bad one and what is allowed.
    pub fn check(&self) -> Result<()> {
        let bad = |name, reason: String| Err(Error::InvalidOption { name, reason });
        for name in ["device", "cap", "cap_fraction", "host_page_size"] {
            self.check_value(name)?;
        }
        // Costs model a GPU on the host backend; on CUDA they would add to the real ones. (Each
        // value is valid alone: the type holds no other.)
        if self.host_driver_costs != HostDriverCosts::None && self.backend == BackendKind::Cuda {
            return bad(
                "host_driver_costs",
                format!(
                    "{} models a GPU's costs on the host backend, and the cuda backend has its own; \
                     use none, or backend host",
                    self.host_driver_costs.name()
                ),
            );
        }
        let page = self.host_page_size;
        if self.host_capacity < page as u64 {
            return bad(
                "host_capacity",
                format!("{} bytes is less than one page ({page})", self.host_capacity),
            );
        }
        for name in [
            "max_chunk_bytes",
            "large_chunk_bytes",
            "largest_chunk_bytes",
            "max_chunk_repeated_bytes",
            "near_fit",
            "carve",
            "carve_repeated",
            "grow_first",
            "unmap_batch_ranges",
            "unmap_batch_bytes",
            "window_refill_pages",
        ] {
            self.check_value(name)?;
        }
        if self.prefetch_window_min > self.prefetch_window_max {
            return bad(
                "prefetch_window_min",
                format!(
                    "{} is larger than prefetch_window_max ({})",
                    self.prefetch_window_min, self.prefetch_window_max
                ),
            );
        }
        self.check_value("va_reserve_factor")?;
        if self.va_limit_factor < self.va_reserve_factor || self.va_limit_factor > 256 {
            return bad(
                "va_limit_factor",
                format!(
                    "{} is not in va_reserve_factor ({})..=256",
                    self.va_limit_factor, self.va_reserve_factor
                ),
            );
        }
        Ok(())
    }

    /// Checks the option `name` (as [`Error::InvalidOption`] names it) on its own, whatever the
    /// others hold: the one copy of each value's rule, which [`check`](Self::check) and the
    /// `MOONBRIGHT_ALLOC_CONF` parser (`conf.rs`, as each key is set) both apply. Rules between
    /// options (a capacity of at least a page, a window's min under its max) are `check`'s.
    pub(crate) fn check_value(&self, name: &'static str) -> Result<()> {
        let problem = match name {
            "device" => (self.device < 0).then(|| format!("{} is negative", self.device)),
            "cap" => (self.cap_bytes == Some(0)).then(|| "must be greater than 0 bytes".into()),
            "cap_fraction" => (!(self.cap_fraction > 0.0 && self.cap_fraction <= 1.0))
                .then(|| format!("{} is not in (0, 1]", self.cap_fraction)),
            "host_page_size" => {
                let page = self.host_page_size;
                (!page.is_power_of_two() || page < 4096 || page as u64 > GIB)
                    .then(|| format!("{page} is not a power of two between 4096 and 1 GiB"))
            }
            "max_chunk_bytes" | "large_chunk_bytes" | "largest_chunk_bytes" => {
                let b = match name {
                    "max_chunk_bytes" => self.max_chunk_bytes,
                    "large_chunk_bytes" => self.large_chunk_bytes,
                    _ => self.largest_chunk_bytes,
                };
                (!valid_chunk_size(b))
                    .then(|| format!("{b} is not a power of two of at most 64 GiB"))
            }
            "max_chunk_repeated_bytes" => {
                let b = self.max_chunk_repeated_bytes;
                (b != 0 && !valid_chunk_size(b))
                    .then(|| format!("{b} is neither 0 nor a power of two of at most 64 GiB"))
            }
            "near_fit" | "carve" | "carve_repeated" | "grow_first" => {
                let (v, max) = match name {
                    "near_fit" => (self.near_fit, 1.0),
                    "carve" => (self.carve, 1.0),
                    "carve_repeated" => (self.carve_repeated, 1.0),
                    _ => (self.grow_first, 10.0),
                };
                (!(0.0..=max).contains(&v)).then(|| format!("{v} is not in [0, {max}]"))
            }
            "unmap_batch_ranges" => {
                (self.unmap_batch_ranges == 0).then(|| "must be at least 1".into())
            }
            "unmap_batch_bytes" => {
                (self.unmap_batch_bytes == 0).then(|| "must be at least 1".into())
            }
            "window_refill_pages" => {
                (self.window_refill_pages == 0).then(|| "must be at least 1".into())
            }
            "va_reserve_factor" => (!(1..=64).contains(&self.va_reserve_factor))
                .then(|| format!("{} is not in 1..=64", self.va_reserve_factor)),
            _ => None,
        };
        match problem {
            Some(reason) => Err(Error::InvalidOption { name, reason }),
            None => Ok(()),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn default_options_are_valid() {
        Options::default().check().unwrap();
    }

    #[test]
    fn each_bad_option_is_named() {
        let cases: Vec<(&str, Options)> = vec![
            ("device", Options { device: -1, ..Default::default() }),
            ("cap", Options { cap_bytes: Some(0), ..Default::default() }),
            ("cap_fraction", Options { cap_fraction: 0.0, ..Default::default() }),
            ("cap_fraction", Options { cap_fraction: f64::NAN, ..Default::default() }),
            ("host_page_size", Options { host_page_size: 3 << 20, ..Default::default() }),
            ("host_page_size", Options { host_page_size: 1024, ..Default::default() }),
            ("host_capacity", Options { host_capacity: 1, ..Default::default() }),
            (
                "host_driver_costs",
                Options {
                    backend: BackendKind::Cuda,
                    host_driver_costs: HostDriverCosts::Cuda,
                    ..Default::default()
                },
            ),
            ("max_chunk_bytes", Options { max_chunk_bytes: 3 << 20, ..Default::default() }),
            (
                "max_chunk_repeated_bytes",
                Options { max_chunk_repeated_bytes: 3 << 20, ..Default::default() },
            ),
            ("largest_chunk_bytes", Options { largest_chunk_bytes: 3 << 30, ..Default::default() }),
            (
                "largest_chunk_bytes",
                Options { largest_chunk_bytes: 128 << 30, ..Default::default() },
            ),
            ("near_fit", Options { near_fit: 1.5, ..Default::default() }),
            ("near_fit", Options { near_fit: f64::NAN, ..Default::default() }),
            ("carve_repeated", Options { carve_repeated: -0.5, ..Default::default() }),
            ("carve_repeated", Options { carve_repeated: f64::NAN, ..Default::default() }),
            ("grow_first", Options { grow_first: -0.1, ..Default::default() }),
            ("grow_first", Options { grow_first: 10.5, ..Default::default() }),
            ("grow_first", Options { grow_first: f64::NAN, ..Default::default() }),
            ("unmap_batch_ranges", Options { unmap_batch_ranges: 0, ..Default::default() }),
            ("unmap_batch_bytes", Options { unmap_batch_bytes: 0, ..Default::default() }),
            ("va_reserve_factor", Options { va_reserve_factor: 0, ..Default::default() }),
            ("va_limit_factor", Options { va_limit_factor: 1, ..Default::default() }),
            (
                "prefetch_window_min",
                Options { prefetch_window_min: 2, prefetch_window_max: 1, ..Default::default() },
            ),
        ];
        for (name, opts) in cases {
            match opts.check() {
                Err(Error::InvalidOption { name: got, reason }) => {
                    assert_eq!(got, name, "{reason}");
                    assert!(!reason.is_empty());
                }
                other => panic!("{name}: expected InvalidOption, got {other:?}"),
            }
        }
    }

    #[test]
    fn backend_names_parse() {
        assert_eq!("host".parse::<BackendKind>().unwrap(), BackendKind::Host);
        assert_eq!("cuda".parse::<BackendKind>().unwrap(), BackendKind::Cuda);
        assert!("gpu".parse::<BackendKind>().is_err());
    }
}
