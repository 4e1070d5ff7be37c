//! Growable allocations through the front end: reserving their private address range, resizing
//! (plan under the lock, map without it, commit), releasing, and freeing the reservations of
//! released ones once their tails are unmapped. The policy is in `core/heap/growable.rs`.

use super::{Shared, MAX_WAIT, WAIT_STEP};
use crate::core::heap::Resize;
use crate::driver::{prelude::*, DevicePtr, EventHandle, StreamHandle};
use crate::error::{Error, Result};

impl Shared {
    /// Reserves `capacity` bytes (rounded up to pages) of addresses for a growable allocation.
    /// No physical memory is used until it grows.
    pub fn reserve_growable(&self, capacity: u64) -> Result<DevicePtr> {
        if capacity == 0 {
            return Err(Error::ZeroSize);
        }
        let page = self.driver.granularity() as u64;
        let limit = self.heap().limits().va_limit;
        let len = match capacity.checked_next_multiple_of(page) {
            Some(len) if len <= limit => len,
            _ => return Err(Error::AddressSpaceExhausted { reserved: capacity, limit }),
        };
        let base = self.reserve(len)?;
        let mut heap = self.heap();
        heap.add_growable(base, len);
        self.validated(&heap);
        Ok(base)
    }

    /// Resizes the growable allocation at `ptr` to `len` bytes, in place, ordered on `stream`
    /// (`None`: the caller orders it, as for `free`).
    pub fn resize(&self, ptr: DevicePtr, len: u64, stream: Option<StreamHandle>) -> Result<()> {
        if let Some(s) = stream {
            self.refuse_capture(s)?;
        }
        let s = stream.map(|s| s.0);
        let mut waited = false;
        let start = crate::sync::Instant::now();
        while start.elapsed() < MAX_WAIT {
            let step = {
                let mut heap = self.heap();
                let r = heap.plan_resize(ptr, len, s);
                self.validated(&heap);
                r?
            };
            match step {
                Resize::Done(event) => {
                    self.record_shrink(event);
                    return Ok(());
                }
                Resize::Map(plan) => {
                    let _mapping = self.mapping_scope();
                    let ex = self.execute_for_request(&plan);
                    let mut heap = self.heap();
                    let r = heap.commit_grow(ptr, len, plan, ex);
                    self.validated(&heap);
                    self.wake_worker_if_due(heap);
                    return r;
                }
                Resize::Busy => crate::sync::pause(WAIT_STEP),
                Resize::Flush => {
                    // The old tail is unmapped once its shrink's stream work has completed.
                    if !self.flush()? {
                        self.wait_for_pending_frees()?;
                        self.flush()?;
                    }
                }
                Resize::OutOfMemory(e) => {
                    if !self.before_oom(&mut waited)? {
                        self.heap().note_oom(len, s.unwrap_or(0));
                        return Err(e);
                    }
                }
            }
        }
        Err(super::gave_up())
    }

    /// Releases the growable allocation at `ptr`, ordered on `stream` as `free_async` is.
    pub fn release_growable(&self, ptr: DevicePtr, stream: Option<u64>) -> Result<()> {
        let start = crate::sync::Instant::now();
        while start.elapsed() < MAX_WAIT {
            let step = {
                let mut heap = self.heap();
                let r = heap.release_growable(ptr, stream);
                self.validated(&heap);
                r?
            };
            match step {
                Resize::Done(event) => {
                    self.record_shrink(event);
                    self.free_dead_growables();
                    return Ok(());
                }
                Resize::Busy => crate::sync::pause(WAIT_STEP),
                other => unreachable!("a release only shrinks: {other:?}"),
            }
        }
        Err(super::gave_up())
    }

    /// Records the event a shrink on a stream asked for; a failure is not the caller's (a
    /// later event on the stream, which the worker records, covers it).
    fn record_shrink(&self, event: Option<(u64, u64, Option<EventHandle>)>) {
        if let Some((stream, epoch, spare)) = event {
            if let Err(e) = self.record(stream, epoch, spare, true) {
                self.heap().note_deferred_error(e);
            }
        }
    }

    /// Frees the reservations of released growables whose addresses are all unmapped.
    pub(super) fn free_dead_growables(&self) {
        let dead = self.heap().take_dead_growables();
        for (base, len) in dead {
            if let Err(e) = self.driver.free_reservation(base, len as usize) {
                self.heap().note_deferred_error(e);
            }
        }
    }
}
