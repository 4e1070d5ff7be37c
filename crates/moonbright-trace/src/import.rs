//! Importers: the JSON of a PyTorch memory snapshot (`torch.cuda.memory._snapshot()`) and RMM's
//! logging CSV (`logging_resource_adaptor`), each turned into a [`Trace`].

use std::collections::HashMap;
use std::io::Read;

use crate::format::{bad, maybe_gunzip, Action, Event, Trace, TraceError};

impl Trace {
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
}

/// Parses an integer written in decimal or, with a `0x` prefix, in hexadecimal.
fn parse_int(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmm_times_parse() {
        assert_eq!(parse_rmm_time("1.5"), Some(1.5));
        assert_eq!(parse_rmm_time("01:02:03.5"), Some(3723.5));
        assert_eq!(parse_rmm_time("x"), None);
    }

    #[test]
    fn ints_parse_in_hex_and_decimal() {
        assert_eq!(parse_int("0x10"), Some(16));
        assert_eq!(parse_int(" 42 "), Some(42));
        assert_eq!(parse_int("zz"), None);
    }
}
