//! The allocator's tags, sleep and wake (`crate::tags`; the work is `stream/sleep.rs`).

use super::Allocator;
use crate::error::Result;
use crate::tags::{Backup, SleepReport, TagInfo, WakeReport};

impl Allocator {
    /// Puts every allocation tagged `tag` ([`crate::tags::scope`]) to sleep: waits, by an event
    /// on each, for the work queued on the streams they were allocated on or used on
    /// ([`Allocator::record_stream`]) — never for the whole device —, copies their bytes to
    /// pinned host memory ([`Backup::Host`]) or drops them ([`Backup::Discard`]), then unmaps
    /// their memory and gives it back to the driver. Their addresses stay reserved: pointers
    /// and CUDA graphs that hold them are valid again after [`Allocator::wake`]. Until then
    /// allocating with the tag, freeing its allocations and sleeping it again are errors
    /// (`Error::TagAsleep`, `Error::TagState`); other tags and untagged memory are untouched.
    ///
    /// Refused, with the tag left awake as it was, while a request of the tag is mapping on
    /// another thread, when some of its memory was exported to another process, or when a
    /// wait or a copy fails. A tag with no allocation sleeps (and wakes) at no cost.
    pub fn sleep(&self, tag: &str, backup: Backup) -> Result<SleepReport> {
        let id = crate::tags::intern(tag)?;
        self.shared.sleep(id, backup)
    }

    /// Wakes `tag`: maps its memory again at the same addresses, from free memory MoonBright
    /// holds and new chunks, and copies its bytes back if its sleep kept them; returns once
    /// they are in place. All or nothing: if the memory cannot be had (the cap, the device) or a
    /// driver call fails, what was mapped is given back, the tag stays asleep with its bytes,
    /// and the error says why (`Error::OutOfMemory` for memory); free memory and call again.
    /// Bytes of a tag slept with [`Backup::Discard`] are whatever the new memory held.
    pub fn wake(&self, tag: &str) -> Result<WakeReport> {
        let id = crate::tags::intern(tag)?;
        self.shared.wake(id)
    }

    /// Every tag with live allocations or asleep.
    pub fn tags(&self) -> Vec<TagInfo> {
        let books = self.shared.heap().tag_books();
        books
            .into_iter()
            .map(|(id, allocations, bytes, asleep, backed_up)| TagInfo {
                name: crate::tags::name_of(id),
                allocations,
                bytes,
                asleep,
                backed_up,
            })
            .collect()
    }

    /// Bytes of pinned host memory held for sleeps: the bytes of tags asleep with a backup, and
    /// spare pieces kept for the next sleep.
    pub fn host_memory(&self) -> u64 {
        self.shared.host_memory()
    }

    /// Pins host memory ahead of a first sleep, until at least `bytes` are held for sleeps (in
    /// use or spare): a sleep's copy runs at link speed, but pinning runs at a few GiB/s (on an
    /// H100 a first sleep of 16 GiB took 8.8 s, the next ones 0.34 s), so a program that knows
    /// what it will put to sleep pins it while it loads. Returns the bytes held.
    pub fn reserve_host_memory(&self, bytes: u64) -> Result<u64> {
        self.shared.reserve_host_memory(bytes)
    }

    /// Gives the spare pinned host memory back (what tags asleep hold stays). Returns the bytes.
    pub fn release_host_memory(&self) -> Result<u64> {
        self.shared.release_host_memory()
    }
}
