//! Shared pieces of the MoonBright benchmarks: a checked layer over the CUDA driver,
//! NVRTC compilation, the kernels, percentiles, the stress workload, and the front end's options.
//!
//! Every binary runs on a real GPU only; on a machine without one it exits with status 2 and a
//! message saying so.

pub mod cu;
pub mod kernels;
pub mod nvrtc;
pub mod paths;
/// Sample summaries and the one percentile (`moonbright-testkit`).
pub use moonbright_testkit::stats;
pub mod workload;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::ExitCode;

use moonbright::{BackendKind, Options};

/// Errors are messages naming the call that failed.
pub type Res<T> = Result<T, String>;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Sets the background mapper's window (bytes kept mapped ahead of the frontier); `max == 0`
/// disables it, so that every new mapping is a cold map.
pub fn window_options(opts: &mut Options, min: u64, max: u64) {
    opts.prefetch_window_min = min;
    opts.prefetch_window_max = max;
}

/// Turns the background worker (events, mapper, deferred unmapper) on or off.
pub fn background_option(opts: &mut Options, on: bool) {
    opts.background = on;
}

/// The default window, or the one `MOONBRIGHT_ALLOC_CONF` sets: (min, max) bytes. (It read
/// `Options::default()` alone before, so the stress's and latency's MoonBright runs ignored a
/// window set there.)
pub fn default_window() -> (u64, u64) {
    let d = env_options();
    (d.prefetch_window_min, d.prefetch_window_max)
}

/// MoonBright options on the CUDA backend: `cap` bytes, chunks up to `max_chunk`, a window of
/// `window` bytes (0: none) and background workers on or off.
pub fn mb_options(cap: Option<u64>, max_chunk: u64, window: (u64, u64), bg: bool) -> Options {
    mb_options_from(env_options(), cap, max_chunk, window, bg)
}

/// `mb_options` over `base` (`profile_options`, say) instead of `env_options()`.
pub fn mb_options_from(
    base: Options,
    cap: Option<u64>,
    max_chunk: u64,
    window: (u64, u64),
    bg: bool,
) -> Options {
    let mut o =
        Options { backend: BackendKind::Cuda, cap_bytes: cap, max_chunk_bytes: max_chunk, ..base };
    window_options(&mut o, window.0, window.1);
    background_option(&mut o, bg);
    o
}

/// `Options::default()` with `MOONBRIGHT_ALLOC_CONF` applied, so one binary can be measured
/// with other settings. A bad value ends the program with the option's error.
pub fn env_options() -> Options {
    let conf = std::env::var(moonbright::conf::ENV_VAR).unwrap_or_default();
    moonbright::conf::parse_conf_over(Options::default(), &conf).unwrap_or_else(|e| {
        eprintln!("{}: {e}", moonbright::conf::ENV_VAR);
        std::process::exit(2)
    })
}

/// `profile`'s options with `MOONBRIGHT_ALLOC_CONF` applied over them (its tuning options win,
/// as beside a profile in the string).
pub fn profile_options(profile: moonbright::Profile) -> Options {
    let conf = std::env::var(moonbright::conf::ENV_VAR).unwrap_or_default();
    let base = Options::default().with_profile(profile);
    moonbright::conf::parse_conf_over(base, &conf).unwrap_or_else(|e| {
        eprintln!("{}: {e}", moonbright::conf::ENV_VAR);
        std::process::exit(2)
    })
}

/// The largest chunk MoonBright uses in these benchmarks: the default, or `max_chunk` from
/// `MOONBRIGHT_ALLOC_CONF`.
pub fn max_chunk() -> u64 {
    env_options().max_chunk_bytes
}

/// Runs a benchmark's body: an error (or a panic) is printed with the program's name and gives
/// exit status 1; "no GPU" gives status 2.
pub fn main_wrapper(name: &str, body: impl FnOnce() -> Res<()>) -> ExitCode {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("{name}: error: {e}");
            if e.starts_with("no GPU") || e.starts_with("no usable GPU") {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic".into());
            eprintln!("{name}: internal error (panic): {msg}");
            ExitCode::from(1)
        }
    }
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json(path: &std::path::Path, value: &impl serde::Serialize) -> Res<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| format!("JSON: {e}"))?;
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// A human size: "256 B", "64 KiB", "2 MiB", "1 GiB".
pub fn human(bytes: u64) -> String {
    for (unit, name) in [(GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")] {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{} {name}", bytes / unit);
        }
    }
    if bytes >= MIB {
        return format!("{:.1} MiB", bytes as f64 / MIB as f64);
    }
    format!("{bytes} B")
}

/// Driver-call deltas of a MoonBright allocator, as (key, count) for the nonzero kinds.
pub fn call_delta(
    after: &moonbright::driver::CallCounts,
    before: &moonbright::driver::CallCounts,
) -> std::collections::BTreeMap<String, u64> {
    after
        .since(before)
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| (k.key().to_string(), n))
        .collect()
}
