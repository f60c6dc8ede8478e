//! The layer on MySQL or MariaDB, in time: latency one request at a time, and throughput with
//! 64 concurrent clients on distinct keys beside the floor, the same claim and completion
//! statements sent straight through the store with no HTTP and no layer.
//!
//! Every service is called in the process (no sockets), on a multi-thread runtime, with the
//! store's pool of 16 connections. Each figure is measured in several rounds; the spread is
//! the lowest and highest round.
//!
//! Run with `cargo bench -p safe-retry-server --all-features --bench mysql`; the server is
//! `SAFE_RETRY_MYSQL_URL` [mysql://root@127.0.0.1:3306/test], in a database of its own that the
//! bench drops at the end. `ROUNDS` [5] and `SECONDS` [3] change the run.

mod common;

use safe_retry_server::MySqlStore;

use common::{ChargesDb, timing};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = std::env::var("SAFE_RETRY_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let database = format!("srs_bench_{}", std::process::id());
    let admin = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("MySQL is unreachable at {url}: {e}; set SAFE_RETRY_MYSQL_URL"));
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .unwrap();
    let base = url.split('?').next().unwrap_or(&url);
    let base = base.rsplit_once('/').map_or(base, |(head, _)| head);
    let store = MySqlStore::connect(&format!("{base}/{database}"))
        .await
        .unwrap();
    store.prepare().await.unwrap();
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    timing::compare(store.clone(), &format!("MySQL {version}")).await;
    store.pool().close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {database}")))
        .execute(&admin)
        .await
        .unwrap();
}
