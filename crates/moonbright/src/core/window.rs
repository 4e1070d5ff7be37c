//! The mapped window: one-page chunks the background mapper has already mapped, with access set,
//! at fresh addresses, so an allocation that fits takes a prefix of a segment and costs no driver
//! call. Segments are contiguous runs of such pages; allocations take from their front, pressure
//! takes pages back from their tail. Pure bookkeeping.

use std::collections::VecDeque;

use super::pool::ChunkId;

#[derive(Debug)]
struct Segment {
    va: u64,
    /// One-page chunks mapped at `va`, `va + page`, ...
    chunks: VecDeque<ChunkId>,
}

#[derive(Debug, Default)]
pub(crate) struct Window {
    page: u64,
    segments: VecDeque<Segment>,
    pages: u64,
}

impl Window {
    pub fn new(page: u64) -> Self {
        Window { page, segments: VecDeque::new(), pages: 0 }
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Takes `n` pages from the first segment that has them: (address, chunks).
    pub fn take(&mut self, n: u64) -> Option<(u64, Vec<ChunkId>)> {
        let i = self.segments.iter().position(|s| s.chunks.len() as u64 >= n)?;
        let seg = &mut self.segments[i];
        let va = seg.va;
        let chunks = front(&mut seg.chunks, n as usize);
        seg.va += n * self.page;
        if seg.chunks.is_empty() {
            self.segments.remove(i);
        }
        self.pages -= n;
        Some((va, chunks))
    }

    /// Takes up to `n` pages back from the tail of the last segment, for other uses: (address of
    /// the first page taken, chunks in address order).
    pub fn take_tail(&mut self, n: u64) -> Option<(u64, Vec<ChunkId>)> {
        let seg = self.segments.back_mut()?;
        let k = (n as usize).min(seg.chunks.len());
        let start = seg.chunks.len() - k;
        let chunks: Vec<ChunkId> = seg.chunks.drain(start..).collect();
        let va = seg.va + start as u64 * self.page;
        if seg.chunks.is_empty() {
            self.segments.pop_back();
        }
        self.pages -= k as u64;
        Some((va, chunks))
    }

    /// Adds pages mapped at `va`; they extend the last segment when they follow it.
    pub fn add(&mut self, va: u64, chunks: Vec<ChunkId>) {
        if chunks.is_empty() {
            return;
        }
        self.pages += chunks.len() as u64;
        if let Some(last) = self.segments.back_mut() {
            if last.va + last.chunks.len() as u64 * self.page == va {
                last.chunks.extend(chunks);
                return;
            }
        }
        self.segments.push_back(Segment { va, chunks: chunks.into() });
    }

    /// Every segment as (address, chunks), for checks and teardown.
    pub fn segments(&self) -> impl Iterator<Item = (u64, Vec<ChunkId>)> + '_ {
        self.segments.iter().map(|s| (s.va, s.chunks.iter().copied().collect()))
    }

    /// Takes every segment out.
    pub fn drain(&mut self) -> Vec<(u64, Vec<ChunkId>)> {
        self.pages = 0;
        self.segments.drain(..).map(|s| (s.va, s.chunks.into())).collect()
    }
}

/// Takes the first `n` ids out of `ids`: two slice copies and an O(1) drain (`ChunkId` is
/// `Copy`), not an iterator over each id. A 1 GiB window hit moves 512 ids, an 8 GiB one 4,096,
/// so this is most of a large hit's cost.
fn front(ids: &mut VecDeque<ChunkId>, n: usize) -> Vec<ChunkId> {
    let (a, b) = ids.as_slices();
    let k = n.min(a.len());
    let mut out = Vec::with_capacity(n);
    out.extend_from_slice(&a[..k]);
    out.extend_from_slice(&b[..n - k]);
    ids.drain(..n);
    out
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn takes_prefixes_and_extends_contiguous_refills() {
        let mut w = Window::new(10);
        w.add(100, vec![1, 2, 3]);
        w.add(130, vec![4]); // follows: one segment of four
        w.add(500, vec![5, 6]);
        assert_eq!(w.pages(), 6);
        assert_eq!(w.take(2), Some((100, vec![1, 2])));
        assert_eq!(w.take(3), None, "no segment has three pages left");
        assert_eq!(w.take(2), Some((120, vec![3, 4])));
        assert_eq!(w.take_tail(1), Some((510, vec![6])));
        assert_eq!(w.pages(), 1);
        assert_eq!(w.drain(), vec![(500, vec![5])]);
    }

    #[test]
    fn front_takes_across_the_deque_wrap() {
        let mut d: VecDeque<ChunkId> = VecDeque::with_capacity(4);
        d.extend([9, 9, 1, 2]);
        d.drain(..2);
        d.extend([3, 4]); // wraps around the ring buffer
        assert!(!d.as_slices().1.is_empty(), "the test needs a wrapped deque");
        assert_eq!(front(&mut d, 3), vec![1, 2, 3]);
        assert_eq!(d, [4]);
    }
}
