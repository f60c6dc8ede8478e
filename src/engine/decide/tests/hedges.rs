//! Hedges in the core: a few rules by hand, then a model-based test of whole scripts (copies
//! sent, copies that win, copies cancelled, requests dropped with one or two copies out, retries
//! after hedged attempts) against a reference model of what each event costs the budget, the
//! throttle and the counters.

use super::model::Gen;
use super::*;
use crate::engine::rate_limit::Quota;

/// A window of 200 answers of 10 ms for a dependency with `policy`: believed, its p95 (and
/// p99.9) 10.24 ms.
fn filled(policy: &RetryPolicy) -> LatencyWindow {
    let window = LatencyWindow::new(policy);
    let start = Instant::now();
    for _ in 0..200 {
        window.answered(Duration::from_millis(10), start);
    }
    window
}

fn hedging(max_delay: Duration, max_attempts: u32) -> RetryPolicy {
    RetryPolicy::builder()
        .max_attempts(max_attempts)
        .attempt_timeout(secs(1))
        .hedge_reads(0.05, max_delay)
        .build()
        .unwrap()
}

fn budget(capacity: u64, initial: u64) -> RetryBudget {
    RetryBudget::builder()
        .capacity(capacity as f64)
        .initial(initial as f64)
        .floor_per_sec(0.0)
        .refund_on_success(false)
        .build()
        .unwrap()
}

fn setup(policy: RetryPolicy, budget: Option<RetryBudget>) -> Setup {
    let mut setup = Setup::new(policy, budget);
    setup.latency = Some(filled(&policy));
    setup
}

fn answered(status: u16) -> Observed<'static> {
    let verdict = if status == 503 {
        Verdict::Transient(Cause::Status { throttled: false })
    } else {
        Verdict::Final(StopReason::Succeeded)
    };
    Observed {
        verdict,
        answer: Some(answer(status, &NO_HEADERS)),
        resend: Some(&URL),
        timed_out: false,
        unsent: false,
    }
}

#[test]
fn only_a_request_allowed_to_hedge_gets_a_hedging_delay_the_window_s_percentile_capped() {
    let s = setup(hedging(secs(1), 3), Some(budget(10, 10)));
    let mut d = s.decider(false);
    assert_eq!(d.next(&s.time), Ok(secs(1)));
    assert_eq!(d.hedge_after(), None, "not allowed: a write, or keyed");
    assert_eq!(d.hedge(s.time.now(), &URL, TOP), None);
    let mut d = s.decider(false);
    d.allow_hedges();
    d.next(&s.time).unwrap();
    assert_eq!(d.hedge_after(), Some(Duration::from_micros(10_240)));
    // Capped by the policy's delay.
    let capped = setup(hedging(5 * MS, 3), None);
    let mut d = capped.decider(false);
    d.allow_hedges();
    d.next(&capped.time).unwrap();
    assert_eq!(d.hedge_after(), Some(5 * MS));
    // A hedge that could only go when the first copy times out is no hedge: a delay of the
    // whole limit (what the deadline leaves) gives none, one a microsecond shorter one.
    for (left, hedged) in [(10_240, false), (10_241, true)] {
        let edge = setup(
            hedging(secs(1), 3)
                .to_builder()
                .deadline(secs(1))
                .build()
                .unwrap(),
            None,
        );
        let mut d = edge.decider(false);
        d.allow_hedges();
        edge.time.advance(secs(1) - Duration::from_micros(left));
        assert_eq!(d.next(&edge.time), Ok(Duration::from_micros(left)));
        assert_eq!(d.hedge_after().is_some(), hedged, "{left} us left");
    }
    // A policy that does not hedge, or a window that is not believed: none.
    let off = Setup::new(RetryPolicy::default(), None);
    let mut d = off.decider(false);
    d.allow_hedges();
    d.next(&off.time).unwrap();
    assert_eq!(d.hedge_after(), None);
    let mut empty = Setup::new(hedging(secs(1), 3), None);
    empty.latency = Some(LatencyWindow::new(&hedging(secs(1), 3)));
    let mut d = empty.decider(false);
    d.allow_hedges();
    d.next(&empty.time).unwrap();
    assert_eq!(d.hedge_after(), None);
}

#[test]
fn a_hedge_is_paid_for_counted_once_and_its_limit_is_the_attempt_s_cut_to_the_deadline() {
    let s = setup(hedging(secs(1), 3), Some(budget(10, 2)));
    let mut d = s.decider(false);
    d.allow_hedges();
    d.next(&s.time).unwrap();
    d.attempt_started();
    s.time.advance(20 * MS);
    assert_eq!(d.hedge(s.time.now(), &URL, TOP), Some(secs(1)));
    assert_eq!(s.budget.as_ref().unwrap().balance(), 1.0);
    // Counted when it is sent.
    assert_eq!(s.counts().hedges, 0);
    d.hedge_started();
    // At most one per attempt.
    assert_eq!(d.hedge(s.time.now(), &URL, TOP), None);
    assert_eq!(s.counts().hedges, 1);
    d.hedge_won();
    assert!(d.hedge_answered());
    assert_eq!(
        d.after(answered(200), &s.time, TOP),
        Wait::Stop(StopReason::Succeeded)
    );
    assert_eq!(
        (
            s.counts().hedges,
            s.counts().hedges_won,
            s.counts().attempts
        ),
        (1, 1, 1)
    );
    // Spent: the hedge was made. (The first attempt's success deposited 0.1.)
    assert_eq!(s.budget.as_ref().unwrap().balance(), 1.1);
}

#[test]
fn a_hedge_is_a_retry_sent_early_so_only_an_attempt_a_retry_may_follow_is_hedged() {
    // One attempt allowed, or retries forbidden: no hedge of it.
    for (max_attempts, retries_disabled) in [(1, false), (3, true)] {
        let s = setup(hedging(secs(1), max_attempts), Some(budget(10, 10)));
        let mut d = s.decider(retries_disabled);
        d.allow_hedges();
        d.next(&s.time).unwrap();
        assert_eq!(
            d.hedge_after(),
            None,
            "{max_attempts} attempts, {retries_disabled}"
        );
        d.attempt_started();
        assert_eq!(d.hedge(s.time.now(), &URL, TOP), None);
        assert_eq!(s.budget.as_ref().unwrap().balance(), 10.0);
    }
    // Two attempts: the first may be hedged, the last not.
    let s = setup(hedging(secs(1), 2), Some(budget(10, 10)));
    let mut d = s.decider(false);
    d.allow_hedges();
    d.next(&s.time).unwrap();
    assert!(d.hedge_after().is_some());
    d.attempt_started();
    assert!(matches!(
        d.after(answered(503), &s.time, TOP),
        Wait::Sleep(_)
    ));
    d.next(&s.time).unwrap();
    assert_eq!(d.hedge_after(), None, "the last attempt");
}

#[test]
fn a_hedge_sent_stays_paid_for_when_its_caller_gives_up_and_one_not_sent_costs_nothing() {
    let s = setup(hedging(secs(1), 3), Some(budget(10, 5)));
    let mut d = s.decider(false);
    d.allow_hedges();
    d.next(&s.time).unwrap();
    d.attempt_started();
    assert!(d.hedge(s.time.now(), &URL, TOP).is_some());
    d.hedge_started();
    drop(d);
    assert_eq!(
        s.budget.as_ref().unwrap().balance(),
        4.0,
        "committed once sent"
    );
    assert_eq!(s.counts().hedges, 1);
    // Allowed, but no timer to send it with: its token comes back, and nothing is counted.
    let mut d = s.decider(false);
    d.allow_hedges();
    d.next(&s.time).unwrap();
    d.attempt_started();
    assert!(d.hedge(s.time.now(), &URL, TOP).is_some());
    assert_eq!(s.budget.as_ref().unwrap().balance(), 3.0);
    d.hedge_unsent();
    assert_eq!(s.budget.as_ref().unwrap().balance(), 4.0);
    assert_eq!(s.counts().hedges, 1);
    // Given back once: the guard has nothing left to give.
    drop(d);
    assert_eq!(s.budget.as_ref().unwrap().balance(), 4.0);
}

#[test]
fn no_hedge_without_tokens_past_the_deadline_or_through_a_spent_quota() {
    let s = setup(hedging(secs(1), 3), Some(budget(1, 0)));
    let mut d = s.decider(false);
    d.allow_hedges();
    d.next(&s.time).unwrap();
    d.attempt_started();
    assert_eq!(d.hedge(s.time.now(), &URL, TOP), None, "no token");
    assert_eq!(s.counts().hedges, 0);

    let s = setup(hedging(secs(1), 3), None);
    let mut d = s.decider(false);
    d.allow_hedges();
    d.next(&s.time).unwrap();
    d.attempt_started();
    s.time.advance(secs(30));
    assert_eq!(
        d.hedge(s.time.now(), &URL, TOP),
        None,
        "the deadline has passed"
    );

    // A quota spent (by another request's answer) while the first copy is out: no hedge.
    let s = setup(hedging(secs(1), 3), None);
    let mut d = s.decider(false);
    d.allow_hedges();
    d.next(&s.time).unwrap();
    d.attempt_started();
    let spent = Quota::Spent(secs(30));
    s.quota.update(&Origin::of(URL), Some(spent), s.time.now());
    assert_eq!(d.hedge(s.time.now(), &URL, TOP), None);
    // A quota past its belief: the first attempt goes as its probe, and no hedge goes beside.
    s.time.advance(crate::engine::rate_limit::BELIEF + secs(1));
    let mut d = s.decider(false);
    d.allow_hedges();
    d.next(&s.time).unwrap();
    d.attempt_started();
    assert_eq!(d.hedge(s.time.now(), &URL, TOP), None);
    assert_eq!(s.counts().hedges, 0);
}

#[test]
fn a_hedge_the_throttle_turns_away_is_not_sent_and_costs_nothing() {
    let mut s = setup(hedging(secs(1), 3), Some(budget(10, 5)));
    let throttle = AdaptiveThrottle::default();
    // A dependency that turned away its last 100 attempts: most are rejected locally.
    for _ in 0..100 {
        throttle.finished(s.time.now(), false);
    }
    s.throttle = Some(throttle);
    let mut d = s.decider(false);
    d.allow_hedges();
    // The first attempt is admitted by the highest draw...
    d.next(&s.time).unwrap();
    d.attempt_started();
    // ...and the hedge rejected by the lowest: not sent, its token back.
    assert_eq!(d.hedge(s.time.now(), &URL, &|| 0u64), None);
    assert_eq!(s.budget.as_ref().unwrap().balance(), 5.0);
    assert_eq!(s.counts().hedges, 0);
    // Admitted, it is sent and paid for.
    assert_eq!(d.hedge(s.time.now(), &URL, TOP), Some(secs(1)));
    assert_eq!(s.budget.as_ref().unwrap().balance(), 4.0);
}

/// What the reference model expects the shared accounts to hold.
#[derive(Debug, Default, PartialEq, Eq)]
struct Expected {
    /// The budget's balance, in milli-tokens.
    balance: u64,
    requests: u64,
    attempts: u64,
    retries: u64,
    hedges: u64,
    hedges_won: u64,
    /// The throttle's `(requests, accepts)`: each copy admitted counts once when it ends.
    throttle: (u64, u64),
}

/// How one attempt ends, in the script.
#[derive(Debug, Clone, Copy)]
enum Ending {
    /// The first copy answers with this status; a hedge, if out, is cancelled.
    First(u16),
    /// The hedge answers with this status, first; the first copy is cancelled.
    Hedge(u16),
    /// The first copy fails with a 503 while the hedge is out, then the hedge answers.
    FirstFailsThenHedge(u16),
    /// The caller drops the request with its copies out.
    Dropped,
}

/// Runs one script; returns a description of the first difference from the model.
fn run_script(seed: u64) -> Result<(), String> {
    let mut g = Gen(seed);
    let capacity = 1 + g.upto(4);
    let initial = g.upto(capacity);
    let max_attempts = 1 + g.upto(3) as u32;
    let mut s = setup(
        hedging(MS * (5 + g.upto(200) as u32), max_attempts),
        Some(budget(capacity, initial)),
    );
    s.throttle = Some(AdaptiveThrottle::default());
    let mut want = Expected {
        balance: initial * 1000,
        ..Expected::default()
    };
    for request in 0..(1 + g.upto(8)) {
        s.time.advance(MS * g.upto(500) as u32);
        let mut d = s.decider(false);
        want.requests += 1;
        let hedgeable = g.chance(80);
        if hedgeable {
            d.allow_hedges();
        }
        for n in 1..=max_attempts {
            let limit = d
                .next(&s.time)
                .map_err(|stop| format!("request {request}: attempt {n} stopped: {stop:?}"))?;
            let after = d.hedge_after();
            // Only an attempt that a retry may follow is hedged.
            if after.is_some() != (hedgeable && n < max_attempts) {
                return Err(format!("request {request}: hedge_after {after:?}"));
            }
            if let Some(after) = after {
                if after >= limit || after > secs(1) {
                    return Err(format!("hedge after {after:?}, limit {limit:?}"));
                }
            }
            d.attempt_started();
            want.attempts += 1;
            want.retries += u64::from(n > 1);
            let mut hedged = false;
            if let (Some(after), true) = (after, g.chance(60)) {
                s.time.advance(after);
                let affordable = want.balance >= 1000;
                let sent = d.hedge(s.time.now(), &URL, TOP);
                if sent.is_some() != affordable {
                    return Err(format!("hedge {sent:?} with {} milli-tokens", want.balance));
                }
                if affordable {
                    d.hedge_started();
                    hedged = true;
                    want.balance -= 1000;
                    want.hedges += 1;
                }
            }
            let status = if g.chance(50) { 200 } else { 503 };
            let ending = match g.upto(9) {
                0 => Ending::Dropped,
                1..=3 if hedged => Ending::Hedge(status),
                4 if hedged => Ending::FirstFailsThenHedge(status),
                _ => Ending::First(status),
            };
            s.time.advance(MS * g.upto(30) as u32);
            let status = match ending {
                Ending::Dropped => {
                    drop(d);
                    // Every copy out counts as a request the dependency did not accept; the
                    // hedge was sent, so its token stays spent.
                    want.throttle.0 += 1 + u64::from(hedged);
                    break;
                }
                Ending::First(status) => status,
                Ending::Hedge(status) | Ending::FirstFailsThenHedge(status) => {
                    d.hedge_won();
                    want.hedges_won += 1;
                    status
                }
            };
            // The copy that answered counts, accepted unless its status is retried; the other
            // one, if sent, counts as given up.
            want.throttle.0 += 1 + u64::from(hedged);
            want.throttle.1 += u64::from(status != 503);
            let wait = d.after(answered(status), &s.time, TOP);
            match wait {
                Wait::Stop(stop) => {
                    let expected = if status != 503 {
                        StopReason::Succeeded
                    } else if n == max_attempts {
                        StopReason::AttemptsExhausted
                    } else {
                        StopReason::BudgetExhausted
                    };
                    if stop != expected {
                        return Err(format!("request {request}: {stop:?}, not {expected:?}"));
                    }
                    if n == 1 && status != 503 {
                        want.balance = (want.balance + 100).min(capacity * 1000);
                    }
                    break;
                }
                Wait::Sleep(delay) => {
                    if status != 503 || want.balance < 1000 || n == max_attempts {
                        return Err(format!("request {request}: a retry after {status}"));
                    }
                    want.balance -= 1000;
                    if g.chance(10) {
                        // Dropped during the wait: the retry's token comes back.
                        drop(d);
                        want.balance += 1000;
                        break;
                    }
                    s.time.advance(delay);
                }
            }
        }
        let c = s.counts();
        let throttle = s.throttle.as_ref().unwrap().counts(s.time.now());
        let got = Expected {
            balance: s.budget.as_ref().unwrap().balance_milli(),
            requests: c.requests,
            attempts: c.attempts,
            retries: c.retries,
            hedges: c.hedges,
            hedges_won: c.hedges_won,
            throttle,
        };
        if got != want {
            return Err(format!(
                "after request {request}: {got:?}, expected {want:?}"
            ));
        }
    }
    Ok(())
}

#[test]
fn two_thousand_scripts_of_hedges_match_the_model() {
    for seed in 0..2_000 {
        if let Err(difference) = run_script(seed) {
            panic!("seed {seed}: {difference}");
        }
    }
}

/// 2 x p99.9 with a 1 ms floor, under a fixed 1 s timeout.
fn measuring() -> RetryPolicy {
    RetryPolicy::builder()
        .attempt_timeout(secs(1))
        .timeout_from_latency(2.0, MS)
        .build()
        .unwrap()
}

#[test]
fn at_a_measured_limit_a_few_attempts_are_cut_and_a_burst_runs_on_to_the_fixed_timeout() {
    let s = setup(measuring(), Some(budget(10, 10)));
    let mut deciders: Vec<_> = (0..16).map(|_| s.decider(false)).collect();
    for d in &mut deciders {
        // Twice the p99.9 of 10 ms answers (10.24 ms).
        assert_eq!(d.next(&s.time), Ok(Duration::from_micros(20_480)));
        d.attempt_started();
    }
    // Every answer ten times slower: all sixteen reach their limit together.
    s.time.advance(21 * MS);
    let at_limit: Vec<_> = deciders
        .iter_mut()
        .map(|d| d.at_limit(s.time.now()))
        .collect();
    let more = secs(1) - Duration::from_micros(20_480);
    let mut expected = vec![None, None];
    expected.extend([Some(more); 14]);
    assert_eq!(
        at_limit,
        expected,
        "the window's allowance: {}",
        crate::engine::latency::MIN_CUTS
    );
    // One that ran on has the fixed timeout: at it, it is cut whatever the allowance.
    assert_eq!(deciders[2].at_limit(s.time.now()), None);
    // The next second has its allowance again.
    s.time.advance(secs(1));
    let mut d = s.decider(false);
    d.next(&s.time).unwrap();
    d.attempt_started();
    assert_eq!(d.at_limit(s.time.now()), None);
    // A limit the deadline cut leaves nothing to run on for.
    let short = setup(
        measuring()
            .to_builder()
            .base_delay(MS)
            .max_delay(MS)
            .deadline(15 * MS)
            .build()
            .unwrap(),
        None,
    );
    let mut d = short.decider(false);
    assert_eq!(d.next(&short.time), Ok(15 * MS));
    d.attempt_started();
    for _ in 0..3 {
        short.latency.as_ref().unwrap().take_cut(short.time.now());
    }
    short.time.advance(15 * MS);
    assert_eq!(d.at_limit(short.time.now()), None);
    // Without a measured limit, the fixed timeout cuts.
    let fixed = Setup::new(RetryPolicy::default(), None);
    let mut d = fixed.decider(false);
    d.next(&fixed.time).unwrap();
    d.attempt_started();
    assert_eq!(d.at_limit(fixed.time.now()), None);
}

#[test]
fn the_cut_allowance_is_a_share_of_the_answer_rate_and_never_below_its_floor() {
    let policy = measuring();
    let window = LatencyWindow::new(&policy);
    let start = Instant::now();
    // 30,000 answers over the window: 1,000 a second, of which 1 % may be cut each second.
    for _ in 0..30_000 {
        window.answered(Duration::from_millis(10), start);
    }
    window.measured(start);
    let cuts = (0..20).filter(|_| window.take_cut(start)).count();
    assert_eq!(cuts, 10);
    let quiet = LatencyWindow::new(&policy);
    quiet.measured(start);
    let cuts = (0..20).filter(|_| quiet.take_cut(start)).count();
    assert_eq!(cuts, crate::engine::latency::MIN_CUTS as usize);
}
