//! What a server says of its own answer beyond its status: whether the failure is worth another
//! attempt, and whether the answer is one it stored under the request's key and replayed.
//!
//! # The server's verdict
//!
//! The APIs called most with reqwest know better than a status code whether their failure will
//! pass: their generated SDKs obey `x-should-retry: true|false`, and Stripe's obey
//! `stripe-should-retry`. A 503 from a deploy that will be rolled back is worth nothing; a 500
//! from a lock that timed out is worth another attempt. So the verdict is read as the default
//! rules' opinion of a failure (`classify` composes it): `false` makes it final, `true`
//! transient. It is never read on a success, and it never makes a request safe to repeat that
//! is not (the safety rule comes after it, and a classifier after that).
//!
//! Only `true` and `false` (in any case) mean something. Anything else is ignored, and so are
//! lines that disagree (one `true`, one `false`, across both fields): the server has not said
//! one thing.
//!
//! # A replayed answer
//!
//! A server that dedupes on the idempotency key stores its answer to the first copy and replays
//! it to every later one, marked `Idempotent-Replayed: true`. Some store failures too, a 503
//! included: then every further attempt with the key gets the same 503, whatever waits, and a
//! retry only spends the budget and the caller's time. A replayed transient answer ends the
//! retrying at once, but only under a key that was sent before (`classify` asks): a request
//! without a key has nothing stored under it, and neither has a key made for this request
//! before its first attempt, so there the marker (a proxy's echo, say) means nothing.

use http::{HeaderMap, HeaderName, StatusCode};

/// The verdict field of the generated SDKs' servers.
const SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
/// Stripe's spelling of it.
const STRIPE_SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");
/// The replay marker of a server that dedupes on the key (the Stripe convention).
const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The server's verdict on its answer: `Some(true)` retry, `Some(false)` do not, `None` when
/// it said nothing, nothing valid, or both.
pub(crate) fn should_retry(headers: &HeaderMap) -> Option<bool> {
    if !super::has_any(headers, &[SHOULD_RETRY, STRIPE_SHOULD_RETRY]) {
        return None;
    }
    let mut said = None;
    let lines = headers
        .get_all(SHOULD_RETRY)
        .iter()
        .chain(headers.get_all(STRIPE_SHOULD_RETRY).iter());
    for value in lines {
        let this = match value.as_bytes().trim_ascii() {
            v if v.eq_ignore_ascii_case(b"true") => true,
            v if v.eq_ignore_ascii_case(b"false") => false,
            _ => continue,
        };
        if said.is_some_and(|before| before != this) {
            return None;
        }
        said = Some(this);
    }
    said
}

/// Whether a failure (a status of 400 or above: a success is final whatever the server says,
/// and is never asked) with `status` may be made transient by the server's `true`: not a 400
/// or a 422, which say that the request itself, or its key's use, is wrong.
pub(crate) fn may_be_made_transient(status: StatusCode) -> bool {
    status != StatusCode::BAD_REQUEST && status != StatusCode::UNPROCESSABLE_ENTITY
}

/// Whether the answer is a stored one replayed (`Idempotent-Replayed: true` on any line).
pub(crate) fn replayed(headers: &HeaderMap) -> bool {
    super::has_any(headers, &[REPLAYED])
        && headers
            .get_all(REPLAYED)
            .iter()
            .any(|value| value.as_bytes().trim_ascii().eq_ignore_ascii_case(b"true"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    /// Header lines, name and value, in order.
    type Lines = &'static [(&'static str, &'static [u8])];

    fn headers(lines: &[(&'static str, &[u8])]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in lines {
            map.append(*name, HeaderValue::from_bytes(value).unwrap());
        }
        map
    }

    #[test]
    fn the_verdict_is_true_or_false_in_either_field_and_nothing_else() {
        let table: &[(Lines, Option<bool>)] = &[
            (&[], None),
            (&[("x-should-retry", b"true")], Some(true)),
            (&[("x-should-retry", b"false")], Some(false)),
            (&[("x-should-retry", b"TRUE")], Some(true)),
            (&[("x-should-retry", b" False ")], Some(false)),
            (&[("stripe-should-retry", b"true")], Some(true)),
            (&[("stripe-should-retry", b"false")], Some(false)),
            // Anything else is no verdict.
            (&[("x-should-retry", b"1")], None),
            (&[("x-should-retry", b"yes")], None),
            (&[("x-should-retry", b"")], None),
            (&[("x-should-retry", b"truee")], None),
            (&[("x-should-retry", b"true, false")], None),
            (&[("x-should-retry", b"\xfftrue")], None),
            (&[("x-should-retry", b"tru\te")], None),
            // Lines that agree, or one that says something beside ones that do not.
            (
                &[
                    ("x-should-retry", b"true"),
                    ("stripe-should-retry", b"TRUE"),
                ],
                Some(true),
            ),
            (
                &[("x-should-retry", b"maybe"), ("x-should-retry", b"false")],
                Some(false),
            ),
            // Lines that disagree: the server has not said one thing.
            (
                &[("x-should-retry", b"true"), ("x-should-retry", b"false")],
                None,
            ),
            (
                &[
                    ("x-should-retry", b"false"),
                    ("stripe-should-retry", b"true"),
                ],
                None,
            ),
        ];
        for (lines, expected) in table {
            assert_eq!(should_retry(&headers(lines)), *expected, "{lines:?}");
        }
    }

    #[test]
    fn a_true_verdict_never_makes_a_malformed_request_or_a_reused_key_transient() {
        let made = |code| may_be_made_transient(StatusCode::from_u16(code).unwrap());
        assert!(made(408) && made(500) && made(599) && made(401) && made(409));
        assert!(!made(400) && !made(422));
    }

    #[test]
    fn a_replay_is_marked_true_on_some_line() {
        let table: &[(Lines, bool)] = &[
            (&[], false),
            (&[("idempotent-replayed", b"true")], true),
            (&[("idempotent-replayed", b"True")], true),
            (&[("idempotent-replayed", b"false")], false),
            (&[("idempotent-replayed", b"1")], false),
            (&[("idempotent-replayed", b"")], false),
            (
                &[
                    ("idempotent-replayed", b"false"),
                    ("idempotent-replayed", b"true"),
                ],
                true,
            ),
        ];
        for (lines, expected) in table {
            assert_eq!(replayed(&headers(lines)), *expected, "{lines:?}");
        }
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 500 } else { 5_000 }))]

            /// Any lines of any bytes: no panic; a verdict only when a line says exactly `true`
            /// or `false` and none says the other.
            #[test]
            fn any_lines_give_a_verdict_only_when_they_say_one_thing(
                lines in proptest::collection::vec(
                    (any::<bool>(), prop_oneof![
                        Just(b"true".to_vec()),
                        Just(b"FALSE".to_vec()),
                        proptest::collection::vec(any::<u8>(), 0..12),
                    ]),
                    0..6,
                ),
            ) {
                let mut map = HeaderMap::new();
                let mut words = Vec::new();
                for (stripe, value) in &lines {
                    let Ok(value) = HeaderValue::from_bytes(value) else { continue };
                    let name = if *stripe { STRIPE_SHOULD_RETRY } else { SHOULD_RETRY };
                    let word = value.as_bytes().trim_ascii().to_ascii_lowercase();
                    if word == b"true" || word == b"false" {
                        words.push(word == b"true");
                    }
                    map.append(name, value);
                }
                let expected = match (words.contains(&true), words.contains(&false)) {
                    (true, false) => Some(true),
                    (false, true) => Some(false),
                    _ => None,
                };
                prop_assert_eq!(should_retry(&map), expected);
                let _ = replayed(&map);
            }
        }
    }
}
