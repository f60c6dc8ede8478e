//! The opt-in headers that tell the server which attempt it is answering and how long the
//! client will still wait, through the whole chain on loopback, in virtual time.

use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryMiddleware, RetryOverride, RetryPolicy, SeededRng, StopReason,
};

use crate::support;

/// A dependency with the default policy (3 attempts, a 30 s deadline) sending both headers.
fn announcing() -> Dependency {
    Dependency::new("search", RetryPolicy::default())
        .with_attempt_header("x-attempt")
        .unwrap()
        .with_deadline_header("x-deadline-ms")
        .unwrap()
}

fn client_on(clock: &FakeClock, dependency: Dependency) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(dependency)
                .with_clock(clock.clone())
                .with_rng(SeededRng::new(5)),
        )
        .build()
}

/// The values of header `name` on the requests `server` received, in order (`None`: absent).
async fn values(server: &wiremock::MockServer, name: &str) -> Vec<Option<String>> {
    let requests = server.received_requests().await.unwrap();
    requests
        .iter()
        .map(|r| {
            let all: Vec<_> = r.headers.get_all(name).iter().collect();
            assert!(all.len() <= 1, "{name} sent {} times", all.len());
            all.first().map(|v| v.to_str().unwrap().to_owned())
        })
        .collect()
}

#[tokio::test]
async fn the_attempt_header_reads_1_2_3_and_the_deadline_header_the_milliseconds_left() {
    let server = support::always(503).await;
    let clock = FakeClock::new();
    let client = client_on(&clock, announcing());

    let response = client
        .get(server.uri())
        .header("x-attempt", "set by the caller")
        .send()
        .await
        .unwrap();

    assert_eq!(
        support::ended(&response),
        (3, StopReason::AttemptsExhausted)
    );
    let attempts = values(&server, "x-attempt").await;
    assert_eq!(
        attempts,
        [Some("1"), Some("2"), Some("3")].map(|v| v.map(str::to_owned))
    );
    // The fake clock stands still on the wire: what is left is the deadline less the waits.
    let sleeps = clock.sleeps();
    assert_eq!(sleeps.len(), 2);
    let expected = left_before_each(Duration::from_secs(30), &sleeps);
    assert_eq!(values(&server, "x-deadline-ms").await, expected);
    let millis: Vec<u64> = expected
        .iter()
        .map(|v| v.as_ref().unwrap().parse().unwrap())
        .collect();
    assert!(millis.windows(2).all(|w| w[1] < w[0]), "{millis:?}");
    assert!(millis[0] <= 30_000);
}

#[tokio::test]
async fn the_deadline_header_follows_a_per_request_deadline() {
    let server = support::always(503).await;
    let clock = FakeClock::new();
    let client = client_on(&clock, announcing());

    client
        .get(server.uri())
        .with_extension(RetryOverride::new().deadline(Duration::from_millis(2_500)))
        .send()
        .await
        .unwrap();

    assert_eq!(
        values(&server, "x-deadline-ms").await,
        left_before_each(Duration::from_millis(2_500), &clock.sleeps())
    );
}

/// What each attempt has left of `deadline` after the `sleeps` before it, as the header says.
fn left_before_each(deadline: Duration, sleeps: &[Duration]) -> Vec<Option<String>> {
    let mut left = deadline;
    let mut out = vec![Some(left.as_millis().to_string())];
    for sleep in sleeps {
        left -= *sleep;
        out.push(Some(left.as_millis().to_string()));
    }
    out
}

#[tokio::test]
async fn without_the_setting_no_header_is_sent_and_only_the_outermost_instance_sends_it() {
    let server = support::always(503).await;
    let clock = FakeClock::new();
    // The default: nothing.
    client_on(&clock, Dependency::new("search", RetryPolicy::default()))
        .get(server.uri())
        .send()
        .await
        .unwrap();
    assert_eq!(values(&server, "x-attempt").await, [None, None, None]);

    // An inner instance passes the outer one's attempts through, and sends nothing of its own.
    let server = support::always(503).await;
    let plain = RetryMiddleware::new(Dependency::new("outer", RetryPolicy::default()))
        .with_clock(clock.clone());
    let inner = RetryMiddleware::new(announcing()).with_clock(clock.clone());
    let nested = ClientBuilder::new(reqwest::Client::new())
        .with(plain)
        .with(inner)
        .build();
    nested.get(server.uri()).send().await.unwrap();
    assert_eq!(values(&server, "x-attempt").await, [None, None, None]);

    let server = support::always(503).await;
    let outer = RetryMiddleware::new(announcing()).with_clock(clock.clone());
    let inner = RetryMiddleware::new(announcing()).with_clock(clock.clone());
    let nested = ClientBuilder::new(reqwest::Client::new())
        .with(outer)
        .with(inner)
        .build();
    nested.get(server.uri()).send().await.unwrap();
    let attempts = values(&server, "x-attempt").await;
    assert_eq!(
        attempts,
        [Some("1"), Some("2"), Some("3")].map(|v| v.map(str::to_owned))
    );
}

#[test]
fn a_header_name_that_is_invalid_standard_or_taken_is_refused_with_what_to_do() {
    let dependency = || Dependency::new("search", RetryPolicy::default());
    let err = dependency().with_attempt_header("x attempt").unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid attempt headers: attempt header \"x attempt\" is not a valid HTTP header \
         name: use letters, digits and '-'"
    );
    let err = dependency()
        .with_deadline_header("Authorization")
        .unwrap_err();
    assert!(err.to_string().contains("standard HTTP field"), "{err}");
    let err = dependency()
        .with_attempt_header("Idempotency-Key")
        .unwrap_err();
    assert!(err.to_string().contains("give each its own name"), "{err}");
    let err = dependency()
        .with_attempt_header("x-a")
        .unwrap()
        .with_deadline_header("X-A")
        .unwrap_err();
    assert!(err.to_string().contains("give each its own name"), "{err}");
}

#[tokio::test]
async fn no_order_of_setters_lets_an_attempt_or_deadline_header_replace_the_key() {
    let unkeyed = || Dependency::new("payments", RetryPolicy::default()).without_idempotency_keys();
    let keys = || reqwest_safe_retry::IdempotencyKeys::default();
    // The attempt's number, or the time left, set first under the key's name: the keys after
    // it are refused, naming both headers.
    let err = unkeyed()
        .with_attempt_header("Idempotency-Key")
        .unwrap()
        .with_idempotency_keys(keys())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid attempt headers: idempotency key header \"idempotency-key\" is already the \
         dependency's attempt header: give each its own name"
    );
    let err = unkeyed()
        .with_deadline_header("idempotency-key")
        .unwrap()
        .with_idempotency_keys(keys())
        .unwrap_err();
    assert!(
        err.to_string().contains("dependency's deadline header"),
        "{err}"
    );
    // The keys first: the attempt header after them is refused, as before.
    assert!(
        unkeyed()
            .with_idempotency_keys(keys())
            .unwrap()
            .with_attempt_header("Idempotency-Key")
            .is_err()
    );

    // Every accepted order sends one key on every attempt, the record's.
    let server = support::always(503).await;
    let clock = FakeClock::new();
    let dependency = unkeyed()
        .with_attempt_header("x-attempt")
        .unwrap()
        .with_idempotency_keys(keys())
        .unwrap()
        .with_deadline_header("x-deadline-ms")
        .unwrap();
    let response = client_on(&clock, dependency)
        .post(server.uri())
        .send()
        .await
        .unwrap();
    let record = reqwest_safe_retry::RetryRecord::of(&response).unwrap();
    let key = record
        .idempotency_key()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(values(&server, "idempotency-key").await, vec![Some(key); 3]);
    assert_eq!(
        values(&server, "x-attempt").await,
        [Some("1"), Some("2"), Some("3")].map(|v| v.map(str::to_owned))
    );
}
