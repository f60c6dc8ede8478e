//! Retries for [`reqwest`] that are safe to repeat.
//!
//! `reqwest-safe-retry` is a [`reqwest_middleware`] middleware that stamps one stable
//! `Idempotency-Key` on each POST and PATCH and reuses it on every attempt, so a server that
//! dedupes on the key performs the effect once; it retries only transient failures (timeouts,
//! host names that did not resolve, refused or reset connections, responses cut off before the
//! end, and the statuses 408, 429, 502,
//! 503 and 504, plus 409 "still in progress" under a key sent before), only when repeating the request
//! is safe, with capped full jitter between attempts. Its clock and its random source are
//! injected, so every retry schedule can be tested instantly and reproducibly.
//!
//! # Quick start
//!
//! ```
//! use reqwest_middleware::ClientBuilder;
//! use reqwest_safe_retry::{RetryMiddleware, RetryPolicy};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = RetryPolicy::builder().max_attempts(3).build()?;
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(RetryMiddleware::new(policy))
//!     .build();
//!
//! let response = client.get("http://127.0.0.1:8080/inventory").send().await?;
//! println!("{}", response.status());
//! # Ok(()) }
//! ```
//!
//! # What is retried
//!
//! - **Transport faults**: timeouts (the request's and the policy's per-attempt timeout), a host
//!   name that could not be resolved (whatever the resolver), refused, reset or aborted
//!   connections, broken pipes, and a server closing the connection before a full
//!   response. Never: TLS certificate failures and other permanent connect errors, builder,
//!   redirect and decode errors, and errors from other middleware.
//! - **Statuses** in the policy's set [408, 429, 502, 503, 504], and `409` under an idempotency key
//!   that was sent before this attempt (the server is still working on the first copy): an
//!   earlier attempt's, the caller's own key, or one derived from a [`NaturalKey`] (a crashed
//!   run may have sent it). A first attempt's 409 under a key the middleware has just made is
//!   the server's own conflict, final: no server can hold an original under it. Any other
//!   response, 500, 400 and 422 included, is final and returned as it is.
//!   [`RetryPolicyBuilder::also_retry_statuses`] adds to the set;
//!   [`RetryPolicyBuilder::retryable_statuses`] replaces it.
//! - **What the server says of its answer**: `x-should-retry: false` (or Stripe's
//!   `stripe-should-retry`) makes a failure final, a 503 included
//!   ([`StopReason::ServerDeclinedRetry`]); `true` makes a failure transient, a 500
//!   included (not a 400 or 422). An answer the server replayed under the request's key
//!   (`Idempotent-Replayed: true`) ends the retrying at once ([`StopReason::ReplayedFailure`]):
//!   every further attempt with the key would get the same answer. The marker counts only
//!   under a key sent before, as for a 409: on a request without a key (a GET) or the first
//!   answer under a key just made, it means nothing (a proxy may echo it) and the answer is
//!   judged by its status.
//!   [`RetryPolicyBuilder::should_retry_fields`] turns the verdict off.
//! - **Your own rules**: a classifier closure on a dependency
//!   ([`Dependency::with_classifier`]) sees each [`Attempt`](classify::Attempt)'s request and outcome and says
//!   whether it is transient, wider or narrower than the rules above, which it can delegate to.
//!   It cannot override the next rule.
//! - **Only when repeating is safe**: GET, HEAD, OPTIONS, TRACE, PUT and DELETE are retried, and
//!   so is any request that carries an idempotency key. A request of another method without a
//!   key is retried only when the failure happened before any byte reached the server (the name
//!   did not resolve, the connection was refused).
//!   [`RetryPolicyBuilder::retryable_methods`] narrows this (to reads only, say:
//!   `.retryable_methods([Method::GET, Method::HEAD])`); it never widens it.
//! - **Only when the body can be sent again**: a request whose body is a stream is sent once,
//!   unchanged, and its record says [`StopReason::BodyNotCloneable`]; a stream whose chunks are
//!   all at hand when the request is sent (`reqwest::Body::wrap` of chunks already made) is
//!   read into bytes first, and sent again like any body in memory, as the tower door does.
//!
//! # Idempotency keys
//!
//! POST and PATCH requests without a key get a fresh one (a random UUID, bare, as servers in use
//! accept it: `Idempotency-Key: 8e03…`) before the first attempt, and every attempt carries the
//! identical value. A key the caller set is kept byte for byte. [`IdempotencyKeys`] changes the
//! header name, the format (bare, or quoted as the IETF draft asks: see [`KeyFormat`]), the
//! stamped methods and the key source, per dependency
//! ([`Dependency::with_idempotency_keys`]); [`Dependency::without_idempotency_keys`] turns keys
//! off. The [`RetryRecord`] or [`RetryError`] of a request tells which key it used, and whether
//! the server answered with a replay (`Idempotent-Replayed: true`).
//!
//! A stamped key lives as long as one call to `send()`. A job that may be sent again from
//! outside it (re-run after its process crashed, a queue redelivering its message) carries a
//! [`NaturalKey`] in its extensions instead (`.with_extension(NaturalKey::new("order-42/charge"))`):
//! its key is then derived from it (a name-based UUID in the configured form), the same on
//! every run, so the server performs the effect once however often the job runs.
//!
//! A key only helps if the server dedupes on it. The [`IdempotencyKeys`] docs say when to supply
//! your own key (a natural one, such as an order id) and what the server must do for the
//! exactly-once guarantee to hold.
//!
//! # When
//!
//! - **Backoff**: capped full jitter, a wait drawn from `[0, min(max_delay, base_delay * 2^retry)]`
//!   [base 100 ms, cap 10 s]; [`Jitter`] has the others (equal, decorrelated, none).
//! - **`Retry-After`** on a retryable response, in seconds or as an HTTP-date (read against the
//!   clock's wall time), is a floor; so are the millisecond fields `retry-after-ms` and Azure's
//!   `x-ms-retry-after-ms`: the first of `retry-after-ms`, `x-ms-retry-after-ms` and
//!   `Retry-After` with a valid value is the floor, and the others on that answer are not
//!   read, so a millisecond field replaces `Retry-After`, shorter or longer (the order of the
//!   openai SDKs and Azure's JavaScript SDK; azure-core for Python reads `Retry-After` first).
//!   The next attempt never starts earlier than the floor.
//!   The backoff draw is added above it, so clients that got the same header do not return as
//!   one herd. A server asking for more than [`RetryPolicyBuilder::max_retry_after`] [the
//!   deadline], or for more than the deadline leaves, gets its response returned at once; so does
//!   one asking for more seconds than fit in 64 bits (RFC 9111 reads them as "very large").
//!   Values that are not valid are ignored (the backoff applies); a date in the past means no
//!   floor. They are read on every answer that is retried (a 429 or 503 most often), never on
//!   a final one; [`RetryPolicyBuilder::retry_after_fields`] turns them off.
//! - **Budget**: a retry that the [`RetryBudget`] refuses is not made.
//! - **Deadline**: one logical request, attempts and waits together, takes at most
//!   [`RetryPolicyBuilder::deadline`] [30 s] on the middleware's clock. Each attempt's timeout is
//!   the policy's per-attempt timeout [10 s] cut to what is left, and no wait starts that would
//!   end at or past the deadline.
//!
//! # Retry budget
//!
//! Every retry is drawn from a [`RetryBudget`], a lock-free token bucket: retries spend tokens,
//! first attempts that go well earn them, and a retry is paid for before it sleeps. While a
//! dependency is healthy every transient failure is retried; during an outage the bucket runs dry
//! after a short burst and the load on the dependency tends to the offered load, not to
//! `max_attempts` times it. The default is a ratio budget of about 10 % extra load, one per
//! dependency, shared by the dependency's clones; share one between dependencies with
//! [`Dependency::with_budget`] and clones of it. See [`RetryBudget`] for the presets and the
//! rules.
//!
//! # RateLimit fields
//!
//! A server that sends the IETF draft's `RateLimit` field (`RateLimit: "default";r=0;t=12`: no
//! request left under the policy `default`, reset in 12 s) has said what it will do with the
//! next request. When an answer says a quota is spent, the next requests to that origin (scheme,
//! host and port: another host or port of the same dependency is not held) wait for the reset
//! before their first attempt, on the middleware's clock, with the jitter a `Retry-After` floor
//! gets above it, so that they do not all come back at the reset instant. The hold is inside the
//! request's deadline; one whose hold would exceed `max_retry_after` or what the deadline leaves
//! fails at once with [`StopReason::QuotaExhausted`], nothing sent. A retry after an answer that
//! spent the quota waits for its reset like a `Retry-After` floor, or stops with that reason.
//!
//! A spent quota is believed for at most 60 s at a time: after that one request goes through as
//! a probe, and its answer renews the quota or clears it, so one wrong answer (a reset a day
//! away) cannot shut a dependency off for a day. A probe whose caller gives up is given back.
//! An answer with quota left clears the hold; a valid `Retry-After` (or millisecond wait) on
//! the same answer takes precedence, and one that cannot be read leaves the quota in force;
//! field lines on one answer are one list; malformed fields are ignored. On by
//! default ([`RetryPolicyBuilder::rate_limit_fields`] turns it off): it costs one header lookup
//! per answer.
//!
//! # Adaptive throttling (opt-in)
//!
//! The budget bounds what retries add; an overloaded dependency still gets every first attempt.
//! An [`AdaptiveThrottle`] on a dependency ([`Dependency::with_throttle`]) counts, over a
//! trailing window (2 minutes by default), the attempts asked and those the dependency accepted
//! (an answer whose status the policy does not retry; an attempt its caller gave up on while it
//! was on the wire counts as asked and not accepted), and rejects an attempt locally with probability
//! `max(0, (requests - K * accepts) / (requests + 1))` (K = 2 by default), the rule of Google's
//! SRE book. A rejected attempt sends nothing: a first attempt fails with
//! [`StopReason::Throttled`], a retry stops with it, and the `throttled` counter counts both.
//!
//! Turn it on for a dependency that many clients share and that can be overloaded: it keeps the
//! load it sees near K times what it can accept while it recovers, where retries and the budget
//! alone leave it the whole offered load. It is off by default because it turns local failures
//! into errors of its own: a dependency that fails for other reasons than load (a bad deploy
//! answering 503 to everything) gets fewer attempts too, and a client with little traffic learns
//! slowly. It costs a lock and two updates of the window per attempt.
//!
//! # Attempts that follow measured latency (opt-in)
//!
//! A dependency whose policy asks for it has the latency of its answers measured over the last
//! 30 s (answers whose status is retried are left out; timeouts are counted apart), and two
//! settings use it:
//!
//! - [`RetryPolicyBuilder::timeout_from_latency`]: each attempt's timeout is a multiple of the
//!   p99.9 of the recent answers (2x is usual), between a floor and the fixed attempt timeout
//!   (which serves until 100 answers are measured, or when more than 5 % of the window's
//!   attempts timed out); a retry after a timeout gets twice the last limit. Turn it on for a
//!   dependency that answers far faster than its fixed timeout: a dead connection then costs a
//!   few times its usual latency instead of 10 s. Only a few attempts a second are cut at the
//!   measured limit (2, or 1 % of the answer rate); past that an attempt runs on to the fixed
//!   timeout, so a brownout that slows every answer costs at most those retries. It costs
//!   about 400 instructions per request (one more reading of the clock, and an atomic addition
//!   per answer) and no allocation.
//! - [`RetryPolicyBuilder::hedge_reads`]: a GET, HEAD or OPTIONS request without a key that
//!   has waited past the `1 - m` percentile of the recent answers (capped by a fixed delay)
//!   gets a second copy; the first answer wins and the other copy is cancelled. A hedge is a
//!   retry sent early: only an attempt a retry may follow is hedged (not under
//!   [`RetryOverride::no_retries`], not the last attempt allowed), hedges draw on the retry
//!   budget like retries, once sent they stay paid for, and the throttle, a spent quota and the
//!   deadline apply to them. Turn it on for reads whose tail latency matters. [`RetryRecord::answered_by_hedge`]
//!   and the `hedges` and `hedges_won` counters say what it did.
//!
//! `docs/simulations.md` in the repository shows both at work: hedging cuts a 1 s p99.9 to
//! 25 ms for 1 % more requests, and a timeout from latency cuts the p99.9 of a dependency with
//! dead connections 27-fold while cutting 0.66 % of a brownout's slow answers.
//!
//! # Telling the server which attempt it is answering (opt-in)
//!
//! [`Dependency::with_attempt_header`] sends the attempt's number (`1`, `2`, `3`) on every
//! attempt, and [`Dependency::with_deadline_header`] the whole milliseconds left before the
//! request's deadline, under names of your choice (`x-envoy-attempt-count`,
//! `x-envoy-expected-rq-timeout-ms`...): a server can then count retries, turn them away first
//! when it is overloaded, and drop work the client will have given up on.
//!
//! # Per dependency, per request
//!
//! A [`Dependency`] bundles a name, a policy, a budget of its own, counters, idempotency keys,
//! and optionally a classifier and a throttle: everything per dependency is set on it. Give each
//! dependency its own client (`RetryMiddleware::new(dependency)`), or route by host within one
//! client with [`RetryMiddleware::route`]. The middleware's own setters are for what all its
//! dependencies share: the clock, the random source, the observer and the log levels. A
//! [`RetryOverride`] in a request's extensions changes the attempts, the deadline and the
//! attempt timeout for that call alone, all in one value
//! (`.with_extension(RetryOverride::new().max_attempts(6).deadline(Duration::from_secs(60)))`);
//! one that contradicts itself fails the call before sending, with a message that names the
//! setting, and so does a `RetryPolicy` (or another setting of this crate) put on a request
//! instead, which is never silently ignored.
//!
//! # One layer retries
//!
//! When several instances of this middleware sit on one request path, exactly one of them
//! retries: the outermost (the first `.with(..)`). While it runs the rest of the chain for an
//! attempt, it marks the request as its own (on the thread, by the address of the request's
//! extensions, which every middleware of the chain is handed); every instance nearer the
//! transport sees the mark and passes the request and its outcome straight through, with no
//! attempts, timeouts, keys, counts or allocation of its own. A request that a middleware of
//! the chain makes of its own through another client (fetching a token, say) has other
//! extensions, and its own instance retries it. So the
//! backend sees at most the outermost instance's `max_attempts` per logical request, whatever
//! the instances' timeouts and deadlines, and the caller gets the real last outcome, never an
//! outer layer's timeout of an inner layer's loop. The outermost is the one that can decide
//! before anything is sent, and the one that holds the caller's override and deadline. Put the
//! instance whose policy should govern first. Retries made by other libraries in the same chain
//! are not seen.
//!
//! The same holds across the two doors (feature `tower`): a tower layer over a service that
//! sends through a `reqwest-middleware` chain carrying the middleware, or a chain whose last
//! middleware sends through a [`RetryService`], makes one layer of attempts. There the
//! extensions are another map, so the request is known by its method and URL while the outer
//! instance runs it on the thread: a request of the same method and URL that the code between
//! the doors makes of its own is passed through too, and one that the code between them sends
//! from another task is not recognised.
//!
//! # Observability
//!
//! Counters per dependency ([`Dependency::counters`], a [`CounterSnapshot`]) count logical
//! requests, attempts, retries, budget refusals, deadline stops, `Retry-After` waits honoured,
//! keys stamped and throttled attempts; with the `metrics` feature they also go to the
//! `metrics` facade. An observer closure ([`RetryMiddleware::with_observer`]) is called after
//! every attempt with a [`RetryEvent`]. `tracing` output, with the target `reqwest_safe_retry`,
//! is at DEBUG except where a retry or a give-up shows: an attempt that a retry follows, and the
//! end of a retried request, at INFO ([`RetryMiddleware::with_retry_log_level`]; a success is
//! never logged above INFO); the end of a request whose failure was not retried (or not again),
//! at WARN ([`RetryMiddleware::with_give_up_log_level`]). A request that went as its first
//! attempt went leaves nothing above DEBUG. The events carry what names the request themselves,
//! so a subscriber at INFO shows what was retried without the span (which is at DEBUG):
//!
//! ```text
//! INFO reqwest_safe_retry: attempt finished dependency="inventory" method="GET" host="inventory.internal:80" path="/items" attempt=1 status=503 decision="status" delay_ms=74
//! ```
//!
//! | kind | name | fields |
//! |---|---|---|
//! | span | `reqwest_safe_retry.request`, one per logical request | `dependency`, `method`, `host`, `path` (never the query), `http.request.resend_count` (recorded at each retry: 1, 2...) |
//! | event | `attempt finished`, one per attempt | `dependency`, `method`, `host` (with the port, the scheme's default if the URL has none), `path` (never the query), `attempt` (from 1), `status`, `error` (`timeout`, `connect`, `reset`, `incomplete`, `permanent`), `decision` (why it is retried, or the stop reason), `delay_ms` (the wait before the next attempt) |
//! | event | `retrying stopped`, one per logical request | `dependency`, `method`, `host`, `path`, `attempts`, `reason` ([`StopReason::as_str`]), `status` (the last response's, if any), `error` (the last attempt's error kind, as above; none when nothing was sent), `waited_ms` |
//!
//! # Outcomes
//!
//! A response is returned as `Ok`, whatever its status, with a [`RetryRecord`] (attempts, stop
//! reason, time waited, key, a replay, a hedge that answered) that [`RetryRecord::of`] reads: from its extensions, or, for a
//! success at the first attempt without a key (which carries none, sparing the success path an
//! allocation), inferred. An error is returned as a [`RetryError`] inside
//! [`reqwest_middleware::Error::Middleware`]; [`RetryError::of`] finds it, and it answers
//! `timed_out()`, `failed_to_connect()`, `last_status()` and `url()` for the last attempt
//! (the URL whatever ended it, the policy's own timeout included), with the attempt count, the
//! stop reason, the key and the time waited (`waited()`, as on a record).
//! `reqwest_middleware::Error`'s own `is_timeout()`, `is_connect()`, `status()` and `url()`
//! cannot see inside a middleware's error; [`RetryErrorExt`] asks the same questions of any
//! `reqwest_middleware::Error` (`timed_out()`, `failed_to_connect()`, `last_status()`,
//! `last_url()`, `attempts()`, `stop_reason()`, `waited()`, `strip_url()`). The message names
//! the last error and its root cause ("Connection refused") once.
//!
//! `RetryError` is generic over the error of what lies beneath its door: the reqwest door's is
//! a `RetryError<reqwest_middleware::Error>` (the default, written `RetryError`), the tower
//! door's a `RetryError<BoxError>`, boxed as tower passes errors and found with
//! [`RetryError::of_boxed`]. Its [`last_error`](RetryError::last_error) is a [`LastError`](error::LastError):
//! the error of the chain or the inner service ([`LastError::Beneath`](error::LastError::Beneath)), or the layer's own
//! ([`LastError::TimedOut`](error::LastError::TimedOut), [`LastError::NotSent`](error::LastError::NotSent)). Both doors answer every question the
//! same way for the same failure.
//!
//! The policy's per-attempt timeout covers an attempt from sending until the response head (or,
//! with `buffer_body`, the whole body) has arrived; it is enforced by the middleware on its
//! [`Clock`]. Timeouts set on the `reqwest::Client` or on one request still apply as reqwest
//! applies them, and count as transient failures too. An attempt cut by the policy's timeout
//! fails with [`LastError::TimedOut`](error::LastError::TimedOut) ("attempt timed out after 20ms"), whose source is an
//! `io::Error` of kind `TimedOut`, and [`RetryError::timed_out`] is `true` for either kind.
//!
//! # Cancellation
//!
//! A request may be dropped at any await (the caller's own timeout, a `select!`). A retry is
//! paid for before its wait; if the request is dropped during the wait, a guard gives the
//! tokens back, and a retry is counted only when its attempt starts. A copy already sent (an
//! attempt, or a hedge) stays paid for: the server got it, whether or not its caller waits.
//! So whatever point a request is dropped at, the budget and the counters show only what
//! happened.
//!
//! # HTTP/2, and reqwest's own retries
//!
//! reqwest 0.13 retries some failures itself, inside the `reqwest::Client`, beneath every
//! middleware: by default, HTTP/2 streams the server refused (REFUSED_STREAM) or left above a
//! graceful GOAWAY, which the protocol says were not processed. Such a re-send never reaches
//! this middleware, so [`RetryRecord::attempts`] counts the attempts *this middleware* made: one
//! attempt may be two sends on the wire. Turn reqwest's off with
//! `reqwest::Client::builder().retry(reqwest::retry::never())` to have every send counted here.
//!
//! With the `http2` feature (turn it on with reqwest's own `http2` feature), this middleware
//! reads HTTP/2 errors too: a refused stream or a graceful GOAWAY above the stream is "not
//! processed" and is retried whatever the method, an unkeyed POST included; a stream reset
//! mid-response or a connection dropped mid-stream may have come after processing, and is
//! retried only when repeating is safe. Without the feature, HTTP/2 errors other than timeouts
//! and I/O failures are final. With or without it, a connection that had closed before the
//! request was handed to it (hyper's "channel closed": a GOAWAY that came before any stream, an
//! idle connection gone) sent nothing, and the request is sent again whatever its method.
//!
//! # Response bodies
//!
//! A middleware returns as soon as the response head has arrived, so a connection cut in the
//! middle of the body surfaces later, as an error from `bytes()` or `json()`, where no retry can
//! reach it. [`RetryPolicyBuilder::buffer_body`] reads bodies up to a limit inside the attempt,
//! which makes such a cut a retryable failure.
//!
//! A transient answer that a retry follows has its body (up to 64 KiB) read while the wait
//! before the retry runs, never past it: when the wait ends in a stop (the throttle, a spent
//! quota, the deadline) the caller gets the server's whole answer, and a body still arriving
//! when the wait ends (one that trickles, or any body after a wait of zero) is dropped, with the
//! `Content-Length` that promised it. A slow body never holds a request past its deadline.
//!
//! # In the browser
//!
//! The reqwest door builds for `wasm32-unknown-unknown`, where reqwest speaks through the page's
//! `fetch`: the same middleware and policies, set up with the same code. Its clock there is
//! `BrowserClock` (the page's `performance.now()` and `setTimeout`), its randomness the page's
//! `crypto.getRandomValues`; [`Instant`] is web-time's, since the standard library's panics when
//! read in a page. A page is told nothing of why a `fetch` failed, so such a failure is read as
//! a connection lost after it was made ([`AttemptErrorKind::Reset`]): retried only when
//! repeating is safe. A response in a page has no extensions, so it carries no record
//! ([`RetryRecord::of`] does not take one; errors and the observer still tell every attempt),
//! and `buffer_body` is refused when the policy is built. The tower and gRPC doors do not build
//! there. The README's "In the browser" section says what the server's CORS must allow and
//! show for the middleware to see its answers.
//!
//! # Testing your retries
//!
//! Two ways are supported.
//!
//! - **[`FakeClock`]** (feature `test-util`) with a [`SeededRng`]: every wait takes no real
//!   time and is recorded, and the same seed gives the same waits on every run. Per-attempt
//!   timeouts run on the same virtual time: they fire only when the test moves it
//!   (`FakeClock::advance`, or another request's sleep), never while a real server is
//!   answering. A `FakeClock` never reads real time (the retry budget's refill included) and
//!   needs no tokio timer. Its wall time starts at 2026-01-01T00:00:00Z on every run: a test
//!   that builds a `Retry-After` date from `SystemTime::now()` sets it first with
//!   `FakeClock::set_wall_time(SystemTime::now())`, or the date reads as years away and the
//!   request stops with [`StopReason::RetryAfterTooLong`].
//! - **tokio's paused clock** (`#[tokio::test(start_paused = true)]`) with the default
//!   [`TokioClock`]: backoff waits, the deadline and per-attempt timeouts all run on tokio's
//!   virtual time. For the first 100 ms of real time of each attempt tokio does not
//!   auto-advance, so a server on threads of its own (wiremock's) answers before any timer is
//!   fired early by the pause; after that, a server on the same runtime that waits with
//!   `tokio::time::sleep` answers in virtual time, and an attempt it outlasts is cut at its
//!   timeout on tokio's clock.
//!
//! On a runtime without tokio's time driver, a `FakeClock` works as it is; with `TokioClock`
//! every request fails before sending with [`StopReason::TimerUnavailable`] and an error that
//! says to enable the timer. (tokio reports a missing timer only by panicking: the middleware
//! catches that panic, which the panic hook still prints.)
//!
//! Enable `test-util` in your `[dev-dependencies]`:
//!
//! ```toml
//! [dev-dependencies]
//! reqwest-safe-retry = { version = "0.1", features = ["test-util"] }
//! ```
//!
//! Then test your own client against a local server, here one that fails twice:
//!
//! ```
//! use std::time::{Duration, Instant};
//!
//! use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
//! use reqwest_safe_retry::{FakeClock, RetryMiddleware, RetryPolicy, RetryRecord, SeededRng};
//! use wiremock::matchers::any;
//! use wiremock::{Mock, MockServer, ResponseTemplate};
//!
//! /// Your service's client, built the way production builds it, but on the given clock.
//! fn inventory_client(clock: FakeClock) -> ClientWithMiddleware {
//!     let retries = RetryMiddleware::new(RetryPolicy::default())
//!         .with_clock(clock)
//!         .with_rng(SeededRng::new(42));
//!     ClientBuilder::new(reqwest::Client::new()).with(retries).build()
//! }
//!
//! #[tokio::main]
//! async fn main() {
//!     let server = MockServer::start().await;
//!     Mock::given(any())
//!         .respond_with(ResponseTemplate::new(503))
//!         .up_to_n_times(2)
//!         .mount(&server)
//!         .await;
//!     Mock::given(any())
//!         .respond_with(ResponseTemplate::new(200))
//!         .mount(&server)
//!         .await;
//!
//!     let clock = FakeClock::new();
//!     let client = inventory_client(clock.clone());
//!     let started = Instant::now();
//!     let response = client.get(server.uri()).send().await.unwrap();
//!
//!     assert_eq!(response.status(), 200);
//!     assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 3);
//!     assert_eq!(server.received_requests().await.unwrap().len(), 3);
//!     // Seed 42 draws these waits from [0, 100 ms] and [0, 200 ms], on every run.
//!     let waits: Vec<u128> = clock.sleeps().iter().map(|d| d.as_millis()).collect();
//!     assert_eq!(waits, [74, 31]);
//!     // ...and none of them was slept for real.
//!     assert!(started.elapsed() < Duration::from_secs(1));
//! }
//! ```
//!
//! # Features
//!
//! - `test-util`: [`FakeClock`], a virtual clock for tests.
//! - `metrics`: counters, and the budget's balance, also exported through the `metrics` facade
//!   (names, labels and meanings: [`CounterSnapshot`]).
//! - `http2`: HTTP/2 errors classified by what the protocol says was processed (see above).
//! - `tower`: the middleware is also a `tower::Layer`, whose [`RetryService`] gives clients built
//!   as a `Service` of `http::Request`s (hyper-util's) the same retries, on the same driver.
//! - `grpc`: `GrpcRetryLayer`, gRPC retries for tonic clients by gRFC A6 (retry or hedging
//!   policy per method, from a service config too, pushback, throttling, committed calls,
//!   transparent retries), on the same engine and driver: the repository's `docs/grpc.md` holds each rule
//!   with the test that shows it.
//!
//! Deterministic simulations of retry traffic, with their charts, live in the repository's
//! `simulator` workspace member, not in this crate: `docs/simulations.md` shows them.
// `FakeClock` is behind `test-util`: without it, its links in these docs go to the section that
// says how to turn it on (a docs.rs page of the type may not exist for this version).
#![cfg_attr(feature = "test-util", doc = "\n\n[`FakeClock`]: crate::FakeClock")]
#![cfg_attr(
    not(feature = "test-util"),
    doc = "\n\n[`FakeClock`]: crate#testing-your-retries"
)]
// `RetryService` is behind `tower`: without it, its links go to the features list.
#![cfg_attr(feature = "tower", doc = "\n\n[`RetryService`]: crate::RetryService")]
#![cfg_attr(not(feature = "tower"), doc = "\n\n[`RetryService`]: crate#features")]
#![deny(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(not(any(feature = "reqwest", feature = "tower", feature = "grpc")))]
compile_error!(
    "reqwest-safe-retry has no door to retry through: turn on one of its features `reqwest` \
     (the default), `tower` or `grpc`"
);

#[cfg(all(target_arch = "wasm32", any(feature = "tower", feature = "grpc")))]
compile_error!(
    "reqwest-safe-retry's tower and gRPC doors do not build for wasm32: in the browser only the \
     reqwest door runs (reqwest over `fetch`). Turn off the `tower` and `grpc` features for this \
     target"
);

mod clock;
mod door;
mod driver;
mod engine;
pub mod error;
#[cfg(feature = "test-util")]
mod fake_clock;
mod fault;
mod maybe_send;
mod observe;
mod record;
mod rng;
mod shared;
mod stop;

#[cfg(target_arch = "wasm32")]
pub use clock::BrowserClock;
#[cfg(not(target_arch = "wasm32"))]
pub use clock::TokioClock;
pub use clock::{Clock, Instant, Sleep};
#[cfg(feature = "reqwest")]
pub use door::reqwest::RetryErrorExt;
#[cfg(feature = "tower")]
pub use door::tower::RetryService;
pub use driver::middleware::RetryMiddleware;
pub use engine::backoff::Jitter;
pub use engine::budget::{RetryBudget, RetryBudgetBuilder};
pub use engine::dependency::{Dependency, RetryOverride};
pub use engine::idempotency::{
    IdempotencyKeys, IdempotencyKeysBuilder, KeyFormat, KeySource, NaturalKey, SeededKeys,
};
pub use engine::policy::{RetryPolicy, RetryPolicyBuilder};
pub use engine::throttle::{AdaptiveThrottle, AdaptiveThrottleBuilder};
pub use error::{BoxError, InvalidConfig, RetryError};
#[cfg(feature = "test-util")]
pub use fake_clock::FakeClock;
pub use fault::AttemptErrorKind;
pub use observe::{CounterSnapshot, RetryAttempt, RetryEvent};
pub use record::{Answer, RetryRecord};
pub use rng::{RandomSource, SeededRng};
pub use stop::StopReason;

/// Your own rules of what is transient: what a classifier
/// ([`Dependency::with_classifier`]) is handed of each attempt, and what it answers.
pub mod classify {
    pub use crate::engine::classifier::{Attempt, Outcome, Retryable};
    pub use crate::engine::seen::ResponseHead;
}

/// The bodies the tower and gRPC doors hand on: a request's as each copy carries it
/// ([`SendBody`](body::SendBody)), and an answer's as the caller reads it
/// ([`RetryBody`](body::RetryBody)).
#[cfg(any(feature = "tower", feature = "grpc"))]
pub mod body {
    pub use crate::driver::{retry_body::RetryBody, send_body::SendBody};
}

/// The gRPC door (feature `grpc`): gRFC A6's retry and hedging policies for tonic clients
/// ([`GrpcRetryLayer`](grpc::GrpcRetryLayer), configured by a [`GrpcConfig`](grpc::GrpcConfig)).
/// The crate's README and `docs/grpc.md` say what it does, rule by rule.
#[cfg(feature = "grpc")]
pub mod grpc {
    pub use crate::door::grpc::{GrpcBody, GrpcRetryLayer, GrpcRetryService};
    pub use crate::engine::grpc::GRPC_MAX_ATTEMPTS;
    pub use crate::engine::grpc::config::{GrpcConfig, GrpcRetryPolicy, GrpcRetryPolicyBuilder};
    pub use crate::engine::grpc::hedging::{GrpcHedgingPolicy, GrpcHedgingPolicyBuilder};
    pub use crate::engine::grpc::throttle::RetryThrottling;
}

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
