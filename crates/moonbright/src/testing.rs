//! Support for MoonBright's own tests, not part of the API: the one gate every GPU test passes.
//!
//! A GPU test starts with `let Some(_gpu) = moonbright::testing::gpu() else { return };` (once
//! per test, and it keeps `_gpu` alive to its end). Three outcomes:
//!
//! - **A GPU is reachable**: the returned [`Gpu`] holds this process's GPU-test lock until it
//!   drops, so the GPU tests of one test binary run one at a time whatever `--test-threads`
//!   says. A CUDA graph captured in global mode is invalidated by another thread's synchronous
//!   driver call, so a capture test must not share the device with another test of its process.
//! - **No GPU, and `MOONBRIGHT_REQUIRE_GPU=1`** (scripts/gpu-check.sh sets it): the test panics,
//!   so a probe that breaks on the GPU machine reads as a failure, never as a pass.
//! - **No GPU otherwise**: the test is skipped, and counted. The harness captures a passing
//!   test's output, so a "skipping" line printed by the test would never be seen. Instead:
//!   - the test binary says at its exit (from a `libc::atexit` hook, after the harness's own
//!     summary, on stderr, which nothing captures then) how many of its GPU tests skipped:
//!     `conformance: 68 GPU tests skipped, not run (...)`, in any `cargo test` run;
//!   - each skip appends one line `binary<TAB>test<TAB>why` to the file that
//!     `MOONBRIGHT_GPU_SKIP_LOG` names, if set: scripts/test.sh sets it and prints the total at
//!     its end ("N Rust GPU tests skipped ..."). Appends of one short line to a file opened for
//!     appending do not interleave, so parallel tests and test binaries can share the file.
//!
//! [`skip`] is the same decision for a GPU test that lacks something else the GPU machine has
//! (libnvrtc, for the paged kernels).

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

/// Set to `1` (as scripts/gpu-check.sh does), a GPU test that cannot run fails.
pub const REQUIRE_GPU: &str = "MOONBRIGHT_REQUIRE_GPU";
/// The file each skipped GPU test appends a line to (scripts/test.sh sets it).
pub const SKIP_LOG: &str = "MOONBRIGHT_GPU_SKIP_LOG";

/// Held by the running GPU test of this process.
static SERIAL: Mutex<()> = Mutex::new(());
/// The GPU tests this process skipped, and the first of them with its reason.
static SKIPPED: AtomicUsize = AtomicUsize::new(0);
static FIRST_SKIP: OnceLock<String> = OnceLock::new();

/// A reachable GPU, for as long as one GPU test runs: it holds the process's GPU-test lock.
pub struct Gpu {
    /// The number of CUDA devices.
    pub devices: i32,
    _serial: MutexGuard<'static, ()>,
}

/// Whether `MOONBRIGHT_REQUIRE_GPU` asks for GPU tests to fail rather than skip.
pub fn required() -> bool {
    std::env::var_os(REQUIRE_GPU).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The GPU, with this process's GPU-test lock (waits for the GPU test holding it); `None` after
/// recording the skip when there is no GPU. Panics instead under `MOONBRIGHT_REQUIRE_GPU=1`.
pub fn gpu() -> Option<Gpu> {
    match crate::driver::cuda::probe() {
        Ok(devices) => {
            // A GPU test that panicked poisoned the lock; the next one may still run.
            let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
            Some(Gpu { devices, _serial: serial })
        }
        Err(why) => {
            skip(&format!("no GPU: {why}"));
            None
        }
    }
}

/// The calling GPU test cannot run, for `why`: under `MOONBRIGHT_REQUIRE_GPU=1` this panics;
/// otherwise it records the skip (see the module's notes) and returns, and the test returns.
pub fn skip(why: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    if required() {
        panic!("{REQUIRE_GPU} is set, and the GPU test {test} cannot run: {why}");
    }
    eprintln!("skipping {test}: {why}");
    let exe = std::env::current_exe().ok();
    let stem = exe.as_deref().and_then(|p| p.file_stem()).map(|s| s.to_string_lossy());
    let binary = without_hash(stem.as_deref().unwrap_or("?"));
    count(binary, &test, why);
    if let Some(path) = std::env::var_os(SKIP_LOG) {
        // A skip that cannot be counted must not pass unseen either.
        if let Err(e) = append(std::path::Path::new(&path), binary, &test, why) {
            panic!(
                "cannot record a skipped GPU test in {SKIP_LOG}={}: {e}",
                path.to_string_lossy()
            );
        }
    }
}

/// Counts a skip; the first one registers the report printed at exit.
fn count(binary: &str, test: &str, why: &str) {
    // The reason's first clause is enough here (the skip log keeps it whole).
    let clause = why.split("; ").next().unwrap_or(why);
    let mut short: String = clause.chars().take(100).collect();
    if short.len() < why.len() {
        short.push_str(" ...");
    }
    let _ = FIRST_SKIP.set(format!("{binary}\t{test}: {short}"));
    if SKIPPED.fetch_add(1, Ordering::SeqCst) == 0 {
        // SAFETY: `report_skips` is a plain function with the signature `atexit` expects; it
        // reads only statics, which live to the process's end, and cannot unwind.
        unsafe { libc::atexit(report_skips) };
    }
}

/// The line a test binary prints at exit when GPU tests of it skipped.
extern "C" fn report_skips() {
    let n = SKIPPED.load(Ordering::SeqCst);
    let first = FIRST_SKIP.get().map(String::as_str).unwrap_or("?\t?");
    let (binary, first) = first.split_once('\t').unwrap_or(("?", first));
    let tests = if n == 1 { "test" } else { "tests" };
    // Written whole, and never a panic (it would abort at exit).
    let _ = std::io::stderr().write_all(
        format!(
            "{binary}: {n} GPU {tests} skipped, not run (first {first}); \
             {REQUIRE_GPU}=1 makes them fail\n"
        )
        .as_bytes(),
    );
}

/// Appends the line `binary<TAB>test<TAB>why` (with tabs and newlines in `why` made spaces).
fn append(path: &std::path::Path, binary: &str, test: &str, why: &str) -> std::io::Result<()> {
    let line = format!("{binary}\t{test}\t{}\n", why.replace(['\t', '\n'], " "));
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    f.write_all(line.as_bytes())
}

/// A test binary's name without cargo's hash: `conformance-0123456789abcdef` is `conformance`.
fn without_hash(stem: &str) -> &str {
    match stem.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            name
        }
        _ => stem,
    }
}

#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn binary_names_lose_cargos_hash() {
        assert_eq!(without_hash("conformance-0123456789abcdef"), "conformance");
        assert_eq!(without_hash("moonbright-cli-0123456789abcdef"), "moonbright-cli");
        assert_eq!(without_hash("unit"), "unit");
        assert_eq!(without_hash("moonbright-cli"), "moonbright-cli");
    }

    #[test]
    fn skips_from_many_threads_append_whole_lines() {
        let dir = std::env::temp_dir().join(format!("mb-skips-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("skips.log");
        std::thread::scope(|s| {
            for t in 0..8 {
                let path = &path;
                s.spawn(move || {
                    for i in 0..50 {
                        append(path, "bin", &format!("t{t}::{i}"), "no GPU:\tnone\nhere").unwrap();
                    }
                });
            }
        });
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(text.lines().count(), 400);
        for line in text.lines() {
            let fields: Vec<&str> = line.split('\t').collect();
            assert_eq!(fields.len(), 3, "{line:?}");
            assert_eq!((fields[0], fields[2]), ("bin", "no GPU: none here"), "{line:?}");
        }
    }

    /// This binary's GPU test of the driver, run again in a child process: under
    /// `MOONBRIGHT_REQUIRE_GPU=1` it fails here unless it reaches a GPU; without the variable it
    /// passes and, when it had no GPU, left its line in the skip log.
    #[test]
    fn a_gpu_test_without_a_gpu_fails_when_required_and_is_counted_otherwise() {
        const TEST: &str = "driver::cuda::tests::granularity_and_mem_info";
        let dir = std::env::temp_dir().join(format!("mb-require-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("skips.log");
        let child = |require: &str| {
            let out = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", TEST, "--test-threads", "1"])
                .env(REQUIRE_GPU, require)
                .env(SKIP_LOG, &log)
                .output()
                .unwrap();
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            (out.status.success(), text(&out.stdout), text(&out.stderr))
        };
        let (required_ok, required_out, _) = child("1");
        let (skipped_ok, skipped_out, skipped_err) = child("");
        let logged = std::fs::read_to_string(&log).unwrap_or_default();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(skipped_ok && skipped_out.contains("1 passed"), "{skipped_out}");
        match crate::driver::cuda::probe() {
            Ok(_) => {
                assert!(required_ok && required_out.contains("1 passed"), "{required_out}");
                assert_eq!(logged, "");
            }
            Err(_) => {
                assert!(!required_ok && required_out.contains("1 failed"), "{required_out}");
                let why =
                    format!("{REQUIRE_GPU} is set, and the GPU test {TEST} cannot run: no GPU");
                assert!(required_out.contains(&why), "{required_out}");
                let exe = std::env::current_exe().unwrap();
                let binary = without_hash(exe.file_stem().unwrap().to_str().unwrap()).to_string();
                let line = logged.lines().next().unwrap_or_default();
                assert!(line.starts_with(&format!("{binary}\t{TEST}\tno GPU: ")), "{logged:?}");
                assert_eq!(logged.lines().count(), 1, "{logged:?}");
                let report = format!("{binary}: 1 GPU test skipped, not run (first {TEST}: no GPU");
                assert!(skipped_err.contains(&report), "{skipped_err}");
            }
        }
    }
}
