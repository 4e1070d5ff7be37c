//! The host backend's address space (`AddressSpace`: reservations, mappings, and the spans this
//! device and its peers may access) and its virtual-memory calls (reserve, create, map, set
//! access, unmap, release), its peers, and its copies, each checked against CUDA's rules.

use std::collections::{BTreeMap, HashMap};

use super::memory::Chunk;
use super::{err, os_err, sys, Charged, HostDriver, HOST_DEVICES};
use crate::driver::{
    code, Batch, CallKind, ChunkHandle, Copies, DevicePtr, DriverResult, MemInfo, Peers,
    VirtualMemory,
};

/// The address space: the reservations carved from the process's, the mappings in them, and
/// the ranges this device and its peers may access.
#[derive(Debug, Default)]
pub(super) struct AddressSpace {
    /// base -> size.
    pub(super) reservations: BTreeMap<u64, u64>,
    /// va -> mapping; mappings never overlap.
    pub(super) mappings: BTreeMap<u64, Mapping>,
    /// Accessible ranges: start -> end, disjoint and coalesced; always inside mappings.
    pub(super) accessible: BTreeMap<u64, u64>,
    /// Ranges each peer was granted access to, as `accessible`.
    pub(super) peer_accessible: HashMap<i32, BTreeMap<u64, u64>>,
}

/// One `map` call's worth of address space.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mapping {
    pub(super) size: u64,
    pub(super) chunk: u64,
}

/// Adds `[start, end)` to a set of disjoint, coalesced spans (start -> end).
pub(super) fn add_span(spans: &mut BTreeMap<u64, u64>, mut start: u64, mut end: u64) {
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
pub(super) fn remove_span(spans: &mut BTreeMap<u64, u64>, start: u64, end: u64) {
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
pub(super) fn covers(spans: &BTreeMap<u64, u64>, start: u64, end: u64) -> bool {
    matches!(spans.range(..=start).next_back(), Some((_, &e)) if e >= end)
}

impl AddressSpace {
    /// The reservation holding all of `[va, end)`, if one does.
    pub(super) fn reservation_of(&self, va: u64, end: u64) -> Option<(u64, u64)> {
        let (&base, &size) = self.reservations.range(..=va).next_back()?;
        (end <= base + size).then_some((base, size))
    }

    /// The mapping holding byte `va`, if one does.
    pub(super) fn mapping_at(&self, va: u64) -> Option<(u64, Mapping)> {
        let (&start, &m) = self.mappings.range(..=va).next_back()?;
        (va < start + m.size).then_some((start, m))
    }

    pub(super) fn any_mapped_in(&self, va: u64, end: u64) -> bool {
        self.mapping_at(va).is_some() || self.mappings.range(va..end).next().is_some()
    }

    /// Whether consecutive mappings cover `[va, end)` with no gap; the first byte not covered
    /// otherwise.
    pub(super) fn covered(&self, va: u64, end: u64) -> Result<(), u64> {
        let (start, m) = self.mapping_at(va).ok_or(va)?;
        let mut cur = start + m.size;
        while cur < end {
            cur += self.mappings.get(&cur).ok_or(cur)?.size;
        }
        Ok(())
    }

    /// Makes `[start, end)` accessible to this device and to `peers`.
    pub(super) fn add_accessible(&mut self, start: u64, end: u64, peers: &[i32]) {
        add_span(&mut self.accessible, start, end);
        for p in peers {
            add_span(self.peer_accessible.entry(*p).or_default(), start, end);
        }
    }

    /// Makes `[start, end)` accessible to no device (it is being unmapped).
    pub(super) fn remove_accessible(&mut self, start: u64, end: u64) {
        remove_span(&mut self.accessible, start, end);
        for spans in self.peer_accessible.values_mut() {
            remove_span(spans, start, end);
        }
    }

    pub(super) fn is_accessible(&self, start: u64, end: u64) -> bool {
        covers(&self.accessible, start, end)
    }

    /// Checks that `[addr, addr + len)` may be copied to or from.
    pub(super) fn check_copy(&self, addr: DevicePtr, len: usize) -> DriverResult<()> {
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

impl VirtualMemory for HostDriver {
    fn name(&self) -> &'static str {
        "host"
    }

    fn granularity(&self) -> usize {
        self.page_size
    }

    fn mem_info(&self) -> DriverResult<MemInfo> {
        let live = self.lock().memory.live_chunk_bytes;
        Ok(MemInfo { free: self.capacity - live, total: self.capacity })
    }

    fn reserve(&self, size: usize, alignment: usize) -> DriverResult<DevicePtr> {
        self.charge(Charged::Reserve);
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
        st.space.reservations.insert(base, size as u64);
        Ok(base)
    }

    fn free_reservation(&self, base: DevicePtr, size: usize) -> DriverResult<()> {
        let call = CallKind::FreeReservation;
        let mut st = self.lock();
        match st.space.reservations.get(&base) {
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
        if st.space.any_mapped_in(base, end) {
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
        st.space.reservations.remove(&base);
        Ok(())
    }

    fn create_chunk(&self, size: usize) -> DriverResult<ChunkHandle> {
        self.charge(Charged::Create);
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
        let live = st.memory.live_chunk_bytes;
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
        let offset = st
            .memory
            .alloc_offsets(size)
            .map_err(|e| os_err(call, "create_chunk: ftruncate", e))?;
        let id = st.memory.add_chunk(Chunk::new(offset, size));
        st.memory.live_chunk_bytes += size;
        Ok(ChunkHandle(id))
    }

    fn release_chunk(&self, handle: ChunkHandle) -> DriverResult<()> {
        self.charge(Charged::Release);
        let mut st = self.lock();
        let chunk = match st.memory.chunks.get_mut(&handle.0) {
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
            st.memory.free_chunk(handle.0);
        }
        Ok(())
    }

    fn map(&self, va: DevicePtr, size: usize, handle: ChunkHandle) -> DriverResult<()> {
        self.charge(Charged::Map);
        let call = CallKind::Map;
        let end = self.check_aligned(call, va, size)?;
        let size = size as u64;
        let mut st = self.lock();
        let (offset, chunk_size, file) = match st.memory.chunks.get(&handle.0) {
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
        if st.space.reservation_of(va, end).is_none() {
            return Err(err(
                call,
                code::INVALID_VALUE,
                format!("map: [{va:#x}, {end:#x}) is not inside one reservation"),
            ));
        }
        if st.space.any_mapped_in(va, end) {
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
        let mapped = unsafe {
            sys::map_shared_fixed(va, size, file.as_deref().unwrap_or(&st.memory.fd), offset)
        };
        if let Err(e) = mapped {
            // A failed MAP_FIXED may have dropped the placeholder; put it back so the range stays
            // reserved. If that fails too, the range is merely unreserved, not corrupted.
            // SAFETY: as above, [va, end) is ours and holds nothing anyone can reference.
            let _ = unsafe { sys::reserve_fixed(va, size) };
            return Err(os_err(call, "map: mmap", e));
        }
        st.space.mappings.insert(va, Mapping { size, chunk: handle.0 });
        if let Some(c) = st.memory.chunks.get_mut(&handle.0) {
            c.maps += 1;
        }
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, size: usize) -> DriverResult<()> {
        self.charge(Charged::SetAccess);
        let call = CallKind::SetAccess;
        let end = self.check_aligned(call, va, size)?;
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut st = self.lock();
        if let Err(hole) = st.space.covered(va, end) {
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
        st.space.add_accessible(va, end, &peers);
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, size: usize) -> DriverResult<()> {
        self.charge(Charged::Unmap);
        let call = CallKind::Unmap;
        let end = self.check_aligned(call, va, size)?;
        let mut st = self.lock();
        let mut spanned = Vec::new();
        let mut cur = va;
        while cur < end {
            let Some(m) = st.space.mappings.get(&cur) else {
                let why = match st.space.mapping_at(cur) {
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
        st.space.remove_accessible(va, end);
        for (start, chunk) in spanned {
            st.space.mappings.remove(&start);
            let gone = match st.memory.chunks.get_mut(&chunk) {
                Some(c) => {
                    c.maps -= 1;
                    c.released && c.maps == 0
                }
                None => false,
            };
            if gone {
                st.memory.free_chunk(chunk);
            }
        }
        Ok(())
    }

    /// Under `HostDriverCosts::DeviceTables`, a batch's page-table writes are one kernel launch
    /// at its end; under the other models a batch changes nothing.
    fn begin_batch(&self) -> Batch {
        Batch(self.costs.begin_batch(self.cost_owner()))
    }

    fn end_batch(&self, batch: Batch) {
        if batch.0 {
            self.costs.end_batch(self.cost_owner());
        }
    }
}

impl Peers for HostDriver {
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
}

impl Copies for HostDriver {
    fn write(&self, dst: DevicePtr, src: &[u8]) -> DriverResult<()> {
        if src.is_empty() {
            return Ok(());
        }
        let st = self.lock();
        st.space.check_copy(dst, src.len())?;
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
        st.space.check_copy(src, dst.len())?;
        // SAFETY: [src, src + len) is mapped readable (checked above) and stays so while we hold
        // the lock; `dst` is an exclusive borrow, so nothing else aliases it.
        unsafe {
            std::ptr::copy_nonoverlapping(src as usize as *const u8, dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }
}
