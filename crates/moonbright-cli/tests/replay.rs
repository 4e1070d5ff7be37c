//! `moonbright replay` and `moonbright bench-traces` on small traces written to a temporary
//! directory, on the host backend.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const MIB: u64 = 1 << 20;

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("moonbright-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// 3 MiB and 5 MiB live together (8 MiB peak), then a 1 KiB block, all freed; segment events
/// record 12 MiB reserved; one free of an address never allocated.
fn small_trace() -> String {
    let mut s = String::from("seq,action,addr,size,stream,dt_us\n");
    let rows = [
        ("segment_alloc", 1 << 30, 12 * MIB),
        ("alloc", 1 << 30, 3 * MIB),
        ("alloc", (1 << 30) + 4 * MIB, 5 * MIB),
        ("free_requested", 1 << 30, 3 * MIB),
        ("free_completed", 1 << 30, 3 * MIB),
        ("alloc", 1 << 30, 1024),
        ("free_completed", 12345, 0),
        ("free_completed", 1 << 30, 1024),
        ("free_completed", (1 << 30) + 4 * MIB, 5 * MIB),
    ];
    for (i, (a, addr, size)) in rows.iter().enumerate() {
        s.push_str(&format!("{i},{a},{addr},{size},0,{}\n", i * 2));
    }
    s
}

fn moonbright(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moonbright"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run moonbright")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn replay_prints_the_figures_and_writes_json_and_a_plot() {
    let dir = TempDir::new("replay");
    std::fs::write(dir.0.join("t.csv"), small_trace()).unwrap();
    let o = moonbright(
        &[
            "replay",
            "t.csv",
            "--backend",
            "host",
            "--host-page-kib",
            "64",
            "--json",
            "out.json",
            "--plot",
            "out.png",
        ],
        &dir.0,
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for want in [
        "9 events, 3 allocs",
        "backend: host | page 64 KiB | cap 1.00 GiB",
        "3 allocs (0 failed), 3 frees, 1 frees of unknown addresses skipped",
        "MoonBright allocated                    8.0 MiB",
        "reserved, as the trace records it      12.0 MiB   1.500",
        "alloc latency: p50",
        "driver calls (",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("out.json")).unwrap()).unwrap();
    assert_eq!(json["moonbright"]["peak_allocated_bytes"], 8 * MIB);
    assert_eq!(json["recorded"]["peak_requested_bytes"], 8 * MIB);
    assert_eq!(json["recorded"]["peak_reserved_bytes"], 12 * MIB);
    assert_eq!(json["replay"]["allocs"], 3);
    assert_eq!(json["replay"]["unknown_frees"], 1);
    assert_eq!(json["replay"]["alloc_latency"]["samples"], 3);
    let reserved = json["moonbright"]["peak_reserved_bytes"].as_u64().unwrap();
    assert!((8 * MIB..=9 * MIB).contains(&reserved), "{reserved}");
    assert!(json["moonbright"]["driver_calls"]["map"].as_u64().unwrap() > 0);
    // Where held memory went at its peak: parts that add up to it.
    assert!(out.contains("held at its peak ("), "{out}");
    let held = &json["moonbright"]["held_at_peak"];
    let parts = ["requested", "rounding", "arena_free", "cached", "pending", "window", "bare"];
    let sum: u64 = parts.iter().chain(["other"].iter()).map(|p| held[p].as_u64().unwrap()).sum();
    let held_reserved = held["reserved"].as_u64().unwrap();
    assert_eq!(sum, held_reserved, "{held}");
    assert!(held_reserved > 0 && held_reserved <= reserved, "{held}");

    let png = std::fs::read(dir.0.join("out.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 1000);

    // Paced: the trace's gaps add up to 72 µs; the pace is said and kept in the JSON.
    let args = ["replay", "t.csv", "--backend", "host", "--pace", "0.5", "--json", "paced.json"];
    let o = moonbright(&args, &dir.0);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("(paced: the recording's gaps / 0.5)"), "{out}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("paced.json")).unwrap()).unwrap();
    assert_eq!(json["replay"]["pace"], 0.5);
    assert!(json["replay"]["wall_s"].as_f64().unwrap() >= 144e-6, "72 µs at half speed");
    // Repeated through one allocator: a line a repetition, and each in the JSON.
    let args = ["replay", "t.csv", "--backend", "host", "--repeat", "3", "--json", "rep.json"];
    let args = [&args[..], &["--conf", "background:false"]].concat();
    let o = moonbright(&args, &dir.0);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("repeated 3 times through one allocator"), "{out}");
    assert!(out.contains("the last of 3 repetitions: 3 allocs (0 failed)"), "{out}");
    assert!(out.contains("over all 3 repetitions: cache hits"), "{out}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("rep.json")).unwrap()).unwrap();
    let reps = json["replay"]["repetitions"].as_array().unwrap();
    assert_eq!((reps.len(), json["replay"]["repeat"].as_u64()), (3, Some(3)));
    assert!(reps[0]["request_maps"].as_u64().unwrap() > 0, "the first repetition maps");
    assert_eq!(reps[2]["request_maps"], 0, "later ones are served by the cache");
    let o = moonbright(&["replay", "t.csv", "--backend", "host", "--repeat", "0"], &dir.0);
    assert!(!o.status.success() && text(&o).contains("--repeat must be 1 or more"));
    // A trace that records no times cannot be paced.
    let timed = small_trace();
    let (header, rows) = timed.split_once('\n').unwrap();
    let untimed: Vec<String> =
        rows.lines().map(|l| l.rsplit_once(',').unwrap().0.to_string() + ",").collect();
    std::fs::write(dir.0.join("untimed.csv"), format!("{header}\n{}\n", untimed.join("\n")))
        .unwrap();
    let o = moonbright(&["replay", "untimed.csv", "--backend", "host", "--pace", "1"], &dir.0);
    assert!(!o.status.success() && text(&o).contains("records no times"), "{}", text(&o));
    for bad in ["0", "-1", "inf"] {
        let pace = format!("--pace={bad}");
        let o = moonbright(&["replay", "t.csv", "--backend", "host", &pace], &dir.0);
        assert!(!o.status.success() && text(&o).contains("must be a positive number"), "{bad}");
    }
}

#[test]
fn replay_converts_and_reads_rmm_logs_and_fails_on_oom() {
    let dir = TempDir::new("rmm");
    let log = "Thread,Time,Action,Pointer,Size,Stream\n\
        1,10:00:00.000000,allocate,0x7f0000000000,4194304,0x0\n\
        1,10:00:00.000100,allocate,0x7f0000400000,2097152,0x0\n\
        1,10:00:00.000200,free,0x7f0000000000,4194304,0x0\n\
        1,10:00:00.000300,free,0x7f0000400000,2097152,0x0\n";
    std::fs::write(dir.0.join("rmm.csv"), log).unwrap();
    let o = moonbright(&["replay", "rmm.csv", "--convert", "ours.csv.gz"], &dir.0);
    assert!(o.status.success(), "{}", text(&o));
    let o = moonbright(&["replay", "ours.csv.gz", "--backend", "host"], &dir.0);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("(Csv; 4 events, 2 allocs"), "{out}");
    assert!(out.contains("MoonBright allocated                    6.0 MiB"), "{out}");

    // A cap below the peak: a failed allocation, reported, and exit status 2.
    let o = moonbright(&["replay", "rmm.csv", "--backend", "host", "--cap-gib", "0.005"], &dir.0);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(out.contains("(RmmCsv;") && out.contains("(1 failed)"), "{out}");
    // Repeated, a failure in any repetition counts.
    let args = ["replay", "rmm.csv", "--backend", "host", "--cap-gib", "0.005", "--repeat", "2"];
    let o = moonbright(&args, &dir.0);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));

    let o = moonbright(&["replay", "missing.csv"], &dir.0);
    assert!(!o.status.success());
    assert!(text(&o).contains("missing.csv"));
}

#[test]
fn bench_traces_writes_a_table_and_json() {
    let dir = TempDir::new("bench");
    std::fs::create_dir_all(dir.0.join("traces")).unwrap();
    std::fs::write(dir.0.join("traces/trace_resnet.csv"), small_trace()).unwrap();
    let o = moonbright(
        &["bench-traces", "traces", "--backend", "host", "--host-page-kib", "64", "--out", "res"],
        &dir.0,
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let md = std::fs::read_to_string(dir.0.join("res/results.md")).unwrap();
    // PyTorch's figures for a trace of that name sit beside ours, and the trace's own.
    assert!(md.contains("| `trace_resnet.csv` | 3 | 8.0 MiB |"), "{md}");
    assert!(md.contains("| 1.207 | 1.010 | 1.500 |"), "{md}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("res/results.json")).unwrap())
            .unwrap();
    assert_eq!(json["backend"], "host");
    assert_eq!(json["traces"][0]["pytorch"]["default"], 1.207);
    assert_eq!(json["traces"][0]["moonbright"]["peak_allocated_bytes"], 8 * MIB);
}

#[test]
fn demo_still_runs_on_the_host_backend() {
    let o = moonbright(
        &["demo", "--backend", "host", "--cap-mib", "256", "--block-mib", "2"],
        Path::new("."),
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("result: MoonBright served"), "{out}");
}

/// `--stream-frees`: each free is stream-ordered (`free_async` on the block's stream), so with
/// the default options each records its event; without it a free is synchronous and records
/// none. Both free every block.
#[test]
fn replay_frees_in_stream_order_on_request() {
    let dir = TempDir::new("stream-frees");
    std::fs::write(dir.0.join("t.csv"), small_trace()).unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["replay", "t.csv", "--backend", "host", "--host-page-kib", "64"];
        args.extend_from_slice(&["--conf", "background:false", "--json", "out.json"]);
        args.extend_from_slice(extra);
        let o = moonbright(&args, &dir.0);
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.0.join("out.json")).unwrap())
                .unwrap();
        (out, json)
    };
    let (out, json) = run(&["--stream-frees"]);
    assert!(out.contains("3 frees (stream-ordered)"), "{out}");
    assert_eq!(json["replay"]["stream_frees"], true);
    assert_eq!(json["replay"]["frees"], 3);
    assert_eq!(json["moonbright"]["driver_calls"]["event_record"], 3);
    let (out, json) = run(&[]);
    assert!(out.contains("3 frees, 1 frees"), "{out}");
    assert_eq!(json["replay"]["stream_frees"], false);
    assert_eq!(json["moonbright"]["driver_calls"]["event_record"].as_u64().unwrap_or(0), 0);
}
