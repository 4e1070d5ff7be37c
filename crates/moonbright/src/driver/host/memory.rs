//! The host backend's memory model: the memfd's offsets (first fit, coalesced, punched when
//! freed), chunks' lifetimes, and the lookups of reservations, mappings and accessible spans.

use std::collections::BTreeMap;
use std::io;

use super::{err, sys, Mapping, State};
use crate::driver::{code, CallKind, DevicePtr, DriverResult};

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

impl State {
    /// First fit among freed offsets, else the end of the file (grown as needed).
    pub(super) fn alloc_offsets(&mut self, size: u64) -> io::Result<u64> {
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
    pub(super) fn free_offsets(&mut self, mut start: u64, mut len: u64) {
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
    pub(super) fn free_chunk(&mut self, id: u64) {
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
