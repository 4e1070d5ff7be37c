//! Options: `mb_options` turned into the core's (zero fields take the defaults), and
//! `mb_options_default`.

use moonbright::{BackendKind, Error, Options};

use crate::status::{call, write_out, Failure, MB_BACKEND_AUTO, MB_BACKEND_CUDA, MB_BACKEND_HOST};
use crate::types::mb_options;

fn non_zero_or<T>(value: u64, name: &'static str, default: T) -> Result<T, Failure>
where
    T: TryFrom<u64>,
{
    if value == 0 {
        return Ok(default);
    }
    T::try_from(value).map_err(|_| {
        Error::InvalidOption { name, reason: format!("{value} does not fit this platform") }.into()
    })
}

/// The core options for C options.
pub(crate) fn to_options(o: &mb_options) -> Result<Options, Failure> {
    let d = Options::default();
    let backend = match o.backend {
        MB_BACKEND_AUTO => BackendKind::Auto,
        MB_BACKEND_CUDA => BackendKind::Cuda,
        MB_BACKEND_HOST => BackendKind::Host,
        other => {
            return Err(Error::InvalidOption {
                name: "backend",
                reason: format!(
                    "{other} is not one of MB_BACKEND_AUTO (0), MB_BACKEND_CUDA (1), \
                     MB_BACKEND_HOST (2)"
                ),
            }
            .into())
        }
    };
    let options = Options {
        backend,
        device: o.device,
        cap_bytes: (o.cap_bytes != 0).then_some(o.cap_bytes),
        host_page_size: non_zero_or(o.host_page_size, "host_page_size", d.host_page_size)?,
        host_capacity: non_zero_or(o.host_capacity, "host_capacity", d.host_capacity)?,
        max_chunk_bytes: non_zero_or(o.max_chunk_bytes, "max_chunk_bytes", d.max_chunk_bytes)?,
        unmap_batch_ranges: non_zero_or(
            o.unmap_batch_ranges,
            "unmap_batch_ranges",
            d.unmap_batch_ranges,
        )?,
        ..d
    };
    options.check()?;
    Ok(options)
}

/// Fills `*out` with the default options: the auto backend on device 0, and every other field at
/// its default value (written out, so a caller can read it). Does nothing when `out` is NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of an `mb_options`.
#[no_mangle]
pub unsafe extern "C" fn mb_options_default(out: *mut mb_options) {
    let _ = call(|| {
        let d = Options::default();
        let o = mb_options {
            backend: MB_BACKEND_AUTO,
            device: d.device,
            cap_bytes: d.cap_bytes.unwrap_or(0),
            host_page_size: d.host_page_size as u64,
            host_capacity: d.host_capacity,
            max_chunk_bytes: d.max_chunk_bytes,
            unmap_batch_ranges: d.unmap_batch_ranges as u64,
        };
        // SAFETY: the caller passes NULL or a pointer valid for a write of an `mb_options`.
        unsafe { write_out(out, "out", o) }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_options_are_the_defaults() {
        let o = to_options(&mb_options::default()).unwrap();
        assert_eq!(o, Options::default());
        let mut filled = mb_options::default();
        // SAFETY: `filled` is a live local.
        unsafe { mb_options_default(&mut filled) };
        assert_eq!(to_options(&filled).unwrap(), Options::default());
    }
}
