//! CUDA graph capture on a real GPU: while a stream is being captured, MoonBright refuses to
//! allocate or free on it, with a clear error and no change; after the capture it works again.
//! Skips (with a message) without a GPU; the host model's capture hook is tested in streams.rs.

use cudarc::driver::sys;
use moonbright::driver::Driver;
use moonbright::{Allocator, BackendKind, Error, Options};

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
    let s = a.driver().create_stream().unwrap();
    let before = a.malloc_async(4 << 20, s).unwrap();
    let stream = s.0 as sys::CUstream;
    // SAFETY: `stream` is a live stream of the allocator's device, whose primary context the
    // allocator made current on this thread (create_stream above).
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
