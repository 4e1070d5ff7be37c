//! Tags, sleep and wake under the interposer: the calling thread's tag, which the `cudaMalloc`s
//! it makes carry, and the current device's tagged memory put to sleep and woken
//! (`moonbright_tag_begin`, `moonbright_sleep` and the rest in `lib.rs`).

use std::ffi::{c_char, c_int, CStr};

use moonbright::tags::{self, Backup};
use moonbright::Allocator;

use crate::{code, code_of, Interposer, Runtime};

/// `moonbright_sleep`'s `backup`: the bytes are dropped.
pub const BACKUP_DISCARD: c_int = 0;
/// `moonbright_sleep`'s `backup`: the bytes are copied to pinned host memory, and back at wake.
pub const BACKUP_HOST: c_int = 1;

/// A tag name from C: non-null, UTF-8, and of a length the core takes, checked here so that a
/// bad name is refused before the current device is asked for.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
unsafe fn tag_name<'a>(tag: *const c_char) -> Result<&'a str, String> {
    if tag.is_null() {
        return Err("a null pointer for the tag".into());
    }
    // SAFETY: a non-null `tag` is, by the caller's contract, a NUL-terminated string, read here
    // only.
    let name = unsafe { CStr::from_ptr(tag) }
        .to_str()
        .map_err(|e| format!("the tag is not UTF-8 ({e})"))?;
    if name.is_empty() || name.len() > tags::MAX_TAG_LEN {
        return Err(format!("a tag is a name of 1 to {} bytes, not {name:?}", tags::MAX_TAG_LEN));
    }
    Ok(name)
}

impl<R: Runtime> Interposer<R> {
    /// `moonbright_tag_begin`: makes `tag` the calling thread's tag; returns the tag before
    /// (0: none), for `tag_end`, or -1 (with the message kept) for a null, empty, overlong or
    /// non-UTF-8 name, the thread's tag unchanged.
    ///
    /// # Safety
    /// `tag` is null or a NUL-terminated string.
    pub unsafe fn tag_begin(&self, tag: *const c_char) -> c_int {
        // SAFETY: the caller's guarantee, passed on.
        let entered = unsafe { tag_name(tag) }.and_then(|name| {
            let previous = tags::enter(name).map_err(|e| e.to_string())?;
            // A C `int` holds the id: ids count the names interned, far below 2^31.
            c_int::try_from(previous).map_err(|_| {
                // `previous` came from `enter`, so `restore` takes it.
                let _ = tags::restore(previous);
                format!("tag id {previous} does not fit a C int")
            })
        });
        entered.unwrap_or_else(|m| {
            self.note(format!("moonbright_tag_begin: {m}"));
            -1
        })
    }

    /// `moonbright_tag_end`: makes `previous`, what `tag_begin` returned, the thread's tag
    /// again. A negative `previous` (a failed begin's -1) changes nothing and is an error.
    pub fn tag_end(&self, previous: c_int) -> c_int {
        match u32::try_from(previous).map_err(|_| ()).and_then(|p| tags::restore(p).map_err(|_| ()))
        {
            Ok(()) => code::SUCCESS,
            Err(()) => self.fail(
                format!(
                    "moonbright_tag_end({previous}): not a tag that moonbright_tag_begin returned"
                ),
                code::INVALID_VALUE,
            ),
        }
    }

    /// `moonbright_sleep`: puts the memory tagged `tag` on the current device to sleep
    /// (`Allocator::sleep`), its bytes backed up to host memory (`BACKUP_HOST`) or dropped
    /// (`BACKUP_DISCARD`), after waiting for the device as `cudaFree` does: a sleep waits for
    /// the streams its allocations were made on, and a `cudaMalloc`'s has none (PyTorch's
    /// cache carves every tensor out of such memory), so work still running on it would read
    /// or write memory being copied out and unmapped.
    ///
    /// # Safety
    /// `tag` is null or a NUL-terminated string.
    pub unsafe fn sleep(&self, tag: *const c_char, backup: c_int) -> c_int {
        // SAFETY: the caller's guarantee, passed on.
        let name = match unsafe { tag_name(tag) } {
            Ok(n) => n,
            Err(m) => return self.fail(format!("moonbright_sleep: {m}"), code::INVALID_VALUE),
        };
        let backup = match backup {
            BACKUP_HOST => Backup::Host,
            BACKUP_DISCARD => Backup::Discard,
            other => {
                let m =
                    format!("moonbright_sleep: backup {other} is neither 1 (host) nor 0 (discard)");
                return self.fail(m, code::INVALID_VALUE);
            }
        };
        self.on_current_device("put a tag to sleep", true, |a| a.sleep(name, backup).map(drop))
    }

    /// `moonbright_wake`: wakes `tag` on the current device (`Allocator::wake`): its memory
    /// mapped again at the same addresses, with its bytes if its sleep kept them.
    ///
    /// # Safety
    /// `tag` is null or a NUL-terminated string.
    pub unsafe fn wake(&self, tag: *const c_char) -> c_int {
        // SAFETY: the caller's guarantee, passed on.
        let name = match unsafe { tag_name(tag) } {
            Ok(n) => n,
            Err(m) => return self.fail(format!("moonbright_wake: {m}"), code::INVALID_VALUE),
        };
        self.on_current_device("wake a tag", false, |a| a.wake(name).map(drop))
    }

    /// `moonbright_release_host_memory`: gives the current device's spare pinned host memory
    /// back (`Allocator::release_host_memory`).
    pub fn release_host_memory(&self) -> c_int {
        self.on_current_device("release host memory", false, |a| a.release_host_memory().map(drop))
    }

    /// Runs `f` on the current device's allocator (made now if need be, as `cudaMemGetInfo`
    /// does), after a `cudaDeviceSynchronize` if `synchronize`: its error as a `cudaError_t`,
    /// with the message kept. A device whose memory is the runtime's has nothing MoonBright can
    /// do `what` to: `cudaErrorNotSupported`.
    fn on_current_device(
        &self,
        what: &str,
        synchronize: bool,
        f: impl FnOnce(&Allocator) -> moonbright::Result<()>,
    ) -> c_int {
        let device = match self.runtime.get_device() {
            Ok(d) => d,
            Err(e) => return self.fail(format!("cannot {what}: cudaGetDevice failed ({e})"), e),
        };
        let Some(a) = self.allocator(device) else {
            return self.fail(
                format!(
                    "device {device}: cannot {what}: this device's memory comes from the CUDA \
                     runtime, since its MoonBright allocator could not be made"
                ),
                code::NOT_SUPPORTED,
            );
        };
        if synchronize {
            let synced = self.runtime.device_synchronize();
            if synced != code::SUCCESS {
                return self.fail(
                    format!("device {device}: cannot {what}: synchronising failed ({synced})"),
                    synced,
                );
            }
        }
        match f(a) {
            Ok(()) => code::SUCCESS,
            Err(e) => self.fail(format!("device {device}: {e}"), code_of(&e)),
        }
    }
}
