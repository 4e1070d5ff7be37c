//! Traces: the CSV format and its gzip form, the PyTorch snapshot and RMM importers, the figures
//! a trace records, and replay on the host backend.
#![cfg(not(loom))]

use moonbright::{Allocator, Options};
use moonbright_trace::{self as trace, Action, Event, Format, ReplayOptions, Trace};

const MIB: u64 = 1 << 20;

fn ev(seq: u64, action: Action, addr: u64, size: u64, dt: Option<u64>) -> Event {
    Event { seq, action, addr, size, stream: 0, dt_us: dt }
}

/// A handmade trace: a 20 MiB segment holding 8 MiB + 4 MiB blocks, a second 10 MiB segment for a
/// 6 MiB block while both are live (18 MiB live at peak), then frees and a segment free.
fn handmade() -> Trace {
    use Action::*;
    let events = vec![
        (SegmentAlloc, 0x1000_0000, 20 * MIB),
        (Alloc, 0x1000_0000, 8 * MIB),
        (Alloc, 0x1080_0000, 4 * MIB),
        (SegmentAlloc, 0x2000_0000, 10 * MIB),
        (Alloc, 0x2000_0000, 6 * MIB),
        (FreeRequested, 0x1000_0000, 8 * MIB),
        (FreeCompleted, 0x1000_0000, 8 * MIB),
        (Alloc, 0x1000_0000, 1000),
        (FreeCompleted, 0x9999, 0), // unknown address
        (SegmentFree, 0x2000_0000, 10 * MIB),
        (FreeCompleted, 0x2000_0000, 6 * MIB),
        (FreeCompleted, 0x1080_0000, 4 * MIB),
    ];
    Trace {
        events: events
            .into_iter()
            .enumerate()
            .map(|(i, (a, addr, size))| ev(i as u64, a, addr, size, Some(i as u64 * 3)))
            .collect(),
    }
}

#[test]
fn csv_round_trips_plain_and_gzipped() {
    let mut t = handmade();
    t.events[3].dt_us = None; // an empty dt_us survives
    t.events[4].stream = 7;
    let mut plain = Vec::new();
    t.write_csv(&mut plain).unwrap();
    let text = String::from_utf8(plain.clone()).unwrap();
    assert!(text.starts_with("seq,action,addr,size,stream,dt_us\n0,segment_alloc,268435456,"));
    assert!(text.contains("\n3,segment_alloc,536870912,10485760,0,\n"), "{text}");
    assert_eq!(Trace::read_csv(&plain[..]).unwrap(), t);

    let mut gz = Vec::new();
    t.write_csv_gz(&mut gz).unwrap();
    assert_eq!(&gz[..2], &[0x1f, 0x8b]);
    assert!(gz.len() < plain.len());
    assert_eq!(Trace::read_csv(&gz[..]).unwrap(), t);
    let (back, format) = Trace::load_reader(&gz[..]).unwrap();
    assert_eq!((back, format), (t.clone(), Format::Csv));

    let dir = std::env::temp_dir().join(format!("moonbright-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["t.csv", "t.csv.gz"] {
        let p = dir.join(name);
        t.save(&p).unwrap();
        let gzipped = std::fs::read(&p).unwrap().starts_with(&[0x1f, 0x8b]);
        assert_eq!(gzipped, name.ends_with(".gz"));
        assert_eq!(Trace::load(&p).unwrap(), t);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_csv_is_refused_with_the_record_named() {
    let e = Trace::read_csv(
        &b"seq,action,addr,size,stream,dt_us\n0,alloc,1,2,0,\n1,malloc,1,2,0,\n"[..],
    )
    .unwrap_err();
    assert!(e.to_string().contains("record 2") && e.to_string().contains("malloc"), "{e}");
    let e =
        Trace::read_csv(&b"seq,action,addr,size,stream,dt_us\n0,alloc,1,-2,0,\n"[..]).unwrap_err();
    assert!(e.to_string().contains("size"), "{e}");
    let e = Trace::read_csv(&b"a,b,c,d,e\n"[..]).unwrap_err();
    assert!(e.to_string().contains("header"), "{e}");
}

#[test]
fn recorded_figures_of_a_handmade_trace() {
    let f = handmade().recorded();
    assert_eq!(f.events, 12);
    assert_eq!(f.allocs, 4);
    assert_eq!(f.frees, 4);
    assert_eq!(f.unknown_frees, 1);
    assert_eq!(f.live_at_end, 1); // the 1000-byte block
    assert_eq!(f.peak_requested, 18 * MIB);
    assert_eq!(f.peak_reserved, Some(30 * MIB));
    assert_eq!(f.reserved_over_requested(), Some(30.0 / 18.0));
    assert_eq!(f.duration_us, 3 * (0..12).sum::<u64>());
    assert_eq!(f.streams, 1);

    // Without segment events there is no recorded reserved peak.
    let mut t = handmade();
    t.events.retain(|e| !matches!(e.action, Action::SegmentAlloc | Action::SegmentFree));
    assert_eq!(t.recorded().peak_reserved, None);
    assert_eq!(t.recorded().peak_requested, 18 * MIB);

    // Expandable segments: maps add, unmaps subtract.
    let t = Trace {
        events: vec![
            ev(0, Action::SegmentMap, 0, 4 * MIB, None),
            ev(1, Action::SegmentMap, 4 * MIB, 4 * MIB, None),
            ev(2, Action::SegmentUnmap, 4 * MIB, 4 * MIB, None),
            ev(3, Action::SegmentMap, 4 * MIB, 2 * MIB, None),
        ],
    };
    assert_eq!(t.recorded().peak_reserved, Some(8 * MIB));
}

#[test]
fn pytorch_snapshot_json_imports() {
    let json = r#"{
      "segments": [],
      "device_traces": [[
        {"action": "segment_alloc", "addr": 1000000, "size": 2097152, "stream": 0, "time_us": 100, "frames": []},
        {"action": "alloc", "addr": 1000000, "size": 512, "stream": 0, "time_us": 105, "frames": [{"filename": "x.py", "line": 1, "name": "f"}]},
        {"action": "alloc", "addr": 1000512, "size": 1024, "stream": 94000000, "time_us": 110},
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 111},
        {"action": "free_requested", "addr": 1000000, "size": 512, "stream": 0, "time_us": 120},
        {"action": "free_completed", "addr": 1000000, "size": 512, "stream": 0, "time_us": 125},
        {"action": "oom", "addr": 0, "size": 99, "stream": 0, "time_us": 130, "device_free": 5}
      ], [
        {"action": "alloc", "addr": 7, "size": 9, "stream": 0, "time_us": 1}
      ]]
    }"#;
    let t = Trace::from_snapshot_json(json.as_bytes(), 0).unwrap();
    let got: Vec<(Action, u64, u64, u64, Option<u64>)> =
        t.events.iter().map(|e| (e.action, e.addr, e.size, e.stream, e.dt_us)).collect();
    assert_eq!(
        got,
        vec![
            (Action::SegmentAlloc, 1000000, 2097152, 0, Some(0)),
            (Action::Alloc, 1000000, 512, 0, Some(5)),
            (Action::Alloc, 1000512, 1024, 94000000, Some(5)),
            (Action::FreeRequested, 1000000, 512, 0, Some(10)), // the skipped snapshot's time counts
            (Action::FreeCompleted, 1000000, 512, 0, Some(5)),
        ]
    );
    assert_eq!(t.events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    assert_eq!(t.recorded().peak_requested, 1536);
    assert_eq!(t.recorded().streams, 2);
    assert_eq!(Trace::from_snapshot_json(json.as_bytes(), 1).unwrap().events.len(), 1);
    assert!(Trace::from_snapshot_json(json.as_bytes(), 2).is_err());
    let (auto, format) = Trace::load_reader(json.as_bytes()).unwrap();
    assert_eq!((auto, format), (t, Format::SnapshotJson));
    assert!(Trace::from_snapshot_json(&br#"{"segments": []}"#[..], 0).is_err());
}

#[test]
fn rmm_log_imports() {
    // As RMM's logging_resource_adaptor writes it (clock time, hex pointers and streams), with a
    // failed allocation, which is skipped.
    let log = "Thread,Time,Action,Pointer,Size,Stream\n\
        140202,23:59:59.500000,allocate,0x7f0000000000,4096,0x0\n\
        140202,23:59:59.500250,allocate,0x7f0000001000,1048576,0x5555aa\n\
        140202,23:59:59.600000,allocate failure,0x0,99999999999,0x0\n\
        140202,00:00:00.000001,free,0x7f0000000000,4096,0x0\n\
        140203,00:00:00.000002,free,0x7f0000001000,1048576,0x5555aa\n";
    let t = Trace::from_rmm_csv(log.as_bytes()).unwrap();
    let got: Vec<(Action, u64, u64, u64, Option<u64>)> =
        t.events.iter().map(|e| (e.action, e.addr, e.size, e.stream, e.dt_us)).collect();
    assert_eq!(
        got,
        vec![
            (Action::Alloc, 0x7f00_0000_0000, 4096, 0, Some(0)),
            (Action::Alloc, 0x7f00_0000_1000, 1 << 20, 1, Some(250)),
            (Action::FreeCompleted, 0x7f00_0000_0000, 4096, 0, Some(499_751)), // past midnight
            (Action::FreeCompleted, 0x7f00_0000_1000, 1 << 20, 1, Some(1)),
        ]
    );
    assert_eq!(t.recorded().peak_requested, 4096 + (1 << 20));
    assert_eq!(t.recorded().peak_reserved, None);
    let (auto, format) = Trace::load_reader(log.as_bytes()).unwrap();
    assert_eq!((auto, format), (t, Format::RmmCsv));

    // Seconds and decimal pointers.
    let log =
        "Thread,Time,Action,Pointer,Size,Stream\n1,0.5,allocate,4096,10,0\n1,0.75,free,4096,10,0\n";
    let t = Trace::from_rmm_csv(log.as_bytes()).unwrap();
    assert_eq!(t.events[1].dt_us, Some(250_000));
    assert_eq!(t.events[1].addr, 4096);
    assert!(Trace::from_rmm_csv("Thread,Time,Action\n".as_bytes()).is_err());
}

#[test]
fn replay_on_the_host_backend_reaches_the_trace_peak() {
    const PAGE: usize = 64 << 10;
    let opts = Options { validate: true, ..Options::host(64 * MIB, PAGE) };
    let alloc = Allocator::new(opts).unwrap();
    let t = handmade();
    let mut calls = Vec::new();
    let rep = trace::replay(
        &alloc,
        &t,
        &ReplayOptions { limit: None, series_points: 4, ..ReplayOptions::default() },
        &mut |n| calls.push(n),
    );
    assert_eq!(calls.last(), Some(&12));
    assert_eq!((rep.events, rep.allocs, rep.frees, rep.unknown_frees), (12, 4, 3, 1));
    assert_eq!((rep.failed_allocs, rep.live_at_end), (0, 1));
    assert_eq!(rep.alloc_latency_ns.len(), 4);
    assert!(rep.alloc_latency_ns.windows(2).all(|w| w[0] <= w[1]));
    let s = alloc.stats();
    assert_eq!(s.allocated_bytes.peak, 18 * MIB);
    assert_eq!(s.allocated_bytes.current, 0, "the block live at the end is freed");
    assert!(s.reserved_bytes.peak >= 18 * MIB && s.reserved_bytes.peak <= 19 * MIB);
    assert_eq!(rep.series.len(), 4); // stretches of 3 events
    assert_eq!(rep.series.iter().map(|p| p.allocated).max(), Some(18 * MIB));
    assert_eq!(rep.series.last().unwrap().event, 11);

    // A limit replays a prefix; a cap too small makes failures, counted, and the replay goes on.
    let small =
        Allocator::new(Options { cap_bytes: Some(14 * MIB), ..Options::host(64 * MIB, PAGE) })
            .unwrap();
    let rep = trace::replay(&small, &t, &ReplayOptions::default(), &mut |_| {});
    assert_eq!(rep.failed_allocs, 1, "the 6 MiB block does not fit beside 12 MiB");
    assert_eq!(rep.frees_of_failed, 1);
    assert!(rep.first_error.is_some());
    let rep = trace::replay(
        &small,
        &t,
        &ReplayOptions { limit: Some(3), ..ReplayOptions::default() },
        &mut |_| {},
    );
    assert_eq!((rep.events, rep.allocs, rep.failed_allocs), (3, 2, 0));
}

#[test]
fn a_paced_replay_keeps_the_recorded_gaps() {
    use Action::*;
    // Four events 20 ms apart (the first at 0): 60 ms as recorded.
    let events = [(Alloc, 0x1000, MIB, 0), (Alloc, 0x2000, MIB, 20_000)]
        .into_iter()
        .chain([(FreeCompleted, 0x1000, MIB, 20_000), (FreeCompleted, 0x2000, MIB, 20_000)])
        .enumerate()
        .map(|(i, (a, addr, size, dt))| ev(i as u64, a, addr, size, Some(dt)))
        .collect();
    let t = Trace { events };
    let alloc = Allocator::new(Options::host(64 * MIB, 64 << 10)).unwrap();
    let paced = |speed: f64| {
        let opts = ReplayOptions { pace: Some(speed), ..ReplayOptions::default() };
        let rep = trace::replay(&alloc, &t, &opts, &mut |_| {});
        assert_eq!((rep.allocs, rep.frees, rep.failed_allocs), (2, 2, 0));
        rep.wall
    };
    let ms = std::time::Duration::from_millis;
    assert!(paced(1.0) >= ms(60), "as recorded: the gaps add up to 60 ms");
    assert!(paced(4.0) >= ms(15), "four times as fast: 15 ms");
}
