//! What to retry, how often and how long to wait: the configuration of one dependency.
//!
//! A [`RetryPolicy`] is built once, validated once, and then only read: it is `Copy`, costs
//! nothing to share, and holds no state. Everything that changes while requests run (the clock,
//! the random source, the budget) lives beside it in the middleware.

use std::fmt;
use std::time::Duration;

use http::{Method, StatusCode};

use crate::engine::backoff::Jitter;
use crate::error::InvalidConfig;

/// The area named in this module's configuration errors.
const POLICY: &str = "retry policy";

/// The configuration of retries for one dependency.
///
/// Build one with [`RetryPolicy::builder`]; [`RetryPolicy::default()`] is the builder's defaults.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::RetryPolicy;
///
/// let policy = RetryPolicy::builder()
///     .max_attempts(5)
///     .base_delay(Duration::from_millis(50))
///     .max_delay(Duration::from_secs(2))
///     .build()
///     .expect("a valid policy");
/// assert_eq!(policy.max_attempts(), 5);
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
    jitter: Jitter,
    attempt_timeout: Duration,
    deadline: Duration,
    max_retry_after: Duration,
    retry_after_jitter: bool,
    rate_limit_fields: bool,
    retry_after_fields: bool,
    should_retry_fields: bool,
    statuses: StatusSet,
    methods: MethodSet,
    buffer_body: Option<usize>,
    latency_timeout: Option<LatencyTimeout>,
    hedging: Option<Hedging>,
}

/// The attempt timeout from measured latency: `multiplier x p99.9`, never below `floor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LatencyTimeout {
    /// The multiplier in thousandths (`Eq` for the policy; 2.0 is 2,000).
    multiplier_milli: u32,
    floor: Duration,
}

/// Hedged reads: a second copy after `p(1 - extra_load)`, at most `max_delay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hedging {
    /// The extra load in millionths (5 % is 50,000).
    extra_load_ppm: u32,
    max_delay: Duration,
}

impl RetryPolicy {
    /// Starts a builder with every default in place.
    pub fn builder() -> RetryPolicyBuilder {
        RetryPolicyBuilder::new()
    }

    /// The most attempts one logical request makes, the first included: the most retries
    /// plus one.
    #[doc(alias = "max_retries")]
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The backoff base: the ceiling of the first retry's wait.
    pub fn base_delay(&self) -> Duration {
        self.base_delay
    }

    /// The backoff cap: no computed wait exceeds it.
    pub fn max_delay(&self) -> Duration {
        self.max_delay
    }

    /// How a wait is drawn under its ceiling.
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The longest one attempt may take on the wire.
    pub fn attempt_timeout(&self) -> Duration {
        self.attempt_timeout
    }

    /// The total time one logical request may take, attempts and waits together.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The longest `Retry-After` the middleware waits for; a server asking for longer gets its
    /// response returned at once.
    pub fn max_retry_after(&self) -> Duration {
        self.max_retry_after
    }

    /// Whether a wait set by `Retry-After` gets the backoff's jitter on top of it.
    pub fn retry_after_jitter(&self) -> bool {
        self.retry_after_jitter
    }

    /// Whether the server's wait fields (`Retry-After`, `retry-after-ms`,
    /// `x-ms-retry-after-ms`) are read; see [`RetryPolicyBuilder::retry_after_fields`].
    pub fn retry_after_fields(&self) -> bool {
        self.retry_after_fields
    }

    /// Whether the dependency's `RateLimit` fields are heeded; see
    /// [`RetryPolicyBuilder::rate_limit_fields`].
    pub fn rate_limit_fields(&self) -> bool {
        self.rate_limit_fields
    }

    /// Whether a server's own verdict on a failure (`x-should-retry`, `stripe-should-retry`) is
    /// followed; see [`RetryPolicyBuilder::should_retry_fields`].
    pub fn should_retry_fields(&self) -> bool {
        self.should_retry_fields
    }

    /// The attempt timeout from measured latency, if on: its multiplier of the p99.9 and its
    /// floor; see [`RetryPolicyBuilder::timeout_from_latency`].
    pub fn timeout_from_latency(&self) -> Option<(f64, Duration)> {
        self.latency_timeout
            .map(|t| (f64::from(t.multiplier_milli) / 1_000.0, t.floor))
    }

    /// Hedged reads, if on: the extra load they may add and the longest delay before the
    /// hedge; see [`RetryPolicyBuilder::hedge_reads`].
    pub fn hedge_reads(&self) -> Option<(f64, Duration)> {
        self.hedging
            .map(|h| (f64::from(h.extra_load_ppm) / 1_000_000.0, h.max_delay))
    }

    /// Whether this policy measures its dependency's latency (for its timeouts or its hedges).
    pub(crate) fn measures_latency(&self) -> bool {
        self.latency_timeout.is_some() || self.hedging.is_some()
    }

    /// The attempt timeout for a window whose p99.9 is `slow`, if this policy takes its timeout
    /// from latency: the multiplier of it, between the floor and the fixed attempt timeout.
    /// `None` when it does not: the fixed timeout serves, whatever the window measured.
    pub(crate) fn timeout_for(&self, slow: Duration) -> Option<Duration> {
        let t = self.latency_timeout?;
        let measured = slow.saturating_mul(t.multiplier_milli) / 1_000;
        Some(measured.max(t.floor).min(self.attempt_timeout))
    }

    /// The hedging delay for a window whose hedging percentile is `at` (if believed): the
    /// percentile, capped; none when off or not believed.
    pub(crate) fn hedge_delay(&self, at: Option<Duration>) -> Option<Duration> {
        Some(at?.min(self.hedging?.max_delay))
    }

    /// Whether a response with this status is a transient failure worth retrying.
    pub fn is_retryable_status(&self, status: StatusCode) -> bool {
        self.statuses.contains(status.as_u16())
    }

    /// Whether a request of this method may be retried at all (see
    /// [`RetryPolicyBuilder::retryable_methods`]); the safety rules still apply to one that
    /// may.
    pub fn is_retryable_method(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// The largest body read inside an attempt, if [`buffer_body`](RetryPolicyBuilder::buffer_body)
    /// is on.
    pub fn buffer_body_limit(&self) -> Option<usize> {
        self.buffer_body
    }

    /// The numbers of a protocol whose rules judge the answers (`engine::rules`): `attempts`,
    /// the backoff from `initial` up to `max`, the server's wait fields read (the rules say
    /// which), no HTTP status or field of its own, and `long` as its deadline and attempt
    /// timeout: a call's own deadline gives its deadline (gRPC's `grpc-timeout`).
    #[cfg(feature = "grpc")]
    pub(crate) fn for_calls(
        attempts: u32,
        initial: Duration,
        max: Duration,
        long: Duration,
    ) -> RetryPolicy {
        RetryPolicy {
            max_attempts: attempts,
            base_delay: initial,
            max_delay: max,
            jitter: Jitter::Full,
            attempt_timeout: long,
            deadline: long,
            max_retry_after: long,
            retry_after_jitter: false,
            rate_limit_fields: false,
            retry_after_fields: true,
            should_retry_fields: false,
            statuses: StatusSet::EMPTY,
            methods: MethodSet::ALL,
            buffer_body: None,
            latency_timeout: None,
            hedging: None,
        }
    }

    /// This policy with `deadline` (at least 1 ms) as its deadline, and a `max_retry_after`
    /// that followed the deadline following this one (one set apart from it kept, cut to it):
    /// a request's own deadline, which no build-time rule checks against the backoff (the
    /// override that sets it decides what a deadline shorter than the backoff leaves).
    pub(crate) fn with_deadline(mut self, deadline: Duration) -> RetryPolicy {
        let deadline = deadline.max(Duration::from_millis(1));
        self.max_retry_after = if self.max_retry_after == self.deadline {
            deadline
        } else {
            self.max_retry_after.min(deadline)
        };
        self.deadline = deadline;
        self
    }

    /// A builder holding every setting of this policy, to change a few and build another:
    /// `build()` on it unchanged gives this policy back. A `max_retry_after` equal to the
    /// deadline follows the deadline in the builder, as it does when left unset.
    ///
    /// ```
    /// use std::time::Duration;
    /// use reqwest_safe_retry::RetryPolicy;
    ///
    /// let policy = RetryPolicy::builder().max_attempts(5).build()?;
    /// let patient = policy.to_builder().deadline(Duration::from_secs(120)).build()?;
    /// assert_eq!(patient.max_attempts(), 5);
    /// assert_eq!(patient.deadline(), Duration::from_secs(120));
    /// assert_eq!(policy.to_builder().build()?, policy);
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    pub fn to_builder(&self) -> RetryPolicyBuilder {
        RetryPolicyBuilder {
            max_attempts: self.max_attempts,
            base_delay: self.base_delay,
            max_delay: self.max_delay,
            jitter: self.jitter,
            attempt_timeout: self.attempt_timeout,
            deadline: self.deadline,
            max_retry_after: (self.max_retry_after != self.deadline)
                .then_some(self.max_retry_after),
            retry_after_jitter: self.retry_after_jitter,
            rate_limit_fields: self.rate_limit_fields,
            retry_after_fields: self.retry_after_fields,
            should_retry_fields: self.should_retry_fields,
            latency_timeout: self.timeout_from_latency(),
            hedging: self.hedge_reads(),
            statuses: (400..=599).filter(|c| self.statuses.contains(*c)).collect(),
            methods: self.methods.listed(),
            buffer_body: self.buffer_body,
        }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        // The defaults are valid by construction; the builder's tests hold them to it.
        RetryPolicyBuilder::new()
            .checked()
            .unwrap_or_else(|e| unreachable!("default policy is invalid: {e}"))
    }
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = f.debug_struct("RetryPolicy");
        shown
            .field("max_attempts", &self.max_attempts)
            .field("base_delay", &self.base_delay)
            .field("max_delay", &self.max_delay)
            .field("jitter", &self.jitter)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("deadline", &self.deadline)
            .field("max_retry_after", &self.max_retry_after)
            .field("retry_after_jitter", &self.retry_after_jitter)
            .field("rate_limit_fields", &self.rate_limit_fields)
            .field("retry_after_fields", &self.retry_after_fields)
            .field("should_retry_fields", &self.should_retry_fields)
            .field("retryable_statuses", &self.statuses)
            .field("retryable_methods", &self.methods)
            .field("buffer_body", &self.buffer_body)
            .field("timeout_from_latency", &self.timeout_from_latency())
            .field("hedge_reads", &self.hedge_reads());
        shown.finish()
    }
}

/// Builds a [`RetryPolicy`]; invalid settings are reported by [`build`](Self::build).
///
/// # Default
///
/// | setting | default |
/// |---|---|
/// | [`max_attempts`](Self::max_attempts) | 3 (the first attempt and two retries) |
/// | [`base_delay`](Self::base_delay) | 100 ms |
/// | [`max_delay`](Self::max_delay) | 10 s |
/// | [`jitter`](Self::jitter) | [`Jitter::Full`] |
/// | [`attempt_timeout`](Self::attempt_timeout) | 10 s |
/// | [`deadline`](Self::deadline) | 30 s |
/// | [`max_retry_after`](Self::max_retry_after) | the deadline (30 s) |
/// | [`retry_after_jitter`](Self::retry_after_jitter) | on |
/// | [`rate_limit_fields`](Self::rate_limit_fields) | on |
/// | [`retry_after_fields`](Self::retry_after_fields) | on |
/// | [`should_retry_fields`](Self::should_retry_fields) | on |
/// | [`retryable_statuses`](Self::retryable_statuses) | 408, 429, 502, 503, 504 |
/// | [`retryable_methods`](Self::retryable_methods) | every method, within the safety rules |
/// | [`buffer_body`](Self::buffer_body) | off |
/// | [`timeout_from_latency`](Self::timeout_from_latency) | off (when on: 2 x p99.9) |
/// | [`hedge_reads`](Self::hedge_reads) | off (when on: after the p95, 5 % extra load) |
#[derive(Debug, Clone)]
pub struct RetryPolicyBuilder {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
    jitter: Jitter,
    attempt_timeout: Duration,
    deadline: Duration,
    /// `None`: the deadline.
    max_retry_after: Option<Duration>,
    retry_after_jitter: bool,
    rate_limit_fields: bool,
    retry_after_fields: bool,
    should_retry_fields: bool,
    statuses: Vec<u16>,
    /// `None`: every method.
    methods: Option<Vec<Method>>,
    buffer_body: Option<usize>,
    /// `(multiplier, floor)`.
    latency_timeout: Option<(f64, Duration)>,
    /// `(extra_load, max_delay)`.
    hedging: Option<(f64, Duration)>,
}

impl RetryPolicyBuilder {
    fn new() -> Self {
        RetryPolicyBuilder {
            max_attempts: 3,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(10),
            jitter: Jitter::Full,
            attempt_timeout: Duration::from_secs(10),
            deadline: Duration::from_secs(30),
            max_retry_after: None,
            retry_after_jitter: true,
            rate_limit_fields: true,
            retry_after_fields: true,
            should_retry_fields: true,
            statuses: vec![408, 429, 502, 503, 504],
            methods: None,
            buffer_body: None,
            latency_timeout: None,
            hedging: None,
        }
    }

    /// The most attempts per logical request, the first included; 1 turns retries off.
    /// Must be at least 1. [`max_retries`](Self::max_retries) says the same in retries.
    #[doc(alias = "max_retries")]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The most retries per logical request, after the first attempt: `max_retries(2)` is
    /// `max_attempts(3)`, as reqwest-retry's and backon's `max_retries`/`with_max_times` count.
    /// 0 turns retries off.
    ///
    /// ```
    /// use reqwest_safe_retry::RetryPolicy;
    ///
    /// let policy = RetryPolicy::builder().max_retries(2).build()?;
    /// assert_eq!(policy.max_attempts(), 3);
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    #[doc(alias = "retries")]
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.max_attempts = retries.saturating_add(1);
        self
    }

    /// The ceiling of the first retry's wait; each later retry doubles it up to
    /// [`max_delay`](Self::max_delay). Zero means retry without waiting.
    pub fn base_delay(mut self, delay: Duration) -> Self {
        self.base_delay = delay;
        self
    }

    /// The cap on any computed wait. Must not be below [`base_delay`](Self::base_delay).
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// How each wait is drawn under its ceiling: [`Jitter::Full`] unless a client must match
    /// another's behaviour. See [`Jitter`] for each strategy's range; none exceeds
    /// [`max_delay`](Self::max_delay).
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The longest one attempt may take, from sending until the response head (or, with
    /// [`buffer_body`](Self::buffer_body), the whole body) has arrived; cut to what the deadline
    /// leaves. Enforced by the middleware on its clock (on a `FakeClock`, in virtual time);
    /// timeouts set on the client or the request still apply too. Must be greater than zero.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// The total time one logical request may take, measured on the middleware's clock from the
    /// call to `send()` (when the middleware is handed the request), covering a spent quota's
    /// hold, the attempts and the waits between them. Each attempt's timeout is cut to
    /// what is left, and no wait starts that would end at or past it. Must be greater than zero.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The longest `Retry-After` worth waiting for. A server that asks for longer (or for longer
    /// than the deadline leaves) gets its response returned at once, with
    /// [`StopReason::RetryAfterTooLong`](crate::StopReason::RetryAfterTooLong), rather than a wait
    /// to no purpose. Unset, it is the deadline: a wait the deadline leaves time for is made.
    /// Must not exceed the deadline, since no longer wait could ever be honoured.
    pub fn max_retry_after(mut self, limit: Duration) -> Self {
        self.max_retry_after = Some(limit);
        self
    }

    /// Whether a wait set by `Retry-After` gets the backoff's draw added on top, so that clients
    /// that got the same header at the same instant do not return at the same instant. Off, the
    /// next attempt starts exactly when the server asked: one herd.
    pub fn retry_after_jitter(mut self, on: bool) -> Self {
        self.retry_after_jitter = on;
        self
    }

    /// Whether the dependency's `RateLimit` fields (the IETF draft
    /// `draft-ietf-httpapi-ratelimit-headers`) are heeded. On, an answer that says a quota is
    /// spent (`RateLimit: "default";r=0;t=12`) makes the next requests to the same origin
    /// (scheme, host, port) wait for the reset before their first attempt, with jitter above
    /// it, instead of sending what the server said it will refuse; the wait is inside the
    /// request's deadline, and a request whose wait would be longer than `max_retry_after`, or
    /// not leave time for an attempt within the deadline, fails at once with
    /// [`StopReason::QuotaExhausted`](crate::StopReason::QuotaExhausted). A retry waits for a
    /// spent quota's reset as for a `Retry-After`. A spent quota is believed for 60 s at a time;
    /// then one request goes as a probe, and its answer renews or clears it. An answer with
    /// quota left clears it. A valid `Retry-After` (or `retry-after-ms`) on the same answer takes
    /// precedence; malformed fields are ignored, a malformed wait beside a `RateLimit` too, so
    /// the quota stays in force. On by default: a server that sends the field has said what it will do
    /// with the next request.
    pub fn rate_limit_fields(mut self, on: bool) -> Self {
        self.rate_limit_fields = on;
        self
    }

    /// Whether the server's wait fields are read: `Retry-After` (delta-seconds or an
    /// HTTP-date), and the millisecond `retry-after-ms` and `x-ms-retry-after-ms`. On, a valid
    /// one on an answer that is retried is a floor for the wait before the retry, with the
    /// backoff's draw above it ([`retry_after_jitter`](Self::retry_after_jitter)), and one
    /// longer than [`max_retry_after`](Self::max_retry_after) stops the request with its
    /// answer. It is read on every answer that is retried, whatever made it transient: a 429
    /// and a 503 most often, but also a 408, 502 or 504, a 409 under a key sent before, and an
    /// answer a classifier called transient. It is never read on an answer that is final (a
    /// 413's `Retry-After` does not make it retried: add 413 with
    /// [`also_retry_statuses`](Self::also_retry_statuses) for that), nor on an error. Off, the
    /// backoff alone sets every wait, and a `RateLimit` field on the same answer is read as if
    /// no wait field were there. On by default: a server that sends one has said when it can
    /// serve again.
    pub fn retry_after_fields(mut self, on: bool) -> Self {
        self.retry_after_fields = on;
        self
    }

    /// Whether a server's own verdict on a failure is followed: the `x-should-retry` field that
    /// the generated SDKs of the large LLM and payment APIs obey, and Stripe's
    /// `stripe-should-retry`, each `true` or `false` (any case; any other value, or lines that
    /// disagree, are ignored).
    ///
    /// - `false` makes a failure final, even one whose status is in the retryable set: a 503
    ///   so marked is returned after one attempt, with
    ///   [`StopReason::ServerDeclinedRetry`](crate::StopReason::ServerDeclinedRetry).
    /// - `true` makes a failure (a status of 400 or above) transient, even one outside the set:
    ///   a 500 so marked is retried like a 503. Not a 400 or a 422: they say the
    ///   request itself is wrong, or its key was used for another request, and sending it
    ///   unchanged cannot go differently.
    ///
    /// The server's verdict speaks of what is transient, never of what is safe: a request that
    /// is neither idempotent nor keyed is not repeated, whatever it says. A dependency's
    /// classifier sees the verdict in [`Attempt::default_verdict`](crate::classify::Attempt::default_verdict)
    /// and has the last word. A success is final whatever the fields say. On by default: a
    /// server that sends them knows its answer better than a status code does.
    pub fn should_retry_fields(mut self, on: bool) -> Self {
        self.should_retry_fields = on;
        self
    }

    /// Replaces the set of response statuses that are retried (408, 429, 502, 503 and
    /// 504 by default). Each must be a failure, in 400-599. To keep the defaults and retry more, use
    /// [`also_retry_statuses`](Self::also_retry_statuses).
    ///
    /// Statuses outside the set are final and reach the caller after one attempt. A 409 is
    /// retried under an idempotency key sent before this attempt whatever the set (the
    /// original is still in flight); under a key just made, or none, it is final.
    pub fn retryable_statuses(mut self, statuses: impl IntoIterator<Item = u16>) -> Self {
        self.statuses = statuses.into_iter().collect();
        self
    }

    /// Narrows the methods whose requests may be retried (or hedged) to these, from every
    /// method. It never widens the safety rules, which still apply to a method listed here: a
    /// POST or PATCH is retried only under an idempotency key or when nothing reached the
    /// server. A request of any other method is sent once and never retried, even when nothing
    /// of it was sent; its record says
    /// [`StopReason::RetriesDisabled`](crate::StopReason::RetriesDisabled).
    ///
    /// To retry reads only, whatever the keys:
    ///
    /// ```
    /// use http::Method;
    /// use reqwest_safe_retry::RetryPolicy;
    ///
    /// let reads = RetryPolicy::builder()
    ///     .retryable_methods([Method::GET, Method::HEAD, Method::OPTIONS])
    ///     .build()?;
    /// assert!(reads.is_retryable_method(&Method::GET));
    /// assert!(!reads.is_retryable_method(&Method::PUT));
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    ///
    /// Only the standard methods (GET, HEAD, OPTIONS, TRACE, PUT, DELETE, POST, PATCH,
    /// CONNECT) can be listed, and at least one: [`max_attempts(1)`](Self::max_attempts) turns
    /// retries off altogether. Under a narrowed set, other methods are not retried.
    pub fn retryable_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = Some(methods.into_iter().collect());
        self
    }

    /// Adds statuses to the retried set, keeping those already in it.
    ///
    /// ```
    /// use http::StatusCode;
    /// use reqwest_safe_retry::RetryPolicy;
    ///
    /// let policy = RetryPolicy::builder().also_retry_statuses([500]).build()?;
    /// for code in [408, 429, 500, 502, 503, 504] {
    ///     assert!(policy.is_retryable_status(StatusCode::from_u16(code).unwrap()));
    /// }
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    pub fn also_retry_statuses(mut self, statuses: impl IntoIterator<Item = u16>) -> Self {
        self.statuses.extend(statuses);
        self
    }

    /// Reads each response body, up to `limit` bytes, inside the attempt.
    ///
    /// Without it the middleware hands a response back as soon as its head arrives, and a
    /// connection cut in the middle of the body shows up later, in the caller's `bytes()` or
    /// `json()`, where no retry can reach it. With it, a body cut off mid-way is a transient
    /// failure like any other. A body longer than `limit` is handed back as a stream (the part
    /// already read first), and is not retried.
    ///
    /// Without a classifier, only the bodies of answers that will not be retried are read: a
    /// response whose status is a transient failure (a 503) is judged on its head. With a
    /// [classifier](crate::Dependency::with_classifier), every answer's body is read first,
    /// within the attempt's time, and the classifier sees it ([`Attempt::body`](crate::classify::Attempt::body)):
    /// a 500 whose body says "maintenance" can be told from another 500.
    pub fn buffer_body(mut self, limit: usize) -> Self {
        self.buffer_body = Some(limit);
        self
    }

    /// Takes each attempt's timeout from the dependency's measured latency: `multiplier` times
    /// the p99.9 of its recent answers (2 is a good start), never below `floor`, never above the
    /// fixed [`attempt_timeout`](Self::attempt_timeout), which also serves until enough is
    /// measured. Off by default.
    ///
    /// Turn it on for a dependency that answers much faster than its fixed timeout: an attempt
    /// stuck on a dead connection is then cut after a few times its usual latency, not after the
    /// fixed 10 s, and retried. A retry after a timeout gets twice the last attempt's timeout
    /// (up to the fixed one).
    ///
    /// What a brownout costs: only a few attempts a second are cut at the measured limit (2, or
    /// 1 % of the dependency's answer rate if more); an attempt that reaches its limit past that
    /// allowance runs on to the fixed timeout instead. So when every answer suddenly slows
    /// (many attempts reaching their limits together), at most the allowance becomes retries
    /// each second, paid from the budget, and the rest are answered as the fixed timeout would
    /// have answered them, while the measurement catches up. A hedged read is cut at its limit
    /// whatever the allowance: its hedge is its second chance.
    ///
    /// What is measured, per dependency over the last 30 s: the latency of every answer whose
    /// status the policy does not retry (fast failures would drag the percentile down).
    /// Timeouts are counted apart: they bring the next reading forward, and when more than 5 %
    /// of the window's attempts time out the fixed timeout serves again. The window needs 100
    /// answers to be used. It costs about 400 instructions per request (one more reading of the
    /// clock, and an atomic addition per answer) and no allocation. Measured on the
    /// middleware's clock: under tokio's paused clock, or a `FakeClock` that a test does not
    /// move, an attempt takes no time and is not counted, so the fixed timeout serves.
    /// [`hedge_reads`](Self::hedge_reads) then sends no hedge either.
    ///
    /// ```
    /// use std::time::Duration;
    /// use reqwest_safe_retry::RetryPolicy;
    ///
    /// let policy = RetryPolicy::builder()
    ///     .timeout_from_latency(2.0, Duration::from_millis(50))
    ///     .build()?;
    /// assert_eq!(policy.timeout_from_latency(), Some((2.0, Duration::from_millis(50))));
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    pub fn timeout_from_latency(mut self, multiplier: f64, floor: Duration) -> Self {
        self.latency_timeout = Some((multiplier, floor));
        self
    }

    /// The fixed attempt timeout alone, whatever the window measures: a request that says its
    /// own attempt timeout (`RetryOverride::attempt_timeout`) gets exactly that.
    pub(crate) fn without_timeout_from_latency(mut self) -> Self {
        self.latency_timeout = None;
        self
    }

    /// Hedges reads: when a GET, HEAD or OPTIONS request without an idempotency key has waited
    /// longer than the `1 - extra_load` percentile of its dependency's recent answers (the p95
    /// for 0.05), and at most `max_delay`, a second copy is sent; the first answer wins and the
    /// other copy is cancelled. Off by default.
    ///
    /// Turn it on for reads whose tail latency matters (a page that waits on many of them): a
    /// dependency that answers 1 % of attempts a hundred times slower than the rest then costs
    /// its callers a little more than the p95, for about `extra_load` more requests. A hedge
    /// is a retry sent early, and whatever forbids or limits a retry forbids or limits it: only
    /// an attempt that a retry may follow is hedged (not the last one `max_attempts` allows,
    /// nor a request with [`RetryOverride::no_retries`](crate::RetryOverride::no_retries)); it
    /// draws from the dependency's retry budget like a retry, so hedges and retries together
    /// stay under one extra-load ceiling; the throttle, a spent quota and the deadline apply to
    /// it. Its cost is committed once it is sent, whether or not its caller waits for its
    /// answer: a request dropped with a hedge out keeps it paid for (the server got it), and
    /// only a hedge never sent gives its token back. Its time-left header, if the dependency
    /// sends one, is read at its own send. When one copy fails transiently while the other is still out, the request waits for
    /// the other before it retries. Never a keyed or streaming request, nor another method: a
    /// second copy of a write is a second write. The latency is measured as for
    /// [`timeout_from_latency`](Self::timeout_from_latency), at the same cost; nothing is
    /// hedged until 100 answers are measured.
    ///
    /// ```
    /// use std::time::Duration;
    /// use reqwest_safe_retry::RetryPolicy;
    ///
    /// let policy = RetryPolicy::builder()
    ///     .hedge_reads(0.05, Duration::from_millis(100))
    ///     .build()?;
    /// assert_eq!(policy.hedge_reads(), Some((0.05, Duration::from_millis(100))));
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    pub fn hedge_reads(mut self, extra_load: f64, max_delay: Duration) -> Self {
        self.hedging = Some((extra_load, max_delay));
        self
    }

    /// Validates the settings and builds the policy.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`], with a message that names the setting to change, when `max_attempts`
    /// is 0, `max_delay` is below `base_delay`, `base_delay` is not below the deadline,
    /// `attempt_timeout` or `deadline` is under a millisecond, `max_retry_after` exceeds the
    /// deadline, a retryable status is not a failure (outside 400-599), the latency timeout's
    /// multiplier is not from 1 to 1,000 or its floor is zero or above the attempt timeout, or
    /// the hedges' extra load is not above 0 and at most 0.5 or their delay is zero.
    pub fn build(self) -> Result<RetryPolicy, InvalidConfig> {
        self.checked()
    }

    fn checked(&self) -> Result<RetryPolicy, InvalidConfig> {
        #[cfg(target_arch = "wasm32")]
        if self.buffer_body.is_some() {
            return Err(InvalidConfig::new(
                POLICY,
                "buffer_body does not work in the browser (wasm32): reqwest's answer there \
                 cannot be handed back around a body read inside the attempt; leave it off and \
                 read the body with the answer's bytes() or text()"
                    .into(),
            ));
        }
        if self.max_attempts == 0 {
            return Err(InvalidConfig::new(
                POLICY,
                "max_attempts must be at least 1 (1 means no retries)".into(),
            ));
        }
        if self.max_delay < self.base_delay {
            return Err(InvalidConfig::new(
                POLICY,
                format!(
                    "max_delay ({:?}) must not be below base_delay ({:?}): raise max_delay or lower base_delay",
                    self.max_delay, self.base_delay
                ),
            ));
        }
        const MS: Duration = Duration::from_millis(1);
        if self.attempt_timeout < MS {
            return Err(InvalidConfig::new(
                POLICY,
                format!(
                    "attempt_timeout ({:?}) leaves no time for an answer: use at least 1 ms",
                    self.attempt_timeout
                ),
            ));
        }
        if self.deadline < MS {
            return Err(InvalidConfig::new(
                POLICY,
                format!(
                    "deadline ({:?}) leaves no time for an attempt: use at least 1 ms",
                    self.deadline
                ),
            ));
        }
        if self.base_delay >= self.deadline && self.max_attempts > 1 {
            return Err(InvalidConfig::new(
                POLICY,
                format!(
                    "base_delay ({:?}) must be below the deadline ({:?}), or no retry could wait \
                     it out: lower base_delay or raise deadline",
                    self.base_delay, self.deadline
                ),
            ));
        }
        let max_retry_after = self.max_retry_after.unwrap_or(self.deadline);
        if max_retry_after > self.deadline {
            return Err(InvalidConfig::new(
                POLICY,
                format!(
                    "max_retry_after ({:?}) exceeds the deadline ({:?}), so no such wait could be \
                     honoured: lower max_retry_after or raise deadline",
                    max_retry_after, self.deadline
                ),
            ));
        }
        let mut statuses = StatusSet::EMPTY;
        for &code in &self.statuses {
            if !(400..=599).contains(&code) {
                return Err(InvalidConfig::new(
                    POLICY,
                    format!("retryable status {code} is not a failure: use codes from 400 to 599"),
                ));
            }
            statuses.insert(code);
        }
        let latency_timeout = self
            .latency_timeout
            .map(|t| self.checked_latency_timeout(t))
            .transpose()?;
        let hedging = self.hedging.map(checked_hedging).transpose()?;
        let methods = match &self.methods {
            None => MethodSet::ALL,
            Some(methods) => MethodSet::of(methods)?,
        };
        Ok(RetryPolicy {
            max_attempts: self.max_attempts,
            base_delay: self.base_delay,
            max_delay: self.max_delay,
            jitter: self.jitter,
            attempt_timeout: self.attempt_timeout,
            deadline: self.deadline,
            max_retry_after,
            retry_after_jitter: self.retry_after_jitter,
            rate_limit_fields: self.rate_limit_fields,
            retry_after_fields: self.retry_after_fields,
            should_retry_fields: self.should_retry_fields,
            statuses,
            methods,
            buffer_body: self.buffer_body,
            latency_timeout,
            hedging,
        })
    }

    fn checked_latency_timeout(
        &self,
        (multiplier, floor): (f64, Duration),
    ) -> Result<LatencyTimeout, InvalidConfig> {
        if !(1.0..=1_000.0).contains(&multiplier) {
            return Err(InvalidConfig::new(
                POLICY,
                format!(
                    "timeout_from_latency's multiplier ({multiplier}) must be from 1 to 1000: \
                     below 1 most attempts of a steady dependency would time out (2 is usual)"
                ),
            ));
        }
        if floor.is_zero() || floor > self.attempt_timeout {
            return Err(InvalidConfig::new(
                POLICY,
                format!(
                    "timeout_from_latency's floor ({floor:?}) must be above zero and at most the \
                     attempt_timeout ({:?}), which caps the measured timeout",
                    self.attempt_timeout
                ),
            ));
        }
        Ok(LatencyTimeout {
            multiplier_milli: (multiplier * 1_000.0).round() as u32,
            floor,
        })
    }
}

fn checked_hedging((extra_load, max_delay): (f64, Duration)) -> Result<Hedging, InvalidConfig> {
    if !(extra_load > 0.0 && extra_load <= 0.5) {
        return Err(InvalidConfig::new(
            POLICY,
            format!(
                "hedge_reads' extra load ({extra_load}) must be above 0 and at most 0.5: it is \
                 the share of requests that get a second copy (0.05 is usual)"
            ),
        ));
    }
    if max_delay.is_zero() {
        return Err(InvalidConfig::new(
            POLICY,
            "hedge_reads' max_delay must be above zero, or every read would be sent twice at \
             once"
                .into(),
        ));
    }
    Ok(Hedging {
        extra_load_ppm: (extra_load * 1_000_000.0).round() as u32,
        max_delay,
    })
}

impl Default for RetryPolicyBuilder {
    fn default() -> Self {
        RetryPolicyBuilder::new()
    }
}

/// A set of status codes 0-639 as a bitmap: `Copy`, and a lookup is one shift and one mask.
#[derive(Clone, Copy, PartialEq, Eq)]
struct StatusSet([u64; 10]);

impl StatusSet {
    const EMPTY: StatusSet = StatusSet([0; 10]);

    fn insert(&mut self, code: u16) {
        let code = usize::from(code);
        self.0[code / 64] |= 1 << (code % 64);
    }

    fn contains(&self, code: u16) -> bool {
        let code = usize::from(code);
        self.0
            .get(code / 64)
            .is_some_and(|word| word & (1 << (code % 64)) != 0)
    }
}

impl fmt::Debug for StatusSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries((100..=599u16).filter(|c| self.contains(*c)))
            .finish()
    }
}

/// A set of methods as a bitmap, one bit for each standard method and one for every other:
/// `Copy`, and a lookup is a match and a mask.
#[derive(Clone, Copy, PartialEq, Eq)]
struct MethodSet(u16);

impl MethodSet {
    const STANDARD: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::OPTIONS,
        Method::TRACE,
        Method::PUT,
        Method::DELETE,
        Method::POST,
        Method::PATCH,
        Method::CONNECT,
    ];
    /// Every method, the others (extension methods) included.
    const ALL: MethodSet = MethodSet(u16::MAX);

    /// The bit of `method`: its place among the standard ones, or the last for any other.
    fn bit(method: &Method) -> u16 {
        let place = Self::STANDARD.iter().position(|m| m == method);
        1 << place.unwrap_or(15)
    }

    fn of(methods: &[Method]) -> Result<MethodSet, InvalidConfig> {
        if let Some(other) = methods.iter().find(|m| !Self::STANDARD.contains(m)) {
            return Err(InvalidConfig::new(
                POLICY,
                format!(
                    "retryable_methods lists {other}, which is not a standard method: list only \
                     GET, HEAD, OPTIONS, TRACE, PUT, DELETE, POST, PATCH or CONNECT"
                ),
            ));
        }
        if methods.is_empty() {
            return Err(InvalidConfig::new(
                POLICY,
                "retryable_methods lists no method: list at least one, or set max_attempts(1) \
                 to turn retries off"
                    .to_owned(),
            ));
        }
        Ok(MethodSet(
            methods.iter().fold(0, |set, m| set | Self::bit(m)),
        ))
    }

    fn contains(&self, method: &Method) -> bool {
        self.0 & Self::bit(method) != 0
    }

    /// What the builder holds for this set: `None` for every method.
    fn listed(&self) -> Option<Vec<Method>> {
        (*self != Self::ALL).then(|| {
            (Self::STANDARD.iter())
                .filter(|m| self.contains(m))
                .cloned()
                .collect()
        })
    }
}

impl fmt::Debug for MethodSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.listed() {
            None => f.write_str("All"),
            Some(methods) => f
                .debug_set()
                .entries(methods.iter().map(Method::as_str))
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_ones() {
        let p = RetryPolicy::default();
        assert_eq!(p.max_attempts(), 3);
        assert_eq!(p.base_delay(), Duration::from_millis(100));
        assert_eq!(p.max_delay(), Duration::from_secs(10));
        assert_eq!(p.attempt_timeout(), Duration::from_secs(10));
        assert_eq!(p.deadline(), Duration::from_secs(30));
        assert_eq!(p.max_retry_after(), p.deadline());
        assert!(p.retry_after_jitter());
        assert_eq!(p.jitter(), Jitter::Full);
        assert_eq!(p.buffer_body_limit(), None);
        assert!(p.rate_limit_fields());
        assert!(p.retry_after_fields());
        assert!(p.should_retry_fields());
        let retryable: Vec<u16> = (100..=599)
            .filter(|c| p.is_retryable_status(StatusCode::from_u16(*c).unwrap()))
            .collect();
        assert_eq!(retryable, [408, 429, 502, 503, 504]);
        assert_eq!(RetryPolicy::builder().build().unwrap(), p);
    }

    #[test]
    fn retryable_methods_narrow_the_set_and_refuse_what_cannot_be_listed() {
        let all = RetryPolicy::default();
        let other = Method::from_bytes(b"PURGE").unwrap();
        for method in MethodSet::STANDARD.iter().chain([&other]) {
            assert!(all.is_retryable_method(method), "{method}");
        }
        // A method listed twice is listed.
        let reads = RetryPolicy::builder()
            .retryable_methods([Method::GET, Method::HEAD, Method::GET])
            .build()
            .unwrap();
        let retried: Vec<_> = (MethodSet::STANDARD.iter().chain([&other]))
            .filter(|m| reads.is_retryable_method(m))
            .collect();
        assert_eq!(retried, [&Method::GET, &Method::HEAD]);
        assert_eq!(reads.to_builder().build().unwrap(), reads);
        assert_eq!(all.to_builder().build().unwrap(), all);
        assert!(format!("{reads:?}").contains("retryable_methods: {\"GET\", \"HEAD\"}"));
        let err = RetryPolicy::builder()
            .retryable_methods([Method::GET, other])
            .build()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid retry policy: retryable_methods lists PURGE, which is not a standard \
             method: list only GET, HEAD, OPTIONS, TRACE, PUT, DELETE, POST, PATCH or CONNECT"
        );
        let err = RetryPolicy::builder()
            .retryable_methods([])
            .build()
            .unwrap_err();
        assert!(
            err.message()
                .starts_with("retryable_methods lists no method"),
            "{err}"
        );
    }

    #[test]
    fn its_debug_names_every_setting() {
        let p = RetryPolicy::builder().buffer_body(1024).build().unwrap();
        assert_eq!(p.buffer_body_limit(), Some(1024));
        assert_eq!(
            format!("{p:?}"),
            "RetryPolicy { max_attempts: 3, base_delay: 100ms, max_delay: 10s, jitter: Full, \
             attempt_timeout: 10s, deadline: 30s, max_retry_after: 30s, \
             retry_after_jitter: true, rate_limit_fields: true, retry_after_fields: true, \
             should_retry_fields: true, \
             retryable_statuses: {408, 429, 502, 503, 504}, retryable_methods: All, \
             buffer_body: Some(1024), timeout_from_latency: None, hedge_reads: None }"
        );
    }

    #[test]
    fn zero_attempts_is_rejected_with_what_to_change() {
        let err = RetryPolicy::builder().max_attempts(0).build().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid retry policy: max_attempts must be at least 1 (1 means no retries)"
        );
    }

    #[test]
    fn cap_below_base_is_rejected() {
        let err = RetryPolicy::builder()
            .base_delay(Duration::from_secs(2))
            .max_delay(Duration::from_secs(1))
            .build()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid retry policy: max_delay (1s) must not be below base_delay (2s): \
             raise max_delay or lower base_delay"
        );
    }

    #[test]
    fn statuses_outside_the_http_range_are_rejected() {
        for code in [0, 99, 200, 304, 399, 600, 999, u16::MAX] {
            let err = RetryPolicy::builder()
                .retryable_statuses([503, code])
                .build()
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "invalid retry policy: retryable status {code} is not a failure: \
                     use codes from 400 to 599"
                )
            );
        }
    }

    #[test]
    fn zero_attempt_timeout_is_rejected() {
        let err = RetryPolicy::builder()
            .attempt_timeout(Duration::ZERO)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("attempt_timeout"), "{err}");
    }

    #[test]
    fn latency_settings_out_of_range_are_rejected_with_what_to_change() {
        let ms = Duration::from_millis;
        let timeout = |k: f64, floor: Duration| {
            RetryPolicy::builder()
                .attempt_timeout(ms(100))
                .timeout_from_latency(k, floor)
                .build()
        };
        for k in [0.999, 0.0, -2.0, 1_000.001, f64::NAN, f64::INFINITY] {
            let err = timeout(k, ms(5)).unwrap_err().to_string();
            assert!(
                err.contains("multiplier") && err.contains("from 1 to 1000"),
                "{k}: {err}"
            );
        }
        for k in [1.0, 2.0, 1_000.0] {
            assert!(timeout(k, ms(5)).is_ok(), "{k}");
        }
        for floor in [Duration::ZERO, ms(100) + Duration::from_nanos(1), ms(101)] {
            let err = timeout(2.0, floor).unwrap_err().to_string();
            assert!(
                err.contains("floor") && err.contains("at most the attempt_timeout"),
                "{err}"
            );
        }
        for floor in [Duration::from_nanos(1), ms(100)] {
            assert!(timeout(2.0, floor).is_ok(), "{floor:?}");
        }
        let hedge = |m: f64, max: Duration| RetryPolicy::builder().hedge_reads(m, max).build();
        for m in [0.0, -0.05, 0.500_001, 1.0, f64::NAN] {
            let err = hedge(m, ms(10)).unwrap_err().to_string();
            assert!(
                err.contains("extra load") && err.contains("at most 0.5"),
                "{m}: {err}"
            );
        }
        for m in [0.000_001, 0.05, 0.5] {
            assert!(hedge(m, ms(10)).is_ok(), "{m}");
        }
        let err = hedge(0.05, Duration::ZERO).unwrap_err().to_string();
        assert!(err.contains("max_delay must be above zero"), "{err}");
        assert!(hedge(0.05, Duration::from_nanos(1)).is_ok());
    }

    #[test]
    fn a_deadline_under_a_millisecond_is_rejected() {
        for deadline in [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_micros(999),
        ] {
            let err = RetryPolicy::builder()
                .deadline(deadline)
                .build()
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "invalid retry policy: deadline ({deadline:?}) leaves no time for an \
                     attempt: use at least 1 ms"
                )
            );
        }
        let one_ms = RetryPolicy::builder()
            .deadline(Duration::from_millis(1))
            .attempt_timeout(Duration::from_millis(1))
            .base_delay(Duration::ZERO)
            .build();
        assert!(one_ms.is_ok(), "{one_ms:?}");
    }

    #[test]
    fn max_retry_after_follows_the_deadline_unless_set_and_never_exceeds_it() {
        let short = RetryPolicy::builder()
            .deadline(Duration::from_secs(5))
            .build()
            .unwrap();
        assert_eq!(short.max_retry_after(), Duration::from_secs(5));
        let err = RetryPolicy::builder()
            .max_retry_after(Duration::from_secs(60))
            .build()
            .unwrap_err();
        assert!(
            err.message()
                .starts_with("max_retry_after (60s) exceeds the deadline (30s)")
        );
        let equal = RetryPolicy::builder()
            .max_retry_after(Duration::from_secs(30))
            .build();
        assert!(equal.is_ok());
    }

    #[test]
    fn a_base_delay_at_the_deadline_is_rejected_unless_there_are_no_retries() {
        let err = RetryPolicy::builder()
            .base_delay(Duration::MAX)
            .max_delay(Duration::MAX)
            .build()
            .unwrap_err();
        assert!(err.message().starts_with("base_delay"), "{err}");
        let once = RetryPolicy::builder()
            .max_attempts(1)
            .base_delay(Duration::MAX)
            .max_delay(Duration::MAX)
            .build();
        assert!(once.is_ok());
    }

    #[test]
    fn a_policy_goes_to_its_builder_and_back_unchanged() {
        let policies = [
            RetryPolicy::default(),
            RetryPolicy::builder()
                .max_attempts(7)
                .base_delay(Duration::from_millis(3))
                .max_delay(Duration::from_millis(900))
                .jitter(Jitter::Decorrelated)
                .attempt_timeout(Duration::from_millis(250))
                .deadline(Duration::from_secs(4))
                .max_retry_after(Duration::from_secs(2))
                .retry_after_jitter(false)
                .rate_limit_fields(false)
                .should_retry_fields(false)
                .retryable_statuses([408, 599])
                .buffer_body(64)
                .timeout_from_latency(2.5, Duration::from_millis(7))
                .hedge_reads(0.125, Duration::from_millis(40))
                .build()
                .unwrap(),
        ];
        assert_eq!(
            policies[1].timeout_from_latency(),
            Some((2.5, Duration::from_millis(7)))
        );
        assert_eq!(
            policies[1].hedge_reads(),
            Some((0.125, Duration::from_millis(40)))
        );
        assert_eq!(policies[0].timeout_from_latency(), None);
        assert_eq!(policies[0].hedge_reads(), None);
        for policy in policies {
            assert_eq!(policy.to_builder().build().unwrap(), policy);
        }
        // A max_retry_after at the deadline follows it; one below stays where it was.
        let follows = RetryPolicy::default()
            .to_builder()
            .deadline(Duration::from_secs(90))
            .build()
            .unwrap();
        assert_eq!(follows.max_retry_after(), Duration::from_secs(90));
        let kept = policies[1]
            .to_builder()
            .deadline(Duration::from_secs(9))
            .build()
            .unwrap();
        assert_eq!(kept.max_retry_after(), Duration::from_secs(2));
    }

    #[test]
    fn max_retries_counts_the_attempts_after_the_first() {
        let attempts = |retries| {
            RetryPolicy::builder()
                .max_retries(retries)
                .build()
                .unwrap()
                .max_attempts()
        };
        assert_eq!(attempts(0), 1);
        assert_eq!(attempts(4), 5);
        assert_eq!(attempts(u32::MAX), u32::MAX);
    }

    #[test]
    fn more_statuses_can_be_added_to_the_defaults() {
        let p = RetryPolicy::builder()
            .also_retry_statuses([408, 500, 503])
            .build()
            .unwrap();
        let retryable: Vec<u16> = (100..=599)
            .filter(|c| p.is_retryable_status(StatusCode::from_u16(*c).unwrap()))
            .collect();
        assert_eq!(retryable, [408, 429, 500, 502, 503, 504]);
        let err = RetryPolicy::builder()
            .also_retry_statuses([302])
            .build()
            .unwrap_err();
        assert!(err.message().starts_with("retryable status 302"), "{err}");
    }

    #[test]
    fn status_set_is_replaced_not_extended() {
        let p = RetryPolicy::builder()
            .retryable_statuses([500, 599, 400])
            .build()
            .unwrap();
        for (code, expected) in [
            (500, true),
            (599, true),
            (400, true),
            (503, false),
            (429, false),
        ] {
            assert_eq!(
                p.is_retryable_status(StatusCode::from_u16(code).unwrap()),
                expected,
                "{code}"
            );
        }
    }

    #[test]
    fn equal_base_and_cap_and_zero_base_are_valid() {
        let d = Duration::from_millis(5);
        assert!(
            RetryPolicy::builder()
                .base_delay(d)
                .max_delay(d)
                .build()
                .is_ok()
        );
        assert!(
            RetryPolicy::builder()
                .base_delay(Duration::ZERO)
                .max_delay(Duration::ZERO)
                .build()
                .is_ok()
        );
    }
}
