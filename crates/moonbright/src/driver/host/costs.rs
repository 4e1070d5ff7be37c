//! The host backend's driver costs: what each virtual-memory call would take on a GPU, charged by
//! spinning so that the allocator's latency measurements see it. `none` charges nothing; `cuda`
//! charges the CUDA driver's costs measured on an H100; `device_tables` models page tables
//! written by a kernel (docs/design.md, "Device-written page tables"). Costs change time only.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Which per-call driver costs the host backend charges (`Options::host_driver_costs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostDriverCosts {
    /// Nothing: each call takes what the host model takes.
    #[default]
    None,
    /// The CUDA driver's mean cost per call, measured on an H100.
    Cuda,
    /// Page tables written by a kernel: maps, set access and unmaps are one launch a batch,
    /// unmaps add one deferred TLB invalidation a batch; reservations and chunks cost as `Cuda`.
    DeviceTables,
}

impl HostDriverCosts {
    /// Every model, in the order the docs list them.
    pub const ALL: [HostDriverCosts; 3] =
        [HostDriverCosts::None, HostDriverCosts::Cuda, HostDriverCosts::DeviceTables];

    /// The model `MOONBRIGHT_ALLOC_CONF` names `name`, if any.
    pub fn from_name(name: &str) -> Option<HostDriverCosts> {
        HostDriverCosts::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The name `MOONBRIGHT_ALLOC_CONF` uses.
    pub fn name(self) -> &'static str {
        match self {
            HostDriverCosts::None => "none",
            HostDriverCosts::Cuda => "cuda",
            HostDriverCosts::DeviceTables => "device_tables",
        }
    }
}

/// The CUDA driver's mean time per call on an H100 80GB HBM3 (driver 580.159.04, CUDA 13.0),
/// from `bench/results/stress/stress.log`, the balanced row's "VMM calls" line (2,033 creates,
/// 417 releases, 7,030 maps, 2,005 set access, 1,600 unmaps). `cuMemAddressFree` is not timed
/// there and costs nothing here.
pub mod cuda_costs {
    use std::time::Duration;
    /// `cuMemAddressReserve`: 26.8 µs.
    pub const RESERVE: Duration = Duration::from_nanos(26_800);
    /// `cuMemCreate`: 18.7 µs.
    pub const CREATE: Duration = Duration::from_nanos(18_700);
    /// `cuMemRelease`: 113.5 µs.
    pub const RELEASE: Duration = Duration::from_nanos(113_500);
    /// `cuMemMap`: 11.5 µs.
    pub const MAP: Duration = Duration::from_nanos(11_500);
    /// `cuMemSetAccess`: 132.3 µs.
    pub const SET_ACCESS: Duration = Duration::from_nanos(132_300);
    /// `cuMemUnmap`: 134.8 µs.
    pub const UNMAP: Duration = Duration::from_nanos(134_800);
}

/// Assumed, not measured: no device-side page-table writer runs here.
pub mod device_table_costs {
    use std::time::Duration;
    /// One kernel launch that writes a batch's page-table entries: about what launching a
    /// small kernel takes on a current GPU.
    pub const LAUNCH: Duration = Duration::from_nanos(4_000);
    /// One TLB invalidation, deferred to the end of a batch that unmapped.
    pub const TLB_INVALIDATION: Duration = Duration::from_nanos(5_000);
}

/// The calls that cost something.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Charged {
    Reserve,
    Create,
    Release,
    Map,
    SetAccess,
    Unmap,
}

/// A batch open on this thread under `DeviceTables`: whose, and what it queued.
#[derive(Clone, Copy)]
struct OpenBatch {
    owner: usize,
    writes: bool,
    unmaps: bool,
}

thread_local! {
    static BATCH: Cell<Option<OpenBatch>> = const { Cell::new(None) };
}

/// One host backend's cost model, and the time it has charged.
#[derive(Debug, Default)]
pub(super) struct Costs {
    model: HostDriverCosts,
    charged_ns: AtomicU64,
}

impl Costs {
    pub(super) fn new(model: HostDriverCosts) -> Costs {
        Costs { model, charged_ns: AtomicU64::new(0) }
    }

    pub(super) fn model(&self) -> HostDriverCosts {
        self.model
    }

    /// The modelled time charged so far.
    pub(super) fn charged(&self) -> Duration {
        Duration::from_nanos(self.charged_ns.load(Ordering::Relaxed))
    }

    /// Charges one call of `owner` (its backend's address, so that a batch of one backend does
    /// not absorb another's calls).
    pub(super) fn call(&self, owner: usize, call: Charged) {
        use device_table_costs::{LAUNCH, TLB_INVALIDATION};
        let cost = match (self.model, call) {
            (HostDriverCosts::None, _) => return,
            (_, Charged::Reserve) => cuda_costs::RESERVE,
            (_, Charged::Create) => cuda_costs::CREATE,
            (_, Charged::Release) => cuda_costs::RELEASE,
            (HostDriverCosts::Cuda, Charged::Map) => cuda_costs::MAP,
            (HostDriverCosts::Cuda, Charged::SetAccess) => cuda_costs::SET_ACCESS,
            (HostDriverCosts::Cuda, Charged::Unmap) => cuda_costs::UNMAP,
            (HostDriverCosts::DeviceTables, _) => {
                let unmap = call == Charged::Unmap;
                if queue_in_batch(owner, unmap) {
                    return;
                }
                // A call outside a batch is a batch of its own.
                if unmap {
                    LAUNCH + TLB_INVALIDATION
                } else {
                    LAUNCH
                }
            }
        };
        self.spend(cost);
    }

    /// Opens a batch on this thread for `owner`; false when none opens (no batching in this
    /// model, or a batch is open already).
    pub(super) fn begin_batch(&self, owner: usize) -> bool {
        if self.model != HostDriverCosts::DeviceTables {
            return false;
        }
        BATCH.with(|b| {
            if b.get().is_some() {
                return false;
            }
            b.set(Some(OpenBatch { owner, writes: false, unmaps: false }));
            true
        })
    }

    /// Closes the batch `begin_batch` opened: one launch if it queued writes, and one TLB
    /// invalidation if it unmapped.
    pub(super) fn end_batch(&self, owner: usize) {
        let Some(open) = BATCH.with(|b| b.take()) else {
            return;
        };
        debug_assert_eq!(open.owner, owner, "a batch ends on the backend that began it");
        let mut cost = Duration::ZERO;
        if open.writes {
            cost += device_table_costs::LAUNCH;
        }
        if open.unmaps {
            cost += device_table_costs::TLB_INVALIDATION;
        }
        self.spend(cost);
    }

    fn spend(&self, cost: Duration) {
        if cost.is_zero() {
            return;
        }
        self.charged_ns.fetch_add(cost.as_nanos() as u64, Ordering::Relaxed);
        spin(cost);
    }
}

/// Queues a page-table write in `owner`'s batch open on this thread; false when there is none.
fn queue_in_batch(owner: usize, unmap: bool) -> bool {
    BATCH.with(|b| match b.get() {
        Some(mut open) if open.owner == owner => {
            open.writes = true;
            open.unmaps |= unmap;
            b.set(Some(open));
            true
        }
        _ => false,
    })
}

/// Busy-waits for `d`: a sleep would oversleep by more than the costs themselves, and the
/// driver's own calls occupy the calling thread as this does.
fn spin(d: Duration) {
    let start = Instant::now();
    while start.elapsed() < d {
        std::hint::spin_loop();
    }
}
