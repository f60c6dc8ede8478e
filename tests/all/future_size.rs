//! The logical request's future is boxed once per request, for the chain: its size decides
//! which of the allocator's size classes serves it. glibc's per-thread cache serves chunks of
//! up to 1,032 bytes; a larger future takes the slower path on every request (about 520
//! instructions more, in the instruction bench). This test holds the size to that bound, for
//! every kind of request, so no comment in the driver has to.

use std::sync::Mutex;
use std::time::Duration;

use reqwest_middleware::{ClientBuilder, Middleware, Next};
use reqwest_safe_retry::{Dependency, RetryMiddleware, RetryOverride, RetryPolicy};

/// The largest future glibc's per-thread cache serves (its largest tcache chunk, 64-bit).
const BOUND: usize = 1_032;

/// An outer middleware that records the size of the future the rest of the chain (the retry
/// middleware) returns.
struct Measure(Mutex<Vec<usize>>);

#[async_trait::async_trait]
impl Middleware for Measure {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut http::Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let future = next.run(request, extensions);
        self.0.lock().unwrap().push(std::mem::size_of_val(&*future));
        future.await
    }
}

#[tokio::test]
async fn the_request_future_stays_within_the_allocator_s_fast_size_class() {
    let server = crate::support::always(200).await;
    let measure = std::sync::Arc::new(Measure(Mutex::new(Vec::new())));
    let hedging = RetryPolicy::builder()
        .hedge_reads(0.05, Duration::from_millis(50))
        .build()
        .unwrap();
    let client = |dependency: Dependency| {
        ClientBuilder::new(reqwest::Client::new())
            .with_arc(measure.clone())
            .with(RetryMiddleware::new(dependency))
            .build()
    };
    let plain = client(Dependency::new("plain", RetryPolicy::default()));
    let hedged = client(Dependency::new("hedged", hedging));

    plain.get(server.uri()).send().await.unwrap();
    plain.post(server.uri()).body("x").send().await.unwrap();
    let over = RetryOverride::new()
        .max_attempts(5)
        .deadline(Duration::from_secs(5));
    plain
        .get(server.uri())
        .with_extension(over)
        .send()
        .await
        .unwrap();
    hedged.get(server.uri()).send().await.unwrap();

    let sizes = measure.0.lock().unwrap().clone();
    assert_eq!(sizes.len(), 4, "plain, keyed, overridden, hedged");
    for (kind, size) in ["plain", "keyed", "overridden", "hedged"]
        .iter()
        .zip(&sizes)
    {
        assert!(
            *size <= BOUND,
            "the {kind} request's future is {size} bytes, over {BOUND}: glibc's per-thread \
             cache no longer serves it, and every request pays the allocator's slow path; box \
             the state that grew (only the rare states need room), or hold less across an await"
        );
    }
}

/// The same bound behind the tower door, whose service boxes the logical request's future (with
/// the inner service and the request's extensions it holds) once per call.
#[cfg(feature = "tower")]
#[tokio::test]
async fn the_tower_door_s_request_future_stays_within_the_same_size_class() {
    use tower_layer::Layer;
    use tower_service::Service;

    let server = crate::support::always(200).await;
    let hedging = RetryPolicy::builder()
        .hedge_reads(0.05, Duration::from_millis(50))
        .build()
        .unwrap();
    let client = crate::support::hyper_client();
    let mut plain = RetryMiddleware::new(RetryPolicy::default()).layer(client.clone());
    let mut hedged = RetryMiddleware::new(Dependency::new("hedged", hedging)).layer(client);
    let over = RetryOverride::new()
        .max_attempts(5)
        .deadline(Duration::from_secs(5));
    let requests = [
        (
            "plain",
            http::Request::get(server.uri()).body(String::new()),
        ),
        (
            "keyed",
            http::Request::post(server.uri()).body(String::from("x")),
        ),
        (
            "overridden",
            http::Request::get(server.uri())
                .extension(over)
                .body(String::new()),
        ),
    ];
    let mut sizes = Vec::new();
    for (kind, request) in requests {
        let future = plain.call(request.unwrap());
        sizes.push((kind, std::mem::size_of_val(&*future)));
        assert_eq!(future.await.unwrap().status(), 200, "{kind}");
    }
    let future = hedged.call(
        http::Request::get(server.uri())
            .body(String::new())
            .unwrap(),
    );
    sizes.push(("hedged", std::mem::size_of_val(&*future)));
    assert_eq!(future.await.unwrap().status(), 200, "hedged");
    for (kind, size) in sizes {
        assert!(
            size <= BOUND,
            "the {kind} request's future is {size} bytes behind the tower door, over {BOUND}: \
             box the state that grew, or hold less across an await"
        );
    }
}

/// The same bound behind the gRPC door, whose service boxes the call's future (with the
/// transport, the call and its extensions) once per call.
#[cfg(feature = "grpc")]
#[tokio::test]
async fn the_grpc_door_s_call_future_stays_within_the_same_size_class() {
    use tower_layer::Layer;
    use tower_service::Service;

    let script = crate::grpc::server::Script::new([]);
    let uri = crate::grpc::server::serve(&script).await;
    let policy = reqwest_safe_retry::grpc::GrpcRetryPolicy::builder()
        .max_attempts(3)
        .initial_backoff(Duration::from_millis(10))
        .max_backoff(Duration::from_millis(10))
        .retryable_codes([tonic::Code::Unavailable])
        .build()
        .unwrap();
    let config = reqwest_safe_retry::grpc::GrpcConfig::new()
        .retry("echo.Echo", policy)
        .unwrap();
    let mut service = reqwest_safe_retry::grpc::GrpcRetryLayer::new(config)
        .layer(crate::grpc::server::channel(&uri));
    let request = http::Request::post("/echo.Echo/Say")
        .header("te", "trailers")
        .header("content-type", "application/grpc")
        .body(tonic::body::Body::empty())
        .unwrap();
    let future = service.call(request);
    let size = std::mem::size_of_val(&*future);
    // An empty body is no message: the server answers with a status, which is all this needs.
    let _ = future.await;
    // With `metrics`, a call holds its method's reporter (one pointer, made once per method)
    // for gRPC's per-call metrics (gRFC A96), recorded when it ends: that much past the bound,
    // a cost of the feature alone.
    let bound = BOUND + usize::from(cfg!(feature = "metrics")) * size_of::<usize>();
    assert!(
        size <= bound,
        "the call's future is {size} bytes behind the gRPC door, over {bound}: box the state \
         that grew, or hold less across an await"
    );
}
