//! `moonbright demo`: the fragmentation scenario, MoonBright against a no-remap caching allocator
//! on the same backend.

use crate::ExitCode;

use moonbright::{Allocator, BackendKind, Options, Stats};
use moonbright_testkit::baseline::NoRemapAllocator;
use moonbright_testkit::scenario::{fragmentation, FragmentationReport};

use crate::MIB;

pub(crate) fn demo(
    backend: &str,
    cap_mib: u64,
    block_mib: u64,
) -> Result<ExitCode, moonbright::Error> {
    let backend: BackendKind = backend.parse()?;
    let cap = cap_mib * MIB;
    let opts = Options {
        backend,
        cap_bytes: Some(cap),
        host_capacity: cap.max(64 * MIB),
        validate: cfg!(debug_assertions),
        ..Options::default()
    };
    let block = (block_mib * MIB) as usize;

    let mb = Allocator::new(opts.clone())?;
    println!(
        "backend: {} | page {} KiB | cap {} MiB | block {} MiB",
        mb.backend_name(),
        mb.page_size() >> 10,
        mb.cap() / MIB,
        block_mib
    );
    let ours = fragmentation(&mb, block, mb.cap())?;
    let stats = mb.stats();
    mb.release_unused()?;
    drop(mb);

    // The baseline carves blocks out of segments of eight blocks, as PyTorch carves its segments.
    let base = NoRemapAllocator::new(&opts, 8 * block as u64)?;
    let theirs = fragmentation(&base, block, u64::MAX)?;
    drop(base);

    println!();
    print_report(&ours);
    print_report(&theirs);
    println!();
    print_stats(&stats);
    let ok = ours.big_ok && ours.data_intact && !theirs.big_ok;
    println!();
    if ok {
        println!(
            "result: MoonBright served the {} MiB request from scattered free pages; the no-remap allocator could not.",
            ours.big_request / MIB
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!("result: UNEXPECTED outcome (see above)");
        Ok(ExitCode::FAILURE)
    }
}

fn print_report(r: &FragmentationReport) {
    println!(
        "{:<18} filled {:>4} blocks of {} MiB, freed {} MiB in {} MiB holes; request {} MiB: {}{}; data intact: {}; peak reserved {} MiB",
        r.allocator,
        r.blocks,
        r.block_bytes / MIB,
        r.freed_bytes / MIB,
        r.block_bytes / MIB,
        r.big_request / MIB,
        if r.big_ok { "OK" } else { "FAILED" },
        r.big_error.as_deref().map(|e| format!(" ({e})")).unwrap_or_default(),
        r.data_intact,
        r.peak_reserved / MIB,
    );
}

pub(crate) fn print_stats(s: &Stats) {
    println!("MoonBright statistics (current / peak / allocated / freed):");
    for (name, st) in s.named() {
        println!(
            "  {name:<22} {:>14} {:>14} {:>14} {:>14}",
            st.current, st.peak, st.allocated, st.freed
        );
    }
    println!(
        "  cache_hits {} | cached ranges stolen {} | chunk splits {} | unmap batches {} ({} unmap calls) | OOMs {} | deferred errors {}",
        s.cache_hits,
        s.cached_ranges_stolen,
        s.chunk_splits,
        s.unmap_batches,
        s.unmap_calls_in_batches,
        s.num_ooms,
        s.deferred_errors
    );
    let calls: Vec<String> = s
        .driver_calls
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{} {n}", k.key()))
        .collect();
    println!("  driver calls: {}", calls.join(", "));
}
