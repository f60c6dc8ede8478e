//! The IETF RateLimit fields (draft-ietf-httpapi-ratelimit-headers-10): a server's word that a
//! client's quota is spent, and for how long.
//!
//! `RateLimit: "default";r=0;t=12` says: under the policy `default`, 0 requests remain, and the
//! quota resets in 12 seconds. The field is a Structured Field List; each member names a policy
//! (a String or a Token) with the parameters `r` (remaining) and `t` (seconds until reset),
//! both non-negative integers. `RateLimit-Policy` describes the policies (quota, window) and is
//! not needed to act on `RateLimit`. A member without `r`, or with a malformed value, is ignored;
//! so is a field that cannot be read at all. A `Retry-After` on the same response takes
//! precedence.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http::HeaderMap;

/// The field's name.
const RATE_LIMIT: http::HeaderName = http::HeaderName::from_static("ratelimit");

/// The longest reset a server is believed for: a day. Beyond it the value is taken as an error,
/// not as a reason to wait.
const LONGEST_RESET: u64 = 86_400;

/// What a response's RateLimit field says of the quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Quota {
    /// Some policy is spent, for this long (the longest of the spent ones).
    Spent(Duration),
    /// Every policy named has requests left.
    Left,
}

/// Reads a RateLimit field's value; `None` when no member can be read.
pub(crate) fn parse(value: &[u8]) -> Option<Quota> {
    let text = std::str::from_utf8(value).ok()?;
    let mut spent: Option<Duration> = None;
    let mut any = false;
    for member in split_outside_quotes(text, ',') {
        let Some((remaining, reset)) = member_params(member) else {
            continue;
        };
        any = true;
        if remaining == 0 {
            let wait = Duration::from_secs(reset.unwrap_or(0));
            spent = Some(spent.map_or(wait, |w| w.max(wait)));
        }
    }
    match (spent, any) {
        (Some(wait), _) => Some(Quota::Spent(wait)),
        (None, true) => Some(Quota::Left),
        (None, false) => None,
    }
}

/// A member's `r` and `t`, if the member is well formed and has `r`.
fn member_params(member: &str) -> Option<(u64, Option<u64>)> {
    let mut parts = split_outside_quotes(member, ';');
    let name = parts.next()?.trim();
    let named = (name.len() >= 2 && name.starts_with('"') && name.ends_with('"'))
        || (!name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.*:/%!#$&'+^`|~".contains(&b)));
    if !named {
        return None;
    }
    let (mut remaining, mut reset) = (None, None);
    for param in parts {
        let (key, value) = param.trim().split_once('=')?;
        let number = || -> Option<u64> {
            let digits = value.trim();
            // Structured Field Integers have at most 15 digits: no overflow here.
            if digits.is_empty() || digits.len() > 15 || !digits.bytes().all(|b| b.is_ascii_digit())
            {
                return None;
            }
            digits.parse().ok()
        };
        match key.trim() {
            "r" => remaining = Some(number()?),
            "t" => reset = Some(number()?.min(LONGEST_RESET)),
            _ => {}
        }
    }
    Some((remaining?, reset))
}

/// `text` cut at every `sep` that is not inside a quoted string.
fn split_outside_quotes(text: &str, sep: char) -> impl Iterator<Item = &str> {
    let mut quoted = false;
    let mut escaped = false;
    let mut start = 0;
    let mut cuts = Vec::new();
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            c if c == sep && !quoted => {
                cuts.push(&text[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    cuts.push(&text[start..]);
    cuts.into_iter()
}

/// What a response says of the quota, if it says anything: nothing when it has a `Retry-After`,
/// which takes precedence.
pub(crate) fn of_response(headers: &HeaderMap) -> Option<Quota> {
    // Most answers have no RateLimit field: one lookup for them.
    let value = headers.get(RATE_LIMIT)?;
    if headers.contains_key(http::header::RETRY_AFTER) {
        return None;
    }
    parse(value.as_bytes())
}

/// A dependency's quota as its last answers described it: spent until an instant, or not.
#[derive(Debug, Default)]
pub(crate) struct QuotaState {
    /// Whether `until` may hold an instant: one relaxed load on every request that finds none.
    spent: AtomicBool,
    until: Mutex<Option<Instant>>,
}

impl QuotaState {
    /// Whether an answer said the quota is spent, and its reset may be ahead: one relaxed load.
    pub(crate) fn maybe_spent(&self) -> bool {
        self.spent.load(Ordering::Relaxed)
    }

    /// Until when the quota is spent, seen at `now`; `None` once it has reset.
    pub(crate) fn spent_until(&self, now: Instant) -> Option<Instant> {
        if !self.maybe_spent() {
            return None;
        }
        let until = *self.until.lock().unwrap_or_else(|e| e.into_inner());
        until.filter(|until| *until > now)
    }

    /// Takes in what an answer at `now` said.
    pub(crate) fn update(&self, quota: Quota, now: Instant) {
        let mut until = self.until.lock().unwrap_or_else(|e| e.into_inner());
        match quota {
            Quota::Spent(wait) if !wait.is_zero() => {
                *until = Some(now + wait);
                self.spent.store(true, Ordering::Relaxed);
            }
            _ => {
                *until = None;
                self.spent.store(false, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Option<Quota> {
        Some(Quota::Spent(Duration::from_secs(s)))
    }

    #[test]
    fn the_draft_s_examples_and_malformed_values() {
        for (value, expected) in [
            // The draft's examples.
            (r#""default";r=50;t=30"#, Some(Quota::Left)),
            (r#""default";r=0;t=12"#, secs(12)),
            (
                r#""problemPolicy";r=0;t=10, "daily";r=1000;t=5000"#,
                secs(10),
            ),
            (r#""burst";r=0;t=5, "daily";r=0;t=600"#, secs(600)),
            // A token name, spaces around members, unknown parameters.
            ("day ; r=3 ; t=60 ; pk=:abc=:", Some(Quota::Left)),
            // Spent without a reset: nothing to wait for.
            (r#""default";r=0"#, secs(0)),
            // A comma inside a quoted name does not cut the member, nor does an escaped quote
            // end the name; a backslash outside quotes escapes nothing.
            (r#""a,b";r=0;t=7"#, secs(7)),
            (r#""a\",b";r=0;t=5"#, secs(5)),
            (r#"bad\, "good";r=0;t=3"#, secs(3)),
            // A reset beyond a day is read as a day.
            (r#""x";r=0;t=99999999"#, secs(86_400)),
            // Malformed: no r, negative, fractional, too long, not a number, no name, empty.
            (r#""default";t=12"#, None),
            (r#""default";r=-1;t=12"#, None),
            (r#""default";r=0;t=1.5"#, None),
            (r#""default";r=0;t=1234567890123456"#, None),
            (r#""default";r=zero"#, None),
            (";r=0;t=5", None),
            ("", None),
            ("\u{e9};r=0;t=5", None),
            // Fifteen digits are an Integer; sixteen are not (above).
            (r#""x";r=0;t=123456789012345"#, secs(86_400)),
            // A name that is neither a String nor a Token.
            (r#"a"b";r=0;t=5"#, None),
            // One bad member among good ones is skipped.
            (r#""bad";r=x, "good";r=0;t=3"#, secs(3)),
        ] {
            assert_eq!(parse(value.as_bytes()), expected, "{value:?}");
        }
        assert_eq!(parse(b"\xff\xfe"), None);
    }

    #[test]
    fn retry_after_takes_precedence() {
        let mut headers = HeaderMap::new();
        headers.insert("ratelimit", r#""default";r=0;t=12"#.parse().unwrap());
        assert_eq!(of_response(&headers), secs(12));
        headers.insert(http::header::RETRY_AFTER, "3".parse().unwrap());
        assert_eq!(of_response(&headers), None);
    }

    #[test]
    fn the_state_holds_until_the_reset_or_an_answer_with_quota() {
        let state = QuotaState::default();
        let now = Instant::now();
        assert_eq!(state.spent_until(now), None);
        state.update(Quota::Spent(Duration::from_secs(5)), now);
        let until = now + Duration::from_secs(5);
        assert_eq!(state.spent_until(now), Some(until));
        assert_eq!(state.spent_until(until), None, "reset");
        state.update(Quota::Left, now);
        assert_eq!(state.spent_until(now), None);
        state.update(Quota::Spent(Duration::ZERO), now);
        assert_eq!(state.spent_until(now), None);
        // Nothing to wait for leaves the fast path's flag down.
        assert!(!state.maybe_spent());
        state.update(Quota::Spent(Duration::from_secs(1)), now);
        assert!(state.maybe_spent());
    }
}
