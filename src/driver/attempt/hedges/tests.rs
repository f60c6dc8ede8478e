//! A hedged gRPC call against a small reference model of A6's hedging, on no socket: random
//! scripts of what each copy answers and when, a `FakeClock` moved 10 ms at a time, and a
//! door whose copies answer when the script says. The model says when each copy goes (to the
//! tick), which copy's answer the call ends with and why, how many copies are cancelled, and
//! the throttling's or the budget's tokens; each copy carries `grpc-previous-rpc-attempts`.
//! Some scripts drop the call at a tick: every copy out is cancelled then, and the tokens stay
//! as the answers before it left them. Some give the call a deadline (a per-call override):
//! no copy goes at or past it, and the call ends there, `DeadlineReached`, with a copy cut at
//! its limit or the last failure; some an override of the attempts; some a small budget in
//! the throttling's place. A failure names its seed: `HEDGE_SEED=N HEDGE_SCRIPTS=M` runs `M`
//! scripts from seed `N`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};

use crate::driver::middleware::RetryMiddleware;
use crate::driver::scripted::Scripted;
use crate::engine::budget::RetryBudget;
use crate::engine::dependency::RetryOverride;
use crate::engine::grpc::config::GrpcConfig;
use crate::engine::grpc::hedging::GrpcHedgingPolicy;
use crate::engine::grpc::throttle::RetryThrottling;
use crate::fake_clock::FakeClock;
use crate::record::RetryRecord;
use crate::rng::RandomSource;
use crate::rng::SeededRng;
use crate::stop::StopReason;

/// One tick of the fake clock.
const TICK: Duration = Duration::from_millis(10);
/// The ticks a script runs for, at most.
const TICKS: u64 = 400;

/// What one copy's server does.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Says {
    /// Response headers: the call is committed.
    Committed,
    /// A trailers-only `OK`.
    Ok,
    /// A trailers-only failure with this code, and a pushback (ticks), or `-1`.
    Fails(u8, Push),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Push {
    None,
    Wait(u64),
    Stop,
}

#[derive(Debug, Clone)]
struct Script {
    max: u32,
    delay: u64,
    non_fatal: Vec<u8>,
    throttling: Option<(u64, f64)>,
    /// Without throttling: a budget of this many tokens (a copy costs one, none is earned).
    budget: Option<u64>,
    /// The call's deadline, in ticks (a per-call override).
    deadline: Option<u64>,
    /// A per-call override of the attempts, in place of `max`.
    attempts: Option<u32>,
    /// Per copy, in the order sent: after how many ticks it answers (never, if `None`), and
    /// what it says.
    copies: Vec<(Option<u64>, Says)>,
    /// The caller drops the call at the start of this tick, before the clock moves to it.
    drop_at: Option<u64>,
}

struct Gen(SeededRng);

impl Gen {
    fn upto(&mut self, n: u64) -> u64 {
        self.0.next_u64() % (n + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.upto(99) < percent
    }
}

fn script(seed: u64) -> Script {
    let mut g = Gen(SeededRng::new(seed));
    let max = 2 + g.upto(3) as u32;
    let delay = [0, 1, 2, 5, 20][g.upto(4) as usize];
    let non_fatal = if g.chance(50) { vec![14] } else { vec![14, 10] };
    let throttling = g
        .chance(40)
        .then(|| (2 + g.upto(4), (1 + g.upto(8)) as f64 / 10.0));
    let budget = (throttling.is_none() && g.chance(40)).then(|| g.upto(3));
    let deadline = g.chance(35).then(|| 1 + g.upto(30));
    let attempts = g.chance(20).then(|| 1 + g.upto(5) as u32);
    let copies = (0..max.max(attempts.unwrap_or(0)))
        .map(|_| {
            let after = (!g.chance(15)).then(|| g.upto(12));
            let says = match g.upto(99) {
                0..15 => Says::Committed,
                15..25 => Says::Ok,
                25..35 => Says::Fails(3, Push::None),
                _ => {
                    let code = if g.chance(70) { 14 } else { 10 };
                    let push = match g.upto(99) {
                        0..60 => Push::None,
                        60..85 => Push::Wait(g.upto(5)),
                        _ => Push::Stop,
                    };
                    Says::Fails(code, push)
                }
            };
            (after, says)
        })
        .collect();
    let drop_at = g.chance(30).then(|| 1 + g.upto(40));
    Script {
        max,
        delay,
        non_fatal,
        throttling,
        budget,
        deadline,
        attempts,
        copies,
        drop_at,
    }
}

/// What a script ends in.
#[derive(Debug, Clone, PartialEq)]
struct Ending {
    /// The tick each copy went at.
    sent: Vec<u64>,
    /// The copy whose answer the call ended with ([`CUT`]: a copy cut at the deadline), and
    /// why; `None` if it had not ended (or was dropped first).
    ended: Option<(usize, StopReason)>,
    /// Copies cancelled: out when the call ended, or when it was dropped.
    cancelled: usize,
    /// The throttling's tokens, in thousandths.
    tokens: Option<u64>,
    /// The budget's tokens, in thousandths.
    budget: Option<u64>,
}

/// The copy a call ended with when a copy was cut at the deadline (its outcome is the layer's
/// timeout, not an answer).
const CUT: usize = usize::MAX;

/// A6's hedging, tick by tick: the reference.
fn model(s: &Script) -> Ending {
    let delay = s.delay;
    let max = s.attempts.unwrap_or(s.max);
    let mut sent: Vec<u64> = vec![0];
    let mut done: Vec<bool> = vec![false];
    let mut next = Some(delay);
    let mut closed: Option<StopReason> = None;
    let mut tokens = s.throttling.map(|(max, _)| max * 1000);
    let mut budget = s.budget.map(|b| b * 1000);
    let mut last = 0;
    let out = |done: &Vec<bool>| done.iter().filter(|d| !**d).count();
    let capacity = s.budget.map(|b| b.max(1) * 1000);
    let end = |sent: Vec<u64>, done: &Vec<bool>, at: usize, why, tokens, budget: Option<u64>| {
        // A first copy the server answered (and no other) earns a tenth of a token.
        let earned = sent.len() == 1
            && matches!(
                why,
                StopReason::Succeeded | StopReason::Committed | StopReason::NotRetryable
            );
        let budget = budget.map(|b| {
            if earned {
                (b + 100).min(capacity.unwrap())
            } else {
                b
            }
        });
        Ending {
            cancelled: done.iter().filter(|d| !**d).count(),
            sent,
            ended: Some((at, why)),
            tokens,
            budget,
        }
    };
    for t in 0..=TICKS {
        if s.drop_at == Some(t) {
            // Dropped: every copy out is cancelled; a cancelled copy is no answer, so the
            // tokens stay.
            return Ending {
                cancelled: out(&done),
                sent,
                ended: None,
                tokens,
                budget,
            };
        }
        if s.deadline == Some(t) {
            if out(&done) > 0 {
                // Every copy out is cut at its limit, the call's deadline (each dropped, its
                // stream reset): the first ends the call, a transport failure counted as
                // UNAVAILABLE.
                if let Some(t) = tokens.as_mut() {
                    *t = t.saturating_sub(1000);
                }
                return end(
                    sent,
                    &done,
                    CUT,
                    StopReason::DeadlineReached,
                    tokens,
                    budget,
                );
            }
            // None out: the next copy was due at or past the deadline; the call ends with the
            // last failure, unless no copy may go any more for another reason already.
            let why = closed.unwrap_or(StopReason::DeadlineReached);
            return end(sent, &done, last, why, tokens, budget);
        }
        loop {
            // Every copy due goes.
            while next.is_some_and(|at| at <= t) {
                let throttled = match (s.throttling, tokens) {
                    (Some((max, _)), Some(tokens)) => tokens * 2 <= max * 1000,
                    _ => false,
                };
                let refused = if sent.len() as u32 >= max {
                    Some(StopReason::AttemptsExhausted)
                } else if throttled || budget.is_some_and(|b| b < 1000) {
                    Some(StopReason::BudgetExhausted)
                } else {
                    None
                };
                match refused {
                    Some(why) => {
                        next = None;
                        let why = *closed.get_or_insert(why);
                        if out(&done) == 0 {
                            return end(sent, &done, last, why, tokens, budget);
                        }
                    }
                    None => {
                        if let Some(b) = budget.as_mut() {
                            *b -= 1000;
                        }
                        sent.push(t);
                        done.push(false);
                        next = Some(t + delay);
                    }
                }
            }
            // The lowest copy whose answer is due answers.
            let due = (0..sent.len())
                .find(|&i| !done[i] && s.copies[i].0.is_some_and(|after| sent[i] + after <= t));
            let Some(i) = due else {
                break;
            };
            done[i] = true;
            match s.copies[i].1 {
                Says::Committed => {
                    return end(sent, &done, i, StopReason::Committed, tokens, budget);
                }
                Says::Ok => {
                    if let (Some((max, ratio)), Some(t)) = (s.throttling, tokens.as_mut()) {
                        *t = (*t + (ratio * 1000.0).round() as u64).min(max * 1000);
                    }
                    return end(sent, &done, i, StopReason::Succeeded, tokens, budget);
                }
                Says::Fails(code, _) if !s.non_fatal.contains(&code) => {
                    return end(sent, &done, i, StopReason::NotRetryable, tokens, budget);
                }
                Says::Fails(_, push) => {
                    if let Some(t) = tokens.as_mut() {
                        *t = t.saturating_sub(1000);
                    }
                    last = i;
                    match push {
                        Push::None => next = next.map(|_| t),
                        Push::Wait(w) => next = next.map(|_| t + w),
                        Push::Stop => {
                            next = None;
                            closed.get_or_insert(StopReason::ServerDeclinedRetry);
                        }
                    }
                    if out(&done) == 0 && next.is_none() {
                        let why = closed.unwrap_or(StopReason::AttemptsExhausted);
                        return end(sent, &done, i, why, tokens, budget);
                    }
                }
            }
        }
    }
    Ending {
        sent,
        ended: None,
        cancelled: 0,
        tokens,
        budget,
    }
}

/// The answer `says`, marked with its copy's number.
fn answer(copy: usize, says: Says) -> Response {
    let mut answer = http::Response::builder()
        .header("content-type", "application/grpc")
        .header("x-copy", copy);
    match says {
        Says::Committed => {}
        Says::Ok => answer = answer.header("grpc-status", "0"),
        Says::Fails(code, push) => {
            answer = answer.header("grpc-status", u16::from(code));
            match push {
                Push::None => {}
                Push::Wait(w) => answer = answer.header("grpc-retry-pushback-ms", w * 10),
                Push::Stop => answer = answer.header("grpc-retry-pushback-ms", "-1"),
            }
        }
    }
    Response::from(answer.body("").unwrap())
}

/// What a run shows beside its ending: the door's copies, the answer's record, and the copies
/// the dependency's retry budget paid for.
struct Seen {
    door: Scripted,
    record: Option<RetryRecord>,
    paid: u64,
}

/// The layer's driver through the script, tick by tick.
fn run(s: &Script) -> (Ending, Seen) {
    let mut policy = GrpcHedgingPolicy::builder()
        .max_attempts(s.max)
        .hedging_delay(TICK * s.delay as u32);
    policy = policy.non_fatal_codes(s.non_fatal.iter().map(|c| i32::from(*c)));
    let mut config = GrpcConfig::new()
        .hedge("", policy.build().unwrap())
        .unwrap();
    let throttling = s
        .throttling
        .map(|(max, ratio)| RetryThrottling::new(max as f64, ratio).unwrap());
    if let Some(throttling) = &throttling {
        config = config.retry_throttling(throttling.clone());
    }
    let script_budget = s.budget.map(|tokens| {
        RetryBudget::builder()
            .capacity(tokens.max(1) as f64)
            .initial(tokens as f64)
            .floor_per_sec(0.0)
            .build()
            .unwrap()
    });
    if let Some(budget) = &script_budget {
        config = config.retry_budget(budget.clone());
    }
    let tokens_of = |budget: &Option<RetryBudget>| {
        budget
            .as_ref()
            .map(|b| (b.balance() * 1000.0).round() as u64)
    };
    let clock = FakeClock::new();
    let url: reqwest::Url = "http://127.0.0.1/echo.Echo/Say".parse().unwrap();
    let routes = config.routes();
    // None under throttling, which takes the budget's place.
    let budget = routes.pick(&url, || url.path()).budget().cloned();
    let paid = || budget.as_ref().map_or(0, |b| b.retries());
    let middleware = RetryMiddleware::routed(routes)
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(1));
    let door = Scripted::default();
    let mut extensions = Extensions::new();
    let mut over = RetryOverride::new();
    if let Some(deadline) = s.deadline {
        over = over.deadline(TICK * deadline as u32);
    }
    if let Some(attempts) = s.attempts {
        over = over.max_attempts(attempts);
    }
    if over != RetryOverride::new() {
        extensions.insert(over);
    }
    let mut call = Some(Box::pin(RetryMiddleware::execute(
        &middleware,
        Request::new(http::Method::POST, url),
        &mut extensions,
        door.clone(),
    )));
    let mut sent: Vec<u64> = Vec::new();
    let mut delivered: Vec<bool> = Vec::new();
    let mut ended = None;
    'ticks: for t in 0..=TICKS {
        if s.drop_at == Some(t) {
            drop(call.take());
            let ending = Ending {
                cancelled: door.dropped(),
                sent,
                ended: None,
                tokens: throttling.map(|t| (t.tokens() * 1000.0).round() as u64),
                budget: tokens_of(&script_budget),
            };
            let (paid, record) = (paid(), None);
            return (ending, Seen { door, record, paid });
        }
        let call = call.as_mut().expect("not dropped yet");
        if t > 0 {
            clock.advance(TICK);
        }
        let mut done = poll(call.as_mut());
        loop {
            while door.sent() > sent.len() {
                sent.push(t);
                delivered.push(false);
            }
            if let Some(done) = done {
                ended = Some(done);
                break 'ticks;
            }
            let due = (0..sent.len()).find(|&i| {
                !delivered[i] && s.copies[i].0.is_some_and(|after| sent[i] + after <= t)
            });
            let Some(i) = due else {
                break;
            };
            delivered[i] = true;
            door.answer(i, Ok(answer(i, s.copies[i].1)));
            done = poll(call.as_mut());
        }
    }
    let tokens = throttling.map(|t| (t.tokens() * 1000.0).round() as u64);
    let budget = tokens_of(&script_budget);
    let Some(ended) = ended else {
        let ending = Ending {
            sent,
            ended: None,
            cancelled: 0,
            tokens,
            budget,
        };
        let (paid, record) = (paid(), None);
        return (ending, Seen { door, record, paid });
    };
    let (copy, record) = match ended {
        Ok(response) => {
            let copy: usize = response.headers()["x-copy"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            (copy, RetryRecord::of(&response).expect("a record"))
        }
        // A copy cut at the deadline: the layer's own timeout.
        Err(err) => {
            let err = crate::error::RetryError::of(&err).expect("the layer's error");
            assert!(err.timed_out(), "{err}");
            (CUT, err.record())
        }
    };
    let ending = Ending {
        cancelled: door.dropped(),
        sent,
        ended: Some((copy, record.stop_reason())),
        tokens,
        budget,
    };
    let (paid, record) = (paid(), Some(record));
    (ending, Seen { door, record, paid })
}

/// Polls `future` once.
fn poll<F: Future>(future: Pin<&mut F>) -> Option<F::Output> {
    match future.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(done) => Some(done),
        Poll::Pending => None,
    }
}

#[test]
fn hedged_calls_follow_a6_s_hedging_tick_by_tick() {
    let from = std::env::var("HEDGE_SEED").map_or(0, |s| s.parse().unwrap());
    let scripts = std::env::var("HEDGE_SCRIPTS").map_or(500, |s| s.parse().unwrap());
    let mut ended_by = std::collections::BTreeMap::new();
    for seed in from..from + scripts {
        let s = script(seed);
        let expected = model(&s);
        let (got, Seen { door, record, paid }) = run(&s);
        assert_eq!(got, expected, "seed {seed}: {s:?}");
        // Without throttling the budget pays for each copy after the first that went, whether
        // the call ended or was dropped, and for none that did not go; with it, for none.
        let copies_paid = if s.throttling.is_some() {
            0
        } else {
            got.sent.len() as u64 - 1
        };
        assert_eq!(paid, copies_paid, "seed {seed}: {got:?} {s:?}");
        // Each copy says how many went before it.
        let previous: Vec<Option<String>> = door
            .headers
            .lock()
            .unwrap()
            .iter()
            .map(|h| {
                let value = h.get("grpc-previous-rpc-attempts");
                value.map(|v| v.to_str().unwrap().to_owned())
            })
            .collect();
        let counted: Vec<Option<String>> = (0..got.sent.len())
            .map(|i| (i > 0).then(|| i.to_string()))
            .collect();
        assert_eq!(previous, counted, "seed {seed}");
        if got.ended.is_none() && s.drop_at.is_some() && got.cancelled > 0 {
            *ended_by
                .entry("Dropped with copies out".to_owned())
                .or_insert(0) += 1;
        }
        if let (Some(record), Some((copy, why))) = (record, got.ended) {
            assert_eq!(record.attempts() as usize, got.sent.len(), "seed {seed}");
            if copy != CUT {
                assert_eq!(
                    record.answered_by_hedge(),
                    copy > 0,
                    "seed {seed}: {got:?} {s:?} {record:?}"
                );
            }
            *ended_by.entry(format!("{why:?}")).or_insert(0) += 1;
        }
    }
    // The scripts reach every way a hedged call ends.
    if scripts >= 500 {
        for why in [
            "Committed",
            "Succeeded",
            "NotRetryable",
            "AttemptsExhausted",
            "ServerDeclinedRetry",
            "BudgetExhausted",
            "DeadlineReached",
            "Dropped with copies out",
        ] {
            assert!(
                ended_by.get(why).is_some_and(|n| *n > 3),
                "{why}: {ended_by:?}"
            );
        }
    }
}
