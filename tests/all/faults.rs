//! Transport faults on real loopback sockets: each is retried, and the attempts are counted.

use std::time::{Duration, Instant};

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{
    FakeClock, RetryError, RetryErrorExt, RetryMiddleware, RetryRecord, SeededRng, StopReason,
};

use crate::support::{self, Action, RawServer};

#[tokio::test]
async fn a_reset_before_the_head_is_complete_is_retried() {
    let server = RawServer::start(vec![
        Action::WriteThenReset(b"HTTP/1.1 200 OK\r\ncontent-le".to_vec()),
        Action::WriteThenReset(b"HTTP/1.1 200 OK\r\ncontent-le".to_vec()),
        Action::Respond(support::ok("whole")),
    ])
    .await;
    let (client, clock) = support::client();

    let response = client.get(server.url("/")).send().await.unwrap();

    assert_eq!(server.requests(), 3);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 3);
    assert_eq!(clock.sleeps().len(), 2);
    assert_eq!(response.text().await.unwrap(), "whole");
}

#[tokio::test]
async fn resets_on_every_attempt_exhaust_the_attempts() {
    let server = RawServer::start(vec![Action::WriteThenReset(b"HTTP/1.1 2".to_vec())]).await;
    let (client, _) = support::client();

    let err = client.get(server.url("/")).send().await.unwrap_err();

    assert_eq!(server.requests(), 3);
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.attempts(), 3);
    assert_eq!(retry.stop_reason(), StopReason::AttemptsExhausted);
    assert!(!retry.timed_out());
    assert!(retry.url().is_some_and(|u| u.as_str() == server.url("/")));
}

#[tokio::test]
async fn a_server_that_closes_before_answering_is_retried() {
    let server = RawServer::start(vec![Action::Close]).await;
    let (client, clock) = support::client();

    let err = client.get(server.url("/")).send().await.unwrap_err();

    assert_eq!(server.requests(), 3);
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.attempts(), 3);
    assert_eq!(retry.stop_reason(), StopReason::AttemptsExhausted);
    assert_eq!(clock.sleeps().len(), 2);
}

#[tokio::test]
async fn a_refused_port_is_retried() {
    let port = support::refused_port().await;
    let (client, clock) = support::client();

    let err = client
        .get(format!("http://127.0.0.1:{port}/"))
        .send()
        .await
        .unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert!(retry.failed_to_connect());
    assert_eq!(retry.attempts(), 3);
    assert_eq!(clock.sleeps().len(), 2);
}

/// A connector layer that never connects.
#[derive(Clone)]
struct NeverConnects;

impl<S> tower_layer::Layer<S> for NeverConnects {
    type Service = NeverConnecting<S>;

    fn layer(&self, inner: S) -> Self::Service {
        NeverConnecting(inner)
    }
}

#[derive(Clone)]
struct NeverConnecting<S>(S);

impl<S: tower_service::Service<R>, R> tower_service::Service<R> for NeverConnecting<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::future::Pending<Result<S::Response, S::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: R) -> Self::Future {
        std::future::pending()
    }
}

#[tokio::test]
async fn a_connect_cut_by_reqwest_s_own_timer_is_a_timeout_that_sent_nothing() {
    // reqwest times a connect twice, by its own timer and by its connector's, and the two run
    // out at the same moment: either may report it. A connector that never connects leaves
    // reqwest's own timer, whose error is reqwest's type, not an I/O error.
    let port = support::refused_port().await;
    let reqwest = reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(20))
        .connector_layer(NeverConnects)
        .build()
        .unwrap();
    let clock = FakeClock::new();
    let middleware = RetryMiddleware::new(support::policy())
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(7));
    let client = ClientBuilder::new(reqwest).with(middleware).build();

    let err = client
        .post(format!("http://127.0.0.1:{port}/orders"))
        .send()
        .await
        .unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (3, StopReason::AttemptsExhausted)
    );
    assert!(retry.failed_to_connect(), "{retry}");
    assert!(retry.timed_out(), "{retry}");
    assert!(err.timed_out() && err.failed_to_connect(), "{err}");
    assert_eq!(clock.sleeps().len(), 2);
}

#[tokio::test]
async fn a_slow_server_is_cut_off_by_the_attempt_timeout_and_retried() {
    let slow = Action::Delay(Duration::from_secs(10), support::ok("late"));
    let server = RawServer::start(vec![
        slow.clone(),
        slow,
        Action::Respond(support::ok("on time")),
    ])
    .await;
    let client = support::real_time_client(Duration::from_millis(40));

    let started = Instant::now();
    let response = client.get(server.url("/")).send().await.unwrap();

    assert_eq!(server.requests(), 3);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 3);
    assert_eq!(response.text().await.unwrap(), "on time");
    // Two attempts cut at 40 ms each, not two waits of 10 s: seconds of slack for a loaded
    // machine.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn timeouts_on_every_attempt_surface_as_a_timeout_error() {
    let server = RawServer::start(vec![Action::Delay(
        Duration::from_millis(300),
        support::ok("late"),
    )])
    .await;
    let client = support::real_time_client(Duration::from_millis(30));

    let err = client.get(server.url("/")).send().await.unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert!(retry.timed_out(), "{retry}");
    assert_eq!(retry.attempts(), 3);
    assert_eq!(server.requests(), 3);
}

#[tokio::test]
async fn a_shorter_timeout_on_the_request_wins() {
    // The server would take 5 s; the request's own timeout is 150 ms, the policy's 5 s. The
    // margin is wide on purpose: under load, a 30 ms timeout could fire before the server had
    // even read the request, and the count below would miss it.
    let server = RawServer::start(vec![Action::Delay(
        Duration::from_secs(5),
        support::ok("late"),
    )])
    .await;
    let (client, _) = support::client(); // attempt timeout 5 s

    let started = Instant::now();
    let err = client
        .get(server.url("/"))
        .timeout(Duration::from_millis(150))
        .send()
        .await
        .unwrap_err();
    let took = started.elapsed();

    let retry = RetryError::of(&err).unwrap();
    assert!(retry.timed_out(), "{retry}");
    assert_eq!(retry.attempts(), 3);
    // Three cuts of 150 ms, not one wait of the policy's 5 s.
    assert!(took >= Duration::from_millis(450), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    // The server reads each request on its own task: give its count a moment (bounded).
    for _ in 0..100 {
        if server.requests() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.requests(), 3);
}

#[tokio::test]
async fn a_post_without_a_key_whose_connection_is_reset_is_not_retried() {
    // The server read the whole request: it may have acted on it.
    let server = RawServer::start(vec![Action::WriteThenReset(Vec::new())]).await;
    let (client, _) = support::unkeyed_client();

    let err = client
        .post(server.url("/orders"))
        .body("charge 10 EUR")
        .send()
        .await
        .unwrap_err();

    assert_eq!(server.requests(), 1);
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.attempts(), 1);
    assert_eq!(retry.stop_reason(), StopReason::NotSafeToRetry);
}

/// A resolver that knows no name, as one that lost its upstream fails every lookup; it counts
/// the lookups. No query leaves the machine.
#[derive(Debug, Default)]
struct NoSuchHost(std::sync::atomic::AtomicU32);

impl reqwest::dns::Resolve for NoSuchHost {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let name = name.as_str().to_owned();
        Box::pin(async move {
            let lost = std::io::Error::other(format!("{name}: the resolver has no upstream"));
            Err(lost.into())
        })
    }
}

/// Nothing is sent when a name does not resolve, so a GET and an unkeyed POST alike make the
/// policy's attempts, and the budget pays for each retry and refuses the ones it cannot pay.
#[tokio::test]
async fn a_host_name_that_cannot_be_resolved_is_retried_for_every_method_within_the_budget() {
    use reqwest_safe_retry::{Dependency, FakeClock, RetryBudget, RetryMiddleware, SeededRng};
    let resolver = std::sync::Arc::new(NoSuchHost::default());
    let one_retry = RetryBudget::builder()
        .capacity(1.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let dependency = Dependency::new("payments", support::policy())
        .without_idempotency_keys()
        .with_budget(RetryBudget::builder().capacity(4.0).build().unwrap());
    let client = |dependency: &Dependency| {
        let inner = reqwest::Client::builder()
            .dns_resolver(resolver.clone())
            .build()
            .unwrap();
        reqwest_middleware::ClientBuilder::new(inner)
            .with(
                RetryMiddleware::new(dependency.clone())
                    .with_clock(FakeClock::new())
                    .with_rng(SeededRng::new(1)),
            )
            .build()
    };
    let url = "http://payments.invalid/orders?id=7";

    let payments = client(&dependency);
    for method in [reqwest::Method::GET, reqwest::Method::POST] {
        let err = payments
            .request(method.clone(), url)
            .body("{}")
            .send()
            .await
            .unwrap_err();
        let retry = RetryError::of(&err).unwrap();
        assert_eq!(
            (retry.attempts(), retry.stop_reason()),
            (3, StopReason::AttemptsExhausted),
            "{method}: {err}"
        );
        assert!(retry.failed_to_connect(), "{err}");
    }
    assert_eq!(resolver.0.load(std::sync::atomic::Ordering::SeqCst), 6);
    let counts = dependency.counters();
    assert_eq!((counts.attempts, counts.retries), (6, 4));

    // A budget of one token pays for one retry; the next is refused.
    let poor = Dependency::new("poor", support::policy()).with_budget(one_retry);
    let err = client(&poor).post(url).body("{}").send().await.unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (2, StopReason::BudgetExhausted)
    );
    assert_eq!(resolver.0.load(std::sync::atomic::Ordering::SeqCst), 8);
}
