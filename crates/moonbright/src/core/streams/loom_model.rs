//! A loom model of the event-completion protocol, the part of the stream front end that runs
//! across lock releases: pollers take a snapshot of (epoch, event) pairs under the lock, ask the
//! device without it, and apply what they saw under it again, while a freeing thread reuses a
//! spare event for a later free. The property: a free is never completed before the record of
//! an event that covers it has completed. (An earlier version failed exactly this on an H200.)

use super::*;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

/// The device: for each event handle, the number of its latest record and how many of its
/// records have completed (records complete in order, as on one stream).
struct Device {
    latest: [AtomicU64; 2],
    completed: [AtomicU64; 2],
}

impl Device {
    fn done(&self, ev: EventHandle) -> bool {
        let i = ev.0 as usize;
        self.completed[i].load(Ordering::SeqCst) >= self.latest[i].load(Ordering::SeqCst)
    }
}

/// `Shared::poll_events` for one stream: the newest pair first, then the oldest onwards
/// until one is pending.
fn poll(frees: &Mutex<StreamFrees>, device: &Device, out: &Mutex<Vec<Pending>>) {
    let snapshot: Vec<(u64, EventHandle)> = frees.lock().unwrap().events().collect();
    let Some((&newest, older)) = snapshot.split_last() else { return };
    let apply = |(epoch, ev): (u64, EventHandle)| {
        let done = device.done(ev);
        if done {
            let items = frees.lock().unwrap().completed(epoch, ev);
            out.lock().unwrap().extend(items);
        }
        done
    };
    if apply(newest) {
        return;
    }
    for &pair in older {
        if !apply(pair) {
            break;
        }
    }
}

/// One model: `setup` lists frees and events (event `i` has `latest[i]` records so far); the
/// device completes event `completes`'s first record while two pollers run and a late free
/// (range `late`) records the event `event_to_record(cap)` gives, if any. That record never
/// completes, so the late free must never be completed.
fn check_late_free(
    latest: [u64; 2],
    completes: usize,
    cap: usize,
    late: u32,
    setup: fn(&mut StreamFrees),
) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(move || {
        let device = Arc::new(Device {
            latest: latest.map(AtomicU64::new),
            completed: [AtomicU64::new(0), AtomicU64::new(0)],
        });
        let frees = Arc::new(Mutex::new(StreamFrees::default()));
        setup(&mut frees.lock().unwrap());
        let completed_items = Arc::new(Mutex::new(Vec::new()));
        let d = device.clone();
        let dev = thread::spawn(move || d.completed[completes].store(1, Ordering::SeqCst));
        let pollers: Vec<_> = (0..2)
            .map(|_| {
                let (f, d, o) = (frees.clone(), device.clone(), completed_items.clone());
                thread::spawn(move || poll(&f, &d, &o))
            })
            .collect();
        let (epoch, event) = {
            let mut f = frees.lock().unwrap();
            let epoch = f.push(u64::from(late), Pending::Range { id: late, va: 0, pages: 1 });
            (epoch, f.event_to_record(cap))
        };
        if let Some(ev) = event {
            device.latest[ev.0 as usize].fetch_add(1, Ordering::SeqCst);
            frees.lock().unwrap().recorded(epoch, ev);
        }
        dev.join().unwrap();
        for p in pollers {
            p.join().unwrap();
        }
        let done = completed_items.lock().unwrap();
        assert!(
            !done.contains(&Pending::Range { id: late, va: 0, pages: 1 }),
            "the late free completed though no record after it did"
        );
    });
}

/// A free covered by event 0's first record, which completes; a second free records event
/// 0 again (at a cap of 1) or the spare event 1 (once a poller has completed event 0).
#[test]
fn pollers_never_complete_a_free_early() {
    check_late_free([1, 0], 0, 1, 2, |f| {
        let e = f.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
        f.recorded(e, EventHandle(0));
        f.return_event(EventHandle(1));
    });
}

/// Two events listed in the opposite order to their records on the stream: the second
/// completes first, which makes the first redundant, and it becomes spare while its record
/// is still pending. A third free may record it again at once.
#[test]
fn a_redundant_event_reused_while_pending_completes_nothing_early() {
    check_late_free([1, 1], 1, 2, 3, |f| {
        let e1 = f.push(1, Pending::Range { id: 1, va: 0, pages: 1 });
        let e2 = f.push(2, Pending::Range { id: 2, va: 0, pages: 1 });
        f.recorded(e1, EventHandle(0));
        f.recorded(e2, EventHandle(1));
    });
}
