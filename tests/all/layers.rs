//! One layer retries: nested instances make the outermost's attempts whatever their timing,
//! inner ones count nothing, and a request a middleware makes of its own is retried by its own
//! instance.

use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryMiddleware, RetryPolicy, RetryRecord, SeededRng, StopReason,
};
use wiremock::ResponseTemplate;

use crate::support::{self, Action, RawServer};

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
        let slow = Action::Delay(Duration::from_millis(40), support::unavailable());
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

/// One layer retries across the two doors too: a tower layer over a service that sends
/// through a reqwest chain carrying the middleware, and a reqwest chain whose transport is a
/// tower `RetryService`; and two tower layers with a service between them that sends from another
/// task. Either door alone makes 3 attempts of an always-503 GET; nested, the server sees 3
/// arrivals, not 9, and the inner instance counts nothing.
#[cfg(feature = "tower")]
mod across_doors {
    use tower_layer::Layer;
    use tower_service::Service;

    use super::*;
    use crate::support::{ThroughReqwest, ThroughTower};

    fn retrying(name: &str) -> (RetryMiddleware, Dependency) {
        let dependency = Dependency::new(name, RetryPolicy::default()).without_budget();
        let middleware = RetryMiddleware::new(dependency.clone())
            .with_clock(FakeClock::new())
            .with_rng(SeededRng::new(5));
        (middleware, dependency)
    }

    /// The outer instance made the default 3 attempts of the always-503 GET, the server saw
    /// those 3, and the inner instance saw no request of its own.
    async fn one_layer_of_attempts(
        record: RetryRecord,
        server: &wiremock::MockServer,
        [outer, inner]: [&Dependency; 2],
    ) {
        assert_eq!(
            (record.attempts(), record.stop_reason()),
            (3, StopReason::AttemptsExhausted)
        );
        assert_eq!(server.received_requests().await.unwrap().len(), 3);
        assert_eq!(outer.counters().attempts, 3);
        assert_eq!(inner.counters().requests, 0);
    }

    #[tokio::test]
    async fn a_tower_layer_over_a_reqwest_chain_with_the_middleware_makes_one_layer_of_attempts() {
        let server = support::always(503).await;
        let (inner, inner_counts) = retrying("inner");
        let chain = ClientBuilder::new(reqwest::Client::new())
            .with(inner)
            .build();
        let (outer, outer_counts) = retrying("outer");
        let mut service = outer.layer(ThroughReqwest(chain));
        let request = http::Request::get(server.uri())
            .body(String::new())
            .unwrap();
        let response = service.call(request).await.unwrap();
        assert_eq!(response.status(), 503);
        let record = RetryRecord::of(&response).unwrap();
        one_layer_of_attempts(record, &server, [&outer_counts, &inner_counts]).await;
    }

    #[tokio::test]
    async fn a_reqwest_chain_over_a_retry_service_makes_one_layer_of_attempts() {
        let server = support::always(503).await;
        let client = crate::support::hyper_client();
        let (inner, inner_counts) = retrying("inner");
        let (outer, outer_counts) = retrying("outer");
        let chain = ClientBuilder::new(reqwest::Client::new())
            .with(outer)
            .with(ThroughTower(inner.layer(client)))
            .build();
        let response = chain.get(server.uri()).send().await.unwrap();
        assert_eq!(response.status(), 503);
        let record = RetryRecord::of(&response).unwrap();
        one_layer_of_attempts(record, &server, [&outer_counts, &inner_counts]).await;
    }

    /// The server's URL written as a user may write it, each way other than the URL
    /// standard's: a port with a leading zero, dot segments, braces in the path, a quote in
    /// the query.
    fn written_otherwise(server: &wiremock::MockServer) -> Vec<String> {
        let port = server.address().port();
        vec![
            format!("http://127.0.0.1:0{port}/orders"),
            format!("http://127.0.0.1:{port}/a/../orders/./7"),
            format!("http://127.0.0.1:{port}/orders/{{7}}"),
            format!("http://127.0.0.1:{port}/orders?note='x'"),
        ]
    }

    /// However the target is written, the two doors know one request: nested across them it
    /// makes one layer of attempts (before, the tower door fingerprinted the URI as written,
    /// the reqwest door its `Url`, and each retried: 9 arrivals).
    #[tokio::test]
    async fn a_target_written_otherwise_still_makes_one_layer_of_attempts_across_the_doors() {
        // One server per form, each form through both nestings.
        for form in 0..4 {
            let server = support::always(503).await;
            let url = written_otherwise(&server).swap_remove(form);

            let (inner, inner_counts) = retrying("inner");
            let chain = ClientBuilder::new(reqwest::Client::new())
                .with(inner)
                .build();
            let (outer, outer_counts) = retrying("outer");
            let mut service = outer.layer(ThroughReqwest(chain));
            let request = http::Request::get(&url).body(String::new()).unwrap();
            let response = service.call(request).await.unwrap();
            let record = RetryRecord::of(&response).unwrap();
            one_layer_of_attempts(record, &server, [&outer_counts, &inner_counts]).await;

            let server = support::always(503).await;
            let url = written_otherwise(&server).swap_remove(form);
            let (inner, inner_counts) = retrying("inner");
            let (outer, outer_counts) = retrying("outer");
            let chain = ClientBuilder::new(reqwest::Client::new())
                .with(outer)
                .with(ThroughTower(inner.layer(crate::support::hyper_client())))
                .build();
            let response = chain.get(&url).send().await.unwrap();
            let record = RetryRecord::of(&response).unwrap();
            one_layer_of_attempts(record, &server, [&outer_counts, &inner_counts]).await;
        }
    }

    /// A service between two layers that sends each request on from another task (as
    /// `tower::buffer` does): the claim's mark on the thread does not reach it, the mark each
    /// copy carries in its extensions does.
    #[derive(Clone)]
    struct Spawning<S>(S);

    impl<S, B> Service<http::Request<B>> for Spawning<S>
    where
        S: Service<http::Request<B>> + Clone + Send + 'static,
        B: Send + 'static,
        S::Future: Send,
        S::Response: Send + 'static,
        S::Error: Send + 'static,
    {
        type Response = S::Response;
        type Error = S::Error;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>,
        >;

        fn poll_ready(
            &mut self,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), S::Error>> {
            self.0.poll_ready(cx)
        }

        fn call(&mut self, request: http::Request<B>) -> Self::Future {
            let mut inner = self.0.clone();
            let task = tokio::spawn(async move {
                std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
                inner.call(request).await
            });
            Box::pin(async move { task.await.expect("the sending task ends") })
        }
    }

    #[tokio::test]
    async fn two_tower_layers_with_a_task_between_them_make_one_layer_of_attempts() {
        let server = support::always(503).await;
        let client = crate::support::hyper_client();
        let (inner, inner_counts) = retrying("inner");
        let (outer, outer_counts) = retrying("outer");
        let mut service = outer.layer(Spawning(inner.layer(client)));
        let request = http::Request::get(server.uri())
            .body(String::new())
            .unwrap();
        let response = service.call(request).await.unwrap();
        assert_eq!(response.status(), 503);
        let record = RetryRecord::of(&response).unwrap();
        one_layer_of_attempts(record, &server, [&outer_counts, &inner_counts]).await;
    }
}
