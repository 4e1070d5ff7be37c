//! Unit tests of stream-ordered frees and their events.

use super::frees::{Item, Items, RangesBySize};
use super::*;

fn mark(epoch: u64) -> Item {
    Item { epoch, what: Pending::Mark }
}

#[test]
fn items_keep_their_order_through_holes_and_drop_them() {
    let mut items = Items::default();
    for seq in (10..310).step_by(3) {
        items.push(seq, mark(seq));
    }
    // Holes in the middle stay (in order) until they outnumber the items...
    for seq in (13..250).step_by(6) {
        assert_eq!(items.remove(seq).map(|it| it.epoch), Some(seq));
    }
    assert!(items.remove(13).is_none(), "taken twice");
    assert!(items.remove(11).is_none(), "never there");
    let left: Vec<u64> = items.iter().map(|(s, _)| s).collect();
    let want: Vec<u64> =
        (10..310).step_by(3).filter(|s| !(13..250).step_by(6).any(|r| r == *s)).collect();
    assert_eq!(left, want);
    assert_eq!(items.len(), want.len());
    // ...and those at the front go with the item before them.
    assert!(items.remove(10).is_some());
    assert_eq!(items.slots.front().map(|&(s, _)| s), Some(16));
    for &s in &want[1..] {
        assert!(items.remove(s).is_some());
    }
    assert!(items.is_empty() && items.slots.is_empty());
    // Many holes behind a long-lived first item are compacted away.
    items.push(1_000, mark(1));
    for seq in 1_001..2_000 {
        items.push(seq, mark(seq));
        if seq > 1_001 {
            assert!(items.remove(seq - 1).is_some());
        }
    }
    assert!(items.slots.len() <= 2 * items.len() + 64, "{} slots", items.slots.len());
    assert_eq!(items.iter().map(|(s, _)| s).collect::<Vec<_>>(), vec![1_000, 1_999]);
}

#[test]
fn ranges_by_size_give_the_lowest_address_and_forget_sizes_gone() {
    let mut r = RangesBySize::default();
    for (va, seq) in [(500, 1), (100, 2), (300, 3), (200, 4)] {
        r.insert(4, va, seq);
    }
    r.insert(2, 50, 5);
    assert_eq!(r.first(4), Some((100, 2)));
    r.remove(4, 100, 2);
    assert_eq!(r.first(4), Some((200, 4)));
    r.remove(4, 200, 7); // another sequence number at that address: nothing happens
    assert_eq!(r.first(4), Some((200, 4)));
    r.remove(4, 200, 4);
    r.remove(4, 999, 9); // not there: nothing happens
    assert_eq!(r.first(4), Some((300, 3)));
    assert_eq!(r.first(2), Some((50, 5)));
    assert_eq!(r.first(3), None);
    assert_eq!(r.sizes_in_use, 2);
    // A thousand sizes come and go: the lists of gone ones are dropped.
    for pages in 100..1_100 {
        r.insert(pages, pages, pages);
        r.remove(pages, pages, pages);
    }
    assert_eq!(r.sizes_in_use, 2);
    assert!(r.by_pages.len() <= 4 * 2 + 64 + 1, "{} lists kept", r.by_pages.len());
    assert_eq!(r.first(4), Some((300, 3)));
    // Thousands of one size, in a scrambled order: the lowest address first throughout.
    let vas: Vec<u64> = (0..5_000u64).map(|i| (i * 7_919) % 5_000 + 1_000).collect();
    for (i, &va) in vas.iter().enumerate() {
        r.insert(8, va, 10_000 + i as u64);
    }
    for want in 1_000..6_000u64 {
        let (va, seq) = r.first(8).expect("pending");
        assert_eq!(va, want);
        r.remove(8, va, seq);
    }
    assert_eq!(r.first(8), None);
}

#[test]
fn same_stream_reuse_by_exact_size_lowest_address_first() {
    let mut s = StreamFrees::default();
    s.push(1, Pending::Range { id: 10, va: 0x9000, pages: 4 });
    s.push(2, Pending::Range { id: 11, va: 0x5000, pages: 4 });
    s.push(3, Pending::Range { id: 12, va: 0x7000, pages: 4 });
    s.push(4, Pending::Mark);
    assert_eq!(s.take_range(3), None);
    assert_eq!(s.peek_range(4), Some((0x5000, 2)));
    assert_eq!(s.take_range(4), Some(11));
    assert_eq!(s.take_range(4), Some(12));
    assert_eq!(s.len(), 2);
}

#[test]
fn a_held_sub_page_free_keeps_the_stream_waiting_and_an_arena_after_it_completes_in_order() {
    let mut s = StreamFrees::new(0);
    let e0 = s.hold(0);
    assert!(!s.is_empty() && !s.is_idle(), "a held block waits for its epoch");
    s.record_failed(e0);
    assert!(s.needs_event(), "held space needs an event to go back to other streams");
    let e1 = s.push(1, Pending::Range { id: 3, va: 0x4000, pages: 1 });
    // An arena emptied later, held until e0: it completes after e1's range, in order.
    s.push_at(2, e0, Pending::Range { id: 4, va: 0x1000, pages: 1 });
    assert_eq!(s.peek_range(1), Some((0x1000, 2)), "lowest address first");
    s.recorded(e0, EventHandle(1));
    assert!(s.completed(e0, EventHandle(1)).is_empty(), "behind e1's range");
    s.recorded(e1, EventHandle(2));
    let done = s.completed(e1, EventHandle(2));
    assert_eq!(done.len(), 2);
    assert!(s.is_empty() && s.is_idle());
}

#[test]
fn only_a_free_whose_own_record_failed_needs_the_workers_event() {
    let mut s = StreamFrees::default();
    let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
    assert!(!s.needs_event(), "the free's own record is still to come");
    s.record_failed(e0);
    assert!(s.needs_event(), "its own record failed");
    let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
    s.recorded(e1, EventHandle(100));
    assert!(!s.needs_event(), "the later free's event covers the failed one");
    let e2 = s.push(3, Pending::Range { id: 3, va: 0, pages: 1 });
    s.record_failed(e2);
    assert!(s.needs_event());
    assert_eq!(s.completed(e1, EventHandle(100)).len(), 2);
    assert!(s.needs_event(), "the third free still waits for an event");
    s.take_range(1).unwrap();
    assert!(!s.needs_event(), "nothing left to cover");
}

#[test]
fn an_idle_stream_is_forgotten_and_seen_again_with_its_past_done() {
    let mut all = Streams::default();
    let e0 = all.push(7, Pending::Range { id: 1, va: 0, pages: 1 });
    assert!(all.forget_if_idle(7).is_none(), "a free is pending");
    all.entry(7).recorded(e0, EventHandle(1));
    assert_eq!(all.entry(7).completed(e0, EventHandle(1)).len(), 1);
    assert_eq!(all.forget_if_idle(7), Some(vec![EventHandle(1)]), "its event goes back");
    assert!(all.get(7).is_none());

    let e1 = all.push(7, Pending::Range { id: 2, va: 0, pages: 1 });
    assert!(e1 > e0, "epochs keep growing across a forgotten stream");
    assert!(all.get(7).unwrap().is_done(e0), "the stream's past counts as done");
    assert!(!all.get(7).unwrap().is_done(e1), "its new free does not");
    // Taken back by its own stream, with its record failed: nothing pending and no event
    // listed, but its epoch is not known done (something retired may wait for it).
    all.entry(7).record_failed(e1);
    all.get_mut(7).unwrap().take_range(1).unwrap();
    assert!(all.forget_if_idle(7).is_none(), "an epoch not known done");
    let e2 = all.push(7, Pending::Range { id: 3, va: 0, pages: 1 });
    all.entry(7).recorded(e2, EventHandle(2));
    assert_eq!(all.entry(7).completed(e2, EventHandle(2)).len(), 1);
    assert!(all.get(7).unwrap().is_done(e1));
    assert_eq!(all.forget_if_idle(7), Some(vec![EventHandle(2)]));
}

#[test]
fn a_joined_free_completes_with_its_last_mark_and_no_stream_reuses_it_before() {
    let mut all = Streams::default();
    let what = Pending::Range { id: 4, va: 0, pages: 3 };
    let waits = all.push_joined(&[1, 2], what);
    assert_eq!(waits.iter().map(|w| w.0).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(all.pending_pages(), 3);
    assert!(all.any_pending());
    // Neither stream can take it back as its own.
    assert_eq!(all.get_mut(1).unwrap().take_range(3), None);
    assert_eq!(all.get_mut(2).unwrap().take_range(3), None);
    let (e1, e2) = (waits[0].1, waits[1].1);
    all.entry(1).recorded(e1, EventHandle(1));
    all.entry(2).recorded(e2, EventHandle(2));
    assert_eq!(all.entry(2).completed(e2, EventHandle(2)), vec![Pending::Mark]);
    assert!(all.take_joined_done().is_empty(), "stream 1 has not passed its mark");
    assert_eq!(all.forget_if_idle(2), Some(vec![EventHandle(2)]), "stream 2 is done");
    assert_eq!(all.entry(1).completed(e1, EventHandle(1)), vec![Pending::Mark]);
    // Stream 2, forgotten, counts as done.
    assert_eq!(all.take_joined_done(), vec![what]);
    assert!(all.take_joined_done().is_empty(), "taken once");
    assert_eq!(all.joined().count(), 0);
}

#[test]
fn an_event_completes_exactly_the_frees_before_it() {
    let mut s = StreamFrees::default();
    let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
    s.recorded(e0, EventHandle(100));
    let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
    s.recorded(e1, EventHandle(101));
    s.push(3, Pending::Range { id: 3, va: 0, pages: 1 });
    assert_eq!(s.completed(e0, EventHandle(100)), vec![Pending::Range { id: 1, va: 0, pages: 1 }]);
    assert_eq!(s.completed(e1, EventHandle(101)), vec![Pending::Range { id: 2, va: 0, pages: 1 }]);
    assert_eq!(s.len(), 1);
    assert_eq!(s.spare_event(), Some(EventHandle(101)));
}

#[test]
fn a_later_event_covers_earlier_frees_that_had_none() {
    let mut s = StreamFrees::default();
    s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
    let e = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
    s.recorded(e, EventHandle(7));
    assert_eq!(s.completed(e, EventHandle(7)).len(), 2);
    assert!(s.is_empty());
}

#[test]
fn reused_items_do_not_complete_twice() {
    let mut s = StreamFrees::default();
    let e = s.push(1, Pending::Range { id: 1, va: 0, pages: 2 });
    s.recorded(e, EventHandle(7));
    assert_eq!(s.take_range(2), Some(1));
    assert!(s.completed(e, EventHandle(7)).is_empty());
}

#[test]
fn a_stale_completion_changes_nothing() {
    let mut s = StreamFrees::default();
    let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
    s.recorded(e0, EventHandle(7));
    assert_eq!(s.completed(e0, EventHandle(7)).len(), 1);
    // Event 7 is spare, then recorded again for a later free that has not completed.
    let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
    let ev = s.spare_event().unwrap();
    s.recorded(e1, ev);
    // A second poller that saw event 7 done for epoch e0 must not complete epoch e1.
    assert!(s.completed(e0, EventHandle(7)).is_empty());
    assert_eq!(s.len(), 1);
}

#[test]
fn events_recorded_out_of_epoch_order_complete_only_what_they_cover() {
    let mut s = StreamFrees::default();
    let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
    let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
    // Two threads: the later epoch's event lands in the list first.
    s.recorded(e1, EventHandle(11));
    s.recorded(e0, EventHandle(10));
    // Event 10 (epoch e0) done: only the first free, even though event 11 is ahead of it.
    assert_eq!(s.completed(e0, EventHandle(10)), vec![Pending::Range { id: 1, va: 0, pages: 1 }]);
    assert_eq!(s.len(), 1);
    assert_eq!(s.completed(e1, EventHandle(11)).len(), 1);
}

#[test]
fn at_the_cap_the_newest_event_is_recorded_again() {
    let mut s = StreamFrees::default();
    s.return_event(EventHandle(50));
    let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
    let ev = s.event_to_record(2).unwrap();
    s.recorded(e0, ev);
    let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
    assert_eq!(s.event_to_record(2), None, "below the cap: no spare, the caller makes one");
    s.recorded(e1, EventHandle(51));
    // At the cap: the newest (51) comes off the list, to be recorded again for epoch e2.
    let e2 = s.push(3, Pending::Range { id: 3, va: 0, pages: 1 });
    assert_eq!(s.event_to_record(2), Some(EventHandle(51)));
    assert_eq!(s.events().count(), 1);
    // A poller that saw 51 done for e1 changes nothing: e1 waits for the new record.
    assert!(s.completed(e1, EventHandle(51)).is_empty());
    s.recorded(e2, EventHandle(51));
    assert_eq!(s.completed(e2, EventHandle(51)).len(), 3);
    assert!(s.is_empty());
}

#[test]
fn a_completion_gives_back_the_events_of_earlier_epochs() {
    let mut s = StreamFrees::default();
    let epochs: Vec<u64> =
        (0..4).map(|i| s.push(i, Pending::Range { id: i as u32, va: 0, pages: 1 })).collect();
    for (i, &e) in epochs.iter().enumerate() {
        s.recorded(e, EventHandle(20 + i as u64));
    }
    // The third event done: the first three frees, and the first three events spare (the
    // first two cover nothing more); the fourth stays listed.
    assert_eq!(s.completed(epochs[2], EventHandle(22)).len(), 3);
    assert_eq!(s.events().collect::<Vec<_>>(), vec![(epochs[3], EventHandle(23))]);
    let mut spare: Vec<u64> = std::iter::from_fn(|| s.spare_event()).map(|e| e.0).collect();
    spare.sort_unstable();
    assert_eq!(spare, vec![20, 21, 22]);
    // A poller that saw event 20 done for its old epoch changes nothing now.
    assert!(s.completed(epochs[0], EventHandle(20)).is_empty());
    assert_eq!(s.len(), 1);
}

#[test]
fn a_redundant_event_recorded_again_covers_only_its_new_free() {
    let mut s = StreamFrees::default();
    let e0 = s.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
    s.recorded(e0, EventHandle(30));
    let e1 = s.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
    s.recorded(e1, EventHandle(31));
    assert_eq!(s.completed(e1, EventHandle(31)).len(), 2);
    // Event 30 may still be pending on the device; it is spare, and a new free records it.
    let e2 = s.push(3, Pending::Range { id: 3, va: 0, pages: 1 });
    let ev = std::iter::from_fn(|| s.spare_event()).find(|e| e.0 == 30).unwrap();
    s.recorded(e2, ev);
    assert!(s.completed(e0, EventHandle(30)).is_empty(), "the old pair is gone");
    assert_eq!(s.len(), 1);
    assert_eq!(s.completed(e2, EventHandle(30)), vec![Pending::Range { id: 3, va: 0, pages: 1 }]);
}
