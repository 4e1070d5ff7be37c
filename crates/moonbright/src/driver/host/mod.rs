//! The host backend: a CPU model of the CUDA virtual-memory API that holds real bytes at real host
//! addresses. This file owns the driver's state under one lock and its test hooks; the state's
//! parts live beside it: `memory` (one sparse memfd as the "physical memory": offsets, chunks),
//! `vm` (the address space: reservations carved from the process's, mappings, accessible spans;
//! and the virtual-memory calls, peers, copies), `streams` (simulated streams, events, capture);
//! with `ipc` (export and import), `sys` (the system calls) and `costs` (the driver costs it
//! may charge).

mod costs;
mod ipc;
mod memory;
mod offload;
mod streams;
mod sys;
#[cfg(all(test, not(loom), not(miri)))]
mod tests;
mod vm;

use std::fmt;
use std::io;
use std::sync::{Mutex, MutexGuard};

use super::{code, CallKind, DevicePtr, DriverError, DriverResult, Kernels, StreamHandle};
use costs::{Charged, Costs};
use memory::Memory;
use streams::StreamModel;
use vm::{covers, AddressSpace};

pub use costs::{cuda_costs, device_table_costs, HostDriverCosts};

/// How the host backend is shaped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// The mapping granularity in bytes: a power of two and a multiple of the OS page size.
    pub page_size: usize,
    /// Bytes of simulated device memory; `create_chunk` fails with `OUT_OF_MEMORY` beyond it.
    pub capacity: u64,
    /// The driver costs each call is charged (time only; results are the same under each).
    pub costs: HostDriverCosts,
}

impl Default for HostConfig {
    /// 2 MiB granularity (an H200's), 64 GiB of simulated device memory, no driver costs.
    fn default() -> Self {
        HostConfig { page_size: 2 << 20, capacity: 64 << 30, costs: HostDriverCosts::None }
    }
}

/// The host backend. See the module documentation.
///
/// Accessibility is tracked per byte range, not per mapping: like `cuMemSetAccess`, `set_access`
/// accepts any aligned sub-range of mapped memory, and may span several mappings. An unmap drops
/// the accessibility of the range it unmaps, so a remapped range needs `set_access` again.
pub struct HostDriver {
    page_size: usize,
    capacity: u64,
    state: Mutex<State>,
    /// Devices `set_access` grants access to besides this one (`Peers::set_peers`). Apart from
    /// `state`, and a lock loom sees: the models check how a grant to a new peer orders with
    /// the maps of requests in flight, which a lock loom cannot see would hide from them.
    peers: crate::sync::Mutex<Vec<i32>>,
    /// What each call costs, charged outside `state`'s lock.
    costs: Costs,
}

/// The driver's state, under `HostDriver`'s lock.
#[derive(Debug)]
struct State {
    /// The physical memory: the memfd, its offsets, and the chunks carved from them.
    memory: Memory,
    /// The address space: reservations, mappings, and who may access what.
    space: AddressSpace,
    /// The simulated streams and events, and the graph captures tests announce.
    streams: StreamModel,
    /// Host buffers given out (`Offload`).
    host: offload::HostBuffers,
}

/// Devices the host backend models: it is device 0, and every other can be its peer.
pub const HOST_DEVICES: i32 = 8;

fn err(call: CallKind, code: i32, message: impl Into<String>) -> DriverError {
    DriverError::new(call, code, message)
}

/// A failed system call as a driver error: address-space or memory exhaustion reads as
/// `OUT_OF_MEMORY` (as the driver would say), anything else as `UNKNOWN`.
fn os_err(call: CallKind, what: &str, e: io::Error) -> DriverError {
    let c = match e.raw_os_error() {
        Some(libc::ENOMEM) | Some(libc::ENOSPC) | Some(libc::EFBIG) => code::OUT_OF_MEMORY,
        _ => code::UNKNOWN,
    };
    err(call, c, format!("{what} failed: {e}"))
}

impl HostDriver {
    /// A host backend with `config`; fails with `INVALID_VALUE` on a bad configuration.
    pub fn new(config: HostConfig) -> DriverResult<Self> {
        let bad =
            |m: String| err(CallKind::MemInfo, code::INVALID_VALUE, format!("host config: {m}"));
        let os_page = sys::os_page_size();
        let ps = config.page_size;
        if ps == 0 || !ps.is_power_of_two() {
            return Err(bad(format!("page_size {ps} is not a power of two")));
        }
        if ps % os_page != 0 {
            return Err(bad(format!(
                "page_size {ps} is not a multiple of the OS page size {os_page}"
            )));
        }
        if config.capacity == 0 {
            return Err(bad("capacity is 0; give the simulated device some memory".into()));
        }
        // File offsets are off_t; leave headroom for fragmentation past `capacity`.
        if config.capacity > (i64::MAX as u64) / 4 {
            return Err(bad(format!("capacity {} is too large for file offsets", config.capacity)));
        }
        let fd = sys::memfd().map_err(|e| {
            err(CallKind::MemInfo, code::NOT_INITIALIZED, format!("memfd_create failed: {e}"))
        })?;
        Ok(HostDriver {
            page_size: ps,
            capacity: config.capacity,
            state: Mutex::new(State {
                memory: Memory::new(fd),
                space: AddressSpace::default(),
                streams: StreamModel::new(),
                host: offload::HostBuffers::default(),
            }),
            peers: crate::sync::Mutex::new(Vec::new()),
            costs: Costs::new(config.costs),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation leaves the state consistent before anything that can panic, so a
        // poisoned lock still guards a usable state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Test hook: events recorded on `s` from now on stay not-done until [`Self::release_stream`].
    /// Holding an unknown stream, or one already held, does nothing.
    pub fn hold_stream(&self, s: StreamHandle) {
        let mut st = self.lock();
        let token = st.streams.next_hold;
        if let Some(hold @ None) = st.streams.streams.get_mut(&s.0) {
            *hold = Some(token);
            st.streams.next_hold += 1;
        }
    }

    /// Test hook: ends a hold; the events recorded on `s` during it are done.
    pub fn release_stream(&self, s: StreamHandle) {
        if let Some(hold) = self.lock().streams.streams.get_mut(&s.0) {
            *hold = None;
        }
    }

    /// Test hook: from now on `synchronize_event` on an event of a held stream waits up to
    /// `limit` for the hold to end, as a host thread waits for a GPU's work, instead of refusing
    /// at once (a test's other thread ends the hold).
    pub fn wait_on_held_streams(&self, limit: std::time::Duration) {
        self.lock().streams.sync_wait = limit;
    }

    /// Test hook: `s` reports being captured into a graph until [`Self::end_capture`]. Returns
    /// the new capture's id.
    pub fn begin_capture(&self, s: StreamHandle) -> u64 {
        let mut st = self.lock();
        let id = st.streams.next_capture;
        st.streams.next_capture += 1;
        st.streams.capturing.insert(s.0, id);
        id
    }

    /// Test hook: `s` joins capture `id` (as a stream forked from the capturing one does).
    pub fn join_capture(&self, s: StreamHandle, id: u64) {
        self.lock().streams.capturing.insert(s.0, id);
    }

    /// Test hook: ends a capture begun by [`Self::begin_capture`] (on `s` only).
    pub fn end_capture(&self, s: StreamHandle) {
        self.lock().streams.capturing.remove(&s.0);
    }

    /// The driver costs this backend charges.
    pub fn costs(&self) -> HostDriverCosts {
        self.costs.model()
    }

    /// The modelled driver time charged so far (zero under `HostDriverCosts::None`).
    pub fn charged_cost(&self) -> std::time::Duration {
        self.costs.charged()
    }

    /// Charges `call` its modelled cost (spinning), before the call does its work.
    fn charge(&self, call: Charged) {
        self.costs.call(self.cost_owner(), call);
    }

    /// This backend's identity in the batches the cost model keeps per thread.
    fn cost_owner(&self) -> usize {
        self as *const HostDriver as usize
    }

    /// Bytes of the memfd actually backed by RAM.
    pub fn resident_bytes(&self) -> u64 {
        let st = self.lock();
        // Only a diagnostic: a failed fstat (which cannot happen on an open memfd) reads as 0.
        sys::allocated_bytes(&st.memory.fd).unwrap_or(0)
    }

    /// Bytes of chunks not yet freed (a released chunk counts until its last unmap).
    pub fn live_chunk_bytes(&self) -> u64 {
        self.lock().memory.live_chunk_bytes
    }

    /// Live mappings.
    pub fn mapping_count(&self) -> usize {
        self.lock().space.mappings.len()
    }

    /// Whether peer device `peer` was granted access to all of `[va, va + len)` (and it is
    /// still mapped).
    pub fn peer_can_access(&self, peer: i32, va: DevicePtr, len: u64) -> bool {
        let st = self.lock();
        st.space.peer_accessible.get(&peer).is_some_and(|spans| covers(spans, va, va + len))
    }

    fn check_aligned(&self, call: CallKind, va: DevicePtr, size: usize) -> DriverResult<u64> {
        let ps = self.page_size as u64;
        let name = call.key();
        if va == 0 || va % ps != 0 {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("{name}: va {va:#x} not aligned to granularity {ps}"),
            ));
        }
        let size = size as u64;
        if size == 0 || size % ps != 0 {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("{name}: size {size} is not a non-zero multiple of granularity {ps}"),
            ));
        }
        va.checked_add(size).ok_or_else(|| {
            err(call, code::INVALID_VALUE, format!("{name}: range {va:#x} + {size} overflows"))
        })
    }
}

impl fmt::Debug for HostDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("HostDriver");
        d.field("page_size", &self.page_size).field("capacity", &self.capacity);
        d.field("costs", &self.costs.model());
        // try_lock: formatting must never wait on (or deadlock with) a call in flight.
        match self.state.try_lock() {
            Ok(st) => d
                .field("live_chunk_bytes", &st.memory.live_chunk_bytes)
                .field("chunks", &st.memory.chunks.len())
                .field("reservations", &st.space.reservations.len())
                .field("mappings", &st.space.mappings.len()),
            Err(_) => d.field("state", &"<busy>"),
        };
        d.finish()
    }
}

/// The host backend runs no kernels: the paged pool keeps its tables on the host.
impl Kernels for HostDriver {}

impl Drop for HostDriver {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        // Every mapping lies in a reservation, so unmapping the reservations drops them too.
        for (&base, &size) in &st.space.reservations {
            // SAFETY: the reservation is ours, and `&mut self` means no call is in flight; any
            // pointer the caller still holds into it was only valid while the driver lived.
            let _ = unsafe { sys::unmap(base, size) };
        }
        st.space.reservations.clear();
        st.space.mappings.clear();
        st.host.free_all();
        // The memfd closes when `st.memory.fd` drops.
    }
}
