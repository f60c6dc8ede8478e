use std::time::{Duration, Instant};

use super::*;

const MS: Duration = Duration::from_millis(1);

#[test]
fn each_copy_is_due_a_delay_after_the_one_before() {
    let t0 = Instant::now();
    let mut course = Course::call(50 * MS, 2, t0);
    assert!(course.is_call());
    assert_eq!((course.due(), course.most()), (Some(t0 + 50 * MS), 2));
    course.sent(t0 + 50 * MS);
    assert_eq!(course.due(), Some(t0 + 100 * MS));
    assert_eq!(course.out, 2);
}

#[test]
fn a_non_fatal_failure_brings_the_next_copy_forward_and_a_pushback_sets_it() {
    let t0 = Instant::now();
    let mut course = Course::call(500 * MS, u32::MAX, t0);
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
    let mut course = Course::call(10 * MS, u32::MAX, t0);
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
        let mut course = Course::call(MS, u32::MAX, t0);
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
    let mut course = Course::call(MS, u32::MAX, t0);
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
    let mut alone = Course::call(MS, u32::MAX, t0);
    assert_eq!(
        alone.ended(CopyEnd::NonFatal(Pushback::Wait(MS)), t0),
        Then::Go
    );
    assert_eq!(
        alone.close(StopReason::AttemptsExhausted),
        Then::End(StopReason::AttemptsExhausted)
    );
}

#[test]
fn a_delay_the_clock_cannot_count_is_never_due_and_never_overflows() {
    let t0 = Instant::now();
    let course = Course::call(Duration::MAX, u32::MAX, t0);
    assert_eq!(course.due(), None);
    let mut course = Course::call(50 * MS, u32::MAX, t0);
    course.sent(t0);
    let end = CopyEnd::NonFatal(Pushback::Wait(Duration::MAX));
    assert_eq!(course.ended(end, t0), Then::Go, "one copy still out");
    assert_eq!(course.due(), None);
}

#[test]
fn a_hedged_attempt_sends_one_hedge_and_fails_with_its_last_copy() {
    let t0 = Instant::now();
    let mut course = Course::attempt(40 * MS, t0);
    assert!(!course.is_call());
    assert_eq!((course.due(), course.most()), (Some(t0 + 40 * MS), 1));
    course.sent(t0 + 40 * MS);
    assert_eq!(course.due(), None, "one hedge at most");
    // A failure with the other copy out waits for it, a pushback or not.
    let end = CopyEnd::NonFatal(Pushback::Wait(MS));
    assert_eq!(course.ended(end, t0 + 50 * MS), Then::Go);
    assert_eq!(course.due(), None);
    // The last copy's failure fails the attempt, as judged: a retry may follow.
    let end = CopyEnd::NonFatal(Pushback::Absent);
    assert_eq!(course.ended(end, t0 + 60 * MS), Then::Failed);
}

#[test]
fn a_hedged_attempt_whose_first_copy_fails_early_sends_no_hedge() {
    let t0 = Instant::now();
    let mut course = Course::attempt(40 * MS, t0);
    // Before the hedge's time: no copy at once (the retry has its own wait).
    let end = CopyEnd::NonFatal(Pushback::Absent);
    assert_eq!(course.ended(end, t0 + 5 * MS), Then::Failed);
    assert_eq!(course.due(), None);
    // A hedge refused leaves the first copy to end the attempt; an answer ends it.
    let mut course = Course::attempt(40 * MS, t0);
    assert_eq!(course.close(StopReason::BudgetExhausted), Then::Go);
    let answered = CopyEnd::Ends(StopReason::Succeeded);
    assert_eq!(
        course.ended(answered, t0 + 90 * MS),
        Then::End(StopReason::Succeeded)
    );
}
