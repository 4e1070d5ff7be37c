//! What sharing memory with other processes costs (option `ipc`, on by default), on a real GPU,
//! in one process: `cuMemCreate` + `cuMemRelease` with and without a POSIX file descriptor
//! handle type; MoonBright's cold map (create, map, set access) with `ipc` on and off; and a
//! fresh chunk's first export, a second export of it (the kept descriptor), its import into a
//! second allocator and the import's close. The sides of each
//! comparison alternate within every round, so a slow spell of the machine falls on both.
//! Prints p50/p99 in µs and the ratios; `--json` writes them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cudarc::driver::sys;
use moonbright::{Allocator, BackendKind, Options};
use moonbright_bench::cu::{ck, Gpu};
use moonbright_bench::stats::{us_since, Summary};
use moonbright_bench::{env_options, human, main_wrapper, Res, GIB, MIB};

#[derive(Parser, Debug)]
#[command(about = "The cost of shareable handles: creates, cold maps, exports and imports")]
struct Args {
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Repetitions per side, size and round.
    #[arg(long, default_value_t = 40)]
    reps: usize,
    /// Rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

const SIZES: [u64; 3] = [2 * MIB, 64 * MIB, GIB];

fn main() -> ExitCode {
    main_wrapper("ipccost", || run(Args::parse()))
}

/// One `cuMemCreate` + `cuMemRelease` of `size` bytes; the create's µs.
fn create_release(gpu: &Gpu, size: u64, fd: bool) -> Res<f64> {
    let mut prop = gpu.alloc_prop();
    if fd {
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    let mut h = 0;
    let t = Instant::now();
    // SAFETY: a valid out-pointer and a fully initialised property struct.
    ck(unsafe { sys::cuMemCreate(&mut h, size as usize, &prop, 0) }, "cuMemCreate")?;
    let us = us_since(t);
    // SAFETY: `h` was just created and is mapped nowhere.
    ck(unsafe { sys::cuMemRelease(h) }, "cuMemRelease")?;
    Ok(us)
}

fn allocator(ipc: bool) -> Res<Allocator> {
    let o = Options {
        backend: BackendKind::Cuda,
        background: false,
        prefetch_window_max: 0,
        prefetch_window_min: 0,
        ipc,
        ..env_options()
    };
    Allocator::new(o).map_err(|e| e.to_string())
}

/// A cold map: `malloc` of `size` bytes with nothing held (create, map, set access); µs.
fn cold_map(a: &Allocator, size: u64) -> Res<f64> {
    let t = Instant::now();
    let p = a.malloc(size as usize).map_err(|e| e.to_string())?;
    let us = us_since(t);
    a.free(p).map_err(|e| e.to_string())?;
    a.release_unused().map_err(|e| e.to_string())?;
    Ok(us)
}

fn run(args: Args) -> Res<()> {
    let gpu = Gpu::open()?;
    println!(
        "{} (driver {}), {} reps x {} rounds",
        gpu.name, gpu.driver_version, args.reps, args.rounds
    );
    let on = allocator(true)?;
    let off = allocator(false)?;
    let exporter = allocator(true)?;
    let importer = allocator(true)?;
    let mut samples: BTreeMap<(String, u64), Vec<f64>> = BTreeMap::new();
    let mut import_error = None;
    for _ in 0..args.rounds {
        for &size in &SIZES {
            for rep in 0..args.reps {
                // Alternate which side goes first.
                let order = if rep % 2 == 0 { [true, false] } else { [false, true] };
                for fd in order {
                    let us = create_release(&gpu, size, fd)?;
                    let key = if fd { "create, POSIX fd handle" } else { "create, no handle type" };
                    samples.entry((key.into(), size)).or_default().push(us);
                    let (a, key) =
                        if fd { (&on, "cold map, ipc on") } else { (&off, "cold map, ipc off") };
                    let us = cold_map(a, size)?;
                    samples.entry((key.into(), size)).or_default().push(us);
                }
                // A fresh chunk each repetition: its first export, then a second one.
                let p = exporter.malloc(size as usize).map_err(|e| e.to_string())?;
                let t = Instant::now();
                let export = exporter.export(p).map_err(|e| e.to_string())?;
                samples.entry(("export, first".into(), size)).or_default().push(us_since(t));
                drop(export);
                let t = Instant::now();
                let export = exporter.export(p).map_err(|e| e.to_string())?;
                samples.entry(("export, again".into(), size)).or_default().push(us_since(t));
                let t = Instant::now();
                match importer.import(&export) {
                    Ok(q) => {
                        samples
                            .entry(("import (same process)".into(), size))
                            .or_default()
                            .push(us_since(t));
                        let t = Instant::now();
                        importer.close_import(q).map_err(|e| e.to_string())?;
                        samples.entry(("close import".into(), size)).or_default().push(us_since(t));
                    }
                    Err(e) => import_error = Some(e.to_string()),
                }
                drop(export);
                exporter.free(p).map_err(|e| e.to_string())?;
                exporter.release_unused().map_err(|e| e.to_string())?;
            }
        }
    }
    if let Some(e) = &import_error {
        println!("import in the same process failed: {e}");
    }
    let mut out = BTreeMap::new();
    println!("\n{:<26} {:>8} {:>10} {:>10}", "us", "size", "p50", "p99");
    for ((key, size), xs) in &samples {
        let s = Summary::of(xs);
        println!("{key:<26} {:>8} {:>10.1} {:>10.1}", human(*size), s.p50, s.p99);
        out.insert(format!("{key} @ {}", human(*size)), s);
    }
    let p50 = |k: &str, size: u64| samples.get(&(k.to_string(), size)).map(|x| Summary::of(x).p50);
    println!("\nratios (p50, on / off):");
    for &size in &SIZES {
        let r = |a: &str, b: &str| match (p50(a, size), p50(b, size)) {
            (Some(x), Some(y)) if y > 0.0 => format!("{:.3}", x / y),
            _ => "-".into(),
        };
        println!(
            "  {:>7}  create {}   cold map {}",
            human(size),
            r("create, POSIX fd handle", "create, no handle type"),
            r("cold map, ipc on", "cold map, ipc off")
        );
    }
    if let Some(path) = args.json {
        let doc = serde_json::json!({
            "gpu": gpu.name,
            "driver_version": gpu.driver_version,
            "reps": args.reps,
            "rounds": args.rounds,
            "import_error": import_error,
            "us": out,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}
