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

use std::time::{Duration, SystemTime};

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

/// Digits to seconds, or `None` when they do not fit in a `u64`.
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
        }
    }
}
