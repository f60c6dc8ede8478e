//! Reading `Retry-After` (RFC 9110 §10.2.3): how long the server asked us to wait.
//!
//! The field is either delta-seconds (`Retry-After: 120`, one or more digits, nothing else) or
//! an HTTP-date (`Retry-After: Wed, 21 Oct 2026 07:28:00 GMT`), read against the clock's wall
//! time. RFC 9110 §5.6.7 requires recipients to accept all three date formats, so the obsolete
//! RFC 850 and asctime forms are read too.
//!
//! Why a floor and not an instruction: the server knows when it expects to recover; arriving
//! earlier only adds load it has said it cannot take. So the wait never ends earlier than asked.
//!
//! Whatever a server sends, reading it never panics, overflows or loops: a value that is not
//! one of the two forms (negative, fractional, empty, garbage, a date that does not exist) is
//! ignored, and the computed backoff applies. Delta-seconds too large for 64 bits are valid
//! syntax asking for a very long wait: as RFC 9111 §1.2.2 says of such values, they read as the
//! largest wait there is, so the request stops at once instead of retrying after the backoff.
//! The digits are read in one pass that stops counting once the value overflows, so even a
//! megabyte of digits costs one scan. A date in the past means "now": no floor.
//!
//! # Milliseconds first
//!
//! Azure's services send `x-ms-retry-after-ms` (and `retry-after-ms`), and the generated SDKs of
//! the large LLM and payment APIs read `retry-after-ms` before `Retry-After`: whole seconds are
//! too coarse for a rate limiter that refills in 50 ms. An answer's floor is therefore the first
//! of `retry-after-ms`, `x-ms-retry-after-ms` and `Retry-After` that holds a valid value, in that
//! order, as Azure's SDK reads them; an invalid value counts as absent and the next field is
//! read. A millisecond value is digits with an optional fraction (`1500`, `1500.25`: what those
//! SDKs read as a float), rounded up to the nanosecond, never down; a sign, an exponent, `inf`
//! or `NaN` is not valid. Digits beyond 64 bits are the largest wait, as for `Retry-After`.
//!
//! A field sent on several lines (a singleton field repeated, against RFC 9110) asks for the
//! largest of its valid values: each line is a floor the server may have meant, and honouring
//! the largest honours them all. Lines that a proxy joined with commas are not a valid value.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName};

/// Azure's millisecond field, as the generated SDKs of other APIs read it too.
const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");
/// Azure's own spelling of it.
const X_MS_RETRY_AFTER_MS: HeaderName = HeaderName::from_static("x-ms-retry-after-ms");

/// The wait an answer's `headers` ask for: the first of `retry-after-ms`, `x-ms-retry-after-ms`
/// and `Retry-After` (a date read against `wall_now()`, asked only then) with a valid value, or
/// `None`.
pub(crate) fn floor(headers: &HeaderMap, wall_now: &dyn Fn() -> SystemTime) -> Option<Duration> {
    const NAMES: [HeaderName; 3] = [
        RETRY_AFTER_MS,
        X_MS_RETRY_AFTER_MS,
        http::header::RETRY_AFTER,
    ];
    if !super::has_any(headers, &NAMES) {
        return None;
    }
    largest(headers, RETRY_AFTER_MS, parse_millis)
        .or_else(|| largest(headers, X_MS_RETRY_AFTER_MS, parse_millis))
        .or_else(|| {
            largest(headers, http::header::RETRY_AFTER, |value| {
                parse(value, wall_now())
            })
        })
}

/// Whether the answer asks for a wait with a valid value in any of the three fields: a
/// `RateLimit` field beside it then says nothing (the server's explicit wait takes precedence).
/// Read by the one parser that reads the wait itself, so a value that cannot be read (`soon`,
/// `1.5` seconds) is absent here as it is there, and leaves the `RateLimit` beside it in force.
/// Whether a value is valid does not depend on the time: a date in the past is a valid wait of
/// zero.
pub(crate) fn is_asked(headers: &HeaderMap) -> bool {
    floor(headers, &|| SystemTime::UNIX_EPOCH).is_some()
}

/// The largest valid value of the field `name` over its lines.
fn largest(
    headers: &HeaderMap,
    name: HeaderName,
    read: impl Fn(&[u8]) -> Option<Duration>,
) -> Option<Duration> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|value| read(value.as_bytes()))
        .max()
}

/// The wait a millisecond field's value asks for (`1500`, `1500.25`), or `None` if the value is
/// not valid.
pub(crate) fn parse_millis(value: &[u8]) -> Option<Duration> {
    let value = value.trim_ascii();
    let (whole, fraction) = match value.iter().position(|&b| b == b'.') {
        Some(dot) => (&value[..dot], Some(&value[dot + 1..])),
        None => (value, None),
    };
    if !all_digits(whole) || fraction.is_some_and(|digits| !all_digits(digits)) {
        return None;
    }
    let Some(millis) = delta_seconds(whole) else {
        return Some(Duration::MAX);
    };
    let nanos = fraction.map_or(0, nanos_of_fraction);
    Some(Duration::from_millis(millis).saturating_add(Duration::from_nanos(nanos)))
}

/// Whether `bytes` is one or more ASCII digits.
fn all_digits(bytes: &[u8]) -> bool {
    !bytes.is_empty() && bytes.iter().all(u8::is_ascii_digit)
}

/// The nanoseconds a fraction of a millisecond stands for (its digits after the point), rounded
/// up: a floor is never shortened. At most 1,000,000.
fn nanos_of_fraction(digits: &[u8]) -> u64 {
    // A millisecond is 10^6 ns: six digits are exact, any further one that is not 0 rounds up.
    let exact = (0..6).fold(0u64, |nanos, i| {
        nanos * 10 + digits.get(i).map_or(0, |d| u64::from(d - b'0'))
    });
    let rest = digits.get(6..).unwrap_or_default();
    exact + u64::from(rest.iter().any(|&d| d != b'0'))
}

/// The wait a `Retry-After` value asks for, or `None` if the value is not valid.
pub(crate) fn parse(value: &[u8], wall_now: SystemTime) -> Option<Duration> {
    let value = value.trim_ascii();
    if value.is_empty() {
        return None;
    }
    if value.iter().all(u8::is_ascii_digit) {
        return Some(delta_seconds(value).map_or(Duration::MAX, Duration::from_secs));
    }
    let text = std::str::from_utf8(value).ok()?;
    let date = httpdate::parse_http_date(text).ok()?;
    // A date in the past asks for no wait at all.
    Some(date.duration_since(wall_now).unwrap_or(Duration::ZERO))
}

/// Digits to their value (seconds, or milliseconds), or `None` when they do not fit in a `u64`.
fn delta_seconds(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |acc, d| {
        acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-01-01T00:00:00Z, a Thursday.
    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600)
    }

    fn secs(s: u64) -> Option<Duration> {
        Some(Duration::from_secs(s))
    }

    #[test]
    fn delta_seconds_forms() {
        let table: &[(&str, Option<Duration>)] = &[
            ("0", secs(0)),
            ("7", secs(7)),
            ("120", secs(120)),
            ("007", secs(7)),
            ("  30\t", secs(30)),
            ("3600", secs(3600)),
            ("18446744073709551615", secs(u64::MAX)),
            // Too large for 64 bits: very large, not absent.
            ("18446744073709551616", Some(Duration::MAX)),
            ("99999999999999999999999", Some(Duration::MAX)),
        ];
        for (value, expected) in table {
            assert_eq!(parse(value.as_bytes(), now()), *expected, "{value:?}");
        }
    }

    #[test]
    fn http_date_forms_are_read_against_the_wall_clock() {
        let table: &[(&str, Option<Duration>)] = &[
            // IMF-fixdate, the preferred form.
            ("Thu, 01 Jan 2026 00:00:05 GMT", secs(5)),
            ("Thu, 01 Jan 2026 01:00:00 GMT", secs(3600)),
            ("Fri, 02 Jan 2026 00:00:00 GMT", secs(86_400)),
            // The obsolete forms RFC 9110 still requires recipients to accept.
            ("Thursday, 01-Jan-26 00:00:05 GMT", secs(5)),
            ("Thu Jan  1 00:00:05 2026", secs(5)),
        ];
        for (value, expected) in table {
            assert_eq!(parse(value.as_bytes(), now()), *expected, "{value:?}");
        }
    }

    #[test]
    fn dates_in_the_past_mean_now() {
        for value in [
            "Thu, 01 Jan 2026 00:00:00 GMT",
            "Wed, 31 Dec 2025 23:59:59 GMT",
            "Thu, 01 Jan 1970 00:00:00 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
        ] {
            assert_eq!(
                parse(value.as_bytes(), now()),
                Some(Duration::ZERO),
                "{value:?}"
            );
        }
    }

    #[test]
    fn malformed_values_are_ignored() {
        let table = [
            "",
            "   ",
            "-5",
            "-0",
            "+5",
            "1.5",
            "0.0",
            "1e3",
            "5 seconds",
            "five",
            "0x10",
            "12 34",
            "Thu, 32 Jan 2026 00:00:00 GMT",
            "Thu, 01 Foo 2026 00:00:00 GMT",
            "Thu, 01 Jan 2026 25:00:00 GMT",
            "Thu, 01 Jan 2026 00:00:00 PST",
            "Thu, 01 Jan 2026",
            "2026-01-01T00:00:05Z",
            "Thu, 01 Jan 2026 00:00:05 GMT garbage",
        ];
        for value in table {
            assert_eq!(parse(value.as_bytes(), now()), None, "{value:?}");
        }
    }

    #[test]
    fn bytes_that_are_not_text_are_ignored() {
        for value in [
            &b"\xff\xfe"[..],
            b"7\x00",
            b"\x80\x81\x82",
            b"Thu, 01 Jan 2026 00:00:05 \xc3\xa9",
        ] {
            assert_eq!(parse(value, now()), None, "{value:?}");
        }
    }

    #[test]
    fn a_wall_clock_far_in_the_future_or_past_does_not_overflow() {
        let date = b"Thu, 01 Jan 2026 00:00:05 GMT";
        assert_eq!(parse(date, SystemTime::UNIX_EPOCH), secs(1_767_225_605));
        let far = SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 40);
        assert_eq!(parse(date, far), Some(Duration::ZERO));
    }

    fn ms(n: u64) -> Option<Duration> {
        Some(Duration::from_millis(n))
    }

    #[test]
    fn millisecond_forms() {
        let table: &[(&str, Option<Duration>)] = &[
            ("0", ms(0)),
            ("1500", ms(1500)),
            ("  250\t", ms(250)),
            ("007", ms(7)),
            ("1500.5", Some(Duration::from_micros(1_500_500))),
            ("0.000001", Some(Duration::from_nanos(1))),
            // Below a nanosecond: rounded up, never down.
            ("0.0000001", Some(Duration::from_nanos(1))),
            ("1.0000000", ms(1)),
            ("1.9999999", ms(2)),
            ("18446744073709551615", ms(u64::MAX)),
            // Too large for 64 bits: very large, not absent.
            ("18446744073709551616", Some(Duration::MAX)),
            ("99999999999999999999999.5", Some(Duration::MAX)),
        ];
        for (value, expected) in table {
            assert_eq!(parse_millis(value.as_bytes()), *expected, "{value:?}");
        }
    }

    #[test]
    fn malformed_millisecond_values_are_ignored() {
        for value in [
            "",
            " ",
            "-5",
            "-0",
            "+5",
            "1.",
            ".5",
            "1..5",
            "1.5.5",
            "1e3",
            "1E3",
            "0x10",
            "inf",
            "NaN",
            "5 ms",
            "12 34",
            "1,500",
            "1500, 1500",
            "١٥٠٠",
        ] {
            assert_eq!(parse_millis(value.as_bytes()), None, "{value:?}");
        }
        for value in [&b"\xff"[..], b"15\x0000", b"\x80"] {
            assert_eq!(parse_millis(value), None, "{value:?}");
        }
    }

    #[test]
    fn a_million_digits_are_one_scan_and_the_largest_wait() {
        let flood = "9".repeat(1_000_000);
        assert_eq!(parse_millis(flood.as_bytes()), Some(Duration::MAX));
        let fraction = format!("1.{flood}");
        // 1.999999|999...: six digits exact, the rest rounds up to the next nanosecond.
        assert_eq!(parse_millis(fraction.as_bytes()), ms(2));
    }

    /// Header lines, name and value, in order.
    type Lines = &'static [(&'static str, &'static str)];

    /// Headers with these lines, in order.
    fn headers(lines: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in lines {
            map.append(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn milliseconds_come_before_retry_after_in_azure_s_order() {
        let table: &[(Lines, Option<Duration>)] = &[
            (&[], None),
            (&[("retry-after", "2")], secs(2)),
            (
                &[("retry-after", "2"), ("retry-after-ms", "1500")],
                ms(1500),
            ),
            (
                &[("x-ms-retry-after-ms", "700"), ("retry-after", "9")],
                ms(700),
            ),
            (
                &[("x-ms-retry-after-ms", "700"), ("retry-after-ms", "300")],
                ms(300),
            ),
            // An invalid value counts as absent: the next field is read.
            (
                &[("retry-after-ms", "soon"), ("x-ms-retry-after-ms", "700")],
                ms(700),
            ),
            (&[("retry-after-ms", "-1"), ("retry-after", "3")], secs(3)),
            (&[("retry-after-ms", "1.5.5"), ("retry-after", "x")], None),
            // A date is read against the wall clock, after the millisecond fields.
            (
                &[
                    ("retry-after", "Thu, 01 Jan 2026 00:00:05 GMT"),
                    ("x-ms-retry-after-ms", "bad"),
                ],
                secs(5),
            ),
        ];
        for (lines, expected) in table {
            assert_eq!(floor(&headers(lines), &now), *expected, "{lines:?}");
        }
    }

    #[test]
    fn a_field_on_several_lines_asks_for_its_largest_valid_value() {
        let table: &[(Lines, Option<Duration>)] = &[
            (
                &[("retry-after-ms", "100"), ("retry-after-ms", "900")],
                ms(900),
            ),
            (
                &[("retry-after-ms", "900"), ("retry-after-ms", "100")],
                ms(900),
            ),
            (&[("retry-after-ms", "x"), ("retry-after-ms", "40")], ms(40)),
            (&[("retry-after", "1"), ("retry-after", "7")], secs(7)),
            (
                &[
                    ("retry-after", "Thu, 01 Jan 2026 00:00:09 GMT"),
                    ("retry-after", "4"),
                ],
                secs(9),
            ),
            (
                &[
                    ("x-ms-retry-after-ms", "5"),
                    ("x-ms-retry-after-ms", "99999999999999999999"),
                ],
                Some(Duration::MAX),
            ),
        ];
        for (lines, expected) in table {
            assert_eq!(floor(&headers(lines), &now), *expected, "{lines:?}");
        }
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            // A fifth of the cases in a debug build (the test command), all in release.
            #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 1_000 } else { 5_000 }))]

            /// Any bytes at all: no panic, and a result only for the two valid forms.
            #[test]
            fn any_bytes_parse_without_panicking(value in proptest::collection::vec(any::<u8>(), 0..64), wall in any::<u32>()) {
                let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(u64::from(wall));
                if let Some(wait) = parse(&value, wall) {
                    let text = std::str::from_utf8(&value).unwrap().trim();
                    let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
                    prop_assert!(digits || httpdate::parse_http_date(text).is_ok());
                    // A date is at most the range of the wall clock ahead; only digits beyond
                    // 64 bits read as the largest wait.
                    if !digits {
                        prop_assert!(wait < Duration::from_secs(1 << 40), "{:?}", wait);
                    }
                } else {
                    let text = String::from_utf8_lossy(&value);
                    let text = text.trim_matches(|c: char| c == ' ' || c == '\t');
                    prop_assert!(text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()));
                }
            }

            /// Text shaped like the real forms, with noise mixed in.
            #[test]
            fn near_valid_text_parses_without_panicking(value in r"[ \t]{0,2}[-+]?[0-9]{0,25}(\.[0-9]{0,3})?[ \t]{0,2}|[A-Za-z]{3}, [0-9]{1,2} [A-Za-z]{3} [0-9]{1,5} [0-9]{2}:[0-9]{2}:[0-9]{2} [A-Z]{3}") {
                let _ = parse(value.as_bytes(), now());
            }

            /// Any string of digits: read exactly when it fits in 64 bits, as the largest wait
            /// when it does not; never absent.
            #[test]
            fn any_digit_string_is_a_wait(digits in "[0-9]{1,400}") {
                let wait = parse(digits.as_bytes(), now());
                let exact = digits.parse::<u64>().ok();
                match exact {
                    Some(n) => prop_assert_eq!(wait, Some(Duration::from_secs(n))),
                    None => prop_assert_eq!(wait, Some(Duration::MAX)),
                }
            }

            /// Every delta that fits in 64 bits is read exactly.
            #[test]
            fn delta_seconds_round_trip(n in any::<u64>(), pad in 0usize..3) {
                let value = format!("{}{n}", "0".repeat(pad));
                prop_assert_eq!(parse(value.as_bytes(), now()), Some(Duration::from_secs(n)));
            }

            /// Every valid date ahead of the wall clock is read to the second.
            #[test]
            fn future_dates_round_trip(ahead in 0u64..(200 * 365 * 86_400)) {
                let date = now() + Duration::from_secs(ahead);
                let value = httpdate::fmt_http_date(date);
                prop_assert_eq!(parse(value.as_bytes(), now()), Some(Duration::from_secs(ahead)));
            }

            /// Any bytes in a millisecond field: no panic, and a wait only for digits with an
            /// optional fraction, never below what they say.
            #[test]
            fn any_bytes_in_a_millisecond_field_parse_without_panicking(value in proptest::collection::vec(any::<u8>(), 0..64)) {
                let text = String::from_utf8_lossy(&value);
                let text = text.trim_matches(|c: char| c.is_ascii_whitespace());
                let (whole, fraction) = match text.split_once('.') {
                    Some((whole, fraction)) => (whole, Some(fraction)),
                    None => (text, None),
                };
                let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
                let valid = std::str::from_utf8(&value).is_ok()
                    && digits(whole)
                    && fraction.is_none_or(digits);
                let wait = parse_millis(&value);
                prop_assert_eq!(wait.is_some(), valid, "{:?}", text);
                if let (Some(wait), Ok(whole)) = (wait, whole.parse::<u64>()) {
                    prop_assert!(wait >= Duration::from_millis(whole));
                    prop_assert!(wait <= Duration::from_millis(whole) + Duration::from_millis(1));
                }
            }

            /// The shapes of the `Retry-After` tests, in a millisecond field.
            #[test]
            fn near_valid_millisecond_text_parses_without_panicking(value in r"[ \t]{0,2}[-+]?[0-9]{0,25}(\.[0-9]{0,12})?([eE][-+]?[0-9]{1,3})?[ \t]{0,2}") {
                if let Some(wait) = parse_millis(value.as_bytes()) {
                    prop_assert!(!value.contains(['-', '+', 'e', 'E']), "{:?}", value);
                    // What a float reader makes of it, rounded up to the nanosecond at most.
                    if let Ok(float) = value.trim().parse::<f64>() {
                        if float < 1e12 {
                            let read = wait.as_secs_f64() * 1_000.0;
                            prop_assert!((read - float).abs() <= 1e-3, "{value:?}: {read}");
                        }
                    }
                }
            }

            /// Whole and fractional milliseconds that fit are read exactly, to the nanosecond,
            /// any further digit rounding up.
            #[test]
            fn milliseconds_round_trip(whole in any::<u64>(), nanos in 0u32..1_000_000, tail in "[0-9]{0,6}") {
                let value = format!("{whole}.{nanos:06}{tail}");
                let up = u64::from(tail.bytes().any(|d| d != b'0'));
                let expected = Duration::from_millis(whole)
                    .saturating_add(Duration::from_nanos(u64::from(nanos) + up));
                prop_assert_eq!(parse_millis(value.as_bytes()), Some(expected));
            }

        }
    }
}
