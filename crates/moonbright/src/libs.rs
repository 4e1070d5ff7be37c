//! Whether NVIDIA's libraries that cudarc loads at run time (libcuda, libnvrtc) are on the
//! loader path: the one place that asks. Each is looked for once per process, and a library
//! found stays loaded for the life of the process (`RTLD_NODELETE`), as cudarc's own handle
//! keeps it once a call is made.
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

/// Whether libcuda (the NVIDIA driver's library) can be loaded. Never panics.
pub fn libcuda_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| load_and_keep(&candidates(&["cuda", "nvcuda"])))
}

/// Whether libnvrtc (CUDA's run-time compiler) can be loaded. Never panics.
pub fn libnvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| load_and_keep(&candidates(&["nvrtc"])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use libloading::os::unix::Library;

    /// Whether `name` is loaded in this process now (`RTLD_NOLOAD` loads nothing).
    fn loaded(name: &str) -> bool {
        // SAFETY: with RTLD_NOLOAD nothing is loaded and no initialiser runs.
        unsafe { Library::open(Some(name), libc::RTLD_LAZY | libc::RTLD_NOLOAD) }.is_ok()
    }

    #[test]
    fn a_missing_library_is_absent_and_asking_again_agrees() {
        assert!(!load_and_keep(&candidates(&["moonbright_no_such_library"])));
        assert_eq!(libcuda_present(), libcuda_present());
        assert_eq!(libnvrtc_present(), libnvrtc_present());
    }

    #[test]
    fn a_library_found_stays_loaded_after_the_check() {
        // glibc's libthread_db: on the loader path wherever glibc is, loaded by no test.
        let name = "libthread_db.so.1".to_string();
        if loaded(&name) {
            println!("skipping: {name} is already loaded in this process");
            return;
        }
        assert!(load_and_keep(std::slice::from_ref(&name)), "{name} did not load");
        assert!(loaded(&name), "{name} was unloaded when the check's handle dropped");
    }
}
