//! Workloads shared by the tests, the `moonbright` command and the benchmarks, written once over
//! [`DeviceAllocator`] so MoonBright and the no-remap baseline run exactly the same steps.

use moonbright::driver::{prelude::*, DevicePtr};
use moonbright::{Allocator, Error, Result};

use crate::baseline::NoRemapAllocator;

/// What a workload needs of an allocator.
pub trait DeviceAllocator {
    /// A short name for reports.
    fn label(&self) -> &'static str;
    /// Allocates.
    fn malloc(&self, size: usize) -> Result<DevicePtr>;
    /// Frees.
    fn free(&self, ptr: DevicePtr) -> Result<()>;
    /// Writes bytes into an allocation.
    fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<()>;
    /// Reads bytes out of an allocation.
    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()>;
    /// Physical bytes held now and at most.
    fn reserved(&self) -> (u64, u64);
}

impl DeviceAllocator for Allocator {
    fn label(&self) -> &'static str {
        "moonbright"
    }
    fn malloc(&self, size: usize) -> Result<DevicePtr> {
        Allocator::malloc(self, size)
    }
    fn free(&self, ptr: DevicePtr) -> Result<()> {
        Allocator::free(self, ptr)
    }
    fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        Allocator::write(self, dst, src)
    }
    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        Allocator::read(self, src, dst)
    }
    fn reserved(&self) -> (u64, u64) {
        let s = self.stats().reserved_bytes;
        (s.current, s.peak)
    }
}

impl DeviceAllocator for NoRemapAllocator {
    fn label(&self) -> &'static str {
        "no-remap baseline"
    }
    fn malloc(&self, size: usize) -> Result<DevicePtr> {
        NoRemapAllocator::malloc(self, size)
    }
    fn free(&self, ptr: DevicePtr) -> Result<()> {
        NoRemapAllocator::free(self, ptr)
    }
    fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        Ok(self.driver().write(dst, src)?)
    }
    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        Ok(self.driver().read(src, dst)?)
    }
    fn reserved(&self) -> (u64, u64) {
        self.reserved_bytes()
    }
}

/// A pattern that differs per allocation and per word, so overlaps and stale data show.
pub fn pattern(id: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Bytes of each allocation the scenarios fill and check (its head and its tail).
const PROBE: usize = 4096;

/// The head and tail probed in an allocation of `size` bytes: (head len, tail len), disjoint.
fn probes(size: usize) -> (usize, usize) {
    let head = size.min(PROBE);
    (head, (size - head).min(PROBE))
}

/// Writes `pattern(id)` at the head and the tail of an allocation.
pub fn stamp(a: &dyn DeviceAllocator, ptr: DevicePtr, size: usize, id: u64) -> Result<()> {
    let (head, tail) = probes(size);
    let p = pattern(id, head + tail);
    a.write(ptr, &p[..head])?;
    a.write(ptr + (size - tail) as u64, &p[head..])
}

/// Checks what `stamp` wrote; `Ok(false)` if the bytes changed.
pub fn verify(a: &dyn DeviceAllocator, ptr: DevicePtr, size: usize, id: u64) -> Result<bool> {
    let (head, tail) = probes(size);
    let p = pattern(id, head + tail);
    let mut got = vec![0u8; head + tail];
    a.read(ptr, &mut got[..head])?;
    a.read(ptr + (size - tail) as u64, &mut got[head..])?;
    Ok(got == p)
}

/// The outcome of [`fragmentation`].
#[derive(Clone, Debug)]
pub struct FragmentationReport {
    /// The allocator's label.
    pub allocator: &'static str,
    /// Blocks allocated while filling memory.
    pub blocks: usize,
    /// Size of each block.
    pub block_bytes: u64,
    /// Bytes freed (every other block).
    pub freed_bytes: u64,
    /// Size of the request made after the frees: larger than any hole.
    pub big_request: u64,
    /// Whether it succeeded.
    pub big_ok: bool,
    /// Its error, if it failed.
    pub big_error: Option<String>,
    /// Whether every surviving block kept its bytes.
    pub data_intact: bool,
    /// Peak physical bytes held.
    pub peak_reserved: u64,
}

/// The classic case a caching allocator fails: fill memory with blocks of `block` bytes (up to
/// `limit` bytes, or until the allocator refuses), free every other one, then ask for four blocks'
/// worth, larger than any hole yet well under the memory freed. Every block is stamped with a
/// pattern and checked at the end.
pub fn fragmentation(
    a: &dyn DeviceAllocator,
    block: usize,
    limit: u64,
) -> Result<FragmentationReport> {
    let mut blocks = Vec::new();
    let mut total = 0u64;
    while total + block as u64 <= limit {
        match a.malloc(block) {
            Ok(p) => {
                stamp(a, p, block, blocks.len() as u64)?;
                blocks.push(p);
                total += block as u64;
            }
            Err(Error::OutOfMemory { .. }) => break,
            Err(e) => return Err(e),
        }
    }
    let mut freed = 0u64;
    for &p in blocks.iter().skip(1).step_by(2) {
        a.free(p)?;
        freed += block as u64;
    }
    let big = 4 * block;
    let (big_ok, big_error) = match a.malloc(big) {
        Ok(p) => {
            stamp(a, p, big, u64::MAX)?;
            let ok = verify(a, p, big, u64::MAX)?;
            a.free(p)?;
            (ok, None)
        }
        Err(e @ Error::OutOfMemory { .. }) => (false, Some(e.to_string())),
        Err(e) => return Err(e),
    };
    let mut data_intact = true;
    for (i, &p) in blocks.iter().enumerate().step_by(2) {
        data_intact &= verify(a, p, block, i as u64)?;
        a.free(p)?;
    }
    Ok(FragmentationReport {
        allocator: a.label(),
        blocks: blocks.len(),
        block_bytes: block as u64,
        freed_bytes: freed,
        big_request: big as u64,
        big_ok,
        big_error,
        data_intact,
        peak_reserved: a.reserved().1,
    })
}
