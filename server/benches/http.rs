//! The layer over HTTP beside the baseline a user would write by hand for the same guarantee:
//! the layer's claim and completion statements in an axum handler of its own
//! ([`common::by_hand`]), and the handler with no guarantee at all, all three on the same
//! server stack (axum over hyper on 127.0.0.1), on SQLite and on PostgreSQL.
//!
//! 64 clients (one reqwest client, a connection each) send the same 26-byte POST with a new key
//! each time, for `SECONDS` a round; every round runs the three services in turn, the one that
//! goes first rotating, so that the machine's drift falls on each alike. The ratio of the layer
//! to the baseline is taken per round; each figure is the mean over rounds [lowest, highest].
//! Client and server share the process and its two worker threads, as on a 2-core machine the
//! load generator and the service share the cores.
//!
//! Run with `cargo bench -p safe-retry-server --all-features --bench http`; `ROUNDS` [7] and
//! `SECONDS` [3] change the run. PostgreSQL is `SAFE_RETRY_POSTGRES_URL`
//! [postgres://postgres@127.0.0.1:5432/test], in a schema of its own the bench drops at the end;
//! SQLite is a new file in the system's temporary directory.

mod common;

use std::net::SocketAddr;

use axum::Router;
use safe_retry_server::{PostgresStore, SqliteStore};

use common::{Commit, timing};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (rounds, seconds) = (timing::env("ROUNDS", 7), timing::env("SECONDS", 3));
    println!("over HTTP, 64 clients on new keys, {rounds} rounds of {seconds} s");

    let dir = std::env::temp_dir().join(format!("safe-retry-http-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sqlite = SqliteStore::open(&format!("sqlite://{}", dir.join("bench.db").display()))
        .await
        .unwrap();
    common::ChargesDb::prepare(&sqlite).await.unwrap();
    compare("SQLite, one file", sqlite.clone(), rounds, seconds).await;
    sqlite.pool().close().await;
    std::fs::remove_dir_all(&dir).unwrap();

    let schema = common::pg_schema::PgSchema::create("http_bench").await;
    let postgres = PostgresStore::from_pool(schema.pool.clone());
    postgres.migrate().await.unwrap();
    common::ChargesDb::prepare(&postgres).await.unwrap();
    compare("PostgreSQL, pool of 16", postgres.clone(), rounds, seconds).await;
    schema.drop().await;
}

/// Serves `router` on a new port of 127.0.0.1.
async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    address
}

/// Runs the three services on `store` round after round and prints their table.
async fn compare<S: Commit>(name: &str, store: S, rounds: u64, seconds: u64) {
    let services = [
        (
            "(a) the handler alone, no guarantee",
            common::bare(store.clone()),
        ),
        (
            "(c) the statements by hand (baseline)",
            common::by_hand(store.clone()),
        ),
        ("(b) the handler behind the layer", common::layered(store)),
    ];
    let mut urls = Vec::new();
    for (_, router) in &services {
        urls.push(format!("http://{}/charges", serve(router.clone()).await));
    }
    let client = reqwest::Client::new();
    let (mut rates, mut p99s) = (vec![Vec::new(); 3], vec![Vec::new(); 3]);
    for round in 0..rounds as usize {
        for turn in 0..3 {
            let service = (round + turn) % 3;
            let (client, url) = (client.clone(), urls[service].clone());
            let (rate, p99) = timing::throughput(1, seconds, move |key: String| {
                let (client, url) = (client.clone(), url.clone());
                async move {
                    let response = client
                        .post(&url)
                        .header("idempotency-key", key)
                        .body("{\"amount\":1000,\"cur\":\"EU\"}")
                        .send()
                        .await
                        .expect("an answer");
                    let created = response.status() == reqwest::StatusCode::CREATED;
                    // Read the body, so that the connection serves the next request.
                    let _ = response.bytes().await;
                    created
                }
            })
            .await;
            rates[service].push(rate[0]);
            p99s[service].push(p99[0]);
        }
    }
    let ratios: Vec<f64> = rates[2].iter().zip(&rates[1]).map(|(b, c)| b / c).collect();
    println!("\n{name}");
    println!("{:<40} {:>24} {:>18}", "service", "requests/s", "p99 (ms)");
    for ((service, _), (rates, p99s)) in services.iter().zip(rates.iter().zip(&p99s)) {
        println!(
            "{service:<40} {:>24} {:>18}",
            timing::spread(rates),
            timing::spread(p99s)
        );
    }
    let low = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
    let high = ratios.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    println!(
        "(b) / (c), per round: {:.3} [{low:.3}, {high:.3}]",
        timing::mean(&ratios)
    );
}
