//! The rules of this crate's outgoing calls (a step's external call, the outbox relay's
//! deliveries): one reading of a dependency's status, and the check that a call went out with a
//! key.

use http::StatusCode;

/// What a dependency's status says of the effect a call asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// `2xx`: done.
    Done,
    /// A final answer other than success (`3xx`, a `4xx` but the transient ones): the
    /// dependency will say the same again.
    Refused,
    /// Not known yet: `408`, `409` (the key's first call still running there), `425`, `429`,
    /// `5xx`, or a status outside 200–599. Ask again later, with the same key.
    Transient,
}

/// The `4xx` statuses that say "not now" rather than "no".
const TRANSIENT_4XX: [u16; 4] = [408, 409, 425, 429];

/// The one reading of a dependency's status, for steps and the relay alike.
pub(crate) fn verdict(status: StatusCode) -> Verdict {
    let code = status.as_u16();
    if status.is_success() {
        Verdict::Done
    } else if TRANSIENT_4XX.contains(&code) || !(200..500).contains(&code) {
        Verdict::Transient
    } else {
        Verdict::Refused
    }
}

/// What a call made through a client without this workspace's middleware is told.
#[cfg(feature = "client")]
pub(crate) const NO_MIDDLEWARE: &str = "the call went out without an idempotency key: build its client with reqwest-safe-retry's RetryMiddleware, which derives the key";

/// Whether `response` came through this workspace's middleware with a key on its request.
#[cfg(feature = "client")]
pub(crate) fn sent_with_key(response: &reqwest::Response) -> bool {
    reqwest_safe_retry::RetryRecord::of(response)
        .is_some_and(|record| record.idempotency_key().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_reading_of_a_status_for_every_outgoing_call() {
        let of = |code| verdict(StatusCode::from_u16(code).unwrap());
        for done in [200, 201, 202, 204, 299] {
            assert_eq!(of(done), Verdict::Done, "{done}");
        }
        for refused in [300, 301, 304, 399, 400, 401, 403, 404, 410, 422, 499] {
            assert_eq!(of(refused), Verdict::Refused, "{refused}");
        }
        for transient in [100, 199, 408, 409, 425, 429, 500, 502, 503, 504, 599] {
            assert_eq!(of(transient), Verdict::Transient, "{transient}");
        }
    }
}
