//! The layer on PostgreSQL, in time: latency one request at a time, and throughput with 64
//! concurrent clients on distinct keys beside the floor, the same claim and completion
//! statements sent straight through the store with no HTTP and no layer (a pgbench-style loop).
//!
//! Every service is called in the process (no sockets), on a multi-thread runtime, with the
//! store's pool of 16 connections. Each figure is measured in several rounds; the spread is
//! the lowest and highest round.
//!
//! Run with `cargo bench -p safe-retry-server --all-features --bench postgres`; the database is
//! `SAFE_RETRY_POSTGRES_URL` [postgres://postgres@127.0.0.1:5432/test], in a schema of its own
//! that the bench drops at the end. `ROUNDS` [5] and `SECONDS` [3] change the run.

mod common;

use std::str::FromStr;

use safe_retry_server::PostgresStore;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use common::{ChargesDb, timing};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = std::env::var("SAFE_RETRY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("srs_bench_{}", std::process::id());
    let options = PgConnectOptions::from_str(&url).unwrap();
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
        .unwrap_or_else(|e| {
            panic!("PostgreSQL is unreachable at {url}: {e}; set SAFE_RETRY_POSTGRES_URL")
        });
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await
        .unwrap();
    let store = PostgresStore::from_pool(pool);
    store.migrate().await.unwrap();
    store.prepare().await.unwrap();
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(store.pool())
        .await
        .unwrap();
    timing::compare(store.clone(), &format!("PostgreSQL {version}")).await;

    store.pool().close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}
