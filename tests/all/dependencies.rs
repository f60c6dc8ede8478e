//! Per dependency and per request: routing by host, overrides, one layer of retries, counters,
//! the observer hook, `metrics` and tracing.

#[cfg(feature = "metrics")]
use std::collections::HashMap;
#[cfg(feature = "metrics")]
use std::sync::OnceLock;
#[cfg(feature = "metrics")]
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::RetryErrorExt;
use reqwest_safe_retry::{
    CounterSnapshot, Dependency, FakeClock, RetryBudget, RetryError, RetryEvent, RetryMiddleware,
    RetryOverride, RetryPolicy, RetryRecord, SeededRng, StopReason,
};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support::{self, Action, RawServer, always};

fn attempts(n: u32) -> RetryPolicy {
    RetryPolicy::builder().max_attempts(n).build().unwrap()
}

fn host_port(server: &MockServer) -> String {
    server.address().to_string()
}

fn build(middleware: RetryMiddleware) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(
            middleware
                .with_clock(FakeClock::new())
                .with_rng(SeededRng::new(6)),
        )
        .build()
}

#[tokio::test]
async fn two_hosts_in_one_client_get_their_own_policies_and_budgets() {
    let (a, b) = (always(503).await, always(503).await);
    let small = RetryBudget::builder()
        .capacity(2.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let a_dep = Dependency::new("a", attempts(2)).with_budget(small.clone());
    let b_dep = Dependency::new("b", attempts(4));
    let (a_counters, b_counters) = (a_dep.clone(), b_dep.clone());
    let b_budget = b_dep.budget().unwrap().clone();
    let client = build(
        RetryMiddleware::new(attempts(1))
            .route(&host_port(&a), a_dep)
            .unwrap()
            .route(&host_port(&b), b_dep)
            .unwrap(),
    );

    // Exhaust a's budget: two retries are paid for, the third is refused.
    for _ in 0..3 {
        client.get(a.uri()).send().await.unwrap();
    }
    assert_eq!(
        (
            a_counters.counters().retries,
            a_counters.counters().budget_refusals
        ),
        (2, 1)
    );
    assert_eq!(a.received_requests().await.unwrap().len(), 2 + 2 + 1);

    // b's retries are untouched by a's empty bucket: four attempts, three paid retries.
    let response = client.get(b.uri()).send().await.unwrap();
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 4);
    assert_eq!(b.received_requests().await.unwrap().len(), 4);
    assert_eq!(b_counters.counters().retries, 3);
    assert!(
        b_budget.balance() < b_budget.capacity() && small.balance() < 1.0,
        "each bucket paid for its own dependency's retries"
    );
    assert_eq!(a_counters.counters().budget_refusals, 1);
    assert_eq!(b_counters.counters().budget_refusals, 0);
    assert_eq!(b_counters.counters().requests, 1);
}

#[tokio::test]
async fn unrouted_hosts_use_the_default_dependency() {
    let server = always(503).await;
    let routed = Dependency::new("elsewhere", attempts(5));
    let default = Dependency::from(attempts(2));
    let middleware = RetryMiddleware::new(default.clone())
        .route("api.example.com", routed)
        .unwrap();
    let counters = default;
    let client = build(middleware);

    client.get(server.uri()).send().await.unwrap();

    assert_eq!(server.received_requests().await.unwrap().len(), 2);
    assert_eq!(counters.counters().attempts, 2);
}

#[tokio::test]
async fn a_request_can_turn_retries_off_or_change_the_policy() {
    let server = always(503).await;
    let client = build(RetryMiddleware::new(attempts(3)));

    let once = client
        .get(server.uri())
        .with_extension(RetryOverride::new().no_retries())
        .send()
        .await
        .unwrap();
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
    let record = RetryRecord::of(&once).unwrap();
    assert_eq!(record.stop_reason(), StopReason::RetriesDisabled);

    let patient = client
        .get(server.uri())
        .with_extension(RetryOverride::new().max_attempts(5))
        .send()
        .await
        .unwrap();
    assert_eq!(server.received_requests().await.unwrap().len(), 1 + 5);
    assert_eq!(RetryRecord::of(&patient).unwrap().attempts(), 5);

    client.get(server.uri()).send().await.unwrap();
    assert_eq!(server.received_requests().await.unwrap().len(), 1 + 5 + 3);
}

/// A client of 3 attempts whose waits are 1 s each (the top of every draw), with this deadline
/// and no budget, on a fake clock.
fn one_second_waits(deadline: Duration) -> (ClientWithMiddleware, FakeClock) {
    let clock = FakeClock::new();
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .base_delay(Duration::from_secs(1))
        .max_delay(Duration::from_secs(1))
        .deadline(deadline)
        .build()
        .unwrap();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(Dependency::new("default", policy).without_budget())
                .with_clock(clock.clone())
                .with_rng(|| u64::MAX),
        )
        .build();
    (client, clock)
}

/// A narrow override changes one setting and keeps the rest of the dependency's policy: its
/// base delay, here, which the fake clock's recorded waits show.
#[tokio::test]
async fn a_request_can_change_only_its_attempts_or_its_deadline() {
    let server = always(503).await;
    let (client, clock) = one_second_waits(Duration::from_secs(60));

    let more = client
        .get(server.uri())
        .with_extension(RetryOverride::new().max_attempts(6))
        .send()
        .await
        .unwrap();
    assert_eq!(RetryRecord::of(&more).unwrap().attempts(), 6);
    assert_eq!(
        RetryRecord::of(&more).unwrap().stop_reason(),
        StopReason::AttemptsExhausted
    );
    assert_eq!(clock.sleeps(), [Duration::from_secs(1); 5]);
    assert_eq!(server.received_requests().await.unwrap().len(), 6);

    // 1.5 s leaves time for one wait of 1 s, not a second: the deadline stops the request
    // before the policy's third attempt, and its base delay is still 1 s.
    clock.clear_sleeps();
    let sooner = client
        .get(server.uri())
        .with_extension(RetryOverride::new().deadline(Duration::from_millis(1_500)))
        .send()
        .await
        .unwrap();
    let record = RetryRecord::of(&sooner).unwrap();
    assert_eq!(record.stop_reason(), StopReason::DeadlineReached);
    assert_eq!(record.attempts(), 2);
    assert_eq!(clock.sleeps(), [Duration::from_secs(1)]);
    assert_eq!(server.received_requests().await.unwrap().len(), 6 + 2);
}

#[tokio::test]
async fn an_override_of_no_attempts_fails_before_sending_and_says_why() {
    let server = always(200).await;
    let client = build(RetryMiddleware::new(RetryPolicy::default()));
    let err = client
        .get(server.uri())
        .with_extension(RetryOverride::new().max_attempts(0))
        .send()
        .await
        .unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.stop_reason(), StopReason::InvalidOverride);
    assert_eq!(retry.attempts(), 0);
    let source = std::error::Error::source(retry).unwrap().to_string();
    assert_eq!(
        source,
        "invalid retry override: max_attempts(0) leaves no attempt: use at least 1 (1 sends once)"
    );
    assert!(server.received_requests().await.unwrap().is_empty());
}

/// "6 attempts and a 60 s deadline" for one call, in one value: both hold. The dependency's
/// 3 s deadline alone would stop the sixth attempt's way (1 s waits), and its 3 attempts would
/// stop before that.
#[tokio::test]
async fn one_override_combines_attempts_and_a_deadline() {
    let server = always(503).await;
    let (client, clock) = one_second_waits(Duration::from_secs(3));
    let send = |over: RetryOverride| client.get(server.uri()).with_extension(over).send();

    let only_attempts = send(RetryOverride::new().max_attempts(6)).await.unwrap();
    let record = RetryRecord::of(&only_attempts).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (3, StopReason::DeadlineReached),
        "the dependency's 3 s deadline still holds"
    );
    clock.clear_sleeps();

    let both = RetryOverride::new()
        .max_attempts(6)
        .deadline(Duration::from_secs(60));
    let response = send(both).await.unwrap();
    let record = RetryRecord::of(&response).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (6, StopReason::AttemptsExhausted)
    );
    assert_eq!(record.waited(), Duration::from_secs(5));
    assert_eq!(clock.sleeps(), [Duration::from_secs(1); 5]);
    assert_eq!(server.received_requests().await.unwrap().len(), 3 + 6);
}

/// What the docs lead a user to build, a whole policy, put on a request: never ignored. The
/// request fails before sending and the message says what to use; so does any other of the
/// crate's settings put there.
#[tokio::test]
async fn a_policy_or_another_setting_on_a_request_fails_it_before_sending() {
    let server = always(503).await;
    let client = build(RetryMiddleware::new(attempts(3)));
    let policy = RetryPolicy::builder().max_attempts(6).build().unwrap();
    let budget = reqwest_safe_retry::RetryBudget::default();
    let refused = [
        (
            client.get(server.uri()).with_extension(policy),
            "a RetryPolicy",
        ),
        (
            client.get(server.uri()).with_extension(policy.to_builder()),
            "a RetryPolicyBuilder",
        ),
        (
            client
                .get(server.uri())
                .with_extension(Dependency::new("other", policy)),
            "a Dependency",
        ),
        (
            client.get(server.uri()).with_extension(budget),
            "a RetryBudget",
        ),
        (
            client
                .get(server.uri())
                .with_extension(reqwest_safe_retry::IdempotencyKeys::default()),
            "an IdempotencyKeys",
        ),
    ];
    for (request, found) in refused {
        let err = request.send().await.unwrap_err();
        let retry = RetryError::of(&err).unwrap();
        assert_eq!(
            (retry.stop_reason(), retry.attempts()),
            (StopReason::InvalidOverride, 0)
        );
        let source = std::error::Error::source(retry).unwrap().to_string();
        assert_eq!(
            source,
            format!(
                "invalid retry override: {found} in a request's extensions is not read: say \
                 what this request changes with a RetryOverride \
                 (RetryOverride::new().max_attempts(6).deadline(..)), or send it through a \
                 Dependency of its own (RetryMiddleware::route)"
            )
        );
    }
    assert!(server.received_requests().await.unwrap().is_empty());
    // Beside a RetryOverride too: the policy is not read, whatever else the request says.
    let err = client
        .get(server.uri())
        .with_extension(RetryOverride::new().max_attempts(2))
        .with_extension(RetryPolicy::default())
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.stop_reason(), Some(StopReason::InvalidOverride));
    assert!(server.received_requests().await.unwrap().is_empty());
}

/// A deadline override at or below the base delay (100 ms) leaves no room for a retry: the
/// request makes one attempt, and succeeds when that one does; when it fails, the deadline is
/// what ended it, and the record says so. On a fake clock, whose time
/// stands still while a request is on the wire, so a 1 ms attempt timeout cannot cut a loopback
/// answer on a loaded machine.
#[tokio::test]
async fn a_deadline_override_too_short_for_a_retry_sends_once_and_never_fails_the_call() {
    let fine = always(200).await;
    let down = always(503).await;
    let client = build(RetryMiddleware::new(RetryPolicy::default()));
    for deadline in [
        Duration::from_millis(1),
        Duration::from_millis(50),
        Duration::ZERO,
    ] {
        let response = client
            .get(fine.uri())
            .with_extension(RetryOverride::new().deadline(deadline))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{deadline:?}");
        let record = RetryRecord::of(&response).unwrap();
        assert_eq!(
            (record.attempts(), record.stop_reason()),
            (1, StopReason::Succeeded)
        );

        let response = client
            .get(down.uri())
            .with_extension(RetryOverride::new().deadline(deadline))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        let record = RetryRecord::of(&response).unwrap();
        assert_eq!(
            (record.attempts(), record.stop_reason()),
            (1, StopReason::DeadlineReached),
            "{deadline:?}"
        );
    }
    assert_eq!(fine.received_requests().await.unwrap().len(), 3);
    assert_eq!(down.received_requests().await.unwrap().len(), 3);
}

fn nested(layers: usize) -> ClientWithMiddleware {
    let mut builder = ClientBuilder::new(reqwest::Client::new());
    for layer in 0..layers {
        builder = builder.with(
            RetryMiddleware::new(attempts(3))
                .with_clock(FakeClock::new())
                .with_rng(SeededRng::new(layer as u64)),
        );
    }
    builder.build()
}

#[tokio::test]
async fn three_nested_layers_make_three_attempts_not_twenty_seven() {
    let server = always(503).await;
    let client = nested(3);

    for round in 1..=4 {
        let response = client.get(server.uri()).send().await.unwrap();
        assert_eq!(response.status(), 503);
        // The outermost layer made the attempts (the inner ones passed each through): its record.
        let record = RetryRecord::of(&response).unwrap();
        assert_eq!(record.attempts(), 3);
        assert_eq!(record.stop_reason(), StopReason::AttemptsExhausted);
        assert_eq!(server.received_requests().await.unwrap().len(), 3 * round);
    }
}

#[tokio::test]
async fn three_nested_layers_against_a_dead_socket_make_three_attempts() {
    let server = RawServer::start(vec![Action::Close]).await;
    let client = nested(3);

    let err = client.get(server.url("/")).send().await.unwrap_err();

    assert_eq!(server.requests(), 3);
    // The outermost layer's error, the last attempt's inside it, not wrapped again by inner ones.
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.attempts(), 3);
    assert_eq!(retry.stop_reason(), StopReason::AttemptsExhausted);
    let last = retry.last_error().beneath().expect("the transport's error");
    assert!(RetryError::of(last).is_none());
}

/// A scripted scenario whose counts are computed by hand:
///
/// - GET /flaky: 503, 503, 200 (Retry-After: 1 on the second 503) → 1 request, 3 attempts,
///   2 retries, 1 Retry-After honoured.
/// - POST /orders: 201 → 1 request, 1 attempt, 1 key stamped.
/// - GET /down: 503 with Retry-After: 3600 → 1 request, 1 attempt, stopped at once.
/// - GET /slow with a 1.5 s deadline and waits of 1 s: 503, 503 → stops on the deadline:
///   1 request, 2 attempts, 1 retry, 1 deadline stop.
async fn scripted_scenario(name: &str) -> CounterSnapshot {
    use wiremock::matchers::{method, path};
    let server = MockServer::start().await;
    Mock::given(path("/flaky"))
        .respond_with(ResponseTemplate::new(503))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(path("/flaky"))
        .respond_with(ResponseTemplate::new(503).insert_header("retry-after", "1"))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(path("/flaky"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(201))
        .mount(&server)
        .await;
    Mock::given(path("/down"))
        .respond_with(ResponseTemplate::new(503).insert_header("retry-after", "3600"))
        .mount(&server)
        .await;
    Mock::given(path("/slow"))
        .respond_with(ResponseTemplate::new(503))
        .mount(&server)
        .await;

    let dependency = Dependency::new(name, RetryPolicy::default());
    let counters = dependency.clone();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(dependency)
                .with_clock(FakeClock::new())
                .with_rng(|| u64::MAX),
        )
        .build();
    let url = |p: &str| format!("{}{p}", server.uri());

    client.get(url("/flaky")).send().await.unwrap();
    client.post(url("/orders")).body("x").send().await.unwrap();
    client.get(url("/down")).send().await.unwrap();
    // Waits of 100 ms, then 200 ms (the top of each draw): the second ends past 150 ms.
    client
        .get(url("/slow"))
        .with_extension(RetryOverride::new().deadline(Duration::from_millis(150)))
        .send()
        .await
        .unwrap();
    counters.counters()
}

fn expected() -> CounterSnapshot {
    let mut c = CounterSnapshot::default();
    c.requests = 4;
    c.attempts = 3 + 1 + 1 + 2;
    c.retries = 2 + 1;
    c.budget_refusals = 0;
    c.deadline_stops = 1;
    c.retry_after_honoured = 1;
    c.keys_stamped = 1;
    c
}

#[tokio::test]
async fn counters_after_a_scripted_scenario_equal_the_hand_count() {
    assert_eq!(scripted_scenario("scripted").await, expected());
}

#[tokio::test]
async fn the_observer_sees_every_decision() {
    let server = always(503).await;
    let events = Arc::new(Mutex::new(Vec::new()));
    let seen = events.clone();
    let client = build(
        RetryMiddleware::new(Dependency::new("observed", attempts(3))).with_observer(
            move |e: &RetryEvent<'_>| {
                seen.lock().unwrap().push((
                    e.dependency.to_owned(),
                    e.attempt,
                    e.status,
                    e.delay.is_some(),
                    e.stop,
                ));
            },
        ),
    );

    client.get(server.uri()).send().await.unwrap();

    let events = events.lock().unwrap().clone();
    let name = "observed".to_owned();
    assert_eq!(
        events,
        [
            (name.clone(), 1, Some(503), true, None),
            (name.clone(), 2, Some(503), true, None),
            (
                name,
                3,
                Some(503),
                false,
                Some(StopReason::AttemptsExhausted)
            ),
        ]
    );
}

/// The event names the request (method, URL without its query) and the server's
/// `Retry-After` floor; a failed attempt's error is a typed kind.
#[tokio::test]
async fn the_observer_sees_the_request_the_floor_and_the_error_kind() {
    use reqwest_safe_retry::AttemptErrorKind;
    let server = MockServer::start().await;
    Mock::given(wiremock::matchers::any())
        .respond_with(ResponseTemplate::new(503).insert_header("retry-after", "2"))
        .mount(&server)
        .await;
    type Seen = (String, String, Option<Duration>, Option<AttemptErrorKind>);
    let events: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let seen = events.clone();
    let client = build(RetryMiddleware::new(attempts(2)).with_observer(
        move |e: &RetryEvent<'_>| {
            seen.lock().unwrap().push((
                e.method.to_string(),
                e.url.to_owned(),
                e.retry_after,
                e.error,
            ));
        },
    ));

    client
        .put(format!("{}/orders/7?token=secret", server.uri()))
        .body("x")
        .send()
        .await
        .unwrap();
    client
        .delete(support::refused_url().await)
        .send()
        .await
        .unwrap_err();

    let url = format!("{}/orders/7", server.uri());
    let events = events.lock().unwrap().clone();
    assert_eq!(
        events[..2],
        [
            (
                "PUT".to_owned(),
                url.clone(),
                Some(Duration::from_secs(2)),
                None
            ),
            ("PUT".to_owned(), url, Some(Duration::from_secs(2)), None),
        ]
    );
    assert_eq!(events.len(), 4);
    for event in &events[2..] {
        assert_eq!(event.0, "DELETE");
        assert_eq!(event.2, None);
        assert_eq!(event.3, Some(AttemptErrorKind::Connect));
    }
}

/// A `metrics` recorder that keeps every counter in memory, keyed by name and labels.
#[cfg(feature = "metrics")]
#[derive(Debug, Default)]
pub(crate) struct MemoryRecorder {
    counters: Mutex<HashMap<String, Arc<Cell>>>,
    gauges: Mutex<HashMap<String, Arc<Cell>>>,
    histograms: Mutex<HashMap<String, Arc<Values>>>,
    described: Mutex<Vec<(String, String)>>,
}

#[cfg(feature = "metrics")]
#[derive(Debug, Default)]
struct Cell(AtomicU64);

/// A histogram's values, in the order recorded.
#[cfg(feature = "metrics")]
#[derive(Debug, Default)]
struct Values(Mutex<Vec<f64>>);

#[cfg(feature = "metrics")]
impl metrics::HistogramFn for Values {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

/// A key's name and labels, as `name{a=x,b=y}`.
#[cfg(feature = "metrics")]
fn keyed(key: &metrics::Key) -> String {
    let labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

#[cfg(feature = "metrics")]
impl metrics::CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::SeqCst);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::SeqCst);
    }
}

#[cfg(feature = "metrics")]
impl metrics::GaugeFn for Cell {
    fn increment(&self, _: f64) {}
    fn decrement(&self, _: f64) {}
    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::SeqCst);
    }
}

#[cfg(feature = "metrics")]
impl MemoryRecorder {
    /// Whether a counter of this name and dependency was registered, at zero or more.
    fn registered(&self, name: &str, dependency: &str) -> bool {
        let key = format!("{name}{{dependency={dependency}}}");
        self.counters.lock().unwrap().contains_key(&key)
    }

    /// The values recorded in the histogram `name` of `labels` (`a=x,b=y`).
    pub(crate) fn histogram(&self, name: &str, labels: &str) -> Vec<f64> {
        let key = format!("{name}{{{labels}}}");
        let histograms = self.histograms.lock().unwrap();
        histograms
            .get(&key)
            .map_or_else(Vec::new, |v| v.0.lock().unwrap().clone())
    }

    /// The gauge `name` of `labels` (`a=x`), if it was set.
    pub(crate) fn gauge_of(&self, name: &str, labels: &str) -> Option<f64> {
        let key = format!("{name}{{{labels}}}");
        let gauges = self.gauges.lock().unwrap();
        gauges
            .get(&key)
            .map(|c| f64::from_bits(c.0.load(Ordering::SeqCst)))
    }

    fn gauge(&self, name: &str, dependency: &str) -> Option<f64> {
        let key = format!("{name}{{dependency={dependency}}}");
        let gauges = self.gauges.lock().unwrap();
        gauges
            .get(&key)
            .map(|c| f64::from_bits(c.0.load(Ordering::SeqCst)))
    }

    fn get(&self, name: &str, dependency: &str) -> u64 {
        let key = format!("{name}{{dependency={dependency}}}");
        self.counters
            .lock()
            .unwrap()
            .get(&key)
            .map_or(0, |c| c.0.load(Ordering::SeqCst))
    }
}

#[cfg(feature = "metrics")]
impl metrics::Recorder for MemoryRecorder {
    fn describe_counter(
        &self,
        name: metrics::KeyName,
        _: Option<metrics::Unit>,
        about: metrics::SharedString,
    ) {
        let described = (name.as_str().to_owned(), about.to_string());
        self.described.lock().unwrap().push(described);
    }
    fn describe_gauge(
        &self,
        name: metrics::KeyName,
        _: Option<metrics::Unit>,
        about: metrics::SharedString,
    ) {
        let described = (name.as_str().to_owned(), about.to_string());
        self.described.lock().unwrap().push(described);
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let cell = self
            .counters
            .lock()
            .unwrap()
            .entry(name)
            .or_default()
            .clone();
        metrics::Counter::from_arc(cell)
    }

    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        let name = keyed(key);
        let cell = self.gauges.lock().unwrap().entry(name).or_default().clone();
        metrics::Gauge::from_arc(cell)
    }

    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        let name = keyed(key);
        let values = self.histograms.lock().unwrap();
        let mut values = values;
        let cell = values.entry(name).or_default().clone();
        metrics::Histogram::from_arc(cell)
    }
}

#[cfg(feature = "metrics")]
pub(crate) fn recorder() -> &'static MemoryRecorder {
    static RECORDER: OnceLock<&'static MemoryRecorder> = OnceLock::new();
    RECORDER.get_or_init(|| {
        let recorder: &'static MemoryRecorder = Box::leak(Box::default());
        metrics::set_global_recorder(recorder).expect("the only recorder in this test binary");
        recorder
    })
}

#[cfg(feature = "metrics")]
#[tokio::test]
async fn the_metrics_facade_sees_the_same_counts() {
    let recorder = recorder();
    // A dependency name no other test uses: the recorder is global to the test binary.
    let name = "metrics-scripted";

    let counts = scripted_scenario(name).await;

    assert_eq!(counts, expected());
    let metric = |m: &str| recorder.get(&format!("reqwest_safe_retry_{m}_total"), name);
    assert_eq!(metric("requests"), counts.requests);
    assert_eq!(metric("attempts"), counts.attempts);
    assert_eq!(metric("retries"), counts.retries);
    assert_eq!(metric("budget_refusals"), counts.budget_refusals);
    assert_eq!(metric("deadline_stops"), counts.deadline_stops);
    assert_eq!(metric("retry_after_honoured"), counts.retry_after_honoured);
    assert_eq!(metric("keys_stamped"), counts.keys_stamped);
}

/// A dependency's first request describes every metric and registers every counter at zero
/// (an exporter lists `..._throttled_total 0` before anything is throttled), and the budget's
/// balance is a gauge.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn every_metric_is_described_and_registered_at_zero_with_the_budget_s_balance() {
    let recorder = recorder();
    let name = "metrics-announced";
    let server = always(503).await;
    let budget = reqwest_safe_retry::RetryBudget::builder()
        .capacity(4.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let dependency = Dependency::new(name, attempts(2)).with_budget(budget);
    let client = build(RetryMiddleware::new(dependency).with_clock(FakeClock::new()));
    client.get(server.uri()).send().await.unwrap();

    let names = [
        "requests",
        "attempts",
        "retries",
        "budget_refusals",
        "deadline_stops",
        "retry_after_honoured",
        "keys_stamped",
        "throttled",
        "hedges",
        "hedges_won",
    ];
    let described = recorder.described.lock().unwrap().clone();
    for short in names {
        let metric = format!("reqwest_safe_retry_{short}_total");
        assert!(recorder.registered(&metric, name), "{metric} registered");
        assert!(
            described
                .iter()
                .any(|(n, about)| *n == metric && !about.is_empty()),
            "{metric} described"
        );
    }
    assert_eq!(recorder.get("reqwest_safe_retry_throttled_total", name), 0);
    assert_eq!(recorder.get("reqwest_safe_retry_retries_total", name), 1);
    // Set at the retry, after it withdrew its token: 4 - 1.
    let balance = recorder.gauge("reqwest_safe_retry_budget_balance", name);
    assert_eq!(balance, Some(3.0));
    assert!(
        described
            .iter()
            .any(|(n, _)| n == "reqwest_safe_retry_budget_balance")
    );
}

#[tokio::test]
async fn a_routed_dependency_counts_apart_from_the_default() {
    let server = always(200).await;
    let routed = Dependency::new("routed", attempts(3));
    let routed_counters = routed.clone();
    let default = Dependency::from(attempts(3));
    let middleware = RetryMiddleware::new(default.clone())
        .route(&host_port(&server), routed)
        .unwrap();
    let default_counters = default;
    let client = build(middleware);

    client.get(server.uri()).send().await.unwrap();
    client
        .get(support::refused_url().await)
        .send()
        .await
        .unwrap_err();

    assert_eq!(routed_counters.counters().requests, 1);
    assert_eq!(default_counters.counters().requests, 1);
    assert_eq!(default_counters.counters().attempts, 3);
}
