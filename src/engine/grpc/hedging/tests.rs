use std::time::{Duration, Instant};

use super::*;

const MS: Duration = Duration::from_millis(1);

#[test]
fn each_copy_is_due_a_delay_after_the_one_before() {
    let t0 = Instant::now();
    let mut course = Course::start(50 * MS, t0);
    assert_eq!(course.due(), Some(t0 + 50 * MS));
    course.sent(t0 + 50 * MS);
    assert_eq!(course.due(), Some(t0 + 100 * MS));
    assert_eq!(course.out, 2);
}

#[test]
fn a_non_fatal_failure_brings_the_next_copy_forward_and_a_pushback_sets_it() {
    let t0 = Instant::now();
    let mut course = Course::start(500 * MS, t0);
    let end = CopyEnd::NonFatal(Pushback::Absent);
    assert_eq!(course.ended(end, t0 + 20 * MS), Then::Go);
    assert_eq!(course.due(), Some(t0 + 20 * MS), "at once");
    course.sent(t0 + 20 * MS);
    assert_eq!(
        course.due(),
        Some(t0 + 520 * MS),
        "then a delay apart again"
    );
    let end = CopyEnd::NonFatal(Pushback::Wait(300 * MS));
    assert_eq!(course.ended(end, t0 + 30 * MS), Then::Go);
    assert_eq!(
        course.due(),
        Some(t0 + 330 * MS),
        "exactly the pushback, later or sooner"
    );
}

#[test]
fn a_pushback_that_says_stop_sends_no_more_and_the_copies_out_run_on() {
    let t0 = Instant::now();
    let mut course = Course::start(10 * MS, t0);
    course.sent(t0 + 10 * MS);
    let stop = CopyEnd::NonFatal(Pushback::Stop);
    assert_eq!(
        course.ended(stop, t0 + 15 * MS),
        Then::Go,
        "one copy is out"
    );
    assert_eq!(course.due(), None);
    // A later wait does not open it again.
    let wait = CopyEnd::NonFatal(Pushback::Wait(MS));
    assert_eq!(
        course.ended(wait, t0 + 16 * MS),
        Then::End(StopReason::ServerDeclinedRetry)
    );
}

#[test]
fn an_answer_or_a_fatal_code_ends_the_call_with_copies_out() {
    for stop in [StopReason::Committed, StopReason::NotRetryable] {
        let t0 = Instant::now();
        let mut course = Course::start(MS, t0);
        course.sent(t0 + MS);
        course.sent(t0 + 2 * MS);
        assert_eq!(
            course.ended(CopyEnd::Ends(stop), t0 + 3 * MS),
            Then::End(stop)
        );
        assert_eq!(course.due(), None);
    }
}

#[test]
fn a_refused_copy_closes_the_course_and_the_last_failure_ends_it() {
    let t0 = Instant::now();
    let mut course = Course::start(MS, t0);
    assert_eq!(course.close(StopReason::BudgetExhausted), Then::Go);
    assert_eq!(course.due(), None);
    // The first reason stays.
    assert_eq!(course.close(StopReason::AttemptsExhausted), Then::Go);
    let end = CopyEnd::NonFatal(Pushback::Absent);
    assert_eq!(
        course.ended(end, t0 + MS),
        Then::End(StopReason::BudgetExhausted)
    );
    // With nothing out, a close ends it at once.
    let mut alone = Course::start(MS, t0);
    assert_eq!(
        alone.ended(CopyEnd::NonFatal(Pushback::Wait(MS)), t0),
        Then::Go
    );
    assert_eq!(
        alone.close(StopReason::AttemptsExhausted),
        Then::End(StopReason::AttemptsExhausted)
    );
}

#[cfg(feature = "grpc")]
#[test]
fn the_policy_keeps_a6_s_rules() {
    let build = |b: GrpcHedgingPolicyBuilder| b.build().map_err(|e| e.to_string());
    let ok = build(
        GrpcHedgingPolicy::builder()
            .max_attempts(9)
            .hedging_delay(5 * MS)
            .non_fatal_codes([14, 10]),
    )
    .unwrap();
    assert_eq!(ok.max_attempts(), 5, "cut to A6's cap");
    assert_eq!(ok.hedging_delay(), 5 * MS);
    assert!(ok.is_non_fatal(14) && ok.is_non_fatal(10) && !ok.is_non_fatal(13));
    assert!(!ok.is_non_fatal(-1) && !ok.is_non_fatal(300));
    let raised = GrpcHedgingPolicy::builder()
        .max_attempts(9)
        .allow_attempts_above_five(7)
        .non_fatal_codes([14]);
    assert_eq!(build(raised).unwrap().max_attempts(), 7);
    let default = build(
        GrpcHedgingPolicy::builder()
            .max_attempts(2)
            .non_fatal_codes([14]),
    );
    assert_eq!(default.unwrap().hedging_delay(), Duration::ZERO);
    for (builder, says) in [
        (
            GrpcHedgingPolicy::builder().non_fatal_codes([14]),
            "maxAttempts is required",
        ),
        (
            GrpcHedgingPolicy::builder()
                .max_attempts(1)
                .non_fatal_codes([14]),
            "maxAttempts (1) must be at least 2",
        ),
        (
            GrpcHedgingPolicy::builder()
                .max_attempts(2)
                .non_fatal_codes([17]),
            "nonFatalStatusCodes: 17 is not a gRPC status code",
        ),
    ] {
        let err = build(builder).unwrap_err();
        assert!(
            err.contains(says) && err.contains("gRPC hedging policy"),
            "{err}"
        );
    }
    let (run, rules) = ok.to_policy();
    assert_eq!(run.max_attempts(), 5);
    assert_eq!((rules.codes, rules.hedge_delay), (ok.codes(), Some(5 * MS)));
    assert_eq!(run.deadline(), crate::engine::grpc::NO_DEADLINE);
}

#[test]
fn a_delay_the_clock_cannot_count_is_never_due_and_never_overflows() {
    let t0 = Instant::now();
    let course = Course::start(Duration::MAX, t0);
    assert_eq!(course.due(), None);
    let mut course = Course::start(50 * MS, t0);
    course.sent(t0);
    let end = CopyEnd::NonFatal(Pushback::Wait(Duration::MAX));
    assert_eq!(course.ended(end, t0), Then::Go, "one copy still out");
    assert_eq!(course.due(), None);
}

#[cfg(feature = "grpc")]
#[test]
fn a_delay_longer_than_a_grpc_duration_is_refused_at_build() {
    let policy = |delay| {
        GrpcHedgingPolicy::builder()
            .max_attempts(2)
            .hedging_delay(delay)
            .non_fatal_codes([14])
            .build()
    };
    let err = policy(Duration::MAX).unwrap_err().to_string();
    assert!(
        err.contains("hedgingDelay") && err.contains("292 years"),
        "{err}"
    );
    assert!(policy(crate::engine::grpc::LONGEST).is_ok());
    let json = r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2,
        "hedgingDelay": "9223372036854775807s", "nonFatalStatusCodes": [14]}}]}"#;
    let err = crate::grpc::GrpcConfig::from_json(json)
        .unwrap_err()
        .to_string();
    assert!(err.contains("hedgingDelay"), "{err}");
}
