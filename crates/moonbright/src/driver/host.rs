//! The host backend: a CPU model of the CUDA virtual-memory API that holds real bytes at real host
//! addresses. It owns one sparse memfd (the "physical memory"), the virtual reservations carved
//! from the process address space, the mapping table, and simulated streams and events.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{
    code, CallKind, ChunkHandle, DevicePtr, Driver, DriverError, DriverResult, EventHandle,
    MemInfo, SharedChunk, StreamHandle,
};

/// How the host backend is shaped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// The mapping granularity in bytes: a power of two and a multiple of the OS page size.
    pub page_size: usize,
    /// Bytes of simulated device memory; `create_chunk` fails with `OUT_OF_MEMORY` beyond it.
    pub capacity: u64,
}

impl Default for HostConfig {
    /// 2 MiB granularity (an H200's) and 64 GiB of simulated device memory.
    fn default() -> Self {
        HostConfig { page_size: 2 << 20, capacity: 64 << 30 }
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
    /// Devices `set_access` grants access to besides this one (`Driver::set_peers`). Apart from
    /// `state`, and a lock loom sees: the models check how a grant to a new peer orders with
    /// the maps of requests in flight, which a lock loom cannot see would hide from them.
    peers: crate::sync::Mutex<Vec<i32>>,
}

/// A physical chunk: a range of memfd offsets.
#[derive(Debug)]
struct Chunk {
    offset: u64,
    size: u64,
    /// How many mappings show this chunk now.
    maps: usize,
    /// `release_chunk` was called; the chunk goes at its last unmap.
    released: bool,
    /// Imported from another backend (`import_chunk`): the file its bytes are in, which is not
    /// this backend's memfd, and whose space this backend neither counts nor frees.
    imported: Option<Arc<OwnedFd>>,
    /// Exported (`export_chunk`): another process may map its offsets for as long as it likes,
    /// so once released they are neither punched nor given to a new chunk (CUDA keeps an
    /// exported chunk's memory until its importers release it too).
    exported: bool,
}

impl Chunk {
    fn new(offset: u64, size: u64) -> Chunk {
        Chunk { offset, size, maps: 0, released: false, imported: None, exported: false }
    }
}

/// One `map` call's worth of address space.
#[derive(Debug, Clone, Copy)]
struct Mapping {
    size: u64,
    chunk: u64,
}

/// Where an event's last record stands.
#[derive(Debug, Clone, Copy)]
enum EventState {
    /// Never recorded, or recorded on a stream that was not held: done.
    Done,
    /// Recorded on `stream` during its hold `hold`: done once that hold ends.
    Pending { stream: u64, hold: u64 },
}

#[derive(Debug)]
struct State {
    fd: OwnedFd,
    /// The memfd's size; grows only, since holes cost nothing.
    file_len: u64,
    /// Everything at or past this offset is unused.
    file_end: u64,
    /// Unused offset ranges below `file_end`: start -> length, disjoint and coalesced.
    free_offsets: BTreeMap<u64, u64>,
    next_chunk: u64,
    chunks: HashMap<u64, Chunk>,
    live_chunk_bytes: u64,
    /// base -> size.
    reservations: BTreeMap<u64, u64>,
    /// va -> mapping; mappings never overlap.
    mappings: BTreeMap<u64, Mapping>,
    /// Accessible ranges: start -> end, disjoint and coalesced; always inside mappings.
    accessible: BTreeMap<u64, u64>,
    /// Ranges each peer was granted access to, as `accessible`.
    peer_accessible: HashMap<i32, BTreeMap<u64, u64>>,
    next_stream: u64,
    /// stream -> the token of its current hold, if held.
    streams: HashMap<u64, Option<u64>>,
    next_hold: u64,
    next_event: u64,
    events: HashMap<u64, EventState>,
    /// Streams a test has put into graph capture, with their capture's id.
    capturing: HashMap<u64, u64>,
    next_capture: u64,
    /// How long `synchronize_event` waits for a held stream's hold to end (another thread of a
    /// test ends it) before it refuses; zero refuses at once.
    sync_wait: std::time::Duration,
}

/// Devices the host backend models: it is device 0, and every other can be its peer.
pub const HOST_DEVICES: i32 = 8;

/// Adds `[start, end)` to a set of disjoint, coalesced spans (start -> end).
fn add_span(spans: &mut BTreeMap<u64, u64>, mut start: u64, mut end: u64) {
    if let Some((&s, &e)) = spans.range(..=start).next_back() {
        if e >= start {
            spans.remove(&s);
            start = s;
            end = end.max(e);
        }
    }
    let inside: Vec<(u64, u64)> = spans.range(start..=end).map(|(&s, &e)| (s, e)).collect();
    for (s, e) in inside {
        spans.remove(&s);
        end = end.max(e);
    }
    spans.insert(start, end);
}

/// Removes `[start, end)` from a set of spans.
fn remove_span(spans: &mut BTreeMap<u64, u64>, start: u64, end: u64) {
    if let Some((&s, &e)) = spans.range(..start).next_back() {
        if e > start {
            spans.insert(s, start);
            if e > end {
                spans.insert(end, e);
            }
        }
    }
    let inside: Vec<(u64, u64)> = spans.range(start..end).map(|(&s, &e)| (s, e)).collect();
    for (s, e) in inside {
        spans.remove(&s);
        if e > end {
            spans.insert(end, e);
        }
    }
}

/// Whether one span covers `[start, end)`.
fn covers(spans: &BTreeMap<u64, u64>, start: u64, end: u64) -> bool {
    matches!(spans.range(..=start).next_back(), Some((_, &e)) if e >= end)
}

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
        let mut streams = HashMap::new();
        streams.insert(StreamHandle::DEFAULT.0, None);
        Ok(HostDriver {
            page_size: ps,
            capacity: config.capacity,
            state: Mutex::new(State {
                fd,
                file_len: 0,
                file_end: 0,
                free_offsets: BTreeMap::new(),
                next_chunk: 1,
                chunks: HashMap::new(),
                live_chunk_bytes: 0,
                reservations: BTreeMap::new(),
                mappings: BTreeMap::new(),
                accessible: BTreeMap::new(),
                peer_accessible: HashMap::new(),
                next_stream: 1,
                streams,
                next_hold: 1,
                next_event: 1,
                events: HashMap::new(),
                capturing: HashMap::new(),
                next_capture: 1,
                sync_wait: std::time::Duration::ZERO,
            }),
            peers: crate::sync::Mutex::new(Vec::new()),
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
        let token = st.next_hold;
        if let Some(hold @ None) = st.streams.get_mut(&s.0) {
            *hold = Some(token);
            st.next_hold += 1;
        }
    }

    /// Test hook: ends a hold; the events recorded on `s` during it are done.
    pub fn release_stream(&self, s: StreamHandle) {
        if let Some(hold) = self.lock().streams.get_mut(&s.0) {
            *hold = None;
        }
    }

    /// Test hook: from now on `synchronize_event` on an event of a held stream waits up to
    /// `limit` for the hold to end, as a host thread waits for a GPU's work, instead of refusing
    /// at once (a test's other thread ends the hold).
    pub fn wait_on_held_streams(&self, limit: std::time::Duration) {
        self.lock().sync_wait = limit;
    }

    /// Test hook: `s` reports being captured into a graph until [`Self::end_capture`]. Returns
    /// the new capture's id.
    pub fn begin_capture(&self, s: StreamHandle) -> u64 {
        let mut st = self.lock();
        let id = st.next_capture;
        st.next_capture += 1;
        st.capturing.insert(s.0, id);
        id
    }

    /// Test hook: `s` joins capture `id` (as a stream forked from the capturing one does).
    pub fn join_capture(&self, s: StreamHandle, id: u64) {
        self.lock().capturing.insert(s.0, id);
    }

    /// Test hook: ends a capture begun by [`Self::begin_capture`] (on `s` only).
    pub fn end_capture(&self, s: StreamHandle) {
        self.lock().capturing.remove(&s.0);
    }

    /// Bytes of the memfd actually backed by RAM.
    pub fn resident_bytes(&self) -> u64 {
        let st = self.lock();
        // Only a diagnostic: a failed fstat (which cannot happen on an open memfd) reads as 0.
        sys::allocated_bytes(&st.fd).unwrap_or(0)
    }

    /// Bytes of chunks not yet freed (a released chunk counts until its last unmap).
    pub fn live_chunk_bytes(&self) -> u64 {
        self.lock().live_chunk_bytes
    }

    /// Live mappings.
    pub fn mapping_count(&self) -> usize {
        self.lock().mappings.len()
    }

    /// Whether peer device `peer` was granted access to all of `[va, va + len)` (and it is
    /// still mapped).
    pub fn peer_can_access(&self, peer: i32, va: DevicePtr, len: u64) -> bool {
        let st = self.lock();
        st.peer_accessible.get(&peer).is_some_and(|spans| covers(spans, va, va + len))
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

impl State {
    /// First fit among freed offsets, else the end of the file (grown as needed).
    fn alloc_offsets(&mut self, size: u64) -> io::Result<u64> {
        let fit = self.free_offsets.iter().find(|(_, &len)| len >= size).map(|(&s, &l)| (s, l));
        if let Some((start, len)) = fit {
            self.free_offsets.remove(&start);
            if len > size {
                self.free_offsets.insert(start + size, len - size);
            }
            return Ok(start);
        }
        let start = self.file_end;
        let end = start + size;
        if end > self.file_len {
            sys::set_len(&self.fd, end)?;
            self.file_len = end;
        }
        self.file_end = end;
        Ok(start)
    }

    /// Returns offsets to the free list, coalescing; a range touching the end lowers the end.
    fn free_offsets(&mut self, mut start: u64, mut len: u64) {
        if let Some((&s, &l)) = self.free_offsets.range(..start).next_back() {
            if s + l == start {
                self.free_offsets.remove(&s);
                start = s;
                len += l;
            }
        }
        if let Some(l) = self.free_offsets.remove(&(start + len)) {
            len += l;
        }
        if start + len == self.file_end {
            self.file_end = start;
        } else {
            self.free_offsets.insert(start, len);
        }
    }

    /// Frees a chunk's memory: its RAM goes back to the OS and its offsets to the free list.
    fn free_chunk(&mut self, id: u64) {
        if let Some(c) = self.chunks.remove(&id) {
            if c.imported.is_some() {
                return;
            }
            self.live_chunk_bytes -= c.size;
            if c.exported {
                return;
            }
            // A failed punch (tmpfs always supports it) would only keep RAM busy; CUDA leaves a
            // fresh chunk's contents unspecified, so reusing unpunched offsets is still correct.
            let _ = sys::punch_hole(&self.fd, c.offset, c.size);
            self.free_offsets(c.offset, c.size);
        }
    }

    /// The reservation holding all of `[va, end)`, if one does.
    fn reservation_of(&self, va: u64, end: u64) -> Option<(u64, u64)> {
        let (&base, &size) = self.reservations.range(..=va).next_back()?;
        (end <= base + size).then_some((base, size))
    }

    /// The mapping holding byte `va`, if one does.
    fn mapping_at(&self, va: u64) -> Option<(u64, Mapping)> {
        let (&start, &m) = self.mappings.range(..=va).next_back()?;
        (va < start + m.size).then_some((start, m))
    }

    fn any_mapped_in(&self, va: u64, end: u64) -> bool {
        self.mapping_at(va).is_some() || self.mappings.range(va..end).next().is_some()
    }

    /// Whether consecutive mappings cover `[va, end)` with no gap; the first byte not covered
    /// otherwise.
    fn covered(&self, va: u64, end: u64) -> Result<(), u64> {
        let (start, m) = self.mapping_at(va).ok_or(va)?;
        let mut cur = start + m.size;
        while cur < end {
            cur += self.mappings.get(&cur).ok_or(cur)?.size;
        }
        Ok(())
    }

    /// Makes `[start, end)` accessible to this device and to `peers`.
    fn add_accessible(&mut self, start: u64, end: u64, peers: &[i32]) {
        add_span(&mut self.accessible, start, end);
        for p in peers {
            add_span(self.peer_accessible.entry(*p).or_default(), start, end);
        }
    }

    /// Makes `[start, end)` accessible to no device (it is being unmapped).
    fn remove_accessible(&mut self, start: u64, end: u64) {
        remove_span(&mut self.accessible, start, end);
        for spans in self.peer_accessible.values_mut() {
            remove_span(spans, start, end);
        }
    }

    fn is_accessible(&self, start: u64, end: u64) -> bool {
        covers(&self.accessible, start, end)
    }

    /// Checks that `[addr, addr + len)` may be copied to or from.
    fn check_copy(&self, addr: DevicePtr, len: usize) -> DriverResult<()> {
        let end = addr.checked_add(len as u64).ok_or_else(|| {
            err(
                CallKind::Copy,
                code::INVALID_VALUE,
                format!("copy: range {addr:#x} + {len} overflows"),
            )
        })?;
        if !self.is_accessible(addr, end) {
            return Err(err(
                CallKind::Copy,
                code::INVALID_VALUE,
                format!(
                    "copy: [{addr:#x}, {end:#x}) is not accessible: map it and call set_access on it first"
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for HostDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("HostDriver");
        d.field("page_size", &self.page_size).field("capacity", &self.capacity);
        // try_lock: formatting must never wait on (or deadlock with) a call in flight.
        match self.state.try_lock() {
            Ok(st) => d
                .field("live_chunk_bytes", &st.live_chunk_bytes)
                .field("chunks", &st.chunks.len())
                .field("reservations", &st.reservations.len())
                .field("mappings", &st.mappings.len()),
            Err(_) => d.field("state", &"<busy>"),
        };
        d.finish()
    }
}

impl Driver for HostDriver {
    fn name(&self) -> &'static str {
        "host"
    }

    fn granularity(&self) -> usize {
        self.page_size
    }

    fn mem_info(&self) -> DriverResult<MemInfo> {
        let live = self.lock().live_chunk_bytes;
        Ok(MemInfo { free: self.capacity - live, total: self.capacity })
    }

    fn reserve(&self, size: usize, alignment: usize) -> DriverResult<DevicePtr> {
        let call = CallKind::Reserve;
        let ps = self.page_size;
        if size == 0 || size % ps != 0 {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("reserve: size {size} is not a non-zero multiple of granularity {ps}"),
            ));
        }
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("reserve: alignment {alignment} is not a power of two (or 0 for the granularity)"),
            ));
        }
        // Mappings must land on granularity boundaries, so no reservation is aligned to less.
        let align = alignment.max(ps);
        let padded = size.checked_add(align).ok_or_else(|| {
            err(
                call,
                code::INVALID_VALUE,
                format!("reserve: size {size} + alignment {align} overflows"),
            )
        })?;
        let mut st = self.lock();
        let raw = sys::reserve_anywhere(padded).map_err(|e| os_err(call, "reserve: mmap", e))?;
        let base = raw.next_multiple_of(align as u64);
        let head = base - raw;
        let tail = padded as u64 - head - size as u64;
        // SAFETY: [raw, raw + padded) is the fresh mapping made just above, known to no one else;
        // the head and tail trimmed here lie inside it and outside [base, base + size).
        unsafe {
            // A failed trim only leaves unused address space reserved, which is harmless.
            if head > 0 {
                let _ = sys::unmap(raw, head);
            }
            if tail > 0 {
                let _ = sys::unmap(base + size as u64, tail);
            }
        }
        st.reservations.insert(base, size as u64);
        Ok(base)
    }

    fn free_reservation(&self, base: DevicePtr, size: usize) -> DriverResult<()> {
        let call = CallKind::FreeReservation;
        let mut st = self.lock();
        match st.reservations.get(&base) {
            Some(&s) if s == size as u64 => {}
            Some(&s) => {
                return Err(err(
                    call,
                    code::INVALID_VALUE,
                    format!(
                        "free_reservation: reservation at {base:#x} is {s} bytes, not {size}; free it whole"
                    ),
                ))
            }
            None => {
                return Err(err(
                    call,
                    code::INVALID_VALUE,
                    format!("free_reservation: {base:#x} is not the base of a reservation"),
                ))
            }
        }
        let end = base + size as u64;
        if st.any_mapped_in(base, end) {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("free_reservation: [{base:#x}, {end:#x}) is still mapped; unmap it first"),
            ));
        }
        // SAFETY: [base, end) is a reservation of ours (checked above) with nothing mapped in it,
        // so no reference into it can be live; it is forgotten below, never to be touched again.
        unsafe { sys::unmap(base, size as u64) }
            .map_err(|e| os_err(call, "free_reservation: munmap", e))?;
        st.reservations.remove(&base);
        Ok(())
    }

    fn create_chunk(&self, size: usize) -> DriverResult<ChunkHandle> {
        let call = CallKind::Create;
        let ps = self.page_size;
        if size == 0 || size % ps != 0 {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("create_chunk: size {size} is not a non-zero multiple of granularity {ps}"),
            ));
        }
        let size = size as u64;
        let mut st = self.lock();
        let live = st.live_chunk_bytes;
        if live.checked_add(size).map_or(true, |total| total > self.capacity) {
            return Err(err(
                call,
                code::OUT_OF_MEMORY,
                format!(
                    "create_chunk: {size} bytes do not fit: {live} of {} bytes are in use",
                    self.capacity
                ),
            ));
        }
        let offset =
            st.alloc_offsets(size).map_err(|e| os_err(call, "create_chunk: ftruncate", e))?;
        let id = st.next_chunk;
        st.next_chunk += 1;
        st.chunks.insert(id, Chunk::new(offset, size));
        st.live_chunk_bytes += size;
        Ok(ChunkHandle(id))
    }

    fn release_chunk(&self, handle: ChunkHandle) -> DriverResult<()> {
        let mut st = self.lock();
        let chunk = match st.chunks.get_mut(&handle.0) {
            Some(c) if !c.released => c,
            _ => {
                return Err(err(
                    CallKind::Release,
                    code::INVALID_HANDLE,
                    format!("release_chunk: chunk {} is unknown or already released", handle.0),
                ))
            }
        };
        chunk.released = true;
        if chunk.maps == 0 {
            st.free_chunk(handle.0);
        }
        Ok(())
    }

    fn map(&self, va: DevicePtr, size: usize, handle: ChunkHandle) -> DriverResult<()> {
        let call = CallKind::Map;
        let end = self.check_aligned(call, va, size)?;
        let size = size as u64;
        let mut st = self.lock();
        let (offset, chunk_size, file) = match st.chunks.get(&handle.0) {
            Some(c) if !c.released => (c.offset, c.size, c.imported.clone()),
            _ => {
                return Err(err(
                    call,
                    code::INVALID_HANDLE,
                    format!("map: chunk {} is unknown or released", handle.0),
                ))
            }
        };
        if size != chunk_size {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!(
                    "map: size {size} differs from chunk {}'s size {chunk_size}; map chunks whole",
                    handle.0
                ),
            ));
        }
        if st.reservation_of(va, end).is_none() {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("map: [{va:#x}, {end:#x}) is not inside one reservation"),
            ));
        }
        if st.any_mapped_in(va, end) {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!(
                    "map: [{va:#x}, {end:#x}) is already mapped, in part or whole; unmap it first"
                ),
            ));
        }
        // SAFETY: [va, end) lies in one of our reservations and nothing is mapped there (both
        // checked above under the lock), so it holds only our PROT_NONE placeholder, which no
        // reference can point into; [offset, offset + size) is this chunk's part of its file.
        let mapped =
            unsafe { sys::map_shared_fixed(va, size, file.as_deref().unwrap_or(&st.fd), offset) };
        if let Err(e) = mapped {
            // A failed MAP_FIXED may have dropped the placeholder; put it back so the range stays
            // reserved. If that fails too, the range is merely unreserved, not corrupted.
            // SAFETY: as above, [va, end) is ours and holds nothing anyone can reference.
            let _ = unsafe { sys::reserve_fixed(va, size) };
            return Err(os_err(call, "map: mmap", e));
        }
        st.mappings.insert(va, Mapping { size, chunk: handle.0 });
        if let Some(c) = st.chunks.get_mut(&handle.0) {
            c.maps += 1;
        }
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, size: usize) -> DriverResult<()> {
        let call = CallKind::SetAccess;
        let end = self.check_aligned(call, va, size)?;
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut st = self.lock();
        if let Err(hole) = st.covered(va, end) {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("set_access: [{va:#x}, {end:#x}) is not all mapped: {hole:#x} is not"),
            ));
        }
        // SAFETY: [va, end) is covered by our own mappings (checked above under the lock);
        // widening their protection invalidates no reference.
        unsafe { sys::protect_rw(va, size as u64) }
            .map_err(|e| os_err(call, "set_access: mprotect", e))?;
        st.add_accessible(va, end, &peers);
        Ok(())
    }

    fn set_peers(&self, peers: &[i32]) -> DriverResult<()> {
        if let Some(&bad) = peers.iter().find(|&&p| p == 0 || !(0..HOST_DEVICES).contains(&p)) {
            return Err(err(
                CallKind::PeerAccess,
                code::INVALID_VALUE,
                format!(
                    "device {bad} cannot be a peer of the host backend's device 0: it models \
                     devices 0..{HOST_DEVICES}, and a device is not its own peer"
                ),
            ));
        }
        *self.peers.lock().unwrap_or_else(|e| e.into_inner()) = peers.to_vec();
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, size: usize) -> DriverResult<()> {
        let call = CallKind::Unmap;
        let end = self.check_aligned(call, va, size)?;
        let mut st = self.lock();
        let mut spanned = Vec::new();
        let mut cur = va;
        while cur < end {
            let Some(m) = st.mappings.get(&cur) else {
                let why = match st.mapping_at(cur) {
                    Some((s, m)) => format!(
                        "{cur:#x} is inside the mapping [{s:#x}, {:#x}); unmap whole mappings only",
                        s + m.size
                    ),
                    None => format!("nothing is mapped at {cur:#x}"),
                };
                return Err(err(
                    call,
                    code::INVALID_VALUE,
                    format!("unmap: [{va:#x}, {end:#x}) is not a run of whole mappings: {why}"),
                ));
            };
            spanned.push((cur, m.chunk));
            cur += m.size;
        }
        if cur != end {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!(
                    "unmap: [{va:#x}, {end:#x}) ends inside the mapping that ends at {cur:#x}; unmap whole mappings only"
                ),
            ));
        }
        // SAFETY: [va, end) is exactly a run of our own mappings inside our reservations (checked
        // above under the lock); the caller gives up any pointer into it by unmapping it, and this
        // backend's own copies hold the lock, so none is in flight.
        unsafe { sys::reserve_fixed(va, size as u64) }
            .map_err(|e| os_err(call, "unmap: mmap", e))?;
        st.remove_accessible(va, end);
        for (start, chunk) in spanned {
            st.mappings.remove(&start);
            let gone = match st.chunks.get_mut(&chunk) {
                Some(c) => {
                    c.maps -= 1;
                    c.released && c.maps == 0
                }
                None => false,
            };
            if gone {
                st.free_chunk(chunk);
            }
        }
        Ok(())
    }

    fn write(&self, dst: DevicePtr, src: &[u8]) -> DriverResult<()> {
        if src.is_empty() {
            return Ok(());
        }
        let st = self.lock();
        st.check_copy(dst, src.len())?;
        // SAFETY: [dst, dst + len) is mapped read-write (checked above) and stays so while we
        // hold the lock; `src` is a live slice, which cannot overlap it without the caller
        // having aliased device memory behind a shared borrow.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as usize as *mut u8, src.len()) };
        Ok(())
    }

    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> DriverResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let st = self.lock();
        st.check_copy(src, dst.len())?;
        // SAFETY: [src, src + len) is mapped readable (checked above) and stays so while we hold
        // the lock; `dst` is an exclusive borrow, so nothing else aliases it.
        unsafe {
            std::ptr::copy_nonoverlapping(src as usize as *const u8, dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    fn create_stream(&self) -> DriverResult<StreamHandle> {
        let mut st = self.lock();
        let id = st.next_stream;
        st.next_stream += 1;
        st.streams.insert(id, None);
        Ok(StreamHandle(id))
    }

    fn destroy_stream(&self, stream: StreamHandle) -> DriverResult<()> {
        if stream == StreamHandle::DEFAULT {
            return Err(err(
                CallKind::StreamDestroy,
                code::INVALID_HANDLE,
                "destroy_stream: the default stream cannot be destroyed",
            ));
        }
        // Work pending on a destroyed stream still completes, so its events become done: their
        // hold token no longer matches any stream's.
        match self.lock().streams.remove(&stream.0) {
            Some(_) => Ok(()),
            None => Err(err(
                CallKind::StreamDestroy,
                code::INVALID_HANDLE,
                format!("destroy_stream: stream {} is unknown", stream.0),
            )),
        }
    }

    fn create_event(&self) -> DriverResult<EventHandle> {
        let mut st = self.lock();
        let id = st.next_event;
        st.next_event += 1;
        st.events.insert(id, EventState::Done);
        Ok(EventHandle(id))
    }

    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> DriverResult<()> {
        let call = CallKind::EventRecord;
        let mut st = self.lock();
        if st.capturing.contains_key(&stream.0) {
            // On CUDA the record would join the graph being captured instead.
            return Err(err(
                call,
                code::STREAM_CAPTURE_UNSUPPORTED,
                format!("record_event: stream {} is being captured into a graph", stream.0),
            ));
        }
        let Some(&hold) = st.streams.get(&stream.0) else {
            return Err(err(
                call,
                code::INVALID_HANDLE,
                format!("record_event: stream {} is unknown", stream.0),
            ));
        };
        let Some(ev) = st.events.get_mut(&event.0) else {
            return Err(err(
                call,
                code::INVALID_HANDLE,
                format!("record_event: event {} is unknown", event.0),
            ));
        };
        *ev = match hold {
            Some(hold) => EventState::Pending { stream: stream.0, hold },
            None => EventState::Done,
        };
        Ok(())
    }

    fn event_done(&self, event: EventHandle) -> DriverResult<bool> {
        let st = self.lock();
        match st.events.get(&event.0) {
            Some(EventState::Done) => Ok(true),
            Some(&EventState::Pending { stream, hold }) => {
                Ok(st.streams.get(&stream).copied().flatten() != Some(hold))
            }
            None => Err(err(
                CallKind::EventQuery,
                code::INVALID_HANDLE,
                format!("event_done: event {} is unknown", event.0),
            )),
        }
    }

    fn destroy_event(&self, event: EventHandle) -> DriverResult<()> {
        match self.lock().events.remove(&event.0) {
            Some(_) => Ok(()),
            None => Err(err(
                CallKind::EventDestroy,
                code::INVALID_HANDLE,
                format!("destroy_event: event {} is unknown", event.0),
            )),
        }
    }

    fn synchronize_event(&self, event: EventHandle) -> DriverResult<()> {
        // Nothing runs on the host model, so a held stream finishes only when a test ends the
        // hold: wait as long as `wait_on_held_streams` allows (by default not at all), then
        // refuse rather than hang.
        let (limit, start) = (self.lock().sync_wait, crate::sync::Instant::now());
        let mut done = self.event_done(event);
        while matches!(done, Ok(false)) && start.elapsed() < limit {
            crate::sync::pause(std::time::Duration::from_millis(1));
            done = self.event_done(event);
        }
        match done {
            Ok(true) => Ok(()),
            Ok(false) => Err(err(
                CallKind::EventSynchronize,
                code::NOT_READY,
                format!("synchronize_event: event {} waits on a held stream", event.0),
            )),
            Err(e) => Err(DriverError { call: CallKind::EventSynchronize, ..e }),
        }
    }

    fn is_capturing(&self, stream: StreamHandle) -> DriverResult<bool> {
        Ok(self.lock().capturing.contains_key(&stream.0))
    }

    fn capture_id(&self, stream: StreamHandle) -> DriverResult<Option<u64>> {
        Ok(self.lock().capturing.get(&stream.0).copied())
    }

    /// Shares the memfd (or, for a chunk imported here, the file it came from) with the
    /// chunk's offsets. Unlike CUDA's descriptor, which names one chunk, it reaches the whole
    /// file; importers map only `[offset, offset + size)`.
    fn export_chunk(&self, handle: ChunkHandle, size: usize) -> DriverResult<SharedChunk> {
        let call = CallKind::Export;
        let mut st = self.lock();
        let st = &mut *st;
        let chunk = match st.chunks.get_mut(&handle.0) {
            Some(c) if !c.released => c,
            _ => {
                return Err(err(
                    call,
                    code::INVALID_HANDLE,
                    format!("export_chunk: chunk {} is unknown or released", handle.0),
                ))
            }
        };
        if chunk.size != size as u64 {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!(
                    "export_chunk: size {size} differs from chunk {}'s {}",
                    handle.0, chunk.size
                ),
            ));
        }
        let file = chunk.imported.as_deref().unwrap_or(&st.fd);
        let fd = file.try_clone().map_err(|e| os_err(call, "export_chunk: dup", e))?;
        chunk.exported = true;
        Ok(SharedChunk { fd, offset: chunk.offset, size: chunk.size })
    }

    fn import_chunk(&self, shared: &SharedChunk) -> DriverResult<ChunkHandle> {
        let call = CallKind::Import;
        let (offset, size) = (shared.offset, shared.size);
        let ps = self.page_size as u64;
        if size == 0 || size % ps != 0 || offset % ps != 0 {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!(
                    "import_chunk: offset {offset} and size {size} must be multiples of the \
                     granularity {ps}, the size non-zero"
                ),
            ));
        }
        let len = sys::file_len(&shared.fd).map_err(|e| os_err(call, "import_chunk: fstat", e))?;
        if offset.checked_add(size).map_or(true, |end| end > len) {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("import_chunk: [{offset}, +{size}) is past the file's end ({len} bytes)"),
            ));
        }
        let fd = shared.fd.try_clone().map_err(|e| os_err(call, "import_chunk: dup", e))?;
        let mut st = self.lock();
        let id = st.next_chunk;
        st.next_chunk += 1;
        st.chunks.insert(id, Chunk { imported: Some(Arc::new(fd)), ..Chunk::new(offset, size) });
        Ok(ChunkHandle(id))
    }

    fn shareable(&self) -> bool {
        true
    }
}

impl Drop for HostDriver {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        // Every mapping lies in a reservation, so unmapping the reservations drops them too.
        for (&base, &size) in &st.reservations {
            // SAFETY: the reservation is ours, and `&mut self` means no call is in flight; any
            // pointer the caller still holds into it was only valid while the driver lived.
            let _ = unsafe { sys::unmap(base, size) };
        }
        st.reservations.clear();
        st.mappings.clear();
        // The memfd closes when `st.fd` drops.
    }
}

/// The system calls, each in one small wrapper.
mod sys {
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    fn check(rc: libc::c_int) -> io::Result<()> {
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn check_map(p: *mut libc::c_void) -> io::Result<u64> {
        if p == libc::MAP_FAILED {
            Err(io::Error::last_os_error())
        } else {
            Ok(p as usize as u64)
        }
    }

    fn off(x: u64) -> io::Result<libc::off_t> {
        libc::off_t::try_from(x).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))
    }

    pub(super) fn os_page_size() -> usize {
        // SAFETY: sysconf reads a constant and has no preconditions.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
    }

    pub(super) fn memfd() -> io::Result<OwnedFd> {
        // SAFETY: the name is a NUL-terminated literal; memfd_create touches no caller memory.
        let fd = unsafe { libc::memfd_create(c"moonbright-host".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The size of `fd`'s file.
    pub(super) fn file_len(fd: &OwnedFd) -> io::Result<u64> {
        Ok(std::fs::File::from(fd.try_clone()?).metadata()?.len())
    }

    pub(super) fn set_len(fd: &OwnedFd, len: u64) -> io::Result<()> {
        // SAFETY: ftruncate on an fd we own; a sparse grow allocates nothing.
        check(unsafe { libc::ftruncate(fd.as_raw_fd(), off(len)?) })
    }

    pub(super) fn punch_hole(fd: &OwnedFd, offset: u64, len: u64) -> io::Result<()> {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // SAFETY: fallocate on an fd we own; the range belongs to a chunk mapped nowhere.
        check(unsafe { libc::fallocate(fd.as_raw_fd(), mode, off(offset)?, off(len)?) })
    }

    pub(super) fn allocated_bytes(fd: &OwnedFd) -> io::Result<u64> {
        let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes a whole `stat` into the buffer we pass on success.
        check(unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) })?;
        // SAFETY: fstat succeeded, so the buffer is initialised.
        let stat = unsafe { stat.assume_init() };
        Ok(u64::try_from(stat.st_blocks).unwrap_or(0) * 512)
    }

    pub(super) const RESERVE_FLAGS: libc::c_int =
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;

    /// Fresh inaccessible address space anywhere; costs no memory.
    pub(super) fn reserve_anywhere(len: usize) -> io::Result<u64> {
        // SAFETY: without MAP_FIXED the kernel picks unused addresses, so nothing is replaced.
        check_map(unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, RESERVE_FLAGS, -1, 0)
        })
    }

    /// Replaces `[va, va + len)` with inaccessible placeholder pages.
    ///
    /// # Safety
    /// The range must be address space this driver owns, with no live reference into it.
    pub(super) unsafe fn reserve_fixed(va: u64, len: u64) -> io::Result<()> {
        let flags = RESERVE_FLAGS | libc::MAP_FIXED;
        // SAFETY: the caller owns the range and nothing points into it.
        let p = unsafe {
            libc::mmap(va as usize as *mut _, len as usize, libc::PROT_NONE, flags, -1, 0)
        };
        check_map(p).map(drop)
    }

    /// Maps `len` bytes of `fd` at `offset` over `[va, va + len)`, inaccessible for now.
    ///
    /// # Safety
    /// As for [`reserve_fixed`].
    pub(super) unsafe fn map_shared_fixed(
        va: u64,
        len: u64,
        fd: &OwnedFd,
        offset: u64,
    ) -> io::Result<()> {
        let flags = libc::MAP_SHARED | libc::MAP_FIXED;
        // SAFETY: the caller owns the range and nothing points into it.
        let p = unsafe {
            libc::mmap(
                va as usize as *mut _,
                len as usize,
                libc::PROT_NONE,
                flags,
                fd.as_raw_fd(),
                off(offset)?,
            )
        };
        check_map(p).map(drop)
    }

    /// Makes `[va, va + len)` readable and writable.
    ///
    /// # Safety
    /// The range must be mappings this driver owns.
    pub(super) unsafe fn protect_rw(va: u64, len: u64) -> io::Result<()> {
        // SAFETY: the caller owns the range; adding permissions breaks no reference.
        check(unsafe {
            libc::mprotect(va as usize as *mut _, len as usize, libc::PROT_READ | libc::PROT_WRITE)
        })
    }

    /// Gives `[va, va + len)` back to the OS.
    ///
    /// # Safety
    /// As for [`reserve_fixed`].
    pub(super) unsafe fn unmap(va: u64, len: u64) -> io::Result<()> {
        // SAFETY: the caller owns the range and nothing points into it.
        check(unsafe { libc::munmap(va as usize as *mut _, len as usize) })
    }
}

// Not under Miri: these tests run the host backend's memfd and mmap calls (or the CUDA
// driver), which Miri cannot interpret.
#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;

    const PS: usize = 64 << 10;

    fn driver(capacity: u64) -> HostDriver {
        match HostDriver::new(HostConfig { page_size: PS, capacity }) {
            Ok(d) => d,
            Err(e) => panic!("host driver: {e}"),
        }
    }

    fn small() -> HostDriver {
        driver(64 * PS as u64)
    }

    #[track_caller]
    fn expect_code<T: fmt::Debug>(r: DriverResult<T>, call: CallKind, code: i32) -> DriverError {
        match r {
            Ok(v) => panic!("expected {call} to fail with code {code}, got Ok({v:?})"),
            Err(e) => {
                assert_eq!((e.call, e.code), (call, code), "wrong error: {e}");
                e
            }
        }
    }

    /// A reservation of `pages` pages with one chunk of `chunk_pages` mapped at its start.
    fn mapped(d: &HostDriver, pages: usize, chunk_pages: usize) -> (u64, ChunkHandle) {
        let base = d.reserve(pages * PS, 0).unwrap();
        let c = d.create_chunk(chunk_pages * PS).unwrap();
        d.map(base, chunk_pages * PS, c).unwrap();
        (base, c)
    }

    #[test]
    fn is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<HostDriver>();
    }

    #[test]
    fn new_rejects_bad_config() {
        for (page_size, capacity) in [(0, 1 << 30), (3 << 16, 1 << 30), (1024, 1 << 30), (PS, 0)] {
            let r = HostDriver::new(HostConfig { page_size, capacity });
            expect_code(r, CallKind::MemInfo, code::INVALID_VALUE);
        }
        let d = HostDriver::new(HostConfig::default()).unwrap();
        assert_eq!(d.granularity(), 2 << 20);
        assert_eq!(d.mem_info().unwrap(), MemInfo { free: 64 << 30, total: 64 << 30 });
        assert_eq!(d.name(), "host");
    }

    #[test]
    fn reserve_honours_alignment_and_rejects_bad_sizes() {
        let d = small();
        let big = 16 * PS;
        for _ in 0..4 {
            let va = d.reserve(PS, big).unwrap();
            assert_eq!(va % big as u64, 0);
        }
        assert_eq!(d.reserve(3 * PS, 0).unwrap() % PS as u64, 0);
        expect_code(d.reserve(0, 0), CallKind::Reserve, code::INVALID_VALUE);
        expect_code(d.reserve(PS + 1, 0), CallKind::Reserve, code::INVALID_VALUE);
        expect_code(d.reserve(PS, 3 * PS), CallKind::Reserve, code::INVALID_VALUE);
    }

    #[test]
    fn create_rejects_sizes_off_the_granularity() {
        let d = small();
        expect_code(d.create_chunk(0), CallKind::Create, code::INVALID_VALUE);
        expect_code(d.create_chunk(PS / 2), CallKind::Create, code::INVALID_VALUE);
        expect_code(d.create_chunk(PS + 4096), CallKind::Create, code::INVALID_VALUE);
        let a = d.create_chunk(PS).unwrap();
        let b = d.create_chunk(PS).unwrap();
        assert!(b.0 > a.0, "handles increase");
        d.release_chunk(b).unwrap();
        let c = d.create_chunk(PS).unwrap();
        assert!(c.0 > b.0, "handles are never reused");
    }

    #[test]
    fn map_rejects_misaligned_va_and_size() {
        let d = small();
        let base = d.reserve(4 * PS, 0).unwrap();
        let c = d.create_chunk(PS).unwrap();
        let e = expect_code(d.map(base + 4096, PS, c), CallKind::Map, code::INVALID_VALUE);
        assert!(e.message.contains("not aligned"), "{e}");
        expect_code(d.map(base, PS + 4096, c), CallKind::Map, code::INVALID_VALUE);
        expect_code(d.map(base, 0, c), CallKind::Map, code::INVALID_VALUE);
        expect_code(d.map(0, PS, c), CallKind::Map, code::INVALID_VALUE);
        assert_eq!(d.mapping_count(), 0);
        d.map(base, PS, c).unwrap();
        assert_eq!(d.mapping_count(), 1);
    }

    #[test]
    fn map_rejects_a_size_other_than_the_chunks() {
        let d = small();
        let base = d.reserve(4 * PS, 0).unwrap();
        let c = d.create_chunk(2 * PS).unwrap();
        expect_code(d.map(base, PS, c), CallKind::Map, code::INVALID_VALUE);
        expect_code(d.map(base, 3 * PS, c), CallKind::Map, code::INVALID_VALUE);
        d.map(base, 2 * PS, c).unwrap();
    }

    #[test]
    fn map_rejects_already_mapped_ranges() {
        let d = small();
        let (base, c) = mapped(&d, 4, 2);
        let e = expect_code(d.map(base, 2 * PS, c), CallKind::Map, code::INVALID_VALUE);
        assert!(e.message.contains("already mapped"), "{e}");
        let other = d.create_chunk(2 * PS).unwrap();
        // Overlapping the tail of the existing mapping, from inside it.
        let e =
            expect_code(d.map(base + PS as u64, 2 * PS, other), CallKind::Map, code::INVALID_VALUE);
        assert!(e.message.contains("already mapped"), "{e}");
        d.map(base + 2 * PS as u64, 2 * PS, other).unwrap();
        assert_eq!(d.mapping_count(), 2);
    }

    #[test]
    fn map_rejects_ranges_outside_one_reservation() {
        let d = small();
        let base = d.reserve(2 * PS, 0).unwrap();
        let c = d.create_chunk(2 * PS).unwrap();
        // Runs past the end of the reservation.
        let e = expect_code(d.map(base + PS as u64, 2 * PS, c), CallKind::Map, code::INVALID_VALUE);
        assert!(e.message.contains("reservation"), "{e}");
        // Wholly outside any reservation (just past it: munmapped tail or someone else's).
        let past = base + 64 * PS as u64;
        expect_code(d.map(past, 2 * PS, c), CallKind::Map, code::INVALID_VALUE);
        // A freed reservation no longer counts.
        let gone = d.reserve(2 * PS, 0).unwrap();
        d.free_reservation(gone, 2 * PS).unwrap();
        expect_code(d.map(gone, 2 * PS, c), CallKind::Map, code::INVALID_VALUE);
        assert_eq!(d.mapping_count(), 0);
    }

    #[test]
    fn map_rejects_released_and_unknown_handles() {
        let d = small();
        let base = d.reserve(4 * PS, 0).unwrap();
        let c = d.create_chunk(PS).unwrap();
        d.release_chunk(c).unwrap();
        expect_code(d.map(base, PS, c), CallKind::Map, code::INVALID_HANDLE);
        expect_code(d.map(base, PS, ChunkHandle(9999)), CallKind::Map, code::INVALID_HANDLE);
        // Released while mapped: the live mapping stays, but no new one may be made.
        let m = d.create_chunk(PS).unwrap();
        d.map(base, PS, m).unwrap();
        d.release_chunk(m).unwrap();
        expect_code(d.map(base + PS as u64, PS, m), CallKind::Map, code::INVALID_HANDLE);
    }

    #[test]
    fn unmap_rejects_part_of_a_mapping() {
        let d = small();
        let (base, _) = mapped(&d, 4, 2);
        for (va, size) in
            [(base, PS), (base + PS as u64, PS), (base + PS as u64, 3 * PS), (base, 3 * PS)]
        {
            expect_code(d.unmap(va, size), CallKind::Unmap, code::INVALID_VALUE);
        }
        assert_eq!(d.mapping_count(), 1);
        d.unmap(base, 2 * PS).unwrap();
        assert_eq!(d.mapping_count(), 0);
    }

    #[test]
    fn unmap_spanning_two_mappings_is_accepted() {
        let d = small();
        let (base, a) = mapped(&d, 4, 1);
        let b = d.create_chunk(2 * PS).unwrap();
        d.map(base + PS as u64, 2 * PS, b).unwrap();
        d.set_access(base, 3 * PS).unwrap();
        d.write(base + PS as u64 - 2, &[7, 8, 9, 10]).unwrap();
        let mut got = [0u8; 4];
        d.read(base + PS as u64 - 2, &mut got).unwrap();
        assert_eq!(got, [7, 8, 9, 10]);
        d.unmap(base, 3 * PS).unwrap();
        assert_eq!(d.mapping_count(), 0);
        // Both chunks survive the unmap (not released), and the addresses stay reserved.
        d.map(base, 2 * PS, b).unwrap();
        d.map(base + 2 * PS as u64, PS, a).unwrap();
    }

    #[test]
    fn unmap_rejects_unmapped_ranges() {
        let d = small();
        let base = d.reserve(4 * PS, 0).unwrap();
        let e = expect_code(d.unmap(base, PS), CallKind::Unmap, code::INVALID_VALUE);
        assert!(e.message.contains("nothing is mapped"), "{e}");
        let c = d.create_chunk(PS).unwrap();
        d.map(base, PS, c).unwrap();
        // Mapped then a gap.
        expect_code(d.unmap(base, 2 * PS), CallKind::Unmap, code::INVALID_VALUE);
        d.unmap(base, PS).unwrap();
        expect_code(d.unmap(base, PS), CallKind::Unmap, code::INVALID_VALUE);
        expect_code(d.unmap(base + 4096, PS), CallKind::Unmap, code::INVALID_VALUE);
    }

    #[test]
    fn set_access_rejects_gaps_and_allows_sub_ranges() {
        let d = small();
        let (base, _) = mapped(&d, 4, 1);
        let c = d.create_chunk(2 * PS).unwrap();
        d.map(base + 2 * PS as u64, 2 * PS, c).unwrap();
        // Page 1 is a hole.
        let e = expect_code(d.set_access(base, 4 * PS), CallKind::SetAccess, code::INVALID_VALUE);
        assert!(e.message.contains("not all mapped"), "{e}");
        expect_code(d.set_access(base + PS as u64, PS), CallKind::SetAccess, code::INVALID_VALUE);
        expect_code(
            d.set_access(base + 3 * PS as u64, 2 * PS),
            CallKind::SetAccess,
            code::INVALID_VALUE,
        );
        expect_code(d.set_access(base + 1, PS), CallKind::SetAccess, code::INVALID_VALUE);
        // A sub-range of one mapping: only that part becomes accessible.
        d.set_access(base + 3 * PS as u64, PS).unwrap();
        d.write(base + 3 * PS as u64, &[1; 16]).unwrap();
        expect_code(d.write(base + 2 * PS as u64, &[1; 16]), CallKind::Copy, code::INVALID_VALUE);
        expect_code(
            d.write(base + 3 * PS as u64 - 8, &[1; 16]),
            CallKind::Copy,
            code::INVALID_VALUE,
        );
    }

    #[test]
    fn read_and_write_need_set_access() {
        let d = small();
        let (base, c) = mapped(&d, 2, 1);
        let mut buf = [0u8; 8];
        let e = expect_code(d.write(base, &[1; 8]), CallKind::Copy, code::INVALID_VALUE);
        assert!(e.message.contains("not accessible"), "{e}");
        expect_code(d.read(base, &mut buf), CallKind::Copy, code::INVALID_VALUE);
        d.set_access(base, PS).unwrap();
        d.write(base, &[1; 8]).unwrap();
        d.read(base, &mut buf).unwrap();
        assert_eq!(buf, [1; 8]);
        // Past the end of the accessible range, and on unmapped memory.
        expect_code(d.read(base + PS as u64 - 4, &mut buf), CallKind::Copy, code::INVALID_VALUE);
        expect_code(d.read(base + PS as u64, &mut buf), CallKind::Copy, code::INVALID_VALUE);
        // A remap starts inaccessible again.
        d.unmap(base, PS).unwrap();
        d.map(base, PS, c).unwrap();
        expect_code(d.read(base, &mut buf), CallKind::Copy, code::INVALID_VALUE);
        d.set_access(base, PS).unwrap();
        d.read(base, &mut buf).unwrap();
        assert_eq!(buf, [1; 8], "the chunk kept its bytes across the remap");
    }

    #[test]
    fn free_reservation_rejects_mapped_and_inexact_ranges() {
        let d = small();
        let (base, _) = mapped(&d, 4, 1);
        let e = expect_code(
            d.free_reservation(base, 4 * PS),
            CallKind::FreeReservation,
            code::INVALID_VALUE,
        );
        assert!(e.message.contains("still mapped"), "{e}");
        expect_code(
            d.free_reservation(base, 2 * PS),
            CallKind::FreeReservation,
            code::INVALID_VALUE,
        );
        expect_code(
            d.free_reservation(base + PS as u64, 3 * PS),
            CallKind::FreeReservation,
            code::INVALID_VALUE,
        );
        d.unmap(base, PS).unwrap();
        d.free_reservation(base, 4 * PS).unwrap();
        expect_code(
            d.free_reservation(base, 4 * PS),
            CallKind::FreeReservation,
            code::INVALID_VALUE,
        );
    }

    #[test]
    fn data_written_through_one_mapping_reads_through_another() {
        let d = small();
        let (a, c) = mapped(&d, 2, 2);
        let b = d.reserve(2 * PS, 0).unwrap();
        d.map(b, 2 * PS, c).unwrap();
        d.set_access(a, 2 * PS).unwrap();
        d.set_access(b, 2 * PS).unwrap();
        let data: Vec<u8> = (0..3 * PS / 2).map(|i| (i * 31 % 251) as u8).collect();
        d.write(a + 100, &data).unwrap();
        let mut got = vec![0u8; data.len()];
        d.read(b + 100, &mut got).unwrap();
        assert_eq!(got, data);
        assert_eq!(d.mapping_count(), 2);
    }

    #[test]
    fn release_while_mapped_frees_at_the_last_unmap() {
        let cap = 8 * PS as u64;
        let d = driver(cap);
        let (a, c) = mapped(&d, 4, 4);
        let b = d.reserve(4 * PS, 0).unwrap();
        d.map(b, 4 * PS, c).unwrap();
        d.set_access(a, 4 * PS).unwrap();
        d.set_access(b, 4 * PS).unwrap();
        d.write(a, b"moonbright").unwrap();
        d.release_chunk(c).unwrap();
        expect_code(d.release_chunk(c), CallKind::Release, code::INVALID_HANDLE);
        assert_eq!(d.live_chunk_bytes(), 4 * PS as u64);
        assert_eq!(d.mem_info().unwrap().free, cap - 4 * PS as u64);
        let mut got = [0u8; 10];
        d.unmap(a, 4 * PS).unwrap();
        d.read(b, &mut got).unwrap();
        assert_eq!(&got, b"moonbright");
        assert_eq!(d.live_chunk_bytes(), 4 * PS as u64, "still mapped at b");
        d.unmap(b, 4 * PS).unwrap();
        assert_eq!(d.live_chunk_bytes(), 0);
        assert_eq!(d.mem_info().unwrap(), MemInfo { free: cap, total: cap });
        expect_code(d.release_chunk(c), CallKind::Release, code::INVALID_HANDLE);
    }

    #[test]
    fn create_fails_at_capacity_and_succeeds_after_a_release() {
        let d = driver(4 * PS as u64);
        let a = d.create_chunk(3 * PS).unwrap();
        let e = expect_code(d.create_chunk(2 * PS), CallKind::Create, code::OUT_OF_MEMORY);
        assert!(e.is_out_of_memory());
        let b = d.create_chunk(PS).unwrap();
        assert_eq!(d.mem_info().unwrap().free, 0);
        expect_code(d.create_chunk(PS), CallKind::Create, code::OUT_OF_MEMORY);
        d.release_chunk(a).unwrap();
        d.create_chunk(2 * PS).unwrap();
        d.release_chunk(b).unwrap();
        assert_eq!(d.live_chunk_bytes(), 2 * PS as u64);
    }

    #[test]
    fn freed_offsets_are_reused_and_come_back_zeroed() {
        let d = small();
        let a = d.create_chunk(2 * PS).unwrap();
        let b = d.create_chunk(PS).unwrap();
        let base = d.reserve(2 * PS, 0).unwrap();
        d.map(base, 2 * PS, a).unwrap();
        d.set_access(base, 2 * PS).unwrap();
        d.write(base, &[0xAB; 64]).unwrap();
        d.unmap(base, 2 * PS).unwrap();
        d.release_chunk(a).unwrap();
        let len = d.lock().file_len;
        // Fits in a's old offsets: the file does not grow, and the hole reads as zeros.
        let c = d.create_chunk(2 * PS).unwrap();
        assert_eq!(d.lock().file_len, len);
        assert_eq!(d.lock().chunks[&c.0].offset, 0);
        d.map(base, 2 * PS, c).unwrap();
        d.set_access(base, 2 * PS).unwrap();
        let mut got = [0xFFu8; 64];
        d.read(base, &mut got).unwrap();
        assert_eq!(got, [0; 64]);
        d.unmap(base, 2 * PS).unwrap();
        d.release_chunk(c).unwrap();
        d.release_chunk(b).unwrap();
        let st = d.lock();
        assert_eq!((st.file_end, st.free_offsets.len()), (0, 0), "everything coalesced back");
    }

    #[test]
    fn untouched_chunks_cost_no_ram_and_freed_chunks_are_punched() {
        let gib = 1usize << 30;
        let d = driver(4 << 30);
        let base = d.reserve(gib, 0).unwrap();
        let c = d.create_chunk(gib).unwrap();
        d.map(base, gib, c).unwrap();
        d.set_access(base, gib).unwrap();
        assert_eq!(d.resident_bytes(), 0, "a mapped, accessible, untouched GiB costs nothing");
        for i in 0..4u64 {
            d.write(base + i * (256 << 20), &[1; 4096]).unwrap();
        }
        let touched = d.resident_bytes();
        // Four pages, or four huge pages where shmem uses transparent huge pages.
        assert!((4 * 4096..=4 * (2 << 20)).contains(&touched), "resident {touched}");
        d.release_chunk(c).unwrap();
        assert_eq!(d.resident_bytes(), touched, "still mapped: not freed yet");
        d.unmap(base, gib).unwrap();
        assert_eq!(d.resident_bytes(), 0, "freed chunk punched out");
    }

    #[test]
    fn forty_gib_of_chunks_cost_only_the_bytes_touched() {
        // More device memory than a 24 GiB CI machine has RAM: fine while most of it is untouched.
        let d = HostDriver::new(HostConfig::default()).unwrap();
        let gib = 1usize << 30;
        let base = d.reserve(40 * gib, 0).unwrap();
        for i in 0..40u64 {
            let c = d.create_chunk(gib).unwrap();
            d.map(base + i * gib as u64, gib, c).unwrap();
            d.release_chunk(c).unwrap();
        }
        d.set_access(base, 40 * gib).unwrap();
        for i in 0..40u64 {
            d.write(base + i * gib as u64 + 12345, &[i as u8]).unwrap();
        }
        assert_eq!(d.mem_info().unwrap().free, 24 << 30);
        assert!(d.resident_bytes() <= 40 * (2 << 20), "resident {}", d.resident_bytes());
        let mut got = [0u8];
        d.read(base + 39 * gib as u64 + 12345, &mut got).unwrap();
        assert_eq!(got, [39]);
        d.unmap(base, 40 * gib).unwrap();
        assert_eq!((d.resident_bytes(), d.live_chunk_bytes()), (0, 0));
        d.free_reservation(base, 40 * gib).unwrap();
    }

    #[test]
    fn a_held_streams_event_stays_pending_until_release() {
        let d = small();
        let s = d.create_stream().unwrap();
        let e = d.create_event().unwrap();
        assert!(d.event_done(e).unwrap(), "never recorded: done");
        d.record_event(e, s).unwrap();
        assert!(d.event_done(e).unwrap());
        d.hold_stream(s);
        d.record_event(e, s).unwrap();
        let other = d.create_event().unwrap();
        d.record_event(other, StreamHandle::DEFAULT).unwrap();
        assert!(!d.event_done(e).unwrap());
        assert!(d.event_done(other).unwrap(), "another stream is not held");
        d.release_stream(s);
        assert!(d.event_done(e).unwrap());
        // A new hold does not revive events of the old one.
        d.hold_stream(s);
        assert!(d.event_done(e).unwrap());
        d.record_event(e, s).unwrap();
        assert!(!d.event_done(e).unwrap());
        // Re-recording on a free stream supersedes the pending record.
        d.record_event(e, StreamHandle::DEFAULT).unwrap();
        assert!(d.event_done(e).unwrap());
        // Destroying a held stream lets its work finish.
        d.record_event(e, s).unwrap();
        d.destroy_stream(s).unwrap();
        assert!(d.event_done(e).unwrap());
        // The default stream can be held too.
        d.hold_stream(StreamHandle::DEFAULT);
        d.record_event(e, StreamHandle::DEFAULT).unwrap();
        assert!(!d.event_done(e).unwrap());
        d.release_stream(StreamHandle::DEFAULT);
        assert!(d.event_done(e).unwrap());
    }

    #[test]
    fn unknown_handles_are_rejected() {
        let d = small();
        let s = d.create_stream().unwrap();
        let e = d.create_event().unwrap();
        expect_code(d.release_chunk(ChunkHandle(42)), CallKind::Release, code::INVALID_HANDLE);
        expect_code(
            d.destroy_stream(StreamHandle(42)),
            CallKind::StreamDestroy,
            code::INVALID_HANDLE,
        );
        expect_code(
            d.destroy_stream(StreamHandle::DEFAULT),
            CallKind::StreamDestroy,
            code::INVALID_HANDLE,
        );
        expect_code(
            d.record_event(e, StreamHandle(42)),
            CallKind::EventRecord,
            code::INVALID_HANDLE,
        );
        expect_code(
            d.record_event(EventHandle(42), s),
            CallKind::EventRecord,
            code::INVALID_HANDLE,
        );
        expect_code(d.event_done(EventHandle(42)), CallKind::EventQuery, code::INVALID_HANDLE);
        expect_code(d.destroy_event(EventHandle(42)), CallKind::EventDestroy, code::INVALID_HANDLE);
        d.destroy_stream(s).unwrap();
        d.destroy_event(e).unwrap();
        expect_code(d.destroy_stream(s), CallKind::StreamDestroy, code::INVALID_HANDLE);
        expect_code(
            d.record_event(e, StreamHandle::DEFAULT),
            CallKind::EventRecord,
            code::INVALID_HANDLE,
        );
        expect_code(d.event_done(e), CallKind::EventQuery, code::INVALID_HANDLE);
        expect_code(d.destroy_event(e), CallKind::EventDestroy, code::INVALID_HANDLE);
    }

    #[test]
    fn concurrent_use_from_threads() {
        let d = driver(256 * PS as u64);
        std::thread::scope(|scope| {
            for t in 0..4u8 {
                let d = &d;
                scope.spawn(move || {
                    for i in 0..20u8 {
                        let base = d.reserve(2 * PS, 0).unwrap();
                        let c = d.create_chunk(2 * PS).unwrap();
                        d.map(base, 2 * PS, c).unwrap();
                        d.set_access(base, 2 * PS).unwrap();
                        d.write(base + PS as u64, &[t, i]).unwrap();
                        d.release_chunk(c).unwrap();
                        let mut got = [0u8; 2];
                        d.read(base + PS as u64, &mut got).unwrap();
                        assert_eq!(got, [t, i]);
                        d.unmap(base, 2 * PS).unwrap();
                        d.free_reservation(base, 2 * PS).unwrap();
                    }
                });
            }
        });
        assert_eq!((d.live_chunk_bytes(), d.mapping_count(), d.resident_bytes()), (0, 0, 0));
    }

    #[test]
    fn drop_unmaps_everything_and_closes_the_memfd() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let d = small();
        let (base, _) = mapped(&d, 4, 2);
        d.set_access(base, 2 * PS).unwrap();
        d.write(base, &[5; 8]).unwrap();
        let fd = d.lock().fd.as_raw_fd();
        // Inode numbers tell this memfd apart from those of tests running alongside.
        let ino = std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap().ino();
        let maps_it = || {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            maps.lines().any(|l| l.split_whitespace().nth(4) == Some(&ino.to_string()))
        };
        let opens_it = || {
            std::fs::read_dir("/proc/self/fd").unwrap().flatten().any(|e| {
                std::fs::metadata(e.path()).is_ok_and(|m| m.ino() == ino && m.nlink() == 0)
            })
        };
        assert!(maps_it() && opens_it(), "the probe must see the live driver");
        drop(d);
        assert!(!maps_it(), "a mapping of the memfd survived drop");
        assert!(!opens_it(), "the memfd is still open after drop");
    }
}
