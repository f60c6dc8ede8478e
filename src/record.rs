//! The record of one logical request that ended in a response: how many attempts, why it
//! stopped, how long it waited, which key it carried, whether the server replayed it, and
//! whether a hedge answered.

use std::time::Duration;

use http::HeaderValue;

use crate::stop::StopReason;

/// The record of one logical request, found in the extensions of the response it returned.
///
/// ```no_run
/// # async fn run(client: reqwest_middleware::ClientWithMiddleware) -> reqwest_middleware::Result<()> {
/// use reqwest_safe_retry::RetryRecord;
///
/// let response = client.get("http://127.0.0.1:8080/").send().await?;
/// if let Some(record) = RetryRecord::of(&response) {
///     println!("{} attempt(s), stopped because {}", record.attempts(), record.stop_reason());
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryRecord {
    pub(crate) attempts: u32,
    pub(crate) stop: StopReason,
    pub(crate) waited: Duration,
    pub(crate) key: Option<HeaderValue>,
    /// The answer carried the server's replay marker, and its attempt went under a key sent
    /// before it (else the marker means nothing: a proxy may echo it).
    pub(crate) replayed: bool,
    pub(crate) answered_by_hedge: bool,
    /// What gRPC's metrics count of the call's attempts.
    pub(crate) tally: Tally,
}

/// What kind of attempts a call made beyond its first, as gRPC's metrics count them (gRFC
/// A96): whether one was A6's transparent retry, and whether those after the first were
/// hedges (a hedged call's) rather than retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Tally {
    pub(crate) transparent: bool,
    pub(crate) hedged: bool,
}

impl RetryRecord {
    /// The record of the logical request that gave `response`.
    ///
    /// A response that succeeded (a status below 400) at its first attempt, without an
    /// idempotency key, carries no record: the success path is spared its allocation, and this
    /// returns what it would have said (1 attempt, [`StopReason::Succeeded`], no wait, no key).
    /// A gRPC call's answer, which the server committed to at its first attempt, is spared
    /// one likewise and reads [`StopReason::Committed`]: a `tonic::Response`, or an
    /// `http::Response` whose head is a gRPC call's (`content-type: application/grpc`, its
    /// status to follow in its trailers; so reads one from the tower layer too).
    /// Every other response from the middleware carries one. `None` for a response of 400 or
    /// above without a record: it did not pass through the middleware. A success that did not
    /// pass through it gets the first-attempt record too: it also made one attempt.
    ///
    /// `response` is an answer of any door: a `reqwest::Response` from a `reqwest-middleware`
    /// chain, an `http::Response` from the tower layer, or a `tonic::Response` through the
    /// gRPC layer (feature `grpc`).
    pub fn of(response: &impl Answer) -> Option<RetryRecord> {
        let (failed, extensions) = response.parts();
        RetryRecord::read(failed, extensions, || response.bare())
    }

    /// The record an answer's head carries, or the first attempt's that it stands for, which
    /// ended as `bare` says.
    fn read(
        failed: bool,
        extensions: &http::Extensions,
        bare: impl FnOnce() -> StopReason,
    ) -> Option<RetryRecord> {
        let record = match extensions.get::<RetryRecord>() {
            Some(record) => record.clone(),
            None if !failed => RetryRecord {
                attempts: 1,
                stop: bare(),
                waited: Duration::ZERO,
                key: None,
                replayed: false,
                answered_by_hedge: false,
                tally: Tally::default(),
            },
            None => return None,
        };
        Some(record)
    }

    /// How many attempts were made, the first included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Why no further attempt was made.
    pub fn stop_reason(&self) -> StopReason {
        self.stop
    }

    /// The total time this request spent waiting, before the first attempt (a spent quota's
    /// hold) and between attempts, as measured by the middleware's clock: what a caller can
    /// read in production. A test on a `FakeClock` sees each wait in `FakeClock::sleeps`.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The idempotency header value every attempt carried (stamped or the caller's own), if any.
    pub fn idempotency_key(&self) -> Option<&HeaderValue> {
        self.key.as_ref()
    }

    /// Whether the answer came from a hedge: the second copy of the last attempt, sent while
    /// the first was slow (see
    /// [`RetryPolicyBuilder::hedge_reads`](crate::RetryPolicyBuilder::hedge_reads)).
    pub fn answered_by_hedge(&self) -> bool {
        self.answered_by_hedge
    }

    /// Whether the server marked the response as a replay of a stored one
    /// (`Idempotent-Replayed: true`): the effect happened earlier, not on this attempt. Always
    /// `false` for a request that carried no key, and for an answer to the first attempt under
    /// a key the middleware had just made (no server can have stored an answer under it): the
    /// marker then means nothing. Under a caller's own key, a derived one, or a key an earlier
    /// attempt may have delivered, it counts.
    pub fn replayed(&self) -> bool {
        self.replayed
    }
}

/// An answer a [`RetryRecord`] is read from: a `reqwest::Response`, an `http::Response` of any
/// body, or (feature `grpc`) a `tonic::Response`. Sealed: the doors' answers, and nothing
/// else.
pub trait Answer: sealed::Sealed {
    /// Whether the answer's status is a failure (400 or above), and its extensions.
    #[doc(hidden)]
    fn parts(&self) -> (bool, &http::Extensions);

    /// What the answer stands for when it carries no record: a success, or a committed gRPC
    /// call.
    #[doc(hidden)]
    fn bare(&self) -> StopReason {
        StopReason::Succeeded
    }
}

impl<B> Answer for http::Response<B> {
    fn parts(&self) -> (bool, &http::Extensions) {
        (self.status().as_u16() >= 400, self.extensions())
    }

    /// A gRPC call's head without a status (which its trailers will carry) is a committed
    /// call's.
    fn bare(&self) -> StopReason {
        let headers = self.headers();
        let grpc = (headers.get(http::header::CONTENT_TYPE))
            .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"));
        if grpc && !headers.contains_key("grpc-status") {
            StopReason::Committed
        } else {
            StopReason::Succeeded
        }
    }
}

pub(crate) mod sealed {
    /// The doors' answers (each door implements it for its own).
    pub trait Sealed {}
    impl<B> Sealed for http::Response<B> {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&str, &str)]) -> http::Response<()> {
        let mut answer = http::Response::builder().status(status);
        for (name, value) in headers {
            answer = answer.header(*name, *value);
        }
        answer.body(()).unwrap()
    }

    fn inferred(answer: &http::Response<()>) -> Option<(u32, StopReason)> {
        RetryRecord::of(answer).map(|r| (r.attempts, r.stop))
    }

    #[test]
    fn an_answer_without_a_record_reads_as_its_protocol_s_first_attempt() {
        let grpc = ("content-type", "application/grpc+proto");
        // A gRPC call's head without a status: committed, the status to follow.
        assert_eq!(
            inferred(&answer(200, &[grpc])),
            Some((1, StopReason::Committed))
        );
        // A trailers-only answer, and any HTTP answer: a success.
        let ok = ("grpc-status", "0");
        assert_eq!(
            inferred(&answer(200, &[grpc, ok])),
            Some((1, StopReason::Succeeded))
        );
        let json = ("content-type", "application/json");
        assert_eq!(
            inferred(&answer(200, &[json])),
            Some((1, StopReason::Succeeded))
        );
        assert_eq!(
            inferred(&answer(204, &[])),
            Some((1, StopReason::Succeeded))
        );
        // A failure without a record did not pass through the middleware.
        assert_eq!(inferred(&answer(503, &[grpc])), None);
    }

    #[test]
    fn a_record_carried_is_read_as_it_is() {
        let mut carried = answer(200, &[("content-type", "application/grpc")]);
        let record = RetryRecord {
            attempts: 3,
            stop: StopReason::Succeeded,
            waited: Duration::from_millis(5),
            key: None,
            replayed: false,
            answered_by_hedge: false,
            tally: Tally::default(),
        };
        carried.extensions_mut().insert(record.clone());
        assert_eq!(RetryRecord::of(&carried), Some(record));
    }
}
