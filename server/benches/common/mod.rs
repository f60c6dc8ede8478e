//! What the server's benches share: the two services they compare, on either store, and a
//! driver that calls a service in the process (no sockets), so that only the layer differs.
#![allow(dead_code)]

use std::future::poll_fn;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use safe_retry_server::{Execution, IdempotencyLayer, Local};
use tower_service::Service;

#[path = "../../examples/support/charges_app.rs"]
mod charges_app;
#[cfg(feature = "postgres")]
pub mod pg_schema;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub mod timing;
pub use charges_app::ChargesDb;

/// The floor: the handler with its effect in a transaction of its own, no layer.
pub fn bare<S: Commit>(store: S) -> Router {
    async fn charge<S: Commit>(State(store): State<S>, body: String) -> Response {
        let mut tx = store.begin().await.expect("a transaction");
        let id = S::record_effect(&mut tx, "bare", &body)
            .await
            .expect("an effect");
        S::commit(tx).await;
        (StatusCode::CREATED, format!("{{\"effect_id\":{id}}}")).into_response()
    }
    Router::new()
        .route("/charges", post(charge::<S>))
        .with_state(store)
}

/// Commits a store's transaction, as the floor must (the layer commits its own).
pub trait Commit: ChargesDb {
    fn commit(tx: Self::Tx) -> impl std::future::Future<Output = ()> + Send;
}

impl Commit for safe_retry_server::SqliteStore {
    async fn commit(tx: Self::Tx) {
        tx.commit().await.expect("a commit");
    }
}

#[cfg(feature = "mysql")]
impl Commit for safe_retry_server::MySqlStore {
    async fn commit(tx: Self::Tx) {
        tx.commit().await.expect("a commit");
    }
}

#[cfg(feature = "postgres")]
impl Commit for safe_retry_server::PostgresStore {
    async fn commit(tx: Self::Tx) {
        tx.commit().await.expect("a commit");
    }
}

/// The same handler behind the layer: its effect in the transaction the layer completes in.
pub fn layered<S: ChargesDb>(store: S) -> Router {
    async fn charge<S: ChargesDb>(
        execution: Execution<S>,
        mut tx: Local<S>,
        body: String,
    ) -> Response {
        let id = S::record_effect(&mut tx, execution.key(), &body)
            .await
            .expect("an effect");
        (StatusCode::CREATED, format!("{{\"effect_id\":{id}}}")).into_response()
    }
    let layer = IdempotencyLayer::builder(store)
        .shared_scope()
        .build()
        .expect("the defaults build");
    Router::new()
        .route("/charges", post(charge::<S>))
        .layer(layer)
}

/// The baseline a user would write by hand for the same guarantee: the layer's claim and
/// completion statements in the handler itself, over the same axum stack. It reads the key,
/// fingerprints the request (SHA-256 of its method, path and body, so that a key reused for
/// another request is told apart), claims the key, writes its effect and the stored answer in one
/// transaction, and answers. What it leaves out is what the layer adds to those statements: its
/// admission and checks, the lease's renewal, the stored answer's headers taken from the
/// response, the events and counters, and every path but a new key's (a key seen before is
/// answered `409` here).
pub fn by_hand<S: ChargesDb>(store: S) -> Router {
    async fn charge<S: ChargesDb>(
        State(store): State<S>,
        headers: axum::http::HeaderMap,
        body: bytes::Bytes,
    ) -> Response {
        use safe_retry_server::store::{Claim, Completion, StoredAnswer};
        use sha2::{Digest, Sha256};
        let Some(key) = headers
            .get("idempotency-key")
            .and_then(|key| key.to_str().ok())
        else {
            return StatusCode::BAD_REQUEST.into_response();
        };
        let mut hash = Sha256::new();
        for part in [&b"POST"[..], b"/charges", &body] {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part);
        }
        let fingerprint: [u8; 32] = hash.finalize().into();
        let claim = Claim {
            scope: "",
            key,
            fingerprint: &fingerprint,
            lease: std::time::Duration::from_secs(30),
            retention: std::time::Duration::from_secs(86_400),
        };
        let claimed = match store.try_claim(&claim).await {
            Ok(Some(claimed)) => claimed,
            Ok(None) => return StatusCode::CONFLICT.into_response(),
            Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
        };
        let Ok(mut tx) = store.begin().await else {
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        };
        let body = std::str::from_utf8(&body).unwrap_or_default();
        let Ok(id) = S::record_effect(&mut tx, key, body).await else {
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        };
        let text = format!("{{\"effect_id\":{id}}}");
        let answer = StoredAnswer {
            status: StatusCode::CREATED,
            headers: vec![(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("text/plain; charset=utf-8"),
            )],
            body: Some(bytes::Bytes::from(text.clone())),
        };
        match store.complete(Some(tx), claimed.fence, &answer).await {
            Ok(Completion::Completed) => (StatusCode::CREATED, text).into_response(),
            _ => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        }
    }
    Router::new()
        .route("/charges", post(charge::<S>))
        .with_state(store)
}

/// One POST with key `key` (a 26-byte body), called on the service in the process.
pub async fn call(router: &mut Router, key: &str) -> StatusCode {
    let request = Request::post("/charges")
        .header("idempotency-key", key)
        .body(Body::from("{\"amount\":1000,\"cur\":\"EU\"}"))
        .unwrap();
    poll_fn(|cx| Service::<Request<Body>>::poll_ready(router, cx))
        .await
        .unwrap();
    let response = router.call(request).await.unwrap();
    let status = response.status();
    // Read the body, as a server writing it out would.
    let _ = axum::body::to_bytes(response.into_body(), usize::MAX).await;
    status
}
