//! The gRPC door against a real tonic server on 127.0.0.1, scripted call by call: attempts,
//! waits and headers exactly as gRFC A6 says, on a `FakeClock` and on tokio's paused clock.

mod hedging;
mod model;
pub(crate) mod server;

use std::time::Duration;

use reqwest_safe_retry::{
    FakeClock, RandomSource, RetryOverride, RetryRecord, SeededRng, StopReason,
    grpc::{GrpcConfig, GrpcHedgingPolicy, GrpcRetryLayer, GrpcRetryPolicy, RetryThrottling},
};
use server::{Act, Gate, Script, channel, count, say, serve, text};
use tonic::Code;
use tower_layer::Layer;

const SEED: u64 = 7;

/// A6's policy: `attempts`, from 100 ms by 2 up to 1 s, `UNAVAILABLE` retried.
fn unavailable(attempts: u32) -> GrpcRetryPolicy {
    GrpcRetryPolicy::builder()
        .max_attempts(attempts)
        .initial_backoff(Duration::from_millis(100))
        .max_backoff(Duration::from_secs(1))
        .retryable_codes([Code::Unavailable])
        .build()
        .unwrap()
}

/// A6's wait before retry `n` (from 0) without pushback, for the draw `x`: the ceiling
/// `min(100 ms * 2^n, 1 s)` times a factor from [0.8, 1.2], as the crate draws it.
fn a6_wait(n: u32, x: u64) -> Duration {
    let ceiling = Duration::from_millis(100 * 2u64.pow(n)).min(Duration::from_secs(1));
    let spread = u64::try_from((ceiling * 2 / 5).as_nanos()).unwrap();
    let drawn = (u128::from(x) * (u128::from(spread) + 1)) >> 64;
    ceiling * 4 / 5 + Duration::from_nanos(drawn as u64)
}

/// The layer retrying `UNAVAILABLE` for every method of `echo.Echo` (`attempts` in all), on a
/// fake clock with the test's seed.
fn faked_retrying(attempts: u32) -> (GrpcRetryLayer, FakeClock) {
    faked(
        GrpcConfig::new()
            .retry("echo.Echo", unavailable(attempts))
            .unwrap(),
    )
}

/// Calls that fail through `service` until the layer's retry budget refuses a retry (within
/// eight calls: the default budget holds 10 tokens).
async fn drain(service: &reqwest_safe_retry::grpc::GrpcRetryService<tonic::transport::Channel>) {
    for _ in 0..8 {
        let status = say(service.clone(), text("x")).await.unwrap_err();
        let stop = RetryRecord::of_status(&status).unwrap().stop_reason();
        if stop == StopReason::BudgetExhausted {
            return;
        }
    }
    panic!("the budget never ran dry");
}

/// The layer for `config` on a fake clock with the test's seed.
fn faked(config: GrpcConfig) -> (GrpcRetryLayer, FakeClock) {
    let clock = FakeClock::new();
    let layer = GrpcRetryLayer::new(config)
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(SEED));
    (layer, clock)
}

#[tokio::test]
async fn a_unary_call_survives_two_unavailables_and_a_pushback_with_one_key() {
    let script = Script::new([
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, Some("250")),
    ]);
    let uri = serve(&script).await;
    let config = GrpcConfig::new()
        .retry("echo.Echo", unavailable(4))
        .unwrap()
        .non_idempotent("echo.Echo/Say")
        .unwrap();
    let (layer, clock) = faked(config);
    let answer = say(layer.layer(channel(&uri)), text("hello"))
        .await
        .unwrap();
    assert_eq!(answer.get_ref().text, "hello");
    let record = &RetryRecord::of(&answer).expect("the layer's answers carry a record");
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (3, StopReason::Committed)
    );
    // A6's first backoff, then exactly the pushback.
    let draws = SeededRng::new(SEED);
    assert_eq!(
        clock.sleeps(),
        [a6_wait(0, draws.next_u64()), Duration::from_millis(250)]
    );
    assert_eq!(
        script.values("grpc-previous-rpc-attempts"),
        [None, Some("1".into()), Some("2".into())]
    );
    // Each copy goes as tonic's own would: no length announced.
    assert_eq!(script.values("content-length"), [None, None, None]);
    let keys = script.values("idempotency-key");
    assert!(keys[0].is_some(), "a key in metadata");
    assert!(
        keys.iter().all(|k| *k == keys[0]),
        "the same on every attempt: {keys:?}"
    );
    assert_eq!(
        record.idempotency_key().unwrap().to_str().unwrap(),
        keys[0].as_deref().unwrap()
    );
}

#[tokio::test]
async fn an_idempotent_method_carries_no_key() {
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let (layer, _clock) = faked_retrying(2);
    say(layer.layer(channel(&uri)), text("x")).await.unwrap();
    assert_eq!(script.values("idempotency-key"), [None, None]);
}

#[tokio::test]
async fn a_code_the_policy_does_not_retry_is_handed_back_at_once_as_tonic_reads_it() {
    let script = Script::new([Act::Fail(Code::InvalidArgument, None)]);
    let uri = serve(&script).await;
    let (layer, clock) = faked_retrying(4);
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::InvalidArgument, "scripted")
    );
    let record = RetryRecord::of_status(&status).expect("the layer's record");
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::NotRetryable)
    );
    assert_eq!(script.seen().len(), 1);
    assert!(clock.sleeps().is_empty());
}

#[tokio::test]
async fn the_last_status_comes_back_with_its_record_when_attempts_run_out() {
    let script = Script::new([
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
    ]);
    let uri = serve(&script).await;
    let (layer, clock) = faked_retrying(3);
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (3, StopReason::AttemptsExhausted)
    );
    let draws = SeededRng::new(SEED);
    let expected: Vec<Duration> = (0..2).map(|n| a6_wait(n, draws.next_u64())).collect();
    assert_eq!(clock.sleeps(), expected);
    assert_eq!(record.waited(), expected.iter().sum::<Duration>());
    assert_eq!(script.seen().len(), 3);
}

#[tokio::test]
async fn a_negative_or_malformed_pushback_ends_the_call() {
    for pushback in ["-1", "soon"] {
        let script = Script::new([Act::Fail(Code::Unavailable, Some(pushback))]);
        let uri = serve(&script).await;
        let (layer, clock) = faked_retrying(4);
        let status = say(layer.layer(channel(&uri)), text("x"))
            .await
            .unwrap_err();
        let record = RetryRecord::of_status(&status).unwrap();
        assert_eq!(
            record.stop_reason(),
            StopReason::ServerDeclinedRetry,
            "{pushback}"
        );
        assert_eq!(
            (script.seen().len(), clock.sleeps().len()),
            (1, 0),
            "{pushback}"
        );
    }
}

#[tokio::test]
async fn a_stream_that_committed_then_failed_is_not_retried() {
    let script = Script::new([Act::SendThenFail(Code::Unavailable)]);
    let uri = serve(&script).await;
    let (layer, clock) = faked_retrying(4);
    let (got, ended) = count(layer.layer(channel(&uri)), "once").await;
    assert_eq!(got, ["once"]);
    assert_eq!(ended.unwrap_err().code(), Code::Unavailable);
    assert_eq!(script.seen().len(), 1, "committed: never retried");
    assert!(clock.sleeps().is_empty());
}

#[tokio::test]
async fn a_stream_refused_before_it_committed_is_retried() {
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let (layer, _clock) = faked_retrying(4);
    let (got, ended) = count(layer.layer(channel(&uri)), "twice").await;
    ended.unwrap();
    assert_eq!(got, ["twice", "twice"]);
    assert_eq!(script.seen().len(), 2);
}

#[tokio::test]
async fn the_call_s_deadline_spans_its_attempts_and_each_is_told_what_is_left() {
    let script = Script::new([Act::Fail(Code::Unavailable, Some("1500"))]);
    let uri = serve(&script).await;
    let (layer, clock) = faked_retrying(4);
    let mut request = text("x");
    request.set_timeout(Duration::from_secs(5));
    say(layer.layer(channel(&uri)), request).await.unwrap();
    assert_eq!(clock.sleeps(), [Duration::from_millis(1500)]);
    let timeouts = script.values("grpc-timeout");
    // tonic writes the caller's 5 s; the retry is told what is left after the 1.5 s wait.
    assert_eq!(timeouts[0].as_deref(), Some("5000000u"));
    assert_eq!(timeouts[1].as_deref(), Some("3500000u"));

    // A pushback past what is left is waited to the deadline, where the call ends
    // `DEADLINE_EXCEEDED` (grpc-go's and grpc-java's status then), its record saying so.
    let script = Script::new([Act::Fail(Code::Unavailable, Some("6000"))]);
    let uri = serve(&script).await;
    let (layer, clock) = faked_retrying(4);
    let mut request = text("x");
    request.set_timeout(Duration::from_secs(5));
    let status = say(layer.layer(channel(&uri)), request).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::DeadlineReached)
    );
    assert_eq!(clock.sleeps(), [Duration::from_secs(5)]);
    assert_eq!(script.seen().len(), 1);
}

#[tokio::test]
async fn the_throttling_stops_retries_at_half_its_tokens_and_a_committed_ok_refills_it() {
    let throttling = RetryThrottling::new(3.0, 0.5).unwrap();
    let config = GrpcConfig::new()
        .retry("echo.Echo", unavailable(5))
        .unwrap()
        .retry_throttling(throttling.clone());
    let script = Script::new([
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
    ]);
    let uri = serve(&script).await;
    let (layer, _clock) = faked(config);
    let service = layer.layer(channel(&uri));
    // 3 → 2 (above 1.5: retried) → 1 (at or below: not).
    let status = say(service.clone(), text("x")).await.unwrap_err();
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (2, StopReason::BudgetExhausted)
    );
    assert_eq!(throttling.tokens(), 1.0);
    // A call that commits and ends OK adds the ratio when its trailers pass.
    say(service, text("y")).await.unwrap();
    assert_eq!(throttling.tokens(), 1.5);
    assert_eq!(script.seen().len(), 3);
}

#[tokio::test]
async fn a_call_past_the_buffer_limit_is_committed_and_sent_once() {
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let config = GrpcConfig::new()
        .retry("echo.Echo", unavailable(4))
        .unwrap()
        .buffer_limits(16, 1 << 20);
    let (layer, _clock) = faked(config);
    let status = say(layer.layer(channel(&uri)), text(&"x".repeat(64)))
        .await
        .unwrap_err();
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::BodyNotCloneable)
    );
    assert_eq!(script.seen().len(), 1);
}

#[tokio::test]
async fn a_method_without_a_policy_is_sent_once_and_the_closest_name_wins() {
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let config = GrpcConfig::new()
        .retry("echo.Echo/Other", unavailable(4))
        .unwrap();
    let (layer, _clock) = faked(config);
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    assert_eq!(RetryRecord::of_status(&status).unwrap().attempts(), 1);

    // The method's own policy over its service's, its service's over every method's.
    let script = Script::new([
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
    ]);
    let uri = serve(&script).await;
    let config = GrpcConfig::new()
        .retry("", unavailable(5))
        .unwrap()
        .retry("echo.Echo/Say", unavailable(2))
        .unwrap()
        .retry("echo.Echo", unavailable(3))
        .unwrap();
    let (layer, _clock) = faked(config);
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    assert_eq!(RetryRecord::of_status(&status).unwrap().attempts(), 2);
}

#[tokio::test]
async fn a_refused_connection_is_retried_and_ends_as_unavailable() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let (layer, clock) = faked_retrying(3);
    let status = say(
        layer.layer(channel(&format!("http://127.0.0.1:{port}"))),
        text("x"),
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let record = RetryRecord::of_status(&status).expect("the layer's record");
    // A6's transparent retry at once (nothing was sent), then the policy's three attempts.
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (4, StopReason::AttemptsExhausted)
    );
    let draws = SeededRng::new(SEED);
    let backoffs: Vec<Duration> = (0..2).map(|n| a6_wait(n, draws.next_u64())).collect();
    assert_eq!(clock.sleeps(), [&[Duration::ZERO][..], &backoffs].concat());

    // With a deadline shorter than the first backoff, A6's transparent retry still goes at
    // once; the backoff after it would cross the deadline, so the call waits out what is left
    // and ends there, `DEADLINE_EXCEEDED`, as grpc-go's and grpc-java's calls do.
    let (layer, clock) = faked_retrying(3);
    let mut request = text("x");
    request.set_timeout(Duration::from_millis(50));
    let status = say(
        layer.layer(channel(&format!("http://127.0.0.1:{port}"))),
        request,
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let record = RetryRecord::of_status(&status).expect("the layer's record");
    assert_eq!(record.stop_reason(), StopReason::DeadlineReached);
    assert_eq!(
        (record.attempts(), clock.sleeps()),
        (2, vec![Duration::ZERO, Duration::from_millis(50)]),
        "{record:?}"
    );
}

/// `echo.Echo` retried on `UNAVAILABLE` up to 5 attempts, under a throttling of 3 tokens
/// (a ratio of 0.5): the second failure in a row leaves 1, below half, and stops retries.
fn throttled_at_three() -> GrpcConfig {
    GrpcConfig::new()
        .retry("echo.Echo", unavailable(5))
        .unwrap()
        .retry_throttling(RetryThrottling::new(3.0, 0.5).unwrap())
}

/// Issue 64, defect 8: a cloned config serving another server does not share its throttling
/// count: server A's failures, which stop A's retries, leave server B's retries going.
#[tokio::test]
async fn a_cloned_config_s_throttling_counts_each_server_alone() {
    let config = throttled_at_three();
    let failing = Script::new([
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
    ]);
    let other = Script::new([Act::Fail(Code::Unavailable, None)]);
    let (a, b) = (serve(&failing).await, serve(&other).await);
    let (layer_a, _) = faked(config.clone());
    let (layer_b, _) = faked(config);
    // A: 3 → 2 (retried) → 1 (not): throttled.
    let status = say(layer_a.layer(channel(&a)), text("x"))
        .await
        .unwrap_err();
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(record.stop_reason(), StopReason::BudgetExhausted);
    // B's count is its own, full: its failure is retried, and the call answered.
    let answer = say(layer_b.layer(channel(&b)), text("y")).await.unwrap();
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (2, StopReason::Committed)
    );
    assert_eq!((failing.seen().len(), other.seen().len()), (2, 2));
}

/// Issue 64: throttling per server name. Two channels to one server, each from its own
/// `layer.layer(channel)`, share the server's count when the layer names it: the first
/// channel's failures stop the second's retries; a layer naming another server counts alone.
#[tokio::test]
async fn channels_to_one_named_server_share_its_throttling_count() {
    let config = throttled_at_three();
    let script = Script::new([
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
    ]);
    let uri = serve(&script).await;
    let (layer, _) = faked(config);
    let layer = layer.with_target("dns:///echo");
    // The first channel: 3 → 2 (retried) → 1 (not): throttled.
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (2, StopReason::BudgetExhausted)
    );
    // A second channel to the same server: the same count, at 1: its failure is not retried.
    let status = say(layer.layer(channel(&uri)), text("y"))
        .await
        .unwrap_err();
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::BudgetExhausted)
    );
    // A clone of the layer naming another server: a full count of its own, whose retry
    // goes (and the script, past its failures, answers).
    let other = layer.clone().with_target("dns:///other");
    let answer = say(other.layer(channel(&uri)), text("z")).await.unwrap();
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(record.attempts(), 2, "{record:?}");
    assert_eq!(script.seen().len(), 5);
}

#[tokio::test]
async fn a_committed_call_that_fails_with_a_counted_code_takes_a_token() {
    for (name, config) in [
        (
            "retry",
            GrpcConfig::new()
                .retry("echo.Echo", unavailable(3))
                .unwrap(),
        ),
        (
            "hedging",
            GrpcConfig::new()
                .hedge(
                    "echo.Echo",
                    reqwest_safe_retry::grpc::GrpcHedgingPolicy::builder()
                        .max_attempts(2)
                        .non_fatal_codes([Code::Unavailable])
                        .build()
                        .unwrap(),
                )
                .unwrap(),
        ),
    ] {
        let throttling = RetryThrottling::new(3.0, 0.5).unwrap();
        let script = Script::new([Act::SendThenFail(Code::Unavailable)]);
        let uri = serve(&script).await;
        let (layer, _clock) = faked(config.retry_throttling(throttling.clone()));
        let (got, ended) = count(layer.layer(channel(&uri)), "once").await;
        assert_eq!(
            (got.len(), ended.unwrap_err().code()),
            (1, Code::Unavailable)
        );
        // Counted as its trailers passed: one token taken.
        assert_eq!(throttling.tokens(), 2.0, "{name}");
    }
}

#[tokio::test(start_paused = true)]
async fn on_tokio_s_paused_clock_the_waits_take_virtual_time() {
    let script = Script::new([
        Act::Fail(Code::Unavailable, Some("30000")),
        Act::Fail(Code::Unavailable, None),
    ]);
    let uri = serve(&script).await;
    let layer = GrpcRetryLayer::new(
        GrpcConfig::new()
            .retry("echo.Echo", unavailable(4))
            .unwrap(),
    );
    let started = tokio::time::Instant::now();
    let real = std::time::Instant::now();
    let answer = say(layer.layer(channel(&uri)), text("x")).await.unwrap();
    let record = answer.extensions().get::<RetryRecord>().unwrap();
    assert_eq!(record.attempts(), 3);
    // 30 s of pushback and a backoff of 80 to 120 ms, in virtual time.
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(30_080), "{waited:?}");
    assert!(
        real.elapsed() < Duration::from_secs(10),
        "{:?}",
        real.elapsed()
    );
}

#[tokio::test]
async fn a_slow_answer_past_the_call_s_deadline_ends_it_deadline_exceeded() {
    let script = Script::new([Act::Slow(Duration::from_secs(5))]);
    let uri = serve(&script).await;
    // On a fake clock that never moves, only tonic's channel's timer can end the call.
    let (layer, _clock) = faked_retrying(4);
    let mut request = text("x");
    request.set_timeout(Duration::from_millis(50));
    let started = std::time::Instant::now();
    let status = say(layer.layer(channel(&uri)), request).await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    // tonic's channel times the call out at the `grpc-timeout` each attempt carries: the
    // caller gets `DEADLINE_EXCEEDED` (tonic's own error says `CANCELLED`), with the layer's
    // record, as when the layer's own timer ends it (`grpc::hedging`'s deadline test).
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let record = RetryRecord::of_status(&status).expect("the layer's record");
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::DeadlineReached)
    );
}

/// Issue 64, defect 3: a deadline shorter than the backoff still lets A6's sends within it
/// go: here a pushback shorter than what is left (the HTTP rule made it one attempt).
#[tokio::test]
async fn a_deadline_shorter_than_the_backoff_still_waits_a_pushback_within_it() {
    let script = Script::new([Act::Fail(Code::Unavailable, Some("50"))]);
    let uri = serve(&script).await;
    let slow = GrpcRetryPolicy::builder()
        .max_attempts(3)
        .initial_backoff(Duration::from_millis(500))
        .max_backoff(Duration::from_secs(1))
        .retryable_codes([Code::Unavailable])
        .build()
        .unwrap();
    let (layer, clock) = faked(GrpcConfig::new().retry("echo.Echo", slow).unwrap());
    let mut request = text("x");
    request.set_timeout(Duration::from_millis(200));
    let answer = say(layer.layer(channel(&uri)), request).await.unwrap();
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (2, StopReason::Committed)
    );
    assert_eq!(clock.sleeps(), [Duration::from_millis(50)]);
    // The retry was told what is left after the wait.
    assert_eq!(script.values("grpc-timeout")[1].as_deref(), Some("150000u"));
}

/// Issue 64, defect 4: a backoff that would cross the deadline is waited to it, and the call
/// ends there `DEADLINE_EXCEEDED` (grpc-go's `shouldRetry` waits on the call's context,
/// grpc-java's deadline timer cancels the scheduled retry), not at once with the last
/// `UNAVAILABLE`, early.
#[tokio::test]
async fn a_backoff_past_the_deadline_ends_the_call_at_it_deadline_exceeded() {
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let (layer, clock) = faked_retrying(4);
    let mut request = text("x");
    // The first backoff is 80 to 120 ms.
    request.set_timeout(Duration::from_millis(60));
    let status = say(layer.layer(channel(&uri)), request).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let record = RetryRecord::of_status(&status).expect("the layer's record");
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::DeadlineReached)
    );
    assert_eq!(clock.sleeps(), [Duration::from_millis(60)]);
    assert_eq!(clock.elapsed(), Duration::from_millis(60));
    assert_eq!(script.seen().len(), 1);
    let counts = layer.counters("echo.Echo").unwrap();
    assert_eq!((counts.retries, counts.deadline_stops), (0, 1));
}

/// Issue 64, defect 9: a method config's `timeout` is the call's deadline when the call sets
/// none or a later one (grpc-go takes the earlier of the two), and the server is told it in
/// `grpc-timeout`, what is left of it on each retry.
#[tokio::test]
async fn a_method_s_timeout_is_the_deadline_of_calls_that_set_none_or_a_later_one() {
    let json = r#"{"methodConfig": [{"name": [{"service": "echo.Echo"}], "timeout": "0.2s",
      "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                      "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#;
    for (own, told) in [
        (None, ["200000u", "150000u"]),
        (Some(Duration::from_secs(5)), ["200000u", "150000u"]),
        (Some(Duration::from_millis(100)), ["100000u", "50000000n"]),
    ] {
        let script = Script::new([Act::Fail(Code::Unavailable, Some("50"))]);
        let uri = serve(&script).await;
        let (layer, clock) = faked(GrpcConfig::from_json(json).unwrap());
        let mut request = text("x");
        if let Some(own) = own {
            request.set_timeout(own);
        }
        say(layer.layer(channel(&uri)), request).await.unwrap();
        assert_eq!(clock.sleeps(), [Duration::from_millis(50)], "{own:?}");
        let values = script.values("grpc-timeout");
        let values: Vec<_> = values.iter().map(|v| v.as_deref().unwrap()).collect();
        assert_eq!(values, told, "{own:?}");
    }
    // A pushback past the method's timeout is waited to it: the call ends there.
    let script = Script::new([Act::Fail(Code::Unavailable, Some("300"))]);
    let uri = serve(&script).await;
    let (layer, clock) = faked(GrpcConfig::from_json(json).unwrap());
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(clock.sleeps(), [Duration::from_millis(200)]);
}

/// A channel whose answers come as the call's deadline passes: each moves the clock `by`
/// once it has come, before the layer reads it.
#[derive(Clone)]
struct Late {
    channel: tonic::transport::Channel,
    clock: FakeClock,
    by: Duration,
}

impl tower_service::Service<http::Request<tonic::body::Body>> for Late {
    type Response = <tonic::transport::Channel as tower_service::Service<
        http::Request<tonic::body::Body>,
    >>::Response;
    type Error = tonic::transport::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.channel.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let answer = self.channel.call(request);
        let (clock, by) = (self.clock.clone(), self.by);
        Box::pin(async move {
            let answer = answer.await;
            clock.advance(by);
            answer
        })
    }
}

/// Issue 64, defect 4: a server's `CANCELLED` that comes at the call's deadline (tonic's
/// server gives up at the `grpc-timeout` it was told, as the client's timer fires) ends the
/// call `DEADLINE_EXCEEDED`, as grpc-java's call reads it; before the deadline it is the
/// server's own answer.
#[tokio::test]
async fn a_cancelled_that_comes_at_the_deadline_is_deadline_exceeded() {
    for (by, code, stop) in [
        (
            Duration::from_millis(200),
            Code::DeadlineExceeded,
            StopReason::DeadlineReached,
        ),
        (
            Duration::from_millis(199),
            Code::Cancelled,
            StopReason::NotRetryable,
        ),
    ] {
        let script = Script::new([Act::Fail(Code::Cancelled, None)]);
        let uri = serve(&script).await;
        let (layer, clock) = faked_retrying(4);
        let late = Late {
            channel: channel(&uri),
            clock: clock.clone(),
            by,
        };
        let mut request = text("x");
        request.set_timeout(Duration::from_millis(200));
        let status = say(layer.layer(late), request).await.unwrap_err();
        assert_eq!(status.code(), code, "{by:?}: {status:?}");
        let record = RetryRecord::of_status(&status).expect("the layer's record");
        assert_eq!(
            (record.attempts(), record.stop_reason()),
            (1, stop),
            "{by:?}"
        );
        assert_eq!(script.seen().len(), 1);
    }
}

/// What a raw HTTP/2 server does with a stream.
#[derive(Debug, Clone, Copy)]
enum Raw {
    /// Refuses it unprocessed (`REFUSED_STREAM`).
    Refuse,
    /// A trailers-only answer with this `grpc-status`.
    Status(&'static str),
    /// What a proxy in front of the server answers: this HTTP status, no `grpc-status`.
    Http(u16),
}

/// An HTTP/2 server that does with each stream what `script` says, in order (the last act for
/// the rest), which no tonic server can be made to do; the streams it got.
async fn raw_h2(script: Vec<Raw>) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let streams = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = streams.clone();
    tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        let mut connection = h2::server::handshake(socket).await.unwrap();
        // Bounded: the test's call makes a handful of streams.
        for _ in 0..16 {
            let Some(Ok((_request, mut respond))) = connection.accept().await else {
                return;
            };
            let n = counted.fetch_add(1, Ordering::SeqCst);
            match script[n.min(script.len() - 1)] {
                Raw::Refuse => respond.send_reset(h2::Reason::REFUSED_STREAM),
                Raw::Status(code) => {
                    let answer = http::Response::builder()
                        .header("content-type", "application/grpc")
                        .header("grpc-status", code)
                        .body(())
                        .unwrap();
                    respond.send_response(answer, true).unwrap();
                }
                Raw::Http(status) => {
                    let answer = http::Response::builder()
                        .status(status)
                        .header("content-type", "text/plain")
                        .body(())
                        .unwrap();
                    respond.send_response(answer, true).unwrap();
                }
            }
        }
    });
    (format!("http://{address}"), streams)
}

/// Issue 64, defect 7 (with the feature `grpc` alone, as with `http2`: the gRPC door reads
/// HTTP/2's own signals, which tonic's transport always speaks).
#[tokio::test]
async fn a_stream_refused_unprocessed_is_retried_at_once_beyond_the_policy_s_attempts() {
    let (uri, streams) = raw_h2(vec![Raw::Refuse, Raw::Status("14")]).await;
    let (layer, clock) = faked_retrying(2);
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (3, StopReason::AttemptsExhausted)
    );
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 3);
    let draws = SeededRng::new(SEED);
    assert_eq!(
        clock.sleeps(),
        [Duration::ZERO, a6_wait(0, draws.next_u64())]
    );
}

/// Issue 64, defect 10: a proxy's `503` or `429` (no `grpc-status`) is retried as the
/// `UNAVAILABLE` it stands for, and the give-up carries its record, as any other does, with the
/// status tonic reads from such an answer.
#[tokio::test]
async fn a_proxy_s_http_failure_given_up_carries_the_record() {
    for proxy in [503, 429] {
        let status = given_up_at_a_raw_peer(Raw::Http(proxy), 3, 3).await;
        assert_eq!(
            status.message(),
            format!("grpc-status header missing, mapped from HTTP status code {proxy}")
        );
    }
}

/// A call to a raw HTTP/2 peer that does `act` with every stream, through a layer whose
/// policy tries `UNAVAILABLE` `tries` times: it ends `UNAVAILABLE` after `attempts` attempts
/// (the peer saw as many streams), with its record; the status.
async fn given_up_at_a_raw_peer(act: Raw, tries: u32, attempts: u32) -> tonic::Status {
    let (uri, streams) = raw_h2(vec![act]).await;
    let (layer, _clock) = faked_retrying(tries);
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{act:?}: {status:?}");
    let record = RetryRecord::of_status(&status).expect("the layer's record");
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (attempts, StopReason::AttemptsExhausted),
        "{act:?}"
    );
    let streams = streams.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(streams, attempts as usize);
    status
}

/// Issue 64, defect 7: a stream the server refuses every time ends `UNAVAILABLE`, as gRPC's
/// HTTP/2 mapping says of `REFUSED_STREAM`, with the record: one transparent retry, then the
/// policy's two attempts.
#[tokio::test]
async fn a_stream_refused_every_time_ends_unavailable_with_its_record() {
    given_up_at_a_raw_peer(Raw::Refuse, 2, 3).await;
}

/// Issue 64, defect 2: a per-call `RetryOverride` narrows the call, never drops its
/// `grpc-timeout`: every attempt is told what is left of the call's deadline, and the call
/// ends `DEADLINE_EXCEEDED` at it.
#[tokio::test]
async fn an_override_keeps_the_call_s_deadline() {
    let never = Gate::default();
    let script = Script::new((0..4).map(|_| Act::Held(never.clone(), None)));
    let uri = serve(&script).await;
    let (layer, clock) = faked_retrying(4);
    for over in [
        RetryOverride::new().max_attempts(3),
        RetryOverride::new().attempt_timeout(Duration::from_secs(60)),
        RetryOverride::new().deadline(Duration::from_secs(60)),
    ] {
        let mut request = text("x");
        request.set_timeout(Duration::from_millis(200));
        request.extensions_mut().insert(over);
        let call = tokio::spawn(say(layer.layer(channel(&uri)), request));
        let seen = script.seen().len();
        script.until(|s| s.seen().len() == seen + 1).await;
        assert_eq!(
            script.values("grpc-timeout").last().unwrap().as_deref(),
            Some("200000u"),
            "{over:?}"
        );
        clock.advance(Duration::from_millis(200));
        let status = call.await.unwrap().unwrap_err();
        assert_eq!(
            status.code(),
            Code::DeadlineExceeded,
            "{over:?}: {status:?}"
        );
        let record = RetryRecord::of_status(&status).unwrap();
        assert_eq!(
            (record.attempts(), record.stop_reason()),
            (1, StopReason::DeadlineReached)
        );
    }
    // A shorter deadline of the override's own wins.
    let mut request = text("x");
    request.set_timeout(Duration::from_millis(200));
    request
        .extensions_mut()
        .insert(RetryOverride::new().deadline(Duration::from_millis(50)));
    let call = tokio::spawn(say(layer.layer(channel(&uri)), request));
    script.until(|s| s.seen().len() == 4).await;
    assert_eq!(
        script.values("grpc-timeout").last().unwrap().as_deref(),
        Some("50000000n")
    );
    clock.advance(Duration::from_millis(50));
    let status = call.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
}

/// Issue 64, defect 2: an override's attempts stop at A6's cap of 5, as a policy's do.
#[tokio::test]
async fn an_override_s_attempts_stop_at_a6_s_cap() {
    let script = Script::new((0..12).map(|_| Act::Fail(Code::Unavailable, None)));
    let uri = serve(&script).await;
    let (layer, _clock) = faked_retrying(2);
    let mut request = text("x");
    request
        .extensions_mut()
        .insert(RetryOverride::new().max_attempts(9));
    let status = say(layer.layer(channel(&uri)), request).await.unwrap_err();
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (5, StopReason::AttemptsExhausted)
    );
    assert_eq!(script.seen().len(), 5);
}

#[tokio::test]
async fn without_throttling_retries_are_paid_from_one_budget_for_every_method() {
    let script = Script::new((0..200).map(|_| Act::Fail(Code::Unavailable, None)));
    let uri = serve(&script).await;
    // Two names, two dependencies: `Say`'s own, and its service's for `Count`.
    let config = GrpcConfig::new()
        .retry("echo.Echo/Say", unavailable(5))
        .unwrap()
        .retry("echo.Echo", unavailable(5))
        .unwrap();
    let (layer, _clock) = faked(config);
    let service = layer.layer(channel(&uri));
    // One method's calls until the budget (10 tokens) runs dry...
    drain(&service).await;
    // ...leave another method's call at once with at most the refill's one retry: the
    // budget is the layer's, not the method's.
    let status = count(service, "x").await.1.unwrap_err();
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(record.stop_reason(), StopReason::BudgetExhausted);
    assert!(record.attempts() <= 2, "{record:?}");
}

/// Issue 64, defect 5: without `retryThrottling` the layer's budget pays the retries, and a call
/// that commits (its status in the trailers, as every unary OK from a tonic server is) earns
/// for it as an HTTP answer does: 200 of them refill a budget that failures drained.
#[tokio::test]
async fn without_throttling_committed_calls_refill_the_budget_as_http_answers_do() {
    let failing = Script::new((0..100).map(|_| Act::Fail(Code::Unavailable, None)));
    let answering = Script::new([]);
    let (failing_uri, answering_uri) = (serve(&failing).await, serve(&answering).await);
    let config = GrpcConfig::new()
        .retry("echo.Echo", unavailable(5))
        .unwrap();
    let (layer, _clock) = faked(config);
    let (fails, answers) = (
        layer.layer(channel(&failing_uri)),
        layer.layer(channel(&answering_uri)),
    );
    // Failures until the budget (10 tokens) runs dry.
    drain(&fails).await;
    // 200 calls answered OK, each committed: a tenth of a token each, the budget full again. No
    // time passes on the fake clock meanwhile, so nothing else refills it.
    for _ in 0..200 {
        let answer = say(answers.clone(), text("y")).await.unwrap();
        assert_eq!(
            RetryRecord::of(&answer).unwrap().stop_reason(),
            StopReason::Committed
        );
    }
    let status = say(fails, text("z")).await.unwrap_err();
    let record = RetryRecord::of_status(&status).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (5, StopReason::AttemptsExhausted),
        "{record:?}"
    );
}

#[tokio::test]
async fn a_caller_s_own_key_in_metadata_is_kept_on_every_attempt() {
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let config = GrpcConfig::new()
        .retry("echo.Echo", unavailable(3))
        .unwrap()
        .non_idempotent("echo.Echo/Say")
        .unwrap();
    let (layer, _clock) = faked(config);
    let mut request = text("x");
    let key = "order-17-charge";
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    let answer = say(layer.layer(channel(&uri)), request).await.unwrap();
    let record = answer.extensions().get::<RetryRecord>().unwrap();
    assert_eq!(record.idempotency_key().unwrap(), key);
    assert_eq!(
        script.values("idempotency-key"),
        [Some(key.to_owned()), Some(key.to_owned())]
    );
}

#[tokio::test]
async fn a_trailers_only_ok_is_an_answer_not_an_error() {
    // An empty stream, answered trailers-only with OK, after a retry (so with a record).
    let (uri, streams) = raw_h2(vec![Raw::Status("14"), Raw::Status("0")]).await;
    let (layer, _clock) = faked_retrying(2);
    let (got, ended) = count(layer.layer(channel(&uri)), "x").await;
    assert!(got.is_empty());
    ended.expect("OK is no error");
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// A call the server committed to at its first attempt (the most common answer) carries no
/// record, which spares it a map and a box, and reads as committed all the same; a
/// trailers-only `OK` at its first attempt stands for no committed call and carries its own.
#[tokio::test]
async fn a_first_attempt_s_answer_carries_a_record_unless_it_is_a_committed_call_s() {
    let uri = serve(&Script::new([])).await;
    let (layer, _clock) = faked_retrying(2);
    let answer = say(layer.layer(channel(&uri)), text("x")).await.unwrap();
    assert_eq!(answer.extensions().get::<RetryRecord>(), None);
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::Committed)
    );

    let (uri, streams) = raw_h2(vec![Raw::Status("0")]).await;
    let mut service = layer.layer(channel(&uri));
    let request = http::Request::post(format!("{uri}/echo.Echo/Count"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::empty())
        .unwrap();
    let answer = tower_service::Service::call(&mut service, request)
        .await
        .unwrap();
    let record = answer
        .extensions()
        .get::<RetryRecord>()
        .expect("its record");
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::Succeeded)
    );
    assert_eq!(RetryRecord::of(&answer).as_ref(), Some(record));
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_status_s_source_says_how_the_call_ended() {
    let script = Script::new([Act::Fail(Code::PermissionDenied, None)]);
    let uri = serve(&script).await;
    let (layer, _clock) = faked_retrying(2);
    let status = say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    let source = std::error::Error::source(&status).expect("the record's error");
    assert_eq!(
        source.to_string(),
        "the call ended after 1 attempt(s): the failure is not retryable"
    );
}

#[tokio::test]
async fn an_absolute_origin_is_the_url_of_a_call_given_up() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let origin: http::Uri = format!("http://127.0.0.1:{port}").parse().unwrap();
    let (layer, _clock) = faked_retrying(2);
    let service = layer.layer(channel(&origin.to_string()));
    let mut grpc = tonic::client::Grpc::with_origin(service, origin);
    grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/echo.Echo/Say");
    let codec = tonic_prost::ProstCodec::<server::Echo, server::Echo>::default();
    let status = grpc.unary(text("x"), path, codec).await.unwrap_err();
    let source = std::error::Error::source(&status).unwrap();
    let gave_up = source
        .downcast_ref::<reqwest_safe_retry::RetryError<reqwest_safe_retry::BoxError>>()
        .expect("the layer's error");
    assert_eq!(
        gave_up.url().map(|u| u.as_str().to_owned()),
        Some(format!("http://127.0.0.1:{port}/echo.Echo/Say"))
    );
}

/// Between two layers, a service that sends each call on from a task of its own, its
/// extensions kept: the inner layer sees the outer's mark and passes the call through.
#[derive(Clone)]
struct OwnTask<S>(S);

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for OwnTask<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
    S::Error: Send,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let mut inner = self.0.clone();
        std::mem::swap(&mut inner, &mut self.0);
        Box::pin(async move { tokio::spawn(inner.call(request)).await.unwrap() })
    }
}

/// Between two layers, a service that makes each call anew, without its extensions, on the same
/// task: to the same path, or (`to`) another method's.
#[derive(Clone)]
struct Remade<S> {
    inner: S,
    to: Option<&'static str>,
}

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for Remade<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let mut fresh = http::Request::new(body);
        *fresh.method_mut() = parts.method;
        *fresh.uri_mut() = match self.to {
            Some(path) => path.parse().unwrap(),
            None => parts.uri,
        };
        *fresh.headers_mut() = parts.headers;
        self.inner.call(fresh)
    }
}

type Inner = reqwest_safe_retry::grpc::GrpcRetryService<tonic::transport::Channel>;

/// Both layers retry `echo.Echo`'s calls, 3 attempts each.
fn retrying() -> GrpcConfig {
    GrpcConfig::new()
        .retry("echo.Echo", unavailable(3))
        .unwrap()
}

/// Both layers hedge `echo.Echo`'s calls: 3 copies with no delay between them (A6: all at
/// once), `UNAVAILABLE` non-fatal.
fn hedging() -> GrpcConfig {
    let policy = GrpcHedgingPolicy::builder()
        .max_attempts(3)
        .hedging_delay(Duration::ZERO)
        .non_fatal_codes([Code::Unavailable])
        .build()
        .unwrap();
    GrpcConfig::new().hedge("echo.Echo", policy).unwrap()
}

/// A call that always fails `UNAVAILABLE`, through two layers of `config` (3 attempts each)
/// with `between` made of the inner one: the outer layer's attempts, and the arrivals at the
/// server.
async fn through_two_layers<M>(
    config: fn() -> GrpcConfig,
    between: impl FnOnce(Inner) -> M,
) -> (u32, usize)
where
    M: tower_service::Service<
            http::Request<tonic::body::Body>,
            Response = <Inner as tower_service::Service<http::Request<tonic::body::Body>>>::Response,
            Error = reqwest_safe_retry::BoxError,
        > + Clone
        + Send
        + Sync
        + 'static,
    M::Future: Send,
{
    let script = Script::new((0..9).map(|_| Act::Fail(Code::Unavailable, None)));
    let uri = serve(&script).await;
    let (outer, _clock) = faked(config());
    let (inner, _inner_clock) = faked(config());
    let service = outer.layer(between(inner.layer(channel(&uri))));
    let status = say(service, text("x")).await.unwrap_err();
    let attempts = RetryRecord::of_status(&status).unwrap().attempts();
    (attempts, script.seen().len())
}

#[tokio::test]
async fn two_layers_make_one_layer_of_attempts_across_tasks() {
    assert_eq!(
        through_two_layers(retrying, OwnTask).await,
        (3, 3),
        "3 arrivals, not 9"
    );
}

#[tokio::test]
async fn two_hedging_layers_send_one_layer_of_copies_across_tasks() {
    // The outer layer's copies go at once, each reaching the inner layer on a task of its own:
    // the inner layer sees each copy's mark and sends it on once.
    assert_eq!(
        through_two_layers(hedging, OwnTask).await,
        (3, 3),
        "3 arrivals, not 9"
    );
}

#[tokio::test]
async fn two_hedging_layers_send_one_layer_of_copies_when_the_extensions_are_lost_between_them() {
    // Three copies of one call in flight at once, none marked: the inner layer knows each by
    // its method and path while the outer layer runs the call.
    let lost = |inner| Remade { inner, to: None };
    assert_eq!(
        through_two_layers(hedging, lost).await,
        (3, 3),
        "3 arrivals, not 9"
    );
}

#[tokio::test]
async fn two_layers_make_one_layer_of_attempts_when_the_extensions_are_lost_between_them() {
    // The inner layer knows the call by its method and path, and passes it through.
    let lost = |inner| Remade { inner, to: None };
    assert_eq!(
        through_two_layers(retrying, lost).await,
        (3, 3),
        "3 arrivals, not 9"
    );
}

#[tokio::test]
async fn a_call_of_its_own_that_a_service_between_two_layers_makes_is_the_inner_layer_s() {
    // Another method's call is not the outer layer's: the inner one makes its attempts.
    let rerouted = |inner| Remade {
        inner,
        to: Some("/echo.Echo/Count"),
    };
    assert_eq!(through_two_layers(retrying, rerouted).await, (3, 9));
}

#[tokio::test]
async fn the_layer_counts_each_name_s_calls_across_its_services() {
    let script = Script::new([
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, None),
    ]);
    let uri = serve(&script).await;
    let config = GrpcConfig::new()
        .retry("echo.Echo/Say", unavailable(3))
        .unwrap()
        .non_idempotent("echo.Echo/Say")
        .unwrap();
    let (layer, _clock) = faked(config);
    // Two services of one layer, and a clone of it.
    say(layer.layer(channel(&uri)), text("x")).await.unwrap();
    say(layer.clone().layer(channel(&uri)), text("y"))
        .await
        .unwrap();
    count(layer.layer(channel(&uri)), "z").await.1.unwrap();
    let say_counts = layer
        .counters("echo.Echo/Say")
        .expect("a name the config gives");
    assert_eq!(
        (
            say_counts.requests,
            say_counts.attempts,
            say_counts.retries,
            say_counts.keys_stamped
        ),
        (2, 4, 2, 2)
    );
    let every = layer.counters("").expect("the calls no name covers");
    assert_eq!((every.requests, every.attempts), (1, 1));
    assert!(layer.counters("echo.Other").is_none());
}

/// A transport that fails every call with an error of its own, which says nothing of whether
/// the call was sent.
#[derive(Clone)]
struct Broken;

impl tower_service::Service<http::Request<tonic::body::Body>> for Broken {
    type Response = http::Response<tonic::body::Body>;
    type Error = reqwest_safe_retry::BoxError;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
        std::future::ready(Err("the transport broke".into()))
    }
}

#[tokio::test]
async fn an_error_the_door_cannot_read_is_not_retried() {
    let (layer, clock) = faked_retrying(4);
    let status = say(layer.layer(Broken), text("x")).await.unwrap_err();
    let record = RetryRecord::of_status(&status).expect("the layer's record");
    // It may have reached the server: neither UNAVAILABLE nor unsent, so final.
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::NotRetryable)
    );
    assert!(clock.sleeps().is_empty());
}

#[tokio::test]
async fn a_call_dropped_in_its_wait_or_on_the_wire_gives_its_buffer_back() {
    // The channel's buffer holds one call's message (8 bytes: a 3-byte message in its frame).
    let script = Script::new([
        Act::Fail(Code::Unavailable, None),
        Act::Slow(Duration::from_secs(5)),
        Act::Fail(Code::Unavailable, Some("0")),
    ]);
    let uri = serve(&script).await;
    let slow = GrpcRetryPolicy::builder()
        .max_attempts(3)
        .initial_backoff(Duration::from_secs(10))
        .max_backoff(Duration::from_secs(10))
        .retryable_codes([Code::Unavailable])
        .build()
        .unwrap();
    let config = GrpcConfig::new()
        .retry("echo.Echo", slow)
        .unwrap()
        .buffer_limits(1 << 20, 8);
    // Real time: the first call waits 8 s or more after its UNAVAILABLE, the second is answered
    // after 5 s; each is dropped within 100 ms.
    let layer = GrpcRetryLayer::new(config);
    let service = layer.layer(channel(&uri));
    for _ in 0..2 {
        let call = say(service.clone(), text("x"));
        assert!(
            tokio::time::timeout(Duration::from_millis(100), call)
                .await
                .is_err()
        );
    }
    // Held bytes came back both times: the next call is kept for its retry, which the
    // server's pushback of 0 lets go at once.
    let answer = say(service, text("x"))
        .await
        .expect("retried, then answered");
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (2, StopReason::Committed)
    );
}

/// A tonic `Channel` beneath the tower door: each copy's body as tonic's own.
#[cfg(feature = "tower")]
#[derive(Clone)]
struct TonicBody<S>(S);

#[cfg(feature = "tower")]
impl<S, B> tower_service::Service<http::Request<B>> for TonicBody<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> S::Future {
        self.0.call(request.map(tonic::body::Body::new))
    }
}

/// Calls `/echo.Echo/Say` through `service` with an origin (absolute URIs, which the tower
/// door needs).
#[cfg(feature = "tower")]
async fn say_at<S>(service: S, origin: &str) -> Result<tonic::Response<server::Echo>, tonic::Status>
where
    S: tonic::client::GrpcService<tonic::body::Body>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut grpc = tonic::client::Grpc::with_origin(service, origin.parse().unwrap());
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unknown(e.into().to_string()))?;
    let path = http::uri::PathAndQuery::from_static("/echo.Echo/Say");
    grpc.unary(text("x"), path, tonic_prost::ProstCodec::default())
        .await
}

/// Issue 64, defect 6: the gRPC layer over this crate's HTTP tower layer, against a proxy that
/// answers HTTP 503: one layer retries (3 arrivals, where each retried the other's attempts:
/// 9). The doors share one mark and one fingerprint rule; the retrying layer is the outer one,
/// whose record the caller reads.
#[cfg(feature = "tower")]
#[tokio::test]
async fn one_layer_retries_when_the_grpc_door_is_over_the_http_door() {
    // The gRPC layer outside: the tower layer beneath passes its copies through.
    let (uri, streams) = raw_h2(vec![Raw::Http(503)]).await;
    let (grpc, _clock) = faked_retrying(3);
    let service = grpc.layer(http().layer(TonicBody(channel(&uri))));
    let status = say(service, text("x")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let record = RetryRecord::of_status(&status).expect("the gRPC layer's record");
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (3, StopReason::AttemptsExhausted)
    );
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 3);
}

/// The HTTP door on a fake clock, with the default policy (3 attempts).
#[cfg(feature = "tower")]
fn http() -> reqwest_safe_retry::RetryMiddleware {
    let policy = reqwest_safe_retry::RetryPolicy::default();
    reqwest_safe_retry::RetryMiddleware::new(policy).with_clock(FakeClock::new())
}

/// Issue 64, defect 6, the other way round: the HTTP layer outside, the gRPC layer beneath
/// passes its copies through.
#[cfg(feature = "tower")]
#[tokio::test]
async fn one_layer_retries_when_the_http_door_is_over_the_grpc_door() {
    let (uri, streams) = raw_h2(vec![Raw::Http(503)]).await;
    let (grpc, _clock) = faked_retrying(3);
    // What the outer layer saw of each attempt: the retrying layer is the one the caller
    // called (before, the inner one retried, and the outer saw one attempt, hiding three).
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let events = seen.clone();
    let outer = http().with_observer(move |e| events.lock().unwrap().push((e.attempt, e.stop)));
    let service = outer.layer(TonicBody(grpc.layer(channel(&uri))));
    let status = say_at(service, &uri).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (1, None),
            (2, None),
            (3, Some(StopReason::AttemptsExhausted))
        ]
    );
}

/// gRFC A96's per-call histograms through the `metrics` facade, labelled `grpc.method` and
/// `grpc.target`, each count not reported when zero; and the channel's throttling tokens.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a96_s_histograms_count_retries_transparent_retries_hedges_and_the_delay() {
    let recorder = crate::dependencies::recorder();
    let labels = |target: &str| format!("grpc.method=echo.Echo/Say,grpc.target={target}");
    let of = |name: &str, target: &str| recorder.histogram(name, &labels(target));

    // Two retries, the second after a pushback; the waits are the delay.
    let script = Script::new([
        Act::Fail(Code::Unavailable, None),
        Act::Fail(Code::Unavailable, Some("250")),
    ]);
    let uri = serve(&script).await;
    let throttling = RetryThrottling::new(10.0, 0.5).unwrap();
    let config = GrpcConfig::new()
        .retry("echo.Echo", unavailable(4))
        .unwrap()
        .retry_throttling(throttling);
    let (layer, clock) = faked(config);
    let layer = layer.with_target("dns:///a96-retries");
    say(layer.layer(channel(&uri)), text("x")).await.unwrap();
    let waited: Duration = clock.sleeps().iter().sum();
    assert_eq!(of("grpc.client.call.retries", "dns:///a96-retries"), [2.0]);
    assert!(of("grpc.client.call.transparent_retries", "dns:///a96-retries").is_empty());
    assert!(of("grpc.client.call.hedges", "dns:///a96-retries").is_empty());
    assert_eq!(
        of("grpc.client.call.retry_delay", "dns:///a96-retries"),
        [waited.as_secs_f64()]
    );
    // 10 - 2 failures + 0.5 for the OK.
    assert_eq!(
        recorder.gauge_of(
            "reqwest_safe_retry_grpc_throttle_tokens",
            "grpc.target=dns:///a96-retries"
        ),
        Some(8.5)
    );

    // A transparent retry of a refused stream, then the policy's retry.
    let (uri, _) = raw_h2(vec![Raw::Refuse, Raw::Status("14")]).await;
    let (layer, _) = faked_retrying(2);
    let layer = layer.with_target("dns:///a96-transparent");
    say(layer.layer(channel(&uri)), text("x"))
        .await
        .unwrap_err();
    assert_eq!(
        of(
            "grpc.client.call.transparent_retries",
            "dns:///a96-transparent"
        ),
        [1.0]
    );
    assert_eq!(
        of("grpc.client.call.retries", "dns:///a96-transparent"),
        [1.0]
    );

    // A hedge after a non-fatal failure; and a call of one attempt reports nothing.
    let script = Script::new([Act::Fail(Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let hedging = GrpcHedgingPolicy::builder()
        .max_attempts(3)
        .hedging_delay(Duration::from_millis(500))
        .non_fatal_codes([Code::Unavailable])
        .build()
        .unwrap();
    let (layer, _) = faked(GrpcConfig::new().hedge("echo.Echo", hedging).unwrap());
    let service = layer.with_target("dns:///a96-hedges").layer(channel(&uri));
    say(service.clone(), text("x")).await.unwrap();
    say(service, text("y")).await.unwrap();
    assert_eq!(of("grpc.client.call.hedges", "dns:///a96-hedges"), [1.0]);
    assert!(of("grpc.client.call.retries", "dns:///a96-hedges").is_empty());
    assert_eq!(
        of("grpc.client.call.retry_delay", "dns:///a96-hedges"),
        [0.0]
    );
}
