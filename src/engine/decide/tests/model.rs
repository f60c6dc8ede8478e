//! Model-based test of the decision core: random scripts (policies, budgets, outcomes,
//! `Retry-After` values in seconds and milliseconds, `RateLimit` fields from two origins, attempt
//! durations, oversleeping clocks, an adaptive throttle, cancellations at random points: during
//! a hold, an attempt or a wait) run through the real [`Decider`] and through a small reference model of the contract
//! written from `DESIGN.md`, and every difference, or a broken invariant, fails with the seed
//! that found it and the number of scripts.
//!
//! Each script is a few logical requests that share one budget, one throttle, one quota state
//! and one set of counters, so the deposits, refunds, give-backs, spent quotas, probes and
//! throttle counts of one request change what the next one may do.

use super::*;

const SCRIPTS: u64 = 10_000;

/// SplitMix64: the script generator (not the crate's, so the test does not lean on it); the
/// hedges' model draws its scripts from it too.
pub(super) struct Gen(pub(super) u64);

impl Gen {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=n`.
    pub(super) fn upto(&mut self, n: u64) -> u64 {
        self.next() % (n + 1)
    }

    pub(super) fn chance(&mut self, percent: u64) -> bool {
        self.upto(99) < percent
    }

    fn ms(&mut self, max: u64) -> Duration {
        Duration::from_millis(self.upto(max))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    /// An answer outside the retryable set (a 404).
    Rejected,
    /// A permanent error with no answer (another middleware's, a redirect loop).
    Broken,
    /// 503.
    Unavailable,
    /// 429.
    Throttled,
    /// A transient failure that is not safe to repeat (a 503 to an unkeyed POST).
    Unsafe,
}

impl Outcome {
    fn status(self) -> u16 {
        match self {
            Outcome::Ok => 200,
            Outcome::Rejected => 404,
            Outcome::Broken => 0,
            Outcome::Unavailable | Outcome::Unsafe => 503,
            Outcome::Throttled => 429,
        }
    }
}

#[derive(Debug, Clone)]
struct Step {
    outcome: Outcome,
    /// How long the attempt takes if nothing cuts it.
    takes: Duration,
    /// `Retry-After` in seconds, or garbage.
    retry_after: Option<Result<u64, &'static str>>,
    /// `retry-after-ms` (or Azure's `x-ms-retry-after-ms`, when `true`) in milliseconds, or
    /// garbage: read before `Retry-After`.
    retry_after_ms: Option<(Result<u64, &'static str>, bool)>,
    /// A `RateLimit` field on the answer: remaining, and seconds to the reset.
    rate_limit: Option<(u64, u64)>,
    /// A `RateLimit` field (remaining, reset) that another request to the same origin got
    /// while this one waits after this step.
    meanwhile: Option<(u64, u64)>,
    can_resend: bool,
    /// The raw value the random source gives the core for this step's draws (hold and backoff
    /// jitter, the throttle's draw).
    draw: u64,
    /// How much longer than asked the wait after this step takes (a real clock oversleeping).
    overslept: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cancel {
    /// The caller drops the request during a hold before attempt `n` (1-based).
    Holding(u32),
    /// The caller drops the request while attempt `n` is on the wire.
    Sending(u32),
    /// The caller drops the request during the wait after attempt `n`.
    Waiting(u32),
}

#[derive(Debug, Clone)]
struct Request {
    /// Time passed since the previous request ended.
    gap: Duration,
    /// Which of the two origins it goes to.
    origin: usize,
    retries_disabled: bool,
    steps: Vec<Step>,
    cancel: Option<Cancel>,
}

#[derive(Debug, Clone, Copy)]
struct BudgetSpec {
    capacity: u64,
    initial: u64,
    timeout_cost: u64,
    refund: bool,
}

#[derive(Debug, Clone)]
struct Script {
    max_attempts: u32,
    base: Duration,
    cap: Duration,
    attempt_timeout: Duration,
    deadline: Duration,
    max_retry_after: Duration,
    jitter_above_floor: bool,
    rate_limit_fields: bool,
    budget: Option<BudgetSpec>,
    /// The throttle's K, if the dependency has one.
    throttle: Option<f64>,
    /// The driver first asks for a stop that needs no time, as the middleware does; else it
    /// always hands the time.
    quick_stops: bool,
    requests: Vec<Request>,
}

const ORIGINS: [&str; 2] = ["http://a.test/x", "http://b.test:8080/y"];

fn script(seed: u64) -> Script {
    let mut g = Gen(seed);
    let deadline = Duration::from_millis(50) + g.ms(20_000);
    // Valid policies only: the base below the deadline, no longer Retry-After than it.
    let base = g.ms(2_000).min(deadline - Duration::from_millis(1));
    let cap = base + g.ms(5_000);
    let budget = g.chance(80).then(|| {
        let capacity = 2 + g.upto(3);
        BudgetSpec {
            capacity,
            initial: g.upto(capacity),
            timeout_cost: 1 + g.upto(1),
            refund: g.chance(50),
        }
    });
    let throttle = g.chance(40).then(|| [1.0, 1.5, 2.0][g.upto(2) as usize]);
    let max_attempts = 1 + g.upto(5) as u32;
    let requests = (0..1 + g.upto(5))
        .map(|_| {
            let steps = (0..max_attempts)
                .map(|_| Step {
                    outcome: match g.upto(9) {
                        0..=1 => Outcome::Ok,
                        2 => Outcome::Rejected,
                        3 => Outcome::Broken,
                        4..=6 => Outcome::Unavailable,
                        7 => Outcome::Throttled,
                        _ => Outcome::Unsafe,
                    },
                    takes: if g.chance(15) {
                        g.ms(12_000)
                    } else {
                        g.ms(300)
                    },
                    retry_after: match g.upto(9) {
                        0..=1 => Some(Ok(g.upto(40))),
                        2 => Some(Err(["-1", "soon", "1.5", ""][g.upto(3) as usize])),
                        _ => None,
                    },
                    retry_after_ms: match g.upto(9) {
                        0..=1 => Some((Ok(g.upto(40_000)), g.chance(50))),
                        2 => Some((Err(["-1", "1e3", "1.", "soon"][g.upto(3) as usize]), false)),
                        _ => None,
                    },
                    rate_limit: match g.upto(9) {
                        // Spent: soon, past the belief, a day away, or with nothing to wait for.
                        0..=2 => Some((0, g.upto(20))),
                        3 => Some((0, 30 + g.upto(100))),
                        4 => Some((0, [0, 86_400, 999_999][g.upto(2) as usize])),
                        5 => Some((1 + g.upto(9), g.upto(60))),
                        _ => None,
                    },
                    meanwhile: g.chance(15).then(|| (g.upto(1) * 5, g.upto(8))),
                    can_resend: g.chance(95),
                    draw: match g.upto(3) {
                        0 => 0,
                        1 => u64::MAX,
                        _ => g.next(),
                    },
                    overslept: if g.chance(10) { g.ms(20_000) } else { g.ms(2) },
                })
                .collect();
            let n = 1 + g.upto(u64::from(max_attempts)) as u32;
            let cancel = match g.upto(19) {
                0..=1 => Some(Cancel::Sending(n)),
                2..=4 => Some(Cancel::Waiting(n)),
                5..=8 => Some(Cancel::Holding(n)),
                _ => None,
            };
            Request {
                gap: match g.upto(3) {
                    0 => Duration::ZERO,
                    1 => g.ms(5_000),
                    _ => g.ms(90_000),
                },
                origin: g.upto(1) as usize,
                retries_disabled: g.chance(10),
                steps,
                cancel,
            }
        })
        .collect();
    Script {
        max_attempts,
        base,
        cap,
        attempt_timeout: Duration::from_millis(10) + g.ms(5_000),
        deadline,
        max_retry_after: g.ms(30_000).min(deadline),
        jitter_above_floor: g.chance(70),
        rate_limit_fields: g.chance(85),
        budget,
        throttle,
        quick_stops: g.chance(70),
        requests,
    }
}

const MILLI: u64 = 1_000;

/// What one logical request did, as seen from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Trace {
    /// Per attempt: its start and its timeout, in time since the request began.
    attempts: Vec<(Duration, Duration)>,
    /// Per wait: its length.
    sleeps: Vec<Duration>,
    /// Per hold: its start, in time since the request began, and its length.
    holds: Vec<(Duration, Duration)>,
    /// Attempts sent as the probe of a spent quota no longer believed.
    probes: u32,
    /// `None` when the caller dropped the request.
    stop: Option<StopReason>,
}

impl Trace {
    fn new() -> Trace {
        Trace {
            attempts: Vec::new(),
            sleeps: Vec::new(),
            holds: Vec::new(),
            probes: 0,
            stop: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    traces: Vec<Trace>,
    counts: CounterSnapshot,
    balance: Option<u64>,
    budget_retries: Option<u64>,
    budget_refusals: Option<u64>,
    /// The throttle's `(requests, accepts)` at the end.
    throttle: Option<(u64, u64)>,
    /// How long each origin's quota would hold a retry at the end.
    quota: [Option<Duration>; 2],
}

/// The floor a step's answer asks for: its valid millisecond field, else its valid
/// `Retry-After`.
fn asked_floor(step: &Step) -> Option<Duration> {
    let millis = step.retry_after_ms.and_then(|(v, _)| v.ok());
    let secs = step.retry_after.and_then(Result::ok);
    millis
        .map(Duration::from_millis)
        .or(secs.map(Duration::from_secs))
}

/// The headers of a step's answer.
fn headers(step: &Step) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(v) = step.retry_after {
        let value = match v {
            Ok(secs) => HeaderValue::from_str(&secs.to_string()).unwrap(),
            Err(garbage) => HeaderValue::from_static(garbage),
        };
        headers.insert(http::header::RETRY_AFTER, value);
    }
    if let Some((v, azure)) = step.retry_after_ms {
        let value = match v {
            Ok(ms) => HeaderValue::from_str(&ms.to_string()).unwrap(),
            Err(garbage) => HeaderValue::from_static(garbage),
        };
        let name = if azure {
            "x-ms-retry-after-ms"
        } else {
            "retry-after-ms"
        };
        headers.insert(name, value);
    }
    if let Some((r, t)) = step.rate_limit {
        let value = format!("\"q\";r={r};t={t}");
        headers.insert("ratelimit", HeaderValue::from_str(&value).unwrap());
    }
    headers
}

/// The verdict `classify` gives an outcome, and whether the dependency answered.
fn judged(outcome: Outcome, timed_out: bool) -> (Verdict, bool) {
    if timed_out {
        return (Verdict::Transient(Cause::Fault(Fault::Timeout)), false);
    }
    match outcome {
        Outcome::Ok => (Verdict::Final(StopReason::Succeeded), true),
        Outcome::Rejected => (Verdict::Final(StopReason::NotRetryable), true),
        Outcome::Broken => (Verdict::Final(StopReason::NotRetryable), false),
        Outcome::Unavailable => (Verdict::Transient(Cause::Status { throttled: false }), true),
        Outcome::Throttled => (Verdict::Transient(Cause::Status { throttled: true }), true),
        Outcome::Unsafe => (Verdict::Final(StopReason::NotSafeToRetry), true),
    }
}

/// A throttle whose window outlasts every script: its counts are plain totals. (Its slices
/// outlast every attempt, so attempts are counted at their admission; the other case is
/// `quota::a_throttle_with_slices_shorter_than_an_attempt_counts_it_at_its_end`.)
fn long_throttle(k: f64) -> AdaptiveThrottle {
    AdaptiveThrottle::builder()
        .window(Duration::from_secs(12 * 3_600))
        .k(k)
        .build()
        .unwrap()
}

/// Runs the script through the real decision core, as the middleware drives it.
fn real(s: &Script) -> Run {
    let policy = RetryPolicy::builder()
        .max_attempts(s.max_attempts)
        .base_delay(s.base)
        .max_delay(s.cap)
        .attempt_timeout(s.attempt_timeout)
        .deadline(s.deadline)
        .max_retry_after(s.max_retry_after)
        .retry_after_jitter(s.jitter_above_floor)
        .rate_limit_fields(s.rate_limit_fields)
        .build()
        .unwrap();
    let budget = s.budget.map(|b| {
        RetryBudget::builder()
            .capacity(b.capacity as f64)
            .initial(b.initial as f64)
            .retry_cost(1.0)
            .timeout_cost(b.timeout_cost as f64)
            .throttled_cost(1.0)
            .deposit_ratio(0.5)
            .refund_on_success(b.refund)
            .floor_per_sec(0.0)
            .build()
            .unwrap()
    });
    let mut setup = Setup::new(policy, budget);
    setup.throttle = s.throttle.map(long_throttle);
    let urls = ORIGINS.map(target);
    let mut traces = Vec::new();
    for request in &s.requests {
        setup.time.advance(request.gap);
        let url = &urls[request.origin];
        let began = setup.time.now();
        let since = |t: &Time| t.now() - began;
        let mut trace = Trace::new();
        let mut d = Decider::start(
            &setup.policy,
            setup.accounts(),
            if request.retries_disabled {
                Cap::NoRetries
            } else {
                Cap::Policy
            },
            &http::Method::GET,
            began,
        );
        // Bounded: each pass makes an attempt, holds or stops, and a request has at most six
        // attempts and a hold or two before each.
        for _ in 0..64 {
            let n = d.attempts() + 1;
            let step = &request.steps[(n - 1).min(s.max_attempts - 1) as usize];
            let draw = step.draw;
            let rng = move || draw;
            let timeout = match d.next_attempt(setup.time.now(), Some(url), &rng) {
                Next::Send(timeout) => timeout,
                Next::Hold(hold) => {
                    trace.holds.push((since(&setup.time), hold));
                    if request.cancel == Some(Cancel::Holding(n)) {
                        break;
                    }
                    setup.time.advance(hold);
                    continue;
                }
                Next::Stop(stop) => {
                    trace.stop = Some(stop);
                    break;
                }
            };
            trace.probes += u32::from(d.probe.is_some());
            let can_resend = step.can_resend && d.may_retry_after_next();
            d.attempt_started();
            trace.attempts.push((since(&setup.time), timeout));
            if request.cancel == Some(Cancel::Sending(n)) {
                break;
            }
            let timed_out = step.takes > timeout;
            setup.time.advance(step.takes.min(timeout));
            let (verdict, answered) = judged(step.outcome, timed_out);
            let headers = headers(step);
            let answer = answered.then(|| Answer {
                status: StatusCode::from_u16(step.outcome.status()).unwrap(),
                headers: &headers,
                from: url,
            });
            let observed = Observed {
                verdict,
                answer,
                resend: can_resend.then_some(url),
                timed_out,
                // The model draws HTTP policies, which never retry transparently.
                unsent: false,
            };
            let quick = if s.quick_stops {
                d.stop_without_time(&observed).map(Wait::Stop)
            } else {
                None
            };
            let next = quick.unwrap_or_else(|| {
                d.after_attempt(observed, setup.time.now(), &|| setup.time.wall, &rng)
            });
            match next {
                Wait::Stop(stop) => {
                    trace.stop = Some(stop);
                    break;
                }
                Wait::Sleep(delay) => {
                    trace.sleeps.push(delay);
                    if let Some((r, t)) = step.meanwhile {
                        let said =
                            crate::engine::rate_limit::parse(format!("q;r={r};t={t}").as_bytes());
                        let origin = crate::engine::rate_limit::Origin::of(*url);
                        setup.quota.update(&origin, said, setup.time.now());
                    }
                    if request.cancel == Some(Cancel::Waiting(n)) {
                        break;
                    }
                    setup.time.advance(delay + step.overslept);
                }
            }
        }
        drop(d);
        traces.push(trace);
    }
    let now = setup.time.now();
    let origins = urls.map(crate::engine::rate_limit::Origin::of);
    Run {
        traces,
        counts: setup.counts(),
        balance: setup.budget.as_ref().map(RetryBudget::balance_milli),
        budget_retries: setup.budget.as_ref().map(RetryBudget::retries),
        budget_refusals: setup.budget.as_ref().map(RetryBudget::refusals),
        throttle: setup.throttle.as_ref().map(|t| t.counts(now)),
        quota: origins.map(|o| setup.quota.floor(&o, now)),
    }
}

/// One origin's spent quota in the model: its reset, and until when it is believed.
#[derive(Debug, Clone, Copy)]
struct Spent {
    until: Duration,
    believed: Duration,
}

/// The model's view of one script's shared state; times are since the script began.
struct World {
    balance: Option<u64>,
    capacity: u64,
    counts: CounterSnapshot,
    budget_retries: u64,
    budget_refusals: u64,
    /// The throttle's requests and accepts.
    throttle: (u64, u64),
    quota: [Option<Spent>; 2],
}

impl World {
    /// The origin's quota, if it has not reset by `t`.
    fn spent(&mut self, origin: usize, t: Duration) -> Option<&mut Spent> {
        if self.quota[origin].is_some_and(|q| q.until <= t) {
            self.quota[origin] = None;
        }
        self.quota[origin].as_mut()
    }

    /// How long the origin's quota holds a request at `t`, if at all.
    fn hold(&mut self, origin: usize, t: Duration) -> Option<Duration> {
        self.spent(origin, t)
            .map(|q| q.until.min(q.believed).saturating_sub(t))
            .filter(|h| !h.is_zero())
    }

    fn give_back(&mut self, pending: &mut Option<(u64, bool)>) {
        if let (Some(b), Some((cost, _))) = (&mut self.balance, pending.take()) {
            *b = (*b + cost).min(self.capacity);
            self.budget_retries -= 1;
        }
    }

    /// A `RateLimit` field (remaining, reset) from `origin` at `now`.
    fn said(&mut self, origin: usize, (remaining, reset): (u64, u64), now: Duration) {
        self.quota[origin] = (remaining == 0 && reset > 0).then(|| {
            let reset = Duration::from_secs(reset.min(86_400));
            Spent {
                until: now + reset,
                believed: now + reset.min(BELIEF),
            }
        });
    }

    /// A probe that got no answer comes back: the belief it replaced stands again.
    fn return_probe(&mut self, origin: usize, ticket: &mut Option<(Duration, Duration)>) {
        if let Some((was, set)) = ticket.take() {
            if let Some(q) = self.quota[origin].as_mut().filter(|q| q.believed == set) {
                q.believed = was;
            }
        }
    }
}

/// The backoff's full jitter for retry `retry` from a raw draw.
fn jitter(s: &Script, retry: u32, draw: u64) -> Duration {
    let ceiling = s
        .base
        .saturating_mul(1u32.checked_shl(retry).unwrap_or(u32::MAX))
        .min(s.cap);
    let nanos = u64::try_from(ceiling.as_nanos()).unwrap();
    Duration::from_nanos(((u128::from(draw) * (u128::from(nanos) + 1)) >> 64) as u64)
}

/// The contract, restated plainly: what the script must do.
/// How long a spent quota is believed at a time.
const BELIEF: Duration = Duration::from_secs(60);

fn model(s: &Script) -> Run {
    let mut w = World {
        balance: s.budget.map(|b| b.initial * MILLI),
        capacity: s.budget.map_or(0, |b| b.capacity * MILLI),
        counts: CounterSnapshot::default(),
        budget_retries: 0,
        budget_refusals: 0,
        throttle: (0, 0),
        quota: [None, None],
    };
    let mut clock = Duration::ZERO;
    let mut traces = Vec::new();
    for request in &s.requests {
        clock += request.gap;
        let began = clock;
        let o = request.origin;
        w.counts.requests += 1;
        let mut trace = Trace::new();
        let max = if request.retries_disabled {
            1
        } else {
            s.max_attempts
        };
        // Time since the request began.
        let mut t = Duration::ZERO;
        // A retry paid for and not yet started: (its cost, whether it honours a floor).
        let mut pending: Option<(u64, bool)> = None;
        let mut last_cost = 0;
        'attempts: for n in 1..=max {
            let step = &request.steps[(n - 1) as usize];
            let u = ((step.draw >> 32) as f64) / 4_294_967_296.0;
            // Before the attempt: the deadline, the quota (holds, a probe), the throttle.
            let mut ticket: Option<(Duration, Duration)> = None;
            let left = loop {
                let left = s.deadline.saturating_sub(t);
                if left.is_zero() {
                    w.give_back(&mut pending);
                    w.counts.deadline_stops += 1;
                    trace.stop = Some(StopReason::DeadlineReached);
                    break 'attempts;
                }
                let now = began + t;
                if s.rate_limit_fields {
                    if let Some(q) = w.spent(o, now) {
                        if now >= q.believed {
                            ticket = Some((q.believed, now + BELIEF));
                            q.believed = now + BELIEF;
                        } else {
                            let hold = q.until.min(q.believed) - now;
                            if hold > s.max_retry_after || hold >= left {
                                w.give_back(&mut pending);
                                trace.stop = Some(StopReason::QuotaExhausted);
                                break 'attempts;
                            }
                            let retry = (n - 1).saturating_sub(1);
                            let hold = if s.jitter_above_floor {
                                hold + jitter(s, retry, step.draw).min((left - hold) / 2)
                            } else {
                                hold
                            };
                            trace.holds.push((t, hold));
                            if request.cancel == Some(Cancel::Holding(n)) {
                                w.give_back(&mut pending);
                                break 'attempts;
                            }
                            t += hold;
                            continue;
                        }
                    }
                }
                if let Some(k) = s.throttle {
                    let (asked, accepted) = w.throttle;
                    let p = ((asked as f64 - k * accepted as f64) / (asked as f64 + 1.0)).max(0.0);
                    if p > 0.0 && u < p {
                        w.throttle.0 += 1;
                        w.counts.throttled += 1;
                        w.give_back(&mut pending);
                        w.return_probe(o, &mut ticket);
                        trace.stop = Some(StopReason::Throttled);
                        break 'attempts;
                    }
                }
                break left;
            };
            let timeout = s.attempt_timeout.min(left);
            trace.probes += u32::from(ticket.is_some());
            if let Some((cost, floor)) = pending.take() {
                w.counts.retries += 1;
                w.counts.retry_after_honoured += u64::from(floor);
                last_cost = cost;
            }
            w.counts.attempts += 1;
            trace.attempts.push((t, timeout));
            if request.cancel == Some(Cancel::Sending(n)) {
                // On the wire when the caller gave up: no accept; the probe comes back.
                if s.throttle.is_some() {
                    w.throttle.0 += 1;
                }
                w.return_probe(o, &mut ticket);
                break;
            }
            let timed_out = step.takes > timeout;
            t += step.takes.min(timeout);
            let now = began + t;
            let (retryable, kind, answered, stop) = match (timed_out, step.outcome) {
                (true, _) => (true, Some(RetryKind::Timeout), false, None),
                (_, Outcome::Ok) => (false, None, true, Some(StopReason::Succeeded)),
                (_, Outcome::Rejected) => (false, None, true, Some(StopReason::NotRetryable)),
                (_, Outcome::Broken) => (false, None, false, Some(StopReason::NotRetryable)),
                (_, Outcome::Unsafe) => (false, None, true, Some(StopReason::NotSafeToRetry)),
                (_, Outcome::Unavailable) => (true, Some(RetryKind::Other), true, None),
                (_, Outcome::Throttled) => (true, Some(RetryKind::Throttled), true, None),
            };
            if s.throttle.is_some() {
                let accepted = answered && matches!(step.outcome, Outcome::Ok | Outcome::Rejected);
                w.throttle.0 += 1;
                w.throttle.1 += u64::from(accepted);
            }
            if s.rate_limit_fields && answered {
                if let Some((_, set)) = ticket.take() {
                    if w.spent(o, now).is_some_and(|q| q.believed == set) {
                        w.quota[o] = None;
                    }
                }
                // A valid Retry-After (in seconds or milliseconds) on the same transient answer
                // takes precedence over the field; one that cannot be read is absent, and on a
                // final answer none is read.
                let asked = retryable && asked_floor(step).is_some();
                if let Some(said) = step.rate_limit.filter(|_| !asked) {
                    w.said(o, said, now);
                }
            }
            if !retryable {
                let stop = stop.unwrap();
                if let Some(b) = &mut w.balance {
                    let earned = matches!(stop, StopReason::Succeeded | StopReason::NotRetryable);
                    if n == 1 && answered && earned {
                        *b = (*b + MILLI / 2).min(w.capacity.max(*b));
                    }
                    if n > 1 && stop == StopReason::Succeeded && s.budget.unwrap().refund {
                        *b = (*b + last_cost).min(w.capacity);
                    }
                }
                trace.stop = Some(stop);
                break;
            }
            let left = s.deadline.saturating_sub(t);
            let stop = if request.retries_disabled {
                StopReason::RetriesDisabled
            } else if n >= max {
                StopReason::AttemptsExhausted
            } else if !step.can_resend {
                StopReason::BodyNotCloneable
            } else if left.is_zero() {
                StopReason::DeadlineReached
            } else {
                let retry_after = asked_floor(step).filter(|_| answered);
                let quota = if s.rate_limit_fields {
                    w.hold(o, now)
                } else {
                    None
                };
                let floor = retry_after.max(quota);
                let jitter = jitter(s, n - 1, step.draw);
                let wait = match floor {
                    Some(f) if f > s.max_retry_after || f >= left => Err(if quota > retry_after {
                        StopReason::QuotaExhausted
                    } else {
                        StopReason::RetryAfterTooLong
                    }),
                    Some(f) if !s.jitter_above_floor => Ok(f),
                    Some(f) => Ok(f + jitter.min((left - f) / 2)),
                    None if jitter >= left => Err(StopReason::DeadlineReached),
                    None => Ok(jitter),
                };
                match wait {
                    Err(stop) => stop,
                    Ok(wait) => {
                        let cost = match (kind.unwrap(), s.budget) {
                            (_, None) => 0,
                            (RetryKind::Timeout, Some(b)) => b.timeout_cost * MILLI,
                            _ => MILLI,
                        };
                        let paid = match &mut w.balance {
                            None => true,
                            Some(b) if *b >= cost => {
                                *b -= cost;
                                w.budget_retries += 1;
                                true
                            }
                            Some(_) => false,
                        };
                        if paid {
                            trace.sleeps.push(wait);
                            if let Some(said) = step.meanwhile {
                                w.said(o, said, now);
                            }
                            pending = Some((cost, floor.is_some()));
                            if request.cancel == Some(Cancel::Waiting(n)) {
                                // Dropped while waiting: the guard gives the tokens back.
                                w.give_back(&mut pending);
                                break;
                            }
                            t += wait + step.overslept;
                            continue;
                        }
                        w.budget_refusals += 1;
                        w.counts.budget_refusals += 1;
                        StopReason::BudgetExhausted
                    }
                }
            };
            if stop == StopReason::DeadlineReached {
                w.counts.deadline_stops += 1;
            }
            trace.stop = Some(stop);
            break;
        }
        clock = began + t;
        traces.push(trace);
    }
    Run {
        traces,
        counts: w.counts,
        balance: w.balance,
        budget_retries: s.budget.map(|_| w.budget_retries),
        budget_refusals: s.budget.map(|_| w.budget_refusals),
        throttle: s.throttle.map(|_| w.throttle),
        quota: [w.hold(0, clock), w.hold(1, clock)],
    }
}

/// Properties that must hold whatever the model says.
fn check_invariants(s: &Script, run: &Run) -> Result<(), String> {
    for (request, trace) in s.requests.iter().zip(&run.traces) {
        let max = if request.retries_disabled {
            1
        } else {
            s.max_attempts
        };
        if trace.attempts.len() > max as usize {
            return Err(format!("{} attempts, at most {max}", trace.attempts.len()));
        }
        for &(start, hold) in &trace.holds {
            if start + hold >= s.deadline {
                return Err(format!(
                    "a hold from {start:?} ends at or past the deadline"
                ));
            }
        }
        for (i, &(start, timeout)) in trace.attempts.iter().enumerate() {
            if start + timeout > s.deadline {
                return Err(format!("attempt {} may run past the deadline", i + 1));
            }
            if i > 0 {
                let (previous, _) = trace.attempts[i - 1];
                let step = &request.steps[i - 1];
                let took = step.takes.min(trace.attempts[i - 1].1);
                let wait = trace.sleeps[i - 1];
                if previous + took + wait >= s.deadline {
                    return Err(format!("wait {i} ends at or past the deadline"));
                }
                let floor = match (asked_floor(step), step.takes > trace.attempts[i - 1].1) {
                    (Some(floor), false) => floor,
                    _ => Duration::ZERO,
                };
                if start < previous + took + floor {
                    return Err(format!("attempt {} starts before its floor", i + 1));
                }
            }
        }
    }
    if let (Some(paid), c) = (run.budget_retries, run.counts) {
        // Tokens pay for retries that started, and for nothing else.
        if paid != c.retries {
            return Err(format!("budget paid {paid} retries, {} started", c.retries));
        }
    }
    if let Some((asked, accepted)) = run.throttle {
        // Every attempt sent and every rejection is a request to the throttle, once.
        if asked != run.counts.attempts + run.counts.throttled || accepted > asked {
            return Err(format!(
                "throttle counted ({asked}, {accepted}) for {} attempts and {} rejections",
                run.counts.attempts, run.counts.throttled
            ));
        }
    }
    Ok(())
}

#[test]
fn ten_thousand_scripts_match_the_model_of_the_contract() {
    let mut checked = 0;
    for seed in 0..SCRIPTS {
        let s = script(seed);
        let got = real(&s);
        let want = model(&s);
        assert_eq!(
            got, want,
            "seed {seed} of {SCRIPTS} scripts: the core differs from the model\n{s:#?}"
        );
        if let Err(broken) = check_invariants(&s, &got) {
            panic!("seed {seed} of {SCRIPTS} scripts: {broken}\n{s:#?}\n{got:#?}");
        }
        // The same seed gives the same schedule.
        assert_eq!(
            real(&script(seed)),
            got,
            "seed {seed} of {SCRIPTS} scripts: not reproducible"
        );
        checked += 1;
    }
    assert_eq!(checked, SCRIPTS);
}

#[test]
fn the_scripts_reach_every_stop_reason_every_cancellation_and_every_quota_event() {
    // A model test is only as good as the cases it reaches.
    let mut seen = std::collections::HashSet::new();
    let (mut dropped_waiting, mut dropped_sending, mut dropped_holding) = (0, 0, 0);
    let (mut holds, mut held_retries, mut rejected, mut probes) = (0, 0, 0, 0);
    for seed in 0..SCRIPTS {
        let s = script(seed);
        let run = real(&s);
        rejected += run.counts.throttled;
        for (request, trace) in s.requests.iter().zip(&run.traces) {
            holds += trace.holds.len();
            probes += trace.probes;
            held_retries += trace
                .holds
                .iter()
                .filter(|(start, _)| trace.attempts.first().is_some_and(|(a, _)| start > a))
                .count();
            match trace.stop {
                Some(stop) => {
                    seen.insert(stop);
                }
                None => match request.cancel {
                    Some(Cancel::Waiting(_)) => dropped_waiting += 1,
                    Some(Cancel::Sending(_)) => dropped_sending += 1,
                    Some(Cancel::Holding(_)) => dropped_holding += 1,
                    None => unreachable!("a trace without a stop was cancelled"),
                },
            }
        }
    }
    for stop in [
        StopReason::Succeeded,
        StopReason::NotRetryable,
        StopReason::NotSafeToRetry,
        StopReason::BodyNotCloneable,
        StopReason::AttemptsExhausted,
        StopReason::DeadlineReached,
        StopReason::RetryAfterTooLong,
        StopReason::BudgetExhausted,
        StopReason::RetriesDisabled,
        StopReason::QuotaExhausted,
        StopReason::Throttled,
    ] {
        assert!(seen.contains(&stop), "no script reached {stop:?}");
    }
    assert!(dropped_waiting > 100, "{dropped_waiting}");
    assert!(dropped_sending > 100, "{dropped_sending}");
    assert!(dropped_holding > 15, "{dropped_holding}");
    assert!(holds > 400, "{holds}");
    assert!(held_retries > 50, "{held_retries}");
    assert!(rejected > 100, "{rejected}");
    assert!(probes > 200, "{probes}");
}
