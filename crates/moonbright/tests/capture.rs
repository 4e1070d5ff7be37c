//! CUDA graph capture on a real GPU: while a stream is being captured, MoonBright refuses to
//! allocate or free on it, with a clear error and no change; after the capture it works again.
//! Skips (with a message) without a GPU; the host model's capture hook is tested in streams.rs.

use cudarc::driver::sys;
use moonbright::driver::Driver;
use moonbright::{Allocator, BackendKind, Error, Options};

/// Makes the allocator's context this thread's, for the test's own driver calls (MoonBright's
/// calls leave the thread's current context as they find it).
fn bind(a: &Allocator) {
    match a.driver().inner() {
        moonbright::Backend::Cuda(d) => d.bind_context().unwrap(),
        moonbright::Backend::Host(_) => unreachable!("a CUDA test"),
    }
}

#[test]
fn allocation_during_graph_capture_is_refused() {
    if let Err(why) = moonbright::driver::cuda::probe() {
        eprintln!("skipping: {why}");
        return;
    }
    let a = Allocator::new(Options {
        backend: BackendKind::Cuda,
        cap_bytes: Some(1 << 30),
        validate: true,
        ..Options::default()
    })
    .unwrap();
    bind(&a);
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
/// its calls with the thread's capture mode relaxed (`driver/cuda.rs: relaxed`).
#[test]
fn allocation_beside_a_global_mode_capture_leaves_it_valid() {
    if let Err(why) = moonbright::driver::cuda::probe() {
        eprintln!("skipping: {why}");
        return;
    }
    let a = Allocator::new(Options {
        backend: BackendKind::Cuda,
        cap_bytes: Some(4 << 30),
        validate: true,
        ..Options::default()
    })
    .unwrap();
    bind(&a);
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
