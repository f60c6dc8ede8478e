//! The operator's view (feature `operator`): an axum router that shows the records a service
//! left parked, stalled or failed, and lets an operator retry or abandon them, as JSON and as a
//! small HTML page. Mount it behind your own authentication: it has none of its own.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use safe_retry_server::SqliteStore;
//! use safe_retry_server::operator::OperatorView;
//!
//! let store = SqliteStore::open("sqlite://orders.db").await?;
//! let ops = OperatorView::new(store.clone()).router();
//! let app = axum::Router::new().nest("/ops", ops); // behind your authentication
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! | route | what |
//! |---|---|
//! | `GET /` | the page: the tally, then the parked, stalled, failed and running records, each with its buttons |
//! | `GET /api/tally` | `{"running":…,"stalled":…,"parked":…,"failed":…,"completed":…}` |
//! | `GET /api/records?standing=parked&limit=100` | `{"records":[…]}`, oldest first |
//! | `GET /api/record?scope=…&key=…` | one record, or `404` |
//! | `POST /api/retry?scope=…&key=…` | `{"retried":true}`; `409` when it is running or has ended |
//! | `POST /api/abandon?scope=…&key=…` with `{"reason":"…"}` | `{"abandoned":true}`; `409` when it is running or completed; `400` without a reason |
//!
//! A record's JSON never carries a saved request's headers or body, nor a stored answer's
//! body: only the saved request's method and target, and the answer's status.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

mod page;

use crate::problem::Problem;
use crate::store::{Operations, RecordView, Standing, StoreError, StoredAnswer, Tally};

type Nudge = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The operator's view of a store: build it, then mount its [`router`](OperatorView::router).
pub struct OperatorView<S> {
    store: S,
    nudge: Option<Nudge>,
    failed_retention: Duration,
    limit: u32,
}

impl<S> Clone for OperatorView<S>
where
    S: Clone,
{
    fn clone(&self) -> Self {
        OperatorView {
            store: self.store.clone(),
            nudge: self.nudge.clone(),
            failed_retention: self.failed_retention,
            limit: self.limit,
        }
    }
}

impl<S> std::fmt::Debug for OperatorView<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperatorView")
            .field("failed_retention", &self.failed_retention)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl<S> OperatorView<S>
where
    S: Operations + Clone + Send + Sync + 'static,
{
    /// The view of `store`: records abandoned here are kept failed for 7 days, and the page
    /// lists up to 100 records of each standing.
    pub fn new(store: S) -> Self {
        OperatorView {
            store,
            nudge: None,
            failed_retention: Duration::from_secs(7 * 24 * 60 * 60),
            limit: 100,
        }
    }

    /// What a retry does after it made the record due: typically one tick of the service's
    /// [`Reconciler`](crate::Reconciler), so that the record is finished before the answer
    /// (`move || { let r = reconciler.clone(); async move { let _ = r.tick().await; } }`).
    /// Without it the record waits for the reconciler's next tick or the client's retry.
    pub fn on_retry<F, Fut>(mut self, nudge: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.nudge = Some(Arc::new(move || Box::pin(nudge())));
        self
    }

    /// How long a record abandoned here is kept failed, answering its key's requests with its
    /// reason [7 days]: keep it as the layer's `failed_retention`.
    pub fn failed_retention(mut self, retention: Duration) -> Self {
        self.failed_retention = retention;
        self
    }

    /// How many records of each standing the page and `api/records` list at most \[100\].
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = limit.max(1);
        self
    }

    /// How many records stand where, each also set as the gauge
    /// `safe_retry_server_records{standing="parked"}` (and `running`, `stalled`, `failed`,
    /// `completed`) with the `metrics` feature. It counts the whole table: call it every few
    /// seconds at most.
    pub async fn tally(&self) -> Result<Tally, StoreError> {
        let tally = self.store.tally().await?;
        #[cfg(feature = "metrics")]
        for standing in Standing::ALL {
            metrics::gauge!("safe_retry_server_records", "standing" => standing.name())
                .set(tally.of(standing) as f64);
        }
        Ok(tally)
    }

    /// The router: the page at `/`, the JSON API under `/api`. Nest it under a path of your
    /// choice, behind your authentication.
    pub fn router(self) -> Router {
        Router::new()
            .route("/", get(page::page::<S>))
            .route("/retry", post(page::retry_form::<S>))
            .route("/abandon", post(page::abandon_form::<S>))
            .route("/api/tally", get(tally_json::<S>))
            .route("/api/records", get(records_json::<S>))
            .route("/api/record", get(one_json::<S>))
            .route("/api/retry", post(retry_json::<S>))
            .route("/api/abandon", post(abandon_json::<S>))
            .with_state(self)
    }

    /// Makes the record due and nudges the reconciler: `Ok(None)` when there is no record.
    async fn retry(&self, scope: &str, key: &str) -> Result<Option<bool>, StoreError> {
        if self.store.inspect(scope, key).await?.is_none() {
            return Ok(None);
        }
        let retried = self.store.retry_now(scope, key).await?;
        if retried && let Some(nudge) = &self.nudge {
            nudge().await;
        }
        Ok(Some(retried))
    }

    /// Ends the record failed with the operator's reason: `Ok(None)` when there is no record.
    async fn abandon(
        &self,
        scope: &str,
        key: &str,
        reason: &str,
    ) -> Result<Option<bool>, StoreError> {
        if self.store.inspect(scope, key).await?.is_none() {
            return Ok(None);
        }
        let detail = format!("an operator abandoned this request: {reason}");
        let answer = Problem::GaveUp.response(&detail);
        let stored = StoredAnswer {
            status: answer.status(),
            headers: vec![(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            )],
            body: Some(answer.into_body()),
        };
        self.store
            .abandon_record(scope, key, reason, &stored, self.failed_retention)
            .await
            .map(Some)
    }
}

type Params = Query<HashMap<String, String>>;

/// The scope (empty when absent: the shared scope) and the key of a request's parameters.
fn named(params: &HashMap<String, String>) -> Option<(&str, &str)> {
    let scope = params.get("scope").map_or("", String::as_str);
    match params.get("key") {
        Some(key) if !key.is_empty() => Some((scope, key)),
        _ => None,
    }
}

/// The answer to a request that names no record.
fn unnamed() -> Response {
    problem(StatusCode::BAD_REQUEST, "name the record: ?key=…&scope=…")
}

fn problem(status: StatusCode, detail: &str) -> Response {
    (status, Json(json!({ "error": detail }))).into_response()
}

fn failed(error: &StoreError) -> Response {
    tracing::warn!(error = %error, "the operator's view could not read the store");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "the outcome store could not be reached",
    )
}

/// A record as JSON.
pub fn record_json(record: &RecordView) -> Value {
    json!({
        "scope": record.scope,
        "key": record.key,
        "standing": record.standing.name(),
        "step": record.step,
        "steps": record.steps.as_deref().map(|s| serde_json::from_str::<Value>(s).unwrap_or(Value::String(s.to_owned()))),
        "request": record.request.as_ref().map(|(method, target)| json!({"method": method, "target": target})),
        "attempt": record.attempt,
        "starts": record.starts,
        "created_at": page::time_of(record.created_at_ms),
        "expires_at": page::time_of(record.expires_at_ms),
        "lease_ends_at": record.lease_ends_ms.map(page::time_of),
        "answer_status": record.answer_status,
        "note": record.note,
    })
}

fn tally_of(tally: &Tally) -> Value {
    let mut out = serde_json::Map::new();
    for standing in Standing::ALL {
        out.insert(standing.name().into(), tally.of(standing).into());
    }
    Value::Object(out)
}

async fn tally_json<S>(State(view): State<OperatorView<S>>) -> Response
where
    S: Operations + Clone + Send + Sync + 'static,
{
    match view.tally().await {
        Ok(tally) => Json(tally_of(&tally)).into_response(),
        Err(error) => failed(&error),
    }
}

async fn records_json<S>(State(view): State<OperatorView<S>>, Query(params): Params) -> Response
where
    S: Operations + Clone + Send + Sync + 'static,
{
    let name = params.get("standing").map_or("parked", String::as_str);
    let Some(standing) = Standing::of_name(name) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "standing is one of running, stalled, parked, failed, completed",
        );
    };
    let limit = match params.get("limit").map(|l| l.parse::<u32>()) {
        None => view.limit,
        Some(Ok(limit)) => limit.clamp(1, 1000),
        Some(Err(_)) => return problem(StatusCode::BAD_REQUEST, "limit is a number, 1 to 1000"),
    };
    match view.store.records(standing, limit).await {
        Ok(records) => {
            Json(json!({ "records": records.iter().map(record_json).collect::<Vec<_>>() }))
                .into_response()
        }
        Err(error) => failed(&error),
    }
}

async fn one_json<S>(State(view): State<OperatorView<S>>, Query(params): Params) -> Response
where
    S: Operations + Clone + Send + Sync + 'static,
{
    let Some((scope, key)) = named(&params) else {
        return unnamed();
    };
    match view.store.inspect(scope, key).await {
        Ok(Some(record)) => Json(record_json(&record)).into_response(),
        Ok(None) => problem(StatusCode::NOT_FOUND, "no record has this scope and key"),
        Err(error) => failed(&error),
    }
}

async fn retry_json<S>(State(view): State<OperatorView<S>>, Query(params): Params) -> Response
where
    S: Operations + Clone + Send + Sync + 'static,
{
    let Some((scope, key)) = named(&params) else {
        return unnamed();
    };
    match view.retry(scope, key).await {
        Ok(Some(true)) => Json(json!({ "retried": true })).into_response(),
        Ok(Some(false)) => (
            StatusCode::CONFLICT,
            Json(json!({ "retried": false, "error": "only a stalled or parked record is retried: this one is running or has ended" })),
        )
            .into_response(),
        Ok(None) => problem(StatusCode::NOT_FOUND, "no record has this scope and key"),
        Err(error) => failed(&error),
    }
}

async fn abandon_json<S>(
    State(view): State<OperatorView<S>>,
    Query(params): Params,
    body: Option<Json<Value>>,
) -> Response
where
    S: Operations + Clone + Send + Sync + 'static,
{
    let Some((scope, key)) = named(&params) else {
        return unnamed();
    };
    let reason = body
        .as_ref()
        .and_then(|Json(body)| body.get("reason")?.as_str())
        .map(str::trim)
        .unwrap_or_default();
    if reason.is_empty() {
        return problem(StatusCode::BAD_REQUEST, "say why: {\"reason\":\"…\"}");
    }
    match view.abandon(scope, key, reason).await {
        Ok(Some(true)) => Json(json!({ "abandoned": true })).into_response(),
        Ok(Some(false)) => (
            StatusCode::CONFLICT,
            Json(json!({ "abandoned": false, "error": "a running or completed record is not abandoned" })),
        )
            .into_response(),
        Ok(None) => problem(StatusCode::NOT_FOUND, "no record has this scope and key"),
        Err(error) => failed(&error),
    }
}
