//! CUDA graph capture on a real GPU: while a stream is being captured, MoonBright refuses to
//! allocate or free on it, with a clear error and no change, unless the capture was begun into
//! a graph pool (`begin_graph_capture`): then its allocations are baked into the graph and stay
//! the pool's. Skips without a GPU (counted; a failure under `MOONBRIGHT_REQUIRE_GPU=1`); the
//! host model's capture hook is tested in streams.rs and graphs.rs. The tests hold the GPU-test
//! lock of `moonbright::testing`, so they run one at a time even in parallel test threads: a
//! global-mode capture is invalidated by another thread's synchronous driver call.

use cudarc::driver::sys;
use moonbright::driver::prelude::*;
use moonbright::testing::Gpu;
use moonbright::{Allocator, BackendKind, Error, Options};

/// Makes the allocator's context this thread's, for the test's own driver calls (MoonBright's
/// calls leave the thread's current context as they find it).
fn bind(a: &Allocator) {
    match a.driver().inner() {
        moonbright::Backend::Cuda(d) => d.bind_context().unwrap(),
        moonbright::Backend::Host(_) => unreachable!("a CUDA test"),
    }
}

/// A CUDA allocator capped at `cap` bytes, validating every step, whose context is this
/// thread's, with the GPU: keep it to the test's end, so that no other GPU test of this process
/// runs beside the test's global-mode capture. `None` without a GPU (see `moonbright::testing`).
fn cuda_allocator(cap: u64) -> Option<(Gpu, Allocator)> {
    let gpu = moonbright::testing::gpu()?;
    let a = Allocator::new(Options {
        backend: BackendKind::Cuda,
        cap_bytes: Some(cap),
        validate: true,
        ..Options::default()
    })
    .unwrap();
    bind(&a);
    Some((gpu, a))
}

#[test]
fn allocation_during_graph_capture_is_refused() {
    let Some((_gpu, a)) = cuda_allocator(1 << 30) else { return };
    let s = a.driver().create_stream().unwrap();
    let before = a.malloc_async(4 << 20, s).unwrap();
    let stream = s.0 as sys::CUstream;
    // SAFETY: `stream` is a live stream of the allocator's device, whose primary context is
    // current on this thread (`bind`).
    let r = unsafe {
        sys::cuStreamBeginCapture_v2(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let live = a.stats().allocations.current;
    assert_eq!(a.malloc_async(1 << 20, s), Err(Error::StreamCapture { stream: s.0 }));
    assert_eq!(a.free_async(before, s), Err(Error::StreamCapture { stream: s.0 }));
    assert_eq!(a.stats().allocations.current, live, "a refused request changed the state");
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; `graph` is a valid out-pointer.
    assert_eq!(unsafe { sys::cuStreamEndCapture(stream, &mut graph) }, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: `graph` came from the capture and is destroyed once.
    assert_eq!(unsafe { sys::cuGraphDestroy(graph) }, sys::CUresult::CUDA_SUCCESS);
    // After the capture: both work again.
    let p = a.malloc_async(1 << 20, s).unwrap();
    a.free_async(p, s).unwrap();
    a.free_async(before, s).unwrap();
    a.check_invariants().unwrap();
}

/// A capture in the default *global* mode (PyTorch's `torch.cuda.graph`) on one thread, while
/// another thread allocates new sizes on its own stream (maps, set access, unmaps, event
/// queries) and the background worker runs: none of MoonBright's calls may invalidate the
/// capture. Under global mode a "potentially unsafe" call from any thread does; MoonBright makes
/// its calls with the thread's capture mode relaxed (`driver/cuda/context.rs: relaxed`).
#[test]
fn allocation_beside_a_global_mode_capture_leaves_it_valid() {
    let Some((_gpu, a)) = cuda_allocator(4 << 30) else { return };
    let s = a.driver().create_stream().unwrap();
    let other = a.driver().create_stream().unwrap();
    let stream = s.0 as sys::CUstream;
    // SAFETY: `stream` is a live stream of the allocator's device, whose primary context is
    // current on this thread (`bind`).
    let r = unsafe {
        sys::cuStreamBeginCapture_v2(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let made = std::thread::scope(|scope| {
        let t = scope.spawn(|| {
            let mut made = 0u64;
            let mut i = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || made < 64 {
                // New sizes (maps), frees on a stream (events), and now and then a release
                // (unmaps and cuMemRelease).
                let p = a.malloc_async((1 + i % 37) << 20, other).expect("allocation failed");
                a.free_async(p, other).expect("free failed");
                if i % 16 == 15 {
                    a.release_unused().expect("release_unused failed");
                }
                made += 1;
                i += 1;
            }
            made
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        t.join().unwrap()
    });
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; `graph` is a valid out-pointer.
    let r = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "the capture was invalidated ({made} allocations)");
    // SAFETY: `graph` came from the capture and is destroyed once.
    assert_eq!(unsafe { sys::cuGraphDestroy(graph) }, sys::CUresult::CUDA_SUCCESS);
    assert!(a.take_deferred_error().is_none(), "a call failed beside the capture");
    a.check_invariants().unwrap();
}

fn ok(r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

/// A capture in global mode (as PyTorch's) begun into a graph pool: a fresh mapping made inside
/// it, a memset and a copy captured over pool memory, a free inside it; the graph, launched
/// after other allocations were made and filled, writes its own memory and spares theirs; the
/// released pool gives everything back.
#[test]
fn allocation_in_a_capture_begun_into_a_pool_is_baked_into_the_graph() {
    let Some((_gpu, a)) = cuda_allocator(4 << 30) else { return };
    let (s, other) = (a.driver().create_stream().unwrap(), a.driver().create_stream().unwrap());
    let stream = s.0 as sys::CUstream;
    let pool = (0, 42);
    const N: usize = 1 << 20;
    // SAFETY: `stream` is a live stream of the allocator's device, whose primary context is
    // current on this thread (`bind`).
    ok(unsafe {
        sys::cuStreamBeginCapture_v2(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    });
    a.begin_graph_capture(s, pool).unwrap();
    let p = a.malloc_async(4 * N, s).unwrap();
    let q = a.malloc_async(N, s).unwrap();
    // SAFETY: both ranges are mapped with access set, and at least `N` bytes long; the calls
    // are captured, not run.
    unsafe {
        ok(sys::cuMemsetD32Async(p, 0xABCD_1234, N, stream));
        ok(sys::cuMemcpyDtoDAsync_v2(q, p + N as u64, N, stream));
    }
    a.free_async(p, s).unwrap();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; `graph` is a valid out-pointer.
    ok(unsafe { sys::cuStreamEndCapture(stream, &mut graph) });
    a.end_graph_capture(s).unwrap();
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` came from the capture; `exec` is a valid out-pointer.
    ok(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) });
    assert_eq!(a.graph_pool_free().0, 1, "p, freed inside the capture, is kept for the graph");

    // Other allocations, made and filled before the launch, must not share the graph's memory.
    let others: Vec<u64> =
        (0..16).map(|i| a.malloc_async((1 + i % 4) * N, other).unwrap()).collect();
    for (i, &o) in others.iter().enumerate() {
        a.driver().write(o, &vec![i as u8 + 1; N]).unwrap();
    }
    // SAFETY: `exec` is the instantiated graph; `stream` is live.
    ok(unsafe { sys::cuGraphLaunch(exec, stream) });
    a.graph_replayed(pool, s);
    // SAFETY: `stream` is live.
    ok(unsafe { sys::cuStreamSynchronize(stream) });
    let mut back = vec![0u8; N];
    a.driver().read(q, &mut back).unwrap();
    let word = 0xABCD_1234u32.to_le_bytes();
    assert!(back.chunks(4).all(|c| c == word), "the graph's copy");
    for (i, &o) in others.iter().enumerate() {
        a.driver().read(o, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == i as u8 + 1), "the graph wrote another allocation");
        a.free_async(o, other).unwrap();
    }
    // SAFETY: destroyed once each, after the launch completed.
    unsafe {
        ok(sys::cuGraphExecDestroy(exec));
        ok(sys::cuGraphDestroy(graph));
    }
    a.release_graph_pool(pool).unwrap();
    a.free_async(q, s).unwrap();
    assert_eq!(a.graph_pool_free(), (0, 0));
    assert!(a.take_deferred_error().is_none());
    a.check_invariants().unwrap();
}
