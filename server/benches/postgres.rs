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

use safe_retry_server::PostgresStore;

use common::{ChargesDb, timing};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let schema = common::pg_schema::PgSchema::create("bench").await;
    let store = PostgresStore::from_pool(schema.pool.clone());
    store.migrate().await.unwrap();
    store.prepare().await.unwrap();
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(store.pool())
        .await
        .unwrap();
    timing::compare(store.clone(), &format!("PostgreSQL {version}")).await;

    schema.drop().await;
}
