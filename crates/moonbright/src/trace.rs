//! Allocation traces: the compact CSV format, importers from PyTorch memory snapshots and RMM's
//! logging CSV, the figures a trace records about itself, and replay through an [`Allocator`].
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

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::allocator::Allocator;
use crate::driver::{CallCounts, CallKind, CallTimes, DevicePtr, StreamHandle};

/// The header line of the trace format.
pub const HEADER: [&str; 6] = ["seq", "action", "addr", "size", "stream", "dt_us"];

/// Errors reading or importing a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read or written.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The CSV layer failed (bad quoting, wrong field count...).
    #[error("csv: {0}")]
    Csv(#[from] csv::Error),
    /// The JSON could not be parsed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// A record was well formed as CSV or JSON but not as a trace.
    #[error("record {record}: {message}")]
    Format {
        /// 1-based record number (data lines for CSV, entries for JSON).
        record: u64,
        /// What was wrong.
        message: String,
    },
}

fn bad(record: u64, message: impl Into<String>) -> TraceError {
    TraceError::Format { record, message: message.into() }
}

/// An event's kind, with PyTorch's `device_traces` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A block was allocated (`size` is the size asked for).
    Alloc,
    /// The program freed a block; its memory is reusable once the stream has passed the free.
    FreeRequested,
    /// The free has completed: the block is no longer live.
    FreeCompleted,
    /// The recording allocator reserved a segment from the driver.
    SegmentAlloc,
    /// The recording allocator gave a segment back.
    SegmentFree,
    /// Expandable segments: pages mapped into a segment.
    SegmentMap,
    /// Expandable segments: pages unmapped from a segment.
    SegmentUnmap,
}

impl Action {
    /// Every action, in the order of their names.
    pub const ALL: [Action; 7] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
    ];

    /// PyTorch's name for the action.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Action {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Action::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| {
            format!(
                "unknown action `{s}` (expected one of {})",
                Action::ALL.map(Action::name).join(", ")
            )
        })
    }
}

/// One event of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// Sequence number (the line's position in the recording).
    pub seq: u64,
    /// What happened.
    pub action: Action,
    /// The address the recorder saw (a block's or a segment's).
    pub addr: u64,
    /// Bytes: asked for by an `alloc`, of the segment for segment events.
    pub size: u64,
    /// The recorder's stream id.
    pub stream: u64,
    /// Microseconds since the previous event, when recorded.
    pub dt_us: Option<u64>,
}

/// An allocation trace: events in the order they happened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// The events.
    pub events: Vec<Event>,
}

/// What a trace records about itself, computed by [`Trace::recorded`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordedFigures {
    /// All events.
    pub events: u64,
    /// `alloc` events.
    pub allocs: u64,
    /// `free_completed` events.
    pub frees: u64,
    /// `free_completed` events of addresses that were not live.
    pub unknown_frees: u64,
    /// Blocks still live at the end.
    pub live_at_end: u64,
    /// Highest sum of live requested bytes (from `alloc` to `free_completed`).
    pub peak_requested: u64,
    /// Highest sum of the recorder's segments (`segment_alloc`/`segment_map` add,
    /// `segment_free`/`segment_unmap` subtract), when the trace has segment events.
    pub peak_reserved: Option<u64>,
    /// Distinct streams seen.
    pub streams: u64,
    /// Sum of `dt_us`: the recording's duration in microseconds.
    pub duration_us: u64,
}

impl RecordedFigures {
    /// The recorder's peak reserved over its peak requested bytes, when the trace has one.
    pub fn reserved_over_requested(&self) -> Option<f64> {
        match self.peak_reserved {
            Some(r) if self.peak_requested > 0 => Some(r as f64 / self.peak_requested as f64),
            _ => None,
        }
    }
}

/// The formats [`Trace::load`] recognises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// This module's CSV (`seq,action,addr,size,stream,dt_us`).
    Csv,
    /// RMM's logging CSV (`Thread,Time,Action,Pointer,Size,Stream`).
    RmmCsv,
    /// The JSON form of `torch.cuda.memory._snapshot()` (its `device_traces`, device 0).
    SnapshotJson,
}

fn parse_u64(field: &[u8], record: u64, name: &str) -> Result<u64, TraceError> {
    let s = std::str::from_utf8(field).map_err(|_| bad(record, format!("{name} is not UTF-8")))?;
    let s = s.trim();
    s.parse::<u64>().map_err(|_| bad(record, format!("{name} `{s}` is not a non-negative integer")))
}

/// Parses an integer written in decimal or, with a `0x` prefix, in hexadecimal.
fn parse_int(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// Wraps a reader so that gzipped input is decompressed, whatever the file is called.
fn maybe_gunzip<'a, R: Read + 'a>(reader: R) -> io::Result<Box<dyn BufRead + 'a>> {
    let mut buf = BufReader::with_capacity(1 << 16, reader);
    let gz = buf.fill_buf()?.starts_with(&[0x1f, 0x8b]);
    Ok(if gz {
        Box::new(BufReader::with_capacity(1 << 16, flate2::bufread::MultiGzDecoder::new(buf)))
    } else {
        Box::new(buf)
    })
}

impl Trace {
    /// Reads a trace from a file in any [`Format`], gzipped or not (see [`Trace::load_reader`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| {
            TraceError::Io(io::Error::new(e.kind(), format!("{}: {e}", path.display())))
        })?;
        Trace::load_reader(file).map(|(t, _)| t)
    }

    /// Reads a trace in any [`Format`], gzipped or not, and says which format it was: JSON when
    /// the text starts with `{`, RMM's CSV when the header starts with `Thread`, else ours.
    pub fn load_reader(reader: impl Read) -> Result<(Trace, Format), TraceError> {
        let mut r = maybe_gunzip(reader)?;
        let head = r.fill_buf()?;
        let first = head.iter().find(|b| !b.is_ascii_whitespace()).copied();
        if first == Some(b'{') {
            return Ok((Trace::from_snapshot_json(r, 0)?, Format::SnapshotJson));
        }
        let rmm = head.len() >= 6 && head[..6].eq_ignore_ascii_case(b"thread");
        if rmm {
            Ok((Trace::from_rmm_csv(r)?, Format::RmmCsv))
        } else {
            Ok((Trace::read_csv(r)?, Format::Csv))
        }
    }

    /// Reads this module's CSV, gzipped or not.
    pub fn read_csv(reader: impl Read) -> Result<Trace, TraceError> {
        let r = maybe_gunzip(reader)?;
        let mut csv = csv::ReaderBuilder::new().has_headers(true).from_reader(r);
        let headers = csv.byte_headers()?.clone();
        let ok =
            headers.len() >= 5 && headers.iter().zip(HEADER).all(|(h, want)| h == want.as_bytes());
        if !ok {
            return Err(bad(
                0,
                format!(
                    "header is `{}`, expected `{}`",
                    headers.iter().map(String::from_utf8_lossy).collect::<Vec<_>>().join(","),
                    HEADER.join(",")
                ),
            ));
        }
        let mut events = Vec::new();
        let mut rec = csv::ByteRecord::new();
        let mut n = 0u64;
        while csv.read_byte_record(&mut rec)? {
            n += 1;
            let action = std::str::from_utf8(&rec[1])
                .map_err(|_| bad(n, "action is not UTF-8"))?
                .parse::<Action>()
                .map_err(|e| bad(n, e))?;
            let dt_us = match rec.get(5) {
                Some(f) if !f.trim_ascii().is_empty() => Some(parse_u64(f, n, "dt_us")?),
                _ => None,
            };
            events.push(Event {
                seq: parse_u64(&rec[0], n, "seq")?,
                action,
                addr: parse_u64(&rec[2], n, "addr")?,
                size: parse_u64(&rec[3], n, "size")?,
                stream: parse_u64(&rec[4], n, "stream")?,
                dt_us,
            });
        }
        Ok(Trace { events })
    }

    /// Writes this module's CSV.
    pub fn write_csv(&self, writer: impl Write) -> Result<(), TraceError> {
        let mut w = BufWriter::with_capacity(1 << 16, writer);
        writeln!(w, "{}", HEADER.join(","))?;
        for e in &self.events {
            write!(w, "{},{},{},{},{},", e.seq, e.action, e.addr, e.size, e.stream)?;
            match e.dt_us {
                Some(dt) => writeln!(w, "{dt}")?,
                None => writeln!(w)?,
            }
        }
        w.flush()?;
        Ok(())
    }

    /// Writes this module's CSV, gzipped.
    pub fn write_csv_gz(&self, writer: impl Write) -> Result<(), TraceError> {
        let mut gz = flate2::write::GzEncoder::new(writer, flate2::Compression::default());
        self.write_csv(&mut gz)?;
        gz.finish()?;
        Ok(())
    }

    /// Writes the trace to `path`, gzipped when the name ends in `.gz`.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), TraceError> {
        let path = path.as_ref();
        let file = File::create(path)?;
        if path.extension().is_some_and(|e| e == "gz") {
            self.write_csv_gz(file)
        } else {
            self.write_csv(file)
        }
    }

    /// Imports device `device`'s trace from the JSON form of `torch.cuda.memory._snapshot()`: a
    /// dict whose `device_traces` is a list, one per device, of lists of events
    /// `{"action", "addr", "size", "stream", "time_us", ...}`. Other keys (`frames`, say) are
    /// ignored, and so are actions other than [`Action`]'s (`oom`, `snapshot`). A bare list of
    /// per-device lists is accepted too. Gzipped input is decompressed.
    pub fn from_snapshot_json(reader: impl Read, device: usize) -> Result<Trace, TraceError> {
        let r = maybe_gunzip(reader)?;
        let value: serde_json::Value = serde_json::from_reader(r)?;
        let traces = match &value {
            serde_json::Value::Object(m) => m
                .get("device_traces")
                .ok_or_else(|| bad(0, "the snapshot has no `device_traces`"))?,
            other => other,
        };
        let devices =
            traces.as_array().ok_or_else(|| bad(0, "`device_traces` is not a list of lists"))?;
        let Some(list) = devices.get(device) else {
            return if devices.is_empty() && device == 0 {
                Ok(Trace::default())
            } else {
                Err(bad(0, format!("no trace for device {device} ({} devices)", devices.len())))
            };
        };
        let list = list
            .as_array()
            .ok_or_else(|| bad(0, format!("`device_traces[{device}]` is not a list")))?;
        let mut events = Vec::with_capacity(list.len());
        let mut last_time: Option<u64> = None;
        for (i, entry) in list.iter().enumerate() {
            let n = i as u64 + 1;
            let obj = entry.as_object().ok_or_else(|| bad(n, "event is not an object"))?;
            let Some(action) = obj.get("action").and_then(|a| a.as_str()) else {
                return Err(bad(n, "event has no `action` string"));
            };
            let Ok(action) = action.parse::<Action>() else { continue };
            let int = |key: &str, required: bool| -> Result<u64, TraceError> {
                match obj.get(key) {
                    None | Some(serde_json::Value::Null) if !required => Ok(0),
                    Some(v) => v
                        .as_u64()
                        .or_else(|| v.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
                        .or_else(|| v.as_str().and_then(parse_int))
                        .ok_or_else(|| bad(n, format!("`{key}` is not a non-negative integer"))),
                    None => Err(bad(n, format!("event has no `{key}`"))),
                }
            };
            let time = match obj.get("time_us") {
                Some(t) if !t.is_null() => Some(int("time_us", true)?),
                _ => None,
            };
            let dt_us = match (time, last_time) {
                (Some(t), Some(l)) => Some(t.saturating_sub(l)),
                (Some(_), None) => Some(0),
                (None, _) => None,
            };
            if time.is_some() {
                last_time = time;
            }
            events.push(Event {
                seq: events.len() as u64,
                action,
                addr: int("addr", true)?,
                size: int("size", true)?,
                stream: int("stream", false)?,
                dt_us,
            });
        }
        Ok(Trace { events })
    }

    /// Imports RMM's logging CSV (`logging_resource_adaptor`): `Thread,Time,Action,Pointer,Size,
    /// Stream`. `allocate` becomes an `alloc` and `free` a `free_completed` (RMM frees are
    /// stream-ordered and reusable at once on their stream); `allocate failure` and other
    /// actions are skipped. Pointers and streams may be hex (`0x...`) or decimal; streams become
    /// ids in order of first appearance, with RMM's default stream (0) kept as 0. Time is seconds
    /// (`12.5`) or a clock time as RMM prints it (`14:02:11.123456`).
    pub fn from_rmm_csv(reader: impl Read) -> Result<Trace, TraceError> {
        let r = maybe_gunzip(reader)?;
        let mut csv =
            csv::ReaderBuilder::new().has_headers(true).trim(csv::Trim::All).from_reader(r);
        let headers = csv.headers()?.clone();
        let col = |name: &str| {
            headers
                .iter()
                .position(|h| h.eq_ignore_ascii_case(name))
                .ok_or_else(|| bad(0, format!("RMM log has no `{name}` column")))
        };
        let (c_time, c_action, c_ptr, c_size) =
            (col("Time")?, col("Action")?, col("Pointer")?, col("Size")?);
        let c_stream = col("Stream").ok();
        let mut streams: HashMap<u64, u64> = HashMap::from([(0, 0)]);
        let mut events = Vec::new();
        let mut last_time: Option<f64> = None;
        let mut rec = csv::StringRecord::new();
        let mut n = 0u64;
        while csv.read_record(&mut rec)? {
            n += 1;
            let action = match rec.get(c_action).unwrap_or("").to_ascii_lowercase().as_str() {
                "allocate" => Action::Alloc,
                "free" => Action::FreeCompleted,
                _ => continue,
            };
            let field = |c: usize, name: &str| {
                let s = rec.get(c).unwrap_or("");
                parse_int(s).ok_or_else(|| bad(n, format!("{name} `{s}` is not an integer")))
            };
            let time_s = rec.get(c_time).unwrap_or("");
            let time = parse_rmm_time(time_s)
                .ok_or_else(|| bad(n, format!("time `{time_s}` unreadable")))?;
            let dt_us = Some(match last_time {
                // A clock time wraps at midnight: a step back is a day forward.
                Some(l) if time < l => ((time + 86_400.0 - l) * 1e6).round() as u64,
                Some(l) => ((time - l) * 1e6).round() as u64,
                None => 0,
            });
            last_time = Some(time);
            let stream = match c_stream {
                Some(c) => {
                    let raw = field(c, "stream")?;
                    let next = streams.len() as u64;
                    *streams.entry(raw).or_insert(next)
                }
                None => 0,
            };
            events.push(Event {
                seq: events.len() as u64,
                action,
                addr: field(c_ptr, "pointer")?,
                size: field(c_size, "size")?,
                stream,
                dt_us,
            });
        }
        Ok(Trace { events })
    }

    /// The figures the trace records about itself: its peak of live requested bytes and, when it
    /// has segment events, the recorder's peak reserved bytes.
    pub fn recorded(&self) -> RecordedFigures {
        let mut f = RecordedFigures { events: self.events.len() as u64, ..Default::default() };
        let mut live: HashMap<u64, u64> = HashMap::new();
        let mut streams: HashMap<u64, ()> = HashMap::new();
        let (mut requested, mut reserved, mut has_segments) = (0u64, 0u64, false);
        let mut peak_reserved = 0u64;
        for e in &self.events {
            f.duration_us += e.dt_us.unwrap_or(0);
            streams.insert(e.stream, ());
            match e.action {
                Action::Alloc => {
                    f.allocs += 1;
                    if let Some(old) = live.insert(e.addr, e.size) {
                        requested -= old; // an address reused without a free: replace it
                    }
                    requested += e.size;
                    f.peak_requested = f.peak_requested.max(requested);
                }
                Action::FreeCompleted => {
                    f.frees += 1;
                    match live.remove(&e.addr) {
                        Some(size) => requested -= size,
                        None => f.unknown_frees += 1,
                    }
                }
                Action::FreeRequested => {}
                Action::SegmentAlloc | Action::SegmentMap => {
                    has_segments = true;
                    reserved += e.size;
                    peak_reserved = peak_reserved.max(reserved);
                }
                Action::SegmentFree | Action::SegmentUnmap => {
                    has_segments = true;
                    reserved = reserved.saturating_sub(e.size);
                }
            }
        }
        f.live_at_end = live.len() as u64;
        f.streams = streams.len() as u64;
        f.peak_reserved = has_segments.then_some(peak_reserved);
        f
    }
}

/// Parses RMM's time: seconds, or `H:M:S[.frac]`; returns seconds.
fn parse_rmm_time(s: &str) -> Option<f64> {
    let s = s.trim();
    if s.is_empty() {
        return Some(0.0);
    }
    if !s.contains(':') {
        return s.parse::<f64>().ok().filter(|t| t.is_finite());
    }
    let mut secs = 0.0;
    for part in s.split(':') {
        let v: f64 = part.parse().ok().filter(|v: &f64| v.is_finite() && *v >= 0.0)?;
        secs = secs * 60.0 + v;
    }
    Some(secs)
}

/// What a replay does besides allocating and freeing.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// Replay at most this many events.
    pub limit: Option<usize>,
    /// Keep about this many points of allocated and reserved bytes over events for a plot
    /// (each point the highest values in its stretch of events); 0 keeps none.
    pub series_points: usize,
    /// Keep the recording's pace, sped up this many times: each event waits until the
    /// recorded time since the first (the sum of `dt_us`), divided by this, has passed; a
    /// late event goes at once. `None`: as fast as it goes. Paced, the background worker sees
    /// the idle spells a program leaves it; unpaced, it sees none.
    pub pace: Option<f64>,
}

/// One point of a replay's series: the highest allocated and reserved bytes over a stretch of
/// events ending at `event`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeriesPoint {
    /// Index of the stretch's last event.
    pub event: u64,
    /// Highest allocated (requested, live) bytes in the stretch.
    pub allocated: u64,
    /// Highest reserved (physical) bytes in the stretch.
    pub reserved: u64,
}

/// What a replay measured. Peaks and driver calls are in the allocator's [`crate::Stats`].
#[derive(Clone, Debug, Default)]
pub struct ReplayReport {
    /// Events replayed (all actions).
    pub events: u64,
    /// `alloc` events replayed.
    pub allocs: u64,
    /// `free_completed` events that freed one of our allocations.
    pub frees: u64,
    /// `free_completed` events of addresses the replay never allocated (skipped).
    pub unknown_frees: u64,
    /// `free_completed` events of blocks whose allocation failed (skipped).
    pub frees_of_failed: u64,
    /// Allocations that failed (out of memory, or any other error).
    pub failed_allocs: u64,
    /// The first failure's message.
    pub first_error: Option<String>,
    /// Allocations still live at the end of the events, freed afterwards (not timed).
    pub live_at_end: u64,
    /// Time spent replaying, without loading the trace or the final frees.
    pub wall: Duration,
    /// Latency of each successful allocation, in nanoseconds, sorted.
    pub alloc_latency_ns: Vec<u64>,
    /// Latency of each free, in nanoseconds, sorted.
    pub free_latency_ns: Vec<u64>,
    /// Allocated and reserved bytes over events (see [`ReplayOptions::series_points`]).
    pub series: Vec<SeriesPoint>,
    /// The slowest allocations, slowest first (at most [`SLOWEST_KEPT`]).
    pub slowest: Vec<SlowAlloc>,
}

/// How many of the slowest allocations a replay describes.
pub const SLOWEST_KEPT: usize = 5;

/// One of a replay's slowest allocations: which, how long, and the driver calls made while it
/// ran, by any thread (the background worker's too) and by the request's own thread, to tell
/// what a tail is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlowAlloc {
    /// The event's index in the trace.
    pub event: u64,
    pub size: u64,
    pub ns: u64,
    /// Calls by kind meanwhile, by any thread.
    pub calls: CallCounts,
    /// Nanoseconds in the virtual-memory calls of each kind meanwhile, by any thread (calls of
    /// two threads at once both count).
    pub call_ns: [u64; CallKind::ALL.len()],
    /// Of those, the calls the request's own thread made, and their nanoseconds.
    pub own_calls: CallCounts,
    pub own_ns: [u64; CallKind::ALL.len()],
}

impl SlowAlloc {
    /// `(kind, calls, nanoseconds)` for each kind called meanwhile, by any thread.
    pub fn calls_made(&self) -> impl Iterator<Item = (CallKind, u64, u64)> + '_ {
        CallKind::ALL
            .iter()
            .map(|&k| (k, self.calls.get(k), self.call_ns[k as usize]))
            .filter(|&(_, n, _)| n > 0)
    }

    /// The same for the calls the request's own thread made.
    pub fn own_calls_made(&self) -> impl Iterator<Item = (CallKind, u64, u64)> + '_ {
        CallKind::ALL
            .iter()
            .map(|&k| (k, self.own_calls.get(k), self.own_ns[k as usize]))
            .filter(|&(_, n, _)| n > 0)
    }

    /// The same for the calls other threads made meanwhile (the worker's, in a replay).
    pub fn others_calls_made(&self) -> impl Iterator<Item = (CallKind, u64, u64)> + '_ {
        CallKind::ALL
            .iter()
            .map(|&k| {
                let i = k as usize;
                (
                    k,
                    self.calls.get(k).saturating_sub(self.own_calls.get(k)),
                    self.call_ns[i].saturating_sub(self.own_ns[i]),
                )
            })
            .filter(|&(_, n, _)| n > 0)
    }
}

/// Keeps `a` among the slowest (slowest first, at most `SLOWEST_KEPT`).
fn keep_if_slow(slowest: &mut Vec<SlowAlloc>, a: SlowAlloc) {
    if slowest.len() == SLOWEST_KEPT && slowest.last().is_some_and(|s| s.ns >= a.ns) {
        return;
    }
    let at = slowest.partition_point(|s| s.ns >= a.ns);
    slowest.insert(at, a);
    slowest.truncate(SLOWEST_KEPT);
}

impl ReplayReport {
    /// The `q`-quantile (0..=1) of the allocation latencies in nanoseconds (nearest rank).
    pub fn alloc_latency_quantile(&self, q: f64) -> Option<u64> {
        quantile(&self.alloc_latency_ns, q)
    }

    /// The `q`-quantile (0..=1) of the free latencies in nanoseconds (nearest rank).
    pub fn free_latency_quantile(&self, q: f64) -> Option<u64> {
        quantile(&self.free_latency_ns, q)
    }
}

/// The `q`-quantile of sorted samples, nearest rank.
pub fn quantile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.saturating_sub(1).min(sorted.len() - 1)])
}

/// Waits until `t`: sleeps through all but the last 200 µs of a long wait, spins the rest (a
/// sleep overshoots by tens of microseconds, and most of a trace's gaps are shorter).
fn wait_until(t: Instant) {
    const SPIN: Duration = Duration::from_micros(200);
    let now = Instant::now();
    if t > now + SPIN {
        std::thread::sleep(t - now - SPIN);
    }
    while Instant::now() < t {
        std::hint::spin_loop();
    }
}

/// How often [`replay`] reports progress, in events.
pub const PROGRESS_EVERY: usize = 1 << 14;

/// Replays `trace` through `alloc`: each `alloc` is a `malloc_async(size, StreamHandle(stream))`
/// and each `free_completed` a `free` of the allocation made for that address; other events are
/// skipped. Failed allocations are counted and the replay goes on. `progress` is called with the
/// number of events done every [`PROGRESS_EVERY`] events and at the end. Allocations still live
/// at the end are freed after the timed part.
pub fn replay(
    alloc: &Allocator,
    trace: &Trace,
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(u64),
) -> ReplayReport {
    let events = match opts.limit {
        Some(n) => &trace.events[..n.min(trace.events.len())],
        None => &trace.events[..],
    };
    let mut rep = ReplayReport::default();
    let mut ours: HashMap<u64, DevicePtr> = HashMap::new();
    let mut failed: HashMap<u64, ()> = HashMap::new();
    rep.alloc_latency_ns.reserve(events.len() / 3 + 1);
    rep.free_latency_ns.reserve(events.len() / 3 + 1);
    let stretch = if opts.series_points > 0 {
        events.len().div_ceil(opts.series_points).max(1)
    } else {
        usize::MAX
    };
    let mut point = SeriesPoint { event: 0, allocated: 0, reserved: 0 };
    let start = Instant::now();
    let mut due_us = 0.0;
    for (i, e) in events.iter().enumerate() {
        if let Some(speed) = opts.pace.filter(|s| *s > 0.0) {
            due_us += e.dt_us.unwrap_or(0) as f64 / speed;
            wait_until(start + Duration::from_secs_f64(due_us / 1e6));
        }
        match e.action {
            Action::Alloc => {
                rep.allocs += 1;
                let driver = alloc.driver();
                let (calls, times) = (driver.counts(), driver.times());
                let (own_calls, own_times) = crate::driver::thread_calls();
                let t = Instant::now();
                let r = alloc.malloc_async(e.size as usize, StreamHandle(e.stream));
                let dt = t.elapsed().as_nanos() as u64;
                match r {
                    Ok(ptr) => {
                        rep.alloc_latency_ns.push(dt);
                        if rep.slowest.len() < SLOWEST_KEPT
                            || rep.slowest.last().is_some_and(|s| s.ns < dt)
                        {
                            let spent = |after: CallTimes, before: CallTimes| {
                                std::array::from_fn(|k| after.total_ns[k] - before.total_ns[k])
                            };
                            let (own_after, own_times_after) = crate::driver::thread_calls();
                            let a = SlowAlloc {
                                event: i as u64,
                                size: e.size,
                                ns: dt,
                                calls: driver.counts().since(&calls),
                                call_ns: spent(driver.times(), times),
                                own_calls: own_after.since(&own_calls),
                                own_ns: spent(own_times_after, own_times),
                            };
                            keep_if_slow(&mut rep.slowest, a);
                        }
                        if let Some(old) = ours.insert(e.addr, ptr) {
                            // The recorder reused an address without a free: drop the old block.
                            let _ = alloc.free(old);
                        }
                        failed.remove(&e.addr);
                    }
                    Err(err) => {
                        rep.failed_allocs += 1;
                        rep.first_error.get_or_insert_with(|| err.to_string());
                        failed.insert(e.addr, ());
                    }
                }
            }
            Action::FreeCompleted => match ours.remove(&e.addr) {
                Some(ptr) => {
                    let t = Instant::now();
                    let r = alloc.free(ptr);
                    rep.free_latency_ns.push(t.elapsed().as_nanos() as u64);
                    if let Err(err) = r {
                        rep.first_error.get_or_insert_with(|| format!("free: {err}"));
                    }
                    rep.frees += 1;
                }
                None if failed.remove(&e.addr).is_some() => rep.frees_of_failed += 1,
                None => rep.unknown_frees += 1,
            },
            _ => {}
        }
        if stretch != usize::MAX {
            let s = alloc.stats();
            point.allocated = point.allocated.max(s.allocated_bytes.current);
            point.reserved = point.reserved.max(s.reserved_bytes.current);
            if (i + 1) % stretch == 0 || i + 1 == events.len() {
                point.event = i as u64;
                rep.series.push(point);
                point = SeriesPoint { event: 0, allocated: 0, reserved: 0 };
            }
        }
        if (i + 1) % PROGRESS_EVERY == 0 {
            progress(i as u64 + 1);
        }
    }
    rep.wall = start.elapsed();
    rep.events = events.len() as u64;
    progress(rep.events);
    rep.live_at_end = ours.len() as u64;
    for (_, ptr) in ours.drain() {
        let _ = alloc.free(ptr);
    }
    rep.alloc_latency_ns.sort_unstable();
    rep.free_latency_ns.sort_unstable();
    rep
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn actions_round_trip_their_names() {
        for a in Action::ALL {
            assert_eq!(a.name().parse::<Action>().unwrap(), a);
        }
        assert!("malloc".parse::<Action>().is_err());
    }

    #[test]
    fn rmm_times_parse() {
        assert_eq!(parse_rmm_time("1.5"), Some(1.5));
        assert_eq!(parse_rmm_time("01:02:03.5"), Some(3723.5));
        assert_eq!(parse_rmm_time("x"), None);
    }

    #[test]
    fn the_slowest_allocations_are_kept_slowest_first() {
        let mut kept = Vec::new();
        let slow = |ns| SlowAlloc {
            event: ns,
            size: 1,
            ns,
            calls: CallCounts::default(),
            call_ns: [0; CallKind::ALL.len()],
            own_calls: CallCounts::default(),
            own_ns: [0; CallKind::ALL.len()],
        };
        for ns in [5, 1, 9, 3, 7, 8, 2, 10, 4] {
            keep_if_slow(&mut kept, slow(ns));
        }
        let ns: Vec<u64> = kept.iter().map(|s| s.ns).collect();
        assert_eq!(ns, [10, 9, 8, 7, 5]);
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(quantile(&v, 0.5), Some(50));
        assert_eq!(quantile(&v, 0.99), Some(99));
        assert_eq!(quantile(&v, 1.0), Some(100));
        assert_eq!(quantile(&v, 0.0), Some(1));
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn ints_parse_in_hex_and_decimal() {
        assert_eq!(parse_int("0x10"), Some(16));
        assert_eq!(parse_int(" 42 "), Some(42));
        assert_eq!(parse_int("zz"), None);
    }
}
