//! The IETF RateLimit fields (draft-ietf-httpapi-ratelimit-headers-10): a server's word that a
//! client's quota is spent, and for how long.
//!
//! `RateLimit: "default";r=0;t=12` says: under the policy `default`, 0 requests remain, and the
//! quota resets in 12 seconds. The field is a Structured Field List; each member names a policy
//! (a String or a Token) with the parameters `r` (remaining) and `t` (seconds until reset),
//! both non-negative integers. `RateLimit-Policy` describes the policies (quota, window) and is
//! not needed to act on `RateLimit`. A member without `r`, or with a malformed value, is ignored;
//! so is a field that cannot be read at all. A valid `Retry-After` (or millisecond wait) on the same response
//! takes precedence; one that cannot be read is absent, for this rule as for the wait. Field lines on one answer are one list.
//!
//! # Per origin, believed for a minute at a time
//!
//! A quota is the server's, and a dependency may span several servers (hosts, ports, a
//! redirect elsewhere): a spent quota is kept per origin (scheme, host, port), so one server's
//! answer never holds requests to another. And a server can be wrong: a reset a day away, said
//! once, would otherwise refuse every request for that day with nothing sent that could clear
//! it. So a spent quota is believed for at most [`BELIEF`] at a time; after that one request
//! goes through as a probe, and its answer renews the quota, or clears it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::clock::Instant;

use crate::engine::seen::Target;
use http::{HeaderMap, HeaderValue};

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

/// What a response's `RateLimit` field says of the quota, if it says anything. Field lines are
/// one list (RFC 9110 section 5.3): every line is read. (Whether a `Retry-After` beside it takes
/// precedence is the core's rule: `decide`.)
pub(crate) fn of_response(headers: &HeaderMap) -> Option<Quota> {
    // Most answers have no RateLimit field: no lookup for them.
    if !is_in(headers) {
        return None;
    }
    let first = headers.get(RATE_LIMIT)?;
    let mut lines = headers.get_all(RATE_LIMIT).iter();
    if lines.size_hint().1 == Some(1) {
        return parse(first.as_bytes());
    }
    // Several lines: joined with commas, as the field's one value.
    let mut joined = Vec::from(lines.next().map_or(&b""[..], HeaderValue::as_bytes));
    for line in lines {
        joined.extend_from_slice(b", ");
        joined.extend_from_slice(line.as_bytes());
    }
    parse(&joined)
}

/// Whether an answer has a `RateLimit` field at all. Asked of every answer: on the few fields
/// most answers carry, comparing names costs less than hashing one for a lookup.
pub(crate) fn is_in(headers: &HeaderMap) -> bool {
    super::has_any(headers, &[RATE_LIMIT])
}

/// How long a spent quota is believed at a time: after that one request is let through as a
/// probe, whose answer says again (or does not), so one wrong answer cannot shut a dependency
/// off for the day its reset may name.
pub(crate) const BELIEF: Duration = Duration::from_secs(60);

/// The most origins whose spent quotas a dependency remembers at once; past it, the one that
/// resets first is forgotten.
const ORIGINS: usize = 64;

/// Where a quota applies: the scheme, host and port of a URL (RFC 6454's origin).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin(Box<str>);

impl Origin {
    pub(crate) fn of(target: Target<'_>) -> Origin {
        let port = target.port.unwrap_or(0);
        // Hosts are compared without regard to case, as a URL parser would have lowered them.
        let origin = format!("{}://{}:{port}", target.scheme, target.host);
        Origin(origin.to_ascii_lowercase().into_boxed_str())
    }
}

/// One origin's spent quota.
#[derive(Debug, Clone)]
struct Spent {
    origin: Origin,
    /// When the server said the quota resets.
    until: Instant,
    /// Until when that is believed; then one request goes as a probe.
    believed_until: Instant,
}

impl Spent {
    /// How long a request at `now` is held.
    fn hold(&self, now: Instant) -> Duration {
        self.until
            .min(self.believed_until)
            .saturating_duration_since(now)
    }
}

/// What a request about to be sent to an origin may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Nothing is held: send.
    Open,
    /// The quota is spent but no longer believed: send as the probe. The ticket gives the probe
    /// back if the request is dropped before an answer.
    Probe(ProbeTicket),
    /// Wait this long before asking again.
    Held(Duration),
}

/// A probe taken: the belief it replaced, and the one it set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProbeTicket {
    origin: Origin,
    was: Instant,
    set: Instant,
}

/// A dependency's quotas as its answers described them, per origin: spent until an instant, or
/// not. Clones of a dependency share one.
#[derive(Debug, Default)]
pub(crate) struct QuotaState {
    /// Whether any origin may be spent: one relaxed load on every request that finds none.
    any: AtomicBool,
    spent: Mutex<Vec<Spent>>,
}

impl QuotaState {
    /// Whether an answer said some quota is spent, and its reset may be ahead: one relaxed load.
    pub(crate) fn maybe_spent(&self) -> bool {
        self.any.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Spent>> {
        // Each update leaves the list whole: a holder that panicked left nothing half done.
        self.spent.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Drops what has reset by `now`, and lowers the flag when nothing is left.
    fn forget_reset(&self, spent: &mut Vec<Spent>, now: Instant) {
        spent.retain(|s| s.until > now);
        if spent.is_empty() {
            self.any.store(false, Ordering::Relaxed);
        }
    }

    /// What a request to `origin` at `now` may do; takes the probe when the belief has run out.
    pub(crate) fn gate(&self, origin: &Origin, now: Instant) -> Gate {
        if !self.maybe_spent() {
            return Gate::Open;
        }
        let mut spent = self.lock();
        self.forget_reset(&mut spent, now);
        let Some(entry) = spent.iter_mut().find(|s| s.origin == *origin) else {
            return Gate::Open;
        };
        if now < entry.believed_until {
            return Gate::Held(entry.hold(now));
        }
        let was = entry.believed_until;
        entry.believed_until = now + BELIEF;
        Gate::Probe(ProbeTicket {
            origin: origin.clone(),
            was,
            set: entry.believed_until,
        })
    }

    /// How long a retry to `origin` at `now` must wait for a quota, as a floor: zero when none
    /// is spent there (a probe is not taken here; the retry asks [`gate`](Self::gate) after).
    pub(crate) fn floor(&self, origin: &Origin, now: Instant) -> Option<Duration> {
        if !self.maybe_spent() {
            return None;
        }
        let spent = self.lock();
        spent
            .iter()
            .find(|s| s.origin == *origin)
            .map(|s| s.hold(now))
            // Zero once the reset has passed.
            .filter(|hold| !hold.is_zero())
    }

    /// A probe whose request was dropped before its answer: the next request may probe at once.
    pub(crate) fn give_back(&self, ticket: &ProbeTicket) {
        let mut spent = self.lock();
        if let Some(entry) = spent
            .iter_mut()
            .find(|s| s.origin == ticket.origin && s.believed_until == ticket.set)
        {
            entry.believed_until = ticket.was;
        }
    }

    /// The answer to a probe came: the quota it probed is cleared, unless another answer
    /// renewed it meanwhile. What the answer itself said is taken in after, by
    /// [`update`](Self::update).
    pub(crate) fn clear_probed(&self, ticket: &ProbeTicket, now: Instant) {
        let mut spent = self.lock();
        spent.retain(|s| !(s.origin == ticket.origin && s.believed_until == ticket.set));
        self.forget_reset(&mut spent, now);
    }

    /// Takes in what an answer from `origin` at `now` said; `None` (no field) changes nothing.
    pub(crate) fn update(&self, origin: &Origin, quota: Option<Quota>, now: Instant) {
        match quota {
            None => {}
            Some(Quota::Spent(wait)) if !wait.is_zero() => {
                let entry = Spent {
                    origin: origin.clone(),
                    until: now + wait,
                    believed_until: now + wait.min(BELIEF),
                };
                let mut spent = self.lock();
                self.forget_reset(&mut spent, now);
                if let Some(old) = spent.iter_mut().find(|s| s.origin == *origin) {
                    *old = entry;
                } else {
                    if spent.len() >= ORIGINS {
                        let first = (0..spent.len()).min_by_key(|&i| spent[i].until);
                        if let Some(first) = first {
                            spent.swap_remove(first);
                        }
                    }
                    spent.push(entry);
                }
                self.any.store(true, Ordering::Relaxed);
            }
            _ => {
                if !self.maybe_spent() {
                    return;
                }
                let mut spent = self.lock();
                spent.retain(|s| s.origin != *origin);
                self.forget_reset(&mut spent, now);
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

    fn origin(url: &str) -> Origin {
        let uri: http::Uri = url.parse().unwrap();
        Origin::of(Target::new(
            uri.scheme_str().unwrap(),
            uri.host().unwrap(),
            uri.port_u16(),
        ))
    }

    #[test]
    fn an_origin_is_scheme_host_and_port_with_the_default_port_filled_in() {
        assert_eq!(origin("http://a.test/x?q"), origin("http://A.test:80/y"));
        assert_ne!(origin("http://a.test/"), origin("https://a.test/"));
        assert_ne!(origin("http://a.test/"), origin("http://a.test:8080/"));
        assert_ne!(origin("http://a.test/"), origin("http://b.test/"));
        assert_eq!(origin("http://[::1]:9/").0.as_ref(), "http://[::1]:9");
    }

    #[test]
    fn field_lines_are_one_list() {
        let mut headers = HeaderMap::new();
        headers.append("ratelimit", r#""burst";r=4;t=1"#.parse().unwrap());
        assert_eq!(of_response(&headers), Some(Quota::Left));
        headers.append("ratelimit", r#""daily";r=0;t=600"#.parse().unwrap());
        assert_eq!(of_response(&headers), secs(600));
        headers.append("ratelimit", "garbage".parse().unwrap());
        assert_eq!(of_response(&headers), secs(600));
    }

    #[test]
    fn a_spent_quota_holds_its_own_origin_only_until_its_reset() {
        let state = QuotaState::default();
        let (a, b) = (origin("http://a.test/"), origin("http://b.test/"));
        let now = Instant::now();
        assert_eq!(state.gate(&a, now), Gate::Open);
        state.update(&a, Some(Quota::Spent(secs5())), now);
        assert!(state.maybe_spent());
        assert_eq!(state.gate(&a, now), Gate::Held(secs5()));
        assert_eq!(state.gate(&a, now + MS), Gate::Held(secs5() - MS));
        assert_eq!(state.floor(&a, now), Some(secs5()));
        assert_eq!(state.gate(&b, now), Gate::Open, "another origin");
        assert_eq!(state.floor(&b, now), None);
        assert_eq!(state.gate(&a, now + secs5()), Gate::Open, "reset");
        assert_eq!(state.floor(&a, now + secs5()), None);
        assert!(!state.maybe_spent(), "nothing left: the fast path again");
    }

    #[test]
    fn an_answer_with_quota_left_or_a_zero_reset_clears_its_origin_alone() {
        let state = QuotaState::default();
        let (a, b) = (origin("http://a.test/"), origin("http://b.test/"));
        let now = Instant::now();
        state.update(&a, Some(Quota::Spent(secs5())), now);
        state.update(&b, Some(Quota::Spent(secs5())), now);
        state.update(&a, Some(Quota::Left), now);
        assert_eq!(state.gate(&a, now), Gate::Open);
        assert_eq!(state.gate(&b, now), Gate::Held(secs5()));
        state.update(&b, None, now);
        assert_eq!(
            state.gate(&b, now),
            Gate::Held(secs5()),
            "no field: no change"
        );
        state.update(&b, Some(Quota::Spent(Duration::ZERO)), now);
        assert!(
            !state.maybe_spent(),
            "nothing to wait for: the fast path at once"
        );
        assert_eq!(state.gate(&b, now), Gate::Open);
    }

    #[test]
    fn a_long_reset_is_believed_a_minute_then_one_request_probes() {
        let state = QuotaState::default();
        let a = origin("http://a.test/");
        let now = Instant::now();
        let day = Duration::from_secs(86_400);
        state.update(&a, Some(Quota::Spent(day)), now);
        assert_eq!(state.gate(&a, now), Gate::Held(BELIEF));
        let later = now + BELIEF;
        let Gate::Probe(ticket) = state.gate(&a, later) else {
            panic!("the belief ran out: a probe");
        };
        // One probe at a time: the others are held for another minute.
        assert_eq!(state.gate(&a, later), Gate::Held(BELIEF));
        // Dropped before its answer: the next request may probe at once.
        state.give_back(&ticket);
        let Gate::Probe(ticket) = state.gate(&a, later + MS) else {
            panic!("the probe was given back");
        };
        // A probe's answer clears the quota it probed.
        state.clear_probed(&ticket, later + MS);
        assert_eq!(state.gate(&a, later + MS), Gate::Open);
        // A ticket given back or answered after the quota was renewed changes nothing.
        let renewed = later + 2 * MS;
        state.update(&a, Some(Quota::Spent(day)), renewed);
        state.give_back(&ticket);
        state.clear_probed(&ticket, renewed);
        assert_eq!(state.gate(&a, renewed), Gate::Held(BELIEF));
    }

    #[test]
    fn past_the_origin_limit_the_quota_that_resets_first_is_forgotten() {
        let state = QuotaState::default();
        let now = Instant::now();
        for i in 0..ORIGINS as u64 {
            let o = origin(&format!("http://h{i}.test/"));
            state.update(
                &o,
                Some(Quota::Spent(secs5() + Duration::from_secs(i))),
                now,
            );
        }
        state.update(
            &origin("http://new.test/"),
            Some(Quota::Spent(secs5())),
            now,
        );
        assert_eq!(state.lock().len(), ORIGINS);
        assert_eq!(state.gate(&origin("http://h0.test/"), now), Gate::Open);
        assert!(matches!(
            state.gate(&origin("http://h1.test/"), now),
            Gate::Held(_)
        ));
        assert!(matches!(
            state.gate(&origin("http://new.test/"), now),
            Gate::Held(_)
        ));
    }

    const MS: Duration = Duration::from_millis(1);

    fn secs5() -> Duration {
        Duration::from_secs(5)
    }
}
