//! The quota and the throttle in the core, case by case: holds inside the deadline and with
//! jitter, per origin, a floor for a retry, probes, and what a dropped request gives back.

use super::*;
use crate::engine::decide::MOST_HOLDS;
use crate::engine::rate_limit::Quota;

fn spent(s: &Setup, url: &str, wait: Duration) {
    let origin = Origin::of(target(url));
    s.quota
        .update(&origin, Some(Quota::Spent(wait)), s.time.now());
}

/// A quota spent for a day whose 60 s of belief have run out: the next request probes it.
fn unbelieved(s: &Setup) {
    spent(s, "http://a.test/", secs(86_400));
    s.time.advance(crate::engine::rate_limit::BELIEF);
}

/// The next attempt of `d`, which must be sent at once with the default timeout, is sent.
fn send(d: &mut Decider<'_>, s: &Setup) {
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Send(secs(10))
    );
    d.attempt_started();
}

fn rate_limit(value: &'static str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("ratelimit", HeaderValue::from_static(value));
    headers
}

#[test]
fn a_spent_quota_holds_the_first_attempt_with_jitter_and_the_hold_counts_as_waited() {
    let s = Setup::default();
    spent(&s, "http://a.test/", secs(5));
    let mut d = s.decider(false);
    // The jitter above the hold is the first backoff's window: [0, 100 ms].
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), &|| 0u64),
        Next::Hold(secs(5))
    );
    drop(d);
    let mut d = s.decider(false);
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Hold(secs(5) + 100 * MS)
    );
    s.time.advance(secs(5) + 100 * MS);
    // The reset has passed: the attempt goes, its timeout cut to what the deadline leaves.
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Send(secs(10))
    );
    assert_eq!(d.waited(), secs(5) + 100 * MS);
    assert_eq!(
        s.counts().requests,
        2,
        "a request counts when it starts, held or not"
    );
}

#[test]
fn a_hold_the_deadline_cannot_cover_stops_before_anything_is_sent() {
    let s = Setup::new(policy(|p| p.deadline(secs(10))), None);
    spent(&s, "http://a.test/", secs(9));
    let mut d = s.decider(false);
    // Nine seconds of hold fit in ten: held, and the deadline runs from the start.
    assert!(matches!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Hold(_)
    ));
    s.time.advance(secs(9) + 100 * MS);
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Send(secs(10) - secs(9) - 100 * MS)
    );
    let s = Setup::new(policy(|p| p.deadline(secs(10))), None);
    spent(&s, "http://a.test/", secs(10));
    let mut d = s.decider(false);
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Stop(StopReason::QuotaExhausted)
    );
    assert_eq!(s.counts().attempts, 0);
}

#[test]
fn a_hold_longer_than_max_retry_after_stops() {
    let s = Setup::new(policy(|p| p.max_retry_after(secs(2))), None);
    spent(&s, "http://a.test/", secs(3));
    let mut d = s.decider(false);
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Stop(StopReason::QuotaExhausted)
    );
}

#[test]
fn a_quota_holds_its_own_origin_only() {
    let s = Setup::default();
    spent(&s, "http://b.test/", secs(5));
    let mut d = s.decider(false);
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Send(secs(10))
    );
}

#[test]
fn without_rate_limit_fields_a_spent_quota_is_not_heeded() {
    let s = Setup::new(policy(|p| p.rate_limit_fields(false)), None);
    spent(&s, "http://a.test/", secs(5));
    let mut d = s.decider(false);
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Send(secs(10))
    );
    begin_at(&mut d);
    let headers = rate_limit(r#""q";r=0;t=20"#);
    let observed = Observed {
        answer: Some(answer(429, &headers)),
        ..transient()
    };
    assert_eq!(d.after(observed, &s.time, TOP), Wait::Sleep(100 * MS));
}

fn begin_at(d: &mut Decider<'_>) {
    d.attempt_started();
}

#[test]
fn the_quota_an_answer_spends_is_a_floor_for_its_retry_or_a_stop() {
    let s = Setup::default();
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let headers = rate_limit(r#""q";r=0;t=5"#);
    let observed = Observed {
        answer: Some(answer(429, &headers)),
        ..transient()
    };
    assert_eq!(d.after(observed, &s.time, &|| 0u64), Wait::Sleep(secs(5)));
    assert_eq!(d.floor(), Some(secs(5)));
    s.time.advance(secs(5));
    begin(&mut d, &s.time);
    assert_eq!(s.counts().retry_after_honoured, 1);
    // A reset longer than the deadline leaves: the answer is returned, for the quota's reason.
    let headers = rate_limit(r#""q";r=0;t=40"#);
    let observed = Observed {
        answer: Some(answer(429, &headers)),
        ..transient()
    };
    assert_eq!(
        d.after(observed, &s.time, TOP),
        Wait::Stop(StopReason::QuotaExhausted)
    );
    assert_eq!(
        d.floor(),
        Some(secs(40)),
        "what the server asked for is reported"
    );
}

#[test]
fn a_retry_after_longer_than_the_quota_s_reset_keeps_its_own_reason() {
    let s = Setup::default();
    spent(&s, "http://a.test/", secs(1));
    let mut d = s.decider(false);
    assert!(matches!(
        d.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Hold(_)
    ));
    s.time.advance(secs(2));
    begin(&mut d, &s.time);
    spent(&s, "http://a.test/", secs(2));
    let headers = retry_after("3600");
    assert_eq!(
        d.after(asking(&headers), &s.time, TOP),
        Wait::Stop(StopReason::RetryAfterTooLong)
    );
}

#[test]
fn a_request_dropped_during_a_hold_before_its_retry_gives_the_tokens_back() {
    let s = Setup::default();
    {
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        assert!(matches!(d.after(transient(), &s.time, TOP), Wait::Sleep(_)));
        assert_eq!(s.balance(), 9_000);
        s.time.advance(100 * MS);
        // Another request's answer spent the quota during the wait.
        spent(&s, "http://a.test/", secs(5));
        assert!(matches!(
            d.next_attempt(s.time.now(), Some(&URL), TOP),
            Next::Hold(_)
        ));
    }
    assert_eq!(s.balance(), 10_000, "the retry never started");
    assert_eq!(s.counts().retries, 0);
}

#[test]
fn a_probe_goes_once_the_belief_runs_out_and_a_dropped_probe_is_given_back() {
    let s = Setup::default();
    unbelieved(&s);
    {
        let mut probe = s.decider(false);
        send(&mut probe, &s);
        // While the probe is out, the others are held for another minute: longer than they may.
        let mut other = s.decider(false);
        assert_eq!(
            other.next_attempt(s.time.now(), Some(&URL), TOP),
            Next::Stop(StopReason::QuotaExhausted)
        );
    }
    // The probe was dropped on the wire: the next request is the probe.
    let mut probe = s.decider(false);
    send(&mut probe, &s);
    // Its answer, with quota left or without a field, clears the quota for everyone.
    let ok = final_(StopReason::Succeeded, true);
    assert_eq!(
        probe.after(ok, &s.time, TOP),
        Wait::Stop(StopReason::Succeeded)
    );
    assert!(!s.quota.maybe_spent());
}

#[test]
fn a_probe_that_gets_no_answer_keeps_the_quota_believed_another_minute() {
    let s = Setup::default();
    unbelieved(&s);
    let mut probe = s.decider(false);
    send(&mut probe, &s);
    let broken = final_(StopReason::NotRetryable, false);
    probe.after(broken, &s.time, TOP);
    drop(probe);
    let origin = Origin::of(URL);
    assert_eq!(
        s.quota.floor(&origin, s.time.now()),
        Some(crate::engine::rate_limit::BELIEF)
    );
}

fn throttled(k: f64) -> Setup {
    let mut s = Setup::default();
    s.throttle = Some(
        AdaptiveThrottle::builder()
            .window(secs(3_600))
            .k(k)
            .build()
            .unwrap(),
    );
    s
}

#[test]
fn an_attempt_dropped_on_the_wire_counts_for_the_throttle_without_an_accept() {
    let s = throttled(2.0);
    let throttle = s.throttle.as_ref().unwrap();
    {
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
    }
    assert_eq!(throttle.counts(s.time.now()), (1, 0));
    // One that never left counts nothing.
    {
        let mut d = s.decider(false);
        assert!(matches!(
            d.next_attempt(s.time.now(), Some(&URL), TOP),
            Next::Send(_)
        ));
    }
    assert_eq!(
        throttle.counts(s.time.now()),
        (1, 0),
        "admitted, never sent"
    );
    // One that was answered counts once, when it ends.
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    d.after(final_(StopReason::Succeeded, true), &s.time, TOP);
    drop(d);
    assert_eq!(throttle.counts(s.time.now()), (2, 1));
}

#[test]
fn what_the_throttle_counts_as_accepted_follows_the_policy_s_statuses() {
    let mut s = throttled(2.0);
    s.policy = policy(|p| p.retryable_statuses([500]));
    let throttle = s.throttle.clone().unwrap();
    for (status, verdict) in [
        (503, Verdict::Final(StopReason::NotRetryable)),
        (500, Verdict::Transient(Cause::Status { throttled: false })),
    ] {
        let mut d = s.decider(true);
        begin(&mut d, &s.time);
        let headers = HeaderMap::new();
        let observed = Observed {
            verdict,
            answer: Some(answer(status, &headers)),
            resend: Some(&URL),
            timed_out: false,
            unsent: false,
        };
        d.after(observed, &s.time, TOP);
    }
    assert_eq!(
        throttle.counts(s.time.now()),
        (2, 1),
        "the 503 is accepted, the 500 is not"
    );
}

#[test]
fn a_throttle_rejection_gives_back_a_retry_s_tokens_and_a_probe() {
    let s = throttled(1.0);
    let throttle = s.throttle.as_ref().unwrap();
    // Ten attempts turned away: p = 10 / 11.
    for _ in 0..10 {
        let mut d = s.decider(true);
        begin(&mut d, &s.time);
        d.after(transient(), &s.time, TOP);
    }
    unbelieved(&s);
    let mut d = s.decider(false);
    assert_eq!(
        d.next_attempt(s.time.now(), Some(&URL), &|| 0u64),
        Next::Stop(StopReason::Throttled)
    );
    assert_eq!(s.counts().throttled, 1);
    assert_eq!(throttle.counts(s.time.now()), (11, 0));
    // The probe it took is back: the next request may probe.
    drop(d);
    let ticket = s.quota.gate(&Origin::of(URL), s.time.now());
    assert!(matches!(ticket, Gate::Probe(_)), "{ticket:?}");
}

#[test]
fn a_stamped_key_counts_only_when_the_first_attempt_is_sent() {
    let s = Setup::default();
    {
        let mut d = s.decider(false);
        d.key_stamped();
    }
    assert_eq!(s.counts().keys_stamped, 0);
    let mut d = s.decider(false);
    d.key_stamped();
    begin(&mut d, &s.time);
    assert!(matches!(d.after(transient(), &s.time, TOP), Wait::Sleep(_)));
    s.time.advance(secs(1));
    begin(&mut d, &s.time);
    assert_eq!(
        s.counts().keys_stamped,
        1,
        "once per request, not per attempt"
    );
}

#[test]
fn a_throttle_with_slices_shorter_than_an_attempt_counts_it_at_its_end() {
    let mut s = Setup::new(policy(|p| p.attempt_timeout(secs(10))), None);
    // Slices of 1 s; the attempt takes 3 s, so it is counted in the slice it ended in.
    s.throttle = Some(
        AdaptiveThrottle::builder()
            .window(secs(12))
            .build()
            .unwrap(),
    );
    let throttle = s.throttle.clone().unwrap();
    let start = s.time.now();
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    s.time.advance(secs(3));
    let ok = final_(StopReason::Succeeded, true);
    assert_eq!(d.stop_without_time(&ok), None, "the count needs the time");
    assert_eq!(d.after(ok, &s.time, TOP), Wait::Stop(StopReason::Succeeded));
    // Eleven seconds on, the slice of the admission has left the window; the end's has not.
    assert_eq!(throttle.counts(start + secs(12) + 500 * MS), (1, 1));
    assert_eq!(throttle.counts(start + secs(15) + 500 * MS), (0, 0));
}

#[test]
fn a_final_answer_needs_no_time_unless_the_quota_or_a_probe_has_something_to_take_in() {
    let s = Setup::default();
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let ok = final_(StopReason::Succeeded, true);
    assert_eq!(d.stop_without_time(&ok), Some(StopReason::Succeeded));
    assert_eq!(
        s.balance(),
        10_000,
        "the deposit is made, capped at the capacity"
    );

    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    assert_eq!(
        d.stop_without_time(&transient()),
        None,
        "a retry needs the time"
    );
    let headers = rate_limit(r#""q";r=5;t=1"#);
    let answered = Observed {
        verdict: Verdict::Final(StopReason::Succeeded),
        answer: Some(answer(200, &headers)),
        resend: Some(&URL),
        timed_out: false,
        unsent: false,
    };
    assert_eq!(d.stop_without_time(&answered), None, "a field to take in");
    let s = Setup::new(policy(|p| p.rate_limit_fields(false)), None);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    assert_eq!(d.stop_without_time(&answered), Some(StopReason::Succeeded));

    let s = Setup::default();
    unbelieved(&s);
    let mut probe = s.decider(false);
    begin(&mut probe, &s.time);
    assert_eq!(
        probe.stop_without_time(&ok),
        None,
        "a probe's answer clears the quota"
    );
}

#[test]
fn a_clock_whose_sleeps_pass_no_time_cannot_hold_a_request_for_ever() {
    let s = Setup::default();
    spent(&s, "http://a.test/", secs(5));
    let mut d = s.decider(false);
    let mut holds = 0;
    // Bounded: the core stops after its own limit, or the test fails at 100.
    for _ in 0..100 {
        match d.next_attempt(s.time.now(), Some(&URL), TOP) {
            Next::Hold(_) => holds += 1,
            other => {
                assert_eq!(other, Next::Stop(StopReason::QuotaExhausted));
                break;
            }
        }
    }
    assert_eq!(holds, MOST_HOLDS);
    assert_eq!(s.counts().attempts, 0);
}

#[test]
fn a_retry_after_as_long_as_the_quota_s_reset_names_the_retry_after() {
    let s = Setup::default();
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    // Another answer spent the quota for exactly as long as this one's Retry-After asks.
    spent(&s, "http://a.test/", secs(40));
    let headers = retry_after("40");
    assert_eq!(
        d.after(asking(&headers), &s.time, TOP),
        Wait::Stop(StopReason::RetryAfterTooLong)
    );
    // One second longer, and the quota is the reason.
    let mut d = s.decider(false);
    s.quota
        .update(&Origin::of(URL), Some(Quota::Left), s.time.now());
    begin(&mut d, &s.time);
    spent(&s, "http://a.test/", secs(41));
    assert_eq!(
        d.after(asking(&headers), &s.time, TOP),
        Wait::Stop(StopReason::QuotaExhausted)
    );
}

#[test]
fn a_throttle_whose_slices_last_an_attempt_timeout_counts_it_at_its_admission() {
    // Slices of 1 s, attempts of at most 1 s: counted in the slice of the admission, at once.
    let mut s = Setup::new(policy(|p| p.attempt_timeout(secs(1))), None);
    s.throttle = Some(
        AdaptiveThrottle::builder()
            .window(secs(12))
            .build()
            .unwrap(),
    );
    let throttle = s.throttle.clone().unwrap();
    let start = s.time.now();
    // Half a slice in, so that the attempt ends in the next slice.
    throttle.counts(start);
    s.time.advance(500 * MS);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    s.time.advance(900 * MS);
    let ok = final_(StopReason::Succeeded, true);
    assert_eq!(d.stop_without_time(&ok), Some(StopReason::Succeeded));
    // Twelve slices after the admission's, the count is gone; the end's slice would keep it.
    assert_eq!(throttle.counts(start + secs(11) + 900 * MS), (1, 1));
    assert_eq!(throttle.counts(start + secs(12) + 100 * MS), (0, 0));
}

#[test]
fn a_wait_field_takes_precedence_over_the_quota() {
    use crate::engine::rate_limit::Quota;
    let spent = |s| Some(Quota::Spent(Duration::from_secs(s)));
    let mut headers = HeaderMap::new();
    headers.insert("ratelimit", r#""default";r=0;t=12"#.parse().unwrap());
    assert_eq!(quota_said(&headers, true), spent(12));
    for name in ["retry-after", "retry-after-ms", "x-ms-retry-after-ms"] {
        let mut asked = headers.clone();
        asked.insert(name, "3".parse().unwrap());
        assert_eq!(quota_said(&asked, true), None, "{name}");
        // Unless the policy reads no wait fields: the quota is then what the answer says.
        assert_eq!(quota_said(&asked, false), spent(12), "{name}");
        // A value that cannot be read is no wait: the field beside it stays in force.
        for unreadable in ["soon", "1.5e3", "-1", ""] {
            let mut bad = headers.clone();
            bad.insert(name, unreadable.parse().unwrap());
            assert_eq!(quota_said(&bad, true), spent(12), "{name}: {unreadable:?}");
        }
    }
    // A date in the past is a valid wait of none: it takes precedence too.
    let mut past = headers.clone();
    past.insert(
        "retry-after",
        "Thu, 01 Jan 1970 00:00:00 GMT".parse().unwrap(),
    );
    assert_eq!(quota_said(&past, true), None);
}

/// A wait field is read on a transient failure only: on a final answer (a 403, a success, a
/// 429 the server said not to retry) the quota beside one holds the next request as if it were
/// not there.
#[test]
fn on_a_final_answer_a_wait_field_cancels_no_quota() {
    for (status, stop) in [
        (403, StopReason::NotRetryable),
        (200, StopReason::Succeeded),
        (400, StopReason::NotRetryable),
        (429, StopReason::NotRetryable),
    ] {
        let s = Setup::default();
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        let mut headers = rate_limit(r#""q";r=0;t=20"#);
        headers.insert("retry-after", HeaderValue::from_static("20"));
        let observed = Observed {
            verdict: Verdict::Final(stop),
            answer: Some(answer(status, &headers)),
            resend: Some(&URL),
            timed_out: false,
            unsent: false,
        };
        assert_eq!(
            d.after(observed, &s.time, TOP),
            Wait::Stop(stop),
            "{status}"
        );
        drop(d);
        let mut next = s.decider(false);
        assert_eq!(
            next.next_attempt(s.time.now(), Some(&URL), &|| 0u64),
            Next::Hold(secs(20)),
            "{status}: the next request is held by the quota"
        );
    }
    // On a transient failure the wait field takes precedence, as before.
    let s = Setup::default();
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let mut headers = rate_limit(r#""q";r=0;t=20"#);
    headers.insert("retry-after", HeaderValue::from_static("2"));
    let observed = Observed {
        answer: Some(answer(503, &headers)),
        ..transient()
    };
    assert!(matches!(d.after(observed, &s.time, TOP), Wait::Sleep(_)));
    drop(d);
    let mut next = s.decider(false);
    assert_eq!(
        next.next_attempt(s.time.now(), Some(&URL), TOP),
        Next::Send(secs(10))
    );
}
