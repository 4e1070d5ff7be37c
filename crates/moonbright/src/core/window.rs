//! The mapped window: one-page chunks the background mapper has already mapped, with access set,
//! at fresh addresses, so an allocation that fits takes a prefix of a segment and costs no driver
//! call. Segments are contiguous runs of such pages; allocations take from their front, pressure
//! takes pages back from their tail. A large take shares the segment's id buffer (`Chunks`) rather
//! than copying it, so a hit costs the same at any size. Pure bookkeeping.

use std::collections::VecDeque;
use std::sync::Arc;

use super::chunks::Chunks;
use super::pool::ChunkId;

/// Takes of up to this many pages (a 64-byte line of ids) copy their ids; larger ones share the
/// segment's id buffer, so a hit costs the same at any size.
const COPY_AT_MOST: usize = 16;

/// Pages mapped back to back from `va`: the ids `ids[start..end]`. Ids before `start` were taken
/// by allocations, which may still share the buffer; they are never changed while shared.
#[derive(Debug)]
struct Segment {
    va: u64,
    ids: Arc<Vec<ChunkId>>,
    start: usize,
    end: usize,
}

impl Segment {
    fn len(&self) -> usize {
        self.end - self.start
    }

    fn live(&self) -> &[ChunkId] {
        &self.ids[self.start..self.end]
    }

    /// Appends the ids of pages mapped right after the segment. Copies what is left of the
    /// buffer if an allocation still shares it (the mapper's work, not a request's).
    fn append(&mut self, more: Vec<ChunkId>) {
        match Arc::get_mut(&mut self.ids) {
            Some(v) => {
                v.truncate(self.end);
                if self.start > v.len() / 2 {
                    // Drop the taken prefix so the buffer does not grow without bound.
                    v.drain(..self.start);
                    self.start = 0;
                }
                v.extend(more);
                self.end = v.len();
            }
            None => {
                let mut v = Vec::with_capacity(2 * (self.len() + more.len()));
                v.extend_from_slice(self.live());
                v.extend(more);
                self.end = v.len();
                self.start = 0;
                self.ids = Arc::new(v);
            }
        }
    }
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

    /// Takes `n` pages from the first segment that has them: (address, chunks). O(1) in `n`
    /// beyond `COPY_AT_MOST`. A segment it empties stays, empty, until the mapper's next `add`
    /// or `take_tail`: removing it here made the hit that empties the window slower than the
    /// others (`hitprobe --run`, session 19: 0.3-1 µs more on the host backend, 0.1-0.6 µs on
    /// the H200). A single-threaded loop does not show that cost, and why the removal costs
    /// so much right after the mapper's refill is not known.
    pub fn take(&mut self, n: u64) -> Option<(u64, Chunks)> {
        let i = self.segments.iter().position(|s| s.len() as u64 >= n)?;
        let seg = &mut self.segments[i];
        let (va, k) = (seg.va, n as usize);
        let chunks = if k <= COPY_AT_MOST {
            Chunks::from(seg.ids[seg.start..seg.start + k].to_vec())
        } else {
            Chunks::shared(&seg.ids, seg.start, k)
        };
        seg.start += k;
        seg.va += n * self.page;
        self.pages -= n;
        Some((va, chunks))
    }

    /// Takes up to `n` pages back from the tail of the last segment that has any, for other
    /// uses: (address of the first page taken, chunks in address order).
    pub fn take_tail(&mut self, n: u64) -> Option<(u64, Vec<ChunkId>)> {
        self.drop_empty();
        let seg = self.segments.back_mut()?;
        let k = (n as usize).min(seg.len());
        let keep = seg.len() - k;
        let chunks = seg.live()[keep..].to_vec();
        let va = seg.va + keep as u64 * self.page;
        seg.end -= k;
        if seg.len() == 0 {
            self.segments.pop_back();
        }
        self.pages -= k as u64;
        Some((va, chunks))
    }

    /// Forgets the segments `take` emptied (the mapper's work, not a request's).
    fn drop_empty(&mut self) {
        self.segments.retain(|s| s.len() > 0);
    }

    /// Adds pages mapped at `va`; they extend the last segment when they follow it.
    pub fn add(&mut self, va: u64, chunks: Vec<ChunkId>) {
        if chunks.is_empty() {
            return;
        }
        self.drop_empty();
        self.pages += chunks.len() as u64;
        if let Some(last) = self.segments.back_mut() {
            if last.va + last.len() as u64 * self.page == va {
                last.append(chunks);
                return;
            }
        }
        let end = chunks.len();
        self.segments.push_back(Segment { va, ids: Arc::new(chunks), start: 0, end });
    }

    /// Every segment that holds pages, as (address, chunks), for checks and teardown.
    pub fn segments(&self) -> impl Iterator<Item = (u64, Vec<ChunkId>)> + '_ {
        self.segments.iter().filter(|s| s.len() > 0).map(|s| (s.va, s.live().to_vec()))
    }

    /// Takes every segment out.
    pub fn drain(&mut self) -> Vec<(u64, Vec<ChunkId>)> {
        self.pages = 0;
        self.segments.drain(..).filter(|s| s.len() > 0).map(|s| (s.va, s.live().to_vec())).collect()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn take(w: &mut Window, n: u64) -> Option<(u64, Vec<ChunkId>)> {
        w.take(n).map(|(va, c)| (va, c.to_vec()))
    }

    #[test]
    fn takes_prefixes_and_extends_contiguous_refills() {
        let mut w = Window::new(10);
        w.add(100, vec![1, 2, 3]);
        w.add(130, vec![4]); // follows: one segment of four
        w.add(500, vec![5, 6]);
        assert_eq!(w.pages(), 6);
        assert_eq!(take(&mut w, 2), Some((100, vec![1, 2])));
        assert_eq!(take(&mut w, 3), None, "no segment has three pages left");
        assert_eq!(take(&mut w, 2), Some((120, vec![3, 4])));
        assert_eq!(w.take_tail(1), Some((510, vec![6])));
        assert_eq!(w.pages(), 1);
        assert_eq!(w.drain(), vec![(500, vec![5])]);
    }

    #[test]
    fn large_takes_share_the_buffer_and_refills_never_change_them() {
        let n = COPY_AT_MOST as u32 + 1;
        let mut w = Window::new(1);
        w.add(0, (0..2 * n).collect());
        let (va, big) = w.take(n as u64).unwrap();
        assert_eq!(va, 0);
        assert_eq!(Arc::strong_count(&w.segments[0].ids), 2, "the take shares the buffer");
        // A refill while the buffer is shared copies what is left; the taken ids stay.
        w.add(2 * n as u64, vec![1000, 1001]);
        assert_eq!(Arc::strong_count(&w.segments[0].ids), 1);
        assert_eq!(big.to_vec(), (0..n).collect::<Vec<_>>());
        w.take_tail(2);
        w.add(2 * n as u64, vec![2000]);
        let (_, rest) = w.take(n as u64 + 1).unwrap();
        assert_eq!(rest.last(), Some(&2000), "the tail taken back is not served again");
        assert_eq!(rest.len(), n as usize + 1);
        assert_eq!(w.pages(), 0);
        // Small takes copy: no buffer outlives the window.
        w.add(0, vec![7, 8]);
        let (_, small) = w.take(1).unwrap();
        assert_eq!(Arc::strong_count(&w.segments[0].ids), 1);
        assert_eq!(&*small, &[7]);
    }

    #[test]
    fn an_emptied_segment_waits_for_the_mapper() {
        let mut w = Window::new(1);
        w.add(0, vec![1, 2]);
        assert_eq!(take(&mut w, 2), Some((0, vec![1, 2])));
        assert_eq!(w.segments.len(), 1, "the hit leaves the empty segment in place");
        assert_eq!((w.pages(), w.segments().count()), (0, 0));
        assert_eq!(take(&mut w, 1), None);
        assert_eq!(w.take_tail(1), None, "nothing to take back from an empty segment");
        w.add(2, vec![3]);
        assert_eq!(w.segments.len(), 1, "the refill drops it");
        w.add(9, vec![4, 5]);
        assert_eq!(take(&mut w, 2), Some((9, vec![4, 5])), "empties the last segment");
        assert_eq!(w.take_tail(1), Some((2, vec![3])), "from the last segment with pages");
        assert_eq!(w.drain(), vec![], "drain skips the empty segment");
    }

    #[test]
    fn an_unshared_buffer_drops_its_taken_prefix() {
        let mut w = Window::new(1);
        w.add(0, vec![1; 10]);
        for i in 0..9 {
            w.take(1).unwrap();
            w.add(10 + i, vec![2]);
        }
        let seg = &w.segments[0];
        assert!(
            seg.ids.len() <= 2 * seg.len() + 1,
            "buffer {} for {} ids",
            seg.ids.len(),
            seg.len()
        );
        assert_eq!(w.pages(), 10);
    }
}
