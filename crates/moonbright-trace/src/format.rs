//! The trace format: events and their kinds, the CSV (plain or gzipped) read and written, the
//! loader that recognises every format, and the figures a trace records about itself.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::str::FromStr;

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

pub(crate) fn bad(record: u64, message: impl Into<String>) -> TraceError {
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
    /// The trace format's CSV (`seq,action,addr,size,stream,dt_us`).
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

/// Wraps a reader so that gzipped input is decompressed, whatever the file is called.
pub(crate) fn maybe_gunzip<'a, R: Read + 'a>(reader: R) -> io::Result<Box<dyn BufRead + 'a>> {
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

    /// Reads the trace format's CSV, gzipped or not.
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

    /// Writes the trace format's CSV.
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

    /// Writes the trace format's CSV, gzipped.
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

    /// The recorder's reserved bytes over events (`segment_*` events), the highest of each
    /// stretch of events, stretched as [`crate::replay`] stretches its series for `points`
    /// points. Empty when the trace has no segment events.
    pub fn recorded_reserved_series(&self, points: usize) -> Vec<u64> {
        let segment = |a| {
            matches!(
                a,
                Action::SegmentAlloc
                    | Action::SegmentFree
                    | Action::SegmentMap
                    | Action::SegmentUnmap
            )
        };
        if points == 0 || !self.events.iter().any(|e| segment(e.action)) {
            return vec![];
        }
        let stretch = self.events.len().div_ceil(points).max(1);
        let (mut cur, mut best, mut out) = (0u64, 0u64, Vec::new());
        for (i, e) in self.events.iter().enumerate() {
            match e.action {
                Action::SegmentAlloc | Action::SegmentMap => cur += e.size,
                Action::SegmentFree | Action::SegmentUnmap => cur = cur.saturating_sub(e.size),
                _ => {}
            }
            best = best.max(cur);
            if (i + 1) % stretch == 0 || i + 1 == self.events.len() {
                out.push(best);
                best = 0;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_round_trip_their_names() {
        for a in Action::ALL {
            assert_eq!(a.name().parse::<Action>().unwrap(), a);
        }
        assert!("malloc".parse::<Action>().is_err());
    }
}
