use super::*;
use proptest::prelude::*;

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(*name, HeaderValue::from_str(value).unwrap());
    }
    map
}

#[test]
fn a_status_in_the_head_is_the_call_s_and_headers_without_one_commit_it() {
    let ok = StatusCode::OK;
    assert_eq!(
        said(ok, &headers(&[("grpc-status", "14")])),
        Said::Status(14)
    );
    assert_eq!(
        said(ok, &headers(&[("grpc-status", "0")])),
        Said::Status(OK)
    );
    assert_eq!(
        said(ok, &headers(&[("content-type", "application/grpc")])),
        Said::Committed
    );
    // A status in the head wins over the HTTP status.
    let bad = StatusCode::SERVICE_UNAVAILABLE;
    assert_eq!(
        said(bad, &headers(&[("grpc-status", "5")])),
        Said::Status(5)
    );
}

#[test]
fn an_http_failure_without_a_grpc_status_stands_for_grpc_s_mapped_code() {
    for (http, code) in [
        (400, INTERNAL),
        (401, 16),
        (403, 7),
        (404, 12),
        (429, UNAVAILABLE),
        (502, UNAVAILABLE),
        (503, UNAVAILABLE),
        (504, UNAVAILABLE),
        (500, UNKNOWN),
        (418, UNKNOWN),
    ] {
        let status = StatusCode::from_u16(http).unwrap();
        assert_eq!(
            said(status, &HeaderMap::new()),
            Said::Status(code),
            "{http}"
        );
    }
}

#[test]
fn an_unreadable_grpc_status_is_unknown() {
    for value in ["", "17", "99", "-1", "1a", "014", " 1", "100"] {
        let value = HeaderValue::from_str(value).unwrap();
        assert_eq!(code_of(&value), UNKNOWN, "{value:?}");
    }
    for code in 0..=16u8 {
        assert_eq!(code_of(&HeaderValue::from(u16::from(code))), code);
    }
    assert_eq!(code_of(&HeaderValue::from_static("04")), 4);
}

#[test]
fn a_pushback_is_a_wait_and_a_negative_or_malformed_one_a_stop() {
    let push = |v: &str| pushback(&headers(&[("grpc-retry-pushback-ms", v)]));
    assert_eq!(pushback(&HeaderMap::new()), Pushback::Absent);
    assert_eq!(push("0"), Pushback::Wait(Duration::ZERO));
    assert_eq!(push("250"), Pushback::Wait(Duration::from_millis(250)));
    assert_eq!(
        push("2147483647"),
        Pushback::Wait(Duration::from_millis(2_147_483_647))
    );
    for bad in ["-1", "-0x1", "1.5", "", "soon", "2147483648", "1e3"] {
        assert_eq!(push(bad), Pushback::Stop, "{bad:?}");
    }
    let twice = headers(&[
        ("grpc-retry-pushback-ms", "1"),
        ("grpc-retry-pushback-ms", "1"),
    ]);
    assert_eq!(pushback(&twice), Pushback::Stop);
}

#[test]
fn a_grpc_timeout_is_read_in_each_unit_and_a_malformed_one_is_none() {
    let read = |v: &str| timeout_of(&headers(&[("grpc-timeout", v)]));
    assert_eq!(read("1H"), Some(Duration::from_secs(3600)));
    assert_eq!(read("2M"), Some(Duration::from_secs(120)));
    assert_eq!(read("3S"), Some(Duration::from_secs(3)));
    assert_eq!(read("4m"), Some(Duration::from_millis(4)));
    assert_eq!(read("5u"), Some(Duration::from_micros(5)));
    assert_eq!(read("99999999n"), Some(Duration::from_nanos(99_999_999)));
    for bad in ["", "m", "123456789m", "1x", "-1S", "1.5S", " 1S"] {
        assert_eq!(read(bad), None, "{bad:?}");
    }
    assert_eq!(timeout_of(&HeaderMap::new()), None);
}

#[test]
fn a_time_left_is_written_in_the_finest_unit_that_fits_rounded_down() {
    let write = |d: Duration| timeout_value(d).to_str().unwrap().to_owned();
    assert_eq!(write(Duration::from_nanos(5)), "5n");
    assert_eq!(write(Duration::from_millis(250)), "250000u");
    assert_eq!(write(Duration::from_secs(1)), "1000000u");
    assert_eq!(write(Duration::from_millis(100_001)), "100001m");
    assert_eq!(write(Duration::from_secs(100_000)), "100000S");
    assert_eq!(write(Duration::MAX), "99999999H");
}

proptest! {
    /// What is written is read back as at most the time left, and within one of its unit.
    #[test]
    fn a_written_timeout_reads_back_at_most_what_was_left(nanos in any::<u64>()) {
        let left = Duration::from_nanos(nanos);
        let mut map = HeaderMap::new();
        map.insert("grpc-timeout", timeout_value(left));
        let read = timeout_of(&map).expect("well formed");
        prop_assert!(read <= left);
        let unit = match map["grpc-timeout"].as_bytes().last() {
            Some(b'n') => Duration::from_nanos(1),
            Some(b'u') => Duration::from_micros(1),
            Some(b'm') => Duration::from_millis(1),
            Some(b'S') => Duration::from_secs(1),
            Some(b'M') => Duration::from_secs(60),
            _ => Duration::from_secs(3600),
        };
        prop_assert!(left - read < unit);
    }

    /// A head's reading never panics, whatever its status and its `grpc-status` bytes.
    #[test]
    fn any_head_is_read_without_panicking(http in 100u16..1000, value in proptest::collection::vec(32u8..127, 0..6)) {
        let mut map = HeaderMap::new();
        if let Ok(value) = HeaderValue::from_bytes(&value) {
            map.insert("grpc-status", value.clone());
            map.insert("grpc-retry-pushback-ms", value);
        }
        let status = StatusCode::from_u16(http).unwrap();
        if let Said::Status(code) = said(status, &map) {
            prop_assert!(usize::from(code) < NAMES.len());
        }
        let _ = pushback(&map);
    }
}

#[test]
fn codes_are_named_as_grpc_names_them_in_any_case() {
    assert_eq!(code_named("UNAVAILABLE"), Some(UNAVAILABLE));
    assert_eq!(code_named("unavailable"), Some(UNAVAILABLE));
    assert_eq!(code_named("OK"), Some(OK));
    assert_eq!(code_named("UNAUTHENTICATED"), Some(16));
    assert_eq!(code_named("SERVICE_UNAVAILABLE"), None);
    let set = CodeSet::of([14, 4]).unwrap();
    assert!(set.has(14) && set.has(4) && !set.has(0) && !set.has(40));
    assert_eq!(
        format!("{set:?}"),
        r#"{"DEADLINE_EXCEEDED", "UNAVAILABLE"}"#
    );
    assert_eq!(CodeSet::of([17]), Err(17));
    assert_eq!(CodeSet::of([-1]), Err(-1));
}

/// The path table's hash is FNV-1a (64 bits), checked against the published vectors.
#[test]
fn the_path_table_s_hash_is_fnv_1a() {
    use std::hash::Hasher;
    let hash = |bytes: &[u8]| {
        let mut h = super::FnvHasher::default();
        h.write(bytes);
        h.finish()
    };
    assert_eq!(hash(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(hash(b"foobar"), 0x8594_4171_f739_67e8);
}

proptest! {
    /// The lookup that passes a small map along finds what `HeaderMap`'s own lookup by hash
    /// finds, in maps smaller and larger than the ones it passes, with repeated names.
    #[test]
    fn a_header_is_found_as_the_map_s_own_lookup_finds_it(
        names in proptest::collection::vec(0usize..6, 0..20),
        sought in 0usize..6,
    ) {
        const NAMES: [HeaderName; 6] = [
            GRPC_STATUS,
            PUSHBACK,
            GRPC_TIMEOUT,
            PREVIOUS_ATTEMPTS,
            http::header::CONTENT_TYPE,
            http::header::DATE,
        ];
        let mut map = HeaderMap::new();
        for (at, &name) in names.iter().enumerate() {
            map.append(NAMES[name].clone(), HeaderValue::from(at));
        }
        let name = &NAMES[sought];
        prop_assert_eq!(header(&map, name), map.get(name));
        let mut all = map.get_all(name).iter();
        prop_assert_eq!(values(&map, name), (all.next(), all.next().is_some()));
    }
}
