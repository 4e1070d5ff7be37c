//! The CUDA runtime's own functions, which the interposer calls for what it does not serve
//! (`Runtime`), and where it finds them in the process (`Real`): the definitions that the
//! interposer's own `cudaMalloc` and the rest hide.

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use crate::ipc::IpcMemHandle;

/// `cudaError_t` values the interposer returns itself.
pub mod code {
    use std::ffi::c_int;
    pub const SUCCESS: c_int = 0;
    pub const INVALID_VALUE: c_int = 1;
    pub const MEMORY_ALLOCATION: c_int = 2;
    pub const INITIALIZATION_ERROR: c_int = 3;
    pub const MAP_BUFFER_OBJECT_FAILED: c_int = 205;
    pub const INVALID_RESOURCE_HANDLE: c_int = 400;
    pub const ILLEGAL_STATE: c_int = 401;
    pub const NOT_SUPPORTED: c_int = 801;
    pub const STREAM_CAPTURE_UNSUPPORTED: c_int = 900;
    pub const UNKNOWN: c_int = 999;
}

/// What the interposer needs of the CUDA runtime. `stream: None` is the synchronous call
/// (`cudaMalloc`, `cudaFree`), `Some` the stream-ordered one on that `cudaStream_t`.
pub trait Runtime: Sync {
    fn get_device(&self) -> Result<i32, c_int>;
    fn set_device(&self, device: i32) -> c_int;
    fn device_synchronize(&self) -> c_int;
    /// # Safety
    /// `out` is valid for a pointer's write.
    unsafe fn malloc(&self, out: *mut *mut c_void, size: usize, stream: Option<u64>) -> c_int;
    /// `ptr` is a device address, never dereferenced here.
    fn free(&self, ptr: u64, stream: Option<u64>) -> c_int;
    /// `cudaMemGetInfo`: the driver's free and total bytes of the current device.
    fn mem_get_info(&self) -> Result<(usize, usize), c_int>;
    /// `cudaIpcGetMemHandle` of memory MoonBright does not own.
    ///
    /// # Safety
    /// `out` is valid for a handle's write.
    unsafe fn ipc_get_mem_handle(&self, out: *mut IpcMemHandle, ptr: u64) -> c_int;
    /// `cudaIpcOpenMemHandle` of a handle MoonBright did not write.
    ///
    /// # Safety
    /// `out` is valid for a pointer's write.
    unsafe fn ipc_open_mem_handle(
        &self,
        out: *mut *mut c_void,
        handle: IpcMemHandle,
        flags: c_uint,
    ) -> c_int;
    /// `cudaIpcCloseMemHandle` of memory MoonBright did not import.
    fn ipc_close_mem_handle(&self, ptr: u64) -> c_int;
}

type GetDevice = unsafe extern "C" fn(*mut c_int) -> c_int;
type SetDevice = unsafe extern "C" fn(c_int) -> c_int;
type Synchronize = unsafe extern "C" fn() -> c_int;
type Malloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type Free = unsafe extern "C" fn(*mut c_void) -> c_int;
type MallocAsync = unsafe extern "C" fn(*mut *mut c_void, usize, *mut c_void) -> c_int;
type FreeAsync = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
type IpcGet = unsafe extern "C" fn(*mut IpcMemHandle, *mut c_void) -> c_int;
type IpcOpen = unsafe extern "C" fn(*mut *mut c_void, IpcMemHandle, c_uint) -> c_int;
type IpcClose = unsafe extern "C" fn(*mut c_void) -> c_int;

/// The runtime's functions, found together.
struct Fns {
    get_device: GetDevice,
    set_device: SetDevice,
    synchronize: Synchronize,
    malloc: Malloc,
    free: Free,
    mem_get_info: MemGetInfo,
    /// Absent before CUDA 11.2.
    malloc_async: Option<MallocAsync>,
    free_async: Option<FreeAsync>,
    /// Absent where the runtime has no IPC (not on Linux builds).
    ipc_get: Option<IpcGet>,
    ipc_open: Option<IpcOpen>,
    ipc_close: Option<IpcClose>,
}

/// The CUDA runtime loaded in this process (libcudart), found at the first call that needs it.
pub struct Real {
    fns: OnceLock<Fns>,
}

impl Default for Real {
    fn default() -> Self {
        Self::new()
    }
}

impl Real {
    pub const fn new() -> Self {
        Real { fns: OnceLock::new() }
    }

    /// The runtime's functions, or `INITIALIZATION_ERROR` if no libcudart is loaded yet (a
    /// later call looks again).
    fn fns(&self) -> Result<&Fns, c_int> {
        if let Some(f) = self.fns.get() {
            return Ok(f);
        }
        let f = find().ok_or(code::INITIALIZATION_ERROR)?;
        Ok(self.fns.get_or_init(|| f))
    }
}

/// Finds the runtime's functions: in the objects after this library in the global scope (a
/// program linked with libcudart), else in a libcudart loaded privately (a library opened with
/// `RTLD_LOCAL`, as Python opens PyTorch's, brings its libcudart outside the global scope,
/// where `RTLD_NEXT` does not look; its calls still reach this library's definitions first).
fn find() -> Option<Fns> {
    // SAFETY: RTLD_NEXT is a valid pseudo-handle for dlsym from a shared object.
    if let Some(f) = resolve(|name| unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) }) {
        return Some(f);
    }
    loaded_cudarts().into_iter().find_map(|path| {
        // SAFETY: RTLD_NOLOAD opens only a library already loaded (no initialiser runs); the
        // handle is kept (a reference count), so the functions found stay valid.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            return None;
        }
        // SAFETY: `handle` is a live handle from dlopen.
        resolve(|name| unsafe { libc::dlsym(handle, name.as_ptr()) })
    })
}

/// Looks up every function with `sym`; `None` unless all the required ones are there.
fn resolve(sym: impl Fn(&CStr) -> *mut c_void) -> Option<Fns> {
    let get = |name: &CStr| {
        let p = sym(name);
        (!p.is_null()).then_some(p)
    };
    // SAFETY: each symbol transmuted is the CUDA runtime's function of that name, whose C
    // signature its type spells (cuda_runtime_api.h); a function pointer and a data pointer
    // have the same size on the platforms CUDA supports.
    unsafe {
        Some(Fns {
            get_device: std::mem::transmute::<*mut c_void, GetDevice>(get(c"cudaGetDevice")?),
            set_device: std::mem::transmute::<*mut c_void, SetDevice>(get(c"cudaSetDevice")?),
            synchronize: std::mem::transmute::<*mut c_void, Synchronize>(get(
                c"cudaDeviceSynchronize",
            )?),
            malloc: std::mem::transmute::<*mut c_void, Malloc>(get(c"cudaMalloc")?),
            free: std::mem::transmute::<*mut c_void, Free>(get(c"cudaFree")?),
            mem_get_info: std::mem::transmute::<*mut c_void, MemGetInfo>(get(c"cudaMemGetInfo")?),
            malloc_async: get(c"cudaMallocAsync")
                .map(|p| std::mem::transmute::<*mut c_void, MallocAsync>(p)),
            free_async: get(c"cudaFreeAsync")
                .map(|p| std::mem::transmute::<*mut c_void, FreeAsync>(p)),
            ipc_get: get(c"cudaIpcGetMemHandle")
                .map(|p| std::mem::transmute::<*mut c_void, IpcGet>(p)),
            ipc_open: get(c"cudaIpcOpenMemHandle")
                .map(|p| std::mem::transmute::<*mut c_void, IpcOpen>(p)),
            ipc_close: get(c"cudaIpcCloseMemHandle")
                .map(|p| std::mem::transmute::<*mut c_void, IpcClose>(p)),
        })
    }
}

/// The paths of the loaded objects whose file name starts with `libcudart.so`.
pub(crate) fn loaded_cudarts() -> Vec<std::ffi::CString> {
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _: usize, data: *mut c_void) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid `info` for the call, and `data` is the
        // `Vec` that `loaded_cudarts` passed in, alive and not otherwise borrowed meanwhile.
        let (info, found) = unsafe { (&*info, &mut *(data as *mut Vec<std::ffi::CString>)) };
        if !info.dlpi_name.is_null() {
            // SAFETY: a non-null `dlpi_name` is a NUL-terminated string owned by the loader.
            let path = unsafe { CStr::from_ptr(info.dlpi_name) };
            let file = path.to_bytes().rsplit(|&b| b == b'/').next().unwrap_or_default();
            if file.starts_with(b"libcudart.so") {
                found.push(path.to_owned());
            }
        }
        0
    }
    let mut found: Vec<std::ffi::CString> = Vec::new();
    // SAFETY: `each` matches the callback type and only reads `info` during the call; `found`
    // outlives the iteration.
    unsafe { libc::dl_iterate_phdr(Some(each), &mut found as *mut _ as *mut c_void) };
    found
}

impl Runtime for Real {
    fn get_device(&self) -> Result<i32, c_int> {
        let f = self.fns()?;
        let mut d: c_int = 0;
        // SAFETY: the runtime's cudaGetDevice with a valid out-pointer.
        match unsafe { (f.get_device)(&mut d) } {
            code::SUCCESS => Ok(d),
            e => Err(e),
        }
    }

    fn set_device(&self, device: i32) -> c_int {
        // SAFETY: the runtime's cudaSetDevice; it validates the ordinal.
        self.fns().map_or_else(|e| e, |f| unsafe { (f.set_device)(device) })
    }

    fn device_synchronize(&self) -> c_int {
        // SAFETY: the runtime's cudaDeviceSynchronize takes no argument.
        self.fns().map_or_else(|e| e, |f| unsafe { (f.synchronize)() })
    }

    unsafe fn malloc(&self, out: *mut *mut c_void, size: usize, stream: Option<u64>) -> c_int {
        let f = match self.fns() {
            Ok(f) => f,
            Err(e) => return e,
        };
        // SAFETY: the caller gives a valid `out`; the stream is the caller's handle, passed on.
        unsafe {
            match (stream, f.malloc_async) {
                (None, _) => (f.malloc)(out, size),
                (Some(s), Some(m)) => m(out, size, s as *mut c_void),
                (Some(_), None) => code::INITIALIZATION_ERROR,
            }
        }
    }

    fn mem_get_info(&self) -> Result<(usize, usize), c_int> {
        let f = self.fns()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: the runtime's cudaMemGetInfo with two valid out-pointers.
        match unsafe { (f.mem_get_info)(&mut free, &mut total) } {
            code::SUCCESS => Ok((free, total)),
            e => Err(e),
        }
    }

    unsafe fn ipc_get_mem_handle(&self, out: *mut IpcMemHandle, ptr: u64) -> c_int {
        match self.fns().map(|f| f.ipc_get) {
            Err(e) => e,
            Ok(None) => code::NOT_SUPPORTED,
            // SAFETY: the caller gives a valid `out`; the runtime checks the pointer.
            Ok(Some(get)) => unsafe { get(out, ptr as *mut c_void) },
        }
    }

    unsafe fn ipc_open_mem_handle(
        &self,
        out: *mut *mut c_void,
        handle: IpcMemHandle,
        flags: c_uint,
    ) -> c_int {
        match self.fns().map(|f| f.ipc_open) {
            Err(e) => e,
            Ok(None) => code::NOT_SUPPORTED,
            // SAFETY: the caller gives a valid `out`; the runtime checks the handle and flags.
            Ok(Some(open)) => unsafe { open(out, handle, flags) },
        }
    }

    fn ipc_close_mem_handle(&self, ptr: u64) -> c_int {
        match self.fns().map(|f| f.ipc_close) {
            Err(e) => e,
            Ok(None) => code::NOT_SUPPORTED,
            // SAFETY: the runtime checks the pointer, which is never dereferenced here.
            Ok(Some(close)) => unsafe { close(ptr as *mut c_void) },
        }
    }

    fn free(&self, ptr: u64, stream: Option<u64>) -> c_int {
        let ptr = ptr as *mut c_void;
        let f = match self.fns() {
            Ok(f) => f,
            Err(e) => return e,
        };
        // SAFETY: the pointer and stream are the caller's, passed on for the runtime to check.
        unsafe {
            match (stream, f.free_async) {
                (None, _) => (f.free)(ptr),
                (Some(s), Some(fa)) => fa(ptr, s as *mut c_void),
                (Some(_), None) => code::INITIALIZATION_ERROR,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test binary links no CUDA runtime: every call reports it, and a later one looks again.
    #[test]
    fn without_a_runtime_every_call_says_so() {
        if !loaded_cudarts().is_empty() {
            eprintln!("skipping: a libcudart is loaded in this process");
            return;
        }
        let r = Real::new();
        assert_eq!(r.get_device(), Err(code::INITIALIZATION_ERROR));
        assert_eq!(r.set_device(0), code::INITIALIZATION_ERROR);
        assert_eq!(r.device_synchronize(), code::INITIALIZATION_ERROR);
        assert_eq!(r.free(0x1000, None), code::INITIALIZATION_ERROR);
        assert_eq!(r.mem_get_info(), Err(code::INITIALIZATION_ERROR));
        assert_eq!(r.ipc_close_mem_handle(0x1000), code::INITIALIZATION_ERROR);
        let mut h = IpcMemHandle { reserved: [0; 64] };
        // SAFETY: `h` is valid for a handle's write.
        assert_eq!(unsafe { r.ipc_get_mem_handle(&mut h, 0x1000) }, code::INITIALIZATION_ERROR);
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer.
        assert_eq!(unsafe { r.malloc(&mut p, 64, Some(0)) }, code::INITIALIZATION_ERROR);
        assert!(p.is_null());
        assert!(r.fns.get().is_none(), "nothing found is remembered");
    }
}
