//! Hedged HTTP attempts against a small reference model, on no socket: random scripts of what
//! each copy answers and when, a `FakeClock` moved a millisecond at a time, and a door whose
//! copies answer when the script says. The dependency's latency window has learned 10 ms
//! answers, so the hedge of an attempt a retry may follow goes 11 ticks after its first copy
//! (its delay, the window's p95, is 10.24 ms), paid from the budget like a retry. The model
//! says when each copy goes (to the tick), which copy's outcome the request ends with and why,
//! how many attempts it made and whether a hedge gave its answer, how many copies are
//! cancelled, the budget's tokens and the hedges counted and won. Some scripts drop the
//! request at a tick: every copy out is cancelled, and what the hedges cost stays spent. A
//! failure names its seed: `HEDGE_SEED=N HEDGE_SCRIPTS=M` runs `M` scripts from seed `N`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};

use crate::clock::Clock;
use crate::driver::middleware::RetryMiddleware;
use crate::driver::scripted::Scripted;
use crate::engine::budget::RetryBudget;
use crate::engine::dependency::Dependency;
use crate::engine::policy::RetryPolicy;
use crate::fake_clock::FakeClock;
use crate::record::RetryRecord;
use crate::rng::{RandomSource, SeededRng};
use crate::stop::StopReason;

/// One tick of the fake clock.
const TICK: Duration = Duration::from_millis(1);
/// The ticks a script runs for, at most.
const TICKS: u64 = 300;
/// The ticks from an attempt's first copy to its hedge: the window's p95 (10.24 ms), the
/// first tick at or past it.
const HEDGE_AT: u64 = 11;
/// The requests that teach the window its latency before each script.
const WARM: u64 = 150;

/// What one copy's server answers.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Says {
    Ok,
    NotFound,
    Unavailable,
}

#[derive(Debug, Clone)]
struct Script {
    attempts: u32,
    /// Each attempt's time limit, in ticks.
    limit: u64,
    /// A budget of this many tokens (a retry or a hedge costs one; a first attempt answered
    /// earns a thousandth, up to its capacity).
    budget: Option<u64>,
    /// Per copy, in the order sent: after how many ticks it answers (never, if `None`), and
    /// what it says.
    copies: Vec<(Option<u64>, Says)>,
    /// The caller drops the request at the start of this tick, before the clock moves to it.
    drop_at: Option<u64>,
}

fn script(seed: u64) -> Script {
    let g = SeededRng::new(seed);
    let upto = |n: u64| g.next_u64() % (n + 1);
    let attempts = 1 + upto(2) as u32;
    let limit = [15, 20, 40][upto(2) as usize];
    let budget = (upto(99) < 50).then(|| upto(3));
    let copies = (0..2 * attempts)
        .map(|_| {
            let after = (upto(99) >= 20).then(|| upto(30));
            let says = match upto(99) {
                0..40 => Says::Ok,
                40..50 => Says::NotFound,
                _ => Says::Unavailable,
            };
            (after, says)
        })
        .collect();
    let drop_at = (upto(99) < 25).then(|| 1 + upto(60));
    Script {
        attempts,
        limit,
        budget,
        copies,
        drop_at,
    }
}

/// What a script ends in.
#[derive(Debug, Clone, PartialEq, Default)]
struct Ending {
    /// Each copy: the tick it went at, its attempt, and whether it was a hedge.
    sent: Vec<(u64, u32, bool)>,
    /// The copy whose outcome the request ended with ([`CUT`]: a copy cut at its limit), and
    /// why; `None` if it had not ended (or was dropped first).
    ended: Option<(usize, StopReason)>,
    /// The attempts the request made, as its record says, and whether a hedge gave the
    /// answer of its last.
    attempts: u32,
    by_hedge: bool,
    /// Copies cancelled (dropped before they answered): cut at their limit, out when their
    /// attempt ended, or when the request was dropped.
    cancelled: usize,
    /// The budget's tokens, in thousandths.
    budget: Option<u64>,
    /// Hedges sent, and attempts whose outcome a hedge gave.
    hedges: u64,
    hedges_won: u64,
}

/// The copy an outcome came from when it was cut at its limit (the layer's timeout, not an
/// answer).
const CUT: usize = usize::MAX;

/// One copy out in the model.
#[derive(Debug, Clone, Copy)]
struct Out {
    copy: usize,
    hedge: bool,
}

/// A copy goes at tick `t`, of `attempt`, a hedge or not: out, and not yet answered.
fn send(e: &mut Ending, out: &mut Vec<Out>, delivered: &mut Vec<bool>, copy: (u64, u32, bool)) {
    out.push(Out {
        copy: e.sent.len(),
        hedge: copy.2,
    });
    e.sent.push(copy);
    delivered.push(false);
}

/// The reference, tick by tick.
fn model(s: &Script) -> Ending {
    // The 150 answers the window learned from each earned a thousandth of a token.
    let capacity = s.budget.map_or(0, |b| b.max(1) * 1000);
    let mut e = Ending {
        sent: vec![(0, 1, false)],
        budget: s.budget.map(|b| (b * 1000 + WARM).min(capacity)),
        ..Ending::default()
    };
    let (mut attempt, mut started) = (1, 0);
    let mut out = vec![Out {
        copy: 0,
        hedge: false,
    }];
    // The hedge may still go: an attempt a retry may follow, whose first copy is out.
    let mut may_hedge = s.attempts > 1;
    let mut delivered = vec![false];
    let pay = |budget: &mut Option<u64>| match budget {
        None => true,
        Some(b) if *b >= 1000 => {
            *b -= 1000;
            true
        }
        Some(_) => false,
    };
    for t in 0..=TICKS {
        if s.drop_at == Some(t) {
            e.cancelled += out.len();
            return e;
        }
        // The poll: the copies' timers, then the hedge; then the answers due, one at a time.
        let mut answer: Option<usize> = None;
        loop {
            let ended = match answer.take() {
                Some(at) => {
                    let who = out.remove(at);
                    Some((who, Some(s.copies[who.copy].1)))
                }
                None => {
                    let cut = out.iter().position(|o| e.sent[o.copy].0 + s.limit <= t);
                    e.cancelled += usize::from(cut.is_some());
                    cut.map(|at| (out.remove(at), None))
                }
            };
            if let Some((who, says)) = ended {
                let failed = match says {
                    Some(Says::Ok) => Some(StopReason::Succeeded),
                    Some(Says::NotFound) => Some(StopReason::NotRetryable),
                    _ => None,
                };
                let outcome = if says.is_some() { who.copy } else { CUT };
                if let Some(stop) = failed {
                    if let (1, Some(b)) = (attempt, e.budget.as_mut()) {
                        *b = (*b + 1).min(capacity.max(*b));
                    }
                    e.cancelled += out.len();
                    e.hedges_won += u64::from(who.hedge);
                    (e.attempts, e.by_hedge) = (attempt, who.hedge);
                    e.ended = Some((outcome, stop));
                    return e;
                }
                may_hedge = false;
                if !out.is_empty() {
                    // The other copy may still answer.
                    continue;
                }
                // The attempt failed with this copy's outcome: retried at once (no backoff),
                // paid, while attempts are left. (A request that ends in an error was
                // answered by no copy.)
                e.hedges_won += u64::from(who.hedge);
                let stop = if attempt >= s.attempts {
                    Some(StopReason::AttemptsExhausted)
                } else if !pay(&mut e.budget) {
                    Some(StopReason::BudgetExhausted)
                } else {
                    None
                };
                if let Some(stop) = stop {
                    (e.attempts, e.by_hedge) = (attempt, who.hedge && says.is_some());
                    e.ended = Some((outcome, stop));
                    return e;
                }
                attempt += 1;
                started = t;
                may_hedge = attempt < s.attempts;
                send(&mut e, &mut out, &mut delivered, (t, attempt, false));
                continue;
            }
            if may_hedge && t >= started + HEDGE_AT {
                may_hedge = false;
                if pay(&mut e.budget) {
                    e.hedges += 1;
                    send(&mut e, &mut out, &mut delivered, (t, attempt, true));
                    continue;
                }
            }
            // The lowest copy whose answer is due answers (a copy gone takes its answer with
            // it).
            let due = (0..e.sent.len()).find(|&i| {
                !delivered[i] && s.copies[i].0.is_some_and(|after| e.sent[i].0 + after <= t)
            });
            let Some(i) = due else {
                break;
            };
            delivered[i] = true;
            answer = out.iter().position(|o| o.copy == i);
        }
    }
    e
}

/// The answer `says`, marked with its copy's number.
fn answer(copy: usize, says: Says) -> Response {
    let status = match says {
        Says::Ok => 200,
        Says::NotFound => 404,
        Says::Unavailable => 503,
    };
    let answer = http::Response::builder()
        .status(status)
        .header("x-copy", copy)
        .body("")
        .unwrap();
    Response::from(answer)
}

/// The middleware's driver through the script, tick by tick.
fn run(s: &Script) -> Ending {
    let policy = RetryPolicy::builder()
        .max_attempts(s.attempts)
        .base_delay(Duration::ZERO)
        .attempt_timeout(TICK * s.limit as u32)
        .hedge_reads(0.05, Duration::from_secs(1))
        .build()
        .unwrap();
    let mut dependency = Dependency::new("hedged", policy);
    let budget = s.budget.map(|tokens| {
        RetryBudget::builder()
            .capacity(tokens.max(1) as f64)
            .initial(tokens as f64)
            .retry_cost(1.0)
            .timeout_cost(1.0)
            .deposit_ratio(0.001)
            .refund_on_success(false)
            .floor_per_sec(0.0)
            .build()
            .unwrap()
    });
    if let Some(budget) = &budget {
        dependency = dependency.with_budget(budget.clone());
    }
    let clock = FakeClock::new();
    let middleware = RetryMiddleware::new(dependency.clone())
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(1));
    let request = || Request::new(http::Method::GET, "http://127.0.0.1/x".parse().unwrap());
    // The window learns 10 ms answers.
    let warm = Scripted {
        answer_after: Some((clock.clone(), Duration::from_millis(10))),
        ..Scripted::default()
    };
    for _ in 0..WARM {
        let mut extensions = Extensions::new();
        let run = RetryMiddleware::execute(&middleware, request(), &mut extensions, warm.clone());
        assert!(poll(std::pin::pin!(run)).is_some_and(|done| done.is_ok()));
    }
    clock.advance(Duration::from_secs(1));
    let (hedges, won) = {
        let counted = dependency.counters();
        (counted.hedges, counted.hedges_won)
    };
    let tokens = || {
        budget
            .as_ref()
            .map(|b| (b.balance() * 1000.0).round() as u64)
    };

    let door = Scripted::default();
    let mut extensions = Extensions::new();
    let mut call = Some(Box::pin(RetryMiddleware::execute(
        &middleware,
        request(),
        &mut extensions,
        door.clone(),
    )));
    let mut e = Ending::default();
    let mut delivered: Vec<bool> = Vec::new();
    let mut ended = None;
    let start = clock.now();
    'ticks: for t in 0..=TICKS {
        if s.drop_at == Some(t) {
            drop(call.take());
            break;
        }
        let call = call.as_mut().expect("not dropped yet");
        if t > 0 {
            clock.advance(TICK);
        }
        assert_eq!(
            clock.now() - start,
            TICK * t as u32,
            "no wait moved the clock"
        );
        let mut done = poll(call.as_mut());
        loop {
            while door.sent() > e.sent.len() {
                // A hedge carries its attempt's number.
                let number = door.attempts.lock().unwrap()[e.sent.len()];
                let hedge = e.sent.last().is_some_and(|(_, last, _)| *last == number);
                e.sent.push((t, number, hedge));
                delivered.push(false);
            }
            if let Some(done) = done {
                ended = Some(done);
                break 'ticks;
            }
            let due = (0..e.sent.len()).find(|&i| {
                !delivered[i] && s.copies[i].0.is_some_and(|after| e.sent[i].0 + after <= t)
            });
            let Some(i) = due else {
                break;
            };
            delivered[i] = true;
            door.answer(i, Ok(answer(i, s.copies[i].1)));
            done = poll(call.as_mut());
        }
    }
    let counted = dependency.counters();
    (e.hedges, e.hedges_won) = (counted.hedges - hedges, counted.hedges_won - won);
    (e.cancelled, e.budget) = (door.dropped(), tokens());
    if let Some(ended) = ended {
        let (copy, record) = match ended {
            // An answer, the last one's when retrying stopped.
            Ok(response) => {
                let copy = response.headers()["x-copy"].to_str().unwrap();
                (copy.parse().unwrap(), RetryRecord::of(&response).unwrap())
            }
            // A copy cut at its limit: the layer's own timeout.
            Err(err) => {
                let err = crate::error::RetryError::of(&err).expect("the layer's error");
                assert!(err.timed_out(), "{err}");
                (CUT, err.record())
            }
        };
        e.ended = Some((copy, record.stop_reason()));
        (e.attempts, e.by_hedge) = (record.attempts(), record.answered_by_hedge());
    }
    e
}

/// Polls `future` once.
fn poll<F: Future>(future: Pin<&mut F>) -> Option<F::Output> {
    match future.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(done) => Some(done),
        Poll::Pending => None,
    }
}

#[test]
fn hedged_attempts_follow_the_model_tick_by_tick() {
    let from = std::env::var("HEDGE_SEED").map_or(0, |s| s.parse().unwrap());
    let scripts = std::env::var("HEDGE_SCRIPTS").map_or(600, |s| s.parse().unwrap());
    let mut reached = std::collections::BTreeMap::new();
    for seed in from..from + scripts {
        let s = script(seed);
        let expected = model(&s);
        let got = run(&s);
        assert_eq!(got, expected, "seed {seed}: {s:?}");
        let mut note = |what: String| *reached.entry(what).or_insert(0) += 1;
        if let Some((copy, why)) = got.ended {
            note(format!("{why:?}"));
            if copy == CUT {
                note("a copy cut at its limit".into());
            }
        } else if got.cancelled > 0 {
            note("dropped with copies out".into());
        }
        if got.hedges_won > 0 {
            note("a hedge won".into());
        }
        if got.ended.is_some() && got.cancelled > 0 {
            note("a copy cancelled when the other ended the request".into());
        }
        if got.attempts > 1 && got.hedges > 0 {
            note("a hedged attempt retried".into());
        }
    }
    // The scripts reach every way a hedged attempt ends.
    if scripts >= 600 {
        for what in [
            "Succeeded",
            "NotRetryable",
            "AttemptsExhausted",
            "BudgetExhausted",
            "a copy cut at its limit",
            "dropped with copies out",
            "a hedge won",
            "a copy cancelled when the other ended the request",
            "a hedged attempt retried",
        ] {
            assert!(
                reached.get(what).is_some_and(|n| *n > 5),
                "{what}: {reached:?}"
            );
        }
    }
}
