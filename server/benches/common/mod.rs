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
