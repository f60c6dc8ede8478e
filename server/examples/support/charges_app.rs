//! The charges service of `examples/charges.rs`, on either store. The server's tests use it
//! too, so that what the example shows is what they prove.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use safe_retry_server::{Execution, IdempotencyLayer, Store, StoreError};

/// One effect: a row the charge wrote, with the key it ran under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    pub id: i64,
    pub key: String,
    pub body: String,
}

/// What the service needs of its database beyond the outcome table: a table of effects.
pub trait ChargesDb: Store {
    /// Creates the effects table if it is missing; safe when several processes start on one new
    /// database at once.
    fn prepare(&self) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Writes one effect in the handler's transaction and returns its id.
    fn record_effect<'a>(
        tx: &'a mut Self::Tx,
        key: &'a str,
        body: &'a str,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;

    /// Every effect, in id order.
    fn effects(&self) -> impl Future<Output = Result<Vec<Effect>, sqlx::Error>> + Send;

    /// The outbox's rows: (id, status, deliveries).
    fn outbox(
        &self,
    ) -> impl Future<Output = Result<Vec<(String, String, i64)>, sqlx::Error>> + Send;

    /// The status and last recovery point of `key`'s record.
    fn record(
        &self,
        key: &str,
    ) -> impl Future<Output = Result<Option<(String, Option<String>)>, sqlx::Error>> + Send;
}

#[cfg(feature = "sqlite")]
impl ChargesDb for safe_retry_server::SqliteStore {
    async fn prepare(&self) -> Result<(), sqlx::Error> {
        // SQLite runs one writer at a time: `BEGIN IMMEDIATE` makes the processes take turns.
        let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS charge_effects
             (id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, body TEXT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }

    fn record_effect<'a>(
        tx: &'a mut Self::Tx,
        key: &'a str,
        body: &'a str,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a {
        sqlx::query_scalar("INSERT INTO charge_effects (key, body) VALUES (?1, ?2) RETURNING id")
            .bind(key)
            .bind(body)
            .fetch_one(&mut **tx)
    }

    async fn effects(&self) -> Result<Vec<Effect>, sqlx::Error> {
        let rows: Vec<(i64, String, String)> =
            sqlx::query_as("SELECT id, key, body FROM charge_effects ORDER BY id")
                .fetch_all(self.pool())
                .await?;
        Ok(rows
            .into_iter()
            .map(|(id, key, body)| Effect { id, key, body })
            .collect())
    }

    async fn outbox(&self) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
        sqlx::query_as("SELECT id, status, deliveries FROM safe_retry_outbox ORDER BY id")
            .fetch_all(self.pool())
            .await
    }

    async fn record(&self, key: &str) -> Result<Option<(String, Option<String>)>, sqlx::Error> {
        sqlx::query_as("SELECT status, step FROM safe_retry_outcomes WHERE key = ?1")
            .bind(key)
            .fetch_optional(self.pool())
            .await
    }
}

#[cfg(feature = "postgres")]
impl ChargesDb for safe_retry_server::PostgresStore {
    async fn prepare(&self) -> Result<(), sqlx::Error> {
        // Two `CREATE TABLE IF NOT EXISTS` at once can both find no table and both create it:
        // the second fails on the catalogue's unique index. An advisory lock (the bytes of
        // "charges!") makes the processes take turns; the second then finds the table.
        let mut tx = self.pool().begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(7163082351321641761)")
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS charge_effects
             (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, body TEXT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }

    fn record_effect<'a>(
        tx: &'a mut Self::Tx,
        key: &'a str,
        body: &'a str,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a {
        sqlx::query_scalar("INSERT INTO charge_effects (key, body) VALUES ($1, $2) RETURNING id")
            .bind(key)
            .bind(body)
            .fetch_one(&mut **tx)
    }

    async fn effects(&self) -> Result<Vec<Effect>, sqlx::Error> {
        let rows: Vec<(i64, String, String)> =
            sqlx::query_as("SELECT id, key, body FROM charge_effects ORDER BY id")
                .fetch_all(self.pool())
                .await?;
        Ok(rows
            .into_iter()
            .map(|(id, key, body)| Effect { id, key, body })
            .collect())
    }

    async fn outbox(&self) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
        sqlx::query_as("SELECT id, status, deliveries FROM safe_retry_outbox ORDER BY id")
            .fetch_all(self.pool())
            .await
    }

    async fn record(&self, key: &str) -> Result<Option<(String, Option<String>)>, sqlx::Error> {
        sqlx::query_as("SELECT status, step FROM safe_retry_outcomes WHERE key = $1")
            .bind(key)
            .fetch_optional(self.pool())
            .await
    }
}

#[cfg(feature = "mysql")]
impl ChargesDb for safe_retry_server::MySqlStore {
    async fn prepare(&self) -> Result<(), sqlx::Error> {
        // `CREATE TABLE IF NOT EXISTS` is one atomic statement on MySQL 8 and MariaDB: two
        // processes at once, and the second finds the table.
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS charge_effects
             (id BIGINT AUTO_INCREMENT PRIMARY KEY, `key` TEXT NOT NULL, body TEXT NOT NULL)",
        )
        .execute(self.pool())
        .await
        .map(|_| ())
    }

    async fn record_effect<'a>(
        tx: &'a mut Self::Tx,
        key: &'a str,
        body: &'a str,
    ) -> Result<i64, sqlx::Error> {
        let done = sqlx::query("INSERT INTO charge_effects (`key`, body) VALUES (?, ?)")
            .bind(key)
            .bind(body)
            .execute(&mut **tx)
            .await?;
        Ok(done.last_insert_id() as i64)
    }

    async fn effects(&self) -> Result<Vec<Effect>, sqlx::Error> {
        let rows: Vec<(i64, String, String)> =
            sqlx::query_as("SELECT id, `key`, body FROM charge_effects ORDER BY id")
                .fetch_all(self.pool())
                .await?;
        Ok(rows
            .into_iter()
            .map(|(id, key, body)| Effect { id, key, body })
            .collect())
    }

    async fn outbox(&self) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT CONVERT(id USING utf8mb4), status, deliveries FROM safe_retry_outbox ORDER BY id",
        )
        .fetch_all(self.pool())
        .await
    }

    async fn record(&self, key: &str) -> Result<Option<(String, Option<String>)>, sqlx::Error> {
        sqlx::query_as("SELECT status, step FROM safe_retry_outcomes WHERE `key` = ?")
            .bind(key.as_bytes())
            .fetch_optional(self.pool())
            .await
    }
}

/// The service: `POST /charges` behind the layer (a key required), `GET /effects`,
/// `GET /health`.
pub fn app<S: ChargesDb>(layer: IdempotencyLayer<S>, effect_delay: Duration) -> Router {
    let store = layer.store().clone();
    let charges = Router::new()
        .route("/charges", post(charge::<S>))
        .layer(layer)
        .with_state(effect_delay);
    Router::new()
        .route("/effects", get(effects::<S>))
        .route("/outbox", get(outbox::<S>))
        .route("/record", get(record::<S>))
        .route("/health", get(|| async { "ok" }))
        .with_state(store)
        .merge(charges)
}

/// Performs the charge: after the delay, one effect row, written in the transaction that
/// stores this answer.
async fn charge<S: ChargesDb>(
    State(delay): State<Duration>,
    Extension(execution): Extension<Execution<S>>,
    body: String,
) -> Response {
    tokio::time::sleep(delay).await;
    // The crate's own answers for a store that failed: `503` with a retry hint, never stored,
    // the lease ended at once, so the retry runs the charge.
    let mut tx = match execution.local().await {
        Ok(tx) => tx,
        Err(error) => return error.into_response(),
    };
    match S::record_effect(&mut tx, execution.key(), &body).await {
        Ok(id) => (
            StatusCode::CREATED,
            Json(serde_json::json!({ "effect_id": id })),
        )
            .into_response(),
        Err(error) => StoreError::from(error).into_response(),
    }
}

/// `GET /outbox`: the outbox's rows, `[{"id", "status", "deliveries"}]`.
async fn outbox<S: ChargesDb>(State(store): State<S>) -> Response {
    match store.outbox().await {
        Ok(rows) => Json(
            rows.into_iter()
                .map(|(id, status, deliveries)| {
                    serde_json::json!({ "id": id, "status": status, "deliveries": deliveries })
                })
                .collect::<Vec<_>>(),
        )
        .into_response(),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    }
}

/// `GET /record?key=K`: the record's `{"status", "step"}` (its last recovery point), or 404.
async fn record<S: ChargesDb>(
    State(store): State<S>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let key = query.get("key").map_or("", String::as_str);
    match store.record(key).await {
        Ok(Some((status, step))) => {
            Json(serde_json::json!({ "status": status, "step": step })).into_response()
        }
        Ok(None) => StatusCode::NOT_FOUND.into_response(),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    }
}

/// `GET /effects?q=TEXT&key=K`: the effects whose body contains TEXT and whose key is K.
async fn effects<S: ChargesDb>(
    State(store): State<S>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let all = match store.effects().await {
        Ok(all) => all,
        Err(error) => return (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    };
    let total = all.len();
    let matching: Vec<&Effect> = all
        .iter()
        .filter(|e| query.get("q").is_none_or(|q| e.body.contains(q.as_str())))
        .filter(|e| query.get("key").is_none_or(|k| &e.key == k))
        .collect();
    let mut by_key = BTreeMap::<&str, u64>::new();
    for effect in &matching {
        *by_key.entry(&effect.key).or_default() += 1;
    }
    Json(serde_json::json!({
        "total": total,
        "count": matching.len(),
        "by_key": by_key,
        "effects": matching
            .iter()
            .map(|e| serde_json::json!({ "id": e.id, "key": e.key, "body": e.body }))
            .collect::<Vec<_>>(),
    }))
    .into_response()
}
