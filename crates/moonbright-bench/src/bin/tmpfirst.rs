use moonbright::{Allocator, BackendKind, StreamHandle};
use std::time::{Duration, Instant};
fn main() {
    let size: u64 = std::env::args().nth(1).unwrap().parse::<u64>().unwrap() << 20;
    let v = std::env::args().nth(2).unwrap_or_default();
    let k = 8u64;
    let mut opts = moonbright_bench::mb_options(
        None,
        moonbright_bench::max_chunk(),
        (k * size, k * size),
        true,
    );
    opts.backend = BackendKind::Host;
    opts.host_capacity = 256 << 30;
    let a = Allocator::new(opts).unwrap();
    let mut held = vec![];
    let mut firsts = vec![];
    let mut seconds = vec![];
    for _run in 0..12 {
        while a.stats().window_bytes.current < k * size {
            std::hint::spin_loop();
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(2) {}
        if v == "reset" {
            for p in held.drain(..) {
                a.free(p).unwrap();
            }
            a.release_unused().unwrap();
            while a.stats().window_bytes.current < k * size {
                std::hint::spin_loop();
            }
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(2) {}
        }
        for i in 0..k {
            let t = Instant::now();
            held.push(a.malloc_async(size as usize, StreamHandle(0)).unwrap());
            let us = t.elapsed().as_secs_f64() * 1e6;
            if i == 0 {
                firsts.push(us)
            } else if i == 1 {
                seconds.push(us)
            }
        }
    }
    println!(
        "{v} size {} MiB firsts {:?}\n  seconds {:?}",
        size >> 20,
        firsts.iter().map(|x| (x * 100.0).round() / 100.0).collect::<Vec<_>>(),
        seconds.iter().map(|x| (x * 100.0).round() / 100.0).collect::<Vec<_>>()
    );
}
