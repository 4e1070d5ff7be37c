//! Unit tests of the heap's own helpers.

use super::*;

#[test]
fn tables_grow_ahead_once_half_their_room_is_gone() {
    assert_eq!(room_to_add(0, 0), Some(TABLE_HEADROOM));
    assert_eq!(room_to_add(0, TABLE_HEADROOM), None);
    assert_eq!(room_to_add(40, 64), Some(TABLE_HEADROOM), "24 left, under 32");
    assert_eq!(room_to_add(100, 150), None, "50 left of 100");
    assert_eq!(room_to_add(100, 140), Some(100));
    assert_eq!(room_to_add(10, 4), Some(TABLE_HEADROOM), "a capacity below the length");
}

#[test]
fn growing_ahead_gives_every_request_table_room_and_is_idempotent() {
    let lim = Limits {
        page: 1,
        cap: 1 << 20,
        chunks: ChunkLimits { max_pages: 1, repeated_pages: 1, large_pages: 1, largest_pages: 1 },
        reserve_bytes: 1 << 20,
        va_limit: 1 << 30,
        unmap: UnmapLimits {
            batch_ranges: 8,
            batch_bytes: 1 << 20,
            run_handles: 0,
            batch_age: std::time::Duration::from_millis(50),
        },
        window_slab_pages: 1,
        reuse_addresses: true,
        shares: PolicyShares {
            near_fit_per_1024: 128,
            carve_per_1024: 0,
            carve_repeated_per_1024: 0,
            grow_first_per_1024: 0,
        },
        defer_free_events: false,
        own_frees_before_new: false,
    };
    let mut h = Heap::new(lim);
    let caps = |h: &Heap| {
        (h.live.allocs.capacity(), h.ranges.slots.capacity(), h.live.recent_free_gen.capacity())
    };
    assert_eq!(caps(&h), (0, 0, 0), "a new heap holds no room yet");
    h.grow_tables_ahead();
    let grown = caps(&h);
    assert!(grown.0 >= TABLE_HEADROOM && grown.1 >= TABLE_HEADROOM && grown.2 >= TABLE_HEADROOM);
    h.grow_tables_ahead();
    assert_eq!(caps(&h), grown, "room enough: nothing grows again");
}
