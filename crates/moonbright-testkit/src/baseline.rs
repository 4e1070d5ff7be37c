//! The no-remap baseline: a caching allocator that carves blocks out of fixed physical segments by
//! best fit and never remaps, as PyTorch's default allocator, RMM's pool and TensorFlow's BFC do.
//! It runs on the same driver as MoonBright so the two can be compared on one machine.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

use moonbright::driver::{prelude::*, ChunkHandle, DevicePtr, DriverError, Instrumented};
use moonbright::{Backend, Error, Options, Result};

/// Blocks are rounded to this many bytes, as PyTorch rounds to 512.
const BLOCK_ROUND: u64 = 512;

#[derive(Debug)]
struct Segment {
    va: u64,
    len: u64,
    handle: ChunkHandle,
    used: u64,
}

#[derive(Debug, Default)]
struct State {
    segments: BTreeMap<u64, Segment>,
    /// Free blocks as (len, addr), and addr -> len.
    free_by_size: BTreeSet<(u64, u64)>,
    free_by_addr: BTreeMap<u64, u64>,
    /// Live blocks: addr -> (len, requested).
    live: HashMap<u64, (u64, u64)>,
    reserved: u64,
    peak_reserved: u64,
    allocated: u64,
    peak_allocated: u64,
}

/// A caching allocator over fixed segments: what MoonBright is measured against.
#[derive(Debug)]
pub struct NoRemapAllocator {
    driver: Instrumented<Backend>,
    state: Mutex<State>,
    page: u64,
    segment_bytes: u64,
    cap: u64,
}

impl NoRemapAllocator {
    /// Opens the backend `options` name; requests below `segment_bytes` share segments of that
    /// size, larger ones get a segment of their own (rounded to the page).
    pub fn new(options: &Options, segment_bytes: u64) -> Result<Self> {
        options.check()?;
        let driver = Instrumented::new(options.open_backend()?);
        let page = driver.granularity() as u64;
        let total = driver.mem_info()?.total;
        let cap = options.cap_bytes.unwrap_or((total as f64 * options.cap_fraction) as u64);
        let segment_bytes = segment_bytes.next_multiple_of(page);
        Ok(NoRemapAllocator {
            driver,
            state: Mutex::new(State::default()),
            page,
            segment_bytes,
            cap,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocates `size` bytes: best fit among free blocks, else a new segment, else (at the cap)
    /// releases empty segments and tries once more, as PyTorch does before reporting OOM.
    pub fn malloc(&self, size: usize) -> Result<DevicePtr> {
        let size = size as u64;
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        if size > self.cap {
            return Err(Error::TooLarge { requested: size, cap: self.cap });
        }
        let len = size.next_multiple_of(BLOCK_ROUND);
        let mut st = self.state();
        if let Some(ptr) = Self::best_fit(&mut st, len, size) {
            return Ok(ptr);
        }
        let seg_len = if len >= self.segment_bytes {
            len.next_multiple_of(self.page)
        } else {
            self.segment_bytes
        };
        if st.reserved + seg_len > self.cap {
            self.release_empty_segments(&mut st)?;
        }
        if st.reserved + seg_len > self.cap {
            let free: u64 = st.free_by_addr.values().sum();
            return Err(Error::OutOfMemory {
                requested: size,
                allocated: st.allocated,
                reserved: st.reserved,
                free_in_pool: free,
                cap: self.cap,
                short: st.reserved + seg_len - self.cap,
                driver: None,
            });
        }
        let seg = self.create_segment(seg_len)?;
        st.reserved += seg_len;
        st.peak_reserved = st.peak_reserved.max(st.reserved);
        st.free_by_size.insert((seg_len, seg.va));
        st.free_by_addr.insert(seg.va, seg_len);
        st.segments.insert(seg.va, seg);
        Ok(Self::best_fit(&mut st, len, size).expect("a new segment fits the block"))
    }

    fn best_fit(st: &mut State, len: u64, size: u64) -> Option<u64> {
        let &(have, addr) = st.free_by_size.range((len, 0)..).next()?;
        st.free_by_size.remove(&(have, addr));
        st.free_by_addr.remove(&addr);
        if have > len {
            st.free_by_size.insert((have - len, addr + len));
            st.free_by_addr.insert(addr + len, have - len);
        }
        st.live.insert(addr, (len, size));
        let seg = st.segments.range_mut(..=addr).next_back().expect("block outside segments").1;
        seg.used += len;
        st.allocated += size;
        st.peak_allocated = st.peak_allocated.max(st.allocated);
        Some(addr)
    }

    /// Frees a block, merging it with free neighbours in its segment.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        let mut st = self.state();
        let Some((len, size)) = st.live.remove(&ptr) else {
            return Err(Error::UnknownPointer { ptr });
        };
        st.allocated -= size;
        let (seg_va, seg_end) = {
            let seg = st.segments.range_mut(..=ptr).next_back().expect("block outside segments").1;
            seg.used -= len;
            (seg.va, seg.va + seg.len)
        };
        let (mut start, mut flen) = (ptr, len);
        if let Some((&p, &pl)) = st.free_by_addr.range(seg_va..ptr).next_back() {
            if p + pl == ptr {
                st.free_by_addr.remove(&p);
                st.free_by_size.remove(&(pl, p));
                start = p;
                flen += pl;
            }
        }
        let next = ptr + len;
        if next < seg_end {
            if let Some(&nl) = st.free_by_addr.get(&next) {
                st.free_by_addr.remove(&next);
                st.free_by_size.remove(&(nl, next));
                flen += nl;
            }
        }
        st.free_by_addr.insert(start, flen);
        st.free_by_size.insert((flen, start));
        Ok(())
    }

    fn create_segment(&self, len: u64) -> Result<Segment> {
        let d = &self.driver;
        let handle = d.create_chunk(len as usize)?;
        let va = match d.reserve(len as usize, 0) {
            Ok(va) => va,
            Err(e) => {
                let _ = d.release_chunk(handle);
                return Err(e.into());
            }
        };
        let mapped = d.map(va, len as usize, handle).and_then(|()| {
            d.set_access(va, len as usize).inspect_err(|_| {
                let _ = d.unmap(va, len as usize);
            })
        });
        if let Err(e) = mapped {
            let _ = d.free_reservation(va, len as usize);
            let _ = d.release_chunk(handle);
            return Err(e.into());
        }
        Ok(Segment { va, len, handle, used: 0 })
    }

    fn destroy_segment(&self, seg: &Segment) -> std::result::Result<(), DriverError> {
        self.driver.unmap(seg.va, seg.len as usize)?;
        self.driver.free_reservation(seg.va, seg.len as usize)?;
        self.driver.release_chunk(seg.handle)
    }

    fn release_empty_segments(&self, st: &mut State) -> Result<()> {
        let empty: Vec<u64> = st.segments.values().filter(|s| s.used == 0).map(|s| s.va).collect();
        for va in empty {
            let seg = st.segments.remove(&va).expect("listed above");
            st.free_by_addr.remove(&va);
            st.free_by_size.remove(&(seg.len, va));
            st.reserved -= seg.len;
            self.destroy_segment(&seg)?;
        }
        Ok(())
    }

    /// Bytes of segments held now, and at most.
    pub fn reserved_bytes(&self) -> (u64, u64) {
        let st = self.state();
        (st.reserved, st.peak_reserved)
    }

    /// Bytes of live allocations now, and at most.
    pub fn allocated_bytes(&self) -> (u64, u64) {
        let st = self.state();
        (st.allocated, st.peak_allocated)
    }

    /// The largest free block, in bytes.
    pub fn largest_free_block(&self) -> u64 {
        self.state().free_by_size.iter().next_back().map_or(0, |b| b.0)
    }

    /// The backend, with its call counters.
    pub fn driver(&self) -> &Instrumented<Backend> {
        &self.driver
    }
}

impl Drop for NoRemapAllocator {
    fn drop(&mut self) {
        let st = std::mem::take(self.state.get_mut().unwrap_or_else(|e| e.into_inner()));
        for seg in st.segments.values() {
            if let Err(e) = self.destroy_segment(seg) {
                eprintln!("moonbright baseline: teardown: {e}");
            }
        }
    }
}
