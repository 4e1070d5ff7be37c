//! The device side of the paged pool: the table kernel (`kernels.cu`) compiled with NVRTC at run
//! time, loaded once per device context through the driver contract (`Kernels`), and its stream-ordered launch, one a step. A step's delta goes
//! through a ring of pinned, device-mapped staging buffers that the kernels read directly. Steps
//! fill one buffer one after another; when the next delta does not fit, an event is recorded
//! behind the buffer's last kernels and the step moves on to a buffer whose event has completed
//! (queried, never waited for, unless the ring is at its largest). So most steps make no event
//! call at all.

use std::ffi::{c_void, CString};
use std::ptr;
use std::sync::Mutex;

use crate::config::{PagedConfig, TablePointers};
use crate::delta::{Delta, PageCopy, TableOp, TokenRun};
use crate::error::{PagedError, PagedResult};
use moonbright::driver::{
    Backend, EventHandle, KernelHandle, Kernels as _, PinnedBuffer, StreamHandle, Streams,
};
use moonbright::DevicePtr;

/// The kernels' CUDA C source.
pub fn kernel_source() -> &'static str {
    include_str!("kernels.cu")
}

/// How NVRTC compiles the kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvrtcOptions {
    /// Compute capability (major, minor); the PTX targets `compute_<major><minor>`.
    pub arch: (i32, i32),
    /// Line information for profilers and compute-sanitizer.
    pub line_info: bool,
}

/// NVRTC's arguments for `opts`.
pub fn nvrtc_options(opts: &NvrtcOptions) -> Vec<String> {
    let mut v = vec![
        format!("--gpu-architecture=compute_{}{}", opts.arch.0, opts.arch.1),
        "--std=c++14".to_string(),
    ];
    if opts.line_info {
        v.push("--generate-line-info".into());
    }
    v
}

/// Compiles the kernels to PTX. Fails with a message (never panics) when libnvrtc cannot be
/// loaded or the compilation fails.
pub fn compile_ptx(opts: &NvrtcOptions) -> Result<String, String> {
    moonbright::nvrtc::compile_ptx(kernel_source(), "moonbright_paged.cu", nvrtc_options(opts))
}

/// The kernel of a loaded module.
#[derive(Clone, Copy, Debug)]
struct Kernels {
    step: KernelHandle,
}

/// Loaded modules, by the context they were loaded into (`Kernels::module_context`: the primary
/// context is shared by every driver of its device). Modules are never unloaded, and the driver
/// keeps their context alive, so an entry never goes stale.
static MODULES: Mutex<Vec<(u64, Kernels)>> = Mutex::new(Vec::new());

fn kernels_for(d: &Backend) -> Result<Kernels, String> {
    let key = d.module_context().map_err(|e| e.message)?;
    let mut cache = MODULES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, k)) = cache.iter().find(|(c, _)| *c == key) {
        return Ok(*k);
    }
    let arch = d.compute_capability().map_err(|e| e.message)?;
    let ptx = compile_ptx(&NvrtcOptions { arch, line_info: true })?;
    let image = CString::new(ptx).map_err(|_| "NVRTC produced PTX with a NUL byte")?;
    let module = d.load_module(image.as_bytes_with_nul()).map_err(|e| e.message)?;
    let step = d.kernel_function(module, "mb_paged_step").map_err(|e| e.message)?;
    let k = Kernels { step };
    cache.push((key, k));
    Ok(k)
}

/// One pinned staging buffer of the ring.
struct Staging {
    host: *mut u8,
    device: u64,
    bytes: usize,
    /// Recorded after the last kernels that read this buffer.
    event: Option<EventHandle>,
    /// Its event was recorded behind its last kernels and has not been seen complete.
    busy: bool,
}

/// The device-side state of one pool: its kernels and its staging ring.
pub(crate) struct DeviceTables {
    kernels: Kernels,
    ring: Vec<Staging>,
    next: usize,
    /// The buffer steps are filling now (no event recorded behind it yet), and the bytes of it
    /// they used.
    filling: Option<usize>,
    used: usize,
    /// The pool's stream: every launch, and the events behind them.
    stream: StreamHandle,
    /// The kernel's block counters (zeroed device memory of the pool, zero between launches).
    sync: DevicePtr,
    driver: *const Backend,
}

// SAFETY: the raw pointers are a pinned host buffer owned by this value (freed in `release`)
// and the allocator's driver, which outlives the pool (the pool borrows the allocator); nothing
// here is tied to a thread.
unsafe impl Send for DeviceTables {}

/// The most staging buffers a pool keeps; past it, a step waits for the oldest.
const MAX_RING: usize = 64;
/// The smallest staging buffer: a step of 4096 decode rows uses about 10 KB of it.
const MIN_STAGING: usize = 256 << 10;
const THREADS: u32 = 256;
/// Blocks per copy-on-write page copy (as in kernels.cu).
const COPY_BLOCKS: u32 = 4;

/// `mb_paged_step`'s one argument; the twin of `StepArgs` in kernels.cu.
#[repr(C)]
struct StepArgs {
    ops: DevicePtr,
    copies: DevicePtr,
    runs: DevicePtr,
    block_table: DevicePtr,
    seq_lens: DevicePtr,
    batch_rows: DevicePtr,
    pages: DevicePtr,
    slot_mapping: DevicePtr,
    sync: DevicePtr,
    page_bytes: u64,
    n_ops: u32,
    n_copies: u32,
    n_runs: u32,
    explicit_tokens: u32,
    decode_rows: u32,
    max_pages_per_seq: u32,
    tokens_per_page: u32,
    op_blocks: u32,
    copy_blocks: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<StepArgs>() == 120);

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

impl DeviceTables {
    /// The kernels and an empty ring, on a driver that runs kernels (`Kernels::runs_kernels`).
    pub(crate) fn new(d: &Backend, stream: StreamHandle, sync: DevicePtr) -> PagedResult<Self> {
        let kernels = kernels_for(d).map_err(PagedError::Device)?;
        Ok(DeviceTables {
            kernels,
            ring: Vec::new(),
            next: 0,
            filling: None,
            used: 0,
            stream,
            sync,
            driver: d,
        })
    }

    fn driver(&self) -> &Backend {
        // SAFETY: the allocator that owns the driver outlives the pool (see `Send` above).
        unsafe { &*self.driver }
    }

    /// A staging buffer of at least `bytes` whose last use has completed.
    fn staging(&mut self, bytes: usize) -> Result<usize, String> {
        let n = self.ring.len();
        let mut pick = None;
        for k in 0..n {
            let i = (self.next + k) % n;
            let s = &self.ring[i];
            let done = !s.busy
                || match s.event {
                    Some(e) => self.driver().event_done(e).map_err(|e| e.to_string())?,
                    None => true,
                };
            if done {
                pick = Some(i);
                break;
            }
        }
        let i = match pick {
            Some(i) => i,
            None if n < MAX_RING => {
                let event = self.driver().create_event().map_err(|e| e.to_string())?;
                self.ring.push(Staging {
                    host: ptr::null_mut(),
                    device: 0,
                    bytes: 0,
                    event: Some(event),
                    busy: false,
                });
                n
            }
            None => {
                let i = self.next % n;
                if let Some(e) = self.ring[i].event {
                    self.driver().synchronize_event(e).map_err(|e| e.to_string())?;
                }
                i
            }
        };
        self.ring[i].busy = false;
        if self.ring[i].bytes < bytes {
            let size = bytes.next_power_of_two().max(MIN_STAGING);
            let driver = self.driver;
            let s = &mut self.ring[i];
            if !s.host.is_null() {
                let old = PinnedBuffer { host: s.host, device: s.device, bytes: s.bytes };
                // SAFETY: allocated by `alloc_pinned` below, freed once (the ring forgets it
                // next); its last use has completed. `driver` outlives the pool (see `Send`).
                let _ = unsafe { (*driver).free_pinned(old) };
                s.host = ptr::null_mut();
                s.bytes = 0;
            }
            // SAFETY: as above, the driver outlives the pool.
            let pinned = unsafe { &*driver }.alloc_pinned(size).map_err(|e| e.message)?;
            s.host = pinned.host;
            s.device = pinned.device;
            s.bytes = pinned.bytes;
        }
        self.next = (i + 1) % self.ring.len();
        Ok(i)
    }

    /// Records the event behind the kernels that read the buffer being filled: it is reused
    /// once that event completes.
    fn retire_filling(&mut self) -> Result<(), String> {
        if let Some(i) = self.filling.take() {
            if let Some(e) = self.ring[i].event {
                self.driver().record_event(e, self.stream).map_err(|e| e.to_string())?;
            }
            self.ring[i].busy = true;
        }
        Ok(())
    }

    /// `bytes` (a multiple of 16) of staging that no kernel reads now: the rest of the buffer
    /// being filled, or the start of another. Returns the buffer and the offset.
    fn reserve(&mut self, bytes: usize) -> Result<(usize, usize), String> {
        if let Some(i) = self.filling {
            if self.used + bytes <= self.ring[i].bytes {
                let off = self.used;
                self.used += bytes;
                return Ok((i, off));
            }
            self.retire_filling()?;
        }
        let i = self.staging(bytes)?;
        self.filling = Some(i);
        self.used = bytes;
        Ok((i, 0))
    }

    /// Ships `d` and launches the step's kernel on the pool's stream.
    pub(crate) fn launch(
        &mut self,
        d: &Delta,
        p: &TablePointers,
        cfg: &PagedConfig,
    ) -> Result<(), String> {
        let n_ops = d.ops.len();
        let n_copies = d.copies.len();
        let n_runs = d.runs.len();
        let tokens = d.step_tokens();
        if n_ops == 0 && n_copies == 0 && tokens == 0 {
            return Ok(());
        }
        let ops_bytes = align16(n_ops * std::mem::size_of::<TableOp>());
        let copies_bytes = align16(n_copies * std::mem::size_of::<PageCopy>());
        let runs_bytes = n_runs * std::mem::size_of::<TokenRun>();
        let (i, off) = self.reserve(ops_bytes + copies_bytes + align16(runs_bytes))?;
        // SAFETY: `off` is within the buffer (reserve checked it against the buffer's size).
        let host = unsafe { self.ring[i].host.add(off) };
        let dev = self.ring[i].device + off as u64;
        // SAFETY: the buffer holds at least the bytes written from `off` (reserved above) and no
        // kernel reads them now: they were never used since the buffer's event completed; the
        // records are plain `repr(C)` words.
        unsafe {
            ptr::copy_nonoverlapping(d.ops.as_ptr().cast::<u8>(), host, n_ops * 12);
            ptr::copy_nonoverlapping(
                d.copies.as_ptr().cast::<u8>(),
                host.add(ops_bytes),
                n_copies * 8,
            );
            ptr::copy_nonoverlapping(
                d.runs.as_ptr().cast::<u8>(),
                host.add(ops_bytes + copies_bytes),
                runs_bytes,
            );
        }
        let op_blocks = (n_ops as u32).div_ceil(THREADS);
        let copy_blocks = n_copies as u32 * COPY_BLOCKS;
        let grid = op_blocks + copy_blocks + tokens.div_ceil(THREADS);
        let dev_at = |offset: usize| dev + offset as u64;
        let args = StepArgs {
            ops: dev_at(0),
            copies: dev_at(ops_bytes),
            runs: dev_at(ops_bytes + copies_bytes),
            block_table: p.block_table,
            seq_lens: p.seq_lens,
            batch_rows: p.batch_rows,
            pages: p.pages,
            slot_mapping: p.slot_mapping,
            sync: self.sync,
            page_bytes: cfg.page_bytes() as u64,
            n_ops: n_ops as u32,
            n_copies: n_copies as u32,
            n_runs: n_runs as u32,
            explicit_tokens: d.explicit_tokens,
            decode_rows: d.decode_rows,
            max_pages_per_seq: cfg.max_pages_per_seq,
            tokens_per_page: cfg.tokens_per_page,
            op_blocks,
            copy_blocks,
            pad: 0,
        };
        let mut params: [*mut c_void; 1] = [(&args as *const StepArgs).cast_mut().cast()];
        // The driver enters its context for the launch and leaves the caller's thread with its
        // own (a PyTorch user's current device).
        // SAFETY: mb_paged_step takes one `StepArgs` by value and this is its `repr(C)` twin
        // (the layout is asserted on both sides); the driver copies it during the call. Every
        // pointer in it is a buffer of this pool (fixed tables, pages, counters, the staging
        // bytes reserved above) that outlives the kernel.
        let r = unsafe {
            self.driver().launch(self.kernels.step, grid, THREADS, self.stream, &mut params)
        };
        r.map_err(|e| e.message)?;
        Ok(())
    }

    /// Waits for the staging buffers' last kernels and frees them (the pool is going away).
    pub(crate) fn release(&mut self) {
        let filling = self.filling;
        if self.retire_filling().is_err() {
            // No event behind its kernels: leak the buffer rather than free it under them.
            if let Some(i) = filling {
                self.ring[i].host = ptr::null_mut();
            }
        }
        let ring = std::mem::take(&mut self.ring);
        for s in ring {
            if let Some(e) = s.event {
                if s.busy {
                    let _ = self.driver().synchronize_event(e);
                }
                let _ = self.driver().destroy_event(e);
            }
            if !s.host.is_null() {
                let buffer = PinnedBuffer { host: s.host, device: s.device, bytes: s.bytes };
                // SAFETY: allocated by `alloc_pinned` and freed once (the ring is gone); no
                // kernel reads it any more (waited above).
                let _ = unsafe { self.driver().free_pinned(buffer) };
            }
        }
    }
}

impl Drop for DeviceTables {
    fn drop(&mut self) {
        self.release();
    }
}

// Not under Miri: these tests run the host backend's memfd and mmap calls (or the CUDA
// driver), which Miri cannot interpret.
#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;

    #[test]
    fn options_are_plain_arguments() {
        let a = nvrtc_options(&NvrtcOptions { arch: (9, 0), line_info: false });
        assert_eq!(a, ["--gpu-architecture=compute_90", "--std=c++14"]);
        let b = nvrtc_options(&NvrtcOptions { arch: (8, 6), line_info: true });
        assert!(b.contains(&"--gpu-architecture=compute_86".to_string()));
        assert!(b.contains(&"--generate-line-info".to_string()));
    }

    /// Compiles the kernels with NVRTC when libnvrtc is on the loader path (scripts/test.sh
    /// installs PyPI's nvidia-cuda-nvrtc for it), else skips as a GPU test does (counted; a
    /// failure under `MOONBRIGHT_REQUIRE_GPU=1`).
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !moonbright::libs::libnvrtc_present() {
            moonbright::testing::skip(
                "no libnvrtc on the loader path (scripts/test.sh provides one)",
            );
            return;
        }
        let ptx = compile_ptx(&NvrtcOptions { arch: (8, 0), line_info: true })
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(ptx.contains(".entry mb_paged_step"), "mb_paged_step missing from the PTX");
        println!("compiled the paged kernels: {} bytes of PTX", ptx.len());
    }
}
