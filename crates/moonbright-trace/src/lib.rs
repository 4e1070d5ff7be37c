//! MoonBright's allocation traces: the compact CSV format, importers from PyTorch memory
//! snapshots and RMM's logging CSV, the figures a trace records about itself, and replay
//! through a [`moonbright::Allocator`] with its report (latencies, slowest allocations, series).
//!
//! The format is the one of the shared traces recorded from PyTorch, plain or gzipped:
//!
//! ```text
//! seq,action,addr,size,stream,dt_us
//! 0,segment_alloc,140230816432128,207618048,0,0
//! 1,alloc,140230816432128,205852672,0,7
//! ```
//!
//! `action` takes PyTorch's names ([`Action`]); `addr` and `size` are decimal; `stream` is the
//! recorder's stream id; `dt_us` is microseconds since the previous event and may be empty. A
//! block is live from its `alloc` to its `free_completed`.
//!
//! ```no_run
//! use moonbright::{Allocator, Options};
//! use moonbright_trace::{replay, ReplayOptions, Trace};
//! let trace = Trace::load("traces/trace_resnet.csv.gz")?;
//! let alloc = Allocator::new(Options::default())?;
//! let report = replay(&alloc, &trace, &ReplayOptions::default(), &mut |_| {});
//! println!("alloc p99: {:?} ns", report.alloc_latency_quantile(0.99));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod format;
mod import;
mod replay;
mod stats;

pub use format::{Action, Event, Format, RecordedFigures, Trace, TraceError, HEADER};
pub use replay::{
    replay, ReplayOptions, ReplayReport, SeriesPoint, SlowAlloc, PROGRESS_EVERY, SLOWEST_KEPT,
};
pub use stats::quantile;
