//! The mapped window: chunks the background mapper has already mapped, with access set, at fresh
//! addresses, so an allocation that fits costs no driver call. Most are one-page chunks in
//! segments, contiguous runs of such pages: allocations take from their front, pressure takes
//! pages back from their tail, and a large take shares the segment's id buffer (`Chunks`) rather
//! than copying it, so a hit costs the same at any size. The rest are *whole* chunks of many
//! pages, each mapped alone for requests about its size (one handle to map and unmap where
//! pages would take hundreds), taken whole. Pure bookkeeping.

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

/// A chunk of many pages mapped alone at `va`.
#[derive(Debug)]
struct Whole {
    va: u64,
    id: ChunkId,
    pages: u64,
}

/// What a take hands over: the address, the pages mapped there (a whole chunk may hold more
/// than were asked for), and their chunks in address order.
pub(crate) type Taken<C> = (u64, u64, C);

#[derive(Debug, Default)]
pub(crate) struct Window {
    page: u64,
    segments: VecDeque<Segment>,
    /// Oldest first; a few at most (each is at least `chunks.large_pages`, within the window's
    /// size).
    wholes: Vec<Whole>,
    /// Pages in segments and whole chunks together.
    pages: u64,
}

impl Window {
    pub fn new(page: u64) -> Self {
        Window { page, segments: VecDeque::new(), wholes: Vec::new(), pages: 0 }
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Takes `n` pages: the smallest whole chunk of `n` to `most` pages (the oldest of those),
    /// else a prefix of the first segment that has them (O(1) in `n` beyond `COPY_AT_MOST`).
    /// A segment it empties stays, empty, until the mapper's next `add` or `take_tail`:
    /// removing it here made the hit that empties the window slower than the others
    /// (`hitprobe --run`: 0.3-1 µs more on the host backend, 0.1-0.6 µs on the
    /// H200). A single-threaded loop does not show that cost, and why the removal costs so much
    /// right after the mapper's refill is not known.
    pub fn take(&mut self, n: u64, most: u64) -> Option<Taken<Chunks>> {
        let whole = (self.wholes.iter().enumerate())
            .filter(|(_, w)| (n..=most).contains(&w.pages))
            .min_by_key(|(i, w)| (w.pages, *i))
            .map(|(i, _)| i);
        if let Some(i) = whole {
            let (va, pages, ids) = self.remove_whole(i);
            return Some((va, pages, Chunks::from(ids)));
        }
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
        Some((va, n, chunks))
    }

    /// Takes pages back for other uses: up to `n` from the tail of the last segment that has
    /// any; with no page left in segments, the largest whole chunk of at most `n` pages.
    /// (address, pages, chunks in address order).
    pub fn take_tail(&mut self, n: u64) -> Option<Taken<Vec<ChunkId>>> {
        self.drop_empty();
        let Some(seg) = self.segments.back_mut() else {
            let i = (self.wholes.iter().enumerate())
                .filter(|(_, w)| w.pages <= n)
                .max_by_key(|(_, w)| w.pages)?
                .0;
            return Some(self.remove_whole(i));
        };
        let k = (n as usize).min(seg.len());
        let keep = seg.len() - k;
        let chunks = seg.live()[keep..].to_vec();
        let va = seg.va + keep as u64 * self.page;
        seg.end -= k;
        if seg.len() == 0 {
            self.segments.pop_back();
        }
        self.pages -= k as u64;
        Some((va, k as u64, chunks))
    }

    /// Takes back the smallest whole chunk, whatever its size (for a need it is larger than).
    pub fn take_smallest_whole(&mut self) -> Option<Taken<Vec<ChunkId>>> {
        let i = self.wholes.iter().enumerate().min_by_key(|(_, w)| w.pages)?.0;
        Some(self.remove_whole(i))
    }

    fn remove_whole(&mut self, i: usize) -> Taken<Vec<ChunkId>> {
        let w = self.wholes.remove(i);
        self.pages -= w.pages;
        (w.va, w.pages, vec![w.id])
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

    /// Adds a whole chunk of `pages` pages mapped alone at `va`.
    pub fn add_whole(&mut self, va: u64, id: ChunkId, pages: u64) {
        self.pages += pages;
        self.wholes.push(Whole { va, id, pages });
    }

    /// Every segment that holds pages, then every whole chunk, as (address, pages, chunks), for
    /// checks and teardown.
    pub fn segments(&self) -> impl Iterator<Item = Taken<Vec<ChunkId>>> + '_ {
        let segments = self.segments.iter().filter(|s| s.len() > 0);
        let segments = segments.map(|s| (s.va, s.len() as u64, s.live().to_vec()));
        segments.chain(self.wholes.iter().map(|w| (w.va, w.pages, vec![w.id])))
    }

    /// Takes everything out, as `segments` lists it.
    pub fn drain(&mut self) -> Vec<Taken<Vec<ChunkId>>> {
        let all = self.segments().collect();
        self.segments.clear();
        self.wholes.clear();
        self.pages = 0;
        all
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn take(w: &mut Window, n: u64) -> Option<(u64, Vec<ChunkId>)> {
        w.take(n, n).map(|(va, _, c)| (va, c.to_vec()))
    }

    fn tail(w: &mut Window, n: u64) -> Option<(u64, Vec<ChunkId>)> {
        w.take_tail(n).map(|(va, _, c)| (va, c))
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
        assert_eq!(tail(&mut w, 1), Some((510, vec![6])));
        assert_eq!(w.pages(), 1);
        assert_eq!(w.drain(), vec![(500, 1, vec![5])]);
    }

    #[test]
    fn large_takes_share_the_buffer_and_refills_never_change_them() {
        let n = COPY_AT_MOST as u32 + 1;
        let mut w = Window::new(1);
        w.add(0, (0..2 * n).collect());
        let (va, _, big) = w.take(n as u64, n as u64).unwrap();
        assert_eq!(va, 0);
        assert_eq!(Arc::strong_count(&w.segments[0].ids), 2, "the take shares the buffer");
        // A refill while the buffer is shared copies what is left; the taken ids stay.
        w.add(2 * n as u64, vec![1000, 1001]);
        assert_eq!(Arc::strong_count(&w.segments[0].ids), 1);
        assert_eq!(big.to_vec(), (0..n).collect::<Vec<_>>());
        w.take_tail(2);
        w.add(2 * n as u64, vec![2000]);
        let (_, _, rest) = w.take(n as u64 + 1, n as u64 + 1).unwrap();
        assert_eq!(rest.last(), Some(&2000), "the tail taken back is not served again");
        assert_eq!(rest.len(), n as usize + 1);
        assert_eq!(w.pages(), 0);
        // Small takes copy: no buffer outlives the window.
        w.add(0, vec![7, 8]);
        let (_, _, small) = w.take(1, 1).unwrap();
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
        assert_eq!(tail(&mut w, 1), None, "nothing to take back from an empty segment");
        w.add(2, vec![3]);
        assert_eq!(w.segments.len(), 1, "the refill drops it");
        w.add(9, vec![4, 5]);
        assert_eq!(take(&mut w, 2), Some((9, vec![4, 5])), "empties the last segment");
        assert_eq!(tail(&mut w, 1), Some((2, vec![3])), "from the last segment with pages");
        assert_eq!(w.drain(), vec![], "drain skips the empty segment");
    }

    #[test]
    fn an_unshared_buffer_drops_its_taken_prefix() {
        let mut w = Window::new(1);
        w.add(0, vec![1; 10]);
        for i in 0..9 {
            w.take(1, 1).unwrap();
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

    #[test]
    fn whole_chunks_serve_requests_of_about_their_size_whole() {
        let mut w = Window::new(1);
        w.add(0, vec![1, 2, 3, 4]);
        w.add_whole(100, 10, 64);
        w.add_whole(200, 11, 72);
        w.add_whole(300, 12, 64);
        assert_eq!(w.pages(), 4 + 64 + 72 + 64);
        // The smallest that fits, the oldest of equals; never a prefix of one.
        assert_eq!(w.take(64, 72).map(|(va, p, c)| (va, p, c.to_vec())), Some((100, 64, vec![10])));
        assert_eq!(w.take(66, 74).map(|(va, p, c)| (va, p, c.to_vec())), Some((200, 72, vec![11])));
        assert!(w.take(32, 36).is_none(), "no segment has 32 pages, and no whole is that small");
        assert!(w.take(100, 112).is_none(), "too large for every whole chunk");
        // Small requests still come from the segments.
        assert_eq!(take(&mut w, 2), Some((0, vec![1, 2])));
        assert_eq!(w.pages(), 2 + 64);
        assert_eq!(w.segments().collect::<Vec<_>>(), vec![(2, 2, vec![3, 4]), (300, 64, vec![12])]);
    }

    #[test]
    fn pressure_takes_pages_before_whole_chunks() {
        let mut w = Window::new(1);
        w.add_whole(100, 10, 64);
        w.add_whole(200, 11, 128);
        w.add(0, vec![1, 2]);
        assert_eq!(w.take_tail(8), Some((0, 2, vec![1, 2])), "pages first");
        assert_eq!(w.take_tail(8), None, "no whole chunk of at most 8 pages");
        w.add_whole(300, 12, 64);
        assert_eq!(w.take_tail(200), Some((200, 128, vec![11])), "the largest that fits");
        assert_eq!(w.take_smallest_whole(), Some((100, 64, vec![10])), "the smallest, oldest");
        assert_eq!(w.drain(), vec![(300, 64, vec![12])]);
        assert_eq!((w.pages(), w.take_tail(1), w.take_smallest_whole()), (0, None, None));
    }
}
