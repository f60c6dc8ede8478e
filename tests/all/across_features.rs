//! The promises that hold across features, over random scripts through the whole chain on
//! loopback, under a `FakeClock`.
//!
//! One generator draws a dependency across every feature at once (keys off or on, attempt and
//! time-left headers, a header named like the key, hedged reads, the timeout from latency,
//! a budget that may run dry, a throttle, a policy that retries reads only, wait fields read
//! or not), then logical requests (a method; no key, the
//! caller's own or a natural one; an override, its own attempt timeout over a warm latency
//! window included), the server's answers to each copy (statuses
//! with `Retry-After` and `retry-after-ms` valid and not, `RateLimit`, `x-should-retry` and
//! `Idempotent-Replayed`), each copy's latency on the clock, and where the caller gives up.
//! A small server on 127.0.0.1 answers as scripted and records every arrival; a middleware
//! beneath the one under test stands in for the network's latency. On every script:
//!
//! 1. a request that must not be repeated (`no_retries`, one attempt, a method the policy does
//!    not retry) or that is not safe to
//!    repeat (a POST without a key) reaches the server once;
//! 2. the server's arrivals are at most the logical requests plus what the budget paid,
//!    whatever was cancelled;
//! 3. every copy of a request carries the same key, the one its record or error reports;
//! 4. no time-left header says more than is left, and no retry comes before a valid floor the
//!    answer before it set (its wait field, or a spent quota's reset); nor the next request's
//!    first copy before the reset of a quota the last answer said was spent, final or not;
//! 5. the counters equal what the server saw: one request per `send()`, attempts and hedges
//!    at least the arrivals, exactly them when no copy was given up;
//!
//! and, where the outcome of each copy is known (no hedging, no measured timeout, no copy
//! cut), every answer followed by another copy of its request is transient by a small
//! reference model of the contract, and a finished request's stop reason agrees with it.
//!
//! One script in ten nests another instance behind the other door, beneath the one under test
//! (a tower layer over a chain that carries it, or a chain whose last middleware sends through
//! it): it must pass every copy through, counting nothing. One in four writes its target other
//! than as the URL standard does (a port's leading zero, a dot segment, braces), and one in
//! five puts a service beneath the tower layer that is not ready when first asked for a copy.
//!
//! Each script goes through one of the two front doors (feature `tower`: even seeds through a
//! `reqwest-middleware` chain, odd ones through the tower layer over hyper-util's client, with
//! the same stand-in beneath either; `ACROSS_DOOR=reqwest` or `tower` picks one for all): the
//! promises are the same on both.
//!
//! The scripts share one clock and, where they measure latency, a warmed dependency (clones
//! of one per way of measuring, so the counters are read as differences); everything else is
//! the script's own, its server and origin included. A failure names its seed and its script:
//! `ACROSS_SEED=N ACROSS_SCRIPTS=M` runs `M` scripts from seed `N` (from 0, the same run
//! again). Hedges race real sockets, so a hedged script may not repeat exactly: the promises
//! hold however the race goes.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use reqwest_safe_retry::{
    AdaptiveThrottle, Clock, Dependency, FakeClock, IdempotencyKeys, NaturalKey, RandomSource,
    RetryBudget, RetryError, RetryMiddleware, RetryOverride, RetryPolicy, RetryRecord, SeededRng,
    StopReason,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::support;

/// Scripts in the debug build (the test command); more in release.
const SCRIPTS: u64 = if cfg!(debug_assertions) { 2_000 } else { 6_000 };

struct Gen(SeededRng);

impl Gen {
    fn upto(&mut self, n: u64) -> u64 {
        self.0.next_u64() % (n + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.upto(99) < percent
    }
    fn ms(&mut self, n: u64) -> Duration {
        Duration::from_millis(self.upto(n))
    }
    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.upto(items.len() as u64 - 1) as usize].clone()
    }
}

/// One scripted answer of the server.
#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    headers: Vec<(&'static str, String)>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        let mut lines = self.headers.iter().filter(|(n, _)| *n == name);
        lines.next().map(|(_, v)| v.as_str())
    }

    /// The floor this answer sets for a retry after it: its first valid wait field
    /// (milliseconds first) when the policy reads them (`waits`), else a spent quota's reset.
    fn floor(&self, waits: bool) -> Option<Duration> {
        self.wait().filter(|_| waits).or(self.spent_quota())
    }

    /// The first valid wait field (milliseconds first), if any.
    fn wait(&self) -> Option<Duration> {
        let millis = (self.header("retry-after-ms")).and_then(|v| v.parse::<u64>().ok());
        let secs = (self.header("retry-after")).and_then(|v| v.parse::<u64>().ok());
        millis
            .map(Duration::from_millis)
            .or(secs.map(Duration::from_secs))
    }

    /// The reset of the quota this answer says is spent, whatever its status and wait fields.
    fn spent_quota(&self) -> Option<Duration> {
        self.header("ratelimit").and_then(|v| {
            let reset = v.strip_prefix("\"q\";r=0;t=")?;
            reset.parse::<u64>().ok().map(Duration::from_secs)
        })
    }
}

fn answer(g: &mut Gen) -> Answer {
    let status = g.pick(&[200, 201, 408, 409, 422, 429, 500, 503, 504]);
    let mut headers = Vec::new();
    match g.upto(9) {
        0 => headers.push(("retry-after", g.upto(2).to_string())),
        1 => headers.push(("retry-after", g.pick(&["1.5", "soon", "-1"]).to_owned())),
        2 => headers.push(("retry-after-ms", g.upto(1_500).to_string())),
        3 => headers.push(("retry-after-ms", g.pick(&["soon", "1e3", ""]).to_owned())),
        _ => {}
    }
    match g.upto(9) {
        0 | 1 => headers.push(("ratelimit", format!("\"q\";r=0;t={}", 1 + g.upto(2)))),
        2 => headers.push(("ratelimit", "\"q\";r=9;t=60".to_owned())),
        3 => headers.push(("ratelimit", "garbage;;".to_owned())),
        _ => {}
    }
    match g.upto(11) {
        0 => headers.push(("x-should-retry", "true".to_owned())),
        1 => headers.push(("x-should-retry", "false".to_owned())),
        2 => headers.push(("x-should-retry", "perhaps".to_owned())),
        _ => {}
    }
    if g.chance(15) {
        headers.push(("idempotent-replayed", "true".to_owned()));
    }
    Answer { status, headers }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyUse {
    None,
    Callers,
    Natural,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cancel {
    Never,
    /// Once this copy (0-based) of the request has been answered by the server, before the
    /// middleware sees the answer.
    AfterAnswer(u32),
    /// After this many polls of the request.
    AfterPolls(u32),
}

/// What a request's override says, as the model reads it; several settings may come together.
#[derive(Debug, Clone, Copy, Default)]
struct Over {
    no_retries: bool,
    max_attempts: Option<u32>,
    deadline: Option<Duration>,
    /// The request's own attempt timeout: it holds over a warm latency window.
    attempt_timeout: Option<Duration>,
}

impl Over {
    fn sent(self) -> RetryOverride {
        let mut over = RetryOverride::new();
        if self.no_retries {
            over = over.no_retries();
        }
        if let Some(n) = self.max_attempts {
            over = over.max_attempts(n);
        }
        if let Some(d) = self.deadline {
            over = over.deadline(d);
        }
        if let Some(t) = self.attempt_timeout {
            over = over.attempt_timeout(t);
        }
        over
    }
}

#[derive(Debug, Clone)]
struct Req {
    method: reqwest::Method,
    key: KeyUse,
    overriding: Option<Over>,
    cancel: Cancel,
    answers: Vec<Answer>,
    /// Each copy's latency on the clock (the last repeats).
    latencies: Vec<Duration>,
    /// The first copy waits for a hedge's answer (when one goes) before it answers.
    slow_first: bool,
}

#[derive(Debug, Clone)]
struct Config {
    keys: bool,
    /// The attempt header is named `Idempotency-Key` and set before the keys.
    attempt_named_like_the_key: bool,
    attempt_header: bool,
    left_header: bool,
    hedging: bool,
    latency_timeout: bool,
    max_attempts: u32,
    base: Duration,
    attempt_timeout: Duration,
    deadline: Duration,
    /// Capacity and initial tokens, or no budget.
    budget: Option<(u64, u64)>,
    throttle: bool,
    /// The policy retries GET and HEAD only (`retryable_methods`).
    reads_only: bool,
    /// The policy reads wait fields (`retry_after_fields`).
    wait_fields: bool,
    /// Another instance sits behind the other door, beneath the one under test (a tower
    /// layer over a chain carrying it, or a chain whose last middleware sends through it).
    nested: bool,
    /// How the target is written: 0 as the URL standard writes it; else with a port's leading
    /// zero, a dot segment, or braces in the path (one request to both doors all the same).
    written: u64,
    /// The service beneath the tower layer is not ready when first asked for each copy (it
    /// wakes its asker at once): a hedge waits for it, unpaid.
    busy_beneath: bool,
}

#[derive(Debug, Clone)]
struct Script {
    config: Config,
    requests: Vec<Req>,
}

fn script(seed: u64) -> Script {
    let mut g = Gen(SeededRng::new(seed));
    let hedging = g.chance(25);
    let deadline = Duration::from_millis(500 + g.upto(20_000));
    let mut config = Config {
        keys: g.chance(75),
        attempt_named_like_the_key: g.chance(5),
        attempt_header: g.chance(50),
        left_header: g.chance(60),
        hedging,
        latency_timeout: g.chance(20),
        max_attempts: 1 + g.upto(3) as u32,
        base: Duration::from_millis(1 + g.upto(300)),
        attempt_timeout: Duration::from_millis(50 + g.upto(2_000)),
        deadline,
        budget: g.chance(85).then(|| {
            let capacity = 1 + g.upto(4);
            (capacity, g.upto(capacity))
        }),
        throttle: g.chance(15),
        reads_only: g.chance(15),
        wait_fields: g.chance(85),
        nested: g.chance(10),
        written: if g.chance(25) { 1 + g.upto(2) } else { 0 },
        busy_beneath: g.chance(20),
    };
    if config.hedging || config.latency_timeout {
        // A measuring dependency is a clone of a warmed one (see `Measuring`): its policy.
        config.max_attempts = MEASURING_ATTEMPTS;
        config.base = MEASURING_BASE;
        config.attempt_timeout = MEASURING_TIMEOUT;
        config.deadline = MEASURING_DEADLINE;
        config.reads_only = false;
        config.wait_fields = true;
    }
    let requests = (0..1 + g.upto(2))
        .map(|_| {
            let method = if hedging && g.chance(70) {
                reqwest::Method::GET
            } else {
                g.pick(&[
                    reqwest::Method::GET,
                    reqwest::Method::POST,
                    reqwest::Method::PUT,
                ])
            };
            let key = match g.upto(9) {
                0 | 1 => KeyUse::Callers,
                2 if config.keys => KeyUse::Natural,
                _ => KeyUse::None,
            };
            let deadline = |g: &mut Gen| {
                Duration::from_millis(config.base.as_millis() as u64 + 1 + g.upto(5_000))
            };
            let overriding = match g.upto(9) {
                0 => Some(Over {
                    no_retries: true,
                    ..Over::default()
                }),
                1 => Some(Over {
                    max_attempts: Some(1 + g.upto(2) as u32),
                    ..Over::default()
                }),
                2 => Some(Over {
                    deadline: Some(deadline(&mut g)),
                    ..Over::default()
                }),
                3 => Some(Over {
                    max_attempts: Some(1 + g.upto(2) as u32),
                    deadline: Some(deadline(&mut g)),
                    ..Over::default()
                }),
                4 => Some(Over {
                    max_attempts: g.chance(50).then(|| 1 + g.upto(2) as u32),
                    attempt_timeout: Some(Duration::from_millis(5 + g.upto(60))),
                    ..Over::default()
                }),
                _ => None,
            };
            let cancel = match g.upto(9) {
                0 => Cancel::AfterAnswer(g.upto(1) as u32),
                1 => Cancel::AfterPolls(1 + g.upto(12) as u32),
                _ => Cancel::Never,
            };
            let answers = (0..1 + g.upto(3)).map(|_| answer(&mut g)).collect();
            let latencies = (0..1 + g.upto(3))
                .map(|_| match g.upto(9) {
                    0 => g.ms(3_000),
                    1..=3 => Duration::from_millis(11 + g.upto(30)),
                    _ => g.ms(10),
                })
                .collect();
            Req {
                method,
                key,
                overriding,
                cancel,
                answers,
                latencies,
                slow_first: hedging && g.chance(50),
            }
        })
        .collect();
    Script { config, requests }
}

/// What the server saw of one copy.
#[derive(Debug, Clone)]
struct Arrival {
    request: usize,
    key: Option<String>,
    left: Option<u64>,
    /// The clock's time since the script began, when it arrived.
    at: Duration,
}

/// What the network stand-in saw of one request's copies.
#[derive(Debug, Default)]
struct Copies {
    entered: u32,
    answered: u32,
    cancel: bool,
    hedge_ended: bool,
}

#[derive(Debug, Default)]
struct Seen {
    arrivals: Vec<Arrival>,
    copies: HashMap<usize, Copies>,
}

type Shared = Arc<Mutex<Seen>>;

/// The scripted server for one script: request `r`'s `n`-th arrival gets its `n`-th answer
/// (the last repeats). Keeps connections alive, as reqwest pools them.
async fn serve(script: Arc<Script>, seen: Shared, clock: FakeClock) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let origin = clock.now();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (script, seen, clock) = (script.clone(), seen.clone(), clock.clone());
            tokio::spawn(async move {
                while let Some(request) = support::read_request(&mut stream).await {
                    let text = |name| {
                        (request.header(name)).map(|v| String::from_utf8_lossy(v).into_owned())
                    };
                    let Some(r) = text("x-req").and_then(|v| v.parse::<usize>().ok()) else {
                        return;
                    };
                    let answer = {
                        let mut seen = seen.lock().unwrap();
                        let n = seen.arrivals.iter().filter(|a| a.request == r).count();
                        seen.arrivals.push(Arrival {
                            request: r,
                            key: text("idempotency-key"),
                            left: text("x-left").and_then(|v| v.parse().ok()),
                            at: clock.now() - origin,
                        });
                        let answers = &script.requests[r].answers;
                        answers[n.min(answers.len() - 1)].clone()
                    };
                    let mut head = format!("HTTP/1.1 {} X\r\ncontent-length: 0\r\n", answer.status);
                    for (name, value) in &answer.headers {
                        head.push_str(&format!("{name}: {value}\r\n"));
                    }
                    head.push_str("\r\n");
                    if stream.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

/// Yields `n` times.
async fn yields(n: u32) {
    for _ in 0..n {
        let mut once = false;
        std::future::poll_fn(|cx: &mut Context<'_>| {
            if once {
                return Poll::Ready(());
            }
            once = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        })
        .await;
    }
}

/// The network's stand-in, beneath the middleware under test: each copy goes to the server,
/// and once answered takes its scripted latency on the clock, then yields, so the attempt's
/// timer (and a hedge's) can fire first. It notes the copies and where the caller gives up.
struct Wire {
    script: Arc<Script>,
    seen: Shared,
    clock: FakeClock,
}

impl Wire {
    /// One copy through the network's stand-in: `sent` is the copy going on to the server
    /// (begun before this is polled, as the chain's next middleware would be), the copy's
    /// outcome after its scripted latency.
    fn pass<T, F>(
        &self,
        headers: &http::HeaderMap,
        sent: F,
    ) -> impl Future<Output = T> + Send + use<T, F>
    where
        T: Send,
        F: Future<Output = T> + Send,
    {
        let r: usize = headers["x-req"].to_str().unwrap().parse().unwrap();
        let req = &self.script.requests[r];
        let copy = {
            let mut seen = self.seen.lock().unwrap();
            let copies = seen.copies.entry(r).or_default();
            copies.entered += 1;
            copies.entered - 1
        };
        let latency = req.latencies[(copy as usize).min(req.latencies.len() - 1)];
        let (seen, clock) = (self.seen.clone(), self.clock.clone());
        let (cancel, slow) = (req.cancel, req.slow_first && copy == 0);
        async move {
            // A hedge that ends, answered or given up (its own timer, a win of the first
            // copy), lets a first copy waiting for it go on.
            let _ended = (copy == 1).then(|| HedgeEnded(seen.clone(), r));
            let outcome = sent.await;
            {
                let mut seen = seen.lock().unwrap();
                let copies = seen.copies.entry(r).or_default();
                copies.answered += 1;
                if cancel == Cancel::AfterAnswer(copy) {
                    copies.cancel = true;
                }
            }
            clock.advance(latency);
            yields(1).await;
            if slow {
                // A hedge, if one goes, enters within a few polls: wait for its answer.
                yields(3).await;
                let hedged = || seen.lock().unwrap().copies[&r].entered > 1;
                let ended = || seen.lock().unwrap().copies[&r].hedge_ended;
                let until = std::time::Instant::now() + Duration::from_secs(2);
                while hedged() && !ended() && std::time::Instant::now() < until {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
            }
            outcome
        }
    }
}

impl Middleware for Wire {
    fn handle<'a, 'b, 'c, 'd>(
        &'a self,
        request: Request,
        extensions: &'b mut Extensions,
        next: Next<'c>,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<Response>> + Send + 'd>>
    where
        'a: 'd,
        'b: 'd,
        'c: 'd,
        Self: 'd,
    {
        let headers = request.headers().clone();
        Box::pin(self.pass(&headers, next.run(request, extensions)))
    }
}

/// The network's stand-in beneath the tower layer: the same [`Wire`], around hyper-util's
/// client.
#[cfg(feature = "tower")]
#[derive(Clone)]
struct WireService<S> {
    inner: S,
    wire: Arc<Wire>,
    /// Not ready when first asked, once per clone (each copy asks a clone of its own).
    busy: bool,
}

#[cfg(feature = "tower")]
impl<S, B> tower_service::Service<http::Request<B>> for WireService<S>
where
    S: tower_service::Service<http::Request<B>> + Send,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if std::mem::take(&mut self.busy) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let headers = request.headers().clone();
        let sent = self.inner.call(request);
        Box::pin(self.wire.pass(&headers, sent))
    }
}

/// The policy of the dependencies that measure latency.
const MEASURING_ATTEMPTS: u32 = 3;
const MEASURING_BASE: Duration = Duration::from_millis(20);
const MEASURING_TIMEOUT: Duration = Duration::from_secs(1);
const MEASURING_DEADLINE: Duration = Duration::from_secs(10);

/// What the scripts share: one clock, and a warmed dependency for each way of measuring
/// latency (hedging, the timeout from it, both), whose window is filled again when its
/// answers grow old. Filling one takes a hundred requests: too many for every script.
struct Measuring {
    clock: FakeClock,
    /// One client beneath every script's chain (each script's server has an origin, and so
    /// connections, of its own): making one is most of what a script would cost.
    http: reqwest::Client,
    /// The same for the tower door: hyper-util's client beneath the layer.
    #[cfg(feature = "tower")]
    hyper: HyperClient,
    /// By `(hedging, latency_timeout)`: the dependency and when it was last warmed.
    warmed: HashMap<(bool, bool), (Dependency, Option<std::time::Instant>)>,
}

impl Measuring {
    /// A clone of the warmed dependency with this way of measuring, warmed again if its
    /// window's answers are more than 20 s old.
    async fn base(&mut self, hedging: bool, latency_timeout: bool) -> Dependency {
        let now = self.clock.now();
        let entry = self
            .warmed
            .entry((hedging, latency_timeout))
            .or_insert_with(|| {
                let mut policy = RetryPolicy::builder()
                    .max_attempts(MEASURING_ATTEMPTS)
                    .base_delay(MEASURING_BASE)
                    .max_delay(MEASURING_BASE * 4)
                    .attempt_timeout(MEASURING_TIMEOUT)
                    .deadline(MEASURING_DEADLINE);
                if latency_timeout {
                    policy = policy.timeout_from_latency(2.0, Duration::from_millis(5));
                }
                if hedging {
                    policy = policy.hedge_reads(0.05, Duration::from_millis(50));
                }
                let dependency = Dependency::new("measuring", policy.build().unwrap());
                (dependency, None)
            });
        if entry
            .1
            .is_none_or(|warmed| now - warmed > Duration::from_secs(20))
        {
            warm(&entry.0, &self.clock, &self.http).await;
            entry.1 = Some(self.clock.now());
        }
        entry.0.clone()
    }
}

/// Marks request `.1`'s hedge as ended when dropped.
struct HedgeEnded(Shared, usize);

impl Drop for HedgeEnded {
    fn drop(&mut self) {
        if let Ok(mut seen) = self.0.lock() {
            seen.copies.entry(self.1).or_default().hedge_ended = true;
        }
    }
}

/// The dependency a script's config draws, or `None` where the configuration is refused
/// (as it must be: a header named like the key).
async fn dependency(c: &Config, measuring: &mut Measuring) -> Option<Dependency> {
    let mut dependency = if c.hedging || c.latency_timeout {
        measuring.base(c.hedging, c.latency_timeout).await
    } else {
        let mut policy = RetryPolicy::builder()
            .max_attempts(c.max_attempts)
            .base_delay(c.base)
            .max_delay(c.base * 4)
            .attempt_timeout(c.attempt_timeout)
            .deadline(c.deadline)
            .retry_after_fields(c.wait_fields);
        if c.reads_only {
            policy = policy.retryable_methods([reqwest::Method::GET, reqwest::Method::HEAD]);
        }
        let policy = policy.build().unwrap();
        Dependency::new("model", policy)
    }
    .without_idempotency_keys();
    if c.attempt_named_like_the_key {
        dependency = dependency.with_attempt_header("Idempotency-Key").unwrap();
        // Refused in either order: a script goes on only where the clash was accepted, and the
        // promises then say what it broke.
        dependency = dependency
            .with_idempotency_keys(IdempotencyKeys::default())
            .ok()?;
    } else if c.keys {
        dependency = dependency
            .with_idempotency_keys(IdempotencyKeys::default())
            .unwrap();
    }
    if c.attempt_header {
        dependency = dependency.with_attempt_header("x-attempt").unwrap();
    }
    if c.left_header {
        dependency = dependency.with_deadline_header("x-left").unwrap();
    }
    dependency = match c.budget {
        None => dependency.without_budget(),
        Some((capacity, initial)) => dependency.with_budget(
            RetryBudget::builder()
                .capacity(capacity as f64)
                .initial(initial as f64)
                .retry_cost(1.0)
                .timeout_cost(1.0)
                .throttled_cost(1.0)
                .deposit_ratio(0.001)
                .refund_on_success(false)
                .floor_per_sec(0.0)
                .build()
                .unwrap(),
        ),
    };
    if c.throttle {
        dependency = dependency.with_throttle(AdaptiveThrottle::default());
    }
    Some(dependency)
}

/// Answers every request at once with a 200 after 10 ms on the clock: fills a dependency's
/// latency window without sockets.
struct Answers10ms(FakeClock);

impl Middleware for Answers10ms {
    fn handle<'a, 'b, 'c, 'd>(
        &'a self,
        _: Request,
        _: &'b mut Extensions,
        _: Next<'c>,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<Response>> + Send + 'd>>
    where
        'a: 'd,
        'b: 'd,
        'c: 'd,
        Self: 'd,
    {
        self.0.advance(Duration::from_millis(10));
        let response = http::Response::builder().status(200).body("").unwrap();
        Box::pin(std::future::ready(Ok(Response::from(response))))
    }
}

/// The window of a dependency that measures latency, filled with 10 ms answers and read.
async fn warm(dependency: &Dependency, clock: &FakeClock, http: &reqwest::Client) {
    let warmer = ClientBuilder::new(http.clone())
        .with(RetryMiddleware::new(dependency.clone()).with_clock(clock.clone()))
        .with(Answers10ms(clock.clone()))
        .build();
    let request = warmer.get("http://127.0.0.1:9/").build().unwrap();
    for _ in 0..110 {
        warmer.execute(request.try_clone().unwrap()).await.unwrap();
    }
    clock.advance(Duration::from_secs(1));
}

/// What the reference model says of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Judged {
    Transient,
    Final(StopReason),
}

fn judged(answer: &Answer, repeatable: bool, keyed: bool, key_sent: bool) -> Judged {
    let status = answer.status;
    if status < 400 {
        return Judged::Final(StopReason::Succeeded);
    }
    let in_set = [408, 429, 502, 503, 504].contains(&status) || (key_sent && status == 409);
    let (transient, declined) = match answer.header("x-should-retry") {
        Some("true") => (in_set || (status != 400 && status != 422), false),
        Some("false") => (false, in_set),
        _ => (in_set, false),
    };
    if !transient {
        let reason = if declined {
            StopReason::ServerDeclinedRetry
        } else {
            StopReason::NotRetryable
        };
        return Judged::Final(reason);
    }
    if !repeatable {
        return Judged::Final(StopReason::NotSafeToRetry);
    }
    if keyed && key_sent && answer.header("idempotent-replayed") == Some("true") {
        return Judged::Final(StopReason::ReplayedFailure);
    }
    Judged::Transient
}

/// The end of one logical request as the caller saw it.
#[derive(Debug)]
enum End {
    Cancelled,
    Done {
        key: Option<String>,
        attempts: u32,
        stop: StopReason,
        /// The caller got an answer (not an error).
        answered: bool,
    },
    /// An error that is not the middleware's (none is expected).
    Other(String),
}

/// Which front door a script's requests go through.
#[derive(Debug, Clone, Copy)]
enum Door {
    /// A `reqwest-middleware` chain.
    Reqwest,
    /// The tower layer over hyper-util's client.
    #[cfg(feature = "tower")]
    Tower,
}

/// A script's client, through its door, with the network's stand-in beneath the middleware.
enum Front {
    Reqwest(ClientWithMiddleware),
    #[cfg(feature = "tower")]
    Tower(Box<reqwest_safe_retry::RetryService<WireService<HyperClient>>>),
    /// The tower layer over a chain that carries another instance.
    #[cfg(feature = "tower")]
    TowerOverChain(Box<reqwest_safe_retry::RetryService<support::ThroughReqwest>>),
}

#[cfg(feature = "tower")]
type HyperClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    reqwest_safe_retry::body::SendBody<reqwest::Body>,
>;

impl Front {
    /// `inner`: another instance to nest behind the other door, beneath `middleware`.
    /// `busy`: the service beneath the tower layer is not ready when first asked.
    #[cfg_attr(not(feature = "tower"), allow(unused_variables))]
    fn new(
        door: Door,
        middleware: RetryMiddleware,
        wire: Wire,
        measuring: &Measuring,
        inner: Option<RetryMiddleware>,
        busy: bool,
    ) -> Front {
        match (door, inner) {
            #[cfg(feature = "tower")]
            (Door::Reqwest, Some(inner)) => {
                let beneath = WireService {
                    inner: measuring.hyper.clone(),
                    wire: Arc::new(wire),
                    busy,
                };
                let through = support::ThroughTower(tower_layer::Layer::layer(&inner, beneath));
                Front::Reqwest(
                    ClientBuilder::new(measuring.http.clone())
                        .with(middleware)
                        .with(through)
                        .build(),
                )
            }
            #[cfg(feature = "tower")]
            (Door::Tower, Some(inner)) => {
                let chain = ClientBuilder::new(measuring.http.clone())
                    .with(inner)
                    .with(wire)
                    .build();
                let over = support::ThroughReqwest(chain);
                Front::TowerOverChain(Box::new(tower_layer::Layer::layer(&middleware, over)))
            }
            (Door::Reqwest, _) => Front::Reqwest(
                ClientBuilder::new(measuring.http.clone())
                    .with(middleware)
                    .with(wire)
                    .build(),
            ),
            #[cfg(feature = "tower")]
            (Door::Tower, None) => {
                let beneath = WireService {
                    inner: measuring.hyper.clone(),
                    wire: Arc::new(wire),
                    busy,
                };
                Front::Tower(Box::new(tower_layer::Layer::layer(&middleware, beneath)))
            }
        }
    }

    /// Request `r` of the script, `req`, to `url`: how it ended.
    fn send(&self, r: usize, req: &Req, url: &str) -> Pin<Box<dyn Future<Output = End> + Send>> {
        let key = match req.key {
            KeyUse::Callers => Some(format!("caller-{r}")),
            _ => None,
        };
        let natural = (req.key == KeyUse::Natural).then(|| NaturalKey::new(format!("job-{r}")));
        let overriding = req.overriding.map(Over::sent);
        let body = if req.method == reqwest::Method::GET {
            ""
        } else {
            "x"
        };
        match self {
            Front::Reqwest(client) => {
                let mut builder = client
                    .request(req.method.clone(), url)
                    .header("x-req", r.to_string())
                    .body(body);
                if let Some(key) = key {
                    builder = builder.header("idempotency-key", key);
                }
                if let Some(natural) = natural {
                    builder = builder.with_extension(natural);
                }
                if let Some(overriding) = overriding {
                    builder = builder.with_extension(overriding);
                }
                Box::pin(async move {
                    match builder.send().await {
                        Ok(response) => ended(RetryRecord::of(&response)),
                        Err(err) => failed(RetryError::of(&err), &err),
                    }
                })
            }
            #[cfg(feature = "tower")]
            Front::Tower(service) => {
                let service = (**service).clone();
                through_tower(service, r, req, url, key, natural, overriding, body)
            }
            #[cfg(feature = "tower")]
            Front::TowerOverChain(service) => {
                let service = (**service).clone();
                through_tower(service, r, req, url, key, natural, overriding, body)
            }
        }
    }
}

/// `url` (`http://127.0.0.1:<port>/`) as the script writes it: as the URL standard does, or
/// with a port's leading zero, a dot segment, or braces in the path.
fn written(url: &str, how: u64) -> String {
    match how {
        1 => url.replacen("127.0.0.1:", "127.0.0.1:0", 1),
        2 => format!("{url}a/../"),
        3 => format!("{url}{{x}}"),
        _ => url.to_owned(),
    }
}

/// Request `r` through a tower `service` of the layer: how it ended.
#[cfg(feature = "tower")]
#[allow(clippy::too_many_arguments)]
fn through_tower<S, R>(
    mut service: S,
    r: usize,
    req: &Req,
    url: &str,
    key: Option<String>,
    natural: Option<NaturalKey>,
    overriding: Option<RetryOverride>,
    body: &'static str,
) -> Pin<Box<dyn Future<Output = End> + Send>>
where
    S: tower_service::Service<
            http::Request<reqwest::Body>,
            Response = http::Response<R>,
            Error = Box<dyn std::error::Error + Send + Sync>,
        > + Send
        + 'static,
    S::Future: Send,
    R: Send + 'static,
{
    let mut request = http::Request::builder()
        .method(req.method.clone())
        .uri(url)
        .header("x-req", r.to_string());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    if let Some(natural) = natural {
        request = request.extension(natural);
    }
    if let Some(overriding) = overriding {
        request = request.extension(overriding);
    }
    let request = request.body(reqwest::Body::from(body)).unwrap();
    Box::pin(async move {
        std::future::poll_fn(|cx| service.poll_ready(cx))
            .await
            .unwrap();
        match service.call(request).await {
            Ok(response) => ended(RetryRecord::of(&response)),
            Err(err) => failed(RetryError::of_boxed(&err), &*err),
        }
    })
}

/// The end of a request that was answered, by its record.
fn ended(record: Option<RetryRecord>) -> End {
    let Some(record) = record else {
        return End::Other("an answer without a record".into());
    };
    End::Done {
        key: (record.idempotency_key()).map(|k| k.to_str().unwrap().to_owned()),
        attempts: record.attempts(),
        stop: record.stop_reason(),
        answered: true,
    }
}

/// The end of a request that failed: by the middleware's error, if it is one.
fn failed<E>(retry: Option<&RetryError<E>>, err: &dyn std::fmt::Display) -> End {
    match retry {
        Some(retry) => End::Done {
            key: (retry.idempotency_key()).map(|k| k.to_str().unwrap().to_owned()),
            attempts: retry.attempts(),
            stop: retry.stop_reason(),
            answered: false,
        },
        None => End::Other(err.to_string()),
    }
}

async fn run(seed: u64, door: Door, measuring: &mut Measuring) -> Result<(), String> {
    let script = Arc::new(script(seed));
    let c = &script.config;
    let Some(dependency) = dependency(c, measuring).await else {
        return Ok(());
    };
    let clock = measuring.clock.clone();
    let seen: Shared = Arc::default();
    let url = serve(script.clone(), seen.clone(), clock.clone()).await;
    let middleware = RetryMiddleware::new(dependency.clone())
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(seed));
    let wire = Wire {
        script: script.clone(),
        seen: seen.clone(),
        clock: clock.clone(),
    };
    // Behind the other door, an instance with a dependency of its own that would retry
    // everything it saw: it must see nothing.
    let inner = (c.nested && cfg!(feature = "tower")).then(|| {
        let policy = RetryPolicy::builder().max_attempts(5).build().unwrap();
        Dependency::new("inner", policy).without_budget()
    });
    let inner_middleware = inner.clone().map(|inner| {
        RetryMiddleware::new(inner)
            .with_clock(clock.clone())
            .with_rng(SeededRng::new(seed))
    });
    let front = Front::new(
        door,
        middleware,
        wire,
        measuring,
        inner_middleware,
        c.busy_beneath,
    );
    let url = written(&url, c.written);
    let before = dependency.counters();
    let balance = |d: &Dependency| d.budget().map(|b| (b.balance() * 1000.0).round() as u64);
    let balance_before = balance(&dependency);
    let origin = clock.now();
    let mut ends = Vec::new();
    let mut starts = Vec::new();
    for (r, req) in script.requests.iter().enumerate() {
        starts.push(clock.now() - origin);
        let mut sending = front.send(r, req, &url);
        let mut polls = 0;
        let cancelled = || {
            seen.lock()
                .unwrap()
                .copies
                .get(&r)
                .is_some_and(|c| c.cancel)
        };
        let outcome = tokio::time::timeout(
            Duration::from_secs(20),
            std::future::poll_fn(|cx| {
                // Given up after being polled that many times (a future never polled has not
                // begun: it is no request).
                if cancelled() || req.cancel == Cancel::AfterPolls(polls) {
                    return Poll::Ready(None);
                }
                polls += 1;
                sending.as_mut().poll(cx).map(Some)
            }),
        )
        .await
        .map_err(|_| format!("request {r} did not end within 20 s"))?;
        ends.push(outcome.unwrap_or(End::Cancelled));
    }
    // Let copies still in flight on the server be counted.
    tokio::task::yield_now().await;
    let seen = seen.lock().unwrap();
    let after = dependency.counters();
    let arrivals = &seen.arrivals;
    let of = |r: usize| arrivals.iter().filter(move |a| a.request == r);
    let n_requests = script.requests.len() as u64;

    // 1, 2. One layer retries, across the doors too: the inner instance passed every copy.
    if let Some(inner) = &inner {
        let counted = inner.counters();
        if counted.requests != 0 || counted.attempts != 0 {
            return Err(format!(
                "the instance behind the other door counted {counted:?}"
            ));
        }
    }
    // 5. One request per send(), and the copies the server saw were counted.
    if after.requests - before.requests != n_requests {
        return Err(format!("requests {:?} -> {:?}", before, after));
    }
    let copies = (after.attempts - before.attempts) + (after.hedges - before.hedges);
    if copies < arrivals.len() as u64 {
        return Err(format!(
            "{copies} copies counted, {} arrivals",
            arrivals.len()
        ));
    }
    let given_up = ends.iter().any(|e| matches!(e, End::Cancelled));
    if !given_up
        && after.hedges == before.hedges
        && after.attempts - before.attempts != arrivals.len() as u64
    {
        return Err(format!(
            "{} attempts counted, {} arrivals",
            after.attempts - before.attempts,
            arrivals.len()
        ));
    }
    // 2. Arrivals within the logical requests and what the budget paid.
    if let (Some(was), Some(is)) = (balance_before, balance(&dependency)) {
        // Each first-attempt answer deposits 1 milli-token; a copy costs 1,000.
        let paid = (was + n_requests).saturating_sub(is) / 1_000;
        if arrivals.len() as u64 > n_requests + paid {
            return Err(format!(
                "{} arrivals for {n_requests} requests and {paid} tokens paid",
                arrivals.len()
            ));
        }
    }
    for (r, req) in script.requests.iter().enumerate() {
        let mine: Vec<&Arrival> = of(r).collect();
        // 1. Once, for what must not or may not be repeated.
        let keys_on = c.keys || c.attempt_named_like_the_key;
        let keyed = match req.key {
            KeyUse::None => keys_on && req.method == reqwest::Method::POST,
            KeyUse::Callers => keys_on,
            KeyUse::Natural => true,
        };
        let repeatable = keyed || req.method != reqwest::Method::POST;
        let forbidden = match req.overriding {
            Some(Over {
                no_retries: true, ..
            }) => true,
            Some(Over {
                max_attempts: Some(n),
                ..
            }) => n == 1,
            _ => c.max_attempts == 1,
        } || (c.reads_only && req.method != reqwest::Method::GET);
        if (forbidden || !repeatable) && mine.len() > 1 {
            return Err(format!(
                "request {r} ({req:?}) reached the server {} times",
                mine.len()
            ));
        }
        // 3. One key on every copy, the record's.
        if let Some(first) = mine.first() {
            if mine.iter().any(|a| a.key != first.key) {
                let keys: Vec<_> = mine.iter().map(|a| &a.key).collect();
                return Err(format!("request {r}: copies carried {keys:?}"));
            }
            if let End::Done { key, .. } = &ends[r] {
                if keyed && *key != first.key {
                    return Err(format!("request {r}: record {key:?}, sent {:?}", first.key));
                }
            }
        }
        // 4. No time-left header above what is left, at each copy's arrival.
        let deadline = match req.overriding {
            Some(Over {
                deadline: Some(d), ..
            }) => d,
            _ => c.deadline,
        };
        for a in &mine {
            if let Some(left) = a.left {
                let elapsed = a.at - starts[r];
                let truly = deadline.saturating_sub(elapsed).as_millis() as u64;
                if left > truly {
                    return Err(format!("request {r}: x-left {left} with {truly} ms left"));
                }
            }
        }
        // Nothing put on a request is ignored: a copy that took at least the request's own
        // attempt timeout was cut there (a warm latency window's limit does not replace it),
        // so the caller's answer never comes from one. A hedge may answer in its place.
        let own_timeout = req.overriding.and_then(|o| o.attempt_timeout);
        if let (
            Some(own),
            End::Done {
                answered: true,
                attempts,
                ..
            },
            Some(last),
        ) = (own_timeout, &ends[r], mine.last())
        {
            let i = mine.len() - 1;
            let latency = req.latencies[i.min(req.latencies.len() - 1)];
            if !c.hedging && *attempts as usize == mine.len() && latency >= own {
                return Err(format!(
                    "request {r}: answered by a copy that took {latency:?} under its own \
                     attempt timeout of {own:?} (sent at {:?})",
                    last.at
                ));
            }
        }
        // 4. No retry before the floor its answer set; and the reference model of verdicts,
        // where each copy's outcome is known.
        let known = !c.hedging && !c.latency_timeout;
        let mut key_sent = keyed && req.key != KeyUse::None;
        for (i, pair) in mine.windows(2).enumerate() {
            let answered = &req.answers[i.min(req.answers.len() - 1)];
            let latency = req.latencies[i.min(req.latencies.len() - 1)];
            let left = deadline.saturating_sub(pair[0].at - starts[r]);
            let cut = may_be_cut(c, own_timeout, latency, left);
            if c.hedging || cut {
                break;
            }
            if let Some(floor) = answered.floor(c.wait_fields) {
                let waited = pair[1].at.saturating_sub(pair[0].at + latency);
                if waited < floor {
                    return Err(format!(
                        "request {r}: retry {waited:?} after an answer asking for {floor:?}"
                    ));
                }
            }
            if known {
                let verdict = judged(answered, repeatable, keyed, key_sent);
                if verdict != Judged::Transient {
                    return Err(format!(
                        "request {r}: copy {} followed an answer judged {verdict:?}: {answered:?}",
                        i + 1
                    ));
                }
            }
            key_sent = keyed;
        }
        if let (true, End::Done { stop, attempts, .. }, Some(_)) = (known, &ends[r], mine.last()) {
            let i = mine.len() - 1;
            let latency = req.latencies[i.min(req.latencies.len() - 1)];
            let last = mine[i];
            let left = deadline.saturating_sub(last.at - starts[r]);
            let cut = may_be_cut(c, own_timeout, latency, left);
            let complete = *attempts as usize == mine.len();
            if !cut && complete {
                let answered = &req.answers[i.min(req.answers.len() - 1)];
                // 4. A spent quota on the last answer holds the next request's first copy
                // until its reset: on a final answer whatever wait field is beside it, on a
                // transient one unless the policy reads a valid wait field there instead.
                let sent_before = keyed && (i > 0 || req.key != KeyUse::None);
                let transient =
                    judged(answered, repeatable, keyed, sent_before) == Judged::Transient;
                let waits = c.wait_fields && answered.wait().is_some();
                let quota = answered.spent_quota().filter(|_| !(transient && waits));
                let next = of(r + 1).next();
                if let (Some(reset), Some(next)) = (quota, next) {
                    let held = next.at.saturating_sub(last.at + latency);
                    if held < reset {
                        return Err(format!(
                            "request {}: sent {held:?} after an answer whose quota resets in \
                             {reset:?}: {answered:?}",
                            r + 1
                        ));
                    }
                }
                let sent_before = keyed && (i > 0 || req.key != KeyUse::None);
                match judged(answered, repeatable, keyed, sent_before) {
                    Judged::Final(reason) if reason != *stop => {
                        return Err(format!(
                            "request {r}: stopped {stop:?}, the model says {reason:?} of {answered:?}"
                        ));
                    }
                    Judged::Transient if is_final(*stop) => {
                        return Err(format!(
                            "request {r}: stopped {stop:?} on a transient {answered:?}"
                        ));
                    }
                    _ => {}
                }
            }
        }
        if let End::Other(err) = &ends[r] {
            return Err(format!("request {r}: an error not the middleware's: {err}"));
        }
    }
    Ok(())
}

/// Whether a copy that took `latency` may have been cut by its time limit, with `left` of the
/// deadline when it was sent: the fixed timeout, or a measured one of at least 20 ms (twice
/// the warmed window's 10.24 ms, and more as the script's own answers raise it).
///
/// `own`: the request's own attempt timeout (an override's), which replaces both.
fn may_be_cut(c: &Config, own: Option<Duration>, latency: Duration, left: Duration) -> bool {
    let mut limit = own.unwrap_or(c.attempt_timeout).min(left);
    if c.latency_timeout && own.is_none() {
        limit = limit.min(Duration::from_millis(20));
    }
    latency >= limit
}

fn is_final(stop: StopReason) -> bool {
    matches!(
        stop,
        StopReason::Succeeded
            | StopReason::NotRetryable
            | StopReason::NotSafeToRetry
            | StopReason::ServerDeclinedRetry
            | StopReason::ReplayedFailure
    )
}

/// The door script `seed` goes through: with the `tower` feature, the reqwest door for even
/// seeds and the tower door for odd ones (`ACROSS_DOOR=reqwest` or `tower` sends every script
/// through one), so each door meets half the scripts in a run, and a seed repeats through its
/// own door.
fn door_of(seed: u64) -> Door {
    #[cfg(feature = "tower")]
    {
        match std::env::var("ACROSS_DOOR").as_deref() {
            Ok("reqwest") => Door::Reqwest,
            Ok("tower") => Door::Tower,
            _ if seed % 2 == 1 => Door::Tower,
            _ => Door::Reqwest,
        }
    }
    #[cfg(not(feature = "tower"))]
    {
        let _ = seed;
        Door::Reqwest
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_feature_keeps_the_others_promises_over_random_scripts() {
    let started = std::time::Instant::now();
    let scripts = std::env::var("ACROSS_SCRIPTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SCRIPTS);
    let first = std::env::var("ACROSS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut measuring = Measuring {
        clock: FakeClock::new(),
        http: reqwest::Client::new(),
        #[cfg(feature = "tower")]
        hyper: hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http(),
        warmed: HashMap::new(),
    };
    for seed in first..first + scripts {
        let door = door_of(seed);
        if let Err(broken) = run(seed, door, &mut measuring).await {
            panic!("seed {seed}, {door:?} door: {broken}\n{:#?}", script(seed));
        }
    }
    eprintln!("{scripts} scripts in {:?}", started.elapsed());
}
