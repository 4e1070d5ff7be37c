//! The synchronisation primitives the crate uses, swapped for loom's under `cfg(loom)` so the
//! model checker sees every atomic and lock (the crossbeam/tokio habit), and the one way a
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

/// Gives up the CPU once, to threads the caller waits for.
pub(crate) fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}
