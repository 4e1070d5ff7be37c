//! `MOONBRIGHT_ALLOC_CONF`: options as text, in the shape of PyTorch's `PYTORCH_ALLOC_CONF`
//! (`key:value,key:value`), and the same keys as `(key, value)` pairs (Python keyword arguments).
//!
//! ```
//! use moonbright::conf::parse_conf;
//! let opts = parse_conf("backend:host,cap:12GiB,unmap_batch:32")?;
//! assert_eq!(opts.cap_bytes, Some(12 << 30));
//! # Ok::<(), moonbright::Error>(())
//! ```
//!
//! Unknown keys and bad values are refused with [`Error::InvalidOption`], naming the key and what
//! is allowed. The resulting options are checked with [`Options::check`].

use crate::config::{BackendKind, Options};
use crate::driver::host::HostDriverCosts;
use crate::error::{Error, Result};

/// The environment variable read by the Python package.
pub const ENV_VAR: &str = "MOONBRIGHT_ALLOC_CONF";

/// Every key, with what its value may be.
pub const KEYS: &[(&str, &str)] = &[
    (
        "profile",
        "memory, balanced or latency: the placement policy as a whole (options set beside it win)",
    ),
    ("backend", "auto, cuda or host"),
    ("device", "a CUDA device ordinal, 0 or more"),
    ("cap", "bytes, with an optional suffix B, KiB, MiB, GiB, TiB, KB, MB, GB, TB (e.g. 12GiB)"),
    ("cap_fraction", "a fraction of device memory in (0, 1]"),
    ("host_page_size", "bytes: a power of two from 4KiB to 1GiB"),
    ("host_capacity", "bytes of simulated memory for the host backend"),
    (
        "host_driver_costs",
        "none, cuda or device_tables: the driver costs the host backend charges each call (time only)",
    ),
    ("max_chunk", "bytes: a power of two of at most 64GiB"),
    (
        "max_chunk_repeated",
        "bytes: 0 (as max_chunk) or a power of two of at most 64GiB; new chunks of a size asked for recently are at most this large",
    ),
    (
        "large_chunk",
        "bytes: a power of two of at most 64GiB; needs this large use chunks this large",
    ),
    (
        "largest_chunk",
        "bytes: a power of two of at most 64GiB; large needs use chunks up to this large",
    ),
    ("unmap_batch", "retired ranges that trigger an unmap batch, 1 or more"),
    ("unmap_batch_bytes", "retired bytes that trigger an unmap batch"),
    ("unmap_run_handles", "chunk mappings one unmap call covers at most, 0 for no limit"),
    ("unmap_batch_age_us", "microseconds after which retired ranges are unmapped anyway"),
    ("background", "true or false: the background worker (events, unmap batches, window)"),
    ("prefetch_window_min", "bytes the background mapper keeps mapped at least"),
    ("prefetch_window_max", "bytes the background mapper keeps mapped at most; 0 turns it off"),
    ("window_refill_pages", "pages the mapper maps into the window per step, 1 or more"),
    ("reuse_addresses", "true or false: new ranges at unmapped addresses before fresh ones"),
    ("near_fit", "a fraction in [0, 1]: cached ranges this much larger than a request serve it whole"),
    ("carve", "a fraction in [0, 1]: unused pages of carved arenas allowed, of the peak in use; 0: off"),
    ("carve_repeated", "a fraction in [0, 1]: carving's budget for a request of a size seen recently"),
    (
        "grow_first",
        "a fraction in [0, 10]: new memory before stealing cached ranges while held memory stays this much above the peak in use; 0: off",
    ),
    ("peer_access", "true or false: each GPU's allocator lets the process's other GPUs reach it"),
    ("ipc", "true or false: chunks can be exported to other processes"),
    (
        "captures_announced",
        "true or false: look for CUDA graph captures only while one is announced (as PyTorch's allocator)",
    ),
    (
        "deferred_free_events",
        "true or false: frees record no event; the worker records one per stream later (streams must outlive the allocator)",
    ),
    ("validate", "true or false"),
];

fn allowed(key: &str) -> &'static str {
    KEYS.iter().find(|(k, _)| *k == key).map(|(_, a)| *a).unwrap_or("")
}

fn known_key(key: &str) -> Option<&'static str> {
    KEYS.iter().find(|(k, _)| *k == key).map(|(k, _)| *k)
}

fn bad(name: &'static str, value: &str) -> Error {
    Error::InvalidOption { name, reason: format!("`{value}` is not valid: {}", allowed(name)) }
}

/// Parses a byte count: a whole number with an optional suffix (B, KiB, MiB, GiB, TiB binary;
/// KB, MB, GB, TB decimal; K, M, G, T binary), case-insensitive, spaces allowed before it.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '_').unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let num: String = num.chars().filter(|&c| c != '_').collect();
    if num.is_empty() {
        return None;
    }
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}

fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// The option each key sets, as [`Options::check_value`] names it, for the keys whose value has
/// a rule of its own there.
fn checked_field(key: &str) -> Option<&'static str> {
    Some(match key {
        "cap" => "cap",
        "cap_fraction" => "cap_fraction",
        "host_page_size" => "host_page_size",
        "max_chunk" => "max_chunk_bytes",
        "max_chunk_repeated" => "max_chunk_repeated_bytes",
        "large_chunk" => "large_chunk_bytes",
        "largest_chunk" => "largest_chunk_bytes",
        "unmap_batch" => "unmap_batch_ranges",
        "unmap_batch_bytes" => "unmap_batch_bytes",
        "window_refill_pages" => "window_refill_pages",
        "near_fit" => "near_fit",
        "carve" => "carve",
        "carve_repeated" => "carve_repeated",
        "grow_first" => "grow_first",
        _ => return None,
    })
}

/// Sets one option on `opts` from its key and textual value: the value must parse, and pass
/// its option's own rule ([`Options::check_value`]); the rules between options are left to
/// [`Options::check`]. On an error `opts` is unchanged.
pub fn apply(opts: &mut Options, key: &str, value: &str) -> Result<()> {
    let key = key.trim();
    let Some(name) = known_key(key) else {
        let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
        return Err(Error::InvalidOption {
            name: "MOONBRIGHT_ALLOC_CONF",
            reason: format!("unknown key `{key}`; the keys are {}", known.join(", ")),
        });
    };
    let v = value.trim();
    let mut next = opts.clone();
    set(&mut next, name, v)?;
    if let Some(field) = checked_field(name) {
        next.check_value(field).map_err(|_| bad(name, v))?;
    }
    *opts = next;
    Ok(())
}

/// Parses `v` for the key `name` and sets its option.
fn set(opts: &mut Options, name: &'static str, v: &str) -> Result<()> {
    let bytes = || parse_bytes(v).ok_or_else(|| bad(name, v));
    let number = || v.parse::<f64>().map_err(|_| bad(name, v));
    let flag = || parse_bool(v).ok_or_else(|| bad(name, v));
    // A count that must not be 0.
    let count = || v.parse::<u64>().ok().filter(|&n| n > 0).ok_or_else(|| bad(name, v));
    match name {
        "backend" => {
            opts.backend = match v.to_ascii_lowercase().as_str() {
                "auto" => BackendKind::Auto,
                "cuda" => BackendKind::Cuda,
                "host" => BackendKind::Host,
                _ => return Err(bad(name, v)),
            }
        }
        "device" => opts.device = v.parse::<u16>().map_err(|_| bad(name, v))? as i32,
        "cap" => opts.cap_bytes = Some(bytes()?),
        "cap_fraction" => opts.cap_fraction = number()?,
        "host_page_size" => {
            opts.host_page_size = usize::try_from(bytes()?).map_err(|_| bad(name, v))?;
        }
        "host_driver_costs" => {
            opts.host_driver_costs =
                HostDriverCosts::from_name(&v.to_ascii_lowercase()).ok_or_else(|| bad(name, v))?;
        }
        "host_capacity" => {
            // At least a page, which `Options::check` asks once the page is known.
            opts.host_capacity = bytes()?;
            if opts.host_capacity == 0 {
                return Err(bad(name, v));
            }
        }
        "max_chunk" => opts.max_chunk_bytes = bytes()?,
        "max_chunk_repeated" => opts.max_chunk_repeated_bytes = bytes()?,
        "large_chunk" => opts.large_chunk_bytes = bytes()?,
        "largest_chunk" => opts.largest_chunk_bytes = bytes()?,
        "unmap_batch" => {
            opts.unmap_batch_ranges = usize::try_from(count()?).map_err(|_| bad(name, v))?;
        }
        "unmap_run_handles" => {
            opts.unmap_run_handles = v.parse().map_err(|_| bad(name, v))?;
        }
        "unmap_batch_bytes" => opts.unmap_batch_bytes = bytes()?,
        "unmap_batch_age_us" => opts.unmap_batch_age_us = v.parse().map_err(|_| bad(name, v))?,
        "background" => opts.background = flag()?,
        "prefetch_window_min" => opts.prefetch_window_min = bytes()?,
        "prefetch_window_max" => opts.prefetch_window_max = bytes()?,
        "window_refill_pages" => opts.window_refill_pages = count()?,
        "reuse_addresses" => opts.reuse_addresses = flag()?,
        "near_fit" => opts.near_fit = number()?,
        "carve" => opts.carve = number()?,
        "carve_repeated" => opts.carve_repeated = number()?,
        "grow_first" => opts.grow_first = number()?,
        "profile" => v.parse::<crate::config::Profile>()?.apply(opts),
        "peer_access" => opts.peer_access = flag()?,
        "ipc" => opts.ipc = flag()?,
        "captures_announced" => opts.captures_announced = flag()?,
        "deferred_free_events" => opts.deferred_free_events = flag()?,
        "validate" => opts.validate = flag()?,
        _ => unreachable!("every key in KEYS is handled"),
    }
    Ok(())
}

/// Applies `(key, value)` pairs over `base`, then checks the result. A `profile` is applied
/// before the other keys, wherever it stands, so that tuning options set beside it win.
pub fn apply_pairs<'a, I>(base: Options, pairs: I) -> Result<Options>
where
    I: IntoIterator<Item = (&'a str, &'a str)>,
{
    let mut opts = base;
    let (profiles, rest): (Vec<_>, Vec<_>) =
        pairs.into_iter().partition(|(k, _)| k.trim() == "profile");
    for (k, v) in profiles.into_iter().chain(rest) {
        apply(&mut opts, k, v)?;
    }
    opts.check()?;
    Ok(opts)
}

/// Splits `key:value,key:value` into pairs. Empty items (a trailing comma) are skipped.
pub fn split_conf(text: &str) -> Result<Vec<(&str, &str)>> {
    let mut out = Vec::new();
    for item in text.split(',') {
        if item.trim().is_empty() {
            continue;
        }
        let Some((k, v)) = item.split_once(':') else {
            return Err(Error::InvalidOption {
                name: "MOONBRIGHT_ALLOC_CONF",
                reason: format!("`{}` is not of the form key:value", item.trim()),
            });
        };
        out.push((k.trim(), v.trim()));
    }
    Ok(out)
}

/// Parses a `MOONBRIGHT_ALLOC_CONF` string over the default options.
pub fn parse_conf(text: &str) -> Result<Options> {
    parse_conf_over(Options::default(), text)
}

/// Parses a `MOONBRIGHT_ALLOC_CONF` string over `base`.
pub fn parse_conf_over(base: Options, text: &str) -> Result<Options> {
    apply_pairs(base, split_conf(text)?)
}

/// The options `MOONBRIGHT_ALLOC_CONF` names, or the defaults when it is unset or empty.
pub fn from_env() -> Result<Options> {
    match std::env::var(ENV_VAR) {
        Ok(s) => parse_conf(&s),
        Err(_) => Ok(Options::default()),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn err_of(text: &str) -> (String, String) {
        match parse_conf(text) {
            Err(Error::InvalidOption { name, reason }) => (name.to_string(), reason),
            other => panic!("{text}: expected InvalidOption, got {other:?}"),
        }
    }

    #[test]
    fn empty_gives_defaults() {
        assert_eq!(parse_conf("").unwrap(), Options::default());
        assert_eq!(parse_conf(" , ").unwrap(), Options::default());
    }

    #[test]
    fn every_key_parses() {
        let o = parse_conf(
            "backend:host, device:1, cap:12GiB, cap_fraction:0.5, host_page_size:64KiB, \
             host_capacity:1GB, max_chunk:8MiB, large_chunk:256MiB, largest_chunk:4GiB, \
             unmap_batch:7, \
             unmap_batch_bytes:1MB, host_driver_costs:device_tables, validate:true",
        )
        .unwrap();
        assert_eq!(o.host_driver_costs, HostDriverCosts::DeviceTables);
        assert_eq!(o.backend, BackendKind::Host);
        assert_eq!(o.device, 1);
        assert_eq!(o.cap_bytes, Some(12 << 30));
        assert_eq!(o.cap_fraction, 0.5);
        assert_eq!(o.host_page_size, 64 << 10);
        assert_eq!(o.host_capacity, 1_000_000_000);
        assert_eq!(o.max_chunk_bytes, 8 << 20);
        assert_eq!(o.large_chunk_bytes, 256 << 20);
        assert_eq!(o.largest_chunk_bytes, 4 << 30);
        assert_eq!(o.unmap_batch_ranges, 7);
        assert_eq!(o.unmap_batch_bytes, 1_000_000);
        assert!(o.validate);
    }

    #[test]
    fn a_profile_sets_the_tuning_and_options_beside_it_win() {
        use crate::config::Profile;
        let d = Options::default();
        assert_eq!(d.profile, Profile::Balanced);
        assert_eq!(parse_conf("profile:balanced").unwrap(), d);
        let m = parse_conf("profile:memory").unwrap();
        assert_eq!((m.carve, m.profile), (0.0, Profile::Memory));
        assert_eq!(m.carve_repeated, d.carve_repeated);
        let l = parse_conf("profile:latency").unwrap();
        assert_eq!((l.grow_first, l.carve, l.profile), (0.3, d.carve, Profile::Latency));
        assert_eq!(l, Options::default().with_profile(Profile::Latency));
        // Set beside a profile, before or after it, a tuning option wins.
        for text in ["grow_first:0.1,profile:latency", "profile:latency,grow_first:0.1"] {
            let o = parse_conf(text).unwrap();
            assert_eq!((o.grow_first, o.profile), (0.1, Profile::Latency), "{text}");
        }
        // A profile resets what another set: the last one stands.
        let o = parse_conf("profile:memory,profile:latency").unwrap();
        assert_eq!((o.carve, o.grow_first), (d.carve, 0.3));
        let (name, reason) = err_of("profile:fast");
        assert_eq!(name, "profile");
        assert!(reason.contains("memory, balanced, latency"), "{reason}");
    }

    #[test]
    fn byte_suffixes() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("2MiB"), Some(2 << 20));
        assert_eq!(parse_bytes("2 mib"), Some(2 << 20));
        assert_eq!(parse_bytes("3G"), Some(3 << 30));
        assert_eq!(parse_bytes("5KB"), Some(5000));
        assert_eq!(parse_bytes("1_000"), Some(1000));
        assert_eq!(parse_bytes("1.5GiB"), None);
        assert_eq!(parse_bytes("GiB"), None);
        assert_eq!(parse_bytes("-1"), None);
        assert_eq!(parse_bytes("99999999999TiB"), None);
    }

    #[test]
    fn unknown_key_lists_the_known_ones() {
        let (name, reason) = err_of("backend:host,prefetch:3");
        assert_eq!(name, "MOONBRIGHT_ALLOC_CONF");
        assert!(reason.contains("`prefetch`"), "{reason}");
        for (k, _) in KEYS {
            assert!(reason.contains(k), "{reason} lacks {k}");
        }
    }

    #[test]
    fn bad_values_name_the_key_and_what_is_allowed() {
        for (text, key, hint) in [
            ("backend:gpu", "backend", "auto, cuda or host"),
            ("device:-1", "device", "ordinal"),
            ("cap:lots", "cap", "GiB"),
            ("cap:0", "cap", "bytes"),
            ("cap_fraction:1.5", "cap_fraction", "(0, 1]"),
            ("cap_fraction:nan", "cap_fraction", "(0, 1]"),
            ("host_page_size:3000", "host_page_size", "power of two"),
            ("host_driver_costs:gpu", "host_driver_costs", "none, cuda or device_tables"),
            ("host_driver_costs:", "host_driver_costs", "none, cuda or device_tables"),
            ("max_chunk:3MiB", "max_chunk", "power of two"),
            ("max_chunk_repeated:3MiB", "max_chunk_repeated", "power of two"),
            ("large_chunk:3MiB", "large_chunk", "power of two"),
            ("largest_chunk:128GiB", "largest_chunk", "power of two"),
            ("unmap_batch:0", "unmap_batch", "1 or more"),
            ("unmap_batch_bytes:x", "unmap_batch_bytes", "bytes"),
            ("unmap_batch_bytes:0", "unmap_batch_bytes", "bytes"),
            ("host_capacity:0", "host_capacity", "simulated memory"),
            ("window_refill_pages:0", "window_refill_pages", "1 or more"),
            ("window_refill_pages:-2", "window_refill_pages", "1 or more"),
            ("near_fit:1.5", "near_fit", "[0, 1]"),
            ("carve:-0.5", "carve", "[0, 1]"),
            ("carve_repeated:NaN", "carve_repeated", "[0, 1]"),
            ("grow_first:11", "grow_first", "[0, 10]"),
            ("grow_first:-1", "grow_first", "[0, 10]"),
            ("validate:maybe", "validate", "true or false"),
        ] {
            let (name, reason) = err_of(text);
            assert_eq!(name, key, "{text}: {reason}");
            assert!(reason.contains(hint), "{text}: {reason}");
        }
    }

    #[test]
    fn malformed_items_are_refused() {
        let (name, reason) = err_of("backend=host");
        assert_eq!(name, "MOONBRIGHT_ALLOC_CONF");
        assert!(reason.contains("key:value"), "{reason}");
    }

    #[test]
    fn the_combined_options_are_checked() {
        // Each value is fine alone; together the capacity is less than a page.
        let e = parse_conf("backend:host,host_page_size:1MiB,host_capacity:4KiB").unwrap_err();
        assert!(matches!(e, Error::InvalidOption { name: "host_capacity", .. }), "{e}");
        // Modelled costs on a real GPU would add to its own.
        let (name, reason) = err_of("backend:cuda,host_driver_costs:cuda");
        assert_eq!(name, "host_driver_costs");
        assert!(reason.contains("backend host"), "{reason}");
    }

    #[test]
    fn host_driver_costs_name_each_model() {
        assert_eq!(parse_conf("").unwrap().host_driver_costs, HostDriverCosts::None);
        for costs in HostDriverCosts::ALL {
            for backend in ["host", "auto"] {
                let text = format!("backend:{backend},host_driver_costs:{}", costs.name());
                assert_eq!(parse_conf(&text).unwrap().host_driver_costs, costs, "{text}");
            }
        }
        let o = parse_conf("host_driver_costs: Device_Tables ").unwrap();
        assert_eq!(o.host_driver_costs, HostDriverCosts::DeviceTables);
        assert_eq!(
            parse_conf("backend:cuda,host_driver_costs:none").unwrap().backend,
            BackendKind::Cuda
        );
    }

    #[test]
    fn pairs_apply_over_a_base() {
        let base = parse_conf("backend:host,cap:1GiB").unwrap();
        let o =
            apply_pairs(base, [("unmap_batch", "3"), ("cap", "2GiB"), ("unmap_run_handles", "0")])
                .unwrap();
        assert_eq!(o.backend, BackendKind::Host);
        assert_eq!(o.cap_bytes, Some(2 << 30));
        assert_eq!(o.unmap_batch_ranges, 3);
        assert_eq!(o.unmap_run_handles, 0);
        assert!(apply_pairs(Options::default(), [("unmap_run_handles", "-1")]).is_err());
        assert_eq!(apply_pairs(Options::default(), [("near_fit", "0.5")]).unwrap().near_fit, 0.5);
        for bad in ["-0.1", "1.5", "NaN", "half"] {
            assert!(apply_pairs(Options::default(), [("near_fit", bad)]).is_err(), "{bad}");
            assert!(apply_pairs(Options::default(), [("carve_repeated", bad)]).is_err(), "{bad}");
        }
        let o = apply_pairs(Options::default(), [("max_chunk_repeated", "32MiB")]).unwrap();
        assert_eq!(o.max_chunk_repeated_bytes, 32 << 20);
        let o = apply_pairs(o, [("max_chunk_repeated", "0")]).unwrap();
        assert_eq!(o.max_chunk_repeated_bytes, 0, "0: as max_chunk");
        let o = apply_pairs(Options::default(), [("carve_repeated", "0.02")]).unwrap();
        assert_eq!((o.carve_repeated, Options::default().carve_repeated), (0.02, 0.01));
        let o = apply_pairs(Options::default(), [("reuse_addresses", "false")]).unwrap();
        assert!(!o.reuse_addresses && Options::default().reuse_addresses);
        assert!(apply_pairs(Options::default(), [("reuse_addresses", "maybe")]).is_err());
        let o = apply_pairs(Options::default(), [("peer_access", "off")]).unwrap();
        assert!(!o.peer_access && Options::default().peer_access);
        assert!(apply_pairs(Options::default(), [("peer_access", "2")]).is_err());
        let o = apply_pairs(Options::default(), [("ipc", "false")]).unwrap();
        assert!(!o.ipc && Options::default().ipc);
        assert!(apply_pairs(Options::default(), [("ipc", "yes please")]).is_err());
    }
}
