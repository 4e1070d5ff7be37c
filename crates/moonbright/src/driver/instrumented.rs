//! [`Instrumented`]: a wrapper of any driver that counts its calls by kind (per driver and per
//! thread), times the virtual-memory calls, and fails planned calls (fault injection). Its
//! forwarding of each trait is generated from that trait's list (`forward_calls!`).

use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::Mutex;

use super::{code, CallCounts, CallKind, CallTimes, DriverError, DriverResult};

// The calls each thread made through any `Instrumented` driver, and the time in its timed
// ones: how a replay tells a slow request's own calls from those other threads made beside it.
// Cells, not a `RefCell`: every call (the capture query of a cache hit too) adds to them.
#[cfg(not(loom))]
thread_local! {
    static THREAD_COUNTS: [std::cell::Cell<u64>; CallKind::ALL.len()] =
        const { [const { std::cell::Cell::new(0) }; CallKind::ALL.len()] };
    static THREAD_NS: [std::cell::Cell<u64>; CallKind::ALL.len()] =
        const { [const { std::cell::Cell::new(0) }; CallKind::ALL.len()] };
}

/// Adds `n` to a thread's counter of kind `kind`.
#[cfg(not(loom))]
fn add_to(cells: &[std::cell::Cell<u64>; CallKind::ALL.len()], kind: CallKind, n: u64) {
    let c = &cells[kind as usize];
    c.set(c.get() + n);
}

/// The calls the calling thread has made so far through any [`Instrumented`] driver, and the
/// time in its virtual-memory calls (the maximum is not kept). All zero under loom.
pub fn thread_calls() -> (CallCounts, CallTimes) {
    #[cfg(not(loom))]
    {
        let mut counts = CallCounts::default();
        let mut times = CallTimes::default();
        THREAD_COUNTS.with(|c| counts.0 = std::array::from_fn(|k| c[k].get()));
        THREAD_NS.with(|c| times.total_ns = std::array::from_fn(|k| c[k].get()));
        (counts, times)
    }
    #[cfg(loom)]
    {
        Default::default()
    }
}

/// A planned failure: the `nth` next call of `kind` (1 = the very next) fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PlannedFailure {
    kind: CallKind,
    remaining: u64,
    code: i32,
}

/// Wraps a backend: counts every call by kind and fails planned calls.
///
/// Counting is lock-free (one atomic per kind). Planned failures sit behind a mutex that is taken
/// only while at least one failure is planned, so the common path pays one atomic load.
#[derive(Debug)]
pub struct Instrumented<D> {
    /// The wrapped backend (`pub(super)`: the forwarding lists' impls call it).
    pub(super) inner: D,
    counts: [AtomicU64; CallKind::ALL.len()],
    /// Nanoseconds in timed calls, total and longest (not kept under loom).
    #[cfg(not(loom))]
    nanos: [(AtomicU64, AtomicU64); CallKind::ALL.len()],
    armed: AtomicU64,
    plans: Mutex<Vec<PlannedFailure>>,
}

impl<D> Instrumented<D> {
    /// Wraps `inner`.
    pub fn new(inner: D) -> Self {
        Instrumented {
            inner,
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            #[cfg(not(loom))]
            nanos: std::array::from_fn(|_| (AtomicU64::new(0), AtomicU64::new(0))),
            armed: AtomicU64::new(0),
            plans: Mutex::new(Vec::new()),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Calls made so far, by kind.
    pub fn counts(&self) -> CallCounts {
        let mut out = CallCounts::default();
        for k in CallKind::ALL {
            out.0[k as usize] = self.counts[k as usize].load(Ordering::Relaxed);
        }
        out
    }

    /// Time spent in the virtual-memory calls so far (all zero under loom).
    pub fn times(&self) -> CallTimes {
        #[cfg_attr(loom, allow(unused_mut))]
        let mut out = CallTimes::default();
        #[cfg(not(loom))]
        for k in CallKind::ALL {
            let (total, max) = &self.nanos[k as usize];
            out.total_ns[k as usize] = total.load(Ordering::Relaxed);
            out.max_ns[k as usize] = max.load(Ordering::Relaxed);
        }
        out
    }

    /// Counts a call of `kind` and, unless it is planned to fail, runs it: how the forwarding
    /// lists' `=> counted(Kind)` calls go.
    #[inline]
    pub(super) fn counted<T>(
        &self,
        kind: CallKind,
        call: impl FnOnce() -> DriverResult<T>,
    ) -> DriverResult<T> {
        self.enter(kind)?;
        call()
    }

    /// As [`Self::counted`], and adds the call's duration to the kind's total and maximum: how
    /// the forwarding lists' `=> timed(Kind)` calls (the virtual-memory calls) go.
    #[inline]
    pub(super) fn timed<T>(
        &self,
        kind: CallKind,
        call: impl FnOnce() -> DriverResult<T>,
    ) -> DriverResult<T> {
        self.enter(kind)?;
        self.time(kind, call)
    }

    /// Runs a virtual-memory call, adding its duration to the kind's total and maximum.
    #[inline]
    fn time<T>(&self, kind: CallKind, call: impl FnOnce() -> DriverResult<T>) -> DriverResult<T> {
        #[cfg(not(loom))]
        {
            let start = std::time::Instant::now();
            let r = call();
            let ns = start.elapsed().as_nanos() as u64;
            THREAD_NS.with(|c| add_to(c, kind, ns));
            let (total, max) = &self.nanos[kind as usize];
            total.fetch_add(ns, Ordering::Relaxed);
            // A compare-and-swap loop only when this call is a new maximum.
            if ns > max.load(Ordering::Relaxed) {
                max.fetch_max(ns, Ordering::Relaxed);
            }
            r
        }
        #[cfg(loom)]
        {
            let _ = kind;
            call()
        }
    }

    /// Makes the `nth` next call of `kind` (1 = the next one) fail with `CUDA_ERROR_UNKNOWN`,
    /// or with `error_code` when given (for example `code::OUT_OF_MEMORY`).
    pub fn fail_nth(&self, kind: CallKind, nth: u64, error_code: Option<i32>) {
        assert!(nth >= 1, "fail_nth counts from 1");
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        plans.push(PlannedFailure {
            kind,
            remaining: nth,
            code: error_code.unwrap_or(code::UNKNOWN),
        });
        self.armed.store(plans.len() as u64, Ordering::SeqCst);
    }

    /// Forgets every planned failure that has not fired.
    pub fn clear_failures(&self) {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        plans.clear();
        self.armed.store(0, Ordering::SeqCst);
    }

    /// Counts the call and decides whether it is one planned to fail.
    fn enter(&self, kind: CallKind) -> DriverResult<()> {
        self.counts[kind as usize].fetch_add(1, Ordering::Relaxed);
        #[cfg(not(loom))]
        THREAD_COUNTS.with(|c| add_to(c, kind, 1));
        if self.armed.load(Ordering::SeqCst) == 0 {
            return Ok(());
        }
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        // Every plan of this kind counts the call; all that reach zero fire together, as one
        // failure of this call.
        let mut fired = None;
        plans.retain_mut(|plan| {
            if plan.kind != kind {
                return true;
            }
            plan.remaining -= 1;
            if plan.remaining == 0 {
                fired.get_or_insert(plan.code);
                return false;
            }
            true
        });
        self.armed.store(plans.len() as u64, Ordering::SeqCst);
        match fired {
            Some(code) => Err(DriverError::new(kind, code, "injected failure")),
            None => Ok(()),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::driver::host;
    use crate::driver::prelude::*;

    /// A thread's own counts take its calls through any instrumented driver, and not another
    /// thread's.
    #[cfg(not(miri))]
    #[test]
    fn thread_calls_count_only_the_calling_threads_calls() {
        let d = Instrumented::new(
            host::HostDriver::new(host::HostConfig {
                page_size: 64 << 10,
                capacity: 1 << 20,
                ..Default::default()
            })
            .unwrap(),
        );
        let (before, _) = thread_calls();
        let h = d.create_chunk(64 << 10).unwrap();
        let other = std::thread::scope(|s| s.spawn(|| d.create_chunk(64 << 10).unwrap()).join());
        let (after, times) = thread_calls();
        let mine = after.since(&before);
        assert_eq!((mine.get(CallKind::Create), d.counts().get(CallKind::Create)), (1, 2));
        assert!(times.total_ns[CallKind::Create as usize] > 0);
        d.release_chunk(h).unwrap();
        d.release_chunk(other.unwrap()).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "the host backend's memfd and mmap calls are outside Miri")]
    fn vmm_calls_are_timed_and_others_are_not() {
        let cfg = host::HostConfig { page_size: 64 << 10, capacity: 1 << 20, ..Default::default() };
        let d = Instrumented::new(host::HostDriver::new(cfg).unwrap());
        let h = d.create_chunk(64 << 10).unwrap();
        let va = d.reserve(128 << 10, 0).unwrap();
        d.map(va, 64 << 10, h).unwrap();
        d.map(va + (64 << 10), 64 << 10, h).unwrap();
        d.create_stream().unwrap();
        let t = d.times();
        let map = CallKind::Map as usize;
        assert!(t.max_ns[map] > 0 && t.max_ns[map] <= t.total_ns[map]);
        assert!(t.total_ns[CallKind::Create as usize] > 0);
        assert_eq!(t.total_ns[CallKind::StreamCreate as usize], 0);
        assert!(CallTimes::timed(CallKind::SetAccess) && !CallTimes::timed(CallKind::EventRecord));
    }
}
