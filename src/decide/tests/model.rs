//! Model-based test of the decision core: random scripts (policies, budgets, outcomes,
//! `Retry-After` values, attempt durations, oversleeping clocks, cancellations at random points)
//! run through the real [`Decider`] and through a small reference model of the contract written
//! from `DESIGN.md`, and every difference, or a broken invariant, fails with the seed that found
//! it.
//!
//! Each script is a few logical requests that share one budget and one set of counters, so the
//! deposits, refunds and give-backs of one request change what the next one may do.

use super::*;

const SCRIPTS: u64 = 10_000;

/// SplitMix64: the script generator (not the crate's, so the test does not lean on it).
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=n`.
    fn upto(&mut self, n: u64) -> u64 {
        self.next() % (n + 1)
    }

    fn chance(&mut self, percent: u64) -> bool {
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

#[derive(Debug, Clone)]
struct Step {
    outcome: Outcome,
    /// How long the attempt takes if nothing cuts it.
    takes: Duration,
    /// `Retry-After` in seconds, or garbage.
    retry_after: Option<Result<u64, &'static str>>,
    can_resend: bool,
    /// The raw value the random source gives the core for this step's jitter.
    draw: u64,
    /// How much longer than asked the wait after this step takes (a real clock oversleeping).
    overslept: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cancel {
    /// The caller drops the request while attempt `n` (1-based) is on the wire.
    DuringAttempt(u32),
    /// The caller drops the request during the wait after attempt `n`.
    DuringWait(u32),
}

#[derive(Debug, Clone)]
struct Request {
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
    budget: Option<BudgetSpec>,
    requests: Vec<Request>,
}

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
    let max_attempts = 1 + g.upto(5) as u32;
    let requests = (0..1 + g.upto(3))
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
                        0..=2 => Some(Ok(g.upto(40))),
                        3 => Some(Err(["-1", "soon", "1.5", ""][g.upto(3) as usize])),
                        _ => None,
                    },
                    can_resend: g.chance(95),
                    draw: match g.upto(3) {
                        0 => 0,
                        1 => u64::MAX,
                        _ => g.next(),
                    },
                    overslept: if g.chance(10) { g.ms(20_000) } else { g.ms(2) },
                })
                .collect();
            let cancel = match g.upto(9) {
                0 => Some(Cancel::DuringAttempt(
                    1 + g.upto(u64::from(max_attempts)) as u32,
                )),
                1..=2 => Some(Cancel::DuringWait(
                    1 + g.upto(u64::from(max_attempts)) as u32,
                )),
                _ => None,
            };
            Request {
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
        budget,
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
    /// `None` when the caller dropped the request.
    stop: Option<StopReason>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    traces: Vec<Trace>,
    counts: CounterSnapshot,
    balance: Option<u64>,
    budget_retries: Option<u64>,
    budget_refusals: Option<u64>,
}

fn retry_after_value(step: &Step) -> Option<HeaderValue> {
    step.retry_after.map(|v| match v {
        Ok(secs) => HeaderValue::from_str(&secs.to_string()).unwrap(),
        Err(garbage) => HeaderValue::from_static(garbage),
    })
}

/// The verdict `classify` gives an outcome, and whether the dependency answered.
fn judged(outcome: Outcome, timed_out: bool) -> (Verdict, bool) {
    if timed_out {
        return (Verdict::Transient(RetryKind::Timeout, "timeout"), false);
    }
    match outcome {
        Outcome::Ok => (Verdict::Final(StopReason::Succeeded), true),
        Outcome::Rejected => (Verdict::Final(StopReason::NotRetryable), true),
        Outcome::Broken => (Verdict::Final(StopReason::NotRetryable), false),
        Outcome::Unavailable => (Verdict::Transient(RetryKind::Other, "status"), true),
        Outcome::Throttled => (Verdict::Transient(RetryKind::Throttled, "status"), true),
        Outcome::Unsafe => (Verdict::Final(StopReason::NotSafeToRetry), true),
    }
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
    let setup = Setup::new(policy, budget);
    let mut traces = Vec::new();
    for request in &s.requests {
        let began = setup.time.now();
        let since = |t: &Time| t.now() - began;
        let mut trace = Trace {
            attempts: Vec::new(),
            sleeps: Vec::new(),
            stop: None,
        };
        let mut d = setup.decider(request.retries_disabled);
        // Bounded: at most max_attempts attempts, each of which either stops or sleeps.
        for step in request
            .steps
            .iter()
            .chain(std::iter::repeat(&request.steps[0]))
            .take(8)
        {
            let timeout = match d.next_attempt(&setup.time) {
                Ok(timeout) => timeout,
                Err(stop) => {
                    trace.stop = Some(stop);
                    break;
                }
            };
            let can_resend = step.can_resend && d.may_retry_after_next();
            d.attempt_started();
            trace.attempts.push((since(&setup.time), timeout));
            if request.cancel == Some(Cancel::DuringAttempt(d.attempts())) {
                break;
            }
            let timed_out = step.takes > timeout;
            setup.time.advance(step.takes.min(timeout));
            let (verdict, answered) = judged(step.outcome, timed_out);
            let header = retry_after_value(step).filter(|_| answered);
            let draw = step.draw;
            let rng = move || draw;
            let next = d.after_attempt(
                Observed {
                    verdict,
                    answered,
                    retry_after: header.as_ref(),
                    can_resend,
                },
                &setup.time,
                &rng,
            );
            match next {
                Wait::Stop(stop) => {
                    trace.stop = Some(stop);
                    break;
                }
                Wait::Sleep(delay) => {
                    trace.sleeps.push(delay);
                    if request.cancel == Some(Cancel::DuringWait(d.attempts())) {
                        break;
                    }
                    setup.time.advance(delay + step.overslept);
                }
            }
        }
        drop(d);
        traces.push(trace);
    }
    Run {
        traces,
        counts: setup.counts(),
        balance: setup.budget.as_ref().map(RetryBudget::balance_milli),
        budget_retries: setup.budget.as_ref().map(RetryBudget::retries),
        budget_refusals: setup.budget.as_ref().map(RetryBudget::refusals),
    }
}

/// The contract, restated plainly: what the script must do.
fn model(s: &Script) -> Run {
    let mut balance = s.budget.map(|b| b.initial * MILLI);
    let capacity = s.budget.map_or(0, |b| b.capacity * MILLI);
    let mut counts = CounterSnapshot::default();
    let (mut budget_retries, mut budget_refusals) = (0, 0);
    let mut traces = Vec::new();
    for request in &s.requests {
        counts.requests += 1;
        let mut trace = Trace {
            attempts: Vec::new(),
            sleeps: Vec::new(),
            stop: None,
        };
        let max = if request.retries_disabled {
            1
        } else {
            s.max_attempts
        };
        let mut t = Duration::ZERO;
        // A retry paid for and not yet started: (its cost, whether it honours a floor).
        let mut pending: Option<(u64, bool)> = None;
        let mut last_cost = 0;
        for n in 1..=max {
            let step = &request.steps[(n - 1) as usize];
            let mut timeout = s.attempt_timeout.min(s.deadline);
            if let Some((cost, floor)) = pending.take() {
                let previous = &request.steps[(n - 2) as usize];
                t += *trace.sleeps.last().unwrap() + previous.overslept;
                if t >= s.deadline {
                    // The wait ran past the deadline: no attempt, the tokens come back.
                    if let Some(b) = &mut balance {
                        *b = (*b + cost).min(capacity);
                        budget_retries -= 1;
                    }
                    counts.deadline_stops += 1;
                    trace.stop = Some(StopReason::DeadlineReached);
                    break;
                }
                timeout = s.attempt_timeout.min(s.deadline - t);
                counts.retries += 1;
                counts.retry_after_honoured += u64::from(floor);
                last_cost = cost;
            }
            counts.attempts += 1;
            trace.attempts.push((t, timeout));
            if request.cancel == Some(Cancel::DuringAttempt(n)) {
                break;
            }
            let timed_out = step.takes > timeout;
            t += step.takes.min(timeout);
            let (retryable, kind, answered, stop) = match (timed_out, step.outcome) {
                (true, _) => (true, Some(RetryKind::Timeout), false, None),
                (_, Outcome::Ok) => (false, None, true, Some(StopReason::Succeeded)),
                (_, Outcome::Rejected) => (false, None, true, Some(StopReason::NotRetryable)),
                (_, Outcome::Broken) => (false, None, false, Some(StopReason::NotRetryable)),
                (_, Outcome::Unsafe) => (false, None, true, Some(StopReason::NotSafeToRetry)),
                (_, Outcome::Unavailable) => (true, Some(RetryKind::Other), true, None),
                (_, Outcome::Throttled) => (true, Some(RetryKind::Throttled), true, None),
            };
            if !retryable {
                let stop = stop.unwrap();
                if let Some(b) = &mut balance {
                    let earned = matches!(stop, StopReason::Succeeded | StopReason::NotRetryable);
                    if n == 1 && answered && earned {
                        *b = (*b + MILLI / 2).min(capacity.max(*b));
                    }
                    if n > 1 && stop == StopReason::Succeeded && s.budget.unwrap().refund {
                        *b = (*b + last_cost).min(capacity);
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
                let floor = step
                    .retry_after
                    .filter(|_| answered)
                    .and_then(Result::ok)
                    .map(Duration::from_secs);
                let ceiling = s.base.saturating_mul(2u32.saturating_pow(n - 1)).min(s.cap);
                let nanos = u64::try_from(ceiling.as_nanos()).unwrap();
                let jitter = Duration::from_nanos(
                    ((u128::from(step.draw) * (u128::from(nanos) + 1)) >> 64) as u64,
                );
                let wait = match floor {
                    Some(f) if f > s.max_retry_after || f >= left => {
                        Err(StopReason::RetryAfterTooLong)
                    }
                    Some(f) if !s.jitter_above_floor => Ok(f),
                    Some(f) => Ok(f + jitter.min((left - f) / 2)),
                    None if jitter >= left => Err(StopReason::DeadlineReached),
                    None => Ok(jitter),
                };
                match wait {
                    Err(stop) => stop,
                    Ok(wait) => {
                        let cost = match (kind.unwrap(), s.budget) {
                            (_, None) => Some(0),
                            (RetryKind::Timeout, Some(b)) => Some(b.timeout_cost * MILLI),
                            _ => Some(MILLI),
                        }
                        .unwrap();
                        let paid = match &mut balance {
                            None => true,
                            Some(b) if *b >= cost => {
                                *b -= cost;
                                budget_retries += 1;
                                true
                            }
                            Some(_) => false,
                        };
                        if paid {
                            trace.sleeps.push(wait);
                            pending = Some((cost, floor.is_some()));
                            if request.cancel == Some(Cancel::DuringWait(n)) {
                                // Dropped while waiting: the guard gives the tokens back.
                                if let (Some(b), Some((cost, _))) = (&mut balance, pending) {
                                    *b = (*b + cost).min(capacity);
                                    budget_retries -= 1;
                                }
                                break;
                            }
                            continue;
                        }
                        budget_refusals += 1;
                        counts.budget_refusals += 1;
                        StopReason::BudgetExhausted
                    }
                }
            };
            if stop == StopReason::DeadlineReached {
                counts.deadline_stops += 1;
            }
            trace.stop = Some(stop);
            break;
        }
        traces.push(trace);
    }
    Run {
        traces,
        counts,
        balance,
        budget_retries: s.budget.map(|_| budget_retries),
        budget_refusals: s.budget.map(|_| budget_refusals),
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
                let floor = match (step.retry_after, step.takes > trace.attempts[i - 1].1) {
                    (Some(Ok(secs)), false) => Duration::from_secs(secs),
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
            "seed {seed}: the core differs from the model\n{s:#?}"
        );
        if let Err(broken) = check_invariants(&s, &got) {
            panic!("seed {seed}: {broken}\n{s:#?}\n{got:#?}");
        }
        // The same seed gives the same schedule.
        assert_eq!(real(&script(seed)), got, "seed {seed}: not reproducible");
        checked += 1;
    }
    assert_eq!(checked, SCRIPTS);
}

#[test]
fn the_scripts_reach_every_stop_reason_and_every_cancellation() {
    // A model test is only as good as the cases it reaches.
    let mut seen = std::collections::HashSet::new();
    let (mut dropped_waiting, mut dropped_sending) = (0, 0);
    for seed in 0..SCRIPTS {
        let s = script(seed);
        let run = real(&s);
        for (request, trace) in s.requests.iter().zip(&run.traces) {
            match trace.stop {
                Some(stop) => {
                    seen.insert(stop);
                }
                None => match request.cancel {
                    Some(Cancel::DuringWait(_)) => dropped_waiting += 1,
                    Some(Cancel::DuringAttempt(_)) => dropped_sending += 1,
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
    ] {
        assert!(seen.contains(&stop), "no script reached {stop:?}");
    }
    assert!(dropped_waiting > 100, "{dropped_waiting}");
    assert!(dropped_sending > 100, "{dropped_sending}");
}
