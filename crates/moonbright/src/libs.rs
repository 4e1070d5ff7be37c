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
//!
//! libnvrtc is looked for first where `MOONBRIGHT_NVRTC` says ([`NVRTC_ENV_VAR`]; the Python
//! package sets it to pip's `nvidia-cuda-nvrtc` when that is installed and the variable is not
//! set), then under every name a CUDA 11 to 13 install gives it, on the loader path. It is
//! called through its own handle (`crate::nvrtc`), not cudarc's, whose names miss CUDA 13's
//! `libnvrtc.so.13`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::Library;

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

/// The environment variable naming where libnvrtc is: `:`-separated files, or directories
/// whose `libnvrtc.so*` files are tried. Tried before the loader path.
pub const NVRTC_ENV_VAR: &str = "MOONBRIGHT_NVRTC";

/// Whether libnvrtc (CUDA's run-time compiler) can be loaded. Never panics.
pub fn libnvrtc_present() -> bool {
    libnvrtc().is_ok()
}

/// libnvrtc, loaded and kept for the life of the process once found; or what was tried. An
/// absent library is looked for again on the next call.
pub fn libnvrtc() -> Result<&'static Library, String> {
    static FOUND: OnceLock<Library> = OnceLock::new();
    if let Some(lib) = FOUND.get() {
        return Ok(lib);
    }
    let names = nvrtc_candidates(std::env::var_os(NVRTC_ENV_VAR).as_deref());
    let flags = libc::RTLD_LAZY | libc::RTLD_LOCAL | libc::RTLD_NODELETE;
    for name in &names {
        // SAFETY: loading runs libnvrtc's initialisers, which have no preconditions; the
        // handle is kept for the life of the process (in `FOUND`, and RTLD_NODELETE), so no
        // function taken from it can dangle.
        if let Ok(lib) = unsafe { Library::open(Some(name), flags) } {
            if let Some(dir) = name.parent().filter(|d| !d.as_os_str().is_empty()) {
                load_builtins_beside(dir);
            }
            return Ok(FOUND.get_or_init(|| lib));
        }
    }
    let tried: Vec<String> = names.iter().map(|n| n.to_string_lossy().into_owned()).collect();
    Err(format!(
        "libnvrtc not found (tried {}); install it (pip install nvidia-cuda-nvrtc, or a CUDA \
         toolkit), then set {NVRTC_ENV_VAR} to the file or its directory, or put that \
         directory on LD_LIBRARY_PATH",
        tried.join(", ")
    ))
}

/// Loads and keeps the `libnvrtc-builtins.so*` files of `dir`, where a libnvrtc was loaded
/// from by path: libnvrtc opens its builtins by name when it compiles, which finds them only
/// on the loader path, or already loaded (a name matches a loaded library's soname).
fn load_builtins_beside(dir: &Path) {
    let files = std::fs::read_dir(dir).into_iter().flatten().flatten().filter(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name.starts_with("libnvrtc-builtins.so") && !name.contains(".alt.")
    });
    let flags = libc::RTLD_LAZY | libc::RTLD_LOCAL | libc::RTLD_NODELETE;
    for e in files {
        // SAFETY: as for libnvrtc itself: NVIDIA's library, kept loaded (RTLD_NODELETE).
        let _ = unsafe { Library::open(Some(e.path()), flags) };
    }
}

/// The files and names libnvrtc is looked for under, in order: what `env` (the value of
/// `MOONBRIGHT_NVRTC`) names, directories expanded to their `libnvrtc.so*` files, newest
/// version first; then the names of CUDA 13 back to 11 and cudarc's, for the loader path.
fn nvrtc_candidates(env: Option<&OsStr>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in env.map(std::env::split_paths).into_iter().flatten() {
        if entry.as_os_str().is_empty() {
            continue;
        }
        if entry.is_dir() {
            out.extend(nvrtc_files_in(&entry));
        } else {
            out.push(entry);
        }
    }
    for name in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so"] {
        out.push(name.into());
    }
    for name in candidates(&["nvrtc"]) {
        if !out.iter().any(|p| p.as_os_str() == name.as_str()) {
            out.push(name.into());
        }
    }
    out
}

/// The `libnvrtc.so` and `libnvrtc.so.N...` files of `dir` (not the builtins or the `.alt`
/// variant), the highest version first.
fn nvrtc_files_in(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let version = name.to_str()?.strip_prefix("libnvrtc.so")?.to_string();
            let numbers: Option<Vec<u32>> = if version.is_empty() {
                Some(Vec::new())
            } else {
                version.strip_prefix('.')?.split('.').map(|n| n.parse().ok()).collect()
            };
            Some((numbers?, e.path()))
        })
        .collect();
    found.sort_by(|a, b| b.0.cmp(&a.0));
    found.into_iter().map(|(_, p)| p).collect()
}

#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_is_looked_for_where_the_variable_says_first() {
        let dir = std::env::temp_dir().join(format!("moonbright-nvrtc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for name in [
            "libnvrtc.so.12",
            "libnvrtc.so.13",
            "libnvrtc-builtins.so.13.0",
            "libnvrtc.alt.so.13",
            "libnvrtc.so.13.0.88",
            "README",
        ] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let file = Path::new("/opt/x/libnvrtc.so.13");
        let env = std::env::join_paths([file, dir.as_path()]).unwrap();
        let got = nvrtc_candidates(Some(&env));
        let n = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(got[0], file);
        assert_eq!(
            got[1..4].iter().map(|p| n(p)).collect::<Vec<_>>(),
            ["libnvrtc.so.13.0.88", "libnvrtc.so.13", "libnvrtc.so.12"]
        );
        assert!(got[1..4].iter().all(|p| p.starts_with(&dir)));
        assert_eq!(got[4], Path::new("libnvrtc.so.13"), "then the loader path's names");
        assert!(got.contains(&PathBuf::from("libnvrtc.so")));
        assert_eq!(got.iter().filter(|p| p.as_os_str() == "libnvrtc.so").count(), 1);
        // Unset, empty or naming nothing: the loader path's names only.
        let plain = nvrtc_candidates(None);
        assert_eq!(plain[0], Path::new("libnvrtc.so.13"));
        assert_eq!(nvrtc_candidates(Some(OsStr::new(""))), plain);
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
