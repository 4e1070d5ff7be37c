//! Sleep and wake of a tag, the driver's side (the books are `core/heap/sleep.rs`).
//!
//! Sleep: wait, by an event on each, for the work queued on the streams that use the tag's
//! memory (never the whole device); copy its bytes to pinned host memory in pieces queued on a
//! stream of MoonBright's own, if asked; then retire its ranges (addresses kept), unmap them and
//! release their chunks, so that the driver counts the memory free. Wake: map each range again
//! at its own address, from free chunks and new large ones, queueing its bytes' copy back as
//! soon as it is mapped, so that copies run while the next range is mapped; then wait for the
//! copies. A wake that cannot map every range (no memory, a driver error) undoes what it mapped
//! and leaves the tag asleep with its bytes. Sleeps and wakes of one allocator run one at a time.
//!
//! Host memory: pieces of `PIECE` bytes of pinned memory, kept in a pool when a wake no longer
//! needs them, so that a sleep after the first one pins nothing (pinning is slower than the copy
//! itself); `release_host_memory` gives the pool back.

use std::collections::HashMap;

use super::{Shared, Waits};
use crate::core::heap::{Heap, SleepWork, WakeWork};
use crate::core::streams::NO_STREAM;
use crate::driver::{prelude::*, DriverError, HostBuffer, StreamHandle};
use crate::error::{Error, Result};
use crate::tags::{Backup, SleepReport, TagId, WakeReport};

/// Bytes of one piece of host memory: a copy's unit, and the pool's.
pub(crate) const PIECE: usize = 64 << 20;

/// A tag's bytes in host memory: the pieces, filled in the order of its ranges.
#[derive(Debug)]
struct Saved {
    pieces: Vec<HostBuffer>,
}

/// What sleeps and wakes hold between calls; its lock serialises them.
#[derive(Debug, Default)]
pub(super) struct Offloads {
    /// The stream copies are queued on, made at the first copy.
    stream: Option<StreamHandle>,
    /// Pieces no tag uses now.
    spare: Vec<HostBuffer>,
    /// The bytes of tags asleep with a backup.
    saved: HashMap<TagId, Saved>,
}

impl Offloads {
    /// Bytes of pinned host memory held, in use or spare.
    pub(super) fn host_bytes(&self) -> u64 {
        let pieces = self.spare.len() + self.saved.values().map(|s| s.pieces.len()).sum::<usize>();
        (pieces * PIECE) as u64
    }
}

/// Where the next piece of a copy goes: (piece, offset in it).
type Cursor = (usize, usize);

impl Shared {
    /// Puts `tag` to sleep (`Allocator::sleep`).
    pub fn sleep(&self, tag: TagId, backup: Backup) -> Result<SleepReport> {
        let start = crate::sync::Instant::now();
        let mut off = self.offloads.lock().unwrap_or_else(|e| e.into_inner());
        let work = self.heap().begin_sleep(tag, backup == Backup::Host)?;
        let saved = match self.save(&mut off, &work, backup) {
            Ok(saved) => saved,
            Err(e) => {
                self.heap().abort_sleep(tag);
                return Err(e);
            }
        };
        let bytes: u64 = work.ranges.iter().map(|r| r.2).sum();
        let backed_up = if saved.is_some() { bytes } else { 0 };
        if let Some(saved) = saved {
            off.saved.insert(tag, saved);
        }
        let claim = {
            let mut heap = self.heap();
            let claim = heap.commit_sleep(&work);
            self.validated(&heap);
            claim
        };
        // The ranges are retired with nothing to wait for: unmap them (and whatever else is
        // due) now, then release their chunks. The tag is asleep, its bytes safe, whatever
        // happens here: a failure is a deferred error, and the memory goes back with a later
        // unmap or `release_unused`.
        let released = self.release_slept(claim);
        Ok(SleepReport { bytes, released, backed_up, seconds: start.elapsed().as_secs_f64() })
    }

    /// Waits for the work queued on `work`'s streams, then copies its ranges' bytes out if
    /// asked. Returns the copy.
    fn save(&self, off: &mut Offloads, work: &SleepWork, backup: Backup) -> Result<Option<Saved>> {
        for &s in &work.streams {
            self.refuse_capture(StreamHandle(s))?;
        }
        for &s in &work.streams {
            self.wait_for_stream(StreamHandle(s))?;
        }
        if backup == Backup::Discard {
            return Ok(None);
        }
        let stream = self.copy_stream(off)?;
        let mut pieces: Vec<HostBuffer> = Vec::new();
        let mut cursor: Cursor = (0, 0);
        let mut queued = Ok(());
        for &(_, va, len) in &work.ranges {
            queued = self.copy_range(off, &mut pieces, &mut cursor, va, len, stream, true);
            if queued.is_err() {
                break;
            }
        }
        // Whatever was queued completes before the pieces are reused or kept.
        let waited = self.wait_for_stream(stream);
        match queued.and(waited) {
            Ok(()) => Ok(Some(Saved { pieces })),
            Err(e) => {
                off.spare.append(&mut pieces);
                Err(e)
            }
        }
    }

    /// Queues the copy of `[va, va + len)` to host memory (`to_host`) or back, in pieces of at
    /// most `PIECE` bytes from `cursor` on; to host, new pieces are taken from the spare ones
    /// or pinned as the cursor reaches them (while the copies before run).
    #[allow(clippy::too_many_arguments)]
    fn copy_range(
        &self,
        off: &mut Offloads,
        pieces: &mut Vec<HostBuffer>,
        cursor: &mut Cursor,
        va: u64,
        len: u64,
        stream: StreamHandle,
        to_host: bool,
    ) -> Result<()> {
        let mut done = 0u64;
        while done < len {
            let (i, at) = *cursor;
            if i == pieces.len() {
                debug_assert!(to_host, "a restore reads only pieces its sleep filled");
                let piece = match off.spare.pop() {
                    Some(p) => p,
                    None => self.driver.alloc_host(PIECE)?,
                };
                pieces.push(piece);
            }
            let n = (PIECE - at).min((len - done) as usize);
            // SAFETY: `[ptr + at, ptr + at + n)` lies in piece `i`, a live buffer of this
            // driver's that only this copy touches until the stream is waited for (`save`,
            // `wake`) — the lock on `Offloads` keeps every other sleep and wake out.
            let host = unsafe { pieces[i].ptr.add(at) };
            let r = if to_host {
                // SAFETY: as above.
                unsafe { self.driver.copy_to_host(host, va + done, n, stream) }
            } else {
                // SAFETY: as above; the piece holds what the sleep copied there.
                unsafe { self.driver.copy_to_device(va + done, host, n, stream) }
            };
            r?;
            done += n as u64;
            *cursor = if at + n == PIECE { (i + 1, 0) } else { (i, at + n) };
        }
        Ok(())
    }

    /// The stream copies go on, made now if need be.
    fn copy_stream(&self, off: &mut Offloads) -> Result<StreamHandle> {
        if let Some(s) = off.stream {
            return Ok(s);
        }
        let s = self.driver.create_stream()?;
        off.stream = Some(s);
        Ok(s)
    }

    /// Blocks this thread until the work queued on `stream` so far has completed (an event,
    /// never the device).
    fn wait_for_stream(&self, stream: StreamHandle) -> Result<()> {
        let event = self.driver.create_event()?;
        let r = self
            .driver
            .record_event(event, stream)
            .and_then(|()| self.driver.synchronize_event(event));
        let destroyed = self.driver.destroy_event(event);
        r.and(destroyed).map_err(Into::into)
    }

    /// Unmaps what is retired and releases the chunks of sleep claim `claim` then mapped
    /// nowhere. Returns the bytes released; a failure is recorded as a deferred error.
    fn release_slept(&self, claim: u64) -> u64 {
        let flushed = self.flush_landed();
        let taken = self.heap().take_slept_releasable(claim);
        let (bytes, first_error) = self.release_claimed(claim, taken);
        let mut heap = self.heap();
        if let Some(e) = first_error {
            heap.note_deferred_error(e);
        }
        if let Err(Error::Driver(e)) = flushed {
            heap.note_deferred_error(e);
        }
        bytes
    }

    /// Wakes `tag` (`Allocator::wake`).
    pub fn wake(&self, tag: TagId) -> Result<WakeReport> {
        let start = crate::sync::Instant::now();
        let mut off = self.offloads.lock().unwrap_or_else(|e| e.into_inner());
        let work = self.heap().begin_wake(tag)?;
        match self.map_and_restore(&mut off, &work) {
            Ok((bytes, created, restored)) => {
                if let Some(mut saved) = off.saved.remove(&tag) {
                    off.spare.append(&mut saved.pieces);
                }
                let mut heap = self.heap();
                heap.finish_wake(tag);
                self.validated(&heap);
                Ok(WakeReport { bytes, created, restored, seconds: start.elapsed().as_secs_f64() })
            }
            Err(e) => {
                let mut heap = self.heap();
                heap.abort_wake(tag);
                self.validated(&heap);
                drop(heap);
                // Unmap what the failed wake had mapped, now rather than in a later batch, so
                // that a retry finds its addresses free; a failure of that is the worker's.
                let _ = self.flush();
                Err(e)
            }
        }
    }

    /// Maps every range of `work` again and queues its bytes' copy back as soon as it is
    /// mapped; waits for the copies. On failure every range is asleep again. Returns the bytes
    /// mapped, of them those of new chunks, and the bytes restored.
    fn map_and_restore(&self, off: &mut Offloads, work: &WakeWork) -> Result<(u64, u64, u64)> {
        let stream = match work.backed_up && off.saved.contains_key(&work.tag) {
            true => Some(self.copy_stream(off)?),
            false => None,
        };
        let mut pieces = match stream {
            Some(_) => off.saved.get_mut(&work.tag).map(|s| std::mem::take(&mut s.pieces)),
            None => None,
        };
        let mut cursor: Cursor = (0, 0);
        let mut woken = Vec::new();
        let (mut bytes, mut created, mut restored) = (0, 0, 0);
        let mut outcome = Ok(());
        for &(id, va, len) in &work.ranges {
            match self.map_in_place(id, len) {
                Ok(new_bytes) => {
                    woken.push(id);
                    bytes += len;
                    created += new_bytes;
                }
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
            if let (Some(stream), Some(pieces)) = (stream, pieces.as_mut()) {
                let copied = self.copy_range(off, pieces, &mut cursor, va, len, stream, false);
                if let Err(e) = copied {
                    outcome = Err(e);
                    break;
                }
                restored += len;
            }
        }
        if let Some(stream) = stream {
            // Every copy queued completes before its pieces or its range change hands.
            let waited = self.wait_for_stream(stream);
            outcome = outcome.and(waited);
        }
        if let Some(p) = pieces {
            off.saved.get_mut(&work.tag).expect("kept until the wake succeeds").pieces = p;
        }
        if let Err(e) = outcome {
            let mut heap = self.heap();
            for id in woken {
                heap.unwake(id);
            }
            return Err(e);
        }
        Ok((bytes, created, restored))
    }

    /// Maps asleep range `id` of `len` bytes again at its address. Returns the bytes of new
    /// chunks it made.
    fn map_in_place(&self, id: crate::core::heap::RangeId, len: u64) -> Result<u64> {
        let mut waits = Waits::new();
        loop {
            let mut made = 0;
            let plan = |heap: &mut Heap| heap.plan_wake(id);
            let commit = |heap: &mut Heap, plan: crate::core::mapping::MapPlan, ex| {
                made = plan.create.iter().sum::<u64>() * heap.limits().page;
                heap.commit_wake(id, plan, ex)
            };
            if self.map_new(len, NO_STREAM, &mut waits, plan, commit)?.is_some() {
                return Ok(made);
            }
        }
    }

    /// Gives back every spare piece of host memory (`Allocator::release_host_memory`). Returns
    /// the bytes freed.
    pub fn release_host_memory(&self) -> Result<u64> {
        let mut off = self.offloads.lock().unwrap_or_else(|e| e.into_inner());
        let mut freed = 0;
        let mut first_error: Option<DriverError> = None;
        for piece in std::mem::take(&mut off.spare) {
            // SAFETY: a spare piece came from this driver's `alloc_host`, and no copy uses it:
            // every copy into or out of it was waited for before it became spare.
            match unsafe { self.driver.free_host(piece) } {
                Ok(()) => freed += PIECE as u64,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e.into()),
            None => Ok(freed),
        }
    }

    /// Pins spare host memory until at least `bytes` are held for sleeps, in use or spare
    /// (`Allocator::reserve_host_memory`). Returns the bytes held.
    pub fn reserve_host_memory(&self, bytes: u64) -> Result<u64> {
        let mut off = self.offloads.lock().unwrap_or_else(|e| e.into_inner());
        while off.host_bytes() < bytes {
            let piece = self.driver.alloc_host(PIECE)?;
            off.spare.push(piece);
        }
        Ok(off.host_bytes())
    }

    /// Bytes of pinned host memory held for sleeps, in use or spare.
    pub fn host_memory(&self) -> u64 {
        self.offloads.lock().unwrap_or_else(|e| e.into_inner()).host_bytes()
    }

    /// Frees every piece of host memory and the copy stream (the allocator is going away).
    pub(super) fn teardown_offloads(&self) {
        let mut off = self.offloads.lock().unwrap_or_else(|e| e.into_inner());
        let saved: Vec<Saved> = off.saved.drain().map(|(_, s)| s).collect();
        let pieces = std::mem::take(&mut off.spare)
            .into_iter()
            .chain(saved.into_iter().flat_map(|s| s.pieces));
        for piece in pieces {
            // SAFETY: every copy on a piece was waited for before its sleep or wake returned.
            let _ = unsafe { self.driver.free_host(piece) };
        }
        if let Some(s) = off.stream.take() {
            let _ = self.driver.destroy_stream(s);
        }
    }
}
