//! The synchronisation primitives the crate uses, swapped for loom's under `cfg(loom)` so the
//! model checker sees every atomic and lock (the crossbeam/tokio habit), and the two ways a
//! thread waits for another's progress.

#[cfg(loom)]
pub(crate) use loom::sync::{atomic, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::{atomic, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};

/// Lets other threads make progress for about `d` (a sleep; under loom, a yield, which is what
/// lets the model checker run the thread being waited for).
pub(crate) fn pause(d: std::time::Duration) {
    #[cfg(loom)]
    {
        let _ = d;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    std::thread::sleep(d);
}

/// Yields while `busy()` holds, for at most `limit`: how the background worker gives way to
/// requests. Under loom, at most a few yields, as the model checker bounds the atomic loads a
/// run may make and a wait measured in real time would spin past that bound.
pub(crate) fn yield_while(busy: impl Fn() -> bool, limit: std::time::Duration) {
    #[cfg(loom)]
    {
        let _ = limit;
        for _ in 0..3 {
            if !busy() {
                return;
            }
            loom::thread::yield_now();
        }
    }
    #[cfg(not(loom))]
    {
        let start = std::time::Instant::now();
        while busy() && start.elapsed() < limit {
            std::thread::yield_now();
        }
    }
}
