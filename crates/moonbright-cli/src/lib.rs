//! The `moonbright` command, as a library: [`run`] takes the arguments and returns the exit
//! status, for the binary (`src/main.rs`, `cargo run -p moonbright-cli`) and for the Python
//! package's console script (`moonbright._moonbright.cli_main`), which pip installs as
//! `moonbright`.
//!
//! - `moonbright demo` (the default) runs the fragmentation scenario on the best backend
//!   available, for MoonBright and for a no-remap caching allocator on the same backend, and
//!   prints both outcomes and MoonBright's statistics.
//! - `moonbright replay TRACE` replays an allocation trace (ours, a PyTorch snapshot's JSON or
//!   RMM's log) and prints peak allocated and reserved bytes, their ratio, the reserved peak the
//!   trace recorded, driver calls and allocation latencies.
//! - `moonbright bench-traces DIR` replays every trace in a directory and writes a markdown table
//!   and JSON beside PyTorch's recorded figures.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};
use moonbright_trace::Trace;

mod bench;
mod demo;
mod plot;
mod replay;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

#[derive(Parser)]
#[command(name = "moonbright", version, about = "MoonBright GPU memory allocator")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

/// Options shared by `replay` and `bench-traces`.
#[derive(Args, Clone, Debug)]
pub(crate) struct ReplayArgs {
    /// auto (cuda when a GPU is present), cuda or host.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Cap on physical memory, in GiB. Default: on the host backend, enough for the trace (1.5x
    /// its peak live bytes, at least 1 GiB); on CUDA, 95% of device memory.
    #[arg(long)]
    pub cap_gib: Option<f64>,
    /// Host backend: page size (mapping granularity) in KiB.
    #[arg(long, default_value_t = 2048)]
    pub host_page_kib: usize,
    /// Check every allocator invariant after every operation (slow).
    #[arg(long)]
    pub validate: bool,
    /// More options, as in MOONBRIGHT_ALLOC_CONF (`key:value,...`, e.g. `background:false`).
    #[arg(long, default_value = "")]
    pub conf: String,
    /// Keep the recording's pace (its `dt_us` gaps), sped up this many times (1: as recorded),
    /// so the background worker sees the idle spells the program left it. Default: as fast as
    /// it goes.
    #[arg(long)]
    pub pace: Option<f64>,
    /// Free in stream order, as PyTorch does under `moonbright.torch.enable()` (each free a
    /// `free_async` on the block's stream, its memory pending there until an event settles
    /// it), instead of at once. Under `deferred_free_events` the frees record no event of their
    /// own: the background worker records them, or a request short of memory.
    #[arg(long)]
    pub stream_frees: bool,
    /// Replay the trace this many times through one allocator (what a longer run of the same
    /// steps does): each repetition gets a line, and the summary's latencies are the last
    /// one's, its peaks those of the whole run.
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
}

#[derive(Subcommand)]
enum Command {
    /// Fill memory, free every other block, ask for a block larger than any hole: MoonBright
    /// against a caching allocator that cannot remap, on the same backend.
    Demo {
        /// auto (cuda when a GPU is present), cuda or host.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Memory the scenario may use, in MiB.
        #[arg(long, default_value_t = 4096)]
        cap_mib: u64,
        /// Size of each block, in MiB (the big request is four blocks).
        #[arg(long, default_value_t = 16)]
        block_mib: u64,
    },
    /// Replay an allocation trace through MoonBright: `alloc` events are allocations on their
    /// stream, `free_completed` events frees. Reads our CSV (gzipped or not), the JSON of a
    /// PyTorch memory snapshot, or RMM's logging CSV. Exits with 2 when an allocation failed.
    Replay {
        /// The trace file.
        trace: PathBuf,
        #[command(flatten)]
        args: ReplayArgs,
        /// Write a PNG of allocated and reserved bytes over events.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Write every figure as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Replay only the first N events.
        #[arg(long)]
        limit: Option<usize>,
        /// Convert the trace to our CSV (gzipped when the name ends in .gz) and exit.
        #[arg(long)]
        convert: Option<PathBuf>,
    },
    /// Replay every trace in a directory (*.csv, *.csv.gz, *.json) and write a markdown table
    /// and JSON of peak reserved / peak requested beside PyTorch's recorded figures.
    BenchTraces {
        /// Directory of traces.
        dir: PathBuf,
        #[command(flatten)]
        args: ReplayArgs,
        /// Where to write results.md and results.json [default: bench/results/traces-BACKEND].
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// An exit status: 0 success, 1 failure, 2 a failed allocation in a replay (or a usage error).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitCode(pub u8);

impl ExitCode {
    /// 0.
    pub const SUCCESS: ExitCode = ExitCode(0);
    /// 1.
    pub const FAILURE: ExitCode = ExitCode(1);
}

impl From<u8> for ExitCode {
    fn from(code: u8) -> Self {
        ExitCode(code)
    }
}

/// Runs the command with `args` (the first is the program's name, as `std::env::args_os`
/// gives it) and returns its exit status. Help and usage errors are printed as clap prints
/// them (help with status 0, a usage error with 2); nothing exits the process.
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    let command = cli.command.unwrap_or(Command::Demo {
        backend: "auto".into(),
        cap_mib: 4096,
        block_mib: 16,
    });
    let result = match command {
        Command::Demo { backend, cap_mib, block_mib } => {
            demo::demo(&backend, cap_mib, block_mib).map_err(|e| e.to_string())
        }
        Command::Replay { trace, args, plot, json, limit, convert } => {
            replay_command(&trace, &args, plot.as_deref(), json.as_deref(), limit, convert)
        }
        Command::BenchTraces { dir, args, out } => bench::command(&dir, &args, out),
    };
    match result {
        Ok(code) => code.0.into(),
        Err(e) => {
            eprintln!("moonbright: {e}");
            ExitCode::FAILURE.0.into()
        }
    }
}

fn replay_command(
    path: &Path,
    args: &ReplayArgs,
    plot: Option<&Path>,
    json_out: Option<&Path>,
    limit: Option<usize>,
    convert: Option<PathBuf>,
) -> Result<ExitCode, String> {
    if let Some(out) = convert {
        let mut trace = Trace::load(path).map_err(|e| format!("{}: {e}", path.display()))?;
        if let Some(n) = limit {
            trace.events.truncate(n);
        }
        trace.save(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        println!("wrote {} events to {}", trace.events.len(), out.display());
        return Ok(ExitCode::SUCCESS);
    }
    let o = replay::run(path, args, limit, if plot.is_some() { replay::PLOT_POINTS } else { 0 })?;
    replay::print_summary(&o);
    if let Some(p) = plot {
        plot::draw(&o, p)?;
        println!("plot: {}", p.display());
    }
    if let Some(j) = json_out {
        let text = serde_json::to_string_pretty(&o.to_json()).map_err(|e| e.to_string())?;
        std::fs::write(j, text + "\n").map_err(|e| format!("{}: {e}", j.display()))?;
        println!("json: {}", j.display());
    }
    Ok(if o.failed_allocs() > 0 { ExitCode::from(2) } else { ExitCode::SUCCESS })
}
