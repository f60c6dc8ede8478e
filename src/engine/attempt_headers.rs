//! Headers that tell the server which attempt it is answering and how long the client will
//! still wait for the answer.
//!
//! A server sees every attempt as a first one unless it is told. AWS's SDKs send
//! `amz-sdk-request: attempt=2; max=3`, Google's `gccl-attempt-count`, Envoy
//! `x-envoy-attempt-count` and `x-envoy-expected-rq-timeout-ms`, the generated SDKs
//! `x-stainless-retry-count` and `x-stainless-timeout`. With the attempt number a server can
//! answer retries differently from first attempts under overload (the SRE book's "overloaded;
//! don't retry"), and count them; with the time left it can drop work whose caller has already
//! given up. Both are opt-in per dependency, under a name of the user's choice, since servers
//! disagree on the name and an unknown header costs bytes on every request.
//!
//! The values are plain decimals, the form every server parses: the attempt number from 1, and
//! the whole milliseconds left before the request's deadline when the attempt is sent (rounded
//! down, so the server never believes the client waits longer than it does). Each attempt gets
//! its own values; a header of the same name that the caller set is replaced.

use std::time::Duration;

use http::{HeaderName, HeaderValue};

use crate::engine::idempotency::STANDARD_FIELDS;
use crate::error::InvalidConfig;

/// The area named in this module's configuration errors.
const AREA: &str = "attempt headers";

/// The attempt headers a dependency sends, if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AttemptHeaders {
    /// The attempt number's header.
    pub(crate) attempt: Option<HeaderName>,
    /// The header of the time left before the deadline, in milliseconds.
    pub(crate) deadline: Option<HeaderName>,
}

impl AttemptHeaders {
    /// Whether any is sent.
    #[inline]
    pub(crate) fn are_on(&self) -> bool {
        self.attempt.is_some() || self.deadline.is_some()
    }

    /// Puts attempt `number`'s headers on the copy of the request it sends, `left` before the
    /// request's deadline.
    pub(crate) fn put_on(&self, headers: &mut http::HeaderMap, number: u32, left: Duration) {
        if let Some(name) = &self.attempt {
            headers.insert(name.clone(), HeaderValue::from(number));
        }
        if let Some(name) = &self.deadline {
            let millis = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
            headers.insert(name.clone(), HeaderValue::from(millis));
        }
    }
}

/// `name` as the name of the header `what` (`"attempt"`, `"deadline"`), unless it is not a
/// valid header name, is a standard field that means something else, or is one of `taken`
/// (the names the dependency's other headers already use).
pub(crate) fn header_name(
    what: &str,
    name: &str,
    taken: &[Option<&HeaderName>],
) -> Result<HeaderName, InvalidConfig> {
    let parsed = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
        InvalidConfig::new(
            AREA,
            format!("{what} header {name:?} is not a valid HTTP header name: use letters, digits and '-'"),
        )
    })?;
    if STANDARD_FIELDS.contains(&parsed.as_str()) {
        return Err(InvalidConfig::new(
            AREA,
            format!(
                "{what} header {name:?} is a standard HTTP field that carries something else: \
                 choose a name of its own, such as \"x-attempt\""
            ),
        ));
    }
    if taken.iter().flatten().any(|other| **other == parsed) {
        return Err(InvalidConfig::new(
            AREA,
            format!(
                "{what} header {name:?} is already the dependency's idempotency key, attempt or \
                 deadline header: give each its own name"
            ),
        ));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> http::Request<()> {
        http::Request::new(())
    }

    #[test]
    fn each_attempt_gets_its_number_and_the_whole_milliseconds_left() {
        let headers = AttemptHeaders {
            attempt: Some(HeaderName::from_static("x-attempt")),
            deadline: Some(HeaderName::from_static("x-deadline-ms")),
        };
        let mut sending = request();
        sending
            .headers_mut()
            .insert("x-attempt", HeaderValue::from_static("callers"));
        headers.put_on(sending.headers_mut(), 2, Duration::from_micros(29_950_999));
        assert_eq!(sending.headers()["x-attempt"], "2");
        assert_eq!(sending.headers()["x-deadline-ms"], "29950");
        assert_eq!(sending.headers().get_all("x-attempt").iter().count(), 1);
        headers.put_on(sending.headers_mut(), u32::MAX, Duration::MAX);
        assert_eq!(sending.headers()["x-attempt"], "4294967295");
        assert_eq!(sending.headers()["x-deadline-ms"], "18446744073709551615");
        // None configured: nothing added.
        let mut bare = request();
        let off = AttemptHeaders::default();
        assert!(!off.are_on() && headers.are_on());
        off.put_on(bare.headers_mut(), 1, Duration::ZERO);
        assert!(bare.headers().is_empty());
        let one = AttemptHeaders {
            attempt: None,
            deadline: Some(HeaderName::from_static("x-deadline-ms")),
        };
        assert!(one.are_on());
    }

    #[test]
    fn a_header_name_must_be_valid_its_own_and_not_a_standard_field() {
        let key = HeaderName::from_static("idempotency-key");
        let ok = header_name("attempt", "X-Attempt", &[Some(&key)]).unwrap();
        assert_eq!(ok.as_str(), "x-attempt");
        let message = |name, taken: &[Option<&HeaderName>]| {
            header_name("attempt", name, taken).unwrap_err().to_string()
        };
        assert!(message("x attempt", &[]).contains("not a valid HTTP header name"));
        assert!(message("", &[]).contains("not a valid HTTP header name"));
        assert!(message("Content-Type", &[]).contains("standard HTTP field"));
        assert!(message("Idempotency-Key", &[Some(&key), None]).contains("give each its own name"));
        let err = header_name("deadline", "x-attempt", &[None, Some(&ok)]).unwrap_err();
        assert_eq!(err.area(), "attempt headers");
    }
}
