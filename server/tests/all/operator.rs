//! The operator's view on every store, without a browser: records parked by a handler that
//! stopped after a step, listed and counted, retried (the reconciler finishing them), and
//! abandoned with a reason that every later request with the key is told; no saved secret in
//! any answer; bad requests answered by name.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Extension;
use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use safe_retry_server::operator::OperatorView;
use safe_retry_server::store::Operations;
use safe_retry_server::{Execution, IdempotencyLayer, Step, StepError};
use serde_json::Value;
use tower_service::Service;

use crate::support::Backend;

/// A handler that commits its step, then stops (`503 step-unfinished`) while `stop` is set,
/// and answers `201` once it is not.
async fn order<S: Backend>(
    Extension(execution): Extension<Execution<S>>,
    Extension(stop): Extension<Arc<AtomicBool>>,
) -> Result<(StatusCode, &'static str), StepError> {
    if let Step::Todo(step) = execution.step::<u32>("charge").await? {
        step.commit(42).await?;
    }
    if stop.load(Ordering::SeqCst) {
        return Err(StepError::Misuse("stopped after its charge"));
    }
    Ok((StatusCode::CREATED, "{\"order\":\"done\"}"))
}

async fn call(router: &mut axum::Router, request: Request<Body>) -> (StatusCode, Vec<u8>) {
    let answer = Service::call(router, request).await.unwrap();
    let status = answer.status();
    (
        status,
        answer
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
}

async fn json(
    router: &mut axum::Router,
    method: &str,
    uri: &str,
    body: &str,
) -> (StatusCode, Value) {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let (status, bytes) = call(router, request).await;
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn place(app: &mut axum::Router, key: &str) -> (StatusCode, String) {
    let request = Request::post("/orders?coupon=none")
        .header("idempotency-key", key)
        .header("authorization", "Bearer secret-token-77")
        .body(Body::from("card=4242424242424242"))
        .unwrap();
    let (status, body) = call(app, request).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

pub async fn the_operator_sees_parked_records_retries_and_abandons_them<S>()
where
    S: Backend + Operations,
{
    let store = S::fresh().await;
    let stop = Arc::new(AtomicBool::new(true));
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .build()
        .unwrap();
    let mut app = axum::Router::new()
        .route("/orders", axum::routing::post(order::<S>))
        .layer(layer.clone())
        .layer(Extension(stop.clone()));
    let reconciler = Arc::new(layer.reconciler(app.clone()));
    let mut ops = axum::Router::new().nest(
        "/ops",
        OperatorView::new(store.clone())
            .on_retry(move || {
                let reconciler = reconciler.clone();
                async move {
                    let _ = reconciler.tick().await;
                }
            })
            .router(),
    );

    for key in ["order-1", "order-2"] {
        assert_eq!(
            place(&mut app, key).await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    let (status, tally) = json(&mut ops, "GET", "/ops/api/tally", "").await;
    assert_eq!(status, 200);
    assert_eq!(tally["parked"], 2, "{tally}");
    assert_eq!(tally["completed"], 0, "{tally}");

    let (status, listed) = json(&mut ops, "GET", "/ops/api/records?standing=parked", "").await;
    assert_eq!(status, 200);
    let records = listed["records"].as_array().unwrap();
    assert_eq!(records.len(), 2);
    let first = &records[0];
    assert_eq!(first["key"], "order-1");
    assert_eq!(first["standing"], "parked");
    assert_eq!(first["step"], "charge:done");
    assert_eq!(first["steps"]["charge"], 42);
    assert_eq!(first["request"]["method"], "POST");
    assert_eq!(first["request"]["target"], "/orders?coupon=none");
    assert_eq!(first["starts"], 1);
    assert!(
        first["created_at"].as_str().unwrap().ends_with('Z'),
        "{first}"
    );
    let text = listed.to_string();
    assert!(
        !text.contains("secret-token"),
        "a saved header shown: {text}"
    );
    assert!(!text.contains("4242"), "a saved body shown: {text}");

    // Abandoned, with a reason every later request with the key is told.
    let (status, _) = json(&mut ops, "POST", "/ops/api/abandon?key=order-2", "{}").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "no reason");
    let reason = "{\"reason\":\"refunded by hand, ticket 7\"}";
    let (status, abandoned) = json(&mut ops, "POST", "/ops/api/abandon?key=order-2", reason).await;
    assert_eq!(
        (status, &abandoned),
        (StatusCode::OK, &serde_json::json!({"abandoned": true}))
    );
    let (_, two) = json(&mut ops, "GET", "/ops/api/record?key=order-2", "").await;
    assert_eq!(two["standing"], "failed");
    assert_eq!(two["note"], "refunded by hand, ticket 7");
    assert_eq!(two["steps"]["charge"], 42, "its recovery points kept");
    let (status, body) = place(&mut app, "order-2").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(body.contains("refunded by hand, ticket 7"), "{body}");
    assert!(body.contains("urn:safe-retry:problem:gave-up"), "{body}");
    // Retried: made due and finished by the reconciler's tick (which finishes whatever else
    // is due too) before the answer.
    stop.store(false, Ordering::SeqCst);
    let (status, retried) = json(&mut ops, "POST", "/ops/api/retry?key=order-1", "").await;
    assert_eq!(
        (status, &retried),
        (StatusCode::OK, &serde_json::json!({"retried": true}))
    );
    let (_, one) = json(&mut ops, "GET", "/ops/api/record?key=order-1", "").await;
    assert_eq!(one["standing"], "completed", "{one}");
    assert_eq!(one["answer_status"], 201);
    let (status, body) = place(&mut app, "order-1").await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::CREATED, "{\"order\":\"done\"}")
    );
    let (status, again) = json(&mut ops, "POST", "/ops/api/retry?key=order-1", "").await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a completed record is not retried: {again}"
    );

    let (status, _) = json(&mut ops, "POST", "/ops/api/abandon?key=order-1", reason).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a completed record is not abandoned"
    );

    let (_, tally) = json(&mut ops, "GET", "/ops/api/tally", "").await;
    assert_eq!(
        (
            tally["parked"].as_u64(),
            tally["failed"].as_u64(),
            tally["completed"].as_u64()
        ),
        (Some(0), Some(1), Some(1))
    );

    // Named mistakes.
    let (status, _) = json(&mut ops, "GET", "/ops/api/record?key=nobody", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = json(&mut ops, "POST", "/ops/api/retry?key=nobody", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = json(&mut ops, "GET", "/ops/api/record", "").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = json(&mut ops, "GET", "/ops/api/records?standing=lost", "").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = json(&mut ops, "GET", "/ops/api/records?limit=many", "").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // The page: escaped text, the failed record with its note, its buttons' forms.
    stop.store(true, Ordering::SeqCst);
    for key in ["<b>x</b>", "order-3"] {
        assert_eq!(
            place(&mut app, key).await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    let (status, page) = call(&mut ops, Request::get("/ops").body(Body::empty()).unwrap()).await;
    assert_eq!(status, 200);
    let page = String::from_utf8(page).unwrap();
    assert!(
        page.contains("<span id=\"tally-parked\">parked: <b>2</b></span>"),
        "{page}"
    );
    assert!(page.contains("<code>&lt;b&gt;x&lt;/b&gt;</code>"), "{page}");
    assert!(page.contains("refunded by hand, ticket 7"));
    assert!(page.contains("action=\"/ops/retry\""), "{page}");
    assert!(!page.contains("<b>x</b>") && !page.contains("secret-token"));
    let form = Request::post("/ops/retry")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from("scope=&key=order-3"))
        .unwrap();
    let answer = Service::call(&mut ops, form).await.unwrap();
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(answer.headers()["location"], "/ops");
    assert_eq!(
        store.inspect("", "order-3").await.unwrap().unwrap().starts,
        1,
        "due again, its starts counted afresh, stopped again by the handler"
    );
}

on_every_store!(the_operator_sees_parked_records_retries_and_abandons_them);
