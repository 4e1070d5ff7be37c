//! The C structures: the opaque allocator, its options, its statistics, and the reports of
//! sleep and wake, with their conversions from the core's.

use std::ffi::c_int;

use moonbright::tags::{SleepReport, WakeReport};
use moonbright::{Allocator, CallKind, Stat, Stats};

/// An allocator (opaque). Made by `mb_create`, destroyed by `mb_destroy`. Any number of threads
/// may call `mb_malloc`, `mb_free` and the other functions on one allocator at once; only
/// `mb_destroy` must not overlap any other call on it.
pub struct mb_allocator {
    pub(crate) inner: Allocator,
}

impl mb_allocator {
    /// The core allocator behind the handle, for Rust code that links this crate: its tests
    /// read and write device memory through it, which the C API leaves to the CUDA runtime.
    pub fn allocator(&self) -> &Allocator {
        &self.inner
    }
}

/// Options of an allocator. Fill with `mb_options_default`, then change what you need. A field
/// of 0 means its default everywhere (except `backend` and `device`, where 0 is itself a value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct mb_options {
    /// Which backend: `MB_BACKEND_AUTO` (0), `MB_BACKEND_CUDA` (1) or `MB_BACKEND_HOST` (2).
    pub backend: c_int,
    /// CUDA device ordinal.
    pub device: i32,
    /// Cap on physical bytes held; 0: 95% of the device's total memory.
    pub cap_bytes: u64,
    /// Host backend: page size in bytes, a power of two from 4096 to 1 GiB; 0: 2 MiB.
    pub host_page_size: u64,
    /// Host backend: bytes of simulated device memory; 0: 64 GiB.
    pub host_capacity: u64,
    /// Largest physical chunk in bytes, a power of two; 0: 64 MiB.
    pub max_chunk_bytes: u64,
    /// Retired ranges that trigger an unmap batch; 0: 256.
    pub unmap_batch_ranges: u64,
}

/// One statistic: its current value, its peak, and its cumulative increases and decreases.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct mb_stat {
    /// Now.
    pub current: u64,
    /// Highest `current` since the allocator was created.
    pub peak: u64,
    /// Sum of all increases.
    pub allocated: u64,
    /// Sum of all decreases.
    pub freed: u64,
}

/// A snapshot of an allocator's statistics (`mb_get_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct mb_stats {
    /// Bytes of live allocations, as requested.
    pub allocated_bytes: mb_stat,
    /// Bytes of physical memory held.
    pub reserved_bytes: mb_stat,
    /// Bytes of live allocations after rounding (to 256 B below a page, to pages above).
    pub active_bytes: mb_stat,
    /// Rounded minus requested bytes of live allocations.
    pub rounding_waste_bytes: mb_stat,
    /// Virtual bytes mapped (live, cached and retired ranges).
    pub mapped_bytes: mb_stat,
    /// Live allocations.
    pub allocations: mb_stat,
    /// Allocations served by a cached range without any driver call.
    pub cache_hits: u64,
    /// Cached ranges broken up to reuse their pages elsewhere.
    pub cached_ranges_stolen: u64,
    /// Chunks released and recreated smaller under pressure.
    pub chunk_splits: u64,
    /// Unmap batches flushed.
    pub unmap_batches: u64,
    /// Requests refused for lack of memory.
    pub num_ooms: u64,
    /// Driver errors met outside a request, recovered by retrying later.
    pub deferred_errors: u64,
    /// `cuMemMap` calls.
    pub map_calls: u64,
    /// `cuMemUnmap` calls.
    pub unmap_calls: u64,
    /// `cuMemSetAccess` calls.
    pub set_access_calls: u64,
    /// `cuMemCreate` calls.
    pub create_calls: u64,
    /// `cuMemRelease` calls.
    pub release_calls: u64,
    /// `cuMemAddressReserve` calls.
    pub reserve_calls: u64,
    /// Bytes of pages committed to growable allocations.
    pub growable_committed_bytes: mb_stat,
    /// Resizes of growable allocations that mapped or gave back pages (none copies).
    pub growable_resizes: u64,
    /// Bytes of ranges whose tag is asleep (`mb_sleep`): unmapped, their memory given back,
    /// their addresses kept. Their allocations still count in `allocated_bytes` and
    /// `active_bytes`, not in `reserved_bytes`.
    pub asleep_bytes: mb_stat,
}

/// What `mb_sleep` did.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct mb_sleep_report {
    /// Bytes of mapped ranges taken out of service: the tag's allocations, rounded to pages,
    /// with the sub-page arenas that hold its small ones.
    pub bytes: u64,
    /// Of them, device memory given back to the driver (less than `bytes` where a chunk's
    /// earlier mapping still waited for other work: that chunk stays in the allocator's pool).
    pub released: u64,
    /// Bytes copied to host memory (0 with `MB_BACKUP_DISCARD`).
    pub backed_up: u64,
    /// Seconds the call took.
    pub seconds: f64,
}

/// What `mb_wake` did.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct mb_wake_report {
    /// Bytes mapped again.
    pub bytes: u64,
    /// Of them, bytes of newly created chunks (the rest came from memory the allocator held).
    pub created: u64,
    /// Bytes copied back from host memory.
    pub restored: u64,
    /// Seconds the call took.
    pub seconds: f64,
}

impl From<Stat> for mb_stat {
    fn from(s: Stat) -> Self {
        mb_stat { current: s.current, peak: s.peak, allocated: s.allocated, freed: s.freed }
    }
}

impl From<&Stats> for mb_stats {
    fn from(s: &Stats) -> Self {
        let calls = |k| s.driver_calls.get(k);
        mb_stats {
            allocated_bytes: s.allocated_bytes.into(),
            reserved_bytes: s.reserved_bytes.into(),
            active_bytes: s.active_bytes.into(),
            rounding_waste_bytes: s.rounding_waste_bytes.into(),
            mapped_bytes: s.mapped_bytes.into(),
            allocations: s.allocations.into(),
            cache_hits: s.cache_hits,
            cached_ranges_stolen: s.cached_ranges_stolen,
            chunk_splits: s.chunk_splits,
            unmap_batches: s.unmap_batches,
            num_ooms: s.num_ooms,
            deferred_errors: s.deferred_errors,
            map_calls: calls(CallKind::Map),
            unmap_calls: calls(CallKind::Unmap),
            set_access_calls: calls(CallKind::SetAccess),
            create_calls: calls(CallKind::Create),
            release_calls: calls(CallKind::Release),
            reserve_calls: calls(CallKind::Reserve),
            growable_committed_bytes: s.growable_committed_bytes.into(),
            growable_resizes: s.growable_resizes,
            asleep_bytes: s.asleep_bytes.into(),
        }
    }
}

impl From<&SleepReport> for mb_sleep_report {
    fn from(r: &SleepReport) -> Self {
        mb_sleep_report {
            bytes: r.bytes,
            released: r.released,
            backed_up: r.backed_up,
            seconds: r.seconds,
        }
    }
}

impl From<&WakeReport> for mb_wake_report {
    fn from(r: &WakeReport) -> Self {
        mb_wake_report {
            bytes: r.bytes,
            created: r.created,
            restored: r.restored,
            seconds: r.seconds,
        }
    }
}
