//! The committed header `include/moonbright.h` is what cbindgen makes of `src/lib.rs` now (and of
//! the modules it declares, in their order).
//! `MOONBRIGHT_BLESS=1 cargo test -p moonbright-capi --test header` rewrites it.

use std::path::Path;

#[test]
fn header_is_current() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("cbindgen.toml should parse");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen should parse src/lib.rs");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");

    let path = crate_dir.join("include/moonbright.h");
    if std::env::var_os("MOONBRIGHT_BLESS").is_some_and(|v| v != "0") {
        std::fs::write(&path, &generated).expect("write include/moonbright.h");
        eprintln!("wrote {}", path.display());
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let first = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(generated.lines().count()));
        panic!(
            "{} is out of date with src/lib.rs (first difference at line {}).\n\
             Regenerate it with:\n    \
             MOONBRIGHT_BLESS=1 cargo test -p moonbright-capi --test header\n",
            path.display(),
            first + 1
        );
    }
}
