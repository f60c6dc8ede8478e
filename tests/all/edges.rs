//! The promises at their edges, on loopback: nested instances whatever their timing, requests
//! dropped during their backoff, no real time in a virtual-time test, tokio's paused clock, a
//! runtime without a timer, budgets that earn only from answers, and timeouts that keep their
//! kind.

use std::time::{Duration, Instant};

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryBudget, RetryError, RetryMiddleware, RetryPolicy, RetryRecord,
    SeededRng, StopReason,
};
use wiremock::matchers::any;
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support::{self, Action, RawServer};

fn unavailable() -> Vec<u8> {
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec()
}

/// `layers` instances on the real clock, each with a 100 ms attempt timeout, 3 attempts and
/// waits of at most 2 ms, in front of `url`.
fn nested_on_the_real_clock(layers: usize) -> ClientWithMiddleware {
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .attempt_timeout(Duration::from_millis(100))
        .base_delay(Duration::from_millis(1))
        .max_delay(Duration::from_millis(2))
        .build()
        .unwrap();
    let mut builder = ClientBuilder::new(reqwest::Client::new());
    for layer in 0..layers {
        builder = builder.with(
            RetryMiddleware::new(Dependency::new("default", policy).without_budget())
                .with_rng(SeededRng::new(layer as u64)),
        );
    }
    builder.build()
}

/// Each attempt takes 40 ms and gets a 503: an inner loop of three such attempts outlasts an
/// outer instance's 100 ms attempt timeout. If the outer timer could cut the inner loop and be
/// retried, one `send()` would make up to 3^layers attempts, and the caller would see a timeout.
#[tokio::test]
async fn nested_instances_make_one_layers_attempts_whatever_their_timeouts() {
    for layers in [2, 3] {
        let slow = Action::Delay(Duration::from_millis(40), unavailable());
        let server = RawServer::start(vec![slow]).await;
        let client = nested_on_the_real_clock(layers);

        let response = client.get(server.url("/")).send().await.unwrap();

        assert_eq!(response.status(), 503, "{layers} layers");
        assert_eq!(server.requests(), 3, "{layers} layers");
        let record = RetryRecord::of(&response).unwrap();
        assert_eq!(record.attempts(), 3);
        assert_eq!(record.stop_reason(), StopReason::AttemptsExhausted);
    }
}

/// The outermost instance is the one that retries: its policy and its counters apply, and the
/// inner ones pass the request through without counting it.
#[tokio::test]
async fn the_outermost_instance_retries_and_the_inner_ones_count_nothing() {
    let server = support::always(503).await;
    let clock = FakeClock::new();
    let outer_counts = Dependency::from(RetryPolicy::builder().max_attempts(4).build().unwrap());
    let inner_counts = Dependency::from(RetryPolicy::builder().max_attempts(2).build().unwrap());
    let outer = RetryMiddleware::new(outer_counts.clone())
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(1));
    let inner = RetryMiddleware::new(inner_counts.clone()).with_clock(clock.clone());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(outer)
        .with(inner)
        .build();

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 4);
    assert_eq!(server.received_requests().await.unwrap().len(), 4);
    assert_eq!(outer_counts.counters().attempts, 4);
    assert_eq!(inner_counts.counters().attempts, 0);
    assert_eq!(inner_counts.counters().requests, 0);
}

/// A middleware of the chain that makes a request of its own (here, fetching a token) through
/// another client with this middleware: that request is not the one the outer instance already
/// retries, so its own instance retries it.
struct FetchesAToken {
    tokens: ClientWithMiddleware,
    url: String,
}

#[async_trait::async_trait]
impl Middleware for FetchesAToken {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let token = self.tokens.get(&self.url).send().await?;
        let attempts = RetryRecord::of(&token).unwrap().attempts();
        request
            .headers_mut()
            .insert("x-token-attempts", attempts.to_string().parse().unwrap());
        next.run(request, extensions).await
    }
}

#[tokio::test]
async fn a_request_a_middleware_makes_of_its_own_is_retried_by_its_own_instance() {
    let tokens =
        support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    let api = support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    let clock = FakeClock::new();
    let retrying = || {
        RetryMiddleware::new(RetryPolicy::default())
            .with_clock(clock.clone())
            .with_rng(SeededRng::new(3))
    };
    let token_client = ClientBuilder::new(reqwest::Client::new())
        .with(retrying())
        .build();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(retrying())
        .with(FetchesAToken {
            tokens: token_client,
            url: tokens.uri(),
        })
        .build();

    let response = client.get(api.uri()).send().await.unwrap();

    assert_eq!(response.status(), 200);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
    // Each of the outer instance's two attempts fetched a token: the first fetch met the
    // token server's 503 and was retried by the token client's own instance.
    assert_eq!(tokens.received_requests().await.unwrap().len(), 3);
    let seen: Vec<String> = api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| r.headers["x-token-attempts"].to_str().unwrap().to_owned())
        .collect();
    assert_eq!(seen, ["2", "1"]);
}

/// Twenty-one callers each give up after 100 ms, while their retries wait 1 s: the ten that got
/// tokens are dropped mid-backoff. None of their retries happened, so none stays paid for or
/// counted, and the next request's retry is granted.
#[tokio::test]
async fn requests_dropped_during_their_backoff_give_their_tokens_back() {
    let server = support::always(503).await;
    let budget = RetryBudget::builder()
        .capacity(10.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let slow_backoff = RetryPolicy::builder()
        .base_delay(Duration::from_secs(1))
        .max_delay(Duration::from_secs(1))
        .build()
        .unwrap();
    // The top of every draw (a second's wait) until the last request, which draws no wait.
    let draw = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
    let drawn = draw.clone();
    let counters = Dependency::new("default", slow_backoff).with_budget(budget.clone());
    let middleware = RetryMiddleware::new(counters.clone())
        .with_rng(move || drawn.load(std::sync::atomic::Ordering::Relaxed));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();

    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..21 {
        let (client, url) = (client.clone(), server.uri());
        callers.spawn(async move {
            tokio::time::timeout(Duration::from_millis(100), client.get(url).send()).await
        });
    }
    let (mut gave_up, mut refused) = (0, 0);
    while let Some(done) = callers.join_next().await {
        match done.unwrap() {
            Err(_elapsed) => gave_up += 1,
            Ok(response) => {
                let record = RetryRecord::of(&response.unwrap()).unwrap();
                assert_eq!(record.stop_reason(), StopReason::BudgetExhausted);
                refused += 1;
            }
        }
    }

    assert_eq!((gave_up, refused), (10, 11));
    assert_eq!(server.received_requests().await.unwrap().len(), 21);
    assert_eq!(budget.balance(), 10.0);
    let counts = counters.counters();
    assert_eq!((counts.attempts, counts.retries), (21, 0));

    // The next request gets its retry (a fast one: it draws no wait).
    let flaky =
        support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    draw.store(0, std::sync::atomic::Ordering::Relaxed);
    let response = client.get(flaky.uri()).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
    assert_eq!(counters.counters().retries, 1);
}

/// What one request does with a budget that starts empty and earns twenty tokens a second, on
/// a fake clock: `gap` of real time passes between building the budget and the clock.
async fn attempts_and_sleeps_after(gap: Duration) -> (u32, Vec<Duration>) {
    let server =
        support::first_then(ResponseTemplate::new(503), 2, ResponseTemplate::new(200)).await;
    let budget = RetryBudget::builder()
        .initial(0.0)
        .floor_per_sec(20.0)
        .build()
        .unwrap();
    tokio::time::sleep(gap).await;
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(
                Dependency::new("default", RetryPolicy::default()).with_budget(budget),
            )
            .with_clock(clock.clone())
            .with_rng(SeededRng::new(3)),
        )
        .build();
    let response = client.get(server.uri()).send().await.unwrap();
    let attempts = RetryRecord::of(&response).unwrap().attempts();
    (attempts, clock.sleeps())
}

#[tokio::test]
async fn real_time_never_leaks_into_a_budget_on_a_fake_clock() {
    let (without_gap, with_gap) = tokio::join!(
        attempts_and_sleeps_after(Duration::ZERO),
        // Two tokens' worth of real time, had it leaked.
        attempts_and_sleeps_after(Duration::from_millis(110)),
    );
    assert_eq!(without_gap, with_gap);
    // An empty budget on virtual time zero: the first retry is refused.
    assert_eq!(without_gap, (1, vec![]));
}

/// The way many users test: tokio's clock paused, the default clock, a real server. Backoff
/// takes no real time, and tokio's auto-advance does not cut the attempts waiting for the
/// server.
#[tokio::test(start_paused = true)]
async fn tokio_s_paused_clock_works_with_the_default_clock_against_a_real_server() {
    let server =
        support::first_then(ResponseTemplate::new(503), 2, ResponseTemplate::new(200)).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(RetryPolicy::default()).with_rng(|| u64::MAX))
        .build();

    let (virtual_start, real_start) = (tokio::time::Instant::now(), Instant::now());
    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 200, "{:?}", RetryRecord::of(&response));
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 3);
    assert_eq!(server.received_requests().await.unwrap().len(), 3);
    // The waits (100 ms and 200 ms at their ceiling) passed in virtual time...
    assert!(virtual_start.elapsed() >= Duration::from_millis(300));
    // ...and the attempts were not cut by an auto-advance to their 10 s timeout.
    assert!(virtual_start.elapsed() < Duration::from_secs(10));
    assert!(real_start.elapsed() < Duration::from_secs(5));
}

/// Under a paused clock the per-attempt timeout is measured in real time, so it still cuts a
/// server that is really too slow.
#[tokio::test(start_paused = true)]
async fn under_a_paused_clock_the_attempt_timeout_is_real_time() {
    let slow = Action::Delay(Duration::from_millis(300), support::ok("late"));
    let server = RawServer::start(vec![slow, Action::Respond(support::ok("on time"))]).await;
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(40))
        .build()
        .unwrap();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy))
        .build();

    let real_start = Instant::now();
    let response = client.get(server.url("/")).send().await.unwrap();

    assert_eq!(response.text().await.unwrap(), "on time");
    assert_eq!(server.requests(), 2);
    assert!(
        real_start.elapsed() < Duration::from_millis(280),
        "{:?}",
        real_start.elapsed()
    );
}

/// A server on a runtime of its own, for a client on a runtime without tokio's timer.
fn server_elsewhere(script: Vec<Action>) -> (RawServer, std::thread::JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            tx.send(RawServer::start(script).await).unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
    });
    (rx.recv().unwrap(), thread)
}

#[test]
fn a_runtime_without_a_timer_works_with_a_fake_clock_and_fails_clearly_with_tokio_s() {
    let (server, _thread) = server_elsewhere(vec![
        Action::Respond(unavailable()),
        Action::Respond(support::ok("ok")),
    ]);
    let no_timer = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    no_timer.block_on(async {
        let clock = FakeClock::new();
        let client = ClientBuilder::new(reqwest::Client::new())
            .with(RetryMiddleware::new(RetryPolicy::default()).with_clock(clock.clone()))
            .build();
        let response = client.get(server.url("/")).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(server.requests(), 2);
        assert_eq!(clock.sleeps().len(), 1);

        let client = ClientBuilder::new(reqwest::Client::new())
            .with(RetryMiddleware::new(RetryPolicy::default()))
            .build();
        let err = client.get(server.url("/")).send().await.unwrap_err();
        let retry = RetryError::of(&err).unwrap();
        assert_eq!(retry.stop_reason(), StopReason::TimerUnavailable);
        assert_eq!(retry.attempts(), 0);
        assert!(err.to_string().contains("enable_time()"), "{err}");
        assert_eq!(server.requests(), 2, "nothing was sent");
    });
}

/// Fails every request before it reaches the network: an error, not an answer.
#[derive(Debug)]
struct Refuses;

#[async_trait::async_trait]
impl Middleware for Refuses {
    async fn handle(
        &self,
        _: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        Err(reqwest_middleware::Error::middleware(
            std::io::Error::other("refused by policy"),
        ))
    }
}

#[tokio::test]
async fn permanent_errors_earn_the_budget_nothing_and_answers_do() {
    let budget = RetryBudget::builder()
        .initial(0.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let ours = || {
        RetryMiddleware::new(
            Dependency::new("default", support::policy()).with_budget(budget.clone()),
        )
        .with_clock(FakeClock::new())
    };
    // The refusing middleware sits after ours: its error is the attempt's outcome.
    let refusing = ClientBuilder::new(reqwest::Client::new())
        .with(ours())
        .with(Refuses)
        .build();
    let plain = ClientBuilder::new(reqwest::Client::new())
        .with(ours())
        .build();
    let looping = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(302).insert_header("location", "/again"))
        .mount(&looping)
        .await;

    for _ in 0..5 {
        assert!(refusing.get(looping.uri()).send().await.is_err());
        let err = plain.get(looping.uri()).send().await.unwrap_err();
        assert!(RetryError::of(&err).unwrap().last_error().is_redirect());
    }
    assert_eq!(budget.balance(), 0.0, "ten errors earned something");

    let missing = support::always(404).await;
    for _ in 0..10 {
        plain.get(missing.uri()).send().await.unwrap();
    }
    assert_eq!(budget.balance(), 1.0, "ten answers earn one token");
}

#[tokio::test]
async fn only_a_success_after_retries_refunds_its_retry() {
    let budget = RetryBudget::aws_like();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(
                Dependency::new("default", support::policy()).with_budget(budget.clone()),
            )
            .with_clock(FakeClock::new()),
        )
        .build();
    let then_404 =
        support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(404)).await;
    client.get(then_404.uri()).send().await.unwrap();
    assert_eq!(budget.balance(), 495.0, "a 404 after a retry is no success");
    let then_200 =
        support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    client.get(then_200.uri()).send().await.unwrap();
    assert_eq!(budget.balance(), 495.0, "paid 5, refunded 5");
}

/// The question generic code asks of any error: is there a timeout somewhere in its sources?
fn timed_out_somewhere(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    // Bounded: no real chain is this deep.
    for _ in 0..32 {
        let Some(cause) = source else {
            return false;
        };
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return true;
            }
        }
        source = cause.source();
    }
    false
}

#[tokio::test]
async fn the_middleware_s_own_timeout_is_a_timeout_to_generic_checks() {
    let slow = Action::Delay(Duration::from_millis(300), support::ok("late"));
    let server = RawServer::start(vec![slow]).await;
    let client = support::real_time_client(Duration::from_millis(20));

    let err = client.get(server.url("/")).send().await.unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert!(retry.timed_out());
    assert!(timed_out_somewhere(&err), "{err:?}");
    assert_eq!(server.requests(), 3);
    // The last attempt's error is the middleware's own, and says how long the attempt had.
    let reqwest_middleware::Error::Middleware(last) = retry.last_error() else {
        panic!("not the middleware's timeout: {:?}", retry.last_error());
    };
    assert_eq!(last.to_string(), "attempt timed out after 20ms");
}
