//! What the interposer's tests share: a fake CUDA runtime of one thread that records what it
//! is asked, and the host backend's options.
#![allow(dead_code)]

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

use moonbright::Options;
use moonbright_preload::{code, Interposer, IpcMemHandle, Runtime};

pub const MIB: usize = 1 << 20;

/// What the fake runtime was asked.
#[derive(Clone, Debug, PartialEq)]
pub enum Call {
    SetDevice(i32),
    Synchronize(i32),
    Malloc(usize, Option<u64>),
    Free(u64, Option<u64>),
    IpcGet(u64),
    IpcOpen(u8, c_uint),
    IpcClose(u64),
}

/// A CUDA runtime of one thread: a current device, pointers of its own from 0x1000 on, and
/// failures on request.
pub struct Fake {
    pub device: AtomicI32,
    pub calls: Mutex<Vec<Call>>,
    /// The runtime's own allocations.
    pub own: Mutex<Vec<u64>>,
    pub fail_get_device: AtomicI32,
    pub fail_sync: AtomicI32,
    /// What `mem_get_info` reports: the driver's free and total bytes.
    pub info: Mutex<(usize, usize)>,
}

impl Fake {
    const fn new() -> Self {
        Fake {
            device: AtomicI32::new(0),
            calls: Mutex::new(Vec::new()),
            own: Mutex::new(Vec::new()),
            fail_get_device: AtomicI32::new(0),
            fail_sync: AtomicI32::new(0),
            info: Mutex::new((0, 0)),
        }
    }
    pub fn take(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
    fn log(&self, c: Call) {
        self.calls.lock().unwrap().push(c);
    }
}

impl Runtime for Fake {
    fn mem_get_info(&self) -> Result<(usize, usize), c_int> {
        Ok(*self.info.lock().unwrap())
    }
    fn get_device(&self) -> Result<i32, c_int> {
        match self.fail_get_device.load(Ordering::SeqCst) {
            0 => Ok(self.device.load(Ordering::SeqCst)),
            e => Err(e),
        }
    }
    fn set_device(&self, device: i32) -> c_int {
        self.log(Call::SetDevice(device));
        self.device.store(device, Ordering::SeqCst);
        code::SUCCESS
    }
    fn device_synchronize(&self) -> c_int {
        self.log(Call::Synchronize(self.device.load(Ordering::SeqCst)));
        self.fail_sync.load(Ordering::SeqCst)
    }
    unsafe fn malloc(&self, out: *mut *mut c_void, size: usize, stream: Option<u64>) -> c_int {
        self.log(Call::Malloc(size, stream));
        let mut own = self.own.lock().unwrap();
        let p = 0x1000 + own.len() as u64 * 0x1000;
        own.push(p);
        // SAFETY: the interposer passes the caller's valid `out`.
        unsafe { *out = p as *mut c_void };
        code::SUCCESS
    }
    fn free(&self, ptr: u64, stream: Option<u64>) -> c_int {
        self.log(Call::Free(ptr, stream));
        if ptr == 0 {
            return code::SUCCESS;
        }
        let mut own = self.own.lock().unwrap();
        match own.iter().position(|&p| p == ptr) {
            Some(i) => {
                own.remove(i);
                code::SUCCESS
            }
            None => code::INVALID_VALUE,
        }
    }
    unsafe fn ipc_get_mem_handle(&self, out: *mut IpcMemHandle, ptr: u64) -> c_int {
        self.log(Call::IpcGet(ptr));
        if !self.own.lock().unwrap().contains(&ptr) {
            return code::INVALID_VALUE;
        }
        // SAFETY: the interposer passes the caller's valid `out`.
        unsafe { *out = IpcMemHandle { reserved: [0xab; 64] } };
        code::SUCCESS
    }
    unsafe fn ipc_open_mem_handle(
        &self,
        out: *mut *mut c_void,
        handle: IpcMemHandle,
        flags: c_uint,
    ) -> c_int {
        self.log(Call::IpcOpen(handle.reserved[0], flags));
        // SAFETY: the interposer passes the caller's valid `out`.
        unsafe { *out = 0xdead_0000 as *mut c_void };
        code::SUCCESS
    }
    fn ipc_close_mem_handle(&self, ptr: u64) -> c_int {
        self.log(Call::IpcClose(ptr));
        code::SUCCESS
    }
}

pub fn host_options() -> Result<Options, String> {
    Ok(Options::host(256 * MIB as u64, 2 * MIB))
}

pub fn bad_options() -> Result<Options, String> {
    Ok(Options::host(256 * MIB as u64, 3))
}

pub fn new(options: fn() -> Result<Options, String>) -> Interposer<Fake> {
    Interposer::new(Fake::new(), options)
}

pub fn malloc(ip: &Interposer<Fake>, size: usize, stream: Option<u64>) -> (c_int, u64) {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer.
    let r = unsafe { ip.malloc(&mut p, size, stream) };
    (r, p as u64)
}

pub fn runtime(ip: &Interposer<Fake>) -> &Fake {
    ip.runtime()
}
