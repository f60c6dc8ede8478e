//! gRPC's retry rules (gRFC A6), beside the HTTP ones and in the same terms: what a gRPC answer's
//! head says of the call (a status, or a committed call), the server's pushback, the call's
//! deadline as `grpc-timeout` writes it, the retry policy and service config (`config`), and
//! the channel's retry throttling (`throttle`). Nothing here names tonic: the gRPC door reads
//! its answers into `http`'s types, and these rules read those.
//!
//! # What an answer says
//!
//! A gRPC call answers with HTTP status 200 and, at its end, trailers holding `grpc-status`. A
//! call the server refuses at once answers *trailers-only*: `grpc-status` in the headers, no
//! body. Only such an answer, or none, can be retried: once the server has sent headers
//! without a status, the call is *committed* (it may have acted, and its messages are the
//! caller's), and A6 never retries it. An answer with another HTTP status comes from something
//! in the path that does not speak gRPC (a proxy), and its status stands for a gRPC code as
//! gRPC's HTTP mapping says (`429`, `502`, `503` and `504` are `UNAVAILABLE`).

pub(crate) mod config;
pub(crate) mod hedging;
pub(crate) mod rules;
pub(crate) mod throttle;

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::engine::course::Pushback;

/// Values by a gRPC call's path (`/pkg.Service/Method`), found as a service config finds a
/// method's: the method's own, else its service's, else the one for every method. A lookup
/// is at most two hash look-ups of slices of the path, whatever the number of names.
#[derive(Debug, Clone)]
pub(crate) struct PathTable<T> {
    /// By `/pkg.Service/Method`.
    methods: std::collections::HashMap<String, T, Fnv>,
    /// By `/pkg.Service/`.
    services: std::collections::HashMap<String, T, Fnv>,
}

impl<T> Default for PathTable<T> {
    fn default() -> Self {
        PathTable {
            methods: std::collections::HashMap::default(),
            services: std::collections::HashMap::default(),
        }
    }
}

/// FNV-1a, for the path table's keys: a call's path is a few dozen bytes, which SipHash (the
/// standard map's, keyed against collisions an attacker picks) hashes in some hundred
/// instructions on every call. Its keys are the config's names, and a path looked up that is
/// none of them finds nothing whatever it collides with.
type Fnv = std::hash::BuildHasherDefault<FnvHasher>;

/// The state of an FNV-1a hash.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FnvHasher(u64);

impl Default for FnvHasher {
    fn default() -> Self {
        FnvHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for FnvHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0 ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

impl<T> PathTable<T> {
    /// `value` for the calls of `service`'s `method`, or of every method of `service`.
    pub(crate) fn insert(&mut self, service: &str, method: Option<&str>, value: T) {
        match method {
            Some(method) => self.methods.insert(format!("/{service}/{method}"), value),
            None => self.services.insert(format!("/{service}/"), value),
        };
    }

    /// The value of the call to `path`: its method's, else its service's.
    pub(crate) fn get(&self, path: &str) -> Option<&T> {
        if self.methods.is_empty() && self.services.is_empty() {
            return None;
        }
        if let Some(value) = self.methods.get(path) {
            return Some(value);
        }
        // `/pkg.Service/`: the path up to its second slash.
        let end = path.get(1..)?.find('/')? + 2;
        self.services.get(&path[..end])
    }

    /// Every value.
    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.methods.values().chain(self.services.values())
    }

    /// Every value, to change.
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.methods.values_mut().chain(self.services.values_mut())
    }

    /// Whether it holds nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.methods.is_empty() && self.services.is_empty()
    }
}

/// The most attempts A6 allows a retry or hedging policy unless raised on purpose
/// ([`GrpcRetryPolicyBuilder::allow_attempts_above_five`](crate::grpc::GrpcRetryPolicyBuilder::allow_attempts_above_five),
/// [`GrpcHedgingPolicyBuilder::allow_attempts_above_five`](crate::grpc::GrpcHedgingPolicyBuilder::allow_attempts_above_five)).
pub const GRPC_MAX_ATTEMPTS: u32 = 5;

/// A policy's `maxAttempts` (`given`): required, at least 2, cut to A6's 5 or to `most` when
/// raised on purpose; else what is wrong with it, for a `kind` policy.
pub(crate) fn max_attempts(
    given: Option<u32>,
    most: Option<u32>,
    kind: &str,
) -> Result<u32, String> {
    let Some(attempts) = given else {
        return Err("maxAttempts is required: set max_attempts".into());
    };
    if attempts < 2 {
        return Err(format!(
            "maxAttempts ({attempts}) must be at least 2 (1 would be no {kind} policy at all)"
        ));
    }
    let most = most.unwrap_or(GRPC_MAX_ATTEMPTS).max(GRPC_MAX_ATTEMPTS);
    Ok(attempts.min(most))
}

/// The longest duration a policy's field may hold: what grpc-go reads a duration into (a
/// `time.Duration`, nanoseconds in 63 bits: about 292 years). Longer ones are refused at build,
/// rather than overflowing the clock's arithmetic when a call uses them.
pub(crate) const LONGEST: Duration = Duration::from_nanos(i64::MAX as u64);

/// `value` of the field `field`, if it is not longer than [`LONGEST`]; else what is wrong.
pub(crate) fn in_range(value: Duration, field: &str) -> Result<Duration, String> {
    if value > LONGEST {
        return Err(format!(
            "{field} ({value:?}) is longer than a gRPC duration holds (about 292 years, as \
             grpc-go reads it): use a shorter one"
        ));
    }
    Ok(value)
}

/// The status codes of the field `field`: at least one, each a code, not `OK` (a success is
/// never retried, nor a failure; grpc-java refuses it too); else what is wrong.
pub(crate) fn status_codes(codes: Vec<i32>, field: &str) -> Result<CodeSet, String> {
    if codes.is_empty() {
        return Err(format!("{field} must name at least one code"));
    }
    codes_without_ok(codes, field)
}

/// The status codes of the field `field`, none of them `OK`; else what is wrong.
pub(crate) fn codes_without_ok(codes: Vec<i32>, field: &str) -> Result<CodeSet, String> {
    if codes.contains(&i32::from(OK)) {
        return Err(format!(
            "{field} names OK, which is no failure: leave it out"
        ));
    }
    CodeSet::of(codes)
        .map_err(|code| format!("{field}: {code} is not a gRPC status code (0 to 16)"))
}

/// The configuration error of `area` that says `msg`.
pub(crate) fn bad_in(area: &'static str) -> impl Fn(String) -> crate::error::InvalidConfig {
    move |msg| crate::error::InvalidConfig::new(area, msg)
}

/// The status codes, by number, as gRPC names them.
pub(crate) const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// The header names the rules read and write, made once: a name written as text is parsed
/// again at every lookup.
pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
pub(crate) const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
pub(crate) const PREVIOUS_ATTEMPTS: HeaderName =
    HeaderName::from_static("grpc-previous-rpc-attempts");

/// `OK`.
pub(crate) const OK: u8 = 0;
/// `CANCELLED`.
pub(crate) const CANCELLED: u8 = 1;
/// `UNKNOWN`: what an unreadable `grpc-status` stands for.
pub(crate) const UNKNOWN: u8 = 2;
/// `INTERNAL`.
const INTERNAL: u8 = 13;
/// `UNAVAILABLE`: what a transport failure stands for.
pub(crate) const UNAVAILABLE: u8 = 14;

/// A call's deadline when it gives none (`grpc-timeout`): a gRPC call has none of its own, so
/// the retries' is long.
pub(crate) const NO_DEADLINE: Duration = Duration::from_secs(365 * 24 * 3600);

/// A set of gRPC status codes (0 to 16).
#[derive(Clone, Copy, PartialEq, Eq, Default, Hash)]
pub(crate) struct CodeSet(u32);

impl CodeSet {
    /// The set of `codes`; `None` if one is not a gRPC code (0 to 16).
    pub(crate) fn of(codes: impl IntoIterator<Item = i32>) -> Result<CodeSet, i32> {
        let mut set = 0u32;
        for code in codes {
            match u8::try_from(code) {
                Ok(c) if usize::from(c) < NAMES.len() => set |= 1 << c,
                _ => return Err(code),
            }
        }
        Ok(CodeSet(set))
    }

    /// Whether `code` is in the set.
    pub(crate) fn has(self, code: u8) -> bool {
        self.0
            .checked_shr(u32::from(code))
            .is_some_and(|bits| bits & 1 == 1)
    }
}

impl std::fmt::Debug for CodeSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = (0..NAMES.len()).filter(|&c| self.0 & (1 << c) != 0);
        f.debug_set().entries(names.map(|c| NAMES[c])).finish()
    }
}

/// The code named `name` (`"UNAVAILABLE"`, in any case), as a service config writes it.
pub(crate) fn code_named(name: &str) -> Option<u8> {
    let at = NAMES.iter().position(|n| n.eq_ignore_ascii_case(name))?;
    u8::try_from(at).ok()
}

/// What an answer's head says of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Said {
    /// Headers without a status: the call is committed, its status comes in its trailers.
    Committed,
    /// The call's status, from a trailers-only answer, or from an HTTP status that is not 200.
    Status(u8),
}

/// The most headers a lookup passes along instead of hashing the name.
const PASSED: usize = 8;

/// The first value of header `name` in `headers`, and whether another follows it. A gRPC
/// head or trailers hold a handful of headers, and comparing each name costs less than hashing
/// the one looked for (about 150 instructions a lookup, found or not): a small map is passed
/// along, a large one looked up by hash.
fn values<'h>(headers: &'h HeaderMap, name: &HeaderName) -> (Option<&'h HeaderValue>, bool) {
    if headers.len() <= PASSED {
        let mut named = headers.iter().filter(|(n, _)| *n == name);
        let first = named.next().map(|(_, value)| value);
        return (first, first.is_some() && named.next().is_some());
    }
    let mut named = headers.get_all(name).iter();
    (named.next(), named.next().is_some())
}

/// The first value of header `name` in `headers` (see [`values`]).
pub(crate) fn header<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<&'h HeaderValue> {
    if headers.len() <= PASSED {
        return headers
            .iter()
            .find_map(|(n, value)| (n == name).then_some(value));
    }
    headers.get(name)
}

/// What an answer with HTTP `status` and `headers` says of the call.
pub(crate) fn said(status: StatusCode, headers: &HeaderMap) -> Said {
    if let Some(value) = header(headers, &GRPC_STATUS) {
        return Said::Status(code_of(value));
    }
    if status == StatusCode::OK {
        return Said::Committed;
    }
    // gRPC's HTTP-to-gRPC status mapping, for an answer from something that does not speak
    // gRPC.
    Said::Status(match status.as_u16() {
        400 => INTERNAL,
        401 => 16,
        403 => 7,
        404 => 12,
        429 | 502 | 503 | 504 => UNAVAILABLE,
        _ => UNKNOWN,
    })
}

/// The code a `grpc-status` value (or a trailer's) holds: a decimal from 0 to 16; anything else
/// is `UNKNOWN`, as gRPC's clients read it.
pub(crate) fn code_of(value: &HeaderValue) -> u8 {
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > 2 || !bytes.iter().all(u8::is_ascii_digit) {
        return UNKNOWN;
    }
    let code = bytes.iter().fold(0u8, |n, d| n * 10 + (d - b'0'));
    if usize::from(code) < NAMES.len() {
        code
    } else {
        UNKNOWN
    }
}

/// The server's pushback on an answer (`grpc-retry-pushback-ms`): absent, a wait, or, when
/// negative or malformed, do not retry (A6: "a negative or malformed value means do not
/// retry").
pub(crate) fn pushback(headers: &HeaderMap) -> Pushback {
    let (first, more) = values(headers, &PUSHBACK);
    let Some(value) = first else {
        return Pushback::Absent;
    };
    if more {
        // Two values say two things: malformed.
        return Pushback::Stop;
    }
    let text = value.to_str().unwrap_or("").trim();
    // An int32, as A6 says; a longer run of digits is malformed.
    match text.parse::<i32>() {
        Ok(ms) if ms >= 0 => Pushback::Wait(Duration::from_millis(ms.unsigned_abs().into())),
        _ => Pushback::Stop,
    }
}

/// The call's deadline from now, as its `grpc-timeout` says (at most 8 digits and a unit: `H`,
/// `M`, `S`, `m`, `u`, `n`); `None` when there is none, or it is malformed.
pub(crate) fn timeout_of(headers: &HeaderMap) -> Option<Duration> {
    let bytes = header(headers, &GRPC_TIMEOUT)?.as_bytes();
    let (&unit, digits) = bytes.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits
        .iter()
        .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// gRPC's attempt headers (A6), on the copy of attempt `number` sent `left` before the call's
/// deadline: `grpc-previous-rpc-attempts` on every retry, and the call's `grpc-timeout`, when
/// it has one, cut to what is left (the deadline spans its attempts).
pub(crate) fn attempt_headers(headers: &mut HeaderMap, number: u32, left: Duration) {
    if number > 1 {
        headers.insert(PREVIOUS_ATTEMPTS, HeaderValue::from(number - 1));
    }
    if header(headers, &GRPC_TIMEOUT).is_some() {
        headers.insert(GRPC_TIMEOUT, timeout_value(left));
    }
}

/// `left` as a `grpc-timeout` value: in the finest unit whose count fits in 8 digits, rounded
/// down (the server never believes the client waits longer than it does).
pub(crate) fn timeout_value(left: Duration) -> HeaderValue {
    const MOST: u128 = 99_999_999;
    let units: [(u128, u8); 6] = [
        (1, b'n'),
        (1_000, b'u'),
        (1_000_000, b'm'),
        (1_000_000_000, b'S'),
        (60_000_000_000, b'M'),
        (3_600_000_000_000, b'H'),
    ];
    let nanos = left.as_nanos();
    let (count, unit) = units
        .iter()
        .map(|&(per, unit)| (nanos / per, unit))
        .find(|&(count, _)| count <= MOST)
        .unwrap_or((MOST, b'H'));
    let mut text = count.to_string().into_bytes();
    text.push(unit);
    HeaderValue::from_bytes(&text).unwrap_or(HeaderValue::from_static("99999999H"))
}

#[cfg(test)]
mod tests;
