//! What the committed header promises, checked against the library: every status code it
//! defines has a value and a message of its own, and the defaults its `mb_options` documents
//! are `Options::default()`'s. Also `mb_create_conf`, the entry point that reaches every option.

use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::path::Path;
use std::ptr;

use moonbright::conf::parse_bytes;
use moonbright::Options;
use moonbright_capi::*;

fn header() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/moonbright.h");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn last_error() -> String {
    // SAFETY: `mb_last_error` returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mb_last_error()) }.to_str().unwrap().to_owned()
}

fn status_text(status: i32) -> String {
    // SAFETY: `mb_status_string` returns a static NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mb_status_string(status)) }.to_str().unwrap().to_owned()
}

/// `(name, value)` of every `#define MB_OK` / `#define MB_ERR_*` in the header.
fn status_codes(header: &str) -> Vec<(String, i32)> {
    header
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some("#define")).then_some(())?;
            let name = words.next()?;
            (name == "MB_OK" || name.starts_with("MB_ERR_")).then_some(())?;
            let value = words.next()?.parse().unwrap_or_else(|_| panic!("{l}: not an integer"));
            Some((name.to_string(), value))
        })
        .collect()
}

#[test]
fn every_status_code_has_its_own_value_and_message() {
    let codes = status_codes(&header());
    assert!(codes.len() >= 14, "only {} status codes found in the header", codes.len());
    let mut by_value: HashMap<i32, &str> = HashMap::new();
    let mut by_text: HashMap<String, &str> = HashMap::new();
    for (name, value) in &codes {
        if let Some(other) = by_value.insert(*value, name) {
            panic!("{name} and {other} are both {value}");
        }
        let text = status_text(*value);
        assert!(!text.is_empty() && text != "unknown status", "{name} ({value}) has no message");
        if let Some(other) = by_text.insert(text.clone(), name) {
            panic!("{name} and {other} have the same message \"{text}\"");
        }
    }
    assert_eq!(by_value.get(&MB_ERR_IPC), Some(&"MB_ERR_IPC"));
    assert_eq!(by_value.get(&MB_ERR_UNKNOWN_SEQUENCE), Some(&"MB_ERR_UNKNOWN_SEQUENCE"));
    let unused = codes.iter().map(|(_, v)| v).max().unwrap() + 1;
    assert_eq!(status_text(unused), "unknown status");
}

/// The fields of `typedef struct mb_options` with the text of the doc comment above each.
fn option_docs(header: &str) -> Vec<(String, String)> {
    let start = header.find("typedef struct mb_options {").expect("mb_options in the header");
    let body = &header[start..];
    let body = &body[..body.find("} mb_options;").expect("end of mb_options")];
    let mut out = Vec::new();
    let mut doc = String::new();
    for line in body.lines().skip(1) {
        let t = line.trim();
        if let Some(text) = t.strip_prefix("* ").or_else(|| t.strip_prefix("/**")) {
            doc.push_str(text.trim());
            doc.push(' ');
        } else if let Some(field) = t.strip_suffix(';') {
            let name = field.split_whitespace().last().unwrap().to_string();
            out.push((name, std::mem::take(&mut doc)));
        }
    }
    out
}

/// What a field's doc says 0 stands for: the text after "0: " up to the sentence's end.
fn stated_default(doc: &str) -> Option<&str> {
    let rest = &doc[doc.find("0: ")? + 3..];
    Some(rest[..rest.find(". ").unwrap_or(rest.len())].trim().trim_end_matches('.'))
}

#[test]
fn documented_defaults_are_the_real_ones() {
    let d = Options::default();
    let fields = option_docs(&header());
    assert!(fields.len() >= 7, "{fields:?}");
    for (name, doc) in &fields {
        if name == "backend" || name == "device" {
            continue; // 0 is a value of theirs, not "the default"
        }
        let stated = stated_default(doc)
            .unwrap_or_else(|| panic!("mb_options.{name} does not say what 0 means: {doc}"));
        if name == "cap_bytes" {
            let percent = stated
                .strip_suffix("% of the device's total memory")
                .unwrap_or_else(|| panic!("cap_bytes: {stated}"));
            assert_eq!(percent.parse::<f64>().unwrap() / 100.0, d.cap_fraction, "{doc}");
            continue;
        }
        let value = parse_bytes(stated)
            .unwrap_or_else(|| panic!("mb_options.{name}: cannot read the default `{stated}`"));
        let real = match name.as_str() {
            "host_page_size" => d.host_page_size as u64,
            "host_capacity" => d.host_capacity,
            "max_chunk_bytes" => d.max_chunk_bytes,
            "unmap_batch_ranges" => d.unmap_batch_ranges as u64,
            other => panic!("mb_options.{other} is new: add its default to this test"),
        };
        assert_eq!(value, real, "mb_options.{name} documents 0 as {stated}, the default is {real}");
    }
    // And mb_options_default writes the same values out.
    let mut o = mb_options::default();
    // SAFETY: `o` is a live local.
    unsafe { mb_options_default(&mut o) };
    assert_eq!(o.unmap_batch_ranges, d.unmap_batch_ranges as u64);
    assert_eq!(o.host_page_size, d.host_page_size as u64);
}

/// `mb_create_conf` with `conf`, as a C string unless None (NULL).
fn create_conf(conf: Option<&[u8]>) -> (i32, *mut mb_allocator) {
    let c = conf.map(|b| {
        let mut v = b.to_vec();
        v.push(0);
        v
    });
    let p = c.as_ref().map_or(ptr::null(), |v| v.as_ptr() as *const c_char);
    let mut a = ptr::null_mut();
    // SAFETY: `p` is NULL or a NUL-terminated string alive for the call; `a` is a live local.
    let status = unsafe { mb_create_conf(p, &mut a) };
    (status, a)
}

#[test]
fn conf_strings_reach_every_option() {
    let (status, a) = create_conf(Some(
        b"backend:host, host_capacity:256MiB, host_page_size:64KiB, cap:32MiB, unmap_batch:3, \
          near_fit:0.5, background:false",
    ));
    assert_eq!(status, MB_OK, "{}", last_error());
    assert!(!a.is_null());
    // SAFETY: `a` is a live handle; the out-parameters are live locals.
    unsafe {
        let (mut page, mut cap, mut p) = (0, 0, 0);
        assert_eq!(mb_get_page_size(a, &mut page), MB_OK);
        assert_eq!(page, 64 << 10);
        assert_eq!(mb_get_cap(a, &mut cap), MB_OK);
        assert_eq!(cap, 32 << 20);
        assert_eq!(mb_malloc(a, 1 << 20, &mut p), MB_OK, "{}", last_error());
        assert_eq!(mb_malloc(a, 64 << 20, &mut 0), MB_ERR_TOO_LARGE);
        assert_eq!(mb_free(a, p), MB_OK);
        assert_eq!(mb_destroy(a), MB_OK);
    }
    // NULL and "" are the defaults (on this machine's best backend).
    for conf in [None, Some(&b""[..]), Some(&b" , "[..])] {
        let (status, a) = create_conf(conf);
        assert_eq!(status, MB_OK, "{conf:?}: {}", last_error());
        // SAFETY: `a` is a live handle.
        assert_eq!(unsafe { mb_destroy(a) }, MB_OK);
    }
}

#[test]
fn bad_conf_strings_are_invalid_arguments_that_say_why() {
    for (conf, says) in [
        (&b"backend:host,nope:3"[..], "unknown key `nope`"),
        (b"backend:host,cap:lots", "invalid option `cap`"),
        (b"backend:gpu", "auto, cuda or host"),
        (b"backend=host", "key:value"),
        (b"backend:host,unmap_batch:0", "1 or more"),
        // Each value is fine alone; together the capacity is less than a page.
        (b"backend:host,host_page_size:1MiB,host_capacity:4KiB", "host_capacity"),
        (b"backend:host,cap:\xff", "not UTF-8"),
    ] {
        let (status, a) = create_conf(Some(conf));
        let text = String::from_utf8_lossy(conf);
        assert_eq!(status, MB_ERR_INVALID_ARGUMENT, "{text}");
        assert!(a.is_null(), "{text}: *out was written on failure");
        let e = last_error();
        assert!(e.contains(says), "{text}: {e}");
        if !says.contains("UTF-8") {
            assert!(e.starts_with("mb_create_conf(\""), "{e}");
        }
    }
    // A NULL `out`.
    // SAFETY: the string is NUL-terminated; NULL `out` is what is tested.
    let status = unsafe { mb_create_conf(c"backend:host".as_ptr(), ptr::null_mut()) };
    assert_eq!(status, MB_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`out` is NULL"), "{}", last_error());
}
