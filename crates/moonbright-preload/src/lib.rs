//! `libmoonbright_preload.so`: MoonBright under an unmodified CUDA program.
//!
//! ```text
//! LD_PRELOAD=libmoonbright_preload.so ./program
//! ```
//!
//! It defines the CUDA runtime's `cudaMalloc`, `cudaFree`, `cudaMallocAsync` and
//! `cudaFreeAsync` (and the `_ptsz` forms that `--default-stream per-thread` builds call), and
//! `cudaMemGetInfo` (which counts memory MoonBright holds unused as free), and
//! the program's calls reach these before libcudart's, wherever libcudart is loaded from, as
//! long as it is loaded as a shared library (a program linked with the static runtime is not
//! reached). Each device's allocations come from a process-wide MoonBright allocator
//! (`moonbright::devices`), made at the first call on that device with the options of
//! `MOONBRIGHT_ALLOC_CONF`. Everything else passes to the runtime:
//!
//! - `cudaFree(NULL)` (the idiom that creates the context), zero-byte requests, and frees of
//!   pointers that MoonBright did not hand out (the runtime reports those it does not know);
//! - every call on a device whose allocator cannot be made (bad options, no virtual-memory
//!   support): said once on stderr, and the program goes on with the runtime's memory.
//!
//! Semantics are the runtime's: `cudaMalloc` returns memory no stream's queued work still uses;
//! `cudaFree` waits for the device, as the runtime's does, then frees;
//! `cudaMallocAsync`/`cudaFreeAsync` are stream-ordered (MoonBright's `malloc_async` and
//! `free_async`). Errors come back as `cudaError_t` (out of memory: `cudaErrorMemoryAllocation`)
//! with MoonBright's message kept for `moonbright_preload_last_error`; no call panics across.
//! IPC handles of MoonBright's memory (`cudaIpcGetMemHandle`, `cudaIpcOpenMemHandle`,
//! `cudaIpcCloseMemHandle`, which the runtime's own calls refuse on virtual-memory allocations)
//! are MoonBright's: the handle names the exporting process's broker, which hands the importer
//! the memory's file descriptors (`ipc.rs`); the importer must run the interposer too. Handles
//! of other memory go to the runtime.
//! Not interposed: the pitched, 3D, managed and pool allocation calls (they go to the runtime,
//! and so do their frees).
//!
//! Tags, sleep and wake (`tags.rs`), exported for the program (from Python,
//! `ctypes.CDLL(None).moonbright_sleep`), each returning a `cudaError_t`-like status (0 on
//! success; the message in `moonbright_preload_last_error`):
//!
//! ```text
//! int moonbright_tag_begin(const char *tag);   // the tag before, for tag_end; -1 if refused
//! int moonbright_tag_end(int previous);
//! int moonbright_sleep(const char *tag, int backup);   // backup: 1 host, 0 discard
//! int moonbright_wake(const char *tag);
//! int moonbright_release_host_memory(void);
//! ```
//!
//! What the calling thread `cudaMalloc`s between a begin and its end carries the tag (names
//! are process-wide; begins nest). Sleep and wake act on the current device's allocator, as
//! `cudaMalloc` does, and are the core's `Allocator::sleep` and `Allocator::wake`: the tag's
//! memory goes back to the driver with its addresses kept, and comes back at them. A sleep
//! first waits for the device, as `cudaFree` does, since a `cudaMalloc`'s memory names no
//! stream whose work the core could wait for. While a tag
//! sleeps, a `cudaMalloc` under it and a `cudaFree` of its memory fail with
//! `cudaErrorIllegalState`, as do a sleep of a sleeping tag and a wake of an awake one; a wake
//! short of memory fails with `cudaErrorMemoryAllocation`, the tag still asleep and whole.

mod ipc;
mod runtime;
mod tags;

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use moonbright::devices::{Devices, MAX_DEVICES};
use moonbright::{conf, Allocator, BackendKind, Error, Options, StreamHandle};

pub use ipc::{Handle, IpcMemHandle};
pub use runtime::{code, Real, Runtime};
pub use tags::{BACKUP_DISCARD, BACKUP_HOST};

/// `CU_STREAM_PER_THREAD`: what the null stream means in a `_ptsz` call.
const PER_THREAD_STREAM: u64 = 2;

/// Calls served and passed on, for `moonbright_preload_report`.
pub struct Counts {
    pub served_allocs: AtomicU64,
    pub served_frees: AtomicU64,
    pub passed_allocs: AtomicU64,
    pub passed_frees: AtomicU64,
    /// `cudaFree`s of MoonBright's memory, each after a device synchronisation.
    pub synchronous_frees: AtomicU64,
    /// IPC handles of MoonBright's memory given out, and opened (a second open of one counts).
    pub ipc_handles: AtomicU64,
    pub ipc_opens: AtomicU64,
}

/// The interposer over a runtime `R` (the real one in the library, a fake in tests).
pub struct Interposer<R> {
    runtime: R,
    devices: Devices,
    /// Devices whose allocator could not be made: their calls go to the runtime.
    refused: [AtomicBool; MAX_DEVICES],
    /// The options of a new allocator, before its device is set.
    options: fn() -> Result<Options, String>,
    pub counts: Counts,
    last_error: Mutex<Option<String>>,
    ipc: ipc::Broker,
}

fn env_options() -> Result<Options, String> {
    let o = conf::from_env().map_err(|e| format!("{}: {e}", conf::ENV_VAR))?;
    cuda_only(o)
}

/// The CUDA backend (`auto` becomes it); the host backend is refused: its memory is the host's,
/// and a kernel given it as device memory faults (an inherited `MOONBRIGHT_ALLOC_CONF` of CPU
/// tests did that to PyTorch on the H200).
pub fn cuda_only(o: Options) -> Result<Options, String> {
    match o.backend {
        BackendKind::Cuda | BackendKind::Auto => Ok(Options { backend: BackendKind::Cuda, ..o }),
        other => Err(format!(
            "{} asks for the {other:?} backend, whose memory is not the GPU's; the interposer \
             serves only backend:cuda",
            conf::ENV_VAR
        )),
    }
}

/// The `cudaError_t` for a MoonBright error.
fn code_of(e: &Error) -> c_int {
    match e {
        Error::OutOfMemory { .. }
        | Error::TooLarge { .. }
        | Error::AddressSpaceExhausted { .. } => code::MEMORY_ALLOCATION,
        Error::StreamCapture { .. } => code::STREAM_CAPTURE_UNSUPPORTED,
        Error::UnknownPointer { .. }
        | Error::DoubleFree { .. }
        | Error::InteriorPointer { .. }
        | Error::InvalidOption { .. }
        | Error::InvalidArgument(_) => code::INVALID_VALUE,
        Error::TagAsleep { .. } | Error::TagState { .. } => code::ILLEGAL_STATE,
        _ => code::UNKNOWN,
    }
}

impl<R: Runtime> Interposer<R> {
    pub const fn new(runtime: R, options: fn() -> Result<Options, String>) -> Self {
        Interposer {
            runtime,
            devices: Devices::new(),
            refused: [const { AtomicBool::new(false) }; MAX_DEVICES],
            options,
            counts: Counts {
                served_allocs: AtomicU64::new(0),
                served_frees: AtomicU64::new(0),
                passed_allocs: AtomicU64::new(0),
                passed_frees: AtomicU64::new(0),
                synchronous_frees: AtomicU64::new(0),
                ipc_handles: AtomicU64::new(0),
                ipc_opens: AtomicU64::new(0),
            },
            last_error: Mutex::new(None),
            ipc: ipc::Broker::new(),
        }
    }

    pub fn runtime(&self) -> &R {
        &self.runtime
    }

    pub fn devices(&self) -> &Devices {
        &self.devices
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Keeps `message` for `moonbright_preload_last_error`.
    fn note(&self, message: String) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
    }

    /// Keeps `message` and returns `code`.
    fn fail(&self, message: String, code: c_int) -> c_int {
        self.note(message);
        code
    }

    /// The allocator of `device`, or `None` if its calls go to the runtime.
    fn allocator(&self, device: i32) -> Option<&Allocator> {
        let i = Devices::index(device).ok()?;
        if self.refused[i].load(Ordering::Acquire) {
            return None;
        }
        let create = || {
            let mut o = (self.options)()?;
            o.device = device;
            Allocator::new(o).map_err(|e| format!("cannot create the allocator: {e}"))
        };
        match self.devices.get_or_create(device, create, |m| self.note(m)) {
            Ok(a) => Some(a),
            Err(m) => {
                if !self.refused[i].swap(true, Ordering::AcqRel) {
                    let m = format!("device {device}: {m}; its allocations go to the CUDA runtime");
                    let _ = catch_unwind(|| eprintln!("moonbright-preload: {m}"));
                    self.note(m);
                }
                None
            }
        }
    }

    /// `cudaMalloc` (`stream: None`) or `cudaMallocAsync`.
    ///
    /// # Safety
    /// `out` is null or valid for a pointer's write.
    pub unsafe fn malloc(&self, out: *mut *mut c_void, size: usize, stream: Option<u64>) -> c_int {
        if out.is_null() {
            return self.fail("a null pointer for the result".into(), code::INVALID_VALUE);
        }
        let pass = || {
            self.counts.passed_allocs.fetch_add(1, Ordering::Relaxed);
            // SAFETY: `out` is valid, as the caller guarantees.
            unsafe { self.runtime.malloc(out, size, stream) }
        };
        if size == 0 {
            return pass();
        }
        let device = match self.runtime.get_device() {
            Ok(d) => d,
            Err(e) => return e,
        };
        let Some(a) = self.allocator(device) else {
            return pass();
        };
        // `malloc` takes no memory still pending on any stream: `cudaMalloc`'s promise.
        let r = match stream {
            None => a.malloc(size),
            Some(s) => a.malloc_async(size, StreamHandle(s)),
        };
        match r {
            Ok(p) => {
                // SAFETY: `out` is valid, as the caller guarantees.
                unsafe { *out = p as *mut c_void };
                self.counts.served_allocs.fetch_add(1, Ordering::Relaxed);
                code::SUCCESS
            }
            Err(e) => self.fail(format!("device {device}: {e}"), code_of(&e)),
        }
    }

    /// `cudaFree` (`stream: None`) or `cudaFreeAsync`.
    pub fn free(&self, ptr: *mut c_void, stream: Option<u64>) -> c_int {
        let owner = if ptr.is_null() { None } else { self.devices.owner(ptr as u64) };
        let Some((device, a)) = owner else {
            self.counts.passed_frees.fetch_add(1, Ordering::Relaxed);
            return self.runtime.free(ptr as u64, stream);
        };
        // A freed allocation's IPC handle is void: `Broker::free` forgets it before the free,
        // so that no importer is served it once the memory may be another allocation's.
        let r = match stream {
            Some(s) => self.ipc.free(ptr as u64, || a.free_async(ptr as u64, StreamHandle(s))),
            None => {
                let synced = self.synchronize(device as i32);
                if synced != code::SUCCESS {
                    // Work may still use it: keep it (the runtime's cudaFree would fail too).
                    return self.fail(
                        format!("device {device}: synchronising before the free failed ({synced})"),
                        synced,
                    );
                }
                self.counts.synchronous_frees.fetch_add(1, Ordering::Relaxed);
                self.ipc.free(ptr as u64, || a.free(ptr as u64))
            }
        };
        match r {
            Ok(()) => {
                self.counts.served_frees.fetch_add(1, Ordering::Relaxed);
                code::SUCCESS
            }
            Err(e) => self.fail(format!("device {device}: {e}"), code_of(&e)),
        }
    }

    /// `cudaIpcGetMemHandle`: for MoonBright's allocation starting at `ptr`, a handle that
    /// another process running the interposer opens (the same handle each time until the
    /// allocation is freed); other memory's from the runtime. The first starts the process's
    /// broker thread, which serves importers for as long as the process lives (so `'static`).
    ///
    /// # Safety
    /// `out` is null or valid for a handle's write.
    pub unsafe fn ipc_get_mem_handle(
        &'static self,
        out: *mut IpcMemHandle,
        ptr: *mut c_void,
    ) -> c_int {
        if out.is_null() {
            return self.fail("a null pointer for the handle".into(), code::INVALID_VALUE);
        }
        let ptr = ptr as u64;
        let Some((device, a)) = (ptr != 0).then(|| self.devices.owner(ptr)).flatten() else {
            // SAFETY: `out` is valid, as the caller guarantees.
            return unsafe { self.runtime.ipc_get_mem_handle(out, ptr) };
        };
        let check = || a.export(ptr).map_err(|e| e.to_string());
        let start = |listener| {
            let serve = move || self.ipc.serve(listener, |p, d| self.export_for_ipc(p, d));
            std::thread::Builder::new().name("moonbright-ipc".into()).spawn(serve).map(drop)
        };
        match self.ipc.handle(ptr, device as i32, check, start) {
            Ok(h) => {
                // SAFETY: `out` is valid, as the caller guarantees.
                unsafe { *out = h };
                self.counts.ipc_handles.fetch_add(1, Ordering::Relaxed);
                code::SUCCESS
            }
            Err(m) => {
                let m = format!("device {device}: cannot share {ptr:#x}: {m}");
                self.fail(m, code::INVALID_VALUE)
            }
        }
    }

    /// How long opening a handle may wait for its exporter in all (connect, answer, every
    /// descriptor) before `cudaIpcOpenMemHandle` fails, and how long this process's broker
    /// gives each importer: 10 s unless set.
    pub fn set_ipc_timeout(&self, timeout: std::time::Duration) {
        self.ipc.set_patience(timeout);
    }

    /// The broker's export of the allocation at `ptr` on `device`, for one importer.
    fn export_for_ipc(&self, ptr: u64, device: i32) -> Result<moonbright::ipc::Export, String> {
        let a = self.devices.get(device).ok_or_else(|| format!("device {device}: no allocator"))?;
        a.export(ptr).map_err(|e| e.to_string())
    }

    /// `cudaIpcOpenMemHandle`: a handle MoonBright wrote is fetched from its exporter and mapped
    /// on the current device by its allocator; other handles go to the runtime. `flags` (peer
    /// access) mean nothing to MoonBright: its import sets access for its device.
    ///
    /// # Safety
    /// `out` is null or valid for a pointer's write.
    pub unsafe fn ipc_open_mem_handle(
        &self,
        out: *mut *mut c_void,
        handle: IpcMemHandle,
        flags: c_uint,
    ) -> c_int {
        if out.is_null() {
            return self.fail("a null pointer for the result".into(), code::INVALID_VALUE);
        }
        let Some(h) = Handle::decode(&handle) else {
            // SAFETY: `out` is valid, as the caller guarantees.
            return unsafe { self.runtime.ipc_open_mem_handle(out, handle, flags) };
        };
        let device = match self.runtime.get_device() {
            Ok(d) => d,
            Err(e) => return e,
        };
        let Some(a) = self.allocator(device) else {
            return self.fail(
                format!(
                    "device {device}: a MoonBright IPC handle needs MoonBright's allocator, and \
                     this device's could not be made"
                ),
                code::NOT_SUPPORTED,
            );
        };
        let import = |e: &moonbright::ipc::Export| a.import(e).map_err(|e| e.to_string());
        match self.ipc.open(&h, device, import) {
            Ok(p) => {
                // SAFETY: `out` is valid, as the caller guarantees.
                unsafe { *out = p as *mut c_void };
                self.counts.ipc_opens.fetch_add(1, Ordering::Relaxed);
                code::SUCCESS
            }
            Err(ipc::Fetch::Unreachable(m)) => {
                self.fail(format!("device {device}: {m}"), code::INVALID_RESOURCE_HANDLE)
            }
            Err(ipc::Fetch::Import(m)) => self.fail(
                format!("device {device}: cannot map the memory of process {}: {m}", h.pid),
                code::MAP_BUFFER_OBJECT_FAILED,
            ),
        }
    }

    /// `cudaIpcCloseMemHandle`: the last close of a MoonBright import unmaps it (at once: the
    /// caller's work on it must have completed, as with the runtime's); a failed unmap keeps
    /// it open. Other pointers go to the runtime.
    pub fn ipc_close_mem_handle(&self, ptr: *mut c_void) -> c_int {
        let ptr = ptr as u64;
        let unmap = |device: i32| match self.devices.get(device) {
            Some(a) => a.close_import(ptr).map_err(|e| format!("device {device}: {e}")),
            None => Err(format!("device {device} has no allocator")),
        };
        match self.ipc.close(ptr, unmap) {
            None => self.runtime.ipc_close_mem_handle(ptr),
            Some(Ok(())) => code::SUCCESS,
            Some(Err(m)) => {
                self.fail(format!("cannot unmap import {ptr:#x}: {m}"), code::INVALID_VALUE)
            }
        }
    }

    /// `cudaMemGetInfo`: what a `cudaMalloc` could get. The memory MoonBright holds for the
    /// current device and no allocation uses counts as free, and what it may still create from
    /// the driver's free memory is bounded by its cap. It makes the device's allocator if need
    /// be (a program asks before its first allocation, and the cap applies from then on); a
    /// device whose calls go to the runtime gets the driver's figures.
    pub fn mem_get_info(&self) -> Result<(usize, usize), c_int> {
        let (free, total) = self.runtime.mem_get_info()?;
        let device = self.runtime.get_device()?;
        let Some(a) = self.allocator(device) else {
            return Ok((free, total));
        };
        let s = a.stats();
        let (reserved, allocated) = (s.reserved_bytes.current, s.allocated_bytes.current);
        let can_create = (free as u64).min(a.cap().saturating_sub(reserved));
        let held_unused = reserved.saturating_sub(allocated);
        Ok(((can_create + held_unused).min(total as u64) as usize, total))
    }

    /// Waits for all work on `device`, as the runtime's `cudaFree` does, leaving the thread's
    /// current device as it was.
    fn synchronize(&self, device: i32) -> c_int {
        let current = match self.runtime.get_device() {
            Ok(d) => d,
            Err(e) => return e,
        };
        if current == device {
            return self.runtime.device_synchronize();
        }
        let set = self.runtime.set_device(device);
        if set != code::SUCCESS {
            return set;
        }
        let r = self.runtime.device_synchronize();
        let back = self.runtime.set_device(current);
        if r != code::SUCCESS {
            r
        } else {
            back
        }
    }

    /// The counts and each device's allocator statistics, as JSON.
    pub fn report(&self) -> String {
        let c = &self.counts;
        let devices: Vec<serde_json::Value> = self
            .devices
            .created()
            .map(|(i, a)| {
                let s = a.stats();
                let tags: Vec<serde_json::Value> = a
                    .tags()
                    .into_iter()
                    .map(|t| {
                        serde_json::json!({
                            "name": &*t.name,
                            "allocations": t.allocations,
                            "bytes": t.bytes,
                            "asleep": t.asleep,
                            "backed_up": t.backed_up,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "device": i,
                    "allocated_bytes": s.allocated_bytes.current,
                    "allocated_bytes_peak": s.allocated_bytes.peak,
                    "reserved_bytes": s.reserved_bytes.current,
                    "reserved_bytes_peak": s.reserved_bytes.peak,
                    "allocations": s.allocations.current,
                    "asleep_bytes": s.asleep_bytes.current,
                    "host_memory": a.host_memory(),
                    "tags": tags,
                })
            })
            .collect();
        serde_json::json!({
            "served_allocs": c.served_allocs.load(Ordering::Relaxed),
            "served_frees": c.served_frees.load(Ordering::Relaxed),
            "passed_allocs": c.passed_allocs.load(Ordering::Relaxed),
            "passed_frees": c.passed_frees.load(Ordering::Relaxed),
            "synchronous_frees": c.synchronous_frees.load(Ordering::Relaxed),
            "ipc_handles": c.ipc_handles.load(Ordering::Relaxed),
            "ipc_opens": c.ipc_opens.load(Ordering::Relaxed),
            "ipc_exported": self.ipc.exported(),
            "devices": devices,
        })
        .to_string()
    }
}

// ---------------------------------------------------------------------------------------------
// The exported functions.

static PRELOAD: Interposer<Real> = Interposer::new(Real::new(), env_options);

/// Runs an entry point; a panic becomes `cudaErrorUnknown` with its message kept.
fn guard(f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        let _ = catch_unwind(|| PRELOAD.fail("internal error (panic)".into(), code::UNKNOWN));
        code::UNKNOWN
    })
}

/// Copies `text` into `buf` (at most `len - 1` bytes and a NUL); returns its whole length.
///
/// # Safety
/// `buf` is null or valid for `len` bytes' writes.
unsafe fn copy_out(text: &str, buf: *mut c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: the caller gives `len` writable bytes at `buf`; n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, n);
            *buf.add(n) = 0;
        }
    }
    text.len()
}

/// The CUDA runtime's `cudaMalloc`, served by MoonBright.
///
/// # Safety
/// As the runtime's: `dev_ptr` is null or valid for a pointer's write.
#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    // SAFETY: passed on under the caller's guarantee.
    guard(|| unsafe { PRELOAD.malloc(dev_ptr, size, None) })
}

/// The CUDA runtime's `cudaFree`: waits for the device, then frees.
#[no_mangle]
pub extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    guard(|| PRELOAD.free(ptr, None))
}

/// The CUDA runtime's `cudaMallocAsync`, stream-ordered on `stream`.
///
/// # Safety
/// As the runtime's: `dev_ptr` is null or valid for a pointer's write.
#[no_mangle]
pub unsafe extern "C" fn cudaMallocAsync(
    dev_ptr: *mut *mut c_void,
    size: usize,
    stream: *mut c_void,
) -> c_int {
    // SAFETY: passed on under the caller's guarantee.
    guard(|| unsafe { PRELOAD.malloc(dev_ptr, size, Some(stream as u64)) })
}

/// The CUDA runtime's `cudaFreeAsync`, stream-ordered on `stream`.
#[no_mangle]
pub extern "C" fn cudaFreeAsync(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    guard(|| PRELOAD.free(ptr, Some(stream as u64)))
}

/// The CUDA runtime's `cudaMemGetInfo`, counting memory MoonBright holds unused as free.
///
/// # Safety
/// As the runtime's: `free` and `total` are valid for writes (a null one is refused).
#[no_mangle]
pub unsafe extern "C" fn cudaMemGetInfo(free: *mut usize, total: *mut usize) -> c_int {
    if free.is_null() || total.is_null() {
        return code::INVALID_VALUE;
    }
    guard(|| match PRELOAD.mem_get_info() {
        Ok((f, t)) => {
            // SAFETY: both are valid, as the caller guarantees and checked non-null above.
            unsafe { (*free, *total) = (f, t) };
            code::SUCCESS
        }
        Err(e) => e,
    })
}

/// The CUDA runtime's `cudaIpcGetMemHandle`; MoonBright's memory gets a handle of its own.
///
/// # Safety
/// As the runtime's: `handle` is null or valid for a handle's write.
#[no_mangle]
pub unsafe extern "C" fn cudaIpcGetMemHandle(handle: *mut IpcMemHandle, ptr: *mut c_void) -> c_int {
    // SAFETY: passed on under the caller's guarantee.
    guard(|| unsafe { PRELOAD.ipc_get_mem_handle(handle, ptr) })
}

/// The CUDA runtime's `cudaIpcOpenMemHandle`; a MoonBright handle is opened by MoonBright.
///
/// # Safety
/// As the runtime's: `dev_ptr` is null or valid for a pointer's write.
#[no_mangle]
pub unsafe extern "C" fn cudaIpcOpenMemHandle(
    dev_ptr: *mut *mut c_void,
    handle: IpcMemHandle,
    flags: c_uint,
) -> c_int {
    // SAFETY: passed on under the caller's guarantee.
    guard(|| unsafe { PRELOAD.ipc_open_mem_handle(dev_ptr, handle, flags) })
}

/// The CUDA runtime's `cudaIpcCloseMemHandle`; MoonBright's imports are unmapped by MoonBright.
#[no_mangle]
pub extern "C" fn cudaIpcCloseMemHandle(ptr: *mut c_void) -> c_int {
    guard(|| PRELOAD.ipc_close_mem_handle(ptr))
}

/// The stream a `_ptsz` call means: the null stream is the thread's own.
fn per_thread(stream: *mut c_void) -> u64 {
    if stream.is_null() {
        PER_THREAD_STREAM
    } else {
        stream as u64
    }
}

/// `cudaMallocAsync` in a program built with `--default-stream per-thread`.
///
/// # Safety
/// As `cudaMallocAsync`.
#[no_mangle]
pub unsafe extern "C" fn cudaMallocAsync_ptsz(
    dev_ptr: *mut *mut c_void,
    size: usize,
    stream: *mut c_void,
) -> c_int {
    // SAFETY: passed on under the caller's guarantee.
    guard(|| unsafe { PRELOAD.malloc(dev_ptr, size, Some(per_thread(stream))) })
}

/// `cudaFreeAsync` in a program built with `--default-stream per-thread`.
#[no_mangle]
pub extern "C" fn cudaFreeAsync_ptsz(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    guard(|| PRELOAD.free(ptr, Some(per_thread(stream))))
}

/// Makes `tag` the calling thread's tag: the memory its `cudaMalloc`s and `cudaMallocAsync`s
/// get carries it until `moonbright_tag_end`. Returns the tag in effect before (0: none), to
/// give to `moonbright_tag_end`, or -1 for a null, empty, overlong (over 256 bytes) or
/// non-UTF-8 name, the thread's tag unchanged.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn moonbright_tag_begin(tag: *const c_char) -> c_int {
    // SAFETY: passed on under the caller's guarantee.
    catch_unwind(|| unsafe { PRELOAD.tag_begin(tag) }).unwrap_or(-1)
}

/// Ends the tag that the `moonbright_tag_begin` which returned `previous` began, making
/// `previous` the thread's tag again. Returns 0, or `cudaErrorInvalidValue` for a negative
/// `previous` (a failed begin's), changing nothing.
#[no_mangle]
pub extern "C" fn moonbright_tag_end(previous: c_int) -> c_int {
    guard(|| PRELOAD.tag_end(previous))
}

/// Puts the memory tagged `tag` on the current device to sleep: once the device's work is done
/// (a `cudaDeviceSynchronize`, as `cudaFree` waits: a `cudaMalloc`'s memory names no stream to
/// wait for), its bytes are copied to pinned host memory (`backup` 1) or dropped (0), and its
/// memory is given back to the driver, its addresses kept. Returns 0;
/// `cudaErrorInvalidValue` for a bad name or `backup`; `cudaErrorIllegalState` for a tag not
/// awake (or whose memory was shared by `cudaIpcGetMemHandle`); `cudaErrorNotSupported` on a
/// device whose memory is the runtime's. After a failure the tag is as it was.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn moonbright_sleep(tag: *const c_char, backup: c_int) -> c_int {
    // SAFETY: passed on under the caller's guarantee.
    guard(|| unsafe { PRELOAD.sleep(tag, backup) })
}

/// Wakes `tag` on the current device: its memory mapped again at the same addresses, its bytes
/// back if its sleep kept them. Returns 0; `cudaErrorMemoryAllocation` when the memory cannot
/// be had (the tag stays asleep, its bytes kept: free memory and call again);
/// `cudaErrorIllegalState` for a tag that is not asleep; `cudaErrorInvalidValue` for a bad name.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn moonbright_wake(tag: *const c_char) -> c_int {
    // SAFETY: passed on under the caller's guarantee.
    guard(|| unsafe { PRELOAD.wake(tag) })
}

/// Gives the current device's spare pinned host memory, kept from earlier sleeps for the next,
/// back to the system (what sleeping tags hold stays). Returns 0 or the error.
#[no_mangle]
pub extern "C" fn moonbright_release_host_memory() -> c_int {
    guard(|| PRELOAD.release_host_memory())
}

/// The last error's message (`buf`, `len` as for `moonbright_preload_report`); its length, 0
/// if none.
///
/// # Safety
/// `buf` is null or valid for `len` bytes' writes.
#[no_mangle]
pub unsafe extern "C" fn moonbright_preload_last_error(buf: *mut c_char, len: usize) -> usize {
    catch_unwind(|| {
        let text = PRELOAD.last_error().unwrap_or_default();
        // SAFETY: the caller's guarantee, passed on.
        unsafe { copy_out(&text, buf, len) }
    })
    .unwrap_or(0)
}

/// The calls served and passed on, and each device's allocator statistics, as JSON written to
/// `buf` (at most `len - 1` bytes and a NUL). Returns the report's whole length: call with a
/// null `buf` first for it.
///
/// # Safety
/// `buf` is null or valid for `len` bytes' writes.
#[no_mangle]
pub unsafe extern "C" fn moonbright_preload_report(buf: *mut c_char, len: usize) -> usize {
    catch_unwind(|| {
        let text = PRELOAD.report();
        // SAFETY: the caller's guarantee, passed on.
        unsafe { copy_out(&text, buf, len) }
    })
    .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The entry points' own checks, before any runtime call (a test binary has no libcudart).
    #[test]
    fn entry_points_refuse_null_outputs_and_report_without_a_runtime() {
        let mut total = 0usize;
        // SAFETY: null pointers, which the entry points must refuse before any use.
        unsafe {
            assert_eq!(cudaMalloc(std::ptr::null_mut(), 64), code::INVALID_VALUE);
            assert_eq!(cudaMallocAsync(std::ptr::null_mut(), 64, 1 as _), code::INVALID_VALUE);
            assert_eq!(cudaMemGetInfo(std::ptr::null_mut(), &mut total), code::INVALID_VALUE);
            assert_eq!(cudaMemGetInfo(&mut total, std::ptr::null_mut()), code::INVALID_VALUE);
        }
        let mut last = [0 as c_char; 64];
        // SAFETY: `last` has 64 writable bytes.
        let n = unsafe { moonbright_preload_last_error(last.as_mut_ptr(), last.len()) };
        assert!(n > 0, "the refusal left its message");
        // The report: its whole length with a null buffer, then cut to the buffer with a NUL.
        // SAFETY: a null buffer is allowed.
        let whole = unsafe { moonbright_preload_report(std::ptr::null_mut(), 0) };
        let mut small = [1 as c_char; 8];
        // SAFETY: `small` has 8 writable bytes.
        let n = unsafe { moonbright_preload_report(small.as_mut_ptr(), 8) };
        assert_eq!(n, whole);
        assert_eq!(small[7], 0);
        let text: Vec<u8> = small[..7].iter().map(|&c| c as u8).collect();
        assert_eq!(text, b"{\"devic".to_vec());
    }

    /// The tag exports: the thread's tag needs no runtime; sleep and wake check their
    /// arguments first, then need the current device.
    #[test]
    fn tag_exports_check_their_arguments_before_the_runtime() {
        // SAFETY: NUL-terminated names, or null where the test means it.
        unsafe {
            let previous = moonbright_tag_begin(c"preload-unit".as_ptr());
            assert_eq!(previous, 0);
            assert_eq!(moonbright::tags::current_name().as_deref(), Some("preload-unit"));
            assert_eq!(moonbright_tag_end(previous), code::SUCCESS);
            assert_eq!(moonbright::tags::current_name(), None);
            assert_eq!(moonbright_tag_begin(std::ptr::null()), -1);
            assert_eq!(moonbright_tag_end(-1), code::INVALID_VALUE);
            assert_eq!(moonbright_sleep(std::ptr::null(), BACKUP_HOST), code::INVALID_VALUE);
            assert_eq!(moonbright_sleep(c"preload-unit".as_ptr(), 7), code::INVALID_VALUE);
            assert_eq!(moonbright_wake(c"".as_ptr()), code::INVALID_VALUE);
            if runtime::loaded_cudarts().is_empty() {
                let tag = c"preload-unit".as_ptr();
                assert_eq!(moonbright_sleep(tag, BACKUP_HOST), code::INITIALIZATION_ERROR);
                assert_eq!(moonbright_wake(tag), code::INITIALIZATION_ERROR);
                assert_eq!(moonbright_release_host_memory(), code::INITIALIZATION_ERROR);
            }
        }
    }

    #[test]
    fn a_ptsz_call_on_the_null_stream_means_the_threads_stream() {
        assert_eq!(per_thread(std::ptr::null_mut()), PER_THREAD_STREAM);
        assert_eq!(per_thread(0x1234 as *mut c_void), 0x1234);
    }
}
