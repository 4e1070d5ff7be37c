//! Compiles `examples/c/basic.c` with the system C compiler against `include/moonbright.h` and the
//! static library cargo built for this test run, runs it, and checks that it succeeds. Skipped,
//! with a message, when there is no `cc`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

/// The newest `libmoonbright_capi.a` in the profile folder this test runs from (`target/<profile>`,
/// or its `deps/`, where cargo leaves the library it built for the tests).
fn static_library() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    let profile = deps.parent()?;
    let mut found: Vec<(SystemTime, PathBuf)> = Vec::new();
    for dir in [profile, deps] {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("libmoonbright_capi") && name.ends_with(".a") {
                let modified = entry.metadata().and_then(|m| m.modified()).ok()?;
                found.push((modified, entry.path()));
            }
        }
    }
    found.into_iter().max_by_key(|(t, _)| *t).map(|(_, p)| p)
}

fn have_cc() -> bool {
    Command::new("cc").arg("--version").output().is_ok_and(|o| o.status.success())
}

#[test]
fn basic_c_example_compiles_and_runs() {
    if !have_cc() {
        eprintln!("skipped: no `cc` on PATH to compile examples/c/basic.c");
        return;
    }
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = static_library().expect(
        "libmoonbright_capi.a not found next to the test executable: cargo should build the \
         staticlib with the tests",
    );
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_example");
    std::fs::create_dir_all(&out_dir).unwrap();
    let exe = out_dir.join("basic");
    let compile = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("examples/c/basic.c"))
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&exe)
        .output()
        .expect("run cc");
    assert!(
        compile.status.success(),
        "cc failed against {}:\n{}{}",
        lib.display(),
        String::from_utf8_lossy(&compile.stdout),
        String::from_utf8_lossy(&compile.stderr)
    );
    let run = Command::new(&exe).output().expect("run the example");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "basic exited with {}:\n{stdout}{stderr}", run.status);
    assert!(stdout.contains("ok"), "{stdout}");
    assert!(stdout.contains(env!("CARGO_PKG_VERSION")), "{stdout}");
}
