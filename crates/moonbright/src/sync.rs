//! The synchronisation primitives the crate uses, swapped for loom's under `cfg(loom)` so the
//! model checker sees every atomic and lock (the crossbeam/tokio habit), the clock the
//! allocator's policies read (batch ages, waits, demand), and the two ways a thread waits for
//! another's progress.

#[cfg(loom)]
pub(crate) use loom::sync::{atomic, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::{atomic, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};

#[cfg(loom)]
pub(crate) use model_clock::Instant;

#[cfg(not(loom))]
pub(crate) use std::time::Instant;

/// Time under loom. Loom replays a model's run step by step and needs every run of a schedule
/// to take the same branches, which real time does not give: an unmap batch that falls due by
/// age (50 ms) in one run of a slow machine and not in its replay sends the checker off its
/// recorded path (it panics inside loom). So a model's clock is logical: it starts at zero in
/// each run and only `pause` moves it, by the time the pause stands for.
#[cfg(loom)]
mod model_clock {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    loom::lazy_static! {
        /// The run's time, in nanoseconds (loom makes one per run; a std atomic, as loom runs
        /// one thread at a time and the clock must not add branches of its own).
        static ref NOW: AtomicU64 = AtomicU64::new(0);
    }

    /// An instant of the run's logical time.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
    pub(crate) struct Instant(u64);

    impl Instant {
        pub(crate) fn now() -> Self {
            Instant(NOW.load(Ordering::Relaxed))
        }

        pub(crate) fn elapsed(&self) -> Duration {
            Self::now().duration_since(*self)
        }

        pub(crate) fn duration_since(&self, earlier: Instant) -> Duration {
            Duration::from_nanos(self.0.saturating_sub(earlier.0))
        }
    }

    /// Moves the run's time on by `d`.
    pub(super) fn advance(d: Duration) {
        NOW.fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    #[cfg(test)]
    mod loom_model {
        use super::super::pause;
        use super::*;

        /// Every run starts at zero whatever earlier runs paused, no work but a pause moves
        /// the clock, and a pause on one thread moves it for all. The two threads touch one
        /// atomic, so that loom runs the model in both orders (a model with nothing shared runs
        /// once, and would not show the clock kept from run to run).
        #[test]
        fn each_run_starts_at_zero_and_only_pauses_move_the_clock() {
            use loom::sync::atomic::AtomicUsize;
            use std::sync::Arc;
            static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            loom::model(|| {
                RUNS.fetch_add(1, Ordering::Relaxed);
                let start = Instant::now();
                assert_eq!(start, Instant(0), "the clock kept an earlier run's time");
                let mut spin = 0u64;
                for i in 0..10_000u64 {
                    spin = spin.wrapping_add(std::hint::black_box(i));
                }
                std::hint::black_box(spin);
                assert_eq!(start.elapsed(), Duration::ZERO);
                let turns = Arc::new(AtomicUsize::new(0));
                let t = {
                    let turns = turns.clone();
                    loom::thread::spawn(move || {
                        turns.fetch_add(1, Ordering::SeqCst);
                        pause(Duration::from_micros(20));
                    })
                };
                turns.fetch_add(1, Ordering::SeqCst);
                pause(Duration::from_micros(30));
                t.join().unwrap();
                assert_eq!(start.elapsed(), Duration::from_micros(50));
                assert_eq!(Instant::now().duration_since(start), Duration::from_micros(50));
            });
            assert!(RUNS.load(Ordering::Relaxed) > 1, "loom ran the model once");
        }
    }
}

/// Lets other threads make progress for about `d` (a sleep; under loom, a yield, which is what
/// lets the model checker run the thread being waited for, and `d` of the model's time).
pub(crate) fn pause(d: std::time::Duration) {
    #[cfg(loom)]
    {
        model_clock::advance(d);
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
