//! The layer called as a tower service, without HTTP: readiness, request bodies that fail, keys
//! read from the body, and a claim that loses a race with a lease's end.

use std::future::{Ready, poll_fn, ready};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use std::time::Duration;

use safe_retry_server::store::{
    Claim, Claimed, Completion, Fence, Outbox, OutboxMessage, Outcomes, Progress, Record,
    RecoveryPoints, Settle, StagedMessage, Stalled, StepWrite, StoredAnswer,
};
use safe_retry_server::{IdempotencyLayer, KeySource, SqliteStore, Store, StoreError};
use tower_layer::Layer;
use tower_service::Service;

use crate::support::Backend;

/// A request body that is whole bytes, or fails when read.
enum TestBody {
    Bytes(Full<Bytes>),
    Fails,
}

impl From<Bytes> for TestBody {
    fn from(bytes: Bytes) -> TestBody {
        TestBody::Bytes(Full::new(bytes))
    }
}

impl Body for TestBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            TestBody::Bytes(full) => Pin::new(full)
                .poll_frame(cx)
                .map_err(|never| match never {}),
            TestBody::Fails => Poll::Ready(Some(Err(std::io::Error::other(
                "the connection broke mid-body",
            )))),
        }
    }
}

/// A handler that counts its calls and answers 201, with the readiness it is given.
#[derive(Clone)]
struct Handler {
    calls: Arc<AtomicUsize>,
    ready: fn() -> Poll<Result<(), &'static str>>,
}

impl Handler {
    fn new() -> Handler {
        Handler {
            calls: Arc::default(),
            ready: || Poll::Ready(Ok(())),
        }
    }
}

impl std::fmt::Debug for Handler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Handler")
    }
}

impl Service<Request<TestBody>> for Handler {
    type Response = Response<Full<Bytes>>;
    type Error = &'static str;
    type Future = Ready<Result<Response<Full<Bytes>>, &'static str>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), &'static str>> {
        (self.ready)()
    }

    fn call(&mut self, _: Request<TestBody>) -> Self::Future {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let mut response = Response::new(Full::new(Bytes::from(format!("call {n}"))));
        *response.status_mut() = StatusCode::CREATED;
        ready(Ok(response))
    }
}

async fn send<S>(service: &mut S, request: Request<TestBody>) -> (StatusCode, Bytes)
where
    S: Service<Request<TestBody>, Response = Response<safe_retry_server::ReplyBody<Full<Bytes>>>>,
    S::Error: std::fmt::Debug,
{
    poll_fn(|cx| service.poll_ready(cx)).await.unwrap();
    let response = service.call(request).await.unwrap();
    let status = response.status();
    (
        status,
        response.into_body().collect().await.unwrap().to_bytes(),
    )
}

fn post(key: Option<&str>, body: TestBody) -> Request<TestBody> {
    let mut request = Request::post("/charges");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(body).unwrap()
}

#[tokio::test]
async fn the_layer_is_ready_when_its_handler_is_and_says_what_it_wraps() {
    let layer = IdempotencyLayer::builder(SqliteStore::memory().await.unwrap())
        .shared_scope()
        .build()
        .unwrap();
    let mut refusing = layer.layer(Handler {
        ready: || Poll::Ready(Err("overloaded")),
        ..Handler::new()
    });
    let readiness = poll_fn(|cx| Poll::Ready(refusing.poll_ready(cx))).await;
    assert_eq!(readiness, Poll::Ready(Err("overloaded")));
    let mut busy = layer.layer(Handler {
        ready: || Poll::Pending,
        ..Handler::new()
    });
    assert!(
        poll_fn(|cx| Poll::Ready(busy.poll_ready(cx)))
            .await
            .is_pending()
    );
    assert_eq!(format!("{busy:?}"), "Idempotent { inner: Handler, .. }");
}

#[tokio::test]
async fn a_request_body_that_fails_is_a_400_and_runs_nothing() {
    let layer = IdempotencyLayer::builder(SqliteStore::memory().await.unwrap())
        .shared_scope()
        .build()
        .unwrap();
    let handler = Handler::new();
    let mut service = layer.layer(handler.clone());
    let (status, body) = send(&mut service, post(Some("k"), TestBody::Fails)).await;
    assert_eq!(status, 400);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["type"], "urn:safe-retry:problem:body-unreadable");
    assert!(
        json["detail"].as_str().unwrap().contains("broke mid-body"),
        "{json}"
    );
    assert_eq!(handler.calls.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_key_in_the_body_is_required_or_passes_through_as_configured() {
    let body = |text: &'static str| TestBody::from(Bytes::from_static(text.as_bytes()));
    let store = SqliteStore::memory().await.unwrap();
    let required = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .key(KeySource::json_pointer("/id"))
        .build()
        .unwrap();
    let handler = Handler::new();
    let mut service = required.layer(handler.clone());
    let (status, answer) = send(&mut service, post(None, body(r#"{"amount":1}"#))).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&answer).contains("missing-key"));
    assert_eq!(
        send(&mut service, post(None, body(r#"{"id":"evt_1"}"#))).await,
        (StatusCode::CREATED, Bytes::from("call 1"))
    );
    assert_eq!(
        send(&mut service, post(None, body(r#"{"id":"evt_1"}"#))).await,
        (StatusCode::CREATED, Bytes::from("call 1"))
    );
    assert_eq!(handler.calls.load(Ordering::Relaxed), 1);

    let optional = IdempotencyLayer::builder(store)
        .shared_scope()
        .key(KeySource::json_pointer("/id"))
        .require_key(false)
        .build()
        .unwrap();
    let mut service = optional.layer(handler.clone());
    assert_eq!(
        send(&mut service, post(None, body(r#"{"amount":1}"#))).await,
        (StatusCode::CREATED, Bytes::from("call 2"))
    );
    assert_eq!(
        send(&mut service, post(None, body(r#"{"amount":1}"#))).await,
        (StatusCode::CREATED, Bytes::from("call 3"))
    );
}

/// A webhook whose senders put its event id in a header or in the body: one key either way,
/// the header's first.
#[tokio::test]
async fn a_webhook_s_key_comes_from_its_header_or_else_its_body() {
    let body = |text: &'static str| TestBody::from(Bytes::from_static(text.as_bytes()));
    let layer = IdempotencyLayer::builder(SqliteStore::memory().await.unwrap())
        .shared_scope()
        .key(
            KeySource::header(http::HeaderName::from_static("webhook-id"))
                .or(KeySource::json_pointer("/id")),
        )
        .build()
        .unwrap();
    let handler = Handler::new();
    let mut service = layer.layer(handler.clone());
    let with_header = || {
        let mut request = post(None, body(r#"{"id":"evt_1","amount":1}"#));
        request
            .headers_mut()
            .insert("webhook-id", http::HeaderValue::from_static("evt_1"));
        request
    };
    assert_eq!(
        send(&mut service, with_header()).await,
        (StatusCode::CREATED, Bytes::from("call 1"))
    );
    // The same event from a sender that puts its id in the body only: the same key.
    assert_eq!(
        send(
            &mut service,
            post(None, body(r#"{"id":"evt_1","amount":1}"#))
        )
        .await,
        (StatusCode::CREATED, Bytes::from("call 1"))
    );
    assert_eq!(
        send(&mut service, with_header()).await,
        (StatusCode::CREATED, Bytes::from("call 1"))
    );
    assert_eq!(handler.calls.load(Ordering::Relaxed), 1);
    // The header comes first: a header naming another event is another key.
    let mut other = post(None, body(r#"{"id":"evt_1","amount":1}"#));
    other
        .headers_mut()
        .insert("webhook-id", http::HeaderValue::from_static("evt_2"));
    assert_eq!(
        send(&mut service, other).await,
        (StatusCode::CREATED, Bytes::from("call 2"))
    );
    let (status, answer) = send(&mut service, post(None, body(r#"{"amount":1}"#))).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&answer).contains("missing-key"));
}

/// A store whose next claims come back empty, as when a lease ends between the claim
/// statement and the read that follows it.
#[derive(Clone)]
struct LateLease<S> {
    inner: S,
    empty_claims: Arc<AtomicUsize>,
    /// Whether `begin` fails, as a database that refuses new transactions does.
    failing_begin: Arc<std::sync::atomic::AtomicBool>,
}

impl<S: Store> Outcomes for LateLease<S> {
    type Tx = S::Tx;

    async fn try_claim(&self, claim: &Claim<'_>) -> Result<Option<Claimed>, StoreError> {
        if self
            .empty_claims
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
        {
            return Ok(None);
        }
        self.inner.try_claim(claim).await
    }
    fn read(
        &self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        self.inner.read(scope, key)
    }
    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        if self.failing_begin.load(Ordering::Relaxed) {
            return Err(StoreError::new("too many connections"));
        }
        self.inner.begin().await
    }
    fn complete(
        &self,
        tx: Option<Self::Tx>,
        fence: Fence,
        answer: &StoredAnswer,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send {
        self.inner.complete(tx, fence, answer)
    }
    fn release(
        &self,
        tx: Option<Self::Tx>,
        fence: Fence,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.inner.release(tx, fence)
    }
    fn abandon(&self, fence: Fence) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.inner.abandon(fence)
    }
    fn sweep(&self, batch: u32) -> impl Future<Output = Result<u64, StoreError>> + Send {
        self.inner.sweep(batch)
    }
    fn fail(
        &self,
        fence: Fence,
        answer: &StoredAnswer,
        retention: Duration,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send {
        self.inner.fail(fence, answer, retention)
    }
}

impl<S: Store> RecoveryPoints for LateLease<S> {
    fn progress(&self, fence: Fence) -> impl Future<Output = Result<Progress, StoreError>> + Send {
        self.inner.progress(fence)
    }
    fn commit_step(
        &self,
        tx: Option<Self::Tx>,
        fence: Fence,
        write: &StepWrite<'_>,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send {
        self.inner.commit_step(tx, fence, write)
    }
    fn stalled(&self, batch: u32) -> impl Future<Output = Result<Vec<Stalled>, StoreError>> + Send {
        self.inner.stalled(batch)
    }
}

impl<S: Store> Outbox for LateLease<S> {
    fn stage(
        &self,
        tx: &mut Self::Tx,
        message: &StagedMessage<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner.stage(tx, message)
    }
    fn take_messages(
        &self,
        batch: u32,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, StoreError>> + Send {
        self.inner.take_messages(batch, lease)
    }
    fn settle(
        &self,
        id: &str,
        delivery: i64,
        settle: &Settle,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.inner.settle(id, delivery, settle)
    }
}

#[tokio::test]
async fn a_claim_that_meets_a_lease_ending_claims_again() {
    let store = SqliteStore::fresh().await;
    let racy = LateLease {
        inner: store.clone(),
        empty_claims: Arc::default(),
        failing_begin: Arc::default(),
    };
    let layer = IdempotencyLayer::builder(racy.clone())
        .shared_scope()
        .build()
        .unwrap();
    // A first holder claimed and went away; its lease has ended.
    let fingerprint_of_the_request = {
        let handler = Handler::new();
        let mut service = layer.layer(handler.clone());
        send(
            &mut service,
            post(Some("k"), TestBody::from(Bytes::from_static(b"x"))),
        )
        .await;
        assert_eq!(handler.calls.load(Ordering::Relaxed), 1);
        store.read("", "k").await.unwrap().unwrap().fingerprint
    };
    sqlx::query("UPDATE safe_retry_outcomes SET status = 'in_progress', locked_until = 0, response_status = NULL")
        .execute(store.pool())
        .await
        .unwrap();
    // The next claim statement comes back empty; the read shows the lease over: the layer
    // claims again and takes the record over, instead of answering 409.
    racy.empty_claims.store(1, Ordering::Relaxed);
    let handler = Handler::new();
    let mut service = layer.layer(handler.clone());
    let (status, body) = send(
        &mut service,
        post(Some("k"), TestBody::from(Bytes::from_static(b"x"))),
    )
    .await;
    assert_eq!((status, body), (StatusCode::CREATED, Bytes::from("call 1")));
    assert_eq!(layer.counters().snapshot().takeovers, 1);
    assert_eq!(
        store.read("", "k").await.unwrap().unwrap().fingerprint,
        fingerprint_of_the_request
    );
    // Claims that keep coming back empty while the record stays in progress (its row held by
    // a transaction that has not ended) end in a 409 after three, not a loop and not a wait.
    sqlx::query("UPDATE safe_retry_outcomes SET status = 'in_progress', locked_until = 0")
        .execute(store.pool())
        .await
        .unwrap();
    racy.empty_claims.store(3, Ordering::Relaxed);
    let (status, body) = send(
        &mut service,
        post(Some("k"), TestBody::from(Bytes::from_static(b"x"))),
    )
    .await;
    assert_eq!(status, 409);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["type"], "urn:safe-retry:problem:in-progress");
    assert_eq!(
        racy.empty_claims.load(Ordering::Relaxed),
        0,
        "three claims were tried"
    );
}

/// The `Local` extractor answers a store that cannot begin a transaction with a 503 problem
/// that names no driver's error, stores nothing, and ends the lease: the retry runs.
#[cfg(feature = "axum")]
#[tokio::test]
async fn a_local_that_cannot_begin_is_a_503() {
    use axum::routing::post;
    use safe_retry_server::Local;

    let store = SqliteStore::fresh().await;
    let racy = LateLease {
        inner: store.clone(),
        empty_claims: Arc::default(),
        failing_begin: Arc::default(),
    };
    racy.failing_begin.store(true, Ordering::Relaxed);
    let layer = IdempotencyLayer::builder(racy.clone())
        .shared_scope()
        .build()
        .unwrap();
    let mut router = axum::Router::new()
        .route(
            "/charges",
            post(|_tx: Local<LateLease<SqliteStore>>| async { "written" }),
        )
        .layer(layer.clone());
    let request = Request::post("/charges")
        .header("idempotency-key", "k")
        .body(axum::body::Body::from("x"))
        .unwrap();
    poll_fn(|cx| Service::<Request<axum::body::Body>>::poll_ready(&mut router, cx))
        .await
        .unwrap();
    let response = router.call(request).await.unwrap();
    assert_eq!(response.status(), 503);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["type"], "urn:safe-retry:problem:store-unavailable");
    assert!(!json.to_string().contains("too many connections"), "{json}");
    assert_eq!(layer.counters().snapshot().completions, 0);
    // The store is back: the same key runs the handler at once (the lease was ended).
    racy.failing_begin.store(false, Ordering::Relaxed);
    let mut answered = None;
    for _ in 0..100 {
        let request = Request::post("/charges")
            .header("idempotency-key", "k")
            .body(axum::body::Body::from("x"))
            .unwrap();
        let response = router.call(request).await.unwrap();
        if response.status() != 409 {
            answered = Some(response.status());
            break;
        }
        // The lease ends in a task of its own, just after the answer.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(answered, Some(StatusCode::OK));
}
