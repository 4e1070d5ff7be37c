//! The allocation paths the latency benchmark compares, each behind one trait: MoonBright (cache
//! hit, window hit, cold map), cuMemAlloc/cuMemFree, cuMemAllocAsync/cuMemFreeAsync on a warm
//! default pool, and raw VMM (one handle, or 2 MiB pages).

use std::ptr;
use std::time::Duration;

use cudarc::driver::sys;
use moonbright::driver::CallCounts;
use moonbright::Allocator;
use moonbright::CallKind;

use crate::cu::{ck, Gpu, Stream};
use crate::{mb_options, Res, GIB, MIB};

/// One way of allocating and freeing device memory.
pub trait AllocPath {
    /// Untimed work before each repetition (let the mapper refill, release the cache, ...).
    fn prepare(&mut self) -> Res<()> {
        Ok(())
    }
    /// Allocates `size` bytes.
    fn alloc(&mut self, size: u64) -> Res<u64>;
    /// Frees what `alloc` returned.
    fn free(&mut self, ptr: u64) -> Res<()>;
    /// MoonBright's driver-call counters, if this is MoonBright.
    fn counts(&self) -> Option<CallCounts> {
        None
    }
    /// MoonBright's time in virtual-memory calls so far, if this is MoonBright.
    fn times(&self) -> Option<moonbright::driver::CallTimes> {
        None
    }
    /// MoonBright's cache hits so far, if this is MoonBright.
    fn cache_hits(&self) -> Option<u64> {
        None
    }
}

/// Which MoonBright path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MbMode {
    /// The same size again and again: after the first, every request is a cache hit (an arena
    /// carve below a page).
    Cache,
    /// The same under PyTorch's contract (`captures_announced`, `deferred_free_events`): no
    /// capture query and no event record, so a hit makes no driver call.
    CacheTorchContract,
    /// A fresh range each time: allocations stay live (so no freed range is cached to serve the
    /// next one), served from the window the background mapper keeps mapped at the frontier, in
    /// runs of `run_len(size)` hits back to back. At the start of a run `prepare` waits
    /// (untimed, spinning) until the window holds the whole run, and makes its first two
    /// requests untimed: the timed ones are the third and later of a run, a warm loop like the
    /// cache-hit and warm-pool loops they are compared with. (`hitprobe` times the first hit
    /// after a refill, and every position of a run, beside `cuMemAllocAsync`'s.) Its free is a
    /// no-op and not meaningful; its alloc time is.
    Window,
    /// The same, but the timed request is the first after the mapper has refilled the whole
    /// window and gone idle: the heap's state was last touched by the mapper's thread.
    WindowIdle,
    /// No window, and `release_unused` before each repetition: every request creates and maps.
    Cold,
    /// The same beside one live one-page allocation, made first and kept to the end: the cold
    /// range is not the only mapping in its part of the address space (no allocator in use is
    /// ever empty; `vaprobe`'s `same-beside-live` times what that changes in the driver).
    ColdBesideLive,
}

/// MoonBright through `malloc_async` / `free_async` on one stream.
pub struct Mb {
    pub inner: Allocator,
    stream: Stream,
    mode: MbMode,
    refill: Duration,
    /// Bytes the next window-path request needs in the window.
    next_window_size: u64,
    /// Window path: allocations kept live until the end (see `free`).
    held: Vec<u64>,
    /// The window's size when the mapper has nothing left to do.
    full_window: u64,
    /// Window path: its place in the current run.
    run: RunCursor,
}

/// Bytes the window paths keep live before giving them back (the H200 has 139 GiB; the 8 GiB
/// window path holds a 16 GiB window beside them).
const HELD_AT_MOST: u64 = 64 * GIB;

/// The window kept for requests of `size`: room for two of them, at least 1 GiB.
pub fn window_for(size: u64) -> u64 {
    (2 * size).max(GIB)
}

/// Fresh allocations a run of window hits (or of `CuAsyncFresh`) makes back to back: 16, or 4
/// above 1 GiB (an 8 GiB run holds 32 GiB).
pub fn run_len(size: u64) -> usize {
    if size > GIB {
        4
    } else {
        16
    }
}

/// The window for runs of `size`: a whole run, at least 1 GiB.
pub fn run_window(size: u64) -> u64 {
    (run_len(size) as u64 * size).max(GIB)
}

/// Where a path is in its run of `run_len` fresh requests: `prepare` makes the first two of a
/// run untimed, and the rest are the timed repetitions.
#[derive(Debug, Default)]
struct RunCursor {
    /// Timed requests left in the current run.
    left: usize,
}

impl RunCursor {
    /// Called once a repetition: whether it starts a new run (the caller then sets it up and
    /// makes its two untimed requests).
    fn starts_run(&mut self, len: usize) -> bool {
        if self.left > 0 {
            self.left -= 1;
            return false;
        }
        self.left = len - 3;
        true
    }
}

impl Mb {
    /// A fresh allocator for `mode` and requests of `size`.
    pub fn new(mode: MbMode, size: u64) -> Res<Mb> {
        let opts = match mode {
            // The default window: it grows with fresh demand, and a run of cache hits has none,
            // so the mapper stays idle as in any steady state.
            MbMode::Cache => mb_options(None, crate::max_chunk(), crate::default_window(), true),
            MbMode::CacheTorchContract => moonbright::Options {
                captures_announced: true,
                deferred_free_events: true,
                ..mb_options(None, crate::max_chunk(), crate::default_window(), true)
            },
            MbMode::Window => {
                mb_options(None, crate::max_chunk(), (run_window(size), run_window(size)), true)
            }
            MbMode::WindowIdle => {
                mb_options(None, crate::max_chunk(), (window_for(size), window_for(size)), true)
            }
            MbMode::Cold | MbMode::ColdBesideLive => {
                mb_options(None, crate::max_chunk(), (0, 0), false)
            }
        };
        Mb::with_options(mode, size, opts)
    }

    /// A fresh allocator with explicit options.
    pub fn with_options(mode: MbMode, size: u64, opts: moonbright::Options) -> Res<Mb> {
        let background = opts.background;
        let alloc = Allocator::new(opts).map_err(|e| format!("MoonBright: {e}"))?;
        let page = alloc.page_size() as u64;
        if background {
            // Let the worker make its first stock of events, as a long-lived allocator has one.
            let t = std::time::Instant::now();
            while alloc.stats().events_stocked == 0 && t.elapsed() < Duration::from_secs(2) {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        let window = if mode == MbMode::Window { run_window(size) } else { window_for(size) };
        // The longest to wait for the mapper to refill: generous, about 100 µs per 2 MiB page.
        let refill = Duration::from_micros(2_000_000 + window / (2 * MIB) * 100);
        let mut held = Vec::new();
        if mode == MbMode::ColdBesideLive {
            held.push(alloc.malloc(page as usize).map_err(|e| format!("malloc({page}): {e}"))?);
        }
        Ok(Mb {
            inner: alloc,
            stream: Stream::new(true)?,
            mode,
            refill,
            next_window_size: size.next_multiple_of(page),
            held,
            full_window: window.next_multiple_of(page),
            run: RunCursor::default(),
        })
    }

    /// Window paths: gives the held ranges back, and the window with them, when `more`
    /// requests would take them past `HELD_AT_MOST` (a freed range would serve the next
    /// request from the cache, so the mapper starts again).
    fn give_back_if_over(&mut self, more: usize) -> Res<()> {
        if (self.held.len() + more) as u64 * self.next_window_size <= HELD_AT_MOST {
            return Ok(());
        }
        self.stream.sync()?;
        for p in std::mem::take(&mut self.held) {
            self.inner.free(p).map_err(|e| format!("free: {e}"))?;
        }
        self.inner.release_unused().map_err(|e| format!("release_unused: {e}"))?;
        Ok(())
    }

    /// Waits, spinning (the request should not pay for a wake-up), until the window holds
    /// `bytes`.
    fn wait_for_window(&self, bytes: u64) -> Res<()> {
        let t = std::time::Instant::now();
        while self.inner.stats().window_bytes.current < bytes {
            if t.elapsed() > self.refill {
                return Err(format!(
                    "the window did not reach {bytes} bytes within {:?}",
                    self.refill
                ));
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// One request, untimed, that must be a window hit; kept live.
    fn untimed_window_hit(&mut self) -> Res<()> {
        let size = self.next_window_size as usize;
        let hits = self.inner.stats().window_hits;
        let p = self
            .inner
            .malloc_async(size, self.stream.handle())
            .map_err(|e| format!("malloc_async({size}): {e}"))?;
        self.held.push(p);
        if self.inner.stats().window_hits != hits + 1 {
            return Err("an untimed request of the run was not a window hit".into());
        }
        Ok(())
    }
}

impl AllocPath for Mb {
    fn prepare(&mut self) -> Res<()> {
        match self.mode {
            MbMode::Cache | MbMode::CacheTorchContract => Ok(()),
            MbMode::Window => {
                let len = run_len(self.next_window_size);
                if !self.run.starts_run(len) {
                    return Ok(());
                }
                self.give_back_if_over(len)?;
                self.wait_for_window(self.full_window)?;
                for _ in 0..2 {
                    self.untimed_window_hit()?;
                }
                Ok(())
            }
            MbMode::WindowIdle => {
                self.give_back_if_over(2)?;
                self.wait_for_window(self.full_window)
            }
            MbMode::Cold | MbMode::ColdBesideLive => {
                self.stream.sync()?;
                self.inner.release_unused().map_err(|e| format!("release_unused: {e}"))?;
                Ok(())
            }
        }
    }

    fn alloc(&mut self, size: u64) -> Res<u64> {
        self.inner
            .malloc_async(size as usize, self.stream.handle())
            .map_err(|e| format!("malloc_async({size}): {e}"))
    }

    fn free(&mut self, ptr: u64) -> Res<()> {
        if matches!(self.mode, MbMode::Window | MbMode::WindowIdle) {
            // Kept live until the end: a freed range would be cached and serve the next request
            // as a cache hit, and the point here is a fresh range from the window each time.
            self.held.push(ptr);
            return Ok(());
        }
        self.inner.free_async(ptr, self.stream.handle()).map_err(|e| format!("free_async: {e}"))
    }

    fn counts(&self) -> Option<CallCounts> {
        Some(self.inner.driver().counts())
    }

    fn cache_hits(&self) -> Option<u64> {
        Some(self.inner.stats().cache_hits)
    }

    fn times(&self) -> Option<moonbright::driver::CallTimes> {
        Some(self.inner.driver().times())
    }
}

impl Drop for Mb {
    fn drop(&mut self) {
        let _ = self.stream.sync();
        for p in std::mem::take(&mut self.held) {
            let _ = self.inner.free(p);
        }
    }
}

/// `cuMemAlloc_v2` / `cuMemFree_v2` (what cudaMalloc / cudaFree call).
pub struct CuMalloc;

impl AllocPath for CuMalloc {
    fn alloc(&mut self, size: u64) -> Res<u64> {
        crate::cu::mem_alloc(size as usize)
    }
    fn free(&mut self, ptr: u64) -> Res<()> {
        crate::cu::mem_free(ptr)
    }
}

/// `cuMemAllocAsync` / `cuMemFreeAsync` on a stream, from the device's default pool with its
/// release threshold at `u64::MAX` (a warm pool: what cudaMallocAsync gives).
pub struct CuAsync {
    stream: Stream,
    /// The device's default pool.
    pool: sys::CUmemoryPool,
}

impl CuAsync {
    pub fn new(gpu: &Gpu) -> Res<CuAsync> {
        let mut pool: sys::CUmemoryPool = ptr::null_mut();
        // SAFETY: valid out-pointer; the device is valid.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, gpu.device) };
        ck(r, "cuDeviceGetDefaultMemPool")?;
        let mut threshold: u64 = u64::MAX;
        // SAFETY: the release threshold attribute takes a pointer to a cuuint64_t.
        let r = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
        };
        ck(r, "cuMemPoolSetAttribute(RELEASE_THRESHOLD, u64::MAX)")?;
        Ok(CuAsync { stream: Stream::new(true)?, pool })
    }

    /// Gives the pool's unused memory back to the device.
    fn trim(&self) {
        // SAFETY: `pool` is the device's default pool; a trim releases only memory that no
        // allocation uses.
        let _ = unsafe { sys::cuMemPoolTrimTo(self.pool, 0) };
    }
}

impl AllocPath for CuAsync {
    fn alloc(&mut self, size: u64) -> Res<u64> {
        let mut p = 0;
        // SAFETY: valid out-pointer; the stream is live.
        let r = unsafe { sys::cuMemAllocAsync(&mut p, size as usize, self.stream.0) };
        ck(r, format!("cuMemAllocAsync({size})"))?;
        Ok(p)
    }
    fn free(&mut self, ptr: u64) -> Res<()> {
        // SAFETY: `ptr` came from cuMemAllocAsync; the stream is live.
        ck(unsafe { sys::cuMemFreeAsync(ptr, self.stream.0) }, "cuMemFreeAsync")
    }
}

impl Drop for CuAsync {
    fn drop(&mut self) {
        let _ = self.stream.sync();
    }
}

/// `cuMemAllocAsync` serving what a window hit serves: fresh allocations that stay live, in
/// runs of `run_len(size)`, from a default pool (release threshold `u64::MAX`) warmed with a
/// whole run. `prepare` frees the last run (untimed) and makes the first two of the next; the
/// timed ones are the third and later, as for `MbMode::Window`. Its free is a no-op.
pub struct CuAsyncFresh {
    pool: CuAsync,
    size: u64,
    held: Vec<u64>,
    run: RunCursor,
}

impl CuAsyncFresh {
    pub fn new(gpu: &Gpu, size: u64) -> Res<CuAsyncFresh> {
        let mut pool = CuAsync::new(gpu)?;
        let warm: Vec<u64> = (0..run_len(size)).map(|_| pool.alloc(size)).collect::<Res<_>>()?;
        for p in warm {
            pool.free(p)?;
        }
        pool.stream.sync()?;
        Ok(CuAsyncFresh { pool, size, held: Vec::new(), run: RunCursor::default() })
    }
}

impl AllocPath for CuAsyncFresh {
    fn prepare(&mut self) -> Res<()> {
        if !self.run.starts_run(run_len(self.size)) {
            return Ok(());
        }
        for p in std::mem::take(&mut self.held) {
            self.pool.free(p)?;
        }
        self.pool.stream.sync()?;
        for _ in 0..2 {
            let p = self.pool.alloc(self.size)?;
            self.held.push(p);
        }
        Ok(())
    }
    fn alloc(&mut self, size: u64) -> Res<u64> {
        self.pool.alloc(size)
    }
    fn free(&mut self, ptr: u64) -> Res<()> {
        self.held.push(ptr);
        Ok(())
    }
}

impl Drop for CuAsyncFresh {
    fn drop(&mut self) {
        for p in std::mem::take(&mut self.held) {
            let _ = self.pool.free(p);
        }
        // Give the run's memory back to the device (up to 32 GiB at 8 GiB): the paths measured
        // later need it. The warm-pool paths warm up again.
        if self.pool.stream.sync().is_ok() {
            self.pool.trim();
        }
    }
}

/// The raw VMM calls: `cuMemCreate` (one handle, or one per page), `cuMemAddressReserve`,
/// `cuMemMap` each handle, one `cuMemSetAccess` over the range; the free is one `cuMemUnmap`
/// over the range, `cuMemAddressFree` and `cuMemRelease` of each handle.
pub struct RawVmm {
    gpu_prop: sys::CUmemAllocationProp,
    access: sys::CUmemAccessDesc,
    page: u64,
    per_page: bool,
    /// Reserve whole 1 GiB-aligned regions, so that nothing else is mapped in the range's
    /// region (as in an empty allocator); otherwise the driver places the reservation, beside
    /// the process's other mappings.
    own_region: bool,
    /// (address, mapped bytes, reserved bytes, handles).
    live: Vec<(u64, u64, u64, Vec<u64>)>,
    /// Time in each kind of call so far, as MoonBright's driver layer keeps it.
    times: moonbright::driver::CallTimes,
}

impl RawVmm {
    pub fn new(gpu: &Gpu, per_page: bool) -> Res<RawVmm> {
        RawVmm::with_placement(gpu, per_page, false)
    }

    /// One handle a range, each in 1 GiB regions of its own (see `own_region`).
    pub fn in_own_region(gpu: &Gpu) -> Res<RawVmm> {
        RawVmm::with_placement(gpu, false, true)
    }

    fn with_placement(gpu: &Gpu, per_page: bool, own_region: bool) -> Res<RawVmm> {
        Ok(RawVmm {
            gpu_prop: gpu.alloc_prop(),
            access: sys::CUmemAccessDesc {
                location: gpu.location(),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            },
            page: gpu.granularity()? as u64,
            per_page,
            own_region,
            live: Vec::new(),
            times: Default::default(),
        })
    }

    fn unwind(&self, va: u64, len: u64, mapped: u64, handles: &[u64]) {
        // SAFETY: best-effort cleanup of what this call made: the mapped prefix, the
        // reservation and the handles, each exactly once.
        unsafe {
            if mapped > 0 {
                let _ = sys::cuMemUnmap(va, mapped as usize);
            }
            if va != 0 {
                let _ = sys::cuMemAddressFree(va, len as usize);
            }
            for &h in handles {
                let _ = sys::cuMemRelease(h);
            }
        }
    }

    /// Runs one driver call, adding its time to `kind`.
    fn timed(&mut self, kind: CallKind, call: impl FnOnce() -> sys::CUresult) -> sys::CUresult {
        let t = std::time::Instant::now();
        let r = call();
        let ns = t.elapsed().as_nanos() as u64;
        self.times.total_ns[kind as usize] += ns;
        let max = &mut self.times.max_ns[kind as usize];
        *max = (*max).max(ns);
        r
    }
}

impl AllocPath for RawVmm {
    fn times(&self) -> Option<moonbright::driver::CallTimes> {
        Some(self.times)
    }

    fn alloc(&mut self, size: u64) -> Res<u64> {
        let len = size.next_multiple_of(self.page);
        let (n, hsize) = if self.per_page { (len / self.page, self.page) } else { (1, len) };
        let mut handles = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let mut h = 0;
            let prop = self.gpu_prop;
            let r = self.timed(CallKind::Create, || {
                // SAFETY: valid out-pointer and a fully initialised property struct.
                unsafe { sys::cuMemCreate(&mut h, hsize as usize, &prop, 0) }
            });
            if let Err(e) = ck(r, format!("cuMemCreate({hsize})")) {
                self.unwind(0, 0, 0, &handles);
                return Err(e);
            }
            handles.push(h);
        }
        let (rlen, align) =
            if self.own_region { (len.next_multiple_of(GIB), GIB) } else { (len, 0) };
        let mut va = 0;
        let r = self.timed(CallKind::Reserve, || {
            // SAFETY: valid out-pointer.
            unsafe { sys::cuMemAddressReserve(&mut va, rlen as usize, align as usize, 0, 0) }
        });
        if let Err(e) = ck(r, format!("cuMemAddressReserve({rlen})")) {
            self.unwind(0, 0, 0, &handles);
            return Err(e);
        }
        for (i, &h) in handles.iter().enumerate() {
            let at = va + i as u64 * hsize;
            let r = self.timed(CallKind::Map, || {
                // SAFETY: `at` lies in the reservation just made; `h` is a handle of `hsize`
                // bytes.
                unsafe { sys::cuMemMap(at, hsize as usize, 0, h, 0) }
            });
            if let Err(e) = ck(r, "cuMemMap") {
                self.unwind(va, rlen, i as u64 * hsize, &handles);
                return Err(e);
            }
        }
        let access = self.access;
        let r = self.timed(CallKind::SetAccess, || {
            // SAFETY: the range is fully mapped; one descriptor.
            unsafe { sys::cuMemSetAccess(va, len as usize, &access, 1) }
        });
        if let Err(e) = ck(r, "cuMemSetAccess") {
            self.unwind(va, rlen, len, &handles);
            return Err(e);
        }
        self.live.push((va, len, rlen, handles));
        Ok(va)
    }

    fn free(&mut self, ptr: u64) -> Res<()> {
        let i = self.live.iter().position(|l| l.0 == ptr).ok_or("raw VMM: unknown pointer")?;
        let (va, len, rlen, handles) = self.live.swap_remove(i);
        let r = self.timed(CallKind::Unmap, || {
            // SAFETY: the range is mapped by this path and no work uses it.
            unsafe { sys::cuMemUnmap(va, len as usize) }
        });
        ck(r, "cuMemUnmap")?;
        // SAFETY: the reservation was made by `alloc` and is now unmapped.
        ck(unsafe { sys::cuMemAddressFree(va, rlen as usize) }, "cuMemAddressFree")?;
        for h in handles {
            let r = self.timed(CallKind::Release, || {
                // SAFETY: each handle was created by `alloc` and is released once.
                unsafe { sys::cuMemRelease(h) }
            });
            ck(r, "cuMemRelease")?;
        }
        Ok(())
    }
}

impl Drop for RawVmm {
    fn drop(&mut self) {
        for (va, len, rlen, handles) in std::mem::take(&mut self.live) {
            self.unwind(va, rlen, len, &handles);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_cursor_times_all_but_the_first_two_of_each_run() {
        let mut c = RunCursor::default();
        // Repetitions of two runs of 5: each run's set-up makes 2 untimed requests, so 3 timed.
        let starts: Vec<bool> = (0..6).map(|_| c.starts_run(5)).collect();
        assert_eq!(starts, vec![true, false, false, true, false, false]);
        assert_eq!(run_len(GIB), 16);
        assert_eq!(run_len(8 * GIB), 4);
        assert_eq!(run_window(2 * MIB), GIB, "at least 1 GiB");
    }
}
