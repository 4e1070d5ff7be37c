//! The commit of a step: its marks become the [`Delta`], freed rows and pages become reusable,
//! and the delta is applied to the tables, by the kernels (`device.rs`) or, on the host backend,
//! by the reference on host copies written to the pool's memory (`Tables`: the tables' memory,
//! the last delta and its applier).

use moonbright::{Allocator, DevicePtr};

use super::PagedPool;
use crate::config::{PagedConfig, TablePointers};
use crate::delta::{Delta, TableOp, OP_BATCH, OP_BLOCK, OP_CLEAR, OP_LEN};
use crate::device::DeviceTables;
use crate::error::{PagedError, PagedResult};
use crate::reference::HostTables;

/// Who applies the deltas: kernels on the GPU, or the reference on host memory.
pub(super) enum Applier {
    Device(DeviceTables),
    Host(HostTables),
}

/// The tables' side of the pool: their memory (fixed for the pool's life), the delta of the
/// last commit, and who applies it.
pub(super) struct Tables {
    pub(super) applier: Applier,
    pub(super) ptrs: TablePointers,
    /// The step kernel's block counters (`SYNC_BYTES`, zero between launches; see kernels.cu).
    pub(super) sync: DevicePtr,
    pub(super) delta: Delta,
}

impl PagedPool<'_> {
    /// Commits the step without decode tokens: ships the delta and launches the kernels (or
    /// applies it on host memory with the host backend). Never waits for the device.
    pub fn commit_step(&mut self) -> PagedResult<&Delta> {
        self.check_usable()?;
        self.refuse_capture()?;
        self.commit(false)
    }

    /// Refuses a commit on a capturing stream, before anything changes.
    pub(super) fn refuse_capture(&self) -> PagedResult<()> {
        use moonbright::driver::prelude::*;
        if self.alloc.driver().is_capturing(self.stream).map_err(moonbright::Error::from)? {
            return Err(PagedError::StreamCapture { stream: self.stream.0 });
        }
        Ok(())
    }

    /// Turns this step's marks into the delta, returns freed rows and pages to their free sets,
    /// and applies the delta.
    pub(super) fn commit(&mut self, decode: bool) -> PagedResult<&Delta> {
        self.close_step(decode);
        self.apply_delta()?;
        Ok(&self.tables.delta)
    }

    /// Turns this step's marks into the delta and returns freed rows and pages to their free
    /// sets: the host side of a commit. Cannot fail.
    pub(super) fn close_step(&mut self, decode: bool) {
        let m = self.cfg.max_pages_per_seq;
        let d = &mut self.tables.delta;
        d.clear();
        for &row in &self.marks.blk_rows {
            let r = row as usize;
            let pages = self.rows.pages.get(r);
            let (lo, hi) = (self.rows.hot[r].blk_lo, self.rows.hot[r].blk_hi);
            // Columns the row holds get their page; those past its end are cleared in one op.
            let held = (pages.len() as u32).clamp(lo, hi);
            for c in lo..held {
                let value = pages[c as usize] as i32;
                d.ops.push(TableOp { kind: OP_BLOCK, index: row * m + c, value });
            }
            if held < hi {
                let index = row * m + held;
                d.ops.push(TableOp { kind: OP_CLEAR, index, value: (hi - held) as i32 });
            }
        }
        for &row in &self.marks.len_rows {
            let r = row as usize;
            // The decode kernel adds the decode token itself. A freed row's length is 0.
            let len = self.rows.hot[r].len_rel.wrapping_add(self.phases.decodes);
            let value = if self.rows.live[r] { len - decode as u32 } else { 0 };
            d.ops.push(TableOp { kind: OP_LEN, index: row, value: value as i32 });
        }
        for &i in &self.marks.bat_idx {
            if let Some(&row) = self.rows.batch.get(i as usize) {
                d.ops.push(TableOp { kind: OP_BATCH, index: i, value: row as i32 });
            }
        }
        std::mem::swap(&mut d.runs, &mut self.marks.runs);
        std::mem::swap(&mut d.copies, &mut self.marks.copies);
        d.explicit_tokens = self.marks.explicit_tokens;
        d.decode_rows = if decode { self.rows.batch.len() as u32 } else { 0 };
        // The step is closed: its freed rows and pages become reusable.
        for row in self.rows.pending_rows.drain(..) {
            self.rows.free_rows.insert(row);
        }
        for p in self.page_books.pending_pages.drain(..) {
            self.page_books.free_pages.insert(p);
        }
        self.marks.step = self.marks.step.wrapping_add(1).max(1);
        if self.marks.step == 1 {
            // The stamps wrapped around: forget them all.
            self.rows.hot.iter_mut().for_each(|h| h.blk_stamp = 0);
            self.marks.len_stamp.iter_mut().for_each(|s| *s = 0);
            self.marks.bat_stamp.iter_mut().for_each(|s| *s = 0);
            self.marks.token_stamp.iter_mut().for_each(|s| *s = 0);
        }
        self.marks.blk_rows.clear();
        self.marks.len_rows.clear();
        self.marks.bat_idx.clear();
        self.marks.runs.clear();
        self.marks.copies.clear();
        self.marks.copied_from.clear();
        self.marks.explicit_tokens = 0;
    }

    /// Ships the delta of [`close_step`](Self::close_step) to the tables (kernels, or the host
    /// reference). A failure poisons the pool.
    pub(super) fn apply_delta(&mut self) -> PagedResult<()> {
        let applied = match &mut self.tables.applier {
            Applier::Device(t) => t
                .launch(&self.tables.delta, &self.tables.ptrs, &self.cfg)
                .map_err(PagedError::Device),
            Applier::Host(h) => {
                apply_on_host(self.alloc, h, &self.tables.delta, &self.tables.ptrs, &self.cfg)
            }
        };
        if let Err(e) = applied {
            self.poisoned = Some(e.to_string());
            return Err(e);
        }
        Ok(())
    }
}

/// The host backend's "kernels": the reference applied to host copies, written to the pool's
/// memory, and page copies through the allocator.
fn apply_on_host(
    alloc: &Allocator,
    h: &mut HostTables,
    d: &Delta,
    ptrs: &TablePointers,
    cfg: &PagedConfig,
) -> PagedResult<()> {
    let pb = cfg.page_bytes();
    let mut buf = vec![0u8; pb];
    for c in &d.copies {
        alloc.read(ptrs.pages + c.src as u64 * pb as u64, &mut buf)?;
        alloc.write(ptrs.pages + c.dst as u64 * pb as u64, &buf)?;
    }
    h.apply(d);
    let bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    alloc.write(ptrs.block_table, &bytes(&h.block_table))?;
    alloc.write(ptrs.seq_lens, &bytes(&h.seq_lens))?;
    alloc.write(ptrs.batch_rows, &bytes(&h.batch_rows))?;
    let slots: Vec<u8> = h.slot_mapping.iter().flat_map(|x| x.to_le_bytes()).collect();
    alloc.write(ptrs.slot_mapping, &slots)?;
    Ok(())
}
