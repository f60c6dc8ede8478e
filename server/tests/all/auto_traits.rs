//! What the public types promise about threads: a type that stops being `Send`, `Sync` or
//! `Unpin` breaks the code of every user that relies on it (cargo-semver-checks reports it
//! against a release; this test reports it on the change that does it).

use safe_retry_server::*;

/// Sent between threads, shared by reference, and moved freely.
fn everywhere<T: Send + Sync + Unpin>() {}

#[test]
fn the_public_types_are_send_sync_and_unpin() {
    everywhere::<SqliteStore>();
    everywhere::<SqliteBuilder>();
    everywhere::<IdempotencyLayer<SqliteStore>>();
    everywhere::<Builder<SqliteStore>>();
    everywhere::<Execution<SqliteStore>>();
    everywhere::<Local<SqliteStore>>();
    // Over a handler service that is (axum's router).
    everywhere::<Reconciler<axum::Router, SqliteStore>>();
    everywhere::<Sweeper<SqliteStore>>();
    everywhere::<Relay<SqliteStore>>();
    everywhere::<Counters>();
    everywhere::<CounterSnapshot>();
    everywhere::<ConfigError>();
    everywhere::<StoreError>();
    everywhere::<LocalError>();
    everywhere::<StepError>();
    everywhere::<Problem>();
    everywhere::<Fingerprint>();
    everywhere::<Message>();
    everywhere::<ReconcileReport>();
    everywhere::<RelayReport>();
    everywhere::<SweepReport>();
    // Over a body that is (axum's own is not `Sync`).
    everywhere::<ReplyBody<http_body_util::Full<bytes::Bytes>>>();
    everywhere::<Event>();
    everywhere::<KeyForm>();
}

#[cfg(feature = "postgres")]
#[test]
fn the_postgres_store_is_send_sync_and_unpin() {
    everywhere::<PostgresStore>();
    everywhere::<IdempotencyLayer<PostgresStore>>();
}

#[cfg(feature = "mysql")]
#[test]
fn the_mysql_store_is_send_sync_and_unpin() {
    everywhere::<MySqlStore>();
    everywhere::<MySqlBuilder>();
    everywhere::<IdempotencyLayer<MySqlStore>>();
}
