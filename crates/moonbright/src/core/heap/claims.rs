//! Work in flight without the heap lock, and what it holds out of the shared books: plans and
//! releases (their chunks and addresses, and the pages they create), chunks quarantined until
//! their stream's work has passed them, unmap batches, and frees' own event records.

// Keys are plan ids: a fast hash, not a DoS-resistant one.
use foldhash::HashMap;

use crate::core::pool::ChunkId;

/// What a plan in flight, or a release in flight, holds until it commits.
#[derive(Debug, Default)]
pub(super) struct Claim {
    /// Chunks neither bare nor in a range meanwhile.
    pub(super) chunks: Vec<ChunkId>,
    /// The plan's fresh addresses (va, len); none for a release.
    pub(super) va: Option<(u64, u64)>,
    /// Chunks it took from its stream's pending frees: (chunk, stream, epoch). If the plan
    /// fails they are quarantined, not made bare.
    pub(super) same_stream: Vec<(ChunkId, u64, u64)>,
}

#[derive(Debug, Default)]
pub(super) struct Claims {
    /// What plans and releases in flight hold, by plan id.
    pub(super) plans: HashMap<u64, Claim>,
    /// Pages the plans in flight create: held already, for the cap.
    pub(super) create_pages: u64,
    pub(super) next_id: u64,
    /// Chunks that only become bare once their stream's epoch has completed:
    /// (chunk, stream, epoch).
    pub(super) quarantine: Vec<(ChunkId, u64, u64)>,
    /// Retired runs being unmapped with the lock released.
    pub(super) unmapping: usize,
    /// Those of them inside growables' private reservations: (va, len).
    pub(super) unmapping_private: Vec<(u64, u64)>,
    /// Frees on streams (and shrinks) whose own event records are still to be settled: until
    /// then their pages are neither free nor covered by an event anyone could wait for.
    pub(super) records_in_flight: u32,
}

impl Claims {
    /// Registers a claim under a new id, returned.
    pub(super) fn add(&mut self, claim: Claim) -> u64 {
        let id = self.new_id();
        self.plans.insert(id, claim);
        id
    }

    /// A new plan id.
    pub(super) fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Whether some plan holds claimed chunks or addresses while it runs, or a free's own event
    /// record is still to be settled.
    pub(super) fn any(&self) -> bool {
        !self.plans.is_empty() || self.records_in_flight > 0
    }
}
