//! A6's hedging policy against a real tonic server on 127.0.0.1: copies a delay apart on a
//! `FakeClock`, the first answer taken and the others cancelled on the server, a non-fatal
//! failure bringing the next copy forward, a pushback setting its time or stopping the copies,
//! the throttling, and the call's deadline over every copy. Each test moves the fake clock only
//! once the server, or the layer's observer, shows that the step before it has happened.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest_safe_retry::{
    FakeClock, RetryRecord, SeededRng, StopReason,
    grpc::{GrpcConfig, GrpcHedgingPolicy, GrpcRetryLayer, RetryThrottling},
};
use tonic::Code;
use tower_layer::Layer;

use super::server::{Act, Gate, Script, channel, say, serve, text};

/// A6's hedging policy: `attempts` copies, `delay` apart, `UNAVAILABLE` non-fatal.
fn hedging(attempts: u32, delay: Duration) -> GrpcHedgingPolicy {
    GrpcHedgingPolicy::builder()
        .max_attempts(attempts)
        .hedging_delay(delay)
        .non_fatal_codes([Code::Unavailable])
        .build()
        .unwrap()
}

/// What the layer's observer saw of each copy's end: its number, the wait before the next
/// copy, and why no copy goes any more.
type Seen = Arc<Mutex<Vec<(u32, Option<Duration>, Option<StopReason>)>>>;

/// The layer for `config` on a fake clock, with an observer.
fn layer(config: GrpcConfig) -> (GrpcRetryLayer, FakeClock, Seen) {
    let clock = FakeClock::new();
    let seen: Seen = Arc::default();
    let events = seen.clone();
    let layer = GrpcRetryLayer::new(config)
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(7))
        .with_observer(move |e| events.lock().unwrap().push((e.attempt, e.delay, e.stop)));
    (layer, clock, seen)
}

/// The layer for `echo.Echo` hedged `attempts` copies `delay` apart, on a fake clock, with an
/// observer.
fn hedged(attempts: u32, delay: Duration) -> (GrpcRetryLayer, FakeClock, Seen) {
    layer(
        GrpcConfig::new()
            .hedge("echo.Echo", hedging(attempts, delay))
            .unwrap(),
    )
}

fn gate() -> Gate {
    Gate::default()
}

/// Waits, in real time and for at most two seconds, until the observer has seen `n` events.
async fn observed(seen: &Seen, n: usize) {
    for _ in 0..400 {
        if seen.lock().unwrap().len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the layer never saw {n} copies end");
}

#[tokio::test]
async fn a_slow_call_is_hedged_after_the_delay_and_the_first_answer_wins_the_other_cancelled() {
    let slow = gate();
    let script = Script::new([Act::Held(slow.clone(), None)]);
    let uri = serve(&script).await;
    let config = GrpcConfig::new()
        .hedge("echo.Echo", hedging(3, Duration::from_millis(100)))
        .unwrap()
        .non_idempotent("echo.Echo/Say")
        .unwrap();
    let (layer, clock, _) = layer(config);
    let call = tokio::spawn(say(layer.layer(channel(&uri)), text("hello")));
    script.until(|s| s.seen().len() == 1).await;
    clock.advance(Duration::from_millis(99));
    // Not before the delay: the server still has one call when the hedge, sent at 100 ms,
    // has arrived.
    clock.advance(Duration::from_millis(1));
    let answer = call.await.unwrap().unwrap();
    assert_eq!(answer.get_ref().text, "hello");
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(
        (
            record.attempts(),
            record.stop_reason(),
            record.answered_by_hedge()
        ),
        (2, StopReason::Committed, true)
    );
    assert_eq!(
        script.values("grpc-previous-rpc-attempts"),
        [None, Some("1".into())]
    );
    let keys = script.values("idempotency-key");
    assert!(keys[0].is_some() && keys[0] == keys[1], "one key: {keys:?}");
    // The first copy, held, was cancelled on the server; no third copy went.
    script.until(|s| s.cancelled() == 1).await;
    assert_eq!(script.seen().len(), 2);
    // The method marked non-idempotent has its own name, and counters.
    let counted = layer.counters("echo.Echo/Say").unwrap();
    assert_eq!(
        (counted.attempts, counted.hedges, counted.hedges_won),
        (2, 1, 1)
    );
}

#[tokio::test]
async fn a_non_fatal_failure_sends_the_next_copy_at_once() {
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let (layer, clock, seen) = hedged(3, Duration::from_secs(10));
    // The clock never moves: the second copy goes as the first fails.
    let answer = say(layer.layer(channel(&uri)), text("x")).await.unwrap();
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!((record.attempts(), record.answered_by_hedge()), (2, true));
    assert_eq!(clock.elapsed(), Duration::ZERO);
    // The first copy's end is traced with the next copy's wait: none, and then the delay
    // again for the third.
    assert_eq!(seen.lock().unwrap()[0], (1, Some(Duration::ZERO), None));
}

#[tokio::test]
async fn a_fatal_code_ends_the_call_and_cancels_every_copy_out() {
    let (first, never) = (gate(), gate());
    let script = Script::new([
        Act::Held(first.clone(), Some((Code::InvalidArgument, None))),
        Act::Held(never.clone(), None),
        Act::Held(never.clone(), None),
    ]);
    let uri = serve(&script).await;
    // No delay: every copy at once.
    let (layer, _clock, _) = hedged(3, Duration::ZERO);
    let call = tokio::spawn(say(layer.layer(channel(&uri)), text("x")));
    script.until(|s| s.seen().len() == 3).await;
    first.notify_one();
    let status = call.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (3, StopReason::NotRetryable)
    );
    script.until(|s| s.cancelled() == 2).await;
}

#[tokio::test]
async fn a_pushback_sets_the_next_copy_s_time() {
    let script = Script::new([Act::Fail(Code::Unavailable, Some("300"))]);
    let uri = serve(&script).await;
    let (layer, clock, seen) = hedged(3, Duration::from_secs(1));
    let call = tokio::spawn(say(layer.layer(channel(&uri)), text("x")));
    observed(&seen, 1).await;
    // Exactly the pushback, neither at once nor the delay.
    assert_eq!(
        seen.lock().unwrap()[0],
        (1, Some(Duration::from_millis(300)), None)
    );
    clock.advance(Duration::from_millis(300));
    let answer = call.await.unwrap().unwrap();
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!((record.attempts(), record.waited()), (2, Duration::ZERO));
    assert_eq!(script.seen().len(), 2);
}

/// Issue 64, defects 1 and 4: a pushback past the call's deadline sends no further copy, and
/// the call, with none out, ends at its deadline, `DEADLINE_EXCEEDED`, as grpc-java's hedged
/// call does: not when the pushback ends (20 s after a 1 s deadline), nor at once with the
/// last failure's `UNAVAILABLE`.
#[tokio::test]
async fn a_pushback_past_the_deadline_sends_no_copy_and_the_call_ends_at_it_deadline_exceeded() {
    let script = Script::new([Act::Fail(Code::Unavailable, Some("20000"))]);
    let uri = serve(&script).await;
    let (layer, clock, seen) = hedged(3, Duration::from_millis(100));
    let mut request = text("x");
    request.set_timeout(Duration::from_secs(1));
    let call = tokio::spawn(say(layer.layer(channel(&uri)), request));
    observed(&seen, 1).await;
    // The next copy is asked about at the deadline, not at the pushback's end.
    assert_eq!(
        seen.lock().unwrap()[0],
        (1, Some(Duration::from_secs(1)), None)
    );
    clock.advance(Duration::from_millis(999));
    tokio::task::yield_now().await;
    assert!(!call.is_finished(), "the call runs to its deadline");
    clock.advance(Duration::from_millis(1));
    let status = call.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::DeadlineReached)
    );
    assert_eq!(clock.elapsed(), Duration::from_secs(1));
    assert_eq!(script.seen().len(), 1);
}

/// Issue 64, defects 1 and 4, on tokio's paused clock with the default clock: the call with a
/// 1 s deadline ends at it in virtual time, `DEADLINE_EXCEEDED`, not when a 20 s pushback
/// would end.
#[tokio::test(start_paused = true)]
async fn on_tokio_s_paused_clock_a_pushback_past_the_deadline_ends_the_call_at_it() {
    let script = Script::new([Act::Fail(Code::Unavailable, Some("20000"))]);
    let uri = serve(&script).await;
    let layer = GrpcRetryLayer::new(
        GrpcConfig::new()
            .hedge("echo.Echo", hedging(3, Duration::from_millis(100)))
            .unwrap(),
    );
    let mut request = text("x");
    request.set_timeout(Duration::from_secs(1));
    let started = tokio::time::Instant::now();
    let status = say(layer.layer(channel(&uri)), request).await.unwrap_err();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_millis(1100),
        "{took:?}"
    );
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::DeadlineReached)
    );
    assert_eq!(script.seen().len(), 1);
}

/// Issue 64, defect 3: a deadline shorter than the hedging delay still lets the next copy go
/// at once after a non-fatal failure, as A6 says (the HTTP rule made it one copy).
#[tokio::test]
async fn a_deadline_shorter_than_the_delay_still_sends_the_next_copy_at_once_after_a_failure() {
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let (layer, clock, _) = hedged(3, Duration::from_millis(500));
    let mut request = text("x");
    request.set_timeout(Duration::from_millis(200));
    let answer = say(layer.layer(channel(&uri)), request).await.unwrap();
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(
        (
            record.attempts(),
            record.stop_reason(),
            record.answered_by_hedge()
        ),
        (2, StopReason::Committed, true)
    );
    assert_eq!(clock.elapsed(), Duration::ZERO);
    assert_eq!(script.seen().len(), 2);
}

#[tokio::test]
async fn a_pushback_that_says_stop_sends_no_more_copies_and_the_one_out_answers() {
    let (first, second) = (gate(), gate());
    let script = Script::new([
        Act::Held(first.clone(), Some((Code::Unavailable, Some("-1")))),
        Act::Held(second.clone(), None),
    ]);
    let uri = serve(&script).await;
    let (layer, clock, seen) = hedged(4, Duration::from_millis(100));
    let call = tokio::spawn(say(layer.layer(channel(&uri)), text("x")));
    script.until(|s| s.seen().len() == 1).await;
    clock.advance(Duration::from_millis(100));
    script.until(|s| s.seen().len() == 2).await;
    first.notify_one();
    observed(&seen, 1).await;
    assert_eq!(
        seen.lock().unwrap()[0],
        (1, None, Some(StopReason::ServerDeclinedRetry))
    );
    // Time passes that would have sent two more copies.
    clock.advance(Duration::from_secs(1));
    second.notify_one();
    let answer = call.await.unwrap().unwrap();
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(
        (
            record.attempts(),
            record.stop_reason(),
            record.answered_by_hedge()
        ),
        (2, StopReason::Committed, true)
    );
}

#[tokio::test]
async fn the_throttling_sends_no_hedge_at_half_its_tokens() {
    // 2 tokens, half is 1: the first failure leaves 1, and no hedge goes.
    let throttling = RetryThrottling::new(2.0, 0.1).unwrap();
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let config = GrpcConfig::new()
        .hedge("echo.Echo", hedging(3, Duration::from_millis(100)))
        .unwrap()
        .retry_throttling(throttling.clone());
    let (layer, _clock, _) = layer(config);
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::BudgetExhausted)
    );
    assert_eq!(throttling.tokens(), 1.0);
    assert_eq!(script.seen().len(), 1);
}

#[tokio::test]
async fn the_call_s_deadline_cuts_every_copy_and_each_is_told_what_is_left() {
    let never = gate();
    let script = Script::new([
        Act::Held(never.clone(), None),
        Act::Held(never.clone(), None),
    ]);
    let uri = serve(&script).await;
    let (layer, clock, _) = hedged(2, Duration::from_millis(100));
    let mut request = text("x");
    request.set_timeout(Duration::from_millis(250));
    let call = tokio::spawn(say(layer.layer(channel(&uri)), request));
    script.until(|s| s.seen().len() == 1).await;
    clock.advance(Duration::from_millis(100));
    script.until(|s| s.seen().len() == 2).await;
    assert_eq!(
        script.values("grpc-timeout"),
        [Some("250000u".into()), Some("150000u".into())]
    );
    clock.advance(Duration::from_millis(150));
    let status = call.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (2, StopReason::DeadlineReached)
    );
    script.until(|s| s.cancelled() == 2).await;
}

#[tokio::test]
async fn a_call_past_the_buffer_limit_is_sent_once_unhedged() {
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let config = GrpcConfig::new()
        .hedge("echo.Echo", hedging(3, Duration::ZERO))
        .unwrap()
        .buffer_limits(16, 1 << 20);
    let (layer, _clock, _) = layer(config);
    let status = say(layer.layer(channel(&uri)), text(&"x".repeat(64)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::BodyNotCloneable)
    );
    assert_eq!(script.seen().len(), 1);
}
