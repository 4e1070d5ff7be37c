//! Statistics in PyTorch's shape: each figure has current / peak / allocated (cumulative
//! increases) / freed (cumulative decreases). Updated under the allocator's lock.

use crate::driver::CallCounts;

/// One statistic: current value, peak, and cumulative increases and decreases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Now.
    pub current: u64,
    /// Highest `current` since creation or the last peak reset.
    pub peak: u64,
    /// Sum of all increases.
    pub allocated: u64,
    /// Sum of all decreases.
    pub freed: u64,
}

impl Stat {
    pub(crate) fn add(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    pub(crate) fn sub(&mut self, n: u64) {
        debug_assert!(self.current >= n, "statistic would go negative");
        self.current -= n;
        self.freed += n;
    }

    pub(crate) fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// Where held memory went when it last reached its peak (`Stats::held_at_peak`), in bytes that
/// add up to `reserved`: taken at the first allocation after held memory rose to a new peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldAtPeak {
    /// Held memory (`reserved_bytes`) then.
    pub reserved: u64,
    /// Live allocations, as requested.
    pub requested: u64,
    /// Their rounding: to 256 bytes below a page, to whole pages from a page up.
    pub rounding: u64,
    /// Free space inside sub-page and carved arenas, whose pages live blocks share.
    pub arena_free: u64,
    /// Freed ranges kept mapped in the cache.
    pub cached: u64,
    /// Freed ranges still pending on their streams (their work, or the event that tells it
    /// has completed, still to come).
    pub pending: u64,
    /// The background mapper's window.
    pub window: u64,
    /// Chunks mapped nowhere.
    pub bare: u64,
    /// The rest: chunks of plans in flight, quarantined for a stream, or mapped only by ranges
    /// waiting for their unmap.
    pub other: u64,
}

impl HeldAtPeak {
    /// The parts, named, in bytes: they add up to `reserved`.
    pub fn parts(&self) -> [(&'static str, u64); 8] {
        [
            ("requested", self.requested),
            ("rounding", self.rounding),
            ("arena_free", self.arena_free),
            ("cached", self.cached),
            ("pending", self.pending),
            ("window", self.window),
            ("bare", self.bare),
            ("other", self.other),
        ]
    }
}

/// A snapshot of an allocator's statistics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes of live allocations, as requested.
    pub allocated_bytes: Stat,
    /// Bytes of physical memory held (chunks created and not released).
    pub reserved_bytes: Stat,
    /// Bytes of live allocations after rounding (to 256 B below a page, to pages above).
    pub active_bytes: Stat,
    /// Rounded minus requested bytes of live allocations: the cost of rounding.
    pub rounding_waste_bytes: Stat,
    /// Virtual bytes mapped (live, cached and retired ranges).
    pub mapped_bytes: Stat,
    /// Chunk mappings in place (live, cached and retired ranges): what set access and unmap cost.
    pub mapped_handles: Stat,
    /// Live allocations.
    pub allocations: Stat,
    /// Physical chunks held.
    pub chunks: Stat,
    /// One-page chunks the background mapper holds mapped, ready to serve allocations.
    pub window_bytes: Stat,
    /// Freed ranges kept mapped for reuse as they are.
    pub cached_ranges: Stat,
    /// Ranges waiting for their unmap.
    pub retired_ranges: Stat,
    /// Bytes of ranges whose tag is asleep: unmapped, their memory given back, their addresses
    /// kept (their allocations still count in `allocated_bytes` and `active_bytes`).
    pub asleep_bytes: Stat,
    /// Bytes of pages committed to growable allocations (also counted in `active_bytes`, and
    /// their sizes in `allocated_bytes`).
    pub growable_committed_bytes: Stat,
    /// Resizes of growable allocations that mapped or gave back pages (none of them copies).
    pub growable_resizes: u64,
    /// Tails given back by a shrink and taken back, still mapped, by a later growth.
    pub growable_reclaims: u64,
    /// Allocations served by a cached range without any driver call.
    pub cache_hits: u64,
    /// Allocations served from the mapped window without any driver call.
    pub window_hits: u64,
    /// Allocations served from a sub-page arena.
    pub subpage_allocations: u64,
    /// Allocations of a page or more served from a carved arena (`Options::carve`), and cached
    /// ranges made carved arenas.
    pub carved_allocations: u64,
    pub carved_arenas: u64,
    /// Whole chunks that no block used, cut out of carved arenas back into the cache.
    pub carved_chunks_uncarved: u64,
    /// Events the background worker has created ahead of need and no free has taken yet.
    pub events_stocked: u64,
    /// Allocation requests that mapped a range of their own, synchronously (every other request
    /// of a page or more was a cache or window hit). Growable resizes are not counted here.
    pub request_maps: u64,
    /// Chunk handles those requests mapped: each costs one set-access share (about 25 us on an
    /// H200), the dominant cost of a synchronous map.
    pub request_mapped_handles: u64,
    /// Chunks those requests created or released (splits included).
    pub request_created_chunks: u64,
    pub request_released_chunks: u64,
    /// Plans that had to unmap retired ranges before going on: to reuse their addresses, or to
    /// split a chunk they still map. The request makes those unmap calls itself: the whole
    /// batch, or for a split only the ranges that still map its chunk when they can all go now.
    pub flushes_for_addresses: u64,
    pub flushes_for_split: u64,
    /// Flushes (of either kind) that unmapped only the ranges mapping the chunk to split.
    pub targeted_flushes: u64,
    /// Cached ranges broken up to reuse their pages elsewhere.
    pub cached_ranges_stolen: u64,
    /// Cached ranges split at a chunk boundary to serve a smaller request (no driver call);
    /// a run taken across joined neighbours counts in `cached_ranges_joined` only.
    pub cached_ranges_split: u64,
    /// Cached ranges joined to a neighbour to serve a request that no one of them could
    /// (`Heap::split_joined`): one count per join, so joining three ranges counts two.
    pub cached_ranges_joined: u64,
    /// Chunks released and recreated smaller under pressure.
    pub chunk_splits: u64,
    /// Unmap batches flushed.
    pub unmap_batches: u64,
    /// `cuMemUnmap` calls made by unmap batches.
    pub unmap_calls_in_batches: u64,
    /// Requests refused for lack of memory.
    pub num_ooms: u64,
    /// Times the host waited for streams' pending frees to complete: a request short of memory,
    /// or `empty_cache` with frees pending (PyTorch's `num_sync_all_streams`, which counts its
    /// `empty_cache` calls and out-of-memory retries). Each one drains the device's queue.
    pub pending_free_waits: u64,
    /// Frees on a stream of allocations other streams used too (`record_stream`), which waited
    /// for every one of those streams.
    pub joined_frees: u64,
    /// Driver errors met outside a request (in a deferred unmap, say), recovered by retrying later.
    pub deferred_errors: u64,
    /// Driver calls by kind.
    pub driver_calls: CallCounts,
    /// Where held memory went at its peak (since creation or the last peak reset).
    pub held_at_peak: HeldAtPeak,
}

impl Stats {
    /// Peak reserved over peak allocated bytes: the figure fragmentation targets are set in.
    pub fn reserved_over_allocated_peak(&self) -> f64 {
        if self.allocated_bytes.peak == 0 {
            return 1.0;
        }
        self.reserved_bytes.peak as f64 / self.allocated_bytes.peak as f64
    }
}

/// The named statistics, listed once: `Stats::named` and `Stats::reset_peaks` come from here.
macro_rules! stat_fields {
    ($($field:ident),* $(,)?) => {
        impl Stats {
            /// Every current/peak/allocated/freed statistic with its name, in a fixed order.
            pub fn named(&self) -> Vec<(&'static str, &Stat)> {
                vec![$((stringify!($field), &self.$field)),*]
            }

            pub(crate) fn reset_peaks(&mut self) {
                $(self.$field.reset_peak();)*
            }

            /// Zeroes every cumulative figure, as PyTorch's `reset_accumulated_memory_stats`:
            /// each statistic's `allocated` and `freed`, and every counter (cache hits, OOMs,
            /// waits, ...). Current values and peaks stay.
            pub(crate) fn reset_accumulated(&mut self) {
                let mut fresh = Stats::default();
                $(fresh.$field = Stat { allocated: 0, freed: 0, ..self.$field };)*
                fresh.held_at_peak = self.held_at_peak;
                *self = fresh;
            }
        }
    };
}

stat_fields!(
    allocated_bytes,
    reserved_bytes,
    active_bytes,
    rounding_waste_bytes,
    mapped_bytes,
    mapped_handles,
    allocations,
    chunks,
    window_bytes,
    cached_ranges,
    retired_ranges,
    asleep_bytes,
    growable_committed_bytes,
);

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.add(10);
        s.add(5);
        s.sub(12);
        s.add(1);
        assert_eq!(s, Stat { current: 4, peak: 15, allocated: 16, freed: 12 });
        s.reset_peak();
        assert_eq!(s.peak, 4);
    }

    #[test]
    fn named_lists_every_stat_and_reset_covers_them() {
        let mut s = Stats::default();
        s.window_bytes.add(3);
        s.window_bytes.sub(2);
        let names: Vec<&str> = s.named().iter().map(|n| n.0).collect();
        assert!(names.contains(&"window_bytes") && names.contains(&"allocated_bytes"));
        s.reset_peaks();
        assert!(s.named().iter().all(|(_, st)| st.peak == st.current));
    }

    #[test]
    fn reset_accumulated_keeps_current_and_peak_and_zeroes_the_rest() {
        let mut s = Stats::default();
        s.allocated_bytes.add(10);
        s.allocated_bytes.sub(4);
        s.growable_committed_bytes.add(3);
        s.cache_hits = 5;
        s.num_ooms = 2;
        s.pending_free_waits = 1;
        s.reset_accumulated();
        assert_eq!(s.allocated_bytes, Stat { current: 6, peak: 10, allocated: 0, freed: 0 });
        assert_eq!(s.growable_committed_bytes, Stat { current: 3, peak: 3, ..Stat::default() });
        assert_eq!((s.cache_hits, s.num_ooms, s.pending_free_waits), (0, 0, 0));
        assert!(s.named().iter().all(|(_, st)| st.allocated == 0 && st.freed == 0));
        s.allocated_bytes.add(1);
        assert_eq!(s.allocated_bytes, Stat { current: 7, peak: 10, allocated: 1, freed: 0 });
    }
}
