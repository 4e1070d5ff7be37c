//! Model checks (loom) of the concurrent structure every driver call passes through: the
//! counting, fault-injecting wrapper. Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p moonbright --test loom --release`.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use moonbright::driver::*;

/// A driver whose every call succeeds: the model is about the wrapper, not a backend.
#[derive(Debug)]
struct Null;

impl VirtualMemory for Null {
    fn name(&self) -> &'static str {
        "null"
    }
    fn granularity(&self) -> usize {
        1
    }
    fn mem_info(&self) -> DriverResult<MemInfo> {
        Ok(MemInfo { free: 0, total: 0 })
    }
    fn reserve(&self, _: usize, _: usize) -> DriverResult<DevicePtr> {
        Ok(0)
    }
    fn free_reservation(&self, _: DevicePtr, _: usize) -> DriverResult<()> {
        Ok(())
    }
    fn create_chunk(&self, _: usize) -> DriverResult<ChunkHandle> {
        Ok(ChunkHandle(1))
    }
    fn release_chunk(&self, _: ChunkHandle) -> DriverResult<()> {
        Ok(())
    }
    fn map(&self, _: DevicePtr, _: usize, _: ChunkHandle) -> DriverResult<()> {
        Ok(())
    }
    fn set_access(&self, _: DevicePtr, _: usize) -> DriverResult<()> {
        Ok(())
    }
    fn unmap(&self, _: DevicePtr, _: usize) -> DriverResult<()> {
        Ok(())
    }
}

impl Peers for Null {
    fn set_peers(&self, _: &[i32]) -> DriverResult<()> {
        Ok(())
    }
}

impl Copies for Null {
    fn write(&self, _: DevicePtr, _: &[u8]) -> DriverResult<()> {
        Ok(())
    }
    fn read(&self, _: DevicePtr, _: &mut [u8]) -> DriverResult<()> {
        Ok(())
    }
}

impl Streams for Null {
    fn create_stream(&self) -> DriverResult<StreamHandle> {
        Ok(StreamHandle(1))
    }
    fn destroy_stream(&self, _: StreamHandle) -> DriverResult<()> {
        Ok(())
    }
    fn create_event(&self) -> DriverResult<EventHandle> {
        Ok(EventHandle(1))
    }
    fn record_event(&self, _: EventHandle, _: StreamHandle) -> DriverResult<()> {
        Ok(())
    }
    fn event_done(&self, _: EventHandle) -> DriverResult<bool> {
        Ok(true)
    }
    fn destroy_event(&self, _: EventHandle) -> DriverResult<()> {
        Ok(())
    }
    fn synchronize_event(&self, _: EventHandle) -> DriverResult<()> {
        Ok(())
    }
}

impl Capture for Null {
    fn is_capturing(&self, _: StreamHandle) -> DriverResult<bool> {
        Ok(false)
    }
}

impl Ipc for Null {}

/// Two threads race through a planned failure: in every interleaving exactly one call fails,
/// and every call is counted.
#[test]
fn a_planned_failure_fires_exactly_once() {
    loom::model(|| {
        let d = Arc::new(Instrumented::new(Null));
        d.fail_nth(CallKind::Map, 2, None);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let d = d.clone();
                thread::spawn(move || d.map(0, 1, ChunkHandle(1)).is_err() as u32)
            })
            .collect();
        let failed: u32 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(failed, 1);
        assert_eq!(d.counts().get(CallKind::Map), 2);
        assert!(d.map(0, 1, ChunkHandle(1)).is_ok(), "a plan fired twice");
    });
}

/// A failure planned while another thread is calling is never lost: the third call overall
/// fails whichever thread makes it.
#[test]
fn a_failure_planned_concurrently_still_fires() {
    loom::model(|| {
        let d = Arc::new(Instrumented::new(Null));
        let d2 = d.clone();
        let t = thread::spawn(move || d2.unmap(0, 1).is_err() as u32);
        d.fail_nth(CallKind::Unmap, 1, None);
        let mut failed = t.join().unwrap();
        for _ in 0..2 {
            failed += d.unmap(0, 1).is_err() as u32;
        }
        assert_eq!(failed, 1, "the planned failure fired {failed} times");
    });
}
