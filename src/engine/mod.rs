//! The engine: every rule of the crate, sans-IO. Handed values (the time now, the wall time
//! when a date must be read, an attempt's outcome as a neutral head and fault, the headers it
//! needs), it answers the next action; it never reads a clock, never awaits, and never names a
//! client library. The driver (`crate::driver`) runs what it answers; the doors
//! (`crate::door`) bring each client's requests to the driver.

pub(crate) mod advice;
pub(crate) mod attempt_headers;
pub(crate) mod backoff;
pub(crate) mod budget;
pub(crate) mod classifier;
pub(crate) mod classify;
pub(crate) mod course;
pub(crate) mod decide;
pub(crate) mod dependency;
#[cfg(feature = "grpc")]
pub(crate) mod grpc;
pub(crate) mod idempotency;
pub(crate) mod latency;
pub(crate) mod observed;
pub(crate) mod policy;
pub(crate) mod rate_limit;
pub(crate) mod retry_after;
pub(crate) mod rules;
pub(crate) mod schedule;
pub(crate) mod seen;
pub(crate) mod throttle;

/// Whether `headers` has a field of any of `names`. Asked of every answer for fields most
/// answers lack (`Retry-After`, the retry advice, the replay marker): on the few fields an
/// answer carries, comparing names costs less than hashing each name for a lookup.
#[inline]
pub(crate) fn has_any(headers: &http::HeaderMap, names: &[http::HeaderName]) -> bool {
    if headers.keys_len() <= 8 {
        return headers.keys().any(|key| names.contains(key));
    }
    names.iter().any(|name| headers.contains_key(name))
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderName, HeaderValue};

    /// A map of `fields` (names), each with one line.
    fn map(fields: &[&str]) -> HeaderMap {
        fields
            .iter()
            .map(|name| {
                (
                    HeaderName::try_from(*name).unwrap(),
                    HeaderValue::from_static("1"),
                )
            })
            .collect()
    }

    /// The same answer whether the map is scanned (up to 8 fields) or looked up (more).
    #[test]
    fn has_any_finds_a_field_in_a_small_map_and_in_a_large_one() {
        let names = [
            http::header::RETRY_AFTER,
            HeaderName::from_static("x-should-retry"),
        ];
        let others: Vec<String> = (0..12).map(|i| format!("x-other-{i}")).collect();
        for size in [0, 1, 7, 8, 9, 12] {
            let mut fields: Vec<&str> = others[..size].iter().map(String::as_str).collect();
            assert!(!super::has_any(&map(&fields), &names), "{size} others");
            fields.push("x-should-retry");
            assert!(
                super::has_any(&map(&fields), &names),
                "{size} others and one"
            );
            fields.pop();
            fields.insert(0, "Retry-After");
            assert!(
                super::has_any(&map(&fields), &names),
                "one and {size} others"
            );
            assert!(!super::has_any(&map(&fields), &[]), "no names");
        }
    }
}
