//! Idempotency keys end to end, against the reference server: one effect per logical request.

use std::sync::Arc;
use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{
    Dependency, FakeClock, IdempotencyKeys, KeyFormat, NaturalKey, RetryError, RetryMiddleware,
    RetryPolicy, RetryRecord, SeededKeys, SeededRng, StopReason,
};
use tokio::sync::Semaphore;
use wiremock::matchers::any;
use wiremock::{Mock, ResponseTemplate};

use crate::reference_server::{Fate, Link, ReferenceServer, parse_response};
use crate::support;

/// A client with these keys and no retry budget: these tests are about keys, and a fault rate
/// far above any healthy service's would rightly exhaust a budget.
fn keyed_client(policy: RetryPolicy, keys: IdempotencyKeys) -> (ClientWithMiddleware, FakeClock) {
    let clock = FakeClock::new();
    let middleware = RetryMiddleware::new(
        Dependency::new("default", policy)
            .with_idempotency_keys(keys)
            .unwrap()
            .without_budget(),
    )
    .with_clock(clock.clone())
    .with_rng(SeededRng::new(11));
    (
        ClientBuilder::new(reqwest::Client::new())
            .with(middleware)
            .build(),
        clock,
    )
}

fn seeded_keys(format: KeyFormat) -> IdempotencyKeys {
    IdempotencyKeys::builder()
        .format(format)
        .key_source(SeededKeys::new(99))
        .build()
        .unwrap()
}

/// What the caller got, in the shape the server's stored original is compared in.
async fn received(response: reqwest::Response) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap().to_owned()))
        .collect();
    (status, headers, response.bytes().await.unwrap().to_vec())
}

/// The caller's response is the original: same status, same body, every original header.
fn assert_is_original(got: &(u16, Vec<(String, String)>, Vec<u8>), original: &[u8]) {
    let (status, headers, body) = parse_response(original);
    assert_eq!(got.0, status);
    assert_eq!(got.2, body, "body differs from the original");
    for header in &headers {
        assert!(got.1.contains(header), "missing original header {header:?}");
    }
}

#[tokio::test]
async fn a_lost_response_makes_one_effect_and_the_caller_gets_the_original() {
    let server = ReferenceServer::start(Link::DropFirstResponses(1)).await;
    let (client, clock) = keyed_client(support::policy(), seeded_keys(KeyFormat::Quoted));

    let response = client
        .post(server.url("/orders"))
        .body("{\"item\":\"book\"}")
        .send()
        .await
        .unwrap();

    let record = RetryRecord::of(&response).unwrap();
    assert_eq!(record.attempts(), 2);
    assert!(
        record.replayed(),
        "the second copy was answered from the store"
    );
    assert_eq!(clock.sleeps().len(), 1);
    let key = record.idempotency_key().unwrap().as_bytes().to_vec();
    let got = received(response).await;
    assert_eq!(server.effects().len(), 1);
    let original = server.original_response("anonymous", &key).unwrap();
    assert_is_original(&got, &original);
    let fates: Vec<Fate> = server.arrivals().iter().map(|a| a.fate).collect();
    assert_eq!(fates, [Fate::ResponseLost, Fate::Answered(201)]);
}

#[tokio::test]
async fn concurrent_copies_of_one_key_make_one_effect_and_all_get_the_original() {
    const TASKS: usize = 24;
    let gate = Arc::new(Semaphore::new(0));
    let server = ReferenceServer::start_with_gate(Link::Clean, Some(gate.clone())).await;
    // Real waits, short ones: the first copy stays in progress in real time while the others
    // retry their 409s.
    let policy = RetryPolicy::builder()
        .max_attempts(200)
        .base_delay(Duration::from_millis(2))
        .max_delay(Duration::from_millis(10))
        .build()
        .unwrap();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(Dependency::new("default", policy).without_budget())
                .with_rng(SeededRng::new(3)),
        )
        .build();

    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (client, url) = (client.clone(), server.url("/orders"));
        tasks.push(tokio::spawn(async move {
            let response = client
                .post(url)
                .header("idempotency-key", "\"order-7\"")
                .body("{\"item\":\"lamp\"}")
                .send()
                .await
                .unwrap();
            let record = RetryRecord::of(&response).unwrap();
            (record, received(response).await)
        }));
    }
    // Hold the first copy in progress until every other task has been told 409 at least once.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.conflicts() < TASKS - 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "copies never collided"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    gate.add_permits(1);

    let mut results = Vec::new();
    for task in tasks {
        // A copy that acted a second time would wait at the gate for ever: fail, do not hang.
        let done = tokio::time::timeout(Duration::from_secs(10), task).await;
        results.push(
            done.expect("a copy is stuck: it was not deduplicated")
                .unwrap(),
        );
    }
    assert_eq!(server.effects().len(), 1, "exactly one effect");
    let original = server
        .original_response("anonymous", b"\"order-7\"")
        .unwrap();
    for (record, got) in &results {
        assert_ne!(got.0, 500);
        assert_is_original(got, &original);
        assert_eq!(record.idempotency_key().unwrap(), "\"order-7\"");
    }
    let retried = results.iter().filter(|(r, _)| r.attempts() > 1).count();
    assert!(
        retried >= TASKS - 1,
        "the in-flight 409s were retried: {retried}"
    );
    // The caller's key reached the server byte for byte on every copy.
    for arrival in server.arrivals() {
        assert_eq!(arrival.key.as_deref(), Some(&b"\"order-7\""[..]));
    }
}

#[tokio::test]
async fn random_faults_never_duplicate_an_effect() {
    // 400 in a debug build (the test command), 1,000 in release.
    const REQUESTS: usize = if cfg!(debug_assertions) { 400 } else { 1_000 };
    let server = ReferenceServer::start(Link::Random {
        seed: 2026,
        drop_request: 0.15,
        drop_response: 0.15,
    })
    .await;
    let policy = RetryPolicy::builder().max_attempts(8).build().unwrap();
    let (client, _) = keyed_client(policy, seeded_keys(KeyFormat::Quoted));

    let mut outcomes = Vec::with_capacity(REQUESTS);
    for batch in 0..REQUESTS / 50 {
        let mut tasks = Vec::new();
        for i in 0..50 {
            let (client, url) = (client.clone(), server.url("/orders"));
            let body = format!("{{\"item\":{}}}", batch * 50 + i);
            tasks.push(tokio::spawn(async move {
                match client.post(url).body(body).send().await {
                    Ok(response) => {
                        let key = RetryRecord::of(&response)
                            .unwrap()
                            .idempotency_key()
                            .cloned();
                        Ok((key.unwrap(), received(response).await))
                    }
                    Err(err) => {
                        let retry = RetryError::of(&err).expect("a RetryError");
                        assert_eq!(retry.stop_reason(), StopReason::AttemptsExhausted);
                        Err(retry.idempotency_key().cloned().unwrap())
                    }
                }
            }));
        }
        for task in tasks {
            outcomes.push(task.await.unwrap());
        }
    }

    let effects = server.effects();
    let mut effect_keys: Vec<&[u8]> = effects.iter().map(|e| e.key.as_slice()).collect();
    effect_keys.sort();
    let before = effect_keys.len();
    effect_keys.dedup();
    assert_eq!(before, effect_keys.len(), "an effect was duplicated");

    let (mut succeeded, mut failed_after_effect, mut failed_before_effect) = (0, 0, 0);
    for outcome in &outcomes {
        match outcome {
            Ok((key, got)) => {
                succeeded += 1;
                let original = server
                    .original_response("anonymous", key.as_bytes())
                    .expect("a success has an effect");
                assert_is_original(got, &original);
            }
            Err(key) if effect_keys.contains(&key.as_bytes()) => failed_after_effect += 1,
            Err(_) => failed_before_effect += 1,
        }
    }
    assert_eq!(effects.len(), succeeded + failed_after_effect);
    assert_eq!(
        succeeded + failed_after_effect + failed_before_effect,
        REQUESTS
    );
    let arrivals = server.arrivals();
    let count = |fate: Fate| arrivals.iter().filter(|a| a.fate == fate).count();
    println!(
        "{REQUESTS} logical POSTs, {} copies: {} requests lost, {} responses lost; \
         {succeeded} succeeded, {failed_after_effect} failed after the effect, \
         {failed_before_effect} failed before it; {} effects",
        arrivals.len(),
        count(Fate::RequestLost),
        count(Fate::ResponseLost),
        effects.len()
    );
    // The link really did lose traffic, and the retries really did recover from it.
    assert!(
        arrivals.len() > REQUESTS * 5 / 4,
        "{} copies",
        arrivals.len()
    );
    assert!(succeeded >= REQUESTS * 99 / 100, "{succeeded} succeeded");
}

#[tokio::test]
async fn the_same_key_with_another_body_gets_422_untouched_and_no_second_effect() {
    let server = ReferenceServer::start(Link::Clean).await;
    let (client, _) = support::client();
    let send = |body: &'static str| {
        client
            .post(server.url("/orders"))
            .header("idempotency-key", "\"order-8\"")
            .body(body)
            .send()
    };

    let first = send("{\"qty\":1}").await.unwrap();
    let second = send("{\"qty\":2}").await.unwrap();

    assert_eq!(first.status(), 201);
    assert_eq!(second.status(), 422);
    let record = RetryRecord::of(&second).unwrap();
    assert_eq!(record.attempts(), 1);
    assert_eq!(record.stop_reason(), StopReason::NotRetryable);
    assert_eq!(
        second.text().await.unwrap(),
        "{\"error\":\"key reused with a different request\"}"
    );
    assert_eq!(server.effects().len(), 1);
    assert_eq!(server.arrivals().len(), 2);
}

#[tokio::test]
async fn a_missing_key_gets_400_untouched() {
    let server = ReferenceServer::start(Link::Clean).await;
    let (client, _) = support::unkeyed_client();

    let response = client
        .post(server.url("/orders"))
        .body("{}")
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 400);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 1);
    assert_eq!(server.arrivals().len(), 1);
    assert!(server.effects().is_empty());
}

/// Three copies of one logical POST (the first two responses lost): the values the server
/// received, in order.
async fn keys_received(format: KeyFormat) -> Vec<Vec<u8>> {
    let server = ReferenceServer::start(Link::DropFirstResponses(2)).await;
    let (client, _) = keyed_client(support::policy(), seeded_keys(format));

    let response = client
        .post(server.url("/orders"))
        .body("{}")
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 201);
    assert_eq!(server.effects().len(), 1);
    let keys: Vec<Vec<u8>> = server
        .arrivals()
        .into_iter()
        .map(|a| a.key.unwrap())
        .collect();
    assert_eq!(keys.len(), 3);
    assert_eq!(
        RetryRecord::of(&response)
            .unwrap()
            .idempotency_key()
            .unwrap()
            .as_bytes(),
        keys[0]
    );
    keys
}

#[tokio::test]
async fn every_attempt_carries_the_identical_quoted_key() {
    let keys = keys_received(KeyFormat::Quoted).await;
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
    let text = std::str::from_utf8(&keys[0]).unwrap();
    let inner = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap();
    assert_eq!(uuid_version(inner), 4);
}

#[tokio::test]
async fn every_attempt_carries_the_identical_bare_key() {
    let keys = keys_received(KeyFormat::Bare).await;
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
    assert_eq!(uuid_version(std::str::from_utf8(&keys[0]).unwrap()), 4);
}

/// The version nibble of a hyphenated UUID.
fn uuid_version(text: &str) -> u32 {
    assert_eq!(text.len(), 36, "{text}");
    text[14..15].parse().unwrap()
}

#[tokio::test]
async fn a_keyed_post_is_retried_on_503_with_the_same_key() {
    let server = support::always(503).await;
    let (client, _) = support::client();

    let response = client.post(server.uri()).body("x").send().await.unwrap();

    assert_eq!(response.status(), 503);
    let received = server.received_requests().await.unwrap();
    assert_eq!(received.len(), 3);
    let values: Vec<_> = received
        .iter()
        .map(|r| r.headers["idempotency-key"].clone())
        .collect();
    assert!(values.iter().all(|v| *v == values[0]));
    assert_eq!(
        RetryRecord::of(&response).unwrap().idempotency_key(),
        Some(&values[0])
    );
}

#[tokio::test]
async fn a_409_is_retried_only_under_a_key_sent_before_and_an_unkeyed_one_is_not() {
    let server =
        support::first_then(ResponseTemplate::new(409), 2, ResponseTemplate::new(201)).await;
    let (client, _) = support::client();

    // The caller's own key, which an earlier run may have sent: the original is in flight.
    let keyed = client
        .post(server.uri())
        .header("idempotency-key", "order-7");
    let keyed = keyed.body("x").send().await.unwrap();
    assert_eq!(keyed.status(), 201);
    assert_eq!(RetryRecord::of(&keyed).unwrap().attempts(), 3);
    let received = server.received_requests().await.unwrap();
    assert!(
        received
            .iter()
            .all(|r| r.headers["idempotency-key"] == "order-7")
    );

    // A key the middleware has just made: no server can hold an original under it, so the
    // first attempt's 409 is the server's own conflict, final.
    server.reset().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(409))
        .mount(&server)
        .await;
    let fresh = client.post(server.uri()).body("x").send().await.unwrap();
    assert_eq!(fresh.status(), 409);
    assert_eq!(
        support::ended(&fresh),
        (1, reqwest_safe_retry::StopReason::NotRetryable)
    );
    assert_eq!(server.received_requests().await.unwrap().len(), 1);

    // Once an attempt with it has gone, the key has been sent: a 409 after a 503 is in flight.
    server.reset().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(503))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(409))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(201))
        .mount(&server)
        .await;
    let later = client.post(server.uri()).body("x").send().await.unwrap();
    assert_eq!(later.status(), 201);
    assert_eq!(RetryRecord::of(&later).unwrap().attempts(), 3);

    server.reset().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(409))
        .mount(&server)
        .await;
    let unkeyed = client.get(server.uri()).send().await.unwrap();
    assert_eq!(unkeyed.status(), 409);
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_derived_key_s_first_409_is_in_flight_since_a_crashed_run_may_have_sent_it() {
    let server =
        support::first_then(ResponseTemplate::new(409), 1, ResponseTemplate::new(201)).await;
    let (client, _) = support::client();
    let job = client
        .post(server.uri())
        .with_extension(NaturalKey::new("order-7/charge"));
    let response = job.body("x").send().await.unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
}

#[tokio::test]
async fn a_replay_marker_on_an_answer_to_a_request_without_a_key_means_nothing() {
    let server = support::always(503).await;
    server.reset().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(503).insert_header("idempotent-replayed", "true"))
        .mount(&server)
        .await;
    let (client, _) = support::client();
    // A GET carries no key: a proxy's echo of the marker does not turn its retries off.
    let response = client.get(server.uri()).send().await.unwrap();
    assert_eq!(
        support::ended(&response),
        (3, StopReason::AttemptsExhausted)
    );
    assert!(!RetryRecord::of(&response).unwrap().replayed());
    assert_eq!(server.received_requests().await.unwrap().len(), 3);
    // Under a key just made, the first answer cannot be a replay either; the second can.
    let response = client.post(server.uri()).body("x").send().await.unwrap();
    assert_eq!(support::ended(&response), (2, StopReason::ReplayedFailure));
    assert!(RetryRecord::of(&response).unwrap().replayed());
}

#[tokio::test]
async fn a_callers_key_is_kept_byte_for_byte_even_when_stamping_is_off() {
    let server = support::always(503).await;
    let keys = IdempotencyKeys::builder()
        .stamp_methods([])
        .build()
        .unwrap();
    let (client, _) = keyed_client(support::policy(), keys);
    // A valid Structured Field String, escapes and all: sent exactly as written.
    let own = r#""tenant=7; order=\"A-1\"""#;

    client
        .post(server.uri())
        .header("Idempotency-Key", own)
        .body("x")
        .send()
        .await
        .unwrap();
    let unkeyed = client.post(server.uri()).body("y").send().await.unwrap();

    let received = server.received_requests().await.unwrap();
    // Three attempts for the keyed POST, one for the POST stamping left alone.
    assert_eq!(received.len(), 4);
    for r in &received[..3] {
        assert_eq!(r.headers["idempotency-key"].as_bytes(), own.as_bytes());
    }
    assert!(received[3].headers.get("idempotency-key").is_none());
    assert_eq!(
        RetryRecord::of(&unkeyed).unwrap().stop_reason(),
        StopReason::NotSafeToRetry
    );
}

#[tokio::test]
async fn get_requests_are_not_stamped() {
    let server = support::always(200).await;
    let (client, _) = support::client();

    let response = client.get(server.uri()).send().await.unwrap();

    assert!(
        RetryRecord::of(&response)
            .unwrap()
            .idempotency_key()
            .is_none()
    );
    let received = server.received_requests().await.unwrap();
    assert!(received[0].headers.get("idempotency-key").is_none());
}

#[tokio::test]
async fn a_key_that_cannot_be_sent_fails_before_anything_is_sent() {
    let server = support::always(201).await;
    let keys = IdempotencyKeys::builder()
        .format(KeyFormat::Bare)
        .key_source(|| "two words".to_owned())
        .build()
        .unwrap();
    let (client, _) = keyed_client(support::policy(), keys);

    let err = client
        .post(server.uri())
        .body("x")
        .send()
        .await
        .unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.attempts(), 0);
    assert_eq!(retry.stop_reason(), StopReason::InvalidIdempotencyKey);
    assert!(retry.to_string().contains("\"two words\""), "{retry}");
    assert!(server.received_requests().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_custom_header_name_is_used() {
    let server = support::always(201).await;
    let keys = IdempotencyKeys::builder()
        .header_name("X-Request-Key")
        .format(KeyFormat::Bare)
        .key_source(|| "k-1".to_owned())
        .build()
        .unwrap();
    let (client, _) = keyed_client(support::policy(), keys);

    client.patch(server.uri()).body("x").send().await.unwrap();

    let received = server.received_requests().await.unwrap();
    assert_eq!(received[0].headers["x-request-key"], "k-1");
    assert!(received[0].headers.get("idempotency-key").is_none());
}

/// A server that checks the key as Django's drf-idempotency does (letters, digits and `-._~:`
/// only, else `400`), answers the first arrival of each key `503` before doing anything, and
/// then performs the effect once per key, replaying it to later copies.
struct ValidatingServer {
    /// Per key: arrivals, and whether its effect was performed.
    seen: std::sync::Mutex<std::collections::HashMap<Vec<u8>, (u32, bool)>>,
    effects: std::sync::atomic::AtomicU32,
}

impl wiremock::Respond for ValidatingServer {
    fn respond(&self, request: &wiremock::Request) -> ResponseTemplate {
        let Some(key) = request.headers.get("idempotency-key") else {
            return ResponseTemplate::new(400).set_body_string("Idempotency-Key required");
        };
        let valid = |b: &u8| b.is_ascii_alphanumeric() || b"-._~:".contains(b);
        if key.is_empty() || !key.as_bytes().iter().all(valid) {
            return ResponseTemplate::new(400).set_body_string(
                "Invalid Idempotency-Key: must contain only letters, digits, and '-._~:'",
            );
        }
        let mut seen = self.seen.lock().unwrap();
        let (arrivals, done) = seen.entry(key.as_bytes().to_vec()).or_default();
        *arrivals += 1;
        if *arrivals == 1 {
            return ResponseTemplate::new(503);
        }
        if !*done {
            *done = true;
            self.effects
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        ResponseTemplate::new(201)
    }
}

#[tokio::test]
async fn the_default_key_passes_a_server_that_validates_like_drf_idempotency() {
    let server = wiremock::MockServer::start().await;
    let validating = Arc::new(ValidatingServer {
        seen: Default::default(),
        effects: Default::default(),
    });
    struct Shared(Arc<ValidatingServer>);
    impl wiremock::Respond for Shared {
        fn respond(&self, request: &wiremock::Request) -> ResponseTemplate {
            self.0.respond(request)
        }
    }
    Mock::given(any())
        .respond_with(Shared(validating.clone()))
        .mount(&server)
        .await;
    // The defaults, apart from the clock: keys as the middleware makes them out of the box.
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(support::policy()).with_clock(clock.clone()))
        .build();

    for order in 0..3 {
        let response = client
            .post(format!("{}/orders", server.uri()))
            .body(format!("{{\"order\":{order}}}"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "order {order}");
        assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
    }

    assert_eq!(
        validating
            .effects
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );
    let received = server.received_requests().await.unwrap();
    assert_eq!(received.len(), 6);
    for pair in received.chunks(2) {
        let key = &pair[0].headers["idempotency-key"];
        assert_eq!(pair[1].headers["idempotency-key"], *key);
        assert_eq!(uuid_version(key.to_str().unwrap()), 4);
    }

    // The same server refuses the quoted form, the draft's, to every request: what the default
    // spares its users.
    let quoted = IdempotencyKeys::builder()
        .format(KeyFormat::Quoted)
        .build()
        .unwrap();
    let (strict, _) = keyed_client(support::policy(), quoted);
    let refused = strict.post(server.uri()).body("{}").send().await.unwrap();
    assert_eq!(refused.status(), 400);
    assert_eq!(
        validating
            .effects
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );
}

/// Waits, in real time and for 10 s at most, until `done` holds.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A job that charges order 42: a POST whose key, with `natural`, is derived from the order
/// and the step. It runs once, its process crashes after the server took the POST on and before
/// the answer, and it is run again by a new process (a queue redelivering it). Returns the
/// second run's response, and the keys the server saw.
async fn crash_and_rerun(
    server: &ReferenceServer,
    gate: &Semaphore,
    natural: bool,
) -> (reqwest::Response, Vec<Vec<u8>>) {
    let job = |client: ClientWithMiddleware| {
        let mut request = client
            .post(server.url("/orders"))
            .body("{\"order\":42,\"amount\":4200}");
        if natural {
            request = request.with_extension(NaturalKey::new("order-42/charge"));
        }
        request.send()
    };
    let (first, _) = keyed_client(support::policy(), IdempotencyKeys::default());
    let run = tokio::spawn(job(first));
    until("the server took the first run's POST on", || {
        server.claims() == 1
    })
    .await;
    // The crash: the first run's client, its connection and its future are gone.
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());
    gate.add_permits(2);
    until("the first run's effect is done", || {
        server.effects().len() == 1
    })
    .await;

    let (second, _) = keyed_client(support::policy(), IdempotencyKeys::default());
    let response = job(second).await.unwrap();
    let keys = server
        .arrivals()
        .into_iter()
        .filter_map(|a| a.key)
        .collect();
    (response, keys)
}

#[tokio::test]
async fn a_job_re_run_after_a_crash_sends_its_derived_key_again_and_the_effect_happens_once() {
    let gate = Arc::new(Semaphore::new(0));
    let server = ReferenceServer::start_with_gate(Link::Clean, Some(gate.clone())).await;

    let (response, keys) = crash_and_rerun(&server, &gate, true).await;

    let record = RetryRecord::of(&response).unwrap();
    assert!(
        record.replayed(),
        "the second run got the first run's answer"
    );
    assert_eq!(server.effects().len(), 1, "one charge");
    // The UUID v5 of "order-42/charge" in the default namespace, on both runs.
    let derived = b"a84c0017-db11-533d-b2ac-49d735995854".to_vec();
    assert_eq!(keys, [derived.clone(), derived.clone()]);
    assert_eq!(record.idempotency_key().unwrap().as_bytes(), derived);
    let original = server.original_response("anonymous", &derived).unwrap();
    assert_is_original(&received(response).await, &original);
}

#[tokio::test]
async fn without_a_natural_key_the_re_run_is_a_new_operation_and_charges_twice() {
    let gate = Arc::new(Semaphore::new(0));
    let server = ReferenceServer::start_with_gate(Link::Clean, Some(gate.clone())).await;

    let (response, keys) = crash_and_rerun(&server, &gate, false).await;

    // What derived keys are for: a stamped key lives for one send() in one process.
    assert!(!RetryRecord::of(&response).unwrap().replayed());
    assert_eq!(server.effects().len(), 2);
    assert_eq!(keys.len(), 2);
    assert_ne!(keys[0], keys[1]);
}

#[tokio::test]
async fn a_natural_key_on_a_dependency_without_keys_is_refused_before_sending() {
    let server = support::always(201).await;
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(
                Dependency::new("default", support::policy()).without_idempotency_keys(),
            )
            .with_clock(clock),
        )
        .build();

    let err = client
        .post(server.uri())
        .with_extension(NaturalKey::new("order-42/charge"))
        .send()
        .await
        .unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (0, StopReason::InvalidIdempotencyKey)
    );
    assert!(err.to_string().contains("turn keys on"), "{err}");
    assert!(server.received_requests().await.unwrap().is_empty());
}

/// Reads only: a policy narrowed to GET and HEAD retries a GET, and sends a PUT, a keyed POST
/// and a POST that never reached the server once each, though the safety rules alone would
/// retry all three; the key the POST carries changes nothing of it.
#[tokio::test]
async fn a_policy_narrowed_to_reads_retries_only_reads() {
    let policy = RetryPolicy::builder()
        .retryable_methods([http::Method::GET, http::Method::HEAD])
        .build()
        .unwrap();
    let (client, clock) = keyed_client(policy, IdempotencyKeys::default());
    let server = support::always(503).await;

    let read = client.get(server.uri()).send().await.unwrap();
    assert_eq!(support::ended(&read), (3, StopReason::AttemptsExhausted));
    assert_eq!(server.received_requests().await.unwrap().len(), 3);

    let put = client.put(server.uri()).body("x").send().await.unwrap();
    assert_eq!(support::ended(&put), (1, StopReason::RetriesDisabled));
    let keyed = client.post(server.uri()).body("x").send().await.unwrap();
    assert_eq!(support::ended(&keyed), (1, StopReason::RetriesDisabled));
    assert!(
        RetryRecord::of(&keyed).unwrap().idempotency_key().is_some(),
        "still keyed"
    );
    assert_eq!(server.received_requests().await.unwrap().len(), 3 + 2);

    let refused = support::refused_url().await;
    let err = client.post(refused).body("x").send().await.unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (1, StopReason::RetriesDisabled)
    );
    assert_eq!(clock.sleeps().len(), 2, "only the read waited");
}
