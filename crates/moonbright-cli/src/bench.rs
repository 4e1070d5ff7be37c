//! `moonbright bench-traces DIR`: the fragmentation benchmark. Replays every trace in a
//! directory and writes `results.md` (a markdown table) and `results.json` beside PyTorch's own
//! figures on the same traces.

use crate::ExitCode;
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::replay::{self, gib, us, Outcome};
use crate::ReplayArgs;

/// PyTorch's peak reserved / peak live requested bytes on the recorded traces, default allocator
/// and `expandable_segments:True`, each recorded in its own process on an H200 with PyTorch 2.11.
/// Source: `traces/README.md` (the table of the traces).
const PYTORCH: [(&str, f64, f64); 3] =
    [("trace_llama", 1.107, 1.038), ("trace_gpt2", 1.224, 1.005), ("trace_resnet", 1.207, 1.010)];

fn pytorch_figures(name: &str) -> Option<(f64, f64)> {
    let stem = name.split('.').next().unwrap_or(name);
    PYTORCH.iter().find(|(n, _, _)| *n == stem).map(|(_, d, e)| (*d, *e))
}

fn traces_in(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            p.is_file()
                && [".csv", ".csv.gz", ".json", ".json.gz"].iter().any(|ext| n.ends_with(ext))
        })
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(format!("{}: no traces (*.csv, *.csv.gz, *.json)", dir.display()));
    }
    Ok(v)
}

fn f3(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into())
}

fn row(o: &Outcome) -> String {
    let py = pytorch_figures(&o.name());
    let s = &o.stats;
    let calls = s.driver_calls.total();
    format!(
        "| `{}` | {} | {} | {} | **{:.3}** | {} | {} | {} | {} | {} | {} | {:.2} s |",
        o.name(),
        o.report.allocs,
        gib(o.recorded.peak_requested),
        gib(s.reserved_bytes.peak),
        o.ratio(),
        f3(py.map(|p| p.0)),
        f3(py.map(|p| p.1)),
        f3(o.recorded.reserved_over_requested()),
        us(o.alloc_us(0.5)),
        us(o.alloc_us(0.99)),
        calls,
        o.report.wall.as_secs_f64(),
    )
}

pub(crate) fn command(
    dir: &Path,
    args: &ReplayArgs,
    out: Option<PathBuf>,
) -> Result<ExitCode, String> {
    let traces = traces_in(dir)?;
    let mut outcomes = Vec::new();
    for t in &traces {
        let o = replay::run(t, args, None, 0)?;
        replay::print_summary(&o);
        println!();
        outcomes.push(o);
    }
    let backend = outcomes[0].backend;
    let out = out.unwrap_or_else(|| PathBuf::from(format!("bench/results/traces-{backend}")));
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;

    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split_once(':').map(|(_, v)| v.trim().to_string()).unwrap_or_default())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let mut md = String::new();
    md.push_str(&format!(
        "# Fragmentation on recorded traces: MoonBright, `{backend}` backend\n\n\
         `moonbright bench-traces {}` (`bash bench/traces.sh`), page {} KiB, on {cpu}.\n\n\
         Ratios are peak reserved / peak live requested bytes. PyTorch's figures are its own \
         `max_memory_reserved()` over the same peak, default allocator and \
         `expandable_segments:True`, from `traces/README.md`; \"in trace\" is the \
         reserved peak the trace's segment events record (the default allocator's). Latencies \
         are of each `malloc_async` of the replay, measured with `Instant`.\n\n",
        dir.display(),
        outcomes[0].page >> 10,
    ));
    md.push_str(
        "| trace | alloc events | peak requested | MoonBright peak reserved | MoonBright ratio | \
         PyTorch default | PyTorch expandable | in trace | alloc p50 | alloc p99 | driver calls | \
         replay time |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for o in &outcomes {
        md.push_str(&row(o));
        md.push('\n');
    }
    md.push_str("\nDriver calls by kind:\n\n");
    for o in &outcomes {
        md.push_str(&format!("- `{}`: {}\n", o.name(), replay::calls(&o.stats)));
    }
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| o.failed_allocs() > 0)
        .map(|o| format!("`{}` ({} failed allocations)", o.name(), o.failed_allocs()))
        .collect();
    if !failed.is_empty() {
        md.push_str(&format!("\nFailed allocations: {}.\n", failed.join(", ")));
    }
    let records: Vec<_> = outcomes
        .iter()
        .map(|o| {
            let mut v = o.to_json();
            let py = pytorch_figures(&o.name());
            v["pytorch"] = json!({
                "default": py.map(|p| p.0),
                "expandable_segments": py.map(|p| p.1),
                "source": "traces/README.md",
            });
            v
        })
        .collect();
    let md_path = out.join("results.md");
    let json_path = out.join("results.json");
    std::fs::write(&md_path, &md).map_err(|e| format!("{}: {e}", md_path.display()))?;
    let text =
        serde_json::to_string_pretty(&json!({ "backend": backend, "cpu": cpu, "traces": records }))
            .map_err(|e| e.to_string())?;
    std::fs::write(&json_path, text + "\n").map_err(|e| format!("{}: {e}", json_path.display()))?;
    print!("{md}");
    println!("\nwrote {} and {}", md_path.display(), json_path.display());
    Ok(if failed.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(2) })
}
