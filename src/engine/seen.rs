//! What the engine reads of a request and of an attempt's outcome, whatever door they came
//! through: borrowed heads in `http`'s types and the crate's own, and a door-neutral fault. Each
//! door makes these of its own types (`crate::door`); nothing here knows a client library.

use std::error::Error;

use http::{HeaderMap, StatusCode, Version};

use crate::fault::Fault;

/// Where a request goes, or where an answer came from: its scheme, host and port (the port as
/// written, else the scheme's known default), as an origin (RFC 6454) is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Target<'a> {
    pub(crate) scheme: &'a str,
    /// The host as written, an IPv6 address in brackets.
    pub(crate) host: &'a str,
    pub(crate) port: Option<u16>,
}

impl<'a> Target<'a> {
    /// The target of `scheme://host[:port]`; `port` as written, if it was: an `http` or `https`
    /// target without one has its scheme's default.
    pub(crate) fn new(scheme: &'a str, host: &'a str, port: Option<u16>) -> Self {
        let port = port.or(match scheme {
            "http" => Some(80),
            "https" => Some(443),
            _ => None,
        });
        Target { scheme, host, port }
    }
}

/// What knows where it points (a door's URL or URI), asked only when a rule needs the target:
/// a quota to look up, a route to match. Most requests need neither.
pub(crate) trait Locate: Sync {
    /// The target it points to.
    fn target(&self) -> Target<'_>;
}

impl Locate for Target<'_> {
    fn target(&self) -> Target<'_> {
        *self
    }
}

impl std::fmt::Debug for dyn Locate + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.target().fmt(f)
    }
}

/// The host and the port of an authority (`[user@]host[:port]`), as `http::Uri::host` and
/// `port_u16` read them, in one pass over its bytes: a port that is not a number up to 65535 is
/// none, as there. This runs for every request, where `http`'s own readers search the text
/// three times.
pub(crate) fn split_authority(authority: &str) -> (&str, Option<u16>) {
    let bytes = authority.as_bytes();
    // Where the host starts (after the last `@`); after that, where the last `:` ends (0: none)
    // and where the last `]` is (0: none, as no authority starts with one).
    let (mut start, mut colon, mut closed) = (0, 0, 0);
    for (at, byte) in bytes.iter().enumerate() {
        if *byte == b':' {
            colon = at + 1;
        } else if *byte == b'@' {
            (start, colon, closed) = (at + 1, 0, 0);
        } else if *byte == b']' {
            closed = at;
        }
    }
    // No colon, or one inside an IPv6 address's brackets: no port.
    if colon <= closed {
        return (authority.get(start..).unwrap_or(""), None);
    }
    let host = authority.get(start..colon - 1).unwrap_or("");
    (host, bytes.get(colon..).and_then(port_of))
}

/// The port `digits` write, read as `http` reads one (as `u16`'s own parser does: decimal
/// digits after an optional `+`, up to 65535).
fn port_of(digits: &[u8]) -> Option<u16> {
    let digits = digits.strip_prefix(b"+").unwrap_or(digits);
    if digits.is_empty() {
        return None;
    }
    let mut value: u16 = 0;
    for digit in digits {
        let digit = digit.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        value = value.checked_mul(10)?.checked_add(u16::from(digit))?;
    }
    Some(value)
}

/// Where a URI points, as the engine reads it: only when a rule asks.
impl Locate for http::Uri {
    fn target(&self) -> Target<'_> {
        let (host, port) = self
            .authority()
            .map_or(("", None), |authority| split_authority(authority.as_str()));
        Target::new(self.scheme_str().unwrap_or(""), host, port)
    }
}

/// An answer's head, as the engine and a [classifier](crate::Dependency::with_classifier) read
/// it: its status, HTTP version and headers, whichever door it came through.
#[derive(Debug, Clone, Copy)]
pub struct ResponseHead<'a> {
    pub(crate) status: StatusCode,
    pub(crate) version: Version,
    pub(crate) headers: &'a HeaderMap,
    /// Where the answer came from (after any redirect): its quota is that origin's.
    pub(crate) from: &'a dyn Locate,
}

impl<'a> ResponseHead<'a> {
    /// The answer's status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The HTTP version it came over.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The answer's headers.
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }
}

/// An attempt that got no answer: its fault, if the door knows a transient one, and the error
/// itself, for a classifier to look into.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Failure<'a> {
    pub(crate) fault: Option<Fault>,
    pub(crate) error: &'a (dyn Error + 'static),
}

/// An attempt's outcome, as the engine reads it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Seen<'a> {
    /// The server answered, with any status.
    Answer(ResponseHead<'a>),
    /// No answer.
    Failed(Failure<'a>),
}

impl Seen<'_> {
    /// The transient fault of an attempt that got no answer, if there is one.
    pub(crate) fn fault(&self) -> Option<Fault> {
        match self {
            Seen::Answer(_) => None,
            Seen::Failed(failure) => failure.fault,
        }
    }

    /// Whether the attempt may have reached the server, and with it the key it carried:
    /// anything but a failure that certainly sent nothing.
    pub(crate) fn may_have_reached(&self) -> bool {
        !self.fault().is_some_and(Fault::nothing_sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_is_a_number_up_to_65535() {
        for (digits, port) in [
            ("0", Some(0)),
            ("80", Some(80)),
            ("65535", Some(65535)),
            ("65536", None),
            ("99999", None),
            ("000080", Some(80)),
            ("", None),
            ("8a", None),
            ("+8", Some(8)),
            ("+", None),
            ("-8", None),
            ("8+", None),
        ] {
            assert_eq!(port_of(digits.as_bytes()), port, "{digits}");
        }
        assert_eq!(split_authority("a@b:1@h:2"), ("h", Some(2)));
        assert_eq!(split_authority("[::1]"), ("[::1]", None));
        assert_eq!(split_authority("[::1]:9"), ("[::1]", Some(9)));
        assert_eq!(split_authority(""), ("", None));
    }

    #[test]
    fn a_target_without_a_port_has_its_scheme_s_default() {
        assert_eq!(Target::new("http", "a", None).port, Some(80));
        assert_eq!(Target::new("https", "a", None).port, Some(443));
        assert_eq!(Target::new("https", "a", Some(8443)).port, Some(8443));
        assert_eq!(Target::new("ws+unix", "a", None).port, None);
    }

    #[test]
    fn only_a_failure_that_certainly_sent_nothing_kept_the_key_from_the_server() {
        let io = std::io::Error::other("x");
        let failed = |fault| Seen::Failed(Failure { fault, error: &io });
        assert!(!failed(Some(Fault::Connect)).may_have_reached());
        assert!(!failed(Some(Fault::NotProcessed)).may_have_reached());
        for fault in [
            None,
            Some(Fault::Timeout),
            Some(Fault::Reset),
            Some(Fault::Incomplete),
        ] {
            assert!(failed(fault).may_have_reached(), "{fault:?}");
        }
        let headers = HeaderMap::new();
        let answer = Seen::Answer(ResponseHead {
            status: StatusCode::SERVICE_UNAVAILABLE,
            version: Version::HTTP_11,
            headers: &headers,
            from: &Target::new("http", "127.0.0.1", None),
        });
        assert!(answer.may_have_reached());
        assert_eq!(answer.fault(), None);
    }

    #[test]
    fn a_response_head_shows_what_it_was_given() {
        let mut headers = HeaderMap::new();
        headers.insert("x-reason", "maintenance".parse().unwrap());
        let head = ResponseHead {
            status: StatusCode::BAD_GATEWAY,
            version: Version::HTTP_2,
            headers: &headers,
            from: &Target::new("https", "a.test", None),
        };
        assert_eq!(head.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(head.version(), Version::HTTP_2);
        assert_eq!(head.headers()["x-reason"], "maintenance");
        assert_eq!(head.from.target().port, Some(443));
        assert_eq!(
            format!("{:?}", head.from),
            format!("{:?}", head.from.target())
        );
    }
}
