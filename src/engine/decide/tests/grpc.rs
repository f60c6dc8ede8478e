//! gRPC's rules in the core: A6's backoff, the server's pushback and the backoff's restart after
//! it, and the channel's throttling, counted as each attempt ends.

use super::*;
use crate::engine::grpc::CodeSet;
use crate::engine::grpc::config::GrpcRetryPolicy;
use crate::engine::grpc::rules::GrpcRules;
use crate::engine::grpc::throttle::RetryThrottling;

/// A6's policy and rules: `attempts`, backoff from 100 ms by 3 up to 1 s, `UNAVAILABLE`
/// retried.
fn a6_parts(attempts: u32) -> (RetryPolicy, GrpcRules) {
    GrpcRetryPolicy::builder()
        .max_attempts(attempts)
        .initial_backoff(Duration::from_millis(100))
        .max_backoff(secs(1))
        .backoff_multiplier(3.0)
        .retryable_codes([14])
        .build()
        .unwrap()
        .to_policy()
}

/// A6's policy of `attempts`, to change before [`grpc`] sets a decider up under it.
fn a6(attempts: u32) -> RetryPolicy {
    a6_parts(attempts).0
}

/// What a decider borrows under gRPC's rules (A6's, as [`a6`]'s) and `policy`.
fn grpc(policy: RetryPolicy, budget: Option<RetryBudget>) -> Setup {
    let mut s = Setup::new(policy, budget);
    s.rules = Arc::new(a6_parts(2).1);
    s
}

/// `s` with the channel's `throttling` in its rules.
fn throttled(s: &mut Setup, throttling: &RetryThrottling) {
    s.rules = Arc::new(a6_parts(2).1.with_throttling(Some(throttling.clone())));
}

/// A trailers-only answer's headers: `grpc-status`, and `more`.
fn status(code: &'static str, more: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("grpc-status", HeaderValue::from_static(code));
    for (name, value) in more {
        headers.insert(*name, HeaderValue::from_static(value));
    }
    headers
}

/// An attempt that ended with `headers`, judged `verdict`.
fn said(verdict: Verdict, headers: &HeaderMap) -> Observed<'_> {
    Observed {
        verdict,
        answer: Some(answer(200, headers)),
        resend: Some(&URL),
        timed_out: false,
        unsent: false,
    }
}

const UNAVAILABLE: Verdict = Verdict::Transient(Cause::Status { throttled: false });

fn ended(d: &mut Decider<'_>, s: &Setup, observed: Observed<'_>, rng: &dyn RandomSource) -> Wait {
    d.ended(observed, false, &|| s.time.now(), &|| s.time.wall, rng)
}

const BOTTOM: &dyn RandomSource = &|| 0;

#[test]
fn the_backoff_grows_by_the_multiplier_up_to_its_cap_then_moves_a_fifth_either_way() {
    let headers = status("14", &[]);
    for (rng, fifth) in [(TOP, 6), (BOTTOM, 4)] {
        let s = grpc(a6(5), None);
        let mut d = s.decider(false);
        let mut waits = Vec::new();
        for _ in 0..4 {
            begin(&mut d, &s.time);
            match ended(&mut d, &s, said(UNAVAILABLE, &headers), rng) {
                Wait::Sleep(wait) => waits.push(wait),
                Wait::Stop(stop) => panic!("{stop:?}"),
            }
        }
        // Ceilings 100 ms, 300 ms, 900 ms, then the 1 s cap; times 1.2 at the top draw, 0.8
        // at the bottom one.
        let expected: Vec<Duration> = [100, 300, 900, 1000]
            .iter()
            .map(|ms| Duration::from_millis(ms * fifth / 5))
            .collect();
        assert_eq!(waits, expected);
        begin(&mut d, &s.time);
        let last = ended(&mut d, &s, said(UNAVAILABLE, &headers), rng);
        assert_eq!(last, Wait::Stop(StopReason::AttemptsExhausted));
    }
}

#[test]
fn a_pushback_is_waited_exactly_and_the_backoff_starts_again_after_it() {
    let s = grpc(a6(5), None);
    let mut d = s.decider(false);
    let plain = status("14", &[]);
    let pushed = status("14", &[("grpc-retry-pushback-ms", "750")]);
    begin(&mut d, &s.time);
    assert_eq!(
        ended(&mut d, &s, said(UNAVAILABLE, &plain), TOP),
        Wait::Sleep(Duration::from_millis(120))
    );
    begin(&mut d, &s.time);
    assert_eq!(
        ended(&mut d, &s, said(UNAVAILABLE, &pushed), TOP),
        Wait::Sleep(Duration::from_millis(750)),
        "exactly, with no jitter"
    );
    begin(&mut d, &s.time);
    assert_eq!(
        ended(&mut d, &s, said(UNAVAILABLE, &plain), TOP),
        Wait::Sleep(Duration::from_millis(120)),
        "the first retry's backoff again, not the third's"
    );
    begin(&mut d, &s.time);
    assert_eq!(
        ended(&mut d, &s, said(UNAVAILABLE, &plain), TOP),
        Wait::Sleep(Duration::from_millis(360))
    );
    assert_eq!(s.counts().retry_after_honoured, 1);
}

#[test]
fn a_wait_past_the_call_s_deadline_is_waited_to_it_unpaid_and_the_call_ends_there() {
    // A pushback or a backoff that would cross the deadline: the call waits out what is left
    // (as grpc-go's and grpc-java's calls do), no retry is paid for, and the plan after the
    // wait stops at the deadline, counted once.
    let two_s = status("14", &[("grpc-retry-pushback-ms", "2000")]);
    let at_deadline = status("14", &[("grpc-retry-pushback-ms", "700")]);
    let plain = status("14", &[]);
    for (headers, slow) in [(&two_s, 100), (&at_deadline, 100), (&plain, 900)] {
        let policy = a6(5)
            .to_builder()
            .base_delay(Duration::from_millis(slow))
            .deadline(secs(1))
            .build()
            .unwrap();
        let s = grpc(policy, Some(RetryBudget::default()));
        let before = s.balance();
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        s.time.advance(300 * MS);
        assert_eq!(
            ended(&mut d, &s, said(UNAVAILABLE, headers), TOP),
            Wait::Sleep(700 * MS),
            "{headers:?}"
        );
        assert_eq!(
            s.balance(),
            before,
            "nothing paid for a retry that cannot go"
        );
        s.time.advance(700 * MS);
        assert_eq!(d.next(&s.time), Err(StopReason::DeadlineReached));
        let counts = s.counts();
        assert_eq!((counts.retries, counts.deadline_stops), (0, 1));
        drop(d);
        assert_eq!(s.balance(), before);
    }
    // A wait that ends before the deadline is a retry as before.
    let policy = a6(5).to_builder().deadline(secs(1)).build().unwrap();
    let s = grpc(policy, None);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let short = status("14", &[("grpc-retry-pushback-ms", "999")]);
    assert_eq!(
        ended(&mut d, &s, said(UNAVAILABLE, &short), TOP),
        Wait::Sleep(999 * MS)
    );
}

#[test]
fn a_cancelled_at_or_past_the_deadline_ended_at_the_deadline() {
    let policy = a6(5).to_builder().deadline(secs(1)).build().unwrap();
    let s = grpc(policy, None);
    let cancelled = status("1", &[]);
    let not_retried = Verdict::Final(StopReason::NotRetryable);
    // Before the deadline, a server's CANCELLED is its own answer.
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    s.time.advance(999 * MS);
    assert_eq!(
        ended(&mut d, &s, said(not_retried, &cancelled), TOP),
        Wait::Stop(StopReason::NotRetryable)
    );
    // At the deadline (tonic's server gives up at the grpc-timeout it was told), the call
    // ended there; another code at the deadline stays what it is.
    for (headers, stop) in [
        (&cancelled, StopReason::DeadlineReached),
        (&status("5", &[]), StopReason::NotRetryable),
    ] {
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        s.time.advance(secs(1));
        assert_eq!(
            ended(&mut d, &s, said(not_retried, headers), TOP),
            Wait::Stop(stop)
        );
    }
    // An HTTP request's CANCELLED-looking header means nothing.
    let s = Setup::new(policy_http_deadline(), None);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    s.time.advance(secs(2));
    assert_eq!(
        ended(&mut d, &s, said(not_retried, &cancelled), TOP),
        Wait::Stop(StopReason::NotRetryable)
    );
}

fn policy_http_deadline() -> RetryPolicy {
    RetryPolicy::builder().deadline(secs(1)).build().unwrap()
}

#[test]
fn the_throttling_counts_each_attempt_and_stops_retries_at_half_its_tokens() {
    let mut s = grpc(a6(5), None);
    let throttle = RetryThrottling::new(4.0, 1.6).unwrap().for_server(None);
    throttled(&mut s, &throttle);
    let failed = status("14", &[]);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    assert!(matches!(
        ended(&mut d, &s, said(UNAVAILABLE, &failed), TOP),
        Wait::Sleep(_)
    ));
    assert_eq!(throttle.tokens(), 3.0);
    begin(&mut d, &s.time);
    assert_eq!(
        ended(&mut d, &s, said(UNAVAILABLE, &failed), TOP),
        Wait::Stop(StopReason::BudgetExhausted),
        "2 is at the threshold"
    );
    assert_eq!(throttle.tokens(), 2.0);
    assert_eq!(s.counts().budget_refusals, 1);
    // An OK refills; a committed call is counted by the door, not here; a code not retried
    // counts nothing.
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let ok = status("0", &[]);
    let done = ended(
        &mut d,
        &s,
        said(Verdict::Final(StopReason::Succeeded), &ok),
        TOP,
    );
    assert_eq!(done, Wait::Stop(StopReason::Succeeded));
    assert_eq!(throttle.tokens(), 3.6);
    for (verdict, headers) in [
        (Verdict::Final(StopReason::Committed), HeaderMap::new()),
        (Verdict::Final(StopReason::NotRetryable), status("5", &[])),
    ] {
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        ended(&mut d, &s, said(verdict, &headers), TOP);
        assert_eq!(throttle.tokens(), 3.6, "{verdict:?}");
    }
    // A transport failure that would be retried counts as UNAVAILABLE.
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let reset = Observed {
        verdict: Verdict::Transient(Cause::Fault(Fault::Reset)),
        answer: None,
        resend: Some(&URL),
        timed_out: false,
        unsent: false,
    };
    assert!(matches!(ended(&mut d, &s, reset, TOP), Wait::Sleep(_)));
    assert_eq!(throttle.tokens(), 2.6);
}

/// An attempt that sent nothing the server acted on, failing transiently.
fn unsent(fault: Fault) -> Observed<'static> {
    Observed {
        verdict: Verdict::Transient(Cause::Fault(fault)),
        answer: None,
        resend: Some(&URL),
        timed_out: false,
        unsent: true,
    }
}

#[test]
fn a_call_that_sent_nothing_is_retried_once_at_once_beyond_its_attempts_and_unpaid() {
    let mut s = grpc(a6(2), None);
    let throttle = RetryThrottling::new(4.0, 1.0).unwrap().for_server(None);
    throttled(&mut s, &throttle);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    assert_eq!(
        ended(&mut d, &s, unsent(Fault::NotProcessed), TOP),
        Wait::Sleep(Duration::ZERO),
        "transparent: no wait"
    );
    assert_eq!(throttle.tokens(), 4.0, "not counted as a failure");
    begin(&mut d, &s.time);
    assert_eq!(
        ended(&mut d, &s, unsent(Fault::Connect), TOP),
        Wait::Sleep(Duration::from_millis(120)),
        "once: the second is the policy's first retry, at its first backoff"
    );
    begin(&mut d, &s.time);
    let failed = status("14", &[]);
    assert_eq!(
        ended(&mut d, &s, said(UNAVAILABLE, &failed), TOP),
        Wait::Stop(StopReason::AttemptsExhausted),
        "the policy's 2 attempts and the transparent one"
    );
    assert_eq!(s.counts().attempts, 3);
}

#[test]
fn no_transparent_retry_for_a_call_that_forbade_retries_nor_under_an_http_policy() {
    let s = grpc(a6(2), None);
    let mut d = s.decider(true);
    begin(&mut d, &s.time);
    assert_eq!(
        ended(&mut d, &s, unsent(Fault::Connect), TOP),
        Wait::Stop(StopReason::RetriesDisabled)
    );
    let http = policy(|p| p.max_attempts(1));
    let s = Setup::new(http, None);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    assert_eq!(
        ended(&mut d, &s, unsent(Fault::Connect), TOP),
        Wait::Stop(StopReason::AttemptsExhausted)
    );
}

#[test]
fn a_call_without_a_deadline_waits_out_the_longest_pushback() {
    let s = grpc(a6(2), None);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    // A6's pushback is an int32 of milliseconds: at most about 24.8 days.
    let pushed = status("14", &[("grpc-retry-pushback-ms", "2147483647")]);
    assert_eq!(
        ended(&mut d, &s, said(UNAVAILABLE, &pushed), TOP),
        Wait::Sleep(Duration::from_millis(2_147_483_647))
    );
}

#[test]
fn a_hedged_call_s_next_copy_is_asked_about_at_its_deadline_at_the_latest_and_refused_there() {
    let (policy, rules) = GrpcRules::hedging(3, 100 * MS, CodeSet::of([14]).unwrap());
    let policy = policy.to_builder().deadline(secs(1)).build().unwrap();
    let mut s = grpc(policy, None);
    s.rules = Arc::new(rules);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    s.time.advance(200 * MS);
    let now = s.time.now();
    // 800 ms left: a copy due before then is asked about when due; one due at or past it, at
    // the deadline.
    assert_eq!(d.copy_at(now + 799 * MS, now), now + 799 * MS);
    for at in [now + 800 * MS, now + secs(20)] {
        assert_eq!(d.copy_at(at, now), now + 800 * MS);
    }
    assert_eq!(s.counts().deadline_stops, 0);
    s.time.advance(800 * MS);
    assert_eq!(
        d.copy(s.time.now(), Some(&URL), TOP)
            .map(|plan| plan.number),
        Err(StopReason::DeadlineReached)
    );
    assert_eq!(s.counts().deadline_stops, 1);
}

#[test]
fn a_hedged_call_s_course_holds_room_for_the_copies_its_attempts_allow_and_an_http_hedge_one() {
    let (policy, rules) = GrpcRules::hedging(3, 100 * MS, CodeSet::of([14]).unwrap());
    let mut s = grpc(policy, None);
    s.rules = Arc::new(rules);
    let d = s.decider(false);
    let now = s.time.now();
    // Asked before the first copy goes: two more may follow it, the first of them 100 ms on.
    let course = d.course(100 * MS, now);
    assert!(course.is_call());
    assert_eq!((course.most(), course.due()), (2, Some(now + 100 * MS)));
    // Under HTTP's rules an attempt has one hedge.
    let http = Setup::new(RetryPolicy::default(), None);
    let course = http.decider(false).course(10 * MS, now);
    assert!(!course.is_call());
    assert_eq!(course.most(), 1);
}
