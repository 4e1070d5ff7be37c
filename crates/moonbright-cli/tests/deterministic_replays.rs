//! The placement policy's fingerprint on the shared traces (`traces/`): replayed on the host
//! backend without the background worker, a replay is deterministic, so its peak reserved
//! bytes, its hits and its driver calls are the policy's own and must not move unless the
//! policy is meant to change. A refactor, a faster data structure or a new option's default
//! that changes any of them fails here; a change of policy updates the figures below (and
//! says so in docs/CHANGELOG.md).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// The figures compared, in the order of each row of `EXPECTED`.
const KEYS: [&str; 11] = [
    "peak_reserved_bytes",
    "peak_mapped_handles",
    "cache_hits",
    "subpage_allocations",
    "carved_allocations",
    "cached_ranges_stolen",
    "chunk_splits",
    "driver_calls.create",
    "driver_calls.map",
    "driver_calls.set_access",
    "driver_calls.unmap",
];

/// (trace, repetitions through one allocator, options beside `background:false`, figures in
/// the order of `KEYS`).
const EXPECTED: &[(&str, u32, &str, [u64; 11])] = &[
    ("resnet", 1, "", [11_911_823_360, 1956, 7977, 10_955, 1956, 961, 188, 777, 2375, 870, 208]),
    (
        "gpt2",
        1,
        "",
        [41_250_979_840, 4688, 36_830, 18_417, 14_625, 2427, 668, 2161, 5346, 1999, 263],
    ),
    ("llama", 1, "", [3_860_856_832, 1151, 35_433, 728_660, 3042, 594, 85, 341, 1402, 458, 160]),
    (
        "resnet",
        3,
        "",
        [11_924_406_272, 1956, 25_023, 32_865, 5515, 2574, 188, 778, 5829, 1461, 817],
    ),
    (
        "gpt2",
        3,
        "",
        [41_299_214_336, 4824, 114_040, 55_251, 41_982, 3631, 670, 2169, 7299, 2447, 1358],
    ),
    (
        "resnet",
        1,
        "profile:memory",
        [11_905_531_904, 1905, 7730, 10_955, 0, 1282, 230, 862, 3196, 1116, 344],
    ),
    (
        "resnet",
        1,
        "profile:latency",
        [13_149_143_040, 308, 8540, 10_955, 5378, 0, 0, 308, 308, 308, 0],
    ),
];

fn figure(v: &Value, path: &str) -> u64 {
    let mut cur = &v["moonbright"];
    for part in path.split('.') {
        cur = &cur[part];
    }
    cur.as_u64().unwrap_or_else(|| panic!("no figure {path} in the replay's JSON"))
}

fn replay(trace: &str, repeat: u32, conf: &str) -> Value {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = root.join(format!("traces/trace_{trace}.csv.gz"));
    let json = std::env::temp_dir().join(format!(
        "moonbright-fingerprint-{trace}-{repeat}-{conf}-{}.json",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_moonbright"))
        .args(["replay", "--backend", "host", "--conf"])
        .arg(if conf.is_empty() {
            "background:false".to_string()
        } else {
            format!("background:false,{conf}")
        })
        .args(["--repeat", &repeat.to_string(), "--json"])
        .arg(&json)
        .arg(&path)
        .output()
        .expect("the moonbright command runs");
    assert!(
        out.status.success(),
        "replay of {trace} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the replay's JSON")).expect("JSON");
    let _ = std::fs::remove_file(&json);
    v
}

#[test]
fn host_replays_of_the_shared_traces_keep_their_figures() {
    let mut moved = Vec::new();
    let mut got_all = String::new();
    for &(trace, repeat, conf, expected) in EXPECTED {
        let v = replay(trace, repeat, conf);
        let got: Vec<u64> = KEYS.iter().map(|k| figure(&v, k)).collect();
        got_all += &format!("{trace} x{repeat} {conf}: {got:?}\n");
        for ((key, want), have) in KEYS.iter().zip(expected).zip(&got) {
            if want != *have {
                moved.push(format!("{trace} x{repeat} {conf}: {key} {want} -> {have}"));
            }
        }
    }
    assert!(
        moved.is_empty(),
        "the policy's figures moved:\n{}\nall figures now:\n{got_all}",
        moved.join("\n")
    );
}
