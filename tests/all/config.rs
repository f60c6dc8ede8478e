//! Configuration that cannot be meant is refused when it is built, with a message that names
//! the setting and the fix; keys a caller set that cannot work are refused before anything is
//! sent.

use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{
    Dependency, IdempotencyKeys, InvalidConfig, KeyFormat, RetryBudget, RetryError,
    RetryMiddleware, RetryPolicy, StopReason,
};

use crate::support;

const MS: Duration = Duration::from_millis(1);

fn policy(
    f: impl FnOnce(reqwest_safe_retry::RetryPolicyBuilder) -> reqwest_safe_retry::RetryPolicyBuilder,
) -> Result<(), InvalidConfig> {
    f(RetryPolicy::builder()).build().map(drop)
}

fn budget(
    f: impl FnOnce(reqwest_safe_retry::RetryBudgetBuilder) -> reqwest_safe_retry::RetryBudgetBuilder,
) -> Result<(), InvalidConfig> {
    f(RetryBudget::builder()).build().map(drop)
}

fn keys(
    f: impl FnOnce(
        reqwest_safe_retry::IdempotencyKeysBuilder,
    ) -> reqwest_safe_retry::IdempotencyKeysBuilder,
) -> Result<(), InvalidConfig> {
    f(IdempotencyKeys::builder()).build().map(drop)
}

fn route(host: &str) -> Result<(), InvalidConfig> {
    RetryMiddleware::new(RetryPolicy::default())
        .route(host, Dependency::new("x", RetryPolicy::default()))
        .map(drop)
}

#[test]
fn invalid_configurations_are_refused_with_the_setting_and_the_fix() {
    // (what was configured, the result, the setting the message must name, the fix it must give)
    let cases: Vec<(&str, Result<(), InvalidConfig>, &str, &str)> = vec![
        (
            "no attempts",
            policy(|p| p.max_attempts(0)),
            "max_attempts",
            "at least 1",
        ),
        (
            "cap below base",
            policy(|p| p.base_delay(2 * MS).max_delay(MS)),
            "max_delay",
            "raise max_delay or lower base_delay",
        ),
        (
            "zero timeout",
            policy(|p| p.attempt_timeout(Duration::ZERO)),
            "attempt_timeout",
            "at least 1 ms",
        ),
        (
            "1 ns deadline",
            policy(|p| p.deadline(Duration::from_nanos(1))),
            "deadline",
            "at least 1 ms",
        ),
        (
            "waits that can never fit",
            policy(|p| p.base_delay(Duration::MAX).max_delay(Duration::MAX)),
            "base_delay",
            "lower base_delay or raise deadline",
        ),
        (
            "a Retry-After limit past the deadline",
            policy(|p| p.max_retry_after(Duration::from_secs(60))),
            "max_retry_after",
            "lower max_retry_after or raise deadline",
        ),
        (
            "retrying successes",
            policy(|p| p.retryable_statuses([200])),
            "retryable status 200",
            "400 to 599",
        ),
        (
            "not a status",
            policy(|p| p.retryable_statuses([503, 1000])),
            "retryable status 1000",
            "400 to 599",
        ),
        (
            "free retries",
            budget(|b| b.retry_cost(0.0)),
            "retry_cost",
            "from 0.001",
        ),
        (
            "negative cost",
            budget(|b| b.timeout_cost(-1.0)),
            "timeout_cost",
            "from 0.001",
        ),
        (
            "huge cost",
            budget(|b| b.throttled_cost(1e15)),
            "throttled_cost",
            "to 1e12",
        ),
        (
            "a bucket too small for a retry",
            budget(|b| b.capacity(0.5)),
            "capacity",
            "raise capacity",
        ),
        (
            "more than the bucket holds",
            budget(|b| b.capacity(2.0).initial(3.0)),
            "initial",
            "must not exceed the capacity",
        ),
        (
            "no deposits",
            budget(|b| b.deposit_ratio(0.0)),
            "deposit ratio",
            "above 0",
        ),
        (
            "a deposit below the resolution",
            budget(|b| b.deposit_ratio(1e-9)),
            "deposit ratio",
            "raise the ratio or the retry cost",
        ),
        (
            "a NaN floor",
            budget(|b| b.floor_per_sec(f64::NAN)),
            "floor_per_sec",
            "from 0",
        ),
        (
            "a header name with a space",
            keys(|k| k.header_name("Idempotency Key")),
            "header name",
            "letters, digits and '-'",
        ),
        (
            "the key in Content-Type",
            keys(|k| k.header_name("content-type")),
            "header name \"content-type\"",
            "choose a name of its own",
        ),
        (
            "the key in Authorization",
            keys(|k| k.header_name("Authorization")),
            "header name \"Authorization\"",
            "choose a name of its own",
        ),
        (
            "a URL for a route",
            route("http://127.0.0.1:8080"),
            "\"http://127.0.0.1:8080\" is a URL",
            "\"127.0.0.1:8080\"",
        ),
        (
            "a path for a route",
            route("example.com/api"),
            "is not a host",
            "\"api.example.com\"",
        ),
        (
            "a port out of range",
            route("example.com:99999"),
            "valid port",
            "65535",
        ),
    ];
    assert!(cases.len() >= 15);
    for (what, result, setting, fix) in cases {
        let err = result.expect_err(what);
        let message = err.to_string();
        assert!(message.contains(setting), "{what}: {message}");
        assert!(message.contains(fix), "{what}: {message}");
        assert!(
            message.starts_with(&format!("invalid {}: ", err.area())),
            "{what}: {message}"
        );
    }
}

#[test]
fn the_defaults_agree_with_each_other() {
    let policy = RetryPolicy::default();
    // A Retry-After the deadline leaves room for is honoured: the limit is the deadline.
    assert_eq!(policy.max_retry_after(), policy.deadline());
    assert!(policy.base_delay() < policy.deadline());
    assert!(policy.attempt_timeout() <= policy.deadline());
    let short = RetryPolicy::builder()
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    assert_eq!(short.max_retry_after(), Duration::from_secs(2));
}

/// Values a caller might set as the key that would defeat the server's dedupe, or that another
/// parser would read differently: each fails before anything is sent, naming the rule.
#[tokio::test]
async fn a_caller_s_invalid_key_fails_before_anything_is_sent() {
    let server = support::always(503).await;
    let (client, _) = support::client();
    // The default format is bare, and a caller may also send a quoted key: what is refused is
    // an empty key, a bare one with spaces, quotes or backslashes, or a broken quoted one.
    for (value, rule) in [
        ("", "an empty key"),
        ("\"\"", "an empty key"),
        ("order 42", "without spaces or quotes"),
        ("order\"42", "without spaces or quotes"),
        ("\"order-42", "must start and end with '\"'"),
        ("\"caf\u{e9}\"", "printable ASCII"),
    ] {
        let err = client
            .post(server.uri())
            .header("Idempotency-Key", value)
            .body("charge 10 EUR")
            .send()
            .await
            .unwrap_err();
        let retry = RetryError::of(&err).unwrap();
        assert_eq!(
            retry.stop_reason(),
            StopReason::InvalidIdempotencyKey,
            "{value:?}"
        );
        assert_eq!(retry.attempts(), 0);
        assert!(err.to_string().contains(rule), "{value:?}: {err}");
    }
    assert_eq!(server.received_requests().await.unwrap().len(), 0);

    // In the quoted format, a bare key is what is refused.
    let quoted = IdempotencyKeys::builder()
        .format(KeyFormat::Quoted)
        .build()
        .unwrap();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(
            Dependency::new("default", support::policy())
                .with_idempotency_keys(quoted)
                .unwrap(),
        ))
        .build();
    for value in ["order-42", "order 42"] {
        let err = client
            .post(server.uri())
            .header("Idempotency-Key", value)
            .send()
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("must start and end with '\"'"),
            "{err}"
        );
    }
    assert_eq!(server.received_requests().await.unwrap().len(), 0);
}
