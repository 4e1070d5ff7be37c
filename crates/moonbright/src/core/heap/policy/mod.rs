//! Placement policy: where a request's pages come from. Each policy is a small unit behind one
//! interface (`Placement`), and the heap runs them in a fixed order over its books:
//!
//! - with no driver call (`Heap::place_pages`, `Heap::place_arena_page`): a block of a carved
//!   arena (`carve::CarvedBlock`), an exact fit (`exact::ExactFit`), a near fit
//!   (`near::NearFit`), a new carved arena (`carve::NewCarving`);
//! - feeding a plan that maps (`Heap::gather_next`), once bare chunks run out: new memory first
//!   while `Options::grow_first` allows (`grow::GrowFirst`), else the steals of `steal`, in order.
//!
//! Static dispatch only: each unit is a zero-sized type, and an order is a chain of calls the
//! compiler inlines, so a request pays for no allocation or indirect call here.

use super::{Heap, RangeId};
use crate::core::pool::ChunkId;
use crate::tags::TagId;

mod carve;
mod exact;
mod grow;
mod near;
mod steal;

pub(super) use carve::{CarvedBlock, NewCarving};
pub(super) use exact::ExactFit;
pub(super) use grow::GrowFirst;
pub(super) use near::NearFit;
pub(super) use steal::{
    BreakOwnPending, OwnPending, OwnQuarantine, StealFitting, StealOldest, WindowTail, WindowWhole,
};

/// A run of chunks in a cached range: (its cache sequence number, first chunk, one past the last).
pub(super) type CachedRun = (u64, usize, usize);

/// A request as the fast policies see it.
pub(super) struct Ask {
    /// Bytes asked for.
    pub size: u64,
    /// Pages the range needs.
    pub pages: u64,
    pub stream: u64,
    /// The request's tag (0: none). A tagged request takes no block of a carved arena: its
    /// memory must be its own, to sleep with its tag.
    pub tag: TagId,
    /// A run up to `near::SPLIT_SLACK` larger than the request, in a cached range, that the
    /// exact fit's search found on its way (for the near fit, which so needs no search).
    pub near_run: Option<CachedRun>,
}

impl Ask {
    #[inline]
    pub fn new(size: u64, pages: u64, stream: u64, tag: TagId) -> Self {
        Ask { size, pages, stream, tag, near_run: None }
    }
}

/// What a fast policy served.
pub(super) enum Placed {
    /// A range of the pages asked for (or a little more), out of every shared structure: the
    /// caller makes it the allocation, or a new arena.
    Range(RangeId),
    /// A block cut from a carved arena, live already: its pointer.
    Block(u64),
}

/// A plan gathering chunks for a new range, as the policies that feed it see it.
pub(super) struct Gather {
    pub stream: u64,
    /// The new range's length in bytes.
    pub len: u64,
    /// New memory may come in large chunks (not for growables, which shrink by whole chunks).
    pub large: bool,
    /// Pages still to find.
    pub left: u64,
    /// Chunks gathered, in order.
    pub got: Vec<ChunkId>,
    /// Those of them taken from the stream's own pending frees: (chunk, stream, epoch).
    pub same_stream: Vec<(ChunkId, u64, u64)>,
    /// Where the search for a cached range worth stealing goes on from
    /// (`steal::fitting_cached`): (seq, ranges looked at).
    pub steal_scan: (u64, usize),
}

/// What a policy feeding a plan did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gathered {
    /// Added chunks (or made bare chunks to take): take bare chunks again, then ask again.
    Took,
    /// What is left is to be made new, in one chunk: stop gathering.
    Grow,
    /// Nothing from this policy: ask the next.
    Nothing,
}

impl Gathered {
    #[inline]
    fn or_else(self, next: impl FnOnce() -> Gathered) -> Gathered {
        match self {
            Gathered::Nothing => next(),
            done => done,
        }
    }
}

/// One placement policy. A fast one serves a request with no driver call (`serve`); one that
/// feeds a plan adds chunks to it (`gather`). Each implements the one it is.
pub(super) trait Placement {
    /// Serves `ask` if this policy can, changing nothing otherwise (but `ask.near_run`).
    #[inline]
    fn serve(_heap: &mut Heap, _ask: &mut Ask) -> Option<Placed> {
        None
    }

    /// Adds chunks to `plan`, or says it grows, or that this policy has nothing for it.
    #[inline]
    fn gather(_heap: &mut Heap, _plan: &mut Gather) -> Gathered {
        Gathered::Nothing
    }
}

impl Heap {
    /// A request of a page or more with no driver call, in order: a carved arena's block, an
    /// exact fit, a near fit, a new carved arena (docs/design.md, "The life of an
    /// allocation").
    #[inline]
    pub(super) fn place_pages(&mut self, ask: &mut Ask) -> Option<Placed> {
        CarvedBlock::serve(self, ask)
            .or_else(|| ExactFit::serve(self, ask))
            .or_else(|| NearFit::serve(self, ask))
            .or_else(|| NewCarving::serve(self, ask))
    }

    /// A page for a new sub-page arena with no driver call: an exact fit, else a near fit.
    #[inline]
    pub(super) fn place_arena_page(&mut self, ask: &mut Ask) -> Option<Placed> {
        ExactFit::serve(self, ask).or_else(|| NearFit::serve(self, ask))
    }

    /// The next source of chunks for a plan that bare chunks left short, in order: new memory
    /// first within `grow_first`'s budget; else a cached range with a chunk that fits, the
    /// window's tail, the stream's own quarantined chunks, its own pending ranges that fit, a
    /// larger pending range of its own broken up, the least recently freed cached range (for a
    /// chunk to split), a whole window chunk.
    pub(super) fn gather_next(&mut self, plan: &mut Gather) -> Gathered {
        GrowFirst::gather(self, plan)
            .or_else(|| StealFitting::gather(self, plan))
            .or_else(|| WindowTail::gather(self, plan))
            .or_else(|| OwnQuarantine::gather(self, plan))
            .or_else(|| OwnPending::gather(self, plan))
            .or_else(|| BreakOwnPending::gather(self, plan))
            .or_else(|| StealOldest::gather(self, plan))
            .or_else(|| WindowWhole::gather(self, plan))
    }
}
