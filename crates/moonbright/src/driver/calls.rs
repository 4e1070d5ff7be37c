//! The kinds of driver call, and the counts and times of calls by kind that
//! [`Instrumented`](super::Instrumented) keeps and statistics report.

use std::fmt;

/// The kinds of driver call, for counters and fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum CallKind {
    /// `cuMemGetInfo`.
    MemInfo,
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemAddressFree`.
    FreeReservation,
    /// `cuMemCreate`.
    Create,
    /// `cuMemRelease`.
    Release,
    /// `cuMemMap`.
    Map,
    /// `cuMemSetAccess`.
    SetAccess,
    /// `cuMemUnmap`.
    Unmap,
    /// `cuMemcpyHtoD` / `cuMemcpyDtoH` (tests and tools only).
    Copy,
    /// `cuStreamCreate`.
    StreamCreate,
    /// `cuStreamDestroy`.
    StreamDestroy,
    /// `cuEventCreate`.
    EventCreate,
    /// `cuEventRecord`.
    EventRecord,
    /// `cuEventQuery`.
    EventQuery,
    /// `cuEventDestroy`.
    EventDestroy,
    /// `cuEventSynchronize`.
    EventSynchronize,
    /// `cuStreamIsCapturing`.
    StreamIsCapturing,
    /// `cuDeviceCanAccessPeer`, checking a peer for [`Peers::set_peers`](super::Peers::set_peers).
    PeerAccess,
    /// `cuMemExportToShareableHandle`.
    Export,
    /// `cuMemImportFromShareableHandle`.
    Import,
    /// `cuMemHostAlloc`: pinned host memory for a tag's bytes while it sleeps.
    HostAlloc,
    /// `cuMemFreeHost`.
    HostFree,
    /// `cuMemcpyDtoHAsync` / `cuMemcpyHtoDAsync`: a tag's bytes to host memory and back.
    CopyAsync,
}

impl CallKind {
    /// Every kind, in counter order.
    pub const ALL: [CallKind; 23] = [
        CallKind::MemInfo,
        CallKind::Reserve,
        CallKind::FreeReservation,
        CallKind::Create,
        CallKind::Release,
        CallKind::Map,
        CallKind::SetAccess,
        CallKind::Unmap,
        CallKind::Copy,
        CallKind::StreamCreate,
        CallKind::StreamDestroy,
        CallKind::EventCreate,
        CallKind::EventRecord,
        CallKind::EventQuery,
        CallKind::EventDestroy,
        CallKind::EventSynchronize,
        CallKind::StreamIsCapturing,
        CallKind::PeerAccess,
        CallKind::Export,
        CallKind::Import,
        CallKind::HostAlloc,
        CallKind::HostFree,
        CallKind::CopyAsync,
    ];

    /// The driver function this kind stands for.
    pub fn driver_name(self) -> &'static str {
        match self {
            CallKind::MemInfo => "cuMemGetInfo",
            CallKind::Reserve => "cuMemAddressReserve",
            CallKind::FreeReservation => "cuMemAddressFree",
            CallKind::Create => "cuMemCreate",
            CallKind::Release => "cuMemRelease",
            CallKind::Map => "cuMemMap",
            CallKind::SetAccess => "cuMemSetAccess",
            CallKind::Unmap => "cuMemUnmap",
            CallKind::Copy => "cuMemcpy",
            CallKind::StreamCreate => "cuStreamCreate",
            CallKind::StreamDestroy => "cuStreamDestroy",
            CallKind::EventCreate => "cuEventCreate",
            CallKind::EventRecord => "cuEventRecord",
            CallKind::EventQuery => "cuEventQuery",
            CallKind::EventDestroy => "cuEventDestroy",
            CallKind::EventSynchronize => "cuEventSynchronize",
            CallKind::StreamIsCapturing => "cuStreamIsCapturing",
            CallKind::PeerAccess => "cuDeviceCanAccessPeer",
            CallKind::Export => "cuMemExportToShareableHandle",
            CallKind::Import => "cuMemImportFromShareableHandle",
            CallKind::HostAlloc => "cuMemHostAlloc",
            CallKind::HostFree => "cuMemFreeHost",
            CallKind::CopyAsync => "cuMemcpyAsync",
        }
    }

    /// A short snake_case name, used as a statistics key.
    pub fn key(self) -> &'static str {
        match self {
            CallKind::MemInfo => "mem_info",
            CallKind::Reserve => "reserve",
            CallKind::FreeReservation => "free_reservation",
            CallKind::Create => "create",
            CallKind::Release => "release",
            CallKind::Map => "map",
            CallKind::SetAccess => "set_access",
            CallKind::Unmap => "unmap",
            CallKind::Copy => "copy",
            CallKind::StreamCreate => "stream_create",
            CallKind::StreamDestroy => "stream_destroy",
            CallKind::EventCreate => "event_create",
            CallKind::EventRecord => "event_record",
            CallKind::EventQuery => "event_query",
            CallKind::EventDestroy => "event_destroy",
            CallKind::EventSynchronize => "event_synchronize",
            CallKind::StreamIsCapturing => "stream_is_capturing",
            CallKind::PeerAccess => "peer_access",
            CallKind::Export => "export",
            CallKind::Import => "import",
            CallKind::HostAlloc => "host_alloc",
            CallKind::HostFree => "host_free",
            CallKind::CopyAsync => "copy_async",
        }
    }
}

impl fmt::Display for CallKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.driver_name())
    }
}

/// Counts of driver calls by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCounts(pub [u64; CallKind::ALL.len()]);

impl CallCounts {
    /// Calls of one kind.
    pub fn get(&self, kind: CallKind) -> u64 {
        self.0[kind as usize]
    }

    /// All calls.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// `(kind, count)` for every kind.
    pub fn iter(&self) -> impl Iterator<Item = (CallKind, u64)> + '_ {
        CallKind::ALL.iter().map(move |&k| (k, self.get(k)))
    }

    /// Counts since `earlier`.
    pub fn since(&self, earlier: &CallCounts) -> CallCounts {
        let mut out = CallCounts::default();
        for k in CallKind::ALL {
            out.0[k as usize] = self.get(k).saturating_sub(earlier.get(k));
        }
        out
    }
}

/// Time spent in the virtual-memory calls (reserve, create, release, map, set access, unmap),
/// by kind: the total and the longest single call, in nanoseconds. Other kinds stay at zero
/// (their calls are sub-microsecond and on fast paths, where two clock reads would show).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallTimes {
    pub total_ns: [u64; CallKind::ALL.len()],
    pub max_ns: [u64; CallKind::ALL.len()],
}

impl CallTimes {
    /// Whether calls of `kind` are timed.
    pub fn timed(kind: CallKind) -> bool {
        use CallKind::*;
        matches!(kind, Reserve | Create | Release | Map | SetAccess | Unmap)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn call_counts_since_subtracts_per_kind() {
        let mut a = CallCounts::default();
        a.0[CallKind::Map as usize] = 5;
        let mut b = a;
        b.0[CallKind::Map as usize] = 8;
        b.0[CallKind::Unmap as usize] = 2;
        let d = b.since(&a);
        assert_eq!(d.get(CallKind::Map), 3);
        assert_eq!(d.get(CallKind::Unmap), 2);
        assert_eq!(d.total(), 5);
    }

    #[test]
    fn call_kind_order_matches_discriminants() {
        for (i, k) in CallKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i);
        }
    }
}
