//! What an address costs: `cuMemMap`, `cuMemSetAccess` and `cuMemUnmap` of one handle timed at
//! addresses of different histories, to find why a map at MoonBright's fresh frontier costs
//! about twice raw VMM's (README, cold maps). One handle of each size is created once and
//! mapped again and again, so only the address changes between the cases:
//!
//! - `fresh`: a new, never-mapped address each time, in one large reservation (MoonBright's
//!   frontier); each mapping is unmapped at once.
//! - `fresh-batched`: the same, but every mapping stays until a burst unmaps them all
//!   (MoonBright's deferred unmap), so the reservation holds many live mappings.
//! - `recycled`: the addresses of `fresh`, mapped and unmapped before (MoonBright's recycled
//!   addresses).
//! - `same`: one address, mapped and unmapped over and over.
//! - `same-beside-live`, `same-far-live`: the same while a 2 MiB mapping stays right after the
//!   address, or 4 GiB away; at 2 MiB also `live-...-away` at distances in between.
//! - `own-reservation`: reserve, map, set access, unmap, free each time (the latency
//!   benchmark's raw VMM).
//! - `small-pool`: reservations of the handle's size made ahead of time, each mapped once.
//! - `small-reused`: one such reservation, mapped and unmapped over and over.
//! - `small-pool-again`: the pool's reservations once more, each unmapped a whole round before.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cudarc::driver::sys;
use moonbright_bench::cu::{ck, Gpu};
use moonbright_bench::stats::{us_since, Summary};
use moonbright_bench::{main_wrapper, Res, GIB, MIB};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Map, set-access and unmap costs by the address's history")]
struct Args {
    /// Mappings per case and size (fewer for sizes of 1 GiB and more).
    #[arg(long, default_value_t = 200)]
    reps: usize,
    /// Size of the large reservation, in GiB (MoonBright reserves several times device memory).
    #[arg(long, default_value_t = 512)]
    reserve_gib: u64,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Debug, Serialize)]
struct Row {
    case: &'static str,
    size: u64,
    map_us: Summary,
    set_access_us: Summary,
    unmap_us: Summary,
}

struct Vmm {
    access: sys::CUmemAccessDesc,
}

/// Times of one mapping's three calls.
struct Times {
    map: f64,
    access: f64,
}

impl Vmm {
    fn map(&self, va: u64, size: u64, h: sys::CUmemGenericAllocationHandle) -> Res<Times> {
        let t = Instant::now();
        // SAFETY: `va` lies in a reservation this program made and is not mapped; `h` is a
        // handle of `size` bytes.
        ck(unsafe { sys::cuMemMap(va, size as usize, 0, h, 0) }, "cuMemMap")?;
        let map = us_since(t);
        let t = Instant::now();
        // SAFETY: `[va, va + size)` was just mapped; one descriptor.
        ck(unsafe { sys::cuMemSetAccess(va, size as usize, &self.access, 1) }, "cuMemSetAccess")?;
        Ok(Times { map, access: us_since(t) })
    }

    /// Maps the handle at each address in turn and unmaps it at once: one row of `case`.
    fn cycle(
        &self,
        case: &'static str,
        addrs: impl IntoIterator<Item = u64>,
        size: u64,
        h: sys::CUmemGenericAllocationHandle,
    ) -> Res<Row> {
        let (mut t, mut u) = (vec![], vec![]);
        for va in addrs {
            t.push(self.map(va, size, h)?);
            u.push(self.unmap(va, size)?);
        }
        Ok(row(case, size, &t, &u))
    }

    fn unmap(&self, va: u64, size: u64) -> Res<f64> {
        let t = Instant::now();
        // SAFETY: `[va, va + size)` is one mapping this program made; nothing uses it.
        ck(unsafe { sys::cuMemUnmap(va, size as usize) }, "cuMemUnmap")?;
        Ok(us_since(t))
    }
}

fn reserve(len: u64) -> Res<u64> {
    let mut va = 0;
    // SAFETY: valid out-pointer.
    ck(unsafe { sys::cuMemAddressReserve(&mut va, len as usize, 0, 0, 0) }, "cuMemAddressReserve")?;
    Ok(va)
}

fn address_free(va: u64, len: u64) -> Res<()> {
    // SAFETY: `[va, va + len)` is a whole reservation made by `reserve`, with nothing mapped.
    ck(unsafe { sys::cuMemAddressFree(va, len as usize) }, "cuMemAddressFree")
}

fn row(case: &'static str, size: u64, t: &[Times], unmaps: &[f64]) -> Row {
    let maps: Vec<f64> = t.iter().map(|t| t.map).collect();
    let access: Vec<f64> = t.iter().map(|t| t.access).collect();
    Row {
        case,
        size,
        map_us: Summary::of(&maps),
        set_access_us: Summary::of(&access),
        unmap_us: Summary::of(unmaps),
    }
}

fn probe(args: &Args, gpu: &Gpu) -> Res<Vec<Row>> {
    let vmm = Vmm {
        access: sys::CUmemAccessDesc {
            location: gpu.location(),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        },
    };
    let big = args.reserve_gib * GIB;
    let mut rows = vec![];
    for size in [2 * MIB, 64 * MIB, GIB] {
        // As many as fit twice in the reservation (the cases use two rounds of addresses).
        let reps = if size >= GIB { args.reps.min(40) } else { args.reps };
        let reps = reps.min((big / (2 * size)) as usize);
        if reps == 0 {
            return Err(format!("--reserve-gib {} is too small for {size}", args.reserve_gib));
        }
        let mut h = 0;
        let prop = gpu.alloc_prop();
        // SAFETY: valid out-pointer and a fully initialised property struct.
        let r = unsafe { sys::cuMemCreate(&mut h, size as usize, &prop, 0) };
        ck(r, "cuMemCreate")?;
        let base = reserve(big)?;
        if size == 2 * MIB {
            println!(
                "reservation base {base:#x}: aligned to {} MiB",
                (1u64 << base.trailing_zeros()) / MIB
            );
        }
        let at = |i: usize| base + i as u64 * size;
        rows.push(vmm.cycle("fresh", (0..reps).map(at), size, h)?);
        rows.push(vmm.cycle("recycled", (0..reps).map(at), size, h)?);
        let (mut t, mut u) = (vec![], vec![]);
        for i in reps..2 * reps {
            t.push(vmm.map(at(i), size, h)?);
        }
        for i in reps..2 * reps {
            u.push(vmm.unmap(at(i), size)?);
        }
        rows.push(row("fresh-batched", size, &t, &u));
        rows.push(vmm.cycle("same", std::iter::repeat(base).take(reps), size, h)?);
        // The same with a 2 MiB handle kept mapped right after the address, or 4 GiB away: does a
        // live mapping nearby keep the driver's cost down?
        let mut n = 0;
        // SAFETY: valid out-pointer and a fully initialised property struct.
        ck(unsafe { sys::cuMemCreate(&mut n, 2 * MIB as usize, &prop, 0) }, "cuMemCreate")?;
        let mut near = vec![("same-beside-live", size), ("same-far-live", 4 * GIB.max(size))];
        if size == 2 * MIB {
            // How far a live mapping helps: from the address's own 2 MiB neighbour outwards.
            near.extend([
                ("live-64MiB-away", 64 * MIB),
                ("live-256MiB-away", 256 * MIB),
                ("live-1022MiB-away", 1022 * MIB),
                ("live-2GiB-away", 2 * GIB),
            ]);
        }
        for (case, off) in near {
            vmm.map(base + off, 2 * MIB, n)?;
            rows.push(vmm.cycle(case, std::iter::repeat(base).take(reps), size, h)?);
            vmm.unmap(base + off, 2 * MIB)?;
        }
        // SAFETY: `n` is mapped nowhere now.
        ck(unsafe { sys::cuMemRelease(n) }, "cuMemRelease")?;
        address_free(base, big)?;
        let (mut t, mut u) = (vec![], vec![]);
        for _ in 0..reps {
            let va = reserve(size)?;
            t.push(vmm.map(va, size, h)?);
            u.push(vmm.unmap(va, size)?);
            address_free(va, size)?;
        }
        rows.push(row("own-reservation", size, &t, &u));
        // Reservations of the handle's size made ahead of time, each used once (a pool of them).
        let pool: Vec<u64> = (0..reps).map(|_| reserve(size)).collect::<Res<_>>()?;
        rows.push(vmm.cycle("small-pool", pool.iter().copied(), size, h)?);
        // One of them, mapped again and again.
        rows.push(vmm.cycle("small-reused", std::iter::repeat(pool[0]).take(reps), size, h)?);
        // All of them again, in the same order: each was unmapped a whole round ago (a pool
        // reused round-robin, as unmap batches would leave it).
        rows.push(vmm.cycle("small-pool-again", pool.iter().copied(), size, h)?);
        for va in pool {
            address_free(va, size)?;
        }
        // SAFETY: `h` is mapped nowhere now.
        ck(unsafe { sys::cuMemRelease(h) }, "cuMemRelease")?;
    }
    Ok(rows)
}

fn main() -> ExitCode {
    main_wrapper("vaprobe", || {
        let args = Args::parse();
        let gpu = Gpu::open()?;
        let rows = probe(&args, &gpu)?;
        println!(
            "{}: map / set access / unmap of one handle, p50 (p99) us; reservation {} GiB",
            gpu.name, args.reserve_gib
        );
        println!("{:<16} {:>8} {:>16} {:>16} {:>16}", "case", "size", "map", "set access", "unmap");
        for r in &rows {
            let f = |s: &Summary| format!("{:.1} ({:.1})", s.p50, s.p99);
            println!(
                "{:<16} {:>8} {:>16} {:>16} {:>16}",
                r.case,
                moonbright_bench::human(r.size),
                f(&r.map_us),
                f(&r.set_access_us),
                f(&r.unmap_us)
            );
        }
        if let Some(p) = &args.json {
            moonbright_bench::write_json(p, &rows)?;
        }
        Ok(())
    })
}
