//! Map plans and their execution. A plan is decided under the heap lock and holds everything the
//! driver must do for one new range (release chunks to split, create chunks, map them back to
//! back, set access); `execute` runs it with no lock held and undoes its own driver effects on
//! failure, and the heap commits the outcome under the lock again.

use super::pool::ChunkId;
use crate::driver::{batched, prelude::*, ChunkHandle, DriverError};

/// What a range-making request will do with the driver.
#[derive(Debug)]
pub(crate) struct MapPlan {
    /// Identifies the plan's claims while it is in flight.
    pub id: u64,
    /// The fresh address the range goes to, and its length.
    pub va: u64,
    pub len: u64,
    /// Bytes a page.
    pub page: u64,
    /// Chunks the range reuses, in address order: (id, handle, pages).
    pub existing: Vec<(ChunkId, ChunkHandle, u64)>,
    /// Bare chunks to release first, to be recreated smaller (a split).
    pub release: Vec<(ChunkId, ChunkHandle, u64)>,
    /// Pages of the chunks to create for the range, mapped after `existing`.
    pub create: Vec<u64>,
    /// Pages of chunks to create and leave bare (what a split has left over).
    pub spare: Vec<u64>,
}

impl MapPlan {
    /// Pages this plan creates in all.
    pub fn created_pages(&self) -> u64 {
        self.create.iter().chain(&self.spare).sum()
    }
}

/// What execution did.
#[derive(Debug)]
pub(crate) struct Executed {
    /// How many of `plan.release` were released (a prefix).
    pub released: usize,
    /// Chunks created for the range, in order: (handle, pages). On failure, those that could not
    /// be released again; they go bare.
    pub created: Vec<(ChunkHandle, u64)>,
    /// Spare chunks created.
    pub spares: Vec<(ChunkHandle, u64)>,
    /// Ok, or the first failure.
    pub result: Result<(), DriverError>,
    /// On failure: the length of a mapped prefix whose unmap failed too, and how many chunks of
    /// `existing ++ created` it holds. It must be retired.
    pub stuck: Option<(u64, usize)>,
}

/// Runs a plan: releases, creates, maps and sets access, as one batch of driver calls; on
/// failure undoes its own work as far as the driver lets it.
pub(crate) fn execute(driver: &dyn Driver, plan: &MapPlan) -> Executed {
    batched(driver, || execute_calls(driver, plan))
}

fn execute_calls(driver: &dyn Driver, plan: &MapPlan) -> Executed {
    let mut ex = Executed {
        released: 0,
        created: Vec::new(),
        spares: Vec::new(),
        result: Ok(()),
        stuck: None,
    };
    for &(_, handle, _) in &plan.release {
        if let Err(e) = driver.release_chunk(handle) {
            ex.result = Err(e);
            return ex;
        }
        ex.released += 1;
    }
    for &pages in &plan.spare {
        match driver.create_chunk((pages * plan.page) as usize) {
            Ok(h) => ex.spares.push((h, pages)),
            Err(e) => {
                ex.result = Err(e);
                return ex;
            }
        }
    }
    for &pages in &plan.create {
        match driver.create_chunk((pages * plan.page) as usize) {
            Ok(h) => ex.created.push((h, pages)),
            Err(e) => {
                ex.result = Err(e);
                release_created(driver, &mut ex.created, 0);
                return ex;
            }
        }
    }
    let all = plan.existing.iter().map(|&(_, h, p)| (h, p)).chain(ex.created.iter().copied());
    let mut at = plan.va;
    let mut mapped = 0;
    let mut failure = None;
    for (h, pages) in all {
        let len = pages * plan.page;
        if let Err(e) = driver.map(at, len as usize, h) {
            failure = Some(e);
            break;
        }
        at += len;
        mapped += 1;
    }
    if failure.is_none() {
        match driver.set_access(plan.va, plan.len as usize) {
            Ok(()) => return ex,
            Err(e) => failure = Some(e),
        }
    }
    ex.result = Err(failure.expect("mapping stopped early or set access failed"));
    if mapped > 0 && driver.unmap(plan.va, (at - plan.va) as usize).is_err() {
        ex.stuck = Some((at - plan.va, mapped));
    }
    // Created chunks still mapped in a stuck prefix cannot be released; the rest can.
    let keep = ex.stuck.map_or(0, |(_, n)| n.saturating_sub(plan.existing.len()));
    release_created(driver, &mut ex.created, keep);
    ex
}

/// Releases `created[keep..]`; those whose release fails stay in the list.
fn release_created(driver: &dyn Driver, created: &mut Vec<(ChunkHandle, u64)>, keep: usize) {
    let mut kept = created[..keep].to_vec();
    for &(h, p) in &created[keep..] {
        if driver.release_chunk(h).is_err() {
            kept.push((h, p));
        }
    }
    *created = kept;
}

/// Unmaps runs of retired ranges taken out of the queue under the lock, one call each (one
/// batch of driver calls), calling `between` before every call but the first; it stops there
/// when `between` says not to go on. Returns how many were unmapped, and the error that
/// stopped it. `between` must make no driver call.
pub(crate) fn unmap_runs(
    driver: &dyn Driver,
    runs: &[super::vaspace::UnmapRun],
    between: impl Fn() -> bool,
) -> (usize, Option<DriverError>) {
    batched(driver, || unmap_runs_calls(driver, runs, between))
}

fn unmap_runs_calls(
    driver: &dyn Driver,
    runs: &[super::vaspace::UnmapRun],
    between: impl Fn() -> bool,
) -> (usize, Option<DriverError>) {
    for (i, run) in runs.iter().enumerate() {
        if i > 0 && !between() {
            return (i, None);
        }
        if let Err(e) = driver.unmap(run.va, run.len as usize) {
            return (i, Some(e));
        }
    }
    (runs.len(), None)
}

/// Unmaps every run, going on past failures (teardown: whatever can be unmapped is), as one
/// batch of driver calls. Returns how many failed, and the first error.
pub(crate) fn unmap_all(
    driver: &dyn Driver,
    runs: &[super::vaspace::UnmapRun],
) -> (usize, Option<DriverError>) {
    batched(driver, || unmap_all_calls(driver, runs))
}

fn unmap_all_calls(
    driver: &dyn Driver,
    runs: &[super::vaspace::UnmapRun],
) -> (usize, Option<DriverError>) {
    let mut failed = 0;
    let mut first = None;
    for run in runs {
        if let Err(e) = driver.unmap(run.va, run.len as usize) {
            failed += 1;
            first.get_or_insert(e);
        }
    }
    (failed, first)
}

// Not under Miri: these tests run the host backend's memfd and mmap calls (or the CUDA
// driver), which Miri cannot interpret.
#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::core::vaspace::{Retired, UnmapRun};
    use crate::driver::host::{HostConfig, HostDriver};
    use crate::driver::{CallKind, Instrumented};

    /// Three one-page ranges mapped back to back, as three runs to unmap.
    fn three_runs(d: &Instrumented<HostDriver>) -> Vec<UnmapRun> {
        let page = d.granularity() as u64;
        let base = d.reserve(3 * page as usize, 0).unwrap();
        (0..3)
            .map(|i| {
                let va = base + i * page;
                d.map(va, page as usize, d.create_chunk(page as usize).unwrap()).unwrap();
                let part = Retired { va, len: page, chunks: vec![i as u32], after: None };
                UnmapRun { va, len: page, parts: vec![part] }
            })
            .collect()
    }

    #[test]
    fn unmap_runs_calls_between_before_every_call_but_the_first_and_stops_at_a_failure() {
        let cfg = HostConfig { page_size: 64 << 10, capacity: 1 << 20, ..Default::default() };
        let d = Instrumented::new(HostDriver::new(cfg).unwrap());
        let between = Cell::new(0);
        let count = || {
            between.set(between.get() + 1);
            true
        };
        let runs = three_runs(&d);
        let (done, err) = unmap_runs(&d, &runs, count);
        assert_eq!((done, err.is_none(), between.get()), (3, true, 2));

        between.set(0);
        let runs = three_runs(&d);
        d.fail_nth(CallKind::Unmap, 2, None);
        let (done, err) = unmap_runs(&d, &runs, count);
        assert_eq!((done, err.map(|e| e.call), between.get()), (1, Some(CallKind::Unmap), 1));
    }

    #[test]
    fn unmap_runs_stops_before_a_call_when_between_says_so() {
        let cfg = HostConfig { page_size: 64 << 10, capacity: 1 << 20, ..Default::default() };
        let d = Instrumented::new(HostDriver::new(cfg).unwrap());
        let runs = three_runs(&d);
        let between = Cell::new(0);
        let (done, err) = unmap_runs(&d, &runs, || {
            between.set(between.get() + 1);
            between.get() < 2
        });
        assert_eq!((done, err.is_none(), between.get()), (2, true, 2));
        assert_eq!(d.inner().mapping_count(), 1, "the third run is still mapped");
    }

    #[test]
    fn unmap_all_goes_on_past_a_failure() {
        let cfg = HostConfig { page_size: 64 << 10, capacity: 1 << 20, ..Default::default() };
        let d = Instrumented::new(HostDriver::new(cfg).unwrap());
        let runs = three_runs(&d);
        d.fail_nth(CallKind::Unmap, 1, None);
        let (failed, err) = unmap_all(&d, &runs);
        assert_eq!((failed, err.map(|e| e.call)), (1, Some(CallKind::Unmap)));
        assert_eq!(d.inner().mapping_count(), 1, "the runs after the failed one are unmapped");
    }
}
