//! Whether NVIDIA's libraries that cudarc loads at run time (libcuda, libnvrtc) are on the
//! loader path: the one place that asks. A library found stays loaded for the life of the
//! process (`RTLD_NODELETE`), as cudarc's own handle keeps it once a call is made, and is not
//! looked for again. One not found is looked for again on the next check (a check that fails
//! is an error path, and the process may have loaded the library since, by another name).
//!
//! cudarc's `is_culib_present` loads and unloads the library on every call instead. What
//! libnvrtc's initialisers allocate in a copy that is then unloaded is lost, and LeakSanitizer
//! names the module only if a later copy happens to be mapped at the same address: CI failed
//! on it (libnvrtc 13.5 from PyPI, 14 leaks of an unknown module). With the library kept, the
//! address sanitizer run finds no leak at all, and repeated checks are cheap.

use std::sync::OnceLock;

/// The file names cudarc tries for each of `libs`.
fn candidates(libs: &[&str]) -> Vec<String> {
    libs.iter().flat_map(|lib| cudarc::get_lib_name_candidates(lib)).collect()
}

/// Loads the first of `names` that loads and keeps it loaded. Whether one did.
fn load_and_keep(names: &[String]) -> bool {
    let flags = libc::RTLD_LAZY | libc::RTLD_LOCAL | libc::RTLD_NODELETE;
    names.iter().any(|name| {
        // SAFETY: loading runs the library's initialisers (NVIDIA's libcuda or libnvrtc, which
        // have no preconditions); with RTLD_NODELETE it stays mapped when the handle drops, so
        // no symbol resolved from it later can dangle.
        unsafe { libloading::os::unix::Library::open(Some(name), flags) }.is_ok()
    })
}

/// Whether one of the files `names` gives is loaded, or can be and now is; `found` remembers a
/// success, and `names` runs only until one.
fn present(found: &OnceLock<()>, names: impl FnOnce() -> Vec<String>) -> bool {
    if found.get().is_some() {
        return true;
    }
    let loaded = load_and_keep(&names());
    if loaded {
        let _ = found.set(());
    }
    loaded
}

/// Whether libcuda (the NVIDIA driver's library) can be loaded. Never panics.
pub fn libcuda_present() -> bool {
    static FOUND: OnceLock<()> = OnceLock::new();
    present(&FOUND, || candidates(&["cuda", "nvcuda"]))
}

/// Whether libnvrtc (CUDA's run-time compiler) can be loaded. Never panics.
pub fn libnvrtc_present() -> bool {
    static FOUND: OnceLock<()> = OnceLock::new();
    present(&FOUND, || candidates(&["nvrtc"]))
}

#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;
    use libloading::os::unix::Library;

    /// Whether `name` is loaded in this process now (`RTLD_NOLOAD` loads nothing).
    fn loaded(name: &str) -> bool {
        // SAFETY: with RTLD_NOLOAD nothing is loaded and no initialiser runs.
        unsafe { Library::open(Some(name), libc::RTLD_LAZY | libc::RTLD_NOLOAD) }.is_ok()
    }

    #[test]
    fn a_missing_library_is_absent_and_looked_for_again() {
        let found = OnceLock::new();
        let mut looks = 0;
        for _ in 0..2 {
            assert!(!present(&found, || {
                looks += 1;
                candidates(&["moonbright_no_such_library"])
            }));
        }
        assert!(found.get().is_none(), "an absent library must not be remembered as found");
        assert_eq!(looks, 2, "an absent library must be looked for again");
    }

    /// Small libraries of glibc that no test loads; which of them load varies. The test once
    /// relied on `libthread_db.so.1` alone, which does not load on the H200 machine (Ubuntu
    /// 24.04, glibc 2.39) though it is installed: it needs the `ps_*` functions a debugger
    /// provides, and that build seems to bind them at load time.
    const GLIBC_EXTRAS: [&str; 5] = [
        "libthread_db.so.1",
        "libanl.so.1",
        "libBrokenLocale.so.1",
        "libnss_compat.so.2",
        "libnss_hesiod.so.2",
    ];

    #[test]
    fn a_library_found_stays_loaded_and_is_remembered() {
        let mut tried = Vec::new();
        for name in GLIBC_EXTRAS {
            if loaded(name) {
                tried.push(format!("{name} (already loaded)"));
                continue;
            }
            let found = OnceLock::new();
            if !present(&found, || vec![name.to_string()]) {
                tried.push(format!("{name} (did not load)"));
                continue;
            }
            assert!(found.get().is_some(), "a library found must be remembered");
            assert!(loaded(name), "{name} was unloaded when the check's handle dropped");
            let mut calls = 0;
            assert!(present(&found, || {
                calls += 1;
                Vec::new()
            }));
            assert_eq!(calls, 0, "a library found must not be looked for again");
            return;
        }
        println!("skipping: no library to load: {}", tried.join(", "));
    }
}
